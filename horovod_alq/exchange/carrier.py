"""A fused round's handshake carried in the first collective that moves payloads (issue 66).

On a transport that takes blocks of any size from each rank by itself (Horovod: ``variable_sizes``)
the handshake of :meth:`.fused.FusedRound.run` is not an allreduce of its own: every rank sends
every rank, in one alltoall under the handshake's name, its handshake vector, the index of the
buffer whose first collective rides along (-1: none) and that collective's block for the receiver.
Each rank takes the maximum of the vectors itself (what the allreduce gave) and uses the carried
blocks only if every rank carried the same buffer and the handshake agrees; otherwise the blocks
are dropped and that buffer issues its first collective again, as it does without a carrier.
Payloads and seeds do not change, so neither do results nor byte counts.

Every rank issues the carrier whatever it carries (a rank that failed carries nothing), so no rank
waits for a collective another will not issue. Rounds whose first collective sends more than
:data:`CARRY_BYTES` from this rank carry nothing: copying the blocks beside the headers would cost
more than the collective it saves.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ..core.protocol import PREFIX, ProtocolError
from .interfaces import Tensor, TensorOps, Transport
from .job import Allgather, Alltoall

#: The most bytes a rank's first payload collective may send and still ride with the handshake.
CARRY_BYTES = 4 << 20
_HEAD = 2  # int64 after the handshake vector: the carried buffer's index and the block's bytes


def carries(transport: Transport) -> bool:
    """Whether rounds over ``transport`` carry their handshake (the same on every rank of a job)."""
    return bool(getattr(transport, "variable_sizes", False))


def small(request: Allgather | Alltoall, size: int) -> bool:
    """Whether ``request`` is small enough to ride with the handshake (:data:`CARRY_BYTES`)."""
    if isinstance(request, Allgather):
        return int(request.payload.shape[0]) * size <= CARRY_BYTES
    return sum(int(s) for s in request.splits) <= CARRY_BYTES


@dataclass
class Carried:
    """What came back with the handshake: the MAX-reduced handshake vector, the buffer every rank
    carried (-1 where they differ or none did) and, if any, the result of its first collective
    (every rank's block in rank order, as the collective itself returns it)."""

    reduced: np.ndarray
    index: int
    result: Tensor | None


def _blocks(request: Allgather | Alltoall | None, ops: TensorOps, size: int, rank: int) -> list:
    """``request``'s block for each rank (none: empty blocks)."""
    if request is None:
        empty = ops.from_numpy(np.zeros(0, dtype=np.uint8))
        return [empty] * size
    if isinstance(request, Allgather):
        return [request.payload] * size
    bounds = np.concatenate([[0], np.cumsum(request.splits)]).astype(np.int64).tolist()
    return [request.payload[bounds[j] : bounds[j + 1]] for j in range(size)]


def _expected(request: Allgather | Alltoall | None, size: int) -> list[int]:
    if request is None:
        return [0] * size
    if isinstance(request, Allgather):
        return [int(s) for s in request.sizes]
    return [int(r) for r in request.received]


def carry(
    transport: Transport,
    ops: TensorOps,
    vec: np.ndarray,
    index: int,
    request: Allgather | Alltoall | None,
    name: str,
) -> Carried:
    """Run the handshake ``vec`` (int64, :func:`~horovod_alq.core.handshake.handshake_vector`) with
    buffer ``index``'s first collective ``request`` (None and -1: nothing carried) in one alltoall
    named ``name``; every rank gets the same :class:`Carried`."""
    n, me = transport.size, transport.rank
    hs = np.ascontiguousarray(vec, dtype="<i8")
    pieces, splits = [], []
    for block in _blocks(request, ops, n, me):
        k = int(block.shape[0])
        head = np.concatenate([hs, np.array([index, k], dtype="<i8")]).view(np.uint8)
        pieces += [ops.from_numpy(head), block]
        splits.append(head.size + k)
    head_bytes = 8 * (hs.size + _HEAD)
    received = [head_bytes + k for k in _expected(request, n)]
    got = transport.alltoall(ops.cat(pieces), splits, received, name)()
    total, pos = int(got.shape[0]), 0
    vectors, indices, blocks = [], [], []
    for r in range(n):
        if pos + head_bytes > total:
            raise ProtocolError(f"{PREFIX}: the handshake of rank {r} is cut short ({total} bytes in all)")
        head = ops.to_numpy(got[pos : pos + head_bytes]).copy().view("<i8")
        k = int(head[-1])
        if k < 0 or pos + head_bytes + k > total:
            raise ProtocolError(f"{PREFIX}: the handshake of rank {r} announces {k} bytes, {total - pos} arrived")
        vectors.append(head[: hs.size])
        indices.append(int(head[-2]))
        blocks.append(got[pos + head_bytes : pos + head_bytes + k])
        pos += head_bytes + k
    if pos != total:
        raise ProtocolError(f"{PREFIX}: the handshakes hold {pos} bytes, {total} arrived")
    reduced = np.max(np.stack(vectors), axis=0)
    agreed = indices[0] if len(set(indices)) == 1 and indices[0] >= 0 else -1
    result = _joined(ops, blocks) if agreed >= 0 else None
    return Carried(reduced, agreed, result)


def _joined(ops: TensorOps, blocks: Sequence[Tensor]) -> Tensor:
    nonempty = [b for b in blocks if int(b.shape[0])]
    if not nonempty:
        return ops.from_numpy(np.zeros(0, dtype=np.uint8))
    return ops.cat(nonempty)
