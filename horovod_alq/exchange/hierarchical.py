"""Hierarchical exchange: exact inside a node, quantized only between nodes.

The ranks form nodes of ``G`` consecutive ranks (:func:`.topology.local_size`: rank ``r`` is on
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

An owner that finds an invalid payload among those it received poisons what it forwards, and in
the same last collective sends every rank of the other nodes one status byte (1: it found one), so
that every rank, on every node, raises after the last collective (none waits in a collective
another will not issue).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ..core.protocol import PREFIX, ProtocolError
from ..core.quantizer import Quantizer
from . import pipeline
from .descriptor import Exchange
from .interfaces import Tensor
from .job import Alltoall, Deferred, Job, Piece, Steps, joined
from .payloads import check_segments, poisoned, raise_if_poisoned
from .plan import BufferPlan, alltoall_bytes, shards, sizes, total
from .topology import local_size

#: Collectives per buffer (a streamed round gives each its own transport).
STAGES = 3
NAME = "hierarchical"


def plan(
    lo: int,
    hi: int,
    size: int,
    rank: int,
    first: Quantizer,
    second: Quantizer | None = None,
    segments=None,
    g: int | None = None,
    status: bool = True,
) -> BufferPlan:
    """``[lo, hi)`` as ``g`` shards (``g``: ranks per node, default ``size``): ``first`` holds each
    shard's payload size; ``sent`` / ``received`` this rank's bytes on the wire over the three
    collectives (float32 inside the node, codes between nodes and again inside the node; with
    ``status``, the last stage's status bytes: TensorFlow's graph sends none)."""
    g = size if g is None else g
    parts = tuple(shards(lo, hi, g, first.bucket_size))
    own = sizes(parts, first, segments)
    local, nodes = rank % g, size // g
    to = splits(size, {r: own[local] for r in cross_ranks(rank, size, g)})
    stage3 = (last_splits if status else forward_splits)(size, rank, [nodes * s for s in own])
    counts = total(*(alltoall_bytes(s, r, rank) for s, r in (node_sum_splits(parts, size, rank), (to, to), stage3)))
    return BufferPlan(parts, own, (), *counts)


def splits(size: int, to: dict[int, int]) -> list[int]:
    """An alltoall's per-rank byte counts over ``size`` ranks: ``to[r]`` for the ranks in ``to``, else 0."""
    return [int(to.get(r, 0)) for r in range(size)]


def steps(job: Job, i: int) -> Steps:
    """Buffer ``i`` through the three collectives; one :class:`Piece` per shard and run of one width
    (``bits="auto"``), each the sum of the nodes' payloads of it."""
    ops, t = job.ops, job.transport
    n, me = t.size, t.rank
    g = local_size(t)
    local, nodes = me % g, n // g
    p = plan(*job.layout.buffers[i], n, me, job.first, segments=job.segments, g=g)
    k = pipeline.chunks(job, p.parts)
    if k > 1:
        return (yield from chunked_steps(job, i, p, k))
    parts = p.parts
    a, b = parts[local]
    acc, failure = yield from node_sum(job, i, parts, g)

    # 2. the node's sum of this shard, quantized, to the owners of the same shard on every node
    runs = job.segments(a, b)
    payload = joined(
        ops,
        [
            job.encode(acc[ra - a : rb - a], q, job.seed(i, 4, k), ("node", ra, rb))
            for k, (ra, rb, q, _) in enumerate(runs)
        ],
    )
    job.encoded += int(payload.shape[0])
    if job.collect_first and b > a and job.widths is None:
        job.add_first_statistics(ops.statistics(acc, job.first))
    own = p.first[local]
    to = splits(n, {r: own for r in cross_ranks(me, n, g)})
    gathered = yield Alltoall(ops.cat([payload] * nodes), to, to, f"h2-{i}")
    try:
        check_segments(
            ops,
            gathered,
            [[(rb - ra, q) for ra, rb, q, _ in runs]] * nodes,
            f"shard {local} of buffer {i} from the nodes",
        )
    except ProtocolError as err:
        failure = failure or err

    # 3. every node's codes of this shard to the node's ranks
    gathered = yield from forward_in_node(
        job, i, gathered, [nodes * s for s in p.first], failure, f"h3-{i}", "from the other nodes"
    )
    expected = [[(rb - ra, q) for ra, rb, q, _ in job.segments(pa, pb)] for pa, pb in parts for _ in range(nodes)]
    offsets = check_segments(ops, gathered, expected, f"buffer {i} from the node")
    out = []
    for j, (pa, pb) in enumerate(parts):
        for k, (ra, rb, q, _) in enumerate(job.segments(pa, pb)):
            out.append(Piece(ra, rb, gathered, tuple(offsets[j * nodes + m][k] for m in range(nodes)), job.frozen(q)))
    return out


