"""The reference codec: configuration, unbiasedness, variance, wire size, bad input, adaptation."""

import math

import numpy as np
import pytest
from scipy import stats as sps

from horovod_alq.core import Quantizer, TruncatedNormal, expected_variance, stochastic_round
from horovod_alq.core.methods import multiplier_levels
from horovod_alq.core.wire import parse_payload

ADAPTIVE = ["alq", "alq-n", "amq", "amq-n"]
FIXED = ["qsgdinf", "qsgd", "nuqsgd", "terngrad"]


# ------------------------------------------------------------------ configuration
def test_fixed_level_tables():
    np.testing.assert_array_equal(Quantizer("nuqsgd").levels, [-1, -1 / 2, -1 / 4, -1 / 8, 1 / 8, 1 / 4, 1 / 2, 1])
    # np.linspace is not exactly antisymmetric in float64 (last-ulp differences): compare to 1e-15
    np.testing.assert_allclose(
        Quantizer("qsgd").levels, [-1, -5 / 7, -3 / 7, -1 / 7, 1 / 7, 3 / 7, 5 / 7, 1], rtol=0, atol=1e-15
    )
    np.testing.assert_allclose(Quantizer("qsgdinf", bits=2).levels, [-1, -1 / 3, 1 / 3, 1], rtol=0, atol=1e-15)
    np.testing.assert_array_equal(Quantizer("terngrad").levels, [-1, 0, 1])
    np.testing.assert_array_equal(Quantizer("nuqsgd", bits=2).levels, [-1, -0.5, 0.5, 1])
    np.testing.assert_array_equal(Quantizer("nuqsgd", bits=4).levels[8:], 2.0 ** -np.arange(7, -1, -1))
    for m in ADAPTIVE:  # adaptive methods start fitted to Gaussian gradients: N(0, 1/d) with L2 buckets
        for d in (512, 8192):
            prior = TruncatedNormal(0.0, d**-0.5)
            start = Quantizer(m, bits=3, bucket_size=d, norm="l2").levels
            assert expected_variance(start, prior) < 0.1 * expected_variance(Quantizer("nuqsgd").levels, prior)
            assert not np.array_equal(start, Quantizer("nuqsgd").levels)
            np.testing.assert_array_equal(start, Quantizer(m, bits=3, bucket_size=d, norm="l2").levels)  # deterministic
    for bits in range(2, 9):
        lv = Quantizer("alq", bits=bits).levels
        assert lv.size == 2**bits and lv[0] == -1 and lv[-1] == 1 and np.all(np.diff(lv) > 0)


