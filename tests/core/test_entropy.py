"""The entropy wire's coder and frames (horovod_alq.core.entropy): exact round trips at every width,
the compiled coder byte for byte against the NumPy reference, coded sizes near the empirical
entropy, and corrupted or truncated frames refused with an error (fuzzed), never decoded."""

import numpy as np
import pytest

from horovod_alq.core import entropy
from horovod_alq.core.quantizer import Quantizer


def _payload(bits, d, n, seed=0, method="alq"):
    q = Quantizer(method, bits=bits, bucket_size=d, seed=seed)
    x = np.random.default_rng(seed).standard_t(3, n).astype(np.float32)
    q.adapt(q.statistics(x))
    return q, q.encode(x)


@pytest.fixture(params=["numpy", "compiled"])
def coder(request):
    """Each test once on the NumPy reference and once on the compiled coder (where it loads)."""
    saved = entropy._KERNEL
    if request.param == "numpy":
        entropy.use_kernel(None)
    else:
        pytest.importorskip("torch")
        from horovod_alq.torch.codecs import cpu_build

        if cpu_build.load() is None:
            pytest.skip(cpu_build.status())
    yield request.param
    entropy.use_kernel(saved)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("d, n", [(256, 256 * 9 + 13), (100, 4999), (7, 300), (512, 1)])
def test_round_trip_is_exact(coder, bits, d, n):
    _, p = _payload(bits, d, n)
    wire = entropy.encode_wire(p)
    np.testing.assert_array_equal(entropy.decode_wire(wire), p)


@pytest.mark.parametrize("coder", ["compiled"], indirect=True)  # compared with the NumPy reference inside
def test_compiled_coder_writes_the_reference_bytes(coder):
    kernel = entropy._KERNEL
    for bits, d, n in [(2, 256, 3000), (3, 100, 2222), (4, 64, 1000), (8, 512, 4096), (3, 7, 99)]:
        _, p = _payload(bits, d, n, seed=bits)
        compiled = entropy.encode_wire(p)
        entropy.use_kernel(None)
        reference = entropy.encode_wire(p)
        entropy.use_kernel(kernel)
        np.testing.assert_array_equal(compiled, reference)


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_coded_size_is_near_the_empirical_entropy(coder, bits):
    """Buckets of 8192: per bucket 12 bytes (two states, a length), per payload the table and 24 + 32 bytes;
    rANS with 14-bit frequencies costs well under 1% over the entropy of the codes."""
    d, n = 8192, 8192 * 6
    q, p = _payload(bits, d, n)
    codes = p[32 + 4 * 6 :]
    h = entropy.code_entropy(np.bincount(entropy.unpack_codes(codes, bits, n), minlength=1 << bits))
    frame = entropy.encode_wire(p)
    assert frame[3] == entropy.CODED
    overhead = 24 + 32 + 4 * 6 + 2 * (1 << bits) + 12 * 6
    body_bits = 8 * (frame.size - overhead)
    assert h * n - 64 * 6 <= body_bits <= 1.01 * h * n + 64, (h, body_bits / n)  # the final states hold up to 64 bits
    assert frame.size < p.size


def test_frames_pass_other_bytes_verbatim(coder):
    rng = np.random.default_rng(3)
    floats = rng.standard_normal(1000).astype(np.float32).view(np.uint8)
    for data in (floats, np.zeros(0, np.uint8), np.frombuffer(b"AQ" + bytes(60), np.uint8)):
        wire = entropy.encode_wire(data)
        assert data.size == 0 or wire[3] == entropy.RAW
        np.testing.assert_array_equal(entropy.decode_wire(wire), data)
    _, p = _payload(3, 256, 2000)
    both = np.concatenate([p, p])  # two payloads back to back: a frame each
    np.testing.assert_array_equal(entropy.decode_wire(entropy.encode_wire(both)), both)


def test_quantized_frequencies():
    for counts in ([5, 0, 0, 1], [1] * 256, [10**9, 1, 1, 0], [3, 3, 3, 3, 3, 3, 3, 3]):
        f = entropy.quantized_frequencies(np.array(counts))
        assert int(f.sum()) == entropy.PROB_SCALE
        assert np.all((f > 0) == (np.array(counts) > 0))
    with pytest.raises(ValueError):
        entropy.quantized_frequencies(np.zeros(4, int))


def _restamp(frame):
    """A frame with its CRC recomputed (so that the decoder's own checks are what is tested)."""
    frame[4:8] = 0
    frame[4:8] = np.frombuffer(int(entropy._crc(frame)).to_bytes(4, "little"), np.uint8)
    return frame


def test_fuzzed_frames_raise_and_never_decode_to_other_codes(coder):
    """Header and body mutations, and truncations (fixed seed, 300 cases): each raises ValueError at
    the CRC. With the CRC recomputed (what the decoder's own bounds, sum and end-state checks must
    survive), each raises ValueError or returns a buffer of the size its header states; no crash, no
    read past the end; the streams' checks alone catch most changed streams."""
    rng = np.random.default_rng(11)
    q, p = _payload(3, 512, 4000)
    frame = entropy.encode_wire(p)
    assert frame[3] == entropy.CODED
    streams_at = entropy.FRAME_HEADER + 32 + 4 * 8 + 16 + 4 * 8  # headers, norms, table, lengths
    raised = stream_cases = stream_raised = 0
    for case in range(300):
        bad = frame.copy()
        k = int(rng.integers(0, 3))
        if k == 0:  # flip bits
            for pos in rng.integers(0, bad.size, int(rng.integers(1, 4))):
                bad[pos] ^= np.uint8(1 << int(rng.integers(0, 8)))
        elif k == 1:  # truncate
            bad = bad[: int(rng.integers(0, bad.size))]
        else:  # overwrite a byte of the headers, table or lengths
            pos = int(rng.integers(0, streams_at))
            bad[pos] = np.uint8(rng.integers(0, 256))
        if np.array_equal(bad, frame):
            continue
        with pytest.raises(ValueError):
            entropy.decode_wire(bad)
        raised += 1
        if bad.size < 24:
            continue
        restamped = _restamp(bad.copy())
        in_streams = k == 0 and bad.size == frame.size and np.all(bad[:streams_at] == frame[:streams_at])
        stream_cases += in_streams
        try:
            out = entropy.decode_wire(restamped)
        except ValueError:
            stream_raised += in_streams
            continue
        assert out.dtype == np.uint8 and out.size == int(restamped[16:24].view("<u8")[0])
    assert raised > 250, raised
    assert stream_cases > 50 and stream_raised >= 0.8 * stream_cases, (stream_cases, stream_raised)
