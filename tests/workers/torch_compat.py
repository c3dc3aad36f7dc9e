"""Worker for tests/torch/test_compat_ranks.py: Horovod compatibility (issue 14), one scenario per run.

Usage (through ``multiproc.run_ranks``): torch_compat.py SCENARIO

Every scenario catches the errors it expects and reports them as ``"Type: message"`` strings, so
that the test can check that *every* rank raised (and what), and that the ranks still work after.
"""

import argparse
import traceback

import horovod.torch as hvd
import numpy as np
import torch
from common import cell_moments, report
from helpers import digest

from horovod_alq.torch import ALQCompressor

EXCHANGES = ("allgather", "two-phase")


def comp_for(exchange="allgather", **kw):
    args = dict(bits=3, bucket_size=512, min_size=16, seed=11, exchange=exchange)
    args.update(kw)
    return ALQCompressor(**args)


def error_of(fn):
    """``None`` and the result if ``fn()`` returns, else ``"Kind/Type: message"`` and None, where
    Kind is ``RuntimeError`` for Horovod's error type and its subclasses, else ``Other``."""
    try:
        return None, fn()
    except Exception as err:  # noqa: BLE001 - reported to the test
        traceback.print_exc()  # into this rank's log
        kind = "RuntimeError" if isinstance(err, RuntimeError) else "Other"
        return f"{kind}/{type(err).__name__}: {err}", None


def after_data(rank: int, n: int = 700) -> torch.Tensor:
    """A signal shared by the ranks plus a little noise of each rank's own (so that the exact mean
    does not cancel out, and relative errors stay meaningful)."""
    shared = torch.randn(n, generator=torch.Generator().manual_seed(12345))
    return shared + 0.3 * torch.randn(n, generator=torch.Generator().manual_seed(rank))


def check_mean(comp, x: torch.Tensor, name: str, process_set=None) -> dict:
    """An averaged allreduce with ``comp``: the output, and whether it lies within the deterministic
    bound of stochastic rounding (each rank's error per coordinate is below its cell's width)."""
    ps = hvd.global_process_set if process_set is None else process_set
    levels = comp.levels.copy()
    out = hvd.allreduce(x, compression=comp, op=hvd.Average, name=name, process_set=ps)
    xs = hvd.allgather(x.double().reshape(1, -1), name=name + ".truth", process_set=ps).numpy()
    truth = xs.mean(0)
    width = sum(cell_moments(row, levels, comp.bucket_size, "l2")[1] for row in xs) / xs.shape[0]
    dev = np.abs(out.double().numpy().ravel() - truth)
    bound = width + 1e-5 * np.abs(truth) + 1e-9
    rel = float(np.linalg.norm(out.double().numpy().ravel() - truth) / max(np.linalg.norm(truth), 1e-12))
    return {
        "ok": bool((dev <= bound).all()),
        "worst": float((dev / bound).max()),
        "rel_err": rel,
        "mean": float(out.double().mean()),
        "truth_mean": float(truth.mean()),
        "digest": digest(out),
    }


# ---------------------------------------------------------------------------------------------
# 1. ranks compute gradients for different parameters (upstream test_force_allreduce)


class TwoHeads(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.trunk = torch.nn.Linear(16, 64)
        self.head_a = torch.nn.Linear(64, 24)
        self.head_b = torch.nn.Linear(64, 24)

    def forward(self, x, head):
        h = torch.relu(self.trunk(x))
        return self.head_a(h) if head == "a" else self.head_b(h)


def _two_heads_train(compression, steps, seed=0):
    rank = hvd.rank()
    torch.manual_seed(seed)
    model = TwoHeads()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    start = [p.detach().clone() for p in model.parameters()]
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters(), compression=compression
    )
    g = torch.Generator().manual_seed(100 + rank)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        x = torch.randn(32, 16, generator=g)
        target = torch.randn(32, 24, generator=g)
        loss = torch.nn.functional.mse_loss(model(x, "a" if rank == 0 else "b"), target)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    moved = [(p.detach() - s) for p, s in zip(model.parameters(), start)]
    return model, moved, losses


