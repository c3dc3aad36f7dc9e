"""error_feedback=True through every exchange on threaded ranks (nodes of 2 for the hierarchical
ones): with a fixed gradient the applied sum minus T times the true average is exactly minus the
ranks' last error buffers (bounded), and much smaller than without error feedback (which
grows like sqrt(T)); buffers are each tensor's, by its identity: streams of other tensors that
alternate keep their own, and a failed round changes none; a bucket holding NaN keeps its
previous error; a saved state resumes bit for bit on its own rank, and another rank's warns and
starts from zero; a rank with another setting is refused on every rank; bad values raise."""

import numpy as np
import pytest

from horovod_alq.core.protocol import ProtocolError
from horovod_alq.exchange.layout import plan_layout
from horovod_alq.exchange.numpy_ops import NumpyOps
from horovod_alq.exchange.registry import allreduce_names
from horovod_alq.settings import Settings, configure
from horovod_alq.testing import Hub, exchange_round, exchange_rounds, start_early

D, N = 256, 4
SIZES = (5000, 3000, 1500)


def _grads(rank, nan_bucket=None):
    rng = np.random.default_rng(rank)
    xs = [(rng.standard_t(3, n) * (1 + rank)).astype(np.float32) for n in SIZES]
    if nan_bucket is not None:
        xs[0][nan_bucket * D + 3] = np.nan
    return xs


def _setups(exchange, feedback, bits=3, fusion_bytes=None, **widths):
    return [
        configure(
            Settings(
                "alq",
                bits=bits,
                bucket_size=D,
                seed=7,
                exchange=exchange,
                update_steps=(0,),
                error_feedback=f,
                fusion_bytes=fusion_bytes,
                **widths,
            )
        )
        for f in feedback
    ]


def _rounds(setups, rounds, first=0, nan=None, early=False, engines=None, scale=1.0):
    """``rounds`` rounds (numbered from ``first``) of every rank's fixed gradients (times
    ``scale``); every rank's outputs per round (or its error). ``nan``: (round, bucket of rank 0's
    first tensor) set to NaN."""
    engines = engines or [s.engine(uid="f") for s in setups]
    ops = NumpyOps()
    if early:  # fusion buffers start as soon as they are complete (Horovod's overlap=True)
        start_early(engines, ops)
    tensors = [
        [
            [x * np.float32(scale) for x in _grads(r, nan[1] if nan and nan[0] == step and r == 0 else None)]
            for r in range(N)
        ]
        for step in range(first, first + rounds)
    ]
    return exchange_rounds(engines, tensors, ops, Hub(N, local_size=2))


def _drift(outs, rounds):
    """Rank 0's applied sum over the rounds minus ``rounds`` times the true sum over ranks (what a
    round returns; the front-ends divide by N), per tensor."""
    truth = [np.sum([_grads(r)[k].astype(np.float64) for r in range(N)], axis=0) for k in range(len(SIZES))]
    return [sum(o[k].astype(np.float64) for o in outs[0]) - rounds * truth[k] for k in range(len(SIZES))]


def _buffers(setups, layout=None):
    """Every rank's error buffers summed at their positions in the round's stream (float64): a
    key ``(stage, tensor, a, b)`` holds coordinates ``[a, b)`` of tensor ``tensor`` (its index in
    the round, as the harness names tensors)."""
    layout = layout or plan_layout(SIZES, D, None)
    total = np.zeros(layout.length)
    for s in setups:
        for (_, k, a, b), buf in s.state.feedback.buffers.items():
            start = layout.starts[k]
            total[start + a : start + b] += np.asarray(buf, dtype=np.float64)
    return total


def _check_drift(drift, left, layout, rounds):
    for k, (d, s, n) in enumerate(zip(drift, layout.starts, SIZES)):
        scale = np.abs(_grads(N - 1)[k]).max()
        np.testing.assert_allclose(d, left[s : s + n], atol=1e-4 * rounds * scale, err_msg=f"tensor {k}")


