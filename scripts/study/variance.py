#!/usr/bin/env python
"""Normalized quantization variance E||Q(g) - g||^2 / ||g||^2 of every method on real gradients,
over the course of training, and the adapted levels against iteration.

One process trains the MNIST CNN of scripts/demo/train.py (plain SGD on the uncompressed gradient, so
every method is judged on the same sequence of gradients) and, every --eval-every iterations,
computes for each method, bit width and bucket size the EXACT variance of unbiased stochastic
rounding of that iteration's full gradient (scripts/study/compare_models.py's formula: per coordinate
n^2 (hi - r)(r - lo); no sampling). Adaptive methods (ALQ, ALQ-N, AMQ, AMQ-N) use
horovod_alq.core.Quantizer: at a refit iteration t the variance of g_t is computed with the old
levels, then q.adapt(q.statistics(g_t)) fits the levels used from t + 1 on (what the Horovod
compressors do: statistics of round t, new levels from round t + 1). Each adaptive method runs with
each bucket norm of --norms, named e.g. alq-l2 (the paper's L2 buckets) and alq-linf (max-abs
buckets). Three schedules:

    paper   refit at iterations 0, 100, 2000 (the paper's schedule, the compressors' default)
    once    refit at iteration 0 only (levels go stale)
    every   refit every --refit-every iterations

    python -m scripts.study.variance --out-dir docs            # 2,500 iterations, 2/3/4 bits, d=512,8192, both norms
    python -m scripts.study.variance --quick --out-dir /tmp/v  # 30 iterations, 3 bits, d=512
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from horovod_alq.core import Quantizer
from scripts.common.cnn import Net, load_digits
from scripts.study.compare_models import normalized_variance

FIXED = ["qsgdinf", "qsgd", "nuqsgd", "terngrad"]
BASES = ["alq", "alq-n", "amq", "amq-n"]
ADAPTIVE = [f"{m}-{norm}" for m in BASES for norm in ("l2", "linf")]  # narrowed by --norms in main()
SCHEDULES = ["paper", "once", "every"]
COLORS = {"alq": "C0", "alq-n": "C9", "amq": "C2", "amq-n": "C8", "qsgdinf": "C1", "qsgd": "C7",
          "nuqsgd": "C3", "terngrad": "C5"}


def split_norm(name: str) -> tuple[str, str | None]:
    """``"alq-linf"`` -> ``("alq", "linf")``; a fixed method -> ``(name, None)``."""
    for norm in ("l2", "linf"):
        if name.endswith(f"-{norm}"):
            return name[: -len(norm) - 1], norm
    return name, None


def _color(name: str) -> str:
    return COLORS[split_norm(name)[0]]


def _style(name: str) -> str:
    return {"l2": "-.", "linf": "-", None: "--"}[split_norm(name)[1]]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iters", type=int, default=2500, help="SGD iterations; default 2500")
    p.add_argument("--eval-every", type=int, default=25, help="measure every this many iterations; default 25")
    p.add_argument("--refit-every", type=int, default=50, help="the 'every' schedule's period; default 50")
    p.add_argument("--paper-steps", default="0,100,2000", help="the 'paper' schedule; default 0,100,2000")
    p.add_argument("--bits", default="2,3,4", help="default 2,3,4 (TernGrad: always its 2-bit ternary)")
    p.add_argument("--buckets", default="512,8192", help="default 512,8192")
    p.add_argument("--norms", default="l2,linf", help="bucket norms of the adaptive methods; default l2,linf")
    p.add_argument("--batch-size", type=int, default=32, help="default 32")
    p.add_argument("--lr", type=float, default=0.05, help="SGD lr, momentum 0.9; default 0.05")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", default="docs", help="variance.md and PNGs go here, variance.json to its data/")
    p.add_argument("--quick", action="store_true", help="30 iterations, 3 bits, bucket 512")
    p.add_argument("--replot", action="store_true", help="only rebuild variance.md and the PNGs from data/variance.json")
    args = p.parse_args(argv)
    if args.quick:
        args.iters, args.eval_every, args.refit_every, args.paper_steps = 30, 10, 10, "0,20"
        args.bits, args.buckets = "3", "512"
    return args


def variance_of(q: Quantizer, g: np.ndarray) -> float:
    return normalized_variance(q.levels, g, q.bucket_size, q.norm)


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out_dir)
    (out / "data").mkdir(parents=True, exist_ok=True)
    bits_list = [int(b) for b in args.bits.split(",")]
    buckets = [int(b) for b in args.buckets.split(",")]
    paper_steps = {int(s) for s in args.paper_steps.split(",") if s.strip()}
    norms = [n.strip() for n in args.norms.split(",") if n.strip()]
    ADAPTIVE[:] = [f"{m}-{norm}" for m in BASES for norm in norms]
    if args.replot:
        data = json.loads((out / "data" / "variance.json").read_text())
        ADAPTIVE[:] = [f"{m}-{norm}" for m in BASES for norm in data["args"].get("norms", "l2").split(",")]
        bits_list = [int(b) for b in data["args"]["bits"].split(",")]
        buckets = [int(b) for b in data["args"]["buckets"].split(",")]
        return write_outputs(data, bits_list, buckets, out, data.get("argv"))

    def refit_now(schedule: str, t: int) -> bool:
        return {"paper": t in paper_steps, "once": t == 0, "every": t % args.refit_every == 0}[schedule]

    # (method, bits, bucket, schedule) -> Quantizer; fixed methods use schedule "-"
    quantizers: dict[tuple, Quantizer] = {}
    for b in bits_list:
        for d in buckets:
            for m in FIXED:
                quantizers[(m, b, d, "-")] = Quantizer(m, bits=2 if m == "terngrad" else b, bucket_size=d)
            for m in ADAPTIVE:
                base, norm = split_norm(m)
                for s in SCHEDULES:
                    quantizers[(m, b, d, s)] = Quantizer(base, bits=b, bucket_size=d, norm=norm)

    torch.manual_seed(args.seed)
    train_x, train_y, _, _ = load_digits(args.seed)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    gen = torch.Generator().manual_seed(args.seed)
    iters, losses, gnorms = [], [], []
    var: dict[str, list] = {"|".join(map(str, k)): [] for k in quantizers}
    levels: dict[str, list] = {"|".join(map(str, k)): [] for k in quantizers if k[0] in ADAPTIVE}
    adapt_seconds, adapt_calls = 0.0, 0
    start = time.monotonic()
    for t in range(args.iters + 1):
        idx = torch.randint(0, len(train_x), (args.batch_size,), generator=gen)
        opt.zero_grad()
        loss = F.cross_entropy(model(train_x[idx]), train_y[idx])
        loss.backward()
        g = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).double().numpy()
        if t % args.eval_every == 0:
            iters.append(t)
            losses.append(loss.item())
            gnorms.append(float(np.linalg.norm(g)))
            for k, q in quantizers.items():
                key = "|".join(map(str, k))
                var[key].append(variance_of(q, g))
                if key in levels:
                    levels[key].append(q.levels.tolist())
        for k, q in quantizers.items():
            if k[0] in ADAPTIVE and refit_now(k[3], t):
                a = time.perf_counter()
                q.adapt(q.statistics(g))
                adapt_seconds += time.perf_counter() - a
                adapt_calls += 1
        opt.step()
        if t % 500 == 0:
            print(f"iteration {t}/{args.iters}, loss {loss.item():.3f}, {time.monotonic() - start:.0f} s", flush=True)
    wall = time.monotonic() - start

    data = {"args": vars(args), "iterations": iters, "loss": losses, "grad_norm": gnorms,
            "variance": var, "levels": levels, "wall_seconds": wall,
            "statistics_plus_adapt_ms_mean": 1e3 * adapt_seconds / max(1, adapt_calls),
            "argv": argv if argv is not None else sys.argv[1:]}
    (out / "data" / "variance.json").write_text(json.dumps(data))
    return write_outputs(data, bits_list, buckets, out, data["argv"])


def write_outputs(data, bits_list, buckets, out, argv) -> int:
    text = report(data, bits_list, buckets, argv)
    (out / "variance.md").write_text(text)
    print(text)
    plot_variance(data, bits_list, buckets, out / "variance_vs_iter.png")
    plot_staleness(data, bits_list, buckets, out / "variance_staleness.png")
    plot_levels(data, bits_list, buckets, out / "levels_vs_iter.png")
    return 0


def _key(m, b, d, s):
    return f"{m}|{b}|{d}|{s}"


def _label(m, s):
    return m if s in ("-", "paper") else f"{m} ({s})"


def report(data: dict, bits_list, buckets, argv) -> str:
    it = np.array(data["iterations"])
    n = len(it)
    early = (it > 0) & (it <= max(1, it[-1]) * 0.1)
    early |= (it > 0) & ~early.any()  # tiny runs: the first measurement after iteration 0
    after0 = it > 0
    late = it >= it[-1] * 0.5
    first = it == 0
    lines = [f"Command: `python -m scripts.study.variance {' '.join(argv or [])}` "
             f"({data['wall_seconds']:.0f} s; {n} measurements, iterations 0..{it[-1]}).", "",
             "Exact normalized variance E||Q(g)-g||^2/||g||^2 of the full CNN gradient; mean over the "
             "measurements in iterations (0, 10%] (early), over all iterations > 0 (all), and over the second "
             "half (late); iteration 0 (it0) is shown apart and left out of the three means: the adaptive "
             "methods still have their initial levels there (fitted to Gaussian gradients; the product refits "
             "from iteration 0's statistics, used from iteration 1 on). Adaptive methods: -l2 normalizes "
             "buckets by their L2 norm (the paper's form), -linf by their max-abs; on the paper schedule "
             "unless a schedule is named. TernGrad is always its 2-bit ternary code. Lower is better.", ""]
    for b in bits_list:
        cols = [f"d={d} {w}" for d in buckets for w in ("it0", "early", "all", "late")]
        lines += [f"**{b} bits**", "", "| method | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
        rows = [(m, "-") for m in FIXED] + [(m, s) for m in ADAPTIVE for s in SCHEDULES]
        best = {}
        for d in buckets:
            means = {(m, s): np.mean(np.array(data["variance"][_key(m, b, d, s)])[after0]) for m, s in rows}
            best[d] = min(means, key=means.get)
        for m, s in rows:
            cells = []
            for d in buckets:
                v = np.array(data["variance"][_key(m, b, d, s)])
                for mask in (first, early, after0, late):
                    cells.append(f"{v[mask].mean():.3g}" if mask.any() else "-")
            mark = " (lowest)" if any(best[d] == (m, s) for d in buckets) else ""
            lines.append(f"| {_label(m, s)}{mark} | " + " | ".join(cells) + " |")
        lines.append("")
    lines.append(f"Statistics + refit, mean per call: {data['statistics_plus_adapt_ms_mean']:.1f} ms "
                 "(NumPy reference, 80k-coordinate gradient, shared CPU).")
    return "\n".join(lines) + "\n"


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_variance(data, bits_list, buckets, path):
    plt = _plt()
    it = data["iterations"]
    fig, axes = plt.subplots(len(buckets), len(bits_list), figsize=(4.6 * len(bits_list), 3.6 * len(buckets)),
                             squeeze=False, sharex=True)
    for i, d in enumerate(buckets):
        for j, b in enumerate(bits_list):
            ax = axes[i][j]
            for m in FIXED + ADAPTIVE:
                s = "-" if m in FIXED else "paper"
                ax.plot(it, data["variance"][_key(m, b, d, s)], color=_color(m), label=m,
                        lw=1.6 if m in ADAPTIVE else 1.0, ls=_style(m))
            ax.set_yscale("log")
            ax.set_title(f"{b} bits, bucket {d}")
            ax.grid(alpha=0.3, which="both")
            if i == len(buckets) - 1:
                ax.set_xlabel("iteration")
            if j == 0:
                ax.set_ylabel("normalized variance")
    axes[0][0].legend(fontsize=6, ncol=2)
    fig.suptitle("Exact normalized variance on MNIST-CNN gradients (adaptive: refit at 0, 100, 2000; "
                 "-l2: L2 buckets, -linf: max-abs buckets; TernGrad: 2-bit)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _main_variants():
    return [m for m in ADAPTIVE if split_norm(m)[0] in ("alq", "amq")]


def plot_staleness(data, bits_list, buckets, path):
    plt = _plt()
    it = data["iterations"]
    b = 3 if 3 in bits_list else bits_list[0]
    variants = _main_variants()
    fig, axes = plt.subplots(1, len(buckets), figsize=(6 * len(buckets), 4.2), squeeze=False)
    styles = {"every": "-", "paper": "--", "once": ":"}
    for i, d in enumerate(buckets):
        ax = axes[0][i]
        for k, m in enumerate(variants):
            for s in SCHEDULES:
                ax.plot(it, data["variance"][_key(m, b, d, s)], color=f"C{k}", ls=styles[s], label=f"{m}, refit {s}")
        ax.plot(it, data["variance"][_key("qsgdinf", b, d, "-")], color="gray", lw=0.8, label="qsgdinf (fixed)")
        ax.set_yscale("log")
        ax.set_title(f"{b} bits, bucket {d}: schedules")
        ax.set_xlabel("iteration")
        ax.set_ylabel("normalized variance")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_levels(data, bits_list, buckets, path):
    plt = _plt()
    it = data["iterations"]
    b = 3 if 3 in bits_list else bits_list[0]
    variants = _main_variants()
    fig, axes = plt.subplots(len(buckets), len(variants), figsize=(4.2 * len(variants), 3.4 * len(buckets)),
                             squeeze=False)
    for i, d in enumerate(buckets):
        for j, m in enumerate(variants):
            ax = axes[i][j]
            for s, ls in (("every", "-"), ("paper", "--")):
                lv = np.array(data["levels"][_key(m, b, d, s)])
                inner = lv[:, 1:-1]  # interior levels (-1 and 1 are fixed)
                for c in range(inner.shape[1]):
                    ax.plot(it, inner[:, c], color=f"C{c}", ls=ls, lw=1.0, label=f"refit {s}" if c == 0 else None)
            ax.set_yscale("symlog", linthresh=1e-2)
            ax.set_title(f"{m} {b} bits, bucket {d}")
            ax.set_xlabel("iteration")
            ax.set_ylabel("interior levels (symlog)")
            ax.grid(alpha=0.3, which="both")
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
