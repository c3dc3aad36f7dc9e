"""What every codec backend shares: the checks of ``encode``'s arguments and the window of a
decode (:func:`payload_window`, for backends that decode whole payloads only)."""

from __future__ import annotations

from typing import Sequence

import torch

from ...core.wire import HEADER_SIZE

#: The dtypes every backend encodes.
DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def payload_window(
    payloads: torch.Tensor,
    offsets: Sequence[int],
    *,
    start: int,
    n: int,
    numel: int | None,
    bits: int,
    bucket_size: int,
) -> tuple[torch.Tensor, list[int]]:
    """Coordinates ``[start, start + n)`` of payloads of ``numel`` coordinates each (None: n), as
    payloads of their own (header bytes kept, the window's norms and codes copied): for backends
    that decode whole payloads only. The payloads themselves when the window is all of them."""
    numel = n if numel is None else int(numel)
    if start == 0 and numel == n:
        return payloads, list(offsets)
    d = int(bucket_size)
    if start % d or (start * bits) % 8 or start + n > numel:
        raise ValueError(f"decode_sum: start {start} is not on a bucket and byte boundary inside {numel}")
    nb = -(-numel // d)
    parts = []
    for offset in offsets:
        norms = offset + HEADER_SIZE + 4 * (start // d)
        codes = offset + HEADER_SIZE + 4 * nb + start * bits // 8
        parts += [
            payloads[offset : offset + HEADER_SIZE],
            payloads[norms : norms + 4 * -(-n // d)],
            payloads[codes : codes + -(-n * bits // 8)],
        ]
    window = torch.cat(parts) if parts else payloads[:0]
    size = HEADER_SIZE + 4 * -(-n // d) + -(-n * bits // 8)
    return window, [k * size for k in range(len(offsets))]


def check_encode_args(flat: torch.Tensor, bits: int, bucket_size: int, norm: str, seed: int) -> None:
    """The argument checks every backend's encode shares."""
    if flat.dim() != 1 or flat.dtype not in DTYPES:
        raise ValueError(
            f"encode: flat must be a 1-D float16/bfloat16/float32/float64 tensor, got "
            f"{flat.dtype} of shape {tuple(flat.shape)}"
        )
    if not 2 <= int(bits) <= 8:
        raise ValueError(f"encode: bits must be 2..8, got {bits}")
    if int(bucket_size) <= 0:
        raise ValueError(f"encode: bucket_size must be positive, got {bucket_size}")
    if norm not in ("l2", "linf"):
        raise ValueError(f"encode: norm must be 'l2' or 'linf', got {norm!r}")
    if not 0 <= int(seed) < 1 << 63:
        raise ValueError(f"encode: seed must be in [0, 2**63), got {seed}")
