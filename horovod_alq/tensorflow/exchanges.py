"""The exchanges the TensorFlow compressors run in the graph, one tensor at a time: the allgather,
the two-phase and the two hierarchical exchanges of :mod:`horovod_alq.exchange`, per their plans
(:class:`GraphExchanges`, a part of :class:`~horovod_alq.tensorflow.compressor.QuantizedCompressor`:
also the rank's own payload and the control vector's head), and the context of one compressed
tensor between ``compress`` and ``decompress`` (:class:`Exchange`)."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import numpy as np
import tensorflow as tf

from ..core import protocol
from ..core.wire import payload_size
from ..exchange import hierarchical as hier
from ..exchange.hierarchical_two_phase import between_splits
from ..exchange.plan import BufferPlan
from ..exchange.registry import get
from . import auto, checks, graph, waits


@dataclass
class Exchange:
    """Context of one compressed tensor between compress and decompress."""

    slot: int
    shape: tf.TensorShape
    dtype: tf.DType
    numel: int
    payload: tf.Tensor  # this rank's payload (two-phase: its first-phase shards, end to end; node-aware: None)
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
    row: bool = True  # a refit round's statistics travel in the control vector (else the exchange's own)
    g: int = 1  # ranks per node (node-aware exchanges)
    collecting_second: Any = None  # bool tensor: the round collects for the second quantizer (else None)


def own_statistics(exchange: str, auto_bits: bool) -> bool:
    """Whether a refit round's statistics come from the exchange (node sums) rather than the control
    vector: node-aware exchanges with fixed bits (``bits="auto"`` rows are the ranks' own tensors')."""
    return get(exchange).own_first_statistics and not auto_bits


class GraphExchanges:
    """The graph execution of each exchange (``graph_method`` of the compressor names the method
    that runs each), the rank's own payload and the control vector's head; the compressor provides
    the codec functions, variables and process set."""

    def _by_width(self, width, fn, eager: bool):
        """:func:`.auto.by_width` over this compressor's candidate widths."""
        return auto.by_width(width, fn, eager, tuple(self._fns.widths))

    # ------------------------------------------------------------------ compress
    def _encode_part(self, codec, x: tf.Tensor, levels, header: tf.Tensor, seed, key: tuple) -> tf.Tensor:
        """One payload of ``x`` with ``codec`` (a :func:`.graph.codec`); an empty range's is its
        header alone. With error feedback, of ``x`` plus the buffer of ``key`` ((slot, elements,
        tag, lo, hi): :mod:`.feedback`), which keeps what the payload dropped."""
        n = x.shape.num_elements()
        if n == 0:
            return header
        fb = self._vars.feedback
        if fb is None:
            return codec.encode(x, levels, header, seed)
        one = tf.constant(1.0, tf.float32)
        return fb.encode(codec.encode, lambda p, lv: codec.decoder(n, 1)(p, lv, one), x, levels, header, seed, key)

    def _own_payload(self, tensor, exchange: str, width, plans, levels, seed, eager: bool, slot: int = 0):
        """``(payload, header)``: this rank's codes of ``tensor`` as the exchange sends them (the
        whole tensor, or one payload per shard end to end; node-aware exchanges quantize node sums
        in ``decompress``: None) and the header of the whole tensor's payload."""
        v, numel = self._vars, tensor.shape.num_elements()
        if get(exchange).node_aware:
            return None, self._by_width(width, lambda bits: v.header(numel, bits=bits), eager)

        def encode(bits: int | None):  # None: the fixed width
            w = self._quantizer.bits if bits is None else bits
            header = v.header(numel, bits=bits)
            codec, lv = self._fns.widths[w], auto.levels_of(levels, bits)
            if exchange == "allgather":
                return self._encode_part(codec, tensor, lv, header, seed, (slot, numel, "own", 0, numel)), header
            flat = tf.reshape(tensor, [-1])
            return tf.concat(
                [
                    self._encode_part(
                        codec,
                        flat[a:b],
                        lv,
                        v.header(b - a, bits=bits),
                        graph.part_seed(seed, j, 1),
                        (slot, numel, "own", a, b),
                    )  # fmt: skip
                    for j, (a, b) in enumerate(plans[w].parts)
                ],
                0,
            ), header

        return self._by_width(width, encode, eager)

    def _head_parts(self, exchange: str) -> tuple[bool, bool]:
        """Whether the control vector carries (the configuration sums, the ranks' layouts): the
        first for the exchanges whose payloads are not all gathered and checked by every rank, the
        second for the node-aware ones; both with ``exchange="auto"``, so that ranks that resolve
        it differently (they see other node layouts) hand Horovod vectors of one length and are
        named (:func:`.checks.check_vector`)."""
        if self._exchange == "auto":
            return True, True
        e = get(exchange)
        return e.requantizes or e.node_aware, e.node_aware

    def _control_head(self, head: tf.Tensor, exchange: str, header: tf.Tensor, width, g: int) -> tf.Tensor:
        """The core's tensor vector ``head``, then (:meth:`_head_parts`) the configuration sums
        (the header bytes and ``bits_second``, and their squares) and this rank's ranks per node
        at its place among the set's; last, always, ``error_feedback`` as ``v = 1 + on`` and
        ``v**2`` (:data:`.checks.FEEDBACK`: no payload header carries it)."""
        config, layout = self._head_parts(exchange)
        if config:
            second = tf.constant(float(self._second.bits), tf.float64) if width is None else tf.cast(width, tf.float64)
            values = tf.concat([tf.cast(header, tf.float64), second[None]], 0)
            head = tf.concat([head, values, values * values], 0)
        if layout:
            mine = np.zeros(self._set_size())
            mine[self._set_rank()] = g
            head = tf.concat([head, tf.constant(mine, tf.float64)], 0)
        v = 1.0 + float(self._vars.feedback is not None)
        return tf.concat([head, tf.constant([v, v * v], tf.float64)], 0)

    def _head_len(self, exchange: str) -> int:
        """Length of the vector compress hands the allreduce, statistics aside (:meth:`_control_head`)."""
        n, (config, layout) = self._set_size(), self._head_parts(exchange)
        return protocol.tensor_vector_length(n) + 2 * checks.CONFIG * config + n * layout + checks.FEEDBACK

    def _check_vector(self, ctx: Exchange, reduced: np.ndarray, expected) -> None:
        n = self._set_size()
        size = protocol.tensor_vector_length(n)
        config, layout = self._head_parts(ctx.exchange)
        e = get(ctx.exchange)  # an allgather checks the gathered headers instead (they name the ranks)
        checks.check_vector(
            reduced,
            rank=self._set_rank(),
            size=n,
            slot=ctx.slot,
            shape_code=ctx.shape_code,
            extra=int(expected) - size,
            config=ctx.exchange if e.requantizes or e.node_aware else None,
            layout=size + 2 * checks.CONFIG * config if layout else None,
            feedback=self._head_len(ctx.exchange) - checks.FEEDBACK,
        )

    # ------------------------------------------------------------------ decompress

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
            return self._complete(ctx, reduced, self._by_width(ctx.width, decode, ctx.eager))

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
        return self._by_width(ctx.width, functools.partial(self._two_phase_width, ctx, reduced), ctx.eager)

    def _two_phase_width(self, ctx: Exchange, reduced: tf.Tensor, bits: int | None) -> tf.Tensor:
        hvd, ps, v = graph.hvd(), self.process_set, self._vars
        chosen = bits is not None  # bits='auto': the width chosen for this tensor
        w = bits if chosen else self._quantizer.bits
        plan, first = ctx.plans[w], self._fns.widths[w]
        n, me = self._set_size(), self._set_rank()
        name = f"horovod_alq.{self._names()}.{ctx.slot}"
        received, rsplits = self._alltoall(ctx.payload, (plan.first, [plan.first[me]] * n), name + ".a2a")
        a, b = plan.parts[me]
        one = tf.constant(1.0, tf.float32)
        levels = auto.levels_of(ctx.levels, bits)
        acc = first.decoder(b - a, n)(received, levels, one) if b > a else tf.zeros([0], tf.float32)
        follows = chosen or v.state.follows_first
        levels2 = levels if follows else v.second_levels_now()
        second = first if chosen else self._fns.second
        payload2 = self._encode_part(
            second, acc, levels2, v.header(b - a, second=True, bits=bits), graph.part_seed(ctx.seed, me, 2),
            (ctx.slot, ctx.numel, "sum", a, b),
        )  # fmt: skip
        payload2 = _reading(payload2, rsplits)
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
        second_statistics = self._owner_statistics(acc, b > a, name + ".second")
        return self._complete(ctx, reduced, tf.concat(pieces, 0), second=second_statistics)

    def _hierarchical(self, ctx: Exchange, reduced: tf.Tensor) -> tf.Tensor:
        """:mod:`horovod_alq.exchange.hierarchical` on one tensor: exact sums inside the node, each
        node's sum of shard ``j`` quantized once by local rank ``j`` and sent to the owners of shard
        ``j`` on every node, then forwarded inside the node (three alltoalls of the set, in which
        ranks outside a group exchange nothing). Every rank decodes the same payloads and sums the
        nodes in node order: identical on every rank. The configurations and the layouts were
        compared through the reduced vector, so the payloads are not checked again."""
        return self._by_width(ctx.width, functools.partial(self._hierarchical_width, ctx, reduced), ctx.eager)

    def _hierarchical_width(self, ctx: Exchange, reduced: tf.Tensor, bits: int | None) -> tf.Tensor:
        w = self._quantizer.bits if bits is None else bits
        plan, first, levels = ctx.plans[w], self._fns.widths[w], auto.levels_of(ctx.levels, bits)
        n, me, g = self._set_size(), self._set_rank(), ctx.g
        local, nodes = me % g, n // g
        name = f"horovod_alq.{self._names()}.{ctx.slot}"
        (a, b), own = plan.parts[local], plan.first[local]
        acc, read = self._node_sum(ctx, plan.parts, name)
        header = self._vars.header(b - a, bits=bits)
        payload = _reading(
            self._encode_part(
                first, acc, levels, header, graph.part_seed(ctx.seed, local, 3), (ctx.slot, ctx.numel, "node", a, b)
            ),
            read,
        )
        to = hier.splits(n, {r: own for r in hier.cross_ranks(me, n, g)})
        held, _ = self._alltoall(tf.tile(payload, [nodes]), (to, to), name + ".h2")
        block = [nodes * s for s in plan.first]
        received, _ = self._alltoall(tf.tile(held, [g]), hier.forward_splits(n, me, block), name + ".h3")
        offsets, scale = np.cumsum([0, *block]).tolist(), self._scale(reduced)
        pieces = [
            first.decoder(pb - pa, nodes)(received[offsets[j] : offsets[j + 1]], levels, scale)
            for j, (pa, pb) in enumerate(plan.parts)
            if pb > pa
        ]
        return self._complete(ctx, reduced, tf.concat(pieces, 0), self._owner_statistics(acc, b > a, name))

    def _hierarchical_two_phase(self, ctx: Exchange, reduced: tf.Tensor) -> tf.Tensor:
        """:mod:`horovod_alq.exchange.hierarchical_two_phase` on one tensor: exact sums inside the
        node, a two-phase exchange of the node sums between the owners of each shard (sub-shard
        ``k`` summed and re-quantized by the owner on node ``k``), then forwarded inside the node
        (four alltoalls of the set). Checked as :meth:`_hierarchical`."""
        return self._by_width(ctx.width, functools.partial(self._hierarchical_two_phase_width, ctx, reduced), ctx.eager)

    def _hierarchical_two_phase_width(self, ctx: Exchange, reduced: tf.Tensor, bits: int | None) -> tf.Tensor:
        v, chosen = self._vars, bits is not None
        w = bits if chosen else self._quantizer.bits
        plan, first, levels = ctx.plans[w], self._fns.widths[w], auto.levels_of(ctx.levels, bits)
        follows = chosen or v.state.follows_first
        levels2 = levels if follows else v.second_levels_now()
        second = first if chosen else self._fns.second
        n, me, g = self._set_size(), self._set_rank(), ctx.g
        m = n // g
        node, local = divmod(me, g)
        name = f"horovod_alq.{self._names()}.{ctx.slot}"
        parts = plan.parts
        mine = parts[local * m : (local + 1) * m]
        a, b = mine[0][0], mine[-1][1]
        acc, read = self._node_sum(ctx, [(parts[j * m][0], parts[j * m + m - 1][1]) for j in range(g)], name)
        payloads = [
            self._encode_part(
                first,
                acc[sa - a : sb - a],
                levels,
                v.header(sb - sa, bits=bits),
                graph.part_seed(ctx.seed, local * m + k, 3),
                (ctx.slot, ctx.numel, "node", sa, sb),
            )
            for k, (sa, sb) in enumerate(mine)
        ]
        phase1, phase2 = between_splits(n, me, g, plan.first, plan.second)
        received, read1 = self._alltoall(_reading(tf.concat(payloads, 0), read), phase1, name + ".h2")
        sa, sb = mine[node]
        one = tf.constant(1.0, tf.float32)
        total = first.decoder(sb - sa, m)(received, levels, one) if sb > sa else tf.zeros([0], tf.float32)
        again = self._encode_part(
            second, total, levels2, v.header(sb - sa, second=True, bits=bits),
            graph.part_seed(ctx.seed, g * m + local * m + node, 3), (ctx.slot, ctx.numel, "sum", sa, sb),
        )  # fmt: skip
        held, _ = self._alltoall(tf.tile(_reading(again, read1), [m]), phase2, name + ".h3")
        block = [sum(plan.second[j * m : (j + 1) * m]) for j in range(g)]
        gathered, _ = self._alltoall(tf.tile(held, [g]), hier.forward_splits(n, me, block), name + ".h4")
        offsets, scale = np.cumsum([0, *plan.second]).tolist(), self._scale(reduced)
        pieces = [
            second.decoder(pb - pa, 1)(gathered[offsets[j] : offsets[j + 1]], levels2, scale)
            for j, (pa, pb) in enumerate(parts)
            if pb > pa
        ]
        return self._complete(
            ctx,
            reduced,
            tf.concat(pieces, 0),
            self._owner_statistics(acc, b > a, name),
            self._owner_statistics(total, sb > sa, name + ".second"),
        )

    def _node_sum(self, ctx: Exchange, shards, name: str) -> tuple[tf.Tensor, tf.Tensor]:
        """Stage 1 of the node-aware exchanges: an exact float32 reduce-scatter inside the node
        (``shards``: one per local rank). Returns this rank's node sum of its shard (the node's
        ranks' shards summed in rank order) and the alltoall's received splits."""
        n, me, g = self._set_size(), self._set_rank(), ctx.g
        a, b = shards[me % g]
        flat = tf.reshape(tf.cast(ctx.source, tf.float32), [-1])
        send = tf.concat([flat[pa:pb] for pa, pb in shards], 0)
        peers = hier.node_ranks(me, g)
        to = hier.splits(n, {r: shards[r % g][1] - shards[r % g][0] for r in peers})
        received, splits = self._alltoall(send, (to, hier.splits(n, {r: b - a for r in peers})), name + ".h1")
        acc = received[0 : b - a]
        for k in range(1, g):
            acc = acc + received[k * (b - a) : (k + 1) * (b - a)]
        return acc, splits

    def _owner_statistics(self, acc: tf.Tensor, nonempty: bool, name: str):
        """A refit round's statistics of what the owners quantize (fixed bits: node sums for the
        first quantizer, reduced shards for the second): their statistics summed over the set in one
        more allreduce (run only in the rounds that collect: every rank takes the same branch), over
        the set's size as the control vector's are."""
        if self._vars.auto is not None:
            return None
        n, ps, hvd = self._set_size(), self.process_set, graph.hvd()

        def statistics():
            # an empty shard's zeros read ``acc`` (its sum is 0): an op that reads nothing from outside
            # a cond branch may run when the branch is not taken (TF lowers it to Switch/Merge)
            empty = tf.zeros([self._vars.stats_length], tf.float64) + tf.reduce_sum(tf.cast(acc, tf.float64))
            mine = self._fns.stats(acc) if nonempty else empty
            summed = waits.bounded(
                lambda: hvd.allreduce(mine, op=hvd.Sum, name=name + ".stats", ignore_name_scope=True, process_set=ps),
                name + ".stats",
                self._timeout,
                ps,
            )
            return summed / n

        return statistics

    def _alltoall(self, data: tf.Tensor, splits, name: str) -> tuple[tf.Tensor, tf.Tensor]:
        """One alltoall of the set: ``splits[0][r]`` elements of ``data`` to rank ``r``; returns what
        came from every rank (in rank order, ``sum(splits[1])`` elements: a static shape) and how
        much came from each."""
        hvd, ps = graph.hvd(), self.process_set
        received, counts = waits.bounded(
            lambda: hvd.alltoall(data, splits=list(splits[0]), name=name, ignore_name_scope=True, process_set=ps),
            name,
            self._timeout,
            ps,
        )
        return tf.reshape(received, [sum(splits[1])]), counts

    def _complete(self, ctx: Exchange, reduced: tf.Tensor, out: tf.Tensor, statistics=None, second=None) -> tf.Tensor:
        """``out`` once the round completed and its reduced statistics (refit rounds) are pending:
        ``statistics()``'s, else those the control vector carried; and, in the rounds that collect
        for the second quantizer, ``second()``'s."""
        head = self._head_len(ctx.exchange)
        if second is not None and ctx.collecting_second is not None:
            with tf.control_dependencies([self._vars.keep_second(ctx.collecting_second, second)]):
                out = tf.identity(out)
        return self._vars.complete(
            out,
            ctx.round,
            ctx.collecting,
            statistics or (lambda: reduced[head:] / reduced[0]),
            slot=ctx.slot,
            key=(ctx.numel, ctx.shape_code),
        )


def _reading(x: tf.Tensor, splits: tf.Tensor) -> tf.Tensor:
    """``x`` plus a zero that reads a collective's ``splits``: a graph prunes the ops nothing reads
    (control dependencies included), and an empty shard's payload reads nothing received."""
    return x + tf.cast(tf.minimum(tf.reduce_min(splits), 0), x.dtype)
