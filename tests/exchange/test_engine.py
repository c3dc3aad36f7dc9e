"""The exchange engine's round logic on one rank (``SingleRank``: every collective of a 1-rank set
returns its input), with the NumPy codec. Multi-rank behaviour: tests/mpi, tests/torch."""

import numpy as np
import pytest

from horovod_alq.core import Quantizer
from horovod_alq.core.rounds import RefitSchedule, RoundState
from horovod_alq.exchange.engine import Engine
from horovod_alq.exchange.interfaces import SingleRank
from horovod_alq.exchange.numpy_ops import NumpyOps


def _engine(exchange="allgather", steps=()):
    q = Quantizer("alq", bits=3, bucket_size=64)
    return Engine(q, RoundState(q, RefitSchedule(steps, 0)), exchange=exchange, seed=3)


def _add(engine, x, t=SingleRank()):
    return engine.add(x, x.size, x.shape, "float32", t)


@pytest.mark.parametrize("exchange", ["allgather", "two-phase"])
def test_kept_buffers_are_not_reused_while_a_round_is_still_read(exchange):
    """Round 1 = {a, b}; a round 2 runs between the decompressions of a and b: b must still get
    round 1's values (the result buffer is kept across rounds only once a round is fully read)."""
    rng = np.random.default_rng(0)
    a, b, c = (rng.standard_normal(300).astype(np.float32) for _ in range(3))
    t, ops = SingleRank(), NumpyOps()

    ref = _engine(exchange)
    (ea, va), (eb, vb) = _add(ref, a), _add(ref, b)
    ref.finish(ea, va, ops, t)
    b_ref = ref.finish(eb, vb, ops, t)[0].copy()

    eng = _engine(exchange)
    (ea, va), (eb, vb) = _add(eng, a), _add(eng, b)
    eng.finish(ea, va, ops, t)
    ec, vc = _add(eng, c)
    c_out = eng.finish(ec, vc, ops, t)[0]
    b_out = eng.finish(eb, vb, ops, t)[0]
    np.testing.assert_array_equal(b_out, b_ref)
    assert np.abs(c_out - c).max() <= np.abs(c).max()  # round 2 ran on its own buffers


def test_buffers_are_kept_across_finished_rounds():
    rng = np.random.default_rng(1)
    t, ops = SingleRank(), NumpyOps()
    eng = _engine()
    held = []
    for _ in range(3):
        x = rng.standard_normal(500).astype(np.float32)
        entry, vec = _add(eng, x)
        out = eng.finish(entry, vec, ops, t)[0]
        assert np.abs(out - x).max() <= np.abs(x).max()
        held.append(id(eng._kept._kept["stream"][0]))
        assert out is not eng._kept._kept["stream"][0] and not np.shares_memory(out, eng._kept._kept["stream"][0])
    assert held[0] == held[1] == held[2]


def test_kept_stream_padding_is_zeroed():
    """Tensors of 70 and 10 elements in 64-buckets: the stream has 58 padding zeros between them,
    also when a previous round left other values there (its norms would change otherwise)."""
    t, ops = SingleRank(), NumpyOps()
    eng = _engine()
    big = np.full(64 + 64 + 10, 5.0, dtype=np.float32)  # the same stream length: its buffer is kept
    e, v = _add(eng, big)
    eng.finish(e, v, ops, t)
    parts = [np.ones(70, dtype=np.float32), np.full(10, 0.5, dtype=np.float32)]
    entries = [_add(eng, p) for p in parts]
    outs = [eng.finish(e, v, ops, t)[0] for e, v in entries]
    assert eng._kept._kept["stream"][0].shape == big.shape
    # a bucket with max-abs 1 (padding zero) holds the levels -1..1 exactly at +-1: exact decode
    np.testing.assert_array_equal(outs[0][64:70], parts[0][64:70])


class _StreamOnlyOps:
    """TorchOps that never encode tensors in place (the path of codecs without encode_parts)."""

    def __init__(self, ops):
        self._ops = ops

    def __getattr__(self, name):
        return getattr(self._ops, name)

    def encode_parts(self, *args):
        return None


