"""Hierarchical exchange: exact inside a node, quantized only between nodes.

The ranks form nodes of ``G`` consecutive ranks (the transport's ``local_size``: rank ``r`` is on
node ``r // G``, local rank ``r % G``). Each buffer is cut into ``G`` shards of whole buckets; local
rank ``j`` owns shard ``j``. Three collectives per buffer, each a global alltoall in which ranks
outside a group exchange nothing (so no process set has to be registered):

1. exact reduce-scatter inside the node: every rank sends its float32 shard ``j`` to the node's
   rank ``j``, which sums the node's ``G`` shards (in rank order);
2. across nodes: each owner quantizes its node's sum of shard ``j`` and sends the payload to the
   owners of shard ``j`` on every node (itself included): every one of them now holds every node's
   codes of shard ``j``;
3. inside the node: each owner forwards those codes to its node's ranks, so every rank holds every
   node's codes of every shard and decodes the whole buffer, summing the nodes in node order:
   identical values on every rank.

Only codes cross nodes: ``(nodes - 1)`` payloads of ``1/G`` of the buffer per rank, ``1/G`` of what
a flat allgather sends. The estimate stays unbiased (exact sums, one unbiased quantization of each
node's sum). A node's sum has up to ``G`` times the norm of one rank's gradient, so at equal bits
the variance of the average is between equal to and ``G`` times the flat exchange's; at equal
inter-node bytes the hierarchical exchange can spend more bits (docs/guides/settings.md, "Clusters of
nodes"). In refit rounds the owners collect the statistics of what they quantize (the node sums).

An owner that finds an invalid payload among those it received poisons what it forwards, so that
every rank raises after the last collective (none waits in a collective another will not issue).
"""

from __future__ import annotations

import os

import numpy as np

from ..core.protocol import PREFIX, ProtocolError
from ..core.quantizer import Quantizer
from ..core.wire import HEADER_SIZE
from .interfaces import Transport
from .job import Alltoall, Job, Piece, Steps, joined
from .payloads import check_segments
from .plan import BufferPlan, alltoall_bytes, sizes, total
from .two_phase import shards

#: Collectives per buffer (a streamed round gives each its own transport).
STAGES = 3
NAME = "hierarchical"
POISON = b"ER"
#: The environment variable that declares nodes of that many consecutive ranks.
LOCAL_SIZE_ENV = "HOROVOD_ALQ_LOCAL_SIZE"
#: This exchange quantizes the node sums, not the rank's own values: it collects the first
#: quantizer's statistics itself (``Job.first_statistics``).
OWN_FIRST_STATISTICS = True


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


def plan(
    lo: int,
    hi: int,
    size: int,
    rank: int,
    first: Quantizer,
    second: Quantizer | None = None,
    segments=None,
    g: int | None = None,
) -> BufferPlan:
    """``[lo, hi)`` as ``g`` shards (``g``: ranks per node, default ``size``): ``first`` holds each
    shard's payload size; ``sent`` / ``received`` this rank's bytes on the wire over the three
    collectives (float32 inside the node, codes between nodes and again inside the node)."""
    g = size if g is None else g
    parts = tuple(shards(lo, hi, g, first.bucket_size))
    own = sizes(parts, first, segments)
    node, local = divmod(rank, g)
    nodes = size // g
    peers = [node * g + j for j in range(g)]
    floats = [4 * (b - a) for a, b in parts]
    stage1 = _splits(size, {r: floats[r % g] for r in peers}), _splits(size, {r: floats[local] for r in peers})
    cross = [k * g + local for k in range(nodes)]
    stage2 = _splits(size, {r: own[local] for r in cross}), _splits(size, {r: own[local] for r in cross})
    stage3 = (
        _splits(size, {r: nodes * own[local] for r in peers}),
        _splits(size, {r: nodes * own[r % g] for r in peers}),
    )
    counts = total(*(alltoall_bytes(s, r, rank) for s, r in (stage1, stage2, stage3)))
    return BufferPlan(parts, own, (), *counts)


def _splits(size: int, to: dict[int, int]) -> list[int]:
    return [int(to.get(r, 0)) for r in range(size)]


