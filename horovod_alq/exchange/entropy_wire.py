"""``wire="entropy"`` at the transport: every payload collective of every exchange moves rANS-coded
frames (:mod:`horovod_alq.core.entropy`) and hands the exchange back the fixed-length bytes.

:class:`EntropyTransport` wraps a :class:`~.interfaces.Transport`. What an exchange sends to a peer
(an alltoall split, or its allgather contribution) is re-coded on the host; what it receives is
decoded to exactly the bytes the fixed wire would have delivered, so plans, checks, decoding and the
results are those of the fixed wire, byte for byte. Coded sizes are known only after coding: a
transport that gathers blocks of any size by itself (Horovod: ``variable_sizes``) sends them as
they are; the others first exchange the sizes (8 bytes per peer) on the same transport.

Failures raise on every rank, the sender included (``docs/design/entropy_wire.md``, Guarantees):

* a sender checks its allgather frames before it sends them (:func:`~.entropy.verify_wire`: raw
  frames compared, coded frames decoded, as every receiver will decode them); frames that do not
  decode to its bytes, or a coder that raises, make it send a *refused* frame naming the error in
  their place, so every rank, itself included, raises :class:`ProtocolError` naming it;
* every frame carries the CRC-32 of its decoded bytes, so a frame that decodes to other bytes than
  its sender coded raises where it is decoded, never a silent disagreement;
* the decoder checks the decoded sizes a frame states against the bytes the exchange expects before
  it allocates; any decode failure (MemoryError included) is a protocol error naming the frame;
* in an allgather every rank decodes the same frames and raises; in an alltoall only a frame's
  receiver has it, so the receiver (and a sender that refused one of its frames, for its own share)
  substitutes ``0xFF`` bytes, which fail the exchange's own payload check there (bad magic), and the
  exchange's poisoning makes every rank raise; a warning names the frame and what was wrong. Bytes
  that have no payload check (the hierarchical node sums) ask :meth:`EntropyTransport.undecoded`.

``bytes_sent`` / ``bytes_received`` of the counter (the round state) are the coded bytes: the
exchange counts the fixed bytes of each collective, this transport adds what coding changed (the
8-byte size exchanges are not counted, like the handshake). ``wire_fixed_bytes`` and
``wire_coded_bytes`` are this rank's frames' bytes before and after coding, each counted once.
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
    ``wire_coded_bytes`` after; ``bytes_sent`` / ``bytes_received``: what coding changed of the
    exchange's counts (:class:`~horovod_alq.core.rounds.RoundState` has all four)."""

    wire_fixed_bytes: int = 0
    wire_coded_bytes: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0


