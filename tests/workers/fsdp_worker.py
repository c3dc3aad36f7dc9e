"""Worker for tests/torch/test_fsdp_ranks.py: FSDP2 (fully_shard) with the ALQ reduce-scatter over
gloo, every scenario in one torchrun launch (start-up dominates), reported as one dict per rank."""

import argparse
import copy
import os
import pickle
import sys

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from common import report, stalled_backward
from ddp_worker import Net, batches
from helpers import digest, t_stat
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from horovod_alq.core.wire import payload_size
from horovod_alq.torch.fsdp import ALQReduceScatter, quantize_reduce_scatter

OPS = {"avg": dist.ReduceOp.AVG, "sum": dist.ReduceOp.SUM, "premul": dist.ReduceOp.PREMUL_SUM(0.25)}


def sharded(seed: int = 0, mp: MixedPrecisionPolicy | None = None) -> Net:
    torch.manual_seed(seed)
    model = Net()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    kwargs = {} if mp is None else {"mp_policy": mp}
    for layer in (model.fc1, model.fc2, model.fc3):
        fully_shard(layer, mesh=mesh, **kwargs)
    fully_shard(model, mesh=mesh, **kwargs)
    return model


def full_digest(model) -> str:
    """:func:`helpers.digest` of the model's full parameters (all-gathers the shards)."""
    return digest(*(p.full_tensor() for p in model.parameters()))


def comm_for(method: str, **kwargs) -> ALQReduceScatter:
    kwargs.setdefault("bucket_size", 256)
    kwargs.setdefault("update_steps", (0, 10))
    kwargs.setdefault("update_every", 0)
    kwargs.setdefault("min_size", 64)
    kwargs.setdefault("seed", 5)
    return ALQReduceScatter(method=method, **kwargs)


def fit(model, opt, data) -> list[float]:
    losses = []
    for x, y in data:
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def training(rank: int, method: str, steps: int, **comm_kwargs) -> dict:
    """``steps`` SGD steps of the MLP with FSDP2 (its own reduce-scatter for method "fsdp")."""
    model = sharded()
    comm = None if method == "fsdp" else quantize_reduce_scatter(model, comm_for(method, **comm_kwargs))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = fit(model, opt, batches(rank, steps))
    out = {
        "loss_first": float(np.mean(losses[:3])),
        "loss_last": float(np.mean(losses[-3:])),
        "params": full_digest(model),
    }
    if comm is not None:
        m = comm.metrics()
        out.update(
            levels=m["levels"].tolist(),
            level_updates=m["level_updates"],
            step=m["step"],
            calls=m["calls"],
            exchange=m["exchange"],
            bits_per_coordinate=m["bits_per_coordinate"],
            uncompressed=m["uncompressed_coordinates"],
        )
        if comm.bits == "auto":
            out.update(
                allocation=m["allocation"],
                allocated_mean_bits=m["allocated_mean_bits"],
                layouts=sorted([list(k), [n for n, _ in v]] for k, v in comm._layouts.items()),
            )
    return out


