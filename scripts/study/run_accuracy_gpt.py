#!/usr/bin/env python
"""Accuracy on a transformer: the held-out loss of the character-level GPT (scripts/common/gpt.py,
scripts/demo/train_gpt.py) after a fixed token budget, for every exchange over several seeds, each launch
a real 4-worker job (``mpirun -np 4 ... -m scripts.demo.train_gpt --json``); a Markdown table of the final
evaluation loss (nats and bits per character), the same-seed differences to fp32 and to QSGDinf at
the same bit width (mean and standard error over seeds), the bits per coordinate each method sent,
and a plot of the learning curves.

    python -m scripts.study.run_accuracy_gpt     # the core grid, 5 seeds, into build/results
    python -m scripts.study.run_accuracy_gpt --grid wide --seeds 0,1   # the wider grid
    python -m scripts.study.run_accuracy_gpt --grid auto     # bits="auto" under a budget
    python -m scripts.study.run_accuracy_gpt --grid bucket   # bits_per="bucket" under a budget
    python -m scripts.study.run_accuracy_gpt --grid sgd --optimizer sgd   # SGD, momentum 0.9
    python -m scripts.study.run_accuracy_gpt --quick --out-dir /tmp/g       # 2 ranks, 1 seed, 20 steps

Every launch writes its JSON under <out-dir>/data/accuracy_gpt_raw; a launch whose JSON exists is
skipped (an interrupted sweep resumes), and ``--aggregate-only`` rebuilds the outputs from what
is there (both grids together). ``--optimizer sgd`` writes accuracy_gpt_sgd.md (and .png, .json,
accuracy_gpt_sgd_raw) instead, so that its rows never mix with AdamW's.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
import time
from pathlib import Path

from scripts.common import launch
from scripts.common import report as pages
from scripts.study.feedback_switches import split, switched

ROOT = Path(__file__).resolve().parents[2]
TRAIN = "scripts.demo.train_gpt"  # run with python -m from ROOT; launches with +ef<step> or +efx<share> rows:
SWITCHES = "scripts.study.feedback_switches"  # the demo with the studies' error-feedback switches
# Each grid is a list of launches per seed; a launch runs its methods in turn in one mpirun job.
# At 2 bits ALQ and AMQ nearly coincide (levels -1, -a, b, 1 against -1, -p, p, 1, fitted to the same
# objective: a, b and p agree to about 1%), so the core grid runs ALQ only there.
GRIDS = {
    "core": [
        ["alq@3", "amq@3", "qsgdinf@3", "none", "psgd-match", "psgd2"],
        ["alq@2", "qsgdinf@2", "terngrad", "fp16"],
    ],
    "wide": [
        ["alq@4", "qsgdinf@4", "nuqsgd@3", "alq-n@3", "amq-n@3"],
        ["alq-l2@3", "amq-l2@3", "alq-ag@3", "amq-ag@3", "qsgdinf-ag@3"],
    ],
    "bucket1024": [["alq@3", "amq@3", "qsgdinf@3", "alq@2", "qsgdinf@2"]],
    # bits="auto": a width from 2 to 8 per tensor under a mean budget (name@auto<budget>), against
    # the core grid's fixed widths on the same seeds
    "auto": [["alq@auto2.5", "alq@auto3"]],
    # bits_per="bucket": a width per bucket of every payload under the budget (name@bucket<budget>)
    "bucket": [["alq@bucket2.5", "alq@bucket3"]],
    # the widths under SGD (--optimizer sgd), against fixed widths and fp32 of the same launch
    "sgd": [["none", "alq@3", "alq@2", "alq@bucket2.5", "alq@bucket3", "alq@auto2.5"]],
    # error_feedback=True (name@bits+ef) against the same widths without it and fp32, same launch
    "feedback": [["none", "alq@3", "alq@3+ef", "alq@2", "alq@2+ef"], ["psgd-match"]],
    # with --optimizer adamw-frozen (1-bit Adam's schedule): error feedback from the start (+ef) and
    # from the freeze step on (+ef30, the default freeze at the 30-step warm-up)
    "frozen": [["none", "alq@3", "alq@3+ef", "alq@3+ef30"], ["alq@2", "alq@2+ef", "alq@2+ef30"]],
    # the frozen optimizer's rows without error feedback, for more seeds
    "frozen-core": [["none", "alq@3", "alq@2"]],
    # AdamW with part of each error kept (+efx<share>), against the feedback grid's rows
    "partial": [["alq@3+efx0.5", "alq@2+efx0.5", "alq@2+efx0.25"]],
    # fp32 alone: a learning-rate sweep (one --out-dir per --lr)
    "fp32": [["none"]],
}
# Same-seed comparisons shown in the second table: (row, against).
PAIRS = [
    ("alq@3", "qsgdinf@3"),
    ("amq@3", "qsgdinf@3"),
    ("alq@2", "qsgdinf@2"),
    ("alq@2", "terngrad"),
    ("alq@3", "amq@3"),
    ("alq@3", "psgd-match"),
    ("amq@3", "psgd-match"),
    ("alq@3", "none"),
    ("amq@3", "none"),
    ("psgd-match", "none"),
    ("qsgdinf@3", "none"),
    ("fp16", "none"),
    # the wider grid: 4 bits, norm-less forms, L2 buckets, allgather against two-phase (auto)
    ("alq@4", "qsgdinf@4"),
    ("alq-n@3", "alq@3"),
    ("amq-n@3", "amq@3"),
    ("alq@3", "alq-l2@3"),
    ("amq@3", "amq-l2@3"),
    ("alq-ag@3", "alq@3"),
    ("amq-ag@3", "amq@3"),
    ("qsgdinf-ag@3", "qsgdinf@3"),
    ("nuqsgd@3", "qsgdinf@3"),
    # bits="auto" against fixed widths (the core grid's runs of the same seeds)
    ("alq@auto2.5", "alq@3"),
    ("alq@auto3", "alq@3"),
    ("alq@auto2.5", "alq@2"),
    ("alq@bucket2.5", "alq@3"),
    ("alq@bucket3", "alq@3"),
    ("alq@bucket2.5", "alq@auto2.5"),
    ("alq@bucket2.5", "alq@2"),
    ("alq@bucket3", "none"),
    ("alq@2", "none"),
    # error feedback against the same widths without it, and against fp32
    ("alq@3+ef", "alq@3"),
    ("alq@2+ef", "alq@2"),
    ("alq@3+ef", "none"),
    ("alq@2+ef", "none"),
    ("alq@3+ef30", "alq@3"),
    ("alq@3+efx0.5", "alq@3"),
    ("alq@2+efx0.5", "alq@2"),
    ("alq@2+efx0.25", "alq@2"),
    ("alq@2+ef30", "alq@2"),
]
LABELS = {"none": "fp32", "fp16": "fp16", "terngrad": "TernGrad", "psgd2": "PowerSGD rank 2"}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--np", type=int, default=4, help="workers; default 4")
    p.add_argument("--seeds", default="0,1,2,3,4", help="default 0,1,2,3,4")
    p.add_argument("--grid", default="core", choices=sorted(GRIDS), help="default core")
    p.add_argument("--bucket-size", type=int, default=None, help="default 8192 (1024 for --grid bucket1024)")
    p.add_argument("--steps", type=int, default=250, help="train_gpt.py --steps; default 250")
    p.add_argument("--batch-size", type=int, default=8, help="train_gpt.py --batch-size; default 8")
    p.add_argument(
        "--optimizer",
        default="adamw",
        choices=("adamw", "adamw-frozen", "sgd"),
        help="train_gpt.py --optimizer; sgd runs at --lr (default 0.2) without weight decay; adamw-frozen: "
        "AdamW with its second moment frozen after --extra '--freeze-step N' (default the warm-up)",
    )
    p.add_argument("--lr", type=float, default=None, help="peak lr; default train_gpt.py's (AdamW) or 0.2 (SGD)")
    p.add_argument("--extra", default="", help="more train_gpt.py arguments, quoted")
    p.add_argument(
        "--out-dir",
        default="build/results",
        help="accuracy_gpt.md/.png go here, accuracy_gpt.json and the raw runs to its data/; default build/results",
    )
    p.add_argument("--timeout", type=float, default=5400, help="seconds per launch; default 5400")
    p.add_argument("--aggregate-only", action="store_true")
    p.add_argument(
        "--quick",
        action="store_true",
        help="2 ranks, seed 0, 20 steps: alq@3, none, psgd-match, or with a --grid other than core that grid's methods",
    )
    args = p.parse_args(argv)
    if args.bucket_size is None:
        args.bucket_size = 1024 if args.grid == "bucket1024" else 8192
    if args.quick:
        args.np, args.seeds, args.steps = 2, "0", 20
    if args.lr is None and args.optimizer == "sgd":
        args.lr = 0.2
    return args


def stem(args) -> str:
    """The outputs' name: accuracy_gpt, or accuracy_gpt_sgd for SGD runs."""
    return "accuracy_gpt" if args.optimizer == "adamw" else f"accuracy_gpt_{args.optimizer}"


