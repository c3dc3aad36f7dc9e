"""Pack level indices into a ``bits``-bit, LSB-first bit stream (wire format of ``docs/design/design.md``).

The code of coordinate ``i`` occupies stream bits ``[i*bits, (i+1)*bits)``, value bit 0 first;
stream bit ``k`` is bit ``k % 8`` of byte ``k // 8``; unused trailing bits are 0. Eight codes make
exactly ``bits`` bytes, so both directions work on groups of 8 codes held in one little-endian
64-bit word, of which the low ``bits`` bytes go on the wire.
"""

from __future__ import annotations

import numpy as np

from .methods import MAX_BITS, MIN_BITS

_SHIFTS = np.arange(8, dtype=np.uint64)  # position of a code within its group of 8
_CHUNK_GROUPS = 1 << 17  # groups of 8 codes per pass: bounds the uint64 temporaries (~8 MiB)


def _check_bits(bits: int) -> int:
    if isinstance(bits, bool) or not isinstance(bits, (int, np.integer)):
        raise ValueError(f"bits must be an integer from {MIN_BITS} to {MAX_BITS}, got {bits!r}")
    if not MIN_BITS <= bits <= MAX_BITS:
        raise ValueError(f"bits must be from {MIN_BITS} to {MAX_BITS}, got {bits}")
    return int(bits)


def packed_size(n: int, bits: int) -> int:
    """Bytes taken by ``n`` codes of ``bits`` bits: ``ceil(n * bits / 8)``."""
    return (int(n) * int(bits) + 7) // 8


def pack_codes(codes: np.ndarray, bits: int) -> np.ndarray:
    """Pack codes into an LSB-first bit stream.

    Parameters
    ----------
    codes : np.ndarray, shape (n,), dtype uint8
        Level indices, each ``< 2**bits`` (any shape is flattened).
    bits : int
        Bits per code, 2 to 8.

    Returns
    -------
    np.ndarray, shape (ceil(n * bits / 8),), dtype uint8
    """
    bits = _check_bits(bits)
    codes = np.asarray(codes)
    if codes.dtype != np.uint8:
        raise ValueError(f"codes must be uint8, got {codes.dtype}")
    codes = codes.ravel()
    n = codes.size
    if n and int(codes.max()) >> bits:
        raise ValueError(f"code {int(codes.max())} does not fit in {bits} bits")
    groups = -(-n // 8)
    out = np.empty(groups * bits, dtype=np.uint8)
    shifts = _SHIFTS * np.uint64(bits)
    for g0 in range(0, groups, _CHUNK_GROUPS):
        g1 = min(g0 + _CHUNK_GROUPS, groups)
        block = codes[g0 * 8 : g1 * 8]
        if block.size < (g1 - g0) * 8:  # last, partial group: pad with zero codes
            block = np.concatenate([block, np.zeros((g1 - g0) * 8 - block.size, np.uint8)])
        words = (block.reshape(-1, 8).astype(np.uint64) << shifts).sum(axis=1, dtype=np.uint64)
        out[g0 * bits : g1 * bits] = words.astype("<u8").view(np.uint8).reshape(-1, 8)[:, :bits].ravel()
    return out[: packed_size(n, bits)]


def unpack_codes(buf: np.ndarray, bits: int, n: int) -> np.ndarray:
    """Inverse of :func:`pack_codes`.

    Parameters
    ----------
    buf : np.ndarray, shape (ceil(n * bits / 8),), dtype uint8
        The bit stream; its length must be exactly ``ceil(n * bits / 8)``.
    bits : int
        Bits per code, 2 to 8.
    n : int
        Number of codes.

    Returns
    -------
    np.ndarray, shape (n,), dtype uint8
    """
    bits = _check_bits(bits)
    n = int(n)
    if n < 0:
        raise ValueError(f"number of codes must be >= 0, got {n}")
    buf = np.asarray(buf)
    if buf.dtype != np.uint8:
        raise ValueError(f"packed codes must be uint8, got {buf.dtype}")
    buf = buf.ravel()
    if buf.size != packed_size(n, bits):
        raise ValueError(f"packed codes have {buf.size} bytes, {n} codes of {bits} bits need {packed_size(n, bits)}")
    groups = -(-n // 8)
    out = np.empty(groups * 8, dtype=np.uint8)
    shifts = _SHIFTS * np.uint64(bits)
    mask = np.uint64((1 << bits) - 1)
    for g0 in range(0, groups, _CHUNK_GROUPS):
        g1 = min(g0 + _CHUNK_GROUPS, groups)
        block = buf[g0 * bits : g1 * bits]
        if block.size < (g1 - g0) * bits:  # last, partial group: pad with zero bytes
            block = np.concatenate([block, np.zeros((g1 - g0) * bits - block.size, np.uint8)])
        raw = np.zeros((g1 - g0, 8), dtype=np.uint8)
        raw[:, :bits] = block.reshape(-1, bits)
        words = raw.view("<u8").ravel()
        out[g0 * 8 : g1 * 8] = ((words[:, None] >> shifts) & mask).astype(np.uint8).ravel()
    return out[:n]
