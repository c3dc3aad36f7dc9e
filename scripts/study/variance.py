#!/usr/bin/env python
"""Exact normalized quantization variance E||Q(g) - g||^2 / ||g||^2 of every method on real
gradients over training (scripts/common/auto_bits.py's formula), and the adapted levels; one
process trains on the uncompressed gradient, adaptive methods refit as the compressors do.
``--model cnn`` (default), ``--auto`` (bits="auto" against uniform 3 bits) and ``--model gpt``
(per layer type, bits per tensor under --budgets): docs/results/variance_training.md.

    python -m scripts.study.variance  # 2,500 iterations, 2/3/4 bits, d=512,8192, both norms: build/results
    python -m scripts.study.variance --quick --out-dir /tmp/v  # 30 iterations, 3 bits, d=512
    python -m scripts.study.variance --model gpt --quick --out-dir /tmp/v  # 20 iterations, 3 bits
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

from horovod_alq.core import Quantizer
from horovod_alq.core.allocation import allocate_bits
from horovod_alq.core.auto_bits import AUTO_WIDTHS, AutoBits
from scripts.common import report as pages
from scripts.common.auto_bits import (
    auto_error,
    auto_refit,
    best_allocation,
    bucket_auto_error,
    bucket_error_matrix,
    error_matrix,
    exact_error,
    normalized_variance,
    quantized_tensors,
    refit_from,
)
from scripts.common.cnn import sgd_gradients
from scripts.common.demo import split_norm
from scripts.common.gpt import GPT, char_splits, lr_at, sample_batch

FIXED = ["qsgdinf", "qsgd", "nuqsgd", "terngrad"]
BASES = ["alq", "alq-n", "amq", "amq-n"]
NORMS = ("l2", "linf")  # the adaptive methods' bucket norms
ADAPTIVE = [f"{m}-{norm}" for m in BASES for norm in NORMS]
SCHEDULES = ["paper", "once", "every"]
AUTO_METHODS = ["alq", "amq"]  # --auto: bits="auto" of these, each with both norms
COLORS = {
    "alq": "C0",
    "alq-n": "C9",
    "amq": "C2",
    "amq-n": "C8",
    "qsgdinf": "C1",
    "qsgd": "C7",
    "nuqsgd": "C3",
    "terngrad": "C5",
}


def _color(name: str) -> str:
    return COLORS[split_norm(name)[0]]


def _style(name: str) -> str:
    return {"l2": "-.", "linf": "-", None: "--"}[split_norm(name)[1]]


#: Per model, the defaults of the options left at None, then what --quick sets.
DEFAULTS = {
    "cnn": dict(iters=2500, batch_size=32, lr=0.05, budgets="3.0,2.5"),
    "gpt": dict(iters=300, batch_size=8, lr=3e-3, budgets="2.5,3"),
}
QUICK = {
    "cnn": dict(iters=30, eval_every=10, refit_every=10, paper_steps="0,20", bits="3", buckets="512"),
    "gpt": dict(iters=20, eval_every=20, bits="3", refit_steps="0,10", budgets="3"),
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = p.add_argument
    add("--model", choices=("cnn", "gpt"), default="cnn", help="the demo CNN (SGD) or the GPT (AdamW); default cnn")
    add("--iters", type=int, help="training iterations; default 2500 (gpt: 300)")
    add("--eval-every", type=int, default=25, help="measure every this many iterations; default 25")
    add("--bits", default="2,3,4", help="default 2,3,4 (TernGrad: always its 2-bit ternary)")
    add("--batch-size", type=int, help="one worker's batch; default 32 (gpt: 8)")
    add("--lr", type=float, help="SGD lr, momentum 0.9 (gpt: AdamW's peak, train_gpt.py's); default 0.05 (gpt: 3e-3)")
    add("--budgets", help="--auto, gpt: mean bits per coordinate of the allocations; default 3.0,2.5 (gpt: 2.5,3)")
    add("--min-size", type=int, default=1024, help="--auto, gpt: smaller tensors are not quantized; default 1024")
    add("--seed", type=int, default=0)
    add("--out-dir", default="build/results", help="the pages and PNGs; the JSON in its data/; default build/results")
    add("--quick", action="store_true", help="cnn: 30 iterations, 3 bits, bucket 512; gpt: 20 iterations, 3 bits")
    add("--refit-every", type=int, default=50, help="cnn: the 'every' schedule's period; default 50")
    add("--paper-steps", default="0,100,2000", help="cnn: the 'paper' schedule; default 0,100,2000")
    add("--buckets", default="512,8192", help="cnn: default 512,8192")
    add("--auto", action="store_true", help="cnn: bits='auto' (--budgets) against uniform 3 bits")
    add("--replot", action="store_true", help="cnn: only rebuild the page and PNGs from data/variance*.json")
    add("--bucket-size", type=int, default=8192, help="gpt: default 8192")
    add("--refit-steps", default="0,100,2000", help="gpt: the compressors' schedule; default 0,100,2000")
    args = p.parse_args(argv)
    unset = {k: v for k, v in DEFAULTS[args.model].items() if getattr(args, k) is None}
    vars(args).update(unset, **(QUICK[args.model] if args.quick else {}))
    return args


def variance_of(q: Quantizer, g: np.ndarray) -> float:
    return normalized_variance(q.levels, g, q.bucket_size, q.norm)


def gradients(args):
    """The gradients of --model: :func:`cnn_gradients` or :func:`gpt_gradients`."""
    return gpt_gradients(args) if args.model == "gpt" else cnn_gradients(args)


def cnn_gradients(args):
    """:func:`scripts.common.cnn.sgd_gradients` of the demo CNN, as float64 arrays."""
    for t, loss, grads in sgd_gradients(args.seed, args.iters, args.lr, args.batch_size):
        yield t, loss, [(n, g.double().numpy()) for n, g in grads]


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out_dir)
    (out / "data").mkdir(parents=True, exist_ok=True)
    if args.model == "gpt":
        return gpt_main(args, out, argv if argv is not None else sys.argv[1:])
    bits_list = [int(b) for b in args.bits.split(",")]
    buckets = [int(b) for b in args.buckets.split(",")]
    paper_steps = {int(s) for s in args.paper_steps.split(",") if s.strip()}
    if args.auto:
        if args.replot:
            return write_auto_outputs(json.loads((out / "data" / "variance_auto.json").read_text()), out)
        return run_auto(args, buckets, paper_steps, out, argv if argv is not None else sys.argv[1:])
    if args.replot:
        data = json.loads((out / "data" / "variance.json").read_text())
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

    iters, losses, gnorms = [], [], []
    var: dict[str, list] = {"|".join(map(str, k)): [] for k in quantizers}
    levels: dict[str, list] = {"|".join(map(str, k)): [] for k in quantizers if k[0] in ADAPTIVE}
    adapt_seconds, adapt_calls = 0.0, 0
    start = time.monotonic()
    for t, loss, grads in gradients(args):
        g = np.concatenate([x for _, x in grads])
        if t % args.eval_every == 0:
            iters.append(t)
            losses.append(loss)
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
        if t % 500 == 0:
            print(f"iteration {t}/{args.iters}, loss {loss:.3f}, {time.monotonic() - start:.0f} s", flush=True)
    wall = time.monotonic() - start

    data = {
        "args": vars(args),
        "iterations": iters,
        "loss": losses,
        "grad_norm": gnorms,
        "variance": var,
        "levels": levels,
        "wall_seconds": wall,
        "statistics_plus_adapt_ms_mean": 1e3 * adapt_seconds / max(1, adapt_calls),
        "argv": argv if argv is not None else sys.argv[1:],
    }
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
    lines = [
        f"Command: `python -m scripts.study.variance {' '.join(argv or [])}` "
        f"({data['wall_seconds']:.0f} s; {n} measurements, iterations 0..{it[-1]}).",
        "",
        "Exact normalized variance of the full CNN gradient: iteration 0 (it0), then the mean over "
        "iterations (0, 10%] (early), > 0 (all) and the second half (late); lower is better. Columns and "
        "method: docs/results/variance_training.md#variance.",
        "",
    ]
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
    lines.append(
        f"Statistics + refit, mean per call: {data['statistics_plus_adapt_ms_mean']:.1f} ms "
        "(NumPy reference, 80k-coordinate gradient, shared CPU)."
    )
    return "\n".join(lines) + "\n"


def _panels(nrows: int, ncols: int, width: float, height: float, **kw):
    """A figure of nrows x ncols axes (always 2-D), each ``width`` x ``height`` inches."""
    return pages.pyplot().subplots(nrows, ncols, figsize=(width * ncols, height * nrows), squeeze=False, **kw)


def _label_edges(axes, ylabel: str) -> None:
    """ "iteration" under the bottom row, ``ylabel`` beside the first column."""
    for ax in axes[-1]:
        ax.set_xlabel("iteration")
    for ax in axes[:, 0]:
        ax.set_ylabel(ylabel)


def plot_variance(data, bits_list, buckets, path):
    it = data["iterations"]
    fig, axes = _panels(len(buckets), len(bits_list), 4.6, 3.6, sharex=True)
    for i, d in enumerate(buckets):
        for j, b in enumerate(bits_list):
            ax = axes[i][j]
            for m in FIXED + ADAPTIVE:
                s, width = ("-", 1.0) if m in FIXED else ("paper", 1.6)
                ax.plot(it, data["variance"][_key(m, b, d, s)], color=_color(m), label=m, lw=width, ls=_style(m))
            ax.set(yscale="log", title=f"{b} bits, bucket {d}")
            ax.grid(alpha=0.3, which="both")
    _label_edges(axes, "normalized variance")
    axes[0][0].legend(fontsize=6, ncol=2)
    fig.suptitle(
        "Exact normalized variance on MNIST-CNN gradients (adaptive: refit at 0, 100, 2000; "
        "-l2: L2 buckets, -linf: max-abs buckets; TernGrad: 2-bit)"
    )
    pages.save(fig, path, dpi=100)


def _main_variants():
    return [m for m in ADAPTIVE if split_norm(m)[0] in ("alq", "amq")]


def plot_staleness(data, bits_list, buckets, path):
    it = data["iterations"]
    b = 3 if 3 in bits_list else bits_list[0]
    variants = _main_variants()
    fig, axes = _panels(1, len(buckets), 6, 4.2)
    styles = {"every": "-", "paper": "--", "once": ":"}
    for i, d in enumerate(buckets):
        ax = axes[0][i]
        for k, m in enumerate(variants):
            for s in SCHEDULES:
                ax.plot(it, data["variance"][_key(m, b, d, s)], color=f"C{k}", ls=styles[s], label=f"{m}, refit {s}")
        ax.plot(it, data["variance"][_key("qsgdinf", b, d, "-")], color="gray", lw=0.8, label="qsgdinf (fixed)")
        ax.set(yscale="log", title=f"{b} bits, bucket {d}: schedules", xlabel="iteration", ylabel="normalized variance")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=6, ncol=2)
    pages.save(fig, path, dpi=100)


def plot_levels(data, bits_list, buckets, path):
    it = data["iterations"]
    b = 3 if 3 in bits_list else bits_list[0]
    variants = _main_variants()
    fig, axes = _panels(len(buckets), len(variants), 4.2, 3.4)
    for i, d in enumerate(buckets):
        for j, m in enumerate(variants):
            ax = axes[i][j]
            for s, ls in (("every", "-"), ("paper", "--")):
                lv = np.array(data["levels"][_key(m, b, d, s)])
                inner = lv[:, 1:-1]  # interior levels (-1 and 1 are fixed)
                for c in range(inner.shape[1]):
                    ax.plot(it, inner[:, c], color=f"C{c}", ls=ls, lw=1.0, label=f"refit {s}" if c == 0 else None)
            ax.set_yscale("symlog", linthresh=1e-2)
            ax.set(title=f"{m} {b} bits, bucket {d}", xlabel="iteration", ylabel="interior levels (symlog)")
            ax.grid(alpha=0.3, which="both")
            ax.legend(fontsize=7)
    pages.save(fig, path, dpi=100)


# ---------------------------------------------------------------------------------------------
# --auto: the compressors' bits="auto" against uniform 3 bits


def run_auto(args, buckets, paper_steps, out: Path, argv: list) -> int:
    """Train, measure every --eval-every iterations, refit on the paper schedule; besides the
    compressors' AutoBits, every width's levels and the best allocation per budget (exhaustive
    search: a bound on any allocation of widths per tensor)."""
    budgets = [float(b) for b in args.budgets.split(",") if b.strip()]
    labels = [f"{m}-{norm}" for m in AUTO_METHODS for norm in NORMS]
    widths = {
        (label, d): [
            Quantizer(split_norm(label)[0], bits=w, bucket_size=d, norm=split_norm(label)[1]) for w in AUTO_WIDTHS
        ]
        for label in labels
        for d in buckets
    }
    autos = {
        (label, d, b): AutoBits(split_norm(label)[0], b, d, split_norm(label)[1])
        for label in labels
        for d in buckets
        for b in budgets
    }
    per_bucket_autos = {
        (label, d, b): AutoBits(split_norm(label)[0], b, d, split_norm(label)[1], bits_per="bucket")
        for label in labels
        for d in buckets
        for b in budgets
    }
    estimators = (widths, autos, per_bucket_autos, budgets)
    record: dict = {"iterations": [], "loss": [], "float32_share": [], "variance": {}, "bits": {}}
    bucket_widths: dict = {}  # (label, d, budget) -> width index per bucket, fitted at the last refit
    refit_seconds, start = 0.0, time.monotonic()
    for t, loss, grads in gradients(args):
        quantized, sizes, keys = quantized_tensors(grads, args.min_size)
        if t % args.eval_every == 0:
            measure_auto(record, t, loss, grads, (quantized, sizes, keys), estimators, bucket_widths)
        if t in paper_steps:
            a = time.perf_counter()
            refit_auto(estimators, (quantized, sizes, keys), bucket_widths)
            refit_seconds += time.perf_counter() - a
        if t % 500 == 0:
            print(f"iteration {t}/{args.iters}, loss {loss:.3f}, {time.monotonic() - start:.0f} s", flush=True)
    record.update(
        args=vars(args),
        labels=labels,
        buckets=buckets,
        budgets=budgets,
        refits=sorted(paper_steps),
        wall_seconds=time.monotonic() - start,
        refit_seconds=refit_seconds,
        quantized_parameters=[n for n, _ in quantized],
        quantized_sizes=sizes,
        parameters=[(n, g.size) for n, g in grads],
        argv=argv,
    )
    (out / "data" / "variance_auto.json").write_text(json.dumps(record))
    return write_auto_outputs(record, out)


def measure_auto(record: dict, t: int, loss: float, grads, tensors: tuple, estimators: tuple, bucket_widths: dict):
    """One measurement of :func:`run_auto`: every width's uniform and best allocations (per tensor
    and per bucket, and the per-bucket widths of the last refit), and the compressors' AutoBits."""
    quantized, sizes, keys = tensors
    widths, autos, per_bucket_autos, budgets = estimators
    total = sum(float((g**2).sum()) for _, g in grads)
    record["iterations"].append(t)
    record["loss"].append(loss)
    record["float32_share"].append(1.0 - sum(float((g**2).sum()) for _, g in quantized) / total)
    for (label, d), qs in widths.items():
        per_bucket, bucket_sizes, firsts = bucket_error_matrix(qs, quantized)
        e = np.add.reduceat(per_bucket, firsts, axis=0)  # per tensor (error_matrix, from the buckets)
        uniform = e[:, AUTO_WIDTHS.index(3)].sum() / total
        record["variance"].setdefault(f"{label}|{d}|uniform3", []).append(uniform)
        for b in budgets:
            best = best_allocation(e, sizes, b, AUTO_WIDTHS)
            if best is not None:
                record["variance"].setdefault(f"{label}|{d}|{b}|best", []).append(best[0] / total)
                record["bits"].setdefault(f"{label}|{d}|{b}|best", []).append(best[1])
            finer = allocate_bits(per_bucket, bucket_sizes, b, AUTO_WIDTHS)  # exact (gap 0) here
            record["variance"].setdefault(f"{label}|{d}|{b}|best_bucket", []).append(finer.error / total)
            record["bits"].setdefault(f"{label}|{d}|{b}|best_bucket_mean", []).append(finer.mean_bits)
            record.setdefault("bucket_gaps", []).append(finer.gap)
            kept = bucket_widths.get((label, d, b))  # the widths per bucket of the last refit
            stale = np.nan if kept is None else per_bucket[np.arange(len(kept)), kept].sum() / total
            record["variance"].setdefault(f"{label}|{d}|{b}|bucket_stale", []).append(stale)
    for (label, d, b), auto in autos.items():
        err, bits = auto_error(auto, quantized, keys)
        record["variance"].setdefault(f"{label}|{d}|{b}", []).append(err / total)
        record["bits"].setdefault(f"{label}|{d}|{b}", []).append(bits)
    for (label, d, b), auto in per_bucket_autos.items():
        err, mean_bits = bucket_auto_error(auto, quantized)
        record["variance"].setdefault(f"{label}|{d}|{b}|bucket_auto", []).append(err / total)
        record["bits"].setdefault(f"{label}|{d}|{b}|bucket_auto_mean", []).append(mean_bits)


