"""Bounded waits for the TensorFlow compressors' own collectives (``timeout=``, docs/guides/horovod-tensorflow.md).

Horovod's TensorFlow collectives are op kernels with no handle to poll: eagerly the calling thread
blocks in the op until every rank issued it. :func:`bounded` therefore runs an eager collective on
a thread of its own and waits for it at most ``timeout`` seconds; then it raises
:class:`~horovod_alq.core.protocol.CollectiveTimeout` naming the collective. The collective itself
stays issued (Horovod cannot withdraw it): it completes if the other ranks issue it later (its
result is dropped), else ``hvd.shutdown()`` fails it. Inside ``tf.function`` the collective is a
node of the graph, run by TensorFlow's executor, which nothing in Python can interrupt or time:
there :func:`bounded` adds the op unchanged and the wait is Horovod's (unbounded; its stall
warnings, and ``HOROVOD_STALL_SHUTDOWN_TIME_SECONDS`` if set).
"""

from __future__ import annotations

import math
import threading
from typing import Callable, TypeVar

import tensorflow as tf

from ..core import protocol

T = TypeVar("T")


def scope_of(process_set) -> str:
    """A process set as the timeout message names it."""
    ranks = getattr(process_set, "ranks", None)
    return "global process set" if not ranks else f"process set {list(ranks)}"


def bounded(run: Callable[[], T], name: str, seconds: float, process_set) -> T:
    """``run()``, one Horovod collective named ``name``; eagerly its wait is bounded by ``seconds``
    (``inf``: no bound), in a graph it is not (see the module docstring). Errors of ``run()`` are
    raised as they are."""
    if not tf.executing_eagerly() or math.isinf(seconds):
        return run()
    box: dict = {}
    done = threading.Event()

    def target() -> None:
        try:
            box["out"] = run()
        except BaseException as err:  # noqa: BLE001 - re-raised in the calling thread
            box["err"] = err
        finally:
            done.set()

    threading.Thread(target=target, name=f"horovod_alq wait {name}", daemon=True).start()
    if not done.wait(seconds):
        raise protocol.timeout_error(name, seconds, scope_of(process_set))
    if "err" in box:
        raise box["err"]
    return box["out"]
