"""Worker for tests/torch/test_elastic_reset.py: a real elastic reset under ``horovodrun`` (Gloo,
elastic mode) with an ALQ compressor registered in ``hvd.elastic.TorchState``.

Usage: torch_elastic_reset.py MODE STEPS AT [HOSTS_FILE]

MODE "error": at batch AT, the process launched as rank 1 raises ``HorovodInternalError`` from a
gradient hook in the middle of backward (after the last layers' gradients were compressed, before
any decompress), so ``hvd.elastic.run`` restores the committed state, re-initializes Horovod and
syncs. Its reset callback then scrambles its levels and counters, which ``sync()`` must undo.

MODE "remove": after batch AT, rank 0 rewrites HOSTS_FILE (read by the discovery script) from
``localhost:2`` to ``localhost:1`` and waits for the driver's notification; the next ``commit()``
raises ``HostsUpdatedInterrupt`` and training goes on with rank 0 alone. The removed process is
aborted by Horovod in its re-initialization; its last report (made before each commit) stands.

Every process reports its events (starts of the training function, resets) and, per batch, a hash
of its parameters, the levels' fingerprint and the compressor's step counter.
"""

import hashlib
import sys
import time
from pathlib import Path

import horovod.torch as hvd
import numpy as np
import torch
from common import launcher_rank, report
from horovod.common.exceptions import HorovodInternalError

import horovod_alq.torch.elastic  # noqa: F401  (registers the compressor's state handler)
from horovod_alq.torch import ALQCompressor

MODE, STEPS, AT = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
HOSTS = Path(sys.argv[4]) if len(sys.argv) > 4 else None
ME = launcher_rank()  # fixed for the life of the process (hvd.rank() may change on a reset)

hvd.init()
torch.manual_seed(0)
model = torch.nn.Sequential(
    torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)
)
comp = ALQCompressor(bits=3, bucket_size=512, min_size=16, update_steps=(0, 3, 8), update_every=0, seed=1)
opt = hvd.DistributedOptimizer(
    torch.optim.SGD(model.parameters(), lr=0.05), named_parameters=model.named_parameters(), compression=comp
)
state = hvd.elastic.TorchState(model=model, optimizer=opt, compressor=comp, batch=0)

events, trace = [], {}
injected = {"done": False}


def snapshot() -> dict:
    m = comp.metrics()
    return {
        "params": hashlib.sha1(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest(),
        "fingerprint": str(comp._quantizer.fingerprint),
        "levels": m["levels"].tolist(),
        "step": m["step"],
        "level_updates": m["level_updates"],
    }


def round_state() -> dict:
    """The compressor's current round: tensors compressed, decompressed, and how it failed."""
    rnd = comp._engine._round
    return {
        "pending": comp._engine.pending(),
        "compressed": len(rnd.entries),
        "decompressed": sum(e.done for e in rnd.entries),
        "failure": None if rnd.failure is None else f"{type(rnd.failure).__name__}: {rnd.failure}"[:300],
    }


def fail_mid_backward(grad):
    """Rank 1, batch AT, once: raise while the round is half compressed (layers 2 and 4 are in)."""
    if MODE == "error" and ME == 1 and state.batch == AT and not injected["done"]:
        injected["done"] = True
        events.append({"event": "inject", "batch": state.batch, **round_state()})
        raise HorovodInternalError("injected by the test in the middle of backward")
    return grad


def on_reset():
    """After restore() and Horovod's re-initialization, before sync()."""
    events.append(
        {"event": "reset", "batch": state.batch, **round_state(), "rank": hvd.rank(), "size": hvd.size(), **snapshot()}
    )
    if MODE == "error" and ME == 1:  # come back diverged: sync() must replace this with rank 0's state
        comp._quantizer.set_levels(np.linspace(-1, 1, 8))
        comp._state.step += 7


model[0].weight.register_hook(fail_mid_backward)
state.register_reset_callbacks([on_reset])


@hvd.elastic.run
def train(state):
    events.append({"event": "start", "batch": state.batch, "rank": hvd.rank(), "size": hvd.size(), **snapshot()})
    while state.batch < STEPS:
        g = torch.Generator().manual_seed(1000 * state.batch + hvd.rank())
        x, y = torch.randn(16, 32, generator=g), torch.randint(0, 4, (16,), generator=g)
        opt.zero_grad()
        phase = "backward"
        try:
            torch.nn.functional.cross_entropy(model(x), y).backward()  # compresses every gradient
            phase = "step"
            opt.step()  # decompresses: the round's exchange
        except HorovodInternalError:  # a peer failed: this rank's round is still pending
            # in backward when Horovod has already shut down by the time a gradient hook enqueues
            # (the small biases go through Horovod's own allreduce), else in step()
            events.append({"event": "failed", "batch": state.batch, "phase": phase, **round_state()})
            raise
        state.batch += 1
        trace[state.batch] = {"rank": hvd.rank(), "size": hvd.size(), **snapshot()}
        if MODE == "remove" and state.batch == AT and hvd.rank() == 0 and hvd.size() == 2:
            HOSTS.write_text("localhost:1\n")
            deadline = time.monotonic() + 60
            while state._host_messages.empty() and time.monotonic() < deadline:
                time.sleep(0.1)  # the driver polls discovery every second, then notifies rank 0
        record("running")
        state.commit()


def record(outcome: str) -> None:
    """Report (again, every batch): a removed worker is aborted inside hvd.init() and cannot report later."""
    report(
        {
            "me": ME,
            "outcome": outcome,
            "batch": state.batch,
            "events": events,
            "trace": trace,
            "pending_at_end": comp._engine.pending(),
            "final": snapshot(),
        }
    )


train(state)
record("completed")
