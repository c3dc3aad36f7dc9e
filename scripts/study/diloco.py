#!/usr/bin/env python
"""DiLoCo with quantized pseudo-gradients on the character GPT (issue 42): held-out loss against
bytes sent and a modeled wall-clock at --rate; one torchrun launch of 4 gloo workers per seed (its
JSON under data/diloco_study_raw/, skipped when present). Rows, their names and the results:
docs/results/diloco_study.md.

    python -m scripts.study.diloco     # every row, 3 seeds, 4 workers, into build/results
    python -m scripts.study.diloco --quick --out-dir /tmp/diloco  # 2 workers, 1 seed, 20 steps, 3 rows

A row is ``base(@lrX)?(@mX)?(@nX)?``: base a key of ROWS or ``h<H>-<kind>`` (``h50-<kind>`` with H
inner steps); ``@lr``, ``@m``: outer lr and Nesterov momentum (0.7, 0.9); ``@n``: fp32 only, noise of
that norm relative to the averaged pseudo-gradient (issue 54).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from scripts.common import launch as launching
from scripts.common import report as pages
from scripts.common.report import mean_se

ROOT = Path(__file__).resolve().parents[2]
#: Every row: (name, H or None for per-step data parallelism, method, bits, error feedback, wire).
ROWS = {
    "dp-fp16": (None, "fp16", None, False, "fixed"),
    "h50-fp32": (50, "fp32", None, False, "fixed"),
    "h50-int8": (50, "int8", None, False, "fixed"),
    "h50-qsgdinf2": (50, "qsgdinf", 2, False, "fixed"),
    "h50-qsgdinf2-ef": (50, "qsgdinf", 2, True, "fixed"),
    "h50-alq4": (50, "alq", 4, False, "fixed"),
    "h50-alq3": (50, "alq", 3, False, "fixed"),
    "h50-alq2": (50, "alq", 2, False, "fixed"),
    "h50-alq2-ef": (50, "alq", 2, True, "fixed"),
    "h10-fp32": (10, "fp32", None, False, "fixed"),
    "h10-alq3": (10, "alq", 3, False, "fixed"),
    # the entropy-coded wire: the same outer steps as the row without "-entropy" (same seed), fewer bytes
    "h50-alq4-entropy": (50, "alq", 4, False, "entropy"),
    "h50-alq3-entropy": (50, "alq", 3, False, "entropy"),
    "h50-alq2-entropy": (50, "alq", 2, False, "entropy"),
}
DEFAULT_ROWS = [row for row in ROWS if not row.endswith("-entropy")]
QUICK_ROWS = ("dp-fp16", "h10-fp32", "h10-alq3")
_ROW = re.compile(r"(?P<base>[^@]+)(?:@lr(?P<lr>[^@]+))?(?:@m(?P<m>[^@]+))?(?:@n(?P<n>[^@]+))?")


def row_spec(row: str) -> tuple:
    """``(H, method, bits, error feedback, wire, outer lr, outer momentum, noise)`` of a row name
    (the module docstring's grammar); ValueError when it is not a row or out of range."""
    match = _ROW.fullmatch(row)
    base = match["base"] if match else ""
    if base in ROWS:
        spec = ROWS[base]
    else:
        h = re.fullmatch(r"h([1-9][0-9]*)-(.+)", base)
        if not h or f"h50-{h[2]}" not in ROWS:
            raise ValueError(f"unknown row {row!r}")
        spec = (int(h[1]), *ROWS[f"h50-{h[2]}"][1:])
    if spec[0] is None and (match["lr"] or match["m"] or match["n"]):
        raise ValueError(f"row {row!r}: per-step data parallelism has no outer step")
    if match["n"] and spec[1] != "fp32":
        raise ValueError(f"row {row!r}: @n (added noise) is for the fp32 rows only")
    try:
        lr = float(match["lr"]) if match["lr"] else 0.7
        mu = float(match["m"]) if match["m"] else 0.9
        noise = float(match["n"]) if match["n"] else 0.0
    except ValueError:
        raise ValueError(f"row {row!r}: @lr, @m and @n take numbers") from None
    if not (0 < lr < math.inf and 0 <= mu < 1 and 0 <= noise < math.inf):
        raise ValueError(f"row {row!r}: the outer lr must be positive, the momentum in [0, 1), the noise >= 0")
    return (*spec, lr, mu, noise)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="2 workers, 1 seed, 20 steps of a tiny GPT, 3 rows")
    p.add_argument("--rows", default=",".join(DEFAULT_ROWS), help="comma-separated rows (above); default: no -entropy")
    p.add_argument("--seeds", default="0,1,2", help="default 0,1,2")
    p.add_argument("--workers", type=int, default=4, help="default 4")
    p.add_argument("--steps", type=int, default=1000, help="inner steps of every row; default 1000 (20 at H=50)")
    p.add_argument("--batch-size", type=int, default=16, help="sequences per worker and step; default 16")
    p.add_argument("--context", type=int, default=64, help="default 64")
    p.add_argument("--width", type=int, default=128, help="default 128")
    p.add_argument("--layers", type=int, default=4, help="default 4")
    p.add_argument("--heads", type=int, default=4, help="default 4")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW's peak learning rate; default 3e-3")
    p.add_argument("--warmup", type=int, default=30, help="linear warm-up steps; default 30")
    p.add_argument("--weight-decay", type=float, default=0.1, help="default 0.1")
    p.add_argument("--bucket-size", type=int, default=8192, help="default 8192")
    p.add_argument("--eval-every", type=int, default=50, help="a multiple of every row's H; default 50")
    p.add_argument("--eval-windows", type=int, default=256, help="held-out windows per evaluation; default 256")
    p.add_argument("--rate", type=float, default=100.0, help="link rate of the modeled wall-clock, Mbit/s")
    p.add_argument("--out-dir", default="build/results", help="default build/results")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--json", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.rows, args.seeds, args.workers, args.steps = ",".join(QUICK_ROWS), "0", 2, 20
        args.width, args.layers, args.heads, args.context, args.batch_size = 32, 1, 2, 32, 8
        args.eval_every, args.eval_windows, args.warmup = 10, 16, 2
    for row in args.rows.split(","):
        try:
            h = row_spec(row)[0]
        except ValueError as err:
            p.error(f"{err}; the rows are {', '.join(ROWS)}, hH-<kind>, each with @lr<x>, @m<x> (fp32: @n<x>)")
        if h and args.steps % math.lcm(h, args.eval_every):
            p.error(f"--steps {args.steps} must be a multiple of lcm(--eval-every, {row}'s H = {h})")
    return args


