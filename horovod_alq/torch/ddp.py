"""A PyTorch DistributedDataParallel communication hook with the adaptive quantizers (no Horovod).

Usage (launched with ``torchrun``; gloo on CPU, NCCL on GPU)::

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from horovod_alq.torch.ddp import ALQState, alq_hook

    dist.init_process_group("gloo")
    model = DDP(model)
    state = ALQState(process_group=None, method="alq", bits=3, bucket_size=8192)
    model.register_comm_hook(state, alq_hook)
    ...
    state.metrics()          # the Horovod compressors' keys
    torch.save({"alq": state.state_dict(), ...}, path)

How it works: one DDP step (one backward with gradient synchronization) is one round of the
exchange engine of :mod:`horovod_alq.exchange`, the same engine, protocol, wire format, methods,
refit schedule and exchanges (allgather, two-phase) as the Horovod compressors. DDP calls the hook
once per gradient bucket, in bucket order, with the same buckets on every rank (it checks the
parameters' shapes across ranks and rebuilds the buckets in one order for all). The round is
*streamed* (:mod:`horovod_alq.exchange.stream`): the first bucket's hook runs a small handshake
(settings, levels, round number, refit flag, ``min_size``: a rank that differs raises on every
rank before any payload moves); then every bucket's hook quantizes its bucket and starts its
collectives at once, so the first buckets travel while the backward pass computes the next. Each
bucket's future completes when its own exchange is done (its payload headers checked, its sum
decoded straight into the bucket); the two-phase exchange's second collective of each bucket is
started as its first completes, on a companion process group of the same ranks. Buckets that
travel uncompressed (fewer than ``min_size`` elements, or not floating point) are ``all_reduce``d
when their hook runs. In refit steps the last bucket's hook waits for every bucket, combines the
statistics of every rank once (one small allreduce) and refits: every rank switches levels at the
same step.

Semantics: the hook gets each bucket's local gradients and returns their average over the process
group (as DDP's default allreduce does). Works with ``no_sync()`` accumulation (no hook runs
inside it; the next synchronized step exchanges the accumulated gradients), ``static_graph``,
``find_unused_parameters``, ``gradient_as_bucket_view`` and sub-groups (``process_group=``; every
member builds its state with the same group). A quantization bucket (``bucket_size`` coordinates)
holding NaN or Inf comes back NaN, so ``torch.amp.GradScaler`` skips the step. Not supported: DDP's
``join()`` for uneven inputs (a joined rank would not take part in the round).
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook

from ..core.protocol import PREFIX, shape_hash
from ..core.speed import SpeedArbiter
from ..settings import Settings
from .dist_state import COMPRESSIBLE, StreamedState
from .dist_transport import WATCHDOG, SettleOnce, on_completion
from .params import FirstSeen
from .precondition import preconditioner_from

__all__ = ["ALQState", "alq_hook"]

logger = logging.getLogger(__name__)


class ALQState(StreamedState):
    """State of :func:`alq_hook`: the method settings, the levels and the round bookkeeping.

    Create one per DDP model, on every rank with the same arguments, and register it with
    ``model.register_comm_hook(state, alq_hook)``.

    Parameters
    ----------
    process_group : ProcessGroup, optional
        The group DDP averages over (the same as ``DistributedDataParallel(process_group=...)``);
        None: the default (world) group.
    method, bits, bucket_size, **keywords
        The shared settings, :class:`horovod_alq.settings.Settings` (its fields as keywords;
        None: the default). ``bucket_size`` is the quantization bucket, not DDP's bucket (those are
        ``bucket_cap_mb``); ``update_steps`` count DDP steps; ``bits="auto"`` gives a width per
        parameter (a DDP bucket carries its parameters' widths); ``timeout`` also bounds DDP's
        own wait for a bucket's future (a bucket whose exchange has not completed this long after
        its hook ran fails with the timeout's error). ``fusion_bytes`` is checked equal on every
        rank, otherwise unused (DDP's buckets are the fusion); ``overlap`` and ``clip`` are not
        served (docs/guides/settings.md).
    settings : horovod_alq.settings.Settings, optional
        Settings to start from; the keywords given override them.

    Attributes
    ----------
    engine : horovod_alq.exchange.Engine
        The round driver; ``engine.quantizer`` holds the current levels.
    round_state : horovod_alq.core.rounds.RoundState
        Counters, schedule and both quantizers (what :meth:`metrics` and :meth:`state_dict` read).
    """

    what = "hook's state"
    FRONT_END = "DDP hook"

    def __init__(
        self,
        process_group=None,
        method: str | None = None,
        bits: int | str | None = None,
        bucket_size: int | None = None,
        *,
        settings: Settings | None = None,
        **keywords,
    ) -> None:
        self._configure(process_group, settings, "ddp", method=method, bits=bits, bucket_size=bucket_size, **keywords)
        self._precondition = preconditioner_from(self.settings.precondition, self.bucket_size)
        self._last = -1  # the index of the step's last bucket so far
        self._param_ids = FirstSeen()  # error_feedback: each parameter's identity, its errors' key
        if self.round_state.compress == "when-faster":
            self.round_state.speed = SpeedArbiter(what=self.FRONT_END)
        self._sixteen_stats: list | None = None  # a 16-bit step's statistics for its refit

    # ------------------------------------------------------------------ the round
    def _add(self, index: int, buffer: torch.Tensor, parameters=()) -> torch.futures.Future:
        """One bucket's hook: open the step's round at bucket 0, start this bucket's exchange."""
        if self._round is not None and index <= self._last:
            # the previous step never reached its last bucket on this rank (its backward raised)
            self._round = None
        if index == 0:
            if self._precondition is not None:  # w of every parameter for this step; its digest to the handshake
                pre = self._precondition  # Form.refit steps after it starts, a refit (RoundState.precondition_round)
                self.round_state.precondition_round(pre.prepare(self.round_state.step), pre.active, pre.form.refit)
            self._round = self.engine.open_stream(self._ops_for(buffer.device), self._stages(), min_size=self.min_size)
        future: torch.futures.Future = torch.futures.Future()
        if self._round is None:
            future.set_exception(
                RuntimeError(f"{PREFIX}: the exchange of this DDP step failed at its first bucket (see that error)")
            )
            return future
        self._last = index
        stage = self._stages()[0]
        n = stage.size
        # DDP waits for the future in C++: the watchdog bounds that wait (a rank that stopped in the
        # middle of the step never issues this bucket's collectives)
        settle = SettleOnce(future, f"DDP bucket {index} of step {self.round_state.step}", stage.scope, self.timeout)
        WATCHDOG.watch(settle)
        if buffer.dtype in COMPRESSIBLE and buffer.numel() >= max(self.min_size, 1):
            flat, scale, fused = buffer.detach().reshape(-1), None, None
            if self._precondition is not None:
                scale = _bucket_scale(self._precondition, parameters, flat)
                if scale is not None and flat.dtype == torch.float32 and self._ops_for(flat.device).fuses_scales:
                    fused = scale  # the codec forms flat * scale inside its encode
                elif scale is not None:
                    flat = flat * scale
            tensors = [(p.numel(), shape_hash(tuple(p.shape), str(p.dtype))) for p in parameters]
            idents = None
            if self.round_state.feedback is not None:  # per parameter: a rebuilt bucket keeps each one's
                idents = [(self._param_ids(p), p.numel()) for p in parameters]
            self._round.add(
                flat,
                flat.numel(),
                functools.partial(_complete, settle, buffer, 1.0 / n, scale),
                tensors=tensors if self.round_state.auto is not None else None,
                idents=idents,
                scales=fused,
            )
        else:
            self.round_state.uncompressed_coordinates += buffer.numel()
            buffer.div_(n)
            work = dist.all_reduce(buffer, group=self.process_group, async_op=True)
            on_completion(work, lambda f: _settle(settle, f, buffer))
        return future

    def _close(self) -> None:
        """The last bucket's hook: the step's refit, if any (waits for every bucket then)."""
        rnd, self._round = self._round, None
        if rnd is not None:
            rnd.close()

    # ------------------------------------------------------------------ compress="when-faster"
    def _quantizes(self, bucket: dist.GradBucket) -> bool:
        """Whether this step is quantized: bucket 0's hook asks the arbiter (every rank alike)."""
        speed, st = self.round_state.speed, self.round_state
        if bucket.index() == 0:
            stage = self._stages()[0]
            speed.rank = stage.rank
            if speed.start(stage.allreduce_max, f"{PREFIX}.ddp.speed"):
                return True
            self._round = None  # a quantized step that never reached its last bucket
            self._sixteen_stats = self.engine.sixteen_stats()
            if self._sixteen_stats is not None and self._precondition is not None:  # statistics of g * w
                self._precondition.prepare(st.step)
        return speed.current

    def _sixteen(self, bucket: dist.GradBucket) -> torch.futures.Future:
        """A bucket of a 16-bit step: ``fp16_compress_hook``, and in refit steps its statistics (of the
        scaled bucket with ``precondition=``); the last bucket ends the step (every rank refits from
        its own statistics in refit steps, three small collectives; error-feedback buffers are kept
        for the next quantized step)."""
        buffer, stats = bucket.buffer(), self._sixteen_stats
        if stats is not None and buffer.dtype in COMPRESSIBLE and buffer.numel() >= max(self.min_size, 1):
            flat = buffer.detach().reshape(-1).float()
            if self._precondition is not None:
                w = _bucket_scale(self._precondition, bucket.parameters(), flat)
                flat = flat if w is None else flat * w
            stats.append(self._ops_for(buffer.device).statistics(flat, self.engine.quantizer))
        future = fp16_compress_hook(self.process_group, bucket)
        if bucket.is_last():
            self._sixteen_stats = None
            self.engine.end_sixteen(stats, self._stages()[0])
        return future


def _bucket_scale(pre, parameters, flat: torch.Tensor) -> torch.Tensor | None:
    """``w`` of a DDP bucket (its parameters' scales, in the bucket's order; 1 where a parameter has
    none); None if none has one."""
    parts = [pre.scale(p) for p in parameters]
    if all(w is None for w in parts):
        return None
    ones = [p.new_ones(p.numel(), dtype=torch.float32) for p in parameters]
    out = torch.cat([one if w is None else w.reshape(-1) for one, w in zip(ones, parts)])
    if out.numel() != flat.numel():
        raise ValueError(f"{PREFIX}: a DDP bucket of {flat.numel()} elements holds parameters of {out.numel()}")
    return out.to(flat.device)


def _complete(settle: SettleOnce, buffer: torch.Tensor, scale: float, w, decoded, error) -> None:
    """A bucket's exchange finished: its average into the bucket (divided by the preconditioning
    scale ``w``, if any), or the error, on its future (through ``settle``: the watchdog may have
    failed it already)."""
    if error is not None:
        settle.set_exception(error)
        return
    try:
        n = buffer.numel()
        if buffer.dtype == torch.float32 and buffer.is_contiguous():  # straight into the bucket
            decoded.read(0, n, scale, buffer.view(-1), divide=w)
        elif w is not None:
            buffer.copy_((decoded.read(0, n, scale).to(w.device) / w).view_as(buffer))
        else:
            buffer.copy_(decoded.read(0, n, scale).view_as(buffer))
    except BaseException as exc:  # noqa: BLE001
        settle.set_exception(exc)
        return
    settle.set_result(buffer)


def _settle(settle: SettleOnce, done: torch.futures.Future, buffer: torch.Tensor) -> None:
    try:
        done.wait()
    except BaseException as exc:  # noqa: BLE001
        settle.set_exception(exc)
        return
    settle.set_result(buffer)


def alq_hook(state: ALQState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: the average over ``state.process_group`` of the bucket's gradients,
    quantized with ``state``'s method (register with ``model.register_comm_hook(state, alq_hook)``).

    Returns a future holding one tensor of the bucket's shape and dtype (the bucket's own buffer,
    overwritten with the average); it completes when this bucket's exchange is done.
    """
    if state.round_state.speed is not None and not state._quantizes(bucket):
        return state._sixteen(bucket)  # compress="when-faster": a 16-bit step
    wanted = state.bits == "auto" or state._precondition is not None or state.round_state.feedback is not None
    future = state._add(bucket.index(), bucket.buffer(), bucket.parameters() if wanted else ())
    if bucket.is_last():
        state._close()
    return future


# DDP checks the hook's annotations as objects (this module's are strings: ``from __future__``)
alq_hook.__annotations__ = {"state": ALQState, "bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]}
