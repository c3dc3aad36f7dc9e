#!/usr/bin/env python
"""Preconditioned quantization under AdamW (issue 69), in one process: the character GPT of
scripts/demo/train_gpt.py (828k parameters), ``--workers`` simulated workers each with its own
batches, their gradients quantized one tensor at a time with the NumPy core's quantizer (the
levels refit from every worker's statistics at ``--update-steps``), averaged, clipped to norm 1 and
applied by AdamW (warm-up, cosine). Every row of a seed starts from the same model and sees the
same batches; only the exchange differs.

Rows: ``fp32`` (exact average), ``alq@<bits>`` (plain), ``alq@<bits>+pre[:k=v,...]`` (quantize
``g * w`` and divide the decoded average by ``w``, :class:`horovod_alq.torch.Preconditioner` on the
run's AdamW; keys ``floor``, ``alpha``, ``cap``, ``start``: :class:`horovod_alq.core.precondition.Form`;
``refit=1``: also refit the levels at the step preconditioning starts; ``after=K``: refit ``K`` steps
after it, as ``Form(refit=K)`` does in the front-ends; ``exact=K`` (also ``alq@3:exact=K``): the
exact average in the first ``K`` steps, quantized from step ``K`` on). ``--node-size G``: the hierarchical
exchange's arithmetic instead, the float32 sums of ``G`` consecutive workers each quantized once.

Per step it records the Adam-space error ``sum_i (g^_i - g_i)^2 / v_hat_i`` over the signal
``sum_i g_i^2 / v_hat_i`` (``v_hat`` before the step, from step 2 on) and the largest bucket crest
factor ``max|x| / rms(x)`` of what was quantized (and the tensor that holds it).

``--model cnn``: the same loop on the demo's MNIST CNN (scripts/common/cnn.py, 80k parameters, the
4,000 training digits of ``load_digits(seed)``, 32 a worker and step) under torch.optim.Adam (betas
0.9, 0.999, no weight decay: the demo's ``--optimizer adam``), the held-out loss and accuracy over
the 1,000 test digits.

    python -m scripts.study.precondition_gpt --rows "fp32;alq@3;alq@3+pre" --seeds 0,1,2,3,4 \
        --json docs/results/data/precondition_gpt_runs.jsonl
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np
import torch


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="fp32;alq@3;alq@3+pre", help="rows separated by semicolons (see above)")
    p.add_argument("--seeds", default="0", help="comma-separated seeds")
    p.add_argument("--steps", type=int, default=240)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument(
        "--node-size",
        type=int,
        default=1,
        help="quantize the float32 sums of this many consecutive workers (the hierarchical exchange's "
        "node sums, once each) instead of each worker's own gradient; 1: each worker's",
    )
    p.add_argument("--model", choices=("gpt", "cnn"), default="gpt")
    p.add_argument("--batch-size", type=int, default=None, help="sequences (digits) per worker and step; 16 (32)")
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--clip", type=float, default=1.0, help="gradient norm clip (0: none)")
    p.add_argument("--bucket-size", type=int, default=8192)
    p.add_argument("--min-size", type=int, default=1024)
    p.add_argument("--update-steps", default="0,100")
    p.add_argument("--eval-every", type=int, default=60)
    p.add_argument("--eval-windows", type=int, default=256)
    p.add_argument("--json", required=True, help="JSON lines, one per (row, seed); runs already there are skipped")
    p.add_argument("--tag", default="", help="a label stored with every run (e.g. the lr sweep's)")
    p.add_argument(
        "--report", action="store_true", help="print the Markdown tables of the runs in --json (comma-separated files)"
    )
    p.add_argument("--quick", action="store_true", help="3 steps, 2 workers, a 1-layer model of width 32")
    args = p.parse_args(argv)
    if args.node_size < 1 or args.workers % args.node_size:
        p.error(f"--node-size must divide --workers ({args.workers}), got {args.node_size}")
    if args.batch_size is None:
        args.batch_size = 32 if args.model == "cnn" else 16
    if args.quick:
        args.steps, args.workers, args.width, args.layers, args.heads = 3, 2, 32, 1, 2
        args.eval_windows, args.eval_every, args.update_steps = 8, 3, "0,2"
    return args


def parse_row(spec: str) -> dict:
    """``alq@3+pre:floor=0.1,start=5`` -> method, bits, and the preconditioning form's keys."""
    if spec == "fp32":
        return {"spec": spec, "method": None}
    base, _, pre = spec.partition("+")
    base, _, base_opts = base.partition(":")
    method, _, bits = base.partition("@")
    row = {"spec": spec, "method": method, "bits": int(bits), "pre": None, "refit": False, "after": None, "exact": 0}
    for kv in filter(None, base_opts.split(",")):
        k, _, v = kv.partition("=")
        if k != "exact":
            raise SystemExit(f"{spec!r}: unknown key {k!r}")
        row["exact"] = int(v)
    if pre:
        kind, _, opts = pre.partition(":")
        if kind != "pre":
            raise SystemExit(f"{spec!r}: only +pre[:k=v,...] is known")
        form = {}
        for kv in filter(None, opts.split(",")):
            k, _, v = kv.partition("=")
            if k == "refit":
                row["refit"] = bool(int(v))
            elif k == "exact":
                row["exact"] = int(v)
            elif k == "after":
                row["after"] = int(v)
            elif k in ("floor", "alpha", "prior"):
                form[k] = float(v)
            elif k == "cap":
                form[k] = None if v == "none" else float(v)
            elif k in ("start", "every"):
                form[k] = int(v)
            else:
                raise SystemExit(f"{spec!r}: unknown key {k!r}")
        row["pre"] = form
    return row


