"""horovod_alq.mpi.QuantizedAllreduce across real ranks: mpirun with 2 and 4 ranks (and two
sub-communicators of 2), no framework; and its payloads read by the torch kernels. Lists of arrays
and ``bits="auto"``: on 2, 3 and 4 ranks.

Each rank count is one launch of tests/workers/mpi_allreduce.py that runs every scenario (3 ranks:
the list and ``bits="auto"`` scenarios only); the tests below check what the ranks reported.

Unbiasedness, with tolerances from the sample size: for M calls with fixed levels the worker
computes the exact law of one output (per coordinate: expectation, variance and the range of each
rank's term, from the ranks' arrays, norms and levels). The tests require

- the exact expectation to equal the true average up to float32 rounding;
- the deviation of the mean of the M outputs from the expectation to stay within Bernstein's bound
  (from the per-coordinate standard error sqrt(variance / M) and the size of one term) at total
  failure probability ALPHA for an unbiased codec: for every coordinate, and for the sum of the
  coordinates' z-scores, plain (an offset) and signed by the expectation (a scale error).

A normal quantile on per-coordinate z-scores would not do: a coordinate rounded up with a small
probability p has a mean of M draws far from normal unless M p is large. Seeds are fixed, so every
run sees the same draws.
"""

import math
import os
from pathlib import Path

import numpy as np
import pytest
from helpers import assert_t_unbiased, same
from multiproc import run_ranks

from horovod_alq.core import Quantizer
from horovod_alq.core.rounds import RoundState

ROOT = Path(__file__).resolve().parents[2]
ADAPTIVE = {"alq", "alq-n", "amq", "amq-n"}
ALPHA = 1e-6  # failure probability of the unbiasedness checks of one method if the codec is unbiased

RUNS = {  # every scenario; lists and bits="auto" also on 3 ranks (AUTO_RUNS)
    2: ["--n", 800, "--bucket", 128, "--reps", 120, "--alpha", ALPHA, "--auto-reps", 150],
    4: [
        "--methods",
        "alq,amq-n,terngrad",
        "--n",
        600,
        "--bucket",
        128,
        "--reps",
        80,
        "--alpha",
        ALPHA,
        "--split",
        "--auto-reps",
        80,
    ],
}
AUTO_RUNS = {**RUNS, 3: ["--auto-only", "--auto-reps", 150]}
_LAUNCHES: dict = {}  # rank count -> the ranks' reports: one launch per rank count for both fixtures


def _env() -> dict:
    # the ranks import horovod_alq from this checkout, installed (make install) or not
    path = os.environ.get("PYTHONPATH")
    return {"PYTHONPATH": str(ROOT) + (os.pathsep + path if path else "")}


def _launch(np_: int) -> list:
    if np_ not in _LAUNCHES:
        _LAUNCHES[np_] = run_ranks("mpi_allreduce.py", np=np_, args=AUTO_RUNS[np_], timeout=180, env=_env())
    return _LAUNCHES[np_]


@pytest.fixture(scope="module", params=sorted(RUNS), ids=lambda n: f"np{n}")
def run(request):
    return _launch(request.param)


@pytest.fixture(scope="module", params=sorted(AUTO_RUNS), ids=lambda n: f"np{n}")
def launched(request):
    """The launches that ran the list and bits="auto" scenarios (``["auto"]`` of every report)."""
    return _launch(request.param)


def _wire_bytes(n: int, bits: int, bucket: int) -> int:
    return 32 + 4 * math.ceil(n / bucket) + math.ceil(n * bits / 8)


# ---------------------------------------------------------------------------------- exchange
def _assert_unbiased(res, what):
    info = (
        what,
        {
            k: res[k]
            for k in ("bernstein_coordinates", "bernstein_z_sum", "bernstein_z_signed", "max_abs_z", "sum_z", "n_z")
        },
    )
    assert res["expect_vs_truth"] < 1e-6, info
    assert res["bernstein_coordinates"] < 1, info
    assert res["bernstein_z_sum"] < 1, info
    assert res["bernstein_z_signed"] < 1, info
    assert res["n_z"] >= 0.75 * res["n"], info  # most coordinates are in the z-score sums


