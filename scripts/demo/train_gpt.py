#!/usr/bin/env python
"""Train the character-level GPT of scripts/common/gpt.py on Python's own English text (pydoc topics,
about 465k characters; no downloads), data-parallel, with one or more gradient exchanges in turn,
and report the held-out loss (and bits per character) of each on rank 0.

    mpirun -np 4 python -m scripts.demo.train_gpt --methods alq@3,qsgdinf@3,none
    mpirun -np 4 python -m scripts.demo.train_gpt --methods psgd2,psgd-match,fp16 --steps 300 --json out.json

A method is ``name``, ``name@bits``, ``name@auto<budget>`` (``alq@auto2.5``: ``bits="auto"``,
``bit_budget=2.5``, a width per tensor chosen at every refit) or ``name@bucket<budget>``
(``bits_per="bucket"``: a width per bucket of every payload; Horovod path, ALQ and AMQ forms only):
- Horovod (``hvd.DistributedOptimizer`` around AdamW): the quantized methods of scripts/demo/train.py
  (alq, alq-n, amq, amq-n, qsgdinf, qsgd, nuqsgd, terngrad; with -l2/-linf and -ag/-2p suffixes),
  ``none`` (fp32) and ``fp16`` (Horovod's compressors);
- DDP over gloo in the same processes (torch.distributed is initialized beside Horovod, its address
  broadcast by Horovod): ``psgd<r>`` is ``powerSGD_hook`` at matrix_approximation_rank r (error
  feedback and warm start, its defaults; start_powerSGD_iter=2, so every step after the first two is
  compressed; one DDP bucket, the configuration in which it runs correctly on gloo, see
  scripts/bench/train_step.py), ``psgd-match`` the rank whose bytes per step are closest to the
  3-bit quantized payload of this model (``matched_rank``); ``ddp-alq@b`` the DDP hook ``alq_hook``.
``+ef`` appended to a quantized method (``alq@3+ef``) turns on ``error_feedback``.

Every method starts from the same model (``--seed``), sees the same batches on each rank (seeded
by ``--seed`` and the rank) and rounds with ``--seed``: runs of one seed differ only in the
exchange, so their differences are paired. AdamW with linear warm-up and cosine decay; the
evaluation loss is measured by rank 0 every ``--eval-every`` steps on fixed held-out windows.
"""

from __future__ import annotations

import argparse
import json
import math
import socket
import sys
import time
from pathlib import Path

import torch

from scripts.common.demo import ADAPTIVE, BASELINES, QUANTIZED, split_exchange, split_norm
from scripts.common.gpt import (  # noqa: F401 (the studies and tests find these here too)
    GPT,
    char_splits,
    evaluate,
    lr_at,
    make_optimizer,
    matched_rank,
    powersgd_bytes,
    quantized_bytes,
    sample_batch,
)

