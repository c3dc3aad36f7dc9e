"""Worker for tests/mpi/test_quantized_allreduce.py: every scenario in one launch (mpirun start-up
dominates), reported as one dict per rank. Only mpi4py, NumPy and the core: no framework."""

import argparse
import functools
import hashlib

import helpers
import numpy as np
from common import report
from helpers import digest, t_stat
from mpi4py import MPI

from horovod_alq.core.bucket_widths import mixed_payload_size
from horovod_alq.core.methods import get_method
from horovod_alq.core.statistics import normalize
from horovod_alq.core.wire import payload_size
from horovod_alq.mpi import QuantizedAllreduce

ALL = ["alq", "alq-n", "amq", "amq-n", "qsgdinf", "qsgd", "nuqsgd", "terngrad"]
ADAPTIVE = {"alq", "alq-n", "amq", "amq-n"}


#: World rank ``rank``'s input: its own scale and offset, a heavy-tailed quarter (some buckets heavy-tailed).
rank_data = functools.partial(helpers.rank_data, seed=7, tail=0.01)


def bits_of(method: str) -> int:
    return 2 if method == "terngrad" else 3


def output_law(xs: list, levels: np.ndarray, bucket: int, norm: str) -> tuple:
    """Exact law of one call's output given the ranks' arrays and the levels, per coordinate: the
    expectation, the variance, and the largest range of one rank's term.

    Rank ``r`` sends ``n32 * l32[j]`` or ``n32 * l32[j+1]`` (products rounded to float32 as the
    decoder does), the upper one with probability ``p = (x / n32 - l_j) / (l_{j+1} - l_j)``;
    the ranks' draws are independent; the output is the mean over ranks.
    """
    size = len(xs)
    l64 = np.asarray(levels, dtype=np.float64)
    l32 = l64.astype(np.float32).astype(np.float64)
    expect = var = width = 0.0
    for x in xs:
        nz = normalize(x, bucket, norm)
        n = x.size
        r = nz.r.reshape(-1)[:n]
        scale = np.repeat(nz.norms.astype(np.float64), bucket)[:n]
        j = np.clip(np.searchsorted(l64, r, side="right") - 1, 0, l64.size - 2)
        p = (r - l64[j]) / (l64[j + 1] - l64[j])
        lo = (scale * l32[j]).astype(np.float32).astype(np.float64)
        hi = (scale * l32[j + 1]).astype(np.float32).astype(np.float64)
        expect = expect + ((1 - p) * lo + p * hi) / size
        var = var + p * (1 - p) * (hi - lo) ** 2 / size**2
        width = np.maximum(width, (hi - lo) / size)
    return expect, var, width


def bernstein_ratio(dev: float, var: float, bound: float, log_term: float, slack: float) -> float:
    """``|dev|`` over Bernstein's half-width: a sum of independent centred terms, each at most
    ``bound`` in size, total variance ``var``, exceeds ``t = b L / 3 + sqrt((b L / 3)**2 + 2 var L)``
    with probability at most ``2 exp(-L)``. ``slack`` absorbs float32 rounding of the outputs."""
    a = bound * log_term / 3
    return float(abs(dev) / (a + np.sqrt(a * a + 2 * var * log_term) + slack))


