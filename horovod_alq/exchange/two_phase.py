"""Two-phase exchange ("scatter-reduce, then allgather"): traffic per worker independent of N.

Each buffer is cut into N shards of whole buckets. Phase 1: shard ``j`` of every rank's codes goes
to rank ``j`` (one alltoall); rank ``j`` decodes and sums its N shards. Phase 2: rank ``j``
re-quantizes the sum once with the *second* quantizer and the re-quantized shards are allgathered;
every rank, the owner included, decodes them, so every rank ends with identical values. Per worker
and coordinate it sends about ``2 (N - 1) / N (b + 32/d)`` bits.

The estimate stays unbiased (``E[Q2(S)] = S``, ``E[S] = sum of the ranks' values``); the second
quantization adds the variance of one quantization of the sum, which does not shrink with N. The
second quantizer may use more bits, and for adaptive methods its levels adapt to the statistics of
the reduced shards (averaging thins the tails), collected by the owners in refit rounds.

An owner that finds an invalid payload among its shards sends a poisoned phase-2 payload, so that
every rank raises (none waits in a collective that the owner will not issue).
"""

from __future__ import annotations

import numpy as np

from ..core.protocol import ProtocolError
from ..core.quantizer import Quantizer
from . import pipeline
from .descriptor import Exchange
from .job import Allgather, Alltoall, Job, Piece, Steps, joined
from .payloads import check_segments, poisoned, raise_if_poisoned
from .plan import BufferPlan, allgather_bytes, alltoall_bytes, shards, sizes, total

#: Collectives per buffer (a streamed round gives each its own transport).
STAGES = 2
NAME = "two-phase"


def plan(lo: int, hi: int, size: int, rank: int, first: Quantizer, second: Quantizer, segments=None) -> BufferPlan:
    """``[lo, hi)`` as ``size`` shards: rank ``j`` receives every rank's shard ``j`` (alltoall), and
    every rank gathers the owners' re-quantized shards (with ``segments``: a payload per run of
    one width in each shard)."""
    parts = tuple(shards(lo, hi, size, first.bucket_size))
    own, again = sizes(parts, first, segments), sizes(parts, second, segments, phase=1)
    counts = total(alltoall_bytes(own, [own[rank]] * size, rank), allgather_bytes(again, rank))
    return BufferPlan(parts, own, again, *counts)


def steps(job: Job, i: int) -> Steps:
    """Buffer ``i`` through the two phases; the owners' statistics of their reduced shards (for the
    second quantizer's refit) are added to ``job.second_statistics`` when ``job.collect_second``.
    Runs of one width (``bits="auto"``) are encoded, summed and re-quantized each with its own
    width: a shard's payload is one payload per run in it."""
    q2, ops, t = job.second, job.ops, job.transport
    n, me = t.size, t.rank
    p = plan(*job.layout.buffers[i], n, me, job.first, q2, segments=job.segments)
    k = pipeline.chunks(job, p.parts)
    if k > 1:
        return (yield from chunked_steps(job, i, p, k))
    parts = p.parts
    a, b = parts[me]
    payloads, runs = [], []
    for j, (pa, pb) in enumerate(parts):
        payload, shard_runs = job.encode_runs(pa, pb, lambda k: job.seed(i, j, 1) if k == 0 else job.seed(i, j, 1, k))
        payloads.append(payload)
        runs.append(shard_runs)
    gathered = yield Alltoall(ops.cat(payloads), list(p.first), [p.first[me]] * n, f"a2a{i}")
    acc, failure = sum_shard(job, gathered, runs[me], n, a, b, f"shard {me} of buffer {i}")
    again = [
        job.encode(acc[ra - a : rb - a], q, job.seed(i, me, 2) if k == 0 else job.seed(i, me, 2, k), ("sum", ra, rb))
        for k, (ra, rb, _, q) in enumerate(runs[me])
    ]
    payload = joined(ops, again)
    if failure is not None:
        payload = poisoned(ops, payload)
    gathered = yield Allgather(payload, list(p.second), f"ag2-{i}")

    raise_if_poisoned(ops, gathered, p.second, failure, f"first-phase payloads for their shards of buffer {i}")
    expected = [[(rb - ra, q) for ra, rb, _, q in shard_runs] for shard_runs in runs]
    check = check_segments(ops, gathered, expected, f"second phase of buffer {i}")
    return [
        Piece(ra, rb, gathered, (check[j][k],), job.frozen(q))
        for j, shard_runs in enumerate(runs)
        for k, (ra, rb, _, q) in enumerate(shard_runs)
    ]


