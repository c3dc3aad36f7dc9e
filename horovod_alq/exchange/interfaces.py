"""The interfaces an exchange runs on: a transport (how bytes move between ranks: an allgather, an
alltoall and two small allreduces) and tensor ops (the codec on a framework's tensors)."""

from __future__ import annotations

from typing import Any, Callable, Protocol, Sequence

import numpy as np

from ..core.quantizer import Quantizer

Tensor = Any  # a framework tensor (torch.Tensor, np.ndarray): sliceable, 1-D where it matters


class Transport(Protocol):
    """How bytes move between the ranks of one process set. Names pair collectives across ranks
    (Horovod); transports that pair by call order (MPI) ignore them."""

    rank: int
    size: int
    local_size: int  # ranks per node: nodes are runs of this many consecutive ranks (size: one node)

    def allgather(self, payload: Tensor, sizes: Sequence[int], name: str) -> Callable[[], Tensor]:
        """Start gathering every rank's uint8 ``payload`` (rank ``r`` sends ``sizes[r]`` bytes);
        the returned function waits and returns the concatenation in rank order."""

    def alltoall(
        self, payload: Tensor, splits: Sequence[int], received: Sequence[int], name: str
    ) -> Callable[[], Tensor]:
        """Start sending ``payload[sum(splits[:j]):][:splits[j]]`` to rank ``j`` and receiving
        ``received[r]`` bytes from every rank ``r``; the function waits and returns them in rank order."""

    def allreduce_sum(self, vec: np.ndarray, name: str) -> np.ndarray:
        """Elementwise sum of a small float64 vector over the ranks."""

    def allreduce_max(self, vec: np.ndarray, name: str) -> np.ndarray:
        """Elementwise maximum of a small int64 vector over the ranks."""


class SingleRank:
    """The :class:`Transport` of a set of one rank: every collective returns this rank's input
    (single-process runs: benchmarks, tests of the round logic)."""

    rank, size, local_size = 0, 1, 1

    def allgather(self, payload, sizes, name):
        return lambda: payload

    def alltoall(self, payload, splits, received, name):
        return lambda: payload

    def allreduce_sum(self, vec, name):
        return np.asarray(vec, dtype=np.float64)

    def allreduce_max(self, vec, name):
        return np.asarray(vec, dtype=np.int64)


class TensorOps(Protocol):
    """The codec and the few tensor operations an exchange needs, on one framework and device."""

    def stream(
        self,
        parts: Sequence[Tensor],
        starts: Sequence[int],
        length: int,
        out: Tensor | None = None,
        padding: Sequence[tuple[int, int]] = (),
    ) -> Tensor:
        """A float32 vector of ``length`` with the flattened ``parts`` at ``starts`` and zeros
        elsewhere: a new one, or ``out`` (stale contents) with its ``padding`` ranges zeroed (the
        parts and the padding cover it)."""

    def zeros(self, n: int) -> Tensor:
        """float32 zeros."""

    def empty(self, n: int) -> Tensor:
        """A float32 vector of ``n`` with undefined contents."""

    def encode(self, x: Tensor, quantizer: Quantizer, seed: int) -> Tensor:
        """One payload (uint8) of the float32 vector ``x`` with the quantizer's levels."""

    def encode_parts(
        self, parts: Sequence[Tensor], starts: Sequence[int], length: int, quantizer: Quantizer, seed: int
    ) -> Tensor | None:
        """The payload that :meth:`encode` gives for ``stream(parts, starts, length)``, read from the
        parts in place; None where the codec cannot (the caller then builds the stream)."""

    def decode_sum(
        self,
        out: Tensor,
        payloads: Tensor,
        offsets: Sequence[int],
        quantizer: Quantizer,
        *,
        start: int = 0,
        numel: int | None = None,
        scale: float = 1.0,
    ) -> None:
        """``out = scale * sum`` over the payloads starting at ``offsets`` (already validated, each of
        ``numel`` coordinates; default ``len(out)``) of their decoded coordinates ``[start, start +
        len(out))``. ``start`` is a multiple of the bucket size whose codes begin on a byte."""

    def statistics(self, x: Tensor, quantizer: Quantizer) -> np.ndarray:
        """The statistics vector of ``x`` for the quantizer's method and norm."""

    def auto_statistics(self, x: Tensor, quantizer: Quantizer) -> tuple[np.ndarray, np.ndarray]:
        """``bits="auto"``: the counts of ``x`` on the grid weighted by squared bucket norms (row 1 of
        :func:`~horovod_alq.core.statistics.grid_histograms`) and its statistics vector."""

    def cat(self, parts: Sequence[Tensor]) -> Tensor:
        """Concatenate uint8 vectors."""

    def as_bytes(self, x: Tensor) -> Tensor:
        """The float32 vector ``x`` as a uint8 vector of its bytes (a view where the framework can)."""

    def from_bytes(self, b: Tensor) -> Tensor:
        """A uint8 vector of float32 bytes as a float32 vector (a view where the framework can)."""

    def to_numpy(self, x: Tensor) -> np.ndarray:
        """A host copy (NumPy)."""

    def from_numpy(self, a: np.ndarray) -> Tensor:
        """A uint8 vector on the ops' device."""
