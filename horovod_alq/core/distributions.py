"""Distributions of normalized gradient coordinates on [-1, 1], in the style of ``scipy.stats``.

Every object has the same protocol, vectorized over NumPy arrays (``x`` and ``q`` of any shape):

- ``pdf(x)``, ``cdf(x)``, ``ppf(q)`` (``ppf(q) = inf {x : F(x) >= q}``; NaN for ``q`` outside [0, 1]);
- ``partial_moment(x, order)`` = integral_{a}^{x} r**order dF(r) for ``order`` 0 (the CDF), 1 or 2;
- ``partial_moments(x)``: the three orders at once, shape ``(3, *x.shape)``;
- ``mean()``, ``var()``.

The partial moments are what the quantization objective (``objective.py``) is built from: the
expected variance of a cell [l, u] is ``-u*l*dM0 + (u + l)*dM1 - dM2``.

Classes: :class:`TruncatedNormal` (the model of one bucket, Faghri et al., NeurIPS 2020, sec. 2),
:class:`NormWeightedMixture` (ALQ / AMQ: buckets weighted by their norms); the grid form of the
additive statistics is in :mod:`.grid`.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike
from scipy import special

__all__ = ["SIGMA_MIN", "Distribution", "TruncatedNormal", "NormWeightedMixture"]

#: Standard deviations below this (including 0) are raised to it: a near point mass.
SIGMA_MIN = 1e-12

_ISQRT2 = float(np.sqrt(0.5))
_INV_SQRT2PI = float(1.0 / np.sqrt(2.0 * np.pi))
_SQRT_HALF_PI = float(np.sqrt(0.5 * np.pi))


def as_float64(x: ArrayLike) -> np.ndarray:
    return np.asarray(x, dtype=np.float64)


def as_result(y: np.ndarray) -> np.ndarray | float:
    """0-d results as Python floats, like scipy's frozen distributions."""
    return float(y) if np.ndim(y) == 0 else y


class Distribution:
    """The base of the distributions on [-1, 1] (shared protocol). Subclasses implement ``_mpdf``
    (and may override the rest)."""

    a: float = -1.0
    b: float = 1.0
    #: ``ppf`` is exact and cheap (closed form / interpolation); otherwise it is iterative.
    _exact_ppf: bool = True

    def _mpdf(self, x: np.ndarray) -> np.ndarray:
        """Partial moments of orders 0, 1, 2 and the density at ``x`` clipped to the support.

        Shape ``(4, *shape)``. The internal workhorse: elementwise, so a value does not depend
        on the shape of the array it is computed in.
        """
        raise NotImplementedError

    def _ppf_raw(self, q: np.ndarray) -> np.ndarray:
        """Quantiles for ``q`` in [0, 1] without checks (exact-ppf distributions)."""
        raise NotImplementedError

    @property
    def support(self) -> tuple[float, float]:
        return (self.a, self.b)

    def partial_moments(self, x: ArrayLike) -> np.ndarray:
        """``integral_a^x r**k dF(r)`` for k = 0, 1, 2.

        Parameters
        ----------
        x : array_like, any shape
            Clipped to the support.

        Returns
        -------
        ndarray, shape ``(3, *shape)``
            Rows: CDF, first and second partial moment.
        """
        return self._mpdf(as_float64(x))[:3]

    def partial_moment(self, x: ArrayLike, order: int) -> np.ndarray | float:
        """``integral_a^x r**order dF(r)`` for ``order`` in {0, 1, 2} (0 gives the CDF)."""
        if isinstance(order, bool) or order not in (0, 1, 2):
            raise ValueError(f"order must be 0, 1 or 2, got {order!r}")
        return as_result(self._mpdf(as_float64(x))[order])

    def pdf(self, x: ArrayLike) -> np.ndarray | float:
        """Density at ``x`` (0 outside the support)."""
        x = as_float64(x)
        return as_result(np.where((x >= self.a) & (x <= self.b), self._mpdf(x)[3], 0.0))

    def cdf(self, x: ArrayLike) -> np.ndarray | float:
        """Cumulative distribution function at ``x``."""
        return as_result(np.clip(self._mpdf(as_float64(x))[0], 0.0, 1.0))

    def mean(self) -> np.ndarray | float:
        raise NotImplementedError

    def var(self) -> np.ndarray | float:
        raise NotImplementedError


