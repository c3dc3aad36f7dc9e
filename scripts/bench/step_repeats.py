#!/usr/bin/env python
"""Ranges over repeated runs of scripts/bench/train_step.py: each row's step as a ratio to a
reference row of the same run (rows interleaved in one launch, so the ratio cancels what the
machine's load does to both), per node layout and rate, min, median and max over the runs, with
the bytes that crossed between nodes (interface counters, median), and the issue's step targets.

    python -m scripts.bench.step_repeats build/steps/run*.json --out build/bench_train_step_repeats.md

(its report is folded into docs/results/bench_train_step.md#repeats)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

#: The ratios reported for each row: to fp16 of its framework, and hierarchical to flat two-phase.
REFERENCE = {"hvd": "hvd-fp16", "ddp": "ddp-fp16"}
FLAT = {"hvd": "hvd-alq-2p", "ddp": "ddp-alq-2p"}
#: Targets (issue 41) at 2 nodes x 2 ranks: (row, reference, rate, at most).
TARGETS = [
    ("hvd-alq-h", "hvd-alq-2p", "1gbit", 0.8),
    ("hvd-alq-h", "hvd-fp16", "1gbit", 1.0),
    ("hvd-alq-h", "hvd-fp16-hier", "1gbit", 1.0),
    ("hvd-alq-h", "hvd-fp16", "100mbit", 0.35),
    ("hvd-alq-h", "hvd-fp16-hier", "100mbit", 0.35),
    ("ddp-alq-h", "ddp-alq-2p", "1gbit", 0.8),
    ("ddp-alq-h", "ddp-fp16", "1gbit", 1.0),
    ("ddp-alq-h", "ddp-fp16", "100mbit", 0.35),
]


def load(paths: list[Path]) -> dict:
    """(layout, rate) -> row -> a list over runs of (step s, ratio to fp16, ratio to flat two-phase,
    bytes between nodes per step); also the rows' labels and each run's date."""
    table: dict = {}
    labels: dict = {}
    for path in paths:
        data = json.loads(path.read_text())
        for run in data["runs"]:
            res = run["run"]["results"]
            layout = f"{run.get('nodes') or run['workers']}x{run.get('ranks_per_node') or 1}"
            cell = table.setdefault((layout, run["rate"]), {})
            for key, r in res.items():
                labels[key] = r["label"]
                fw = key.split("-")[0]
                ref, flat = res.get(REFERENCE.get(fw, "")), res.get(FLAT.get(fw, ""))
                step = scaled(r, res)
                cell.setdefault(key, []).append(
                    (
                        step,
                        step / ref["step_s"] if ref else None,
                        step / flat["step_s"] if flat else None,
                        r.get("link_tx_per_step"),
                    )
                )
    return {"table": table, "labels": labels}


def scaled(row: dict, results: dict) -> float:
    """A row's step; for a row of its own launch (``own_local_s``: that launch's step alone), scaled
    by this launch's step alone over that one, so that ratios to this launch's rows compare
    step / alone (launches of different processes run at different speeds on shared cores)."""
    own, here = row.get("own_local_s"), results.get("local", {}).get("step_s")
    return row["step_s"] * here / own if own and here else row["step_s"]


def span(values: list) -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.2f}"
    return f"{min(values):.2f} / {statistics.median(values):.2f} / {max(values):.2f}"


def report(data: dict, paths: list[Path], argv: list[str]) -> str:
    table, labels = data["table"], data["labels"]
    runs = max(len(v) for cell in table.values() for v in cell.values())
    out = [
        "# Full training step across nodes: ranges over repeated runs",
        "",
        f"Command: `python -m scripts.bench.step_repeats {' '.join(argv)}`, over {len(paths)} runs of "
        "scripts/bench/train_step.py (their commands and dates in each JSON's `argv` and on the pages they "
        "wrote). Each cell: min / median / max over the runs of a ratio made inside one run (rows "
        "interleaved in the same processes), so the machine's load moves both sides of it; a row of its "
        "own launch (a process-wide setting) is scaled by the two launches' steps alone (step / alone "
        "against step / alone).",
        "",
    ]
    for (layout, rate), cell in sorted(table.items()):
        out += [
            f"## {layout.replace('x', ' nodes x ', 1)} ranks, {rate} ({runs} runs)",
            "",
            "| row | step ms (median) | vs fp16 | vs flat two-phase ALQ | MB between nodes / step (median) |",
            "|---|---:|---:|---:|---:|",
        ]
        for key, vals in cell.items():
            steps = [v[0] for v in vals]
            mb = [v[3] / 1e6 for v in vals if v[3] is not None]
            out.append(
                f"| {labels[key]} | {1e3 * statistics.median(steps):.0f} | {span([v[1] for v in vals])} | "
                f"{span([v[2] for v in vals]) if key.startswith(('hvd-alq', 'ddp-alq')) else '-'} | "
                f"{statistics.median(mb):.3f} |"
                if mb
                else f"| {labels[key]} | {1e3 * statistics.median(steps):.0f} | {span([v[1] for v in vals])} | - | - |"
            )
        out.append("")
    out += [
        "## Targets at 2 nodes x 2 ranks",
        "",
        "Floor: the step with no exchange at all (the 'alone' row) over the reference, per run: no "
        "exchange can take a step below it on these cores.",
        "",
        "| row | against | rate | target | runs meeting it | ratios | floor |",
        "|---|---|---|---:|---:|---|---|",
    ]
    for row, ref, rate, bound in TARGETS:
        cell = table.get(("2x2", rate), {})
        if row not in cell or ref not in cell:
            continue
        ratios = [a[0] / b[0] for a, b in zip(cell[row], cell[ref])]
        floor = [a[0] / b[0] for a, b in zip(cell.get("local", []), cell[ref])]
        out.append(
            f"| {labels[row]} | {labels[ref]} | {rate} | at most {bound:g}x | {sum(r <= bound for r in ratios)} of "
            f"{len(ratios)} | {', '.join(f'{r:.2f}' for r in ratios)} | {', '.join(f'{r:.2f}' for r in floor)} |"
        )
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", help="train_step JSON files")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    paths = [Path(x) for x in args.runs]
    text = report(load(paths), paths, argv)
    Path(args.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
