#!/usr/bin/env python
"""What a refit round costs with ``bits="auto"`` against fixed bits, on the gradients of the
character-level GPT (scripts/common/gpt.py, the model of scripts/demo/train_gpt.py).

One process, one rank (every collective returns its input), the Horovod compressors' engine with
the compiled CPU codec: the time of a plain round (quantize, exchange, decode every tensor of the
step), of a refit round with fixed 3 bits (statistics and one level fit added) and of a refit round
with ``bits="auto"`` (each tensor's error at every width, the allocation, one level fit per width
in use; with ``bits_max=4`` only the widths 2 to 4); medians over repeats, rows interleaved, as
ratios to the plain round. Also what the cap costs: the allocation's quantization error at budget
``--budget`` with widths 2 to 4 against 2 to 8, on the timed round's gradient and levels. Each timed round
refits on another batch's gradient than the round before it (as in training: a refit's statistics
are new), so the level fits start warm but not at their fixed point.

    python -m scripts.bench.refit --out build/results/bench_refit.md
    # the report goes by hand into docs/results/codec_speed.md#bench_refit
    python -m scripts.bench.refit --quick
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np
import torch

from horovod_alq.core.allocation import allocate_bits
from horovod_alq.core.auto_bits import AUTO_WIDTHS, errors_from_histograms
from horovod_alq.core.rounds import DEFAULT_UPDATE_EVERY, DEFAULT_UPDATE_STEPS, RefitSchedule
from horovod_alq.exchange.interfaces import SingleRank
from horovod_alq.exchange.job import auto_rows
from horovod_alq.settings import Settings, configure
from horovod_alq.torch.ops import TorchOps
from scripts.common.bench import gpt_gradients, one_round, write_report


def allocation_time(auto, grads, ops) -> float:
    """Seconds of the allocation proper on one round's tensors (their histograms taken before the
    clock starts): every tensor's error at every width, then the exact allocation."""
    rows = auto_rows(auto, ops, grads)  # the refit vectors (errors, statistics), as the round computes them
    squared = np.stack([ops.auto_statistics(g, auto.quantizers[auto.default])[0] for g in grads])
    t0 = time.perf_counter()
    errors = errors_from_histograms(squared, [auto.quantizers[w].levels for w in AUTO_WIDTHS])
    allocate_bits(errors, [g.numel() for g in grads], auto.budget, AUTO_WIDTHS)
    elapsed = time.perf_counter() - t0
    assert np.array_equal(errors, rows[:, : len(AUTO_WIDTHS)])  # the same errors as the round's
    return elapsed


def cap_line(errors: np.ndarray, sizes: list, budget: float, chosen: tuple) -> str:
    """What ``bits_max=4`` costs: the optimal allocation's error within widths 2 to 4 against 2 to 8."""
    full = allocate_bits(errors, sizes, budget, AUTO_WIDTHS)
    capped = allocate_bits(errors[:, :3], sizes, budget, AUTO_WIDTHS[:3])
    wide = sum(n for n, b in zip(sizes, chosen) if b > 4)
    return (
        f"`bits_max=4`: at budget {budget} the allocation within widths 2 to 4 has {capped.error / full.error:.3f}x "
        f"the quantization error of the one within 2 to 8 (same errors per width, the timed round's levels); "
        f"uncapped, {wide:,} of {sum(sizes):,} coordinates got more than 4 bits (widths {sorted(set(chosen))})."
    )


