#!/usr/bin/env python
"""Wall clock of a full FSDP2 training step of the character GPT on CPU: FSDP's float32 and
bfloat16 reduce-scatter against ``quantize_reduce_scatter`` (ALQ 3 bits), on gloo workers in
network namespaces with tc-shaped links (needs root, except --local and --help). Rows and runs:
docs/results/training_steps.md#bench_fsdp.

    python -m scripts.bench.fsdp                                # 4 workers x 1gbit,100mbit
    python -m scripts.bench.fsdp --local --workers 2 --quick    # no namespaces, loopback, no root
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
from pathlib import Path

from scripts.common import launch, report, timing
from scripts.common import network as net  # namespaces, tc, the mpirun launches

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


def padded(p, n: int) -> int:
    """Elements of parameter ``p`` as FSDP2 shards it: dim 0 padded to a multiple of ``n``."""
    shape = tuple(p.shape)
    return math.ceil(shape[0] / n) * n * math.prod(shape[1:]) if shape else n


def worker(args) -> int:
    """Runs on every rank: build every row, time the steps, check the parameters, rank 0 writes JSON."""
    import torch
    import torch.distributed as dist

    from scripts.common.gpt import GPT, char_splits

    torch.set_num_threads(1)
    rank, n = rank_size()
    os.environ["GLOO_SOCKET_IFNAME"] = args.gloo_ifname
    if rank == 0 and args.gloo_ifname != "lo" and net.if_addr(args.gloo_ifname) != args.master_addr:
        raise RuntimeError(
            f"rank 0 is not at {args.master_addr} ({args.gloo_ifname}: "
            f"{net.if_addr(args.gloo_ifname)}): the hostfile order is not the rank order"
        )
    timeout = datetime.timedelta(seconds=args.gloo_timeout)
    where = f"tcp://{args.master_addr}:{args.master_port}"
    dist.init_process_group("gloo", init_method=where, rank=rank, world_size=n, timeout=timeout)
    train, _, chars = char_splits()
    keys = args.rows.split(",")
    built = {key: build_row(args, key, len(chars), n) for key in keys}
    timed, before, after = run_steps(args, keys, built, train, rank)
    # parameters after all steps: the largest difference to rank 0's (full_tensor() all-gathers the shards)
    diffs = {
        k: timing.param_diff(p.full_tensor() for p in built[k]["model"].parameters()) for k in keys if k != "local"
    }
    per_rank = [None] * n
    dist.all_gather_object(per_rank, {**timed, "maxrss_mb": timing.maxrss_mb()})
    # FSDP's groups: each block's parameters (all-gathered in forward and backward), the root's (once)
    plain = GPT(len(chars), args.width, args.layers, args.heads, args.context)
    sizes = {"block_elements": sum(padded(p, n) for b in plain.blocks for p in b.parameters())}
    sizes["root_elements"] = sum(padded(p, n) for name, p in plain.named_parameters() if not name.startswith("blocks."))
    results = {key: row_result(args, key, per_rank, diffs.get(key)) for key in keys}
    for key in keys:
        results[key].update(row_bytes(args, key, before[key], after[key], n, sizes))
    if rank == 0:
        run = {"size": n, "params": sum(p.numel() for p in plain.parameters())}
        run.update(param_tensors=len(list(plain.parameters())), vocab=len(chars), **sizes)
        run.update(maxrss_mb=max(r["maxrss_mb"] for r in per_rank), torch=torch.__version__, results=results)
        Path(args.worker_out).write_text(json.dumps(run))
    dist.destroy_process_group()
    return 0


def build_row(args, key: str, vocab: int, n: int) -> dict:
    """One row's model (its blocks and then the root ``fully_shard``-ed but for "local"), its AdamW
    and its quantized reduce-scatter (or None)."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from horovod_alq.torch.fsdp import ALQReduceScatter, quantize_reduce_scatter
    from scripts.common.gpt import GPT

    torch.manual_seed(0)  # the same initial weights in every row and on every rank
    model = GPT(vocab, args.width, args.layers, args.heads, args.context)
    comm = None
    if key != "local":
        mesh = init_device_mesh("cpu", (n,))
        mp = MixedPrecisionPolicy(reduce_dtype=torch.bfloat16) if key == "fsdp-bf16" else MixedPrecisionPolicy()
        for block in model.blocks:
            fully_shard(block, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)
        if key == "fsdp-alq":
            comm = quantize_reduce_scatter(model, ALQReduceScatter(method="alq", bits=3, bucket_size=8192, seed=1))
    return {"model": model, "opt": torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True), "comm": comm}


