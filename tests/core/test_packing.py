"""b-bit LSB-first packing of codes (docs/design/design.md, wire format)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from horovod_alq.core.packing import pack_codes, packed_size, unpack_codes


def reference_pack(codes: np.ndarray, bits: int) -> np.ndarray:
    """The contract spelled out: bit j of code i is stream bit i*bits + j; stream bit k is bit k%8 of byte k//8."""
    stream = ((codes[:, None].astype(np.uint16) >> np.arange(bits)) & 1).astype(np.uint8).ravel()
    return np.packbits(stream, bitorder="little")


@pytest.mark.parametrize("bits", range(2, 9))
@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 1000003])
def test_round_trip_and_reference(bits, n):
    codes = np.random.default_rng(bits * 31 + n).integers(0, 2**bits, n).astype(np.uint8)
    packed = pack_codes(codes, bits)
    assert packed.dtype == np.uint8 and packed.shape == ((n * bits + 7) // 8,) == (packed_size(n, bits),)
    np.testing.assert_array_equal(packed, reference_pack(codes, bits))
    out = unpack_codes(packed, bits, n)
    assert out.dtype == np.uint8
    np.testing.assert_array_equal(out, codes)


def test_literal_bytes():
    # 3 bits: word = sum code_i << 3i = 1 | 2<<3 | 3<<6 | 4<<9 | 5<<12 | 6<<15 | 7<<18 = 0x1F58D1
    assert pack_codes(np.arange(1, 9, dtype=np.uint8) % 8, 3).tolist() == [0xD1, 0x58, 0x1F]
    # 2 bits, 5 codes: 3, 0, 1, 2 -> 0b10_01_00_11; then 1 and six zero padding bits
    assert pack_codes(np.array([3, 0, 1, 2, 1], np.uint8), 2).tolist() == [0b10010011, 0b01]
    assert pack_codes(np.array([200, 7], np.uint8), 8).tolist() == [200, 7]


@settings(max_examples=60, deadline=None)
@given(st.integers(2, 8).flatmap(lambda b: st.tuples(st.just(b), st.lists(st.integers(0, 2**b - 1), max_size=70))))
def test_property_round_trip(case):
    bits, values = case
    codes = np.array(values, dtype=np.uint8)
    packed = pack_codes(codes, bits)
    assert packed.size == packed_size(codes.size, bits)
    np.testing.assert_array_equal(packed, reference_pack(codes, bits))
    np.testing.assert_array_equal(unpack_codes(packed, bits, codes.size), codes)
    spare = packed.size * 8 - codes.size * bits  # unused trailing bits must be 0
    if spare:
        assert int(packed[-1]) >> (8 - spare) == 0


def test_errors():
    with pytest.raises(ValueError, match="does not fit in 2 bits"):
        pack_codes(np.array([4], np.uint8), 2)
    with pytest.raises(ValueError, match="must be uint8"):
        pack_codes(np.array([1, 2], np.int64), 3)
    for bits in (1, 9):
        with pytest.raises(ValueError, match="bits must be from 2 to 8"):
            pack_codes(np.zeros(3, np.uint8), bits)
    with pytest.raises(ValueError, match="packed codes have 2 bytes, 9 codes of 3 bits need 4"):
        unpack_codes(np.zeros(2, np.uint8), 3, 9)
