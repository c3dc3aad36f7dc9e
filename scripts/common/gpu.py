"""What the GPU check's codec sections (scripts/bench/gpu_paths_codec.py) use: this package's codecs
without its framework packages, CUDA-event timing, peak extra memory, the copy bandwidth, the
interpreter's payload for the agreement check and the timed rows of one size."""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import torch

from scripts.common.bench import parse_size  # noqa: F401 (the GPU benchmarks' sizes)

ROOT = Path(__file__).resolve().parents[2]


def _import_codecs():
    """horovod_alq.torch.codecs, without horovod_alq.torch's __init__ (the compressors need scipy
    and Horovod, which a bare GPU machine may lack)."""
    try:
        from horovod_alq.torch import codecs

        return codecs
    except ImportError:
        for name in list(sys.modules):
            if name.startswith("horovod_alq.torch"):
                del sys.modules[name]
        pkg = types.ModuleType("horovod_alq.torch")
        pkg.__path__ = [str(ROOT / "horovod_alq" / "torch")]
        sys.modules["horovod_alq.torch"] = pkg
        from horovod_alq.torch import codecs

        return codecs


def _grid() -> torch.Tensor:
    try:
        from horovod_alq.core.statistics import GRID
    except ImportError:  # the same grid (core/statistics.py), without scipy
        GRID = np.concatenate([-np.geomspace(1e-6, 1.0, 400)[::-1], [0.0], np.geomspace(1e-6, 1.0, 400)])
    return torch.tensor(GRID, dtype=torch.float64, device="cuda")


def time_ms(fn, repeats: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def peak_extra(fn, keep_bytes: int) -> int:
    """Bytes allocated by ``fn`` at its peak beyond what existed before, minus ``keep_bytes``
    (its own output)."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    result = fn()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base - keep_bytes
    del result
    return max(0, extra)


def copy_bandwidth() -> float:
    x = torch.empty(1 << 28, dtype=torch.float32, device="cuda")
    y = torch.empty_like(x)
    ms = time_ms(lambda: y.copy_(x), 10)
    return 2 * x.numel() * 4 / (ms * 1e-3)


def _interpreter_payload(n: int, bits: int, d: int, seed: int) -> torch.Tensor:
    """The same encode under Triton's interpreter, in a fresh process (Triton picks interpreter or
    compiler at its first import)."""
    code = (
        f"import sys, torch; "
        f"sys.argv = ['x']; import scripts.common.gpu as b; codecs = b._import_codecs(); "
        f"x = torch.randn({n}, generator=torch.Generator().manual_seed(0)); "
        f"lv = torch.linspace(-1, 1, {1 << bits}, dtype=torch.float64); "
        f"p = codecs.resolve('triton', 'cpu').encode(x, lv, torch.zeros(32, dtype=torch.uint8), bits={bits}, "
        f"bucket_size={d}, norm='l2', seed={seed}); sys.stdout.buffer.write(p.numpy().tobytes())"
    )
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(out.stderr.decode()[-2000:])
    return torch.frombuffer(bytearray(out.stdout), dtype=torch.uint8)


def bench_size(
    codecs, name: str, n: int, bits: int, d: int, repeats: int, bandwidth: float, baseline: bool
) -> list[tuple]:
    torch.manual_seed(0)
    x = torch.randn(n, device="cuda")
    levels = torch.linspace(-1, 1, 1 << bits, dtype=torch.float64, device="cuda")
    header = torch.zeros(32, dtype=torch.uint8)
    nb = -(-n // d)
    code_bytes = -(-n * bits // 8)
    payload_bytes = 32 + 4 * nb + code_bytes
    in_bytes = 4 * n
    grid = _grid()
    rows = []
    backends = ["triton"] + (["torch"] if baseline else [])
    for backend in backends:
        codec = codecs.resolve(backend, "cuda")
        enc = lambda: codec.encode(x, levels, header, bits=bits, bucket_size=d, norm="l2", seed=7)  # noqa: E731
        payload = enc()
        assert payload.numel() == payload_bytes
        ms = time_ms(enc, repeats)
        extra = peak_extra(enc, payload_bytes)
        floor = (in_bytes + 4 * nb + code_bytes) / bandwidth * 1e3
        rows.append((name, backend, "encode", ms, floor, extra / in_bytes))
        for p in (1, 4, 8):
            payloads = payload.repeat(p)
            offsets = [i * payload_bytes for i in range(p)]
            out = torch.empty(n, dtype=torch.float32, device="cuda")
            dec = lambda: codec.decode_sum(out, payloads, offsets, levels, bits=bits, bucket_size=d, scale=1.0 / p)  # noqa: E731
            ms = time_ms(dec, repeats)
            extra = peak_extra(dec, 0)
            floor = (p * (4 * nb + code_bytes) + 4 * n) / bandwidth * 1e3
            rows.append((name, backend, f"decode-sum x{p}", ms, floor, extra / in_bytes))
        stats = lambda: codec.grid_statistics(x, grid, bucket_size=d, norm="l2")  # noqa: E731
        ms = time_ms(stats, max(3, repeats // 2), warmup=1)
        extra = peak_extra(stats, 0)
        rows.append((name, backend, "grid statistics", ms, in_bytes / bandwidth * 1e3, extra / in_bytes))
        del payload
    cast = lambda: x.half().float()  # noqa: E731
    ms = time_ms(cast, repeats)
    rows.append(
        (name, "torch", "fp16 cast round trip", ms, 12 * n / bandwidth * 1e3, peak_extra(cast, 4 * n) / in_bytes)
    )
    return rows


class Skipped(Exception):
    """A section of the GPU check (scripts/bench/gpu_paths.py) that cannot run here: reported as
    skipped with this reason."""