#: Decode failures that are protocol errors (a frame that states a huge size may still fail to allocate).
DECODE_ERRORS = (ValueError, MemoryError, OverflowError, IndexError, RuntimeError)


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
        self._undecoded: dict[str, str] = {}  # alltoall name -> why a frame that arrived here did not decode
        load_compiled_coder()

    def undecoded(self, name: str) -> str | None:
        """Why a frame that this rank received in alltoall ``name`` (its full name) did not decode
        (its bytes were replaced by 0xFF), or None; forgets it. For the exchanges whose float32
        blocks have no payload check of their own (the hierarchical node sums)."""
        return self._undecoded.pop(name, None)

    def __getattr__(self, name: str):  # rank, size, local_size, scope, ... of the wrapped transport
        return getattr(self.inner, name)

    def allreduce_sum(self, vec: np.ndarray, name: str) -> np.ndarray:
        return self.inner.allreduce_sum(vec, name)

    def allreduce_max(self, vec: np.ndarray, name: str) -> np.ndarray:
        return self.inner.allreduce_max(vec, name)

    def _code(self, host: np.ndarray, verify: bool) -> tuple[np.ndarray, str | None]:
        """``host``'s frames (``verify``: checked to decode to ``host``), or a refused frame and the
        error that made this rank refuse them."""
        try:
            coded = entropy.encode_wire(host)
            if verify:
                entropy.verify_wire(coded, host)
        except Exception as err:  # a coder bug: every receiver must learn it, so it travels
            reason = f"rank {self.inner.rank}: {type(err).__name__}: {err}"
            return entropy.refused_frame(host.size, reason), reason
        self.counter.wire_fixed_bytes += int(host.size)
        self.counter.wire_coded_bytes += int(coded.size)
        return coded, None

    def _count(self, sent: int, received: int) -> None:
        """Add what coding changed of the exchange's (fixed-length) counts."""
        self.counter.bytes_sent += int(sent)
        self.counter.bytes_received += int(received)

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
        headers). ``own``: this rank's (fixed bytes, frames it sent, its refusal or None): where its
        share of ``got`` is those frames and it refused none, it is those fixed bytes, not decoded
        again (it checked them before sending). Counts the coded bytes received."""
        host = np.ascontiguousarray(self.ops.to_numpy(got))
        me = self.inner.rank
        parts, pos, coded_in = [], 0, 0
        for r, want in enumerate(expected):
            start = pos
            try:
                if r == me and own[2] is not None and not gather:
                    raise ValueError(f"this rank could not code its frames for other ranks ({own[2]})")
                end = pos + sizes[r] if sizes is not None else self._delimit(host, pos, want)
                if r == me and own[2] is None and np.array_equal(host[pos:end], own[1]):
                    part = own[0]
                else:
                    part = entropy.decode_wire(host[pos:end], want)
                pos = end
            except DECODE_ERRORS as err:
                if gather:
                    raise ProtocolError(f"{PREFIX}: {name}: rank {r}'s entropy-coded payloads: {err}") from None
                self._warn(r, name, err)
                self._undecoded.setdefault(name, f"rank {r}'s frames: {err}")
                part = np.full(want, 0xFF, dtype=np.uint8)
                if r == me and own[2] is not None:
                    pos += sizes[r] if sizes is not None else own[1].size
                else:
                    pos = host.size if sizes is None else pos + sizes[r]  # without sizes the rest is lost
            if r != me:
                coded_in += pos - start - want
            parts.append(part)
        self._count(0, coded_in)
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
        coded, refused = self._code(host, verify=True)
        self._count((self.inner.size - 1) * (coded.size - host.size), 0)
        peer = None if self.variable else self._peer_sizes([coded.size], name, True)
        wait = self.inner.allgather(self.ops.from_numpy(coded), peer or [coded.size] * self.inner.size, name)
        return lambda: self._decoded(wait(), peer, [int(s) for s in sizes], (host, coded, refused), name, True)

    def alltoall(self, payload: Tensor, splits: Sequence[int], received: Sequence[int], name: str):
        """Frames for other ranks are not checked here: their receiver checks them (the decoded
        bytes' CRC) and the exchange's poisoning makes every rank raise."""
        host = np.ascontiguousarray(self.ops.to_numpy(payload)).ravel()
        bounds = np.concatenate([[0], np.cumsum([int(s) for s in splits])]).astype(np.int64)
        me = self.inner.rank
        own = host[bounds[me] : bounds[me + 1]].copy()  # this rank's share of its own alltoall: not coded
        coded, refused = [], None
        for j in range(len(splits)):
            part = host[bounds[j] : bounds[j + 1]]
            if j == me:
                coded.append(entropy.raw_frame(own) if own.size else own)
                continue
            frames, why = self._code(part, verify=False)
            coded.append(frames)
            refused = refused or why
        own_frames = coded[me] if me < len(coded) else np.zeros(0, np.uint8)
        out_splits = [c.size for c in coded]
        self._count(sum(c.size - int(s) for j, (c, s) in enumerate(zip(coded, splits)) if j != me), 0)
        peer = None if self.variable else self._peer_sizes(out_splits, name, False)
        body = np.concatenate(coded) if coded else np.zeros(0, np.uint8)
        wait = self.inner.alltoall(self.ops.from_numpy(body), out_splits, peer or out_splits, name)
        return lambda: self._decoded(wait(), peer, [int(r) for r in received], (own, own_frames, refused), name, False)


def on_wire(transport: Transport, ops: TensorOps | None, wire: str, counter) -> Transport:
    """``transport`` as the ``wire`` format needs it (the fixed wire: itself)."""
    if wire == "fixed" or ops is None or isinstance(transport, EntropyTransport):
        return transport
    return EntropyTransport(transport, ops, counter)
