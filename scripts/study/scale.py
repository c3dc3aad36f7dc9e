#!/usr/bin/env python
"""Calibrates the alpha-beta step model of horovod_alq/doctor/model.py on the namespace runs of
2 and 4 nodes x 2 ranks (least squares on log(predicted / measured)), predicts the flat runs out
of sample and projects to 16-1024 GPUs. Formulas, inputs, results: docs/results/scale_model.md.

    python -m scripts.study.scale     # build/results/scale_model.md, .png, data/scale_model.json
    python -m scripts.study.scale --quick --out-dir /tmp/s    # 16 and 64 GPUs, 2 rates
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import re
import sys
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

# The model itself (costs of the collectives and exchanges, one step) lives in the package, where
# python -m horovod_alq.doctor predicts with it; this script calibrates and projects it.
from horovod_alq.doctor.model import (  # noqa: F401 (re-exported: tests, the docs)
    ALQ_ROWS,
    BUCKET,
    GBIT,
    ROWS,
    SIXTEEN,
    SIXTEEN_LABELS,
    Codec,
    Cost,
    Params,
    allgather,
    alltoall,
    alq_allgather,
    alq_hierarchical,
    alq_hierarchical_two_phase,
    alq_two_phase,
    astuple,
    hier16,
    hierarchical_allreduce,
    parts,
    qbytes,
    ring16,
    ring_allreduce,
    small_allreduce,
    step_time,
)

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "docs" / "results" / "data"
#: The namespace runs of 2 and 4 nodes of 2 ranks, TCP between a node's ranks (what the model's
#: B_intra describes); the calibration fits the medians over them.
CALIBRATION = [DATA / f"bench_train_step_nodes_tcp{x}.json" for x in ("", "_2", "_3")]
CHECKS = [DATA / f for f in ("bench_train_step_cores_two.json", "bench_train_step_cores_two_B.json")]
CHECKS += [DATA / "bench_train_step_cores_two_100.json", DATA / "bench_train_step.json"]
CHECKS += [DATA / f"bench_train_step_cores_long_{x}.json" for x in "AB"]
#: The CPU kernels' report: scripts/bench/codec_widths.py's, a section of the codec speed page.
CODEC_TABLE = "docs/results/codec_speed.md#bench_codec_widths"
#: The projection's machine beyond --params, --compute, --alpha and --alpha-intra: nodes of NODE GPUs,
#: INTRA GB/s per GPU inside a node, ETA of the inter-node rate achieved, an assumed GPU codec encoding
#: GPU_CODEC coordinates/s, OVERLAP (phi) of codec/copies and wire; HOST_CORES: cores of the measuring host.
NODE, INTRA, ETA, GPU_CODEC, OVERLAP, HOST_CORES = 8, 400.0, 1.0, 1e11, 0.0, 2
HBM = 4.8e12  # bytes/s, an H200's memory bandwidth (the GPU codec's floor, for comparison only)
# the projection's reference model: 6 P tokens FLOP per step at REF_MFU of an H100's dense bf16 peak
REF_PARAMS, REF_TOKENS, REF_MFU, REF_PEAK = 1e9, 8192, 0.4, 989e12


# ----------------------------------------------------------------------------- inputs
def first_table(report: str) -> tuple[str, list[str]]:
    """The text before the first table of ``report`` (``page.md#anchor``: in that section; paths
    from the repository root) and that table's lines."""
    path, _, anchor = report.partition("#")
    text = (ROOT / path).read_text()
    if anchor:
        heading = re.search(rf"^#+ .*\{{#{re.escape(anchor)}\}}[ \t]*$", text, re.M)
        if heading is None:
            raise ValueError(f"{path} has no section with the anchor {{#{anchor}}}")
        text = text[heading.end() :]
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("|")), None)
    if start is None:
        raise ValueError(f"{report} has no table")
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
    return "\n".join(lines[:start]), lines[start:end]


def cpu_codec(report: str = CODEC_TABLE) -> tuple[Codec, str]:
    """The compiled CPU codec's AVX2 kernels (one thread) per coordinate, from the first table of
    scripts/bench/codec_widths.py's report: encode at 3 and 4 bits, decode at 3."""
    head, table = first_table(report)
    found = re.search(r"([\d,]+) float32", head)
    if found is None:
        raise ValueError(f"{report}: no 'N float32' coordinate count before its first table")
    count = int(found.group(1).replace(",", ""))
    rows = {}
    for line in table:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 7 and cells[0] == "AVX2":
            rows[int(cells[1])] = (float(cells[2]) / 1e3 / count, float(cells[5]) / 1e3 / count)
    if not {3, 4} <= rows.keys():
        raise ValueError(f"{report}: its first table has no AVX2 rows of 3 and 4 bits")
    codec = Codec(rows[3][0], rows[4][0], rows[3][1])
    return codec, f"{Path(report).name} (AVX2, one thread, {count:,} coordinates)"


def gpu_codec(throughput: float, cpu: Codec) -> Codec:
    """An assumed GPU codec: ``throughput`` coordinates/s encoded at 3 bits; 4 bits and decoding
    in the CPU kernels' proportions."""
    t = 1 / throughput
    return Codec(t, t * cpu.enc4 / cpu.enc3, t * cpu.dec / cpu.enc3)


