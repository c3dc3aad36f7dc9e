"""Levels for a code entropy (horovod_alq.core.rate_levels): exact gradients, the target met, less
variance than ALQ's levels at the same entropy, ALQ's levels where they already meet it, and the
setting's checks."""

import numpy as np
import pytest

from horovod_alq.core import Quantizer
from horovod_alq.core.objective import expected_variance
from horovod_alq.core.rate_levels import _objective, code_entropy, code_probabilities, fit_levels_for_entropy
from horovod_alq.core.statistics import distribution_from_statistics
from horovod_alq.settings import Settings, configure


@pytest.fixture(scope="module")
def fitted():
    """Heavy-tailed coordinates (Student t, 3 degrees of freedom), ALQ fitted at 3 and 4 bits."""
    x = np.random.default_rng(0).standard_t(3, 1 << 18).astype(np.float32)
    q3, q4 = Quantizer("alq", bits=3, bucket_size=4096), Quantizer("alq", bits=4, bucket_size=4096)
    stats = q3.statistics(x)
    q3.adapt(stats)
    q4.adapt(stats)
    return distribution_from_statistics("alq", stats), q3.levels, q4.levels


@pytest.mark.parametrize("lam", [0.0, 1e-3, 0.05])
def test_gradient_is_exact(fitted, lam):
    dist, _, lv = fitted
    lv = lv.copy()
    lv[1:-1] += 0.2 * np.diff(lv)[:-1] * np.random.default_rng(2).uniform(-1, 1, lv.size - 2)  # off ALQ's optimum
    _, grad, _ = _objective(lv, dist, lam)
    step = 1e-7
    for k in range(1, lv.size - 1):
        up, down = lv.copy(), lv.copy()
        up[k] += step
        down[k] -= step
        numeric = (_objective(up, dist, lam)[0] - _objective(down, dist, lam)[0]) / (2 * step)
        assert numeric == pytest.approx(grad[k], rel=1e-4, abs=1e-4 * np.abs(grad).max())


def test_probabilities_are_a_distribution(fitted):
    dist, _, lv = fitted
    p = code_probabilities(lv, dist)
    assert np.all(p >= 0) and p.sum() == pytest.approx(1.0, abs=1e-12)


def test_meets_the_target_with_less_variance_than_alq_at_the_same_entropy(fitted):
    dist, lv3, lv4 = fitted
    target = code_entropy(lv3, dist)  # what ALQ's 8 levels cost, entropy-coded
    levels = fit_levels_for_entropy(dist, 4, target, init=lv4)
    assert levels.size == 16 and levels[0] == -1 and levels[-1] == 1 and np.all(np.diff(levels) > 0)
    assert code_entropy(levels, dist) <= target + 1e-9
    assert code_entropy(levels, dist) >= target - 1e-3  # the constraint binds
    ratio = expected_variance(levels, dist) / expected_variance(lv3, dist)
    assert ratio < 0.75, ratio  # 16 levels fitted for the rate beat 8 fitted for the count


def test_alq_levels_when_they_meet_the_target(fitted):
    dist, _, lv4 = fitted
    np.testing.assert_array_equal(fit_levels_for_entropy(dist, 4, 4.0, init=lv4), lv4)


def test_quantizer_and_settings():
    s = Settings(bits=4, wire="entropy", code_entropy=2.5, bucket_size=512, seed=1)
    setup = configure(s)
    assert setup.quantizer.code_entropy == 2.5 and setup.second.code_entropy == 2.5
    x = np.random.default_rng(1).standard_t(3, 1 << 14)
    q = setup.quantizer
    q.adapt(q.statistics(x))
    dist = distribution_from_statistics("alq", q.statistics(x))
    assert code_entropy(q.levels, dist) <= 2.5 + 1e-3  # float32 rounding of the levels


@pytest.mark.parametrize(
    "keywords, match",
    [
        ({"bits": 4, "code_entropy": 2.5}, "needs wire='entropy'"),
        ({"bits": 4, "wire": "entropy", "code_entropy": 4.5}, "code_entropy must be a positive number of bits"),
        ({"bits": 4, "wire": "entropy", "code_entropy": 0.0}, "code_entropy must be a positive number of bits"),
        ({"bits": 4, "wire": "entropy", "code_entropy": "2"}, "code_entropy must be a positive number of bits"),
        ({"method": "amq", "bits": 4, "wire": "entropy", "code_entropy": 2.5}, "needs alq or alq-n"),
        ({"bits": "auto", "wire": "entropy", "code_entropy": 2.5}, "not bits='auto'"),
    ],
)
def test_bad_values_are_refused(keywords, match):
    with pytest.raises(ValueError, match=match):
        Settings(**keywords)


@pytest.mark.parametrize("norm", ["linf", "l2"])
@pytest.mark.parametrize("bits, target", [(3, 0.5), (4, 1.5), (4, 2.8), (5, 2.0)])
def test_low_targets_keep_the_levels_distinct(norm, bits, target):
    """A low target makes merging levels pay (fewer effective levels): the gaps keep MIN_GAP, so the
    levels stay strictly increasing in float32, from the Gaussian start and after a refit."""
    q = Quantizer("alq", bits=bits, bucket_size=8192, seed=1, code_entropy=target, norm=norm)
    assert np.all(np.diff(q.levels.astype(np.float32)) > 0)
    x = np.random.default_rng(3).standard_t(3, 1 << 15)
    q.adapt(q.statistics(x))
    assert np.all(np.diff(q.levels.astype(np.float32)) > 0)
