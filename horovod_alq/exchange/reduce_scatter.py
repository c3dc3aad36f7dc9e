"""Reduce-scatter exchange (FSDP2's gradient reduction): each rank ends with the sum of one shard.

A buffer of ``N * S`` coordinates is N shards of ``S`` (shard ``j`` is ``[j S, (j + 1) S)``, the
part rank ``j`` owns, as FSDP lays out its reduce-scatter input). Each rank quantizes every shard on
its own (buckets counted from the shard's start), one alltoall sends shard ``j``'s codes to rank
``j``, and rank ``j`` decodes and sums the N payloads of its shard: one quantization, no second
one (the result is the owner's gradient shard; nothing is gathered again). Per worker and input
coordinate it sends about ``(N - 1) / N (b + 32/d)`` bits. Streamed rounds only
(:meth:`.engine.Engine.open_stream`): the result covers this rank's shard, :func:`span`.
"""

from __future__ import annotations

from ..core.wire import payload_size
from .base import Alltoall, Job, Piece, Steps, check_payloads

#: Collectives per buffer.
STAGES = 1
NAME = "reduce-scatter"


def shard_bounds(job: Job, i: int) -> list[tuple[int, int]]:
    """The N shards of buffer ``i``; ValueError if its length is not a multiple of N."""
    lo, hi = job.layout.buffers[i]
    n = job.transport.size
    if (hi - lo) % n:
        raise ValueError(f"a reduce-scatter input of {hi - lo} elements does not split into {n} equal shards")
    per = (hi - lo) // n
    return [(lo + j * per, lo + (j + 1) * per) for j in range(n)]


def steps(job: Job, i: int) -> Steps:
    """Buffer ``i``: encode its N shards, send shard ``j`` to rank ``j``, check the N payloads of
    this rank's shard; one :class:`Piece` covering it."""
    q, me = job.first, job.transport.rank
    parts = shard_bounds(job, i)
    payloads = [job.encode_range(a, b, q, job.seed(i, j)) for j, (a, b) in enumerate(parts)]
    a, b = parts[me]
    size = payload_size(b - a, q.bits, q.bucket_size)
    gathered = yield Alltoall(job.ops.cat(payloads), [size] * len(parts), [size] * len(parts), f"rs{i}")
    offsets = check_payloads(job.ops, gathered, [b - a] * len(parts), q, f"shard {me} of buffer {i}")
    return [Piece(a, b, gathered, tuple(offsets), job.frozen(q))]


def span(job: Job) -> tuple[int, int]:
    """Where this rank's result lies in a one-buffer job's stream: ``(start, length)`` of its shard."""
    a, b = shard_bounds(job, 0)[job.transport.rank]
    return a, b - a
