#!/usr/bin/env python
"""Does Horovod's background thread wait for the GIL? With torch 2.13 it takes it whenever it drops
the last C++ reference to a tensor that Python holds (once per collective). Conditions interleaved
in the same processes, slowest rank; results:
docs/results/compress_when_faster.md#horovods-background-thread-and-the-gil.

Chains (default): --k dependent allreduces of --n floats, waited for as the package's transport
waits; a second Python thread spinning bytecode or not; the tensor held by a view (whose autograd
meta holds it as an at::Tensor: Horovod's thread then never takes the GIL) or not; the switch
interval at its default or --small. --train: the ResNet-18 step of scripts.bench.train_step (rows
hvd-fp16, hvd-alq), each at both switch intervals.

    OMPI_MCA_mpi_yield_when_idle=1 python -m scripts.common.launch -np 2 python -m scripts.bench.gil_wait [--train]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import threading
import time

import horovod.torch as hvd
import torch

from horovod_alq.core.protocol import wait_for


def spinner(go: threading.Event, stop: threading.Event) -> None:
    """While ``go`` is set, run pure Python bytecode (it holds the GIL until a switch is forced)."""
    while not stop.is_set():
        if go.wait(0.05):
            x = 0
            while go.is_set():
                for _ in range(100):
                    x += 1


def chain(args, held: bool) -> float:
    """Seconds per collective over ``args.k`` dependent in-place allreduces."""
    t = torch.ones(args.n)
    keep = t.view(-1) if held else None
    t0 = time.perf_counter()
    for i in range(args.k):
        h = hvd.allreduce_async_(t, name=f"gil.{i}", op=hvd.Sum)
        wait_for(lambda: hvd.poll(h), 60.0, "gil", "global")
        hvd.synchronize(h)
        t.mul_(0.5)
    del keep
    return (time.perf_counter() - t0) / args.k


def train_step(args, built: dict, key: str) -> float:
    """Seconds of one step of row ``key`` (built by :func:`scripts.common.rows.build`)."""
    model, opt, (x, y) = built[key]["model"], built[key]["opt"], built["batch"]
    t0 = time.perf_counter()
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    return time.perf_counter() - t0


def run(args) -> dict:
    """{condition: [seconds]}, every condition once per round, the order rotated each round."""
    go, stop, built = threading.Event(), threading.Event(), {}
    intervals = (sys.getswitchinterval(), args.small)
    if args.train:
        from scripts.bench.train_step import resnet18
        from scripts.common import rows

        gen = torch.Generator().manual_seed(hvd.rank())
        x, y = torch.randn(args.batch, 3, 32, 32, generator=gen), torch.randint(0, 10, (args.batch,), generator=gen)
        built["batch"] = x, y
        for key in ("hvd-fp16", "hvd-alq"):
            torch.manual_seed(0)
            model = resnet18(args.width)
            built[key] = rows.build(key, model, torch.optim.SGD(model.parameters(), lr=0.01), hvd)
        conds = list(itertools.product(("hvd-fp16", "hvd-alq"), intervals))
    else:
        threading.Thread(target=spinner, args=(go, stop), daemon=True).start()
        conds = list(itertools.product((False, True), (False, True), intervals))
    times = {c: [] for c in conds}
    for r in range(args.warmup + args.rounds):
        for cond in conds[r % len(conds) :] + conds[: r % len(conds)]:
            default = sys.getswitchinterval()
            sys.setswitchinterval(cond[-1])
            hvd.barrier()
            if not args.train and cond[0]:
                go.set()
                time.sleep(0.01)
            s = train_step(args, built, cond[0]) if args.train else chain(args, cond[1])
            go.clear()
            sys.setswitchinterval(default)
            times[cond].append(s)
    stop.set()
    return {c: v[args.warmup :] for c, v in times.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = p.add_argument
    add("--train", action="store_true", help="time the ResNet-18 step instead of chains of allreduces")
    add("--rounds", type=int, default=15, help="timed rounds of every condition; default 15")
    add("--warmup", type=int, default=3, help="untimed rounds first; default 3")
    add("--small", type=float, default=1e-4, help="the small switch interval, s; default 1e-4")
    add("--k", type=int, default=40, help="chains: dependent allreduces per chain; default 40")
    add("--n", type=int, default=64, help="chains: float32 elements per allreduce; default 64")
    add("--width", type=float, default=0.25, help="--train: ResNet-18 width; default 0.25")
    add("--batch", type=int, default=8, help="--train: batch per rank; default 8")
    args = p.parse_args(argv)
    hvd.init()
    torch.set_num_threads(1)
    load0, start = os.getloadavg()[0], time.time()
    times = run(args)
    flat = torch.tensor([t for v in times.values() for t in v], dtype=torch.float64)
    slow = hvd.allreduce(flat, op=hvd.Max, name="gil.max").view(len(times), -1).tolist()
    if hvd.rank() == 0:
        utc = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(start))
        print(json.dumps({"argv": sys.argv[1:], "utc": utc, "wall_s": round(time.time() - start, 1)}))
        print(json.dumps({"load": [round(load0, 2), round(os.getloadavg()[0], 2)], "size": hvd.size()}))
        for cond, row in zip(times, slow):
            us = [round(1e6 * v) for v in row]
            print(json.dumps({"cond": cond, "median_us": statistics.median(us), "us": us}))
    hvd.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
