"""Horovod compressors for PyTorch that put bit-packed codes on the wire.

Usage::

    import horovod.torch as hvd
    from horovod_alq.torch import ALQCompressor
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=ALQCompressor(bits=3, bucket_size=8192))

How the exchange works (``docs/design.md``): ``compress`` records the gradient and hands Horovod's
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
from typing import Sequence

import torch

from ..core import frontends
from ..core.methods import get_method
from ..core.protocol import outsider_vector, process_set_uid, resolve_timeout
from ..exchange import Entry
from ..exchange.setup import configure
from . import codecs
from .ops import TorchOps, ops_for
from .transport import HorovodTransport, NotMemberError, hvd

COMPRESSIBLE = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclass
class _Exchange:
    """Context of one compressed tensor between compress and decompress."""

    entry: Entry
    shape: torch.Size
    dtype: torch.dtype
    device: torch.device
    source: torch.Tensor | None  # the input, when autograd needs it


@dataclass
class _Outsider:
    """Context of a tensor compressed on a rank outside the compressor's process set."""

    message: str


@dataclass
class _PassThrough:
    """Context of a tensor that travels uncompressed (too small, or not floating point)."""

    dtype: torch.dtype


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


class QuantizedCompressor(frontends.PerProcessSet, frontends.CompressorBase):
    """Base class: a Horovod ``compression=`` object for one quantization method.

    Parameters
    ----------
    method : str
        One of :data:`horovod_alq.core.methods.METHODS`.
    bits : int or "auto"
        Bits per coordinate on the wire (2..8; TernGrad: 2). ``"auto"`` (ALQ, AMQ and their -N
        forms): a width from 2 to 8 per tensor, chosen at every refit so that the step's total
        quantization variance is smallest within ``bit_budget``; one level set per width, fitted
        from the tensors that use it; allocated by every rank alike from the allreduced per-tensor
        errors and statistics (docs/design.md, "Bits per tensor"). Until the first refit, and in
        rounds of other tensors than the step's, every tensor gets ``floor(bit_budget)`` bits.
    bucket_size : int
        Coordinates per float32 norm. 8192 costs 0.004 extra bits per coordinate.
    bit_budget : float, optional
        ``bits="auto"`` only: mean bits per coordinate over the compressed tensors (bucket norms,
        32/bucket_size bits per coordinate, not counted), from 2 to 8; default 3.0.
    bits_per : {"tensor", "bucket"}, optional
        ``bits="auto"`` only: what gets a width. "tensor" (default): the allocation above, agreed by
        every rank. "bucket": every quantization bucket of every payload, chosen by each rank at
        every step from its own bucket norms with an error model of every width refit from the
        allreduced statistics; the codes of each payload fill ``bit_budget`` (to 1/256 of a bit)
        and carry a width byte per bucket (docs/design.md, "Bits per bucket"). Bucket sizes that
        are multiples of 8.
    update_steps : sequence of int, optional
        Rounds (optimizer steps) whose statistics refit the levels; default (0, 100, 2000).
    update_every : int, optional
        After the last of ``update_steps``, refit every this many rounds; default 10000, 0: never.
    min_size : int
        Tensors with fewer elements travel uncompressed (Horovod's plain allreduce). Default 1024.
    seed : int, optional
        Seed of the stochastic rounding (combined with the rank, round, buffer and phase).
        Default: fresh entropy.
    codec : str
        Codec backend (:mod:`horovod_alq.torch.codecs`): "auto" (default: Triton for CUDA tensors
        when importable, the compiled CPU codec for CPU tensors when it builds, torch ops
        otherwise), "triton", "cpu" or "torch".
    fused : bool, optional
        Deprecated: ``fused=False`` is ``codec="torch"``, ``fused=True`` is ``codec="auto"``.
    exchange : {"auto", "allgather", "two-phase"}
        How codes travel: ``allgather`` (every rank gathers every rank's codes: ``(N-1)(b + 32/d)``
        bits received per coordinate, one quantization), ``two-phase`` (scatter-reduce, re-quantize
        the sums once, allgather: about ``2(N-1)/N (b + 32/d)`` bits, independent of N, at the cost
        of a second quantization), ``auto`` (default): two-phase from 4 ranks on (docs/results.md).
    fusion_bytes : int, optional
        A round's compressed gradients are quantized and exchanged in buffers of this many bytes of
        float32 (default 64 MiB, or ``$HOROVOD_ALQ_FUSION_BYTES``); 0: one buffer per tensor.
    bits_second : int, optional
        Bits of the second (two-phase) quantization; default ``bits``.
    adapt_second : bool, optional
        How the second (two-phase) quantization's levels follow the gradients. None (default):
        with ``bits_second == bits`` they are the first quantizer's levels, copied at every refit;
        with other bits they are refit from the statistics of the reduced shards, collected in the
        round after each refit of the first quantizer. True: refit them so at equal bits too; False:
        with other bits, keep their initial fit. (Measured in docs/variance_two_phase.md.)
    process_set : horovod.torch.ProcessSet, optional
        Pin the compressor to this process set: allreduces over another set raise, naming it.
        Default: not pinned; the compressor serves every set it is used with (the global one, and
        each other set through a compressor of its own with these settings, made at the set's
        first use: levels, statistics and rounds per set; ``docs/design.md``).
    norm : {"l2", "linf"}, optional
        Bucket norm (adaptive methods take either; None: the method's default). See
        :class:`horovod_alq.core.Quantizer`.
    overlap : bool
        Start each fusion buffer's exchange as soon as it is complete, during the backward pass
        (default), not at the round's first ``decompress``. Results are the same either way; ranks
        whose rounds disagree complete each other's early collectives and run the round as usual.
    timeout : float, optional
        Seconds to wait for any of this compressor's own collectives (payloads, handshake,
        statistics) before raising an error that names the collective and the likely causes;
        default ``$HOROVOD_ALQ_TIMEOUT``, else 300; 0: no limit. Horovod's own allreduce of the
        control vector is Horovod's (its stall warnings apply).

    Notes
    -----
    Collective names: a compressor's collectives are named after its process set and the order in
    which this process first *uses* compressors of that set, so ranks that created different numbers
    of compressors (one per process set, one on some ranks only) still pair (docs/design.md).
    """

    method: str = ""
    HOROVOD = "horovod.torch"

    def __init__(self, method: str | None = None, bits: int | str = 3, bucket_size: int = 8192, *,
                 bit_budget: float | None = None, bits_per: str | None = None,
                 update_steps: Sequence[int] | None = None, update_every: int | None = None,
                 min_size: int = 1024, seed: int | None = None, codec: str = "auto",
                 fused: bool | None = None, exchange: str = "auto", fusion_bytes: int | None = None,
                 bits_second: int | None = None, adapt_second: bool | None = None, process_set=None,
                 norm: str | None = None, overlap: bool = True, timeout: float | None = None) -> None:
        method = method or self.method
        self._method = get_method(method)
        setup = configure(self._method.name, bits, bucket_size, norm=norm, bits_second=bits_second,
                          update_steps=update_steps, update_every=update_every, adapt_second=adapt_second,
                          seed=seed, bit_budget=bit_budget, bits_per=bits_per)
        self._quantizer, self._state, seed = setup.quantizer, setup.state, setup.seed
        self.min_size = frontends.check_min_size(min_size)
        self._engine = setup.engine(exchange=exchange, fusion_bytes=fusion_bytes, uid=None,
                                    early=bool(overlap))  # uid: at first use
        self._timeout = resolve_timeout(timeout)
        if fused is not None:
            warnings.warn("horovod_alq: fused= is deprecated; use codec='torch' (fused=False) or "
                          "codec='auto' (fused=True)", DeprecationWarning, stacklevel=2)
            if codec != "auto":
                raise ValueError("give codec= or the deprecated fused=, not both")
            codec = "auto" if fused else "torch"
        self._codec = codecs.check_name(codec)
        self._process_set = process_set
        self._transport_cache: HorovodTransport | None = None
        self._ops: dict[str, TorchOps] = {}
        # Without process_set=, allreduces over other process sets get a compressor of their own
        # (made at first use, with these settings): levels, statistics and rounds per set.
        self._settings = dict(bits=bits, bucket_size=bucket_size, bit_budget=bit_budget, bits_per=bits_per,
                              update_steps=update_steps,
                              update_every=update_every, min_size=self.min_size, seed=seed,
                              codec=self._codec, exchange=exchange, fusion_bytes=fusion_bytes,
                              bits_second=bits_second, adapt_second=adapt_second,
                              norm=self._quantizer.norm, overlap=bool(overlap), timeout=timeout)
        self._init_sets()

    # ------------------------------------------------------------------ configuration
    @property
    def exchange(self) -> str:
        return self._engine.exchange

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(method={self._method.name!r}, bits={self.bits}, "
                f"bucket_size={self.bucket_size}, norm={self.norm!r}, min_size={self.min_size}, "
                f"exchange={self.exchange!r})")

    # ------------------------------------------------------------------ Horovod interface
    @frontends.ClassOrInstance
    def compress(self, tensor: torch.Tensor):
        """Record ``tensor`` for this round's exchange; return the control vector to allreduce."""
        other = self._for_calling_process_set()
        if other is not None:
            small, ctx = other.compress(tensor)
            return small, frontends.Delegated(other, ctx)
        if self._engine.uid is None:  # named at its first compress of any tensor (every rank calls it)
            ps = self._process_set if self._process_set is not None else hvd().global_process_set
            self._engine.uid = process_set_uid(ps)
        if tensor.dtype not in COMPRESSIBLE or tensor.numel() < max(self.min_size, 1) or tensor.is_sparse:
            self._state.uncompressed_coordinates += tensor.numel()
            if tensor.dtype == torch.bfloat16:  # Horovod's torch allreduce rejects bfloat16
                return tensor.float(), _PassThrough(tensor.dtype)
            return tensor, _PassThrough(tensor.dtype)
        try:
            transport = self._transport()
        except NotMemberError as err:
            # Raising here would leave the members waiting in this collective: take part with a
            # vector that fails their checks, and raise in decompress.
            size = len(self._process_set.ranks or ())
            return torch.from_numpy(outsider_vector(size)).to(tensor.device), _Outsider(str(err))
        flat = tensor.detach().reshape(-1)
        entry, vec = self._engine.add(flat, flat.numel(), tuple(tensor.shape), tensor.dtype, transport,
                                      ops=self._ops_for(tensor.device))
        small = torch.from_numpy(vec).to(tensor.device)
        source = tensor if tensor.requires_grad and torch.is_grad_enabled() else None
        ctx = _Exchange(entry, tensor.shape, tensor.dtype, tensor.device, source)
        # The framework holds ctx until decompress; if it drops ctx first (its allreduce raised), the
        # entry leaves the round. Not `small`: frameworks may keep only an alias (Adasum: `small.data`).
        weakref.finalize(ctx, entry.abandon)
        return small, ctx

    @frontends.ClassOrInstance
    def decompress(self, tensor: torch.Tensor, ctx):
        """Exchange the round's codes (first call of a round) and return this tensor's reduced values."""
        if ctx is None:  # sparse gradients: Horovod reduced them itself
            return tensor
        if isinstance(ctx, frontends.Delegated):
            return ctx.compressor.decompress(tensor, ctx.ctx)
        if isinstance(ctx, _PassThrough):
            return tensor.to(ctx.dtype) if tensor.dtype != ctx.dtype else tensor
        if isinstance(ctx, _Outsider):
            raise RuntimeError(ctx.message)
        reduced = tensor.detach().double().cpu().numpy()
        out, scale = self._engine.finish(ctx.entry, reduced, self._ops_for(ctx.device), self._transport())
        out = out.to(device=ctx.device, dtype=ctx.dtype).view(ctx.shape)
        if ctx.source is not None:
            out = _QuantizedAllreduceGrad.apply(ctx.source, out, scale, self._transport().process_set)
        return out

    # ------------------------------------------------------------------ metrics and state
    @frontends.ClassOrInstance
    def metrics(self) -> dict:
        """``levels``, ``multiplier``, ``second_levels``, ``level_updates``, ``step``, ``calls``,
        ``payload_bytes`` (this rank's own payloads), ``coordinates``, ``uncompressed_coordinates``,
        ``bits_per_coordinate`` (of compressed tensors), ``bytes_sent`` / ``bytes_received`` (payload
        bytes this rank put on / took off the wire, all phases, headers included), ``exchange``;
        ``process_sets``: the same for each other process set this compressor served (by ranks)."""
        return self._sets_metrics(self._state.metrics())

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

    def reset(self) -> None:
        """Drop the round in progress (e.g. after a Horovod elastic reset); levels and counters stay."""
        self._engine.reset()
        self._transport_cache = None
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

    def _for_set(self, process_set) -> QuantizedCompressor:
        return QuantizedCompressor(self._method.name, process_set=process_set, **self._settings)