def refit_auto(estimators: tuple, tensors: tuple, bucket_widths: dict) -> None:
    """A refit of :func:`run_auto`: every width's levels, the widths per bucket kept until the next
    refit, and the AutoBits."""
    quantized, sizes, keys = tensors
    widths, autos, per_bucket_autos, budgets = estimators
    for (label, d), qs in widths.items():
        for q in qs:
            refit_from(q, quantized)
        per_bucket, bucket_sizes, _ = bucket_error_matrix(qs, quantized)
        for b in budgets:  # widths per bucket from this gradient, kept until the next refit
            bits = allocate_bits(per_bucket, bucket_sizes, b, AUTO_WIDTHS).bits
            bucket_widths[label, d, b] = np.searchsorted(AUTO_WIDTHS, bits)
    for auto in (*autos.values(), *per_bucket_autos.values()):
        auto_refit(auto, quantized, sizes, keys)


def write_auto_outputs(record: dict, out: Path) -> int:
    text = auto_report(record)
    (out / "variance_auto.md").write_text(text)
    print(text)
    plot_auto(record, out / "variance_auto.png")
    plot_auto_bits(record, out / "variance_auto_bits.png")
    return 0


def auto_phases(record: dict) -> list[tuple[int, int]]:
    """The intervals (lo, hi] of measured iterations that use one refit's allocation."""
    ends = [r for r in record["refits"] if 0 < r < record["iterations"][-1]] + [record["iterations"][-1]]
    return list(zip([0] + ends[:-1], ends))


