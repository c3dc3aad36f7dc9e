"""Worker for tests/tensorflow/test_dropin.py: the pattern of Horovod v0.28.1's
examples/tensorflow2/tensorflow2_synthetic_benchmark.py with its compression line swapped for
``ALQCompressor(...)``: the compressor is built inside the ``tf.function``, which is traced twice
(``first_batch=True``, then False). A small Keras model (tf_keras: TF_USE_LEGACY_KERAS=1, as
Horovod's Keras needs) on fixed synthetic data, plain SGD.

Usage: python dropin_tf_benchmark.py [--steps N] [--eager-build]
"""

import argparse
import hashlib
import os

os.environ["TF_USE_LEGACY_KERAS"] = "1"  # before TensorFlow is imported (Horovod's Keras is Keras 2)

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf
from common import report

from horovod_alq.tensorflow import ALQCompressor

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=12)
args = p.parse_args()

hvd.init()
tf.keras.utils.set_random_seed(hvd.rank())  # different starts: the broadcast must align them
model = tf.keras.Sequential(
    [tf.keras.layers.Dense(256, activation="relu", input_shape=(64,)), tf.keras.layers.Dense(10)]
)
opt = tf.optimizers.SGD(0.01)
rng = np.random.default_rng(hvd.rank())
data = tf.constant(rng.standard_normal((32, 64)), tf.float32)
target = tf.constant(rng.integers(0, 10, (32, 1)), tf.int64)
built = []  # the compressor each trace of the step got
pairs = []  # each trace's two compressors built at one line


@tf.function
def benchmark_step(first_batch):
    # Horovod: (optional) compression algorithm.  <- the example's line, swapped
    compression = ALQCompressor(bits=3, bucket_size=512)
    built.append(compression)
    pairs.append([ALQCompressor(bits=2, bucket_size=512) for _ in range(2)])  # two at one line: two

    with tf.GradientTape() as tape:
        probs = model(data, training=True)
        loss = tf.reduce_mean(tf.keras.losses.sparse_categorical_crossentropy(target, probs, from_logits=True))

    tape = hvd.DistributedGradientTape(tape, compression=compression)
    gradients = tape.gradient(loss, model.trainable_variables)
    opt.apply_gradients(zip(gradients, model.trainable_variables))

    if first_batch:
        hvd.broadcast_variables(model.variables, root_rank=0)
        hvd.broadcast_variables(opt.variables(), root_rank=0)
    return loss


losses = [float(benchmark_step(first_batch=True))]
losses += [float(benchmark_step(first_batch=False)) for _ in range(args.steps - 1)]
weights = b"".join(v.numpy().tobytes() for v in model.variables)
m = built[0].metrics()
report(
    dict(
        traces=len(built),
        distinct=len({id(c) for c in built}),
        pairs=[[id(c) for c in pair] for pair in pairs],
        steps=m["step"],
        level_updates=m["level_updates"],
        bits_per_coordinate=m["bits_per_coordinate"],
        losses=losses,
        digest=hashlib.sha256(weights).hexdigest(),
        levels=np.asarray(m["levels"]).tolist(),
    )
)