def unbiased(comm, method: str, n: int, bucket: int, reps: int, alpha: float) -> dict:
    """Warm up, adapt, then ``reps`` calls with fixed levels: the mean output against its exact law.

    Reports ratios of deviations to Bernstein's bound at total failure probability ``alpha`` (so < 1
    unless biased): every coordinate's ``mean - expectation``; and the sum of the z-scores
    ``(mean - expectation) / sqrt(variance / reps)``, plain (an offset) and signed by the
    expectation (a scale error), over the coordinates whose terms are at most one standard error
    in size (``reps * p * (1 - p) >= 1`` on one rank). Bernstein, not a normal quantile, because
    stochastic rounding with a small probability makes a coordinate's mean of ``reps`` draws skewed.
    """
    world = MPI.COMM_WORLD.Get_rank()
    members = comm.allgather(world)
    x = rank_data(world, n)
    xs = [rank_data(r, n) for r in members]
    truth = np.mean([v.astype(np.float64) for v in xs], axis=0)
    bits = bits_of(method)
    ar = QuantizedAllreduce(
        comm, method, bits=bits, bucket_size=bucket, seed=11 + ALL.index(method), exchange="allgather"
    )  # the exact law below is the allgather exchange's
    start = ar.levels
    for i in range(3):
        ar(x * np.float32(1 + 0.5 * i))
    refit = ar.adapt()
    outs = np.empty((reps, n), dtype=np.float64)
    h = hashlib.sha1()
    for i in range(reps):
        out = ar(x, collect=False)
        h.update(out.tobytes())
        outs[i] = out
    expect, var, width = output_law(xs, ar.levels, bucket, get_method(method).norm)
    dev = outs.mean(0) - expect
    v, b = var / reps, width / reps  # of the mean of reps calls: one term per call and rank
    scale = float(np.abs(truth).max())
    slack = 1e-6 * scale  # float32 rounding of the outputs
    log_term = np.log(2 * (n + 2) / alpha)  # union over the coordinates and the two sums
    per_coord = max(bernstein_ratio(d, vi, bi, log_term, slack) for d, vi, bi in zip(dev, v, b))
    regular = (v > 0) & (b * b <= v)
    z = dev[regular] / np.sqrt(v[regular])
    zb = float((b[regular] / np.sqrt(v[regular])).max())  # terms of a z-score are at most this
    z_slack = float((slack / np.sqrt(v[regular])).sum())
    parts = ar.allgather(x)
    m = ar.metrics()
    return {
        "n": n,
        "reps": reps,
        "alpha": alpha,
        "expect_vs_truth": float(np.abs(expect - truth).max() / scale),
        "bernstein_coordinates": per_coord,
        "bernstein_z_sum": bernstein_ratio(z.sum(), z.size, zb, log_term, z_slack),
        "bernstein_z_signed": bernstein_ratio(np.sign(expect[regular]) @ z, z.size, zb, log_term, z_slack),
        "max_abs_z": float(np.abs(z).max()),
        "sum_z": float(z.sum()),
        "n_z": int(z.size),
        "outputs": h.hexdigest(),
        "dtype": str(out.dtype),
        "refit": refit,
        "start_levels": start.tolist(),
        "levels": ar.levels.tolist(),
        "fingerprint": ar.quantizer.fingerprint,
        "level_updates": m["level_updates"],
        "step": m["step"],
        "payload_bytes": m["payload_bytes"],
        "coordinates": m["coordinates"],
        "uncompressed": m["uncompressed_coordinates"],
        "bits_per_coordinate": m["bits_per_coordinate"],
        "metric_keys": sorted(m),
        "one_payload": payload_size(n, bits, bucket),
        "gathered_bytes": int(sum(p.size for p in parts)),
        "payload_sizes": [int(p.size) for p in parts],
        "own_payload": digest(parts[comm.Get_rank()]),
        "members": members,
    }


def dtypes(comm) -> dict:
    """float16/32/64 in -> same dtype and shape out; close to the exact average."""
    rank = comm.Get_rank()
    ar = QuantizedAllreduce(comm, "alq", bits=4, bucket_size=64, seed=3)
    res = {}
    for name in ("float16", "float32", "float64"):
        x = rank_data(rank, 600).reshape(20, 30).astype(name)
        exact = comm.allreduce(x.astype(np.float64)) / comm.Get_size()
        for label, arr in ((name, x), (name + ".strided", x[:, ::2])):
            out = ar(arr)
            ref = exact if arr is x else exact[:, ::2]
            res[label] = {
                "dtype": str(out.dtype),
                "shape": list(out.shape),
                "same_shape": out.shape == arr.shape,
                "rel_err": float(np.linalg.norm(out - ref) / np.linalg.norm(ref)),
                "digest": digest(out),
            }
    x = rank_data(rank, 256)
    res["sum_over_average"] = float(np.median(ar(x, op="sum") / ar(x)))
    nan = rank_data(rank, 256)
    if rank == 1:
        nan[70] = np.nan
    out = ar(nan)
    res["nan_buckets"] = [bool(np.isnan(out[i * 64 : (i + 1) * 64]).all()) for i in range(4)]
    res["empty"] = list(ar(np.zeros(0, np.float32)).shape)
    return res


def _attempt(fn) -> str | None:
    try:
        fn()
    except Exception as err:  # noqa: BLE001 - reported to the test
        return f"{type(err).__name__}: {err}"
    return None


