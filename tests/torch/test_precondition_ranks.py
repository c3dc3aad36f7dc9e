"""Preconditioned quantization (precondition=) through the DDP hook on 2 gloo ranks launched by
torchrun: identical parameters on every rank with each exchange, the entropy
wire, error feedback, bits="auto" and a callable's scales; a rank whose optimizer state differs raises on every
rank, naming the preconditioning scales, and none hangs."""

from __future__ import annotations

import pytest
from helpers import same
from multiproc import run_ranks

pytestmark = pytest.mark.multiproc


@pytest.fixture(scope="module")
def ranks():
    return run_ranks("precondition_ddp.py", np=2, launcher="torchrun", timeout=600)


@pytest.mark.parametrize("case", ["allgather", "two-phase", "entropy", "feedback+entropy", "auto", "callable"])
def test_identical_and_learning(ranks, case):
    assert same(ranks, lambda r: r["train"][case]["params"]), case
    assert same(ranks, lambda r: r["train"][case]["digest"]), case
    first = ranks[0]["train"][case]
    assert first["digest"] != 0
    # the quantized buckets went scaled: a callable's from the start, AdamW's once it has a second
    # moment (step 0's buckets: w = 1)
    scaled = first["scaled"]
    assert scaled and all(n > 0 for n in (scaled if case == "callable" else scaled[-3:])), scaled
    assert case == "callable" or scaled[0] == 0, scaled
    assert first["loss_last"] < first["loss_first"], first


def test_optimizer_state_mismatch_raises_on_every_rank(ranks):
    for r in ranks:
        m = r["mismatch"]
        assert m["raised"], (r["rank"], m)
        assert "preconditioning scales" in m["message"], m
