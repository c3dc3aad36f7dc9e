"""The quantized exchange, written once for every front-end (``docs/design/design.md``, "Exchange").

Three axes vary independently:

* **exchanges** (how payloads travel): each is one module that defines an
  :class:`.descriptor.Exchange`, registered in :data:`.registry.REGISTRY` (which lists them);
* **transports** (how bytes move): Horovod for PyTorch (:mod:`horovod_alq.torch.horovod_transport`),
  mpi4py (:mod:`horovod_alq.mpi.transport`); each is an allgather, an alltoall and two small allreduces;
* **tensor ops** (the codec on the framework's tensors): :class:`.interfaces.TensorOps` (NumPy:
  :class:`.numpy_ops.NumpyOps`; torch: :mod:`horovod_alq.torch.ops`).

:class:`.engine.Engine` drives rounds: it fuses a round's tensors into buckets-aligned buffers,
runs the protocol of :mod:`horovod_alq.core.protocol` and one exchange, and refits the levels.
Every front-end builds its quantizers, round state, seed and engine with
:func:`horovod_alq.settings.configure` from its :class:`~horovod_alq.settings.Settings`;
each exchange's ``plan`` (:mod:`.plan`) is its arithmetic (ranges, payload sizes, wire bytes),
read by its ``steps`` and by TensorFlow, which runs the exchange in its graph.
"""

from .descriptor import Exchange
from .engine import Engine, Entry, resolve_fusion_bytes
from .interfaces import TensorOps, Transport
from .layout import Layout, plan_layout

__all__ = [
    "Engine",
    "Entry",
    "Exchange",
    "Layout",
    "TensorOps",
    "Transport",
    "plan_layout",
    "resolve_fusion_bytes",
]
