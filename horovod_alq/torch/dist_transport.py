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

Teardown (issue 56: a rank must end with its error's status, never abort at exit). A backend thread
that needs the GIL once the interpreter has begun to finalize is ended by CPython in the middle of a
C++ destructor, and the process aborts ("terminate called without an active exception"). So:

- every tensor handed to a collective owns its memory (:func:`_owned`: a tensor over NumPy's memory,
  ``torch.from_numpy``, is copied first), so that the backend thread that drops a finished
  collective frees plain memory, without the GIL;
- Python callbacks on the backend's threads (:func:`on_completion`) are counted, and the
  interpreter's exit waits for them (:class:`_BackendCallbacks`);
- the :class:`Watchdog` thread is stopped and joined at exit;
- at exit, the backend threads of the groups still alive (one the program still references, or
  the default group that torch keeps once an optimizer imported ``torch._dynamo``) are let finish
  dropping their last collective before the interpreter finalizes (:func:`settle_backend_threads`,
  issue 65);
- the companion groups (:func:`companion_group`) are this module's: they are destroyed at exit (an
  ``atexit`` hook, before the interpreter finalizes; one with a collective of ours still in flight,
  after a :class:`~horovod_alq.core.protocol.CollectiveTimeout`, is left alone: destroying it would
  wait for that collective), by :func:`destroy_companions`, or by the user's
  ``dist.destroy_process_group()`` (all groups), after which they are made again on next use.
  The group a front-end is given (default: the world) is the user's to destroy.
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
from ..exchange.topology import resolve_local_size

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
        self.collectives = 0  # collectives this transport started (metrics()["collectives"])

    def wait(self, work, name: str) -> None:
        """Wait for ``work`` (bounded by the timeout), raising its error if it failed."""
        wait_for(work.is_completed, self.timeout, name, self.scope)
        IN_FLIGHT.done(work)
        work.wait()

    def allgather(self, payload: torch.Tensor, sizes: Sequence[int], name: str):
        sizes = [int(s) for s in sizes]
        width = max(sizes) if sizes else 0
        src = _owned(payload.to(self.device).contiguous())
        if src.numel() != width:
            padded = torch.zeros(width, dtype=torch.uint8, device=self.device)
            padded[: src.numel()] = src
            src = padded
        out = torch.empty(width * self.size, dtype=torch.uint8, device=self.device)
        work = self._started(_ALL_GATHER(out, src, group=self.group, async_op=True))

        def result() -> torch.Tensor:
            if all(s == width for s in sizes):
                return out
            return torch.cat([out[r * width : r * width + s] for r, s in enumerate(sizes)])

        return _Pending(self, work, result, name)

    def alltoall(self, payload: torch.Tensor, splits: Sequence[int], received: Sequence[int], name: str):
        out = torch.empty(sum(int(r) for r in received), dtype=torch.uint8, device=self.device)
        work = dist.all_to_all_single(
            out,
            _owned(payload.to(self.device).contiguous()),
            output_split_sizes=[int(r) for r in received],
            input_split_sizes=[int(s) for s in splits],
            group=self.group,
            async_op=True,
        )
        return _Pending(self, self._started(work), lambda: out, name)

    def _allreduce(self, vec: np.ndarray, dtype, op, name: str) -> np.ndarray:
        t = torch.tensor(np.ascontiguousarray(vec, dtype=dtype), device=self.device)  # a copy: memory of its own
        self.wait(self._started(dist.all_reduce(t, op=op, group=self.group, async_op=True)), name)
        return t.cpu().numpy()

    def _started(self, work):
        """``work``, recorded as in flight on this transport's group until it completes."""
        self.collectives += 1
        IN_FLIGHT.add(self.group, work)
        return work

    def allreduce_sum(self, vec: np.ndarray, name: str) -> np.ndarray:
        return self._allreduce(vec, np.float64, dist.ReduceOp.SUM, name)

    def allreduce_max(self, vec: np.ndarray, name: str) -> np.ndarray:
        return self._allreduce(vec, np.int64, dist.ReduceOp.MAX, name)


