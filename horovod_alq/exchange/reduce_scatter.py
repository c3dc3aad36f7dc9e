"""Reduce-scatter exchange (FSDP2's gradient reduction): each rank ends with the sum of one shard.

A buffer of ``N * S`` coordinates is N shards of ``S`` (shard ``j`` is ``[j S, (j + 1) S)``, the
part rank ``j`` owns, as FSDP lays out its reduce-scatter input). Each rank quantizes every shard on
its own (buckets counted from the shard's start), one alltoall sends shard ``j``'s codes to rank
``j``, and rank ``j`` decodes and sums the N payloads of its shard: one quantization, no second
one (the result is the owner's gradient shard; nothing is gathered again). Per worker and input
coordinate it sends about ``(N - 1) / N (b + 32/d)`` bits. With ``bits="auto"`` the buffer's
tensors (for FSDP2: each parameter's chunk of each shard) carry their allocated widths, a payload
per run of one width within a shard. Streamed rounds only
(:meth:`.engine.Engine.open_stream`): the result covers this rank's shard, :func:`span`.
"""

from __future__ import annotations

from .descriptor import Exchange
from .job import Alltoall, Job, Piece, Steps
from .payloads import check_segments

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
    """Buffer ``i``: encode its N shards (``bits="auto"``: a payload per run of one width in each,
    :meth:`Job.segments`), send shard ``j``'s to rank ``j``, check the N ranks' payloads of this
    rank's shard; one :class:`Piece` per run of it."""
    me, n = job.transport.rank, job.transport.size
    shards = shard_bounds(job, i)
    runs = [job.segments(a, b) for a, b in shards]
    payloads = [
        job.encode_range(a, b, q, job.seed(i, j) if k == 0 else job.seed(i, j, k, 3))
        for j, shard_runs in enumerate(runs)
        for k, (a, b, q, _) in enumerate(shard_runs)
    ]
    splits = [sum(q.payload_bytes(b - a) for a, b, q, _ in shard_runs) for shard_runs in runs]
    gathered = yield Alltoall(job.ops.cat(payloads), splits, [splits[me]] * n, f"rs{i}")
    expected = [(b - a, q) for a, b, q, _ in runs[me]]
    offsets = check_segments(job.ops, gathered, [expected] * n, f"shard {me} of buffer {i}")
    return [
        Piece(a, b, gathered, tuple(o[k] for o in offsets), job.frozen(q)) for k, (a, b, q, _) in enumerate(runs[me])
    ]


def span(job: Job) -> tuple[int, int]:
    """Where this rank's result lies in a one-buffer job's stream: ``(start, length)`` of its shard."""
    a, b = shard_bounds(job, 0)[job.transport.rank]
    return a, b - a


EXCHANGE = Exchange(NAME, 2, STAGES, steps, span=span)
