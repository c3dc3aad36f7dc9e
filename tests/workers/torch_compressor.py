"""Worker for tests/torch/test_compressor_ranks.py: the scenario chosen by argv[1] ("a+b": several in
turn). Groups of scenarios with options of their own, each named by ``--label``, separated by "::"
("exchange --label x --rounds 100 :: train --label t"), run in turn in one launch, reported as
{label: what the group alone would report}."""

import argparse
import hashlib
import json
import sys
import time

import horovod.torch as hvd
import numpy as np
import torch
from common import argv_groups, cell_moments, report
from helpers import digest, rank_data, t_stat

from horovod_alq.core import Quantizer
from horovod_alq.torch import ALQCompressor, AMQCompressor, compressor_for


def rank_tensor(rank: int, n: int) -> torch.Tensor:
    """:func:`helpers.rank_data` as a torch tensor."""
    return torch.from_numpy(rank_data(rank, n))


def exchange(args) -> dict:
    """M rounds of hvd.allreduce with the compressor; a Bernstein bound per coordinate with the
    exact variance of each round (its levels are known) says whether the mean is unbiased."""
    size, rank = hvd.size(), hvd.rank()
    method, norm = args.method, None
    for suffix in ("l2", "linf"):  # "alq-l2": that method with that bucket norm
        if method.endswith(f"-{suffix}"):
            method, norm = method[: -len(suffix) - 1], suffix
    if args.exchange != "allgather":
        return exchange_two_phase(args, method, norm)
    comp = compressor_for(
        method,
        bits=args.bits,
        bucket_size=args.bucket,
        update_steps=(0, 5),
        update_every=0,
        min_size=16,
        seed=args.seed,
        norm=norm,
    )
    norm = comp.norm
    op = hvd.Sum if args.op == "sum" else hvd.Average
    xs = [rank_tensor(r, args.numel).double().numpy() for r in range(size)]
    x = torch.from_numpy(xs[rank]).float()
    xs = [x_.astype(np.float32).astype(np.float64) for x_ in xs]
    scale = 1.0 if op == hvd.Sum else 1.0 / size
    truth = scale * sum(xs)
    dev_sum, var_sum, width = np.zeros(args.numel), np.zeros(args.numel), np.zeros(args.numel)
    digests = []
    for i in range(args.rounds):
        levels = comp.levels
        for x_r in xs:  # round i uses the levels it starts with
            var, w = cell_moments(x_r, levels, args.bucket, norm)
            var_sum += scale**2 * var
            width = np.maximum(width, w)
        out = hvd.allreduce(x, compression=comp, op=op, name=f"x{i}")
        dev_sum += out.double().numpy() - truth
        digests.append(digest(out))
    # Bernstein: P(|sum| >= s) <= 2 exp(-s^2 / (2 (V + c s / 3))), c = largest single deviation
    c = scale * size * width
    log_term = np.log(2 / 1e-10)  # 1e-10 per coordinate: ~3e-7 for 3000 coordinates
    bound = c * log_term / 3 + np.sqrt((c * log_term / 3) ** 2 + 2 * var_sum * log_term)
    bound += args.rounds * 1e-6 * np.abs(truth) + 1e-9  # float32 rounding of the outputs
    m = comp.metrics()
    return {
        "worst_ratio": float(np.max(np.abs(dev_sum) / bound)),
        "aggregate_z": float(dev_sum.sum() / np.sqrt(var_sum.sum())),
        "digests": digests,
        "levels": m["levels"].tolist(),
        "level_updates": m["level_updates"],
        "bits_per_coordinate": m["bits_per_coordinate"],
        "payload_bytes": m["payload_bytes"],
        "coordinates": m["coordinates"],
    }


