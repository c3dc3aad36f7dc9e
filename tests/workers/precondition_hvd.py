"""Worker for tests/torch/test_precondition_hvd.py: the Horovod PyTorch compressor with
``precondition=`` under hvd.DistributedOptimizer (AdamW), reported as one dict per rank."""

import copy

import horovod.torch as hvd
import numpy as np
import torch
import torch.nn.functional as F
from common import record_refit_round, refit_fits, replay, report, snapshot
from helpers import count_fused_encodes, digest

from horovod_alq.core.precondition import Form
from horovod_alq.core.speed import SpeedArbiter
from horovod_alq.torch import ALQCompressor, Preconditioner
from horovod_alq.torch.ops import TorchOps

FUSED = count_fused_encodes()  # encodes that formed x * w inside the codec (encode_parts with scales)


def model_and_data(rank: int, steps: int):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.Tanh(), torch.nn.Linear(128, 4))
    teacher = torch.randn(32, 4, generator=torch.Generator().manual_seed(123))
    g = torch.Generator().manual_seed(1000 + rank)
    data = []
    for _ in range(steps):
        x = torch.randn(32, 32, generator=g)
        data.append((x, (x @ teacher).argmax(1)))
    return model, data


def run(rank: int, size: int, steps: int, *args, unfused: bool = False, **kwargs) -> dict:
    """``unfused``: the codec does not form x * w (the compressor multiplies and divides itself)."""
    fuses = TorchOps.fuses_scales
    if unfused:
        TorchOps.fuses_scales = property(lambda self: False)
    FUSED[0] = 0
    try:
        return {**_run(rank, size, steps, *args, **kwargs), "fused": FUSED[0]}
    finally:
        TorchOps.fuses_scales = fuses


def _run(rank: int, size: int, steps: int, perturb_at: int | None = None, bits=3, **settings) -> dict:
    model, data = model_and_data(rank, steps)
    base = torch.optim.AdamW(model.parameters(), lr=1e-2)
    kw = dict(bucket_size=256, min_size=64, seed=7, compress="always", precondition=base)
    comp = ALQCompressor(bits=bits, named_parameters=model.named_parameters(), **kw, **settings)
    opt = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters(), compression=comp)
    scaled, find = set(), comp._precondition.for_gradient

    def recorded(tensor):  # the shapes of the gradients that went scaled
        w = find(tensor)
        if w is not None:
            scaled.add(tuple(tensor.shape))
        return w

    comp._precondition.for_gradient = recorded
    losses = []
    try:
        for i, (x, y) in enumerate(data):
            if i == perturb_at and rank == size - 1:  # as a checkpoint loaded on this rank only
                for st in opt.state.values():
                    st["exp_avg_sq"].mul_(4.0)
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
    except Exception as err:  # noqa: BLE001
        return {"raised": True, "message": f"{type(err).__name__}: {err}", "at": len(losses)}
    return {
        "raised": False,
        "params": digest(*model.parameters()),
        "digest": int(comp._state.precondition),
        "followed": comp._precondition.optimizer is opt,
        "scaled": sorted(scaled),
        "loss_first": float(np.mean(losses[:3])),
        "loss_last": float(np.mean(losses[-3:])),
    }


def refit(rank: int, size: int, steps: int = 4, sixteen_at: int | None = None, delay: int | None = None) -> dict:
    """The default refit schedule (rounds 0, 100, ...): round 0 quantizes g (AdamW has no second
    moment yet) and refits from it; round 1, the first preconditioned round, must refit too, from
    the statistics of g * w. Reports the levels after each round, and fits of the levels before
    round 1 on the statistics of what round 1 quantized (``scaled``) and of the bare gradients
    (``unscaled``), summed over the ranks.

    ``sixteen_at``: ``compress="when-faster"`` with an injected clock under which 16-bit rounds
    cost less, so that from round 4 on every round sends 16 bits, and a scheduled refit at round
    ``sixteen_at`` (a 16-bit round): the same report for that round (``paths``: the rounds that
    were quantized).

    ``delay``: ``Form(refit=delay)``, the refit in round ``1 + delay`` (the same report for that
    round); the model's, optimizer's and compressor's state saved after round 1 are then loaded in
    place and rounds 2 on run again (``replay``: their levels and refit counts)."""
    model, data = model_and_data(rank, steps)
    base = torch.optim.AdamW(model.parameters(), lr=1e-2)
    kw = dict(bucket_size=128, min_size=64, seed=7, compress="always", exchange="allgather")
    if sixteen_at is not None:
        kw.update(compress="when-faster", update_steps=(0, sixteen_at), update_every=0)
    source = base if delay is None else Preconditioner(base, form=Form(refit=delay))
    comp = ALQCompressor(bits=3, precondition=source, **kw)  # 4096, 128, 512 elements: whole buckets, no padding
    opt = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters(), compression=comp)
    now, checked = [0.0], 1 + (delay or 0) if sixteen_at is None else sixteen_at
    if sixteen_at is not None:  # rounds 0-1 quantized, a trial of 2 blocks of 2, then 16 bits
        comp._state.speed = SpeedArbiter(rank=rank, clock=lambda: now[0], warmup=2, block=2, watch=1000)
    seen, find = [], comp._precondition.for_gradient

    def recorded(tensor):  # what the round quantizes: g * w, or g where w is the identity
        w = find(tensor)
        seen.append((tensor.detach().reshape(-1).clone(), None if w is None else w.reshape(-1).clone()))
        return w

    comp._precondition.for_gradient = recorded
    ops, out = comp._ops_for(torch.device("cpu")), {"levels": [], "updates": []}
    for i, (x, y) in enumerate(data):
        seen.clear()
        before = copy.deepcopy(comp._quantizer)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        record_refit_round(out, comp.metrics(), None if sixteen_at is None else comp._state.speed, now)
        if i == checked:
            out["w_active"] = all(w is not None for _, w in seen) and len(seen) == 3
            out.update(refit_fits(seen, before, ops, _summed))
        if i == 1 and delay is not None:
            saved = snapshot(model, opt, comp)
    if delay is not None:  # resumed after round 1, the planned refit still to come
        out["replay"] = replay(saved, model, opt, comp, data[2:])
    return out


def _summed(stats: np.ndarray, key: str) -> np.ndarray:
    return hvd.allreduce(torch.from_numpy(stats), op=hvd.Sum, name=f"refit.{key}").numpy()


def main() -> None:
    hvd.init()
    torch.set_num_threads(1)
    rank, size = hvd.rank(), hvd.size()
    out = {"rank": rank, "size": size}
    out["allgather"] = run(rank, size, 15, exchange="allgather")
    out["allgather-unfused"] = run(rank, size, 15, exchange="allgather", unfused=True)
    out["two-phase"] = run(rank, size, 15, exchange="two-phase", wire="entropy")
    out["two-phase-unfused"] = run(rank, size, 15, exchange="two-phase", wire="entropy", unfused=True)
    out["auto"] = run(rank, size, 15, bits="auto", bit_budget=2.5)
    out["feedback"] = run(rank, size, 15, exchange="two-phase", error_feedback=True)
    out["mismatch"] = run(rank, size, 6, perturb_at=3, timeout=60)
    out["refit"] = refit(rank, size)
    out["refit16"] = refit(rank, size, steps=9, sixteen_at=7)
    out["refit_late"] = refit(rank, size, steps=6, delay=2)
    report(out)


if __name__ == "__main__":
    main()
