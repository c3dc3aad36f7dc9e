"""The checks of one tensor's exchange in TensorFlow: the reduced vector (on the host, with the
core's :func:`~horovod_alq.core.protocol.read_tensor_vector` and two checks of TensorFlow's own)
and the gathered payload headers (in the graph, explained on the host with the exchange's
:func:`~horovod_alq.exchange.payloads.check_host_payloads` when they differ). Every rank checks the
same reduced data, so all pass or all raise."""

from __future__ import annotations

import types

import numpy as np
import tensorflow as tf

from ..core import protocol
from ..core.quantizer import Quantizer
from ..core.wire import HEADER_SIZE, parse_header, payload_size
from ..exchange import payloads
from .graph import ProtocolError, tf_error

#: Vectors of the exchanges that do not gather every payload (two-phase, node-aware) add to the
#: core's tensor vector the sums of ``c`` and ``c**2`` for the 32 bytes of the tensor's first header
#: and ``bits_second``: every rank checks the configurations agree before any payload moves.
CONFIG = HEADER_SIZE + 1
_CONFIG_FIELDS = {
    3: "method",
    4: "bits",
    5: "norm",
    **{i: "bucket_size" for i in range(8, 12)},
    **{i: "levels" for i in range(24, 32)},
    HEADER_SIZE: "bits_second",
}
#: Every control vector ends with ``v = 1 + error_feedback`` and ``v**2``: the ranks agree on it when
#: ``(mean v)**2 == mean v**2`` (no payload header carries it, so this is the only place it is compared).
FEEDBACK = 2


def check_vector(
    reduced: np.ndarray,
    *,
    rank: int,
    size: int,
    slot: int,
    shape_code: int,
    extra: int,
    config: str | None = None,
    layout: int | None = None,
    feedback: int | None = None,
) -> None:
    """The core's checks of the reduced vector (its length against the one compress made, with
    ``extra`` entries after the core's; the op and scale, the process set, shapes and dtypes,
    slots), then TensorFlow's: every rank gave the tensor the same slot (its payload collectives
    are named after it); with ``config`` (the exchange's name), the same configuration bytes ``c``
    (``(mean c)**2 == mean c**2``); with ``layout`` (where the ranks' entries start), the same
    ranks per node; with ``feedback`` (where :data:`FEEDBACK` starts), the same ``error_feedback``.
    Raises when one fails."""
    try:
        read = protocol.read_tensor_vector(reduced, rank=rank, size=size, slot=slot, shape_code=shape_code, extra=extra)
    except protocol.ProtocolError as err:
        raise tf_error(err) from None
    if len(set(read.slots)) > 1:
        raise ProtocolError(
            f"horovod_alq: the ranks exchanged different tensors in one allreduce (their slots in this step, "
            f"in rank order: {list(read.slots)}): the ranks compressed their tensors in different orders "
            f"or different tensors; refusing to decode"
        )
    head = protocol.tensor_vector_length(size)
    if layout is not None:
        # rank r's entry is its ranks per node (Sum: as is; Average: over the size, as reduced[0])
        g = np.rint(reduced[layout : layout + size] * size / reduced[0]).astype(int).tolist()
        if len(set(g)) > 1:
            raise ProtocolError(
                f"horovod_alq: the ranks declare different node layouts (ranks per node, in rank order: {g}); "
                f"every rank must see the same HOROVOD_ALQ_LOCAL_SIZE or launcher layout. Refusing to exchange"
            )
    if feedback is not None:
        v, v2 = (float(x) for x in reduced[feedback : feedback + FEEDBACK] / reduced[0])
        if abs(v * v - v2) > 1e-9 * max(1.0, v2):
            on = int(round((v - 1.0) * size))
            raise ProtocolError(
                f"horovod_alq: the ranks' compressors differ in error_feedback (True on {on} of {size} ranks; "
                f"compared before any payload moved). Every rank must build the compressor with the same "
                f"error_feedback"
            )
    if config is not None:
        w = reduced[head : head + 2 * CONFIG] / reduced[0]
        c, c2 = w[:CONFIG], w[CONFIG:]
        differ = sorted(
            {_CONFIG_FIELDS.get(i, "header") for i in np.flatnonzero(np.abs(c * c - c2) > 1e-9 * np.maximum(1.0, c2))}
        )
        if differ:
            raise ProtocolError(
                f"horovod_alq: the ranks' compressors differ in {', '.join(differ)} ({config} exchange; "
                f"compared before any payload moved). Every rank must build the compressor with the same "
                f"arguments and load the same state"
            )


def payloads_ok(gathered: tf.Tensor, header: tf.Tensor, ranks: int, payload_bytes) -> tuple[tf.Tensor, tf.Tensor]:
    """The in-graph form of :func:`horovod_alq.exchange.payloads.check_payloads`: every rank's payload
    has ``payload_bytes`` (an int, or a tensor for a width chosen at run time) and this rank's
    ``header`` bytes. Also ``gathered`` fitted to exactly ``ranks * payload_bytes`` bytes (cut or
    zero-padded), so that no op fails on a wrong size before the explanation is raised: TF may run
    shape-bound ops of a ``tf.cond`` branch that is not taken."""
    expected = ranks * payload_bytes
    got = tf.size(gathered)
    fitted = tf.pad(gathered[:expected], [[0, tf.maximum(0, expected - got)]])
    if isinstance(expected, int):
        fitted.set_shape([expected])
    rows = tf.reshape(fitted, [ranks, -1])[:, :HEADER_SIZE]
    ok = tf.logical_and(tf.equal(got, expected), tf.reduce_all(tf.equal(rows, header[None, :])))
    return ok, fitted


def explain_payloads(
    gathered: np.ndarray, header: np.ndarray, *, numel: int, ranks: int, quantizer: Quantizer, slot: int
) -> None:
    """Raise :func:`horovod_alq.exchange.payloads.check_host_payloads`'s error, naming the first rank
    whose payload differs from this rank's configuration (``quantizer``'s method, bucket size and
    norm; the bits and the levels' fingerprint of this rank's payload ``header``) when
    :func:`payloads_ok` failed."""
    own = parse_header(np.asarray(header, np.uint8))
    q = types.SimpleNamespace(
        method=quantizer.method,
        bits=own.bits,
        bucket_size=quantizer.bucket_size,
        norm=quantizer.norm,
        fingerprint=own.fingerprint,
        payload_bytes=lambda n: payload_size(n, own.bits, quantizer.bucket_size),
    )
    try:
        payloads.check_host_payloads(gathered, [numel] * ranks, q, f"tensor in slot {slot}")
    except protocol.ProtocolError as err:
        raise tf_error(err) from None
    raise ProtocolError(f"horovod_alq: tensor in slot {slot}: the gathered payload headers differ")
