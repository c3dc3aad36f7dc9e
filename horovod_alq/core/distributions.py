"""Distributions of normalized gradient coordinates on [-1, 1], in the style of ``scipy.stats``.

Every object has the same protocol, vectorized over NumPy arrays (``x`` and ``q`` of any shape):

- ``pdf(x)``, ``cdf(x)``, ``ppf(q)`` (``ppf(q) = inf {x : F(x) >= q}``; NaN for ``q`` outside [0, 1]);
- ``partial_moment(x, order)`` = integral_{a}^{x} r**order dF(r) for ``order`` 0 (the CDF), 1 or 2;
- ``partial_moments(x)``: the three orders at once, shape ``(3, *x.shape)``;
- ``mean()``, ``var()``.

The partial moments are what the quantization objective (``objective.py``) is built from: the
expected variance of a cell [l, u] is ``-u*l*dM0 + (u + l)*dM1 - dM2``.

Classes: :class:`TruncatedNormal` (the model of one bucket, Faghri et al., NeurIPS 2020, sec. 2),
:class:`NormWeightedMixture` (ALQ / AMQ: buckets weighted by their norms) and
:class:`GridDistribution` (piecewise-linear CDF on a grid, the form of the additive statistics).
"""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike
from scipy import special

__all__ = ["SIGMA_MIN", "TruncatedNormal", "NormWeightedMixture", "GridDistribution"]

#: Standard deviations below this (including 0) are raised to it: a near point mass.
SIGMA_MIN = 1e-12

_ISQRT2 = float(np.sqrt(0.5))
_INV_SQRT2PI = float(1.0 / np.sqrt(2.0 * np.pi))
_SQRT_HALF_PI = float(np.sqrt(0.5 * np.pi))


def _asfloat(x: ArrayLike) -> np.ndarray:
    return np.asarray(x, dtype=np.float64)


def _out(y: np.ndarray) -> np.ndarray | float:
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
        return self._mpdf(_asfloat(x))[:3]

    def partial_moment(self, x: ArrayLike, order: int) -> np.ndarray | float:
        """``integral_a^x r**order dF(r)`` for ``order`` in {0, 1, 2} (0 gives the CDF)."""
        if isinstance(order, bool) or order not in (0, 1, 2):
            raise ValueError(f"order must be 0, 1 or 2, got {order!r}")
        return _out(self._mpdf(_asfloat(x))[order])

    def pdf(self, x: ArrayLike) -> np.ndarray | float:
        """Density at ``x`` (0 outside the support)."""
        x = _asfloat(x)
        return _out(np.where((x >= self.a) & (x <= self.b), self._mpdf(x)[3], 0.0))

    def cdf(self, x: ArrayLike) -> np.ndarray | float:
        """Cumulative distribution function at ``x``."""
        return _out(np.clip(self._mpdf(_asfloat(x))[0], 0.0, 1.0))

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
        mu = _asfloat(mu)
        sigma = _asfloat(sigma)
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
        x = _asfloat(x)
        phiz = self._eval(x)[1]
        return _out(np.where((x >= self.a) & (x <= self.b), phiz / self.sigma, 0.0))

    def cdf(self, x: ArrayLike) -> np.ndarray | float:
        """Cumulative distribution function at ``x``."""
        return _out(np.clip(self._eval(_asfloat(x))[0], 0.0, 1.0))

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
        q = _asfloat(q)
        x = self._ppf_raw(q)
        x = np.where(q == 0, self.a, np.where(q == 1, self.b, x))
        return _out(np.where((q >= 0) & (q <= 1), x, np.nan))

    def mean(self) -> np.ndarray | float:
        """Mean of the distribution."""
        return _out(self.mu - self.sigma * (self._phiz_b - self._phiz_a))

    def var(self) -> np.ndarray | float:
        """Variance of the distribution."""
        mu, s = self.mu, self.sigma
        d = self._phiz_b - self._phiz_a
        v = s * s * (1.0 - ((self.b - mu) * self._phiz_b - (self.a - mu) * self._phiz_a) / s - d * d)
        return _out(np.clip(v, 0.0, 0.25 * (self.b - self.a) ** 2))

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
        w, mus, sigmas = (np.ravel(v) for v in np.broadcast_arrays(_asfloat(weights), _asfloat(mus), _asfloat(sigmas)))
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
        x = _asfloat(x)
        f = np.sum(self.components._eval(x[..., None])[0] * self.weights, axis=-1)
        return _out(np.clip(f, 0.0, 1.0))

    def _cdf_table(self) -> tuple[np.ndarray, np.ndarray]:
        if self._table is None:
            pts = np.concatenate([np.linspace(-1.0, 1.0, 65), self.mus])
            grid = np.unique(np.clip(pts, -1.0, 1.0))
            vals = np.maximum.accumulate(self.cdf(grid))
            self._table = (grid, vals)
        return self._table

    def ppf(self, q: ArrayLike) -> np.ndarray | float:
        """Quantile function by numerical inversion; NaN outside [0, 1]."""
        q = _asfloat(q)
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
        return _out(x.reshape(shape))

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