def force_allreduce(args) -> dict:
    res = {}
    steps = 4
    _, exact_moved, _ = _two_heads_train(hvd.Compression.none, steps)
    for exchange in EXCHANGES:
        comp = comp_for(exchange)
        err, out = error_of(lambda: _two_heads_train(comp, steps))
        if err is not None:
            res[exchange] = {"error": err}
            continue
        model, moved, losses = out
        a = torch.cat([m.reshape(-1) for m in moved]).double()
        b = torch.cat([m.reshape(-1) for m in exact_moved]).double()
        m = comp.metrics()
        res[exchange] = {
            "error": None,
            "params": [digest(p) for p in model.parameters()],
            "finite": all(bool(torch.isfinite(p).all()) for p in model.parameters()),
            "cosine_to_exact": float(a @ b / (a.norm() * b.norm())),
            "heads_moved": [float(moved[i].abs().max()) for i in (2, 3, 4, 5)],
            "exchange": m["exchange"],
            "step": m["step"],
            "coordinates": m["coordinates"],
            "recovered": m["recovered"],
        }
    return res


# ---------------------------------------------------------------------------------------------
# 2. ops other than Sum / Average, and Adasum


def ops(args) -> dict:
    rank = hvd.rank()
    res = {}
    for exchange in EXCHANGES:
        comp = comp_for(exchange)
        for op_name in ("Min", "Max", "Product"):
            op = getattr(hvd, op_name)
            x = torch.full((64,), float(rank + 1))
            err, out = error_of(lambda: hvd.allreduce(x, op=op, compression=comp, name=f"{exchange}.{op_name}"))
            res[f"{exchange}.{op_name}"] = {"error": err, "out": None if out is None else out[:4].tolist()}
            after = check_mean(comp, after_data(rank, 1024) + rank, f"{exchange}.{op_name}.after")
            res[f"{exchange}.{op_name}.after"] = after
    return res


def adasum(args) -> dict:
    rank = hvd.rank()
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 32)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    before = digest(model.weight)
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        named_parameters=model.named_parameters(),
        compression=comp_for(),
        op=hvd.Adasum,
    )

    def step():
        opt.zero_grad()
        model(torch.randn(8, 64) + rank).pow(2).mean().backward()
        opt.step()

    err, _ = error_of(step)
    # Horovod (and its process) stay usable: a plain allreduce afterwards
    plain = hvd.allreduce(torch.full((4,), float(rank + 1)), name="adasum.after", op=hvd.Sum)
    return {"error": err, "weight_changed": digest(model.weight) != before, "after": plain.tolist()}


# ---------------------------------------------------------------------------------------------
# 3. shapes and 4. dtypes that differ across ranks


def shapes(args) -> dict:
    rank = hvd.rank()
    res = {}
    for exchange in EXCHANGES:
        comp = comp_for(exchange)
        cases = {
            "same_count": torch.ones(4, 256) if rank == 0 else torch.ones(256, 4),
            "different_count": torch.ones(1024) if rank == 0 else torch.ones(2048),
            # below min_size on rank 0 (travels uncompressed) and compressed on rank 1
            "min_size_f32": torch.ones(10) if rank == 0 else torch.ones(1024),
            "min_size_f64": torch.ones(10, dtype=torch.float64) if rank == 0 else torch.ones(1024, dtype=torch.float64),
            # upstream test_horovod_allreduce_type_error
            "dtype": torch.ones(1024, dtype=torch.int32) if rank == 0 else torch.ones(1024),
            "dtype_f64": torch.ones(1024, dtype=torch.float64) if rank == 0 else torch.ones(1024),
            # rank 0's uncompressed float64 tensor has exactly the control vector's length (7 + N) while
            # rank 1 compresses: the control vector goes as (7 + N, 1), so Horovod's shape check refuses
            "collide": (torch.ones(9, dtype=torch.float64) if rank == 0 else torch.ones(1024, dtype=torch.float64)),
            # ... and with exactly the control vector's shape (it goes as (9, 1, 1))
            "collide_2d": (
                torch.ones(9, 1, dtype=torch.float64) if rank == 0 else torch.ones(1024, dtype=torch.float64)
            ),
            # both ranks pass a (9, 1) tensor uncompressed: reduced as (9, 1, 1), returned as (9, 1)
            "column": torch.arange(9, dtype=torch.float64).reshape(9, 1) * (rank + 1),
        }
        for case, x in cases.items():
            err, out = error_of(lambda: hvd.allreduce(x, compression=comp, name=f"{exchange}.{case}"))
            res[f"{exchange}.{case}"] = {
                "error": err,
                "shape": None if out is None else list(out.shape),
                "values": None if out is None else out.reshape(-1).tolist(),
            }
            # the compressor (and Horovod) still work afterwards
            res[f"{exchange}.{case}.after"] = check_mean(comp, after_data(rank), f"{exchange}.{case}.after")
        res[f"{exchange}.step"] = comp.metrics()["step"]
    return res


