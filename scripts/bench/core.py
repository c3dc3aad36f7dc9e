#!/usr/bin/env python
"""Benchmark the NumPy core: adaptation time, reference-codec throughput, quantization variance.

Writes a Markdown report (default ``build/results/bench_core.md``; folded into
docs/results/codec_speed.md#bench_core by hand) with the tables, the command that produced
them and a note on the machine. ``--quick`` uses smaller inputs and fewer repeats (a smoke test).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from pathlib import Path

import numpy as np
import scipy

from horovod_alq.core import Quantizer

ADAPTIVE = ["alq", "alq-n", "amq", "amq-n"]
ALL = ["qsgdinf", "qsgd", "nuqsgd", "terngrad", *ADAPTIVE]


def median_time(fn, repeats: int) -> float:
    """Median wall time of ``fn()`` in seconds."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def gradient(kind: str, n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    g = rng.standard_normal(n) if kind == "gaussian" else rng.standard_t(3, n)
    return g.astype(np.float32)


def bench_adaptation(n: int, repeats: int) -> list[tuple]:
    """Per adaptive method (3 bits, bucket 8192): time of statistics(x) and of adapt(stats)."""
    x = gradient("gaussian", n, 0)
    rows = []
    for method in ADAPTIVE:
        q = Quantizer(method, bits=3, bucket_size=8192, seed=0)
        stats = q.statistics(x)
        t_stats = median_time(lambda: q.statistics(x), repeats)
        t_adapt = median_time(lambda: Quantizer(method, bits=3, bucket_size=8192).adapt(stats), repeats)
        rows.append((method, 1e3 * t_stats, 1e3 * t_adapt))
    return rows


def bench_throughput(n: int, repeats: int) -> list[tuple]:
    """Encode and decode throughput (million coordinates per second) on float32 input."""
    x = gradient("gaussian", n, 1)
    rows = []
    for method, bits in (("alq", 2), ("alq", 3), ("alq", 8), ("terngrad", 2), ("qsgdinf", 4)):
        q = Quantizer(method, bits=bits, bucket_size=8192, seed=0)
        payload = q.encode(x)
        t_enc = median_time(lambda: q.encode(x), repeats)
        t_dec = median_time(lambda: q.decode(payload), repeats)
        rows.append((method, bits, n / t_enc / 1e6, n / t_dec / 1e6, 8 * payload.size / n))
    return rows


def normalized_variance(q: Quantizer, x: np.ndarray, draws: int) -> float:
    """Monte-Carlo ``E||Q(x) - x||^2 / ||x||^2`` over ``draws`` encodings."""
    x64 = x.astype(np.float64)
    err = [np.sum((q.decode(q.encode(x)).astype(np.float64) - x64) ** 2) for _ in range(draws)]
    return float(np.mean(err) / np.sum(x64**2))


def bench_variance(n: int, draws: int) -> dict:
    """Normalized variance per (data, bucket size) and method; adaptive methods adapted to the data."""
    table = {}
    for kind in ("gaussian", "student-t3"):
        x = gradient(kind, n, 2)
        for d in (512, 8192):
            for method in ALL:
                q = Quantizer(method, bits=2 if method == "terngrad" else 3, bucket_size=d, seed=3)
                q.adapt(q.statistics(x))  # no-op for fixed methods
                table[(kind, d, method)] = normalized_variance(q, x, draws)
    return table


