#!/usr/bin/env python
"""The gradient exchange of one TensorFlow training step (issue 53): a ResNet's gradients averaged
over 4 ranks with Horovod TensorFlow (CPU, MPI operations) inside one ``tf.function`` per row, in
network namespaces with tc-shaped links (2 nodes x 2 ranks at 1 Gbit/s and 100 Mbit/s), against
Horovod's fp16 compression and against this package's per-tensor TF path. Needs root (ip netns,
tc), except --local and --help.

    python -m scripts.bench.tf_step --layout 2x2 --rates 1gbit,100mbit --repeats 2 \\
        --out build/results/bench_tf_step.md       # ResNet-50 shapes, 10 timed steps: about 25 minutes
    python -m scripts.bench.tf_step --layout 2x2 --rates 1gbit,100mbit --repeats 2 \\
        --rows fp32,fp16,alq-tensor@2p,alq-fused,alq-fused@2p --out build/results/bench_tf_step_2p.md
    python -m scripts.bench.tf_step --layout 2x2 --rates 1gbit,100mbit \\
        --rows fp16,alq-tensor,alq-fused,alq-fused@16,alq-fused@4 --out build/results/bench_tf_step_fusion.md
    python -m scripts.bench.tf_step --layout 2x2 --quick    # ResNet-18 at width 0.25, 3 steps: 3 minutes
    python -m scripts.bench.tf_step --local --workers 2 --quick   # loopback, no root: about 30 s

The namespaces, links, shaping and the mpirun launch are scripts/common/network.py's (see its
docstring); --layout KxG puts G consecutive ranks in each of K namespaces ("nodes":
``HOROVOD_ALQ_LOCAL_SIZE=G`` and Open MPI's local size G), the nodes joined by the shaped links,
the ranks of a node by their namespace's loopback.

What each rank exchanges: gradients with the parameter shapes of torchvision's ResNet-50 (161
tensors, 25,557,032 elements; --model resnet18: 62 tensors, 11,689,512) in TensorFlow's layout
(convolutions (k, k, in, out), the classifier (in, out)), from scripts/common/bench.py (no model
is built, nothing downloaded); --width scales every channel count (the classifier keeps its 1,000
outputs). Each rank fills them with its own random normal values (seed 1234 + rank, a scale
10^-U(1,4) per tensor), once; every step exchanges the same tensors.

Rows (--rows; each one ``tf.function`` called with the list of gradients, returning the list of
averages; one compressor object per row):

- ``fp32``: ``hvd.allreduce(g, op=hvd.Average, name=...)`` for each gradient (what
  ``hvd.DistributedGradientTape`` does without compression);
- ``fp16``: the same with ``compression=hvd.Compression.fp16``;
- ``alq-tensor``: the same with ``compression=ALQCompressor(bits=3, bucket_size=8192)``: the
  per-tensor TF path (each tensor its own exchange);
- ``alq-fused``: ``horovod_alq.tensorflow.fused_allreduce(grads, compression=ALQCompressor(...),
  op=hvd.Average)``: the tensors packed into fusion buffers of the compressor's ``fusion_bytes``.
  Where horovod_alq.tensorflow has no ``fused_allreduce`` yet, the row is skipped with a note.

Suffixes, after ``@``, combine: a number sets ``fusion_bytes`` in MiB (``alq-fused@4``); ``hier``,
``h2p``, ``2p``, ``ag`` and ``auto`` set ``exchange=`` to "hierarchical", "hierarchical-two-phase",
"two-phase", "allgather" or "auto" (the default: at 2 nodes x 2 ranks "auto" is "hierarchical",
on one node of 2 ranks "allgather"; the table names the exchange each row used). A row whose
compressor refuses its settings is skipped with the reason.

Rows interleaved step by step in the same processes, a barrier (a one-element allreduce) before
each row's step, so the machine's noise hits them alike. The first call of each row (tracing,
graph preparation, the codec's XLA compiles per tensor shape, Horovod's first negotiation of every
name) and the second (the ALQ compressors' refit of their levels from the first call's statistics)
are reported apart; --warmup calls in all (at least 2), then --steps timed ones. Per row: the
slowest rank's step, median and min-max over the timed steps; its ratio to fp16 and to alq-tensor,
taken step by step (same step index) and summarized as median and min-max; bytes sent per step and
rank (ALQ rows: ``metrics()["bytes_sent"]`` over the timed rounds plus 2(N-1)/N x 4 B per
coordinate sent uncompressed; fp32 and fp16: 2(N-1)/N x 4 or 2 B x elements, a bandwidth-optimal
ring allreduce); in the namespaces the bytes that crossed each node's eth0 during the row's steps.
After the last step: whether every rank holds identical averages (a digest per rank) and rank 0's
relative error ||average - exact mean|| / ||exact mean|| (rank 0 regenerates every rank's gradients).

--repeats R launches everything R times per rate (separate mpirun launches, the rates in turn), so
ranges over repeated runs can be quoted; the report ends with the issue's targets per launch.
Machine load (os.getloadavg) is recorded before and after every launch.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from scripts.common import launch, report, timing
from scripts.common import network as net
from scripts.common.bench import numel, resnet18_shapes, resnet50_shapes

BASES = ("fp32", "fp16", "alq-tensor", "alq-fused")
EXCHANGES = {
    "auto": "auto",
    "ag": "allgather",
    "2p": "two-phase",
    "hier": "hierarchical",
    "h2p": "hierarchical-two-phase",
}
DEFAULT_ROWS = "fp32,fp16,alq-tensor,alq-fused"
FULL = dict(workers="4", rates="1gbit,100mbit", model="resnet50", width=1.0, steps=10, warmup=2, timeout=3600.0)
QUICK = dict(workers="4", rates="1gbit,100mbit", model="resnet18", width=0.25, steps=3, warmup=2, timeout=600.0)
MODELS = {"resnet50": resnet50_shapes, "resnet18": resnet18_shapes}
#: The issue's targets for every alq-fused row: (reference, rate, the row's step over the reference's
#: at most); "tensor": the row's per-tensor reference (:func:`tensor_ref`).
TARGETS = [("fp16", "100mbit", 0.6), ("tensor", "1gbit", 1 / 1.5)]
FIELDS = ("step_s", "cpu_main_s", "cpu_all_s")


class Unavailable(Exception):
    """A row this installation cannot run (reason in the message); it is skipped on every rank."""


# ---------------------------------------------------------------------------------------- rows
def parse_row(key: str) -> dict:
    """``base[@suffix...]`` into {"base", "exchange", "fusion_mib"}; ValueError if malformed."""
    base, *parts = key.split("@")
    if base not in BASES:
        raise ValueError(f"row {key!r}: unknown base {base!r}, choose from {', '.join(BASES)}")
    spec = {"base": base, "exchange": "auto", "fusion_mib": None}
    for part in parts:
        if part in EXCHANGES:
            spec["exchange"] = EXCHANGES[part]
            continue
        try:
            spec["fusion_mib"] = float(part)
        except ValueError:
            raise ValueError(
                f"row {key!r}: suffix {part!r} is neither a fusion size in MiB nor one of {', '.join(EXCHANGES)}"
            ) from None
    if base in ("fp32", "fp16") and parts:
        raise ValueError(f"row {key!r}: {base} takes no suffix")
    return spec


def label(key: str, args) -> str:
    spec = parse_row(key)
    if spec["base"] == "fp32":
        return "Horovod fp32 (Compression.none), per tensor"
    if spec["base"] == "fp16":
        return "Horovod fp16 (Compression.fp16), per tensor"
    how = "fused_allreduce" if spec["base"] == "alq-fused" else "per tensor"
    fusion = f", fusion_bytes={spec['fusion_mib']:g} MiB" if spec["fusion_mib"] is not None else ""
    return f"ALQ {args.bits}b, {how}, exchange={spec['exchange']}{fusion}"


def build_row(key: str, args, hvd, tf) -> dict:
    """Row ``key``'s {"fn": its tf.function, "comp": its ALQ compressor or None}; :class:`Unavailable`
    where it cannot run here."""
    spec = parse_row(key)
    comp = None
    if spec["base"] == "fp32":
        compression = hvd.Compression.none
    elif spec["base"] == "fp16":
        compression = hvd.Compression.fp16
    else:
        from horovod_alq.tensorflow import ALQCompressor

        kw = dict(bits=args.bits, bucket_size=args.bucket_size, exchange=spec["exchange"])
        if spec["fusion_mib"] is not None:
            kw["fusion_bytes"] = int(spec["fusion_mib"] * 2**20)
        try:
            comp = compression = ALQCompressor(**kw)
        except (ValueError, TypeError) as e:
            raise Unavailable(f"ALQCompressor({', '.join(f'{k}={v!r}' for k, v in kw.items())}) refused: {e}") from e
    if spec["base"] == "alq-fused":
        import horovod_alq.tensorflow as alq_tf

        fused = getattr(alq_tf, "fused_allreduce", None)
        if fused is None:
            raise Unavailable("horovod_alq.tensorflow has no fused_allreduce (not written yet in this checkout)")

        def step(grads):
            return fused(list(grads), compression=comp, op=hvd.Average)

    else:

        def step(grads):
            return [
                hvd.allreduce(g, op=hvd.Average, compression=compression, name=f"{key.replace('@', '_')}.{i}")
                for i, g in enumerate(grads)
            ]

    return {"fn": tf.function(step), "comp": comp}


# ---------------------------------------------------------------------------------------- gradients
def tf_shapes(model: str, width: float) -> list[tuple[str, tuple[int, ...]]]:
    """The model's parameter shapes in TensorFlow's layout: (out, in, k, k) as (k, k, in, out), a
    linear layer's (out, in) as (in, out)."""
    out = []
    for name, shape in MODELS[model](width):
        if len(shape) == 4:
            shape = (shape[2], shape[3], shape[1], shape[0])
        elif len(shape) == 2:
            shape = (shape[1], shape[0])
        out.append((name, shape))
    return out


