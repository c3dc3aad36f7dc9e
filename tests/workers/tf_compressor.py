"""Worker for tests/tensorflow/test_tf_compressor_ranks.py: the scenario chosen by argv[1].

TensorFlow starts slowly, so each scenario checks several things in one run, and scenarios joined
by "+" ("misc+compat") run in turn in one launch, reported as {scenario: result}. Groups of
scenarios with options of their own, separated by "::" ("exchange --rounds 100 :: misc+compat"),
run in turn too, all reported in that one dict. The ``keras`` scenario sets TF_USE_LEGACY_KERAS=1
before TensorFlow is imported (tf.keras is then tf_keras): only ``exchange``, which uses no Keras,
runs beside it; ``process_sets`` (its own hvd.init, with the set {0, 1}) runs last.
"""

import argparse
import hashlib
import os
import sys
import tempfile
import time

from common import argv_groups  # no TensorFlow: safe before TF_USE_LEGACY_KERAS is set

SCENARIOS = [
    "exchange",
    "train",
    "keras",
    "mismatch",
    "misc",
    "compat",
    "deadlock",
    "process_sets",
    "two_phase",
    "reducescatter",
    "join",
    "auto",
    "collide",
    "stall",
    "fusion",
    "feedback",
    "feedback_mismatch",
]


