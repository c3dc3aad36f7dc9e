"""The DDP communication hook (horovod_alq.torch.ddp) on 2 and 3 gloo ranks launched by torchrun:
identical parameters and levels on every rank for each method, loss falls, both exchanges
unbiased, DDP's options (no_sync accumulation, static_graph, find_unused_parameters,
gradient_as_bucket_view, sub-groups), non-finite gradients skip the GradScaler step, checkpoint
round trip, a rank with other settings raises on every rank instead of hanging, and a rank that
stops in the middle of backward makes every waiting rank raise after the timeout."""

from __future__ import annotations

import pytest
from helpers import assert_t_unbiased, same
from multiproc import run_ranks

pytestmark = pytest.mark.multiproc

METHODS = ("alq", "amq", "qsgdinf", "terngrad")


_LAUNCHES: dict = {}  # rank count -> the ranks' reports (one launch each)


def _launch(np_: int) -> list:
    if np_ not in _LAUNCHES:
        _LAUNCHES[np_] = run_ranks(
            "ddp_worker.py",
            np=np_,
            launcher="torchrun",
            timeout=600,
            args=["--methods", ",".join(METHODS), "--steps", "30", "--reps", "60"],
        )
    return _LAUNCHES[np_]


@pytest.fixture(scope="module", params=[2, 3], ids=["np2", "np3"])
def ranks(request):
    return _launch(request.param)


def test_training_identical_and_learning(ranks):
    size = ranks[0]["size"]
    for name, first in ranks[0]["train"].items():
        assert same(ranks, lambda r: r["train"][name]["params"]), name
        assert same(ranks, lambda r: r["train"][name]["levels"]), name
        assert same(ranks, lambda r: r["train"][name]["second_levels"]), name
        assert first["loss_last"] < 0.7 * first["loss_first"], (name, first)
        assert first["calls"] > 0, (name, first)
        method = name.split("/")[0]
        if method in ("alq", "amq"):
            assert first["level_updates"] == 2, (name, first)
        else:
            assert first["level_updates"] == 0, (name, first)
    train = ranks[0]["train"]
    assert train["alq/find_unused+bucket_view"]["uncompressed"] > 0  # a small bucket: plain all_reduce
    assert train["alq"]["step"] == 30 and train["alq"]["exchange"] == "allgather"
    assert train["alq/two-phase+accumulate"]["step"] == 15  # no_sync steps run no round
    assert train["alq/two-phase+accumulate"]["exchange"] == "two-phase"
    assert 3.0 < train["alq"]["bits_per_coordinate"] < 3.3  # 3 bits + 32/256 + headers
    assert 2.0 < train["terngrad"]["bits_per_coordinate"] < 2.3
    auto = train["alq/auto"]  # bits="auto": a width per parameter, within the budget, the same everywhere
    assert same(ranks, lambda r: r["train"]["alq/auto"]["allocation"])
    assert len(auto["allocation"]) >= 3 and auto["allocated_mean_bits"] <= 2.5 + 1e-9, auto
    assert size in (2, 3)


