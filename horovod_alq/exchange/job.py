"""One round's exchange as every exchange module sees it: the :class:`Job` (the round's tensors,
layout, quantizers, seeds, byte counts), the collectives an exchange asks for (:class:`Allgather`,
:class:`Alltoall`) and what it returns (:class:`Piece`, read through :class:`Decoded`)."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Callable, Generator, Sequence

import numpy as np

from ..core.protocol import PREFIX
from ..core.quantizer import Quantizer
from .feedback import ErrorFeedback, Pending, spans
from .interfaces import Tensor, TensorOps, Transport
from .layout import Layout
from .plan import allgather_bytes, alltoall_bytes


@dataclass(frozen=True)
class Piece:
    """Stream coordinates ``[lo, hi)`` as the sum of decoded payloads of ``hi - lo`` coordinates
    each, back to back in ``payloads`` (validated) from ``offsets``, encoded with ``quantizer``'s
    levels (a snapshot, :meth:`Job.frozen`: a refit round replaces the levels before it is read).
    ``summed``: ``payloads`` is that sum already, float32 (the pipelined round decodes a chunk while
    the next one travels, :mod:`.pipeline`), and ``offsets`` is empty."""

    lo: int
    hi: int
    payloads: Tensor
    offsets: tuple[int, ...]
    quantizer: Quantizer
    summed: bool = False


class Decoded:
    """An exchange's result: the reduced stream ``[start, start + length)`` (all of it, or the shard
    a reduce-scatter leaves on this rank), decoded on demand from the pieces that cover it, so that
    each tensor's values are written once, straight into its output, with its scale."""

    def __init__(self, ops: TensorOps, length: int, pieces: Sequence[Piece], start: int = 0) -> None:
        self.ops, self.start, self.length = ops, int(start), int(length)
        self.pieces = sorted((p for p in pieces if p.hi > p.lo), key=lambda p: p.lo)
        edges = [start] + [e for p in self.pieces for e in (p.lo, p.hi)] + [start + length]
        if any(a != b for a, b in zip(edges[::2], edges[1::2])):
            raise AssertionError(f"{PREFIX}: the decoded pieces do not cover [{start}, {start + length}) of the stream")
        self._whole: dict[int, Tensor] = {}  # piece index -> its decoded sum (for windows off a byte)

    def read(
        self, lo: int, hi: int, scale: float = 1.0, out: Tensor | None = None, divide: Tensor | None = None
    ) -> Tensor:
        """``scale`` times the reduced stream's ``[lo, hi)`` (``lo`` on a bucket boundary of its
        piece), in ``out`` (float32, ``hi - lo``) or a new vector; divided by ``divide`` (``hi - lo``
        values: preconditioning's ``w``), in the decode's pass where the ops can (``fuses_scales``)."""
        out = self.ops.empty(hi - lo) if out is None else out
        fused = divide is not None and getattr(self.ops, "fuses_scales", False)
        for k, p in enumerate(self.pieces):
            a, b = max(lo, p.lo), min(hi, p.hi)
            if a >= b:
                continue
            start = a - p.lo
            if p.summed:  # the float32 operations of decode_sum's scale and divide, in its order
                summed = p.payloads[start : start + b - a]
                out[a - lo : b - lo] = summed if scale == 1.0 else summed * scale
                if divide is not None:
                    out[a - lo : b - lo] /= divide[a - lo : b - lo]
            elif (start * p.quantizer.bits) % 8 == 0:  # the window's codes begin on a byte: decode it alone
                self.ops.decode_sum(
                    out[a - lo : b - lo],
                    p.payloads,
                    p.offsets,
                    p.quantizer,
                    start=start,
                    numel=p.hi - p.lo,
                    scale=scale,
                    **({"divide": divide[a - lo : b - lo]} if fused else {}),
                )
                if divide is not None and not fused:
                    out[a - lo : b - lo] /= divide[a - lo : b - lo]
            else:  # (bucket sizes that are not multiples of 8) decode the piece once, then slice it
                if k not in self._whole:
                    self._whole[k] = self.ops.empty(p.hi - p.lo)
                    self.ops.decode_sum(self._whole[k], p.payloads, p.offsets, p.quantizer)
                out[a - lo : b - lo] = self._whole[k][start : start + b - a] * scale
                if divide is not None:
                    out[a - lo : b - lo] /= divide[a - lo : b - lo]
        return out


