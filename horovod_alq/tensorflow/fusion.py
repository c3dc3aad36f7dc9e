"""Fusion buffers in TensorFlow: many gradients, one control vector and one payload exchange per
buffer of ``fusion_bytes``.

Horovod calls a compressor once per tensor, so ``hvd.DistributedGradientTape`` with a compressor
exchanges every gradient on its own: a ResNet-50 step is 161 control vectors, 161 payload
exchanges and 161 codec calls (and 161 XLA compiles at the first step). :func:`fused_allreduce`
packs the tensors into buffers first (TF ops: ``tf.concat`` / ``tf.split``, eagerly and inside
``tf.function``), one dtype per buffer, and hands each buffer to the compressor as one tensor;
:class:`DistributedGradientTape` is Horovod's tape with that in place of the per-tensor allreduce.

Which tensors travel in buffers: those the compressor would quantize (floating point, a size known
when traced, at least ``min_size`` elements). The others (integers, small or unknown-size tensors)
go uncompressed through the compressor, one ``hvd.grouped_allreduce`` per dtype.

Rounds: one call is one round of the compressor. Eagerly every buffer goes through one
``hvd.grouped_allreduce`` (their control vectors are all float64); inside ``tf.function`` each
buffer is an allreduce of its own (its call site numbers its slot in the traced step), so that
TensorFlow's executor can start a buffer's exchange once its gradients exist, while the backward
pass computes the rest: the buffers are filled from the last tensor to the first, the order in
which a backward pass produces them.
"""

from __future__ import annotations

from typing import Any, Sequence

import tensorflow as tf

from ..exchange.engine import resolve_fusion_bytes
from . import graph
from .compressor import COMPRESSIBLE, QuantizedCompressor

#: The name prefix of the collectives of :func:`fused_allreduce` (``name=`` replaces it).
NAME = "horovod_alq.fused"


def buffers(tensors: Sequence[tf.Tensor], fusion_bytes: int, min_size: int) -> tuple[list[list[int]], list[int]]:
    """``(groups, direct)``: the indices of ``tensors`` as fusion buffers (each of one dtype, at
    most ``fusion_bytes`` of float32 unless one tensor is larger; 0: a buffer per tensor), filled
    from the last tensor to the first, and the indices that travel on their own (not floating
    point, size unknown when traced, fewer than ``min_size`` elements)."""
    groups: list[list[int]] = []
    open_: dict[tf.DType, list[int]] = {}
    fill: dict[tf.DType, int] = {}
    direct = []
    for i in reversed(range(len(tensors))):
        t = tensors[i]
        numel = t.shape.num_elements()
        if t.dtype not in COMPRESSIBLE or numel is None or numel < max(min_size, 1):
            direct.append(i)
            continue
        size = 4 * numel
        current = open_.get(t.dtype)
        if current is None or fill[t.dtype] + size > fusion_bytes:
            current = open_[t.dtype] = []
            groups.append(current)
            fill[t.dtype] = 0
        current.append(i)
        fill[t.dtype] += size
    return groups, sorted(direct)


def fused_allreduce(
    tensors: Sequence[Any],
    compression: QuantizedCompressor,
    *,
    op=None,
    fusion_bytes: int | None = None,
    process_set=None,
    name: str | None = None,
) -> list[Any]:
    """Allreduce ``tensors`` (a list; None entries stay None, ``tf.IndexedSlices`` are made dense)
    through ``compression`` in fusion buffers; returns the reduced tensors in the order, shapes
    and dtypes given. ``op``: ``hvd.Average`` (default) or ``hvd.Sum``; ``fusion_bytes``: float32
    bytes per buffer (default: the compressor's setting, else ``$HOROVOD_ALQ_FUSION_BYTES``, else
    64 MiB; 0: one buffer per tensor); ``process_set``: Horovod's (default: the compressor's, else
    the global set). Every rank must pass the same shapes and dtypes in the same order."""
    if not isinstance(compression, QuantizedCompressor):
        raise TypeError(
            f"fused_allreduce needs a horovod_alq.tensorflow compressor instance (ALQCompressor(...)), "
            f"got {type(compression).__name__}"
        )
    hvd = graph.hvd()
    op = hvd.Average if op is None else op
    limit = resolve_fusion_bytes(compression.settings.fusion_bytes if fusion_bytes is None else fusion_bytes)
    ps = process_set if process_set is not None else compression.process_set
    prefix = NAME if name is None else name
    values = [None if t is None else tf.convert_to_tensor(t) for t in tensors]
    present = [i for i, t in enumerate(values) if t is not None]
    groups, direct = buffers([values[i] for i in present], limit, compression.min_size)
    packed = [tf.concat([tf.reshape(values[present[j]], [-1]) for j in group], 0) for group in groups]
    common = dict(compression=compression, op=op, process_set=ps)
    if not packed:
        summed = []
    elif tf.executing_eagerly():  # one grouped call (float64 control vectors): one round
        summed = hvd.grouped_allreduce(packed, name=prefix, **common)
    else:  # a traced step is one round whatever its calls; each buffer may start on its own
        summed = [hvd.allreduce(b, name=f"{prefix}.{k}", **common) for k, b in enumerate(packed)]
    out: list[Any] = list(values)
    for group, buffer in zip(groups, summed):
        sizes = [values[present[j]].shape.num_elements() for j in group]
        for j, piece in zip(group, tf.split(buffer, sizes)):
            out[present[j]] = tf.reshape(piece, values[present[j]].shape)
    by_dtype: dict[tf.DType, list[int]] = {}  # Horovod groups tensors of one dtype only
    for j in direct:
        by_dtype.setdefault(values[present[j]].dtype, []).append(j)
    for k, (dtype, js) in enumerate(by_dtype.items()):
        alone = hvd.grouped_allreduce([values[present[j]] for j in js], name=f"{prefix}.direct.{k}", **common)
        for j, tensor in zip(js, alone):
            out[present[j]] = tensor
    return out


class DistributedGradientTape:
    """``hvd.DistributedGradientTape`` with fusion buffers: ``gradient()`` differentiates with the
    wrapped ``tf.GradientTape``, then reduces every gradient with :func:`fused_allreduce` (sparse
    gradients as dense). Other attributes are the wrapped tape's.

    ``DistributedGradientTape(tape, compression=ALQCompressor(bits=3), op=hvd.Average,
    fusion_bytes=None, process_set=None)``."""

    def __init__(
        self,
        gradtape: tf.GradientTape,
        compression: QuantizedCompressor,
        *,
        op=None,
        fusion_bytes=None,
        process_set=None,
    ) -> None:
        self._tape = gradtape
        self._reduce = dict(compression=compression, op=op, fusion_bytes=fusion_bytes, process_set=process_set)

    def gradient(self, target, sources, output_gradients=None, **keywords):
        """The wrapped tape's gradients of ``target`` with respect to ``sources`` (any nest),
        averaged (or summed) over the ranks in fusion buffers."""
        grads = self._tape.gradient(target, sources, output_gradients, **keywords)
        flat = tf.nest.flatten(grads, expand_composites=False)
        return tf.nest.pack_sequence_as(grads, fused_allreduce(flat, **self._reduce))

    def __getattr__(self, name: str):
        return getattr(self._tape, name)
