"""Error feedback: what a rank's quantization dropped, added to what it quantizes next time.

Every quantization a rank performs keeps its error ``e = x - decode(encode(x))`` under a key
naming what was quantized: its own values of a buffer range (the first phase of every flat
exchange), or the sums it owns (the two-phase exchange's second quantization, the node sums of the
hierarchical ones). The next round adds ``e`` to the same key's input before encoding it. So every
exchange gets error feedback with nothing extra on the wire; the estimate is no longer unbiased
step by step, but the sum of what was applied stays within one buffer of the sum of the true values.

A key holds the job's identity (the kind of round and its layout's sizes) and the stream range:
when a round's layout changes, the changed parts start again from zero. Buckets whose input holds
NaN or Inf keep their previous error (a skipped step must not absorb a NaN). Buffers are float32, or
bfloat16 to halve their memory (torch tensors only). Ops with an ``encode_feedback`` (the compiled
CPU codec's) do all of it in one pass, with the same results; others take the two passes below.
"""

from __future__ import annotations

import threading
from typing import Hashable

import numpy as np

from ..core.quantizer import Quantizer
from .interfaces import Tensor, TensorOps

#: The dtypes an error buffer may be kept in.
FEEDBACK_DTYPES = ("float32", "bfloat16")


def check_feedback(error_feedback, dtype) -> None:
    """ValueError naming a bad ``error_feedback`` (a bool) or ``error_feedback_dtype``."""
    if not isinstance(error_feedback, bool):
        raise ValueError(f"error_feedback must be True or False, got {error_feedback!r}")
    if dtype not in FEEDBACK_DTYPES:
        raise ValueError(f"error_feedback_dtype must be one of {', '.join(map(repr, FEEDBACK_DTYPES))}, got {dtype!r}")


