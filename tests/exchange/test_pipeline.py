"""The pipelined round (exchange/pipeline.py), ranks as threads over the compiled CPU codec: a large
buffer cut into chunks gives bit for bit the unpipelined round's results, with the collectives the
chunking asks for; ranks cut alike or raise, and bad payloads raise on every rank."""

import numpy as np
import pytest
import torch

from horovod_alq.core.protocol import ProtocolError
from horovod_alq.core.wire import HEADER_SIZE
from horovod_alq.exchange import pipeline
from horovod_alq.settings import Settings, configure
from horovod_alq.testing import Hub, start_early
from horovod_alq.torch.ops import TorchOps

pytestmark = pytest.mark.skipif(
    TorchOps(torch.device("cpu"), "auto").codec.name != "cpu", reason="the compiled CPU codec is unavailable"
)

SIZES = (3000, 1100, 70, 2090)  # 6260 coordinates: one fusion buffer
D = 64


def _engines(ranks, chunk, exchange, d=D, **kw):
    kw.setdefault("update_steps", (0,))
    kw.setdefault("update_every", 0)
    settings = Settings("alq", 3, d, seed=1, exchange=exchange, pipeline_bytes=4 * chunk, **kw)
    return [configure(settings).engine(uid="t") for _ in range(ranks)]