def gradients(shapes, rank: int) -> list:
    """Rank ``rank``'s gradients (numpy float32): normal, a scale 10^-U(1,4) per tensor."""
    import numpy as np

    rng = np.random.default_rng(1234 + rank)
    return [(rng.standard_normal(s, dtype=np.float32) * np.float32(10.0 ** -rng.uniform(1, 4))) for _, s in shapes]


def exact_mean(shapes, size: int) -> list:
    """The mean over every rank's :func:`gradients`, float64."""
    total = None
    for r in range(size):
        g = gradients(shapes, r)
        total = [x.astype("float64") for x in g] if total is None else [t + x for t, x in zip(total, g)]
    return [t / size for t in total]


def output_check(outs, mean) -> dict:
    """This rank's digest of a row's averages and, where ``mean`` is given, their relative error."""
    import numpy as np

    arrays = [o.numpy() for o in outs]
    digest = hashlib.sha1(b"".join(np.ascontiguousarray(a, dtype=np.float32).tobytes() for a in arrays)).hexdigest()
    res = {"digest": digest}
    if mean is not None:
        err = sum(float(np.sum((a.astype(np.float64) - m) ** 2)) for a, m in zip(arrays, mean))
        ref = sum(float(np.sum(m**2)) for m in mean)
        res["rel_error"] = (err / ref) ** 0.5
    return res


