"""The TensorFlow plumbing of one tensor's exchange: its errors, the codec's cached ``tf.function`` s,
header bytes and seeds as tensors, the guard that runs a collective only after every rank's check
passed, and the gradient connection. No compressor state lives here."""

from __future__ import annotations

import functools
import types
import zlib

import numpy as np
import tensorflow as tf

from ..core import protocol
from ..core.statistics import GRID
from ..core.wire import HEADER_SIZE
from . import kernels


class ProtocolError(protocol.ProtocolError, tf.errors.FailedPreconditionError):
    """horovod_alq's protocol error in TensorFlow: a ``RuntimeError`` and, as Horovod's own errors
    there, a ``tf.errors.FailedPreconditionError`` (eagerly; inside ``tf.function`` TensorFlow
    reports any error raised in Python code as ``UnknownError``, with the same message)."""

    def __init__(self, message: str) -> None:
        tf.errors.FailedPreconditionError.__init__(self, None, None, message)
        self.args = (message,)


class ReductionMismatch(ProtocolError, protocol.ReductionMismatch):
    """:class:`horovod_alq.core.protocol.ReductionMismatch` in TensorFlow (see :class:`ProtocolError`)."""


def tf_error(err: protocol.ProtocolError) -> ProtocolError:
    """The core's error as this module's class of the same name (a FailedPreconditionError too)."""
    return (ReductionMismatch if isinstance(err, protocol.ReductionMismatch) else ProtocolError)(str(err))


def hvd():
    """horovod.tensorflow, imported on first use so that the kernels work without Horovod."""
    import horovod.tensorflow as hvd

    return hvd


def signed64(z: int) -> int:
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


def outermost_graph():
    """The graph of the outermost function being traced (cond/while branches are nested graphs)."""
    graph = tf.compat.v1.get_default_graph()
    while hasattr(graph, "outer_graph") and hasattr(graph.outer_graph, "outer_graph"):
        graph = graph.outer_graph
    return graph


@functools.cache
def codec(bits: int, bucket_size: int, norm: str, jit_compile: bool) -> types.SimpleNamespace:
    """The codec of one configuration as ``tf.function`` s: ``encode(tensor, levels, header, seed)``,
    ``decoder(numel, ranks)(gathered, levels, scale)``, ``normless(tensor)``, ``grid(tensor)`` and
    ``histograms(tensor)`` (``bits="auto"``)
    (shared by compressors of one configuration: one trace and XLA compile per tensor shape)."""
    opts = dict(bits=bits, bucket_size=bucket_size)
    keep = dict(experimental_attributes={"_noinline": True})
    encode = tf.function(
        functools.partial(kernels.encode, norm=norm, unrolled=jit_compile, **opts),
        autograph=False,
        jit_compile=jit_compile,
        **keep,
    )
    decoders: dict = {}

    def decoder(numel: int, ranks: int):
        if (numel, ranks) not in decoders:
            decoders[numel, ranks] = tf.function(
                functools.partial(kernels.decode_sum, ranks=ranks, numel=numel, **opts),
                autograph=False,
                jit_compile=jit_compile,
                **keep,
            )
        return decoders[numel, ranks]

    return types.SimpleNamespace(
        encode=tf.function(encode, autograph=False, **keep),
        decoder=decoder,
        normless=tf.function(
            functools.partial(kernels.normless_statistics, bucket_size=bucket_size, norm=norm), autograph=False
        ),
        grid=tf.function(
            functools.partial(kernels.grid_statistics, grid=GRID, bucket_size=bucket_size, norm=norm), autograph=False
        ),
        histograms=tf.function(
            functools.partial(kernels.grid_histograms, grid=GRID, bucket_size=bucket_size, norm=norm), autograph=False
        ),
    )


def part_seed(seed: tf.Tensor, part: int, phase: int) -> tf.Tensor:
    """The ``[key, counter]`` seed of one shard's encoding in one phase of the two-phase exchange.
    Bit 63 keeps the key's input apart from a rank key's (``rank + 1``): owner 0's second-phase
    draws were rank 1's first-phase draws of shard 0 without it (found by tests/test_conformance.py)."""
    key = signed64(protocol.splitmix64((1 << 63) | (int(part) << 2) | int(phase)))
    return tf.stack([tf.bitwise.bitwise_xor(seed[0], tf.constant(key, tf.int64)), seed[1]])


def guarded(ok, run, check, args, numel: int, eager: bool):
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


def control(vector: tf.Tensor) -> tf.Tensor:
    """The vector ``compress`` hands the allreduce, shaped ``(length, 1)``
    (:func:`horovod_alq.core.protocol.control_shape`; the length may be known at run time only)."""
    return tf.reshape(vector, [-1, 1])


def passthrough(tensor: tf.Tensor):
    """``tensor`` shaped as it enters the allreduce uncompressed
    (:func:`horovod_alq.core.protocol.passthrough_shape`: never the control vector's shape), and what
    :func:`restore` needs: None (sent as it is), True (one trailing 1 added) or, for a shape not
    fully known while traced, the tensor's shape at run time (the rule is then applied in the graph)."""
    shape = tensor.shape
    if shape.rank is not None and shape.is_fully_defined():
        grown = len(protocol.passthrough_shape(shape.as_list())) > shape.rank
        return (tf.expand_dims(tensor, -1), True) if grown else (tensor, None)
    dims = tf.shape(tensor)
    grow = tf.logical_and(tf.size(dims) >= 2, tf.reduce_all(tf.equal(dims[-1:], 1)))
    return tf.reshape(tensor, tf.concat([dims, tf.ones(tf.cast(grow, tf.int32)[None], tf.int32)], 0)), dims


def restore(tensor: tf.Tensor, how, shape: tf.TensorShape) -> tf.Tensor:
    """The reduced uncompressed tensor in the shape :func:`passthrough` took it in (static ``shape``)."""
    if how is None:
        return tensor
    out = tf.squeeze(tensor, [-1]) if how is True else tf.reshape(tensor, how)
    if not tf.executing_eagerly():
        out.set_shape(shape)
    return out


def refuse(tensor: tf.Tensor, message: str, shape: tf.TensorShape, dtype: tf.DType) -> tf.Tensor:
    """Raise ``message`` once the allreduce of ``tensor`` is over (in a graph: when it has run)."""
    if tf.executing_eagerly():
        raise ProtocolError(message)

    def raise_(_):
        raise ProtocolError(message)

    bad = tf.numpy_function(raise_, [tensor], dtype, stateful=True, name="horovod_alq_not_member")
    return tf.reshape(bad, shape)


def connect_gradient(source, out, scale, process_set):
    """``out`` with a gradient to ``source``: Horovod's own allreduce gradient (an exact sum of the
    incoming gradients over the process set, times the op's ``scale``), as for an uncompressed
    ``hvd.allreduce``. Without it a tape would see the quantized output as a constant and give zero
    gradients."""
    if source is None or not source.dtype.is_floating:
        return out

    @tf.custom_gradient
    def connected(x):
        def grad(dy):
            summed = hvd().allreduce(dy, op=hvd().Sum, process_set=process_set)
            return summed * tf.cast(scale, dy.dtype)

        return tf.identity(out), grad

    return connected(source)
