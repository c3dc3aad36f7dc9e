"""Helpers shared by the tests and the worker scripts (tests/ is on the path of both: setup.cfg's
``pythonpath`` for pytest, tests/workers/_boot.py for the ranks). NumPy only at import: the ranks
import this module too.

Statistics: :func:`t_stat`, :func:`t_bound`, :func:`assert_zero_mean` (samples in hand) and
:func:`assert_t_unbiased`, :func:`assert_bernstein_unbiased` (t statistics and Bernstein ratios that
a worker reported). The tolerances follow from the sample size: two-sided Student t tests at total
failure probability :data:`ALPHA` for an unbiased codec, Bonferroni over the statistics tested.

Data: :func:`rank_data` (a rank's input), :func:`digest` (to compare arrays across ranks),
:func:`same` (every rank reported the same).
"""

from __future__ import annotations

import hashlib
from typing import Any, Callable, Iterable

import numpy as np

#: Total failure probability of one unbiasedness check if the codec is unbiased.
ALPHA = 1e-6


# ------------------------------------------------------------------------------------ statistics
def t_stat(samples: np.ndarray) -> np.ndarray:
    """t-statistics of the column means of ``samples`` (reps, k): mean / (std / sqrt(reps))."""
    samples = np.asarray(samples, dtype=np.float64)
    return samples.mean(0) / (samples.std(0, ddof=1) / np.sqrt(samples.shape[0]))


def t_bound(reps: int, count: int = 1, alpha: float = ALPHA) -> float:
    """The bound on the largest of ``count`` |t| statistics of ``reps`` samples each that an
    unbiased estimate exceeds with probability at most ``alpha`` (two-sided, Bonferroni)."""
    from scipy.stats import t

    return float(t.isf(alpha / (2 * count), reps - 1))


def assert_zero_mean(samples: np.ndarray, alpha: float = ALPHA) -> None:
    """Every column of ``samples`` (reps, k: e.g. the deviations of k bucket sums in each of reps
    rounds) has mean zero: max |t| below :func:`t_bound` over the k columns."""
    samples = np.asarray(samples, dtype=np.float64)
    stats = np.abs(t_stat(samples))
    bound = t_bound(samples.shape[0], samples.shape[1], alpha)
    assert stats.max() < bound, (float(stats.max()), bound, samples.shape)


def assert_t_unbiased(
    res: dict, keys: Iterable[str] = ("t_plain", "t_signed", "t_buckets_max"), *, alpha: float = ALPHA, what: Any = None
) -> None:
    """A worker's report ``res`` of t statistics over ``res["reps"]`` rounds says unbiased: each of
    ``keys`` (required) within :func:`t_bound` at ``alpha``; a key ending in ``_max`` is the largest
    |t| over ``res["buckets"]`` statistics (Bonferroni over them), any other key one statistic."""
    for key in keys:
        count = res["buckets"] if key.endswith("_max") else 1
        assert abs(res[key]) < t_bound(res["reps"], count, alpha), (what, key, res)


def assert_bernstein_unbiased(res: dict) -> None:
    """A worker's report from the exact variance of every round says unbiased: per coordinate,
    Bernstein's bound at 1e-10 (``worst_ratio`` < 1); overall, the sum of all deviations over its
    exact standard deviation, |z| < 5."""
    assert res["worst_ratio"] < 1.0, res["worst_ratio"]
    assert abs(res["aggregate_z"]) < 5.0, res["aggregate_z"]


