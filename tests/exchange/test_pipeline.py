"""The pipelined round (exchange/pipeline.py), ranks as threads over the compiled CPU codec: a large
buffer cut into chunks gives bit for bit the unpipelined round's results, with the collectives the
chunking asks for; ranks cut alike or raise, and bad payloads raise on every rank."""

import numpy as np
import pytest
import torch

from horovod_alq.core.protocol import ProtocolError
from horovod_alq.exchange import pipeline
from horovod_alq.settings import Settings, configure
from horovod_alq.testing import Hub, start_early
from horovod_alq.torch.ops import TorchOps

pytestmark = pytest.mark.skipif(
    TorchOps(torch.device("cpu"), "auto").codec.name != "cpu", reason="the compiled CPU codec is unavailable"
)

SIZES = (3000, 1100, 70, 2090)  # 6260 coordinates: one fusion buffer
D = 64


def _engines(ranks, chunk, exchange, **kw):
    kw.setdefault("update_steps", (0,))
    kw.setdefault("update_every", 0)
    settings = Settings("alq", 3, D, seed=1, exchange=exchange, pipeline_bytes=4 * chunk, **kw)
    return [configure(settings).engine(uid="t") for _ in range(ranks)]


def _rounds(ranks, rounds, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [[[torch.randn(n, generator=g) for n in SIZES] for _ in range(ranks)] for _ in range(rounds)]


def _run(ranks, rounds, chunk, exchange, g=None, early=False, ops=None, scales=None, **kw):
    """Every rank's outputs per round, and the round's own collectives (by name) per round."""
    engines = _engines(ranks, chunk, exchange, **kw)
    ops = ops or [TorchOps(torch.device("cpu"), "cpu")] * ranks
    if early:
        start_early(engines, ops[0])
    hub = Hub(ranks, timeout=20.0, local_size=g, variable_sizes=True)
    outs, counts = [], []
    for step, tensors in enumerate(rounds):
        before = {n for n in hub._got if n.startswith("horovod_alq.")}
        outs.append(_round(engines, tensors, ops, f"r{step}", hub, scales))
        counts.append(len({n for n in hub._got if n.startswith("horovod_alq.")} - before))
    return outs, counts


def _round(engines, tensors, ops, tag, hub, scales=None):
    def rank(r, t):
        entries = [
            engines[r].add(
                x, x.numel(), tuple(x.shape), "float32", t, ident=k, scale=None if scales is None else scales[k]
            )
            for k, x in enumerate(tensors[r])
        ]
        reduced = [t.allreduce_sum(v, f"{tag}.control{k}") for k, (_, v) in enumerate(entries)]
        return [engines[r].finish(e, v, ops[r], t)[0] * 1 for (e, _), v in zip(entries, reduced)]

    return hub.outcomes(rank)


def _same(a, b):
    for ra, rb in zip(a, b):
        for xa, xb in zip(ra, rb):
            assert not isinstance(xa, BaseException) and not isinstance(xb, BaseException), (xa, xb)
            for ta, tb in zip(xa, xb):
                assert torch.equal(ta, tb)


@pytest.mark.parametrize(
    "exchange, ranks, g, chunk, k",
    [
        ("allgather", 2, None, 2000, 4),
        ("allgather", 3, None, 6000, 2),
        ("hierarchical", 4, 2, 1500, 5),
        ("two-phase", 3, None, 1500, 5),
        ("two-phase", 4, None, 3000, 3),
    ],
)
def test_pipelined_rounds_equal_the_unpipelined_ones_bit_for_bit(exchange, ranks, g, chunk, k):
    rounds = _rounds(ranks, 3)  # round 0 refits (its statistics from the pipelined decode), then new levels
    plain, n_plain = _run(ranks, rounds, 0, exchange, g)
    piped, n_piped = _run(ranks, rounds, chunk, exchange, g)
    _same(plain, piped)
    stages = {"hierarchical": 3, "two-phase": 2}.get(exchange, 1)
    # one buffer: its stages once per chunk instead of once (the handshake rides with the first)
    assert [n + (k - 1) * stages for n in n_plain] == n_piped
    for out in piped:  # identical on every rank
        for r in range(1, ranks):
            for a, b in zip(out[0], out[r]):
                assert torch.equal(a, b)


@pytest.mark.parametrize("exchange, ranks, g", [("allgather", 2, None), ("hierarchical", 4, 2), ("two-phase", 3, None)])
def test_preconditioned_pipelined_rounds_equal_the_unpipelined_ones(exchange, ranks, g):
    """Scales w (precondition=): each chunk quantizes x * w read in place, the decode divides by w."""
    gen = torch.Generator().manual_seed(7)
    scales = [torch.rand(n, generator=gen) + 0.25 for n in SIZES]
    rounds = _rounds(ranks, 2, seed=5)
    plain, n_plain = _run(ranks, rounds, 0, exchange, g, scales=scales)
    piped, n_piped = _run(ranks, rounds, 1500, exchange, g, scales=scales)
    _same(plain, piped)
    assert n_piped[1] > n_plain[1]


def test_chunks_cut_whole_buckets_and_small_buffers_stay_whole():
    assert pipeline.cuts(10, 10 + 5 * D + 3, 3, D) == [
        (10, 10 + 2 * D),
        (10 + 2 * D, 10 + 4 * D),
        (10 + 4 * D, 13 + 5 * D),
    ]
    small, n_small = _run(2, _rounds(2, 1), 10_000, "allgather")
    plain, n_plain = _run(2, _rounds(2, 1), 0, "allgather")
    _same(plain, small)
    assert n_small == n_plain


def test_early_buffers_and_precondition_free_rounds_pipeline_alike():
    """Small fusion buffers started early stay whole; the round's big last buffer is pipelined."""
    rounds = _rounds(2, 2, seed=3)
    plain, _ = _run(2, rounds, 0, "allgather", early=True, fusion_bytes=4 * 4200)
    piped, _ = _run(2, rounds, 1000, "allgather", early=True, fusion_bytes=4 * 4200)
    _same(plain, piped)


def test_ranks_that_cut_differently_raise_on_every_rank():
    """A rank without a codec that encodes ranges (plain torch ops) cuts nothing: every rank raises."""
    ops = [TorchOps(torch.device("cpu"), "cpu"), TorchOps(torch.device("cpu"), "torch")]
    outs, _ = _run(2, _rounds(2, 1), 1000, "allgather", ops=ops)
    for out in outs[0]:
        assert isinstance(out, ProtocolError) and "chunks" in str(out), out


def _corrupting(module, tag, rank, only=None):
    """``module.chunked_steps`` with ``rank``'s collective ``tag`` carrying a payload whose header is
    broken (in the copy to rank ``only`` alone, if given)."""
    real = module.chunked_steps

    def corrupt(job, *args):
        steps = real(job, *args)
        request = next(steps)
        while True:
            inner = request.request
            if job.transport.rank == rank and inner.tag == tag:
                payload = inner.payload.clone()
                blocks = inner.splits if hasattr(inner, "splits") else [int(payload.numel())]
                for to, (start, size) in enumerate(zip(np.cumsum([0, *blocks[:-1]]), blocks)):
                    if size and only in (None, to):  # the header's bucket size, in the copy every receiver gets
                        payload[int(start) + 8] ^= 0x7F
                fields = (payload, inner.splits, inner.received) if hasattr(inner, "splits") else (payload, inner.sizes)
                request = type(request)(type(inner)(*fields, inner.tag))
            try:
                request = steps.send((yield request))
            except StopIteration as stop:
                return stop.value

    return real, corrupt


def test_a_chunk_broken_only_on_its_way_to_one_node_raises_on_every_node():
    """Rank 1's quantized node sum of chunk 2 reaches rank 3 (the other node) broken and rank 1
    itself intact: rank 3's node raises, and rank 1's node learns it from rank 3's status byte."""
    from horovod_alq.exchange import hierarchical

    real, corrupt = _corrupting(hierarchical, "h2-0-2", 1, only=3)
    hierarchical.chunked_steps = corrupt
    try:
        outs, counts = _run(4, _rounds(4, 1), 1500, "hierarchical", 2)
    finally:
        hierarchical.chunked_steps = real
    for r in range(4):
        assert isinstance(outs[0][r], ProtocolError), (r, outs[0][r])
    assert "rank(s) [3]" in str(outs[0][0]) and "rank(s) [3]" in str(outs[0][1]), outs[0][:2]
    assert counts == [3 * 5]  # every chunk's three collectives issued: none waits


@pytest.mark.parametrize(
    "exchange, ranks, g, tag, count, where",
    [
        ("allgather", 2, None, "ag0-2", 7, "chunk 2 of buffer 0"),
        # rank 1's quantized node sum of its shard's chunk 2 reaches the shard's owners on both nodes
        # (ranks 1 and 3) broken: each poisons what it forwards in its node, and every rank refuses
        ("hierarchical", 4, 2, "h2-0-2", 3 * 5, "buffer 0"),
        # rank 1's chunk 2 of every shard reaches each shard's owner broken: each poisons its second phase
        ("two-phase", 3, None, "a2a0-2", 2 * 5, "chunk 2 of shard"),
    ],
)
def test_an_invalid_chunk_raises_on_every_rank_after_the_last_collective(exchange, ranks, g, tag, count, where):
    """A broken payload in a chunk: every rank raises, after the buffer's last collective (none waits)."""
    from horovod_alq.exchange import allgather, hierarchical, two_phase

    module = {"allgather": allgather, "hierarchical": hierarchical, "two-phase": two_phase}[exchange]
    real, corrupt = _corrupting(module, tag, 1)
    module.chunked_steps = corrupt
    try:
        outs, counts = _run(ranks, _rounds(ranks, 1), 1000 if exchange == "allgather" else 1500, exchange, g)
    finally:
        module.chunked_steps = real
    for r in range(ranks):
        assert isinstance(outs[0][r], ProtocolError) and where in str(outs[0][r]), (r, outs[0][r])
    assert counts == [count]  # the handshake carried with the first chunk's first collective: all issued
