"""Bits per tensor under a budget: the allocation that minimizes the variance of a step's update.

Given, for every tensor ``t`` of a step and every candidate width ``w``, the quantization error
``E||Q_w(g_t) - g_t||^2`` with the levels fitted for ``w``, and the tensors' sizes ``n_t``, find
widths ``w_t`` minimizing ``sum_t error[t, w_t]`` subject to ``sum_t n_t w_t <= budget * sum_t n_t``.

This is a multiple-choice knapsack. :func:`allocate_bits` solves it greedily on each tensor's
lower convex hull of (bits, error): starting from the narrowest width, it repeatedly takes the hull
segment with the largest error reduction per coordinate-bit that still fits the budget. Taken in
that order the segments give the optimum of the problem's linear relaxation (each tensor's
error is convex along its hull, so no later segment is worth more than an earlier one); the
integer solution returned is at most one segment short of it: ``gap`` of the result bounds its
distance to the true optimum. Ties are broken by tensor index, so every rank given the same
inputs (sums of allreduced statistics) gets the same allocation.
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


def allocate_bits(errors: np.ndarray, sizes: Sequence[int], budget: float, widths: Sequence[int]) -> Allocation:
    """Widths for every tensor minimizing the total error under a mean-bits budget.

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
    return Allocation(bits=bits, error=total, mean_bits=float((sizes_a * bits).sum() / sizes_a.sum()), gap=gap or 0.0)
