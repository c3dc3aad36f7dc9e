"""Adaptive level schemes: ALQ (levels by coordinate descent) and AMQ (multiplier by GD).

Faghri et al., "Adaptive Gradient Quantization for Data-Parallel SGD", NeurIPS 2020, sec. 4-5.
Both minimize Psi (``objective.py``) for a distribution of normalized coordinates
(``distributions.py``). Both are deterministic: the same input gives bit-identical output.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike

from .distributions import Distribution
from .grid import GridDistribution, GridStack
from .methods import nuqsgd_levels, uniform_levels
from .objective import (
    amq_psi_grad,
    check_levels,
    check_multiplier,
    check_width,
    psi_batch,
    two_cell_cost,
)

__all__ = ["fit_alq_levels", "fit_alq_levels_together", "fit_amq_multiplier"]

#: A level is optimal for its two cells when |F(l_j) - q_j| is below this (F units).
_FTOL = 1e-13
#: Newton iterations stop when the bracket is this narrow (relative).
_XTOL = 2e-16
_NEWTON_MAXITER = 100
#: Within a sweep, F(l_j) = q is solved to this fraction of the starting residual (later
#: sweeps refine it; the fixed point is the same).
_NEWTON_RTOL = 0.1
#: New levels stay this fraction of the interval away from the neighbours (a candidate that is
#: not strictly inside after rounding is rejected).
_MARGIN = 1e-9
#: Grid size of the fallback 1-D minimization of the two-cell cost.
_FALLBACK_POINTS = 33
#: Fallback only when the closed-form candidate failed and the level is clearly not optimal.
_FALLBACK_FTOL = 1e-7


def _quantile_levels(dist: Distribution, n: int) -> np.ndarray:
    """Levels at the quantiles j / (n - 1) of ``dist``, made strictly increasing if needed."""
    inner = np.asarray(dist.ppf(np.arange(1, n - 1) / (n - 1)), dtype=np.float64)
    levels = np.concatenate([[-1.0], inner, [1.0]])
    if not (np.all(np.isfinite(levels)) and np.all(np.diff(levels) > 0)):
        levels = np.nan_to_num(levels, nan=0.0)
        levels = 0.999 * np.maximum.accumulate(levels) + 0.001 * np.linspace(-1.0, 1.0, n)
        levels[0], levels[-1] = -1.0, 1.0
    return levels


#: Points of the density's grid for the companding start (distributions not on a grid of their own).
_COMPANDING_POINTS = 2049


def _companding_levels(dist: Distribution, n: int) -> np.ndarray | None:
    """Levels at the quantiles j / (n - 1) of the density proportional to ``pdf**(1/3)``: the level
    density that minimizes the variance of stochastic rounding as the levels get many (cells of
    width w hold variance ~ pdf w^2 / 6 per unit, under a fixed count of cells: w ~ pdf^(-1/3), as
    in Panter and Dite's companding). The sweeps converge slowly from the other starts at 5 to 8
    bits (at 8 bits, 30 sweeps from them leave Psi several times its minimum); from this one they
    need few. None if it does not give a valid level set."""
    if isinstance(dist, GridDistribution):
        x = dist.grid
        weight = np.cbrt(np.maximum(dist._dens, 0.0)) * dist._h  # exact per cell: constant density
    else:
        x = np.linspace(-1.0, 1.0, _COMPANDING_POINTS)
        root = np.cbrt(np.maximum(np.nan_to_num(np.asarray(dist._mpdf(x), dtype=np.float64)[3]), 0.0))
        weight = (root[1:] + root[:-1]) / 2.0 * np.diff(x)
    total = weight.sum()
    if not (np.isfinite(total) and total > 0):
        return None
    weight = weight + 1e-9 * total / weight.size  # strictly increasing, also across zero density
    cumulative = np.concatenate([[0.0], np.cumsum(weight)])
    levels = np.interp(np.linspace(0.0, cumulative[-1], n), cumulative, x)
    levels[0], levels[-1] = -1.0, 1.0
    return levels if np.all(np.isfinite(levels)) and np.all(np.diff(levels) > 0) else None


def _newton(
    dist: Distribution,
    q: np.ndarray,
    a: np.ndarray,
    b: np.ndarray,
    x: np.ndarray,
    m: np.ndarray,
    active: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """Solve ``F(x) = q`` in ``(a, b)`` by safeguarded Newton steps from ``x`` (rows ``active``).

    ``F(a) <= q <= F(b)``; ``m = dist._mpdf(x)``, shape (4, I). Stops at a residual below
    ``_NEWTON_RTOL`` times the starting one (or ``_FTOL``). Returns the new ``x`` and
    ``dist._mpdf(x)``; rows not ``active`` are meaningless (the caller masks them).
    """
    r = m[0] - q
    tol = np.maximum(_NEWTON_RTOL * np.abs(r), _FTOL)
    lo = np.where(r < 0, x, a)
    hi = np.where(r > 0, x, b)
    for it in range(_NEWTON_MAXITER):
        with np.errstate(all="ignore"):
            xn = x - r / m[3]
        inside = (xn > lo) & (xn < hi)
        if not inside.all():
            xn = np.where(inside, xn, 0.5 * (lo + hi))
        if it == 0:  # rows inactive from the start are masked by the caller
            x, m = xn, dist._mpdf(xn)
        else:  # rows that have converged stay where they are
            x, m = np.where(active, xn, x), np.where(active, dist._mpdf(xn), m)
        r = m[0] - q
        active = active & (np.abs(r) > tol)
        if not active.any():
            break
        lo = np.where(r < 0, x, lo)
        hi = np.where(r > 0, x, hi)
        active &= hi - lo > _XTOL * (np.abs(lo) + np.abs(hi))
        if not active.any():
            break
    return x, m


def _coordinate_descent(levels: np.ndarray, dist: Distribution, sweeps: int) -> np.ndarray:
    """ALQ sweeps on several level sets of one length at once (shape (I, L)): :func:`_descend`."""
    lev = np.array(levels, dtype=np.float64)
    return _descend(lev.ravel(), [lev.shape[1]] * lev.shape[0], dist, sweeps).reshape(lev.shape)


def _descend(levels: np.ndarray, lengths, dist, sweeps: int) -> np.ndarray:
    """ALQ sweeps on several level sets at once.

    A sweep updates the odd interior levels, then the even ones (red-black order). The two-cell
    costs of levels of one parity share no cell, and each depends only on the neighbours (the other
    parity), so a half-sweep is an exact block minimization done in one vectorized step: the
    Gauss-Seidel sweep of the paper in another order, with the same fixed points, at a cost that no
    longer grows with the number of levels in Python steps.

    Parameters
    ----------
    levels : ndarray, shape (N,)
        Valid level sets (strictly increasing, endpoints -1 and 1) back to back.
    lengths : ints summing to N
        The levels of each set (each row).
    dist : distribution, or a pair (:class:`GridStack`, ``which``): row ``i`` follows the
        stack's distribution ``which[i]``
    sweeps : int

    Returns
    -------
    ndarray, shape (N,)
        Psi of each row is nonincreasing over sweeps (checked after every sweep; a sweep that
        increased Psi by rounding is undone and that row stops). A row stops early at a fixed
        point (a sweep that changes nothing), which gives the same result as more sweeps.
    """
    lev = np.array(levels, dtype=np.float64)
    lengths = np.asarray(lengths, dtype=np.intp)
    n_rows = lengths.size
    row_of = np.repeat(np.arange(n_rows), lengths)
    pos = np.arange(lev.size) - np.repeat(np.cumsum(lengths) - lengths, lengths)  # index within the row
    last = lengths[row_of] - 1
    halves = [
        j
        for j in (
            np.flatnonzero((pos > 0) & (pos < last) & (pos % 2 == 1)),
            np.flatnonzero((pos > 0) & (pos < last) & (pos % 2 == 0)),
        )
        if j.size
    ]
    cells = np.flatnonzero(pos < last)  # the left end of every cell
    mom = _at(dist, row_of)._mpdf(lev)  # (4, N): M0, M1, M2, pdf at every level
    psi = _row_psi(lev, mom, cells, row_of[cells], n_rows)
    live = np.ones(n_rows, dtype=bool)
    for _ in range(sweeps):
        prev_lev, prev_mom = lev.copy(), mom.copy()
        changed = np.zeros(n_rows, dtype=bool)
        for j in halves:
            moved = _half_sweep(lev, mom, j, live[row_of[j]], _at(dist, row_of[j]))
            changed[row_of[j[moved]]] = True
        new_psi = _row_psi(lev, mom, cells, row_of[cells], n_rows)
        worse = ~(new_psi <= psi)
        if worse.any():
            back = worse[row_of]
            lev[back], mom[:, back] = prev_lev[back], prev_mom[:, back]
        psi = np.where(worse, psi, new_psi)
        live &= ~worse & changed
        if not live.any():
            break
    return lev


def _row_psi(lev, mom, cells, rows, n_rows) -> np.ndarray:
    """Psi of every row: the sum of its cells' costs (``cells``: left ends, ``rows``: their rows)."""
    lo, hi = lev[cells], lev[cells + 1]
    d = mom[:3, cells + 1] - mom[:3, cells]
    cost = np.maximum(-hi * lo * d[0] + (hi + lo) * d[1] - d[2], 0.0)
    return np.bincount(rows, weights=cost, minlength=n_rows)


def _half_sweep(lev: np.ndarray, mom: np.ndarray, j: np.ndarray, live: np.ndarray, dist) -> np.ndarray:
    """Move the levels ``j`` (no two adjacent, none an endpoint; ``live``: may move, ``dist``: the
    distribution of each), in place, to the minimizer of their two-cell cost; returns which moved."""
    a, x0, b = lev[j - 1], lev[j], lev[j + 1]
    ma, m0, mb = mom[:, j - 1], mom[:, j], mom[:, j + 1]
    w = b - a
    # The two-cell cost is convex in l_j with derivative w * (F(l_j) - q): its minimizers solve
    # F(l_j) = q (the paper's closed form).
    q = mb[0] - ((mb[1] - ma[1]) - a * (mb[0] - ma[0])) / w
    resid = np.abs(m0[0] - q)
    act = live & (resid > _FTOL)
    if not act.any():
        return act
    if dist._exact_ppf:
        x, mx = dist._ppf_raw(np.minimum(np.maximum(q, ma[0]), mb[0])), None
    else:
        x, mx = _newton(dist, q, a, b, x0, m0, act)
    lo, hi = a + _MARGIN * w, b - _MARGIN * w
    xc = np.minimum(np.maximum(x, lo), hi)
    if mx is None or (xc != x).any():
        mx = dist._mpdf(xc)
    # cost(x) - cost(x0) = w * (I(x) - I(x0) - q (x - x0)), I(x) = x F(x) - M1(x).
    gain = (x0 * m0[0] - m0[1]) - (xc * mx[0] - mx[1]) + q * (xc - x0)
    acc = act & (gain > 0) & (xc > a) & (xc < b)
    fail = act & ~acc
    if fail.any():
        retry = fail & (resid > _FALLBACK_FTOL) & (lo < hi)
        if retry.any():
            xc, mx, acc = _fallback(dist, retry, a, x0, b, ma, m0, mb, lo, hi, xc, mx, acc)
    lev[j] = np.where(acc, xc, x0)
    mom[:, j] = np.where(acc, mx, m0)
    return acc


def _fallback(dist, rows, a, x0, b, ma, m0, mb, lo, hi, x, mx, acc):
    """Bounded 1-D minimization of the convex two-cell cost on a grid (rows ``rows``), at once."""
    r = np.flatnonzero(rows)
    t = np.linspace(0.0, 1.0, _FALLBACK_POINTS)
    xs = lo[r, None] + (hi[r] - lo[r])[:, None] * t
    ms = (dist.take(r) if isinstance(dist, _Bound) else dist)._mpdf(xs)
    cost = two_cell_cost(a[r, None], xs, b[r, None], ma[:, r, None], ms, mb[:, r, None])
    cost = np.where(np.isfinite(cost), cost, np.inf)
    k = np.argmin(cost, axis=1)
    i = np.arange(r.size)
    old = two_cell_cost(a[r], x0[r], b[r], ma[:, r], m0[:, r], mb[:, r])
    better = (cost[i, k] < old) & (xs[i, k] > a[r]) & (xs[i, k] < b[r])
    x, mx, acc = x.copy(), mx.copy(), acc.copy()
    x[r] = np.where(better, xs[i, k], x[r])
    mx[:, r] = np.where(better, ms[:, i, k], mx[:, r])
    acc[r] = better
    return x, mx, acc


def _check_sweeps(sweeps) -> None:
    if isinstance(sweeps, bool) or not isinstance(sweeps, (int, np.integer)) or sweeps < 0:
        raise ValueError(f"sweeps must be a nonnegative integer, got {sweeps!r}")


def _starts(dist, bits: int, init) -> np.ndarray:
    """ALQ's starting level sets: the quantiles of F, uniform levels, NUQSGD's levels, the
    companding levels (:func:`_companding_levels`, where valid) and ``init``."""
    n = 2**bits
    starts = [_quantile_levels(dist, n), uniform_levels(bits), nuqsgd_levels(bits)]
    companding = _companding_levels(dist, n)
    if companding is not None:
        starts.append(companding)
    if init is not None:
        starts.append(check_levels(init, size=n))
    return np.stack(starts)


def fit_alq_levels(dist: Distribution, bits: int, sweeps: int = 30, init: ArrayLike | None = None) -> np.ndarray:
    """ALQ: levels minimizing Psi by coordinate descent over the interior levels.

    Each sweep moves every interior level l_j (the odd ones, then the even ones: one vectorized
    step each, see :func:`_descend`) to the minimizer of the cost of its two cells,
    ``l_j* = F^-1(F(l_{j+1}) - int_{l_{j-1}}^{l_{j+1}} (r - l_{j-1}) dF / (l_{j+1} - l_{j-1}))``
    (the two-cell cost is convex in l_j with derivative proportional to F(l_j) - that level).
    F^-1 is exact for :class:`TruncatedNormal` and :class:`GridDistribution`; for the mixture it
    is a safeguarded Newton solve warm-started at the current level, to a tenth of the starting
    residual per visit (later sweeps refine it). The new level is kept strictly inside
    (l_{j-1}, l_{j+1}) and accepted only if it lowers the two-cell cost (else a bounded grid
    minimization of that cost is tried), so Psi never increases, also where the density is
    (nearly) zero; all starts are swept at once. Starts: the quantiles of F, uniform levels,
    NUQSGD's levels, the companding levels (quantiles of ``pdf**(1/3)``, near the optimum when
    the levels are many, where the sweeps converge slowly) and ``init``; the result is the level
    set of lowest Psi among the results and the starts.

    Parameters
    ----------
    dist : distribution on [-1, 1] (``distributions.py``)
    bits : int, 2..8
        ``2**bits`` levels.
    sweeps : int, default 30
        Maximum number of sweeps (the paper's runs use 30); stops early at a fixed point.
    init : array_like, shape (2**bits,), optional
        An additional starting level set, e.g. the current levels.

    Returns
    -------
    ndarray, shape (2**bits,), float64
        Strictly increasing, ``levels[0] == -1``, ``levels[-1] == 1``.
    """
    bits = check_width(bits)
    _check_sweeps(sweeps)
    start = _starts(dist, bits, init)
    final = _coordinate_descent(start, dist, int(sweeps))
    candidates = np.concatenate([final, start])
    psi = psi_batch(candidates, dist)
    psi = np.where(np.isfinite(psi), psi, np.inf)
    return candidates[int(np.argmin(psi))].copy()


class _Bound:
    """A :class:`GridStack` seen as one distribution per element of the arrays it is given."""

    _exact_ppf = True

    def __init__(self, stack: GridStack, which: np.ndarray) -> None:
        self.stack, self.which = stack, which

    def _mpdf(self, x):
        return self.stack._mpdf(x, self.which)

    def _ppf_raw(self, q):
        return self.stack._ppf_raw(q, self.which)

    def take(self, r: np.ndarray) -> "_Bound":
        """The distributions of flat positions ``r``, for arrays of shape (len(r), P)."""
        return _Bound(self.stack, self.which[r][:, None])


def _at(dist, rows: np.ndarray):
    """``dist`` for an array of levels of rows ``rows``: for a pair (stack, which), a level of
    row i follows distribution ``which[i]``; any other distribution is itself."""
    if not isinstance(dist, tuple):
        return dist
    stack, which = dist
    return _Bound(stack, which[rows])


def fit_alq_levels_together(
    dists: list, bits: list[int], sweeps: int = 30, inits: list | None = None
) -> list[np.ndarray]:
    """:func:`fit_alq_levels` of several (distribution, bits, init) at once: the same results (each
    level set is swept exactly as alone), at about the cost of the widest fit when every
    distribution is a :class:`GridDistribution` on one grid (the fits of ``bits="auto"``); else
    one after another."""
    inits = [None] * len(dists) if inits is None else list(inits)
    same_grid = all(
        isinstance(d, GridDistribution)
        and d.grid.shape == dists[0].grid.shape
        and np.array_equal(d.grid, dists[0].grid)
        for d in dists
    )
    if len(dists) < 2 or not same_grid:
        return [fit_alq_levels(d, b, sweeps, init) for d, b, init in zip(dists, bits, inits)]
    _check_sweeps(sweeps)
    starts = [_starts(d, check_width(b), init) for d, b, init in zip(dists, bits, inits)]
    which = np.concatenate([np.full(len(st), t) for t, st in enumerate(starts)])
    lengths = np.concatenate([np.full(len(st), st.shape[1]) for st in starts])
    flat = np.concatenate([st.ravel() for st in starts])
    stack = (GridStack(dists), which)
    final = _descend(flat, lengths, stack, int(sweeps))
    out, at = [], 0
    for d, st in zip(dists, starts):  # as fit_alq_levels: the best of its results and starts
        size = st.size
        candidates = np.concatenate([final[at : at + size], flat[at : at + size]]).reshape(-1, st.shape[1])
        psi = psi_batch(candidates, d)
        out.append(candidates[int(np.argmin(np.where(np.isfinite(psi), psi, np.inf)))].copy())
        at += size
    return out


def fit_amq_multiplier(
    dist: Distribution,
    bits: int,
    steps: int = 50,
    lr: float = 0.7,
    starts: ArrayLike = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9),
    previous: float | None = None,
) -> float:
    """AMQ: the multiplier p of the levels ``+-{p^s, ..., p, 1}`` minimizing Psi.

    Projected gradient descent with the exact derivative (``objective.amq_derivative``) from
    every start (and ``previous``) at once; p is kept in ``[p_min, 1 - 1e-6]`` with
    ``p_min = max(1e-6, 1e-300**(1/s))`` (so ``p**s`` does not underflow). The result is the
    iterate of lowest Psi over all starts and steps (ties: the earliest).

    Parameters
    ----------
    dist : distribution on [-1, 1]
    bits : int, 2..8
    steps : int, default 50
    lr : float, default 0.7
        Step size on ``dPsi/dp / 2``: for a symmetric distribution that is the paper's
        positive-half objective V(p), whose official step is 0.7.
    starts : sequence of float in (0, 1), default 0.1, ..., 0.9
    previous : float in (0, 1), optional
        The previous best p, tried as one more start.

    Returns
    -------
    float
        p in (0, 1).
    """
    bits = check_width(bits)
    if isinstance(steps, bool) or not isinstance(steps, (int, np.integer)) or steps < 0:
        raise ValueError(f"steps must be a nonnegative integer, got {steps!r}")
    lr = float(lr)
    if not (np.isfinite(lr) and lr > 0):
        raise ValueError(f"lr must be positive, got {lr!r}")
    p0 = [check_multiplier(v) for v in np.ravel(np.asarray(starts, dtype=np.float64))]
    if previous is not None:
        p0.append(check_multiplier(previous))
    if not p0:
        raise ValueError("starts is empty and previous is None")
    s = 2 ** (bits - 1) - 1
    p_min, p_max = max(1e-6, 1e-300 ** (1.0 / s)), 1.0 - 1e-6
    p = np.clip(np.array(p0), p_min, p_max)
    best_p, best_psi = float(p[0]), np.inf
    for step in range(int(steps) + 1):
        psi, grad = amq_psi_grad(p, bits, dist)
        psi = np.where(np.isfinite(psi), psi, np.inf)
        i = int(np.argmin(psi))
        if psi[i] < best_psi:
            best_p, best_psi = float(p[i]), float(psi[i])
        if step == steps:
            break
        grad = np.where(np.isfinite(grad), grad, 0.0)
        p = np.clip(p - lr * 0.5 * grad, p_min, p_max)
    return best_p
