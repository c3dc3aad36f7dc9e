#!/usr/bin/env python
"""Exit codes after an error, under load: does every rank end with the error's status, or does one
die at teardown (``terminate called without an active exception``, SIGABRT)? (Issue 56.)

Each error path (scripts/study/exit_workers.py: DiLoCo ranks with another ``sync_every``, alone or
followed by a checker's collectives on a second gloo group (issue 65), the DDP hook, FSDP2's
reduce-scatter comm and mpi4py's QuantizedAllreduce with another ``bits``, the hierarchical exchange
with another node layout, a rank that stops calling so that the other raises ``CollectiveTimeout``,
and every designed error of the Horovod PyTorch compressor, ``hvd-*``) runs ``--runs`` times on 2
ranks (torchrun; mpirun for mpi4py and Horovod) beside ``--burners`` processes that spin on the CPU
(started first, killed at the end, and each stops by itself after ``--burn-limit`` seconds). Every
rank runs under a shim that records its worker's own exit status and then exits 0, so that the
launcher never stops the other ranks: the statuses are the ranks' own. A rank that ends well exits
with 1 (the error, raised again after
``dist.destroy_process_group()``); a negative status is the signal that ended it.

    python -m scripts.study.exit_stress --runs 20 --out build/results/exit_stress.md
    python -m scripts.study.exit_stress --runs 20 --label "before the fix" --out build/results/exit_stress.md
    # the report goes by hand into docs/results/exit_stress.md (the page also holds #fault_campaign)
    python -m scripts.study.exit_stress --paths diloco --runs 5 --keep /tmp/exit-runs   # keep crashed runs' logs

Prints each run's statuses per rank; writes a Markdown page (one section per ``--label``: a table
of path x runs) and its raw data as JSON in data/ beside it, to which each run adds its section
(the committed runs: docs/results/data/exit_stress.json; copy it there first to add to them). Run
under ``nice -n 19`` on a shared machine.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import resource
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from scripts.common import launch
from scripts.study import exit_workers

ROOT = Path(__file__).resolve().parents[2]
TORCH_PATHS = ("diloco", "checked", "ddp", "fsdp", "hierarchical", "timeout")
HOROVOD_PATHS = tuple(f"hvd-{w}" for w in (*exit_workers.HOROVOD_MISMATCHES, "set", "outsider", "timeout"))
PATHS = (*TORCH_PATHS, "mpi", *HOROVOD_PATHS)
MPIRUN_PATHS = ("mpi", *HOROVOD_PATHS)  # launched by mpirun (Horovod over MPI), the others by torchrun
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
    """The launcher (torchrun; mpirun with scripts/common/launch.py's options for mpi4py), each rank
    the shim of ``python -m scripts.study.exit_workers PATH``."""
    python = sys.executable
    worker = [python, "-m", "scripts.study.exit_workers", path]
    rank = [python, "-m", "scripts.study.exit_stress", "--shim", str(out_dir), *(["--cores"] if cores else []), "--"]
    return [*(launch.mpirun(np) if path in MPIRUN_PATHS else launch.torchrun(np)), *rank, *worker]


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


def ensure_codec() -> None:
    """Build the compiled CPU codec for the current source now, if it is not built (in a process of
    its own, untimed): ranks that would build it themselves, after another process edited its
    source, take minutes before their error and overrun the launch's limit."""
    from horovod_alq.torch.codecs import cpu_build

    if not cpu_build.cached_library().exists():
        build = "from horovod_alq.torch.codecs import cpu_build; print(cpu_build.status())"
        subprocess.run(
            [sys.executable, "-c", build], cwd=ROOT, env=launch.rank_env(PYTHONFAULTHANDLER="1"), capture_output=True
        )


# ------------------------------------------------------------------ load
def start_burners(count: int, limit: float) -> list[subprocess.Popen]:
    """``count`` processes that spin on the CPU, each stopping by itself after ``limit`` seconds."""
    code = f"import time\nend = time.monotonic() + {float(limit)}\nwhile time.monotonic() < end:\n    pass\n"
    return [subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.DEVNULL) for _ in range(count)]


def stop_burners(burners: list[subprocess.Popen]) -> None:
    for b in burners:
        if b.poll() is None:
            b.kill()
        b.wait()


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


