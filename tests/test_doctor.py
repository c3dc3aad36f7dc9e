"""python -m horovod_alq.doctor on 1 process, on 2 ranks (torchrun with torch.distributed, mpirun
with mpi4py) and on 4 ranks as 2 nodes x 2 (tests/torchrun_nodes.py): what it reports, and its
prediction (the scale model of horovod_alq/doctor/model.py) on hand-checkable cases."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from multiproc import RANK_ENV, launch_command

from horovod_alq.doctor import model
from horovod_alq.doctor.predict import KNOWN_RANGE, predict
from horovod_alq.settings import FRONT_ENDS, NOT_SERVED

ROOT = Path(__file__).resolve().parent.parent
DOCTOR = [sys.executable, "-m", "horovod_alq.doctor", "--params", "2M", "--link-bytes", "1M", "--codec-size", "256K"]
TORCHRUN = str(Path(sys.executable).parent / "torchrun")


def _doctor(tmp_path, prefix=(), timeout=300) -> tuple[dict, str]:
    out = tmp_path / "doctor.json"
    proc = subprocess.run(
        [*prefix, *DOCTOR, "--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **RANK_ENV},
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return json.loads(out.read_text()), proc.stdout


def test_one_process_reports_versions_codecs_horovod_and_what_each_front_end_serves(tmp_path):
    r, text = _doctor(tmp_path)
    assert r["versions"]["numpy"] and r["versions"]["python"]
    cpu = next(c for c in r["codecs"] if c["device"] == "cpu")
    assert cpu["codec"] in ("cpu", "torch") and cpu["note"]
    assert set(r["served"]) == set(FRONT_ENDS)
    for fe in FRONT_ENDS:
        assert r["served"][fe]["refuses"] == sorted(NOT_SERVED[fe])
    assert "hierarchical" in r["served"]["Horovod TensorFlow"]["exchanges"]
    assert "horovod" in r and "links" not in r and "prediction" not in r
    assert "launch on N ranks" in text


@pytest.mark.multiproc
def test_two_ranks_under_torchrun_measure_the_link_and_predict(tmp_path):
    r, text = _doctor(tmp_path, [TORCHRUN, "--standalone", "--nproc-per-node", "2", "--no-python"])
    links, p = r["links"], r["prediction"]
    assert links["ranks"] == 2 and links["ranks_per_node"] == 2 and "between" not in links
    inside = links["inside"]
    assert 0 < inside["latency_s"] < 0.1 and inside["bytes_per_s"] > 1e6
    assert r["codec"]["enc3"] > 0 and r["codec"]["dec"] > 0
    assert p["exchange"] == "allgather" and p["via"] == "torch.distributed (gloo)"
    assert p["ratio"] == pytest.approx(p["alq_s"] / p["fp16_s"]) and p["known_range"] == list(KNOWN_RANGE)
    assert "ALQ / fp16 =" in text


@pytest.mark.multiproc
def test_two_ranks_under_mpirun_use_mpi4py(tmp_path):
    pytest.importorskip("mpi4py")
    r, _ = _doctor(tmp_path, launch_command("mpi", 2))
    assert r["prediction"]["via"] == "mpi4py" and r["links"]["ranks"] == 2


@pytest.mark.multiproc
def test_two_nodes_of_two_ranks_measure_between_nodes_and_pick_hierarchical(tmp_path):
    nodes = [sys.executable, str(ROOT / "tests" / "torchrun_nodes.py"), "2", "2"]
    r, _ = _doctor(tmp_path, nodes, timeout=400)
    links = r["links"]
    assert links["ranks"] == 4 and links["ranks_per_node"] == 2
    assert links["inside"]["pair"] == [0, 1] and links["between"]["pair"] == [0, 2]
    assert r["prediction"]["exchange"] == "hierarchical"
    assert r["prediction"]["fp16_row"] in ("ring allreduce fp16", "Horovod hierarchical fp16")


LINKS = {
    "inside": {"latency_s": 1e-5, "bytes_per_s": 5e9},
    "between": {"latency_s": 2e-5, "bytes_per_s": 100e6 / 8},
}
CODEC = model.Codec(1e-9, 1.4e-9, 2e-10)


def test_prediction_is_the_scale_model_of_the_auto_exchange():
    p = predict(1e7, 4, 2, LINKS, CODEC, compute=0.05)
    assert p["exchange"] == "hierarchical"
    m = model.Params(2e-5, 1e-5, 1.0, 5e9)
    alq = model.alq_hierarchical(1e7, 4, 2, 3) + model.small_allreduce(4, 2) * 2
    assert p["alq_s"] == pytest.approx(model.step_time(alq, 0.05, 100e6 / 8, m, CODEC, 3, g=2))
    fp16 = min(
        model.step_time(c, 0.05, 100e6 / 8, m, CODEC, 2, g=2)
        for c in (model.ring16(1e7, 4, 2), model.hier16(1e7, 4, 2))
    )
    assert p["fp16_s"] == pytest.approx(fp16)
    assert predict(1e7, 16, 2, LINKS, CODEC)["exchange"] == "hierarchical-two-phase"
    assert predict(1e7, 2, 1, {"between": LINKS["between"]}, CODEC)["exchange"] == "allgather"


def test_slow_links_favour_alq_and_fast_ones_fp16():
    slow = {**LINKS, "between": {"latency_s": 2e-5, "bytes_per_s": 10e6 / 8}}
    fast = {**LINKS, "between": {"latency_s": 2e-5, "bytes_per_s": 100e9 / 8}}
    assert predict(1e8, 4, 2, slow, CODEC)["ratio"] < 1 < predict(1e8, 4, 2, fast, CODEC)["ratio"]
    one_node = predict(1e8, 2, 2, {"inside": LINKS["inside"]}, CODEC)
    assert one_node["bytes_between_nodes"] == {"alq": 0, "fp16": 0} and math.isfinite(one_node["ratio"])


def test_prediction_and_arguments_refuse_bad_input():
    with pytest.raises(ValueError, match="at least 2 ranks"):
        predict(1e7, 1, 1, LINKS, CODEC)
    proc = subprocess.run(
        [sys.executable, "-m", "horovod_alq.doctor", "--params", "-5"], capture_output=True, text=True, cwd=ROOT
    )
    assert proc.returncode == 2 and "--params" in proc.stderr


def test_the_known_range_is_the_comparison_on_the_results_page():
    data = json.loads((ROOT / "docs" / "results" / "data" / "doctor_check.json").read_text())
    ratios = [r["predicted_over_measured"] for r in data["rows"]]
    assert len(ratios) == 8
    assert KNOWN_RANGE == (round(min(ratios), 2), round(max(ratios), 2))
    page = (ROOT / "docs" / "results" / "doctor_check.md").read_text()
    assert f"Predicted / measured: {KNOWN_RANGE[0]:.2f} to {KNOWN_RANGE[1]:.2f}" in page
    for quoted in ("docs/guides/doctor.md", "docs/results/index.md"):  # the prose that quotes it
        assert f"{KNOWN_RANGE[0]:.2f}-{KNOWN_RANGE[1]:.2f}x" in (ROOT / quoted).read_text(), quoted
