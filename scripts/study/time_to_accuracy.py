#!/usr/bin/env python
"""Time to accuracy on slow links: the held-out loss of the character GPT against wall-clock
training seconds, every row (scripts/common/rows.py) in the same processes, on 2 nodes x 2 ranks in
network namespaces with shaped links between nodes (needs root, except --local). The method, the
targets, the columns and the results: docs/results/time_to_accuracy.md.

    python -m scripts.study.time_to_accuracy     # 2 rates x 3 seeds, 240 steps, into build/results
    python -m scripts.study.time_to_accuracy --quick --out-dir build/bench     # 1 seed, 1 rate, 40 steps
    python -m scripts.study.time_to_accuracy --local --np 2 --quick --out-dir /tmp/tta  # loopback, no root

Every rank logs each row's steps to <out-dir>/data/time_to_accuracy_logs/<run>/rank<r>.jsonl; every
(rate, seed) run writes its JSON to <out-dir>/data/time_to_accuracy_raw/; a run whose JSON exists is
skipped (an interrupted study resumes) and ``--aggregate-only`` rebuilds the report.
"""

import argparse
import datetime
import json
import math
import os
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path

from scripts.common import launch as launching
from scripts.common import network as net
from scripts.common import report as pages
from scripts.common import rows, timing

ROWS = "hvd-fp16,ddp-bf16,ddp-psgd,hvd-qsgdinf,hvd-alq,hvd-alq-auto,hvd-alq-flat,hvd-alq4-entropy".split(",")
ROWS += ["hvd-alq4-rate", "hvd-alq4-rate21", "local"]
DEFAULT_ROWS = list(ROWS)  # the error-feedback rows run on request (--rows), with --optimizer sgd
ROWS += ["hvd-alq-ef", "hvd-alq2", "hvd-alq2-ef", "hvd-alq-pre", "hvd-alq2-pre", "hvd-alq-auto-pre"]
ROWS += ["hvd-alq-pre30"]
ROWS += ["hvd-alq-when"]  # ALQ 3 bits with the default compress (when-faster), docs/results/compress_when_faster.md
LABELS = {k: rows.ROWS[k].label for k in ROWS}  # scripts/common/rows.py's, but for the names these pages use
LABELS.update({"hvd-fp16": "Horovod fp16", "ddp-bf16": "DDP bf16_compress_hook", "hvd-alq": "ALQ 3 bits (defaults)"})
LABELS["local"] = "no exchange (compute alone)"
LABELS["hvd-alq-when"] = "ALQ 3 bits, compress='when-faster' (the default)"
BASELINE = "hvd-fp16"
TARGETS = (0.5, 0.75, 1.0)  # fractions of fp16's steps whose loss is a target
FULL = dict(layout="2x2", rates="100mbit,1gbit", seeds="0,1,2", steps=240, eval_every=20, timeout=7200.0)
QUICK = dict(layout="2x2", rates="100mbit", seeds="0", steps=40, eval_every=10, timeout=1200.0)
STEM = "time_to_accuracy"
OPTIMIZERS = {"adamw": "AdamW", "sgd": "SGD (momentum 0.9, no weight decay)"}
LR = {"adamw": 3e-3, "sgd": 0.05}  # SGD's: the fp32 sweep of docs/results/error_feedback.md
FIELDS = ("step_s", "fwd_bwd_s", "cpu_main_s", "cpu_all_s", "bytes", "link")


# ---------------------------------------------------------------------------------------- worker
def build_row(key: str, args, vocab: int, hvd, plain_args) -> dict:
    """One row (scripts/common/rows.py's): the model to call, the model to evaluate, its optimizer
    and its counters (or None); PowerSGD at the rank whose bytes match 3-bit ALQ's."""
    import torch

    from scripts.common.gpt import GPT, make_optimizer, matched_rank

    torch.manual_seed(args.seed)  # the same initial model in every row and on every rank
    model = GPT(vocab, args.width, args.layers, args.heads, args.context)
    matched = lambda m: matched_rank(m, 3, 8192, 1024)
    return rows.build(key, model, make_optimizer(model, plain_args), hvd, seed=args.seed, matched_rank=matched)


def sent_so_far(row: dict) -> tuple[float, float]:
    """(payload bytes sent, coordinates sent uncompressed) so far by this rank's row; PowerSGD:
    (0, coordinates after its compression)."""
    c = timing.counters(row["state"])
    if c is None:
        return 0.0, 0.0
    if "numel_after" in c:
        return 0.0, float(c["numel_after"])
    coded = c["wire_coded"] / c["wire_fixed"] if c["wire_fixed"] else 1.0  # wire="entropy"
    return float(c["bytes_sent"]) * coded, float(c["uncompressed"])