def exchange_two_phase(args, method, norm) -> dict:
    """M rounds of hvd.allreduce with the two-phase exchange. The second quantization makes the
    exact variance intractable, so unbiasedness comes from the sample: after the refit round the
    rounds are i.i.d., and the t statistics of the per-round deviation summed over all coordinates
    (plain, and signed by the truth: a scale error) and summed per bucket must be small."""
    size, rank = hvd.size(), hvd.rank()
    comp = compressor_for(
        method,
        bits=args.bits,
        bucket_size=args.bucket,
        update_steps=(0,),
        update_every=0,
        min_size=16,
        seed=args.seed,
        norm=norm,
        exchange="two-phase",
    )
    op = hvd.Sum if args.op == "sum" else hvd.Average
    xs = [rank_tensor(r, args.numel).float().double().numpy() for r in range(size)]
    truth = (1.0 if op == hvd.Sum else 1.0 / size) * sum(xs)
    x = torch.from_numpy(xs[rank]).float()
    hvd.allreduce(x, compression=comp, op=op, name="refit")
    devs, digests = [], []
    for i in range(args.rounds):
        out = hvd.allreduce(x, compression=comp, op=op, name=f"x{i}")
        devs.append(out.double().numpy() - truth)
        digests.append(digest(out))
    dev = np.stack(devs)
    nb = -(-args.numel // args.bucket)
    per_bucket = np.add.reduceat(dev, np.arange(0, nb * args.bucket, args.bucket), axis=1)
    m = comp.metrics()
    return {
        "t_plain": float(t_stat(dev.sum(1, keepdims=True))[0]),
        "t_signed": float(t_stat((dev @ np.sign(truth))[:, None])[0]),
        "t_buckets_max": float(np.abs(t_stat(per_bucket)).max()),
        "buckets": nb,
        "reps": args.rounds,
        "rel_err": float(np.sqrt((dev**2).sum(1).mean() / (truth**2).sum())),
        "digests": digests,
        "exchange": m["exchange"],
        "levels": m["levels"].tolist(),
        "second_levels": m["second_levels"].tolist(),
        "level_updates": m["level_updates"],
    }


def digits_data(rank: int, size: int):
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0
    y = torch.tensor(data.target)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    x, y = x[perm], y[perm]
    train_x, train_y, test_x, test_y = x[:1500], y[:1500], x[1500:], y[1500:]
    return train_x[rank::size], train_y[rank::size], test_x, test_y


def fit_digits(model, opt, rank: int, size: int, steps: int, bpps: int = 1) -> dict:
    """``steps`` optimizer steps on this rank's digits (``bpps`` backward passes of 32 each), then
    the loss at the start and the end, the held-out accuracy and the parameters' digests."""
    tx, ty, vx, vy = digits_data(rank, size)
    g = torch.Generator().manual_seed(rank)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        for _ in range(bpps):
            idx = torch.randint(0, len(tx), (32,), generator=g)
            loss = torch.nn.functional.cross_entropy(model(tx[idx]), ty[idx])
            loss.backward()
        opt.step()
        losses.append(loss.item())
    with torch.no_grad():
        acc = (model(vx).argmax(1) == vy).float().mean().item()
    return {
        "first_loss": float(np.mean(losses[:10])),
        "last_loss": float(np.mean(losses[-10:])),
        "accuracy": acc,
        "params": [digest(p) for p in model.parameters()],
    }


def train(args) -> dict:
    size, rank = hvd.size(), hvd.rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    if args.method == "none":
        comp = hvd.Compression.none
    else:
        comp = compressor_for(
            args.method,
            bits=args.bits,
            bucket_size=args.bucket,
            update_steps=(0, 20, 60),
            update_every=0,
            min_size=100,
            seed=args.seed,
        )
    start_levels = None if args.method == "none" else comp.levels.tolist()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    kwargs = {}
    if args.groups:
        kwargs["num_groups"] = args.groups
    opt = hvd.DistributedOptimizer(
        opt, named_parameters=model.named_parameters(), compression=comp, backward_passes_per_step=args.bpps, **kwargs
    )
    result = fit_digits(model, opt, rank, size, args.steps, args.bpps)
    if args.method != "none":
        m = comp.metrics()
        # the live levels and fingerprint agree with the NumPy core: its decoder reads our payload
        q = Quantizer(comp._method.name, bits=comp.bits, bucket_size=comp.bucket_size)
        q.set_levels(m["levels"])
        w = model[0].weight.grad if model[0].weight.grad is not None else model[0].weight
        flat = w.detach().reshape(-1).float()
        payload = comp._ops_for(flat.device).encode(flat, comp._quantizer, 0).numpy()
        decoded = q.decode(payload)
        result.update(
            start_levels=start_levels,
            levels=m["levels"].tolist(),
            level_updates=m["level_updates"],
            step=m["step"],
            bits_per_coordinate=m["bits_per_coordinate"],
            uncompressed=m["uncompressed_coordinates"],
            coordinates=m["coordinates"],
            core_decoded_shape=list(decoded.shape),
            state=json.loads(
                json.dumps({k: v for k, v in comp.state_dict().items() if k in ("step", "level_updates")})
            ),
        )
    return result


def auto(args) -> dict:
    """bits="auto" through the stock optimizer: a model whose layers' gradients differ in scale (one
    fusion buffer holds tensors of several widths), trained with each exchange; then the exchange of
    one fixed tensor set repeated (the per-rank deviations from the true sum, for the unbiasedness
    test), and a state_dict round trip."""
    size, rank = hvd.size(), hvd.rank()
    out = {}
    for exchange in ("allgather", "two-phase"):
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(64, 128),
            torch.nn.ReLU(),
            torch.nn.Linear(128, 64),
            torch.nn.ReLU(),
            torch.nn.Linear(64, 10),
        )
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        comp = ALQCompressor(
            bits="auto",
            bit_budget=2.5,
            bits_per=args.bits_per,
            bucket_size=args.bucket,
            update_steps=(0, 20, 60),
            update_every=0,
            min_size=100,
            seed=args.seed,
            exchange=exchange,
        )
        opt = hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
            named_parameters=model.named_parameters(),
            compression=comp,
        )
        fitted = fit_digits(model, opt, rank, size, args.steps)
        m = comp.metrics()
        saved = comp.state_dict()
        again = ALQCompressor(
            bits="auto", bit_budget=2.5, bits_per=args.bits_per, bucket_size=args.bucket, min_size=100
        )
        again.load_state_dict(saved)
        out[exchange] = {
            **fitted,
            "allocation": m["allocation"],
            "allocated_mean_bits": m["allocated_mean_bits"],
            "bits_per_coordinate": m["bits_per_coordinate"],
            "level_updates": m["level_updates"],
            "exchange": m["exchange"],
            "bits": comp.bits,
            "width_levels": {str(w): v.tolist() for w, v in m["width_levels"].items()},
            "reloaded": again._state.auto.fingerprint() == comp._state.auto.fingerprint()
            and all(np.array_equal(again.metrics()["width_levels"][w], v) for w, v in m["width_levels"].items()),
        }
    # unbiasedness with mixed widths: tensors of scales 1000, 1, 0.001 in one buffer, summed over ranks
    comp = ALQCompressor(
        bits="auto",
        bit_budget=3.0,
        bits_per=args.bits_per,
        bucket_size=args.bucket,
        update_steps=(0,),
        update_every=0,
        min_size=100,
        seed=args.seed,
        exchange=args.exchange,
    )
    scales, numel = (1000.0, 1.0, 0.001), 1500
    xs = [rank_tensor(rank, numel) * s for s in scales]
    truth = [hvd.allreduce(x, op=hvd.Sum, name=f"truth{k}") for k, x in enumerate(xs)]
    devs = []
    for r in range(args.rounds):
        got = hvd.grouped_allreduce(xs, op=hvd.Sum, name="auto", compression=comp)
        if r > 0:  # round 0 refits (default widths); the allocation applies from round 1
            devs.append(torch.cat([(y.double() - t.double()) / s for y, t, s in zip(got, truth, scales)]).numpy())
    dev = np.stack(devs)
    per_bucket = np.add.reduceat(dev, np.arange(0, dev.shape[1], args.bucket), axis=1)
    m = comp.metrics()
    out["unbiased"] = {
        "t_max": float(np.abs(t_stat(per_bucket)).max()),
        "buckets": per_bucket.shape[1],
        "reps": dev.shape[0],
        "allocation": m["allocation"],
        "exchange": m["exchange"],
        "digest": digest(dev),
    }
    if args.bits_per == "bucket":  # the widths of this rank's buckets in a payload of its tensors
        from horovod_alq.exchange.mixed import MixedOps

        mixed, flat = comp._state.auto.mixed, torch.cat([x.reshape(-1) for x in xs])
        payload = MixedOps(comp._ops_for(flat.device)).encode(flat, mixed, 0).numpy()
        out["unbiased"]["widths"] = sorted(set(mixed.layout(payload, 0, flat.numel())[0].tolist()))
    return out


