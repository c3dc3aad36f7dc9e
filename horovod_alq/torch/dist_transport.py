"""The exchange engine's transport over ``torch.distributed`` (gloo on CPU, NCCL on GPU).

torch.distributed pairs collectives by call order within a process group, so the names the engine
gives collectives are ignored; every rank of the group issues the same collectives in the same
order (the engine's handshake guarantees it before any payload moves). A streamed round (the DDP
hook) issues the second collective of each buffer from completion callbacks, on a
:func:`companion_group` of the same members, so that each group sees one order.

Payloads of different sizes: ``all_gather_into_tensor`` (``all_gather_single``) needs equal sizes on every rank, so each
rank pads its payload to the largest size and the padding is dropped on arrival (the engine passes
every rank's size). ``all_to_all_single`` takes the splits directly (gloo and NCCL support uneven
splits of uint8 tensors). The small vectors go through ``all_reduce`` (SUM of float64, MAX of int64).

Python callbacks on the backend's threads (:func:`on_completion`) are counted, and the interpreter's
exit waits for them: otherwise a backend thread that still has to release a completed collective
(its work and the callback hold Python objects) can find the interpreter finalizing, and the
process aborts at exit ("terminate called without an active exception").
"""

from __future__ import annotations

import atexit
import os
import threading
import time
from typing import Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist

from ..core.protocol import resolve_timeout, timeout_error, wait_for
from ..exchange.hierarchical import resolve_local_size

#: ``all_gather_into_tensor`` is called ``all_gather_single`` from PyTorch 2.13 on (the old name warns).
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class DistTransport:
    """Collectives of one torch.distributed process group (default: the world), for the engine.

    Parameters
    ----------
    process_group : ProcessGroup, optional
        The group (``None``: the default group). This rank must be a member.
    device : torch.device, optional
        Where the collectives' tensors live: CUDA (the current device) for NCCL, CPU otherwise.
    timeout : float, optional
        Seconds a wait for one of its collectives may take before it raises
        (:func:`horovod_alq.core.protocol.resolve_timeout`: default ``$HOROVOD_ALQ_TIMEOUT`` or 300).
    local_size : int, optional
        Ranks per node (nodes are runs of consecutive ranks of the group). Default:
        ``$HOROVOD_ALQ_LOCAL_SIZE``, else torchrun's ``LOCAL_WORLD_SIZE`` for the world group when
        ``LOCAL_RANK`` is this rank's place in its run, else the group's size (one node).
    """

    def __init__(
        self,
        process_group=None,
        device: torch.device | None = None,
        timeout: float | None = None,
        local_size: int | None = None,
    ) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "horovod_alq: torch.distributed is not initialized; call "
                "dist.init_process_group() first (torchrun sets the environment)"
            )
        self.group = process_group
        rank = dist.get_rank(process_group)
        if rank < 0:
            raise RuntimeError("horovod_alq: this rank is not a member of the hook's process group")
        self.rank = int(rank)
        self.size = int(dist.get_world_size(process_group))
        if device is None:
            nccl = dist.get_backend(process_group) == "nccl"
            device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
        self.device = torch.device(device)
        self.scope = f"process group {dist.get_process_group_ranks(process_group or dist.group.WORLD)}"
        self.timeout = resolve_timeout(timeout)
        self.local_size = _local_size(process_group, self.rank, self.size) if local_size is None else int(local_size)

    def wait(self, work, name: str) -> None:
        """Wait for ``work`` (bounded by the timeout), raising its error if it failed."""
        wait_for(work.is_completed, self.timeout, name, self.scope)
        work.wait()

    def allgather(self, payload: torch.Tensor, sizes: Sequence[int], name: str):
        sizes = [int(s) for s in sizes]
        width = max(sizes) if sizes else 0
        src = payload.to(self.device).contiguous()
        if src.numel() != width:
            padded = torch.zeros(width, dtype=torch.uint8, device=self.device)
            padded[: src.numel()] = src
            src = padded
        out = torch.empty(width * self.size, dtype=torch.uint8, device=self.device)
        work = _ALL_GATHER(out, src, group=self.group, async_op=True)

        def result() -> torch.Tensor:
            if all(s == width for s in sizes):
                return out
            return torch.cat([out[r * width : r * width + s] for r, s in enumerate(sizes)])

        return _Pending(self, work, result, name)

    def alltoall(self, payload: torch.Tensor, splits: Sequence[int], received: Sequence[int], name: str):
        out = torch.empty(sum(int(r) for r in received), dtype=torch.uint8, device=self.device)
        work = dist.all_to_all_single(
            out,
            payload.to(self.device).contiguous(),
            output_split_sizes=[int(r) for r in received],
            input_split_sizes=[int(s) for s in splits],
            group=self.group,
            async_op=True,
        )
        return _Pending(self, work, lambda: out, name)

    def _allreduce(self, vec: np.ndarray, dtype, op, name: str) -> np.ndarray:
        t = torch.from_numpy(np.ascontiguousarray(vec, dtype=dtype)).to(self.device)
        self.wait(dist.all_reduce(t, op=op, group=self.group, async_op=True), name)
        return t.cpu().numpy()

    def allreduce_sum(self, vec: np.ndarray, name: str) -> np.ndarray:
        return self._allreduce(vec, np.float64, dist.ReduceOp.SUM, name)

    def allreduce_max(self, vec: np.ndarray, name: str) -> np.ndarray:
        return self._allreduce(vec, np.int64, dist.ReduceOp.MAX, name)