def chunked_steps(job: Job, i: int, p: BufferPlan, k: int) -> Steps:
    """Buffer ``i`` of the two-phase exchange (its plan ``p``) in ``k`` chunks (chunk ``c``: run ``c``
    of every shard, :mod:`.pipeline`): chunk ``c``'s first phase travels while chunk ``c - 1``'s
    shard is summed and re-quantized and chunk ``c - 2``'s second phase decoded."""
    q1, q2, ops, t = job.first, job.second, job.ops, job.transport
    n, me = t.size, t.rank
    parts = p.parts
    a, b = parts[me]
    runs = [pipeline.cuts(pa, pb, k, q1.bucket_size) for pa, pb in parts]  # runs[j][c]: chunk c of shard j
    acc = ops.zeros(b - a)  # this rank's shard summed over the ranks, chunk by chunk
    first_wait, second_wait, failures = [None] * k, [None] * k, [None] * k
    pieces, raised = [], None

    def scatter(c: int) -> Alltoall:
        """1. every rank's chunk ``c`` of each shard to the shard's owner."""
        payloads = [
            job.encode_range(*r[c], q1, job.seed(i, j, 1), first=r[c][0] - parts[j][0]) for j, r in enumerate(runs)
        ]
        ca, cb = runs[me][c]
        sizes = [q1.payload_bytes(r[c][1] - r[c][0]) for r in runs]
        return Alltoall(ops.cat(payloads), sizes, [q1.payload_bytes(cb - ca)] * n, f"a2a{i}-{c}")

    def gather(c: int) -> Allgather:
        """2. chunk ``c`` of this rank's summed shard, re-quantized, to every rank (poisoned on a failure)."""
        ca, cb = runs[me][c]
        view = acc[ca - a : cb - a]
        what = f"chunk {c} of shard {me} of buffer {i}"
        _, failures[c] = sum_shard(job, first_wait[c](), [(ca, cb, q1, q2)], n, ca, cb, what, out=view, collect=False)
        payload = job.encode(view, q2, job.seed(i, me, 2), first=ca - a)
        if failures[c] is not None:
            payload = poisoned(ops, payload)
        return Allgather(payload, [q2.payload_bytes(r[c][1] - r[c][0]) for r in runs], f"ag2-{i}-{c}")

    def decode(c: int) -> None:
        """Chunk ``c`` of every shard, as its owner re-quantized it: checked and decoded."""
        nonlocal raised
        gathered, error = pipeline.waited(second_wait[c])
        raised = raised or error
        if raised is not None:
            return
        sizes = [q2.payload_bytes(r[c][1] - r[c][0]) for r in runs]
        try:
            raise_if_poisoned(ops, gathered, sizes, failures[c], f"first-phase payloads for their shards of buffer {i}")
            expected = [[(r[c][1] - r[c][0], q2)] for r in runs]
            offsets = check_segments(ops, gathered, expected, f"second phase of chunk {c} of buffer {i}")
        except ProtocolError as exc:
            raised = exc
            return
        for j, r in enumerate(runs):
            pieces.append(pipeline.summed(job, *r[c], gathered, [offsets[j][0]], q2))

    yield from pipeline.staggered(k, scatter, gather, decode, first_wait, second_wait)  # phases 1, 2, decode
    if job.collect_second and b > a:
        job.add_second_statistics(ops.statistics(acc, job.second))
    if raised is not None:
        raise raised
    return pieces


def sum_shard(job: Job, gathered, runs, copies: int, a: int, b: int, what: str, out=None, collect: bool = True):
    """Decode and sum the ``copies`` payloads of ``[a, b)`` (encoded as ``runs``) in ``gathered``:
    the sum (padding zeroed, the second quantizer's statistics collected) and the ProtocolError met
    on the way, or None; a rank that met one poisons what it sends next, so that every rank raises.
    ``out``: the sum's vector (default: a new one); ``collect``: whether to collect its statistics here."""
    ops = job.ops
    acc = ops.zeros(b - a) if out is None else out
    failure = None
    try:
        offsets = check_segments(ops, gathered, [[(rb - ra, q) for ra, rb, q, _ in runs]] * copies, what)
        for k, (ra, rb, q1, _) in enumerate(runs):
            ops.decode_sum(acc[ra - a : rb - a], gathered, [o[k] for o in offsets], q1)
    except ProtocolError as err:
        failure = err
    for pa, pb in job.layout.padding_in(a, b):  # keep padding out of the second norms
        acc[pa - a : pb - a] = 0
    if collect and job.collect_second and b > a:
        job.add_second_statistics(ops.statistics(acc, job.second))
    return acc, failure


def empty_first(ops, size: int) -> Alltoall:
    """The first collective of ``steps(job, 0)`` with nothing to contribute (see allgather's)."""
    return Alltoall(ops.from_numpy(np.zeros(0, dtype=np.uint8)), [0] * size, [0] * size, "a2a0")


EXCHANGE = Exchange(NAME, 1, STAGES, steps, plan, empty_first, requantizes=True, graph=True)
