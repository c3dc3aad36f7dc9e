"""The safety protocol of the quantized exchange, written once for every front-end (``docs/design/design.md``).

Two small messages keep every rank on the same path, whatever the ranks do:

* the **tensor vector**, what ``compress`` hands the framework's allreduce in place of the gradient.
  The allreduce pairs tensors by name, so its result tells every rank, for *this* tensor, which op
  reduced it and with which scale, which process set took part, whether all ranks passed the same
  shape and dtype, whether some rank failed to encode it, and the slot every rank gave it in its
  round (so ranks that compressed their tensors in different orders are paired correctly);
* the **round handshake**, one tiny allreduce (max of ``v`` and ``-v``, so every rank learns the
  minimum and the maximum of each field) before any payload moves: settings, levels, round number,
  refit flag and the round's layout. Payload collectives are issued only after it agreed, so no
  rank issues a collective that another rank will not issue.

Everything here is NumPy; the transports only move the vectors.
"""

from __future__ import annotations

import hashlib
import itertools
import math
import os
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

PREFIX = "horovod_alq"
#: The handshake's exchange ids and their names (filled by :func:`horovod_alq.exchange.registry.register`).
EXCHANGE_NAMES: dict[int, str] = {}
MASK64 = (1 << 64) - 1

# ---------------------------------------------------------------------------------------------
# Seeds


def splitmix64(z: int) -> int:
    """One step of SplitMix64 (a 64-bit mixing function)."""
    z = (int(z) + 0x9E3779B97F4A7C15) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def derive_seed(base: int, *keys: int) -> int:
    """A 63-bit seed for one encode: ``base`` mixed with every key (rank, round, buffer, shard, phase).

    Different keys give independent-looking streams; the same keys give the same stream on every run."""
    z = int(base) & MASK64
    for key in keys:
        z = splitmix64(z ^ splitmix64(int(key) & MASK64))
    return z >> 1


