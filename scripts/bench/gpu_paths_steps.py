"""The training sections of scripts.bench.gpu_paths: DDP step times at world size 1 (NCCL on CUDA,
gloo on CPU), the FSDP2, DiLoCo and torch.compile smoke runs, and the Horovod compressor (in a
subprocess, ``--horovod-worker DEVICE``, so a crash cannot take the report down).
"""

# no `from __future__ import annotations`: DDP checks the hooks' annotations as objects

import copy
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
import traceback

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# ---------------------------------------------------------------------------------------- setup
def ensure_group(ctx) -> None:
    """The world of this process alone: NCCL on CUDA, gloo on CPU (once per process)."""
    if dist.is_initialized():
        return
    if ctx.cuda:
        torch.cuda.set_device(ctx.device)
    backend = "nccl" if ctx.cuda else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def no_exchange_hook(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The local gradients at once: the step's cost without any exchange."""
    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def finite(params) -> bool:
    return all(bool(torch.isfinite(p).all()) for p in params)


def train_losses(data, opt, loss_of, step=None) -> list[float]:
    """The losses of a run over ``data`` ((x, y) batches): zero_grad, ``loss_of(x, y)``, backward,
    then ``step`` (default ``opt.step``)."""
    losses = []
    for x, y in data:
        opt.zero_grad(set_to_none=True)
        loss = loss_of(x, y)
        loss.backward()
        (step or opt.step)()
        losses.append(float(loss.detach()))
    return losses


def falls(losses: list, k: int = 3) -> bool:
    """The mean of the last ``k`` losses below 95% of the mean of the first ``k``."""
    return sum(losses[-k:]) / k < 0.95 * sum(losses[:k]) / k


def optimizer_check(hvd, model, w, gen) -> tuple:
    """40 SGD steps of ``hvd.DistributedOptimizer`` with ALQ on a linear regression to ``w`` (batches
    drawn from ``gen``): the check that the loss falls, and the losses."""
    from horovod_alq.torch import ALQCompressor

    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05),
        named_parameters=model.named_parameters(),
        compression=ALQCompressor(bits=3, min_size=0),
    )
    losses = []
    for _ in range(40):
        xb = torch.randn(64, 32, generator=gen).to(w.device)
        opt.zero_grad()
        loss = F.mse_loss(model(xb), xb @ w)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    detail = f"{losses[0]:.3f} -> {losses[-1]:.3f}"
    return {"name": "DistributedOptimizer: loss falls", "ok": falls(losses), "detail": detail}, losses


def check(checks: list, name: str, ok, detail: str = "") -> None:
    checks.append({"name": name, "ok": bool(ok), "detail": detail})


def unbiased(outs: list, exact: torch.Tensor, name: str, checks: list) -> None:
    one = float((outs[-1] - exact).norm() / exact.norm())
    mean = float((torch.stack(outs).mean(0) - exact).norm() / exact.norm())
    ok = all(o.device == exact.device and o.dtype == exact.dtype and bool(torch.isfinite(o).all()) for o in outs)
    check(checks, f"{name}: on the device, float32, finite", ok, f"{len(outs)} rounds")
    # unbiased and independent rounds: the mean's error is about one round's / sqrt(16) = 1/4
    check(
        checks,
        f"{name}: mean of {len(outs)} rounds closer than one (unbiased)",
        mean < 0.5 * one,
        f"relative error: one {one:.3f}, mean {mean:.3f}",
    )


# ---------------------------------------------------------------------------------------- models
class GPTLoss(nn.Module):
    """DDP's module: ``forward(x, y)`` is the GPT's next-token loss."""

    def __init__(self, gpt) -> None:
        super().__init__()
        self.gpt = gpt

    def forward(self, x, y):
        return self.gpt.loss(x, y)


def gpt(ctx, size: str) -> GPTLoss:
    """The GPT of scripts.common.gpt, head tied to the token embedding: ``size`` "gpt2" (GPT-2 small's
    shape, 124.5M parameters) or "char" (the studies'); --tiny: width 64, 2 layers."""
    from scripts.common.gpt import GPT

    shapes = {"gpt2": (50257, 768, 12, 12, 1024), "char": (103, 192, 4, 4, 128), "tiny": (103, 64, 2, 2, 32)}
    model = GPT(*shapes["tiny" if ctx.tiny else size])
    model.head.weight = model.tok.weight
    return GPTLoss(model).to(ctx.device)


