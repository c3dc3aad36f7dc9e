"""The quantization objective Psi and the AMQ objective with its exact derivative.

Psi(l) = sum_j integral_{l_j}^{l_{j+1}} (l_{j+1} - r)(r - l_j) dF(r) is the expected variance of
unbiased stochastic rounding of one normalized coordinate r ~ F to the levels l (Faghri et al.,
NeurIPS 2020, sec. 3). Each cell is computed exactly from partial moments M_k(x) = int r^k dF:
cost(l, u) = -u l dM0 + (u + l) dM1 - dM2.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike

from .distributions import Distribution
from .methods import MAX_BITS, MIN_BITS

__all__ = ["check_levels", "expected_variance", "amq_objective", "amq_derivative"]


def check_levels(levels: ArrayLike, size: int | None = None) -> np.ndarray:
    """Validate a level set and return it as a float64 1-D array.

    Parameters
    ----------
    levels : array_like, shape (L,)
        Finite, strictly increasing, ``levels[0] == -1`` and ``levels[-1] == 1``, L >= 2.
    size : int, optional
        Required length L.
    """
    lv = np.array(levels, dtype=np.float64)
    if lv.ndim != 1 or lv.size < 2:
        raise ValueError(f"levels must be a 1-D array of at least 2 values, got shape {lv.shape}")
    if size is not None and lv.size != size:
        raise ValueError(f"expected {size} levels, got {lv.size}")
    if not np.all(np.isfinite(lv)):
        raise ValueError("levels must be finite")
    if lv[0] != -1.0 or lv[-1] != 1.0:
        raise ValueError(f"levels must start at -1 and end at 1, got {lv[0]!r} and {lv[-1]!r}")
    if not np.all(np.diff(lv) > 0):
        raise ValueError("levels must be strictly increasing")
    return lv


def check_width(bits: int) -> int:
    """``bits`` as an int from MIN_BITS to MAX_BITS, or ValueError naming it."""
    if isinstance(bits, bool) or not isinstance(bits, (int, np.integer)):
        raise ValueError(f"bits must be an integer from {MIN_BITS} to {MAX_BITS}, got {bits!r}")
    if not MIN_BITS <= int(bits) <= MAX_BITS:
        raise ValueError(f"bits must be from {MIN_BITS} to {MAX_BITS}, got {bits}")
    return int(bits)


def check_multiplier(p: float) -> float:
    """The AMQ multiplier ``p`` as a float in (0, 1), or ValueError naming it."""
    p = float(p)
    if not 0.0 < p < 1.0:
        raise ValueError(f"multiplier p must lie in (0, 1), got {p!r}")
    return p


def cell_costs(levels: np.ndarray, mom: np.ndarray) -> np.ndarray:
    """Cost of each cell [l_j, l_{j+1}] from moments at the levels.

    levels: (..., L); mom: (>=3, ..., L) partial moments at the levels. Returns (..., L-1), >= 0.
    """
    lo, hi = levels[..., :-1], levels[..., 1:]
    d = np.diff(mom[:3], axis=-1)
    return np.maximum(-hi * lo * d[0] + (hi + lo) * d[1] - d[2], 0.0)


def two_cell_cost(a, x, b, ma, mx, mb) -> np.ndarray:
    """Cost of the cells [a, x] and [x, b] (same arithmetic as :func:`cell_costs`)."""
    c1 = np.maximum(-x * a * (mx[0] - ma[0]) + (x + a) * (mx[1] - ma[1]) - (mx[2] - ma[2]), 0.0)
    c2 = np.maximum(-b * x * (mb[0] - mx[0]) + (b + x) * (mb[1] - mx[1]) - (mb[2] - mx[2]), 0.0)
    return c1 + c2


def _psi_from_moments(levels: np.ndarray, mom: np.ndarray) -> np.ndarray:
    return np.sum(cell_costs(levels, mom), axis=-1)


def psi_batch(levels: np.ndarray, dist: Distribution) -> np.ndarray:
    """Psi of each row of ``levels`` (shape (n, L)), unvalidated; shape (n,)."""
    levels = np.ascontiguousarray(levels, dtype=np.float64)
    return _psi_from_moments(levels, dist._mpdf(levels))


def expected_variance(levels: ArrayLike, dist: Distribution) -> float:
    """Psi: expected variance of unbiased stochastic rounding of r ~ ``dist`` to ``levels``.

    Parameters
    ----------
    levels : array_like, shape (L,)
        Strictly increasing, from -1 to 1 (see :func:`check_levels`).
    dist : distribution on [-1, 1] (``distributions.py``)

    Returns
    -------
    float
        ``sum_j integral_{l_j}^{l_{j+1}} (l_{j+1} - r)(r - l_j) dF(r)``, exact for the
        distribution (up to rounding).
    """
    lv = check_levels(levels)
    return float(psi_batch(lv[None, :], dist)[0])


def _amq_levels(p: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """Levels ``+-{p^s, ..., p, 1}`` for each p (shape (P,)) and their derivatives in p; (P, L)."""
    s = 2 ** (bits - 1) - 1
    e = np.concatenate([np.arange(0, s + 1), np.arange(s, -1, -1)]).astype(np.float64)
    sign = np.concatenate([-np.ones(s + 1), np.ones(s + 1)])
    p = np.asarray(p, dtype=np.float64)[:, None]
    levels = sign * p**e
    dlevels = sign * e * p ** np.maximum(e - 1.0, 0.0)
    return levels, dlevels


def amq_psi_grad(p: np.ndarray, bits: int, dist: Distribution) -> tuple[np.ndarray, np.ndarray]:
    """Psi and dPsi/dp of the multiplier levels for each p; shapes (P,), (P,)."""
    levels, dlevels = _amq_levels(p, bits)
    mom = dist._mpdf(levels)
    psi = _psi_from_moments(levels, mom)
    d0 = np.diff(mom[0], axis=-1)
    d1 = np.diff(mom[1], axis=-1)
    left = d1 - levels[:, :-1] * d0  # int_cell (r - l_j) dF: d cost / d (right end)
    right = levels[:, 1:] * d0 - d1  # int_cell (l_{j+1} - r) dF: -d cost / d (left end)
    grad_levels = left[:, :-1] - right[:, 1:]  # d Psi / d l_j, interior levels
    return psi, np.sum(grad_levels * dlevels[:, 1:-1], axis=-1)


def amq_objective(p: float, bits: int, dist: Distribution) -> float:
    """Psi of the AMQ levels ``+-{p^s, ..., p, 1}`` (s = 2^(bits-1) - 1) over the whole support.

    Parameters
    ----------
    p : float in (0, 1)
    bits : int, 2..8
    dist : distribution on [-1, 1]; need not be symmetric.

    Returns
    -------
    float
        For a symmetric distribution this is twice the paper's positive-half V(p).
    """
    psi, _ = amq_psi_grad(np.array([check_multiplier(p)]), check_width(bits), dist)
    return float(psi[0])


def amq_derivative(p: float, bits: int, dist: Distribution) -> float:
    """Exact ``d amq_objective / d p``.

    Uses d Psi / d l_j = int_{l_{j-1}}^{l_j} (r - l_{j-1}) dF - int_{l_j}^{l_{j+1}} (l_{j+1} - r) dF
    (from F and the first partial moment) and d(+-p^k)/dp = +-k p^(k-1); the innermost cell is
    [-p^s, p^s]. For a symmetric truncated normal it equals 2 dV/dp of the paper.
    """
    _, grad = amq_psi_grad(np.array([check_multiplier(p)]), check_width(bits), dist)
    return float(grad[0])
