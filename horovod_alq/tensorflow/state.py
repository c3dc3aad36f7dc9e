"""A TensorFlow compressor's round state in ``tf.Variable`` s: the levels and their header mask, the
seed, :class:`~horovod_alq.core.rounds.RoundState`'s counters and the pending statistics, so that a
traced step reads and writes them, and ``tf.train.Checkpoint`` saves them. The schedule (which
rounds collect), the refit and the schema of ``metrics()`` / ``state_dict()`` are the core's
``RoundState``; this module only moves values between it and the variables."""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from ..core import protocol
from ..core.methods import get_method
from ..core.rounds import COUNTERS, RoundState
from ..core.statistics import statistics_length
from ..core.wire import HEADER_SIZE, Header, pack_header
from .auto import AutoVariables
from .feedback import FeedbackVariables, SavedRows
from .graph import header_mask, signed64


class RoundVariables(tf.Module):
    """The variables of one compressor's rounds over ``state`` (a :class:`RoundState`, which stays
    the schema) with rounding seed ``seed``. One variable per counter, so that compress, decompress
    and the refit write different variables (tf.function orders the ops that use one variable)."""

    _TF_MODULE_IGNORED_PROPERTIES = frozenset(tf.Module._TF_MODULE_IGNORED_PROPERTIES | {"state", "method"})

    def __init__(self, state: RoundState, seed: int) -> None:
        super().__init__(name="round_state")
        self.state = state
        self.method = get_method(state.quantizer.method)
        self.stats_length = statistics_length(self.method)
        q = state.quantizer
        #: bits="auto": the allocation and every width's levels (None with fixed bits)
        self.auto = None if state.auto is None else AutoVariables(state.auto, self.stats_length)
        #: what a refit round adds to a tensor's vector: its statistics, or (auto) its row
        self.row_length = self.stats_length if self.auto is None else self.auto.row_length
        #: error_feedback: the error buffers (None without)
        self.feedback = None if state.feedback is None else FeedbackVariables(q.bucket_size)
        if state.feedback is not None:  # the variables are the buffers: the state holds their rows
            state.feedback = SavedRows()
        with tf.init_scope():
            self.levels = tf.Variable(q.levels, dtype=tf.float64, trainable=False, name="levels")
            self.header_mask = tf.Variable(
                header_mask(self._fingerprint()), dtype=tf.int32, trainable=False, name="header_mask"
            )
            self.seed = tf.Variable(signed64(seed), dtype=tf.int64, trainable=False, name="seed")
            self.counters = {key: tf.Variable(0, dtype=tf.int64, trainable=False, name=key) for key in COUNTERS}
            self.current = tf.Variable(0, dtype=tf.int64, trainable=False, name="current_round")
            self.pending = tf.Variable(
                np.zeros(self.stats_length), dtype=tf.float64, trainable=False, name="pending_statistics"
            )
            self.pending_count = tf.Variable(0, dtype=tf.int64, trainable=False, name="pending_count")
        #: the second quantizer's levels adapt (two-phase exchanges, ``adapt_second``; fixed bits)
        self.adapts_second = bool(state.adapt_second and self.method.adaptive and self.auto is None)
        if self.adapts_second:
            q2 = state.second
            with tf.init_scope():
                self.second_levels = tf.Variable(q2.levels, dtype=tf.float64, trainable=False, name="second_levels")
                self.second_mask = tf.Variable(
                    header_mask(q2.fingerprint), dtype=tf.int32, trainable=False, name="second_header_mask"
                )
                self.pending_second = tf.Variable(
                    np.zeros(self.stats_length), dtype=tf.float64, trainable=False, name="pending_second_statistics"
                )
                self.pending_second_count = tf.Variable(0, dtype=tf.int64, trainable=False, name="pending_second_count")

    # ------------------------------------------------------------------ in the step (TF ops)
    def count(self, **values) -> dict:
        """Add ``values`` (ints or tensors) to the named counters; returns their values after it."""
        return {key: self.counters[key].assign_add(tf.cast(value, tf.int64)) for key, value in values.items()}

    def header(self, numel: int, second: bool = False, bits: int | None = None) -> tf.Tensor:
        """Header of a payload of ``numel`` elements (the second quantization's with ``second``;
        ``bits``: of that width, ``bits="auto"``)."""
        st = self.state
        q = st.auto.quantizers[bits] if bits is not None else st.second if second else st.quantizer
        own = second and bits is None and not st.follows_first  # levels of its own
        fixed = own and not self.adapts_second  # fixed levels of their own: a static header
        static = np.frombuffer(
            pack_header(
                Header(self.method.id, q.bits, q.bucket_size, numel, q.fingerprint if fixed else 0, norm=q.norm)
            ),
            np.uint8,
        ).astype(np.int32)
        if fixed:
            return tf.constant(static.astype(np.uint8))
        mask = self.second_mask if own else self.header_mask
        return tf.cast(tf.bitwise.bitwise_xor(tf.constant(static), mask.read_value()), tf.uint8)

    def second_levels_now(self) -> tf.Tensor:
        """The second quantizer's current levels (fixed bits, not following the first)."""
        if self.adapts_second:
            return self.second_levels.read_value()
        return tf.constant(self.state.second.levels, tf.float64)

    def collecting_second(self, current: tf.Tensor):
        """Whether round ``current`` gathers the owners' statistics for the second quantizer (the
        round after each refit of the first, :attr:`RoundState.collecting_second`); None if its
        levels do not adapt."""
        if not self.adapts_second:
            return None
        schedule = self.state.schedule
        return _flag(lambda step: step > 0 and schedule.collects(step - 1), current, "horovod_alq_collects_second")

    def keep_second(self, collecting, statistics) -> tf.Tensor:
        """When ``collecting`` (a bool tensor; None: never), add ``statistics()`` (the owners'
        reduced statistics) to the second quantizer's pending ones; the op to depend on."""
        if collecting is None:
            return tf.constant(False)

        def keep():
            with tf.control_dependencies(
                [self.pending_second.assign_add(statistics()), self.pending_second_count.assign_add(1)]
            ):
                return tf.constant(True)

        return tf.cond(collecting, keep, lambda: tf.constant(False))

    def collecting(self, current: tf.Tensor) -> tf.Tensor:
        """Whether round ``current`` gathers statistics for a refit (the core's refit schedule)."""
        return _flag(self.state.schedule.collects, current, "horovod_alq_collects")

    def begin_round(self) -> None:
        """Refit from the previous round's statistics (if it collected any); the round's index is the
        number of completed rounds. A round completes in decompress, so a round that failed before it
        on every rank (Horovod's own errors) or on some (a rank that passed the tensor uncompressed)
        is begun again by the next call, on every rank alike. Refitting is idempotent: a rank that
        refit in the failed round and one that refits in the next fit the same statistics."""
        if self.auto is not None:

            def refit_auto():
                with tf.control_dependencies(
                    self.auto.refit(self.levels, self.header_mask)
                    + [self.counters["level_updates"].assign_add(1), self.pending_count.assign(0)]
                ):
                    return tf.constant(True)

            tf.cond(self.pending_count > 0, refit_auto, lambda: tf.constant(False))
        elif self.method.adaptive:
            self._refit_from(self.state.quantizer, self.levels, self.header_mask, self.pending, self.pending_count)
        if self.adapts_second:
            q2 = self.state.second
            self._refit_from(q2, self.second_levels, self.second_mask, self.pending_second, self.pending_second_count)
        self.current.assign(self.counters["step"])

    def _fingerprint(self) -> int:
        """What the payload headers' levels fingerprint hashes: the levels, or (``bits="auto"``)
        every width's levels and the allocation."""
        st = self.state
        return st.quantizer.fingerprint if st.auto is None else st.auto.fingerprint()

    def _refit_from(self, q, levels: tf.Variable, mask: tf.Variable, pending: tf.Variable, count: tf.Variable) -> None:
        """When ``count`` > 0: fit quantizer ``q`` (the NumPy core, deterministic: identical inputs
        give identical levels on every rank) to the ``pending`` statistics, store its levels in
        ``levels`` and their header mask in ``mask``, count the update, clear the statistics."""

        def fit(current: np.ndarray, stats: np.ndarray):
            q.set_levels(current)
            updated = bool(np.isfinite(stats).all() and stats[0] > 0)  # else no finite non-zero bucket seen
            if updated:
                q.adapt(stats)
            return q.levels, header_mask(q.fingerprint), np.int64(updated)

        def refit():
            new, new_mask, updated = tf.numpy_function(
                fit, [levels.read_value(), pending.read_value()], [tf.float64, tf.int32, tf.int64], stateful=True,
                name="horovod_alq_refit",
            )  # fmt: skip
            new.set_shape(levels.shape)
            new_mask.set_shape([HEADER_SIZE])
            with tf.control_dependencies(
                [
                    levels.assign(new),
                    mask.assign(new_mask),
                    self.counters["level_updates"].assign_add(tf.reshape(updated, [])),
                    pending.assign(tf.zeros_like(pending)),
                    count.assign(0),
                ]
            ):
                return tf.constant(True)

        tf.cond(count > 0, refit, lambda: tf.constant(False))

    def complete(
        self,
        out: tf.Tensor,
        round_index: tf.Tensor,
        collecting,
        statistics,
        slot: int = 0,
        key: tuple[int, int] = (0, 0),
    ) -> tf.Tensor:
        """``out``, once round ``round_index`` counts as completed and, when ``collecting``, the
        round's reduced ``statistics`` (a callable giving them) were added to the pending ones
        (``bits="auto"``: as the row of the tensor of ``key`` in ``slot``)."""
        with tf.control_dependencies([self.counters["step"].assign(round_index + 1)]):
            out = tf.identity(out)
        if collecting is None:
            return out

        def keep():
            row = statistics()
            add = [self.pending.assign_add(row)] if self.auto is None else self.auto.add(slot, key, row)
            with tf.control_dependencies(add + [self.pending_count.assign_add(1)]):
                return tf.constant(True)

        kept = tf.cond(collecting, keep, lambda: tf.constant(False))
        with tf.control_dependencies([kept]):
            return tf.identity(out)

    # ------------------------------------------------------------------ between steps (eager)
    def read(self) -> RoundState:
        """The :class:`RoundState` with the variables' levels and counters."""
        st = self.state
        st.quantizer.set_levels(self.levels.numpy())
        if self.auto is not None:
            self.auto.read()  # (the quantizer is the default width's, with the same levels)
        if self.adapts_second:
            st.second.set_levels(self.second_levels.numpy())
        if self.feedback is not None:
            st.feedback.load_state_dict(self.feedback.state())
        st.refitted_first()
        for key, var in self.counters.items():
            setattr(st, key, int(var.numpy()))
        return st

    def state_dict(self) -> dict:
        """:meth:`RoundState.state_dict` with the seed and the pending statistics, as Python values."""
        out = {
            "seed": int(self.seed.numpy()) & protocol.MASK64,
            **self.read().state_dict(),
            "pending_statistics": self.pending.numpy(),
            "pending_count": int(self.pending_count.numpy()),
        }
        if self.auto is not None:
            out.update(self.auto.pending_state())
        if self.adapts_second:
            out["pending_second_statistics"] = self.pending_second.numpy()
            out["pending_second_count"] = int(self.pending_second_count.numpy())
        return out

    def load_state_dict(self, state: dict) -> None:
        """Restore a :meth:`state_dict` (validated by :meth:`RoundState.load_state_dict`)."""
        pending = np.asarray(state.get("pending_statistics", np.zeros(self.stats_length)), dtype=np.float64)
        if pending.shape != (self.stats_length,):
            raise ValueError(f"pending_statistics has shape {pending.shape}, expected ({self.stats_length},)")
        st = self.read()
        st.load_state_dict(state)  # validates method, norm, bits, bucket size and levels
        if self.auto is not None:
            self.auto.load_pending(state)
            self.auto.assign_from_auto()  # (the quantizer is the default width's)
        if self.feedback is not None:
            self.feedback.load(st.feedback.state_dict())
        st.refitted_first()
        self.levels.assign(st.quantizer.levels)
        self.header_mask.assign(header_mask(self._fingerprint()))
        for key, var in self.counters.items():
            var.assign(getattr(st, key))
        self.seed.assign(signed64(int(state["seed"])))
        self.pending.assign(pending)
        self.pending_count.assign(int(state.get("pending_count", 0)))
        if self.adapts_second:
            second = np.asarray(state.get("pending_second_statistics", np.zeros(self.stats_length)), np.float64)
            if second.shape != (self.stats_length,):
                raise ValueError(f"pending_second_statistics has shape {second.shape}, expected ({self.stats_length},)")
            self.second_levels.assign(st.second.levels)
            self.second_mask.assign(header_mask(st.second.fingerprint))
            self.pending_second.assign(second)
            self.pending_second_count.assign(int(state.get("pending_second_count", 0)))


def _flag(test, current: tf.Tensor, name: str) -> tf.Tensor:
    """``test(round)`` of the round index ``current`` (a schedule's answer, on the host) as a bool scalar."""
    flag = tf.numpy_function(lambda step: np.bool_(test(int(step))), [current], tf.bool, stateful=False, name=name)
    flag.set_shape([])
    return flag