class Bottleneck(nn.Module):
    def __init__(self, cin: int, mid: int, stride: int) -> None:
        super().__init__()
        cout = 4 * mid
        self.body = nn.Sequential(
            nn.Conv2d(cin, mid, 1, bias=False),
            nn.BatchNorm2d(mid),
            nn.ReLU(inplace=True),
            nn.Conv2d(mid, mid, 3, stride, 1, bias=False),
            nn.BatchNorm2d(mid),
            nn.ReLU(inplace=True),
            nn.Conv2d(mid, cout, 1, bias=False),
            nn.BatchNorm2d(cout),
        )
        short = stride != 1 or cin != cout
        self.short = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)) if short else None

    def forward(self, x):
        return F.relu(self.body(x) + (x if self.short is None else self.short(x)))


class ResNetLoss(nn.Module):
    """torchvision's ResNet-50 (25,557,032 parameters at width 64, blocks 3-4-6-3, 1000 classes),
    written out (no torchvision); ``forward(x, y)`` is the cross-entropy."""

    def __init__(self, width: int = 64, blocks=(3, 4, 6, 3), classes: int = 1000) -> None:
        super().__init__()
        layers = [
            nn.Conv2d(3, width, 7, 2, 3, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(3, 2, 1),
        ]
        cin = width
        for i, n in enumerate(blocks):
            for j in range(n):
                layers.append(Bottleneck(cin, width << i, 2 if j == 0 and i > 0 else 1))
                cin = 4 * (width << i)
        self.features = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.fc = nn.Linear(cin, classes)

    def forward(self, x, y):
        return F.cross_entropy(self.fc(self.features(x)), y)


def batches(ctx, model_name: str, count: int) -> list:
    g = torch.Generator().manual_seed(7)
    if model_name == "resnet":
        b, side, classes = ctx.pick((4, 32, 10), (32, 224, 1000))
        make = lambda: (torch.randn(b, 3, side, side, generator=g), torch.randint(0, classes, (b,), generator=g))  # noqa: E731
    else:
        b, t, vocab = ctx.pick((4, 32, 103), (8, 1024, 50257))
        make = lambda: tuple(torch.randint(0, vocab, (2, b, t), generator=g))  # noqa: E731
    return [tuple(v.to(ctx.device) for v in make()) for _ in range(count)]


# ---------------------------------------------------------------------------------------- DDP
def hook_rows() -> dict:
    """label -> (state, hook), or None for DDP's own allreduce."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    from horovod_alq.torch.ddp import ALQState, alq_hook

    steady = dict(update_steps=(0,), update_every=0, seed=0)  # refit at step 0 (a warm-up step)
    power = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=4, start_powerSGD_iter=2)
    return {
        "DDP allreduce": None,
        "fp16_compress_hook": (None, default_hooks.fp16_compress_hook),
        "bf16_compress_hook": (None, default_hooks.bf16_compress_hook),
        "PowerSGD rank 4": (power, powerSGD_hook.powerSGD_hook),
        "alq_hook bits=3": (ALQState(bits=3, **steady), alq_hook),
        'alq_hook bits="auto"': (ALQState(bits="auto", **steady), alq_hook),
        "no exchange": (None, no_exchange_hook),
    }


def timed_step(ctx, model, opt, batch) -> tuple:
    """(seconds, loss) of one step: forward under bf16 autocast, backward with DDP's exchange, SGD."""
    ctx.sync()
    start = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    with torch.autocast(ctx.device.type, dtype=torch.bfloat16):
        loss = model(*batch)
    loss.backward()
    opt.step()
    ctx.sync()
    return time.perf_counter() - start, float(loss.detach())


def make_row(ctx, base: nn.Module, spec) -> dict:
    """A copy of ``base`` in DDP with the row's hook; a hook that does not serve this device on the
    CPU dry run (bf16_compress_hook: NCCL only) makes a skipped row, on CUDA a failed one."""
    model = DDP(copy.deepcopy(base), device_ids=[ctx.device.index] if ctx.cuda else None)
    row = {"model": model, "state": spec and spec[0], "times": [], "losses": [], "error": None, "skipped": None}
    row["opt"] = torch.optim.SGD(model.parameters(), lr=1e-3)
    try:
        if spec is not None:
            model.register_comm_hook(*spec)
    except Exception as exc:  # noqa: BLE001
        if ctx.cuda:
            row["error"] = traceback.format_exc()
        else:
            row["skipped"] = f"{type(exc).__name__}: {exc}"
    return row


def run_rows(ctx, base: nn.Module, data: list, warmup: int) -> dict:
    """Every row's model stepped in turn on the same batches: label -> {"times", "losses", "state",
    "error", "skipped", "model", "opt"}."""
    rows = {label: make_row(ctx, base, spec) for label, spec in hook_rows().items()}
    for step, batch in enumerate(data):
        for row in rows.values():
            if row["error"] is not None or row["skipped"] is not None:
                continue
            try:
                seconds, loss = timed_step(ctx, row["model"], row["opt"], batch)
            except Exception:  # noqa: BLE001 - one row's failure is reported; the others still run
                row["error"] = traceback.format_exc()
                continue
            row["losses"].append(loss)
            if step >= warmup:
                row["times"].append(seconds)
    return rows


def ddp_section(ctx, sec, which: str) -> None:
    ensure_group(ctx)
    base = gpt(ctx, "gpt2") if which == "gpt" else ResNetLoss(*ctx.pick((8, (1, 1, 1, 1), 10), ())).to(ctx.device)
    params = sum(p.numel() for p in base.parameters())
    warmup, steps = ctx.pick((2, 3), (3, 10))
    rows = run_rows(ctx, base, batches(ctx, "resnet" if which == "resnet" else "gpt", warmup + steps), warmup)
    base_ms = statistics.median(rows["no exchange"]["times"]) * 1e3 if rows["no exchange"]["times"] else None
    sec.lines += [
        f"{params:,} parameters; bf16 autocast; median of {steps} steps after {warmup} warm-up steps, rows "
        f"interleaved; world size 1 ({'NCCL' if ctx.cuda else 'gloo'}).",
        "",
        "| row | median ms | excess over no exchange, ms | % of the no-exchange step | bits per coordinate "
        "| last loss |",
        "|---|---|---|---|---|---|",
    ]
    for label, row in rows.items():
        if row["skipped"] is not None:
            sec.lines.append(f"| {label} | not on this device: {row['skipped']} | | | | |")
            continue
        if row["error"] is not None or not row["times"]:
            sec.lines.append(f"| {label} | failed | | | | |")
            sec.lines += ["", f"{label}:", "", "```", (row["error"] or "no timed step").rstrip(), "```", ""]
            sec.check(f"{label}: steps run", False, (row["error"] or "no timed step").strip().splitlines()[-1])
            continue
        ms = statistics.median(row["times"]) * 1e3
        excess = ms - base_ms if base_ms else float("nan")
        state = row["state"]
        bits = f"{state.metrics()['bits_per_coordinate']:.3f}" if hasattr(state, "metrics") else "-"
        sec.lines.append(
            f"| {label} | {ms:.2f} | {excess:.2f} | {100 * excess / base_ms:.1f} | {bits} | {row['losses'][-1]:.4f} |"
        )
        sec.data[label] = {"median_ms": ms, "times": row["times"], "losses": row["losses"], "bits": bits}
        sec.check(
            f"{label}: losses and parameters finite",
            finite(row["model"].parameters()) and all(map(lambda v: v == v and abs(v) < float("inf"), row["losses"])),
        )
        if label == "alq_hook bits=3" and which == "gpt":
            value = 100 * excess / base_ms if ctx.cuda else None
            sec.target("alq_hook's own GPU cost, % of the GPT step", value, 10.0, "%", "CPU dry run")
    alq, bf16 = sec.data.get("alq_hook bits=3"), sec.data.get("bf16_compress_hook")
    if alq and bf16 and base_ms:
        sec.data["alq_over_bf16_ms"] = alq["median_ms"] - bf16["median_ms"]
        sec.lines += [
            "",
            f"alq_hook bits=3 against bf16_compress_hook: {alq['median_ms'] - base_ms:.2f} ms against "
            f"{bf16['median_ms'] - base_ms:.2f} ms over the no-exchange step ({sec.data['alq_over_bf16_ms']:+.2f} ms).",
        ]


# ---------------------------------------------------------------------------------------- smoke runs
def char_data(device, tiny: bool, count: int, seed: int = 0) -> list:
    from scripts.common.gpt import char_splits, sample_batch

    train, _, _ = char_splits()
    g = torch.Generator().manual_seed(seed)
    b, t = (8, 32) if tiny else (16, 128)
    return [tuple(v.to(device) for v in sample_batch(train, b, t, g)) for _ in range(count)]


def fsdp_smoke(ctx, sec) -> None:
    """FSDP2's reduce-scatter comm called directly (FSDP2 skips it at one rank) on the flat
    gradients of the character GPT, trained with AdamW; then one bf16 call with ``async_op``."""
    from horovod_alq.torch.fsdp import ALQReduceScatter

    ensure_group(ctx)
    model = gpt(ctx, "char")
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=3e-3)
    comm = ALQReduceScatter(bits=3)
    losses = []
    for x, y in char_data(ctx.device, ctx.tiny, ctx.pick(30, 60)):
        opt.zero_grad(set_to_none=True)
        loss = model(x, y)
        loss.backward()
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        out = torch.empty_like(flat)
        comm(out, flat, dist.group.WORLD, dist.ReduceOp.AVG)
        torch.nn.utils.vector_to_parameters(out, [p.grad for p in params])
        opt.step()
        losses.append(float(loss.detach()))
    sec.check("loss falls", falls(losses), f"{losses[0]:.3f} -> {losses[-1]:.3f}")
    sec.check("parameters finite", finite(params))
    half = flat.to(torch.bfloat16)
    out = torch.empty_like(half)
    comm(out, half, dist.group.WORLD, dist.ReduceOp.AVG, async_op=True).wait()
    err = float((out.float() - half.float()).norm() / half.float().norm())
    sec.check(
        "bf16 input, async_op: output bf16, finite",
        out.dtype == torch.bfloat16 and finite([out]),
        f"relative error {err:.3f}",
    )
    sec.data.update(losses=losses, metrics={k: v for k, v in comm.metrics().items() if isinstance(v, (int, float))})


