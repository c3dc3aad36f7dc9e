"""FSDP2's reduce-scatter with the adaptive quantizers (horovod_alq.torch.fsdp) on 2 and 3 gloo
ranks launched by torchrun: called directly as FSDP calls it, it is unbiased for AVG, SUM and
PREMUL_SUM and leaves the right shard on each rank; fully_shard training learns like FSDP's own
reduce-scatter, with identical parameters and levels on every rank and refits at the scheduled
steps; bfloat16 reduction and a divide factor; checkpoint round trip; NaN stays in its bucket; bad
input and a rank with other settings raise on every rank; bytes on the wire (N = 2, 3, 4); HSDP
(2 replicas x 2 shards)."""

from __future__ import annotations

import pytest
from helpers import assert_t_unbiased, same
from multiproc import run_ranks

from horovod_alq.core.wire import HEADER_SIZE

pytestmark = pytest.mark.multiproc

METHODS = ("alq", "amq", "qsgdinf", "terngrad")


@pytest.fixture(scope="module", params=[2, 3], ids=["np2", "np3"])
def ranks(request):
    return run_ranks(
        "fsdp_worker.py",
        np=request.param,
        launcher="torchrun",
        timeout=600,
        args=["--methods", ",".join(METHODS), "--steps", "30", "--reps", "60"],
    )


def test_training_identical_and_learning(ranks):
    base = ranks[0]["train"]["fsdp"]
    for name in ("fsdp", *METHODS):
        first = ranks[0]["train"][name]
        assert same(ranks, lambda r: r["train"][name]["params"]), name
        assert first["loss_last"] < 0.7 * first["loss_first"], (name, first)
        if name == "fsdp":
            continue
        assert same(ranks, lambda r: r["train"][name]["levels"]), name
        assert first["step"] == 30 and first["exchange"] == "reduce-scatter", first
        # 3 FSDP groups (fc1, fc2, fc3) per backward, every one compressed (min_size 64)
        assert first["calls"] == 90 and first["uncompressed"] == 0, first
        assert first["level_updates"] == (2 if name in ("alq", "amq") else 0), (name, first)
        # within a noise margin of FSDP's own reduce-scatter (the same data and initial model)
        assert first["loss_last"] < base["loss_last"] + 0.25 * (base["loss_first"] - base["loss_last"]), (name, first)
    assert 3.0 < ranks[0]["train"]["alq"]["bits_per_coordinate"] < 3.4  # 3 bits + 32/256 + headers
    assert 2.0 < ranks[0]["train"]["terngrad"]["bits_per_coordinate"] < 2.4


def test_auto_bits_a_width_per_parameter_chunk(ranks):
    """bits="auto" (budget 2.5): every rank allocates alike, a width per parameter chunk of every
    shard (the layouts quantize_reduce_scatter recorded for fc1, fc2, fc3), within the budget;
    training learns with identical parameters and levels; direct calls whose shards mix widths
    are unbiased (per chunk bucket, Bonferroni at 1e-6)."""
    n = ranks[0]["size"]
    auto = ranks[0]["train"]["alq/auto"]
    for key in ("params", "allocation", "levels"):
        assert same(ranks, lambda r: r["train"]["alq/auto"][key]), key
    assert [len(sizes) for _, sizes in auto["layouts"]] == [2, 2, 2]  # weight and bias of each layer
    assert len(auto["allocation"]) == 3 * 2 * n and auto["allocated_mean_bits"] <= 2.5 + 1e-9, auto
    assert auto["level_updates"] == 2 and auto["loss_last"] < 0.7 * auto["loss_first"], auto
    assert same(ranks, lambda r: r["unbiased_auto"]["allocation"])
    for r in ranks:
        u = r["unbiased_auto"]
        assert len(u["allocation"]) == 4 * n and len(set(u["allocation"])) > 1, u
        assert_t_unbiased(u, ("t_buckets_max",))
        assert u["call_bytes"] == _auto_wire(u["pieces"], u["allocation"], 64), u  # the wire follows it


