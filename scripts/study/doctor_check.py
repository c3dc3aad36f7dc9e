#!/usr/bin/env python
"""The doctor's prediction against measured steps: run ``python -m horovod_alq.doctor`` on the
namespace "nodes" (2 x 2 and 4 x 2 ranks, TCP inside a node, 100 Mbit/s and 1 Gbit/s between nodes;
scripts/common/network.py, root), then predict, from what it measured, the ALQ / fp16 step ratio of
the rows scripts.bench.train_step measured on the same layouts and rates
(docs/results/data/bench_train_step_nodes_tcp*.json: their model size and compute), against the
measured ratio.

    python -m scripts.study.doctor_check     # runs the doctor (root); build/results/doctor_check.md, data/
    python -m scripts.study.doctor_check --reuse docs/results/data/doctor_check.json --out /tmp/d.md
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from horovod_alq.doctor.model import Codec
from horovod_alq.doctor.predict import predict
from scripts.common import network

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "docs" / "results" / "data"
MEASURED = [DATA / f"bench_train_step_nodes_tcp{x}.json" for x in ("", "_2", "_3")]
LAYOUTS = [(2, 2), (4, 2)]  # (nodes, ranks per node)
RATES = ["100mbit", "1gbit"]
#: The measured rows the doctor's choice is: each front-end's fp16 and its ALQ row of the exchange
#: exchange="auto" picks (hierarchical on 2 nodes, hierarchical two-phase from 4).
ROWS = {"Horovod": ("hvd-fp16", "hvd-alq-h", "hvd-alq-h2p"), "DDP": ("ddp-fp16", "ddp-alq-h", "ddp-alq-h2p")}


def run_doctor(nodes: int, g: int, rate: str, out: Path, tmp: Path) -> dict:
    """The doctor's JSON from one namespace launch of ``nodes`` x ``g`` ranks at ``rate``."""
    network.setup(nodes)
    try:
        network.shape(rate, nodes)
        cmd = network.mpirun_command(tmp, n=nodes, ranks_per_node=g, intra="tcp")
        cmd += [sys.executable, "-m", "horovod_alq.doctor", "--params", "1M", "--json", str(out)]
        log = tmp / f"doctor_{nodes}x{g}_{rate}.log"
        rc = network.launch_retry(cmd, log, 600, missing=lambda: network.missing_ranks(nodes, g))
        if rc != 0:
            raise RuntimeError(f"the doctor exited {rc} on {nodes}x{g} at {rate}: {log.read_text()[-3000:]}")
        return json.loads(out.read_text())
    finally:
        network.kill_in_namespaces()
        network.teardown()


def measured_ratios() -> dict:
    """(layout, rate, front-end) -> (median measured ALQ / fp16 ratio, its runs, the runs' params and compute)."""
    got: dict = {}
    for path in MEASURED:
        for run in json.loads(path.read_text())["runs"]:
            res, info = run["run"]["results"], run["run"]
            layout = (info["nodes"], info["local_size"])
            for fe, (fp16, h, h2p) in ROWS.items():
                alq = h if layout[0] < 4 else h2p
                if fp16 in res and alq in res:
                    entry = got.setdefault(
                        (layout, run["rate"], fe), {"ratios": [], "compute": [], "rows": (fp16, alq)}
                    )
                    entry["ratios"].append(res[alq]["step_s"] / res[fp16]["step_s"])
                    entry["compute"].append(res["local"]["step_s"])
                    entry["params"] = info["params"]
    return got


def compare(doctors: dict) -> list[dict]:
    """Predicted against measured ratio for every measured (layout, rate, front-end)."""
    out = []
    for (layout, rate, fe), m in sorted(measured_ratios().items()):
        doc = doctors.get(f"{layout[0]}x{layout[1]} {rate}")
        if doc is None:
            continue
        c = doc["codec"]
        codec = Codec(c["enc3"], c["enc4"], c["dec"])
        n, g = layout[0] * layout[1], layout[1]
        compute = statistics.median(m["compute"])
        share = doc["prediction"]["share"]
        p = predict(m["params"], n, g, doc["links"], codec, compute, 3, share)
        measured = statistics.median(m["ratios"])
        out.append(
            {
                "layout": f"{layout[0]} x {layout[1]}",
                "rate": rate,
                "front_end": fe,
                "rows": m["rows"],
                "runs": len(m["ratios"]),
                "measured": measured,
                "measured_range": [min(m["ratios"]), max(m["ratios"])],
                "predicted": p["ratio"],
                "predicted_over_measured": p["ratio"] / measured,
                "exchange": p["exchange"],
                "between": doc["links"].get("between"),
                "inside": doc["links"].get("inside"),
                "compute_s": compute,
                "share": share,
            }
        )
    return out


