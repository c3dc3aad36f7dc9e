"""Horovod compressors for TensorFlow that put bit-packed codes on the wire.

Usage::

    import horovod.tensorflow as hvd
    from horovod_alq.tensorflow import ALQCompressor

    compression = ALQCompressor(bits=3, bucket_size=8192)
    tape = hvd.DistributedGradientTape(tape, compression=compression)   # or hvd.allreduce(..., compression=)

Same wire format as the PyTorch compressors (``docs/design.md``): ``compress`` encodes the gradient
into a uint8 payload (same bytes layout as the NumPy core) and hands Horovod's allreduce the core's
small float64 tensor vector (:func:`horovod_alq.core.protocol.tensor_vector`), followed by the
configuration sums (two-phase) and the statistics (refit rounds); it issues no collective.
``decompress`` checks the reduced vector with the core's checks (every rank sees the same one, so
every rank takes the same decision: raise, or exchange; a reducescatter, whose pieces are shorter
than the vector, and a rank in ``hvd.join()``, which adds zeros, fail them), and only then moves the
payloads, one tensor at a time: ``exchange="allgather"`` gathers every rank's payload, validates its
header against this rank's configuration, decodes, sums and scales; ``exchange="two-phase"`` runs the scatter-reduce /
re-quantize / allgather of :mod:`horovod_alq.exchange.two_phase` on the tensor's buckets. Horovod
errors before ``decompress`` (a dtype or shape mismatch, a rank that passes the tensor uncompressed)
therefore leave no payload collective behind on any rank. Everything is TF ops, so it works eagerly and inside ``tf.function``
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
point. ``metrics()["level_updates"]`` therefore counts a refit once the next round started, and
``metrics()["step"]`` counts completed rounds (a round completes in ``decompress``).
"""

from __future__ import annotations

import functools
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
from ..core.rounds import COUNTERS, RoundState, schedule_from
from ..core.statistics import GRID, statistics_length
from ..core import protocol
from ..core.wire import HEADER_SIZE, Header, pack_header, payload_size
from ..exchange import base, two_phase
from ..exchange.engine import check_exchange, choose_exchange
from . import kernels

COMPRESSIBLE = (tf.float16, tf.bfloat16, tf.float32, tf.float64)
#: Two-phase vectors add to the core's tensor vector the sums of ``c`` and ``c**2`` for the 32 bytes
#: of the tensor's first header and ``bits_second``: every rank checks the configurations agree
#: before any payload moves.
_CONFIG = HEADER_SIZE + 1
_CONFIG_FIELDS = {3: "method", 4: "bits", 5: "norm", **{i: "bucket_size" for i in range(8, 12)},
                  **{i: "levels" for i in range(24, 32)}, HEADER_SIZE: "bits_second"}


class ProtocolError(protocol.ProtocolError, tf.errors.FailedPreconditionError):
    """horovod_alq's protocol error in TensorFlow: a ``RuntimeError`` and, as Horovod's own errors
    there, a ``tf.errors.FailedPreconditionError`` (eagerly; inside ``tf.function`` TensorFlow
    reports any error raised in Python code as ``UnknownError``, with the same message)."""

    def __init__(self, message: str) -> None:
        tf.errors.FailedPreconditionError.__init__(self, None, None, message)
        self.args = (message,)


class ReductionMismatch(ProtocolError, protocol.ReductionMismatch):
    """:class:`horovod_alq.core.protocol.ReductionMismatch` in TensorFlow (see :class:`ProtocolError`)."""


def _hvd():
    """horovod.tensorflow, imported on first use so that the kernels work without Horovod."""
    import horovod.tensorflow as hvd

    return hvd


def _signed64(z: int) -> int:
    """A 64-bit value as TensorFlow's int64."""
    z &= protocol.MASK64
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
    payload: tf.Tensor  # this rank's payload (two-phase: its first-phase shards, end to end)
    collecting: Any  # bool tensor, or None for fixed methods
    levels: tf.Tensor
    header: tf.Tensor
    eager: bool
    exchange: str
    seed: tf.Tensor
    round: tf.Tensor  # index of this tensor's round
    source: Any = None  # the compressed tensor (autograd connects the output to it)
    shape_code: int = 0
    config: Any = None  # two-phase: this rank's configuration bytes, float64 (_CONFIG,)
    done: list = None  # eager: [decompressed?], read by the finalizer of an abandoned exchange