def stable_hash(*parts, bits: int = 62) -> int:
    """A hash of ``repr(parts)`` that is the same on every rank and every run (unlike ``hash``)."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << bits) - 1)


# ---------------------------------------------------------------------------------------------
# Collective names and bounded waits

_FIRST_USE: dict[str, itertools.count] = {}


def first_use_uid(scope: str) -> str:
    """The name part of the next compressor *used* (not created) in ``scope`` (a process set's
    identity) by this process: ``"<scope>.<k>"`` for the ``k``-th. Ranks that run the same program
    first use their compressors of one process set in the same order, whatever objects each rank
    created (a compressor per process set, one made on some ranks only), so their collectives get
    the same names; compressors of different process sets never share a name."""
    counter = _FIRST_USE.setdefault(scope, itertools.count())
    return f"{scope}.{next(counter)}"


def process_set_uid(process_set) -> str:
    """:func:`first_use_uid` for a Horovod process set (torch or TF): scope ``"ps<id>"``."""
    return first_use_uid(f"ps{process_set.process_set_id}")


#: Seconds a rank waits for one of this package's own collectives before it raises; keyword
#: ``timeout=`` of every front-end, else ``$HOROVOD_ALQ_TIMEOUT``; 0: wait forever.
DEFAULT_TIMEOUT = 300.0


def resolve_timeout(value: float | None = None) -> float:
    """``value``, else ``$HOROVOD_ALQ_TIMEOUT``, else :data:`DEFAULT_TIMEOUT`; 0 means no limit
    (``inf``). ValueError for a negative or non-numeric value."""
    source = "timeout"
    if value is None:
        env = os.environ.get("HOROVOD_ALQ_TIMEOUT")
        if env is None:
            return DEFAULT_TIMEOUT
        source, value = "HOROVOD_ALQ_TIMEOUT", env
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{source} must be a number of seconds (0: no limit), got {value!r}") from None
    if not seconds >= 0:
        raise ValueError(f"{source} must be a number of seconds >= 0 (0: no limit), got {value!r}")
    return math.inf if seconds == 0 else seconds


def timeout_error(name: str, seconds: float, scope: str) -> "CollectiveTimeout":
    """The error of a rank that waited ``seconds`` for collective ``name`` over ``scope``."""
    return CollectiveTimeout(
        f"{PREFIX}: collective {name!r} over {scope} did not complete within {seconds:g} s "
        f"(timeout=, $HOROVOD_ALQ_TIMEOUT). Likely causes: a rank stopped calling in the middle of a "
        f"round (it raised, or took another branch); ranks used their compressors in different "
        f"orders or a rank used one that others did not (collective names follow the order in which "
        f"each rank first uses its compressors of a process set); ranks built them with different "
        f"arguments. Horovod's own stall warnings, if any, name the ranks that did not join"
    )


def wait_for(done: Callable[[], bool], seconds: float, name: str, scope: str) -> None:
    """Return once ``done()`` is true; raise :func:`timeout_error` after ``seconds``. Polls with a
    backoff from 20 microseconds to 1 ms, so a short collective costs little more than a blocking wait."""
    if done():
        return
    deadline = time.monotonic() + seconds
    pause = 2e-5
    while not done():
        if time.monotonic() > deadline:
            raise timeout_error(name, seconds, scope)
        time.sleep(pause)
        pause = min(pause * 2, 1e-3)


# ---------------------------------------------------------------------------------------------
# The tensor vector

_HEAD = 7  # [1, p, p**2, h, h**2, error, p * 2**45], p = rank + 1, h = shape/dtype hash in [1, 2**20)
_SHAPE_BITS = 20
#: The last head field, ``p * 2**45``, dominates the vector's norm and makes the ranks' vectors far
#: from parallel (norms in ratio p): Adasum, which averages nearly parallel vectors, then gives
#: unequal weights to the ranks and the sums no longer match (exact in float64: a multiple of 2**45).
_ADASUM_GUARD = float(2**45)


def tensor_vector_length(size: int) -> int:
    """Length of the tensor vector for a process set of ``size`` ranks."""
    return _HEAD + int(size)


def control_shape(length: int) -> tuple[int, int]:
    """The shape the front-ends give the tensor vector (``length`` elements, any appended fields
    included) in the framework's allreduce: ``(length, 1)``. No tensor that travels uncompressed
    enters that allreduce with this shape (:func:`passthrough_shape`), so when one rank passes a
    tensor uncompressed and another compresses one under the same name, Horovod's shape check
    refuses the pair on every rank instead of summing the tensor with a control vector."""
    return int(length), 1


def passthrough_shape(shape: Sequence[int]) -> tuple[int, ...]:
    """The shape under which a tensor of ``shape`` that travels uncompressed enters the framework's
    allreduce: its own, with one more trailing 1 when it has 2 or more dims and its last is 1
    (``(9, 1)`` goes as ``(9, 1, 1)``). Injective, and never a :func:`control_shape`: two ranks'
    uncompressed tensors still pair exactly when their shapes are equal. The front-end restores
    the shape in decompress."""
    shape = tuple(int(s) for s in shape)
    return (*shape, 1) if len(shape) >= 2 and shape[-1] == 1 else shape


def shape_hash(shape: Sequence[int], dtype: str) -> int:
    """Hash of a tensor's shape and dtype in ``[1, 2**20)``: small enough that sums of squares over
    thousands of ranks stay exact in float64."""
    return 1 + stable_hash(tuple(int(s) for s in shape), str(dtype), bits=_SHAPE_BITS) % ((1 << _SHAPE_BITS) - 1)


def tensor_vector(rank: int, size: int, slot: int, shape_code: int, failed: bool) -> np.ndarray:
    """This rank's tensor vector (float64) for the tensor in ``slot`` of its round."""
    p = float(rank + 1)
    h = float(shape_code)
    vec = np.zeros(tensor_vector_length(size), dtype=np.float64)
    vec[:_HEAD] = [1.0, p, p * p, h, h * h, 1.0 if failed else 0.0, p * _ADASUM_GUARD]
    vec[_HEAD + rank] = slot + 1
    return vec


@dataclass(frozen=True)
class Reduced:
    """What the reduced tensor vector says about one tensor.

    Attributes
    ----------
    scale : float
        Multiply the *sum* of the ranks' decoded values by this: 1 for Sum, 1/N for Average, with
        Horovod's pre- and postscale factors folded in.
    slots : tuple of int
        The slot every rank of the process set gave this tensor in its round, in rank order.
    """

    scale: float
    slots: tuple[int, ...]


def _close(a: float, b: float, rtol: float = 1e-9) -> bool:
    return abs(a - b) <= rtol * max(1.0, abs(b))


class ProtocolError(RuntimeError):
    """Raised identically on every rank when the protocol finds that ranks disagree."""


def error_text(error: BaseException | None) -> str | None:
    """How a rank's own error travels in a handshake: ``"Type: message"`` (None: no error)."""
    return None if error is None else f"{type(error).__name__}: {error}"


class ReductionMismatch(ProtocolError):
    """The tensor vector was not reduced by a Sum or Average over exactly the compressor's process
    set (another set, ``hvd.join``, a reducescatter, Adasum): some ranks of the set may not be in
    this collective at all, so no further collective over the set may be issued for this round."""


