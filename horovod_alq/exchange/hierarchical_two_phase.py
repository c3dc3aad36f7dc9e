"""Hierarchical two-phase exchange: exact inside a node, a two-phase exchange of the node sums between
nodes, so that the bytes between nodes do not grow with the number of nodes.

Nodes of ``G`` consecutive ranks as in :mod:`.hierarchical`, ``M`` nodes. Each buffer is cut into
``G`` shards of whole buckets (local rank ``j`` owns shard ``j``), each shard into ``M`` sub-shards
of whole buckets (the owner of shard ``j`` on node ``k`` owns sub-shard ``k``). Four collectives
per buffer, each a global alltoall in which ranks outside a group exchange nothing:

1. exact reduce-scatter inside the node (:func:`.hierarchical.node_sum`);
2. between nodes, phase 1: each owner quantizes its node's sum of every sub-shard of its shard
   and sends sub-shard ``k``'s payload to the owner on node ``k``, which decodes and sums the
   ``M`` nodes' payloads (the job's sum of its sub-shard) and re-quantizes it once with the second
   quantizer;
3. between nodes, phase 2: the owners of shard ``j`` gather each other's re-quantized sub-shards;
4. inside the node: each owner forwards its shard's ``M`` payloads to the node's ranks; every rank
   decodes the whole buffer from the same payloads (identical values on every rank).

Bytes between nodes per node: ``2 (M - 1) / M`` of one rank's payload of the whole buffer, ``1/G``
of the flat two-phase exchange's, and bounded in ``M`` where :mod:`.hierarchical` sends
``(M - 1)`` payloads. The estimate stays unbiased: exact node sums, then two unbiased quantizations
(of the node sums, as :mod:`.hierarchical`, and of their total, as :mod:`.two_phase`). Refit rounds
collect the first quantizer's statistics from the node sums and the second's from the owners'
reduced sub-shards.

An owner that finds an invalid payload poisons what it sends on (phase 2, then the forward), so
that every rank raises after the last collective (none waits in a collective another will not issue).
"""

from __future__ import annotations

import numpy as np

from ..core.protocol import PREFIX, ProtocolError
from ..core.quantizer import Quantizer
from .descriptor import Exchange
from .hierarchical import cross_ranks, forward_in_node, forward_splits, last_splits, node_sum, node_sum_splits, splits
from .job import Alltoall, Job, Piece, Steps, joined
from .payloads import check_segments, poisoned, poisoned_blocks
from .plan import BufferPlan, alltoall_bytes, shards, sizes, total
from .topology import local_size
from .two_phase import sum_shard

#: Collectives per buffer (a streamed round gives each its own transport).
STAGES = 4
NAME = "hierarchical-two-phase"