# ------------------------------------------------------------------------------------------ data
def rank_data(rank: int, n: int, *, seed: int = 1000, tail: float | None = None) -> np.ndarray:
    """Rank ``rank``'s float32 input of ``n`` elements: standard normal times ``1 + rank`` plus
    ``0.1 * rank`` (its own scale and offset); with ``tail``, the first quarter Student t(3) times
    ``tail`` instead (heavy-tailed buckets). Drawn from ``default_rng([seed, rank])``."""
    rng = np.random.default_rng([seed, rank])
    x = rng.standard_normal(n) * (1 + rank) + 0.1 * rank
    if tail is not None:
        x[: n // 4] = rng.standard_t(3, n // 4) * tail
    return x.astype(np.float32)


def _array(a: Any) -> np.ndarray:
    if hasattr(a, "detach"):  # torch tensor
        a = a.detach().contiguous().cpu().numpy()
    return np.ascontiguousarray(np.asarray(a))  # NumPy, TF eager tensors, lists


def digest(*arrays: Any) -> str:
    """SHA-1 of the bytes of ``arrays`` (NumPy arrays, torch or TF tensors) in order: equal on two
    ranks iff they hold the same values with the same dtypes."""
    h = hashlib.sha1()
    for a in arrays:
        h.update(_array(a).tobytes())
    return h.hexdigest()


def same(results: list, key: Callable[[Any], Any]) -> bool:
    """Whether ``key`` of every rank's result is the same (compared by ``repr``)."""
    return len({repr(key(r)) for r in results}) == 1


#: The modules that test the research scripts (scripts/study, scripts/bench): ``make test-studies``
#: runs them, ``make test`` leaves them out (conftest.py marks them ``studies``).
STUDY_MODULES = ("test_scripts.py", "test_time_to_accuracy.py", "test_precondition_scripts.py")


# ------------------------------------------------------------------------------ exact references
def quantization_errors(x: np.ndarray, quantizers) -> np.ndarray:
    """``E||Q(x) - x||^2`` of the array ``x`` under each quantizer (same norm and bucket size, their
    own levels), shape (len(quantizers),), from the grid histograms of ``bits="auto"``."""
    from horovod_alq.core.auto_bits import errors_from_histograms
    from horovod_alq.core.statistics import grid_histograms, normalize

    nz = normalize(x, quantizers[0].bucket_size, quantizers[0].norm)
    return errors_from_histograms(grid_histograms(nz)[1:], [q.levels for q in quantizers])[0]


def scenario(runs: list, name: str) -> list:
    """Scenario ``name``'s result on every rank, from a launch whose ranks report a dict per scenario."""
    return [r[name] for r in runs]


def count_fused_encodes() -> list:
    """Counts the codec encodes that formed ``x * w`` themselves (``TorchOps.encode_parts`` called
    with ``scales``): patches TorchOps for this process and returns the one-element counter."""
    from horovod_alq.torch.ops import TorchOps

    counter, original = [0], TorchOps.encode_parts

    def counted(self, *args, scales=None, **kwargs):
        out = original(self, *args, scales=scales, **kwargs)
        counter[0] += scales is not None and out is not None
        return out

    TorchOps.encode_parts = counted
    return counter


def assert_refits_after_preconditioning_begins(ranks: list, key: str = "refit", delay: int = 0) -> None:
    """Every rank's ``key`` record (tests/workers' precondition scenarios): round 0 refit from the
    bare gradients, round ``1 + delay`` (``Form(refit=delay)`` rounds after the first preconditioned
    one) refit again from the scaled statistics summed over the ranks (levels equal to the fit on
    them, unlike the fit on the bare ones), the same levels on every rank, no other refit; where the
    record has a ``replay`` (the rounds from 2 on again, after loading the state saved after round
    1), the same refits and levels in it."""
    assert same(ranks, lambda r: r[key]["levels"])
    at = 1 + delay
    for r in ranks:
        m = r[key]
        assert m["w_active"], m
        assert m["updates"] == [1] * at + [2] * (len(m["updates"]) - at), m["updates"]
        levels = np.array(m["levels"])
        assert (levels[:at] == levels[0]).all() and np.abs(levels[at] - levels[0]).max() > 1e-3, levels
        assert np.allclose(levels[at], m["scaled"], rtol=0, atol=1e-6), (levels[at], m["scaled"])
        assert np.abs(levels[at] - np.array(m["unscaled"])).max() > 1e-3, (levels[at], m["unscaled"])
        assert (levels[at:] == levels[at]).all()
        if "replay" in m:
            assert m["replay"]["updates"] == m["updates"][2:], (m["replay"]["updates"], m["updates"])
            assert m["replay"]["levels"] == m["levels"][2:]


def assert_sixteen_bit_refit_fits_the_scaled_statistics(ranks: list, at: int) -> None:
    """Every rank's ``refit16`` record: ``compress="when-faster"`` quantized rounds 0-1, then sent 16
    bits; the scheduled refit at round ``at`` (a 16-bit one) fit the levels to the statistics of
    g * w summed over the ranks (as a quantized round would quantize), not of the bare gradients,
    the same on every rank."""
    assert same(ranks, lambda r: r["refit16"]["levels"])
    for r in ranks:
        m = r["refit16"]
        assert m["paths"][:2] == [True, True] and m["paths"][at] is False, m["paths"]
        assert m["updates"][at] == m["updates"][at - 1] + 1, m["updates"]
        assert m["w_active"], m
        level = np.array(m["levels"][at])
        assert np.allclose(level, m["scaled"], rtol=0, atol=1e-6), (level, m["scaled"])
        assert np.abs(level - np.array(m["unscaled"])).max() > 1e-3, (level, m["unscaled"])