def errors(comm) -> dict:
    """Rank 1 differs in one thing per case: every rank must raise (no hang), and afterwards the
    communicator still works."""
    rank = comm.Get_rank()
    odd = rank == 1
    x = rank_data(rank, 500)
    good = QuantizedAllreduce(comm, "alq", bits=3, bucket_size=64, seed=0)
    res, after = {}, {}

    def config(**changes):
        kw = dict(method="alq", bits=3, bucket_size=64, seed=0)
        if odd:
            kw.update(changes)
        return QuantizedAllreduce(comm, **kw)

    other_levels = np.array([-1, -0.4, -0.1, -0.01, 0.01, 0.1, 0.4, 1.0])

    def levels_ar():
        ar = config()
        if odd:
            ar.quantizer.set_levels(other_levels)
        return ar

    cases = {
        "bits": lambda: config(bits=4)(x),
        "bucket": lambda: config(bucket_size=32)(x),
        "method": lambda: config(method="amq")(x),
        "levels": lambda: levels_ar()(x),
        "numel": lambda: good(x[:-1] if odd else x),
        "int_input": lambda: good(x.astype(np.int32) if odd else x),
        "str_input": lambda: good(np.array(["a", "b"]) if odd else x),
        "adapt_levels": lambda: levels_ar().adapt(),
        "adapt_stats": lambda: good.adapt(np.ones(3) if odd else None),
        "adapt_config": lambda: config(bits=4).adapt(),
        "norm": lambda: config(norm="linf" if good.norm == "l2" else "l2")(x),
        "adapt_norm": lambda: config(norm="linf" if good.norm == "l2" else "l2").adapt(),
        "feedback_key": lambda: QuantizedAllreduce(comm, "alq", bits=3, bucket_size=64, error_feedback=True)(
            x, key=None if odd else "x"
        ),
    }
    for name, fn in cases.items():
        res[name] = _attempt(fn)
        after[name] = digest(good(x))  # the communicator is still usable, results still identical
    res["bad_op"] = _attempt(lambda: good(x, op="max" if odd else "average"))
    after["bad_op"] = digest(good(x))
    return {"errors": res, "after": after, "good_levels": good.levels.tolist()}


def bounded_wait(comm) -> dict:
    """Rank 0 waits for an allreduce that rank 1 joins only 3 s later, with a 1 s timeout: rank 0
    raises naming it (no hang); rank 1's late call then completes the pending collective."""
    import time

    from horovod_alq.core.protocol import CollectiveTimeout
    from horovod_alq.mpi.transport import MpiTransport

    t = MpiTransport(comm, timeout=1)
    out = {"error": None}
    if comm.Get_rank() == 0:
        start = time.monotonic()
        try:
            t.allreduce_max(np.ones(4, dtype=np.int64), "late")
        except CollectiveTimeout as err:
            out = {"error": str(err), "seconds": time.monotonic() - start}
    else:
        time.sleep(3)
        t.comm.Iallreduce(np.ones(4, dtype=np.int64), np.empty(4, dtype=np.int64), op=MPI.MAX).Wait()
    comm.Barrier()
    return out


_COUNT: dict = {}


class _Counting(MPI.Intracomm):
    """The same communicator, counting the collectives called on it (by method name)."""


def _counted(name):
    base = getattr(MPI.Intracomm, name)

    def call(self, *args, **kwargs):
        _COUNT[name] = _COUNT.get(name, 0) + 1
        return base(self, *args, **kwargs)

    return call


for _name in (
    "Allgather",
    "allgather",
    "Allgatherv",
    "Iallgatherv",
    "Allreduce",
    "allreduce",
    "Iallreduce",
    "Alltoallv",
    "Ialltoallv",
    "Bcast",
    "bcast",
    "Barrier",
):
    setattr(_Counting, _name, _counted(_name))


def collectives(comm) -> dict:
    """The collectives of one call and of one adapt(), per exchange."""
    x = rank_data(comm.Get_rank(), 500)
    res = {}
    for exchange in ("allgather", "two-phase"):
        ar = QuantizedAllreduce(_Counting(comm), "alq", bits=3, bucket_size=64, seed=0, exchange=exchange)
        ar(x)
        _COUNT.clear()
        ar(x)
        res[exchange] = dict(_COUNT)
        _COUNT.clear()
        ar.adapt()
        res[exchange + ".adapt"] = dict(_COUNT)
    return res


def refit_failure(comm) -> dict:
    """The fit raises on rank 1 only: every rank raises, restores its levels and carries on."""
    x = rank_data(comm.Get_rank(), 500)
    ar = QuantizedAllreduce(comm, "alq", bits=3, bucket_size=64, seed=0)
    ar(x)
    start = ar.levels
    if comm.Get_rank() == 1:

        def broken(*args, **kwargs):
            raise FloatingPointError("injected")

        ar.quantizer.adapt = broken
    err = _attempt(ar.adapt)
    return {
        "error": err,
        "restored": bool(np.array_equal(ar.levels, start)),
        "level_updates": ar.metrics()["level_updates"],
        "after": digest(ar(x)),
    }


