"""Error feedback in TensorFlow's graph exchanges (:mod:`horovod_alq.exchange.feedback`'s rule).

Every quantization a rank performs in a tensor's exchange keeps its error ``e = x - decode(encode(x))``
in a ``tf.Variable`` under a key naming what was quantized: ``(slot, elements, tag, lo, hi)``, with
``tag`` "own" (the rank's own values, the first phase of the flat exchanges), "sum" (the two-phase
owners' reduced shards) or "node" (the hierarchical owners' node sums) and ``[lo, hi)`` the range of
the tensor. The next round adds ``e`` to the same key's input before encoding it. The variables are
made when a key is first traced (``tf.init_scope``), so ``tf.train.Checkpoint`` saves them and
restores them as they are made; ``state_dict()`` holds them in the PyTorch compressors' layout.
Buckets whose input holds NaN or Inf keep their previous error. Buffers are float32.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

#: The key's parts, as the variables' names join them.
_SEPARATOR = "."


def _name(key: tuple) -> str:
    return _SEPARATOR.join(str(k) for k in key)


class SavedRows:
    """The :class:`~horovod_alq.core.rounds.RoundState`'s error-feedback slot in TensorFlow: the
    rows of :meth:`FeedbackVariables.state` as they are (the variables are the buffers)."""

    def __init__(self) -> None:
        self.rows: dict = {"dtype": "float32", "buffers": []}

    def state_dict(self) -> dict:
        return self.rows

    def load_state_dict(self, state: dict) -> None:
        self.rows = {"dtype": "float32", "buffers": list(state.get("buffers", []))}

    @property
    def nbytes(self) -> int:
        return sum(4 * int(np.size(v)) for _, v in self.rows["buffers"])


class FeedbackVariables(tf.Module):
    """The error buffers of one compressor's tensors (see the module docstring); ``bucket_size``:
    the bucket of the finite check."""

    _TF_MODULE_IGNORED_PROPERTIES = frozenset(tf.Module._TF_MODULE_IGNORED_PROPERTIES | {"keys"})

    def __init__(self, bucket_size: int) -> None:
        super().__init__(name="error_feedback")
        self.bucket_size = int(bucket_size)
        self.buffers: dict[str, tf.Variable] = {}
        self.keys: dict[str, tuple] = {}

    def variable(self, key: tuple, n: int) -> tf.Variable:
        """The buffer of ``key`` (``n`` elements), made (zeros) the first time it is asked for."""
        name = _name(key)
        if name not in self.buffers:
            with tf.init_scope():
                self.buffers[name] = tf.Variable(tf.zeros([n], tf.float32), trainable=False, name=f"error_{name}")
            self.keys[name] = tuple(key)
        return self.buffers[name]

    def encode(self, encode, decode, x: tf.Tensor, levels, header, seed, key: tuple) -> tf.Tensor:
        """``encode(x + e, levels, header, seed)`` with ``e`` the key's buffer, which becomes what
        the payload dropped (``decode(payload, levels)``: this payload alone, unscaled), except in
        buckets whose input is not finite."""
        n = x.shape.num_elements()
        e = self.variable(key, n)
        target = tf.reshape(tf.cast(x, tf.float32), [-1]) + e.read_value()
        payload = encode(target, levels, header, seed)
        dropped = target - decode(payload, levels)
        d = self.bucket_size
        padded = tf.pad(target, [[0, -n % d]])
        finite = tf.reduce_all(tf.math.is_finite(tf.reshape(padded, [-1, d])), axis=1)
        keep = tf.repeat(finite, d)[:n]
        with tf.control_dependencies([e.assign(tf.where(keep, dropped, e.read_value()))]):
            return tf.identity(payload)

    def state(self) -> dict:
        """The buffers as :meth:`horovod_alq.exchange.feedback.ErrorFeedback.state_dict` gives them."""
        return {"dtype": "float32", "buffers": [(self.keys[k], v.numpy().copy()) for k, v in self.buffers.items()]}

    def load(self, state: dict) -> None:
        """Take the buffers of a :meth:`state` (keys of other tensors are made as variables now)."""
        for key, values in state["buffers"]:
            values = np.asarray(values, dtype=np.float32).ravel()
            self.variable(tuple(key), values.size).assign(values)
        saved = {_name(tuple(k)) for k, _ in state["buffers"]}
        for name, var in self.buffers.items():
            if name not in saved:
                var.assign(tf.zeros_like(var))
