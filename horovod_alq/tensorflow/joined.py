"""``hvd.join()`` in the TensorFlow compressors (docs/design/design.md, "Protocol").

Horovod serves a rank in ``hvd.join()`` in allreduces (it sums zeros for it), not in allgathers or
alltoalls, so a quantized exchange cannot run while a rank of the set is joined. Where the calling
Horovod collective runs over the compressor's own process set (read from its frame at ``compress``),
ranks whose entries in the reduced control vector are 0 can only be in ``hvd.join()``; if every other
check holds over the other ranks (:func:`horovod_alq.core.protocol.joined_ranks`), every rank that
took part (they all hold the same vector) sends the tensor uncompressed in one more allreduce, which
the joined ranks serve: the result is Horovod's own. Anything else raises as before.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from .. import compressor_mixins as mixins
from ..core import protocol
from . import graph, waits


def own_set(comp) -> bool:
    """Whether the Horovod collective calling ``comp.compress`` runs over ``comp``'s process set."""
    calling = mixins.calling_process_set(comp.HOROVOD, depth=12)
    return calling is not None and calling.process_set_id == comp.process_set.process_set_id


def guarded(comp, ctx, reduced: tf.Tensor, expected: tf.Tensor, check, run) -> tf.Tensor:
    """:func:`graph.guarded` (``run()`` once ``check`` passed, else ``check`` raises), except that a
    vector that shows ranks in ``hvd.join()`` gives :func:`serve`'s result (flat, float64 for a
    float64 tensor, else float32)."""
    if not ctx.own_set:
        return graph.guarded(None, run, check, [reduced, expected], ctx.numel, ctx.eager)
    dtype = tf.float64 if ctx.dtype == tf.float64 else tf.float32
    size, rank = comp._set_size(), comp._set_rank()

    def host(values, length) -> np.int32:  # 0: exchange, 1: serve the joined ranks; raises otherwise
        try:
            check(values, length)
        except protocol.ReductionMismatch:
            if protocol.joined_ranks(values, rank=rank, size=size, shape_code=ctx.shape_code) is None:
                raise
            return np.int32(1)
        return np.int32(0)

    if ctx.eager:
        return serve(comp, ctx, reduced, dtype) if host(reduced.numpy(), expected.numpy()) else run()
    branch = tf.numpy_function(host, [reduced, expected], tf.int32, stateful=True, name="horovod_alq_check")
    branch.set_shape([])

    def exchanged():
        with tf.control_dependencies([branch]):
            return tf.cast(run(), dtype)

    def served():
        with tf.control_dependencies([branch]):
            return serve(comp, ctx, reduced, dtype)

    return tf.switch_case(branch, [exchanged, served])


def serve(comp, ctx, reduced: tf.Tensor, dtype: tf.DType) -> tf.Tensor:
    """The tensor summed uncompressed over the ranks not in ``hvd.join()`` (Horovod adds zeros for
    those), times the op's scale: the reduced vector's scale over the number of those ranks."""
    size = comp._set_size()
    end = protocol.tensor_vector_length(size)
    present = tf.cast(tf.math.count_nonzero(reduced[end - size : end]), tf.float64)
    hvd, ps, source = graph.hvd(), comp.process_set, ctx.source
    x = tf.cast(source, tf.float32) if source.dtype == tf.bfloat16 else source
    name = f"horovod_alq.{comp._names()}.joined.{ctx.slot}"
    summed = waits.bounded(
        lambda: hvd.allreduce(x, op=hvd.Sum, name=name, ignore_name_scope=True, process_set=ps), name, comp._timeout, ps
    )
    return tf.cast(tf.reshape(tf.cast(summed, tf.float64) * (reduced[0] / present), [-1]), dtype)
