"""The pipelined round (exchange/pipeline.py) across real Horovod processes: 2 ranks (allgather), 4
ranks (two-phase) and 4 ranks as 2 nodes x 2 (hierarchical): the pipelined rounds give bit for bit the unpipelined
rounds' results on every rank, with the collectives the chunking asks for, and a rank that cuts
its buffers into other chunks makes every rank raise (none hangs)."""

import pytest
from multiproc import run_ranks

from horovod_alq.exchange import registry
from horovod_alq.exchange.layout import plan_layout

SIZES, D = (150_000, 60_000, 7_001, 90_000), 512  # one fusion buffer
CHUNK = 1 << 18  # bytes: 65536 coordinates


@pytest.mark.multiproc
@pytest.mark.parametrize(
    "np_, local, exchange",
    [(2, None, "allgather"), (4, None, "two-phase"), (4, 2, "hierarchical")],
    ids=["2-ranks-allgather", "4-ranks-two-phase", "2x2-hierarchical"],
)
def test_pipelined_rounds_are_the_unpipelined_ones_on_real_ranks(np_, local, exchange):
    env = {"HOROVOD_ALQ_LOCAL_SIZE": str(local)} if local else {}
    results = run_ranks(
        "pipelined.py",
        np=np_,
        launcher="mpi",
        args=["--chunk", str(CHUNK), "--sizes", ",".join(map(str, SIZES)), "--bucket", str(D)],
        env=env,
        timeout=400,
    )
    length = plan_layout(list(SIZES), D, None).length
    chunks = -(-length // (CHUNK // 4))
    assert chunks > 2
    stages = registry.get(exchange).stages
    for rank, r in enumerate(results):
        assert r["plain_exchange"] == r["piped_exchange"] == exchange, rank
        assert r["piped"] == r["plain"] == results[0]["plain"], rank  # bit for bit, and the same on every rank
        # one buffer: its stages once per chunk, the handshake carried with the first
        assert r["plain_collectives"] == stages, rank
        assert r["piped_collectives"] == stages * chunks, rank
        assert r["mismatch"] is not None and "different chunks" in r["mismatch"], (rank, r["mismatch"])


@pytest.mark.multiproc
def test_pipelined_rounds_on_the_entropy_wire_on_real_ranks():
    """wire="entropy" on 2 Horovod ranks (allgather): each chunk's frames coded when it is issued and
    decoded in its wait give the unpipelined rounds' results bit for bit, on every rank; the byte
    counters add up (each rank's frames reach the other; a header more per added chunk); a frame of
    chunk 2 that rank 0's coder breaks makes every rank raise, naming it, after the last chunk."""
    fault = 2
    results = run_ranks(
        "pipelined.py",
        np=2,
        launcher="mpi",
        args=["--chunk", str(CHUNK), "--sizes", ",".join(map(str, SIZES)), "--bucket", str(D)]
        + ["--wire", "entropy", "--fault-chunk", str(fault)],
        timeout=400,
    )
    length = plan_layout(list(SIZES), D, None).length
    chunks = -(-length // (CHUNK // 4))
    assert chunks > fault
    for rank, r in enumerate(results):
        assert r["plain_exchange"] == r["piped_exchange"] == "allgather", rank
        assert r["piped"] == r["plain"] == results[0]["plain"], rank
        # one stage per chunk, and the handshake's own allreduce (not carried on the entropy wire)
        assert r["plain_collectives"] == 2 and r["piped_collectives"] == chunks + 1, rank
        plain, piped = r["plain_counters"], r["piped_counters"]
        assert piped["wire_fixed_bytes"] == plain["wire_fixed_bytes"] + (chunks - 1) * 32, (rank, plain, piped)
        assert piped["bytes_sent"] == piped["wire_coded_bytes"] < piped["wire_fixed_bytes"], (rank, piped)
        assert piped["bytes_received"] == results[1 - rank]["piped_counters"]["bytes_sent"], rank
        assert f"ag0-{fault}" in r["fault"] and "rank 0's entropy-coded payloads" in r["fault"], (rank, r["fault"])
        assert r["mismatch"] is not None and "different chunks" in r["mismatch"], (rank, r["mismatch"])
