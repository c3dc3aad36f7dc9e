"""ALQ (coordinate descent on the levels) and AMQ (gradient descent on the multiplier)."""

import numpy as np
import pytest
from scipy import optimize

from horovod_alq.core.adaptation import (
    _companding_levels,
    _quantile_levels,
    fit_alq_levels,
    fit_alq_levels_together,
    fit_amq_multiplier,
)
from horovod_alq.core.distributions import NormWeightedMixture, TruncatedNormal
from horovod_alq.core.grid import GridDistribution
from horovod_alq.core.methods import multiplier_levels, nuqsgd_levels, uniform_levels
from horovod_alq.core.objective import amq_objective, expected_variance

GRID = np.concatenate([-np.geomspace(1e-6, 1, 400)[::-1], [0.0], np.geomspace(1e-6, 1, 400)])


def _mixture(n=60, seed=0):
    rng = np.random.default_rng(seed)
    return NormWeightedMixture(rng.uniform(0.1, 1, n), rng.normal(0, 0.01, n), rng.uniform(0.005, 0.05, n))


DISTS = {
    "tn-0.01": TruncatedNormal(0.0, 0.01),
    "tn-0.02-shifted": TruncatedNormal(0.004, 0.02),
    "tn-0.05": TruncatedNormal(0.0, 0.05),
    "mixture": _mixture(),
    "grid": GridDistribution(GRID, _mixture(seed=1).cdf(GRID)),
}

# Near-zero density between or around the mass.
SPARSE = {
    "two-narrow": NormWeightedMixture([1.0, 1.0], [-0.5, 0.5], [1e-3, 1e-3]),
    "two-very-narrow": NormWeightedMixture([1.0, 3.0], [-0.5, 0.5], [1e-6, 1e-6]),
    "tn-1e-4": TruncatedNormal(0.0, 1e-4),
    "grid-gaps": GridDistribution([-1, -0.5, -0.49, 0.3, 0.31, 1], [0, 0, 0.5, 0.5, 1, 1]),
}


def check_valid(levels, bits):
    assert levels.dtype == np.float64 and levels.shape == (2**bits,)
    assert levels[0] == -1.0 and levels[-1] == 1.0
    assert np.all(np.diff(levels) > 0)


@pytest.mark.parametrize("name", DISTS)
@pytest.mark.parametrize("bits", [2, 3])
def test_alq_beats_fixed_schemes_and_its_starts(name, bits):
    d = DISTS[name]
    levels = fit_alq_levels(d, bits)
    check_valid(levels, bits)
    psi = expected_variance(levels, d)
    for start in (uniform_levels(bits), nuqsgd_levels(bits), _quantile_levels(d, 2**bits)):
        assert psi <= expected_variance(start, d)
    if bits == 3:  # normalized gradients are concentrated near 0: far better than fixed levels
        assert psi < 0.1 * expected_variance(nuqsgd_levels(bits), d)


@pytest.mark.parametrize(
    "name,bits", [("mixture", 5), ("grid", 5), ("grid", 8), ("tn-0.02-shifted", 5), ("tn-0.02-shifted", 8)]
)  # (the mixture's 8-bit reference takes 20 s)
def test_alq_wide_fits_reach_the_optimum_in_the_default_sweeps(name, bits):
    """5 to 8 bits (what bits="auto" gives the tensors that matter): the default 30 sweeps end within
    1% of the Psi that 400 sweeps reach. From the quantile, uniform and NUQSGD starts alone they
    ended 14% (5 bits) to 280% (8 bits) above it on the GPT's gradients: the companding start (the
    quantiles of pdf^(1/3)) is what gets there."""
    d = DISTS[name]
    fitted = fit_alq_levels(d, bits)
    check_valid(fitted, bits)
    best = expected_variance(fit_alq_levels(d, bits, sweeps=400), d)
    assert expected_variance(fitted, d) <= 1.01 * best


def test_companding_levels():
    """Quantiles of pdf^(1/3): uniform levels for a uniform density; valid, denser where the mass is,
    and spread over stretches of zero density without ties (a grid with gaps)."""
    flat = GridDistribution([-1.0, 0.0, 1.0], [0.0, 0.5, 1.0])
    np.testing.assert_allclose(_companding_levels(flat, 8), uniform_levels(3), atol=1e-8)
    for name, d in {**DISTS, **SPARSE}.items():
        levels = _companding_levels(d, 256)
        check_valid(levels, 8)
    narrow = _companding_levels(DISTS["tn-0.01"], 16)
    assert np.diff(narrow)[7] < np.diff(narrow)[0]  # finer near 0, where the mass is