@pytest.mark.parametrize("exchange", ["allgather", "two-phase"])
@pytest.mark.parametrize("bucket", [64, 100])  # 100: windows whose codes do not begin on a byte
def test_fused_tensors_come_back_in_place(exchange, bucket):
    """Tensors of +-c (exact under max-abs buckets) fused into one stream: every tensor's decoded
    window is its own values, whether the codec reads the tensors in place or from the stream, and
    both give the same floats for random values too."""
    torch = pytest.importorskip("torch")
    from horovod_alq.torch.ops import TorchOps

    rng = np.random.default_rng(bucket)
    sizes = [3 * bucket, 5, bucket + 1, 2000, 1, 7 * bucket]
    exact = [
        torch.from_numpy(np.sign(rng.standard_normal(n)).astype(np.float32) * (k + 1)) for k, n in enumerate(sizes)
    ]
    noisy = [torch.from_numpy(rng.standard_normal(n).astype(np.float32)) for n in sizes]
    ops = TorchOps("cpu")
    outs = {}
    for name, variant in [("in place", ops), ("stream", _StreamOnlyOps(ops))]:
        for label, xs in [("exact", exact), ("noisy", noisy)]:
            q = Quantizer("alq", bits=3, bucket_size=bucket)
            eng = Engine(q, RoundState(q, RefitSchedule((), 0)), exchange=exchange, seed=3)
            added = [eng.add(x, x.numel(), x.shape, "float32", SingleRank()) for x in xs]
            outs[name, label] = [eng.finish(e, v, variant, SingleRank())[0] for e, v in added]
            if label == "exact":
                for x, out in zip(xs, outs[name, label]):
                    assert torch.equal(out, x)
    for a, b in zip(outs["in place", "noisy"], outs["stream", "noisy"]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("exchange", ["allgather", "two-phase"])
def test_streamed_round_hands_each_buffer_its_values_and_refits_at_close(exchange):
    """A streamed round on one rank (collectives complete at once): every buffer's consumer gets
    its own values, decoded with the levels it was encoded with (values on the initial levels round
    exactly); the refit happens at close, after every buffer, and the round counts once."""
    q = Quantizer("alq", bits=3, bucket_size=64)
    eng = Engine(q, RoundState(q, RefitSchedule((0,), 0)), exchange=exchange, seed=3)
    before = q.levels.astype(np.float32)
    rng = np.random.default_rng(2)
    xs = [rng.choice(before, size=n).astype(np.float32) for n in (200, 64, 3)]
    for x in xs:
        x[0] = 1.0  # max-abs 1: every value is a level, rounded exactly
    rnd = eng.open_stream(NumpyOps(), [SingleRank(), SingleRank()], min_size=16)
    got = {}
    for k, x in enumerate(xs):
        rnd.add(x, x.size, lambda decoded, error, k=k: got.setdefault(k, (decoded, error)))
    assert set(got) == {0, 1, 2} and np.array_equal(q.levels.astype(np.float32), before)
    rnd.close()
    assert not np.array_equal(q.levels.astype(np.float32), before)  # refit at close
    for k, x in enumerate(xs):
        decoded, error = got[k]
        assert error is None
        out = np.empty(x.size, dtype=np.float32)
        assert decoded.read(0, x.size, 0.5, out) is out
        np.testing.assert_array_equal(out, x * 0.5)
    m = eng.state.metrics()
    assert (m["step"], m["calls"], m["coordinates"], m["level_updates"]) == (1, 3, 267, 1)


@pytest.mark.parametrize("exchange", ["allgather", "two-phase"])
def test_a_refit_round_decodes_with_the_levels_it_encoded_with(exchange):
    """Values on the initial levels round deterministically; the refit at the end of the round
    changes the levels, and the round's tensors must still decode with the old ones."""
    q = Quantizer("alq", bits=3, bucket_size=64)
    eng = Engine(q, RoundState(q, RefitSchedule((0,), 0)), exchange=exchange, seed=3)
    before = q.levels.astype(np.float32)
    rng = np.random.default_rng(0)
    xs = [rng.choice(before, size=n).astype(np.float32) for n in (200, 64)]
    for x in xs:
        x[0] = 1.0  # max-abs 1: every value is a level, rounded exactly
    added = [_add(eng, x) for x in xs]
    outs = [eng.finish(e, v, NumpyOps(), SingleRank())[0] for e, v in added]
    assert not np.array_equal(q.levels.astype(np.float32), before)  # the round refit the levels
    for x, out in zip(xs, outs):
        np.testing.assert_array_equal(out, x)


@pytest.mark.parametrize("exchange", ["allgather", "two-phase"])
def test_a_caller_collected_round_returns_its_statistics_and_refit_combines_them(exchange):
    """open_stream(collect=True) refits nothing, even in a round the schedule would refit, and
    close() hands back this rank's statistics; Engine.refit then fits from them (mpi4py's adapt())."""
    q = Quantizer("alq", bits=3, bucket_size=64)
    second = Quantizer("alq", bits=4, bucket_size=64)
    eng = Engine(q, RoundState(q, RefitSchedule((0,), 0), second), exchange=exchange, seed=3)
    x = np.random.default_rng(1).standard_normal(500).astype(np.float32)
    before, before_second = q.levels, second.levels
    rnd = eng.open_stream(NumpyOps(), [SingleRank(), SingleRank()], elements=x.size, collect=True)
    rnd.add(x, x.size, lambda decoded, error: None)
    first, stats_second = rnd.close()
    np.testing.assert_array_equal(first, q.statistics(x))
    assert (stats_second is not None) == (exchange == "two-phase")
    assert np.array_equal(q.levels, before) and eng.state.level_updates == 0
    assert eng.refit(first, stats_second, SingleRank()) is True
    assert not np.array_equal(q.levels, before) and eng.state.level_updates == 1
    assert np.array_equal(second.levels, before_second) == (exchange == "allgather")
    with pytest.raises(Exception, match="This rank: ValueError: bad"):
        eng.refit(None, None, SingleRank(), error="ValueError: bad")