@pytest.mark.multiproc
def test_unbiased(run):
    for method, res in run[0]["unbiased"].items():
        _assert_unbiased(res, method)


@pytest.mark.multiproc
def test_identical_results_and_levels_on_all_ranks(run):
    for method in run[0]["unbiased"]:
        per_rank = [r["unbiased"][method] for r in run]
        assert len({r["outputs"] for r in per_rank}) == 1, f"{method}: ranks got different averages"
        assert all(r["levels"] == per_rank[0]["levels"] for r in per_rank), method
        assert len({r["fingerprint"] for r in per_rank}) == 1, method
        assert all(r["dtype"] == "float32" for r in per_rank)
        # same seed on every rank, yet independent rounding noise: the ranks' payloads differ
        assert len({r["own_payload"] for r in per_rank}) == len(run), method


@pytest.mark.multiproc
def test_adapt_moves_levels_of_adaptive_methods_only(run):
    for method, res in run[0]["unbiased"].items():
        if method in ADAPTIVE:
            assert res["refit"] and res["level_updates"] == 1, method
            assert res["levels"] != res["start_levels"], method
        else:
            assert not res["refit"] and res["level_updates"] == 0, method
            assert res["levels"] == res["start_levels"], method


@pytest.mark.multiproc
def test_bytes_on_the_wire_and_metrics(run):
    parity = set(RoundState(Quantizer("alq")).metrics())
    for method, res in run[0]["unbiased"].items():
        bits = 2 if method == "terngrad" else 3
        one = _wire_bytes(res["n"], bits, 128)
        assert res["one_payload"] == one
        assert res["step"] == 3 + res["reps"] + 1  # warm-up, measured, and the final allgather
        assert res["payload_bytes"] == res["step"] * one
        assert res["coordinates"] == res["step"] * res["n"]
        assert res["payload_sizes"] == [one] * len(run)
        assert res["gathered_bytes"] == len(run) * one
        assert res["bits_per_coordinate"] == pytest.approx(8 * one / res["n"])
        assert res["uncompressed"] == 0
        assert set(res["metric_keys"]) == parity


@pytest.mark.multiproc
def test_dtype_and_shape_follow_the_input(run):
    for r in run:
        res = r["dtypes"]
        for name in ("float16", "float32", "float64"):
            for label in (name, name + ".strided"):
                assert res[label]["dtype"] == name and res[label]["same_shape"], label
                # 4 bits, buckets of 64: one call is within ~30% of the exact average (in L2)
                assert res[label]["rel_err"] < 0.5, (label, res[label]["rel_err"])
        # two independent calls (independent rounding): the median ratio of sum to average is N
        assert res["sum_over_average"] == pytest.approx(len(run), rel=0.05)
        assert res["nan_buckets"] == [False, True, False, False]  # rank 1's NaN spoils its bucket only
        assert res["empty"] == [0]
    for label in run[0]["dtypes"]:
        if isinstance(run[0]["dtypes"][label], dict):
            assert len({r["dtypes"][label]["digest"] for r in run}) == 1, label


# ---------------------------------------------------------------------------------- two-phase
@pytest.mark.multiproc
def test_two_phase_unbiased_identical_and_adapted(run):
    for r in run:
        tp = r["two_phase"]
        assert_t_unbiased(tp)
        assert tp["exchange"] == "two-phase" and tp["second_updates"] == 1
        assert tp["second_follows_first"] and tp["second_refit_at_other_bits"], tp
    assert len({r["two_phase"]["digest"] for r in run}) == 1, "ranks got different results"


