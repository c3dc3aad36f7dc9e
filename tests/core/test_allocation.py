"""Bits per tensor under a budget (horovod_alq.core.allocation): against brute force."""

import itertools

import numpy as np
import pytest

from horovod_alq.core.allocation import allocate_bits

WIDTHS = [2, 3, 4, 5]


def brute_force(errors, sizes, budget, widths):
    best = None
    for choice in itertools.product(range(len(widths)), repeat=len(sizes)):
        bits = np.array([widths[j] for j in choice])
        if (bits * sizes).sum() <= budget * sizes.sum() + 1e-9:
            e = errors[np.arange(len(sizes)), list(choice)].sum()
            best = e if best is None else min(best, e)
    return best


def quantization_like(rng, tensors):
    """Errors of the form s_t * 4^-w with noise (convex, decreasing), as stochastic rounding gives."""
    scale = rng.lognormal(0, 2, tensors)[:, None]
    w = np.array(WIDTHS)[None, :]
    return scale * 4.0**-w * rng.uniform(0.7, 1.3, (tensors, len(WIDTHS)))


@pytest.mark.parametrize("seed", range(40))
def test_the_optimum_within_budget(seed):
    rng = np.random.default_rng(seed)
    t = int(rng.integers(1, 6))
    errors = quantization_like(rng, t) if seed % 2 else rng.uniform(0, 1, (t, len(WIDTHS)))  # odd: any shape
    sizes = rng.integers(1, 50, t) if seed % 3 else 64 * rng.integers(1, 80, t)  # (large: exact in units of 64)
    budget = float(rng.uniform(2, 5))
    a = allocate_bits(errors, sizes, budget, WIDTHS)
    opt = brute_force(errors, sizes, budget, WIDTHS)
    assert a.mean_bits <= budget + 1e-12
    assert a.error == pytest.approx(errors[np.arange(t), [WIDTHS.index(b) for b in a.bits]].sum())
    assert a.gap == 0.0 and a.error == pytest.approx(opt, rel=1e-12, abs=1e-15), (a, opt)


def test_one_tensor_holding_most_coordinates_gets_its_bits():
    """The demo CNN's case, where the greedy on the hulls failed: at budget 3.0 the big tensor's step
    to 3 bits only fits if the small ones stay narrow; the optimum is uniform 3 bits."""
    widths = list(range(2, 9))
    sizes = np.array([51_200, 1_605_632 // 8, 12_800])  # conv2, fc1 (82% of the coordinates), fc2
    scale = np.array([1.0, 2.0, 1.0])[:, None]  # the small tensors gain more per coordinate-bit
    errors = scale * 4.0 ** -np.array(widths, dtype=float)[None, :]
    a = allocate_bits(errors, sizes, 3.0, widths)
    assert a.bits[1] >= 3 and a.mean_bits <= 3.0 + 1e-12
    assert a.error <= errors[:, 1].sum() + 1e-15  # no worse than uniform 3 bits
    from horovod_alq.core.allocation import _greedy

    greedy = _greedy(errors, sizes, 3.0, np.array(widths))
    assert greedy.bits[1] == 2 and greedy.error > 1.5 * a.error  # what the greedy alone did


def test_a_coarse_budget_grid_stays_within_budget_and_never_worse_than_the_greedy(monkeypatch):
    from horovod_alq.core import allocation

    rng = np.random.default_rng(7)
    errors, sizes = quantization_like(rng, 12), rng.integers(100, 10_000, 12)
    exact = allocate_bits(errors, sizes, 3.3, WIDTHS)
    monkeypatch.setattr(allocation, "CELL_LIMIT", 64)
    thinned = allocate_bits(errors, sizes, 3.3, WIDTHS)
    greedy = allocation._greedy(errors, sizes, 3.3, np.array(WIDTHS))
    assert thinned.mean_bits <= 3.3 + 1e-12 and thinned.error <= greedy.error
    assert exact.error - 1e-12 <= thinned.error <= exact.error + thinned.gap + 1e-12


def test_equal_sizes_convex_errors_are_exact_and_favour_large_norms():
    # two tensors of one size, one with 100x the error scale: extra bits go to it first
    errors = np.array([[1.0, 0.25, 0.0625, 0.015625], [100.0, 25.0, 6.25, 1.5625]])
    a = allocate_bits(errors, [10, 10], 3.5, WIDTHS)
    assert a.bits.tolist() == [2, 5]
    assert a.error == pytest.approx(1.0 + 1.5625) == brute_force(errors, np.array([10, 10]), 3.5, WIDTHS)
    assert a.gap == 0.0
    assert allocate_bits(errors, [10, 10], 5, WIDTHS).bits.tolist() == [5, 5]
    assert allocate_bits(errors, [10, 10], 2, WIDTHS).bits.tolist() == [2, 2]


def test_a_wider_width_that_is_no_better_is_never_taken():
    errors = np.array([[1.0, 1.0, 0.5, 0.5]])
    assert allocate_bits(errors, [4], 5, WIDTHS).bits.tolist() == [4]


def test_ties_break_by_tensor_index_identically():
    errors = np.tile([[1.0, 0.25, 0.0625, 0.015625]], (4, 1))
    first = allocate_bits(errors, [8] * 4, 2.5, WIDTHS)
    assert first.bits.tolist() == [3, 3, 2, 2]  # a second bit on tensor 0 gains less than a first on 1
    assert allocate_bits(errors.copy(), [8] * 4, 2.5, WIDTHS).bits.tolist() == first.bits.tolist()


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(budget=1.5), "below the narrowest"),
        (dict(widths=[3, 2, 4, 5]), "strictly increasing"),
        (dict(sizes=[0, 1]), "positive"),
        (dict(errors=np.full((2, 4), np.nan)), "finite"),
        (dict(errors=np.ones((3, 4))), "shape"),
    ],
)
def test_bad_input_is_refused(bad, match):
    kw = dict(errors=np.ones((2, 4)), sizes=[1, 1], budget=3.0, widths=WIDTHS)
    with pytest.raises(ValueError, match=match):
        allocate_bits(**{**kw, **bad})


