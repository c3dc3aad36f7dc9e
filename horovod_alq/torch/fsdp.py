"""FSDP2's gradient reduce-scatter with the adaptive quantizers (``fully_shard``, no Horovod).

Usage (launched with ``torchrun``; gloo on CPU, NCCL on GPU)::

    from torch.distributed.fsdp import fully_shard
    from horovod_alq.torch.fsdp import ALQReduceScatter, quantize_reduce_scatter

    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    comm = quantize_reduce_scatter(model, ALQReduceScatter(method="alq", bits=3, bucket_size=8192))
    ...
    comm.metrics()          # the Horovod compressors' keys
    torch.save({"alq": comm.state_dict(), ...}, path)

How it works: FSDP2 reduces each parameter group's gradients with one reduce-scatter of a flat
input of ``N * S`` coordinates, shard ``j`` (``S`` of them) being what rank ``j`` owns. This comm
quantizes the N shards separately, sends shard ``j``'s codes to rank ``j`` (one ``all_to_all_single``
of bit-packed codes) and rank ``j`` decodes and sums its N shards in float32, straight into FSDP's
output (:mod:`horovod_alq.exchange.reduce_scatter`): one quantization, about ``(N - 1)/N (b + 32/d)``
bits sent per coordinate. One backward pass is one *streamed round* of the same engine, protocol,
wire format, methods and refit schedule as the DDP hook and the Horovod compressors: the first
reduce-scatter of a backward runs a small handshake (settings, levels, round number, refit flag,
``min_size``; a rank that differs raises on every rank before any payload moves), every later one
exchanges at once, and at the end of the backward (an autograd engine callback) a refit round
combines the statistics of every rank with one small allreduce: every rank switches levels at the
same step. A call outside a backward pass is a round of its own.

Ops: ``ReduceOp.AVG``, ``SUM`` and ``PREMUL_SUM`` (its factor scales the decoded sum; FSDP passes
it for ``set_reduce_scatter_divide_factor``); any other raises naming it. Inputs of float32,
bfloat16, float16 or float64 (``MixedPrecisionPolicy(reduce_dtype=...)``) are quantized from
float32 and the output is written in the input's dtype. Inputs with fewer than ``min_size``
elements go through torch.distributed's own reduce-scatter. A quantization bucket holding NaN or
Inf comes back NaN in its owner's shard. HSDP (``fully_shard(mesh=...)`` with a replicate
dimension): the reduce-scatter over the shard dimension is quantized; the all-reduce across
replicas stays FSDP's own (float).

``compress="when-faster"`` (the default's choice here, :mod:`horovod_alq.core.speed`): the first
reduce-scatter of a backward asks the arbiter, alike on every rank, whether the backward is
quantized. A 16-bit backward reduce-scatters every input as ``MixedPrecisionPolicy(reduce_dtype=
torch.bfloat16)`` does (torch.distributed's own reduce-scatter of a bfloat16 cast, float16 inputs in
float16; the op's factor applied to the sum in the output's dtype); in refit steps every rank
collects the statistics of its inputs and refits at the end of the backward, and the step counter
advances as in a quantized round. Error-feedback buffers are kept for the next quantized backward.
"""

from __future__ import annotations

import functools
import math
from typing import Sequence

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

from ..core.protocol import PREFIX, shape_hash, stable_hash
from ..core.speed import SpeedArbiter
from ..exchange import registry, topology
from ..exchange.reduce_scatter import NAME
from ..settings import Settings
from .dist_state import COMPRESSIBLE, StreamedState
from .dist_transport import WATCHDOG, SettleOnce

__all__ = ["ALQReduceScatter", "quantize_reduce_scatter"]

