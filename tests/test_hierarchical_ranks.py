"""The hierarchical exchanges across real processes: 4 ranks declared as 2 nodes x 2
(HOROVOD_ALQ_LOCAL_SIZE=2) through mpi4py, the Horovod PyTorch compressor, the DDP hook and FSDP2's
reduce-scatter (node-aware): the exchange picked by exchange="auto" and the hierarchical two-phase
exchange asked for, identical results on every rank (FSDP2: one digest of every rank's shard),
unbiased, and a rank that declares another node layout raises on every rank."""

import pytest
from helpers import assert_t_unbiased
from multiproc import run_ranks

LAUNCHERS = {"mpi": "mpi", "horovod": "mpi", "ddp": "torchrun", "fsdp": "torchrun"}
EXCHANGE = {"fsdp": "hierarchical-reduce-scatter"}  # the others: "hierarchical"


@pytest.mark.multiproc
@pytest.mark.parametrize(
    "front, exchange",
    [*((f, "auto") for f in LAUNCHERS), *((f, "hierarchical-two-phase") for f in ("mpi", "horovod", "ddp"))],
)
def test_two_nodes_of_two_ranks(front, exchange):
    results = run_ranks(
        "hierarchical.py",
        np=4,
        launcher=LAUNCHERS[front],
        args=["--front", front, "--exchange", exchange],
        env={"HOROVOD_ALQ_LOCAL_SIZE": "2"},
        timeout=400,
    )
    expected = EXCHANGE.get(front, "hierarchical") if exchange == "auto" else exchange
    assert [r["exchange"] for r in results] == [expected] * 4
    assert len({r["digest"] for r in results}) == 1, "the ranks' results differ"
    for r in results:
        assert_t_unbiased(r, ("t_plain", "t_buckets_max"), what=front)
    for rank, r in enumerate(results):
        assert r["mismatch"] is not None and "node layouts" in r["mismatch"], (rank, r["mismatch"])