#: How each measured row is modelled: (exchange, transport). The transport decides the
#: algorithms: Open MPI's allreduce sent hier16's bytes and its allgatherv pairwise bytes at 2 x 2
#: (the bytes table of the page), gloo's were rings.
MEASURED = {
    "hvd-fp32": ("hier16-fp32", "mpi"),
    "hvd-fp16": ("hier16", "mpi"),
    "hvd-fp16-hier": ("hier16", "mpi"),
    "hvd-alq": ("auto", "mpi"),
    "hvd-alq-ag": ("allgather", "mpi"),
    "hvd-alq-2p": ("two-phase", "mpi"),
    "hvd-alq-h": ("hierarchical", "mpi"),
    "hvd-alq-h4": ("hierarchical4", "mpi"),
    "hvd-alq-h2p": ("hierarchical-two-phase", "mpi"),
    "ddp-fp32": ("ring-fp32", "gloo"),
    "ddp-fp16": ("ring16", "gloo"),
    "ddp-bf16": ("ring16", "gloo"),
    "ddp-alq": ("auto", "gloo"),
    "ddp-alq-2p": ("two-phase", "gloo"),
    "ddp-alq-h": ("hierarchical", "gloo"),
    "ddp-alq-h2p": ("hierarchical-two-phase", "gloo"),
}


def measured_cost(key: str, p: float, n: int, g: int, small: float) -> tuple[Cost, int]:
    """The cost of a measured row (``small``: coordinates of tensors below min_size, which Horovod
    allreduces in float32 with the ALQ compressor's control vectors) and its bits."""
    exchange, transport = MEASURED[key]
    if exchange == "auto":
        exchange = "allgather" if n == 2 else "two-phase"
    ag = "pairwise" if transport == "mpi" else "ring"
    bits = 4 if exchange.endswith("4") else 3
    if exchange.startswith("hier16"):
        return hier16(p, n, g, 4 if exchange.endswith("fp32") else 2), bits
    if exchange.startswith("ring"):
        return ring_allreduce((4 if exchange.endswith("fp32") else 2) * p, n, g), bits
    cost = {
        "allgather": lambda: alq_allgather(p - small, n, g, bits, ag),
        "two-phase": lambda: alq_two_phase(p - small, n, g, bits, ag),
        "hierarchical": lambda: alq_hierarchical(p - small, n, g, bits),
        "hierarchical4": lambda: alq_hierarchical(p - small, n, g, bits),
        "hierarchical-two-phase": lambda: alq_hierarchical_two_phase(p - small, n, g, bits),
    }[exchange]()
    cost += small_allreduce(n, g)  # the round's handshake
    if transport == "mpi":
        cost += hier16(small, n, g, 4)  # the fused allreduce of the control vectors and small tensors
    return cost, bits


def load_rows(path: Path, host_cores: int = HOST_CORES) -> list[dict]:
    """Every modelled row of a bench_train_step JSON: its inputs and the measured step (the runs
    shared the ``host_cores`` cores of one machine)."""
    data = json.loads(path.read_text())
    rows = []
    for run in data["runs"]:
        res = run["run"]["results"]
        n, g = run["run"]["size"], run["run"].get("local_size") or 1
        for key, r in res.items():
            if key not in MEASURED:
                continue
            small = r.get("uncompressed_per_step", 0.0) if key.startswith("hvd-alq") else 0.0
            cost, bits = measured_cost(key, run["run"]["params"], n, g, small)
            rows.append(
                {
                    "source": path.name,
                    "layout": f"{n // g}x{g}" if g > 1 else f"{n} flat",
                    "rate": run["rate"],
                    "rate_Bps": run["throughput_Bps"],
                    "row": key,
                    "label": r["label"],
                    "params": run["run"]["params"],
                    "compute_s": res["local"]["step_s"],
                    "measured_s": r["step_s"],
                    "link_max": r.get("link_max_per_step"),
                    "lo": r.get("lo_per_step"),
                    "n": n,
                    "g": g,
                    "bits": bits,
                    "share": max(1.0, n / host_cores),
                    "cost": cost,
                }
            )
    return rows


def median_rows(paths: list[Path], host_cores: int = HOST_CORES) -> list[dict]:
    """:func:`load_rows` of repeated runs: per layout, rate and row, the median measured step
    (``runs``: how many; ``spread``: largest step over smallest)."""
    groups: dict = {}
    for path in paths:
        for r in load_rows(path, host_cores):
            groups.setdefault((r["layout"], r["rate"], r["row"]), []).append(r)
    rows = []
    for group in groups.values():
        row = dict(group[0], runs=len(group), source=", ".join(r["source"] for r in group))
        for key in ("measured_s", "compute_s", "rate_Bps", "link_max", "lo"):
            values = [r[key] for r in group if r.get(key) is not None]
            row[key] = float(np.median(values)) if values else None
        steps = [r["measured_s"] for r in group]
        row["spread"] = max(steps) / min(steps)
        rows.append(row)
    return rows


# ----------------------------------------------------------------------------- calibration
def predict(rows: list[dict], m: Params, codec: Codec) -> np.ndarray:
    """Predicted step (s) of every measured row."""
    return np.array(
        [
            step_time(r["cost"], r["compute_s"], r["rate_Bps"], m, codec, r["bits"], g=r["g"], share=r["share"])
            for r in rows
        ]
    )