def steps(job: Job, i: int) -> Steps:
    """Buffer ``i`` through the three collectives; one :class:`Piece` per shard and run of one width
    (``bits="auto"``), each the sum of the nodes' payloads of it."""
    ops, t = job.ops, job.transport
    n, me = t.size, t.rank
    g = local_size(t)
    node, local = divmod(me, g)
    nodes = n // g
    lo, hi = job.layout.buffers[i]
    p = plan(lo, hi, n, me, job.first, segments=job.segments, g=g)
    parts = p.parts
    a, b = parts[local]
    peers = [node * g + j for j in range(g)]
    cross = [k * g + local for k in range(nodes)]

    # 1. exact reduce-scatter inside the node
    x = job.stream[lo:hi]
    floats = [4 * (pb - pa) for pa, pb in parts]
    pieces = [ops.as_bytes(x[pa - lo : pb - lo]) for pa, pb in parts]
    gathered = yield Alltoall(
        ops.cat(pieces),
        _splits(n, {r: floats[r % g] for r in peers}),
        _splits(n, {r: floats[local] for r in peers}),
        f"h1-{i}",
    )
    shard = ops.from_bytes(gathered)
    acc = ops.zeros(b - a)
    for k in range(g):  # in rank order: the node's owners of other shards do the same sums
        acc += shard[k * (b - a) : (k + 1) * (b - a)]

    # 2. the node's sum of this shard, quantized, to the owners of the same shard on every node
    runs = job.segments(a, b)
    payload = joined(
        ops, [job.encode(acc[ra - a : rb - a], q, job.seed(i, 4, k)) for k, (ra, rb, q, _) in enumerate(runs)]
    )
    job.encoded += int(payload.shape[0])
    if job.collect_first and b > a and job.widths is None:
        job.add_first_statistics(ops.statistics(acc, job.first))
    own = p.first[local]
    gathered = yield Alltoall(
        ops.cat([payload] * nodes), _splits(n, {r: own for r in cross}), _splits(n, {r: own for r in cross}), f"h2-{i}"
    )
    failure = None
    try:
        check_segments(
            ops,
            gathered,
            [[(rb - ra, q) for ra, rb, q, _ in runs]] * nodes,
            f"shard {local} of buffer {i} from the nodes",
        )
    except ProtocolError as err:
        failure = err
    forward = gathered if failure is None else _poisoned(ops, gathered)

    # 3. every node's codes of this shard to the node's ranks
    gathered = yield Alltoall(
        ops.cat([forward] * g),
        _splits(n, {r: nodes * own for r in peers}),
        _splits(n, {r: nodes * p.first[r % g] for r in peers}),
        f"h3-{i}",
    )
    host = ops.to_numpy(gathered)
    starts = np.concatenate([[0], np.cumsum([nodes * s for s in p.first])]).astype(np.int64).tolist()
    bad = [
        peers[j] for j in range(g) if host.size >= starts[j] + 2 and bytes(host[starts[j] : starts[j] + 2]) == POISON
    ]
    if bad:
        if failure is not None:
            raise failure
        raise ProtocolError(
            f"{PREFIX}: rank(s) {bad} received invalid payloads from the other nodes for "
            f"their shards of buffer {i} (see their errors); refusing to decode on every rank"
        )
    expected = [[(rb - ra, q) for ra, rb, q, _ in job.segments(pa, pb)] for pa, pb in parts for _ in range(nodes)]
    offsets = check_segments(ops, gathered, expected, f"buffer {i} from the node")
    out = []
    for j, (pa, pb) in enumerate(parts):
        for k, (ra, rb, q, _) in enumerate(job.segments(pa, pb)):
            out.append(Piece(ra, rb, gathered, tuple(offsets[j * nodes + m][k] for m in range(nodes)), job.frozen(q)))
    return out


def empty_first(ops, size: int) -> Alltoall:
    """The first collective of ``steps(job, 0)`` with nothing to contribute (see allgather's)."""
    return Alltoall(ops.from_numpy(np.zeros(0, dtype=np.uint8)), [0] * size, [0] * size, "h1-0")


def _poisoned(ops, payloads):
    host = ops.to_numpy(payloads).copy()
    if host.size >= HEADER_SIZE:
        host[:2] = np.frombuffer(POISON, dtype=np.uint8)
        host[2:HEADER_SIZE] = 0
    return ops.from_numpy(host)
