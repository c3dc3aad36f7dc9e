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
Streamed rounds (:meth:`Engine.open_stream`, the DDP hook, FSDP and mpi4py) are in :mod:`.stream`;
a refit outside any round (mpi4py's ``adapt()``) is :meth:`Engine.refit`.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from ..core.entropy import WIRES, check_wire
from ..core.methods import get_method
from ..core.protocol import (
    PREFIX,
    REFIT_FIELDS,
    STREAM_FIELDS,
    CollectiveTimeout,
    ProtocolError,
    ReductionMismatch,
    derive_seed,
    handshake_range,
    handshake_vector,
    read_handshake,
    read_tensor_vector,
    stable_hash,
    tensor_vector,
)
from ..core.quantizer import Quantizer
from ..core.rounds import RoundState
from ..core.statistics import statistics_length
from . import (
    allgather,
    hierarchical,
    hierarchical_two_phase,
    node_reduce_scatter,
    recovery,
    reduce_scatter,
    topology,
    two_phase,
)
from .driver import Started, run
from .entropy_wire import on_wire
from .interfaces import TensorOps, Transport
from .job import Decoded, Job, auto_rows, issue
from .layout import plan_layout
from .stream import StreamedRound

#: Exchanges by name; "auto" picks one by the rule of :func:`choose_exchange`.
EXCHANGES = {
    allgather.NAME: allgather,
    two_phase.NAME: two_phase,
    hierarchical.NAME: hierarchical,
    hierarchical_two_phase.NAME: hierarchical_two_phase,
}
EXCHANGE_CHOICES = (*EXCHANGES, "auto")
#: The exchanges of streamed rounds: also the reduce-scatter (FSDP2), whose result is one shard (the
#: order numbers them in the handshake).
STREAMED = {
    allgather.NAME: allgather,
    two_phase.NAME: two_phase,
    reduce_scatter.NAME: reduce_scatter,
    hierarchical.NAME: hierarchical,
    node_reduce_scatter.NAME: node_reduce_scatter,
    hierarchical_two_phase.NAME: hierarchical_two_phase,
}
#: The most collectives of one buffer (a front-end that pairs collectives by call order can pass
#: one transport this many times to :meth:`Engine.open_stream`).
MAX_STAGES = max(m.STAGES for m in STREAMED.values())
#: Fusion buffers hold this many bytes of float32 gradient by default (``fusion_bytes=``,
#: ``HOROVOD_ALQ_FUSION_BYTES``; 0: one buffer per tensor).
DEFAULT_FUSION_BYTES = 64 << 20
#: ``exchange="auto"`` uses the two-phase exchange from this many ranks on (docs/results/exchanges.md).
TWO_PHASE_FROM = 4


def resolve_fusion_bytes(value: int | None) -> int:
    """``fusion_bytes`` as given, else ``$HOROVOD_ALQ_FUSION_BYTES``, else 64 MiB; ValueError if bad."""
    source = "fusion_bytes"
    if value is None:
        env = os.environ.get("HOROVOD_ALQ_FUSION_BYTES")
        if env is None:
            return DEFAULT_FUSION_BYTES
        source = "HOROVOD_ALQ_FUSION_BYTES"
        try:
            value = int(env)
        except ValueError:
            raise ValueError(f"{source} must be a non-negative integer (bytes), got {env!r}") from None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ValueError(f"{source} must be a non-negative integer (bytes; 0 turns fusion off), got {value!r}")
    return int(value)


def check_exchange(exchange: str) -> str:
    if exchange not in EXCHANGE_CHOICES:
        raise ValueError(f"exchange must be one of {', '.join(map(repr, EXCHANGE_CHOICES))}, got {exchange!r}")
    return exchange


def choose_exchange(exchange: str, size: int, local_size: int | None = None) -> str:
    """The exchange in use for ``size`` ranks in nodes of ``local_size`` (None: one node). ``auto``:
    across several nodes of several ranks, a hierarchical exchange (exact inside the node), whose
    stage between nodes follows the flat rule applied to the nodes: the node sums allgathered below
    :data:`TWO_PHASE_FROM` nodes, a two-phase exchange of them from there on; otherwise two-phase
    from :data:`TWO_PHASE_FROM` ranks on, else allgather."""
    if exchange != "auto":
        return exchange
    if local_size is not None and 1 < local_size < size:
        return hierarchical_two_phase.NAME if size // local_size >= TWO_PHASE_FROM else hierarchical.NAME
    return two_phase.NAME if size >= TWO_PHASE_FROM else allgather.NAME


def requantizes(exchange: str) -> bool:
    """Whether ``exchange`` quantizes sums a second time (with the second quantizer)."""
    return getattr(STREAMED[exchange], "REQUANTIZES", False)


def exchange_for(exchange: str, transport: Transport) -> str:
    """:func:`choose_exchange` for ``transport``'s ranks and nodes."""
    return choose_exchange(exchange, transport.size, topology.local_size(transport))


@dataclass(eq=False)
class Entry:
    """One compressed tensor between ``compress`` and ``decompress``."""

    round: "_Round"
    slot: int
    flat: Any
    numel: int
    shape_code: int
    error: str | None = None
    done: bool = False
    abandoned: bool = False

    def abandon(self) -> None:
        """The framework dropped this exchange without decompressing it (it raised before)."""
        if not self.done:
            self.abandoned = True


@dataclass(eq=False)
class _Round:
    entries: list[Entry] = field(default_factory=list)
    result: Any = None
    failure: Exception | None = None
    prefix: str = ""
    epoch: int = 0
    recovery: dict = field(default_factory=dict)  # slot index -> allgather waiter or its result
    repeated: frozenset = frozenset()  # (numel, shape code) of tensors that share a shape
    early: list = field(default_factory=list)  # buffers started in add(), in order (base.Started)
    cut: tuple = (0, 0, 0)  # the fusion plan so far: (buffer start, stream end, first slot of the buffer)
    early_off: bool = False  # a tensor of this round stopped early starts (it carried an error)

    @property
    def started(self) -> bool:
        return self.result is not None or self.failure is not None

    def live(self) -> list[Entry]:
        return [e for e in self.entries if not e.abandoned]


@dataclass
class _Ordered:
    values: Decoded
    starts: dict  # live entry -> its start in the stream


class Engine:
    """Drives the rounds of one compressor.

    Parameters
    ----------
    quantizer : Quantizer
        The (first-phase) codec and its levels.
    state : RoundState
        Counters, schedule and checkpoint state (shared with the front-end's ``metrics``); its
        ``feedback`` (error buffers, :mod:`.feedback`) turns error feedback on.
    exchange : {"allgather", "two-phase", "auto"}
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
        collectives by name (Horovod); see :meth:`_start_early`.
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
    ) -> None:
        self.quantizer = quantizer
        self.state = state
        self.exchange = check_exchange(exchange)
        self.fusion_bytes = resolve_fusion_bytes(fusion_bytes)
        self.seed = int(seed)
        self.uid = uid
        self.early = early
        self.wire = check_wire(wire)
        self._round = _Round()
        self._kept: dict[str, tuple[Any, _Round]] = {}  # tag -> (buffer, the round that used it last)

    # ------------------------------------------------------------------ compress
    def add(
        self,
        flat: Any,
        numel: int,
        shape,
        dtype,
        transport: Transport,
        error: str | None = None,
        ops: TensorOps | None = None,
    ) -> tuple[Entry, np.ndarray]:
        """Record one tensor of the current round; returns its entry and tensor vector. With
        ``early`` (and ``ops``), a fusion buffer that this tensor closes starts its exchange."""
        rnd = self._round
        if rnd.started or (rnd.entries and not rnd.live()):
            rnd = self._round = _Round()
        code = _shape_code(shape, dtype)
        entry = Entry(rnd, len(rnd.entries), flat, int(numel), code, error)
        rnd.entries.append(entry)
        self.state.calls += 1
        vec = tensor_vector(transport.rank, transport.size, entry.slot, code, error is not None)
        rnd.early_off |= error is not None
        if self.early and ops is not None and not rnd.early_off:
            self._plan(rnd, entry, ops, self._on_wire(transport, ops))
        return entry, vec

    def _plan(self, rnd: _Round, entry: Entry, ops: TensorOps, transport: Transport) -> None:
        """Extend the round's fusion plan by ``entry`` exactly as :func:`.layout.plan_layout` cuts the
        whole round, and start the buffer it closes."""
        d = self.quantizer.bucket_size
        capacity = self.fusion_bytes // 4 if self.fusion_bytes else 0
        lo, pos, first = rnd.cut
        aligned = lo + -(-(pos - lo) // d) * d
        if pos > lo and (capacity == 0 or aligned + entry.numel - lo > capacity):
            self._start_early(rnd, rnd.entries[first : entry.slot], lo, ops, transport)
            lo = aligned = pos
            first = entry.slot
        rnd.cut = (lo, aligned + entry.numel, first)

    def _early_name(self, epoch: int, i: int) -> Callable[[str], str]:
        return lambda tag: f"{PREFIX}.{self.uid}.{epoch}.early{i}.{tag}"

    def _start_early(
        self, rnd: _Round, entries: list[Entry], offset: int, ops: TensorOps, transport: Transport
    ) -> None:
        """Quantize the complete buffer of ``entries`` (at ``offset`` of the round's stream) and issue
        its first collective, under a name of its own (``...early<i>``) with the seeds it would have
        in the round: a buffer's codes do not depend on when it starts. The handshake then tells
        every rank how many buffers each rank started; every rank completes, with an empty
        contribution, the ones another rank started, and only if every rank started the same
        buffers of the same round layout are their results used (:meth:`_run_round`)."""
        q, st = self.quantizer, self.state
        epoch, i, base, rank = st.step, len(rnd.early), self.seed, transport.rank
        exchange = exchange_for(self.exchange, transport)
        job = Job(
            [e.flat for e in entries],
            plan_layout([e.numel for e in entries], q.bucket_size, None),
            ops,
            transport,
            q,
            st.second,
            seed=lambda *keys: derive_seed(base, rank, epoch, i, *keys[1:]),
            name=self._early_name(epoch, i),
            collect_second=self._collects(exchange)[1],
            collect_first=self._collects(exchange)[0] and getattr(EXCHANGES[exchange], "OWN_FIRST_STATISTICS", False),
            widths=self._early_widths(rnd, entries),
            **self.feedback_for("early", i, tuple(e.numel for e in entries)),
        )
        steps = EXCHANGES[exchange].steps(job, 0)
        rnd.early.append(Started(job, steps, job.issue(next(steps)), offset))

    def _collects(self, exchange: str) -> tuple[bool, bool]:
        """Whether this round collects statistics for the first and for the second quantizer."""
        st = self.state
        # second quantizer: the round after each refit of the first
        return st.collecting, requantizes(exchange) and st.adapt_second and st.collecting_second

    # ------------------------------------------------------------------ decompress
    def pending(self) -> bool:
        """Whether a round has tensors that were compressed and not yet exchanged."""
        return not self._round.started and any(not e.done for e in self._round.live())

    def reset(self) -> None:
        """Drop the round in progress (its tensors will not be exchanged)."""
        self._round = _Round()

    def finish(self, entry: Entry, reduced: np.ndarray, ops: TensorOps, transport: Transport):
        """The reduced values of ``entry`` (float32, 1-D), scaled as the allreduce's op asks, and
        that scale (1 for Sum, 1/N for Average, times Horovod's pre- and postscale factors)."""
        if entry.done:
            raise RuntimeError(f"{PREFIX}: decompress called twice for the same compressed tensor")
        entry.done = True
        rnd = entry.round
        err = None
        try:
            info = read_tensor_vector(
                reduced,
                rank=transport.rank,
                size=transport.size,
                slot=entry.slot,
                shape_code=entry.shape_code,
                local_error=entry.error,
                scope=getattr(transport, "scope", ""),
            )
        except ProtocolError as exc:
            err = exc
        if not rnd.started and isinstance(err, ReductionMismatch):
            # some ranks of the set may not be in this collective at all (another process set,
            # hvd.join): a handshake over the set could wait for them forever. Every rank that
            # compressed this tensor received the same vector and stops here alike.
            rnd.failure = err
        if not rnd.started:
            try:
                self._run_round(rnd, ops, self._on_wire(transport, ops), None if err is None else str(err))
            except Exception as exc:
                rnd.failure = exc
                raise
        if err is not None:
            raise err
        if rnd.failure is not None:
            raise ProtocolError(f"{PREFIX}: the exchange of this round failed: {rnd.failure}")
        if isinstance(rnd.result, _Ordered) and any(s != entry.slot for s in info.slots):
            out = (
                recovery.recover(
                    rnd, entry, info.slots, self.quantizer, self.state, self.seed, ops, self._on_wire(transport, ops)
                )
                * info.scale
            )
        elif isinstance(rnd.result, _Ordered):
            start = rnd.result.starts[entry]
            out = rnd.result.values.read(start, start + entry.numel, info.scale)
        else:
            out = rnd.result.read(info.slots, entry.numel) * info.scale
        if (entry.numel, entry.shape_code) not in rnd.repeated:  # like tensors may still need it
            entry.flat = None
        return out, info.scale

    def _on_wire(self, transport: Transport, ops: TensorOps | None) -> Transport:
        return on_wire(transport, ops, self.wire, self.state)

    # ------------------------------------------------------------------ the round
    def _new_round(self) -> None:
        """A round passed its handshake: error buffers the last round did not use are dropped."""
        if self.state.feedback is not None:
            self.state.feedback.end_round()

    def feedback_for(self, *key) -> dict:
        """A :class:`~.job.Job`'s error-feedback fields: the buffers and ``key`` (what the job is)."""
        return {"feedback": self.state.feedback, "feedback_key": key} if self.state.feedback is not None else {}

    def _handshake_fields(self, exchange: str, epoch: int, collecting: bool, transport: Transport) -> dict:
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
            exchange=list(STREAMED).index(exchange),
            fusion_bytes=self.fusion_bytes,
            bits_second=0 if auto else st.second.bits,
            adapt_second=int(st.adapt_second),
            wire=WIRES.index(self.wire),
            error_feedback=int(self.state.feedback is not None),
            levels=stable_hash(q.fingerprint, st.second.fingerprint, auto.fingerprint() if auto else 0),
            allocation=auto.allocation_hash() if auto else 0,
            round=epoch,
            collecting=int(collecting),
        )

    def _widths(self, keys: Sequence) -> list[Quantizer] | None:
        """``bits="auto"``: the quantizer of each tensor of a round whose tensors are ``keys``."""
        auto = self.state.auto
        return None if auto is None else auto.quantizers_for(keys)

    def _early_widths(self, rnd: _Round, entries: list[Entry]) -> list[Quantizer] | None:
        """The widths of an early buffer's tensors: the allocation's if the round so far is its
        beginning (the round checks it once complete, :meth:`_run_round`), else the default."""
        auto = self.state.auto
        if auto is None:
            return None
        keys = [(e.numel, e.shape_code) for e in rnd.entries[: entries[-1].slot + 1]]
        return auto.quantizers_for(keys, entries[0].slot, whole=False)

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
        ``exchange``: one of :data:`STREAMED` instead of the engine's (FSDP2: "reduce-scatter").
        ``error``: this rank cannot take part (its message); ``elements``: the coordinates this rank
        will add, if known (checked to agree; 0: not announced); ``order``: a hash of its tensors in
        order, if known (checked to agree). Either raises :class:`ProtocolError` on every rank at the
        handshake. ``collect``: None, the refit schedule picks the rounds that collect statistics
        and ``close`` refits in them; True / False, this rank collects this round's statistics (or
        not) for the caller, ``close`` returns them (with ``bits="auto"``: a row per tensor of the
        round's ``keys``) and refits nothing (a front-end that refits on request, :meth:`refit`)."""
        q, st = self.quantizer, self.state
        transport = stages[0]
        epoch = st.step
        exchange = exchange_for(self.exchange, transport) if exchange is None else exchange
        if exchange not in STREAMED:
            raise ValueError(f"{PREFIX}: a streamed round's exchange is one of {', '.join(STREAMED)}, not {exchange!r}")
        module = STREAMED[exchange]
        if len(stages) < module.STAGES:
            raise ValueError(
                f"{PREFIX}: a streamed {exchange} round needs {module.STAGES} transports, got {len(stages)}"
            )
        if collect is None:
            collect_first, collect_second = self._collects(exchange)
        else:  # the caller's statistics stay local: the ranks need not agree on them
            collect_first = bool(collect) and get_method(q.method).adaptive
            collect_second = collect_first and requantizes(exchange) and st.adapt_second
        refit = collect is None and (collect_first or collect_second)
        prefix = f"{PREFIX}.{self.uid}.{epoch}"
        vec = handshake_vector(
            fields=STREAM_FIELDS,
            error=int(error is not None),
            min_size=int(min_size),
            elements=int(elements),
            order=int(order),
            **self._handshake_fields(exchange, epoch, refit, transport),
        )
        read_handshake(transport.allreduce_max(vec, f"{prefix}.handshake"), error, fields=STREAM_FIELDS)
        self._new_round()
        st.step += 1
        st.exchange = exchange
        return StreamedRound(
            self,
            ops,
            [self._on_wire(t, ops) for t in stages[: module.STAGES]],
            module,
            epoch=epoch,
            prefix=prefix,
            collect_first=collect_first,
            collect_second=collect_second,
            refit=refit,
        )

    def _run_round(self, rnd: _Round, ops: TensorOps, transport: Transport, local_error: str | None) -> None:
        q, st = self.quantizer, self.state
        live = rnd.live()
        epoch = st.step
        exchange = exchange_for(self.exchange, transport)
        collect_first, collect_second = self._collects(exchange)
        collecting = collect_first or collect_second
        order = tuple((e.numel, e.shape_code) for e in live)
        fields = dict(
            error=int(local_error is not None or any(e.error is not None for e in live)),
            **self._handshake_fields(exchange, epoch, collecting, transport),
            tensors=len(live),
            elements=sum(e.numel for e in live),
            contents=stable_hash(tuple(sorted(order))),
            order=stable_hash(order),
            early=len(rnd.early),
            early_ok=int(len(live) == len(rnd.entries)),
        )
        own = local_error or next((e.error for e in live if e.error), None)
        prefix = f"{PREFIX}.{self.uid}.{epoch}"
        reduced = transport.allreduce_max(handshake_vector(**fields), f"{prefix}.handshake")
        early = self._settle_early(rnd, reduced, ops, transport, exchange, epoch)
        widths = self._widths(order)
        if early and widths is not None:  # early buffers guessed the allocation from the round's beginning
            guessed = [q for s in rnd.early for q in s.job.widths]
            early = all(a is b for a, b in zip(guessed, widths))
        try:
            agreement = read_handshake(reduced, own)
        except ProtocolError:
            self._drain(rnd, reduced)
            raise
        if not early:
            self._drain(rnd, reduced)
        self._new_round()
        st.step += 1  # every rank passed the handshake: the round counts, whatever happens next
        # The same sequence of shapes gives every rank the same layout, so the fused exchange sums
        # slot k of every rank; a tensor that some rank put in another slot of the same shape
        # (ranks that swapped two like tensors: the handshake cannot see it) is found by its control
        # vector in finish() and exchanged again on its own (recovery.recover).
        ordered = agreement.ordered
        rnd.prefix, rnd.epoch = prefix, epoch
        rnd.repeated = frozenset(k for k in set(order) if order.count(k) > 1)

        capacity = self.fusion_bytes // 4 if self.fusion_bytes else 0
        layout = plan_layout([e.numel for e in live], q.bucket_size, capacity if ordered else None)
        job = Job(
            [e.flat for e in live],
            layout,
            ops,
            transport,
            q,
            st.second,
            seed=lambda *keys: derive_seed(self.seed, transport.rank, epoch, *keys),
            name=lambda tag: f"{prefix}.{tag}",
            collect_second=collect_second,
            collect_first=collect_first and getattr(EXCHANGES[exchange], "OWN_FIRST_STATISTICS", False),
            stream_buffer=lambda n: self._kept_buffer(rnd, "stream", n, ops),
            widths=widths if ordered else None,
            **self.feedback_for("round", layout.numels),
        )
        st.coordinates += sum(e.numel for e in live)
        started = {}
        if early:
            started = dict(enumerate(rnd.early))
            planned = [(s.offset, s.offset + s.job.layout.length) for s in rnd.early]
            if list(layout.buffers[: len(planned)]) != planned:  # the same on every rank: plans are deterministic
                raise AssertionError(f"{PREFIX}: early buffers {planned} are not the layout's {layout.buffers}")
        try:
            if ordered:
                values = run(job, EXCHANGES[exchange].steps, started)
                second_stats = job.second_statistics
                rnd.result = _Ordered(values, dict(zip(live, layout.starts)))
                st.exchange = exchange
            else:
                rnd.result = recovery.gather_unordered(job, live)
                second_stats = None
                st.exchange = allgather.NAME + " (unordered round)"
        finally:
            st.bytes_sent += job.sent
            st.bytes_received += job.received
            st.payload_bytes += job.encoded
        if collecting and st.auto is not None:
            if ordered:  # per-tensor rows line up on every rank only in ordered rounds
                self._refit_auto(job, order, prefix)
        elif collecting:
            self._refit(job, collect_first, second_stats, prefix)

    def _settle_early(
        self, rnd: _Round, reduced: np.ndarray, ops: TensorOps, transport: Transport, exchange: str, epoch: int
    ) -> bool:
        """After the handshake, before any of its checks: complete with empty contributions the
        early buffers that other ranks started and this one did not (so no rank waits for them),
        and say whether the early buffers' results may be used: every rank started the same number,
        no tensor left the round, and the ranks' layouts agree (same order)."""
        lo, hi = handshake_range(reduced, "early")
        for i in range(len(rnd.early), hi):
            request = EXCHANGES[exchange].empty_first(ops, transport.size)
            issue(transport, request, self._early_name(epoch, i)(request.tag))
        order = handshake_range(reduced, "order")
        return bool(rnd.early) and lo == hi and handshake_range(reduced, "early_ok")[0] == 1 and order[0] == order[1]

    def _drain(self, rnd: _Round, reduced: np.ndarray) -> None:
        """Wait for the early buffers whose results are not used (their collectives complete: every
        rank issued them), so that the transport lets go of them; none where the ranks disagree on
        the round or the exchange (their names differ: such collectives never complete)."""
        early, rnd.early = rnd.early, []
        if early and self.state.feedback is not None:  # their errors were never applied
            self.state.feedback.forget("early")
        if not early or any(len(set(handshake_range(reduced, f))) > 1 for f in ("round", "exchange")):
            return
        for s in early:
            try:
                s.wait()
            except Exception:  # noqa: BLE001 - the round fails on its own terms
                pass

    def _kept_buffer(self, rnd: _Round, tag: str, n: int, ops: TensorOps):
        """A float32 vector of ``n`` for this round's ``tag``, with stale contents: the one of the
        last round that used ``tag`` once each of that round's tensors was decompressed (nobody
        reads it any more), else a new one. A fresh 100 MB vector costs its page faults on every
        round (docs/results/bench_step.md); the streams of refit rounds and of codecs that cannot encode
        tensors in place use it."""
        held = self._kept.get(tag)
        if held is not None:
            buf, owner = held
            if int(buf.shape[0]) == n and all(e.done or e.abandoned for e in owner.entries):
                self._kept[tag] = (buf, rnd)
                return buf
        buf = ops.zeros(n)
        self._kept[tag] = (buf, rnd)
        return buf

    def _refit(self, job: Job, collect_first: bool, second_stats: np.ndarray | None, prefix: str) -> None:
        """One allreduce of the round's statistics (both quantizers'), then every rank refits alike."""
        k = statistics_length(get_method(job.first.method))
        first = second = None
        if job.collect_first:  # the exchange collected the statistics of what it quantized
            first = np.zeros(k) if job.first_statistics is None else job.first_statistics
        elif collect_first:
            first = sum(
                (job.ops.statistics(job.stream[lo:hi], job.first) for lo, hi in job.layout.buffers), np.zeros(k)
            )
        if job.collect_second:
            second = np.zeros(k) if second_stats is None else second_stats
        self.refit_from(first, second, job.transport, f"{prefix}.statistics")

    def _refit_auto(self, job: Job, keys: tuple, prefix: str) -> None:
        self.refit_auto(auto_rows(self.state.auto, job.ops, job.parts), keys, job.transport, f"{prefix}.statistics")

    def refit_auto(self, rows: Sequence[np.ndarray], keys: Sequence, transport: Transport, name: str) -> None:
        """``bits="auto"``: one allreduce of every tensor's row (errors per width, statistics; the
        same tensors on every rank), then every rank allocates the widths and refits the levels
        alike (:meth:`~horovod_alq.core.auto_bits.AutoBits.refit`)."""
        auto, st = self.state.auto, self.state
        mine = np.stack(rows)
        total = transport.allreduce_sum(mine.ravel(), name).reshape(mine.shape)
        auto.refit(total, [k[0] for k in keys], keys)
        st.refitted_first()
        st.level_updates += 1

    def refit_from(self, first: np.ndarray | None, second: np.ndarray | None, transport: Transport, name: str) -> bool:
        """Sum this rank's statistics of the first quantizer (None: zeros) and, when ``second`` is
        given, of the second, over the ranks (one allreduce), then refit both alike on every rank.
        Returns whether any levels changed (False: no rank saw a finite non-zero bucket)."""
        st, q = self.state, self.quantizer
        k = statistics_length(get_method(q.method))
        parts = [np.zeros(k) if first is None else np.asarray(first, dtype=np.float64)]
        if second is not None:
            parts.append(np.asarray(second, dtype=np.float64))
        total = transport.allreduce_sum(np.concatenate(parts), name)
        updated = False
        if total[0] > 0:
            q.adapt(total[:k])
            st.refitted_first()
            updated = True
        if second is not None and total[k] > 0:
            st.second.adapt(total[k:])
            updated = True
        st.level_updates += int(updated)
        return updated

    def refit(
        self,
        first: np.ndarray | None,
        second: np.ndarray | None,
        transport: Transport,
        *,
        error: str | None = None,
        keys: Sequence = (),
    ) -> bool:
        """A refit outside any round, for front-ends that refit on request (mpi4py's ``adapt()``).

        A handshake of :data:`~horovod_alq.core.protocol.REFIT_FIELDS` (settings, levels, round,
        ``error``, this rank's reason not to refit, and the hash of ``keys``: :class:`ProtocolError`
        on every rank), then for adaptive methods :meth:`refit_from` (``first``: this rank's
        statistics since the last refit, ``second``: its two-phase owner statistics of reduced
        shards; None: nothing recorded) or, with ``bits="auto"``, :meth:`refit_auto` (``first``:
        this rank's rows of the tensors ``keys``, the same on every rank), then a second handshake
        that every rank fitted and reached the same levels and allocation; if not, every rank
        restores its previous state and raises :class:`RefitError`. Returns whether levels changed.
        """
        q, st, auto = self.quantizer, self.state, self.state.auto
        exchange = exchange_for(self.exchange, transport)
        prefix = f"{PREFIX}.{self.uid}.{st.step}.refit"
        recorded = stable_hash(tuple(map(tuple, keys))) if auto is not None and len(keys) else 0
        self._agree(transport, f"{prefix}.handshake", exchange, error, recorded)
        if not get_method(q.method).adaptive:
            return False
        if not (requantizes(exchange) and st.adapt_second):
            second = None  # nothing to refit it from (the same on every rank: the settings agree)
        elif second is None:
            second = np.zeros(statistics_length(get_method(q.method)))
        previous = (
            q.state_dict(),
            st.second.state_dict(),
            st.level_updates,
            None if auto is None else auto.state_dict(),
        )
        try:
            if auto is None:
                updated = self.refit_from(first, second, transport, f"{prefix}.statistics")
            else:
                updated = self._refit_recorded(first, keys, transport, f"{prefix}.statistics")
            failure = None
        except CollectiveTimeout:
            raise
        except Exception as exc:  # noqa: BLE001 - the check below makes it every rank's
            updated, failure = False, f"{type(exc).__name__}: {exc}"
        try:
            self._agree(transport, f"{prefix}.check", exchange, failure, recorded)
        except ProtocolError as exc:
            q.load_state_dict(previous[0])
            st.second.load_state_dict(previous[1])
            st.level_updates = previous[2]
            if auto is not None:
                auto.load_state_dict(previous[3])
            if isinstance(exc, CollectiveTimeout):
                raise
            raise RefitError(
                f"{PREFIX}: the refit failed on some rank or the ranks reached different levels "
                f"from the same statistics (do all ranks run the same NumPy and SciPy?); previous "
                f"levels restored: {exc}"
            ) from None
        return updated

    def _refit_recorded(self, rows: np.ndarray | None, keys: Sequence, transport: Transport, name: str) -> bool:
        """``bits="auto"`` in :meth:`refit`: :meth:`refit_auto` from this rank's ``rows`` of the tensors
        ``keys`` (none recorded on any rank: nothing to fit); whether the levels or allocation changed."""
        if not len(keys):
            return False
        auto = self.state.auto
        rows = np.asarray(rows, dtype=np.float64)
        if rows.shape[0] != len(keys):
            raise ValueError(f"{len(rows)} rows recorded for {len(keys)} tensors")
        before = auto.fingerprint()
        self.refit_auto(list(rows), keys, transport, name)
        return auto.fingerprint() != before

    def _agree(self, transport: Transport, name: str, exchange: str, error: str | None, recorded: int = 0) -> None:
        vec = handshake_vector(
            fields=REFIT_FIELDS,
            error=int(error is not None),
            recorded=recorded,
            **self._handshake_fields(exchange, self.state.step, True, transport),
        )
        read_handshake(transport.allreduce_max(vec, name), error, fields=REFIT_FIELDS)


def blame(
    transport: Transport,
    error: str | None,
    elements: Any,
    prefix: str,
    what: str,
    differ: str = "the ranks passed arrays with different element counts",
) -> str | None:
    """After a handshake that failed alike on every rank: every rank's local ``error`` and
    ``elements`` (a count, or any JSON value the ranks must agree on; two more collectives, on this
    path only), as a message naming the ranks at fault (``what`` and their errors, or ``differ``
    and every rank's ``elements``); None when no rank reported an error and ``elements`` agree."""
    raw = np.frombuffer(json.dumps([error, elements]).encode(), dtype=np.uint8)
    n = int(transport.allreduce_max(np.array([raw.size], dtype=np.int64), f"{prefix}.messages.size")[0])
    buf = np.zeros(n, dtype=np.uint8)
    buf[: raw.size] = raw
    got = transport.allgather(buf, [n] * transport.size, f"{prefix}.messages")()
    shared = [json.loads(bytes(got[r * n : (r + 1) * n]).rstrip(b"\0").decode()) for r in range(transport.size)]
    failed = [f"rank {r}: {m}" for r, (m, _) in enumerate(shared) if m is not None]
    if failed:
        return f"{what} " + "; ".join(failed)
    if len({json.dumps(e) for _, e in shared}) > 1:
        counts = ", ".join(f"rank {r}: {e}" for r, (_, e) in enumerate(shared))
        return f"{differ} ({counts})"
    return None


class RefitError(ProtocolError):
    """:meth:`Engine.refit` failed after the statistics were combined (raised on every rank)."""


def _shape_code(shape, dtype) -> int:
    from ..core.protocol import shape_hash

    return shape_hash(tuple(shape), str(dtype))