class TruncatedNormal(Distribution):
    """Normal ``N(mu, sigma**2)`` truncated to ``[a, b]``, with broadcastable parameters.

    ``mu`` and ``sigma`` broadcast like the parameters of a frozen ``scipy.stats.truncnorm``
    (but ``a`` and ``b`` here are bounds in data units, not standardized); evaluating at ``x``
    broadcasts ``x`` against them, e.g. ``mu`` of shape ``(B, 1)`` and ``x`` of shape ``(G,)``
    give ``(B, G)``.

    Parameters
    ----------
    mu : array_like
        Location of the untruncated normal; any finite value (it may lie far outside [a, b]).
    sigma : array_like
        Scale, finite and >= 0; values below :data:`SIGMA_MIN` (including 0) are raised to it.
    a, b : float
        Finite bounds with ``a < b``; default [-1, 1].

    Notes
    -----
    Robust for tiny ``sigma`` and for ``mu`` many ``sigma`` outside the support: a support
    entirely in a tail of the normal is mirrored into the lower tail if needed and handled
    relative to its bound nearer to ``mu`` (d = t - hi, exact there),
    ``Phi(t) / Phi(hi) = exp(d (2c - d) / 2) erfcx((c - d) / sqrt2) / erfcx(c / sqrt2)``, c = -hi.
    Partial moments use ``int_a^x (r - mu) dF = -sigma**2 (f(x) - f(a))`` and
    ``int_a^x (r - mu)**2 dF = sigma**2 F(x) - sigma**2 ((x - mu) f(x) - (a - mu) f(a))``;
    their absolute error is a few ulps of ``max(1, mu**2)``. ``var()`` has absolute error of
    order ``eps * (mu - nearest bound)**2``.
    """

    def __init__(self, mu: ArrayLike, sigma: ArrayLike, a: float = -1.0, b: float = 1.0) -> None:
        mu = as_float64(mu)
        sigma = as_float64(sigma)
        a, b = float(a), float(b)
        if not (np.isfinite(a) and np.isfinite(b) and a < b):
            raise ValueError(f"bounds must be finite with a < b, got a={a!r}, b={b!r}")
        if not np.all(np.isfinite(mu)):
            raise ValueError("mu must be finite")
        if not np.all(np.isfinite(sigma)) or np.any(sigma < 0):
            raise ValueError("sigma must be finite and >= 0 (values below SIGMA_MIN are floored)")
        mu, sigma = np.broadcast_arrays(mu, np.maximum(sigma, SIGMA_MIN))
        self.mu = np.array(mu)
        self.sigma = np.array(sigma)
        self.a, self.b = a, b
        with np.errstate(all="ignore"):
            self._setup()

    @property
    def shape(self) -> tuple[int, ...]:
        """Shape of the parameters."""
        return self.mu.shape

    def _setup(self) -> None:
        mu, sigma, a, b = self.mu, self.sigma, self.a, self.b
        alpha = (a - mu) / sigma
        beta = (b - mu) / sigma
        flip = alpha > 0  # support entirely above mu (upper tail): mirror it
        self._flip = flip
        self._any_flip = bool(flip.any())
        self._sgn = np.where(flip, -1.0, 1.0)
        hi = np.where(flip, -alpha, beta)  # oriented standardized upper bound
        tail = hi <= 0  # support entirely below the mode: work relative to the bound
        self._tail = tail
        self._any_tail = bool(tail.any())
        # Coordinate d: t = (x - mu) / sigma (oriented) in the central case, t - hi in the tail
        # case (exact near the bound even when mu is far away).
        self._ref = np.where(tail, np.where(flip, a, b), mu)
        self._dlo = np.where(tail, (a - b) / sigma, alpha)
        self._dhi = np.where(tail, 0.0, beta)
        self._c = np.where(tail, -hi, 0.0)
        e_hi = special.erfcx(np.maximum(-hi, 0.0) * _ISQRT2)
        self._kd = np.where(tail, e_hi, 2.0)
        w_lo, _ = self._w(self._dlo)
        w_hi, _ = self._w(self._dhi)
        z = w_hi - w_lo  # central: Phi(hi) - Phi(lo); tail: 1 - Phi(lo) / Phi(hi)
        self._z = z
        self._w_lo = w_lo
        self._q_hi = 0.5 * special.erfc(beta * _ISQRT2)  # 1 - Phi(hi), central case
        self._log_phi_hi = np.log(0.5 * e_hi) - 0.5 * hi * hi  # log Phi(hi), tail case
        self._aref = np.where(flip, w_hi, w_lo)
        self._zs = self._sgn * z
        self._kappa = 2.0 * _INV_SQRT2PI / (self._kd * z)  # phi(t) / Z_true = X(d) * kappa
        self._phiz_a = self._w(np.where(flip, self._dhi, self._dlo))[1] * self._kappa
        self._phiz_b = self._w(np.where(flip, self._dlo, self._dhi))[1] * self._kappa
        self._s2 = mu * mu + sigma * sigma
        self._amu_phiz_a = (a + mu) * self._phiz_a

    def _w(self, d: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Oriented ``W`` and ``X`` at coordinate ``d``, with ``phi(t) / Z_true = X * kappa``.

        Central case (a < mu < b), d = t: ``W = Phi(t)``, ``X = exp(-t**2 / 2)``.
        Tail case, d = t - hi <= 0, c = -hi: ``W = Phi(t) / Phi(hi)``,
        ``X = exp(d (2c - d) / 2) = phi(t) / phi(hi)``.
        """
        if not self._any_tail:
            return special.ndtr(d), np.exp(d * d * -0.5)
        c = self._c
        x = np.exp(d * (2.0 * c - d) * 0.5)
        w_tail = x * special.erfcx(np.abs(c - d) * _ISQRT2) / self._kd
        return np.where(self._tail, w_tail, special.ndtr(d)), x

    def _eval(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """CDF and ``phi(t) / Z`` (= sigma * pdf) at ``x`` clipped to the support."""
        with np.errstate(all="ignore"):
            d = (x - self._ref) / self.sigma
            if self._any_flip:
                d = d * self._sgn
            d = np.minimum(np.maximum(d, self._dlo), self._dhi)
            w, xx = self._w(d)
            return (w - self._aref) / self._zs, xx * self._kappa

    def _mpdf(self, x: np.ndarray) -> np.ndarray:
        f, phiz = self._eval(x)
        xc = np.minimum(np.maximum(x, self.a), self.b)
        out = np.empty((4,) + f.shape)
        out[0] = f
        out[1] = self.mu * f - self.sigma * (phiz - self._phiz_a)
        out[2] = self._s2 * f - self.sigma * ((xc + self.mu) * phiz - self._amu_phiz_a)
        out[3] = phiz / self.sigma
        return out

    def pdf(self, x: ArrayLike) -> np.ndarray | float:
        """Density at ``x`` (0 outside the support)."""
        x = as_float64(x)
        phiz = self._eval(x)[1]
        return as_result(np.where((x >= self.a) & (x <= self.b), phiz / self.sigma, 0.0))

    def cdf(self, x: ArrayLike) -> np.ndarray | float:
        """Cumulative distribution function at ``x``."""
        return as_result(np.clip(self._eval(as_float64(x))[0], 0.0, 1.0))

    def _ppf_raw(self, q: np.ndarray) -> np.ndarray:
        """Quantiles for ``q`` in [0, 1] (no checks)."""
        with np.errstate(all="ignore"):
            if self._any_flip:
                qq = np.where(self._flip, 1.0 - q, q)  # oriented CDF level
                qc = np.where(self._flip, q, 1.0 - q)
            else:
                qq, qc = q, 1.0 - q
            p_lo = self._w_lo + qq * self._z  # central: Phi(t); tail: Phi(t) / Phi(hi)
            d = np.where(p_lo <= 0.5, special.ndtri(p_lo), -special.ndtri(self._q_hi + qc * self._z))
            if self._any_tail:
                log_p = np.log(p_lo)
                c = self._c
                dt = special.ndtri_exp(log_p + self._log_phi_hi) + c
                # ndtri_exp loses accuracy far in the tail, and t - hi cancels: Newton steps on
                # log W(d) = log p in d itself; d/dd log W = phi(t) / Phi(t) = 1 / mills.
                for _ in range(3):
                    dt = np.minimum(dt, 0.0)
                    e = special.erfcx((c - dt) * _ISQRT2)
                    log_w = dt * (2.0 * c - dt) * 0.5 + np.log(e / self._kd)
                    dt = dt - (log_w - log_p) * e * _SQRT_HALF_PI
                d = np.where(self._tail, dt, d)
            d = np.minimum(np.maximum(d, self._dlo), self._dhi)
            x = self._ref + (self._sgn * self.sigma) * d
            return np.minimum(np.maximum(x, self.a), self.b)

    def ppf(self, q: ArrayLike) -> np.ndarray | float:
        """Quantile function (closed form via ``ndtri`` / ``ndtri_exp``); NaN outside [0, 1]."""
        q = as_float64(q)
        x = self._ppf_raw(q)
        x = np.where(q == 0, self.a, np.where(q == 1, self.b, x))
        return as_result(np.where((q >= 0) & (q <= 1), x, np.nan))

    def mean(self) -> np.ndarray | float:
        """Mean of the distribution."""
        return as_result(self.mu - self.sigma * (self._phiz_b - self._phiz_a))

    def var(self) -> np.ndarray | float:
        """Variance of the distribution."""
        mu, s = self.mu, self.sigma
        d = self._phiz_b - self._phiz_a
        v = s * s * (1.0 - ((self.b - mu) * self._phiz_b - (self.a - mu) * self._phiz_a) / s - d * d)
        return as_result(np.clip(v, 0.0, 0.25 * (self.b - self.a) ** 2))

    def __repr__(self) -> str:
        return f"TruncatedNormal(mu={self.mu!r}, sigma={self.sigma!r}, a={self.a}, b={self.b})"


class NormWeightedMixture(Distribution):
    """Mixture of normals truncated to [-1, 1], weighted by bucket norms: ``w_b = n_b / sum(n)``.

    Parameters
    ----------
    weights : array_like, shape (B,)
        Nonnegative, finite, not all zero (e.g. the bucket norms); normalized here.
        Zero-weight components are dropped.
    mus, sigmas : array_like, shape (B,)
        Parameters of the components (see :class:`TruncatedNormal`); broadcast with ``weights``.

    Notes
    -----
    ``ppf`` inverts the CDF numerically (vectorized safeguarded Newton / bisection), starting
    from a tabulated CDF.
    """

    _exact_ppf = False

    def __init__(self, weights: ArrayLike, mus: ArrayLike, sigmas: ArrayLike) -> None:
        w, mus, sigmas = (
            np.ravel(v) for v in np.broadcast_arrays(as_float64(weights), as_float64(mus), as_float64(sigmas))
        )
        if w.size == 0:
            raise ValueError("the mixture needs at least one component")
        if not np.all(np.isfinite(w)) or np.any(w < 0):
            raise ValueError("weights must be finite and nonnegative")
        total = w.sum()
        if not total > 0:
            raise ValueError("weights are all zero: the mixture has no mass")
        keep = w > 0
        self.weights = w[keep] / total
        self.weights /= self.weights.sum()
        self.components = TruncatedNormal(mus[keep], sigmas[keep])
        self.mus, self.sigmas = self.components.mu, self.components.sigma
        c, w = self.components, self.weights
        self._fw = np.stack([w, w * c.mu, w * c._s2])  # weights of F: M0, M1, M2 terms
        self._pw = np.stack([w * c.sigma, w * c.sigma * c.mu, w / c.sigma])  # weights of phi/Z
        self._k1 = float(np.sum(w * c.sigma * c._phiz_a))
        self._k2 = float(np.sum(w * c.sigma * c._amu_phiz_a))
        self._table: tuple[np.ndarray, np.ndarray] | None = None

    def _mpdf(self, x: np.ndarray) -> np.ndarray:
        f, phiz = self.components._eval(x[..., None])
        sf = np.sum(f[..., None, :] * self._fw, axis=-1)
        sp = np.sum(phiz[..., None, :] * self._pw, axis=-1)
        xc = np.minimum(np.maximum(x, -1.0), 1.0)
        out = np.empty((4,) + x.shape)
        out[0] = sf[..., 0]
        out[1] = sf[..., 1] - sp[..., 0] + self._k1
        out[2] = sf[..., 2] - xc * sp[..., 0] - sp[..., 1] + self._k2
        out[3] = sp[..., 2]
        return out

    def cdf(self, x: ArrayLike) -> np.ndarray | float:
        """Cumulative distribution function at ``x``."""
        x = as_float64(x)
        f = np.sum(self.components._eval(x[..., None])[0] * self.weights, axis=-1)
        return as_result(np.clip(f, 0.0, 1.0))

    def _cdf_table(self) -> tuple[np.ndarray, np.ndarray]:
        if self._table is None:
            pts = np.concatenate([np.linspace(-1.0, 1.0, 65), self.mus])
            grid = np.unique(np.clip(pts, -1.0, 1.0))
            vals = np.maximum.accumulate(self.cdf(grid))
            self._table = (grid, vals)
        return self._table

    def ppf(self, q: ArrayLike) -> np.ndarray | float:
        """Quantile function by numerical inversion; NaN outside [0, 1]."""
        q = as_float64(q)
        shape = q.shape
        qf = q.ravel()
        x = np.full(qf.shape, np.nan)
        ok = (qf >= 0) & (qf <= 1)
        if ok.any():
            qs = qf[ok]
            grid, vals = self._cdf_table()
            k = np.clip(np.searchsorted(vals, qs, side="left"), 1, grid.size - 1)
            lo, hi = grid[k - 1], grid[k]
            flo, fhi = vals[k - 1], vals[k]
            with np.errstate(all="ignore"):
                x0 = np.where(fhi > flo, lo + (qs - flo) / (fhi - flo) * (hi - lo), lo)
            x0 = np.clip(x0, lo, hi)
            xs, _ = _invert_cdf(self, qs, lo.copy(), hi.copy(), x0, self._mpdf(x0))
            xs = np.where(qs == 0, -1.0, np.where(qs == 1, 1.0, xs))
            x[ok] = xs
        return as_result(x.reshape(shape))

    def mean(self) -> float:
        """Mean of the distribution."""
        return float(np.sum(self.weights * self.components.mean()))

    def var(self) -> float:
        """Variance of the distribution."""
        m = self.components.mean()
        mean = np.sum(self.weights * m)
        return float(np.sum(self.weights * (self.components.var() + (m - mean) ** 2)))

    def __repr__(self) -> str:
        return f"NormWeightedMixture({self.weights.size} components)"


def _invert_cdf(
    dist: Distribution,
    q: np.ndarray,
    lo: np.ndarray,
    hi: np.ndarray,
    x: np.ndarray,
    m: np.ndarray,
    ftol: float = 1e-13,
    maxiter: int = 100,
) -> tuple[np.ndarray, np.ndarray]:
    """Solve ``F(x) = q`` in brackets ``[lo, hi]`` by safeguarded Newton steps (bisection fallback).

    Parameters
    ----------
    dist : distribution with ``_mpdf``
    q, lo, hi, x : ndarray, shape (n,)
        Targets, brackets (``F(lo) <= q <= F(hi)``) and starting points inside them.
    m : ndarray, shape (4, n)
        ``dist._mpdf(x)``.

    Returns
    -------
    x : ndarray, shape (n,)
    m : ndarray, shape (4, n)
        ``dist._mpdf`` at the returned ``x`` (moments and density).
    """
    x, m, lo, hi = x.copy(), m.copy(), lo.copy(), hi.copy()
    r = m[0] - q
    lo = np.where(r < 0, x, lo)
    hi = np.where(r > 0, x, hi)

    def _open(r: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        width = 4.0 * np.spacing(np.maximum(np.abs(lo), np.abs(hi)))
        return (np.abs(r) > ftol) & (hi - lo > width)

    active = _open(r, lo, hi)
    for _ in range(maxiter):
        idx = np.flatnonzero(active)
        if idx.size == 0:
            break
        xi, li, hi_i = x[idx], lo[idx], hi[idx]
        with np.errstate(all="ignore"):
            xn = xi - r[idx] / m[3, idx]
        xn = np.where((xn > li) & (xn < hi_i), xn, 0.5 * (li + hi_i))
        mn = dist._mpdf(xn)
        rn = mn[0] - q[idx]
        x[idx], m[:, idx], r[idx] = xn, mn, rn
        li = np.where(rn < 0, xn, li)
        hi_i = np.where(rn > 0, xn, hi_i)
        lo[idx], hi[idx] = li, hi_i
        active[idx] = _open(rn, li, hi_i)
    return x, m
