"""The hierarchical exchanges across real processes: 4 ranks declared as 2 nodes x 2
(HOROVOD_ALQ_LOCAL_SIZE=2) through mpi4py, the Horovod PyTorch and TensorFlow compressors, the DDP
hook and FSDP2's reduce-scatter (node-aware): the exchange picked by exchange="auto" and the
hierarchical two-phase exchange asked for, identical results on every rank (FSDP2: one digest of
every rank's shard), unbiased, and a rank that declares another node layout raises on every rank.
TensorFlow also: the bytes of its plan (the PyTorch front-ends' too: tests/test_conformance.py),
one refit, and inputs whose node sums are 0 average to exactly 0 (only node sums are quantized)."""

import pytest
from helpers import assert_t_unbiased
from multiproc import run_ranks

from horovod_alq.core.quantizer import Quantizer
from horovod_alq.exchange import registry

LAUNCHERS = {"mpi": "mpi", "horovod": "mpi", "tf": "mpi", "ddp": "torchrun", "fsdp": "torchrun"}
EXCHANGE = {"fsdp": "hierarchical-reduce-scatter"}  # the others: "hierarchical"


TOGETHER = ("mpi", "horovod", "tf")  # the mpirun fronts: both exchanges in one launch, in turn
_LAUNCHES: dict = {}


def _launch(front: str, exchange: str) -> list:
    """Each rank's report of ``exchange`` through ``front`` (launches of TOGETHER's fronts are shared)."""
    exchanges = ("auto", "hierarchical-two-phase") if front in TOGETHER else (exchange,)
    key = (front, exchanges)
    if key not in _LAUNCHES:
        _LAUNCHES[key] = run_ranks(
            "hierarchical.py",
            np=4,
            launcher=LAUNCHERS[front],
            args=["--front", front, "--exchange", ",".join(exchanges)],
            env={"HOROVOD_ALQ_LOCAL_SIZE": "2"},
            timeout=400 * len(exchanges),
        )
    results = _LAUNCHES[key]
    return [r[exchange] for r in results] if len(exchanges) > 1 else results


@pytest.mark.multiproc
@pytest.mark.parametrize(
    "front, exchange",
    [*((f, "auto") for f in LAUNCHERS), *((f, "hierarchical-two-phase") for f in ("mpi", "horovod", "tf", "ddp"))],
)
def test_two_nodes_of_two_ranks(front, exchange):
    results = _launch(front, exchange)
    expected = EXCHANGE.get(front, "hierarchical") if exchange == "auto" else exchange
    assert [r["exchange"] for r in results] == [expected] * 4
    assert len({r["digest"] for r in results}) == 1, "the ranks' results differ"
    for r in results:
        assert_t_unbiased(r, ("t_plain", "t_buckets_max"), what=front)
    for rank, r in enumerate(results):
        assert r["mismatch"] is not None and "node layouts" in r["mismatch"], (rank, r["mismatch"])
    if front == "mpi":  # rank 0's codes garbled on the way to rank 2 only: both nodes raise in that round
        for rank, r in enumerate(results):
            assert r["broken_copy"] is not None and "horovod_alq: " in r["broken_copy"], (rank, r["broken_copy"])
        for r in results[:2]:  # the node that received intact codes: told by the other node's ranks
            assert "refusing to decode on every rank" in r["broken_copy"], r["broken_copy"]
    if front == "horovod":  # the handshake rides with the first stage (exchange/carrier.py): one buffer
        assert [r["collectives_per_round"] for r in results] == [registry.get(expected).stages] * 4
    if front == "tf":
        q = Quantizer("qsgdinf", 4, 256)  # the worker's bits and bucket size (payload sizes only)
        for rank, r in enumerate(results):
            plan = registry.get(expected).bytes(3000, rank, 4, q, local_size=2, status=False)  # TF sends no status
            assert (r["sent"], r["received"]) == plan, rank
            assert r["level_updates"] == 1 and r["levels"] == results[0]["levels"], rank
            assert r["cancelled_max"] == 0.0, (rank, r["cancelled_max"])
