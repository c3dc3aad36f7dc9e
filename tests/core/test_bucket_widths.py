"""Widths per bucket (``bits_per="bucket"``): the allocation against brute force and within the
budget, the mixed payload's format and size, its checks, unbiasedness (NumPy codec)."""

import itertools

import numpy as np
import pytest
from helpers import assert_zero_mean

from horovod_alq.core.auto_bits import AutoBits
from horovod_alq.core.bucket_widths import (
    BUCKET_WIDTHS,
    allocate_buckets,
    budget_units,
    code_bits,
    mixed_payload_size,
    widths_crc,
)
from horovod_alq.core.protocol import ProtocolError
from horovod_alq.core.wire import Header, bucket_lengths, pack_header, parse_header
from horovod_alq.exchange.mixed import MixedOps
from horovod_alq.exchange.numpy_ops import NumpyOps
from horovod_alq.exchange.payloads import check_host_segments

C = 4.0 ** -np.arange(7) * (1 + 0.1 * np.arange(7))  # strictly convex, decreasing: every width on the hull


def _brute(squared, lengths, c, cap):
    best = np.inf
    for combo in itertools.product(range(7), repeat=len(squared)):
        k = np.array(combo)
        if (lengths * (k + 2)).sum() <= cap:
            best = min(best, float((squared * c[k]).sum()))
    return best


@pytest.mark.parametrize("seed", range(6))
def test_allocation_is_optimal_on_equal_buckets_and_caps_on_whole_steps(seed):
    rng = np.random.default_rng(seed)
    squared = rng.exponential(1.0, 4) ** 3
    lengths = np.full(4, 8)
    for extra in (0, 1, 3, 7, 12, 24):  # spare bits in whole steps of one bucket
        cap = 2 * 32 + 8 * extra
        w = allocate_buckets(squared, lengths, C, cap)
        assert (lengths * w).sum() <= cap
        got = float((squared * C[w.astype(int) - 2]).sum())
        assert got == pytest.approx(_brute(squared, lengths, C, cap), rel=1e-12)


@pytest.mark.parametrize("seed", range(6))
def test_allocation_stays_within_any_budget_and_near_the_optimum(seed):
    """Unequal lengths and caps anywhere: within the cap, and at most one segment's gain (the
    largest a single bucket could still take) above the brute-force optimum."""
    rng = np.random.default_rng(10 + seed)
    squared = rng.exponential(1.0, 4) ** 2
    lengths = rng.integers(1, 9, 4)
    cap = int(lengths.sum() * rng.uniform(2, 8))
    w = allocate_buckets(squared, lengths, C, cap).astype(int)
    assert (lengths * w).sum() <= cap and w.min() >= 2 and w.max() <= 8
    got = float((squared * C[w - 2]).sum())
    assert got <= _brute(squared, lengths, C, cap) + float(squared.max() * (C[0] - C[1])) + 1e-12


def test_allocation_gives_large_buckets_more_bits_and_zero_or_nan_buckets_the_narrowest():
    squared = np.array([1e6, 1.0, 0.0, np.nan, 1e-6, np.inf])
    w = allocate_buckets(squared, np.full(6, 16), C, 16 * 6 * 3)
    assert w[0] == w.max() > w[1] and w[2] == w[3] == w[5] == 2
    with pytest.raises(ValueError, match="below 2 bits"):
        allocate_buckets(squared, np.full(6, 16), C, 16 * 6 * 2 - 1)


def _mixed(budget=2.5, d=64, seed=0):
    rng = np.random.default_rng(seed)
    auto = AutoBits("alq", budget, d, bits_per="bucket")
    x = _heavy(rng, 40 * d + 17, d)
    auto.refit(auto.row(x)[None], [x.size], [(x.size, 0)])
    return auto.mixed, x


