"""mpi4py's QuantizedAllreduce: after a mismatch (another ``bits`` on rank 1) every rank exits with the
error's status, never a signal (issue 56), a few runs in a row under mpirun (tests/workers/exit_workers.py;
every rank's own status recorded by the shim of tests/exit_ranks.py)."""

from __future__ import annotations

import pytest
from exit_ranks import describe, run_once

pytestmark = pytest.mark.multiproc


def test_every_rank_exits_with_the_errors_status(tmp_path):
    pytest.importorskip("mpi4py")
    for k in range(3):
        result = run_once("mpi", np=2, timeout=60, keep=tmp_path)
        assert [describe(s) for s in result["statuses"]] == ["1", "1"] and not result["hung"], (k, result)
