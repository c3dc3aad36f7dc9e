"""Rounds, fusion and the protocol around one exchange: what every front-end's compressor runs.

A *round* is a run of ``compress`` calls (:meth:`Engine.add`) followed by their ``decompress``
calls (:meth:`Engine.finish`); with ``hvd.DistributedOptimizer`` it is one optimizer step, with a
plain ``hvd.allreduce`` one call. ``compress`` records the tensor and returns the tensor vector of
:mod:`horovod_alq.core.protocol` for the framework's allreduce; with ``early`` (the Horovod
compressors' ``overlap=True``) it also starts the exchange of each fusion buffer that this tensor
completes (under a name of its own), so those payloads travel during the backward pass. The first
``decompress`` of the round runs, on every rank alike, the handshake, the exchange of the round's
other buffers (continuing the early ones) and (in refit rounds) one allreduce of the statistics
and the refit; every ``decompress`` then takes its tensor from the result, from each rank where
that rank put it.

Why that is safe: a round whose ranks disagree (different orders, a tensor one rank passes
uncompressed, an error Horovod raised on every rank before ``decompress``) must never leave a rank
waiting in a collective that another rank does not issue, or pair payloads of different tensors.
Early buffers are only ever *waited for* after the handshake, which tells every rank how many
buffers each rank started: every rank first completes, with empty contributions, those it did not
start, and the early results are used only if every rank started the same buffers of one layout;
otherwise they are drained and the round runs as if none had started. A buffer's codes do not
depend on whether it started early (same seeds), so neither do the results. A round that ends
before its handshake (the control vector shows another op or process set, or ``hvd.join``)
leaves early collectives that some rank may never complete; nothing waits for them.
The engine is a facade over four parts: the exchanges and the rule that picks one
(:mod:`.registry`), Horovod's fused round (:mod:`.fused`) beside the streamed round of the DDP hook,
FSDP2 and mpi4py (:mod:`.stream`), the refits both call (:mod:`.refit`), and what a round shares
with them, its names, seeds and counters (:mod:`.context`).
"""

from __future__ import annotations

import os
from typing import Sequence

import numpy as np

from ..core.entropy import check_wire
from ..core.handshake import STREAM_FIELDS, handshake_vector, read_handshake
from ..core.methods import get_method
from ..core.protocol import PREFIX, shape_hash, tensor_vector
from ..core.quantizer import Quantizer
from ..core.rounds import RoundState
from . import registry
from .context import RoundContext
from .entropy_wire import on_wire
from .fused import Entry, FusedRound, KeptBuffers
from .interfaces import TensorOps, Transport
from .refit import RefitError, Refitter
from .stream import StreamedRound

__all__ = [
    "DEFAULT_FUSION_BYTES",
    "DEFAULT_PIPELINE_BYTES",
    "Engine",
    "Entry",
    "RefitError",
    "resolve_fusion_bytes",
    "resolve_pipeline_bytes",
]

#: Fusion buffers hold this many bytes of float32 gradient by default (``fusion_bytes=``,
#: ``HOROVOD_ALQ_FUSION_BYTES``; 0: one buffer per tensor).
DEFAULT_FUSION_BYTES = 64 << 20


#: A fusion buffer of more than this many bytes of float32 gradient is exchanged in chunks of about
#: this size, pipelined (:mod:`.pipeline`; ``pipeline_bytes=``, ``HOROVOD_ALQ_PIPELINE_BYTES``; 0: off).
#: Off by default: no run has measured it faster yet (docs/results/bench_train_step.md#pipeline).
DEFAULT_PIPELINE_BYTES = 0


def resolve_pipeline_bytes(value: int | None) -> int:
    """``pipeline_bytes`` as given, else ``$HOROVOD_ALQ_PIPELINE_BYTES``, else 0 (off); ValueError if bad."""
    return _resolve_bytes(value, "pipeline_bytes", "HOROVOD_ALQ_PIPELINE_BYTES", DEFAULT_PIPELINE_BYTES, "pipelining")


def resolve_fusion_bytes(value: int | None) -> int:
    """``fusion_bytes`` as given, else ``$HOROVOD_ALQ_FUSION_BYTES``, else 64 MiB; ValueError if bad."""
    return _resolve_bytes(value, "fusion_bytes", "HOROVOD_ALQ_FUSION_BYTES", DEFAULT_FUSION_BYTES, "fusion")


def _resolve_bytes(value: int | None, source: str, variable: str, default: int, what: str) -> int:
    if value is None:
        env = os.environ.get(variable)
        if env is None:
            return default
        source = variable
        try:
            value = int(env)
        except ValueError:
            raise ValueError(f"{source} must be a non-negative integer (bytes), got {env!r}") from None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ValueError(f"{source} must be a non-negative integer (bytes; 0 turns {what} off), got {value!r}")
    return int(value)


