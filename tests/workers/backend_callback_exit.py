"""Worker for tests/torch/test_backend_callbacks.py (one process, a gloo group of one rank): a
completion callback that is still in Python on gloo's thread when the main thread reaches the end of
the program, as the DDP hook's last bucket can be.

Usage: backend_callback_exit.py {counted,raw}. ``counted`` registers the callback with
``dist_transport.on_completion``; ``raw`` with the future's own ``then`` (the control: the process
usually dies at exit, SIGSEGV or SIGABRT).
"""

import sys
import tempfile
import time

import torch
import torch.distributed as dist

from horovod_alq.torch.dist_transport import on_completion

store = tempfile.mktemp(prefix="horovod-alq-store-")
dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
released = torch.futures.Future()


def callback(fut):
    released.set_result(None)  # the main thread goes on to exit now
    time.sleep(0.3)  # ... while this backend thread is still in Python


work = dist.all_reduce(torch.ones(4), async_op=True)
if sys.argv[1] == "counted":
    on_completion(work, callback)
else:
    work.get_future().then(callback)
released.wait()
print("main thread done", flush=True)
