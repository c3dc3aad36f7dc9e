"""Worker for tests/torch/test_ddp_ranks.py: DistributedDataParallel with the ALQ hook over gloo,
every scenario in one torchrun launch (start-up dominates), reported as one dict per rank."""

import argparse
import copy
import io
import os
import pickle
import sys

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from common import report, stalled_backward
from helpers import digest, t_stat
from torch.nn.parallel import DistributedDataParallel as DDP

from horovod_alq.torch.ddp import ALQState, alq_hook
from horovod_alq.torch.dist_transport import DistTransport


class Net(torch.nn.Module):
    """An MLP (about 21k parameters: several DDP buckets at bucket_cap_mb=0.01, biases travel plain)
    with an optional branch that the forward never uses (find_unused_parameters)."""

    def __init__(self, unused: bool = False) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(32, 128)
        self.fc2 = torch.nn.Linear(128, 128)
        self.fc3 = torch.nn.Linear(128, 4)
        self.unused = torch.nn.Linear(64, 32) if unused else None

    def forward(self, x):
        return self.fc3(torch.tanh(self.fc2(torch.tanh(self.fc1(x)))))


def batches(rank: int, steps: int, size: int = 32):
    """A fixed teacher (the same on every rank), each rank's own inputs."""
    teacher = torch.Generator().manual_seed(123)
    w = torch.randn(32, 4, generator=teacher)
    g = torch.Generator().manual_seed(1000 + rank)
    out = []
    for _ in range(steps):
        x = torch.randn(size, 32, generator=g)
        out.append((x, (x @ w).argmax(1)))
    return out


def make_model(seed: int = 0, unused: bool = False, group=None, **ddp_kwargs) -> DDP:
    torch.manual_seed(seed)
    return DDP(Net(unused), process_group=group, bucket_cap_mb=0.01, **ddp_kwargs)


def state_for(method: str, group=None, **kwargs) -> ALQState:
    kwargs.setdefault("bucket_size", 256)
    kwargs.setdefault("update_steps", (0, 10))
    kwargs.setdefault("update_every", 0)
    kwargs.setdefault("seed", 7)
    return ALQState(process_group=group, method=method, **kwargs)


