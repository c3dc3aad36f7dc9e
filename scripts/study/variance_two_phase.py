#!/usr/bin/env python
"""Variance of the two-phase exchange's estimate against allgather's for N simulated workers
on real gradients of the demo CNN (NumPy core only): normalized variance (exact for allgather,
sampled for two-phase) and sampled unbiasedness checks, for each second quantizer of VARIANTS.
Settings and results: docs/results/variance_training.md#variance_two_phase.

    python -m scripts.study.variance_two_phase --out build/results/variance_two_phase.md
    python -m scripts.study.variance_two_phase --quick
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from horovod_alq.core import Quantizer
from horovod_alq.core.methods import get_method
from horovod_alq.core.statistics import normalize
from scripts.common import report as pages
from scripts.common.cnn import Net, load_digits

LABELS = {"alq": "ALQ", "amq": "AMQ", "qsgdinf": "QSGDinf"}
VARIANTS = ("a", "a0", "b", "b2", "c", "c2")
VARIANT_NAMES = {
    "allgather": "allgather",
    "a": "two-phase (a) reuse first levels",
    "a0": "two-phase (a0) initial levels, no refit",
    "b": "two-phase (b) adapted second levels",
    "b2": "two-phase (b') adapted, S of the new first levels",
    "c": "two-phase (c) 4-bit second, adapted",
    "c2": "two-phase (c') 4-bit second, adapted, S of the new first levels",
}


#: The fixed settings (kept with the options in the data): simulated worker counts N, first-phase bits
#: (and (a), (a0), (b)), variant (c)'s second bits, the CNN's batch and SGD lr (momentum 0.9).
SETTINGS = dict(methods="alq,amq,qsgdinf", workers="2,4,8", bits=3, bits_second=4, batch_size=32, lr=0.05, seed=0)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--buckets", default="8192,512", help="bucket sizes; default 8192,512")
    p.add_argument("--checkpoints", default="50,400,1000,2000", help="iterations to measure at; default %(default)s")
    p.add_argument("--draws", type=int, default=3, help="evaluation rounds per checkpoint; default 3")
    p.add_argument("--samples", type=int, default=2, help="draws of S per evaluation round; default 2")
    p.add_argument("--unbiased-samples", type=int, default=60, help="estimates per setting of the unbiasedness check")
    p.add_argument("--out", help="write the Markdown report here (and the raw numbers to data/<name>.json beside it)")
    p.add_argument("--quick", action="store_true", help="checkpoints 20, 60, 2 draws, bucket 8192, 20 unbiased samples")
    args = p.parse_args(argv)
    vars(args).update(SETTINGS)
    if args.quick:
        args.checkpoints, args.draws, args.samples, args.buckets, args.unbiased_samples = "20,60", 2, 2, "8192", 20
    return args


# --------------------------------------------------------------------------- exact variances
def coord_variance(levels: np.ndarray, x: np.ndarray, bucket: int, norm: str) -> np.ndarray:
    """Per-coordinate variance n_b^2 (hi - r)(r - lo) of unbiased stochastic rounding of ``x``."""
    nz = normalize(x, bucket, norm)
    r = nz.r.reshape(-1)[: x.size]
    n = np.repeat(np.nan_to_num(nz.norms.astype(np.float64)), bucket)[: x.size]
    cell = np.clip(np.searchsorted(levels, r, side="right") - 1, 0, levels.size - 2)
    return n**2 * (levels[cell + 1] - r) * (r - levels[cell])


def quantize(q: Quantizer, x: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """D(E(x)) through the core's wire format (float32)."""
    return q.decode(q.encode(x, rng=rng))


def norm_of(q: Quantizer) -> str:
    return get_method(q.method).norm


