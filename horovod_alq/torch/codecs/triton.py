"""Codec ``triton``: fused Triton kernels (``_triton_kernels.py``) for CUDA tensors.

- encode: for bucket sizes that are a multiple of 8 (up to ``max_fused_bucket``), ONE kernel with
  one program per bucket computes the norm (float64 accumulation, as the CPU codec and the NumPy
  core: the norms are the same float32 values), normalizes, draws counter-based Philox uniforms
  keyed by the seed and the element index, rounds and packs, writing the norm and the code bytes
  straight into the payload. Other bucket sizes: a norm kernel (chunked buckets), a few torch ops
  on the per-bucket arrays, then a codes kernel.
- decode_sum: one kernel, all payloads summed in registers, scale folded in, written once.
- statistics of refit rounds (grid histogram with weights n_b / count_b, bucket moments): a norm
  kernel and a statistics kernel (``tl.histogram`` per chunk, partial histograms per program
  summed by torch, so the result does not depend on scheduling).

Temporaries beyond the payload and the output: the padded level tables (2**bits floats), the
offsets (one int64 per payload), and for the statistics or the non-fused encode per-bucket float64
partials (about 20 bytes per bucket) plus, for ``grid_statistics``, one 1024-bin float64 histogram
per program of ``stats_chunk`` elements (8 KiB per 32768 elements: 1/16 of float32 input bytes).
With the default bucket size 8192 that is below 0.07x the input's bytes, and at most 0.25x for
any bucket size >= 128 and any input dtype. No copy or cast of the input is made.

CPU tensors run only under Triton's interpreter, for tests. Triton chooses between interpreter and
compiler once per process, when ``triton.language`` is first imported (its own library functions,
``tl.randint4x`` included, are decorated then): ``TRITON_INTERPRET=1`` must be in the environment
before the first ``import triton``; this codec then serves CPU tensors (and CUDA tensors, through
the interpreter). Otherwise it serves CUDA tensors with compiled kernels and refuses CPU tensors,
saying why.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from typing import Sequence

import torch

from ...core.wire import HEADER_SIZE
from . import torch_kernels
from .common import check_encode_args, payload_window

INSTALL_HINT = (
    "install it with `pip install triton==3.6.0` (pinned in requirements/pinned.txt; "
    "`make install` installs it; `pip install horovod-alq[gpu]` for the extra)"
)
_KERNEL_SOURCE = Path(__file__).with_name("_triton_kernels.py")
_KERNELS: dict[bool, object] = {}
_IMPORT_ERROR: list[str | None] = []


def interpret_requested() -> bool:
    """Whether ``TRITON_INTERPRET`` asks for Triton's interpreter (as Triton reads it)."""
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "on", "yes")


def import_error() -> str | None:
    """None if ``import triton`` works, else why not."""
    if not _IMPORT_ERROR:
        try:
            import triton  # noqa: F401
            import triton.language  # noqa: F401

            _IMPORT_ERROR.append(None)
        except Exception as exc:  # ImportError, or a broken installation
            _IMPORT_ERROR.append(f"{type(exc).__name__}: {exc}")
    return _IMPORT_ERROR[0]


def triton_interpreted() -> bool:
    """Whether the imported Triton runs under its interpreter (fixed at its first import)."""
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(tl.randint4x, InterpretedFunction)


def kernels(interpret: bool):
    """The kernel module, decorated for the interpreter (``interpret``) or for the compiler; it
    must match :func:`triton_interpreted` to run."""
    if interpret not in _KERNELS:
        name = f"{__name__}._kernels_{'interpreted' if interpret else 'compiled'}"
        old = os.environ.get("TRITON_INTERPRET")
        os.environ["TRITON_INTERPRET"] = "1" if interpret else "0"
        try:
            spec = importlib.util.spec_from_file_location(name, _KERNEL_SOURCE)
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module  # Triton looks kernels' globals up through their module
            spec.loader.exec_module(module)
        finally:
            if old is None:
                os.environ.pop("TRITON_INTERPRET", None)
            else:
                os.environ["TRITON_INTERPRET"] = old
        _KERNELS[interpret] = module
    return _KERNELS[interpret]


