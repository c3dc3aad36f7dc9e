#!/usr/bin/env python
"""What widths per bucket (``bits="auto", bits_per="bucket"``) cost per round against fixed 3 bits
and against widths per tensor (``bits="auto"``), after the refit that sets the widths' levels.

One process, one rank (every collective returns its input), the Horovod compressors' engine with
the compiled CPU codec, allgather (one payload per fusion buffer): the time of a plain round
(quantize, exchange, decode every tensor of the step) and this rank's payload bytes, medians over
repeats, rows interleaved, as ratios to fixed 3 bits. Gradients: one GPT gradient (scripts/common/
gpt.py; 19 tensors) and a synthetic 16M-coordinate step (8 tensors of 2M, bucket scales spread
over orders of magnitude, as a real step's are).

    python -m scripts.bench.bucket_widths --out build/results/bench_bucket_widths.md
    # the report goes by hand into docs/results/codec_speed.md#bench_bucket_widths
    python -m scripts.bench.bucket_widths --quick
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from horovod_alq.exchange.interfaces import SingleRank
from horovod_alq.settings import Settings, configure
from horovod_alq.torch.ops import TorchOps
from scripts.common.bench import gpt_gradients, one_round, write_report


def synthetic(tensors: int, numel: int, bucket: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(tensors):
        scales = torch.exp(2 * torch.randn(-(-numel // bucket), generator=g)).repeat_interleave(bucket)[:numel]
        out.append(torch.randn(numel, generator=g) * scales)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--budget", type=float, default=3.0)
    p.add_argument("--bucket", type=int, default=8192)
    p.add_argument("--quick", action="store_true", help="2 repeats, a 2M-coordinate synthetic step")
    p.add_argument("--out", help="Markdown report (default: print only)")
    args = p.parse_args(argv)
    repeats = 2 if args.quick else args.repeats
    torch.set_num_threads(1)
    steps = {
        "GPT gradient": gpt_gradients(1024, batch=1),
        "synthetic": synthetic(2 if args.quick else 8, 1 << 20 if args.quick else 1 << 21, args.bucket),
    }
    ops, transport = TorchOps("cpu"), SingleRank()
    cases = {
        "3 bits": dict(bits=3),
        f"bits='auto' {args.budget}": dict(bits="auto", bit_budget=args.budget),
        f"bits_per='bucket' {args.budget}": dict(bits="auto", bit_budget=args.budget, bits_per="bucket"),
    }
    lines = [
        f"Command: `python -m scripts.bench.bucket_widths {' '.join(argv if argv is not None else sys.argv[1:])}` "
        f"({time.strftime('%Y-%m-%d')}; alq, bucket {args.bucket}, one rank, allgather, compiled CPU codec, "
        f"one thread, medians of {repeats}, rows interleaved).",
        "",
    ]
    for title, grads in steps.items():
        numel = sum(g.numel() for g in grads)
        engines = {}
        for name, kw in cases.items():
            setup = configure(Settings("alq", bucket_size=args.bucket, update_steps=(0,), update_every=0, seed=0, **kw))
            engine = setup.engine(exchange="allgather", uid="bench")
            one_round(setup, engine, grads, ops, transport)  # the refit: levels, widths, error model
            engines[name] = (setup, engine)
        times = {name: [] for name in cases}
        sent = {}
        for _ in range(repeats):
            for name, (setup, engine) in engines.items():
                before = setup.state.payload_bytes
                times[name].append(one_round(setup, engine, grads, ops, transport))
                sent[name] = setup.state.payload_bytes - before
        base = statistics.median(times["3 bits"])
        lines += [
            f"**{title}** ({len(grads)} tensors, {numel:,} coordinates):",
            "",
            "| round after the refit | median (ms) | ratio to 3 bits | payload bytes | bits per coordinate |",
            "|---|---:|---:|---:|---:|",
        ]
        for name, ts in times.items():
            m = statistics.median(ts)
            lines.append(
                f"| {name} | {1000 * m:.1f} | {m / base:.2f} | {sent[name]:,} | {8 * sent[name] / numel:.3f} |"
            )
        lines.append("")
    write_report(lines, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
