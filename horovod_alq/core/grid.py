"""Distributions with a piecewise-linear CDF on a grid over [-1, 1]: the form of the additive
statistics (:class:`GridDistribution`) and a stack of them evaluated together (:class:`GridStack`,
``bits="auto"``), with the protocol of :mod:`.distributions`."""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike

from .distributions import Distribution, as_float64, as_result

__all__ = ["GridDistribution", "GridStack"]


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
        x = as_float64(x)
        return as_result(np.where(np.isnan(x), np.nan, np.interp(x, self.grid, self.cdf_values)))

    def _ppf_raw(self, q: np.ndarray) -> np.ndarray:
        c, g = self.cdf_values, self.grid
        i = np.searchsorted(c[1:-1], q, side="left")  # first k >= 1 with c_k >= q, minus 1
        dc, gi = self._dc[i], g[i]
        with np.errstate(all="ignore"):
            x = np.where(dc > 0, gi + (q - c[i]) / dc * self._h[i], gi)
        return np.minimum(np.maximum(x, gi), g[i + 1])

    def ppf(self, q: ArrayLike) -> np.ndarray | float:
        """Inverse interpolation; ``inf {x : F(x) >= q}``, NaN outside [0, 1]."""
        q = as_float64(q)
        return as_result(np.where((q >= 0) & (q <= 1), self._ppf_raw(q), np.nan))

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
