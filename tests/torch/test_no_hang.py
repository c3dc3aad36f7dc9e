"""No hang, and the right error, whatever ranks create (3 real ranks, Horovod torch, mpirun):
collective names follow the order in which each process first *uses* its compressors of a process
set, so ranks that created different compressors still pair; a compressor made without process_set=
serves every process set it is used with (state per set), one pinned to a set raises on every member
of another set, naming the set; a rank that stops calling in the middle of a round makes
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


def test_one_compressor_serves_every_process_set(ranks):
    a = [r["any_set"] for r in ranks]
    for r, s in enumerate(a):
        assert s["global_rel"] < 0.05 and s["alone_rel"] < 0.05, s  # 8 bits: the quantized means
        assert s["state_round_trip"], s
    for r, s in enumerate(a[:2]):
        assert s["ps01_rel"] < 0.05, s
        assert s["sets"] == sorted(["0,1", str(r)]), s  # a compressor per set this rank used
        assert s["ps01_updates"] >= 2, s  # the set refits its own levels (steps 0 and 2)
    assert a[2]["sets"] == ["2"], a[2]
    assert a[0]["ps01_digest"] == a[1]["ps01_digest"] and a[0]["model_digest"] == a[1]["model_digest"]
    assert a[0]["set_levels"]["0,1"] == a[1]["set_levels"]["0,1"]  # the set's levels agree
    assert len({s["global_digest"] for s in a}) == 1  # identical results on every rank


def test_compressor_pinned_to_another_process_set_names_it(ranks):
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
