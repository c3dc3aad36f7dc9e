"""The per-coordinate scale ``w`` of preconditioned quantization for the torch front-ends
(``precondition=``, :mod:`horovod_alq.core.precondition`): from an Adam-family optimizer's second
moment, or from a callable.

    compression = ALQCompressor(bits=3, precondition=optimizer)        # Horovod: the optimizer that steps
    state = ALQState(bits=3, precondition=optimizer)                   # DDP hook
    state = ALQState(bits=3, precondition=Preconditioner(fn, parameters=model.parameters()))

``w`` is computed once per round for every parameter the source knows, from the state the last
optimizer step left (the same on every rank, since every rank applied the same averaged
gradients), and its digest goes into the round's handshake.
"""

from __future__ import annotations

import math
import weakref
from typing import Callable, Iterable

import numpy as np
import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from ..core import precondition as core
from ..core.precondition import Form

__all__ = ["Form", "Preconditioner", "adam_scale", "preconditioner_from"]

_NO_SECOND_MOMENT = (
    "precondition takes an Adam-family optimizer (AdamW, Adam, FrozenVarianceAdamW: a second moment "
    "'exp_avg_sq' per parameter) or a callable giving each parameter a scale; {kind} keeps no second "
    "moment. SGD needs none: its update is linear in the gradient, so the gradient-space error ALQ "
    "already minimizes is the error it sees. Leave precondition unset"
)


def adam_scale(
    v_hat: torch.Tensor,
    form: Form,
    eps: float = 0.0,
    bucket_size: int | None = None,
    n: float = math.inf,
    correction: float = 1.0,
) -> torch.Tensor:
    """:func:`horovod_alq.core.precondition.adam_scale` in torch (float32, on ``v_hat``'s device) of
    ``v_hat / correction`` (Adam's bias correction, folded into the first pass); in place after
    that pass, which alone allocates."""
    v = v_hat.detach()
    a, b = 1.0 / correction, 0.0
    if form.prior > 0 and v.numel() and math.isfinite(n):
        a, b = a * n / (n + form.prior), form.prior * float(v.float().mean()) / correction / (n + form.prior)
    root = (v.float() * a + b if (a, b) != (1.0, 0.0) else v.float().clone()).sqrt_()
    floor = max(form.floor * float(root.mean()) if root.numel() else 0.0, float(eps))
    w = root.add_(floor if floor > 0 else float(np.finfo(np.float32).tiny)).reciprocal_()
    if form.alpha != 1:
        w = w.pow_(form.alpha)
    if form.cap is not None and bucket_size:
        flat = w.reshape(-1)
        pad = (-flat.numel()) % bucket_size
        b = torch.cat([flat, flat.new_full((pad,), float("inf"))]).view(-1, bucket_size)
        low = b.min(dim=1, keepdim=True).values
        w = torch.minimum(b, low * form.cap).reshape(-1)[: flat.numel()].view_as(w)
    return w


