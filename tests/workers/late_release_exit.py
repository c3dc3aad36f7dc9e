"""Worker for tests/torch/test_teardown.py (one process, gloo groups of one rank): issue 65's abort
at exit, made deterministic. A gloo worker thread drops the last reference to a finished
collective's tensor (made in Python) while the main thread exits: a finalizer on that tensor keeps
the worker busy for a moment, the GIL released, as a worker that the scheduler runs late would be.

Usage: late_release_exit.py {package,raw}. ``package`` imports horovod_alq.torch.dist_transport,
whose exit hook waits for the backend's threads to settle; ``raw`` does not (the control: the
process dies with "terminate called without an active exception", SIGABRT).
"""

import sys
import tempfile
import threading
import time
import weakref

import torch
import torch.distributed as dist

if sys.argv[1] == "package":
    import horovod_alq.torch.dist_transport  # noqa: F401 - its exit hook

BUSY = 1.0  # seconds the worker stays busy once the main thread exits (whatever the machine's load)
MAIN = threading.main_thread()
on_worker = threading.Event()
exiting = threading.Event()


def late() -> None:
    """The tensor's finalizer: on gloo's worker thread, busy (runnable) once the main thread exits."""
    if threading.current_thread() is MAIN:
        return
    on_worker.set()
    exiting.wait()
    a, end = torch.randn(200, 200), time.monotonic() + BUSY
    while time.monotonic() < end:  # each op releases the GIL: the thread stays runnable, as a late one is
        a = torch.tanh(a @ a)
    print("worker dropped the work", flush=True)


store = tempfile.mktemp(prefix="horovod-alq-store-")
dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
checker = dist.new_group(backend="gloo")  # the program keeps it: its threads outlive the teardown
for attempt in range(200):  # until the worker, not this thread, drops the tensor (almost always the first)
    flag = torch.ones(1)
    weakref.finalize(flag, late)
    dist.all_reduce(flag, group=checker, async_op=True)  # the work is not kept: the worker holds it
    del flag
    if on_worker.wait(0.05):
        break
else:
    print("the worker never dropped the tensor", flush=True)
    sys.exit(5)
print("main thread done", flush=True)
exiting.set()
dist.destroy_process_group()
sys.exit(0)
