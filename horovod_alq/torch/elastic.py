"""Elastic Horovod support: the compressors' state in ``hvd.elastic.TorchState``.

Importing this module registers a state handler for :class:`~horovod_alq.torch.QuantizedCompressor`
with Horovod's (public) handler registry, so a compressor passed as a keyword is saved with every
``state.commit()``, restored on a reset and broadcast from rank 0 when workers join::

    import horovod_alq.torch.elastic  # noqa: F401  (registers the handler)
    state = hvd.elastic.TorchState(model, optimizer, compressor=compression)

On a reset the round in progress is dropped (its exchange will never complete) and the next round
starts from the committed levels and counters, identical on every rank after ``sync()``, which
sends rank 0's levels, counters and seed to every rank; each process keeps its own error-feedback
buffers (they hold what its own quantizations dropped: rank 0's would be applied N times). A reset
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
        self.save()

    def save(self) -> None:
        self._saved = _this_process(copy.deepcopy(self.value.state_dict()))

    def restore(self) -> None:
        self.value.reset()
        self.value.load_state_dict(self._saved)

    def sync(self) -> None:
        self.value.reset()
        own = _this_process(self.value.state_dict())
        shared = broadcast_object(_feedback_of(own, None), root_rank=0)
        self.value.load_state_dict(_feedback_of(shared, own))
        self.save()


def _feedback_of(state: dict, source: dict | None) -> dict:
    """``state`` with the error-feedback buffers of ``source`` (None: without any), at the top and
    in each process set's state."""
    out = {k: v for k, v in state.items() if k not in ("error_feedback", "process_sets")}
    if source is not None and "error_feedback" in source:
        out["error_feedback"] = source["error_feedback"]
    if "process_sets" in state:
        theirs = {} if source is None else source.get("process_sets", {})
        out["process_sets"] = {key: _feedback_of(s, theirs.get(key, {})) for key, s in state["process_sets"].items()}
    return out


def _this_process(state: dict) -> dict:
    """Mark the error-feedback buffers of ``state`` as this process's whatever rank it has after a
    reset (a reset may renumber the ranks; the buffers stay this process's own)."""
    if "error_feedback" in state:
        state["error_feedback"] = {**state["error_feedback"], "owner": "any"}
    for s in state.get("process_sets", {}).values():
        _this_process(s)
    return state


def register() -> None:
    """Add the handler to Horovod's registry (idempotent; done on import)."""
    registry = _state.get_handler_registry()
    if not any(cls is CompressorStateHandler for _, cls in registry):
        _state.set_handler_registry([(QuantizedCompressor, CompressorStateHandler), *registry])


register()
