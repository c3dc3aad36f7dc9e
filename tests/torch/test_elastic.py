"""Elastic Horovod: a compressor registered in hvd.elastic.TorchState survives a reset in the
middle of a round (real ranks; the reset is done as hvd.elastic.run does it)."""

import pytest
from multiproc import run_ranks

pytestmark = pytest.mark.multiproc


def test_reset_in_the_middle_of_a_round_restores_identical_levels():
    res = run_ranks("torch_elastic.py", np=2, launcher="gloo", timeout=300)
    for r in res:
        assert r["pending_before_reset"] and not r["pending_after"] and r["batch"] == 10
        # 10 committed steps = 10 exchanged rounds: the dropped round is not counted
        assert r["step"] == 10 and r["level_updates"] == 3
    assert res[0]["params"] == res[1]["params"] and res[0]["levels"] == res[1]["levels"]
