"""The codec sections of scripts.bench.gpu_paths: correctness of ``codec="auto"`` (Triton on CUDA)
and the torch-ops codec, and the codec benchmark's table (on the CPU dry run with
``torch.cuda`` stood in by the CPU)."""

from __future__ import annotations

import functools
import importlib.util
import math
import time
from unittest import mock

import numpy as np
import torch

from scripts.common import gpu

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
    """The payload of Triton's interpreter (scripts/common/gpu.py's subprocess): on CUDA byte for byte
    against the GPU's; on every device, decoded identically by this device's codecs."""
    if importlib.util.find_spec("triton") is None:
        sec.check("Triton importable (for the interpreter's payload)", not ctx.cuda, "triton is not installed")
        sec.lines.append("- interpreter payload: not compared (triton is not installed)")
        return
    n, bits, d, seed = ctx.pick(20_000, 100_000), 3, 8192, 12345
    interp = gpu._interpreter_payload(n, bits, d, seed).to(ctx.device)
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
    codecs = gpu._import_codecs()
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
    """``torch`` as scripts/common/gpu.py sees it in the CPU dry run: ``device="cuda"`` means the CPU,
    ``torch.cuda`` times with perf_counter and reports no memory."""

    class cuda:  # noqa: N801
        Event = _CpuEvent
        synchronize = empty_cache = reset_peak_memory_stats = staticmethod(lambda: None)
        memory_allocated = max_memory_allocated = staticmethod(lambda: 0)

    def __getattr__(self, name):
        attr = getattr(torch, name)
        return functools.partial(_on_cpu, attr) if callable(attr) and not isinstance(attr, type) else attr


class _CpuCodecs:
    """The codec registry for scripts/common/gpu.py on the CPU: "triton" stands for "auto"."""

    def __init__(self, codecs) -> None:
        self.codecs = codecs

    def resolve(self, name: str, device):
        return self.codecs.resolve("auto" if name == "triton" else name, "cpu")


def _bench_rows(ctx, codecs, sizes: list[str], bits: int, d: int) -> list[tuple]:
    repeats, bandwidth = ctx.pick(2, 10), ctx.args.bandwidth
    if ctx.cuda:
        return [
            r for s in sizes for r in gpu.bench_size(codecs, s, gpu.parse_size(s), bits, d, repeats, bandwidth, True)
        ]
    with mock.patch.object(gpu, "torch", _CpuTorch()):
        cpu = _CpuCodecs(codecs)
        rows = [r for s in sizes for r in gpu.bench_size(cpu, s, gpu.parse_size(s), bits, d, repeats, bandwidth, True)]
    name = codecs.resolve("auto", "cpu").name
    return [(r[0], f"{name} (for triton)" if r[1] == "triton" else r[1], *r[2:]) for r in rows]


def codec_benchmark(ctx, sec) -> None:
    codecs = gpu._import_codecs()
    sizes = [s.strip() for s in (ctx.args.sizes or ctx.pick("64K,256K", "16M,64M,256M")).split(",")]
    bits, d = 3, 8192
    if ctx.cuda:
        sec.lines.append(f"Measured device-to-device copy bandwidth: {gpu.copy_bandwidth() / 1e12:.2f} TB/s.")
    else:
        sec.lines.append(
            "CPU dry run: scripts.common.gpu.bench_size with torch.cuda stood in by the CPU "
            "(perf_counter timing, no memory statistics)."
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
            if codec == "triton" and gpu.parse_size(size) >= 64 << 20:
                sec.target(f"Triton encode + decode at {size}, x the memory floor", total / floor, 3.0, "x")
    sec.data["rows"] = [dict(zip(("elements", "codec", "operation", "ms", "floor_ms", "peak_extra"), r)) for r in rows]
    sec.check("every row timed", all(r[3] > 0 for r in rows) and len(rows) == 11 * len(sizes))


SECTIONS = {
    "codec": ("Codec correctness", codec_correctness),
    "bench": ("Codec benchmark", codec_benchmark),
}
