"""Bucket normalization, per-bucket moments and the additive statistics vector (``docs/design/design.md``).

Pipeline: ``x -> normalize`` (float32 bucket norms and normalized coordinates ``r``, shared with the
encoder) ``-> summarize`` (a fixed-length float64 vector; the elementwise sum over workers describes
all their buckets) ``-> distribution_from_statistics`` (what the level fits use). Every use of the
vector is a ratio, so the mean over workers gives the same distribution as the sum.

Norm-less methods (ALQ-N, AMQ-N) use four moments and the paper's single truncated normal.
Norm-based methods (ALQ, AMQ) use the norm-weighted mixture of the buckets' *empirical*
distributions, as a CDF on :data:`GRID`: the paper models each bucket as a truncated normal, but
real gradients are heavy-tailed and that model makes ALQ put all its levels in the bulk (on the
MNIST CNN of scripts/demo/train.py it multiplied the true quantization variance by up to 8 and cost 20
points of accuracy; ``docs/design/statistics.md``). The empirical CDF is as cheap and just as additive.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .methods import Method, get_method
from .wire import bucket_lengths

GRID: np.ndarray = np.concatenate([-np.geomspace(1e-6, 1.0, 400)[::-1], [0.0], np.geomspace(1e-6, 1.0, 400)])
"""Fixed symmetric grid of the norm-based statistics: 0 and +-geomspace(1e-6, 1, 400), sorted."""
GRID.setflags(write=False)

#: Floor on a bucket's (or the pooled) standard deviation of normalized coordinates. A bucket whose
#: coordinates are all equal (e.g. a single coordinate) has sigma 0; the truncated normal needs
#: sigma > 0, and at 1e-6 it is a step at mu on the grid's scale.
SIGMA_FLOOR = 1e-6


@dataclass(frozen=True)
class Normalized:
    """Bucket norms and normalized coordinates of a flat array.

    Attributes
    ----------
    norms : np.ndarray, shape (B,), float32
        L2 or max-abs norm of each bucket rounded to float32; NaN where the bucket holds a
        non-finite value (or its norm overflows float32).
    r : np.ndarray, shape (B, bucket_size), float64
        ``x / norm`` clipped to [-1, 1]; 0 in buckets with norm 0 or NaN and in the padding
        after the last element.
    numel : int
        Number of elements ``n``; the last bucket holds ``n - (B - 1) * bucket_size`` of them.
    """

    norms: np.ndarray
    r: np.ndarray
    numel: int

    @property
    def counts(self) -> np.ndarray:
        """Elements per bucket, shape (B,), int64."""
        return bucket_lengths(self.numel, self.r.shape[1])


def _padded_buckets(x: np.ndarray, bucket_size: int) -> tuple[np.ndarray, int]:
    """Flat ``x`` zero-padded to whole buckets, float64, shape (B, bucket_size); and its size."""
    x = np.asarray(x).ravel()
    n = x.size
    nb = -(-n // bucket_size)
    xb = np.zeros(nb * bucket_size, dtype=np.float64)
    xb[:n] = x
    return xb.reshape(nb, bucket_size), n


def _norms_of(xb: np.ndarray, norm: str) -> np.ndarray:
    """The float32 norm of each row of ``xb`` (computed in float64), NaN where not finite."""
    with np.errstate(over="ignore", invalid="ignore"):
        if norm == "l2":
            norms64 = np.sqrt(np.einsum("ij,ij->i", xb, xb))
        elif norm == "linf":
            norms64 = np.abs(xb).max(axis=1) if len(xb) else np.zeros(0)
        else:
            raise ValueError(f"unknown norm {norm!r}; allowed: l2, linf")
        norms = norms64.astype(np.float32)
    norms[~np.isfinite(norms)] = np.nan
    return norms


def bucket_norms(x: np.ndarray, bucket_size: int, norm: str) -> np.ndarray:
    """The norms :func:`normalize` computes (float32, NaN for a bucket that is not finite), alone."""
    return _norms_of(_padded_buckets(x, bucket_size)[0], norm)


def normalize(x: np.ndarray, bucket_size: int, norm: str) -> Normalized:
    """Split flat ``x`` into buckets and normalize them exactly as the encoder does.

    Parameters
    ----------
    x : np.ndarray, any shape, floating dtype
        Flattened in C order.
    bucket_size : int
        Coordinates per bucket ``d``; the last bucket may be short.
    norm : {"l2", "linf"}
        Bucket norm, computed in float64 and rounded to float32.

    Returns
    -------
    Normalized
    """
    xb, n = _padded_buckets(x, bucket_size)
    norms = _norms_of(xb, norm)
    ok = norms > 0  # False for NaN
    xb[~ok] = 0.0
    np.divide(xb, norms.astype(np.float64)[:, None], out=xb, where=ok[:, None])
    np.clip(xb, -1.0, 1.0, out=xb)
    return Normalized(norms, xb, n)


@dataclass(frozen=True)
class BucketMoments:
    """Per-bucket moments of normalized coordinates over finite, non-zero-norm buckets.

    Attributes
    ----------
    norms : np.ndarray, shape (B',), float64
        The float32 bucket norms (as float64).
    count : np.ndarray, shape (B',), float64
        Coordinates in each bucket.
    sum_r, sum_r2 : np.ndarray, shape (B',), float64
        Sum of ``r`` and of ``r**2`` in each bucket.
    """

    norms: np.ndarray
    count: np.ndarray
    sum_r: np.ndarray
    sum_r2: np.ndarray


def moments_of(normalized: Normalized) -> BucketMoments:
    """Moments of already-normalized buckets (see :func:`bucket_moments`)."""
    keep = normalized.norms > 0
    r = normalized.r[keep]
    return BucketMoments(
        norms=normalized.norms[keep].astype(np.float64),
        count=normalized.counts[keep].astype(np.float64),
        sum_r=r.sum(axis=1),
        sum_r2=np.einsum("ij,ij->i", r, r),
    )


def bucket_moments(x: np.ndarray, bucket_size: int, norm: str) -> BucketMoments:
    """Per-bucket moments of ``x`` normalized as by the encoder; skips non-finite and zero buckets.

    Parameters
    ----------
    x : np.ndarray, any shape, floating dtype
    bucket_size : int
    norm : {"l2", "linf"}

    Returns
    -------
    BucketMoments
    """
    return moments_of(normalize(x, bucket_size, norm))


def _method(method: str | Method) -> Method:
    return method if isinstance(method, Method) else get_method(method)


def _norm_based(method: Method) -> bool:
    return method.adaptive and not method.normless


def statistics_length(method: str | Method) -> int:
    """Length of the statistics vector: 4 (norm-less and fixed methods) or ``1 + len(GRID)``."""
    return 1 + GRID.size if _norm_based(_method(method)) else 4


def normless_statistics(moments: BucketMoments) -> np.ndarray:
    """``[N, sum r, sum r**2, sum_b (sum_r_b)**2 / count_b]`` of the buckets in ``moments``."""
    c = moments.count
    return np.array(
        [c.sum(), moments.sum_r.sum(), moments.sum_r2.sum(), (moments.sum_r**2 / c).sum() if c.size else 0.0],
        dtype=np.float64,
    )


def grid_cell(r: np.ndarray) -> np.ndarray:
    """Index ``k >= 1`` of the grid cell ``(GRID[k-1], GRID[k]]`` holding each ``r`` (``-1`` goes to
    cell 1). Frameworks: ``max(bucketize(r, GRID, right=False), 1)``."""
    return np.maximum(np.searchsorted(GRID, r, side="left"), 1)


def grid_statistics(normalized: Normalized) -> np.ndarray:
    """Norm-based statistics: ``[W, C(GRID[0]), ..., C(GRID[-1])]`` with ``W = sum_b n_b`` and
    ``C(g) = sum_b n_b / count_b * #{i in bucket b : r_i <= g}`` over finite non-zero buckets
    (``C(-1) = 0``: a coordinate at -1 counts in the first cell)."""
    return _grid_cumulative(normalized, squared=False)[0]


def grid_histograms(normalized: Normalized) -> np.ndarray:
    """Shape (2, 1 + len(GRID)): row 0 :func:`grid_statistics`; row 1 the same counts weighted by
    ``n_b**2`` instead of ``n_b / count_b`` (``[sum_b n_b**2 count_b, C2(GRID)]``), from which
    :func:`~.auto_bits.errors_from_histograms` gives ``E||Q(x) - x||**2`` for any levels
    (``bits="auto"``). One grid search for both."""
    return _grid_cumulative(normalized, squared=True)


def auto_statistics(normalized: Normalized, method: str | Method) -> tuple[np.ndarray, np.ndarray]:
    """``bits="auto"``: row 1 of :func:`grid_histograms` and the method's statistics vector (for
    the norm-based methods row 0 of the same histograms: one grid search for both)."""
    hist = grid_histograms(normalized)
    return hist[1], hist[0] if _norm_based(_method(method)) else summarize(method, normalized)


def _grid_cumulative(normalized: Normalized, squared: bool) -> np.ndarray:
    keep = normalized.norms > 0  # False for NaN
    counts = normalized.counts
    norms = np.where(keep, normalized.norms.astype(np.float64), 0.0)
    cells = grid_cell(normalized.r).ravel()
    rows = [(norms / np.maximum(counts, 1), norms.sum())]
    if squared:
        rows.append((norms * norms, (norms * norms * counts).sum()))
    out = np.empty((len(rows), 1 + GRID.size), dtype=np.float64)
    for row, (bucket_weight, total) in zip(out, rows):
        weights = np.repeat(bucket_weight, normalized.r.shape[1])
        weights[normalized.numel :] = 0.0  # padding after the last element
        hist = np.bincount(cells, weights=weights, minlength=GRID.size)
        row[0] = total
        row[1:] = np.cumsum(hist[: GRID.size])
    return out


def summarize(method: str | Method, normalized: Normalized) -> np.ndarray:
    """The method's additive statistics vector of normalized buckets (see :func:`normalize`).

    Returns
    -------
    np.ndarray, shape (statistics_length(method),), float64
        Norm-less and fixed methods: :func:`normless_statistics`; norm-based (alq, amq):
        :func:`grid_statistics`.
    """
    if _norm_based(_method(method)):
        return grid_statistics(normalized)
    return normless_statistics(moments_of(normalized))


def distribution_from_statistics(method: str | Method, stats: np.ndarray):
    """The distribution of normalized coordinates described by a statistics vector.

    Parameters
    ----------
    method : str or Method
    stats : array_like, shape (statistics_length(method),), float
        One worker's vector, or the sum or mean of several.

    Returns
    -------
    TruncatedNormal
        Norm-less and fixed methods: ``mu = sum r / N``, ``sigma**2`` = pooled within-bucket
        variance ``(sum r**2 - sum_b (sum_r_b)**2 / count_b) / N``, floored at ``SIGMA_FLOOR**2``.
    GridDistribution
        Norm-based methods: piecewise-linear CDF ``stats[1:] / stats[-1]`` on ``GRID``.

    Raises
    ------
    ValueError
        Wrong length, non-finite entries, or no data (N == 0 or W == 0).
    """
    from .distributions import TruncatedNormal  # (loads SciPy, needed at refits only)
    from .grid import GridDistribution

    m = _method(method)
    stats = np.asarray(stats, dtype=np.float64)
    expected = statistics_length(m)
    if stats.ndim != 1 or stats.size != expected:
        raise ValueError(f"statistics vector has shape {stats.shape}, method {m.name} expects ({expected},)")
    bad = np.flatnonzero(~np.isfinite(stats))
    if bad.size:
        raise ValueError(f"statistics vector has non-finite entries at indices {bad[:5].tolist()}")
    if not stats[0] > 0:
        what = "W (sum of bucket norms)" if _norm_based(m) else "N (coordinate count)"
        raise ValueError(f"statistics describe no data: {what} is {stats[0]}; no finite non-zero bucket was seen")
    if not _norm_based(m):
        n, s1, s2, s3 = stats
        mu = s1 / n
        sigma = max(np.sqrt(max(s2 - s3, 0.0) / n), SIGMA_FLOOR)
        return TruncatedNormal(mu, sigma)
    if not stats[-1] > 0:
        raise ValueError("statistics describe no data: the grid CDF is 0 everywhere")
    cdf = np.clip(np.maximum.accumulate(stats[1:] / stats[-1]), 0.0, 1.0)
    cdf[0], cdf[-1] = 0.0, 1.0
    return GridDistribution(GRID, cdf)