def unpack(x: np.ndarray) -> Params:
    """Fit variables (logs, and a logit for phi) to Params; on one host alpha_intra = alpha and a
    byte through TCP costs the host the same inside a node or between nodes (B_host = B_intra)."""
    alpha, eta, b_intra, kappa = np.exp(x[:4])
    return Params(alpha, alpha, eta, b_intra, kappa, 1 / (1 + np.exp(-x[4])), b_intra)


def calibrate(rows: list[dict], codec: Codec) -> tuple[Params, np.ndarray, dict]:
    """Least squares on log(predicted / measured) for alpha, eta, B_intra, kappa and phi: the
    Params, the ratios and each parameter's uncertainty (a factor; +- for phi)."""
    from scipy.optimize import least_squares

    measured = np.array([r["measured_s"] for r in rows])
    x0 = np.array([np.log(1e-3), np.log(0.8), np.log(5e8), np.log(5.0), 0.0])
    fit = least_squares(lambda x: np.log(predict(rows, unpack(x), codec) / measured), x0)
    m = unpack(fit.x)
    dof = max(1, len(rows) - len(x0))
    cov = np.linalg.pinv(fit.jac.T @ fit.jac) * float(fit.fun @ fit.fun) / dof
    se = np.sqrt(np.clip(np.diag(cov), 0, None))
    spread = {k: float(np.exp(v)) for k, v in zip(("alpha", "eta", "b_intra", "kappa"), se[:4])}
    spread["phi"] = float(m.phi * (1 - m.phi) * se[4])
    return m, predict(rows, m, codec) / measured, spread


# ----------------------------------------------------------------------------- projection
def row_cost(label: str, p: float, n: int, g: int) -> tuple[Cost, int]:
    """A projection row's cost (ALQ rows: plus the control vector's and the handshake's small
    allreduces, as with Horovod) and its bits."""
    fn, quantized = {r[0]: (r[1], r[2]) for r in ROWS}[label]
    cost = fn(p, n, g)
    if quantized:
        cost += small_allreduce(n, g) * 2
    return cost, 4 if "4b" in label else 3


def project(
    p: float, compute: float, gpus: list[int], g: int, rates: list[float], m: Params, codecs: dict[str, Codec]
) -> list[dict]:
    """Step time (s) of every row of :data:`ROWS` at each GPU count, inter-node rate (bytes/s) and
    codec, with the best 16-bit row's."""
    out = []
    for codec_name, codec in codecs.items():
        for rate in rates:
            for n in gpus:
                times = {label: step_time(*_cost_bits(label, p, n, g, compute, rate, m, codec)) for label, *_ in ROWS}
                best16 = min(times[r[0]] for r in SIXTEEN)
                out.append({"codec": codec_name, "rate_Bps": rate, "gpus": n, "times": times, "best16": best16})
    return out


def _cost_bits(label, p, n, g, compute, rate, m, codec):
    cost, bits = row_cost(label, p, n, g)
    return cost, compute, rate, m, codec, bits


def crossover(
    label: str, p: float, compute: float, n: int, g: int, m: Params, codec: Codec, lo: float = 1e6 / 8, hi=1e13 / 8
) -> float | None:
    """The inter-node rate (bytes/s) below which ``label`` beats the best 16-bit exchange (bisection
    on log rate in [lo, hi]); inf when faster everywhere, None when nowhere."""

    def gap(rate):  # < 0: the ALQ row is faster
        best = min(step_time(*_cost_bits(r[0], p, n, g, compute, rate, m, codec)) for r in SIXTEEN)
        return step_time(*_cost_bits(label, p, n, g, compute, rate, m, codec)) - best

    if gap(lo) >= 0:
        return None
    if gap(hi) < 0:
        return math.inf
    a, b = math.log(lo), math.log(hi)
    for _ in range(80):
        mid = (a + b) / 2
        a, b = (mid, b) if gap(math.exp(mid)) < 0 else (a, mid)
    return math.exp((a + b) / 2)


# ----------------------------------------------------------------------------- the report
def fmt_ms(s: float) -> str:
    ms = s * 1e3
    return f"{ms:,.0f}" if ms >= 100 else f"{ms:.1f}" if ms >= 1 else f"{ms:.2f}"


def fmt_rate(rate: float | None) -> str:
    """A rate in bytes/s as Gbit/s or Mbit/s; None: never; inf: every rate."""
    if rate is None:
        return "never"
    if math.isinf(rate):
        return "every rate"
    gbit = rate / GBIT
    if gbit >= 100:
        return f"{gbit:,.0f} Gbit/s"
    return f"{gbit:.3g} Gbit/s" if gbit >= 1 else f"{gbit * 1e3:.3g} Mbit/s"


def outside(ratio: float) -> bool:
    return abs(math.log(ratio)) > math.log(1.25)


def measured_table(rows: list[dict], ratios, m: Params, codec: Codec, source: bool = False) -> list[str]:
    """Predicted against measured, one line per row, with L and W (and the runs' spread when the rows
    are medians of repeated runs)."""
    spread = all("spread" in r for r in rows)
    lines = [
        ("| source " if source else "")
        + "| layout | rate | row | compute ms | L ms | W ms | predicted ms | measured ms | predicted / measured |"
        + (" runs' max / min |" if spread else ""),
        ("|---" if source else "") + "|---|---|---|---:|---:|---:|---:|---:|---:|" + ("---:|" if spread else ""),
    ]
    for r, ratio in zip(rows, ratios):
        local, wire = parts(r["cost"], r["rate_Bps"], m, codec, r["bits"], g=r["g"], share=r["share"])
        flag = " **outside 25%**" if outside(ratio) else ""
        lines.append(
            (f"| {r['source']} " if source else "")
            + f"| {r['layout']} | {r['rate']} | {r['label']} | {fmt_ms(r['compute_s'])} | {fmt_ms(local)} | "
            f"{fmt_ms(wire)} | {fmt_ms(r['measured_s'] * ratio)} | {fmt_ms(r['measured_s'])} | {ratio:.2f}{flag} |"
            + (f" {r['spread']:.2f} |" if spread else "")
        )
    return lines


