"""``compress="when-faster"``: quantize only while that is faster than the framework's own 16-bit path.

A :class:`SpeedArbiter` decides, at the start of every round and alike on every rank, whether the
round is quantized or goes through the framework's 16-bit allreduce (the front-end runs either).
It times the real training step: from the start of one round to the start of the next, that is
from one optimizer step to the next. The schedule (defaults in brackets):

- ``warmup`` (2) quantized rounds: the first rounds' one-off costs (the first refit, buffers, the
  framework's first negotiations) stay out of the timings (in the studies' runs only the first
  step is slower: docs/results/compress_when_faster.md).
- A *trial*: units of ``block`` (2) rounds per block in the order quantized, 16-bit, 16-bit,
  quantized (the order cancels a linear drift), every round carrying the real gradients. Not
  counted: the trial's first round and every round that changes path (it pays the switch). After
  each unit each rank takes the median of its counted steps per path so far and the share of
  (quantized, 16-bit) pairs of them where the quantized step is shorter; one MAX allreduce gives
  every rank the slowest rank's medians and the smallest share. The trial ends when the medians
  differ by at least ``sure`` (10%) and the share agrees (at least ``pairs``, 75%, for quantized;
  at most 25% for 16 bits), or after ``units`` (3) units. Every rank then quantizes only if the
  quantized step is at least ``margin`` (3%) shorter and the share at least ``pairs``: a tie, or a
  difference the noise does not confirm, goes to the framework's own path. A clear difference
  costs one unit (8 rounds, 4 on the slower path); a close one, where either path costs about the
  same, up to 3.
- A confirming trial at round ``confirm`` (100), when the first rounds' effects are past, then a
  trial every ``recheck`` (2000) rounds; every ``watch`` (50) rounds one more small MAX allreduce
  compares the median step since the last check with the chosen path's trial time, and a change by
  more than ``drift`` (25%) starts a trial at once.

Every collective's vector carries the round number: ranks that count rounds differently raise
:class:`~horovod_alq.core.protocol.ProtocolError` on every rank.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Callable

import numpy as np

from .protocol import PREFIX, ProtocolError

__all__ = ["COMPRESS_MODES", "SpeedArbiter", "resolve_compress", "speed_metrics"]

logger = logging.getLogger("horovod_alq")

#: The values of the ``compress`` setting.
COMPRESS_MODES = ("auto", "when-faster", "always")
#: The environment variable that gives ``compress`` when the setting is None.
COMPRESS_ENV = "HOROVOD_ALQ_COMPRESS"
QUANTIZED, SIXTEEN = "quantized", "16-bit"

#: Trial order of the blocks: True quantized, False 16-bit.
PATTERN = (True, False, False, True)


def check_compress(value) -> None:
    """ValueError unless ``value`` is None or one of :data:`COMPRESS_MODES`."""
    if value is not None and value not in COMPRESS_MODES:
        raise ValueError(f"compress must be one of {', '.join(map(repr, COMPRESS_MODES))} (or None), got {value!r}")


def resolve_compress(value: str | None, measures: bool, environ=None) -> str:
    """The mode a front-end runs: ``"always"`` or ``"when-faster"``. ``value`` None: ``$HOROVOD_ALQ_COMPRESS``,
    else ``"auto"``; ``"auto"``: ``"when-faster"`` where the front-end ``measures``, else ``"always"``."""
    import os

    env = os.environ if environ is None else environ
    source = "compress"
    if not measures and value in (None, "auto"):
        return "always"  # the environment's default is for the front-ends that measure
    if value is None:
        value, source = env.get(COMPRESS_ENV, "auto"), COMPRESS_ENV
    if value not in COMPRESS_MODES:
        raise ValueError(f"{source} must be one of {', '.join(map(repr, COMPRESS_MODES))}, got {value!r}")
    if value == "auto":
        return "when-faster" if measures else "always"
    if value == "when-faster" and not measures:
        raise ValueError(f"{source}='when-faster' is not served by this front-end: use compress='always'")
    return value


class SpeedArbiter:
    """The round-by-round choice of ``compress="when-faster"`` (module docstring).

    ``clock``: seconds, monotonic (tests inject one); ``rank``: this rank in the set (rank 0 logs
    each change); ``what``: how the log line names the front-end. ``warmup``, ``block``, ``units``,
    ``confirm`` (None: no confirming trial), ``watch``, ``recheck`` count rounds; ``sure``,
    ``drift`` and ``margin`` (how much shorter a quantized step must be) are relative; ``pairs``:
    the share of step pairs in which the quantized one must be shorter."""

    def __init__(
        self,
        *,
        rank: int = 0,
        what: str = "",
        clock: Callable[[], float] = time.perf_counter,
        warmup: int = 2,
        block: int = 2,
        units: int = 3,
        sure: float = 0.1,
        confirm: int | None = 100,
        watch: int = 50,
        recheck: int = 2000,
        drift: float = 0.25,
        margin: float = 0.03,
        pairs: float = 0.75,
    ) -> None:
        if (
            block < 2
            or warmup < 0
            or units < 1
            or not 0 <= sure < 1
            or watch < 1
            or recheck < 1
            or not drift > 0
            or not 0 <= margin < 1
            or not 0.5 <= pairs <= 1
        ):
            raise ValueError(
                "SpeedArbiter: block >= 2, warmup >= 0, units >= 1, 0 <= sure < 1, watch >= 1, recheck >= 1, "
                "drift > 0, 0 <= margin < 1, 0.5 <= pairs <= 1"
            )
        self.margin, self.sure, self.units, self.pairs = margin, sure, units, pairs
        self.rank, self.what, self.clock = rank, what, clock
        self.warmup, self.block, self.watch, self.recheck, self.drift = warmup, block, watch, recheck, drift
        self.confirm = confirm
        self.round = 0  # rounds started
        self.quantizing = True  # the choice (what rounds outside trials do)
        self.current = True  # whether the round in progress is quantized
        self.times = {QUANTIZED: math.nan, SIXTEEN: math.nan}  # the last trial's step times (slowest rank), s
        self.shorter = math.nan  # the last trial's share of pairs with the quantized step shorter (smallest)
        self.trials = self.changes = self.rounds_16bit = self.trial_rounds = 0
        self._plan: list[tuple[bool, bool]] = []  # (quantized, counted) of the coming rounds of the unit
        self._units = 0  # units of the trial in progress so far (0: no trial in progress)
        self._samples: dict[bool, list[float]] = {True: [], False: []}
        self._window: list[float] = []  # step times since the last drift check
        self._last: tuple[float, bool, str] | None = None  # (start, quantized, "trial"/"watch"/"") of the round
        self._next_trial = warmup
        self._next_watch: int | None = None  # None: no trial yet

    # ------------------------------------------------------------------ the round
    def start(self, agree: Callable[[np.ndarray, str], np.ndarray], name: str) -> bool:
        """Call at the start of every round, on every rank: whether this round is quantized.
        ``agree(vec, name)``: the MAX allreduce of a small int64 vector over the set (called on
        every rank at the same rounds); ``name``: the collectives' name prefix."""
        now = self.clock()
        if self._last is not None:
            begun, quantized, kind = self._last
            if kind == "trial":
                self._samples[quantized].append(now - begun)
            elif kind == "watch":
                self._window.append(now - begun)
        r = self.round
        if not self._plan and self._units:  # a unit of the trial ended: decide, or one more unit
            self._unit_ended(agree, f"{name}.trial.{r}")
        elif not self._plan and self._next_watch is not None and r >= self._next_watch:
            self._check_drift(agree, f"{name}.watch.{r}")
        if not self._plan and not self._units and r >= self._next_trial:
            self._unit()
        if self._plan:
            quantized, counted = self._plan.pop(0)
            kind = "trial" if counted else ""
            self.trial_rounds += 1
        else:
            quantized, kind = self.quantizing, ("watch" if self._next_watch is not None else "")
        self._last = (now, quantized, kind)
        self.round += 1
        self.current = quantized
        self.rounds_16bit += not quantized
        return quantized

    def _unit(self) -> None:
        """Plan the trial's next unit: the trial's first round and each round that changes path
        are not counted."""
        first, previous = not self._units, self.current
        self._plan = []
        for q in (q for q in PATTERN for _ in range(self.block)):
            self._plan.append((q, not first and q == previous))
            first, previous = False, q
        self._units += 1

    # ------------------------------------------------------------------ decisions
    def _agree(self, agree, values_us: list[int], name: str) -> np.ndarray:
        """MAX over the ranks of ``[round, -round, *values]``; ProtocolError on every rank if rounds differ."""
        vec = np.array([self.round, -self.round, *values_us], dtype=np.int64)
        out = np.asarray(agree(vec, name), dtype=np.int64)
        if out[0] != -out[1]:
            raise ProtocolError(
                f"{PREFIX}: compress='when-faster': the ranks are at different rounds ({-out[1]} to {out[0]}); "
                "every rank must run the same rounds with this compressor"
            )
        return out[2:]

    def _unit_ended(self, agree, name: str) -> None:
        """The slowest rank's medians so far and the smallest share of pairs with the quantized step
        shorter: the trial goes on unless both say the same clearly or it ran ``units`` units (every
        rank alike: the same agreed values, the same count)."""
        q, h = self._samples[True], self._samples[False]
        share = np.mean([(a < b) + 0.5 * (a == b) for a in q for b in h]) if q and h else 0.5
        mine = [_us(np.median(q)) if q else 0, _us(np.median(h)) if h else 0, -int(round(1000 * share))]
        out = self._agree(agree, mine, name)
        t_q, t_16, shorter = float(out[0]) * 1e-6, float(out[1]) * 1e-6, float(-out[2]) / 1000
        quantized = t_q <= (1 - self.sure) * t_16 and shorter >= self.pairs
        sixteen = t_16 <= (1 - self.sure) * t_q and shorter <= 1 - self.pairs
        if self._units < self.units and not (quantized or sixteen):
            self._unit()
            return
        self._decide(t_q, t_16, shorter)

    def _decide(self, t_q: float, t_16: float, shorter: float) -> None:
        self._samples, self._units = {True: [], False: []}, 0
        self.times, self.shorter = {QUANTIZED: t_q, SIXTEEN: t_16}, shorter
        self.trials += 1
        choice = t_q <= (1 - self.margin) * t_16 and shorter >= self.pairs
        if choice != self.quantizing:
            self.changes += 1
            if self.rank == 0:
                logger.warning(
                    "%s%s: compress='when-faster' now sends %s (step %.1f ms quantized, %.1f ms 16-bit, "
                    "quantized shorter in %.0f%% of pairs, round %d)",
                    PREFIX,
                    f" ({self.what})" if self.what else "",
                    "quantized codes" if choice else "16 bits",
                    1e3 * t_q,
                    1e3 * t_16,
                    100 * shorter,
                    self.round,
                )
        self.quantizing = choice
        confirming = self.confirm is not None and self.round <= self.confirm
        self._next_trial = self.confirm if confirming else self.round + self.recheck
        self._next_watch = self.round + self.watch
        self._window = []

    def _check_drift(self, agree, name: str) -> None:
        mine = _us(np.median(self._window)) if self._window else 0
        (slowest,) = self._agree(agree, [mine], name)
        self._window = []
        self._next_watch = self.round + self.watch
        chosen = self.times[QUANTIZED if self.quantizing else SIXTEEN]
        if slowest > 0 and chosen > 0 and abs(slowest * 1e-6 / chosen - 1) > self.drift:
            self._next_trial = self.round  # the step time moved: measure again now


def speed_metrics(arbiter: SpeedArbiter | None) -> dict:
    """The ``metrics()`` keys of ``compress``: ``compress_choice`` ("quantized" or "16-bit"),
    ``step_time_quantized`` and ``step_time_16bit`` (the last trial's, the slowest rank's, seconds;
    NaN before the first trial and with ``compress="always"``, ``arbiter`` None), ``compress_trials``,
    ``compress_changes``, ``rounds_16bit``."""
    a = arbiter
    return {
        "compress_choice": QUANTIZED if a is None or a.quantizing else SIXTEEN,
        "step_time_quantized": math.nan if a is None else a.times[QUANTIZED],
        "step_time_16bit": math.nan if a is None else a.times[SIXTEEN],
        "compress_trials": 0 if a is None else a.trials,
        "compress_changes": 0 if a is None else a.changes,
        "rounds_16bit": 0 if a is None else a.rounds_16bit,
    }


def _us(seconds: float) -> int:
    return max(0, min(int(round(float(seconds) * 1e6)), 1 << 61))
