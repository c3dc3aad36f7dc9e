#!/usr/bin/env python
"""What users feel: the wall-clock time of a FULL training step (forward, backward, gradient
exchange, optimizer step) of a ResNet-18-shaped CNN computed on CPU, with Horovod and with
PyTorch DDP, on 4 and 8 workers in network namespaces with tc-shaped links (unshaped, 1 Gbit/s,
100 Mbit/s). Needs root (ip netns, tc), except --local and --help.

    python -m scripts.bench.train_step                                # 4,8 workers x unshaped,1gbit,100mbit
    python -m scripts.bench.train_step --quick      # width 0.25, 4 workers, 1gbit and 100mbit, 5 steps
    python -m scripts.bench.train_step --local --workers 2 --quick    # no namespaces, loopback, no root

The namespaces, links, shaping and the mpirun launch (a hostfile of worker addresses and an rsh
agent that runs Open MPI's orted in each worker's namespace; Open MPI's traffic restricted to the
shaped links) are scripts/bench/network.py's, imported from it; see its docstring. Every rank
also joins a torch.distributed gloo group (rendezvous at rank 0's address on --gloo-ifname,
``eth0`` in the namespaces, sent to the other ranks with Horovod), so Horovod's and DDP's
traffic both cross the shaped veths, from the same processes. The full run (6 tables of the
11.2M-parameter model) takes about an hour on 2 cores (estimated, not timed); 8 ranks of it need
about 20 GB (the script compares its estimate with MemAvailable before launching).

Rows, all in the same processes and interleaved (each row takes one step in turn, a barrier
before each, so the machine's noise hits them alike), one model and optimizer per row (same
initial weights, SGD lr 0.01 (momentum 0 by default: memory, see --momentum), the same random batch
every step, a different one per rank):

- local: forward + backward + SGD with no exchange at all (the compute the others must hide);
- Horovod (``hvd.DistributedOptimizer``, MPI CPU operations): fp32 (``hvd.Compression.none``),
  fp16 (``hvd.Compression.fp16``), ``ALQCompressor(bits=3)`` (exchange "auto": two-phase from 4
  ranks on, allgather below), the same with ``fusion_bytes=4 MiB`` (several fusion buffers, so
  the first start during the backward pass), ``exchange="allgather"``, ``exchange="two-phase"``;
- DDP (gloo): default allreduce, ``fp16_compress_hook``, ``powerSGD_hook`` at
  matrix_approximation_rank 2 and 8 (its defaults otherwise: error feedback, warm start,
  min_compression_rate 2, except start_powerSGD_iter=2, the smallest it takes, which --warmup
  covers), ``alq_hook`` with ``ALQState(bits=3)`` (exchange "auto").

PowerSGD on gloo: ``powerSGD_hook`` issues its second and third allreduce from future callbacks,
which gloo runs on its own worker threads when the previous allreduce completes, while the autograd
thread goes on issuing the next DDP bucket's allreduce. Gloo pairs collectives across ranks by a
tag taken when a collective is issued, so with more than one DDP bucket the ranks can issue them in
different orders and pair, e.g., one rank's P allreduce with another's next-bucket allreduce
("Received data size doesn't match expected size", or a hang). The PowerSGD rows therefore run with
one DDP bucket (``bucket_cap_mb`` above the model's size: the hook's three allreduces are then the
only collectives of the backward, issued in the same order everywhere); --powersgd-fix wait keeps
DDP's buckets and waits for each bucket's chain in the hook instead; --powersgd-fix none runs it as
it stands (to reproduce the failure).
(``batched_powerSGD_hook`` also issues its second allreduce from a callback, and in torch 2.13 it
fails before that on every backend: it passes its 2-D Q to ``_orthogonalize``, which asserts a
3-D batch.)

Node layout (--nodes K --ranks-per-node G, or --layout KxG; issue 41): K namespaces ("nodes") of
G consecutive ranks each (Open MPI ``slots=G``, ``--map-by slot``: ``hvd.local_size()`` = G, and
``HOROVOD_ALQ_LOCAL_SIZE=G`` exported for the DDP rows, which read it before torchrun's
LOCAL_WORLD_SIZE); the ranks of a node talk over their namespace's loopback (unshaped), the nodes
over the shaped links. Default rows then: local, Horovod fp32, fp16, fp16 with
HOROVOD_HIERARCHICAL_ALLREDUCE=1 (``hvd-fp16-hier``: a process-wide setting read at ``hvd.init()``,
so it runs in a launch of its own; Horovod 0.28.1 implements hierarchical allreduce for NCCL only,
so on CPU tensors with MPI operations it should change nothing, and the counters check that),
ALQ 3b two-phase (flat), ALQ hierarchical at 3 and 4 bits, ALQ 3b hierarchical two-phase, DDP
fp16_compress_hook, bf16_compress_hook (DDP refuses to register the hook of that name without CUDA
and NCCL, so it is registered under another name; gloo allreduces bfloat16 on CPU), alq_hook
two-phase, hierarchical and hierarchical two-phase (``exchange="auto"`` picks hierarchical across 2
or 3 nodes, hierarchical two-phase from 4: the rows name theirs).
In the namespaces every row also reports the bytes that crossed between namespaces per step, read
from each namespace's eth0 counters (see the columns' note in the report); the default one-rank-
per-namespace layout is unchanged.

For every row: the median over --steps timed steps (after --warmup) of the slowest rank's step
time; the ratio to fp16 (Horovod rows to Horovod fp16, DDP rows to DDP's fp16_compress_hook);
bytes sent per step and rank, measured for the ALQ rows (``metrics()["bytes_sent"]`` over the
timed steps, plus ring arithmetic for the few tensors that travel uncompressed) and for PowerSGD
from its own counters (``total_numel_after_compression``, allreduced in fp32) times a
bandwidth-optimal allreduce's 2(N-1)/N, arithmetic for fp32 and fp16 (2(N-1)/N x 4 or 2 bytes
x parameters); and the ratio of the step to two limits at the measured TCP throughput R of a
worker link: without overlap ``local + bytes / R``, with perfect overlap ``max(local, bytes / R)``.
Last column: the largest difference of any parameter between rank 0 and another rank after all
steps (0 for every exchange that averages correctly).

Where the time goes, a second table per run: CPU time per step and rank (mean over ranks, median
over steps) of the main thread (``time.thread_time``: forward, backward, hooks, codec, optimizer)
and of the process's other threads (Horovod's background thread, Open MPI, gloo, the DDP hook's
decode in gloo's callbacks), and all ranks' CPU over the cores against the step. Open MPI's
yield-when-idle polling counts as CPU time: where ranks share cores the cores are always busy.
"""

import argparse
import datetime
import json
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

import scripts.bench.network as net  # namespaces, tc, mpirun agent