def auto_report(record: dict) -> str:
    it = np.array(record["iterations"])
    budgets, phases = record["budgets"], auto_phases(record)
    v = {k: np.array(x) for k, x in record["variance"].items()}
    checkpoints = sorted({int(it[i]) for i in np.linspace(1, len(it) - 1, 5).round().astype(int)})
    names = ", ".join(f"{n} ({s})" for n, s in zip(record["quantized_parameters"], record["quantized_sizes"]))
    float32 = [f"{n} ({s})" for n, s in record["parameters"] if n not in record["quantized_parameters"]]
    lines = [
        f"Command: `python -m scripts.study.variance {' '.join(record['argv'] or [])}` "
        f"({record['wall_seconds']:.0f} s, of which refits {record['refit_seconds']:.0f} s; {len(it)} "
        f"measurements, iterations 0..{it[-1]}).",
        "",
        'The compressors\' `bits="auto"` against uniform 3 bits of the same method and norm, refitted at '
        f"iterations {', '.join(map(str, record['refits']))}; total normalized variance of the quantized "
        f"tensors over the whole ||g||^2. Float32 (below {record['args']['min_size']} elements): "
        f"{', '.join(float32)}, {100 * np.mean(record['float32_share']):.1f}% of ||g||^2 on average. "
        f"Quantized tensors: {names}. The estimators (best, per bucket, kept, bits_per=bucket) and issue "
        "23's targets: docs/results/variance_training.md#variance_auto.",
        "",
        "**Mean over the measurements after iteration 0** (ratio of the means to uniform 3 bits; widths in the "
        "order of the quantized tensors):",
        "",
    ]
    lines += auto_means_table(record, v, it > 0) + [""]
    lines += [
        "**Ratio to uniform 3 bits between refits** (ratio of the means over each interval of iterations, "
        "each using one refit's allocation and levels) **and at single iterations**:",
        "",
    ]
    head = ["method, bucket, budget"] + [f"({lo}, {hi}]" for lo, hi in phases] + [f"it {c}" for c in checkpoints]
    cells = []
    for label in record["labels"]:
        for d in record["buckets"]:
            u = v[f"{label}|{d}|uniform3"]
            for b in budgets:
                a = v[f"{label}|{d}|{b}"]
                row = [f"{label}, {d}, {b}"]
                row += [
                    f"{a[(it > lo) & (it <= hi)].mean() / u[(it > lo) & (it <= hi)].mean():.2f}" for lo, hi in phases
                ]
                cells.append(row + [f"{a[it == c][0] / u[it == c][0]:.2f}" for c in checkpoints])
    lines += pages.table(head, cells, "-" + "r" * len(head)) + [""]
    target = {3.0: 0.7, 2.5: 1.0}
    kinds = (("", "bits='auto'", "target at most {t}x"), ("|best_bucket", "Widths per bucket", "the target"))
    kinds += (
        ("|bucket_stale", "Widths per bucket, kept", "the target"),
        ("|bucket_auto", "bits_per='bucket'", "the target"),
    )
    for kind, name, what in kinds:
        for b in budgets:
            r = [
                v[f"{label}|{d}|{b}{kind}"][it > 0].mean() / v[f"{label}|{d}|uniform3"][it > 0].mean()
                for label in record["labels"]
                for d in record["buckets"]
                if f"{label}|{d}|{b}{kind}" in v
            ]
            if r:
                met = f"; {what.format(t=target.get(b))} met in {sum(x <= target[b] for x in r)} of {len(r)} rows."
                lines.append(
                    f"{name} at budget {b}: ratio {min(r):.2f} to {max(r):.2f}" + (met if b in target else ".")
                )
    return "\n".join(lines) + "\n"


