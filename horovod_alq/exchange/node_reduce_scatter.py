"""Node-aware reduce-scatter (FSDP2 across nodes): exact inside a node, codes only between nodes.

The buffer is N shards of ``S`` (shard ``r`` is rank ``r``'s, as in :mod:`.reduce_scatter`); the
ranks form nodes of ``G`` consecutive ranks (:func:`.topology.local_size`). Two collectives,
global alltoalls in which ranks outside a group exchange nothing:

1. exact reduce-scatter inside the node: local rank ``j`` receives, from every rank of its node,
   the float32 shards of the ranks ``k G + j`` (one per node ``k``) and sums them: its node's sum of
   each of those shards;
2. across nodes: it quantizes its node's sum of shard ``k G + j`` and sends the codes to rank
   ``k G + j``, which decodes and sums the nodes' payloads of its own shard (in node order).

One quantization, of the node sums (the shape of ZeRO++'s qgZ and SDP4Bit): between nodes each
rank sends ``(nodes - 1)`` payloads of ``S`` coordinates, the node as a whole ``(nodes - 1) / nodes``
of the buffer's codes; the flat reduce-scatter's node sends ``G`` times that. In refit rounds the
ranks collect the statistics of what they quantize (the node sums). Streamed rounds only.
"""

from __future__ import annotations

import numpy as np

from .descriptor import Exchange
from .job import Alltoall, Job, Piece, Steps
from .payloads import check_segments
from .reduce_scatter import shard_bounds, span  # noqa: F401 - span: where the result lies
from .topology import local_size

#: Collectives per buffer.
STAGES = 2
NAME = "hierarchical-reduce-scatter"


def steps(job: Job, i: int) -> Steps:
    """Buffer ``i`` through the two collectives; one :class:`Piece` per run of one width of this
    rank's shard (``bits="auto"``: :meth:`Job.segments`)."""
    ops, t = job.ops, job.transport
    n, me = t.size, t.rank
    g = local_size(t)
    node, local = divmod(me, g)
    nodes = n // g
    shards = shard_bounds(job, i)
    per = shards[0][1] - shards[0][0]
    peers = [node * g + j for j in range(g)]

    # 1. to each rank of the node, its column of shards (one per node), in float32
    x = job.stream
    column = [[shards[k * g + j] for k in range(nodes)] for j in range(g)]
    pieces = [ops.as_bytes(x[a:b]) for j in range(g) for a, b in column[j]]
    floats = 4 * nodes * per
    to = [floats if r in peers else 0 for r in range(n)]
    gathered = yield Alltoall(ops.cat(pieces) if pieces else ops.from_numpy(np.zeros(0, np.uint8)), to, to, f"nrs1-{i}")
    got = ops.from_bytes(gathered)
    acc = ops.zeros(nodes * per)
    for k in range(g):  # in rank order
        acc += got[k * nodes * per : (k + 1) * nodes * per]

    # 2. the node's sum of shard k G + local, quantized, to its owner on node k
    payloads, sizes = [], []
    for k, (a, b) in enumerate(column[local]):
        part = acc[k * per : (k + 1) * per]
        runs = job.segments(a, b)
        for m, (ra, rb, q, _) in enumerate(runs):
            payloads.append(job.encode(part[ra - a : rb - a], q, job.seed(i, k, 5, m), ("node", ra, rb)))
        sizes.append(sum(q.payload_bytes(rb - ra) for ra, rb, q, _ in runs))
        if job.collect_first and job.widths is None and b > a:
            job.add_first_statistics(ops.statistics(part, job.first))
    job.encoded += sum(int(p.shape[0]) for p in payloads)
    splits = [0] * n
    for k in range(nodes):
        splits[k * g + local] = sizes[k]
    own = job.segments(*shards[me])
    mine = sum(q.payload_bytes(rb - ra) for ra, rb, q, _ in own)
    received = [mine if r % g == local else 0 for r in range(n)]
    gathered = yield Alltoall(ops.cat(payloads), splits, received, f"nrs2-{i}")
    offsets = check_segments(
        ops, gathered, [[(rb - ra, q) for ra, rb, q, _ in own]] * nodes, f"shard {me} of buffer {i} from the nodes"
    )
    return [
        Piece(ra, rb, gathered, tuple(o[m] for o in offsets), job.frozen(q)) for m, (ra, rb, q, _) in enumerate(own)
    ]


EXCHANGE = Exchange(
    NAME, 4, STAGES, steps, span=span, own_first_statistics=True, node_aware=True, shard_of="hierarchical"
)