def sub_shards(lo: int, hi: int, g: int, nodes: int, bucket_size: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` as ``g`` shards, each as ``nodes`` sub-shards, of whole buckets: sub-shard ``k``
    of shard ``j`` at index ``j * nodes + k``."""
    return [sub for a, b in shards(lo, hi, g, bucket_size) for sub in shards(a, b, nodes, bucket_size)]


def plan(
    lo: int,
    hi: int,
    size: int,
    rank: int,
    first: Quantizer,
    second: Quantizer,
    segments=None,
    g: int | None = None,
    status: bool = True,
) -> BufferPlan:
    """``[lo, hi)`` as :func:`sub_shards` (``g``: ranks per node, default ``size``): ``first`` and
    ``second`` hold each sub-shard's payload sizes in both quantizations; ``sent`` / ``received``
    this rank's bytes on the wire over the four collectives (``status``: as :func:`.hierarchical.plan`)."""
    g = size if g is None else g
    m = size // g
    parts = tuple(sub_shards(lo, hi, g, m, first.bucket_size))
    own, again = sizes(parts, first, segments), sizes(parts, second, segments, phase=1)
    counts = total(
        *(
            alltoall_bytes(s, r, rank)
            for s, r in (
                node_sum_splits([(parts[j * m][0], parts[j * m + m - 1][1]) for j in range(g)], size, rank),
                *between_splits(size, rank, g, own, again),
                (last_splits if status else forward_splits)(
                    size, rank, [sum(again[j * m : (j + 1) * m]) for j in range(g)]
                ),
            )
        )
    )
    return BufferPlan(parts, own, again, *counts)


def between_splits(size: int, rank: int, g: int, own, again) -> tuple[tuple[list[int], list[int]], ...]:
    """The byte counts of stages 2 and 3 (phase 1 and phase 2 between nodes)."""
    m = size // g
    node, local = divmod(rank, g)
    cross = cross_ranks(rank, size, g)
    mine = local * m
    phase1 = (
        splits(size, {cross[k]: own[mine + k] for k in range(m)}),
        splits(size, {r: own[mine + node] for r in cross}),
    )
    phase2 = (
        splits(size, {r: again[mine + node] for r in cross}),
        splits(size, {cross[k]: again[mine + k] for k in range(m)}),
    )
    return phase1, phase2


def steps(job: Job, i: int) -> Steps:
    """Buffer ``i`` through the four collectives; one :class:`Piece` per sub-shard and run of one
    width (``bits="auto"``), each one re-quantized payload."""
    ops, t = job.ops, job.transport
    n, me = t.size, t.rank
    g = local_size(t)
    m = n // g
    node, local = divmod(me, g)
    p = plan(*job.layout.buffers[i], n, me, job.first, job.second, segments=job.segments, g=g)
    mine = p.parts[local * m : (local + 1) * m]
    a, b = mine[0][0], mine[-1][1]
    acc, early = yield from node_sum(job, i, [(p.parts[j * m][0], p.parts[j * m + m - 1][1]) for j in range(g)], g)
    if job.collect_first and b > a and job.widths is None:
        job.add_first_statistics(ops.statistics(acc, job.first))

    # 2. the node's sum of each sub-shard to its owner on every node; the owner sums the nodes'
    runs = [job.segments(sa, sb) for sa, sb in mine]
    payloads = [
        joined(
            ops,
            [
                job.encode(acc[ra - a : rb - a], q1, job.seed(i, 5, k, s), ("node", ra, rb))
                for s, (ra, rb, q1, _) in enumerate(r)
            ],
        )
        for k, r in enumerate(runs)
    ]
    job.encoded += sum(int(x.shape[0]) for x in payloads)
    phase1, phase2 = between_splits(n, me, g, p.first, p.second)
    gathered = yield Alltoall(ops.cat(payloads), *phase1, f"h2-{i}")
    sa, sb = mine[node]
    reduced, failure = sum_shard(job, gathered, runs[node], m, sa, sb, f"sub-shard {local}.{node} of buffer {i}")
    failure = early or failure  # a node sum that arrived undecodable poisons what this rank sends on
    again = joined(
        ops,
        [
            job.encode(reduced[ra - sa : rb - sa], q2, job.seed(i, 6, s), ("sum", ra, rb))
            for s, (ra, rb, _, q2) in enumerate(runs[node])
        ],
    )

    # 3. the re-quantized sub-shards to the owners of the same shard on every node
    gathered = yield Alltoall(ops.cat([again if failure is None else poisoned(ops, again)] * m), *phase2, f"h3-{i}")
    bad = poisoned_blocks(ops.to_numpy(gathered), p.second[local * m : (local + 1) * m])
    if failure is None and bad:
        failure = ProtocolError(
            f"{PREFIX}: rank(s) {[cross_ranks(me, n, g)[k] for k in bad]} received invalid payloads from "
            f"the other nodes for their sub-shards of buffer {i} (see their errors); refusing to decode on every rank"
        )
    if failure is None:
        try:
            expected = [[(rb - ra, q) for ra, rb, _, q in r] for r in runs]
            check_segments(ops, gathered, expected, f"shard {local} of buffer {i}")
        except ProtocolError as err:
            failure = err

    # 4. every sub-shard of this shard to the node's ranks
    block = [sum(p.second[j * m : (j + 1) * m]) for j in range(g)]
    gathered = yield from forward_in_node(job, i, gathered, block, failure, f"h4-{i}", "between nodes")
    expected = [[(rb - ra, q) for ra, rb, _, q in job.segments(pa, pb)] for pa, pb in p.parts]
    offsets = check_segments(ops, gathered, expected, f"buffer {i} from the node")
    return [
        Piece(ra, rb, gathered, (offsets[j][s],), job.frozen(q))
        for j, (pa, pb) in enumerate(p.parts)
        for s, (ra, rb, _, q) in enumerate(job.segments(pa, pb))
    ]


def empty_first(ops, size: int) -> Alltoall:
    """The first collective of ``steps(job, 0)`` with nothing to contribute (see allgather's)."""
    return Alltoall(ops.from_numpy(np.zeros(0, dtype=np.uint8)), [0] * size, [0] * size, "h1-0")


EXCHANGE = Exchange(
    NAME,
    5,
    STAGES,
    steps,
    plan,
    empty_first,
    requantizes=True,
    own_first_statistics=True,
    node_aware=True,
    graph=True,
)