class ErrorFeedback:
    """The error buffers of one front-end's rounds, by key (see the module docstring)."""

    def __init__(self, dtype: str = "float32", scale: float = 1.0) -> None:
        check_feedback(True, dtype)
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 0 < scale <= 1:
            raise ValueError(f"ErrorFeedback's scale (the share of each error kept) must be in (0, 1], got {scale!r}")
        self.dtype = dtype
        self.scale = float(scale)  # the share of each error kept for the next round
        self.buffers: dict[Hashable, Tensor] = {}
        self._touched: set = set()

    def encode(self, ops: TensorOps, x: Tensor, quantizer: Quantizer, seed: int, key: Hashable) -> Tensor:
        """The payload of ``x`` plus ``key``'s error; ``key``'s error becomes what this payload dropped.
        Runs in place in the key's buffer and a per-thread scratch (no allocation once warm)."""
        n = int(x.shape[0])
        e = self.buffers.get(key)
        e = e if e is not None and int(e.shape[0]) == n else None
        fused = getattr(ops, "encode_feedback", None)
        if fused is not None and not isinstance(x, np.ndarray):  # the compiled codec: one pass, same results
            error = e if e is not None else self._stored(ops.zeros(n))
            payload = fused(x, error, quantizer, seed, self.scale)
            if payload is not None:
                self.buffers[key] = error
                self._touched.add(key)
                return payload
        target, decoded = self._scratch(x, n)
        target[:] = x
        if e is not None:
            target += e  # (a bfloat16 buffer is promoted in place)
        if not _finite(target):  # a bucket with NaN or Inf: keep its previous error (rare: allocate)
            return self._encode_keeping(ops, target, quantizer, seed, key, e)
        payload = ops.encode(target, quantizer, seed)
        decoded[:] = 0
        ops.decode_sum(decoded, payload, [0], quantizer)
        if e is None:
            self.buffers[key] = self._stored(self._scaled(target - decoded))
        elif self.dtype == "float32":
            e[:] = target
            e -= decoded
            self._scaled(e)
        else:  # bfloat16 (torch): the difference in the scratch, rounded into the buffer
            decoded *= -1
            decoded += target
            e.copy_(self._scaled(decoded))
        self._touched.add(key)
        return payload

    def _encode_keeping(self, ops, target, quantizer, seed, key, e) -> Tensor:
        payload = ops.encode(target, quantizer, seed)
        decoded = ops.zeros(int(target.shape[0]))
        ops.decode_sum(decoded, payload, [0], quantizer)
        error = self._scaled(target - decoded)
        d = quantizer.bucket_size
        for b in _bad_buckets(error, d) or ():
            lo, hi = b * d, min((b + 1) * d, int(target.shape[0]))
            error[lo:hi] = 0 if e is None else self._float(e)[lo:hi]
        self.buffers[key] = self._stored(error)
        self._touched.add(key)
        return payload

    def _scaled(self, error: Tensor) -> Tensor:
        """``error`` times the kept share, in place (float32, as the compiled kernel multiplies)."""
        if self.scale != 1.0:
            error *= np.float32(self.scale) if isinstance(error, np.ndarray) else self.scale
        return error

    def _scratch(self, x: Tensor, n: int) -> tuple[Tensor, Tensor]:
        """Two float32 vectors of ``n`` like ``x`` (same framework and device), kept per thread."""
        pool = _SCRATCH.__dict__.setdefault("pool", {})
        kind = "numpy" if isinstance(x, np.ndarray) else str(x.device)
        have = pool.get(kind)
        if have is None or int(have[0].shape[0]) < n:
            make = (lambda: np.empty(n, np.float32)) if kind == "numpy" else (lambda: x.new_empty(n))
            have = pool[kind] = (make(), make())
        return have[0][:n], have[1][:n]

    def zero(self, key: Hashable, lo: int, hi: int) -> None:
        """Zero ``key``'s error on ``[lo, hi)`` of its input (padding between tensors)."""
        e = self.buffers.get(key)
        if e is not None:
            e[lo:hi] = 0

    def forget(self, kind: str) -> None:
        """Drop the buffers of the jobs of ``kind`` (the first element of their keys): quantizations
        whose results the round did not use (early buffers re-exchanged in the fused round)."""
        self.buffers = {k: v for k, v in self.buffers.items() if k[0] != kind}
        self._touched = {k for k in self._touched if k[0] != kind}

    def end_round(self) -> None:
        """Drop the buffers no encode of this round used (parts of a layout that changed)."""
        self.buffers = {k: v for k, v in self.buffers.items() if k in self._touched}
        self._touched = set()

    @property
    def nbytes(self) -> int:
        """Memory held by the buffers."""
        return sum(int(v.shape[0]) * (2 if self.dtype == "bfloat16" else 4) for v in self.buffers.values())

    def state_dict(self) -> dict:
        """The buffers, copied (rounds update them in place)."""
        return {"dtype": self.dtype, "buffers": [(k, _copy(v)) for k, v in self.buffers.items()]}

    def load_state_dict(self, state: dict) -> None:
        """Take the saved buffers (copied: rounds update them in place)."""
        self.buffers = {_key(k): _copy(v) for k, v in state["buffers"]}
        self._touched = set(self.buffers)  # the last round's: kept by the next round's start

    def _stored(self, error: Tensor) -> Tensor:
        if self.dtype == "bfloat16":
            if isinstance(error, np.ndarray):
                raise ValueError("error_feedback_dtype='bfloat16' keeps torch tensors only")
            return error.to(dtype=_torch_dtype("bfloat16"))
        return error

    def _float(self, e: Tensor) -> Tensor:
        return e if isinstance(e, np.ndarray) or self.dtype == "float32" else e.float()


#: Per-thread scratch vectors of :meth:`ErrorFeedback.encode` (encodes may run on several threads).
_SCRATCH = threading.local()


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


def _copy(v: Tensor) -> Tensor:
    return v.copy() if isinstance(v, np.ndarray) else v.clone()


def _key(k):
    """A key as saved (tuples may come back as lists from some formats)."""
    return tuple(_key(v) for v in k) if isinstance(k, (list, tuple)) else k


def _torch_dtype(name: str):
    import torch

    return getattr(torch, name)
