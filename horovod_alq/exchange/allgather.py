"""Allgather exchange: every rank gathers every rank's payload of each buffer and decodes all.

Per worker and coordinate it receives ``(N - 1)(b + 32/d)`` bits: the cheapest for a few workers,
and one quantization only (the variance of the average is that of the ranks' own codes, / N**2).
When the ranks laid their rounds out in different orders (:func:`gather_streams`), each rank's
whole stream is gathered once and every tensor is taken from each rank where that rank put it.
"""

from __future__ import annotations

import numpy as np

from ..core.wire import payload_size
from .base import Decoded, Job, Piece, Tensor, check_payloads

NAME = "allgather"


def run(job: Job) -> tuple[Decoded, np.ndarray | None]:
    """Sum over ranks of the decoded stream (decoded on demand); no second-phase statistics."""
    q, ops, t = job.first, job.ops, job.transport
    waits = []
    for i, (lo, hi) in enumerate(job.layout.buffers):
        payload = job.encode_range(lo, hi, q, job.seed(i))
        sizes = [payload_size(hi - lo, q.bits, q.bucket_size)] * t.size
        job.count_allgather(sizes)
        waits.append(t.allgather(payload, sizes, job.name(f"ag{i}")))
    pieces = []
    for i, ((lo, hi), wait) in enumerate(zip(job.layout.buffers, waits)):
        gathered = wait()
        offsets = check_payloads(ops, gathered, [hi - lo] * t.size, q, f"buffer {i}")
        pieces.append(Piece(lo, hi, gathered, tuple(offsets), job.frozen(q)))
    return Decoded(ops, job.layout.length, pieces), None


def gather_streams(job: Job, lengths: list[int] | None = None) -> list[Tensor]:
    """The decoded stream of every rank, separately (for rounds whose ranks ordered tensors
    differently). ``lengths``: every rank's stream length (they differ when the padding between
    tensors depends on their order); default: this rank's on every rank."""
    q, ops, t = job.first, job.ops, job.transport
    n = job.layout.length
    lengths = [n] * t.size if lengths is None else [int(x) for x in lengths]
    payload = job.encode_range(0, n, q, job.seed(0))
    sizes = [payload_size(m, q.bits, q.bucket_size) for m in lengths]
    job.count_allgather(sizes)
    gathered = t.allgather(payload, sizes, job.name("ag-unordered"))()
    offsets = check_payloads(ops, gathered, lengths, q, "unordered round")
    streams = []
    for offset, m in zip(offsets, lengths):
        out = ops.zeros(m)
        ops.decode_sum(out, gathered, [offset], q)
        streams.append(out)
    return streams
