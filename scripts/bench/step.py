#!/usr/bin/env python
"""Time one optimizer step's gradient exchange of a ResNet-50-shaped model (--width scales the
channels) per compressor, interleaved in the same processes, as ratios to Horovod's fp16: the
median over --steps of the slowest rank's step. Rows and results:
docs/results/training_steps.md#bench_step. --profile METHOD runs that method under cProfile.

    OMP_NUM_THREADS=1 mpirun -np 2 python -m scripts.bench.step --out build/results/bench_step.md
    OMP_NUM_THREADS=1 mpirun -np 2 python -m scripts.bench.step --quick
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import io
import os
import platform
import pstats
import statistics
import sys
import time

import horovod.torch as hvd
import torch

from scripts.common.bench import numel, resnet50_shapes


def make_compressors(include_refit: bool) -> dict:
    from horovod_alq.core.speed import SpeedArbiter
    from horovod_alq.torch import ALQCompressor

    steady = dict(bits=3, bucket_size=8192, update_steps=(0,), update_every=0, seed=0)
    methods = {
        "none (fp32)": hvd.Compression.none,
        "fp16": hvd.Compression.fp16,
        "ALQ, allgather": ALQCompressor(exchange="allgather", **steady),
        "ALQ, two-phase": ALQCompressor(exchange="two-phase", **steady),
        "ALQ, allgather, fusion_bytes=0": ALQCompressor(exchange="allgather", fusion_bytes=0, **steady),
    }
    # the same tensors viewed with distinct shapes (see distinct_views): the exchange's "ordered" path
    methods[DISTINCT] = ALQCompressor(exchange="allgather", **steady)
    methods[DISTINCT_TP] = ALQCompressor(exchange="two-phase", **steady)
    methods[SIXTEEN] = sixteen = ALQCompressor(compress="when-faster", **steady)
    sixteen._state.speed = SpeedArbiter(warmup=1 << 62)  # no trial ever: held on its 16-bit path
    sixteen._state.speed.quantizing = False
    if include_refit:
        methods["ALQ, allgather, refit round"] = ALQCompressor(
            bits=3, bucket_size=8192, update_steps=(0,), update_every=1, seed=0, exchange="allgather"
        )
    return methods


DISTINCT = "ALQ, allgather, no repeated shapes (diagnostic)"
DISTINCT_TP = "ALQ, two-phase, no repeated shapes (diagnostic)"
SIXTEEN = "ALQ, compress='when-faster' on its 16-bit path"

PROFILE_KEYS = {
    "alq-distinct": DISTINCT,
    "alq-two-phase-distinct": DISTINCT_TP,
    "fp32": "none (fp32)",
    "none": "none (fp32)",
    "fp16": "fp16",
    "alq": "ALQ, allgather",
    "alq-allgather": "ALQ, allgather",
    "alq-two-phase": "ALQ, two-phase",
    "alq-nofusion": "ALQ, allgather, fusion_bytes=0",
    "alq-refit": "ALQ, allgather, refit round",
    "alq-16bit": SIXTEEN,
}


def distinct_views(work: list) -> list:
    """The gradients viewed with shapes that never repeat (k leading 1s on the k-th repeat of a shape):
    the same bytes and work, but a round in which no two compressed tensors share a shape."""
    seen: dict = {}
    out = []
    for w in work:
        k = seen.get(tuple(w.shape), 0)
        seen[tuple(w.shape)] = k + 1
        out.append(w.view((1,) * k + tuple(w.shape)))
    return out


def one_step(comp, label: str, params: list, work: list, master: list) -> tuple[float, float, float, float]:
    """One exchange of every gradient; returns (compress + submit, synchronize + decompress) wall
    seconds, the process's CPU seconds (all its threads: Horovod's background thread included) and
    the main thread's CPU seconds inside compress and decompress."""
    for w, m in zip(work, master):  # fp32's in-place allreduce overwrote last step's gradients
        w.copy_(m)
    hvd.barrier()
    c0 = time.process_time()
    t0 = time.perf_counter()
    handles = []
    grads = distinct_views(work) if label in (DISTINCT, DISTINCT_TP) else work
    calls = 0.0
    for (name, _), grad in zip(reversed(params), reversed(grads)):  # backward order
        c = time.thread_time()
        compressed, ctx = comp.compress(grad)
        calls += time.thread_time() - c
        handles.append((hvd.allreduce_async_(compressed, name=f"{label}.{name}", op=hvd.Average), ctx))
    t1 = time.perf_counter()
    for handle, ctx in handles:
        reduced = hvd.synchronize(handle)
        c = time.thread_time()
        comp.decompress(reduced, ctx)
        calls += time.thread_time() - c
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1, time.process_time() - c0, calls


