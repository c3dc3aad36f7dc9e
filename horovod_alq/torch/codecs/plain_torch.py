"""Codec ``torch``: the plain torch kernels (:mod:`horovod_alq.torch.codecs.torch_kernels`), any device.

Draws come from ``torch.rand`` with a generator seeded per call by ``seed``.
"""

from __future__ import annotations

from typing import Sequence

import torch

from . import torch_kernels as kernels
from .common import check_encode_args, payload_window


class PlainTorchCodec:
    name = "torch"

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
        generator = torch.Generator(device=flat.device).manual_seed(int(seed))
        return kernels.encode(flat, levels, header, bits=bits, bucket_size=bucket_size, norm=norm, generator=generator)

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
        payloads, offsets = payload_window(
            payloads, offsets, start=start, n=out.numel(), numel=numel, bits=bits, bucket_size=bucket_size
        )
        out.zero_()
        for offset in offsets:
            kernels.decode_into(out, payloads[int(offset) :], levels, bits=bits, bucket_size=bucket_size)
        return out.mul_(scale)

    def grid_statistics(self, flat, grid, *, bucket_size: int, norm: str):
        return kernels.grid_statistics(flat, grid, bucket_size=bucket_size, norm=norm)

    def grid_histograms(self, flat, grid, *, bucket_size: int, norm: str):
        return kernels.grid_histograms(flat, grid, bucket_size=bucket_size, norm=norm)

    def bucket_moments(self, flat, *, bucket_size: int, norm: str):
        return kernels.bucket_moments(flat, bucket_size=bucket_size, norm=norm)


CODEC = PlainTorchCodec()


def factory(device: torch.device) -> PlainTorchCodec:
    return CODEC
