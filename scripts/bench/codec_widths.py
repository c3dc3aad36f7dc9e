#!/usr/bin/env python
"""Encode and decode time of the compiled CPU codec per bit width (2..8), one thread, as ratios to
3 bits: what a wide width (``bits="auto"`` gives 5 to 8 bits to tensors whose errors weigh most)
costs next to the default.

ALQ levels fitted to the gradient at each width, one float32 tensor of Student-t values, max-abs
buckets of 8192; the AVX2 kernels and the generic ones (``set_simd(False)``), rows interleaved,
medians over repeats.

    python -m scripts.bench.codec_widths --out build/results/bench_codec_widths.md
    # the report goes by hand into docs/results/codec_speed.md#bench_codec_widths
    python -m scripts.bench.codec_widths --quick
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np
import torch

from horovod_alq.core import Quantizer
from horovod_alq.torch.ops import TorchOps
from scripts.common.bench import parse_size, write_report

WIDTHS = (2, 3, 4, 5, 6, 7, 8)


def time_widths(x: torch.Tensor, ops: TorchOps, simd_modes: list[bool], repeats: int) -> dict:
    """Median ms of encode and of decode per (simd, width), interleaved repeat by repeat."""
    quantizers = {}
    for bits in WIDTHS:
        q = Quantizer("alq", bits=bits, bucket_size=8192, seed=0)
        q.adapt(q.statistics(x[: 1 << 20].double().numpy()))
        quantizers[bits] = q
    out = torch.empty_like(x)
    times = {(simd, bits, what): [] for simd in simd_modes for bits in WIDTHS for what in ("encode", "decode")}
    for r in range(repeats + 1):  # the first round warms up
        for simd in simd_modes:
            ops.codec._module.set_simd(simd)
            for bits, q in quantizers.items():
                start = time.perf_counter()
                payload = ops.encode(x, q, seed=r)
                mid = time.perf_counter()
                ops.decode_sum(out, payload, [0], q)
                end = time.perf_counter()
                if r:
                    times[simd, bits, "encode"].append(mid - start)
                    times[simd, bits, "decode"].append(end - mid)
    ops.codec._module.set_simd(True)
    return {key: 1e3 * statistics.median(t) for key, t in times.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="4M", help="elements of the tensor (K, M suffixes)")
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--quick", action="store_true", help="256K elements, 3 repeats")
    p.add_argument("--out", help="write a Markdown table here")
    args = p.parse_args(argv)
    if args.quick:
        args.size, args.repeats = "256K", 3
    torch.set_num_threads(1)
    ops = TorchOps(torch.device("cpu"), codec="cpu")
    simd_modes = [True, False] if ops.codec._module.simd() == "avx2" else [False]
    n = parse_size(args.size)
    x = torch.from_numpy(np.random.default_rng(0).standard_t(3.0, n).astype(np.float32))
    ms = time_widths(x, ops, simd_modes, args.repeats)
    lines = [
        "# Codec speed per bit width (compiled CPU codec, one thread)",
        "",
        f"Command: `python -m scripts.bench.codec_widths {' '.join(argv if argv is not None else sys.argv[1:])}`",
        "",
        f"{n:,} float32 Student-t (3) coordinates, ALQ levels fitted at each width, max-abs buckets "
        f"of 8192; median of {args.repeats} calls, widths interleaved. Ratios to 3 bits of the same kernels.",
        "",
        "| kernels | bits | encode ms | vs 3 bits | ns per coordinate | decode ms | vs 3 bits |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for simd in simd_modes:
        for bits in WIDTHS:
            enc, dec = ms[simd, bits, "encode"], ms[simd, bits, "decode"]
            lines.append(
                f"| {'AVX2' if simd else 'generic'} | {bits} | {enc:.2f} | "
                f"{enc / ms[simd, 3, 'encode']:.2f} | {1e6 * enc / n:.2f} | {dec:.2f} | "
                f"{dec / ms[simd, 3, 'decode']:.2f} |"
            )
    write_report(lines, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