@pytest.mark.multiproc
@pytest.mark.parametrize("np_", [3, 4, 8])
def test_two_phase_traffic_does_not_grow_with_ranks(np_):
    """N = 3 (odd; buffers that do not divide by N), 4 and 8 (oversubscribed, small arrays): bytes per
    coordinate of two-phase against 2 (N - 1) / N (b + 32/d), headers aside; allgather's grow as N - 1."""
    n, d = 8192 * 4 + 100, 512
    res = run_ranks(
        "mpi_allreduce.py",
        np=np_,
        timeout=300,
        env=_env(),
        args=["--two-phase-only", "--n", n, "--bucket", d, "--reps", 40],
    )
    per = 3 + 32 / d
    headers = 2 * np_ * 32 * 8 / n  # at most one header per shard and phase
    expected = 2 * (np_ - 1) / np_ * per
    buckets = -(-n // d)
    granularity = 2 * (np_ - 1) * per * d / n  # shards differ by at most one bucket
    for key in ("sent_per_call", "received_per_call"):
        mean = np.mean([8 * r["two_phase"][key] / n for r in res])
        assert expected * 0.98 <= mean <= expected * 1.02 + headers, (key, mean, expected)
        for r in res:
            assert abs(8 * r["two_phase"][key] / n - expected) <= granularity + headers + 0.02 * expected
    for r in res:
        tp = r["two_phase"]
        assert_t_unbiased(tp)
        assert tp["buckets"] == buckets
        one = _wire_bytes(n, 3, d)
        assert tp["allgather_sent"] == (np_ - 1) * one and tp["allgather_received"] == (np_ - 1) * one
    assert len({r["two_phase"]["digest"] for r in res}) == 1


# ---------------------------------------------------------------------------------- errors
MISMATCH = {  # case: what every rank's message must say (the exchange's handshake names the field)
    "bits": "differ in bits 3 on some ranks, 4 on others",
    "bucket": "bucket_size 32 on some ranks, 64 on others",
    "method": "differ in method",
    "levels": "levels differ",
    "adapt_levels": "differ in levels",
    "adapt_config": "differ in bits",
    "norm": "differ in norm l2 on some ranks, linf on others",
    "adapt_norm": "differ in norm",
}
BAD_INPUT = {  # only rank 1 is at fault; everyone names it
    "numel": "different element counts (rank 0: 500, rank 1: 499",
    "int_input": "rank 1: ValueError: x must be a floating-point array",
    "str_input": "rank 1: ValueError: x must be a floating-point array",
    "adapt_stats": "could not adapt on rank 1: ValueError: stats has shape (3,)",
    "bad_op": "rank 1: ValueError: op must be one of ('average', 'sum'), got 'max'",
    "feedback_key": "rank 1: ValueError: error_feedback=True keeps each array's error under a key: pass key=",
}


@pytest.mark.multiproc
@pytest.mark.parametrize("case", sorted(MISMATCH))
def test_mismatch_raises_on_every_rank(run, case):
    for r in run:
        err = r["errors"]["errors"][case]
        assert err is not None, f"rank {r['rank']} did not raise for {case}"
        assert err.startswith("ValueError: horovod_alq.mpi:") and MISMATCH[case] in err, err
    assert len({r["errors"]["after"][case] for r in run}) == 1, "communicator unusable or ranks disagree afterwards"


@pytest.mark.multiproc
@pytest.mark.parametrize("case", sorted(BAD_INPUT))
def test_bad_input_on_one_rank_raises_on_every_rank(run, case):
    for r in run:
        err = r["errors"]["errors"][case]
        assert err is not None and BAD_INPUT[case] in err, (r["rank"], err)
    assert len({r["errors"]["after"][case] for r in run}) == 1


@pytest.mark.multiproc
def test_a_late_rank_makes_the_waiting_rank_raise_not_hang():
    run = _launch(2)  # the 2-rank launch's case (its rank 1 is the late one)
    err, seconds = run[0]["bounded_wait"]["error"], run[0]["bounded_wait"]["seconds"]
    assert err is not None and "'late'" in err and "did not complete within 1 s" in err, err
    assert 1 <= seconds < 2.5, seconds  # raised at the timeout, before rank 1 came (3 s)
    assert run[1]["bounded_wait"]["error"] is None


@pytest.mark.multiproc
def test_collectives_per_call_and_per_adapt(run):
    """A call is the handshake and the exchange's collectives (no preflight, no control vector);
    adapt() is a handshake, the statistics and the check of the new levels."""
    for r in run:
        c = r["collectives"]
        assert c["allgather"] == {"Iallreduce": 1, "Iallgatherv": 1}, c
        assert c["two-phase"] == {"Iallreduce": 1, "Ialltoallv": 1, "Iallgatherv": 1}, c
        assert c["allgather.adapt"] == c["two-phase.adapt"] == {"Iallreduce": 3}, c


@pytest.mark.multiproc
def test_a_fit_that_fails_on_one_rank_raises_on_every_rank(run):
    for r in run:
        f = r["refit_failure"]
        assert f["error"].startswith("RuntimeError: horovod_alq.mpi:") and "previous levels restored" in f["error"], f
        assert "FloatingPointError: injected" in f["error"] or r["rank"] != 1, f
        assert f["restored"] and f["level_updates"] == 0, f
    assert len({r["refit_failure"]["after"] for r in run}) == 1


# ---------------------------------------------------------------------------------- state, sub-communicators
@pytest.mark.multiproc
def test_state_dict_round_trip(run):
    for r in run:
        s = r["state"]
        assert s["same_output_own_state"] and s["root_state_runs"]
        assert s["loaded_levels_equal"] and s["adapted_levels_equal"]
        assert s["step"] == 3 and s["level_updates"] == 2  # 2 saved + 1 after loading; 1 saved + 1
        assert 0 < s["multiplier"] < 1


@pytest.mark.multiproc
def test_statistics_collection_and_empty_adapt(run):
    for r in run:
        c = r["collect"]
        assert c["nothing_recorded"] == [False, True]  # collect_every=0: adapt() has nothing to fit
        assert c["on_request"] == [True, False]  # collect=True recorded the call; the levels moved
        assert c["every_2nd"]  # collect_every=2: calls 0 and 2 since the last adapt()
        assert c["all_zero"] == [False, 0]  # zeros only: no bucket to fit, the levels stay
        assert c["explicit"][0] is True
        assert c["fixed"] == [False, None]
    assert len({str(r["collect"]["explicit"][1]) for r in run}) == 1


@pytest.mark.multiproc
@pytest.mark.parametrize("run", [4], indirect=True, ids=["np4"])
def test_sub_communicators_exchange_independently(run):
    halves = {}
    for r in run:
        s = r["split"]
        assert s["sub_size"] == 2 and s["members"] == [s["color"], s["color"] + 2]
        halves.setdefault(s["color"], []).append(s)
    for color, half in halves.items():
        assert half[0]["outputs"] == half[1]["outputs"] and half[0]["levels"] == half[1]["levels"]
        assert half[0]["refit"] and half[0]["levels"] != half[0]["start_levels"]
        _assert_unbiased(half[0], f"half {color}")
        assert half[0]["gathered_bytes"] == 2 * half[0]["one_payload"]
    assert halves[0][0]["outputs"] != halves[1][0]["outputs"]
    assert halves[0][0]["levels"] != halves[1][0]["levels"]  # each half fit its own data
    # a mismatch inside the odd half raises on both of its ranks and leaves the even half alone
    assert all(s["half_mismatch"] is None for s in halves[0])
    assert all(s["half_mismatch"] and "differ in bits" in s["half_mismatch"] for s in halves[1])


# ---------------------------------------------------------------------------------- torch side
def _payloads(res):
    torch = pytest.importorskip("torch")
    payloads = [torch.frombuffer(bytearray.fromhex(p), dtype=torch.uint8) for p in res["payloads"]]
    numel = int(np.frombuffer(bytes.fromhex(res["payloads"][0])[16:24], "<u8")[0])  # header field
    return torch, payloads, torch.tensor(res["levels"], dtype=torch.float64), numel


def _core_decode(res):
    q = Quantizer(res["method"], bits=res["bits"], bucket_size=res["bucket_size"])
    q.set_levels(res["levels"])  # the adapted levels: the payloads carry their fingerprint
    return [q.decode(bytes.fromhex(p)) for p in res["payloads"]]


@pytest.mark.multiproc
def test_payloads_decode_with_the_torch_kernels(run):
    res = run[0]["payload"]
    assert all(r["payload"]["payloads"] == res["payloads"] for r in run)
    torch, payloads, levels, numel = _payloads(res)
    from horovod_alq.torch.codecs import torch_kernels as kernels

    core = _core_decode(res)
    assert numel == core[0].size == 1003
    for payload, expected in zip(payloads, core):
        out = torch.zeros(numel, dtype=torch.float32)
        kernels.decode_into(out, payload, levels, bits=res["bits"], bucket_size=res["bucket_size"])
        np.testing.assert_array_equal(out.numpy(), expected)  # the same float32 products
    mean = np.asarray(res["mean"], dtype=np.float32)  # what QuantizedAllreduce returned
    np.testing.assert_array_equal(mean, sum(core[1:], core[0].copy()) / np.float32(len(core)))


@pytest.mark.multiproc
def test_payloads_decode_with_the_fused_codec(run):
    res = run[0]["payload"]
    torch, payloads, levels, numel = _payloads(res)
    from horovod_alq.torch.codecs import cpu_build

    module = cpu_build.load()
    if module is None:
        pytest.skip(f"fused codec unavailable: {cpu_build.status()}")
    offsets = np.cumsum([0] + [p.numel() for p in payloads[:-1]]).tolist()
    out = torch.empty(numel, dtype=torch.float32)
    module.decode_sum(out, torch.cat(payloads), offsets, levels, res["bits"], res["bucket_size"], 1.0 / len(payloads))
    np.testing.assert_allclose(out.numpy(), np.asarray(res["mean"], dtype=np.float32), rtol=1e-6, atol=1e-7)


# ---------------------------------------------------------------------------------- lists, bits="auto"
AUTO_SIZES = [512, 512, 256]  # scales 100, 1, 0.01 (tests/workers/mpi_allreduce.py, auto_arrays)
AUTO_KEYS = [[n, 0] for n in AUTO_SIZES]  # arrays are matched by their element counts


@pytest.mark.multiproc
@pytest.mark.parametrize("exchange", ["allgather", "two-phase"])
def test_auto_identical_on_every_rank_within_budget_with_more_bits_for_the_larger_array(launched, exchange):
    key = f"unbiased.{exchange}"
    res = launched[0]["auto"][key]
    for field in ("digest", "allocation", "width_levels", "levels"):
        assert same(launched, lambda r: r["auto"][key][field]), field
    assert res["updated"] and res["level_updates"] == 1 and res["exchange"] == exchange
    alloc = res["allocation"]
    assert alloc[0] > alloc[1], alloc  # the same size, 100x the norm: more bits
    mean = float(np.dot(AUTO_SIZES, alloc)) / sum(AUTO_SIZES)
    assert mean <= 2.5 and res["allocated_mean_bits"] == pytest.approx(mean) and res["default_bits"] == 2
    assert sorted(res["width_levels"]) == sorted(map(str, set(alloc) | {2}))
    assert res["dtypes"] == ["float32", "float64", "float16"] and res["shapes"] == [[512], [16, 32], [256]]
    if exchange == "allgather":  # the payloads carry the allocated widths
        assert res["bytes_per_call"] == res["expected_bytes"]


@pytest.mark.multiproc
@pytest.mark.parametrize("case", ["unbiased.allgather", "unbiased.two-phase", "unbiased.fixed", "unbiased.bucket"])
def test_lists_unbiased(launched, case):
    """Mixed widths in one round (bits="auto", per array or, ``unbiased.bucket``, per bucket) and a
    list with fixed bits: per-bucket t tests."""
    assert_t_unbiased(launched[0]["auto"][case])
    assert same(launched, lambda r: r["auto"][case]["digest"])


@pytest.mark.multiproc
def test_widths_per_bucket_send_the_budgets_payload_and_agree_on_every_rank(launched):
    res = launched[0]["auto"]["unbiased.bucket"]
    assert res["updated"] and res["level_updates"] == 1 and res["allocation"] == []
    assert same(launched, lambda r: r["auto"]["unbiased.bucket"]["width_levels"])
    assert max(res["rel_err"]) < 1.0, res["rel_err"]  # a quantized average, not noise
    if res["exchange"] == "allgather":  # one mixed payload per call, of the size the budget fixes
        # the bits go where the norm is, across the list (two-phase: within each rank's shard only)
        assert res["rel_err"][0] < 0.3, res["rel_err"]
        assert res["bytes_per_call"] == res["expected_bytes"]


@pytest.mark.multiproc
def test_a_fixed_bits_list_quantizes_each_array_as_if_alone(launched):
    for r in launched:
        f = r["auto"]["fixed_list"]
        assert f["statistics_as_alone"] and f["bytes"] == f["expected_bytes"], f
        assert f["type"] == "list" and f["shapes"] == [[512], [16, 32], [256]]
        assert f["dtypes"] == ["float32", "float64", "float16"]
        assert f["empty"] == [[0], [5]] and f["nothing"] == []
        u = r["auto"]["unbiased.fixed"]
        assert max(u["rel_err"]) < 0.5, u["rel_err"]
        assert u["bytes_per_call"] == u["expected_bytes"] or u["exchange"] == "two-phase", u
    assert same(launched, lambda r: r["auto"]["fixed_list"]["digest"])


@pytest.mark.multiproc
def test_auto_records_rows_per_array_and_uses_the_allocation_for_its_arrays_only(launched):
    for r in launched:
        c = r["auto"]["collection"]
        assert c["nothing"] is False  # adapt() with nothing recorded on any rank
        assert c["added"] and c["keys_added"] == AUTO_KEYS  # two calls of the same arrays: rows added
        assert c["replaced"] and c["keys_replaced"] == AUTO_KEYS[:2]  # other arrays: replaced
        assert c["not_collected"] and c["adapted"] and c["pending_after"] is None
        assert c["default_bits"] == 2
        # the allocation's arrays (by element counts) take its widths; a prefix or others the default
        assert c["bytes"] == c["expected"], (c["bytes"], c["expected"])
        assert c["reduce"].startswith("ValueError") and "bits='auto'" in c["reduce"]
    assert same(launched, lambda r: r["auto"]["collection"]["allocation"])


AUTO_ERRORS = {  # only rank 1 differs; every rank raises
    "budget": "bit_budget (thousandths of a bit: 2500 on some ranks, 3000 on others)",
    "adapt_budget": "bit_budget (thousandths of a bit: 2500 on some ranks, 3000 on others)",
    "list_int": "could not encode the input of rank 1: ValueError: x[1] must be a floating-point array",
    "list_split": "different element counts (rank 0: [512, 512, 256], rank 1: [512, 256, 512]",
    "list_length": "different element counts (rank 0: [512, 512, 256], rank 1: [512, 512]",
    "recorded": "recorded different arrays since the last adapt() (elements per array) (rank 0: [512, 512, 256], "
    "rank 1: [512, 512]",
    "stats": "could not adapt on rank 1: ValueError: stats= does not apply to bits='auto'",
    "allgather": "allgather() returns payloads of one width: not with bits='auto'",
}


@pytest.mark.multiproc
@pytest.mark.parametrize("case", sorted(AUTO_ERRORS))
def test_auto_and_list_errors_raise_on_every_rank(launched, case):
    for r in launched:
        err = r["auto"]["errors"]["errors"][case]
        assert err is not None and err.startswith("ValueError: horovod_alq.mpi:"), (r["rank"], err)
        assert AUTO_ERRORS[case] in err, (r["rank"], err)
    assert same(launched, lambda r: r["auto"]["errors"]["after"][case]), "ranks disagree afterwards"


@pytest.mark.multiproc
def test_auto_recovers_after_ranks_recorded_different_arrays(launched):
    for r in launched:
        assert r["auto"]["errors"]["errors"]["recovered"] is True
    assert same(launched, lambda r: r["auto"]["errors"]["errors"]["allocation"])


@pytest.mark.multiproc
def test_auto_state_dict_round_trip(launched):
    for r in launched:
        s = r["auto"]["state"]
        assert s["same_output_own_state"] and s["root_state_runs"] and s["allocation_loaded"], s
        assert s["adapted_alike"] and s["level_updates"] == 2, s  # the recorded rows travelled too
        assert "bits='auto'" in s["fixed_refused"] and "bit_budget" in s["budget_refused"], s
    assert same(launched, lambda r: r["auto"]["state"]["allocation"])
