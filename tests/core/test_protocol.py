"""horovod_alq.core.protocol in one process: the tensor vector (built with the module's own builder,
reduced here as Horovod's ops would reduce it, then checked), the round handshake, seeds, collective
names and timeouts. The vectors' length and layout are the module's: the tests find the fields they
perturb by building vectors that differ in one argument."""

import math
import uuid
from types import SimpleNamespace

import numpy as np
import pytest

from horovod_alq.core.handshake import (
    HANDSHAKE_FIELDS,
    REFIT_FIELDS,
    SETTINGS,
    STREAM_FIELDS,
    handshake_range,
    handshake_vector,
    read_handshake,
)
from horovod_alq.core.protocol import (
    DEFAULT_TIMEOUT,
    CollectiveTimeout,
    ProtocolError,
    ReductionMismatch,
    derive_seed,
    first_use_uid,
    outsider_vector,
    process_set_uid,
    read_tensor_vector,
    resolve_timeout,
    shape_hash,
    splitmix64,
    stable_hash,
    tensor_vector,
    tensor_vector_length,
    wait_for,
)

CODE = shape_hash((4, 5), "float32")


def _vectors(size, slots=None, codes=None, failed=()):
    """Every rank's tensor vector for one tensor."""
    slots = slots or [0] * size
    codes = codes or [CODE] * size
    return [tensor_vector(r, size, slots[r], codes[r], r in failed) for r in range(size)]


def _reduce(vectors, op="sum", ranks=None):
    """What an allreduce with ``op`` over ``ranks`` (default: all) gives every rank."""
    stack = np.stack([vectors[r] for r in (range(len(vectors)) if ranks is None else ranks)])
    return {
        "sum": stack.sum(0),
        "average": stack.mean(0),
        "min": stack.min(0),
        "max": stack.max(0),
        "product": stack.prod(0),
    }[op]


def _read(reduced, rank, size, slot=0, code=CODE, **kw):
    return read_tensor_vector(reduced, rank=rank, size=size, slot=slot, shape_code=code, **kw)


def _field(size, **changed):
    """The index of the one element that changes when one argument of tensor_vector changes."""
    args = dict(rank=0, size=size, slot=0, shape_code=CODE, failed=False)
    diff = np.flatnonzero(tensor_vector(**args) != tensor_vector(**{**args, **changed}))
    assert diff.size == 1, diff
    return int(diff[0])


# ---------------------------------------------------------------------------- tensor vector
@pytest.mark.parametrize("size", [1, 2, 3, 5])
def test_sum_and_average_give_the_scale_and_every_ranks_slot(size):
    slots = [(3 * r + 1) % 7 for r in range(size)]
    vecs = _vectors(size, slots)
    assert all(v.size == tensor_vector_length(size) and v.dtype == np.float64 for v in vecs)
    for op, scale in (("sum", 1.0), ("average", 1.0 / size)):
        reduced = _reduce(vecs, op)
        for rank in range(size):
            got = _read(reduced, rank, size, slots[rank])
            assert got.slots == tuple(slots) and got.scale == pytest.approx(scale, rel=1e-12)
            # any shape: the front-ends send the vector as a column
            assert _read(reduced.reshape(-1, 1), rank, size, slots[rank]) == got
    prescale = 0.25  # Horovod's prescale and postscale factors multiply the vector: folded into the scale
    assert _read(_reduce([v * prescale for v in vecs]), 0, size, slots[0]).scale == pytest.approx(prescale)


def test_wrong_length_is_a_reducescatter_unless_the_front_end_appended_fields():
    size = 3
    reduced = _reduce(_vectors(size))
    for bad in (reduced[:-1], np.concatenate([reduced, [1.0]])):
        with pytest.raises(
            ReductionMismatch, match=f"has {bad.size} elements on this rank, expected {reduced.size} .*reducescatter"
        ):
            _read(bad, 0, size)
    appended = np.concatenate([reduced, [5.0, -2.0]])
    assert _read(appended, 0, size, extra=2).slots == (0, 0, 0)
    with pytest.raises(ReductionMismatch):
        _read(reduced, 0, size, extra=2)