def _heavy(rng, n, d):
    """A gradient whose bucket scales differ by orders of magnitude."""
    scales = np.repeat(np.exp(rng.normal(0, 2, -(-n // d))), d)[:n]
    return (rng.standard_normal(n) * scales).astype(np.float32)


@pytest.mark.parametrize("budget", [2.0, 2.5, 3.0, 5.75, 8.0])
def test_mixed_payload_size_depends_on_size_and_budget_only_and_widths_fill_the_budget(budget):
    mixed, x = _mixed(budget)
    ops = MixedOps(NumpyOps())
    for n in (0, 1, 64, 65, 2577):
        payload = ops.encode(x[:n], mixed, seed=n)
        assert payload.size == mixed.payload_bytes(n) == mixed_payload_size(n, 64, budget_units(budget))
        header = parse_header(payload)
        assert header.bits == 0 and header.numel == n and header.payload_size == payload.size
        widths, runs = mixed.layout(payload, 0, n)
        lengths = bucket_lengths(n, 64)
        assert (lengths * widths).sum() <= code_bits(n, budget_units(budget))
        if n >= 2577 and 2 < budget < 8:  # the budget is spent to within one bucket's step
            assert (lengths * widths).sum() > code_bits(n, budget_units(budget)) - 64 * 6
            assert len(set(widths.tolist())) > 1


def test_mixed_payload_round_trip_unbiased_per_bucket():
    """200 encodes of one gradient: per bucket, a t test of the decoded sum's mean against the
    true sum at 1e-6 (Bonferroni over the buckets); and the error is far below uniform 3 bits'."""
    mixed, x = _mixed(3.0)
    ops, plain = MixedOps(NumpyOps()), NumpyOps()
    q3 = mixed.quantizers[3]
    k, d = 200, 64
    sums, err_mixed, err_3 = [], 0.0, 0.0
    out = np.empty(x.size, dtype=np.float32)
    for s in range(k):
        ops.decode_sum(out, ops.encode(x, mixed, s), [0], mixed)
        sums.append(np.add.reduceat(out.astype(np.float64) - x, np.arange(0, x.size, d)))
        err_mixed += float(((out - x.astype(np.float64)) ** 2).sum())
        plain.decode_sum(out, plain.encode(x, q3, s), [0], q3)
        err_3 += float(((out - x.astype(np.float64)) ** 2).sum())
    dev = np.array(sums)
    assert_zero_mean(dev[:, dev.std(0) > 0])
    assert err_mixed < 0.5 * err_3  # same mean bits, widths where the norm is


def test_decoding_a_window_equals_the_slice_of_the_whole():
    mixed, x = _mixed(2.5)
    ops = MixedOps(NumpyOps())
    payload = np.concatenate([ops.encode(x, mixed, 1), ops.encode(x[::-1].copy(), mixed, 2)])
    offsets = [0, mixed.payload_bytes(x.size)]
    whole = np.empty(x.size, dtype=np.float32)
    ops.decode_sum(whole, payload, offsets, mixed, scale=0.5)
    for lo, hi in ((0, 64), (128, 1000), (64 * 39, x.size), (640, 641)):
        part = np.empty(hi - lo, dtype=np.float32)
        ops.decode_sum(part, payload, offsets, mixed, start=lo, numel=x.size, scale=0.5)
        np.testing.assert_array_equal(part, whole[lo:hi])


def test_corrupted_or_foreign_mixed_payloads_are_refused_naming_the_problem():
    mixed, x = _mixed(2.5)
    ops = MixedOps(NumpyOps())
    good = ops.encode(x, mixed, 0)
    check_host_segments(good, [[(x.size, mixed)]], "t")
    b = 41

    def rewritten(widths):  # other widths with a valid checksum
        bad = good.copy()
        bad[32 : 32 + b] = widths
        bad[32 + b : 36 + b] = np.frombuffer(widths_crc(bad[32 : 32 + b]), dtype=np.uint8)
        return bad

    w = good[32 : 32 + b].copy()
    i, j = np.flatnonzero(w == w.min())[0], np.flatnonzero(w == w.max())[0]
    swapped = w.copy()
    swapped[i], swapped[j] = w[j], w[i]  # the same bits on other buckets
    bad = good.copy()
    bad[32 : 32 + b] = swapped
    with pytest.raises(ProtocolError, match="checksum mismatch"):
        check_host_segments(bad, [[(x.size, mixed)]], "t")
    with pytest.raises(ProtocolError, match="out of 2..8"):
        check_host_segments(rewritten(np.where(np.arange(b) == 0, 9, w)), [[(x.size, mixed)]], "t")
    with pytest.raises(ProtocolError, match="exceed the budget"):
        check_host_segments(rewritten(np.full(b, 8)), [[(x.size, mixed)]], "t")
    more = w.copy()
    more[np.flatnonzero(w > 2)[0]] -= 1  # fewer bits in total: the parts no longer match
    with pytest.raises(ProtocolError, match="its widths say"):
        check_host_segments(rewritten(more), [[(x.size, mixed)]], "t")
    other, _ = _mixed(3.0)
    with pytest.raises(ProtocolError, match="bit_budget=2.5"):
        check_host_segments(good, [[(x.size, other)]], "t")
    refit, _ = _mixed(2.5, seed=1)  # the same budget, another error model and levels
    with pytest.raises(ProtocolError, match="levels differ"):
        check_host_segments(good, [[(x.size, refit)]], "t")


def test_mixed_headers_carry_the_budget_and_reject_one_out_of_range():
    h = Header(1, 0, 64, 100, 7, budget256=640)
    assert parse_header(pack_header(h)).budget256 == 640
    with pytest.raises(ValueError, match="budget 100/256"):
        parse_header(pack_header(Header(1, 0, 64, 100, 7, budget256=100)))


def test_bits_per_bucket_needs_buckets_in_whole_bytes_and_a_known_unit():
    with pytest.raises(ValueError, match="multiple of 8"):
        AutoBits("alq", 3.0, 100, bits_per="bucket")
    with pytest.raises(ValueError, match="bits_per must be one of"):
        AutoBits("alq", 3.0, 64, bits_per="layer")


def test_before_the_first_refit_every_bucket_takes_the_default_width():
    auto = AutoBits("amq", 2.5, 64, bits_per="bucket")
    x = _heavy(np.random.default_rng(3), 640, 64)
    payload = MixedOps(NumpyOps()).encode(x, auto.mixed, 0)
    widths, _ = auto.mixed.layout(payload, 0, x.size)
    assert set(widths.tolist()) == {2} and BUCKET_WIDTHS[0] == 2
