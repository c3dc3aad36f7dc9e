"""Preconditioned quantization (precondition=) through the Horovod PyTorch compressor under
hvd.DistributedOptimizer on 2 ranks: the compressor follows the optimizer Horovod builds, every
rank ends with the same parameters (allgather, two-phase with the entropy wire, bits="auto",
error feedback),
and a rank whose AdamW state differs raises on every rank, naming the scales, without a hang."""

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
    return run_ranks("precondition_hvd.py", np=2, launcher="mpi", timeout=400)


@pytest.mark.parametrize("case", ["allgather", "two-phase", "auto", "feedback"])
def test_identical_and_learning(ranks, case):
    for r in ranks:
        assert not r[case]["raised"], r[case]
    assert same(ranks, lambda r: r[case]["params"]) and same(ranks, lambda r: r[case]["digest"])
    first = ranks[0][case]
    assert first["followed"] and first["digest"] != 0
    assert first["scaled"] == [[4, 128], [128], [128, 32]]  # all but the 4-element bias (below min_size)
    assert first["loss_last"] < first["loss_first"], first


@pytest.mark.parametrize("case", ["allgather", "two-phase"])
def test_fused_scaling_is_the_unfused_one(ranks, case):
    """The compiled codec forms g * w inside its encode and the round divides its decode by w (the
    compressor hands the engine the gradient and w): the same parameters, bit for bit, as the
    compressor multiplying and dividing itself."""
    for r in ranks:
        fused, unfused = r[case], r[f"{case}-unfused"]
        assert fused["params"] == unfused["params"], (r["rank"], case)
        assert fused["fused"] > 0 and unfused["fused"] == 0, (fused["fused"], unfused["fused"])


def test_optimizer_state_mismatch_raises_on_every_rank(ranks):
    for r in ranks:
        m = r["mismatch"]
        assert m["raised"] and m["at"] == 3, (r["rank"], m)
        assert "preconditioning scales" in m["message"], m


def test_first_preconditioned_round_refits_the_levels(ranks):
    """Round 0 goes unscaled (AdamW has no second moment) and refits from g; round 1, the first
    preconditioned one, refits again (outside the schedule 0, 100, ...) from the statistics of
    g * w summed over the ranks: the same levels on every rank, those of a fit on the scaled
    statistics and not of one on the bare gradients; no refit after it."""
    assert_refits_after_preconditioning_begins(ranks)


def test_a_delayed_refit_comes_later_and_survives_a_resume(ranks):
    """Form(refit=2): the refit comes in round 3, two rounds after the first preconditioned one,
    from the statistics of g * w of round 3, and no other refit; with the compressor's, the
    optimizer's and the model's state saved after round 1 and loaded in place, rounds 2-5 again
    refit in round 3, alike."""
    assert_refits_after_preconditioning_begins(ranks, "refit_late", delay=2)


def test_a_16_bit_refit_round_fits_the_scaled_statistics(ranks):
    """compress="when-faster" chose 16 bits; a scheduled refit that falls on a 16-bit round (round 7)
    collects the statistics of g * w, as a quantized round would quantize them: the levels after it
    are the fit on the scaled statistics summed over the ranks, not on the bare gradients, and the
    same on every rank."""
    assert_sixteen_bit_refit_fits_the_scaled_statistics(ranks, 7)
