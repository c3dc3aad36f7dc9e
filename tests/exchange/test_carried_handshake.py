"""The fused round's handshake carried in its first payload collective (exchange/carrier.py), with
ranks as threads: a transport that takes blocks of any size (as Horovod's) runs one collective
fewer per round and gives the same results, bytes and errors as one that does not."""

import numpy as np
import pytest

from horovod_alq.core.protocol import ProtocolError
from horovod_alq.exchange import carrier
from horovod_alq.exchange.numpy_ops import NumpyOps
from horovod_alq.settings import Settings, configure
from horovod_alq.testing import Hub, exchange_round, start_early

SIZES = (300, 200, 70, 130)


def _engines(ranks, exchange="auto", **kw):
    kw.setdefault("update_steps", (0,))
    kw.setdefault("update_every", 0)
    bits = kw.pop("bits", 3)
    first = kw.pop("bits0", bits)  # rank 0's, where it differs
    settings = [
        configure(Settings("alq", first if r == 0 else bits, 64, seed=1, exchange=exchange, **kw)) for r in range(ranks)
    ]
    return [s.engine(uid="t") for s in settings]


def _tensors(ranks, rounds, sizes=SIZES, seed=0):
    rng = np.random.default_rng(seed)
    return [[[rng.standard_normal(n).astype(np.float32) for n in sizes] for _ in range(ranks)] for _ in range(rounds)]


def _run(variable, ranks, rounds, g=None, early=False, swap=None, **kw):
    """Every rank's outputs per round, collectives per round (own, by name) and bytes sent."""
    engines = _engines(ranks, **kw)
    if early:
        start_early(engines, NumpyOps())
    hub = Hub(ranks, timeout=10.0, local_size=g, variable_sizes=variable)
    outs, counts = [], []
    for step, tensors in enumerate(rounds):
        if swap is not None:
            tensors = [xs[::-1] if r == swap else xs for r, xs in enumerate(tensors)]
        before = {n for n in hub._got if n.startswith("horovod_alq.")}
        outs.append(exchange_round(engines, tensors, NumpyOps(), f"r{step}", hub))
        counts.append(len({n for n in hub._got if n.startswith("horovod_alq.")} - before))
    return outs, counts, [e.state.bytes_sent for e in engines]


def _same(a, b):
    for ra, rb in zip(a, b):
        for xa, xb in zip(ra, rb):
            assert not isinstance(xa, BaseException) and not isinstance(xb, BaseException), (xa, xb)
            for ta, tb in zip(xa, xb):
                np.testing.assert_array_equal(ta, tb)


@pytest.mark.parametrize(
    "exchange, ranks, g",
    [("allgather", 2, None), ("two-phase", 3, None), ("hierarchical", 4, 2), ("hierarchical-two-phase", 4, 2)],
)
def test_carried_rounds_give_the_same_results_bytes_and_one_collective_fewer(exchange, ranks, g):
    rounds = _tensors(ranks, 3)  # round 0 refits (statistics allreduce), then the new levels
    plain, n_plain, b_plain = _run(False, ranks, rounds, g, exchange=exchange)
    carried, n_carried, b_carried = _run(True, ranks, rounds, g, exchange=exchange)
    _same(plain, carried)
    assert b_plain == b_carried
    assert [n - 1 for n in n_plain] == n_carried
    for out in carried:  # identical on every rank
        for r in range(1, ranks):
            for a, b in zip(out[0], out[r]):
                np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("kw", [dict(bits="auto", bit_budget=3.0), dict(error_feedback=True)])
def test_auto_bits_and_error_feedback_rounds_carry_alike(kw):
    rounds = _tensors(2, 3, seed=1)
    plain, _, b_plain = _run(False, 2, rounds, exchange="two-phase", **kw)
    carried, _, b_carried = _run(True, 2, rounds, exchange="two-phase", **kw)
    _same(plain, carried)
    assert b_plain == b_carried


def test_early_buffers_carry_the_first_buffer_they_left():
    """Buffers started early (overlap) keep their own collectives; the first one left rides along."""
    rounds = _tensors(2, 2, sizes=(300, 200, 70, 130, 90))
    kw = dict(exchange="allgather", fusion_bytes=4 * 320)
    plain, n_plain, _ = _run(False, 2, rounds, early=True, **kw)
    carried, n_carried, _ = _run(True, 2, rounds, early=True, **kw)
    _same(plain, carried)
    assert [n - 1 for n in n_plain] == n_carried


