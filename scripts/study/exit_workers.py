"""The ranks' side of scripts/study/exit_stress.py: one agreement error (or a timeout) per launch, then
the teardown a user writes, then the error's own exit.

    torchrun --standalone --nproc-per-node 2 -m scripts.study.exit_workers diloco
    mpirun -np 2 python -m scripts.study.exit_workers mpi

Each path makes the ranks disagree (or one rank stop), catches the error it expects on every rank,
tears down as a user would (``dist.destroy_process_group()``; mpi4py finalizes at exit) and raises
the error again: a rank that ends well exits with status 1 and the error's traceback. Status 0: no
error was raised; 3: another error than the one expected (printed). Anything else, a signal above
all, is what the stress script counts as a crash at exit.
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np

TIMEOUT = 3.0  # seconds: the timeout path's wait
STOPPED = "this rank stopped calling (injected)"

#: What each path's error says (one of these substrings of ``str(error)``).
EXPECTED = {
    "diloco": ("DiLoCo settings differ: sync_every",),
    "ddp": ("bits",),
    "fsdp": ("bits",),
    "hierarchical": ("differ in node layouts",),
    "mpi": ("bits",),
    "timeout": ("did not complete within", STOPPED),
}


def _net():
    import torch

    torch.manual_seed(0)  # the same initial parameters on every rank
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))


def _batch(rank: int):
    import torch

    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(16, 32, generator=g)
    return x, torch.randint(0, 4, (16,), generator=g)


def _diloco_steps(rank: int, sync_every: int, steps: int, **keywords) -> None:
    """``steps`` inner steps of a DiLoCo with ``sync_every`` (its outer steps are collective)."""
    import torch
    import torch.nn.functional as F

    from horovod_alq.torch.diloco import DiLoCo

    model = _net()
    inner = torch.optim.SGD(model.parameters(), lr=0.01)
    diloco = DiLoCo(model, inner, sync_every=sync_every, min_size=64, **keywords)
    x, y = _batch(rank)
    for _ in range(steps):
        F.cross_entropy(model(x), y).backward()
        diloco.step()
        inner.zero_grad()


def diloco(rank: int) -> None:
    """The report of issue 56: sync_every 5 on rank 0, 10 on the others; both raise at the first outer step."""
    _diloco_steps(rank, 5 if rank == 0 else 10, 10, method="alq", bits=3)


def hierarchical(rank: int) -> None:
    """The hierarchical exchange (a companion group per further stage) where rank 0 declares a node
    per rank and the others one node of every rank: the handshake's layout differs."""
    import torch.distributed as dist

    os.environ["HOROVOD_ALQ_LOCAL_SIZE"] = "1" if rank == 0 else str(dist.get_world_size())
    _diloco_steps(rank, 2, 2, exchange="hierarchical", bits=3)


def timeout(rank: int) -> None:
    """Rank 1 never reaches its outer step and stays alive past the timeout (then fails itself);
    rank 0 waits in the outer step's handshake and raises CollectiveTimeout after ``TIMEOUT``."""
    if rank == 0:
        _diloco_steps(rank, 2, 2, timeout=TIMEOUT)
        return
    _diloco_steps(rank, 100, 2, timeout=TIMEOUT)
    time.sleep(TIMEOUT + 2)
    raise RuntimeError(STOPPED)


def ddp(rank: int) -> None:
    """The DDP hook with 3 bits on rank 0, 4 on the others: the first bucket's handshake raises."""
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    from horovod_alq.torch.ddp import ALQState, alq_hook

    model = DDP(_net())
    model.register_comm_hook(ALQState(bits=3 if rank == 0 else 4, min_size=64), alq_hook)
    x, y = _batch(rank)
    F.cross_entropy(model(x), y).backward()


def fsdp(rank: int) -> None:
    """FSDP2's reduce-scatter comm with 3 bits on rank 0, 4 on the others: the backward raises."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from horovod_alq.torch.fsdp import ALQReduceScatter, quantize_reduce_scatter

    model = _net()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model:
        if list(layer.parameters()):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    quantize_reduce_scatter(model, ALQReduceScatter(bits=3 if rank == 0 else 4, min_size=64))
    x, y = _batch(rank)
    F.cross_entropy(model(x), y).backward()


def mpi(rank: int) -> None:
    """mpi4py's QuantizedAllreduce with 3 bits on rank 0, 4 on the others."""
    from mpi4py import MPI

    from horovod_alq.mpi import QuantizedAllreduce

    ar = QuantizedAllreduce(MPI.COMM_WORLD, "alq", bits=3 if rank == 0 else 4, bucket_size=256)
    ar(np.random.default_rng(rank).standard_normal(4096).astype(np.float32))


TORCH_PATHS = {"diloco": diloco, "ddp": ddp, "fsdp": fsdp, "hierarchical": hierarchical, "timeout": timeout}
MPI_PATHS = {"mpi": mpi}


def run(path: str) -> int:
    """Run ``path`` on this rank; returns the exit status when no error was raised (0) or another
    error than the expected one (3). The expected error propagates (status 1)."""
    torch_path = path in TORCH_PATHS
    if torch_path:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group("gloo")
        rank = dist.get_rank()
    else:
        from mpi4py import MPI

        rank = MPI.COMM_WORLD.Get_rank()
    try:
        {**TORCH_PATHS, **MPI_PATHS}[path](rank)
    except Exception as err:
        if torch_path:
            dist.destroy_process_group()  # the user's teardown after the error
        if not any(text in str(err) for text in EXPECTED[path]):
            print(f"rank {rank}: unexpected error {type(err).__name__}: {err}", flush=True)
            return 3
        print(f"rank {rank}: the expected error: {type(err).__name__}: {str(err)[:300]}", flush=True)
        raise
    print(f"rank {rank}: no error", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or argv[0] not in {**TORCH_PATHS, **MPI_PATHS}:
        print(__doc__)
        print(f"paths: {', '.join({**TORCH_PATHS, **MPI_PATHS})}")
        return 2
    return run(argv[0])


if __name__ == "__main__":
    sys.exit(main())
