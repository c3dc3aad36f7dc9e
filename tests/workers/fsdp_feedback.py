"""FSDP2's reduce-scatter with error_feedback=True (torchrun, gloo): a 1-D parameter whose gradient
is the rank's fixed input, a warm-up round (the refit) and R rounds; each rank reports the sum of
its shard's outputs over the R rounds and its error buffers (from the comm's state_dict) after the
warm-up and after the last round, placed at their positions in the reduce-scatter input."""

from __future__ import annotations

import argparse

import numpy as np
import torch
import torch.distributed as dist
from common import linear, placed_buffers, report
from helpers import rank_data
from torch.distributed.fsdp import fully_shard

from horovod_alq.torch.fsdp import ALQReduceScatter, quantize_reduce_scatter


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--elements", type=int, default=10240)
    p.add_argument("--rounds", type=int, default=12)
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank, n = dist.get_rank(), args.elements
    model = linear(n)
    fully_shard(model)
    comm = quantize_reduce_scatter(
        model,
        ALQReduceScatter(bits=3, bucket_size=256, seed=5, update_steps=(0,), update_every=0, error_feedback=True),
    )
    x = torch.from_numpy(rank_data(rank, n, seed=20, tail=0.05))
    outs, first = [], None
    for i in range(args.rounds + 1):
        model.zero_grad(set_to_none=True)
        model(x).backward()
        if i == 0:
            first = placed_buffers(comm.state_dict(), n)
        else:
            outs.append(model.p.grad.to_local().double().numpy().copy())
    report({"rank": rank, "sum": np.sum(outs, axis=0), "first": first, "last": placed_buffers(comm.state_dict(), n)})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
