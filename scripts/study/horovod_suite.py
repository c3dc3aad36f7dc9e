"""Horovod's own test suite with a horovod_alq compressor injected as every compression.

Usage::

    # upstream's tests are not in the PyPI sdist: take them from Horovod's repository, tag v0.28.1
    git clone --depth 1 --branch v0.28.1 https://github.com/horovod/horovod /tmp/horovod
    python -m scripts.study.horovod_suite --horovod-test-dir /tmp/horovod/test --framework torch
    python -m scripts.study.horovod_suite --horovod-test-dir /tmp/horovod/test --framework tensorflow
    python -m scripts.study.horovod_suite --horovod-test-dir /tmp/horovod/test --framework tensorflow-process-sets

Runs ``test/parallel/test_torch.py`` (or ``test_tensorflow.py``) under ``mpirun -np 2`` with this
file loaded into pytest as a plugin (``-p scripts.study.horovod_suite``) on every rank. The plugin wraps every
Horovod call that takes a ``compression=`` argument (torch: ``allreduce``, ``grouped_allreduce``,
``reducescatter``, ``grouped_reducescatter``, ``DistributedOptimizer``; TensorFlow: the same plus
``DistributedGradientTape``, ``PartialDistributedGradientTape``); where the argument is missing or
``Compression.none`` it becomes
``ALQCompressor(bits=3, bucket_size=512, min_size=16)`` (one compressor per test, made for the
global process set, by default). Calls without a ``compression=`` parameter (``allreduce_async``,
``allreduce_``, ...) are Horovod's own.

Every rank writes one JSON line per test (outcome, error, how many tensors the compressor
quantized); a per-test watchdog dumps every thread's stack and ends the rank when a test runs past
``--test-timeout`` (a hang), and the driver relaunches with the tests not yet run. After each test
the ranks wait for each other through those files (no collective): a test that failed on some ranks
only leaves the others inside it, so the launch ends there (their stacks are dumped) and the next
one starts with the next test. Hangs, crashes, such tests and (up to 10) apparent real problems are
re-run alone; non-passing tests are then re-run without the compressor (the baseline), and each is
put in a category:

* ``precision``: an assertion failed (no horovod_alq error), the compressor quantized tensors in
  the test, and the test passes without it: a quantized result compared with an exact one at
  upstream's tolerance (torch.allclose with rtol 0 and atol 1e-8 at 2 ranks, 1e-6 in TF);
* ``refusal``: a documented horovod_alq refusal that matches the test (op=Min/Max/Product or Adasum
  in a test of that op, hvd.join, reducescatter with compression);
* ``real``: anything else (a wrong error, a crash, a failure that is not quantization error);
* ``baseline``: fails without the compressor too (a torch / TF version newer than Horovod 0.28.1's);
* ``hang``: the watchdog fired.

``--tf-eager-only`` runs TensorFlow tests eagerly only: upstream's file ends with
``run_all_in_graph_and_eager_modes(TensorFlowTests)``, which runs each test first in a TF1 graph
with a session, then eagerly.

The report (markdown, ``--out``, default build/results/horovod_suite.md; docs/results/horovod_suite.md is
updated from it by hand) lists the command, date, versions, counts and every non-passing test; text
after the line ``<!-- notes -->`` in an existing report is kept. Results per framework are kept as
JSON in ``--results-dir`` (default build/results/data/horovod_suite; the committed runs:
docs/results/data/horovod_suite) so that one report covers every suite; the ranks' logs go to
``--work-dir`` (build/horovod_suite).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

from scripts.common import launch
from scripts.common import report as pages
from scripts.common.launch import RANK_ENV

ROOT = Path(__file__).resolve().parents[2]
NOTES_MARK = "<!-- notes -->"

RANK_ENV = {**RANK_ENV, "CUDA_VISIBLE_DEVICES": ""}
SUITES = {
    "torch": "test_torch.py",
    "tensorflow": "test_tensorflow.py",
    "tensorflow-process-sets": "test_tensorflow_process_sets.py",
}  # (static sets: its own hvd.init)
# environment of the plugin inside the ranks
ENV_OUT, ENV_SKIP, ENV_TIMEOUT, ENV_INJECT = (
    "HOROVOD_SUITE_OUT",
    "HOROVOD_SUITE_SKIP",
    "HOROVOD_SUITE_TEST_TIMEOUT",
    "HOROVOD_SUITE_INJECT",
)
MAX_ALONE = 10  # at most this many tests that look like real problems are re-run alone
SYNC_WAIT = 30  # seconds a rank that finished a test waits for the others to finish it
GRACE = 15  # seconds a rank whose watchdog fired waits (so the other ranks dump too) before it exits

# A refusal is expected only where the test asked for what is refused: (test-name pattern, message pattern).
REFUSALS = [
    (r"_min\b|_min_", r"op=Min"),
    (r"_max\b|_max_", r"op=Max"),
    (r"_product", r"op=(Max or )?Product"),
    (r"adasum", r"Adasum"),
    (r"join", r"join"),
    (r"reducescatter", r"reducescatter"),
    # a compressor made for the global set used in an allreduce over another set: the error must
    # name the process set, never an op the test did not pass
    (r"process_sets", r"(?s)^(?!.*op=(Min|Max|Product))(?=.*process set)"),
]
PREFIX = "horovod_alq"


# =============================================================================================
# The plugin (runs inside every rank's pytest)


class _Injector:
    """Wraps Horovod's functions that take ``compression=`` so that none / missing becomes ours."""

    def __init__(self, framework: str, factory, scope: str, internal: bool = False) -> None:
        self.framework, self.factory, self.scope, self.internal = framework, factory, scope, internal
        self.current = None
        self.calls = 0
        self.quantized = 0

    def compressor(self):
        if self.scope == "call" or self.current is None:
            compressor = self.factory()
            compress = compressor.compress

            def counting(tensor):  # counts the tensors the compressor will quantize
                self.count([tensor], compressor.min_size)
                return compress(tensor)

            compressor.compress = counting
            self.current = compressor
        return self.current

    def new_test(self) -> None:
        if self.scope == "test":
            self.current = None
        self.calls = self.quantized = 0

    def count(self, tensors, min_size: int) -> None:
        for t in tensors:
            try:
                if self.framework == "torch":
                    import torch

                    ok = (
                        t.dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64)
                        and t.numel() >= min_size
                        and not t.is_sparse
                    )
                else:
                    n = t.shape.num_elements()  # None: unknown in a graph; counted
                    ok = t.dtype.is_floating and (n is None or n >= min_size)
            except Exception:  # noqa: BLE001 - counting only
                ok = False
            self.quantized += int(ok)

    def wrap(self, module, name: str) -> None:
        import functools
        import inspect

        original = getattr(module, name, None)
        if original is None or getattr(original, "_horovod_suite", False):
            return
        signature = inspect.signature(original)
        if "compression" not in signature.parameters:
            return
        none = module.Compression.none

        internal = self.internal

        @functools.wraps(original)
        def wrapper(*args, **kwargs):
            bound = signature.bind(*args, **kwargs)
            given = bound.arguments.get("compression", none)
            caller = sys._getframe(1).f_globals.get("__name__", "")
            # the tests' own calls; never horovod_alq's (the exact allreduce in a compressed
            # allreduce's backward), Horovod's internal ones only with --internal
            ours = caller.startswith("horovod_alq") or (caller.startswith("horovod.") and not internal)
            if given is none and not ours:
                bound.arguments["compression"] = self.compressor()
                self.calls += 1
            return original(*bound.args, **bound.kwargs)

        wrapper._horovod_suite = True
        setattr(module, name, wrapper)