def state(comm) -> dict:
    rank = comm.Get_rank()
    x = rank_data(rank, 700)
    ar = QuantizedAllreduce(comm, "amq", bits=3, bucket_size=100, seed=5)
    ar(x)
    ar.adapt()
    ar(x * 2)
    own = ar.state_dict()
    root = comm.bcast(own, root=0)
    mine = QuantizedAllreduce(comm, "amq", bits=3, bucket_size=100)
    mine.load_state_dict(own)
    from_root = QuantizedAllreduce(comm, "amq", bits=3, bucket_size=100)
    from_root.load_state_dict(root)
    loaded_equal = bool(np.array_equal(ar.levels, mine.levels) and np.array_equal(ar.levels, from_root.levels))
    a, b, c = ar(x), mine(x), from_root(x)
    ar.adapt()
    mine.adapt()
    return {
        "same_output_own_state": bool(np.array_equal(a, b)),
        "root_state_runs": bool(np.isfinite(c).all()),
        "loaded_levels_equal": loaded_equal,
        "adapted_levels_equal": bool(np.array_equal(ar.levels, mine.levels)),
        "step": from_root.metrics()["step"],
        "level_updates": mine.metrics()["level_updates"],
        "multiplier": ar.metrics()["multiplier"],
    }


def collect(comm) -> dict:
    """Which calls record statistics, and adapt() with nothing (or only zeros) recorded."""
    rank = comm.Get_rank()
    x = rank_data(rank, 400)
    res = {}
    ar = QuantizedAllreduce(comm, "alq", bits=3, bucket_size=50, collect_every=0)
    start = ar.levels
    ar(x)
    res["nothing_recorded"] = [ar.adapt(), bool(np.array_equal(ar.levels, start))]
    ar(x, collect=True)
    res["on_request"] = [ar.adapt(), bool(np.array_equal(ar.levels, start))]
    every2 = QuantizedAllreduce(comm, "alq-n", bits=3, bucket_size=50, collect_every=2)
    for i in range(4):
        every2(x * np.float32(i + 1))
    expected = every2.quantizer.statistics(x) + every2.quantizer.statistics(x * np.float32(3))
    res["every_2nd"] = bool(np.allclose(every2.state_dict()["pending"], expected, rtol=1e-12))
    zeros = QuantizedAllreduce(comm, "amq", bits=3, bucket_size=50)
    zeros(np.zeros(400, np.float32))
    res["all_zero"] = [zeros.adapt(), zeros.metrics()["level_updates"]]
    explicit = QuantizedAllreduce(comm, "amq", bits=3, bucket_size=50)
    res["explicit"] = [explicit.adapt(explicit.quantizer.statistics(x)), explicit.levels.tolist()]
    fixed = QuantizedAllreduce(comm, "qsgd", bits=3, bucket_size=50)
    fixed(x)
    res["fixed"] = [fixed.adapt(), fixed.state_dict()["pending"]]
    return res


def payload_dump(comm) -> dict:
    """Payloads made here, for the torch-side decode in the test process."""
    rank = comm.Get_rank()
    ar = QuantizedAllreduce(comm, "alq", bits=3, bucket_size=100, seed=9)
    x = rank_data(rank, 1003)
    ar(x)
    ar.adapt()
    parts = ar.allgather(x)
    mean = ar.reduce(parts)
    return {
        "method": ar.method,
        "bits": ar.bits,
        "bucket_size": ar.bucket_size,
        "levels": ar.levels.tolist(),
        "payloads": [p.tobytes().hex() for p in parts],
        "mean": mean.tolist(),
        "mean_digest": digest(mean),
    }


def split(comm, alpha: float) -> dict:
    """Two halves (even and odd world ranks) exchange independently on their own communicators;
    the odd half then has a mismatch, which must not disturb the even half."""
    rank = comm.Get_rank()
    sub = comm.Split(color=rank % 2, key=rank)
    res = unbiased(sub, "alq", n=800, bucket=64, reps=60, alpha=alpha)
    res["color"] = rank % 2
    res["sub_rank"] = sub.Get_rank()
    res["sub_size"] = sub.Get_size()
    bits = 4 if rank % 2 == 1 and sub.Get_rank() == 1 else 3
    ar = QuantizedAllreduce(sub, "alq", bits=bits, bucket_size=64)
    res["half_mismatch"] = _attempt(lambda: ar(rank_data(rank, 300)))
    sub.Free()
    return res


