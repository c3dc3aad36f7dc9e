"""Payload header, fingerprint, sizes, slicing and splitting (docs/design/design.md, wire format v2)."""

import hashlib
import struct
import zlib

import numpy as np
import pytest

from horovod_alq.core.methods import nuqsgd_levels, uniform_levels
from horovod_alq.core.wire import (
    Header,
    check_header,
    levels_fingerprint,
    pack_header,
    parse_header,
    parse_payload,
    payload_size,
    split_payloads,
)


def make_payload(numel=3669, bits=3, bucket_size=8192, method_id=4, fingerprint=0x1234, seed=0):
    header = pack_header(Header(method_id, bits, bucket_size, numel, fingerprint))
    body = np.random.default_rng(seed).integers(0, 256, payload_size(numel, bits, bucket_size) - 32)
    return np.concatenate([np.frombuffer(header, np.uint8), body.astype(np.uint8)])


def test_header_layout():
    raw = pack_header(Header(method_id=6, bits=5, bucket_size=1024, numel=10**10, fingerprint=0xDEADBEEF01, norm="l2"))
    assert len(raw) == 32
    assert raw[:2] == b"AQ" and raw[2] == 2 and raw[3] == 6 and raw[4] == 5 and raw[5:8] == b"\0\0\0"
    assert struct.unpack_from("<I", raw, 8)[0] == 1024
    assert struct.unpack_from("<Q", raw, 16)[0] == 10**10
    assert struct.unpack_from("<Q", raw, 24)[0] == 0xDEADBEEF01
    zeroed = raw[:12] + b"\0\0\0\0" + raw[16:]
    assert struct.unpack_from("<I", raw, 12)[0] == zlib.crc32(zeroed)
    assert parse_header(raw) == Header(6, 5, 1024, 10**10, 0xDEADBEEF01, norm="l2")


def test_header_norm_byte():
    """Byte 5 is the bucket norm (0 = l2, 1 = linf) for every method; unknown codes are refused."""
    for method_id in range(8):
        for norm, code in (("l2", 0), ("linf", 1)):
            raw = pack_header(Header(method_id, 3, 64, 7, 0x55, norm=norm))
            assert raw[5] == code and raw[6:8] == b"\0\0"
            assert parse_header(raw).norm == norm
    assert Header(0, 3, 64, 7, 0).norm == "linf" and Header(1, 3, 64, 7, 0).norm == "l2"  # default: method's
    bad = bytearray(pack_header(Header(4, 3, 64, 7, 0)))
    bad[5], bad[12:16] = 2, b"\0\0\0\0"
    struct.pack_into("<I", bad, 12, zlib.crc32(bytes(bad)))
    with pytest.raises(ValueError, match="unknown norm code 2"):
        parse_header(bytes(bad))
    with pytest.raises(ValueError, match="norm must be one of l2, linf"):
        pack_header(Header(4, 3, 64, 7, 0, norm="l1"))


def test_fingerprint():
    levels = nuqsgd_levels(3)
    digest = hashlib.blake2b(levels.astype("<f8").tobytes(), digest_size=8).digest()
    fp = levels_fingerprint(levels)
    assert fp == int.from_bytes(digest, "little") and 0 <= fp < 2**64
    # the header carries the digest bytes verbatim
    assert pack_header(Header(4, 3, 8, 0, fp))[24:32] == digest
    assert levels_fingerprint(list(levels)) == fp
    assert levels_fingerprint(uniform_levels(3)) != fp
    assert levels_fingerprint(np.nextafter(levels, 2.0)) != fp


def test_payload_size():
    assert payload_size(0, 3, 8) == 32
    assert payload_size(1, 3, 8) == 32 + 4 + 1
    assert payload_size(17, 5, 8) == 32 + 4 * 3 + 11
    assert payload_size(3669, 3, 8192) == 1412


def test_parse_payload_views():
    payload = make_payload(numel=20, bits=3, bucket_size=8)
    header, norms, codes = parse_payload(payload)
    assert header.numel == 20 and header.num_buckets == 3
    assert norms.dtype == np.dtype("<f4") and norms.shape == (3,)
    np.testing.assert_array_equal(norms.view(np.uint8), payload[32:44])
    np.testing.assert_array_equal(codes, payload[44:])
    assert codes.size == 8
    assert parse_payload(payload.tobytes())[0] == header


