"""Worker for tests/test_hierarchical_ranks.py: the hierarchical exchange on 4 ranks declared as 2
nodes x 2 (HOROVOD_ALQ_LOCAL_SIZE=2), through one front-end (--front): mpi4py's QuantizedAllreduce,
the Horovod PyTorch compressor (under mpirun), the Horovod TensorFlow compressor (mpirun, inside
tf.function), the DDP hook or FSDP2's reduce-scatter comm (its node-aware reduce-scatter; under
torchrun), with --exchange (default "auto"). Reports the exchange in use, a digest of every rank's
results, the t statistics of the results' deviations from the exact average over --reps rounds,
and what a rank that declares another node layout gets; TensorFlow also its bytes per round and
the largest value of the average of inputs whose node sums are 0."""

import argparse
import os

import numpy as np
from common import report
from helpers import digest, t_stat

N, D = 3000, 256


def rank_input(rank: int) -> np.ndarray:
    rng = np.random.default_rng(100 + rank)
    return (rng.standard_normal(N) * (1 + rank) + 0.1 * rank).astype(np.float32)


def summarize(outs: list[np.ndarray], exact: np.ndarray) -> dict:
    """Deviations of each round's result from the exact average: t statistics of the bucket sums."""
    dev = np.stack(outs).astype(np.float64) - exact
    buckets = np.add.reduceat(dev, np.arange(0, N, D), axis=1)
    t = t_stat(buckets)
    return {
        "reps": len(outs),
        "buckets": buckets.shape[1],
        "t_buckets_max": float(np.abs(t).max()),
        "t_plain": float(t_stat(dev.sum(1, keepdims=True))[0]),
        "digest": digest(*outs),
    }


def run_mpi(args) -> dict:
    from mpi4py import MPI

    from horovod_alq.mpi import QuantizedAllreduce

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    x = rank_input(rank)
    exact = comm.allreduce(x.astype(np.float64)) / size
    ar = QuantizedAllreduce(comm, "alq", bits=args.bits, bucket_size=D, seed=5, exchange=args.exchange)
    outs = [ar(x) for _ in range(args.reps)]
    out = summarize(outs, exact)
    out["exchange"] = ar.metrics()["exchange"]
    out["sent"] = ar.metrics()["bytes_sent"]
    out["broken_copy"] = broken_copy(ar, x, rank)
    if rank == size - 1:
        os.environ["HOROVOD_ALQ_LOCAL_SIZE"] = str(size)  # this rank declares one node of every rank
    other = QuantizedAllreduce(comm, "alq", bits=args.bits, bucket_size=D, seed=5, exchange=args.exchange)
    try:
        other(x)
        out["mismatch"] = None
    except Exception as err:  # noqa: BLE001 - reported
        out["mismatch"] = f"{type(err).__name__}: {err}"
    return out


def broken_copy(ar, x, rank: int) -> str | None:
    """One more round in which rank 0's codes between nodes reach rank 2 (the other node) garbled
    and its other copies intact: the error this rank raised, or None."""
    t = ar._transport
    honest = t.alltoall

    def garbled(payload, splits, received, name):
        if rank == 0 and ".h2-" in name:
            payload = np.array(payload, copy=True)
            start = int(sum(splits[:2]))
            payload[start : start + int(splits[2])] = 0x7F
        return honest(payload, splits, received, name)

    t.alltoall = garbled
    try:
        ar(x)
        return None
    except Exception as err:  # noqa: BLE001 - reported
        return f"{type(err).__name__}: {err}"
    finally:
        t.alltoall = honest


def horovod_mismatch(hvd, compressor, x, args) -> str | None:
    """The error of one Horovod allreduce (torch or TF) after the last rank declared one node of
    every rank, or None if it went through."""
    if hvd.rank() == hvd.size() - 1:
        os.environ["HOROVOD_ALQ_LOCAL_SIZE"] = str(hvd.size())
    other = compressor(bits=args.bits, bucket_size=D, seed=5, exchange=args.exchange)
    try:
        hvd.allreduce(x, compression=other, op=hvd.Average, name="mismatch")
        return None
    except Exception as err:  # noqa: BLE001 - reported
        return f"{type(err).__name__}: {err}"