ROOT = Path(__file__).resolve().parents[2]
ROWS = [
    "local",
    "hvd-fp32",
    "hvd-fp16",
    "hvd-fp16-hier",
    "hvd-alq",
    "hvd-alq-f4",
    "hvd-alq-ag",
    "hvd-alq-2p",
    "hvd-alq-h",
    "hvd-alq-h4",
    "hvd-alq-h2p",
    "hvd-alq-e",
    "hvd-alq4-e",
    "ddp-fp32",
    "ddp-fp16",
    "ddp-bf16",
    "ddp-psgd2",
    "ddp-psgd8",
    "ddp-alq",
    "ddp-alq-2p",
    "ddp-alq-h",
    "ddp-alq-h2p",
    "ddp-alq-e",
    "ddp-alq4-e",
]
DEFAULT_ROWS = [
    "local",
    "hvd-fp32",
    "hvd-fp16",
    "hvd-alq",
    "hvd-alq-f4",
    "hvd-alq-ag",
    "hvd-alq-2p",
    "ddp-fp32",
    "ddp-fp16",
    "ddp-psgd2",
    "ddp-psgd8",
    "ddp-alq",
]  # one rank per namespace
NODE_ROWS = [
    "local",
    "hvd-fp32",
    "hvd-fp16",
    "hvd-fp16-hier",
    "hvd-alq-2p",
    "hvd-alq-h",
    "hvd-alq-h4",
    "hvd-alq-h2p",
    "ddp-fp16",
    "ddp-bf16",
    "ddp-alq-2p",
    "ddp-alq-h",
    "ddp-alq-h2p",
]  # the default with --nodes
SEPARATE = {"hvd-fp16-hier": {"HOROVOD_HIERARCHICAL_ALLREDUCE": "1"}}  # rows that need their own launch
LABELS = {
    "local": "fwd+bwd+SGD alone (no exchange)",
    "hvd-fp32": "Horovod fp32 (Compression.none)",
    "hvd-fp16": "Horovod fp16 (Compression.fp16)",
    "hvd-alq": "Horovod ALQCompressor(bits=3), auto",
    "hvd-alq-f4": "Horovod ALQ 3b, auto, fusion_bytes=4 MiB",
    "hvd-alq-ag": "Horovod ALQ 3b, allgather",
    "hvd-alq-2p": "Horovod ALQ 3b, two-phase",
    "hvd-fp16-hier": "Horovod fp16, HOROVOD_HIERARCHICAL_ALLREDUCE=1 (own launch)",
    "hvd-alq-h": "Horovod ALQ 3b, hierarchical",
    "hvd-alq-h4": "Horovod ALQ 4b, hierarchical",
    "hvd-alq-h2p": "Horovod ALQ 3b, hierarchical two-phase",
    "hvd-alq-e": "Horovod ALQ 3b, auto, entropy wire",
    "hvd-alq4-e": "Horovod ALQ 4b, auto, entropy wire",
    "ddp-bf16": "DDP bf16_compress_hook (wrapped, see --help)",
    "ddp-alq-2p": "DDP alq_hook 3b, two-phase",
    "ddp-alq-h": "DDP alq_hook 3b, hierarchical",
    "ddp-alq-h2p": "DDP alq_hook 3b, hierarchical two-phase",
    "ddp-alq-e": "DDP alq_hook 3b, auto, entropy wire",
    "ddp-alq4-e": "DDP alq_hook 4b, auto, entropy wire",
    "ddp-fp32": "DDP allreduce (fp32)",
    "ddp-fp16": "DDP fp16_compress_hook",
    "ddp-psgd2": "DDP powerSGD_hook rank 2",
    "ddp-psgd8": "DDP powerSGD_hook rank 8",
    "ddp-alq": "DDP alq_hook, ALQState(bits=3), auto",
}
FP16_OF = {"hvd": "hvd-fp16", "ddp": "ddp-fp16"}
PSGD_START = 2  # start_powerSGD_iter: the smallest PowerSGDState accepts with error feedback / warm start
FULL = dict(workers="4,8", rates="unshaped,1gbit,100mbit", width=1.0, batch_size=8, steps=5, warmup=3, timeout=3600.0)
QUICK = dict(workers="4", rates="1gbit,100mbit", width=0.25, batch_size=8, steps=5, warmup=3, timeout=600.0)


# ---------------------------------------------------------------------------------------- model
def resnet18(width: float = 1.0, num_classes: int = 10):
    """ResNet-18 in its CIFAR form (3x3 stem, no max-pool, 4 stages of 2 basic blocks, widths c,
    2c, 4c, 8c with c = 64 x width, global average pool, linear), for 3x32x32 inputs: 11,173,962
    parameters at width 1."""
    import torch.nn as nn
    import torch.nn.functional as F

    class Block(nn.Module):
        def __init__(self, cin: int, cout: int, stride: int) -> None:
            super().__init__()
            self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
            self.bn1 = nn.BatchNorm2d(cout)
            self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
            self.bn2 = nn.BatchNorm2d(cout)
            self.shortcut = nn.Sequential()
            if stride != 1 or cin != cout:
                self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

        def forward(self, x):
            out = F.relu(self.bn1(self.conv1(x)))
            return F.relu(self.bn2(self.conv2(out)) + self.shortcut(x))

    c = max(4, round(64 * width))
    layers = [nn.Conv2d(3, c, 3, 1, 1, bias=False), nn.BatchNorm2d(c), nn.ReLU()]
    cin = c
    for i, cout in enumerate((c, 2 * c, 4 * c, 8 * c)):
        layers += [Block(cin, cout, 1 if i == 0 else 2), Block(cout, cout, 1)]
        cin = cout
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, num_classes)]
    return nn.Sequential(*layers)


# ---------------------------------------------------------------------------------------- worker
def if_bytes(name: str) -> tuple[int, int]:
    """(tx_bytes, rx_bytes) of interface ``name`` in this process's network namespace
    (/proc/net/dev: the interface's counters, whole frames)."""
    with open("/proc/net/dev") as f:
        for line in f:
            dev, _, rest = line.partition(":")
            if dev.strip() == name:
                fields = rest.split()
                return int(fields[8]), int(fields[0])
    raise RuntimeError(f"no interface {name!r} in /proc/net/dev")


def if_addr(name: str) -> str:
    """IPv4 address of network interface ``name`` (SIOCGIFADDR)."""
    import fcntl
    import socket
    import struct

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        return socket.inet_ntoa(fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))[20:24])


def free_port(addr: str) -> int:
    import socket

    with socket.socket() as s:
        s.bind((addr, 0))
        return s.getsockname()[1]


