"""Preconditioned quantization, framework-free: quantize ``g * w`` and return ``decode(...) / w``
with a per-coordinate scale ``w`` that is the same on every rank (docs/design/design.md,
"Preconditioned quantization").

ALQ's levels minimize the error of what it quantizes. Under Adam the update divides each
coordinate by ``sqrt(v_hat)``, so the error that matters is ``e_i / sqrt(v_hat_i)``; quantizing
``g * w`` with ``w = 1 / (sqrt(v_hat) + floor)`` makes the levels minimize that error. Since ``w``
is deterministic and identical on every rank, ``E[decode(Q(g * w)) / w] = g``: the estimate stays
unbiased. This module holds what every front-end shares: the form of ``w`` (:class:`Form`,
:func:`adam_scale`), the checks of a scale (:func:`check_scale`) and the digest the round's
handshake compares (:func:`digest`).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import numpy as np

__all__ = [
    "Form",
    "adam_scale",
    "check_precondition",
    "check_scale",
    "combine",
    "digest",
    "digest_sample",
    "sample_indices",
    "samples",
]

#: Coordinates of each scale that the digest reads (evenly spaced, both ends included).
DIGEST_SAMPLES = 64
_MASK = (1 << 62) - 1


@dataclass(frozen=True)
class Form:
    """How ``w`` is made from Adam's bias-corrected second moment ``v_hat``:
    ``w = 1 / (sqrt(v_hat) + floor * mean(sqrt(v_hat)))`` per tensor, then ``w ** alpha``, then
    capped at ``cap`` times its smallest value within each quantization bucket; the identity until
    the optimizer has taken ``start`` steps (``v_hat`` then rests on too few gradients).

    The defaults (``floor=0.05, prior=4``) are the form measured in docs/results/precondition_gpt.md
    (the first form, ``floor=0.01`` without ``prior``, is ``Form(floor=0.01, prior=0)``)."""

    floor: float = 0.05
    """Relative floor: a fraction of the tensor's mean ``sqrt(v_hat)`` added to every ``sqrt(v_hat)``
    (never below the optimizer's own ``eps``). Bounds how much a coordinate whose ``v_hat`` is near 0
    (a rare token's embedding row) is magnified."""
    alpha: float = 1.0
    """Partial preconditioning: ``w ** alpha`` (0: none, 1: full)."""
    cap: float | None = None
    """Largest ratio of ``w`` to its smallest value within a quantization bucket; None: no cap."""
    start: int = 1
    """Optimizer steps ``v_hat`` must have seen before ``w`` departs from 1."""
    every: int = 1
    """Rounds between two computations of ``w`` (the round number divided by ``every`` picks the
    block; within a block the first ``w`` computed from an optimizer state is kept): ``w`` costs
    several passes over ``v``, and ``v`` moves slowly. The same on every rank, since ranks count
    rounds alike."""
    prior: float = 4.0
    """Shrinkage of a young ``v_hat``: it is averaged with the tensor's mean ``v_hat`` weighted as
    ``prior`` gradients against the effective number of gradients ``v_hat`` holds
    (:func:`samples`: 1 after one step, ``(1 + beta2) / (1 - beta2)`` in the limit). 0: none."""
    refit: int | None = 0
    """Rounds after the first preconditioned round at which the levels refit outside the schedule,
    from the statistics of ``g * w`` (``RoundState.precondition_round``): 0 refits in that round
    itself, ``K`` once ``v_hat`` has seen ``K`` more steps, None not at all (the schedule's refits
    only). Every rank counts rounds alike, so every rank refits in the same round."""

    def __post_init__(self) -> None:
        if not (isinstance(self.floor, (int, float)) and math.isfinite(self.floor) and self.floor >= 0):
            raise ValueError(f"precondition floor must be a finite number >= 0, got {self.floor!r}")
        if not (isinstance(self.alpha, (int, float)) and 0 <= self.alpha <= 1):
            raise ValueError(f"precondition alpha must lie in [0, 1], got {self.alpha!r}")
        if self.cap is not None and not (isinstance(self.cap, (int, float)) and self.cap >= 1):
            raise ValueError(f"precondition cap must be None or a number >= 1, got {self.cap!r}")
        if isinstance(self.start, bool) or not isinstance(self.start, int) or self.start < 1:
            raise ValueError(f"precondition start must be a positive integer (optimizer steps), got {self.start!r}")
        if isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 1:
            raise ValueError(f"precondition every must be a positive integer (rounds), got {self.every!r}")
        if not (isinstance(self.prior, (int, float)) and math.isfinite(self.prior) and self.prior >= 0):
            raise ValueError(f"precondition prior must be a finite number >= 0, got {self.prior!r}")
        if self.refit is not None and (
            isinstance(self.refit, bool) or not isinstance(self.refit, int) or self.refit < 0
        ):
            raise ValueError(f"precondition refit must be None or an integer >= 0 (rounds), got {self.refit!r}")


def samples(step: int, beta2: float) -> float:
    """The effective number of gradients in Adam's bias-corrected second moment after ``step``
    steps: ``(sum of weights)**2 / (sum of squared weights)`` of its moving average."""
    if step <= 0:
        return 0.0
    if beta2 <= 0:
        return 1.0
    return (1 - beta2**step) ** 2 * (1 + beta2) / ((1 - beta2) * (1 - beta2 ** (2 * step)))


def check_precondition(value):
    """The ``precondition`` setting as given, or ValueError: None (off), an Adam-family optimizer
    (its groups hold ``betas``), or an object with a ``prepare`` method (a front-end's
    preconditioner, e.g. :class:`horovod_alq.torch.Preconditioner`). A bare callable is refused
    here: it needs the parameters it scales (``Preconditioner(fn, parameters=...)``)."""
    if value is None or callable(getattr(value, "prepare", None)):
        return value
    groups = getattr(value, "param_groups", None)
    if groups is not None:
        if not all("betas" in g and "eps" in g for g in groups):
            raise ValueError(
                f"precondition needs an Adam-family optimizer (a second moment per parameter); "
                f"{type(value).__name__} keeps none. SGD's update is linear in the gradient, so the "
                f"gradient-space error ALQ already minimizes is what it sees: leave precondition unset"
            )
        return value
    if callable(value):
        raise ValueError(
            "precondition with a callable needs the parameters it scales: pass "
            "horovod_alq.torch.Preconditioner(fn, parameters=model.parameters())"
        )
    raise ValueError(f"precondition takes an Adam-family optimizer or a Preconditioner, got {type(value).__name__}")


def adam_scale(
    v_hat: np.ndarray, form: Form, eps: float = 0.0, bucket_size: int | None = None, n: float = math.inf
) -> np.ndarray:
    """``w`` (float32, ``v_hat``'s shape) from the bias-corrected second moment ``v_hat`` of one
    tensor holding ``n`` gradients' worth (:func:`samples`) (NumPy; the torch front-ends run the same
    steps in torch, :func:`horovod_alq.torch.precondition.adam_scale`)."""
    v = np.asarray(v_hat, dtype=np.float32)
    if form.prior > 0 and v.size and math.isfinite(n):
        v = (np.float32(n) * v + np.float32(form.prior) * v.mean()) / np.float32(n + form.prior)
    root = np.sqrt(v)
    floor = max(float(form.floor) * float(root.mean()) if root.size else 0.0, float(eps))
    w = 1.0 / (root + np.float32(floor if floor > 0 else np.finfo(np.float32).tiny))
    if form.alpha != 1:
        w = w ** np.float32(form.alpha)
    if form.cap is not None and bucket_size:
        flat = w.reshape(-1)
        pad = (-flat.size) % bucket_size
        b = np.concatenate([flat, np.full(pad, np.inf, np.float32)]).reshape(-1, bucket_size)
        low = b.min(axis=1, keepdims=True)
        flat = np.minimum(b, low * np.float32(form.cap)).reshape(-1)[: w.size]
        w = flat.reshape(w.shape)
    return w.astype(np.float32, copy=False)


def check_scale(name: str, scale, shape) -> np.ndarray:
    """``scale`` as a float32 array of ``shape``, or ValueError naming the tensor ``name``: a wrong
    shape, a NaN or Inf, or a value <= 0 (zeros would make ``decode / w`` infinite)."""
    w = np.asarray(scale)
    if tuple(w.shape) != tuple(shape) and w.size != int(np.prod(shape, dtype=np.int64)):
        raise ValueError(f"precondition scale of {name} has shape {tuple(w.shape)}, the tensor {tuple(shape)}")
    w = w.astype(np.float32, copy=False).reshape(shape)
    problem = _problem(w)
    if problem:
        raise ValueError(f"precondition scale of {name} {problem}")
    return w


def _problem(w: np.ndarray) -> str | None:
    if not np.isfinite(w).all():
        return "holds NaN or Inf"
    if w.size and float(w.min()) <= 0:
        return "holds zeros or negative values (it must be > 0)"
    return None


def digest(w: np.ndarray, key: int = 0) -> int:
    """A cheap digest of one tensor's scale: the bytes of :data:`DIGEST_SAMPLES` evenly spaced
    coordinates (float32), its size and ``key`` (the tensor's place); 62 bits."""
    flat = np.asarray(w, dtype=np.float32).reshape(-1)
    return digest_sample(flat[sample_indices(flat.size)], flat.size, key)


def sample_indices(n: int) -> np.ndarray:
    """The coordinates of a tensor of ``n`` elements that :func:`digest` reads."""
    return np.unique(np.linspace(0, max(n - 1, 0), min(n, DIGEST_SAMPLES)).astype(np.int64))


def digest_sample(sample: np.ndarray, n: int, key: int = 0) -> int:
    """:func:`digest` from the values at :func:`sample_indices` (a device tensor's sample, copied alone)."""
    data = np.ascontiguousarray(np.asarray(sample, dtype=np.float32)).tobytes()
    return int.from_bytes(hashlib.blake2b(data + f"{n}.{key}".encode(), digest_size=8).digest(), "little") & _MASK


def combine(digests) -> int:
    """The digests of a round's scales as one handshake field in ``[1, 2**62)`` (their sum modulo
    ``2**62``, so the order the ranks add tensors in does not matter; 0 means off)."""
    return (sum(int(d) for d in digests) & _MASK) or 1