def amortized(extra: float, plain: float, steps: int = DEFAULT_UPDATE_EVERY) -> str:
    """What ``extra`` seconds per refit round cost per step of a run under the default refit schedule
    (derived from the medians, not timed): refits in the first ``steps`` rounds, per round and
    against the plain rounds' time."""
    refits = sum(RefitSchedule().collects(t) for t in range(steps))
    per_step = extra * refits / steps
    return (
        f"Derived: the default schedule refits {refits} times in the first {steps:,} rounds "
        f"(steps {', '.join(map(str, DEFAULT_UPDATE_STEPS))}, then every {DEFAULT_UPDATE_EVERY:,}), so "
        f"`bits='auto'`'s {1000 * extra:.1f} ms over a 3-bit refit round add {1e6 * per_step:.1f} us per round "
        f"on average, {100 * per_step / plain:.2f}% of a plain round."
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--method", default="alq")
    p.add_argument("--budget", type=float, default=3.0)
    p.add_argument("--quick", action="store_true", help="2 repeats")
    p.add_argument("--out", help="Markdown report (default: print only)")
    args = p.parse_args(argv)
    repeats = 2 if args.quick else args.repeats
    torch.set_num_threads(1)
    warm, grads = gpt_gradients(1024, batch=0), gpt_gradients(1024, batch=1)
    ops, transport = TorchOps("cpu"), SingleRank()
    auto_row = f"refit round, bits='auto' (budget {args.budget})"
    capped_row = f"refit round, bits='auto', bits_max=4 (budget {args.budget})"
    cases = {
        "plain round (3 bits)": (3, None, None, False, None),
        "refit round, 3 bits": (3, None, None, True, None),
        auto_row: ("auto", args.budget, None, True, None),
        capped_row: ("auto", args.budget, None, True, 4),
        f"refit round, bits='auto', bits_per='bucket' (budget {args.budget})": (
            "auto",
            args.budget,
            "bucket",
            True,
            None,
        ),
    }
    times = {name: [] for name in cases}
    allocation = []
    for _ in range(repeats):
        for name, (bits, budget, bits_per, refit, bits_max) in cases.items():  # rows interleaved
            setup = configure(
                Settings(
                    args.method,
                    bits,
                    8192,
                    bit_budget=budget,
                    bits_per=bits_per,
                    bits_max=bits_max,
                    update_steps=(0,) if refit else (),
                    update_every=0,
                    seed=0,
                )
            )
            engine = setup.engine(exchange="allgather", uid="bench")
            one_round(setup, engine, warm, ops, transport)  # warm: codec, allocations, levels
            setup.state.step = 0  # the timed round refits (or not) again
            times[name].append(one_round(setup, engine, grads, ops, transport))
            if name == auto_row:
                allocation.append(allocation_time(setup.state.auto, grads, ops))
                chosen = setup.state.auto.bits
                errors = auto_rows(setup.state.auto, ops, grads)[:, : len(AUTO_WIDTHS)]
    plain = statistics.median(times["plain round (3 bits)"])
    numel = sum(g.numel() for g in grads)
    lines = [
        f"Command: `python -m scripts.bench.refit {' '.join(argv if argv is not None else sys.argv[1:])}` "
        f"({time.strftime('%Y-%m-%d')}; {args.method}, {len(grads)} tensors, {numel:,} coordinates of one GPT "
        f"gradient, one rank, compiled CPU codec, medians of {repeats}).",
        "",
        "| round | median (ms) | ratio to the plain round | ratio to the 3-bit refit round |",
        "|---|---:|---:|---:|",
    ]
    refit3 = statistics.median(times["refit round, 3 bits"])
    for name, ts in times.items():
        m = statistics.median(ts)
        lines.append(f"| {name} | {1000 * m:.1f} | {m / plain:.2f} | {m / refit3:.2f} |")
    auto, alloc = statistics.median(times[auto_row]), statistics.median(allocation)
    lines += [
        "",
        f"Of the `bits='auto'` round (per tensor), the allocation proper (every tensor's error at every "
        f"width from its histograms, then `allocate_bits`' exact optimum) takes {1000 * alloc:.1f} ms, "
        f"{100 * alloc / refit3:.0f}% of a 3-bit refit round; the rest of its {1000 * (auto - refit3):.1f} ms "
        f"over one is the per-tensor histograms and the level fits of every width in use.",
        "",
        amortized(auto - refit3, plain),
        "",
        cap_line(errors, [g.numel() for g in grads], args.budget, chosen),
    ]
    write_report(lines, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
