"""What the step benchmarks and the time-to-accuracy study measure inside the ranks, the same way:
the timed step (wall clock, the main thread's CPU and the process's, a barrier before and, where
link bytes are counted, after), the bytes counters of a row's compressor or hook, a namespace's
interface counters, the closing check that every rank holds the same parameters, and the
statistics over ranks and steps."""

from __future__ import annotations

import math
import statistics
import time


def if_bytes(name: str) -> tuple[int, int]:
    """(tx_bytes, rx_bytes) of interface ``name`` in this process's network namespace
    (/proc/net/dev: the interface's counters, whole frames)."""
    with open("/proc/net/dev") as f:
        for line in f:
            dev, _, rest = line.partition(":")
            if dev.strip() == name:
                fields = rest.split()
                return int(fields[8]), int(fields[0])
    raise RuntimeError(f"no interface {name!r} in /proc/net/dev")


def timed_step(
    forward_backward, optimizer_step, zero_grad, barrier, link=None, settle: bool = False, clock=None
) -> dict:
    """One row's step after ``barrier()``: {"out": what ``forward_backward()`` returned, "step_s"
    (forward, backward and ``optimizer_step()``), "fwd_bwd_s", "cpu_main_s" (``time.thread_time``:
    forward, backward, hooks, codec, optimizer), "cpu_all_s" (the process's, Horovod's, Open MPI's
    and gloo's threads too), "link" (``link()``'s counters after less before, None without)}.
    ``zero_grad()`` comes after the clock; with ``settle`` a second barrier follows (every rank's
    traffic has ended before ``link()`` is read again). ``clock``: the row's :class:`RowClock`
    (or None), running from the first barrier to the end."""
    if clock is not None:
        clock.resume()
    barrier()
    l0 = link() if link else None
    c0, p0 = time.thread_time(), time.process_time()
    t0 = time.perf_counter()
    out = forward_backward()
    t1 = time.perf_counter()
    optimizer_step()
    t2 = time.perf_counter()
    c2, p2 = time.thread_time(), time.process_time()
    # set_to_none (torch's default): this row's gradients are freed until its next step, as a
    # training loop's zero_grad() before the backward would free them
    zero_grad()
    if settle:
        barrier()
    rec = {"out": out, "step_s": t2 - t0, "fwd_bwd_s": t1 - t0, "cpu_main_s": c2 - c0, "cpu_all_s": p2 - p0}
    rec["link"] = tuple(b - a for a, b in zip(l0, link())) if link else None
    if clock is not None:
        clock.pause()
    return rec


class RowClock:
    """A clock that runs only between :meth:`resume` and :meth:`pause` (:func:`timed_step` calls
    them around its row's step). The benchmarks interleave rows step by step, so a clock on the
    wall would time, from one of a row's rounds to its next, every row's step: a
    ``compress="when-faster"`` trial would see its row's difference diluted by the others'."""

    def __init__(self) -> None:
        self.elapsed, self.since = 0.0, None

    def __call__(self) -> float:
        return self.elapsed + (time.perf_counter() - self.since if self.since is not None else 0.0)

    def resume(self) -> None:
        self.since = time.perf_counter()

    def pause(self) -> None:
        self.elapsed, self.since = self(), None


def row_clock(state, rank: int, **arbiter) -> RowClock | None:
    """For a row whose ``state`` (rows.build's) runs ``compress="when-faster"``: a new arbiter (its
    front-end's defaults but for ``arbiter``'s keywords) that times the rounds on a :class:`RowClock`,
    which the caller resumes and pauses around the row's steps; returns that clock, None for
    other rows."""
    from horovod_alq.core.speed import SpeedArbiter

    rounds = getattr(state, "round_state", None) or getattr(state, "_state", None)
    if getattr(rounds, "speed", None) is None:
        return None
    clock = RowClock()
    rounds.speed = SpeedArbiter(rank=rank, what=rounds.speed.what, clock=clock, **arbiter)
    return clock


def counters(state) -> dict | None:
    """The bytes counters so far of a row's ``state`` (rows.build's): PowerSGD's coordinates before
    and after its compression, or this package's ``metrics()`` (payload bytes, coordinates sent
    uncompressed, rounds, the exchange, the entropy wire's fixed and coded bytes); None without."""
    if state is None:
        return None
    if hasattr(state, "total_numel_after_compression"):
        after, before = state.total_numel_after_compression, state.total_numel_before_compression
        return {"numel_after": after, "numel_before": before}
    m = state.metrics()
    return {
        "bytes_sent": m["bytes_sent"],
        "uncompressed": m["uncompressed_coordinates"],
        "step": m["step"],
        "exchange": m["exchange"],
        "wire_fixed": m.get("wire_fixed_bytes", 0),
        "wire_coded": m.get("wire_coded_bytes", 0),
        "collectives": m.get("collectives", 0),
        "rounds_16bit": m.get("rounds_16bit", 0),
        "compress_choice": m.get("compress_choice"),
        "step_time_quantized": m.get("step_time_quantized"),
        "step_time_16bit": m.get("step_time_16bit"),
    }


def ring(n: int) -> float:
    """What a bandwidth-optimal ring allreduce sends per rank, per byte of the tensor: 2(N-1)/N."""
    return 2 * (n - 1) / n


def param_diff(tensors) -> float:
    """The largest difference of these parameters (all ranks' in the same order) to rank 0's, over
    ranks (gloo); inf where a value is not finite."""
    import torch
    import torch.distributed as dist

    flat = torch.cat([t.detach().reshape(-1) for t in tensors])
    ref = flat.clone()
    dist.broadcast(ref, 0)
    d = torch.tensor([float((flat - ref).abs().max()) if torch.isfinite(flat).all() else math.inf], dtype=torch.float64)
    dist.all_reduce(d, op=dist.ReduceOp.MAX)
    return float(d)


def slowest(per_rank: list[dict], field: str, key: str) -> list[float]:
    """Per step, the slowest rank's ``per_rank[r][field][key][step]``."""
    return [max(steps) for steps in zip(*(r[field][key] for r in per_rank))]


def median_of_means(per_rank: list[dict], field: str, key: str) -> float:
    """Per step the mean over ranks, then the median over steps."""
    return statistics.median(statistics.fmean(steps) for steps in zip(*(r[field][key] for r in per_rank)))


def maxrss_mb() -> float:
    """This process's peak resident memory, MB."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
