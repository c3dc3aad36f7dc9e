"""Horovod's PyTorch synthetic benchmark with its compression line swapped for
``ALQCompressor(...)`` (tests/workers/dropin_torch_benchmark.py), on 2 real ranks."""

import pytest
from multiproc import run_ranks

pytestmark = pytest.mark.multiproc


@pytest.mark.parametrize("launcher", ["mpi", "gloo"])
def test_one_line_swap_in_the_pytorch_example(launcher):
    steps = 12
    r0, r1 = run_ranks("dropin_torch_benchmark.py", np=2, launcher=launcher, timeout=300, args=["--steps", steps])
    for r in (r0, r1):
        assert r["steps"] == steps and r["level_updates"] >= 1
        assert r["bits_per_coordinate"] < 4
    assert r0["digest"] == r1["digest"], "identical weights on both ranks"
    assert r0["losses"][-1] < r0["losses"][0]
