"""``wire="entropy"`` on 2 real ranks (mpi4py): a fault on rank 0, in its coder or in flight in an
alltoall, makes every rank raise a protocol error naming it, within the exchange (no rank waits for
a timeout, none decodes other bytes). One launch of tests/workers/entropy_faults.py runs them all."""

import pytest
from multiproc import run_ranks

pytestmark = pytest.mark.multiproc

WHY = {
    "coder-other-bytes": "decoded CRC mismatch",
    "coder-undecodable": "rank 0: ValueError: ",
    "coder-raises": "RuntimeError: injected coder fault",
    "alltoall-in-flight": "checksum mismatch",
}


@pytest.fixture(scope="module")
def outcomes():
    return run_ranks("entropy_faults.py", np=2, timeout=240)


@pytest.mark.parametrize(
    "exchange, fault",
    [
        ("allgather", "coder-other-bytes"),
        ("allgather", "coder-undecodable"),
        ("allgather", "coder-raises"),
        ("two-phase", "coder-other-bytes"),
        ("two-phase", "coder-raises"),
        ("two-phase", "alltoall-in-flight"),
    ],
)
def test_a_fault_on_rank_0_raises_on_every_rank(outcomes, exchange, fault):
    """The allgather exchange: rank 0's own check refuses its frame and every rank raises naming
    rank 0 and the error. The two-phase exchange: rank 0's frame in the alltoall fails at rank 1 (the
    decoded bytes' CRC, the frame's CRC, or a refused frame), rank 1 poisons its second phase and
    both raise; a rank 0 whose coder raised fails its own share as well."""
    got = [o[f"{exchange}|{fault}"] for o in outcomes]
    for rank, o in enumerate(got):
        assert o.get("error") == "ValueError", (rank, o)  # mpi4py's protocol errors; not a timeout
        assert "did not complete within" not in o["message"], (rank, o)
    if exchange == "allgather":
        for o in got:
            assert "rank 0's entropy-coded payloads" in o["message"] and WHY[fault] in o["message"], o
    else:  # the receiver's warning names the frame and the fault; its check fails on the substitute
        assert any(WHY[fault] in w and "rank 0's entropy-coded payloads" in w for w in got[1]["warnings"]), got
        assert "the payload of rank 0 does not match" in got[1]["message"], got
        if fault == "coder-raises":  # rank 0 fails its own share
            assert any("this rank could not code its frames" in w for w in got[0]["warnings"]), got
            assert "the payload of rank 0 does not match" in got[0]["message"], got
        else:  # rank 0 learns it from rank 1's poisoned second phase
            assert "rank(s) [1] received invalid first-phase payloads" in got[0]["message"], got


def test_without_a_fault_the_ranks_agree(outcomes):
    got = [o["two-phase|none"] for o in outcomes]
    assert all("digest" in o for o in got) and got[0]["digest"] == got[1]["digest"], got