# --------------------------------------------------------------------------- the simulation
class Setting:
    """The quantizers of one (method, bucket, N): the first, and the second of every variant."""

    def __init__(self, method: str, bits: int, bits_second: int, bucket: int) -> None:
        self.q1 = Quantizer(method, bits=bits, bucket_size=bucket)
        self.second = {
            "a0": Quantizer(method, bits=bits, bucket_size=bucket),
            "b": Quantizer(method, bits=bits, bucket_size=bucket),
            "b2": Quantizer(method, bits=bits, bucket_size=bucket),
            "c": Quantizer(method, bits=bits_second, bucket_size=bucket),
            "c2": Quantizer(method, bits=bits_second, bucket_size=bucket),
        }

    def levels(self, variant: str) -> np.ndarray:
        return self.q1.levels if variant == "a" else self.second[variant].levels

    def quantizer(self, variant: str) -> Quantizer:
        return self.q1 if variant == "a" else self.second[variant]

    def refit(self, grads: list[np.ndarray], rng: np.random.Generator) -> None:
        """One refit round: first-phase statistics of the workers' gradients, second-phase
        statistics of the reduced sum made with the current first levels; then both refit."""
        q1 = self.q1
        if not get_method(q1.method).adaptive:
            return
        s = np.sum([quantize(q1, g, rng) for g in grads], axis=0, dtype=np.float32)
        stats1 = sum(q1.statistics(g) for g in grads)
        for key in ("b", "c"):
            q2 = self.second[key]
            q2.adapt(q2.statistics(s))
        q1.adapt(stats1)
        s_new = np.sum([quantize(q1, g, rng) for g in grads], axis=0, dtype=np.float32)
        for key in ("b2", "c2"):
            q2 = self.second[key]
            q2.adapt(q2.statistics(s_new))


def evaluate(st: Setting, grads: list[np.ndarray], samples: int, rng: np.random.Generator) -> dict:
    """Normalized variances of one evaluation round (exact allgather; two-phase averaged over S)."""
    n = len(grads)
    mean = np.sum([g.astype(np.float64) for g in grads], axis=0) / n
    msq = float(mean @ mean)
    q1 = st.q1
    ag = sum(float(coord_variance(q1.levels, g, q1.bucket_size, norm_of(q1)).sum()) for g in grads) / n**2
    out = {"allgather": ag / msq, "gnorm_ratio": float(np.mean([g.astype(np.float64) @ g for g in grads]) / msq)}
    extra = {v: 0.0 for v in VARIANTS}
    for _ in range(samples):
        s = np.sum([quantize(q1, g, rng) for g in grads], axis=0, dtype=np.float32)
        for v in VARIANTS:
            q2 = st.quantizer(v)
            extra[v] += float(coord_variance(q2.levels, s, q2.bucket_size, norm_of(q2)).sum()) / n**2 / samples
    for v in VARIANTS:
        out[v] = (ag + extra[v]) / msq
    return out


def unbiased_check(st: Setting, grads: list[np.ndarray], variant: str, repeats: int, rng: np.random.Generator) -> dict:
    """Sample ``repeats`` full two-phase estimates and test that their mean is the true mean."""
    n = len(grads)
    mean = np.sum([g.astype(np.float64) for g in grads], axis=0) / n
    q1, q2 = st.q1, st.quantizer(variant)
    ests = np.empty((repeats, mean.size))
    for r in range(repeats):
        s = np.sum([quantize(q1, g, rng) for g in grads], axis=0, dtype=np.float32)
        ests[r] = quantize(q2, s, rng).astype(np.float64) / n
    avg = ests.mean(axis=0)
    err = ests - mean
    total_var = float(((ests - avg) ** 2).sum() / (repeats - 1))  # trace of the covariance, estimated
    sq = float(((avg - mean) ** 2).sum())
    directions = {
        "mean": mean / np.linalg.norm(mean),
        "ones": np.ones_like(mean) / np.sqrt(mean.size),
        "random +-1": np.random.default_rng(7).choice([-1.0, 1.0], mean.size) / np.sqrt(mean.size),
    }
    tstats = {}
    for name, u in directions.items():
        proj = err @ u
        tstats[name] = float(proj.mean() / (proj.std(ddof=1) / np.sqrt(repeats)))
    return {
        "T": sq / (total_var / repeats),
        "rel_var": total_var / float(mean @ mean),
        "err_rel": float(np.sqrt(sq) / np.linalg.norm(mean)),
        "noise_rel": float(np.sqrt(total_var / repeats) / np.linalg.norm(mean)),
        "t": tstats,
    }