def join_gloo(hvd, ifname: str, timeout: float) -> None:
    """torch.distributed (gloo) in the processes Horovod started, over interface ``ifname``: rank 0
    picks its address there and a free port, and Horovod broadcasts them."""
    import torch.distributed as dist

    os.environ["GLOO_SOCKET_IFNAME"] = ifname
    where = None
    if hvd.rank() == 0:
        addr = if_addr(ifname)
        where = (addr, free_port(addr))
    addr, port = hvd.broadcast_object(where, root_rank=0, name="join_gloo.address")
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{addr}:{port}",
        rank=hvd.rank(),
        world_size=hvd.size(),
        timeout=datetime.timedelta(seconds=timeout),
    )


def worker(args) -> int:
    """Runs on every rank: build every row, time the steps, check the parameters, rank 0 writes JSON."""
    import resource

    import horovod
    import horovod.torch as hvd
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
    from torch.nn.parallel import DistributedDataParallel as DDP

    hvd.init()
    torch.set_num_threads(1)
    rank, n = hvd.rank(), hvd.size()
    join_gloo(hvd, args.gloo_ifname, args.gloo_timeout)

    from horovod_alq.torch import ALQCompressor
    from horovod_alq.torch.ddp import ALQState, alq_hook

    def powersgd_wait_hook(state: psgd.PowerSGDState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """powerSGD_hook, its future chain waited for before the backward goes on."""
        fut = psgd.powerSGD_hook(state, bucket)
        fut.wait()
        return fut

    def bf16_hook(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """bf16_compress_hook itself, under another name: DDP refuses to register the hook of that
        name without CUDA and NCCL 2.10+, though gloo allreduces bfloat16 on CPU."""
        return default_hooks.bf16_compress_hook(state, bucket)

    keys = args.rows.split(",")
    g = torch.Generator().manual_seed(1000 + rank)
    x = torch.randn(args.batch_size, 3, 32, 32, generator=g)
    y = torch.randint(0, 10, (args.batch_size,), generator=g)
    rows = {}
    for key in keys:
        torch.manual_seed(0)  # the same initial weights in every row and on every rank
        model = resnet18(args.width)
        sgd = torch.optim.SGD(model.parameters(), lr=0.01, momentum=args.momentum)
        row = {"model": model, "opt": sgd, "state": None}
        if key.startswith("hvd-"):
            comp = {
                "hvd-fp32": hvd.Compression.none,
                "hvd-fp16": hvd.Compression.fp16,
                "hvd-alq": ALQCompressor(bits=3),
                "hvd-alq-f4": ALQCompressor(bits=3, fusion_bytes=4 << 20),
                "hvd-alq-ag": ALQCompressor(bits=3, exchange="allgather"),
                "hvd-alq-2p": ALQCompressor(bits=3, exchange="two-phase"),
                "hvd-fp16-hier": hvd.Compression.fp16,
                "hvd-alq-h": ALQCompressor(bits=3, exchange="hierarchical"),
                "hvd-alq-h4": ALQCompressor(bits=4, exchange="hierarchical"),
                "hvd-alq-h2p": ALQCompressor(bits=3, exchange="hierarchical-two-phase"),
                "hvd-alq-e": ALQCompressor(bits=3, wire="entropy"),
                "hvd-alq4-e": ALQCompressor(bits=4, wire="entropy"),
            }[key]
            # names prefixed by the row: Horovod's response cache never sees one name in two rows
            row["opt"] = hvd.DistributedOptimizer(
                sgd, named_parameters=[(f"{key}.{k}", p) for k, p in model.named_parameters()], compression=comp
            )
            row["state"] = comp if hasattr(comp, "metrics") else None
        elif key.startswith("ddp-"):
            bucket_mb = args.ddp_bucket_mb
            if key.startswith("ddp-psgd") and args.powersgd_fix == "one-bucket":
                bucket_mb = 4 * sum(p.numel() for p in model.parameters()) / 2**20 + 1  # one bucket
            model = row["model"] = DDP(model, bucket_cap_mb=bucket_mb)  # (the SGD above holds the same parameters)
            if key == "ddp-fp16":
                model.register_comm_hook(None, default_hooks.fp16_compress_hook)
            elif key == "ddp-bf16":
                model.register_comm_hook(None, bf16_hook)
            elif key.startswith("ddp-psgd"):
                state = psgd.PowerSGDState(
                    process_group=None, matrix_approximation_rank=int(key[8:]), start_powerSGD_iter=PSGD_START
                )
                model.register_comm_hook(
                    state, powersgd_wait_hook if args.powersgd_fix == "wait" else psgd.powerSGD_hook
                )
                row["state"] = state
            elif key.startswith("ddp-alq"):
                exchange = {"2p": "two-phase", "h": "hierarchical", "h2p": "hierarchical-two-phase"}
                bits, wire = (
                    (4, "entropy") if key == "ddp-alq4-e" else (3, "entropy" if key == "ddp-alq-e" else "fixed")
                )
                exchange = exchange.get(key[len("ddp-alq-") :], "auto")
                row["state"] = ALQState(bits=bits, exchange=exchange, wire=wire)
                model.register_comm_hook(row["state"], alq_hook)
        rows[key] = row
    base = rows[keys[0]]["model"]
    params = sum(p.numel() for p in base.parameters())
    buffers = sum(b.numel() for b in base.buffers())

    def counters(key):
        st = rows[key]["state"]
        if st is None:
            return None
        if isinstance(st, psgd.PowerSGDState):
            return {"numel_after": st.total_numel_after_compression, "numel_before": st.total_numel_before_compression}
        m = st.metrics()
        return {
            "bytes_sent": m["bytes_sent"],
            "uncompressed": m["uncompressed_coordinates"],
            "step": m["step"],
            "exchange": m["exchange"],
            "wire_fixed": m.get("wire_fixed_bytes", 0),
            "wire_coded": m.get("wire_coded_bytes", 0),
        }

    times = {k: [] for k in keys}
    fwd_bwd = {k: [] for k in keys}
    cpu_main = {k: [] for k in keys}  # the main thread's CPU time: compute, hooks, codec, Python
    cpu_all = {k: [] for k in keys}  # the process's: also Horovod's, Open MPI's and gloo's threads
    link = {k: [] for k in keys}  # (tx, rx) of this namespace's --count-ifname, tx of its lo, per timed step
    before = {}
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            before = {k: counters(k) for k in keys}
        for key in keys:
            row = rows[key]
            dist.barrier()
            if args.count_ifname:
                l0 = if_bytes(args.count_ifname) + if_bytes("lo")[:1]
            c0, p0 = time.thread_time(), time.process_time()
            t0 = time.perf_counter()
            F.cross_entropy(row["model"](x), y).backward()
            t1 = time.perf_counter()
            row["opt"].step()
            t2 = time.perf_counter()
            c2, p2 = time.thread_time(), time.process_time()
            # set_to_none (torch's default): this row's gradients are freed until its next step, as
            # a training loop's zero_grad() before the backward would free them (11 rows' gradients
            # held at once would not fit 8 ranks of the full model in this machine's memory)
            row["opt"].zero_grad()
            if args.count_ifname:
                # the row's traffic has ended on every rank after this barrier (its bytes, and the
                # barrier's own, are in the counters read after it); the next row starts after
                # another barrier and another read
                dist.barrier()
                l1 = if_bytes(args.count_ifname) + if_bytes("lo")[:1]
                if step >= args.warmup:
                    link[key].append(tuple(b - a for a, b in zip(l0, l1)))
            if step >= args.warmup:
                times[key].append(t2 - t0)
                fwd_bwd[key].append(t1 - t0)
                cpu_main[key].append(c2 - c0)
                cpu_all[key].append(p2 - p0)
        if rank == 0:
            print(f"step {step + 1}/{args.warmup + args.steps} done", flush=True)
    after = {k: counters(k) for k in keys}

    # parameters after all steps: the largest difference to rank 0's (0 when every rank averaged alike)
    diffs = {}
    for key in keys:
        flat = torch.cat([p.detach().reshape(-1) for p in rows[key]["model"].parameters()])
        ref = flat.clone()
        dist.broadcast(ref, 0)
        d = torch.tensor(
            [float((flat - ref).abs().max()) if torch.isfinite(flat).all() else float("inf")], dtype=torch.float64
        )
        dist.all_reduce(d, op=dist.ReduceOp.MAX)
        diffs[key] = float(d)

    per_rank = hvd.allgather_object(
        {
            "times": times,
            "fwd_bwd": fwd_bwd,
            "cpu_main": cpu_main,
            "cpu_all": cpu_all,
            "local_rank": hvd.local_rank(),
            "local_size": hvd.local_size(),
            "link": link,
            "maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        }
    )
    ring = 2 * (n - 1) / n
    results = {}
    for key in keys:
        slow = [max(r["times"][key][i] for r in per_rank) for i in range(args.steps)]
        slow_fb = [max(r["fwd_bwd"][key][i] for r in per_rank) for i in range(args.steps)]
        res = {
            "label": LABELS[key],
            "step_s": statistics.median(slow),
            "steps_s": slow,
            "fwd_bwd_s": statistics.median(slow_fb),
            "max_param_diff": diffs[key],
            # per step, the mean over ranks; then the median over steps
            "cpu_main_s": statistics.median(
                statistics.fmean(r["cpu_main"][key][i] for r in per_rank) for i in range(args.steps)
            ),
            "cpu_all_s": statistics.median(
                statistics.fmean(r["cpu_all"][key][i] for r in per_rank) for i in range(args.steps)
            ),
        }
        b, a = before.get(key), after[key]
        if key == "local":
            res.update(bytes_per_step=0.0, bytes_how="none")
        elif key.endswith(("fp32", "fp16", "bf16", "fp16-hier")):
            res.update(
                bytes_per_step=ring * (4 if key.endswith("fp32") else 2) * params,
                bytes_how=f"arithmetic: 2(N-1)/N x {4 if key.endswith('fp32') else 2} B x parameters",
            )
        elif "psgd" in key:
            numel = (a["numel_after"] - b["numel_after"]) / args.steps
            res.update(
                bytes_per_step=ring * 4 * numel,
                numel_after_per_step=numel,
                numel_before_per_step=(a["numel_before"] - b["numel_before"]) / args.steps,
                bytes_how="PowerSGD counters: 2(N-1)/N x 4 B x total_numel_after_compression",
            )
        else:
            rounds = max(1, a["step"] - b["step"])
            sent = (a["bytes_sent"] - b["bytes_sent"]) / rounds
            unc = (a["uncompressed"] - b["uncompressed"]) / rounds
            fixed, coded = a["wire_fixed"] - b["wire_fixed"], a["wire_coded"] - b["wire_coded"]
            if fixed > 0:  # wire="entropy": bytes_sent is the fixed wire's; scale by what coding kept
                sent *= coded / fixed
                res.update(coded_over_fixed=coded / fixed)
            res.update(
                bytes_per_step=sent + ring * 4 * unc,
                bytes_sent_per_step=sent,
                uncompressed_per_step=unc,
                exchange=a["exchange"],
                rounds=rounds,
                bytes_how="measured: metrics() bytes_sent (x wire_coded_bytes / wire_fixed_bytes on the entropy "
                "wire) + 2(N-1)/N x 4 B x uncompressed coordinates",
            )
        nodes = [r["link"][key] for r in per_rank if r["local_rank"] == 0]  # one reader per namespace
        if args.count_ifname and nodes:
            steps = len(nodes[0])
            res.update(
                link_tx_per_step=sum(c[0] for node in nodes for c in node) / steps,
                link_rx_per_step=sum(c[1] for node in nodes for c in node) / steps,
                # the busiest node link, the more loaded direction (tbf shapes each direction)
                link_max_per_step=max(max(sum(c[0] for c in node), sum(c[1] for c in node)) for node in nodes) / steps,
                # inside the nodes: their loopbacks (tx = rx there)
                lo_per_step=sum(c[2] for node in nodes for c in node) / steps,
            )
        results[key] = res
    if rank == 0:
        Path(args.worker_out).write_text(
            json.dumps(
                {
                    "size": n,
                    "params": params,
                    "param_tensors": len(list(base.parameters())),
                    "buffers": buffers,
                    "maxrss_mb": max(r["maxrss_mb"] for r in per_rank),
                    "torch": torch.__version__,
                    "horovod": horovod.__version__,
                    "local_size": hvd.local_size(),
                    "nodes": sum(1 for r in per_rank if r["local_rank"] == 0),
                    "results": results,
                }
            )
        )
    dist.destroy_process_group()
    hvd.shutdown()
    return 0


# ---------------------------------------------------------------------------------------- driver
def worker_args(args, out: Path, ifname: str, rows: str | None = None) -> list[str]:
    extra = [] if args.ddp_bucket_mb is None else ["--ddp-bucket-mb", str(args.ddp_bucket_mb)]
    if ifname != "lo":  # in the namespaces: each node's eth0 counters around each row's steps
        extra += ["--count-ifname", ifname]
    return [
        sys.executable,
        "-m",
        "scripts.bench.train_step",
        "--worker",
        "--worker-out",
        str(out),
        "--gloo-ifname",
        ifname,
        "--rows",
        rows or args.rows,
        "--width",
        str(args.width),
        "--batch-size",
        str(args.batch_size),
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--powersgd-fix",
        args.powersgd_fix,
        "--gloo-timeout",
        str(args.gloo_timeout),
        "--momentum",
        str(args.momentum),
        *extra,
    ]


def log_path(args, n: int, rate: str) -> Path:
    """mpirun's output, kept beside the report (data/<out stem>_logs/)."""
    folder = Path(args.out).parent / "data" / f"{Path(args.out).stem}_logs"
    folder.mkdir(parents=True, exist_ok=True)
    return folder / f"mpirun_{n}_{rate}.log"


def run_netns(args, tmp: Path, n: int, rate: str, make_args=None) -> dict:
    """The worker in ``n`` namespaces (``args.ranks_per_node`` ranks in each, default 1);
    ``make_args(args, out, ifname)``: its command line (default :func:`worker_args`). Rows of
    :data:`SEPARATE` run in a launch of their own, with their variables; the results are merged.
    Each launch has a minute to start every rank (else it is killed, named and tried once more)."""
    g = getattr(args, "ranks_per_node", 1) or 1
    if make_args is not None:
        return _launch_netns(args, tmp, n, rate, g, make_args, "", {})
    keys = args.rows.split(",")
    main = [k for k in keys if k not in SEPARATE]
    run = None
    if main:
        run = _launch_netns(
            args, tmp, n, rate, g, lambda a, out, ifname: worker_args(a, out, ifname, ",".join(main)), "", {}
        )
    for key in (k for k in keys if k in SEPARATE):
        # with the step alone of its own launch, so that its ratios can be scaled by the alone steps
        part = _launch_netns(
            args,
            tmp,
            n,
            rate,
            g,
            lambda a, out, ifname: worker_args(a, out, ifname, f"local,{key}"),
            f"_{key}",
            SEPARATE[key],
        )
        part["results"][key]["launch"] = "own launch: " + " ".join(f"{k}={v}" for k, v in SEPARATE[key].items())
        part["results"][key]["own_local_s"] = part["results"]["local"]["step_s"]
        if run is None:
            run = part
        else:
            run["results"][key] = part["results"][key]
            run.setdefault("launch_bytes_separate", {})[key] = part.get("launch_bytes")
    run["results"] = {k: run["results"][k] for k in keys}
    return run


def _launch_netns(args, tmp: Path, n: int, rate: str, g: int, make_args, suffix: str, env: dict) -> dict:
    out = tmp / f"result_{n}_{rate}{suffix}.json"
    full = net.mpirun_command(
        tmp, args.yield_when_idle, n, env=env, ranks_per_node=g, intra=getattr(args, "intra_node", "tcp")
    ) + make_args(args, out, "eth0")
    log = log_path(args, n * g, rate + suffix)
    where = f"{n} nodes x {g} ranks" if g > 1 else f"{n} workers"
    print(f"[{where}, {rate}{suffix}] {shlex.join(full)}\n  (output: {log})", flush=True)
    before = net.link_counters(n)
    rc = net.launch_retry(
        full,
        log,
        args.timeout,
        missing=lambda: net.missing_ranks(n, g),
        connect_timeout=getattr(args, "connect_timeout", net.CONNECT_TIMEOUT),
        cleanup=net.kill_in_namespaces,
    )
    after = net.link_counters(n)
    if rc != 0 or not out.exists():
        raise RuntimeError(f"mpirun failed ({rc}):\n{log.read_text()[-6000:]}")
    run = json.loads(out.read_text())
    # the whole launch's bytes on the node links (start-up, wire-up, warm-up, barriers, results included)
    run["launch_bytes"] = {
        "tx": sum(a[0] - b[0] for a, b in zip(after, before)),
        "rx": sum(a[1] - b[1] for a, b in zip(after, before)),
    }
    return run


def run_local(args, tmp: Path, n: int, make_args=None) -> dict:
    """The same worker on this host's loopback (no namespaces, no shaping, shared memory allowed)."""
    out = tmp / f"result_{n}_local.json"
    from scripts.study.run_accuracy import MPI_OPTIONS  # one host's Open MPI options

    full = ["mpirun", *MPI_OPTIONS, "-np", str(n), "--mca", "mpi_yield_when_idle", str(args.yield_when_idle)]
    for k, v in {
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "HOROVOD_CPU_OPERATIONS": "mpi",
        "PYTHONWARNINGS": "ignore",
        "PYTHONPATH": str(ROOT),
    }.items():
        full += ["-x", f"{k}={v}"]
    full += (make_args or worker_args)(args, out, "lo")
    log = log_path(args, n, "loopback")
    print(f"[{n} workers, loopback] {shlex.join(full)}\n  (output: {log})", flush=True)
    rc = net.launch(full, log, args.timeout)
    if rc != 0 or not out.exists():
        raise RuntimeError(f"mpirun failed ({rc}):\n{log.read_text()[-6000:]}")
    return json.loads(out.read_text())


def memory_check(args, workers: list[int]) -> str | None:
    """None, or why the largest launch would not fit in MemAvailable. Per rank: 0.45 GB (torch,
    Horovod, MPI) plus 15 bytes per parameter and row (parameters, gradients, DDP buckets, hook and
    compressor buffers), 4 more with momentum; measured peaks: 2.35 GB at width 1 with momentum 0,
    2.83 GB with 0.9, 0.68 GB at width 0.25, 11 rows."""
    params = sum(p.numel() for p in resnet18(args.width).parameters())
    rows = len(args.rows.split(","))
    per_rank = 0.45e9 + params * rows * (15 + (4 if args.momentum else 0)) * 1.1
    with open("/proc/meminfo") as f:
        avail = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    need = max(workers) * (getattr(args, "ranks_per_node", 1) or 1) * per_rank
    if need <= avail:
        return None
    return (
        f"{max(workers) * (getattr(args, 'ranks_per_node', 1) or 1)} ranks x about {per_rank / 1e9:.2f} GB "
        f"({params:,} parameters x {rows} rows) = "
        f"{need / 1e9:.1f} GB > {avail / 1e9:.1f} GB available; use --momentum 0, a smaller --width, fewer "
        "--rows or --workers (or --skip-memory-check)"
    )


def ms(s: float) -> str:
    return f"{s * 1e3:.0f}" if s >= 0.1 else f"{s * 1e3:.1f}"


def table(run: dict, rate_Bps: float | None) -> list[str]:
    res = run["results"]
    local = res.get("local", {}).get("step_s")
    lines = []
    if "local" in res:
        lines.append(
            f"Alone (no exchange, same oversubscription): fwd+bwd {ms(res['local']['fwd_bwd_s'])} ms, "
            f"fwd+bwd+SGD step {ms(local)} ms (the compute in the limits)."
        )
        lines.append("")
    links = all("link_tx_per_step" in r for r in res.values())
    nodes = run.get("local_size", 1) > 1 and links  # limits from the counted bytes of the busiest link
    lines += [
        "| row | step ms | fwd+bwd ms | vs fp16 | MB sent / step / rank"
        + (
            " | MB between nodes / step (eth0 tx, all nodes) | busiest node link MB / step"
            " | MB inside nodes / step (lo, all nodes)"
            if links
            else ""
        )
        + " | comm at R, ms | limit no overlap, ms | step / limit | limit overlap, ms | step / limit "
        "| max param diff across ranks |",
        "|---|---:|---:|---:|---:|" + ("---:|---:|---:|" if links else "") + "---:|---:|---:|---:|---:|---:|",
    ]
    for key, r in res.items():
        fam = key.split("-")[0]
        ref = res.get(FP16_OF.get(fam, ""), {}).get("step_s")
        ratio = f"{r['step_s'] / ref:.2f}" if ref and key != "local" else "-"
        cells = [
            r["label"] + (f" [{r['exchange']}]" if r.get("exchange") else ""),
            ms(r["step_s"]),
            ms(r["fwd_bwd_s"]),
            ratio,
            f"{r['bytes_per_step'] / 1e6:.3f}",
        ]
        if links:
            cells += [
                f"{r['link_tx_per_step'] / 1e6:.3f}",
                f"{r['link_max_per_step'] / 1e6:.3f}",
                f"{r['lo_per_step'] / 1e6:.3f}" if "lo_per_step" in r else "-",
            ]
        if rate_Bps and local is not None and key != "local":
            comm = (r["link_max_per_step"] if nodes else r["bytes_per_step"]) / rate_Bps
            no_ov, ov = local + comm, max(local, comm)
            cells += [ms(comm), ms(no_ov), f"{r['step_s'] / no_ov:.2f}", ms(ov), f"{r['step_s'] / ov:.2f}"]
        else:
            cells += ["-"] * 5
        cells.append("-" if key == "local" else f"{r['max_param_diff']:.3g}")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def launch_lines(run: dict) -> list[str]:
    """What the counted rows leave out: the whole launch's bytes on the node links, against the
    sum of the rows' counted steps; [] for a run without counters."""
    res, lb = run["results"], run.get("launch_bytes")
    if not lb or not all("link_tx_per_step" in r for r in res.values()):
        return []
    steps = len(next(iter(res.values()))["steps_s"])
    own = [k for k, r in res.items() if r.get("launch")]
    counted = sum(r["link_tx_per_step"] for k, r in res.items() if k not in own) * steps
    line = (
        f"Whole launch on the node links (eth0 tx of every node, read with `ip -n <ns> -s -j link show "
        f"eth0` before and after mpirun): {lb['tx'] / 1e6:.2f} MB, of which the rows' counted timed "
        f"steps {counted / 1e6:.2f} MB; the rest is start-up (orted, MPI and gloo wire-up), warm-up "
        "steps, DDP's initial broadcast, the barriers between rows, the closing parameter check's broadcasts "
        "and the results' gathering."
    )
    for k in own:
        b = run.get("launch_bytes_separate", {}).get(k)
        if b:
            line += (
                f" {res[k]['label']}: its own launch, {b['tx'] / 1e6:.2f} MB in all, "
                f"{res[k]['link_tx_per_step'] * steps / 1e6:.2f} MB in its counted steps."
            )
        if res[k].get("own_local_s") and "local" in res:
            line += (
                f" Its launch's step alone took {ms(res[k]['own_local_s'])} ms against {ms(res['local']['step_s'])}"
                " ms in this one: compare its step / alone with the other rows'."
            )
    return ["", line]


def cpu_table(run: dict) -> list[str]:
    """Where a row's time goes: CPU time per step and rank, main thread (forward, backward, hooks,
    codec) and the others (Horovod, Open MPI, gloo), against the wall-clock step; [] for a run
    without CPU times (before they were recorded)."""
    res, cores = run["results"], os.cpu_count()
    if not all("cpu_main_s" in r for r in res.values()):
        return []
    local = res.get("local", {}).get("cpu_main_s")
    lines = [
        "CPU time per step and rank (mean over ranks, median over steps) and what the cores allow:",
        "",
        "| row | step ms | main thread CPU ms | main thread CPU over the local row's, ms "
        "| other threads CPU ms | all ranks' CPU / cores, ms | step / that |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for key, r in res.items():
        bound = run["size"] * r["cpu_all_s"] / cores
        extra = "-" if local is None or key == "local" else f"{(r['cpu_main_s'] - local) * 1e3:+.0f}"
        lines.append(
            f"| {r['label']} | {ms(r['step_s'])} | {ms(r['cpu_main_s'])} | {extra} "
            f"| {ms(r['cpu_all_s'] - r['cpu_main_s'])} | {ms(bound)} | {r['step_s'] / bound:.2f} |"
        )
    return [""] + lines


def report_head(
    title: str,
    module: str,
    argv,
    runs: list[dict],
    wall: float,
    versions: str,
    threads: str,
    fewer_ranks: str = "",
    load: str = "",
) -> list[str]:
    """A report's title, command, date and machine lines (this script's and scripts.bench.fsdp's):
    ``versions`` follows the date, ``threads`` names the threads that share the cores,
    ``fewer_ranks`` qualifies a run with no more ranks than cores, ``load`` ends the machine line."""
    first, cores = runs[0]["run"], os.cpu_count()
    cmd = f"python -m {module}" + "".join(f" {shlex.quote(a)}" for a in (argv if argv is not None else sys.argv[1:]))
    workers = sorted({r["workers"] for r in runs})
    return [
        title,
        "",
        f"Command: `{cmd}` ({wall:.0f} s in all).",
        "",
        f"Date: {datetime.datetime.now().strftime('%Y-%m-%d %H:%M')}; torch {first['torch']}, {versions}.",
        "",
        f"Machine: {platform.machine()}, {cores} CPU cores shared by all ranks (and their {threads}): "
        + ", ".join(
            f"{w} ranks on {cores} cores = compute oversubscribed {w / cores:g}x"
            if w > cores
            else f"{w} ranks on {cores} cores{fewer_ranks}"
            for w in workers
        )
        + f", so every step time, the local one included, is that of ranks competing for the cores{load}; "
        f"peak RSS per rank {max(r['run']['maxrss_mb'] for r in runs):.0f} MB.",
        "",
    ]


def rate_heading(r: dict) -> str:
    """The section heading of one (workers, link) run, with the link's measured throughput."""
    head = (
        f"## {r['nodes']} nodes x {r['ranks_per_node']} ranks, {r['rate']}"
        if r.get("nodes")
        else f"## {r['workers']} workers, {r['rate']}"
    )
    if r.get("throughput_Bps"):
        head += f" (measured TCP throughput w0->w1 R = {r['throughput_Bps'] * 8 / 1e6:.0f} Mbit/s)"
    return head


def report(args, argv, runs: list[dict], wall: float) -> str:
    first = runs[0]["run"]
    lines = report_head(
        "# Full training step (forward + backward + exchange + SGD): ResNet-18-shaped CNN on CPU, Horovod and DDP",
        "scripts.bench.train_step",
        argv,
        runs,
        wall,
        f"Horovod {first['horovod']}, Python {platform.python_version()}",
        "Horovod, Open MPI and gloo threads",
        fewer_ranks=" (one core per rank at most)",
    )
    lines += [
        f"Model: ResNet-18 (CIFAR form) at width {args.width}, {first['params']:,} parameters in "
        f"{first['param_tensors']} tensors ({first['buffers']:,} batch-norm buffer elements, which DDP "
        f"broadcasts from rank 0 at every forward and Horovod leaves alone); 3x32x32 inputs, batch "
        f"{args.batch_size} per worker; SGD lr 0.01 momentum {args.momentum:g}. Median over {args.steps} "
        "timed steps "
        f"(after {args.warmup} warm-up) of the slowest rank's step; rows interleaved, a barrier before each "
        f"step. Open MPI mpi_yield_when_idle={args.yield_when_idle}"
        + (
            f", between the ranks of a node {'shared memory (vader)' if args.intra_node == 'shm' else 'TCP over lo'}"
            if getattr(args, "nodes", None)
            else ""
        )
        + ". PowerSGD: start_powerSGD_iter="
        f"{PSGD_START}, "
        + {
            "one-bucket": "one DDP bucket (bucket_cap_mb above the model's size)",
            "wait": "DDP's buckets, each bucket's future chain waited for in the hook",
            "none": "DDP's buckets, the hook as it stands",
        }[args.powersgd_fix]
        + "; the other DDP rows DDP's default buckets"
        + (f" ({args.ddp_bucket_mb} MB)" if args.ddp_bucket_mb else " (25 MB)")
        + ".",
        "",
    ]
    for r in runs:
        lines += (
            [rate_heading(r), ""]
            + table(r["run"], r.get("throughput_Bps"))
            + launch_lines(r["run"])
            + cpu_table(r["run"])
            + [""]
        )
    lines += [
        "Columns: step ms = median of the slowest rank's full step; fwd+bwd ms = the same for the forward "
        "and backward alone (with DDP: its exchange, which ends in the backward; with Horovod: the "
        "exchange started during the backward, finished in optimizer.step()); vs fp16 = Horovod rows over "
        "Horovod fp16, "
        "DDP rows over DDP's fp16_compress_hook; MB between nodes: read from the interface counters of "
        "every worker namespace's eth0 (/proc/net/dev inside it, by the first rank of each namespace) after "
        "a barrier before and after each row's step, summed over namespaces and divided by the timed steps: "
        "whole frames (Ethernet, IP, TCP headers and ACKs), the barrier after the step (gloo) and whatever "
        "else crossed meanwhile (Horovod's background coordination, control vectors) included, nothing "
        "subtracted: the local row shows that floor; busiest node link: the largest of any node's tx or rx; "
        "MB inside nodes: the same from each namespace's lo (the ranks of a node reach each other over it, "
        "unshaped); with several ranks per node the limits below use the busiest node link's bytes; "
        "MB sent: the ALQ rows measured (metrics()['bytes_sent'] "
        "over the timed steps, on the entropy wire times wire_coded_bytes / wire_fixed_bytes, "
        "plus 2(N-1)/N x 4 B per coordinate that travelled uncompressed), PowerSGD "
        "from its counters (2(N-1)/N x 4 B x total_numel_after_compression: its P, Q and uncompressed "
        "tensors are allreduced in fp32), fp32 and fp16 by arithmetic (2(N-1)/N x 4 or 2 B x parameters: a "
        "bandwidth-optimal ring allreduce; Open MPI and gloo may send more); comm at R = bytes / R with R the "
        "measured TCP throughput of one worker link; limit no overlap = local step + comm, limit overlap = "
        "max(local step, comm), 'local step' being the fwd+bwd+SGD row; max param diff: the largest "
        "|parameter - rank 0's| over ranks after all steps. CPU tables: the main thread's CPU time "
        "(time.thread_time: forward, backward, the hooks and compressors, the optimizer step) and the other "
        "threads' (process time less that: Horovod's background thread, Open MPI, gloo; Open MPI's "
        "yield-when-idle polling counts as CPU time, so a long wait on a slow link shows there); all ranks' CPU / "
        "cores = N x process CPU time / cores, the step time if the cores were the only limit.",
        "",
    ]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", help=f"comma-separated worker counts, 2..8; default {FULL['workers']}")
    p.add_argument("--rates", help=f"tc tbf rates, 'unshaped' = no qdisc; default {FULL['rates']}")
    p.add_argument("--width", type=float, help=f"ResNet-18 channel scale; default {FULL['width']}")
    p.add_argument("--batch-size", type=int, help=f"per worker; default {FULL['batch_size']}")
    p.add_argument("--steps", type=int, help=f"timed steps per row; default {FULL['steps']}")
    p.add_argument(
        "--warmup",
        type=int,
        help=f"untimed steps per row first (>= 3 for PowerSGD's steady state); default {FULL['warmup']}",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="defaults for a check of 2-3 minutes: "
        + ", ".join(f"{k} {v:g}" if isinstance(v, float) else f"{k} {v}" for k, v in QUICK.items()),
    )
    p.add_argument(
        "--rows",
        help=f"comma-separated, from {','.join(ROWS)}; default {','.join(DEFAULT_ROWS)}, "
        f"with --nodes {','.join(NODE_ROWS)}",
    )
    p.add_argument(
        "--nodes",
        help="node layout: comma-separated node counts (2..8), each node a namespace of "
        "--ranks-per-node ranks, the nodes joined by the shaped links (instead of "
        "--workers: one rank per namespace)",
    )
    p.add_argument("--ranks-per-node", type=int, help="ranks in each node's namespace; default 2 with --nodes")
    p.add_argument("--layout", help="KxG[,KxG]: --nodes K --ranks-per-node G in one (one G for all)")
    p.add_argument(
        "--intra-node",
        choices=("tcp", "shm"),
        default="tcp",
        help="how Open MPI (the Horovod rows) moves bytes between the ranks of a node: TCP over the "
        "namespace's loopback, or shared memory (vader), as a node's fast links would; gloo (the DDP "
        "rows) always uses TCP; default tcp",
    )
    p.add_argument(
        "--connect-timeout",
        type=float,
        default=60.0,
        help="seconds for every rank of a launch to start; then it is killed, named and retried once; default 60",
    )
    p.add_argument(
        "--powersgd-fix",
        choices=("one-bucket", "wait", "none"),
        default="one-bucket",
        help="how powerSGD_hook is kept in step on gloo (see above); default one-bucket",
    )
    p.add_argument("--ddp-bucket-mb", type=float, help="bucket_cap_mb of the other DDP rows; default DDP's (25)")
    p.add_argument(
        "--momentum",
        type=float,
        default=0.0,
        help="SGD momentum; default 0 (its buffers are one more model copy per row: with 0.9 the "
        "11 rows of the full model take 2.8 GB per rank, 8 ranks more than 23 GB)",
    )
    p.add_argument(
        "--skip-memory-check",
        action="store_true",
        help="launch even if the ranks' estimated memory exceeds MemAvailable",
    )
    p.add_argument("--yield-when-idle", type=int, choices=(0, 1), default=1, help="Open MPI's; default 1")
    p.add_argument(
        "--local",
        action="store_true",
        help="no namespaces or shaping: the ranks on this host's loopback (no root needed)",
    )
    p.add_argument(
        "--out",
        help="markdown report (JSON next to it); default docs/results/bench_train_step.md, "
        "with --quick build/bench/bench_train_step.md",
    )
    p.add_argument("--timeout", type=float, help="seconds per mpirun; default 3600 (--quick: 600)")
    p.add_argument("--gloo-timeout", type=float, default=600, help=argparse.SUPPRESS)
    p.add_argument("--teardown-only", action="store_true", help="remove leftover namespaces of scripts.bench.network")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--worker-out", help=argparse.SUPPRESS)
    p.add_argument("--gloo-ifname", default="eth0", help=argparse.SUPPRESS)
    p.add_argument("--count-ifname", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for k, v in (QUICK if args.quick else FULL).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.layout:
        if args.nodes or args.ranks_per_node:
            p.error("--layout replaces --nodes and --ranks-per-node")
        try:
            pairs = [tuple(int(v) for v in item.lower().split("x")) for item in args.layout.split(",")]
            assert all(len(pair) == 2 for pair in pairs)
        except (ValueError, AssertionError):
            p.error(f"--layout {args.layout!r}: expected KxG[,KxG], e.g. 2x2,4x2")
        if len({g for _, g in pairs}) != 1:
            p.error("--layout: one ranks-per-node G for all layouts")
        args.nodes, args.ranks_per_node = ",".join(str(k) for k, _ in pairs), pairs[0][1]
    if args.nodes:
        if args.ranks_per_node is None:
            args.ranks_per_node = 2
        if args.local:
            p.error("--nodes needs the namespaces (not --local)")
        args.workers = args.nodes  # the namespaces; ranks = nodes x ranks_per_node
    elif args.ranks_per_node not in (None, 1):
        p.error("--ranks-per-node needs --nodes")
    else:
        args.ranks_per_node = 1
    if args.ranks_per_node < 1:
        p.error("--ranks-per-node must be at least 1")
    if args.rows is None:
        args.rows = ",".join(NODE_ROWS if args.nodes else DEFAULT_ROWS)
    if args.worker:
        return worker(args)
    unknown = [r for r in args.rows.split(",") if r not in ROWS]
    if unknown:
        p.error(f"unknown rows {unknown}; choose from {ROWS}")
    workers = [int(w) for w in args.workers.split(",")]
    if not all(2 <= w <= 8 for w in workers):
        p.error("--nodes must be 2..8" if args.nodes else "--workers must be 2..8")
    if any("psgd" in r for r in args.rows.split(",")) and args.warmup < PSGD_START + 1:
        print(
            f"note: --warmup {args.warmup} < {PSGD_START + 1}: PowerSGD's timed steps include its first "
            "(allocating, vanilla) ones",
            file=sys.stderr,
        )
    if args.out is None:
        args.out = "build/bench/bench_train_step.md" if args.quick else "docs/results/bench_train_step.md"
    if not args.skip_memory_check and not args.teardown_only:
        problem = memory_check(args, workers)
        if problem:
            print(f"scripts.bench.train_step: {problem}", file=sys.stderr)
            return 2
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    if args.local:
        runs = sweep_local(args, workers, "alqtrain-", run_local)
    else:
        status = net.preflight("scripts.bench.train_step", args.teardown_only, "; --local runs without")
        if status is not None:
            return status
        runs = sweep_netns(args, workers, "alqtrain-", run_netns)
    write_results(args, argv, runs, out, report(args, argv, sorted_runs(args, runs), time.monotonic() - start))
    return 0


def sweep_local(args, workers: list[int], prefix: str, run) -> list[dict]:
    """``run(args, tmp, n)`` for every worker count on the loopback (no namespaces)."""
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        return [{"workers": n, "rate": "loopback (no namespaces)", "run": run(args, Path(tmp), n)} for n in workers]


def sweep_netns(args, workers: list[int], prefix: str, run) -> list[dict]:
    """``run(args, tmp, n, rate)`` for every rate of ``args.rates`` (the links shaped, their TCP
    throughput measured) and worker count, in the namespaces of scripts.bench.network, removed at the end."""
    runs = []
    try:
        with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
            net.setup(max(workers))
            for rate in args.rates.split(","):
                net.shape(None if rate == "unshaped" else rate, max(workers))
                bps = net.measure_throughput()
                print(f"[{rate}] TCP throughput w0->w1: {bps * 8 / 1e6:.0f} Mbit/s", flush=True)
                for n in workers:
                    result = run(args, Path(tmp), n, rate)
                    g = getattr(args, "ranks_per_node", 1) or 1
                    runs.append(
                        {
                            "workers": n * g,
                            "rate": rate,
                            "throughput_Bps": bps,
                            "run": result,
                            **({"nodes": n, "ranks_per_node": g} if g > 1 else {}),
                        }
                    )
                    print(json.dumps({k: round(r["step_s"], 4) for k, r in result["results"].items()}), flush=True)
    finally:
        left = net.teardown()
        print("teardown:", "all namespaces removed" if not left else f"LEFT {left}", flush=True)
    return runs


def sorted_runs(args, runs: list[dict]) -> list[dict]:
    """By worker count, then in the order of ``args.rates``."""
    rates = args.rates.split(",")
    return sorted(runs, key=lambda r: (r["workers"], rates.index(r["rate"]) if r["rate"] in rates else 0))


def write_results(args, argv, runs: list[dict], out: Path, text: str) -> None:
    """The markdown report at ``out``, the runs as JSON in data/ beside it, the report on stdout."""
    out.write_text(text)
    data = out.parent / "data"
    data.mkdir(parents=True, exist_ok=True)
    (data / out.with_suffix(".json").name).write_text(
        json.dumps(
            {"args": vars(args), "argv": argv if argv is not None else sys.argv[1:], "runs": sorted_runs(args, runs)},
            indent=1,
        )
    )
    print(text)


if __name__ == "__main__":
    sys.exit(main())