# ------------------------------------------------------------------ bits="auto" (AutoBits)
from helpers import quantization_errors  # noqa: E402

from horovod_alq.core import Quantizer  # noqa: E402
from horovod_alq.core.auto_bits import AUTO_WIDTHS, AutoBits, check_budget  # noqa: E402


@pytest.mark.parametrize("method,norm", [("alq", "linf"), ("amq", "l2"), ("alq-n", "linf")])
def test_quantization_errors_are_the_expected_error_of_the_codec(method, norm):
    """E||Q(x)-x||^2 per width against 400 encode/decode draws: within 5 standard errors plus the
    3% that counting the coordinates on the statistics grid may move it."""
    rng = np.random.default_rng(3)
    x = (rng.standard_t(3, 700) * 0.01).astype(np.float32)
    qs = [Quantizer(method, bits=w, bucket_size=128, norm=norm, seed=w) for w in (2, 3, 5)]
    exact = quantization_errors(x, qs)
    assert np.all(np.diff(exact) < 0)  # more bits, less error
    for q, e in zip(qs, exact):
        draws = np.array([((q.decode(q.encode(x)) - x.astype(np.float64)) ** 2).sum() for _ in range(400)])
        assert abs(draws.mean() - e) < 5 * draws.std(ddof=1) / np.sqrt(len(draws)) + 0.03 * e, (q, draws.mean(), e)


def _rows(auto, tensors):
    return np.stack([auto.row(x) for x in tensors])