class CollectiveTimeout(ProtocolError, TimeoutError):
    """One of this package's collectives did not complete within the timeout (:func:`wait_for`)."""


def outsider_vector(size: int) -> np.ndarray:
    """What a rank outside the compressor's process set (of ``size`` ranks) hands an allreduce over
    another set: a vector that makes every member's check fail (the head sums stop matching)."""
    vec = np.zeros(tensor_vector_length(size), dtype=np.float64)
    vec[0] = 1.0
    vec[5] = 1.0
    return vec


def op_ok(head: np.ndarray, size: int) -> bool:
    """Whether the reduced ``[1, p, p**2]`` (p = rank + 1) is a Sum or an Average over ``size`` ranks."""
    n = int(size)
    v0, v1, v2 = (float(x) for x in head[:3])
    return v0 != 0 and _close(v1 / v0, (n + 1) / 2) and _close(v2 / v0, (n + 1) * (2 * n + 1) / 6)


def check_op(head: np.ndarray, size: int) -> None:
    """Raise :class:`ProtocolError` naming the op when the reduced ``[1, p, p**2]`` shows Min, Max
    or Product over ``size`` ranks (the values each op gives are distinct for N > 1)."""
    n = int(size)
    v = [float(x) for x in head[:3]]
    if n <= 1:
        return
    fact = math.factorial(n) if n <= 20 else float("inf")
    if v == [1.0, 1.0, 1.0]:
        op = "Min"
    elif v[0] == 1 and _close(v[1], n) and _close(v[2], n * n) and n > 2:
        op = "Max"
    elif v[0] == 1 and _close(v[1], fact) and _close(v[2], fact * fact):
        op = "Max or Product" if n == 2 else "Product"
    else:
        return
    raise ProtocolError(
        f"{PREFIX}: this allreduce used op={op}; a quantized exchange can only sum or average "
        f"(the ranks' decoded values are summed), so horovod_alq compressors support op=Sum and "
        f"op=Average only. Pass compression=hvd.Compression.none for this call"
    )


@dataclass(frozen=True)
class Joined:
    """A reduced tensor vector that is a Sum or an Average over the process set's ranks but ``missing``
    (their entries 0): :func:`joined_ranks`."""

    missing: tuple[int, ...]
    scale: float  # the factor on the plain sum of the other ranks' tensors (Horovod's op and factors)
    slots: tuple[int, ...]  # the slot each other rank gave the tensor, in rank order


def joined_ranks(reduced: np.ndarray, *, rank: int, size: int, shape_code: int) -> Joined | None:
    """What an allreduce over the compressor's own process set gives when ranks of the set are in
    ``hvd.join()`` (Horovod sums zeros for them): None unless every check of
    :func:`read_tensor_vector` holds over the ranks whose entries are not 0, this rank among them,
    and at least one rank's entry is 0. Only the caller knows that the allreduce ran over the
    compressor's set (an allreduce over a smaller set gives the same vector)."""
    v = np.asarray(reduced, dtype=np.float64).ravel()
    n = int(size)
    if v.size < tensor_vector_length(n) or not np.isfinite(v).all() or v[0] <= 0:
        return None
    entries = v[_HEAD : _HEAD + n]
    present = [r for r in range(n) if entries[r] != 0]
    if len(present) == n or rank not in present:
        return None
    m = len(present)
    w = v * (m / v[0])  # the sums over the present ranks under op=Sum without scaling
    ps = [r + 1.0 for r in present]
    if not (
        _close(w[1], sum(ps))
        and _close(w[2], sum(p * p for p in ps))
        and _close(w[6], _ADASUM_GUARD * sum(ps))
        and abs(w[5]) < 0.5
        and round(w[3]) == m * shape_code
        and round(w[4]) == m * shape_code * shape_code
    ):
        return None
    slots = tuple(int(round(w[_HEAD + r])) - 1 for r in present)
    if any(abs(s + 1 - w[_HEAD + r]) > 1e-6 * max(1.0, w[_HEAD + r]) for s, r in zip(slots, present)):
        return None
    return Joined(tuple(r for r in range(n) if r not in present), float(v[0]) / m, slots)


