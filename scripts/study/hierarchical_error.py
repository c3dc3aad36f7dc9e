#!/usr/bin/env python
"""Quantization error of the hierarchical exchange against the flat ones, on real gradients.

N ranks (threads of one process standing for them, horovod_alq.testing) in nodes of G
consecutive ranks each compute the gradient of their own minibatch of the demo CNN (MNIST digits)
or of the character GPT (scripts/common/gpt.py), after --warmup steps of plain training. Every
exchange runs the real engine (horovod_alq.exchange, NumPy codec, ALQ levels fitted in a first round
to these gradients): the flat ones (`allgather`, and `two-phase`, what `exchange="auto"` picks on
one node from 4 ranks) at 3 bits, the hierarchical one at 3, 4 and 5 bits and the hierarchical
two-phase one at 3 and 4 (what `"auto"` picks from 4 nodes on). For each it reports
the relative squared error of the decoded mean against the exact mean, ||mean_Q - mean||^2 /
||mean||^2, averaged over --rounds rounds of fresh rounding noise (mean and standard error), and
the bytes that crossed between nodes per step, counted on the transports (every byte a rank sent to
a rank of another node, summed over ranks).

    python -m scripts.study.hierarchical_error     # N=4 and 16, G=2,4,8: build/results/hierarchical_error.md
    python -m scripts.study.hierarchical_error --quick --out /tmp/h.md             # N=8, G=2, CNN only
    python -m scripts.study.hierarchical_error --exchanges hierarchical-two-phase --append   # rows into --out's report
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from horovod_alq.exchange.numpy_ops import NumpyOps
from horovod_alq.settings import Settings, configure
from horovod_alq.testing import Hub

ROWS = [
    ("flat allgather", "allgather", 3),
    ("flat two-phase", "two-phase", 3),
    ("hierarchical", "hierarchical", 3),
    ("hierarchical", "hierarchical", 4),
    ("hierarchical", "hierarchical", 5),
    ("hierarchical two-phase", "hierarchical-two-phase", 3),
    ("hierarchical two-phase", "hierarchical-two-phase", 4),
]


def cnn_gradients(ranks: int, warmup: int, batch: int, seed: int) -> list[list[np.ndarray]]:
    from scripts.common.cnn import Net, load_digits

    torch.manual_seed(seed)
    x, y, _, _ = load_digits(seed)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(seed)
    for _ in range(warmup):
        idx = torch.randint(0, len(x), (batch * ranks,), generator=g)
        opt.zero_grad()
        F.cross_entropy(model(x[idx]), y[idx]).backward()
        opt.step()
    out = []
    for _ in range(ranks):
        idx = torch.randint(0, len(x), (batch,), generator=g)
        model.zero_grad()
        F.cross_entropy(model(x[idx]), y[idx]).backward()
        out.append([p.grad.detach().numpy().ravel().astype(np.float32).copy() for p in model.parameters()])
    return out


def gpt_gradients(ranks: int, warmup: int, batch: int, seed: int) -> list[list[np.ndarray]]:
    from scripts.common.gpt import GPT, char_splits, sample_batch

    torch.manual_seed(seed)
    train, _, chars = char_splits()
    model = GPT(len(chars), width=128, layers=2, heads=4, context=64)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(seed)
    for _ in range(warmup):
        xb, yb = sample_batch(train, batch * ranks, 64, g)
        opt.zero_grad()
        model.loss(xb, yb).backward()
        opt.step()
    out = []
    for _ in range(ranks):
        xb, yb = sample_batch(train, batch, 64, g)
        model.zero_grad()
        model.loss(xb, yb).backward()
        out.append([p.grad.detach().numpy().ravel().astype(np.float32).copy() for p in model.parameters()])
    return out


def measure(grads: list[list[np.ndarray]], g: int, exchange: str, bits: int, rounds: int, bucket: int) -> dict:
    """The engine's rounds over the ranks' gradients: relative squared error of the decoded mean
    (rounds after the first, which fits the levels) and the bytes sent between nodes per round."""
    n = len(grads)
    exact = [np.mean([gr[k].astype(np.float64) for gr in grads], axis=0) for k in range(len(grads[0]))]
    norm2 = sum(float((e**2).sum()) for e in exact)
    setups = [
        configure(
            Settings("alq", bits, bucket, seed=11, exchange=exchange, update_steps=(0,), update_every=0, min_size=1024)
        )
        for _ in range(n)
    ]
    engines = [s.engine(uid="study") for s in setups]
    ops = NumpyOps()
    errors, inter = [], []
    for rnd in range(rounds + 1):
        transports = Hub(n, timeout=600, local_size=g).transports()

        def rank(r):
            t = transports[r]
            entries = [engines[r].add(x, x.size, x.shape, "float32", t) for x in grads[r]]
            reduced = [t.allreduce_sum(v, f"{rnd}.c{k}") for k, (_, v) in enumerate(entries)]
            return [engines[r].finish(e, v, ops, t)[0] / n for (e, _), v in zip(entries, reduced)]

        with ThreadPoolExecutor(n) as pool:
            outs = list(pool.map(rank, range(n)))
        if rnd == 0:
            continue  # the refit round
        errors.append(sum(float(((o.astype(np.float64) - e) ** 2).sum()) for o, e in zip(outs[0], exact)) / norm2)
        inter.append(sum(b for t in transports for dst, b in t.sent_to.items() if dst // g != t.rank // g))
    errors = np.asarray(errors)
    return {
        "error": float(errors.mean()),
        "error_se": float(errors.std(ddof=1) / np.sqrt(len(errors))),
        "inter_node_bytes": int(np.mean(inter)),
        "exchange_used": setups[0].state.exchange,
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", default="4,16", help="comma-separated rank counts")
    p.add_argument("--local-sizes", default="2,4,8")
    p.add_argument("--models", default="cnn,gpt")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--bucket", type=int, default=8192)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="8 ranks, G=2, the CNN, 3 rounds, 10 warm-up steps")
    p.add_argument(
        "--out",
        default="build/results/hierarchical_error.md",
        help="the report, its JSON in data/ beside it; default %(default)s (folded into "
        "docs/results/clusters.md#hierarchical_error by hand)",
    )
    p.add_argument(
        "--exchanges",
        help="comma-separated: only the rows of these exchanges (flat two-phase, the "
        "reference of the ratios, always runs)",
    )
    p.add_argument(
        "--append",
        action="store_true",
        help="merge into --out's raw data: replace the rows measured "
        "again, keep the others, and name both commands on the page",
    )
    args = p.parse_args(argv)
    if args.quick:
        args.ranks, args.local_sizes, args.models, args.rounds, args.warmup = "8", "2", "cnn", 3, 10
    rows = ROWS
    if args.exchanges:
        wanted = {*args.exchanges.split(","), "two-phase"}
        rows = [r for r in ROWS if r[1] in wanted]
    started = time.time()
    results = []
    for ranks in (int(v) for v in str(args.ranks).split(",")):
        for model in args.models.split(","):
            grads = (cnn_gradients if model == "cnn" else gpt_gradients)(ranks, args.warmup, args.batch, args.seed)
            coords = sum(x.size for x in grads[0])
            for g in (int(v) for v in args.local_sizes.split(",")):
                if not 1 < g < ranks or ranks % g:
                    continue  # one node, or nodes of unequal size
                for label, exchange, bits in rows:
                    res = measure(grads, g, exchange, bits, args.rounds, args.bucket)
                    results.append(
                        {
                            "model": model,
                            "coordinates": coords,
                            "ranks": ranks,
                            "local_size": g,
                            "row": label,
                            "exchange": exchange,
                            "bits": bits,
                            **res,
                        }
                    )
                    print(json.dumps(results[-1]), flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    raw_dir = out.parent / "data" if (out.parent / "data").is_dir() else out.parent
    raw = raw_dir / (out.stem + ".json")
    command = seconds = None
    if args.append:
        results, command, seconds = merged(raw, out, results, argv, time.time() - started)
    raw.write_text(json.dumps(results, indent=1))
    out.write_text(render(results, args, seconds or time.time() - started, command))
    print(f"wrote {out} and {raw_dir / (out.stem + '.json')}")


def merged(raw: Path, page: Path, new: list[dict], argv, seconds: float) -> tuple[list[dict], str, float]:
    """``new`` rows merged into the study's raw data (the rows of the same model, layout, exchange
    and bits replaced, in the study's row order), the page's command line with this run's added,
    and the seconds of both."""
    key = lambda r: (r["model"], r["ranks"], r["local_size"], r["exchange"], r["bits"])  # noqa: E731
    again = {key(r) for r in new}
    old = [r for r in json.loads(raw.read_text()) if key(r) not in again]
    order = {(e, b): k for k, (_, e, b) in enumerate(ROWS)}
    results = sorted(
        old + new, key=lambda r: (r["ranks"], r["model"], r["local_size"], order[r["exchange"], r["bits"]])
    )
    first = page.read_text().split("\n\n", 2)[1]  # the command paragraph
    before = re.match(r"(.*) \((\d{4}-\d\d-\d\d), (\d+) s on", first)
    argv = sys.argv[1:] if argv is None else argv
    this = f"`python -m scripts.study.hierarchical_error {' '.join(argv)}`"
    command = f"{before.group(1)} ({before.group(2)}), then {this}"  # the page adds this run's date
    return results, command, float(before.group(3)) + seconds


def render(results: list[dict], args, seconds: float, command: str | None = None) -> str:
    """The page: one table per model and node layout, ratios to the flat two-phase exchange at 3 bits."""
    command = command or f"`python -m scripts.study.hierarchical_error{' --quick' if args.quick else ''}`"
    lines = [
        "# Hierarchical exchange: quantization error and bytes between nodes on real gradients\n",
        f"{command} ({time.strftime('%Y-%m-%d')}, {seconds:.0f} s on this project's 2-core CPU machine): "
        f"ranks as threads standing for them, ALQ with max-abs buckets of {args.bucket}, levels fitted "
        f"in a first round to the same gradients, {args.rounds} rounds of fresh rounding noise after it; "
        f"gradients after {args.warmup} steps of plain training, minibatches of {args.batch} per rank. "
        "Error: ||mean_Q - mean||^2 / ||mean||^2 (mean +- s.e. over rounds). Bytes between nodes: every "
        "byte a rank sent to a rank of another node in one step, all ranks together (counted on the "
        "transports; headers included).\n",
    ]
    layouts = sorted(dict.fromkeys((r["model"], r["ranks"], r["local_size"]) for r in results))
    for model, ranks, g in layouts:
        rows = [r for r in results if (r["model"], r["ranks"], r["local_size"]) == (model, ranks, g)]
        ref = next(r for r in rows if r["exchange"] == "two-phase")
        lines.append(f"\n## {model.upper()} ({rows[0]['coordinates']:,} coordinates), {ranks // g} nodes x {g} ranks\n")
        lines.append(
            "| exchange | bits | error | error / flat two-phase 3 bits | bytes between nodes | "
            "bytes / flat two-phase 3 bits |"
        )
        lines.append("|---|---|---|---|---|---|")
        for r in rows:
            lines.append(
                f"| {r['row']} | {r['bits']} | {r['error']:.4f} +- {r['error_se']:.4f} | "
                f"{r['error'] / ref['error']:.2f} | {r['inter_node_bytes']:,} | "
                f"{r['inter_node_bytes'] / ref['inter_node_bytes']:.2f} |"
            )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