def _task(seed: int, args, data):
    """``--model``'s model, optimizer, ``loss(generator)`` (one worker's batch) and held-out
    ``evaluate() -> (loss, accuracy or None)``."""
    if args.model == "cnn":
        import torch.nn.functional as F

        from scripts.common.cnn import Net, load_digits

        train_x, train_y, test_x, test_y = load_digits(seed)
        torch.manual_seed(seed)
        model = Net()
        opt = torch.optim.Adam(model.parameters(), lr=args.lr)

        def loss(gen):
            idx = torch.randint(0, len(train_x), (args.batch_size,), generator=gen)
            return F.cross_entropy(model(train_x[idx]), train_y[idx])

        def evaluate():
            with torch.no_grad():
                logits = model(test_x)
            return float(F.cross_entropy(logits, test_y)), float((logits.argmax(1) == test_y).float().mean())

        return model, opt, loss, evaluate
    from scripts.common.gpt import GPT, sample_batch
    from scripts.common.gpt import evaluate as gpt_evaluate

    train_ids, val_ids, chars = data
    torch.manual_seed(seed)
    model = GPT(len(chars), args.width, args.layers, args.heads, args.context)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay, betas=(0.9, 0.95))
    return (
        model,
        opt,
        lambda gen: model.loss(*sample_batch(train_ids, args.batch_size, args.context, gen)),
        lambda: (gpt_evaluate(model, val_ids, args), None),
    )