@pytest.mark.parametrize(
    "size, op, named",
    [
        (3, "min", "Min"),
        (3, "max", "Max"),
        (3, "product", "Product"),
        (4, "min", "Min"),
        (4, "max", "Max"),
        (4, "product", "Product"),
        (2, "min", "Min"),
        (2, "max", "Max or Product"),
        (2, "product", "Max or Product"),
    ],
)
def test_min_max_and_product_are_named(size, op, named):
    reduced = _reduce(_vectors(size, [1] * size), op)
    for rank in range(size):
        with pytest.raises(ProtocolError, match=f"this allreduce used op={named}; .* op=Sum and op=Average only"):
            _read(reduced, rank, size, slot=1)


def test_unequal_weights_adasum_like_do_not_match_a_sum():
    vecs = _vectors(2)
    with pytest.raises(ReductionMismatch, match="does not match a Sum or Average"):
        _read(0.7 * vecs[0] + 0.3 * vecs[1], 0, 2)


def test_a_ranks_missing_slot():
    size = 3
    reduced = _reduce(_vectors(size), ranks=[0, 1])  # rank 2 took no part: another set, or hvd.join()
    for rank in (0, 1):  # their own entry survived: a Sum over a subset, named as such
        with pytest.raises(
            ReductionMismatch,
            match=r"reduced over 2 of the 3 ranks .*ranks \[2\] .*contributed "
            r"nothing.*hvd.join",
        ):
            _read(reduced, rank, size)
    with pytest.raises(ReductionMismatch, match=r"ranks \[2\] of the compressor's process set contributed nothing"):
        _read(reduced, 2, size)


def test_a_rank_outside_the_set_breaks_every_members_check():
    size = 2
    reduced = _reduce(_vectors(size)) + outsider_vector(size)
    assert outsider_vector(size).size == tensor_vector_length(size)
    for rank in range(size):
        with pytest.raises(ReductionMismatch):
            _read(reduced, rank, size)


def test_a_rank_that_failed_to_encode_fails_every_rank():
    size = 3
    assert _field(size, failed=True) != _field(size, slot=1)
    reduced = _reduce(_vectors(size, failed={1}))
    for rank in range(size):
        with pytest.raises(ProtocolError, match=r"1 rank\(s\) could not encode this tensor.*; refusing") as err:
            _read(reduced, rank, size, local_error="boom" if rank == 1 else None)
        assert type(err.value) is ProtocolError and ("(this rank: boom)" in str(err.value)) == (rank == 1)
    with pytest.raises(ProtocolError, match=r"2 rank\(s\) could not encode"):
        _read(_reduce(_vectors(size, failed={0, 2})), 1, size)


def test_shape_or_dtype_mismatch():
    size = 3
    other = shape_hash((4, 5), "float64")
    assert other != CODE and shape_hash((5, 4), "float32") != CODE
    reduced = _reduce(_vectors(size, codes=[CODE, CODE, other]))
    for rank, code in enumerate([CODE, CODE, other]):
        with pytest.raises(ProtocolError, match="different shapes or dtypes"):
            _read(reduced, rank, size, code=code)
    with pytest.raises(ProtocolError, match="different shapes or dtypes"):  # all equal, not this rank's
        _read(_reduce(_vectors(size)), 0, size, code=other)


def test_slots_must_be_whole_and_include_this_ranks():
    size = 3
    reduced = _reduce(_vectors(size, [2, 0, 1]))
    with pytest.raises(ProtocolError, match="do not include this rank's slot 1: corrupted"):
        _read(reduced, 0, size, slot=1)
    broken = reduced.copy()
    broken[_field(size, slot=1)] += 0.5  # rank 0's slot entry
    with pytest.raises(ProtocolError, match="not whole numbers"):
        _read(broken, 1, size, slot=0)


def test_non_finite_or_zero_vectors():
    size = 2
    reduced = _reduce(_vectors(size))
    for bad in (
        np.where(np.arange(reduced.size) == reduced.size - 1, np.nan, reduced),
        reduced * 0.0,
        np.where(np.arange(reduced.size) == 0, np.inf, reduced),
    ):
        with pytest.raises(ProtocolError, match="not finite or its scale is 0"):
            _read(bad, 0, size)


