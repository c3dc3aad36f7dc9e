"""mpi4py's QuantizedAllreduce with scales= (preconditioned quantization) on 2 ranks: unbiased,
identical on every rank; scales that differ between ranks, given on one rank only, holding NaN or
of a wrong shape raise on every rank (naming the array where the input is bad), none hangs."""

from __future__ import annotations

import pytest
from helpers import same, t_bound
from multiproc import run_ranks

pytestmark = pytest.mark.multiproc


@pytest.fixture(scope="module")
def ranks():
    return run_ranks("precondition_mpi.py", np=2, launcher="mpi", timeout=300)


def test_unbiased_and_identical(ranks):
    r = ranks[0]
    assert r["t_max"] < t_bound(r["reps"], 32), r
    for key in ("first", "listed", "digest", "after"):
        assert same(ranks, lambda x: x[key]), key
    assert r["digest"] != 0


@pytest.mark.parametrize(
    "case, match",
    [
        ("differ", "preconditioning scales"),
        ("one_rank", "preconditioning scales"),
        ("nan", None),
        ("shape", None),
    ],
)
def test_disagreement_raises_on_every_rank(ranks, case, match):
    for r in ranks:
        e = r[case]
        assert e["raised"] and e["type"] == "ValueError", (case, r["rank"], e)
        if match:
            assert match in e["message"], e
    # the rank with the bad input names the array and the problem
    bad = {"nan": (1, "precondition scale of x holds NaN"), "shape": (0, "precondition scale of x has shape")}
    if case in bad:
        who, text = bad[case]
        assert text in ranks[who][case]["message"], ranks[who][case]