def summarize(path: str, runs: list[dict]) -> dict:
    """One row of the table: runs, clean runs (every rank exited 1), rank exits with 1, ranks ended
    by a signal, other rank statuses, hung runs, and the signals and other statuses seen."""
    flat = [s for r in runs for s in r["statuses"]]
    signals = [describe(s) for s in flat if s is not None and s < 0]
    others = [describe(s) for s in flat if s is None or s >= 0 and s != 1]
    return {
        "path": path,
        "runs": len(runs),
        "clean": sum(all(s == 1 for s in r["statuses"]) and not r["hung"] for r in runs),
        "exit1": sum(s == 1 for s in flat),
        "signals": len(signals),
        "other": len(others),
        "hung": sum(r["hung"] for r in runs),
        "hung_before": sum(r["hung"] and not all(r.get("raised_before_hang") or [False]) for r in runs),
        "seen": sorted(set(signals + others)),
        "seconds": round(sum(r["seconds"] for r in runs) / max(len(runs), 1), 1),
    }


def table(rows: list[dict], ranks: int) -> str:
    head = (
        f"| path | runs | clean runs (every rank exit 1) | rank exits 1 (of {ranks} x runs) | ranks ended by "
        "a signal | other rank statuses | hung runs | what else | s per run |\n|---|---|---|---|---|---|---|---|---|\n"
    )
    body = "".join(
        f"| {r['path']} | {r['runs']} | {r['clean']} | {r['exit1']} | {r['signals']} | {r['other']} | {_hung(r)} "
        f"| {', '.join(r['seen']) or '-'} | {r['seconds']} |\n"
        for r in rows
    )
    return head + body


def _hung(row: dict) -> str:
    """Hung runs, and how many had not raised their error on every rank when stopped (slow before the
    error, e.g. a C++ extension's build: not a teardown that hangs)."""
    before = row.get("hung_before", 0)
    return f"{row['hung']} ({before} before the error)" if before else str(row["hung"])


def section(label: str, data: dict) -> str:
    """A label's part of the page: its command, date, load, table and every run's statuses."""
    rows = [summarize(p, runs) for p, runs in data["runs"].items()]
    lines = [
        f"## {label}\n",
        f"`{data['command']}`, {data['date']}; {data['machine']}; {data['burners']} CPU burners beside the ranks; "
        f"{data['ranks']} ranks per run.\n",
        table(rows, data["ranks"]),
        *([data["note"] + "\n"] if data.get("note") else []),
        "Each run's statuses, rank 0 first (1: the error's exit; a name: the signal that ended the rank):\n",
    ]
    for p, runs in data["runs"].items():
        statuses = " ".join(
            "/".join(describe(s) for s in r["statuses"]) + ("(hung)" if r["hung"] else "") for r in runs
        )
        lines.append(f"- {p}: {statuses}")
    return "\n".join(lines) + "\n"


PAGE_HEAD = """# Exit codes after an error, under load

Every error path of the front-ends that run over torch.distributed or mpi4py, launched again and again
on 2 ranks beside CPU-burning processes, and how each rank ended: with the error's status (1), as it
should, or killed by a signal at teardown (`terminate called without an active exception`, SIGABRT:
issue 56). Made by `python -m scripts.study.exit_stress` (scripts/study/exit_stress.py; the ranks'
side: scripts/study/exit_workers.py); raw data: [data/exit_stress.json](data/exit_stress.json).
Who destroys which process group: [Troubleshooting](../guides/troubleshooting.md#exit-after-an-error).

Each rank runs under a shim that records its worker's own exit status and exits 0, so the launcher
never stops a rank because another one failed first. Paths: `diloco` (ranks with `sync_every` 5 and
10, the report), `ddp` and `fsdp` (`bits` 3 and 4), `hierarchical` (DiLoCo over
`exchange="hierarchical"`, rank 0 declaring a node per rank: its companion groups), `timeout` (rank 1
never reaches its outer step; rank 0 raises `CollectiveTimeout` after 3 s with its handshake in
flight), `mpi` (mpi4py's `QuantizedAllreduce`, `bits` 3 and 4, under mpirun); from issue 65:
`checked` (the `diloco` mismatch, then the checker's own `all_reduce` and `all_gather_object` on a
second gloo group, `dist.destroy_process_group()` and `sys.exit(1)`), and the Horovod PyTorch
compressor's designed errors under mpirun, `hvd-<what>`: rank 1's compressor differs in `bits`
(through `hvd.DistributedOptimizer`), `bucket`, `method`, `norm`, `levels`, `budget`, `allocation`
or `bits_max` (`hvd.allreduce`, the cases of tests/torch/test_compressor_ranks.py); `hvd-set` (a
compressor pinned to the global set in an allreduce over a rank's own set), `hvd-outsider` (pinned
to the set [0] in a global allreduce), `hvd-timeout` (rank 1 stops after the control allreduce; rank
0 raises `CollectiveTimeout` after 3 s). A launch past 120 s
counts as hung; "before the error" means its ranks had not raised their error yet when it was
stopped (the compiled codec being rebuilt after another process edited its source), not a
teardown that hangs.

"""


