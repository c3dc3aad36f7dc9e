#!/usr/bin/env python
"""Wall-clock per training step under limited bandwidth: 4 (--workers: 2..8) Horovod workers in
network namespaces with tc-shaped links (scripts/common/network.py), time per step for none (fp32),
fp16, QSGDinf and ALQ (allgather and two-phase), as ratios to none and to fp16, on a wide MLP (about
20M parameters, batch 8 per worker: communication dominates); the median over steps of the slowest
rank's step. Needs root (ip netns, tc). Results: docs/results/network_wall_clock.md.

    python -m scripts.bench.network     # unshaped, 1gbit, 100mbit: build/results/bench_network.md, .png, data/
    python -m scripts.bench.network --quick --out-dir /tmp/net     # small model, 1 rate, 2 steps
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from scripts.common import launch, report
from scripts.common import network as net

N_WORKERS = 4
BITS, BUCKET, BUDGET, BATCH = 3, 8192, 2.5, 8  # the compressors' bits, bucket and bits="auto" budget; batch
METHODS = ["none", "fp16", "qsgdinf", "alq", "alq-2p"]
LABELS = {
    "none": "none (fp32)",
    "fp16": "fp16",
    "qsgdinf": "QSGDinf 3b",
    "alq": "ALQ 3b allgather",
    "alq-2p": "ALQ 3b two-phase",
    "alq-auto": "ALQ bits='auto' allgather",
    "alq-auto-2p": "ALQ bits='auto' two-phase",
}  # (the last two: --methods; budget BUDGET)


# ---------------------------------------------------------------------------------------- worker
def worker(args) -> int:
    """Runs on every rank (inside its namespace): time training steps per method."""
    import horovod.torch as hvd
    import torch
    import torch.nn.functional as F

    hvd.init()
    torch.set_num_threads(1)
    from horovod_alq.torch import ALQCompressor, QSGDCompressor

    common = dict(bits=BITS, bucket_size=BUCKET, update_steps=(0,), update_every=0, seed=1)
    auto = dict(common, bits="auto", bit_budget=BUDGET)  # allocated at step 0, used from step 1
    comps = {
        "none": hvd.Compression.none,
        "fp16": hvd.Compression.fp16,
        "qsgdinf": QSGDCompressor(**common, exchange="allgather"),
        "alq": ALQCompressor(**common, exchange="allgather"),
        "alq-2p": ALQCompressor(**common, exchange="two-phase"),
        "alq-auto": ALQCompressor(**auto, exchange="allgather"),
        "alq-auto-2p": ALQCompressor(**auto, exchange="two-phase"),
    }
    h = args.hidden
    results = {}
    for method in args.methods.split(","):
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(784, h), torch.nn.ReLU(), torch.nn.Linear(h, h), torch.nn.ReLU(), torch.nn.Linear(h, 10)
        )
        params = sum(p.numel() for p in model.parameters())
        opt = hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.01),
            named_parameters=model.named_parameters(),
            compression=comps[method],
        )
        x = torch.randn(BATCH, 784)
        y = torch.randint(0, 10, (BATCH,))
        times, compute = [], []
        for step in range(args.warmup + args.steps):
            hvd.barrier()
            t0 = time.perf_counter()
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            t1 = time.perf_counter()
            opt.step()
            t2 = time.perf_counter()
            if step >= args.warmup:
                times.append(t2 - t0)
                compute.append(t1 - t0)
        per_rank = hvd.allgather_object((times, compute))
        step_max = [max(r[0][i] for r in per_rank) for i in range(len(times))]
        results[method] = {
            "step_s": statistics.median(step_max),
            "steps": step_max,
            "compute_s": statistics.median(max(r[1][i] for r in per_rank) for i in range(len(times))),
            "params": params,
        }
        if hasattr(comps[method], "metrics"):  # this package's compressors: payload bytes on the wire
            m = comps[method].metrics()
            rounds = max(1, m["step"])
            results[method].update(
                exchange=m["exchange"],
                bytes_sent_per_step=m["bytes_sent"] / rounds,
                bytes_received_per_step=m["bytes_received"] / rounds,
                allocation=m.get("allocation"),
                allocated_mean_bits=m.get("allocated_mean_bits"),
            )
        del opt
    if hvd.rank() == 0:
        Path(args.worker_out).write_text(json.dumps({"size": hvd.size(), "results": results}))
    hvd.shutdown()
    return 0


def run_workers(args, tmp: Path, rate: str) -> dict:
    """The worker in the :data:`N_WORKERS` namespaces (links shaped to ``rate``); its JSON."""
    cmd = lambda out, ifname: (
        [sys.executable, "-m", "scripts.bench.network", "--worker", "--worker-out", str(out)]
        + (launch.flags(args, "methods", "hidden", "steps", "warmup"))
    )
    return net.run_netns(args, tmp, N_WORKERS, rate, cmd, tmp / f"mpirun_{rate}.log")


# ---------------------------------------------------------------------------------------- driver
def wire_bits(method: str, bits: float, bucket: int, n: int) -> float:
    """Bits each worker receives per coordinate (docs: Horovod wire arithmetic; ``bits="auto"``:
    ``bits`` is the budget, the most the allocation spends)."""
    if method == "none":
        return 2 * (n - 1) / n * 32
    if method == "fp16":
        return 2 * (n - 1) / n * 16
    if method.endswith("-2p"):  # scatter-reduce + allgather of codes (horovod_alq/exchange/two_phase.py)
        return 2 * (n - 1) / n * (bits + 32 / bucket)
    return (n - 1) * (bits + 32 / bucket)


def _bits(method: str) -> float:
    return BUDGET if "auto" in method else BITS


def page(runs: dict, args, argv, throughput: dict, wall: float) -> str:
    rates, methods = list(runs), args.methods.split(",")
    params = next(iter(next(iter(runs.values()))["results"].values()))["params"]
    label = lambda m: LABELS.get(m, m)
    cells = []
    for rate in rates:
        res = runs[rate]["results"]
        base = res.get("none", {}).get("step_s")
        row = [rate, f"{throughput.get(rate, float('nan')) * 8 / 1e6:.0f} Mbit/s"]
        row += [
            f"{res[m]['step_s'] * 1e3:.0f} ms" + (f" ({res[m]['step_s'] / base:.2f}x)" if base else "") for m in methods
        ]
        cells.append(row + [f"{max(r['compute_s'] for r in res.values()) * 1e3:.0f} ms"])
    head = [
        "link",
        "measured TCP throughput w0->w1",
        *map(label, methods),
        "fwd+bwd incl. compress calls (max over methods)",
    ]
    wire = ", ".join(f"{label(m)} {wire_bits(m, _bits(m), BUCKET, N_WORKERS):.2f} bits" for m in methods)
    lines = [
        f"Command: `python -m scripts.bench.network {' '.join(argv if argv is not None else sys.argv[1:])}` "
        f"({wall:.0f} s in all).",
        "",
        f"{N_WORKERS} workers in network namespaces, MLP 784-{args.hidden}-{args.hidden}-10 "
        f"({params / 1e6:.1f}M parameters), "
        f"batch {BATCH} per worker, {BITS} bits, bucket {BUCKET}; median over "
        f"{args.steps} timed steps (after {args.warmup} warm-up) of the slowest rank's step time; "
        f"Open MPI mpi_yield_when_idle={args.yield_when_idle}.",
        "",
        *report.table(head, cells),
        "",
        "Ratios in parentheses are to none (fp32) on the same link. Wire arithmetic per worker and coordinate: "
        f"{wire}.",
    ]
    if "fp16" in methods:
        others = [m for m in methods if m != "fp16"]
        ratios = [
            [r] + [f"{runs[r]['results'][m]['step_s'] / runs[r]['results']['fp16']['step_s']:.2f}" for m in others]
            for r in rates
        ]
        lines += ["", "Step time as a fraction of fp16's on the same link (below 1: faster than fp16):", ""]
        lines += report.table(["link"] + [f"{label(m)} / fp16" for m in others], ratios)
    return "\n".join(lines + bytes_lines(runs, args, params)) + "\n"


def bytes_lines(runs: dict, args, params: int) -> list[str]:
    """Payload bytes per step and rank as the compressors measured them, against the arithmetic."""
    rate, methods = next(iter(runs)), args.methods.split(",")
    res = runs[rate]["results"]
    measured = [m for m in methods if "bytes_received_per_step" in res[m]]
    if not measured:
        return []
    arithmetic = lambda m, bits: f"{wire_bits(m, bits, BUCKET, N_WORKERS) * params / 8e6:.2f} MB"
    cells = [
        [LABELS.get(m, m), res[m]["exchange"], f"{res[m]['bytes_sent_per_step'] / 1e6:.2f} MB"]
        + [f"{res[m]['bytes_received_per_step'] / 1e6:.2f} MB", arithmetic(m, _bits(m))]
        for m in measured
    ]
    ring = "ring allreduce (arithmetic) | | |"
    lines = [
        "",
        f"Payload bytes per step and rank, measured by the compressors (rank 0, {rate} run; the "
        "same on every link), against the wire arithmetic above times the parameter count:",
        "",
        *report.table(["method", "exchange", "sent", "received", "arithmetic (received)"], cells),
        f"| {LABELS['none']} | {ring} {arithmetic('none', BITS)} |",
        f"| fp16 | {ring} {arithmetic('fp16', BITS)} |",
    ]
    for m in measured:
        if res[m].get("allocation"):
            lines += [
                "",
                f"{LABELS.get(m, m)}: widths {res[m]['allocation']} of the compressed tensors in "
                f"round order (the last layer first), {res[m]['allocated_mean_bits']:.2f} bits per "
                f"coordinate (budget {BUDGET}); "
                "the bytes above average every step, the first one (all at the default "
                f"{int(BUDGET)} bits, before the allocation) included.",
            ]
    return lines


def plot(runs: dict, args, path: Path) -> None:
    import numpy as np

    plt = report.pyplot()
    methods, rates = args.methods.split(","), list(runs)
    fig, ax = plt.subplots(figsize=(7.5, 3.8))
    w = 0.8 / len(methods)
    for j, m in enumerate(methods):
        vals = [runs[r]["results"][m]["step_s"] for r in rates]
        ax.bar(np.arange(len(rates)) + (j - (len(methods) - 1) / 2) * w, vals, w, label=LABELS.get(m, m))
    ax.set_xticks(np.arange(len(rates)), rates)
    ax.set_yscale("log")
    ax.set_ylabel("seconds per step (median, slowest rank)")
    ax.set_title(f"{N_WORKERS} workers in netns, tc tbf per worker link, MLP {args.hidden}x{args.hidden}")
    ax.grid(axis="y", alpha=0.3, which="both")
    ax.legend(fontsize=8)
    report.save(fig, path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = p.add_argument
    add("--rates", default="unshaped,1gbit,100mbit", help="tc tbf rates; 'unshaped' = no qdisc")
    add("--methods", default=",".join(METHODS))
    add("--workers", type=int, default=4, help="worker namespaces and ranks, 2..8; default 4")
    add("--hidden", type=int, default=4096, help="MLP width; default 4096 (20.0M parameters)")
    add("--steps", type=int, default=5)
    add("--warmup", type=int, default=2)
    add("--timeout", type=float, default=1200, help="seconds per mpirun")
    add("--yield-when-idle", type=int, choices=(0, 1), default=1, help="mpi_yield_when_idle; 0: busy-wait")
    add("--out-dir", default="build/results", help="default build/results")
    tag_help = "suffix of the output file names (bench_network<tag>.md/.png, data/bench_network<tag>.json)"
    add("--tag", default="", help=tag_help)
    add("--quick", action="store_true", help="1gbit only, MLP 512, 2 steps")
    add("--teardown-only", action="store_true", help="remove leftover namespaces of this script")
    add("--worker", action="store_true", help=argparse.SUPPRESS)
    add("--worker-out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker(args)
    global N_WORKERS
    if not 2 <= args.workers <= 8:
        p.error("--workers must be 2..8")
    N_WORKERS = args.workers
    if args.quick:
        args.rates, args.hidden, args.steps, args.warmup = "1gbit", 512, 2, 1
    status = net.preflight("scripts.bench.network", args.teardown_only)
    if status is not None:
        return status
    out = Path(args.out_dir) / f"bench_network{args.tag}.md"
    start = time.monotonic()
    runs, throughput = {}, {}

    def each(tmp: Path, rate: str, bps: float) -> list:
        throughput[rate], runs[rate] = bps, run_workers(args, tmp, rate)
        print(json.dumps({m: round(r["step_s"], 4) for m, r in runs[rate]["results"].items()}), flush=True)
        return []

    net.sweep(False, args.rates.split(","), N_WORKERS, "alqnet-", each)
    text = page(runs, args, argv, throughput, time.monotonic() - start)
    report.write(out, text, {"args": vars(args), "throughput_Bps": throughput, "runs": runs})
    plot(runs, args, out.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