def inputs(size: int, per: int) -> list[np.ndarray]:
    """Every rank's reduce-scatter input (``size`` shards of ``per``), known to every rank."""
    cs = []
    for r in range(size):
        g = np.random.default_rng([11, r])
        c = g.standard_normal(size * per) * (1 + r) + 0.1 * r
        c[: per // 3] = g.standard_t(3, per // 3) * 0.01
        cs.append(c.astype(np.float32))
    return cs


def unbiased(rank: int, size: int, op: str, per: int = 1000, bucket: int = 128, reps: int = 60) -> dict:
    """``reps`` direct calls, as FSDP makes them: t-statistics of this rank's output shard against
    the exact reduction (levels fixed after the refit of the first call, which is skipped)."""
    cs = inputs(size, per)
    factor = {"avg": 1.0 / size, "sum": 1.0, "premul": 0.25}[op]
    truth = factor * np.sum([c.astype(np.float64) for c in cs], axis=0)[rank * per : (rank + 1) * per]
    comm = ALQReduceScatter(bucket_size=bucket, seed=3, update_steps=(0,), update_every=0)
    mine = torch.from_numpy(cs[rank])
    outs = []
    for i in range(reps + 1):
        out = comm.allocate((per,), dtype=torch.float32, device=torch.device("cpu"))
        work = comm(out, mine, dist.group.WORLD, OPS[op], async_op=bool(i % 2))
        if work is not None:
            work.wait()
        if i:
            outs.append(out.double().numpy().copy())
    dev = np.stack(outs) - truth
    nb = -(-per // bucket)
    per_bucket = np.add.reduceat(dev, np.arange(0, nb * bucket, bucket), axis=1)
    m = comm.metrics()
    return {
        "t_plain": float(t_stat(dev.sum(1, keepdims=True))[0]),
        "t_signed": float(t_stat((dev @ np.sign(truth))[:, None])[0]),
        "t_buckets_max": float(np.abs(t_stat(per_bucket)).max()),
        "buckets": nb,
        "reps": reps,
        "rel_error": float(np.abs(dev).mean() / np.abs(truth).mean()),
        "step": m["step"],
        "level_updates": m["level_updates"],
        "exchange": m["exchange"],
    }


def unbiased_auto(rank: int, size: int, reps: int = 60, bucket: int = 64) -> dict:
    """bits="auto", called directly as FSDP calls it, on a module's input whose layout
    quantize_reduce_scatter recorded: parameter chunks whose scales differ 10^4-fold, so the
    allocation mixes widths inside every shard. t-statistics of this rank's shard against the
    exact sum (levels and widths fixed after the refit of the first call, which is skipped)."""
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(48, 40), torch.nn.Linear(40, 24))
    fully_shard(module, mesh=init_device_mesh("cpu", (size,)))
    comm = quantize_reduce_scatter(
        module, comm_for("alq", bits="auto", bit_budget=3.0, bucket_size=bucket, update_steps=(0,), seed=3)
    )
    (((total, _), pieces),) = comm._layouts.items()
    per, scales = total // size, [100.0, 1.0, 0.01, 3.0]
    sizes = [k for k, _ in pieces]
    scale = np.concatenate([np.full(k, s) for k, s in zip(sizes, scales)])  # of one shard
    cs = [
        (np.random.default_rng([12, r]).standard_normal(total) * np.tile(scale, size)).astype(np.float32)
        for r in range(size)
    ]
    truth = np.sum([c.astype(np.float64) for c in cs], axis=0)[rank * per : (rank + 1) * per]
    outs = []
    for i in range(reps + 1):
        out = torch.empty(per)
        before = comm.metrics()["payload_bytes"]
        comm(out, torch.from_numpy(cs[rank]), dist.group.WORLD, OPS["sum"])
        call_bytes = comm.metrics()["payload_bytes"] - before  # this rank's payloads of its N shards
        if i:
            outs.append(out.double().numpy().copy())
    dev = (np.stack(outs) - truth) / scale
    starts = np.cumsum([0, *sizes[:-1]])  # groups: the buckets of each chunk (any partition is a valid test)
    edges = np.concatenate([a + np.arange(0, k, bucket) for a, k in zip(starts, sizes)])
    per_bucket = np.add.reduceat(dev, edges, axis=1)
    m = comm.metrics()
    return {
        "t_buckets_max": float(np.abs(t_stat(per_bucket)).max()),
        "buckets": int(edges.size),
        "reps": reps,
        "allocation": m["allocation"],
        "pieces": sizes,
        "step": m["step"],
        "call_bytes": call_bytes,
    }


def wire(rank: int, size: int, per: int = 8 * 8192, bits: int = 3, bucket: int = 8192) -> dict:
    """One call's bytes on the wire against (N - 1)/N (b + 32/d) per input coordinate."""
    comm = ALQReduceScatter(bits=bits, bucket_size=bucket, seed=1, update_steps=(), update_every=0)
    x = torch.from_numpy(inputs(size, per)[rank])
    comm(torch.empty(per), x, dist.group.WORLD, dist.ReduceOp.AVG)
    m = comm.metrics()
    return {
        "bytes_sent": m["bytes_sent"],
        "bytes_received": m["bytes_received"],
        "coordinates": m["coordinates"],
        "payload": payload_size(per, bits, bucket),
        "bits": bits,
        "bucket": bucket,
    }


def special(rank: int, size: int, per: int = 512) -> dict:
    """NaN in one bucket; a bfloat16 input; inputs below min_size; bad input."""
    cs = inputs(size, per)
    comm = ALQReduceScatter(bucket_size=128, seed=2, update_steps=(), update_every=0, min_size=64)
    x = torch.from_numpy(cs[rank].copy())
    if rank == 0:
        x[per + 5] = float("nan")  # shard 1 (rank 1's), its first bucket
    out = torch.empty(per)
    comm(out, x, dist.group.WORLD, dist.ReduceOp.AVG)
    nan_buckets = [bool(torch.isnan(out[k : k + 128]).any()) for k in range(0, per, 128)]
    # bfloat16 (MixedPrecisionPolicy(reduce_dtype=torch.bfloat16) passes such inputs)
    truth = np.mean([c.astype(np.float64) for c in cs], axis=0)[rank * per : (rank + 1) * per]
    xb = torch.from_numpy(cs[rank]).bfloat16()
    outb = comm.allocate((per,), dtype=torch.bfloat16, device=torch.device("cpu"))
    comm(outb, xb, dist.group.WORLD, dist.ReduceOp.AVG)
    bf16_rel = float(np.abs(outb.double().numpy() - truth).mean() / np.abs(truth).mean())
    # small inputs: torch.distributed's own reduce-scatter, exact
    small = torch.arange(size * 8, dtype=torch.float32) * (rank + 1)
    outs = torch.empty(8)
    comm(outs, small, dist.group.WORLD, dist.ReduceOp.PREMUL_SUM(0.5))
    exact = 0.5 * sum(r + 1 for r in range(size)) * torch.arange(rank * 8, rank * 8 + 8, dtype=torch.float32)
    errors = {}
    for name, call in {
        "op": lambda: comm(torch.empty(per), x, dist.group.WORLD, dist.ReduceOp.MAX),
        "sizes": lambda: comm(torch.empty(per + 1), x, dist.group.WORLD, dist.ReduceOp.AVG),
        "dtype": lambda: comm(torch.empty(per, dtype=torch.int32), x.int(), dist.group.WORLD, dist.ReduceOp.SUM),
    }.items():
        try:
            call()
            errors[name] = None
        except (ValueError, TypeError) as err:
            errors[name] = f"{type(err).__name__}: {err}"
    m = comm.metrics()
    return {
        "nan_buckets": nan_buckets,
        "bf16_dtype": str(outb.dtype),
        "bf16_rel": bf16_rel,
        "small_exact": bool(torch.equal(outs, exact)),
        "uncompressed": m["uncompressed_coordinates"],
        "step": m["step"],
        "errors": errors,
    }


def mixed_precision(rank: int, steps: int = 6) -> dict:
    """FSDP2 with reduce_dtype=bfloat16 and a divide factor (PREMUL_SUM): it trains, finite grads."""
    model = sharded(mp=MixedPrecisionPolicy(reduce_dtype=torch.bfloat16))
    model.set_reduce_scatter_divide_factor(2.0 * dist.get_world_size())
    comm = quantize_reduce_scatter(model, comm_for("alq"))
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    losses = fit(model, opt, batches(rank, steps))
    finite = all(bool(torch.isfinite(p.grad.full_tensor()).all()) for p in model.parameters())
    return {"losses": losses, "finite": finite, "step": comm.metrics()["step"], "levels": comm.levels.tolist()}


def hsdp(rank: int, steps: int = 6) -> dict:
    """HSDP on 2 x 2 ranks (replicate x shard): the shard groups' reduce-scatters are quantized, each
    group with its own round and levels; FSDP's own all-reduce averages the shards across replicas."""
    torch.manual_seed(0)
    model = Net()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    for layer in (model.fc1, model.fc2, model.fc3):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    comm = quantize_reduce_scatter(model, comm_for("alq", update_steps=(0, 3)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = fit(model, opt, batches(rank, steps))
    m = comm.metrics()
    return {
        "params": full_digest(model),
        "levels": m["levels"].tolist(),
        "step": m["step"],
        "level_updates": m["level_updates"],
        "losses": losses,
        "shard_group": mesh["shard"].mesh.tolist(),
    }


def checkpoint(rank: int) -> dict:
    """Save at step 8; run 6 steps (a refit at step 10 among them); load the saved model, optimizer
    and comm state in place and run the same 6 steps again: the same parameters and levels."""
    data = batches(rank, 14)
    model = sharded()
    comm = quantize_reduce_scatter(model, comm_for("alq", update_steps=(0, 4, 10)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    fit(model, opt, data[:8])
    saved = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict(), "alq": comm.state_dict()})
    levels_saved = comm.levels.tolist()
    fit(model, opt, data[8:])
    first = {"params": full_digest(model), "levels": comm.levels.tolist(), "step": comm.metrics()["step"]}
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    comm.load_state_dict(saved["alq"])
    restored = comm.levels.tolist()
    fit(model, opt, data[8:])
    second = {"params": full_digest(model), "levels": comm.levels.tolist(), "step": comm.metrics()["step"]}
    clone = pickle.loads(pickle.dumps(comm))
    try:
        ALQReduceScatter(method="amq").load_state_dict(saved["alq"])
        wrong = None
    except ValueError as err:
        wrong = str(err)
    return {
        "first": first,
        "second": second,
        "levels_saved": levels_saved,
        "restored": restored,
        "clone_levels": clone.levels.tolist(),
        "clone_step": clone.metrics()["step"],
        "wrong_method": wrong,
    }


def mismatch(rank: int) -> dict:
    """A rank with other settings (bits, then min_size), then with bits="auto" a rank with another
    bit_budget and a rank whose comm recorded no layout (set with set_custom_reduce_scatter alone):
    every rank raises at the handshake."""
    out = {}
    for name, kwargs in {
        "bits": {"bits": 3 + (rank == 1)},
        "min_size": {"min_size": 64 + (rank == 1)},
        "budget": {"bits": "auto", "bit_budget": 3.0 - 0.5 * (rank == 1)},
        "layout": {"bits": "auto", "bit_budget": 3.0},
    }.items():
        model = sharded()
        comm = quantize_reduce_scatter(model, comm_for("alq", **kwargs))
        if name == "layout" and rank == 1:
            comm._layouts.clear()
        x, y = batches(rank, 1)[0]
        try:
            F.cross_entropy(model(x), y).backward()
            out[name] = None
        except Exception as err:  # noqa: BLE001 - reported to the test
            out[name] = f"{type(err).__name__}: {err}"
    return out


def stalled(rank: int, size: int, timeout: float = 3.0) -> dict:
    """The last rank raises in the middle of backward (a pre-backward hook on fc2, after fc3's
    reduce-scatter went out) and stays alive: every other rank's reduce-scatter of fc2, our
    collective, must raise after ``timeout`` (the watchdog), not wait for gloo's 30 minutes.
    Parameters stay unsharded after forward, so backward issues no all-gather of FSDP's own (which
    would wait unbounded). Run last: the abandoned collective stays in the mesh's group."""
    torch.manual_seed(0)
    model = Net()
    mesh = init_device_mesh("cpu", (size,))
    for layer in (model.fc1, model.fc2, model.fc3):
        fully_shard(layer, mesh=mesh, reshard_after_forward=False)
    fully_shard(model, mesh=mesh, reshard_after_forward=False)
    quantize_reduce_scatter(model, comm_for("alq", timeout=timeout))
    (x, y), (x2, y2) = batches(rank, 2)
    F.cross_entropy(model(x), y).backward()  # a whole step first
    if rank == size - 1:

        def stop(module, grad_output):
            raise RuntimeError("injected: this rank stops in the middle of backward")

        model.fc2.register_full_backward_pre_hook(stop)
    return stalled_backward(rank, size, timeout, lambda: F.cross_entropy(model(x2), y2).backward())


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--methods", default="alq,amq,qsgdinf,terngrad")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--reps", type=int, default=60)
    p.add_argument("--only", default="")
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    res = {"rank": rank, "size": size, "wire": wire(rank, size)}
    if args.only == "wire+hsdp":
        res["hsdp"] = hsdp(rank)
    if args.only == "stalled":
        res["stalled"] = stalled(rank, size)
    if not args.only:
        res["train"] = {m: training(rank, m, args.steps) for m in ["fsdp", *args.methods.split(",")]}
        res["train"]["alq/auto"] = training(rank, "alq", args.steps, bits="auto", bit_budget=2.5)
        res["unbiased_auto"] = unbiased_auto(rank, size, reps=args.reps)
        res["unbiased"] = {op: unbiased(rank, size, op, reps=args.reps) for op in OPS}
        res["special"] = special(rank, size)
        res["mixed"] = mixed_precision(rank)
        res["checkpoint"] = checkpoint(rank)
        res["mismatch"] = mismatch(rank)
        res["stalled"] = stalled(rank, size)  # last: it leaves a collective behind
    report(res)
    # as in ddp_worker.py: PyTorch's gloo teardown sometimes aborts at interpreter exit ("terminate
    # called without an active exception"); leave without it once the results are written
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
