"""Worker for tests/torch/test_shutdown_enqueue.py (2 ranks, Horovod torch): rank 0 enqueues
collectives while its Horovod shuts down because rank 1 left.

Rank 0 first queues BACKLOG allreduces that rank 1 never matches, keeping its own references to
their tensors. With torch 2.13 every one of them, when Horovod's background thread drops its last
C++ reference at shutdown, releases the tensor's Python object, which takes the GIL. Horovod 0.28.1
does that while it holds its process-set table's lock, and its torch enqueue functions take that lock
while holding the GIL, so an enqueue made then waited forever (an elastic reset's flaky hang).
Rank 0 keeps enqueueing until Horovod refuses; it must get ``HorovodInternalError``, not hang.

Usage: torch_shutdown_enqueue.py BACKLOG
"""

import sys
import time

import horovod.torch as hvd
import torch
from common import report
from horovod.common.exceptions import HorovodInternalError

BACKLOG = int(sys.argv[1])

hvd.init()
RANK = hvd.rank()
hvd.allreduce(torch.zeros(1), name="ready")  # both ranks are up
if RANK == 1:
    time.sleep(2.0)  # rank 0 queues its backlog meanwhile
    hvd.shutdown()
    report({"rank": 1})
    sys.exit(0)

kept = [torch.full((4,), float(i)) for i in range(BACKLOG)]
handles = [hvd.allreduce_async(t, name=f"backlog.{i}") for i, t in enumerate(kept)]
start, probes, error = time.monotonic(), 0, None
while error is None and time.monotonic() - start < 120:
    try:
        hvd.allreduce_async(torch.ones(4), name=f"probe.{probes}")
        probes += 1
    except HorovodInternalError as exc:
        error = str(exc)
report({"rank": 0, "probes": probes, "error": error, "seconds": time.monotonic() - start})
