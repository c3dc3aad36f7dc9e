"""Where the ranks sit: nodes of ``G`` consecutive ranks (rank ``r`` on node ``r // G``, local rank
``r % G``), declared by ``$HOROVOD_ALQ_LOCAL_SIZE`` or taken from the launcher. Every transport's
``local_size`` comes from :func:`resolve_local_size`; the node-aware exchanges read it through
:func:`local_size`."""

from __future__ import annotations

import os

from ..core.protocol import PREFIX
from .interfaces import Transport

#: The environment variable that declares nodes of that many consecutive ranks.
LOCAL_SIZE_ENV = "HOROVOD_ALQ_LOCAL_SIZE"


def local_size_from_env(size: int) -> int | None:
    """``$HOROVOD_ALQ_LOCAL_SIZE`` when set (checked to divide ``size``), else None."""
    raw = os.environ.get(LOCAL_SIZE_ENV)
    if raw is None or raw == "":
        return None
    try:
        g = int(raw)
    except ValueError:
        raise ValueError(f"{LOCAL_SIZE_ENV} must be a whole number of ranks per node, got {raw!r}") from None
    if g < 1 or size % g:
        raise ValueError(f"{LOCAL_SIZE_ENV}={g} does not divide the {size} ranks into nodes of equal size")
    return g


def resolve_local_size(size: int, rank: int, launcher: tuple[int, int] | None) -> int:
    """The ranks per node of a group of ``size``: ``$HOROVOD_ALQ_LOCAL_SIZE`` when set, else the
    launcher's ``(local size, local rank)`` when its nodes are runs of consecutive ranks of that size
    (this rank's local rank is its place in its run), else ``size`` (one node). What every
    transport's ``local_size`` is."""
    declared = local_size_from_env(size)
    if declared is not None:
        return declared
    if launcher is None:
        return size
    g, local = launcher
    return g if 0 < g <= size and size % g == 0 and local == rank % g else size


def local_size(transport: Transport) -> int:
    """The ranks per node of ``transport`` (its ``local_size``; all ranks one node when it has none)."""
    g = int(getattr(transport, "local_size", 0) or transport.size)
    if g < 1 or transport.size % g:
        raise ValueError(f"{PREFIX}: {g} ranks per node do not divide the {transport.size} ranks")
    return g
