"""``wire="entropy"`` at the transport: every payload collective of every exchange moves rANS-coded
frames (:mod:`horovod_alq.core.entropy`) and hands the exchange back the fixed-length bytes.

:class:`EntropyTransport` wraps a :class:`~.interfaces.Transport`. What an exchange sends to a peer
(an alltoall split, or its allgather contribution) is re-coded on the host; what it receives is
decoded to exactly the bytes the fixed wire would have delivered, so plans, checks, decoding and the
results are those of the fixed wire, byte for byte. Coded sizes are known only after coding: a
transport that gathers blocks of any size by itself (Horovod: ``variable_sizes``) sends them as
they are; the others first exchange the sizes (8 bytes per peer) on the same transport.

A frame that does not decode raises on every rank where every rank received it (allgather); in an
alltoall only its receiver has it, so the receiver substitutes ``0xFF`` bytes, which fail the
exchange's own payload check there (bad magic), and the exchange's poisoning makes every rank raise;
a warning names the frame and what was wrong with it.
"""

from __future__ import annotations

import importlib
import importlib.util
import warnings
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from ..core import entropy
from ..core.protocol import PREFIX, ProtocolError
from .interfaces import Tensor, TensorOps, Transport

_TRIED_COMPILED = False


def load_compiled_coder() -> str:
    """Serve the coder with the compiled CPU codec where torch is installed and it loads (once per
    process; the torch front-ends load it anyway); returns :func:`~horovod_alq.core.entropy.kernel_name`."""
    global _TRIED_COMPILED
    if entropy.kernel_name() == "numpy" and not _TRIED_COMPILED:
        _TRIED_COMPILED = True
        if importlib.util.find_spec("torch") is not None:
            importlib.import_module("horovod_alq.torch.codecs.cpu_build").load()
    return entropy.kernel_name()


@dataclass
class WireBytes:
    """What this rank's payload collectives sent: ``wire_fixed_bytes`` before coding,
    ``wire_coded_bytes`` on the wire (:class:`~horovod_alq.core.rounds.RoundState` has both)."""

    wire_fixed_bytes: int = 0
    wire_coded_bytes: int = 0


def _sizes_bytes(sizes: Sequence[int]) -> np.ndarray:
    return np.asarray(sizes, dtype="<i8").view(np.uint8)