def worker(args) -> int:
    """Runs on every rank: every row's steps in turn, the per-step log, rank 0 writes the run's JSON."""
    import horovod
    import horovod.torch as hvd
    import torch
    import torch.distributed as dist

    from scripts.common.gpt import char_splits

    hvd.init()
    torch.set_num_threads(1)
    net.join_gloo(hvd, args.gloo_ifname, 600)
    train_ids, val_ids, chars = char_splits()
    # train_gpt.py's optimizers and schedule (AdamW: weight decay 0.1; SGD: momentum 0.9, no weight
    # decay, as run_accuracy --model gpt's; warm-up then cosine)
    decay = 0.1 if args.optimizer == "adamw" else 0.0
    plain = argparse.Namespace(
        optimizer=args.optimizer, lr=args.lr, weight_decay=decay, warmup=min(30, args.steps // 8)
    )
    plain.__dict__.update(steps=args.steps, context=args.context, eval_windows=args.eval_windows)
    keys = args.rows.split(",")
    # --stretch: every row but fp16 trains that many times fp16's steps, its cosine schedule to its own end
    plains = {k: argparse.Namespace(**{**vars(plain), "steps": row_steps(args, k)}) for k in keys}
    built = {k: build_row(k, args, len(chars), hvd, plains[k]) for k in keys}
    for row in built.values():  # compress="when-faster": a trial times this row's steps alone
        row["clock"] = timing.row_clock(row["state"], hvd.rank())
    params = sum(p.numel() for p in built[keys[0]]["model"].parameters())
    per, curves = train(args, built, (train_ids, val_ids), plains, params, hvd)
    # the parameters after all steps: the largest difference to rank 0's (0 where every rank averaged alike)
    diffs = {key: timing.param_diff(built[key]["model"].parameters()) for key in keys}
    gathered = hvd.allgather_object({"per": per, "local_rank": hvd.local_rank()})
    if hvd.rank() == 0:
        results = {key: row_result(args, key, gathered, curves[key], diffs[key], built[key]) for key in keys}
        run = {"size": hvd.size(), "local_size": hvd.local_size(), "params": params, "torch": torch.__version__}
        run.update(horovod=horovod.__version__, rows=results)
        Path(args.worker_out).write_text(json.dumps(run))
    dist.destroy_process_group()
    hvd.shutdown()
    return 0


def row_steps(args, key: str) -> int:
    """The steps ``key`` trains: fp16's ``--steps``, the other rows ``--stretch`` times that."""
    return args.steps if key == BASELINE else round(args.stretch * args.steps)


def train(args, built: dict, data: tuple, plains: dict, params: int, hvd) -> tuple[dict, dict]:
    """Every row's steps in turn on the same batches (a different one per rank), each row's clock the
    sum of its steps' (the slowest rank's); every rank logs every row's step as a JSON line.
    ``plains``: each row's schedule (its ``steps``). Returns {field: {row: [per step]}}
    (:data:`FIELDS`) and each row's held-out curve ([step, loss])."""
    import torch

    from scripts.common.gpt import sample_batch

    rank, keys, (train_ids, val_ids) = hvd.rank(), list(built), data
    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(args.seed * 1000 + rank)
    per = {field: {k: [] for k in keys} for field in FIELDS}
    clocks = {k: [0.0, 0.0] for k in keys}  # this rank's, the slowest rank's (step by step)
    curves = {k: [] for k in keys}
    last = {k: sent_so_far(built[k]) for k in keys}
    link = (lambda: timing.if_bytes(args.count_ifname)) if args.count_ifname and hvd.local_rank() == 0 else None
    with open(log_dir / f"rank{rank}.jsonl", "w") as log:
        total = max(plains[k].steps for k in keys)
        for step in range(total):
            batch = sample_batch(train_ids, args.batch_size, args.context, generator)
            for key in (k for k in keys if step < plains[k].steps):
                plain = plains[key]
                rec, last[key] = row_step(
                    args, key, built[key], batch, step, plain, link, last[key], params, hvd.size()
                )
                clocks[key][0] += rec["own_s"]
                clocks[key][1] += rec["step_s"]
                for field in FIELDS:
                    per[field][key].append(rec[field])
                line = {"row": key, "step": step + 1, "seconds": round(clocks[key][0], 6)}
                line.update(seconds_slowest=round(clocks[key][1], 6), step_seconds=round(rec["own_s"], 6))
                line.update(bytes_sent=round(rec["bytes"], 1), train_loss=round(float(rec["out"]), 5))
                if (step + 1) % args.eval_every == 0 or step + 1 == plain.steps:
                    value = evaluation(built[key], key, val_ids, plain, hvd)
                    if value is not None:
                        curves[key].append([step + 1, value])
                        line["eval_loss"] = round(value, 6)
                log.write(json.dumps(line) + "\n")
            log.flush()
            if rank == 0 and (step + 1) % max(1, total // 10) == 0:
                clock = ", ".join(f"{k} {clocks[k][1]:.1f} s" for k in keys)
                print(f"step {step + 1}/{total}: " + clock, flush=True)
    return per, curves


def row_step(args, key: str, row: dict, batch, step: int, plain, link, last, params: int, n: int):
    """One row's timed step (scripts/common/timing.py's), its bytes since ``last`` (the counters
    then) and the slowest rank's step time: (the step's record, the counters now)."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from scripts.common.gpt import lr_at

    x, y = batch
    for group in row["opt"].param_groups:
        group["lr"] = lr_at(step, plain)

    def forward_backward():
        if row["call"] is row["model"]:
            loss = row["model"].loss(x, y)
        else:
            loss = F.cross_entropy(row["call"](x).flatten(0, 1), y.flatten())
        loss.backward()
        return loss

    def optimizer_step():
        if args.clip and hasattr(row["opt"], "synchronize"):  # Horovod: the averaged gradients first
            row["opt"].synchronize()
            torch.nn.utils.clip_grad_norm_(row["model"].parameters(), args.clip)
            with row["opt"].skip_synchronize():
                row["opt"].step()
            return
        if args.clip:
            torch.nn.utils.clip_grad_norm_(row["model"].parameters(), args.clip)
        row["opt"].step()

    rec = timing.timed_step(
        forward_backward,
        optimizer_step,
        row["opt"].zero_grad,
        dist.barrier,
        link,
        bool(args.count_ifname),
        clock=row["clock"],
    )
    now, ring, counted = sent_so_far(row), timing.ring(n), rows.ROWS[key].counted
    if counted == "arithmetic":
        rec["bytes"] = ring * rows.ROWS[key].width * params
    elif counted == "psgd":
        rec["bytes"] = ring * 4 * (now[1] - last[1])
    else:
        rec["bytes"] = (now[0] - last[0]) + ring * 4 * (now[1] - last[1])
    slowest = torch.tensor([rec["step_s"]], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    rec.update(own_s=rec["step_s"], step_s=float(slowest), link=rec["link"] or (0, 0))
    return rec, now


def evaluation(row: dict, key: str, val_ids, plain, hvd) -> float | None:
    """The held-out loss, measured by rank 0 (scripts/common/gpt.py's ``evaluate``) and sent
    to every rank; None for the local row."""
    from scripts.common.gpt import evaluate

    value = evaluate(row["model"], val_ids, plain) if hvd.rank() == 0 and key != "local" else None
    return hvd.broadcast_object(value, root_rank=0, name="tta.eval")


def row_result(args, key: str, gathered: list[dict], curve: list, diff: float, row: dict) -> dict:
    """One row's run: the slowest rank's step times, its curve, bytes per step (the mean over ranks
    and steps), per step the mean over ranks then the median over steps of the forward and
    backward and the CPU times, and (in the namespaces) the busiest node link's bytes per step."""
    pers = [g["per"] for g in gathered]
    res = {"label": LABELS[key], "step_s": [round(v, 6) for v in pers[0]["step_s"][key]], "curve": curve}
    res.update(bytes_per_step=statistics.fmean(statistics.fmean(r["bytes"][key]) for r in pers), max_param_diff=diff)
    for field in ("fwd_bwd_s", "cpu_main_s", "cpu_all_s"):
        res[field] = timing.median_of_means(pers, field, key)
    res.update(row["extra"])
    if args.count_ifname:
        nodes = [g["per"]["link"][key] for g in gathered if g["local_rank"] == 0]
        steps = len(pers[0]["step_s"][key])
        # the busiest node link, the more loaded direction (tbf shapes each direction)
        res["link_max_per_step"] = max(max(sum(c[0] for c in nd), sum(c[1] for c in nd)) for nd in nodes) / steps
    if row["state"] is not None and hasattr(row["state"], "metrics"):
        m = row["state"].metrics()
        res.update(exchange=m["exchange"], bits_per_coordinate=m["bits_per_coordinate"])
    return res


# ---------------------------------------------------------------------------------------- targets
def reach(curve: list, clock: list[float], target: float) -> float | None:
    """Seconds on ``clock`` (cumulative, per step) at the first evaluation of ``curve`` ([step, loss])
    at or below ``target``; None if none is."""
    step = reach_step(curve, target)
    return None if step is None else clock[step - 1]


def reach_step(curve: list, target: float) -> int | None:
    """The step of the first evaluation of ``curve`` at or below ``target``, or None."""
    return next((step for step, loss in curve if loss <= target), None)


def targets_of(curve: list, steps: int) -> list[tuple[float, int, float]]:
    """(fraction, step, loss) of the baseline's ``curve`` at each fraction of :data:`TARGETS` of
    ``steps`` (the evaluation at that step: --eval-every divides those steps)."""
    at = dict((s, v) for s, v in curve)
    out = []
    for f in TARGETS:
        step = round(f * steps)
        if step not in at:
            raise ValueError(
                f"the fp16 curve has no evaluation at step {step} ({f:.0%} of {steps}); steps: {sorted(at)}"
            )
        out.append((f, step, at[step]))
    return out


def cumulative(step_s: list[float]) -> list[float]:
    total, out = 0.0, []
    for s in step_s:
        total += s
        out.append(total)
    return out


def summarize(runs: list[dict]) -> dict:
    """Per rate: per row the time to each target over seeds (mean, s.e., ratio to fp16, seeds that
    reached it), bytes, step profile, final loss."""
    out = {}
    for rate in sorted({r["rate"] for r in runs}, key=lambda r: [x["rate"] for x in runs].index(r)):
        group = [r for r in runs if r["rate"] == rate]
        keys = list(group[0]["rows"])
        table = {}
        for key in keys:
            if key == "local":
                continue
            entry = {"targets": [], "label": LABELS[key]}
            for i, f in enumerate(TARGETS):
                times, ratios, losses, steps_to = [], [], [], []
                for run in group:
                    steps = len(run["rows"][BASELINE]["step_s"])
                    _, _, target = targets_of(run["rows"][BASELINE]["curve"], steps)[i]
                    losses.append(target)
                    t = reach(run["rows"][key]["curve"], cumulative(run["rows"][key]["step_s"]), target)
                    t0 = reach(run["rows"][BASELINE]["curve"], cumulative(run["rows"][BASELINE]["step_s"]), target)
                    if t is not None:
                        times.append(t)
                        ratios.append(t / t0)
                        steps_to.append(reach_step(run["rows"][key]["curve"], target))
                entry["targets"].append(
                    {
                        "fraction": f,
                        "loss": statistics.fmean(losses),
                        "reached": len(times),
                        "seeds": len(group),
                        "seconds": pages.mean_se(times) if times else None,
                        "ratio": pages.mean_se(ratios) if ratios else None,
                        "steps": statistics.fmean(steps_to) if steps_to else None,
                    }
                )
            rws = [run["rows"][key] for run in group]
            entry.update(
                final_loss=pages.mean_se([r["curve"][-1][1] for r in rws]),
                final_vs_fp16=pages.mean_se(
                    [r["curve"][-1][1] - run["rows"][BASELINE]["curve"][-1][1] for r, run in zip(rws, group)]
                ),
                total_s=pages.mean_se([sum(r["step_s"]) for r in rws]),
                step_s=statistics.median(statistics.median(r["step_s"]) for r in rws),
                bytes_per_step=statistics.fmean(r["bytes_per_step"] for r in rws),
                link_max_per_step=(
                    statistics.fmean(r["link_max_per_step"] for r in rws) if "link_max_per_step" in rws[0] else None
                ),
                fwd_bwd_s=statistics.median(r["fwd_bwd_s"] for r in rws),
                cpu_main_s=statistics.median(r["cpu_main_s"] for r in rws),
                cpu_all_s=statistics.median(r["cpu_all_s"] for r in rws),
                exchange=rws[0].get("exchange"),
                max_param_diff=max(r["max_param_diff"] for r in rws),
                powersgd_rank=rws[0].get("powersgd_rank"),
            )
            table[key] = entry
        local = [run["rows"]["local"] for run in group if "local" in run["rows"]]
        out[rate] = {
            "rows": table,
            "seeds": [r["seed"] for r in group],
            "throughput_Bps": statistics.fmean(r["throughput_Bps"] for r in group)
            if group[0].get("throughput_Bps")
            else None,
            "local_step_s": statistics.median(statistics.median(r["step_s"]) for r in local) if local else None,
            "local_cpu_main_s": statistics.median(r["cpu_main_s"] for r in local) if local else None,
        }
    return out


# ---------------------------------------------------------------------------------------- report
def fmt_time(t) -> str:
    return "not reached" if t is None else f"{t[0]:.1f} ± {t[1]:.1f}" if t[1] == t[1] else f"{t[0]:.1f}"


def fmt_ratio(r, reached: int, seeds: int) -> str:
    if r is None:
        return f"not reached (0/{seeds})"
    text = f"{r[0]:.2f} ± {r[1]:.2f}" if r[1] == r[1] else f"{r[0]:.2f}"
    return text + ("" if reached == seeds else f" ({reached}/{seeds} seeds; not reached in the others)")


def rate_table(rate: str, s: dict) -> list[str]:
    head = ["row"] + [
        c for t in s["rows"][BASELINE]["targets"] for c in (f"to {t['fraction']:.0%} target: s", "ratio to fp16")
    ]
    head += ["final loss (vs fp16)", "bytes sent/step/rank", "busiest node link bytes/step"]
    cells = []
    for e in s["rows"].values():
        row = [e["label"]]
        for t in e["targets"]:
            row += [fmt_time(t["seconds"]), fmt_ratio(t["ratio"], t["reached"], t["seeds"])]
        d = e["final_vs_fp16"]
        row += [f"{e['final_loss'][0]:.4f} ({d[0]:+.4f})", f"{e['bytes_per_step'] / 1e6:.3f} MB"]
        cells.append(row + ["" if e["link_max_per_step"] is None else f"{e['link_max_per_step'] / 1e6:.2f} MB"])
    lines = pages.table(head, cells)
    targets = ", ".join(f"{t['fraction']:.0%}: {t['loss']:.4f}" for t in s["rows"][BASELINE]["targets"])
    lines.append("")
    lines.append(f"Targets (fp16's held-out loss at that share of its steps, mean over seeds): {targets} nats/char.")
    lines.append(
        "Bytes sent: all a rank sends per step, inside its node too (the hierarchical exchange's first "
        "stage sends float32 over the node's fast links); the busiest node link: what crossed the shaped "
        "link of the more loaded node, in its more loaded direction (eth0's counters)."
    )
    return lines


def profile_table(s: dict) -> list[str]:
    """Where each row's step goes: the slowest rank's step (median), fwd+bwd on a rank (with DDP,
    its hooks' exchange too), the main thread's CPU and the process's; against compute alone."""
    local = s["local_step_s"]
    head = ["row", "step ms", "vs no exchange", "fwd+bwd ms", "opt.step+exchange ms", "main-thread CPU ms"]
    cells = []
    for e in s["rows"].values():
        vs = f"{e['step_s'] / local:.2f}x" if local else ""
        row = [e["label"], f"{e['step_s'] * 1e3:.0f}", vs, f"{e['fwd_bwd_s'] * 1e3:.0f}"]
        row += [f"{(e['step_s'] - e['fwd_bwd_s']) * 1e3:.0f}", f"{e['cpu_main_s'] * 1e3:.0f}"]
        cells.append(row + [f"{e['cpu_all_s'] * 1e3:.0f}", e["exchange"] or ""])
    lines = pages.table(head + ["all threads CPU ms", "exchange"], cells)
    if local:
        lines.append(f"| no exchange (compute alone) | {local * 1e3:.0f} | 1.00x | | | | | |")
    return lines


def diagnose(rate: str, s: dict) -> list[str]:
    """Why each row's time to fp16's final loss differs from fp16's: the steps it needed against
    fp16's, times its step time against fp16's; the step against compute alone split into the main
    thread's extra CPU (codec, hooks, Python) and the rest (wire and waits)."""
    base = s["rows"][BASELINE]
    local, local_cpu = s["local_step_s"], s["local_cpu_main_s"]
    lines = [f"Why, at {rate} (time to fp16's final loss = steps needed x time per step, each against fp16's):", ""]
    if local:
        lines.append(
            f"- {base['label']}: step {base['step_s'] * 1e3:.0f} ms = compute {local * 1e3:.0f} ms + "
            f"{(base['step_s'] - local) * 1e3:.0f} ms of exchange."
        )
    for key, e in s["rows"].items():
        if key == BASELINE:
            continue
        t, t0 = e["targets"][-1], base["targets"][-1]
        step_ratio = e["step_s"] / base["step_s"]
        if t["steps"] is None:
            steps = f"never reached in {t['seeds']} seed(s) (final loss {e['final_vs_fp16'][0]:+.4f} against fp16's)"
        else:
            steps = f"{t['steps']:.0f} steps against fp16's {t0['steps']:.0f} ({t['steps'] / t0['steps']:.2f}x)"
            if t["reached"] < t["seeds"]:
                steps += f", in {t['reached']} of {t['seeds']} seeds"
        where = ""
        if local and local_cpu is not None:
            extra = e["step_s"] - local
            codec = max(0.0, e["cpu_main_s"] - local_cpu)
            where = (
                f"; its step is compute {local * 1e3:.0f} ms + {extra * 1e3:.0f} ms of exchange, of which "
                f"{min(codec, extra) * 1e3:.0f} ms main-thread CPU beyond compute (codec, hooks) and "
                f"{max(0.0, extra - codec) * 1e3:.0f} ms wire and waits"
            )
        lines.append(f"- {e['label']}: {steps}; step time {step_ratio:.2f}x fp16's{where}.")
    return lines


def target_checks(summary: dict) -> list[str]:
    """The study's targets, met or missed: at 100 Mbit/s ALQ 3 bits reaches fp16's final loss in at
    most 0.6x fp16's time and before PowerSGD at matched bytes; at 1 Gbit/s, every target in at
    most 1.0x fp16's time. A target counts as reached only where every seed reached it."""

    def target(rate, key, i):
        return summary[rate]["rows"][key]["targets"][i]

    def said(t) -> str:
        if t["seconds"] is None:
            return f"not reached (0/{t['seeds']} seeds)"
        part = "" if t["reached"] == t["seeds"] else f" in {t['reached']}/{t['seeds']} seeds"
        return f"{t['seconds'][0]:.1f} s, {t['ratio'][0]:.2f}x{part}"

    def full(t) -> bool:
        return t["ratio"] is not None and t["reached"] == t["seeds"]

    out = []
    rows = summary.get("100mbit", {}).get("rows", {})
    if "hvd-alq" in rows:
        t = target("100mbit", "hvd-alq", -1)
        out.append(
            f"- 100 Mbit/s, ALQ 3 bits to fp16's final loss in at most 0.6x fp16's time: {said(t)}; "
            f"{'met' if full(t) and t['ratio'][0] <= 0.6 else 'missed'}."
        )
        if "ddp-psgd" in rows:
            ahead = []
            for i, f in enumerate(TARGETS):
                a, b = target("100mbit", "hvd-alq", i), target("100mbit", "ddp-psgd", i)
                ahead.append(
                    a["reached"] > b["reached"]
                    or (a["reached"] == b["reached"] > 0 and a["seconds"][0] < b["seconds"][0])
                )
                out.append(f"  - to the {f:.0%} target: ALQ {said(a)}; PowerSGD at matched bytes {said(b)}")
            out.append(
                "- 100 Mbit/s, ALQ ahead of PowerSGD at matched bytes (more seeds reaching each target, or as many "
                f"and sooner): {'met' if all(ahead) else 'missed'} ({sum(ahead)} of {len(ahead)} targets)."
            )
    if "hvd-alq" in summary.get("1gbit", {}).get("rows", {}):
        ts = [target("1gbit", "hvd-alq", i) for i in range(len(TARGETS))]
        met = all(full(t) and t["ratio"][0] <= 1.0 for t in ts)
        out.append(
            "- 1 Gbit/s, ALQ 3 bits to every target in at most 1.0x fp16's time: "
            + "; ".join(said(t) for t in ts)
            + f"; {'met' if met else 'missed'}."
        )
    return out


def plot(runs: list[dict], summary: dict, path: Path) -> bool:
    """Held-out loss against wall-clock seconds, one panel per rate: mean over seeds (time and loss
    at each evaluation step), a band of ± one standard error of the loss."""
    try:
        plt = pages.pyplot()
    except ImportError:
        return False
    rates = list(summary)
    fig, axes = plt.subplots(1, len(rates), figsize=(6.5 * len(rates), 4.5), squeeze=False)
    for ax, rate in zip(axes[0], rates):
        group = [r for r in runs if r["rate"] == rate]
        for key in summary[rate]["rows"]:
            steps = [s for s, _ in group[0]["rows"][key]["curve"]]
            ts = [statistics.fmean(cumulative(r["rows"][key]["step_s"])[s - 1] for r in group) for s in steps]
            per = [[r["rows"][key]["curve"][i][1] for r in group] for i in range(len(steps))]
            mean = [statistics.fmean(v) for v in per]
            se = [statistics.stdev(v) / math.sqrt(len(v)) if len(v) > 1 else 0.0 for v in per]
            (line,) = ax.plot(ts, mean, marker=".", label=LABELS[key], lw=2.2 if key in (BASELINE, "hvd-alq") else 1.2)
            low, high = [m - e for m, e in zip(mean, se)], [m + e for m, e in zip(mean, se)]
            ax.fill_between(ts, low, high, alpha=0.2, color=line.get_color())
        for t in summary[rate]["rows"][BASELINE]["targets"]:
            ax.axhline(t["loss"], color="grey", ls=":", lw=0.8)
        ax.set_title(f"{rate} between nodes, {len(group)} seed(s)")
        ax.set_xlabel("wall-clock training seconds (evaluation excluded)")
        ax.set_ylabel("held-out loss (nats/char)")
        low = min(t["loss"] for t in summary[rate]["rows"][BASELINE]["targets"])
        ax.set_ylim(low - 0.15, low + 0.9)
        ax.legend(fontsize=7)
    pages.save(fig, path)
    return True


def report(args, argv, runs: list[dict], summary: dict, plotted: bool, date: str) -> str:
    """The page: ``args`` and ``argv`` those of the runs (their first's), ``date`` theirs."""
    first = runs[0]
    layout = first.get("layout") or f"{first['size']} ranks on one host's loopback"
    layout = layout.replace(f"; {first['rate']} links between nodes", "; shaped links between them")
    lines = [
        "# Time to accuracy on slow links",
        "",
        f"Generated by `python -m scripts.study.time_to_accuracy {shlex.join(argv)}` (runs of {date}); "
        f"this machine: {os.cpu_count()} cores "
        f"({platform.processor() or platform.machine()}), Python {platform.python_version()}, torch {first['torch']}, "
        f"Horovod {first['horovod']}. {first['size']} ranks as {layout}; the character GPT "
        f"(width {args.width}, {args.layers} layers, context {args.context}, {first['params']:,} parameters), "
        f"{args.batch_size} sequences per rank and step, {OPTIMIZERS[args.optimizer]} (lr {args.lr}, warm-up, cosine), "
        f"gradient norm clipped to {args.clip:g} (after the average), "
        f"{args.steps} steps, held-out loss every {args.eval_every} steps on {args.eval_windows} windows.",
        "",
    ]
    if args.stretch != 1:
        lines += [
            f"**Stretched (MLPerf's rule):** every row but fp16 trains {row_steps(args, 'hvd-alq')} steps "
            f"({args.stretch:g}x fp16's {args.steps}), its warm-up the same and its cosine decay to its own end; "
            "the targets stay fp16's, so the 100% column is each row's time to fp16's final loss within "
            f"{args.stretch:g}x fp16's steps, and the final loss column compares each row's own end with fp16's.",
            "",
        ]
    lines += [
        "Every row runs in the same processes, step by step in turn, on the same seeds and batches; its clock "
        "sums its own steps' times (the slowest rank's), evaluation and barriers excluded. All ranks share the "
        "machine's cores, so compute is slower than on a node of its own, which makes the exchange a smaller "
        "share of the step than on a real cluster of this network. Each run's JSON is in "
        f"`data/{STEM}_raw/` beside this page (this page again: the same command with `--aggregate-only`); "
        "the ranks' per-step logs stay beside them on the machine that ran them (`*_logs/`, not kept).",
        "",
    ]
    checks = target_checks(summary)
    if checks:
        lines += ["Targets (ALQ 3 bits with default settings, the mean ratio over seeds):", "", *checks, ""]
    bf16 = next((s["rows"]["ddp-bf16"] for s in summary.values() if "ddp-bf16" in s["rows"]), None)
    example = (
        f" (DDP's bf16 hook, the same 16-bit exchange in all but rounding, ends {bf16['final_vs_fp16'][0]:+.4f} "
        f"from it and reaches it in {bf16['targets'][-1]['reached']} of {bf16['targets'][-1]['seeds']} seeds)"
        if bf16
        else ""
    )
    lines += [
        "The 100% target is fp16's own final loss: a row that ends level with fp16 within the noise of "
        f"the held-out loss can miss it by a thousandth of a nat{example}; the 50% and 75% targets are the "
        "robust comparison, and the final loss column says how far each row ends from fp16.",
        "",
    ]
    if plotted:
        lines += [f"![held-out loss against seconds]({STEM}.png)", ""]
    for rate, s in summary.items():
        tp = s["throughput_Bps"]
        lines += [
            f"## {rate}" + (f" (TCP throughput between nodes {tp * 8 / 1e6:.0f} Mbit/s)" if tp else ""),
            "",
            f"Seeds {', '.join(str(x) for x in s['seeds'])}. Time to each target in seconds (mean ± s.e. over seeds), "
            "its ratio to fp16's (per seed; below 1 is sooner):",
            "",
            *rate_table(rate, s),
            "",
            "Where the step goes (medians over steps and seeds; the main thread runs forward, backward, the "
            "hooks' codecs and the optimizer; the other threads Horovod's background loop, MPI and gloo):",
            "",
            *profile_table(s),
            "",
        ]
        if s["local_step_s"]:
            share = 1 - s["local_step_s"] / s["rows"][BASELINE]["step_s"]
            lines += [
                f"The exchange's share of fp16's step at {rate}: {share:.0%} (1 - compute alone / fp16's step).",
                "",
            ]
        lines += [*diagnose(rate, s), ""]
        worst = max(e["max_param_diff"] for e in s["rows"].values())
        lines += [f"Largest parameter difference between ranks after training, any row: {worst:.3g}.", ""]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------- driver
def worker_command(args, out: Path, log_dir: Path, ifname: str, seed: int) -> list[str]:
    cmd = [sys.executable, "-m", "scripts.study.time_to_accuracy", "--worker", "--worker-out", str(out)]
    cmd += ["--log-dir", str(log_dir), "--gloo-ifname", ifname, "--seed", str(seed), "--rows", args.rows]
    names = ("steps", "eval_every", "eval_windows", "batch_size", "context", "width", "layers", "heads", "lr", "clip")
    names += ("optimizer", "stretch")
    cmd += launching.flags(args, *names)
    if ifname != "lo":
        cmd += ["--count-ifname", ifname]
    return cmd


def launch(args, tmp: Path, rate: str, seed: int, data: Path) -> dict:
    """One run (all rows) at ``rate`` with ``seed``: in the namespaces, or on the loopback (--local)."""
    name = f"{rate}_s{seed}"
    logs = data / f"{STEM}_logs" / name
    logs.mkdir(parents=True, exist_ok=True)
    cmd = lambda out, ifname: worker_command(args, out, logs, ifname, seed)
    if args.local:
        run = net.run_local(args, tmp, args.np, cmd, logs / "mpirun.log", tag=name)
    else:
        run = net.run_netns(args, tmp, args.nodes, rate, cmd, logs / "mpirun.log", suffix=f"_s{seed}")
    run.update(rate=rate, seed=seed)
    if not args.local:
        run["layout"] = f"{args.nodes} nodes x {args.ranks_per_node} ranks (namespaces; shaped links between them)"
    return run


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = p.add_argument
    add("--quick", action="store_true", help="defaults: " + ", ".join(f"{k} {v}" for k, v in QUICK.items()))
    add("--layout", help=f"KxG: K nodes (namespaces) of G ranks; default {FULL['layout']}")
    add("--rates", help=f"tc rates of the links between nodes; default {FULL['rates']}")
    add("--seeds", help=f"default {FULL['seeds']}")
    add("--steps", type=int, help=f"steps per row; default {FULL['steps']}")
    add("--eval-every", type=int, help=f"steps between evaluations; default {FULL['eval_every']}")
    add("--stretch", type=float, default=1.0, help="every row but fp16 trains this many times --steps; default 1")
    add("--rows", default=",".join(DEFAULT_ROWS), help=f"from {','.join(ROWS)}; default {','.join(DEFAULT_ROWS)}")
    add("--batch-size", type=int, default=8, help="sequences per rank and step; default 8")
    add("--context", type=int, default=64, help="default 64")
    add("--width", type=int, default=128, help="default 128")
    add("--layers", type=int, default=4, help="default 4")
    add("--heads", type=int, default=4, help="default 4")
    add("--optimizer", choices=sorted(OPTIMIZERS), default="adamw", help="default adamw")
    add("--lr", type=float, help=f"peak lr; default {LR['adamw']} (AdamW), {LR['sgd']} (SGD, tuned for fp32)")
    add("--clip", type=float, default=1.0, help="clip the averaged gradient's norm to this (0: no clipping); default 1")
    add("--eval-windows", type=int, default=256, help="held-out windows per evaluation; default 256")
    add("--local", action="store_true", help="no namespaces: --np ranks on the loopback (no root)")
    add("--np", type=int, default=2, help="ranks with --local; default 2")
    add("--out-dir", default="build/results", help="report, plot, data/; default build/results")
    add("--stem", default=STEM, help=f"name of the page, plot and data; default {STEM}")
    add("--timeout", type=float, help="seconds per run; default 7200 (--quick 1200)")
    add("--aggregate-only", action="store_true", help="rebuild the report from the runs' JSON")
    add("--fresh", action="store_true", help="run again what has its JSON already (make bench)")
    add("--baseline-from", help="a raw directory of an earlier run: its fp16 row joins each run of its rate and seed")
    add("--teardown-only", action="store_true", help="remove leftover namespaces")
    add("--worker", action="store_true", help=argparse.SUPPRESS)
    add("--worker-out", help=argparse.SUPPRESS)
    add("--log-dir", help=argparse.SUPPRESS)
    add("--seed", type=int, default=0, help=argparse.SUPPRESS)
    add("--gloo-ifname", default="lo", help=argparse.SUPPRESS)
    add("--count-ifname", help=argparse.SUPPRESS)
    return p


def parse(p: argparse.ArgumentParser, argv: list[str]):
    args = p.parse_args(argv)
    net.apply_defaults(args, QUICK, FULL)
    if args.lr is None:
        args.lr = LR[args.optimizer]
    return args


def check(p: argparse.ArgumentParser, args) -> None:
    unknown = [r for r in args.rows.split(",") if r not in ROWS]
    if unknown or (BASELINE not in args.rows.split(",")) == (args.baseline_from is None):
        base = f"with {BASELINE} (the baseline), or without it and with --baseline-from"
        p.error(f"--rows: choose from {ROWS}, {base}; unknown: {unknown}")
    if not 1.0 <= args.stretch <= 4.0:
        p.error(f"--stretch {args.stretch}: from 1 to 4 (times fp16's steps)")
    for f in TARGETS:
        step = round(f * args.steps)
        if step % args.eval_every and step != args.steps:
            p.error(f"--eval-every {args.eval_every} must divide {step} ({f:.0%} of --steps {args.steps})")
    try:
        args.nodes, args.ranks_per_node = (int(v) for v in args.layout.lower().split("x"))
    except ValueError:
        p.error(f"--layout {args.layout!r}: expected KxG, e.g. 2x2")


def run_all(args, argv: list[str], raw: Path, data: Path, rates: list[str], seeds: list[int]) -> int | None:
    """Every (rate, seed) run whose JSON is not in ``raw`` yet (all with --fresh); an exit status to
    stop with, or None."""
    todo = [(r, s) for r in rates for s in seeds if args.fresh or not (raw / f"{r}_s{s}.json").exists()]
    if not todo:
        return None
    if not args.local:
        status = net.preflight("scripts.study.time_to_accuracy", args.teardown_only, "; --local runs without")
        if status is not None:
            return status

    def each(tmp: Path, rate: str | None, bps: float | None) -> list:
        rate = rate or "loopback"
        for seed in [s for r, s in todo if r == rate]:
            run = launch(args, tmp, rate, seed, data)
            run.update(throughput_Bps=bps, argv=argv)
            if args.baseline_from:  # fp16's row of the earlier run, same rate and seed
                earlier = json.loads((Path(args.baseline_from) / f"{rate}_s{seed}.json").read_text())
                run["rows"] = {BASELINE: earlier["rows"][BASELINE], **run["rows"]}
                run["baseline_from"] = args.baseline_from
            (raw / f"{rate}_s{seed}.json").write_text(json.dumps(run))
        return []

    net.sweep(args.local, [r for r in rates if any(r == t for t, _ in todo)], args.nodes, "alqtta-", each)
    return None


def main(argv=None) -> int:
    global STEM
    argv = list(sys.argv[1:] if argv is None else argv)
    p = parser()
    args = parse(p, argv)
    if args.worker:
        return worker(args)
    STEM = args.stem
    check(p, args)
    if args.teardown_only:  # nothing else: not the page either
        return net.preflight("scripts.study.time_to_accuracy", True) or 0
    out_dir = Path(args.out_dir)
    data = out_dir / "data"
    raw = data / f"{STEM}_raw"
    raw.mkdir(parents=True, exist_ok=True)
    rates = ["loopback"] if args.local else args.rates.split(",")
    seeds = [int(s) for s in args.seeds.split(",")]
    start = time.monotonic()
    if not args.aggregate_only:
        status = run_all(args, argv, raw, data, rates, seeds)
        if status is not None:
            return status
    files = [raw / f"{r}_s{s}.json" for r in rates for s in seeds if (raw / f"{r}_s{s}.json").exists()]
    runs = [json.loads(f.read_text()) for f in files]
    if not runs:
        print("no runs to report", file=sys.stderr)
        return 1
    summary = summarize(runs)
    plotted = plot(runs, summary, out_dir / f"{STEM}.png")
    shown = runs[0].get("argv", argv)  # the runs' own command line, also when only aggregating
    days = sorted({datetime.date.fromtimestamp(f.stat().st_mtime).isoformat() for f in files})
    text = report(parse(p, shown), shown, runs, summary, plotted, " to ".join(dict.fromkeys([days[0], days[-1]])))
    (out_dir / f"{STEM}.md").write_text(text)
    (data / f"{STEM}.json").write_text(json.dumps({"argv": argv, "summary": summary}, indent=1))
    print(text)
    print(f"({time.monotonic() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
