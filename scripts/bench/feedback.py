#!/usr/bin/env python
"""What error feedback costs a rank per round, beside the codec: one process, the compiled CPU
codec on float32 CPU tensors (TorchOps), ALQ 3 bits, buckets of 8192.

Rows, interleaved, medians over repeats: the codec's round of one rank's own values (encode, then
decode one payload: what every exchange does at least once); the same with error feedback as it
runs (``ErrorFeedback.encode``: the compiled codec's one-pass kernel, which adds the error, encodes,
and writes the new error of each bucket while it is in cache); the same through the two-pass path
that other codecs take (the error added, the encode, a decode of the own payload, the new error and
a finiteness check); and, as the memory floor, one elementwise pass ``e += x`` over the buffer.
Extra times are shares of the codec's round; the memory of the buffers per dtype is exact (4 or 2
bytes per compressed coordinate).

    python -m scripts.bench.feedback --out build/results/bench_feedback.md
    # the report goes by hand into docs/results/error_feedback.md#bench_feedback
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

from horovod_alq.core.quantizer import Quantizer
from horovod_alq.exchange.feedback import ErrorFeedback, Pending
from horovod_alq.torch.ops import TorchOps


def timed(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


class TwoPass:
    """``ops`` without the one-pass kernel: error feedback's path on codecs that lack it."""

    def __init__(self, ops) -> None:
        self.ops = ops

    def __getattr__(self, name):
        if name == "encode_feedback":
            raise AttributeError(name)
        return getattr(self.ops, name)


def measure(n: int, repeats: int, dtype: str) -> dict:
    ops, q = TorchOps(torch.device("cpu"), "auto"), Quantizer("alq", bits=3, bucket_size=8192)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, generator=g) * torch.rand(n, generator=g)
    out = torch.zeros(n)
    one, two, many = ErrorFeedback(dtype), ErrorFeedback(dtype), ErrorFeedback(dtype)
    floor = torch.zeros(n, dtype=getattr(torch, dtype))
    slow = TwoPass(ops)
    whole = [("k", 0, n, 0)]  # one tensor: its buffer is the kernel's (adopted at the commit)
    k = 16  # a fusion buffer of 16 tensors: their errors copied in before and out after
    step = -(-n // k)
    pieces = [(i, 0, min(step, n - a), a) for i, a in enumerate(range(0, n, step))]

    def with_feedback(fb, o, spans):
        out.zero_()
        pending = Pending()
        ops.decode_sum(out, fb.encode(o, x, q, 1, "own", spans, pending, (0, 1)), [0], q)
        fb.commit(pending)

    def codec():
        out.zero_()
        ops.decode_sum(out, ops.encode(x, q, 1), [0], q)

    rows = {
        "codec": codec,
        "one_pass": lambda: with_feedback(one, ops, whole),
        "pieces": lambda: with_feedback(many, ops, pieces),
        "two_pass": lambda: with_feedback(two, slow, whole),
        "floor": lambda: floor.add_(x),
    }
    for fn in rows.values():  # warm-up (and the buffers exist from here on)
        fn()
    times = {k: [] for k in rows}
    for _ in range(repeats):
        for k, fn in rows.items():
            times[k].append(timed(fn, 1))
    med = {k: statistics.median(v) for k, v in times.items()}
    base = med["codec"]
    return {"n": n, "dtype": dtype, "codec": ops.codec.name, "bytes": one.nbytes, "codec_s": base,
            **{f"{k}_s": med[k] for k in ("one_pass", "pieces", "two_pass", "floor")},
            "one_pass_share": (med["one_pass"] - base) / base, "two_pass_share": (med["two_pass"] - base) / base,
            "pieces_share": (med["pieces"] - base) / base,
            "floor_share": med["floor"] / base}  # fmt: skip


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="1048576,16777216", help="coordinates; default 1M and 16M")
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--out", help="Markdown report")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    results = [measure(int(n), args.repeats, d) for n in args.sizes.split(",") for d in ("float32", "bfloat16")]
    lines = [
        "| coordinates | buffer dtype | codec round, ms | with error feedback (one pass), ms | extra / round | "
        "16 tensors in the range, ms | extra / round | "
        "two-pass path, ms | extra / round | e += x, ms / round | buffer memory, MB (bytes per coordinate) |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        lines.append(
            f"| {r['n']:,} | {r['dtype']} | {1e3 * r['codec_s']:.1f} | {1e3 * r['one_pass_s']:.1f} | "
            f"{r['one_pass_share']:.2f} | {1e3 * r['pieces_s']:.1f} | {r['pieces_share']:.2f} | "
            f"{1e3 * r['two_pass_s']:.1f} | {r['two_pass_share']:.2f} | "
            f"{1e3 * r['floor_s']:.1f} / {r['floor_share']:.2f} | {r['bytes'] / 1e6:.1f} ({r['bytes'] / r['n']:g}) |"
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
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            f.write(head + (__doc__ or "").split("\n\n")[1] + "\n\n" + table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
