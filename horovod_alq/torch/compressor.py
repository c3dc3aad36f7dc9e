"""Horovod compressors for PyTorch that put bit-packed codes on the wire.

Usage::

    import horovod.torch as hvd
    from horovod_alq.torch import ALQCompressor
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=ALQCompressor(bits=3, bucket_size=8192))

How the exchange works (``docs/design/design.md``): ``compress`` records the gradient and hands Horovod's
allreduce a small float64 control vector (``horovod_alq.core.protocol``); the round's gradients
are fused into buffers, and each buffer that is complete (a later gradient does not fit in it)
is quantized and its codes start moving from ``compress`` (``overlap=True``), during the backward
pass; the first ``decompress`` of the round checks the ranks agree, exchanges the rest
(``exchange="allgather"`` or ``"two-phase"``), all through ``horovod_alq.exchange``; each
``decompress`` returns its tensor's reduced values.
"""

from __future__ import annotations

import warnings
import weakref
from dataclasses import dataclass

import torch

from .. import compressor_mixins as mixins
from ..core.methods import get_method
from ..core.protocol import (
    PREFIX,
    ReductionMismatch,
    control_shape,
    joined_ranks,
    outsider_vector,
    passthrough_shape,
    process_set_uid,
    resolve_timeout,
)
from ..core.speed import SpeedArbiter
from ..exchange import Entry
from ..settings import Settings, configure
from . import codecs
from .amp import loss_scale_of
from .horovod_transport import HorovodTransport, NotMemberError, hvd
from .ops import TorchOps, ops_for
from .params import ParameterNames
from .precondition import preconditioner_from

COMPRESSIBLE = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclass
class _Exchange:
    """Context of one compressed tensor between compress and decompress."""

    entry: Entry
    shape: torch.Size
    dtype: torch.dtype
    device: torch.device
    source: torch.Tensor | None  # the input, when autograd needs it
    own_set: bool = False  # the calling Horovod collective runs over the compressor's process set
    scale: torch.Tensor | None = None  # precondition=: the tensor went as tensor * scale


@dataclass
class _Outsider:
    """Context of a tensor compressed on a rank outside the compressor's process set."""

    message: str


@dataclass
class _PassThrough:
    """Context of a tensor that travels uncompressed (too small, or not floating point)."""

    dtype: torch.dtype
    unsqueezed: bool = False  # sent with one more trailing 1 (core.protocol.passthrough_shape)


@dataclass(slots=True)
class _Sixteen:
    """Context of a tensor of a 16-bit round (``compress="when-faster"``): Horovod's fp16 compression's."""

    ctx: object


class _QuantizedAllreduceGrad(torch.autograd.Function):
    """Connects the output of ``hvd.allreduce(x, compression=...)`` to ``x`` for autograd: the
    gradient of a (scaled) sum over ranks is the same sum of the incoming gradients, which is what
    Horovod's own allreduce computes in its backward (exactly, without quantization)."""

    @staticmethod
    def forward(ctx, source, values, scale, process_set):
        ctx.scale = scale
        ctx.process_set = process_set
        return values.view_as(values)

    @staticmethod
    def backward(ctx, grad):
        h = hvd()
        summed = h.allreduce(grad.contiguous(), op=h.Sum, process_set=ctx.process_set)
        return summed * ctx.scale, None, None, None


