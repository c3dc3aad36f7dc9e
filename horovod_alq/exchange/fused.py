"""Horovod's round: a run of ``compress`` calls, then their ``decompress`` calls, fused into buffers.

:class:`FusedRound` holds one such round (:meth:`.engine.Engine.add` records its tensors,
:meth:`.engine.Engine.finish` runs it at the first ``decompress``); the module docstring of
:mod:`.engine` says why its early starts, handshake and recovery are safe. :class:`KeptBuffers`
lends rounds their large scratch vectors from one round to the next.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..core.handshake import handshake_range, handshake_vector, read_handshake
from ..core.protocol import PREFIX, ProtocolError, ReductionMismatch, read_tensor_vector, stable_hash
from ..core.quantizer import Quantizer
from . import carrier, recovery
from .context import RoundContext
from .driver import Started, run
from .interfaces import TensorOps, Transport
from .job import Decoded, Deferred, Job, issue
from .layout import Layout, plan_layout
from .refit import Refitter


@dataclass(eq=False)
class Entry:
    """One compressed tensor between ``compress`` and ``decompress``."""

    round: "FusedRound"
    slot: int
    flat: Any
    numel: int
    shape_code: int
    error: str | None = None
    ident: object = None  # error_feedback: what the tensor is (its errors' key), from the front-end
    scale: Any = None  # precondition=: w, the round quantizes flat * w and finish divides by it
    done: bool = False
    abandoned: bool = False

    def abandon(self) -> None:
        """The framework dropped this exchange without decompressing it (it raised before)."""
        if not self.done:
            self.abandoned = True


def _chunk(ctx: RoundContext, ops: TensorOps) -> int:
    """Coordinates per chunk of the round's pipelined buffers (:mod:`.pipeline`): the engine's, where
    the ops encode ranges; 0 otherwise. A handshake field: every rank must cut its buffers alike."""
    return ctx.pipeline if getattr(ops, "encodes_ranges", False) else 0


def _scales(entries: list[Entry]) -> list | None:
    """The Job's ``scales`` of ``entries`` (precondition=): None if none has one, else each one's
    ``w`` (ones for those without)."""
    if all(e.scale is None for e in entries):
        return None
    return [e.flat.new_ones(e.numel, dtype=e.scale.dtype) if e.scale is None else e.scale for e in entries]


@dataclass
class _Ordered:
    values: Decoded
    starts: dict  # live entry -> its start in the stream


class KeptBuffers:
    """Float32 scratch vectors kept across rounds: a fresh 100 MB vector costs its page faults on
    every round (docs/results/training_steps.md#bench_step)."""

    def __init__(self) -> None:
        self._kept: dict[str, tuple[Any, FusedRound]] = {}  # tag -> (buffer, the round that used it last)

    def get(self, rnd: "FusedRound", tag: str, n: int, ops: TensorOps):
        """A vector of ``n`` for ``rnd``'s ``tag``, with stale contents: the one of the last round
        that used ``tag`` once each of that round's tensors was decompressed (nobody reads it any
        more), else a new one."""
        held = self._kept.get(tag)
        if held is not None:
            buf, owner = held
            if int(buf.shape[0]) == n and all(e.done or e.abandoned for e in owner.entries):
                self._kept[tag] = (buf, rnd)
                return buf
        buf = ops.zeros(n)
        self._kept[tag] = (buf, rnd)
        return buf


@dataclass(eq=False)
class FusedRound:
    """The tensors of one round, its early buffers and, once run, its result or failure."""

    refitter: Refitter
    kept: KeptBuffers
    entries: list[Entry] = field(default_factory=list)
    result: Any = None
    failure: Exception | None = None
    ctx: RoundContext | None = None  # the context it ran in
    recovery: dict = field(default_factory=dict)  # slot index -> allgather waiter or its result
    repeated: frozenset = frozenset()  # (numel, shape code) of tensors that share a shape
    early: list = field(default_factory=list)  # buffers started in add(), in order (driver.Started)
    cut: tuple = (0, 0, 0)  # the fusion plan so far: (buffer start, stream end, first slot of the buffer)
    early_off: bool = False  # a tensor of this round stopped early starts (it carried an error)

    @property
    def started(self) -> bool:
        return self.result is not None or self.failure is not None

    def live(self) -> list[Entry]:
        return [e for e in self.entries if not e.abandoned]

    # ------------------------------------------------------------------ compress
    def plan_early(self, ctx: RoundContext, entry: Entry, ops: TensorOps, transport: Transport) -> None:
        """Extend the fusion plan by ``entry`` exactly as :func:`.layout.plan_layout` cuts the whole
        round, and start the buffer it closes."""
        d = ctx.quantizer.bucket_size
        capacity = ctx.fusion_bytes // 4 if ctx.fusion_bytes else 0
        lo, pos, first = self.cut
        aligned = lo + -(-(pos - lo) // d) * d
        if pos > lo and (capacity == 0 or aligned + entry.numel - lo > capacity):
            self._start_early(ctx, self.entries[first : entry.slot], lo, ops, transport)
            lo = aligned = pos
            first = entry.slot
        self.cut = (lo, aligned + entry.numel, first)

    def _start_early(
        self, ctx: RoundContext, entries: list[Entry], offset: int, ops: TensorOps, transport: Transport
    ) -> None:
        """Quantize the complete buffer of ``entries`` (at ``offset`` of the round's stream) and issue
        its first collective, under a name of its own (``...early<i>``) with the seeds it would have
        in the round: a buffer's codes do not depend on when it starts. The handshake then tells
        every rank how many buffers each rank started; every rank completes, with an empty
        contribution, the ones another rank started, and only if every rank started the same
        buffers of the same round layout are their results used (:meth:`run`)."""
        i = len(self.early)
        collect_first, collect_second = ctx.collects()
        job = Job(
            [e.flat for e in entries],
            plan_layout([e.numel for e in entries], ctx.quantizer.bucket_size, None),
            ops,
            transport,
            ctx.quantizer,
            ctx.state.second,
            seed=ctx.early_seed(i),
            name=ctx.name(f"early{i}"),
            collect_second=collect_second,
            collect_first=collect_first and ctx.exchange.own_first_statistics,
            widths=self._early_widths(ctx, entries),
            scales=_scales(entries),
            **self._feedback(ctx, entries, None),
        )
        steps = ctx.exchange.steps(job, 0)
        self.early.append(Started(job, steps, job.issue(next(steps)), offset))

    @staticmethod
    def _feedback(ctx: RoundContext, entries: list[Entry], layout: Layout | None) -> dict:
        """A job's error-feedback fields: its tensors' identities at their starts (``layout``'s, or
        an early buffer's own, back to back on bucket boundaries as :func:`plan_layout` lays them)."""
        if ctx.state.feedback is None:
            return {}
        if layout is None:
            layout = plan_layout([e.numel for e in entries], ctx.quantizer.bucket_size, None)
        return ctx.feedback_for([e.ident for e in entries], layout.starts, layout.numels)

    def _early_widths(self, ctx: RoundContext, entries: list[Entry]) -> list[Quantizer] | None:
        """The widths of an early buffer's tensors: the allocation's if the round so far is its
        beginning (the round checks it once complete, :meth:`run`), else the default."""
        auto = ctx.state.auto
        if auto is None:
            return None
        keys = [(e.numel, e.shape_code) for e in self.entries[: entries[-1].slot + 1]]
        return auto.quantizers_for(keys, entries[0].slot, whole=False)

    # ------------------------------------------------------------------ decompress
    def finish(self, ctx: RoundContext, entry: Entry, reduced: np.ndarray, ops: TensorOps, transport: Transport):
        """:meth:`.engine.Engine.finish` for ``entry`` of this round: ``(values, scale)``."""
        if entry.done:
            raise RuntimeError(f"{PREFIX}: decompress called twice for the same compressed tensor")
        entry.done = True
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
        if not self.started and isinstance(err, ReductionMismatch):
            # some ranks of the set may not be in this collective at all (another process set,
            # hvd.join): a handshake over the set could wait for them forever. Every rank that
            # compressed this tensor received the same vector and stops here alike.
            self.failure = err
        if not self.started:
            try:
                self.run(ctx, ops, transport, None if err is None else str(err))
            except Exception as exc:
                self.failure = exc
                raise
        if err is not None:
            raise err
        if self.failure is not None:
            raise ProtocolError(f"{PREFIX}: the exchange of this round failed: {self.failure}")
        if isinstance(self.result, _Ordered) and any(s != entry.slot for s in info.slots):
            out = recovery.recover(self, entry, info.slots, ops, transport) * info.scale
        elif isinstance(self.result, _Ordered):
            start = self.result.starts[entry]
            out = self.result.values.read(start, start + entry.numel, info.scale, divide=entry.scale)
        else:
            out = self.result.read(info.slots, entry.numel) * info.scale
        if entry.scale is not None and (
            not isinstance(self.result, _Ordered) or any(s != entry.slot for s in info.slots)
        ):
            out = out / entry.scale
        if (entry.numel, entry.shape_code) not in self.repeated:  # like tensors may still need it
            entry.flat = None
        return out, info.scale

    def run(self, ctx: RoundContext, ops: TensorOps, transport: Transport, local_error: str | None) -> None:
        """The handshake (carried with the first buffer's first collective where the transport
        allows it, :mod:`.carrier`), the exchange of every buffer (continuing the early ones) and
        the refit."""
        st, q = ctx.state, ctx.quantizer
        live = self.live()
        collect_first, collect_second = ctx.collects()
        collecting = collect_first or collect_second
        order = tuple((e.numel, e.shape_code) for e in live)
        own = local_error or next((e.error for e in live if e.error), None)
        widths = None if st.auto is None else st.auto.quantizers_for(order)
        capacity = ctx.fusion_bytes // 4 if ctx.fusion_bytes else 0
        jobs = (ctx, ops, transport, live, widths, collect_first, collect_second)
        carrying, carried = carrier.carries(transport), None
        if carrying and own is None:
            try:
                carried = self._carried(plan_layout([e.numel for e in live], q.bucket_size, capacity), jobs)
            except Exception as exc:  # noqa: BLE001 - every rank learns it from the handshake
                own = f"{PREFIX}: rank {transport.rank} could not start the round's exchange: {exc!r}"
        fields = dict(
            error=int(own is not None or local_error is not None or any(e.error is not None for e in live)),
            **ctx.handshake_fields(collecting, transport),
            tensors=len(live),
            elements=sum(e.numel for e in live),
            contents=stable_hash(tuple(sorted(order))),
            order=stable_hash(order),
            early=len(self.early),
            early_ok=int(len(live) == len(self.entries)),
            pipeline=_chunk(ctx, ops),
        )
        vec, name, index = handshake_vector(**fields), ctx.name()("handshake"), len(self.early)
        if carrying:
            raw = getattr(transport, "inner", transport)  # the carrier itself is not on the entropy wire
            got = carrier.carry(raw, ops, vec, -1 if carried is None else index, carried and carried[2], name)
            reduced = got.reduced
        else:
            got, reduced = None, transport.allreduce_max(vec, name)
        early = self._settle_early(ctx, reduced, ops, transport)
        if early and widths is not None:  # early buffers guessed the allocation from the round's beginning
            guessed = [q for s in self.early for q in s.job.widths]
            early = all(a is b for a, b in zip(guessed, widths))
        try:
            agreement = read_handshake(reduced, own)
        except ProtocolError:
            self._drain(ctx, reduced)
            raise
        if not early:
            self._drain(ctx, reduced)
        ctx.passed_handshake()  # the round counts, whatever happens next
        # The same sequence of shapes gives every rank the same layout, so the fused exchange sums
        # slot k of every rank; a tensor that some rank put in another slot of the same shape
        # (ranks that swapped two like tensors: the handshake cannot see it) is found by its control
        # vector in finish() and exchanged again on its own (recovery.recover).
        ordered = agreement.ordered
        self.ctx = ctx
        self.repeated = frozenset(k for k in set(order) if order.count(k) > 1)

        # every rank carried the same buffer of the same (ordered) layout: its first collective is done
        use = got is not None and got.index >= 0 and ordered and (index == 0 or early)
        if use:  # (a pipelined buffer's first chunk was started, not waited for: its steps take a wait)
            wait = (lambda: lambda: got.result) if carried[3] else (lambda: got.result)
            job, started = carried[0], {index: Started(carried[0], carried[1], wait, 0)}
        else:
            if carried is not None:
                carried[1].close()
            layout = plan_layout([e.numel for e in live], q.bucket_size, capacity if ordered else None)
            job, started = self._job(layout, ordered, *jobs), {}
        layout = job.layout
        st.coordinates += sum(e.numel for e in live)
        if early:
            started.update(enumerate(self.early))
            planned = [(s.offset, s.offset + s.job.layout.length) for s in self.early]
            if list(layout.buffers[: len(planned)]) != planned:  # the same on every rank: plans are deterministic
                raise AssertionError(f"{PREFIX}: early buffers {planned} are not the layout's {layout.buffers}")
        try:
            if ordered:
                values = run(job, ctx.exchange.steps, started)
                second_stats = job.second_statistics
                self.result = _Ordered(values, dict(zip(live, layout.starts)))
                st.exchange = ctx.exchange.name
            else:
                self.result = recovery.gather_unordered(job, live)
                second_stats = None
                st.exchange = "allgather (unordered round)"
        finally:
            ctx.count(job)
        done = {id(j): j for j in [job, *(s.job for s in started.values())]}
        for j in done.values():  # only now: the exchange succeeded
            j.commit_feedback()
        name = ctx.name()("statistics")
        if collecting and st.auto is not None:
            if ordered:  # per-tensor rows line up on every rank only in ordered rounds
                self.refitter.after_auto_job(job, order, name)
        elif collecting:
            self.refitter.after_job(job, collect_first, second_stats, name)

    def _job(self, layout, ordered, ctx, ops, transport, live, widths, collect_first, collect_second) -> Job:
        """The round's job over ``layout`` (``ordered``: every rank laid the round out alike)."""
        st = ctx.state
        return Job(
            [e.flat for e in live],
            layout,
            ops,
            transport,
            ctx.quantizer,
            st.second,
            seed=ctx.round_seed,
            name=ctx.name(),
            collect_second=collect_second,
            collect_first=collect_first and ctx.exchange.own_first_statistics,
            stream_buffer=lambda n: self.kept.get(self, "stream", n, ops),
            widths=widths if ordered else None,
            scales=_scales(live),
            chunk=_chunk(ctx, ops),
            **self._feedback(ctx, live, layout),
        )

    def _carried(self, layout: Layout, jobs: tuple):
        """Before the handshake, assuming the ranks agree: the round's job over ``layout``, the
        steps of its first buffer not started early and that buffer's first collective, to carry
        with the handshake (:mod:`.carrier`); None where there is none or it is too large, or the
        transport is wrapped (the entropy wire codes its payloads itself)."""
        transport = jobs[2]
        k = len(self.early)
        planned = [(s.offset, s.offset + s.job.layout.length) for s in self.early]
        if hasattr(transport, "inner") or k >= len(layout.buffers) or list(layout.buffers[:k]) != planned:
            return None
        job = self._job(layout, True, *jobs)
        steps = jobs[0].exchange.steps(job, k)
        request = next(steps)
        deferred = isinstance(request, Deferred)  # a pipelined buffer's first chunk (:mod:`.pipeline`)
        request = request.request if deferred else request
        if not carrier.small(request, transport.size):
            steps.close()
            return None
        job.count(request)
        return job, steps, request, deferred

    def _settle_early(self, ctx: RoundContext, reduced: np.ndarray, ops: TensorOps, transport: Transport) -> bool:
        """After the handshake, before any of its checks: complete with empty contributions the
        early buffers that other ranks started and this one did not (so no rank waits for them),
        and say whether the early buffers' results may be used: every rank started the same number,
        no tensor left the round, and the ranks' layouts agree (same order)."""
        lo, hi = handshake_range(reduced, "early")
        for i in range(len(self.early), hi):
            request = ctx.exchange.empty_first(ops, transport.size)
            issue(transport, request, ctx.name(f"early{i}")(request.tag))
        order = handshake_range(reduced, "order")
        return bool(self.early) and lo == hi and handshake_range(reduced, "early_ok")[0] == 1 and order[0] == order[1]

    def _drain(self, ctx: RoundContext, reduced: np.ndarray) -> None:
        """Wait for the early buffers whose results are not used (their collectives complete: every
        rank issued them), so that the transport lets go of them; none where the ranks disagree on
        the round or the exchange (their names differ: such collectives never complete)."""
        early, self.early = self.early, []  # their pending errors go with them: never applied
        if not early or any(len(set(handshake_range(reduced, f))) > 1 for f in ("round", "exchange")):
            return
        for s in early:
            try:
                s.wait()
            except Exception:  # noqa: BLE001 - the round fails on its own terms
                pass