_STATE: dict = {}


def _rank() -> int:
    for key in ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "HOROVOD_RANK"):
        if key in os.environ:
            return int(os.environ[key])
    return 0


def _write(record: dict) -> None:
    f = _STATE.get("file")
    if f is not None:
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _install(framework: str) -> _Injector:
    bits = int(os.environ.get("HOROVOD_SUITE_BITS", "3"))
    bucket = int(os.environ.get("HOROVOD_SUITE_BUCKET", "512"))
    min_size = int(os.environ.get("HOROVOD_SUITE_MIN_SIZE", "16"))
    scope = os.environ.get("HOROVOD_SUITE_SCOPE", "test")
    internal = os.environ.get("HOROVOD_SUITE_INTERNAL", "0") == "1"
    if framework == "torch":
        # the public namespace only: Horovod's own internal calls (the allreduce in allgather's
        # backward, the optimizer's allreduce_async_) keep their own arguments
        import horovod.torch as hvd
        import horovod.torch.mpi_ops as mpi_ops

        from horovod_alq.torch import ALQCompressor

        modules = [hvd, mpi_ops] if internal else [hvd]
        names = ["allreduce", "grouped_allreduce", "reducescatter", "grouped_reducescatter", "DistributedOptimizer"]
    else:
        if os.environ.get("HOROVOD_SUITE_TF_EAGER", "0") == "1":
            # upstream ends test_tensorflow.py with run_all_in_graph_and_eager_modes(TensorFlowTests):
            # every test first in a TF1 graph with a session, then eagerly. Eager only: TF2's default
            from tensorflow.python.framework import test_util

            test_util.run_all_in_graph_and_eager_modes = lambda cls: cls
        import horovod.tensorflow as hvd

        from horovod_alq.tensorflow import ALQCompressor

        modules = [hvd]
        names = [
            "allreduce",
            "grouped_allreduce",
            "reducescatter",
            "grouped_reducescatter",
            "DistributedOptimizer",
            "DistributedGradientTape",
            "PartialDistributedGradientTape",
        ]
    injector = _Injector(
        framework, lambda: ALQCompressor(bits=bits, bucket_size=bucket, min_size=min_size), scope, internal
    )
    for module in modules:
        for name in names:
            injector.wrap(module, name)
    return injector


def pytest_configure(config) -> None:
    out = os.environ.get(ENV_OUT)
    if not out:
        return
    try:  # upstream's test/utils/common.py imports the `mock` backport; the standard library's is the same
        import mock  # noqa: F401
    except ImportError:
        import unittest.mock

        sys.modules["mock"] = unittest.mock
    rank = _rank()
    _STATE["rank"] = rank
    _STATE["file"] = open(Path(out) / f"rank{rank}.jsonl", "a", buffering=1)
    _STATE["hang_path"] = Path(out) / f"rank{rank}.stacks.txt"
    _STATE["timeout"] = float(os.environ.get(ENV_TIMEOUT, "180"))
    (Path(out) / f"rank{rank}.pid").write_text(str(os.getpid()))
    import faulthandler

    _STATE["usr1"] = open(_STATE["hang_path"], "a")
    faulthandler.register(signal.SIGUSR1, file=_STATE["usr1"], all_threads=True)  # asked by a rank that left
    framework = os.environ.get("HOROVOD_SUITE_FRAMEWORK", "torch")
    if os.environ.get(ENV_INJECT, "1") == "1":
        _STATE["injector"] = _install(framework)
    import horovod_alq

    _write(
        {
            "event": "configure",
            "rank": rank,
            "horovod_alq": horovod_alq.__file__,
            "inject": os.environ.get(ENV_INJECT, "1") == "1",
        }
    )


