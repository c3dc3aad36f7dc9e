"""The pipelined round: a large buffer's exchange in chunks, each chunk's collectives travelling
while this rank encodes the next chunk and decodes the previous one.

A buffer (or, in the hierarchical exchange, each of its shards) is cut into ``K`` runs of whole
buckets (:func:`cuts`); chunk ``k`` is run ``k`` of every shard. Chunk ``k`` is encoded with the
seed of the whole buffer (shard) and ``first`` = its offset in it: the codec's draws depend only
on the seed and a coordinate's index (:attr:`horovod_alq.torch.ops.TorchOps.encodes_ranges`), and
the run starts on a bucket boundary and on a byte of codes, so its norms and codes are those the
unpipelined encode gives it. Each chunk is decoded into float32 (:class:`.job.Piece` ``summed``),
every rank's payloads added in rank (node) order as the whole decode adds them: the results are
bit for bit the unpipelined round's. Only the framing differs: one 32-byte header per chunk and
payload, ``K`` times the collectives.

When: :func:`chunks` (> 1 for buffers of more than ``job.chunk`` coordinates,
``Engine(pipeline_bytes=)``), on ops that encode ranges, with one width per buffer and without
error feedback (their encodes are not cut by coordinate), for the exchanges that call it
(:func:`.allgather.chunked_steps`, :func:`.two_phase.chunked_steps`,
:func:`.hierarchical.chunked_steps`; the hierarchical two-phase exchange is not pipelined), on the
fixed wire or on the entropy wire over a transport that takes blocks of any size (Horovod's,
``variable_sizes``): there chunk ``k``'s frames are coded when it is issued and decoded in its
wait, so coding chunk ``k + 1`` overlaps chunk ``k``'s transfer; on the other transports each
coded collective first exchanges its sizes, a blocking collective that would hold every chunk's
issue until every rank reached it, so they stay whole. Every input is agreed by the handshake
(the chunk size is its field ``pipeline``), so every rank cuts alike and issues the same
collectives in the same order. Errors: a chunk's check that fails is kept and raised only after
the buffer's last collective, as the unpipelined exchanges do, and so is an entropy-coded
allgather's frame that does not decode (its wait raises it on every rank); an owner poisons what
it forwards (two-phase, hierarchical), so every rank raises and none waits.
"""

from __future__ import annotations

from typing import Sequence

from ..core.protocol import ProtocolError
from .job import Deferred, Job, Piece
from .plan import shards

__all__ = ["chunks", "cuts", "staggered", "summed", "waited"]


def chunks(job: Job, parts: Sequence[tuple[int, int]]) -> int:
    """How many chunks the buffer of ``parts`` (its shards; one for the allgather) travels in: 1
    unless the job pipelines (``chunk`` > 0), its ops encode ranges, the wire is the fixed one or
    the entropy wire on a transport that takes blocks of any size, it has one width and no error
    feedback, the bucket size is a multiple of 8 and the buffer holds more than one chunk; at most
    the buckets of its smallest shard."""
    q, t = job.first, job.transport
    if (
        job.chunk <= 0
        or (hasattr(t, "inner") and not getattr(t, "variable_sizes", False))  # the entropy wire's size exchanges
        or job.widths is not None
        or job.feedback is not None
        or q.bucket_size % 8
        or not getattr(job.ops, "encodes_ranges", False)
    ):
        return 1
    length = sum(b - a for a, b in parts)
    fewest = min(-(-(b - a) // q.bucket_size) for a, b in parts)
    return max(1, min(-(-length // job.chunk), fewest))


def cuts(a: int, b: int, k: int, bucket_size: int) -> list[tuple[int, int]]:
    """``[a, b)`` as ``k`` runs of whole buckets counted from ``a`` (as even as buckets allow)."""
    return shards(a, b, k, bucket_size)


def summed(job: Job, a: int, b: int, gathered, offsets: Sequence[int], quantizer=None) -> Piece:
    """``[a, b)`` as the float32 sum of the decoded payloads at ``offsets`` of ``gathered``, in their
    order, encoded with ``quantizer``'s levels (default: the job's first quantizer's)."""
    q = job.first if quantizer is None else quantizer
    out = job.ops.empty(b - a)
    job.ops.decode_sum(out, gathered, list(offsets), q)
    return Piece(a, b, out, (), job.frozen(q), summed=True)


def waited(wait) -> tuple:
    """``(wait(), None)``, or ``(None, error)`` where the wait raised a protocol error (the entropy
    wire's allgather raises, on every rank, a frame that does not decode), to be raised after the
    buffer's last collective; a timeout is raised at once."""
    try:
        return wait(), None
    except TimeoutError:
        raise
    except ProtocolError as exc:
        return None, exc


def staggered(k: int, start, follow, finish, started: list, followed: list):
    """The last two stages of ``k`` chunks, staggered: chunk ``c``'s ``start(c)`` request, then
    ``follow(c - 1)``'s, then ``finish(c - 2)`` (its result decoded), so that two chunks are on the
    wire while the main thread works on a third. The waits land in ``started[c]`` and ``followed[c]``;
    every rank issues the requests in this same order."""
    for c in range(k + 2):
        if c < k:
            started[c] = yield Deferred(start(c))
        if 0 <= c - 1 < k:
            followed[c - 1] = yield Deferred(follow(c - 1))
        if 0 <= c - 2 < k:
            finish(c - 2)
