"""The ranks' side of tests/exit_ranks.py: one agreement error (or a timeout) per launch, then the
teardown a user writes, then the error's own exit (run as a file, the repository on PYTHONPATH).

    torchrun --standalone --nproc-per-node 2 tests/workers/exit_workers.py diloco
    mpirun -np 2 python tests/workers/exit_workers.py mpi

Each path makes the ranks disagree (or one rank stop), catches the error it expects on every rank,
tears down as a user would (``dist.destroy_process_group()``; mpi4py finalizes at exit) and raises
the error again: a rank that ends well exits with status 1 and the error's traceback. Status 0: no
error was raised; 3: another error than the one expected (printed). Anything else, a signal above
all, is what the exit-code tests count as a crash at exit.
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
    "checked": ("DiLoCo settings differ: sync_every",),
    "ddp": ("bits",),
    "fsdp": ("bits",),
    "hierarchical": ("differ in node layouts",),
    "mpi": ("bits",),
    "timeout": ("did not complete within", STOPPED),
    "hvd-bits": ("differ in bits 3 on some ranks, 4 on others",),
    "hvd-bucket": ("bucket_size 256 on some ranks, 512 on others",),
    "hvd-method": ("differ in method",),
    "hvd-norm": ("differ in norm",),
    "hvd-levels": ("levels differ",),
    "hvd-budget": ("bit_budget (thousandths of a bit: 2500 on some ranks, 3000 on others)",),
    "hvd-allocation": ("bit allocations of bits='auto'",),
    "hvd-bits_max": ("levels differ",),
    "hvd-set": ("process set",),
    "hvd-outsider": ("process set",),
    "hvd-timeout": ("did not complete within", STOPPED),
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


def checked(rank: int) -> int:
    """Issue 65's program: the DiLoCo mismatch of :func:`diloco`, then the checker's own
    ``all_reduce`` and ``all_gather_object`` on a second gloo group (made before training, as a
    harness does), then ``dist.destroy_process_group()`` and ``sys.exit``: 1 when every rank raised
    the expected error, 3 otherwise."""
    import torch
    import torch.distributed as dist

    checker = dist.new_group(backend="gloo")
    error = None
    try:
        diloco(rank)
    except Exception as err:  # noqa: BLE001 - the checker compares every rank's error
        error = f"{type(err).__name__}: {err}"
    expected = error is not None and any(text in error for text in EXPECTED["diloco"])
    raised = torch.tensor([int(expected)])
    dist.all_reduce(raised, group=checker)
    errors: list = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error, group=checker)
    every = int(raised) == dist.get_world_size() and all(errors)
    print(f"rank {rank}: {'the expected error' if expected else 'unexpected'}: {str(error)[:300]}", flush=True)
    dist.destroy_process_group()
    sys.exit(1 if every else 3)


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


# ------------------------------------------------------------------ Horovod PyTorch (under mpirun)
#: The Horovod compressor's designed errors, each a path ``hvd-<what>``: what rank 1 does otherwise.
HOROVOD_MISMATCHES = ("bits", "bucket", "method", "norm", "levels", "budget", "allocation", "bits_max")


def _hvd_mismatch(what: str, rank: int) -> None:
    """Rank 1's compressor differs from rank 0's in ``what`` (the test suite's cases,
    tests/torch/test_compressor_ranks.py); a DistributedOptimizer step over a small model (``bits``:
    the optimizer a user writes), else ``hvd.allreduce`` of one tensor: the handshake raises."""
    import horovod.torch as hvd
    import torch
    import torch.nn.functional as F

    from horovod_alq.torch import ALQCompressor, AMQCompressor

    kw = dict(bits=3, bucket_size=256, min_size=16, seed=0)
    other = rank == 1
    if what == "norm":
        kw["norm"] = "linf" if other else "l2"
    if other and what == "bits":
        kw["bits"] = 4
    if other and what == "bucket":
        kw["bucket_size"] = 512
    if what in ("budget", "allocation", "bits_max"):
        kw.update(bits="auto", bit_budget=2.5 if other and what == "budget" else 3.0)
        if other and what == "bits_max":
            kw["bits_max"] = 4
    comp = AMQCompressor(**kw) if other and what == "method" else ALQCompressor(**kw)
    if other and what == "levels":
        comp._quantizer.set_levels(np.array([-1, -0.3, -0.1, -0.01, 0.01, 0.1, 0.3, 1.0]))
    if other and what == "allocation":
        comp._state.auto.keys, comp._state.auto.bits = ((4096, 1),), (5,)
    if what == "bits":
        model = _net()
        opt = hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.01), named_parameters=model.named_parameters(), compression=comp
        )
        x, y = _batch(rank)
        F.cross_entropy(model(x), y).backward()
        opt.step()
        return
    g = torch.from_numpy(np.random.default_rng(rank).standard_normal(4096).astype(np.float32))
    hvd.allreduce(g, compression=comp, name="mismatch")


def _hvd_set(rank: int) -> None:
    """A compressor pinned to the global process set, in an allreduce over this rank's own set:
    each rank raises, naming the set."""
    import horovod.torch as hvd
    import torch

    from horovod_alq.torch import ALQCompressor

    comp = ALQCompressor(bits=3, bucket_size=256, min_size=16, process_set=hvd.global_process_set)
    alone = _HVD_SETS[rank]
    hvd.barrier()  # Horovod's background loop has registered the sets (right after hvd.init it may not have)
    hvd.allreduce(torch.ones(4096), compression=comp, name=f"alone{rank}", process_set=alone)


def _hvd_outsider(rank: int) -> None:
    """A compressor pinned to the set [0], in a global allreduce: rank 1 is outside its set (takes
    part with a vector that fails the checks, and raises), rank 0 finds the reduction over another
    set than its compressor's."""
    import horovod.torch as hvd
    import torch

    from horovod_alq.torch import ALQCompressor

    comp = ALQCompressor(bits=3, bucket_size=256, min_size=16, process_set=_HVD_SETS[0])
    hvd.allreduce(torch.ones(4096), compression=comp, name="outsider")


