"""Error feedback: what a rank's quantization dropped, added to what it quantizes next time.

An error belongs to one rank and to the coordinates it quantized: the buffers are keyed by
``(stage, tensor, a, b)``, coordinates ``[a, b)`` of one tensor named by its front-end (a
parameter's name or another stable identity, never a position in a round), quantized in ``stage``:
``"own"`` for this rank's own values (the first phase of every exchange), or the tag of a sum it
owns (the two-phase exchange's second quantization, the node sums of the hierarchical ones). An
encode of a stream range assembles the errors of the pieces of tensors in it (zeros in padding and
for pieces seen for the first time), adds them to its input, and writes what this payload dropped
into a *pending* buffer of its job. The job's front-end commits it only when the exchange succeeded
(:meth:`ErrorFeedback.commit`); a failed, abandoned or re-exchanged job drops it. So rounds of
different tensors (two arrays that alternate, a DDP bucket rebuild) keep each tensor's own error,
and no error is applied twice or lost to a failure.

Buckets whose input holds NaN or Inf keep their previous error. With a loss scaler
(:attr:`ErrorFeedback.loss_scale`, AMP), errors are kept in unscaled units and a round's errors are
committed at the next encode only if the scale did not drop (a drop means the scaler skipped that
step). Buffers are float32, or bfloat16 to halve their memory (torch tensors only); they follow the
input's device. Ops with an ``encode_feedback`` (the compiled CPU codec's) do the arithmetic in one
pass, with the same results; others take the two passes below. A job holds its pending errors until
it completes: a round in flight holds up to twice the buffers' memory.
"""

from __future__ import annotations

import threading
import warnings
from typing import Callable, Hashable, Sequence

import numpy as np

from ..core.quantizer import Quantizer
from .interfaces import Tensor, TensorOps

#: The dtypes an error buffer may be kept in.
FEEDBACK_DTYPES = ("float32", "bfloat16")

#: One piece of a tensor in an encoded range: (tensor identity, a, b, offset in the range).
Span = tuple[Hashable, int, int, int]


def check_feedback(error_feedback, dtype) -> None:
    """ValueError naming a bad ``error_feedback`` (a bool) or ``error_feedback_dtype``."""
    if not isinstance(error_feedback, bool):
        raise ValueError(f"error_feedback must be True or False, got {error_feedback!r}")
    if dtype not in FEEDBACK_DTYPES:
        raise ValueError(f"error_feedback_dtype must be one of {', '.join(map(repr, FEEDBACK_DTYPES))}, got {dtype!r}")


def spans(idents: Sequence[tuple[Hashable, int, int]], lo: int, hi: int) -> list[Span]:
    """The pieces of the tensors ``idents`` ((identity, start in a stream, elements) rows) in the
    stream's ``[lo, hi)``, as :data:`Span` rows."""
    out = []
    for ident, s, n in idents:
        a, b = max(lo, s), min(hi, s + n)
        if a < b:
            out.append((ident, a - s, b - s, a - lo))
    return out


class Pending:
    """A job's errors, waiting for its exchange to succeed: (stage, spans, error, loss scale) rows."""

    __slots__ = ("rows",)

    def __init__(self) -> None:
        self.rows: list[tuple[str, list[Span], Tensor, float]] = []