@pytest.mark.parametrize("exchange", sorted(allreduce_names()))
def test_applied_sum_is_the_true_sum_less_the_last_buffers(exchange):
    T = 30
    setups = _setups(exchange, [True] * N)
    outs = _rounds(setups, T)
    assert not any(isinstance(o, Exception) for o in outs), outs
    for r in range(1, N):  # identical on every rank
        for a, b in zip(outs[0][-1], outs[r][-1]):
            np.testing.assert_array_equal(a, b)
    drift = _drift(outs, T)
    _check_drift(drift, -_buffers(setups), plan_layout(SIZES, D, None), T)
    plain = _drift(_rounds(_setups(exchange, [False] * N), T), T)
    ratio = np.sqrt(sum((d**2).sum() for d in drift) / sum((d**2).sum() for d in plain))
    assert ratio < 0.5, f"{exchange}: drift with error feedback {ratio:.2f} of the drift without"
    assert all(s.state.metrics()["error_feedback_bytes"] > 0 for s in setups if s.state.feedback.buffers)


@pytest.mark.parametrize("exchange", ["allgather", "two-phase"])
@pytest.mark.parametrize("bits_per", ["tensor", "bucket"])
def test_adaptive_widths_keep_the_identity(exchange, bits_per):
    """bits="auto" (a width per tensor, or per bucket): the same identity, the widths changing
    between the refit round and the next."""
    T = 12
    setups = _setups(exchange, [True] * N, bits="auto", bit_budget=3.0, bits_per=bits_per)
    outs = _rounds(setups, T)
    assert not any(isinstance(o, Exception) for o in outs), outs
    _check_drift(_drift(outs, T), -_buffers(setups), plan_layout(SIZES, D, None), T)


