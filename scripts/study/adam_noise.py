#!/usr/bin/env python
"""What AdamW sees of each exchange's quantization noise: the character-level GPT of
scripts/demo/train_gpt.py trained through the real Horovod path (run under mpirun), with every
step's decoded average gradient compared to the exact average of the same local gradients (an
uncompressed allreduce beside the exchange).

Per tensor group (head, embeddings, attention and MLP matrices) and window of steps:
- ``rel``: the norm-weighted relative error ``||g^ - g||^2 / ||g||^2``, what the widths minimize;
- ``pre``: the noise as AdamW weighs it, ``mean_i (g^_i - g_i)^2 / v_i`` (``v``: AdamW's bias-corrected
  second moment before the step), against the signal ``mean_i g_i^2 / v_i``;
- ``low / high``: where that noise sits: ``pre`` per coordinate in the group's buckets whose exact
  gradient has a mean square below the group's median over those above it (widths per bucket give
  the low-norm buckets the fewest bits; AdamW divides their coordinates by the smallest ``v``);
- ``jump``: how much a bucket's noise level moves from step to step: the standard deviation over
  steps of ``log2 ||e_b||^2 / ||g_b||^2`` per quantization bucket ``b``, median over buckets
  (fixed widths: the spread of one width's error; widths per bucket: also the width changes);
- ``cos``: the largest |cosine| between the errors of consecutive steps (0 for independent rounding);
- ``bias``: after the measured steps, one batch's exchange repeated ``--repeats`` times on the run's
  state: per tensor ``||mean - exact||^2`` over its expectation for an unbiased exchange (the sum
  of the per-coordinate error variances over the repeats), near 1 when unbiased.

    mpirun -np 4 python -m scripts.study.adam_noise --out build/results/adam_noise.md
    # the report goes by hand into docs/results/error_feedback.md#adam_noise
    mpirun -np 2 python -m scripts.study.adam_noise --quick
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np
import torch

GROUPS = ("head", "embeddings", "attention", "mlp")


def group_of(name: str) -> str | None:
    """The group of a GPT parameter (None: a vector or a norm, sent uncompressed)."""
    if not name.endswith("weight") or ".ln" in name or name.startswith("ln"):
        return None
    if name.startswith("head"):
        return "head"
    if name.startswith(("tok", "pos")):
        return "embeddings"
    return "mlp" if ".mlp." in name else "attention"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--methods",
        default="alq@3,alq@2,alq@auto2.5,alq@bucket2.5,alq@bucket3",
        help="train_gpt.py method specs, run in turn (+ef, +efx<share>: error feedback)",
    )
    p.add_argument("--steps", type=int, default=60, help="steps measured; default 60")
    p.add_argument("--window", type=int, default=30, help="steps per row; default 30")
    p.add_argument("--repeats", type=int, default=80, help="repeats of one exchange for the bias; default 80")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="6 steps, windows of 3, two methods")
    p.add_argument("--out", help="Markdown report (rank 0; default: print only)")
    p.add_argument("--json", help="every step's figures (rank 0)")
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.window, args.methods, args.repeats = 6, 3, "alq@2,alq@bucket2.5", 4
    return args


def measure(spec: str, args, data, hvd) -> dict:
    """Train ``spec`` for ``args.steps`` steps of the accuracy sweep's run (AdamW, 250-step schedule,
    8 sequences per worker); every step's errors per group."""
    from scripts.common.gpt import sample_batch
    from scripts.demo import train_gpt as tg
    from scripts.study import feedback_switches as switches

    run = tg.parse_args(["--steps", "250", "--batch-size", "8", "--seed", str(args.seed)])
    train_ids, val_ids, chars = data
    base, feedback_from, share = switches.split(spec)  # +ef, +efx<share>: error feedback
    if feedback_from:
        raise SystemExit(f"{spec!r}: error feedback from a later step is not measured here")
    name, bits, budget = tg.parse_method(base)
    model, plain, opt, comp, _ = tg.make_run(name, bits, run, len(chars), hvd, budget, feedback_from == 0)
    switches.keep_share(comp, share)
    named = [(n, p, group_of(n)) for n, p in model.named_parameters()]
    local: dict = {}
    for n, p, _ in named:
        p.register_hook(lambda g, n=n: local.__setitem__(n, g.detach().clone()))
    generator = torch.Generator().manual_seed(args.seed * 1000 + hvd.rank())
    rows = {k: [] for k in ("loss", *(f"{m}.{g}" for m in ("rel", "pre", "sig", "split") for g in GROUPS))}
    levels: dict = {}  # (group, tensor, bucket) -> log2 of its relative error, per step
    cosines, previous = [], None
    for step in range(args.steps):
        for group in opt.param_groups:
            group["lr"] = tg.lr_at(step, run)
        x, y = sample_batch(train_ids, run.batch_size, run.context, generator)
        opt.zero_grad()
        loss = model.loss(x, y)
        loss.backward()
        opt.synchronize()
        exact = hvd.allreduce(
            torch.cat([local[n].reshape(-1) for n, _, _ in named]), op=hvd.Average, name=f"adam_noise.{spec}.exact"
        )
        exact = exact.double()
        error = torch.cat([p.grad.reshape(-1) for _, p, _ in named]).double() - exact
        if previous is not None:
            cosines.append(float(error @ previous / (error.norm() * previous.norm()).clamp_min(1e-300)))
        previous = error
        acc, count, buckets = step_sums(named, exact, error, opt, run.bucket_size, levels)
        rows["loss"].append(loss.item())
        for g in GROUPS:
            rows[f"rel.{g}"].append(acc[f"rel.{g}"] / max(acc[f"norm.{g}"], 1e-300))
            rows[f"pre.{g}"].append(acc[f"pre.{g}"] / count[g] if step else float("nan"))
            rows[f"sig.{g}"].append(acc[f"sig.{g}"] / count[g] if step else float("nan"))
            rows[f"split.{g}"].append(low_over_high(buckets[g]) if step else float("nan"))
        with opt.skip_synchronize():
            opt.step()
    batch = sample_batch(train_ids, run.batch_size, run.context, generator)
    bias = repeat_bias(spec, model, opt, named, local, batch, args.repeats, hvd)
    jump = {
        g: float(np.median([np.std(v) for (gg, *_), v in levels.items() if gg == g and len(v) > 2] or [float("nan")]))
        for g in GROUPS
    }
    return {
        "rows": rows,
        "jump": jump,
        "eval": tg.evaluate(plain, val_ids, run),
        "bias": bias,
        "cos": max(map(abs, cosines), default=float("nan")),
        "mean_cos": float(np.mean(cosines)) if cosines else float("nan"),
    }


