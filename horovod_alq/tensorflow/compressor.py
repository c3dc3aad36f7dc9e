"""Horovod compressors for TensorFlow that put bit-packed codes on the wire.

Usage::

    import horovod.tensorflow as hvd
    from horovod_alq.tensorflow import ALQCompressor

    compression = ALQCompressor(bits=3, bucket_size=8192)
    tape = hvd.DistributedGradientTape(tape, compression=compression)   # or hvd.allreduce(..., compression=)

Same wire format and protocol as the PyTorch compressors (docs/design/design.md, "TensorFlow"):
``compress`` encodes the gradient and hands Horovod's allreduce the core's tensor vector (two-phase:
with the configuration sums; refit rounds: with the statistics); it issues no collective.
``decompress`` checks the reduced vector (:mod:`.checks`; every rank sees the same one, so every
rank raises or every rank exchanges), and only then runs the tensor's exchange in the graph, as
planned by the exchange's ``plan`` (:mod:`horovod_alq.exchange.plan`). Everything is TF ops, so it
works eagerly and inside ``tf.function``; the state lives in ``tf.Variable`` s (:mod:`.state`).

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
import types
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np
import tensorflow as tf

from .. import compressor_mixins as mixins
from ..core import protocol
from ..core.methods import get_method
from ..exchange.registry import choose_exchange, get
from ..settings import Settings, configure
from . import auto, graph, joined, traced
from .exchanges import Exchange, GraphExchanges, own_statistics
from .membership import SetMembership
from .state import RoundVariables

COMPRESSIBLE = (tf.float16, tf.bfloat16, tf.float32, tf.float64)


def _encoded(exchange: str, plan, rank: int, g: int) -> int:
    """The payload bytes this rank encodes of one tensor (``metrics()["payload_bytes"]``): its
    shards of the whole tensor, or (node-aware) of its node's sum of its own shard."""
    if not get(exchange).node_aware:
        return sum(plan.first)
    per = len(plan.parts) // g  # sub-shards per shard
    return sum(plan.first[(rank % g) * per : (rank % g + 1) * per])


def graph_method(exchange: str) -> str:
    """The compressor's method that runs ``exchange`` in the graph (one of
    :func:`horovod_alq.exchange.registry.graph_names`; an exchange without ``graph`` is refused)."""
    return "_" + exchange.replace("-", "_")


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
    shape: tf.TensorShape
    restore: Any = None  # graph.passthrough's: how to give the reduced tensor its shape back


