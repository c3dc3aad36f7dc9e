"""Preconditioned quantization (precondition=) through the DDP hook on 2 gloo ranks launched by
torchrun: identical parameters on every rank with each exchange, the entropy
wire, error feedback, bits="auto" and a callable's scales; a rank whose optimizer state differs raises on every
rank, naming the preconditioning scales, and none hangs."""

from __future__ import annotations

import pytest
from helpers import (
    assert_refits_after_preconditioning_begins,
    assert_sixteen_bit_refit_fits_the_scaled_statistics,
    same,
)
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


@pytest.mark.parametrize("exchange", ["allgather", "two-phase"])
def test_fused_scaling_is_the_unfused_one(ranks, exchange):
    """The compiled codec forms g * w inside its encode and divides its decode by w (the DDP hook
    hands it the bucket and w): the same parameters, bit for bit, as the hook multiplying and
    dividing itself."""
    for r in ranks:
        fused, unfused = r["train"][exchange], r["train"][f"{exchange}-unfused"]
        assert fused["params"] == unfused["params"], (r["rank"], exchange)
        assert fused["fused"] > 0 and unfused["fused"] == 0, (fused["fused"], unfused["fused"])


def test_optimizer_state_mismatch_raises_on_every_rank(ranks):
    for r in ranks:
        m = r["mismatch"]
        assert m["raised"], (r["rank"], m)
        assert "preconditioning scales" in m["message"], m


def test_first_preconditioned_step_refits_the_levels(ranks):
    """Step 0's buckets go unscaled (AdamW has no second moment) and refit the levels; step 1, the
    first preconditioned one, refits again (outside the schedule 0, 10) from the statistics of the
    scaled buckets summed over the ranks: the same levels on every rank, those of a fit on the
    scaled statistics and not of one on the bare buckets; no refit after it."""
    assert_refits_after_preconditioning_begins(ranks)


def test_a_delayed_refit_comes_later_and_survives_a_resume(ranks):
    """Form(refit=2): the refit comes at step 3, two steps after the first preconditioned one, from
    the statistics of the scaled buckets of step 3, and no other refit; with the hook's, the
    optimizer's and the model's state saved after step 1 and loaded in place, steps 2-5 again
    refit at step 3, alike."""
    assert_refits_after_preconditioning_begins(ranks, "refit_late", delay=2)


def test_a_16_bit_refit_step_fits_the_scaled_statistics(ranks):
    """compress="when-faster" chose 16 bits; a scheduled refit that falls on a 16-bit step (step 7)
    collects the statistics of the scaled buckets, as a quantized step would quantize them: the
    levels after it are the fit on those statistics summed over the ranks, not on the bare buckets,
    and the same on every rank."""
    assert_sixteen_bit_refit_fits_the_scaled_statistics(ranks, 7)
