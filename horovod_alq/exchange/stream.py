"""A streamed round: buffers are exchanged one by one as the framework hands them over, so the
first ones travel while the backward pass still computes the next (the DDP hook, whose buckets
arrive in the same order on every rank and whose transport pairs collectives by call order).

The round opens with one small handshake (settings, levels, round number, refit flag, the
threshold below which buffers travel uncompressed): after it, every rank knows that every other
rank quantizes the same buffers with the same codec, so it can issue each buffer's collectives
without waiting for the rest of the round. Each buffer is one :class:`.job.Job` run through the
exchange's ``steps``; its first collective is issued by :meth:`StreamedRound.add` on the calling
thread (buffer order on every rank). Later collectives are issued as earlier ones complete (on
the transport's completion threads), on a transport of their own per stage (``stages[s]``), in
buffer order within each stage: every transport sees the same collectives in the same order on
every rank. Payload checks (method, bits, bucket size, levels, element count in every header) run
on every buffer as in a whole round; an error in a buffer is that buffer's alone (``on_done``
receives it) and every rank finds it alike. Refit statistics are combined once, by
:meth:`StreamedRound.close`, after every buffer completed: every rank switches levels at the same
round (or, in a round that collects for its caller, ``close`` returns this rank's statistics; with
``bits="auto"``, one row per tensor of :attr:`StreamedRound.keys`).
"""

from __future__ import annotations

import math
import threading
from typing import Any, Callable, Sequence

import numpy as np

from ..core.methods import get_method
from ..core.protocol import timeout_error
from ..core.statistics import statistics_length
from .context import RoundContext
from .descriptor import Exchange
from .interfaces import TensorOps, Transport
from .job import Decoded, Job, auto_rows
from .layout import Layout, plan_layout
from .refit import Refitter


