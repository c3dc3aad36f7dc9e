#!/usr/bin/env python
"""Fault campaign (issue 65): kill -9 one rank in the middle of training and see how every other rank
ends: does it raise, and how long after the kill, against the configured timeout
(``$HOROVOD_ALQ_TIMEOUT``)?

Each front-end of scripts/study/fault_workers.py (``hvd``: Horovod PyTorch under mpirun; ``ddp``,
``fsdp``: under torchrun; ``mpi``: mpi4py under mpirun) runs ``--runs`` times on ``--np`` ranks, each
rank under the shim of scripts/study/exit_stress.py (its own exit status recorded; the launcher never
stops a rank). Once rank ``--victim`` has printed ``round --after``, its process gets SIGKILL; the
other ranks are watched until each has ended or ``--limit`` seconds have passed (then the launch is
killed and the rank counts as still waiting).

    python -m scripts.study.fault_campaign --runs 5 --out build/results/fault_campaign.md
    # the report goes by hand into docs/results/exit_stress.md#fault_campaign

Writes a Markdown page (a table per front-end, every run's outcome) and its raw data as JSON in
data/ beside it (the committed runs: docs/results/data/fault_campaign.json). Run under ``nice -n 19``
on a shared machine.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from scripts.common import launch
from scripts.study.exit_stress import LOG, PID, STATUS, _text, describe, ensure_codec, start_burners, stop_burners
from scripts.study.fault_workers import PATHS, TORCHRUN

RAISED = re.compile(r"^raised (\d+\.\d+) (.*)$", re.M)


def launch_command(path: str, np: int, out_dir: Path) -> list[str]:
    python = sys.executable
    shim = [python, "-m", "scripts.study.exit_stress", "--shim", str(out_dir), "--"]
    worker = [python, "-m", "scripts.study.fault_workers", path]
    return [*(launch.torchrun(np) if path in TORCHRUN else launch.mpirun(np)), *shim, *worker]


def kill_once(path: str, np: int, victim: int, after: int, timeout: float, limit: float) -> dict:
    """One launch: SIGKILL to rank ``victim``'s worker once it printed ``round after``; then each other
    rank's end: its status, and the seconds from the kill to its ``raised`` line."""
    out_dir = Path(tempfile.mkdtemp(prefix=f"fault-{path}-"))
    env = launch.rank_env(HOROVOD_ALQ_TIMEOUT=f"{timeout:g}", PYTHONFAULTHANDLER="1")
    with open(out_dir / "launcher.log", "w") as log:
        proc = subprocess.Popen(
            launch_command(path, np, out_dir),
            env=env,
            cwd=launch.ROOT,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    start, killed_at, others = time.monotonic(), None, [r for r in range(np) if r != victim]
    try:
        while time.monotonic() - start < limit:
            if killed_at is None and f"round {after}\n" in _text(out_dir / LOG.format(victim)):
                worker = int(_text(out_dir / PID.format(victim)).split()[1])
                os.kill(worker, signal.SIGKILL)
                killed_at = time.time()
            ended = all((out_dir / STATUS.format(r)).exists() for r in others)
            if ended or (proc.poll() is not None and killed_at is None):
                break
            time.sleep(0.1)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            pass
    finally:
        pids = [int(p) for f in out_dir.glob("rank*.pid") for p in _text(f).split()]
        launch.signal_pids([*pids, proc.pid], signal.SIGKILL)
        proc.wait()
    ranks = []
    for r in range(np):
        f = out_dir / STATUS.format(r)
        status = int(f.read_text()) if f.exists() else None
        ended = None if status is None or killed_at is None else round(f.stat().st_mtime - killed_at, 2)
        found = RAISED.search(_text(out_dir / LOG.format(r)))
        ranks.append(
            {
                "rank": r,
                "killed": r == victim,
                "status": status,
                "ended_after_kill": ended,
                "after_kill": None if found is None or killed_at is None else round(float(found[1]) - killed_at, 2),
                "error": None if found is None else found[2][:240],
            }
        )
    shutil.rmtree(out_dir, ignore_errors=True)
    return {"killed": killed_at is not None, "ranks": ranks, "seconds": round(time.monotonic() - start, 1)}


def outcome(run: dict, timeout: float, slack: float) -> str:
    """A run in words: each surviving rank's end."""
    if not run["killed"]:
        return "the victim never reached the round (no kill)"
    parts = []
    for r in run["ranks"]:
        if r["killed"]:
            continue
        if r["after_kill"] is not None:
            within = "within" if r["after_kill"] <= timeout + slack else "PAST"
            parts.append(
                f"rank {r['rank']} raised {r['after_kill']} s after the kill ({within} the timeout): {r['error']}"
            )
        elif r["status"] is None:
            parts.append(f"rank {r['rank']} still waiting at the limit (killed)")
        else:
            after = r.get("ended_after_kill")
            when = f" {after} s after the kill" if after is not None else ""
            parts.append(f"rank {r['rank']} ended with {describe(r['status'])}{when}, no error printed")
    return "; ".join(parts)


def good(run: dict, timeout: float, slack: float) -> bool:
    return run["killed"] and all(
        r["after_kill"] is not None and r["after_kill"] <= timeout + slack for r in run["ranks"] if not r["killed"]
    )


def write_page(out: Path, data: dict) -> None:
    lines = [
        "# Fault campaign: a rank killed mid-training\n",
        "Made by `python -m scripts.study.fault_campaign` (scripts/study/fault_campaign.py; the ranks' side:",
        "scripts/study/fault_workers.py); raw data: [data/fault_campaign.json](data/fault_campaign.json).",
        "Each run: 2 ranks train (Horovod PyTorch's DistributedOptimizer with ALQCompressor under mpirun;",
        "the DDP hook and FSDP2's reduce-scatter comm under torchrun; mpi4py's QuantizedAllreduce under",
        "mpirun), each rank under the exit_stress shim; once rank 1 has printed its round 3 its process gets",
        "SIGKILL, and the other rank is watched: it should raise within the timeout",
        "(`HOROVOD_ALQ_TIMEOUT`). *Within* means at most the timeout plus the slack below after the kill.\n",
        f"`{data['command']}`, {data['date']}; {data['machine']}; {data['burners']} CPU burners beside the ranks; "
        f"timeout {data['timeout']:g} s, slack {data['slack']:g} s.\n",
        "| front-end | runs | every other rank raised within the timeout | seconds from kill to raise |",
        "|---|---|---|---|",
    ]
    for path, runs in data["runs"].items():
        delays = [
            r["after_kill"] for run in runs for r in run["ranks"] if not r["killed"] and r["after_kill"] is not None
        ]
        shown = f"{min(delays)} to {max(delays)}" if delays else "-"
        ok = sum(good(run, data["timeout"], data["slack"]) for run in runs)
        lines.append(f"| {path} | {len(runs)} | {ok} | {shown} |")
    lines.append("")
    if data.get("note"):
        lines += [data["note"], ""]
    lines.append("Every run:\n")
    for path, runs in data["runs"].items():
        for k, run in enumerate(runs):
            lines.append(f"- {path} run {k + 1}: {outcome(run, data['timeout'], data['slack'])}")
    out.write_text("\n".join(lines) + "\n")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--paths", default=",".join(PATHS), help=f"comma-separated, of {', '.join(PATHS)}")
    p.add_argument("--np", type=int, default=2)
    p.add_argument("--victim", type=int, default=1, help="the rank killed (default 1)")
    p.add_argument("--after", type=int, default=3, help="kill once the victim printed this round")
    p.add_argument("--timeout", type=float, default=10.0, help="HOROVOD_ALQ_TIMEOUT for the ranks (s)")
    p.add_argument("--slack", type=float, default=5.0, help="seconds past the timeout still counted within")
    p.add_argument("--limit", type=float, default=180.0, help="seconds per launch")
    p.add_argument("--burners", type=int, default=2)
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    paths = [x for x in args.paths.split(",") if x]
    runs: dict[str, list[dict]] = {x: [] for x in paths}
    burners = start_burners(args.burners, 3600)
    try:
        for path in paths:
            for k in range(args.runs):
                ensure_codec()
                run = kill_once(path, args.np, args.victim, args.after, args.timeout, args.limit)
                runs[path].append(run)
                print(f"{path} run {k + 1}/{args.runs}: {outcome(run, args.timeout, args.slack)}", flush=True)
    finally:
        stop_burners(burners)
    if args.out is not None:
        import torch

        data_file = args.out.parent / "data" / "fault_campaign.json"
        old = json.loads(data_file.read_text()) if data_file.exists() else {}
        data = {
            "command": "python -m scripts.study.fault_campaign " + shlex.join(argv),
            "date": dt.date.today().isoformat(),
            "machine": f"{os.cpu_count()} cores, Python {platform.python_version()}, torch {torch.__version__}",
            "burners": args.burners,
            "timeout": args.timeout,
            "slack": args.slack,
            "runs": {**old.get("runs", {}), **runs},
            **({"note": old["note"]} if old.get("note") else {}),
        }
        data_file.parent.mkdir(parents=True, exist_ok=True)
        data_file.write_text(json.dumps(data, indent=1) + "\n")
        write_page(args.out, data)
    return 0 if all(good(r, args.timeout, args.slack) for rs in runs.values() for r in rs) else 1


if __name__ == "__main__":
    sys.exit(main())