def _owned(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a copy of it when its memory is not torch's own (``torch.from_numpy``: the backend
    thread that drops a finished collective would free it, and freeing NumPy's memory takes the GIL,
    which aborts the process once the interpreter finalizes)."""
    if t.device.type == "cpu" and not t.untyped_storage().resizable():
        return t.clone()
    return t


class _InFlight:
    """The collectives this module started and that have not completed, by process group (a work is
    dropped once waited for, or by the next start after it completed): what says whether a
    companion group can be destroyed at exit without waiting for a collective that will not end
    (one that a :class:`~horovod_alq.core.protocol.CollectiveTimeout` left behind)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._works: list[tuple[object, object]] = []

    def add(self, group, work) -> None:
        with self._lock:
            self._works = [(g, w) for g, w in self._works if not w.is_completed()]
            self._works.append((group, work))

    def done(self, work) -> None:
        """Forget ``work`` (completed): its tensors are not kept past their use."""
        with self._lock:
            self._works = [(g, w) for g, w in self._works if w is not work]

    def busy(self, group) -> bool:
        """Whether a collective of ours on ``group`` has not completed."""
        with self._lock:
            return any(g is group and not w.is_completed() for g, w in self._works)


IN_FLIGHT = _InFlight()


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
    (:func:`_at_exit`), waits until every one has returned (at most ``DRAIN_SECONDS``), then lets
    the backend threads run for ``RELEASE_SECONDS``.

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

    def add(self, future, callback: Callable) -> None:
        with self._lock:
            self.started += 1

        def run(f):
            try:
                return callback(f)
            finally:
                with self._lock:
                    self.finished += 1

        future.then(run)

    def drain(self) -> None:
        if not self.started:
            return
        deadline = time.monotonic() + self.DRAIN_SECONDS
        while self.finished < self.started and time.monotonic() < deadline:
            time.sleep(0.001)
        time.sleep(self.RELEASE_SECONDS)


_CALLBACKS = _BackendCallbacks()


def on_completion(work, callback: Callable) -> None:
    """Run ``callback(future)`` on a backend thread once the collective ``work`` completed, counted
    so that the interpreter's exit waits for it (:class:`_BackendCallbacks`)."""
    _CALLBACKS.add(work.get_future(), callback)


_COMPANIONS: dict[tuple[tuple[int, ...], int], object] = {}


def companion_group(process_group=None, index: int = 1):
    """The ``index``-th other process group with the members of ``process_group`` (made once per
    member set and index, by every member on first use, at the same point of their programs; again
    after ``dist.destroy_process_group()`` destroyed it): its collectives pair apart from the group's
    own, so collectives issued from completion callbacks keep one order (an exchange's stage ``k``
    runs on companion ``k``). This module's own: destroyed at exit or by :func:`destroy_companions`."""
    ranks = tuple(dist.get_process_group_ranks(process_group or dist.group.WORLD))
    group = _COMPANIONS.get((ranks, index))
    if group is None or not _registered(group):
        group = _COMPANIONS[ranks, index] = dist.new_group(list(ranks), use_local_synchronization=True)
    return group


def destroy_companions() -> int:
    """Destroy the companion groups this module made (:func:`companion_group`) that torch.distributed
    still knows and that have no collective of ours in flight; returns how many. Local, not a
    collective. Runs at exit by itself; call it to release them earlier (after the last step of every
    front-end over their ranks: a later step makes them again, on every rank alike)."""
    done = 0
    for key, group in list(_COMPANIONS.items()):
        if not _registered(group):  # the user's dist.destroy_process_group() destroyed it
            del _COMPANIONS[key]
        elif not IN_FLIGHT.busy(group):
            dist.destroy_process_group(group)
            del _COMPANIONS[key]
            done += 1
    return done


def _registered(group) -> bool:
    """Whether torch.distributed still knows ``group`` (not destroyed, not from an earlier init)."""
    if not dist.is_initialized():
        return False
    try:
        dist.get_process_group_ranks(group)
    except (ValueError, KeyError, RuntimeError):
        return False
    return True


