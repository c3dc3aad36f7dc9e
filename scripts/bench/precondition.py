#!/usr/bin/env python
"""What preconditioned quantization (``precondition=``) costs a rank per round, beside the codec:
one process, the compiled CPU codec on float32 CPU tensors (TorchOps), ALQ 3 bits, buckets of 8192.

Rows, interleaved, medians over repeats: the codec's round of one rank's own values (encode, then
decode one payload: what every exchange does at least once); ``w`` from AdamW's second moment as
:class:`horovod_alq.torch.Preconditioner` makes it once per round (bias correction, square root,
floor, reciprocal) with its digest; the multiply ``g * w`` before encoding and the divide by ``w``
after decoding, unfused (two elementwise passes) and fused into the compiled codec's kernels (the
encode's ``w=``, forming ``g * w`` bucket by bucket in cache; the decode's ``divide=``). Extra times
are shares of the codec's round: from the medians, and from the minima (the least disturbed repeat,
where other jobs share the cores).

    python -m scripts.bench.precondition --out build/results/bench_precondition.md
    # the report goes by hand into docs/results/precondition_gpt.md#cost
    python -m scripts.bench.precondition --quick
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

from horovod_alq.core import precondition as core
from horovod_alq.core.quantizer import Quantizer
from horovod_alq.torch.ops import TorchOps
from horovod_alq.torch.precondition import Form, _digest, adam_scale


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(n: int, repeats: int) -> dict:
    ops, q = TorchOps(torch.device("cpu"), "auto"), Quantizer("alq", bits=3, bucket_size=8192)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, generator=g) * torch.rand(n, generator=g)
    v = (torch.randn(n, generator=g) * 1e-3) ** 2
    out = torch.zeros(n)
    form = Form()
    n10, bc = core.samples(10, 0.95), 1 - 0.95**10
    w = adam_scale(v, form, 1e-8, n=n10, correction=bc)

    def codec():
        out.zero_()
        ops.decode_sum(out, ops.encode(x, q, 1), [0], q)

    def scale():
        _digest(adam_scale(v, form, 1e-8, n=n10, correction=bc), 0)

    def multiply():
        scaled = x * w
        out.zero_()
        ops.decode_sum(out, ops.encode(scaled, q, 1), [0], q)
        out.div_(w)

    args, kw = ops._coding(q, n, 1)

    def fused():
        ops.codec.decode_sum(
            out, ops.codec.encode(x, *args, **kw, w=w), [0], args[0], bits=3, bucket_size=8192, scale=1.0, divide=w
        )

    rows = {"codec": codec, "scale": scale, "round_scaled": multiply}
    if ops.codec.name == "cpu":
        rows["round_fused"] = fused
    for fn in rows.values():
        fn()
    times = {k: [] for k in rows}
    for _ in range(repeats):
        for k, fn in rows.items():
            times[k].append(timed(fn))
    med = {k: statistics.median(t) for k, t in times.items()}
    low = {k: min(t) for k, t in times.items()}
    base = med["codec"]
    return {
        "n": n,
        "codec": ops.codec.name,
        "codec_s": base,
        "scale_s": med["scale"],
        "round_scaled_s": med["round_scaled"],
        "multiply_share": (med["round_scaled"] - base) / base,
        "round_fused_s": med.get("round_fused", float("nan")),
        "fused_share": (med.get("round_fused", float("nan")) - base) / base,
        "scale_share": med["scale"] / base,
        "multiply_share_min": (low["round_scaled"] - low["codec"]) / low["codec"],
        "fused_share_min": (low.get("round_fused", float("nan")) - low["codec"]) / low["codec"],
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="1048576,8388608", help="coordinates; default 1M and 8M")
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--quick", action="store_true", help="65536 coordinates, 3 repeats")
    p.add_argument("--out", help="Markdown report")
    args = p.parse_args(argv)
    if args.quick:
        args.sizes, args.repeats = "65536", 3
    torch.set_num_threads(1)
    results = [measure(int(n), args.repeats) for n in args.sizes.split(",")]
    lines = [
        "| coordinates | codec round, ms | with g * w and / w, ms | extra / round | fused, ms | extra / round "
        "| w and its digest, ms | extra / round | unfused extra, minima | fused extra, minima |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        lines.append(
            f"| {r['n']:,} | {1e3 * r['codec_s']:.1f} | {1e3 * r['round_scaled_s']:.1f} | "
            f"{r['multiply_share']:.3f} | {1e3 * r['round_fused_s']:.1f} | {r['fused_share']:.3f} | "
            f"{1e3 * r['scale_s']:.1f} | {r['scale_share']:.3f} | {r['multiply_share_min']:.3f} | "
            f"{r['fused_share_min']:.3f} |"
        )
    table = "\n".join(lines) + "\n"
    print(f"codec: {results[0]['codec']}\n{table}")
    if args.out:
        head = (
            "# What preconditioned quantization costs beside the codec\n\n"
            f"Command: `python -m scripts.bench.precondition {' '.join(argv if argv is not None else sys.argv[1:])}` "
            f"({time.strftime('%Y-%m-%d %H:%M')} UTC; torch {torch.__version__}, codec {results[0]['codec']}, "
            "1 thread; this machine's 2 cores were shared with other jobs: read the ratios).\n\n"
        )
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            f.write(head + (__doc__ or "").split("\n\n")[1] + "\n\n" + table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
