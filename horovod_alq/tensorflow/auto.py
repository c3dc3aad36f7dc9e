"""``bits="auto"`` in TensorFlow: the allocation, every width's levels and a refit round's rows in
``tf.Variable`` s, so that a traced step chooses each tensor's width at run time and the refit
(:meth:`~horovod_alq.core.auto_bits.AutoBits.refit`, the NumPy core's) changes it between steps.

A tensor's width is looked up by its slot in the round (its compress call's index) and its key
(elements, shape code): the allocation's width when the allocation's tensor in that slot has the
same key, else the default width (the widest within the budget). Every rank checks the slots and
shapes through the allreduced vector and the widths and levels through the payload headers (the
allocation's hash is in their fingerprint), so ranks that disagree raise, on every rank.

A refit round adds to each tensor's vector its row: the counts on the grid weighted by squared
bucket norms (from which every width's error follows, linear in the counts, so the reduced row is
the ranks' sum) and the method's statistics. The next round begins by allocating and refitting
from the reduced rows, as the PyTorch compressors do.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import tensorflow as tf

from ..core.auto_bits import AUTO_WIDTHS, AutoBits, errors_from_histograms
from ..core.statistics import GRID
from .graph import header_mask

#: Length of a tensor's squared-norm histogram (its row's first part).
HISTOGRAM_LENGTH = 1 + GRID.size


class AutoVariables(tf.Module):
    """The variables of ``bits="auto"`` over ``auto`` (an :class:`AutoBits`, which stays the schema)."""

    _TF_MODULE_IGNORED_PROPERTIES = frozenset(tf.Module._TF_MODULE_IGNORED_PROPERTIES | {"auto"})

    def __init__(self, auto: AutoBits, stats_length: int) -> None:
        super().__init__(name="auto_bits")
        self.auto = auto
        self.row_length = HISTOGRAM_LENGTH + stats_length
        with tf.init_scope():
            self.levels = tf.Variable(self.padded_levels(), dtype=tf.float64, trainable=False, name="width_levels")
            self.keys = tf.Variable(
                np.zeros((0, 2), np.int64), shape=tf.TensorShape([None, 2]), trainable=False, name="allocation_keys"
            )
            self.bits = tf.Variable(
                np.zeros(0, np.int32), shape=tf.TensorShape([None]), trainable=False, name="allocation_bits"
            )
            self.pending = tf.Variable(
                np.zeros((0, self.row_length)),
                shape=tf.TensorShape([None, self.row_length]),
                trainable=False,
                name="pending_rows",
            )
            self.pending_keys = tf.Variable(
                np.zeros((0, 2), np.int64), shape=tf.TensorShape([None, 2]), trainable=False, name="pending_keys"
            )

    def padded_levels(self) -> np.ndarray:
        """Every candidate width's levels (2 to ``bits_max``), row ``w - 2`` holding width ``w``'s
        ``2**w`` levels (zero-padded)."""
        widths = self.auto.widths
        out = np.zeros((len(widths), 2 ** widths[-1]))
        for i, w in enumerate(widths):
            out[i, : 2**w] = self.auto.quantizers[w].levels
        return out

    # ------------------------------------------------------------------ in the step (TF ops)
    def width(self, slot: int, numel: int, shape_code: int) -> tf.Tensor:
        """The width (int32 scalar) of the tensor of key (``numel``, ``shape_code``) in ``slot``."""
        default = tf.constant(self.auto.default, tf.int32)
        bits = tf.concat([self.bits.read_value(), tf.fill([slot + 1], default)], 0)
        keys = tf.concat([self.keys.read_value(), tf.fill([slot + 1, 2], tf.constant(-1, tf.int64))], 0)
        match = tf.reduce_all(tf.equal(keys[slot], tf.constant([numel, shape_code], tf.int64)))
        return tf.where(match, bits[slot], default)

    def add(self, slot: int, key: tuple[int, int], row: tf.Tensor) -> list:
        """Add a reduced ``row`` to the pending rows in ``slot`` (the ops that do it)."""
        rows = self.pending.read_value()
        grow = tf.maximum(slot + 1 - tf.shape(rows)[0], 0)
        rows = tf.tensor_scatter_nd_add(tf.pad(rows, [[0, grow], [0, 0]]), [[slot]], row[None])
        keys = tf.tensor_scatter_nd_update(
            tf.pad(self.pending_keys.read_value(), [[0, grow], [0, 0]]), [[slot]], tf.constant([key], tf.int64)
        )
        return [self.pending.assign(rows), self.pending_keys.assign(keys)]

    def refit(self, default_levels: tf.Variable, mask: tf.Variable) -> list:
        """Allocate and refit from the pending rows; the ops that store the result (and the default
        width's levels in ``default_levels``, the handshake mask in ``mask``) and clear the rows."""
        levels, keys, bits, new_mask = tf.numpy_function(
            self._refit,
            [
                self.levels.read_value(),
                self.keys.read_value(),
                self.bits.read_value(),
                self.pending.read_value(),
                self.pending_keys.read_value(),
            ],
            [tf.float64, tf.int64, tf.int32, tf.int32],
            stateful=True,
            name="horovod_alq_refit_auto",
        )
        levels.set_shape(self.levels.shape)
        keys.set_shape([None, 2])
        bits.set_shape([None])
        new_mask.set_shape(mask.shape)
        i = self.auto.default - AUTO_WIDTHS[0]
        return [
            self.levels.assign(levels),
            self.keys.assign(keys),
            self.bits.assign(bits),
            mask.assign(new_mask),
            default_levels.assign(levels[i, : 2**self.auto.default]),
            self.pending.assign(tf.zeros([0, self.row_length], tf.float64)),
            self.pending_keys.assign(tf.zeros([0, 2], tf.int64)),
        ]

    def _refit(self, levels, keys, bits, rows, row_keys):
        """The NumPy core's allocation and fits (deterministic: identical inputs, identical results)."""
        self.load(levels, keys, bits)
        live = row_keys[:, 0] > 0  # (a slot never completed holds no row)
        rows, row_keys = rows[live], row_keys[live]
        a = self.auto
        if len(rows) and np.isfinite(rows).all():
            errors = errors_from_histograms(rows[:, :HISTOGRAM_LENGTH], [a.quantizers[w].levels for w in a.widths])
            a.refit(
                np.concatenate([errors, rows[:, HISTOGRAM_LENGTH:]], axis=1),
                row_keys[:, 0].tolist(),
                [tuple(int(v) for v in k) for k in row_keys],
            )
        return (
            self.padded_levels(),
            np.array(a.keys, np.int64).reshape(-1, 2),
            np.array(a.bits, np.int32),
            header_mask(a.fingerprint()),
        )

    # ------------------------------------------------------------------ between steps (eager)
    def load(self, levels: np.ndarray, keys: np.ndarray, bits: np.ndarray) -> None:
        """Set the :class:`AutoBits` from the variables' values."""
        a = self.auto
        for i, w in enumerate(a.widths):
            a.quantizers[w].set_levels(levels[i, : 2**w])
        a.keys = tuple(tuple(int(v) for v in k) for k in np.asarray(keys).reshape(-1, 2))
        a.bits = tuple(int(b) for b in bits)

    def read(self) -> AutoBits:
        """The :class:`AutoBits` with the variables' levels and allocation."""
        self.load(self.levels.numpy(), self.keys.numpy(), self.bits.numpy())
        return self.auto

    def assign_from_auto(self) -> None:
        """Store the :class:`AutoBits` (after it was loaded from a state) in the variables."""
        a = self.auto
        self.levels.assign(self.padded_levels())
        self.keys.assign(np.array(a.keys, np.int64).reshape(-1, 2))
        self.bits.assign(np.array(a.bits, np.int32))

    def pending_state(self) -> dict:
        return {"pending_rows": self.pending.numpy(), "pending_keys": self.pending_keys.numpy()}

    def load_pending(self, state: dict) -> None:
        rows = np.asarray(state.get("pending_rows", np.zeros((0, self.row_length))), dtype=np.float64)
        keys = np.asarray(state.get("pending_keys", np.zeros((0, 2))), dtype=np.int64).reshape(-1, 2)
        if rows.ndim != 2 or rows.shape[1] != self.row_length or rows.shape[0] != keys.shape[0]:
            raise ValueError(
                f"pending_rows has shape {rows.shape} for {keys.shape[0]} keys, expected "
                f"({keys.shape[0]}, {self.row_length})"
            )
        self.pending.assign(rows)
        self.pending_keys.assign(keys)


def per_width(width, values: dict, dtype: tf.DType = tf.int64) -> Any:
    """The value of the tensor's width in ``values`` (each candidate width -> int): the one value
    with fixed bits, a ``dtype`` tensor looked up in the table when the width is chosen at run time."""
    if width is None:
        return next(iter(values.values()))
    widths = sorted(values)
    return tf.gather(tf.constant([values[w] for w in widths], dtype), width - widths[0])


def by_width(width, fn, eager: bool, widths: tuple[int, ...] = AUTO_WIDTHS):
    """``fn(bits)`` of the tensor's width: fixed bits, or ``bits="auto"``'s width chosen at run
    time among ``widths`` (consecutive, from 2 to ``bits_max``; eagerly the branch of its value, in
    a graph a ``tf.switch_case`` over every width)."""
    if width is None:
        return fn(None)
    if eager:
        return fn(int(width))
    return tf.switch_case(width - widths[0], [functools.partial(fn, w) for w in widths])


def levels_of(levels: tf.Tensor, bits: int | None) -> tf.Tensor:
    """The levels of width ``bits`` (``bits="auto"``: a row of the padded levels; None: fixed)."""
    return levels if bits is None else levels[bits - AUTO_WIDTHS[0], : 2**bits]
