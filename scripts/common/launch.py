"""One host's launch, shared by the tests, the studies and the benchmarks: the Open MPI options and the
rank environment, the mpirun and torchrun command lines, and :func:`run`, which runs a launcher in a
process group of its own and kills that group (and the ranks it names) on a timeout, with their
stacks first if asked.

Shared memory and loopback only, no InfiniBand probing; no single-copy (CMA) shared memory, which
containers often forbid; root allowed; one thread per library in every rank (2 ranks on 2 cores
must not oversubscribe). ``python -m scripts.common.launch ARGS`` runs ``mpirun`` with these options
and ARGS (the Makefile's ``MPIRUN``).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def open_mpi_major() -> int | None:
    """The major version of the ``mpirun`` on PATH when it is Open MPI's, else None."""
    try:
        out = subprocess.run(["mpirun", "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    found = re.search(r"Open MPI\)?\s+v?(\d+)\.", out)
    return int(found.group(1)) if found else None


#: Open MPI 5's runtime (PRRTE) finds no interface for its own messages when told to use the
#: loopback only ("No network interfaces were found for out-of-band communications"), so only
#: older versions are told to.
MPI_OPTIONS: tuple[str, ...] = (
    ("--allow-run-as-root", "--oversubscribe", "--bind-to", "none", "--mca", "btl", "self,vader,tcp")
    + ("--mca", "btl_vader_single_copy_mechanism", "none", "--mca", "btl_tcp_if_include", "lo")
    + (("--mca", "oob_tcp_if_include", "lo") if (open_mpi_major() or 4) < 5 else ())
)
RANK_ENV: dict[str, str] = {
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "TF_NUM_INTRAOP_THREADS": "1",
    "TF_NUM_INTEROP_THREADS": "1",
    "TF_CPP_MIN_LOG_LEVEL": "2",
    "PYTHONUNBUFFERED": "1",
    "OMPI_ALLOW_RUN_AS_ROOT": "1",
    "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
    # studies, benchmarks and tests quantize every round (compress="always") unless a run says otherwise
    "HOROVOD_ALQ_COMPRESS": "always",
}


def tool(name: str) -> str:
    """``name`` next to this Python (the venv's bin/) if it is there, else the name (found on PATH)."""
    local = Path(sys.executable).parent / name
    return str(local) if local.exists() else name


def mpirun(np: int, env: Mapping[str, str] | None = None, yield_when_idle: int | None = None) -> list[str]:
    """``mpirun`` with :data:`MPI_OPTIONS` for ``np`` ranks on this host; ``env`` exported to the
    ranks with ``-x``; ``yield_when_idle``: Open MPI's ``mpi_yield_when_idle`` (ranks that share
    cores must yield, not spin). Append the program and its arguments."""
    cmd = [tool("mpirun"), *MPI_OPTIONS, "-np", str(np)]
    if yield_when_idle is not None:
        cmd += ["--mca", "mpi_yield_when_idle", str(yield_when_idle)]
    for k, v in (env or {}).items():
        cmd += ["-x", f"{k}={v}"]
    return cmd


def torchrun(np: int) -> list[str]:
    """``torchrun`` for ``np`` ranks on this host (``--standalone`` picks a free port); ``--no-python``:
    append the whole command, the interpreter included."""
    return [tool("torchrun"), "--standalone", "--nproc-per-node", str(np), "--no-python"]


def flags(args, *names: str) -> list[str]:
    """``--name value`` for each attribute ``name`` of ``args`` (underscores as dashes), None left out:
    a driver's options passed on to its workers."""
    out = []
    for name in names:
        if getattr(args, name) is not None:
            out += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    return out


def rank_env(**extra: str) -> dict[str, str]:
    """This process's environment, :data:`RANK_ENV`, the repository on PYTHONPATH, then ``extra``."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, **RANK_ENV, "PYTHONPATH": path, **extra}


def signal_pids(pids: Iterable[int], sig: int) -> None:
    """Send ``sig`` to each pid and to its process group where that is not ours (launchers such as
    torchrun and horovodrun start ranks in sessions of their own)."""
    own = os.getpgrp()
    for pid in pids:
        try:
            if os.getpgid(pid) != own:
                os.killpg(os.getpgid(pid), sig)
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def dump_stacks(pids: Iterable[int]) -> None:
    """Ask each process for its threads' Python stacks (SIGUSR1, which it must have given to
    ``faulthandler.register``) and give them a moment to write."""
    asked = False
    for pid in pids:
        try:
            os.kill(pid, signal.SIGUSR1)
            asked = True
        except (ProcessLookupError, PermissionError):
            pass
    if asked:
        time.sleep(1.0)


def run(
    cmd: list[str],
    log,
    timeout: float,
    *,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike = ROOT,
    watch: Callable[[], None] | None = None,
    poll: float = 1.0,
    grace: float = 0.0,
    ranks: Callable[[], Iterable[int]] | None = None,
    stacks: bool = False,
    cleanup: Callable[[], None] | None = None,
) -> int:
    """Run ``cmd`` in a session of its own, stdout and stderr to ``log`` (a path or an open file),
    and return its exit status. ``watch()`` is called every ``poll`` seconds while it runs and may
    raise to stop it. Past ``timeout`` seconds, or when ``watch`` (or anything) raises, the launch
    is stopped: with ``stacks`` the ``ranks()`` pids asked for their stacks (:func:`dump_stacks`),
    then SIGTERM to the group and those pids, SIGKILL after ``grace`` seconds (at once with 0),
    then ``cleanup()``; a timeout raises ``subprocess.TimeoutExpired``, anything else is raised
    again."""
    out = open(log, "w") if isinstance(log, (str, os.PathLike)) else log
    proc = subprocess.Popen(
        cmd, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
    )
    start = time.monotonic()
    try:
        while True:
            try:
                return proc.wait(timeout=min(poll, max(0.01, start + timeout - time.monotonic())))
            except subprocess.TimeoutExpired:
                pass
            if time.monotonic() - start > timeout:
                raise subprocess.TimeoutExpired(cmd, timeout)
            if watch is not None:
                watch()
    except BaseException:
        _stop(proc, grace, ranks, stacks)
        if cleanup is not None:
            cleanup()
        raise
    finally:
        if out is not log:
            out.close()


def _stop(proc: subprocess.Popen, grace: float, ranks: Callable[[], Iterable[int]] | None, stacks: bool) -> None:
    """Stacks of ``ranks()`` first if asked, then SIGTERM (with ``grace``) and SIGKILL to them and
    the group (``ranks()`` asked again each time: a rank still starting may have come since)."""
    pids = (lambda: list(ranks())) if ranks is not None else list
    if stacks:
        dump_stacks(pids())
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 30.0)):
        if wait <= 0:
            continue
        signal_pids(pids(), sig)
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            pass


def output(cmd: list[str], timeout: float, **kw) -> tuple[int, str]:
    """:func:`run` with the output kept: (exit status, output); a timeout's ``TimeoutExpired``
    carries it as ``output``."""
    with tempfile.TemporaryFile("w+", errors="replace") as f:
        try:
            rc = run(cmd, f, timeout, **kw)
        except subprocess.TimeoutExpired as e:
            f.seek(0)
            e.output = f.read()
            raise
        f.seek(0)
        return rc, f.read()


def resumable(cmd: list[str], path: Path, timeout: float) -> str | None:
    """A sweep's launch that writes its JSON to ``path``: skipped (None) if ``path`` exists, so an
    interrupted sweep resumes; else ``cmd`` runs with ``path``.part in it (``{json}``), which replaces
    ``path`` once the launch succeeds; its output. RuntimeError with the output's end on a failure."""
    if path.exists():
        print(f"[skip] {path.name} exists", flush=True)
        return None
    part = Path(f"{path}.part")
    cmd = [str(part) if c == "{json}" else c for c in cmd]
    print(f"[run] {' '.join(cmd)}", flush=True)
    start = time.monotonic()
    rc, out = output(cmd, timeout, env=rank_env(PYTHONWARNINGS="ignore"))
    if rc != 0 or not part.exists():
        raise RuntimeError(f"launch failed (rc {rc}):\n{out[-3000:]}")
    os.replace(part, path)
    print(f"[done] {time.monotonic() - start:.0f} s", flush=True)
    return out


if __name__ == "__main__":
    os.execvpe(tool("mpirun"), [tool("mpirun"), *MPI_OPTIONS, *sys.argv[1:]], {**os.environ, **RANK_ENV})
