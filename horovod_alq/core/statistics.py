"""Bucket normalization, per-bucket moments and the additive statistics vector (``docs/design.md``).

Pipeline: ``x -> normalize`` (float32 bucket norms and normalized coordinates ``r``, shared with the
encoder) ``-> bucket_moments -> summarize`` (a fixed-length float64 vector; the elementwise sum over
workers describes all their buckets) ``-> distribution_from_statistics`` (what the level fits use).
Every use of the vector is a ratio, so the mean over workers gives the same distribution as the sum.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .methods import Method, get_method

#: Fixed symmetric grid of the norm-based statistics: 0 and +-geomspace(1e-6, 1, 400), sorted.
GRID: np.ndarray = np.concatenate([-np.geomspace(1e-6, 1.0, 400)[::-1], [0.0], np.geomspace(1e-6, 1.0, 400)])
GRID.setflags(write=False)

#: Floor on a bucket's (or the pooled) standard deviation of normalized coordinates. A bucket whose
#: coordinates are all equal (e.g. a single coordinate) has sigma 0; the truncated normal needs
#: sigma > 0, and at 1e-6 it is a step at mu on the grid's scale.
SIGMA_FLOOR = 1e-6

_CDF_CHUNK = 2048  # buckets per vectorized CDF evaluation (2048 x 801 float64 = 13 MB)


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
        b, d = self.r.shape
        counts = np.full(b, d, dtype=np.int64)
        if b:
            counts[-1] = self.numel - (b - 1) * d
        return counts


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
    x = np.asarray(x).ravel()
    n = x.size
    nb = -(-n // bucket_size)
    xb = np.zeros(nb * bucket_size, dtype=np.float64)
    xb[:n] = x
    xb = xb.reshape(nb, bucket_size)
    with np.errstate(over="ignore", invalid="ignore"):
        if norm == "l2":
            norms64 = np.sqrt(np.einsum("ij,ij->i", xb, xb))
        elif norm == "linf":
            norms64 = np.abs(xb).max(axis=1) if nb else np.zeros(0)
        else:
            raise ValueError(f"unknown norm {norm!r}; allowed: l2, linf")
        norms = norms64.astype(np.float32)
    norms[~np.isfinite(norms)] = np.nan
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


def _bucket_sigma(mu: np.ndarray, count: np.ndarray, sum_r2: np.ndarray) -> np.ndarray:
    return np.maximum(np.sqrt(np.maximum(sum_r2 / count - mu**2, 0.0)), SIGMA_FLOOR)


def summarize(method: str | Method, moments: BucketMoments) -> np.ndarray:
    """Turn bucket moments into the method's additive statistics vector.

    Parameters
    ----------
    method : str or Method
    moments : BucketMoments

    Returns
    -------
    np.ndarray, shape (statistics_length(method),), float64
        Norm-less and fixed methods: ``[N, sum r, sum r**2, sum_b (sum_r_b)**2 / count_b]``.
        Norm-based (alq, amq): ``[W, sum_b n_b * F_b(GRID)]`` with ``W = sum_b n_b`` and ``F_b`` the
        CDF of ``N(mu_b, sigma_b**2)`` truncated to [-1, 1], ``mu_b = sum_r_b / count_b``,
        ``sigma_b = max(sqrt(sum_r2_b / count_b - mu_b**2), SIGMA_FLOOR)``.
    """
    m = _method(method)
    if not _norm_based(m):
        c = moments.count
        return np.array(
            [c.sum(), moments.sum_r.sum(), moments.sum_r2.sum(), (moments.sum_r**2 / c).sum() if c.size else 0.0],
            dtype=np.float64,
        )
    from .distributions import TruncatedNormal

    out = np.zeros(1 + GRID.size, dtype=np.float64)
    out[0] = moments.norms.sum()
    mu = moments.sum_r / moments.count if moments.count.size else np.zeros(0)
    sigma = _bucket_sigma(mu, moments.count, moments.sum_r2)
    for i in range(0, mu.size, _CDF_CHUNK):
        sl = slice(i, i + _CDF_CHUNK)
        cdf = TruncatedNormal(mu[sl, None], sigma[sl, None]).cdf(GRID[None, :])
        out[1:] += moments.norms[sl] @ cdf
    return out


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
        Norm-based methods: piecewise-linear CDF ``stats[1:] / stats[0]`` on ``GRID``.

    Raises
    ------
    ValueError
        Wrong length, non-finite entries, or no data (N == 0 or W == 0).
    """
    from .distributions import GridDistribution, TruncatedNormal

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
    cdf = np.clip(np.maximum.accumulate(stats[1:] / stats[0]), 0.0, 1.0)
    cdf[0], cdf[-1] = 0.0, 1.0
    return GridDistribution(GRID, cdf)