def test_alq_with_init_never_worse_than_init():
    d = DISTS["mixture"]
    init = np.array([-1.0, -0.07, -0.03, -0.01, 0.01, 0.03, 0.07, 1.0])
    levels = fit_alq_levels(d, 3, init=init)
    assert expected_variance(levels, d) <= expected_variance(init, d)
    again = fit_alq_levels(d, 3, init=levels)  # refitting from the result keeps it optimal
    assert expected_variance(again, d) <= expected_variance(levels, d)
    with pytest.raises(ValueError, match="expected 8 levels"):
        fit_alq_levels(d, 3, init=nuqsgd_levels(2))


@pytest.mark.parametrize("sigma", [0.02, 0.2])
def test_alq_reaches_the_optimum_for_2_bits(sigma):
    # Symmetric F, 2 bits: levels -1, -l, l, 1; minimize Psi over l directly.
    d = TruncatedNormal(0.0, sigma)
    res = optimize.minimize_scalar(
        lambda v: expected_variance([-1, -v, v, 1], d),
        bounds=(1e-6, 1 - 1e-6),
        method="bounded",
        options={"xatol": 1e-12},
    )
    levels = fit_alq_levels(d, 2, sweeps=200)
    assert expected_variance(levels, d) <= res.fun * (1 + 1e-9)
    np.testing.assert_allclose(levels[1:3], [-res.x, res.x], rtol=1e-4)


@pytest.mark.parametrize("bits", [4, 6])
def test_alq_sweeps_reach_the_stationary_levels(bits):
    """The red-black sweeps converge to the paper's fixed point: every interior level solves
    F(l_j) = F(l_{j+1}) - int_{l_{j-1}}^{l_{j+1}} (r - l_{j-1}) dF / (l_{j+1} - l_{j-1})."""
    d = TruncatedNormal(0.01, 0.1)
    levels = fit_alq_levels(d, bits, sweeps=3000)
    a, x, b = levels[:-2], levels[1:-1], levels[2:]
    m = d._mpdf(np.stack([a, x, b]))
    q = m[0, 2] - ((m[1, 2] - m[1, 0]) - a * (m[0, 2] - m[0, 0])) / (b - a)
    assert np.max(np.abs(m[0, 1] - q)) < 1e-7  # (30 sweeps: 1e-4 to 1e-3; the floor is the ppf's precision)
    assert expected_variance(levels, d) < expected_variance(fit_alq_levels(d, bits, sweeps=30), d) * (1 + 1e-9)


def test_alq_fits_together_equal_the_fits_alone():
    """bits="auto" refits its widths in use in one descent: the same levels, bit for bit, as
    fitting each alone (grid distributions), and one after another for other distributions."""
    rng = np.random.default_rng(5)
    grid = np.linspace(-1.0, 1.0, 201)
    dists = []
    for scale in (0.05, 0.2, 0.01, 0.5):
        dens = np.exp(-0.5 * (grid / scale) ** 2) * rng.uniform(0.5, 1.5, grid.size)
        dens[rng.integers(0, grid.size, 20)] = 0.0  # empty cells: flat stretches of the CDF
        dists.append(GridDistribution(grid, np.concatenate([[0.0], np.cumsum(dens[1:])])))
    bits = [2, 5, 3, 8]
    inits = [None, uniform_levels(5), nuqsgd_levels(3), None]
    together = fit_alq_levels_together(dists, bits, inits=inits)
    for d, b, init, got in zip(dists, bits, inits, together):
        np.testing.assert_array_equal(got, fit_alq_levels(d, b, init=init))
    mixed = [TruncatedNormal(0.0, 0.1), dists[0]]
    for d, got in zip(mixed, fit_alq_levels_together(mixed, [3, 4])):
        np.testing.assert_array_equal(got, fit_alq_levels(d, 3 if isinstance(d, TruncatedNormal) else 4))