PSGD_START = 2  # start_powerSGD_iter: the smallest PowerSGDState takes with error feedback and warm start


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--methods",
        default="alq@3,none",
        help="comma-separated name[@bits] or name@auto<budget> (alq@auto2.5), run in turn",
    )
    p.add_argument("--steps", type=int, default=300, help="optimizer steps; default 300")
    p.add_argument("--batch-size", type=int, default=16, help="sequences per worker and step; default 16")
    p.add_argument("--context", type=int, default=64, help="characters per sequence; default 64")
    p.add_argument("--width", type=int, default=128, help="default 128")
    p.add_argument("--layers", type=int, default=4, help="default 4")
    p.add_argument("--heads", type=int, default=4, help="default 4")
    p.add_argument(
        "--optimizer",
        default="adamw",
        choices=("adamw", "adamw-frozen", "sgd"),
        help="AdamW (betas 0.9, 0.95), the same with its second moment frozen after the warm-up "
        "(1-bit Adam's schedule), or SGD with momentum 0.9; default adamw",
    )
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate; default 3e-3 (AdamW's)")
    p.add_argument("--weight-decay", type=float, default=0.1, help="default 0.1 (decoupled with AdamW)")
    p.add_argument("--warmup", type=int, default=30, help="linear warm-up steps; default 30")
    p.add_argument("--bucket-size", type=int, default=8192, help="coordinates per norm; default 8192")
    p.add_argument("--min-size", type=int, default=1024, help="smaller tensors travel uncompressed")
    p.add_argument("--update-steps", default="0,100,2000", help="steps whose statistics refit the levels")
    p.add_argument("--update-every", type=int, default=10000, help="then refit every this many steps")
    p.add_argument("--eval-every", type=int, default=50, help="evaluation-loss curve period; default 50")
    p.add_argument("--eval-windows", type=int, default=256, help="held-out windows per evaluation; default 256")
    p.add_argument("--seed", type=int, default=0, help="model, data order and rounding seed; default 0")
    p.add_argument("--json", help="rank 0 writes the results here")
    return p.parse_args(argv)


def parse_method(spec: str) -> tuple[str, int | str | None, float | None]:
    """(name, bits, bit_budget): ``"alq@2"`` -> ``("alq", 2, None)``; ``"none"`` -> ``("none", None, None)``;
    ``"alq@auto2.5"`` -> ``("alq", "auto", 2.5)`` (ALQ/AMQ forms through Horovod only). SystemExit on
    an unknown name, bad bits or budget, or ``auto`` where it does not apply."""
    name, _, bits = spec.partition("@")
    known = name in QUANTIZED + BASELINES or name == "psgd-match" or (name.startswith("psgd") and name[4:].isdigit())
    if name.startswith("ddp-"):
        known = name[4:] in QUANTIZED
    if not known:
        raise SystemExit(
            f"unknown method {name!r}: a quantized method ({', '.join(QUANTIZED[:8])}, ...), "
            f"none, fp16, psgd<rank>, psgd-match or ddp-<quantized method>"
        )
    if bits.startswith(("auto", "bucket")):
        kind = "auto" if bits.startswith("auto") else "bucket"
        if name not in QUANTIZED or split_norm(name)[0] not in ADAPTIVE:
            raise SystemExit(
                f"{spec!r}: bits='auto' is for the Horovod compressors of {', '.join(ADAPTIVE)} "
                f"(with their -l2/-linf/-ag/-2p forms), not {name!r}"
            )
        from horovod_alq.core.auto_bits import check_budget

        try:
            return name, kind, check_budget(float(bits[len(kind) :]))
        except ValueError as exc:
            raise SystemExit(f"{spec!r}: name@auto<budget> with a budget from 2 to 8 (alq@auto2.5): {exc}") from None
    if bits and not bits.isdigit():
        raise SystemExit(f"{spec!r}: bits must be an integer or auto<budget> (alq@3, alq@auto2.5)")
    return name, int(bits) if bits else None, None


def make_run(
    name: str,
    bits: int | str | None,
    args,
    vocab: int,
    hvd,
    bit_budget: float | None = None,
    feedback: bool = False,
):
    """(model to call, model whose parameters are evaluated, optimizer, state with metrics or None, extra record).
    ``bits="auto"`` takes ``bit_budget`` (parse_method); ``feedback``: ``error_feedback=True``."""
    from horovod_alq import torch as alq

    torch.manual_seed(args.seed)  # the same initial model on every rank and in every run
    model = GPT(vocab, args.width, args.layers, args.heads, args.context)
    optimizer = make_optimizer(model, args)
    steps = tuple(int(s) for s in args.update_steps.split(",") if s.strip())
    kw = dict(
        bits=bits or 3,
        bucket_size=args.bucket_size,
        update_steps=steps,
        update_every=args.update_every,
        min_size=args.min_size,
        seed=args.seed,
        **({"bit_budget": bit_budget} if bits == "auto" else {}),
        **({"error_feedback": True} if feedback else {}),
    )
    if bits == "bucket":  # name@bucket<budget>: widths per bucket
        kw.update(bits="auto", bit_budget=bit_budget, bits_per="bucket")
    extra = {}
    if name in QUANTIZED or name in BASELINES:
        if name == "none":
            comp = hvd.Compression.none
        elif name == "fp16":
            comp = hvd.Compression.fp16
        else:
            base, norm = split_norm(name)
            exchange = split_exchange(name)[1]
            comp = alq.compressor_for(
                base, **kw, **({"norm": norm} if norm else {}), **({"exchange": exchange} if exchange else {})
            )
        opt = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(), compression=comp)
        return model, model, opt, comp if hasattr(comp, "metrics") else None, extra
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
    from torch.nn.parallel import DistributedDataParallel as DDP

    one_bucket = 4 * sum(p.numel() for p in model.parameters()) / 2**20 + 1
    ddp = DDP(model, bucket_cap_mb=one_bucket if name.startswith("psgd") else 25)
    if name.startswith("psgd"):
        r = matched_rank(model, 3, args.bucket_size, args.min_size) if name == "psgd-match" else int(name[4:])
        state = psgd.PowerSGDState(
            process_group=None, matrix_approximation_rank=r, start_powerSGD_iter=PSGD_START, random_seed=args.seed
        )
        ddp.register_comm_hook(state, psgd.powerSGD_hook)
        extra["rank"] = r
    else:
        from horovod_alq.torch.ddp import ALQState, alq_hook

        base, norm = split_norm(name[4:])
        state = ALQState(
            None, base, **kw, **({"norm": norm} if norm else {}), exchange=split_exchange(name[4:])[1] or "auto"
        )
        ddp.register_comm_hook(state, alq_hook)
    return ddp, model, optimizer, state, extra