def spreads_by_layout(rows: list[dict]) -> dict[str, list[float]]:
    """The runs' spread of each median row, by layout (empty for rows of one run)."""
    out: dict[str, list[float]] = {}
    for r in rows:
        if r.get("runs", 1) > 1:
            out.setdefault(r["layout"], []).append(r["spread"])
    return out


def bytes_table(rows: list[dict]) -> list[str]:
    """The model's bytes against the interface counters of the calibration runs."""
    lines = [
        "| rate | row | between nodes, model: MB per node | busiest node link, measured: MB | measured / model "
        "| inside nodes, model: MB, all ranks | lo, measured: MB, all nodes | measured / model |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        c = r["cost"]
        intra = c.intra * r["n"]
        lines.append(
            f"| {r['rate']} | {r['label']} | {c.inter / 1e6:.3f} | {r['link_max'] / 1e6:.3f} | "
            f"{r['link_max'] / c.inter:.2f} | {intra / 1e6:.3f} | {r['lo'] / 1e6:.3f} | {r['lo'] / intra:.2f} |"
        )
    return lines


def projection_table(proj: list[dict], codec_name: str) -> list[str]:
    """Step ms of every row (ALQ rows: and their ratio to the best 16-bit row) per scale and rate."""
    labels = [r[0] for r in ROWS]
    lines = ["| GPUs | between nodes | " + " | ".join(labels) + " |", "|---:|---|" + "---:|" * len(labels)]
    for x in (x for x in proj if x["codec"] == codec_name):
        cells = [
            fmt_ms(x["times"][k])
            if k in SIXTEEN_LABELS
            else f"{fmt_ms(x['times'][k])} ({x['times'][k] / x['best16']:.2f})"
            for k in labels
        ]
        lines.append(f"| {x['gpus']} | {x['rate_Bps'] / GBIT:g} Gbit/s | " + " | ".join(cells) + " |")
    return lines


def crossover_table(cross: list[dict], codec_name: str) -> list[str]:
    labels = [r[0] for r in ROWS[2:]]
    lines = ["| GPUs | nodes | " + " | ".join(labels) + " |", "|---:|---:|" + "---|" * len(labels)]
    for n in sorted({c["gpus"] for c in cross}):
        got = {c["label"]: c["rate_Bps"] for c in cross if c["gpus"] == n and c["codec"] == codec_name}
        nodes = next(c["nodes"] for c in cross if c["gpus"] == n)
        lines.append(f"| {n} | {nodes} | " + " | ".join(fmt_rate(got[k]) for k in labels) + " |")
    return lines


def plot(path: Path, rows: list[dict], ratios, proj: list[dict], rates: list[float], g: int) -> None:
    """Left: calibration, predicted against measured; then one panel per inter-node rate: every
    ALQ row's step over the best 16-bit step against the GPU count, GPU codec solid, CPU dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    fig, axes = plt.subplots(1, 1 + len(rates), figsize=(4.3 * (1 + len(rates)), 4.4))
    ax = axes[0]
    meas = np.array([r["measured_s"] for r in rows]) * 1e3
    for rate, marker in zip(sorted({r["rate"] for r in rows}), "os^v"):
        sel = np.array([r["rate"] == rate for r in rows])
        ax.scatter(
            meas[sel], (meas * ratios)[sel], s=20, marker=marker, color="black", label=f"{rows[0]['layout']}, {rate}"
        )
    lim = np.array([0.0, 1.15 * max(meas.max(), (meas * ratios).max())])
    ax.plot(lim, lim, "k-", lw=0.8)
    ax.fill_between(lim, lim / 1.25, lim * 1.25, color="grey", alpha=0.2, label="within 25%")
    ax.set(xlim=lim, ylim=lim, xlabel="measured step, ms", ylabel="predicted step, ms", title="calibration")
    ax.legend(fontsize=7, loc="upper left")
    colors = ["tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown"]
    for ax, rate in zip(axes[1:], rates):
        for codec, style in (("GPU codec", "-"), ("CPU codec", "--")):
            pts = [x for x in proj if x["rate_Bps"] == rate and x["codec"] == codec]
            for (label, *_), color in zip(ROWS[2:], colors):
                ys = [x["times"][label] / x["best16"] for x in pts]
                ax.plot([x["gpus"] for x in pts], ys, style, color=color, marker=".")
        ax.axhline(1.0, color="black", lw=0.8)
        ax.set(xscale="log", yscale="log", xlabel=f"GPUs (nodes of {g})", ylabel="step / best 16-bit step")
        ax.set_title(f"{rate / GBIT:g} Gbit/s between nodes")
    handles = [Line2D([], [], color=c, marker=".", label=r[0]) for r, c in zip(ROWS[2:], colors)]
    handles += [
        Line2D([], [], color="grey", ls=ls, label=name) for ls, name in (("-", "GPU codec"), ("--", "CPU codec"))
    ]
    fig.legend(handles=handles, loc="lower center", ncol=4, fontsize=8)
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


FORMULAS = [
    ("ring allreduce fp16/bf16", "2(N-1)/N · 2P", "(G-1)/G · 2(N-1)/N · 2P", "2(N-1) / 0", "-"),
    ("Horovod hierarchical fp16", "2(M-1)/M · 2P", "2(G-1)/G · 2P", "2(M-1) / 2(G-1)", "-"),
    ("ALQ flat allgather", "(N-1) Pq", "(G-1)/G · (N-1) Pq", "N-1 / 0", "P / N·P"),
    (
        "ALQ two-phase",
        "G(M-1)/M · Pq + (N-1)/N · Pq",
        "(G-1) Pq/N + (G-1)/G · (N-1)/N · Pq",
        "2N-G-1 / G-1",
        "P + P/N / 2P",
    ),
    ("ALQ hierarchical", "(M-1) Pq", "(G-1)/G · 4P + (G-1) M Pq/G", "M-1 / 2(G-1)", "P/G / M·P"),
    (
        "ALQ hierarchical two-phase",
        "2(M-1)/M · Pq",
        "(G-1)/G · 4P + (G-1) Pq/G",
        "2(M-1) / 2(G-1)",
        "P/G + P/N / P + P/G",
    ),
]

ASSUMPTIONS = """\
What the model leaves out, and what that does to its numbers:

- **No overlap in the projection** (phi = 0): the exchange and the codec follow the whole compute.
  Real front-ends start buckets during the backward pass (DDP, Horovod's hooks; the 2-worker check
  below shows Horovod fp16 hiding most of its allreduce under the backward when each rank has a core),
  which helps every row by up to the backward's length: the ratios to 16-bit move towards 1 where the
  exchange is short and stay where it dominates. phi was fitted on the calibration host only, where
  it stands for ranks using the cores while others wait on the wire.
- **One buffer per stage**: the whole gradient in one collective per stage, so the latency terms
  count once per stage; fusion into k buffers multiplies them by about k for every row.
- **No congestion, no stragglers, no tail latency**: a non-blocking switch, every node's link at
  eta R in each direction at once, all ranks in step. Alltoalls of many small blocks (two-phase at
  1024 GPUs sends blocks of P q / N) usually get less than line rate; only alpha per message
  stands for that.
- **Codec time is kernel time**: coordinates / throughput, measured on one CPU core (kappa = 1 in
  the projection), or an assumed GPU throughput. Not modelled: moving the gradient between GPU and
  host for the CPU codec (over PCIe, about 4 bytes per coordinate each way), the codec's memory
  traffic competing with the compute, the refit rounds (every 10,000 steps), the float32 sums of
  the node shards, Python and launch overheads. The calibration's kappa says how much the whole
  quantized path cost per coordinate on the measuring machine against its kernels.
- **Collective algorithms are fixed**: 16-bit allreduces are rings (flat) or Horovod's hierarchical
  scheme; allgathers are rings, alltoalls pairwise. NCCL's tree and NVLS algorithms, in-network
  reduction (SHARP) and several NICs per node are not modelled (the inter-node rate is per node).
- **Bytes**: the 32-byte payload headers, the tensors below min_size (sent in float32) and the
  bucket alignment of tensors inside a fusion buffer are left out of the projection.
"""


def headline(proj: list[dict], gpus: list[int]) -> list[str]:
    """Both hierarchical ALQ 3b exchanges and the best ALQ row against the best 16-bit row at the
    largest scales."""
    lines = [
        "| GPUs | between nodes | codec | best 16-bit, ms | ALQ 3b hierarchical / best 16-bit "
        "| ALQ 3b hierarchical two-phase / best 16-bit | best ALQ row / best 16-bit |",
        "|---:|---|---|---:|---:|---:|---|",
    ]
    for x in proj:
        if x["gpus"] not in gpus:
            continue
        best = min(ALQ_ROWS, key=lambda k: x["times"][k])
        lines.append(
            f"| {x['gpus']} | {x['rate_Bps'] / GBIT:g} Gbit/s | {x['codec']} | {fmt_ms(x['best16'])} | "
            f"{x['times']['ALQ 3b hierarchical'] / x['best16']:.2f} | {x['times'][ROWS[-1][0]] / x['best16']:.2f} | "
            f"{best}: {x['times'][best] / x['best16']:.2f} |"
        )
    return lines


def twins(checks: list) -> str:
    """The widest spread of measured steps among rows of one run that the model cannot tell apart
    (same predicted cost), a floor for any model's error on those runs."""
    groups = {}
    for r, ratio in checks:
        key = (r["source"], r["layout"], r["rate"], round(r["measured_s"] * ratio, 9))
        groups.setdefault(key, []).append(r)
    spread = [(max(v, key=lambda r: r["measured_s"]), min(v, key=lambda r: r["measured_s"])) for v in groups.values()]
    hi, lo = max(spread, key=lambda pair: pair[0]["measured_s"] / pair[1]["measured_s"])
    if hi is lo:
        return "no two rows of one run share a prediction."
    return (
        f"there, {hi['label']} and {lo['label']} ({lo['source']}, {lo['layout']}, {lo['rate']}) ran the same "
        f"exchange and measured {fmt_ms(hi['measured_s'])} and {fmt_ms(lo['measured_s'])} ms, "
        f"{hi['measured_s'] / lo['measured_s']:.2f}x apart: no model fits both within 25%."
    )


def report(args, argv, rows, ratios, fitted, spread, checks, proj, cross, codecs, codec_src, wall) -> str:
    rates = [float(v) for v in args.rates.split(",")]
    gpus = [int(v) for v in args.gpus.split(",")]
    within = sum(not outside(x) for x in ratios)
    check_ratios = np.array([x for _, x in checks])
    check_within = int(sum(not outside(x) for x in check_ratios))
    cpu, gpu = codecs["CPU codec"], codecs["GPU codec"]
    q3 = qbytes(3)
    by = {}
    for r, x in zip(rows, ratios):
        by.setdefault((MEASURED[r["row"]][1], r["rate"]), []).append(x)
    pattern = "; ".join(
        f"{'Horovod (Open MPI)' if t == 'mpi' else 'DDP (gloo)'} rows at {rate}: {min(v):.2f}-{max(v):.2f}"
        for (t, rate), v in sorted(by.items())
    )
    groups = {}
    for r, x in checks:
        groups.setdefault((r["layout"], "ALQ" if "alq" in r["row"] else "16/32-bit"), []).append(x)
    check_pattern = "; ".join(f"{lay}, {kind} rows: {min(v):.2f}-{max(v):.2f}" for (lay, kind), v in groups.items())
    big = [n for n in (256, 1024) if n in gpus] or gpus[-2:]
    twin = twins(checks)
    ref_compute = 6 * REF_PARAMS * REF_TOKENS / (REF_MFU * REF_PEAK)
    msgs = [r["cost"].msgs + r["cost"].msgs_intra for r in rows]
    layouts = " and ".join(dict.fromkeys(r["layout"].replace("x", " nodes x ") + " ranks" for r in rows))
    runs = max(r.get("runs", 1) for r in rows)
    sources = [str(c.relative_to(ROOT)) for c in CALIBRATION if c.exists()]
    pages = ", ".join(f"[{Path(c).stem}](bench_train_step.md#{Path(c).stem})" for c in sources)
    out = [
        f"# A scale model of the training step (alpha-beta), calibrated on {layouts}",
        "",
        f"Command: `{' '.join(['python -m scripts.study.scale', *argv])}` "
        f"({wall:.1f} s). Date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC. "
        "Every number on this page comes from that run (scripts/study/scale.py; its data: "
        "[data/scale_model.json](data/scale_model.json)); nothing was measured for it: it reads the "
        "measurements below.",
        "",
        "## Summary",
        "",
        f"- **Calibration**: {within} of {len(rows)} measured steps of {layouts} (100 Mbit/s and 1 Gbit/s "
        f"between nodes; each the median over {runs} runs) predicted within 25%; predicted / measured "
        f"{ratios.min():.2f} to {ratios.max():.2f} "
        f"with 5 global parameters (alpha {fitted.alpha * 1e3:.3g} ms, eta {fitted.eta:.2f}, "
        f"B_intra {fitted.b_intra / 1e6:.0f} MB/s, kappa {fitted.kappa:.1f}, phi {fitted.phi:.2f})."
        + (
            " Rows outside 25%: "
            + ", ".join(
                f"{r['layout']} {r['label']} at {r['rate']} ({x:.2f})" for r, x in zip(rows, ratios) if outside(x)
            )
            + "."
            if within < len(rows)
            else ""
        )
        + "".join(
            f" The {layout} rows' own runs spread by up to {max(spreads):.2f}x (largest step over smallest)."
            for layout, spreads in spreads_by_layout(rows).items()
        ),
        f"- **Out of sample** (the flat runs, not fitted: other rank counts, another model width, runs the "
        f"pages call noisy): {check_within} of {len(checks)} within 25%, predicted / measured "
        f"{check_ratios.min():.2f} to {check_ratios.max():.2f} ({check_pattern}): the host parameters "
        "(kappa, B_intra, phi) belong to the oversubscribed node runs and do not carry over well; the "
        "bytes do (the bytes table)."
        if checks
        else "- No out-of-sample runs read.",
        f"- **Projection** (P = {args.params:.3g} parameters, compute {args.compute * 1e3:g} ms per step, nodes of "
        f"{NODE}, {INTRA:g} GB/s inside a node, alpha {args.alpha * 1e6:g} us between nodes): "
        f"the hierarchical exchange sends (M-1) P q between nodes per node, an allgather of the node sums, "
        f"against 2(M-1)/M · 2P for Horovod's hierarchical fp16: at 3 bits (q = {q3:.4f} B) fewer bytes only while "
        f"M < 4/q = {4 / q3:.1f} nodes. The hierarchical two-phase exchange (what exchange='auto' picks from 4 "
        f"nodes on) sends 2(M-1)/M P q, q/2 = {q3 / 2:.3f}x Horovod's hierarchical fp16 at every M. Step against "
        "the best 16-bit exchange at the largest scales:",
        "",
        *headline(proj, big),
        "",
        "See the crossover tables below for the rate under which each ALQ row wins at each scale.",
        "",
        "## The model",
        "",
        "Per step and exchange, with N ranks in M nodes of G, P coordinates, q = b/8 + 4/8192 bytes per "
        "quantized coordinate (b bits and a float32 norm per bucket of 8192):",
        "",
        "| exchange | between nodes, bytes per node | inside a node, bytes per rank | messages between / inside "
        "| encoded / decoded coordinates per rank |",
        "|---|---|---|---|---|",
        *[f"| {' | '.join(f)} |" for f in FORMULAS],
        "",
        "Every ALQ row adds two latency-only allreduces (control vector, handshake: log2 M + log2 G messages "
        "each). A step is",
        "",
        "    T = T_compute + L + W - phi min(L, W)",
        "    L = share [kappa (encoded t_enc + decoded t_dec) + intra / B_intra + (inter / G) / B_host "
        "+ messages inside alpha_intra]",
        "    W = inter / (eta R) + messages between alpha",
        "",
        "L is the host's (or GPU's) own work, W the wire. In the calibration share = ranks / host cores "
        f"(the runs shared {HOST_CORES} cores), B_host = B_intra (on one host a byte through TCP costs "
        "the same to loopback or to a veth) and alpha_intra = alpha; in the projection share = 1, "
        "B_host infinite (RDMA), kappa = 1 and phi = "
        f"{OVERLAP:g}. The formulas are the docstrings of `ring_allreduce`, `hierarchical_allreduce`, "
        "`alltoall`, `allgather` and the `alq_*` functions of scripts/study/scale.py, checked against "
        "hand-computed cases in tests/test_scale_model.py.",
        "",
        ASSUMPTIONS,
        "## Inputs",
        "",
        f"- Step times: {', '.join(f'`{c}`' for c in sources)} ({pages}): one command run {len(sources)} "
        f"times, ResNet-18-shaped CNN at width 0.25 ({rows[0]['params']:,} parameters), {layouts} in "
        "network namespaces on one 2-core machine (TCP between a node's ranks too), slowest rank's median "
        "step; for each row the median over the runs of its step, of its run's 'alone' row (compute) and "
        "of the run's measured TCP throughput (R).",
        f"- CPU codec: {codec_src}: encode {cpu.enc3 * 1e9:.3f} ns per coordinate at 3 bits, "
        f"{cpu.enc4 * 1e9:.3f} at 4, decode-and-add {cpu.dec * 1e9:.3f} ns per coordinate and payload.",
        "- GPU codec: **not measured** (no GPU here; [the GPU codec's report](codec_speed.md#bench_gpu) has the "
        f"command): an assumed {GPU_CODEC:.3g} coordinates/s encoded at 3 bits ({gpu.enc3 * 1e12:.3g} ps per "
        f"coordinate), 4 bits and decoding in the CPU kernels' proportions ({gpu.enc4 * 1e12:.3g} and "
        f"{gpu.dec * 1e12:.3g} ps). The memory floor of an H200 ({HBM / 1e12:g} TB/s, 4 B read and q written per "
        f"coordinate) would allow {HBM / (4 + q3) / GPU_CODEC:.0f}x this encode rate.",
        f"- Projection model: P = {args.params:.3g} parameters and {args.compute * 1e3:g} ms of compute per step "
        f"(`--params`, `--compute`): a transformer of {REF_PARAMS:,.0f} parameters at {REF_TOKENS} tokens per GPU "
        f"and step takes 6 P tokens = {6 * REF_PARAMS * REF_TOKENS:.2e} FLOP, {ref_compute * 1e3:.0f} ms at "
        f"{REF_MFU:.0%} of an H100's {REF_PEAK / 1e12:g} TFLOP/s (bf16, dense); the default rounds that.",
        f"- Network: {', '.join(f'{r:g}' for r in rates)} Gbit/s per node between nodes at eta = {ETA:g} "
        f"of it, {INTRA:g} GB/s per GPU inside a node, alpha = {args.alpha * 1e6:g} us per message between "
        f"nodes and {args.alpha_intra * 1e6:g} us inside (`--alpha`, `--alpha-intra`).",
        "",
        "## Calibration",
        "",
        "Fitted by least squares on log(predicted / measured) over every row below (uncertainty from the "
        "fit's Jacobian: x/÷ a factor for those fitted as logs):",
        "",
        "| parameter | fitted | uncertainty | meaning |",
        "|---|---:|---:|---|",
        f"| alpha | {fitted.alpha * 1e3:.3g} ms | x/÷ {spread['alpha']:.2g} | per message (each row has "
        f"{min(msgs):g} to {max(msgs):g}: weakly constrained) |",
        f"| eta | {fitted.eta:.3f} | x/÷ {spread['eta']:.2g} | fraction of the measured TCP rate the exchanges got |",
        f"| B_intra = B_host | {fitted.b_intra / 1e6:.0f} MB/s | x/÷ {spread['b_intra']:.2g} | per rank with a core "
        "of its own: loopback copies and TCP work on the host |",
        f"| kappa | {fitted.kappa:.1f} | x/÷ {spread['kappa']:.2g} | the quantized path's time per coordinate "
        "over the codec kernels' (Python, copies, sums, allocation: not the kernels) |",
        f"| phi | {fitted.phi:.2f} | ± {spread['phi']:.2f} | overlap of the host's work with the wire |",
        "",
        f"Residuals by front-end and rate: {pattern}. L and W are the model's host work and wire time "
        "(before the overlap); compute is the run's measured step without an exchange.",
        "",
        *measured_table(rows, ratios, fitted, cpu),
        "",
        "The model's bytes against the interface counters of the same runs (whole frames, the barrier and "
        "Horovod's coordination included; the model has no headers; Horovod's ALQ rows also carry the "
        "bucket alignment of tensors inside the fusion buffer, which the model leaves out):",
        "",
        *bytes_table(rows),
        "",
    ]
    if checks:
        out += [
            "### Out of sample: the flat runs",
            "",
            "The same parameters on the one-rank-per-namespace runs (G = 1; "
            f"{', '.join(f'{v:,}' for v in sorted({r['params'] for r, _ in checks}))} parameters). Not fitted. "
            "With 2 workers each rank had a core; bench_train_step.json timed few steps per row with 4 and 8 "
            f"ranks on the 2 cores ([its page](bench_train_step.md)): {twin}",
            "",
            *measured_table([r for r, _ in checks], check_ratios, fitted, cpu, source=True),
            "",
        ]
    out += [
        "## Projection",
        "",
        f"Step time in ms; for the ALQ rows (in brackets) over the best 16-bit row's. Nodes of {NODE}.",
        "",
        "![scale model](scale_model.png)",
        "",
    ]
    for name in codecs:
        out += [f"### {name}", "", *projection_table(proj, name), ""]
    out += [
        "## Crossover: the rate between nodes below which each ALQ row beats the best 16-bit exchange",
        "",
        "Solved by bisection on log(rate) from 1 Mbit/s to 10 Tbit/s (per node, as the model's eta R); "
        "'never': slower at every rate (it sends more bytes between nodes than a 16-bit allreduce); "
        "'every rate': faster at every rate.",
        "",
    ]
    for name in codecs:
        out += [f"### {name}", "", *crossover_table(cross, name), ""]
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="a small grid: 16 and 64 GPUs, 10 and 100 Gbit/s")
    out_help = "writes scale_model.md, .png and data/scale_model.json; default build/results"
    p.add_argument("--out-dir", default="build/results", help=out_help)
    p.add_argument("--params", type=float, default=1e9, help="projection: gradient coordinates P")
    p.add_argument("--compute", type=float, default=0.125, help="projection: compute per step, s")
    p.add_argument("--gpus", default="16,32,64,128,256,512,1024", help="projection: GPU counts")
    p.add_argument("--rates", default="10,25,100", help="projection: inter-node rates, Gbit/s per node")
    p.add_argument("--alpha", type=float, default=5e-6, help="projection: s per message between nodes")
    p.add_argument("--alpha-intra", type=float, default=1e-6, help="projection: s per message inside a node")
    args = p.parse_args(argv)
    if args.quick:
        args.gpus, args.rates = "16,64", "10,100"
    started = time.time()
    cpu, codec_src = cpu_codec()
    rows = median_rows([c for c in CALIBRATION if c.exists()])
    fitted, ratios, spread = calibrate(rows, cpu)
    checks = []
    for path in CHECKS:
        if path.exists():
            rs = load_rows(path)
            checks += list(zip(rs, predict(rs, fitted, cpu) / np.array([r["measured_s"] for r in rs])))
    machine = Params(args.alpha, args.alpha_intra, ETA, INTRA * 1e9, 1.0, OVERLAP)
    codecs = {"GPU codec": gpu_codec(GPU_CODEC, cpu), "CPU codec": cpu}
    gpus = [int(v) for v in args.gpus.split(",")]
    rates = [float(v) * GBIT for v in args.rates.split(",")]
    g = NODE
    proj = project(args.params, args.compute, gpus, g, rates, machine, codecs)
    cross = [
        {
            "codec": name,
            "gpus": n,
            "nodes": n // g,
            "label": label,
            "rate_Bps": crossover(label, args.params, args.compute, n, g, machine, codec),
        }
        for name, codec in codecs.items()
        for n in gpus
        for label, *_ in ROWS[2:]
    ]
    out = Path(args.out_dir)
    (out / "data").mkdir(parents=True, exist_ok=True)
    plot(out / "scale_model.png", rows, ratios, proj, rates, g)
    argv_list = list(argv) if argv is not None else sys.argv[1:]
    wall = time.time() - started
    text = report(args, argv_list, rows, ratios, fitted, spread, checks, proj, cross, codecs, codec_src, wall)
    (out / "scale_model.md").write_text(text)

    def row_json(r, ratio):
        return {k: v for k, v in r.items() if k != "cost"} | {
            "cost": asdict(r["cost"]),
            "predicted_over_measured": ratio,
        }

    def json_rate(x):  # None: never; "inf": at every rate
        return None if x is None else ("inf" if math.isinf(x) else x)

    data = {
        "argv": argv_list,
        "args": vars(args),
        "codecs": {k: asdict(v) for k, v in codecs.items()},
        "codec_source": codec_src,
        "fitted": asdict(fitted),
        "fitted_uncertainty": spread,
        "calibration": [row_json(r, float(x)) for r, x in zip(rows, ratios)],
        "checks": [row_json(r, float(x)) for r, x in checks],
        "projection": proj,
        "crossover": [c | {"rate_Bps": json_rate(c["rate_Bps"])} for c in cross],
    }
    (out / "data" / "scale_model.json").write_text(json.dumps(data, indent=1, default=float) + "\n")
    print(f"wrote {out / 'scale_model.md'}, {out / 'scale_model.png'}, {out / 'data' / 'scale_model.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
