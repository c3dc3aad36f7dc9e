"""The exchange engine's transport over an mpi4py communicator (:mod:`horovod_alq.mpi`)."""

from __future__ import annotations

import os

import numpy as np
from mpi4py import MPI

from ..core.protocol import resolve_timeout, wait_for
from ..exchange.topology import resolve_local_size


class MpiTransport:
    """The exchange engine's transport over an mpi4py communicator (collectives pair by call order):
    nonblocking collectives, each wait bounded by ``timeout`` seconds
    (:func:`horovod_alq.core.protocol.resolve_timeout`)."""

    def __init__(self, comm: MPI.Intracomm, timeout: float | None = None) -> None:
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.scope = f"communicator {comm.Get_name() or 'of ' + str(self.size) + ' ranks'}"
        self.timeout = resolve_timeout(timeout)
        self.local_size = _local_size(comm, self.rank, self.size)

    @staticmethod
    def _displacements(counts) -> list[int]:
        return np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64).tolist()

    def _waiter(self, request, buf, name: str):
        def wait():
            wait_for(request.Test, self.timeout, name, self.scope)
            return buf

        return wait

    def allgather(self, payload, sizes, name):
        counts = [int(c) for c in sizes]
        buf = np.empty(sum(counts), dtype=np.uint8)
        request = self.comm.Iallgatherv(
            [np.ascontiguousarray(payload), MPI.BYTE], [buf, (counts, self._displacements(counts)), MPI.BYTE]
        )
        return self._waiter(request, buf, name)

    def alltoall(self, payload, splits, received, name):
        send, recv = [int(c) for c in splits], [int(c) for c in received]
        buf = np.empty(sum(recv), dtype=np.uint8)
        request = self.comm.Ialltoallv(
            [np.ascontiguousarray(payload), (send, self._displacements(send)), MPI.BYTE],
            [buf, (recv, self._displacements(recv)), MPI.BYTE],
        )
        return self._waiter(request, buf, name)

    def _allreduce(self, vec, dtype, op, name):
        out = np.empty(np.shape(vec), dtype=dtype)
        return self._waiter(self.comm.Iallreduce(np.ascontiguousarray(vec, dtype=dtype), out, op=op), out, name)()

    def allreduce_sum(self, vec, name):
        return self._allreduce(vec, np.float64, MPI.SUM, name)

    def allreduce_max(self, vec, name):
        return self._allreduce(vec, np.int64, MPI.MAX, name)


def _local_size(comm, rank: int, size: int) -> int:
    """Ranks per node of ``comm``: ``$HOROVOD_ALQ_LOCAL_SIZE``, else for the world communicator
    the launcher's node layout (Open MPI's ``OMPI_COMM_WORLD_LOCAL_SIZE``, MPICH's
    ``MPI_LOCALNRANKS``) when nodes are runs of consecutive ranks, else ``size`` (one node). Read
    from the environment, not with a collective (``Split_type``), so that nothing here can wait."""
    launcher = None
    if comm.Compare(MPI.COMM_WORLD) in (MPI.IDENT, MPI.CONGRUENT):
        for g_name, r_name in (
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
            ("MPI_LOCALNRANKS", "MPI_LOCALRANKID"),
        ):
            try:
                launcher = int(os.environ[g_name]), int(os.environ[r_name])
                break
            except (KeyError, ValueError):
                continue
    return resolve_local_size(size, rank, launcher)