# ---------------------------------------------------------------------------------------------
# 5. process sets (3 ranks, a set of ranks 0 and 1)


def process_sets(args) -> dict:
    rank = hvd.rank()
    ps = PROCESS_SET
    res = {"members": ps.ranks}
    member = ps.included()
    comp = comp_for(process_set=ps)
    value = {0: 10.0, 1: 20.0}.get(rank, 30.0)
    if member:
        x = torch.full((1024,), value)
        res["subset"] = check_mean(comp, x, "ps.mean", process_set=ps)
        res["subset"]["value"] = hvd.allreduce(x, compression=comp, name="ps.mean2", process_set=ps)[:4].tolist()
    # the set's compressor in a global allreduce: every rank (the non-member too) uses it
    err, out = error_of(lambda: hvd.allreduce(torch.full((1024,), value), compression=comp, name="ps.global"))
    res["global"] = {"error": err, "out": None if out is None else out[:4].tolist()}
    # a compressor pinned to the global set in an allreduce over the set (members only) raises; one
    # made without process_set= serves the set with a compressor of its own
    if member:
        pinned = comp_for(process_set=hvd.global_process_set)
        err, out = error_of(
            lambda: hvd.allreduce(torch.full((1024,), value), compression=pinned, name="ps.swapped", process_set=ps)
        )
        res["swapped"] = {"error": err, "out": None if out is None else out[:4].tolist()}
        err, out = error_of(
            lambda: hvd.allreduce(
                torch.full((1024,), value), compression=comp_for(), name="ps.unpinned", process_set=ps
            )
        )
        res["unpinned"] = {"error": err, "out": None if out is None else out[:4].tolist()}
        res["after"] = check_mean(comp, torch.full((1024,), value), "ps.after", process_set=ps)
    hvd.barrier()
    # the optimizer over the set, trained on the members only
    if member:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
        hvd.broadcast_parameters(model.state_dict(), root_rank=0, process_set=ps) if _bcast_has_ps() else None
        start = digest(model[0].weight)
        opt = hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1),
            named_parameters=model.named_parameters(),
            compression=comp_for(process_set=ps),
            process_set=ps,
        )
        g = torch.Generator().manual_seed(rank)
        for _ in range(4):
            opt.zero_grad()
            model(torch.randn(16, 16, generator=g)).pow(2).mean().backward()
            opt.step()
        res["train"] = {
            "params": [digest(p) for p in model.parameters()],
            "moved": digest(model[0].weight) != start,
            "step": opt._compression.metrics()["step"] if hasattr(opt, "_compression") else None,
        }
    hvd.barrier()
    return res


def _bcast_has_ps() -> bool:
    import inspect

    return "process_set" in inspect.signature(hvd.broadcast_parameters).parameters


# ---------------------------------------------------------------------------------------------
# 6. autograd through hvd.allreduce(compression=...)