def read_tensor_vector(
    reduced: np.ndarray,
    *,
    rank: int,
    size: int,
    slot: int,
    shape_code: int,
    local_error: str | None = None,
    scope: str = "",
    extra: int = 0,
) -> Reduced:
    """Check a reduced tensor vector (of any shape: the front-ends send it as :func:`control_shape`)
    and return the scale and the ranks' slots.

    Every rank receives the same reduced vector for the same tensor, so every rank raises the same
    error for the same tensor (``local_error`` only makes the message of the failing rank precise).

    ``scope`` names the compressor's process set in messages (e.g. "process set [0, 1]").
    ``extra``: elements the front-end appended to the vector (TensorFlow: the configuration and the
    statistics), counted in the length check and not read here.

    Raises
    ------
    ProtocolError
        The allreduce was not a Sum or an Average over exactly this process set (Min, Max, Product,
        Adasum, a reducescatter, ``hvd.join``, another process set), a rank failed to encode the
        tensor, ranks passed different shapes or dtypes, or the slots are not valid.
    """
    v = np.asarray(reduced, dtype=np.float64).ravel()
    n = int(size)
    expected = tensor_vector_length(n)
    where = f"the compressor's {scope or 'process set'} ({n} ranks)"
    if v.size != expected + extra:
        raise ReductionMismatch(
            f"{PREFIX}: the reduced control vector has {v.size} elements on this rank, expected "
            f"{expected + extra} for {where}: the compressed tensor went through a collective other than "
            f"an allreduce. hvd.reducescatter (and grouped_reducescatter) is not supported with horovod_alq "
            f"compressors (refused on every rank before any payload moved): pass "
            f"compression=hvd.Compression.none to reducescatter"
        )
    v = v[:expected]
    if not np.isfinite(v).all() or v[0] == 0:
        raise ProtocolError(
            f"{PREFIX}: the reduced control vector is not finite or its scale is 0 "
            f"({v[:3].tolist()}): the allreduce used an op other than Sum or Average"
        )
    entries = v[_HEAD:]
    missing = [r for r in range(n) if entries[r] == 0]
    if entries[rank] > 0 and missing:
        # this rank's own entry survived and others' are 0: a Sum or Average over a subset of the
        # set (Min and Product zero this rank's entry too; Max keeps every entry)
        raise ReductionMismatch(
            f"{PREFIX}: this allreduce reduced over {n - len(missing)} of the {n} ranks of {where}: "
            f"ranks {missing} (in the set's numbering) contributed nothing. The allreduce ran over "
            f"another process set than the compressor's (pass the same process_set= to the compressor "
            f"and to the allreduce / optimizer, or make one compressor per process set), or those ranks "
            f"were in hvd.join() (a joined rank cannot send quantized payloads)"
        )
    check_op(v[:3], n)
    w = v * (n / v[0])  # the sums the vector would have under op=Sum without scaling
    slots_raw = w[_HEAD:]
    absent = [r for r in range(n) if slots_raw[r] < 0.5]
    ok_op = (
        _close(w[1], n * (n + 1) / 2)
        and _close(w[2], n * (n + 1) * (2 * n + 1) / 6)
        and _close(w[6], _ADASUM_GUARD * n * (n + 1) / 2)
    )
    if absent or not ok_op:
        who = (
            f"ranks {absent} of the compressor's process set contributed nothing"
            if absent
            else "the reduced control vector does not match a Sum or Average over the compressor's process set"
        )
        raise ReductionMismatch(
            f"{PREFIX}: {who} (process set of {n} ranks; reduced head {v[:3].tolist()}). Causes: "
            f"op=Adasum or another op than Sum/Average; hvd.join() (a joined rank cannot send "
            f"quantized payloads); or an allreduce over another process set than the compressor's "
            f"(pass the same process_set= to the compressor and to the allreduce / optimizer)"
        )
    if w[5] > 0.5:
        mine = f" (this rank: {local_error})" if local_error else ""
        raise ProtocolError(
            f"{PREFIX}: {int(round(w[5]))} rank(s) could not encode this tensor{mine}; refusing to decode on every rank"
        )
    # All ranks passed the same shape and dtype iff (sum h)**2 == n * sum h**2 (Cauchy-Schwarz).
    s1, s2 = round(w[3]), round(w[4])
    if s1 * s1 != n * s2 or s1 != n * shape_code:
        raise ProtocolError(
            f"{PREFIX}: the ranks passed tensors of different shapes or dtypes to the same allreduce "
            f"(this rank's differs from another rank's); Horovod requires the same shape and dtype on "
            f"every rank"
        )
    slots = tuple(int(round(s)) - 1 for s in slots_raw)
    if any(abs(s + 1 - x) > 1e-6 * max(1.0, x) for s, x in zip(slots, slots_raw)) or slots[rank] != slot:
        raise ProtocolError(
            f"{PREFIX}: the reduced slots {slots_raw.tolist()} are not whole numbers or "
            f"do not include this rank's slot {slot}: corrupted control vector"
        )
    return Reduced(float(v[0]) / n, slots)
