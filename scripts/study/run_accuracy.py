#!/usr/bin/env python
"""Accuracy sweeps over seeds, every launch a real Horovod job (mpirun -np 4), with same-seed
differences; what each grid runs and the results: docs/results/accuracy_cnn.md and
accuracy_transformer.md. Every launch writes its own JSON and is skipped when it exists (a sweep
resumes; --aggregate-only only rebuilds the outputs).

    python -m scripts.study.run_accuracy     # the demo CNN's test accuracy (build/results)
    python -m scripts.study.run_accuracy --model gpt --grid core   # the GPT's held-out loss
    python -m scripts.study.run_accuracy --quick --out-dir /tmp/q  # 2 ranks, 1 seed, 1 epoch
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

from scripts.common import launch
from scripts.common import report as pages
from scripts.common.demo import BASELINES, PLAIN, PRE, QUANTIZED
from scripts.study.feedback_switches import split, switched

BITS_FREE = ["terngrad"]  # always 2 bits on the wire: one run per seed whatever --bits says
TRAIN = {"cnn": "scripts.demo.train", "gpt": "scripts.demo.train_gpt"}  # run with python -m from the root
SWITCHES = "scripts.study.feedback_switches"  # the GPT demo with the studies' error-feedback switches
LABELS = {"none": "fp32", "fp16": "fp16", "terngrad": "TernGrad", "psgd2": "PowerSGD rank 2"}

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
    # fp32 alone: a learning-rate sweep (one --out-dir per --lr)
    "fp32": [["none"]],
}
# Same-seed comparisons shown in the second table, "row:against": the core grid; the wider grid (4 bits,
# norm-less forms, L2 buckets, allgather against two-phase); bits="auto"/"bucket" against fixed widths;
# error feedback against the same widths without it and against fp32.
PAIRS = [
    tuple(pair.split(":"))
    for pair in (
        "alq@3:qsgdinf@3 amq@3:qsgdinf@3 alq@2:qsgdinf@2 alq@2:terngrad alq@3:amq@3 alq@3:psgd-match "
        "amq@3:psgd-match alq@3:none amq@3:none psgd-match:none qsgdinf@3:none fp16:none alq@4:qsgdinf@4 "
        "alq-n@3:alq@3 amq-n@3:amq@3 alq@3:alq-l2@3 amq@3:amq-l2@3 alq-ag@3:alq@3 amq-ag@3:amq@3 "
        "qsgdinf-ag@3:qsgdinf@3 nuqsgd@3:qsgdinf@3 alq@auto2.5:alq@3 alq@auto3:alq@3 alq@auto2.5:alq@2 "
        "alq@bucket2.5:alq@3 alq@bucket3:alq@3 alq@bucket2.5:alq@auto2.5 alq@bucket2.5:alq@2 alq@bucket3:none "
        "alq@2:none alq@3+ef:alq@3 alq@2+ef:alq@2 alq@3+ef:none alq@2+ef:none alq@3+ef30:alq@3 alq@2+ef30:alq@2"
    ).split()
]


def parse_args(argv=None) -> argparse.Namespace:
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--model", choices=("cnn", "gpt"), default="cnn", help="the demo CNN or the GPT; default cnn")
    model = pre.parse_known_args(argv)[0].model
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, parents=[pre]
    )
    p.add_argument("--np", type=int, default=4, help="workers (ranks); default 4")
    p.add_argument("--seeds", default="0,1,2,3,4", help="comma-separated seeds; default 0,1,2,3,4")
    p.add_argument("--timeout", type=float, default=7200, help="seconds per launch; default 7200")
    p.add_argument("--aggregate-only", action="store_true", help="do not launch, only aggregate")
    name = "accuracy" if model == "cnn" else "accuracy_gpt"
    p.add_argument("--out-dir", default="build/results", help=f"{name}.md, .png; {name}.json and raw runs in data/")
    if model == "cnn":
        _cnn_options(p.add_argument)
    else:
        _gpt_options(p.add_argument)
    args = p.parse_args(argv)
    if model == "cnn":
        args.bits_list = [int(b) for b in str(args.bits).split(",") if b.strip()]
        if args.quick:
            args.np, args.seeds, args.buckets, args.methods, args.baselines = 2, "0", "8192", "alq", "fp16"
            args.epochs = 1
        return args
    if args.bucket_size is None:
        args.bucket_size = 1024 if args.grid == "bucket1024" else 8192
    if args.quick:
        args.np, args.seeds, args.steps = 2, "0", 20
    if args.lr is None and args.optimizer == "sgd":
        args.lr = 0.2
    return args


def _cnn_options(add) -> None:
    add("--buckets", default="512,8192", help="bucket sizes; default 512,8192")
    add("--bits", default="3", help="comma-separated bit widths; default 3")
    add("--methods", default=",".join(PLAIN), help="quantized methods (-ag/-2p: the exchange); default all")
    add("--baselines", default=",".join(BASELINES), help="default none,fp16 ('' for none)")
    add("--epochs", type=int, default=8, help="train.py --epochs; default 8 (248 steps at 4 workers)")
    add("--lr", type=float, default=None, help="train.py --lr (default: train.py's)")
    add("--optimizer", choices=("sgd", "adam"), default="sgd", help="train.py --optimizer; adam allows alq+pre")
    add("--raw-dir", default=None, help="per-launch JSON files; default <out-dir>/data/accuracy_raw")
    add("--tag", default="", help="suffix of the output names: accuracy<tag>.md etc.; default none")
    add("--quick", action="store_true", help="2 ranks, seed 0, alq+fp16, bucket 8192, 1 epoch")


def _gpt_options(add) -> None:
    add("--grid", default="core", choices=sorted(GRIDS), help="default core")
    add("--bucket-size", type=int, default=None, help="default 8192 (1024 for --grid bucket1024)")
    add("--steps", type=int, default=250, help="train_gpt.py --steps; default 250")
    add("--batch-size", type=int, default=8, help="train_gpt.py --batch-size; default 8")
    add("--optimizer", default="adamw", choices=("adamw", "adamw-frozen", "sgd"), help="train_gpt.py --optimizer")
    add("--lr", type=float, default=None, help="peak lr; default train_gpt.py's (AdamW) or 0.2 (SGD)")
    add("--quick", action="store_true", help="2 ranks, seed 0, 20 steps (core grid: alq@3, none, psgd-match)")


def paired(diffs: list) -> dict:
    """Mean, standard deviation, standard error, min, max and n of same-seed differences."""
    d = pages.stats(diffs)
    return {**d, "sem": d["std"] / math.sqrt(d["n"])}


# ------------------------------------------------------------------------------- the demo CNN


def cnn_launches(args) -> list[dict]:
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


def cnn_run_launch(job: dict, args, raw_dir: Path) -> None:
    opt = "" if args.optimizer == "sgd" else f"{args.optimizer}_"  # SGD's names as before --optimizer
    name = f"np{args.np}_b{job['bits']}_d{job['bucket']}_s{job['seed']}_e{args.epochs}_{opt}"
    name += f"{'-'.join(job['methods'])}.json"
    cmd = [*launch.mpirun(args.np), sys.executable, "-m", TRAIN["cnn"], "--methods", ",".join(job["methods"])]
    cmd += ["--bits", str(job["bits"]), "--bucket-size", str(job["bucket"]), "--epochs", str(args.epochs)]
    cmd += ["--seed", str(job["seed"]), "--quiet", "--json", "{json}"]
    if args.lr is not None:
        cmd += ["--lr", str(args.lr)]
    if args.optimizer != "sgd":
        cmd += ["--optimizer", args.optimizer]
    out = launch.resumable(cmd, raw_dir / name, args.timeout)
    if out:
        print("\n".join(out.strip().splitlines()[-len(job["methods"]) - 1 :]), flush=True)


def cnn_collect(raw_dir: Path, args) -> dict:
    """{(method, (bits, bucket) or None): [(seed, accuracy), ...]} over the JSON files matching np,
    the bit widths and epochs (TernGrad counts as 2 bits, what it sends)."""
    runs: dict = {}
    for bits in args.bits_list:
        for path in sorted(raw_dir.glob(f"np{args.np}_b{bits}_d*_e{args.epochs}_*.json")):
            data = json.loads(path.read_text())
            if args.lr is not None and data["args"]["lr"] != args.lr:
                print(f"[skip] {path.name}: lr {data['args']['lr']}, not {args.lr}", flush=True)
                continue
            if data["args"].get("optimizer", "sgd") != args.optimizer:
                continue  # another optimizer's run (the raw files of SGD predate --optimizer)
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
    known = [v for m in QUANTIZED for v in (m, m + PRE)] + BASELINES
    methods = [m for m in known if any(k[0] == m for k in table)]
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
                cell["vs_fp32"] = paired(diffs)
            # the same method with the allgather exchange, the paper's L2 buckets, without preconditioning
            for key, suffix, other in (
                ("vs_allgather", "-2p", "-ag"),
                ("vs_l2", "-linf", "-l2"),
                ("vs_plain", PRE, ""),
            ):
                ref = dict(table.get((m[: -len(suffix)] + other, c), [])) if m.endswith(suffix) else {}
                pairs = [100 * (a - ref[seed]) for seed, a in runs if seed in ref]
                if pairs:
                    cell[key] = paired(pairs)
                    if key == "vs_plain":
                        cell[key].update(higher=sum(x > 0 for x in pairs), diffs=pairs)
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
    for key, title, row_label in (
        ("vs_l2", "Max-abs minus L2 buckets", lambda m: f"{m[:-5]}: linf − l2"),
        ("vs_allgather", "Two-phase minus allgather exchange", lambda m: f"{m[:-3]}: 2p − ag"),
        (
            "vs_plain",
            "Preconditioned minus plain (higher: on how many seeds +pre was more accurate)",
            lambda m: f"{m[: -len(PRE)]}: +pre − plain",
        ),
    ):
        lines += _same_seed_table(summary, methods, configs, labels, key, title, row_label)
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
        cells.append([row_label(m)] + [_diff(d) for d in diffs])
    lines += pages.table(["method", *labels], cells)
    return lines


def _diff(d: dict | None) -> str:
    """``mean ± s.e.``, with the count of seeds where the first was higher when known."""
    if not d:
        return "-"
    return f"{d['mean']:+.2f} ± {d['sem']:.2f}" + (f" (higher {d['higher']} of {d['n']})" if "higher" in d else "")


def cnn_aggregate(table: dict, args, out_dir: Path, wall: float | None) -> str:
    methods, configs, summary = summarize(table)
    text = markdown(methods, configs, summary)
    data = dict(np=args.np, bits=args.bits_list, epochs=args.epochs, lr=args.lr, optimizer=args.optimizer)
    data.update(wall_seconds=wall, summary=summary)
    (out_dir / "data" / f"accuracy{args.tag}.json").write_text(json.dumps(data, indent=2))
    (out_dir / f"accuracy{args.tag}.md").write_text(text)
    cnn_plot(summary, methods, configs, out_dir / f"accuracy{args.tag}.png", args)
    return text


#: the mark of a method whose accuracy falls below the difference plot's scale
COLLAPSED = dict(xytext=(0, 6), textcoords="offset points", rotation=90, ha="center", va="bottom", fontsize=8)


def cnn_plot(summary: dict, methods: list, configs: list, path: Path, args) -> None:
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
                bx.annotate("collapsed", (j + shift, -limit), color=color, **COLLAPSED)
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


# ------------------------------------------------------------------------------- the GPT
def stem(args) -> str:
    """The outputs' name: accuracy_gpt, or accuracy_gpt_sgd for SGD runs."""
    return "accuracy_gpt" if args.optimizer == "adamw" else f"accuracy_gpt_{args.optimizer}"