def slowest(seconds: float) -> float:
    return float(hvd.allreduce(torch.tensor([seconds], dtype=torch.float64), op=hvd.Max, name="bench.max")[0])


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add, keys = p.add_argument, ", ".join(sorted(PROFILE_KEYS))
    add("--steps", type=int, default=7, help="timed steps per method (median); default 7")
    warmup = "untimed steps per method first (>= 1: step 0 of an ALQ compressor is its refit round); default 2"
    add("--warmup", type=int, default=2, help=warmup)
    add("--width", type=float, default=1.0, help="channel-count scale of ResNet-50; default 1")
    add("--no-refit-row", action="store_true", help="skip the 'refit round' row")
    add("--methods", help="only these rows (fp32 and fp16 always run), comma-separated from: " + keys)
    add("--quick", action="store_true", help="--width 0.5 --steps 3 --warmup 1 (for make bench)")
    add("--profile", metavar="METHOD", choices=sorted(PROFILE_KEYS), help="only this one, cProfile on rank 0: " + keys)
    clock = "with --profile: wall time or the main thread's CPU time (time.thread_time); default wall"
    add("--profile-clock", choices=("wall", "cpu"), default="wall", help=clock)
    add("--out", help="rank 0 writes the Markdown report here")
    return p


def main(argv=None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if args.quick:
        args.width, args.steps, args.warmup = 0.5, 3, 1
    args.warmup = max(1, args.warmup)
    # Several compressors x 161 names, cycled step by step, thrash Horovod's default 1,024-entry
    # response cache (an LRU): every tensor would renegotiate every step. One model alone fits.
    os.environ.setdefault("HOROVOD_CACHE_CAPACITY", "8192")
    hvd.init()
    from horovod_alq.torch.codecs import cpu_build

    shapes = resnet50_shapes(args.width)
    gen = torch.Generator().manual_seed(1234 + hvd.rank())
    master = [
        torch.randn(shape, generator=gen) * (10.0 ** -float(torch.empty(()).uniform_(1, 4, generator=gen)))
        for _, shape in shapes
    ]
    work = [m.clone() for m in master]
    methods = make_compressors(not args.no_refit_row)
    if args.methods:
        keep = {PROFILE_KEYS[k] for k in args.methods.split(",")} | {"none (fp32)", "fp16"}
        methods = {k: v for k, v in methods.items() if k in keep}
    if args.profile:
        key = PROFILE_KEYS[args.profile]
        return profile(methods[key], key, shapes, work, master, args)

    load_before = os.getloadavg()[0]
    start = time.monotonic()
    first: dict[str, float] = {}
    times: dict[str, list] = {k: [] for k in methods}
    parts: dict[str, list] = {k: [] for k in methods}
    for i in range(args.warmup + args.steps):
        for label, comp in methods.items():
            submit, finish, cpu, calls = one_step(comp, label, shapes, work, master)
            total = slowest(submit + finish)
            if i == 0:
                first[label] = total
            if i >= args.warmup:
                times[label].append(total)
                parts[label].append((slowest(submit), slowest(finish), slowest(cpu), slowest(calls)))
    wall = time.monotonic() - start
    load_after = os.getloadavg()[0]
    if hvd.rank() == 0:
        lines = report(
            args, argv, shapes, methods, times, parts, first, load_before, load_after, wall, cpu_build.status()
        )
        text = "\n".join(lines) + "\n"
        print(text)
        if args.out:
            os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
            with open(args.out, "w") as f:
                f.write(text)
    hvd.shutdown()
    return 0


def exchange_in_use(comp) -> str:
    """The exchange the compressor's last round used (``metrics()["exchange"]``), or Horovod's."""
    metrics = getattr(comp, "metrics", None)
    if metrics is None:
        return "Horovod allreduce"
    try:
        return str(metrics().get("exchange", "?"))
    except Exception as exc:  # the library is being changed under this script: report, do not fail
        return f"? ({type(exc).__name__})"


def report(args, argv, shapes, methods, times, parts, first, load_before, load_after, wall, codec_status) -> list[str]:
    med = {k: statistics.median(v) for k, v in times.items()}
    fp16 = med["fp16"]
    n_all = sum(numel(s) for _, s in shapes)
    big = [s for _, s in shapes if numel(s) >= 1024]
    cmd = " ".join(argv if argv is not None else sys.argv[1:])
    lines = [
        "# One optimizer step's gradient exchange, ResNet-50 shapes",
        "",
        f"Command: `OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '?')} mpirun -np {hvd.size()} "
        f"python -m scripts.bench.step{' ' + cmd if cmd else ''}`",
        f"Date: {datetime.datetime.now().strftime('%Y-%m-%d %H:%M')} (local time of the run), {wall:.0f} s wall.",
        "",
        f"Model: ResNet-50 parameter shapes (width x{args.width:g}): {len(shapes)} tensors, {n_all:,} elements, "
        f"{len(big)} tensors of >= 1,024 elements holding {sum(map(numel, big)):,} (compressed by ALQ; the "
        f"others travel through Horovod's plain allreduce).",
        f"Machine: {platform.machine()}, {os.cpu_count()} CPUs, {torch.get_num_threads()} torch thread(s) per rank, "
        f"{hvd.size()} ranks on one host (shared memory). {codec_status}. "
        f"HOROVOD_CACHE_CAPACITY={os.environ.get('HOROVOD_CACHE_CAPACITY')}, Open MPI mpi_yield_when_idle="
        f"{os.environ.get('OMPI_MCA_mpi_yield_when_idle', 'default')}. Load average {load_before:.1f} before, "
        f"{load_after:.1f} after.",
        "ALQ: 3 bits, bucket 8192, default fusion (64 MiB of float32 per buffer) unless "
        f"named; levels refit at step 0 only (inside the warm-up). Median of {args.steps} steps after "
        f"{args.warmup} warm-up step(s), slowest rank; methods interleaved step by step.",
        "",
        "| compressor | ms per step | vs fp16 | vs fp32 | compress + submit ms | synchronize + decompress ms "
        "| CPU ms | calls CPU ms | first step ms | exchange in use |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for label in methods:
        sub, fin, cpu, calls = (statistics.median(p[i] for p in parts[label]) for i in range(4))
        lines.append(
            f"| {label} | {1e3 * med[label]:.1f} | {med[label] / fp16:.2f} | "
            f"{med[label] / med['none (fp32)']:.2f} | {1e3 * sub:.1f} | {1e3 * fin:.1f} | {1e3 * cpu:.0f} | "
            f"{1e3 * calls:.2f} | {1e3 * first[label]:.0f} | {exchange_in_use(methods[label])} |"
        )
    lines += [
        "",
        "Columns: the two phases are medians of the slowest rank each, so they need not add up to the "
        'step; "CPU ms": the process CPU time of the step (all threads of the rank, Horovod\'s background '
        "thread and MPI's polling included; slowest rank, median), less sensitive than wall time to other "
        'jobs on the machine; "calls CPU": the main thread\'s CPU time inside compress and decompress '
        '(slowest rank, median); "first step" is step 0 (for ALQ its refit round, plus first-call costs '
        'such as Horovod negotiating new names). "refit round" refits at every step: statistics of every buffer, one '
        "allreduce of them, the level fit, on top of a plain step.",
        "All steps (ms): " + "; ".join(f"{k}: " + ", ".join(f"{1e3 * t:.0f}" for t in v) for k, v in times.items()),
    ]
    return lines


def profile(comp, label: str, shapes, work, master, args) -> int:
    """Warm up, then run --steps steps of one method with cProfile enabled on rank 0 only."""
    for _ in range(args.warmup):
        one_step(comp, label, shapes, work, master)
    timer = time.thread_time if args.profile_clock == "cpu" else time.perf_counter
    prof = cProfile.Profile(timer) if hvd.rank() == 0 else None
    totals, subs, fins = [], [], []
    for _ in range(args.steps):
        if prof:
            prof.enable()
        s, f, _, _ = one_step(comp, label, shapes, work, master)
        if prof:
            prof.disable()
        totals.append(slowest(s + f))
        subs.append(s)
        fins.append(f)
    if prof:
        print(
            f"# profile of {label!r} ({args.profile_clock} clock): {args.steps} steps on rank 0 under cProfile; "
            f"slowest-rank step median "
            f"{1e3 * statistics.median(totals):.1f} ms; this rank's compress + submit median "
            f"{1e3 * statistics.median(subs):.1f} ms, synchronize + decompress {1e3 * statistics.median(fins):.1f} ms"
        )
        for sort in ("tottime", "cumulative"):
            buf = io.StringIO()
            pstats.Stats(prof, stream=buf).sort_stats(sort).print_stats(30)
            print(f"## sorted by {sort}\n" + buf.getvalue())
    hvd.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
