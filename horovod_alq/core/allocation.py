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


def hull(widths: np.ndarray, errors: np.ndarray) -> list[int]:
    """Indices (into ``widths``) of the lower convex hull of (width, error), from the narrowest,
    keeping only points that reduce the error."""
    kept: list[int] = []
    for j in range(len(widths)):
        if kept and errors[j] >= errors[kept[-1]]:
            continue  # wider and no better: never worth its bits
        while len(kept) >= 2:
            a, b = kept[-2], kept[-1]
            # b lies on or above the segment a -> j: drop it
            if (errors[b] - errors[a]) * (widths[j] - widths[a]) >= (errors[j] - errors[a]) * (widths[b] - widths[a]):
                kept.pop()
            else:
                break
        kept.append(j)
    return kept


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
        raise ValueError(
            f"errors must have shape (tensors, widths) = ({len(sizes_a)}, {len(widths_a)}), got {errors.shape}"
        )
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
    return Allocation(bits=bits, error=total, mean_bits=float((sizes_a * bits).sum() / max(sizes_a.sum(), 1)), gap=gap)


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
    hulls = [hull(widths_a, errors[t]) for t in range(len(sizes_a))]
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
    return Allocation(
        bits=bits, error=total, mean_bits=float((sizes_a * bits).sum() / max(sizes_a.sum(), 1)), gap=gap or 0.0
    )
