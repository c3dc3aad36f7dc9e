"""Worker for tests/torch/test_precondition_ranks.py: the DDP hook with ``precondition=`` (AdamW's
second moment, a callable), every scenario in one torchrun launch, reported as one dict per rank."""

import copy
import os
import sys

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from common import record_refit_round, refit_fits, replay, report, snapshot
from ddp_worker import batches, make_model, state_for
from helpers import count_fused_encodes, digest

from horovod_alq.core.precondition import Form
from horovod_alq.core.speed import SpeedArbiter
from horovod_alq.torch import Preconditioner
from horovod_alq.torch import ddp as hook_module
from horovod_alq.torch.ddp import alq_hook
from horovod_alq.torch.ops import TorchOps

SCALED: list = []  # elements of each quantized bucket that went scaled
QUANTIZED: list = []  # what each quantized bucket went as (bucket * w, or the bucket), while refit() runs
_bucket_scale = hook_module._bucket_scale


def _recorded(pre, parameters, flat):
    w = _bucket_scale(pre, parameters, flat)
    SCALED.append(0 if w is None else int(w.numel()))
    if QUANTIZED:
        QUANTIZED.append((flat.detach().clone(), None if w is None else w.clone()))
    return w


hook_module._bucket_scale = _recorded

FUSED = count_fused_encodes()  # encodes that formed x * w inside the codec (encode_parts with scales)


def training(rank: int, steps: int = 12, pre: str = "adamw", unfused: bool = False, **kwargs) -> dict:
    """AdamW through the hook with preconditioning: identical parameters on every rank, and the
    handshake's digest field set (nonzero) once AdamW has a second moment. ``unfused``: the codec
    does not form x * w (the hook multiplies and divides itself)."""
    fuses = TorchOps.fuses_scales
    if unfused:
        TorchOps.fuses_scales = property(lambda self: False)
    try:
        return _training(rank, steps, pre, **kwargs)
    finally:
        TorchOps.fuses_scales = fuses


def _training(rank: int, steps: int, pre: str, **kwargs) -> dict:
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    source = opt
    if pre == "callable":  # w from a callable: a fixed per-parameter ramp
        source = Preconditioner(lambda p: torch.linspace(0.5, 2.0, p.numel()).view_as(p), parameters=model.parameters())
    state = state_for("alq", precondition=source, **kwargs)
    model.register_comm_hook(state, alq_hook)
    losses = []
    SCALED.clear()
    FUSED[0] = 0
    for x, y in batches(rank, steps):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {
        "params": digest(*model.parameters()),
        "digest": int(state.round_state.precondition),
        "scaled": list(SCALED),
        "fused": FUSED[0],
        "levels": state.metrics()["levels"].tolist(),
        "loss_first": float(np.mean(losses[:3])),
        "loss_last": float(np.mean(losses[-3:])),
    }


def mismatch(rank: int, size: int) -> dict:
    """After 3 steps the last rank's AdamW state is changed (as a checkpoint loaded on that rank
    only): the next step must raise on every rank, none may hang."""
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = state_for("alq", precondition=opt, timeout=60)
    model.register_comm_hook(state, alq_hook)
    data = batches(rank, 4)
    for x, y in data[:3]:
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    if rank == size - 1:
        for st in opt.state.values():
            st["exp_avg_sq"].mul_(4.0)
    x, y = data[3]
    try:
        F.cross_entropy(model(x), y).backward()
    except Exception as err:  # noqa: BLE001
        return {"raised": True, "message": f"{type(err).__name__}: {err}"}
    return {"raised": False}


def refit(rank: int, steps: int = 4, sixteen_at: int | None = None, delay: int | None = None) -> dict:
    """Refits at steps 0 and 10: step 0 quantizes g (AdamW has no second moment yet) and refits
    from it; step 1, the first preconditioned one, must refit too, from the statistics of the
    scaled buckets. Reports the levels after each step, and fits of the levels before step 1 on
    the statistics of what step 1 quantized (``scaled``) and of the bare buckets (``unscaled``),
    summed over the ranks.

    ``sixteen_at``: ``compress="when-faster"`` with an injected clock under which 16-bit steps cost
    less (every step from 4 on sends 16 bits) and a scheduled refit at step ``sixteen_at``, a
    16-bit one: the same report for that step (``paths``: the steps that were quantized).

    ``delay``: ``Form(refit=delay)``, the refit at step ``1 + delay`` (the same report for that
    step); the model's, optimizer's and hook's state saved after step 1 are then loaded in place
    and steps 2 on run again (``replay``: their levels and refit counts)."""
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    kw = {} if sixteen_at is None else dict(compress="when-faster", update_steps=(0, sixteen_at))
    source = opt if delay is None else Preconditioner(opt, form=Form(refit=delay))
    state = state_for("alq", precondition=source, exchange="allgather", **kw)
    model.register_comm_hook(state, alq_hook)
    now, checked = [0.0], 1 + (delay or 0) if sixteen_at is None else sixteen_at
    if sixteen_at is not None:  # steps 0-1 quantized, a trial of 2 blocks of 2, then 16 bits
        state.round_state.speed = SpeedArbiter(rank=rank, clock=lambda: now[0], warmup=2, block=2, watch=1000)
    ops, out = state._ops_for(torch.device("cpu")), {"levels": [], "updates": []}
    data = batches(rank, steps)
    for i, (x, y) in enumerate(data):
        QUANTIZED[:] = [None]  # on: the hook appends after this marker
        before = copy.deepcopy(state.engine.quantizer)
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        seen = QUANTIZED[1:]
        QUANTIZED.clear()
        record_refit_round(out, state.metrics(), None if sixteen_at is None else state.round_state.speed, now)
        if i == checked:
            out["w_active"] = bool(seen) and all(w is not None for _, w in seen)
            out.update(refit_fits(seen, before, ops, _summed))
        if i == 1 and delay is not None:
            saved = snapshot(model, opt, state)
    if delay is not None:  # resumed after step 1, the planned refit still to come
        out["replay"] = replay(saved, model, opt, state, data[2:])
    return out


def _summed(stats: np.ndarray, key: str) -> np.ndarray:
    total = torch.from_numpy(stats)
    dist.all_reduce(total)
    return total.numpy()


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    out = {"rank": rank, "size": size}
    out["train"] = {
        "allgather": training(rank, exchange="allgather"),
        "allgather-unfused": training(rank, exchange="allgather", unfused=True),
        "two-phase": training(rank, exchange="two-phase"),
        "two-phase-unfused": training(rank, exchange="two-phase", unfused=True),
        "entropy": training(rank, exchange="two-phase", wire="entropy"),
        "feedback+entropy": training(rank, exchange="two-phase", error_feedback=True, wire="entropy"),
        "auto": training(rank, bits="auto", bit_budget=2.5),
        "callable": training(rank, pre="callable"),
    }
    out["refit"] = refit(rank)
    out["refit16"] = refit(rank, steps=9, sixteen_at=7)
    out["refit_late"] = refit(rank, steps=6, delay=2)
    out["mismatch"] = mismatch(rank, size)
    report(out)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # after a hook raised inside backward, leave without the C++ teardown (ddp_worker.py)


if __name__ == "__main__":
    main()