def pytest_collection_modifyitems(config, items) -> None:
    skip_file = os.environ.get(ENV_SKIP)
    if not skip_file or not Path(skip_file).exists():
        return
    done = set(Path(skip_file).read_text().split())
    keep = [i for i in items if i.nodeid not in done]
    dropped = [i for i in items if i.nodeid in done]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep


def _watchdog_fire(nodeid: str) -> None:
    import faulthandler

    with open(_STATE["hang_path"], "a") as f:
        f.write(f"=== rank {_STATE['rank']}: {nodeid} ran past {_STATE['timeout']:g} s; stacks:\n")
        f.flush()
        faulthandler.dump_traceback(file=f, all_threads=True)
        f.write("\n")
    _write({"event": "hang", "test": nodeid, "rank": _STATE["rank"]})
    time.sleep(GRACE)
    os._exit(75)


def _others_results(nodeid: str) -> dict:
    out = {}
    for path in Path(os.environ[ENV_OUT]).glob("rank*.jsonl"):
        for line in path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if rec.get("event") == "result" and rec.get("test") == nodeid:
                out[rec["rank"]] = rec["outcome"]
    return out


def _sync_with_others(nodeid: str, outcome: str) -> None:
    """Wait (through the result files, not a collective) until every rank has finished this test.

    A test that fails on some ranks only leaves the others inside it, waiting for collectives that
    never come (or pairing them with the next test's): then this launch ends here, and the driver
    relaunches with the next test. When every rank finished, leftover process sets of a test that
    raised before removing them are removed (on every rank: they are in step), so that the next
    test's hvd.add_process_set does not fail."""
    size = int(os.environ.get("OMPI_COMM_WORLD_SIZE", os.environ.get("HOROVOD_SIZE", "1")))
    deadline = time.monotonic() + SYNC_WAIT
    got = _others_results(nodeid)
    while len(got) < size and time.monotonic() < deadline:
        time.sleep(0.05)
        got = _others_results(nodeid)
    mixed = {("failed" if o in ("failed", "error") else "ok") for o in got.values()}
    if len(got) < size or len(mixed) > 1:
        _write({"event": "desync", "test": nodeid, "rank": _STATE["rank"], "outcomes": got})
        for r in range(size):  # where the ranks still in the test wait: their stacks
            if r not in got:
                try:
                    with open(_STATE["hang_path"].with_name(f"rank{r}.stacks.txt"), "a") as f:
                        f.write(
                            f"=== rank {r}: still in {nodeid} {SYNC_WAIT} s after rank {_STATE['rank']} "
                            f"finished it ({got.get(_STATE['rank'])}); stacks:\n"
                        )
                    os.kill(int(Path(os.environ[ENV_OUT], f"rank{r}.pid").read_text()), signal.SIGUSR1)
                except (OSError, ValueError):
                    pass
        time.sleep(3)
        os._exit(76)
    if "failed" in mixed:
        try:
            from horovod.common import process_sets as ps

            if ps._basics is not None and ps._basics.is_initialized():
                for pid in sorted(ps._basics._get_process_set_ids_and_ranks()):
                    if pid != 0:
                        ps.remove_process_set(ps._temp_process_set_object(pid))
        except Exception as err:  # noqa: BLE001 - best effort
            _write({"event": "cleanup-error", "test": nodeid, "rank": _STATE["rank"], "error": repr(err)})


def _runtest_protocol_wrapper():
    import pytest

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item, nextitem):
        if "file" not in _STATE:
            yield
            return
        import faulthandler
        import threading

        injector = _STATE.get("injector")
        if injector is not None:
            injector.new_test()
        _STATE["reports"] = []
        _write({"event": "start", "test": item.nodeid, "rank": _STATE["rank"]})
        timer = threading.Timer(_STATE["timeout"], _watchdog_fire, args=(item.nodeid,))
        timer.daemon = True
        timer.start()
        # backstop for a main thread that holds the GIL: dump and exit from C
        backstop = open(_STATE["hang_path"], "a")
        faulthandler.dump_traceback_later(_STATE["timeout"] + GRACE + 30, exit=True, file=backstop)
        start = time.monotonic()
        try:
            yield
        finally:
            faulthandler.cancel_dump_traceback_later()
            backstop.close()
            timer.cancel()
        outcome, phase, message = "passed", "call", ""
        for rep in _STATE["reports"]:
            if rep["outcome"] == "failed":
                outcome, phase, message = ("failed" if rep["when"] == "call" else "error"), rep["when"], rep["message"]
                break
            if rep["outcome"] == "skipped" and outcome == "passed":
                outcome, phase, message = "skipped", rep["when"], rep["message"]
        _write(
            {
                "event": "result",
                "test": item.nodeid,
                "rank": _STATE["rank"],
                "outcome": outcome,
                "phase": phase,
                "message": message,
                "seconds": round(time.monotonic() - start, 2),
                "calls": injector.calls if injector else 0,
                "quantized": injector.quantized if injector else 0,
            }
        )
        _sync_with_others(item.nodeid, outcome)

    return pytest_runtest_protocol


