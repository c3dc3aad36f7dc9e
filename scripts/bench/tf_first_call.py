#!/usr/bin/env python
"""The first call of a traced TensorFlow step with ResNet-50's gradients (Keras' ResNet50, built
offline without weights): tracing, TF's graph preparation and XLA compiles, per compressor, and the
calls after it. One process (Horovod with one rank): the codec and the graph, not the network.

``bits="auto"`` traces every width's codec for every tensor shape (its width is chosen at run
time), so its first call costs more than a fixed width's; this measures how much.

    python -m scripts.bench.tf_first_call --out build/results/bench_tf_first_call.md
    # the report goes by hand into docs/results/codec_speed.md#bench_tf_first_call
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

from scripts.common.bench import write_report


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bits", default="3,auto", help="comma-separated: widths and/or 'auto' (budget 3.0)")
    p.add_argument("--no-xla", action="store_true", help="jit_compile=False")
    p.add_argument("--out", help="Markdown report (default: print only)")
    args = p.parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import horovod.tensorflow as hvd
    import tensorflow as tf

    from horovod_alq.tensorflow import ALQCompressor

    hvd.init()
    model = tf.keras.applications.ResNet50(weights=None)
    shapes = [tuple(v.shape) for v in model.trainable_variables]
    xs = [tf.random.stateless_normal(s, seed=[i, 0]) for i, s in enumerate(shapes)]
    compressed = [s for s in shapes if np.prod(s) >= 1024]
    rows = []
    for bits in args.bits.split(","):
        kw = dict(bits="auto", bit_budget=3.0) if bits == "auto" else dict(bits=int(bits))
        comp = ALQCompressor(
            bucket_size=8192, update_steps=(0,), update_every=0, seed=1, jit_compile=not args.no_xla, **kw
        )
        step = tf.function(
            lambda *t, comp=comp: [hvd.allreduce(x, compression=comp, name=f"x{i}") for i, x in enumerate(t)]
        )
        times = []
        for _ in range(3):  # the first call; the second refits (statistics of the first); the third
            start = time.perf_counter()
            _ = [y.shape for y in step(*xs)]
            times.append(time.perf_counter() - start)
        rows.append(f"| ALQ bits={bits} | {times[0]:.1f} | {times[1]:.2f} | {times[2]:.2f} |")
    lines = [
        f"Command: `python -m scripts.bench.tf_first_call {' '.join(argv if argv is not None else sys.argv[1:])}` "
        f"({time.strftime('%Y-%m-%d')}; TensorFlow {tf.__version__}, {os.cpu_count()} CPUs, XLA "
        f"{'off' if args.no_xla else 'on'}). ResNet-50's {len(shapes)} gradients in one `tf.function` of "
        f"`hvd.allreduce` calls, {len(compressed)} compressed ({len(set(compressed))} distinct shapes), "
        f"one rank.",
        "",
        "| compressor | first call (s) | second call, refit (s) | third call (s) |",
        "|---|---:|---:|---:|",
        *rows,
    ]
    write_report(lines, args.out)
    hvd.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
