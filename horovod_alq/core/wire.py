"""Payload header, levels fingerprint and payload slicing (wire format version 2, ``docs/design/design.md``).

A payload is a 32-byte header, one float32 norm per bucket, then the packed codes::

    offset size field
    0      2    magic b"AQ"
    2      1    format version (2)
    3      1    method id
    4      1    bits per coordinate (2..8), or 0: widths per bucket (a mixed payload, below)
    5      1    bucket norm code: 0 = l2, 1 = linf (version 1: reserved, 0)
    6      2    mixed payloads: the bit budget in 1/256 of a bit (512..2048); else 0
    8      4    bucket size d (uint32)
    12     4    CRC-32 of the 32 header bytes with this field set to 0
    16     8    element count n (uint64)
    24     8    levels fingerprint (uint64)
    32     4*B  float32 norms, B = ceil(n / d)
    32+4B  C    codes, C = ceil(n * bits / 8)

A mixed payload (``bits="auto", bits_per="bucket"``, :mod:`.bucket_widths`) is its header, the
width of each of its B buckets (one byte each), their CRC-32 (:func:`widths_crc`), one ordinary payload per
width of :data:`BUCKET_WIDTHS` (the buckets of that width back to back), then zeros up to
:func:`mixed_payload_size`.

Only the header is checksummed: a corrupted norm or code byte decodes to wrong values silently.
"""

from __future__ import annotations

import hashlib
import struct
import zlib
from dataclasses import dataclass

import numpy as np

from .methods import MAX_BITS, METHODS_BY_ID, MIN_BITS, NORMS, NORMS_BY_CODE
from .packing import packed_size

MAGIC = b"AQ"
VERSION = 2  # 2: byte 5 carries the bucket norm (adaptive methods take either)
HEADER_SIZE = 32
_HEADER = struct.Struct("<2sBBBBHIIQQ")
_CRC_OFFSET = 12
assert _HEADER.size == HEADER_SIZE