class EntropyTransport:
    """``transport`` with its payload collectives on the entropy wire (``ops``: the framework's
    host/device conversions; ``counter``: where the bytes sent are added, a :class:`WireBytes` or
    a round state)."""

    def __init__(self, transport: Transport, ops: TensorOps, counter=None) -> None:
        self.inner, self.ops = transport, ops
        self.counter = WireBytes() if counter is None else counter
        self.variable = bool(getattr(transport, "variable_sizes", False))
        load_compiled_coder()

    def __getattr__(self, name: str):  # rank, size, local_size, scope, ... of the wrapped transport
        return getattr(self.inner, name)

    def allreduce_sum(self, vec: np.ndarray, name: str) -> np.ndarray:
        return self.inner.allreduce_sum(vec, name)

    def allreduce_max(self, vec: np.ndarray, name: str) -> np.ndarray:
        return self.inner.allreduce_max(vec, name)

    def _code(self, host: np.ndarray) -> np.ndarray:
        coded = entropy.encode_wire(host)
        self.counter.wire_fixed_bytes += int(host.size)
        self.counter.wire_coded_bytes += int(coded.size)
        return coded

    def _peer_sizes(self, mine: Sequence[int], name: str, gather: bool) -> list[int]:
        """Every rank's coded size (``gather``: of its one block), or what each rank sends to this one."""
        n = self.inner.size
        if gather:
            got = self.inner.allgather(self.ops.from_numpy(_sizes_bytes(mine)), [8] * n, f"{name}.sizes")()
        else:
            got = self.inner.alltoall(self.ops.from_numpy(_sizes_bytes(mine)), [8] * n, [8] * n, f"{name}.sizes")()
        return np.ascontiguousarray(self.ops.to_numpy(got)).view("<i8").tolist()

    def _decoded(self, got: Tensor, sizes, expected: Sequence[int], own: tuple, name: str, gather: bool):
        """The fixed bytes of every rank's frames, back to back in ``got`` (``sizes``: each rank's
        coded bytes, or None: cut after each rank's ``expected`` fixed bytes, read from the frames'
        headers). ``own``: this rank's (fixed bytes, frames it sent): where its share of ``got`` is
        those frames, it is those fixed bytes, not decoded again."""
        host = np.ascontiguousarray(self.ops.to_numpy(got))
        parts, pos = [], 0
        for r, want in enumerate(expected):
            try:
                end = pos + sizes[r] if sizes is not None else self._delimit(host, pos, want)
                if r == self.inner.rank and np.array_equal(host[pos:end], own[1]):
                    part = own[0]
                else:
                    part = entropy.decode_wire(host[pos:end])
                    if part.size != want:
                        raise ValueError(f"frames decode to {part.size} bytes, the exchange expects {want}")
                pos = end
            except ValueError as err:
                if gather:
                    raise ProtocolError(f"{PREFIX}: {name}: rank {r}'s entropy-coded payloads: {err}") from None
                self._warn(r, name, err)
                part = np.full(want, 0xFF, dtype=np.uint8)
                pos = host.size if sizes is None else pos + sizes[r]  # without sizes the rest is lost
            parts.append(part)
        return self.ops.from_numpy(np.concatenate(parts) if parts else np.zeros(0, np.uint8))

    @staticmethod
    def _delimit(host: np.ndarray, pos: int, want: int) -> int:
        """The end of the frames from ``pos`` whose headers add up to ``want`` decoded bytes."""
        got = 0
        while got < want:
            size, decoded = entropy.frame_sizes(host, pos)
            pos, got = pos + size, got + decoded
        if got != want:
            raise ValueError(f"frames decode to more bytes than the {want} the exchange expects")
        return pos

    @staticmethod
    def _warn(rank: int, name: str, err: Exception) -> None:
        warnings.warn(f"{PREFIX}: {name}: rank {rank}'s entropy-coded payloads do not decode ({err})", RuntimeWarning)

    def allgather(self, payload: Tensor, sizes: Sequence[int], name: str) -> Callable[[], Tensor]:
        host = np.array(self.ops.to_numpy(payload), dtype=np.uint8, copy=True).ravel()  # kept: this rank's share
        coded = self._code(host)
        peer = None if self.variable else self._peer_sizes([coded.size], name, True)
        wait = self.inner.allgather(self.ops.from_numpy(coded), peer or [coded.size] * self.inner.size, name)
        return lambda: self._decoded(wait(), peer, [int(s) for s in sizes], (host, coded), name, True)

    def alltoall(self, payload: Tensor, splits: Sequence[int], received: Sequence[int], name: str):
        host = np.ascontiguousarray(self.ops.to_numpy(payload)).ravel()
        bounds = np.concatenate([[0], np.cumsum([int(s) for s in splits])]).astype(np.int64)
        me = self.inner.rank
        own = host[bounds[me] : bounds[me + 1]].copy()  # this rank's share of its own alltoall: not coded
        coded = [
            entropy.raw_frame(own) if j == me and own.size else self._code(host[bounds[j] : bounds[j + 1]])
            for j in range(len(splits))
        ]
        own_frames = coded[me] if me < len(coded) else np.zeros(0, np.uint8)
        out_splits = [c.size for c in coded]
        peer = None if self.variable else self._peer_sizes(out_splits, name, False)
        body = np.concatenate(coded) if coded else np.zeros(0, np.uint8)
        wait = self.inner.alltoall(self.ops.from_numpy(body), out_splits, peer or out_splits, name)
        return lambda: self._decoded(wait(), peer, [int(r) for r in received], (own, own_frames), name, False)


def on_wire(transport: Transport, ops: TensorOps | None, wire: str, counter) -> Transport:
    """``transport`` as the ``wire`` format needs it (the fixed wire: itself)."""
    if wire == "fixed" or ops is None or isinstance(transport, EntropyTransport):
        return transport
    return EntropyTransport(transport, ops, counter)