def autograd(args) -> dict:
    rank = hvd.rank()
    res = {}
    for exchange in EXCHANGES:
        comp = comp_for(exchange)
        for op_name in ("Average", "Sum"):
            op = getattr(hvd, op_name)
            weights = torch.arange(1, 1025, dtype=torch.float32) * (rank + 1)  # exact in float32
            grads = []
            for compression in (hvd.Compression.none, comp):
                x = torch.randn(1024, generator=torch.Generator().manual_seed(rank)).requires_grad_()
                err, y = error_of(
                    lambda: hvd.allreduce(
                        x, op=op, compression=compression, name=f"ag.{exchange}.{op_name}.{len(grads)}"
                    )
                )
                if err is not None:
                    grads.append(err)
                    continue
                err, _ = error_of(lambda: (y * weights).sum().backward())
                grads.append(err if err is not None else x.grad.clone())
            ref, got = grads
            res[f"{exchange}.{op_name}"] = {
                "errors": [g for g in grads if isinstance(g, str)],
                "equal": isinstance(ref, torch.Tensor)
                and isinstance(got, torch.Tensor)
                and bool(torch.equal(ref, got)),
                "got": got[:4].tolist() if isinstance(got, torch.Tensor) else None,
                "ref": ref[:4].tolist() if isinstance(ref, torch.Tensor) else None,
            }
    return res


# ---------------------------------------------------------------------------------------------
# 7. hvd.join and reducescatter