# ---------------------------------------------------------------------------------------- worker
def worker(args) -> int:
    """Runs on every rank: build the rows, time their steps, check the averages, rank 0 writes JSON."""
    for k, v in {**launch.RANK_ENV, "HOROVOD_CACHE_CAPACITY": "8192", "HOROVOD_ALQ_TIMEOUT": "1800"}.items():
        os.environ.setdefault(k, v)  # one thread per TF pool; rows x tensors exceed Horovod's 1,024 names
    import horovod
    import horovod.tensorflow as hvd
    import tensorflow as tf

    hvd.init()
    shapes = tf_shapes(args.model, args.width)
    grads = [tf.constant(g) for g in gradients(shapes, hvd.rank())]
    built, skipped = {}, {}
    for key in args.rows.split(","):
        try:
            built[key] = build_row(key, args, hvd, tf)
        except Unavailable as e:
            skipped[key] = str(e)
            if hvd.rank() == 0:
                print(f"scripts.bench.tf_step: row {key} skipped: {e}", flush=True)
    mean = exact_mean(shapes, hvd.size()) if hvd.rank() == 0 else None
    timed, checks, before, after = run_steps(args, built, grads, mean, hvd, tf)
    mine = {"local_rank": hvd.local_rank(), "maxrss_mb": timing.maxrss_mb(), "checks": checks, **timed}
    per_rank = hvd.allgather_object(mine)
    if hvd.rank() == 0:
        results = {k: row_result(args, k, per_rank, before[k], after[k], shapes, hvd.size()) for k in built}
        run = {"size": hvd.size(), "local_size": hvd.local_size(), "params": sum(numel(s) for _, s in shapes)}
        run.update(tensors=len(shapes), compressed=sum(numel(s) >= 1024 for _, s in shapes), skipped=skipped)
        run.update(tensorflow=tf.__version__, horovod=horovod.__version__, results=results)
        run.update(maxrss_mb=max(r["maxrss_mb"] for r in per_rank), per_rank=per_rank)
        Path(args.worker_out).write_text(json.dumps(run))
    hvd.shutdown()
    return 0


