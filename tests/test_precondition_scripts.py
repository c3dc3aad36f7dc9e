"""The preconditioning study and cost benchmark run end to end (--quick)."""

from __future__ import annotations

import json

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
