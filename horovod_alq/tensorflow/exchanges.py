"""The exchanges the TensorFlow compressors run in the graph, one tensor at a time: the allgather
and the two-phase exchange of :mod:`horovod_alq.exchange`, per its plans (:class:`GraphExchanges`,
a part of :class:`~horovod_alq.tensorflow.compressor.QuantizedCompressor`), and the context of one
compressed tensor between ``compress`` and ``decompress`` (:class:`Exchange`)."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import numpy as np
import tensorflow as tf

from ..core.wire import payload_size
from ..exchange.plan import BufferPlan
from . import auto, checks, graph, waits


@dataclass
class Exchange:
    """Context of one compressed tensor between compress and decompress."""

    slot: int
    shape: tf.TensorShape
    dtype: tf.DType
    numel: int
    payload: tf.Tensor  # this rank's payload (two-phase: its first-phase shards, end to end)
    collecting: Any  # bool tensor, or None for fixed methods
    levels: tf.Tensor  # bits="auto": every width's, padded (AutoVariables.padded_levels)
    header: tf.Tensor
    eager: bool
    exchange: str
    plans: dict[int, BufferPlan]  # per width: the exchange's element ranges, payload sizes and wire bytes
    seed: tf.Tensor
    round: tf.Tensor  # index of this tensor's round
    source: Any = None  # the compressed tensor (autograd connects the output to it)
    shape_code: int = 0
    done: list = None  # eager: [decompressed?], read by the finalizer of an abandoned exchange
    width: Any = None  # bits="auto": the tensor's width (int32 tensor); None with fixed bits
    own_set: bool = False  # the calling collective runs over the compressor's set (joined.own_set)


class GraphExchanges:
    """The graph execution of each exchange (``graph_method`` of the compressor names the method
    that runs each); the compressor provides the codec functions, variables and process set."""

    def _allgather(self, ctx: Exchange, reduced: tf.Tensor) -> tf.Tensor:
        """Gather every rank's payload, check every header, decode and sum (flat float32)."""
        n = self._set_size()
        name, ps = f"horovod_alq.{self._names()}.{ctx.slot}", self.process_set
        gathered = waits.bounded(
            lambda: graph.hvd().allgather(ctx.payload, name=name, ignore_name_scope=True, process_set=ps),
            name,
            self._timeout,
            ps,
        )

        sizes = {w: payload_size(ctx.numel, w, q.bucket_size) for w, (q, _) in self._widths().items()}
        ok, fitted = checks.payloads_ok(gathered, ctx.header, n, auto.per_width(ctx.width, sizes, tf.int32))

        def decode(bits: int | None):  # only the codec depends on the width
            w = self._quantizer.bits if bits is None else bits
            payloads = tf.reshape(fitted, [n * sizes[w]])
            return self._fns.widths[w].decoder(ctx.numel, n)(
                payloads, auto.levels_of(ctx.levels, bits), self._scale(reduced)
            )

        def run():
            return self._complete(ctx, reduced, auto.by_width(ctx.width, decode, ctx.eager))

        explain = functools.partial(
            checks.explain_payloads, numel=ctx.numel, ranks=n, quantizer=self._quantizer, slot=ctx.slot
        )
        return graph.guarded(ok, run, explain, [gathered, ctx.header], ctx.numel, ctx.eager)

    def _two_phase(self, ctx: Exchange, reduced: tf.Tensor) -> tf.Tensor:
        """:mod:`horovod_alq.exchange.two_phase` on one tensor, per its plan: shard ``j`` of every
        rank's codes goes to rank ``j``, which sums them and re-quantizes the sum once; every rank
        decodes all the re-quantized shards (flat float32, identical on every rank). The
        configurations (``bits="auto"``: the width and the allocation's hash too) were compared
        through the reduced vector, so the payloads are not checked again."""
        return auto.by_width(ctx.width, functools.partial(self._two_phase_width, ctx, reduced), ctx.eager)

    def _two_phase_width(self, ctx: Exchange, reduced: tf.Tensor, bits: int | None) -> tf.Tensor:
        hvd, ps, v = graph.hvd(), self.process_set, self._vars
        chosen = bits is not None  # bits='auto': the width chosen for this tensor
        w = bits if chosen else self._quantizer.bits
        plan, first = ctx.plans[w], self._fns.widths[w]
        n, me = self._set_size(), self._set_rank()
        name = f"horovod_alq.{self._names()}.{ctx.slot}"
        received, rsplits = waits.bounded(
            lambda: hvd.alltoall(
                ctx.payload, splits=list(plan.first), name=name + ".a2a", ignore_name_scope=True, process_set=ps
            ),
            name + ".a2a",
            self._timeout,
            ps,
        )
        received = tf.reshape(received, [n * plan.first[me]])
        a, b = plan.parts[me]
        one = tf.constant(1.0, tf.float32)
        levels = auto.levels_of(ctx.levels, bits)
        acc = first.decoder(b - a, n)(received, levels, one) if b > a else tf.zeros([0], tf.float32)
        follows = chosen or v.state.follows_first
        levels2 = levels if follows else tf.constant(self._second.levels, tf.float64)
        second = first if chosen else self._fns.second
        payload2 = graph.encode_part(
            second.encode, acc, levels2, v.header(b - a, second=True, bits=bits), graph.part_seed(ctx.seed, me, 2)
        )
        # An empty shard's payload reads nothing received, and a graph prunes the ops nothing reads
        # (control dependencies included): add a zero that reads the alltoall's splits.
        payload2 += tf.cast(tf.minimum(tf.reduce_min(rsplits), 0), tf.uint8)
        gathered = waits.bounded(
            lambda: hvd.allgather(payload2, name=name + ".ag2", ignore_name_scope=True, process_set=ps),
            name + ".ag2",
            self._timeout,
            ps,
        )
        gathered = tf.reshape(gathered, [sum(plan.second)])
        scale = self._scale(reduced)
        offsets = np.cumsum([0, *plan.second]).tolist()
        pieces = [
            second.decoder(pb - pa, 1)(gathered[offsets[j] : offsets[j + 1]], levels2, scale)
            for j, (pa, pb) in enumerate(plan.parts)
            if pb > pa
        ]
        return self._complete(ctx, reduced, tf.concat(pieces, 0))

    def _complete(self, ctx: Exchange, reduced: tf.Tensor, out: tf.Tensor) -> tf.Tensor:
        """``out`` once the round completed and its reduced statistics (refit rounds) are pending."""
        head = self._head_len(ctx.exchange)
        return self._vars.complete(
            out,
            ctx.round,
            ctx.collecting,
            lambda: reduced[head:] / reduced[0],
            slot=ctx.slot,
            key=(ctx.numel, ctx.shape_code),
        )