class GridDistribution(Distribution):
    """Distribution with a piecewise-linear CDF on a grid over [-1, 1] (constant density per cell).

    Parameters
    ----------
    grid : array_like, shape (G,)
        Strictly increasing, ``grid[0] == -1`` and ``grid[-1] == 1``; G >= 2.
    cdf_values : array_like, shape (G,)
        CDF at the grid points, up to a positive factor (it is divided by ``cdf_values[-1]``, so
        norm-weighted sums can be passed as they are); must start at 0 and be nondecreasing
        (violations up to 1e-9 relative are rounding and are repaired).

    Notes
    -----
    Partial moments are exact per cell from precomputed cumulative sums; ``ppf`` interpolates
    inversely and returns the left end of a zero-mass stretch.
    """

    _TOL = 1e-9

    def __init__(self, grid: ArrayLike, cdf_values: ArrayLike) -> None:
        g = np.array(grid, dtype=np.float64)
        c = np.array(cdf_values, dtype=np.float64)
        if g.ndim != 1 or c.shape != g.shape or g.size < 2:
            raise ValueError(
                f"grid and cdf_values must be 1-D of the same length >= 2, got shapes {g.shape} and {c.shape}"
            )
        if not (np.all(np.isfinite(g)) and np.all(np.isfinite(c))):
            raise ValueError("grid and cdf_values must be finite")
        if not np.all(np.diff(g) > 0):
            raise ValueError("grid must be strictly increasing")
        if abs(g[0] + 1.0) > 1e-12 or abs(g[-1] - 1.0) > 1e-12:
            raise ValueError(f"grid must run from -1 to 1, got [{g[0]!r}, {g[-1]!r}]")
        g[0], g[-1] = -1.0, 1.0
        if not c[-1] > 0:
            raise ValueError(f"cdf_values[-1] (total mass) must be > 0, got {c[-1]!r}")
        c = c / c[-1]
        if abs(c[0]) > self._TOL:
            raise ValueError(f"cdf_values[0] must be 0 (F(-1) = 0), got {c[0]!r} after normalizing")
        if np.any(np.diff(c) < -self._TOL) or np.any(c < -self._TOL) or np.any(c > 1 + self._TOL):
            raise ValueError("cdf_values must be nondecreasing")
        self.grid, self._h = g, np.diff(g)
        tables = _cumulative_tables(g, c[None])
        self.cdf_values, self._p1, self._p2, self._dc, self._dens = (t[0] for t in tables)

    def _mpdf(self, x: np.ndarray) -> np.ndarray:
        return self._moments(self.grid, (self.cdf_values, self._p1, self._p2, self._dc, self._dens), x)

    @staticmethod
    def _moments(g: np.ndarray, tables: tuple, x: np.ndarray, which=0) -> np.ndarray:
        """M0, M1, M2 and the density at ``x`` (shape (4,) + x.shape) from the cumulative tables
        (cdf, p1, p2: G entries per distribution; dc, dens: G - 1) of distribution ``which``
        (broadcast against ``x``) of several laid back to back on the grid ``g``."""
        cdf, p1, p2, dc, dens = tables
        xc = np.minimum(np.maximum(x, -1.0), 1.0)
        i = np.searchsorted(g[1:-1], xc, side="right")  # cell index, 0 .. G-2
        at, cell = which * g.size + i, which * (g.size - 1) + i
        gi = g[i]
        dct = dc[cell] * ((xc - gi) / (g[i + 1] - gi))  # mass in [g_i, x]
        out = np.empty((4,) + dct.shape)
        out[0] = cdf[at] + dct
        out[1] = p1[at] + dct * (gi + xc) * 0.5
        out[2] = p2[at] + dct * (gi * gi + gi * xc + xc * xc) / 3.0
        out[3] = dens[cell]
        return out

    def cdf(self, x: ArrayLike) -> np.ndarray | float:
        """Cumulative distribution function at ``x``."""
        x = _asfloat(x)
        return _out(np.where(np.isnan(x), np.nan, np.interp(x, self.grid, self.cdf_values)))

    def _ppf_raw(self, q: np.ndarray) -> np.ndarray:
        c, g = self.cdf_values, self.grid
        i = np.searchsorted(c[1:-1], q, side="left")  # first k >= 1 with c_k >= q, minus 1
        dc, gi = self._dc[i], g[i]
        with np.errstate(all="ignore"):
            x = np.where(dc > 0, gi + (q - c[i]) / dc * self._h[i], gi)
        return np.minimum(np.maximum(x, gi), g[i + 1])

    def ppf(self, q: ArrayLike) -> np.ndarray | float:
        """Inverse interpolation; ``inf {x : F(x) >= q}``, NaN outside [0, 1]."""
        q = _asfloat(q)
        return _out(np.where((q >= 0) & (q <= 1), self._ppf_raw(q), np.nan))

    def mean(self) -> float:
        """Mean of the distribution."""
        return float(self._p1[-1])

    def var(self) -> float:
        """Variance of the distribution."""
        mid = (self.grid[:-1] + self.grid[1:]) / 2.0
        return float(np.sum(self._dc * ((mid - self.mean()) ** 2 + self._h**2 / 12.0)))

    def __repr__(self) -> str:
        return f"GridDistribution({self.grid.size} grid points)"


