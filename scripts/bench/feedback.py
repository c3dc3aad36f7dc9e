#!/usr/bin/env python
"""What error feedback costs a rank per round, beside the codec: one process, the compiled CPU
codec on float32 CPU tensors (TorchOps), ALQ 3 bits, buckets of 8192.

Rows, interleaved, medians over repeats: the codec's round of one rank's own values (encode, then
decode one payload: what every exchange does at least once) and the same with error feedback
(``ErrorFeedback.encode``: the error added to the input, the encode, a decode of the own payload,
the new error and its finiteness check). The extra time is reported as a share of the codec's
round; the memory of the buffers per dtype is exact (4 or 2 bytes per compressed coordinate).

    python -m scripts.bench.feedback --out docs/results/bench_feedback.md
    python -m scripts.bench.feedback --quick
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from horovod_alq.core.quantizer import Quantizer
from horovod_alq.exchange.feedback import ErrorFeedback
from horovod_alq.torch.ops import TorchOps


def timed(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(n: int, repeats: int, dtype: str) -> dict:
    ops, q = TorchOps(torch.device("cpu"), "auto"), Quantizer("alq", bits=3, bucket_size=8192)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, generator=g) * torch.rand(n, generator=g)
    out = torch.zeros(n)
    fb = ErrorFeedback(dtype)

    def codec():
        out.zero_()
        ops.decode_sum(out, ops.encode(x, q, 1), [0], q)

    def feedback():
        out.zero_()
        ops.decode_sum(out, fb.encode(ops, x, q, 1, ("k",)), [0], q)

    codec(), feedback()  # warm-up (and the buffer exists from here on)
    rows = {"codec": [], "feedback": []}
    for _ in range(repeats):
        rows["codec"].append(timed(codec, 1))
        rows["feedback"].append(timed(feedback, 1))
    base, with_fb = statistics.median(rows["codec"]), statistics.median(rows["feedback"])
    return {"n": n, "dtype": dtype, "codec_s": base, "feedback_s": with_fb, "share": (with_fb - base) / base,
            "bytes": fb.nbytes, "codec": ops.codec.name}  # fmt: skip


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="1048576,16777216", help="coordinates; default 1M and 16M")
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--quick", action="store_true", help="65536 coordinates, 3 repeats")
    p.add_argument("--out", help="Markdown report")
    args = p.parse_args(argv)
    if args.quick:
        args.sizes, args.repeats = "65536", 3
    torch.set_num_threads(1)
    results = [measure(int(n), args.repeats, d) for n in args.sizes.split(",") for d in ("float32", "bfloat16")]
    lines = [
        "| coordinates | buffer dtype | codec round, ms | with error feedback, ms | extra / codec round | "
        "buffer memory, MB (bytes per coordinate) |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    for r in results:
        lines.append(
            f"| {r['n']:,} | {r['dtype']} | {1e3 * r['codec_s']:.1f} | {1e3 * r['feedback_s']:.1f} | "
            f"{r['share']:.2f} | {r['bytes'] / 1e6:.1f} ({r['bytes'] / r['n']:g}) |"
        )
    table = "\n".join(lines) + "\n"
    print(f"codec: {results[0]['codec']}\n{table}")
    if args.out:
        head = (
            "# What error feedback costs beside the codec\n\n"
            f"Command: `python -m scripts.bench.feedback {' '.join(argv if argv is not None else sys.argv[1:])}` "
            f"({time.strftime('%Y-%m-%d %H:%M')} UTC; torch {torch.__version__}, codec {results[0]['codec']}, "
            "1 thread; this machine's 2 cores were shared with other jobs: read the ratios).\n\n"
        )
        with open(args.out, "w") as f:
            f.write(head + (__doc__ or "").split("\n\n")[1] + "\n\n" + table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
