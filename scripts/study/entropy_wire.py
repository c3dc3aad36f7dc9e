#!/usr/bin/env python
"""Bits per coordinate of the fixed and the entropy-coded wire on the GPT's and the CNN's real
gradients (levels refit per method and width), against entropy and the rate-distortion bound, and
the coder's speed on one core. Columns and results: docs/results/entropy_wire.md.

    python -m scripts.study.entropy_wire     # build/results/entropy_wire.md and data/entropy_wire.json
    python -m scripts.study.entropy_wire --quick --out /tmp/entropy_wire.md
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch

from horovod_alq.core import Quantizer, entropy, rate_levels
from horovod_alq.core.methods import get_method
from horovod_alq.core.statistics import distribution_from_statistics
from horovod_alq.core.wire import Header, pack_header
from horovod_alq.torch.codecs import cpu_build
from scripts.common import report as pages
from scripts.common.auto_bits import exact_error
from scripts.common.cnn import sgd_gradients
from scripts.common.gpt import GPT, char_splits, sample_batch

METHODS = ("alq", "amq", "qsgdinf")
BUCKET, MIN_SIZE = 8192, 1024  # the compressors' defaults; smaller tensors are not quantized


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="build/results/entropy_wire.md", help="JSON in data/ beside it")
    p.add_argument("--iters", type=int, default=100, help="training steps before the gradient is taken")
    p.add_argument("--bits", default="2,3,4")
    p.add_argument("--speed-coordinates", type=int, default=1 << 24)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="5 steps, 3 bits, 1M coordinates, 1 repeat")
    args = p.parse_args(argv)
    if args.quick:
        args.iters, args.bits, args.speed_coordinates, args.repeats = 5, "3", 1 << 20, 1
    return args


def gpt_gradient(args) -> np.ndarray:
    torch.manual_seed(0)
    train, _, chars = char_splits()
    model = GPT(len(chars), width=128, layers=4, heads=4, context=64)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(0)
    for _ in range(args.iters + 1):
        x, y = sample_batch(train, 8, 64, gen)
        opt.zero_grad()
        model.loss(x, y).backward()
        grads = [p.grad.detach().reshape(-1).clone() for p in model.parameters()]
        opt.step()
    return _stream(grads)


def cnn_gradient(args) -> np.ndarray:
    *_, (_, _, grads) = sgd_gradients(0, args.iters)
    return _stream([g.clone() for _, g in grads])


def _stream(grads) -> np.ndarray:
    return torch.cat([g for g in grads if g.numel() >= MIN_SIZE]).numpy().astype(np.float32)


def model_cross_entropy(q: Quantizer, dist, counts: np.ndarray) -> float:
    """Bits per code of ``counts`` under the static model of ``dist`` (unbiased rounding's
    code probabilities, floored at the coder's least frequency)."""
    p = rate_levels.code_probabilities(q.levels, dist)
    p = np.maximum(p / p.sum(), 2.0**-entropy.PROB_BITS)
    c = counts[: p.size].astype(np.float64)
    return float(-(c * np.log2(p)).sum() / c.sum())


def measure(g: np.ndarray, method: str, bits: int, d: int, code_entropy: float | None = None) -> dict:
    q = Quantizer(method, bits=bits, bucket_size=d, seed=1, code_entropy=code_entropy)
    stats = q.statistics(g)
    q.adapt(stats)
    payload = q.encode(g)
    frame = entropy.encode_wire(payload)
    n = g.size
    nb = -(-n // d)
    codes = payload[32 + 4 * nb :]
    counts = entropy.count_codes(codes, n, bits)
    err = exact_error(q, g)
    sq = float((g.astype(np.float64) ** 2).sum())
    rate = 8 * frame.size / n
    dist = distribution_from_statistics(method, stats)
    return {
        "method": method if code_entropy is None else f"alq, code_entropy={code_entropy:.3f}",
        "bits": bits,
        "model_entropy": rate_levels.code_entropy(q.levels, dist),
        "fixed_bits": 8 * payload.size / n,
        "coded_bits": rate,
        "ratio": frame.size / payload.size,
        "entropy": entropy.code_entropy(counts),
        "model_bits": model_cross_entropy(q, dist, counts),
        "variance": err / sq,
        "rd_multiple": (err / n) / ((sq / n) * 2.0 ** (-2 * rate)),
    }


def rows_for(g: np.ndarray, bits: list[int], d: int) -> list[dict]:
    """Every method and width; then 16 levels at ALQ 3 bits' entropy and at a measured 3.0 bits per
    coordinate, against ALQ 3 bits fixed."""
    rows = [measure(g, m, b, d) for m in METHODS for b in bits]
    done = {(r["method"], r["bits"]): r for r in rows}
    alq3 = done.get(("alq", 3)) or measure(g, "alq", 3, d)
    alq4 = done.get(("alq", 4)) or measure(g, "alq", 4, d)
    excess = alq4["coded_bits"] - alq4["model_entropy"]
    for target in (alq3["model_entropy"], 3.0 - excess):
        row = measure(g, "alq", 4, d, code_entropy=round(min(target, 4.0), 3))
        row["variance_vs_alq3"] = row["variance"] / alq3["variance"]
        rows.append(row)
    return rows


def speed(g: np.ndarray, n: int, repeats: int, d: int) -> list[dict]:
    """Interleaved timings (seconds) of the fixed codec's encode and decode and the coder's, per repeat."""
    x = torch.from_numpy(np.resize(g, n).astype(np.float32))
    q = Quantizer("alq", bits=3, bucket_size=d, seed=1)
    q.adapt(q.statistics(g))
    module = cpu_build.load()
    levels = torch.from_numpy(q.levels)
    method_id = get_method("alq").id
    header = torch.frombuffer(
        bytearray(pack_header(Header(method_id, 3, d, n, q.fingerprint, norm=q.norm))), dtype=torch.uint8
    )
    rows = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        payload = module.encode(x, levels, header, 3, d, True, 7)
        t1 = time.perf_counter()
        frame = entropy.encode_wire(payload.numpy())
        t2 = time.perf_counter()
        back = entropy.decode_wire(frame)
        t3 = time.perf_counter()
        out = torch.empty(n, dtype=torch.float32)
        module.decode_sum(out, torch.from_numpy(back), [0], levels, 3, d, 1.0, 0, n)
        t4 = time.perf_counter()
        assert np.array_equal(back, payload.numpy()) and frame[3] == entropy.CODED
        rows.append({"encode": t1 - t0, "code": t2 - t1, "decode": t3 - t2, "decode_sum": t4 - t3})
    return rows


def report(rows: dict, timing: list[dict], n: int, argv: list[str], kernel: str) -> str:
    mb = 4 * n / 1e6
    lines = [
        "# The entropy-coded wire: bits per coordinate and the coder's speed",
        "",
        f"Command: `python -m scripts.study.entropy_wire {' '.join(argv)}` ({datetime.date.today()}, "
        f"{platform.machine()}, torch {torch.__version__}, {torch.get_num_threads()} thread, coder: {kernel}).",
        "",
        "Bits per coordinate of whole payloads (headers, norms, table), the codes' empirical entropy,",
        "the cost of a static model of the fitted distribution instead of the payload's own frequencies,",
        "the exact variance relative to ||g||^2 and as a multiple of the Gaussian bound sigma^2 2^(-2R).",
        "",
    ]
    head = ["gradients", "method", "bits", "fixed bits/coord", "coded bits/coord", "coded / fixed", "code entropy"]
    head += ["fitted-model cost", "relative variance", "x Gaussian bound"]
    fields = (("fixed_bits", ".3f"), ("coded_bits", ".3f"), ("ratio", ".3f"), ("entropy", ".3f"), ("model_bits", ".3f"))
    fields += (("variance", ".4f"), ("rd_multiple", ".2f"))
    cells = [
        [model, r["method"], r["bits"]] + [format(r[k], f) for k, f in fields] for model, rs in rows.items() for r in rs
    ]
    lines += pages.table(head, cells)
    lines += [
        "",
        "Levels for a code entropy (16 levels) against ALQ 3 bits on the fixed wire (3.0 bits per "
        "coordinate plus norms), variance ratio:",
        "",
    ]
    cells = [
        [model, r["method"].split("=")[1], f"{r['coded_bits']:.3f}", f"{r['variance_vs_alq3']:.3f}"]
        for model, rs in rows.items()
        for r in rs
        if "variance_vs_alq3" in r
    ]
    lines += pages.table(["gradients", "code_entropy", "coded bits/coord", "variance / ALQ 3 bits'"], cells)
    lines += [
        "",
        f"Speed on one core, ALQ 3 bits, {n:,} coordinates of the GPT's gradient (tiled), MB/s of "
        "float32 input; each repeat runs all four in turn:",
        "",
    ]
    keys = ("encode", "code", "decode", "decode_sum")
    cells = [[i] + [f"{mb / t[k]:.0f}" for k in keys] for i, t in enumerate(timing)]
    lines += pages.table(["repeat", "fixed encode", "entropy code", "entropy decode", "fixed decode"], cells)
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    torch.set_num_threads(1)
    kernel = "compiled" if cpu_build.load() is not None else "numpy"
    bits = [int(b) for b in args.bits.split(",")]
    grads = {"GPT (AdamW)": gpt_gradient(args), "CNN (SGD)": cnn_gradient(args)}
    rows = {name: rows_for(g, bits, BUCKET) for name, g in grads.items()}
    timing = speed(grads["GPT (AdamW)"], args.speed_coordinates, args.repeats, BUCKET)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(report(rows, timing, args.speed_coordinates, argv, kernel))
    data = {"argv": argv, "date": str(datetime.date.today()), "rows": rows, "timing": timing}
    (out.parent / "data").mkdir(exist_ok=True)
    (out.parent / "data" / f"{out.stem}.json").write_text(json.dumps(data, indent=1))
    print(out.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
