"""What one round shares with every part that runs it (:mod:`.fused`, :mod:`.stream`,
:mod:`.recovery`, :mod:`.refit`): its collectives' names, its seed domains, its byte counters and
the handshake's fields, each written once here."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from ..core.entropy import WIRES
from ..core.methods import get_method
from ..core.protocol import PREFIX, derive_seed, stable_hash
from ..core.quantizer import Quantizer
from ..core.rounds import RoundState
from . import topology
from .descriptor import Exchange
from .interfaces import Transport

#: Seed keys that keep draws of different kinds of encodes of one round apart (after the base seed,
#: rank and round): a fused round's buffer ``i`` draws with ``(i, ...)``, a streamed round's buffer
#: with ``(STREAM_KEY, i, ...)``, a tensor exchanged again on its own with ``(RECOVERY_KEY, slot)``.
RECOVERY_KEY = 1 << 40
STREAM_KEY = 1 << 41


@dataclass(frozen=True)
class RoundContext:
    """One round of one engine: ``epoch`` (its number, the same on every rank), ``exchange`` (the
    one in use), ``rank`` and the engine's settings at the round's start."""

    quantizer: Quantizer
    state: RoundState
    exchange: Exchange
    uid: str | None
    epoch: int
    seed: int
    rank: int
    fusion_bytes: int
    wire: str
    pipeline: int = 0  # coordinates per chunk of a pipelined buffer (:mod:`.pipeline`); 0: off

    # ---------------------------------------------------------------- names
    @property
    def prefix(self) -> str:
        return f"{PREFIX}.{self.uid}.{self.epoch}"

    def name(self, *parts: Any) -> Callable[[str], str]:
        """The namer of a job's collectives: ``<prefix>.<parts>.<tag>``."""
        head = ".".join([self.prefix, *map(str, parts)])
        return lambda tag: f"{head}.{tag}"

    # ---------------------------------------------------------------- seeds
    def round_seed(self, *keys: int) -> int:
        """A fused round's encode of ``keys`` (buffer, then the exchange's own keys)."""
        return derive_seed(self.seed, self.rank, self.epoch, *keys)

    def early_seed(self, i: int) -> Callable[..., int]:
        """Early buffer ``i``'s seeds: those it has in the round (it is the round's buffer ``i``)."""
        return lambda *keys: self.round_seed(i, *keys[1:])

    def stream_seed(self, index: int) -> Callable[..., int]:
        return lambda *keys: self.round_seed(STREAM_KEY, index, *keys)

    def recovery_seed(self, slot: int) -> int:
        return self.round_seed(RECOVERY_KEY, slot)

    # ---------------------------------------------------------------- counters
    def passed_handshake(self) -> None:
        """Every rank passed this round's handshake: the round counts (``step``)."""
        self.state.step += 1

    def count(self, job) -> None:
        """Add a finished job's bytes to the round state's counters."""
        st = self.state
        st.bytes_sent += job.sent
        st.bytes_received += job.received
        st.payload_bytes += job.encoded

    def feedback_for(self, idents, starts=None, numels=None) -> dict:
        """A :class:`~.job.Job`'s error-feedback fields: the buffers and what each of its tensors is
        (their errors' keys): ``idents``, one per tensor at ``starts`` of ``numels`` elements (a
        layout's), or (identity, start, numel) rows when ``starts`` is None."""
        fb = self.state.feedback
        if fb is None:
            return {}
        if idents is not None and starts is not None:
            if len(idents) != len(starts):
                raise ValueError(f"{self.prefix}: {len(idents)} tensor identities for {len(starts)} tensors")
            idents = list(zip(idents, starts, numels))
        return {"feedback": fb, "idents": None if idents is None else tuple(idents)}

    def collects(self) -> tuple[bool, bool]:
        """Whether this round collects statistics for the first and for the second quantizer (the
        second: the round after each refit of the first)."""
        st = self.state
        return st.collecting, self.exchange.requantizes and st.adapt_second and st.collecting_second

    # ---------------------------------------------------------------- the handshake
    def handshake_fields(self, collecting: bool, transport: Transport) -> dict:
        """The handshake fields every rank must share: settings, levels, round number, refit flag,
        and the node layout (ranks per node)."""
        q, st, auto = self.quantizer, self.state, self.state.auto
        return dict(
            method=get_method(q.method).id,
            bits=0 if auto else q.bits,
            local_size=topology.local_size(transport),
            budget=round(1000 * auto.budget) if auto else 0,
            bucket_size=q.bucket_size,
            norm=("l2", "linf").index(q.norm),
            exchange=self.exchange.wire_id,
            fusion_bytes=self.fusion_bytes,
            bits_second=0 if auto else st.second.bits,
            adapt_second=int(st.adapt_second),
            wire=WIRES.index(self.wire),
            error_feedback=int(st.feedback is not None),
            compress=int(st.compress == "when-faster"),
            precondition=int(st.precondition),
            levels=stable_hash(q.fingerprint, st.second.fingerprint, auto.fingerprint() if auto else 0),
            allocation=auto.allocation_hash() if auto else 0,
            round=self.epoch,
            collecting=int(collecting),
        )