def run_steps(args, keys: list[str], built: dict, train, rank: int) -> tuple[dict, dict, dict]:
    """Every row's steps in turn on one batch per rank: {field: {row: [per step]}} for step_s,
    fwd_bwd_s, loss and link, and the rows' counters before and after."""
    import torch
    import torch.distributed as dist

    from scripts.common.gpt import sample_batch

    wire = args.gloo_ifname != "lo"  # per-rank interface counters only in the namespaces
    link = (lambda: timing.if_bytes(args.gloo_ifname)[:1]) if wire else None
    gen = torch.Generator().manual_seed(1000 + rank)
    timed = {field: {k: [] for k in keys} for field in ("step_s", "fwd_bwd_s", "loss", "link")}
    before = {}
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            before = {k: timing.counters(built[k]["comm"]) for k in keys}
        x, y = sample_batch(train, args.batch_size, args.context, gen)
        for key in keys:
            row = built[key]

            def forward_backward():
                loss = row["model"].loss(x, y)
                loss.backward()
                return loss

            rec = timing.timed_step(forward_backward, row["opt"].step, row["opt"].zero_grad, dist.barrier, link, wire)
            if step >= args.warmup:
                rec["loss"] = float(rec["out"].detach())
                for field in ("step_s", "fwd_bwd_s", "loss") + (("link",) if wire else ()):
                    timed[field][key].append(rec[field])
        if rank == 0:
            print(f"step {step + 1}/{args.warmup + args.steps} done", flush=True)
    return timed, before, {k: timing.counters(built[k]["comm"]) for k in keys}


def row_result(args, key: str, per_rank: list[dict], diff: float | None) -> dict:
    """One row's times (the slowest rank's step, median over steps), mean loss and eth0 bytes."""
    slow = timing.slowest(per_rank, "step_s", key)
    res = {"label": LABELS[key], "step_s": statistics.median(slow), "steps_s": slow}
    res.update(fwd_bwd_s=statistics.median(timing.slowest(per_rank, "fwd_bwd_s", key)), max_param_diff=diff)
    res["loss"] = statistics.mean(statistics.mean(r["loss"][key]) for r in per_rank)
    wire = args.gloo_ifname != "lo"
    res["wire_tx_per_step"] = [sum(c[0] for c in r["link"][key]) / args.steps for r in per_rank] if wire else None
    return res


def row_bytes(args, key: str, b: dict | None, a: dict | None, n: int, sizes: dict) -> dict:
    """Bytes per step and rank: the gradient reduce-scatter's (measured for ALQ from the counters
    ``b`` before and ``a`` after the timed steps, else arithmetic) and the all-gathers'."""
    share, block, root = (n - 1) / n, sizes["block_elements"], sizes["root_elements"]
    gather = share * 4 * (2 * block + root)
    if key == "local":
        res = dict(rs_bytes=0.0, gather_bytes=0.0, rs_how="none")
    elif a is None:
        size = 4 if key == "fsdp-fp32" else 2
        res = dict(rs_bytes=share * size * (block + root), gather_bytes=gather)
        res["rs_how"] = f"arithmetic: (N-1)/N x {size} B x padded elements"
    else:
        rounds = max(1, a["step"] - b["step"])
        rs = (a["bytes_sent"] - b["bytes_sent"]) / args.steps
        unc = (a["uncompressed"] - b["uncompressed"]) / args.steps
        res = dict(rs_bytes=rs + share * 4 * unc, bytes_sent_per_step=rs, uncompressed_per_step=unc)
        res.update(rounds_per_step=rounds / args.steps, exchange=a["exchange"], gather_bytes=gather)
        res["rs_how"] = "measured: metrics() bytes_sent + (N-1)/N x 4 B x uncompressed coordinates"
    res["bytes_per_step"] = res["rs_bytes"] + res["gather_bytes"]
    return res


# ---------------------------------------------------------------------------------------- driver
def worker_args(args, out: Path, ifname: str) -> list[str]:
    cmd = [sys.executable, "-m", "scripts.bench.fsdp", "--worker", "--worker-out", str(out), "--gloo-ifname", ifname]
    names = ("master_addr", "master_port", "rows", "width", "layers", "heads", "context", "batch_size")
    return cmd + launch.flags(args, *names, "steps", "warmup", "gloo_timeout")


LAUNCHES = itertools.count()


def run(args, tmp: Path, n: int, rate: str | None) -> dict:
    """The worker on ``n`` ranks on the loopback (rate None) or in ``n`` namespaces at ``rate``."""
    cmd = lambda out, ifname: worker_args(args, out, ifname)
    if rate is None:
        args.master_port = net.free_port(args.master_addr)
        return net.run_local(args, tmp, n, cmd, net.log_path(args.out, n, "loopback"))
    args.master_port = PORT + next(LAUNCHES)  # a fresh port per launch (no TIME_WAIT clash)
    return net.run_netns(args, tmp, n, rate, cmd, net.log_path(args.out, n, rate))


def mb(b: float) -> str:
    return f"{b / 1e6:.2f}"