def step_sums(named, exact, error, opt, bucket_size: int, levels: dict) -> tuple[dict, dict, dict]:
    """One step's sums per group: the squared error and the exact gradient's squared norm, both
    scaled by AdamW's second moment; the coordinates; each bucket's (mean square of the exact
    gradient, AdamW-scaled noise, coordinates); and each bucket's log2 relative error appended to
    ``levels``."""
    beta2 = opt.param_groups[0]["betas"][1]
    acc = {f"{m}.{g}": 0.0 for m in ("rel", "pre", "sig", "norm") for g in GROUPS}
    count = dict.fromkeys(GROUPS, 0)
    buckets = {g: [] for g in GROUPS}
    at = 0
    for n, p, g in named:
        k = p.numel()
        e, err, at = exact[at : at + k], error[at : at + k], at + k
        if g is None:
            continue
        acc[f"rel.{g}"] += float(err.pow(2).sum())
        acc[f"norm.{g}"] += float(e.pow(2).sum())
        state = opt.state.get(p, {})
        if "exp_avg_sq" in state:
            v = state["exp_avg_sq"].reshape(-1).double() / (1 - beta2 ** float(state["step"])) + 1e-16
            scaled = err.pow(2) / v
            acc[f"pre.{g}"] += float(scaled.sum())
            acc[f"sig.{g}"] += float((e.pow(2) / v).sum())
            for lo in range(0, k, bucket_size):
                hi = min(k, lo + bucket_size)
                buckets[g].append((float(e[lo:hi].pow(2).mean()), float(scaled[lo:hi].sum()), hi - lo))
        count[g] += k
        for b, lo in enumerate(range(0, k, bucket_size)):
            eb, gb = err[lo : lo + bucket_size], e[lo : lo + bucket_size]
            ratio = float(eb.pow(2).sum() / gb.pow(2).sum().clamp_min(1e-300))
            if ratio > 0:
                levels.setdefault((g, n, b), []).append(np.log2(ratio))
    return acc, count, buckets


