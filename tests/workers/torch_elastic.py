"""Worker for tests/torch/test_elastic.py: a compressor in hvd.elastic.TorchState across a reset.

What hvd.elastic.run does with the state on a HorovodInternalError, done by hand:
``state.restore()`` then, after the (here skipped) re-initialization, ``state.sync()``. Real
elastic resets under horovodrun are in test_elastic_reset.py (torch_elastic_reset.py); this one
needs only plain ``horovodrun --gloo``. The failure comes after every gradient was compressed and before the exchange (a
round in progress); rank 1 also scrambles its levels before the reset, which ``sync()`` must undo.
The ranks report their parameters, levels and counters.
"""

import hashlib

import horovod.torch as hvd
import numpy as np
import torch
from common import report

import horovod_alq.torch.elastic  # noqa: F401  (registers the compressor's state handler)
from horovod_alq.torch import ALQCompressor

STEPS, FAIL_AT = 10, 5

hvd.init()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
comp = ALQCompressor(bits=3, bucket_size=128, min_size=16, update_steps=(0, 3, 7), update_every=0, seed=1)
opt = hvd.DistributedOptimizer(
    torch.optim.SGD(model.parameters(), lr=0.05), named_parameters=model.named_parameters(), compression=comp
)
state = hvd.elastic.TorchState(model, opt, compressor=comp, batch=0)
state.sync()
failed = False
while state.batch < STEPS:
    g = torch.Generator().manual_seed(100 * state.batch + hvd.rank())
    x, y = torch.randn(16, 64, generator=g), torch.randint(0, 10, (16,), generator=g)
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()  # compresses every gradient
    if state.batch == FAIL_AT and not failed:
        failed = True
        pending_before = comp._engine.pending()
        opt._handles.clear()  # the stock optimizer's pending allreduces die with the reset
        state.restore()
        if hvd.rank() == 1:  # a rank that comes back with other levels: sync() must fix it
            comp._quantizer.set_levels(np.linspace(-1, 1, 8))
        state.sync()
        continue
    opt.step()
    state.batch += 1
    state.commit()

m = comp.metrics()
report(
    {
        "params": hashlib.sha1(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest(),
        "levels": m["levels"].tolist(),
        "step": m["step"],
        "level_updates": m["level_updates"],
        "pending_before_reset": pending_before,
        "pending_after": comp._engine.pending(),
        "batch": state.batch,
    }
)