try:  # only where pytest is importable (the driver itself does not need it)
    pytest_runtest_protocol = _runtest_protocol_wrapper()
except ImportError:  # pragma: no cover
    pass


def pytest_runtest_logreport(report) -> None:
    if "reports" not in _STATE:
        return
    message = ""
    if report.outcome == "failed":
        message = report.longreprtext[-6000:]
    elif report.outcome == "skipped":
        lr = report.longrepr
        message = str(lr[2]) if isinstance(lr, tuple) and len(lr) == 3 else str(lr)
    _STATE["reports"].append({"when": report.when, "outcome": report.outcome, "message": message})


def pytest_sessionfinish(session, exitstatus) -> None:
    if "file" in _STATE:
        _write({"event": "finish", "rank": _STATE["rank"]})


# =============================================================================================
# The driver


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Categories and method: see the module docstring / docs/results/horovod_suite.md.",
    )
    p.add_argument(
        "--horovod-test-dir", type=Path, help="Horovod's test/ folder at tag v0.28.1 (holds parallel/ and utils/)"
    )
    p.add_argument("--framework", choices=sorted(SUITES), default="torch")
    p.add_argument("--np", type=int, default=2)
    p.add_argument("-k", dest="keyword", default=None, help="pytest -k expression (a subset)")
    p.add_argument(
        "--quick", action="store_true", help="a few tests only (allreduce, process sets, optimizer): a smoke run"
    )
    p.add_argument("--test-timeout", type=float, default=180, help="seconds per test before it counts as a hang")
    p.add_argument(
        "--alq-timeout",
        type=float,
        default=120,
        help="HOROVOD_ALQ_TIMEOUT in the ranks (below --test-timeout, so a bounded wait raises first)",
    )
    p.add_argument("--total-timeout", type=float, default=5400, help="seconds for all launches together")
    p.add_argument("--bits", type=int, default=3)
    p.add_argument("--bucket-size", type=int, default=512)
    p.add_argument("--min-size", type=int, default=16)
    p.add_argument(
        "--scope",
        choices=["test", "session", "call"],
        default="test",
        help="a compressor per test (default), one for the whole run, or one per call",
    )
    p.add_argument(
        "--internal",
        action="store_true",
        help="also Horovod's internal calls (the allreduce in allgather's / broadcast's backward)",
    )
    p.add_argument(
        "--tf-eager-only",
        action="store_true",
        help="TensorFlow: run each test eagerly only (upstream runs it in a TF1 graph with a session "
        "first, then eagerly); results under the label tensorflow-eager",
    )
    p.add_argument("--no-baseline", action="store_true", help="do not re-run non-passing tests without the compressor")
    p.add_argument(
        "--results-dir",
        type=Path,
        default=ROOT / "build" / "results" / "data" / "horovod_suite",
        help="the JSON per suite (the report is rebuilt from it); default build/results/data/horovod_suite, "
        "the committed runs: docs/results/data/horovod_suite",
    )
    p.add_argument("--work-dir", type=Path, default=ROOT / "build" / "horovod_suite", help="the ranks' logs")
    p.add_argument(
        "--out", type=Path, default=ROOT / "build" / "results" / "horovod_suite.md", help="default %(default)s"
    )
    p.add_argument(
        "--merge",
        action="store_true",
        help="replace only the tests run now in the framework's existing results (with -k)",
    )
    p.add_argument("--report-only", action="store_true", help="rewrite --out from the JSON in --results-dir")
    p.add_argument("--python", default=sys.executable)
    args = p.parse_args(argv)
    args.results_dir, args.out = args.results_dir.resolve(), args.out.resolve()  # the ranks run elsewhere
    args.work_dir = args.work_dir.resolve()
    return args


QUICK = "allreduce_average or allreduce_process_sets or optimizer_process_sets or test_horovod_allreduce_min"


def _stop_current(*_):
    """SIGTERM to the driver: the mpirun in flight is killed with it."""
    launch.kill_running()
    sys.exit(130)


def _launch(
    args,
    test_file: Path,
    out: Path,
    skip_file: Path,
    inject: bool,
    keyword: str | None,
    selection: list | None,
    deadline: float,
    log,
) -> int:
    env = {
        **os.environ,
        **RANK_ENV,
        ENV_OUT: str(out),
        ENV_SKIP: str(skip_file),
        ENV_TIMEOUT: str(args.test_timeout),
        ENV_INJECT: "1" if inject else "0",
        "HOROVOD_SUITE_FRAMEWORK": args.framework,
        "HOROVOD_SUITE_BITS": str(args.bits),
        "HOROVOD_SUITE_BUCKET": str(args.bucket_size),
        "HOROVOD_SUITE_MIN_SIZE": str(args.min_size),
        "HOROVOD_SUITE_SCOPE": args.scope,
        "HOROVOD_SUITE_INTERNAL": "1" if args.internal else "0",
        "HOROVOD_SUITE_TF_EAGER": "1" if args.tf_eager_only else "0",
        "HOROVOD_ALQ_TIMEOUT": str(args.alq_timeout),
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
    }
    cmd = [*launch.mpirun(args.np), args.python, "-m", "pytest", "-p", "scripts.study.horovod_suite", "-q", "-rN"]
    cmd += ["--no-header", "-p", "no:cacheprovider", *(selection or [test_file.name])]
    if keyword:
        cmd += ["-k", keyword]
    print(f"[launch] {'with' if inject else 'WITHOUT'} the compressor: {shlex.join(cmd)}", file=log, flush=True)
    try:
        return launch.run(cmd, log, max(30.0, deadline - time.monotonic()), env=env, cwd=test_file.parent, grace=10)
    except subprocess.TimeoutExpired:
        return -signal.SIGTERM


