"""The 2-rank sections of scripts.bench.gpu_paths: two processes on ``cuda:0`` over gloo (on CPU in
the dry run): the DDP hook's exchanges, the GPT trained with the hook, FSDP2 and DiLoCo, and the
Horovod compressor (on CUDA with a Horovod built without GPU operations, ``--horovod-gloo``).
Each worker writes ``--result DIR/rank<r>.json``; the section merges the ranks' checks and digests.
"""

# no `from __future__ import annotations`: DDP checks the hooks' annotations as objects

import argparse
import hashlib
import importlib.util
import json
import os
import subprocess
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn

from scripts.bench.gpu_paths_steps import char_data, check, falls, optimizer_check, train_losses, unbiased
from scripts.common.network import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXCHANGES = ("allgather", "two-phase", "hierarchical", "hierarchical-two-phase")
ROUNDS = 16


# ---------------------------------------------------------------------------------------- parent
def launch(ctx, kind: str, timeout: float = 240, horovod_path: str | None = None) -> list:
    """Both ranks' results of the ``kind`` worker; raises with their output when a rank fails or
    outlives ``timeout`` (below the section timeout, so the next sections still run)."""
    worker = [sys.executable, "-m", "scripts.bench.gpu_paths_ranks", "--worker", kind, "--device", ctx.device.type]
    worker += ["--tiny"] if ctx.tiny else []
    paths = [horovod_path, ROOT, os.environ.get("PYTHONPATH")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p), "OMP_NUM_THREADS": "1"}
    env.pop("TRITON_INTERPRET", None)
    if kind in ("exchanges", "horovod"):
        env["HOROVOD_ALQ_LOCAL_SIZE"] = "1"  # the hierarchical exchanges: 2 nodes of 1 rank
    with tempfile.TemporaryDirectory() as out:
        worker += ["--result", out]
        if kind == "horovod":
            runner = [sys.executable, "-m", "horovod.runner.launch", "-np", "2", "-H", "localhost:2", "--gloo"]
            cmds = [(runner + worker, env)]
        else:
            env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port("127.0.0.1")), WORLD_SIZE="2")
            cmds = [(worker, {**env, "RANK": str(r), "LOCAL_RANK": str(r)}) for r in range(2)]
        pipe = dict(cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        procs = [subprocess.Popen(cmd, env=e, **pipe) for cmd, e in cmds]
        outputs = []
        for p in procs:
            try:
                outputs.append(p.communicate(timeout=timeout)[0])
            except subprocess.TimeoutExpired:
                for q in procs:
                    q.kill()
                outputs.append(p.communicate()[0] + f"\n(killed after {timeout:.0f} s)")
        files = [os.path.join(out, f"rank{r}.json") for r in range(2)]
        if any(p.returncode != 0 for p in procs) or not all(map(os.path.exists, files)):
            codes = [p.returncode for p in procs]
            raise RuntimeError(
                f"the 2-rank {kind} worker failed (exit {codes}):\n" + "\n".join(o[-3000:] for o in outputs)
            )
        results = []
        for f in files:
            with open(f) as fh:
                results.append(json.load(fh))
    return results


def merge(sec, results: list) -> None:
    """Rank 0's checks, rank 1's failed ones, and one check per digest that both ranks agree."""
    for c in results[0]["checks"]:
        sec.check(c["name"], c["ok"], c.get("detail", ""))
    for c in results[1]["checks"]:
        if not c["ok"]:
            sec.check("rank 1: " + c["name"], False, c.get("detail", ""))
    for name, value in results[0]["digests"].items():
        sec.check(f"{name}: identical on both ranks", results[1]["digests"].get(name) == value, value[:12])
    sec.data.update(results[0]["data"])


def exchanges_section(ctx, sec) -> None:
    merge(sec, launch(ctx, "exchanges"))
    sec.lines.append(f"2 ranks on one {'GPU' if ctx.cuda else 'CPU'} over gloo; {ROUNDS} rounds per exchange.")


def train_section(ctx, sec) -> None:
    merge(sec, launch(ctx, "train"))
    sec.lines.append(f"2 ranks on one {'GPU' if ctx.cuda else 'CPU'} over gloo, each with its own batches.")


def horovod_section(ctx, sec) -> None:
    from scripts.bench.gpu_paths_codec import Skipped

    path = getattr(ctx.args, "horovod_gloo", "") or None
    if path is None and importlib.util.find_spec("horovod") is None:
        raise Skipped("Horovod is not importable (building it: docs/guides/gpu.md)")
    if ctx.cuda and path is None:
        probe = "import horovod.torch as h; print(int(h.nccl_built()))"
        built = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
        if built.stdout.strip() != "0":
            raise Skipped(
                "this Horovod sends CUDA tensors through NCCL, which refuses 2 ranks on one GPU; "
                "--horovod-gloo names a Horovod built without GPU operations (scripts/bench/gpu_device.sh)"
            )
    merge(sec, launch(ctx, "horovod", horovod_path=path))
    sec.lines.append(f"horovodrun --gloo -np 2 on one {'GPU' if ctx.cuda else 'CPU'}.")


SECTIONS = {
    "ranks-exchanges": ("2 ranks: DDP hook, every exchange", exchanges_section),
    "ranks-train": ("2 ranks: DDP hook, FSDP2, DiLoCo training", train_section),
    "ranks-horovod": ("2 ranks: Horovod compressor, gloo controller", horovod_section),
}


# ---------------------------------------------------------------------------------------- workers
def digest(tensors) -> str:
    h = hashlib.sha1()
    for t in tensors:
        h.update(t.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def rank_input(rank: int, n: int, device) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + rank)
    return (torch.randn(n, generator=g) * (1 + rank) + 0.1 * rank).to(device)


class Vector(nn.Module):
    """One parameter ``w``; ``forward(g)`` is ``(w * g).sum()``, so the gradient is ``g``."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(n))

    def forward(self, g):
        return (self.w * g).sum()


def ddp(module: nn.Module, device) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel as DDP

    return DDP(module, device_ids=[device.index] if device.type == "cuda" else None)


def exchanges_worker(rank: int, device, tiny: bool) -> dict:
    from horovod_alq.torch.ddp import ALQState, alq_hook

    n = (1 << 12) if tiny else (1 << 20)
    checks, digests, data = [], {}, {}
    g = rank_input(rank, n, device)
    exact = (rank_input(0, n, device) + rank_input(1, n, device)) / 2
    for exchange in EXCHANGES:
        model = ddp(Vector(n).to(device), device)
        state = ALQState(bits=3, seed=0, update_steps=(0,), update_every=0, exchange=exchange)
        model.register_comm_hook(state, alq_hook)
        outs = []
        for _ in range(ROUNDS):
            model.zero_grad(set_to_none=True)
            model(g).backward()
            outs.append(model.module.w.grad.detach().clone())
        unbiased(outs, exact, f"DDP hook, {exchange}", checks)
        used = state.metrics().get("exchange")
        check(checks, f"DDP hook, {exchange}: the exchange in use", used == exchange, str(used))
        digests[f"DDP hook, {exchange}"] = digest(outs)
        data[exchange] = {"bits_per_coordinate": state.metrics().get("bits_per_coordinate")}
    return {"checks": checks, "digests": digests, "data": data}


def char_model(device, tiny: bool, seed: int = 0) -> nn.Module:
    from scripts.common.gpt import GPT

    torch.manual_seed(seed)
    return GPT(*((103, 64, 2, 2, 32) if tiny else (103, 192, 4, 4, 128))).to(device)


def train_worker(rank: int, device, tiny: bool) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from horovod_alq.torch.ddp import ALQState, alq_hook
    from horovod_alq.torch.diloco import DiLoCo
    from horovod_alq.torch.fsdp import ALQReduceScatter, quantize_reduce_scatter

    steps = 30 if tiny else 60
    data = char_data(device, tiny, steps, 10 + rank)
    checks, digests, out = [], {}, {}

    def record(name, losses, params, state=None):
        if state is not None:
            m = state.metrics()
            sent = f"{m['bytes_sent']} bytes sent, {m['coordinates']} coordinates"
            check(checks, f"{name}: codes exchanged", m["bytes_sent"] > 0 < m["coordinates"], sent)
        check(checks, f"{name}: loss falls", falls(losses), f"{losses[0]:.3f} -> {losses[-1]:.3f}")
        check(checks, f"{name}: parameters finite", all(bool(torch.isfinite(p).all()) for p in params))
        digests[f"{name}: parameters"] = digest(params)
        out[name] = {"losses": losses}

    # DDP with the hook
    from scripts.bench.gpu_paths_steps import GPTLoss

    model = ddp(GPTLoss(char_model(device, tiny)), device)
    state = ALQState(bits=3, seed=0)
    model.register_comm_hook(state, alq_hook)
    losses = train_losses(data, torch.optim.AdamW(model.parameters(), lr=3e-3), model)
    record("DDP hook", losses, list(model.parameters()), state)

    # FSDP2: each block and the whole model sharded over the 2 ranks, the ALQ reduce-scatter
    model = char_model(device, tiny)
    mesh = init_device_mesh(device.type, (2,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    comm = quantize_reduce_scatter(model, ALQReduceScatter(bits=3, seed=0))
    losses = train_losses(data, torch.optim.AdamW(model.parameters(), lr=3e-3), model.loss)
    record("FSDP2", losses, [p.full_tensor() for p in model.parameters()], comm)

    # DiLoCo: an outer step every 5 inner steps
    model = char_model(device, tiny)
    inner = torch.optim.AdamW(model.parameters(), lr=3e-3)
    loco = DiLoCo(model, inner, sync_every=5, bits=3)
    losses = train_losses(data, inner, model.loss, loco.step)
    record("DiLoCo", losses, list(model.parameters()), loco)
    check(checks, "DiLoCo: an outer step every 5", loco.outer_steps == steps // 5, str(loco.outer_steps))
    return {"checks": checks, "digests": digests, "data": out}


def horovod_worker(device_type: str, tiny: bool) -> tuple:
    """(rank, result): Horovod's allreduce with the ALQ compressor and each exchange, then
    hvd.DistributedOptimizer, on 2 ranks (both on cuda:0 on CUDA)."""
    import horovod.torch as hvd

    from horovod_alq.torch import ALQCompressor

    hvd.init()
    rank = hvd.rank()
    device = torch.device("cuda", 0) if device_type == "cuda" else torch.device("cpu")
    n = (1 << 12) if tiny else (1 << 20)
    checks, digests = [], {}
    nccl = bool(hvd.nccl_built())
    name = "2 ranks" + (", CUDA tensors not on NCCL" if device_type == "cuda" else "")
    check(
        checks, name, hvd.size() == 2 and not (device_type == "cuda" and nccl), f"size {hvd.size()}, nccl_built {nccl}"
    )
    g = rank_input(rank, n, device)
    exact = (rank_input(0, n, device) + rank_input(1, n, device)) / 2
    for exchange in ("allgather", "two-phase", "hierarchical"):
        comp = ALQCompressor(bits=3, exchange=exchange)
        outs = [hvd.allreduce(g, compression=comp, op=hvd.Average, name=f"{exchange}{i}") for i in range(ROUNDS)]
        unbiased(outs, exact, f"Horovod allreduce, {exchange}", checks)
        used = comp.metrics().get("exchange")
        check(checks, f"Horovod, {exchange}: the exchange in use", used == exchange, str(used))
        digests[f"Horovod allreduce, {exchange}"] = digest(outs)
    model = nn.Linear(32, 1).to(device)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    w = torch.randn(32, 1, generator=torch.Generator().manual_seed(1)).to(device)
    done, losses = optimizer_check(hvd, model, w, torch.Generator().manual_seed(1 + rank))
    checks.append(done)
    digests["DistributedOptimizer: parameters"] = digest(model.parameters())
    hvd.shutdown()
    return rank, {"checks": checks, "digests": digests, "data": {"losses": losses}}


def worker(argv) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--worker", choices=["exchanges", "train", "horovod"])
    p.add_argument("--device", choices=["cuda", "cpu"])
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--result")
    args = p.parse_args(argv)
    if args.worker == "horovod":
        rank, result = horovod_worker(args.device, args.tiny)
    else:
        rank = int(os.environ["RANK"])
        device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group("gloo", rank=rank, world_size=2)
        try:
            fn = exchanges_worker if args.worker == "exchanges" else train_worker
            result = fn(rank, device, args.tiny)
        finally:
            dist.destroy_process_group()
    with open(os.path.join(args.result, f"rank{rank}.json"), "w") as fh:
        json.dump(result, fh, default=str)


if __name__ == "__main__":
    worker(sys.argv[1:])