def auto_means_table(record: dict, v: dict, after0) -> list[str]:
    """Per method and bucket, the mean over the measurements after iteration 0 of every estimator at
    every budget, its ratio to uniform 3 bits, and auto's widths at the last refit."""
    budgets = record["budgets"]
    head = ["method, bucket", "uniform 3 bits"]
    for b in budgets:
        head += [f"auto {b}", "ratio", f"best {b}", "ratio", f"per bucket {b}", "ratio"]
        head += [f"per bucket, kept {b}", "ratio", f"bits_per=bucket {b}", "ratio"]
    head.append("auto's widths at the last refit (" + " / ".join(map(str, budgets)) + ")")
    cells = []
    for label in record["labels"]:
        for d in record["buckets"]:
            u = v[f"{label}|{d}|uniform3"][after0].mean()
            row = [f"{label}, {d}", f"{u:.3g}"]
            for b in budgets:
                for kind in ("", "|best", "|best_bucket", "|bucket_stale", "|bucket_auto"):
                    key = f"{label}|{d}|{b}{kind}"
                    a = v[key][after0].mean() if key in v else np.nan
                    row += [f"{a:.3g}", f"{a / u:.2f}"]
            cells.append(
                row + [" / ".join(" ".join(map(str, record["bits"][f"{label}|{d}|{b}"][-1])) for b in budgets)]
            )
    return pages.table(head, cells, "-" + "r" * (len(head) - 2) + "-")