class ErrorFeedback:
    """One rank's error buffers, by ``(stage, tensor, a, b)`` (see the module docstring)."""

    def __init__(self, dtype: str = "float32") -> None:
        check_feedback(True, dtype)
        self.dtype = dtype
        #: AMP: a callable giving the loss scale of the gradients being quantized (None: 1)
        self.loss_scale: Callable[[], float] | None = None
        self.owner: tuple[int, int] | None = None  # (rank, size) of the rank whose errors these are
        #: committed errors: (stage, tensor) -> (a, b) -> (buffer, the loss scale it is in units of)
        self._pieces: dict[tuple, dict[tuple[int, int], tuple[Tensor, float]]] = {}
        self._loaded: tuple[int, int] | None = None  # the owner a loaded state named, checked at first use
        self._held: list[Pending] = []  # with a loss scale: succeeded jobs awaiting the next scale
        self._held_scale = 1.0
        self._spare: dict[tuple[str, int], Tensor] = {}  # replaced whole buffers, by (device, size)
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ encoding
    def encode(
        self,
        ops: TensorOps,
        x: Tensor,
        quantizer: Quantizer,
        seed: int,
        stage: str,
        pieces: Sequence[Span],
        pending: Pending,
        owner: tuple[int, int],
    ) -> Tensor:
        """The payload of ``x`` plus the errors of its ``pieces`` (:func:`spans`) kept for
        ``stage``; what the payload dropped goes to ``pending`` (for :meth:`commit`). ``owner``:
        this rank's (rank, size)."""
        scale = self._begin(owner)
        n = int(x.shape[0])
        error = self._assemble(x, stage, pieces, n, scale)
        fused = getattr(ops, "encode_feedback", None)
        if fused is not None and not isinstance(x, np.ndarray):  # the compiled codec: one pass, same results
            payload = fused(x, error, quantizer, seed)
            if payload is not None:
                pending.rows.append((stage, list(pieces), error, scale))
                return payload
        target, decoded = _scratch(x, n)
        target[:] = x
        target += error  # (a bfloat16 buffer is promoted in place)
        payload = ops.encode(target, quantizer, seed)
        decoded[:] = 0
        ops.decode_sum(decoded, payload, [0], quantizer)
        new = target - decoded
        for b in (None if _finite(target) else _bad_buckets(target, quantizer.bucket_size)) or ():
            lo, hi = b * quantizer.bucket_size, min((b + 1) * quantizer.bucket_size, n)
            new[lo:hi] = _float(error)[lo:hi]  # a bucket with NaN or Inf keeps its previous error
        if isinstance(error, np.ndarray) or self.dtype == "float32":
            error[:] = new
        else:
            error.copy_(new)
        pending.rows.append((stage, list(pieces), error, scale))
        return payload

    def _begin(self, owner: tuple[int, int]) -> float:
        """Before an encode: check a loaded state's owner, settle held jobs; the loss scale now."""
        scale = 1.0 if self.loss_scale is None else float(self.loss_scale())
        if not np.isfinite(scale) or scale <= 0:
            raise ValueError(f"horovod_alq: the loss scale must be a positive finite number, got {scale!r}")
        with self._lock:
            if self._loaded is not None:
                if self._loaded != tuple(owner):
                    warnings.warn(
                        f"horovod_alq: the error-feedback buffers were saved by rank {self._loaded[0]} of "
                        f"{self._loaded[1]}, this is rank {owner[0]} of {owner[1]}: each rank's errors are its "
                        "own (save and load one state per rank); error feedback starts from zero",
                        stacklevel=2,
                    )
                    self._pieces = {}
                self._loaded = None
            self.owner = (int(owner[0]), int(owner[1]))
            self._settle(scale)
        return scale

    def _settle(self, scale: float) -> None:
        """Held jobs (with a loss scale) are stored unless the scale dropped since: the scaler backed
        off, so it skipped the step those errors were made for."""
        if self._held:
            held, self._held = self._held, []
            if scale >= self._held_scale:
                for p in held:
                    self._store(p)

    def _assemble(self, x: Tensor, stage: str, pieces: Sequence[Span], n: int, scale: float) -> Tensor:
        """A buffer of ``n`` (this buffer's dtype, ``x``'s device) holding the committed errors of
        ``pieces`` at their offsets, in the units of ``scale``; zeros elsewhere."""
        with self._lock:
            found = [(p, self._pieces.get((stage, p[0]), {}).get((p[1], p[2]))) for p in pieces]
        covered = sum(p[2] - p[1] for p, have in found if have is not None)
        error = self._new(x, n, zeroed=covered < n)
        for (_, a, b, at), have in found:
            if have is None:
                continue
            buf, unit = have
            if not isinstance(buf, np.ndarray) and buf.device != x.device:
                buf = buf.to(x.device)  # a state loaded on another device
            if unit == scale:
                error[at : at + b - a] = buf
            else:
                error[at : at + b - a] = _float(buf) * (scale / unit)
        return error

    def _new(self, x: Tensor, n: int, zeroed: bool) -> Tensor:
        """A vector of ``n`` like ``x`` in the buffers' dtype: one a commit replaced, where one of
        that size is spare (a fresh vector costs its page faults), zeroed if asked, else new zeros."""
        numpy = isinstance(x, np.ndarray)
        if numpy and self.dtype == "bfloat16":
            raise ValueError("error_feedback_dtype='bfloat16' keeps torch tensors only")
        with self._lock:
            buf = self._spare.pop(("numpy" if numpy else str(x.device), n), None)
        if buf is not None:
            if zeroed:
                buf[:] = 0
            return buf
        return np.zeros(n, np.float32) if numpy else x.new_zeros(n, dtype=_torch_dtype(self.dtype))

    # ------------------------------------------------------------------ commits
    def commit(self, pending: Pending) -> None:
        """A job's exchange succeeded: its errors become the committed ones (with a loss scale: at the
        next encode, unless the scale dropped by then)."""
        if not pending.rows:
            return
        with self._lock:
            if self.loss_scale is None:
                self._store(pending)
            else:
                scale = min(row[3] for row in pending.rows)
                self._held_scale = min(self._held_scale, scale) if self._held else scale
                self._held.append(pending)

    def _store(self, pending: Pending) -> None:
        for stage, pieces, error, scale in pending.rows:
            whole = len(pieces) == 1 and pieces[0][3] == 0 and pieces[0][2] - pieces[0][1] == int(error.shape[0])
            for ident, a, b, at in pieces:
                kept = self._pieces.setdefault((stage, ident), {})
                have = kept.get((a, b))
                if whole:
                    if have is not None:  # spare for the next encode of its size
                        self._spare[_kind(have[0])] = have[0]
                    kept[(a, b)] = (error, scale)
                elif have is not None:  # in place: no allocation once warm
                    have[0][:] = error[at : at + b - a]
                    kept[(a, b)] = (have[0], scale)
                else:
                    for old in [k for k in kept if k[0] < b and a < k[1]]:  # the tensor's layout changed
                        del kept[old]
                    kept[(a, b)] = (_copy(error[at : at + b - a]), scale)
            if not whole:  # copied out: the vector serves the next encode of its size
                self._spare[_kind(error)] = error
        pending.rows = []

    # ------------------------------------------------------------------ state
    @property
    def buffers(self) -> dict[tuple, Tensor]:
        """The committed errors by ``(stage, tensor, a, b)`` (in the units of their loss scale)."""
        return {(st, ident, a, b): v for (st, ident), kept in self._pieces.items() for (a, b), (v, _) in kept.items()}

    @property
    def nbytes(self) -> int:
        """Memory held by the committed buffers."""
        return sum(int(v.shape[0]) * (2 if self.dtype == "bfloat16" else 4) for v in self.buffers.values())

    def state_dict(self) -> dict:
        """This rank's buffers in unscaled units (copies), with the (rank, size) they belong to."""
        with self._lock:
            if self.loss_scale is not None:  # the next encode would decide on held jobs: decide now
                self._settle(float(self.loss_scale()))
            rows = [
                ([st, ident, a, b], _unscaled(v, unit))
                for (st, ident), kept in self._pieces.items()
                for (a, b), (v, unit) in kept.items()
            ]
        return {"dtype": self.dtype, "owner": None if self.owner is None else list(self.owner), "buffers": rows}

    def load_state_dict(self, state: dict) -> None:
        """Take saved buffers (copied). Only the rank (and world size) that saved them uses them,
        checked at the next encode: another rank warns and starts from zero; so does a state of
        the position-keyed format (before 2026-12-06). ``owner`` "any": this process's own, kept
        whatever rank it has now (an elastic reset)."""
        rows = list(state.get("buffers", []))
        if rows and not (isinstance(rows[0][0], (list, tuple)) and len(rows[0][0]) == 4):
            warnings.warn(
                "horovod_alq: the error-feedback buffers were saved in the position-keyed format of "
                "earlier versions; error feedback starts from zero",
                stacklevel=3,
            )
            rows = []
        owner = state.get("owner")
        with self._lock:
            self._pieces, self._held = {}, []
            for k, v in rows:
                st, ident, a, b = _key(k)
                self._pieces.setdefault((st, ident), {})[(int(a), int(b))] = (_copy(v), 1.0)
            # owner "any": this process's own buffers, whatever its rank now (Horovod elastic)
            self._loaded = (int(owner[0]), int(owner[1])) if rows and owner not in (None, "any") else None


