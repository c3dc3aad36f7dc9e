"""Worker for tests/torch/test_speed_ranks.py: ``compress="when-faster"`` switching mid-training.

``speed_worker.py ddp`` or ``fsdp`` (torchrun, gloo) or ``speed_worker.py torch`` (Horovod, mpirun):
an MLP trained with the DDP hook, FSDP2's ``fully_shard`` with the ALQ reduce-scatter, or
``hvd.DistributedOptimizer``; the arbiter's clock is injected: each
optimizer step advances it by a simulated cost of the path the step took (quantized 2 s, 16-bit
1 s until ``--flip``, then 16-bit 4 s), so it switches to 16 bits at its first trial, keeps them
at the confirming trial and goes back at the drift check after the flip, the same on every rank.
Reports, per step, the path taken and a digest of the parameters, and the metrics; with Horovod,
per 16-bit step, whether every reduced gradient equals ``hvd.Compression.fp16``'s of the same
gradients (checked on 2 ranks, where a sum of two fp16 values is the same in any order). FSDP2 also
runs with ``error_feedback=True`` and reports the quantized calls and a digest of the error buffers
after each step and, called directly as FSDP calls it, whether each
16-bit call's output is the bf16 reduce-scatter of the same inputs (AVG, SUM, PREMUL_SUM; float32
and bfloat16 inputs)."""

import argparse
import os
import sys

import numpy as np
import torch
import torch.nn.functional as F
from common import report
from helpers import digest

from horovod_alq.core.speed import SpeedArbiter


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(32, 128)
        self.fc2 = torch.nn.Linear(128, 4)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def build(frontend: str, model: torch.nn.Module, last_compress: str | None = None) -> tuple:
    """``model`` with the front-end, ``compress="when-faster"`` (the last rank ``last_compress``
    where given): (net, opt, round_state, metrics, rank, size). Starts the front-end once."""
    keywords = dict(compress="when-faster", bucket_size=256, min_size=256, seed=3, update_steps=(0,), update_every=5)
    launched = int(os.environ.get("RANK", os.environ.get("OMPI_COMM_WORLD_RANK", 0)))
    last = int(os.environ.get("WORLD_SIZE", os.environ.get("OMPI_COMM_WORLD_SIZE", 1))) - 1
    if last_compress is not None and launched == last:
        keywords["compress"] = last_compress
    if frontend == "ddp":
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel as DDP

        from horovod_alq.torch.ddp import ALQState, alq_hook

        if not dist.is_initialized():
            dist.init_process_group("gloo")
        net = DDP(model, bucket_cap_mb=0.01)
        state = ALQState(**keywords)
        net.register_comm_hook(state, alq_hook)
        opt = torch.optim.SGD(net.parameters(), lr=0.05)
        return net, opt, state.round_state, state.metrics, dist.get_rank(), dist.get_world_size()
    if frontend == "fsdp":
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        from horovod_alq.torch.fsdp import ALQReduceScatter, quantize_reduce_scatter

        if not dist.is_initialized():
            dist.init_process_group("gloo")
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in (model.fc1, model.fc2):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        comm = quantize_reduce_scatter(model, ALQReduceScatter(**keywords, error_feedback=True))
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        return model, opt, comm.round_state, comm.metrics, dist.get_rank(), dist.get_world_size()
    import horovod.torch as hvd

    from horovod_alq.torch import ALQCompressor

    if not hvd.is_initialized():
        hvd.init()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    compression = ALQCompressor(**keywords)
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05),
        named_parameters=model.named_parameters(),
        compression=compression,
    )
    return model, opt, compression._state, compression.metrics, hvd.rank(), hvd.size()


def same_as_fp16(model: torch.nn.Module, local: list, step: int) -> bool:
    """Whether the reduced gradients (``p.grad`` after a step) are Horovod's fp16 average of ``local``."""
    import horovod.torch as hvd

    ref = [
        hvd.allreduce(g, op=hvd.Average, compression=hvd.Compression.fp16, name=f"fp16.{step}.{i}")
        for i, g in enumerate(local)
    ]
    return all(torch.equal(p.grad, r) for p, r in zip(model.parameters(), ref))


