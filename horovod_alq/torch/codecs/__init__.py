"""Codecs of the torch compressors: one interface, one module per backend, one registry.

A codec turns a flat float tensor into a payload of the wire format (``docs/design/design.md``) and sums
decoded payloads; it also computes the statistics of refit rounds. Backends:

- ``torch``: plain torch ops (:mod:`.plain_torch`, kernels in :mod:`horovod_alq.torch.codecs.torch_kernels`), any
  device;
- ``cpu``: the compiled CPU codec (:mod:`horovod_alq.torch.codecs.cpu_build`), CPU tensors;
- ``triton``: Triton kernels (:mod:`.triton`), CUDA tensors; CPU tensors only under Triton's
  interpreter (``TRITON_INTERPRET=1``, slow: for tests).

``resolve("auto", device)`` picks Triton for CUDA tensors when it is importable, the compiled CPU
codec for CPU tensors when it loads, the torch ops otherwise. A new backend is one module with a
``factory(device) -> codec`` (raising ValueError with the reason where it cannot serve that
device) and one :func:`register` call at the end of this file.

Every codec has (see :class:`Codec`): ``name``, ``encode``, ``decode_sum``, ``grid_statistics``,
``grid_histograms``, ``bucket_moments``; a codec may also have ``encode_parts`` (the payload of a
stream of tensors, read in place) and ``encode_feedback`` (error feedback's encode in one pass):
the compiled CPU codec has both. Payloads are interchangeable between backends and with
:class:`horovod_alq.core.Quantizer`; the random draws differ (each backend has its own
counter-based or seeded generator), the decoded distribution does not.
"""

from __future__ import annotations

import warnings
from typing import Callable, Protocol, Sequence

import numpy as np
import torch

from .common import DTYPES, check_encode_args, payload_window  # noqa: F401 (re-exported)


class Codec(Protocol):
    """The interface every backend implements."""

    name: str

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
        """Payload (uint8, 1-D, on ``flat``'s device): the 32 ``header`` bytes, one float32 norm
        per bucket, the packed codes. ``flat``: 1-D contiguous float16/bfloat16/float32/float64;
        ``levels``: sorted float64 on the same device; ``norm``: "l2" or "linf"; ``seed``: int in
        [0, 2**63), the only source of randomness."""

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
        """Overwrite the float32 ``out`` (n elements) with ``scale * sum_i decode(payloads[offsets[i]:])``
        and return it. ``payloads``: uint8, already validated payloads back to back, each of
        ``numel`` coordinates (default n), of which coordinates ``[start, start + n)`` are decoded
        (``start``: a multiple of ``bucket_size`` whose codes begin on a byte)."""

    def grid_statistics(self, flat: torch.Tensor, grid: torch.Tensor, *, bucket_size: int, norm: str) -> np.ndarray:
        """As :func:`horovod_alq.torch.codecs.torch_kernels.grid_statistics`."""

    def grid_histograms(self, flat: torch.Tensor, grid: torch.Tensor, *, bucket_size: int, norm: str) -> np.ndarray:
        """As :func:`horovod_alq.torch.codecs.torch_kernels.grid_histograms` (the rows of ``bits="auto"``)."""

    def bucket_moments(self, flat: torch.Tensor, *, bucket_size: int, norm: str) -> tuple:
        """As :func:`horovod_alq.torch.codecs.torch_kernels.bucket_moments`."""


_FACTORIES: dict[str, Callable[[torch.device], Codec]] = {}
_WARNED: set[str] = set()


def register(name: str, factory: Callable[[torch.device], Codec]) -> None:
    """Add a backend: ``factory(device)`` returns a codec for tensors on ``device`` or raises
    ValueError saying why it cannot."""
    if name == "auto":
        raise ValueError("'auto' is reserved")
    _FACTORIES[name] = factory


def names() -> list[str]:
    """Every accepted codec name: "auto" and the registered backends."""
    return ["auto", *_FACTORIES]


def check_name(codec: str) -> str:
    """``codec`` if it is a known name, else ValueError listing the choices."""
    if codec not in names():
        raise ValueError(f"unknown codec {codec!r}; choose one of {', '.join(map(repr, names()))}")
    return codec


def resolve(codec: str = "auto", device: torch.device | str = "cpu") -> Codec:
    """The codec named ``codec`` for tensors on ``device``; ValueError if unknown or unusable there."""
    check_name(codec)
    device = torch.device(device)
    if codec == "auto":
        return _auto(device)
    return _FACTORIES[codec](device)


def available(device: torch.device | str = "cpu") -> list[str]:
    """Names of the backends that can serve tensors on ``device`` (registration order)."""
    device = torch.device(device)
    usable = []
    for name, factory in _FACTORIES.items():
        try:
            factory(device)
        except ValueError:
            continue
        usable.append(name)
    return usable


def _auto(device: torch.device) -> Codec:
    preferred = {"cuda": "triton", "cpu": "cpu"}.get(device.type)
    if preferred is not None:
        try:
            return _FACTORIES[preferred](device)
        except ValueError as err:
            if preferred == "triton" and "triton" not in _WARNED:  # (cpu_build.load warns itself)
                _WARNED.add("triton")
                warnings.warn(f"horovod_alq: Triton codec unavailable ({err}); using torch ops on {device}")
    return _FACTORIES["torch"](device)


from . import cpu, plain_torch  # noqa: E402  (the backends register below)
from . import triton as triton_codec  # noqa: E402

register("torch", plain_torch.factory)
register("cpu", cpu.factory)
register("triton", triton_codec.factory)
