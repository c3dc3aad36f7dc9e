"""Elastic Horovod support: the compressors' state in ``hvd.elastic.TorchState``.

Importing this module registers a state handler for :class:`~horovod_alq.torch.QuantizedCompressor`
with Horovod's (public) handler registry, so a compressor passed as a keyword is saved with every
``state.commit()``, restored on a reset and broadcast from rank 0 when workers join::

    import horovod_alq.torch.elastic  # noqa: F401  (registers the handler)
    state = hvd.elastic.TorchState(model, optimizer, compressor=compression)

On a reset the round in progress is dropped (its exchange will never complete) and the next round
starts from the committed levels and counters, identical on every rank after ``sync()``. A reset
for removed workers (``HostsUpdatedInterrupt``) calls neither ``restore()`` nor ``sync()``: the
compressor itself notices that Horovod's rank or size changed and drops its old round and transport.
Tested with real resets in tests/torch/test_elastic_reset.py.
"""

from __future__ import annotations

import copy

from horovod.torch.elastic import state as _state
from horovod.torch.functions import broadcast_object

from .compressor import QuantizedCompressor


class CompressorStateHandler(_state.StateHandler):
    """Saves, restores and synchronizes a compressor through its ``state_dict``."""

    def __init__(self, compressor: QuantizedCompressor) -> None:
        super().__init__(compressor)
        self._saved = copy.deepcopy(compressor.state_dict())

    def save(self) -> None:
        self._saved = copy.deepcopy(self.value.state_dict())

    def restore(self) -> None:
        self.value.reset()
        self.value.load_state_dict(self._saved)

    def sync(self) -> None:
        self.value.reset()
        self.value.load_state_dict(broadcast_object(self.value.state_dict(), root_rank=0))
        self.save()


def register() -> None:
    """Add the handler to Horovod's registry (idempotent; done on import)."""
    registry = _state.get_handler_registry()
    if not any(cls is CompressorStateHandler for _, cls in registry):
        _state.set_handler_registry([(QuantizedCompressor, CompressorStateHandler), *registry])


register()
