"""Bucket normalization, moments, the additive statistics vector and its distribution."""

import numpy as np
import pytest

from horovod_alq.core.statistics import (
    GRID,
    bucket_moments,
    distribution_from_statistics,
    normalize,
    statistics_length,
    summarize,
)

ALL = ["qsgdinf", "qsgd", "nuqsgd", "terngrad", "alq", "alq-n", "amq", "amq-n"]


def test_grid():
    assert GRID.shape == (801,) and np.all(np.diff(GRID) > 0)
    np.testing.assert_array_equal(GRID, -GRID[::-1])
    assert GRID[0] == -1 and GRID[-1] == 1 and GRID[400] == 0 and GRID[401] == pytest.approx(1e-6)
    assert [statistics_length(m) for m in ALL] == [4, 4, 4, 4, 802, 4, 802, 4]


def test_normalize_matches_encoder_rule():
    rng = np.random.default_rng(0)
    x = rng.standard_normal(21).astype(np.float32) * 3
    for norm, ref in (("l2", np.linalg.norm), ("linf", lambda v: np.abs(v).max())):
        nz = normalize(x, 8, norm)
        assert nz.norms.dtype == np.float32 and nz.r.shape == (3, 8) and nz.counts.tolist() == [8, 8, 5]
        for b in range(3):
            v = x[b * 8 : (b + 1) * 8].astype(np.float64)
            n32 = np.float32(ref(v))
            assert nz.norms[b] == n32
            np.testing.assert_array_equal(nz.r[b, : v.size], np.clip(v / np.float64(n32), -1, 1))
        assert np.all(nz.r[2, 5:] == 0)
        assert np.all(np.abs(nz.r) <= 1)
    assert np.max(np.abs(normalize(x, 8, "linf").r), axis=1).tolist() == [1, 1, 1]


def test_moments_skip_nonfinite_and_zero_buckets():
    x = np.arange(1, 13, dtype=np.float64)
    x[4:8] = 0.0
    x[9] = np.inf
    nz = normalize(x, 4, "l2")
    assert nz.norms[1] == 0 and np.isnan(nz.norms[2])
    assert np.all(nz.r[1:] == 0)
    m = bucket_moments(x, 4, "l2")
    v = np.arange(1, 5.0)
    n32 = np.float64(np.float32(np.linalg.norm(v)))
    np.testing.assert_array_equal(m.norms, [n32])
    np.testing.assert_array_equal(m.count, [4])
    np.testing.assert_allclose(m.sum_r, [v.sum() / n32], rtol=1e-15)
    np.testing.assert_allclose(m.sum_r2, [(v**2).sum() / n32**2], rtol=1e-15)
    empty = bucket_moments(np.zeros(0, np.float32), 4, "l2")
    assert empty.norms.size == 0
    np.testing.assert_array_equal(summarize("alq-n", normalize(np.zeros(0, np.float32), 4, "l2")), [0, 0, 0, 0])


def test_normless_vector_and_distribution():
    rng = np.random.default_rng(1)
    x = rng.normal(0.3, 1.0, 1000)
    nz = normalize(x, 64, "l2")
    s = summarize("alq-n", nz)
    r = [nz.r[b, :c] for b, c in enumerate(nz.counts)]
    expected = [1000, sum(v.sum() for v in r), sum((v**2).sum() for v in r), sum(v.sum() ** 2 / v.size for v in r)]
    np.testing.assert_allclose(s, expected, rtol=1e-12)
    dist = distribution_from_statistics("alq-n", s)
    within = sum(((v - v.mean()) ** 2).sum() for v in r) / 1000
    np.testing.assert_allclose([dist.mu, dist.sigma], [expected[1] / 1000, np.sqrt(within)], rtol=1e-9)


def test_norm_based_vector_is_the_norm_weighted_empirical_cdf():
    rng = np.random.default_rng(2)
    x = rng.standard_t(3, 20 * 32 + 7)
    x[32:64] = 0.0  # a zero bucket carries no weight
    nz = normalize(x, 32, "l2")
    s = summarize("alq", nz)
    expected = np.zeros(GRID.size)
    for b, count in enumerate(nz.counts):
        if nz.norms[b] > 0:
            r = nz.r[b, :count]
            expected += nz.norms[b] / count * (r[None, :] <= GRID[:, None]).sum(axis=1)
    expected[0] = 0.0  # a coordinate at exactly -1 counts in the first cell
    np.testing.assert_allclose(s[0], nz.norms.astype(np.float64).sum(), rtol=1e-14)
    np.testing.assert_allclose(s[1:], expected, rtol=1e-12, atol=1e-12)
    dist = distribution_from_statistics("alq", s)
    np.testing.assert_allclose(dist.cdf(GRID), expected / expected[-1], rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("method", ["alq", "alq-n", "amq", "amq-n", "qsgd", "terngrad"])
def test_shards_sum_to_whole(method):
    norm = "linf" if method == "terngrad" else "l2"
    x = np.random.default_rng(3).standard_normal(4 * 3 * 256 + 100)
    whole = summarize(method, normalize(x, 256, norm))
    edges = [0, 3 * 256, 6 * 256, 9 * 256, x.size]  # bucket-aligned shards
    parts = [summarize(method, normalize(x[a:b], 256, norm)) for a, b in zip(edges, edges[1:])]
    np.testing.assert_allclose(np.sum(parts, axis=0), whole, rtol=1e-12, atol=1e-12)
    d_sum = distribution_from_statistics(method, np.sum(parts, axis=0))
    d_mean = distribution_from_statistics(method, np.mean(parts, axis=0))
    probe = np.linspace(-1, 1, 101)
    np.testing.assert_allclose(d_sum.cdf(probe), d_mean.cdf(probe), rtol=1e-12, atol=1e-15)


def test_distribution_errors():
    with pytest.raises(ValueError, match=r"statistics vector has shape \(5,\), method alq-n expects \(4,\)"):
        distribution_from_statistics("alq-n", np.ones(5))
    with pytest.raises(ValueError, match=r"method alq expects \(802,\)"):
        distribution_from_statistics("alq", np.ones(4))
    with pytest.raises(ValueError, match=r"non-finite entries at indices \[2\]"):
        distribution_from_statistics("amq-n", [10, 1, np.nan, 1])
    with pytest.raises(ValueError, match=r"no data: N \(coordinate count\) is 0.0"):
        distribution_from_statistics("alq-n", np.zeros(4))
    with pytest.raises(ValueError, match=r"no data: W \(sum of bucket norms\) is 0.0"):
        distribution_from_statistics("amq", np.zeros(802))
    with pytest.raises(ValueError, match="unknown method 'foo'"):
        statistics_length("foo")
