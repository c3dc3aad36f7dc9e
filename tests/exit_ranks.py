#!/usr/bin/env python
"""Exit codes after an error: does every rank end with the error's status, or does one die at
teardown (``terminate called without an active exception``, SIGABRT)? (Issue 56.) The harness of
tests/torch/test_exit_codes.py and tests/mpi/test_mpi_exit_codes.py.

:func:`run_once` launches one error path of tests/workers/exit_workers.py on 2 ranks (torchrun;
mpirun for mpi4py and Horovod), every rank under this file's shim (``--shim``) that records its
worker's own exit status and then exits 0, so that the launcher never stops the other ranks: the
statuses are the ranks' own. A rank that ends well exits with 1 (the error, raised again after
``dist.destroy_process_group()``); a negative status is the signal that ended it.

This was scripts/study/exit_stress.py; its 20-run campaign beside CPU burners, which wrote
docs/results/exit_stress.md, was retired in d5446c3 (``git show d5446c3:scripts/study/exit_stress.py``).
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from scripts.common import launch

HERE = Path(__file__).resolve().parent
STATUS = "rank{}.status"
LOG = "rank{}.log"
PID = "rank{}.pid"
RAISED = "the expected error"  # what a rank of exit_workers prints once it caught its error


# ------------------------------------------------------------------ the rank's side
def rank_of_environment() -> int:
    for var in ("RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK"):
        if var in os.environ:
            return int(os.environ[var])
    raise RuntimeError("no rank in the environment: run the shim under torchrun or mpirun")


def shim(out_dir: Path, command: list[str], cores: bool) -> int:
    """Run ``command`` (this rank's worker) with its output in ``rank{N}.log``, record its exit
    status in ``rank{N}.status`` (negative: the signal that ended it) and return 0: the launcher
    sees every rank succeed and stops none of them."""
    rank = rank_of_environment()
    for sig in (signal.SIGTERM, signal.SIGINT):  # a launcher's stop is for the worker to answer
        signal.signal(sig, signal.SIG_IGN)

    def limits() -> None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        if cores:
            resource.setrlimit(resource.RLIMIT_CORE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))

    with open(out_dir / LOG.format(rank), "wb") as log:
        proc = subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, cwd=out_dir, preexec_fn=limits
        )
        (out_dir / PID.format(rank)).write_text(f"{os.getpid()} {proc.pid}")  # for a launch that overruns
        status = proc.wait()
    (out_dir / STATUS.format(rank)).write_text(str(status))
    return 0


# ------------------------------------------------------------------ launching
def launch_command(path: str, np: int, out_dir: Path, cores: bool) -> list[str]:
    """The launcher (torchrun; mpirun with scripts/common/launch.py's options for mpi4py and Horovod),
    each rank this file's shim around ``python tests/workers/exit_workers.py PATH``."""
    python = sys.executable
    worker = [python, str(HERE / "workers" / "exit_workers.py"), path]
    rank = [python, str(Path(__file__).resolve()), "--shim", str(out_dir), *(["--cores"] if cores else []), "--"]
    mpirun = path == "mpi" or path.startswith("hvd-")  # Horovod over MPI, mpi4py; the others by torchrun
    return [*(launch.mpirun(np) if mpirun else launch.torchrun(np)), *rank, *worker]


def run_once(path: str, np: int = 2, timeout: float = 120.0, keep: Path | None = None) -> dict:
    """One launch of ``path`` on ``np`` ranks: each rank's own exit status (None: none recorded),
    the launcher's, the seconds, whether it hung (killed after ``timeout``) and whether a rank's log
    shows the abort's message. With ``keep``, a run where a rank did not exit 1 keeps its folder
    (logs, core files) there."""
    out_dir = Path(tempfile.mkdtemp(prefix=f"exit-stress-{path}-"))
    start = time.monotonic()
    raised = None

    def stopping() -> list[int]:
        """At a hang, before the kill: whether each rank had raised its error yet; then the pids to
        kill, every shim's and worker's (torchrun starts its ranks in sessions of their own)."""
        nonlocal raised
        raised = [RAISED in _text(out_dir / LOG.format(r)) for r in range(np)]
        return [int(p) for f in out_dir.glob("rank*.pid") for p in _text(f).split()]

    try:
        launcher = launch.run(
            launch_command(path, np, out_dir, cores=keep is not None),
            out_dir / "launcher.log",
            timeout,
            env=launch.rank_env(PYTHONFAULTHANDLER="1"),
            ranks=stopping,
        )
    except subprocess.TimeoutExpired:
        launcher = None
    hung = launcher is None
    statuses = []
    for rank in range(np):
        f = out_dir / STATUS.format(rank)
        statuses.append(int(f.read_text()) if f.exists() else None)
    logs = "".join(_text(f) for f in out_dir.glob("rank*.log"))
    result = {
        "statuses": statuses,
        "launcher": launcher,
        "seconds": round(time.monotonic() - start, 1),
        "hung": hung,
        "terminate": "terminate called" in logs,
        **({"raised_before_hang": raised} if hung else {}),
    }
    if keep is not None and any(s != 1 for s in statuses):
        keep.mkdir(parents=True, exist_ok=True)
        result["kept"] = str(shutil.move(str(out_dir), keep / out_dir.name))
    else:
        shutil.rmtree(out_dir, ignore_errors=True)
    return result


def _text(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


# ------------------------------------------------------------------ the table
def describe(status: int | None) -> str:
    """A rank's status in words: "1", "0", "3", "SIGABRT", "none" (no status: the shim was killed)."""
    if status is None:
        return "none"
    if status < 0:
        try:
            return signal.Signals(-status).name
        except ValueError:
            return f"signal {-status}"
    return str(status)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shim", type=Path, required=True, help="the launch's folder: run COMMAND as this rank")
    p.add_argument("--cores", action="store_true", help="allow core files")
    p.add_argument("command", nargs="+", help="the rank's worker")
    args = p.parse_args(argv)
    return shim(args.shim, args.command, args.cores)


if __name__ == "__main__":
    sys.exit(main())