# ---------------------------------------------------------------------------------- the workers
class PlainOuter:
    """DiLoCo's outer step (the Nesterov update of horovod_alq.torch.diloco.DiLoCo) in fp32 (exact
    all_reduce) or int8 (per-tensor absmax, allgathered); ``noise``: fp32's seeded Gaussian noise,
    the same on every rank."""

    def __init__(
        self,
        model,
        inner,
        sync_every: int,
        kind: str,
        outer_lr: float,
        outer_momentum: float,
        noise: float = 0.0,
        seed: int = 0,
    ) -> None:
        import torch

        self.params = [p for p in model.parameters() if p.requires_grad]
        self.inner, self.sync_every, self.kind = inner, sync_every, kind
        self.lr, self.mu, self.noise, self.seed = outer_lr, outer_momentum, noise, seed
        self.global_params = [p.detach().float().clone() for p in self.params]
        self.momentum = [torch.zeros_like(g) for g in self.global_params]
        self.steps, self.bytes_sent = 0, 0

    def step(self) -> None:
        import torch
        import torch.distributed as dist

        self.inner.step()
        self.steps += 1
        if self.steps % self.sync_every:
            return
        n = dist.get_world_size()
        with torch.no_grad():
            deltas = [(g - p.detach().float()).reshape(-1) for p, g in zip(self.params, self.global_params)]
            if self.kind == "fp32":
                flat = torch.cat(deltas)
                dist.all_reduce(flat)
                flat /= n
                if self.noise:
                    gen = torch.Generator().manual_seed(1_000_003 * (self.seed + 1) + self.steps // self.sync_every)
                    sigma = self.noise * float(flat.norm()) / math.sqrt(flat.numel())
                    flat += sigma * torch.randn(flat.numel(), generator=gen)
                avg = list(torch.split(flat, [d.numel() for d in deltas]))
                self.bytes_sent += 8 * flat.numel() * (n - 1) // n
            else:  # int8, per-tensor absmax
                scales = torch.stack([d.abs().max().clamp_min(1e-30) for d in deltas])
                codes = torch.cat(
                    [torch.round(d / s * 127).clamp(-127, 127).to(torch.int8) for d, s in zip(deltas, scales)]
                )
                all_codes = torch.empty(n * codes.numel(), dtype=torch.int8)
                all_scales = torch.empty(n * scales.numel())
                dist.all_gather_into_tensor(all_codes, codes)
                dist.all_gather_into_tensor(all_scales, scales)
                total = torch.zeros(codes.numel())
                for r in range(n):
                    s = all_scales[r * scales.numel() : (r + 1) * scales.numel()]
                    per = torch.repeat_interleave(s, torch.tensor([d.numel() for d in deltas]))
                    total += all_codes[r * codes.numel() : (r + 1) * codes.numel()].float() * per / 127
                avg = list(torch.split(total / n, [d.numel() for d in deltas]))
                self.bytes_sent += (n - 1) * (codes.numel() + 4 * len(deltas))
            for p, g, m, a in zip(self.params, self.global_params, self.momentum, avg):
                a = a.view_as(g)
                m.mul_(self.mu).add_(a)
                g.sub_(a.add(m, alpha=self.mu), alpha=self.lr)
                p.copy_(g)


def coded(outer) -> float:
    """DiLoCo's bytes sent: the engine's payload bytes (on the entropy wire the coded frames) plus the
    uncompressed parameters' ring all_reduce."""
    m = outer.metrics()
    return m["bytes_sent"] + m["plain_bytes_sent"]


class OuterProbe:
    """Per outer step of ``outer`` (read only), the L2 norms of the exact average pseudo-gradient,
    the applied one (from the momentum update), their difference, the ranks' own (mean) and the
    update; the inner optimizer's post-hook reads the ranks before the step, :meth:`after` the new
    globals. ``seconds``: its own time, left out of the timed loop."""

    KEYS = ("exact_norm", "applied_norm", "error_norm", "local_norm", "update_norm")

    def __init__(self, outer, inner, sync_every: int, lr: float, mu: float) -> None:
        self.outer, self.sync_every, self.lr, self.mu = outer, sync_every, lr, mu
        self.record = {k: [] for k in self.KEYS}
        self.calls, self.seconds, self.taken = 0, 0.0, None
        inner.register_step_post_hook(self._hook)

    @staticmethod
    def _flat(tensors):
        import torch

        return torch.cat([t.detach().float().reshape(-1) for t in tensors])

    def _hook(self, optimizer, *_) -> None:
        import torch
        import torch.distributed as dist

        self.calls += 1
        if self.calls % self.sync_every:
            return
        start = time.perf_counter()
        g, m = self._flat(self.outer.global_params), self._flat(self.outer.momentum)
        local = g - self._flat(self.outer.params)
        both = torch.cat([local, local.norm().reshape(1)])
        dist.all_reduce(both)
        both /= dist.get_world_size()
        self.taken = (g, m, both[:-1], float(both[-1]))
        self.seconds += time.perf_counter() - start

    def after(self) -> None:
        """Right after the inner step that ended in an outer step (every rank)."""
        start = time.perf_counter()
        g, m, exact, local_norm = self.taken
        g_new = self._flat(self.outer.global_params)
        update = g - g_new
        applied = self._flat(self.outer.momentum) - self.mu * m if self.mu else update / self.lr
        values = (exact.norm(), applied.norm(), (applied - exact).norm(), local_norm, update.norm())
        for key, value in zip(self.KEYS, values):
            self.record[key].append(float(value))
        self.taken = None
        self.seconds += time.perf_counter() - start

    def summary(self) -> dict:
        """``outer_probe``: the per-step lists; ``outer_probe_mean``: their means."""
        means = {k: sum(v) / len(v) if v else float("nan") for k, v in self.record.items()}
        return {"outer_probe": self.record, "outer_probe_mean": means}


def make_outer(model, inner, spec: tuple, args):
    """The row's outer step (``spec``: :func:`row_spec`): None for data parallelism."""
    from horovod_alq.torch.diloco import DiLoCo

    h, kind, bits, ef, wire, outer_lr, outer_momentum, noise = spec
    if kind == "fp16":
        return None
    if kind in ("fp32", "int8"):
        return PlainOuter(model, inner, h, kind, outer_lr, outer_momentum, noise, args.seed)
    return DiLoCo(
        model,
        inner,
        sync_every=h,
        outer_lr=outer_lr,
        outer_momentum=outer_momentum,
        method=kind,
        bits=bits,
        error_feedback=ef,
        bucket_size=args.bucket_size,
        exchange="allgather",
        wire=wire,
        seed=args.seed,
    )


def dp_step(params, n: int) -> int:
    """Per-step data parallelism's exchange: the gradients rounded to fp16, summed, averaged; the
    bytes a ring all_reduce of fp16 sends per worker."""
    import torch
    import torch.distributed as dist

    flat = torch.cat([p.grad.reshape(-1) for p in params]).half().float()
    dist.all_reduce(flat)
    flat /= n
    for p, g in zip(params, torch.split(flat, [p.numel() for p in params])):
        p.grad.copy_(g.view_as(p))
    return 4 * flat.numel() * (n - 1) // n


def run_row(row: str, args, data) -> dict:
    """Train one row on this rank; rank 0's record: the curve [(inner step, bytes sent, seconds, loss)],
    and for the DiLoCo rows the outer step's settings and :class:`OuterProbe`'s measurements."""
    import torch
    import torch.distributed as dist

    from horovod_alq.torch.diloco import DiLoCo
    from scripts.common.gpt import GPT, lr_at, sample_batch
    from scripts.demo.train_gpt import evaluate

    train_ids, val_ids, chars = data
    rank, n = dist.get_rank(), dist.get_world_size()
    spec = row_spec(row)
    h = spec[0]
    torch.manual_seed(args.seed)  # the same initial model on every rank and in every row
    model = GPT(len(chars), args.width, args.layers, args.heads, args.context)
    inner = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay, betas=(0.9, 0.95))
    outer = make_outer(model, inner, spec, args)
    probe = None if outer is None else OuterProbe(outer, inner, h, spec[5], spec[6])
    params = [p for p in model.parameters()]
    generator = torch.Generator().manual_seed(args.seed * 1000 + rank)
    every = math.lcm(args.eval_every, h) if h else args.eval_every
    dp_bytes, seconds, curve = 0, 0.0, []
    for step in range(args.steps):
        start = time.perf_counter()
        for group in inner.param_groups:
            group["lr"] = lr_at(step, args)
        x, y = sample_batch(train_ids, args.batch_size, args.context, generator)
        inner.zero_grad()
        model.loss(x, y).backward()
        if outer is None:
            dp_bytes += dp_step(params, n)
            inner.step()
        else:
            outer.step()
            if (step + 1) % h == 0:
                probe.after()
        seconds += time.perf_counter() - start
        if (step + 1) % every == 0:
            sent = dp_bytes if outer is None else (outer.bytes_sent if isinstance(outer, PlainOuter) else coded(outer))
            loss = evaluate(model, val_ids, args) if rank == 0 else float("nan")
            curve.append([step + 1, int(sent), seconds - (probe.seconds if probe else 0.0), loss])
    out = {"row": row, "curve": curve, "final_loss": curve[-1][3], "bytes": curve[-1][1], "seconds": curve[-1][2]}
    if outer is not None:
        out.update(sync_every=h, outer_lr=spec[5], outer_momentum=spec[6], outer_noise=spec[7], **probe.summary())
    if isinstance(outer, DiLoCo):
        m = outer.metrics()
        out.update(
            bits_per_coordinate=m["bits_per_coordinate"],
            level_updates=m["level_updates"],
            outer_steps=m["outer_steps"],
            levels=[float(v) for v in m["levels"]],
            wire=spec[4],
            wire_fixed_bytes=m["wire_fixed_bytes"],
            wire_coded_bytes=m["wire_coded_bytes"],
        )
    dist.barrier()
    return out


