"""Bookkeeping shared by the framework compressors: exchange rounds, the refit schedule,
statistics accumulated across a round, metrics and checkpoint state.

Horovod's compressor interface passes no step, name or rank, so steps are inferred: a *round*
runs from the first ``compress`` while no exchange is outstanding until every exchange begun in
it has been decompressed. With ``hvd.DistributedOptimizer`` a round is one optimizer step (all
hooks compress, then ``synchronize`` decompresses); with a plain ``hvd.allreduce`` it is one call.
Every rank sees the same rounds, slots and reduced statistics, so every rank refits identically.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from .methods import get_method
from .quantizer import Quantizer

#: Rounds after which the levels are refit, as in the paper's runs (iterations 0, 100, 2000) ...
DEFAULT_UPDATE_STEPS = (0, 100, 2000)
#: ... and then every this many rounds.
DEFAULT_UPDATE_EVERY = 10_000


@dataclass(frozen=True)
class RefitSchedule:
    """Statistics are gathered in round ``t`` when ``t`` is in ``steps`` or, past the last of
    them, a multiple of ``every`` (0 disables the period); the new levels apply from round ``t+1``."""

    steps: tuple[int, ...] = DEFAULT_UPDATE_STEPS
    every: int = DEFAULT_UPDATE_EVERY

    def __post_init__(self) -> None:
        steps = tuple(int(s) for s in self.steps)
        if any(s < 0 for s in steps):
            raise ValueError(f"update_steps must be non-negative round numbers, got {self.steps!r}")
        if isinstance(self.every, bool) or int(self.every) != self.every or self.every < 0:
            raise ValueError(f"update_every must be a non-negative integer (0: never), got {self.every!r}")
        object.__setattr__(self, "steps", tuple(sorted(set(steps))))
        object.__setattr__(self, "every", int(self.every))

    def collects(self, step: int) -> bool:
        if step in self.steps:
            return True
        last = self.steps[-1] if self.steps else -1
        return self.every > 0 and step > last and step % self.every == 0


@dataclass
class RoundState:
    """Per-compressor state: the quantizer (levels), round counters, pending statistics, metrics."""

    quantizer: Quantizer
    schedule: RefitSchedule = field(default_factory=RefitSchedule)
    step: int = 0  # completed rounds
    level_updates: int = 0
    payload_bytes: int = 0
    coordinates: int = 0
    uncompressed_coordinates: int = 0
    calls: int = 0  # compress calls ever made: seeds the per-call randomness
    _outstanding: int = 0
    _slot: int = 0
    _pending: list = field(default_factory=list)

    @property
    def collecting(self) -> bool:
        """Whether the current (or next) round gathers statistics for a refit."""
        return get_method(self.quantizer.method).adaptive and self.schedule.collects(self.step)

    def begin(self, numel: int, payload_bytes: int) -> int:
        """Register one compressed exchange; returns its slot ``k`` in the round."""
        if self._outstanding == 0:
            self._slot = 0
        k = self._slot
        self._slot += 1
        self._outstanding += 1
        self.calls += 1
        self.coordinates += int(numel)
        self.payload_bytes += int(payload_bytes)
        return k

    def end(self, k: int, stats: np.ndarray | None) -> None:
        """Finish the exchange in slot ``k`` with its reduced statistics (or None)."""
        if self._outstanding <= 0:
            raise RuntimeError("decompress called without a matching compress")
        if stats is not None:
            self._pending.append((k, np.asarray(stats, dtype=np.float64)))
        self._outstanding -= 1
        if self._outstanding == 0:
            self._close_round()

    def _close_round(self) -> None:
        if self._pending and self.collecting:
            self._pending.sort(key=lambda item: item[0])
            total = np.sum([s for _, s in self._pending], axis=0)
            self.quantizer.adapt(total)
            self.level_updates += 1
        self._pending.clear()
        self.step += 1

    def metrics(self) -> dict:
        return {
            "levels": self.quantizer.levels,
            "multiplier": self.quantizer.multiplier,
            "level_updates": self.level_updates,
            "step": self.step,
            "payload_bytes": self.payload_bytes,
            "coordinates": self.coordinates,
            "uncompressed_coordinates": self.uncompressed_coordinates,
            "bits_per_coordinate": 8.0 * self.payload_bytes / self.coordinates if self.coordinates else float("nan"),
        }

    def state_dict(self) -> dict:
        if self._outstanding:
            raise RuntimeError("state_dict() during an exchange: call it between optimizer steps")
        return {
            "quantizer": self.quantizer.state_dict(),
            "step": self.step,
            "level_updates": self.level_updates,
            "calls": self.calls,
            "payload_bytes": self.payload_bytes,
            "coordinates": self.coordinates,
            "uncompressed_coordinates": self.uncompressed_coordinates,
        }

    def load_state_dict(self, state: dict) -> None:
        if self._outstanding:
            raise RuntimeError("load_state_dict() during an exchange: call it between optimizer steps")
        self.quantizer.load_state_dict(state["quantizer"])
        for key in ("step", "level_updates", "calls", "payload_bytes", "coordinates", "uncompressed_coordinates"):
            setattr(self, key, int(state[key]))


def schedule_from(update_steps: Sequence[int] | None, update_every: int | None) -> RefitSchedule:
    """Build a :class:`RefitSchedule` from the compressors' keywords (None: the defaults)."""
    return RefitSchedule(
        DEFAULT_UPDATE_STEPS if update_steps is None else tuple(update_steps),
        DEFAULT_UPDATE_EVERY if update_every is None else update_every,
    )
