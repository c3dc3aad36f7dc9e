"""Run a worker script on several ranks (mpirun or horovodrun) and collect what each rank reports.

Usage in a test::

    from multiproc import run_ranks

    @pytest.mark.multiproc
    @pytest.mark.parametrize("launcher", ["mpi", "gloo"])
    def test_something(launcher):
        results = run_ranks("my_worker.py", np=2, launcher=launcher, args=["--bits", "3"])
        assert results[1]["value"] == ...

The worker (a script, relative paths are taken from tests/workers/) calls
``common.report(obj)`` once per rank; ``run_ranks`` returns those objects in rank order. A rank that
exits non-zero or does not report, a launcher that fails, or a run that exceeds ``timeout``
(everything is killed; nothing hangs) fails the test with every rank's output.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from scripts.common import launch as one_host
from scripts.common.launch import MPI_OPTIONS, RANK_ENV

WORKERS = Path(__file__).resolve().parent / "workers"
BOOT = WORKERS / "_boot.py"
HOROVODRUN = WORKERS.parent / "horovodrun.py"
LAUNCHERS = ("mpi", "gloo", "torchrun")

# One host's Open MPI options and rank environment (scripts/common/launch.py), with Python's fault
# handler: a rank that a test kills prints its stack.
RANK_ENV = {**RANK_ENV, "PYTHONFAULTHANDLER": "1"}
__all__ = ["MPI_OPTIONS", "RANK_ENV", "launch_command", "elastic_launch_command", "run_ranks"]

_TAIL = 4000


def _horovodrun() -> list[str]:
    """horovodrun of this Python's Horovod, less its build check's TensorFlow import (tests/horovodrun.py)."""
    return [sys.executable, str(HOROVODRUN)]


def launch_command(launcher: str, np: int) -> list[str]:
    """The command prefix that starts ``np`` local ranks with ``launcher`` ("mpi", "gloo", or
    "torchrun": torch.distributed's launcher, for workers that call ``dist.init_process_group``)."""
    if launcher == "mpi":
        return one_host.mpirun(np)
    if launcher == "torchrun":  # --no-python: run "python _boot.py ..."
        return one_host.torchrun(np)
    if launcher == "gloo":
        return [*_horovodrun(), "--gloo", "-np", str(np), "-H", f"localhost:{np}"]
    raise ValueError(f"launcher must be one of {LAUNCHERS}, not {launcher!r}")


def elastic_launch_command(
    np: int, discovery_script: str | os.PathLike, min_np: int, max_np: int, elastic_timeout: int = 60
) -> list[str]:
    """horovodrun's elastic Gloo mode on this host, starting ``np`` ranks.

    ``--network-interface lo`` is required on a single host: without it the elastic driver waits
    for a second host to agree on common interfaces (``gloo_run._get_min_start_hosts``) until the
    elastic timeout (600 s by default), which looks like a hang. ``--elastic-timeout`` bounds the
    wait for slots."""
    return [
        *_horovodrun(),
        *("--gloo", "-np", str(np), "--min-np", str(min_np), "--max-np", str(max_np)),
        *("--host-discovery-script", str(discovery_script), "--network-interface", "lo"),
        *("--elastic-timeout", str(elastic_timeout)),
    ]


def _tail(text: str, n: int = _TAIL) -> str:
    return text if len(text) <= n else "...\n" + text[-n:]


def _rank_pids(result_dir: Path) -> list[int]:
    """The pids the ranks recorded (``_boot`` writes them)."""
    pids = []
    for pid_file in result_dir.glob("rank*.pid"):
        try:
            pids.append(int(pid_file.read_text()))
        except ValueError:
            pass
    return pids


def run_ranks(
    worker: str | os.PathLike,
    np: int = 2,
    launcher: str = "mpi",
    args: Sequence[Any] = (),
    timeout: float = 180,
    env: Mapping[str, str] | None = None,
    launch: Sequence[str] | None = None,
) -> list:
    """Run ``worker`` on ``np`` ranks and return each rank's reported object, in rank order.

    Parameters
    ----------
    worker : path of a Python script; a relative path is taken from tests/workers/.
    np : number of ranks.
    launcher : "mpi" (mpirun, Horovod's MPI controller), "gloo" (horovodrun --gloo) or "torchrun".
    args : command-line arguments for the worker (converted with ``str``).
    timeout : seconds for the whole run; past it every process is killed and the test fails.
    env : extra environment variables for the ranks (override the defaults in ``RANK_ENV``).
    launch : a launcher command prefix that replaces ``launcher``'s (e.g. ``elastic_launch_command``;
        ``launcher`` then only names the run in messages).

    Returns
    -------
    list of the ``np`` objects the ranks passed to ``common.report``, decoded from JSON.
    """
    path = Path(worker)
    if not path.is_absolute():
        path = WORKERS / path
    if not path.is_file():
        raise FileNotFoundError(f"worker script {path} not found")
    prefix = list(launch) if launch is not None else launch_command(launcher, np)
    cmd = [*prefix, sys.executable, str(BOOT), str(path), *map(str, args)]

    with tempfile.TemporaryDirectory(prefix="horovod-alq-ranks-") as tmp:
        result_dir = Path(tmp)
        run_env = dict(os.environ)
        run_env.update(RANK_ENV)
        run_env["HOROVOD_ALQ_RESULT_DIR"] = str(result_dir)
        if env:
            run_env.update(env)

        start = time.monotonic()
        log = result_dir / "launcher.log"
        timed_out, rc = False, None
        try:
            # the ranks' stacks into their logs, then SIGTERM (lets the launcher stop ranks it is
            # still starting), SIGKILL after a grace period
            rc = one_host.run(
                cmd,
                log,
                timeout,
                env=run_env,
                cwd=os.getcwd(),
                grace=5,
                ranks=lambda: _rank_pids(result_dir),
                stacks=True,
            )
        except subprocess.TimeoutExpired:
            timed_out = True
        launcher_out = log.read_text(errors="replace") if log.exists() else ""
        elapsed = time.monotonic() - start

        results, problems, logs = [], [], []
        for rank in range(np):
            log_file = result_dir / f"rank{rank}.log"
            log = log_file.read_text(errors="replace") if log_file.exists() else "(rank never started)"
            logs.append(log)
            result_file = result_dir / f"rank{rank}.json"
            if result_file.exists():
                results.append(json.loads(result_file.read_text()))
            else:
                problems.append(f"rank {rank} did not report")

        if timed_out:
            problems.insert(0, f"timed out after {timeout:g} s; killed all processes")
        elif rc != 0:
            problems.insert(0, f"launcher exited with status {rc}")
        if problems:
            parts = [
                f"{launcher} run of {path.name} on {np} ranks failed after {elapsed:.1f} s: " + "; ".join(problems),
                "command: " + " ".join(cmd),
                "---- launcher output (tail) ----\n" + _tail(launcher_out or "(none)"),
            ]
            for rank, log in enumerate(logs):
                parts.append(f"---- rank {rank} output (tail) ----\n" + _tail(log or "(empty)"))
            pytest.fail("\n".join(parts), pytrace=False)
        return results