def worker(args) -> int:
    import torch
    import torch.distributed as dist

    from scripts.common.gpt import char_splits

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    data = char_splits()
    results = {}
    for row in args.rows.split(","):
        results[row] = run_row(row, args, data)
        if dist.get_rank() == 0:
            r = results[row]
            print(
                f"seed {args.seed} {row:>16}: held-out loss {r['final_loss']:.4f}, {r['bytes'] / 1e6:.2f} MB sent, "
                f"{r['seconds']:.1f} s",
                flush=True,
            )
    if dist.get_rank() == 0:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(
            json.dumps({"args": vars(args), "workers": dist.get_world_size(), "results": results}, indent=1)
        )
    dist.destroy_process_group()
    return 0


# ---------------------------------------------------------------------------------- the driver
def launch(args, seed: int, path: Path) -> None:
    passed = launching.flags(args, "rows", "steps", "batch_size", "context", "width", "layers", "heads", "lr")
    passed += launching.flags(args, "warmup", "weight_decay", "bucket_size")
    passed += launching.flags(args, "eval_every", "eval_windows")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.workers)]
    cmd += ["-m", "scripts.study.diloco", "--worker", "--seed", str(seed), "--json", str(path), *passed]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    subprocess.run(cmd, cwd=ROOT, env=env, check=True)


