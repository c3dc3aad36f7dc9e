#!/usr/bin/env python3
"""Sanity job: every rank allreduces and allgathers a small tensor with Horovod and checks the result.

Run it on several processes, e.g.:

    mpirun --allow-run-as-root --oversubscribe -np 2 .venv/bin/python -m scripts.demo.hello_horovod
    .venv/bin/horovodrun --gloo -np 2 -H localhost:2 .venv/bin/python -m scripts.demo.hello_horovod

Exits 1 on any rank whose result is wrong.
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--framework",
        choices=["torch", "tensorflow"],
        default="torch",
        help="which Horovod binding to use (default: torch)",
    )
    parser.add_argument("--size", type=int, default=4, help="elements per rank (default: 4)")
    opts = parser.parse_args(argv)

    if opts.framework == "torch":
        import horovod.torch as hvd
        import torch

        hvd.init()
        rank, n = hvd.rank(), hvd.size()
        x = torch.arange(opts.size, dtype=torch.float32) + rank
        total = hvd.allreduce(x, op=hvd.Sum, name="hello.sum").tolist()
        gathered = hvd.allgather(torch.tensor([rank]), name="hello.gather").tolist()
    else:
        import horovod.tensorflow as hvd
        import tensorflow as tf

        hvd.init()
        rank, n = hvd.rank(), hvd.size()
        x = tf.range(opts.size, dtype=tf.float32) + rank
        total = hvd.allreduce(x, op=hvd.Sum, name="hello.sum").numpy().tolist()
        gathered = hvd.allgather(tf.constant([rank]), name="hello.gather").numpy().tolist()

    want_total = [float(n * i + n * (n - 1) // 2) for i in range(opts.size)]
    ok = total == want_total and gathered == list(range(n))
    controller = "MPI" if hvd.mpi_enabled() else "Gloo" if hvd.gloo_enabled() else "?"
    print(
        f"rank {rank}/{n} ({opts.framework}, {controller}): allreduce(sum) = {total}, "
        f"allgather(rank) = {gathered} -> {'ok' if ok else 'WRONG, expected ' + str(want_total)}",
        flush=True,
    )
    hvd.shutdown()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
