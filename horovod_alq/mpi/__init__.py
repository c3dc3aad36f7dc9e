"""Quantized averaging of NumPy arrays over an mpi4py communicator, without a deep-learning framework.

For code outside PyTorch and TensorFlow (NumPy simulations, JAX with arrays converted at the
boundary): the payloads of the Horovod compressors, exchanged with MPI collectives::

    ar = QuantizedAllreduce(MPI.COMM_WORLD, method="alq", bits=3, bucket_size=8192)
    mean = ar(grad)    # NumPy in, NumPy out: the average over ranks of the decoded payloads
    w, b = ar([grad_w, grad_b])   # a list of arrays: one round, each array quantized as if alone
    ar.adapt()         # refit the levels from the statistics of every rank since the last adapt()

With ``bits="auto"`` (``bit_budget=``) :meth:`~QuantizedAllreduce.adapt` also chooses a width per
array of the recorded calls' list, used by later calls of the same arrays.

Every call is one streamed round of the exchange engine (:meth:`Engine.open_stream`: a handshake,
then one ``Allgatherv``, or an ``Alltoallv`` and an ``Allgatherv``); :meth:`~QuantizedAllreduce.adapt`
is :meth:`Engine.refit`. Every wait is bounded (``timeout=``). Errors are collective: a bad input,
a rank with another array size or another configuration raises on *every* rank, naming the rank,
and the communicator stays usable. An exception raised outside these calls on one rank leaves the
others waiting until the timeout; run scripts with ``mpiexec python -m mpi4py script.py``.

Modules: :mod:`.allreduce` (:class:`QuantizedAllreduce`), :mod:`.transport` (the engine's transport
over a communicator), :mod:`.pending` (what a call records for :meth:`~QuantizedAllreduce.adapt`).
"""

from .allreduce import QuantizedAllreduce

__all__ = ["QuantizedAllreduce"]
