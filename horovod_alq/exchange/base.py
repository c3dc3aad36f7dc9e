"""What the exchanges share: the round's layout, the interfaces of transports and tensor ops, the
collectives an exchange asks for and the driver that issues them, and the check of received payloads."""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Generator, Protocol, Sequence

import numpy as np

from ..core.bucket_widths import BUDGET_UNITS
from ..core.methods import get_method
from ..core.protocol import PREFIX, ProtocolError
from ..core.quantizer import Quantizer
from ..core.wire import HEADER_SIZE, check_header, parse_header
from .plan import allgather_bytes, alltoall_bytes

Tensor = Any  # a framework tensor (torch.Tensor, np.ndarray): sliceable, 1-D where it matters


class Transport(Protocol):
    """How bytes move between the ranks of one process set. Names pair collectives across ranks
    (Horovod); transports that pair by call order (MPI) ignore them."""

    rank: int
    size: int

    def allgather(self, payload: Tensor, sizes: Sequence[int], name: str) -> Callable[[], Tensor]:
        """Start gathering every rank's uint8 ``payload`` (rank ``r`` sends ``sizes[r]`` bytes);
        the returned function waits and returns the concatenation in rank order."""

    def alltoall(self, payload: Tensor, splits: Sequence[int], received: Sequence[int],
                 name: str) -> Callable[[], Tensor]:
        """Start sending ``payload[sum(splits[:j]):][:splits[j]]`` to rank ``j`` and receiving
        ``received[r]`` bytes from every rank ``r``; the function waits and returns them in rank order."""

    def allreduce_sum(self, vec: np.ndarray, name: str) -> np.ndarray:
        """Elementwise sum of a small float64 vector over the ranks."""

    def allreduce_max(self, vec: np.ndarray, name: str) -> np.ndarray:
        """Elementwise maximum of a small int64 vector over the ranks."""


class SingleRank:
    """The :class:`Transport` of a set of one rank: every collective returns this rank's input
    (single-process runs: benchmarks, tests of the round logic)."""

    rank, size = 0, 1

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

    def stream(self, parts: Sequence[Tensor], starts: Sequence[int], length: int, out: Tensor | None = None,
               padding: Sequence[tuple[int, int]] = ()) -> Tensor:
        """A float32 vector of ``length`` with the flattened ``parts`` at ``starts`` and zeros
        elsewhere: a new one, or ``out`` (stale contents) with its ``padding`` ranges zeroed (the
        parts and the padding cover it)."""

    def zeros(self, n: int) -> Tensor:
        """float32 zeros."""

    def empty(self, n: int) -> Tensor:
        """A float32 vector of ``n`` with undefined contents."""

    def encode(self, x: Tensor, quantizer: Quantizer, seed: int) -> Tensor:
        """One payload (uint8) of the float32 vector ``x`` with the quantizer's levels."""

    def encode_parts(self, parts: Sequence[Tensor], starts: Sequence[int], length: int, quantizer: Quantizer,
                     seed: int) -> Tensor | None:
        """The payload that :meth:`encode` gives for ``stream(parts, starts, length)``, read from the
        parts in place; None where the codec cannot (the caller then builds the stream)."""

    def decode_sum(self, out: Tensor, payloads: Tensor, offsets: Sequence[int], quantizer: Quantizer, *,
                   start: int = 0, numel: int | None = None, scale: float = 1.0) -> None:
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

    def to_numpy(self, x: Tensor) -> np.ndarray:
        """A host copy (NumPy)."""

    def from_numpy(self, a: np.ndarray) -> Tensor:
        """A uint8 vector on the ops' device."""


def auto_rows(auto, ops: TensorOps, parts: Sequence) -> np.ndarray:
    """``bits="auto"``: this rank's refit vector of every tensor of ``parts``
    (:meth:`~horovod_alq.core.allocation.AutoBits.rows`)."""
    pairs = [ops.auto_statistics(part, auto.quantizers[auto.default]) for part in parts]
    return auto.rows(np.stack([p[0] for p in pairs]), np.stack([p[1] for p in pairs]))



