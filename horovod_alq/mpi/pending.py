"""What :class:`~horovod_alq.mpi.QuantizedAllreduce` records between two ``adapt()`` calls: this
rank's statistics (``bits="auto"``: one row per array, and the arrays' keys), its reduced shards'
statistics (two-phase owner) and the calls since the last ``adapt()``; kept in its ``state_dict``,
of which another rank takes neither these nor the random streams (:func:`without_rng`)."""

from __future__ import annotations

import numpy as np


class Pending:
    """This rank's statistics since the last ``adapt()``: ``first`` (a vector, or ``bits="auto"``:
    rows), ``second`` (its reduced shards'), ``keys`` (``bits="auto"``: the recorded arrays) and
    ``calls`` (calls since the last ``adapt()``)."""

    def __init__(self, auto: bool) -> None:
        self.auto = auto
        self.clear()

    def clear(self) -> None:
        self.first: np.ndarray | None = None
        self.second: np.ndarray | None = None
        self.keys: tuple = ()
        self.calls = 0

    def record(self, stats: tuple | None, keys: tuple) -> None:
        """Keep a collecting call's statistics. ``bits="auto"``: its rows (one per array) are added
        to those recorded for the same arrays, and replace those of other arrays."""
        if stats is None:
            return
        if not self.auto:
            self.first = _add(self.first, stats[0])
            self.second = _add(self.second, stats[1])
        elif stats[0] is not None:
            same = self.first is not None and keys == self.keys
            self.first = self.first + stats[0] if same else stats[0]
            self.keys = keys

    def contribution(self, stats, length: int, method: str) -> tuple[np.ndarray | None, Exception | None]:
        """What this rank gives an ``adapt()``: the recorded statistics (``bits="auto"``: rows), or
        ``stats`` checked (shape ``(length,)``, finite); and the error that makes every rank refuse."""
        first = self.first if self.auto else None
        try:
            if self.auto and stats is not None:
                raise ValueError("stats= does not apply to bits='auto' (adapt() fits from the recorded calls)")
            local = None if self.auto else self.first if stats is None else stats
            if local is not None:
                first = np.asarray(local, dtype=np.float64)
                if first.shape != (length,):
                    raise ValueError(f"stats has shape {first.shape}, {method} expects {(length,)}")
                if not np.isfinite(first).all():
                    raise ValueError("stats has non-finite entries")
        except (TypeError, ValueError) as err:
            return first, err
        return first, None

    def state_dict(self) -> dict:
        return {
            "calls_since_adapt": self.calls,
            "pending": None if self.first is None else self.first.copy(),
            "pending_second": None if self.second is None else self.second.copy(),
            "pending_keys": [list(k) for k in self.keys],
        }

    def load_state_dict(self, state: dict, same_rank: bool) -> None:
        """Restore the counter; the statistics only from this rank's own state."""
        self.calls = int(state["calls_since_adapt"])
        self.first = _array(state.get("pending") if same_rank else None)
        self.second = _array(state.get("pending_second") if same_rank else None)
        keys = state.get("pending_keys") if same_rank and self.first is not None else None
        self.keys = tuple(tuple(int(v) for v in k) for k in keys or ())


def _array(values) -> np.ndarray | None:
    return None if values is None else np.array(values, dtype=np.float64)


def _add(total: np.ndarray | None, stats: np.ndarray | None) -> np.ndarray | None:
    return total if stats is None else stats if total is None else total + stats


def without_rng(state: dict) -> dict:
    """``state`` with every quantizer's random generator state left out (another rank's stream)."""
    out = dict(state, quantizer=dict(state["quantizer"], rng=None))
    if state.get("auto") is not None:
        quantizers = {w: dict(q, rng=None) for w, q in state["auto"]["quantizers"].items()}
        out["auto"] = dict(state["auto"], quantizers=quantizers)
    return out