def plot_auto(record: dict, path: Path) -> None:
    """Total normalized variance against iteration: uniform 3 bits and bits='auto' at each budget."""
    it = record["iterations"]
    labels, buckets = record["labels"], record["buckets"]
    fig, axes = _panels(len(buckets), len(labels), 4.2, 3.3, sharex=True)
    for i, d in enumerate(buckets):
        for j, label in enumerate(labels):
            ax = axes[i][j]
            ax.plot(it, record["variance"][f"{label}|{d}|uniform3"], color="gray", label="uniform 3 bits")
            for k, b in enumerate(record["budgets"]):
                ax.plot(it, record["variance"][f"{label}|{d}|{b}"], color=f"C{k}", lw=1.2, label=f"auto, budget {b}")
                best = record["variance"].get(f"{label}|{d}|{b}|best")
                if best is not None:
                    ax.plot(it, best, color=f"C{k}", lw=0.8, ls="--", label=f"best allocation, budget {b}")
            for r in record["refits"][1:]:
                ax.axvline(r, color="k", ls=":", lw=0.8)
            ax.set_yscale("log")
            ax.set_title(f"{label}, bucket {d}", fontsize=10)
            ax.grid(alpha=0.3, which="both")
    _label_edges(axes, "total normalized variance")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(
        "bits='auto' against uniform 3 bits on MNIST-CNN gradients (refits at "
        + ", ".join(map(str, record["refits"]))
        + "; dashed: the best allocation, exhaustive search)"
    )
    pages.save(fig, path, dpi=100)


def plot_auto_bits(record: dict, path: Path) -> None:
    """Width of every quantized tensor against iteration, per method, bucket and budget."""
    it = record["iterations"]
    labels = record["labels"]
    cols = [(d, b) for d in record["buckets"] for b in record["budgets"]]
    names = record["quantized_parameters"]
    fig, axes = _panels(len(labels), len(cols), 3.6, 2.4, sharex=True, sharey=True)
    for i, label in enumerate(labels):
        for j, (d, b) in enumerate(cols):
            ax = axes[i][j]
            bits = np.array(record["bits"][f"{label}|{d}|{b}"])
            for k, n in enumerate(names):  # offset so that equal widths stay visible
                shift = 0.12 * (k - (len(names) - 1) / 2)
                ax.step(it, bits[:, k] + shift, where="post", color=f"C{k}", label=n.replace(".weight", ""))
            ax.set_title(f"{label}, bucket {d}, budget {b}", fontsize=9)
            ax.set_ylim(1.5, 8.5)
            ax.grid(alpha=0.3)
    _label_edges(axes, "bits")
    axes[0][0].legend(fontsize=7)
    fig.suptitle("bits='auto': width of each quantized tensor against iteration (lines offset by 0.12)")
    pages.save(fig, path, dpi=100)