def split_feedback(spec: str) -> tuple[str, bool]:
    """``"alq@3+ef"`` -> ``("alq@3", True)``: the ``+ef`` suffix turns on ``error_feedback``."""
    base, ef, tail = spec.partition("+ef")
    if tail:
        raise SystemExit(f"{spec!r}: +ef takes nothing after it here (+ef<step>: scripts.study.feedback_switches)")
    return base, bool(ef)


def sent_bits(name: str, state) -> float:
    """Bits per coordinate a rank put into its exchange (the payload; a ring allreduce sends about
    twice that, allgather and two-phase per their design)."""
    if name == "none":
        return 32.0
    if name == "fp16":
        return 16.0
    if hasattr(state, "total_numel_after_compression"):  # PowerSGD: counters of compressed steps
        return 32.0 * state.total_numel_after_compression / max(1, state.total_numel_before_compression)
    m = state.metrics()
    coords = m["coordinates"] + m["uncompressed_coordinates"]
    return (m["bits_per_coordinate"] * m["coordinates"] + 32.0 * m["uncompressed_coordinates"]) / max(1, coords)


def train(spec: str, args, data, hvd) -> dict:
    base, feedback = split_feedback(spec)
    name, bits, bit_budget = parse_method(base)
    if feedback and name not in QUANTIZED and not (name.startswith("ddp-") and name[4:] in QUANTIZED):
        raise SystemExit(f"{spec!r}: +ef (error feedback) is for the quantized methods")
    train_ids, val_ids, chars = data
    rank = hvd.rank()
    model, plain, opt, state, extra = make_run(name, bits, args, len(chars), hvd, bit_budget, feedback)
    generator = torch.Generator().manual_seed(args.seed * 1000 + rank)
    curve, losses, moments = [], [], []
    start = time.perf_counter()
    for step in range(args.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args)
        x, y = sample_batch(train_ids, args.batch_size, args.context, generator)
        opt.zero_grad()
        loss = (
            model.loss(x, y)
            if model is plain
            else torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        )
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if rank == 0 and ((step + 1) % args.eval_every == 0 or step + 1 == args.steps):
            curve.append([step + 1, evaluate(plain, val_ids, args)])
            moment = second_moment(opt)
            if moment is not None:
                moments.append([step + 1, moment])
    seconds = time.perf_counter() - start
    params = sum(p.numel() for p in plain.parameters())
    worst = hvd.allreduce(
        torch.tensor([max(abs(p.detach()).max().item() for p in plain.parameters())]),
        op=hvd.Max,
        name=f"train_gpt.check.{spec}",
    )  # pairs ranks before the next run
    out = {
        "method": name,
        "spec": spec,
        "bits": bits,
        "bucket_size": args.bucket_size if bits else None,
        "eval_loss": curve[-1][1] if curve else None,
        "curve": curve,
        "train_loss_last50": sum(losses[-50:]) / len(losses[-50:]),
        "seconds_per_step": seconds / args.steps,
        "bits_per_coordinate": sent_bits(name, state),
        "params": params,
        "max_abs_param": float(worst),
        **extra,
    }
    if moments:  # Adam's mean second moment at each evaluation: what noise in the gradients inflates
        out["second_moment"] = moments
    if curve:
        out["eval_bpc"] = curve[-1][1] / math.log(2)
    if state is not None and hasattr(state, "metrics"):
        m = state.metrics()
        out.update(
            levels=[float(v) for v in m["levels"]],
            level_updates=m["level_updates"],
            exchange=m.get("exchange"),
            compressed_bits_per_coordinate=m["bits_per_coordinate"],
        )
        if bits == "auto":  # the last refit's width per tensor (in the round's order) and their mean
            out.update(
                bit_budget=m["bit_budget"],
                allocation=[int(b) for b in m["allocation"]],
                allocated_mean_bits=float(m["allocated_mean_bits"]),
                allocation_elements=[int(k[0]) for k in state.state_dict()["auto"]["keys"]],
            )
        if bits == "bucket":
            out.update(bit_budget=m["bit_budget"], bits_per=m["bits_per"])
    if not math.isfinite(out["train_loss_last50"]):
        out["diverged"] = True
    return out


