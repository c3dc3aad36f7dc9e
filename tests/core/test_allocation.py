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
    return scale * 4.0 ** -w * rng.uniform(0.7, 1.3, (tensors, len(WIDTHS)))


@pytest.mark.parametrize("seed", range(40))
def test_within_its_gap_of_the_optimum_and_within_budget(seed):
    rng = np.random.default_rng(seed)
    t = int(rng.integers(1, 6))
    errors = quantization_like(rng, t) if seed % 2 else rng.uniform(0, 1, (t, len(WIDTHS)))  # odd: any shape
    sizes = rng.integers(1, 50, t)
    budget = float(rng.uniform(2, 5))
    a = allocate_bits(errors, sizes, budget, WIDTHS)
    opt = brute_force(errors, sizes, budget, WIDTHS)
    assert a.mean_bits <= budget + 1e-12
    assert a.error == pytest.approx(errors[np.arange(t), [WIDTHS.index(b) for b in a.bits]].sum())
    assert opt - 1e-12 <= a.error <= opt + a.gap + 1e-12, (a, opt)


def test_equal_sizes_convex_errors_are_exact_and_favour_large_norms():
    # two tensors of one size, one with 100x the error scale: extra bits go to it first
    errors = np.array([[1.0, 0.25, 0.0625, 0.015625], [100.0, 25.0, 6.25, 1.5625]])
    a = allocate_bits(errors, [10, 10], 3.5, WIDTHS)
    assert a.bits.tolist() == [2, 5]
    assert a.error == pytest.approx(1.0 + 1.5625) == brute_force(errors, np.array([10, 10]), 3.5, WIDTHS)
    assert a.gap == pytest.approx(0.75)  # the bound: tensor 0's 2 -> 3 bits, which did not fit
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


@pytest.mark.parametrize("bad, match", [
    (dict(budget=1.5), "below the narrowest"),
    (dict(widths=[3, 2, 4, 5]), "strictly increasing"),
    (dict(sizes=[0, 1]), "positive"),
    (dict(errors=np.full((2, 4), np.nan)), "finite"),
    (dict(errors=np.ones((3, 4))), "shape"),
])
def test_bad_input_is_refused(bad, match):
    kw = dict(errors=np.ones((2, 4)), sizes=[1, 1], budget=3.0, widths=WIDTHS)
    with pytest.raises(ValueError, match=match):
        allocate_bits(**{**kw, **bad})
