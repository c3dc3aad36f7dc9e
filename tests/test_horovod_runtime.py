"""Stock Horovod runs here: 2-rank collectives over MPI and Gloo with exact results."""

from __future__ import annotations

import numpy as np
import pytest
from multiproc import run_ranks

pytestmark = pytest.mark.multiproc

NP = 2


def expected(n: int) -> dict:
    """What the workers' collectives must give on n ranks (see tests/workers/hvd_*_collectives.py)."""
    x = [np.array([r + 1.0, 10.0 * (r + 1), -float(r), 0.25]) for r in range(n)]
    rows = [np.arange((r + 1) * 3, dtype=np.float64).reshape(r + 1, 3) + 100.0 * r for r in range(n)]
    return {
        "sum": sum(x).tolist(),
        "average": (sum(x) / n).tolist(),
        "int_sum": [sum(r + 1 for r in range(n)), sum(1000 * r for r in range(n)), -(2**40) * n],
        "gather": np.concatenate(rows).tolist(),
    }


def check_controller(result: dict, launcher: str) -> None:
    assert result["size"] == NP
    assert result["mpi_enabled"] == (launcher == "mpi")
    assert result["gloo_enabled"] == (launcher == "gloo")


@pytest.mark.parametrize("launcher", ["mpi", "gloo"])
def test_torch_allreduce_allgather(launcher):
    results = run_ranks("hvd_torch_collectives.py", np=NP, launcher=launcher)
    want = expected(NP)
    assert [r["rank"] for r in results] == list(range(NP))
    for result in results:
        check_controller(result, launcher)
        assert result["sum"] == want["sum"]  # [3, 30, -1, 0.5] on 2 ranks
        assert result["average"] == want["average"]  # [1.5, 15, -0.5, 0.25]
        assert result["int_sum"] == want["int_sum"]
        assert result["gather"] == want["gather"]  # 1 row from rank 0, then 2 from rank 1
        assert result["gather_dtype"] == "torch.float64"


def test_tensorflow_allreduce_allgather_mpi():
    results = run_ranks("hvd_tf_collectives.py", np=NP, launcher="mpi")
    want = expected(NP)
    for rank, result in enumerate(results):
        assert result["rank"] == rank
        check_controller(result, "mpi")
        assert result["sum"] == want["sum"]
        assert result["average"] == want["average"]
        assert result["gather"] == want["gather"]
