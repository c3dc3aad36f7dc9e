"""Bits per tensor under a budget: the allocation that minimizes the variance of a step's update.

Given, for every tensor ``t`` of a step and every candidate width ``w``, the quantization error
``E||Q_w(g_t) - g_t||^2`` with the levels fitted for ``w``, and the tensors' sizes ``n_t``, find
widths ``w_t`` minimizing ``sum_t error[t, w_t]`` subject to ``sum_t n_t w_t <= budget * sum_t n_t``.

This is a multiple-choice knapsack. :func:`allocate_bits` solves it exactly by dynamic programming
over the tensors on the budget's spare coordinate-bits, in units of the sizes' greatest common
divisor (every cost is a multiple of it); past :data:`CELL_LIMIT` units the costs are rounded up
to a coarser unit (always within budget), and the result is then the better of that and a
greedy on each tensor's lower convex hull of (bits, error), which takes the hull segments in
order of error reduction per coordinate-bit while they fit. The greedy alone can be far off where
one tensor holds most coordinates: small tensors take the spare bits first and the big one's
next width no longer fits (on the demo CNN it chose 7/2/8 bits with several times the error of
uniform 3/3/3). ``gap`` of the result bounds its distance to the optimum (0 when exact). Every rank given the
same inputs (sums of allreduced statistics) gets the same allocation.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Sequence

import numpy as np


@dataclass(frozen=True)
class Allocation:
    """The result of :func:`allocate_bits`.

    Attributes
    ----------
    bits : np.ndarray, shape (T,), int
        The width of every tensor.
    error : float
        ``sum_t error[t, bits_t]``.
    mean_bits : float
        ``sum_t n_t bits_t / sum_t n_t`` (at most the budget).
    gap : float
        Upper bound on ``error`` minus the optimum: the error reduction of the first hull segment
        (in the greedy order) that did not fit (0 when none was left out).
    """

    bits: np.ndarray
    error: float
    mean_bits: float
    gap: float


def _hull(widths: np.ndarray, errors: np.ndarray) -> list[int]:
    """Indices (into ``widths``) of the lower convex hull of (width, error), from the narrowest,
    keeping only points that reduce the error."""
    hull: list[int] = []
    for j in range(len(widths)):
        if hull and errors[j] >= errors[hull[-1]]:
            continue  # wider and no better: never worth its bits
        while len(hull) >= 2:
            a, b = hull[-2], hull[-1]
            # b lies on or above the segment a -> j: drop it
            if (errors[b] - errors[a]) * (widths[j] - widths[a]) >= (errors[j] - errors[a]) * (widths[b] - widths[a]):
                hull.pop()
            else:
                break
        hull.append(j)
    return hull


#: Most budget units :func:`allocate_bits` solves exactly (in units of the sizes' common divisor).
CELL_LIMIT = 1 << 14


def allocate_bits(errors: np.ndarray, sizes: Sequence[int], budget: float, widths: Sequence[int]) -> Allocation:
    """Widths for every tensor minimizing the total error under a mean-bits budget (exact unless the
    budget spans more than :data:`CELL_LIMIT` units: then ``gap`` bounds the distance to the optimum).

    Parameters
    ----------
    errors : array, shape (T, W)
        ``errors[t, j]``: the error of tensor ``t`` at ``widths[j]`` (finite, >= 0).
    sizes : T ints
        Coordinates per tensor (> 0).
    budget : float
        Mean bits per coordinate over the tensors; at least ``min(widths)``.
    widths : W ints, strictly increasing
        Candidate bits per coordinate, e.g. ``range(2, 9)``.

    Raises
    ------
    ValueError
        On shapes that do not match, a budget below the narrowest width, widths not increasing,
        sizes not positive or errors not finite and non-negative.
    """
    errors = np.asarray(errors, dtype=np.float64)
    sizes_a = np.asarray(sizes, dtype=np.int64)
    widths_a = np.asarray(widths, dtype=np.int64)
    if errors.ndim != 2 or errors.shape != (len(sizes_a), len(widths_a)):
        raise ValueError(f"errors must have shape (tensors, widths) = ({len(sizes_a)}, {len(widths_a)}), "
                         f"got {errors.shape}")
    if len(widths_a) == 0 or np.any(np.diff(widths_a) <= 0) or widths_a[0] < 1:
        raise ValueError(f"widths must be positive and strictly increasing, got {list(widths)}")
    if np.any(sizes_a <= 0):
        raise ValueError("every tensor size must be positive")
    if not np.all(np.isfinite(errors)) or np.any(errors < 0):
        raise ValueError("errors must be finite and non-negative")
    if not budget >= widths_a[0]:
        raise ValueError(f"budget {budget} is below the narrowest width {int(widths_a[0])}")
    exact, choice = _knapsack(errors, sizes_a, budget, widths_a)
    bits = widths_a[choice]
    total = float(errors[np.arange(len(sizes_a)), choice].sum())
    gap = 0.0
    if not exact:
        greedy = _greedy(errors, sizes_a, budget, widths_a)
        if greedy.error < total:
            return greedy
        gap = max(0.0, total - greedy.error + greedy.gap)
    return Allocation(bits=bits, error=total, mean_bits=float((sizes_a * bits).sum() / max(sizes_a.sum(), 1)),
                      gap=gap)


def _knapsack(errors: np.ndarray, sizes: np.ndarray, budget: float, widths: np.ndarray) -> tuple[bool, np.ndarray]:
    """Dynamic programming over the tensors on the coordinate-bits above the narrowest width, in
    units of the sizes' greatest common divisor (exact) or, past :data:`CELL_LIMIT` units, of
    1/CELL_LIMIT of the budget's spare bits with every cost rounded up (within budget, not always
    optimal). ``best[c]``: the least error of the tensors so far spending at most ``c`` units.
    Returns whether it was exact and the chosen width index of every tensor (ties: the narrower)."""
    extra = sizes[:, None] * (widths - widths[0])[None, :]  # (T, W) coordinate-bits, integers
    spare = (budget - float(widths[0])) * float(sizes.sum())
    spare += 1e-9 * max(1.0, abs(spare))
    unit = int(np.gcd.reduce(sizes)) if len(sizes) else 1
    exact = spare / unit <= CELL_LIMIT
    if exact:
        cells, costs = int(spare // unit), extra // unit
    else:
        cells, costs = CELL_LIMIT, np.ceil(extra / (spare / CELL_LIMIT)).astype(np.int64)
    best = np.zeros(cells + 1)
    picks = np.zeros((len(sizes), cells + 1), dtype=np.int8)
    for t in range(len(sizes)):
        new = best + errors[t, 0]  # the narrowest width costs no unit
        for j in range(1, len(widths)):
            k = int(costs[t, j])
            if k > cells:
                break
            option = best[: cells + 1 - k] + errors[t, j]
            better = option < new[k:]  # strictly: ties keep the narrower width
            new[k:][better] = option[better]
            picks[t, k:][better] = j
        best = new
    choice = np.zeros(len(sizes), dtype=np.int64)
    c = cells
    for t in range(len(sizes) - 1, -1, -1):
        choice[t] = picks[t, c]
        c -= costs[t, choice[t]]
    return exact, choice


def _greedy(errors: np.ndarray, sizes_a: np.ndarray, budget: float, widths_a: np.ndarray) -> Allocation:
    """The greedy on each tensor's convex hull (the optimum of the linear relaxation, less the
    critical segment, then the segments that still fit): ``gap`` is that segment's error reduction."""
    hulls = [_hull(widths_a, errors[t]) for t in range(len(sizes_a))]
    position = [0] * len(sizes_a)  # index into each tensor's hull
    spare = (budget - float(widths_a[0])) * float(sizes_a.sum())  # every hull starts at the narrowest width
    heap: list[tuple[float, int]] = []

    def push(t: int) -> None:
        h, k = hulls[t], position[t]
        if k + 1 < len(h):
            a, b = h[k], h[k + 1]
            gain = (errors[t, a] - errors[t, b]) / (sizes_a[t] * (widths_a[b] - widths_a[a]))
            heapq.heappush(heap, (-gain, t))

    for t in range(len(sizes_a)):
        push(t)
    gap = None
    while heap:
        _, t = heapq.heappop(heap)
        a, b = hulls[t][position[t]], hulls[t][position[t] + 1]
        cost = float(sizes_a[t] * (widths_a[b] - widths_a[a]))
        if cost <= spare + 1e-9 * max(1.0, abs(spare)):
            spare -= cost
            position[t] += 1
            push(t)
        elif gap is None:  # the first segment that does not fit: the relaxation takes part of it
            gap = float(errors[t, a] - errors[t, b])
    chosen = np.array([hulls[t][position[t]] for t in range(len(sizes_a))], dtype=np.int64)
    bits = widths_a[chosen]
    total = float(errors[np.arange(len(sizes_a)), chosen].sum())
    return Allocation(bits=bits, error=total, mean_bits=float((sizes_a * bits).sum() / max(sizes_a.sum(), 1)),
                      gap=gap or 0.0)