def test_shape_hash():
    codes = {shape_hash(s, d) for s in [(3,), (3, 1), (1, 3), (7, 7, 7)] for d in ("float16", "float32", "float64")}
    assert len(codes) == 12 and all(1 <= c < 2**20 for c in codes)
    assert shape_hash([4, 5], np.dtype("float32")) == CODE  # lists, dtypes by their name


# --------------------------------------------------------------------------------- handshake
def _values(fields=HANDSHAKE_FIELDS, **changed):
    return {**{f: 1 + k for k, f in enumerate(fields)}, "error": 0, **changed}


def _agree(per_rank, fields=HANDSHAKE_FIELDS, local_error=None):
    vecs = [handshake_vector(fields=fields, **v) for v in per_rank]
    return read_handshake(np.max(vecs, axis=0), local_error, fields=fields)


def test_handshake_vector_and_range():
    v = handshake_vector(**_values())
    k = len(HANDSHAKE_FIELDS)
    assert v.dtype == np.int64 and v.shape == (2 * k,) and np.array_equal(v[k:], -v[:k])
    reduced = np.max([handshake_vector(**_values(round=r)) for r in (7, 3, 5)], axis=0)
    assert handshake_range(reduced, "round") == (3, 7)
    assert handshake_range(reduced, "method") == (1 + HANDSHAKE_FIELDS.index("method"),) * 2
    for bad in (-1, 2**62):
        with pytest.raises(ValueError, match=r"handshake fields must lie in \[0, 2\*\*62\)"):
            handshake_vector(**_values(bits=bad))
    assert handshake_vector(**_values(bits=2**62 - 1))[HANDSHAKE_FIELDS.index("bits")] == 2**62 - 1


def test_handshake_agrees_and_tells_a_different_order():
    assert _agree([_values()] * 3).ordered
    assert not _agree([_values(), _values(order=99)]).ordered
    # the early fields only say which early starts to discard
    assert _agree([_values(), _values(early=0, early_ok=0)]).ordered


def test_handshake_error_flag():
    with pytest.raises(ProtocolError, match="a rank failed before the payload exchange.* This rank: bad input"):
        _agree([_values(error=0), _values(error=1)], local_error="bad input")
    with pytest.raises(ProtocolError, match="see the failing rank's error"):
        _agree([_values(error=0), _values(error=1)])


@pytest.mark.parametrize("field", [*SETTINGS, "levels", "allocation", "round", "collecting"])
def test_handshake_names_the_setting_that_differs(field):
    with pytest.raises(ProtocolError, match="the ranks differ in .*Every rank must build the compressor") as err:
        _agree([_values(**{field: 0}), _values(**{field: 1})])
    assert ("0 on some ranks, 1 on others" in str(err.value)) == (field not in ("norm", "exchange", "wire"))


def test_handshake_names_norm_and_exchange():
    with pytest.raises(ProtocolError, match="norm l2 on some ranks, linf on others"):
        _agree([_values(norm=0), _values(norm=1)])
    with pytest.raises(ProtocolError, match="exchange allgather on some ranks, two-phase on others"):
        _agree([_values(exchange=0), _values(exchange=1)])


@pytest.mark.parametrize("field", ["tensors", "elements", "contents"])
def test_handshake_refuses_different_tensors(field):
    with pytest.raises(ProtocolError, match="compressed different tensors in this round"):
        _agree([_values(), _values(**{field: 1000})])


def test_streamed_and_refit_handshakes():
    fields = STREAM_FIELDS
    assert _agree([_values(fields)] * 2, fields).ordered
    for field, message in (
        ("min_size", "quantize different tensors"),
        ("elements", "different numbers of elements"),
        ("order", "hold different tensors"),
    ):
        with pytest.raises(ProtocolError, match=message):
            _agree([_values(fields), _values(fields, **{field: 1000})], fields)
    fields = REFIT_FIELDS
    assert _agree([_values(fields)] * 2, fields).ordered
    with pytest.raises(ProtocolError, match="recorded bits='auto' statistics of different tensors"):
        _agree([_values(fields), _values(fields, recorded=0)], fields)


