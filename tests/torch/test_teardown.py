"""horovod_alq.torch.dist_transport's teardown (issue 56), on a gloo group of this process alone: no
tensor over NumPy's memory reaches a collective (a backend thread would free it with the GIL); the
collectives in flight are known per group; the companion groups are destroyed by
destroy_companions() (only those with nothing in flight), made again after the user's
dist.destroy_process_group(); the watchdog's thread stops and joins; at exit the backend's threads are
let settle (issue 65). The exit codes of real ranks
after an error: tests/torch/test_exit_codes.py."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from horovod_alq.torch import dist_transport as dt


def test_memory_of_numpy_is_copied_before_a_collective():
    over_numpy = torch.from_numpy(np.arange(6, dtype=np.float32))
    copied = dt._owned(over_numpy)
    assert copied is not over_numpy and copied.untyped_storage().resizable()
    assert torch.equal(copied, over_numpy)
    own = torch.arange(6, dtype=torch.float32)
    assert dt._owned(own) is own


def test_collectives_in_flight_are_known_per_group(group):
    transport = dt.DistTransport(group)
    got = transport.allreduce_max(np.array([3, 1], dtype=np.int64), "t.max")
    assert got.tolist() == [3, 1]
    pending = transport.allgather(torch.arange(4, dtype=torch.uint8), [4], "t.ag")
    assert pending().tolist() == [0, 1, 2, 3]
    assert not dt.IN_FLIGHT.busy(group)
    never = dt._InFlight()
    stuck = torch.futures.Future()  # a work that never completes stands for a collective left behind

    class Work:
        def is_completed(self):
            return stuck.done()

    never.add(group, Work())
    assert never.busy(group) and not never.busy(object())
    stuck.set_result(None)
    assert not never.busy(group)


def test_companion_groups_are_destroyed_and_made_again(group):
    first = dt.companion_group(group, 1)
    assert dt.companion_group(group, 1) is first and dt._registered(first)
    assert dt.destroy_companions() >= 1
    assert not dt._registered(first) and not dt._COMPANIONS
    again = dt.companion_group(group, 1)
    assert again is not first and dt._registered(again)
    dist.destroy_process_group(again)  # the user's teardown of that group: made again on next use
    third = dt.companion_group(group, 1)
    assert third is not again and dt._registered(third)
    t = torch.ones(2)
    dist.all_reduce(t, group=third)
    assert t.tolist() == [1.0, 1.0]
    assert dt.destroy_companions() == 1


def test_a_companion_with_a_collective_in_flight_is_left_alone(group, monkeypatch):
    companion = dt.companion_group(group, 1)
    monkeypatch.setattr(dt.IN_FLIGHT, "busy", lambda g: g is companion)
    assert dt.destroy_companions() == 0 and dt._registered(companion)
    monkeypatch.undo()
    assert dt.destroy_companions() == 1


def test_watchdog_thread_stops_and_starts_again():
    dog = dt.Watchdog()
    dog.watch(dt.SettleOnce(torch.futures.Future(), "w", "process group [0]", 60.0))
    thread = dog._thread
    assert thread is not None and thread.is_alive()
    dog.stop()
    assert not thread.is_alive() and dog._thread is None
    late = dt.SettleOnce(torch.futures.Future(), "late", "process group [0]", 0.1)
    dog.watch(late)
    try:
        late.future.wait()
    except Exception as err:  # noqa: BLE001 - the watchdog failed it: running again
        assert "did not complete within 0.1 s" in str(err)
    else:
        raise AssertionError("the restarted watchdog did not fail the late future")
    dog.stop()


def test_backend_threads_settle_after_a_collective(group):
    # issue 65: at exit the package waits until the groups' worker threads have dropped their works
    transport = dt.DistTransport(group)
    transport.allgather(torch.arange(4, dtype=torch.uint8), [4], "t.settle")()
    names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
    assert any(n.startswith("pt_gloo") for n in names), names  # the gloo group's workers are there
    start = time.monotonic()
    assert dt.settle_backend_threads(limit=5.0)
    assert time.monotonic() - start < 5.0


def test_a_busy_backend_thread_is_waited_for_then_given_up_on():
    stop = threading.Event()
    named = threading.Event()

    def spin() -> None:  # a thread the kernel names like a gloo worker, and that keeps running
        ctypes.CDLL(None).prctl(15, b"pt_test_busy")  # PR_SET_NAME
        named.set()
        while not stop.is_set():
            pass

    thread = threading.Thread(target=spin, daemon=True)
    thread.start()
    named.wait(5)
    try:
        start = time.monotonic()
        assert not dt.settle_backend_threads(limit=0.3, period=0.001)
        assert 0.3 <= time.monotonic() - start < 3.0
    finally:
        stop.set()
        thread.join()
    assert dt.settle_backend_threads(limit=5.0)


def test_exit_waits_for_a_backend_thread_still_dropping_a_collective():
    # issue 65: with mode "raw" (no exit hook) this program died by SIGABRT ("terminate called
    # without an active exception") in 3 of 3 runs here (its gloo worker is late on purpose, 1 s);
    # the package's exit hook waits for that worker
    worker = Path(__file__).resolve().parents[1] / "workers" / "late_release_exit.py"
    proc = subprocess.run(
        [sys.executable, str(worker), "package"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, (proc.returncode, proc.stdout, proc.stderr[-3000:])
    assert "main thread done" in proc.stdout and "worker dropped the work" in proc.stdout, proc.stdout
