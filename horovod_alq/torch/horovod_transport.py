"""The Horovod transport of the exchange engine (``horovod_alq.exchange``): Horovod collectives over
a process set. The tensor ops on one device are :mod:`horovod_alq.torch.ops`."""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from ..core.protocol import resolve_timeout, wait_for
from ..exchange.topology import resolve_local_size


def hvd():
    """horovod.torch, imported on first use so that the kernels work without Horovod."""
    import horovod.torch as hvd_module

    return hvd_module


class NotMemberError(RuntimeError):
    """This rank is not in the compressor's process set."""


class HorovodTransport:
    """Collectives of :mod:`horovod.torch` over one process set (default: the global one); each
    wait is bounded by ``timeout`` seconds (:func:`horovod_alq.core.protocol.resolve_timeout`)."""

    #: Horovod's allgather and alltoall take blocks of any size from each rank by themselves.
    variable_sizes = True

    def __init__(self, process_set=None, timeout: float | None = None) -> None:
        h = hvd()
        self.process_set = h.global_process_set if process_set is None else process_set
        if not self.process_set.included():
            raise NotMemberError(
                f"horovod_alq: this rank is not a member of the compressor's process set "
                f"{self.process_set.ranks}; use it only in allreduces over that set "
                f"(process_set=), with the same set on every member"
            )
        self.rank = int(self.process_set.rank())
        self.size = int(self.process_set.size())
        ranks = self.process_set.ranks
        self.scope = "global process set" if ranks is None else f"process set {list(ranks)}"
        self.timeout = resolve_timeout(timeout)
        self.local_size = _local_size(h, ranks, self.rank, self.size)
        self.collectives = 0  # collectives this transport started (metrics()["collectives"])

    def _wait(self, handle, name: str):
        wait_for(lambda: hvd().poll(handle), self.timeout, name, self.scope)
        return hvd().synchronize(handle)

    def stale(self) -> bool:
        """Whether Horovod was re-initialized into another world since this transport was made
        (an elastic reset that added or removed workers): its rank or size no longer hold."""
        try:
            return (int(self.process_set.rank()), int(self.process_set.size())) != (self.rank, self.size)
        except Exception:  # not initialized, or no longer a member: certainly not this world
            return True

    def allgather(self, payload: torch.Tensor, sizes: Sequence[int], name: str):
        self.collectives += 1
        handle = hvd().allgather_async(payload, name=name, process_set=self.process_set)
        return lambda: self._wait(handle, name)

    def alltoall(self, payload: torch.Tensor, splits: Sequence[int], received: Sequence[int], name: str):
        self.collectives += 1
        split_tensor = torch.tensor(list(splits), dtype=torch.int32)
        handle = hvd().alltoall_async(payload, splits=split_tensor, name=name, process_set=self.process_set)
        return lambda: self._wait(handle, name)[0]

    def allreduce_sum(self, vec: np.ndarray, name: str) -> np.ndarray:
        return self._allreduce(vec, np.float64, hvd().Sum, name)

    def allreduce_max(self, vec: np.ndarray, name: str) -> np.ndarray:
        return self._allreduce(vec, np.int64, hvd().Max, name)

    def _allreduce(self, vec: np.ndarray, dtype, op, name: str) -> np.ndarray:
        self.collectives += 1
        t = torch.from_numpy(np.ascontiguousarray(vec, dtype=dtype))
        handle = hvd().allreduce_async(t, op=op, name=name, process_set=self.process_set)
        return self._wait(handle, name).numpy()


def _local_size(h, ranks, rank: int, size: int) -> int:
    """Ranks per node of a process set (:func:`~horovod_alq.exchange.topology.resolve_local_size`):
    Horovod's ``local_size()`` and ``local_rank()`` for the global set."""
    return resolve_local_size(size, rank, (int(h.local_size()), int(h.local_rank())) if ranks is None else None)
