#!/usr/bin/env python
"""Time one DDP step of a ResNet-50-shaped model through the ALQ communication hook against
DistributedDataParallel's own allreduce, its fp16_compress_hook and its 8-bit quantization hook,
side by side in the same processes (2 gloo ranks on CPU). Run with torchrun:

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 -m scripts.bench.ddp --out build/results/bench_ddp.md
    # the report goes by hand into docs/results/training_steps.md#bench_ddp
    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 -m scripts.bench.ddp --quick

The model: the 161 parameters of torchvision's resnet50 (the shapes of scripts/bench/step.py's
``resnet50_shapes``; 25,557,032 elements), each rank with its own random "gradients" (normal, a
different scale per tensor): the forward is ``sum_p <p, g_p>``, so the backward hands DDP exactly
``g_p``, in buckets of DDP's default 25 MB. One model per row, all wrapped in DDP; the rows run
interleaved, one step each in turn, so the machine's noise hits them alike. A barrier precedes
every step; the step time (forward, backward with DDP's exchange, until every bucket's future is
done) of the slowest rank is recorded (an all_reduce MAX outside the timed region); the table
gives the median over --steps timed steps after --warmup steps. "no exchange" is a hook that
returns the local gradients at once: the step's cost without communication. PyTorch's 8-bit
quantization hook is written against NCCL's all_gather futures; on gloo they run through a
small shim (``_NcclStyleAllGather``: their all_gathers run synchronously, in NCCL's layout).
(``quantization_perchannel_hook`` is left out: it indexes the gathered list as a tensor and fails
with TypeError whatever the backend, and it quantizes row by row in a Python loop.)

The ALQ rows use the defaults (3 bits, bucket 8192) and refit their levels only at step 0
(update_steps=(0,), update_every=0), which the warm-up covers: the steady state.
"""

# no `from __future__ import annotations`: DDP checks the hooks' annotations as objects

import argparse
import cProfile
import datetime
import io
import os
import platform
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, quantization_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from horovod_alq.torch.ddp import ALQState, alq_hook
from scripts.common.bench import numel, resnet50_shapes  # step.py's 161 shapes


class Shaped(torch.nn.Module):
    """Parameters of the given shapes; ``forward(grads)`` is ``sum_p <p, g_p>`` (so the gradient of
    ``p`` is ``g_p``)."""

    def __init__(self, shapes) -> None:
        super().__init__()
        self.params = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(s)) for _, s in shapes])

    def forward(self, grads):
        return sum((p * g).sum() for p, g in zip(self.params, grads))


