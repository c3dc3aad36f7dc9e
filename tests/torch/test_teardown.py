"""horovod_alq.torch.dist_transport's teardown (issue 56), on a gloo group of this process alone: no
tensor over NumPy's memory reaches a collective (a backend thread would free it with the GIL); the
collectives in flight are known per group; the companion groups are destroyed by
destroy_companions() (only those with nothing in flight), made again after the user's
dist.destroy_process_group(); the watchdog's thread stops and joins. The exit codes of real ranks
after an error: tests/torch/test_exit_codes.py."""

from __future__ import annotations

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