class StreamedRound:
    """One round of :class:`.engine.Engine` exchanged buffer by buffer (made by
    :meth:`.engine.Engine.open_stream`, after its handshake).

    ``ctx``: the round's names, seeds and counters; ``refitter``: its refit at :meth:`close`.
    ``stages[s]`` carries the ``s``-th collective of every buffer (``stages[0]`` is the engine's
    transport: the handshake, the first collectives and the statistics). A transport's wait
    function may have ``then(callback)`` (run the callback once the collective completed, on any
    thread); one without is waited for at once.
    """

    def __init__(
        self,
        ctx: RoundContext,
        refitter: Refitter,
        ops: TensorOps,
        stages: Sequence[Transport],
        *,
        collect_first: bool,
        collect_second: bool,
        refit: bool = True,
    ) -> None:
        self.ctx, self.refitter, self.ops, self.stages = ctx, refitter, ops, list(stages)
        self.exchange: Exchange = ctx.exchange
        self.prefix = ctx.prefix
        self.span = ctx.exchange.span or _whole  # what of a buffer's stream the exchange leaves here
        self.collect_first, self.collect_second, self.refit = collect_first, collect_second, refit
        q = ctx.quantizer
        k = statistics_length(get_method(q.method))
        self._first_stats = np.zeros(k)
        self._second_stats = np.zeros(k)
        self._lock = threading.Condition()
        self._ready: list[dict[int, Any]] = [dict() for _ in self.stages]  # stage -> buffer -> request
        self._next = [0] * len(self.stages)  # stage -> the next buffer to issue there
        self._buffers: list[_Buffer] = []
        self._open = 0  # buffers not yet completed
        self._keys: list[tuple[int, int]] = []  # bits="auto": the round's tensors so far ...
        self._rows: list[np.ndarray] = []  # ... and, in refit rounds, their rows
        self.failure: BaseException | None = None

    # ------------------------------------------------------------------ the calling thread
    def add(
        self,
        flat: Any,
        numel: int,
        on_done: Callable[[Decoded | None, BaseException | None], None],
        tensors: Sequence[tuple[int, int]] | None = None,
        *,
        whole: bool = False,
        idents: Sequence | None = None,
        scales: Any = None,
    ) -> Layout:
        """Quantize buffer ``flat`` (1-D, ``numel`` elements; or a list of 1-D tensors of ``numel``
        elements in all, each starting on a bucket boundary: quantized as it would be alone), issue
        its first collective and return the buffer's layout (where each tensor of a list starts);
        ``on_done(decoded, None)`` gets the sum over ranks of its values (``decoded.read``; a
        reduce-scatter: of this rank's shard only) once its exchange completed, or
        ``on_done(None, error)``; on any thread. ``tensors``: for ``bits="auto"``, the (elements,
        shape code) of the tensors of the list, or of those laid back to back in ``flat`` (a DDP
        bucket's parameters); ``whole``: this buffer holds all of the round's tensors (they take
        the allocation's widths only if they are exactly its tensors). ``idents`` (required with
        error feedback): what the tensors are, their errors' keys, as (identity, elements) pairs:
        one per tensor of a list, or of the tensors back to back in ``flat``. ``scales``
        (precondition=): ``w`` of ``flat`` (a tensor as long as it; a list: one per tensor), the
        buffer quantized being ``flat * w`` (formed inside the encode where the ops can)."""
        ctx, t = self.ctx, self.stages[0]
        st, q = ctx.state, ctx.quantizer
        index = len(self._buffers)
        parts = list(flat) if isinstance(flat, (list, tuple)) else [flat]
        sizes = [int(p.shape[0]) for p in parts] if len(parts) > 1 else [int(numel)]
        if sum(sizes) != int(numel):
            raise ValueError(f"horovod_alq: the buffer's tensors hold {sum(sizes)} elements, not {numel}")
        layout = plan_layout(sizes, q.bucket_size, None)
        widths = None
        if scales is not None:
            scales = list(scales) if isinstance(scales, (list, tuple)) else [scales]
            if [int(w.shape[0]) for w in scales] != [int(p.shape[0]) for p in parts]:
                raise ValueError(f"horovod_alq: the buffer's scales do not match its tensors ({len(scales)} given)")
            if st.auto is not None:  # bits="auto" splits the buffer per tensor: the products go
                parts, scales = [p * w for p, w in zip(parts, scales)], None
        if st.auto is not None:
            parts, layout, widths = self._auto_layout(parts, layout, tensors, whole)
        own_stats = self.exchange.own_first_statistics  # it quantizes other values than these
        job = Job(
            parts,
            layout,
            self.ops,
            t,
            q,
            st.second,
            seed=ctx.stream_seed(index),
            name=ctx.name(f"b{index}"),
            collect_second=self.collect_second,
            collect_first=self.collect_first and own_stats and st.auto is None,
            widths=widths,
            scales=scales,
            **ctx.feedback_for(self._idents(idents, sizes, layout)),
        )
        if self.collect_first and st.auto is None and not own_stats:  # a list's tensors one by one, as if alone
            views = [job.stream] if len(parts) == 1 else [job.stream[a : a + n] for a, n in zip(layout.starts, sizes)]
            self._first_stats = self._first_stats + sum(self.ops.statistics(v, q) for v in views)
        buf = _Buffer(index, job, self.exchange.steps(job, 0), on_done)
        st.calls += 1
        st.coordinates += int(numel)
        with self._lock:
            self._buffers.append(buf)
            self._open += 1
        self._advance(buf, 0, None)
        return layout

    def _idents(self, idents: Sequence | None, sizes: list[int], layout: Layout) -> list | None:
        """Error feedback: the (identity, start, elements) rows of a buffer's tensors from ``idents``,
        (identity, elements) pairs: one per tensor of a list, or of the tensors back to back in one
        buffer (a DDP bucket's parameters)."""
        if self.ctx.state.feedback is None:
            return None
        if idents is None:
            raise ValueError(f"{self.prefix}: error_feedback=True needs the identity of every tensor of a buffer")
        pairs = [(ident, int(n)) for ident, n in idents]
        if len(sizes) > 1:  # a list: one per part, at the layout's starts
            if [n for _, n in pairs] != sizes:
                raise ValueError(
                    f"{self.prefix}: tensor identities for {[n for _, n in pairs]} elements, a list of {sizes}"
                )
            return [(i, s, n) for (i, n), s in zip(pairs, layout.starts)]
        starts = np.concatenate([[0], np.cumsum([n for _, n in pairs])]).astype(int).tolist()
        if starts[-1] != sizes[0]:
            raise ValueError(f"{self.prefix}: the tensor identities cover {starts[-1]} elements, the buffer {sizes[0]}")
        return [(i, s, n) for (i, n), s in zip(pairs, starts)]

    def _auto_layout(self, parts: list, layout: Layout, tensors: Sequence[tuple[int, int]] | None, whole: bool):
        """``bits="auto"``: the buffer's tensors (``parts``, or the tensors back to back in one
        part), their layout, and each one's quantizer: its allocated width when the round so far is
        the allocated sequence's beginning (the same on every rank: they hand over the same
        buffers; ``whole``: when the round is exactly that sequence), else the default width. In
        rounds that collect, each tensor's row is recorded for :meth:`close`."""
        auto = self.ctx.state.auto
        tensors = [(int(n), int(c)) for n, c in tensors] if tensors else [(n, 0) for n in layout.numels]
        numels = [n for n, _ in tensors]
        if len(parts) == 1 and len(tensors) > 1:  # a DDP bucket: its parameters back to back
            if sum(numels) != layout.length:
                raise ValueError(
                    f"horovod_alq: the buffer's tensors hold {sum(numels)} elements, the buffer {layout.length}"
                )
            flat, n = parts[0], layout.length
            starts = np.concatenate([[0], np.cumsum(numels)[:-1]]).astype(int).tolist()
            layout = Layout(tuple(numels), tuple(starts), n, ((0, n),), self.ctx.quantizer.bucket_size)
            parts = [flat[s : s + k] for s, k in zip(starts, numels)]
        elif tuple(numels) != layout.numels:
            raise ValueError(
                f"horovod_alq: the buffer's tensors hold {numels} elements, its parts {list(layout.numels)}"
            )
        start = len(self._keys)
        self._keys += tensors
        widths = auto.quantizers_for(self._keys, start, whole)
        if self.collect_first:
            self._rows += list(auto_rows(auto, self.ops, parts))
        return parts, layout, widths

    @property
    def keys(self) -> tuple[tuple[int, int], ...]:
        """``bits="auto"``: the (elements, shape code) of the round's tensors so far."""
        return tuple(self._keys)

    def close(self) -> tuple[np.ndarray | None, np.ndarray | None] | None:
        """The round's end (after the last :meth:`add`): in refit rounds, wait for every buffer,
        combine the statistics of every rank once and refit (the next round uses the new levels);
        an error of any buffer is raised here then, on every rank alike, instead of the refit. A
        round that collects for its caller (``refit`` off) waits and returns this rank's
        statistics (first quantizer, second: None unless collected); other rounds return None."""
        if not (self.collect_first or self.collect_second):
            return None
        self.wait()
        if self.failure is not None:
            raise self.failure
        if not self.refit:
            if self.ctx.state.auto is not None:  # one row per tensor of keys (none: no tensor was added)
                return (np.stack(self._rows) if self._rows else None), None
            return (
                self._first_stats if self.collect_first else None,
                self._second_stats if self.collect_second else None,
            )
        if self.ctx.state.auto is not None:
            if self._rows:
                self.refitter.from_rows(self._rows, self._keys, self.stages[0], f"{self.prefix}.statistics")
            return None
        self.refitter.from_statistics(
            self._first_stats if self.collect_first else None,
            self._second_stats if self.collect_second else None,
            self.stages[0],
            f"{self.prefix}.statistics",
        )
        return None

    def wait(self) -> None:
        """Until every buffer added so far completed; at most the first stage's ``timeout``, then
        :func:`~horovod_alq.core.protocol.timeout_error` naming the round's buffers (a rank that
        stopped in the middle of the round never completes them)."""
        t = self.stages[0]
        seconds = getattr(t, "timeout", math.inf)
        with self._lock:
            if self._lock.wait_for(lambda: self._open == 0, None if math.isinf(seconds) else seconds):
                return
        raise timeout_error(f"{self.prefix}.buffers", seconds, getattr(t, "scope", "the process set"))

    # ------------------------------------------------------------------ any thread
    def _advance(self, buf: "_Buffer", stage: int, wait: Callable[[], Any] | None) -> None:
        """Run buffer ``buf``'s exchange, with the result of ``wait`` (its previous collective), up
        to its next collective (stage ``stage``) or to its end."""
        try:
            request = buf.steps.send(None if wait is None else wait())
        except StopIteration as stop:
            start, length = self.span(buf.job)
            self._done(buf, Decoded(buf.job.ops, length, stop.value, start), None)
            return
        except BaseException as exc:  # noqa: BLE001 - the buffer's consumer raises it
            self._done(buf, None, exc)
            return
        if stage >= len(self.stages):
            self._done(
                buf,
                None,
                RuntimeError(
                    f"horovod_alq: the exchange asked for more than {len(self.stages)} collectives per buffer"
                ),
            )
            return
        with self._lock:
            self._ready[stage][buf.index] = request
            issue = []
            while self._next[stage] in self._ready[stage]:
                k = self._next[stage]
                issue.append((self._buffers[k], self._ready[stage].pop(k)))
                self._next[stage] += 1
            # issued under the lock: a stage's collectives leave in buffer order on every rank
            started, failed = [], []
            for b, r in issue:
                try:
                    started.append((b, b.job.issue(r, self.stages[stage])))
                except BaseException as exc:  # noqa: BLE001
                    failed.append((b, exc))
        for b, exc in failed:
            self._done(b, None, exc)
        for b, wait in started:
            _then(wait, lambda b=b, wait=wait: self._advance(b, stage + 1, wait))

    def _done(self, buf: "_Buffer", decoded: Decoded | None, error: BaseException | None) -> None:
        job = buf.job
        with self._lock:  # counted before the consumer learns the buffer is done
            self.ctx.count(job)
            if job.second_statistics is not None:
                self._second_stats = self._second_stats + job.second_statistics
            if job.first_statistics is not None:
                self._first_stats = self._first_stats + job.first_statistics
        if error is None:  # the exchange succeeded: its errors are kept before its result is handed over
            job.commit_feedback()
        try:
            buf.on_done(decoded, error)
        except BaseException as exc:  # noqa: BLE001
            error = error or exc
        with self._lock:
            if error is not None and self.failure is None:
                self.failure = error
            self._open -= 1
            self._lock.notify_all()


class _Buffer:
    __slots__ = ("index", "job", "steps", "on_done")

    def __init__(self, index, job, steps, on_done) -> None:
        self.index, self.job, self.steps, self.on_done = index, job, steps, on_done


def _whole(job: Job) -> tuple[int, int]:
    return 0, job.layout.length


def _then(wait: Callable[[], Any], callback: Callable[[], None]) -> None:
    then = getattr(wait, "then", None)
    if then is None:
        callback()
    else:
        then(callback)
