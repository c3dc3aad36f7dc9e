"""Worker for tests/torch/test_no_hang.py (3 ranks, Horovod torch): ranks that create compressors
unevenly still pair; a compressor made without process_set= serves every process set it is used
with, one pinned to a set raises naming it when used over another; and a rank that stops calling in
the middle of a round makes the others raise after the timeout (not hang)."""

import time

import horovod.torch as hvd
import numpy as np
import torch
from common import report

from horovod_alq.core.protocol import CollectiveTimeout, ProtocolError
from horovod_alq.torch import ALQCompressor, AMQCompressor

PS01 = hvd.ProcessSet([0, 1])
ALONE = [hvd.ProcessSet([r]) for r in range(3)]  # each rank in a set of its own
hvd.init(process_sets=[PS01, *ALONE])
RANK, SIZE = hvd.rank(), hvd.size()


def data(n: int = 4096, rank: int = RANK) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng([5, rank]).standard_normal(n).astype(np.float32))


def exact(ranks, n: int = 4096) -> np.ndarray:
    return np.mean([data(n, r).double().numpy() for r in ranks], axis=0)


def rel(out: torch.Tensor, ranks) -> float:
    truth = exact(ranks)
    return float(np.abs(out.double().numpy() - truth).mean() / np.abs(truth).mean())


def uneven() -> dict:
    """The issue's case: ranks 0 and 1 make (and use) a compressor for their process set; rank 0
    makes one more that it never uses; then every rank makes a compressor for the global set."""
    out = {}
    if RANK in (0, 1):
        c01 = ALQCompressor(bits=8, bucket_size=512, min_size=16, seed=1, process_set=PS01)
        r = hvd.allreduce(data(), compression=c01, name="d01", process_set=PS01)
        out["ps01_rel"] = rel(r, (0, 1))
    if RANK == 0:
        ALQCompressor(bits=4, seed=2)  # made, never used
    c = ALQCompressor(bits=8, bucket_size=512, min_size=16, seed=3)
    start = time.monotonic()
    r = hvd.allreduce(data(), compression=c, name="dt")
    out.update(global_rel=rel(r, range(SIZE)), seconds=time.monotonic() - start, digest=float(r.double().sum()))
    return out


def any_set() -> dict:
    """One compressor (no process_set=) in allreduces over [0, 1], the global set, each rank's own
    set, and a DistributedOptimizer over [0, 1] (Horovod's test_optimizer_process_sets pattern)."""
    c = AMQCompressor(bits=8, bucket_size=512, min_size=16, seed=4, update_steps=(0, 2))  # AMQ: fast refits
    out = {}
    if RANK in (0, 1):
        r = hvd.allreduce(data(), compression=c, name="a01", process_set=PS01)
        out.update(ps01_rel=rel(r, (0, 1)), ps01_digest=float(r.double().sum()))
    r = hvd.allreduce(data(), compression=c, name="aall")
    out.update(global_rel=rel(r, range(SIZE)), global_digest=float(r.double().sum()))
    r = hvd.allreduce(data(), compression=c, name=f"alone{RANK}", process_set=ALONE[RANK])
    out["alone_rel"] = rel(r, (RANK,))
    if RANK in (0, 1):
        torch.manual_seed(0)
        model = torch.nn.Linear(64, 64)
        opt = hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1),
            compression=c,
            named_parameters=model.named_parameters(),
            process_set=PS01,
        )
        for step in range(4):
            opt.zero_grad()
            model(
                torch.from_numpy(np.random.default_rng([9, RANK, step]).standard_normal((8, 64)).astype(np.float32))
            ).square().mean().backward()
            opt.step()
        out["model_digest"] = float(sum(p.detach().double().sum() for p in model.parameters()))
    metrics = c.metrics()
    out["sets"] = sorted(",".join(map(str, r)) for r in metrics.get("process_sets", {}))
    out["set_levels"] = {
        ",".join(map(str, r)): m["levels"].tolist() for r, m in metrics.get("process_sets", {}).items()
    }
    out["ps01_updates"] = metrics.get("process_sets", {}).get((0, 1), {}).get("level_updates")
    state = c.state_dict()
    fresh = AMQCompressor(bits=8, bucket_size=512, min_size=16, seed=4)
    fresh.load_state_dict(state)
    out["state_round_trip"] = sorted(fresh.state_dict().get("process_sets", {})) == sorted(
        state.get("process_sets", {})
    )
    return out


def wrong_set() -> dict:
    """A compressor pinned to the global set in an allreduce over [0, 1]: both members raise, naming it."""
    if RANK == 2:
        return {}
    c = ALQCompressor(bits=3, bucket_size=512, min_size=16, seed=1, process_set=hvd.global_process_set)
    try:
        hvd.allreduce(data(), compression=c, name="w01", process_set=PS01)
        return {"error": None}
    except ProtocolError as err:
        return {"error": str(err)}


def stop_mid_round() -> dict:
    """Every rank compresses two tensors and allreduces their control vectors; rank 2 then stops
    calling: ranks 0 and 1 wait in the round's handshake until the timeout, then raise."""
    c = ALQCompressor(bits=3, bucket_size=512, min_size=16, seed=1)
    pairs = [c.compress(data()) for _ in range(2)]  # as DistributedOptimizer's gradient hooks do
    handles = [hvd.allreduce_async(vec, op=hvd.Sum, name=f"s{k}") for k, (vec, _) in enumerate(pairs)]
    reduced = [hvd.synchronize(h) for h in handles]
    if RANK == 2:  # leaves the round without decompressing (as a rank that raised would)
        return {"stopped": True}
    start = time.monotonic()
    try:
        c.decompress(reduced[0], pairs[0][1])
        return {"error": None}
    except CollectiveTimeout as err:
        return {"error": str(err), "seconds": time.monotonic() - start}


# one launch for all (start-up dominates); the stop scenario leaves a collective pending: last
report({"rank": RANK, "uneven": uneven(), "any_set": any_set(), "wrong_set": wrong_set(), "stop": stop_mid_round()})
# every rank here, then shut down (the handshake that rank 2 never joined is cancelled there)
hvd.allreduce(torch.zeros(1), name="end")
hvd.shutdown()
