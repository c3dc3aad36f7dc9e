#!/usr/bin/env python
"""The wall-clock time of a FULL FSDP2 training step (forward with FSDP's parameter all-gathers,
backward with its re-gathers and gradient reduce-scatters, AdamW step on the shards) of a small
character-level GPT (scripts/common/gpt.py) on CPU, with FSDP's own float32 and bfloat16 reduce-scatter
and with this package's quantized one (ALQ, 3 bits), on 4 workers in network namespaces with
tc-shaped links (1 Gbit/s, 100 Mbit/s; also ``unshaped``). Needs root (ip netns, tc), except
--local and --help.

    python -m scripts.bench.fsdp                                # 4 workers x 1gbit,100mbit
    python -m scripts.bench.fsdp --rates unshaped,1gbit,100mbit --steps 10
    python -m scripts.bench.fsdp --quick                        # tiny GPT, 1gbit, 2 timed steps
    python -m scripts.bench.fsdp --local --workers 2 --quick    # no namespaces, loopback, no root

The namespaces, links, shaping and the mpirun launch are scripts/bench/network.py's, the launch
and loopback variants scripts/bench/train_step.py's (imported; see their docstrings). No Horovod
and no MPI inside the ranks: mpirun (through bench_network's rsh agent) only starts them; each
takes its rank and size from Open MPI's environment (``OMPI_COMM_WORLD_RANK``/``_SIZE``; torchrun's
``RANK``/``WORLD_SIZE`` also work) and joins a torch.distributed gloo group with rendezvous at
rank 0's address on the namespace interface (``eth0``, 10.213.0.1; ``lo`` with --local), so every
byte FSDP moves crosses the shaped veths.

Model: ``GPT(vocab 103, width, layers, heads, context)`` (defaults 192, 4, 4, 128: 1.84M
parameters), a random batch of --batch-size windows of Python's pydoc text per rank and step
(different per rank, the same for every row of a step). Each block is ``fully_shard``-ed, then
the root (embeddings, final LayerNorm, head), on ``init_device_mesh("cpu", (world,))``, gloo, FSDP's
defaults otherwise (blocks resharded after forward: their parameters are all-gathered in the
forward and again in the backward; the root's once).

Rows, all in the same processes and interleaved (each row takes one step in turn, a barrier
before each, so the machine's noise hits them alike), one model and AdamW (lr --lr,
``foreach=True``: torch's CPU default, the per-tensor loop, costs about 10x more on FSDP's DTensor
shards) per row, all from the same initial weights:

- local: a plain (unsharded) copy, forward + backward + AdamW with no collective at all (the
  compute the others must hide; its AdamW updates the whole model, the FSDP rows' a 1/N shard);
- fsdp-fp32: FSDP2's own reduce-scatter, float32 (default ``MixedPrecisionPolicy()``);
- fsdp-bf16: ``MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)``: FSDP's reduce-scatter in bf16;
- fsdp-alq: ``quantize_reduce_scatter(model, ALQReduceScatter(method="alq", bits=3,
  bucket_size=8192, seed=1))`` (horovod_alq/torch/fsdp.py): bit-packed 3-bit codes, one
  all_to_all per reduce-scatter, one streamed round per backward.

Every row's parameter all-gathers are FSDP's own, float32 (no ``param_dtype``): the same bytes in
every row, uncompressed.

For every row: the median over --steps timed steps (after --warmup) of the slowest rank's step time
(forward + backward + optimizer step; zero_grad outside); the ratios to fsdp-bf16 and fsdp-fp32;
bytes sent per step and rank: the gradient reduce-scatter measured for ALQ (``comm.metrics()
["bytes_sent"]`` over the timed steps, plus (N-1)/N x 4 B per coordinate that went through torch's
own reduce-scatter) and by arithmetic for fp32 / bf16 ((N-1)/N x 4 or 2 B x the padded elements
FSDP reduces), the all-gathers by arithmetic ((N-1)/N x 4 B x padded elements, twice for the
blocks, once for the root), and, in the namespaces, what the rank's eth0 actually transmitted
(``/proc/net/dev`` tx bytes between a barrier before and one after the step: TCP/IP headers and
gloo's framing included); a limit without overlap (local step + eth0 tx bytes / R, R the measured
TCP throughput of a worker link); the mean training loss over the timed steps; and the largest
difference between ranks of any parameter after the run (``full_tensor()`` of each DTensor,
compared with rank 0's: 0 when every rank holds the same model).
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import scripts.bench.network as net  # namespaces, tc, mpirun agent
import scripts.bench.train_step as bts  # launch in the namespaces / on loopback, if_addr, free_port

ROWS = ["local", "fsdp-fp32", "fsdp-bf16", "fsdp-alq"]
LABELS = {
    "local": "fwd+bwd+AdamW alone (unsharded, no collective)",
    "fsdp-fp32": "FSDP2 reduce-scatter fp32",
    "fsdp-bf16": "FSDP2 reduce-scatter bf16 (reduce_dtype)",
    "fsdp-alq": "FSDP2 + ALQReduceScatter(alq, 3 bits, bucket 8192)",
}
FULL = dict(
    workers="4",
    rates="1gbit,100mbit",
    width=192,
    layers=4,
    heads=4,
    context=128,
    batch_size=8,
    steps=10,
    warmup=3,
    timeout=2400.0,
)
QUICK = dict(
    workers="4", rates="1gbit", width=64, layers=2, heads=2, context=64, batch_size=4, steps=2, warmup=1, timeout=600.0
)
PORT = 29400  # rendezvous port in the (fresh) worker namespaces: one per launch from here on


# ---------------------------------------------------------------------------------------- worker
def rank_size() -> tuple[int, int]:
    """This process's rank and the world size from Open MPI's environment (or torchrun's)."""
    env = os.environ
    if "OMPI_COMM_WORLD_RANK" in env:
        return int(env["OMPI_COMM_WORLD_RANK"]), int(env["OMPI_COMM_WORLD_SIZE"])
    return int(env["RANK"]), int(env["WORLD_SIZE"])


def tx_bytes(ifname: str) -> int:
    """Bytes transmitted so far by interface ``ifname`` of this process's network namespace."""
    with open("/proc/net/dev") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name.strip() == ifname:
                return int(rest.split()[8])
    raise KeyError(ifname)


def padded(p, n: int) -> int:
    """Elements of parameter ``p`` as FSDP2 shards it: dim 0 padded to a multiple of ``n``."""
    shape = tuple(p.shape)
    return math.ceil(shape[0] / n) * n * math.prod(shape[1:]) if shape else n


def worker(args) -> int:
    """Runs on every rank: build every row, time the steps, check the parameters, rank 0 writes JSON."""
    import resource

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from horovod_alq.torch.fsdp import ALQReduceScatter, quantize_reduce_scatter
    from scripts.common.gpt import GPT, char_splits, sample_batch

    torch.set_num_threads(1)
    rank, n = rank_size()
    os.environ["GLOO_SOCKET_IFNAME"] = args.gloo_ifname
    if rank == 0 and args.gloo_ifname != "lo" and bts.if_addr(args.gloo_ifname) != args.master_addr:
        raise RuntimeError(
            f"rank 0 is not at {args.master_addr} ({args.gloo_ifname}: "
            f"{bts.if_addr(args.gloo_ifname)}): the hostfile order is not the rank order"
        )
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{args.master_addr}:{args.master_port}",
        rank=rank,
        world_size=n,
        timeout=datetime.timedelta(seconds=args.gloo_timeout),
    )
    mesh = init_device_mesh("cpu", (n,))
    wire = args.gloo_ifname != "lo"  # per-rank interface counters only in the namespaces

    train, _, chars = char_splits()
    keys = args.rows.split(",")
    rows = {}
    for key in keys:
        torch.manual_seed(0)  # the same initial weights in every row and on every rank
        model = GPT(len(chars), args.width, args.layers, args.heads, args.context)
        comm = None
        if key != "local":
            mp = MixedPrecisionPolicy(reduce_dtype=torch.bfloat16) if key == "fsdp-bf16" else MixedPrecisionPolicy()
            for block in model.blocks:
                fully_shard(block, mesh=mesh, mp_policy=mp)
            fully_shard(model, mesh=mesh, mp_policy=mp)
            if key == "fsdp-alq":
                comm = quantize_reduce_scatter(model, ALQReduceScatter(method="alq", bits=3, bucket_size=8192, seed=1))
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, foreach=True)
        rows[key] = {"model": model, "opt": opt, "comm": comm}

    # FSDP's groups: each block's parameters (all-gathered in forward and backward), the root's (once)
    plain = GPT(len(chars), args.width, args.layers, args.heads, args.context)
    params = sum(p.numel() for p in plain.parameters())
    block_el = sum(padded(p, n) for b in plain.blocks for p in b.parameters())
    root_el = sum(padded(p, n) for name, p in plain.named_parameters() if not name.startswith("blocks."))
    share = (n - 1) / n
    gather_bytes = share * 4 * (2 * block_el + root_el)

    def counters(key):
        comm = rows[key]["comm"]
        if comm is None:
            return None
        m = comm.metrics()
        return {
            "bytes_sent": m["bytes_sent"],
            "uncompressed": m["uncompressed_coordinates"],
            "step": m["step"],
            "exchange": m["exchange"],
        }

    gen = torch.Generator().manual_seed(1000 + rank)
    times = {k: [] for k in keys}
    fwd_bwd = {k: [] for k in keys}
    losses = {k: [] for k in keys}
    sent = {k: 0 for k in keys}
    before = {}
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            before = {k: counters(k) for k in keys}
        x, y = sample_batch(train, args.batch_size, args.context, gen)
        for key in keys:
            row = rows[key]
            dist.barrier()
            tx0 = tx_bytes(args.gloo_ifname) if wire else 0
            t0 = time.perf_counter()
            loss = row["model"].loss(x, y)
            loss.backward()
            t1 = time.perf_counter()
            row["opt"].step()
            t2 = time.perf_counter()
            row["opt"].zero_grad()
            if step >= args.warmup:
                times[key].append(t2 - t0)
                fwd_bwd[key].append(t1 - t0)
                losses[key].append(float(loss.detach()))
            if wire:
                dist.barrier()  # every rank's step over: all it sent has crossed the link
                if step >= args.warmup:
                    sent[key] += tx_bytes(args.gloo_ifname) - tx0
        if rank == 0:
            print(f"step {step + 1}/{args.warmup + args.steps} done", flush=True)
    after = {k: counters(k) for k in keys}

    # parameters after all steps: the largest difference to rank 0's (full_tensor() all-gathers the shards)
    diffs = {}
    for key in keys:
        if key == "local":
            continue
        flat = torch.cat([p.full_tensor().detach().reshape(-1) for p in rows[key]["model"].parameters()])
        ref = flat.clone()
        dist.broadcast(ref, 0)
        d = torch.tensor(
            [float((flat - ref).abs().max()) if torch.isfinite(flat).all() else float("inf")], dtype=torch.float64
        )
        dist.all_reduce(d, op=dist.ReduceOp.MAX)
        diffs[key] = float(d)

    per_rank = [None] * n
    dist.all_gather_object(
        per_rank,
        {
            "times": times,
            "fwd_bwd": fwd_bwd,
            "losses": losses,
            "sent": sent,
            "maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        },
    )
    results = {}
    for key in keys:
        slow = [max(r["times"][key][i] for r in per_rank) for i in range(args.steps)]
        slow_fb = [max(r["fwd_bwd"][key][i] for r in per_rank) for i in range(args.steps)]
        res = {
            "label": LABELS[key],
            "step_s": statistics.median(slow),
            "steps_s": slow,
            "fwd_bwd_s": statistics.median(slow_fb),
            "max_param_diff": diffs.get(key),
            "loss": statistics.mean(statistics.mean(r["losses"][key]) for r in per_rank),
            "wire_tx_per_step": ([r["sent"][key] / args.steps for r in per_rank] if wire else None),
        }
        b, a = before.get(key), after[key]
        if key == "local":
            res.update(rs_bytes=0.0, gather_bytes=0.0, rs_how="none")
        elif a is None:
            size = 4 if key == "fsdp-fp32" else 2
            res.update(
                rs_bytes=share * size * (block_el + root_el),
                gather_bytes=gather_bytes,
                rs_how=f"arithmetic: (N-1)/N x {size} B x padded elements",
            )
        else:
            rounds = max(1, a["step"] - b["step"])
            rs = (a["bytes_sent"] - b["bytes_sent"]) / args.steps
            unc = (a["uncompressed"] - b["uncompressed"]) / args.steps
            res.update(
                rs_bytes=rs + share * 4 * unc,
                bytes_sent_per_step=rs,
                uncompressed_per_step=unc,
                rounds_per_step=rounds / args.steps,
                exchange=a["exchange"],
                gather_bytes=gather_bytes,
                rs_how="measured: metrics() bytes_sent + (N-1)/N x 4 B x uncompressed coordinates",
            )
        res["bytes_per_step"] = res["rs_bytes"] + res["gather_bytes"]
        results[key] = res
    if rank == 0:
        Path(args.worker_out).write_text(
            json.dumps(
                {
                    "size": n,
                    "params": params,
                    "param_tensors": len(list(plain.parameters())),
                    "vocab": len(chars),
                    "block_elements": block_el,
                    "root_elements": root_el,
                    "maxrss_mb": max(r["maxrss_mb"] for r in per_rank),
                    "torch": torch.__version__,
                    "results": results,
                }
            )
        )
    dist.destroy_process_group()
    return 0


# ---------------------------------------------------------------------------------------- driver
def worker_args(args, out: Path, ifname: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "scripts.bench.fsdp",
        "--worker",
        "--worker-out",
        str(out),
        "--gloo-ifname",
        ifname,
        "--master-addr",
        args.master_addr,
        "--master-port",
        str(args.master_port),
        "--rows",
        args.rows,
        "--width",
        str(args.width),
        "--layers",
        str(args.layers),
        "--heads",
        str(args.heads),
        "--context",
        str(args.context),
        "--batch-size",
        str(args.batch_size),
        "--lr",
        str(args.lr),
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--gloo-timeout",
        str(args.gloo_timeout),
    ]


def mb(b: float) -> str:
    return f"{b / 1e6:.2f}"


def table(run: dict, rate_Bps: float | None) -> list[str]:
    res = run["results"]
    local = res.get("local", {}).get("step_s")
    lines = []
    if local is not None:
        lines += [
            "Alone (unsharded, no collective, same oversubscription): fwd+bwd "
            f"{bts.ms(res['local']['fwd_bwd_s'])} ms, fwd+bwd+AdamW step {bts.ms(local)} ms (the compute "
            "in the limit).",
            "",
        ]
    lines += [
        "| row | step ms | fwd+bwd ms | vs bf16 | vs fp32 | reduce-scatter MB | all-gathers MB | total MB "
        "| eth0 tx MB (measured) | limit no overlap, ms | step / limit | mean loss "
        "| max param diff across ranks |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    bf16, fp32 = (res.get(k, {}).get("step_s") for k in ("fsdp-bf16", "fsdp-fp32"))
    for key, r in res.items():
        sharded = key != "local"
        cells = [
            r["label"] + (f" [{r['exchange']}]" if r.get("exchange") else ""),
            bts.ms(r["step_s"]),
            bts.ms(r["fwd_bwd_s"]),
            f"{r['step_s'] / bf16:.2f}" if bf16 and sharded else "-",
            f"{r['step_s'] / fp32:.2f}" if fp32 and sharded else "-",
            mb(r["rs_bytes"]),
            mb(r["gather_bytes"]),
            mb(r["bytes_per_step"]),
            mb(statistics.mean(r["wire_tx_per_step"])) if r.get("wire_tx_per_step") else "-",
        ]
        if rate_Bps and local is not None and sharded:
            sent = statistics.mean(r["wire_tx_per_step"]) if r.get("wire_tx_per_step") else r["bytes_per_step"]
            limit = local + sent / rate_Bps
            cells += [bts.ms(limit), f"{r['step_s'] / limit:.2f}"]
        else:
            cells += ["-", "-"]
        cells += [f"{r['loss']:.3f}", "-" if r["max_param_diff"] is None else f"{r['max_param_diff']:.3g}"]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def report(args, argv, runs: list[dict], wall: float) -> str:
    first = runs[0]["run"]
    lines = bts.report_head(
        "# Full FSDP2 training step (forward + backward + reduce-scatter + AdamW): small GPT "
        "on CPU, fp32 / bf16 / ALQ reduce-scatter",
        "scripts.bench.fsdp",
        argv,
        runs,
        wall,
        f"Python {platform.python_version()}, gloo",
        "gloo threads",
        load=" (and with whatever else ran on the machine; the rows are interleaved so it hits them alike)",
    )
    lines += [
        f"Model: GPT(vocab {first['vocab']}, width {args.width}, layers {args.layers}, heads {args.heads}, "
        f"context {args.context}), {first['params']:,} parameters in {first['param_tensors']} tensors "
        f"(blocks {first['block_elements']:,} and root {first['root_elements']:,} elements as FSDP pads "
        f"them on {first['size']} ranks); character-level, batch {args.batch_size} x {args.context} tokens per "
        f"rank; AdamW lr {args.lr:g}. Median over {args.steps} timed steps (after {args.warmup} warm-up) of the "
        "slowest rank's step; rows interleaved, a barrier before each step.",
        "",
    ]
    for r in runs:
        lines += [bts.rate_heading(r), ""] + table(r["run"], r.get("throughput_Bps")) + [""]
    lines += [
        "Columns: step ms = median of the slowest rank's full step; fwd+bwd ms = the same for forward + backward "
        "alone (FSDP's all-gathers and reduce-scatters run inside them); vs bf16 / vs fp32 = the step over "
        "fsdp-bf16's / fsdp-fp32's on the same link; MB per step and rank: reduce-scatter measured for ALQ "
        "(metrics()['bytes_sent'] over the timed steps, plus (N-1)/N x 4 B per coordinate through torch's own "
        "reduce-scatter) and arithmetic for fp32 / bf16 ((N-1)/N x 4 or 2 B x padded elements); all-gathers: "
        "arithmetic, (N-1)/N x 4 B x padded elements, twice for the blocks (forward, backward) and once for the "
        "root, the same in every FSDP row (float32, not compressed); eth0 tx: what the rank's interface sent "
        "between a barrier before and after the step (mean over ranks; TCP/IP headers and gloo framing "
        "included; '-' on loopback); limit no overlap = local step + eth0 tx MB / R (total MB where eth0 tx is "
        "not measured); mean loss: over the timed steps and ranks (the same batches in every row); max param "
        "diff: the largest |parameter - rank 0's| over ranks after all steps, from full_tensor().",
        "",
    ]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", help=f"comma-separated worker counts, 2..8; default {FULL['workers']}")
    p.add_argument("--rates", help=f"tc tbf rates, 'unshaped' = no qdisc; default {FULL['rates']}")
    for k in ("width", "layers", "heads", "context"):
        p.add_argument(f"--{k}", type=int, help=f"GPT {k}; default {FULL[k]}")
    p.add_argument("--batch-size", type=int, help=f"windows per rank and step; default {FULL['batch_size']}")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate; default 1e-3")
    p.add_argument("--steps", type=int, help=f"timed steps per row; default {FULL['steps']}")
    p.add_argument("--warmup", type=int, help=f"untimed steps per row first; default {FULL['warmup']}")
    p.add_argument(
        "--quick",
        action="store_true",
        help="defaults for a check of a minute or two: "
        + ", ".join(f"{k} {v:g}" if isinstance(v, float) else f"{k} {v}" for k, v in QUICK.items()),
    )
    p.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, in this order: {','.join(ROWS)}")
    p.add_argument(
        "--yield-when-idle",
        type=int,
        choices=(0, 1),
        default=1,
        help="Open MPI's (it only launches the ranks here); default 1",
    )
    p.add_argument(
        "--local",
        action="store_true",
        help="no namespaces or shaping: the ranks on this host's loopback (no root needed)",
    )
    p.add_argument(
        "--out",
        help="markdown report (JSON in data/ beside it); default docs/results/bench_fsdp.md, "
        "with --quick build/bench/bench_fsdp.md",
    )
    p.add_argument("--timeout", type=float, help="seconds per mpirun; default 2400 (--quick: 600)")
    p.add_argument("--gloo-timeout", type=float, default=600, help=argparse.SUPPRESS)
    p.add_argument("--teardown-only", action="store_true", help="remove leftover namespaces of scripts.bench.network")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--worker-out", help=argparse.SUPPRESS)
    p.add_argument("--gloo-ifname", default="eth0", help=argparse.SUPPRESS)
    p.add_argument("--master-addr", default=f"{net.SUBNET}.1", help=argparse.SUPPRESS)
    p.add_argument("--master-port", type=int, default=PORT, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for k, v in (QUICK if args.quick else FULL).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.worker:
        return worker(args)
    unknown = [r for r in args.rows.split(",") if r not in ROWS]
    if unknown:
        p.error(f"unknown rows {unknown}; choose from {ROWS}")
    workers = [int(w) for w in args.workers.split(",")]
    if not all(2 <= w <= 8 for w in workers):
        p.error("--workers must be 2..8")
    if args.out is None:
        args.out = "build/bench/bench_fsdp.md" if args.quick else "docs/results/bench_fsdp.md"
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    launches = itertools.count()
    if args.local:
        args.master_addr = "127.0.0.1"

        def run_local(args, tmp, n):
            args.master_port = bts.free_port(args.master_addr)
            return bts.run_local(args, tmp, n, make_args=worker_args)

        runs = bts.sweep_local(args, workers, "alqfsdp-", run_local)
    else:
        status = net.preflight("scripts.bench.fsdp", args.teardown_only, "; --local runs without")
        if status is not None:
            return status

        def run_netns(args, tmp, n, rate):
            args.master_port = PORT + next(launches)  # a fresh port per launch (no TIME_WAIT clash)
            return bts.run_netns(args, tmp, n, rate, make_args=worker_args)

        runs = bts.sweep_netns(args, workers, "alqfsdp-", run_netns)
    bts.write_results(args, argv, runs, out, report(args, argv, bts.sorted_runs(args, runs), time.monotonic() - start))
    return 0


if __name__ == "__main__":
    sys.exit(main())
