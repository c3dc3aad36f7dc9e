"""The round handshake: one small MAX allreduce of ``[v, -v]`` before any payload moves, from which
every rank learns the maximum and minimum of each field (settings, levels, round, layout) and
raises alike when the ranks differ (docs/design/design.md, "Handshake")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from .entropy import WIRES
from .protocol import EXCHANGE_NAMES, PREFIX, ProtocolError

#: Settings every rank must share, in the order the handshake checks them (a fused round's also
#: ``pipeline``: coordinates per chunk of its pipelined buffers, 0 where its codec cannot cut them).
#: ``budget``: ``bit_budget`` in thousandths of a bit with ``bits="auto"`` (``bits`` is then 0), else 0.
#: ``local_size``: ranks per node (nodes are runs of consecutive ranks; the hierarchical exchange's groups).
#: ``precondition``: a digest of the round's preconditioning scales (:mod:`.precondition`; 0: off).
SETTINGS = (
    "method",
    "bits",
    "budget",
    "bucket_size",
    "norm",
    "exchange",
    "fusion_bytes",
    "bits_second",
    "adapt_second",
    "local_size",
    "wire",
    "error_feedback",
    "compress",
    "precondition",
)
HANDSHAKE_FIELDS = (
    "error",
    *SETTINGS,
    "levels",
    "allocation",
    "round",
    "collecting",
    "tensors",
    "elements",
    "contents",
    "order",
    "early",
    "early_ok",
    "pipeline",
)
#: The handshake of a streamed round (the DDP hook, mpi4py): before its tensors are known, so instead
#: of their layout the threshold that decides which of them are quantized (the framework guarantees
#: the same tensors, in the same order, on every rank), and where the front-end knows them in
#: advance (mpi4py; 0 where it does not) the elements the round will hold and ``order``, a hash of
#: its tensors in order.
STREAM_FIELDS = ("error", *SETTINGS, "levels", "allocation", "round", "collecting", "min_size", "elements", "order")
#: The handshakes of a refit outside any round (:meth:`horovod_alq.exchange.Engine.refit`);
#: ``recorded``: a hash of the tensors whose ``bits="auto"`` rows the refit combines (0: none, or fixed bits).
REFIT_FIELDS = ("error", *SETTINGS, "levels", "allocation", "round", "collecting", "recorded")


def handshake_vector(*, fields: Sequence[str] = HANDSHAKE_FIELDS, **values: int) -> np.ndarray:
    """The int64 vector ``[v, -v]`` of the handshake ``fields`` (each value in ``[0, 2**62)``):
    reduced with MAX it gives every rank the maximum and (negated) the minimum of each field."""
    vec = np.array([int(values[name]) for name in fields], dtype=np.int64)
    if (vec < 0).any() or (vec >= 1 << 62).any():
        raise ValueError(f"handshake fields must lie in [0, 2**62): {values}")
    return np.concatenate([vec, -vec])


@dataclass(frozen=True)
class Agreement:
    """The outcome of a handshake: ``ordered`` if every rank laid its round out identically (the
    fast path); otherwise the ranks hold the same tensors in different orders."""

    ordered: bool


def handshake_range(
    reduced_max: np.ndarray, field: str, *, fields: Sequence[str] = HANDSHAKE_FIELDS
) -> tuple[int, int]:
    """The minimum and maximum over the ranks of one handshake field (read before any check, for
    what every rank must do whatever the checks find: the buffers some rank started early)."""
    r = np.asarray(reduced_max, dtype=np.int64)
    k = list(fields).index(field)
    return int(-r[len(fields) + k]), int(r[k])


def read_handshake(
    reduced_max: np.ndarray, local_error: str | None = None, *, fields: Sequence[str] = HANDSHAKE_FIELDS
) -> Agreement:
    """Check the MAX-reduced ``[v, -v]`` handshake of ``fields``; raise :class:`ProtocolError` on
    every rank if the ranks may not exchange payloads this round."""
    r = np.asarray(reduced_max, dtype=np.int64)
    fields = tuple(fields)
    k = len(fields)
    hi = dict(zip(fields, r[:k].tolist()))
    lo = dict(zip(fields, (-r[k:]).tolist()))
    if hi["error"]:
        mine = f" This rank: {local_error}" if local_error else " (see the failing rank's error)"
        raise ProtocolError(
            f"{PREFIX}: a rank failed before the payload exchange of this round; "
            f"refusing to exchange on every rank.{mine}"
        )
    differ = [f for f in (*SETTINGS, "levels", "allocation", "round", "collecting") if hi[f] != lo[f]]
    if differ:
        meaning = {
            "levels": "levels differ (fingerprints",
            "allocation": "bit allocations of bits='auto' (hashes",
            "budget": "bit_budget (thousandths of a bit:",
            "local_size": "node layouts (ranks per node:",
            "error_feedback": "error_feedback (1: on, 0: off:",
            "round": "round numbers (a previous exchange failed on some ranks only:",
            "collecting": "refit schedules (update_steps / update_every:",
            "precondition": "preconditioning scales (digests of w, 0: off; the optimizer states differ, "
            "e.g. a checkpoint loaded on some ranks only:",
            "compress": "compress modes (0: 'always', 1: 'when-faster':",
        }
        named = {
            "norm": ("l2", "linf"),
            "wire": WIRES,
            "exchange": EXCHANGE_NAMES,
        }

        def show(f, v):
            names = dict(enumerate(named[f])) if isinstance(named.get(f), tuple) else named.get(f, {})
            return names.get(v, v)

        detail = "; ".join(
            f"{meaning.get(f, f)} {show(f, lo[f])} on some ranks, {show(f, hi[f])} on others"
            + (")" if f in meaning else "")
            for f in differ
        )
        raise ProtocolError(
            f"{PREFIX}: the ranks differ in {detail}. Every rank must build the compressor "
            f"with the same arguments and load the same state"
        )
    if "pipeline" in hi and hi["pipeline"] != lo["pipeline"]:
        raise ProtocolError(
            f"{PREFIX}: the ranks cut large buffers into different chunks (pipeline_bytes / 4: "
            f"{lo['pipeline']} on some ranks, {hi['pipeline']} on others; 0 also where the codec cannot "
            f"encode ranges, e.g. a rank without the compiled CPU codec): every rank must use the same "
            f"pipeline_bytes ($HOROVOD_ALQ_PIPELINE_BYTES) and codec"
        )
    if "min_size" in hi and hi["min_size"] != lo["min_size"]:
        raise ProtocolError(
            f"{PREFIX}: the ranks quantize different tensors (min_size {lo['min_size']} on some ranks, "
            f"{hi['min_size']} on others): every rank must build the hook's state with the same arguments"
        )
    if "tensors" not in hi:
        if "elements" in hi and hi["elements"] != lo["elements"]:
            raise ProtocolError(
                f"{PREFIX}: the ranks' rounds hold different numbers of elements "
                f"({lo['elements']} on some ranks, {hi['elements']} on others)"
            )
        if "order" in hi and hi["order"] != lo["order"]:
            raise ProtocolError(
                f"{PREFIX}: the ranks' rounds hold different tensors (the same number of "
                f"elements, split or shaped differently)"
            )
        if "recorded" in hi and hi["recorded"] != lo["recorded"]:
            raise ProtocolError(
                f"{PREFIX}: the ranks recorded bits='auto' statistics of different tensors since "
                f"the last refit: every rank must make the same collecting calls"
            )
        return Agreement(ordered=True)
    if any(hi[f] != lo[f] for f in ("tensors", "elements", "contents")):
        raise ProtocolError(
            f"{PREFIX}: the ranks compressed different tensors in this round ({lo['tensors']} to "
            f"{hi['tensors']} tensors, {lo['elements']} to {hi['elements']} elements); every rank must "
            f"allreduce the same tensors with this compressor between two optimizer steps"
        )
    return Agreement(ordered=hi["order"] == lo["order"])