def run_steps(args, built: dict, grads: list, mean, hvd, tf) -> tuple[dict, dict, dict, dict]:
    """Every row's steps in turn: ({"warm": {field: {row: [...]}}, "timed": ..., "link": {row: [(tx,
    rx, lo tx)]}}, this rank's output checks after the last step, the ALQ rows' counters before and
    after the timed steps)."""
    keys = list(built)
    one = tf.zeros([1])
    barrier = lambda: hvd.allreduce(one, op=hvd.Sum, name="tf_step.barrier")  # noqa: E731
    link = None
    if args.count_ifname:  # the row's traffic has ended on every rank after a second barrier
        link = lambda: timing.if_bytes(args.count_ifname) + timing.if_bytes("lo")[:1]  # noqa: E731
    rec = {part: {f: {k: [] for k in keys} for f in FIELDS} for part in ("warm", "timed")}
    rec["link"] = {k: [] for k in keys}
    before, checks, total = {}, {}, args.warmup + args.steps
    for step in range(total):
        if step == args.warmup:
            before = {k: timing.counters(built[k]["comp"]) for k in keys}
        for key in keys:
            fn = built[key]["fn"]
            r = timing.timed_step(lambda: fn(grads), lambda: None, lambda: None, barrier, link, bool(link))
            part = "warm" if step < args.warmup else "timed"
            for f in FIELDS:
                rec[part][f][key].append(r[f])
            if link and part == "timed":
                rec["link"][key].append(r["link"])
            if step == total - 1:
                checks[key] = output_check(r["out"], mean)
        if hvd.rank() == 0:
            print(
                f"step {step + 1}/{total} done: "
                + ", ".join(
                    f"{k} {rec['warm' if step < args.warmup else 'timed']['step_s'][k][-1]:.3f} s" for k in keys
                ),
                flush=True,
            )
    return rec, checks, before, {k: timing.counters(built[k]["comp"]) for k in keys}


def row_result(args, key: str, per_rank: list[dict], b: dict | None, a: dict | None, shapes, n: int) -> dict:
    """One row's slowest-rank steps (timed and warm-up), CPU times, bytes, link bytes and checks."""
    slow = lambda part, f: [max(s) for s in zip(*(r[part][f][key] for r in per_rank))]  # noqa: E731
    steps = slow("timed", "step_s")
    res = {"label": label(key, args), "steps_s": steps, "warm_s": slow("warm", "step_s")}
    res.update(step_s=statistics.median(steps), first_call_s=res["warm_s"][0], second_call_s=res["warm_s"][1])
    res["cpu_main_s"] = statistics.median(
        statistics.fmean(s) for s in zip(*(r["timed"]["cpu_main_s"][key] for r in per_rank))
    )
    res["cpu_all_s"] = statistics.median(
        statistics.fmean(s) for s in zip(*(r["timed"]["cpu_all_s"][key] for r in per_rank))
    )
    params, ring = sum(numel(s) for _, s in shapes), timing.ring(n)
    if a is None:
        width = 4 if key == "fp32" else 2
        res.update(bytes_per_step=ring * width * params, bytes_how=f"arithmetic: 2(N-1)/N x {width} B x elements")
    else:
        rounds = max(1, a["step"] - b["step"])
        sent, unc = (a["bytes_sent"] - b["bytes_sent"]) / rounds, (a["uncompressed"] - b["uncompressed"]) / rounds
        res.update(bytes_per_step=sent + ring * 4 * unc, bytes_sent_per_step=sent, uncompressed_per_step=unc)
        res.update(
            rounds=rounds,
            exchange=a["exchange"],
            bytes_how="measured: metrics() bytes_sent + 2(N-1)/N x 4 B x uncompressed",
        )
    nodes = [r["link"][key] for r in per_rank if r["local_rank"] == 0 and r["link"][key]]  # one reader per namespace
    if nodes:
        k = len(nodes[0])
        res["link_tx_per_step"] = sum(c[0] for node in nodes for c in node) / k
        res["link_max_per_step"] = max(max(sum(c[0] for c in node), sum(c[1] for c in node)) for node in nodes) / k
        res["lo_per_step"] = sum(c[2] for node in nodes for c in node) / k
    digests = {r["checks"][key]["digest"] for r in per_rank}
    res.update(identical_on_ranks=len(digests) == 1, rel_error=per_rank[0]["checks"][key].get("rel_error"))
    return res