class QuantizedCompressor(mixins.PerProcessSet, mixins.CompressorBase, metaclass=mixins.DefaultBound):
    """Base class: a Horovod ``compression=`` object for one quantization method.

    Parameters
    ----------
    method, bits, bucket_size, **keywords
        The shared settings, :class:`horovod_alq.settings.Settings` (its fields as keywords: ``bits=3``,
        ``bucket_size=8192``, ``exchange="auto"``, ``min_size=1024``, ``timeout``, ...; None: the
        default). Every one is served here but ``clip`` (docs/guides/settings.md).
    settings : horovod_alq.settings.Settings, optional
        Settings to start from; the keywords given override them. A subclass's method
        (``ALQCompressor``: ``"alq"``) overrides theirs.
    process_set : horovod.torch.ProcessSet, optional
        Pin the compressor to this process set: allreduces over another set raise, naming it.
        Default: not pinned; the compressor serves every set it is used with (the global one, and
        each other set through a compressor of its own with these settings, made at the set's
        first use: levels, statistics and rounds per set; ``docs/design/design.md``).
    named_parameters : iterable of (str, torch.Tensor), optional
        With ``error_feedback=True`` each tensor's error is kept under its name: its parameter's
        name in Horovod's ``DistributedOptimizer``, or the ``name=`` given to ``hvd.allreduce``
        (the same at every call for the same tensor); ``model.named_parameters()`` here names
        gradients that reach the compressor otherwise. A tensor with no name fails its round on
        every rank, naming the tensor.
    fused : bool, optional
        Deprecated: ``fused=False`` is ``codec="torch"``, ``fused=True`` is ``codec="auto"``.

    Notes
    -----
    Collective names: a compressor's collectives are named after its process set and the order in
    which this process first *uses* compressors of that set, so ranks that created different numbers
    of compressors (one per process set, one on some ranks only) still pair (docs/design/design.md).
    Horovod's own allreduce of the control vector is Horovod's (its stall warnings apply);
    ``timeout`` bounds the compressor's own collectives.
    """

    method: str = ""
    HOROVOD = "horovod.torch"
    FRONT_END = "Horovod PyTorch"

    def __init__(
        self,
        method: str | None = None,
        bits: int | str | None = None,
        bucket_size: int | None = None,
        *,
        settings: Settings | None = None,
        process_set=None,
        named_parameters=None,
        fused: bool | None = None,
        **keywords,
    ) -> None:
        if fused is not None:
            warnings.warn(
                "horovod_alq: fused= is deprecated; use codec='torch' (fused=False) or codec='auto' (fused=True)",
                DeprecationWarning,
                stacklevel=2,
            )
            if keywords.get("codec") not in (None, "auto"):
                raise ValueError("give codec= or the deprecated fused=, not both")
            keywords["codec"] = "auto" if fused else "torch"
        self.settings = s = Settings.of(
            settings,
            self.FRONT_END,
            method=method or self.method or None,
            bits=bits,
            bucket_size=bucket_size,
            **keywords,
        )
        self._method = get_method(s.method)
        setup = configure(s, front_end=self.FRONT_END)
        self._quantizer, self._state = setup.quantizer, setup.state
        self.min_size = s.min_size
        self._engine = setup.engine(uid=None)  # uid: at first use
        if self._state.compress == "when-faster":
            self._state.speed = SpeedArbiter(what=self.FRONT_END)
        self._between = True  # no round in progress: the next compress starts one
        self._fp16 = None  # compress="when-faster": Horovod's fp16 compression (at the first 16-bit round)
        self._plain16 = False  # a 16-bit round without statistics is in progress
        self._collectives = 0  # collectives of transports dropped by reset()
        self._sixteen_stats: list | None = None  # a 16-bit round's statistics for its refit
        self._timeout = resolve_timeout(s.timeout)
        self._codec = codecs.check_name(s.codec)
        self._precondition = preconditioner_from(s.precondition, s.bucket_size)
        self._process_set = process_set
        self._names = None if named_parameters is None else ParameterNames(named_parameters)
        self._transport_cache: HorovodTransport | None = None
        self._ops: dict[str, TorchOps] = {}
        self._init_sets()

    # ------------------------------------------------------------------ configuration
    @property
    def exchange(self) -> str:
        return self._engine.exchange

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(method={self._method.name!r}, bits={self.bits}, "
            f"bucket_size={self.bucket_size}, norm={self.norm!r}, min_size={self.min_size}, "
            f"exchange={self.exchange!r})"
        )

    # ------------------------------------------------------------------ Horovod interface
    def compress(self, tensor: torch.Tensor):
        """Record ``tensor`` for this round's exchange; return the control vector to allreduce."""
        if self._plain16 and (self._process_set is not None or not mixins.other_sets(self.HOROVOD)):
            small, ctx = self._fp16.compress(tensor)  # a 16-bit round: Horovod's fp16, nothing else per tensor
            return small, _Sixteen(ctx)
        other = self._for_calling_process_set()
        if other is not None:
            small, ctx = other.compress(tensor)
            return small, mixins.Delegated(other, ctx)
        if self._engine.uid is None:  # named at its first compress of any tensor (every rank calls it)
            ps = self._process_set if self._process_set is not None else hvd().global_process_set
            self._engine.uid = process_set_uid(ps)
        if self._state.speed is not None and not self._quantizes():
            return self._sixteen(tensor)
        if tensor.dtype not in COMPRESSIBLE or tensor.numel() < max(self.min_size, 1) or tensor.is_sparse:
            self._state.uncompressed_coordinates += tensor.numel()
            unsqueeze = not tensor.is_sparse and len(passthrough_shape(tensor.shape)) > tensor.dim()
            ctx = _PassThrough(tensor.dtype, unsqueeze)
            if ctx.unsqueezed:  # never the control vector's shape: Horovod refuses a mix on every rank
                tensor = tensor.unsqueeze(-1)
            if tensor.dtype == torch.bfloat16:  # Horovod's torch allreduce rejects bfloat16
                return tensor.float(), ctx
            return tensor, ctx
        try:
            transport = self._transport()
        except NotMemberError as err:
            # Raising here would leave the members waiting in this collective: take part with a
            # vector that fails their checks, and raise in decompress.
            size = len(self._process_set.ranks or ())
            vec = outsider_vector(size)
            return torch.from_numpy(vec).view(control_shape(vec.size)).to(tensor.device), _Outsider(str(err))
        flat, scale, fused = tensor.detach().reshape(-1), None, None
        if self._precondition is not None:  # w of every parameter, once per round; its digest to the handshake
            pre = self._precondition  # Form.refit rounds after it starts, a refit (RoundState.precondition_round)
            self._state.precondition_round(pre.prepare(self._state.step), pre.active, pre.form.refit)
            scale = self._precondition.for_gradient(tensor)
            ops = self._ops_for(tensor.device)
            if scale is not None and flat.dtype == torch.float32 and ops.fuses_scales and self._state.auto is None:
                fused, scale = scale.reshape(-1), None  # the codec forms flat * w; finish divides by it
            elif scale is not None:
                flat = flat * scale.reshape(-1)  # float32 (float64 stays)
        ident = None
        if self._state.feedback is not None:  # the parameter's name, or the name Horovod was given
            ident = self._names.of_gradient(tensor) if self._names is not None else None
            ident = ident or mixins.calling_tensor_name(self.HOROVOD, tensor)
        entry, vec = self._engine.add(
            flat,
            flat.numel(),
            tuple(tensor.shape),
            tensor.dtype,
            transport,
            ops=self._ops_for(tensor.device),
            ident=ident,
            scale=fused,
        )
        small = torch.from_numpy(vec).view(control_shape(vec.size)).to(tensor.device)
        source = tensor if tensor.requires_grad and torch.is_grad_enabled() else None
        calling = mixins.calling_process_set(self.HOROVOD, depth=10)
        own_set = calling is not None and calling.process_set_id == transport.process_set.process_set_id
        ctx = _Exchange(entry, tensor.shape, tensor.dtype, tensor.device, source, own_set, scale)
        # The framework holds ctx until decompress; if it drops ctx first (its allreduce raised), the
        # entry leaves the round. Not `small`: frameworks may keep only an alias (Adasum: `small.data`).
        weakref.finalize(ctx, entry.abandon)
        return small, ctx

    def decompress(self, tensor: torch.Tensor, ctx):
        """Exchange the round's codes (first call of a round) and return this tensor's reduced values."""
        if type(ctx) is _Sixteen:
            if not self._between:  # the round's first decompress
                self._between, self._plain16 = True, False
                self._end_sixteen()
            return self._fp16.decompress(tensor, ctx.ctx)
        if ctx is None:  # sparse gradients: Horovod reduced them itself
            return tensor
        if isinstance(ctx, mixins.Delegated):
            return ctx.compressor.decompress(tensor, ctx.ctx)
        self._between, self._plain16 = True, False  # (the round's first decompress ends it)
        if isinstance(ctx, _PassThrough):
            out = tensor.to(ctx.dtype) if tensor.dtype != ctx.dtype else tensor
            return out.squeeze(-1) if ctx.unsqueezed else out
        if isinstance(ctx, _Outsider):
            raise RuntimeError(ctx.message)
        reduced = tensor.detach().double().cpu().numpy()
        transport = self._transport()
        try:
            out, scale = self._engine.finish(ctx.entry, reduced, self._ops_for(ctx.device), transport)
        except ReductionMismatch:
            # Over the compressor's own set, ranks whose entries are 0 are in hvd.join(): Horovod serves
            # them in an allreduce (zeros), not in the payload collectives. Every other rank holds this
            # vector: all send the tensor uncompressed in one more allreduce, as Horovod alone would.
            joined = ctx.own_set and joined_ranks(
                reduced, rank=transport.rank, size=transport.size, shape_code=ctx.entry.shape_code
            )
            if not joined or ctx.entry.flat is None:
                raise
            flat, name = ctx.entry.flat, f"{PREFIX}.{self._engine.uid}.joined.{'.'.join(map(str, joined.slots))}"
            handle = hvd().allreduce_async(
                flat.float() if flat.dtype == torch.bfloat16 else flat,
                op=hvd().Sum,
                name=name,
                process_set=transport.process_set,
            )
            out, scale = transport._wait(handle, name).double() * joined.scale, joined.scale  # as Horovod scales
            self._state.uncompressed_coordinates += flat.numel()
        if ctx.scale is not None:  # decode(...) / w
            out = out.to(ctx.device) / ctx.scale.reshape(-1)
        out = out.to(device=ctx.device, dtype=ctx.dtype).view(ctx.shape)
        if ctx.source is not None:
            out = _QuantizedAllreduceGrad.apply(ctx.source, out, scale, transport.process_set)
        return out

    # ------------------------------------------------------------------ metrics and state
    def metrics(self) -> dict:
        """``levels``, ``multiplier``, ``second_levels``, ``level_updates``, ``step``, ``calls``,
        ``payload_bytes`` (this rank's own payloads), ``coordinates``, ``uncompressed_coordinates``,
        ``bits_per_coordinate`` (of compressed tensors), ``bytes_sent`` / ``bytes_received`` (payload
        bytes this rank put on / took off the wire, all phases, headers included), ``exchange``,
        ``collectives`` (the compressor's own, started on this rank: not Horovod's allreduces of the
        control vectors), ``compress_choice`` and the timings of ``compress="when-faster"``;
        ``process_sets``: the same for each other process set this compressor served (by ranks)."""
        done = self._collectives + (self._transport_cache.collectives if self._transport_cache is not None else 0)
        return self._sets_metrics({**self._state.metrics(), "collectives": done})

    def state_dict(self) -> dict:
        """Levels (both quantizations), counters and seed: a resumed run continues identically."""
        if self._engine.pending() or any(c._engine.pending() for c in self._per_set.values()):
            raise RuntimeError("state_dict() during an exchange: call it between optimizer steps")
        return self._sets_state({"seed": self._engine.seed, **self._state.state_dict()})

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` saved (the other process sets' states included)."""
        if self._engine.pending() or any(c._engine.pending() for c in self._per_set.values()):
            raise RuntimeError("load_state_dict() during an exchange: call it between optimizer steps")
        state = self._load_sets(state)
        self._state.load_state_dict(state)
        self._engine.seed = int(state["seed"])

    def use_grad_scaler(self, scaler) -> None:
        """AMP: read the loss scale of ``scaler`` (a ``torch.amp.GradScaler``) so that error-feedback
        buffers stay in unscaled units and a step the scaler skips leaves them unchanged (without
        ``error_feedback`` there is nothing to keep: a no-op after the check)."""
        read = loss_scale_of(scaler)
        self._loss_scale = read
        for c in (self, *self._per_set.values()):
            if c._state.feedback is not None:
                c._state.feedback.loss_scale = read

    def reset(self) -> None:
        """Drop the round in progress (e.g. after a Horovod elastic reset); levels and counters stay."""
        self._engine.reset()
        if self._transport_cache is not None:
            self._collectives += self._transport_cache.collectives
        self._transport_cache = None
        self._between, self._sixteen_stats, self._plain16 = True, None, False  # the next compress starts a round
        for child in self._per_set.values():
            child.reset()

    # ------------------------------------------------------------------ internals
    def _transport(self) -> HorovodTransport:
        if self._transport_cache is not None and self._transport_cache.stale():
            # Horovod was re-initialized with other ranks (an elastic reset after a removal or an
            # addition: hvd.elastic.run then calls neither restore() nor, for a removal, sync()). The
            # round in progress belongs to the old world and is dropped; levels and counters stay.
            self.reset()
        if self._transport_cache is None:
            self._transport_cache = HorovodTransport(self._process_set, self._timeout)
        return self._transport_cache

    def _ops_for(self, device: torch.device) -> TorchOps:
        return ops_for(self._ops, device, self._codec)

    # ------------------------------------------------------------------ compress="when-faster"
    def _quantizes(self) -> bool:
        """Whether this round is quantized; a round's first compress asks the arbiter (every rank
        alike: its collectives run at the same rounds on every rank of the set)."""
        if self._between:
            self._between = False
            try:
                transport = self._transport()
            except NotMemberError:
                return True  # the quantized path answers an outsider (the members' checks fail)
            speed, st = self._state.speed, self._state
            speed.rank = transport.rank
            quantized = speed.start(transport.allreduce_max, f"{PREFIX}.{self._engine.uid}.speed")
            self._sixteen_stats = None if quantized else self._engine.sixteen_stats()
            collects = self._sixteen_stats is not None
            if not quantized:  # a 16-bit round without statistics: compress's first lines serve it
                self._fp16, self._plain16 = hvd().Compression.fp16, not collects
            if collects and self._precondition is not None:  # the statistics of what is quantized: g * w
                self._precondition.prepare(st.step)
        return self._state.speed.current

    def _sixteen(self, tensor: torch.Tensor):
        """A tensor of a 16-bit round: Horovod's own fp16 compression (in refit rounds, the statistics of
        what a quantized round would quantize: ``g * w`` with ``precondition=``)."""
        stats = self._sixteen_stats
        if stats is not None and tensor.dtype in COMPRESSIBLE and not tensor.is_sparse:
            if tensor.numel() >= max(self.min_size, 1):
                flat = tensor.detach().reshape(-1).float()
                w = None if self._precondition is None else self._precondition.for_gradient(tensor)
                if w is not None:
                    flat = flat * w.reshape(-1).float()
                stats.append(self._ops_for(tensor.device).statistics(flat, self._quantizer))
        small, ctx = self._fp16.compress(tensor)
        return small, _Sixteen(ctx)

    def _end_sixteen(self) -> None:
        """A 16-bit round's first decompress: :meth:`~horovod_alq.exchange.engine.Engine.end_sixteen`."""
        stats, self._sixteen_stats = self._sixteen_stats, None
        self._engine.end_sixteen(stats, self._transport())

    def _for_set(self, process_set) -> QuantizedCompressor:
        child = QuantizedCompressor(process_set=process_set, settings=self.settings)
        child._names = self._names
        if getattr(self, "_loss_scale", None) is not None and child._state.feedback is not None:
            child._state.feedback.loss_scale = self._loss_scale
        return child


class ALQCompressor(mixins.ALQ, QuantizedCompressor):
    """ALQ for Horovod PyTorch: levels fitted by coordinate descent to the gradients'
    statistics (``normless=True``: ALQ-N).

    ``ALQCompressor(bits=3, bucket_size=8192, normless=False, norm=None, **keywords)``; ``norm="linf"``
    (max-abs buckets, the default) or ``"l2"`` (the paper's form); the other keywords are those of
    :class:`QuantizedCompressor`."""


class AMQCompressor(mixins.AMQ, QuantizedCompressor):
    """AMQ for Horovod PyTorch: levels ``+-{p**s, ..., p, 1}`` with the multiplier ``p`` adapted
    (``normless=True``: AMQ-N). Keywords as :class:`ALQCompressor`."""


class QSGDCompressor(mixins.QSGD, QuantizedCompressor):
    """QSGD for Horovod PyTorch, uniform levels: ``norm="linf"`` (default) is QSGDinf, ``norm="l2"``
    the original QSGD. Other keywords: those of :class:`QuantizedCompressor`."""


class NUQSGDCompressor(mixins.NUQSGD, QuantizedCompressor):
    """NUQSGD for Horovod PyTorch: fixed exponential levels ``+-{2**-s, ..., 1/2, 1}``, L2 buckets."""


class TernGradCompressor(mixins.TernGrad, QuantizedCompressor):
    """TernGrad for Horovod PyTorch: levels {-1, 0, 1} times the bucket's max-abs, 2 bits per
    coordinate (``bits`` other than 2 is refused)."""


def compressor_for(method: str, **kwargs) -> QuantizedCompressor:
    """The compressor for a method name ("alq", "alq-n", "amq", "amq-n", "qsgdinf", "qsgd", "nuqsgd",
    "terngrad"), with the classes' keywords: ``compressor_for("alq-n", bits=3)`` is
    ``ALQCompressor(bits=3, normless=True)``. TernGrad ignores ``bits`` (always 2)."""
    return mixins.compressor_by_name(globals(), method, **kwargs)