def no_exchange_hook(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


class _NcclStyleAllGather:
    """What ``quantization_hooks`` sees as ``torch.distributed``: the same module, except that
    ``all_gather`` runs at once and its future holds ``[list of tensors]`` as NCCL's does. On gloo the
    hooks fail as they stand (gloo's future holds the list itself: ``IndexError``), and with only
    the layout fixed they deadlock (they issue the second all_gather from a callback on gloo's
    thread and wait in it); with this shim they run unchanged, their collectives in the hook's
    thread: same quantization, same traffic, no overlap with the backward (as the ALQ hook)."""

    def __getattr__(self, name):
        return getattr(dist, name)

    @staticmethod
    def all_gather(tensor_list, tensor, group=None, async_op=False):
        dist.all_gather(tensor_list, tensor, group=group)
        return _Done([tensor_list]) if async_op else None


class _Done:
    def __init__(self, value) -> None:
        self._value = value

    def get_future(self):
        fut = torch.futures.Future()
        fut.set_result(self._value)
        return fut


quantization_hooks.dist = _NcclStyleAllGather()  # the hooks' module only


def rows(args) -> dict:
    """label -> (state, hook) or None for DDP's default allreduce."""
    steady = dict(bits=args.bits, bucket_size=args.bucket_size, update_steps=(0,), update_every=0, seed=0)
    out = {
        "no exchange (local backward only)": (None, no_exchange_hook),
        "DDP allreduce (fp32)": None,
        "fp16_compress_hook": (None, default_hooks.fp16_compress_hook),
        "quantization_pertensor_hook (8-bit)": (None, quantization_hooks.quantization_pertensor_hook),
        f"alq_hook, {args.bits} bits, allgather": (ALQState(exchange="allgather", **steady), alq_hook),
        f"alq_hook, {args.bits} bits, two-phase": (ALQState(exchange="two-phase", **steady), alq_hook),
    }
    if args.skip:
        out = {k: v for k, v in out.items() if not any(s in k for s in args.skip.split(","))}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = p.add_argument
    add("--steps", type=int, default=7, help="timed steps per row (median); default 7")
    add("--warmup", type=int, default=2, help="untimed steps per row first; default 2")
    add("--width", type=float, default=1.0, help="scale every channel count; default 1")
    add("--bits", type=int, default=3)
    add("--bucket-size", type=int, default=8192)
    add("--skip", default="", help="comma-separated substrings of rows to leave out")
    add("--quick", action="store_true", help="width 0.25, 3 steps, 1 warm-up")
    add("--out", help="rank 0 writes the markdown table here")
    profile = "rows whose label contains this: rank 0 runs their timed steps under cProfile (the hook's thread: "
    profile += (
        "encode, handshake, waits; decodes run on gloo's threads) and the table gains the top functions by own time"
    )
    add("--profile", default="", help=profile)
    args = p.parse_args(argv)
    if args.quick:
        args.width, args.steps, args.warmup = 0.25, 3, 1
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    shapes = resnet50_shapes(args.width)
    g = torch.Generator().manual_seed(1000 + rank)
    grads = [torch.randn(s, generator=g) * float(torch.rand(1, generator=g) * 0.1 + 1e-3) for _, s in shapes]
    models = {}
    for label, spec in rows(args).items():
        model = DDP(Shaped(shapes))
        if spec is not None:
            model.register_comm_hook(*spec)
        models[label] = (model, None if spec is None else spec[0])
    profiles = {label: cProfile.Profile() for label in models if args.profile and args.profile in label}
    times, failed = run_steps(args, models, grads, profiles, rank)
    if rank == 0:
        text = page(args, argv, shapes, models, times, failed, profiles)
        print(text, flush=True)
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(text)
    dist.destroy_process_group()
    return 0


def run_steps(args, models: dict, grads: list, profiles: dict, rank: int) -> tuple[dict, dict]:
    """Every row's steps in turn, a barrier before each: the slowest rank's seconds per timed step
    of each row, and why each row that failed did."""
    times, failed = {label: [] for label in models}, {}
    for step in range(args.warmup + args.steps):
        for label, (model, _) in models.items():
            if label in failed:
                continue
            dist.barrier()
            start = time.perf_counter()
            prof = profiles.get(label) if rank == 0 and step >= args.warmup else None
            try:
                if prof is not None:
                    prof.enable()
                model(grads).backward()
                if prof is not None:
                    prof.disable()
            except Exception as err:  # noqa: BLE001  (a baseline hook that does not run on gloo)
                failed[label] = f"{type(err).__name__}: {str(err).splitlines()[0][:120]}"
                continue
            elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            model.zero_grad(set_to_none=True)
            if step >= args.warmup:
                times[label].append(float(elapsed))
        if rank == 0:
            print(f"step {step + 1}/{args.warmup + args.steps} done", flush=True)
    return times, failed


def page(args, argv, shapes, models: dict, times: dict, failed: dict, profiles: dict) -> str:
    size = dist.get_world_size()
    fp16 = statistics.median(times["fp16_compress_hook"]) if times.get("fp16_compress_hook") else None
    lines = [
        "| exchange (DDP hook) | median ms per step | ratio to fp16 | bits per coordinate |",
        "|---|---:|---:|---:|",
    ]
    for label, (model, state) in models.items():
        if label in failed or not times[label]:
            lines.append(f"| {label} | failed: {failed.get(label, 'no steps')} | | |")
            continue
        med = statistics.median(times[label])
        ratio = f"{med / fp16:.2f}" if fp16 else "-"
        bits = {"DDP allreduce (fp32)": "32", "fp16_compress_hook": "16"}.get(
            label, "8" if "quantization" in label else "-"
        )
        if state is not None:
            bits = f"{state.metrics()['bits_per_coordinate']:.3f}"
        lines.append(f"| {label} | {1000 * med:.1f} | {ratio} | {bits} |")
    header = [
        "# DDP communication hooks: one ResNet-50-shaped step",
        "",
        f"Command: `OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node {size} -m scripts.bench.ddp"
        + "".join(f" {a}" for a in (argv if argv is not None else sys.argv[1:]))
        + "`",
        "",
        f"Date: {datetime.date.today().isoformat()}; {size} gloo ranks on one host "
        f"({platform.machine()}, {os.cpu_count()} CPUs, shared); torch {torch.__version__}; "
        f"{len(shapes)} tensors, {sum(numel(s) for _, s in shapes):,} elements (width {args.width}); median of "
        f"{args.steps} steps after {args.warmup} warm-up steps; the slowest rank's step, rows interleaved.",
        "",
    ]
    for label, prof in profiles.items():
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(15)
        body = buf.getvalue()
        body = body[body.find("ncalls") :] if "ncalls" in body else body
        title = f"Profile of rank 0's hook thread, {label}, {args.steps} timed steps (cProfile, by own time):"
        lines += ["", title, "", "```", body.rstrip(), "```"]
    return "\n".join(header + lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
