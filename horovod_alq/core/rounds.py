"""Round bookkeeping shared by every front-end: the refit schedule, the quantizers whose levels
the rounds refit, the counters behind ``metrics()`` and one ``state_dict`` schema.

Horovod's compressor interface passes no step, name or rank, so steps are inferred: a *round*
runs from the first ``compress`` to the first ``decompress`` after it (``horovod_alq.exchange``);
``step`` counts the rounds whose exchange ran. Every rank sees the same rounds and the same
reduced statistics, so every rank refits identically.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, Sequence

from .auto_bits import AutoBits
from .methods import get_method
from .quantizer import Quantizer
from .speed import speed_metrics

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


#: The counters of :class:`RoundState`, in the order of its ``metrics`` and ``state_dict``.
COUNTERS = (
    "step",
    "level_updates",
    "calls",
    "payload_bytes",
    "coordinates",
    "uncompressed_coordinates",
    "bytes_sent",
    "bytes_received",
    "recovered",
    "wire_fixed_bytes",
    "wire_coded_bytes",
)


@dataclass
class RoundState:
    """Per-compressor state: the quantizers (``quantizer`` for the ranks' own codes, ``second`` for
    the re-quantized sums of the two-phase exchange), the schedule, counters and metrics."""

    quantizer: Quantizer
    schedule: RefitSchedule = field(default_factory=RefitSchedule)
    second: Quantizer | None = None
    adapt_second: bool | None = None  # None: adapt only when the second quantizer has other bits
    step: int = 0  # rounds whose exchange ran
    level_updates: int = 0
    calls: int = 0  # compress calls of compressed tensors
    payload_bytes: int = 0  # this rank's own encoded payloads (headers included)
    coordinates: int = 0
    uncompressed_coordinates: int = 0
    bytes_sent: int = 0  # payload bytes this rank put on the wire (all phases, headers included)
    bytes_received: int = 0
    recovered: int = 0  # tensors re-exchanged alone: ranks had put them in different slots of one shape
    wire_fixed_bytes: int = 0  # wire="entropy": what this rank's collectives would have sent on the fixed wire
    wire_coded_bytes: int = 0  # ... and what they sent (frames)
    exchange: str | None = None  # the exchange used by the last round
    auto: AutoBits | None = None  # bits="auto": a quantizer per width and the allocation
    feedback: Any = None  # error_feedback=True: the error buffers (exchange.feedback.ErrorFeedback)
    compress: str = "always"  # the compress mode the front-end runs ("always", "when-faster"): in the handshake
    speed: Any = None  # compress="when-faster": the front-end's SpeedArbiter (core.speed)
    precondition: int = 0  # the digest of this round's preconditioning scales (0: off; core.precondition)
    preconditioned: bool = False  # the last round quantized g * w with some w other than the identity
    refit_at: int = -1  # a round outside the schedule that collects for a refit (after preconditioning began)

    def __post_init__(self) -> None:
        if self.second is None:
            q = self.quantizer
            self.second = Quantizer(q.method, bits=q.bits, bucket_size=q.bucket_size, norm=q.norm)
        if self.adapt_second is None:
            self.adapt_second = self.second.bits != self.quantizer.bits
        self.adapt_second = bool(self.adapt_second)

    @property
    def collecting(self) -> bool:
        """Whether the next round gathers statistics for a refit of the (first) quantizer."""
        return get_method(self.quantizer.method).adaptive and self._collects(self.step)

    def _collects(self, step: int) -> bool:
        return self.schedule.collects(step) or step == self.refit_at

    @property
    def collecting_second(self) -> bool:
        """Whether the next round gathers statistics of the reduced sums for the second quantizer:
        the round *after* each refit of the first, so that the sums are made with its new levels
        (docs/results/variance_training.md#variance_two_phase: sums made with the old levels fit
        worse than no refit)."""
        return (
            self.adapt_second
            and get_method(self.quantizer.method).adaptive
            and self.step > 0
            and self._collects(self.step - 1)
        )

    def precondition_round(self, digest: int, active: bool, refit: int | None = 0) -> None:
        """Record this round's preconditioning: the digest of its scales (the handshake's field) and
        whether any scale departs from the identity. ``refit`` rounds after the round where it starts
        (Adam's first step leaves no second moment: round 0 quantizes ``g``; ``Form.refit``; None:
        never) a round collects statistics for a refit outside the schedule, so that the levels fit
        to ``g`` are not kept for ``g * w`` until the next scheduled refit. Every rank decides alike:
        the scales agree (the digest), ranks count rounds alike, and the refit flag is in the
        handshake; ``state_dict`` keeps the planned round."""
        self.precondition = int(digest)
        if active and not self.preconditioned and refit is not None:
            self.refit_at = self.step + int(refit)
        self.preconditioned = bool(active)

    @property
    def follows_first(self) -> bool:
        """Whether the second quantizer takes the first one's levels at every refit (same bits,
        ``adapt_second`` off: the default, the best of the measured choices at equal bits)."""
        return not self.adapt_second and self.second.bits == self.quantizer.bits

    def refitted_first(self) -> None:
        """Call after every refit of the first quantizer: a following second quantizer copies it."""
        if self.follows_first:
            self.second.set_levels(self.quantizer.levels)

    def metrics(self) -> dict:
        out = {
            "levels": self.quantizer.levels,
            "multiplier": self.quantizer.multiplier,
            "second_levels": self.second.levels,
            "exchange": self.exchange,
        }
        out.update({key: getattr(self, key) for key in COUNTERS})
        out["bits_per_coordinate"] = 8.0 * self.payload_bytes / self.coordinates if self.coordinates else float("nan")
        out["error_feedback_bytes"] = self.feedback.nbytes if self.feedback is not None else 0
        out.update(speed_metrics(self.speed))
        if self.auto is not None:
            a = self.auto
            used = a.quantizers if a.mixed is not None else sorted(set(a.bits) | {a.default})
            out.update(
                bit_budget=a.budget,
                bits_per=a.bits_per,
                allocation=list(a.bits),
                allocated_mean_bits=a.mean_bits(),
                default_bits=a.default,
                width_levels={w: a.quantizers[w].levels for w in used},
            )
        return out

    def state_dict(self) -> dict:
        out = {"quantizer": self.quantizer.state_dict(), "second": self.second.state_dict()}
        out.update({key: getattr(self, key) for key in COUNTERS})
        if self.auto is not None:
            out["auto"] = self.auto.state_dict()
        if self.feedback is not None:
            out["error_feedback"] = self.feedback.state_dict()
        if self.preconditioned or self.refit_at >= 0:
            out["precondition"] = {"preconditioned": self.preconditioned, "refit_at": self.refit_at}
        return out

    def load_state_dict(self, state: dict) -> None:
        """Restore a :meth:`state_dict`; states saved before the two-phase exchange (no ``second``,
        ``bytes_*``) load with the second quantizer's initial levels and zero byte counters."""
        if (state.get("auto") is None) != (self.auto is None):
            raise ValueError(
                "state was saved with bits="
                + ("'auto'" if state.get("auto") is not None else "fixed")
                + ", this compressor has bits="
                + ("'auto'" if self.auto is not None else "fixed")
            )
        if self.auto is not None:
            self.auto.load_state_dict(state["auto"])
        self.quantizer.load_state_dict(state["quantizer"])
        if state.get("second") is not None:
            self.second.load_state_dict(state["second"])
        for key in COUNTERS:
            setattr(self, key, int(state.get(key, 0)))
        pre = state.get("precondition") or {}  # absent: saved before preconditioning began (or before it existed)
        self.preconditioned, self.refit_at = bool(pre.get("preconditioned", False)), int(pre.get("refit_at", -1))
        saved = state.get("error_feedback")
        if saved is not None and self.feedback is None:
            raise ValueError(
                "state was saved with error_feedback=True (it holds error buffers), this compressor has "
                "error_feedback=False: build it with error_feedback=True, or drop the state's 'error_feedback'"
            )
        if self.feedback is not None:
            if saved is None:
                warnings.warn(
                    "horovod_alq: the state was saved without error buffers (error_feedback=False); "
                    "error feedback starts from zero",
                    stacklevel=3,
                )
                self.feedback.load_state_dict({"buffers": []})
            else:
                self.feedback.load_state_dict(saved)


def schedule_from(update_steps: Sequence[int] | None, update_every: int | None) -> RefitSchedule:
    """Build a :class:`RefitSchedule` from the compressors' keywords (None: the defaults)."""
    return RefitSchedule(
        DEFAULT_UPDATE_STEPS if update_steps is None else tuple(update_steps),
        DEFAULT_UPDATE_EVERY if update_every is None else update_every,
    )