def report(args, adapt_rows, tput_rows, var_table, elapsed: float) -> str:
    cmd = "python -m scripts.bench.core" + (" --quick" if args.quick else "")
    lines = [
        "# Core benchmark (NumPy reference codec)",
        "",
        f"Produced by `{cmd}` in {elapsed:.0f} s.",
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} CPU cores visible (shared with other jobs), "
        f"Python {platform.python_version()}, NumPy {np.__version__}, SciPy {scipy.__version__}. "
        "Single-threaded NumPy code; times are medians of repeats and noisy on a shared machine.",
        "",
        f"## Adaptation (3 bits, bucket 8192, {args.n_adapt:,} Gaussian coordinates, median of {args.repeats})",
        "",
        "statistics = `q.statistics(x)` on one worker's gradient; adapt = `q.adapt(stats)` from the starting levels "
        "(ALQ: 30 coordinate-descent sweeps; AMQ: multi-start gradient descent on p).",
        "",
        "| method | statistics (ms) | adapt (ms) |",
        "|---|---|---|",
    ]
    lines += [f"| {m} | {ts:.1f} | {ta:.1f} |" for m, ts, ta in adapt_rows]
    lines += [
        "",
        f"## Reference codec throughput ({args.n_codec:,} float32 coordinates, bucket 8192, median of {args.repeats})",
        "",
        "| method | bits | encode (M coords/s) | decode (M coords/s) | wire bits/coord |",
        "|---|---|---|---|---|",
    ]
    lines += [f"| {m} | {b} | {e:.1f} | {d:.1f} | {w:.4f} |" for m, b, e, d, w in tput_rows]
    lines += [
        "",
        f"## Normalized variance E‖Q(g) − g‖² / ‖g‖² ({args.n_var:,} coordinates, mean of {args.draws} encodings)",
        "",
        "3 bits (TernGrad: its 3 levels on 2 bits). Adaptive methods adapted to the same data first "
        "(`q.adapt(q.statistics(g))`). Lower is better.",
        "",
        "| method | Gaussian, d=512 | Gaussian, d=8192 | Student-t(3), d=512 | Student-t(3), d=8192 |",
        "|---|---|---|---|---|",
    ]
    cols = [("gaussian", 512), ("gaussian", 8192), ("student-t3", 512), ("student-t3", 8192)]
    for method in ALL:
        cells = " | ".join(f"{var_table[(k, d, method)]:.4g}" for k, d in cols)
        lines.append(f"| {method} | {cells} |")
    lines.append("")
    for k, d in cols:
        ranking = sorted(ALL, key=lambda m: var_table[(k, d, m)])
        lines.append(f"- ranking, {k}, d={d}: " + " < ".join(ranking))
    lines += [
        "",
        "Notes:",
        "- The paper's level sets have no zero level, so a coordinate near 0 costs about "
        "`l_1**2` (innermost level squared) in the L2-normalized methods; with normalized "
        "coordinates of size ~1/sqrt(d) that makes QSGD's and NUQSGD's variance grow like "
        "d/49 and d/64 at 3 bits. Adaptive methods move the inner levels to the data's scale.",
        "- ALQ and AMQ adapt to the norm-weighted empirical distribution of the normalized "
        "coordinates; ALQ-N and AMQ-N to one truncated normal (the paper's model), which "
        "underweights the heavy tails of Student-t data: there ALQ-N is 3x worse than ALQ "
        "(docs/design/statistics.md).",
        "- QSGDinf normalizes by the max-abs, which suits light-tailed (Gaussian) buckets: it beats "
        "the L2-normalized adaptive methods there at d=512, and loses by 3-20x on Student-t data.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small inputs, few repeats (smoke test)")
    parser.add_argument(
        "--out",
        default=str(Path(__file__).resolve().parents[2] / "build" / "results" / "bench_core.md"),
        help="Markdown report to write (default: build/results/bench_core.md)",
    )
    args = parser.parse_args(argv)
    args.repeats = 3 if args.quick else 7
    args.n_adapt = 2**18 if args.quick else 2**22
    args.n_codec = 2**18 if args.quick else 2**22
    args.n_var = 2**16 if args.quick else 2**20
    args.draws = 2 if args.quick else 5

    t0 = time.perf_counter()
    adapt_rows = bench_adaptation(args.n_adapt, args.repeats)
    tput_rows = bench_throughput(args.n_codec, args.repeats)
    var_table = bench_variance(args.n_var, args.draws)
    text = report(args, adapt_rows, tput_rows, var_table, time.perf_counter() - t0)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