def sixteen_calls(rank: int, size: int, per: int = 300) -> dict:
    """FSDP2: direct calls of a ``compress="when-faster"`` comm (each a round: warm-up 0, so the
    trial's rounds 2-5 are 16-bit); per op and input dtype, whether every 16-bit call's output equals
    the bf16 reduce-scatter of the same inputs (their bfloat16 sum, in rank order, scaled)."""
    import torch.distributed as dist

    from horovod_alq.torch.fsdp import ALQReduceScatter

    ops = {"avg": (dist.ReduceOp.AVG, 1.0 / size), "sum": (dist.ReduceOp.SUM, 1.0)}
    ops["premul"] = (dist.ReduceOp.PREMUL_SUM(0.25), 0.25)
    out = {}
    for name, (op, factor) in ops.items():
        for dtype in (torch.float32, torch.bfloat16):
            xs = [torch.from_numpy(np.random.default_rng([11, r]).standard_normal(size * per)) for r in range(size)]
            xs = [x.to(dtype) for x in xs]
            total = xs[0].bfloat16()
            for x in xs[1:]:
                total = total + x.bfloat16()
            ref = total[rank * per : (rank + 1) * per].to(dtype) * factor
            comm = ALQReduceScatter(compress="when-faster", bucket_size=64, min_size=64, seed=3)
            now = [0.0]
            comm.round_state.speed = arbiter = SpeedArbiter(rank=rank, clock=lambda: now[0], warmup=0)
            equal = []
            for i in range(8):
                o = torch.empty(per, dtype=dtype)
                work = comm(o, xs[rank], dist.group.WORLD, op, async_op=bool(i % 2))
                if work is not None:
                    work.wait()
                if not arbiter.current:
                    equal.append(bool(torch.equal(o, ref)))
                now[0] += 1.0
            m = comm.metrics()
            out[f"{name}/{str(dtype)[6:]}"] = {"equal": equal, "rounds_16bit": m["rounds_16bit"], "step": m["step"]}
    return out


def mismatched(frontend: str) -> dict:
    """A model whose last rank was built with compress='always': its first step must raise on every rank."""
    net, opt, *_ = build(frontend, Net(), last_compress="always")
    x = torch.randn(16, 32)
    try:
        F.mse_loss(net(x), x[:, :4]).backward()
        opt.step()
    except Exception as err:  # noqa: BLE001
        return {"raised": True, "message": f"{type(err).__name__}: {err}"}
    return {"raised": False}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("frontend", choices=("ddp", "fsdp", "torch"))
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--flip", type=int, default=30)
    p.add_argument("--mismatch", action="store_true", help="then a model whose last rank builds compress='always'")
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = Net()
    net, opt, round_state, metrics, rank, size = build(args.frontend, model)
    now = [0.0]
    arbiter = round_state.speed
    assert arbiter is not None, "compress='when-faster' made no arbiter"
    # the default schedule on the injected clock, its confirming trial at round 20, drift checks every 4
    round_state.speed = arbiter = SpeedArbiter(rank=rank, clock=lambda: now[0], confirm=20, watch=4)
    g = torch.Generator().manual_seed(100 + rank)
    teacher = torch.Generator().manual_seed(7)
    w = torch.randn(32, 4, generator=teacher)
    paths, digests, updates, as_fp16, calls, errors = [], [], [], [], [], []
    for step in range(args.steps):
        x = torch.randn(16, 32, generator=g)
        loss = F.mse_loss(net(x), x @ w)
        opt.zero_grad()
        loss.backward()
        local = [p.grad.clone() for p in model.parameters()]
        opt.step()
        quantized = arbiter.current
        if args.frontend == "torch" and size == 2 and not quantized:
            as_fp16.append(same_as_fp16(model, local, step))
        now[0] += 2.0 if quantized else (1.0 if step < args.flip else 4.0)
        paths.append(bool(quantized))
        params = [p.full_tensor() for p in model.parameters()] if args.frontend == "fsdp" else model.parameters()
        digests.append(digest(*params))
        updates.append(int(round_state.level_updates))
        calls.append(int(round_state.calls))
        if round_state.feedback is not None:  # FSDP2: a digest of the error-feedback buffers
            errors.append(digest(*(b for _, b in sorted(round_state.feedback.buffers.items(), key=repr))))
    m = metrics()
    out = {
        "rank": rank,
        "size": size,
        "paths": paths,
        "digests": digests,
        "level_updates": updates,
        "as_fp16": as_fp16,
        "calls": calls,
        "errors": errors,
        "metrics": {k: m[k] for k in m if k.startswith(("compress", "step", "rounds_16bit", "level"))},
        "levels": [float(v) for v in round_state.quantizer.levels],
    }
    if args.frontend == "fsdp":
        out["sixteen"] = sixteen_calls(rank, size)
    if args.mismatch:  # after the training (one launch): a mismatched model raises on every rank
        out["mismatch"] = mismatched(args.frontend)
    report(out)
    if args.frontend == "fsdp" or (args.mismatch and args.frontend == "ddp"):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # after a hook raised in backward, skip the C++ teardown (as ddp_worker.py)
    # (Horovod shuts down at exit: mpirun wants MPI finalized)


if __name__ == "__main__":
    main()
