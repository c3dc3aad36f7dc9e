"""Ranks as threads of one process: a transport whose collectives pair by name (as Horovod's do),
for fast multi-rank tests and studies of the engine's rounds (``Hub(size, local_size=G)``: nodes of G
consecutive ranks). The tests and scripts/study use it; real processes: tests/torch, tests/mpi."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np


def _cat(parts):
    if all(isinstance(p, np.ndarray) for p in parts):
        return np.concatenate(parts)
    import torch

    return torch.cat([p if not isinstance(p, np.ndarray) else torch.from_numpy(p) for p in parts])


class Hub:
    """Where the ranks' contributions meet, by collective name."""

    def __init__(
        self, size: int, timeout: float = 20.0, local_size: int | None = None, variable_sizes: bool = False
    ) -> None:
        self.size, self.timeout = size, timeout
        self.variable_sizes = variable_sizes  # the transports say they take blocks of any size (as Horovod's)
        self.local_size = size if local_size is None else local_size  # ranks per node (consecutive ranks)
        self._cond = threading.Condition()
        self._got: dict[str, dict[int, object]] = {}

    def put(self, name: str, rank: int, value) -> None:
        with self._cond:
            slot = self._got.setdefault(name, {})
            if rank in slot:
                raise AssertionError(f"rank {rank} issued {name!r} twice")
            slot[rank] = value
            self._cond.notify_all()

    def get(self, name: str) -> list:
        with self._cond:
            if not self._cond.wait_for(lambda: len(self._got.get(name, {})) == self.size, self.timeout):
                raise TimeoutError(f"collective {name!r}: only ranks {sorted(self._got.get(name, {}))} arrived")
            return [self._got[name][r] for r in range(self.size)]

    def transports(self) -> list["ThreadTransport"]:
        return [ThreadTransport(self, r) for r in range(self.size)]

    def run(self, fn):
        """``fn(rank, transport)`` on every rank, concurrently; their results (or the first error)."""
        with ThreadPoolExecutor(self.size) as pool:
            futures = [pool.submit(fn, r, t) for r, t in enumerate(self.transports())]
            return [f.result() for f in futures]

    def outcomes(self, fn) -> list:
        """Like :meth:`run`, but every rank's result or exception."""
        with ThreadPoolExecutor(self.size) as pool:
            futures = [pool.submit(fn, r, t) for r, t in enumerate(self.transports())]
            return [f.exception() or f.result() for f in futures]


class ThreadTransport:
    def __init__(self, hub: Hub, rank: int) -> None:
        self.hub, self.rank, self.size = hub, rank, hub.size
        self.local_size = hub.local_size
        self.variable_sizes = hub.variable_sizes
        self.sent_to: dict[int, int] = {}  # bytes this rank's alltoalls and allgathers sent to each other rank

    def allgather(self, payload, sizes, name):
        for r in range(self.size):
            if r != self.rank:
                self.sent_to[r] = self.sent_to.get(r, 0) + int(sizes[self.rank])
        self.hub.put(name, self.rank, payload)
        return lambda: _cat(self.hub.get(name))

    def alltoall(self, payload, splits, received, name):
        bounds = np.concatenate([[0], np.cumsum(splits)]).astype(int)
        for r in range(self.size):
            if r != self.rank:
                self.sent_to[r] = self.sent_to.get(r, 0) + int(splits[r])
        self.hub.put(name, self.rank, [payload[bounds[j] : bounds[j + 1]] for j in range(self.size)])
        return lambda: _cat([pieces[self.rank] for pieces in self.hub.get(name)])

    def allreduce_sum(self, vec, name):
        self.hub.put(name, self.rank, np.asarray(vec, dtype=np.float64))
        return np.sum(self.hub.get(name), axis=0)

    def allreduce_max(self, vec, name):
        self.hub.put(name, self.rank, np.asarray(vec, dtype=np.int64))
        return np.max(self.hub.get(name), axis=0)


def exchange_round(engines, tensors, ops, tag: str, hub: Hub | None = None, idents=None) -> list:
    """One round of every rank's ``tensors`` (a list per rank) through its engine, with the control
    vectors summed as Horovod's allreduce would; every rank's outputs (or exception). ``idents``:
    what each tensor of the list is (error feedback's keys; default: its index in the list)."""
    hub = hub or Hub(len(engines))

    def rank(r, t):
        entries = [
            engines[r].add(
                x,
                x.size if hasattr(x, "size") and not callable(x.size) else x.numel(),
                tuple(x.shape),
                "float32",
                t,
                ident=k if idents is None else idents[k],
            )
            for k, x in enumerate(tensors[r])
        ]
        reduced = [t.allreduce_sum(v, f"{tag}.control{k}") for k, (_, v) in enumerate(entries)]
        return [engines[r].finish(e, v, ops, t)[0] * 1 for (e, _), v in zip(entries, reduced)]

    return hub.outcomes(rank)


def exchange_rounds(engines, rounds, ops, hub: Hub | None = None) -> list:
    """:func:`exchange_round` for each round in turn (``rounds``: each a list of tensors per rank):
    every rank's outputs per round, or the exception that ended its rounds (they stop at the first)."""
    hub = hub or Hub(len(engines))
    outs: list = [[] for _ in engines]
    for step, tensors in enumerate(rounds):
        got = exchange_round(engines, tensors, ops, f"round{step}", hub)
        for r, out in enumerate(got):
            if isinstance(out, BaseException):
                outs[r] = out
            else:
                outs[r].append(out)
        if any(isinstance(out, BaseException) for out in got):
            break
    return outs


def start_early(engines, ops) -> None:
    """Make each engine's ``add`` pass ``ops`` (what Horovod's compressors do with ``overlap=True``),
    so that a fusion buffer starts its exchange as soon as it is complete."""
    for e in engines:
        add = e.add
        e.add = lambda *a, _add=add, **k: _add(*a, ops=ops, **k)
