"""The multi-process helper itself: results in rank order, and failures that fail loudly."""

from __future__ import annotations

import time
import uuid

import psutil
import pytest
from multiproc import run_ranks

pytestmark = pytest.mark.multiproc


def test_results_in_rank_order_with_args():
    results = run_ranks("rank_behaviour.py", np=3, args=["ok"])
    assert results == [{"rank": r, "argv": ["ok"]} for r in range(3)]


def test_failing_rank_fails_with_its_output():
    with pytest.raises(pytest.fail.Exception) as info:
        run_ranks("rank_behaviour.py", np=2, args=["fail", 1])
    message = str(info.value)
    assert "rank 1 says: deliberate failure marker" in message
    assert "rank 1 did not report" in message


def test_missing_report_fails():
    with pytest.raises(pytest.fail.Exception, match="rank 0 did not report"):
        run_ranks("rank_behaviour.py", np=2, args=["silent", 0])


def _processes_with(tag: str) -> list:
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        if tag in (proc.info["cmdline"] or []):
            found.append(proc)
    return found


@pytest.mark.parametrize("launcher", ["mpi", "gloo"])
def test_timeout_kills_everything(launcher):
    tag = f"tag-{uuid.uuid4().hex}"
    start = time.monotonic()
    with pytest.raises(pytest.fail.Exception) as info:
        run_ranks("rank_behaviour.py", np=2, launcher=launcher, args=["hang", "all", tag], timeout=8)
    assert time.monotonic() - start < 60
    assert "timed out after 8 s" in str(info.value)
    if launcher == "mpi":  # horovodrun may take longer than that to start ranks on a loaded machine
        assert "rank 1 hangs" in str(info.value)
        # each rank's Python stacks, asked for before the kill, are in its log
        assert str(info.value).count("most recent call first") >= 2, str(info.value)[-3000:]
    # Nothing survives, not even a rank that a launcher was still starting when it was stopped.
    time.sleep(3)
    deadline = time.monotonic() + 10
    while _processes_with(tag) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _processes_with(tag) == []


def test_unknown_launcher():
    with pytest.raises(ValueError):
        run_ranks("rank_behaviour.py", launcher="ssh")