def test_auto_allocation_is_optimal_within_budget_and_refits_each_width_from_its_tensors():
    rng = np.random.default_rng(0)
    sizes = [256, 512, 128, 384]
    tensors = [(s * rng.standard_normal(n)).astype(np.float32) for s, n in zip((30.0, 1.0, 0.1, 3.0), sizes)]
    auto = AutoBits("alq", 3.0, 128)
    before = {w: q.levels for w, q in auto.quantizers.items()}
    rows = _rows(auto, tensors) + _rows(auto, [t[::-1].copy() for t in tensors])  # two "ranks"
    errors = rows[:, : len(AUTO_WIDTHS)]
    alloc = auto.refit(rows, sizes, [(n, k) for k, n in enumerate(sizes)])
    assert np.dot(sizes, alloc.bits) <= 3.0 * sum(sizes)
    best = brute_force(errors, np.array(sizes), 3.0, list(AUTO_WIDTHS))
    assert best - 1e-12 <= alloc.error <= best + alloc.gap + 1e-12
    assert auto.bits == tuple(alloc.bits.tolist()) and auto.widths_for(auto.keys) == auto.bits
    for w in AUTO_WIDTHS:  # the widths in use refit from exactly their tensors' statistics
        used = [k for k, b in enumerate(auto.bits) if b == w]
        if not used:
            assert np.array_equal(auto.quantizers[w].levels, before[w])
            continue
        ref = Quantizer("alq", bits=w, bucket_size=128)
        ref.adapt(rows[used, len(AUTO_WIDTHS) :].sum(axis=0))
        np.testing.assert_array_equal(auto.quantizers[w].levels, ref.levels)


def test_auto_default_and_other_rounds():
    auto = AutoBits("amq", 2.5, 64)
    assert auto.default == 2 and auto.widths_for([(10, 1), (20, 2)]) == (2, 2)
    auto.keys, auto.bits = ((10, 1), (20, 2)), (4, 2)
    assert auto.widths_for([(10, 1), (20, 2)]) == (4, 2)
    assert auto.widths_for([(20, 2), (10, 1)]) == (2, 2)  # another round: the default width
    assert auto.widths_so_far([(10, 1)], 0) == (4,) and auto.widths_so_far([(10, 1), (20, 2)], 1) == (2,)
    assert auto.widths_so_far([(20, 2)], 0) == (2,)  # not the allocated round's beginning
    assert auto.widths_so_far([(10, 1), (20, 2), (5, 3)], 1) == (2, 2)  # longer than the allocated round
    assert auto.mean_bits() == pytest.approx((40 + 40) / 30)
    other = AutoBits("amq", 2.5, 64)
    assert other.fingerprint() != auto.fingerprint()
    other.load_state_dict(auto.state_dict())
    assert other.fingerprint() == auto.fingerprint()


def test_bits_max_caps_the_allocation_and_the_level_sets():
    """bits_max=4: three level sets, an allocation within 2 to 4 bits that is optimal among them
    (a tensor that gets 8 bits uncapped gets 4), and checkpoints of another cap refused."""
    rng = np.random.default_rng(1)
    sizes = [256, 512, 128, 384]
    tensors = [(s * rng.standard_normal(n)).astype(np.float32) for s, n in zip((300.0, 1.0, 0.01, 3.0), sizes)]
    keys = [(n, k) for k, n in enumerate(sizes)]
    full, capped = AutoBits("alq", 3.5, 128), AutoBits("alq", 3.5, 128, bits_max=4)
    assert capped.widths == (2, 3, 4) and sorted(capped.quantizers) == [2, 3, 4]
    uncapped = full.refit(_rows(full, tensors), sizes, keys)
    rows = _rows(capped, tensors)
    assert rows.shape[1] == _rows(full, tensors).shape[1] - 4  # errors at 3 widths, then the statistics
    alloc = capped.refit(rows, sizes, keys)
    assert max(uncapped.bits) > 4 and set(alloc.bits.tolist()) <= {2, 3, 4}
    best = brute_force(rows[:, :3], np.array(sizes), 3.5, [2, 3, 4])
    assert best - 1e-12 <= alloc.error <= best + alloc.gap + 1e-12
    assert capped.fingerprint() != AutoBits("alq", 3.5, 128).fingerprint()
    with pytest.raises(ValueError, match="widths 2 to 8, this compressor 2 to 4"):
        AutoBits("alq", 3.5, 128, bits_max=4).load_state_dict(full.state_dict())
    with pytest.raises(ValueError, match="bit_budget must be a number from 2 to 4"):
        AutoBits("alq", 4.5, 128, bits_max=4)


@pytest.mark.parametrize("bad", [1.99, 8.5, float("inf"), "3", True, None])
def test_bad_budgets_are_refused(bad):
    with pytest.raises(ValueError, match="bit_budget"):
        check_budget(bad)
