"""Worker for tests/test_conformance.py: every (method, exchange) through one front-end, one launch.

    conformance.py --frontend {torch,tf,ddp,mpi} --exchanges allgather,two-phase --methods qsgdinf,alq
                   --elements N --bits B --bucket D --rounds R --seed S --out DIR [--wire entropy]
                   [--plugin FILE:FUNCTION]

Front-ends: ``torch`` (``hvd.allreduce`` with the Horovod torch compressor; mpirun), ``tf``
(``hvd.allreduce`` with the TensorFlow compressor inside one ``tf.function``; mpirun), ``ddp``
(``DistributedDataParallel`` with ``alq_hook`` over gloo; torchrun), ``mpi`` (``QuantizedAllreduce``;
mpirun). Each rank averages its own :func:`rank_data` with every method and exchange: one warm-up
round (adaptive methods refit from it), then ``R`` rounds of the same input with fixed levels.

Rank 0 writes ``DIR/{frontend}.npz`` (key ``"{method}|{exchange}"``: the R outputs, float32, (R, N));
every rank reports, per key, the SHA-1 of each output, the front-end's ``metrics()`` per round
(``bytes_sent`` and ``bytes_received`` of each round, warm-up first), the levels after the run and
the error if the front-end refused.
Groups of these arguments separated by "::" (one --frontend) run in turn in one launch, each with
its own --out; every rank then reports ``{"groups": [what each group alone would report]}``.
The assertions are the test's.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
import traceback
from pathlib import Path

import helpers
import numpy as np

#: Rank ``rank``'s input: its own scale and offset, a heavy-tailed quarter (the test regenerates it).
rank_data = functools.partial(helpers.rank_data, seed=20, tail=0.05)


def feedback(args) -> dict:
    """``error_feedback=True`` when asked for."""
    return {"error_feedback": True} if args.error_feedback else {}


# ------------------------------------------------------------------ front-ends
# Each returns (rank, make), make(method, exchange, args) -> (step, metrics): step(x) is one
# averaged round (NumPy in, NumPy out) and metrics() the front-end's metrics dict.


def torch_frontend():
    import horovod.torch as hvd
    import torch

    from horovod_alq.torch import compressor_for

    hvd.init()

    def make(method, exchange, args):
        comp = compressor_for(
            method,
            bits=args.bits,
            bucket_size=args.bucket,
            update_steps=(0,),
            update_every=0,
            min_size=16,
            seed=args.seed,
            exchange=exchange,
            wire=args.wire,
            **feedback(args),
        )
        calls = iter(range(1 << 30))

        def step(x):
            # error feedback keeps the tensor's error under its name: the same at every call
            call = "" if args.error_feedback else f".{next(calls)}"
            out = hvd.allreduce(
                torch.from_numpy(x), compression=comp, op=hvd.Average, name=f"conformance.{method}.{exchange}{call}"
            )
            return out.numpy()

        step.holder = comp
        return step, comp.metrics

    return hvd.rank(), make


def tf_frontend():
    import horovod.tensorflow as hvd
    import tensorflow as tf

    from horovod_alq.tensorflow import compressor_for

    hvd.init()

    def make(method, exchange, args):
        # jit_compile=False by default: no XLA compile per traced shape (this test's tensors are tiny)
        comp = compressor_for(
            method,
            bits=args.bits,
            bucket_size=args.bucket,
            update_steps=(0,),
            update_every=0,
            min_size=16,
            seed=args.seed,
            exchange=exchange,
            jit_compile=args.tf_jit,
            wire=args.wire,
            **feedback(args),
        )
        fn = tf.function(lambda t: hvd.allreduce(t, compression=comp, op=hvd.Average))  # one call, one round

        def step(x):
            return fn(tf.constant(x)).numpy()

        step.holder = comp
        return step, comp.metrics

    return hvd.rank(), make


def ddp_frontend():
    import torch
    import torch.distributed as dist
    from common import linear
    from torch.nn.parallel import DistributedDataParallel as DDP

    from horovod_alq.torch.ddp import ALQState, alq_hook

    dist.init_process_group("gloo")

    def make(method, exchange, args):
        model = DDP(linear(args.elements))  # the gradient is x exactly, one DDP bucket
        state = ALQState(
            method=method,
            bits=args.bits,
            bucket_size=args.bucket,
            exchange=exchange,
            seed=args.seed,
            update_steps=(0,),
            update_every=0,
            min_size=16,
            wire=args.wire,
            **feedback(args),
        )
        model.register_comm_hook(state, alq_hook)

        def step(x):
            model.zero_grad(set_to_none=True)
            model(torch.from_numpy(x)).backward()
            return model.module.p.grad.numpy().copy()

        step.holder = state
        return step, state.metrics

    return dist.get_rank(), make


def mpi_frontend():
    from mpi4py import MPI

    from horovod_alq.core.methods import get_method
    from horovod_alq.mpi import QuantizedAllreduce

    def make(method, exchange, args):
        ar = QuantizedAllreduce(
            MPI.COMM_WORLD,
            method,
            bits=args.bits,
            bucket_size=args.bucket,
            seed=args.seed,
            exchange=exchange,
            collect_every=0,
            wire=args.wire,
            **feedback(args),
        )
        calls, adaptive = [0], get_method(method).adaptive

        def step(x):
            # the warm-up call collects and adapt() refits: the other front-ends' refit at round 0
            first = calls[0] == 0 and adaptive
            calls[0] += 1
            out = ar(x, collect=first, key="x" if args.error_feedback else None)
            if first:
                ar.adapt()
            return out

        step.holder = ar
        return step, ar.metrics

    return MPI.COMM_WORLD.Get_rank(), make


FRONTENDS = {"torch": torch_frontend, "tf": tf_frontend, "ddp": ddp_frontend, "mpi": mpi_frontend}


def run_one(step, metrics, x, rounds, after_warmup=None):
    """Warm-up round, then ``rounds`` rounds; per-round byte counts from the cumulative metrics;
    ``after_warmup()`` is called after the warm-up round."""
    sent, received, outputs, digests, times = [], [], [], [], []
    last = metrics()
    before = (last["bytes_sent"], last["bytes_received"])
    for i in range(rounds + 1):
        t0 = time.monotonic()
        y = step(x)
        times.append(time.monotonic() - t0)
        if i == 0 and after_warmup is not None:
            after_warmup()
        if i:
            outputs.append(np.asarray(y, dtype=np.float32).reshape(-1))
            digests.append(helpers.digest(outputs[-1]))
        m = metrics()
        sent.append(int(m["bytes_sent"] - before[0]))
        received.append(int(m["bytes_received"] - before[1]))
        before = (m["bytes_sent"], m["bytes_received"])
    return np.stack(outputs), {
        "digests": digests,
        "bytes_sent": sent,
        "bytes_received": received,
        "exchange": m["exchange"],
        "step": int(m["step"]),
        "levels": np.asarray(m["levels"]).tolist(),
        "second_levels": np.asarray(m["second_levels"]).tolist(),
        "level_updates": int(m["level_updates"]),
        "coordinates": int(m["coordinates"]),
        "uncompressed_coordinates": int(m["uncompressed_coordinates"]),
        "wire_fixed_bytes": int(m["wire_fixed_bytes"]),
        "wire_coded_bytes": int(m["wire_coded_bytes"]),
        "first_round_s": times[0],
        "later_rounds_s": sum(times[1:]),
    }


def load_plugin(spec: str) -> None:
    """Import ``FILE`` and call its ``FUNCTION()``: how a test module registers its own exchange here."""
    import importlib.util

    path, function = spec.rsplit(":", 1)
    module_spec = importlib.util.spec_from_file_location(Path(path).stem, path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    getattr(module, function)()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--frontend", required=True, choices=sorted(FRONTENDS))
    p.add_argument("--exchanges", required=True)
    p.add_argument("--methods", default="qsgdinf,alq")
    p.add_argument("--elements", type=int, default=10900)
    p.add_argument("--bits", type=int, default=3)
    p.add_argument("--bucket", type=int, default=256)
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--seed", type=int, default=5)
    p.add_argument("--tf-jit", action="store_true", help="tf: compile the codec with XLA")
    p.add_argument("--wire", default="fixed", choices=("fixed", "entropy"))
    p.add_argument("--error-feedback", action="store_true", help="error_feedback=True; reports the buffers")
    p.add_argument("--out", required=True)
    p.add_argument("--plugin", help="FILE:FUNCTION to call first (a test that registers an exchange of its own)")
    groups, current = [], []  # runs with arguments of their own, "::" between them: one launch
    for word in sys.argv[1:] + ["::"]:
        if word == "::":
            groups.append(p.parse_args(current))
            current = []
        else:
            current.append(word)
    if len({g.frontend for g in groups}) > 1:
        p.error("one --frontend for every group of a launch")
    for args in groups:
        if args.plugin:
            load_plugin(args.plugin)

    from common import report

    start = time.monotonic()
    rank, make = FRONTENDS[groups[0].frontend]()
    outs = [run_group(args, rank, make, start) for args in groups]
    report(outs[0] if len(outs) == 1 else {"groups": outs})


def run_group(args, rank: int, make, start: float) -> dict:
    """One group's runs: every (method, exchange) of ``args``; rank 0 saves the outputs in --out."""
    from common import placed_buffers

    x = rank_data(rank, args.elements)
    arrays, out = {}, {"rank": rank, "startup_s": time.monotonic() - start, "runs": {}}
    for method in args.methods.split(","):
        for exchange in args.exchanges.split(","):
            key = f"{method}|{exchange}"
            t0 = time.monotonic()
            try:  # a refusal (e.g. an exchange this front-end does not serve) is reported, not skipped
                step, metrics = make(method, exchange, args)
                first: list = []
                keep = (
                    (lambda: first.append(placed_buffers(step.holder.state_dict(), args.elements)))
                    if args.error_feedback
                    else None
                )
                arrays[key], info = run_one(step, metrics, x, args.rounds, keep)
                if args.error_feedback:  # after the warm-up round and after the last
                    info["buffers"] = [first[0], placed_buffers(step.holder.state_dict(), args.elements)]
            except Exception as exc:
                traceback.print_exc()
                info = {"error": f"{type(exc).__name__}: {exc}"}
            info["seconds"] = time.monotonic() - t0
            out["runs"][key] = info
    if rank == 0:  # the other ranks' outputs are compared through their digests
        np.savez(Path(args.out) / f"{args.frontend}.npz", **arrays)
    out["total_s"] = time.monotonic() - start
    return out


if __name__ == "__main__":
    main()