def parse_args(argv: list) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("scenario", help="one of " + ", ".join(SCENARIOS) + ", or several joined by '+'")
    p.add_argument("--methods", default="alq")
    p.add_argument("--bits", type=int, default=3)
    p.add_argument("--bucket", type=int, default=512)
    p.add_argument("--n", type=int, default=3000)
    p.add_argument("--rounds", type=int, default=150)
    p.add_argument("--op", default="average")
    p.add_argument("--mode", default="function", choices=["function", "eager"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--large", action="store_true", help="exchange: also a 65536-element tensor")
    args = p.parse_args(argv)
    args.scenarios = args.scenario.split("+")
    unknown = [s for s in args.scenarios if s not in SCENARIOS]
    if unknown:
        p.error(f"scenario {args.scenario!r}: unknown {unknown}")
    return args


def parse_groups() -> list:
    """The groups of argv (separated by "::"), each parsed with its own options, in order."""
    groups = argv_groups(parse_args)
    names = [name for g in groups for name in g.scenarios]
    with_keras = "keras" in names and set(names) - {"keras", "exchange"}
    if len(set(names)) < len(names) or with_keras or "process_sets" in names[:-1]:
        sys.exit(f"scenarios {names}: each once, keras with exchange only, process_sets last")
    return groups


START = time.monotonic()
GROUPS = parse_groups()
SCENARIO_NAMES = [name for g in GROUPS for name in g.scenarios]
if "keras" in SCENARIO_NAMES:
    os.environ["TF_USE_LEGACY_KERAS"] = "1"  # before TensorFlow is imported

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf
from common import cell_moments, report
from helpers import digest, rank_data, t_stat

from horovod_alq.core import Quantizer
from horovod_alq.tensorflow import ALQCompressor, AMQCompressor, QSGDCompressor, QuantizedCompressor, compressor_for

# XLA compiles the codec once per traced tensor shape (about a second each here). Only the exchange
# scenario keeps it (tests/tensorflow/test_tf_kernels.py checks the XLA kernels against the core);
# the others run the same TF ops op by op: main() makes jit_compile=False their compressors' default.
_JIT_DEFAULT = QuantizedCompressor.__init__.__kwdefaults__["jit_compile"]

ADAPTIVE = ("alq", "alq-n", "amq", "amq-n")


def core_decodes(comp, x: np.ndarray) -> list:
    """A payload encoded with the compressor's live levels, header and seed decodes with the core."""
    m = comp.metrics()
    q = Quantizer(comp._method.name, bits=comp.bits, bucket_size=comp.bucket_size)
    q.set_levels(m["levels"])
    payload = comp._fns.codec.encode(
        tf.constant(x), comp._vars.levels, comp._vars.header(x.size), tf.constant([1, 2], tf.int64)
    ).numpy()
    return list(q.decode(payload).shape)


def reduce_fn(comp, op, mode):
    def fn(x):
        return hvd.allreduce(x, compression=comp, op=op)

    return fn if mode == "eager" else tf.function(fn)


def exchange(args) -> dict:
    """M rounds of hvd.allreduce per method. Unbiasedness: a Bernstein bound per coordinate from the
    exact variance of every round (its levels are known: in TF a round's refit happens when it
    begins, so the levels read after the call are the ones it used); identical results on all ranks."""
    size, rank = hvd.size(), hvd.rank()
    op = hvd.Sum if args.op == "sum" else hvd.Average
    xs = [rank_data(r, args.n).astype(np.float64) for r in range(size)]
    x = tf.constant(rank_data(rank, args.n))
    scale = 1.0 if op == hvd.Sum else 1.0 / size
    truth = scale * sum(xs)
    out = {}
    for method in args.methods.split(","):
        comp = compressor_for(
            method,
            bits=args.bits,
            bucket_size=args.bucket,
            update_steps=(0, 5),
            update_every=0,
            min_size=16,
            seed=args.seed,
        )
        norm = comp.norm
        start = comp.levels.tolist()
        fn = reduce_fn(comp, op, args.mode)
        dev_sum, var_sum, width = np.zeros(args.n), np.zeros(args.n), np.zeros(args.n)
        h = hashlib.sha1()
        for _ in range(args.rounds):
            y = fn(x).numpy()
            levels = comp.levels
            for x_r in xs:
                var, w = cell_moments(x_r, levels, args.bucket, norm)
                var_sum += scale**2 * var
                width = np.maximum(width, w)
            dev_sum += y.astype(np.float64) - truth
            h.update(y.tobytes())
        # Bernstein: P(|sum| >= s) <= 2 exp(-s^2 / (2 (V + c s / 3))), c = largest single deviation
        c = scale * size * width
        log_term = np.log(2 / 1e-10)  # 1e-10 per coordinate: ~3e-7 for 3000 coordinates
        bound = c * log_term / 3 + np.sqrt((c * log_term / 3) ** 2 + 2 * var_sum * log_term)
        bound += args.rounds * 1e-6 * np.abs(truth) + 1e-9  # float32 rounding of the outputs
        m = comp.metrics()
        out[method] = {
            "worst_ratio": float(np.max(np.abs(dev_sum) / bound)),
            "aggregate_z": float(dev_sum.sum() / np.sqrt(var_sum.sum())),
            "digest": h.hexdigest(),
            "levels": m["levels"].tolist(),
            "start_levels": start,
            "level_updates": m["level_updates"],
            "step": m["step"],
            "calls": m["calls"],
            "bits_per_coordinate": m["bits_per_coordinate"],
            "dtype": str(y.dtype),
            "core_decoded_shape": core_decodes(comp, rank_data(rank, args.n)),
        }
    if args.large:
        comp = ALQCompressor(bits=3, bucket_size=8192, min_size=16, seed=args.seed, update_steps=(0,))
        fn = reduce_fn(comp, op, args.mode)
        big = tf.constant(rank_data(rank, 65536))
        for _ in range(3):
            y = fn(big)
        m = comp.metrics()
        out["large"] = {
            "bits_per_coordinate": m["bits_per_coordinate"],
            "payload_bytes": m["payload_bytes"],
            "coordinates": m["coordinates"],
            "digest": digest(y.numpy()),
            "rel_err": float(
                np.linalg.norm(
                    y.numpy() - sum(rank_data(r, 65536) for r in range(size)) / (size if op == hvd.Average else 1)
                )
                / np.linalg.norm(y.numpy())
            ),
        }
    return out


def digits_data(rank: int, size: int):
    from sklearn.datasets import load_digits

    data = load_digits()
    x = (data.data / 16.0).astype(np.float32)
    y = data.target.astype(np.int64)
    perm = np.random.default_rng(0).permutation(len(x))
    x, y = x[perm], y[perm]
    return x[:1500][rank::size], y[:1500][rank::size], x[1500:], y[1500:]


class MLP(tf.Module):
    """64 -> 128 -> 10 with plain tf.Variables, the same initial values on every rank."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        init = tf.keras.initializers.GlorotUniform(seed=seed)
        self.w1 = tf.Variable(init([64, 128]), name="w1")
        self.b1 = tf.Variable(tf.zeros([128]), name="b1")
        self.w2 = tf.Variable(init([128, 10]), name="w2")
        self.b2 = tf.Variable(tf.zeros([10]), name="b2")

    def __call__(self, x):
        return tf.matmul(tf.nn.relu(tf.matmul(x, self.w1) + self.b1), self.w2) + self.b2


def train_loop(variables, forward, comp, data, steps: int, lr: float = 0.1, seed: int = 0, process_set=None):
    """SGD with momentum 0.9 in a tf.function around hvd.DistributedGradientTape."""
    tx, ty, vx, vy = data
    momenta = [tf.Variable(tf.zeros_like(v)) for v in variables]
    extra = {} if process_set is None else {"process_set": process_set}

    @tf.function
    def step(xb, yb):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(yb, forward(xb)))
        tape = hvd.DistributedGradientTape(tape, compression=comp, **extra)
        grads = tape.gradient(loss, variables)
        for v, m, g in zip(variables, momenta, grads):
            m.assign(0.9 * m + g)
            v.assign_sub(lr * m)
        return loss

    rng = np.random.default_rng(seed * 100 + hvd.rank())
    losses = []
    for _ in range(steps):
        idx = rng.integers(0, len(tx), 32)
        losses.append(float(step(tx[idx], ty[idx])))
    acc = float(np.mean(np.argmax(forward(vx).numpy(), 1) == vy))
    return {
        "first_loss": float(np.mean(losses[:10])),
        "last_loss": float(np.mean(losses[-10:])),
        "accuracy": acc,
        "params": [digest(v.numpy()) for v in variables],
        "traces": step.experimental_get_tracing_count(),
    }


def make_train_compressor(method: str, args):
    bits = 2 if method == "terngrad" else 4
    return compressor_for(
        method,
        bits=bits,
        bucket_size=args.bucket,
        update_steps=(0, 20, 60),
        update_every=0,
        min_size=100,
        seed=args.seed,
    )


def train(args) -> dict:
    """A small model on sklearn digits, per method; then a Keras 3 model through its tf.Variables."""
    size, rank = hvd.size(), hvd.rank()
    data = digits_data(rank, size)
    out = {}
    for method in args.methods.split(","):
        model = MLP(seed=1)
        comp = make_train_compressor(method, args)
        start = comp.levels.tolist()
        res = train_loop([model.w1, model.b1, model.w2, model.b2], model, comp, data, args.steps)
        m = comp.metrics()
        res.update(
            start_levels=start,
            levels=m["levels"].tolist(),
            level_updates=m["level_updates"],
            step=m["step"],
            uncompressed=m["uncompressed_coordinates"],
            coordinates=m["coordinates"],
            core_decoded_shape=core_decodes(comp, model.w1.numpy()),
        )
        out[method] = res

    # Keras 3: DistributedGradientTape needs the Keras variables' underlying tf.Variables.
    import keras

    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(128, activation="relu"), keras.layers.Dense(10)])
    model.set_weights(hvd.broadcast_object(model.get_weights(), root_rank=0))
    comp = make_train_compressor("alq", args)
    direct_error = None
    try:
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model(data[0][:4]))
        hvd.DistributedGradientTape(tape, compression=comp).gradient(loss, model.trainable_variables)
    except Exception as err:  # noqa: BLE001 - reported to the test
        direct_error = f"{type(err).__name__}: {err}"
    res = train_loop([v.value for v in model.trainable_variables], lambda x: model(x), comp, data, args.steps)
    res.update(
        keras_version=keras.__version__, direct_error=direct_error, level_updates=comp.metrics()["level_updates"]
    )
    out["keras3"] = res
    return out


def keras_fit(args) -> dict:
    """Keras model.fit through horovod.tensorflow.keras with tf_keras (TF_USE_LEGACY_KERAS=1)."""
    import horovod.tensorflow.keras as hvdk

    keras = tf.keras
    size, rank = hvdk.size(), hvdk.rank()
    tx, ty, vx, vy = digits_data(rank, size)
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.layers.Dense(128, activation="relu", input_shape=(64,)), keras.layers.Dense(10)])
    comp = ALQCompressor(
        bits=4, bucket_size=args.bucket, update_steps=(0, 20, 60), update_every=0, min_size=100, seed=args.seed
    )
    start = comp.levels.tolist()
    opt = hvdk.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9), compression=comp)
    model.compile(
        optimizer=opt, metrics=["accuracy"], loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    hist = model.fit(
        tx,
        ty,
        batch_size=32,
        epochs=args.steps,
        shuffle=True,
        verbose=0,
        callbacks=[hvdk.callbacks.BroadcastGlobalVariablesCallback(0)],
    )
    acc = float(np.mean(np.argmax(model.predict(vx, verbose=0), 1) == vy))
    m = comp.metrics()
    import tf_keras

    return {
        "keras": keras.__name__,
        "keras_version": tf_keras.__version__,
        "loss": hist.history["loss"],
        "accuracy": acc,
        "params": [digest(w) for w in model.get_weights()],
        "start_levels": start,
        "levels": m["levels"].tolist(),
        "level_updates": m["level_updates"],
        "step": m["step"],
        "bits_per_coordinate": m["bits_per_coordinate"],
    }


def mismatch(args) -> dict:
    """Rank 1 differs from rank 0 (bits, bucket size, levels or method): every rank must refuse,
    eagerly and inside tf.function. After each refusal the ranks go on to the next case."""
    rank = hvd.rank()
    out = {}
    for mode in ("eager", "function"):
        for what in ("bits", "bucket", "levels", "method", "norm"):
            kw = dict(bits=3, bucket_size=256, min_size=16, seed=0, update_steps=())
            if what == "norm":
                kw["norm"] = "linf" if rank == 1 else "l2"
            if rank == 1 and what == "bits":
                kw["bits"] = 4
            if rank == 1 and what == "bucket":
                kw["bucket_size"] = 512
            comp = AMQCompressor(**kw) if rank == 1 and what == "method" else ALQCompressor(**kw)
            if rank == 1 and what == "levels":
                state = comp.state_dict()
                state["quantizer"]["levels"] = np.array([-1, -0.3, -0.1, -0.01, 0.01, 0.1, 0.3, 1.0])
                comp.load_state_dict(state)
            x = tf.constant(rank_data(rank, 4096))
            try:
                y = reduce_fn(comp, hvd.Average, mode)(x)
                out[f"{mode}.{what}"] = {"error": None, "out": digest(y.numpy())}
            except Exception as err:  # noqa: BLE001 - reported to the test
                out[f"{mode}.{what}"] = {"error": f"{type(err).__name__}: {err}"[-1500:]}
    # After all of that, a matching exchange still works.
    comp = ALQCompressor(bits=3, bucket_size=256, min_size=16, seed=0)
    out["after"] = digest(hvd.allreduce(tf.constant(rank_data(0, 4096)), compression=comp).numpy())
    return out


def feedback_mismatch(args) -> dict:
    """Rank 1 builds its compressor with ``error_feedback=True``, rank 0 without (allgather eagerly,
    two-phase inside tf.function: one trace, the launch is long): every rank must refuse before any
    payload moves. Then a matching exchange still works. The allreduces are named: Horovod's
    default name follows the op names, which differ where one rank's compress adds the buffers."""
    rank = hvd.rank()
    out = {}
    for mode, exchange in (("eager", "allgather"), ("function", "two-phase")):
        comp = ALQCompressor(bits=3, bucket_size=256, min_size=16, seed=0, update_steps=(), exchange=exchange,
                             error_feedback=rank == 1)  # fmt: skip

        def fn(x, comp=comp, name=f"fb.{mode}.{exchange}"):
            return hvd.allreduce(x, compression=comp, op=hvd.Average, name=name)

        try:
            y = (fn if mode == "eager" else tf.function(fn))(tf.constant(rank_data(rank, 4096)))
            out[f"{mode}.{exchange}"] = {"error": None, "out": digest(y.numpy())}
        except Exception as err:  # noqa: BLE001 - reported to the test
            text = f"{type(err).__name__}: {err}"  # in a graph: TF's traceback around the message
            at = max(0, text.find("horovod_alq: "))
            out[f"{mode}.{exchange}"] = {"error": text[at : at + 1500]}
    comp = ALQCompressor(bits=3, bucket_size=256, min_size=16, seed=0, error_feedback=True)
    out["after"] = digest(hvd.allreduce(tf.constant(rank_data(0, 4096)), compression=comp).numpy())
    return out


def misc(args) -> dict:
    """Checkpointing (tf.train.Checkpoint and state_dict), dtypes, NaN buckets, class-as-compression,
    grouped allreduce, and the per-step randomness inside tf.function."""
    import tempfile

    size, rank = hvd.size(), hvd.rank()
    out = {}
    kw = dict(bits=3, bucket_size=256, min_size=16, update_steps=(0, 3), update_every=0, seed=7)
    comp = ALQCompressor(**kw)
    x = tf.constant(rank_data(rank, 5000))
    fn = tf.function(lambda t: hvd.allreduce(t, compression=comp))
    draws = [fn(x).numpy() for _ in range(5)]  # rounds 1-3 share their levels
    out["draws_differ"] = len({digest(d) for d in draws}) == 5
    out["draws_digest"] = digest(*draws)
    ckpt_dir = tempfile.mkdtemp(prefix=f"alq-ckpt-{rank}-")
    path = tf.train.Checkpoint(compressor=comp).save(os.path.join(ckpt_dir, "c"))
    saved = comp.state_dict()
    from_ckpt = ALQCompressor(**{**kw, "seed": 99})
    tf.train.Checkpoint(compressor=from_ckpt).restore(path).assert_existing_objects_matched()
    from_state = ALQCompressor(**{**kw, "seed": 98})
    from_state.load_state_dict(saved)
    outs = {}
    for name, c in (("original", comp), ("checkpoint", from_ckpt), ("state_dict", from_state)):
        f = tf.function(lambda t, c=c: hvd.allreduce(t, compression=c))
        outs[name] = digest(f(x).numpy(), f(2 * x).numpy())
        outs[name + ".metrics"] = {k: v for k, v in c.metrics().items() if k != "levels"}
        outs[name + ".levels"] = c.levels.tolist()
    out["state"] = outs
    out["state_levels_moved"] = list(saved["quantizer"]["levels"]) != ALQCompressor(bits=3).levels.tolist()
    out["state_step"], out["state_updates"] = saved["step"], saved["level_updates"]

    comp = ALQCompressor(bits=4, bucket_size=128, min_size=64, seed=1)
    res = {}
    for name in ("float16", "bfloat16", "float32", "float64", "int32", "int64"):
        dt = getattr(tf, name)
        for n in (1000, 10):  # compressed, and passed through
            base = rank_data(rank, n)
            t = tf.cast(base * 10, dt) if not dt.is_floating else tf.reshape(tf.cast(base, dt), [10, n // 10])
            y = hvd.allreduce(t, compression=comp, name=f"{name}.{n}")
            ref = tf.cast(hvd.allreduce(tf.cast(t, tf.float32) if dt == tf.bfloat16 else t, name=f"ref.{name}.{n}"), dt)
            yd, rd = tf.cast(y, tf.float64).numpy(), tf.cast(ref, tf.float64).numpy()
            res[f"{name}.{n}"] = {
                "dtype": y.dtype.name,
                "same_shape": y.shape == t.shape,
                "rel_err": float(np.linalg.norm(yd - rd) / max(np.linalg.norm(rd), 1e-12)),
                "exact": bool(np.array_equal(yd, rd)),
                "digest": digest(yd),
            }
    out["dtypes"] = res
    nan = rank_data(rank, 512)
    if rank == 1:
        nan[300] = np.nan
    y = hvd.allreduce(tf.constant(nan), compression=comp, name="nan").numpy()
    out["nan_buckets"] = [bool(np.isnan(y[i * 128 : (i + 1) * 128]).all()) for i in range(4)]

    # the same tensor on both ranks, same seed: the ranks' payloads still differ (rank in the seed)
    same = QSGDCompressor(bits=3, bucket_size=256, min_size=16, seed=11)
    small, ctx = same.compress(tf.constant(rank_data(0, 4096)))
    same.decompress(hvd.allreduce(small, name="same.small"), ctx)
    halves = np.split(hvd.allgather(ctx.payload, name="same.payloads").numpy(), size)
    out["rank_payloads_differ"] = digest(halves[0][32:]) != digest(halves[1][32:]) and digest(halves[0][:32]) == digest(
        halves[1][:32]
    )

    # the class itself as compression=, and a grouped allreduce (eager: one round of two slots)
    y = hvd.allreduce(tf.constant(rank_data(rank, 2048)), compression=QSGDCompressor, name="cls")
    out["class_default"] = {"shape": list(y.shape), "calls": QSGDCompressor.metrics()["calls"]}
    comp = ALQCompressor(bits=3, bucket_size=256, min_size=16, update_steps=(0,), seed=3)
    ys = hvd.grouped_allreduce(
        [tf.constant(rank_data(rank, 2048)), tf.constant(rank_data(rank + 5, 1024))], compression=comp
    )
    m = comp.metrics()
    out["grouped"] = {
        "shapes": [list(t.shape) for t in ys],
        "step": m["step"],
        "calls": m["calls"],
        "digest": digest(*[t.numpy() for t in ys]),
    }
    hvd.allreduce(tf.constant(rank_data(rank, 2048)), compression=comp)
    out["grouped"]["updates_after_next_round"] = comp.metrics()["level_updates"]

    # DistributedGradientTape outside tf.function (Horovod still traces its allreduce function):
    # one round per gradient() call.
    model = MLP(seed=2)
    variables = [model.w1, model.b1, model.w2, model.b2]
    comp = ALQCompressor(bits=4, bucket_size=512, min_size=100, update_steps=(0, 2), update_every=0, seed=5)
    tx, ty, _, _ = digits_data(rank, size)
    for i in range(4):
        with tf.GradientTape() as tape:
            logits = model(tx[i * 16 : (i + 1) * 16])
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(ty[i * 16 : (i + 1) * 16], logits))
        grads = hvd.DistributedGradientTape(tape, compression=comp).gradient(loss, variables)
        for v, g in zip(variables, grads):
            v.assign_sub(0.1 * g)
    m = comp.metrics()
    out["eager_tape"] = {
        "params": [digest(v.numpy()) for v in variables],
        "step": m["step"],
        "calls": m["calls"],
        "level_updates": m["level_updates"],
        "uncompressed": m["uncompressed_coordinates"],
    }
    return out


def compat(args) -> dict:
    """Horovod compatibility (issue 14), eagerly and in tf.function: ops a quantized exchange cannot
    honour and shape disagreements raise on every rank; autograd through hvd.allreduce gives
    Horovod's own gradient, not zeros; afterwards the compressor still works."""
    rank = hvd.rank()
    comp = ALQCompressor(bits=3, bucket_size=512, min_size=16, seed=3)
    out = {}
    x = tf.fill([2048], float(rank + 1))
    for mode in ("eager", "function"):
        for name in ("Min", "Max", "Product"):
            op = getattr(hvd, name)
            call = lambda t, op=op: hvd.allreduce(t, compression=comp, op=op)
            fn = tf.function(call) if mode == "function" else call
            try:
                fn(x)
                out[f"{mode}.{name}"] = None
            except Exception as err:  # noqa: BLE001 - reported
                out[f"{mode}.{name}"] = f"{type(err).__name__}: {err}"
        shape = [64, 32] if rank == 0 else [32, 64]
        call = lambda t: hvd.allreduce(t, compression=comp, name=f"shape.{mode}")  # noqa: E731
        fn = tf.function(call) if mode == "function" else call
        try:
            fn(tf.ones(shape))
            out[f"{mode}.shape"] = None
        except Exception as err:  # noqa: BLE001
            out[f"{mode}.shape"] = f"{type(err).__name__}: {err}"
    # a constant tensor is quantized exactly (every coordinate equals its bucket's norm / sqrt(d)... no:
    # use the mean of constants with QSGDinf, whose level 1 is the max-abs): exact average
    exact = QSGDCompressor(bits=3, bucket_size=512, min_size=16)
    out["after"] = float(tf.reduce_mean(hvd.allreduce(x, compression=exact)).numpy())
    # autograd: d/dx sum(w * allreduce(x)) against Horovod's uncompressed allreduce
    w = tf.constant(np.linspace(-1, 1, 2048, dtype=np.float32) * (rank + 1))
    grads = {}
    for label, compression in (("alq", comp), ("none", hvd.Compression.none)):
        v = tf.Variable(tf.fill([2048], float(rank + 1)))
        with tf.GradientTape() as tape:
            y = hvd.allreduce(v, compression=compression, name=f"grad.{label}")
            loss = tf.reduce_sum(w * y)
        grads[label] = tape.gradient(loss, v).numpy()
    out["grad_max_diff"] = float(np.abs(grads["alq"] - grads["none"]).max())
    out["grad_norm"] = float(np.linalg.norm(grads["none"]))
    return out


def _attempt(fn, *a):
    """``fn(*a)`` as ``{"error": None, "value": ...}`` or ``{"error": "Type: message"}``."""
    try:
        y = fn(*a)
        return {"error": None, "digest": digest(y.numpy())}
    except Exception as err:  # noqa: BLE001 - reported to the test
        return {"error": f"{type(err).__name__}: {err}"[-1500:], "type": type(err).__name__}


def deadlock(args) -> dict:
    """Issue "Horovod compatibility", item 1: ranks that disagree before decompress (a dtype mismatch,
    as upstream's test_horovod_allreduce_type_error; one rank below min_size) must raise or agree,
    never leave a payload collective behind; afterwards plain and compressed allreduces work."""
    rank = hvd.rank()
    comp = ALQCompressor(bits=3, bucket_size=512, min_size=16, seed=3)
    out = {}
    for mode in ("eager", "function"):
        tensor = tf.ones([17] * 3, dtype=tf.int32 if rank % 2 == 0 else tf.float32)
        call = lambda t, mode=mode: hvd.allreduce(t, compression=comp, name=f"type.{mode}")  # noqa: E731
        out[f"{mode}.dtype"] = _attempt(call if mode == "eager" else tf.function(call), tensor)
        small = ALQCompressor(bits=3, bucket_size=512, min_size=1024 if rank == 0 else 4096, seed=3)
        call = lambda t, mode=mode: hvd.allreduce(t, compression=small, name=f"min.{mode}")  # noqa: E731
        out[f"{mode}.min_size"] = _attempt(
            call if mode == "eager" else tf.function(call), tf.constant(rank_data(rank, 2048))
        )
        x = tf.constant(rank_data(rank, 4096))
        out[f"{mode}.plain_after"] = float(hvd.allreduce(tf.ones([8]) * (rank + 1), name=f"plain.{mode}")[0])
        call = lambda t: hvd.allreduce(t, compression=comp)  # noqa: E731
        out[f"{mode}.compressed_after"] = _attempt(call if mode == "eager" else tf.function(call), x)
    return out


def process_sets(args) -> dict:
    """Issue item 2 on 3 ranks with the set {0, 1}: values and refits within the set, identical on
    its members; a non-member and a compressor pinned to another set raise on every rank taking
    part, without hanging; a compressor made without process_set= serves the set; compressors made
    on the set's members only leave later global ones pairing; DistributedGradientTape(process_set=)
    trains."""
    ps = PROCESS_SET
    rank = hvd.rank()
    member = rank in ps.ranks
    out = {"member": member}
    xs = [rank_data(r, args.n).astype(np.float64) for r in ps.ranks]
    truth = np.mean(xs, axis=0)
    # DistributedGradientTape(process_set=ps) inside tf.function, on every rank (rank 2 skips the set's allreduce)
    model = MLP(seed=1)
    variables = [model.w1, model.b1, model.w2, model.b2]
    comp = ALQCompressor(
        bits=4, bucket_size=512, min_size=100, update_steps=(0, 2), update_every=0, seed=6, process_set=ps
    )
    res = train_loop(variables, model, comp, digits_data(rank, hvd.size()), 6, process_set=ps)
    res.update(step=comp.metrics()["step"] if member else None)
    out["tape"] = res
    x = tf.constant(rank_data(rank, args.n))
    for exchange in ("allgather", "two-phase"):
        comp = ALQCompressor(
            bits=3,
            bucket_size=args.bucket,
            min_size=16,
            seed=4,
            update_steps=(0, 3),
            update_every=0,
            process_set=ps,
            exchange=exchange,
        )
        if not member:  # (Horovod 0.28.1 itself waits forever in an allreduce over a set without this rank)
            continue
        fn = tf.function(lambda t, comp=comp: hvd.allreduce(t, compression=comp, process_set=ps))
        ys = np.stack([fn(x).numpy().astype(np.float64) for _ in range(args.rounds)])
        m = comp.metrics()
        err = np.linalg.norm(ys - truth, axis=1) / np.linalg.norm(truth)
        out[exchange] = {
            "digest": digest(ys),
            "rel_err_single": float(err.max()),
            "rel_err_mean": float(np.linalg.norm(ys.mean(0) - truth) / np.linalg.norm(truth)),
            "level_updates": m["level_updates"],
            "step": m["step"],
            "exchange": m["exchange"],
            "levels": m["levels"].tolist(),
        }
    # the set's compressor with a global allreduce; the global compressor with the set's allreduce
    # (no refit rounds: there the members' head vectors carry statistics, the outsider's cannot, and
    # Horovod's own shape-mismatch error was seen to leave the outsider waiting inside tf.function)
    comp = ALQCompressor(
        bits=3, bucket_size=args.bucket, min_size=16, seed=4, update_steps=(), update_every=0, process_set=ps
    )
    for mode in ("eager", "function"):
        call = lambda t, mode=mode: hvd.allreduce(t, compression=comp, name=f"global.{mode}")  # noqa: E731
        out[f"{mode}.global"] = _attempt(call if mode == "eager" else tf.function(call), x)
        if member:  # a compressor made without process_set= serves the set with a compressor of its own
            glob = ALQCompressor(bits=3, bucket_size=args.bucket, min_size=16, seed=4, update_steps=(), update_every=0)
            call = lambda t, glob=glob, mode=mode: hvd.allreduce(
                t,
                compression=glob,
                process_set=ps,  # noqa: E731
                name=f"subset.{mode}",
            )
            out[f"{mode}.subset"] = _attempt(call if mode == "eager" else tf.function(call), x)
            y = call(x).numpy().astype(np.float64)
            out[f"{mode}.subset"].update(
                rel_err=float(np.linalg.norm(y - truth) / np.linalg.norm(truth)),
                sets=[list(k) for k in glob.metrics().get("process_sets", {})],
            )
    # issue 21's case: only the set's members make (and use) a compressor for it; afterwards every
    # rank makes one and allreduces globally: the names still pair (per process set, at first use)
    if member:
        pinned = ALQCompressor(bits=3, bucket_size=args.bucket, min_size=16, seed=5, process_set=ps)
        hvd.allreduce(x, compression=pinned, process_set=ps, name="uneven.set")
    late = ALQCompressor(bits=3, bucket_size=args.bucket, min_size=16, seed=5)
    out["uneven"] = _attempt(lambda t: hvd.allreduce(t, compression=late, name="dt"), x)
    out["plain_after"] = float(hvd.allreduce(tf.ones([4]) * (rank + 1), op=hvd.Sum)[0])
    if member:
        out["set_after"] = _attempt(lambda t: hvd.allreduce(t, compression=comp, process_set=ps), x)
    hvd.allreduce(tf.ones([1]), name="process_sets.end")  # no rank shuts Horovod down while others work
    return out


#: (key, method, bits, bits_second, adapt_second) of the two-phase scenario; "alq@3": 4 bits, the
#: second quantization at 3 bits adapts its levels, "alq@3-fixed" keeps their initial fit (both on
#: spiky inputs, :func:`spiky_data`, where the fit matters).
CASES_TWO_PHASE = [
    ("alq", "alq", 3, None, None),
    ("qsgdinf", "qsgdinf", 3, 4, None),
    ("amq", "amq", 3, None, None),
    ("alq@3", "alq", 4, 3, None),
    ("alq@3-fixed", "alq", 4, 3, False),
]


def spiky_data(rank: int, n: int) -> np.ndarray:
    """Heavy-tailed inputs: 5% of the coordinates 100 times larger than the others."""
    g = np.random.default_rng(50 + rank)
    return (g.standard_normal(n) * np.where(g.random(n) < 0.05, 20.0, 0.2)).astype(np.float32)


def comp_initial_second(comp) -> list:
    """The initial levels of ``comp``'s second quantizer (a fresh compressor's)."""
    fresh = compressor_for("alq", bits=comp.bits, bucket_size=comp.bucket_size, bits_second=3)
    return fresh.metrics()["second_levels"].tolist()


def _second_state_round_trip(comp) -> bool:
    """A compressor loaded with ``comp``'s state_dict has its second levels and pending statistics."""
    other = compressor_for("alq", bits=comp.bits, bucket_size=comp.bucket_size, bits_second=3, exchange="two-phase")
    try:
        other.load_state_dict(comp.state_dict())
    except ValueError:
        return False
    a, b = comp.state_dict(), other.state_dict()
    return a["second"] == b["second"] and np.array_equal(
        a.get("pending_second_statistics", []), b.get("pending_second_statistics", [])
    )


def two_phase(args) -> dict:
    """Issue item 3: exchange="two-phase" per tensor. Unbiased (t-statistics of the deviation summed
    over all coordinates, signed by the truth, and per bucket: coordinates of a bucket share a norm),
    identical on every rank, tensors whose bucket count does not divide by N (and fewer buckets than
    ranks: empty shards); DistributedGradientTape inside tf.function gives identical variables."""
    size, rank = hvd.size(), hvd.rank()
    n, d = args.n, args.bucket
    tiny = tf.constant(rank_data(rank + 7, 200))  # 2 buckets of 128: empty shards from 3 ranks on
    out = {}
    for key, method, bits, bits_second, adapt in CASES_TWO_PHASE:
        data = spiky_data if "@" in key else rank_data
        truth = np.mean([data(r, n).astype(np.float64) for r in range(size)], axis=0)
        comp = compressor_for(
            method,
            bits=bits,
            bucket_size=d,
            update_steps=(0, 5),
            update_every=0,
            min_size=16,
            seed=args.seed,
            exchange="two-phase",
            bits_second=bits_second,
            adapt_second=adapt,
        )
        print(f"two_phase: {key}", flush=True)
        fn = tf.function(lambda t, u, comp=comp: hvd.grouped_allreduce([t, u], compression=comp))
        x = tf.constant(data(rank, n))
        fn(x, tiny)
        before = comp.metrics()
        outs, tinies = [], []
        for _ in range(args.rounds):
            y, z = fn(x, tiny)
            outs.append(y.numpy().astype(np.float64))
            tinies.append(z.numpy())
        after = comp.metrics()
        dev = np.stack(outs) - truth
        nb = -(-n // d)
        per_bucket = np.add.reduceat(dev, np.arange(0, nb * d, d), axis=1)
        gather = compressor_for(method, bits=3, bucket_size=d, min_size=16, seed=1, exchange="allgather")
        g0 = gather.metrics()
        hvd.allreduce(x, compression=gather)
        g1 = gather.metrics()
        out[key] = {
            "t_plain": float(t_stat(dev.sum(1, keepdims=True))[0]),
            "t_signed": float(t_stat((dev @ np.sign(truth))[:, None])[0]),
            "t_buckets_max": float(np.abs(t_stat(per_bucket)).max()),
            "buckets": nb,
            "reps": args.rounds,
            "rel_err": float(np.linalg.norm(dev[-1]) / np.linalg.norm(truth)),
            "digest": digest(*outs),
            "tiny_digest": digest(*tinies),
            "tiny_err": float(
                np.abs(np.mean(tinies, 0) - np.mean([rank_data(r + 7, 200) for r in range(size)], 0)).max()
            ),
            "exchange": after["exchange"],
            "level_updates": after["level_updates"],
            "levels_moved": after["levels"].tolist() != before["levels"].tolist() or after["level_updates"] > 0,
            "second_follows": after["second_levels"].tolist() == after["levels"].tolist(),
            "second_moved": after["second_levels"].tolist() != comp_initial_second(comp),
            "mse": float(np.mean(dev**2)),
            "state_same": _second_state_round_trip(comp),
            "sent_per_round": (after["bytes_sent"] - before["bytes_sent"]) / args.rounds,
            "received_per_round": (after["bytes_received"] - before["bytes_received"]) / args.rounds,
            "allgather_sent": g1["bytes_sent"] - g0["bytes_sent"],
            "allgather_received": g1["bytes_received"] - g0["bytes_received"],
        }
    print("two_phase: tape", flush=True)
    model = MLP(seed=1)
    variables = [model.w1, model.b1, model.w2, model.b2]
    comp = ALQCompressor(
        bits=4,
        bucket_size=512,
        min_size=100,
        update_steps=(0, 20, 60),
        update_every=0,
        seed=args.seed,
        exchange="two-phase",
    )
    res = train_loop(variables, model, comp, digits_data(rank, size), args.steps)
    m = comp.metrics()
    res.update(exchange=m["exchange"], level_updates=m["level_updates"], step=m["step"])
    out["tape"] = res
    return out


def _refused(fn, *a) -> dict:
    """``_attempt``, keeping the message from its first "horovod_alq:" (TF puts node names and a
    traceback around the errors raised inside tf.function)."""
    try:
        y = fn(*a)
        return {"error": None, "digest": digest(y.numpy())}
    except Exception as err:  # noqa: BLE001 - reported to the test
        text = str(err)
        return {"error": text[max(text.find("horovod_alq:"), 0) :][:1500], "type": type(err).__name__}


REFUSALS = [(exchange, mode) for exchange in ("allgather", "two-phase") for mode in ("eager", "function")]


def _after(comps, rank: int, tag: str) -> dict:
    """Issue 14, item 7: after a refusal, each compressor (the one that refused) still averages
    (eagerly and in tf.function; digests compared across ranks by the test), a plain allreduce works,
    and no round was completed by the refused calls (step 0 before the first good exchange)."""
    x = tf.constant(rank_data(rank, 2048))
    truth = np.mean([rank_data(r, 2048) for r in range(hvd.size())], axis=0)
    out = {"plain": float(hvd.allreduce(tf.ones([4]) * (rank + 1), op=hvd.Sum, name=f"{tag}.plain")[0])}
    for key, comp in comps.items():
        steps = comp.metrics()["step"]
        eager = hvd.allreduce(x, compression=comp, op=hvd.Average, name=f"{tag}.{key}.eager").numpy()
        fn = tf.function(
            lambda t, comp=comp: hvd.allreduce(t, compression=comp, op=hvd.Average, name=f"{tag}.{key}.function")
        )
        traced = fn(x).numpy()
        err = max(np.linalg.norm(y - truth) for y in (eager, traced)) / np.linalg.norm(truth)
        out[key] = {
            "steps_before": steps,
            "steps_after": comp.metrics()["step"],
            "digest": digest(eager, traced),
            "rel_err": float(err),
        }
    return out


def reducescatter(args) -> dict:
    """Issue 14, item 7: hvd.reducescatter with a compressor is refused on every rank, eagerly and in
    tf.function, in a refit round (the head carries statistics: the first rank's piece still starts
    with a valid head) and outside one, before any payload collective (a rank that went on to gather
    payloads would hang the run); then Horovod and the compressors work."""
    rank = hvd.rank()
    x = tf.reshape(tf.constant(rank_data(rank, 2048)), [64, 32])
    out, comps = {}, {}
    for exchange, mode in REFUSALS:
        for refit in (True, False):
            key = f"{exchange}.{mode}.{'refit' if refit else 'plain'}"
            comp = ALQCompressor(
                bits=3,
                bucket_size=512,
                min_size=16,
                seed=3,
                exchange=exchange,
                update_steps=(0,) if refit else (),
                update_every=0,
            )
            call = lambda t, comp=comp, key=key: hvd.reducescatter(  # noqa: E731
                t, compression=comp, op=hvd.Average, name=f"rs.{key}"
            )
            out[key] = _refused(call if mode == "eager" else tf.function(call), x)
            comps[key] = comp
    for mode in ("eager", "function"):  # grouped_reducescatter: each tensor refused alike
        key = f"grouped.{mode}"
        comps[key] = comp = ALQCompressor(
            bits=3, bucket_size=512, min_size=16, seed=3, update_steps=(0,), update_every=0
        )
        call = lambda t, comp=comp: hvd.grouped_reducescatter([t, 2 * t], compression=comp)[0]  # noqa: E731
        out[key] = _refused(call if mode == "eager" else tf.function(call), x)
    # reducescatter without compression still works
    rs = hvd.reducescatter(tf.ones([4, 3]) * (rank + 1), compression=hvd.Compression.none, op=hvd.Sum, name="rs.none")
    out["uncompressed"] = rs.numpy().tolist()
    out["after"] = _after(comps, rank, "rs.after")
    return out


def join(args) -> dict:
    """Issue 43, item 2: rank 1 calls hvd.join() while rank 0 goes on allreducing with compressors
    (eagerly and in tf.function, both exchanges, Sum and Average, then DistributedGradientTape in
    tf.function): every call is served as Horovod serves it without compression (rank 0's tensor,
    scaled by the op: compared with Horovod's own allreduce in the same mode); then rank 0 joins,
    rank 1 returns from hvd.join(), and both ranks exchange identically. One join per run:
    in Horovod 0.28.1 a second hvd.join() returns before the other ranks joined (see
    docs/guides/horovod-tensorflow.md)."""
    rank = hvd.rank()
    x = tf.constant(rank_data(rank, 2048))
    out, comps = {}, {}
    for exchange, mode in REFUSALS:
        for op in ("Average", "Sum"):
            key = f"{exchange}.{mode}.{op}"
            comps[key] = ALQCompressor(
                bits=3, bucket_size=512, min_size=16, seed=3, exchange=exchange, update_steps=(0,), update_every=0
            )
    model = MLP(seed=1)
    variables = [model.w1, model.b1, model.w2, model.b2]
    comps["tape"] = ALQCompressor(bits=4, bucket_size=512, min_size=100, update_steps=(0,), update_every=0, seed=6)
    tx, ty, _, _ = digits_data(rank, hvd.size())

    def grads_with(compression):
        @tf.function
        def grads(xb, yb):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(yb, model(xb)))
            return hvd.DistributedGradientTape(tape, compression=compression).gradient(loss, variables)

        return grads

    if rank == 1:
        out["joined"] = int(hvd.join())
    else:
        for key, comp in comps.items():
            if key == "tape":
                got = _refused(
                    lambda a, b: tf.concat([tf.reshape(g, [-1]) for g in grads_with(comp)(a, b)], 0), tx[:32], ty[:32]
                )
                ref = _refused(
                    lambda a, b: tf.concat([tf.reshape(g, [-1]) for g in grads_with(hvd.Compression.none)(a, b)], 0),
                    tx[:32],
                    ty[:32],
                )
                out[key] = [dict(got, ref=ref["digest"])]
                continue
            exchange, mode, op = key.split(".")
            calls = []
            for i in range(2):
                call = lambda t, comp=comp, op=op, name=f"join.{key}.{i}": hvd.allreduce(  # noqa: E731
                    t, compression=comp, op=getattr(hvd, op), name=name
                )
                plain = lambda t, op=op, name=f"join.{key}.{i}.ref": hvd.allreduce(  # noqa: E731
                    t, op=getattr(hvd, op), name=name
                )
                got = _refused(call if mode == "eager" else tf.function(call), x)
                calls.append(dict(got, ref=_refused(plain if mode == "eager" else tf.function(plain), x)["digest"]))
            out[key] = calls
        out["joined"] = int(hvd.join())
    out["after"] = _after(comps, rank, "join.after")
    return out


def collide(args) -> dict:
    """Issue 43, item 1: a float64 tensor below min_size with the control vector's 9 elements (2 ranks;
    shape (9,), and the control vector's own shape (9, 1)) on rank 0 while rank 1 compresses: Horovod's
    shape check refuses it on every rank (the control vector goes as (9, 1), no uncompressed tensor
    does). A (9, 1) tensor uncompressed on both ranks comes back as (9, 1) with the exact mean, also
    with a shape unknown while traced."""
    rank = hvd.rank()
    comp = ALQCompressor(bits=3, bucket_size=512, min_size=16, seed=3)
    column = tf.reshape(tf.range(9, dtype=tf.float64), [9, 1]) * (rank + 1)
    out = {}
    for mode in ("eager", "function"):
        for case, x in (
            ("collide", tf.ones([9] if rank == 0 else [1024], tf.float64)),
            ("collide_2d", tf.ones([9, 1] if rank == 0 else [1024], tf.float64)),
        ):
            call = lambda t, name=f"{case}.{mode}": hvd.allreduce(t, compression=comp, name=name)  # noqa: E731
            out[f"{case}.{mode}"] = _attempt(call if mode == "eager" else tf.function(call), x)
        call = lambda t, name=f"column.{mode}": hvd.allreduce(t, compression=comp, name=name)  # noqa: E731
        fns = {"column": call if mode == "eager" else tf.function(call)}
        if mode == "function":
            fns["column_dynamic"] = tf.function(call, input_signature=[tf.TensorSpec([None, None], tf.float64)])
        for case, fn in fns.items():
            y = fn(column)
            out[f"{case}.{mode}"] = {"shape": y.shape.as_list(), "values": y.numpy().ravel().tolist()}
    out["after"] = _attempt(
        lambda t: hvd.allreduce(t, compression=comp, name="collide.after"), tf.constant(rank_data(rank, 2048))
    )
    return out


#: The compressors' timeout=, and how long rank 1 stalls in each mode: eagerly 5 s past the timeout
#: (rank 0 raises in between); in tf.function, where nothing bounds the wait, 2 s past it (the
#: wait outlasts the timeout; each stall is idle time of the launch).
STALL_TIMEOUT, STALL = 3.0, {"eager": 8.0, "function": 5.0}


def _stall_payloads(comp, exchange: str, seconds: float) -> None:
    """Make ``comp`` (rank 1's) sleep ``seconds`` after the control vector's allreduce, before its
    first payload collective: eagerly in Python, in a graph in a host op its payload depends on."""
    method = {"allgather": "_allgather", "two-phase": "_two_phase"}[exchange]
    run = getattr(comp, method)

    def slow(ctx, reduced):
        if tf.executing_eagerly():
            time.sleep(seconds)
        else:
            shape = ctx.payload.shape
            ctx.payload = tf.numpy_function(
                lambda p: (time.sleep(seconds), p)[1], [ctx.payload], ctx.payload.dtype, stateful=True
            )
            ctx.payload.set_shape(shape)
        return run(ctx, reduced)

    setattr(comp, method, slow)


def stall(args) -> dict:
    """Issue 43, item 3: rank 1 stalls (STALL) between the control vector's allreduce and its
    payload collectives. Eagerly rank 0 raises CollectiveTimeout after timeout= (STALL_TIMEOUT); in
    tf.function it waits until rank 1 issues the collective, and both get the same result."""
    rank = hvd.rank()
    x = tf.constant(rank_data(rank, 2048))
    out = {"timeout": STALL_TIMEOUT, "stall": STALL["eager"], "stall_function": STALL["function"]}
    for exchange in ("allgather", "two-phase"):
        for mode in ("eager", "function"):
            comp = ALQCompressor(
                bits=3,
                bucket_size=512,
                min_size=16,
                seed=3,
                exchange=exchange,
                timeout=STALL_TIMEOUT,
                update_steps=(),
                update_every=0,
            )
            if rank == 1:
                _stall_payloads(comp, exchange, STALL[mode])
            call = lambda t, comp=comp, name=f"stall.{exchange}.{mode}": hvd.allreduce(  # noqa: E731
                t, compression=comp, op=hvd.Average, name=name
            )
            hvd.allreduce(tf.ones([1]), name=f"stall.start.{exchange}.{mode}")  # start together
            start = time.monotonic()
            res = _refused(call if mode == "eager" else tf.function(call), x)
            res["seconds"] = time.monotonic() - start
            out[f"{exchange}.{mode}"] = res
    return out


PROCESS_SET = None


def auto(args) -> dict:
    """bits="auto" (ALQ): tensors of scales 1000, 1 and 0.001 allreduced (Sum) in one traced step per
    exchange, refit at round 0: every rank's allocation, levels and sums; the allocation the NumPy
    core makes from every rank's data; the bytes each round puts on the wire; the deviations from the
    true sum (unbiasedness); a state_dict round trip. Then training through DistributedGradientTape
    at budget 2.5, and ranks that differ in budget or allocation (every rank must refuse)."""
    from horovod_alq.core.auto_bits import AutoBits
    from horovod_alq.core.protocol import shape_hash
    from horovod_alq.core.wire import payload_size

    size, rank = hvd.size(), hvd.rank()
    scales, numel = (1000.0, 1.0, 0.001), 1500
    data = [[rank_data(r + 7 * k, numel) * s for k, s in enumerate(scales)] for r in range(size)]
    truth = [sum(d[k].astype(np.float64) for d in data) for k in range(len(scales))]
    core = AutoBits("alq", 3.0, args.bucket)
    rows = sum(np.stack([core.row(x) for x in d]) for d in data)
    keys = [(numel, shape_hash((numel,), "float32"))] * len(scales)
    expected = [int(b) for b in core.refit(rows, [numel] * len(scales), keys).bits]
    out = {"core_allocation": expected}
    for exchange in ("allgather", "two-phase"):
        comp = ALQCompressor(
            bits="auto",
            bit_budget=3.0,
            bucket_size=args.bucket,
            update_steps=(0,),
            update_every=0,
            min_size=100,
            seed=args.seed,
            exchange=exchange,
        )
        xs = [tf.constant(x) for x in data[rank]]
        fn = tf.function(
            lambda *t: [hvd.allreduce(x, op=hvd.Sum, compression=comp, name=f"auto{k}") for k, x in enumerate(t)]
        )
        devs, sent, h = [], [], hashlib.sha1()
        for r in range(args.rounds):
            before = comp.metrics()["payload_bytes"]
            got = fn(*xs)
            sent.append(comp.metrics()["payload_bytes"] - before)
            ys = [y.numpy().astype(np.float64) for y in got]
            h.update(np.concatenate(ys).tobytes())
            if r > 0:  # round 0 refits (default widths); the allocation applies from round 1
                devs.append(np.concatenate([(y - t) / s for y, t, s in zip(ys, truth, scales)]))
        dev = np.stack(devs)
        per_bucket = np.add.reduceat(dev, np.arange(0, dev.shape[1], args.bucket), axis=1)
        m = comp.metrics()
        eager = ALQCompressor(
            bits="auto",
            bit_budget=3.0,
            bucket_size=args.bucket,
            update_steps=(0,),
            update_every=0,
            min_size=100,
            seed=args.seed,
            exchange=exchange,
        )
        he = hashlib.sha1()  # eagerly, one grouped allreduce per round: the same rounds, draws and sums
        for r in range(args.rounds):
            got = hvd.grouped_allreduce(xs, op=hvd.Sum, compression=eager, name="auto_eager")
            he.update(np.concatenate([y.numpy().astype(np.float64) for y in got]).tobytes())
        again = ALQCompressor(bits="auto", bit_budget=3.0, bucket_size=args.bucket, min_size=100)
        again.load_state_dict(comp.state_dict())
        m2 = again.metrics()
        # tf.train.Checkpoint: a restored compressor takes the next step exactly as the saved one
        restored = ALQCompressor(bits="auto", bit_budget=3.0, bucket_size=args.bucket, min_size=100, exchange=exchange)
        path = tf.train.Checkpoint(compressor=comp).save(os.path.join(tempfile.mkdtemp(), f"auto{rank}"))
        tf.train.Checkpoint(compressor=restored).restore(path).assert_consumed()
        nexts = [
            hvd.grouped_allreduce(xs, op=hvd.Sum, compression=c, name=f"auto_next{i}")
            for i, c in enumerate((comp, restored))
        ]
        out[exchange] = {
            "allocation": m["allocation"],
            "allocated_mean_bits": m["allocated_mean_bits"],
            "bits": comp.bits,
            "exchange": m["exchange"],
            "level_updates": m["level_updates"],
            "digest": h.hexdigest(),
            "eager_digest": he.hexdigest(),
            "eager_allocation": eager.metrics()["allocation"],
            "width_levels": {str(w): v.tolist() for w, v in m["width_levels"].items()},
            "sent_first": sent[0],
            "sent_later": sorted(set(sent[1:])),
            "payload_sizes": {str(w): payload_size(numel, w, args.bucket) for w in range(2, 9)},
            "t_max": float(np.abs(t_stat(per_bucket)).max()),
            "buckets": per_bucket.shape[1],
            "reps": dev.shape[0],
            "checkpoint_same_step": all(np.array_equal(a.numpy(), b.numpy()) for a, b in zip(*nexts)),
            "reloaded": m2["allocation"] == m["allocation"]
            and all(np.array_equal(m2["width_levels"][w], v) for w, v in m["width_levels"].items()),
        }
    # bits_max=4: the graph holds widths 2 to 4 only; the allocation is the core's under the cap
    capped = AutoBits("alq", 3.0, args.bucket, bits_max=4)
    rows = sum(np.stack([capped.row(x) for x in d]) for d in data)
    comp = ALQCompressor(bits="auto", bit_budget=3.0, bits_max=4, bucket_size=args.bucket, update_steps=(0,),
                         update_every=0, min_size=100, seed=args.seed)  # fmt: skip
    fn = tf.function(
        lambda *t: [hvd.allreduce(x, op=hvd.Sum, compression=comp, name=f"cap{k}") for k, x in enumerate(t)]
    )
    ys = [fn(*[tf.constant(x) for x in data[rank]]) for _ in range(3)][-1]
    m = comp.metrics()
    out["bits_max"] = {
        "core_allocation": [int(b) for b in capped.refit(rows, [numel] * len(scales), keys).bits],
        "allocation": m["allocation"],
        "widths": sorted(int(w) for w in m["width_levels"]),
        "levels_shape": list(comp._vars.auto.levels.shape),
        "digest": digest(*[y.numpy() for y in ys]),
    }
    model = MLP(seed=1)
    comp = ALQCompressor(
        bits="auto",
        bit_budget=2.5,
        bucket_size=args.bucket,
        update_steps=(0, 20, 60),
        update_every=0,
        min_size=100,
        seed=args.seed,
    )
    res = train_loop([model.w1, model.b1, model.w2, model.b2], model, comp, digits_data(rank, size), args.steps)
    m = comp.metrics()
    out["train"] = {
        **res,
        "allocation": m["allocation"],
        "allocated_mean_bits": m["allocated_mean_bits"],
        "level_updates": m["level_updates"],
    }
    for what in ("budget", "allocation"):
        comp = ALQCompressor(
            bits="auto",
            bit_budget=2.5 if rank == 1 and what == "budget" else 3.0,
            bucket_size=256,
            min_size=16,
            seed=0,
            update_steps=(),
        )
        if rank == 1 and what == "allocation":
            state = comp.state_dict()
            state["auto"]["keys"], state["auto"]["bits"] = [[4096, shape_hash((4096,), "float32")]], [5]
            comp.load_state_dict(state)
        try:
            y = reduce_fn(comp, hvd.Average, "function")(tf.constant(rank_data(rank, 4096)))
            out[f"mismatch.{what}"] = {"error": None, "out": digest(y.numpy())}
        except Exception as err:  # noqa: BLE001 - reported to the test
            out[f"mismatch.{what}"] = {"error": f"{type(err).__name__}: {err}"[-1500:]}
    return out


FUSION_SHAPES = [((40, 30), "float32"), ((7,), "float32"), ((300,), "float32"), ((20, 20, 3), "float32"),
                 ((500,), "float16"), ((10,), "int32"), (None, None), ((200,), "float64")]  # fmt: skip


def fusion_inputs(rank: int) -> list:
    """Rank ``rank``'s tensors for the fusion scenario (ints: the same on every rank; None: no gradient)."""
    rng = np.random.default_rng(40 + rank)
    return [
        None if shape is None
        else np.arange(10, dtype=dtype) if dtype == "int32"
        else (rng.standard_normal(shape) + rank).astype(dtype)
        for shape, dtype in FUSION_SHAPES
    ]  # fmt: skip


def _chunk_t(dev: np.ndarray, chunk: int = 128) -> float:
    """The largest |t| of the deviations (reps, *shape) summed over chunks of ``chunk`` coordinates."""
    flat = dev.reshape(dev.shape[0], -1)
    return float(np.abs(t_stat(np.add.reduceat(flat, np.arange(0, flat.shape[1], chunk), axis=1))).max())


def fusion(args) -> dict:
    """horovod_alq.tensorflow.fused_allreduce, eagerly and in tf.function, 24 calls each: the ranks'
    results (digest), each tensor's dtype and shape, the t statistics of each float tensor's deviation
    from the exact average, the compressor's counters (buffers per call), fusion_bytes=0 (a buffer
    per tensor), and DistributedGradientTape against the plain tape's gradients fused alike."""
    from horovod_alq.tensorflow import DistributedGradientTape, fused_allreduce

    rank, size, reps = hvd.rank(), hvd.size(), 24
    mine = fusion_inputs(rank)
    every = [fusion_inputs(r) for r in range(size)]
    exact = [None if x is None else np.mean([e[i].astype(np.float64) for e in every], 0) for i, x in enumerate(mine)]
    tensors = [None if x is None else tf.constant(x) for x in mine]
    out = {}
    for mode in ("eager", "function"):
        for fusion_bytes in (6000, 0):
            comp = ALQCompressor(bits=4, bucket_size=128, seed=3, min_size=16, fusion_bytes=fusion_bytes)
            fn = (lambda ts, c=comp: fused_allreduce(ts, c)) if mode == "eager" else tf.function(
                lambda ts, c=comp: fused_allreduce(ts, c))  # fmt: skip
            runs = [[None if y is None else y.numpy() for y in fn(tensors)] for _ in range(reps)]
            floats = [i for i, x in enumerate(mine) if x is not None and x.dtype.kind == "f" and x.size >= 16]
            m = comp.metrics()
            out[f"{mode}.{fusion_bytes}"] = {
                "digest": digest(*[y for y in runs[-1] if y is not None]),
                "dtypes": [None if y is None else str(y.dtype) for y in runs[0]],
                "shapes": [None if y is None else list(y.shape) for y in runs[0]],
                "t_max": {i: _chunk_t(np.stack([r[i].astype(np.float64) - exact[i] for r in runs])) for i in floats},
                "ints_exact": bool(np.array_equal(runs[0][5], exact[5])),
                "small_close": float(np.abs(runs[0][1] - exact[1]).max()),
                "reps": reps,
                "step": m["step"],
                "calls": m["calls"],
                "uncompressed": m["uncompressed_coordinates"],
            }
    w = tf.Variable(tf.constant(np.random.default_rng(rank).standard_normal((64, 8)), tf.float32))
    b = tf.Variable(tf.zeros([8]))
    x = tf.constant(np.random.default_rng(100 + rank).standard_normal((16, 64)), tf.float32)
    grads = {}
    for how in ("tape", "plain"):
        comp = ALQCompressor(bits=3, bucket_size=128, seed=9, min_size=4)
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.tanh(x @ w + b) ** 2)
        if how == "tape":
            grads[how] = DistributedGradientTape(tape, compression=comp).gradient(loss, {"w": w, "b": b})
        else:
            g = tape.gradient(loss, {"w": w, "b": b})
            grads[how] = dict(zip(("b", "w"), fused_allreduce([g["b"], g["w"]], comp)))
    out["tape"] = {
        "keys": sorted(grads["tape"]),
        "same": all(np.array_equal(grads["tape"][k].numpy(), grads["plain"][k].numpy()) for k in ("w", "b")),
        "digest": digest(grads["tape"]["w"], grads["tape"]["b"]),
    }
    return out


def feedback(args) -> dict:
    """error_feedback=True in TensorFlow (2 ranks, in tf.function): a state_dict and a
    tf.train.Checkpoint restore take the next step bit for bit; a bucket holding NaN keeps its
    previous error while the others change; a state without buffers loads with a warning and zero
    buffers, one with buffers into a compressor without error feedback raises; a refit keeps the
    buffers; bits="auto" and fused_allreduce run with it, identically on both ranks."""
    import warnings

    from horovod_alq.tensorflow import fused_allreduce

    rank = hvd.rank()
    x = tf.constant(rank_data(rank, 1000))
    common = dict(bits=2, bucket_size=128, min_size=16, seed=4, error_feedback=True)

    def make(**kw):
        comp = ALQCompressor(**{**common, **kw})
        return comp, tf.function(lambda t: hvd.allreduce(t, compression=comp, name="fb"))

    def buffers(comp):
        return {tuple(k): np.asarray(v) for k, v in comp.state_dict()["error_feedback"]["buffers"]}

    out = {}
    comp, fn = make(update_steps=(0, 2), update_every=0)
    for _ in range(2):
        fn(x)
    before = buffers(comp)
    for _ in range(2):  # round 3 begins with the refit of round 2's statistics: the buffers stay
        fn(x)
    kept = buffers(comp)
    out["refit_kept"] = (
        comp.metrics()["level_updates"] == 2
        and set(kept) == set(before)
        and all(np.abs(v).max() > 0 for v in kept.values())
    )
    saved = comp.state_dict()
    path = tf.train.Checkpoint(compressor=comp).save(os.path.join(tempfile.mkdtemp(), f"fb{rank}"))
    other, other_fn = make(update_steps=(0, 2), update_every=0)
    other.load_state_dict(saved)
    restored, restored_fn = make(update_steps=(0, 2), update_every=0)
    tf.train.Checkpoint(compressor=restored).restore(path)
    nexts = [fn(x).numpy(), other_fn(x).numpy(), restored_fn(x).numpy()]
    out["resume_same"] = [bool(np.array_equal(nexts[0], y)) for y in nexts[1:]]
    out["digest"] = digest(nexts[0])
    before = buffers(comp)
    y = rank_data(rank, 1000).copy()
    y[5] = np.nan
    try:
        fn(tf.constant(y))
    except Exception:  # noqa: BLE001 - the NaN bucket may fail the exchange; the buffer is what is checked
        pass
    after = buffers(comp)
    (key,) = [k for k in after if k[2] == "own"]
    out["nan_bucket_kept"] = bool(np.array_equal(after[key][:128], before[key][:128]))
    out["others_changed"] = bool(not np.array_equal(after[key][128:], before[key][128:]))
    fresh, _ = make()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plain_state = ALQCompressor(bits=2, bucket_size=128, min_size=16).state_dict()
        fresh.load_state_dict(plain_state)
    out["warned"] = any("without error buffers" in str(w.message) for w in caught)
    try:
        ALQCompressor(bits=2, bucket_size=128, min_size=16).load_state_dict(saved)
        out["refused"] = None
    except ValueError as err:
        out["refused"] = str(err)
    auto_comp, auto_fn = make(bits="auto", bit_budget=2.5, update_steps=(0,), update_every=0)
    ys = [auto_fn(x) for _ in range(3)][-1]
    fused_comp = ALQCompressor(**common)
    fused = tf.function(lambda ts: fused_allreduce(ts, fused_comp))
    zs = [fused([x, x[:300] * 2.0]) for _ in range(3)][-1]
    out["auto_fused_digest"] = digest(ys.numpy(), *[z.numpy() for z in zs])
    out["auto_fused_buffers"] = [len(buffers(auto_comp)), len(buffers(fused_comp))]
    return out


def main() -> None:
    global PROCESS_SET
    if SCENARIO_NAMES[-1] == "process_sets":
        PROCESS_SET = hvd.ProcessSet([0, 1])
        hvd.init(process_sets=[PROCESS_SET])
    else:
        hvd.init()
    results = {}
    for args in GROUPS:
        for name in args.scenarios:
            # (the rank's log: where a failed launch stopped, and each scenario's start)
            print(f"== scenario {name} at {time.monotonic() - START:.1f} s", flush=True)
            QuantizedCompressor.__init__.__kwdefaults__["jit_compile"] = _JIT_DEFAULT and name == "exchange"
            results[name] = globals()["keras_fit" if name == "keras" else name](args)
    report(results if len(results) > 1 else results[SCENARIO_NAMES[0]])
    hvd.shutdown()


if __name__ == "__main__":
    sys.exit(main())
