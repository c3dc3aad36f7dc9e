"""Levels for a code entropy (``code_entropy=``, with ``wire="entropy"``): entropy-constrained
scalar quantization of the fitted distribution, with unbiased stochastic rounding.

Once codes are entropy-coded, what a payload costs is the entropy of its codes, not ``bits``. So
for the ``L = 2**bits`` levels ``-1 = l_0 < ... < l_{L-1} = 1`` and the distribution ``F`` of the
normalized coordinates (the same statistics and agreement as ALQ's fit), this fits

    minimize  Psi(l)   subject to   H(p(l)) <= R,

``Psi`` the expected variance of unbiased rounding (:func:`~.objective.expected_variance`), ``p_k``
the probability of code ``k`` (the mass rounded to level ``k``: the hat function of ``l_k`` integrated
against ``F``), ``H`` its entropy in bits and ``R`` the target. The Lagrangian ``Psi + lam H`` is
minimized over the interior levels (BFGS, exact gradients from the partial moments, the levels
parameterized by the logits of their gaps so that they stay ordered) and ``lam`` is bisected until
``H`` is within 0.001 bits below ``R``; where ALQ's own levels (``lam = 0``) already meet the
target they are the answer.
Deterministic: ranks given the same statistics get the same levels (rounded to float32 as ALQ's).
docs/design/entropy_wire.md has the derivation.
"""

from __future__ import annotations

import numpy as np

from .distributions import Distribution

_LOG2E = 1.0 / np.log(2.0)
_P_FLOOR = 1e-300
#: The least gap between two levels: levels that merge would no longer be distinct in float32
#: (the entropy term rewards merging them: fewer effective levels).
MIN_GAP = 2.0**-16


def code_probabilities(levels: np.ndarray, dist: Distribution) -> np.ndarray:
    """``p_k``: the probability that unbiased rounding of ``r ~ dist`` gives code ``k``."""
    p, _ = _probabilities(np.asarray(levels, dtype=np.float64), dist._mpdf(np.asarray(levels, dtype=np.float64)))
    return p


def _probabilities(lv: np.ndarray, mom: np.ndarray):
    mass, first = np.diff(mom[0]), np.diff(mom[1])
    width = np.diff(lv)
    up = np.clip((first - lv[:-1] * mass) / width, 0.0, mass)  # the cell's mass rounded up
    p = np.zeros(lv.size)
    p[1:] += up
    p[:-1] += mass - up
    return p, (mass, first, width, up)


def code_entropy(levels: np.ndarray, dist: Distribution) -> float:
    """``H(p(levels))`` in bits per coordinate."""
    p = code_probabilities(levels, dist)
    p = p[p > 0]
    return float(-(p * np.log2(p)).sum())


def _objective(lv: np.ndarray, dist: Distribution, lam: float) -> tuple[float, np.ndarray, float]:
    """``Psi + lam H`` at ``lv``, its gradient in every level (ends included, ignored) and ``H``."""
    mom = dist._mpdf(lv)
    pdf = mom[3]
    p, (mass, first, width, up) = _probabilities(lv, mom)
    second = np.diff(mom[2])
    a, b = lv[:-1], lv[1:]
    psi = float(np.maximum(-a * b * mass + (a + b) * first - second, 0.0).sum())
    g_psi = np.zeros(lv.size)
    g_psi[1:] += first - a * mass  # d cell cost / d b
    g_psi[:-1] -= b * mass - first  # d cell cost / d a
    q = np.maximum(p, _P_FLOOR)
    h = float(-(p * np.log2(q)).sum())
    dh_dp = -(np.log2(q) + _LOG2E)
    down = mass - up
    # up(a, b) = (M1 - a M0) / (b - a): d up / d b = f(b) - up / w, d up / d a = -down / w
    d_up_db = pdf[1:] - up / width
    d_up_da = -down / width
    # mass = M0(b) - M0(a): d mass / d b = f(b), d mass / d a = -f(a); down = mass - up
    g_h = np.zeros(lv.size)
    g_h[1:] += dh_dp[1:] * d_up_db + dh_dp[:-1] * (pdf[1:] - d_up_db)
    g_h[:-1] += dh_dp[1:] * d_up_da + dh_dp[:-1] * (-pdf[:-1] - d_up_da)
    return psi + lam * h, g_psi + lam * g_h, h


def _spread(gaps: int) -> float:
    """What the gaps share beyond their ``MIN_GAP`` each."""
    return 2.0 - gaps * MIN_GAP


def _levels_of(z: np.ndarray) -> np.ndarray:
    g = np.exp(z - z.max())
    g /= g.sum()
    gaps = MIN_GAP + _spread(z.size) * g
    return np.concatenate([[-1.0], -1.0 + np.cumsum(gaps)[:-1], [1.0]])


def _logits_of(levels: np.ndarray) -> np.ndarray:
    gaps = np.diff(levels)
    return np.log(np.maximum((gaps - MIN_GAP) / _spread(gaps.size), 1e-12))


def _minimize(z0: np.ndarray, dist: Distribution, lam: float) -> np.ndarray:
    from scipy.optimize import minimize

    def fun(z):
        lv = _levels_of(z)
        value, grad_l, _ = _objective(lv, dist, lam)
        g = np.exp(z - z.max())
        g /= g.sum()
        # levels_k = -1 + sum_{j<k} (MIN_GAP + spread g_j): d J / d g_j = spread sum_{k>j} dJ/dl_k (interior k)
        d_gap = _spread(z.size) * np.cumsum(grad_l[1:-1][::-1])[::-1]
        d_gap = np.concatenate([d_gap, [0.0]])
        return value, g * (d_gap - float(g @ d_gap))

    res = minimize(fun, z0, jac=True, method="BFGS", options={"maxiter": 300, "gtol": 1e-11})
    return res.x


def fit_levels_for_entropy(
    dist: Distribution, bits: int, target: float, init: np.ndarray, iterations: int = 40
) -> np.ndarray:
    """The ``2**bits`` levels of least expected variance whose codes have entropy at most ``target``
    bits under ``dist``, started from ``init`` (ALQ's levels at this width: they are the answer
    when their entropy is within the target).

    Returns
    -------
    np.ndarray, shape (2**bits,), float64, from -1 to 1, strictly increasing.
    """
    init = np.asarray(init, dtype=np.float64)
    if init.size != 1 << bits:
        raise ValueError(f"init must have {1 << bits} levels, got {init.size}")
    if code_entropy(init, dist) <= target:
        return init
    z0 = _logits_of(init)
    lo, hi = 0.0, 1e-3
    z_hi = _minimize(z0, dist, hi)
    while _objective(_levels_of(z_hi), dist, hi)[2] > target and hi < 1e6:
        lo, hi = hi, hi * 4.0
        z_hi = _minimize(z_hi, dist, hi)
    best, h_best = z_hi, _objective(_levels_of(z_hi), dist, hi)[2]
    z = z_hi
    for _ in range(iterations):  # the entropy falls as lam grows: keep the feasible end
        if target - h_best <= 1e-3:
            break
        mid = 0.5 * (lo + hi)
        z = _minimize(z, dist, mid)
        h = _objective(_levels_of(z), dist, mid)[2]
        if h > target:
            lo = mid
        else:
            hi, best, h_best = mid, z, h
    return _levels_of(best)