def second_moment(opt) -> float | None:
    """The mean of AdamW's second-moment estimate over every parameter coordinate (None for SGD)."""
    total, count = 0.0, 0
    for st in opt.state.values():
        v = st.get("exp_avg_sq")
        if v is not None:
            total, count = total + float(v.double().sum()), count + v.numel()
    return total / count if count else None


def init_gloo(hvd, dist) -> None:
    """torch.distributed (gloo over loopback) in the processes Horovod started: rank 0 picks a port
    and Horovod broadcasts it."""
    port = None
    if hvd.rank() == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    port = hvd.broadcast_object(port, root_rank=0, name="train_gpt.gloo_port")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=hvd.rank(), world_size=hvd.size())


def main(argv=None) -> int:
    args = parse_args(argv)
    specs = [s.strip() for s in args.methods.split(",") if s.strip()]
    names = [parse_method(split_feedback(s)[0])[0] for s in specs]
    import horovod.torch as hvd
    import torch.distributed as dist

    hvd.init()
    torch.set_num_threads(1)
    if any(n.startswith(("psgd", "ddp-")) for n in names):
        init_gloo(hvd, dist)
    data = char_splits()
    results = []
    for spec in specs:
        r = train(spec, args, data, hvd)
        results.append(r)
        if hvd.rank() == 0:
            print(
                f"{spec:>12}  eval loss {r['eval_loss']:.4f}  ({r['eval_bpc']:.3f} bits/char)  "
                f"{r['bits_per_coordinate']:.2f} bits/coord sent  {r['seconds_per_step'] * 1e3:.0f} ms/step",
                flush=True,
            )
    if hvd.rank() == 0 and args.json:
        Path(args.json).write_text(
            json.dumps({"args": vars(args), "workers": hvd.size(), "results": results}, indent=2)
        )
    if dist.is_initialized():
        dist.destroy_process_group()
    hvd.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