def write_page(out: Path, data_file: Path) -> None:
    sections = json.loads(data_file.read_text())["sections"]
    body = "\n".join(section(label, sections[label]) for label in sections)
    out.write_text(PAGE_HEAD + body)


# ------------------------------------------------------------------ the command
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=20, help="launches per path (default 20)")
    p.add_argument("--paths", default=",".join(PATHS), help=f"comma-separated, of {', '.join(PATHS)}")
    p.add_argument("--np", type=int, default=2, help="ranks per launch (default 2)")
    p.add_argument("--burners", type=int, default=2, help="CPU-burning processes beside the ranks (default 2)")
    p.add_argument("--burn-limit", type=float, default=3600, help="seconds after which a burner stops by itself")
    p.add_argument("--timeout", type=float, default=120, help="seconds per launch before it counts as hung")
    p.add_argument("--label", default="after the fix", help="the page's section for this run (replaced if there)")
    p.add_argument("--out", type=Path, help="the Markdown page (its data: data/exit_stress.json beside it)")
    p.add_argument("--keep", type=Path, help="keep the folders (logs, core files) of runs where a rank did not exit 1")
    p.add_argument("--shim", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--cores", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("command", nargs="*", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def stress(args) -> dict:
    """Every path ``args.runs`` times beside the burners; prints each run's statuses."""
    paths = [p for p in args.paths.split(",") if p]
    unknown = set(paths) - set(PATHS)
    if unknown:
        raise SystemExit(f"unknown paths: {', '.join(sorted(unknown))} (of {', '.join(PATHS)})")
    runs: dict[str, list[dict]] = {p: [] for p in paths}
    burners = start_burners(args.burners, args.burn_limit)
    try:
        for path in paths:
            for k in range(args.runs):
                if path != "mpi":
                    ensure_codec()
                r = run_once(path, args.np, args.timeout, args.keep)
                runs[path].append(r)
                shown = " ".join(f"rank {i}: {describe(s)}" for i, s in enumerate(r["statuses"]))
                extra = (" HUNG" if r["hung"] else "") + (" (terminate called)" if r["terminate"] else "")
                print(
                    f"{path} run {k + 1}/{args.runs}: {shown}; launcher {r['launcher']}; {r['seconds']} s{extra}",
                    flush=True,
                )
    finally:
        stop_burners(burners)
    return runs


def record(args, runs: dict, argv: list[str]) -> None:
    """Add this run to its section (``args.label``) of the JSON beside the page (the paths measured
    again replace theirs, the others stay), then rewrite the page."""
    import torch

    data_file = args.out.parent / "data" / "exit_stress.json"
    data_file.parent.mkdir(parents=True, exist_ok=True)
    saved = json.loads(data_file.read_text()) if data_file.exists() else {"sections": {}}
    command = "python -m scripts.study.exit_stress " + shlex.join(argv)
    old = saved["sections"].get(args.label, {})
    saved["sections"][args.label] = {
        "command": command if not old or set(runs) >= set(old["runs"]) else f"{old['command']}`, then `{command}",
        "date": dt.date.today().isoformat(),
        "machine": f"{os.cpu_count()} cores, Python {platform.python_version()}, torch {torch.__version__}",
        "burners": args.burners,
        "ranks": args.np,
        "runs": {**old.get("runs", {}), **runs},
        **({"note": old["note"]} if old.get("note") else {}),
    }
    data_file.write_text(json.dumps(saved, indent=1) + "\n")
    write_page(args.out, data_file)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if args.shim is not None:
        return shim(args.shim, args.command, args.cores)
    runs = stress(args)
    for path, results in runs.items():
        print(table([summarize(path, results)], args.np).splitlines()[-1])
    if args.out is not None:
        record(args, runs, argv)
    clean = all(summarize(p, r)["clean"] == len(r) for p, r in runs.items())
    return 0 if clean else 1


if __name__ == "__main__":
    sys.exit(main())
