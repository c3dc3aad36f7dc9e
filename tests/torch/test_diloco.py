"""DiLoCo outer steps (horovod_alq.torch.diloco) on 2 and 3 gloo ranks launched by torchrun:
parameters identical on every rank after each outer step and different between them, loss falls,
the pseudo-gradient exchange is unbiased (both exchanges, error feedback off), a resumed run takes
the same next outer steps bit for bit, and a rank with another sync_every, method, bits, outer_lr or
initial parameters raises on every rank at the first outer step instead of hanging."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import assert_t_unbiased, same
from multiproc import run_ranks

pytestmark = pytest.mark.multiproc


@pytest.fixture(scope="module", params=[2, 3], ids=["np2", "np3"])
def ranks(request):
    return run_ranks("diloco_worker.py", np=request.param, launcher="torchrun", timeout=600)


def test_identical_after_outer_steps_and_learning(ranks):
    for name, first in ranks[0]["train"].items():
        assert len(first["after_outer"]) == 6 and first["outer_steps"] == 6 and first["inner_steps"] == 24, name
        for k in range(6):
            assert same(ranks, lambda r: r["train"][name]["after_outer"][k]), (name, k)
        for k in range(len(first["after_inner"])):  # the ranks' own data: they differ between outer steps
            assert len({r["train"][name]["after_inner"][k] for r in ranks}) == len(ranks), (name, k)
        assert same(ranks, lambda r: r["train"][name]["levels"]), name
        assert first["loss_last"] < 0.8 * first["loss_first"], (name, first)
        assert first["step"] == 6 and first["level_updates"] == 4, (name, first)  # refits after 0, 1, 2, 5
        assert first["uncompressed_coordinates"] == 6 * (64 + 64 + 4) and first["plain_bytes_sent"] > 0, name
    train = ranks[0]["train"]
    assert train["allgather+ef"]["exchange"] == "allgather" and train["two-phase"]["exchange"] == "two-phase"
    assert 2.0 < train["allgather+ef"]["bits_per_coordinate"] < 2.3  # 2 bits + 32/256 + headers
    assert train["auto"]["bits_per_coordinate"] < 2.8


def test_unbiased(ranks):
    for exchange, u in ranks[0]["unbiased"].items():
        assert u["exchange"] == exchange
        assert_t_unbiased(u, what=exchange)
        assert u["rel_error"] < 1.0, u  # a quantized average, not noise
        assert same(ranks, lambda r: r["unbiased"][exchange]["digest"])


def test_entropy_wire_takes_the_same_outer_steps_for_fewer_bytes(ranks):
    """wire="entropy": the outer steps of the fixed wire's run, bit for bit (the same seed), for fewer
    bytes."""
    for exchange in ("allgather", "two-phase"):
        plain, e = (ranks[0]["entropy"][f"{exchange}|{wire}"] for wire in ("fixed", "entropy"))
        assert e["step_digests"] == plain["step_digests"], exchange
        fixed, coded = e["wire_bytes"]
        assert 0 < coded < fixed and plain["wire_bytes"] == [0, 0], (exchange, e["wire_bytes"])
        assert same(ranks, lambda r: r["entropy"][f"{exchange}|entropy"]["digest"])


@pytest.mark.parametrize("exchange", ["allgather", "two-phase"])
def test_error_feedback_telescopes(ranks, exchange):
    """Sum over T outer steps of the decoded average + the mean of the ranks' last error buffers
    = T x the exact average (float32 rounding only); without the buffers, off by 2-bit noise. The
    shared error_feedback setting: two-phase too (the owners keep the second quantization's error)."""
    runs = [r["feedback"][exchange] for r in ranks]
    assert runs[0]["exchange"] == exchange
    c = np.mean([np.asarray(f["c"], dtype=np.float64) for f in runs], axis=0)
    total = np.asarray(runs[0]["total"])
    assert same(ranks, lambda r: r["feedback"][exchange]["total"])
    error = np.mean([np.asarray(f["error"]) for f in runs], axis=0)
    steps = runs[0]["steps"]
    scale = np.abs(c).mean()
    assert np.abs(total + error - steps * c).max() < 1e-4 * steps * scale
    assert np.abs(error).mean() > 0.05 * scale  # the buffers carry real quantization error
    # each rank's buffer is its own codes' error (about one 2-bit cell: 0.98 x mean |c| measured on rank 0),
    # not the ranks' spread around the average, which would pile up over the steps (about 20x here)
    for f in runs if exchange == "allgather" else []:
        own, mine = np.asarray(f["error"]), np.asarray(f["c"], dtype=np.float64)
        assert np.abs(own).mean() < 2.0 * np.abs(mine).mean()


def test_resume_takes_the_same_outer_step(ranks):
    for r in ranks:
        res = r["resume"]
        assert len(res["first"]) == 2 and res["first"] == res["again"], res
        assert res["outer_steps"] == 4
    assert same(ranks, lambda r: r["resume"]["again"])


@pytest.mark.parametrize("which", ["sync_every", "method", "bits", "outer_lr", "global_parameters"])
def test_mismatch_raises_on_every_rank(ranks, which):
    size = len(ranks)
    for r in ranks:
        res = r["mismatch"][which]
        assert res["raised"], (which, r["rank"], res)
        assert res["message"].startswith("ValueError: horovod_alq: ") and "alq: horovod_alq" not in res["message"], res
        assert res["inner_steps"] == (3 if which == "sync_every" and r["rank"] == size - 1 else 2), res
    text = ranks[0]["mismatch"][which]["message"]
    if which in ("sync_every", "outer_lr", "global_parameters"):  # DiLoCo's own fields: only the one that differs
        assert f"DiLoCo settings differ: {which} (rank 0: " in text and text.count("(rank 0: ") == 1, text
    else:
        assert which in text, text


@pytest.mark.parametrize("exchange", ["allgather", "two-phase"])
@pytest.mark.parametrize("where", ["nan-weight", "inf-bias"])
def test_a_non_finite_average_raises_on_every_rank_and_writes_nothing(ranks, where, exchange):
    """The last rank's parameters go NaN (a quantized weight) or Inf (a bias that travels plain)
    between outer steps: every rank raises ValueError naming the parameter at that outer step, and
    the global parameters and momentum stay as the previous outer step left them, finite."""
    size = len(ranks)
    name = "fc2.weight" if where == "nan-weight" else "fc3.bias"
    for r in ranks:
        res = r["nonfinite"][f"{where}|{exchange}"]
        assert res["raised"], (r["rank"], res)
        text = res["message"]
        assert text.startswith("ValueError: horovod_alq: DiLoCo outer step 1: the averaged pseudo-gradient"), text
        assert f"NaN or Inf in {name}" in text and "no outer step was taken" in text, text
        own = "NOT finite" if r["rank"] == size - 1 else "finite"
        assert f"own pseudo-gradient is {own} " in text, text
        assert res["unchanged"] and res["finite"] and res["outer_steps"] == 1, res