def _unordered(variable):
    """One round in which rank 1 compresses its tensors in reverse order (control vectors pair by
    tensor, as Horovod's names do): every rank's outputs, in tensor order, and collectives."""
    engines = _engines(2, exchange="allgather")
    hub = Hub(2, timeout=10.0, variable_sizes=variable)
    tensors = _tensors(2, 1)[0]

    def rank(r, t):
        order = list(range(len(SIZES)))[:: -1 if r == 1 else 1]
        xs = tensors[r]
        entries = {k: engines[r].add(xs[k], xs[k].size, xs[k].shape, "float32", t, ident=k) for k in order}
        for k in order:  # every control vector leaves before any is waited for (Horovod's async ops)
            hub.put(f"c{k}", r, entries[k][1])
        reduced = {k: np.sum(hub.get(f"c{k}"), axis=0) for k in order}
        out = {k: engines[r].finish(entries[k][0], reduced[k], NumpyOps(), t)[0] for k in order}
        return [out[k] for k in range(len(SIZES))]

    outs = hub.outcomes(rank)
    return outs, len([n for n in hub._got if n.startswith("horovod_alq.")])


def test_unordered_rounds_drop_the_carried_blocks():
    """Ranks that order their tensors differently: the carried blocks are not used; the round
    gathers every rank's stream (the unordered path) exactly as without a carrier."""
    plain, n_plain = _unordered(False)
    carried, n_carried = _unordered(True)
    _same([plain], [carried])
    assert n_plain == n_carried  # the carrier replaces the handshake; its blocks are sent again


def test_large_first_collectives_travel_on_their_own(monkeypatch):
    monkeypatch.setattr(carrier, "CARRY_BYTES", 16)
    rounds = _tensors(4, 2)
    plain, n_plain, _ = _run(False, 4, rounds, 2, exchange="hierarchical")
    carried, n_carried, _ = _run(True, 4, rounds, 2, exchange="hierarchical")
    _same(plain, carried)
    assert n_plain == n_carried


def _errors(outs):
    return [o for o in outs if isinstance(o, BaseException)]


def test_ranks_that_differ_raise_on_every_rank_without_hanging():
    rounds = _tensors(4, 1)
    outs, _, _ = _run(True, 4, rounds, 2, exchange="hierarchical", bits0=4)  # rank 0: 4 bits, the rest 3
    errors = _errors(outs[0])
    assert len(errors) == 4 and all(isinstance(e, ProtocolError) and "differ in bits" in str(e) for e in errors)


def test_ranks_with_different_layouts_raise_on_every_rank():
    """Rank 0 cuts the round into other fusion buffers: its carried blocks differ in size from what
    the others expect; every rank still reads every handshake and raises."""
    engines = _engines(4, exchange="hierarchical")
    engines[0] = configure(Settings("alq", 3, 64, seed=1, exchange="hierarchical", fusion_bytes=4 * 320)).engine(
        uid="t"
    )
    hub = Hub(4, timeout=10.0, local_size=2, variable_sizes=True)
    outs = exchange_round(engines, _tensors(4, 1)[0], NumpyOps(), "r", hub)
    errors = _errors(outs)
    assert len(errors) == 4 and all("differ in fusion_bytes" in str(e) for e in errors), outs


def test_a_rank_that_cannot_start_its_exchange_fails_every_rank(monkeypatch):
    """A rank whose carried collective fails to build (here: its codec raises) carries nothing,
    flags the error in its handshake, and every rank raises after the one carrier collective."""
    ops, bad = NumpyOps(), NumpyOps()

    def broken(*a, **k):
        raise MemoryError("no room")

    bad.encode = broken
    engines = _engines(2, exchange="allgather")
    hub = Hub(2, timeout=10.0, variable_sizes=True)
    tensors = _tensors(2, 1)[0]

    def rank(r, t):
        entries = [engines[r].add(x, x.size, x.shape, "float32", t, ident=k) for k, x in enumerate(tensors[r])]
        reduced = [t.allreduce_sum(v, f"c{k}") for k, (_, v) in enumerate(entries)]
        return [engines[r].finish(e, v, bad if r == 1 else ops, t)[0] for (e, _), v in zip(entries, reduced)]

    outs = hub.outcomes(rank)
    assert all(isinstance(o, ProtocolError) and "a rank failed" in str(o) for o in outs), outs
    assert "no room" in str(outs[1])
