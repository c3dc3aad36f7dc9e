"""Distributions on [-1, 1]: against scipy.stats.truncnorm, quadrature, and each other."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import integrate, stats

from horovod_alq.core.distributions import SIGMA_MIN, NormWeightedMixture, TruncatedNormal
from horovod_alq.core.grid import GridDistribution, GridStack

# (mu, sigma) where scipy's truncnorm is itself accurate.
MODERATE = [(0.0, 0.02), (0.3, 0.1), (-0.5, 0.5), (0.0, 1.0), (0.9, 3.0), (-1.2, 0.3), (1.5, 0.5)]


def scipy_tn(mu, sigma):
    return stats.truncnorm((-1 - mu) / sigma, (1 - mu) / sigma, loc=mu, scale=sigma)


def points(mu, sigma):
    x = np.concatenate([np.linspace(-1, 1, 41), mu + sigma * np.linspace(-4, 4, 17)])
    return np.sort(x[(x >= -1) & (x <= 1)])


@pytest.mark.parametrize("mu,sigma", MODERATE)
def test_truncated_normal_matches_scipy(mu, sigma):
    d, ref = TruncatedNormal(mu, sigma), scipy_tn(mu, sigma)
    x = points(mu, sigma)
    np.testing.assert_allclose(d.cdf(x), ref.cdf(x), rtol=0, atol=1e-13)
    np.testing.assert_allclose(d.pdf(x), ref.pdf(x), rtol=1e-10, atol=1e-300)
    q = np.linspace(0, 1, 21)
    np.testing.assert_allclose(d.ppf(q), ref.ppf(q), rtol=0, atol=1e-12)
    assert d.mean() == pytest.approx(ref.mean(), rel=1e-11, abs=1e-14)
    assert d.var() == pytest.approx(ref.var(), rel=1e-9)


@pytest.mark.parametrize("mu,sigma", MODERATE + [(0.2, 1e-3), (2.0, 0.05)])
def test_partial_moments_match_quadrature(mu, sigma):
    d = TruncatedNormal(mu, sigma)
    for x in (-1.0, mu - sigma, mu, mu + 0.5 * sigma, 0.7, 1.0):
        x = float(np.clip(x, -1, 1))
        for k in (0, 1, 2):
            ref = integrate.quad(
                lambda r: r**k * d.pdf(r),
                -1.0,
                x,
                points=[mu] if -1 < mu < x else None,
                epsabs=1e-14,
                epsrel=1e-11,
                limit=200,
            )[0]
            assert d.partial_moment(x, k) == pytest.approx(ref, rel=1e-9, abs=1e-13), (x, k)
    np.testing.assert_allclose(d.partial_moments([-1.0, 1.0])[:, 0], 0, atol=0)
    assert d.partial_moment(1.0, 0) == 1.0
    assert d.partial_moment(1.0, 1) == pytest.approx(d.mean(), abs=1e-15)


def test_broadcasting_like_frozen_scipy():
    mu = np.array([-0.3, 0.0, 0.4])[:, None]
    sigma = np.array([0.05, 0.2, 1.0])[:, None]
    x = np.linspace(-1, 1, 11)
    d = TruncatedNormal(mu, sigma)
    assert d.cdf(x).shape == (3, 11)
    assert d.partial_moments(x).shape == (3, 3, 11)
    np.testing.assert_allclose(d.cdf(x), scipy_tn(mu, sigma).cdf(x), atol=1e-13)
    np.testing.assert_allclose(d.mean(), scipy_tn(mu, sigma).mean(), atol=1e-14)
    assert isinstance(TruncatedNormal(0, 1).cdf(0.0), float)


@pytest.mark.parametrize(
    "mu,sigma", [(0.0, 1e-8), (0.3, 1e-8), (1.0, 1e-8), (2.0, 1e-8), (-5.0, 0.01), (1e3, 0.1), (0.5, 0.0), (-1.0, 1e-4)]
)
def test_truncated_normal_extreme_parameters(mu, sigma):
    d = TruncatedNormal(mu, sigma)
    s = max(sigma, SIGMA_MIN)
    q = np.linspace(0, 1, 101)
    x = d.ppf(q)
    assert np.all(np.isfinite(x)) and np.all(np.diff(x) >= 0)
    assert x[0] == -1.0 and x[-1] == 1.0
    grid = np.linspace(-1, 1, 2001)
    f = d.cdf(grid)
    assert np.all((f >= 0) & (f <= 1)) and np.all(np.diff(f) >= 0)
    assert d.cdf(-1.0) == 0.0 and d.cdf(1.0) == 1.0
    m = np.clip(mu, -1, 1)
    # The mass sits at mu (inside) or within sigma^2 / distance of the nearer bound (outside).
    spread = 10 * s if -1 < mu < 1 else 10 * s * s / max(abs(mu) - 1, s)
    assert abs(d.mean() - m) <= spread + 8 * np.spacing(max(1.0, abs(mu)))
    # var() has absolute error ~ eps * (mu - nearest bound)^2 (documented).
    assert 0 <= d.var() <= spread**2 + 8 * np.spacing(max(1.0, (abs(mu) - 1) ** 2))
    # F(ppf(q)) = q up to the resolution of x: a few ulps of x times the density.
    x = d.ppf(q[1:-1])
    assert np.all(np.abs(d.cdf(x) - q[1:-1]) <= 1e-12 + 4 * np.spacing(np.abs(x)) * d.pdf(x))


def test_far_tail_against_exponential_limit():
    # mu = 2, sigma = 0.01: the density on [-1, 1] is ~ exp(-lam (1 - r)), lam = (mu - 1) / sigma^2,
    # with relative corrections of order 1 / beta^2 = 1e-4.
    d = TruncatedNormal(2.0, 0.01)
    lam = 1.0 / 0.01**2
    assert 1 - d.mean() == pytest.approx(1 / lam, rel=3e-4)
    assert d.var() == pytest.approx(1 / lam**2, rel=1e-3)
    assert 1 - d.ppf(0.5) == pytest.approx(np.log(2) / lam, rel=1e-3)


def test_truncated_normal_bad_inputs():
    with pytest.raises(ValueError, match="sigma"):
        TruncatedNormal(0.0, -0.1)
    with pytest.raises(ValueError, match="sigma"):
        TruncatedNormal(0.0, np.nan)
    with pytest.raises(ValueError, match="mu"):
        TruncatedNormal(np.inf, 0.1)
    with pytest.raises(ValueError, match="bounds"):
        TruncatedNormal(0.0, 0.1, a=1.0, b=-1.0)
    with pytest.raises(ValueError, match="order"):
        TruncatedNormal(0.0, 0.1).partial_moment(0.0, 3)
    assert np.isnan(TruncatedNormal(0.0, 0.1).ppf(1.5))


def test_mixture_matches_weighted_scipy_sum():
    rng = np.random.default_rng(1)
    n = rng.uniform(0.1, 2.0, 7)
    mus = rng.uniform(-0.5, 0.5, 7)
    sig = rng.uniform(0.01, 0.3, 7)
    d = NormWeightedMixture(n, mus, sig)
    w = n / n.sum()
    x = np.linspace(-1, 1, 57)
    refs = [scipy_tn(m, s) for m, s in zip(mus, sig)]
    np.testing.assert_allclose(d.cdf(x), sum(wi * r.cdf(x) for wi, r in zip(w, refs)), atol=1e-13)
    np.testing.assert_allclose(d.pdf(x), sum(wi * r.pdf(x) for wi, r in zip(w, refs)), rtol=1e-10)
    assert d.mean() == pytest.approx(sum(wi * r.mean() for wi, r in zip(w, refs)), abs=1e-14)
    second = sum(wi * (r.var() + r.mean() ** 2) for wi, r in zip(w, refs))
    assert d.var() == pytest.approx(second - d.mean() ** 2, rel=1e-10)
    comps = [TruncatedNormal(m, s) for m, s in zip(mus, sig)]
    expected = sum(wi * c.partial_moments(x) for wi, c in zip(w, comps))
    np.testing.assert_allclose(d.partial_moments(x), expected, atol=1e-14)
    q = np.linspace(0, 1, 41)
    np.testing.assert_allclose(d.cdf(d.ppf(q)), q, atol=1e-12)


def test_mixture_ppf_narrow_and_separated_components():
    d = NormWeightedMixture([1.0, 3.0, 0.0], [-0.5, 0.5, 0.0], [1e-6, 1e-6, 0.1])
    assert d.weights.tolist() == [0.25, 0.75]
    q = np.array([0.1, 0.2, 0.5, 0.9])
    x = d.ppf(q)
    np.testing.assert_allclose(x, [-0.5, -0.5, 0.5, 0.5], atol=1e-5)
    np.testing.assert_allclose(d.cdf(x), q, atol=1e-12)
    assert d.ppf(0.25) == pytest.approx(d.ppf(0.25), abs=0)  # deterministic


def test_mixture_bad_inputs():
    with pytest.raises(ValueError, match="all zero"):
        NormWeightedMixture([0.0, 0.0], [0.0, 0.1], [0.1, 0.1])
    with pytest.raises(ValueError, match="nonnegative"):
        NormWeightedMixture([1.0, -1.0], [0.0, 0.1], [0.1, 0.1])
    with pytest.raises(ValueError, match="sigma"):
        NormWeightedMixture([1.0, 1.0], [0.0, 0.1], [0.1, -0.1])


def test_grid_of_fine_truncated_normal_cdf_approximates_it():
    d = TruncatedNormal(0.1, 0.2)
    g = np.linspace(-1, 1, 4001)
    gd = GridDistribution(g, d.cdf(g))
    x = np.linspace(-1, 1, 333)
    # Linear interpolation of F: error <= h^2 / 8 max |F''| = h^2 / 8 max |f'|.
    h = g[1] - g[0]
    fine = np.linspace(-1, 1, 100001)
    max_df = np.max(np.abs(np.diff(d.pdf(fine)) / np.diff(fine))) * 1.01
    bound = h**2 / 8 * max_df
    np.testing.assert_allclose(gd.cdf(x), d.cdf(x), rtol=0, atol=bound)
    np.testing.assert_allclose(gd.partial_moments(x), d.partial_moments(x), rtol=0, atol=bound)
    np.testing.assert_allclose(gd.pdf(x), d.pdf(x), rtol=0, atol=h * max_df)  # cell averages
    q = np.linspace(0, 1, 51)
    np.testing.assert_allclose(d.cdf(gd.ppf(q)), q, rtol=0, atol=bound)
    # mean = 1 - int F, E r^2 = 1 - int 2 r F over [-1, 1]: both move by at most 2 * bound.
    assert gd.mean() == pytest.approx(d.mean(), rel=0, abs=2 * bound)
    assert gd.var() == pytest.approx(d.var(), rel=0, abs=2 * bound * (1 + 2 * abs(d.mean()) + 2 * bound))


def test_grid_exact_cells_and_flat_stretches():
    # Mass 1/2 uniform on [-0.5, -0.4] and 1/2 on [0.2, 0.6]; zero mass elsewhere.
    g = [-1.0, -0.5, -0.4, 0.2, 0.6, 1.0]
    gd = GridDistribution(g, [0, 0, 1, 1, 2, 2])  # unnormalized: divided by the last value
    assert gd.partial_moment(1.0, 1) == pytest.approx(0.5 * -0.45 + 0.5 * 0.4, abs=1e-15)
    e2 = 0.5 * (0.5**3 - 0.4**3) / (3 * 0.1) + 0.5 * (0.6**3 - 0.2**3) / (3 * 0.4)
    assert gd.partial_moment(1.0, 2) == pytest.approx(e2, abs=1e-15)
    assert gd.var() == pytest.approx(e2 - gd.mean() ** 2, abs=1e-15)
    assert gd.partial_moment(0.4, 0) == pytest.approx(0.75, abs=1e-15)
    # Flat stretches: ppf is the left end of {F >= q}; F(ppf(q)) = q.
    assert gd.ppf(0.5) == pytest.approx(-0.4, abs=1e-15)
    assert gd.ppf(0.0) == -1.0 and gd.ppf(1.0) == pytest.approx(0.6, abs=1e-15)
    q = np.linspace(0, 1, 77)
    np.testing.assert_allclose(gd.cdf(gd.ppf(q)), q, atol=1e-15)
    assert gd.pdf(0.0) == 0.0 and gd.pdf(0.3) == pytest.approx(0.5 / 0.4)
    assert gd.pdf(1.5) == 0.0 and np.isnan(gd.ppf(-0.1))


def test_grid_bad_inputs():
    with pytest.raises(ValueError, match="strictly increasing"):
        GridDistribution([-1, 0, 0, 1], [0, 0.5, 0.5, 1])
    with pytest.raises(ValueError, match="from -1 to 1"):
        GridDistribution([-1, 0, 0.9], [0, 0.5, 1])
    with pytest.raises(ValueError, match="nondecreasing"):
        GridDistribution([-1, 0, 0.5, 1], [0, 0.6, 0.5, 1])
    with pytest.raises(ValueError, match=r"cdf_values\[0\]"):
        GridDistribution([-1, 0, 1], [0.2, 0.5, 1])
    with pytest.raises(ValueError, match="total mass"):
        GridDistribution([-1, 0, 1], [0, 0, 0])
    with pytest.raises(ValueError, match="same length"):
        GridDistribution([-1, 0, 1], [0, 1])
    with pytest.raises(ValueError, match="finite"):
        GridDistribution([-1, 0, 1], [0, np.nan, 1])


@settings(max_examples=40, deadline=None)
@given(mu=st.floats(-3, 3), log_sigma=st.floats(-8, 1), q=st.floats(0, 1))
def test_ppf_cdf_round_trip(mu, log_sigma, q):
    d = TruncatedNormal(mu, 10.0**log_sigma)
    x = d.ppf(q)
    assert -1 <= x <= 1
    # |F(ppf(q)) - q| is limited by the resolution of x: one ulp times the density.
    assert abs(d.cdf(x) - q) <= 1e-12 + 4 * np.spacing(1.0) * d.pdf(x)
    grid = GridDistribution(np.linspace(-1, 1, 201), TruncatedNormal(mu, 0.3).cdf(np.linspace(-1, 1, 201)))
    assert abs(grid.cdf(grid.ppf(q)) - q) <= 1e-15


def test_grid_stack_is_its_distributions_side_by_side():
    """GridStack (the ALQ fits of several widths at once, the errors of bits="auto"): moments and
    inverse CDF of distribution ``which`` are exactly each GridDistribution's, built from the
    distributions or straight from cumulative weights, for ties with grid CDF values, flat
    stretches, 0, 1 and NaN."""
    rng = np.random.default_rng(1)
    grid = np.concatenate([[-1.0], np.sort(rng.uniform(-1, 1, 60)), [1.0]])
    weights = np.cumsum(rng.exponential(size=(4, grid.size)) * (rng.random((4, grid.size)) < 0.6), axis=1)
    weights[:, 0] = 0.0
    weights *= np.array([[1.0], [1e6], [1e-6], [3.0]])
    dists = [GridDistribution(grid, w) for w in weights]
    which = rng.integers(0, 4, 3000)
    q = rng.random(3000)
    q[:40], q[40:80], q[80:90] = 0.0, 1.0, np.nan
    q[90:600] = np.stack([d.cdf_values for d in dists])[which[90:600], rng.integers(0, grid.size, 510)]
    x = rng.uniform(-1.2, 1.2, 3000)
    for stack in (GridStack(dists), GridStack.from_cumulative(grid, weights)):
        want_ppf = np.choose(which, [d._ppf_raw(np.minimum(np.maximum(q, 0), 1)) for d in dists])
        np.testing.assert_array_equal(stack._ppf_raw(q, which), want_ppf)
        want_m = np.stack([np.choose(which, [d._mpdf(x)[k] for d in dists]) for k in range(4)])
        np.testing.assert_array_equal(stack._mpdf(x, which), want_m)