def _cumulative_tables(g: np.ndarray, c: np.ndarray) -> tuple:
    """The tables of :meth:`GridDistribution._moments` (cdf, p1, p2: shape (T, G); dc, dens: (T,
    G - 1)) of T distributions on the grid ``g`` from their CDFs at the grid points (``c``, shape (T,
    G), already divided by their totals; rounding below 0, above 1 or downwards is repaired)."""
    c = np.clip(np.maximum.accumulate(np.clip(c, 0.0, 1.0), axis=1), 0.0, 1.0)
    c[:, 0], c[:, -1] = 0.0, 1.0
    gl, gr = g[:-1], g[1:]
    dc = np.diff(c, axis=1)
    zero = np.zeros((c.shape[0], 1))
    p1 = np.concatenate([zero, np.cumsum(dc * (gl + gr) / 2.0, axis=1)], axis=1)
    p2 = np.concatenate([zero, np.cumsum(dc * (gl * gl + gl * gr + gr * gr) / 3.0, axis=1)], axis=1)
    return c, p1, p2, dc, dc / (gr - gl)


class GridStack:
    """Several :class:`GridDistribution` on one grid, for work on all of them at once (ALQ fits that
    run together, the errors of ``bits="auto"``): ``_mpdf`` and ``_ppf_raw`` of distribution
    ``which`` (an int array broadcast against the argument)."""

    _exact_ppf = True

    def __init__(self, dists: list[GridDistribution]) -> None:
        self.grid, self._h, self._keys = dists[0].grid, dists[0]._h, None
        # each table flat, distribution t's entries at t * G (cdf, p1, p2) or t * (G - 1) (per cell)
        self._cdf, self._p1, self._p2, self._dc, self._dens = (
            np.concatenate(t) for t in zip(*((d.cdf_values, d._p1, d._p2, d._dc, d._dens) for d in dists))
        )

    @classmethod
    def from_cumulative(cls, grid: np.ndarray, weights: np.ndarray) -> "GridStack":
        """The stack of ``GridDistribution(grid, w)`` for each row ``w`` of ``weights`` (shape (T,
        G), cumulative, each with a positive total), built at once and without the checks."""
        stack = cls.__new__(cls)
        stack.grid = np.asarray(grid, dtype=np.float64)
        stack._h, stack._keys = np.diff(stack.grid), None
        w = np.asarray(weights, dtype=np.float64)
        tables = _cumulative_tables(stack.grid, w / w[:, -1:])
        stack._cdf, stack._p1, stack._p2, stack._dc, stack._dens = (t.ravel() for t in tables)
        return stack

    def _mpdf(self, x: np.ndarray, which: np.ndarray) -> np.ndarray:
        return GridDistribution._moments(self.grid, (self._cdf, self._p1, self._p2, self._dc, self._dens), x, which)

    def _ppf_raw(self, q: np.ndarray, which: np.ndarray) -> np.ndarray:
        g = self.grid
        qc = np.minimum(np.maximum(q, 0.0), 1.0)
        # GridDistribution._ppf_raw's index in distribution `which`'s interior CDF values, for all
        # at once: one search in the pairs (distribution, value), compared lexicographically as
        # complex numbers (exact: no arithmetic on the values)
        inner = g.size - 2
        if self._keys is None:
            cdf = self._cdf.reshape(-1, g.size)
            self._keys = (np.arange(cdf.shape[0])[:, None] + 1j * cdf[:, 1:-1]).ravel()
        # (a NaN value sorts after every pair: capped to the end of its own distribution, as alone)
        i = np.minimum(np.searchsorted(self._keys, which + 1j * qc, side="left") - which * inner, inner)
        c, dc, gi = self._cdf[which * g.size + i], self._dc[which * (g.size - 1) + i], g[i]
        with np.errstate(all="ignore"):
            x = np.where(dc > 0, gi + (qc - c) / dc * self._h[i], gi)
        return np.minimum(np.maximum(x, gi), g[i + 1])


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