def _pow2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class TritonCodec:
    """Triton backend. Tuning knobs are attributes (tests shrink them to reach every path)."""

    name = "triton"
    max_fused_bucket = 1 << 16  # larger buckets (or d % 8 != 0): norm kernel + codes kernel
    encode_block = 1024  # elements per iteration of the norm loops
    encode_quads = 64  # quads (32 elements) per iteration of the code loops
    decode_groups = 256  # groups of 8 elements per decode program
    norm_chunk = 1 << 16  # buckets above this are split over several norm programs
    stats_chunk = 1 << 15  # elements per statistics program (buckets grouped or split)
    stats_block = 1024  # elements per iteration of the statistics loop

    def __init__(self, interpret: bool) -> None:
        self.interpret = interpret
        if interpret:  # the interpreter pays per operation, not per element: bigger tiles
            self.encode_block = 8192
            self.encode_quads = 256
            self.decode_groups = 2048
            self.stats_block = 8192
        self._k = kernels(interpret)
        self._tables_cache: dict = {}

    # ------------------------------------------------------------------ helpers
    def _check_device(self, device: torch.device) -> None:
        if device.type != "cuda" and not self.interpret:
            raise ValueError(_cpu_message(device))

    def _tables(self, levels: torch.Tensor, bits: int, device: torch.device):
        """(levels padded with +inf, widths padded with 0, decode table padded with NaN), float32,
        2**bits entries each, cached per levels tensor."""
        key = (id(levels), levels._version, bits, str(device))
        hit = self._tables_cache.get(key)
        if hit is not None and hit[0] is levels:
            return hit[1]
        lf = levels.to(device=device, dtype=torch.float32).reshape(-1)
        size, count = 1 << bits, lf.numel()
        if not 2 <= count <= size:
            raise ValueError(f"need 2..{size} levels for {bits} bits, got {count}")
        lv = torch.full((size,), float("inf"), dtype=torch.float32, device=device)
        lv[:count] = lf
        wd = torch.zeros(size, dtype=torch.float32, device=device)
        wd[: count - 1] = lf[1:] - lf[:-1]
        table = torch.full((size,), float("nan"), dtype=torch.float32, device=device)
        table[:count] = lf
        if len(self._tables_cache) >= 16:
            self._tables_cache.clear()
        self._tables_cache[key] = (levels, (lv, wd, table))
        return lv, wd, table

    def _norms(self, flat: torch.Tensor, d: int, linf: bool) -> torch.Tensor:
        """float32 norm per bucket (NaN for non-finite buckets), any bucket size."""
        n = flat.numel()
        nb = _cdiv(n, d)
        if d <= self.norm_chunk:
            splits, chunk = 1, d
        else:
            splits, chunk = _cdiv(d, self.norm_chunk), self.norm_chunk
        block = min(_pow2(chunk), self.encode_block)
        rows = 1 if splits > 1 else min(_pow2(nb), max(1, self.encode_block // block))
        total = torch.empty(nb * splits, dtype=torch.float64, device=flat.device)
        bad = torch.empty(nb * splits, dtype=torch.int32, device=flat.device)
        self._k._norm_partials_kernel[(_cdiv(nb, rows) * splits,)](
            flat, total, bad, n, d, nb, splits, chunk, LINF=linf, RB=rows, BLOCK=block, ITERS=_cdiv(chunk, block)
        )
        total, bad = total.view(nb, splits), bad.view(nb, splits)
        norms = (total.amax(1) if linf else total.sum(1).sqrt()).float()
        ok = (bad.sum(1) == 0) & torch.isfinite(norms)
        return norms.masked_fill_(~ok, float("nan"))

    # ------------------------------------------------------------------ codec interface
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
        uniforms: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """See :class:`horovod_alq.torch.codecs.Codec`. ``uniforms`` (testing hook): float32
        tensor of n values in (0, 1) used instead of the Philox draws."""
        check_encode_args(flat, bits, bucket_size, norm, seed)
        device = flat.device
        self._check_device(device)
        flat = flat.contiguous()
        n, d, bits = flat.numel(), int(bucket_size), int(bits)
        nb = _cdiv(n, d)
        code_bytes = _cdiv(n * bits, 8)
        payload = torch.empty(HEADER_SIZE + 4 * nb + code_bytes, dtype=torch.uint8, device=device)
        payload[:HEADER_SIZE].copy_(header.reshape(-1))
        if n == 0:
            return payload
        norms = payload[HEADER_SIZE : HEADER_SIZE + 4 * nb].view(torch.float32)
        codes = payload[HEADER_SIZE + 4 * nb :]
        lv, wd, _ = self._tables(levels, bits, device)
        has_u = uniforms is not None
        if has_u:
            uniforms = uniforms.to(device=device, dtype=torch.float32).contiguous()
            if uniforms.numel() != n:
                raise ValueError(f"uniforms: need {n} values, got {uniforms.numel()}")
        u = uniforms if has_u else lv  # (a placeholder pointer when the kernel draws its own)
        linf, linear = norm == "linf", bits <= 4
        if d % 8 == 0 and d <= self.max_fused_bucket:
            block = min(_pow2(d), self.encode_block)
            span = _cdiv(d, 32) + 1  # quads touching one bucket, at most
            quads = min(self.encode_quads, _pow2(span))
            self._k._encode_fused_kernel[(nb,)](
                flat,
                norms,
                codes,
                u,
                lv,
                wd,
                n,
                d,
                code_bytes,
                int(seed),
                LINF=linf,
                BITS=bits,
                LINEAR=linear,
                HAS_U=has_u,
                BLOCK=block,
                ITERS=_cdiv(d, block),
                Q=quads,
                QITERS=_cdiv(span, quads),
            )
        else:
            norms.copy_(self._norms(flat, d, linf))
            live = torch.isfinite(norms) & (norms > 0)
            scale = torch.where(norms < 2.0**-64, 2.0**64, 1.0).to(torch.float32)
            inv = torch.where(live, 1.0 / (norms * scale), torch.zeros_like(norms))
            quads = self.encode_quads
            self._k._codes_kernel[(_cdiv(_cdiv(n, 32), quads),)](
                flat,
                inv,
                scale,
                codes,
                u,
                lv,
                wd,
                n,
                d,
                code_bytes,
                int(seed),
                BITS=bits,
                LINEAR=linear,
                HAS_U=has_u,
                Q=quads,
            )
        return payload

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
        self._check_device(out.device)
        if out.dtype != torch.float32 or not out.is_contiguous() or payloads.dtype != torch.uint8:
            raise ValueError("decode_sum: out must be contiguous float32 and payloads uint8")
        payloads, offsets = payload_window(
            payloads, offsets, start=start, n=out.numel(), numel=numel, bits=bits, bucket_size=bucket_size
        )
        n, d, bits = out.numel(), int(bucket_size), int(bits)
        offsets = [int(o) for o in offsets]
        if n == 0:
            return out
        if not offsets:
            return out.zero_()
        nb = _cdiv(n, d)
        size = HEADER_SIZE + 4 * nb + _cdiv(n * bits, 8)
        if min(offsets) < 0 or max(offsets) + size > payloads.numel():
            raise ValueError("decode_sum: payload out of range")
        payloads = payloads.to(out.device).contiguous()
        offs = torch.tensor(offsets, dtype=torch.int64).to(out.device)
        _, _, table = self._tables(levels, bits, out.device)
        groups = self.decode_groups
        self._k._decode_sum_kernel[(_cdiv(_cdiv(n, 8), groups),)](
            out,
            payloads,
            offs,
            table,
            n,
            d,
            nb,
            float(scale),
            NUM_PAYLOADS=len(offsets),
            BITS=bits,
            G=groups,
            ALIGNED=d % 8 == 0,
        )
        return out

    def _statistics(self, flat: torch.Tensor, d: int, norm: str, grid: torch.Tensor | None):
        self._check_device(flat.device)
        if flat.dim() != 1:
            flat = flat.reshape(-1)
        flat = flat.detach().contiguous()
        n, d = flat.numel(), int(d)
        nb = _cdiv(n, d)
        device = flat.device
        norms = self._norms(flat, d, norm == "linf") if n else torch.empty(0, device=device)
        if d <= self.stats_chunk:
            splits, per, chunk = 1, max(1, min(self.stats_chunk // d, nb)), d
            programs = _cdiv(nb, per)
        else:
            splits, per, chunk = _cdiv(d, self.stats_chunk), 1, self.stats_chunk
            programs = nb * splits
        sr = torch.zeros(nb * splits, dtype=torch.float64, device=device)
        sr2 = torch.zeros(nb * splits, dtype=torch.float64, device=device)
        gbits = 1
        if grid is not None:
            gbits = max(1, int(grid.numel()).bit_length())
            padded = torch.full((1 << gbits,), float("inf"), dtype=torch.float64, device=device)
            padded[: grid.numel()] = grid.to(device=device, dtype=torch.float64)
            hist = torch.empty(programs, 1 << gbits, dtype=torch.float64, device=device)
        else:
            padded = hist = sr  # placeholders, unused
        if n:
            block = min(_pow2(chunk), self.stats_block)
            self._k._stats_kernel[(programs,)](
                flat,
                norms,
                padded,
                sr,
                sr2,
                hist,
                n,
                d,
                nb,
                splits,
                chunk,
                X64=flat.dtype == torch.float64,
                HIST=grid is not None,
                GBITS=gbits,
                R=per,
                BLOCK=block,
                ITERS=_cdiv(chunk, block),
            )
        norms64 = norms.double()
        keep = torch.isfinite(norms64) & (norms64 > 0)
        return norms64, keep, sr.view(nb, splits).sum(1), sr2.view(nb, splits).sum(1), hist

    def bucket_moments(self, flat: torch.Tensor, *, bucket_size: int, norm: str):
        norms, keep, sr, sr2, _ = self._statistics(flat, bucket_size, norm, None)
        n, d = flat.numel(), int(bucket_size)
        counts = torch.full_like(norms, float(d))
        if counts.numel():
            counts[-1] = n - (counts.numel() - 1) * d
        return tuple(t[keep].cpu().numpy() for t in (norms, counts, sr, sr2))

    def grid_statistics(self, flat: torch.Tensor, grid: torch.Tensor, *, bucket_size: int, norm: str):
        norms, keep, _, _, hist = self._statistics(flat, bucket_size, norm, grid)
        k = grid.numel()
        out = torch.empty(k + 1, dtype=torch.float64, device=norms.device)
        out[0] = norms[keep].sum()
        out[1:] = hist.sum(0)[:k].cumsum(0) if flat.numel() else 0.0
        return out.cpu().numpy()

    def grid_histograms(self, flat: torch.Tensor, grid: torch.Tensor, *, bucket_size: int, norm: str):
        """The rows of ``bits="auto"`` refits, by the torch kernels on the tensor's device."""
        self._check_device(flat.device)
        return torch_kernels.grid_histograms(flat, grid, bucket_size=bucket_size, norm=norm)


_CODECS: dict[bool, TritonCodec] = {}


def _cpu_message(device: torch.device) -> str:
    return (
        f"codec 'triton' takes CUDA tensors; tensors on {device} run only under Triton's "
        f"interpreter, which needs TRITON_INTERPRET=1 in the environment before triton is first "
        f"imported (slow, meant for tests); use codec='auto' or 'cpu' for CPU tensors"
    )


def factory(device: torch.device) -> TritonCodec:
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"codec 'triton' takes CUDA tensors (CPU tensors under Triton's interpreter), not {device}")
    if device.type == "cpu" and not interpret_requested():  # (decided without importing triton)
        message = _cpu_message(device)
        if importlib.util.find_spec("triton") is None:
            message += f"; triton is not installed either: {INSTALL_HINT}"
        raise ValueError(message)
    reason = import_error()
    if reason is not None:
        raise ValueError(f"codec 'triton' needs Triton, which is not importable ({reason}); {INSTALL_HINT}")
    interpret = triton_interpreted()
    if device.type == "cpu" and not interpret:
        raise ValueError(
            "codec 'triton' on CPU tensors: TRITON_INTERPRET=1 is set, but triton was "
            "imported before it was set and runs compiled; set it before the first "
            "import of triton (e.g. in the environment of the process)"
        )
    if interpret not in _CODECS:
        _CODECS[interpret] = TritonCodec(interpret)
    return _CODECS[interpret]