def mismatch(args) -> dict:
    """Rank 1 differs from rank 0 in each of ``--what`` (comma-separated: bits, bucket size, levels,
    method, norm, or bits="auto"'s budget, allocation or cap), one case after another in this launch:
    every rank must refuse each. After them all a matching exchange still works."""
    out = {what: _mismatch(what) for what in args.what.split(",")}
    comp = ALQCompressor(bits=3, bucket_size=256, min_size=16, seed=0)
    out["after"] = _attempt(lambda: digest(hvd.allreduce(rank_tensor(0, 4096), compression=comp, name="mm.after")))
    return out


def _attempt(fn) -> dict:
    """``fn()`` as ``{"error": None, "out": ...}`` or ``{"error": "Type: message"}``."""
    try:
        return {"error": None, "out": fn()}
    except Exception as err:  # noqa: BLE001 - reported to the test
        return {"error": f"{type(err).__name__}: {err}"}


def _mismatch(what: str) -> dict:
    rank = hvd.rank()
    kw = dict(bits=3, bucket_size=256, min_size=16, seed=0)
    if what == "norm":
        kw["norm"] = "linf" if rank == 1 else "l2"
    if rank == 1 and what == "bits":
        kw["bits"] = 4
    if rank == 1 and what == "bucket":
        kw["bucket_size"] = 512
    comp = AMQCompressor(**kw) if rank == 1 and what == "method" else ALQCompressor(**kw)
    if rank == 1 and what == "levels":
        comp._quantizer.set_levels(np.array([-1, -0.3, -0.1, -0.01, 0.01, 0.1, 0.3, 1.0]))
    if what in ("budget", "allocation", "bits_max"):  # bits="auto": another budget, allocation or cap
        kw.update(bits="auto", bit_budget=2.5 if rank == 1 and what == "budget" else 3.0)
        if rank == 1 and what == "bits_max":
            kw["bits_max"] = 4
        comp = ALQCompressor(**kw)
        if rank == 1 and what == "allocation":
            auto = comp._state.auto
            auto.keys, auto.bits = ((4096, 1),), (5,)
    return _attempt(lambda: digest(hvd.allreduce(torch.randn(4096), compression=comp, name=f"mismatch.{what}")))


