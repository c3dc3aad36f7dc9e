"""What the reports of the benchmarks and studies share: the command line that made a page, its
header (title, command, date, machine), Markdown tables, number formats, the JSON sidecar in
``data/`` beside a page, summary statistics and the end of a paired-difference plot."""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import shlex
import statistics
import sys
from pathlib import Path


def command(module: str, argv=None) -> str:
    """``python -m module ARGS`` as it was run (``argv``: sys.argv[1:] by default), shell-quoted."""
    return f"python -m {module}" + "".join(f" {shlex.quote(a)}" for a in (sys.argv[1:] if argv is None else argv))


def now() -> str:
    return datetime.datetime.now().strftime("%Y-%m-%d %H:%M")


def table(head: list[str], rows, align: str = "") -> list[str]:
    """Markdown lines of a table: ``head``'s cells, a rule (``align``'s letters per column, "r" for
    right-aligned, "-" or nothing for the default), then one line per row of cells (``str``-ed)."""
    rule = "|" + "".join("---:|" if align[i : i + 1] == "r" else "---|" for i in range(len(head)))
    return ["| " + " | ".join(head) + " |", rule] + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]


def ms(s: float) -> str:
    """Seconds as milliseconds: no decimals from 100 ms on, one below."""
    return f"{s * 1e3:.0f}" if s >= 0.1 else f"{s * 1e3:.1f}"


def write(out: Path, text: str, data: dict) -> None:
    """The page at ``out``, ``data`` as JSON in data/ beside it (same stem), the page on stdout."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    sidecar = out.parent / "data" / out.with_suffix(".json").name
    sidecar.parent.mkdir(parents=True, exist_ok=True)
    sidecar.write_text(json.dumps(data, indent=1))
    print(text)


def step_header(title: str, module: str, argv, runs: list[dict], wall: float, versions: str, threads: str, **kw):
    """A step benchmark's title, command, date and machine lines (scripts/bench/train_step.py's and
    fsdp.py's): ``versions`` follows the date, ``threads`` names the threads that share the cores,
    ``fewer_ranks`` qualifies a run with no more ranks than cores, ``load`` ends the machine line."""
    first, cores = runs[0]["run"], os.cpu_count()
    workers = sorted({r["workers"] for r in runs})
    ranks = ", ".join(
        f"{w} ranks on {cores} cores = compute oversubscribed {w / cores:g}x"
        if w > cores
        else f"{w} ranks on {cores} cores{kw.get('fewer_ranks', '')}"
        for w in workers
    )
    return [
        title,
        "",
        f"Command: `{command(module, argv)}` ({wall:.0f} s in all).",
        "",
        f"Date: {now()}; torch {first['torch']}, {versions}.",
        "",
        f"Machine: {platform.machine()}, {cores} CPU cores shared by all ranks (and their {threads}): {ranks}, so "
        f"every step time, the local one included, is that of ranks competing for the cores{kw.get('load', '')}; "
        f"peak RSS per rank {max(r['run']['maxrss_mb'] for r in runs):.0f} MB.",
        "",
    ]


def rate_heading(r: dict) -> str:
    """The section heading of one (workers, link) run, with the link's measured throughput."""
    head = (
        f"## {r['nodes']} nodes x {r['ranks_per_node']} ranks, {r['rate']}"
        if r.get("nodes")
        else f"## {r['workers']} workers, {r['rate']}"
    )
    if r.get("throughput_Bps"):
        head += f" (measured TCP throughput w0->w1 R = {r['throughput_Bps'] * 8 / 1e6:.0f} Mbit/s)"
    return head


def stats(values) -> dict:
    """n, mean, sample standard deviation (0 for one value), min and max."""
    import numpy as np

    v = np.asarray(values, dtype=float)
    return {
        "n": int(v.size),
        "mean": float(v.mean()),
        "std": float(v.std(ddof=1)) if v.size > 1 else 0.0,
        "min": float(v.min()),
        "max": float(v.max()),
    }


def mean_se(values) -> tuple[float, float]:
    """Mean and standard error (nan for one value)."""
    m = statistics.fmean(values)
    return m, (statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else float("nan"))


def finish_paired_plot(
    fig, bx, ylabel: str, path: Path, title: str = "paired difference to fp32: mean ± 2 standard errors"
) -> None:
    """The paired-difference axis's zero line, labels and grid; the figure saved and closed."""

    bx.axhline(0, color="black", lw=0.8)
    bx.set_ylabel(ylabel)
    bx.set_title(title, fontsize=10)
    bx.grid(axis="y", alpha=0.3)
    save(fig, path)


def save(fig, path: Path, dpi: int = 110) -> None:
    """``fig`` laid out tight, saved to ``path`` and closed."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)


def pyplot():
    """matplotlib's pyplot on the Agg backend (no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
