"""Error feedback under automatic mixed precision: the loss scale of the gradients being quantized."""

from __future__ import annotations

from typing import Callable


def loss_scale_of(scaler) -> Callable[[], float]:
    """The loss-scale reader of a ``torch.amp.GradScaler`` (ValueError for anything else).

    With it, the error buffers are kept in unscaled units (a change of scale does not weigh them
    x2 or x0.5) and a round's errors are committed only if the scaler did not skip the step they
    were made for (its scale dropped): :mod:`horovod_alq.exchange.feedback`."""
    get_scale = getattr(scaler, "get_scale", None)
    if not callable(get_scale) or not callable(getattr(scaler, "update", None)):
        raise ValueError(f"use_grad_scaler takes a torch.amp.GradScaler, got {type(scaler).__name__}")
    return lambda: float(get_scale())