@dataclass
class _Outsider:
    """Context of a tensor compressed on a rank outside the compressor's process set."""

    message: str
    shape: tf.TensorShape
    dtype: tf.DType


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

    A ``tf.Module``: its state (levels, :class:`~horovod_alq.core.rounds.RoundState`'s counters,
    pending statistics, seed) lives in ``tf.Variable`` s, so ``tf.train.Checkpoint(compressor=c)``
    saves and restores it; restore into a compressor built with the same arguments.
    :meth:`metrics`, :meth:`state_dict` / :meth:`load_state_dict` read and write it through a
    ``RoundState`` (the PyTorch compressors' layout, validated on load).

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
    exchange : {"auto", "allgather", "two-phase"}
        How each tensor's codes travel: ``allgather`` (every rank gathers every rank's payload),
        ``two-phase`` (the tensor's buckets cut into N shards: alltoall, each owner sums its shard
        and re-quantizes it once, allgather; about ``2(N-1)/N (b + 32/d)`` bits per coordinate,
        a second quantization's noise), ``auto`` (default): two-phase from 4 ranks on.
    bits_second : int, optional
        Bits of the two-phase second quantization; default ``bits``, whose levels then follow the
        first quantization's (every refit). Other widths only for the fixed methods (their fixed
        levels): the second quantization does not adapt in TensorFlow, and adaptive levels left at
        their initial fit give 12 to 16x the variance (docs/variance_two_phase.md), so ALQ and AMQ
        refuse them (the PyTorch compressors adapt them).
    process_set : horovod.tensorflow.ProcessSet, optional
        The process set of the allreduces this compressor serves (default: global). Pass the same
        one to ``hvd.DistributedGradientTape(process_set=...)`` / ``hvd.allreduce(process_set=...)``.
        Payloads, scaling and statistics stay within the set; each set's compressor fits its own
        levels. An allreduce over another set raises on every rank that took part.
    """

    method: str = ""
    # Python-side configuration: not part of tf.Module's variable search.
    _TF_MODULE_IGNORED_PROPERTIES = frozenset(tf.Module._TF_MODULE_IGNORED_PROPERTIES | {
        "_fns", "_quantizer", "_state", "_method", "_second", "_process_set", "_set_cache", "_claimed_uid"})

    def __init__(self, method: str | None = None, bits: int = 3, bucket_size: int = 8192, *,
                 update_steps: Sequence[int] | None = None, update_every: int | None = None,
                 min_size: int = 1024, seed: int | None = None, jit_compile: bool = True,
                 norm: str | None = None, exchange: str = "auto", bits_second: int | None = None,
                 process_set=None) -> None:
        super().__init__(name=type(self).__name__)
        method = method or self.method
        self._method = get_method(method)
        self._quantizer = Quantizer(self._method.name, bits=bits, bucket_size=bucket_size, norm=norm)
        self._exchange = check_exchange(exchange)
        self._second = Quantizer(self._method.name, bits=self._quantizer.bits if bits_second is None else bits_second,
                                 bucket_size=bucket_size, norm=self._quantizer.norm)
        if self._method.adaptive and self._second.bits != self._quantizer.bits:
            raise ValueError(f"bits_second={self._second.bits} with bits={self._quantizer.bits}: the TensorFlow "
                             f"compressors cannot adapt a second quantization of other bits for {self._method.name} "
                             f"(its initial levels give 12-16x the variance); use bits_second=bits, or the "
                             f"PyTorch compressors")
        self._process_set = process_set
        self._set_cache = None
        # The schema of metrics() and state_dict(); the variables below hold its values.
        self._state = RoundState(self._quantizer, schedule_from(update_steps, update_every), second=self._second,
                                 adapt_second=False)
        self.min_size = frontends.check_min_size(min_size)
        self.jit_compile = bool(jit_compile)
        seed = int.from_bytes(os.urandom(8), "little") if seed is None else int(seed) & protocol.MASK64
        self._claimed_uid = None  # the name part of its collectives, claimed at first use (_names)
        self._stats_len = statistics_length(self._method)
        self._outstanding = 0  # eager exchanges begun and not yet decompressed
        self._slot = 0
        q = self._quantizer
        with tf.init_scope():
            self._levels = tf.Variable(q.levels, dtype=tf.float64, trainable=False, name="levels")
            self._header_mask = tf.Variable(header_mask(q.fingerprint), dtype=tf.int32, trainable=False,
                                            name="header_mask")
            self._seed = tf.Variable(_signed64(seed), dtype=tf.int64, trainable=False, name="seed")
            # RoundState's counters, one variable each ("step": completed rounds), so that compress,
            # decompress and the refit write different variables (tf.function orders ops by variable)
            self._counters = {key: tf.Variable(0, dtype=tf.int64, trainable=False, name=key) for key in COUNTERS}
            self._current = tf.Variable(0, dtype=tf.int64, trainable=False, name="current_round")
            self._pending = tf.Variable(np.zeros(self._stats_len), dtype=tf.float64, trainable=False,
                                        name="pending_statistics")
            self._pending_count = tf.Variable(0, dtype=tf.int64, trainable=False, name="pending_count")
        # The codec's tf.functions (shared by compressors with the same configuration; one trace and
        # XLA compile per tensor shape) and per-traced-graph call-site counters, in a plain namespace
        # so that tf.Module / tf.train.Checkpoint do not track them.
        codec = _codec(q.bits, q.bucket_size, q.norm, self.jit_compile)
        self._fns = types.SimpleNamespace(sites=weakref.WeakKeyDictionary(), codec=codec, encode=codec.encode,
                                          stats=codec.normless if self._stats_len == 4 else codec.grid,
                                          second=_codec(self._second.bits, q.bucket_size, q.norm, self.jit_compile))

    # ------------------------------------------------------------------ configuration
    @property
    def levels(self) -> np.ndarray:
        """Current levels, shape (L,), float64 (read eagerly)."""
        return self._levels.numpy()

    @property
    def exchange(self) -> str:
        """The exchange in use: ``exchange=`` with "auto" resolved for the process set's size."""
        return choose_exchange(self._exchange, self._set_size())

    @property
    def process_set(self):
        """The Horovod process set this compressor serves."""
        return self._process_set if self._process_set is not None else _hvd().global_process_set

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(method={self._method.name!r}, bits={self.bits}, "
                f"bucket_size={self.bucket_size}, min_size={self.min_size}, exchange={self._exchange!r})")

    # ------------------------------------------------------------------ Horovod interface
    def _names(self) -> str:
        """The name part of this compressor's collectives: after the process set and the order in
        which this process first compresses (any tensor) with compressors of that set
        (:func:`horovod_alq.core.protocol.first_use_uid`): ranks that created different numbers of
        compressors still pair their collectives."""
        if self._claimed_uid is None:
            self._claimed_uid = protocol.process_set_uid(self.process_set)
        return self._claimed_uid

    @_ClassOrInstance
    def compress(self, tensor):
        """Encode ``tensor`` and return the small vector to allreduce (no collective here)."""
        self._names()  # claimed at the first compress of any tensor (every rank of the allreduce calls it)
        tensor = tf.convert_to_tensor(tensor)
        numel = tensor.shape.num_elements()
        if tensor.dtype not in COMPRESSIBLE or numel is None or numel < max(self.min_size, 1):
            self._count(uncompressed_coordinates=tf.size(tensor))
            if tensor.dtype == tf.bfloat16:  # Horovod's TF allreduce has no bfloat16
                return tf.cast(tensor, tf.float32), _PassThrough(tensor.dtype)
            return tensor, _PassThrough(tensor.dtype)
        if not self._is_member():
            # Raising here would leave the members waiting in this allreduce: take part with the
            # core's outsider vector, which fails their checks, and raise in decompress.
            n = self._set_size()
            head = np.zeros(self._head_len(self.exchange))
            head[:protocol.tensor_vector_length(n)] = protocol.outsider_vector(n)
            return tf.constant(head, tf.float64), _Outsider(self._outsider_message(), tensor.shape, tensor.dtype)
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
        exchange = self.exchange
        n, me = self._set_size(), self._set_rank()
        parts = self._parts(numel, exchange, n)
        sent, received = self._wire_bytes(parts, exchange, me)
        counters = self._count(calls=1, payload_bytes=sum(payload_size(b - a, self.bits, self.bucket_size)
                                                           for a, b in parts),
                               coordinates=numel, bytes_sent=sent, bytes_received=received)
        calls = counters["calls"] - 1
        current = self._current.read_value()
        collecting = self._collecting(current) if self._method.adaptive else None
        levels = self._levels.read_value()
        header = self._header(numel)
        seed = tf.stack([tf.bitwise.bitwise_xor(self._seed.read_value(), self._rank_key()), calls])
        h = protocol.shape_hash(tuple(tensor.shape.as_list()), tensor.dtype.name)
        head = tf.constant(protocol.tensor_vector(me, n, slot, h, failed=False), tf.float64)
        config = None
        if exchange == "allgather":
            payload = self._fns.encode(tensor, levels, header, seed)
        else:
            flat = tf.reshape(tensor, [-1])
            payload = tf.concat([self._encode_part(self._fns.encode, flat[a:b], levels, self._header(b - a),
                                                   _part_seed(seed, j, 1)) for j, (a, b) in enumerate(parts)], 0)
            config = tf.concat([tf.cast(header, tf.float64), tf.constant([float(self._second.bits)], tf.float64)], 0)
            head = tf.concat([head, config, config * config], 0)
        if collecting is None:
            small = head
        else:
            small = tf.cond(collecting, lambda: tf.concat([head, self._statistics(tensor)], 0), lambda: head)
        ctx = _Exchange(slot, tensor.shape, tensor.dtype, numel, payload, collecting, levels, header, eager,
                        exchange, seed, current, source=tensor, shape_code=h, config=config)
        if eager:
            # Horovod drops ctx without decompress when its allreduce raised (a dtype mismatch): the
            # exchange is then over on this rank, as on the others, which never began it.
            ctx.done = [False]
            weakref.finalize(ctx, self._abandon, ctx.done)
        return small, ctx

    @_ClassOrInstance
    def decompress(self, tensor, ctx):
        """Check the reduced vector, exchange the payloads, and return the reduced gradient in
        the original shape and dtype."""
        if ctx is None:
            return tensor
        if isinstance(ctx, _PassThrough):
            return tf.cast(tensor, ctx.dtype) if tensor.dtype != ctx.dtype else tensor
        if isinstance(ctx, _Outsider):
            return self._refuse(tensor, ctx)
        try:
            reduced = tf.reshape(tf.cast(tensor, tf.float64), [-1])
            expected = tf.constant(self._head_len(ctx.exchange))  # the length compress made
            if ctx.collecting is not None:
                expected = tf.where(ctx.collecting, expected + self._stats_len, expected)
            run = self._allgather if ctx.exchange == "allgather" else self._two_phase
            out = _guarded(None, functools.partial(run, ctx, reduced), functools.partial(self._check_vector, ctx),
                           [reduced, expected], ctx.numel, ctx.eager)
        finally:
            if ctx.eager:
                ctx.done[0] = True
                self._outstanding -= 1
        out = tf.reshape(tf.cast(out, ctx.dtype), ctx.shape)
        return _connect_gradient(ctx.source, out, reduced[0] / self._set_size(), self.process_set)

    def _allgather(self, ctx: _Exchange, reduced: tf.Tensor) -> tf.Tensor:
        """Gather every rank's payload, check every header, decode and sum (flat float32)."""
        gathered = _hvd().allgather(ctx.payload, name=f"horovod_alq.{self._names()}.{ctx.slot}", ignore_name_scope=True,
                                    process_set=self.process_set)
        ok, fitted = self._payloads_ok(ctx, gathered)

        def decode():
            return self._kept(ctx, reduced, self._decode_fn(ctx.numel)(fitted, ctx.levels, self._scale(reduced)))

        explain = functools.partial(self._explain_payloads, ctx)
        return _guarded(ok, decode, explain, [gathered, ctx.levels], ctx.numel, ctx.eager)

    def _two_phase(self, ctx: _Exchange, reduced: tf.Tensor) -> tf.Tensor:
        """:mod:`horovod_alq.exchange.two_phase` on one tensor: shard ``j`` of every rank's codes goes
        to rank ``j``, which sums them and re-quantizes the sum once; every rank decodes all the
        re-quantized shards (flat float32, identical on every rank). The configurations were
        compared through the reduced vector, so the payloads are not checked again."""
        hvd, ps = _hvd(), self.process_set
        n, me, d = self._set_size(), self._set_rank(), self.bucket_size
        parts = self._parts(ctx.numel, "two-phase", n)
        splits = [payload_size(b - a, self.bits, d) for a, b in parts]
        name = f"horovod_alq.{self._names()}.{ctx.slot}"
        received, rsplits = hvd.alltoall(ctx.payload, splits=splits, name=name + ".a2a", ignore_name_scope=True,
                                         process_set=ps)
        received = tf.reshape(received, [n * splits[me]])
        a, b = parts[me]
        one = tf.constant(1.0, tf.float32)
        acc = self._fns.codec.decoder(b - a, n)(received, ctx.levels, one) if b > a else tf.zeros([0], tf.float32)
        levels2 = ctx.levels if self._follows() else tf.constant(self._second.levels, tf.float64)
        payload2 = self._encode_part(self._fns.second.encode, acc, levels2, self._header(b - a, second=True),
                                     _part_seed(ctx.seed, me, 2))
        # An empty shard's payload reads nothing received, and a graph prunes the ops nothing reads
        # (control dependencies included): add a zero that reads the alltoall's splits.
        payload2 += tf.cast(tf.minimum(tf.reduce_min(rsplits), 0), tf.uint8)
        sizes = [payload_size(pb - pa, self._second.bits, d) for pa, pb in parts]
        gathered = tf.reshape(hvd.allgather(payload2, name=name + ".ag2", ignore_name_scope=True, process_set=ps),
                              [sum(sizes)])
        scale = self._scale(reduced)
        offsets = np.cumsum([0, *sizes]).tolist()
        pieces = [self._fns.second.decoder(pb - pa, 1)(gathered[offsets[j]:offsets[j + 1]], levels2, scale)
                  for j, (pa, pb) in enumerate(parts) if pb > pa]
        return self._kept(ctx, reduced, tf.concat(pieces, 0))

    def _kept(self, ctx: _Exchange, reduced: tf.Tensor, out: tf.Tensor) -> tf.Tensor:
        """``out``, once its round counts as completed and the round's reduced statistics were added
        to the pending ones (refit rounds)."""
        with tf.control_dependencies([self._counters["step"].assign(ctx.round + 1)]):
            out = tf.identity(out)
        if ctx.collecting is None:
            return out

        def keep():
            stats = reduced[self._head_len(ctx.exchange):] / reduced[0]
            with tf.control_dependencies([self._pending.assign_add(stats), self._pending_count.assign_add(1)]):
                return tf.constant(True)

        kept = tf.cond(ctx.collecting, keep, lambda: tf.constant(False))
        with tf.control_dependencies([kept]):
            return tf.identity(out)

    def _refuse(self, tensor: tf.Tensor, ctx: _Outsider) -> tf.Tensor:
        """Raise ``ctx.message`` once the allreduce is over (in a graph: when it has run)."""
        if tf.executing_eagerly():
            raise ProtocolError(ctx.message)

        def raise_(_):
            raise ProtocolError(ctx.message)

        bad = tf.numpy_function(raise_, [tensor], ctx.dtype, stateful=True, name="horovod_alq_not_member")
        return tf.reshape(bad, ctx.shape)

    # ------------------------------------------------------------------ metrics and state
    @_ClassOrInstance
    def metrics(self) -> dict:
        """:meth:`horovod_alq.core.rounds.RoundState.metrics` (the PyTorch compressors' metrics):
        ``levels``, ``multiplier``, ``second_levels`` (two-phase), ``exchange``, the counters
        (``step``: rounds completed) and ``bits_per_coordinate``. Read eagerly, between steps."""
        st = self._read_state()
        st.exchange = self.exchange
        return st.metrics()

    def state_dict(self) -> dict:
        """:meth:`RoundState.state_dict` with the seed and the pending statistics, as Python values: a
        compressor that loads it continues with identical levels and identical random draws."""
        if self._outstanding:
            raise RuntimeError("state_dict() during an exchange: call it between steps")
        return {"seed": int(self._seed.numpy()) & protocol.MASK64, **self._read_state().state_dict(),
                "pending_statistics": self._pending.numpy(), "pending_count": int(self._pending_count.numpy())}

    def load_state_dict(self, state: dict) -> None:
        """Restore a :meth:`state_dict` (also one of a PyTorch compressor with the same method, bits
        and bucket size: its levels, seed and counters)."""
        if self._outstanding:
            raise RuntimeError("load_state_dict() during an exchange: call it between steps")
        pending = np.asarray(state.get("pending_statistics", np.zeros(self._stats_len)), dtype=np.float64)
        if pending.shape != (self._stats_len,):
            raise ValueError(f"pending_statistics has shape {pending.shape}, expected ({self._stats_len},)")
        st = self._read_state()
        st.load_state_dict(state)  # validates method, norm, bits, bucket size and levels
        st.refitted_first()
        self._levels.assign(st.quantizer.levels)
        self._header_mask.assign(header_mask(st.quantizer.fingerprint))
        for key, var in self._counters.items():
            var.assign(getattr(st, key))
        self._seed.assign(_signed64(int(state["seed"])))
        self._pending.assign(pending)
        self._pending_count.assign(int(state.get("pending_count", 0)))

    # ------------------------------------------------------------------ internals
    def _read_state(self) -> RoundState:
        """The :class:`RoundState` with the variables' levels and counters."""
        st = self._state
        st.quantizer.set_levels(self._levels.numpy())
        st.refitted_first()
        for key, var in self._counters.items():
            setattr(st, key, int(var.numpy()))
        return st

    def _count(self, **values) -> dict:
        """Add ``values`` (ints or tensors) to the named counters; returns their values after it."""
        return {key: self._counters[key].assign_add(tf.cast(value, tf.int64)) for key, value in values.items()}

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

    def _abandon(self, done: list) -> None:
        """Finalizer of an eager exchange: Horovod dropped it without decompress (it raised first)."""
        if not done[0]:
            done[0] = True
            self._outstanding = max(0, self._outstanding - 1)

    def _rank_key(self) -> int:
        return _signed64(protocol.splitmix64(_hvd().rank() + 1))

    # ---- process set
    def _set_info(self) -> tuple[int, int]:
        """(size, rank in the set), read from Horovod once (a set's membership does not change)."""
        if self._set_cache is None:
            size = self.process_set.size()
            if size is None:
                raise ValueError(f"horovod_alq: the compressor's process set {self.process_set} is not "
                                 f"registered with Horovod (hvd.init(process_sets=...) or hvd.add_process_set)")
            self._set_cache = (int(size), int(self.process_set.rank()) if self._is_member() else -1)
        return self._set_cache

    def _set_size(self) -> int:
        return self._set_info()[0]

    def _set_rank(self) -> int:
        return self._set_info()[1]

    def _is_member(self) -> bool:
        ranks = self.process_set.ranks
        return not ranks or _hvd().rank() in ranks

    def _outsider_message(self) -> str:
        return (f"horovod_alq: rank {_hvd().rank()} is not in the compressor's process set (ranks "
                f"{self.process_set.ranks}): pass this compressor only to allreduces over that set "
                f"(hvd.allreduce(..., process_set=ps), hvd.DistributedGradientTape(..., process_set=ps))")

    # ---- layout of one tensor's exchange
    def _head_len(self, exchange: str) -> int:
        """Length of the vector compress hands the allreduce, statistics aside: the core's tensor
        vector, and the configuration sums (two-phase)."""
        return protocol.tensor_vector_length(self._set_size()) + (2 * _CONFIG if exchange == "two-phase" else 0)

    def _parts(self, numel: int, exchange: str, n: int) -> list[tuple[int, int]]:
        """The element ranges encoded as separate payloads: the whole tensor, or its N shards."""
        if exchange == "allgather":
            return [(0, numel)]
        return two_phase.shards(0, numel, n, self.bucket_size)

    def _wire_bytes(self, parts: list[tuple[int, int]], exchange: str, me: int) -> tuple[int, int]:
        """(sent, received) payload bytes of one tensor's exchange on this rank, counted as the
        engine counts its requests (:func:`horovod_alq.exchange.base.allgather_bytes`)."""
        n, d = self._set_size(), self.bucket_size
        first = [payload_size(b - a, self.bits, d) for a, b in parts]
        if exchange == "allgather":
            return base.allgather_bytes(first * n, me)
        second = [payload_size(b - a, self._second.bits, d) for a, b in parts]
        phases = base.alltoall_bytes(first, [first[me]] * n, me), base.allgather_bytes(second, me)
        return sum(p[0] for p in phases), sum(p[1] for p in phases)

    @staticmethod
    def _encode_part(encode, x: tf.Tensor, levels, header: tf.Tensor, seed: tf.Tensor) -> tf.Tensor:
        """One payload; an empty shard's is its header alone."""
        if x.shape.num_elements() == 0:
            return header
        return encode(x, levels, header, seed)

    def _follows(self) -> bool:
        """Whether the second quantization uses the first's levels (same bits)."""
        return self._state.follows_first

    def _scale(self, reduced: tf.Tensor) -> tf.Tensor:
        """Sum of 1 over the ranks (N for Sum, 1 for Average) over N: the factor on the decoded sum."""
        return tf.cast(reduced[0] / self._set_size(), tf.float32)

    def _header(self, numel: int, second: bool = False) -> tf.Tensor:
        """Header of a payload of ``numel`` elements (the second quantization's with ``second``)."""
        q = self._second if second else self._quantizer
        static = np.frombuffer(pack_header(Header(self._method.id, q.bits, q.bucket_size, numel,
                                                  q.fingerprint if second and not self._follows() else 0,
                                                  norm=q.norm)), np.uint8).astype(np.int32)
        if second and not self._follows():
            return tf.constant(static.astype(np.uint8))
        return tf.cast(tf.bitwise.bitwise_xor(tf.constant(static), self._header_mask.read_value()), tf.uint8)

    def _collecting(self, current: tf.Tensor) -> tf.Tensor:
        """Whether round ``current`` gathers statistics for a refit (the core's refit schedule)."""
        collects = tf.numpy_function(lambda step: np.bool_(self._state.schedule.collects(int(step))), [current],
                                     tf.bool, stateful=False, name="horovod_alq_collects")
        collects.set_shape([])
        return collects

    def _begin_round(self) -> None:
        """Refit from the previous round's statistics (if it collected any); the round's index is the
        number of completed rounds. A round completes in decompress, so a round that failed before it
        on every rank (Horovod's own errors) or on some (a rank that passed the tensor uncompressed)
        is begun again by the next call, on every rank alike. Refitting is idempotent: a rank that
        refit in the failed round and one that refits in the next fit the same statistics."""
        if self._method.adaptive:
            def refit():
                levels, mask, updated = tf.numpy_function(
                    self._refit_numpy, [self._levels.read_value(), self._pending.read_value()],
                    [tf.float64, tf.int32, tf.int64], stateful=True, name="horovod_alq_refit")
                levels.set_shape(self._levels.shape)
                mask.set_shape([HEADER_SIZE])
                return tf.group(self._levels.assign(levels), self._header_mask.assign(mask),
                                self._counters["level_updates"].assign_add(tf.reshape(updated, [])),
                                self._pending.assign(tf.zeros_like(self._pending)),
                                self._pending_count.assign(0))

            def refit_flag():
                with tf.control_dependencies([refit()]):
                    return tf.constant(True)

            tf.cond(self._pending_count > 0, refit_flag, lambda: tf.constant(False))
        self._current.assign(self._counters["step"])

    def _refit_numpy(self, levels: np.ndarray, stats: np.ndarray):
        """The NumPy core's fit of the state's quantizer (deterministic: identical inputs give
        identical levels on every rank)."""
        q = self._state.quantizer
        q.set_levels(levels)
        updated = bool(np.isfinite(stats).all() and stats[0] > 0)  # else no finite non-zero bucket seen
        if updated:
            q.adapt(stats)
        return q.levels, header_mask(q.fingerprint), np.int64(updated)

    def _statistics(self, tensor: tf.Tensor) -> tf.Tensor:
        """This rank's statistics vector of ``tensor`` (TF ops; only in refit rounds)."""
        return self._fns.stats(tensor)

    def _decode_fn(self, numel: int):
        return self._fns.codec.decoder(numel, self._set_size())

    # ---- checks, on the host (NumPy); every rank checks the same reduced data, so all pass or all raise
    def _check_vector(self, ctx: _Exchange, reduced: np.ndarray, expected) -> None:
        """The core's checks of the reduced vector (:func:`horovod_alq.core.protocol.read_tensor_vector`:
        its length against the ``expected`` one compress made, the op and scale, the process set,
        shapes and dtypes, slots), then the two TensorFlow ones: every rank gave the tensor the same
        slot (the payloads' collectives are named after it) and, two-phase, the same configuration
        bytes ``c`` (``(mean c)**2 == mean c**2``). Raises when one fails."""
        n = self._set_size()
        size = protocol.tensor_vector_length(n)
        try:
            read = protocol.read_tensor_vector(reduced, rank=self._set_rank(), size=n, slot=ctx.slot,
                                               shape_code=ctx.shape_code, extra=int(expected) - size)
        except protocol.ProtocolError as err:
            raise _tf_error(err) from None
        if len(set(read.slots)) > 1:
            raise ProtocolError(
                f"horovod_alq: the ranks exchanged different tensors in one allreduce (their slots in this step, "
                f"in rank order: {list(read.slots)}): the ranks compressed their tensors in different orders "
                f"or different tensors; refusing to decode")
        if ctx.config is not None:
            w = reduced[size: size + 2 * _CONFIG] / reduced[0]
            c, c2 = w[:_CONFIG], w[_CONFIG:]
            differ = sorted({_CONFIG_FIELDS.get(i, "header")
                             for i in np.flatnonzero(np.abs(c * c - c2) > 1e-9 * np.maximum(1.0, c2))})
            if differ:
                raise ProtocolError(
                    f"horovod_alq: the ranks' compressors differ in {', '.join(differ)} (two-phase exchange; "
                    f"compared before any payload moved). Every rank must build the compressor with the same "
                    f"arguments and load the same state")

    def _payloads_ok(self, ctx: _Exchange, gathered: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        """The in-graph form of :func:`horovod_alq.exchange.base.check_payloads` (which
        :meth:`_explain_payloads` runs when it fails): every rank's payload has this rank's size and
        header bytes. Also ``gathered`` fitted to exactly ``ranks * payload_size`` bytes (cut or
        zero-padded), so that no op fails on a wrong size before the explanation is raised: TF may
        run shape-bound ops of a ``tf.cond`` branch that is not taken."""
        ranks = self._set_size()
        expected = ranks * payload_size(ctx.numel, self.bits, self.bucket_size)
        got = tf.size(gathered)
        fitted = tf.pad(gathered[:expected], [[0, tf.maximum(0, expected - got)]])
        fitted.set_shape([expected])
        rows = tf.reshape(fitted, [ranks, -1])[:, :HEADER_SIZE]
        ok = tf.logical_and(tf.equal(got, expected), tf.reduce_all(tf.equal(rows, ctx.header[None, :])))
        return ok, fitted

    def _explain_payloads(self, ctx: _Exchange, gathered: np.ndarray, levels: np.ndarray) -> None:
        """Raise :func:`horovod_alq.exchange.base.check_payloads`'s error, naming the first rank whose
        payload differs from this rank's configuration (called when :meth:`_payloads_ok` failed)."""
        q = Quantizer(self._method.name, bits=self.bits, bucket_size=self.bucket_size, norm=self.norm)
        q.set_levels(levels)
        try:
            base.check_host_payloads(gathered, [ctx.numel] * self._set_size(), q, f"tensor in slot {ctx.slot}")
        except protocol.ProtocolError as err:
            raise _tf_error(err) from None
        raise ProtocolError(f"horovod_alq: tensor in slot {ctx.slot}: the gathered payload headers differ")


def _tf_error(err: protocol.ProtocolError) -> ProtocolError:
    """The core's error as this module's class of the same name (a FailedPreconditionError too)."""
    return (ReductionMismatch if isinstance(err, protocol.ReductionMismatch) else ProtocolError)(str(err))


def _part_seed(seed: tf.Tensor, part: int, phase: int) -> tf.Tensor:
    """The ``[key, counter]`` seed of one shard's encoding in one phase of the two-phase exchange."""
    key = _signed64(protocol.splitmix64((1 << 63) | (int(part) << 2) | int(phase)))  # not a rank key's input
    return tf.stack([tf.bitwise.bitwise_xor(seed[0], tf.constant(key, tf.int64)), seed[1]])


def _guarded(ok, run, check, args, numel: int, eager: bool):
    """``run()`` if the data pass, else ``check(*args)`` raises on this rank. ``check`` runs on the
    host (NumPy), returns when the data pass and raises the error that says why they do not;
    ``ok``, when given, is an in-graph test equivalent to it, so that ``check`` runs only on failure.

    Every rank checks the same reduced data, so all run or all raise. Eagerly the checks run in
    Python; in a graph ``run`` is the taken branch of a ``tf.cond`` on the check (and depends on
    it), so none of its ops, collectives included, runs after a failed check (a control dependency
    alone is not enough: TF may run an inlined function's ops before it)."""
    if eager:
        if ok is None or not bool(ok.numpy()):
            check(*(a.numpy() for a in args))
        return run()

    def host(*values):
        check(*values)
        return np.bool_(True)

    if ok is None:
        ok = tf.numpy_function(host, list(args), tf.bool, stateful=True, name="horovod_alq_check")
        ok.set_shape([])

    def taken():
        with tf.control_dependencies([ok]):
            return run()

    def fail():  # check raises
        bad = tf.numpy_function(host, list(args), tf.bool, stateful=True, name="horovod_alq_check")
        with tf.control_dependencies([bad]):
            return tf.zeros([numel], tf.float32)

    return tf.cond(ok, taken, fail)


def _connect_gradient(source, out, scale, process_set):
    """``out`` with a gradient to ``source``: Horovod's own allreduce gradient (an exact sum of the
    incoming gradients over the process set, times the op's ``scale``), as for an uncompressed
    ``hvd.allreduce``. Without it a tape would see the quantized output as a constant and give zero
    gradients."""
    if source is None or not source.dtype.is_floating:
        return out

    @tf.custom_gradient
    def connected(x):
        def grad(dy):
            summed = _hvd().allreduce(dy, op=_hvd().Sum, process_set=process_set)
            return summed * tf.cast(scale, dy.dtype)

        return tf.identity(out), grad

    return connected(source)


class ALQCompressor(frontends.ALQ, QuantizedCompressor):
    """ALQ for Horovod TensorFlow: levels fitted by coordinate descent to the gradients'
    statistics (``normless=True``: ALQ-N).

    ``ALQCompressor(bits=3, bucket_size=8192, normless=False, norm=None, **keywords)``; ``norm="linf"``
    (max-abs buckets, the default) or ``"l2"`` (the paper's form); the other keywords are those of
    :class:`QuantizedCompressor`."""


class AMQCompressor(frontends.AMQ, QuantizedCompressor):
    """AMQ for Horovod TensorFlow: levels ``+-{p**s, ..., p, 1}`` with the multiplier ``p`` adapted
    (``normless=True``: AMQ-N). Keywords as :class:`ALQCompressor`."""


class QSGDCompressor(frontends.QSGD, QuantizedCompressor):
    """QSGD for Horovod TensorFlow, uniform levels: ``norm="linf"`` (default) is QSGDinf, ``norm="l2"``
    the original QSGD. Other keywords: those of :class:`QuantizedCompressor`."""


class NUQSGDCompressor(frontends.NUQSGD, QuantizedCompressor):
    """NUQSGD for Horovod TensorFlow: fixed exponential levels ``+-{2**-s, ..., 1/2, 1}``, L2 buckets."""


class TernGradCompressor(frontends.TernGrad, QuantizedCompressor):
    """TernGrad for Horovod TensorFlow: levels {-1, 0, 1} times the bucket's max-abs, 2 bits per
    coordinate (``bits`` other than 2 is refused)."""


def compressor_for(method: str, **kwargs) -> QuantizedCompressor:
    """The compressor for a method name ("alq", "alq-n", "amq", "amq-n", "qsgdinf", "qsgd", "nuqsgd",
    "terngrad"), with the classes' keywords: ``compressor_for("alq-n", bits=3)`` is
    ``ALQCompressor(bits=3, normless=True)``. TernGrad ignores ``bits`` (always 2)."""
    return frontends.compressor_by_name(globals(), method, **kwargs)