def _read(out: Path, np: int) -> tuple[dict, dict, set]:
    """Results per test per rank, tests started per rank, ranks that finished."""
    results: dict = {}
    started: dict = {}
    finished = set()
    for r in range(np):
        path = out / f"rank{r}.jsonl"
        if not path.exists():
            continue
        for line in path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if rec["event"] == "result":
                results.setdefault(rec["test"], {})[r] = rec
            elif rec["event"] == "start":
                started.setdefault(rec["test"], set()).add(r)
            elif rec["event"] == "hang":
                results.setdefault(rec["test"], {})[r] = {"outcome": "hang", "message": "watchdog fired", "rank": r}
            elif rec["event"] == "finish":
                finished.add(r)
            elif rec["event"] == "desync":
                results.setdefault(rec["test"], {}).setdefault("desync", rec.get("outcomes"))
    return results, started, finished


def run_suite(
    args,
    test_file: Path,
    out: Path,
    inject: bool,
    keyword: str | None,
    log,
    deadline: float,
    selection: list | None = None,
) -> dict:
    """Run (and relaunch past hangs and crashes) until every selected test has a result."""
    out.mkdir(parents=True, exist_ok=True)
    skip_file = out / "skip.txt"
    skip_file.write_text("")
    final: dict = {}
    launches = 0
    while time.monotonic() < deadline:
        launches += 1
        for f in out.glob("rank*"):
            f.unlink()
        rc = _launch(args, test_file, out, skip_file, inject, keyword, selection, deadline, log)
        results, started, finished = _read(out, args.np)
        stacks = {}
        for r in range(args.np):
            p = out / f"rank{r}.stacks.txt"
            if p.exists() and p.read_text().strip():
                stacks[r] = p.read_text()
        progressed = False
        for test in started:
            if test in final:
                continue
            progressed = True
            got = dict(results.get(test, {}))
            desync = got.pop("desync", None)
            if desync is not None and got and all(g["outcome"] != "hang" for g in got.values()):
                # some ranks failed, the others were left in the test (or passed): ended there
                final[test] = {
                    "ranks": got,
                    "desync": True,
                    "stacks": {r: st[-12000:] for r, st in stacks.items() if r not in got},
                }
            elif len(got) == args.np and all(g["outcome"] != "hang" for g in got.values()):
                final[test] = {"ranks": got}
            else:  # the launch ended inside this test: a hang (watchdog) or a crash
                kind = "hang" if any(g["outcome"] == "hang" for g in got.values()) else "crash"
                final[test] = {
                    "ranks": got,
                    "interrupted": kind,
                    "rc": rc,
                    "stacks": {r: st[-12000:] for r, st in stacks.items()},
                }
        skip_file.write_text("\n".join(final) + "\n")
        if len(finished) == args.np or not progressed or (selection and all(t in final for t in selection)):
            break
        print(f"[relaunch] launch {launches} ended (rc {rc}) after {len(final)} tests", file=log, flush=True)
    return final


def _passed(entry: dict) -> bool:
    return not entry.get("interrupted") and all(r["outcome"] in ("passed", "skipped") for r in entry["ranks"].values())


def classify(test: str, entry: dict, baseline: dict | None) -> tuple[str, str]:
    """(outcome, category) of one test from its ranks' records."""
    ranks = entry["ranks"]
    if entry.get("interrupted"):
        return entry["interrupted"], "hang" if entry["interrupted"] == "hang" else "real"
    outcomes = {r["outcome"] for r in ranks.values()}
    if outcomes == {"passed"}:
        return "passed", "passed"
    if outcomes <= {"skipped", "passed"}:
        return "skipped", "skipped"
    if baseline is not None and baseline.get("outcome") not in ("passed", None):
        return "failed", "baseline"  # fails without the compressor too: not ours to explain
    failing = [r.get("message", "") for r in ranks.values() if r["outcome"] in ("failed", "error")]
    messages = "\n".join(failing)
    name = test.rsplit("::", 1)[-1]
    if PREFIX in messages:
        every = len(failing) == len(ranks)  # a refusal is raised on every rank ...
        if entry.get("desync"):
            # ... that is still in the test: a rank left waiting counts only where it waits outside
            # horovod_alq (in the test's own next collective, after the other rank raised)
            stacks = entry.get("stacks") or {}
            every = every and bool(stacks) and all("horovod_alq" not in st for st in stacks.values())
        for test_pat, msg_pat in REFUSALS:
            if re.search(test_pat, name) and every and all(re.search(msg_pat, m) for m in failing):
                return "failed", "refusal"
        return "failed", "real"
    quantized = max(r.get("quantized", 0) for r in ranks.values())
    assertion = re.search(r"^E\s+(AssertionError|assert )", messages, re.M) is not None
    base_ok = baseline is not None and baseline.get("outcome") == "passed"
    if assertion and quantized > 0 and base_ok:
        return "failed", "precision"
    return "failed", "real"