@dataclass
class Job:
    """One round's exchange: what every exchange module receives.

    ``parts`` are the round's flat tensors, at ``layout.starts`` of the round's stream (zeros
    between them). ``encode_range`` reads them in place where the codec can; ``stream`` builds the
    stream (once, in ``stream_buffer(n)``, a kept vector with stale contents, when given).
    ``seed(*keys)`` gives the seed of one encode; ``name(tag)`` a collective's name, the same on
    every rank; ``sent`` / ``received`` accumulate this rank's payload bytes on the wire."""

    parts: Sequence[Tensor]
    layout: Layout
    ops: TensorOps
    transport: Transport
    first: Quantizer
    second: Quantizer | None
    seed: Callable[..., int]
    name: Callable[[str], str]
    collect_second: bool = False
    collect_first: bool = False  # an exchange that quantizes other values than the stream collects their statistics
    stream_buffer: Callable[[int], Tensor] | None = None
    widths: Sequence[Quantizer] | None = None  # bits="auto": each tensor's quantizer (both phases)
    sent: int = 0
    received: int = 0
    encoded: int = 0  # bytes of this rank's own (first-phase) payloads
    second_statistics: np.ndarray | None = None  # the owners' statistics of their reduced shards
    first_statistics: np.ndarray | None = None  # with collect_first: the statistics of what it quantized
    feedback: ErrorFeedback | None = None  # error_feedback: the front-end's error buffers
    #: error_feedback: (identity, start, numel) of each tensor in the stream, its errors' key (a
    #: name or another stable identity; a DDP bucket's parameters, or each of ``layout``'s tensors)
    idents: Sequence[tuple] | None = None
    #: precondition=: each part's float32 scale ``w`` (as long as it): the stream holds ``part * w``,
    #: read in place by ops that fuse the multiply into the encode (``fuses_scales``), else built
    scales: Sequence[Tensor] | None = None
    #: the pipelined round (:mod:`.pipeline`): coordinates per chunk of a buffer; 0: one collective per stage
    chunk: int = 0
    pending: Pending = field(default_factory=Pending)  # errors made by this job, for commit_feedback()
    _stream: Tensor | None = None
    _frozen: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.feedback is not None and self.idents is None:
            raise ValueError(f"{PREFIX}: error feedback keeps each tensor's error under its identity: none was given")
        if self.widths and self.widths[0].bits == 0:  # widths per bucket: mixed payloads
            from .mixed import MixedOps

            self.ops = self.ops if isinstance(self.ops, MixedOps) else MixedOps(self.ops)

    def frozen(self, quantizer: Quantizer) -> Quantizer:
        """A copy of ``quantizer`` whose levels a later refit does not change (for :class:`Piece`)."""
        if id(quantizer) not in self._frozen:
            self._frozen[id(quantizer)] = copy.copy(quantizer)
        return self._frozen[id(quantizer)]

    def segments(self, lo: int, hi: int) -> list[tuple[int, int, Quantizer, Quantizer]]:
        """``[lo, hi)`` as runs of one width: ``(a, b, first, second)`` quantizers of each run (a
        tensor's run reaches the next tensor's start); one run unless ``widths`` is given."""
        if self.widths is None:
            return [(lo, hi, self.first, self.second)]
        lay, runs = self.layout, []
        for q, s, e in zip(self.widths, lay.starts, (*lay.starts[1:], lay.length)):
            a, b = max(lo, s), min(hi, e)
            if a >= b:
                continue
            if runs and runs[-1][2] is q and runs[-1][1] == a:
                runs[-1] = (runs[-1][0], b, q, q)
            else:
                runs.append((a, b, q, q))
        return runs

    @property
    def stream(self) -> Tensor:
        """The round's stream (float32, ``layout.length``), built on first use."""
        if self._stream is None:
            lay = self.layout
            out = None if self.stream_buffer is None else self.stream_buffer(lay.length)
            parts = self.parts if self.scales is None else [p * w for p, w in zip(self.parts, self.scales)]
            self._stream = self.ops.stream(parts, lay.starts, lay.length, out=out, padding=lay.padding)
        return self._stream

    def encode_range(self, lo: int, hi: int, quantizer: Quantizer, seed: int, first: int = 0) -> Tensor:
        """The payload of the stream's ``[lo, hi)`` (``lo`` on a bucket boundary of its buffer): this
        rank's own codes (counted in ``encoded``); with error feedback, of the range plus its error.
        ``first``: ``lo``'s index in the random stream of the encode it is a chunk of (:mod:`.pipeline`)."""
        if self.feedback is not None:
            if first:
                raise AssertionError(f"{PREFIX}: error feedback does not encode chunks")
            payload = self._feedback_encode(self.stream[lo:hi], quantizer, seed, "own", lo, hi)
            self.encoded += int(payload.shape[0])
            return payload
        if self._stream is None and (self.scales is None or getattr(self.ops, "fuses_scales", False)):
            parts, starts, scales = [], [], []
            for k, (part, s, n) in enumerate(zip(self.parts, self.layout.starts, self.layout.numels)):
                a, b = max(lo, s), min(hi, s + n)
                if a < b:
                    parts.append(part[a - s : b - s])
                    starts.append(a - lo)
                    if self.scales is not None:
                        scales.append(self.scales[k][a - s : b - s])
            kw = {} if self.scales is None else {"scales": scales}
            if first:
                kw["first"] = first
            payload = self.ops.encode_parts(parts, starts, hi - lo, quantizer, seed, **kw)
            if payload is not None:
                self.encoded += int(payload.shape[0])
                return payload
        payload = self.ops.encode(self.stream[lo:hi], quantizer, seed, **({"first": first} if first else {}))
        self.encoded += int(payload.shape[0])
        return payload

    def encode(self, x: Tensor, quantizer: Quantizer, seed: int, key: tuple = (), first: int = 0) -> Tensor:
        """A payload of ``x`` (not of the stream: a sum this rank owns; ``key`` names it for error
        feedback: a stage and its stream range ``(tag, lo, hi)``); an empty ``x`` gives the bare header.
        ``first``: as :meth:`encode_range`'s."""
        if self.feedback is not None and key:
            return self._feedback_encode(x, quantizer, seed, key[0], key[-2], key[-1])
        return self.ops.encode(x, quantizer, seed, **({"first": first} if first else {}))

    def _feedback_encode(self, x: Tensor, quantizer: Quantizer, seed: int, stage: str, lo: int, hi: int) -> Tensor:
        """``x`` (the stream's ``[lo, hi)``, or a sum of it this rank owns in ``stage``) encoded with
        its tensors' errors added; what it dropped waits in :attr:`pending` (no error in padding)."""
        pieces = spans(self.idents, lo, hi)
        owner = (self.transport.rank, self.transport.size)
        return self.feedback.encode(self.ops, x, quantizer, seed, stage, pieces, self.pending, owner)

    def commit_feedback(self) -> None:
        """The exchange succeeded: the errors this job made become the rank's (no-op without feedback)."""
        if self.feedback is not None:
            self.feedback.commit(self.pending)

    def encode_runs(self, lo: int, hi: int, seed: Callable[[int], int]) -> tuple[Tensor, list]:
        """This rank's payloads of ``[lo, hi)``, one per run of one width (:meth:`segments`), back
        to back; ``seed(k)`` is run ``k``'s. Returns them and the runs."""
        runs = self.segments(lo, hi)
        payloads = [self.encode_range(a, b, q1, seed(k)) for k, (a, b, q1, _) in enumerate(runs)]
        return joined(self.ops, payloads), runs

    def add_first_statistics(self, stats: np.ndarray) -> None:
        self.first_statistics = stats if self.first_statistics is None else self.first_statistics + stats

    def add_second_statistics(self, stats: np.ndarray) -> None:
        self.second_statistics = stats if self.second_statistics is None else self.second_statistics + stats

    def issue(self, request: "Allgather | Alltoall", transport: Transport | None = None) -> Callable[[], Tensor]:
        """Start ``request`` on ``transport`` (default: the job's), counting its bytes; returns its wait."""
        self.count(request)
        return issue(self.transport if transport is None else transport, request, self.name(request.tag))

    def count(self, request: "Allgather | Alltoall") -> None:
        """Add ``request``'s payload bytes to :attr:`sent` / :attr:`received`."""
        if isinstance(request, Allgather):
            self.count_allgather(request.sizes)
        else:
            self.count_alltoall(request.splits, request.received)

    def count_allgather(self, sizes: Sequence[int]) -> None:
        sent, received = allgather_bytes(sizes, self.transport.rank)
        self.sent, self.received = self.sent + sent, self.received + received

    def count_alltoall(self, splits: Sequence[int], received: Sequence[int]) -> None:
        sent, got = alltoall_bytes(splits, received, self.transport.rank)
        self.sent, self.received = self.sent + sent, self.received + got