def diloco_smoke(ctx, sec) -> None:
    from horovod_alq.torch.diloco import DiLoCo

    ensure_group(ctx)
    model = gpt(ctx, "char")
    inner = torch.optim.AdamW(model.parameters(), lr=3e-3)
    loco = DiLoCo(model, inner, sync_every=5, bits=3)
    data = char_data(ctx.device, ctx.tiny, ctx.pick(30, 60))
    losses = train_losses(data, inner, model, loco.step)
    sec.check("loss falls", falls(losses), f"{losses[0]:.3f} -> {losses[-1]:.3f}")
    sec.check("parameters finite", finite(model.parameters()))
    sec.check(
        "an outer step every 5 inner steps", loco.outer_steps == len(data) // 5, f"{loco.outer_steps} outer steps"
    )
    sec.data.update(losses=losses, metrics={k: v for k, v in loco.metrics().items() if isinstance(v, (int, float))})


#: compiled against eager, step by step from the same weights: the losses within LOSS_RTOL, and
#: the averaged (quantized) gradients equal within GRAD_RTOL but at a fraction FLIPS of coordinates
#: at most (a draw that the float rounding of the compiled gradient puts on the other level)
LOSS_RTOL, GRAD_RTOL, FLIPS = 1e-4, 1e-4, 1e-3


