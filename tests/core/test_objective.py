"""Psi (expected variance of stochastic rounding) and the AMQ objective with its derivative."""

import numpy as np
import pytest
from scipy import stats

from horovod_alq.core.distributions import NormWeightedMixture, TruncatedNormal
from horovod_alq.core.grid import GridDistribution
from horovod_alq.core.methods import multiplier_levels, nuqsgd_levels, uniform_levels
from horovod_alq.core.objective import (
    amq_derivative,
    amq_objective,
    check_levels,
    expected_variance,
)


def stochastic_round(r, levels, rng):
    j = np.clip(np.searchsorted(levels, r, side="right") - 1, 0, levels.size - 2)
    lo, hi = levels[j], levels[j + 1]
    up = rng.random(r.size) < (r - lo) / (hi - lo)
    return np.where(up, hi, lo)


@pytest.mark.parametrize(
    "mu,sigma,levels",
    [
        (0.1, 0.3, uniform_levels(3)),
        (0.0, 0.02, nuqsgd_levels(3)),
        (-0.2, 0.05, np.array([-1.0, -0.3, -0.2, -0.15, 0.0, 0.1, 0.5, 1.0])),
        (0.5, 1.0, nuqsgd_levels(2)),
    ],
)
def test_expected_variance_matches_monte_carlo(mu, sigma, levels):
    n = 200_000
    r = stats.truncnorm((-1 - mu) / sigma, (1 - mu) / sigma, loc=mu, scale=sigma).rvs(
        n, random_state=np.random.default_rng(7)
    )
    q = stochastic_round(r, levels, np.random.default_rng(8))
    assert abs(np.mean(q - r)) <= 5 * np.std(q - r) / np.sqrt(n)  # unbiased rounding
    err = (q - r) ** 2
    psi = expected_variance(levels, TruncatedNormal(mu, sigma))
    assert abs(err.mean() - psi) <= 5 * err.std(ddof=1) / np.sqrt(n)


def test_expected_variance_monte_carlo_mixture():
    w, mus, sig = np.array([1.0, 2.0, 0.5]), np.array([-0.4, 0.05, 0.6]), np.array([0.05, 0.02, 0.2])
    d = NormWeightedMixture(w, mus, sig)
    n = 200_000
    rng = np.random.default_rng(3)
    comp = rng.choice(3, size=n, p=w / w.sum())
    r = np.empty(n)
    for k in range(3):
        idx = comp == k
        a, b = (-1 - mus[k]) / sig[k], (1 - mus[k]) / sig[k]
        r[idx] = stats.truncnorm(a, b, loc=mus[k], scale=sig[k]).rvs(idx.sum(), random_state=rng)
    levels = uniform_levels(3)
    err = (stochastic_round(r, levels, rng) - r) ** 2
    assert abs(err.mean() - expected_variance(levels, d)) <= 5 * err.std(ddof=1) / np.sqrt(n)


def test_expected_variance_uniform_exact():
    uniform = GridDistribution([-1.0, 1.0], [0.0, 1.0])  # density 1/2; a cell of width h costs h^3/12
    assert expected_variance([-1.0, 0.0, 1.0], uniform) == pytest.approx(1 / 6, rel=1e-15)
    assert expected_variance([-1.0, 0.5, 1.0], uniform) == pytest.approx((1.5**3 + 0.5**3) / 12, rel=1e-15)
    for bits in (2, 3, 5):
        h = 2 / (2**bits - 1)
        assert expected_variance(uniform_levels(bits), uniform) == pytest.approx(h * h / 6, rel=1e-13)
    assert expected_variance([-1.0, 1.0], uniform) == pytest.approx(8 / 12, rel=1e-15)


def test_expected_variance_near_point_mass_on_a_level():
    # sigma = 0 is floored to SIGMA_MIN; Psi ~ E|r - 0.3| * (neighbour distance) on each side.
    sigma = 1e-12
    expected = sigma / np.sqrt(2 * np.pi) * (0.7 + 1.3)
    assert expected_variance([-1.0, 0.3, 1.0], TruncatedNormal(0.3, 0.0)) == pytest.approx(expected, rel=1e-3)


