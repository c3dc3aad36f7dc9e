"""TensorFlow kernels against the NumPy core and the torch kernels: same bytes, same statistics."""

import zlib

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

from horovod_alq.core import Quantizer
from horovod_alq.core.packing import pack_codes
from horovod_alq.core.statistics import GRID, normalize
from horovod_alq.core.wire import Header, pack_header, parse_payload
from horovod_alq.tensorflow import kernels
from horovod_alq.tensorflow.graph import header_mask

CASES = [("alq", 3), ("alq-n", 2), ("amq", 5), ("qsgdinf", 4), ("qsgd", 8), ("nuqsgd", 3), ("terngrad", 2)]


def _header(q: Quantizer, numel: int) -> np.ndarray:
    return np.frombuffer(
        pack_header(Header(q._method.id, q.bits, q.bucket_size, numel, q.fingerprint, norm=q.norm)), np.uint8
    )


def _tf_encode(q: Quantizer, x: np.ndarray, seed=(1, 2)) -> np.ndarray:
    return kernels.encode(
        tf.constant(x),
        tf.constant(q.levels),
        tf.constant(_header(q, x.size)),
        tf.constant(seed, tf.int64),
        bits=q.bits,
        bucket_size=q.bucket_size,
        norm=q.norm,
    ).numpy()


def _tf_decode(q: Quantizer, payloads: list, numel: int, scale: float = 1.0) -> np.ndarray:
    return kernels.decode_sum(
        tf.constant(np.concatenate(payloads)),
        tf.constant(q.levels),
        tf.constant(scale),
        ranks=len(payloads),
        numel=numel,
        bits=q.bits,
        bucket_size=q.bucket_size,
    ).numpy()


def _data(n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(n) * rng.uniform(0.1, 3.0, n)).astype(np.float32)


@pytest.mark.parametrize("bits", range(2, 9))
def test_pack_unpack_match_the_core_bit_stream(bits):
    rng = np.random.default_rng(bits)
    for n in (1, 7, 8, 9, 1003):
        codes = rng.integers(0, 2**bits, n).astype(np.uint8)
        packed = kernels.pack_codes(tf.constant(codes.astype(np.int32)), bits).numpy()
        assert np.array_equal(packed, pack_codes(codes, bits))
        assert np.array_equal(kernels.unpack_codes(tf.constant(packed[None]), bits, n).numpy()[0], codes)


def test_header_mask_rebuilds_the_packed_header_for_any_fingerprint():
    rng = np.random.default_rng(0)
    for numel in (1, 1000, 2**40):
        static = np.frombuffer(pack_header(Header(4, 3, 8192, numel, 0)), np.uint8).astype(np.int32)
        for fingerprint in [0, 1, 2**64 - 1, *rng.integers(0, 2**63, 5).tolist()]:
            want = pack_header(Header(4, 3, 8192, numel, int(fingerprint)))
            assert bytes((static ^ header_mask(int(fingerprint))).astype(np.uint8)) == want
    assert zlib.crc32(bytes(32)) != 0  # the mask relies on CRC-32 being affine, not linear


@pytest.mark.parametrize("method,bits", CASES)
def test_tf_payload_decodes_with_the_core_and_core_payload_with_tf(method, bits):
    q = Quantizer(method, bits=bits, bucket_size=100, seed=0)
    x = _data(1234)
    x[500] = np.nan  # bucket 5 travels with norm NaN
    payload = _tf_encode(q, x)
    header, norms, _ = parse_payload(payload)  # layout and header valid for the core
    assert header.numel == x.size and header.fingerprint == q.fingerprint
    assert np.isnan(norms[5]) and np.isfinite(np.delete(norms, 5)).all()
    decoded = q.decode(payload)
    assert np.array_equal(decoded, _tf_decode(q, [payload], x.size), equal_nan=True)
    assert np.isnan(decoded[500:600]).all() and not np.isnan(np.delete(decoded, np.s_[500:600])).any()
    # two ranks' payloads, averaged
    other = _tf_encode(q, x, seed=(3, 4))
    avg = _tf_decode(q, [payload, other], x.size, 0.5)
    assert np.allclose(avg, 0.5 * (decoded + q.decode(other)), equal_nan=True, rtol=1e-6, atol=1e-6)
    core_payload = q.encode(x)
    assert np.array_equal(_tf_decode(q, [core_payload], x.size), q.decode(core_payload), equal_nan=True)


