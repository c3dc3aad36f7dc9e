"""The codec sections of scripts.bench.gpu_paths: correctness of ``codec="auto"`` (Triton on CUDA)
and the torch-ops codec, and the codec benchmark's table (in the CPU dry run, ``torch.cuda`` stood
in by the CPU); the codecs imported without this package's framework modules, CUDA-event timing."""

from __future__ import annotations

import functools
import importlib.util
import math
import os
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path
from unittest import mock

import numpy as np
import torch
import torch as _torch  # the real one, while the CPU dry run patches ``torch`` here

from scripts.common.bench import parse_size


class Skipped(Exception):
    """A section of the GPU check (scripts/bench/gpu_paths.py) that cannot run here: reported as
    skipped with this reason."""


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
        f"sys.argv = ['x']; import scripts.bench.gpu_paths_codec as b; codecs = b._import_codecs(); "
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


HEADER = torch.zeros(32, dtype=torch.uint8)  # the payload header: copied, never read here


# ---------------------------------------------------------------------------------------- codec
def _levels(bits: int, device) -> torch.Tensor:
    return torch.linspace(-1, 1, 1 << bits, dtype=torch.float64, device=device)


def _encode(codec, x: torch.Tensor, bits: int, d: int, seed: int) -> torch.Tensor:
    return codec.encode(x, _levels(bits, x.device), HEADER.to(x.device), bits=bits, bucket_size=d, norm="l2", seed=seed)


def _decode(codec, payloads: list, n: int, bits: int, d: int, device, scale: float = 1.0) -> torch.Tensor:
    out = torch.full((n,), 7.0, dtype=torch.float32, device=device)  # overwritten, not added to
    offsets = np.cumsum([0] + [p.numel() for p in payloads[:-1]]).tolist()
    return codec.decode_sum(
        out, torch.cat(payloads), offsets, _levels(bits, device), bits=bits, bucket_size=d, scale=scale
    )


