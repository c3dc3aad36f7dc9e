"""Allgather exchange: every rank gathers every rank's payload of each buffer and decodes all.

Per worker and coordinate it receives ``(N - 1)(b + 32/d)`` bits: the cheapest for a few workers,
and one quantization only (the variance of the average is that of the ranks' own codes, / N**2).
When the ranks laid their rounds out in different orders (:func:`gather_streams`), each rank's
whole stream is gathered once and every tensor is taken from each rank where that rank put it.

An exchange module is ``steps(job, i)``: the protocol of one buffer as a generator that yields each
collective it needs (:class:`.job.Allgather`, :class:`.job.Alltoall`), receives what it gathered
and returns the buffer's :class:`.job.Piece` list; a driver (:func:`.driver.run`, or the streamed
round of :mod:`.stream`) decides when each collective is issued.
"""

from __future__ import annotations

import numpy as np

from ..core.quantizer import Quantizer
from . import pipeline
from .descriptor import Exchange
from .interfaces import Tensor
from .job import Allgather, Deferred, Job, Piece, Steps
from .payloads import check_payloads, check_segments
from .plan import BufferPlan, allgather_bytes, sizes

#: Collectives per buffer (a streamed round gives each its own transport).
STAGES = 1
NAME = "allgather"


def plan(
    lo: int, hi: int, size: int, rank: int, first: Quantizer, second: Quantizer | None = None, segments=None
) -> BufferPlan:
    """``[lo, hi)`` as one payload (with ``segments``: one per run of one width), gathered by every rank."""
    parts = ((lo, hi),)
    own = sizes(parts, first, segments)
    return BufferPlan(parts, own, (), *allgather_bytes(own * size, rank))


def steps(job: Job, i: int) -> Steps:
    """Buffer ``i``: encode it (a payload per run of one width), gather every rank's payloads,
    check them; one :class:`Piece` per run."""
    t = job.transport
    lo, hi = job.layout.buffers[i]
    p = plan(lo, hi, t.size, t.rank, job.first, segments=job.segments)
    k = pipeline.chunks(job, p.parts)
    if k > 1:
        return (yield from chunked_steps(job, i, k))
    payload, runs = job.encode_runs(lo, hi, lambda k: job.seed(i) if k == 0 else job.seed(i, k, 3))
    gathered = yield Allgather(payload, list(p.first) * t.size, f"ag{i}")
    expected = [(b - a, q) for a, b, q, _ in runs]
    offsets = check_segments(job.ops, gathered, [expected] * t.size, f"buffer {i}")
    return [Piece(a, b, gathered, tuple(o[k] for o in offsets), job.frozen(q)) for k, (a, b, q, _) in enumerate(runs)]


def chunked_steps(job: Job, i: int, k: int) -> Steps:
    """Buffer ``i`` of the allgather exchange in ``k`` chunks: chunk ``c``'s payload
    is gathered while chunk ``c + 1`` is encoded and chunk ``c - 1`` decoded."""
    t, ops, q = job.transport, job.ops, job.first
    lo, hi = job.layout.buffers[i]
    runs = pipeline.cuts(lo, hi, k, q.bucket_size)
    seed = job.seed(i)
    waits, pieces, failure = [], [], None

    def receive(c: int) -> None:
        nonlocal failure
        a, b = runs[c]
        gathered, error = pipeline.waited(waits[c])
        failure = failure or error
        if failure is not None:
            return
        try:
            offsets = check_payloads(ops, gathered, [b - a] * t.size, q, f"chunk {c} of buffer {i}")
        except Exception as exc:  # noqa: BLE001 - raised after the last chunk's collective
            failure = exc
            return
        pieces.append(pipeline.summed(job, a, b, gathered, offsets))

    for c, (a, b) in enumerate(runs):
        payload = job.encode_range(a, b, q, seed, first=a - lo)
        waits.append((yield Deferred(Allgather(payload, [q.payload_bytes(b - a)] * t.size, f"ag{i}-{c}"))))
        if c > 0:
            receive(c - 1)
    receive(len(runs) - 1)
    if failure is not None:
        raise failure
    return pieces


def empty_first(ops, size: int) -> Allgather:
    """The first collective of ``steps(job, 0)`` with nothing to contribute (a buffer that other
    ranks started early and this one did not: it completes theirs)."""
    return Allgather(ops.from_numpy(np.zeros(0, dtype=np.uint8)), [0] * size, "ag0")


def gather_streams(job: Job, lengths: list[int] | None = None) -> list[Tensor]:
    """The decoded stream of every rank, separately (for rounds whose ranks ordered tensors
    differently). ``lengths``: every rank's stream length (they differ when the padding between
    tensors depends on their order); default: this rank's on every rank."""
    q, ops, t = job.first, job.ops, job.transport
    n = job.layout.length
    lengths = [n] * t.size if lengths is None else [int(x) for x in lengths]
    payload = job.encode_range(0, n, q, job.seed(0))
    gathered_sizes = [q.payload_bytes(m) for m in lengths]
    job.count_allgather(gathered_sizes)
    gathered = t.allgather(payload, gathered_sizes, job.name("ag-unordered"))()
    offsets = check_payloads(ops, gathered, lengths, q, "unordered round")
    streams = []
    for offset, m in zip(offsets, lengths):
        out = ops.zeros(m)
        ops.decode_sum(out, gathered, [offset], q)
        streams.append(out)
    return streams


EXCHANGE = Exchange(NAME, 0, STAGES, steps, plan, empty_first, graph=True)