def train(row: dict, seed: int, args, data) -> dict:
    from horovod_alq.core.precondition import Form
    from horovod_alq.core.quantizer import Quantizer
    from horovod_alq.torch.precondition import Preconditioner
    from scripts.common.gpt import lr_at

    model, opt, batch_loss, evaluate = _task(seed, args, data)
    params = list(model.parameters())
    names = [n for n, _ in model.named_parameters()]
    gens = [torch.Generator().manual_seed(seed * 1000 + k) for k in range(args.workers)]
    quantized = row["method"] is not None
    q = Quantizer(row["method"], row["bits"], args.bucket_size) if quantized else None
    pre = None
    if quantized and row["pre"] is not None:
        pre = Preconditioner(opt, form=Form(**row["pre"]), bucket_size=args.bucket_size)
    start = pre.form.start if pre is not None else 0
    refits = set(int(s) for s in args.update_steps.split(",") if s.strip())
    if row.get("refit") and start > 0:
        refits.add(start)
    if row.get("after") is not None and pre is not None:
        refits.add(start + row["after"])
    if row.get("exact"):  # the first quantized step fits the levels, as step 0 does otherwise
        refits = {max(s, row["exact"]) for s in refits}
    per_node = args.node_size
    nodes = [list(range(j, j + per_node)) for j in range(0, args.workers, per_node)]  # what is quantized
    curve, err_ratio, crest, crest_at, accuracy = [], [], [], [], None
    t0 = time.perf_counter()
    for step in range(args.steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args)
        grads = []
        for k in range(args.workers):
            model.zero_grad(set_to_none=True)
            batch_loss(gens[k]).backward()
            grads.append([p.grad.detach().clone() for p in params])
        exact = [sum(gs[i] for gs in grads) / args.workers for i in range(len(params))]
        if quantized and step >= row["exact"]:
            if pre is not None:
                pre.prepare(step)
            stats, out, worst = None, [], (0.0, "")
            for i, p in enumerate(params):
                if p.numel() < args.min_size:
                    out.append(exact[i])
                    continue
                w = pre.scale(p) if pre is not None else None
                total = np.zeros(p.numel(), np.float32)
                for k, node in enumerate(nodes):
                    xk = grads[node[0]][i].reshape(-1).numpy()
                    for m in node[1:]:  # the node's float32 sum, in rank order
                        xk = xk + grads[m][i].reshape(-1).numpy()
                    if w is not None:
                        xk = xk * w.reshape(-1).numpy()
                    rng = np.random.default_rng([seed, step, k, i])
                    total += q.decode(q.encode(xk, rng))
                    if step in refits:
                        s = q.statistics(xk)
                        stats = s if stats is None else stats + s
                    c = _crest(xk, args.bucket_size)
                    if c > worst[0]:
                        worst = (c, names[i])
                avg = torch.from_numpy(total / args.workers).view_as(p)
                out.append(avg / w if w is not None else avg)
            if step in refits and stats is not None:
                q.adapt(stats)
            crest.append(round(worst[0], 2))
            crest_at.append(worst[1])
            err_ratio.append(_adam_error(opt, params, out, exact))
        else:
            out = exact
        for p, g in zip(params, out):
            p.grad = g.clone()
        if args.clip > 0:
            torch.nn.utils.clip_grad_norm_(params, args.clip)
        opt.step()
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            loss, accuracy = evaluate()
            curve.append([step + 1, loss])
    result = {
        "spec": row["spec"],
        "seed": seed,
        "eval_loss": curve[-1][1],
        "curve": curve,
        "adam_error": err_ratio,
        "crest": crest,
        "crest_at": crest_at,
        "levels": None if q is None else [float(v) for v in q.levels],
        "seconds": time.perf_counter() - t0,
    }
    if accuracy is not None:
        result["accuracy"] = accuracy
    return result


def _crest(x: np.ndarray, d: int) -> float:
    """The largest ``max|x| / rms(x)`` over the buckets of ``x``."""
    n = x.size
    pad = np.concatenate([np.abs(x), np.zeros((-n) % d, np.float32)]).reshape(-1, d)
    rms = np.sqrt((pad.astype(np.float64) ** 2).sum(1) / np.minimum(d, n - d * np.arange(pad.shape[0])))
    peak = pad.max(1)
    ok = rms > 0
    return float((peak[ok] / rms[ok]).max()) if ok.any() else 0.0


def _adam_error(opt, params, out, exact) -> float | None:
    """``sum (g^ - g)^2 / v_hat`` over ``sum g^2 / v_hat`` (v_hat before this step; None before any)."""
    num = den = 0.0
    for p, a, e in zip(params, out, exact):
        st = opt.state.get(p)
        if not st:
            return None
        b2 = opt.param_groups[0]["betas"][1]
        v = st["exp_avg_sq"] / (1 - b2 ** int(st["step"])) + 1e-16
        num += float(((a - e) ** 2 / v).sum())
        den += float((e**2 / v).sum())
    return round(num / den, 5)


