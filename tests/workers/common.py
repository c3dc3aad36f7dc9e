"""Helpers for worker scripts started by :func:`multiproc.run_ranks`.

A worker is a plain Python script run once per rank (under mpirun or horovodrun). It does its work
and calls :func:`report` once with a JSON-serializable object; ``run_ranks`` returns the reported
objects in rank order. Anything it prints goes to a per-rank log that is shown when the test fails.
What the tests use too (t statistics, digests, the ranks' data) is in tests/helpers.py.
"""

from __future__ import annotations

import copy
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

RESULT_DIR_ENV = "HOROVOD_ALQ_RESULT_DIR"
_RANK_VARS = ("OMPI_COMM_WORLD_RANK", "HOROVOD_RANK", "PMI_RANK", "PMIX_RANK", "RANK")  # RANK: torchrun


def launcher_rank() -> int:
    """This process's rank as set by the launcher (before any ``hvd.init()``)."""
    for var in _RANK_VARS:
        if var in os.environ:
            return int(os.environ[var])
    raise RuntimeError(f"no rank variable set ({', '.join(_RANK_VARS)}); start this script with run_ranks")


def _plain(obj: Any) -> Any:
    """json.dumps fallback: arrays and tensors (NumPy, torch, TF) become lists, scalars numbers."""
    if hasattr(obj, "numpy") and not hasattr(obj, "tolist"):  # TF eager tensor
        obj = obj.numpy()
    if hasattr(obj, "detach"):  # torch tensor
        obj = obj.detach().cpu()
    if hasattr(obj, "tolist"):
        return obj.tolist()
    raise TypeError(f"cannot report an object of type {type(obj).__name__}")


def report(obj: Any) -> None:
    """Hand ``obj`` (JSON-serializable; arrays and tensors are turned into lists) to the test.

    Writes ``$HOROVOD_ALQ_RESULT_DIR/rank{N}.json`` atomically. Call it once per rank, at the end.
    """
    result_dir = Path(os.environ[RESULT_DIR_ENV])
    rank = launcher_rank()
    tmp = result_dir / f".rank{rank}.json.tmp"
    tmp.write_text(json.dumps(obj, default=_plain))
    tmp.replace(result_dir / f"rank{rank}.json")


def cell_moments(x: np.ndarray, levels: np.ndarray, bucket: int, norm: str):
    """Exact per-coordinate variance of n * Q(x / n) and the width of its support, for a tensor
    ``x`` quantized in buckets of ``bucket`` with norm ``norm`` ("l2" or "linf") and ``levels``."""
    n = x.size
    nb = -(-n // bucket)
    padded = np.zeros(nb * bucket)
    padded[:n] = x
    b = padded.reshape(nb, bucket)
    norms = np.sqrt((b * b).sum(1)) if norm == "l2" else np.abs(b).max(1)
    norms = np.repeat(norms.astype(np.float32).astype(np.float64), bucket)[:n]
    r = np.clip(np.divide(x, norms, out=np.zeros(n), where=norms > 0), -1, 1)
    cell = np.clip(np.searchsorted(levels, r, side="right") - 1, 0, levels.size - 2)
    lo, hi = levels[cell], levels[cell + 1]
    return norms**2 * (hi - r) * (r - lo), norms * (hi - lo)


_STALLS = [0]  # calls of stalled_backward so far (the same count on every rank)


def stalled_backward(rank: int, size: int, timeout: float, backward) -> dict:
    """Run ``backward()``, in which the last rank raises (it stops in the middle of a round), and
    report whether and after how long it raised here. The last rank then stays alive, not calling,
    until every other rank has raised (a process that exits closes its connections, and the
    backend fails the others at once), so that the others' bounded waits are what ends their wait:
    each of them leaves a file in the result folder once it raised; the last rank waits for those
    for ``timeout`` + 60 s at most."""
    _STALLS[0] += 1
    folder, tag = Path(os.environ[RESULT_DIR_ENV]), f"stalled{_STALLS[0]}"
    start = time.monotonic()
    try:
        backward()
    except Exception as err:  # noqa: BLE001 - reported to the test
        seconds = time.monotonic() - start
        if rank == size - 1:
            deadline = time.monotonic() + timeout + 60
            while len(list(folder.glob(f"{tag}.rank*"))) < size - 1 and time.monotonic() < deadline:
                time.sleep(0.05)
        else:
            (folder / f"{tag}.rank{rank}").touch()
        return {
            "raised": True,
            "message": f"{type(err).__name__}: {err}"[:2000],
            "seconds": seconds,
            "timeout": timeout,
        }
    return {"raised": False, "seconds": time.monotonic() - start}


def linear(n: int):
    """A torch module whose loss ``<p, x>`` has gradient ``x`` exactly (``p``: n zeros)."""
    import torch

    class Linear(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.p = torch.nn.Parameter(torch.zeros(n))

        def forward(self, x):
            return (self.p * x).sum()

    return Linear()


def placed_buffers(state: dict, n: int) -> list:
    """The error buffers of a front-end's ``state_dict()`` summed at their stream positions."""
    total = np.zeros(n)
    for key, buf in state["error_feedback"]["buffers"]:
        lo, hi = key[-2], key[-1]
        total[lo:hi] += np.asarray(buf, dtype=np.float64)[: n - lo]
    return total.tolist()


def argv_groups(parse) -> list:
    """The groups of ``sys.argv`` (separated by "::"), each parsed by ``parse`` with its own options, in order."""
    groups, current = [], []
    for word in sys.argv[1:] + ["::"]:
        if word == "::":
            groups.append(parse(current))
            current = []
        else:
            current.append(word)
    return groups


def record_refit_round(out: dict, metrics: dict, speed=None, now: list | None = None) -> None:
    """One round of the precondition workers' ``refit`` scenarios into ``out``: the levels and the
    refit count after it, and with ``speed`` (an arbiter on the injected clock ``now``) whether it was
    quantized, the clock then advanced by the round's simulated cost (quantized 2 s, 16-bit 1 s)."""
    if speed is not None:
        out.setdefault("paths", []).append(bool(speed.current))
        now[0] += 2.0 if speed.current else 1.0
    out["levels"].append(metrics["levels"].tolist())
    out["updates"].append(int(metrics["level_updates"]))


def snapshot(model, opt, alq) -> dict:
    """Copies of the state dicts of a model, its optimizer and its compressor (or ALQState)."""
    return copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict(), "alq": alq.state_dict()})


def replay(saved: dict, model, opt, alq, batches) -> dict:
    """The precondition workers' resume: ``saved`` (:func:`snapshot`) loaded, then a training step
    per ``(x, y)`` of ``batches``, each round recorded as :func:`record_refit_round` does."""
    import torch.nn.functional as F

    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    alq.load_state_dict(saved["alq"])
    out = {"levels": [], "updates": []}
    for x, y in batches:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        record_refit_round(out, alq.metrics())
    return out


def refit_fits(seen: list, before, ops, allreduce) -> dict:
    """Fits of the levels ``before`` a round on the statistics of what it quantized (``scaled``:
    each ``(g, w)`` of ``seen`` as g * w) and of the bare ``g`` (``unscaled``), summed over the ranks
    by ``allreduce(array, key)``."""
    out = {}
    for key, xs in (("scaled", [g * w for g, w in seen]), ("unscaled", [g for g, _ in seen])):
        q = copy.deepcopy(before)
        q.adapt(allreduce(sum(ops.statistics(v, before) for v in xs), key))
        out[key] = q.levels.tolist()
    return out