def node_ranks(rank: int, g: int) -> list[int]:
    """The ranks of ``rank``'s node (nodes of ``g`` consecutive ranks)."""
    node = rank // g
    return [node * g + j for j in range(g)]


def node_sum_splits(parts: Sequence[tuple[int, int]], size: int, rank: int) -> tuple[list[int], list[int]]:
    """The byte counts (sent, received per rank) of stage 1 for the ``len(parts)`` shards of a buffer."""
    g = len(parts)
    floats = [4 * (b - a) for a, b in parts]
    peers = node_ranks(rank, g)
    return splits(size, {r: floats[r % g] for r in peers}), splits(size, {r: floats[rank % g] for r in peers})


def forward_splits(size: int, rank: int, block: Sequence[int]) -> tuple[list[int], list[int]]:
    """The byte counts of the last stage: ``block[j]`` bytes from local rank ``j`` to its node."""
    g = len(block)
    peers = node_ranks(rank, g)
    return splits(size, {r: block[rank % g] for r in peers}), splits(size, {r: block[r % g] for r in peers})


def last_splits(size: int, rank: int, block: Sequence[int]) -> tuple[list[int], list[int]]:
    """The byte counts of the last stage of the engine's exchanges: :func:`forward_splits` inside
    the node, and one status byte to and from every rank of the other nodes."""
    g = len(block)
    sent, received = forward_splits(size, rank, block)
    for r in range(size):
        if r // g != rank // g:
            sent[r] = received[r] = 1
    return sent, received


def last_stage(ops, t, forward: Tensor, block: Sequence[int], failure, tag: str) -> Alltoall:
    """The last stage's collective: ``forward`` to the node's ranks (poisoned when ``failure``),
    this rank's status byte to the ranks of the other nodes (see :func:`node_part`)."""
    g = len(block)
    node = t.rank // g
    status = ops.from_numpy(np.full(1, failure is not None, dtype=np.uint8))
    sent = forward if failure is None else poisoned(ops, forward)
    blocks = [status] * (node * g) + [sent] * g + [status] * (t.size - (node + 1) * g)
    return Alltoall(ops.cat(blocks), *last_splits(t.size, t.rank, block), tag)