def report(runs: list[dict], against: str = "alq@3", key: str = "eval_loss") -> list[str]:
    """Markdown lines: the final loss (``key="accuracy"``: accuracy, higher is better) per row and
    seed, the same-seed differences to fp32 and, for a preconditioned row, to its plain row
    (``alq@2+pre`` to ``alq@2``; mean, standard error over seeds, wins), and fp32's seed-to-seed
    standard error. ``against`` is listed second. Runs at several learning rates: rows per lr,
    compared within their lr."""
    lrs = {r.get("lr") for r in runs}

    def label(spec: str, lr) -> str:
        return spec if len(lrs) < 2 else f"{spec} lr={lr:g}"

    by, spec_lr = {}, {}
    for r in runs:
        by.setdefault(label(r["spec"], r.get("lr")), {})[r["seed"]] = r[key]
        spec_lr[label(r["spec"], r.get("lr"))] = (r["spec"], r.get("lr"))
    sign, what = (-1, "accuracy") if key == "accuracy" else (1, "loss")
    rank = {"fp32": (0, ""), against: (1, "")}
    specs = sorted(by, key=lambda s: (spec_lr[s][1] or 0, rank.get(spec_lr[s][0], (2, spec_lr[s][0]))))
    seeds = sorted({k for v in by.values() for k in v})
    lines = ["| row | " + " | ".join(f"seed {k}" for k in seeds) + " | mean |", "|---|" + "---:|" * (len(seeds) + 1)]
    for s in specs:
        vals = [by[s].get(k) for k in seeds]
        done = [v for v in vals if v is not None]
        cells = [f"{v:.4f}" if v is not None else "-" for v in vals]
        lines.append(f"| `{s}` | " + " | ".join(cells) + f" | {np.mean(done):.4f} |")
    for s in (s for s in specs if spec_lr[s][0] == "fp32"):
        base = [by[s][k] for k in seeds if k in by[s]]
        if len(base) > 1:
            se = np.std(base, ddof=1) / math.sqrt(len(base))
            lines += ["", f"{s}'s final {what} over {len(base)} seeds: {np.mean(base):.4f}, standard error {se:.4f}."]
    lines += [
        "",
        "| row | against | seeds | mean difference | standard error | better on | worst |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for s in specs:
        spec, lr = spec_lr[s]
        for ref in (label("fp32", lr), label(spec.partition("+")[0], lr)):
            if s == ref or ref not in by:
                continue
            common = [k for k in seeds if k in by[s] and k in by[ref]]
            if not common:
                continue
            d = np.array([by[s][k] - by[ref][k] for k in common])
            se = d.std(ddof=1) / math.sqrt(len(d)) if len(d) > 1 else float("nan")
            wins = f"{int((sign * d < 0).sum())} of {len(d)}"
            worst = d[np.argmax(sign * d)]
            lines.append(f"| `{s}` | `{ref}` | {len(d)} | {d.mean():+.4f} | {se:.4f} | {wins} | {worst:+.4f} |")
    return lines


def diagnostics(runs: list[dict]) -> list[str]:
    """Markdown lines, one row per quantized row (all its runs): the mean over runs of each run's
    largest crest factor in steps 1-5 and of its median crest factor, and the Adam-space error over
    signal in steps 1-30 and 31 on (mean and median over every step of every run)."""
    by, nan = {}, float("nan")
    for r in runs:
        if r["spec"] != "fp32":
            by.setdefault(r["spec"], []).append(r)
    lines = [
        "| row | runs | worst crest, steps 1-5 | median crest, all steps | Adam-space error / signal, steps 1-30 "
        "| steps 31 on | median, steps 1-30 | median, steps 31 on |",
        "|---|" + "---:|" * 7,
    ]
    for spec, rs in sorted(by.items()):
        early = [v for r in rs for v in r["adam_error"][1:31] if v is not None]
        late = [v for r in rs for v in r["adam_error"][31:] if v is not None]
        worst = np.mean([max(r["crest"][1:6], default=nan) for r in rs])
        crest = (worst, np.mean([np.median(r["crest"]) for r in rs]))
        errs = [f(x) if x else nan for f in (np.mean, np.median) for x in (early, late)]
        lines.append(
            f"| `{spec}` | {len(rs)} | {crest[0]:.1f} | {crest[1]:.1f} | " + " | ".join(f"{e:.3f}" for e in errs) + " |"
        )
    return lines


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.report:
        runs = [json.loads(line) for path in args.json.split(",") for line in Path(path).read_text().splitlines()]
        print("\n".join(report(runs)))
        if all("accuracy" in r for r in runs):
            print("\nAccuracy:\n\n" + "\n".join(report(runs, key="accuracy")))
        print("\nDiagnostics:\n\n" + "\n".join(diagnostics(runs)))
        return 0
    torch.set_num_threads(1)
    from scripts.common.gpt import char_splits

    data = char_splits() if args.model == "gpt" else None
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    done = set()
    if out.exists():
        for line in out.read_text().splitlines():
            r = json.loads(line)
            done.add((r["spec"], r["seed"], r.get("tag", ""), r.get("lr"), r.get("warmup"), r.get("model", "gpt")))
    for seed in (int(s) for s in args.seeds.split(",")):
        for spec in args.rows.split(";"):
            if (spec, seed, args.tag, args.lr, args.warmup, args.model) in done:
                continue
            r = train(parse_row(spec), seed, args, data)
            r.update(tag=args.tag, lr=args.lr, warmup=args.warmup, steps=args.steps)
            r.update(batch_size=args.batch_size, node_size=args.node_size, model=args.model)
            if not math.isfinite(r["eval_loss"]):
                r["diverged"] = True
            with out.open("a") as f:
                f.write(json.dumps(r) + "\n")
            print(f"{spec:>28} seed {seed}: {r['eval_loss']:.4f} ({r['seconds']:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