def _hvd_timeout(rank: int) -> None:
    """Both ranks compress and allreduce the control vectors; rank 1 then stops calling (and fails
    itself later): rank 0 waits in the round's handshake and raises CollectiveTimeout after ``TIMEOUT``."""
    import horovod.torch as hvd
    import torch

    from horovod_alq.torch import ALQCompressor

    comp = ALQCompressor(bits=3, bucket_size=256, min_size=16, timeout=TIMEOUT)
    g = torch.from_numpy(np.random.default_rng(rank).standard_normal(4096).astype(np.float32))
    vec, ctx = comp.compress(g)
    reduced = hvd.allreduce(vec, op=hvd.Sum, name="stop")
    if rank == 1:
        time.sleep(TIMEOUT + 2)
        raise RuntimeError(STOPPED)
    comp.decompress(reduced, ctx)


_HVD_SETS: list = []  # each rank's process set of its own, made at hvd.init
HOROVOD_PATHS = {
    **{f"hvd-{what}": (lambda rank, what=what: _hvd_mismatch(what, rank)) for what in HOROVOD_MISMATCHES},
    "hvd-set": _hvd_set,
    "hvd-outsider": _hvd_outsider,
    "hvd-timeout": _hvd_timeout,
}


def _hvd_init() -> int:
    import horovod.torch as hvd

    _HVD_SETS[:] = [hvd.ProcessSet([r]) for r in range(int(os.environ.get("OMPI_COMM_WORLD_SIZE", "2")))]
    hvd.init(process_sets=list(_HVD_SETS))
    return hvd.rank()


TORCH_PATHS = {"diloco": diloco, "ddp": ddp, "fsdp": fsdp, "hierarchical": hierarchical, "timeout": timeout}
#: Paths that tear down and exit themselves (the process's own ``sys.exit``).
OWN_EXIT = {"checked": checked}
MPI_PATHS = {"mpi": mpi, **HOROVOD_PATHS}


def run(path: str) -> int:
    """Run ``path`` on this rank; returns the exit status when no error was raised (0) or another
    error than the expected one (3). The expected error propagates (status 1)."""
    torch_path = path in TORCH_PATHS or path in OWN_EXIT
    if torch_path:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group("gloo")
        rank = dist.get_rank()
    elif path in HOROVOD_PATHS:
        rank = _hvd_init()
    else:
        from mpi4py import MPI

        rank = MPI.COMM_WORLD.Get_rank()
    if path in OWN_EXIT:
        return OWN_EXIT[path](rank)
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
    if len(argv) != 1 or argv[0] not in {**TORCH_PATHS, **OWN_EXIT, **MPI_PATHS}:
        print(__doc__)
        print(f"paths: {', '.join({**TORCH_PATHS, **OWN_EXIT, **MPI_PATHS})}")
        return 2
    return run(argv[0])


if __name__ == "__main__":
    sys.exit(main())