def optimizer_args(args) -> list[str]:
    """train_gpt.py's optimizer arguments for this sweep."""
    out = {"adamw": [], "adamw-frozen": ["--optimizer", "adamw-frozen"]}.get(
        args.optimizer, ["--optimizer", args.optimizer, "--weight-decay", "0"]
    )
    return out + ([] if args.lr is None else ["--lr", repr(args.lr)])


def gpt_launches(args) -> list[dict]:
    grid = [["alq@3", "none", "psgd-match"]] if args.quick and args.grid == "core" else GRIDS[args.grid]
    return [{"seed": int(s), "methods": ms} for s in args.seeds.split(",") if s.strip() for ms in grid]


def raw_path(job: dict, args, raw_dir: Path) -> Path:
    """The launch's JSON: a method spec's ``@`` as ``b`` and a budget's ``.`` as ``p`` (``alq@auto2.5``:
    ``alqbauto2p5``)."""
    return raw_dir / (
        f"np{args.np}_d{args.bucket_size}_s{job['seed']}_t{args.steps}_b{args.batch_size}_"
        f"{'-'.join(m.replace('@', 'b').replace('.', 'p').replace('+', 'p') for m in job['methods'])}.json"
    )


def gpt_run_launch(job: dict, args, raw_dir: Path) -> None:
    module = SWITCHES if any(switched(m) for m in job["methods"]) else TRAIN["gpt"]
    cmd = [*launch.mpirun(args.np), sys.executable, "-m", module, "--methods", ",".join(job["methods"])]
    cmd += ["--seed", str(job["seed"]), "--steps", str(args.steps), "--batch-size", str(args.batch_size)]
    cmd += ["--bucket-size", str(args.bucket_size), "--json", "{json}", *optimizer_args(args)]
    out = launch.resumable(cmd, raw_path(job, args, raw_dir), args.timeout)
    if out:
        print("\n".join(ln for ln in out.splitlines() if "eval loss" in ln), flush=True)