# ---------------------------------------------------------------------------------------------
# --model gpt: the GPT's gradients, per layer type

# (label, method, norm): the compressors' default norm unless named; -l2 is the paper's form.
METHODS = [
    ("alq", "alq", None),
    ("amq", "amq", None),
    ("alq-n", "alq-n", None),
    ("amq-n", "amq-n", None),
    ("alq-l2", "alq", "l2"),
    ("amq-l2", "amq", "l2"),
    ("qsgdinf", "qsgdinf", None),
    ("nuqsgd", "nuqsgd", None),
    ("terngrad", "terngrad", None),
]
TYPES = ["embedding", "attention", "MLP", "head"]
ALLOC_METHODS = ["alq", "amq"]
ALLOC_WIDTHS = list(range(2, 9))


def layer_type(name: str) -> str:
    if name.startswith(("tok.", "pos.")):
        return "embedding"
    if ".qkv." in name or ".proj." in name:
        return "attention"
    if ".mlp." in name:
        return "MLP"
    if name.startswith("head."):
        return "head"
    return "norm"


def gpt_main(args, out: Path, argv: list) -> int:
    """The GPT's measurements (--model gpt): per layer type, and with --budgets the allocations."""
    bits_list = [int(b) for b in args.bits.split(",")]
    refits = {int(s) for s in args.refit_steps.split(",") if s.strip()}
    quantizers = {
        (label, b): Quantizer(m, bits=2 if m == "terngrad" else b, bucket_size=args.bucket_size, norm=n)
        for label, m, n in METHODS
        for b in bits_list
    }
    budgets = [float(b) for b in args.budgets.split(",") if b.strip()]
    widths = {(m, w): Quantizer(m, bits=w, bucket_size=args.bucket_size) for m in ALLOC_METHODS for w in ALLOC_WIDTHS}
    current = {}  # (method, budget) -> bits per quantized tensor, from the last refit
    # the compressors' own bits="auto" state (previous levels for the allocation, then a refit per width)
    autos = {(m, b): AutoBits(m, b, args.bucket_size) for m in ALLOC_METHODS for b in budgets}
    per_bucket = {(m, b): AutoBits(m, b, args.bucket_size, bits_per="bucket") for m in ALLOC_METHODS for b in budgets}
    est = dict(
        quantizers=quantizers, widths=widths, current=current, autos=autos, per_bucket=per_bucket, budgets=budgets
    )
    record: dict = {
        "iterations": [],
        "loss": [],
        "share": [],
        "variance": {},
        "allocation": {},
        "refit_bits": {},
        "compressor_bits": {},
    }
    start = time.monotonic()
    for t, loss, grads in gradients(args):
        quantized, sizes, keys = quantized_tensors(grads, args.min_size)
        if t % args.eval_every == 0:
            measure(record, t, loss, grads, (quantized, sizes, keys), est, args)
        if t in refits:
            refit(record, t, (quantized, sizes, keys), est)
        if t % 100 == 0:
            print(f"iteration {t}/{args.iters}, loss {loss:.3f}, {time.monotonic() - start:.0f} s", flush=True)
    record.update(
        args=vars(args),
        wall_seconds=time.monotonic() - start,
        parameters=[n for n, _ in grads],
        quantized_parameters=[n for n, g in quantized],
        quantized_sizes=sizes,
        argv=argv,
    )
    (out / "data" / "variance_gpt.json").write_text(json.dumps(record))
    text = gpt_report(record, bits_list)
    (out / "variance_gpt.md").write_text(text)
    plot(record, bits_list, out / "variance_gpt.png")
    print(text)
    return 0


