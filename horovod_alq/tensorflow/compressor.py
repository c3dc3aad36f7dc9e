"""Horovod compressors for TensorFlow that put bit-packed codes on the wire.

Usage::

    import horovod.tensorflow as hvd
    from horovod_alq.tensorflow import ALQCompressor

    compression = ALQCompressor(bits=3, bucket_size=8192)
    tape = hvd.DistributedGradientTape(tape, compression=compression)   # or hvd.allreduce(..., compression=)

Same exchange as the PyTorch compressors (``docs/design.md``): ``compress`` encodes the gradient
into a uint8 payload (same bytes layout as the NumPy core), starts an allgather of it and hands
Horovod's allreduce a small float64 vector ``[1, k, k**2, statistics...]``; ``decompress`` checks
the reduced vector, validates every rank's header against this rank's configuration, decodes all
payloads, sums and scales. Everything is TF ops, so it works eagerly and inside ``tf.function``
(traced once, run for many steps): the state lives in ``tf.Variable`` s and the level fits call the
NumPy core through ``tf.numpy_function``.

Rounds in TensorFlow
--------------------
A *round* (one optimizer step) begins at the first compressing call of a step:

* inside ``tf.function`` (which is also how ``hvd.DistributedGradientTape`` and Horovod's Keras
  optimizer run, even "eagerly"), call sites are numbered while tracing, per traced function; the
  first one (``k = 0``) begins the round each time the function runs. So one ``gradient()`` call, or
  one run of a traced training step, is one round, however many tensors it compresses;
* eagerly (a plain ``hvd.allreduce`` / ``hvd.grouped_allreduce``), as in PyTorch: from the first
  compress while no exchange is outstanding until all of them were decompressed.

Statistics of a refit round are summed (in call order, identical on every rank) and the new levels
are fit when the *next* round begins, before anything is encoded, so all ranks switch at the same
point. ``metrics()["level_updates"]`` therefore counts a refit once the next round started.
"""

from __future__ import annotations

import functools
import itertools
import os
import types
import weakref
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import tensorflow as tf

from ..core import frontends
from ..core.methods import get_method
from ..core.quantizer import Quantizer
from ..core.rounds import schedule_from
from ..core.statistics import GRID, statistics_length
from ..core.protocol import ProtocolError, check_op, op_ok, shape_hash
from ..core.wire import HEADER_SIZE, Header, check_header, pack_header, parse_header, payload_size
from . import kernels

COMPRESSIBLE = (tf.float16, tf.bfloat16, tf.float32, tf.float64)
_HEAD = 7  # [1, k, k**2, p, p**2, h, h**2]: slot k, p = rank + 1, h = shape/dtype hash
_UIDS = itertools.count()
_MASK64 = (1 << 64) - 1


def _hvd():
    """horovod.tensorflow, imported on first use so that the kernels work without Horovod."""
    import horovod.tensorflow as hvd

    return hvd


