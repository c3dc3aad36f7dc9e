"""scripts/study/time_to_accuracy.py: its quick form on 2 real ranks (mpirun on the loopback, no
namespaces): every rank's per-step log has its fields, the clocks add up, and the targets are read
off the fp16 curve; the target arithmetic on made-up curves."""

import json
import math

import pytest

from scripts.study import time_to_accuracy as tta

ROWS = ["hvd-fp16", "ddp-bf16", "hvd-alq", "local"]


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("tta")
    argv = ["--local", "--np", "2", "--quick", "--steps", "8", "--eval-every", "2", "--rows", ",".join(ROWS)]
    argv += ["--width", "32", "--layers", "1", "--batch-size", "4", "--eval-windows", "32", "--out-dir", str(out)]
    assert tta.main(argv) == 0
    return out


def test_every_rank_logs_each_row_and_step(quick_run):
    logs = quick_run / "data" / "time_to_accuracy_logs" / "loopback_s0"
    for rank in (0, 1):
        lines = [json.loads(x) for x in (logs / f"rank{rank}.jsonl").read_text().splitlines()]
        assert len(lines) == 8 * len(ROWS)
        for row in ROWS:
            mine = [x for x in lines if x["row"] == row]
            assert [x["step"] for x in mine] == list(range(1, 9))
            for a, b in zip(mine, mine[1:]):
                assert b["seconds"] == pytest.approx(a["seconds"] + b["step_seconds"], abs=1e-5)
            # the slowest rank's clock is never behind this rank's own
            assert all(x["seconds_slowest"] >= x["seconds"] - 1e-6 for x in mine)
            evals = [x["step"] for x in mine if "eval_loss" in x]
            assert evals == ([] if row == "local" else [2, 4, 6, 8])
            assert all(math.isfinite(x["train_loss"]) and x["bytes_sent"] >= 0 for x in mine)
            if row != "local":
                assert all(x["bytes_sent"] > 0 for x in mine)
        # fp16 and bf16: a ring allreduce of 2-byte values, 2(N-1)/N x 2 B x parameters with N = 2
        run = json.loads((quick_run / "data" / "time_to_accuracy_raw" / "loopback_s0.json").read_text())
        fp16 = [x["bytes_sent"] for x in lines if x["row"] == "hvd-fp16"]
        assert fp16 == [pytest.approx(2 * run["params"], abs=0.1)] * 8
        # ALQ at 3 bits sends less than fp16 (this tiny model has many small tensors, sent as float32)
        alq = [x["bytes_sent"] for x in lines if x["row"] == "hvd-alq"]
        assert max(alq) < 0.75 * fp16[0]


def test_targets_come_from_the_fp16_curve(quick_run):
    run = json.loads((quick_run / "data" / "time_to_accuracy_raw" / "loopback_s0.json").read_text())
    summary = json.loads((quick_run / "data" / "time_to_accuracy.json").read_text())["summary"]["loopback"]
    fp16 = dict((s, v) for s, v in run["rows"]["hvd-fp16"]["curve"])
    targets = summary["rows"]["hvd-fp16"]["targets"]
    assert [t["loss"] for t in targets] == pytest.approx([fp16[4], fp16[6], fp16[8]])
    # fp16 reaches each of its own targets, no later than at the step it was read at
    clock = tta.cumulative(run["rows"]["hvd-fp16"]["step_s"])
    for t, step in zip(targets, (4, 6, 8)):
        assert t["reached"] == 1 and t["ratio"][0] == pytest.approx(1.0)
        assert t["seconds"][0] <= clock[step - 1] + 1e-9
    # every row's time is its clock at its first evaluation at or below the target, or not reached
    for key in ("ddp-bf16", "hvd-alq"):
        rclock = tta.cumulative(run["rows"][key]["step_s"])
        for t in summary["rows"][key]["targets"]:
            first = next((s for s, v in run["rows"][key]["curve"] if v <= t["loss"]), None)
            assert (t["seconds"] is None) == (first is None)
            if first is not None:
                assert t["seconds"][0] == pytest.approx(rclock[first - 1])
    # every exchange leaves the ranks identical; the local row (no exchange) does not
    assert max(r["max_param_diff"] for k, r in run["rows"].items() if k != "local") == 0.0
    assert run["rows"]["local"]["max_param_diff"] > 0
    report = (quick_run / "time_to_accuracy.md").read_text()
    assert "Time to each target" in report and "Where the step goes" in report


def test_reach_and_targets_on_made_up_curves():
    curve = [[2, 3.0], [4, 2.5], [6, 2.2], [8, 2.0]]
    clock = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]
    assert tta.targets_of(curve, 8) == [(0.5, 4, 2.5), (0.75, 6, 2.2), (1.0, 8, 2.0)]
    assert tta.reach(curve, clock, 2.5) == 4.0
    assert tta.reach(curve, clock, 2.4) == 6.0
    assert tta.reach(curve, clock, 1.9) is None
    with pytest.raises(ValueError, match="no evaluation at step 6"):
        tta.targets_of([[4, 2.5], [8, 2.0]], 8)
    assert tta.cumulative([0.5, 0.25, 1.0]) == [0.5, 0.75, 1.75]