def test_properties_and_defaults():
    q = Quantizer("AMQ-N", bucket_size=512, seed=1)
    assert (q.method, q.bits, q.bucket_size) == ("amq-n", 3, 512)
    assert 0 < q.multiplier < 1 and np.array_equal(q.levels, multiplier_levels(q.multiplier, 3))
    assert Quantizer("terngrad").bits == 2 and Quantizer("alq").bucket_size == 8192
    assert Quantizer("alq").multiplier is None
    lv = q.levels
    lv[:] = 0  # a copy: mutating it must not touch the quantizer
    assert q.levels[0] == -1
    with pytest.raises(ValueError):
        q._levels[0] = 5  # internal array is read-only too


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            dict(method="alqq"),
            "unknown method 'alqq'; allowed: qsgdinf, qsgd, nuqsgd, terngrad, alq, alq-n, amq, amq-n",
        ),
        (dict(method="alq", bits=1), "bits must be from 2 to 8, got 1"),
        (dict(method="qsgd", bits=9), "bits must be from 2 to 8, got 9"),
        (dict(method="alq", bits=3.0), "bits must be an integer"),
        (dict(method="terngrad", bits=3), "terngrad sends its 3 levels on 2 bits; bits must be 2, got 3"),
        (dict(method="alq", bucket_size=0), "bucket_size must be from 1 to 4294967295, got 0"),
        (dict(method="alq", bucket_size=-1), "bucket_size must be from 1 to 4294967295, got -1"),
        (dict(method="alq", bucket_size=512.0), "bucket_size must be a positive integer, got 512.0"),
        (dict(method="alq", bucket_size=True), "bucket_size must be a positive integer, got True"),
        (dict(method="qsgd", clip=True), "clip applies to terngrad only, not qsgd"),
        (dict(method="terngrad", clip=-1.0), "clip must be False, True or a positive number"),
    ],
)
def test_bad_configuration(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        Quantizer(**kwargs)


# ------------------------------------------------------------------ unbiasedness
UNBIASED_CASES = [(m, b) for m in ["qsgdinf", "qsgd", "nuqsgd", "alq", "alq-n", "amq", "amq-n"] for b in (2, 3, 5)]
UNBIASED_CASES += [("terngrad", 2), ("alq", 8)]
M = 800  # repetitions per case
Z = 6.0  # see test_unbiased


def _cell_variance(r, levels):
    """Exact Var[levels[code]] of one coordinate, from the levels (independent of the codec)."""
    hi_idx = np.clip(np.searchsorted(levels, r, side="right"), 1, levels.size - 1)
    lo, hi = levels[hi_idx - 1], levels[hi_idx]
    return np.maximum((hi - r) * (r - lo), 0.0), hi - lo


@pytest.mark.parametrize("method, bits", UNBIASED_CASES)
def test_unbiased(method, bits):
    rng = np.random.default_rng(bits)
    q = Quantizer(method, bits=bits, bucket_size=48, seed=100 + bits)
    if method.startswith("alq"):  # arbitrary non-uniform levels, as after adaptation
        inner = np.sort(rng.uniform(-1, 1, 2**bits - 2) ** 3)
        q.set_levels(np.concatenate([[-1], inner, [1]]))
    elif method.startswith("amq"):
        q.set_levels(multiplier_levels(0.3, bits))
    x = np.concatenate([rng.standard_t(3, 100), [0.0, 0.0], np.zeros(2)]).astype(np.float32)
    x[:3] = [1e-3, -5.0, 5.0]  # below the smallest level, and clipped at the norm for linf
    n = x.size  # 104: buckets of 48, 48 and a partial one of 8

    norms = parse_payload(q.encode(x))[1].astype(np.float64)
    scale = np.repeat(norms, q.bucket_size)[:n]
    r = np.clip(x / scale, -1, 1)
    var, width = _cell_variance(r, q.levels)
    var, width = var * scale**2, width * scale

    decoded = np.stack([q.decode(q.encode(x)) for _ in range(M)]).astype(np.float64)
    err = decoded.mean(axis=0) - x
    # Bernstein's inequality for the mean of M i.i.d. variables with variance var and range
    # width: P(|err| > t) <= 2 exp(-M t^2 / (2 var + 2 width t / 3)). Z = 6 gives t =
    # sqrt(Z^2 var / M) + Z^2 width / (3 M)... i.e. a tail of 2 exp(-18) = 3e-8 per coordinate;
    # over ~2,300 coordinates in all cases (Bonferroni) a false failure has probability < 1e-4.
    # The range term keeps rare-event coordinates (p of order 1/M) honest where a plain
    # z-score on the empirical std would not. atol: float32 rounding of norm * level.
    tol = Z * np.sqrt(var / M) + Z**2 * width / (3 * M) + 2e-7 * scale
    assert np.all(np.abs(err) <= tol), np.max(np.abs(err) / tol)
    # aggregate z-test: sum of the errors of independent coordinates has variance sum(var) / M
    z = err.sum() / math.sqrt(var.sum() / M)
    assert abs(z) < 5, z
    # the empirical variance agrees with the exact per-coordinate variance, in aggregate
    emp = decoded.var(axis=0, ddof=1).sum()
    assert emp == pytest.approx(var.sum(), rel=6 * math.sqrt(2 / M))


def test_zero_variance_coordinates_are_exact():
    q = Quantizer("qsgdinf", bits=3, bucket_size=8, seed=0)
    x = np.array([1.0, -1.0, 1 / 7, -3 / 7, 5 / 7, 0.5, 0.0, 0.25], dtype=np.float64) * 4
    for _ in range(20):
        np.testing.assert_allclose(q.decode(q.encode(x))[:5], x[:5], rtol=1e-6)


# ------------------------------------------------------------------ variance
@pytest.mark.parametrize("mu, sigma", [(0.0, 0.1), (0.2, 0.5), (-0.05, 0.02)])
@pytest.mark.parametrize("levels", ["nuqsgd", "uniform", "custom"])
def test_variance_matches_expected_variance(mu, sigma, levels):
    """Quantize r ~ TruncatedNormal(mu, sigma) directly; mean squared error vs Psi(levels)."""
    lv = {
        "nuqsgd": Quantizer("nuqsgd").levels,
        "uniform": Quantizer("qsgd").levels,
        "custom": np.array([-1, -0.3, -0.05, -0.01, 0.02, 0.1, 0.4, 1.0]),
    }[levels]
    n = 100_000
    a, b = (-1 - mu) / sigma, (1 - mu) / sigma
    r = sps.truncnorm(a, b, loc=mu, scale=sigma).rvs(n, random_state=np.random.default_rng(5))
    sq = (lv[stochastic_round(r, lv, np.random.default_rng(6))] - r) ** 2
    psi = expected_variance(lv, TruncatedNormal(mu, sigma))
    # 6 standard errors of the sample mean of the squared errors
    assert abs(sq.mean() - psi) <= 6 * sq.std() / math.sqrt(n), (sq.mean(), psi)


def test_codec_variance_end_to_end():
    """QSGDinf with one coordinate pinned at 1 per bucket: the norm is 1 and r = x exactly."""
    d, buckets = 256, 200
    dist = TruncatedNormal(0.1, 0.3)
    r = sps.truncnorm((-1.1) / 0.3, 0.9 / 0.3, loc=0.1, scale=0.3).rvs(
        (buckets, d - 1), random_state=np.random.default_rng(7)
    )
    x = np.concatenate([np.ones((buckets, 1)), r], axis=1).ravel()
    q = Quantizer("qsgdinf", bits=3, bucket_size=d, seed=8)
    sq = ((q.decode(q.encode(x)).astype(np.float64) - x) ** 2).reshape(buckets, d)[:, 1:].ravel()
    psi = expected_variance(q.levels, dist)
    assert abs(sq.mean() - psi) <= 6 * sq.std() / math.sqrt(sq.size)


# ------------------------------------------------------------------ wire
@pytest.mark.parametrize("method, bits", [("alq", 3), ("terngrad", 2), ("qsgd", 8), ("amq-n", 5)])
@pytest.mark.parametrize("n, d", [(0, 8), (1, 8), (9, 8), (1000, 64), (65536, 512), (100_003, 8192)])
def test_wire_size(method, bits, n, d):
    q = Quantizer(method, bits=bits, bucket_size=d, seed=0)
    x = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    payload = q.encode(x)
    assert payload.dtype == np.uint8 and payload.ndim == 1
    assert payload.size == 32 + 4 * math.ceil(n / d) + math.ceil(n * bits / 8)
    if n >= 65536:
        assert 8 * payload.size / n == pytest.approx(bits + 32 / d, rel=0.01)
    y = q.decode(payload)
    assert y.dtype == np.float32 and y.shape == (n,)


def test_dtypes_shapes_and_determinism():
    x = np.random.default_rng(1).standard_normal((7, 33))
    for dtype in (np.float16, np.float32, np.float64):
        p1 = Quantizer("alq", bucket_size=50, seed=3).encode(x.astype(dtype))
        p2 = Quantizer("alq", bucket_size=50, seed=3).encode(x.astype(dtype).ravel())
        np.testing.assert_array_equal(p1, p2)
    q = Quantizer("alq", bucket_size=50, seed=3)
    assert not np.array_equal(q.encode(x), q.encode(x))  # fresh randomness on every call
    for bad in (np.arange(10), np.ones(3, bool), np.ones(3, np.complex64), ["a"]):
        with pytest.raises(ValueError, match="x must be a floating-point array"):
            q.encode(bad)
    with pytest.raises(ValueError, match="x must be a floating-point array"):
        q.statistics(np.arange(4))


def test_bad_payloads():
    x = np.random.default_rng(2).standard_normal(1000).astype(np.float32)
    q = Quantizer("alq", bits=3, bucket_size=256, seed=0)
    p = q.encode(x)
    assert p.size == 423
    with pytest.raises(ValueError, match="payload truncated: 400 bytes, header says 423"):
        q.decode(p[:400])
    bad = p.copy()
    bad[4] ^= 1
    with pytest.raises(ValueError, match=r"header checksum mismatch \(corrupted header\)"):
        q.decode(bad)
    bad = p.copy()
    bad[0] = 0
    with pytest.raises(ValueError, match="bad magic"):
        q.decode(bad)
    others = [
        (Quantizer("alq", bits=4, bucket_size=256), "payload made with bits=4, this quantizer uses bits=3"),
        (Quantizer("amq", bits=3, bucket_size=256), "payload made with method amq, this quantizer uses alq"),
        (
            Quantizer("alq", bits=3, bucket_size=512),
            "payload made with bucket_size=512, this quantizer uses bucket_size=256",
        ),
    ]
    for other, message in others:
        with pytest.raises(ValueError, match=message):
            q.decode(other.encode(x))
    other = Quantizer("alq", bits=3, bucket_size=256)
    other.set_levels([-1, -0.6, -0.2, -0.05, 0.05, 0.2, 0.6, 1])
    with pytest.raises(
        ValueError, match=f"levels differ: payload fingerprint {other.fingerprint:#018x}, local {q.fingerprint:#018x}"
    ):
        q.decode(other.encode(x))
    # Norms and codes are not checksummed (only the header is): a flipped code byte decodes
    # without error to different values.
    bad = p.copy()
    bad[-1] ^= 0xFF
    assert not np.array_equal(q.decode(bad), q.decode(p))
    # ...except TernGrad's unused code 3
    t = Quantizer("terngrad", bucket_size=256, seed=0)
    bad = t.encode(x)
    bad[-1] = 0xFF
    with pytest.raises(ValueError, match=r"code 3 out of range for 3 levels \(corrupted codes\)"):
        t.decode(bad)


# ------------------------------------------------------------------ special values
@pytest.mark.parametrize("method", ["alq", "qsgdinf", "terngrad"])
@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_nonfinite_bucket_only(method, value):
    x = np.random.default_rng(4).standard_normal(4 * 64 - 10)
    x[2 * 64 + 5] = value  # bucket 2 of 4 (0-based)
    q = Quantizer(method, bucket_size=64, seed=0)
    y = q.decode(q.encode(x))
    assert np.all(np.isnan(y[128:192]))
    assert np.all(np.isfinite(np.delete(y, np.s_[128:192])))
    clean = np.delete(x, np.s_[128:192])
    # the statistics skip the non-finite bucket
    np.testing.assert_allclose(q.statistics(x), q.statistics(clean), rtol=1e-12)


def test_zero_bucket_and_empty():
    for method in ("alq", "terngrad", "qsgdinf"):
        q = Quantizer(method, bucket_size=16, seed=0)
        x = np.random.default_rng(5).standard_normal(40)
        x[16:32] = 0.0
        y = q.decode(q.encode(x))
        assert np.all(y[16:32] == 0) and np.any(y[:16] != 0) and np.any(y[32:] != 0)
        empty = q.decode(q.encode(np.zeros(0, np.float32)))
        assert empty.dtype == np.float32 and empty.shape == (0,)
    q = Quantizer("alq-n", bucket_size=16)
    np.testing.assert_array_equal(q.decode(q.encode(np.zeros(33))), np.zeros(33))
    with pytest.raises(ValueError, match="no data"):
        q.adapt(q.statistics(np.zeros(33)))


# ------------------------------------------------------------------ TernGrad clipping
def test_terngrad_clip():
    rng = np.random.default_rng(6)
    x = rng.standard_normal(4096)
    x[10] = 1000.0  # one outlier dominates the max norm of its bucket
    plain = Quantizer("terngrad", bucket_size=1024, seed=0)
    clipped = Quantizer("terngrad", bucket_size=1024, seed=0, clip=True)
    assert clipped.clip == 2.5 and plain.clip is None
    b = x[:1024]
    bound = 2.5 * b.std()
    yc = clipped.decode(clipped.encode(x))
    assert np.abs(yc[:1024]).max() == pytest.approx(bound, rel=1e-6)  # max-abs of the clipped bucket
    yp = plain.decode(plain.encode(x))
    assert np.abs(yp[:1024]).max() == pytest.approx(1000.0, rel=1e-6)
    # lower error on the outlier bucket, at the price of bias (the outlier is cut to `bound`)
    assert np.sum((yc[11:1024] - x[11:1024]) ** 2) < np.sum((yp[11:1024] - x[11:1024]) ** 2)
    assert Quantizer("terngrad", clip=1.0, bucket_size=1024).clip == 1.0


# ------------------------------------------------------------------ levels, state, adaptation
def test_set_levels_validation():
    q = Quantizer("alq", bits=2, bucket_size=16)
    q.set_levels([-1, -0.1, 0.3, 1])
    assert q.levels.tolist() == [-1, -0.1, 0.3, 1]
    for bad, message in [
        ([-1, 0, 1], r"levels must have shape \(4,\)"),
        ([-1, 0.5, 0.2, 1], "strictly increasing"),
        ([-0.9, 0, 0.5, 1], "start at -1 and end at 1"),
        ([-1, np.nan, 0.5, 1], "finite"),
    ]:
        with pytest.raises(ValueError, match=message):
            q.set_levels(bad)
    with pytest.raises(ValueError, match="qsgd has fixed levels"):
        Quantizer("qsgd", bits=2).set_levels([-1, -0.1, 0.3, 1])
    Quantizer("qsgd", bits=2).set_levels(Quantizer("qsgd", bits=2).levels)  # same levels: fine
    a = Quantizer("amq", bits=3)
    a.set_levels(multiplier_levels(0.3, 3))
    assert a.multiplier == pytest.approx(0.3)
    with pytest.raises(ValueError, match="for some p in"):
        a.set_levels([-1, -0.6, -0.2, -0.05, 0.05, 0.2, 0.6, 1])


def test_state_round_trip():
    x = np.random.default_rng(7).standard_normal(5000)
    for method in ("alq", "amq", "qsgd"):
        q = Quantizer(method, bucket_size=512, seed=11)
        q.adapt(q.statistics(x))
        q.encode(x)
        state = q.state_dict()
        r = Quantizer(method, bucket_size=512, seed=99)
        r.load_state_dict(state)
        assert r.fingerprint == q.fingerprint and r.multiplier == q.multiplier
        np.testing.assert_array_equal(r.encode(x), q.encode(x))
    with pytest.raises(ValueError, match="state has bits=3, this quantizer has bits=4"):
        Quantizer("alq", bits=4, bucket_size=512).load_state_dict(Quantizer("alq", bucket_size=512).state_dict())


@pytest.mark.parametrize("method", ADAPTIVE)
def test_adapt(method):
    rng = np.random.default_rng(8)
    shards = [rng.standard_normal(4 * 2048) for _ in range(4)]
    q_sum, q_mean, q_whole = (Quantizer(method, bucket_size=2048, seed=0) for _ in range(3))
    stats = [q_sum.statistics(s) for s in shards]
    q_sum.adapt(np.sum(stats, axis=0))
    q_mean.adapt(np.mean(stats, axis=0))
    q_whole.adapt(q_whole.statistics(np.concatenate(shards)))
    start = Quantizer("nuqsgd").levels
    assert not np.allclose(q_sum.levels, start)
    np.testing.assert_allclose(q_mean.levels, q_sum.levels, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(q_whole.levels, q_sum.levels, rtol=1e-9, atol=1e-12)
    lv = q_sum.levels
    assert lv[0] == -1 and lv[-1] == 1 and np.all(np.diff(lv) > 0)
    if method.startswith("amq"):
        assert 0 < q_sum.multiplier < 1
        np.testing.assert_allclose(lv, multiplier_levels(q_sum.multiplier, 3))
    # deterministic: same vector, same levels, same fingerprint
    again = Quantizer(method, bucket_size=2048, seed=5)
    again.adapt(np.sum(stats, axis=0))
    assert again.fingerprint == q_sum.fingerprint
    # adapted levels quantize this data with lower variance than the starting (NUQSGD) levels
    x = shards[0]
    nuq = Quantizer("nuqsgd", bucket_size=2048, seed=1)
    err_adapted = np.mean([np.sum((q_sum.decode(q_sum.encode(x)) - x) ** 2) for _ in range(5)])
    err_nuqsgd = np.mean([np.sum((nuq.decode(nuq.encode(x)) - x) ** 2) for _ in range(5)])
    assert err_adapted < err_nuqsgd
    # a payload from the adapted quantizer is refused by one with the old levels
    with pytest.raises(ValueError, match="levels differ"):
        Quantizer(method, bucket_size=2048).decode(q_sum.encode(x))


def test_adapt_is_noop_for_fixed_methods():
    for method in FIXED:
        q = Quantizer(method, bucket_size=64)
        before = q.levels
        q.adapt(q.statistics(np.random.default_rng(9).standard_normal(500)))
        np.testing.assert_array_equal(q.levels, before)