@pytest.mark.parametrize("exchange", ["allgather", "two-phase"])
def test_early_started_buffers_keep_their_errors(exchange):
    """With fusion buffers that start early (Horovod's overlap), the applied sum is still the true
    sum less the last buffers: the early buffers' errors are kept under their own keys."""
    T, fusion = 20, 4 * SIZES[0]  # the first tensor fills a buffer, which starts early
    setups = _setups(exchange, [True] * N, fusion_bytes=fusion)
    outs = _rounds(setups, T, early=True)
    assert not any(isinstance(o, Exception) for o in outs), outs
    layout = plan_layout(SIZES, D, fusion // 4)
    _check_drift(_drift(outs, T), -_buffers(setups, layout), layout, T)


@pytest.mark.parametrize("exchange", sorted(allreduce_names()))
def test_a_nan_bucket_keeps_its_previous_error(exchange):
    """Rank 0's first tensor holds NaN in bucket 2 (coordinates [2D, 3D)): every buffer of values
    that include them (rank 0's own, and the owners' sums) keeps its previous error there, not
    zero and not NaN; every other coordinate moved on."""
    setups = _setups(exchange, [True] * N)
    engines = [s.engine(uid="f") for s in setups]
    _rounds(setups, 1, engines=engines)
    before = [{k: v.copy() for k, v in s.state.feedback.buffers.items()} for s in setups]
    outs = _rounds(setups, 1, first=1, nan=(1, 2), engines=engines)
    assert not any(isinstance(o, Exception) for o in outs), outs
    assert np.isnan(outs[0][0][0][2 * D : 3 * D]).all()  # the bucket comes back NaN, as without feedback
    covering, moved = 0, 0
    for r, (s, old) in enumerate(zip(setups, before)):
        after = s.state.feedback.buffers
        assert sorted(after) == sorted(old)
        for (stage, t, a, b), buf in after.items():
            assert np.isfinite(buf).all(), (exchange, stage, t)
            # NaN is in rank 0's own values, its node's sums (ranks 0 and 1), and all sums over ranks
            nan = t == 0 and {"own": r == 0, "node": r < 2, "sum": True}[stage]
            lo, hi = (max(a, 2 * D), min(b, 3 * D)) if nan else (0, 0)
            if lo < hi:
                covering += 1
                np.testing.assert_array_equal(buf[lo - a : hi - a], old[(stage, t, a, b)][lo - a : hi - a])
            keep = np.zeros(b - a, bool)
            keep[max(lo - a, 0) : max(hi - a, 0)] = True
            moved += int((buf != old[(stage, t, a, b)])[~keep].sum())
    assert covering > 0 and moved > 0.5 * sum(int(np.prod(v.shape)) for o in before for v in o.values())
    later = _rounds(setups, 1, first=2, engines=engines)
    assert np.isfinite(np.concatenate(later[0][0])).all()


def test_a_saved_state_resumes_bit_for_bit():
    setups = _setups("two-phase", [True] * N)
    _rounds(setups, 3)
    saved = [s.state.state_dict() for s in setups]
    assert all(st["error_feedback"]["buffers"] for st in saved)
    straight = _rounds(setups, 1, first=3)
    fresh = _setups("two-phase", [True] * N)
    for s, st in zip(fresh, saved):
        s.state.load_state_dict(st)
    resumed = _rounds(fresh, 1, first=3)
    for a, b in zip(straight[0][0], resumed[0][0]):
        np.testing.assert_array_equal(a, b)


def test_another_ranks_state_warns_and_starts_from_zero():
    setups = _setups("two-phase", [True] * N)
    _rounds(setups, 2)
    saved = [s.state.state_dict() for s in setups]
    assert saved[1]["error_feedback"]["owner"] == [1, N]
    fresh = _setups("two-phase", [True] * N)
    for s in fresh:  # rank 0's checkpoint on every rank: its errors must not be applied N times
        s.state.load_state_dict(saved[0])
    engines = [s.engine(uid="f") for s in fresh]
    with pytest.warns(UserWarning, match=r"saved by rank 0 of 4, this is rank [123] of 4.*starts from zero"):
        outs = _rounds(fresh, 1, first=2, engines=engines)
    assert not any(isinstance(o, Exception) for o in outs), outs
    zero = _setups("two-phase", [True] * N)  # what ranks 1-3 must do: rank 0's levels, no buffers
    engines0 = [s.engine(uid="f") for s in zero]
    empty = {**saved[0], "error_feedback": {**saved[0]["error_feedback"], "buffers": []}}
    for r, s in enumerate(zero):
        s.state.load_state_dict(saved[0] if r == 0 else empty)
    ref = _rounds(zero, 1, first=2, engines=engines0)
    for r in range(N):
        for a, b in zip(outs[r][0], ref[r][0]):
            np.testing.assert_array_equal(a, b)


def test_alternating_streams_keep_their_own_errors():
    """Two lists of tensors of the same sizes, named apart, alternate on one set of engines (two
    arrays on one mpi4py instance, two hvd.allreduce calls): each keeps its own error, so each
    one's applied sum is its true sum less its own last buffers, as if it ran alone."""
    T = 12
    setups = _setups("allgather", [True] * N)
    engines = [s.engine(uid="f") for s in setups]
    ops, hub = NumpyOps(), Hub(N, local_size=2)
    streams = {
        "a": [_grads(r) for r in range(N)],
        "b": [[-2 * x[::-1].copy() for x in _grads(r)] for r in range(N)],
    }
    applied = {k: [np.zeros(n) for n in SIZES] for k in streams}
    for step in range(2 * T):
        k = "ab"[step % 2]
        idents = [(k, i) for i in range(len(SIZES))]
        outs = exchange_round(engines, streams[k], ops, f"r{step}", hub, idents=idents)
        assert not any(isinstance(o, Exception) for o in outs), outs
        for i, v in enumerate(outs[0]):
            applied[k][i] += v
    for k, xs in streams.items():
        left = {key[1][1]: 0 for key in setups[0].state.feedback.buffers if key[1][0] == k}
        assert sorted(left) == [0, 1, 2], sorted(setups[0].state.feedback.buffers)
        for i, n in enumerate(SIZES):
            truth = sum(xs[r][i].astype(np.float64) for r in range(N))
            buffers = sum(
                np.asarray(s.state.feedback.buffers[(st, (k, i), 0, n)], np.float64) for s in setups for st in ("own",)
            )
            scale = np.abs(truth).max()
            np.testing.assert_allclose(applied[k][i] - T * truth, -buffers, atol=1e-4 * T * scale, err_msg=(k, i))


def test_a_failed_round_changes_no_buffer():
    """A round that fails on every rank (here one rank's tensor could not be compressed) after its
    early buffers were quantized and sent leaves every rank's buffers as they were."""
    fusion = 4 * SIZES[0]  # the first tensor fills a buffer, which starts early
    setups = _setups("two-phase", [True] * N, fusion_bytes=fusion)
    engines = [s.engine(uid="f") for s in setups]
    ops, hub = NumpyOps(), Hub(N, local_size=2)
    start_early(engines, ops)
    _rounds(setups, 2, engines=engines)
    before = [{k: v.copy() for k, v in s.state.feedback.buffers.items()} for s in setups]

    def rank(r, t):
        xs = [x * 3 for x in _grads(r)]
        entries = [engines[r].add(x, x.size, x.shape, "float32", t, ops=ops, ident=i) for i, x in enumerate(xs[:2])]
        err = "cannot compress" if r == 2 else None
        entries.append(engines[r].add(xs[2], xs[2].size, xs[2].shape, "float32", t, error=err, ident=2))
        reduced = [t.allreduce_sum(v, f"fail.control{k}") for k, (_, v) in enumerate(entries)]
        return engines[r].finish(entries[0][0], reduced[0], ops, t)

    outs = hub.outcomes(rank)
    assert all(isinstance(o, Exception) for o in outs), outs
    assert any(s.state.calls > 0 for s in setups)
    for s, b in zip(setups, before):
        after = s.state.feedback.buffers
        assert sorted(after) == sorted(b)
        for k in b:
            np.testing.assert_array_equal(after[k], b[k], err_msg=str(k))


def test_states_with_and_without_buffers():
    on, off = _setups("allgather", [True, False])
    _rounds(_setups("allgather", [True] * N), 1)  # (buffers exist only after a round)
    with pytest.warns(UserWarning, match="starts from zero"):
        on.state.load_state_dict(off.state.state_dict())
    assert on.state.feedback.buffers == {}
    saved = on.state.state_dict()
    with pytest.raises(ValueError, match="error_feedback=True"):
        off.state.load_state_dict(saved)


def test_a_rank_with_another_setting_is_refused_on_every_rank():
    setups = _setups("two-phase", [True, True, False, True])
    outs = _rounds(setups, 1)
    assert all(isinstance(o, ProtocolError) for o in outs), outs
    assert all("error_feedback" in str(o) for o in outs), outs[0]
    assert all(not s.state.feedback or not s.state.feedback.buffers for s in setups)  # before any payload


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"error_feedback": 1}, "error_feedback must be True or False, got 1"),
        ({"error_feedback": "yes"}, "error_feedback must be True or False"),
        ({"error_feedback_dtype": "float16"}, "error_feedback_dtype must be one of 'float32', 'bfloat16'"),
    ],
)
def test_bad_values_name_the_problem(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Settings(**kwargs)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_torch_buffers_in_either_dtype(dtype):
    """TorchOps (the compiled CPU codec): k encodes of one vector decode to k times it less the
    last error, to the buffer dtype's rounding; bfloat16 buffers take half the memory."""
    import torch

    from horovod_alq.core.quantizer import Quantizer
    from horovod_alq.exchange.feedback import ErrorFeedback, Pending
    from horovod_alq.torch.ops import TorchOps

    ops, q = TorchOps(torch.device("cpu")), Quantizer("alq", bits=3, bucket_size=D)
    x = torch.from_numpy(_grads(1)[0])
    fb, total = ErrorFeedback(dtype), torch.zeros(x.shape[0], dtype=torch.float64)
    n = int(x.shape[0])
    for k in range(8):
        out, pending = ops.zeros(n), Pending()
        ops.decode_sum(out, fb.encode(ops, x, q, k, "own", [("t", 0, n, 0)], pending, (0, 1)), [0], q)
        fb.commit(pending)
        total += out.double()
    e = fb.buffers[("own", "t", 0, n)]
    assert e.dtype == getattr(torch, dtype) and fb.nbytes == x.shape[0] * (2 if dtype == "bfloat16" else 4)
    # each bfloat16 rounding of the buffer loses up to 2^-8 of it; the errors are below a level gap
    tol = (8 * 2.0**-8 if dtype == "bfloat16" else 1e-5) * float(x.abs().max())
    np.testing.assert_allclose(total.numpy(), (8 * x.double() - e.double()).numpy(), atol=tol)