@pytest.mark.parametrize("method,bits", [("alq", 3), ("terngrad", 2), ("qsgd", 6)])
def test_payloads_cross_decode_with_the_torch_kernels(method, bits):
    torch = pytest.importorskip("torch")
    from horovod_alq.torch.codecs import torch_kernels as tk

    q = Quantizer(method, bits=bits, bucket_size=64)
    x = _data(1000, seed=1)
    payload = _tf_encode(q, x)
    out = torch.zeros(x.size)
    tk.decode_into(out, torch.from_numpy(payload.copy()), torch.from_numpy(q.levels), bits=bits, bucket_size=64)
    assert np.array_equal(out.numpy(), q.decode(payload))
    tpayload = tk.encode(
        torch.from_numpy(x),
        torch.from_numpy(q.levels),
        torch.from_numpy(_header(q, x.size).copy()),
        bits=bits,
        bucket_size=64,
        norm=q.norm,
        generator=torch.Generator().manual_seed(0),
    ).numpy()
    assert np.array_equal(_tf_decode(q, [tpayload], x.size), q.decode(tpayload))


def test_norms_match_the_core_including_float32_overflow_and_float64_input():
    x = _data(3000)
    x[100:110] = 3e37  # squares overflow float32, the norm does not
    x[2500] = np.inf
    for norm in ("l2", "linf"):
        for dtype in (np.float32, np.float64, np.float16):
            with np.errstate(over="ignore"):
                xs = x.astype(dtype)  # float16: 3e37 becomes inf, its bucket NaN
            want = normalize(xs, 256, norm).norms
            got = kernels.bucket_norms(
                kernels.bucket_view(tf.constant(xs.astype(np.float64 if dtype == np.float64 else np.float32)), 256),
                norm,
            )
            assert np.allclose(got.numpy(), want, rtol=2e-6, equal_nan=True), (norm, dtype)
    big = np.full(10, 1e300)  # float64 whose norm overflows float32: NaN, as in the core
    assert np.isnan(kernels.bucket_norms(kernels.bucket_view(tf.constant(big), 10), "l2").numpy()).all()


def test_stochastic_rounding_is_unbiased_and_seeded():
    q = Quantizer("alq", bits=3, bucket_size=64, norm="l2")
    x = _data(64, seed=3)
    draws = 4000
    seeds = tf.stack([tf.fill([draws], tf.constant(7, tf.int64)), tf.range(draws, dtype=tf.int64)], axis=1)
    enc = tf.function(
        lambda s: kernels.encode(
            tf.constant(x), tf.constant(q.levels), tf.constant(_header(q, x.size)), s, bits=3, bucket_size=64, norm="l2"
        )
    )
    decoded = np.stack([q.decode(p) for p in tf.map_fn(enc, seeds, fn_output_signature=tf.uint8).numpy()])
    # exact variance of each coordinate's rounding: 6 standard errors of the mean
    norm = np.float32(np.linalg.norm(x.astype(np.float64)))
    r = x / np.float64(norm)
    cell = np.clip(np.searchsorted(q.levels, r, side="right") - 1, 0, 6)
    var = norm**2 * (q.levels[cell + 1] - r) * (r - q.levels[cell])
    assert np.all(np.abs(decoded.mean(0) - x) <= 6 * np.sqrt(var / draws) + 1e-5)
    assert np.array_equal(_tf_encode(q, x, (5, 6)), _tf_encode(q, x, (5, 6)))
    assert not np.array_equal(_tf_encode(q, x, (5, 6)), _tf_encode(q, x, (5, 7)))