class QuantizedCompressor(
    SetMembership, GraphExchanges, mixins.PerProcessSet, mixins.CompressorBase, tf.Module, metaclass=mixins.DefaultBound
):
    """Base class: a Horovod ``compression=`` object for one quantization method (TensorFlow).

    A ``tf.Module``: its state (levels, :class:`~horovod_alq.core.rounds.RoundState`'s counters,
    pending statistics, seed) lives in ``tf.Variable`` s, so ``tf.train.Checkpoint(compressor=c)``
    saves and restores it; restore into a compressor built with the same arguments.
    :meth:`metrics`, :meth:`state_dict` / :meth:`load_state_dict` read and write it through a
    ``RoundState`` (the PyTorch compressors' layout, validated on load).

    Parameters
    ----------
    method, bits, bucket_size, **keywords
        The shared settings, :class:`horovod_alq.settings.Settings` (its fields as keywords; None:
        the default). Here ``bits="auto"`` gives a tensor the allocation's width for its slot in
        the step when that slot holds a tensor of its size and shape, else the widest width within
        the budget; ``min_size`` also sends uncompressed a tensor whose size is not known when
        traced; ``seed`` is combined with the rank and a call counter (the draws differ on every
        call, also inside ``tf.function``); ``exchange="two-phase"`` cuts each tensor's buckets into
        N shards; ``bits_second`` and ``adapt_second`` as in PyTorch (the second quantizer's levels
        refit from the owners' reduced shards in the round after each refit of the first, with one
        more allreduce of their statistics in that round). A setting TensorFlow does not
        serve raises ValueError naming why (:data:`horovod_alq.settings.NOT_SERVED`; the table in
        docs/guides/settings.md).
    settings : horovod_alq.settings.Settings, optional
        Settings to start from; the keywords given override them. A subclass's method overrides theirs.
    jit_compile : bool
        Compile the encoder (all but the random draws) and the decoder with XLA, once per tensor
        shape: several times faster on CPU, at a compile of about a second per shape. Default True;
        False runs the same TF ops op by op.
    process_set : horovod.tensorflow.ProcessSet, optional
        Pin the compressor to one process set: an allreduce over another set raises on every rank
        that took part. Default (None): the compressor serves every process set it is used with,
        as Horovod's own compressions do, with a compressor of its own per set (made at first use,
        with these arguments): payloads, scaling, statistics and levels stay within each set;
        ``metrics()["process_sets"]`` and ``state_dict()`` hold the other sets' by ranks.
    """

    method: str = ""
    HOROVOD = "horovod.tensorflow"
    # Python-side configuration: not part of tf.Module's variable search.
    _TF_MODULE_IGNORED_PROPERTIES = frozenset(
        tf.Module._TF_MODULE_IGNORED_PROPERTIES
        | {
            "_fns",
            "_quantizer",
            "_method",
            "_second",
            "_process_set",
            "_set_cache",
            "_claimed_uid",
            "settings",
            "_per_set_states",
            "_state",
        }
    )

    FRONT_END = "Horovod TensorFlow"

    def __new__(cls, *args, **keywords):
        # Built while a tf.function is traced: the compressor an earlier trace of the same line
        # built with the same arguments (:mod:`.traced`), so a retrace makes no new variables.
        k = traced.key(cls, args, keywords)
        made = traced.made(k)
        if made is not None:
            return made
        self = super().__new__(cls)
        object.__setattr__(self, "_traced_key", k)  # (untracked by tf.Module)
        return self

    def __init__(
        self,
        method: str | None = None,
        bits: int | str | None = None,
        bucket_size: int | None = None,
        *,
        settings: Settings | None = None,
        jit_compile: bool = True,
        process_set=None,
        **keywords,
    ) -> None:
        if getattr(self, "_made", False):  # an earlier trace's compressor (__new__)
            return
        super().__init__(name=type(self).__name__)
        s = Settings.of(
            settings,
            self.FRONT_END,
            method=method or self.method or None,
            bits=bits,
            bucket_size=bucket_size,
            **keywords,
        )
        self._method = get_method(s.method)
        setup = configure(s)
        self.settings = s if s.seed is not None else s.replace(seed=setup.seed)  # one seed for every set
        self._state = setup.state
        self._quantizer, self._second = q, q2 = setup.quantizer, setup.second
        self._exchange = s.exchange  # auto or one with a graph execution (settings.partly)
        self._process_set = process_set
        self._set_cache = None
        self.min_size = s.min_size
        self._timeout = protocol.resolve_timeout(s.timeout)  # the bound of this compressor's own waits
        self.jit_compile = bool(jit_compile)
        self._claimed_uid = None  # the name part of its collectives, claimed at first use (_names)
        self._outstanding = 0  # eager exchanges begun and not yet decompressed
        self._slot = 0
        self._vars = RoundVariables(setup.state, setup.seed)
        self._init_sets()
        # The codec's tf.functions and per-traced-graph call-site counters, in a plain namespace so
        # that tf.Module / tf.train.Checkpoint do not track them.
        first = graph.codec(q.bits, q.bucket_size, q.norm, self.jit_compile)
        widths = self._state.auto.widths if self._vars.auto is not None else (q.bits,)
        self._fns = types.SimpleNamespace(
            sites=weakref.WeakKeyDictionary(),
            codec=first,
            stats=first.normless if self._vars.stats_length == 4 else first.grid,
            second=graph.codec(q2.bits, q.bucket_size, q.norm, self.jit_compile),
            widths={w: graph.codec(w, q.bucket_size, q.norm, self.jit_compile) for w in widths},
        )
        self._made = True
        traced.keep(self.__dict__.pop("_traced_key", None), self)

    # ------------------------------------------------------------------ configuration
    @property
    def levels(self) -> np.ndarray:
        """Current levels, shape (L,), float64 (read eagerly)."""
        return self._vars.levels.numpy()

    @property
    def exchange(self) -> str:
        """The exchange in use: ``exchange=`` with "auto" resolved for the process set's size."""
        return choose_exchange(self._exchange, self._set_size(), self._local_size())

    @property
    def process_set(self):
        """The Horovod process set this compressor serves."""
        return self._process_set if self._process_set is not None else graph.hvd().global_process_set

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(method={self._method.name!r}, bits={self.bits}, "
            f"bucket_size={self.bucket_size}, min_size={self.min_size}, exchange={self._exchange!r})"
        )

    # ------------------------------------------------------------------ Horovod interface
    def _names(self) -> str:
        """The name part of this compressor's collectives: after the process set and the order in
        which this process first compresses (any tensor) with compressors of that set
        (:func:`horovod_alq.core.protocol.process_set_uid`): ranks that created different numbers of
        compressors still pair their collectives."""
        if self._claimed_uid is None:
            self._claimed_uid = protocol.process_set_uid(self.process_set)
        return self._claimed_uid

    @tf.autograph.experimental.do_not_convert  # plain Python over static shapes, called in tf.function
    def compress(self, tensor):
        """Encode ``tensor`` and return the small vector to allreduce (no collective here)."""
        other = self._for_calling_process_set()
        if other is not None:
            small, ctx = other.compress(tensor)
            return small, mixins.Delegated(other, ctx)
        self._names()  # claimed at the first compress of any tensor (every rank of the allreduce calls it)
        tensor = tf.convert_to_tensor(tensor)
        numel = tensor.shape.num_elements()
        if tensor.dtype not in COMPRESSIBLE or numel is None or numel < max(self.min_size, 1):
            self._vars.count(uncompressed_coordinates=tf.size(tensor))
            sent, how = graph.passthrough(tensor)  # never the control vector's shape (docs/design/design.md)
            if tensor.dtype == tf.bfloat16:  # Horovod's TF allreduce has no bfloat16
                sent = tf.cast(sent, tf.float32)
            return sent, _PassThrough(tensor.dtype, tensor.shape, how)
        if not self._is_member():
            # Raising here would leave the members waiting in this allreduce: take part with the
            # core's outsider vector, which fails their checks, and raise in decompress.
            n = self._set_size()
            head = np.zeros(self._head_len(self.exchange))
            head[: protocol.tensor_vector_length(n)] = protocol.outsider_vector(n)
            ctx = _Outsider(self._outsider_message(), tensor.shape, tensor.dtype)
            return graph.control(tf.constant(head, tf.float64)), ctx
        eager = tf.executing_eagerly()
        slot = self._next_slot(eager)
        try:
            small, ctx = self._compress(tensor, numel, slot, eager)
            ctx.own_set = joined.own_set(self)
            return small, ctx
        except Exception:
            if eager:
                self._outstanding -= 1
            raise

    def _compress(self, tensor, numel: int, slot: int, eager: bool):
        v = self._vars
        if slot == 0:
            v.begin_round()
        exchange, g = self.exchange, self._local_size()
        n, me = self._set_size(), self._set_rank()
        h = protocol.shape_hash(tuple(tensor.shape.as_list()), tensor.dtype.name)
        width = None if v.auto is None else v.auto.width(slot, numel, h)
        layout = {"g": g, "status": False} if get(exchange).node_aware else {}  # the graph sends no status bytes
        plans = {w: get(exchange).plan(0, numel, n, me, q, q2, **layout) for w, (q, q2) in self._widths().items()}
        counters = v.count(
            calls=1,
            payload_bytes=auto.per_width(width, {w: _encoded(exchange, p, me, g) for w, p in plans.items()}),
            coordinates=numel,
            bytes_sent=auto.per_width(width, {w: p.sent for w, p in plans.items()}),
            bytes_received=auto.per_width(width, {w: p.received for w, p in plans.items()}),
        )
        current = v.current.read_value()
        collecting = v.collecting(current) if self._method.adaptive else None
        levels = (v.levels if v.auto is None else v.auto.levels).read_value()
        seed = tf.stack([tf.bitwise.bitwise_xor(v.seed.read_value(), self._rank_key()), counters["calls"] - 1])
        head = tf.constant(protocol.tensor_vector(me, n, slot, h, failed=False), tf.float64)
        payload, header = self._own_payload(tensor, exchange, width, plans, levels, seed, eager, slot)
        head = self._control_head(head, exchange, header, width, g)
        # the statistics row: unless the exchange collects its own (always with "auto": one length)
        row = collecting is not None and (self._exchange == "auto" or not own_statistics(exchange, v.auto is not None))
        if not row:
            small = head
        else:
            small = tf.cond(collecting, lambda: tf.concat([head, self._refit_row(tensor)], 0), lambda: head)
        ctx = Exchange(
            slot,
            tensor.shape,
            tensor.dtype,
            numel,
            payload,
            collecting,
            levels,
            header,
            eager,
            exchange,
            plans,
            seed,
            current,
            source=tensor,
            shape_code=h,
            width=width,
            row=row,
            g=g,
            collecting_second=v.collecting_second(current) if get(exchange).requantizes else None,
        )
        if eager:
            # Horovod drops ctx without decompress when its allreduce raised (a dtype mismatch): the
            # exchange is then over on this rank, as on the others, which never began it.
            ctx.done = [False]
            weakref.finalize(ctx, self._abandon, ctx.done)
        return graph.control(small), ctx

    def _widths(self) -> dict:
        """Each width this compressor may send: (quantizer, second quantizer)."""
        if self._vars.auto is None:
            return {self._quantizer.bits: (self._quantizer, self._second)}
        return {w: (q, q) for w, q in self._state.auto.quantizers.items()}

    def _refit_row(self, tensor) -> tf.Tensor:
        """What a refit round adds to the tensor's vector: its statistics, or (``bits="auto"``) its
        counts weighted by squared bucket norms and its statistics (:mod:`.auto`)."""
        if self._vars.auto is None:
            return self._fns.stats(tensor)
        hist = self._fns.codec.histograms(tensor)
        return tf.concat([hist[1], self._fns.codec.normless(tensor) if self._vars.stats_length == 4 else hist[0]], 0)

    @tf.autograph.experimental.do_not_convert
    def decompress(self, tensor, ctx):
        """Check the reduced vector, exchange the payloads, and return the reduced gradient in
        the original shape and dtype."""
        if ctx is None:
            return tensor
        if isinstance(ctx, mixins.Delegated):
            return ctx.compressor.decompress(tensor, ctx.ctx)
        if isinstance(ctx, _PassThrough):
            return graph.restore(
                tf.cast(tensor, ctx.dtype) if tensor.dtype != ctx.dtype else tensor, ctx.restore, ctx.shape
            )
        if isinstance(ctx, _Outsider):
            return graph.refuse(tensor, ctx.message, ctx.shape, ctx.dtype)
        try:
            reduced = tf.reshape(tf.cast(tensor, tf.float64), [-1])
            expected = tf.constant(self._head_len(ctx.exchange))  # the length compress made
            if ctx.collecting is not None and ctx.row:
                expected = tf.where(ctx.collecting, expected + self._vars.row_length, expected)
            n = self._set_size()
            check = functools.partial(self._check_vector, ctx)
            run = functools.partial(getattr(self, graph_method(ctx.exchange)), ctx, reduced)
            out = joined.guarded(self, ctx, reduced, expected, check, run)  # ranks in hvd.join(): served
        finally:
            if ctx.eager:
                ctx.done[0] = True
                self._outstanding -= 1
        out = tf.reshape(tf.cast(out, ctx.dtype), ctx.shape)
        return graph.connect_gradient(ctx.source, out, reduced[0] / n, self.process_set)

    # ------------------------------------------------------------------ metrics and state
    @tf.autograph.experimental.do_not_convert
    def metrics(self) -> dict:
        """:meth:`horovod_alq.core.rounds.RoundState.metrics` (the PyTorch compressors' metrics):
        ``levels``, ``multiplier``, ``second_levels`` (two-phase), ``exchange``, the counters
        (``step``: rounds completed) and ``bits_per_coordinate``. Read eagerly, between steps."""
        st = self._vars.read()
        st.exchange = self.exchange
        return self._sets_metrics(st.metrics())

    def state_dict(self) -> dict:
        """:meth:`RoundState.state_dict` with the seed and the pending statistics, as Python values: a
        compressor that loads it continues with identical levels and identical random draws."""
        if self._outstanding or any(c._outstanding for c in self._per_set.values()):
            raise RuntimeError("state_dict() during an exchange: call it between steps")
        return self._sets_state(self._vars.state_dict())

    def load_state_dict(self, state: dict) -> None:
        """Restore a :meth:`state_dict` (also one of a PyTorch compressor with the same method, bits
        and bucket size: its levels, seed and counters)."""
        if self._outstanding or any(c._outstanding for c in self._per_set.values()):
            raise RuntimeError("load_state_dict() during an exchange: call it between steps")
        self._vars.load_state_dict(self._load_sets(state))

    # ------------------------------------------------------------------ internals
    def _next_slot(self, eager: bool) -> int:
        """Index ``k`` of this compress call in its round (see the module docstring)."""
        if eager:
            if self._outstanding == 0:
                self._slot = 0
            k = self._slot
            self._slot += 1
            self._outstanding += 1
            return k
        outer = graph.outermost_graph()
        k = self._fns.sites.get(outer, 0)
        self._fns.sites[outer] = k + 1
        return k

    def _abandon(self, done: list) -> None:
        """Finalizer of an eager exchange: Horovod dropped it without decompress (it raised first)."""
        if not done[0]:
            done[0] = True
            self._outstanding = max(0, self._outstanding - 1)

    def _rank_key(self) -> int:
        return graph.signed64(protocol.splitmix64(graph.hvd().rank() + 1))

    def _scale(self, reduced: tf.Tensor) -> tf.Tensor:
        """Sum of 1 over the ranks (N for Sum, 1 for Average) over N: the factor on the decoded sum."""
        return tf.cast(reduced[0] / self._set_size(), tf.float32)

    # ---- process set
    def _for_set(self, process_set) -> QuantizedCompressor:
        return QuantizedCompressor(process_set=process_set, settings=self.settings, jit_compile=self.jit_compile)


