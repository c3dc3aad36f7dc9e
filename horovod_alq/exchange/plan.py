"""The arithmetic of one buffer's exchange: which element ranges are encoded as separate payloads,
their sizes in both quantizations, and the payload bytes each rank puts on and takes off the wire.

Each exchange module's ``plan(lo, hi, size, rank, first, second)`` returns a :class:`BufferPlan`;
its ``steps`` and every front-end that runs the exchange itself (TensorFlow, in the graph) read
their sizes and byte counts from it, so the arithmetic exists once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ..core.quantizer import Quantizer


@dataclass(frozen=True)
class BufferPlan:
    """``parts``: the element ranges encoded with the first quantizer (the whole buffer, or one
    shard per rank); ``first``: their payload sizes; ``second``: the sizes of the re-quantized
    ranges (two-phase; empty otherwise); ``sent`` / ``received``: this rank's payload bytes on the
    wire (headers included), as :meth:`.job.Job.issue` counts the collectives."""

    parts: tuple[tuple[int, int], ...]
    first: tuple[int, ...]
    second: tuple[int, ...] = ()
    sent: int = 0
    received: int = 0


def shards(lo: int, hi: int, parts: int, bucket_size: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` cut into ``parts`` runs of whole buckets (counted from ``lo``), as even as whole
    buckets allow: the first ``buckets % parts`` runs hold one bucket more; runs may be empty."""
    d = bucket_size
    buckets = -(-(hi - lo) // d)
    base, extra = divmod(buckets, parts)
    bounds, pos = [lo], lo
    for j in range(parts):
        pos += (base + (j < extra)) * d
        bounds.append(min(pos, hi))
    return [(bounds[j], bounds[j + 1]) for j in range(parts)]


def sizes(parts: Sequence[tuple[int, int]], quantizer: Quantizer, segments=None, phase: int = 0) -> tuple[int, ...]:
    """The payload size of each element range under ``quantizer``; with ``segments`` (a job's
    :meth:`~.job.Job.segments`), the sum over its runs of one width, each run's quantizer of
    ``phase`` (0: first, 1: second)."""
    if segments is None:
        return tuple(quantizer.payload_bytes(b - a) for a, b in parts)
    return tuple(sum(codecs[phase].payload_bytes(rb - ra) for ra, rb, *codecs in segments(a, b)) for a, b in parts)


def allgather_bytes(sizes: Sequence[int], rank: int) -> tuple[int, int]:
    """(sent, received) payload bytes of an allgather on ``rank`` (rank ``r`` contributes
    ``sizes[r]``): its payload reaches the N - 1 others (as a ring forwards it), the others' reach it."""
    return (len(sizes) - 1) * int(sizes[rank]), sum(int(s) for r, s in enumerate(sizes) if r != rank)


def alltoall_bytes(splits: Sequence[int], received: Sequence[int], rank: int) -> tuple[int, int]:
    """(sent, received) payload bytes of an alltoall on ``rank``: what goes to and comes from other ranks."""
    return (
        sum(int(s) for j, s in enumerate(splits) if j != rank),
        sum(int(s) for r, s in enumerate(received) if r != rank),
    )


def total(*counts: tuple[int, int]) -> tuple[int, int]:
    """The (sent, received) of several collectives together."""
    return sum(c[0] for c in counts), sum(c[1] for c in counts)