# ---------------------------------------------------------------------------------------- driver
def code_version() -> dict:
    """The checkout's HEAD and the files of horovod_alq/ changed in the working tree (the ranks
    import the working tree: a launch measures what was on disk when it started)."""
    git = lambda *a: subprocess.run(["git", *a], cwd=net.ROOT, capture_output=True, text=True).stdout  # noqa: E731
    changed = [line[3:] for line in git("status", "--porcelain", "--", "horovod_alq").splitlines() if line]
    return {"head": git("rev-parse", "--short", "HEAD").strip(), "changed": changed}


def worker_args(args, out: Path, ifname: str) -> list[str]:
    cmd = [sys.executable, "-m", "scripts.bench.tf_step", "--worker", "--worker-out", str(out), "--rows", args.rows]
    cmd += launch.flags(args, "model", "width", "steps", "warmup", "bits", "bucket_size")
    if ifname != "lo":  # in the namespaces: each node's eth0 counters around each row's steps
        cmd += ["--count-ifname", ifname]
    return cmd


def launches(args, workers: list[int]) -> list[dict]:
    """Every launch: per worker (node) count, --repeats times on the loopback (--local), or in the
    namespaces for each rate of --rates in turn, --repeats rounds of them."""
    g, seen = args.ranks_per_node, {}
    cmd = lambda out, ifname: worker_args(args, out, ifname)  # noqa: E731

    def one(tmp: Path, n: int, rate: str | None, bps: float | None) -> dict:
        i = seen[(n, rate)] = seen.get((n, rate), -1) + 1
        load, start, code = os.getloadavg(), time.monotonic(), code_version()
        if rate is None:
            log = net.log_path(args.out, n, f"loopback_r{i}")
            result = net.run_local(args, tmp, n, cmd, log, tag=f"local_r{i}")
        else:
            log = net.log_path(args.out, n * g, f"{rate}_r{i}")
            result = net.run_netns(args, tmp, n, rate, cmd, log, f"_r{i}")
        entry = {"workers": n * g, "rate": rate or "loopback (no namespaces)", "repeat": i, "run": result}
        entry.update(load_before=load, load_after=os.getloadavg(), wall_s=time.monotonic() - start, code=code)
        if rate is not None:
            entry.update(throughput_Bps=bps, **({"nodes": n, "ranks_per_node": g} if g > 1 else {}))
        print(json.dumps({k: round(r["step_s"], 4) for k, r in result["results"].items()}), flush=True)
        return entry

    def each(tmp: Path, rate: str | None, bps: float | None) -> list[dict]:
        reps = args.repeats if rate is None else 1  # the namespaces: the rates list repeats instead
        return [one(tmp, n, rate, bps) for _ in range(reps) for n in workers]

    rates = args.rates.split(",") * args.repeats
    return net.sweep(args.local, rates, max(workers), "alqtfstep-", each)


# ---------------------------------------------------------------------------------------- report
def spread(values: list[float], fmt: str = "{:.2f}") -> str:
    """median (min-max)"""
    if not values:
        return "-"
    return f"{fmt.format(statistics.median(values))} ({fmt.format(min(values))}-{fmt.format(max(values))})"