#: Per-thread scratch vectors of :meth:`ErrorFeedback.encode` (encodes may run on several threads).
_SCRATCH = threading.local()


def _scratch(x: Tensor, n: int) -> tuple[Tensor, Tensor]:
    """Two float32 vectors of ``n`` like ``x`` (same framework and device), kept per thread."""
    pool = _SCRATCH.__dict__.setdefault("pool", {})
    kind = "numpy" if isinstance(x, np.ndarray) else str(x.device)
    have = pool.get(kind)
    if have is None or int(have[0].shape[0]) < n:
        make = (
            (lambda: np.empty(n, np.float32))
            if kind == "numpy"
            else (lambda: x.new_empty(n, dtype=_torch_dtype("float32")))
        )
        have = pool[kind] = (make(), make())
    return have[0][:n], have[1][:n]


def _finite(x: Tensor) -> bool:
    """Whether every value of ``x`` is finite (one sum: NaN and Inf propagate; float64 for NumPy)."""
    if isinstance(x, np.ndarray):
        return bool(np.isfinite(x.sum(dtype=np.float64)))
    return bool(x.sum(dtype=_torch_dtype("float64")).isfinite())


def _bad_buckets(x: Tensor, bucket: int) -> list[int] | None:
    """The buckets of ``x`` holding NaN or Inf, or None when there are none."""
    if isinstance(x, np.ndarray):
        finite = np.isfinite(x)
        if finite.all():
            return None
        bad = ~finite
    else:
        finite = x.isfinite()
        if bool(finite.all()):
            return None
        bad = (~finite).cpu().numpy()
    return sorted({int(i) // bucket for i in np.flatnonzero(bad)})


def _float(e: Tensor) -> Tensor:
    return e if isinstance(e, np.ndarray) or e.dtype == _torch_dtype("float32") else e.float()


def _unscaled(v: Tensor, unit: float) -> Tensor:
    if unit == 1.0:
        return _copy(v)
    out = _float(v) / unit
    return out.astype(np.float32) if isinstance(out, np.ndarray) else out.to(v.dtype)


def _kind(v: Tensor) -> tuple[str, int]:
    return ("numpy" if isinstance(v, np.ndarray) else str(v.device)), int(v.shape[0])


def _copy(v: Tensor) -> Tensor:
    return v.copy() if isinstance(v, np.ndarray) else v.clone()


def _key(k):
    """A key as saved (tuples may come back as lists from some formats)."""
    return tuple(_key(v) for v in k) if isinstance(k, (list, tuple)) else k


def _torch_dtype(name: str):
    import torch

    return getattr(torch, name)
