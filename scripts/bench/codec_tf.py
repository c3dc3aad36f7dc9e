#!/usr/bin/env python
"""Time compress + exchange + decompress of one large gradient per TensorFlow compressor, side by
side in the same processes, as ratios to Horovod's fp16 compressor. Run under a launcher:

    mpirun -np 2 python -m scripts.bench.codec_tf --out build/results/bench_codec_tf.md
    # the report goes by hand into docs/results/codec_speed.md#bench_codec_tf

Each measurement is one call of a tf.function around ``hvd.allreduce(tensor, compression=c)``
(traced once before timing; this is how hvd.DistributedGradientTape runs it), median of --repeats
timed calls after --warmup calls, compressors interleaved round-robin so that noise from a shared
machine hits them alike; the slowest rank's median counts. Extra rows: the same ALQ call made
eagerly (every TF op dispatched from Python), with plain TF ops instead of XLA, and with the
statistics computed, allreduced and the levels refit on every call (the cost of a refit round), and
the same two calls with ``bits="auto"`` (a width chosen at run time: every width's codec is traced,
the refit round adds each width's error, the allocation and a fit per width in use). A second table
gives each compressor's first call (tracing and XLA compiles included).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

from scripts.common.bench import parse_size, ratio_rows, timing_table, write_report


def compressors(hvd, bits: int, bucket: int, extra_rows: bool) -> dict:
    from horovod_alq.tensorflow import ALQCompressor, QSGDCompressor

    common = dict(bucket_size=bucket, update_steps=(), update_every=0, seed=0)
    out = {
        "none (fp32)": (hvd.Compression.none, False),
        "fp16": (hvd.Compression.fp16, False),
        f"ALQ {bits}b": (ALQCompressor(bits=bits, **common), False),
        f"QSGDinf {bits}b": (QSGDCompressor(bits=bits, **common), False),
    }
    if extra_rows:
        out[f"ALQ {bits}b, eager call"] = (ALQCompressor(bits=bits, **common), True)
        out[f"ALQ {bits}b, plain TF ops (no XLA)"] = (ALQCompressor(bits=bits, jit_compile=False, **common), False)
        refit = dict(common, update_steps=(0,), update_every=1)
        out[f"ALQ {bits}b, statistics + refit every call"] = (ALQCompressor(bits=bits, **refit), False)
        out[f"ALQ auto (budget {bits})"] = (ALQCompressor(bits="auto", bit_budget=bits, **common), False)
        out[f"ALQ auto (budget {bits}), statistics + refit every call"] = (
            ALQCompressor(bits="auto", bit_budget=bits, **refit),
            False,
        )
    return out


def time_methods(tf, hvd, methods: dict, tensor, warmup: int, repeats: int) -> tuple[dict, dict]:
    """The slowest rank's median call and first call of every compressor (seconds)."""
    import re

    calls = {}
    for name, (comp, eager) in methods.items():
        op_name = "bench." + re.sub(r"[^A-Za-z0-9]+", "_", name)

        def call(t, comp=comp, op_name=op_name):
            return hvd.allreduce(t, compression=comp, name=op_name)

        calls[name] = call if eager else tf.function(call)
    sync = tf.function(lambda: hvd.allreduce(tf.zeros([1]), name="bench.barrier"))
    times = {name: [] for name in methods}
    first = {}
    for i in range(warmup + repeats):
        for name, call in calls.items():
            sync()
            start = time.perf_counter()
            out = call(tensor)
            _ = out.shape
            elapsed = time.perf_counter() - start
            if i >= warmup:
                times[name].append(elapsed)
            elif i == 0:
                first[name] = elapsed
    slowest = lambda value, tag: max(hvd.allgather_object(value, name=f"bench.{tag}"))  # noqa: E731
    return (
        {name: slowest(statistics.median(t), f"t{i}") for i, (name, t) in enumerate(times.items())},
        {name: slowest(t, f"f{i}") for i, (name, t) in enumerate(first.items())},
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="1M,16M", help="comma-separated element counts (K, M suffixes)")
    p.add_argument("--bits", type=int, default=3)
    p.add_argument("--bucket-size", type=int, default=8192)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument(
        "--no-extra-rows",
        action="store_true",
        help="only none, fp16, ALQ and QSGDinf (skip: ALQ eager, without XLA, refitting every call)",
    )
    p.add_argument("--quick", action="store_true", help="1M elements, 3 repeats")
    p.add_argument("--out", help="rank 0 writes a Markdown table here")
    args = p.parse_args(argv)
    if args.quick:
        args.sizes, args.repeats, args.warmup = "1M", 3, 1
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import horovod.tensorflow as hvd
    import tensorflow as tf

    hvd.init()
    methods = compressors(hvd, args.bits, args.bucket_size, not args.no_extra_rows)
    rows, first_calls = [], []
    load_before = os.getloadavg()[0]
    for size_text in args.sizes.split(","):
        n = parse_size(size_text)
        tensor = tf.random.stateless_normal([n], seed=[hvd.rank(), 0])
        med, first = time_methods(tf, hvd, methods, tensor, args.warmup, args.repeats)
        rows += ratio_rows(size_text, med)
        first_calls += [f"| {size_text} | {name} | {t:.2f} |" for name, t in first.items()]
    load_after = os.getloadavg()[0]
    if hvd.rank() == 0:
        threads = os.environ.get("TF_NUM_INTRAOP_THREADS", "default")
        command = " ".join(argv if argv is not None else sys.argv[1:])
        lines = [
            "# TensorFlow codec speed: compress + exchange + decompress",
            "",
            f"Command: `mpirun -np {hvd.size()} python -m scripts.bench.codec_tf {command}`",
            "",
            (
                f"Machine: {platform.machine()}, {os.cpu_count()} CPUs visible, TensorFlow {tf.__version__} "
                f"(CPU, intra-op threads: {threads}), {hvd.size()} ranks on one host (shared memory). "
                f"Bucket size {args.bucket_size}. Each call is a tf.function around hvd.allreduce, "
                f"traced before timing; median of {args.repeats} calls, slowest rank. "
                f"Load average {load_before:.1f} before, {load_after:.1f} after (other jobs share "
                f"this machine; ratios are more stable than absolute times)."
            ),
            "",
            *timing_table(rows),
        ]
        lines += [
            "",
            "First call of each compressor (tracing and XLA compiles included; the compressors' "
            "tf.functions are shared by compressors of one configuration, so a later row may reuse an "
            "earlier row's traces), slowest rank:",
            "",
            "| elements | compressor | first call (s) |",
            "|---|---|---:|",
            *first_calls,
        ]
        lines += [
            "",
            "On one host the wire is shared memory, so these times are mostly codec compute. The "
            "quantizers allgather b + 32/d bits per coordinate where fp16 allreduces 16: they pay off "
            "on slow links, not here. The TF codec is TF ops compiled by XLA, random draws included (a "
            "counter-based uint32 hash); the torch compressors have a fused C++ codec "
            "(docs/results/codec_speed.md#bench_codec).",
        ]
        write_report(lines, args.out)
    hvd.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