# ------------------------------------------------------------------------- seeds and names
def test_splitmix64_reference_values():
    """Vigna's SplitMix64 from state 0: its first two outputs."""
    golden = 0x9E3779B97F4A7C15
    assert splitmix64(0) == 0xE220A8397B1DCDAF
    assert splitmix64(golden) == 0x6E789E6AA1B965F4


def test_derive_seed_mixes_every_key():
    seeds = {derive_seed(11, rank, rnd) for rank in range(8) for rnd in range(200)}
    assert len(seeds) == 1600 and all(0 <= s < 2**63 for s in seeds)
    assert derive_seed(11, 1, 2) == derive_seed(11, 1, 2) != derive_seed(11, 2, 1)
    assert derive_seed(11, 1, 2) != derive_seed(12, 1, 2) and derive_seed(11) != derive_seed(11, 0)
    assert derive_seed(-1, 3) == derive_seed(2**64 - 1, 3)  # keys and base taken mod 2**64
    bits = np.array([[(derive_seed(5, k) >> b) & 1 for b in range(63)] for k in range(400)])
    # every bit is a fair coin over the keys: 400 draws, |mean - 1/2| < 5 sigma (sigma = 0.025)
    assert np.abs(bits.mean(0) - 0.5).max() < 5 * 0.025


def test_stable_hash():
    assert stable_hash("a", 1) == stable_hash("a", 1) != stable_hash(1, "a")
    assert all(0 <= stable_hash(k, bits=10) < 1024 for k in range(100))
    assert stable_hash(3) < 2**62


def test_first_use_uid_counts_per_scope():
    a, b = f"test-{uuid.uuid4().hex}", f"test-{uuid.uuid4().hex}"
    assert [first_use_uid(a), first_use_uid(a), first_use_uid(b), first_use_uid(a)] == [
        f"{a}.0",
        f"{a}.1",
        f"{b}.0",
        f"{a}.2",
    ]
    pid = 10**9 + uuid.uuid4().int % 10**6
    ps = SimpleNamespace(process_set_id=pid)
    assert [process_set_uid(ps), process_set_uid(ps)] == [f"ps{pid}.0", f"ps{pid}.1"]


# ---------------------------------------------------------------------------------- timeouts
def test_resolve_timeout(monkeypatch):
    monkeypatch.delenv("HOROVOD_ALQ_TIMEOUT", raising=False)
    assert resolve_timeout() == DEFAULT_TIMEOUT == 300.0
    assert resolve_timeout(2) == 2.0 and resolve_timeout("1.5") == 1.5 and resolve_timeout(0) == math.inf
    monkeypatch.setenv("HOROVOD_ALQ_TIMEOUT", "12.5")
    assert resolve_timeout() == 12.5 and resolve_timeout(3) == 3.0  # the keyword wins
    monkeypatch.setenv("HOROVOD_ALQ_TIMEOUT", "0")
    assert resolve_timeout() == math.inf
    for bad in (-1, float("nan"), "-0.5"):
        with pytest.raises(ValueError, match="timeout must be a number of seconds >= 0"):
            resolve_timeout(bad)
    for bad in ("soon", [1]):
        with pytest.raises(ValueError, match="timeout must be a number of seconds"):
            resolve_timeout(bad)
    monkeypatch.setenv("HOROVOD_ALQ_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="HOROVOD_ALQ_TIMEOUT must be a number of seconds .*'soon'"):
        resolve_timeout()


def test_wait_for_returns_when_done_and_raises_after_the_timeout():
    calls = []
    wait_for(lambda: calls.append(1) or len(calls) > 3, 10.0, "n", "s")
    assert len(calls) == 4
    with pytest.raises(
        CollectiveTimeout, match="collective 'horovod_alq.ps0.3.7.x' over process set 0 did not complete within 0.05 s"
    ) as err:
        wait_for(lambda: False, 0.05, "horovod_alq.ps0.3.7.x", "process set 0")
    assert isinstance(err.value, TimeoutError) and isinstance(err.value, ProtocolError)