def _run_summary(test: str, entry: dict, np: int) -> dict:
    """One launch's result for a test: its outcome, each rank's and the first error."""
    failing = [r.get("message", "") for _, r in sorted(entry["ranks"].items()) if r.get("outcome") != "passed"]
    return {
        "outcome": classify(test, entry, None)[0],
        "ranks": {str(r): entry["ranks"].get(r, {}).get("outcome", "left waiting") for r in range(np)},
        "error": _first_error(failing[0]) if failing else "",
    }


def _first_error(message: str) -> str:
    lines = [ln[1:].strip() for ln in message.splitlines() if ln.startswith("E ")]
    text = " ".join(lines) if lines else (message.strip().splitlines() or [""])[-1]
    return re.sub(r"\s+", " ", text)[:400]


def _where(message: str) -> str:
    """The last line of the upstream test file in a traceback: ``test_torch.py:123``."""
    hits = re.findall(r"(test_(?:torch|tensorflow)\.py):(\d+)", message)
    return f"{hits[-1][0]}:{hits[-1][1]}" if hits else ""


def _versions(python: str) -> dict:
    code = (
        "import json,platform,horovod,horovod_alq,pytest;v={'python':platform.python_version(),"
        "'horovod':horovod.__version__,'pytest':pytest.__version__}\n"
        "try:\n import torch;v['torch']=torch.__version__\nexcept Exception: pass\n"
        "try:\n import tensorflow as tf;v['tensorflow']=tf.__version__\nexcept Exception: pass\n"
        "print(json.dumps(v))"
    )
    env = {
        **os.environ,
        "TF_CPP_MIN_LOG_LEVEL": "3",
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
    }
    try:
        out = subprocess.run([python, "-c", code], env=env, capture_output=True, text=True, timeout=120).stdout
        v = json.loads(out.strip().splitlines()[-1])
    except Exception:  # noqa: BLE001
        v = {}
    try:
        v["horovod_alq commit"] = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip()
    except OSError:
        pass
    return v


def _compact_stack(text: str) -> list:
    """The header and the main thread's frames of a faulthandler dump, without pytest's own."""
    out, main = [], False
    for line in text.splitlines():
        if line.startswith("==="):
            out.append(line.split("; stacks:")[0])
            main = False
        elif line.startswith("Current thread") or line.startswith("Thread") and "most recent call first" in line:
            main = line.startswith("Current thread")
        elif (
            main
            and line.strip().startswith("File")
            and not any(k in line for k in ("_pytest", "pluggy", "unittest/case.py", "threading.py"))
        ):
            out.append("  " + line.strip())
    return out


CATEGORY_TEXT = {
    "precision": "expected precision failure (a quantized result compared with an exact one at upstream's tolerance; "
    "passes without the compressor)",
    "refusal": "expected refusal (a documented horovod_alq refusal of what the test asks for)",
    "real": "real problem",
    "hang": "hang (the per-test watchdog fired)",
}


def _run_cells(test: dict, np: int) -> tuple[str, str]:
    """The shared run's and the alone re-run's result of one test, as table cells."""

    def cell(run: dict | None) -> str:
        if not run:
            return "not re-run"
        ranks = set(run["ranks"].values())
        if ranks == {run["outcome"]}:
            return run["outcome"]
        return run["outcome"] + " (" + ", ".join(f"{r}: {o}" for r, o in sorted(run["ranks"].items())) + ")"

    shared = test.get("shared")
    if not isinstance(shared, dict):  # a report from before the per-run record: only the ranks of the final run
        shared = {
            "outcome": test["outcome"],
            "ranks": {str(r): test["ranks"].get(str(r), {}).get("outcome", "left waiting") for r in range(np)},
        }
    return cell(shared), cell(test.get("alone"))


INTRO = [
    "# Horovod's own test suite with ALQ injected as every compression",
    "",
    "Written by `scripts/study/horovod_suite.py` (its docstring has the method). Upstream's tests are not "
    "in the PyPI sdist; take them from Horovod's repository at the tag of the installed version:",
    "",
    "```",
    "git clone --depth 1 --branch v0.28.1 https://github.com/horovod/horovod /tmp/horovod",
    "```",
    "",
    "Every Horovod call with a `compression=` parameter (torch: `allreduce`, `grouped_allreduce`, "
    "`reducescatter`, `grouped_reducescatter`, `DistributedOptimizer`; TensorFlow: also "
    "`DistributedGradientTape`, `PartialDistributedGradientTape`) gets the compressor where the test passes "
    "none or `Compression.none`. "
    "Calls without that parameter (`allreduce_async`, `allreduce_`, `broadcast`, ...) stay Horovod's.",
    "",
    "Categories: **precision**: an assertion failed without a horovod_alq error, the compressor quantized "
    "tensors in the test, and the test passes when re-run without it (upstream compares the quantized sum "
    "with an exact one at `torch.allclose(rtol=0)`, atol 1e-8, for up to 3 ranks; 1e-6-scale in TF); "
    "**refusal**: horovod_alq's documented refusal of what the test asks for (op=Min/Max/Product, Adasum, "
    "`hvd.join`, reducescatter with compression, a compressor of the global set in an allreduce over another "
    "set when the error names the process set), raised on every rank; **baseline**: fails without the "
    "compressor too (torch or Horovod version, not horovod_alq); **real**: anything else; **hang**: the "
    "per-test watchdog fired (the ranks' stacks are dumped). The ranks are kept in step through their result "
    "files: a test that fails on some ranks only ends the launch (the ranks still in it dump their stacks, "
    "shown below) and the next launch goes on with the next test; a test that raised before removing its "
    "process sets has them removed. A hang, a crash, a test that failed on some ranks only, and (up to 10) "
    "tests that look like real problems are re-run alone in fresh processes; their category is from that "
    "run. Columns *shared run* and *alone re-run*: the test's outcome in the launch of the whole suite and "
    "in its re-run alone, with each rank's where the ranks differ (left waiting: still in the test 30 s "
    "after another rank finished it). The JSON behind each section is in `docs/results/data/horovod_suite/`.",
    "",
]
ORDER = ["passed", "precision", "refusal", "baseline", "real", "hang", "skipped"]