def run_horovod(args) -> dict:
    import horovod.torch as hvd
    import torch

    from horovod_alq.torch import ALQCompressor

    hvd.init()
    rank = hvd.rank()
    x = torch.from_numpy(rank_input(rank))
    exact = hvd.allreduce(x.double(), op=hvd.Average, name="exact").numpy()
    comp = ALQCompressor(
        bits=args.bits, bucket_size=D, seed=5, update_steps=(0,), update_every=0, exchange=args.exchange
    )
    outs = [hvd.allreduce(x, compression=comp, op=hvd.Average, name="h0").numpy()]  # round 0 refits
    before = comp.metrics()["collectives"]
    outs += [hvd.allreduce(x, compression=comp, op=hvd.Average, name=f"h{k}").numpy() for k in range(1, args.reps)]
    out = summarize(outs, exact)
    out["exchange"] = comp.metrics()["exchange"]
    out["collectives_per_round"] = (comp.metrics()["collectives"] - before) / (args.reps - 1)
    out["levels"] = digest(comp.levels)
    out["mismatch"] = horovod_mismatch(hvd, ALQCompressor, x, args)
    return out


def run_tf(args) -> dict:
    import horovod.tensorflow as hvd
    import tensorflow as tf

    from horovod_alq.tensorflow import ALQCompressor

    hvd.init()
    rank = hvd.rank()
    x = tf.constant(rank_input(rank))
    exact = hvd.allreduce(tf.cast(x, tf.float64), op=hvd.Average, name="exact").numpy()
    comp = ALQCompressor(
        bits=args.bits, bucket_size=D, seed=5, update_steps=(0,), update_every=0, exchange=args.exchange
    )
    step = tf.function(lambda t: hvd.allreduce(t, compression=comp, op=hvd.Average, name="h"))
    outs = [step(x).numpy() for _ in range(args.reps)]
    out = summarize(outs, exact)
    m = comp.metrics()
    out.update(exchange=m["exchange"], levels=digest(comp.levels), level_updates=m["level_updates"])
    out["sent"], out["received"] = m["bytes_sent"] / args.reps, m["bytes_received"] / args.reps
    # local ranks 0 and 1 of a node send opposite inputs: every node's sum is exactly 0 (eagerly)
    node_zero = tf.constant(rank_input(rank // 2 * 2) * (1 - 2 * (rank % 2)))
    cancel = ALQCompressor(bits=args.bits, bucket_size=D, seed=6, exchange=args.exchange)
    out["cancelled_max"] = float(np.abs(hvd.allreduce(node_zero, compression=cancel, name="zero").numpy()).max())
    out["mismatch"] = horovod_mismatch(hvd, ALQCompressor, x, args)
    return out


def run_ddp(args) -> dict:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from horovod_alq.torch.ddp import ALQState, alq_hook

    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    x = torch.from_numpy(rank_input(rank))

    def grads(state) -> list[np.ndarray]:
        """The hook's average of the ranks' gradients of sum(w * x) (= x) over ``args.reps`` steps."""
        torch.manual_seed(0)
        model = DDP(torch.nn.Linear(N, 1, bias=False), bucket_cap_mb=1)
        model.register_comm_hook(state, alq_hook)
        out = []
        for _ in range(args.reps):
            model.zero_grad()
            (model(x[None]).sum()).backward()
            out.append(model.module.weight.grad[0].detach().numpy().copy())
        return out

    exact = x.double().clone()
    dist.all_reduce(exact)
    state = ALQState(
        bits=args.bits, bucket_size=D, seed=5, update_steps=(0,), update_every=0, min_size=0, exchange=args.exchange
    )
    out = summarize(grads(state), (exact / size).numpy())
    out["exchange"] = state.metrics()["exchange"]
    if rank == size - 1:
        os.environ["HOROVOD_ALQ_LOCAL_SIZE"] = str(size)
    try:
        grads(ALQState(bits=args.bits, bucket_size=D, seed=5, min_size=0, timeout=60, exchange=args.exchange))
        out["mismatch"] = None
    except Exception as err:  # noqa: BLE001
        out["mismatch"] = f"{type(err).__name__}: {err}"
    dist.destroy_process_group()
    return out


def run_fsdp(args) -> dict:
    """FSDP2's reduce-scatter comm called as FSDP calls it: rank r's input is N shards, it keeps the
    average of shard r; the node-aware reduce-scatter against the exact one."""
    import torch
    import torch.distributed as dist

    from horovod_alq.torch.fsdp import ALQReduceScatter

    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    per = N // size
    x = torch.from_numpy(rank_input(rank)[: per * size])
    exact = x.double().clone()
    dist.all_reduce(exact)
    exact = (exact / size)[rank * per : (rank + 1) * per].numpy()
    comm = ALQReduceScatter(bits=args.bits, bucket_size=D, seed=5, update_steps=(0,), update_every=0, min_size=0)
    outs = []
    for _ in range(args.reps):
        out = torch.empty(per)
        comm(out, x, dist.group.WORLD, dist.ReduceOp.AVG)
        outs.append(out.numpy().copy())
    dev = np.stack(outs).astype(np.float64) - exact
    t = t_stat(np.add.reduceat(dev, np.arange(0, per, D), axis=1))
    gathered = [torch.empty(per) for _ in range(size)]
    dist.all_gather(gathered, torch.from_numpy(outs[-1]))  # every rank's shard: one digest of the whole
    out = {
        "reps": len(outs),
        "buckets": t.size,
        "t_buckets_max": float(np.abs(t).max()),
        "t_plain": float(t_stat(dev.sum(1, keepdims=True))[0]),
        "digest": digest(*gathered),
        "exchange": comm.metrics()["exchange"],
    }
    if rank == size - 1:
        os.environ["HOROVOD_ALQ_LOCAL_SIZE"] = "1"  # this rank declares a node per rank
    try:
        ALQReduceScatter(bits=args.bits, bucket_size=D, seed=5, min_size=0, timeout=60)(
            torch.empty(per), x, dist.group.WORLD, dist.ReduceOp.AVG
        )
        out["mismatch"] = None
    except Exception as err:  # noqa: BLE001
        out["mismatch"] = f"{type(err).__name__}: {err}"
    dist.destroy_process_group()
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--front", choices=("mpi", "horovod", "tf", "ddp", "fsdp"), required=True)
    parser.add_argument("--exchange", default="auto", help="one, or several joined by ',' (mpirun fronts: in turn)")
    parser.add_argument("--bits", type=int, default=4)
    parser.add_argument("--reps", type=int, default=60)
    args = parser.parse_args()
    run = {"mpi": run_mpi, "horovod": run_horovod, "tf": run_tf, "ddp": run_ddp, "fsdp": run_fsdp}[args.front]
    exchanges = args.exchange.split(",")
    if len(exchanges) == 1:
        report(run(args))
        return
    if args.front not in ("mpi", "horovod", "tf"):  # one process group per launch
        parser.error(f"--front {args.front} runs one exchange per launch")
    out, local_size = {}, os.environ["HOROVOD_ALQ_LOCAL_SIZE"]
    for args.exchange in exchanges:  # one launch, the exchanges in turn: {exchange: what it reports}
        out[args.exchange] = run(args)
        os.environ["HOROVOD_ALQ_LOCAL_SIZE"] = local_size  # the mismatch changed the last rank's
    report(out)


if __name__ == "__main__":
    main()