def _ddp_with_hook(ctx, base: nn.Module) -> DDP:
    from horovod_alq.torch.ddp import ALQState, alq_hook

    # find_unused_parameters: DDP keeps its first bucket layout (it rebuilds the buckets in the order
    # the gradients became ready otherwise, which compiled code may change: other buckets, other draws)
    model = DDP(copy.deepcopy(base), device_ids=[ctx.device.index] if ctx.cuda else None, find_unused_parameters=True)
    model.register_comm_hook(ALQState(bits=3, seed=0, update_steps=(0,), update_every=0), alq_hook)
    return model


def compile_smoke(ctx, sec) -> None:
    """``torch.compile(DDP(model))`` with alq_hook against eager on the same weights and batch at
    every step: losses and averaged gradients compared; then the eager model steps."""
    ensure_group(ctx)
    base = gpt(ctx, "char")
    eager, plain = _ddp_with_hook(ctx, base), _ddp_with_hook(ctx, base)
    compiled = torch.compile(plain)
    opt = torch.optim.SGD(eager.parameters(), lr=0.3)
    losses, loss_diff, flips, total, seconds = [], 0.0, 0, 0, {"eager": 0.0, "compiled": 0.0}
    for x, y in char_data(ctx.device, ctx.tiny, ctx.pick(8, 20)):
        with torch.no_grad():
            for p, q in zip(plain.parameters(), eager.parameters()):
                p.copy_(q)
        result = {}
        for mode, model, run in (("eager", eager, eager), ("compiled", plain, compiled)):
            model.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            loss = run(x, y)
            loss.backward()
            ctx.sync()
            seconds[mode] += time.perf_counter() - t0
            result[mode] = (float(loss.detach()), torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
        (le, ge), (lc, gc) = result["eager"], result["compiled"]
        loss_diff = max(loss_diff, abs(lc - le) / abs(le))
        flips += int((~torch.isclose(gc, ge, rtol=GRAD_RTOL, atol=1e-7 * float(ge.abs().max()))).sum())
        total += ge.numel()
        losses.append(lc)
        opt.step()
    sec.check("compiled: loss falls", falls(losses), f"{losses[0]:.3f} -> {losses[-1]:.3f}")
    sec.check("parameters finite", finite(eager.parameters()))
    sec.check(f"compiled equals eager: losses within {LOSS_RTOL:g}", loss_diff <= LOSS_RTOL, f"{loss_diff:.2e}")
    sec.check(
        f"compiled equals eager: averaged gradients within {GRAD_RTOL:g} but at most {FLIPS:g} of them",
        flips <= FLIPS * total,
        f"{flips} of {total} differ",
    )
    sec.lines.append(
        f"{len(losses)} steps; eager {seconds['eager']:.1f} s, compiled {seconds['compiled']:.1f} s "
        "(forward and backward, compilation included)."
    )
    sec.data.update(losses=losses, loss_diff=loss_diff, flips=flips, coordinates=total)


# ---------------------------------------------------------------------------------------- Horovod
def horovod_section(ctx, sec) -> None:
    from scripts.bench.gpu_paths_codec import Skipped

    if importlib.util.find_spec("horovod") is None:
        raise Skipped("Horovod is not importable (building it with NCCL: docs/guides/gpu.md)")
    cmd = [sys.executable, "-m", "scripts.bench.gpu_paths_steps", "--horovod-worker", ctx.device.type]
    if ctx.tiny:
        cmd.append("--tiny")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    last = (proc.stdout.strip().splitlines() or [""])[-1]
    if proc.returncode != 0 or not last.startswith("{"):
        raise RuntimeError(
            f"the Horovod worker exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        )
    result = json.loads(last)
    if "skip" in result:
        raise Skipped(result["skip"])
    for c in result["checks"]:
        sec.check(c["name"], c["ok"], c["detail"])
    sec.data.update(result["data"])


def horovod_worker(device: str, tiny: bool) -> dict:
    """In the subprocess: Horovod's allreduce with the ALQ compressor on ``device``, then a short
    regression trained with hvd.DistributedOptimizer and the compressor."""
    import horovod.torch as hvd

    from horovod_alq.torch import ALQCompressor

    if device == "cuda" and not hvd.nccl_built():
        return {"skip": "this Horovod is built without NCCL (building it with NCCL: docs/guides/gpu.md)"}
    hvd.init()
    dev = torch.device("cuda", hvd.local_rank()) if device == "cuda" else torch.device("cpu")
    checks, n, rounds = [], (1 << 14) if tiny else (1 << 22), 16
    comp = ALQCompressor(bits=3)
    x = torch.randn(n, generator=torch.Generator().manual_seed(0)).to(dev)
    outs = [hvd.allreduce(x, compression=comp, op=hvd.Average, name=f"x{i}") for i in range(rounds)]
    unbiased(outs, x, "allreduce", checks)
    g = torch.Generator().manual_seed(1)
    w = torch.randn(32, 1, generator=g).to(dev)
    check, losses = optimizer_check(hvd, nn.Linear(32, 1).to(dev), w, g)
    checks.append(check)
    hvd.shutdown()
    return {"checks": checks, "data": {"losses": losses, "horovod": __import__("horovod").__version__}}


SECTIONS = {
    "ddp-gpt": ("DDP steps: GPT-2 small", lambda ctx, sec: ddp_section(ctx, sec, "gpt")),
    "ddp-resnet": ("DDP steps: ResNet-50", lambda ctx, sec: ddp_section(ctx, sec, "resnet")),
    "fsdp": ("Smoke: FSDP2 comm", fsdp_smoke),
    "diloco": ("Smoke: DiLoCo", diloco_smoke),
    "compile": ("Smoke: torch.compile(DDP) against eager", compile_smoke),
    "horovod": ("Horovod compressor", horovod_section),
}


if __name__ == "__main__" and sys.argv[1:2] == ["--horovod-worker"]:
    print(json.dumps(horovod_worker(sys.argv[2], "--tiny" in sys.argv)), flush=True)