def _auto_wire(pieces, widths, bucket):
    """A call's payload bytes: each shard holds the P pieces in order (``widths``: shard by shard),
    and is one payload per run of one width (adjacent pieces of one width are one run, a run never
    crosses into the next shard)."""
    from horovod_alq.core.wire import payload_size

    total = 0
    for j in range(len(widths) // len(pieces)):
        runs = []
        for k, w in zip(pieces, widths[j * len(pieces) : (j + 1) * len(pieces)]):
            runs[-1:] = [(runs[-1][0] + k, w)] if runs and runs[-1][1] == w else runs[-1:] + [(k, w)]
        total += sum(payload_size(k, w, bucket) for k, w in runs)
    return total


def test_unbiased_right_shard(ranks):
    for r in ranks:
        for op, u in r["unbiased"].items():
            assert u["exchange"] == "reduce-scatter" and u["step"] == u["reps"] + 1, u  # a round per call
            assert u["level_updates"] == 1, u
            assert_t_unbiased(u, what=op)
            # against this rank's shard of the exact reduction: a quantized estimate, not another shard
            assert u["rel_error"] < 1.0, (op, u)


def test_rank_stopped_mid_backward_raises_on_every_waiting_rank(ranks):
    """Issue 21: a rank that stops in the middle of a backward leaves the others waiting in our
    reduce-scatter; they raise CollectiveTimeout naming it after the comm's timeout (3 s here)."""
    *waiting, stopped = (r["stalled"] for r in ranks)
    assert stopped["raised"] and "injected" in stopped["message"], stopped
    for s in waiting:
        assert s["raised"], s
        assert "CollectiveTimeout" in s["message"] and "fsdp" in s["message"], s["message"]
        assert s["timeout"] <= s["seconds"] < s["timeout"] + 30, s


def test_wire_bytes(ranks):
    for r in ranks:
        _check_wire(r["wire"], r["size"])


def test_four_ranks_wire_bytes_and_hsdp():
    res = run_ranks("fsdp_worker.py", np=4, launcher="torchrun", timeout=300, args=["--only", "wire+hsdp"])
    for r in res:
        _check_wire(r["wire"], 4)
    # HSDP, 2 replicas x 2 shards: one model on all 4 ranks; levels agreed within each shard group
    assert same(res, lambda r: r["hsdp"]["params"])
    for r in res:
        h = r["hsdp"]
        assert h["step"] == 6 and h["level_updates"] == 2 and h["losses"][-1] < h["losses"][0], h
        mates = [res[k]["hsdp"] for k in h["shard_group"]]
        assert len(mates) == 2 and same(mates, lambda m: m["levels"]), h["shard_group"]


def _check_wire(w, n):
    b, d = w["bits"], w["bucket"]
    per_coordinate = 8 * w["bytes_sent"] / w["coordinates"]
    ideal = (n - 1) / n * (b + 32 / d)
    headers = 8 * (n - 1) * HEADER_SIZE / w["coordinates"]
    assert ideal <= per_coordinate <= 1.02 * ideal + headers, (per_coordinate, ideal, w)
    assert w["bytes_sent"] == w["bytes_received"] == (n - 1) * w["payload"], w


def test_special_inputs(ranks):
    for r in ranks:
        s = r["special"]
        # rank 0 put a NaN in the first bucket of shard 1: only rank 1's first bucket is NaN
        assert s["nan_buckets"] == [r["rank"] == 1] + [False] * 3, s
        assert s["bf16_dtype"] == "torch.bfloat16" and s["bf16_rel"] < 1.0, s
        assert s["small_exact"] and s["uncompressed"] > 0, s
        assert s["step"] == 2, s  # the two quantized calls; the small one is no round
        assert "MAX" in s["errors"]["op"] and "AVG" in s["errors"]["op"], s
        assert s["errors"]["sizes"].startswith("ValueError") and "513" in s["errors"]["sizes"], s
        assert s["errors"]["dtype"].startswith("TypeError") and "torch.int32" in s["errors"]["dtype"], s


def test_mixed_precision(ranks):
    for r in ranks:
        m = r["mixed"]
        assert m["finite"] and m["step"] == 6 and m["losses"][-1] < m["losses"][0], m
    assert same(ranks, lambda r: r["mixed"]["levels"])


def test_checkpoint_round_trip(ranks):
    for r in ranks:
        c = r["checkpoint"]
        assert c["first"] == c["second"], c  # same parameters, levels and counters after resuming
        assert c["restored"] == c["levels_saved"] != c["first"]["levels"]  # the refit of step 10
        assert c["clone_levels"] == c["second"]["levels"] and c["clone_step"] == 14  # pickle round trip
        assert "other settings" in c["wrong_method"]
    assert same(ranks, lambda r: r["checkpoint"]["first"])


def test_other_settings_raise_on_every_rank(ranks):
    for r in ranks:
        m = r["mismatch"]
        assert m["bits"] is not None and "bits" in m["bits"], m
        assert m["min_size"] is not None and "min_size" in m["min_size"], m
        assert m["budget"] is not None and "bit_budget" in m["budget"], m
        # bits="auto" with layouts recorded on some ranks only: their rounds hold other tensors
        assert m["layout"] is not None and "hold different tensors" in m["layout"], m


def test_error_feedback_applies_the_true_sum_less_the_buffers():
    """error_feedback=True in FSDP2's reduce-scatter (2 ranks): over the rounds after the warm-up,
    each rank's shard of the applied sum is R times the exact average plus the ranks' buffers after
    the warm-up less those after the last round, over N (buffers from the comm's state_dict)."""
    import numpy as np
    from helpers import rank_data

    n, rounds = 10240, 12
    ranks = run_ranks("fsdp_feedback.py", np=2, launcher="torchrun", timeout=300, args=["--rounds", rounds])
    avg = np.mean([rank_data(k, n, seed=20, tail=0.05).astype(np.float64) for k in range(2)], axis=0)
    first = np.sum([r["first"] for r in ranks], axis=0)
    last = np.sum([r["last"] for r in ranks], axis=0)
    assert np.abs(last).max() > 0, "no error kept"
    shard = n // 2
    for r in ranks:
        part = slice(r["rank"] * shard, (r["rank"] + 1) * shard)
        drift = np.array(r["sum"]) - rounds * avg[part]
        np.testing.assert_allclose(drift, (first[part] - last[part]) / 2, atol=1e-4)
