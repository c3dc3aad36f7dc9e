#!/usr/bin/env python
"""Time compress + exchange + decompress of one large gradient per compressor, side by side in the
same processes, as ratios to Horovod's fp16 compressor. Run under a launcher:

    mpirun -np 2 python scripts/bench_codec.py --sizes 16M --out docs/bench_codec.md

Each measurement is ``hvd.allreduce(tensor, compression=c)`` (what the optimizer does per tensor),
median of --repeats timed calls after --warmup calls, methods interleaved round-robin so that noise
from this shared machine hits them alike. Also times the pure-torch kernels (HOROVOD_ALQ_FUSED=0
path) and the level adaptation.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time

import torch

import horovod.torch as hvd


def parse_size(text: str) -> int:
    text = text.strip().upper()
    scale = {"K": 2**10, "M": 2**20}.get(text[-1], 1)
    return int(float(text.rstrip("KM")) * scale)


def compressors(bits: int, bucket: int):
    from horovod_alq.torch import ALQCompressor, AMQCompressor, QSGDCompressor, TernGradCompressor

    common = dict(bucket_size=bucket, update_steps=(), update_every=0, seed=0)
    return {
        "none (fp32)": hvd.Compression.none,
        "fp16": hvd.Compression.fp16,
        f"ALQ {bits}b": ALQCompressor(bits=bits, **common),
        f"AMQ {bits}b": AMQCompressor(bits=bits, **common),
        f"QSGDinf {bits}b": QSGDCompressor(bits=bits, **common),
        "TernGrad": TernGradCompressor(**common),
        f"ALQ {bits}b, plain torch kernels": ALQCompressor(bits=bits, fused=False, **common),
    }


def time_methods(methods: dict, tensor: torch.Tensor, warmup: int, repeats: int) -> dict:
    times = {name: [] for name in methods}
    for i in range(warmup + repeats):
        for name, comp in methods.items():
            hvd.barrier()
            start = time.perf_counter()
            hvd.allreduce(tensor, compression=comp, name=f"bench.{name}")
            elapsed = time.perf_counter() - start
            if i >= warmup:
                times[name].append(elapsed)
    # the slowest rank decides the step time
    return {name: max(hvd.allgather_object(statistics.median(t))) for name, t in times.items()}


def adaptation_ms(bits: int, bucket: int) -> dict:
    import numpy as np

    from horovod_alq.core import Quantizer

    grad = np.random.default_rng(0).standard_normal(2**20).astype(np.float32)
    out = {}
    for method in ("alq", "alq-n", "amq", "amq-n"):
        q = Quantizer(method, bits=bits, bucket_size=bucket)
        stats = q.statistics(grad)
        runs = []
        for _ in range(5):
            start = time.perf_counter()
            q.adapt(stats)
            runs.append(time.perf_counter() - start)
        out[method] = 1e3 * statistics.median(runs)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="1M,16M", help="comma-separated element counts (K, M suffixes)")
    p.add_argument("--bits", type=int, default=3)
    p.add_argument("--bucket-size", type=int, default=8192)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--quick", action="store_true", help="1M elements, 3 repeats")
    p.add_argument("--out", help="rank 0 writes a Markdown table here")
    args = p.parse_args(argv)
    if args.quick:
        args.sizes, args.repeats, args.warmup = "1M", 3, 1
    hvd.init()
    from horovod_alq.torch import fused

    methods = compressors(args.bits, args.bucket_size)
    rows = []
    for size_text in args.sizes.split(","):
        n = parse_size(size_text)
        tensor = torch.randn(n, generator=torch.Generator().manual_seed(hvd.rank()))
        med = time_methods(methods, tensor, args.warmup, args.repeats)
        for name, seconds in med.items():
            rows.append((size_text, name, seconds, seconds / med["fp16"], seconds / med["none (fp32)"]))
    adapt = adaptation_ms(args.bits, args.bucket_size)
    if hvd.rank() == 0:
        lines = [f"# Codec speed: compress + exchange + decompress", "",
                 f"Command: `mpirun -np {hvd.size()} python scripts/bench_codec.py "
                 f"{' '.join(argv if argv is not None else sys.argv[1:])}`", "",
                 f"Machine: {platform.machine()}, {torch.get_num_threads()} torch threads per rank, "
                 f"{hvd.size()} ranks on one host (shared memory), CPU. {fused.status()}. "
                 f"Bucket size {args.bucket_size}. Median of {args.repeats} calls, slowest rank.", "",
                 "| elements | compressor | ms | vs fp16 | vs fp32 |", "|---|---|---|---|---|"]
        lines += [f"| {s} | {name} | {1e3 * t:.1f} | {r16:.2f} | {r32:.2f} |" for s, name, t, r16, r32 in rows]
        lines += ["", f"Level adaptation ({args.bits} bits, statistics of a 1M-element gradient): "
                  + ", ".join(f"{m} {ms:.1f} ms" for m, ms in adapt.items())]
        text = "\n".join(lines) + "\n"
        print(text)
        if args.out:
            with open(args.out, "w") as f:
                f.write(text)
    hvd.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
