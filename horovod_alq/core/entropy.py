"""The entropy-coded wire (``wire="entropy"``): payloads re-coded with rANS at the transport.

A fixed-length payload (:mod:`.wire`) spends ``bits`` bits on every code, yet the codes are far from
uniform (ALQ 4 bits carries about 3.15 bits of entropy per coordinate on the GPT's gradients). Here
each payload becomes a *frame* whose codes are coded with a static rANS model: the payload's own
code frequencies, quantized to ``2**PROB_BITS`` and carried in the frame (``2**(bits + 1)`` bytes).
Decoding gives back the fixed-length payload byte for byte, so the decoded values are those of the
fixed wire for the same seed, whatever codec made the payload. Frames are self-delimiting; bytes
that are not a run of plain payloads (float32 sums of the hierarchical exchanges, mixed-width or
poisoned payloads) travel verbatim in a raw frame, and so does a payload that would not shrink.

Frame layout (little-endian)::

    offset size field
    0      2    magic b"AE"
    2      1    frame version (2)
    3      1    kind: 0 raw (the decoded bytes follow verbatim), 1 coded, 2 refused (the sender could
                not code its bytes: its error, UTF-8, follows; every receiver raises naming it)
    4      4    CRC-32 of the whole frame with this field set to 0
    8      8    frame size in bytes, this header included
    16     8    decoded size in bytes
    24     4    kind 1: CRC-32 of the decoded bytes (0 otherwise: the frame's CRC covers raw bytes)
    28     4    reserved, 0
    -- kind 1 (a payload of n codes of b bits in B buckets of d):
    32     32   the payload's header, verbatim
    64     4B   its float32 bucket norms, verbatim
           2S   code frequencies, uint16, S = 2**b, summing to 2**PROB_BITS (0: code absent)
           4B   the coded length of each bucket's stream, uint32
                the streams: per bucket, its LANES = 2 final rANS states (4 bytes each) then their
                renormalization bytes in the order the decoder reads them (codes of the bucket
                first to last; code ``i`` of a bucket is coded by state ``i % 2``, so that the
                two states' arithmetic overlaps)

rANS with a 32-bit state in ``[RANS_L, 256 RANS_L)`` and byte-wise renormalization (Duda's
asymmetric numeral systems, in the byte-aligned form of Giesen's ryg_rans): coding code ``s`` of
frequency ``f`` and cumulative frequency ``c`` maps ``x`` to ``(x // f) * 2**PROB_BITS + x % f + c``
after emitting low bytes while ``x >= f * 2**(31 - PROB_BITS)``. Every state starts at ``RANS_L``
and the decoder must end there with every byte used: with the frame's CRC, a corrupted or
truncated stream raises (ValueError naming what is wrong), it never decodes into other codes; the
CRC of the decoded bytes catches a coder that made a frame which decodes to other bytes. The decoder
checks the sizes a frame states against the bytes the exchange expects before it allocates.

The compiled CPU codec serves the coder (:func:`use_kernel`); the NumPy functions here are its
reference and the fallback (vectorized over buckets: slow, for tests and small payloads).
"""

from __future__ import annotations

import struct
import zlib
from typing import Any

import numpy as np

from .packing import pack_codes, packed_size, unpack_codes
from .wire import HEADER_SIZE, Header, bucket_lengths, num_buckets, parse_header

#: The wire formats a front-end may put on the network (``Settings.wire``).
WIRES = ("fixed", "entropy")
MAGIC = b"AE"
VERSION = 2
FRAME_HEADER = 32
RAW, CODED, REFUSED = 0, 1, 2
#: Frequencies are quantized to this many bits (total ``2**PROB_BITS``).
PROB_BITS = 14
PROB_SCALE = 1 << PROB_BITS
RANS_L = 1 << 23
#: Interleaved states per bucket: code ``i`` of a bucket is coded by state ``i % LANES``.
LANES = 2
_FRAME = struct.Struct("<2sBBIQQII")
assert _FRAME.size == FRAME_HEADER

#: The compiled coder, or None (the NumPy reference).
_KERNEL: Any = None


def check_wire(wire: Any) -> str:
    """``wire`` if it names a wire format, else ValueError listing them."""
    if not isinstance(wire, str) or wire not in WIRES:
        raise ValueError(f"wire must be one of {', '.join(map(repr, WIRES))}, got {wire!r}")
    return wire