def _se(value: float) -> str:
    return "" if math.isnan(value) else f" ± {value:.4f}"


def summarize(runs: dict[int, dict], args) -> str:
    """The Markdown table: per row, the final held-out loss (mean ± s.e. over seeds), its same-seed
    difference to DiLoCo fp32 at H = 50 (or the first row), bytes per worker and the modeled wall-clock."""
    rows = [r for r in args.rows.split(",") if all(r in run["results"] for run in runs.values())]
    base = "h50-fp32" if "h50-fp32" in rows else rows[0]
    seeds = sorted(runs)
    lines = [
        f"Held-out loss of the character GPT after {args.steps} inner steps per worker, {args.workers} "
        f"workers, seeds {', '.join(map(str, seeds))} (mean ± standard error over seeds; difference: same seed, "
        f"against {base}). Wall-clock: this machine's measured loop time plus the bytes at {args.rate:g} Mbit/s.",
        "",
        f"| row | held-out loss (nats/char) | vs {base} | MB sent per worker | bytes vs {base} | "
        f"modeled wall-clock (s) |",
        "|---|---|---|---|---|---|",
    ]
    base_bytes = sum(runs[s]["results"][base]["bytes"] for s in seeds) / len(seeds)
    for row in rows:
        res = [runs[s]["results"][row] for s in seeds]
        loss, loss_se = mean_se([r["final_loss"] for r in res])
        diff, diff_se = mean_se([r["final_loss"] - runs[s]["results"][base]["final_loss"] for s, r in zip(seeds, res)])
        mbytes = sum(r["bytes"] for r in res) / len(res)
        wall, _ = mean_se([r["seconds"] + 8 * r["bytes"] / (args.rate * 1e6) for r in res])
        ratio = mbytes / base_bytes if base_bytes else float("nan")
        lines.append(
            f"| {row} | {loss:.4f}{_se(loss_se)} | {diff:+.4f}{_se(diff_se)} | {mbytes / 1e6:.3f} | "
            f"{ratio:.4f} | {wall:.1f} |"
        )
    return "\n".join(lines) + "\n"