#: ``reduce_scatter_tensor`` is called ``reduce_scatter_single`` from PyTorch 2.13 on.
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class ALQReduceScatter(StreamedState, ReduceScatter):
    """A ``torch.distributed.fsdp`` ``ReduceScatter`` comm that sends bit-packed quantized codes.

    Create one per model, on every rank with the same arguments, and set it on every FSDP module
    (:func:`quantize_reduce_scatter`, or ``module.set_custom_reduce_scatter(comm)``).

    Parameters
    ----------
    process_group : ProcessGroup, optional
        The group to reduce over; None (default): the group FSDP passes (its shard group). When
        given, a call with another group raises.
    method, bits, bucket_size, **keywords
        The shared settings, :class:`horovod_alq.settings.Settings` (its fields as keywords;
        None: the default). ``bucket_size`` counts from each shard's start (``bits="auto"``: from
        each parameter chunk's start); ``update_steps`` count backward passes. ``bits="auto"``
        gives a width per parameter chunk of every shard: the parameters of a reduce-scatter are
        known from :func:`quantize_reduce_scatter`; an input whose layout it did not record (or one
        that other modules share with another layout) is one tensor. ``exchange``: ``"auto"`` (the
        default) reduce-scatters node-aware when the shard group spans several nodes of several ranks
        (an exact reduce-scatter inside each node, then only the node sums' codes between nodes:
        :mod:`horovod_alq.exchange.node_reduce_scatter`), flat otherwise; ``"hierarchical"``: always
        node-aware. A setting FSDP2 does not serve raises ValueError naming why
        (:data:`horovod_alq.settings.NOT_SERVED`; the table in docs/guides/settings.md).
    settings : horovod_alq.settings.Settings, optional
        Settings to start from; the keywords given override them.
    """

    what = "reduce-scatter comm"
    FRONT_END = "FSDP2"
    ENGINE_EXCHANGE = "allgather"  # unused by reduce-scatter rounds; kept for the engine's checks

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
        self._configure(process_group, settings, "fsdp", method=method, bits=bits, bucket_size=bucket_size, **keywords)
        self._task = -1  # the autograd graph task of the round in progress (-1: outside backward)
        # bits="auto": (input elements, shards) -> each parameter chunk's (elements, shape code) in a
        # shard (None: modules with other layouts share that size), from quantize_reduce_scatter
        self._layouts: dict[tuple[int, int], tuple | None] = {}
        if self.round_state.compress == "when-faster":
            self.round_state.speed = SpeedArbiter(what=self.FRONT_END)
        self._sixteen: _Sixteen | None = None  # the 16-bit backward in progress

    def record_layout(self, module) -> None:
        """``bits="auto"``: remember how FSDP lays out ``module``'s reduce-scatter input (shard
        ``j``: every parameter's ``j``-th dim-0 chunk, padded, in order), so that its parameters
        get widths of their own (:func:`quantize_reduce_scatter` calls this for every module)."""
        layout = _shard_layout(module)
        if layout is None:
            return
        n, pieces = layout
        key = (n * sum(k for k, _ in pieces), n)
        self._layouts[key] = pieces if self._layouts.get(key, pieces) == pieces else None

    @property
    def exchange(self) -> str:
        return NAME

    def _exchange_for(self, transport) -> str:
        """The reduce-scatter of a call over ``transport``'s ranks (:func:`.registry.shard_exchange`)."""
        return registry.shard_exchange(self.settings.exchange, transport.size, topology.local_size(transport))

    # ------------------------------------------------------------------ the Comm interface
    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A buffer for FSDP's reduce-scatter input or output (a plain tensor)."""
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op,
        async_op: bool = False,
        *,
        ident: str | None = None,
    ):
        """Reduce ``input_tensor`` (N shards) over ``group`` and leave this rank's shard, scaled
        as ``op`` says, in ``output_tensor``. With ``async_op`` returns a Work whose ``wait()``
        leaves the result there; otherwise returns None with the result in place. ``ident``: the
        FSDP module whose gradients these are (:func:`quantize_reduce_scatter` passes its name),
        the key of their error-feedback buffer; required with ``error_feedback=True``."""
        group = self._group(group)
        stages = self._stages(group, NAME)
        exchange = self._exchange_for(stages[0])
        if exchange != NAME:
            stages = self._stages(group, exchange)
        n = stages[0].size
        scale = _scale(op, n)
        _check(output_tensor, input_tensor, n)
        if input_tensor.dtype not in COMPRESSIBLE or input_tensor.numel() < max(self.min_size, 1):
            self.round_state.uncompressed_coordinates += input_tensor.numel()
            _REDUCE_SCATTER(output_tensor, input_tensor, op=dist.ReduceOp.SUM, group=group)
            if scale != 1.0:
                output_tensor.mul_(scale)
            return _done_work() if async_op else None
        if self.round_state.speed is not None and not self._quantizes(stages[0]):
            self._sixteen_call(output_tensor, input_tensor, group, scale)
            return _done_work() if async_op else None
        rnd = self._open(stages, input_tensor.device, exchange)
        flat = input_tensor.detach().reshape(-1)
        if flat.dtype != torch.float32:
            flat = flat.float()
        future: torch.futures.Future = torch.futures.Future()
        # the exchange settles the future, or the watchdog fails it after `timeout` (FSDP may wait
        # for an async call's Work in C++, where no bounded wait of ours runs)
        settle = SettleOnce(future, f"{PREFIX}.fsdp.{self.round_state.step - 1}.rs", stages[0].scope, self.timeout)
        WATCHDOG.watch(settle)
        pieces = self._layouts.get((flat.numel(), n)) if self.bits == "auto" else None
        if self.round_state.feedback is not None and ident is None:
            raise ValueError(
                f"{PREFIX}: error_feedback=True keeps each module's error under its name: set this comm "
                "with horovod_alq.torch.fsdp.quantize_reduce_scatter(model, comm), not set_custom_reduce_scatter"
            )
        rnd.add(
            flat,
            flat.numel(),
            functools.partial(_complete, settle, output_tensor, scale),
            tensors=list(pieces) * n if pieces else None,
            idents=None if ident is None else [(ident, flat.numel())],
        )
        if self._task < 0:  # a call outside a backward pass is a round of its own
            self._close()
        if async_op:
            return torch._C._distributed_c10d._create_work_from_future(future)
        future.wait()
        return None

    # ------------------------------------------------------------------ the round
    def _group(self, group):
        if self.process_group is not None and group is not self.process_group:
            raise ValueError(
                f"{PREFIX}: this reduce-scatter comm was made for process group "
                f"{dist.get_process_group_ranks(self.process_group)}, and FSDP called it for "
                f"{dist.get_process_group_ranks(group)}; make it with process_group=None "
                f"(the group FSDP passes) or the FSDP mesh's shard group"
            )
        return group

    def _open(self, stages, device: torch.device, exchange: str = NAME):
        """The round of the backward pass in progress: opened (the handshake) by its first call."""
        task = torch._C._current_graph_task_id()
        if self._round is not None and task != self._task:
            self._round = None  # the backward of that round raised before its end on this rank
        if self._round is None:
            # bits="auto": the recorded layouts make the round's tensors; ranks that recorded others
            # would allocate over different rows, so the handshake compares them (every rank raises)
            order = stable_hash(repr(sorted(self._layouts.items()))) if self.bits == "auto" else 0
            self._round = self.engine.open_stream(
                self._ops_for(device), stages, min_size=self.min_size, exchange=exchange, order=order
            )
            self._task = task
            if task >= 0:  # closed once the backward pass is over (after FSDP's own final callback)
                torch.autograd.Variable._execution_engine.queue_callback(self._close)
        return self._round

    def _close(self) -> None:
        """The round's end: its refit, if any (waits for every call of the round then)."""
        rnd, self._round, self._task = self._round, None, -1
        if rnd is not None:
            rnd.close()

    @property
    def _pending(self) -> bool:
        return self._round is not None or self._sixteen is not None

    # ------------------------------------------------------------------ compress="when-faster"
    def _quantizes(self, stage) -> bool:
        """Whether this call's backward is quantized: its first call asks the arbiter (every rank alike)."""
        task = torch._C._current_graph_task_id()
        if self._pending:
            if task >= 0 and task == self._task:
                return self._sixteen is None
            self._round = self._sixteen = None  # that backward raised before its end on this rank
        speed = self.round_state.speed
        speed.rank = stage.rank
        if speed.start(stage.allreduce_max, f"{PREFIX}.fsdp.speed"):
            return True  # _open opens the round
        self._sixteen, self._task = _Sixteen(self.engine.sixteen_stats(), stage), task
        if task >= 0:  # ended once the backward pass is over
            torch.autograd.Variable._execution_engine.queue_callback(self._close_sixteen)
        return False

    def _sixteen_call(self, output: torch.Tensor, source: torch.Tensor, group, scale: float) -> None:
        """A call of a 16-bit backward: :func:`_bf16_reduce_scatter`, and in refit steps the
        statistics of the input (as the flat quantized round collects them)."""
        sixteen = self._sixteen
        if sixteen.stats is not None:
            sixteen.stats.append(
                self._ops_for(source.device).statistics(source.detach().reshape(-1).float(), self.engine.quantizer)
            )
        _bf16_reduce_scatter(output, source, group, scale)
        if self._task < 0:  # a call outside a backward pass is a round of its own
            self._close_sixteen()

    def _close_sixteen(self) -> None:
        """A 16-bit backward's end: in refit steps every rank refits from its own statistics (small
        collectives); the step counter advances."""
        sixteen, self._sixteen, self._task = self._sixteen, None, -1
        if sixteen is not None:
            self.engine.end_sixteen(sixteen.stats, sixteen.stage)