# --------------------------------------------------------------------------- training and driver
def main(argv=None) -> int:
    args = parse_args(argv)
    methods = args.methods.split(",")
    workers = [int(w) for w in args.workers.split(",")]
    buckets = [int(b) for b in args.buckets.split(",")]
    checkpoints = sorted(int(c) for c in args.checkpoints.split(","))
    torch.manual_seed(args.seed)
    train_x, train_y, _, _ = load_digits(args.seed)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    gen = torch.Generator().manual_seed(args.seed)
    sim = torch.Generator().manual_seed(args.seed + 1)  # the simulated workers' minibatches
    rng = np.random.default_rng(args.seed + 2)  # the rounding

    def gradient(generator) -> tuple[np.ndarray, float]:
        idx = torch.randint(0, len(train_x), (args.batch_size,), generator=generator)
        opt.zero_grad()
        loss = F.cross_entropy(model(train_x[idx]), train_y[idx])
        loss.backward()
        return torch.cat([p.grad.reshape(-1) for p in model.parameters()]).numpy().astype(np.float32), loss.item()

    settings = {
        (m, d, n): Setting(m, args.bits, args.bits_second, d) for m in methods for d in buckets for n in workers
    }
    results = {"|".join(map(str, k)): [] for k in settings}  # one dict per (checkpoint, draw)
    levels_log = {}
    unbiased = {}
    start = time.monotonic()
    t = 0
    for ck in checkpoints:
        while t < ck:  # train on the uncompressed gradient
            gradient(gen)
            opt.step()
            t += 1
        for n in workers:
            refit_grads = [gradient(sim)[0] for _ in range(n)]
            for m in methods:
                for d in buckets:
                    settings[(m, d, n)].refit(refit_grads, rng)
            for draw in range(args.draws):
                grads = [gradient(sim)[0] for _ in range(n)]
                for m in methods:
                    for d in buckets:
                        res = evaluate(settings[(m, d, n)], grads, args.samples, rng)
                        res.update(checkpoint=ck, draw=draw)
                        results[f"{m}|{d}|{n}"].append(res)
            for m in methods:
                for d in buckets:
                    st = settings[(m, d, n)]
                    levels_log[f"{m}|{d}|{n}|{ck}"] = {
                        "first": st.q1.levels.tolist(),
                        **{v: st.second[v].levels.tolist() for v in st.second},
                    }
        print(f"checkpoint {ck}: {time.monotonic() - start:.0f} s", flush=True)
    if args.unbiased_samples > 1:
        unbiased = unbiased_all(args, settings, methods, buckets[0], workers, lambda: gradient(sim)[0], rng)
        print(f"unbiasedness check: {time.monotonic() - start:.0f} s", flush=True)
    argv_text = " ".join(argv if argv is not None else sys.argv[1:])
    data = {"args": vars(args), "argv": argv_text, "wall_seconds": time.monotonic() - start, "results": results}
    data.update(levels=levels_log, unbiased=unbiased, date=datetime.datetime.now().strftime("%Y-%m-%d %H:%M"))
    text = report(data, methods, buckets, workers, checkpoints)
    print(text)
    if args.out:
        out = Path(args.out)
        (out.parent / "data").mkdir(parents=True, exist_ok=True)
        out.write_text(text)
        (out.parent / "data" / out.with_suffix(".json").name).write_text(json.dumps(data))
    return 0


def unbiased_all(args, settings: dict, methods, d: int, workers, gradient, rng) -> dict:
    """The sampled unbiasedness check of every method and worker count at bucket ``d``, at the
    product's defaults for equal and for 4 second bits."""
    grads_by_n = {n: [gradient() for _ in range(n)] for n in workers}
    out = {}
    for m in methods:
        for n in workers:
            for v in ("a", "c2"):
                out[f"{m}|{d}|{n}|{v}"] = unbiased_check(
                    settings[(m, d, n)], grads_by_n[n], v, args.unbiased_samples, rng
                )
    return out


def _mean(rows: list[dict], key: str, checkpoint: int | None = None) -> float:
    vals = [r[key] for r in rows if checkpoint is None or r["checkpoint"] == checkpoint]
    return float(np.mean(vals))