def _second_refit_at_other_bits(comm, method, bucket, x):
    """With bits_second=4 the second quantizer is refit by adapt() from the reduced shards: its
    levels leave their initial fit (and are 16, not the first quantizer's 8)."""
    ar = QuantizedAllreduce(comm, method, bits=3, bucket_size=bucket, seed=6, exchange="two-phase", bits_second=4)
    initial = ar.metrics()["second_levels"]
    ar(x)
    ar.adapt()
    second = ar.metrics()["second_levels"]
    return bool(second.size == 16 and np.any(second != initial))


def two_phase(comm, n: int, bucket: int, reps: int, method: str = "alq") -> dict:
    """The two-phase exchange: ``reps`` calls with fixed levels; unbiasedness from the sample (the
    exact law of a re-quantized sum is not tractable). The calls are independent, so per-call
    scalars are i.i.d.: the t-statistics of the deviation summed over all coordinates (plain, and
    signed by the truth: a scale error) and summed per bucket (the coordinates of a bucket share a
    random norm, so single coordinates are neither independent nor normal enough for a z-score).
    Also the traffic of one call per coordinate, for both exchanges."""
    rank = comm.Get_rank()
    xs = [rank_data(r, n) for r in range(comm.Get_size())]
    truth = np.mean([v.astype(np.float64) for v in xs], axis=0)
    ar = QuantizedAllreduce(comm, method, bits=3, bucket_size=bucket, seed=5, exchange="two-phase")
    ar(xs[rank])
    ar.adapt()
    outs = np.stack([ar(xs[rank], collect=False).astype(np.float64) for _ in range(reps)])
    before = ar.metrics()
    ar(xs[rank], collect=False)
    after = ar.metrics()
    gather = QuantizedAllreduce(comm, method, bits=3, bucket_size=bucket, seed=5, exchange="allgather")
    gather(xs[rank], collect=False)
    g = gather.metrics()
    dev = outs - truth
    nb = -(-n // bucket)
    per_bucket = np.add.reduceat(dev, np.arange(0, nb * bucket, bucket), axis=1)
    return {
        "t_plain": float(t_stat(dev.sum(1, keepdims=True))[0]),
        "t_signed": float(t_stat((dev @ np.sign(truth))[:, None])[0]),
        "t_buckets_max": float(np.abs(t_stat(per_bucket)).max()),
        "buckets": nb,
        "reps": reps,
        "digest": digest(outs),
        "exchange": after["exchange"],
        "second_updates": after["level_updates"],
        "second_follows_first": bool(np.array_equal(ar.metrics()["second_levels"], ar.levels)),
        "second_refit_at_other_bits": _second_refit_at_other_bits(comm, method, bucket, xs[rank]),
        "sent_per_call": after["bytes_sent"] - before["bytes_sent"],
        "received_per_call": after["bytes_received"] - before["bytes_received"],
        "allgather_sent": g["bytes_sent"],
        "allgather_received": g["bytes_received"],
    }


# ---------------------------------------------------------------------------------- lists, bits="auto"
AUTO_SCALES = (100.0, 1.0, 0.01)  # one array 100x the next (same size): it must get more bits
AUTO_SIZES = (512, 512, 256)
AUTO_BUCKET = 64


def auto_arrays(world_rank: int, step: int = 0) -> list:
    """Three arrays of very different scale (the same scales on every rank), float32/float64/float16."""
    rng = np.random.default_rng([31, world_rank, step])
    xs = [s * (rng.standard_normal(n) + 0.2 * world_rank) for s, n in zip(AUTO_SCALES, AUTO_SIZES)]
    return [xs[0].astype(np.float32), xs[1].reshape(16, 32), xs[2].astype(np.float16)]


def list_wire(sizes, widths, bucket: int) -> int:
    """Bytes of one rank's payloads for a list: one payload per run of one width, each array's run
    reaching the next array's start (arrays start on bucket boundaries)."""
    spans = [-(-n // bucket) * bucket for n in sizes[:-1]] + [sizes[-1]]
    runs = []
    for n, w in zip(spans, widths):
        if runs and runs[-1][1] == w:
            runs[-1][0] += n
        else:
            runs.append([n, w])
    return sum(payload_size(n, w, bucket) for n, w in runs)


def list_unbiased(comm, bits, exchange: str, reps: int, bits_per: str = "tensor") -> dict:
    """A list of three arrays, levels (and widths) fitted once, then ``reps`` calls with fixed levels.
    The calls are independent: per bucket of each array, the t-statistic of the mean deviation
    (normalized by the array's scale) of the output from the exact average; and of its sum over all
    coordinates, plain and signed by the truth."""
    world = MPI.COMM_WORLD.Get_rank()
    members = comm.allgather(world)
    truth = [np.mean([auto_arrays(r)[k].astype(np.float64) for r in members], axis=0) for k in range(3)]
    kw = dict(bits=bits, bit_budget=2.5, bits_per=bits_per) if bits == "auto" else dict(bits=bits)
    ar = QuantizedAllreduce(comm, "alq", bucket_size=AUTO_BUCKET, seed=21, exchange=exchange, **kw)
    for step in range(2):  # the rows (statistics) of both calls are added
        outs = ar(auto_arrays(world, step))
    updated = ar.adapt()
    xs = auto_arrays(world)
    before = ar.metrics()["payload_bytes"]
    devs, h = [], hashlib.sha1()
    for _ in range(reps):
        outs = ar(xs, collect=False)
        for o in outs:
            h.update(o.tobytes())
        devs.append(
            np.concatenate(
                [(o.astype(np.float64).ravel() - t.ravel()) / s for o, t, s in zip(outs, truth, AUTO_SCALES)]
            )
        )
    m = ar.metrics()
    dev = np.array(devs)
    edges = np.concatenate([[0], np.cumsum(AUTO_SIZES)])
    cuts = sorted({int(c) for a, b in zip(edges[:-1], edges[1:]) for c in range(a, b, AUTO_BUCKET)})
    per_bucket = np.add.reduceat(dev, cuts, axis=1)
    sign = np.sign(np.concatenate([t.ravel() for t in truth]))
    widths = m["allocation"] if bits == "auto" else [bits] * 3
    return {
        "reps": reps,
        "buckets": len(cuts),
        "updated": updated,
        "digest": h.hexdigest(),
        "t_buckets_max": float(np.abs(t_stat(per_bucket)).max()),
        "t_plain": float(t_stat(dev.sum(1, keepdims=True))[0]),
        "t_signed": float(t_stat((dev @ sign)[:, None])[0]),
        "dtypes": [str(o.dtype) for o in outs],
        "shapes": [list(o.shape) for o in outs],
        "rel_err": [
            float(np.linalg.norm(o.astype(np.float64).ravel() - t.ravel()) / np.linalg.norm(t))
            for o, t in zip(outs, truth)
        ],
        "exchange": m["exchange"],
        "level_updates": m["level_updates"],
        "levels": ar.levels.tolist(),
        "allocation": m.get("allocation"),
        "allocated_mean_bits": m.get("allocated_mean_bits"),
        "default_bits": m.get("default_bits"),
        "width_levels": {str(w): v.tolist() for w, v in m.get("width_levels", {}).items()},
        "bytes_per_call": (m["payload_bytes"] - before) / reps,
        "expected_bytes": (
            mixed_payload_size(sum(AUTO_SIZES), AUTO_BUCKET, 640)
            if bits_per == "bucket"
            else list_wire(AUTO_SIZES, widths, AUTO_BUCKET)
        ),
    }


def auto_collection(comm) -> dict:
    """What collecting calls record with bits="auto" (rows added for the same arrays, replaced by
    others), which calls use the allocation, and adapt() with nothing recorded."""
    from horovod_alq.core.auto_bits import AutoBits

    world = MPI.COMM_WORLD.Get_rank()
    fresh = AutoBits("alq", 2.5, AUTO_BUCKET)  # the initial levels of every width: the rows' reference

    def rows(xs):
        return np.stack([fresh.row(np.ravel(x).astype(np.float32)) for x in xs])

    ar = QuantizedAllreduce(
        comm, "alq", bits="auto", bit_budget=2.5, bucket_size=AUTO_BUCKET, seed=4, exchange="allgather"
    )  # its payload bytes are the widths' (checked)
    res = {"nothing": ar.adapt()}
    a, b = auto_arrays(world, 0), auto_arrays(world, 1)
    ar(a)
    ar(b)
    s = ar.state_dict()
    res["added"] = bool(np.allclose(s["pending"], rows(a) + rows(b), rtol=1e-12))
    res["keys_added"] = s["pending_keys"]
    ar(b[:2])  # other arrays: their rows replace the recorded ones
    s = ar.state_dict()
    res["replaced"] = bool(np.allclose(s["pending"], rows(b[:2]), rtol=1e-12))
    res["keys_replaced"] = s["pending_keys"]
    ar(a)
    ar(a, collect=False)  # not recorded
    s = ar.state_dict()
    res["not_collected"] = bool(np.allclose(s["pending"], rows(a), rtol=1e-12))
    res["adapted"] = ar.adapt()
    m = ar.metrics()
    res["allocation"], res["default_bits"] = m["allocation"], m["default_bits"]
    res["pending_after"] = ar.state_dict()["pending"]
    # the allocation's arrays take their widths; any other call (a prefix included) the default
    calls = {
        "same": a,
        "prefix": a[:2],
        "single": a[0],
        "other": [a[2], a[0], a[1]],
        "same_counts": [a[1], a[0], a[2]],
    }  # arrays are matched by their element counts
    res["bytes"] = {}
    for name, xs in calls.items():
        before = ar.metrics()["payload_bytes"]
        ar(xs, collect=False)
        res["bytes"][name] = ar.metrics()["payload_bytes"] - before
    res["expected"] = {
        "same": list_wire(AUTO_SIZES, m["allocation"], AUTO_BUCKET),
        "prefix": list_wire(AUTO_SIZES[:2], [2, 2], AUTO_BUCKET),
        "single": payload_size(AUTO_SIZES[0], 2, AUTO_BUCKET),
        "other": list_wire(AUTO_SIZES[::-1], [2, 2, 2], AUTO_BUCKET),
        "same_counts": list_wire(AUTO_SIZES, m["allocation"], AUTO_BUCKET),
    }
    res["reduce"] = _attempt(lambda: ar.reduce([np.zeros(40, np.uint8)]))
    return res


def auto_errors(comm) -> dict:
    """Rank 1 differs in one thing per case: every rank raises, and afterwards the communicator and
    the allreduce still work (the same digest on every rank)."""
    world, rank = MPI.COMM_WORLD.Get_rank(), comm.Get_rank()
    odd = rank == 1
    xs = auto_arrays(world)
    good = QuantizedAllreduce(comm, "alq", bits="auto", bit_budget=2.5, bucket_size=AUTO_BUCKET, seed=0)

    def budget(call):
        ar = QuantizedAllreduce(comm, "alq", bits="auto", bit_budget=3.0 if odd else 2.5, bucket_size=AUTO_BUCKET)
        return call(ar)

    def recorded_other_arrays():  # rank 1 records the 2-array call, the others the 3-array call
        good(xs, collect=not odd)
        good(xs[:2], collect=odd)
        good.adapt()

    cases = {
        "budget": lambda: budget(lambda ar: ar(xs)),
        "adapt_budget": lambda: budget(lambda ar: ar.adapt()),
        "list_int": lambda: good([xs[0], xs[1].astype(np.int32) if odd else xs[1], xs[2]]),
        "list_split": lambda: good([xs[0], xs[2], xs[1]] if odd else xs),  # the same elements, other arrays
        "list_length": lambda: good(xs[:2] if odd else xs),
        "recorded": recorded_other_arrays,
        "stats": lambda: good.adapt(np.ones(3) if odd else None),
        "allgather": lambda: good.allgather(xs[0]),
    }
    res, after = {}, {}
    for name, fn in cases.items():
        res[name] = _attempt(fn)
        after[name] = digest(np.concatenate([o.ravel().astype(np.float64) for o in good(xs, collect=False)]))
    # the recorded mismatch kept every rank's rows: the same collecting call on every rank
    # replaces rank 1's and adds to the others', then adapt() agrees
    good(xs)
    res["recovered"] = good.adapt()
    res["allocation"] = good.metrics()["allocation"]
    return {"errors": res, "after": after}


def auto_state(comm) -> dict:
    """state_dict / load_state_dict with bits="auto": levels of every width, the allocation and the
    recorded rows travel; another rank's state loads too; fixed bits or another budget are refused."""
    world = MPI.COMM_WORLD.Get_rank()
    xs = auto_arrays(world)
    kw = dict(bits="auto", bit_budget=2.5, bucket_size=AUTO_BUCKET)
    ar = QuantizedAllreduce(comm, "amq", seed=8, **kw)
    ar(xs)
    ar.adapt()
    ar(auto_arrays(world, 1))  # recorded, pending in the state
    own = ar.state_dict()
    root = comm.bcast(own, root=0)
    mine = QuantizedAllreduce(comm, "amq", **kw)
    mine.load_state_dict(own)
    from_root = QuantizedAllreduce(comm, "amq", **kw)
    from_root.load_state_dict(root)
    same = [np.array_equal(p, q) for p, q in zip(ar(xs, collect=False), mine(xs, collect=False))]
    runs = all(np.isfinite(o).all() for o in from_root(xs, collect=False))
    ar.adapt()
    mine.adapt()
    m, n = ar.metrics(), mine.metrics()
    return {
        "same_output_own_state": bool(all(same)),
        "root_state_runs": bool(runs),
        "allocation_loaded": from_root.metrics()["allocation"] == own["auto"]["bits"],
        "adapted_alike": m["allocation"] == n["allocation"]
        and all(np.array_equal(m["width_levels"][w], n["width_levels"][w]) for w in m["width_levels"]),
        "level_updates": n["level_updates"],
        "allocation": m["allocation"],
        "fixed_refused": _attempt(lambda: QuantizedAllreduce(comm, "amq", bits=3).load_state_dict(own)),
        "budget_refused": _attempt(
            lambda: QuantizedAllreduce(comm, "amq", bits="auto", bit_budget=3.0).load_state_dict(own)
        ),
    }


def fixed_list(comm) -> dict:
    """A list with fixed bits: each array quantized as if alone (its statistics, its buckets)."""
    world = MPI.COMM_WORLD.Get_rank()
    xs = auto_arrays(world)
    ar = QuantizedAllreduce(comm, "alq", bits=3, bucket_size=AUTO_BUCKET, seed=2, exchange="allgather")
    before = ar.metrics()["payload_bytes"]
    outs = ar(tuple(xs))
    q = ar.quantizer
    expected = sum(q.statistics(np.ravel(x).astype(np.float32)) for x in xs)
    return {
        "statistics_as_alone": bool(np.allclose(ar.state_dict()["pending"], expected, rtol=1e-12)),
        "bytes": ar.metrics()["payload_bytes"] - before,
        "expected_bytes": list_wire(AUTO_SIZES, [3] * 3, 64),
        "type": type(outs).__name__,
        "shapes": [list(o.shape) for o in outs],
        "dtypes": [str(o.dtype) for o in outs],
        "empty": [list(o.shape) for o in ar([np.zeros(0), xs[0][:5]])],
        "nothing": ar([]),
        "digest": digest(np.concatenate([o.ravel().astype(np.float64) for o in outs])),
    }


def auto_bits(comm, reps: int) -> dict:
    out = {f"unbiased.{ex}": list_unbiased(comm, "auto", ex, reps) for ex in ("allgather", "two-phase")}
    out["unbiased.fixed"] = list_unbiased(comm, 3, "auto", reps)
    out["unbiased.bucket"] = list_unbiased(comm, "auto", "auto", reps, bits_per="bucket")
    out["collection"] = auto_collection(comm)
    out["errors"] = auto_errors(comm)
    out["state"] = auto_state(comm)
    out["fixed_list"] = fixed_list(comm)
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--methods", default=",".join(ALL))
    p.add_argument("--n", type=int, default=1000)
    p.add_argument("--bucket", type=int, default=128)
    p.add_argument("--reps", type=int, default=120)
    p.add_argument("--alpha", type=float, default=1e-6)
    p.add_argument("--split", action="store_true")
    p.add_argument("--two-phase-only", action="store_true")
    p.add_argument("--auto-only", action="store_true")
    p.add_argument("--auto-reps", type=int, default=150)
    args = p.parse_args()
    comm = MPI.COMM_WORLD
    if args.two_phase_only:
        report({"rank": comm.Get_rank(), "two_phase": two_phase(comm, args.n, args.bucket, args.reps)})
        return
    if args.auto_only:
        report({"rank": comm.Get_rank(), "size": comm.Get_size(), "auto": auto_bits(comm, args.auto_reps)})
        return
    out = {"rank": comm.Get_rank(), "size": comm.Get_size()}
    out["unbiased"] = {
        m: unbiased(comm, m, args.n, args.bucket, args.reps, args.alpha) for m in args.methods.split(",")
    }
    out["dtypes"] = dtypes(comm)
    out["errors"] = errors(comm)
    if comm.Get_size() == 2:
        out["bounded_wait"] = bounded_wait(comm)
    out["collectives"] = collectives(comm)
    out["refit_failure"] = refit_failure(comm)
    out["state"] = state(comm)
    out["collect"] = collect(comm)
    out["payload"] = payload_dump(comm)
    if args.split:
        out["split"] = split(comm, args.alpha)
    out["two_phase"] = two_phase(comm, args.n, args.bucket, args.reps)
    out["auto"] = auto_bits(comm, args.auto_reps)
    report(out)


if __name__ == "__main__":
    main()
