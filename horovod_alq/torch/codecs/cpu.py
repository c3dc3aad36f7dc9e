"""Codec ``cpu``: the compiled CPU codec (``csrc/fused_codec.cpp``, built and loaded by
:mod:`horovod_alq.torch.codecs.cpu_build`).

CPU tensors only; the norm-less statistics (moments per bucket) use the torch kernels.
Preconditioned quantization (``precondition=``): the encodes take ``w`` (``scales`` for
``encode_parts``), a float32 scale per coordinate, and quantize ``x * w`` without writing it to
memory; ``decode_sum`` takes ``divide`` and divides its output by it in the same pass. The bytes and
floats are those of the unfused ``encode(x * w)`` and ``decode_sum(...) / w``.
Ranges (the pipelined round, :mod:`horovod_alq.exchange.pipeline`): the draws depend only on the
seed and a coordinate's index, so ``encode(v[a:b], ..., first=a)`` (``a`` on a bucket boundary and a
multiple of 8) gives the norms and codes that ``encode(v, ...)`` gives ``v[a:b]``.
"""

from __future__ import annotations

from typing import Sequence

import torch

from . import cpu_build
from . import torch_kernels as kernels
from .common import check_encode_args


class CpuCodec:
    name = "cpu"

    def __init__(self, module) -> None:
        self._module = module

    def encode(
        self,
        flat: torch.Tensor,
        levels: torch.Tensor,
        header: torch.Tensor,
        *,
        bits: int,
        bucket_size: int,
        norm: str,
        seed: int,
        w: torch.Tensor | None = None,
        first: int = 0,
    ) -> torch.Tensor:
        """``first``: the index of ``flat``'s first coordinate in the random stream (see the module)."""
        check_encode_args(flat, bits, bucket_size, norm, seed)
        return self._module.encode(
            flat.contiguous(),
            levels,
            header,
            int(bits),
            int(bucket_size),
            norm == "linf",
            int(seed),
            _scale(w, flat.numel(), "encode"),
            _first(first, "encode"),
        )

    def encode_parts(
        self,
        parts: Sequence[torch.Tensor],
        starts: Sequence[int],
        length: int,
        levels: torch.Tensor,
        header: torch.Tensor,
        *,
        bits: int,
        bucket_size: int,
        norm: str,
        seed: int,
        scales: Sequence[torch.Tensor] | None = None,
        first: int = 0,
    ) -> torch.Tensor:
        """The payload that :meth:`encode` gives for the stream of ``length`` coordinates holding the
        float32 ``parts`` at ``starts`` (increasing) and zeros elsewhere, read in place (``scales``:
        one per part, the stream holds ``part * scale``; ``first``: as :meth:`encode`'s)."""
        check_encode_args(torch.empty(0), bits, bucket_size, norm, seed)
        if scales is not None and len(scales) != len(parts):
            raise ValueError(f"codec 'cpu' encode_parts: {len(scales)} scales for {len(parts)} parts")
        return self._module.encode_parts(
            list(parts),
            [int(s) for s in starts],
            int(length),
            levels,
            header,
            int(bits),
            int(bucket_size),
            norm == "linf",
            int(seed),
            None if scales is None else [_scale(w, p.numel(), "encode_parts") for w, p in zip(scales, parts)],
            _first(first, "encode_parts"),
        )

    def encode_feedback(
        self,
        flat: torch.Tensor,
        error: torch.Tensor,
        levels: torch.Tensor,
        header: torch.Tensor,
        *,
        bits: int,
        bucket_size: int,
        norm: str,
        seed: int,
        w: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The payload :meth:`encode` gives for ``flat + error`` (``flat`` float32, ``error`` float32
        or bfloat16, ``bucket_size`` a multiple of 8); ``error`` becomes, bucket by bucket, what
        that payload drops, except in buckets where that is not finite, which
        keep it. One pass over memory. ``w``: of ``flat * w + error`` (the error in the scaled space)."""
        check_encode_args(flat, bits, bucket_size, norm, seed)
        return self._module.encode_feedback(
            flat,
            error,
            levels,
            header,
            int(bits),
            int(bucket_size),
            norm == "linf",
            int(seed),
            _scale(w, flat.numel(), "encode_feedback"),
        )

    def decode_sum(
        self,
        out: torch.Tensor,
        payloads: torch.Tensor,
        offsets: Sequence[int],
        levels: torch.Tensor,
        *,
        bits: int,
        bucket_size: int,
        scale: float,
        start: int = 0,
        numel: int | None = None,
        divide: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``out`` = ``scale`` times the sum of the decoded payloads (divided by ``divide``, float32
        as long as ``out``, if given)."""
        return self._module.decode_sum(
            out,
            payloads.contiguous(),
            [int(o) for o in offsets],
            levels,
            int(bits),
            int(bucket_size),
            float(scale),
            int(start),
            -1 if numel is None else int(numel),
            _scale(divide, out.numel(), "decode_sum"),
        )

    def grid_statistics(self, flat, grid, *, bucket_size: int, norm: str):
        return self._module.grid_statistics(
            flat.reshape(-1).contiguous(), grid, int(bucket_size), norm == "linf"
        ).numpy()

    def grid_histograms(self, flat, grid, *, bucket_size: int, norm: str):
        return self._module.grid_histograms(
            flat.reshape(-1).contiguous(), grid, int(bucket_size), norm == "linf"
        ).numpy()

    def bucket_moments(self, flat, *, bucket_size: int, norm: str):
        return kernels.bucket_moments(flat, bucket_size=bucket_size, norm=norm)


def _scale(w: torch.Tensor | None, n: int, what: str) -> torch.Tensor | None:
    """A preconditioning scale as the kernels take it (flat, contiguous float32 on the CPU, ``n``
    values), or None; ValueError naming ``what`` otherwise."""
    if w is None:
        return None
    if w.dtype != torch.float32 or w.device.type != "cpu" or w.numel() != n:
        raise ValueError(
            f"codec 'cpu' {what}: a preconditioning scale must be float32 on the CPU with {n} values "
            f"(one per coordinate), got {w.dtype} on {w.device} with {w.numel()}"
        )
    return w.reshape(-1).contiguous()


def _first(first: int, what: str) -> int:
    """A range's first index in the random stream, checked: ValueError naming ``what`` otherwise."""
    if isinstance(first, bool) or not isinstance(first, int) or first < 0 or first % 8:
        raise ValueError(f"codec 'cpu' {what}: first must be a non-negative multiple of 8, got {first!r}")
    return first


_CODEC: CpuCodec | None = None


def factory(device: torch.device) -> CpuCodec:
    global _CODEC
    if device.type != "cpu":
        raise ValueError(
            f"codec 'cpu' (the compiled CPU codec) takes CPU tensors, not {device}; "
            f"use codec='auto' (Triton on CUDA), 'triton' or 'torch' for them"
        )
    if _CODEC is None:
        module = cpu_build.load()
        if module is None:
            raise ValueError(f"codec 'cpu' is unavailable: {cpu_build.status()}")
        _CODEC = CpuCodec(module)
    return _CODEC