class Engine:
    """Drives the rounds of one compressor.

    Parameters
    ----------
    quantizer : Quantizer
        The (first-phase) codec and its levels.
    state : RoundState
        Counters, schedule and checkpoint state (shared with the front-end's ``metrics``); its
        ``feedback`` (error buffers, :mod:`.feedback`) turns error feedback on.
    exchange : str
        One of :func:`.registry.choices` ("auto": :func:`.registry.choose_exchange`).
    fusion_bytes : int
        Bytes of float32 gradient per fusion buffer; 0: one buffer per tensor.
    seed : int
        Base of every encode's seed (mixed with rank, round, buffer, shard and phase).
    uid : str, optional
        Part of every collective's name; must be the same on every rank for this compressor (the
        Horovod compressors set it at first use, :func:`horovod_alq.core.protocol.first_use_uid`).
    wire : {"fixed", "entropy"}
        How payloads travel (:mod:`.entropy_wire`).
    early : bool
        Start a fusion buffer's exchange in :meth:`add`, as soon as the buffer is complete (a later
        tensor does not fit in it), instead of at the round's first :meth:`finish`: its payloads
        travel while the framework still computes the next gradients. For transports that pair
        collectives by name (Horovod).
    pipeline_bytes : int, optional
        A fused round's buffer of more than this many bytes of float32 travels in chunks of about
        this size, each encoded and decoded while another travels (:mod:`.pipeline`; the same
        results); None: ``$HOROVOD_ALQ_PIPELINE_BYTES``, else 0: off.
    """

    def __init__(
        self,
        quantizer: Quantizer,
        state: RoundState,
        *,
        exchange: str = "auto",
        fusion_bytes: int = DEFAULT_FUSION_BYTES,
        seed: int = 0,
        uid: str | None = "0",
        early: bool = False,
        wire: str = "fixed",
        pipeline_bytes: int | None = None,
    ) -> None:
        self.quantizer = quantizer
        self.state = state
        self.exchange = registry.check_exchange(exchange)
        self.fusion_bytes = resolve_fusion_bytes(fusion_bytes)
        self.pipeline_bytes = resolve_pipeline_bytes(pipeline_bytes)
        self.seed = int(seed)
        self.uid = uid
        self.early = early
        self.wire = check_wire(wire)
        self.refitter = Refitter(quantizer, state)
        self._kept = KeptBuffers()
        self._round = self._fresh()

    def _fresh(self) -> FusedRound:
        return FusedRound(self.refitter, self._kept)

    def _context(self, transport: Transport, exchange: str | None = None) -> RoundContext:
        """The context of a round over ``transport`` now (``exchange``: instead of the chosen one)."""
        name = registry.exchange_for(self.exchange, transport) if exchange is None else exchange
        return RoundContext(
            self.quantizer,
            self.state,
            registry.get(name),
            self.uid,
            self.state.step,
            self.seed,
            transport.rank,
            self.fusion_bytes,
            self.wire,
            self.pipeline_bytes // 4,
        )

    def _on_wire(self, transport: Transport, ops: TensorOps | None) -> Transport:
        return on_wire(transport, ops, self.wire, self.state)

    # ------------------------------------------------------------------ Horovod's fused rounds
    def add(
        self,
        flat,
        numel: int,
        shape,
        dtype,
        transport: Transport,
        error: str | None = None,
        ops: TensorOps | None = None,
        ident=None,
        scale=None,
    ) -> tuple[Entry, np.ndarray]:
        """Record one tensor of the current round; returns its entry and tensor vector. With
        ``early`` (and ``ops``), a fusion buffer that this tensor closes starts its exchange.
        ``ident``: what the tensor is (a parameter's name, or another identity stable across
        rounds), the key of its error-feedback buffer; required with ``error_feedback``: without
        it the tensor's round fails on every rank (``error``). ``scale`` (precondition=): ``w`` of
        ``flat`` (as long as it): the round quantizes ``flat * w`` (formed inside the encode where
        the ops can) and :meth:`finish` returns the reduced values divided by ``w``."""
        if self.state.feedback is not None and ident is None and error is None:
            error = (
                f"{PREFIX}: error_feedback=True keeps each tensor's error under its identity, and this tensor "
                f"(shape {tuple(shape)}) has none: give the Horovod collective a name= (the same at every call "
                "for this tensor), or the model's named_parameters to the compressor"
            )
        rnd = self._round
        if rnd.started or (rnd.entries and not rnd.live()):
            rnd = self._round = self._fresh()
        code = shape_hash(tuple(shape), str(dtype))
        entry = Entry(rnd, len(rnd.entries), flat, int(numel), code, error, ident, scale=scale)
        rnd.entries.append(entry)
        self.state.calls += 1
        vec = tensor_vector(transport.rank, transport.size, entry.slot, code, error is not None)
        rnd.early_off |= error is not None
        if self.early and ops is not None and not rnd.early_off:
            wired = self._on_wire(transport, ops)
            rnd.plan_early(self._context(wired), entry, ops, wired)
        return entry, vec

    def finish(self, entry: Entry, reduced: np.ndarray, ops: TensorOps, transport: Transport):
        """The reduced values of ``entry`` (float32, 1-D), scaled as the allreduce's op asks, and
        that scale (1 for Sum, 1/N for Average, times Horovod's pre- and postscale factors)."""
        wired = self._on_wire(transport, ops)
        return entry.round.finish(self._context(wired), entry, reduced, ops, wired)

    def pending(self) -> bool:
        """Whether a round has tensors that were compressed and not yet exchanged."""
        return not self._round.started and any(not e.done for e in self._round.live())

    def reset(self) -> None:
        """Drop the round in progress (its tensors will not be exchanged)."""
        self._round = self._fresh()

    # ------------------------------------------------------------------ streamed rounds
    def open_stream(
        self,
        ops: TensorOps,
        stages: Sequence[Transport],
        *,
        min_size: int = 0,
        exchange: str | None = None,
        error: str | None = None,
        elements: int = 0,
        order: int = 0,
        collect: bool | None = None,
    ) -> StreamedRound:
        """Start a streamed round (:mod:`.stream`, for front-ends whose transport pairs collectives
        by call order and whose framework hands every rank the same tensors in the same order):
        the handshake on ``stages[0]``, then a round that takes buffers one by one. ``stages``:
        one transport per collective of a buffer (two-phase: 2), each pairing its own collectives.
        ``exchange``: a registered exchange instead of the engine's (FSDP2: a reduce-scatter).
        ``error``: this rank cannot take part (its message); ``elements``: the coordinates this rank
        will add, if known (checked to agree; 0: not announced); ``order``: a hash of its tensors in
        order, if known (checked to agree). Either raises :class:`ProtocolError` on every rank at the
        handshake. ``collect``: None, the refit schedule picks the rounds that collect statistics
        and ``close`` refits in them; True / False, this rank collects this round's statistics (or
        not) for the caller, ``close`` returns them (with ``bits="auto"``: a row per tensor of the
        round's ``keys``) and refits nothing (a front-end that refits on request, :meth:`refit`)."""
        q, st = self.quantizer, self.state
        transport = stages[0]
        ctx = self._context(transport, exchange)
        ex = ctx.exchange
        if len(stages) < ex.stages:
            raise ValueError(f"{PREFIX}: a streamed {ex.name} round needs {ex.stages} transports, got {len(stages)}")
        if collect is None:
            collect_first, collect_second = ctx.collects()
        else:  # the caller's statistics stay local: the ranks need not agree on them
            collect_first = bool(collect) and get_method(q.method).adaptive
            collect_second = collect_first and ex.requantizes and st.adapt_second
        refit = collect is None and (collect_first or collect_second)
        vec = handshake_vector(
            fields=STREAM_FIELDS,
            error=int(error is not None),
            min_size=int(min_size),
            elements=int(elements),
            order=int(order),
            **ctx.handshake_fields(refit, transport),
        )
        read_handshake(transport.allreduce_max(vec, ctx.name()("handshake")), error, fields=STREAM_FIELDS)
        ctx.passed_handshake()
        st.exchange = ex.name
        return StreamedRound(
            ctx,
            self.refitter,
            ops,
            [self._on_wire(t, ops) for t in stages[: ex.stages]],
            collect_first=collect_first,
            collect_second=collect_second,
            refit=refit,
        )

    # ------------------------------------------------------------------ refits on request
    def refit(
        self,
        first: np.ndarray | None,
        second: np.ndarray | None,
        transport: Transport,
        *,
        error: str | None = None,
        keys: Sequence = (),
    ) -> bool:
        """A refit outside any round, for front-ends that refit on request (mpi4py's ``adapt()``):
        :meth:`.refit.Refitter.on_request` with this engine's handshake fields."""
        ctx = self._context(transport)
        return self.refitter.on_request(
            first,
            second,
            transport,
            fields=ctx.handshake_fields(True, transport),
            requantizes=ctx.exchange.requantizes,
            prefix=ctx.name()("refit"),
            error=error,
            keys=keys,
        )

    # ------------------------------------------------------------------ 16-bit rounds (compress="when-faster")
    def sixteen_stats(self) -> list | None:
        """The statistics list of a 16-bit round: ``[]`` in refit rounds, so the levels keep adapting
        (fixed widths: ``bits="auto"`` keeps its levels), else None."""
        return [] if self.state.collecting and self.state.auto is None else None

    def end_sixteen(self, stats: list | None, transport: Transport) -> None:
        """A 16-bit round's end: in refit rounds every rank refits from the statistics of its own
        inputs (small collectives); the round counts, so the refit schedule goes on. Error-feedback
        buffers are left for the next quantized round."""
        if stats is not None:
            self.refit(sum(stats) if stats else None, None, transport)
        self.state.step += 1
