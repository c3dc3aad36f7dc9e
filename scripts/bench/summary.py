#!/usr/bin/env python
"""The last words of `make bench`: where ALQ's step and time to accuracy beat the 16-bit baselines
and where they do not, and why, read from the quick runs' JSON (scripts/bench/train_step.py and
scripts/study/time_to_accuracy.py, written under --dir), with pointers to the full pages.

    python -m scripts.bench.summary --dir build/bench

Runs missing from --dir (no root, so no namespaces) are named, not guessed.
"""

import argparse
import json
import sys
from pathlib import Path

PAGES = {
    "step": "docs/results/bench_train_step.md",
    "tta": "docs/results/time_to_accuracy.md",
    "index": "docs/results/index.md",
}
PAIRS = (("Horovod ALQCompressor(bits=3)", "hvd-alq", "hvd-fp16"), ("DDP alq_hook", "ddp-alq", "ddp-fp16"))


def step_lines(data: dict) -> list[str]:
    """Per rate: ALQ's step against fp16's, and the exchange's share of fp16's step."""
    lines = []
    for run in data["runs"]:
        res = run["run"]["results"]
        cells = [
            f"{label} {res[a]['step_s'] / res[b]['step_s']:.2f}x" for label, a, b in PAIRS if a in res and b in res
        ]
        share = ""
        if "local" in res and "hvd-fp16" in res:
            share = f"; the exchange is {1 - res['local']['step_s'] / res['hvd-fp16']['step_s']:.0%} of fp16's step"
        lines.append(f"  {run['rate']:>9}, {run['workers']} workers: step vs fp16: " + ", ".join(cells) + share)
    return lines


def verdict(ratio: float) -> str:
    return "ALQ wins" if ratio < 0.95 else "ALQ loses" if ratio > 1.05 else "about even"


def summary(folder: Path) -> list[str]:
    lines = ["", "== make bench: summary =="]
    step = folder / "data" / "bench_train_step.json"
    tta = folder / "data" / "time_to_accuracy.json"
    ratios, shares, sent = {}, {}, []
    if step.exists():
        data = json.loads(step.read_text())
        lines += ["Full training step (ResNet-18-shaped CNN, width 0.25):", *step_lines(data)]
        for run in data["runs"]:
            res = run["run"]["results"]
            if "hvd-alq" in res and "hvd-fp16" in res:
                ratios[run["rate"]] = res["hvd-alq"]["step_s"] / res["hvd-fp16"]["step_s"]
                sent.append(res["hvd-alq"]["bytes_per_step"] / res["hvd-fp16"]["bytes_per_step"])
                if "local" in res:
                    shares[run["rate"]] = 1 - res["local"]["step_s"] / res["hvd-fp16"]["step_s"]
    else:
        lines.append(f"(no step table: {step} is missing; scripts.bench.train_step needs root for its namespaces)")
    if tta.exists():
        data = json.loads(tta.read_text())["summary"]
        lines.append("Time to accuracy (character GPT, ALQ 3 bits against fp16's time to the loss fp16 reaches at):")
        for rate, s in data.items():
            row = s["rows"].get("hvd-alq")
            if row is None:
                continue
            cells = [
                f"{t['fraction']:.0%} of its steps "
                + ("not reached" if t["ratio"] is None else f"{t['ratio'][0]:.2f}x")
                for t in row["targets"][1:]
            ]
            seeds = len(s["seeds"])
            lines.append(
                f"  {rate:>9}: " + ", ".join(cells) + f" ({row['exchange']} exchange; {seeds} seed(s): "
                "a quick run is noisy, the full study has 3)"
            )
    else:
        lines.append(f"(no time-to-accuracy run: {tta} is missing; it needs root for its namespaces)")
    if ratios:
        lines.append("Where and why:")
        for rate, r in ratios.items():
            why = f", the exchange {shares[rate]:.0%} of fp16's step" if rate in shares else ""
            lines.append(f"  {rate}: {verdict(r)} ({r:.2f}x{why}).")
        lines += [
            f"  ALQ sends {'-'.join(dict.fromkeys(f'{v:.2f}' for v in (min(sent), max(sent))))}x fp16's bytes per step "
            "and pays for that in CPU (statistics,",
            "  encoding, decoding). Where the wire is most of fp16's step, the bytes saved outweigh the codec;",
            "  where it is a small share, the codec's CPU competes with the forward and backward passes (here",
            "  the ranks share 2 cores): there compression is not expected to pay. Nodes that give each rank",
            "  its own cores, or a GPU codec, move the break-even toward faster links.",
        ]
    lines += [f"Full results: {PAGES['index']}, {PAGES['step']}, {PAGES['tta']}."]
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", default="build/bench", help="where make bench wrote its quick runs; default build/bench")
    args = p.parse_args(argv)
    print("\n".join(summary(Path(args.dir))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
