"""``compress="when-faster"`` on real ranks (tests/workers/speed_worker.py): the DDP hook and FSDP2's
reduce-scatter (torchrun) and the Horovod compressor (mpirun) on 2 and 4 ranks follow the default
schedule (its confirming trial moved to round 20) and switch to 16 bits and back mid-training, with
the same path and identical parameters on every rank after every step, the refit schedule going on
through the 16-bit steps, Horovod's 16-bit steps reducing exactly what ``hvd.Compression.fp16``
does and FSDP2's 16-bit calls exactly what a bf16 reduce-scatter does (quantizing nothing, keeping
the error-feedback buffers); ranks
built with different modes raise on every rank."""

from __future__ import annotations

import importlib.util

import pytest
from multiproc import run_ranks

pytestmark = pytest.mark.multiproc

STEPS, FLIP = 60, 30


_LAUNCHES: dict = {}  # (front-end, ranks) -> the ranks' reports (one launch each)


def _run(frontend: str, np_: int) -> list:
    """The training launch of ``frontend`` on ``np_`` ranks; on 2 ranks it goes on with a model
    whose last rank was built with another compress mode (its result under "mismatch")."""
    if frontend == "torch" and importlib.util.find_spec("horovod") is None:
        pytest.skip("Horovod is not installed")
    if (frontend, np_) not in _LAUNCHES:
        launcher = "mpi" if frontend == "torch" else "torchrun"
        args = [frontend, "--steps", STEPS, "--flip", FLIP, *(["--mismatch"] if np_ == 2 else [])]
        _LAUNCHES[frontend, np_] = run_ranks("speed_worker.py", np=np_, launcher=launcher, timeout=300, args=args)
    return _LAUNCHES[frontend, np_]


@pytest.mark.parametrize("np_", [2, 4])
@pytest.mark.parametrize("frontend", ["ddp", "fsdp", "torch"])
def test_switching_mid_training_keeps_every_rank_identical(frontend, np_):
    ranks = _run(frontend, np_)
    paths = ranks[0]["paths"]
    for r in ranks[1:]:
        assert r["paths"] == paths, "ranks took different paths"
        assert r["digests"] == ranks[0]["digests"], "parameters differ across ranks"
        assert r["levels"] == ranks[0]["levels"]
    # 2 rounds of warm-up, a trial of one unit (a clear difference), 16 bits, the confirming trial at
    # round 20, 16 bits until the drift check after the flip (round 32), its trial, then quantized
    unit = [True] * 2 + [False] * 4 + [True] * 2
    assert paths == [True] * 2 + unit + [False] * 10 + unit + [False] * 4 + unit + [True] * 20, paths
    m = ranks[0]["metrics"]
    assert m["compress_choice"] == "quantized" and m["compress_changes"] == 2 and m["compress_trials"] == 3, m
    assert m["step_time_quantized"] == pytest.approx(2.0) and m["step_time_16bit"] == pytest.approx(4.0), m
    assert m["rounds_16bit"] == paths.count(False) and m["step"] == STEPS, m
    # refits every 5 rounds go on in 16-bit steps too (statistics of every rank's own gradients)
    updates = ranks[0]["level_updates"]
    sixteen_refits = [i for i in range(1, STEPS) if updates[i] > updates[i - 1] and not paths[i]]
    assert sixteen_refits, (updates, paths)
    if frontend == "torch" and np_ == 2:  # every 16-bit step (refit rounds included) is Horovod's fp16
        for r in ranks:
            assert r["as_fp16"] == [True] * paths.count(False), r["as_fp16"]
    if frontend == "fsdp":  # a 16-bit backward quantizes nothing; a quantized one its 2 groups (fc1, fc2)
        calls = ranks[0]["calls"]
        added = [b - a for a, b in zip([0, *calls], calls)]
        assert added == [2 if q else 0 for q in paths], (added, paths)
        # error_feedback=True: a 16-bit backward keeps the buffers, a quantized one changes them
        errors = ranks[0]["errors"]
        kept = [errors[i] == errors[i - 1] for i in range(1, STEPS)]
        assert kept == [not q for q in paths[1:]], (kept, paths)


@pytest.mark.parametrize("np_", [2, 4])
def test_fsdp_sixteen_bit_calls_are_a_bf16_reduce_scatter(np_):
    """FSDP2's 16-bit calls, made directly: rounds 2-5 of 8 with warm-up 0; on 2 ranks (where a sum
    of two bfloat16 values is the same in any order) each output equals the bf16 reduction."""
    for r in _run("fsdp", np_):
        for key, got in r["sixteen"].items():
            assert got["rounds_16bit"] == 4 and got["step"] == 8 and len(got["equal"]) == 4, (key, got)
            if np_ == 2:
                assert all(got["equal"]), (key, got)


@pytest.mark.parametrize("frontend", ["ddp", "fsdp", "torch"])
def test_ranks_built_with_different_modes_raise_on_every_rank(frontend):
    for r in _run(frontend, 2):
        m = r["mismatch"]
        assert m["raised"] and "compress modes" in m["message"], m
