"""Codecs of the torch compressors: one interface, one module per backend, one registry.

A codec turns a flat float tensor into a payload of the wire format (``docs/design.md``) and sums
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
stream of tensors, read in place: the compiled CPU codec). Payloads are interchangeable between backends and with
:class:`horovod_alq.core.Quantizer`; the random draws differ (each backend has its own
counter-based or seeded generator), the decoded distribution does not.
"""

from __future__ import annotations

import warnings
from typing import Callable, Protocol, Sequence

import numpy as np
import torch

from ...core.wire import HEADER_SIZE

DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


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


def payload_window(
    payloads: torch.Tensor,
    offsets: Sequence[int],
    *,
    start: int,
    n: int,
    numel: int | None,
    bits: int,
    bucket_size: int,
) -> tuple[torch.Tensor, list[int]]:
    """Coordinates ``[start, start + n)`` of payloads of ``numel`` coordinates each (None: n), as
    payloads of their own (header bytes kept, the window's norms and codes copied): for backends
    that decode whole payloads only. The payloads themselves when the window is all of them."""
    numel = n if numel is None else int(numel)
    if start == 0 and numel == n:
        return payloads, list(offsets)
    d = int(bucket_size)
    if start % d or (start * bits) % 8 or start + n > numel:
        raise ValueError(f"decode_sum: start {start} is not on a bucket and byte boundary inside {numel}")
    nb = -(-numel // d)
    parts = []
    for offset in offsets:
        norms = offset + HEADER_SIZE + 4 * (start // d)
        codes = offset + HEADER_SIZE + 4 * nb + start * bits // 8
        parts += [
            payloads[offset : offset + HEADER_SIZE],
            payloads[norms : norms + 4 * -(-n // d)],
            payloads[codes : codes + -(-n * bits // 8)],
        ]
    window = torch.cat(parts) if parts else payloads[:0]
    size = HEADER_SIZE + 4 * -(-n // d) + -(-n * bits // 8)
    return window, [k * size for k in range(len(offsets))]


def check_encode_args(flat: torch.Tensor, bits: int, bucket_size: int, norm: str, seed: int) -> None:
    """The argument checks every backend's encode shares."""
    if flat.dim() != 1 or flat.dtype not in DTYPES:
        raise ValueError(
            f"encode: flat must be a 1-D float16/bfloat16/float32/float64 tensor, got "
            f"{flat.dtype} of shape {tuple(flat.shape)}"
        )
    if not 2 <= int(bits) <= 8:
        raise ValueError(f"encode: bits must be 2..8, got {bits}")
    if int(bucket_size) <= 0:
        raise ValueError(f"encode: bucket_size must be positive, got {bucket_size}")
    if norm not in ("l2", "linf"):
        raise ValueError(f"encode: norm must be 'l2' or 'linf', got {norm!r}")
    if not 0 <= int(seed) < 1 << 63:
        raise ValueError(f"encode: seed must be in [0, 2**63), got {seed}")


from . import cpu, plain_torch  # noqa: E402  (the backends use the helpers above)
from . import triton as triton_codec  # noqa: E402

register("torch", plain_torch.factory)
register("cpu", cpu.factory)
register("triton", triton_codec.factory)
