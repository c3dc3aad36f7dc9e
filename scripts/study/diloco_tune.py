#!/usr/bin/env python
"""DiLoCo with a tuned fp32 baseline first, then the quantizers at its optimum (issue 54), a driver
of scripts.study.diloco: stages ``sweep`` (fp32 at H = 50 over outer lr x momentum), ``horizon``
(the best pair at H = 10, 100), ``quant`` (the quantizers there) and ``report`` (the tables of
docs/results/diloco_study.md#tuned). Launches write ``<out-dir>/raw/<stage>_seed<k>.json``; rows a
seed already has there are not run again.

    python -m scripts.study.diloco_tune --stage sweep --out-dir build/diloco_tuned
    python -m scripts.study.diloco_tune --stage report --out-dir build/diloco_tuned
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from scripts.common import report as pages
from scripts.study import diloco

QUANT = ("fp32", "int8", "qsgdinf2", "alq2", "alq3", "alq4", "alq2-ef")
#: The arguments a DP reference's raw file must share with this study's launches.
SHARED = ("steps", "batch_size", "context", "width", "layers", "heads", "lr", "warmup", "weight_decay")
SHARED += ("eval_windows",)
LRS, MOMENTA = (0.3, 0.5, 0.7, 1.0), (0.0, 0.9)  # the sweep's outer learning rates and Nesterov momenta
H, HORIZONS = 50, (10, 100)  # the sweep's and the quantizers' H; the horizon stage's
DP_RAW = Path("docs/results/data/diloco_study_raw")  # dp-fp16's raw files


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stage", required=True, choices=("sweep", "horizon", "quant", "report"))
    p.add_argument("--out-dir", default="build/diloco_tuned", help="default build/diloco_tuned")
    p.add_argument("--seeds", default="0", help="the quant stage's seeds; default 0")
    return p.parse_args(argv)


def name(kind: str, lr: float, mu: float, h: int = 50) -> str:
    return f"h{h}-{kind}@lr{lr:g}@m{mu:g}"


def load_all(raw: Path) -> dict[int, dict]:
    """Every seed's results across the stage files: {seed: {row: result}}, and the launch args."""
    runs: dict[int, dict] = {}
    for path in sorted(raw.glob("*_seed*.json")):
        data = json.loads(path.read_text())
        seed = int(data["args"]["seed"])
        runs.setdefault(seed, {"args": data["args"], "results": {}})["results"].update(data["results"])
    return runs


def sweep_rows() -> list[str]:
    return [name("fp32", lr, mu, H) for lr in LRS for mu in MOMENTA]


def tuned(runs: dict) -> tuple[float, float]:
    """The tuned pair: the sweep's row with the lowest held-out loss."""
    sweep = {r: runs[0]["results"][r] for r in sweep_rows() if r in runs.get(0, {}).get("results", {})}
    if not sweep:
        raise SystemExit("no sweep results: run --stage sweep first")
    best = min(sweep, key=lambda r: sweep[r]["final_loss"])
    return sweep[best]["outer_lr"], sweep[best]["outer_momentum"]


def run_stage(args, rows: list[str], seed: int, raw: Path, runs: dict) -> None:
    """One launch of the rows this seed does not have yet."""
    todo = [r for r in rows if r not in runs.get(seed, {}).get("results", {})]
    if not todo:
        print(f"{args.stage} seed {seed}: every row is done", flush=True)
        return
    path = raw / f"{args.stage}_seed{seed}.json"
    for k in range(2, 100):
        if not path.exists():
            break
        path = raw / f"{args.stage}{k}_seed{seed}.json"
    study = diloco.parse_args(["--rows", ",".join(todo)])
    diloco.launch(study, seed, path)


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out_dir)
    raw = out / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    runs = load_all(raw)
    if args.stage == "sweep":
        run_stage(args, sweep_rows(), 0, raw, runs)
    elif args.stage == "horizon":
        lr, mu = tuned(runs)
        run_stage(args, [name("fp32", lr, mu, h) for h in HORIZONS], 0, raw, runs)
    elif args.stage == "quant":
        lr, mu = tuned(runs)
        for seed in (int(s) for s in args.seeds.split(",")):
            run_stage(args, [name(k, lr, mu, H) for k in QUANT], seed, raw, runs)
            runs = load_all(raw)
    else:
        text = report(runs)
        (out / "tables.md").write_text(text)
        print(text)
    return 0


# ---------------------------------------------------------------------------------- the report
def fmt(values: list[float], sign: str = "") -> str:
    """Mean ± standard error (4 decimals; no error for one value); ``sign="+"``: signed."""
    m, se = pages.mean_se(values)
    return f"{m:{sign}.4f}" + ("" if math.isnan(se) else f" ± {se:.4f}")


