"""FrozenVarianceAdamW: torch's AdamW until the freeze, a fixed second moment after it, the freeze
kept when Horovod's DistributedOptimizer builds the optimizer again from its groups, and a
checkpoint that resumes bit for bit."""

import copy

import pytest
import torch

from horovod_alq.torch import FrozenVarianceAdamW


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 12), torch.nn.Tanh(), torch.nn.Linear(12, 3))


def _steps(model, opt, n, seed=1):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        x = torch.randn(8, 16, generator=g)
        opt.zero_grad()
        model(x).pow(2).sum().backward()
        opt.step()


def test_before_the_freeze_it_is_adamw():
    a, b = _model(), _model()
    kw = dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    _steps(a, torch.optim.AdamW(a.parameters(), **kw), 25)
    _steps(b, FrozenVarianceAdamW(b.parameters(), **kw, freeze_step=25), 25)
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6)


def test_after_the_freeze_the_second_moment_stays_and_the_step_is_linear():
    model = _model()
    opt = FrozenVarianceAdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.0, freeze_step=5)
    _steps(model, opt, 5)
    frozen = [opt.state[p]["exp_avg_sq"].clone() for p in model.parameters()]
    _steps(model, opt, 7, seed=2)
    assert all(torch.equal(v, opt.state[p]["exp_avg_sq"]) for v, p in zip(frozen, model.parameters()))
    # with v fixed, one step moves a parameter by lr * m / (sqrt(v / c) + eps) / (1 - b1^t): linear in m
    p = next(model.parameters())
    st, before = opt.state[p], p.detach().clone()
    p.grad = torch.randn_like(p)
    m = st["exp_avg"] * 0.9 + p.grad * 0.1
    t = st["step"] + 1
    want = before - 1e-2 * m / ((st["exp_avg_sq"] / (1 - 0.95**5)).sqrt() + 1e-8) / (1 - 0.9**t)
    for q in list(model.parameters())[1:]:
        q.grad = None
    opt.step()
    torch.testing.assert_close(p.detach(), want, rtol=1e-6, atol=1e-7)


def test_the_freeze_survives_a_rebuild_from_the_groups():
    """Horovod's DistributedOptimizer calls the class again with the groups (and no other
    argument): the freeze step travels in them, not in the instance."""
    model = _model()
    opt = FrozenVarianceAdamW(model.parameters(), lr=1e-3, freeze_step=30)
    rebuilt = FrozenVarianceAdamW(opt.param_groups)
    assert [g["freeze_step"] for g in rebuilt.param_groups] == [30]


def test_a_checkpoint_resumes_bit_for_bit():
    a = _model()
    opt = FrozenVarianceAdamW(a.parameters(), lr=1e-2, freeze_step=4)
    _steps(a, opt, 3)
    saved_model, saved_opt = {k: v.clone() for k, v in a.state_dict().items()}, copy.deepcopy(opt.state_dict())
    _steps(a, opt, 5, seed=3)
    b = _model(seed=9)
    b.load_state_dict(saved_model)
    opt_b = FrozenVarianceAdamW(b.parameters(), lr=1.0, freeze_step=99)  # the saved groups win
    opt_b.load_state_dict(saved_opt)
    _steps(b, opt_b, 5, seed=3)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"freeze_step": 0}, "freeze_step must be a positive int"),
        ({"freeze_step": "30"}, "freeze_step must be a positive int"),
        ({"freeze_step": True}, "freeze_step must be a positive int"),
        ({"betas": (0.9, 1.0)}, "betas must be two numbers"),
        ({"lr": -1.0}, "need lr >= 0"),
    ],
)
def test_bad_arguments_name_the_problem(kwargs, message):
    with pytest.raises(ValueError, match=message):
        FrozenVarianceAdamW(_model().parameters(), **kwargs)