def plot(runs: dict[int, dict], args, path: Path) -> None:
    plt = pages.pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for row in args.rows.split(","):
        curves = [runs[s]["results"][row]["curve"] for s in sorted(runs) if row in runs[s]["results"]]
        if not curves:
            continue
        k = min(len(c) for c in curves)
        mean = [[sum(c[i][j] for c in curves) / len(curves) for j in range(4)] for i in range(k)]
        sent = [max(m[1], 1) / 1e6 for m in mean]
        wall = [m[2] + 8 * m[1] / (args.rate * 1e6) for m in mean]
        loss = [m[3] for m in mean]
        axes[0].plot(sent, loss, marker=".", label=row)
        axes[1].plot(wall, loss, marker=".", label=row)
    axes[0].set(xscale="log", xlabel="MB sent per worker")
    axes[1].set(xlabel=f"modeled wall-clock at {args.rate:g} Mbit/s (s)")
    for ax in axes:
        ax.set_ylabel("held-out loss (nats/char)")
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=7)
    fig.suptitle(f"DiLoCo on the character GPT, {args.workers} workers, {len(runs)} seed(s)")
    pages.save(fig, path)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker(args)
    out = Path(args.out_dir)
    raw = out / "data" / "diloco_study_raw"
    raw.mkdir(parents=True, exist_ok=True)
    runs = {}
    for seed in (int(s) for s in args.seeds.split(",")):
        path = raw / f"seed{seed}.json"
        if not path.exists():
            launch(args, seed, path)
        runs[seed] = json.loads(path.read_text())
    table = summarize(runs, args)
    head = (
        "# DiLoCo study: held-out loss against bytes\n\n"
        f"Generated by `python -m scripts.study.diloco {' '.join(argv if argv is not None else sys.argv[1:])}` on "
        f"{time.strftime('%Y-%m-%d')} (this machine: {os.cpu_count()} cores, no GPU; gloo over loopback); "
        f"{len(runs)} seed(s)"
        f"{'' if len(runs) >= 3 else ': fewer than the 3 the study is meant for'}"
        f"{': no standard error' if len(runs) == 1 else ''}."
        " ![held-out loss against bytes and modeled wall-clock](diloco_study.png)\n\n"
    )
    (out / "diloco_study.md").write_text(head + table)
    (out / "data" / "diloco_study.json").write_text(json.dumps({str(s): r for s, r in runs.items()}, indent=1))
    plot(runs, args, out / "diloco_study.png")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