class ALQCompressor(frontends.ALQ, QuantizedCompressor):
    """ALQ for Horovod PyTorch: levels fitted by coordinate descent to the gradients'
    statistics (``normless=True``: ALQ-N).

    ``ALQCompressor(bits=3, bucket_size=8192, normless=False, norm=None, **keywords)``; ``norm="linf"``
    (max-abs buckets, the default) or ``"l2"`` (the paper's form); the other keywords are those of
    :class:`QuantizedCompressor`."""


class AMQCompressor(frontends.AMQ, QuantizedCompressor):
    """AMQ for Horovod PyTorch: levels ``+-{p**s, ..., p, 1}`` with the multiplier ``p`` adapted
    (``normless=True``: AMQ-N). Keywords as :class:`ALQCompressor`."""


class QSGDCompressor(frontends.QSGD, QuantizedCompressor):
    """QSGD for Horovod PyTorch, uniform levels: ``norm="linf"`` (default) is QSGDinf, ``norm="l2"``
    the original QSGD. Other keywords: those of :class:`QuantizedCompressor`."""


class NUQSGDCompressor(frontends.NUQSGD, QuantizedCompressor):
    """NUQSGD for Horovod PyTorch: fixed exponential levels ``+-{2**-s, ..., 1/2, 1}``, L2 buckets."""


class TernGradCompressor(frontends.TernGrad, QuantizedCompressor):
    """TernGrad for Horovod PyTorch: levels {-1, 0, 1} times the bucket's max-abs, 2 bits per
    coordinate (``bits`` other than 2 is refused)."""


def compressor_for(method: str, **kwargs) -> QuantizedCompressor:
    """The compressor for a method name ("alq", "alq-n", "amq", "amq-n", "qsgdinf", "qsgd", "nuqsgd",
    "terngrad"), with the classes' keywords: ``compressor_for("alq-n", bits=3)`` is
    ``ALQCompressor(bits=3, normless=True)``. TernGrad ignores ``bits`` (always 2)."""
    return frontends.compressor_by_name(globals(), method, **kwargs)