def report(rows: list[dict], doctors: dict, argv: list[str], wall: float) -> str:
    ratios = [r["predicted_over_measured"] for r in rows]
    within = sum(abs(x - 1) <= 0.25 for x in ratios)
    lines = [
        "# The doctor's prediction against measured steps",
        "",
        f"Command: `python -m scripts.study.doctor_check {' '.join(argv)}` ({wall:.0f} s). "
        f"Date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; load average "
        f"{os.getloadavg()[0]:.1f} at the end. Data: [data/doctor_check.json](data/doctor_check.json).",
        "",
        "`python -m horovod_alq.doctor` ran on the namespace nodes of scripts/common/network.py (every rank on "
        "this 2-core machine, TCP inside a node, tc-shaped links between nodes) and measured the links and "
        "the codec; from those, the scale model predicted the ALQ / fp16 step ratio of the rows "
        "scripts.bench.train_step measured on the same layouts and rates (a 0.70M-parameter CNN; "
        "[bench_train_step](bench_train_step.md#runs), 3 runs, medians), with their compute step, "
        "kappa 1 (the codec kernels' time only) and the doctor's ranks per core.",
        "",
        f"**Predicted / measured: {min(ratios):.2f} to {max(ratios):.2f}; {within} of {len(rows)} within 25%.**",
        "",
        "| layout | between nodes | front-end | rows | measured ALQ / fp16 (runs' range) | predicted | "
        "predicted / measured | doctor's link between nodes | inside a node |",
        "|---|---|---|---|---:|---:|---:|---|---|",
    ]
    for r in rows:
        b, i = r["between"], r["inside"]
        lines.append(
            f"| {r['layout']} | {r['rate']} | {r['front_end']} | {' / '.join(reversed(r['rows']))} | "
            f"{r['measured']:.2f} ({r['measured_range'][0]:.2f}-{r['measured_range'][1]:.2f}) | "
            f"{r['predicted']:.2f} | {r['predicted_over_measured']:.2f} | "
            f"{b['bytes_per_s'] * 8 / 1e6:.0f} Mbit/s, {b['latency_s'] * 1e6:.0f} us | "
            f"{i['bytes_per_s'] * 8 / 1e9:.2f} Gbit/s, {i['latency_s'] * 1e6:.0f} us |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="build/results/doctor_check.md", help="default %(default)s")
    p.add_argument("--data", default="build/results/data/doctor_check.json", help="default %(default)s")
    p.add_argument("--reuse", help="a doctor_check.json whose doctor runs to compare (no namespaces)")
    args = p.parse_args(argv)
    argv_list = list(argv) if argv is not None else sys.argv[1:]
    start = time.time()
    if args.reuse:
        doctors = json.loads(Path(args.reuse).read_text())["doctors"]
    else:
        stop = network.preflight("scripts/study/doctor_check.py", False)
        if stop is not None:
            return stop
        doctors = {}
        with tempfile.TemporaryDirectory() as tmp:
            for nodes, g in LAYOUTS:
                for rate in RATES:
                    out = Path(tmp) / f"doctor_{nodes}x{g}_{rate}.json"
                    doctors[f"{nodes}x{g} {rate}"] = run_doctor(nodes, g, rate, out, Path(tmp))
                    print(f"{nodes}x{g} {rate}: {doctors[f'{nodes}x{g} {rate}']['links']}", flush=True)
    rows = compare(doctors)
    for path in (args.out, args.data):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(report(rows, doctors, argv_list, time.time() - start))
    Path(args.data).write_text(json.dumps({"argv": argv_list, "doctors": doctors, "rows": rows}, indent=1) + "\n")
    print(f"wrote {args.out}, {args.data}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