def low_over_high(buckets: list) -> float:
    """AdamW-scaled noise per coordinate in the buckets below the median mean square over that in the
    buckets at or above it (``buckets``: (mean square, scaled noise, coordinates) each); NaN with
    fewer than two buckets."""
    if len(buckets) < 2:
        return float("nan")
    msq, noise, n = (np.array(c, dtype=np.float64) for c in zip(*buckets))
    low = msq < np.median(msq)
    if not low.any() or low.all():
        return float("nan")
    return float((noise[low].sum() / n[low].sum()) / max(noise[~low].sum() / n[~low].sum(), 1e-300))


def repeat_bias(spec, model, opt, named, local, batch, repeats: int, hvd) -> dict:
    """One batch's exchange ``repeats`` times (no optimizer step): per quantized tensor,
    ``||mean - exact||^2`` over the sum of the per-coordinate error variances over ``repeats``."""
    x, y = batch
    total = squares = exact = None
    for _ in range(repeats):
        opt.zero_grad()
        model.loss(x, y).backward()
        opt.synchronize()
        decoded = torch.cat([p.grad.reshape(-1) for _, p, _ in named]).double()
        if exact is None:
            exact = hvd.allreduce(
                torch.cat([local[n].reshape(-1) for n, _, _ in named]), op=hvd.Average, name=f"adam_noise.bias.{spec}"
            ).double()
            total, squares = torch.zeros_like(decoded), torch.zeros_like(decoded)
        total += decoded
        squares += (decoded - exact) ** 2
    opt.zero_grad()
    mean, out, at = total / repeats, {}, 0
    for n, p, g in named:
        k = p.numel()
        sl, at = slice(at, at + k), at + k
        if g is not None:
            variance = float(squares[sl].sum()) / repeats  # E||g^ - g||^2 (a bias adds to both; the ratio grows)
            out[n] = float(((mean[sl] - exact[sl]) ** 2).sum()) / (variance / repeats)
    return out


