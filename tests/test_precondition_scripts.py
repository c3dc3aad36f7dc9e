"""The preconditioning study and cost benchmark run end to end (--quick)."""

from __future__ import annotations

import json

import pytest

from scripts.bench import precondition as bench
from scripts.study import precondition_gpt as study


def test_study_quick_writes_every_row_and_reports(tmp_path, capsys):
    out = tmp_path / "runs.jsonl"
    rows = "fp32;alq@3;alq@3+pre:floor=0.05,prior=4,every=2"
    assert study.main(["--quick", "--rows", rows, "--json", str(out)]) == 0
    runs = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["spec"] for r in runs] == rows.split(";")
    assert all(r["eval_loss"] > 0 and len(r["curve"]) == 1 for r in runs)
    assert runs[2]["adam_error"][0] is None and runs[2]["adam_error"][1] >= 0  # no v before step 1
    assert study.main(["--quick", "--rows", rows, "--json", str(out)]) == 0  # done runs are skipped
    assert len(out.read_text().splitlines()) == 3
    capsys.readouterr()
    assert study.main(["--report", "--json", str(out)]) == 0
    assert "| `alq@3+pre:floor=0.05,prior=4,every=2` | `alq@3` | 1 |" in capsys.readouterr().out


def test_cost_bench_quick(tmp_path):
    out = tmp_path / "bench.md"
    assert bench.main(["--quick", "--out", str(out)]) == 0
    assert "| 65,536 |" in out.read_text()


def test_study_node_size_quantizes_node_sums(tmp_path):
    """--node-size 2: fp32 is unchanged, the quantized rows quantize the workers' sum instead."""
    one, two = tmp_path / "one.jsonl", tmp_path / "two.jsonl"
    rows = "fp32;alq@3+pre"
    assert study.main(["--quick", "--rows", rows, "--json", str(one)]) == 0
    assert study.main(["--quick", "--node-size", "2", "--rows", rows, "--json", str(two)]) == 0
    a, b = ([json.loads(line) for line in f.read_text().splitlines()] for f in (one, two))
    assert a[0]["curve"] == b[0]["curve"] and b[0]["node_size"] == 2
    assert a[1]["curve"] != b[1]["curve"]


def test_study_node_size_must_divide_workers(tmp_path, capsys):
    with pytest.raises(SystemExit):
        study.main(["--node-size", "3", "--json", str(tmp_path / "x.jsonl")])
    assert "--node-size must divide --workers (4), got 3" in capsys.readouterr().err


def test_study_exact_first_steps(tmp_path):
    """``exact=K``: the exact average in the first K steps (all 3 of --quick: fp32's curve), then quantized."""
    out = tmp_path / "runs.jsonl"
    rows = "fp32;alq@3:exact=3;alq@3+pre:exact=2;alq@3+pre"
    assert study.main(["--quick", "--rows", rows, "--json", str(out)]) == 0
    runs = [json.loads(line) for line in out.read_text().splitlines()]
    assert runs[1]["curve"] == runs[0]["curve"] and runs[1]["adam_error"] == []
    assert len(runs[2]["adam_error"]) == 1 and runs[2]["curve"] not in (runs[0]["curve"], runs[3]["curve"])


def test_study_cnn_model(tmp_path, capsys):
    """--model cnn: the same loop on the MNIST CNN under Adam, held-out loss and accuracy reported."""
    out = tmp_path / "cnn.jsonl"
    rows = "fp32;alq@2;alq@2+pre:floor=0.05,prior=4"
    assert study.main(["--quick", "--model", "cnn", "--rows", rows, "--json", str(out)]) == 0
    runs = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["model"], r["batch_size"]) for r in runs] == [("cnn", 32)] * 3
    assert all(0 <= r["accuracy"] <= 1 and r["eval_loss"] > 0 for r in runs)
    assert runs[0]["curve"] != runs[1]["curve"] != runs[2]["curve"]
    assert runs[2]["adam_error"][0] is None and runs[2]["adam_error"][1] >= 0
    assert set(runs[1]["crest_at"]) <= {"conv2.weight", "fc1.weight", "fc2.weight"}  # 1,024 elements or more
    capsys.readouterr()
    assert study.main(["--report", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "\nAccuracy:\n" in text and text.count("| `alq@2+pre:floor=0.05,prior=4` | `alq@2` | 1 |") == 2


def test_study_report_accuracy_and_learning_rates():
    """Accuracy: higher is better; runs at two learning rates: one row each, each fp32 its own error."""

    def run(spec, seed, acc, lr=1e-3):
        return {"spec": spec, "seed": seed, "eval_loss": 1 - acc, "accuracy": acc, "lr": lr}

    runs = [run("fp32", 0, 0.90), run("fp32", 1, 0.92), run("alq@3", 0, 0.91), run("alq@3", 1, 0.90)]
    lines = study.report(runs, key="accuracy")
    assert "| `alq@3` | `fp32` | 2 | -0.0050 | 0.0150 | 1 of 2 | -0.0200 |" in lines
    assert "fp32's final accuracy over 2 seeds: 0.9100, standard error 0.0100." in lines
    lines = study.report(runs + [run("fp32", 0, 0.80, 3e-3), run("fp32", 1, 0.84, 3e-3), run("alq@3", 1, 0.85, 3e-3)])
    assert "fp32 lr=0.003's final loss over 2 seeds: 0.1800, standard error 0.0200." in lines
    assert lines[2] == "| `fp32 lr=0.001` | 0.1000 | 0.0800 | 0.0900 |"  # the smaller lr first, fp32 first
    assert "| `alq@3 lr=0.003` | `fp32 lr=0.003` | 1 | -0.0100 | nan | 1 of 1 | -0.0100 |" in lines


def test_study_diagnostics_table():
    """Crest: the mean over runs of each run's worst in steps 1-5 and of its median; the Adam-space
    error's mean and median over steps 1-30 and 31 on, pooled over runs (step 0 has none)."""
    crest = [50.0, 10.0, 30.0, 10.0, 10.0, 10.0, 99.0] + [10.0] * 33
    err = [None] + [0.1] * 30 + [0.2, 0.2, 1.4]
    runs = [{"spec": "fp32"}, {"spec": "alq@3", "crest": crest, "adam_error": err}]
    runs.append({"spec": "alq@3", "crest": [c * 2 for c in crest], "adam_error": err})
    lines = study.diagnostics(runs)
    assert len(lines) == 3 and lines[2] == "| `alq@3` | 2 | 45.0 | 15.0 | 0.100 | 0.600 | 0.100 | 0.200 |"
