"""A collective enqueued while Horovod shuts down raises instead of hanging (worker:
tests/workers/torch_shutdown_enqueue.py).

Rank 1 leaves while rank 0 has a backlog of unmatched allreduces and keeps enqueueing. Unpatched
Horovod 0.28.1 with torch 2.13 deadlocked there: its background thread holds the process-set
table's lock and waits for the GIL to release the backlog's tensors, while the enqueue holds the GIL
and waits for that lock (scripts/install/patch_horovod.py, edit 4). This is the hang that an
elastic reset met when a peer failed during a round (tests/torch/test_elastic_reset.py).
"""

import pytest
from multiproc import run_ranks

pytestmark = pytest.mark.multiproc

BACKLOG = 2000  # reproduced the hang in 2 of 2 launches before the patch


@pytest.mark.parametrize("launcher", ["gloo", "mpi"])
def test_enqueue_during_shutdown_raises(launcher):
    r0, r1 = run_ranks("torch_shutdown_enqueue.py", np=2, launcher=launcher, args=[BACKLOG], timeout=120)
    assert r1 == {"rank": 1}
    assert r0["error"] is not None, r0  # Horovod refused a later enqueue: it shut down
    assert "shut down" in r0["error"].lower() or "shutdown" in r0["error"].lower(), r0["error"]
    assert r0["seconds"] < 100, r0  # refused well before the worker gives up (120 s)
