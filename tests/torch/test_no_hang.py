"""No hang, and the right error, whatever ranks create (3 real ranks, Horovod torch, mpirun):
collective names follow the order in which each process first *uses* its compressors of a process
set, so ranks that created different compressors still pair; a compressor used over another process
set raises on every member naming the set; a rank that stops calling in the middle of a round makes
the others raise after HOROVOD_ALQ_TIMEOUT instead of waiting forever (worker: torch_no_hang.py)."""

from __future__ import annotations

import pytest

from multiproc import run_ranks

pytestmark = pytest.mark.multiproc


@pytest.fixture(scope="module")
def ranks():
    return run_ranks("torch_no_hang.py", np=3, launcher="mpi", timeout=180, env={"HOROVOD_ALQ_TIMEOUT": "4"})


def test_uneven_compressor_creation_pairs(ranks):
    for r in ranks:
        u = r["uneven"]
        assert u["global_rel"] < 0.05, u  # 8 bits: the quantized mean of all three ranks
        if r["rank"] in (0, 1):
            assert u["ps01_rel"] < 0.05, u
    assert len({r["uneven"]["digest"] for r in ranks}) == 1  # identical results on every rank


def test_compressor_of_another_process_set_names_it(ranks):
    for r in ranks[:2]:
        err = r["wrong_set"]["error"]
        assert err is not None and "over 2 of the 3 ranks of the compressor's process set [0, 1, 2]" in err, err
        assert "ranks [2]" in err and "op=" not in err, err  # names the set, not an op never passed


def test_rank_that_stops_mid_round_times_out_on_the_others(ranks):
    assert ranks[2]["stop"]["stopped"]
    for r in ranks[:2]:
        s = r["stop"]
        err = s["error"]
        assert err is not None and "handshake" in err and "did not complete within 4 s" in err, err
        assert "over process set [0, 1, 2]" in err and "stopped calling" in err, err
        assert 4 <= s["seconds"] < 30, s