def dtypes(args) -> dict:
    rank = hvd.rank()
    comp = ALQCompressor(bits=4, bucket_size=128, min_size=64, seed=1)
    res = {}
    for name in ("float16", "bfloat16", "float32", "float64", "int32", "int64"):
        dt = getattr(torch, name)
        for n in (1000, 10):  # compressed, and passed through
            base = rank_tensor(rank, n)
            x = (base * 10).to(dt) if not dt.is_floating_point else base.to(dt).view(10, n // 10)
            out = hvd.allreduce(x, compression=comp, name=f"{name}.{n}")
            ref = hvd.allreduce(x if dt != torch.bfloat16 else x.float(), name=f"ref.{name}.{n}").to(dt)
            err = ((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-12)).item()
            res[f"{name}.{n}"] = {
                "dtype": str(out.dtype),
                "shape": list(out.shape),
                "same_shape": out.shape == x.shape,
                "rel_err": err,
                "exact": bool(torch.equal(out, ref)),
                "digest": digest(out.float()),
            }
    # the class itself as compression= (one default instance per class), also its metrics()
    plain = rank_tensor(rank, 4096)
    via_class = hvd.allreduce(plain, compression=ALQCompressor, name="class")
    exact = hvd.allreduce(plain, name="class.ref")
    res["class_rel_err"] = ((via_class - exact).norm() / exact.norm()).item()
    res["class_metrics_coordinates"] = ALQCompressor.metrics()["coordinates"]
    nan = rank_tensor(rank, 512)
    nan[300] = float("nan") if rank == 1 else nan[300]
    out = hvd.allreduce(nan, compression=comp, name="nan")
    res["nan_buckets"] = [bool(torch.isnan(out[i * 128 : (i + 1) * 128]).all()) for i in range(4)]
    return res


def amp(args) -> dict:
    """torch.amp's GradScaler must still see an overflow on one rank: the step is skipped everywhere."""
    rank = hvd.rank()
    torch.manual_seed(0)
    model = torch.nn.Linear(256, 64)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        named_parameters=model.named_parameters(),
        compression=ALQCompressor(bits=3, bucket_size=1024, min_size=100),
    )
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    before = digest(model.weight)
    x = torch.randn(8, 256)
    if rank == 1:
        x[0, 5] = float("inf")  # overflow on rank 1 only
    opt.zero_grad()
    scaler.scale(model(x).pow(2).mean()).backward()
    opt.synchronize()
    with opt.skip_synchronize():
        scaler.step(opt)
    scaler.update()
    skipped = digest(model.weight) == before
    opt.zero_grad()
    scaler.scale(model(torch.randn(8, 256)).pow(2).mean()).backward()
    opt.synchronize()
    with opt.skip_synchronize():
        scaler.step(opt)
    scaler.update()
    return {
        "skipped": skipped,
        "scale": scaler.get_scale(),
        "moved_after": digest(model.weight) != before,
        "params": digest(model.weight),
    }


