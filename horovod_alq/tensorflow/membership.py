"""A TensorFlow compressor's process set as seen from this rank: the set's size, this rank's place
in it (read from Horovod once: a set's membership does not change), its node layout and the error
of a rank outside it."""

from __future__ import annotations

from ..exchange.topology import resolve_local_size
from . import graph


class SetMembership:
    """Mixed into :class:`~horovod_alq.tensorflow.compressor.QuantizedCompressor`, which sets
    ``process_set`` and ``_set_cache = None``."""

    def _set_info(self) -> tuple[int, int]:
        """(size, rank in the set), read from Horovod once (a set's membership does not change)."""
        if self._set_cache is None:
            size = self.process_set.size()
            if size is None:
                raise ValueError(
                    f"horovod_alq: the compressor's process set {self.process_set} is not "
                    f"registered with Horovod (hvd.init(process_sets=...) or hvd.add_process_set)"
                )
            self._set_cache = (int(size), int(self.process_set.rank()) if self._is_member() else -1)
        return self._set_cache

    def _set_size(self) -> int:
        return self._set_info()[0]

    def _set_rank(self) -> int:
        return self._set_info()[1]

    def _local_size(self) -> int:
        """Ranks per node of the set (:func:`horovod_alq.exchange.topology.resolve_local_size`):
        ``$HOROVOD_ALQ_LOCAL_SIZE``, else Horovod's local size for the global set (when its nodes
        are runs of consecutive ranks), else one node. Read at each compress (traced: once)."""
        hvd, (size, rank) = graph.hvd(), self._set_info()
        launcher = (hvd.local_size(), hvd.local_rank()) if self.process_set.process_set_id == 0 else None
        return resolve_local_size(size, rank, launcher)

    def _is_member(self) -> bool:
        ranks = self.process_set.ranks
        return not ranks or graph.hvd().rank() in ranks

    def _outsider_message(self) -> str:
        return (
            f"horovod_alq: rank {graph.hvd().rank()} is not in the compressor's process set (ranks "
            f"{self.process_set.ranks}): pass this compressor only to allreduces over that set "
            f"(hvd.allreduce(..., process_set=ps), hvd.DistributedGradientTape(..., process_set=ps))"
        )