def report(data: dict, methods, buckets, workers, checkpoints) -> str:
    a = data["args"]
    res = data["results"]
    lines = [
        f"Command: `{('python -m scripts.study.variance_two_phase ' + data['argv']).strip()}`",
        f"Date: {data['date']}; {data['wall_seconds']:.0f} s wall.",
        "",
        f"Normalized variance E||est - mean||^2 / ||mean||^2 of the average of N workers' minibatch gradients "
        f"(batch {a['batch_size']} each, demo CNN, 80k parameters), first quantization {a['bits']} bits; mean over "
        f"{a['draws']} evaluation rounds at each of the checkpoints {', '.join(map(str, checkpoints))} "
        f"(training iterations). In brackets: two-phase / allgather.",
        "",
    ]
    for d in buckets:
        cols = [f"N={n}" for n in workers]
        lines += [
            f"**Bucket {d}**",
            "",
            "| method | exchange | " + " | ".join(cols) + " |",
            "|---|---|" + "---|" * len(cols),
        ]
        for m in methods:
            adaptive = get_method(m).adaptive
            for v in ("allgather", *VARIANTS):
                if not adaptive and v in ("a0", "b", "b2", "c2"):
                    continue  # fixed levels: identical to (a)
                cells = []
                for n in workers:
                    rows = res[f"{m}|{d}|{n}"]
                    val = _mean(rows, v)
                    cells.append(
                        f"{val:.3g}" if v == "allgather" else f"{val:.3g} ({val / _mean(rows, 'allgather'):.2f}x)"
                    )
                name = VARIANT_NAMES[v] if adaptive or v != "c" else f"two-phase (c) {a['bits_second']}-bit second"
                if not adaptive and v == "a":
                    name = "two-phase (a) same fixed levels"
                lines.append(f"| {LABELS.get(m, m)} | {name} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines + training_lines(data, methods, buckets[0], workers[-1], checkpoints)) + "\n"


def training_lines(data: dict, methods, d: int, n: int, checkpoints) -> list[str]:
    """Over training (bucket ``d``, ``n`` workers), the levels at the last checkpoint and the sampled
    unbiasedness check."""
    a, res = data["args"], data["results"]
    head = ["method", "exchange"] + [f"iter {c}" for c in checkpoints]
    cells = []
    for m in methods:
        for v in ("allgather", "a", "b", "b2", "c", "c2") if get_method(m).adaptive else ("allgather", "a", "c"):
            cells.append([LABELS.get(m, m), v] + [f"{_mean(res[f'{m}|{d}|{n}'], v, c):.3g}" for c in checkpoints])
    lines = [f"**Over training** (bucket {d}, N={n}): normalized variance at each checkpoint", ""]
    lines += pages.table(head, cells)
    rows = res[f"{methods[0]}|{d}|{n}"]
    lines += [
        "",
        "Mean ||g_i||^2 / ||mean||^2 at each checkpoint (how much the N minibatch gradients disagree): "
        + ", ".join(f"iter {c}: {_mean(rows, 'gnorm_ratio', c):.2f}" for c in checkpoints),
        "",
    ]
    last = checkpoints[-1]
    lines += [f"Levels at iteration {last} (bucket {d}, N={n}; positive half):", ""]
    second = (("first", "first"), ("b", "second (b), adapted"), ("b2", "second (b')"))
    for m in (m for m in methods if get_method(m).adaptive):
        rec = data["levels"][f"{m}|{d}|{n}|{last}"]
        for key, name in second + (("c", f"second (c), {a['bits_second']} bits"),):
            lines.append(f"- {LABELS[m]} {name}: " + ", ".join(f"{x:.3g}" for x in rec[key] if x >= 0))
    lines.append("")
    if data["unbiased"]:
        lines += [
            f"**Unbiasedness** (sampled: {a['unbiased_samples']} full two-phase estimates per row, one set of "
            f"N minibatch gradients at iteration {last}, bucket {d}). T = ||mean of estimates - "
            f"mean||^2 / (estimated trace of the covariance / R): about 1 if unbiased (a bias b adds "
            f"R ||b||^2 / variance); t: t statistics (R - 1 degrees of freedom) of the error projected on "
            f"the mean gradient's direction, on (1, ..., 1) and on a random sign vector; error: "
            f"||mean of estimates - mean|| / ||mean||, noise: the error expected without bias, "
            f"sqrt(variance / R) / ||mean||.",
            "",
        ]
        head = ["method", "N", "second", "T", "t (mean dir.)", "t (ones)", "t (random)", "rel. variance", "error"]
        cells = []
        for key, u in data["unbiased"].items():
            m, _, n_, v = key.split("|")
            tt = u["t"]
            cells.append(
                [LABELS.get(m, m), n_, f"({v})", f"{u['T']:.2f}", f"{tt['mean']:+.2f}", f"{tt['ones']:+.2f}"]
                + [f"{tt['random +-1']:+.2f}", f"{u['rel_var']:.3g}", f"{u['err_rel']:.3g}", f"{u['noise_rel']:.3g}"]
            )
        lines += pages.table(head + ["noise"], cells)
    return lines


if __name__ == "__main__":
    sys.exit(main())