class _Sixteen:
    """A 16-bit backward in progress: its statistics (None: not a refit step), the transport it refits over."""

    def __init__(self, stats: list | None, stage) -> None:
        self.stats, self.stage = stats, stage


def _bf16_reduce_scatter(output: torch.Tensor, source: torch.Tensor, group, scale: float) -> None:
    """FSDP2's bf16 reduce-scatter (``MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)``): the sum of
    ``source`` cast to bfloat16 (float16 stays float16), reduce-scattered by torch.distributed,
    into ``output`` in its dtype, times ``scale``. Its wait is torch.distributed's own, bounded by
    the process group's timeout, not ``timeout`` (gloo's reduce-scatter work never reports completion
    to a poll, nor honours ``wait(timeout)``)."""
    half = source.detach() if source.dtype in (torch.bfloat16, torch.float16) else source.detach().to(torch.bfloat16)
    out = output if output.dtype == half.dtype else torch.empty(output.shape, dtype=half.dtype, device=output.device)
    _REDUCE_SCATTER(out, half.contiguous(), op=dist.ReduceOp.SUM, group=group)
    if out is not output:
        output.copy_(out)
    if scale != 1.0:
        output.mul_(scale)


def _shard_layout(module) -> tuple[int, tuple] | None:
    """(shards, each parameter chunk's (elements, shape code)) of an FSDP module's reduce-scatter
    input, from FSDP's parameter group (dim-0 sharding); None where its internals do not say."""
    try:
        group = module._get_fsdp_state()._fsdp_param_group
        n = int(group.mesh_info.shard_mesh_size)
        params = list(group.fsdp_params)
        if not params or any(p.fsdp_placement.dim != 0 for p in params):
            return None
        sizes = [tuple(p._orig_size) for p in params]
    except (AttributeError, TypeError):
        return None
    return n, tuple((-(-s[0] // n) * math.prod(s[1:]) if s else 1, shape_hash(s, "fsdp")) for s in sizes)


def _scale(op, size: int) -> float:
    """The factor on the sum that ``op`` asks for; ValueError naming any op but AVG, SUM, PREMUL_SUM."""
    kind = getattr(op, "op", op)
    if kind == dist.ReduceOp.AVG:
        return 1.0 / size
    if kind == dist.ReduceOp.SUM:
        return 1.0
    if kind == dist.ReduceOp.PREMUL_SUM:
        return float(op.factor)
    raise ValueError(
        f"{PREFIX}: a quantized reduce-scatter can average or sum (ReduceOp.AVG, SUM, PREMUL_SUM), not {kind}"
    )


def _check(output: torch.Tensor, source: torch.Tensor, size: int) -> None:
    if not (source.is_floating_point() and output.is_floating_point()):
        raise TypeError(
            f"{PREFIX}: a quantized reduce-scatter reduces floating-point tensors, got input "
            f"{source.dtype} and output {output.dtype}"
        )
    if source.numel() != size * output.numel():
        raise ValueError(
            f"{PREFIX}: a reduce-scatter over {size} ranks needs an input of {size} x the output's "
            f"elements; got an input of {source.numel()} and an output of {output.numel()}"
        )
    if not output.is_contiguous():
        raise ValueError(f"{PREFIX}: the reduce-scatter output must be contiguous")


def _complete(settle: SettleOnce, output: torch.Tensor, scale: float, decoded, error) -> None:
    """A call's exchange finished: this rank's shard, scaled, into the output (or the error)."""
    if error is not None:
        settle.set_exception(error)
        return
    if settle.settled:  # the watchdog failed it already: leave the output alone
        return
    try:
        lo, hi = decoded.start, decoded.start + decoded.length
        if output.dtype == torch.float32:
            decoded.read(lo, hi, scale, output.view(-1))
        else:
            output.view(-1).copy_(decoded.read(lo, hi, scale))
    except BaseException as exc:  # noqa: BLE001
        settle.set_exception(exc)
        return
    settle.set_result(None)


def _done_work():
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(None)
    return torch._C._distributed_c10d._create_work_from_future(future)


def quantize_reduce_scatter(model: torch.nn.Module, comm: ALQReduceScatter | None = None, **kwargs) -> ALQReduceScatter:
    """Set ``comm`` (default: ``ALQReduceScatter(**kwargs)``) as the reduce-scatter of every
    ``fully_shard``-ed module of ``model`` (one comm: one round per backward); returns it.
    Raises ValueError if no module of ``model`` is an FSDP module."""
    if comm is None:
        comm = ALQReduceScatter(**kwargs)
    elif kwargs:
        raise TypeError("give a comm or its keywords, not both")
    modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not modules:
        raise ValueError(
            f"{PREFIX}: no module of this {type(model).__name__} was fully_shard-ed; call "
            f"torch.distributed.fsdp.fully_shard on its blocks and on the model first"
        )
    names = {id(m): name for name, m in model.named_modules()}
    for module in modules:
        if _all_reduce_only(module):
            raise ValueError(
                f"{PREFIX}: FSDP reduces the gradients of this {type(module).__name__} with its own "
                "all_reduce alone (replicate(), or a mesh whose shard dimension has one rank): FSDP2 calls "
                "a custom reduce-scatter only over a shard group of several ranks and has no custom "
                "all-reduce, so ALQ would never run. Use DDP with horovod_alq.torch.ddp.alq_hook, or "
                "fully_shard over the data-parallel ranks"
            )
        module.set_custom_reduce_scatter(_Named(comm, names[id(module)] or "(root)"))
        comm.record_layout(module)
    return comm


class _Named(ReduceScatter):
    """``comm`` for one FSDP module: its calls carry the module's name (error feedback's key)."""

    def __init__(self, comm: ALQReduceScatter, name: str) -> None:
        self.comm, self.name = comm, name

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return self.comm.allocate(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):
        return self.comm(output_tensor, input_tensor, group, op, async_op, ident=self.name)


def _all_reduce_only(module) -> bool:
    """Whether FSDP reduces ``module``'s gradients by a float all_reduce across replicas without a
    reduce-scatter of several ranks (``replicate()``; HSDP with one rank per shard group)."""
    try:
        groups = module._get_fsdp_state()._fsdp_param_groups
    except AttributeError:
        return False
    for group in groups:
        info = group.mesh_info
        if getattr(info, "shard_mesh_size", 1) == 1 and getattr(info, "replicate_mesh_size", 1) > 1:
            return True
    return False