@pytest.mark.parametrize(
    "method,norm",
    [
        ("alq", "l2"),
        ("alq-n", "l2"),
        ("amq", "l2"),
        ("amq-n", "l2"),
        ("qsgdinf", "linf"),
        ("alq", "linf"),
        ("alq-n", "linf"),
        ("amq", "linf"),
        ("amq-n", "linf"),
    ],
)
def test_statistics_match_the_core(method, norm):
    q = Quantizer(method, bits=3, bucket_size=256, norm=norm)
    x = _data(5000, seed=4)
    x[700] = np.nan  # a non-finite bucket and a zero bucket are left out
    x[1300:1536] = 0.0
    want = q.statistics(x)
    norm = q.norm
    if want.size == 4:
        got = kernels.normless_statistics(tf.constant(x), bucket_size=256, norm=norm).numpy()
    else:
        got = kernels.grid_statistics(tf.constant(x), GRID, bucket_size=256, norm=norm).numpy()
    assert got.shape == want.shape
    assert np.allclose(got, want, rtol=1e-6, atol=1e-9 * np.abs(want).max())


@pytest.mark.parametrize("norm", ["l2", "linf"])
def test_grid_histograms_match_the_core(norm):
    """bits="auto"'s histograms (counts weighted by n_b / count_b and by n_b**2) as the core's."""
    from horovod_alq.core.statistics import grid_histograms, normalize

    x = _data(5000, seed=4) * np.repeat([1.0, 30.0, 0.01, 1.0, 2.0, 1.0, 0.5, 1.0, 3.0, 1.0], 500)
    x[700] = np.nan
    x[1300:1536] = 0.0
    want = grid_histograms(normalize(x, 256, norm))
    got = kernels.grid_histograms(tf.constant(x), GRID, bucket_size=256, norm=norm).numpy()
    assert got.shape == want.shape == (2, 1 + GRID.size)
    for g, w in zip(got, want):
        assert np.allclose(g, w, rtol=1e-6, atol=1e-9 * np.abs(w).max())
    assert np.array_equal(got[0], kernels.grid_statistics(tf.constant(x), GRID, bucket_size=256, norm=norm).numpy())


@pytest.mark.parametrize("method,bits", [("alq", 3), ("terngrad", 2), ("amq", 5), ("qsgdinf", 4)])
def test_xla_compiled_codec_reads_and_writes_the_same_format(method, bits):
    """The compressors' default path: XLA-compiled encoder (unrolled cell search) and decoder."""
    import functools

    q = Quantizer(method, bits=bits, bucket_size=100)
    x = _data(2003, seed=5)
    x[1500] = np.nan
    u = kernels.uniforms(tf.constant(x), tf.constant([3, 4], tf.int64), 100)
    opts = dict(bits=bits, bucket_size=100)
    plain = kernels.encode_with_uniforms(
        tf.constant(x), tf.constant(q.levels), tf.constant(_header(q, x.size)), u, norm=q.norm, **opts
    ).numpy()
    xla = tf.function(
        functools.partial(kernels.encode_with_uniforms, norm=q.norm, unrolled=True, **opts), jit_compile=True
    )(tf.constant(x), tf.constant(q.levels), tf.constant(_header(q, x.size)), u)
    xla = xla.numpy()
    assert xla.shape == plain.shape and np.array_equal(xla[:32], plain[:32])
    a, b = q.decode(xla), q.decode(plain)
    assert np.array_equal(np.isnan(a), np.isnan(b)) and np.isnan(a[1500:1600]).all()
    # same draws: norms agree to float32 rounding (summation order), and so do the codes, except
    # where such a last-bit difference flips a rounding decision (or in the NaN bucket)
    (_, norms_x, codes_x), (_, norms_p, codes_p) = parse_payload(xla), parse_payload(plain)
    assert np.allclose(norms_x, norms_p, rtol=1e-6, equal_nan=True)
    from horovod_alq.core.packing import unpack_codes

    cx, cp = unpack_codes(codes_x, bits, x.size), unpack_codes(codes_p, bits, x.size)
    assert np.mean(np.delete(cx != cp, np.s_[1500:1600])) < 1e-3
    decode = tf.function(functools.partial(kernels.decode_sum, ranks=2, numel=x.size, **opts), jit_compile=True)
    both = decode(tf.constant(np.concatenate([xla, plain])), tf.constant(q.levels), tf.constant(0.5)).numpy()
    assert np.allclose(both, 0.5 * (a + b), rtol=1e-6, atol=1e-6, equal_nan=True)


