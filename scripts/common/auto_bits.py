"""What the variance studies (scripts/study/variance.py, both models) share to measure a step's
exact quantization error per tensor, as the compressors quantize it, and the compressors'
``bits="auto"`` (horovod_alq.core.auto_bits.AutoBits) along a sequence of gradients."""

from __future__ import annotations

import itertools

import numpy as np

from horovod_alq.core import Quantizer
from horovod_alq.core.auto_bits import AutoBits
from horovod_alq.core.statistics import normalize


def coordinate_errors(levels: np.ndarray, g: np.ndarray, bucket: int, norm: str = "l2") -> np.ndarray:
    """Exact E(Q(g_i) - g_i)^2 of every coordinate for unbiased stochastic rounding to ``levels``
    (buckets of ``bucket`` from the start of ``g``)."""
    nz = normalize(g, bucket, norm)
    r = nz.r.reshape(-1)[: g.size]
    n = np.repeat(nz.norms.astype(np.float64), bucket)[: g.size]
    cell = np.clip(np.searchsorted(levels, r, side="right") - 1, 0, levels.size - 2)
    return n**2 * (levels[cell + 1] - r) * (r - levels[cell])


def normalized_variance(levels: np.ndarray, g: np.ndarray, bucket: int, norm: str = "l2") -> float:
    """Exact E||Q(g) - g||^2 / ||g||^2 for unbiased stochastic rounding to ``levels``."""
    return float(coordinate_errors(levels, g, bucket, norm).sum() / (g.astype(np.float64) ** 2).sum())


def exact_error(q: Quantizer, g: np.ndarray) -> float:
    """E||Q(g) - g||^2 of one tensor (unnormalized; buckets counted from its start)."""
    return normalized_variance(q.levels, g, q.bucket_size, q.norm) * float((g.astype(np.float64) ** 2).sum())


def error_matrix(quantizers: list, quantized: list) -> np.ndarray:
    """errors[t, j]: E||Q(g_t) - g_t||^2 of quantized tensor t under ``quantizers[j]``."""
    return np.array([[exact_error(q, g) for q in quantizers] for _, g in quantized])


def bucket_error_matrix(quantizers: list, quantized: list) -> tuple[np.ndarray, list[int], np.ndarray]:
    """errors[u, j]: E||Q(b_u) - b_u||^2 of bucket u (every quantized tensor's buckets, from its start,
    in order) under ``quantizers[j]`` (one bucket size), the buckets' sizes, and the row of each
    tensor's first bucket (``np.add.reduceat(errors, firsts)`` is :func:`error_matrix`)."""
    d = quantizers[0].bucket_size
    starts = [np.arange(0, g.size, d) for _, g in quantized]
    errors = np.stack(
        [
            np.concatenate(
                [np.add.reduceat(coordinate_errors(q.levels, g, d, q.norm), s) for (_, g), s in zip(quantized, starts)]
            )
            for q in quantizers
        ],
        axis=1,
    )
    sizes = [int(min(d, g.size - a)) for (_, g), s in zip(quantized, starts) for a in s]
    firsts = np.cumsum([0] + [len(s) for s in starts[:-1]])
    return errors, sizes, firsts


def best_allocation(errors: np.ndarray, sizes: list, budget: float, widths) -> tuple[float, list[int]] | None:
    """The exact optimum of :func:`~horovod_alq.core.allocation.allocate_bits`'s problem (least
    ``sum_t errors[t, w_t]`` with ``sum_t n_t w_t <= budget * sum_t n_t``) by trying every
    allocation: its error and widths; None when there are more than 10**6 allocations."""
    if len(widths) ** len(sizes) > 10**6:
        return None
    choice = np.array(list(itertools.product(range(len(widths)), repeat=len(sizes))))  # (allocations, T)
    bits = np.asarray(widths)[choice]
    total = np.where(
        bits @ np.asarray(sizes, dtype=np.float64) <= budget * sum(sizes) * (1 + 1e-12),
        errors[np.arange(len(sizes)), choice].sum(axis=1),
        np.inf,
    )
    i = int(np.argmin(total))
    return float(total[i]), bits[i].tolist()


def quantized_tensors(grads: list, min_size: int) -> tuple[list, list, list]:
    """The (name, flat gradient) pairs a compressor quantizes (at least ``min_size`` elements; the
    smaller ones travel in float32), their sizes, and their keys for :class:`AutoBits`."""
    quantized = [(n, g) for n, g in grads if g.size >= min_size]
    sizes = [g.size for _, g in quantized]
    return quantized, sizes, [(n, k) for k, n in enumerate(sizes)]


def refit_from(q: Quantizer, quantized: list) -> None:
    """Refit ``q`` from the sum of the tensors' statistics (what the compressors' allreduce combines)."""
    q.adapt(sum(q.statistics(g) for _, g in quantized))


def auto_refit(auto: AutoBits, quantized: list, sizes: list, keys: list) -> list[int]:
    """The compressors' refit of ``bits="auto"`` from one round: allocate with the current levels,
    then refit every width in use from its tensors. Returns the widths per tensor."""
    auto.refit(np.stack([auto.row(g) for _, g in quantized]), sizes, keys)
    return list(auto.bits)


def auto_error(auto: AutoBits, quantized: list, keys: list) -> tuple[float, list[int]]:
    """E||Q(g) - g||^2 of the round under the compressor's allocation (its default width before the
    first refit) and the widths it used."""
    bits = list(auto.widths_for(keys))
    return sum(exact_error(auto.quantizers[w], g) for w, (_, g) in zip(bits, quantized)), bits


def bucket_auto_error(auto: AutoBits, quantized: list) -> tuple[float, float]:
    """``bits_per="bucket"``: E||Q(g) - g||^2 of the round when the quantized tensors travel in one
    payload (each from a bucket boundary, as a fusion buffer lays them out) whose buckets take the
    widths the compressor picks from their norms, and the mean bits per coordinate it spent."""
    from horovod_alq.core.auto_bits import AUTO_WIDTHS
    from horovod_alq.core.statistics import bucket_norms

    d, norm = auto.mixed.bucket_size, auto.mixed.norm
    errors, sizes, _ = bucket_error_matrix([auto.quantizers[w] for w in AUTO_WIDTHS], quantized)
    squared = np.concatenate([bucket_norms(g, d, norm) for _, g in quantized]).astype(np.float64) ** 2
    lengths = np.full(len(sizes), d)
    lengths[-1] = sizes[-1]
    widths = auto.mixed.widths(squared, lengths, int(lengths.sum()))
    return float(errors[np.arange(len(widths)), widths.astype(int) - AUTO_WIDTHS[0]].sum()), float(
        (lengths * widths).sum() / lengths.sum()
    )