def gpt_gradients(args):
    """AdamW (betas 0.9/0.95, weight decay 0.1, warm-up then cosine) of the GPT on one worker's
    uncompressed gradient: yields ``(t, loss, [(name, flat float64 gradient)])`` for t = 0..--iters."""
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    train_ids, _, chars = char_splits()
    model = GPT(len(chars), width=128, layers=4, heads=4, context=64)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95))
    schedule = argparse.Namespace(lr=args.lr, warmup=max(1, args.iters // 10), steps=args.iters)
    gen = torch.Generator().manual_seed(args.seed)
    for t in range(args.iters + 1):
        for group in opt.param_groups:
            group["lr"] = lr_at(min(t, args.iters - 1), schedule)
        x, y = sample_batch(train_ids, args.batch_size, 64, gen)
        opt.zero_grad()
        loss = model.loss(x, y)
        loss.backward()
        yield t, loss.item(), [(n, p.grad.detach().reshape(-1).double().numpy()) for n, p in model.named_parameters()]
        opt.step()


def measure(record: dict, t: int, loss: float, grads, tensors: tuple, est: dict, args) -> None:
    """One measurement: every method's error per layer type and in total; with budgets, the
    allocations (stale, oracle, the compressors' per tensor and per bucket)."""
    quantized, sizes, keys = tensors
    quantizers, widths, current, budgets = est["quantizers"], est["widths"], est["current"], est["budgets"]
    autos, per_bucket = est["autos"], est["per_bucket"]
    sq = {k: 0.0 for k in TYPES + ["norm"]}
    for n, g in grads:
        sq["norm" if g.size < args.min_size else layer_type(n)] += float((g**2).sum())
    total = sum(sq.values())
    record["iterations"].append(t)
    record["loss"].append(loss)
    record["share"].append({k: v / total for k, v in sq.items()})
    for (label, b), q in quantizers.items():
        err = {k: 0.0 for k in TYPES}
        for n, g in quantized:
            err[layer_type(n)] += exact_error(q, g)
        row = {k: err[k] / sq[k] for k in TYPES if sq[k] > 0}
        row["total"] = sum(err.values()) / total
        record["variance"].setdefault(f"{label}|{b}", []).append(row)
    measure_allocations(record, widths, current, quantized, sizes, budgets, total)
    for (m, budget), auto in autos.items():
        err, _ = auto_error(auto, quantized, keys)
        record["allocation"][f"{m}|{budget}"][-1]["compressor"] = err / total
    for (m, budget), auto in per_bucket.items():
        err, _ = bucket_auto_error(auto, quantized)
        record["allocation"][f"{m}|{budget}"][-1]["per_bucket"] = err / total


def refit(record: dict, t: int, tensors: tuple, est: dict) -> None:
    """A refit: the adaptive methods' levels; with budgets, every width's levels, the compressors'
    AutoBits and the allocation kept until the next refit."""
    quantized, sizes, keys = tensors
    quantizers, widths, current, budgets = est["quantizers"], est["widths"], est["current"], est["budgets"]
    autos, per_bucket = est["autos"], est["per_bucket"]
    for (label, b), q in quantizers.items():
        if q.method in ("alq", "alq-n", "amq", "amq-n"):
            refit_from(q, quantized)
    for q in widths.values():
        refit_from(q, quantized)
    for auto in per_bucket.values():
        auto_refit(auto, quantized, sizes, keys)
    for (m, budget), auto in autos.items():
        bits = auto_refit(auto, quantized, sizes, keys)
        record["compressor_bits"].setdefault(f"{m}|{budget}", {})[str(t)] = bits
    for m in ALLOC_METHODS:
        e = error_matrix([widths[(m, w)] for w in ALLOC_WIDTHS], quantized)
        for budget in budgets:
            current[(m, budget)] = allocate_bits(e, sizes, budget, ALLOC_WIDTHS).bits
            record["refit_bits"].setdefault(f"{m}|{budget}", {})[str(t)] = current[(m, budget)].tolist()


def measure_allocations(record, widths, current, quantized, sizes, budgets, total) -> None:
    """Append, per method and budget, the total normalized variance of the stale allocation (from
    the last refit; uniform 3 bits before the first), of the oracle one, and of uniform 3 bits."""
    for m in ALLOC_METHODS:
        e = error_matrix([widths[(m, w)] for w in ALLOC_WIDTHS], quantized)
        rows = np.arange(len(quantized))
        uniform = e[:, ALLOC_WIDTHS.index(3)].sum() / total
        for budget in budgets:
            stale = current.get((m, budget))
            cols = [ALLOC_WIDTHS.index(3)] * len(rows) if stale is None else [ALLOC_WIDTHS.index(b) for b in stale]
            oracle = allocate_bits(e, sizes, budget, ALLOC_WIDTHS)
            record["allocation"].setdefault(f"{m}|{budget}", []).append(
                {
                    "stale": float(e[rows, cols].sum() / total),
                    "oracle": oracle.error / total,
                    "oracle_gap": oracle.gap / total,
                    "uniform3": float(uniform),
                    "oracle_bits": oracle.bits.tolist(),
                }
            )


def _mean(rows: list, key: str, mask) -> float:
    return float(np.mean([r[key] for r, keep in zip(rows, mask) if keep and key in r]))


def gpt_report(record: dict, bits_list) -> str:
    it = np.array(record["iterations"])
    after0 = it > 0
    share = {k: float(np.mean([s[k] for s in record["share"]])) for k in TYPES + ["norm"]}
    lines = [
        f"Command: `python -m scripts.study.variance {' '.join(record['argv'] or [])}` "
        f"({record['wall_seconds']:.0f} s; {len(it)} measurements, iterations 0..{it[-1]}).",
        "",
        "Exact normalized variance E||Q(g)-g||^2/||g||^2 of one worker's GPT gradient, per layer type "
        "(each type's error over its own squared norm) and in total (over the whole gradient, the "
        "uncompressed LayerNorms and biases counted with zero error); mean over the measurements after "
        "iteration 0. Lower is better. Share of ||g||^2 (mean over measurements): "
        + ", ".join(f"{k} {100 * v:.1f}%" for k, v in share.items())
        + ".",
        "",
    ]
    for b in bits_list:
        lines += [
            f"**{b} bits**",
            "",
            "| method | total | " + " | ".join(TYPES) + " | total / QSGDinf |",
            "|---|---:|" + "---:|" * len(TYPES) + "---:|",
        ]
        reference = _mean(record["variance"][f"qsgdinf|{b}"], "total", after0)
        for label, _, _ in METHODS:
            rows = record["variance"][f"{label}|{b}"]
            total = _mean(rows, "total", after0)
            cells = [f"{_mean(rows, k, after0):.3g}" for k in TYPES]
            lines.append(f"| {label} | {total:.3g} | " + " | ".join(cells) + f" | {total / reference:.2f} |")
        lines.append("")
    lines += allocation_report(record, after0)
    return "\n".join(lines) + "\n"


def allocation_report(record: dict, after0) -> list[str]:
    lines = [
        "**Bits per tensor under a budget** (widths 2..8): total normalized variance, mean after iteration 0, "
        "and its ratio to uniform 3 bits of the same method; stale, oracle, bits='auto' and bits_per='bucket': "
        "docs/results/variance_training.md#variance_gpt.",
        "",
        "| method, budget | uniform 3 bits | allocated, stale | stale / uniform 3 | oracle | oracle / uniform 3 | "
        "gap / oracle | bits='auto' (the compressors) | / uniform 3 | bits_per='bucket' | / uniform 3 | "
        "bits per tensor at the last refit |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for key, rows in record["allocation"].items():
        m, budget = key.split("|")
        uniform = _mean(rows, "uniform3", after0)
        stale, oracle = _mean(rows, "stale", after0), _mean(rows, "oracle", after0)
        gap = _mean(rows, "oracle_gap", after0)
        refits = record["refit_bits"].get(key, {})
        last = refits[max(refits, key=int)] if refits else []
        shown = " ".join(str(b) for b in last)
        comp = _mean(rows, "compressor", after0)
        finer = _mean(rows, "per_bucket", after0) if "per_bucket" in rows[-1] else float("nan")
        lines.append(
            f"| {m}, {budget} | {uniform:.3g} | {stale:.3g} | {stale / uniform:.2f} | {oracle:.3g} | "
            f"{oracle / uniform:.2f} | {gap / oracle:.1e} | {comp:.3g} | {comp / uniform:.2f} | "
            f"{finer:.3g} | {finer / uniform:.2f} | {shown} |"
        )
    names = record.get("quantized_parameters", [])
    lines += [
        "",
        "Tensors in that order: "
        + ", ".join(f"{n} ({s})" for n, s in zip(names, record.get("quantized_sizes", [])))
        + ".",
        "",
    ]
    return lines


def plot(record: dict, bits_list, path: Path) -> None:
    """Left: total normalized variance against iteration at 3 bits (or the first width). Right: per
    layer type, mean over iterations > 0, for the main methods."""
    plt = pages.pyplot()

    b = 3 if 3 in bits_list else bits_list[0]
    it = record["iterations"]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 4.4))
    for i, (label, _, _) in enumerate(METHODS):
        rows = record["variance"][f"{label}|{b}"]
        ax.plot(it, [r["total"] for r in rows], label=label, color=f"C{i}", ls="-" if i < 6 else "--")
    ax.set(yscale="log", xlabel="iteration", ylabel="normalized variance (total)")
    ax.set_title(f"GPT gradients, {b} bits, bucket {record['args']['bucket_size']}", fontsize=10)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, ncol=2)
    mask = np.array(it) > 0
    shown = ["alq", "amq", "alq-l2", "qsgdinf", "nuqsgd", "terngrad"]
    width = 0.8 / len(shown)
    for j, label in enumerate(shown):
        rows = record["variance"][f"{label}|{b}"]
        values = [_mean(rows, k, mask) for k in TYPES]
        bx.bar(
            np.arange(len(TYPES)) + (j - (len(shown) - 1) / 2) * width,
            values,
            width,
            label=label,
            color=f"C{[m[0] for m in METHODS].index(label)}",
        )
    bx.set_xticks(range(len(TYPES)), TYPES)
    bx.set(yscale="log", ylabel="normalized variance of the layer type")
    bx.set_title(f"per layer type, {b} bits (mean over iterations > 0)", fontsize=10)
    bx.grid(axis="y", alpha=0.3, which="both")
    bx.legend(fontsize=7, ncol=3)
    pages.save(fig, path)
    plot_bits(record, path.with_name(path.stem + "_bits.png"))


def plot_bits(record: dict, path: Path) -> None:
    """Bits per quantized tensor chosen at each refit, per method and budget."""
    names = record["quantized_parameters"]
    keys = list(record["refit_bits"])
    fig, axes = _panels(len(keys), 1, 13, 2.2, sharex=True)
    for ax, key in zip(axes[:, 0], keys):
        refits = record["refit_bits"][key]
        width = 0.8 / len(refits)
        for i, (step, bits) in enumerate(sorted(refits.items(), key=lambda kv: int(kv[0]))):
            ax.bar(np.arange(len(names)) + (i - (len(refits) - 1) / 2) * width, bits, width, label=f"refit at {step}")
        m, budget = key.split("|")
        ax.set_ylabel("bits")
        ax.set_title(f"{m}, budget {budget} bits/coordinate", fontsize=9)
        ax.set_ylim(0, 8.5)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=7, loc="upper right")
    axes[-1, 0].set_xticks(range(len(names)), [n.replace(".weight", "") for n in names], rotation=70, fontsize=7)
    pages.save(fig, path, dpi=100)


if __name__ == "__main__":
    sys.exit(main())