def test_check_levels_errors():
    with pytest.raises(ValueError, match="strictly increasing"):
        expected_variance([-1.0, 0.5, 0.5, 1.0], TruncatedNormal(0, 0.1))
    with pytest.raises(ValueError, match="start at -1 and end at 1"):
        expected_variance([-0.9, 0.0, 1.0], TruncatedNormal(0, 0.1))
    with pytest.raises(ValueError, match="finite"):
        check_levels([-1.0, np.nan, 1.0])
    with pytest.raises(ValueError, match="1-D"):
        check_levels([[-1.0, 1.0]])
    with pytest.raises(ValueError, match="expected 4 levels"):
        check_levels([-1.0, 1.0], size=4)


_G = np.linspace(-1, 1, 801)
DISTS = {
    "tn-narrow": TruncatedNormal(0.0, 0.02),
    "tn-skewed": TruncatedNormal(0.15, 0.1),
    "mixture": NormWeightedMixture([1.0, 2.0, 0.3], [-0.05, 0.02, 0.4], [0.03, 0.01, 0.2]),
    "grid": GridDistribution(_G, TruncatedNormal(-0.1, 0.2).cdf(_G)),
}


@pytest.mark.parametrize("name", DISTS)
@pytest.mark.parametrize("bits", [2, 3, 4])
def test_amq_derivative_matches_finite_differences(name, bits):
    d = DISTS[name]
    for p in (0.15, 0.35, 0.5, 0.72, 0.9):
        g = amq_derivative(p, bits, d)
        h = 1e-5

        def fd(h):
            return (amq_objective(p + h, bits, d) - amq_objective(p - h, bits, d)) / (2 * h)

        # Truncation error of the central difference ~ |fd(h) - fd(2h)| / 3 (it scales as h^2);
        # rounding error ~ eps * Psi / h.
        tol = 2 * abs(fd(h) - fd(2 * h)) + 50 * np.spacing(1.0) * amq_objective(p, bits, d) / h + 1e-12
        assert g == pytest.approx(fd(h), rel=0, abs=tol), (p, g, fd(h))


def paper_dv_dp(p, bits, mu, sigma):
    """The paper's closed form for the positive half, truncated normal (sec. 5)."""
    d = TruncatedNormal(mu, sigma)
    s = 2 ** (bits - 1) - 1
    out = 2 * s * p ** (2 * s - 1) * (d.cdf(p**s) - d.cdf(0.0))
    for j in range(s):
        c = (j * p ** (j - 1) if j else 0.0) + (j + 1) * p**j
        out += (mu * c - (2 * j + 1) * p ** (2 * j)) * (d.cdf(p**j) - d.cdf(p ** (j + 1)))
        out += sigma**2 * c * (d.pdf(p ** (j + 1)) - d.pdf(p**j))
    return out


@pytest.mark.parametrize("sigma", [0.01, 0.05, 0.3, 1.0])
@pytest.mark.parametrize("bits", [2, 3, 4])
def test_amq_derivative_is_twice_paper_formula_for_symmetric_tn(sigma, bits):
    d = TruncatedNormal(0.0, sigma)
    for p in (0.1, 0.3, 0.5, 0.8):
        expected = 2 * paper_dv_dp(p, bits, 0.0, sigma)
        assert amq_derivative(p, bits, d) == pytest.approx(expected, rel=1e-12, abs=1e-15)


def test_amq_objective_is_psi_of_multiplier_levels():
    d = DISTS["mixture"]
    for p, bits in [(0.3, 3), (0.5, 2), (0.8, 4)]:
        expected = expected_variance(multiplier_levels(p, bits), d)
        assert amq_objective(p, bits, d) == pytest.approx(expected, rel=1e-14)
    assert amq_objective(0.5, 3, d) == expected_variance(nuqsgd_levels(3), d)
    with pytest.raises(ValueError, match="multiplier p"):
        amq_objective(1.0, 3, d)
    with pytest.raises(ValueError, match="bits"):
        amq_derivative(0.5, 1, d)
