"""``bits="auto"``: the state the compressors keep (a quantizer per width, the allocation of the last
refit) and the errors they compute at each refit.

Every tensor of a step gets a width of :data:`AUTO_WIDTHS` under a mean-bits budget: at a refit,
from the sum over ranks of every tensor's errors at every width (:func:`errors_from_histograms`),
:func:`~.allocation.allocate_bits` picks the widths and each width in use refits its levels
(:class:`AutoBits`). With ``bits_per="bucket"`` each rank picks a width per bucket of every payload
instead (:mod:`.bucket_widths`).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from .allocation import Allocation, allocate_bits
from .bucket_widths import MixedWidths
from .protocol import stable_hash
from .quantizer import Quantizer, adapt_together
from .statistics import GRID, auto_statistics, normalize
from .wire import BUDGET_UNITS

#: The candidate widths of ``bits="auto"``.
AUTO_WIDTHS: tuple[int, ...] = tuple(range(2, 9))
#: What gets a width with ``bits="auto"``: each tensor (one allocation agreed at refits) or each
#: bucket of every payload (chosen by each rank from its own norms, :mod:`.bucket_widths`).
BITS_PER = ("tensor", "bucket")


def check_budget(budget, bits_max: int | None = None) -> float:
    """``bit_budget`` as a float from 2 to ``bits_max`` (None: 8; mean bits per coordinate of the
    quantized tensors, bucket norms not counted), or ValueError naming it."""
    top = check_bits_max(bits_max)
    if (
        isinstance(budget, bool)
        or not isinstance(budget, (int, float, np.integer, np.floating))
        or not np.isfinite(budget)
        or not AUTO_WIDTHS[0] <= budget <= top
    ):
        raise ValueError(
            f"bit_budget must be a number from {AUTO_WIDTHS[0]} to {top} (mean bits per coordinate"
            f"{'' if bits_max is None else ', at most bits_max'}), got {budget!r}"
        )
    return float(budget)


def check_auto(budget, bits_per: str, bits_max: int | None) -> float:
    """The settings of ``bits="auto"`` checked together (ValueError naming the one at fault); returns
    the budget as a float."""
    if bits_per not in BITS_PER:
        raise ValueError(f"bits_per must be one of {', '.join(map(repr, BITS_PER))}, got {bits_per!r}")
    if bits_max is not None and bits_per == "bucket":
        raise ValueError("bits_max applies to bits_per='tensor' (per-bucket payloads have a slot for every width)")
    return check_budget(budget, bits_max)


def check_bits_max(bits_max) -> int:
    """The widest width of ``bits="auto"``: ``bits_max`` (an integer from 3 to 8), None: 8; or ValueError."""
    top = AUTO_WIDTHS[-1]
    if bits_max is None:
        return top
    if isinstance(bits_max, bool) or not isinstance(bits_max, (int, np.integer)) or not 3 <= bits_max <= top:
        raise ValueError(f"bits_max must be an integer from 3 to {top} or None, got {bits_max!r}")
    return int(bits_max)


def errors_from_histograms(squared: np.ndarray, level_sets: Sequence[np.ndarray]) -> np.ndarray:
    """``E||Q(x) - x||^2`` of tensors under level sets, shape (T, W), from each tensor's counts on
    :data:`~.statistics.GRID` weighted by its squared bucket norms (``squared``, shape (T, 1 + G):
    row 1 of :func:`~.statistics.grid_histograms`, of one rank or summed over ranks): the total
    weight times Psi of each level set on the tensor's :class:`~.distributions.GridDistribution`
    (``sum_b n_b**2 sum_i (l_{j+1} - r_i)(r_i - l_j)`` with the ``r_i`` taken as uniform within a
    grid cell, which moves the result by about 0.1% on real gradients, at most a few %). All
    tensors and widths at once; 0 for a tensor without weight."""
    # (here, not at the top: distributions and objective load SciPy, which bits="auto" needs only at refits)
    from .grid import GridStack
    from .objective import cell_costs

    c = np.atleast_2d(np.asarray(squared, dtype=np.float64))[:, 1:]  # C2 at the grid points
    total = c[:, -1]
    out = np.zeros((c.shape[0], len(level_sets)))
    live = np.flatnonzero(total > 0)
    if not live.size:
        return out
    stack = GridStack.from_cumulative(GRID, c[live])
    x = np.concatenate([np.asarray(lv, dtype=np.float64) for lv in level_sets])
    mom = stack._mpdf(x[None, :], np.arange(live.size)[:, None])  # (4, live, P)
    ends = np.cumsum([len(lv) for lv in level_sets])
    psi = np.stack(
        [cell_costs(x[e - len(lv) : e], mom[:, :, e - len(lv) : e]).sum(axis=-1) for lv, e in zip(level_sets, ends)],
        axis=1,
    )
    out[live] = total[live, None] * psi
    return out


class AutoBits:
    """The state of ``bits="auto"``: one quantizer per width (:attr:`widths`: :data:`AUTO_WIDTHS` up
    to ``bits_max``, each with its own levels) and the allocation of the last refit, a width per
    tensor of the round it was fitted on (``keys``: each tensor's (elements, shape code), in order).

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

    def __init__(
        self,
        method: str,
        budget: float,
        bucket_size: int,
        norm: str | None = None,
        bits_per: str = "tensor",
        bits_max: int | None = None,
    ) -> None:
        self.budget = check_auto(budget, bits_per, bits_max)
        self.bits_per = bits_per
        #: The candidate widths.
        self.widths: tuple[int, ...] = tuple(w for w in AUTO_WIDTHS if w <= check_bits_max(bits_max))
        self.quantizers = {w: Quantizer(method, bits=w, bucket_size=bucket_size, norm=norm) for w in self.widths}
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
        if self.keys[: len(keys)] == keys:
            return self.bits[start : len(keys)]
        return (self.default,) * (len(keys) - start)

    def row(self, x: np.ndarray) -> np.ndarray:
        """One array's refit vector: its error at every width, then its statistics."""
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
        errors = errors_from_histograms(squared, [self.quantizers[w].levels for w in self.widths])
        return np.concatenate([errors, np.atleast_2d(stats)], axis=1)

    def refit(self, rows: np.ndarray, sizes: Sequence[int], keys: Sequence) -> Allocation:
        """Allocate and refit from the sum over ranks of every tensor's :meth:`row` (shape (T, ...))."""
        rows = np.asarray(rows, dtype=np.float64)
        if self.mixed is not None:
            return self._refit_buckets(rows)
        w = len(self.widths)
        alloc = allocate_bits(np.maximum(rows[:, :w], 0.0), sizes, self.budget, self.widths)
        widths = sorted(set(alloc.bits.tolist()))
        stats = [rows[alloc.bits == width, w:].sum(axis=0) for width in widths]
        seen = [i for i, st in enumerate(stats) if st[0] > 0]  # (no finite non-zero bucket: keep)
        adapt_together([self.quantizers[widths[i]] for i in seen], [stats[i] for i in seen])
        self.keys, self.bits = tuple(keys), tuple(int(b) for b in alloc.bits)
        return alloc

    def _refit_buckets(self, rows: np.ndarray) -> None:
        """``bits_per="bucket"``: every width refits from all tensors' statistics, then the error model
        (each width's error per unit of squared bucket norm, new levels) from the summed histograms."""
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
            return self.mixed.budget256 / BUDGET_UNITS
        if not self.bits:
            return float("nan")
        n = np.array([k[0] for k in self.keys], dtype=np.float64)
        return float((n * np.array(self.bits)).sum() / n.sum())

    def fingerprint(self) -> int:
        """Hash of every width's levels and of the allocation (the handshake's)."""
        return stable_hash(*(self.quantizers[w].fingerprint for w in self.widths), self.allocation_hash())

    def allocation_hash(self) -> int:
        if self.mixed is not None:
            return stable_hash("bucket", self.mixed.fingerprint)
        return stable_hash(repr((self.keys, self.bits)))

    def state_dict(self) -> dict:
        out = {
            "budget": self.budget,
            "keys": [list(k) for k in self.keys],
            "bits": list(self.bits),
            "quantizers": {w: q.state_dict() for w, q in self.quantizers.items()},
        }
        if self.mixed is not None:
            out.update(bits_per="bucket", error_model=None if self.mixed.c is None else self.mixed.c.tolist())
        return out

    def load_state_dict(self, state: dict) -> None:
        if float(state["budget"]) != self.budget:
            raise ValueError(f"state has bit_budget={state['budget']!r}, this compressor has {self.budget!r}")
        widths = tuple(int(w) for w in state["quantizers"])
        if widths != self.widths:
            raise ValueError(
                f"state has bits='auto' widths {widths[0]} to {widths[-1]}, this compressor "
                f"{self.widths[0]} to {self.widths[-1]} (bits_max)"
            )
        for w, q in self.quantizers.items():
            q.load_state_dict(state["quantizers"][w] if w in state["quantizers"] else state["quantizers"][str(w)])
        if state.get("bits_per", "tensor") != self.bits_per:
            raise ValueError(
                f"state has bits_per={state.get('bits_per', 'tensor')!r}, this compressor has {self.bits_per!r}"
            )
        self.keys = tuple(tuple(int(v) for v in k) for k in state["keys"])
        self.bits = tuple(int(b) for b in state["bits"])
        if self.mixed is not None:
            c = state.get("error_model")
            self.mixed = MixedWidths(self.quantizers, self.budget, self.default, None if c is None else np.asarray(c))
