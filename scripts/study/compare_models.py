#!/usr/bin/env python
"""Which distribution should ALQ and AMQ adapt to? The paper's norm-weighted mixture of per-bucket
truncated normals, or the norm-weighted mixture of the buckets' empirical distributions (what this
package uses)? Fits both on real gradients of the MNIST CNN of scripts/demo/train.py (one process, plain
SGD) and reports the true normalized variance E||Q(g) - g||^2 / ||g||^2 of each fit, computed
exactly from the levels and the gradient (no sampling).

    python -m scripts.study.compare_models --out docs/design/statistics.md
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from horovod_alq.core.adaptation import fit_alq_levels, fit_amq_multiplier
from horovod_alq.core.distributions import NormWeightedMixture
from horovod_alq.core.methods import multiplier_levels, uniform_levels
from horovod_alq.core.statistics import (
    SIGMA_FLOOR,
    distribution_from_statistics,
    grid_statistics,
    moments_of,
    normalize,
)
from scripts.common.auto_bits import normalized_variance
from scripts.common.cnn import Net, load_digits


def paper_mixture(g: np.ndarray, bucket: int) -> NormWeightedMixture:
    m = moments_of(normalize(g, bucket, "l2"))
    mu = m.sum_r / m.count
    sigma = np.maximum(np.sqrt(np.maximum(m.sum_r2 / m.count - mu**2, 0.0)), SIGMA_FLOOR)
    return NormWeightedMixture(m.norms, mu, sigma)


def rows_for(g: np.ndarray, bits: int, bucket: int) -> dict:
    empirical = distribution_from_statistics("alq", grid_statistics(normalize(g, bucket, "l2")))
    mixture = paper_mixture(g, bucket)
    out = {}
    for name, dist in (("truncated-normal mixture (paper)", mixture), ("empirical mixture (this package)", empirical)):
        out[f"ALQ, {name}"] = normalized_variance(fit_alq_levels(dist, bits), g, bucket)
        out[f"AMQ, {name}"] = normalized_variance(multiplier_levels(fit_amq_multiplier(dist, bits), bits), g, bucket)
    out["QSGDinf (fixed)"] = normalized_variance(uniform_levels(bits), g, bucket, "linf")
    out["NUQSGD (fixed)"] = normalized_variance(multiplier_levels(0.5, bits), g, bucket)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", default="0,50,200", help="SGD steps at which to take the gradient")
    p.add_argument("--bits", type=int, default=3)
    p.add_argument("--buckets", default="512,8192")
    p.add_argument("--out", help="write a Markdown table here")
    args = p.parse_args(argv)
    steps = [int(s) for s in args.steps.split(",")]
    buckets = [int(b) for b in args.buckets.split(",")]
    torch.manual_seed(0)
    train_x, train_y, _, _ = load_digits(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    generator = torch.Generator().manual_seed(0)
    table: dict[tuple, dict] = {}
    for step in range(max(steps) + 1):
        idx = torch.randint(0, len(train_x), (64,), generator=generator)
        opt.zero_grad()
        F.cross_entropy(model(train_x[idx]), train_y[idx]).backward()
        if step in steps:
            g = torch.cat([q.grad.reshape(-1) for q in model.parameters()]).double().numpy()
            for bucket in buckets:
                table[(step, bucket)] = rows_for(g, args.bits, bucket)
        opt.step()
    cols = list(table)
    lines = [
        "# Adapting to a model of the gradients, or to the gradients themselves",
        "",
        f"Command: `python -m scripts.study.compare_models {' '.join(argv if argv is not None else sys.argv[1:])}`",
        "",
        f"True normalized variance E||Q(g) - g||^2 / ||g||^2 (exact, {args.bits} bits) of the whole "
        "gradient of the MNIST CNN in scripts/demo/train.py, at SGD step s, bucket size d. Lower is better.",
        "",
        "| levels fitted to | " + " | ".join(f"s={s}, d={d}" for s, d in cols) + " |",
        "|---|" + "---|" * len(cols),
    ]
    for name in table[cols[0]]:
        lines.append(f"| {name} | " + " | ".join(f"{table[c][name]:.3f}" for c in cols) + " |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