def gpt_collect(raw_dir: Path, args) -> dict:
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
    ordered = sorted(diffs)
    median = (ordered[(len(ordered) - 1) // 2] + ordered[len(ordered) // 2]) / 2
    return {**paired(diffs), "median": median, "lower": sum(x < 0 for x in diffs), "diffs": diffs}


def gpt_summarize(rows: dict) -> dict:
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
        spec, start = split(spec)
        name, _, bits = spec.partition("@")
        feedback = -1 if start is None else start
        rank = {"none": 0, "fp16": 1}.get(name, 3 if name.startswith("psgd") else 2)
        auto = bits.startswith(("auto", "bucket"))
        return (rank, -float(bits.removeprefix("auto").removeprefix("bucket") or 0), bucket, auto, feedback, name)

    return sorted(labels, key=key)


def gpt_markdown(summary: dict) -> str:
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
    raw = Path(args.out_dir) / "data" / f"{stem(args)}_raw"
    first = json.loads(min(raw.glob(f"np{args.np}_d*_t{args.steps}_b{args.batch_size}_*.json")).read_text())
    a = first["args"]
    optimizer = {
        "sgd": "SGD (momentum 0.9, no weight decay)",
        "adamw-frozen": f"AdamW (second moment frozen after step {a.get('freeze_step') or a['warmup']})",
    }.get(a.get("optimizer"), "AdamW")
    params = next(iter(next(iter(rows.values())).values()))["params"]
    return (
        f"# Held-out loss of a character-level GPT, every exchange\n\n"
        f"Command: `python -m scripts.study.run_accuracy --model gpt` (grids and seeds as listed per row; "
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


def gpt_plot(summary: dict, path: Path, title: str) -> None:
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


def gpt_aggregate(rows: dict, args, out_dir: Path, wall: float | None) -> str:
    summary = gpt_summarize(rows)
    text = preamble(args, rows) + gpt_markdown(summary)
    (out_dir / "data" / f"{stem(args)}.json").write_text(
        json.dumps({"np": args.np, "steps": args.steps, "batch_size": args.batch_size, "summary": summary}, indent=2)
    )
    (out_dir / f"{stem(args)}.md").write_text(text)
    gpt_plot(
        summary,
        out_dir / f"{stem(args)}.png",
        f"GPT on pydoc text, {args.np} workers, {args.steps} steps of {args.batch_size} x 64 chars per worker",
    )
    return text


MODELS = {
    "cnn": (cnn_launches, cnn_run_launch, cnn_collect, cnn_aggregate),
    "gpt": (gpt_launches, gpt_run_launch, gpt_collect, gpt_aggregate),
}


def main(argv=None) -> int:
    args = parse_args(argv)
    launches, run_launch, collect, aggregate = MODELS[args.model]
    out_dir = Path(args.out_dir)
    if args.model == "cnn":
        raw_dir = Path(args.raw_dir) if args.raw_dir else out_dir / "data" / "accuracy_raw"
    else:
        raw_dir = out_dir / "data" / f"{stem(args)}_raw"
    (out_dir / "data").mkdir(parents=True, exist_ok=True)
    raw_dir.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    if not args.aggregate_only:
        jobs = launches(args)
        for k, job in enumerate(jobs):
            what = f"bits {job['bits']}, bucket {job['bucket']}" if args.model == "cnn" else ",".join(job["methods"])
            print(f"launch {k + 1}/{len(jobs)}: seed {job['seed']}: {what}", flush=True)
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
