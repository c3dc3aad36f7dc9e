#!/usr/bin/env python
"""The wall-clock time of a full training step (forward, backward, exchange, SGD) of a ResNet-18-shaped
CNN on CPU, Horovod and DDP rows in the same processes, interleaved, on workers in network namespaces
with tc-shaped links (scripts/common/network.py). Needs root (ip netns, tc), except --local and --help.
The rows, columns and runs: docs/results/bench_train_step.md (each report says its setup).

    python -m scripts.bench.train_step                                # 4,8 workers x unshaped,1gbit,100mbit
    python -m scripts.bench.train_step --quick      # width 0.25, 4 workers, 1gbit and 100mbit, 5 steps
    python -m scripts.bench.train_step --local --workers 2 --quick    # no namespaces, loopback, no root
    python -m scripts.bench.train_step --layout 2x2 --quick           # 2 nodes of 2 ranks (issue 41)

PowerSGD on gloo issues its second and third allreduce from future callbacks on gloo's threads, so
with several DDP buckets the ranks can pair different collectives ("Received data size doesn't match
expected size", or a hang): its rows run with one DDP bucket.
"""

import argparse
import json
import os
import platform
import statistics
import sys
from pathlib import Path

from scripts.common import launch, report, rows, timing
from scripts.common import network as net  # namespaces, tc, the mpirun launches, gloo in the ranks
from scripts.common.rows import PSGD_START

ROWS = list(rows.STEP_ROWS)
DEFAULT_ROWS = "local,hvd-fp32,hvd-fp16,hvd-alq,hvd-alq-f4,hvd-alq-ag,hvd-alq-2p,ddp-fp32,ddp-fp16,ddp-psgd2".split(",")
DEFAULT_ROWS += ["ddp-psgd8", "ddp-alq"]  # one rank per namespace
NODE_ROWS = "local,hvd-fp32,hvd-fp16,hvd-fp16-hier,hvd-alq-2p,hvd-alq-h,hvd-alq-h4,hvd-alq-h2p,ddp-fp16".split(",")
NODE_ROWS += ["ddp-bf16", "ddp-alq-2p", "ddp-alq-h", "ddp-alq-h2p"]  # the default with --nodes
SEPARATE = {k: r.env for k, r in rows.ROWS.items() if r.env}  # rows that need their own launch
LABELS = {k: r.label for k, r in rows.ROWS.items()}
FP16_OF = {"hvd": "hvd-fp16", "ddp": "ddp-fp16"}
FULL = dict(workers="4,8", rates="unshaped,1gbit,100mbit", width=1.0, batch_size=8, steps=5, warmup=3, timeout=3600.0)
QUICK = dict(workers="4", rates="1gbit,100mbit", width=0.25, batch_size=8, steps=5, warmup=3, timeout=600.0)
TIMED = ("step_s", "fwd_bwd_s", "cpu_main_s", "cpu_all_s")


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
def worker(args) -> int:
    """Runs on every rank: build every row, time the steps, check the parameters, rank 0 writes JSON."""
    import horovod
    import horovod.torch as hvd
    import torch
    import torch.distributed as dist

    hvd.init()
    torch.set_num_threads(1)
    net.join_gloo(hvd, args.gloo_ifname, args.gloo_timeout)
    keys = args.rows.split(",")
    built = {}
    # a when-faster row's trial times its steps alone (--speed-warmup: its first after that many rounds)
    warmup = {} if args.speed_warmup is None else {"warmup": args.speed_warmup}
    for key in keys:
        torch.manual_seed(0)  # the same initial weights in every row and on every rank
        model = resnet18(args.width)
        built[key] = rows.build(key, model, torch.optim.SGD(model.parameters(), lr=0.01), hvd)
        built[key]["clock"] = timing.row_clock(built[key]["state"], hvd.rank(), **warmup)
    timed, before, after = run_steps(args, keys, built, hvd.rank())
    # parameters after all steps: the largest difference to rank 0's (0 when every rank averaged alike)
    diffs = {key: timing.param_diff(built[key]["model"].parameters()) for key in keys}
    mine = {"local_rank": hvd.local_rank(), "local_size": hvd.local_size(), "maxrss_mb": timing.maxrss_mb()}
    per_rank = hvd.allgather_object({**timed, **mine})
    base = built[keys[0]]["model"]
    params = sum(p.numel() for p in base.parameters())
    results = {}
    for key in keys:
        results[key] = row_result(args, key, per_rank, diffs[key])
        results[key].update(row_bytes(args, key, before.get(key), after[key], params, hvd.size()))
    if hvd.rank() == 0:
        run = {"size": hvd.size(), "params": params, "param_tensors": len(list(base.parameters()))}
        run.update(buffers=sum(b.numel() for b in base.buffers()), maxrss_mb=max(r["maxrss_mb"] for r in per_rank))
        run.update(torch=torch.__version__, horovod=horovod.__version__, local_size=hvd.local_size())
        run.update(nodes=sum(1 for r in per_rank if r["local_rank"] == 0), results=results)
        Path(args.worker_out).write_text(json.dumps(run))
    dist.destroy_process_group()
    hvd.shutdown()
    return 0