def write_report(results_dir: Path, out: Path) -> None:
    runs = sorted(
        (json.loads(path.read_text()) for path in results_dir.glob("*.json")),
        key=lambda run: (list(SUITES).index(run["framework"]), run["np"], run.get("label", "")),
    )
    notes = ""
    if out.exists() and NOTES_MARK in out.read_text():
        notes = out.read_text().split(NOTES_MARK, 1)[1]
    lines = INTRO + [line for run in runs for line in _run_section(run)] + [NOTES_MARK]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + (notes if notes else "\n"))


def _run_section(run: dict) -> list[str]:
    """One run's section: what ran, the tests that did not pass, every test, the stacks, the skips."""
    counts: dict = {}
    for t in run["tests"].values():
        counts[t["category"]] = counts.get(t["category"], 0) + 1
    label = run.get("label", run["framework"])
    mode = ""
    if label.startswith("tensorflow"):
        eager = "-eager" in label
        mode = (
            " (eagerly only: --tf-eager-only)"
            if eager
            else " (upstream's modes: each test in a TF1 graph with a session, then eagerly)"
        )
    lines = [
        f"## {run['framework']}, {run['np']} ranks: upstream test/parallel/{SUITES[run['framework']]}{mode}",
        "",
        f"- Command: `{run['command']}`",
        f"- Date: {run['date']}, {run['wall_s']:.0f} s, {run['np']} ranks (mpirun, CPU), {run['launches']} launch(es)",
        f"- Compressor: `{run['compressor']}`, {run['scope_text']}",
        "- Versions: " + ", ".join(f"{k} {v}" for k, v in run["versions"].items()),
        f"- Tests: {len(run['tests'])}: " + ", ".join(f"{k} {counts.get(k, 0)}" for k in ORDER),
        "",
    ]
    name = lambda n: f"`{n.rsplit('::', 1)[-1]}`"
    bad = [(n, t) for n, t in run["tests"].items() if t["category"] not in ("passed", "skipped")]
    if bad:
        cells = []
        for n, t in sorted(bad, key=lambda x: (ORDER.index(x[1]["category"]), x[0])):
            msg = t["error"].replace("|", "\\|")
            if t["category"] == "baseline":
                msg += f" (without the compressor: {t.get('baseline_error') or ''})".replace("|", "\\|")
            cells.append([name(n), t["category"], *_run_cells(t, run["np"]), t["where"], msg])
        head = ["test", "category", "shared run", "alone re-run", "where", "error (first rank that failed)"]
        lines += pages.table(head, cells) + [""]
    ran = sorted(n for n, t in run["tests"].items() if t["category"] != "skipped")
    lines += [
        f"Every test that ran ({len(ran)}), as the shared launch saw it and, where it was re-run alone in fresh "
        "processes, as that run saw it:",
        "",
    ]
    cells = [[name(n), *_run_cells(run["tests"][n], run["np"]), run["tests"][n]["category"]] for n in ran]
    lines += pages.table(["test", "shared run", "alone re-run", "category"], cells) + [""]
    for n, t in run["tests"].items():
        if t.get("stacks"):
            lines += [f"Where the ranks still in {name(n)} wait (main thread, innermost first):", "", "```"]
            lines += [line for _, st in sorted(t["stacks"].items()) for line in _compact_stack(st)] + ["```", ""]
    skipped = sorted(name(n) for n, t in run["tests"].items() if t["category"] == "skipped")
    if skipped:
        lines += ["Skipped (upstream's own skips: GPU, NCCL, gloo-only, ...): " + ", ".join(skipped), ""]
    return lines


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.report_only:
        write_report(args.results_dir, args.out)
        print(f"wrote {args.out}")
        return 0
    if args.horovod_test_dir is None:
        print("--horovod-test-dir is required (Horovod's test/ folder at v0.28.1; see the docstring)", file=sys.stderr)
        return 2
    test_dir = args.horovod_test_dir.resolve()
    parallel = test_dir / "parallel"
    test_file = (parallel if parallel.is_dir() else test_dir) / SUITES[args.framework]
    if not test_file.exists():
        print(f"{test_file} not found", file=sys.stderr)
        return 2
    args.results_dir.mkdir(parents=True, exist_ok=True)
    label = args.framework + ("-eager" if args.tf_eager_only and args.framework.startswith("tensorflow") else "")
    label += "" if args.np == 2 else f"-np{args.np}"
    log_path = args.work_dir / f"{label}.log"
    args.work_dir.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    signal.signal(signal.SIGTERM, _stop_current)
    with open(log_path, "w") as log:
        final, baseline = run_all(args, test_file, args.work_dir / label, log)
    launches = len(re.findall(r"^\[launch\]", log_path.read_text(), re.M))
    tests = {t: _test_record(t, e, baseline.get(t), args.np) for t, e in final.items()}
    shown = _command(args)
    previous = args.results_dir / f"{label}.json"
    if args.merge and previous.exists():
        old = json.loads(previous.read_text())
        for t in tests:
            tests[t]["rerun"] = date
        tests = {**old["tests"], **tests}
        shown = shlex.split(old["command"])
        date = f"{old['date']} (re-run {len(final)} test(s) {date}: `-k {args.keyword}`)"
        start -= old["wall_s"]  # wall time and launches: both runs
        launches += old["launches"]
    scopes = {
        "test": "a new one for every test",
        "session": "one for the whole run",
        "call": "a new one for every call",
    }
    run = {"framework": args.framework, "label": label, "command": shlex.join(shown), "date": date, "np": args.np}
    run.update(wall_s=time.monotonic() - start, launches=launches)
    run["compressor"] = f"ALQCompressor(bits={args.bits}, bucket_size={args.bucket_size}, min_size={args.min_size})"
    run.update(scope_text=scopes[args.scope], versions=_versions(args.python), tests=tests)
    (args.results_dir / f"{label}.json").write_text(json.dumps(run, indent=1))
    write_report(args.results_dir, args.out)
    counts: dict = {}
    for t in tests.values():
        counts[t["category"]] = counts.get(t["category"], 0) + 1
    print(f"{args.framework}: {len(tests)} tests: {counts}; report {args.out}, log {log_path}")
    return 0