def state(args) -> dict:
    rank = hvd.rank()
    comp = ALQCompressor(bits=3, bucket_size=256, min_size=16, update_steps=(0, 3), update_every=0, seed=7)
    x = rank_tensor(rank, 5000)
    for i in range(5):
        hvd.allreduce(x * (i + 1), compression=comp, name=f"s{i}")
    saved = comp.state_dict()
    restored = ALQCompressor(bits=3, bucket_size=256, min_size=16, update_steps=(0, 3), update_every=0)
    restored.load_state_dict(saved)
    a = hvd.allreduce(x, compression=comp, name="after.a")
    b = hvd.allreduce(x, compression=restored, name="after.b")
    return {
        "levels_equal": bool(np.array_equal(comp.levels, restored.levels)),
        "step": restored.metrics()["step"],
        "updates": restored.metrics()["level_updates"],
        "same_output": bool(torch.equal(a, b)),
        "levels": comp.levels.tolist(),
        "start_levels": ALQCompressor(bits=3).levels.tolist(),
    }


def overlap(args) -> dict:
    """Four 256x256 weights (biases below min_size travel plain), one fusion buffer each: per step,
    when the compressor starts its payload collectives (inside loss.backward() or after), and the
    averaged gradients with overlap on and off (the same seeds: the same codes and sums). Then
    unbiasedness of the overlapped path: ``loss = sum_k <w_k, c_{rank,k}>`` hands every rank fixed
    gradients; t-statistics of the deviations of the averaged gradients over ``args.rounds`` steps."""
    from horovod_alq.torch import horovod_transport as tr

    rank, size = hvd.rank(), hvd.size()
    events, phase = [], ["before"]
    originals = {name: getattr(tr.HorovodTransport, name) for name in ("allgather", "alltoall")}

    def recording(name):
        def call(self, payload, *rest):
            events.append([name, phase[0], rest[-1]])
            return originals[name](self, payload, *rest)

        return call

    def model_and_opt(overlap_on):
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[m for _ in range(4) for m in (torch.nn.Linear(256, 256), torch.nn.Tanh())])
        comp = ALQCompressor(
            bits=3,
            bucket_size=512,
            min_size=1024,
            seed=4,
            exchange=args.exchange,
            fusion_bytes=256 * 256 * 4,
            update_steps=(0, 3),
            update_every=0,
            overlap=overlap_on,
        )
        opt = hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.05), compression=comp, named_parameters=model.named_parameters()
        )
        return model, opt, comp

    out = {}
    for name in originals:
        setattr(tr.HorovodTransport, name, recording(name))
    try:
        for overlap_on in (True, False):
            model, opt, comp = model_and_opt(overlap_on)
            g = torch.Generator().manual_seed(70 + rank)
            steps, grads = [], []
            for _ in range(5):
                events.clear()
                opt.zero_grad()
                loss = model(torch.randn(8, 256, generator=g)).pow(2).mean()
                phase[0] = "backward"
                loss.backward()
                phase[0] = "after"
                opt.step()
                steps.append([e for e in events if e[1] == "backward"])
                grads.append(hashlib.sha1(b"".join(digest(p.grad).encode() for p in model.parameters())).hexdigest())
            m = comp.metrics()
            out[str(overlap_on)] = {
                "early": steps,
                "grads": grads,
                "exchange": m["exchange"],
                "level_updates": m["level_updates"],
                "params": [digest(p) for p in model.parameters()],
            }
    finally:
        for name, f in originals.items():
            setattr(tr.HorovodTransport, name, f)

    n, k = 4096, 4
    cs = [
        [(torch.randn(n, generator=torch.Generator().manual_seed(100 * r + j)) * (1 + j) + 0.2 * r) for j in range(k)]
        for r in range(size)
    ]
    truth = [sum(c[j].double() for c in cs) / size for j in range(k)]
    ws = [torch.nn.Parameter(torch.zeros(n)) for _ in range(k)]
    comp = ALQCompressor(
        bits=3,
        bucket_size=512,
        min_size=16,
        seed=5,
        exchange=args.exchange,
        fusion_bytes=n * 4,
        update_steps=(0,),
        update_every=0,
    )
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(ws, lr=0.0), compression=comp, named_parameters=[(f"w{j}", w) for j, w in enumerate(ws)]
    )
    devs = []
    for i in range(args.rounds + 1):
        opt.zero_grad()
        sum((w * c).sum() for w, c in zip(ws, cs[rank])).backward()
        opt.synchronize()
        with opt.skip_synchronize():
            opt.step()
        if i:
            devs.append(torch.cat([w.grad.double() - t for w, t in zip(ws, truth)]).numpy())
    dev = np.stack(devs)
    # per coordinate, a rounding probability near 0 or 1 gives the same code in every round (a zero
    # sample variance): test sums over buckets instead, as the DDP worker does
    per_bucket = np.add.reduceat(dev, np.arange(0, n * k, 512), axis=1)
    out["unbiased"] = {
        "t_max": float(np.abs(t_stat(per_bucket)).max()),
        "buckets": per_bucket.shape[1],
        "reps": args.rounds,
        "t_sum": float(t_stat(dev.sum(1, keepdims=True))[0]),
        "digest": digest(dev),
    }
    return out


