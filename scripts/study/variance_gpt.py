#!/usr/bin/env python
"""Exact quantization variance of every method on the gradients of the character-level GPT
(scripts/common/gpt.py, the model of scripts/demo/train_gpt.py), over training, in total and per layer type.

One process trains the GPT with AdamW on the uncompressed gradient of one worker's batch (the
gradient a worker of scripts/demo/train_gpt.py quantizes) and, every --eval-every iterations, computes
for each method and bit width the EXACT variance of unbiased stochastic rounding, per tensor as the
compressors quantize it (buckets counted from each tensor's start, tensors below --min-size left in
float32): E||Q(g) - g||^2 summed per layer type and divided by that type's ||g||^2, and the total
over the step's gradient. Adaptive methods refit on the compressors' schedule (--refit-steps) from
the sum of the per-tensor statistics (what the allreduce of the compressors combines): the
variance of iteration t uses the levels fitted before t.

With --budgets (mean bits per coordinate over the quantized tensors, bucket norms not counted),
ALQ and AMQ also get bits per tensor (horovod_alq.core.allocation.allocate_bits: widths 2..8, one
level set per width fitted on the same schedule from all tensors' statistics): at every refit
the allocation minimizing the step's total variance under the budget, computed from that
iteration's gradient and kept until the next refit ("stale", what a compressor would do), and,
for comparison, the allocation recomputed at every measurement ("oracle"); both against uniform
3 bits of the same method. The compressors' ``bits="auto"`` (horovod_alq.core.auto_bits.AutoBits,
the same refits) is measured beside them.

Layer types: embedding (token and position tables), attention (qkv and output projections), MLP,
head (the output projection to the vocabulary); LayerNorms and biases are all below --min-size
and travel uncompressed (their share of ||g||^2 is shown).

    python -m scripts.study.variance_gpt      # 300 iterations, 2/3/4 bits, d=8192, into build/results
    python -m scripts.study.variance_gpt --quick --out-dir /tmp/v # 20 iterations, 3 bits
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
from horovod_alq.core.auto_bits import AutoBits
from scripts.common import report as pages
from scripts.common.auto_bits import (
    auto_error,
    auto_refit,
    bucket_auto_error,
    error_matrix,
    exact_error,
    quantized_tensors,
    refit_from,
)
from scripts.common.gpt import GPT, char_splits, lr_at, sample_batch

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


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iters", type=int, default=300, help="AdamW iterations; default 300")
    p.add_argument("--eval-every", type=int, default=25, help="default 25")
    p.add_argument("--bits", default="2,3,4", help="default 2,3,4 (TernGrad: always 2)")
    p.add_argument("--bucket-size", type=int, default=8192, help="default 8192")
    p.add_argument("--min-size", type=int, default=1024, help="smaller tensors are not quantized; default 1024")
    p.add_argument("--refit-steps", default="0,100,2000", help="the compressors' schedule; default 0,100,2000")
    p.add_argument("--batch-size", type=int, default=8, help="one worker's batch; default 8")
    p.add_argument("--lr", type=float, default=3e-3, help="peak AdamW learning rate (train_gpt.py's); default 3e-3")
    p.add_argument("--budgets", default="2.5,3", help="mean bits per coordinate of the allocations; '' for none")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--out-dir",
        default="build/results",
        help="variance_gpt.md/.png go here, variance_gpt.json to its data/; default build/results",
    )
    p.add_argument("--quick", action="store_true", help="20 iterations, 3 bits")
    args = p.parse_args(argv)
    if args.quick:
        args.iters, args.eval_every, args.bits, args.refit_steps, args.budgets = 20, 20, "3", "0,10", "3"
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out_dir)
    (out / "data").mkdir(parents=True, exist_ok=True)
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
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    train_ids, _, chars = char_splits()
    model = GPT(len(chars), width=128, layers=4, heads=4, context=64)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95))
    schedule = argparse.Namespace(lr=args.lr, warmup=max(1, args.iters // 10), steps=args.iters)
    gen = torch.Generator().manual_seed(args.seed)
    names = [n for n, _ in model.named_parameters()]
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
    for t in range(args.iters + 1):
        for group in opt.param_groups:
            group["lr"] = lr_at(min(t, args.iters - 1), schedule)
        x, y = sample_batch(train_ids, args.batch_size, 64, gen)
        opt.zero_grad()
        loss = model.loss(x, y)
        loss.backward()
        grads = [(n, p.grad.detach().reshape(-1).double().numpy()) for n, p in model.named_parameters()]
        quantized, sizes, keys = quantized_tensors(grads, args.min_size)
        if t % args.eval_every == 0:
            measure(record, t, loss.item(), grads, (quantized, sizes, keys), est, args)
        if t in refits:
            refit(record, t, (quantized, sizes, keys), est)
        opt.step()
        if t % 100 == 0:
            print(f"iteration {t}/{args.iters}, loss {loss.item():.3f}, {time.monotonic() - start:.0f} s", flush=True)
    record.update(
        args=vars(args),
        wall_seconds=time.monotonic() - start,
        parameters=names,
        quantized_parameters=[n for n, g in quantized],
        quantized_sizes=sizes,
        argv=argv if argv is not None else sys.argv[1:],
    )
    (out / "data" / "variance_gpt.json").write_text(json.dumps(record))
    text = report(record, bits_list)
    (out / "variance_gpt.md").write_text(text)
    plot(record, bits_list, out / "variance_gpt.png")
    print(text)
    return 0


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
    if budgets:
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
    if budgets:
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


def report(record: dict, bits_list) -> str:
    it = np.array(record["iterations"])
    after0 = it > 0
    share = {k: float(np.mean([s[k] for s in record["share"]])) for k in TYPES + ["norm"]}
    lines = [
        f"Command: `python -m scripts.study.variance_gpt {' '.join(record['argv'] or [])}` "
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
    if record["allocation"]:
        lines += allocation_report(record, after0)
    return "\n".join(lines) + "\n"


def allocation_report(record: dict, after0) -> list[str]:
    lines = [
        "**Bits per tensor under a budget** (widths 2..8, horovod_alq.core.allocation): total normalized "
        "variance, mean over the measurements after iteration 0, and its ratio to uniform 3 bits of the same "
        "method. Stale: the allocation of the last refit; oracle: recomputed at every measurement "
        "(allocate_bits' exact optimum: gap 0 unless its budget grid was coarse); both with every width's levels "
        "fitted "
        "from all tensors. bits='auto': the compressors' own AutoBits (allocated with the previous refit's "
        "levels, each width then refit from its own tensors; uniform 3 bits before the first refit), "
        "its allocation kept until the next refit. bits_per='bucket': the compressors' widths per bucket "
        "(horovod_alq.core.bucket_widths; every width and the error model refit at the same refits, each "
        "bucket's width chosen from the measured gradient's bucket norms, the quantized tensors in one "
        "payload).",
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
    ax.set_yscale("log")
    ax.set_xlabel("iteration")
    ax.set_ylabel("normalized variance (total)")
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
    bx.set_yscale("log")
    bx.set_xticks(range(len(TYPES)), TYPES)
    bx.set_ylabel("normalized variance of the layer type")
    bx.set_title(f"per layer type, {b} bits (mean over iterations > 0)", fontsize=10)
    bx.grid(axis="y", alpha=0.3, which="both")
    bx.legend(fontsize=7, ncol=3)
    pages.save(fig, path)
    if record["refit_bits"]:
        plot_bits(record, path.with_name(path.stem + "_bits.png"))


def plot_bits(record: dict, path: Path) -> None:
    """Bits per quantized tensor chosen at each refit, per method and budget."""
    plt = pages.pyplot()

    names = record["quantized_parameters"]
    keys = list(record["refit_bits"])
    fig, axes = plt.subplots(len(keys), 1, figsize=(13, 2.2 * len(keys)), sharex=True, squeeze=False)
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
