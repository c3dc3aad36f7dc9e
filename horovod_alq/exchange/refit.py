"""Refits: every rank combines its statistics with one allreduce and derives the same levels.

:class:`Refitter` serves both round types (:mod:`.fused`, :mod:`.stream`) at the end of a round
that collected statistics, and front-ends that refit on request (mpi4py's ``adapt()``,
:meth:`Refitter.on_request`: a handshake before, a check after, and the previous levels restored
on every rank when any rank failed).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ..core.handshake import REFIT_FIELDS, handshake_vector, read_handshake
from ..core.methods import get_method
from ..core.protocol import PREFIX, CollectiveTimeout, ProtocolError, stable_hash
from ..core.quantizer import Quantizer
from ..core.rounds import RoundState
from ..core.statistics import statistics_length
from .interfaces import Transport
from .job import Job, auto_rows


class RefitError(ProtocolError):
    """:meth:`Refitter.on_request` failed after the statistics were combined (raised on every rank)."""


class Refitter:
    """The refits of one engine's ``quantizer`` and its ``state`` (second quantizer, ``bits="auto"``)."""

    def __init__(self, quantizer: Quantizer, state: RoundState) -> None:
        self.quantizer, self.state = quantizer, state

    def after_job(self, job: Job, collect_first: bool, second_stats: np.ndarray | None, name: str) -> None:
        """A fused round's refit from its job: the statistics the exchange collected, else those of
        the rank's own buffers (first quantizer); ``bits="auto"``: its tensors' rows."""
        k = statistics_length(get_method(job.first.method))
        first = second = None
        if job.collect_first:  # the exchange collected the statistics of what it quantized
            first = np.zeros(k) if job.first_statistics is None else job.first_statistics
        elif collect_first:
            first = sum(
                (job.ops.statistics(job.stream[lo:hi], job.first) for lo, hi in job.layout.buffers), np.zeros(k)
            )
        if job.collect_second:
            second = np.zeros(k) if second_stats is None else second_stats
        self.from_statistics(first, second, job.transport, name)

    def after_auto_job(self, job: Job, keys: tuple, name: str) -> None:
        self.from_rows(auto_rows(self.state.auto, job.ops, job.parts), keys, job.transport, name)

    def from_rows(self, rows: Sequence[np.ndarray], keys: Sequence, transport: Transport, name: str) -> None:
        """``bits="auto"``: one allreduce of every tensor's row (errors per width, statistics; the
        same tensors on every rank), then every rank allocates the widths and refits the levels
        alike (:meth:`~horovod_alq.core.auto_bits.AutoBits.refit`)."""
        st = self.state
        mine = np.stack(rows)
        total = transport.allreduce_sum(mine.ravel(), name).reshape(mine.shape)
        st.auto.refit(total, [k[0] for k in keys], keys)
        st.refitted_first()
        st.level_updates += 1

    def from_statistics(
        self, first: np.ndarray | None, second: np.ndarray | None, transport: Transport, name: str
    ) -> bool:
        """Sum this rank's statistics of the first quantizer (None: zeros) and, when ``second`` is
        given, of the second, over the ranks (one allreduce), then refit both alike on every rank.
        Returns whether any levels changed (False: no rank saw a finite non-zero bucket)."""
        st, q = self.state, self.quantizer
        k = statistics_length(get_method(q.method))
        parts = [np.zeros(k) if first is None else np.asarray(first, dtype=np.float64)]
        if second is not None:
            parts.append(np.asarray(second, dtype=np.float64))
        total = transport.allreduce_sum(np.concatenate(parts), name)
        updated = False
        if total[0] > 0:
            q.adapt(total[:k])
            st.refitted_first()
            updated = True
        if second is not None and total[k] > 0:
            st.second.adapt(total[k:])
            updated = True
        st.level_updates += int(updated)
        return updated

    def on_request(
        self,
        first: np.ndarray | None,
        second: np.ndarray | None,
        transport: Transport,
        *,
        fields: dict,
        requantizes: bool,
        prefix: str,
        error: str | None = None,
        keys: Sequence = (),
    ) -> bool:
        """A refit outside any round. A handshake of :data:`~horovod_alq.core.handshake.REFIT_FIELDS`
        (``fields``, :meth:`.context.RoundContext.handshake_fields`; ``error``, this rank's reason
        not to refit; the hash of ``keys``: :class:`ProtocolError` on every rank), then for adaptive
        methods :meth:`from_statistics` (``first``: this rank's statistics since the last refit,
        ``second``: its two-phase owner statistics; None: nothing recorded) or, with
        ``bits="auto"``, :meth:`from_rows` (``first``: this rank's rows of the tensors ``keys``),
        then a second handshake that every rank fitted and reached the same levels and allocation;
        if not, every rank restores its previous state and raises :class:`RefitError`. Returns
        whether levels changed."""
        q, st, auto = self.quantizer, self.state, self.state.auto
        recorded = stable_hash(tuple(map(tuple, keys))) if auto is not None and len(keys) else 0
        _agree(transport, f"{prefix}.handshake", fields, error, recorded)
        if not get_method(q.method).adaptive:
            return False
        if not (requantizes and st.adapt_second):
            second = None  # nothing to refit it from (the same on every rank: the settings agree)
        elif second is None:
            second = np.zeros(statistics_length(get_method(q.method)))
        previous = (
            q.state_dict(),
            st.second.state_dict(),
            st.level_updates,
            None if auto is None else auto.state_dict(),
        )
        try:
            if auto is None:
                updated = self.from_statistics(first, second, transport, f"{prefix}.statistics")
            else:
                updated = self._from_recorded(first, keys, transport, f"{prefix}.statistics")
            failure = None
        except CollectiveTimeout:
            raise
        except Exception as exc:  # noqa: BLE001 - the check below makes it every rank's
            updated, failure = False, f"{type(exc).__name__}: {exc}"
        try:
            _agree(transport, f"{prefix}.check", fields, failure, recorded)
        except ProtocolError as exc:
            q.load_state_dict(previous[0])
            st.second.load_state_dict(previous[1])
            st.level_updates = previous[2]
            if auto is not None:
                auto.load_state_dict(previous[3])
            if isinstance(exc, CollectiveTimeout):
                raise
            raise RefitError(
                f"{PREFIX}: the refit failed on some rank or the ranks reached different levels "
                f"from the same statistics (do all ranks run the same NumPy and SciPy?); previous "
                f"levels restored: {exc}"
            ) from None
        return updated

    def _from_recorded(self, rows: np.ndarray | None, keys: Sequence, transport: Transport, name: str) -> bool:
        """``bits="auto"`` in :meth:`on_request`: :meth:`from_rows` from this rank's ``rows`` of the
        tensors ``keys`` (none recorded on any rank: nothing to fit); whether anything changed."""
        if not len(keys):
            return False
        auto = self.state.auto
        rows = np.asarray(rows, dtype=np.float64)
        if rows.shape[0] != len(keys):
            raise ValueError(f"{len(rows)} rows recorded for {len(keys)} tensors")
        before = auto.fingerprint()
        self.from_rows(list(rows), keys, transport, name)
        return auto.fingerprint() != before


def _agree(transport: Transport, name: str, fields: dict, error: str | None, recorded: int) -> None:
    vec = handshake_vector(fields=REFIT_FIELDS, error=int(error is not None), recorded=recorded, **fields)
    read_handshake(transport.allreduce_max(vec, name), error, fields=REFIT_FIELDS)
