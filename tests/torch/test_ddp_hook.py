"""The DDP hook in this process (a gloo group of one rank): the future's tensor, dtypes, metrics
keys, state round trip and argument checks. The multi-rank behaviour: test_ddp_ranks.py."""

from __future__ import annotations

import io
import pickle

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from horovod_alq.torch import ALQCompressor
from horovod_alq.torch.ddp import ALQState, alq_hook


def _model(dtype=torch.float32):
    torch.manual_seed(0)
    return DDP(torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8)).to(dtype), bucket_cap_mb=0.01)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_one_rank_close_to_local_gradient(group, dtype):
    model = _model(dtype)
    reference = _model(dtype).module
    state = ALQState(method="alq", bits=8, bucket_size=64, seed=1, min_size=16)
    model.register_comm_hook(state, alq_hook)
    x = torch.randn(16, 64, dtype=dtype)
    model(x).square().sum().backward()
    reference(x).square().sum().backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        assert p.grad.dtype == dtype and p.grad.shape == q.grad.shape
        err = (p.grad.double() - q.grad.double()).norm() / q.grad.double().norm()
        assert err < 0.1, err  # 8 bits: a close, not exact, average of one rank
    m = state.metrics()
    assert m["step"] == 1 and m["calls"] >= 1


def test_metrics_keys_match_horovod_compressors(group):
    state = ALQState(method="amq", seed=0)
    assert set(state.metrics()) == set(ALQCompressor(seed=0).metrics())


def test_state_round_trip_and_checks(group):
    model = _model()
    state = ALQState(method="alq", bucket_size=64, seed=3, update_steps=(0,), min_size=16)
    model.register_comm_hook(state, alq_hook)
    model(torch.randn(4, 64)).sum().backward()
    saved = state.state_dict()
    other = ALQState(method="alq", bucket_size=64, seed=9)
    other.load_state_dict(saved)
    assert (other.levels == state.levels).all() and other.metrics()["step"] == 1 and other.seed == 3
    for method, bits in (("alq", 3), ("amq", 3), ("alq", "auto")):  # torch.load's default weights_only=True
        kept = ALQState(method=method, bits=bits, bucket_size=64, seed=3)
        buf = io.BytesIO()
        torch.save({"alq": kept.state_dict()}, buf)
        buf.seek(0)
        back = ALQState(method=method, bits=bits, bucket_size=64)
        back.load_state_dict(torch.load(buf)["alq"])
        assert (back.levels == kept.levels).all() and back.metrics()["multiplier"] == kept.metrics()["multiplier"]
    clone = pickle.loads(pickle.dumps(state))
    assert (clone.levels == state.levels).all() and clone.min_size == 16
    with pytest.raises(ValueError, match="other settings"):
        ALQState(method="alq", bucket_size=128).load_state_dict(saved)
    with pytest.raises(ValueError):
        ALQState(method="nope")
    with pytest.raises(ValueError):
        ALQState(exchange="ring")
    assert ALQState(method="terngrad").bits == 2
    auto = ALQState(method="amq", bits="auto", bit_budget=2.5, bucket_size=64)
    assert auto.bits == "auto" and auto.bit_budget == 2.5 and auto.metrics()["default_bits"] == 2
    with pytest.raises(ValueError, match="adaptive method"):
        ALQState(method="qsgdinf", bits="auto")


def test_nonfinite_bucket_comes_back_nan(group):
    model = _model()
    state = ALQState(method="qsgdinf", bucket_size=64, seed=0, min_size=16)
    model.register_comm_hook(state, alq_hook)
    model(torch.full((2, 64), float("inf"))).sum().backward()
    assert any(not torch.isfinite(p.grad).all() for p in model.parameters())
