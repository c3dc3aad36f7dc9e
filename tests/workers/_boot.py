"""Per-rank entry point used by :func:`multiproc.run_ranks`; not a worker itself.

Usage (by the launcher, once per rank): python _boot.py WORKER [ARGS...]

Sends this rank's stdout and stderr to ``$HOROVOD_ALQ_RESULT_DIR/rank{N}.log``, records its pid
(so that a timed-out run can be killed even where the launcher put ranks in their own process
groups), has SIGUSR1 write every thread's Python stack to that log (``run_ranks`` asks for it
before it kills a timed-out run, so the test's failure shows where each rank waited), then runs
WORKER as ``__main__`` with ``sys.argv = [WORKER, *ARGS]`` and tests/workers, tests/ and WORKER's
folder on ``sys.path`` (the only place that sets a rank's path).
"""

from __future__ import annotations

import faulthandler
import os
import runpy
import signal
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
# the workers' folder (common) and tests/ (helpers), as setup.cfg's pythonpath gives the tests
sys.path[:0] = [str(HERE), str(HERE.parent)]

from common import RESULT_DIR_ENV, launcher_rank  # noqa: E402


def main() -> None:
    worker = Path(sys.argv[1])
    result_dir = Path(os.environ[RESULT_DIR_ENV])
    rank = launcher_rank()
    (result_dir / f"rank{rank}.pid").write_text(str(os.getpid()))
    log = os.open(result_dir / f"rank{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    faulthandler.register(signal.SIGUSR1, all_threads=True, chain=False)
    sys.argv = [str(worker), *sys.argv[2:]]
    if worker.parent != HERE:
        sys.path.insert(0, str(worker.parent))
    runpy.run_path(str(worker), run_name="__main__")


if __name__ == "__main__":
    main()