def ratios(res: dict, key: str, ref: str) -> list[float]:
    """The row's step over the reference's, step by step (same step index); [] without the reference."""
    if ref not in res or key == ref:
        return []
    return [a / b for a, b in zip(res[key]["steps_s"], res[ref]["steps_s"])]


def tensor_ref(res: dict, key: str) -> str | None:
    """The per-tensor row a row is compared with: the alq-tensor row that used the same exchange,
    else the first alq-tensor row; None for per-tensor rows and where there is none."""
    if not key.startswith("alq-fused"):
        return None
    tensor = [k for k in res if k.startswith("alq-tensor")]
    same = [k for k in tensor if res[k].get("exchange") == res[key].get("exchange")]
    return (same or tensor or [None])[0]


def ref_cell(res: dict, key: str) -> str:
    ref = tensor_ref(res, key)
    return "-" if ref is None else f"{spread(ratios(res, key, ref))} to `{ref}`"


def table(run: dict) -> list[str]:
    res = run["results"]
    links = all("link_tx_per_step" in r for r in res.values())
    head = ["row", "exchange", "first call s", "second call s", "step ms: median (min-max)"]
    head += ["vs fp16: median (min-max)", "vs per tensor: median (min-max)", "MB sent / step / rank"]
    head += ["MB between nodes / step (eth0 tx)", "busiest node link MB / step"] if links else []
    head += ["CPU ms / rank (all threads)", "identical on all ranks", "rel. error vs exact mean"]
    rows = []
    for key, r in res.items():
        ms = [s * 1e3 for s in r["steps_s"]]
        cells = [f"`{key}`: {r['label']}", r.get("exchange", "Horovod allreduce"), f"{r['first_call_s']:.1f}"]
        cells += [f"{r['second_call_s']:.2f}", spread(ms, "{:.0f}" if min(ms) >= 100 else "{:.1f}")]
        cells += [spread(ratios(res, key, "fp16")), ref_cell(res, key)]
        cells += [f"{r['bytes_per_step'] / 1e6:.2f}"]
        if links:
            cells += [f"{r['link_tx_per_step'] / 1e6:.2f}", f"{r['link_max_per_step'] / 1e6:.2f}"]
        err = r.get("rel_error")
        cells += [report.ms(r["cpu_all_s"]), "yes" if r["identical_on_ranks"] else "NO"]
        rows.append(cells + ["-" if err is None else f"{err:.3g}"])
    return report.table(head, rows, "--rrrrrr" + "r" * (len(head) - 8))


def repeats_table(entries: list[dict]) -> list[str]:
    """Per row, over the launches of one layout and rate: each launch's median step and ratios."""
    keys = list(entries[0]["run"]["results"])
    head = ["row", "step ms, median per launch", "vs fp16, median per launch", "vs per tensor, median per launch"]
    rows = []
    for key in keys:
        runs = [e["run"]["results"] for e in entries if key in e["run"]["results"]]
        cells = [f"`{key}`", ", ".join(f"{res[key]['step_s'] * 1e3:.0f}" for res in runs)]
        for ref in (lambda res: "fp16", lambda res: tensor_ref(res, key)):
            vals = [ratios(res, key, ref(res)) for res in runs if ref(res)]
            cells.append(", ".join(f"{statistics.median(v):.2f}" for v in vals if v) or "-")
        rows.append(cells)
    return report.table(head, rows, "-rrr")


def targets(entries: list[dict]) -> list[str]:
    """The issue's targets, per launch at the target's rate: the ratio's median and range over steps."""
    rows = []
    for which, rate, bound in TARGETS:
        for e in (e for e in entries if e["rate"] == rate):
            res = e["run"]["results"]
            layout = f"{e.get('nodes', e['workers'])}x{e.get('ranks_per_node', 1)}"
            for key in (k for k in res if k.startswith("alq-fused")):
                ref = "fp16" if which == "fp16" else tensor_ref(res, key)
                v = ratios(res, key, ref) if ref in res else []
                met = "-" if not v else ("yes" if statistics.median(v) <= bound else "no")
                cells = [f"`{key}` / `{ref}`", rate, layout, e["repeat"] + 1, f"at most {bound:.2f}", spread(v), met]
                rows.append(cells)
    if not rows:
        return []
    head = ["ratio", "rate", "layout", "launch", "target", "median (min-max) over steps", "median meets it"]
    return ["## The issue's targets", ""] + report.table(head, rows, "---r-r-") + [""]