def _local_size(process_group, rank: int, size: int) -> int:
    """The ranks per node of a group (see :class:`DistTransport`): torchrun's ``LOCAL_WORLD_SIZE`` and
    ``LOCAL_RANK`` for the world group (:func:`~horovod_alq.exchange.topology.resolve_local_size`)."""
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
        self._stop = threading.Event()

    def watch(self, settle: SettleOnce) -> None:
        if settle.seconds == float("inf"):
            return
        with self._lock:
            self._watched.append((time.monotonic() + settle.seconds, settle))
            if self._thread is None:
                self._stop.clear()
                self._thread = threading.Thread(target=self._run, name="horovod-alq-watchdog", daemon=True)
                self._thread.start()

    def stop(self) -> None:
        """End the thread and wait for it (at exit: it may be failing a future, in C++, when the
        interpreter finalizes); a later :meth:`watch` starts another."""
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._stop.set()
            thread.join(timeout=2 * self.PERIOD + 1)

    def _run(self) -> None:
        while not self._stop.wait(self.PERIOD):
            now = time.monotonic()
            with self._lock:
                due = [s for d, s in self._watched if d <= now and not s.settled]
                self._watched = [(d, s) for d, s in self._watched if d > now and not s.settled]
            for settle in due:
                settle.expire()


WATCHDOG = Watchdog()

#: The process group backends' worker threads (named by torch: ``pt_gloo_runloop``,
#: ``pt_nccl_watchdg``, ...) and gloo's transport loops.
BACKEND_THREADS = ("pt_", "gloo")


def settle_backend_threads(limit: float = 5.0, quiet: int = 3, period: float = 0.005) -> bool:
    """Wait, with the GIL released, until no backend thread of this process (:data:`BACKEND_THREADS`)
    is running or runnable in ``quiet`` successive looks ``period`` seconds apart; at most ``limit``
    seconds. Returns whether they settled (True where ``/proc`` cannot tell: not Linux).

    Why (issue 65): ``dist.destroy_process_group()`` joins no thread of a group that something still
    references (a group the program keeps in a variable; torch keeps the default group once
    ``torch._dynamo`` is imported, which any ``torch.optim`` optimizer does), so its worker threads
    live until the interpreter finalizes. A worker that completed a collective drops it a moment
    later, and with it the last C++ reference to tensors made in Python, which takes the GIL. If the
    main thread has begun to finalize by then, CPython ends that worker inside a ``noexcept``
    destructor and the process aborts ("terminate called without an active exception"), which a
    loaded machine makes likely when the program exits right after its last collective."""
    tasks = "/proc/self/task"
    if not os.path.isdir(tasks):
        return True
    deadline, calm = time.monotonic() + limit, 0
    while True:
        calm = calm + 1 if not _busy_backend_threads(tasks) else 0
        if calm >= quiet:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(period)


def _busy_backend_threads(tasks: str) -> list[str]:
    """The names of this process's backend threads that are running or runnable (state R)."""
    busy = []
    for tid in os.listdir(tasks):
        try:
            with open(f"{tasks}/{tid}/stat") as f:
                stat = f.read()
        except OSError:  # the thread ended
            continue
        name = stat[stat.find("(") + 1 : stat.rfind(")")]
        if name.startswith(BACKEND_THREADS) and stat[stat.rfind(")") + 2 :][:1] == "R":
            busy.append(name)
    return busy


@atexit.register
def _at_exit() -> None:
    """Before the interpreter finalizes: stop the watchdog, wait for the callbacks still running on
    backend threads, destroy the companion groups that have nothing in flight (where nothing else
    holds one, its threads are joined now, not while the interpreter finalizes), then wait until
    the backend threads of the groups still alive are idle (:func:`settle_backend_threads`)."""
    WATCHDOG.stop()
    _CALLBACKS.drain()
    try:
        destroy_companions()
    except Exception:  # noqa: BLE001 - at exit: a teardown that fails leaves the group to the process's end
        pass
    settle_backend_threads()
