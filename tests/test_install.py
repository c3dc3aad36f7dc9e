"""The install's checks: `make test` fails when the compiled CPU codec (codec 'cpu', the default
for CPU tensors) cannot load, unless HOROVOD_ALQ_ALLOW_TORCH_CODEC=1 asks for the plain torch
kernels (scripts/install/check_codec.py)."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHECK = ROOT / "scripts" / "install" / "check_codec.py"
ALLOW = "HOROVOD_ALQ_ALLOW_TORCH_CODEC"


def _check(env_extra, *args):
    env = {k: v for k, v in os.environ.items() if k not in (ALLOW, "HOROVOD_ALQ_FUSED")}
    env.update(env_extra)
    return subprocess.run(
        [sys.executable, str(CHECK), *args], env=env, capture_output=True, text=True, timeout=300, cwd=ROOT
    )


def _broken_build(tmp_path):
    """A build that must fail: no usable C++ compiler and an empty library cache."""
    return {"CXX": "/bin/false", "HOROVOD_ALQ_CACHE": str(tmp_path / "empty-cache")}


def test_check_fails_when_the_compiled_codec_cannot_be_built(tmp_path):
    res = _check(_broken_build(tmp_path))
    assert res.returncode == 1, (res.stdout, res.stderr)
    assert "ERROR: codec 'cpu'" in res.stderr and "did not load" in res.stderr, res.stderr
    assert f"{ALLOW}=1" in res.stderr, res.stderr
    assert "/bin/false" in res.stderr, res.stderr  # the reason: the compiler that failed
    assert not list((tmp_path / "empty-cache").rglob("*.so"))


def test_check_passes_with_a_warning_when_the_fallback_is_asked_for(tmp_path):
    res = _check({**_broken_build(tmp_path), ALLOW: "1"})
    assert res.returncode == 0, (res.stdout, res.stderr)
    assert "WARNING: codec 'cpu'" in res.stderr and "going on with codec 'torch'" in res.stderr, res.stderr


def test_install_reports_a_broken_build_without_failing(tmp_path):
    res = _check(_broken_build(tmp_path), "--warn")
    assert res.returncode == 0 and "`make test` fails on this" in res.stderr, (res.stdout, res.stderr)


def test_check_passes_where_the_codec_builds():
    res = _check({})
    assert res.returncode == 0, (res.stdout, res.stderr)
    assert "codec 'cpu' (the compiled CPU codec) loaded" in res.stdout


def test_make_test_runs_the_check_before_pytest():
    res = subprocess.run(["make", "-n", "test"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    check = [i for i, line in enumerate(lines) if "scripts/install/check_codec.py" in line and "--warn" not in line]
    pytest_run = [i for i, line in enumerate(lines) if "-m pytest tests" in line]
    assert check and pytest_run and check[0] < pytest_run[0], res.stdout
    lint = [i for i, line in enumerate(lines) if "ruff check" in line or "ruff format --check" in line]
    assert len(lint) == 2 and max(lint) < pytest_run[0], res.stdout  # the lint and format check first
