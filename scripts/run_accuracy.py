#!/usr/bin/env python
"""Accuracy sweep: final test accuracy of every method over several seeds and bucket sizes, each run
a real Horovod job of scripts/train.py (``mpirun -np 4 ... train.py --json``), aggregated into a
Markdown table (mean, standard deviation, min..max) and a PNG.

    python scripts/run_accuracy.py --out-dir docs            # the full sweep (long)
    python scripts/run_accuracy.py --quick --out-dir /tmp/q  # 2 ranks, 1 seed, 2 methods, 1 epoch

Every launch writes its own JSON under --raw-dir; a launch whose JSON already exists is skipped,
so an interrupted sweep resumes where it stopped, and ``--aggregate-only`` rebuilds the table and
the plot from what is there. fp32 (``none``) and ``fp16`` do not depend on the bucket size: they
run once per seed, in the launch of the first bucket size.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

from demo_common import BASELINES, QUANTIZED  # scripts/ is on sys.path when this runs as a script

ROOT = Path(__file__).resolve().parent.parent
TRAIN = ROOT / "scripts" / "train.py"
# Same single-host Open MPI options as tests/multiproc.py and the Makefile.
MPI_OPTIONS = ["--allow-run-as-root", "--oversubscribe", "--bind-to", "none",
               "--mca", "btl", "self,vader,tcp", "--mca", "btl_vader_single_copy_mechanism", "none",
               "--mca", "btl_tcp_if_include", "lo", "--mca", "oob_tcp_if_include", "lo"]
RANK_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
            "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
            "PYTHONWARNINGS": "ignore"}
LABELS = {"none": "fp32", "fp16": "fp16"}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--np", type=int, default=4, help="workers (ranks); default 4")
    p.add_argument("--seeds", default="0,1,2", help="comma-separated seeds; default 0,1,2")
    p.add_argument("--buckets", default="512,8192", help="bucket sizes; default 512,8192")
    p.add_argument("--bits", type=int, default=3, help="default 3")
    p.add_argument("--methods", default=",".join(QUANTIZED), help="quantized methods; default all")
    p.add_argument("--baselines", default=",".join(BASELINES), help="default none,fp16 ('' for none)")
    p.add_argument("--epochs", type=int, default=4, help="train.py --epochs; default 4")
    p.add_argument("--lr", type=float, default=None, help="train.py --lr (default: train.py's)")
    p.add_argument("--raw-dir", default=None, help="per-launch JSON files; default <out-dir>/accuracy_raw")
    p.add_argument("--out-dir", default="docs", help="accuracy.md, accuracy.json, accuracy.png go here")
    p.add_argument("--timeout", type=float, default=7200, help="seconds per launch; default 7200")
    p.add_argument("--aggregate-only", action="store_true", help="do not launch, only aggregate")
    p.add_argument("--quick", action="store_true", help="2 ranks, seed 0, alq+fp16, bucket 8192, 1 epoch")
    args = p.parse_args(argv)
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
        for i, bucket in enumerate(buckets):
            ms = methods + (baselines if i == 0 else [])
            if ms:
                out.append({"seed": seed, "bucket": bucket, "methods": ms})
    return out


def run_launch(job: dict, args, raw_dir: Path) -> Path:
    path = raw_dir / f"np{args.np}_b{args.bits}_d{job['bucket']}_s{job['seed']}_e{args.epochs}_{'-'.join(job['methods'])}.json"
    if path.exists():
        print(f"[skip] {path.name} exists", flush=True)
        return path
    cmd = ["mpirun", *MPI_OPTIONS, "-np", str(args.np), sys.executable, str(TRAIN),
           "--methods", ",".join(job["methods"]), "--bits", str(args.bits), "--bucket-size", str(job["bucket"]),
           "--epochs", str(args.epochs), "--seed", str(job["seed"]), "--quiet", "--json", str(path) + ".part"]
    if args.lr is not None:
        cmd += ["--lr", str(args.lr)]
    print(f"[run] {shlex.join(cmd)}", flush=True)
    start = time.monotonic()
    env = {**os.environ, **RANK_ENV}
    proc = subprocess.run(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=args.timeout)
    if proc.returncode != 0 or not Path(str(path) + ".part").exists():
        raise RuntimeError(f"launch failed (rc {proc.returncode}):\n{proc.stdout[-3000:]}")
    os.replace(str(path) + ".part", path)
    print(f"[done] {time.monotonic() - start:.0f} s\n{proc.stdout.strip().splitlines()[-len(job['methods']) - 1:]}", flush=True)
    return path


def collect(raw_dir: Path, args) -> dict:
    """{(method, bucket or None): [accuracy, ...]} over the JSON files matching np, bits and epochs."""
    table: dict = {}
    for path in sorted(raw_dir.glob(f"np{args.np}_b{args.bits}_d*_e{args.epochs}_*.json")):
        data = json.loads(path.read_text())
        for r in data["results"]:
            key = (r["method"], r["bucket_size"])
            table.setdefault(key, []).append((data["args"]["seed"], r["accuracy"]))
    return table


def aggregate(table: dict, args, out_dir: Path, wall: float | None) -> str:
    import numpy as np

    buckets = sorted({b for _, b in table if b is not None})
    methods = [m for m in QUANTIZED + BASELINES if any(k[0] == m for k in table)]
    rows, summary = [], {}
    for m in methods:
        cells = []
        for b in buckets:
            key = (m, None if m in BASELINES else b)
            acc = np.array([a for _, a in table.get(key, [])]) * 100
            if acc.size:
                summary[f"{m}@{key[1]}"] = {"n": int(acc.size), "mean": float(acc.mean()),
                                             "std": float(acc.std(ddof=1)) if acc.size > 1 else 0.0,
                                             "min": float(acc.min()), "max": float(acc.max())}
                s = summary[f"{m}@{key[1]}"]
                cells.append(f"{s['mean']:.2f} ± {s['std']:.2f} ({s['min']:.1f}..{s['max']:.1f}, n={s['n']})")
            else:
                cells.append("-")
            if m in BASELINES:
                break
        if m in BASELINES:
            cells = cells + ["(same)"] * (len(buckets) - 1)
        delta = "-"
        if m not in BASELINES and len(buckets) >= 2:
            a, z = summary.get(f"{m}@{buckets[0]}"), summary.get(f"{m}@{buckets[-1]}")
            if a and z:
                delta = f"{z['mean'] - a['mean']:+.2f}"
        rows.append(f"| {LABELS.get(m, m)} | " + " | ".join(cells) + f" | {delta} |")
    head = ("| method | " + " | ".join(f"bucket {b}" for b in buckets)
            + f" | change {buckets[0]}→{buckets[-1]} (points) |" if buckets else "| method |")
    lines = [head, "|---|" + "---|" * (len(buckets) + 1), *rows]
    text = "\n".join(lines) + "\n"
    (out_dir / "accuracy.json").write_text(json.dumps({"np": args.np, "bits": args.bits, "epochs": args.epochs,
                                                       "lr": args.lr, "wall_seconds": wall,
                                                       "summary": summary}, indent=2))
    (out_dir / "accuracy.md").write_text(text)
    plot(summary, methods, buckets, out_dir / "accuracy.png", args)
    return text


def plot(summary: dict, methods: list, buckets: list, path: Path, args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(9, 4.2))
    x = np.arange(len(methods))
    width = 0.8 / max(1, len(buckets))
    for i, b in enumerate(buckets):
        means, lo, hi, xs = [], [], [], []
        for j, m in enumerate(methods):
            s = summary.get(f"{m}@{None if m in BASELINES else b}")
            if not s or (m in BASELINES and i > 0):
                continue
            xs.append(j + (0 if m in BASELINES else (i - (len(buckets) - 1) / 2) * width))
            means.append(s["mean"])
            lo.append(s["mean"] - s["min"])
            hi.append(s["max"] - s["mean"])
        label = f"bucket {b}" if i or True else None
        ax.errorbar(xs, means, yerr=[lo, hi], fmt="o", capsize=4, label=f"bucket {b} (fp32/fp16: n/a)" if i == 0 else f"bucket {b}")
    ax.set_xticks(x, [LABELS.get(m, m) for m in methods])
    ax.set_ylabel("final test accuracy (%)")
    ax.set_title(f"MNIST digits, {args.np} workers, {args.bits} bits, {args.epochs} epochs: mean, min..max over seeds")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    args = parse_args(argv)
    out_dir = Path(args.out_dir)
    raw_dir = Path(args.raw_dir) if args.raw_dir else out_dir / "accuracy_raw"
    out_dir.mkdir(parents=True, exist_ok=True)
    raw_dir.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    if not args.aggregate_only:
        jobs = launches(args)
        for k, job in enumerate(jobs):
            print(f"launch {k + 1}/{len(jobs)}: seed {job['seed']}, bucket {job['bucket']}", flush=True)
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