@pytest.mark.parametrize("name", SPARSE)
@pytest.mark.parametrize("bits", [2, 3, 4])
def test_alq_sparse_density_is_robust_and_monotone(name, bits):
    d = SPARSE[name]
    psis = []
    for sweeps in range(0, 9):
        levels = fit_alq_levels(d, bits, sweeps=sweeps)
        check_valid(levels, bits)
        psis.append(expected_variance(levels, d))
    assert all(b <= a for a, b in zip(psis, psis[1:])), psis
    assert psis[-1] <= expected_variance(nuqsgd_levels(bits), d)


def test_alq_level_stuck_in_an_empty_region():
    # A start with levels where there is no mass at all (the official closed form leaves the
    # interval here): the result stays valid and never gets worse than the start.
    d = SPARSE["two-very-narrow"]
    init = np.array([-1.0, -0.9, -0.8, -0.1, 0.0, 0.1, 0.2, 1.0])
    for sweeps in (1, 30):
        levels = fit_alq_levels(d, 3, sweeps=sweeps, init=init)
        check_valid(levels, 3)
        assert expected_variance(levels, d) <= expected_variance(init, d)


@pytest.mark.parametrize("name", ["mixture", "grid", "tn-0.02-shifted"])
def test_alq_is_deterministic(name):
    d = DISTS[name]
    a = fit_alq_levels(d, 3)
    b = fit_alq_levels(d, 3)
    assert a.tobytes() == b.tobytes()
    if name == "mixture":  # a fresh, equal object gives the same bits
        assert fit_alq_levels(_mixture(), 3).tobytes() == a.tobytes()


def test_alq_bad_arguments():
    d = DISTS["tn-0.01"]
    with pytest.raises(ValueError, match="bits"):
        fit_alq_levels(d, 1)
    with pytest.raises(ValueError, match="sweeps"):
        fit_alq_levels(d, 3, sweeps=-1)
    check_valid(fit_alq_levels(d, 3, sweeps=0), 3)


@pytest.mark.parametrize("name", list(DISTS) + ["two-narrow", "tn-1e-4"])
@pytest.mark.parametrize("bits", [2, 3, 4])
def test_amq_beats_nuqsgd(name, bits):
    d = {**DISTS, **SPARSE}[name]
    p = fit_amq_multiplier(d, bits)
    assert isinstance(p, float) and 0.0 < p < 1.0
    assert amq_objective(p, bits, d) <= expected_variance(nuqsgd_levels(bits), d)
    assert amq_objective(p, bits, d) == expected_variance(multiplier_levels(p, bits), d)


def test_amq_near_grid_optimum_and_uses_previous():
    d = DISTS["tn-0.02-shifted"]
    p = fit_amq_multiplier(d, 3)
    ps = np.linspace(0.01, 0.99, 981)
    best = min(amq_objective(x, 3, d) for x in ps)
    assert amq_objective(p, 3, d) <= best * 1.01
    q = fit_amq_multiplier(d, 3, starts=[0.9], steps=0, previous=p)
    assert q == p


def test_amq_is_deterministic_and_validates():
    d = DISTS["mixture"]
    assert fit_amq_multiplier(d, 3) == fit_amq_multiplier(d, 3)
    assert fit_amq_multiplier(d, 3, previous=0.3) == fit_amq_multiplier(d, 3, previous=0.3)
    with pytest.raises(ValueError, match="multiplier p"):
        fit_amq_multiplier(d, 3, starts=[0.0, 0.5])
    with pytest.raises(ValueError, match="multiplier p"):
        fit_amq_multiplier(d, 3, previous=1.5)
    with pytest.raises(ValueError, match="lr"):
        fit_amq_multiplier(d, 3, lr=0.0)


class _WrongPpf(TruncatedNormal):
    """A distribution whose quantile function is wrong: the safeguards must catch it."""

    def _ppf_raw(self, q):
        return np.full(np.shape(q), -1.0)


def test_alq_safeguard_rejects_bad_closed_form_candidates():
    d, good = _WrongPpf(0.0, 0.05), TruncatedNormal(0.0, 0.05)
    psis = [expected_variance(fit_alq_levels(d, 3, sweeps=k), good) for k in range(0, 6)]
    assert all(b <= a for a, b in zip(psis, psis[1:]))
    levels = fit_alq_levels(d, 3)
    check_valid(levels, 3)
    # The fallback (bounded minimization of the two-cell cost) still gets close to the optimum.
    assert expected_variance(levels, good) <= 1.05 * expected_variance(fit_alq_levels(good, 3), good)