class ALQCompressor(mixins.ALQ, QuantizedCompressor):
    """ALQ for Horovod TensorFlow: levels fitted by coordinate descent to the gradients'
    statistics (``normless=True``: ALQ-N).

    ``ALQCompressor(bits=3, bucket_size=8192, normless=False, norm=None, **keywords)``; ``norm="linf"``
    (max-abs buckets, the default) or ``"l2"`` (the paper's form); the other keywords are those of
    :class:`QuantizedCompressor`."""


class AMQCompressor(mixins.AMQ, QuantizedCompressor):
    """AMQ for Horovod TensorFlow: levels ``+-{p**s, ..., p, 1}`` with the multiplier ``p`` adapted
    (``normless=True``: AMQ-N). Keywords as :class:`ALQCompressor`."""


class QSGDCompressor(mixins.QSGD, QuantizedCompressor):
    """QSGD for Horovod TensorFlow, uniform levels: ``norm="linf"`` (default) is QSGDinf, ``norm="l2"``
    the original QSGD. Other keywords: those of :class:`QuantizedCompressor`."""


class NUQSGDCompressor(mixins.NUQSGD, QuantizedCompressor):
    """NUQSGD for Horovod TensorFlow: fixed exponential levels ``+-{2**-s, ..., 1/2, 1}``, L2 buckets."""


class TernGradCompressor(mixins.TernGrad, QuantizedCompressor):
    """TernGrad for Horovod TensorFlow: levels {-1, 0, 1} times the bucket's max-abs, 2 bits per
    coordinate (``bits`` other than 2 is refused)."""


def compressor_for(method: str, **kwargs) -> QuantizedCompressor:
    """The compressor for a method name ("alq", "alq-n", "amq", "amq-n", "qsgdinf", "qsgd", "nuqsgd",
    "terngrad"), with the classes' keywords: ``compressor_for("alq-n", bits=3)`` is
    ``ALQCompressor(bits=3, normless=True)``. TernGrad ignores ``bits`` (always 2)."""
    return mixins.compressor_by_name(globals(), method, **kwargs)