def table(run: dict, rate_Bps: float | None) -> list[str]:
    res, ms = run["results"], report.ms
    local = res.get("local", {}).get("step_s")
    lines = []
    if local is not None:
        lines += [
            "Alone (unsharded, no collective, same oversubscription): fwd+bwd "
            f"{ms(res['local']['fwd_bwd_s'])} ms, fwd+bwd+AdamW step {ms(local)} ms (the compute "
            "in the limit).",
            "",
        ]
    bf16, fp32 = (res.get(k, {}).get("step_s") for k in ("fsdp-bf16", "fsdp-fp32"))
    cells = []
    for key, r in res.items():
        sharded = key != "local"
        tx = statistics.mean(r["wire_tx_per_step"]) if r.get("wire_tx_per_step") else None
        row = [r["label"] + (f" [{r['exchange']}]" if r.get("exchange") else ""), ms(r["step_s"]), ms(r["fwd_bwd_s"])]
        row += [f"{r['step_s'] / bf16:.2f}" if bf16 and sharded else "-"]
        row += [f"{r['step_s'] / fp32:.2f}" if fp32 and sharded else "-"]
        row += [mb(r["rs_bytes"]), mb(r["gather_bytes"]), mb(r["bytes_per_step"]), mb(tx) if tx else "-"]
        if rate_Bps and local is not None and sharded:
            limit = local + (tx if tx else r["bytes_per_step"]) / rate_Bps
            row += [ms(limit), f"{r['step_s'] / limit:.2f}"]
        else:
            row += ["-", "-"]
        cells.append(row + [f"{r['loss']:.3f}", "-" if r["max_param_diff"] is None else f"{r['max_param_diff']:.3g}"])
    head = ["row", "step ms", "fwd+bwd ms", "vs bf16", "vs fp32", "reduce-scatter MB", "all-gathers MB", "total MB"]
    head += [
        "eth0 tx MB (measured)",
        "limit no overlap, ms",
        "step / limit",
        "mean loss",
        "max param diff across ranks",
    ]
    return lines + report.table(head, cells, "-" + "r" * 12)


COLUMNS = (
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
    "diff: the largest |parameter - rank 0's| over ranks after all steps, from full_tensor()."
)


def page(args, argv, runs: list[dict], wall: float) -> str:
    first = runs[0]["run"]
    lines = report.step_header(
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
        f"rank; AdamW lr 0.001. Median over {args.steps} timed steps (after {args.warmup} warm-up) of the "
        "slowest rank's step; rows interleaved, a barrier before each step.",
        "",
    ]
    for r in runs:
        lines += [report.rate_heading(r), ""] + table(r["run"], r.get("throughput_Bps")) + [""]
    return "\n".join(lines + [COLUMNS, ""])


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = p.add_argument
    add("--workers", help=f"comma-separated worker counts, 2..8; default {FULL['workers']}")
    add("--rates", help=f"tc tbf rates, 'unshaped' = no qdisc; default {FULL['rates']}")
    for k in ("width", "layers", "heads", "context"):
        add(f"--{k}", type=int, help=f"GPT {k}; default {FULL[k]}")
    add("--batch-size", type=int, help=f"windows per rank and step; default {FULL['batch_size']}")
    add("--steps", type=int, help=f"timed steps per row; default {FULL['steps']}")
    add("--warmup", type=int, help=f"untimed steps per row first; default {FULL['warmup']}")
    quick = ", ".join(f"{k} {v:g}" if isinstance(v, float) else f"{k} {v}" for k, v in QUICK.items())
    add("--quick", action="store_true", help="defaults for a check of a minute or two: " + quick)
    add("--rows", default=",".join(ROWS), help=f"comma-separated, in this order: {','.join(ROWS)}")
    yield_help = "Open MPI's (it only launches the ranks here); default 1"
    add("--yield-when-idle", type=int, choices=(0, 1), default=1, help=yield_help)
    out_help = "markdown report (JSON in data/ beside it); default build/results/bench_fsdp.md, with --quick "
    add("--out", help=out_help + "build/bench/bench_fsdp.md")
    add("--timeout", type=float, help="seconds per mpirun; default 2400 (--quick: 600)")
    net.add_namespace_options(add)
    add("--master-addr", default=f"{net.SUBNET}.1", help=argparse.SUPPRESS)
    add("--master-port", type=int, default=PORT, help=argparse.SUPPRESS)
    return p


def main(argv=None) -> int:
    p = parser()
    args = p.parse_args(argv)
    net.apply_defaults(args, QUICK, FULL)
    if args.worker:
        return worker(args)
    if args.local:
        args.master_addr = "127.0.0.1"
    return net.step_main(p, args, argv, "scripts.bench.fsdp", ROWS, run, page)


if __name__ == "__main__":
    sys.exit(main())
