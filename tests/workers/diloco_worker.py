"""Worker for tests/torch/test_diloco.py: horovod_alq.torch.diloco.DiLoCo over gloo, every scenario
in one torchrun launch (start-up dominates), reported as one dict per rank."""

import io
import os
import sys

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from common import placed_buffers, report
from helpers import digest, t_stat

from horovod_alq.torch.diloco import DiLoCo


class Net(torch.nn.Module):
    """An MLP of about 6k parameters: the weights are quantized, the biases (under min_size) travel plain."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(16, 64)
        self.fc2 = torch.nn.Linear(64, 64)
        self.fc3 = torch.nn.Linear(64, 4)

    def forward(self, x):
        return self.fc3(torch.tanh(self.fc2(torch.tanh(self.fc1(x)))))


def batch(rank: int, step: int, size: int = 16):
    """Rank ``rank``'s batch of inner step ``step``: its own inputs, labels of one fixed teacher."""
    w = torch.randn(16, 4, generator=torch.Generator().manual_seed(123))
    x = torch.randn(size, 16, generator=torch.Generator().manual_seed(1000 * step + rank))
    return x, (x @ w).argmax(1)


def build(sync_every: int = 4, init: int = 0, **kwargs):
    torch.manual_seed(init)
    model = Net()
    inner = torch.optim.AdamW(model.parameters(), lr=3e-3)
    kwargs.setdefault("bucket_size", 256)
    kwargs.setdefault("min_size", 256)
    kwargs.setdefault("seed", 5)
    return model, inner, DiLoCo(model, inner, sync_every=sync_every, **kwargs)


def run(rank, model, inner, diloco, first: int, steps: int):
    """Inner steps ``first`` .. ``first + steps - 1``; the parameters' digest after each outer step
    and after the first inner step that follows one."""
    after_outer, after_inner, losses = [], [], []
    for step in range(first, first + steps):
        x, y = batch(rank, step)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        outer = diloco.step()
        inner.zero_grad()
        losses.append(loss.item())
        params = digest(*[p.detach() for p in model.parameters()])
        if outer:
            after_outer.append(params)
            assert params == digest(*diloco.global_params)
        elif step % diloco.sync_every == 0:
            after_inner.append(params)
    return {
        "after_outer": after_outer,
        "after_inner": after_inner,
        "loss_first": float(np.mean(losses[:4])),
        "loss_last": float(np.mean(losses[-4:])),
    }


def train(rank: int, **kwargs) -> dict:
    model, inner, diloco = build(**kwargs)
    out = run(rank, model, inner, diloco, 0, 24)
    m = diloco.metrics()
    out.update(
        {
            k: m[k]
            for k in (
                "step",
                "outer_steps",
                "inner_steps",
                "level_updates",
                "exchange",
                "bytes_sent",
                "plain_bytes_sent",
                "bits_per_coordinate",
                "uncompressed_coordinates",
            )
        }
    )
    out["levels"] = m["levels"]
    return out


def unbiased(
    rank: int, size: int, exchange: str, n: int = 3000, bucket: int = 128, reps: int = 60, wire: str = "fixed"
) -> dict:
    """``reps`` outer steps whose pseudo-gradient is exactly rank r's fixed ``c_r`` (global parameters 0,
    an inner SGD step of lr 1 on gradient c_r, outer SGD of lr 1 without momentum: the new global
    parameters are minus the decoded average). t statistics over the steps after the refit of step 0."""
    cs = []
    for r in range(size):
        g = np.random.default_rng([21, r])
        c = g.standard_normal(n) * (1 + r) + 0.1 * r
        c[: n // 4] = g.standard_t(3, n // 4) * 0.01
        cs.append(c.astype(np.float32))
    truth = np.mean([c.astype(np.float64) for c in cs], axis=0)
    w = torch.nn.Parameter(torch.zeros(n))
    model = torch.nn.ParameterList([w])
    inner = torch.optim.SGD([w], lr=1.0)
    diloco = DiLoCo(
        model,
        inner,
        sync_every=1,
        outer_lr=1.0,
        outer_momentum=0.0,
        bits=3,
        bucket_size=bucket,
        exchange=exchange,
        seed=3,
        update_steps=(0,),
        update_every=0,
        wire=wire,
    )
    mine = torch.from_numpy(cs[rank])
    outs = []
    for i in range(reps + 1):
        with torch.no_grad():
            w.zero_()
            diloco.global_params[0].zero_()
        w.grad = mine.clone()
        diloco.step()
        if i:
            outs.append(-w.detach().double().numpy().copy())
    dev = np.stack(outs) - truth
    nb = -(-n // bucket)
    per_bucket = np.add.reduceat(dev, np.arange(0, nb * bucket, bucket), axis=1)
    return {
        "t_plain": float(t_stat(dev.sum(1, keepdims=True))[0]),
        "t_signed": float(t_stat((dev @ np.sign(truth))[:, None])[0]),
        "t_buckets_max": float(np.abs(t_stat(per_bucket)).max()),
        "buckets": nb,
        "reps": reps,
        "exchange": diloco.metrics()["exchange"],
        "digest": digest(np.stack(outs)),
        "step_digests": [digest(o) for o in outs],
        "rel_error": float(np.abs(dev).mean() / np.abs(truth).mean()),
        "wire_bytes": [int(diloco.metrics()[k]) for k in ("wire_fixed_bytes", "wire_coded_bytes")],
    }


def feedback(rank: int, size: int, exchange: str, n: int = 3000, steps: int = 20) -> dict:
    """Error feedback, with the setting of :func:`unbiased` at 2 bits: the decoded averages of ``steps``
    outer steps, summed, plus the average of the ranks' last error buffers telescope to ``steps`` times
    the exact average (what the ranks meant to send, less what their own payloads decoded to, and in
    two-phase what the shard owners' sums lost to the second quantization)."""
    c = np.random.default_rng([22, rank]).standard_normal(n).astype(np.float32) * (1 + rank)
    w = torch.nn.Parameter(torch.zeros(n))
    inner = torch.optim.SGD([w], lr=1.0)
    diloco = DiLoCo(
        torch.nn.ParameterList([w]),
        inner,
        sync_every=1,
        outer_lr=1.0,
        outer_momentum=0.0,
        bits=2,
        bucket_size=128,
        exchange=exchange,
        seed=4,
        error_feedback=True,
    )
    total = np.zeros(n)
    for _ in range(steps):
        with torch.no_grad():
            w.zero_()
            diloco.global_params[0].zero_()
        w.grad = torch.from_numpy(c).clone()
        diloco.step()
        total -= w.detach().double().numpy()
    error = placed_buffers(diloco.state_dict()["exchange"], n)
    return {"c": c, "total": total, "error": error, "steps": steps, "exchange": diloco.metrics()["exchange"]}


def resume(rank: int, **kwargs) -> dict:
    """Save after 2 outer steps (model, inner optimizer, DiLoCo), take the next 2 outer steps, load the
    saved state and take them again: the same parameters, bit for bit."""
    model, inner, diloco = build(**kwargs)
    run(rank, model, inner, diloco, 0, 8)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "inner": inner.state_dict(), "diloco": diloco.state_dict()}, buf)
    first = run(rank, model, inner, diloco, 8, 8)["after_outer"]
    buf.seek(0)
    saved = torch.load(buf, weights_only=False)
    model.load_state_dict(saved["model"])
    inner.load_state_dict(saved["inner"])
    diloco.load_state_dict(saved["diloco"])
    again = run(rank, model, inner, diloco, 8, 8)["after_outer"]
    return {"first": first, "again": again, "outer_steps": diloco.outer_steps}


