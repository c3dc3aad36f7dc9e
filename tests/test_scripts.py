"""Smoke tests of the evidence scripts (docs/results/index.md): each one's --help, and the short paths
that write its outputs. Kept brief; the real runs are `make bench` and the commands in the results pages."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from scripts.common import launch

ROOT = Path(__file__).resolve().parent.parent  # the scripts run as modules from here: python -m scripts.demo.train


def load(name: str):
    """The script ``scripts.<name>`` ("study.variance")."""
    return importlib.import_module(f"scripts.{name}")


def mpirun_module(module: str, *args, np: int = 2, timeout: float = 300) -> None:
    """``python -m module ARGS`` on ``np`` ranks (scripts/common/launch.py's mpirun); fails with its output."""
    cmd = [*launch.mpirun(np), sys.executable, "-m", module, *map(str, args)]
    rc, out = launch.output(cmd, timeout, env=launch.rank_env())
    assert rc == 0, out[-4000:]


@pytest.mark.parametrize(
    "name",
    [
        "study.variance",
        "study.run_accuracy",
        "bench.network",
        "bench.codec",
        "bench.train_step",
        "bench.fsdp",
        "bench.codec_widths",
        "study.scale",
        "study.time_to_accuracy",
    ],
)
def test_help(name, capsys):
    with pytest.raises(SystemExit) as exc:
        load(name).main(["--help"])
    assert exc.value.code == 0
    assert "--quick" in capsys.readouterr().out


def test_train_step_cpu_table(monkeypatch):
    """scripts/bench/train_step.py's CPU table: the other threads' time is the process's less the main
    thread's, the bound is N x process CPU / cores; a run recorded without CPU times gives none."""
    ts = load("bench.train_step")
    monkeypatch.setattr(ts.os, "cpu_count", lambda: 2)
    row = dict(label="r", step_s=0.9, fwd_bwd_s=0.8, cpu_main_s=0.2, cpu_all_s=0.35)
    run = {"size": 4, "results": {"local": {**row, "label": "alone", "cpu_main_s": 0.15}, "hvd-alq": row}}
    cells = [line.split("|")[1:-1] for line in ts.cpu_table(run) if line.startswith("| r ")]
    assert [c.strip() for c in cells[0]] == ["r", "900", "200", "+50", "150", "700", "1.29"]
    assert ts.cpu_table({"size": 4, "results": {"hvd-alq": {"label": "r", "step_s": 1.0}}}) == []


def test_row_clock_runs_only_around_its_rows_steps(monkeypatch):
    """scripts/common/timing.py: a compress='when-faster' row's arbiter times its rounds on a clock
    that stands still while the other rows step (the benchmarks interleave rows); other rows get none."""
    from horovod_alq.torch.ddp import ALQState
    from scripts.common import timing

    now = [10.0]
    monkeypatch.setattr(timing.time, "perf_counter", lambda: now[0])
    state = ALQState(bits=3, compress="when-faster")
    clock = timing.row_clock(state, rank=0, warmup=5)
    assert state.round_state.speed.clock is clock and state.round_state.speed.warmup == 5
    assert timing.row_clock(ALQState(bits=3, compress="always"), rank=0) is None
    clock.resume()
    now[0] += 2.0  # this row's step
    clock.pause()
    now[0] += 7.0  # the other rows' steps
    clock.resume()
    now[0] += 0.5
    assert clock() == pytest.approx(2.5)
    clock.pause()
    now[0] += 1.0
    assert clock() == pytest.approx(2.5)

    def backward():  # timed_step runs the clock around the whole step, barriers included
        now[0] += 0.25

    nothing = lambda: None  # noqa: E731
    rec = timing.timed_step(backward, nothing, nothing, backward, clock=clock)
    assert rec["step_s"] == pytest.approx(0.25) and clock() == pytest.approx(3.0)


def test_codec_widths_reports_every_width(tmp_path):
    """scripts/bench/codec_widths.py on a small tensor: a row per width and kernel set, 3 bits at 1.00."""
    out = tmp_path / "widths.md"
    assert load("bench.codec_widths").main(["--size", "64K", "--repeats", "1", "--out", str(out)]) == 0
    rows = [
        line.split("|")[1:-1]
        for line in out.read_text().splitlines()
        if line.startswith("| AVX2") or line.startswith("| generic")
    ]
    assert [int(r[1]) for r in rows] == list(range(2, 9)) * (len(rows) // 7) and len(rows) in (7, 14)
    assert all(float(r[3]) == 1.0 for r in rows if int(r[1]) == 3)
    assert all(float(r[2]) > 0 for r in rows)


def test_variance_quick(tmp_path):
    assert load("study.variance").main(["--quick", "--out-dir", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "data" / "variance.json").read_text())
    assert data["iterations"] == [0, 10, 20, 30]
    v = data["variance"]
    for norm in ("l2", "linf"):  # the adaptive methods with each bucket norm
        assert all(x > 0 for x in v[f"alq-{norm}|3|512|paper"])
        # the adaptive levels beat NUQSGD's once fitted
        assert v[f"alq-{norm}|3|512|every"][-1] < v["nuqsgd|3|512|-"][-1]
    for png in ("variance_vs_iter.png", "variance_staleness.png", "levels_vs_iter.png"):
        assert (tmp_path / png).stat().st_size > 10_000
    assert "| alq" in (tmp_path / "variance.md").read_text()


def test_variance_auto_quick(tmp_path):
    """--auto: the compressors' bits='auto' against uniform 3 bits on the CNN's quantized tensors."""
    assert load("study.variance").main(["--auto", "--quick", "--out-dir", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "data" / "variance_auto.json").read_text())
    assert data["iterations"] == [0, 10, 20, 30] and data["refits"] == [0, 20]
    assert data["quantized_parameters"] == ["conv2.weight", "fc1.weight", "fc2.weight"]  # min_size 1024
    sizes, v = data["quantized_sizes"], data["variance"]
    for label in ("alq-l2", "alq-linf", "amq-l2", "amq-linf"):
        uniform = v[f"{label}|512|uniform3"]
        for budget in (3.0, 2.5):
            for key in (f"{label}|512|{budget}", f"{label}|512|{budget}|best"):
                assert all(0 < a / u < float("inf") for a, u in zip(v[key], uniform)), key
                for bits in data["bits"][key]:  # every measurement's widths: within the budget
                    assert sum(b * n for b, n in zip(bits, sizes)) <= budget * sum(sizes)
                    assert set(bits) <= set(range(2, 9))
        # uniform 3 bits is one of the allocations within budget 3.0: the best is no worse; widths per
        # bucket include every allocation per tensor: no worse than the best of those
        assert all(b <= u * (1 + 1e-9) for b, u in zip(v[f"{label}|512|3.0|best"], uniform))
        for budget in (3.0, 2.5):
            assert all(
                f <= b * (1 + 1e-9)
                for f, b in zip(v[f"{label}|512|{budget}|best_bucket"], v[f"{label}|512|{budget}|best"])
            )
            assert all(m <= budget + 1e-9 for m in data["bits"][f"{label}|512|{budget}|best_bucket_mean"])
            kept = v[f"{label}|512|{budget}|bucket_stale"]  # widths per bucket from the last refit: none before it
            assert kept[0] != kept[0] and all(0 < k < float("inf") for k in kept[1:]), kept  # NaN, then values
    assert data["bucket_gaps"] and max(data["bucket_gaps"]) == 0  # exact
    for png in ("variance_auto.png", "variance_auto_bits.png"):
        assert (tmp_path / png).stat().st_size > 10_000
    assert "| alq-l2, 512 |" in (tmp_path / "variance_auto.md").read_text()


def test_run_accuracy_aggregates(tmp_path):
    raw = tmp_path / "raw"
    raw.mkdir()
    for seed, acc in ((0, 0.9), (1, 0.92)):
        results = [
            {"method": "alq", "bucket_size": 512, "accuracy": acc},
            {"method": "none", "bucket_size": None, "accuracy": acc + 0.01},
        ]
        (raw / f"np4_b3_d512_s{seed}_e4_alq-none.json").write_text(
            json.dumps({"args": {"seed": seed}, "results": results})
        )
        (raw / f"np4_b3_d8192_s{seed}_e4_alq.json").write_text(
            json.dumps(
                {"args": {"seed": seed}, "results": [{"method": "alq", "bucket_size": 8192, "accuracy": acc - 0.1}]}
            )
        )
    mod = load("study.run_accuracy")
    assert mod.main(["--aggregate-only", "--epochs", "4", "--raw-dir", str(raw), "--out-dir", str(tmp_path)]) == 0
    summary = json.loads((tmp_path / "data" / "accuracy.json").read_text())["summary"]
    assert summary["alq@512"]["n"] == 2 and summary["alq@512"]["mean"] == pytest.approx(91.0)
    assert summary["none@None"]["mean"] == pytest.approx(92.0)
    assert "-10.00" in (tmp_path / "accuracy.md").read_text()  # bucket-size change 512 -> 8192
    # same-seed difference to fp32: -1 and -11 points on both seeds, so no spread
    assert summary["alq@512"]["vs_fp32"]["mean"] == pytest.approx(-1.0)
    assert summary["alq@8192"]["vs_fp32"]["mean"] == pytest.approx(-11.0)
    assert summary["alq@8192"]["vs_fp32"]["sem"] == pytest.approx(0.0, abs=1e-9)
    assert "vs_fp32" not in summary["none@None"]
    assert (tmp_path / "accuracy.png").stat().st_size > 10_000
    # a raw file that repeats a (method, bucket, seed) run is an error, not a silent double count
    (raw / "np4_b3_d512_s0_e4_alq-again.json").write_text(
        json.dumps({"args": {"seed": 0}, "results": [{"method": "alq", "bucket_size": 512, "accuracy": 0.5}]})
    )
    with pytest.raises(ValueError, match="repeats"):
        mod.main(["--aggregate-only", "--epochs", "4", "--raw-dir", str(raw), "--out-dir", str(tmp_path)])


@pytest.mark.multiproc
def test_bench_codec_two_ranks(tmp_path):
    out = tmp_path / "codec.md"
    mpirun_module("scripts.bench.codec", "--sizes", "64K", "--repeats", "1", "--warmup", "0", "--out", out, timeout=120)
    text = out.read_text()
    for name in ("fp16", "ALQ 3b", "torch 8-bit quantization hook helpers"):
        assert f"| {name} |" in text


def test_run_accuracy_aggregates_several_bit_widths(tmp_path):
    """--bits 2,3: one column per (bits, bucket); TernGrad and fp32 run once per seed (2 bits)."""
    raw = tmp_path / "raw"
    raw.mkdir()
    for seed in (0, 1):
        first = [
            {"method": "alq-linf", "bucket_size": 8192, "accuracy": 0.90},
            {"method": "terngrad", "bucket_size": 8192, "accuracy": 0.88},
            {"method": "none", "bucket_size": None, "accuracy": 0.91},
        ]
        (raw / f"np4_b2_d8192_s{seed}_e8_alq-linf-terngrad-none.json").write_text(
            json.dumps({"args": {"seed": seed}, "results": first})
        )
        (raw / f"np4_b3_d8192_s{seed}_e8_alq-linf.json").write_text(
            json.dumps(
                {"args": {"seed": seed}, "results": [{"method": "alq-linf", "bucket_size": 8192, "accuracy": 0.93}]}
            )
        )
    mod = load("study.run_accuracy")
    assert [
        j["methods"]
        for j in mod.cnn_launches(
            mod.parse_args(
                [
                    "--bits",
                    "2,3",
                    "--buckets",
                    "8192",
                    "--seeds",
                    "0",
                    "--methods",
                    "alq-linf,terngrad",
                    "--baselines",
                    "none",
                ]
            )
        )
    ] == [["alq-linf", "terngrad", "none"], ["alq-linf"]]
    assert (
        mod.main(
            ["--aggregate-only", "--bits", "2,3", "--raw-dir", str(raw), "--out-dir", str(tmp_path), "--tag", "_t"]
        )
        == 0
    )
    summary = json.loads((tmp_path / "data" / "accuracy_t.json").read_text())["summary"]
    assert summary["alq-linf@b2d8192"]["mean"] == pytest.approx(90.0)
    assert summary["alq-linf@b3d8192"]["vs_fp32"]["mean"] == pytest.approx(2.0)
    assert summary["terngrad@b2d8192"]["n"] == 2 and "terngrad@b3d8192" not in summary
    text = (tmp_path / "accuracy_t.md").read_text()
    assert "| method | 2 bits, d=8192 | 3 bits, d=8192 |" in text and "(2 bits) 88.00" in text


def test_exchange_suffixes():
    """-ag / -2p choose the exchange (train.py and train_tf.py); unknown names are refused."""
    import argparse

    import scripts.common.demo as dc

    assert dc.split_exchange("alq-2p") == ("alq", "two-phase")
    assert dc.split_exchange("amq-linf-ag") == ("amq-linf", "allgather")
    assert dc.split_exchange("alq-n") == ("alq-n", None)
    assert dc.split_norm("alq-linf-2p") == ("alq", "linf") and dc.split_norm("alq-n-ag") == ("alq-n", None)
    assert dc.selected_methods(argparse.Namespace(methods="alq-2p,amq-ag,none")) == ["alq-2p", "amq-ag", "none"]
    assert dc.selected_methods(argparse.Namespace(methods="alq-3p")) is None
    from horovod_alq import torch as alq

    args = dc.parse_args("", ["--bits", "3"])
    assert dc.make_compressor(None, alq, "alq-2p", args).exchange == "two-phase"
    assert dc.make_compressor(None, alq, "amq-linf-ag", args).exchange == "allgather"
    assert dc.make_compressor(None, alq, "alq", args).exchange == "auto"


def test_demo_bits_auto():
    """--bits auto --bit-budget B gives the front-ends bits="auto" (a budget without auto, or other
    words for --bits, are refused)."""
    import scripts.common.demo as dc
    from horovod_alq import torch as alq

    args = dc.parse_args("", ["--bits", "auto", "--bit-budget", "2.5"])
    assert dc.width_keywords(args) == {"bits": "auto", "bit_budget": 2.5}
    c = dc.make_compressor(None, alq, "amq", args)
    assert c.bits == "auto" and c.metrics()["bit_budget"] == 2.5
    assert dc.width_keywords(dc.parse_args("", ["--bits", "auto"])) == {"bits": "auto"}
    with pytest.raises(SystemExit, match="--bits auto only"):
        dc.width_keywords(dc.parse_args("", ["--bits", "3", "--bit-budget", "2.5"]))
    with pytest.raises(SystemExit):
        dc.parse_args("", ["--bits", "many"])


def test_demo_adam_and_precondition_options(tmp_path):
    """--optimizer adam (default lr 3e-3) and the +pre suffix: +pre gives the compressor the optimizer
    (SGD's is refused by it), is known to train.py only, and needs Horovod and Adam."""
    import argparse

    import scripts.common.demo as dc
    from horovod_alq import torch as alq

    train = load("demo.train")
    args = dc.parse_args("", ["--optimizer", "adam"], optimizers=True)
    assert args.lr == dc.ADAM_LR and dc.parse_args("", [], optimizers=True).lr == 0.05
    model = torch.nn.Linear(4, 2)
    assert isinstance(train.make_optimizer(model, args), torch.optim.Adam)
    dc.make_compressor(None, alq, "alq+pre", args, precondition=torch.optim.Adam(model.parameters()))
    with pytest.raises(ValueError, match="second moment"):
        dc.make_compressor(None, alq, "alq+pre", args, precondition=torch.optim.SGD(model.parameters(), lr=0.1))
    methods = argparse.Namespace(methods="alq+pre,none")
    assert dc.selected_methods(methods, precondition=True) == ["alq+pre", "none"]
    assert dc.selected_methods(methods) is None  # train_tf.py: no +pre
    assert dc.selected_methods(argparse.Namespace(methods="none+pre"), precondition=True) is None
    assert train.main(["--methods", "alq+pre"]) == 2  # SGD
    assert train.main(["--methods", "alq+pre", "--optimizer", "adam", "--backend", "ddp"]) == 2


def test_run_accuracy_pairs_preconditioned_with_plain(tmp_path):
    """--optimizer adam aggregates only Adam's raw files, and pairs alq+pre with alq on each seed."""
    raw = tmp_path / "raw"
    raw.mkdir()
    for seed, (plain, pre) in enumerate(((0.90, 0.92), (0.91, 0.90), (0.93, 0.95))):
        results = [
            {"method": "alq", "bucket_size": 8192, "accuracy": plain},
            {"method": "alq+pre", "bucket_size": 8192, "accuracy": pre},
            {"method": "none", "bucket_size": None, "accuracy": 0.92},
        ]
        (raw / f"np4_b3_d8192_s{seed}_e8_adam_alq-alq+pre-none.json").write_text(
            json.dumps({"args": {"seed": seed, "lr": 0.003, "optimizer": "adam"}, "results": results})
        )
        (raw / f"np4_b3_d8192_s{seed}_e8_alq.json").write_text(  # SGD's, from before --optimizer
            json.dumps({"args": {"seed": seed, "lr": 0.05}, "results": [results[0]]})
        )
    mod = load("study.run_accuracy")
    argv = ["--aggregate-only", "--epochs", "8", "--raw-dir", str(raw), "--out-dir", str(tmp_path), "--tag", "_a"]
    assert mod.main([*argv, "--optimizer", "adam"]) == 0
    summary = json.loads((tmp_path / "data" / "accuracy_a.json").read_text())["summary"]
    d = summary["alq+pre@8192"]["vs_plain"]
    assert d["n"] == 3 and d["mean"] == pytest.approx(1.0) and d["higher"] == 2
    assert summary["alq+pre@8192"]["vs_fp32"]["mean"] == pytest.approx(0.3333, abs=1e-3)
    assert "alq: +pre − plain | +1.00 ± " in (tmp_path / "accuracy_a.md").read_text()
    assert mod.main(argv) == 0  # SGD: the one file per seed without an optimizer, no +pre row
    summary = json.loads((tmp_path / "data" / "accuracy_a.json").read_text())["summary"]
    assert set(summary) == {"alq@8192"} and summary["alq@8192"]["n"] == 3


@pytest.mark.multiproc
def test_train_adam_preconditioned_two_ranks(tmp_path):
    """train.py --optimizer adam with alq and alq+pre (1 epoch, 2 ranks): both train to a finite
    accuracy, and +pre changes the run (same seed, same rounding: only w differs)."""
    out = tmp_path / "train.json"
    args = ["--optimizer", "adam", "--methods", "alq,alq+pre", "--epochs", "1", "--quiet", "--json", out]
    mpirun_module("scripts.demo.train", *args)
    data = json.loads(out.read_text())
    plain, pre = data["results"]
    assert data["args"]["optimizer"] == "adam" and [plain["method"], pre["method"]] == ["alq", "alq+pre"]
    assert all(np.isfinite(r["final_loss"]) and r["accuracy"] > 0.5 and r["bits"] == 3 for r in (plain, pre))
    assert pre["final_loss"] != plain["final_loss"]


def test_run_accuracy_aggregates_two_phase(tmp_path):
    """alq-ag and alq-2p on the same seeds: the same-seed difference two-phase minus allgather."""
    raw = tmp_path / "raw"
    raw.mkdir()
    for seed, acc in ((0, 0.90), (1, 0.94)):
        results = [
            {"method": "alq-ag", "bucket_size": 8192, "accuracy": acc},
            {"method": "alq-2p", "bucket_size": 8192, "accuracy": acc - 0.005},
            {"method": "none", "bucket_size": None, "accuracy": acc + 0.01},
        ]
        (raw / f"np4_b3_d8192_s{seed}_e8_alq-ag-alq-2p-none.json").write_text(
            json.dumps({"args": {"seed": seed}, "results": results})
        )
    mod = load("study.run_accuracy")
    assert [
        j["methods"]
        for j in mod.cnn_launches(
            mod.parse_args(["--buckets", "8192", "--seeds", "0", "--methods", "alq-ag,alq-2p", "--baselines", "none"])
        )
    ] == [["alq-ag", "alq-2p", "none"]]
    assert (
        mod.main(
            ["--aggregate-only", "--buckets", "8192", "--raw-dir", str(raw), "--out-dir", str(tmp_path), "--tag", "_x"]
        )
        == 0
    )
    summary = json.loads((tmp_path / "data" / "accuracy_x.json").read_text())["summary"]
    assert summary["alq-2p@8192"]["vs_allgather"]["mean"] == pytest.approx(-0.5)
    assert summary["alq-2p@8192"]["vs_fp32"]["mean"] == pytest.approx(-1.5)
    assert "vs_allgather" not in summary["alq-ag@8192"]
    assert "| alq: 2p − ag | -0.50 ± 0.00 |" in (tmp_path / "accuracy_x.md").read_text()


@pytest.mark.multiproc
def test_train_exchange_two_ranks(tmp_path):
    """train.py with alq-ag and alq-2p: each trains with the exchange it names (1 epoch, 2 ranks)."""
    out = tmp_path / "train.json"
    mpirun_module("scripts.demo.train", "--methods", "alq-ag,alq-2p", "--epochs", "1", "--quiet", "--json", out)
    results = json.loads(out.read_text())["results"]
    assert [(r["method"], r["exchange"]) for r in results] == [("alq-ag", "allgather"), ("alq-2p", "two-phase")]
    assert all(r["accuracy"] > 0.5 and r["bucket_size"] == 8192 for r in results)


@pytest.mark.multiproc
def test_gpt_accuracy_quick(tmp_path):
    """run_accuracy.py --model gpt --quick: one 2-rank launch of train_gpt.py (ALQ through Horovod, fp32,
    PowerSGD at the rank matched to 3-bit ALQ's bytes through DDP in the same processes)."""
    mod = load("study.run_accuracy")
    assert mod.main(["--model", "gpt", "--quick", "--out-dir", str(tmp_path)]) == 0
    summary = json.loads((tmp_path / "data" / "accuracy_gpt.json").read_text())["summary"]
    pairs = summary.pop("pairs")
    assert set(summary) == {"alq@3", "none", "psgd-match"}
    assert set(pairs) == {"alq@3 - none", "alq@3 - psgd-match", "psgd-match - none"}
    d = pairs["alq@3 - none"]
    assert d["n"] == 1 and d["mean"] == pytest.approx(
        summary["alq@3"]["loss"]["mean"] - summary["none"]["loss"]["mean"]
    )
    for cell in summary.values():
        assert cell["loss"]["mean"] < 0.85 * __import__("math").log(103), cell  # learned: below the uniform guess
        assert [s for s, _ in cell["curve"]] == [20]
    assert summary["none"]["bits_per_coordinate"] == 32.0
    assert 3.0 < summary["alq@3"]["bits_per_coordinate"] < 3.6  # 3 bits, norms, uncompressed biases
    # the matched PowerSGD rank's own counters agree with the byte arithmetic that chose it
    train_gpt, gpt = load("demo.train_gpt"), load("common.gpt")
    model = gpt.GPT(103, 128, 4, 4, 64)
    r = summary["psgd-match"]["powersgd_rank"]
    params = sum(p.numel() for p in model.parameters())
    assert summary["psgd-match"]["bits_per_coordinate"] == pytest.approx(
        8 * train_gpt.powersgd_bytes(model, r) / params, rel=0.02
    )
    target = 8 * train_gpt.quantized_bytes(model, 3, 8192, 1024) / params
    assert abs(summary["psgd-match"]["bits_per_coordinate"] - target) < 0.2 * target
    assert summary["alq@3"]["vs_fp32"]["n"] == 1 and "vs_fp32" in summary["psgd-match"]
    assert (tmp_path / "accuracy_gpt.png").stat().st_size > 10_000
    assert mod.main(["--model", "gpt", "--quick", "--out-dir", str(tmp_path)]) == 0  # resumes: the file exists


def test_gpt_auto_bits_spec_raw_names_and_pairs(tmp_path):
    """train_gpt's ``name@auto<budget>`` (bits="auto" for the Horovod ALQ/AMQ compressors only), the
    auto grid's raw file names, and the aggregation pairing its runs with the core grid's fixed
    widths of the same seeds (without mpirun: made-up raw files)."""
    train_gpt, mod = load("demo.train_gpt"), load("study.run_accuracy")
    assert train_gpt.parse_method("alq@3") == ("alq", 3, None)
    assert train_gpt.parse_method("none") == ("none", None, None)
    assert train_gpt.parse_method("alq@auto2.5") == ("alq", "auto", 2.5)
    assert train_gpt.parse_method("amq-n-2p@auto3") == ("amq-n-2p", "auto", 3.0)
    assert train_gpt.parse_method("alq@bucket2.5") == ("alq", "bucket", 2.5)
    for bad in (
        "ddp-alq@auto3",
        "psgd2@auto3",
        "psgd-match@auto3",
        "none@auto3",
        "fp16@auto3",
        "qsgdinf@auto3",
        "terngrad@auto3",
        "alq@auto",
        "alq@auto1.5",
        "alq@auto9",
        "alq@autox",
        "alq@2.5",
        "bogus@auto3",
        "qsgdinf@bucket3",
        "alq@bucket1",
    ):
        with pytest.raises(SystemExit):
            train_gpt.parse_method(bad)
    # every PAIRS method is run by some grid; the auto grid's file name is plain
    specs = {m for grid in mod.GRIDS.values() for launch in grid for m in launch}
    assert {m for pair in mod.PAIRS for m in pair} <= specs
    assert ["alq@auto2.5", "alq@auto3"] in mod.GRIDS["auto"]
    args = mod.parse_args(["--model", "gpt", "--grid", "auto"])
    name = mod.raw_path({"seed": 3, "methods": mod.GRIDS["auto"][0]}, args, tmp_path).name
    assert name == "np4_d8192_s3_t250_b8_alqbauto2p5-alqbauto3.json"
    assert name.count(".") == 1 and "@" not in name
    # collect/summarize: auto runs of seeds 0-2 against core-grid alq@3/alq@2 runs of seeds 0-3
    raw = tmp_path / "data" / "accuracy_gpt_raw"
    raw.mkdir(parents=True)

    def result(spec, loss, **extra):
        bits = train_gpt.parse_method(spec)[1]
        return {
            "spec": spec,
            "bits": bits,
            "eval_loss": loss,
            "curve": [[250, loss]],
            "bits_per_coordinate": 3.0,
            "params": 10,
            **extra,
        }

    for seed in range(4):
        core = mod.raw_path({"seed": seed, "methods": ["alq@3", "alq@2"]}, args, raw)
        core.write_text(
            json.dumps(
                {
                    "args": {"seed": seed, "bucket_size": 8192},
                    "results": [result("alq@3", 2.0 + seed / 10), result("alq@2", 2.1 + seed / 10)],
                }
            )
        )
        if seed < 3:
            auto = [
                result(
                    spec,
                    2.0 + seed / 10 + delta,
                    allocation=[2, 3],
                    allocated_mean_bits=b,
                    allocation_elements=[100, 100],
                )
                for spec, delta, b in (("alq@auto2.5", 0.01 * (seed + 1), 2.5), ("alq@auto3", -0.02, 3.0))
            ]
            mod.raw_path({"seed": seed, "methods": mod.GRIDS["auto"][0]}, args, raw).write_text(
                json.dumps({"args": {"seed": seed, "bucket_size": 8192}, "results": auto})
            )
    summary = mod.gpt_summarize(mod.gpt_collect(raw, args))
    pairs = summary["pairs"]
    assert pairs["alq@auto2.5 - alq@3"]["n"] == 3
    assert pairs["alq@auto2.5 - alq@3"]["diffs"] == pytest.approx([0.01, 0.02, 0.03])
    assert pairs["alq@auto3 - alq@3"]["mean"] == pytest.approx(-0.02)
    assert pairs["alq@auto2.5 - alq@2"]["diffs"] == pytest.approx([-0.09, -0.08, -0.07])
    assert summary["alq@auto3"]["vs_qsgdinf"] is None and summary["alq@auto2.5"]["allocated_mean_bits"][2] == 2.5
    assert summary["alq@3"]["loss"]["n"] == 4 and "allocation" not in summary["alq@3"]
    assert mod.order(summary.keys() - {"pairs"}) == ["alq@3", "alq@auto3", "alq@auto2.5", "alq@2"]
    text = mod.gpt_markdown(summary)
    assert "| alq@auto2.5 − alq@2 | -0.0800 ± 0.0058 |" in text and "| alq@auto3 | 1 | 2 3 | 3.000 |" in text


def test_gpt_optimizer_choice_and_sgd_sweep_outputs(tmp_path):
    """train_gpt's --optimizer (AdamW by default, SGD with momentum on request) and the SGD sweep's
    own output names and train_gpt arguments, so its rows never mix with AdamW's."""
    import torch

    train_gpt, mod = load("demo.train_gpt"), load("study.run_accuracy")
    model = torch.nn.Linear(3, 2)
    adamw = train_gpt.make_optimizer(model, train_gpt.parse_args([]))
    assert isinstance(adamw, torch.optim.AdamW) and adamw.param_groups[0]["betas"] == (0.9, 0.95)
    sgd = train_gpt.make_optimizer(model, train_gpt.parse_args(["--optimizer", "sgd", "--lr", "0.2"]))
    assert isinstance(sgd, torch.optim.SGD) and sgd.param_groups[0]["momentum"] == 0.9
    with pytest.raises(SystemExit):
        train_gpt.parse_args(["--optimizer", "adam"])
    args = mod.parse_args(["--model", "gpt", "--grid", "sgd", "--optimizer", "sgd"])
    assert mod.stem(args) == "accuracy_gpt_sgd" and args.lr == 0.2
    assert mod.optimizer_args(args) == ["--optimizer", "sgd", "--weight-decay", "0", "--lr", "0.2"]
    default = mod.parse_args(["--model", "gpt"])
    assert mod.stem(default) == "accuracy_gpt" and mod.optimizer_args(default) == []
    assert {m for pair in mod.PAIRS for m in pair} <= {m for grid in mod.GRIDS.values() for ms in grid for m in ms}


@pytest.mark.multiproc
def test_feedback_switches_two_ranks(tmp_path):
    """scripts/study/feedback_switches.py: the studies' error-feedback switches on the demo's rows, one
    2-rank launch on the same seed and batches. ``+ef<step>`` past the last step changes nothing (bit
    for bit the plain row); from step 1 on the rows differ from the plain one and from each other;
    each row keeps its own spec. The demo itself refuses the switches."""
    out = tmp_path / "switches.json"
    specs = ["alq@3", "alq@3+ef3", "alq@3+ef1", "alq@3+ef"]
    tiny = ["--steps", "3", "--eval-every", "3", "--eval-windows", "8", "--width", "32", "--layers", "1"]
    mpirun_module("scripts.study.feedback_switches", "--methods", ",".join(specs), *tiny, "--json", out)
    results = {r["spec"]: r for r in json.loads(out.read_text())["results"]}
    assert list(results) == specs
    loss = {s: r["eval_loss"] for s, r in results.items()}
    assert loss["alq@3+ef3"] == loss["alq@3"]
    assert len({loss[s] for s in specs if s != "alq@3+ef3"}) == 3, loss
    train_gpt = load("demo.train_gpt")
    assert train_gpt.split_feedback("alq@3+ef") == ("alq@3", True)
    with pytest.raises(SystemExit, match="feedback_switches"):
        train_gpt.split_feedback("alq@3+ef30")
    switches = load("study.feedback_switches")
    assert switches.split("alq@2+ef30") == ("alq@2", 30) and not switches.switched("alq@3+ef")


def test_variance_gpt_quick(tmp_path):
    mod = load("study.variance")
    assert mod.main(["--model", "gpt", "--quick", "--out-dir", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "data" / "variance_gpt.json").read_text())
    assert data["iterations"] == [0, 20]
    assert {mod.layer_type(n) for n in data["parameters"]} == set(mod.TYPES) | {"norm"}
    v = data["variance"]
    for label, _, _ in mod.METHODS:
        assert all(0 < row["total"] for row in v[f"{label}|3"]), label
    assert v["alq|3"][-1]["total"] < v["qsgdinf|3"][-1]["total"]  # fitted levels beat the uniform ones
    sizes = data["quantized_sizes"]
    for m in mod.ALLOC_METHODS:  # bits per tensor at budget 3: within it, and no worse than uniform 3 bits
        for bits in data["refit_bits"][f"{m}|3.0"].values():
            assert sum(b * n for b, n in zip(bits, sizes)) <= 3.0 * sum(sizes) and set(bits) <= set(mod.ALLOC_WIDTHS)
        last = data["allocation"][f"{m}|3.0"][-1]
        assert last["oracle"] <= last["uniform3"] + 1e-12 and last["stale"] < last["uniform3"], last
        assert last["compressor"] < last["uniform3"], last  # the compressors' own bits="auto"
        for bits in data["compressor_bits"][f"{m}|3.0"].values():
            assert sum(b * n for b, n in zip(bits, sizes)) <= 3.0 * sum(sizes)
    assert (tmp_path / "variance_gpt.png").stat().st_size > 10_000
    assert "| alq |" in (tmp_path / "variance_gpt.md").read_text()


def test_gpt_corpus_split_is_deterministic_and_round_trips():
    gpt = load("common.gpt")
    train, val, chars = gpt.char_splits()
    again = gpt.char_splits()
    assert train.equal(again[0]) and val.equal(again[1]) and chars == again[2]
    text = gpt.corpus()
    assert len(train) + len(val) == len(text) and len(val) == len(text) - int(0.9 * len(text))
    assert gpt.decode(train[:2000], chars) == text[:2000] and gpt.decode(val[-500:], chars) == text[-500:]
    assert len(chars) == len(set(text)) and chars == sorted(chars)
    x, y = gpt.sample_batch(train, 4, 16, __import__("torch").Generator().manual_seed(0))
    assert x.shape == y.shape == (4, 16) and x[:, 1:].equal(y[:, :-1])  # targets: the next character


@pytest.mark.multiproc
def test_diloco_study_quick(tmp_path, capsys):
    """scripts/study/diloco.py --quick: one 2-worker torchrun launch, per-step fp16 data parallelism
    against DiLoCo at H = 10 in fp32 and with ALQ 3 bits, the same inner steps; the table, plot and
    raw JSON; fewer bytes for DiLoCo (5x fewer exchanges) and fewer again for ALQ; a rerun resumes."""
    mod = load("study.diloco")
    with pytest.raises(SystemExit) as exc:
        mod.main(["--help"])
    assert exc.value.code == 0 and "--quick" in capsys.readouterr().out
    assert mod.main(["--quick", "--out-dir", str(tmp_path)]) == 0
    runs = json.loads((tmp_path / "data" / "diloco_study.json").read_text())
    res = runs["0"]["results"]
    assert list(res) == ["dp-fp16", "h10-fp32", "h10-alq3"] and runs["0"]["workers"] == 2
    for r in res.values():
        assert [c[0] for c in r["curve"]] == [10, 20] and np.isfinite(r["final_loss"]), r
        assert r["final_loss"] < np.log(103)  # learned something: below the uniform guess
    dp, fp32, alq = (res[k]["bytes"] for k in ("dp-fp16", "h10-fp32", "h10-alq3"))
    assert fp32 == pytest.approx(dp / 5, rel=1e-6)  # fp32 at 1/10 the exchanges, twice fp16's bytes each
    assert alq < 0.5 * fp32 and res["h10-alq3"]["outer_steps"] == 2
    table = (tmp_path / "diloco_study.md").read_text()
    assert sum(line.startswith("| h10-") or line.startswith("| dp-") for line in table.splitlines()) == 3
    assert (tmp_path / "diloco_study.png").stat().st_size > 10_000
    assert mod.main(["--quick", "--out-dir", str(tmp_path)]) == 0  # resumes: the launch's file exists


def test_namespace_launch_that_never_connects_fails_named_and_retried(tmp_path):
    """scripts/common/network.py's launch (issue 43, item 9): a launch whose ranks have not all started
    within the connect timeout is killed, named, tried once more, and then raises; no namespaces
    needed (a stub command that never starts a rank, a stub check that names the missing worker)."""
    import time

    net = load("common.network")
    polls, cleanups, said = [], [], []

    def missing():
        polls.append(time.monotonic())
        return [("alqnet-w0", None), ("alqnet-w1", "worker 1 (10.213.0.2, namespace alqnet-w1): no orted")]

    start = time.monotonic()
    with pytest.raises(
        net.LaunchTimeout,
        match=r"after 1 s: worker 1 \(10\.213\.0\.2, namespace alqnet-w1\)"
        r": no orted .*\(try 2 of 2\)",
    ):
        net.launch_retry(
            [sys.executable, "-c", "import time; time.sleep(60)"],
            tmp_path / "log",
            30,
            missing=missing,
            connect_timeout=1.0,
            cleanup=lambda: cleanups.append(1),
            say=lambda *a, **k: said.append(a[0]),
        )
    assert time.monotonic() - start < 15 and len(cleanups) == 2 and len(said) == 1 and "retrying" in said[0]
    # a launch whose parts all start is left to finish; the check stops once everything started
    polls.clear()
    rc = net.launch(
        [sys.executable, "-c", "import time; time.sleep(2.5)"],
        tmp_path / "log",
        30,
        missing=lambda: polls.append(1) or [("alqnet-w0", None)],
        connect_timeout=0.5,
        poll=0.2,
    )
    assert rc == 0 and len(polls) == 1
    # past the overall timeout: killed, TimeoutExpired
    with pytest.raises(subprocess.TimeoutExpired):
        net.launch([sys.executable, "-c", "import time; time.sleep(60)"], tmp_path / "log", 1.0, poll=0.2)


def test_step_repeats_ranges_and_targets(tmp_path):
    """Ratios made inside each run, min / median / max over runs; targets counted run by run."""
    from scripts.bench import step_repeats

    src = json.loads((ROOT / "docs/results/data/bench_train_step_nodes_quiet.json").read_text())
    paths = []
    for k, scale in enumerate((1.0, 1.5)):  # a second run where the hierarchical rows took 1.5x as long
        run = json.loads(json.dumps(src))
        for r in run["runs"]:
            for key in ("hvd-alq-h", "ddp-alq-h"):
                r["run"]["results"][key]["step_s"] *= scale
        paths.append(tmp_path / f"run{k}.json")
        paths[-1].write_text(json.dumps(run))
    text = step_repeats.report(step_repeats.load(paths), paths, ["x"])
    res = {r["rate"]: r["run"]["results"] for r in src["runs"]}["100mbit"]
    ratio = res["hvd-alq-h"]["step_s"] / res["hvd-fp16"]["step_s"]
    line = next(x for x in text.splitlines() if x.startswith("| Horovod ALQ 3b, hierarchical |") and "100mbit" not in x)
    assert f"{ratio:.2f} / {1.25 * ratio:.2f} / {1.5 * ratio:.2f}" in text, line
    target = next(x for x in text.splitlines() if "| 100mbit | at most 0.35x |" in x and x.startswith("| Horovod"))
    assert "| 0 of 2 |" in target and f"{ratio:.2f}, {1.5 * ratio:.2f}" in target


def test_step_repeats_scales_a_row_of_its_own_launch():
    """A row launched on its own is compared step / alone against step / alone."""
    from scripts.bench import step_repeats

    results = {
        "local": {"step_s": 0.08},
        "hvd-fp16": {"step_s": 0.10},
        "hvd-fp16-hier": {"step_s": 0.06, "own_local_s": 0.05},
    }
    assert step_repeats.scaled(results["hvd-fp16-hier"], results) == pytest.approx(0.06 * 0.08 / 0.05)
    assert step_repeats.scaled(results["hvd-fp16"], results) == 0.10
    del results["hvd-fp16-hier"]["own_local_s"]  # runs from before the own launch timed its step alone
    assert step_repeats.scaled(results["hvd-fp16-hier"], results) == 0.06
