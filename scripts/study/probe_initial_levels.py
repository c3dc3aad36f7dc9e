#!/usr/bin/env python
"""Starting levels of ALQ and AMQ with max-abs buckets: exact normalized variance before any refit.

The adaptive methods start from levels fitted to Gaussian buckets, N(0, sigma^2) truncated to
[-1, 1]. For max-abs buckets the product uses sigma = 1 / m, m the median max-abs of d standard
normals (``horovod_alq.core.quantizer.gaussian_sigma``). This script compares that choice with two
others, the L2 start and levels fitted to the data itself (the best any start can do), on the CNN's
first gradient (scripts/demo/train.py's model, seed 0, batch 32: what the compressors encode at step 0)
and on synthetic Gaussian and Student-t(3) data:

    gauss-median  sigma = 1 / median max-abs of d normals (the product's choice)
    1/sqrt(d)     sigma = 1 / sqrt(d), the L2 choice, on max-abs buckets
    geo-mean      sigma = sqrt(gauss-median * 1/sqrt(d))
    l2-start      the product's start with L2 buckets (norm="l2")
    fitted        max-abs buckets, levels fitted to the data's own statistics

    python -m scripts.study.probe_initial_levels --out build/results/initial_levels.md
    # the report goes by hand into docs/results/variance_training.md#initial_levels
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from horovod_alq.core import Quantizer
from horovod_alq.core.distributions import TruncatedNormal
from horovod_alq.core.quantizer import gaussian_sigma
from scripts.common.auto_bits import normalized_variance

CHOICES = ["gauss-median", "1/sqrt(d)", "geo-mean", "l2-start", "fitted"]


def first_gradient(seed: int = 0) -> np.ndarray:
    import torch
    import torch.nn.functional as F

    from scripts.common.cnn import Net, load_digits

    torch.manual_seed(seed)
    tx, ty, _, _ = load_digits(seed)
    model = Net()
    idx = torch.randint(0, len(tx), (32,), generator=torch.Generator().manual_seed(seed))
    F.cross_entropy(model(tx[idx]), ty[idx]).backward()
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()]).double().numpy()


def variances(x: np.ndarray, method: str, bits: int, d: int) -> dict:
    out = {}
    median = gaussian_sigma(d, "linf")
    for label, sigma in (("gauss-median", median), ("1/sqrt(d)", d**-0.5), ("geo-mean", np.sqrt(median * d**-0.5))):
        q = Quantizer(method, bits, d, norm="linf")
        q._fit(TruncatedNormal(0.0, sigma))
        out[label] = normalized_variance(q.levels, x, d, "linf")
    q = Quantizer(method, bits, d, norm="l2")
    out["l2-start"] = normalized_variance(q.levels, x, d, "l2")
    q = Quantizer(method, bits, d, norm="linf")
    q.adapt(q.statistics(x))
    out["fitted"] = normalized_variance(q.levels, x, d, "linf")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, help="write the Markdown table here")
    p.add_argument("--quick", action="store_true", help="the CNN gradient only, 3 bits, d=512")
    args = p.parse_args(argv)
    rng = np.random.default_rng(0)
    datas = {"CNN gradient, step 0": first_gradient()}
    configs = [(b, d) for b in (2, 3) for d in (512, 8192)]
    if args.quick:
        configs = [(3, 512)]
    else:
        datas.update({"Gaussian": rng.standard_normal(1 << 18), "Student-t(3)": rng.standard_t(3, 1 << 18)})
    lines = [
        "Exact normalized variance with the starting levels (no refit yet); max-abs buckets except "
        "l2-start. Command: `python -m scripts.study.probe_initial_levels"
        + (" --quick" if args.quick else "")
        + (f" --out {args.out}`" if args.out else "`"),
        "",
        "| data | method | bits | d | " + " | ".join(CHOICES) + " |",
        "|---|---|---|---|" + "---|" * len(CHOICES),
    ]
    for name, x in datas.items():
        for bits, d in configs:
            for method in ("alq", "amq"):
                v = variances(x, method, bits, d)
                lines.append(
                    f"| {name} | {method} | {bits} | {d} | " + " | ".join(f"{v[c]:.3g}" for c in CHOICES) + " |"
                )
                print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