COLUMNS = (
    "Columns: first call = the slowest rank's first call of the row's tf.function (tracing, graph "
    "preparation, the codec's XLA compiles per tensor shape, Horovod's first negotiation of every name), "
    "second call = the next (the ALQ compressors' refit from the first call's statistics); step = the "
    "slowest rank's call, a barrier before it, median and min-max over the timed steps; vs fp16 / vs per "
    "tensor = the row's step over the reference's at the same step index, median and min-max over the "
    "steps (a fused row's per-tensor reference: the alq-tensor row of the same exchange, else the first one); "
    "MB sent: ALQ rows measured (metrics()['bytes_sent'] over the timed rounds, plus 2(N-1)/N x 4 B "
    "per coordinate sent uncompressed), fp32 and fp16 by arithmetic (2(N-1)/N x 4 or 2 B x elements: a "
    "bandwidth-optimal ring allreduce; Open MPI may send more); MB between nodes: every namespace's eth0 tx "
    "over the row's timed steps (read by the node's first rank after a barrier before and after each step: "
    "whole frames, the barriers' and Horovod's coordination traffic included), busiest node link: the "
    "largest of any node's tx or rx; CPU: the process's CPU time during the call (every thread: "
    "TensorFlow's executor runs the graph on its own threads, Horovod's background thread, Open MPI's polling), mean "
    "over ranks, median over steps; identical on all ranks: a digest of every rank's averages after the last step; "
    "rel. error: rank 0's ||average - exact mean|| / ||exact mean|| over all tensors (fp16 rounds, ALQ quantizes)."
)


def page(args, argv, entries: list[dict], wall: float, loads: tuple) -> str:
    first = entries[0]["run"]
    cores, ranks = os.cpu_count(), sorted({e["workers"] for e in entries})
    rss = max(e["run"]["maxrss_mb"] for e in entries)
    over = ", ".join(
        f"{w} ranks on {cores} cores" + (f" (oversubscribed {w / cores:g}x)" if w > cores else "") for w in ranks
    )
    lines = [
        "# TensorFlow gradient exchange of a training step: Horovod TF fp16, ALQ per tensor, ALQ fused",
        "",
        f"Command: `{report.command('scripts.bench.tf_step', argv)}` ({wall:.0f} s in all).",
        "",
        f"Date: {report.now()}; TensorFlow {first['tensorflow']}, Horovod {first['horovod']} (MPI CPU operations).",
        "",
        f"Machine: {cores} CPU cores shared by all ranks: {over}. Load average (1 min) {loads[0]:.2f} before, "
        f"{loads[1]:.2f} after; per launch below. Peak RSS per rank {rss:.0f} MB.",
        "",
        f"Gradients: torchvision {args.model}'s parameter shapes at width {args.width:g} in TensorFlow's layout, "
        f"{first['params']:,} elements in {first['tensors']} tensors ({first['compressed']} of at least 1,024 "
        f"elements, which ALQ compresses), random, one set per rank, exchanged every step. ALQ: "
        f"ALQCompressor(bits={args.bits}, bucket_size={args.bucket_size}), one per row. {args.warmup} untimed "
        f"calls per row (the first two reported), then {args.steps} timed; rows interleaved step by step, a "
        "barrier before each call.",
        "",
    ]
    for key, why in first.get("skipped", {}).items():
        lines += [f"Row `{key}` skipped: {why}.", ""]
    for e in entries:
        lines += [report.rate_heading(e) + f", launch {e['repeat'] + 1}", ""]
        lines += [
            f"Load average {e['load_before'][0]:.2f} before, {e['load_after'][0]:.2f} after ({e['wall_s']:.0f} s)."
        ]
        code = e.get("code")
        if code:
            changed = ", ".join(code["changed"]) or "none"
            lines[-1] += f" Code: HEAD {code['head']}; horovod_alq/ files changed in the working tree: {changed}."
        lines += [""]
        lines += table(e["run"]) + [""]
    groups: dict = {}
    for e in entries:
        groups.setdefault((e["workers"], e["rate"]), []).append(e)
    for (w, rate), group in groups.items():
        if len(group) > 1:
            lines += [f"## Over the {len(group)} launches: {w} ranks, {rate}", ""] + repeats_table(group) + [""]
    return "\n".join(lines + targets(entries) + [COLUMNS, ""])