class Preconditioner:
    """``w`` for each parameter of ``source``: an Adam-family ``torch.optim.Optimizer`` (its
    ``exp_avg_sq``, ``max_exp_avg_sq`` with ``amsgrad``, bias-corrected as it does; ``eps`` from its
    groups), or a callable ``fn(parameter) -> tensor of its shape`` (then ``parameters=`` lists
    them). ``names``: parameter -> name, for errors (``model.named_parameters()``).

    ValueError at construction for an optimizer without a second moment (SGD: refused, not the
    identity, so that a setting that does nothing is never silently on); when a scale is computed,
    for a callable's scale of a wrong shape, or any scale holding zeros, negative values, NaN or
    Inf, naming the tensor."""

    def __init__(
        self,
        source,
        *,
        parameters: Iterable[torch.Tensor] | None = None,
        form: Form | None = None,
        names=None,
        bucket_size: int | None = None,
    ) -> None:
        self.form = Form() if form is None else form
        if not isinstance(self.form, Form):
            raise ValueError(f"form must be a horovod_alq.core.precondition.Form, got {type(form).__name__}")
        self.bucket_size = bucket_size
        self.optimizer = source if isinstance(source, torch.optim.Optimizer) else None
        if self.optimizer is None and not callable(source):
            raise ValueError(f"precondition takes an Adam-family optimizer or a callable, got {type(source).__name__}")
        if self.optimizer is not None:
            groups = self.optimizer.param_groups
            if not all("betas" in g and "eps" in g for g in groups):
                raise ValueError(_NO_SECOND_MOMENT.format(kind=type(self.optimizer).__name__))
            self.params = [p for g in groups for p in g["params"]]
            self._groups = {id(p): g for g in groups for p in g["params"]}  # also the follower's: same dicts
            self._follow_steps(groups)
        else:
            if parameters is None:
                raise ValueError("precondition with a callable needs parameters= (the tensors it scales)")
            self.params = list(parameters)
        self.fn: Callable | None = None if self.optimizer is not None else source
        self._names = {id(p): n for n, p in (names or ())}
        self._index = {id(p): i for i, p in enumerate(self.params)}
        self._key = self._block = None
        self._scales: dict[int, torch.Tensor | None] = {}
        self._by_grad: dict[int, int] = {}
        self.digest = 0
        self.active = False  # some parameter's w this round is not the identity

    def _follow_steps(self, groups) -> None:
        """Read the state of whichever optimizer steps these parameter groups: hvd.DistributedOptimizer
        builds a new optimizer over the same group dicts, with a state of its own."""
        self._first_group = groups[0] if groups else None
        _FOLLOWING.add(self)
        if not _HOOK:
            _HOOK.append(register_optimizer_step_post_hook(_follow))

    def name(self, p: torch.Tensor) -> str:
        i = self._index.get(id(p))
        return self._names.get(id(p)) or f"parameter {i} (shape {tuple(p.shape)})"

    # ------------------------------------------------------------------ one round
    def prepare(self, key) -> int:
        """Compute ``w`` of every parameter for the round ``key`` (once per key) and return the
        digest of them all (the handshake's ``precondition`` field); :attr:`active` then says
        whether any ``w`` departs from the identity."""
        if key == self._key:
            return self.digest
        block = None if key is None else key // self.form.every
        if block is not None and block == self._block and any(w is not None for w in self._scales.values()):
            self._key = key  # the block's w stands
            return self.digest
        self._block = block
        self._scales = {i: self._compute(p) for i, p in enumerate(self.params)}
        self.active = any(w is not None for w in self._scales.values())
        self._by_grad = {}
        self.digest = core.combine(_digest(w, i) if w is not None else 0 for i, w in self._scales.items())
        self._key = key
        return self.digest

    def scale(self, p: torch.Tensor) -> torch.Tensor | None:
        """``w`` of parameter ``p`` this round (None: the identity, or not a parameter it knows)."""
        i = self._index.get(id(p))
        return None if i is None else self._scales.get(i)

    def for_gradient(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """``w`` of the parameter whose ``.grad`` is ``tensor`` (Horovod's compressors get gradients
        only); None if no known parameter's gradient is that tensor."""
        i = self._by_grad.get(id(tensor))
        if i is None or self.params[i].grad is not tensor:
            self._by_grad = {id(p.grad): k for k, p in enumerate(self.params) if p.grad is not None}
            i = self._by_grad.get(id(tensor))
        return None if i is None else self._scales.get(i)

    def _compute(self, p: torch.Tensor) -> torch.Tensor | None:
        if self.fn is not None:
            w = self.fn(p)
            if not isinstance(w, torch.Tensor):
                w = torch.as_tensor(np.asarray(w))
            if w.numel() != p.numel():
                raise ValueError(
                    f"precondition scale of {self.name(p)} has shape {tuple(w.shape)}, the tensor {tuple(p.shape)}"
                )
            w = w.detach().to(device=p.device, dtype=torch.float32).reshape(p.shape)
        else:
            w = self._from_optimizer(p)
            if w is None:
                return None
        bad = core._problem(w.cpu().numpy()) if not bool(torch.isfinite(w).all() and (w > 0).all()) else None
        if bad:
            raise ValueError(f"precondition scale of {self.name(p)} {bad}")
        return w

    def _from_optimizer(self, p: torch.Tensor) -> torch.Tensor | None:
        opt = self.optimizer
        st = opt.state.get(p)
        if not st:  # no step taken yet: the identity
            return None
        group = self._groups[id(p)]
        key = "max_exp_avg_sq" if group.get("amsgrad") else "exp_avg_sq"
        if key not in st:
            raise ValueError(
                f"precondition: {type(opt).__name__} keeps no {key!r} for {self.name(p)} "
                "(it needs Adam's second moment)"
            )
        t = int(st["step"]) if "step" in st else 0
        if t < self.form.start:
            return None
        b2 = float(group["betas"][1])
        if "freeze_step" in group:  # FrozenVarianceAdamW: v stops at freeze_step
            t = min(t, int(group["freeze_step"]))
        n = core.samples(t, b2)
        return adam_scale(st[key], self.form, float(group["eps"]), self.bucket_size, n, correction=1 - b2**t)


def _digest(w: torch.Tensor, key: int) -> int:
    """:func:`horovod_alq.core.precondition.digest` of ``w``, copying only its sample off the device."""
    idx = torch.from_numpy(core.sample_indices(w.numel())).to(w.device)
    return core.digest_sample(w.reshape(-1)[idx].cpu().numpy(), w.numel(), key)


_FOLLOWING: weakref.WeakSet = weakref.WeakSet()  # the preconditioners that read an optimizer's state
_HOOK: list = []  # the one global step hook, registered at the first use


def _follow(opt, args, kwargs) -> None:
    for pre in list(_FOLLOWING):
        if opt is not pre.optimizer and opt.param_groups and opt.param_groups[0] is pre._first_group:
            pre.optimizer = opt


def preconditioner_from(source, bucket_size: int | None = None) -> Preconditioner | None:
    """The :class:`Preconditioner` of a ``precondition=`` setting (an optimizer, a callable with
    ``parameters``: pass a Preconditioner; None: off)."""
    if source is None or isinstance(source, Preconditioner):
        return source
    if isinstance(source, torch.optim.Optimizer):
        return Preconditioner(source, bucket_size=bucket_size)
    raise ValueError(
        "precondition takes an Adam-family torch optimizer, a horovod_alq.torch.Preconditioner "
        f"(for a callable: Preconditioner(fn, parameters=...)), or None; got {type(source).__name__}"
    )
