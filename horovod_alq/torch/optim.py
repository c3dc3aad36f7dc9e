"""AdamW whose second moment stops changing after a warm-up (1-bit Adam's schedule, for quantized
exchanges).

Quantization noise adds to every coordinate's squared gradient, so AdamW's second moment ``v``
grows with it and its steps shrink; error feedback makes that worse, since it trades a smaller
accumulated error for a larger error per step. Freezing ``v`` after ``freeze_step`` steps (1-bit
Adam, Tang et al. 2021) keeps the scale learned during the warm-up, and from then on the update is
linear in the gradients, as SGD with momentum's is::

    from horovod_alq.torch import ALQCompressor, FrozenVarianceAdamW
    opt = FrozenVarianceAdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1, freeze_step=30)
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), compression=ALQCompressor(bits=2))

Until ``freeze_step`` it is ``torch.optim.AdamW`` (the same update, to rounding). ``freeze_step``
lives in each parameter group, as the other hyperparameters do, so Horovod's
``DistributedOptimizer``, which builds the optimizer again from its groups, keeps it.
"""

from __future__ import annotations

import torch


class FrozenVarianceAdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay) whose second moment is frozen after ``freeze_step`` steps."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, freeze_step=100):
        if isinstance(freeze_step, bool) or not isinstance(freeze_step, int) or freeze_step < 1:
            raise ValueError(
                f"freeze_step must be a positive int (steps that update the second moment), got {freeze_step!r}"
            )
        if not (isinstance(betas, (tuple, list)) and len(betas) == 2 and all(0 <= b < 1 for b in betas)):
            raise ValueError(f"betas must be two numbers in [0, 1), got {betas!r}")
        if not lr >= 0 or not eps > 0 or not weight_decay >= 0:
            raise ValueError(f"need lr >= 0, eps > 0 and weight_decay >= 0, got {lr!r}, {eps!r}, {weight_decay!r}")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, freeze_step=freeze_step)
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            (b1, b2), lr, freeze = group["betas"], group["lr"], int(group["freeze_step"])
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise ValueError("FrozenVarianceAdamW does not take sparse gradients")
                st = self.state[p]
                if not st:
                    st.update(step=0, exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
                st["step"] += 1
                t = st["step"]
                p.mul_(1 - lr * group["weight_decay"])
                st["exp_avg"].lerp_(p.grad, 1 - b1)
                if t <= freeze:
                    st["exp_avg_sq"].mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                denom = (st["exp_avg_sq"] / (1 - b2 ** min(t, freeze))).sqrt_().add_(group["eps"])
                p.addcdiv_(st["exp_avg"], denom, value=-lr / (1 - b1**t))
        return loss