def optimizer_args(args) -> list[str]:
    """train_gpt.py's optimizer arguments for this sweep."""
    out = {"adamw": [], "adamw-frozen": ["--optimizer", "adamw-frozen"]}.get(
        args.optimizer, ["--optimizer", args.optimizer, "--weight-decay", "0"]
    )
    return out + ([] if args.lr is None else ["--lr", repr(args.lr)])


def launches(args) -> list[dict]:
    grid = [["alq@3", "none", "psgd-match"]] if args.quick and args.grid == "core" else GRIDS[args.grid]
    return [{"seed": int(s), "methods": ms} for s in args.seeds.split(",") if s.strip() for ms in grid]


def raw_path(job: dict, args, raw_dir: Path) -> Path:
    """The launch's JSON: a method spec's ``@`` as ``b`` and a budget's ``.`` as ``p`` (``alq@auto2.5``:
    ``alqbauto2p5``)."""
    return raw_dir / (
        f"np{args.np}_d{args.bucket_size}_s{job['seed']}_t{args.steps}_b{args.batch_size}_"
        f"{'-'.join(m.replace('@', 'b').replace('.', 'p').replace('+', 'p') for m in job['methods'])}.json"
    )


def run_launch(job: dict, args, raw_dir: Path) -> None:
    module = SWITCHES if any(switched(m) for m in job["methods"]) else TRAIN
    cmd = [*launch.mpirun(args.np), sys.executable, "-m", module, "--methods", ",".join(job["methods"])]
    cmd += ["--seed", str(job["seed"]), "--steps", str(args.steps), "--batch-size", str(args.batch_size)]
    cmd += ["--bucket-size", str(args.bucket_size), "--json", "{json}", *optimizer_args(args)]
    out = launch.resumable(cmd + shlex.split(args.extra), raw_path(job, args, raw_dir), args.timeout)
    if out:
        print("\n".join(ln for ln in out.splitlines() if "eval loss" in ln), flush=True)


