"""The torch preconditioner (horovod_alq.torch.precondition): w from AdamW, Adam (amsgrad) and
FrozenVarianceAdamW, from a callable; bad input refused naming the tensor; SGD refused; the state
of the optimizer that steps (Horovod's DistributedOptimizer builds a new one over the same groups)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from horovod_alq.core.precondition import Form, samples
from horovod_alq.core.precondition import adam_scale as numpy_scale
from horovod_alq.torch.optim import FrozenVarianceAdamW
from horovod_alq.torch.precondition import Preconditioner, adam_scale


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 2))


def _steps(model, opt, n=3):
    for i in range(n):
        opt.zero_grad()
        model(torch.randn(4, 8, generator=torch.Generator().manual_seed(i))).square().sum().backward()
        opt.step()


@pytest.mark.parametrize("kind", ["adamw", "adam-amsgrad", "frozen"])
def test_w_from_the_second_moment(kind):
    model = _model()
    opt = {
        "adamw": lambda p: torch.optim.AdamW(p, betas=(0.9, 0.95)),
        "adam-amsgrad": lambda p: torch.optim.Adam(p, betas=(0.9, 0.95), amsgrad=True),
        "frozen": lambda p: FrozenVarianceAdamW(p, betas=(0.9, 0.95), freeze_step=2),
    }[kind](model.parameters())
    form = Form(floor=0.1, prior=2.0)
    pre = Preconditioner(opt, form=form)
    pre.prepare(0)
    assert all(pre.scale(p) is None for p in model.parameters())  # before any step: the identity
    _steps(model, opt, 3)
    digest = pre.prepare(1)
    w = pre.scale(model[0].weight)
    st = opt.state[model[0].weight]
    t = 2 if kind == "frozen" else 3  # the frozen optimizer's v stopped after 2 steps
    v = st["max_exp_avg_sq" if kind == "adam-amsgrad" else "exp_avg_sq"] / (1 - 0.95**t)
    expect = numpy_scale(v.numpy(), form, 1e-8, n=samples(t, 0.95))
    np.testing.assert_allclose(w.numpy(), expect, rtol=1e-5)
    assert pre.prepare(1) == digest  # once per round
    _steps(model, opt, 1)
    assert (pre.prepare(2) == digest) == (kind == "frozen")  # a frozen v keeps w


def test_torch_and_numpy_forms_agree():
    v = torch.rand(1000) ** 4
    for form in (Form(), Form(floor=0.01, alpha=0.5, cap=8.0, prior=3.0)):
        np.testing.assert_allclose(
            adam_scale(v, form, 1e-8, 64, n=2.0).numpy(), numpy_scale(v.numpy(), form, 1e-8, 64, n=2.0), rtol=1e-5
        )


def test_sgd_and_other_optimizers_are_refused():
    model = _model()
    with pytest.raises(ValueError, match="SGD keeps no second moment"):
        Preconditioner(torch.optim.SGD(model.parameters(), lr=0.1))
    adamax = torch.optim.Adamax(model.parameters())  # betas, but no exp_avg_sq
    pre = Preconditioner(adamax, names=model.named_parameters())
    _steps(model, adamax, 1)
    with pytest.raises(ValueError, match="Adamax keeps no 'exp_avg_sq' for 0.weight"):
        pre.prepare(1)
    from horovod_alq.torch import QuantizedCompressor
    from horovod_alq.torch.ddp import ALQState
    from horovod_alq.torch.fsdp import ALQReduceScatter

    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    for make in (QuantizedCompressor, ALQState):
        with pytest.raises(ValueError, match="SGD's update is linear"):
            make(method="alq", precondition=sgd)
    with pytest.raises(ValueError, match="FSDP2 does not serve precondition=.*sharded"):
        ALQReduceScatter(method="alq", precondition=torch.optim.AdamW(model.parameters()))


@pytest.mark.parametrize(
    "fn, match",
    [
        (lambda p: torch.ones(p.numel() + 1), "has shape"),
        (lambda p: torch.zeros_like(p), "zeros or negative"),
        (lambda p: -torch.ones_like(p), "zeros or negative"),
        (lambda p: torch.full_like(p, float("nan")), "NaN"),
    ],
)
def test_bad_callable_scales_name_the_tensor(fn, match):
    model = _model()
    pre = Preconditioner(fn, parameters=model.parameters(), names=model.named_parameters())
    with pytest.raises(ValueError, match=f"precondition scale of 0.weight .*{match}"):
        pre.prepare(0)


def test_callable_needs_parameters_and_gives_w():
    model = _model()
    with pytest.raises(ValueError, match="needs parameters="):
        Preconditioner(lambda p: torch.ones_like(p))
    pre = Preconditioner(lambda p: torch.full_like(p, 2.0), parameters=model.parameters())
    pre.prepare(0)
    assert torch.equal(pre.scale(model[1].bias), torch.full((2,), 2.0))
    model(torch.randn(2, 8)).sum().backward()
    assert pre.for_gradient(model[1].weight.grad) is pre.scale(model[1].weight)
    assert pre.for_gradient(torch.zeros(3)) is None  # not a known parameter's gradient: unscaled


def test_follows_the_optimizer_that_steps_the_groups():
    """hvd.DistributedOptimizer makes an optimizer of a new class over the same parameter groups,
    with a state of its own: the preconditioner reads that one's state once it steps."""
    model = _model()
    base = torch.optim.AdamW(model.parameters())
    pre = Preconditioner(base)
    wrapped = type("AdamW", (torch.optim.AdamW,), {})(base.param_groups)
    _steps(model, wrapped, 2)
    assert not base.state and pre.optimizer is wrapped
    pre.prepare(0)
    assert pre.scale(model[0].weight) is not None


def test_w_is_kept_for_every_rounds_and_digest_matches_numpy():
    from horovod_alq.core.precondition import combine, digest

    model = _model()
    opt = torch.optim.AdamW(model.parameters())
    pre = Preconditioner(opt, form=Form(every=3))
    assert pre.prepare(0) == combine([0] * 4)  # no state yet: the identity, and again next round
    _steps(model, opt, 1)
    first = pre.prepare(1)  # the first w of block 0, from the state after one step
    assert first == combine(digest(pre.scale(p).numpy(), i) for i, p in enumerate(model.parameters()))
    _steps(model, opt, 1)
    assert pre.prepare(2) == first  # block 0 keeps it
    _steps(model, opt, 1)
    assert pre.prepare(3) != first  # block 1: computed again
