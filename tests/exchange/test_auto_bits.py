"""bits="auto" in the exchange engine, with ranks as threads (horovod_alq.testing) and the
NumPy codec: the allocation every rank reaches, mixed widths in one fusion buffer, unbiasedness,
refusals. The same across real Horovod ranks: tests/torch/test_compressor_ranks.py."""

import numpy as np
import pytest
from helpers import assert_zero_mean

from horovod_alq.core.protocol import ProtocolError
from horovod_alq.exchange.numpy_ops import NumpyOps
from horovod_alq.settings import Settings, configure
from horovod_alq.testing import exchange_round, start_early

SCALES = (100.0, 1.0, 0.01, 3.0)  # the gradients of four tensors differ by orders of magnitude
SIZES = (300, 500, 200, 640)


def _setups(n, budget=3.0, exchange="allgather", **kw):
    setups = [
        configure(Settings("alq", "auto", 64, bit_budget=budget, update_steps=(0,), update_every=0, seed=11, **kw))
        for _ in range(n)
    ]
    return setups, [s.engine(exchange=exchange, uid="t") for s in setups]


def _wire(widths, sizes=SIZES):
    """One rank's payload bytes: one payload per run of one width; a tensor's run reaches the next one's start."""
    from horovod_alq.core.wire import payload_size

    spans = [-(-k // 64) * 64 for k in sizes[:-1]] + [sizes[-1]]
    runs = []
    for k, w in zip(spans, widths):
        runs[-1:] = [(runs[-1][0] + k, w)] if runs and runs[-1][1] == w else runs[-1:] + [(k, w)]
    return sum(payload_size(k, w, 64) for k, w in runs)


def _grads(step, rank):
    g = np.random.default_rng(1000 * step + rank)
    return [(s * g.standard_normal(n)).astype(np.float32) for s, n in zip(SCALES, SIZES)]


@pytest.mark.parametrize("exchange,n", [("allgather", 2), ("allgather", 3), ("two-phase", 3), ("two-phase", 4)])
def test_every_rank_allocates_alike_within_budget_and_mixes_widths_in_one_buffer(exchange, n):
    setups, engines = _setups(n, 3.0, exchange)
    for step in range(3):
        outs = exchange_round(engines, [_grads(step, r) for r in range(n)], NumpyOps(), f"s{step}")
        for r in range(1, n):
            assert all(np.array_equal(a, b) for a, b in zip(outs[0], outs[r])), "ranks got different sums"
    metrics = [s.state.metrics() for s in setups]
    alloc = metrics[0]["allocation"]
    assert all(m["allocation"] == alloc for m in metrics)
    assert all(
        np.array_equal(m["width_levels"][w], metrics[0]["width_levels"][w])
        for m in metrics
        for w in metrics[0]["width_levels"]
    )
    assert len(set(alloc)) > 1 and alloc[0] == max(alloc)  # the 100x tensor gets the most bits
    sizes = np.array(SIZES)
    assert (sizes * np.array(alloc)).sum() <= 3.0 * sizes.sum()
    assert metrics[0]["allocated_mean_bits"] == pytest.approx((sizes * np.array(alloc)).sum() / sizes.sum())
    assert metrics[0]["level_updates"] == 1 and metrics[0]["exchange"] == exchange
    # the codes on the wire carry the allocated widths: payload bytes of the last rounds follow them
    if exchange == "allgather":  # round 0 before the first refit: floor(3.0) bits everywhere
        assert metrics[0]["payload_bytes"] == _wire([3] * 4) + 2 * _wire(alloc)


@pytest.mark.parametrize("exchange,n", [("allgather", 3), ("two-phase", 3)])
def test_mixed_widths_keep_the_sum_unbiased(exchange, n):
    """Fixed gradients, 150 rounds after the refit: per bucket, a t test of the mean deviation of
    the decoded sum from the true sum at 1e-6 (Bonferroni over the buckets)."""
    setups, engines = _setups(n, 3.0, exchange)
    xs = [_grads(0, r) for r in range(n)]
    truth = [sum(x[k].astype(np.float64) for x in xs) for k in range(len(SIZES))]
    exchange_round(engines, xs, NumpyOps(), "refit")
    devs = []
    for step in range(150):
        out = exchange_round(engines, xs, NumpyOps(), f"s{step}")[0]
        devs.append(np.concatenate([(o - tr) / s for o, tr, s in zip(out, truth, SCALES)]))
    assert len(set(setups[0].state.metrics()["allocation"])) > 1
    dev = np.array(devs)
    assert_zero_mean(np.add.reduceat(dev, np.arange(0, dev.shape[1], 64), axis=1))


def test_overlapped_buffers_use_the_allocation_and_give_the_same_sums():
    """With early starts (Horovod's overlap) and several fusion buffers, the buffers started during
    the round use the allocated widths and the results equal those of the same round run at once."""
    n, results = 2, {}
    for early in (False, True):
        setups = [
            configure(Settings("alq", "auto", 64, bit_budget=3.0, update_steps=(0,), update_every=0, seed=11))
            for _ in range(n)
        ]
        engines = [s.engine(exchange="allgather", uid="t", fusion_bytes=4 * 700, early=early) for s in setups]
        ops = NumpyOps()
        if early:
            start_early(engines, ops)
        outs = [exchange_round(engines, [_grads(step, r) for r in range(n)], ops, f"s{step}") for step in range(3)]
        results[early] = (outs, setups[0].state.metrics())
    assert results[True][1]["allocation"] == results[False][1]["allocation"]
    for a, b in zip(results[False][0], results[True][0]):
        assert all(np.array_equal(x, y) for x, y in zip(a[0], b[0]))


def test_another_budget_or_allocation_on_one_rank_raises_on_every_rank():
    setups = [configure(Settings("alq", "auto", 64, bit_budget=b, seed=1)) for b in (3.0, 2.5)]
    out = exchange_round([s.engine(uid="t") for s in setups], [_grads(0, r) for r in range(2)], NumpyOps(), "b")
    assert all(isinstance(o, ProtocolError) and "bit_budget" in str(o) for o in out), out

    setups, engines = _setups(2)
    exchange_round(engines, [_grads(0, r) for r in range(2)], NumpyOps(), "s0")
    auto = setups[1].state.auto
    auto.bits = tuple(b + 1 for b in auto.bits)  # rank 1 believes in another allocation
    out = exchange_round(engines, [_grads(1, r) for r in range(2)], NumpyOps(), "s1")
    assert all(isinstance(o, ProtocolError) and "bit allocations" in str(o) for o in out), out


def test_state_dict_round_trip_and_refusals():
    setups, engines = _setups(2)
    exchange_round(engines, [_grads(0, r) for r in range(2)], NumpyOps(), "s0")
    saved = setups[0].state.state_dict()
    fresh = configure(Settings("alq", "auto", 64, bit_budget=3.0))
    fresh.state.load_state_dict(saved)
    assert fresh.state.metrics()["allocation"] == setups[0].state.metrics()["allocation"]
    assert fresh.state.auto.fingerprint() == setups[0].state.auto.fingerprint()
    with pytest.raises(ValueError, match="bit_budget"):
        configure(Settings("alq", "auto", 64, bit_budget=2.5)).state.load_state_dict(saved)
    with pytest.raises(ValueError, match="bits='auto'"):
        configure(Settings("alq", 3, 64)).state.load_state_dict(saved)


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(method="qsgdinf", bits="auto"), "adaptive method"),
        (dict(bits="auto", bit_budget=1.5), "bit_budget must be a number from 2 to 8"),
        (dict(bits="auto", bit_budget=float("nan")), "bit_budget"),
        (dict(bits=3, bit_budget=3.0), "applies to bits='auto' only"),
        (dict(bits="four"), "'auto'"),
        (dict(bits="auto", bits_second=4), "bits_second"),
    ],
)
def test_bad_configurations_are_refused(kw, match):
    kw = {"method": "alq", **kw}
    with pytest.raises(ValueError, match=match):
        configure(Settings(kw.pop("method"), kw.pop("bits"), 64, **kw))