def _rounds(ranks, rounds, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [[[torch.randn(n, generator=g) for n in SIZES] for _ in range(ranks)] for _ in range(rounds)]


def _run(ranks, rounds, chunk, exchange, g=None, early=False, ops=None, scales=None, probe=None, **kw):
    """Every rank's outputs per round, and the round's own collectives (by name) per round.
    ``probe`` (a dict): receives the ``engines`` and each rank's payload bytes ``moved`` to other
    ranks on the hub (:class:`_Below`); takes a ``fault``, ``(rank, tag)``, for :class:`_Below`."""
    engines = _engines(ranks, chunk, exchange, **kw)
    ops = ops or [TorchOps(torch.device("cpu"), "cpu")] * ranks
    if early:
        start_early(engines, ops[0])
    hub = Hub(ranks, timeout=20.0, local_size=g, variable_sizes=True)
    if probe is not None:
        probe.update(engines=engines, moved=[0] * ranks)
    outs, counts = [], []
    for step, tensors in enumerate(rounds):
        before = {n for n in hub._got if n.startswith("horovod_alq.")}
        outs.append(_round(engines, tensors, ops, f"r{step}", hub, scales, probe))
        counts.append(len({n for n in hub._got if n.startswith("horovod_alq.")} - before))
    return outs, counts


def _round(engines, tensors, ops, tag, hub, scales=None, probe=None):
    def rank(r, t):
        wired = t if probe is None else _Below(t, probe, *probe.get("fault", (None, None)))
        entries = [
            engines[r].add(
                x, x.numel(), tuple(x.shape), "float32", wired, ident=k, scale=None if scales is None else scales[k]
            )
            for k, x in enumerate(tensors[r])
        ]
        reduced = [t.allreduce_sum(v, f"{tag}.control{k}") for k, (_, v) in enumerate(entries)]
        return [engines[r].finish(e, v, ops[r], wired)[0] * 1 for (e, _), v in zip(entries, reduced)]

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


# ------------------------------------------------------------------ the entropy wire
#: Buckets of 256: each coded bucket's stream lengths and states (12 bytes) leave the coding a saving.
ENTROPY = dict(wire="entropy", d=256)
STAGES = {"allgather": 1, "hierarchical": 3, "two-phase": 2}


def _heavy(ranks, rounds, seed=0):
    """:func:`_rounds` of Student t(3) values: heavy tails, whose codes the entropy wire shrinks."""
    rng = np.random.default_rng(seed)
    return [
        [[torch.from_numpy(rng.standard_t(3, n).astype(np.float32)) for n in SIZES] for _ in range(ranks)]
        for _ in range(rounds)
    ]


@pytest.mark.parametrize(
    "exchange, ranks, g, chunk, k",
    [("allgather", 2, None, 2000, 4), ("hierarchical", 4, 2, 1500, 5), ("two-phase", 3, None, 1500, 5)],
)
def test_pipelined_rounds_on_the_entropy_wire_equal_the_unpipelined_ones(exchange, ranks, g, chunk, k):
    """wire="entropy" over a transport that takes blocks of any size (Horovod's): each chunk's frames
    are coded when it is issued and decoded in its wait. The results are bit for bit the unpipelined
    round's (and the fixed wire's) with each chunk's collectives, and the byte counters add up: what
    an engine counts as sent is what its transport moved to other ranks, every byte sent is
    received, and the frames are smaller than the fixed payloads."""
    rounds = _heavy(ranks, 3)
    fixed, _ = _run(ranks, rounds, 0, exchange, g, d=256)
    plain_probe, piped_probe = {}, {}
    plain, n_plain = _run(ranks, rounds, 0, exchange, g, probe=plain_probe, **ENTROPY)
    piped, n_piped = _run(ranks, rounds, chunk, exchange, g, probe=piped_probe, **ENTROPY)
    _same(fixed, plain)
    _same(plain, piped)
    assert [n + (k - 1) * STAGES[exchange] for n in n_plain] == n_piped  # (no size exchanges: none counted)
    for out in piped:  # identical on every rank
        for r in range(1, ranks):
            for a, b in zip(out[0], out[r]):
                assert torch.equal(a, b)
    for probe in (plain_probe, piped_probe):
        states = [e.state for e in probe["engines"]]
        assert [st.bytes_sent for st in states] == probe["moved"], (probe["moved"], states)
        assert sum(st.bytes_sent for st in states) == sum(st.bytes_received for st in states)
    if exchange == "allgather":  # payloads only: the frames are smaller, and each added chunk adds a header
        plain_states, piped_states = [[e.state for e in p["engines"]] for p in (plain_probe, piped_probe)]
        extra = len(rounds) * (k - 1) * HEADER_SIZE
        assert [st.wire_fixed_bytes for st in piped_states] == [st.wire_fixed_bytes + extra for st in plain_states]
        assert all(st.wire_coded_bytes < 0.95 * st.wire_fixed_bytes for st in piped_states), piped_states


@pytest.mark.filterwarnings("ignore:horovod_alq.*do not decode:RuntimeWarning")
@pytest.mark.parametrize(
    "exchange, chunk, tag, mine, others",
    [
        # rank 1's float32 shard for rank 0 (its node) arrives undecodable: the entropy wire hands
        # rank 0 0xFF bytes (NaN as float32), which no payload check sees; rank 0 poisons what it
        # forwards in its node and sends status 1 to the other node
        ("hierarchical", 0, "h1-0", "h1-0: the node's float32 shards of buffer 0 arrived undecodable", [0, 0, 0]),
        ("hierarchical", 1500, "h1-0-2", "h1-0-2: chunk 2 of the node's float32 shards", [0, 0, 0]),
        # rank 0 poisons its re-quantized sub-shard: rank 2, its owner on the other node, names it,
        # then rank 0's and rank 2's nodes learn it from them
        ("hierarchical-two-phase", 0, "h1-0", "h1-0: the node's float32 shards of buffer 0 arrived", [0, 0, 2]),
    ],
)
def test_an_undecodable_node_sum_raises_on_every_rank(exchange, chunk, tag, mine, others):
    """Never NaN gradients from a frame broken on its way: every rank raises, rank 0 naming it,
    ranks 1 to 3 the rank (``others``) whose error they learnt it from."""
    rounds, kw = _heavy(4, 1), dict(ENTROPY, update_steps=(5,))
    outs, _ = _run(4, rounds, chunk, exchange, 2, probe={"fault": (1, tag)}, **kw)
    for r in range(4):
        assert isinstance(outs[0][r], ProtocolError), (r, outs[0][r])
    assert mine in str(outs[0][0]) and "rank 1's frames" in str(outs[0][0]), outs[0][0]
    for r, source in zip((1, 2, 3), others):
        assert f"rank(s) [{source}]" in str(outs[0][r]), (r, outs[0][r])


class _Below:
    """A rank's hub transport as its engine gets it (below the entropy wire, which the engine wraps
    around it): adds the payload bytes it sends other ranks (not the handshake's) to
    ``probe["moved"]``; collective ``tag`` of rank ``faulty`` arrives with a byte flipped in what it
    sends each other rank (a fault on the way)."""

    def __init__(self, inner, probe: dict, faulty: int | None = None, tag: str | None = None) -> None:
        self.inner, self.probe, self.faulty, self.tag = inner, probe, faulty, tag

    def __getattr__(self, name):  # rank, size, local_size, variable_sizes, the allreduces
        return getattr(self.inner, name)

    def _count(self, name: str, blocks) -> None:
        if not name.endswith(".handshake"):
            self.probe["moved"][self.inner.rank] += sum(int(b) for to, b in enumerate(blocks) if to != self.inner.rank)

    def _hit(self, name: str) -> bool:
        return self.inner.rank == self.faulty and name.endswith("." + self.tag)

    def allgather(self, payload, sizes, name):
        self._count(name, [sizes[self.inner.rank]] * self.inner.size)
        if self._hit(name):
            payload = payload.clone()
            payload[payload.numel() // 2] ^= 0x10
        return self.inner.allgather(payload, sizes, name)

    def alltoall(self, payload, splits, received, name):
        self._count(name, splits)
        if self._hit(name):
            payload, start = payload.clone(), 0
            for to, size in enumerate(splits):
                if size and to != self.inner.rank:
                    payload[start + size // 2] ^= 0x10
                start += size
        return self.inner.alltoall(payload, splits, received, name)


@pytest.mark.filterwarnings("ignore:horovod_alq.*do not decode:RuntimeWarning")
@pytest.mark.parametrize(
    "exchange, ranks, g, chunk, k, tag, why",
    [
        # every rank decodes rank 1's frame of chunk 1 (the CRC fails), the sender its own copy too,
        # and its wait raises that on every rank: kept until chunk 3's collective is issued
        ("allgather", 2, None, 2000, 4, "ag0-1", {r: "ag0-1: rank 1's entropy-coded" for r in (0, 1)}),
        # the same in the two-phase exchange's second phase (an allgather), chunks 2 to 4 still to come
        ("two-phase", 3, None, 1500, 5, "ag2-0-1", {r: "ag2-0-1: rank 1's entropy-coded" for r in (0, 1, 2)}),
        # rank 1's node sum of chunk 2 reaches rank 3 (the other node) broken: rank 3 poisons what it
        # forwards in its node and sends status 1 to the other node
        ("hierarchical", 4, 2, 1500, 5, "h2-0-2", {0: "rank(s) [3]", 1: "rank(s) [3]", 3: "chunk 2 of shard 1"}),
        # rank 1's chunk 2 reaches the owners of shards 0 and 2 broken: each poisons its second phase
        (
            "two-phase",
            3,
            None,
            1500,
            5,
            "a2a0-2",
            {0: "chunk 2 of shard 0", 1: "rank(s) [0, 2]", 2: "chunk 2 of shard 2"},
        ),
    ],
)
def test_a_broken_frame_in_one_chunk_raises_on_every_rank(exchange, ranks, g, chunk, k, tag, why):
    """A coded frame of one chunk corrupted on its way (its CRC fails where it is decoded): every
    rank raises, after the buffer's last collective (the same collectives as a clean round: none waits)."""
    rounds, kw = _heavy(ranks, 1), dict(ENTROPY, update_steps=(5,))  # (no refit's allreduce after the exchange)
    _, clean = _run(ranks, rounds, chunk, exchange, g, **kw)
    outs, counts = _run(ranks, rounds, chunk, exchange, g, probe={"fault": (1, tag)}, **kw)
    for r in range(ranks):
        assert isinstance(outs[0][r], ProtocolError), (r, outs[0][r])
    for r, text in why.items():
        assert text in str(outs[0][r]), (r, outs[0][r])
    assert counts == clean == [1 + k * STAGES[exchange]]  # the handshake and every chunk's collectives
