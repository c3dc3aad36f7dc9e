"""The GPU check (scripts/bench/gpu_paths.py, issue 52) dry-run on the CPU: every section of the
report runs and passes with gloo and tiny models, a machine without CUDA is told so in one line
(exit status 2), and a section that raises is reported with its traceback while the rest still run.
On a GPU the same command is `make gpu-check` (docs/guides/gpu.md)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from scripts.bench import gpu_paths

ROOT = Path(__file__).resolve().parent.parent
TITLES = {
    "codec": "Codec correctness",
    "bench": "Codec benchmark",
    "ddp-gpt": "DDP steps: GPT-2 small",
    "ddp-resnet": "DDP steps: ResNet-50",
    "fsdp": "Smoke: FSDP2 comm",
    "diloco": "Smoke: DiLoCo",
    "compile": "Smoke: torch.compile(DDP) against eager",
    "ranks-exchanges": "2 ranks: DDP hook, every exchange",
    "ranks-train": "2 ranks: DDP hook, FSDP2, DiLoCo training",
    "horovod": "Horovod compressor",
    "ranks-horovod": "2 ranks: Horovod compressor, gloo controller",
}
HOROVOD = ("horovod", "ranks-horovod")


def _run(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # (tests/conftest.py sets it)
    cmd = [sys.executable, "-m", "scripts.bench.gpu_paths", *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.multiproc  # its 2-rank sections start ranks
def test_gpu_paths_dry_run_on_cpu_passes_every_section(tmp_path):
    """`--device cpu --tiny`: the whole check, every section passed, the 2-rank ones (2 processes
    over gloo on CPU tensors) included (the Horovod ones run the compressor on CPU tensors where
    Horovod is installed). Its time (over 10 minutes on 2 cores shared with other builds, most of
    it starting the 2-rank workers) is in the report, not asserted: a loaded machine would make a
    timed test flaky."""
    out = tmp_path / "gpu_paths.md"
    proc = _run("--device", "cpu", "--tiny", "--out", str(out), timeout=1200)  # 2-rank starts on a loaded host
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    text = out.read_text()
    data = json.loads(out.with_suffix(".json").read_text())
    assert [s["key"] for s in data["sections"]] == gpu_paths.SECTIONS == list(TITLES)
    for section in data["sections"]:
        assert f"## {TITLES[section['key']]}" in text
        expected = "skipped" if section["key"] in HOROVOD and not importlib.util.find_spec("horovod") else "passed"
        assert section["status"] == expected, (section["key"], section["reason"], section["traceback"])
        assert section["traceback"] is None
        assert section["key"] in HOROVOD or section["checks"], section["key"]
    assert data["seconds"] > 0
    checks = {s["key"]: [c["name"] for c in s["checks"]] for s in data["sections"]}
    for exchange in ("allgather", "two-phase", "hierarchical", "hierarchical-two-phase"):
        assert f"DDP hook, {exchange}: identical on both ranks" in checks["ranks-exchanges"]
    for front in ("DDP hook", "FSDP2", "DiLoCo"):
        assert f"{front}: parameters: identical on both ranks" in checks["ranks-train"]
        assert f"{front}: codes exchanged" in checks["ranks-train"]
    for row in ("DDP allreduce", "fp16_compress_hook", "PowerSGD rank 4", "alq_hook bits=3", 'alq_hook bits="auto"'):
        assert f"| {row} |" in text
    assert text.count("| no exchange | ") == 2 and "## Targets" in text


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
def test_gpu_paths_without_cuda_exits_2_with_one_line():
    proc = _run()
    assert proc.returncode == 2
    assert proc.stdout == "" and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "--device cpu" in proc.stderr


def test_gpu_paths_failing_section_is_reported_and_the_rest_run(tmp_path):
    """--fail makes a section raise at once: the report names it failed with the traceback, the
    next section still runs and passes, and the exit status is 1."""
    out = tmp_path / "r.md"
    proc = _run("--device", "cpu", "--tiny", "--only", "codec,bench", "--fail", "codec", "--out", str(out))
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.with_suffix(".json").read_text())
    codec, bench = data["sections"]
    assert codec["status"] == "failed" and "injected failure" in codec["reason"]
    assert "Traceback" in codec["traceback"] and "RuntimeError: injected failure" in codec["traceback"]
    assert bench["status"] == "passed"
    assert "RuntimeError: injected failure" in out.read_text()
    assert _run("--device", "cpu", "--only", "nope").returncode == 2


def test_run_sections_reports_raises_skips_and_failed_checks():
    """In-process: a raise, a skip and a false check each end their section; the others run."""

    def boom(ctx, sec):
        sec.check("before the raise", True)
        raise ValueError("boom\nsecond line")

    def skip(ctx, sec):
        raise gpu_paths.Skipped("not here")

    def bad(ctx, sec):
        sec.check("one", True)
        sec.check("two", False, "detail")

    def good(ctx, sec):
        sec.check("fine", True)
        sec.target("a target", 2.0, 3.0, "x")
        sec.lines.append("a line")

    ctx = gpu_paths.Ctx(gpu_paths.parse(["--device", "cpu", "--tiny"]))
    written = []
    specs = [("a", "A", boom), ("b", "B", skip), ("c", "C", bad), ("d", "D", good)]
    sections = gpu_paths.run_sections(specs, ctx, write=lambda done: written.append(len(done)))
    assert [s.status for s in sections] == ["failed", "skipped", "failed", "passed"]
    assert sections[0].reason == "ValueError: boom" and "ValueError: boom" in sections[0].traceback
    assert sections[1].reason == "not here" and sections[2].reason == "failed checks: two"
    assert written == [1, 1, 2, 2, 3, 3, 4, 4]
    text = gpu_paths.markdown({"date": "today", "command": "cmd", "environment": {"torch": "x"}}, sections)
    assert "ValueError: boom" in text and "- [ ] two: detail" in text and "| a target | 2x | 3x | yes |" in text
    assert json.dumps([s.as_dict() for s in sections])


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
def test_device_script_without_cuda_exits_2_and_builds_nothing(tmp_path):
    """scripts/bench/gpu_device.sh (the check in one call on a lent GPU machine) stops before its
    Horovod builds where the Python has no CUDA device."""
    env = {**os.environ, "OUT": str(tmp_path), "PY": sys.executable}
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "bench" / "gpu_device.sh")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "no CUDA device" in proc.stdout and "nothing built or run" in proc.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["device.log"]
