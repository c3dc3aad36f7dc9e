"""Error feedback under AMP, with a real ``torch.amp.GradScaler`` on CPU and the DDP hook in this
process (a gloo group of one rank): the buffers are kept in unscaled units (runs at loss scales
2^10 and 2^11 keep bit-identical buffers: powers of two scale exactly), and a step the scaler skips
(one parameter's gradient is Inf) leaves every buffer, the finite ones too, as it was."""

from __future__ import annotations

import math

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from horovod_alq.torch.ddp import ALQState, alq_hook


def _run(init_scale: float, steps: int, inf_at: int | None = None):
    """A small model under DDP + the ALQ hook with error feedback; each step's saved buffers
    (unscaled) and whether the scaler took the step."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))
    model = DDP(net, bucket_cap_mb=0.01)
    state = ALQState(method="alq", bits=2, bucket_size=64, seed=1, min_size=16, error_feedback=True)
    model.register_comm_hook(state, alq_hook)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=1000)
    state.use_grad_scaler(scaler)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    poison = {"on": False}
    net[2].bias.register_hook(lambda g: torch.full_like(g, math.inf) if poison["on"] else g)
    saved, taken = [], []
    g = torch.Generator().manual_seed(5)
    for step in range(steps):
        x = torch.randn(32, 64, generator=g)
        poison["on"] = step == inf_at
        opt.zero_grad()
        scaler.scale(model(x).square().mean()).backward()
        before = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        taken.append(scaler.get_scale() >= before)
        saved.append({tuple(k): v.clone() for k, v in state.state_dict()["error_feedback"]["buffers"]})
    return saved, taken


def test_buffers_are_kept_in_unscaled_units(group):
    low, _ = _run(2.0**10, 3)
    high, _ = _run(2.0**11, 3)
    assert low[-1] and sorted(low[-1]) == sorted(high[-1])
    for step, (a, b) in enumerate(zip(low, high)):
        for key in a:
            torch.testing.assert_close(a[key], b[key], rtol=0, atol=0, msg=lambda m: f"step {step} {key}: {m}")


def test_a_skipped_step_leaves_every_buffer_unchanged(group):
    saved, taken = _run(2.0**10, 4, inf_at=2)
    assert taken == [True, True, False, True]
    before, after = saved[1], saved[2]
    assert sorted(before) == sorted(after) and len(before) > 1
    for key in before:
        torch.testing.assert_close(after[key], before[key], rtol=0, atol=0, msg=lambda m: f"{key}: {m}")
    changed = [k for k in before if not torch.equal(saved[3][k], before[k])]
    assert changed, "the next step's errors are kept again"


def test_use_grad_scaler_takes_a_scaler_only(group):
    state = ALQState(method="alq", bits=2, error_feedback=True)
    with pytest.raises(ValueError, match="takes a torch.amp.GradScaler, got float"):
        state.use_grad_scaler(1024.0)