SCENARIOS = ("exchange", "train", "mismatch", "dtypes", "state", "amp", "overlap", "auto")


def parse(argv: list) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("scenario", help=f"one of {', '.join(SCENARIOS)}, or several joined by '+' (run in turn)")
    p.add_argument("--label", default=None, help="the group's key in the report (required with several)")
    p.add_argument("--method", default="alq")
    p.add_argument("--bits", type=int, default=3)
    p.add_argument("--bucket", type=int, default=512)
    p.add_argument("--numel", type=int, default=3000)
    p.add_argument("--rounds", type=int, default=200)
    p.add_argument("--op", default="average")
    p.add_argument("--exchange", default="allgather")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--groups", type=int, default=0)
    p.add_argument("--bpps", type=int, default=1)
    p.add_argument("--what", default="bits")
    p.add_argument("--bits-per", default="tensor")
    args = p.parse_args(argv)
    if set(args.scenario.split("+")) - set(SCENARIOS):
        p.error(f"unknown scenario in {args.scenario!r}")
    return args


def run_group(args) -> object:
    """What one group reports: {name: result} for several scenarios, {method: result} for
    several methods of exchange or train, else the scenario's result."""
    names = args.scenario.split("+")
    if len(names) > 1:  # one launch, several scenarios: {name: what the scenario reports}
        return {name: globals()[name](args) for name in names}
    if args.scenario in ("exchange", "train") and "," in args.method:  # several methods, one launch
        results = {}
        for method in args.method.split(","):
            args.method = method
            results[method] = globals()[args.scenario](args)
        return results
    return globals()[args.scenario](args)


def main() -> None:
    groups = argv_groups(parse)
    labels = [g.label for g in groups]
    if len(groups) > 1 and (None in labels or len(set(labels)) < len(labels)):
        sys.exit(f"several groups need a --label each, all different: {labels}")
    start = time.monotonic()
    hvd.init()
    torch.set_num_threads(1)
    results = {}
    for args in groups:
        # (the rank's log: where a failed launch stopped, and each group's start)
        print(f"== group {args.label}: {args.scenario} at {time.monotonic() - start:.1f} s", flush=True)
        results[args.label] = run_group(args)
    report(results if labels[0] is not None else results[None])  # labelled: {label: result}
    hvd.shutdown()


if __name__ == "__main__":
    main()