def report(results: dict, args, seconds: float) -> list[str]:
    argv = " ".join(sys.argv[1:])
    lines = [
        "# The quantization noise as AdamW sees it: GPT, real Horovod path",
        "",
        f"Command: `mpirun -np {args.np} python -m scripts.study.adam_noise {argv}` "
        f"({time.strftime('%Y-%m-%d')}, {seconds:.0f} s). The GPT run of the accuracy sweep "
        f"(scripts/study/run_accuracy_gpt.py: AdamW betas 0.9/0.95, 250-step schedule with 30 warm-up "
        f"steps, 8 x 64 characters per worker and step, bucket 8192, refits at steps 0 and 100, "
        f"{args.np} workers, two-phase), seed {args.seed}, its first {args.steps} steps. Each step's decoded "
        f"average gradient against the exact average of the same local gradients.",
        "",
        "- rel: `||g^ - g||^2 / ||g||^2` of the group, mean over the window's steps (what the widths minimize);",
        "- pre / sig: `mean_i (g^_i - g_i)^2 / v_i` and `mean_i g_i^2 / v_i` with AdamW's bias-corrected "
        "second moment `v` before the step (the noise and the signal as AdamW scales them);",
        "- jump: standard deviation over all measured steps of `log2` of a bucket's relative error, "
        "median over the group's buckets (how much a coordinate's noise level moves between steps);",
        "- cos: the largest |cosine| between the errors of consecutive steps, and their mean cosine (signed: "
        "error feedback's errors are anti-correlated by design);",
        f"- bias: one batch's exchange repeated {args.repeats} times after the measured steps (no optimizer "
        "step), per tensor `||mean - exact||^2` over its expectation for an unbiased exchange (near 1; with "
        "error feedback (`+ef`) the repeats telescope, so below 1);",
        "- eval: held-out loss after the last measured step.",
        "",
    ]
    head = (
        "| method | steps | train loss | "
        + " | ".join(f"rel {g}" for g in GROUPS)
        + " | "
        + " | ".join(f"pre / sig {g}" for g in GROUPS)
        + " |"
    )
    lines += [head, "|---|---|---:|" + "---:|" * (2 * len(GROUPS))]
    for spec, r in results.items():
        rows = r["rows"]
        for lo in range(0, args.steps, args.window):
            hi = min(args.steps, lo + args.window)

            def mean(key):
                return float(np.nanmean(rows[key][lo:hi])) if np.isfinite(rows[key][lo:hi]).any() else float("nan")

            lines.append(
                f"| {spec} | {lo}-{hi} | {mean('loss'):.3f} | "
                + " | ".join(f"{mean(f'rel.{g}'):.3f}" for g in GROUPS)
                + " | "
                + " | ".join(f"{mean(f'pre.{g}'):.3f} / {mean(f'sig.{g}'):.3f}" for g in GROUPS)
                + " |"
            )
    lines += [
        "",
        "Where AdamW's noise sits: `pre` per coordinate in the buckets below the group's median norm "
        "over those above it (1: spread evenly), mean over the window's steps:",
        "",
        "| method | steps | " + " | ".join(f"low / high {g}" for g in GROUPS) + " |",
        "|---|---|" + "---:|" * len(GROUPS),
    ]
    for spec, r in results.items():
        rows = r["rows"]
        for lo in range(0, args.steps, args.window):
            hi = min(args.steps, lo + args.window)
            cells = [np.asarray(rows[f"split.{g}"][lo:hi], dtype=np.float64) for g in GROUPS]
            lines.append(
                f"| {spec} | {lo}-{hi} | "
                + " | ".join(f"{np.nanmean(c):.2f}" if np.isfinite(c).any() else "-" for c in cells)
                + " |"
            )
    lines += [
        "",
        "| method | eval loss | "
        + " | ".join(f"jump {g}" for g in GROUPS)
        + f" | cos | mean cos | bias over {args.repeats} repeats (min-max over tensors) |",
        "|---|---:|" + "---:|" * len(GROUPS) + "---:|---:|---:|",
    ]
    for spec, r in results.items():
        b = list(r["bias"].values())
        lines.append(
            f"| {spec} | {r['eval']:.4f} | "
            + " | ".join(f"{r['jump'][g]:.2f}" for g in GROUPS)
            + f" | {r['cos']:.4f} | {r['mean_cos']:+.4f} | {min(b):.2f}-{max(b):.2f} |"
        )
    return lines


def main(argv=None) -> int:
    args = parse_args(argv)
    import horovod.torch as hvd

    from scripts.common.bench import write_report
    from scripts.common.gpt import char_splits

    hvd.init()
    torch.set_num_threads(1)
    args.np = hvd.size()
    data = char_splits()
    start = time.perf_counter()
    results = {spec: measure(spec, args, data, hvd) for spec in args.methods.split(",") if spec.strip()}
    if hvd.rank() == 0:
        write_report(report(results, args, time.perf_counter() - start), args.out)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"workers": args.np, "steps": args.steps, "results": results}, f)
    hvd.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