# ---------------------------------------------------------------------------------------------
# bits="auto": what the compressors keep and compute at each refit

#: The candidate widths of ``bits="auto"``.
AUTO_WIDTHS: tuple[int, ...] = tuple(range(2, 9))
#: What gets a width with ``bits="auto"``: each tensor (one allocation agreed at refits) or each
#: bucket of every payload (chosen by each rank from its own norms, :mod:`.bucket_widths`).
BITS_PER = ("tensor", "bucket")


def check_budget(budget) -> float:
    """``bit_budget`` as a float in [2, 8] (mean bits per coordinate of the quantized tensors,
    bucket norms not counted), or ValueError naming it."""
    if isinstance(budget, bool) or not isinstance(budget, (int, float, np.integer, np.floating)) \
            or not np.isfinite(budget) or not AUTO_WIDTHS[0] <= budget <= AUTO_WIDTHS[-1]:
        raise ValueError(f"bit_budget must be a number from {AUTO_WIDTHS[0]} to {AUTO_WIDTHS[-1]} (mean bits per "
                         f"coordinate), got {budget!r}")
    return float(budget)


def errors_from_histograms(squared: np.ndarray, level_sets: Sequence[np.ndarray]) -> np.ndarray:
    """``E||Q(x) - x||^2`` of tensors under level sets, shape (T, W), from each tensor's counts on
    :data:`~.statistics.GRID` weighted by its squared bucket norms (``squared``, shape (T, 1 + G):
    row 1 of :func:`~.statistics.grid_histograms`, of one rank or summed over ranks): the total
    weight times Psi of each level set on the tensor's :class:`~.distributions.GridDistribution`
    (``sum_b n_b**2 sum_i (l_{j+1} - r_i)(r_i - l_j)`` with the ``r_i`` taken as uniform within a
    grid cell, which moves the result by about 0.1% on real gradients, at most a few %). All
    tensors and widths at once; 0 for a tensor without weight."""
    from .distributions import _GridStack
    from .objective import _cell_costs
    from .statistics import GRID

    c = np.atleast_2d(np.asarray(squared, dtype=np.float64))[:, 1:]  # C2 at the grid points
    total = c[:, -1]
    out = np.zeros((c.shape[0], len(level_sets)))
    live = np.flatnonzero(total > 0)
    if not live.size:
        return out
    stack = _GridStack.from_cumulative(GRID, c[live])
    x = np.concatenate([np.asarray(lv, dtype=np.float64) for lv in level_sets])
    mom = stack._mpdf(x[None, :], np.arange(live.size)[:, None])  # (4, live, P)
    ends = np.cumsum([len(lv) for lv in level_sets])
    psi = np.stack([_cell_costs(x[e - len(lv): e], mom[:, :, e - len(lv): e]).sum(axis=-1)
                    for lv, e in zip(level_sets, ends)], axis=1)
    out[live] = total[live, None] * psi
    return out