def mismatch(rank: int, size: int, which: str) -> dict:
    """The last rank builds its DiLoCo with another setting: every rank must raise, none may hang."""
    kwargs = {}
    if rank == size - 1:
        kwargs = {
            "sync_every": dict(sync_every=3),
            "method": dict(method="amq"),
            "bits": dict(bits=4),
            "outer_lr": dict(outer_lr=0.5),
            "global_parameters": dict(init=1),
        }[which]
    model, inner, diloco = build(**{"sync_every": 2, **kwargs})
    try:
        run(rank, model, inner, diloco, 0, 6)
    except Exception as err:  # noqa: BLE001
        return {"raised": True, "message": f"{type(err).__name__}: {err}", "inner_steps": diloco.inner_steps}
    return {"raised": False}


def nonfinite(rank: int, size: int, where: str, exchange: str) -> dict:
    """One clean outer step, then the last rank's local parameters go non-finite (``where``: NaN in
    a quantized weight, Inf in a bias that travels plain) before the second: every rank must raise,
    the global parameters must stay as the first outer step left them."""
    model, inner, diloco = build(sync_every=2, exchange=exchange)
    run(rank, model, inner, diloco, 0, 2)
    before = digest(*diloco.global_params)
    momentum = digest(*diloco.momentum)
    x, y = batch(rank, 2)
    F.cross_entropy(model(x), y).backward()
    diloco.step()
    inner.zero_grad()
    x, y = batch(rank, 3)
    F.cross_entropy(model(x), y).backward()
    if rank == size - 1:  # after the backward: only this coordinate goes non-finite in the inner step
        with torch.no_grad():
            if where == "nan-weight":
                model.fc2.weight[3, 5] = float("nan")
            else:
                model.fc3.bias[1] = float("inf")
    try:
        diloco.step()
        out = {"raised": False}
    except Exception as err:  # noqa: BLE001
        out = {"raised": True, "message": f"{type(err).__name__}: {err}"}
    out.update(
        unchanged=digest(*diloco.global_params) == before and digest(*diloco.momentum) == momentum,
        finite=all(bool(torch.isfinite(g).all()) for g in diloco.global_params),
        outer_steps=diloco.outer_steps,
    )
    return out


def main() -> None:
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    out = {"rank": rank, "size": size}
    out["train"] = {
        "allgather+ef": train(rank, exchange="allgather", bits=2, error_feedback=True),
        "two-phase": train(rank, exchange="two-phase", bits=3),
        "auto": train(rank, bits="auto", bit_budget=2.5, exchange="allgather"),
    }
    out["unbiased"] = {ex: unbiased(rank, size, ex) for ex in ("allgather", "two-phase")}
    out["entropy"] = {  # buckets of 1024: of 128 a bucket's 12 bytes of streams' state cost more than coding saves
        f"{ex}|{wire}": unbiased(rank, size, ex, n=8192, bucket=1024, reps=6, wire=wire)
        for ex in ("allgather", "two-phase")
        for wire in ("fixed", "entropy")
    }
    out["feedback"] = {ex: feedback(rank, size, ex) for ex in ("allgather", "two-phase")}
    out["resume"] = resume(rank, exchange="allgather", bits=2, error_feedback=True, update_steps=(0, 1, 2, 3))
    out["mismatch"] = {
        w: mismatch(rank, size, w) for w in ("sync_every", "method", "bits", "outer_lr", "global_parameters")
    }
    out["nonfinite"] = {
        f"{where}|{ex}": nonfinite(rank, size, where, ex)
        for where in ("nan-weight", "inf-bias")
        for ex in ("allgather", "two-phase")
    }
    report(out)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
