"""Which parameter a tensor is: the identity under which a rank keeps a tensor's error-feedback
buffer (:mod:`horovod_alq.exchange.feedback`), stable across rounds and processes."""

from __future__ import annotations

from typing import Iterable

import torch


class ParameterNames:
    """Names of a model's parameters (``model.named_parameters()``), looked up from a parameter or
    from the tensor that is its ``.grad`` (what Horovod hands a compressor)."""

    def __init__(self, named_parameters: Iterable[tuple[str, torch.Tensor]]) -> None:
        pairs = list(named_parameters)
        if not pairs or not all(isinstance(n, str) and isinstance(p, torch.Tensor) for n, p in pairs):
            raise ValueError("named_parameters must be (name, parameter) pairs, as model.named_parameters() gives")
        self.params = [p for _, p in pairs]
        self.names = [n for n, _ in pairs]
        self._by_param = {id(p): k for k, p in enumerate(self.params)}
        self._by_grad: dict[int, int] = {}

    def of_parameter(self, p: torch.Tensor) -> str | None:
        k = self._by_param.get(id(p))
        return None if k is None or self.params[k] is not p else self.names[k]

    def of_gradient(self, tensor: torch.Tensor) -> str | None:
        """The name of the parameter whose ``.grad`` is ``tensor`` now; None if none is."""
        k = self._by_grad.get(id(tensor))
        if k is None or self.params[k].grad is not tensor:  # grads are new tensors after zero_grad()
            self._by_grad = {id(p.grad): k for k, p in enumerate(self.params) if p.grad is not None}
            k = self._by_grad.get(id(tensor))
        return None if k is None else self.names[k]


class FirstSeen:
    """Identities for parameters without names (a DDP bucket's): ``"param<k>"`` in the order they
    are first seen, which a model and its DDP configuration fix, like an optimizer's state indices."""

    def __init__(self) -> None:
        self._ids: dict[int, tuple[torch.Tensor, str]] = {}

    def __call__(self, p: torch.Tensor) -> str:
        have = self._ids.get(id(p))
        if have is None or have[0] is not p:
            have = self._ids[id(p)] = (p, f"param{len(self._ids)}")
        return have[1]
