#!/usr/bin/env python
"""Time compress + exchange + decompress of one large gradient per compressor (Horovod's none and
fp16, this package's, torch's 8-bit per-tensor path, ALQ refit every step), interleaved, as ratios
to fp16: ``hvd.allreduce(tensor, compression=c)``, median of --repeats. Results:
docs/results/codec_speed.md#bench_codec. Run under a launcher:

    mpirun -np 2 python -m scripts.bench.codec --sizes 16M --out build/results/bench_codec.md
    mpirun -np 2 python -m scripts.bench.codec --quick
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import horovod.torch as hvd
import torch

from scripts.common.bench import parse_size, ratio_rows, timing_table, write_report


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
        f"ALQ {bits}b, refit every step": ALQCompressor(
            bits=bits, bucket_size=bucket, update_steps=(0,), update_every=1, seed=0
        ),
        f"ALQ {bits}b, plain torch kernels": ALQCompressor(bits=bits, codec="torch", **common),
        "torch 8-bit quantization hook helpers": TorchQuant8(),
    }


class TorchQuant8:
    """torch's per-tensor 8-bit DDP quantization hook, with Horovod allgathers (see module doc)."""

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        from torch.distributed.algorithms.ddp_comm_hooks.quantization_hooks import (
            _dequantize_per_tensor_backend,
            _quantize_per_tensor_backend,
        )

        observer = torch.ao.quantization.MinMaxObserver()
        observer(tensor)
        s, z = observer.calculate_qparams()
        sz = hvd.allgather(torch.tensor([[float(s), float(z)]]), name="bench.q8.sz")
        codes = _quantize_per_tensor_backend(tensor, s, z)
        gathered = hvd.allgather(codes.view(1, -1), name="bench.q8.codes")
        out = torch.zeros_like(tensor)
        for i in range(gathered.shape[0]):
            out += _dequantize_per_tensor_backend(gathered[i], sz[i, 0], sz[i, 1]).view_as(tensor)
        return out / gathered.shape[0]


def time_methods(methods: dict, tensor: torch.Tensor, warmup: int, repeats: int) -> dict:
    times = {name: [] for name in methods}
    for i in range(warmup + repeats):
        for name, comp in methods.items():
            hvd.barrier()
            start = time.perf_counter()
            if isinstance(comp, TorchQuant8):
                comp(tensor)
            else:
                hvd.allreduce(tensor, compression=comp, name=f"bench.{name}")
            elapsed = time.perf_counter() - start
            if i >= warmup:
                times[name].append(elapsed)
    # the slowest rank decides the step time
    return {name: max(hvd.allgather_object(statistics.median(t))) for name, t in times.items()}


def adaptation_ms(bits: int, bucket: int) -> dict:
    """Median ms of ``q.adapt(stats)`` (the level fit alone) per adaptive method, 1M-element gradient."""
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
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--quick", action="store_true", help="1M elements, 3 repeats")
    p.add_argument("--skip-slow-above", default="16M", help="larger sizes skip the plain-torch-kernel ALQ")
    p.add_argument("--out", help="rank 0 writes a Markdown table here")
    args = p.parse_args(argv)
    if args.quick:
        args.sizes, args.repeats, args.warmup = "1M", 3, 1
    hvd.init()
    from horovod_alq.torch.codecs import cpu_build

    methods = compressors(3, 8192)
    rows = []
    load_before = os.getloadavg()[0]
    for size_text in args.sizes.split(","):
        n = parse_size(size_text)
        tensor = torch.randn(n, generator=torch.Generator().manual_seed(hvd.rank()))
        chosen = {k: v for k, v in methods.items() if not (n > parse_size(args.skip_slow_above) and "plain torch" in k)}
        med = time_methods(chosen, tensor, args.warmup, args.repeats)
        rows += ratio_rows(size_text, med)
    load_after = os.getloadavg()[0]
    adapt = adaptation_ms(3, 8192)
    if hvd.rank() == 0:
        lines = [
            "# Codec speed: compress + exchange + decompress",
            "",
            f"Command: `mpirun -np {hvd.size()} python -m scripts.bench.codec "
            f"{' '.join(argv if argv is not None else sys.argv[1:])}`",
            "",
            f"Machine: {platform.machine()}, {torch.get_num_threads()} torch threads per rank, "
            f"{hvd.size()} ranks on one host (shared memory), CPU. {cpu_build.status()}. "
            f"Bucket size 8192. Median of {args.repeats} calls, slowest rank. "
            f"Load average {load_before:.1f} before, {load_after:.1f} after.",
            "",
            *timing_table(rows),
        ]
        lines += [
            "",
            "Level adaptation (3 bits, statistics of a 1M-element gradient): "
            + ", ".join(f"{m} {ms:.1f} ms" for m, ms in adapt.items()),
        ]
        write_report(lines, args.out)
    hvd.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