def joined(ops: TensorOps, payloads: Sequence[Tensor]) -> Tensor:
    """Payloads back to back (none: an empty uint8 vector)."""
    if len(payloads) == 1:
        return payloads[0]
    return ops.cat(payloads) if payloads else ops.from_numpy(np.zeros(0, dtype=np.uint8))


@dataclass(frozen=True)
class Allgather:
    """A collective an exchange asks for: gather every rank's ``payload`` (rank ``r``'s has ``sizes[r]`` bytes)."""

    payload: Tensor
    sizes: Sequence[int]
    tag: str


@dataclass(frozen=True)
class Alltoall:
    """A collective an exchange asks for: ``splits[j]`` bytes of ``payload`` to rank ``j``,
    ``received[r]`` from rank ``r``."""

    payload: Tensor
    splits: Sequence[int]
    received: Sequence[int]
    tag: str


@dataclass(frozen=True)
class Deferred:
    """What a pipelined exchange yields (:mod:`.pipeline`): start ``request`` and send back its wait,
    not its result, so that the exchange encodes and decodes other chunks while it travels."""

    request: "Allgather | Alltoall"


def issue(transport: Transport, request: "Allgather | Alltoall", name: str) -> Callable[[], Tensor]:
    """Start ``request`` on ``transport`` under ``name``; returns its wait."""
    if isinstance(request, Allgather):
        return transport.allgather(request.payload, request.sizes, name)
    return transport.alltoall(request.payload, request.splits, request.received, name)


#: One buffer's exchange: yields the collectives it needs, receives each one's result (the gathered
#: bytes in rank order; for a :class:`Deferred` one, its wait), returns the buffer's pieces.
Steps = Generator["Allgather | Alltoall", Tensor, list]


def auto_rows(auto, ops: TensorOps, parts: Sequence) -> np.ndarray:
    """``bits="auto"``: this rank's refit vector of every tensor of ``parts``
    (:meth:`~horovod_alq.core.auto_bits.AutoBits.rows`)."""
    pairs = [ops.auto_statistics(part, auto.quantizers[auto.default]) for part in parts]
    return auto.rows(np.stack([p[0] for p in pairs]), np.stack([p[1] for p in pairs]))