def levels_fingerprint(levels: np.ndarray) -> int:
    """Fingerprint of a level set: blake2b (8-byte digest) of the levels as little-endian float64.

    Parameters
    ----------
    levels : array_like, shape (L,), float

    Returns
    -------
    int
        The 8 digest bytes read as a little-endian uint64, so that the header's bytes 24..32
        are the digest itself.
    """
    data = np.ascontiguousarray(levels, dtype="<f8").tobytes()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def num_buckets(numel: int, bucket_size: int) -> int:
    """``ceil(numel / bucket_size)``."""
    return -(-int(numel) // int(bucket_size))


def bucket_lengths(numel: int, bucket_size: int) -> np.ndarray:
    """The coordinates of each bucket of ``numel`` (int64; the last bucket may be short)."""
    b = num_buckets(numel, bucket_size)
    out = np.full(b, bucket_size, dtype=np.int64)
    if b:
        out[-1] = numel - (b - 1) * bucket_size
    return out


def payload_size(numel: int, bits: int, bucket_size: int) -> int:
    """Bytes of a payload: ``32 + 4 * ceil(numel / bucket_size) + ceil(numel * bits / 8)``."""
    return HEADER_SIZE + 4 * num_buckets(numel, bucket_size) + packed_size(numel, bits)


#: The widths a bucket of a mixed payload may take (every width has its own payload in it).
BUCKET_WIDTHS: tuple[int, ...] = tuple(range(2, 9))
#: Budget resolution on the wire: the header carries the budget in 1/256 of a bit.
BUDGET_UNITS = 256


def budget_units(budget: float) -> int:
    """``budget`` in 1/256 of a bit, rounded down (what the payload sizes use)."""
    return int(np.floor(float(budget) * BUDGET_UNITS + 1e-9))


def code_bits(numel: int, budget256: int) -> int:
    """The code bits a mixed payload of ``numel`` coordinates may spend."""
    return int(budget256) * int(numel) // BUDGET_UNITS


def mixed_payload_size(numel: int, bucket_size: int, budget256: int) -> int:
    """Bytes of a mixed payload: header, a width byte and a norm per bucket, the widths' CRC-32, one header per width,
    and room for ``code_bits`` bits of codes (the codes of each width start on a byte: one more)."""
    b = num_buckets(numel, bucket_size)
    return HEADER_SIZE + b + 4 + len(BUCKET_WIDTHS) * HEADER_SIZE + 4 * b + code_bits(numel, budget256) // 8 + 1


def widths_crc(widths: np.ndarray) -> bytes:
    """The 4 bytes that follow the widths of a mixed payload: their CRC-32, little-endian."""
    return zlib.crc32(np.ascontiguousarray(widths, dtype=np.uint8).tobytes()).to_bytes(4, "little")


@dataclass(frozen=True)
class Header:
    """The fields of a payload header."""

    method_id: int
    bits: int
    bucket_size: int
    numel: int
    fingerprint: int
    version: int = VERSION
    norm: str | None = None  # "l2" or "linf"; None: the method's default norm
    budget256: int = 0  # mixed payloads (bits 0): the bit budget in 1/256 of a bit

    def __post_init__(self) -> None:
        if self.norm is None:
            method = METHODS_BY_ID.get(self.method_id)
            object.__setattr__(self, "norm", method.norm if method is not None else "l2")

    @property
    def method(self) -> str:
        """Method name of ``method_id``."""
        return METHODS_BY_ID[self.method_id].name

    @property
    def num_buckets(self) -> int:
        return num_buckets(self.numel, self.bucket_size)

    @property
    def payload_size(self) -> int:
        """Total bytes of the payload this header describes."""
        if self.bits == 0:
            return mixed_payload_size(self.numel, self.bucket_size, self.budget256)
        return payload_size(self.numel, self.bits, self.bucket_size)


def pack_header(header: Header) -> bytes:
    """Serialize a header to its 32 bytes, checksum included."""
    if header.norm not in NORMS:
        raise ValueError(f"norm must be one of {', '.join(NORMS)}, got {header.norm!r}")
    fields = [
        MAGIC,
        header.version,
        header.method_id,
        header.bits,
        NORMS[header.norm],
        header.budget256,
        header.bucket_size,
        0,
        header.numel,
        header.fingerprint,
    ]
    raw = bytearray(_HEADER.pack(*fields))
    struct.pack_into("<I", raw, _CRC_OFFSET, zlib.crc32(raw))
    return bytes(raw)


def _as_bytes(payload) -> np.ndarray:
    if isinstance(payload, (bytes, bytearray, memoryview)):
        return np.frombuffer(payload, dtype=np.uint8)
    payload = np.asarray(payload)
    if payload.dtype != np.uint8 or payload.ndim != 1:
        raise ValueError(f"payload must be a 1-D uint8 array, got {payload.dtype} of shape {payload.shape}")
    return payload


def parse_header(payload) -> Header:
    """Read and validate the header at the start of ``payload``.

    Parameters
    ----------
    payload : np.ndarray (uint8, 1-D) or bytes-like
        At least the 32 header bytes.

    Raises
    ------
    ValueError
        Too short, bad magic, unsupported version, header checksum mismatch, unknown method id,
        bits out of range or zero bucket size.
    """
    buf = _as_bytes(payload)
    if buf.size < HEADER_SIZE:
        raise ValueError(f"payload truncated: {buf.size} bytes, shorter than the {HEADER_SIZE}-byte header")
    raw = bytearray(buf[:HEADER_SIZE].tobytes())
    magic, version, method_id, bits, norm_code, budget256, bucket_size, crc, numel, fingerprint = _HEADER.unpack(raw)
    if magic != MAGIC:
        raise ValueError(f"bad magic {magic!r}, expected {MAGIC!r}: not a horovod-alq payload")
    struct.pack_into("<I", raw, _CRC_OFFSET, 0)
    if zlib.crc32(raw) != crc:
        raise ValueError("header checksum mismatch (corrupted header)")
    if version != VERSION:
        raise ValueError(f"unsupported payload format version {version}, this build reads {VERSION}")
    if method_id not in METHODS_BY_ID:
        raise ValueError(f"unknown method id {method_id} in payload header")
    if bits == 0:
        if not MIN_BITS * 256 <= budget256 <= MAX_BITS * 256:
            raise ValueError(
                f"mixed payload header with budget {budget256}/256 bits, must be from {MIN_BITS} to {MAX_BITS}"
            )
    elif not MIN_BITS <= bits <= MAX_BITS:
        raise ValueError(f"bits={bits} in payload header, must be from {MIN_BITS} to {MAX_BITS} (or 0: mixed)")
    if bucket_size == 0:
        raise ValueError("bucket size 0 in payload header")
    if norm_code not in NORMS_BY_CODE:
        raise ValueError(f"unknown norm code {norm_code} in payload header")
    return Header(
        method_id,
        bits,
        bucket_size,
        numel,
        fingerprint,
        version,
        NORMS_BY_CODE[norm_code],
        budget256 if bits == 0 else 0,
    )


def parse_payload(payload) -> tuple[Header, np.ndarray, np.ndarray]:
    """Validate a whole payload and slice it.

    Parameters
    ----------
    payload : np.ndarray (uint8, 1-D) or bytes-like

    Returns
    -------
    header : Header
    norms : np.ndarray, shape (B,), dtype '<f4'
        View of the bucket norms, ``B = ceil(numel / bucket_size)``.
    codes : np.ndarray, shape (ceil(numel * bits / 8),), dtype uint8
        View of the packed codes.

    Raises
    ------
    ValueError
        Header problems (see :func:`parse_header`) or a length that differs from the header's.
    """
    buf = _as_bytes(payload)
    header = parse_header(buf)
    expected = header.payload_size
    if buf.size < expected:
        raise ValueError(f"payload truncated: {buf.size} bytes, header says {expected}")
    if buf.size > expected:
        raise ValueError(f"payload too long: {buf.size} bytes, header says {expected}")
    end_norms = HEADER_SIZE + 4 * header.num_buckets
    norms = buf[HEADER_SIZE:end_norms].view("<f4")
    return header, norms, buf[end_norms:]


def check_header(header: Header, method_id: int, bits: int, bucket_size: int, fingerprint: int, norm: str) -> None:
    """Raise ValueError saying how ``header`` differs from the local quantizer's configuration
    (method, bucket norm, bits, bucket size, levels fingerprint; checked in that order)."""
    if header.method_id != method_id:
        raise ValueError(
            f"payload made with method {header.method}, this quantizer uses {METHODS_BY_ID[method_id].name}"
        )
    if header.norm != norm:
        raise ValueError(f"payload made with norm={header.norm}, this quantizer uses norm={norm}")
    if header.bits != bits:
        raise ValueError(f"payload made with bits={header.bits}, this quantizer uses bits={bits}")
    if header.bucket_size != bucket_size:
        raise ValueError(
            f"payload made with bucket_size={header.bucket_size}, this quantizer uses bucket_size={bucket_size}"
        )
    if header.fingerprint != fingerprint:
        raise ValueError(f"levels differ: payload fingerprint {header.fingerprint:#018x}, local {fingerprint:#018x}")


def split_payloads(buf) -> list[np.ndarray]:
    """Split a concatenation of payloads (e.g. an allgather's output) into the individual payloads.

    Each header gives the size of its payload; the next payload starts right after it.

    Parameters
    ----------
    buf : np.ndarray (uint8, 1-D) or bytes-like

    Returns
    -------
    list of np.ndarray (uint8 views into ``buf``)

    Raises
    ------
    ValueError
        A header is invalid, or the last payload runs past the end of ``buf``.
    """
    buf = _as_bytes(buf)
    parts, offset = [], 0
    while offset < buf.size:
        try:
            size = parse_header(buf[offset:]).payload_size
        except ValueError as err:
            raise ValueError(f"payload {len(parts)} at byte {offset}: {err}") from None
        if offset + size > buf.size:
            raise ValueError(
                f"payload {len(parts)} at byte {offset} truncated: {buf.size - offset} bytes, header says {size}"
            )
        parts.append(buf[offset : offset + size])
        offset += size
    return parts