@pytest.mark.parametrize("jit", [False, True], ids=["plain", "xla"])
@pytest.mark.parametrize(
    "method,norm,bits",
    [
        ("alq", "linf", 2),
        ("alq", "linf", 3),
        ("amq", "linf", 4),
        ("alq-n", "linf", 3),
        ("amq-n", "linf", 3),
        ("alq", "l2", 3),
        ("amq", "l2", 2),
    ],
)
def test_unbiased_with_either_norm(method, norm, bits, jit):
    """Mean of M encodes (the compressors' encoder: XLA-compiled and unrolled, or plain TF ops) is
    within a per-coordinate Bernstein bound of x, with each coordinate's exact rounding variance;
    the payload says its norm, and a quantizer with the other norm refuses it."""
    import functools

    q = Quantizer(method, bits=bits, bucket_size=128, norm=norm)
    n, m = 1000, 300
    x = _data(n, seed=bits)
    x[:128] = 0.0  # a zero-norm bucket decodes to exact zeros
    enc = tf.function(
        functools.partial(kernels.encode, bits=bits, bucket_size=128, norm=norm, unrolled=jit), jit_compile=jit
    )
    seeds = tf.stack([tf.fill([m], tf.constant(11, tf.int64)), tf.range(m, dtype=tf.int64)], axis=1)
    payloads = tf.map_fn(
        lambda s: enc(tf.constant(x), tf.constant(q.levels), tf.constant(_header(q, n)), s),
        seeds,
        fn_output_signature=tf.uint8,
    ).numpy()
    assert payloads[0][5] == {"l2": 0, "linf": 1}[norm]
    other = Quantizer(method, bits=bits, bucket_size=128, norm={"l2": "linf", "linf": "l2"}[norm])
    with pytest.raises(ValueError, match=f"payload made with norm={norm}, this quantizer uses norm={other.norm}"):
        other.decode(payloads[0])
    mean = np.stack([q.decode(p) for p in payloads]).astype(np.float64).mean(0)
    norms = np.repeat(payloads[0][32 : 32 + 4 * 8].view("<f4").astype(np.float64), 128)[:n]
    levels = q.levels.astype(np.float32).astype(np.float64)
    target = x.astype(np.float64)
    r = np.clip(np.divide(target, norms, out=np.zeros(n), where=norms > 0), -1, 1)
    cell = np.clip(np.searchsorted(levels, r, side="right") - 1, 0, levels.size - 2)
    var = norms**2 * np.clip((levels[cell + 1] - r) * (r - levels[cell]), 0, None)
    c = norms * (levels[cell + 1] - levels[cell]) / m
    log_term = np.log(2 / 1e-9)  # 1e-9 per coordinate
    bound = c * log_term / 3 + np.sqrt((c * log_term / 3) ** 2 + 2 * var / m * log_term)
    bound += 1e-6 * (np.abs(target) + norms)  # float32 arithmetic of the encoder
    assert (np.abs(mean - target) <= bound).all()
    assert (mean[:128] == 0).all()
    assert abs((mean - target).sum()) <= 5 * np.sqrt(var.sum() / m) + 1e-6 * np.abs(target).sum()


def test_uniforms_are_uniform_and_independent():
    """The counter-hash draws: in (0, 1), uniform (chi-square over 64 bins), uncorrelated between
    neighbours and between two calls' seeds; tolerances from the sample size, fixed seeds."""
    from scipy import stats

    x = tf.zeros([1 << 18])
    a = kernels.uniforms(x, tf.constant([7, 1], tf.int64), 4096).numpy().ravel().astype(np.float64)
    b = kernels.uniforms(x, tf.constant([7, 2], tf.int64), 4096).numpy().ravel().astype(np.float64)
    n = a.size
    assert a.min() > 0 and a.max() < 1
    assert abs(a.mean() - 0.5) < 5 * np.sqrt(1 / 12 / n)
    counts = np.histogram(a, bins=64, range=(0, 1))[0]
    assert stats.chisquare(counts).pvalue > 1e-4
    for u, v in ((a[:-1], a[1:]), (a, b)):  # neighbours; the next call's draws
        assert abs(np.corrcoef(u, v)[0, 1]) < 5 / np.sqrt(n)
    assert not np.array_equal(a, kernels.uniforms(x, tf.constant([8, 1], tf.int64), 4096).numpy().ravel())