def node_part(ops, t, gathered: Tensor, block: Sequence[int], failure, what: str) -> Tensor:
    """What :func:`last_stage` gathered, checked: raises on this rank if a block from its node
    arrived poisoned (its own ``failure`` first) or a rank of another node sent status 1 (naming
    it: it received invalid ``what``); else returns the node's blocks."""
    g = len(block)
    node = t.rank // g
    before, inside = node * g, int(sum(block))
    ranks = node_ranks(t.rank, g)
    raise_if_poisoned(ops, gathered[before : before + inside], block, failure, what, ranks)
    status = np.concatenate([ops.to_numpy(gathered[:before]), ops.to_numpy(gathered[before + inside :])])
    others = [r for r in range(t.size) if r // g != node]
    flagged = [others[j] for j in np.flatnonzero(status).tolist()]
    if flagged:
        raise ProtocolError(
            f"{PREFIX}: rank(s) {flagged} received invalid {what} (see their errors); refusing to decode on every rank"
        )
    return gathered[before : before + inside]


def cross_ranks(rank: int, size: int, g: int) -> list[int]:
    """The ranks with ``rank``'s local rank, one per node, in node order: the owners of its shard."""
    return [k * g + rank % g for k in range(size // g)]


def node_sum(job: Job, i: int, parts: Sequence[tuple[int, int]], g: int):
    """Stage 1 of buffer ``i`` (``parts``: its ``g`` shards), an exact float32 reduce-scatter inside
    the node: yields one :class:`Alltoall`, returns this rank's node sum of its shard ``local``
    (the node's ranks' shards summed in rank order, so that a node's owners agree bit for bit) and
    the error to poison what it forwards with, or None (:func:`undecoded`)."""
    ops, t = job.ops, job.transport
    n, me = t.size, t.rank
    lo, hi = job.layout.buffers[i]
    a, b = parts[me % g]
    x = job.stream[lo:hi]
    gathered = yield Alltoall(
        ops.cat([ops.as_bytes(x[pa - lo : pb - lo]) for pa, pb in parts]), *node_sum_splits(parts, n, me), f"h1-{i}"
    )
    shard = ops.from_bytes(gathered)
    acc = ops.zeros(b - a)
    for k in range(g):
        acc += shard[k * (b - a) : (k + 1) * (b - a)]
    return acc, undecoded(job, f"h1-{i}", f"the node's float32 shards of buffer {i}")


def undecoded(job: Job, tag: str, what: str) -> ProtocolError | None:
    """The error when a frame of ``what`` that this rank received in the job's alltoall ``tag`` did
    not decode on the entropy wire (which then hands over 0xFF bytes: NaN as float32, and the node
    sums have no payload check to catch them), else None. The caller poisons what it forwards,
    so every rank raises."""
    why = getattr(job.transport, "undecoded", lambda _: None)(job.name(tag))
    if why is None:
        return None
    return ProtocolError(f"{PREFIX}: {tag}: {what} arrived undecodable ({why}); refusing to decode on every rank")


def forward_in_node(
    job: Job, i: int, held: Tensor, block: Sequence[int], failure: ProtocolError | None, tag: str, source: str
):
    """The last stage: this rank's ``held`` payloads of its shard go to its node's ranks (poisoned
    when ``failure``: it found an invalid payload), each rank receiving ``block[j]`` bytes from
    local rank ``j``, and its status to the other nodes (:func:`last_stage`). Yields one
    :class:`Alltoall`, returns the node's bytes; raises on every rank of every node if any rank
    found an invalid payload (:func:`node_part`)."""
    ops, t = job.ops, job.transport
    gathered = yield last_stage(ops, t, held, block, failure, tag)
    return node_part(ops, t, gathered, block, failure, f"payloads {source} for their shards of buffer {i}")


def chunked_steps(job: Job, i: int, p: BufferPlan, k: int) -> Steps:
    """Buffer ``i`` of the hierarchical exchange (its plan ``p``) in ``k`` chunks, each through the
    exchange's three collectives (:mod:`.hierarchical`): every chunk's node sum is sent first
    (float32, no work to overlap), then chunk ``c``'s quantized node sum crosses the nodes while
    chunk ``c - 1``'s codes are forwarded in the node and chunk ``c - 2``'s decoded."""
    ops, t, q = job.ops, job.transport, job.first
    n, me = t.size, t.rank
    g = local_size(t)
    local, nodes = me % g, n // g
    lo, hi = job.layout.buffers[i]
    parts = p.parts
    a, b = parts[local]
    runs = [pipeline.cuts(pa, pb, k, q.bucket_size) for pa, pb in parts]  # runs[j][c]: chunk c of shard j
    mine = runs[local]
    seed = job.seed(i, 4, 0)
    x = job.stream[lo:hi]
    acc = ops.zeros(b - a)  # the node's sum of this rank's shard, chunk by chunk
    first_wait, second_wait, third_wait = [], [None] * k, [None] * k
    failures: list = [None] * k  # a chunk's invalid payloads from the nodes (its owner poisons them on)
    pieces, raised = [], None

    for c in range(k):  # 1. every chunk's node sum: float32, nothing to overlap with
        chunk = [r[c] for r in runs]
        floats = [4 * (cb - ca) for ca, cb in chunk]
        peers = node_ranks(me, g)
        send = splits(n, {r: floats[r % g] for r in peers})
        got = splits(n, {r: floats[local] for r in peers})
        payload = ops.cat([ops.as_bytes(x[ca - lo : cb - lo]) for ca, cb in chunk])
        first_wait.append((yield Deferred(Alltoall(payload, send, got, f"h1-{i}-{c}"))))

    def cross(c: int):
        """2. chunk ``c`` of this rank's node sum, quantized, to its shard's owners on every node."""
        ca, cb = mine[c]
        shard = ops.from_bytes(first_wait[c]())
        failures[c] = undecoded(job, f"h1-{i}-{c}", f"chunk {c} of the node's float32 shards of buffer {i}")
        view = acc[ca - a : cb - a]
        for m in range(g):
            view += shard[m * (cb - ca) : (m + 1) * (cb - ca)]
        payload = job.encode(view, q, seed, first=ca - a)
        job.encoded += int(payload.shape[0])
        to = splits(n, {r: q.payload_bytes(cb - ca) for r in cross_ranks(me, n, g)})
        return Alltoall(ops.cat([payload] * nodes), to, to, f"h2-{i}-{c}")

    def forward(c: int):
        """3. every node's codes of chunk ``c`` of this rank's shard to the node's ranks."""
        ca, cb = mine[c]
        held = second_wait[c]()
        try:
            check_segments(
                ops, held, [[(cb - ca, q)]] * nodes, f"chunk {c} of shard {local} of buffer {i} from the nodes"
            )
        except Exception as exc:  # noqa: BLE001 - poisons what this rank forwards
            failures[c] = failures[c] or exc
        block = [nodes * q.payload_bytes(r[c][1] - r[c][0]) for r in runs]
        return last_stage(ops, t, held, block, failures[c], f"h3-{i}-{c}")

    def decode(c: int) -> None:
        """Chunk ``c`` of every shard from the node: checked, decoded and summed in node order."""
        nonlocal raised
        gathered = third_wait[c]()
        if raised is not None:
            return
        block = [nodes * q.payload_bytes(r[c][1] - r[c][0]) for r in runs]
        what = f"payloads from the other nodes for their shards of buffer {i}"
        try:
            gathered = node_part(ops, t, gathered, block, failures[c], what)
            expected = [[(r[c][1] - r[c][0], q)] for r in runs for _ in range(nodes)]
            offsets = check_segments(ops, gathered, expected, f"chunk {c} of buffer {i} from the node")
        except Exception as exc:  # noqa: BLE001 - raised after the last chunk's collective
            raised = exc
            return
        for j, r in enumerate(runs):
            pieces.append(pipeline.summed(job, *r[c], gathered, [offsets[j * nodes + m][0] for m in range(nodes)]))

    yield from pipeline.staggered(k, cross, forward, decode, second_wait, third_wait)  # stages 2, 3, decode
    if job.collect_first and b > a:
        job.add_first_statistics(ops.statistics(acc, q))
    if raised is not None:
        raise raised
    return pieces


def empty_first(ops, size: int) -> Alltoall:
    """The first collective of ``steps(job, 0)`` with nothing to contribute (see allgather's)."""
    return Alltoall(ops.from_numpy(np.zeros(0, dtype=np.uint8)), [0] * size, [0] * size, "h1-0")


EXCHANGE = Exchange(NAME, 3, STAGES, steps, plan, empty_first, own_first_statistics=True, node_aware=True, graph=True)
