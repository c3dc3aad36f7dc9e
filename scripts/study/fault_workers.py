"""The ranks' side of scripts/study/fault_campaign.py: training rounds until something fails.

    torchrun --standalone --nproc-per-node 2 -m scripts.study.fault_workers ddp
    mpirun -np 2 python -m scripts.study.fault_workers mpi

Each front-end (``hvd``: Horovod PyTorch's DistributedOptimizer with ALQCompressor; ``ddp``: the DDP
hook; ``fsdp``: FSDP2's reduce-scatter comm; ``mpi``: mpi4py's QuantizedAllreduce) runs rounds and
prints ``round K`` after each. Whatever a round raises is printed as ``raised <unix time> <type>:
<message>`` and the rank ends at once with status 1 (``os._exit``: no teardown, which a collective
left in flight would hold up). The bound on every wait is ``$HOROVOD_ALQ_TIMEOUT``.
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np

ROUNDS = 100000


def _steps(model, optimizer, rank: int) -> None:
    import torch.nn.functional as F

    from scripts.study.exit_workers import _batch

    x, y = _batch(rank)
    for k in range(ROUNDS):
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        print(f"round {k}", flush=True)


def hvd(rank: int) -> None:
    import horovod.torch as hvd
    import torch

    from horovod_alq.torch import ALQCompressor
    from scripts.study.exit_workers import _net

    model = _net()
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01),
        named_parameters=model.named_parameters(),
        compression=ALQCompressor(bits=3, bucket_size=256, min_size=16),
    )
    _steps(model, opt, rank)


def ddp(rank: int) -> None:
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    from horovod_alq.torch.ddp import ALQState, alq_hook
    from scripts.study.exit_workers import _net

    model = DDP(_net())
    model.register_comm_hook(ALQState(bits=3, min_size=64), alq_hook)
    _steps(model, torch.optim.SGD(model.parameters(), lr=0.01), rank)


def fsdp(rank: int) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from horovod_alq.torch.fsdp import ALQReduceScatter, quantize_reduce_scatter
    from scripts.study.exit_workers import _net

    model = _net()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model:
        if list(layer.parameters()):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    quantize_reduce_scatter(model, ALQReduceScatter(bits=3, min_size=64))
    _steps(model, torch.optim.SGD(model.parameters(), lr=0.01), rank)


def mpi(rank: int) -> None:
    from mpi4py import MPI

    from horovod_alq.mpi import QuantizedAllreduce

    ar = QuantizedAllreduce(MPI.COMM_WORLD, "alq", bits=3, bucket_size=256)
    x = np.random.default_rng(rank).standard_normal(4096).astype(np.float32)
    for k in range(ROUNDS):
        ar(x)
        print(f"round {k}", flush=True)


PATHS = {"hvd": hvd, "ddp": ddp, "fsdp": fsdp, "mpi": mpi}
TORCHRUN = ("ddp", "fsdp")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or argv[0] not in PATHS:
        print(__doc__)
        return 2
    path = argv[0]
    if path in TORCHRUN:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group("gloo")
        rank = dist.get_rank()
    elif path == "hvd":
        import horovod.torch as hvd_torch

        hvd_torch.init()
        rank = hvd_torch.rank()
    else:
        from mpi4py import MPI

        rank = MPI.COMM_WORLD.Get_rank()
    try:
        PATHS[path](rank)
    except BaseException as err:  # noqa: BLE001 - every failure is the campaign's datum
        print(f"raised {time.time():.3f} {type(err).__name__}: {str(err)[:400]}", flush=True)
        os._exit(1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