# ---------------------------------------------------------------------------------------- command line
def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = p.add_argument
    add("--workers", help=f"comma-separated worker counts, 2..8 (one rank per namespace); default {FULL['workers']}")
    add("--rates", help=f"tc tbf rates, 'unshaped' = no qdisc; default {FULL['rates']}")
    add("--model", choices=tuple(MODELS), help=f"parameter shapes; default {FULL['model']}")
    add("--width", type=float, help=f"channel scale; default {FULL['width']}")
    add("--steps", type=int, help=f"timed steps per row; default {FULL['steps']}")
    add("--warmup", type=int, help=f"untimed calls per row first (at least 2); default {FULL['warmup']}")
    add("--repeats", type=int, default=1, help="launches per rate (the rates in turn); default 1")
    quick = ", ".join(f"{k} {v:g}" if isinstance(v, float) else f"{k} {v}" for k, v in QUICK.items())
    add("--quick", action="store_true", help="defaults for a check of a minute or two: " + quick)
    suffixes = ", ".join(EXCHANGES)
    add(
        "--rows",
        default=DEFAULT_ROWS,
        help=f"comma-separated, from {', '.join(BASES)}, ALQ rows with @-suffixes "
        f"(a fusion size in MiB; {suffixes}: the exchange); default {DEFAULT_ROWS}",
    )
    add("--bits", type=int, default=3, help="the ALQ rows' bits; default 3")
    add("--bucket-size", type=int, default=8192, help="the ALQ rows' bucket size; default 8192")
    net.add_layout_options(add)
    add(
        "--intra-node",
        choices=("tcp", "shm"),
        default="tcp",
        help="how Open MPI moves bytes between the ranks "
        "of a node: TCP over the namespace's loopback, or shared memory (vader); default tcp",
    )
    add("--connect-timeout", type=float, default=60.0, help="seconds for every rank of a launch to start; default 60")
    add("--yield-when-idle", type=int, choices=(0, 1), default=1, help="Open MPI's; default 1")
    add(
        "--out",
        help="markdown report (JSON in data/ beside it); default build/results/bench_tf_step.md, with "
        "--quick or --local build/bench/bench_tf_step.md",
    )
    add("--timeout", type=float, help="seconds per mpirun; default 3600 (--quick: 600)")
    net.add_namespace_options(add)
    add("--count-ifname", help=argparse.SUPPRESS)
    return p


def main(argv=None) -> int:
    p = parser()
    args = p.parse_args(argv)
    net.apply_defaults(args, QUICK, FULL)
    net.parse_layout(p, args)
    for key in args.rows.split(","):
        try:
            parse_row(key)
        except ValueError as e:
            p.error(str(e))
    if args.worker:
        return worker(args)
    if args.warmup < 2:
        p.error("--warmup must be at least 2 (the first call and the ALQ refit are reported apart)")
    workers = [int(w) for w in args.workers.split(",")]
    if not all(2 <= w <= 8 for w in workers):
        p.error("--nodes must be 2..8" if args.nodes else "--workers must be 2..8")
    if args.out is None:
        quick = args.quick or args.local
        args.out = "build/bench/bench_tf_step.md" if quick else "build/results/bench_tf_step.md"
    if not args.local:
        status = net.preflight("scripts.bench.tf_step", args.teardown_only, "; --local runs without")
        if status is not None:
            return status
    start, load = time.monotonic(), os.getloadavg()[0]
    entries = launches(args, workers)
    loads = (load, os.getloadavg()[0])
    data = {"args": vars(args), "argv": argv if argv is not None else sys.argv[1:], "runs": entries}
    report.write(Path(args.out), page(args, argv, entries, time.monotonic() - start, loads), data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