def _join_train(compression, steps: int = 2) -> list:
    """A few optimizer steps of a small model (rank 0's data); returns the parameters' digests."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 40), torch.nn.ReLU(), torch.nn.Linear(40, 8))
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters(), compression=compression
    )
    g = torch.Generator().manual_seed(5)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(16, 64, generator=g)).pow(2).mean().backward()
        opt.step()
    return [digest(p) for p in model.parameters()]


def join(args) -> dict:
    """Rank 1 is in hvd.join() while rank 0 allreduces with the compressor (Average and Sum, then
    DistributedOptimizer steps): Horovod sums zeros for the joined rank, so every call must give what
    Horovod gives without compression (rank 0's tensor, scaled by the op), through one uncompressed
    allreduce that the joined rank serves; then both ranks exchange identically."""
    rank = hvd.rank()
    res = {}
    for exchange in EXCHANGES:
        # 4 KiB fusion buffers: in the optimizer steps each gradient closes the previous one's buffer,
        # whose payload collective starts early (and fails in Horovod: no allgather with a joined rank)
        comp = comp_for(exchange, fusion_bytes=4096)
        if rank == 1:
            res[exchange] = {"joined": hvd.join()}
        else:
            calls = []
            x = torch.randn(1024, generator=torch.Generator().manual_seed(3))
            for op_name, scale in (("Average", 0.5), ("Sum", 1.0)):
                for i in range(2):
                    err, out = error_of(
                        lambda: hvd.allreduce(
                            x, compression=comp, op=getattr(hvd, op_name), name=f"j.{exchange}.{op_name}.{i}"
                        )
                    )
                    ref = hvd.allreduce(x, op=getattr(hvd, op_name), name=f"j.{exchange}.{op_name}.{i}.ref")
                    calls.append(
                        {
                            "error": err,
                            "equal": out is not None and bool(torch.equal(out, ref)),
                            "exact": out is not None and bool(torch.equal(out, x * scale)),
                        }
                    )
            # the same compressor: one used on rank 0 only would not pair with rank 1's afterwards
            err, trained = error_of(lambda: _join_train(comp))
            res[exchange] = {
                "calls": calls,
                "train_error": err,
                "trained": trained,
                "trained_ref": _join_train(hvd.Compression.none),
                "metrics": {k: comp.metrics()[k] for k in ("step", "uncompressed_coordinates")},
                "joined": hvd.join(),
            }
        res[f"{exchange}.after"] = check_mean(comp, after_data(rank), f"j.{exchange}.after")
    return res


def reducescatter(args) -> dict:
    rank = hvd.rank()
    res = {}
    for exchange in EXCHANGES:
        comp = comp_for(exchange)
        err, out = error_of(
            lambda: hvd.reducescatter(torch.ones(64, 32) * (rank + 1), compression=comp, name=f"rs.{exchange}")
        )
        res[exchange] = {"error": err, "shape": None if out is None else list(out.shape)}
        res[f"{exchange}.after"] = check_mean(comp, after_data(rank), f"rs.{exchange}.after")
    return res


# ---------------------------------------------------------------------------------------------
# Settings that differ across ranks; 3 ranks and odd sizes


def settings(args) -> dict:
    rank = hvd.rank()
    res = {}
    for exchange in EXCHANGES:
        for what in ("bits", "levels"):
            comp = comp_for(exchange, bits=4 if (what == "bits" and rank == 1) else 3)
            if what == "levels" and rank == 1:
                comp._quantizer.set_levels(np.array([-1, -0.3, -0.1, -0.01, 0.01, 0.1, 0.3, 1.0]))
            err, out = error_of(lambda: hvd.allreduce(torch.randn(2000), compression=comp, name=f"s.{exchange}.{what}"))
            res[f"{exchange}.{what}"] = {"error": err}
    return res


def odd_sizes(args) -> dict:
    rank = hvd.rank()
    res = {}
    sizes = (37, 1000, 513, 5003, 17)
    for fusion in (0, 4096, "b4"):
        if fusion == "b4":  # 4-bit second quantization: refit in the round after the first's refit
            comp = comp_for("two-phase", fusion_bytes=4096, update_steps=(0,), update_every=0, bits_second=4)
        else:
            comp = comp_for("two-phase", fusion_bytes=fusion, update_steps=(0, 1), update_every=0)
        initial_second = comp.metrics()["second_levels"].tolist()
        for rnd in range(3):
            g = torch.Generator().manual_seed(rank * 7 + rnd)
            xs = [torch.randn(n, generator=g) * (rank + 1) for n in sizes]
            outs = hvd.grouped_allreduce(xs, compression=comp, op=hvd.Average, name=f"odd.{fusion}.{rnd}")
            exact = hvd.grouped_allreduce(xs, op=hvd.Average, name=f"odd.exact.{fusion}.{rnd}")
            res[f"{fusion}.{rnd}"] = {
                "digests": [digest(o) for o in outs],
                "shapes": [list(o.shape) for o in outs],
                "rel_err": [float((o - e).norm() / e.norm()) for o, e in zip(outs, exact)],
            }
        m = comp.metrics()
        res[f"{fusion}.metrics"] = {
            "exchange": m["exchange"],
            "levels": m["levels"].tolist(),
            "level_updates": m["level_updates"],
            "initial_second": initial_second,
            "second_levels": m["second_levels"].tolist(),
        }
    return res


PROCESS_SET = None


SCENARIOS = (
    "force_allreduce",
    "ops",
    "adasum",
    "shapes",
    "process_sets",
    "autograd",
    "join",
    "reducescatter",
    "settings",
    "odd_sizes",
)


def main() -> None:
    global PROCESS_SET
    p = argparse.ArgumentParser()
    p.add_argument("scenario", help=f"one of {', '.join(SCENARIOS)}, or several joined by '+' (run in turn)")
    args = p.parse_args()
    names = args.scenario.split("+")
    if set(names) - set(SCENARIOS) or "process_sets" in names[:-1]:
        p.error(f"scenario {args.scenario!r}: unknown, or process_sets not last")
    if names[-1] == "process_sets":  # (its hvd.init registers the set {0, 1})
        PROCESS_SET = hvd.ProcessSet([0, 1])
        hvd.init(process_sets=[PROCESS_SET])
    else:
        hvd.init()
    torch.set_num_threads(1)
    if len(names) > 1:  # one launch, several scenarios: {name: what the scenario reports}
        report({name: globals()[name](args) for name in names})
    else:
        report(globals()[args.scenario](args))
    hvd.shutdown()


if __name__ == "__main__":
    main()
