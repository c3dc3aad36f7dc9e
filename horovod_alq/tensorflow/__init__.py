"""TensorFlow compressors for Horovod's ``compression=``, and the TF kernels of the wire format.

Usage (the compressor is an object with state: create it once, reuse it every step)::

    import horovod.tensorflow as hvd
    from horovod_alq.tensorflow import ALQCompressor

    compression = ALQCompressor(bits=3, bucket_size=8192)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(model(x), y)
        tape = hvd.DistributedGradientTape(tape, compression=compression)
        grads = tape.gradient(loss, variables)
        ...

    hvd.allreduce(tensor, compression=compression)          # eagerly or inside tf.function

What works with TensorFlow 2.21 (Keras 3) and Horovod 0.28.1 (also with ``process_set=`` and ``exchange=``):

* ``hvd.DistributedGradientTape`` and ``hvd.allreduce`` / ``hvd.grouped_allreduce`` with
  ``tf.Variable`` s (custom loops, ``tf.Module``), eagerly and inside ``tf.function``; each tensor
  is exchanged on its own. :class:`DistributedGradientTape` and :func:`fused_allreduce` (here)
  pack the tensors into fusion buffers of ``fusion_bytes`` first (:mod:`.fusion`).
* Keras 3 models in a custom loop: pass the Keras variables' underlying tf.Variables,
  ``[v.value for v in model.trainable_variables]``, to ``tape.gradient``. Passing the Keras 3
  variables themselves fails inside Horovod (``'Variable' object has no attribute 'ref'``).
* Keras ``model.fit``: ``horovod.tensorflow.keras.DistributedOptimizer(opt, compression=...)`` with
  the tf_keras package (Keras 2), selected by ``TF_USE_LEGACY_KERAS=1`` set before TensorFlow is
  imported. Not with Keras 3: Horovod's Keras ``DistributedOptimizer`` wraps a Keras 3 optimizer
  without error, but Keras 3 never calls the Keras 2 hooks it overrides, so ``fit`` runs with no
  allreduce at all (every rank trains alone; the compressor is never called).

State: the compressors are ``tf.Module`` s (``tf.train.Checkpoint(compressor=c)``) and also offer
``state_dict()`` / ``load_state_dict()``; ``metrics()`` reports levels, refits and wire bits.
"""

from .compressor import (
    ALQCompressor,
    AMQCompressor,
    NUQSGDCompressor,
    QSGDCompressor,
    QuantizedCompressor,
    TernGradCompressor,
    compressor_for,
)
from .fusion import DistributedGradientTape, fused_allreduce
from .graph import ProtocolError, ReductionMismatch

__all__ = [
    "ALQCompressor",
    "AMQCompressor",
    "DistributedGradientTape",
    "NUQSGDCompressor",
    "ProtocolError",
    "QSGDCompressor",
    "QuantizedCompressor",
    "ReductionMismatch",
    "TernGradCompressor",
    "compressor_for",
    "fused_allreduce",
]