def use_kernel(kernel: Any) -> None:
    """Serve the coder with ``kernel`` (``count``, ``encode``, ``decode`` with the signatures of
    :func:`count_codes`, :func:`encode_streams`, :func:`decode_streams`), or the NumPy reference (None)."""
    global _KERNEL
    _KERNEL = kernel


def kernel_name() -> str:
    """``"compiled"`` or ``"numpy"``: what codes frames now."""
    return "numpy" if _KERNEL is None else "compiled"


# ----------------------------------------------------------------------------------- the model
def quantized_frequencies(counts: np.ndarray) -> np.ndarray:
    """Code counts to frequencies summing to ``PROB_SCALE``: proportional, every counted code at
    least 1, absent codes 0 (the rounding excess taken from, or the deficit given to, the largest).

    Parameters
    ----------
    counts : np.ndarray, shape (S,), int
        Occurrences of each code; at least one positive, at most ``PROB_SCALE`` codes counted.
    """
    counts = np.asarray(counts, dtype=np.int64)
    total = int(counts.sum())
    if total <= 0 or np.count_nonzero(counts) > PROB_SCALE:
        raise ValueError(f"cannot model {np.count_nonzero(counts)} codes in {total} occurrences")
    freq = np.where(counts > 0, np.maximum(counts * PROB_SCALE // total, 1), 0)
    excess = int(freq.sum()) - PROB_SCALE
    if excess < 0:
        freq[int(np.argmax(freq))] -= excess
    while excess > 0:  # ends: the frequencies of the counted codes sum to at least their number
        top = int(np.argmax(freq))
        take = min(excess, int(freq[top]) - 1)
        freq[top] -= take
        excess -= take
    return freq.astype(np.uint16)


def code_entropy(counts: np.ndarray) -> float:
    """Empirical entropy of codes with these counts, in bits per code."""
    c = np.asarray(counts, dtype=np.float64)
    p = c[c > 0] / c.sum()
    return float(-(p * np.log2(p)).sum())


# ----------------------------------------------------------------------------------- the coder
def count_codes(codes: np.ndarray, n: int, bits: int) -> np.ndarray:
    """Occurrences of each of the ``2**bits`` codes among the ``n`` packed ``codes`` (int64)."""
    if _KERNEL is not None:
        return _KERNEL.count(codes, n, bits)
    return np.bincount(unpack_codes(codes, bits, n), minlength=1 << bits).astype(np.int64)


def _tables(freq: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    f = np.asarray(freq, dtype=np.uint64)
    return f, np.concatenate([[0], np.cumsum(f)[:-1]]).astype(np.uint64)


def encode_streams(codes: np.ndarray, n: int, d: int, bits: int, freq: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """rANS-code each bucket of ``d`` of the ``n`` packed ``codes`` with ``freq``.

    Returns
    -------
    lengths : np.ndarray, shape (B,), uint32
        Bytes of each bucket's stream.
    streams : np.ndarray, uint8
        The streams back to back.
    """
    if _KERNEL is not None:
        return _KERNEL.encode(codes, n, d, bits, freq)
    b = num_buckets(n, d)
    flat = unpack_codes(codes, bits, n)
    sym = np.zeros(b * d, dtype=np.int64)
    sym[:n] = flat
    sym = sym.reshape(b, d)
    counts = bucket_lengths(n, d)
    f, c = _tables(freq)
    if b and np.any(f[np.unique(flat)] == 0):
        raise ValueError("a code of the payload has frequency 0 in its model")
    cap = 2 * d + 4 * LANES
    out = np.zeros((b, cap), dtype=np.uint8)
    ptr = np.full(b, cap, dtype=np.int64)
    states = np.full((LANES, b), RANS_L, dtype=np.uint64)
    rows = np.arange(b)
    shift = np.uint64(31 - PROB_BITS)
    for i in range(d - 1, -1, -1):
        live = counts > i
        s = sym[:, i]
        fs = np.where(live, f[s], np.uint64(1))
        x = states[i % LANES]
        for _ in range(2):  # f >= 1 and x < 2**31: at most two bytes out
            emit = live & (x >= (fs << shift))
            ptr[emit] -= 1
            out[rows[emit], ptr[emit]] = (x[emit] & np.uint64(0xFF)).astype(np.uint8)
            x = np.where(emit, x >> np.uint64(8), x)
        coded = ((x // fs) << np.uint64(PROB_BITS)) + x % fs + c[s]
        states[i % LANES] = np.where(live, coded, x)
    for lane in range(LANES - 1, -1, -1):  # the final states, little-endian, lane 0 first
        for k in range(4):
            ptr -= 1
            out[rows, ptr] = ((states[lane] >> np.uint64(8 * (3 - k))) & np.uint64(0xFF)).astype(np.uint8)
    lengths = (cap - ptr).astype(np.uint32)
    streams = np.concatenate([out[r, ptr[r] :] for r in range(b)]) if b else np.zeros(0, np.uint8)
    return lengths, streams


def decode_streams(streams: np.ndarray, lengths: np.ndarray, n: int, d: int, bits: int, freq: np.ndarray) -> np.ndarray:
    """Inverse of :func:`encode_streams`: the packed codes (``packed_size(n, bits)`` bytes).
    ValueError where a stream runs out, has bytes left over or does not end in the initial state."""
    if _KERNEL is not None:
        return _KERNEL.decode(streams, lengths, n, d, bits, freq)
    b = num_buckets(n, d)
    lengths = np.asarray(lengths, dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    ends = starts + lengths
    if np.any(lengths < 4 * LANES):
        raise ValueError(f"bucket {int(np.argmax(lengths < 4 * LANES))}: coded stream shorter than its states")
    f, c = _tables(freq)
    slot_symbol = np.repeat(np.arange(f.size), f.astype(np.int64))
    src = np.concatenate([np.asarray(streams, dtype=np.uint8), np.zeros(1, np.uint8)]).astype(np.uint64)
    states = np.zeros((LANES, b), dtype=np.uint64)
    for lane in range(LANES):  # the states, little-endian
        for k in range(4):
            states[lane] |= src[np.minimum(starts + 4 * lane + k, src.size - 1)] << np.uint64(8 * k)
    ptr = starts + 4 * LANES
    counts = bucket_lengths(n, d)
    width = min(d, n)  # a bucket holds at most n codes (one bucket of d > n: n)
    out = np.zeros((b, width), dtype=np.uint8)
    mask = np.uint64(PROB_SCALE - 1)
    for i in range(width):
        live = counts > i
        x = states[i % LANES]
        slot = x & mask
        s = slot_symbol[slot.astype(np.int64)]
        out[:, i] = s
        x = np.where(live, f[s] * (x >> np.uint64(PROB_BITS)) + slot - c[s], x)
        for _ in range(2):
            need = live & (x < np.uint64(RANS_L))
            if np.any(need & (ptr >= ends)):
                raise ValueError(f"bucket {int(np.argmax(need & (ptr >= ends)))}: coded stream truncated")
            x = np.where(need, (x << np.uint64(8)) | src[np.minimum(ptr, src.size - 1)], x)
            ptr = ptr + need
        states[i % LANES] = x
    bad = np.flatnonzero(np.any(states != np.uint64(RANS_L), axis=0) | (ptr != ends))
    if bad.size:
        raise ValueError(
            f"bucket {int(bad[0])}: coded stream corrupted (its decoder does not end in the initial state)"
        )
    return pack_codes(out.ravel()[:n], bits)


# ----------------------------------------------------------------------------------- frames
def _crc(frame: np.ndarray) -> int:
    view = memoryview(frame)
    crc = zlib.crc32(view[:4])
    crc = zlib.crc32(b"\0\0\0\0", crc)
    return zlib.crc32(view[8:], crc)


def _frame(kind: int, body: list, decoded: int, content: int = 0) -> np.ndarray:
    size = FRAME_HEADER + sum(int(np.asarray(p).nbytes) for p in body)
    out = np.empty(size, dtype=np.uint8)
    head = _FRAME.pack(MAGIC, VERSION, kind, 0, size, decoded, content, 0)
    out[:FRAME_HEADER] = np.frombuffer(head, dtype=np.uint8)
    pos = FRAME_HEADER
    for part in body:
        part = np.asarray(part).view(np.uint8).ravel()
        out[pos : pos + part.size] = part
        pos += part.size
    out[4:8] = np.frombuffer(struct.pack("<I", _crc(out)), dtype=np.uint8)
    return out


def raw_frame(data: np.ndarray) -> np.ndarray:
    """``data`` (uint8) in a raw frame."""
    data = np.asarray(data, dtype=np.uint8).ravel()
    return _frame(RAW, [data], data.size)


def refused_frame(decoded: int, reason: str) -> np.ndarray:
    """What a sender that could not code ``decoded`` bytes sends in their place: a frame that every
    receiver refuses, naming ``reason`` (at most 1000 bytes of it)."""
    text = np.frombuffer(reason.encode("utf-8", "replace")[:1000], dtype=np.uint8)
    return _frame(REFUSED, [text], int(decoded))


def code_payload(payload: np.ndarray, header: Header | None = None) -> np.ndarray:
    """The frame of one fixed-length payload (``header``: its parsed header, if the caller has it):
    coded, or raw where it is mixed (bits 0) or coding would not make it smaller."""
    payload = np.asarray(payload, dtype=np.uint8).ravel()
    header = parse_header(payload) if header is None else header
    if header.bits == 0:
        return raw_frame(payload)
    n, d, bits = header.numel, header.bucket_size, header.bits
    b = num_buckets(n, d)
    codes = payload[HEADER_SIZE + 4 * b :]
    if n == 0 or codes.size != packed_size(n, bits):
        return raw_frame(payload)
    counts = count_codes(codes, n, bits)
    freq = quantized_frequencies(counts).astype("<u2")
    lengths, streams = encode_streams(codes, n, d, bits, freq)
    body = [payload[: HEADER_SIZE + 4 * b], freq, np.asarray(lengths, dtype="<u4"), streams]
    if FRAME_HEADER + sum(np.asarray(p).nbytes for p in body) >= payload.size + FRAME_HEADER:
        return raw_frame(payload)
    return _frame(CODED, body, payload.size, zlib.crc32(memoryview(payload)))


def frame_size(buf: np.ndarray, offset: int = 0) -> int:
    """The size of the frame at ``offset`` of ``buf``, from its header (ValueError if it is not one)."""
    return frame_sizes(buf, offset)[0]


def frame_sizes(buf: np.ndarray, offset: int = 0) -> tuple[int, int]:
    """The frame's size and the size of what it decodes to, from its header at ``offset`` of ``buf``
    (ValueError if it is not one)."""
    if buf.size - offset < FRAME_HEADER:
        raise ValueError(
            f"entropy frame truncated: {buf.size - offset} bytes, shorter than its {FRAME_HEADER}-byte header"
        )
    magic, version, kind, _, size, decoded, _, _ = _FRAME.unpack(buf[offset : offset + FRAME_HEADER].tobytes())
    if magic != MAGIC:
        raise ValueError(f"bad magic {magic!r}, expected {MAGIC!r}: not an entropy-coded frame")
    if version != VERSION:
        raise ValueError(f"unsupported entropy frame version {version}, this build reads {VERSION}")
    if kind not in (RAW, CODED, REFUSED) or size < FRAME_HEADER:
        raise ValueError(f"bad entropy frame header (kind {kind}, size {size})")
    if offset + size > buf.size:
        raise ValueError(f"entropy frame truncated: {buf.size - offset} bytes, its header says {size}")
    return int(size), int(decoded)


def decode_frame(frame: np.ndarray, limit: int | None = None) -> np.ndarray:
    """The bytes a frame carries (a fixed-length payload for a coded frame); ValueError naming what
    is wrong with a corrupted or truncated one, or one that states more than ``limit`` decoded
    bytes (checked before anything is allocated)."""
    frame = np.asarray(frame, dtype=np.uint8).ravel()
    size = frame_size(frame)
    if size != frame.size:
        raise ValueError(f"entropy frame of {frame.size} bytes, its header says {size}")
    _, _, kind, crc, _, decoded, content, reserved = _FRAME.unpack(frame[:FRAME_HEADER].tobytes())
    if _crc(frame) != crc:
        raise ValueError("entropy frame checksum mismatch (corrupted frame)")
    body = frame[FRAME_HEADER:]
    if kind == REFUSED:
        reason = body.tobytes().decode("utf-8", "replace")
        raise ValueError(f"its sender could not code these bytes and refused them ({reason})")
    if limit is not None and decoded > limit:
        raise ValueError(f"entropy frame states {decoded} decoded bytes, the exchange expects at most {limit}")
    if reserved != 0:
        raise ValueError(f"bad entropy frame header (reserved field {reserved})")
    if kind == RAW:
        if body.size != decoded:
            raise ValueError(f"raw entropy frame holds {body.size} bytes, its header says {decoded}")
        return body
    header = parse_header(body)
    n, d, bits = header.numel, header.bucket_size, header.bits
    if bits == 0 or header.payload_size != decoded:
        raise ValueError(f"coded entropy frame of a payload of {header.payload_size} bytes, its header says {decoded}")
    b = num_buckets(n, d)
    s = 1 << bits
    pos = HEADER_SIZE + 4 * b
    if body.size < pos + 2 * s + 4 * b:
        raise ValueError("coded entropy frame truncated before its streams")
    freq = body[pos : pos + 2 * s].view("<u2")
    lengths = body[pos + 2 * s : pos + 2 * s + 4 * b].view("<u4")
    streams = body[pos + 2 * s + 4 * b :]
    if int(freq.astype(np.int64).sum()) != PROB_SCALE:
        raise ValueError(
            f"coded entropy frame's frequencies sum to {int(freq.astype(np.int64).sum())}, not {PROB_SCALE}"
        )
    coded = int(lengths.astype(np.int64).sum())
    if coded != streams.size:
        raise ValueError(f"coded entropy frame's stream lengths sum to {coded}, it holds {streams.size}")
    out = np.empty(decoded, dtype=np.uint8)
    out[:pos] = body[:pos]
    out[pos:] = decode_streams(streams, lengths, n, d, bits, freq)
    if zlib.crc32(memoryview(out)) != content:
        raise ValueError("coded entropy frame decodes to other bytes than its sender coded (decoded CRC mismatch)")
    return out


# ----------------------------------------------------------------------------------- the wire
def _plain_payloads(buf: np.ndarray) -> list[tuple[int, Header]] | None:
    """``(offset, header)`` of each payload if ``buf`` is a run of valid fixed-length payloads, else None."""
    out, pos = [], 0
    while pos < buf.size:
        try:
            header = parse_header(buf[pos:])
        except ValueError:
            return None
        if pos + header.payload_size > buf.size:
            return None
        out.append((pos, header))
        pos += header.payload_size
    return out


def encode_wire(buf: np.ndarray) -> np.ndarray:
    """What ``wire="entropy"`` sends in place of ``buf`` (uint8, one rank's bytes for one peer or
    for all): a coded frame per plain payload, or ``buf`` in one raw frame; empty stays empty."""
    buf = np.asarray(buf, dtype=np.uint8).ravel()
    if buf.size == 0:
        return buf
    parts = _plain_payloads(buf)
    if parts is None:
        return raw_frame(buf)
    frames = [code_payload(buf[pos : pos + h.payload_size], h) for pos, h in parts]
    return frames[0] if len(frames) == 1 else np.concatenate(frames)


def decode_wire(buf: np.ndarray, expected: int | None = None) -> np.ndarray:
    """Inverse of :func:`encode_wire` (also of several of its outputs back to back). ``expected``:
    the bytes they must decode to; a frame that states more than are left raises before it is
    decoded, and so does a total that differs."""
    buf = np.asarray(buf, dtype=np.uint8).ravel()
    parts, pos, got = [], 0, 0
    while pos < buf.size:
        try:
            size = frame_size(buf, pos)
            left = None if expected is None else expected - got
            parts.append(decode_frame(buf[pos : pos + size], left))
        except ValueError as err:
            raise ValueError(f"entropy frame {len(parts)} at byte {pos}: {err}") from None
        pos, got = pos + size, got + parts[-1].size
    if expected is not None and got != expected:
        raise ValueError(f"entropy frames decode to {got} bytes, the exchange expects {expected}")
    if not parts:
        return np.zeros(0, dtype=np.uint8)
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def verify_wire(coded: np.ndarray, buf: np.ndarray) -> None:
    """Check that ``coded`` (this rank's :func:`encode_wire` of ``buf``) decodes to ``buf``, as
    receivers will decode it: raw frames by comparison, coded frames decoded. ValueError if not."""
    buf = np.asarray(buf, dtype=np.uint8).ravel()
    pos = at = 0
    while pos < coded.size:
        size, decoded = frame_sizes(coded, pos)
        frame = coded[pos : pos + size]
        if frame[3] == RAW:
            ok = size == FRAME_HEADER + decoded and np.array_equal(frame[FRAME_HEADER:], buf[at : at + decoded])
        else:
            ok = np.array_equal(decode_frame(frame, buf.size - at), buf[at : at + decoded])
        if not ok:
            raise ValueError(f"this rank's entropy frame at byte {pos} does not decode to the bytes it codes")
        pos, at = pos + size, at + decoded
    if at != buf.size:
        raise ValueError(f"this rank's entropy frames decode to {at} bytes, it coded {buf.size}")