def collect(raw_dir: Path, args) -> dict:
    """{row label: {seed: result}} over the raw files of this worker count, step count and batch
    size; the row label is the method spec, with ``/d<bucket>`` where the bucket is not 8192."""
    rows: dict = {}
    for path in sorted(raw_dir.glob(f"np{args.np}_d*_t{args.steps}_b{args.batch_size}_*.json")):
        data = json.loads(path.read_text())
        seed, bucket = data["args"]["seed"], data["args"]["bucket_size"]
        for r in data["results"]:
            label = r["spec"] if r["bits"] is None or bucket == 8192 else f"{r['spec']}/d{bucket}"
            if seed in rows.setdefault(label, {}):
                raise ValueError(f"{path.name} repeats {label} seed {seed}")
            rows[label][seed] = r
    return rows


def _paired(runs: dict, reference: dict | None) -> dict | None:
    """Mean, standard error, median and the count of seeds where ``runs`` is lower, of the same-seed
    differences ``runs - reference``."""
    if not reference or runs is reference:
        return None
    diffs = [r["eval_loss"] - reference[s]["eval_loss"] for s, r in runs.items() if s in reference]
    if not diffs:
        return None
    d = pages.stats(diffs)
    ordered = sorted(diffs)
    median = (ordered[(len(ordered) - 1) // 2] + ordered[len(ordered) // 2]) / 2
    return {
        **d,
        "sem": d["std"] / math.sqrt(d["n"]),
        "median": median,
        "lower": sum(x < 0 for x in diffs),
        "diffs": diffs,
    }


def summarize(rows: dict) -> dict:
    """Per row: eval-loss statistics over seeds, bits per character, bits per coordinate sent, and
    the same-seed differences to fp32 and to QSGDinf of the same bit width (and bucket)."""
    out = {}
    for label, runs in rows.items():
        losses = [r["eval_loss"] for r in runs.values()]
        first = next(iter(runs.values()))
        bucket = label.partition("/")[2]
        qsgd_label = f"qsgdinf@{first['bits']}" + (f"/{bucket}" if bucket else "") if first["bits"] else None
        cell = {
            "loss": pages.stats(losses),
            "bpc": pages.stats([v / math.log(2) for v in losses]),
            "bits_per_coordinate": sum(r["bits_per_coordinate"] for r in runs.values()) / len(runs),
            "vs_fp32": _paired(runs, rows.get("none")),
            "vs_qsgdinf": _paired(runs, rows.get(qsgd_label)) if qsgd_label else None,
            "curve": _mean_curve(runs),
            "seeds": sorted(runs),
        }
        if "rank" in first:
            cell["powersgd_rank"] = first["rank"]
        if "allocation" in first:  # bits="auto": each seed's last allocation
            cell["allocated_mean_bits"] = {s: r["allocated_mean_bits"] for s, r in sorted(runs.items())}
            cell["allocation"] = {s: r["allocation"] for s, r in sorted(runs.items())}
            cell["allocation_elements"] = first.get("allocation_elements")
        out[label] = cell
    out["pairs"] = {f"{a} - {b}": _paired(rows[a], rows[b]) for a, b in PAIRS if a in rows and b in rows}
    return out


def _mean_curve(runs: dict) -> list:
    curves = [r["curve"] for r in runs.values()]
    steps = [s for s, _ in curves[0]]
    return [
        [s, sum(c[i][1] for c in curves) / len(curves)]
        for i, s in enumerate(steps)
        if all(len(c) > i and c[i][0] == s for c in curves)
    ]


def order(labels) -> list:
    """Baselines first, then by method family, bit width (an auto budget beside its width, after it),
    bucket."""

    def key(label):
        spec, _, bucket = label.partition("/")
        spec, start, share = split(spec)
        name, _, bits = spec.partition("@")
        feedback = (-1, 0.0) if start is None else (start, -share)
        rank = {"none": 0, "fp16": 1}.get(name, 3 if name.startswith("psgd") else 2)
        auto = bits.startswith(("auto", "bucket"))
        return (rank, -float(bits.removeprefix("auto").removeprefix("bucket") or 0), bucket, auto, feedback, name)

    return sorted(labels, key=key)


def markdown(summary: dict) -> str:
    def pm(d):
        if not d:
            return "-"
        return f"{d['mean']:+.4f} ± {d['sem']:.4f}" if d["n"] > 1 else f"{d['mean']:+.4f} (one seed)"

    lines = [
        "| method | bits/coord sent | eval loss (nats/char) | bits/char | − fp32, same seed | "
        "− QSGDinf same bits, same seed | seeds |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    rows = {k: v for k, v in summary.items() if k != "pairs"}
    for label in order(rows):
        c = rows[label]
        name = label.partition("@")[0]
        shown = LABELS.get(name, label) + (f" (rank {c['powersgd_rank']})" if name == "psgd-match" else "")
        lines.append(
            f"| {shown} | {c['bits_per_coordinate']:.2f} | {c['loss']['mean']:.4f} ± {c['loss']['std']:.4f} "
            f"| {c['bpc']['mean']:.3f} | {pm(c['vs_fp32'])} | {pm(c['vs_qsgdinf'])} | {c['loss']['n']} |"
        )
    lines += [
        "",
        "Same-seed differences of the evaluation loss (nats/char; negative: the first is better): mean ± "
        "standard error, median, and on how many seeds the first was lower.",
        "",
        "| comparison | mean ± s.e. | median | first lower | per seed |",
        "|---|---:|---:|---:|---|",
    ]
    for key, d in summary.get("pairs", {}).items():
        if d:
            a, b = key.split(" - ")
            lines.append(
                f"| {LABELS.get(a, a)} − {LABELS.get(b, b)} | {pm(d)} | {d['median']:+.4f} | "
                f"{d['lower']} of {d['n']} | {' '.join(f'{x:+.3f}' for x in d['diffs'])} |"
            )
    auto = [label for label in order(rows) if "allocation" in rows[label]]
    if auto:
        lines += [
            "",
            'bits="auto": the widths of the last refit, per tensor in the round\'s order '
            "(elements: " + ", ".join(map(str, rows[auto[0]]["allocation_elements"] or [])) + "), and their "
            "mean over the compressed coordinates, per seed.",
            "",
            "| method | seed | widths | mean bits |",
            "|---|---:|---|---:|",
        ]
        for label in auto:
            c = rows[label]
            for seed, widths in c["allocation"].items():
                lines.append(
                    f"| {label} | {seed} | {' '.join(map(str, widths))} | {c['allocated_mean_bits'][seed]:.3f} |"
                )
    return "\n".join(lines) + "\n"


def preamble(args, rows: dict) -> str:
    """What the table is: model, data, budget, workers, seeds, date."""
    first = json.loads(
        next(
            iter(
                sorted(
                    (Path(args.out_dir) / "data" / f"{stem(args)}_raw").glob(
                        f"np{args.np}_d*_t{args.steps}_b{args.batch_size}_*.json"
                    )
                )
            )
        ).read_text()
    )
    a = first["args"]
    optimizer = {
        "sgd": "SGD (momentum 0.9, no weight decay)",
        "adamw-frozen": f"AdamW (second moment frozen after step {a.get('freeze_step') or a['warmup']})",
    }.get(a.get("optimizer"), "AdamW")
    params = next(iter(next(iter(rows.values())).values()))["params"]
    return (
        f"# Held-out loss of a character-level GPT, every exchange\n\n"
        f"Command: `python -m scripts.study.run_accuracy_gpt` (grids and seeds as listed per row; "
        f"{time.strftime('%Y-%m-%d')}). GPT of scripts/common/gpt.py: {a['layers']} blocks of width {a['width']}, "
        f"{a['heads']} heads, context {a['context']}, {params:,} parameters, on Python's pydoc text "
        f"(90% train, the last 10% held out); {args.np} workers, {args.steps} {optimizer} steps (peak lr {a['lr']}, "
        f"{a['warmup']} warm-up, cosine to 10%), {args.batch_size} x {a['context']} characters per worker and "
        f"step; quantized methods at bucket {a['bucket_size']} with the compressors' defaults (max-abs buckets, "
        f"exchange auto: two-phase at 4 workers, refits at steps {a['update_steps']}). Evaluation loss on "
        f"{a['eval_windows']} fixed held-out windows after the last step; a seed fixes the initial model, the "
        f"batches and the rounding, so differences on one seed are paired. Bits/coord sent: the payload a "
        f"rank contributes per coordinate (uncompressed small tensors at 32).\n\n"
    )


def plot(summary: dict, path: Path, title: str) -> None:
    """Left: mean evaluation loss against step (learning curves). Right: the same-seed comparisons
    of PAIRS, mean ± 2 standard errors and every seed's difference."""
    plt = pages.pyplot()

    pairs = {k: d for k, d in summary.get("pairs", {}).items() if d}
    summary = {k: v for k, v in summary.items() if k != "pairs"}
    labels = order(summary)
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 4.6))
    for i, label in enumerate(labels):
        curve = summary[label]["curve"]
        ax.plot(
            [s for s, _ in curve], [v for _, v in curve], label=label, color=f"C{i % 10}", ls="-" if i < 10 else "--"
        )
    ax.set_xlabel("step")
    ax.set_ylabel("evaluation loss (nats/char), mean over seeds")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    for j, (key, d) in enumerate(pairs.items()):
        bx.errorbar([j], [d["mean"]], yerr=[2 * d["sem"]], fmt="o", capsize=4, color="C0")
        bx.plot([j + 0.15] * len(d["diffs"]), d["diffs"], "x", color="gray", ms=4)
    bx.set_xticks(
        range(len(pairs)),
        [k.replace(" - ", " − ").replace("none", "fp32") for k in pairs],
        rotation=45,
        ha="right",
        fontsize=7,
    )
    pages.finish_paired_plot(
        fig,
        bx,
        "eval loss difference, same seed (nats/char)",
        path,
        "same-seed comparisons: mean ± 2 s.e. (o), each seed (x)",
    )


def main(argv=None) -> int:
    args = parse_args(argv)
    out_dir = Path(args.out_dir)
    raw_dir = out_dir / "data" / f"{stem(args)}_raw"
    raw_dir.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    if not args.aggregate_only:
        jobs = launches(args)
        for k, job in enumerate(jobs):
            print(f"launch {k + 1}/{len(jobs)}: seed {job['seed']}: {','.join(job['methods'])}", flush=True)
            run_launch(job, args, raw_dir)
    rows = collect(raw_dir, args)
    if not rows:
        print("no results found", file=sys.stderr)
        return 1
    summary = summarize(rows)
    text = preamble(args, rows) + markdown(summary)
    (out_dir / "data" / f"{stem(args)}.json").write_text(
        json.dumps({"np": args.np, "steps": args.steps, "batch_size": args.batch_size, "summary": summary}, indent=2)
    )
    (out_dir / f"{stem(args)}.md").write_text(text)
    plot(
        summary,
        out_dir / f"{stem(args)}.png",
        f"GPT on pydoc text, {args.np} workers, {args.steps} steps of {args.batch_size} x 64 chars per worker",
    )
    print(text)
    if not args.aggregate_only:
        print(f"sweep wall-clock: {time.monotonic() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