def run_all(args, test_file: Path, work: Path, log) -> tuple[dict, dict]:
    """The suite with the compressor, its suspects again alone, and what still fails without it:
    (each test's final entry, the baseline's outcome and error of each test re-run without it)."""
    keyword = QUICK if args.quick and not args.keyword else args.keyword
    deadline = time.monotonic() + args.total_timeout
    # 1. the whole suite in one launch (relaunched past hangs and crashes)
    shared = run_suite(args, test_file, work / "alq", True, keyword, log, deadline)
    final = dict(shared)
    # 2. what looks like a real problem, a hang, a crash or a test that failed on some ranks only
    #    is re-run alone, in fresh processes (no state left by an earlier test)
    suspect = [t for t, e in shared.items() if not _passed(e) and (e.get("interrupted") or e.get("desync"))]
    real = [
        t
        for t, e in shared.items()
        if not _passed(e) and t not in suspect and classify(t, e, {"outcome": "passed"})[1] == "real"
    ]
    if len(real) <= MAX_ALONE:  # many alike: one cause, seen in step on every rank; not one launch each
        suspect += real
    for t in suspect:
        alone = run_suite(args, test_file, work / "alq-alone", True, None, log, deadline, selection=[t])
        if t in alone:
            final[t] = {**alone[t], "shared": shared[t], "alone": True}
    # 3. the baseline: what still fails, without the compressor (together, then alone)
    baseline: dict = {}
    redo = [t for t, e in final.items() if not _passed(e)]
    if redo and not args.no_baseline:
        base = run_suite(args, test_file, work / "baseline", False, None, log, deadline, selection=redo)
        for t in [t for t, e in base.items() if not _passed(e)]:
            base.update(run_suite(args, test_file, work / "baseline-alone", False, None, log, deadline, selection=[t]))
        for t, e in base.items():
            error = _first_error("\n".join(r.get("message", "") for r in e["ranks"].values()))
            baseline[t] = {"outcome": classify(t, e, None)[0], "error": error}
    return final, baseline


def _test_record(t: str, e: dict, baseline: dict | None, np: int) -> dict:
    """One test's record in the run's JSON."""
    outcome, category = classify(t, e, baseline)
    failing = [r for _, r in sorted(e["ranks"].items()) if r.get("outcome") in ("failed", "error", "hang")]
    msg = failing[0].get("message", "") if failing else ""
    if e.get("interrupted") == "crash":
        msg = msg or f"the launch ended inside this test (rc {e.get('rc')})"
    return {
        "outcome": outcome,
        "category": category,
        "error": _first_error(msg),
        "where": _where(msg),
        "baseline": (baseline or {}).get("outcome"),
        "baseline_error": (baseline or {}).get("error"),
        "shared": _run_summary(t, e["shared"] if e.get("alone") else e, np),
        "alone": _run_summary(t, e, np) if e.get("alone") else None,
        "stacks": e.get("stacks"),
        "ranks": {
            str(r): {k: v for k, v in rec.items() if k != "message"} | {"message": rec.get("message", "")[-3000:]}
            for r, rec in e["ranks"].items()
        },
    }


def _command(args) -> list[str]:
    """The command line as the report shows it: the options that differ from their defaults."""
    shown = ["python", "-m", "scripts.study.horovod_suite", "--horovod-test-dir", "<horovod>/test"]
    shown += ["--framework", args.framework]
    defaults = (("-k", args.keyword, None), ("--np", args.np, 2), ("--scope", args.scope, "test"))
    for flag, value, default in defaults + (("--test-timeout", args.test_timeout, 180),):
        if value != default:
            shown += [flag, str(value)]
    flags = (("--quick", args.quick), ("--internal", args.internal), ("--tf-eager-only", args.tf_eager_only))
    return shown + [flag for flag, on in flags if on]


if __name__ == "__main__":
    sys.exit(main())