class _Pending:
    """A started collective: calling it waits and returns the result; ``then(callback)`` runs the
    callback (on a thread of the backend) once the collective completed, and a call from the
    callback returns the result (or raises the collective's error) without waiting on the work,
    which would wait for the callback itself."""

    __slots__ = ("transport", "work", "result", "name", "ready", "error")

    def __init__(self, transport: DistTransport, work, result, name: str) -> None:
        self.transport, self.work, self.result, self.name = transport, work, result, name
        self.ready, self.error = False, None

    def __call__(self) -> torch.Tensor:
        if self.error is not None:
            raise self.error
        if not self.ready:
            self.transport.wait(self.work, self.name)
        return self.result()

    def then(self, callback) -> None:
        def run(future) -> None:
            try:
                future.wait()
                self.ready = True
            except BaseException as exc:  # noqa: BLE001 - raised by the call in the callback
                self.error = exc
            callback()

        on_completion(self.work, run)


class _BackendCallbacks:
    """Counts the Python callbacks started on backend threads and, at the interpreter's exit
    (an ``atexit`` hook, registered with the first callback), waits until every one has returned
    (at most ``DRAIN_SECONDS``), then lets the backend threads run for ``RELEASE_SECONDS``.

    Why: a backend thread releases a collective's work and the callback after the callback
    returned, and both hold Python objects (the callable; the work's saved thread-local state),
    so it takes the GIL once more. If the main thread has begun to finalize the interpreter by then,
    CPython ends that thread mid-destructor and the process aborts ("terminate called without an
    active exception"; seen with the DDP hook on gloo in about 1 run in 4 when a program exits
    right after its last step). ``atexit`` hooks run before the interpreter starts finalizing.
    """

    DRAIN_SECONDS = 5.0
    RELEASE_SECONDS = 0.05

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.started = self.finished = 0
        self._registered = False

    def add(self, future, callback: Callable) -> None:
        with self._lock:
            self.started += 1
            if not self._registered:
                atexit.register(self.drain)
                self._registered = True

        def run(f):
            try:
                return callback(f)
            finally:
                with self._lock:
                    self.finished += 1

        future.then(run)

    def drain(self) -> None:
        deadline = time.monotonic() + self.DRAIN_SECONDS
        while self.finished < self.started and time.monotonic() < deadline:
            time.sleep(0.001)
        time.sleep(self.RELEASE_SECONDS)


_CALLBACKS = _BackendCallbacks()


def on_completion(work, callback: Callable) -> None:
    """Run ``callback(future)`` on a backend thread once the collective ``work`` completed, counted
    so that the interpreter's exit waits for it (:class:`_BackendCallbacks`)."""
    _CALLBACKS.add(work.get_future(), callback)


_COMPANIONS: dict[tuple[int, ...], object] = {}


def companion_group(process_group=None, index: int = 1):
    """The ``index``-th other process group with the members of ``process_group`` (made once per
    member set and index, by every member on first use, at the same point of their programs): its
    collectives pair apart from the group's own, so collectives issued from completion callbacks
    keep one order (an exchange's stage ``k`` runs on companion ``k``)."""
    ranks = tuple(dist.get_process_group_ranks(process_group or dist.group.WORLD))
    if (ranks, index) not in _COMPANIONS:
        _COMPANIONS[ranks, index] = dist.new_group(list(ranks), use_local_synchronization=True)
    return _COMPANIONS[ranks, index]


def _local_size(process_group, rank: int, size: int) -> int:
    """The ranks per node of a group (see :class:`DistTransport`): torchrun's ``LOCAL_WORLD_SIZE`` and
    ``LOCAL_RANK`` for the world group (:func:`~horovod_alq.exchange.hierarchical.resolve_local_size`)."""
    launcher = None
    if process_group is None or process_group == dist.group.WORLD:
        try:
            launcher = int(os.environ["LOCAL_WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
        except (KeyError, ValueError):
            pass
    return resolve_local_size(size, rank, launcher)


class SettleOnce:
    """A future that the exchange completes, or :class:`Watchdog` fails when the exchange has not
    completed within its time; whichever comes first settles it, the other is ignored."""

    __slots__ = ("future", "name", "scope", "seconds", "_lock", "settled")

    def __init__(self, future: torch.futures.Future, name: str, scope: str, seconds: float) -> None:
        self.future, self.name, self.scope, self.seconds = future, name, scope, seconds
        self._lock = threading.Lock()
        self.settled = False

    def _claim(self) -> bool:
        with self._lock:
            if self.settled:
                return False
            self.settled = True
            return True

    def set_result(self, value) -> None:
        if self._claim():
            self.future.set_result(value)

    def set_exception(self, error: BaseException) -> None:
        if self._claim():
            self.future.set_exception(error)

    def expire(self) -> None:
        self.set_exception(timeout_error(self.name, self.seconds, self.scope))


class Watchdog:
    """One daemon thread that fails every watched :class:`SettleOnce` still pending at its deadline
    (checked every ``PERIOD`` seconds): a future that DDP waits for in C++, where no bounded wait
    of ours runs, raises :func:`~horovod_alq.core.protocol.timeout_error` instead of waiting for
    the process group's own timeout (30 minutes by default on gloo)."""

    PERIOD = 0.25

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._watched: list[tuple[float, SettleOnce]] = []
        self._thread: threading.Thread | None = None

    def watch(self, settle: SettleOnce) -> None:
        if settle.seconds == float("inf"):
            return
        with self._lock:
            self._watched.append((time.monotonic() + settle.seconds, settle))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="horovod-alq-watchdog", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while True:
            time.sleep(self.PERIOD)
            now = time.monotonic()
            with self._lock:
                due = [s for d, s in self._watched if d <= now and not s.settled]
                self._watched = [(d, s) for d, s in self._watched if d > now and not s.settled]
            for settle in due:
                settle.expire()


WATCHDOG = Watchdog()