def train(model, opt, data, accumulate: int = 1, scaler=None):
    losses = []
    for i, (x, y) in enumerate(data):
        sync = (i + 1) % accumulate == 0
        ctx = model.no_sync() if not sync else _null()
        with ctx:
            loss = F.cross_entropy(model(x), y)
            (scaler.scale(loss) if scaler else loss).backward()
        losses.append(loss.item())
        if sync:
            if scaler:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
            opt.zero_grad()
    return losses


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def training(rank: int, method: str, exchange: str, steps: int, state_kwargs=None, **ddp_kwargs) -> dict:
    unused = ddp_kwargs.pop("unused", False)
    accumulate = ddp_kwargs.pop("accumulate", 1)
    model = make_model(unused=unused, **ddp_kwargs)
    state = state_for(method, exchange=exchange, **(state_kwargs or {}))
    model.register_comm_hook(state, alq_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = train(model, opt, batches(rank, steps), accumulate)
    m = state.metrics()
    k = max(1, steps // 5)
    return {
        "params": digest(*model.parameters()),
        "levels": m["levels"].tolist(),
        "second_levels": m["second_levels"].tolist(),
        "level_updates": m["level_updates"],
        "step": m["step"],
        "exchange": m["exchange"],
        "calls": m["calls"],
        "uncompressed": m["uncompressed_coordinates"],
        "bits_per_coordinate": m["bits_per_coordinate"],
        "loss_first": float(np.mean(losses[:k])),
        "loss_last": float(np.mean(losses[-k:])),
        "allocation": m.get("allocation"),
        "allocated_mean_bits": m.get("allocated_mean_bits"),
    }


class _Dot(torch.nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(n))

    def forward(self, c):
        return (self.w * c).sum()


def unbiased(
    rank: int, size: int, exchange: str, method: str = "alq", n: int = 3000, bucket: int = 128, reps: int = 60
) -> dict:
    """``reps`` DDP backward passes of loss = <w, c_rank>: the hook's output estimates the mean of
    the c_r; t-statistics over the i.i.d. calls (levels fixed after the refit of step 0)."""
    cs = []
    for r in range(size):
        g = np.random.default_rng([11, r])
        c = g.standard_normal(n) * (1 + r) + 0.1 * r
        c[: n // 4] = g.standard_t(3, n // 4) * 0.01
        cs.append(c.astype(np.float32))
    truth = np.mean([c.astype(np.float64) for c in cs], axis=0)
    model = DDP(_Dot(n), bucket_cap_mb=1)
    state = ALQState(method=method, bucket_size=bucket, exchange=exchange, seed=3, update_steps=(0,), update_every=0)
    model.register_comm_hook(state, alq_hook)
    mine = torch.from_numpy(cs[rank])
    outs = []
    for i in range(reps + 1):
        model.zero_grad()
        model(mine).backward()
        if i:
            outs.append(model.module.w.grad.double().numpy().copy())
    dev = np.stack(outs) - truth
    nb = -(-n // bucket)
    per_bucket = np.add.reduceat(dev, np.arange(0, nb * bucket, bucket), axis=1)
    return {
        "t_plain": float(t_stat(dev.sum(1, keepdims=True))[0]),
        "t_signed": float(t_stat((dev @ np.sign(truth))[:, None])[0]),
        "t_buckets_max": float(np.abs(t_stat(per_bucket)).max()),
        "buckets": nb,
        "reps": reps,
        "exchange": state.metrics()["exchange"],
        "digest": digest(np.stack(outs)),
        "rel_error": float(np.abs(dev).mean() / np.abs(truth).mean()),
    }


class _Dots(torch.nn.Module):
    def __init__(self, sizes) -> None:
        super().__init__()
        self.ws = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(n)) for n in sizes])

    def forward(self, cs):
        return sum((w * c).sum() for w, c in zip(self.ws, cs))


def unbiased_auto(
    rank: int, size: int, exchange: str, reps: int = 60, bucket: int = 128, bits_per: str = "tensor"
) -> dict:
    """bits="auto": three parameters whose gradients differ 10^4-fold in scale share one DDP bucket;
    after the refit of step 0 they travel at different widths. t statistics as :func:`unbiased`."""
    sizes, scales = (1000, 1500, 500), (100.0, 1.0, 0.01)
    cs = [
        [
            (np.random.default_rng([12, r, k]).standard_normal(n) * s).astype(np.float32)
            for k, (n, s) in enumerate(zip(sizes, scales))
        ]
        for r in range(size)
    ]
    truth = np.concatenate([np.mean([c[k].astype(np.float64) for c in cs], axis=0) / s for k, s in enumerate(scales)])
    model = DDP(_Dots(sizes), bucket_cap_mb=1)
    state = ALQState(
        method="alq",
        bits="auto",
        bit_budget=3.0,
        bits_per=bits_per,
        bucket_size=bucket,
        exchange=exchange,
        seed=3,
        update_steps=(0,),
        update_every=0,
    )
    model.register_comm_hook(state, alq_hook)
    mine = [torch.from_numpy(c) for c in cs[rank]]
    outs = []
    for i in range(reps + 1):
        model.zero_grad()
        model(mine).backward()
        if i:
            outs.append(np.concatenate([w.grad.double().numpy() / s for w, s in zip(model.module.ws, scales)]))
    dev = np.stack(outs) - truth
    per_bucket = np.add.reduceat(dev, np.arange(0, dev.shape[1], bucket), axis=1)
    t = per_bucket.mean(0) / (per_bucket.std(0, ddof=1) / np.sqrt(reps))
    m = state.metrics()
    return {
        "t_buckets_max": float(np.abs(t).max()),
        "buckets": per_bucket.shape[1],
        "reps": reps,
        "allocation": m["allocation"],
        "exchange": m["exchange"],
        "bits": state.bits,
        "bits_per": m["bits_per"],
        "payload_bytes": m["payload_bytes"],
        "rounds": m["step"],
        "digest": digest(np.stack(outs)),
    }


def checkpoint(rank: int) -> dict:
    """Save at step 8; run 6 steps (a refit at step 10 among them); load the saved model, optimizer
    and hook state in place and run the same 6 steps again: the same parameters and levels."""
    data = batches(rank, 14)
    model = make_model()
    state = state_for("alq", update_steps=(0, 4, 10))
    model.register_comm_hook(state, alq_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    train(model, opt, data[:8])
    saved = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict(), "alq": state.state_dict()})
    buf = io.BytesIO()
    torch.save(saved["alq"], buf)
    levels_saved = state.levels.tolist()
    train(model, opt, data[8:])
    first = {"params": digest(*model.parameters()), "levels": state.levels.tolist(), "metrics": _counters(state)}
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    buf.seek(0)
    state.load_state_dict(torch.load(buf, weights_only=False))
    restored_levels = state.levels.tolist()
    train(model, opt, data[8:])
    second = {"params": digest(*model.parameters()), "levels": state.levels.tolist(), "metrics": _counters(state)}
    # a fresh state and a pickled one load the same levels and counters
    fresh = state_for("alq", seed=99)
    fresh.load_state_dict(saved["alq"])
    clone = pickle.loads(pickle.dumps(state))
    wrong = None
    try:
        state_for("amq").load_state_dict(saved["alq"])
    except ValueError as err:
        wrong = str(err)
    return {
        "first": first,
        "second": second,
        "levels_saved": levels_saved,
        "restored_levels": restored_levels,
        "fresh_levels": fresh.levels.tolist(),
        "fresh_step": fresh.metrics()["step"],
        "clone_levels": clone.levels.tolist(),
        "clone_step": clone.metrics()["step"],
        "wrong_method": wrong,
    }


