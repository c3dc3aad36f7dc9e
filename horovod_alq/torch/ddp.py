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
once per gradient bucket, in bucket order; each call records the bucket and returns a future; the
call for the last bucket (``bucket.is_last()``) runs the round on every rank alike: the handshake
(settings, levels, round number and the buckets of every rank must agree, else every rank raises),
the quantized exchange of all the step's buckets, fused into bucket-aligned buffers, the refit in
refit steps, then the plain ``all_reduce`` of the buckets that travel uncompressed (fewer than
``min_size`` elements, or not floating point), and completes every bucket's future with the
average over the group. Nothing is sent before the last bucket: the price of never leaving a rank
in a collective that another rank does not issue.

Semantics: the hook gets each bucket's local gradients and returns their average over the process
group (as DDP's default allreduce does). Works with ``no_sync()`` accumulation (no hook runs
inside it; the next synchronized step exchanges the accumulated gradients), ``static_graph``,
``find_unused_parameters``, ``gradient_as_bucket_view`` and sub-groups (``process_group=``; every
member builds its state with the same group). A quantization bucket (``bucket_size`` coordinates)
holding NaN or Inf comes back NaN, so ``torch.amp.GradScaler`` skips the step. Not supported: DDP's
``join()`` for uneven inputs (a joined rank would not take part in the round).
"""

from __future__ import annotations

import itertools
import logging
import os
from typing import Any, Sequence

import numpy as np
import torch
import torch.distributed as dist

from ..core import frontends
from ..core.methods import get_method
from ..core.protocol import PREFIX
from ..core.quantizer import Quantizer
from ..core.rounds import RoundState, schedule_from
from ..exchange import Engine
from . import codecs
from .dist_transport import DistTransport
from .transport import TorchOps, ops_for

__all__ = ["ALQState", "alq_hook"]

logger = logging.getLogger(__name__)
COMPRESSIBLE = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_UIDS = itertools.count()
#: Keywords saved by ``state_dict`` and checked by ``load_state_dict``.
_SETTINGS = ("method", "bits", "bucket_size", "norm")


class ALQState:
    """State of :func:`alq_hook`: the method settings, the levels and the round bookkeeping.

    Create one per DDP model, on every rank with the same arguments, and register it with
    ``model.register_comm_hook(state, alq_hook)``.

    Parameters (also attributes)
    ----------------------------
    process_group : ProcessGroup, optional
        The group DDP averages over (the same as ``DistributedDataParallel(process_group=...)``);
        None: the default (world) group.
    method : str
        ``"alq"``, ``"alq-n"``, ``"amq"``, ``"amq-n"`` (adaptive), ``"qsgdinf"``, ``"qsgd"``,
        ``"nuqsgd"``, ``"terngrad"`` (fixed levels; TernGrad always sends 2 bits).
    bits : int
        Bits per coordinate on the wire, 2..8. Default 3.
    bucket_size : int
        Coordinates per float32 norm (not DDP's bucket: those are ``bucket_cap_mb``). Default 8192.
    exchange : {"auto", "allgather", "two-phase"}
        How codes travel; ``auto``: two-phase from 4 ranks on (see the Horovod compressors).
    seed : int, optional
        Seed of the stochastic rounding (mixed with rank, round, buffer and phase); None: fresh
        entropy on every rank.
    update_steps : sequence of int, optional
        DDP steps whose statistics refit the levels (default (0, 100, 2000)); new levels apply
        from the next step.
    update_every : int, optional
        After the last of ``update_steps``, refit every this many steps (default 10000; 0: never).
    min_size : int
        DDP buckets with fewer elements travel uncompressed (plain ``all_reduce``). Default 1024.
    codec : str
        Codec backend (:mod:`horovod_alq.torch.codecs`): "auto" (default: Triton for CUDA buckets
        when importable, the compiled CPU codec for CPU buckets when it builds, else torch ops),
        or a backend's name.
    fusion_bytes : int, optional
        The step's buckets are quantized and exchanged in buffers of this many bytes of float32
        (default 64 MiB or ``$HOROVOD_ALQ_FUSION_BYTES``; 0: one buffer per DDP bucket).
    bits_second : int, optional
        Bits of the two-phase exchange's second quantization (default ``bits``).
    adapt_second : bool, optional
        As for :class:`horovod_alq.torch.ALQCompressor` (default None: the second quantization
        takes the first one's levels at equal bits, and is refit at other bits).
    norm : {"l2", "linf"}, optional
        Bucket norm (adaptive methods take either; None: the method's default); see
        :class:`horovod_alq.core.Quantizer`.

    Attributes
    ----------
    engine : horovod_alq.exchange.Engine
        The round driver; ``engine.quantizer`` holds the current levels.
    round_state : horovod_alq.core.rounds.RoundState
        Counters, schedule and both quantizers (what :meth:`metrics` and :meth:`state_dict` read).
    """

    def __init__(self, process_group=None, method: str = "alq", bits: int = 3, bucket_size: int = 8192,
                 exchange: str = "auto", seed: int | None = None, *, update_steps: Sequence[int] | None = None,
                 update_every: int | None = None, min_size: int = 1024, codec: str = "auto",
                 fusion_bytes: int | None = None, bits_second: int | None = None,
                 adapt_second: bool | None = None, norm: str | None = None) -> None:
        m = get_method(method)
        if m.name == "terngrad":
            bits = 2
        self.process_group = process_group
        self.method = m.name
        self.min_size = frontends.check_min_size(min_size)
        self.codec = codecs.check_name(codec)
        quantizer = Quantizer(m.name, bits=bits, bucket_size=bucket_size, norm=norm)
        self.bits = quantizer.bits
        self.bucket_size = quantizer.bucket_size
        self.norm = quantizer.norm
        second = Quantizer(m.name, bits=self.bits if bits_second is None else bits_second,
                           bucket_size=self.bucket_size, norm=self.norm)
        self.round_state = RoundState(quantizer, schedule_from(update_steps, update_every), second,
                                      adapt_second)
        self.seed = int.from_bytes(os.urandom(8), "little") if seed is None else int(seed) & ((1 << 64) - 1)
        self.engine = Engine(quantizer, self.round_state, exchange=exchange, fusion_bytes=fusion_bytes,
                             seed=self.seed, uid=f"ddp{next(_UIDS)}")
        self._transport: DistTransport | None = None
        self._ops: dict[str, TorchOps] = {}
        self._pending: list[tuple[int, torch.Tensor, torch.futures.Future, bool]] = []

    # ------------------------------------------------------------------ configuration
    @property
    def levels(self) -> np.ndarray:
        return self.engine.quantizer.levels

    @property
    def exchange(self) -> str:
        return self.engine.exchange

    def __repr__(self) -> str:
        return (f"ALQState(method={self.method!r}, bits={self.bits}, bucket_size={self.bucket_size}, "
                f"norm={self.norm!r}, min_size={self.min_size}, exchange={self.exchange!r})")

    # ------------------------------------------------------------------ metrics and state
    def metrics(self) -> dict:
        """``levels``, ``multiplier``, ``second_levels``, ``level_updates``, ``step`` (DDP steps
        exchanged), ``calls`` (quantized DDP buckets), ``payload_bytes``, ``coordinates``,
        ``uncompressed_coordinates``, ``bits_per_coordinate``, ``bytes_sent`` / ``bytes_received``,
        ``exchange``: the keys of the Horovod compressors' ``metrics()``."""
        return self.round_state.metrics()

    def state_dict(self) -> dict:
        """Levels (both quantizations), counters, seed and settings: a resumed run continues with
        identical levels. Call between steps."""
        if self._pending:
            raise RuntimeError("state_dict() during a DDP step's exchange: call it between steps")
        return {**{k: getattr(self, k) for k in _SETTINGS}, "seed": self.engine.seed,
                **self.round_state.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Restore a :meth:`state_dict` (same method, bits, bucket size and norm). Load the same state on
        every rank, or the next step raises on every rank (the handshake compares the levels)."""
        if self._pending:
            raise RuntimeError("load_state_dict() during a DDP step's exchange: call it between steps")
        differ = [f"{k}: saved {state[k]!r}, this state {getattr(self, k)!r}" for k in _SETTINGS
                  if k in state and state[k] != getattr(self, k)]
        if differ:
            raise ValueError(f"{PREFIX}: the saved state has other settings ({'; '.join(differ)})")
        self.round_state.load_state_dict(state)
        self.seed = self.engine.seed = int(state["seed"])

    def __getstate__(self) -> dict:
        """Pickling (``torch.save(state)``): settings and :meth:`state_dict`; the process group is
        not picklable and comes back as the default group."""
        config = {k: getattr(self, k) for k in ("method", "bits", "bucket_size", "norm", "min_size", "codec")}
        st = self.round_state
        config.update(exchange=self.exchange, fusion_bytes=self.engine.fusion_bytes,
                      update_steps=st.schedule.steps, update_every=st.schedule.every,
                      bits_second=st.second.bits, adapt_second=st.adapt_second)
        return {"config": config, "state": self.state_dict()}

    def __setstate__(self, saved: dict) -> None:
        self.__init__(None, **saved["config"])
        self.load_state_dict(saved["state"])

    # ------------------------------------------------------------------ the round
    def _transport_for(self) -> DistTransport:
        if self._transport is None:
            self._transport = DistTransport(self.process_group)
        return self._transport

    def _ops_for(self, device: torch.device) -> TorchOps:
        return ops_for(self._ops, device, self.codec)

    def _add(self, index: int, buffer: torch.Tensor) -> torch.futures.Future:
        if self._pending and index <= self._pending[-1][0]:
            # the previous step never reached its last bucket on this rank (its backward raised)
            self._fail(RuntimeError(f"{PREFIX}: a DDP step was abandoned before its last bucket"))
        transport = self._transport_for()
        quantized = buffer.dtype in COMPRESSIBLE and buffer.numel() >= max(self.min_size, 1)
        if quantized:
            flat = buffer.detach().reshape(-1)
            # (index, numel) as the "shape": unique per bucket, so the engine takes its ordered path
            self.engine.add(flat, flat.numel(), (index, flat.numel()), buffer.dtype, transport)
        else:
            self.round_state.uncompressed_coordinates += buffer.numel()
        future: torch.futures.Future = torch.futures.Future()
        self._pending.append((index, buffer, future, quantized))
        return future

    def _run(self) -> None:
        """The last bucket's hook: exchange the step, then complete every bucket's future."""
        pending, self._pending = self._pending, []
        try:
            transport = self._transport_for()
            n = transport.size
            quantized = [(buf, fut) for _, buf, fut, q in pending if q]
            device = pending[-1][1].device
            if not quantized:
                # a 1-element placeholder, so that this rank still takes part in the handshake (a rank
                # whose settings quantize some bucket must meet this one there and raise, not hang)
                self.engine.add(torch.zeros(1, device=device), 1, (-1, 1), torch.float32, transport)
                st, before = self.round_state, self.round_state.state_dict()
            reads = self.engine.exchange_round(self._ops_for(device), transport)
            if not quantized:
                for key in ("calls", "payload_bytes", "coordinates", "bytes_sent", "bytes_received"):
                    setattr(st, key, before[key])
            for (buf, _), read in zip(quantized, reads):
                if buf.dtype == torch.float32 and buf.is_contiguous():
                    read(1.0 / n, buf.view(-1))  # decoded straight into the bucket
                else:
                    buf.copy_(read(1.0 / n).view_as(buf))
            works = []
            for _, buf, _, q in pending:
                if not q:
                    buf.div_(n)
                    works.append(dist.all_reduce(buf, group=self.process_group, async_op=True))
            for work in works:
                work.wait()
        except BaseException as exc:
            self.engine.reset()
            for _, _, fut, _ in pending:
                fut.set_exception(exc)
            raise
        for _, buf, fut, _ in pending:
            fut.set_result(buf)

    def _fail(self, exc: BaseException) -> None:
        pending, self._pending = self._pending, []
        self.engine.reset()
        for _, _, fut, _ in pending:
            if not fut.done():
                fut.set_exception(exc)


def alq_hook(state: ALQState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: the average over ``state.process_group`` of the bucket's gradients,
    quantized with ``state``'s method (register with ``model.register_comm_hook(state, alq_hook)``).

    Returns a future holding one tensor of the bucket's shape and dtype (the bucket's own buffer,
    overwritten with the average); it completes when the step's last bucket has been exchanged.
    """
    future = state._add(bucket.index(), bucket.buffer())
    if bucket.is_last():
        state._run()
    return future


# DDP checks the hook's annotations as objects (this module's are strings: ``from __future__``)
alq_hook.__annotations__ = {"state": ALQState, "bucket": dist.GradBucket,
                            "return": torch.futures.Future[torch.Tensor]}