def run_steps(args, keys: list[str], built: dict, rank: int) -> tuple[dict, dict, dict]:
    """Every row's steps in turn, the same random batch every step (a different one per rank):
    {field: {row: [per timed step]}} for the fields of :data:`TIMED` and "link" ((tx, rx) of this
    namespace's --count-ifname and tx of its lo), and every row's counters before and after the
    timed steps."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(1000 + rank)
    x = torch.randn(args.batch_size, 3, 32, 32, generator=g)
    y = torch.randint(0, 10, (args.batch_size,), generator=g)
    link = None
    if args.count_ifname:  # the row's traffic has ended on every rank after a second barrier
        link = lambda: timing.if_bytes(args.count_ifname) + timing.if_bytes("lo")[:1]
    timed = {field: {k: [] for k in keys} for field in (*TIMED, "link")}
    before = {}
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            before = {k: timing.counters(built[k]["state"]) for k in keys}
        for key in keys:
            row = built[key]
            fb = lambda: F.cross_entropy(row["call"](x), y).backward()
            step_args = (fb, row["opt"].step, row["opt"].zero_grad, dist.barrier, link, bool(link))
            rec = timing.timed_step(*step_args, clock=row["clock"])
            if step >= args.warmup:
                for field in TIMED + (("link",) if link else ()):
                    timed[field][key].append(rec[field])
        if rank == 0:
            print(f"step {step + 1}/{args.warmup + args.steps} done", flush=True)
    return timed, before, {k: timing.counters(built[k]["state"]) for k in keys}


def row_result(args, key: str, per_rank: list[dict], diff: float) -> dict:
    """One row's times (the slowest rank's step, median over steps; CPU times per step the mean over
    ranks, then the median over steps) and, with --count-ifname, its bytes on the node links."""
    slow = timing.slowest(per_rank, "step_s", key)
    res = {"label": LABELS[key], "step_s": statistics.median(slow), "steps_s": slow}
    res["fwd_bwd_s"] = statistics.median(timing.slowest(per_rank, "fwd_bwd_s", key))
    res["max_param_diff"] = diff
    res["cpu_main_s"] = timing.median_of_means(per_rank, "cpu_main_s", key)
    res["cpu_all_s"] = timing.median_of_means(per_rank, "cpu_all_s", key)
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
    return res


def row_bytes(args, key: str, b: dict | None, a: dict | None, params: int, n: int) -> dict:
    """Bytes sent per step and rank over the timed steps, from the counters ``b`` before and ``a``
    after them, and how they were counted."""
    ring, row = timing.ring(n), rows.ROWS[key]
    if row.counted == "none":
        return dict(bytes_per_step=0.0, bytes_how="none")
    if row.counted == "arithmetic":
        how = f"arithmetic: 2(N-1)/N x {row.width} B x parameters"
        return dict(bytes_per_step=ring * row.width * params, bytes_how=how)
    if row.counted == "psgd":
        numel = (a["numel_after"] - b["numel_after"]) / args.steps
        return dict(
            bytes_per_step=ring * 4 * numel,
            numel_after_per_step=numel,
            numel_before_per_step=(a["numel_before"] - b["numel_before"]) / args.steps,
            bytes_how="PowerSGD counters: 2(N-1)/N x 4 B x total_numel_after_compression",
        )
    rounds = max(1, a["step"] - b["step"])
    sent = (a["bytes_sent"] - b["bytes_sent"]) / rounds
    unc = (a["uncompressed"] - b["uncompressed"]) / rounds
    fixed, coded = a["wire_fixed"] - b["wire_fixed"], a["wire_coded"] - b["wire_coded"]
    res = {}
    if fixed > 0:  # wire="entropy": bytes_sent counts the coded frames; what coding kept, for the record
        res.update(coded_over_fixed=coded / fixed)
    return dict(
        res,
        bytes_per_step=sent + ring * 4 * unc,
        bytes_sent_per_step=sent,
        uncompressed_per_step=unc,
        exchange=a["exchange"],
        rounds=rounds,
        collectives_per_round=(a["collectives"] - b["collectives"]) / rounds,
        rounds_16bit=a["rounds_16bit"] - b["rounds_16bit"],
        compress_choice=a["compress_choice"],
        step_time_quantized=a["step_time_quantized"],
        step_time_16bit=a["step_time_16bit"],
        bytes_how="measured: metrics() bytes_sent (the coded frames on the entropy wire) "
        "+ 2(N-1)/N x 4 B x uncompressed coordinates",
    )


# ---------------------------------------------------------------------------------------- driver
def worker_args(args, out: Path, ifname: str, rows: str | None = None) -> list[str]:
    cmd = [sys.executable, "-m", "scripts.bench.train_step", "--worker", "--worker-out", str(out)]
    cmd += ["--gloo-ifname", ifname, "--rows", rows or args.rows]
    cmd += launch.flags(args, "width", "batch_size", "steps", "warmup", "gloo_timeout", "speed_warmup")
    if ifname != "lo":  # in the namespaces: each node's eth0 counters around each row's steps
        cmd += ["--count-ifname", ifname]
    return cmd


def run(args, tmp: Path, n: int, rate: str | None) -> dict:
    """The worker on ``n`` ranks on the loopback (rate None), or in ``n`` namespaces of
    ``args.ranks_per_node`` ranks each at ``rate``. Rows of :data:`SEPARATE` run in a launch of
    their own, with their variables (and the local row: their ratios can be scaled by the alone
    steps); the results are merged."""
    g = args.ranks_per_node
    if rate is None:
        log = net.log_path(args.out, n, "loopback")
        return net.run_local(args, tmp, n, lambda out, ifname: worker_args(args, out, ifname), log)
    keys = args.rows.split(",")
    main = [k for k in keys if k not in SEPARATE]
    result = None
    if main:
        cmd = lambda out, ifname: worker_args(args, out, ifname, ",".join(main))
        result = net.run_netns(args, tmp, n, rate, cmd, net.log_path(args.out, n * g, rate))
    for key in (k for k in keys if k in SEPARATE):
        cmd = lambda out, ifname: worker_args(args, out, ifname, f"local,{key}")
        log = net.log_path(args.out, n * g, f"{rate}_{key}")
        part = net.run_netns(args, tmp, n, rate, cmd, log, f"_{key}", SEPARATE[key])
        part["results"][key]["launch"] = "own launch: " + " ".join(f"{k}={v}" for k, v in SEPARATE[key].items())
        part["results"][key]["own_local_s"] = part["results"]["local"]["step_s"]
        if result is None:
            result = part
        else:
            result["results"][key] = part["results"][key]
            result.setdefault("launch_bytes_separate", {})[key] = part.get("launch_bytes")
    result["results"] = {k: result["results"][k] for k in keys}
    return result


def memory_check(args, workers: list[int]) -> str | None:
    """None, or why the largest launch would not fit in MemAvailable. Per rank: 0.45 GB (torch,
    Horovod, MPI) plus 15 bytes per parameter and row (parameters, gradients, DDP buckets, hook and
    compressor buffers); measured peaks: 2.35 GB at width 1, 0.68 GB at width 0.25, 11 rows."""
    params = sum(p.numel() for p in resnet18(args.width).parameters())
    rows = len(args.rows.split(","))
    per_rank = 0.45e9 + params * rows * 15 * 1.1
    with open("/proc/meminfo") as f:
        avail = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    ranks = max(workers) * args.ranks_per_node
    need = ranks * per_rank
    if need <= avail:
        return None
    return (
        f"{ranks} ranks x about {per_rank / 1e9:.2f} GB ({params:,} parameters x {rows} rows) = "
        f"{need / 1e9:.1f} GB > {avail / 1e9:.1f} GB available; use a smaller --width, fewer --rows or "
        "--workers"
    )


# ---------------------------------------------------------------------------------------- report
def table(run: dict, rate_Bps: float | None) -> list[str]:
    res = run["results"]
    local = res.get("local", {}).get("step_s")
    lines = []
    if "local" in res:
        lines.append(
            f"Alone (no exchange, same oversubscription): fwd+bwd {report.ms(res['local']['fwd_bwd_s'])} ms, "
            f"fwd+bwd+SGD step {report.ms(local)} ms (the compute in the limits)."
        )
        lines.append("")
    links = all("link_tx_per_step" in r for r in res.values())
    nodes = run.get("local_size", 1) > 1 and links  # limits from the counted bytes of the busiest link
    head = ["row", "step ms", "fwd+bwd ms", "vs fp16", "MB sent / step / rank", "own collectives / round"]
    if links:
        head += ["MB between nodes / step (eth0 tx, all nodes)", "busiest node link MB / step"]
        head += ["MB inside nodes / step (lo, all nodes)"]
    head += ["comm at R, ms", "limit no overlap, ms", "step / limit", "limit overlap, ms", "step / limit"]
    head += ["max param diff across ranks"]
    return (
        lines
        + report.table(head, (table_row(res, key, links, nodes, rate_Bps, local) for key in res), "-" + "r" * 99)
        + speed_lines(res)
    )


def speed_lines(res: dict) -> list[str]:
    """What each ``compress="when-faster"`` row chose, from its last trial (the slowest rank's medians)."""
    out = []
    for r in res.values():
        if r.get("compress_choice") is not None and r.get("step_time_quantized") == r.get("step_time_quantized"):
            q, h = report.ms(r["step_time_quantized"]), report.ms(r["step_time_16bit"])
            out.append(
                f"{r['label']}: chose {r['compress_choice']} (trial: quantized {q} ms, 16-bit {h} ms per step of "
                f"this row alone; {r['rounds_16bit']} of the {r['rounds']} timed rounds sent 16 bits)."
            )
    return [""] + out if out else []


def table_row(res: dict, key: str, links: bool, nodes: bool, rate_Bps: float | None, local: float | None) -> list:
    r, ms = res[key], report.ms
    ref = res.get(FP16_OF.get(key.split("-")[0], ""), {}).get("step_s")
    ratio = f"{r['step_s'] / ref:.2f}" if ref and key != "local" else "-"
    label = r["label"] + (f" [{r['exchange']}]" if r.get("exchange") else "")
    cells = [label, ms(r["step_s"]), ms(r["fwd_bwd_s"]), ratio, f"{r['bytes_per_step'] / 1e6:.3f}"]
    cells += [f"{r['collectives_per_round']:.1f}" if "collectives_per_round" in r else "-"]
    if links:
        cells += [f"{r['link_tx_per_step'] / 1e6:.3f}", f"{r['link_max_per_step'] / 1e6:.3f}"]
        cells += [f"{r['lo_per_step'] / 1e6:.3f}" if "lo_per_step" in r else "-"]
    if rate_Bps and local is not None and key != "local":
        comm = (r["link_max_per_step"] if nodes else r["bytes_per_step"]) / rate_Bps
        no_ov, ov = local + comm, max(local, comm)
        cells += [ms(comm), ms(no_ov), f"{r['step_s'] / no_ov:.2f}", ms(ov), f"{r['step_s'] / ov:.2f}"]
    else:
        cells += ["-"] * 5
    return cells + ["-" if key == "local" else f"{r['max_param_diff']:.3g}"]


def launch_lines(run: dict) -> list[str]:
    """What the counted rows leave out: the whole launch's bytes on the node links, against the
    sum of the rows' counted steps; [] for a run without counters."""
    res, lb, ms = run["results"], run.get("launch_bytes"), report.ms
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
    res, cores, ms = run["results"], os.cpu_count(), report.ms
    if not all("cpu_main_s" in r for r in res.values()):
        return []
    local = res.get("local", {}).get("cpu_main_s")
    cells = []
    for key, r in res.items():
        bound = run["size"] * r["cpu_all_s"] / cores
        extra = "-" if local is None or key == "local" else f"{(r['cpu_main_s'] - local) * 1e3:+.0f}"
        other = ms(r["cpu_all_s"] - r["cpu_main_s"])
        cells.append(
            [r["label"], ms(r["step_s"]), ms(r["cpu_main_s"]), extra, other, ms(bound), f"{r['step_s'] / bound:.2f}"]
        )
    head = ["row", "step ms", "main thread CPU ms", "main thread CPU over the local row's, ms", "other threads CPU ms"]
    head += ["all ranks' CPU / cores, ms", "step / that"]
    intro = ["CPU time per step and rank (mean over ranks, median over steps) and what the cores allow:", ""]
    return [""] + intro + report.table(head, cells, "-rrrrrr")


COLUMNS = (
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
    "over the timed steps, on the entropy wire the coded frames, "
    "plus 2(N-1)/N x 4 B per coordinate that travelled uncompressed), PowerSGD "
    "from its counters (2(N-1)/N x 4 B x total_numel_after_compression: its P, Q and uncompressed "
    "tensors are allreduced in fp32), fp32 and fp16 by arithmetic (2(N-1)/N x 4 or 2 B x parameters: a "
    "bandwidth-optimal ring allreduce; Open MPI and gloo may send more); comm at R = bytes / R with R the "
    "measured TCP throughput of one worker link; limit no overlap = local step + comm, limit overlap = "
    "max(local step, comm), 'local step' being the fwd+bwd+SGD row; own collectives / round: the "
    "collectives the ALQ row started itself per round (handshake, payload stages, refit and "
    "compress='when-faster' allreduces; metrics()['collectives']), not Horovod's allreduces of the "
    "control vectors (one per tensor, fused by Horovod); max param diff: the largest "
    "|parameter - rank 0's| over ranks after all steps. CPU tables: the main thread's CPU time "
    "(time.thread_time: forward, backward, the hooks and compressors, the optimizer step) and the other "
    "threads' (process time less that: Horovod's background thread, Open MPI, gloo; Open MPI's "
    "yield-when-idle polling counts as CPU time, so a long wait on a slow link shows there); all ranks' CPU / "
    "cores = N x process CPU time / cores, the step time if the cores were the only limit."
)


def page(args, argv, runs: list[dict], wall: float) -> str:
    first = runs[0]["run"]
    lines = report.step_header(
        "# Full training step (forward + backward + exchange + SGD): ResNet-18-shaped CNN on CPU, Horovod and DDP",
        "scripts.bench.train_step",
        argv,
        runs,
        wall,
        f"Horovod {first['horovod']}, Python {platform.python_version()}",
        "Horovod, Open MPI and gloo threads",
        fewer_ranks=" (one core per rank at most)",
    )
    intra = "shared memory (vader)" if args.intra_node == "shm" else "TCP over lo"
    lines += [
        f"Model: ResNet-18 (CIFAR form) at width {args.width}, {first['params']:,} parameters in "
        f"{first['param_tensors']} tensors ({first['buffers']:,} batch-norm buffer elements, which DDP "
        f"broadcasts from rank 0 at every forward and Horovod leaves alone); 3x32x32 inputs, batch "
        f"{args.batch_size} per worker; SGD lr 0.01 momentum 0. Median over {args.steps} "
        "timed steps "
        f"(after {args.warmup} warm-up) of the slowest rank's step; rows interleaved, a barrier before each "
        f"step. Open MPI mpi_yield_when_idle={args.yield_when_idle}"
        + (f", between the ranks of a node {intra}" if getattr(args, "nodes", None) else "")
        + f". PowerSGD: start_powerSGD_iter={PSGD_START}, "
        + "one DDP bucket (bucket_cap_mb above the model's size); the other DDP rows DDP's default buckets (25 MB).",
        "",
    ]
    for r in runs:
        rate = r.get("throughput_Bps")
        lines += [report.rate_heading(r), ""] + table(r["run"], rate) + launch_lines(r["run"]) + cpu_table(r["run"])
        lines += [""]
    return "\n".join(lines + [COLUMNS, ""])


# ---------------------------------------------------------------------------------------- command line
def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = p.add_argument
    add("--workers", help=f"comma-separated worker counts, 2..8; default {FULL['workers']}")
    add("--rates", help=f"tc tbf rates, 'unshaped' = no qdisc; default {FULL['rates']}")
    add("--width", type=float, help=f"ResNet-18 channel scale; default {FULL['width']}")
    add("--batch-size", type=int, help=f"per worker; default {FULL['batch_size']}")
    add("--steps", type=int, help=f"timed steps per row; default {FULL['steps']}")
    warmup_help = f"untimed steps per row first (>= 3 for PowerSGD's steady state); default {FULL['warmup']}"
    add("--warmup", type=int, help=warmup_help)
    quick = ", ".join(f"{k} {v:g}" if isinstance(v, float) else f"{k} {v}" for k, v in QUICK.items())
    add("--quick", action="store_true", help="defaults for a check of 2-3 minutes: " + quick)
    rows_help = f"comma-separated, from {','.join(ROWS)}; default {','.join(DEFAULT_ROWS)}, with --nodes "
    add("--rows", help=rows_help + ",".join(NODE_ROWS))
    net.add_layout_options(add)
    intra = "Open MPI (the Horovod rows) between a node's ranks: TCP over its loopback or shared memory; default tcp"
    add("--intra-node", choices=("tcp", "shm"), default="tcp", help=intra)
    add("--speed-warmup", type=int, help="compress='when-faster' rows: rounds before the first trial; default 2")
    add("--yield-when-idle", type=int, choices=(0, 1), default=1, help="Open MPI's; default 1")
    out_help = "markdown report (JSON next to it); default build/results/bench_train_step.md, with --quick build/bench/"
    add("--out", help=out_help + "bench_train_step.md")
    add("--timeout", type=float, help="seconds per mpirun; default 3600 (--quick: 600)")
    net.add_namespace_options(add)
    add("--count-ifname", help=argparse.SUPPRESS)
    return p


def main(argv=None) -> int:
    p = parser()
    args = p.parse_args(argv)
    net.apply_defaults(args, QUICK, FULL)
    net.parse_layout(p, args)
    if args.rows is None:
        args.rows = ",".join(NODE_ROWS if args.nodes else DEFAULT_ROWS)
    if args.worker:
        return worker(args)
    if any("psgd" in r for r in args.rows.split(",")) and args.warmup < PSGD_START + 1:
        print(
            f"note: --warmup {args.warmup} < {PSGD_START + 1}: PowerSGD's timed steps include its first "
            "(allocating, vanilla) ones",
            file=sys.stderr,
        )
    return net.step_main(p, args, argv, "scripts.bench.train_step", ROWS, run, page, memory_check)


if __name__ == "__main__":
    sys.exit(main())