def quantization_errors(x: np.ndarray, quantizers: Sequence) -> np.ndarray:
    """``E||Q(x) - x||^2`` of the array ``x`` under each quantizer (same norm and bucket size, their
    own levels), shape (len(quantizers),); see :func:`errors_from_histograms`."""
    from .statistics import grid_histograms, normalize

    nz = normalize(x, quantizers[0].bucket_size, quantizers[0].norm)
    return errors_from_histograms(grid_histograms(nz)[1:], [q.levels for q in quantizers])[0]


class AutoBits:
    """The state of ``bits="auto"``: one quantizer per width of :data:`AUTO_WIDTHS` (each with its
    own levels) and the allocation of the last refit, a width per tensor of the round it was fitted
    on (``keys``: each tensor's (elements, shape code), in order).

    A round whose tensors are exactly ``keys`` quantizes each with its allocated width; any other
    round (before the first refit, a plain allreduce between steps, ranks in different orders)
    quantizes all of its tensors with :attr:`default`, the widest width within the budget. At a
    refit (:meth:`refit`), every rank holds the sum over ranks of every tensor's :meth:`row`: the
    exact quantization error of each width with its current levels (the sum of the ranks' errors is
    the variance of the summed update), and the method's statistics. :func:`allocate_bits` then
    picks the widths minimizing the total error under the budget, and each width in use refits its
    levels from the statistics of the tensors that use it (warm-started; widths not in use keep
    theirs). The same sums give every rank the same allocation and levels.
    """

    def __init__(self, method: str, budget: float, bucket_size: int, norm: str | None = None,
                 bits_per: str = "tensor") -> None:
        from .bucket_widths import MixedWidths
        from .quantizer import Quantizer

        self.budget = check_budget(budget)
        if bits_per not in BITS_PER:
            raise ValueError(f"bits_per must be one of {', '.join(map(repr, BITS_PER))}, got {bits_per!r}")
        self.bits_per = bits_per
        self.quantizers = {w: Quantizer(method, bits=w, bucket_size=bucket_size, norm=norm) for w in AUTO_WIDTHS}
        self.default = int(np.floor(self.budget))
        self.keys: tuple = ()
        self.bits: tuple[int, ...] = ()
        # bits_per="bucket": every payload's widths per bucket (the error model set at each refit)
        self.mixed = MixedWidths(self.quantizers, self.budget, self.default) if bits_per == "bucket" else None

    def quantizers_for(self, keys: Sequence, start: int = 0, whole: bool = True) -> list:
        """The quantizer of each tensor of ``keys[start:]`` (:meth:`widths_for`, or with ``whole``
        False :meth:`widths_so_far`); with ``bits_per="bucket"`` the mixed one for all."""
        if self.mixed is not None:
            return [self.mixed] * (len(keys) - start)
        bits = self.widths_for(keys)[start:] if whole else self.widths_so_far(keys, start)
        return [self.quantizers[w] for w in bits]

    def widths_for(self, keys: Sequence) -> tuple[int, ...]:
        """The width of each tensor of a round whose tensors are ``keys``."""
        keys = tuple(keys)
        return self.bits if keys == self.keys else (self.default,) * len(keys)

    def widths_so_far(self, keys: Sequence, start: int) -> tuple[int, ...]:
        """The widths of ``keys[start:]``, the latest tensors of a round whose tensors so far are
        ``keys`` (a round started before all of its tensors are known): the allocation's if
        ``keys`` is its beginning, else the default (the complete round is checked on its own)."""
        keys = tuple(keys)
        if self.keys[:len(keys)] == keys:
            return self.bits[start:len(keys)]
        return (self.default,) * (len(keys) - start)

    def row(self, x: np.ndarray) -> np.ndarray:
        """One array's refit vector: its error at every width, then its statistics."""
        from .statistics import auto_statistics, normalize

        q = self.quantizers[self.default]
        squared, stats = auto_statistics(normalize(x, q.bucket_size, q.norm), q.method)
        return self.rows(squared[None], stats[None])[0]

    def rows(self, squared: np.ndarray, stats: np.ndarray) -> np.ndarray:
        """The refit vectors of T tensors, shape (T, W + k): their errors at every width (from their
        squared-norm histograms, shape (T, 1 + G), see :func:`errors_from_histograms`), then their
        statistics (shape (T, k)). With ``bits_per="bucket"`` the histograms themselves (T, 1 + G + k):
        the error model is computed after the refit, with the new levels."""
        if self.mixed is not None:
            return np.concatenate([np.atleast_2d(squared), np.atleast_2d(stats)], axis=1)
        errors = errors_from_histograms(squared, [self.quantizers[w].levels for w in AUTO_WIDTHS])
        return np.concatenate([errors, np.atleast_2d(stats)], axis=1)

    def refit(self, rows: np.ndarray, sizes: Sequence[int], keys: Sequence) -> Allocation:
        """Allocate and refit from the sum over ranks of every tensor's :meth:`row` (shape (T, ...))."""
        from .quantizer import adapt_together

        rows = np.asarray(rows, dtype=np.float64)
        if self.mixed is not None:
            return self._refit_buckets(rows)
        w = len(AUTO_WIDTHS)
        alloc = allocate_bits(np.maximum(rows[:, :w], 0.0), sizes, self.budget, AUTO_WIDTHS)
        widths = sorted(set(alloc.bits.tolist()))
        stats = [rows[alloc.bits == width, w:].sum(axis=0) for width in widths]
        seen = [i for i, st in enumerate(stats) if st[0] > 0]  # (no finite non-zero bucket: keep)
        adapt_together([self.quantizers[widths[i]] for i in seen], [stats[i] for i in seen])
        self.keys, self.bits = tuple(keys), tuple(int(b) for b in alloc.bits)
        return alloc

    def _refit_buckets(self, rows: np.ndarray) -> None:
        """``bits_per="bucket"``: every width refits from all tensors' statistics, then the error model
        (each width's error per unit of squared bucket norm, new levels) from the summed histograms."""
        from .bucket_widths import MixedWidths
        from .quantizer import adapt_together
        from .statistics import GRID

        g = 1 + len(GRID)
        squared, stats = rows[:, :g].sum(axis=0), rows[:, g:].sum(axis=0)
        if stats[0] > 0:  # (no finite non-zero bucket: keep the levels)
            adapt_together([self.quantizers[w] for w in AUTO_WIDTHS], [stats] * len(AUTO_WIDTHS))
        c = errors_from_histograms(squared[None], [self.quantizers[w].levels for w in AUTO_WIDTHS])[0]
        self.mixed = MixedWidths(self.quantizers, self.budget, self.default, c if c.any() else None)

    def mean_bits(self) -> float:
        """Mean bits per coordinate of the allocation (NaN before the first refit; with
        ``bits_per="bucket"`` the budget, which every payload's codes fill up to a bucket)."""
        if self.mixed is not None:
            from .bucket_widths import BUDGET_UNITS

            return self.mixed.budget256 / BUDGET_UNITS
        if not self.bits:
            return float("nan")
        n = np.array([k[0] for k in self.keys], dtype=np.float64)
        return float((n * np.array(self.bits)).sum() / n.sum())

    def fingerprint(self) -> int:
        """Hash of every width's levels and of the allocation (the handshake's)."""
        from .protocol import stable_hash

        return stable_hash(*(self.quantizers[w].fingerprint for w in AUTO_WIDTHS), self.allocation_hash())

    def allocation_hash(self) -> int:
        from .protocol import stable_hash

        if self.mixed is not None:
            return stable_hash("bucket", self.mixed.fingerprint)
        return stable_hash(repr((self.keys, self.bits)))

    def state_dict(self) -> dict:
        out = {"budget": self.budget, "keys": [list(k) for k in self.keys], "bits": list(self.bits),
               "quantizers": {w: q.state_dict() for w, q in self.quantizers.items()}}
        if self.mixed is not None:
            out.update(bits_per="bucket", error_model=None if self.mixed.c is None else self.mixed.c.tolist())
        return out

    def load_state_dict(self, state: dict) -> None:
        if float(state["budget"]) != self.budget:
            raise ValueError(f"state has bit_budget={state['budget']!r}, this compressor has {self.budget!r}")
        for w, q in self.quantizers.items():
            q.load_state_dict(state["quantizers"][w] if w in state["quantizers"] else state["quantizers"][str(w)])
        if state.get("bits_per", "tensor") != self.bits_per:
            raise ValueError(f"state has bits_per={state.get('bits_per', 'tensor')!r}, this compressor has "
                             f"{self.bits_per!r}")
        self.keys = tuple(tuple(int(v) for v in k) for k in state["keys"])
        self.bits = tuple(int(b) for b in state["bits"])
        if self.mixed is not None:
            from .bucket_widths import MixedWidths

            c = state.get("error_model")
            self.mixed = MixedWidths(self.quantizers, self.budget, self.default, None if c is None else np.asarray(c))