def test_error_feedback_with_no_sync_accumulation(ranks):
    """With no_sync() accumulation the hook runs, and the error buffers change, at the synchronized
    micro-steps only: one round per optimizer step, never one per micro-step."""
    micro = ranks[0]["accumulate_feedback"]["micro"]
    assert [m["rounds"] for m in micro] == [(i + 1) // 2 for i in range(len(micro))]
    assert not micro[0]["sync"] and micro[0]["rounds"] == 0  # no buffer yet: the first round is to come
    previous = micro[0]["buffers"]
    for m in micro[1:]:
        assert (m["buffers"] != previous) == m["sync"], micro
        previous = m["buffers"]
    assert same(ranks, lambda r: r["accumulate_feedback"]["params"])


def test_unbiased(ranks):
    for exchange, u in ranks[0]["unbiased"].items():
        assert u["exchange"] == exchange
        assert_t_unbiased(u)
        assert u["rel_error"] < 1.0, u  # a quantized average, not noise
        assert same(ranks, lambda r: r["unbiased"][exchange]["digest"])


def test_unbiased_with_widths_chosen_per_parameter(ranks):
    for exchange, u in ranks[0]["unbiased_auto"].items():
        assert u["exchange"] == exchange and u["bits"] == "auto"
        assert len(set(u["allocation"])) > 1, u["allocation"]  # widths differ inside the one DDP bucket
        assert_t_unbiased(u, ("t_buckets_max",))
        assert same(ranks, lambda r: r["unbiased_auto"][exchange]["digest"])
        assert same(ranks, lambda r: r["unbiased_auto"][exchange]["allocation"])


def test_unbiased_with_widths_chosen_per_bucket(ranks):
    """bits_per="bucket": each rank's payload of the one DDP bucket (3000 coordinates, bucket 128)
    holds widths per bucket chosen from its own norms, of the size the budget fixes."""
    from horovod_alq.core.bucket_widths import mixed_payload_size

    for exchange, u in ranks[0]["unbiased_bucket"].items():
        assert u["exchange"] == exchange and u["bits_per"] == "bucket" and u["allocation"] == []
        assert_t_unbiased(u, ("t_buckets_max",))
        assert same(ranks, lambda r: r["unbiased_bucket"][exchange]["digest"])
        if exchange == "allgather":
            assert u["payload_bytes"] == u["rounds"] * mixed_payload_size(3000, 128, 3 * 256), u
    assert ranks[0]["train"]["alq/auto-bucket"]["bits_per_coordinate"] < 3.0


def test_checkpoint_round_trip(ranks):
    for r in ranks:
        c = r["checkpoint"]
        assert c["first"] == c["second"], c  # same parameters, levels and counters after resuming
        assert c["restored_levels"] == c["levels_saved"] != c["first"]["levels"]  # step 10 refit
        assert c["fresh_levels"] == c["levels_saved"] and c["fresh_step"] == 8  # a new state loads it
        assert c["clone_levels"] == c["second"]["levels"] and c["clone_step"] == 14  # pickle round trip
        assert c["first"]["metrics"]["step"] == 14
        assert "other settings" in c["wrong_method"]
    assert same(ranks, lambda r: r["checkpoint"]["first"])


def test_nonfinite_skips_step(ranks):
    for r in ranks:
        n = r["nonfinite"]
        assert not any(n["finite_grads"]), n  # every bucket of every rank: NaN
        assert not n["moved"] and n["scale"] == 128.0, n
    assert same(ranks, lambda r: r["nonfinite"]["params"])


def test_subgroup():
    ranks = _launch(3)  # a group of ranks 0 and 1 beside rank 2
    members = [r["subgroup"] for r in ranks if r["subgroup"]["member"]]
    assert len(members) == 2 and not ranks[2]["subgroup"]["member"]
    assert members[0]["params"] == members[1]["params"] and members[0]["levels"] == members[1]["levels"]
    assert members[0]["step"] == 6


@pytest.mark.parametrize("exchange", ["allgather", "two-phase"])
def test_payloads_move_during_backward(ranks, exchange):
    """Each bucket's payload collective starts in its own hook, before DDP hands over the last
    bucket (the backward pass still computes the later gradients), in every step after the first
    (DDP's first step runs one bucket, then it rebuilds them in gradient order)."""
    for r in ranks:
        o = r["overlap"][exchange]
        assert o["exchange"] == exchange
        first_kind = ["payload", "allgather" if exchange == "allgather" else "alltoall"]  # (JSON lists)
        assert len(o["events"]) == 4
        for events in o["events"][1:]:
            hooks = [i for i, e in enumerate(events) if e[0] == "hook"]
            assert [events[i][1] for i in hooks] == list(range(len(hooks))), events
            assert events[hooks[-1]][2] and not any(events[i][2] for i in hooks[:-1]), events
            quantized = [events[i][3] >= 1024 for i in hooks]  # the worker's min_size
            assert sum(quantized[:-1]) >= 4, events  # five 512x512 weights, several buckets
            # each quantized bucket's first collective starts inside its own hook call, so all but
            # the last bucket's are under way before DDP hands the hook the last bucket
            for k, i in enumerate(hooks):
                end = hooks[k + 1] if k + 1 < len(hooks) else len(events)
                assert events[i + 1 : end].count(first_kind) == int(quantized[k]), (k, events)
    assert same(ranks, lambda r: r["overlap"][exchange]["grads"])


@pytest.mark.parametrize("which", ["bits", "min_size"])
def test_mismatch_raises_everywhere(ranks, which):
    for r in ranks:
        m = r["mismatch"][which]
        assert m["raised"], (which, r["rank"], m)
        expected = "bits" if which == "bits" else "different tensors"
        assert expected in m["message"], m


@pytest.mark.parametrize("step", ["plain", "refit"])
def test_rank_stopped_mid_step_raises_on_every_waiting_rank(ranks, step):
    *waiting, stopped = (r["stalled"][step] for r in ranks)
    assert stopped["raised"] and "injected" in stopped["message"], stopped
    for s in waiting:
        assert s["raised"], s
        # after the timeout (the watchdog checks every 0.25 s), long before gloo's own 30 minutes:
        # the watchdog's CollectiveTimeout for the bucket the stopped rank never sent; in a refit
        # step the last bucket's hook waits for every bucket, and that wait raises first
        assert f"did not complete within {s['timeout']:g} s" in s["message"], s
        assert ("DDP bucket" if step == "plain" else ".buffers'") in s["message"], s
        assert s["timeout"] <= s["seconds"] < s["timeout"] + 30, s


def test_train_script_ddp_backend(tmp_path):
    """scripts/demo/train.py --backend ddp (what `make demo-ddp` runs), one short epoch on 2 ranks."""
    import json
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    from multiproc import RANK_ENV, launch_command

    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "r.json"
    cmd = [
        *launch_command("torchrun", 2),
        sys.executable,
        "-m",
        "scripts.demo.train",
        "--backend",
        "ddp",
        "--methods",
        "alq,fp16,none",
        "--epochs",
        "1",
        "--quiet",
        "--json",
        str(out),
    ]
    env = {**os.environ, **RANK_ENV}
    proc = subprocess.Popen(
        cmd, env=env, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        stdout, _ = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun and its ranks (same session)
        stdout, _ = proc.communicate()
        pytest.fail(f"train.py --backend ddp timed out after 300 s:\n{stdout[-3000:]}")
    assert proc.returncode == 0, stdout[-5000:]
    assert "PyTorch DDP" in stdout
    results = {r["method"]: r for r in json.loads(out.read_text())["results"]}
    assert results["alq"]["bits_per_coordinate"] < 3.1 and results["alq"]["level_updates"] == 1
    assert all(r["accuracy"] > 0.7 for r in results.values()), results