def sweep_table(runs: dict) -> list[str]:
    res = runs.get(0, {}).get("results", {})
    lines = [
        "| outer lr | momentum | held-out loss, step 500 | held-out loss, step 1000 | "
        "mean ‖pseudo-gradient‖ | mean ‖update‖ | ‖update‖ / ‖pseudo-gradient‖ |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in sweep_rows():
        if row in res:
            r = res[row]
            mid = next((c[3] for c in r["curve"] if c[0] == 500), float("nan"))
            pm = r["outer_probe_mean"]
            lines.append(
                f"| {r['outer_lr']:g} | {r['outer_momentum']:g} | {mid:.4f} | {r['final_loss']:.4f} | "
                f"{pm['applied_norm']:.4f} | {pm['update_norm']:.4f} | {pm['update_norm'] / pm['applied_norm']:.3f} |"
            )
    return lines


def horizon_table(runs: dict, lr: float, mu: float) -> list[str]:
    res = runs.get(0, {}).get("results", {})
    lines = [
        "| H | outer steps | held-out loss | MB sent per worker | mean ‖pseudo-gradient‖ | mean ‖update‖ |",
        "|---|---|---|---|---|---|",
    ]
    for h in sorted({H, *HORIZONS}):
        row = name("fp32", lr, mu, h)
        if row in res:
            r = res[row]
            pm = r["outer_probe_mean"]
            lines.append(
                f"| {h} | {len(r['outer_probe']['update_norm'])} | {r['final_loss']:.4f} | {r['bytes'] / 1e6:.3f} | "
                f"{pm['applied_norm']:.4f} | {pm['update_norm']:.4f} |"
            )
    return lines


def dp_reference(runs: dict) -> dict[int, float]:
    """dp-fp16's final held-out loss per seed from :data:`DP_RAW`, where the recorded args match."""
    out = {}
    for seed, run in runs.items():
        path = DP_RAW / f"seed{seed}.json"
        if not path.exists():
            continue
        data = json.loads(path.read_text())
        differ = [k for k in SHARED if data["args"][k] != run["args"][k]]
        if data["workers"] != 4 or differ or "dp-fp16" not in data["results"]:
            print(f"dp reference seed {seed}: not used ({differ or 'workers or row'})", file=sys.stderr)
            continue
        out[seed] = data["results"]["dp-fp16"]["final_loss"]
    return out


def extra_rows(runs: dict, mine: list[str]) -> list[str]:
    """The rows beyond the quant stage's that seeds other than 0 ran, or with added noise (``@n``):
    the noise control and fp32 at other outer steps, compared with the tuned point seed by seed."""
    rows = {r for s, run in runs.items() for r in run["results"] if s != 0 or "@n" in r}
    return sorted(rows - set(mine))


def paired(runs: dict, row: str, base: str) -> tuple[list[int], list[float]]:
    """The seeds that ran both rows and ``row`` minus ``base`` on each."""
    seeds = [s for s in sorted(runs) if row in runs[s]["results"] and base in runs[s]["results"]]
    return seeds, [runs[s]["results"][row]["final_loss"] - runs[s]["results"][base]["final_loss"] for s in seeds]


def quant_table(runs: dict, lr: float, mu: float, h: int, dp: dict[int, float], extra=()) -> list[str]:
    """Per row, over the seeds that ran it and the tuned fp32 row: each seed's loss, their mean, the
    same-seed difference (mean ± standard error over the seeds), the bytes."""
    base = name("fp32", lr, mu, h)
    every = sorted(runs)
    lines = [
        f"| row | {' | '.join(f'seed {s}' for s in every)} | mean | vs {base} (same seed) | MB sent per worker | "
        "bytes vs fp32 |",
        "|---|" + "---|" * len(every) + "---|---|---|---|",
    ]
    for row in [name(kind, lr, mu, h) for kind in QUANT] + list(extra):
        seeds, diff = paired(runs, row, base)
        if not seeds:
            continue
        res = [runs[s]["results"][row] for s in seeds]
        per = [f"{runs[s]['results'][row]['final_loss']:.4f}" if s in seeds else "" for s in every]
        mbytes = sum(r["bytes"] for r in res) / len(res)
        fp32_bytes = sum(runs[s]["results"][base]["bytes"] for s in seeds) / len(seeds)
        lines.append(
            f"| {row} | {' | '.join(per)} | {fmt([r['final_loss'] for r in res])} | {fmt(diff, '+')} | "
            f"{mbytes / 1e6:.3f} | {mbytes / fp32_bytes:.4f} |"
        )
    both = [s for s in sorted(runs) if s in dp and base in runs[s]["results"]]
    if both:
        gap = [runs[s]["results"][base]["final_loss"] - dp[s] for s in both]
        rel = [runs[s]["results"][base]["final_loss"] / dp[s] - 1 for s in both]
        lines += [
            "",
            f"dp-fp16 (seeds {', '.join(map(str, both))}, the earlier study's raw files): "
            f"{fmt([dp[s] for s in both])}; tuned fp32 DiLoCo minus dp-fp16, same seed: {fmt(gap, '+')} nats/char "
            f"({100 * pages.mean_se(rel)[0]:+.1f}% of dp-fp16's loss).",
        ]
    return lines


def pair_table(runs: dict, lr: float, mu: float, h: int, extra=()) -> list[str]:
    """The issue's same-seed comparisons (ALQ 2 bits against tuned fp32, int8 and QSGDinf 2 bits,
    every extra row against those, the noise rows in order) and the bytes ratio."""
    rows = {k: name(k, lr, mu, h) for k in QUANT}
    pairs = [(rows[a], rows[b]) for a in ("alq2", "alq2-ef") for b in ("fp32", "int8", "qsgdinf2")]
    pairs += [(rows["qsgdinf2"], rows["fp32"])] + [(r, rows[k]) for r in extra for k in ("qsgdinf2", "alq2")]
    noisy = sorted((r for r in extra if "@n" in r), key=lambda r: float(r.rsplit("@n", 1)[1]))
    pairs += list(zip(noisy[1:], noisy[:-1]))
    lines = [
        "| row | minus | seeds | difference (mean ± s.e.) | row better in | bytes ratio |",
        "|---|---|---|---|---|---|",
    ]
    for a, b in pairs:
        seeds, diff = paired(runs, a, b)
        if not seeds:
            continue
        ratio = sum(runs[s]["results"][a]["bytes"] for s in seeds) / sum(runs[s]["results"][b]["bytes"] for s in seeds)
        lines.append(
            f"| {a} | {b} | {','.join(map(str, seeds))} | {fmt(diff, '+')} | "
            f"{sum(d < 0 for d in diff)} of {len(diff)} | {ratio:.4f} |"
        )
    return lines


def norm_table(runs: dict, rows: list[str]) -> list[str]:
    """Per row, means over seeds of OuterProbe's per-outer-step norms, the cosine of applied and
    exact pseudo-gradients and the relative error ``‖applied − exact‖ / ‖exact‖``."""
    lines = [
        "| row | seeds | ‖exact avg‖ | ‖applied avg‖ | ‖applied − exact‖ | ‖applied − exact‖ / ‖exact‖ | "
        "cos(applied, exact) | mean ‖own‖ | ‖update‖ | ‖update‖ / ‖applied‖ |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        res = [runs[s]["results"][row] for s in sorted(runs) if row in runs[s]["results"]]
        if not res:
            continue
        cols = {k: sum(r["outer_probe_mean"][k] for r in res) / len(res) for k in diloco.OuterProbe.KEYS}
        cos, rel = [], []
        for r in res:
            p = r["outer_probe"]
            for a, e, d in zip(p["applied_norm"], p["exact_norm"], p["error_norm"]):
                cos.append((a * a + e * e - d * d) / (2 * a * e))
                rel.append(d / e)
        lines.append(
            f"| {row} | {len(res)} | {cols['exact_norm']:.4f} | {cols['applied_norm']:.4f} | "
            f"{cols['error_norm']:.4f} | {sum(rel) / len(rel):.3f} | {sum(cos) / len(cos):.3f} | "
            f"{cols['local_norm']:.4f} | "
            f"{cols['update_norm']:.4f} | {cols['update_norm'] / cols['applied_norm']:.3f} |"
        )
    return lines


def report(runs: dict) -> str:
    lr, mu = tuned(runs)
    dp = dp_reference(runs)
    mine = [name(k, lr, mu, H) for k in QUANT]
    extra = extra_rows(runs, mine)
    others = sorted({r for run in runs.values() for r in run["results"]} - set(mine))
    parts = [
        f"## Sweep (seed 0, H = {H}, fp32)\n\nTuned pair: outer lr {lr:g}, momentum {mu:g}.\n",
        "\n".join(sweep_table(runs)),
        "\n## H at the tuned pair (seed 0, fp32)\n",
        "\n".join(horizon_table(runs, lr, mu)),
        f"\n## The quantizers at the tuned point (H = {H})\n",
        "\n".join(quant_table(runs, lr, mu, H, dp, extra)),
        "\n## Paired differences (same seed)\n",
        "\n".join(pair_table(runs, lr, mu, H, extra)),
        "\n## Outer-step norms (mean over outer steps, then over seeds)\n",
        "\n".join(norm_table(runs, mine + others)),
    ]
    return "\n".join(parts) + "\n"


if __name__ == "__main__":
    sys.exit(main())