def _counters(state):
    m = state.metrics()
    return {k: m[k] for k in ("step", "level_updates", "calls", "payload_bytes", "coordinates")}


def nonfinite(rank: int) -> dict:
    """Rank 0's loss is Inf at step 2: every rank gets non-finite gradients, GradScaler skips the
    step on every rank (the parameters do not move) and the next steps train on."""
    model = make_model()
    state = state_for("alq")
    model.register_comm_hook(state, alq_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    out = {}
    for i, (x, y) in enumerate(batches(rank, 4)):
        before = digest(*model.parameters())
        loss = F.cross_entropy(model(x), y)
        if i == 2 and rank == 0:
            loss = loss * float("inf")
        scaler.scale(loss).backward()
        if i == 2:
            out["finite_grads"] = [bool(torch.isfinite(p.grad).all()) for p in model.parameters()]
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        if i == 2:
            out["moved"] = digest(*model.parameters()) != before
            out["scale"] = scaler.get_scale()
    out["params"] = digest(*model.parameters())
    return out


def subgroup(rank: int, size: int) -> dict:
    """DDP over the group of ranks 0 and 1 only (process_group= for DDP and the state)."""
    group = dist.new_group([0, 1])
    if rank > 1:
        return {"member": False}
    model = make_model(group=group)
    state = state_for("amq", group=group)
    model.register_comm_hook(state, alq_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = train(model, opt, batches(rank, 6))
    return {
        "member": True,
        "params": digest(*model.parameters()),
        "levels": state.levels.tolist(),
        "step": state.metrics()["step"],
        "losses": losses,
    }


def overlap(rank: int, exchange: str, steps: int = 4) -> dict:
    """An MLP of five 512x512 layers with bucket_cap_mb=1 (several DDP buckets): per step, the
    order in which DDP calls the hook for each bucket and the hook starts its payload collectives
    (recorded at the transport: allgather, alltoall)."""
    events = []
    originals = {name: getattr(DistTransport, name) for name in ("allgather", "alltoall")}

    def recording(name):
        def call(self, payload, *args):
            events.append(("payload", name))
            return originals[name](self, payload, *args)

        return call

    def hook(state, bucket):
        events.append(("hook", bucket.index(), bucket.is_last(), bucket.buffer().numel()))
        return alq_hook(state, bucket)

    torch.manual_seed(0)
    net = torch.nn.Sequential(*[m for _ in range(5) for m in (torch.nn.Linear(512, 512), torch.nn.Tanh())])
    model = DDP(net, bucket_cap_mb=1)
    state = state_for("alq", exchange=exchange, bucket_size=512, min_size=1024)
    model.register_comm_hook(state, hook)
    g = torch.Generator().manual_seed(50 + rank)
    per_step = []
    for name in originals:
        setattr(DistTransport, name, recording(name))
    try:
        for _ in range(steps):
            events.clear()
            model.zero_grad()
            model(torch.randn(16, 512, generator=g)).pow(2).mean().backward()
            per_step.append(list(events))
    finally:
        for name, f in originals.items():
            setattr(DistTransport, name, f)
    return {
        "events": per_step,
        "grads": digest(*(p.grad for p in model.parameters())),
        "exchange": state.metrics()["exchange"],
    }


def mismatch(rank: int, size: int, which: str) -> dict:
    """The last rank builds its state with other settings: every rank must raise, none may hang."""
    kwargs = {}
    if rank == size - 1:
        kwargs = {"bits": dict(bits=4), "min_size": dict(min_size=100_000), "method": dict(method="amq")}[which]
    model = make_model()
    state = state_for("alq", **kwargs)
    model.register_comm_hook(state, alq_hook)
    x, y = batches(rank, 1)[0]
    try:
        F.cross_entropy(model(x), y).backward()
    except Exception as err:  # noqa: BLE001
        return {"raised": True, "message": f"{type(err).__name__}: {err}"}
    return {"raised": False}


def stalled(rank: int, size: int, refit: bool, timeout: float = 3.0) -> dict:
    """The last rank raises in the middle of backward (from a hook on fc1's weight, after the later
    layers' buckets went out), so it never issues fc1's bucket, and stays alive (a process that
    exits closes its connections, and gloo fails the others at once): every other rank's future
    for that bucket must fail after ``timeout`` (the watchdog), not wait for gloo's 30 minutes. With
    ``refit``, step 2 refits: the last bucket's hook waits for every bucket, and that wait raises
    after ``timeout``. Each run has a process group of its own, where its abandoned collective stays;
    run last all the same (the stopped rank's DDP state is left mid-step)."""
    group = dist.new_group(list(range(size)))  # its own group: the abandoned collective stays there
    model = make_model(group=group)
    state = state_for("alq", group=group, timeout=timeout, update_steps=(0, 1) if refit else (0,))
    model.register_comm_hook(state, alq_hook)
    (x, y), (x2, y2) = batches(rank, 2)
    F.cross_entropy(model(x), y).backward()  # a whole step: DDP then rebuilds its buckets at 0.01 MB
    if rank == size - 1:

        def stop(grad):
            raise RuntimeError("injected: this rank stops in the middle of backward")

        model.module.fc1.weight.register_hook(stop)
    return stalled_backward(rank, size, timeout, lambda: F.cross_entropy(model(x2), y2).backward())


def accumulate_feedback(rank: int, micro: int = 8, accumulate: int = 2) -> dict:
    """``no_sync()`` accumulation with ``error_feedback=True``: after each micro-step, a digest of
    the rank's error buffers and the rounds run so far (the buffers may change at synchronized
    micro-steps only, and must change at each)."""
    model = make_model()
    state = state_for("alq", exchange="two-phase", error_feedback=True, bits=2)
    model.register_comm_hook(state, alq_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    seen = []
    for i, (x, y) in enumerate(batches(rank, micro)):
        sync = (i + 1) % accumulate == 0
        with model.no_sync() if not sync else _null():
            F.cross_entropy(model(x), y).backward()
        if sync:
            opt.step()
            opt.zero_grad()
        buffers = state.state_dict()["error_feedback"]["buffers"]
        seen.append({"sync": sync, "rounds": state.metrics()["step"], "buffers": digest(*(b for _, b in buffers))})
    return {"micro": seen, "params": digest(*model.parameters())}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--methods", default="alq,amq,qsgdinf,terngrad")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--reps", type=int, default=60)
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    out = {"rank": rank, "size": size, "train": {}}
    for method in args.methods.split(","):
        out["train"][method] = training(rank, method, "auto", args.steps)
    # the other exchange, and DDP's options
    out["train"]["alq/two-phase+accumulate"] = training(rank, "alq", "two-phase", args.steps, accumulate=2)
    out["accumulate_feedback"] = accumulate_feedback(rank)
    out["train"]["amq/static_graph"] = training(rank, "amq", "auto", args.steps, static_graph=True)
    out["train"]["alq/find_unused+bucket_view"] = training(
        rank, "alq", "allgather", args.steps, unused=True, find_unused_parameters=True, gradient_as_bucket_view=True
    )
    out["train"]["alq/auto"] = training(rank, "alq", "auto", args.steps, state_kwargs=dict(bits="auto", bit_budget=2.5))
    out["train"]["alq/auto-bucket"] = training(
        rank, "alq", "auto", args.steps, state_kwargs=dict(bits="auto", bit_budget=2.5, bits_per="bucket")
    )
    out["unbiased"] = {ex: unbiased(rank, size, ex, reps=args.reps) for ex in ("allgather", "two-phase")}
    out["unbiased_auto"] = {ex: unbiased_auto(rank, size, ex, reps=args.reps) for ex in ("allgather", "two-phase")}
    out["unbiased_bucket"] = {
        ex: unbiased_auto(rank, size, ex, reps=args.reps, bits_per="bucket") for ex in ("allgather", "two-phase")
    }
    out["checkpoint"] = checkpoint(rank)
    out["nonfinite"] = nonfinite(rank)
    if size > 2:
        out["subgroup"] = subgroup(rank, size)
    out["overlap"] = {ex: overlap(rank, ex) for ex in ("allgather", "two-phase")}
    out["mismatch"] = {w: mismatch(rank, size, w) for w in ("bits", "min_size")}
    out["stalled"] = {
        k: stalled(rank, size, k == "refit") for k in ("plain", "refit")
    }  # last: leave collectives behind
    report(out)
    # After a comm hook raised inside backward (the mismatch scenarios), PyTorch sometimes aborts at
    # interpreter exit ("terminate called without an active exception", also with its own
    # quantization hooks): leave without the C++ teardown once the results are written.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
