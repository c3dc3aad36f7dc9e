#!/usr/bin/env python
"""Accuracy sweep: final test accuracy of every method over several seeds and bucket sizes, each run
a real Horovod job of scripts/demo/train.py (``mpirun -np 4 ... -m scripts.demo.train --json``), aggregated into a
Markdown table (mean, standard deviation, min..max; and the same-seed difference to fp32, mean and
standard error) and a PNG.

    python -m scripts.study.run_accuracy     # the full sweep (~18 min on 2 cores), into build/results
    python -m scripts.study.run_accuracy --quick --out-dir /tmp/q  # 2 ranks, 1 seed, 2 methods, 1 epoch
    python -m scripts.study.run_accuracy --bits 2,3 --buckets 8192 --tag _norm --baselines none \
        --methods alq-l2,alq-linf,amq-l2,amq-linf,qsgdinf,terngrad   # bucket norms
    python -m scripts.study.run_accuracy --buckets 8192 --methods alq-ag,alq-2p --baselines none \
        --tag _exchange   # allgather vs two-phase exchange (-ag / -2p suffixes)

Every launch writes its own JSON under --raw-dir; a launch whose JSON already exists is skipped,
so an interrupted sweep resumes where it stopped, and ``--aggregate-only`` rebuilds the table and
the plot from what is there. fp32 (``none``) and ``fp16`` do not depend on the bucket size: they
run once per seed, in the launch of the first bucket size (and first bit width); so does TernGrad
(always 2 bits) when several bit widths are swept.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from scripts.common import launch
from scripts.common import report as pages
from scripts.common.demo import BASELINES, PLAIN, QUANTIZED

BITS_FREE = ["terngrad"]  # always 2 bits on the wire: one run per seed whatever --bits says

ROOT = Path(__file__).resolve().parents[2]
TRAIN = "scripts.demo.train"  # run with python -m from ROOT
LABELS = {"none": "fp32", "fp16": "fp16"}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--np", type=int, default=4, help="workers (ranks); default 4")
    p.add_argument("--seeds", default="0,1,2,3,4", help="comma-separated seeds; default 0,1,2,3,4")
    p.add_argument("--buckets", default="512,8192", help="bucket sizes; default 512,8192")
    p.add_argument("--bits", default="3", help="comma-separated bit widths; default 3")
    p.add_argument(
        "--methods",
        default=",".join(PLAIN),
        help="quantized methods; default all, each with the compressor's default exchange; "
        "-ag / -2p appended: the allgather / two-phase exchange (alq-ag,alq-2p)",
    )
    p.add_argument("--baselines", default=",".join(BASELINES), help="default none,fp16 ('' for none)")
    p.add_argument("--epochs", type=int, default=8, help="train.py --epochs; default 8 (248 steps at 4 workers)")
    p.add_argument("--lr", type=float, default=None, help="train.py --lr (default: train.py's)")
    p.add_argument("--raw-dir", default=None, help="per-launch JSON files; default <out-dir>/data/accuracy_raw")
    p.add_argument(
        "--out-dir",
        default="build/results",
        help="accuracy.md and accuracy.png go here, accuracy.json and the raw runs to its data/; default build/results",
    )
    p.add_argument("--tag", default="", help="suffix of the output names: accuracy<tag>.md etc.; default none")
    p.add_argument("--timeout", type=float, default=7200, help="seconds per launch; default 7200")
    p.add_argument("--aggregate-only", action="store_true", help="do not launch, only aggregate")
    p.add_argument("--quick", action="store_true", help="2 ranks, seed 0, alq+fp16, bucket 8192, 1 epoch")
    args = p.parse_args(argv)
    args.bits_list = [int(b) for b in str(args.bits).split(",") if b.strip()]
    if args.quick:
        args.np, args.seeds, args.buckets, args.methods, args.baselines, args.epochs = 2, "0", "8192", "alq", "fp16", 1
    return args


def launches(args) -> list[dict]:
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    buckets = [int(b) for b in args.buckets.split(",") if b.strip()]
    methods = [m for m in args.methods.split(",") if m.strip()]
    baselines = [m for m in args.baselines.split(",") if m.strip()]
    out = []
    for seed in seeds:
        for k, bits in enumerate(args.bits_list):
            for i, bucket in enumerate(buckets):
                ms = [m for m in methods if k == 0 or m not in BITS_FREE] + (baselines if i == 0 and k == 0 else [])
                if ms:
                    out.append({"seed": seed, "bits": bits, "bucket": bucket, "methods": ms})
    return out


def run_launch(job: dict, args, raw_dir: Path) -> None:
    name = f"np{args.np}_b{job['bits']}_d{job['bucket']}_s{job['seed']}_e{args.epochs}_{'-'.join(job['methods'])}.json"
    cmd = [*launch.mpirun(args.np), sys.executable, "-m", TRAIN, "--methods", ",".join(job["methods"])]
    cmd += ["--bits", str(job["bits"]), "--bucket-size", str(job["bucket"]), "--epochs", str(args.epochs)]
    cmd += ["--seed", str(job["seed"]), "--quiet", "--json", "{json}"]
    if args.lr is not None:
        cmd += ["--lr", str(args.lr)]
    out = launch.resumable(cmd, raw_dir / name, args.timeout)
    if out:
        print("\n".join(out.strip().splitlines()[-len(job["methods"]) - 1 :]), flush=True)


def collect(raw_dir: Path, args) -> dict:
    """{(method, (bits, bucket) or None): [(seed, accuracy), ...]} over the JSON files matching np,
    the bit widths and epochs (TernGrad counts as 2 bits, what it sends)."""
    runs: dict = {}
    for bits in args.bits_list:
        for path in sorted(raw_dir.glob(f"np{args.np}_b{bits}_d*_e{args.epochs}_*.json")):
            data = json.loads(path.read_text())
            if args.lr is not None and data["args"]["lr"] != args.lr:
                print(f"[skip] {path.name}: lr {data['args']['lr']}, not {args.lr}", flush=True)
                continue
            for r in data["results"]:
                config = None
                if r["bucket_size"] is not None:
                    config = (2 if r["method"] in BITS_FREE else bits, r["bucket_size"])
                key = (r["method"], config, data["args"]["seed"])
                if key in runs:
                    raise ValueError(f"{path.name} repeats {key} (method, (bits, bucket), seed) of another raw file")
                runs[key] = r["accuracy"]
    table: dict = {}
    for (method, config, seed), accuracy in sorted(runs.items(), key=lambda kv: kv[0][2]):
        table.setdefault((method, config), []).append((seed, accuracy))
    return table


_ONE_BIT_WIDTH = [True]  # set by summarize(): keys name the bucket only, as before --bits took a list


def _key(method: str, config) -> str:
    if config is None:
        return f"{method}@None"
    return f"{method}@{config[1]}" if _ONE_BIT_WIDTH[0] else f"{method}@b{config[0]}d{config[1]}"


def _config_label(config, configs) -> str:
    bits = {c[0] for c in configs}
    return f"bucket {config[1]}" if len(bits) == 1 else f"{config[0]} bits, d={config[1]}"


def summarize(table: dict) -> tuple[list, list, dict]:
    """Methods, (bits, bucket) configurations and, per ``method@b<bits>d<bucket>`` (one bit width:
    ``method@<bucket>``), accuracy
    statistics (percent) over seeds plus ``vs_fp32``: the same-seed difference to fp32 (seeds fix
    the initial model and the data order, so pairing removes most of the seed-to-seed spread)."""
    configs = sorted({c for m, c in table if c is not None and m not in BITS_FREE})
    if not configs:
        configs = sorted({c for _, c in table if c is not None})
    _ONE_BIT_WIDTH[0] = len({c[0] for c in configs}) == 1
    methods = [m for m in QUANTIZED + BASELINES if any(k[0] == m for k in table)]
    reference = {seed: 100 * a for seed, a in table.get(("none", None), [])}
    summary = {}
    for m in methods:
        for c in [None] if m in BASELINES else sorted({k[1] for k in table if k[0] == m}):
            runs = table.get((m, c), [])
            if not runs:
                continue
            cell = pages.stats([100 * a for _, a in runs])
            diffs = [100 * a - reference[seed] for seed, a in runs if seed in reference]
            if diffs and m != "none":
                d = pages.stats(diffs)
                cell["vs_fp32"] = {**d, "sem": d["std"] / d["n"] ** 0.5}
            if m.endswith("-2p") and (m[:-3] + "-ag", c) in table:  # same method, the allgather exchange
                ag = dict(table[(m[:-3] + "-ag", c)])
                pairs = [100 * (a - ag[seed]) for seed, a in runs if seed in ag]
                if pairs:
                    d = pages.stats(pairs)
                    cell["vs_allgather"] = {**d, "sem": d["std"] / d["n"] ** 0.5}
            if m.endswith("-linf") and (m[:-5] + "-l2", c) in table:  # same method, the paper's L2 buckets
                l2 = dict(table[(m[:-5] + "-l2", c)])
                pairs = [100 * (a - l2[seed]) for seed, a in runs if seed in l2]
                if pairs:
                    d = pages.stats(pairs)
                    cell["vs_l2"] = {**d, "sem": d["std"] / d["n"] ** 0.5}
            summary[_key(m, c)] = cell
    return methods, configs, summary


def _cell_key(m: str, c, summary: dict) -> str | None:
    """The summary key shown for method ``m`` in column ``c`` (TernGrad: its 2-bit run at that bucket)."""
    if m in BITS_FREE and _key(m, c) not in summary:
        return _key(m, (2, c[1])) if _key(m, (2, c[1])) in summary else None
    return _key(m, c)


def markdown(methods: list, configs: list, summary: dict) -> str:
    def acc(s):
        return f"{s['mean']:.2f} ± {s['std']:.2f} ({s['min']:.1f}..{s['max']:.1f}, n={s['n']})" if s else "-"

    def paired(s):
        d = (s or {}).get("vs_fp32")
        return f"{d['mean']:+.2f} ± {d['sem']:.2f}" if d else "-"

    def shown(m, c, fmt):
        k = _cell_key(m, c, summary)
        if k is None:
            return "-"
        text = fmt(summary.get(k))
        return text if k == _key(m, c) or single_bits else f"(2 bits) {text}"

    labels = [_config_label(c, configs) for c in configs]
    single_bits = len({c[0] for c in configs}) == 1
    change = single_bits and len(configs) > 1
    cells = []
    for m in methods:
        if m in BASELINES:
            row = [acc(summary.get(f"{m}@None"))] + ["(same)"] * (len(configs) - 1)
            delta = "-"
        else:
            row = [shown(m, c, acc) for c in configs]
            a, z = (summary.get(_cell_key(m, c, summary) or "") for c in (configs[0], configs[-1]))
            delta = f"{z['mean'] - a['mean']:+.2f}" if a and z else "-"
        cells.append([LABELS.get(m, m), *row] + ([delta] if change else []))
    head = ["method", *labels] + ([f"change {configs[0][1]}→{configs[-1][1]}"] if change else [])
    lines = pages.table(head, cells)
    lines += ["", "Difference to fp32 on the same seed (points): mean ± standard error over seeds.", ""]
    cells = [
        [LABELS.get(m, m)]
        + ([paired(summary.get(f"{m}@None"))] if m in BASELINES else [shown(m, c, paired) for c in configs])
        for m in methods
        if m != "none"
    ]
    lines += pages.table(["method", *labels], cells)
    lines += _same_seed_table(
        summary, methods, configs, labels, "vs_l2", "Max-abs minus L2 buckets", lambda m: f"{m[:-5]}: linf − l2"
    )
    lines += _same_seed_table(
        summary,
        methods,
        configs,
        labels,
        "vs_allgather",
        "Two-phase minus allgather exchange",
        lambda m: f"{m[:-3]}: 2p − ag",
    )
    return "\n".join(lines) + "\n"


def _same_seed_table(summary, methods, configs, labels, key: str, title: str, row_label) -> list[str]:
    """Lines of a table of same-seed differences ``key`` (mean ± standard error over seeds) for the
    methods that have one; none if no method has."""
    rows = [m for m in methods if any(key in summary.get(_key(m, c), {}) for c in configs)]
    if not rows:
        return []
    lines = ["", f"{title}, same method and seed (points): mean ± standard error over seeds.", ""]
    cells = []
    for m in rows:
        diffs = [summary.get(_key(m, c), {}).get(key) for c in configs]
        cells.append([row_label(m)] + [f"{d['mean']:+.2f} ± {d['sem']:.2f}" if d else "-" for d in diffs])
    lines += pages.table(["method", *labels], cells)
    return lines


def aggregate(table: dict, args, out_dir: Path, wall: float | None) -> str:
    methods, configs, summary = summarize(table)
    text = markdown(methods, configs, summary)
    (out_dir / "data" / f"accuracy{args.tag}.json").write_text(
        json.dumps(
            {
                "np": args.np,
                "bits": args.bits_list,
                "epochs": args.epochs,
                "lr": args.lr,
                "wall_seconds": wall,
                "summary": summary,
            },
            indent=2,
        )
    )
    (out_dir / f"accuracy{args.tag}.md").write_text(text)
    plot(summary, methods, configs, out_dir / f"accuracy{args.tag}.png", args)
    return text


def plot(summary: dict, methods: list, configs: list, path: Path, args) -> None:
    """Left: accuracy, mean and min..max over seeds. Right: same-seed difference to fp32, mean ± 2
    standard errors, on a scale where the working methods are visible (collapsed ones are marked)."""
    plt = pages.pyplot()
    import numpy as np

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 4.4))
    x = np.arange(len(methods))
    width = 0.8 / max(1, len(configs))
    series = [
        (_config_label(c, configs), c, (i - (len(configs) - 1) / 2) * width, f"C{i}") for i, c in enumerate(configs)
    ]
    series.append(("fp32 / fp16 (no buckets)", None, 0.0, "gray"))
    limit = 4.0
    for label, config, shift, color in series:
        xs, means, lo, hi, dxs, dmeans, derr = [], [], [], [], [], [], []
        for j, m in enumerate(methods):
            if (m in BASELINES) != (config is None):
                continue
            key = _key(m, None) if config is None else _key(m, config)
            s = summary.get(key)
            if not s:
                continue
            xs.append(j + shift)
            means.append(s["mean"])
            lo.append(s["mean"] - s["min"])
            hi.append(s["max"] - s["mean"])
            d = s.get("vs_fp32")
            if d and d["mean"] > -limit:
                dxs.append(j + shift)
                dmeans.append(d["mean"])
                derr.append(2 * d["sem"])
            elif d:
                bx.annotate(
                    "collapsed",
                    (j + shift, -limit),
                    xytext=(0, 6),
                    textcoords="offset points",
                    rotation=90,
                    ha="center",
                    va="bottom",
                    color=color,
                    fontsize=8,
                )
        if xs:
            ax.errorbar(xs, means, yerr=[lo, hi], fmt="o", capsize=4, label=label, color=color)
        if dxs:
            bx.errorbar(dxs, dmeans, yerr=derr, fmt="o", capsize=4, label=label, color=color)
    ax.set_xticks(x, [LABELS.get(m, m) for m in methods], rotation=30)
    ax.set_ylabel("final test accuracy (%)")
    bits = ",".join(str(b) for b in args.bits_list)
    ax.set_title(f"{args.np} workers, {bits} bits, {args.epochs} epochs: mean, min..max over seeds", fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(loc="lower left", fontsize=8)
    bx.set_ylim(-limit, limit)
    bx.set_xticks(x, [LABELS.get(m, m) for m in methods], rotation=30)
    pages.finish_paired_plot(fig, bx, "accuracy − fp32, same seed (points)", path)


def main(argv=None) -> int:
    args = parse_args(argv)
    out_dir = Path(args.out_dir)
    raw_dir = Path(args.raw_dir) if args.raw_dir else out_dir / "data" / "accuracy_raw"
    (out_dir / "data").mkdir(parents=True, exist_ok=True)
    raw_dir.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    if not args.aggregate_only:
        jobs = launches(args)
        for k, job in enumerate(jobs):
            print(
                f"launch {k + 1}/{len(jobs)}: seed {job['seed']}, bits {job['bits']}, bucket {job['bucket']}",
                flush=True,
            )
            run_launch(job, args, raw_dir)
    wall = None if args.aggregate_only else time.monotonic() - start
    table = collect(raw_dir, args)
    if not table:
        print("no results found", file=sys.stderr)
        return 1
    print(aggregate(table, args, out_dir, wall))
    if wall is not None:
        print(f"sweep wall-clock: {wall:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
