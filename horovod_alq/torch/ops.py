"""The exchange engine's tensor ops on torch tensors of one device, with one codec backend
(``horovod_alq.exchange``; every torch front-end: the Horovod compressors, the DDP hook, FSDP2)."""

from __future__ import annotations

import numpy as np
import torch

from ..core.methods import get_method
from ..core.quantizer import Quantizer
from ..core.statistics import GRID, BucketMoments, normless_statistics, statistics_length
from ..core.wire import Header, pack_header
from . import codecs
from .codecs import torch_kernels as kernels


class TorchOps:
    """The exchange's tensor ops on ``device`` with one codec backend (:mod:`.codecs`: ``"auto"``
    is Triton for CUDA tensors, the compiled CPU codec for CPU tensors, torch ops otherwise)."""

    def __init__(self, device: torch.device, codec: str = "auto") -> None:
        self.device = torch.device(device)
        self.codec = codecs.resolve(codec, self.device)
        self._levels: dict[int, torch.Tensor] = {}
        self._grid: torch.Tensor | None = None

    @property
    def fuses_scales(self) -> bool:
        """Whether the codec quantizes ``x * w`` and divides its decode by ``w`` inside its kernels
        (``encode_parts(scales=)``, ``decode_sum(divide=)``: preconditioned quantization): the
        compiled CPU codec."""
        return self.codec.name == "cpu"

    @property
    def encodes_ranges(self) -> bool:
        """Whether the codec's draws depend only on the seed and a coordinate's index, and its encodes
        take ``first`` (that index for the range's first coordinate): a range of a vector that starts
        on a bucket boundary then encodes to the codes the whole vector's encode gives it (the
        pipelined round, :mod:`horovod_alq.exchange.pipeline`): the compiled CPU codec."""
        return self.codec.name == "cpu"

    def levels(self, q: Quantizer) -> torch.Tensor:
        key = q.fingerprint
        if key not in self._levels:
            if len(self._levels) > 8:
                self._levels.clear()
            self._levels[key] = torch.as_tensor(q.levels, dtype=torch.float64, device=self.device)
        return self._levels[key]

    def stream(self, parts, starts, length, out=None, padding=()):
        if out is None:
            out = torch.zeros(length, dtype=torch.float32, device=self.device)
        else:
            for a, b in padding:
                out[a:b].zero_()
        for part, start in zip(parts, starts):
            out[start : start + part.numel()].copy_(part.reshape(-1))
        return out

    def zeros(self, n: int) -> torch.Tensor:
        return torch.zeros(n, dtype=torch.float32, device=self.device)

    def empty(self, n: int) -> torch.Tensor:
        return torch.empty(n, dtype=torch.float32, device=self.device)

    def _header(self, q: Quantizer, numel: int) -> torch.Tensor:
        header = pack_header(Header(get_method(q.method).id, q.bits, q.bucket_size, numel, q.fingerprint, norm=q.norm))
        return torch.frombuffer(bytearray(header), dtype=torch.uint8).to(self.device)

    def _coding(self, q: Quantizer, numel: int, seed: int, first: int = 0) -> tuple[tuple, dict]:
        """An encode's levels and header, and its keywords, as every codec's encode takes them
        (``first``, where not 0: only codecs that :attr:`encodes_ranges` take it)."""
        kw = dict(bits=q.bits, bucket_size=q.bucket_size, norm=q.norm, seed=seed)
        if first:
            if not self.encodes_ranges:
                raise ValueError(
                    f"codec {self.codec.name!r} draws its rounding noise per encode, not per coordinate "
                    f"index: it cannot encode a range at first={first}; use codec='cpu'"
                )
            kw["first"] = int(first)
        return (self.levels(q), self._header(q, numel)), kw

    def encode(self, x: torch.Tensor, q: Quantizer, seed: int, first: int = 0) -> torch.Tensor:
        """``first``: the index of ``x``'s first coordinate in the random stream (where
        :attr:`encodes_ranges`; ValueError elsewhere unless 0)."""
        if x.numel() == 0:
            return self._header(q, 0)
        args, kw = self._coding(q, x.numel(), seed, first)
        return self.codec.encode(x.contiguous(), *args, **kw)

    def encode_parts(self, parts, starts, length, q: Quantizer, seed: int, scales=None, first: int = 0):
        """The payload of the stream holding ``parts`` (times ``scales``, one float32 per part, where
        :attr:`fuses_scales`), read in place; None where the codec cannot. ``first``: as :meth:`encode`'s."""
        encode = getattr(self.codec, "encode_parts", None)
        if (
            encode is None
            or length == 0
            or q.bucket_size % 8
            or not all(p.dtype == torch.float32 and p.device == self.device for p in parts)
            or (scales is not None and not self.fuses_scales)
        ):
            return None
        args, kw = self._coding(q, length, seed, first)
        if scales is not None:
            kw["scales"] = [w.reshape(-1).contiguous() for w in scales]
        return encode([p.reshape(-1).contiguous() for p in parts], list(starts), length, *args, **kw)

    def encode_feedback(self, x: torch.Tensor, error: torch.Tensor, q: Quantizer, seed: int):
        """The payload of ``x + error`` with ``error`` updated in place (see
        :meth:`horovod_alq.torch.codecs.cpu.CpuCodec.encode_feedback`), or None where the codec
        has no such kernel or the tensors do not suit it."""
        encode = getattr(self.codec, "encode_feedback", None)
        if (
            encode is None
            or x.numel() == 0
            or q.bucket_size % 8
            or x.dtype != torch.float32
            or error.dtype not in (torch.float32, torch.bfloat16)
            or x.device != self.device
            or not x.is_contiguous()
            or not error.is_contiguous()
            or x.shape != error.shape
        ):
            return None
        args, kw = self._coding(q, x.numel(), seed)
        return encode(x, error, *args, **kw)

    def decode_sum(
        self,
        out: torch.Tensor,
        payloads: torch.Tensor,
        offsets,
        q: Quantizer,
        *,
        start: int = 0,
        numel: int | None = None,
        scale: float = 1.0,
        divide: torch.Tensor | None = None,
    ) -> None:
        """See :meth:`horovod_alq.exchange.interfaces.TensorOps.decode_sum`; ``divide`` (as long as
        ``out``): the output divided by it, in the decode's pass where :attr:`fuses_scales`."""
        n = out.numel()
        numel = n if numel is None else int(numel)
        if n == 0:
            return
        target = out if out.is_contiguous() else torch.empty_like(out)
        self.codec.decode_sum(
            target,
            payloads.contiguous(),
            list(offsets),
            self.levels(q),
            bits=q.bits,
            bucket_size=q.bucket_size,
            scale=scale,
            start=start,
            numel=numel,
            **({"divide": divide.reshape(-1)} if divide is not None and self.fuses_scales else {}),
        )
        if divide is not None and not self.fuses_scales:
            target.div_(divide.reshape(target.shape))
        if target is not out:
            out.copy_(target)

    def statistics(self, x: torch.Tensor, q: Quantizer) -> np.ndarray:
        method = get_method(q.method)
        x = x.contiguous()
        if not method.adaptive or method.normless:
            moments = self.codec.bucket_moments(x, bucket_size=q.bucket_size, norm=q.norm)
            return normless_statistics(BucketMoments(*moments))
        return self.codec.grid_statistics(x, self._grid_tensor(), bucket_size=q.bucket_size, norm=q.norm)

    def auto_statistics(self, x: torch.Tensor, q: Quantizer) -> tuple[np.ndarray, np.ndarray]:
        hist = self.codec.grid_histograms(x.contiguous(), self._grid_tensor(), bucket_size=q.bucket_size, norm=q.norm)
        return hist[1], hist[0] if hist[0].size == statistics_length(q.method) else self.statistics(x, q)

    def _grid_tensor(self) -> torch.Tensor:
        if self._grid is None:
            self._grid = torch.tensor(GRID, dtype=torch.float64, device=self.device)
        return self._grid

    def bucket_norms(self, x: torch.Tensor, bucket_size: int, norm: str) -> np.ndarray:
        d, n = int(bucket_size), x.numel()
        rows = x.reshape(-1)[: n - n % d].view(-1, d)
        parts = [rows]
        if n % d:
            parts.append(x.reshape(-1)[n - n % d :].view(1, -1))
        # (no padded copy and no finiteness pass, unlike kernels.bucket_norms: a non-finite norm only
        # gives its bucket the narrowest width, whose codec handles it)
        norms = [
            torch.linalg.vector_norm(p.float(), dim=1) if norm == "l2" else kernels.row_max_abs(p).float()
            for p in parts
            if p.numel()
        ]
        return torch.cat(norms).double().cpu().numpy() if norms else np.zeros(0)

    def take_buckets(self, x: torch.Tensor, ids, bucket_size: int) -> torch.Tensor:
        d, n = int(bucket_size), x.numel()
        full, tail = _split_ids(ids, n, d, self.device)
        out = x[: n - n % d].view(-1, d).index_select(0, full).reshape(-1)
        return torch.cat([out, x[n - n % d :]]) if tail else out

    def add_buckets(self, out: torch.Tensor, values: torch.Tensor, ids, bucket_size: int, scale: float = 1.0) -> None:
        d, n = int(bucket_size), out.numel()
        full, tail = _split_ids(ids, n, d, self.device)
        k = full.numel() * d
        out[: n - n % d].view(-1, d).index_add_(0, full, values[:k].view(-1, d), alpha=scale)
        if tail:
            out[n - n % d :].add_(values[k:], alpha=scale)

    def cat(self, parts) -> torch.Tensor:
        return torch.cat(list(parts)) if len(parts) > 1 else parts[0]

    def as_bytes(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(torch.float32).contiguous().view(torch.uint8)

    def from_bytes(self, b: torch.Tensor) -> torch.Tensor:
        return b.contiguous().view(torch.float32)

    def to_numpy(self, x: torch.Tensor) -> np.ndarray:
        return x.detach().cpu().numpy()

    def from_numpy(self, a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(self.device)


def _split_ids(ids, n: int, d: int, device: torch.device) -> tuple[torch.Tensor, bool]:
    """Sorted bucket ids of a vector of ``n``: the ids of whole buckets (a tensor) and whether the
    short last bucket is among them."""
    ids = np.asarray(ids, dtype=np.int64)
    tail = bool(n % d) and ids.size > 0 and ids[-1] == n // d
    return torch.from_numpy(ids[:-1] if tail else ids).to(device), tail


def ops_for(cache: dict, device: torch.device, codec: str) -> TorchOps:
    """The :class:`TorchOps` for ``device`` in ``cache`` (made on first use)."""
    key = str(device)
    if key not in cache:
        cache[key] = TorchOps(device, codec)
    return cache[key]