@dataclass(frozen=True)
class Layout:
    """Where a round's tensors sit in its stream, and how the stream is cut into fusion buffers.

    Inside a buffer every tensor starts on a bucket boundary (counted from the buffer's start; the
    gap before it is zero padding), so a fused buffer quantizes each tensor exactly as it would
    alone: the same buckets, the same norms. The last tensor of a buffer is not padded.
    """

    numels: tuple[int, ...]
    starts: tuple[int, ...]
    length: int
    buffers: tuple[tuple[int, int], ...]
    bucket_size: int
    padding: tuple[tuple[int, int], ...] = field(default=())

    def padding_in(self, lo: int, hi: int) -> list[tuple[int, int]]:
        """The padding ranges that overlap ``[lo, hi)``, clipped to it."""
        return [(max(a, lo), min(b, hi)) for a, b in self.padding if a < hi and b > lo]


def plan_layout(numels: Sequence[int], bucket_size: int, capacity: int | None) -> Layout:
    """Lay out tensors of ``numels`` elements (in slot order) and cut buffers of at most
    ``capacity`` elements (a tensor larger than that gets a buffer of its own; None: one buffer
    for all, 0: one buffer per tensor). The same inputs give the same layout on every rank."""
    d = int(bucket_size)
    starts, padding, buffers = [], [], []
    lo = pos = 0
    for n in numels:
        aligned = lo + -(-(pos - lo) // d) * d
        full = capacity is not None and (capacity == 0 or aligned + int(n) - lo > capacity)
        if pos > lo and full:
            buffers.append((lo, pos))
            lo = aligned = pos
        if aligned > pos:
            padding.append((pos, aligned))
        starts.append(aligned)
        pos = aligned + int(n)
    if pos > lo:
        buffers.append((lo, pos))
    return Layout(tuple(int(n) for n in numels), tuple(starts), pos, tuple(buffers), d, tuple(padding))


def check_payloads(ops: TensorOps, gathered: Tensor, numels: Sequence[int], quantizer: Quantizer,
                   what: str) -> list[int]:
    """Validate the payloads of every rank, back to back in ``gathered`` (rank ``r``'s holds
    ``numels[r]`` elements), and return their offsets. Raises :class:`ProtocolError` naming the rank."""
    return check_host_payloads(ops.to_numpy(gathered), numels, quantizer, what)


def check_host_payloads(host: np.ndarray, numels: Sequence[int], quantizer: Quantizer, what: str) -> list[int]:
    """:func:`check_payloads` on a host copy (uint8). The headers are read at their expected offsets
    first (the first rank whose payload differs in configuration is named, even when its size then
    differs), then the total size."""
    return [o[0] for o in check_host_segments(host, [[(n, quantizer)] for n in numels], what)]


def check_segments(ops: TensorOps, gathered: Tensor, expected: Sequence[Sequence[tuple[int, Quantizer]]],
                   what: str) -> list[list[int]]:
    """Validate every rank's run of payloads, back to back in ``gathered``: rank ``r``'s holds one
    payload per ``(elements, quantizer)`` of ``expected[r]`` (tensors of several widths in one
    buffer, ``bits="auto"``). Returns the offsets of each rank's payloads."""
    return check_host_segments(ops.to_numpy(gathered), expected, what)


def check_host_segments(host: np.ndarray, expected: Sequence[Sequence[tuple[int, Quantizer]]],
                        what: str) -> list[list[int]]:
    """:func:`check_segments` on a host copy (uint8): headers first, then the total size."""
    offsets, pos = [], 0
    for rank_expected in expected:
        offsets.append([])
        for n, q in rank_expected:
            offsets[-1].append(pos)
            pos += q.payload_bytes(n)
    for rank, rank_expected in enumerate(expected):
        for offset, (n, q) in zip(offsets[rank], rank_expected):
            if offset + HEADER_SIZE > host.size:
                break
            try:
                header = parse_header(host[offset: offset + HEADER_SIZE])
                if q.bits == 0 and header.bits == 0 and header.budget256 != q.budget256:
                    raise ValueError(f"payload made with bit_budget={header.budget256 / BUDGET_UNITS}, this rank "
                                     f"uses {q.budget256 / BUDGET_UNITS}")
                check_header(header, get_method(q.method).id, q.bits, q.bucket_size, q.fingerprint, q.norm)
                if header.numel != n:
                    raise ValueError(f"payload has {header.numel} elements, expected {n}")
                if q.bits == 0 and offset + q.payload_bytes(n) <= host.size:  # widths per bucket: its parts too
                    q.layout(host, offset, n)
            except ValueError as err:
                raise ProtocolError(f"{PREFIX}: {what}: the payload of rank {rank} does not match this rank's "
                                    f"({q.method}, bits={q.bits}, bucket_size={q.bucket_size}): {err}") from None
    if host.size != pos:
        raise ProtocolError(f"{PREFIX}: {what}: received {host.size} bytes, expected {pos}")
    return offsets


@dataclass(frozen=True)
class Piece:
    """Stream coordinates ``[lo, hi)`` as the sum of decoded payloads of ``hi - lo`` coordinates
    each, back to back in ``payloads`` (validated) from ``offsets``, encoded with ``quantizer``'s
    levels (a snapshot, :meth:`Job.frozen`: a refit round replaces the levels before it is read)."""

    lo: int
    hi: int
    payloads: Tensor
    offsets: tuple[int, ...]
    quantizer: Quantizer


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

    def read(self, lo: int, hi: int, scale: float = 1.0, out: Tensor | None = None) -> Tensor:
        """``scale`` times the reduced stream's ``[lo, hi)`` (``lo`` on a bucket boundary of its
        piece), in ``out`` (float32, ``hi - lo``) or a new vector."""
        out = self.ops.empty(hi - lo) if out is None else out
        for k, p in enumerate(self.pieces):
            a, b = max(lo, p.lo), min(hi, p.hi)
            if a >= b:
                continue
            start = a - p.lo
            if (start * p.quantizer.bits) % 8 == 0:  # the window's codes begin on a byte: decode it alone
                self.ops.decode_sum(out[a - lo: b - lo], p.payloads, p.offsets, p.quantizer, start=start,
                                    numel=p.hi - p.lo, scale=scale)
            else:  # (bucket sizes that are not multiples of 8) decode the piece once, then slice it
                if k not in self._whole:
                    self._whole[k] = self.ops.empty(p.hi - p.lo)
                    self.ops.decode_sum(self._whole[k], p.payloads, p.offsets, p.quantizer)
                out[a - lo: b - lo] = self._whole[k][start: start + b - a] * scale
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
    stream_buffer: Callable[[int], Tensor] | None = None
    widths: Sequence[Quantizer] | None = None  # bits="auto": each tensor's quantizer (both phases)
    sent: int = 0
    received: int = 0
    encoded: int = 0  # bytes of this rank's own (first-phase) payloads
    second_statistics: np.ndarray | None = None  # the owners' statistics of their reduced shards
    _stream: Tensor | None = None
    _frozen: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
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
            self._stream = self.ops.stream(self.parts, lay.starts, lay.length, out=out, padding=lay.padding)
        return self._stream

    def encode_range(self, lo: int, hi: int, quantizer: Quantizer, seed: int) -> Tensor:
        """The payload of the stream's ``[lo, hi)`` (``lo`` on a bucket boundary of its buffer): this
        rank's own codes (counted in ``encoded``)."""
        if self._stream is None:
            parts, starts = [], []
            for part, s, n in zip(self.parts, self.layout.starts, self.layout.numels):
                a, b = max(lo, s), min(hi, s + n)
                if a < b:
                    parts.append(part[a - s: b - s])
                    starts.append(a - lo)
            payload = self.ops.encode_parts(parts, starts, hi - lo, quantizer, seed)
            if payload is not None:
                self.encoded += int(payload.shape[0])
                return payload
        payload = self.ops.encode(self.stream[lo:hi], quantizer, seed)
        self.encoded += int(payload.shape[0])
        return payload

    def encode(self, x: Tensor, quantizer: Quantizer, seed: int) -> Tensor:
        """A payload of ``x`` (not of the stream: a reduced shard); an empty ``x`` gives the bare header."""
        return self.ops.encode(x, quantizer, seed)

    def encode_runs(self, lo: int, hi: int, seed: Callable[[int], int]) -> tuple[Tensor, list]:
        """This rank's payloads of ``[lo, hi)``, one per run of one width (:meth:`segments`), back
        to back; ``seed(k)`` is run ``k``'s. Returns them and the runs."""
        runs = self.segments(lo, hi)
        payloads = [self.encode_range(a, b, q1, seed(k)) for k, (a, b, q1, _) in enumerate(runs)]
        return joined(self.ops, payloads), runs

    def add_second_statistics(self, stats: np.ndarray) -> None:
        self.second_statistics = stats if self.second_statistics is None else self.second_statistics + stats

    def issue(self, request: "Allgather | Alltoall", transport: Transport | None = None) -> Callable[[], Tensor]:
        """Start ``request`` on ``transport`` (default: the job's), counting its bytes; returns its wait."""
        if isinstance(request, Allgather):
            self.count_allgather(request.sizes)
        else:
            self.count_alltoall(request.splits, request.received)
        return issue(self.transport if transport is None else transport, request, self.name(request.tag))

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
    """A collective an exchange asks for: ``splits[j]`` bytes of ``payload`` to rank ``j``, ``received[r]`` from rank ``r``."""

    payload: Tensor
    splits: Sequence[int]
    received: Sequence[int]
    tag: str


def issue(transport: Transport, request: "Allgather | Alltoall", name: str) -> Callable[[], Tensor]:
    """Start ``request`` on ``transport`` under ``name``; returns its wait."""
    if isinstance(request, Allgather):
        return transport.allgather(request.payload, request.sizes, name)
    return transport.alltoall(request.payload, request.splits, request.received, name)


#: One buffer's exchange: yields the collectives it needs, receives each one's result (the gathered
#: bytes in rank order), returns the buffer's pieces.
Steps = Generator["Allgather | Alltoall", Tensor, list]


@dataclass
class Started:
    """A buffer whose exchange began before its round was run (:meth:`.engine.Engine.add`): the
    buffer's own job (its stream is the round's ``[offset, offset + length)``), its steps, and the
    wait of the collective they asked for first."""

    job: Job
    steps: Steps
    wait: Callable[[], Tensor] | None
    offset: int


def run(job: Job, steps: Callable[[Job, int], Steps], started: dict[int, Started] | None = None) -> Decoded:
    """Every buffer of ``job`` through ``steps``, stage by stage: all buffers' first collectives are
    issued, then each buffer waits for its first and issues its second, and so on, so every rank
    issues the same collectives in the same order and none waits before it has issued all of a stage.
    Exchanges raise only after their last collective, so an error leaves no collective unissued.
    ``started``: buffers whose first collective is already under way (their pieces are shifted
    into the round's stream; their bytes are counted in ``job``)."""
    started = dict(started or {})
    for i in range(len(job.layout.buffers)):
        if i not in started:
            started[i] = Started(job, steps(job, i), None, 0)
    buffers = [started[i] for i in range(len(job.layout.buffers))]
    pieces: list[Piece] = []
    active = list(range(len(buffers)))
    while active:
        still = []
        for k in active:
            b = buffers[k]
            try:
                request = b.steps.send(None if b.wait is None else b.wait())
            except StopIteration as stop:
                pieces += [dataclasses.replace(p, lo=p.lo + b.offset, hi=p.hi + b.offset) for p in stop.value]
                continue
            b.wait = b.job.issue(request)
            still.append(k)
        active = still
    for b in {id(b.job): b for b in buffers if b.job is not job}.values():
        job.sent += b.job.sent
        job.received += b.job.received
        job.encoded += b.job.encoded
        if b.job.second_statistics is not None:
            job.add_second_statistics(b.job.second_statistics)
    return Decoded(job.ops, job.layout.length, pieces)