def _variance(payload: torch.Tensor, target: torch.Tensor, bits: int, d: int) -> np.ndarray:
    """Each coordinate's exact variance under stochastic rounding between its two levels (the norms
    read from the payload, the levels as the kernels use them: float32)."""
    n = target.numel()
    nb = -(-n // d)
    norms = np.frombuffer(payload[32 : 32 + 4 * nb].cpu().numpy().tobytes(), "<f4").astype(np.float64)
    norms = np.repeat(norms, d)[:n]
    lv = _levels(bits, "cpu").numpy().astype(np.float32).astype(np.float64)
    r = np.clip(target.cpu().numpy() / np.where(norms > 0, norms, 1.0), -1, 1)
    cell = np.clip(np.searchsorted(lv, r, side="right") - 1, 0, lv.size - 2)
    return norms**2 * np.clip((lv[cell + 1] - r) * (r - lv[cell]), 0, None)


def mean_errors(codec, x: torch.Tensor, bits: int, d: int, ts, chunk: int = 16) -> list[tuple]:
    """(T, rms error of the mean of T decodes (seeds 1..T), predicted rms) for each T in ``ts``:
    decode-sums of ``chunk`` payloads at a time, accumulated in float64."""
    n, target = x.numel(), x.double()
    acc = torch.zeros(n, dtype=torch.float64, device=x.device)
    seed, first, rows = 1, None, []
    for t in sorted(ts):
        while seed <= t:
            payloads = [_encode(codec, x, bits, d, s) for s in range(seed, min(t, seed + chunk - 1) + 1)]
            first = payloads[0] if first is None else first
            acc += _decode(codec, payloads, n, bits, d, x.device).double()
            seed += len(payloads)
        observed = float(((acc / t - target) ** 2).mean().sqrt())
        rows.append((t, observed))
    mean_var = float(_variance(first, target, bits, d).mean())
    return [(t, e, math.sqrt(mean_var / t)) for t, e in rows]


def _unbiased(ctx, sec, codec, label: str, x: torch.Tensor, d: int) -> None:
    ts = ctx.pick((4, 16, 64, 256), (16, 64, 256, 1024))
    for bits in (2, 3, 4, 8):
        rows = mean_errors(codec, x, bits, d, ts)
        ratios = [e / p for _, e, p in rows]
        slope = float(np.polyfit(np.log([t for t, _, _ in rows]), np.log([e for _, e, _ in rows]), 1)[0])
        sec.data.setdefault("unbiased", []).append({"codec": label, "bits": bits, "rows": rows, "slope": slope})
        detail = f"error / predicted at T={ts}: {', '.join(f'{r:.3f}' for r in ratios)}; slope of log error {slope:.3f}"
        sec.check(
            f"{label}, {bits} bits: mean of T decodes unbiased, error ~ 1/sqrt(T)",
            all(0.85 <= r <= 1.15 for r in ratios) and -0.55 <= slope <= -0.45,
            detail,
        )


def _non_finite(ctx, sec, codec, label: str, d: int) -> None:
    x = torch.randn(4 * d, generator=torch.Generator().manual_seed(3)).to(ctx.device)
    x[d + 3], x[3 * d + 1] = float("nan"), float("inf")
    clean = _encode(codec, torch.randn_like(x), 3, d, 2)
    for what, payloads in (("one payload", [_encode(codec, x, 3, d, 1)]), ("summed with a clean one", None)):
        payloads = payloads or [_encode(codec, x, 3, d, 1), clean]
        out = _decode(codec, payloads, x.numel(), 3, d, ctx.device).view(4, d).cpu()
        nan = out.isnan().all(1).tolist()
        finite = out.isfinite().all(1).tolist()
        ok = nan == [False, True, False, True] and finite == [True, False, True, False]
        sec.check(f"{label}: NaN and Inf confined to their buckets ({what})", ok, f"all-NaN buckets {nan}")


def _dtypes(ctx, sec, codec, label: str, x: torch.Tensor, d: int) -> None:
    t = ctx.pick(32, 128)
    size = _encode(codec, x, 3, d, 1).numel()
    for dtype in (torch.float16, torch.bfloat16, torch.float64):
        xd = x.to(dtype)
        kept = xd.clone()
        ((_, e, p),) = mean_errors(codec, xd, 3, d, (t,))
        same = _encode(codec, xd, 3, d, 1).numel() == size and torch.equal(xd, kept)
        sec.check(
            f"{label}: {str(dtype)[6:]} input: unchanged, payload as float32's, unbiased",
            same and 0.8 <= e / p <= 1.25,
            f"error / predicted at T={t}: {e / p:.3f}",
        )


def _cross_decode(ctx, sec, named: dict, x: torch.Tensor, d: int) -> None:
    for src, codec in named.items():
        payload = _encode(codec, x, 3, d, 5)
        outs = {dst: _decode(other, [payload], x.numel(), 3, d, ctx.device) for dst, other in named.items()}
        ref = next(iter(outs.values()))
        same = all(torch.equal(o, ref) for o in outs.values())
        sec.check(f"{src}'s payload decoded identically by {', '.join(outs)}", same)


def _interpreter(ctx, sec, codecs) -> None:
    """The payload of Triton's interpreter (:func:`_interpreter_payload`): on CUDA byte for byte
    against the GPU's; on every device, decoded identically by this device's codecs."""
    if importlib.util.find_spec("triton") is None:
        sec.check("Triton importable (for the interpreter's payload)", not ctx.cuda, "triton is not installed")
        sec.lines.append("- interpreter payload: not compared (triton is not installed)")
        return
    n, bits, d, seed = ctx.pick(20_000, 100_000), 3, 8192, 12345
    interp = _interpreter_payload(n, bits, d, seed).to(ctx.device)
    x = torch.randn(n, generator=torch.Generator().manual_seed(0)).to(ctx.device)
    nb = -(-n // d)
    mine = _encode(codecs.resolve("triton" if ctx.cuda else "auto", ctx.device), x, bits, d, seed)
    head = torch.equal(mine[: 32 + 4 * nb], interp[: 32 + 4 * nb])
    differ = int((mine != interp).sum()) if mine.numel() == interp.numel() else -1
    if ctx.cuda:
        sec.check(
            "GPU payload equals the interpreter's byte for byte",
            head and differ == 0,
            f"header and norms identical: {head}; code bytes that differ: {differ}",
        )
    else:
        sec.check("interpreter payload: header as this device's codec writes it", torch.equal(mine[:32], interp[:32]))
        sec.lines.append("- byte-for-byte comparison: on CUDA only (the CPU codecs draw with their own generator)")
    outs = [_decode(codecs.resolve(c, ctx.device), [interp], n, bits, d, ctx.device) for c in ("auto", "torch")]
    err = float((outs[0] - x).abs().max() / x.abs().max())
    sec.check(
        "interpreter payload decoded identically by auto and torch",
        torch.equal(*outs),
        f"max |decoded - x| / max |x|: {err:.3f}",
    )


def codec_correctness(ctx, sec) -> None:
    codecs = _import_codecs()
    auto = codecs.resolve("auto", ctx.device)
    if ctx.cuda:
        sec.check("codec='auto' picks Triton on CUDA", auto.name == "triton", f"picked {auto.name}")
    named = {f"auto ({auto.name})": auto, "torch": codecs.resolve("torch", ctx.device)}
    sec.data["codecs"] = list(named)
    n, d = ctx.pick((8192, 256), (1 << 20, 8192))
    x = torch.randn(n, generator=torch.Generator().manual_seed(1)).to(ctx.device)
    for label, codec in named.items():
        _unbiased(ctx, sec, codec, label, x, d)
        _non_finite(ctx, sec, codec, label, d)
        _dtypes(ctx, sec, codec, label, x, d)
    _cross_decode(ctx, sec, named, x, d)
    _interpreter(ctx, sec, codecs)
    sec.lines.append(f"{n} float32 elements, bucket {d}, L2 norm, levels evenly spaced in [-1, 1].")


# ---------------------------------------------------------------------------------------- bench
class _CpuEvent:
    def __init__(self, **_) -> None:
        self.t = 0.0

    def record(self) -> None:
        self.t = time.perf_counter()

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: _CpuEvent) -> float:
        return 1e3 * (end.t - self.t)


def _on_cpu(fn, *args, **kwargs):
    if "device" in kwargs:
        kwargs["device"] = "cpu"
    return fn(*args, **kwargs)


class _CpuTorch:
    """``torch`` as :func:`bench_size` sees it in the CPU dry run: ``device="cuda"`` means the CPU,
    ``torch.cuda`` times with perf_counter and reports no memory."""

    class cuda:  # noqa: N801
        Event = _CpuEvent
        synchronize = empty_cache = reset_peak_memory_stats = staticmethod(lambda: None)
        memory_allocated = max_memory_allocated = staticmethod(lambda: 0)

    def __getattr__(self, name):
        attr = getattr(_torch, name)
        return functools.partial(_on_cpu, attr) if callable(attr) and not isinstance(attr, type) else attr


class _CpuCodecs:
    """The codec registry for :func:`bench_size` on the CPU: "triton" stands for "auto"."""

    def __init__(self, codecs) -> None:
        self.codecs = codecs

    def resolve(self, name: str, device):
        return self.codecs.resolve("auto" if name == "triton" else name, "cpu")


def _bench_rows(ctx, codecs, sizes: list[str], bits: int, d: int) -> list[tuple]:
    repeats, bandwidth = ctx.pick(2, 10), ctx.args.bandwidth
    if ctx.cuda:
        return [r for s in sizes for r in bench_size(codecs, s, parse_size(s), bits, d, repeats, bandwidth, True)]
    with mock.patch.object(sys.modules[__name__], "torch", _CpuTorch()):
        cpu = _CpuCodecs(codecs)
        rows = [r for s in sizes for r in bench_size(cpu, s, parse_size(s), bits, d, repeats, bandwidth, True)]
    name = codecs.resolve("auto", "cpu").name
    return [(r[0], f"{name} (for triton)" if r[1] == "triton" else r[1], *r[2:]) for r in rows]


def codec_benchmark(ctx, sec) -> None:
    codecs = _import_codecs()
    sizes = [s.strip() for s in (ctx.args.sizes or ctx.pick("64K,256K", "16M,64M,256M")).split(",")]
    bits, d = 3, 8192
    if ctx.cuda:
        sec.lines.append(f"Measured device-to-device copy bandwidth: {copy_bandwidth() / 1e12:.2f} TB/s.")
    else:
        sec.lines.append(
            "CPU dry run: bench_size with torch.cuda stood in by the CPU (perf_counter timing, no memory statistics)."
        )
    rows = _bench_rows(ctx, codecs, sizes, bits, d)
    sec.lines += [
        f"{bits} bits, bucket {d}, floor at {ctx.args.bandwidth / 1e12:.1f} TB/s.",
        "",
        "| elements | codec | operation | ms | / floor | peak extra (x input) |",
        "|---|---|---|---|---|---|",
    ]
    sec.lines += [f"| {s} | {c} | {op} | {ms:.3f} | {ms / fl:.1f}x | {ex:.3f} |" for s, c, op, ms, fl, ex in rows]
    sec.lines += [
        "",
        "| elements | codec | encode + decode x1 ms | / fp16 round trip | / floor |",
        "|---|---|---|---|---|",
    ]
    for size in sizes:
        mine = [r for r in rows if r[0] == size]
        fp16 = next(r[3] for r in mine if r[2] == "fp16 cast round trip")
        for codec in dict.fromkeys(r[1] for r in mine if r[2] == "encode"):
            enc, dec = (next(r for r in mine if r[1] == codec and r[2] == op) for op in ("encode", "decode-sum x1"))
            total, floor = enc[3] + dec[3], enc[4] + dec[4]
            sec.lines.append(f"| {size} | {codec} | {total:.3f} | {total / fp16:.1f}x | {total / floor:.1f}x |")
            if codec == "triton" and parse_size(size) >= 64 << 20:
                sec.target(f"Triton encode + decode at {size}, x the memory floor", total / floor, 3.0, "x")
    sec.data["rows"] = [dict(zip(("elements", "codec", "operation", "ms", "floor_ms", "peak_extra"), r)) for r in rows]
    sec.check("every row timed", all(r[3] > 0 for r in rows) and len(rows) == 11 * len(sizes))


SECTIONS = {
    "codec": ("Codec correctness", codec_correctness),
    "bench": ("Codec benchmark", codec_benchmark),
}