def _splitmix64(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def _signed64(z: int) -> int:
    z &= _MASK64
    return z - (1 << 64) if z >> 63 else z


def header_mask(fingerprint: int) -> np.ndarray:
    """The header bytes that depend on the levels, as an XOR mask over a header packed with
    fingerprint 0: the fingerprint (bytes 24..32) and its effect on the CRC-32 (bytes 12..16).

    CRC-32 is affine over XOR for messages of equal length, so
    ``crc(h0 ^ m) = crc(h0) ^ crc(m) ^ crc(zeros)``: one mask per level set serves every tensor size.

    Returns
    -------
    np.ndarray, shape (32,), int32 (byte values)
    """
    raw = bytearray(HEADER_SIZE)
    raw[24:32] = int(fingerprint).to_bytes(8, "little")
    delta = zlib.crc32(bytes(raw)) ^ zlib.crc32(bytes(HEADER_SIZE))
    raw[12:16] = delta.to_bytes(4, "little")
    return np.frombuffer(bytes(raw), dtype=np.uint8).astype(np.int32)


def _outermost_graph():
    """The graph of the outermost function being traced (cond/while branches are nested graphs)."""
    graph = tf.compat.v1.get_default_graph()
    while hasattr(graph, "outer_graph") and hasattr(graph.outer_graph, "outer_graph"):
        graph = graph.outer_graph
    return graph


@dataclass
class _Exchange:
    """Context of one compressed tensor between compress and decompress."""

    slot: int
    shape: tf.TensorShape
    dtype: tf.DType
    numel: int
    gathered: tf.Tensor
    collecting: Any  # bool tensor, or None for fixed methods
    levels: tf.Tensor
    header: tf.Tensor
    eager: bool
    source: Any = None  # the compressed tensor (autograd connects the output to it)
    shape_code: int = 0
    fitted: Any = None  # the gathered bytes cut or padded to the expected length (set by the check)


@dataclass
class _PassThrough:
    """Context of a tensor that travels uncompressed (too small, unknown size, not floating point)."""

    dtype: tf.DType


@functools.cache
def _codec(bits: int, bucket_size: int, norm: str, jit_compile: bool) -> types.SimpleNamespace:
    """The codec of one configuration as ``tf.function`` s: ``encode(tensor, levels, header, seed)``,
    ``decoder(numel, ranks)(gathered, levels, scale)``, ``normless(tensor)`` and ``grid(tensor)``."""
    opts = dict(bits=bits, bucket_size=bucket_size)
    encode = tf.function(functools.partial(kernels.encode, norm=norm, unrolled=jit_compile, **opts),
                         autograph=False, jit_compile=jit_compile)

    decoders: dict = {}

    def decoder(numel: int, ranks: int):
        if (numel, ranks) not in decoders:
            decoders[numel, ranks] = tf.function(functools.partial(kernels.decode_sum, ranks=ranks, numel=numel, **opts),
                                                 autograph=False, jit_compile=jit_compile)
        return decoders[numel, ranks]

    return types.SimpleNamespace(
        encode=tf.function(encode, autograph=False), decoder=decoder,
        normless=tf.function(functools.partial(kernels.normless_statistics, bucket_size=bucket_size, norm=norm),
                             autograph=False),
        grid=tf.function(functools.partial(kernels.grid_statistics, grid=GRID, bucket_size=bucket_size, norm=norm),
                         autograph=False))


class _ClassOrInstance(frontends.ClassOrInstance):
    """:class:`frontends.ClassOrInstance` whose method autograph leaves alone: it is plain Python
    over static shapes, called from inside tf.function."""

    def __init__(self, func):
        super().__init__(tf.autograph.experimental.do_not_convert(func))
        self.__doc__ = func.__doc__


class QuantizedCompressor(frontends.CompressorBase, tf.Module):
    """Base class: a Horovod ``compression=`` object for one quantization method (TensorFlow).

    A ``tf.Module``: its state (levels, AMQ multiplier, counters, pending statistics, seed) lives in
    ``tf.Variable`` s, so ``tf.train.Checkpoint(compressor=c)`` saves and restores it; restore into
    a compressor built with the same arguments. :meth:`state_dict` / :meth:`load_state_dict` give
    the same state as plain Python values (the PyTorch compressors' layout, validated on load).
    Only Horovod's global process set is supported (the payloads are allgathered over all ranks).

    Parameters
    ----------
    method : str
        One of :data:`horovod_alq.core.methods.METHODS`.
    bits : int
        Bits per coordinate on the wire (2..8; TernGrad: 2).
    bucket_size : int
        Coordinates per float32 norm. 8192 costs 0.004 extra bits per coordinate.
    update_steps : sequence of int, optional
        Rounds (optimizer steps) whose statistics refit the levels; default (0, 100, 2000).
    update_every : int, optional
        After the last of ``update_steps``, refit every this many rounds; default 10000, 0: never.
    min_size : int
        Tensors with fewer elements (or whose size is not known when traced) travel uncompressed
        through Horovod's plain allreduce. Default 1024.
    seed : int, optional
        Seed of the stochastic rounding (combined with the rank and a call counter, so the draws
        differ on every rank and every call, also inside ``tf.function``). Default: fresh entropy.
    jit_compile : bool
        Compile the encoder (all but the random draws) and the decoder with XLA, once per tensor
        shape: several times faster on CPU, at a compile of about a second per shape. Default True;
        False runs the same TF ops op by op.
    norm : {"l2", "linf"}, optional
        Bucket norm (adaptive methods take either; None: the method's default). See
        :class:`horovod_alq.core.Quantizer`.
    """

    method: str = ""
    # Python-side configuration: not part of tf.Module's variable search.
    _TF_MODULE_IGNORED_PROPERTIES = frozenset(tf.Module._TF_MODULE_IGNORED_PROPERTIES | {
        "_fns", "_quantizer", "_schedule", "_method"})

    def __init__(self, method: str | None = None, bits: int = 3, bucket_size: int = 8192, *,
                 update_steps: Sequence[int] | None = None, update_every: int | None = None,
                 min_size: int = 1024, seed: int | None = None, jit_compile: bool = True,
                 norm: str | None = None) -> None:
        super().__init__(name=type(self).__name__)
        method = method or self.method
        self._method = get_method(method)
        self._quantizer = Quantizer(self._method.name, bits=bits, bucket_size=bucket_size, norm=norm)
        self._schedule = schedule_from(update_steps, update_every)
        self.min_size = frontends.check_min_size(min_size)
        self.jit_compile = bool(jit_compile)
        seed = int.from_bytes(os.urandom(8), "little") if seed is None else int(seed) & _MASK64
        self._uid = next(_UIDS)
        self._stats_len = statistics_length(self._method)
        self._outstanding = 0  # eager exchanges begun and not yet decompressed
        self._slot = 0
        q = self._quantizer
        multiplier = q.multiplier if q.multiplier is not None else float("nan")
        with tf.init_scope():
            self._levels = tf.Variable(q.levels, dtype=tf.float64, trainable=False, name="levels")
            self._multiplier = tf.Variable(multiplier, dtype=tf.float64, trainable=False, name="multiplier")
            self._header_mask = tf.Variable(header_mask(q.fingerprint), dtype=tf.int32, trainable=False,
                                            name="header_mask")
            self._seed = tf.Variable(_signed64(seed), dtype=tf.int64, trainable=False, name="seed")
            self._rounds = tf.Variable(0, dtype=tf.int64, trainable=False, name="rounds")
            self._level_updates = tf.Variable(0, dtype=tf.int64, trainable=False, name="level_updates")
            # compress calls, payload bytes, compressed coordinates
            self._traffic = tf.Variable([0, 0, 0], dtype=tf.int64, trainable=False, name="traffic")
            self._uncompressed = tf.Variable(0, dtype=tf.int64, trainable=False, name="uncompressed")
            self._pending = tf.Variable(np.zeros(self._stats_len), dtype=tf.float64, trainable=False,
                                        name="pending_statistics")
            self._pending_count = tf.Variable(0, dtype=tf.int64, trainable=False, name="pending_count")
        # The codec's tf.functions (shared by compressors with the same configuration; one trace and
        # XLA compile per tensor shape) and per-traced-graph call-site counters, in a plain namespace
        # so that tf.Module / tf.train.Checkpoint do not track them.
        codec = _codec(q.bits, q.bucket_size, q.norm, self.jit_compile)
        self._fns = types.SimpleNamespace(sites=weakref.WeakKeyDictionary(), codec=codec, encode=codec.encode,
                                          stats=codec.normless if self._stats_len == 4 else codec.grid)

    # ------------------------------------------------------------------ configuration
    @property
    def levels(self) -> np.ndarray:
        """Current levels, shape (L,), float64 (read eagerly)."""
        return self._levels.numpy()

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(method={self._method.name!r}, bits={self.bits}, "
                f"bucket_size={self.bucket_size}, min_size={self.min_size})")

    # ------------------------------------------------------------------ Horovod interface
    @_ClassOrInstance
    def compress(self, tensor):
        """Encode ``tensor``, start the allgather of its payload, return the small vector to allreduce."""
        tensor = tf.convert_to_tensor(tensor)
        numel = tensor.shape.num_elements()
        if tensor.dtype not in COMPRESSIBLE or numel is None or numel < max(self.min_size, 1):
            self._uncompressed.assign_add(tf.cast(tf.size(tensor), tf.int64))
            if tensor.dtype == tf.bfloat16:  # Horovod's TF allreduce has no bfloat16
                return tf.cast(tensor, tf.float32), _PassThrough(tensor.dtype)
            return tensor, _PassThrough(tensor.dtype)
        eager = tf.executing_eagerly()
        slot = self._next_slot(eager)
        try:
            return self._compress(tensor, numel, slot, eager)
        except Exception:
            if eager:
                self._outstanding -= 1
            raise

    def _compress(self, tensor, numel: int, slot: int, eager: bool):
        if slot == 0:
            self._begin_round()
        size = payload_size(numel, self.bits, self.bucket_size)
        calls = self._traffic.assign_add(tf.constant([1, size, numel], tf.int64))[0] - 1
        collecting = self._collecting() if self._method.adaptive else None
        levels = self._levels.read_value()
        header = self._header(numel)
        seed = tf.stack([tf.bitwise.bitwise_xor(self._seed.read_value(), self._rank_key()), calls])
        payload = self._fns.encode(tensor, levels, header, seed)
        hvd = _hvd()
        gathered = hvd.allgather(payload, name=f"horovod_alq.{self._uid}.{slot}", ignore_name_scope=True)
        p = float(_hvd().rank() + 1)
        h = float(shape_hash(tuple(tensor.shape.as_list()), tensor.dtype.name))
        head = tf.constant([1.0, float(slot), float(slot) ** 2, p, p * p, h, h * h], tf.float64)
        if collecting is None:
            small = head
        else:
            small = tf.cond(collecting, lambda: tf.concat([head, self._statistics(tensor)], 0), lambda: head)
        return small, _Exchange(slot, tensor.shape, tensor.dtype, numel, gathered, collecting, levels, header,
                                eager, source=tensor, shape_code=int(h))

    @_ClassOrInstance
    def decompress(self, tensor, ctx):
        """Check the payloads and return the reduced gradient in the original shape and dtype."""
        if ctx is None:
            return tensor
        if isinstance(ctx, _PassThrough):
            return tf.cast(tensor, ctx.dtype) if tensor.dtype != ctx.dtype else tensor
        try:
            reduced = tf.cast(tensor, tf.float64)
            head = reduced[:_HEAD]
            pairing_ok = self._pairing_ok(head, ctx.slot, ctx.shape_code)
            payloads_ok = self._payloads_ok(ctx)

            def decode():
                scale = tf.cast(reduced[0] / _hvd().size(), tf.float32)
                out = self._decode_fn(ctx.numel)(ctx.fitted, ctx.levels, scale)
                if ctx.collecting is None:
                    return out

                def keep():
                    with tf.control_dependencies([self._pending.assign_add(reduced[_HEAD:] / reduced[0]),
                                                  self._pending_count.assign_add(1)]):
                        return tf.constant(True)

                kept = tf.cond(ctx.collecting, keep, lambda: tf.constant(False))
                with tf.control_dependencies([kept]):
                    return tf.identity(out)

            explain = functools.partial(self._explain, slot=ctx.slot, numel=ctx.numel)
            if ctx.eager:
                if not bool(pairing_ok.numpy() and payloads_ok.numpy()):
                    explain(head.numpy(), ctx.gathered.numpy(), ctx.header.numpy())
                out = decode()
            else:
                # The decode runs only in the branch where every check passed (a control dependency
                # on the checks is not enough: TF may run an inlined function's ops before it).
                def fail():
                    def raise_(*values):
                        explain(*values)
                        return np.zeros(ctx.numel, np.float32)  # not reached: explain raises

                    bad = tf.numpy_function(raise_, [head, ctx.gathered, ctx.header], tf.float32,
                                            stateful=True, name="horovod_alq_check")
                    return tf.reshape(bad, [ctx.numel])

                out = tf.cond(tf.logical_and(pairing_ok, payloads_ok), decode, fail)
        finally:
            if ctx.eager:
                self._outstanding -= 1
        out = tf.reshape(tf.cast(out, ctx.dtype), ctx.shape)
        return _connect_gradient(ctx.source, out, reduced[0] / _hvd().size())

    # ------------------------------------------------------------------ metrics and state
    @_ClassOrInstance
    def metrics(self) -> dict:
        """``levels``, ``multiplier``, ``level_updates``, ``step`` (rounds begun), ``payload_bytes``,
        ``coordinates``, ``uncompressed_coordinates``, ``bits_per_coordinate`` (compressed tensors,
        on the wire), ``calls``. Read eagerly, between steps."""
        calls, payload, coords = (int(v) for v in self._traffic.numpy())
        mult = float(self._multiplier.numpy())
        return {
            "levels": self._levels.numpy(),
            "multiplier": None if np.isnan(mult) else mult,
            "level_updates": int(self._level_updates.numpy()),
            "step": int(self._rounds.numpy()),
            "payload_bytes": payload,
            "coordinates": coords,
            "uncompressed_coordinates": int(self._uncompressed.numpy()),
            "bits_per_coordinate": 8.0 * payload / coords if coords else float("nan"),
            "calls": calls,
        }

    def state_dict(self) -> dict:
        """Levels, multiplier, seed, round and call counters and pending statistics, as Python values:
        a compressor that loads it continues with identical levels and identical random draws."""
        if self._outstanding:
            raise RuntimeError("state_dict() during an exchange: call it between steps")
        calls, payload, coords = (int(v) for v in self._traffic.numpy())
        mult = float(self._multiplier.numpy())
        return {
            "seed": int(self._seed.numpy()) & _MASK64,
            "quantizer": {"method": self._method.name, "bits": self.bits, "bucket_size": self.bucket_size,
                          "norm": self.norm, "levels": self._levels.numpy(), "multiplier": None if np.isnan(mult) else mult,
                          "rng": None},
            "step": int(self._rounds.numpy()),
            "level_updates": int(self._level_updates.numpy()),
            "calls": calls,
            "payload_bytes": payload,
            "coordinates": coords,
            "uncompressed_coordinates": int(self._uncompressed.numpy()),
            "pending_statistics": self._pending.numpy(),
            "pending_count": int(self._pending_count.numpy()),
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore a :meth:`state_dict` (also one of a PyTorch compressor with the same method, bits
        and bucket size: its levels, seed and counters)."""
        if self._outstanding:
            raise RuntimeError("load_state_dict() during an exchange: call it between steps")
        q = Quantizer(self._method.name, bits=self.bits, bucket_size=self.bucket_size, norm=self.norm)
        q.load_state_dict(state["quantizer"])  # validates method, norm, bits, bucket size and levels
        pending = np.asarray(state.get("pending_statistics", np.zeros(self._stats_len)), dtype=np.float64)
        if pending.shape != (self._stats_len,):
            raise ValueError(f"pending_statistics has shape {pending.shape}, expected ({self._stats_len},)")
        self._store_levels(q)
        self._seed.assign(_signed64(int(state["seed"])))
        self._rounds.assign(int(state["step"]))
        self._level_updates.assign(int(state["level_updates"]))
        self._traffic.assign([int(state["calls"]), int(state["payload_bytes"]), int(state["coordinates"])])
        self._uncompressed.assign(int(state["uncompressed_coordinates"]))
        self._pending.assign(pending)
        self._pending_count.assign(int(state.get("pending_count", 0)))

    # ------------------------------------------------------------------ internals
    def _store_levels(self, q: Quantizer) -> None:
        self._levels.assign(q.levels)
        self._multiplier.assign(q.multiplier if q.multiplier is not None else float("nan"))
        self._header_mask.assign(header_mask(q.fingerprint))

    def _next_slot(self, eager: bool) -> int:
        """Index ``k`` of this compress call in its round (see the module docstring)."""
        if eager:
            if self._outstanding == 0:
                self._slot = 0
            k = self._slot
            self._slot += 1
            self._outstanding += 1
            return k
        graph = _outermost_graph()
        k = self._fns.sites.get(graph, 0)
        self._fns.sites[graph] = k + 1
        return k

    def _rank_key(self) -> int:
        return _signed64(_splitmix64(_hvd().rank() + 1))

    def _header(self, numel: int) -> tf.Tensor:
        q = self._quantizer
        static = np.frombuffer(pack_header(Header(self._method.id, q.bits, q.bucket_size, numel, 0, norm=q.norm)),
                               np.uint8)
        mixed = tf.bitwise.bitwise_xor(tf.constant(static.astype(np.int32)), self._header_mask.read_value())
        return tf.cast(mixed, tf.uint8)

    def _collecting(self) -> tf.Tensor:
        """Whether the current round (index ``rounds - 1``) gathers statistics for a refit."""
        step = self._rounds.read_value() - 1
        sched = self._schedule
        out = tf.constant(False)
        if sched.steps:
            out = tf.reduce_any(tf.equal(step, tf.constant(sched.steps, tf.int64)))
        if sched.every > 0:
            last = sched.steps[-1] if sched.steps else -1
            periodic = tf.logical_and(step > last, tf.equal(tf.math.floormod(step, sched.every), 0))
            out = tf.logical_or(out, periodic)
        return out

    def _begin_round(self) -> None:
        """Refit from the previous round's statistics (if it collected any), then count the round."""
        if self._method.adaptive:
            def refit():
                levels, mult, mask, updated = tf.numpy_function(
                    self._refit_numpy, [self._levels.read_value(), self._pending.read_value()],
                    [tf.float64, tf.float64, tf.int32, tf.int64], stateful=True, name="horovod_alq_refit")
                levels.set_shape(self._levels.shape)
                mask.set_shape([HEADER_SIZE])
                return tf.group(self._levels.assign(levels), self._multiplier.assign(tf.reshape(mult, [])),
                                self._header_mask.assign(mask),
                                self._level_updates.assign_add(tf.reshape(updated, [])),
                                self._pending.assign(tf.zeros_like(self._pending)),
                                self._pending_count.assign(0))

            def refit_flag():
                with tf.control_dependencies([refit()]):
                    return tf.constant(True)

            tf.cond(self._pending_count > 0, refit_flag, lambda: tf.constant(False))
        self._rounds.assign_add(1)

    def _refit_numpy(self, levels: np.ndarray, stats: np.ndarray):
        """The NumPy core's fit (deterministic: identical inputs give identical levels on every rank)."""
        q = Quantizer(self._method.name, bits=self.bits, bucket_size=self.bucket_size, norm=self.norm)
        q.set_levels(levels)
        updated = 0
        if np.isfinite(stats).all() and stats[0] > 0:  # no finite non-zero bucket seen: keep the levels
            q.adapt(stats)
            updated = 1
        mult = q.multiplier if q.multiplier is not None else float("nan")
        return q.levels, np.float64(mult), header_mask(q.fingerprint), np.int64(updated)

    def _statistics(self, tensor: tf.Tensor) -> tf.Tensor:
        """This rank's statistics vector of ``tensor`` (TF ops; only in refit rounds)."""
        return self._fns.stats(tensor)

    def _decode_fn(self, numel: int):
        return self._fns.codec.decoder(numel, _hvd().size())

    # ---- checks: cheap in-graph tests; on failure a NumPy explanation raises on every rank
    @staticmethod
    def _pairing_ok(head: tf.Tensor, slot: int, shape_code: int) -> tf.Tensor:
        """The reduced head ``[s, s*k, s*k**2, p.., p**2.., h.., h**2..]`` pairs this rank's slot ``k``
        with every other rank's, comes from a Sum or an Average (``p = rank + 1``: see
        :func:`horovod_alq.core.protocol.op_ok`), and every rank passed this shape and dtype
        (hash ``h``: ``(sum h)**2 == N sum h**2``)."""
        k, n, h = float(slot), float(_hvd().size()), float(shape_code)
        scale = head[0]
        ok = tf.logical_and(tf.reduce_all(tf.math.is_finite(head)), tf.not_equal(scale, 0.0))
        safe = tf.where(ok, scale, tf.ones_like(scale))
        w = head / safe  # per-rank mean of each entry
        checks = [tf.abs(w[1] - k) < 1e-6, tf.abs(w[2] - k * k) < 1e-6 * max(1.0, k * k),
                  tf.abs(w[3] - (n + 1) / 2) < 1e-9 * n, tf.abs(w[4] - (n + 1) * (2 * n + 1) / 6) < 1e-9 * n * n,
                  tf.abs(w[5] - h) < 1e-9 * h, tf.abs(w[6] - h * h) < 1e-9 * h * h]
        return tf.logical_and(ok, tf.reduce_all(tf.stack(checks)))

    def _payloads_ok(self, ctx: _Exchange) -> tf.Tensor:
        """Every rank's payload has this rank's size and header (method, bits, bucket, numel, levels).

        Also fits ``ctx.gathered`` to exactly ``ranks * payload_size`` bytes (cut or zero-padded), so
        that no op fails on a wrong size before the explanation is raised: TF may run shape-bound ops
        of a ``tf.cond`` branch that is not taken."""
        ranks = _hvd().size()
        expected = ranks * payload_size(ctx.numel, self.bits, self.bucket_size)
        got = tf.size(ctx.gathered)
        fitted = tf.pad(ctx.gathered[:expected], [[0, tf.maximum(0, expected - got)]])
        fitted.set_shape([expected])
        rows = tf.reshape(fitted, [ranks, -1])[:, :HEADER_SIZE]
        ok = tf.logical_and(tf.equal(got, expected), tf.reduce_all(tf.equal(rows, ctx.header[None, :])))
        ctx.fitted = fitted
        return ok

    def _explain(self, head: np.ndarray, gathered: np.ndarray, header: np.ndarray, *, slot: int,
                 numel: int) -> None:
        """Raise the error that says what differs (called only when a check failed)."""
        head = np.asarray(head, dtype=np.float64)
        scale = head[0]
        n = _hvd().size()
        triple = np.array([head[0], head[3], head[4]])
        check_op(triple, n)
        if not op_ok(triple, n):
            raise ProtocolError(
                f"horovod_alq: the reduced control vector does not match a Sum or Average over all "
                f"{n} ranks ({triple.tolist()}): op=Adasum, hvd.join(), or an allreduce over a process "
                f"set (the TensorFlow compressors support the global process set only)")
        w = head / scale
        if abs(w[5] * w[5] - w[6]) > 1e-6 * w[6]:
            raise ProtocolError("horovod_alq: the ranks passed tensors of different shapes or dtypes to the "
                                "same allreduce; Horovod requires the same shape and dtype on every rank")
        if not (np.isfinite(head).all() and scale != 0 and abs(head[1] / scale - slot) < 1e-6
                and abs(head[2] / scale - slot * slot) < 1e-6 * max(1, slot * slot)):
            raise RuntimeError(
                f"horovod_alq: ranks exchanged different tensors in slot {slot} of this step (the ranks "
                f"compressed their tensors in different orders or different tensors); refusing to "
                f"decode. Reduced check vector: {head.tolist()}")
        self._explain_payloads(np.asarray(gathered), np.asarray(header), numel=numel)
        raise RuntimeError("horovod_alq: payload check failed")  # not reached

    def _explain_payloads(self, gathered: np.ndarray, header: np.ndarray, *, numel: int) -> None:
        """Raise ValueError naming the first rank whose payload differs from this rank's configuration."""
        hvd = _hvd()
        local = parse_header(header)
        offset, total = 0, gathered.size
        for rank in range(hvd.size()):
            if offset + HEADER_SIZE > total:
                raise ValueError(f"horovod_alq: payload of rank {rank} missing or truncated "
                                 f"({total} bytes gathered from {hvd.size()} ranks)")
            try:
                theirs = parse_header(gathered[offset: offset + HEADER_SIZE])
                check_header(theirs, local.method_id, local.bits, local.bucket_size, local.fingerprint, local.norm)
                if theirs.numel != numel:
                    raise ValueError(f"payload has {theirs.numel} elements, this rank's tensor has {numel}")
                if offset + theirs.payload_size > total:
                    raise ValueError(f"payload truncated: {total - offset} bytes, header says {theirs.payload_size}")
            except ValueError as err:
                raise ValueError(f"horovod_alq: payload from rank {rank} does not match this rank "
                                 f"(rank {hvd.rank()}): {err}") from None
            offset += theirs.payload_size
        if offset != total:
            raise ValueError(f"horovod_alq: {total - offset} unexpected bytes after {hvd.size()} payloads")


def _connect_gradient(source, out, scale):
    """``out`` with a gradient to ``source``: Horovod's own allreduce gradient (an exact sum of the
    incoming gradients, times the op's ``scale``), as for an uncompressed ``hvd.allreduce``. Without
    it a tape would see the quantized output as a constant and give zero gradients."""
    if source is None or not source.dtype.is_floating:
        return out

    @tf.custom_gradient
    def connected(x):
        def grad(dy):
            summed = _hvd().allreduce(dy, op=_hvd().Sum)
            return summed * tf.cast(scale, dy.dtype)

        return tf.identity(out), grad

    return connected(source)


ALQCompressor, AMQCompressor, QSGDCompressor, NUQSGDCompressor, TernGradCompressor = frontends.bind(
    QuantizedCompressor)


def compressor_for(method: str, **kwargs) -> QuantizedCompressor:
    """The compressor for a method name ("alq", "alq-n", "amq", "amq-n", "qsgdinf", "qsgd", "nuqsgd",
    "terngrad"), with the classes' keywords: ``compressor_for("alq-n", bits=3)`` is
    ``ALQCompressor(bits=3, normless=True)``. TernGrad ignores ``bits`` (always 2)."""
    return frontends.compressor_by_name(globals(), method, **kwargs)
