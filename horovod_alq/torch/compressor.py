"""Horovod compressors for PyTorch that put bit-packed codes on the wire.

Usage::

    import horovod.torch as hvd
    from horovod_alq.torch import ALQCompressor
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=ALQCompressor(bits=3, bucket_size=8192))

How the exchange works (``docs/design.md``): ``compress`` encodes the gradient into a uint8 payload,
starts an allgather of it and hands Horovod's allreduce a small float64 vector
``[1, k, k**2, statistics...]``; ``decompress`` checks the reduced vector (same tensor on every
rank, the reduction's scale), waits for the allgather, validates every rank's header, decodes,
sums and scales. Statistics of refit rounds are combined by that same allreduce, and every rank
refits from the identical sum.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from ..core import frontends
from ..core.methods import get_method
from ..core.quantizer import Quantizer
from ..core.rounds import RoundState, schedule_from
from ..core.statistics import GRID, BucketMoments, normless_statistics
from ..core.wire import HEADER_SIZE, Header, check_header, pack_header, parse_header
from . import fused, kernels

COMPRESSIBLE = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_UIDS = itertools.count()


def _hvd():
    """horovod.torch, imported on first use so that the kernels work without Horovod."""
    import horovod.torch as hvd

    return hvd


def _splitmix64(z: int) -> int:
    mask = (1 << 64) - 1
    z = (z + 0x9E3779B97F4A7C15) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    return z ^ (z >> 31)


@dataclass
class _Exchange:
    """Context of one compressed tensor between compress and decompress."""

    slot: int
    shape: torch.Size
    dtype: torch.dtype
    numel: int
    handle: Any
    collecting: bool


@dataclass
class _PassThrough:
    """Context of a tensor that travels uncompressed (too small, or not floating point)."""

    dtype: torch.dtype


class QuantizedCompressor(frontends.CompressorBase):
    """Base class: a Horovod ``compression=`` object for one quantization method.

    Parameters
    ----------
    method : str
        One of :data:`horovod_alq.core.methods.METHODS`.
    bits : int
        Bits per coordinate on the wire (2..8; TernGrad: 2).
    bucket_size : int
        Coordinates per float32 norm. 8192 costs 0.004 extra bits per coordinate.
    update_steps : sequence of int, optional
        Rounds (optimizer steps) whose statistics refit the levels; default (0, 100, 2000).
    update_every : int, optional
        After the last of ``update_steps``, refit every this many rounds; default 10000, 0: never.
    min_size : int
        Tensors with fewer elements travel uncompressed (Horovod's plain allreduce). Default 1024.
    seed : int, optional
        Seed of the stochastic rounding (combined with the rank). Default: fresh entropy.
    fused : bool, optional
        Use the compiled CPU codec (default: when it builds). CUDA tensors use torch kernels.
    norm : {"l2", "linf"}, optional
        Bucket norm (adaptive methods take either; None: the method's default). See
        :class:`horovod_alq.core.Quantizer`.
    """

    method: str = ""

    def __init__(self, method: str | None = None, bits: int = 3, bucket_size: int = 8192, *,
                 update_steps: Sequence[int] | None = None, update_every: int | None = None,
                 min_size: int = 1024, seed: int | None = None, fused: bool | None = None,
                 norm: str | None = None) -> None:
        method = method or self.method
        self._method = get_method(method)
        self._quantizer = Quantizer(self._method.name, bits=bits, bucket_size=bucket_size, norm=norm)
        self._state = RoundState(self._quantizer, schedule_from(update_steps, update_every))
        self.min_size = frontends.check_min_size(min_size)
        self._seed = int.from_bytes(os.urandom(8), "little") if seed is None else int(seed) & ((1 << 64) - 1)
        self._use_fused = fused
        self._uid = next(_UIDS)
        self._levels_cache: dict[str, torch.Tensor] = {}
        self._grid: torch.Tensor | None = None

    # ------------------------------------------------------------------ configuration
    @property
    def levels(self) -> np.ndarray:
        return self._quantizer.levels

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(method={self._method.name!r}, bits={self.bits}, "
                f"bucket_size={self.bucket_size}, norm={self.norm!r}, min_size={self.min_size})")

    # ------------------------------------------------------------------ Horovod interface
    @frontends.ClassOrInstance
    def compress(self, tensor: torch.Tensor):
        """Encode ``tensor``, start the allgather of its payload, return the small vector to allreduce."""
        if tensor.dtype not in COMPRESSIBLE or tensor.numel() < max(self.min_size, 1) or tensor.is_sparse:
            self._state.uncompressed_coordinates += tensor.numel()
            if tensor.dtype == torch.bfloat16:  # Horovod's torch allreduce rejects bfloat16
                return tensor.float(), _PassThrough(tensor.dtype)
            return tensor, _PassThrough(tensor.dtype)
        state = self._state
        collecting = state.collecting
        payload = self._encode(tensor, state.calls)
        slot = state.begin(tensor.numel(), payload.numel())
        handle = _hvd().allgather_async(payload, name=f"horovod_alq.{self._uid}.{slot}")
        head = [1.0, float(slot), float(slot) ** 2]
        if collecting:
            head.extend(self._statistics(tensor))
        small = torch.tensor(head, dtype=torch.float64, device=tensor.device)
        return small, _Exchange(slot, tensor.shape, tensor.dtype, tensor.numel(), handle, collecting)

    @frontends.ClassOrInstance
    def decompress(self, tensor: torch.Tensor, ctx):
        """Wait for the payloads, check them, and return the reduced gradient in shape and dtype."""
        if ctx is None:  # sparse gradients: Horovod reduced them itself
            return tensor
        if isinstance(ctx, _PassThrough):
            return tensor.to(ctx.dtype) if tensor.dtype != ctx.dtype else tensor
        reduced = tensor.detach().double().cpu().numpy()
        gathered = _hvd().synchronize(ctx.handle)
        try:
            scale = self._check_pairing(reduced, ctx.slot)
            offsets = self._check_payloads(gathered, ctx.numel)
            out = self._decode_sum(gathered, offsets, ctx.numel, scale / _hvd().size(), tensor.device)
        except Exception:
            self._state.end(ctx.slot, None)
            raise
        self._state.end(ctx.slot, reduced[3:] / reduced[0] if ctx.collecting else None)
        return out.to(ctx.dtype).view(ctx.shape)

    # ------------------------------------------------------------------ metrics and state
    @frontends.ClassOrInstance
    def metrics(self) -> dict:
        """``levels``, ``level_updates``, ``payload_bytes``, ``coordinates``, ``uncompressed_coordinates``,
        ``bits_per_coordinate`` (of compressed tensors, on the wire), ``step``, ``multiplier``."""
        return self._state.metrics()

    def state_dict(self) -> dict:
        """Levels, multiplier, round and call counters: a resumed run continues with identical levels."""
        return {"seed": self._seed, **self._state.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self._state.load_state_dict(state)
        self._seed = int(state["seed"])
        self._levels_cache.clear()

    # ------------------------------------------------------------------ internals
    def _levels_on(self, device: torch.device) -> torch.Tensor:
        key = f"{device}:{self._quantizer.fingerprint}"
        if key not in self._levels_cache:
            self._levels_cache.clear() if len(self._levels_cache) > 8 else None
            self._levels_cache[key] = torch.as_tensor(self._quantizer.levels, dtype=torch.float64, device=device)
        return self._levels_cache[key]

    def _header(self, numel: int) -> torch.Tensor:
        q = self._quantizer
        raw = pack_header(Header(self._method.id, q.bits, q.bucket_size, numel, q.fingerprint, norm=q.norm))
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8)

    def _fused_module(self, tensor: torch.Tensor):
        if tensor.device.type != "cpu" or self._use_fused is False:
            return None
        return fused.load()

    def _encode(self, tensor: torch.Tensor, call: int) -> torch.Tensor:
        seed = _splitmix64(self._seed ^ _splitmix64(_hvd().rank() * 0x10001 + (call << 20)))
        levels = self._levels_on(tensor.device)
        module = self._fused_module(tensor)
        if module is not None:
            flat = tensor.detach().reshape(-1).contiguous()
            return module.encode(flat, levels, self._header(tensor.numel()), self.bits,
                                 self.bucket_size, self._quantizer.norm == "linf", seed >> 1)
        generator = torch.Generator(device=tensor.device).manual_seed(seed >> 1)
        return kernels.encode(tensor, levels, self._header(tensor.numel()), bits=self.bits,
                              bucket_size=self.bucket_size, norm=self._quantizer.norm, generator=generator)

    def _statistics(self, tensor: torch.Tensor) -> list:
        d, norm = self.bucket_size, self._quantizer.norm
        if self._method.normless:
            return normless_statistics(BucketMoments(*kernels.bucket_moments(tensor, bucket_size=d, norm=norm))).tolist()
        if self._grid is None or self._grid.device != tensor.device:
            self._grid = torch.tensor(GRID, dtype=torch.float64, device=tensor.device)
        return kernels.grid_statistics(tensor, self._grid, bucket_size=d, norm=norm).tolist()

    def _check_pairing(self, reduced: np.ndarray, slot: int) -> float:
        scale = float(reduced[0])
        ok = scale != 0 and np.isfinite(reduced[:3]).all()
        if ok:
            ok = abs(reduced[1] / scale - slot) < 1e-6 and abs(reduced[2] / scale - slot * slot) < 1e-6 * max(1, slot * slot)
        if not ok:
            raise RuntimeError(
                f"horovod_alq: ranks exchanged different tensors in slot {slot} of this step (the ranks "
                f"compressed their tensors in different orders or different tensors); refusing to "
                f"decode. Reduced check vector: {reduced[:3].tolist()}")
        return scale

    def _check_payloads(self, gathered: torch.Tensor, numel: int) -> list[int]:
        q = self._quantizer
        size = _hvd().size()
        offsets, offset, total = [], 0, gathered.numel()
        for rank in range(size):
            if offset + HEADER_SIZE > total:
                raise ValueError(f"horovod_alq: payload of rank {rank} missing or truncated "
                                 f"({total} bytes gathered from {size} ranks)")
            try:
                header = parse_header(gathered[offset: offset + HEADER_SIZE].cpu().numpy())
                check_header(header, self._method.id, q.bits, q.bucket_size, q.fingerprint, q.norm)
                if header.numel != numel:
                    raise ValueError(f"payload has {header.numel} elements, this rank's tensor has {numel}")
                if offset + header.payload_size > total:
                    raise ValueError(f"payload truncated: {total - offset} bytes, header says {header.payload_size}")
            except ValueError as err:
                raise ValueError(f"horovod_alq: payload from rank {rank} does not match this rank "
                                 f"(rank {_hvd().rank()}): {err}") from None
            offsets.append(offset)
            offset += header.payload_size
        if offset != total:
            raise ValueError(f"horovod_alq: {total - offset} unexpected bytes after {size} payloads")
        return offsets

    def _decode_sum(self, gathered: torch.Tensor, offsets: list[int], numel: int, scale: float,
                    device: torch.device) -> torch.Tensor:
        levels = self._levels_on(gathered.device)
        out = torch.empty(numel, dtype=torch.float32, device=gathered.device)
        module = self._fused_module(gathered)
        if module is not None:
            module.decode_sum(out, gathered.contiguous(), offsets, levels, self.bits, self.bucket_size, scale)
        else:
            out.zero_()
            for offset in offsets:
                kernels.decode_into(out, gathered[offset:], levels, bits=self.bits, bucket_size=self.bucket_size)
            out.mul_(scale)
        return out.to(device)


ALQCompressor, AMQCompressor, QSGDCompressor, NUQSGDCompressor, TernGradCompressor = frontends.bind(
    QuantizedCompressor)


def compressor_for(method: str, **kwargs) -> QuantizedCompressor:
    """The compressor for a method name ("alq", "alq-n", "amq", "amq-n", "qsgdinf", "qsgd", "nuqsgd",
    "terngrad"), with the classes' keywords: ``compressor_for("alq-n", bits=3)`` is
    ``ALQCompressor(bits=3, normless=True)``. TernGrad ignores ``bits`` (always 2)."""
    return frontends.compressor_by_name(globals(), method, **kwargs)
