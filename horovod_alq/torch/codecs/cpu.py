"""Codec ``cpu``: the compiled CPU codec (``csrc/fused_codec.cpp``, built and loaded by
:mod:`horovod_alq.torch.codecs.cpu_build`).

CPU tensors only; the norm-less statistics (moments per bucket) use the torch kernels.
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
    ) -> torch.Tensor:
        check_encode_args(flat, bits, bucket_size, norm, seed)
        return self._module.encode(
            flat.contiguous(), levels, header, int(bits), int(bucket_size), norm == "linf", int(seed)
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
    ) -> torch.Tensor:
        """The payload that :meth:`encode` gives for the stream of ``length`` coordinates holding the
        float32 ``parts`` at ``starts`` (increasing) and zeros elsewhere, read in place."""
        check_encode_args(torch.empty(0), bits, bucket_size, norm, seed)
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
        scale: float = 1.0,
    ) -> torch.Tensor:
        """The payload :meth:`encode` gives for ``flat + error`` (``flat`` float32, ``error`` float32
        or bfloat16, ``bucket_size`` a multiple of 8); ``error`` becomes, bucket by bucket, what
        that payload drops (times ``scale``), except in buckets where that is not finite, which
        keep it. One pass over memory."""
        check_encode_args(flat, bits, bucket_size, norm, seed)
        return self._module.encode_feedback(
            flat, error, levels, header, int(bits), int(bucket_size), norm == "linf", int(seed), float(scale)
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
    ) -> torch.Tensor:
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