def test_a_caller_collected_list_round_returns_rows_and_refit_allocates_for_exactly_its_tensors():
    """mpi4py's path on one rank: a list as one streamed buffer (each tensor on a bucket boundary),
    rows per tensor from close(), Engine.refit(rows, keys=); then only a round of exactly those
    tensors takes the allocated widths (whole=True: a prefix gets the default)."""
    from horovod_alq.exchange.interfaces import SingleRank

    setup = configure(Settings("alq", "auto", 64, bit_budget=2.5, seed=3), on_request=True)
    eng, auto = setup.engine(exchange="allgather", uid="t"), setup.state.auto
    xs = _grads(0, 0)

    def call(parts, collect):
        got = {}
        rnd = eng.open_stream(NumpyOps(), [SingleRank()] * 2, elements=sum(p.size for p in parts), collect=collect)
        before = setup.state.payload_bytes
        layout = rnd.add(list(parts), sum(p.size for p in parts), lambda d, e: got.update(d=d, e=e), whole=True)
        rnd.wait()
        assert got["e"] is None
        outs = [got["d"].read(s, s + p.size) for s, p in zip(layout.starts, parts)]
        return outs, rnd.close(), rnd.keys, setup.state.payload_bytes - before, layout

    outs, (rows, second), keys, _, layout = call(xs, True)
    assert second is None and keys == tuple((n, 0) for n in SIZES)
    assert all(s % 64 == 0 for s in layout.starts)
    np.testing.assert_allclose(rows, np.stack([auto.row(x) for x in xs]), rtol=1e-12)  # (batched: last ulps)
    assert eng.refit(rows, None, SingleRank(), keys=keys) is True
    alloc = setup.state.metrics()["allocation"]
    assert alloc[0] == max(alloc) and len(set(alloc)) > 1
    assert call(xs, False)[3] == _wire(alloc)
    assert call(xs[:2], False)[3] == _wire([2, 2], SIZES[:2])  # a prefix of the allocated tensors: the default
    assert eng.refit(None, None, SingleRank(), keys=()) is False  # nothing recorded