def test_parse_errors():
    payload = make_payload()
    with pytest.raises(ValueError, match=r"^payload truncated: 1000 bytes, header says 1412$"):
        parse_payload(payload[:1000])
    with pytest.raises(ValueError, match=r"payload truncated: 20 bytes, shorter than the 32-byte header"):
        parse_payload(payload[:20])
    with pytest.raises(ValueError, match=r"payload too long: 1413 bytes, header says 1412"):
        parse_payload(np.concatenate([payload, [0]]).astype(np.uint8))
    bad = payload.copy()
    bad[0] = ord("X")
    with pytest.raises(ValueError, match="bad magic"):
        parse_payload(bad)
    for offset in (2, 3, 4, 5, 9, 13, 17, 30):
        bad = payload.copy()
        bad[offset] ^= 0x10
        with pytest.raises(ValueError, match=r"header checksum mismatch \(corrupted header\)"):
            parse_payload(bad)
    with pytest.raises(ValueError, match="1-D uint8"):
        parse_payload(payload.astype(np.int16))


def test_invalid_fields_with_valid_checksum():
    with pytest.raises(ValueError, match="unknown method id 9"):
        parse_header(pack_header(Header(9, 3, 8, 1, 0)))
    with pytest.raises(ValueError, match="bits=9 in payload header"):
        parse_header(pack_header(Header(4, 9, 8, 1, 0)))
    with pytest.raises(ValueError, match="bucket size 0"):
        parse_header(pack_header(Header(4, 3, 0, 1, 0)))
    with pytest.raises(ValueError, match="unsupported payload format version 3, this build reads 2"):
        parse_header(pack_header(Header(4, 3, 8, 1, 0, version=3)))
    with pytest.raises(ValueError, match="unsupported payload format version 1, this build reads 2"):
        parse_header(pack_header(Header(4, 3, 8, 1, 0, version=1)))


def test_check_header_messages():
    h = Header(method_id=4, bits=4, bucket_size=512, numel=10, fingerprint=0xAB, norm="l2")
    check_header(h, 4, 4, 512, 0xAB, "l2")
    with pytest.raises(ValueError, match="payload made with method alq, this quantizer uses amq"):
        check_header(h, 6, 4, 512, 0xAB, "l2")
    with pytest.raises(ValueError, match="payload made with norm=l2, this quantizer uses norm=linf"):
        check_header(h, 4, 4, 512, 0xAB, "linf")
    with pytest.raises(ValueError, match="payload made with bits=4, this quantizer uses bits=3"):
        check_header(h, 4, 3, 512, 0xAB, "l2")
    with pytest.raises(ValueError, match="payload made with bucket_size=512, this quantizer uses bucket_size=8192"):
        check_header(h, 4, 4, 8192, 0xAB, "l2")
    with pytest.raises(
        ValueError, match="levels differ: payload fingerprint 0x00000000000000ab, local 0x00000000000000cd"
    ):
        check_header(h, 4, 4, 512, 0xCD, "l2")


def test_split_payloads():
    parts = [
        make_payload(numel=n, bits=b, bucket_size=d, seed=i)
        for i, (n, b, d) in enumerate([(100, 3, 8), (0, 2, 64), (1, 8, 1), (5000, 5, 512)])
    ]
    joined = np.concatenate(parts)
    out = split_payloads(joined)
    assert len(out) == 4
    for a, b in zip(out, parts):
        np.testing.assert_array_equal(a, b)
    assert split_payloads(np.zeros(0, np.uint8)) == []
    with pytest.raises(ValueError, match=r"payload 3 at byte \d+ truncated: \d+ bytes, header says \d+"):
        split_payloads(joined[:-1])
    bad = joined.copy()
    bad[parts[0].size + 4] ^= 1
    with pytest.raises(ValueError, match=r"payload 1 at byte \d+: header checksum mismatch"):
        split_payloads(bad)
