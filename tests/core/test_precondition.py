"""Preconditioned quantization's core (horovod_alq.core.precondition): the form of w, the checks of
a scale, the digest, the setting, and unbiasedness of decode(Q(g * w)) / w."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import assert_zero_mean

from horovod_alq.core.precondition import Form, adam_scale, check_scale, combine, digest, samples
from horovod_alq.core.quantizer import Quantizer
from horovod_alq.settings import Settings


def test_unbiased_after_scaling_back():
    """E[decode(Q(g * w)) / w] = g: 600 independent roundings of one heavy-tailed gradient with
    scales spread over four decades (so that the largest scaled coordinates dominate their
    buckets), the mean deviations tested at ALPHA (t statistics from the 600 draws)."""
    rng = np.random.default_rng(0)
    d, reps = 1024, 600
    g = (rng.standard_t(3, d) * 1e-3).astype(np.float32)
    w = (10.0 ** rng.uniform(-2, 2, d)).astype(np.float32)
    q = Quantizer("alq", 3, 256)
    q.adapt(q.statistics(g * w))
    draws = np.random.default_rng(1)
    dev = np.stack([q.decode(q.encode(g * w, draws)) / w - g for _ in range(reps)])
    # t statistics of sums over 32 coordinates (a coordinate alone may never take its rare level in
    # 600 draws, and a bucket's largest sits on level 1: zero variance), Bonferroni over the 32 sums
    assert_zero_mean(dev.reshape(reps, 32, -1).sum(2))
    assert_zero_mean(dev.sum(1, keepdims=True))


def test_lowers_the_error_adam_sees():
    """Coordinates of scales spread over four decades (Adam's sqrt(v)): with w = 1 / scale, the
    error weighted as Adam weighs it, sum (w e)^2, is several times smaller than plain ALQ's."""
    rng = np.random.default_rng(2)
    d = 8192
    scale = (10.0 ** rng.uniform(-4, 0, d)).astype(np.float32)
    g = (scale * rng.standard_normal(d)).astype(np.float32)
    w = 1 / scale
    errors = {}
    for name, x, back in (("plain", g, 1.0), ("pre", g * w, w)):
        q = Quantizer("alq", 3, 1024)
        q.adapt(q.statistics(x))
        draws = np.random.default_rng(3)
        errors[name] = np.mean([(((q.decode(q.encode(x, draws)) / back - g) * w) ** 2).sum() for _ in range(20)])
    assert errors["pre"] * 5 < errors["plain"], errors


def test_form_of_w():
    v = np.array([0.0, 1e-8, 1e-4, 1.0], np.float32)
    w = adam_scale(v, Form(floor=0.1))
    root = np.sqrt(v)
    np.testing.assert_allclose(w, 1 / (root + 0.1 * root.mean()), rtol=1e-6)
    assert np.all(np.isfinite(adam_scale(np.zeros(4, np.float32), Form(floor=0.0))))  # no division by 0
    half = adam_scale(v, Form(floor=0.1, alpha=0.5))
    np.testing.assert_allclose(half, np.sqrt(w), rtol=1e-6)
    capped = adam_scale(v, Form(floor=0.1, cap=4.0), bucket_size=2)
    for b in capped.reshape(2, 2):
        assert b.max() <= 4 * b.min() * (1 + 1e-6)
    # the prior pulls a young v_hat toward the tensor's mean, less and less as it holds more gradients
    young = adam_scale(v, Form(floor=0.1, prior=4.0), n=samples(1, 0.95))
    old = adam_scale(v, Form(floor=0.1, prior=4.0), n=samples(1000, 0.95))
    assert young.max() / young.min() < old.max() / old.min() <= w.max() / w.min() * (1 + 1e-6)
    assert abs(samples(1, 0.95) - 1.0) < 1e-12 and abs(samples(10**6, 0.95) - 39.0) < 1e-9


@pytest.mark.parametrize(
    "scale, match",
    [
        (np.ones(5), "shape"),
        (np.zeros((2, 3)), "zeros or negative"),
        (-np.ones((2, 3)), "zeros or negative"),
        (np.full((2, 3), np.nan), "NaN"),
        (np.full((2, 3), np.inf), "NaN or Inf"),
    ],
)
def test_bad_scales_are_refused_naming_the_tensor(scale, match):
    with pytest.raises(ValueError, match=f"precondition scale of x\\[1\\] .*{match}"):
        check_scale("x[1]", scale, (2, 3))
    assert check_scale("x", np.full(6, 2.0), (2, 3)).shape == (2, 3)


def test_digest_tells_scales_apart_cheaply():
    w = np.linspace(1, 2, 100_000, dtype=np.float32)
    other = w.copy()
    other[::2] *= 1.5  # a mis-loaded state differs almost everywhere
    assert digest(w, 0) == digest(w.copy(), 0)
    assert digest(w, 0) != digest(other, 0)
    assert digest(w, 0) != digest(w, 1)  # the tensor's place counts
    assert combine([digest(w, 0), digest(other, 1)]) == combine([digest(other, 1), digest(w, 0)])
    assert 0 < combine([]) < 2**62


def test_setting_refuses_what_has_no_second_moment():
    class Sgd:
        param_groups = [{"lr": 0.1, "momentum": 0.9}]

    class Adam:
        param_groups = [{"lr": 0.1, "betas": (0.9, 0.95), "eps": 1e-8}]

    with pytest.raises(ValueError, match="SGD's update is linear"):
        Settings(precondition=Sgd())
    with pytest.raises(ValueError, match="needs the parameters it scales"):
        Settings(precondition=lambda p: p)
    with pytest.raises(ValueError, match="precondition takes"):
        Settings(precondition="adam")
    adam = Adam()
    assert Settings(precondition=adam).precondition is adam
    for front_end in ("Horovod TensorFlow", "FSDP2", "DiLoCo", "mpi4py"):
        with pytest.raises(ValueError, match=f"{front_end} does not serve precondition="):
            Settings.of(None, front_end, precondition=adam)


@pytest.mark.parametrize(
    "bad",
    [{"floor": -1}, {"alpha": 2}, {"cap": 0.5}, {"start": 0}, {"prior": float("nan")}, {"every": 0}, {"refit": -1}],
)
def test_bad_forms_are_refused(bad):
    with pytest.raises(ValueError, match="precondition " + next(iter(bad))):
        Form(**bad)


def test_the_round_where_preconditioning_starts_refits():
    """RoundState.precondition_round: the round where w first departs from the identity collects
    for a refit outside the schedule (and the second quantizer's round after it), once; a state
    saved after it resumes without a second one."""
    from horovod_alq.core.rounds import RefitSchedule, RoundState

    def state():
        return RoundState(Quantizer("alq", 3, 256), RefitSchedule((0, 100), 0), adapt_second=True)

    st, collected, second = state(), [], []
    for step in range(6):
        st.precondition_round(12345, active=step >= 2)
        collected.append(st.collecting)
        second.append(st.collecting_second)
        st.step += 1
    assert collected == [True, False, True, False, False, False]
    assert second == [False, True, False, True, False, False]
    resumed = state()
    resumed.load_state_dict(st.state_dict())
    resumed.precondition_round(12345, active=True)
    assert not resumed.collecting and resumed.step == 6
    fresh = state()  # a state saved before preconditioning began holds no "precondition"
    assert "precondition" not in fresh.state_dict()


def test_a_delayed_refit_waits_for_its_round_and_survives_a_resume():
    """Form.refit=K: the refit comes K rounds after the first preconditioned round, not in it; a state
    saved between the two resumes with the refit still planned (and a state saved after it, with none
    to come); refit=None plans none."""
    from horovod_alq.core.rounds import RefitSchedule, RoundState

    def state():
        return RoundState(Quantizer("alq", 3, 256), RefitSchedule((0, 100), 0))

    def run(st, steps, refit):
        out = []
        for _ in range(steps):
            st.precondition_round(12345, active=st.step >= 1, refit=refit)
            out.append(st.collecting)
            st.step += 1
        return out

    assert run(state(), 8, 3) == [True, False, False, False, True, False, False, False]
    assert run(state(), 8, None) == [True] + [False] * 7
    first = state()
    assert run(first, 2, 3) == [True, False]  # saved at round 2: the refit (round 4) still to come
    resumed = state()
    resumed.load_state_dict(first.state_dict())
    assert run(resumed, 6, 3) == [False, False, True, False, False, False]
    again = state()
    again.load_state_dict(resumed.state_dict())
    assert run(again, 3, 3) == [False, False, False]
