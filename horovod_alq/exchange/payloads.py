"""The check of received payloads: every rank's headers against this rank's quantizers, then the sizes."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ..core.bucket_widths import BUDGET_UNITS
from ..core.methods import get_method
from ..core.protocol import PREFIX, ProtocolError
from ..core.quantizer import Quantizer
from ..core.wire import HEADER_SIZE, check_header, parse_header
from .interfaces import Tensor, TensorOps

#: The first bytes of a poisoned payload: a rank that found invalid payloads sends it on in place of
#: its own, so that every rank raises after the exchange's last collective (none waits in one that
#: another rank will not issue).
POISON = b"ER"


def poisoned(ops: TensorOps, payload: Tensor) -> Tensor:
    """``payload`` marked as poisoned (its header overwritten; an empty one stays empty)."""
    host = ops.to_numpy(payload).copy()
    if host.size >= HEADER_SIZE:
        host[:2] = np.frombuffer(POISON, dtype=np.uint8)
        host[2:HEADER_SIZE] = 0
    return ops.from_numpy(host)


def poisoned_blocks(host: np.ndarray, sizes: Sequence[int]) -> list[int]:
    """The indices of the blocks of ``host`` (back to back, ``sizes[j]`` bytes each) that begin poisoned."""
    starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64).tolist()
    return [j for j, s in enumerate(starts[:-1]) if host.size >= s + 2 and bytes(host[s : s + 2]) == POISON]


def raise_if_poisoned(
    ops: TensorOps, gathered: Tensor, sizes: Sequence[int], failure: Exception | None, what: str, ranks=None
) -> None:
    """Raise if a block of ``gathered`` (``sizes[j]`` bytes each, from ``ranks[j]``, default ``j``)
    arrived poisoned: this rank's own ``failure`` if it met one, else a ProtocolError naming the
    ranks that did (they received invalid ``what``), so that every rank raises."""
    bad = poisoned_blocks(ops.to_numpy(gathered), sizes)
    if not bad:
        return
    if failure is not None:
        raise failure
    names = bad if ranks is None else [ranks[j] for j in bad]
    raise ProtocolError(
        f"{PREFIX}: rank(s) {names} received invalid {what} (see their errors); refusing to decode on every rank"
    )


def check_payloads(
    ops: TensorOps, gathered: Tensor, numels: Sequence[int], quantizer: Quantizer, what: str
) -> list[int]:
    """Validate the payloads of every rank, back to back in ``gathered`` (rank ``r``'s holds
    ``numels[r]`` elements), and return their offsets. Raises :class:`ProtocolError` naming the rank."""
    return check_host_payloads(ops.to_numpy(gathered), numels, quantizer, what)


def check_host_payloads(host: np.ndarray, numels: Sequence[int], quantizer: Quantizer, what: str) -> list[int]:
    """:func:`check_payloads` on a host copy (uint8). The headers are read at their expected offsets
    first (the first rank whose payload differs in configuration is named, even when its size then
    differs), then the total size."""
    return [o[0] for o in check_host_segments(host, [[(n, quantizer)] for n in numels], what)]


def check_segments(
    ops: TensorOps, gathered: Tensor, expected: Sequence[Sequence[tuple[int, Quantizer]]], what: str
) -> list[list[int]]:
    """Validate every rank's run of payloads, back to back in ``gathered``: rank ``r``'s holds one
    payload per ``(elements, quantizer)`` of ``expected[r]`` (tensors of several widths in one
    buffer, ``bits="auto"``). Returns the offsets of each rank's payloads."""
    return check_host_segments(ops.to_numpy(gathered), expected, what)


def check_host_segments(
    host: np.ndarray, expected: Sequence[Sequence[tuple[int, Quantizer]]], what: str
) -> list[list[int]]:
    """:func:`check_segments` on a host copy (uint8): headers first, then the total size."""
    offsets, pos = [], 0
    for rank_expected in expected:
        offsets.append([])
        for n, q in rank_expected:
            offsets[-1].append(pos)
            pos += q.payload_bytes(n)
    for rank, rank_expected in enumerate(expected):
        for offset, (n, q) in zip(offsets[rank], rank_expected):
            if offset + HEADER_SIZE > host.size:
                break
            try:
                header = parse_header(host[offset : offset + HEADER_SIZE])
                if q.bits == 0 and header.bits == 0 and header.budget256 != q.budget256:
                    raise ValueError(
                        f"payload made with bit_budget={header.budget256 / BUDGET_UNITS}, this rank "
                        f"uses {q.budget256 / BUDGET_UNITS}"
                    )
                check_header(header, get_method(q.method).id, q.bits, q.bucket_size, q.fingerprint, q.norm)
                if header.numel != n:
                    raise ValueError(f"payload has {header.numel} elements, expected {n}")
                if q.bits == 0 and offset + q.payload_bytes(n) <= host.size:  # widths per bucket: its parts too
                    q.layout(host, offset, n)
            except ValueError as err:
                raise ProtocolError(
                    f"{PREFIX}: {what}: the payload of rank {rank} does not match this rank's "
                    f"({q.method}, bits={q.bits}, bucket_size={q.bucket_size}): {err}"
                ) from None
    if host.size != pos:
        raise ProtocolError(f"{PREFIX}: {what}: received {host.size} bytes, expected {pos}")
    return offsets