def test_a_row_alone_with_an_earlier_baseline(tmp_path, quick_run, capsys):
    """--baseline-from: a row run alone takes fp16's row from the earlier run of the same rate and
    seed, and its own curve is the one it had beside the other rows (each row its own model, seed
    and batches); fp16 in --rows as well is refused."""
    earlier = quick_run / "data" / "time_to_accuracy_raw"
    argv = ["--local", "--np", "2", "--quick", "--steps", "8", "--eval-every", "2", "--baseline-from", str(earlier)]
    argv += ["--width", "32", "--layers", "1", "--batch-size", "4", "--eval-windows", "32", "--out-dir", str(tmp_path)]
    assert tta.main([*argv, "--rows", "hvd-alq"]) == 0
    before = json.loads((earlier / "loopback_s0.json").read_text())["rows"]
    run = json.loads((tmp_path / "data" / "time_to_accuracy_raw" / "loopback_s0.json").read_text())
    assert list(run["rows"]) == ["hvd-fp16", "hvd-alq"]
    assert run["rows"]["hvd-fp16"] == before["hvd-fp16"]
    assert run["rows"]["hvd-alq"]["curve"] == before["hvd-alq"]["curve"]
    capsys.readouterr()
    with pytest.raises(SystemExit):
        tta.main([*argv, "--rows", "hvd-fp16,hvd-alq"])
    assert "without it and with --baseline-from" in capsys.readouterr().err


def test_stretched_rows_train_longer_on_their_own_schedule(tmp_path, quick_run, capsys):
    """--stretch 1.5 (MLPerf's rule): the ALQ row trains 12 steps against fp16's 8, its cosine decay
    to step 12, so its curve leaves the 8-step run's after the first evaluation (the lr is the same
    up to there); the targets stay fp16's (read at its steps 4, 6 and 8)."""
    earlier = quick_run / "data" / "time_to_accuracy_raw"
    argv = ["--local", "--np", "2", "--quick", "--steps", "8", "--eval-every", "2", "--baseline-from", str(earlier)]
    argv += ["--width", "32", "--layers", "1", "--batch-size", "4", "--eval-windows", "32", "--out-dir", str(tmp_path)]
    assert tta.main([*argv, "--rows", "hvd-alq", "--stretch", "1.5"]) == 0
    before = json.loads((earlier / "loopback_s0.json").read_text())["rows"]
    run = json.loads((tmp_path / "data" / "time_to_accuracy_raw" / "loopback_s0.json").read_text())
    alq = run["rows"]["hvd-alq"]
    assert len(alq["step_s"]) == 12 and [s for s, _ in alq["curve"]] == [2, 4, 6, 8, 10, 12]
    assert alq["curve"][0] == before["hvd-alq"]["curve"][0]
    assert alq["curve"][1][1] != before["hvd-alq"]["curve"][1][1]
    summary = json.loads((tmp_path / "data" / "time_to_accuracy.json").read_text())["summary"]["loopback"]
    fp16 = dict(before["hvd-fp16"]["curve"])
    assert [t["loss"] for t in summary["rows"]["hvd-alq"]["targets"]] == pytest.approx([fp16[4], fp16[6], fp16[8]])
    assert "Stretched (MLPerf's rule)" in (tmp_path / "time_to_accuracy.md").read_text()
    capsys.readouterr()
    with pytest.raises(SystemExit):
        tta.main([*argv, "--rows", "hvd-alq", "--stretch", "0.5"])
    assert "--stretch 0.5" in capsys.readouterr().err


def test_eval_every_must_divide_the_target_steps(capsys):
    with pytest.raises(SystemExit):
        tta.main(["--local", "--steps", "40", "--eval-every", "7"])
    assert "must divide" in capsys.readouterr().err


def test_bench_summary_reads_both_quick_runs(tmp_path, quick_run):
    """scripts/bench/summary.py: the verdict per link rate from the step table, ALQ's time to fp16's
    final loss from the time-to-accuracy run, and the missing runs named."""
    from scripts.bench import summary

    def row(step, sent):
        return {"step_s": step, "bytes_per_step": sent}

    res = lambda alq: {"local": row(0.1, 0), "hvd-fp16": row(0.4, 2e6), "hvd-alq": row(alq, 4e5)}  # noqa: E731
    runs = [
        {"workers": 4, "rate": "1gbit", "run": {"results": res(0.5)}},
        {"workers": 4, "rate": "100mbit", "run": {"results": res(0.2)}},
    ]
    assert "no step table" in "\n".join(summary.summary(tmp_path))
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "bench_train_step.json").write_text(json.dumps({"runs": runs}))
    text = "\n".join(summary.summary(tmp_path))
    assert "1gbit: ALQ loses (1.25x, the exchange 75% of fp16's step)" in text
    assert "100mbit: ALQ wins (0.50x" in text and "0.20x fp16's bytes" in text
    assert "no time-to-accuracy run" in text
    text = "\n".join(summary.summary(quick_run))
    assert "75% of its steps" in text and "100% of its steps" in text and "loopback" in text
