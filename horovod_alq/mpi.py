"""Quantized averaging of NumPy arrays over an mpi4py communicator, without a deep-learning framework.

For code outside PyTorch and TensorFlow (NumPy simulations, JAX with arrays converted at the
boundary): the payloads of the Horovod compressors, exchanged with MPI collectives::

    ar = QuantizedAllreduce(MPI.COMM_WORLD, method="alq", bits=3, bucket_size=8192)
    mean = ar(grad)    # NumPy in, NumPy out: the average over ranks of the decoded payloads
    ar.adapt()         # refit the levels from the statistics of every rank since the last adapt()

Every call is one streamed round of the exchange engine (:meth:`Engine.open_stream`: a handshake,
then one ``Allgatherv``, or an ``Alltoallv`` and an ``Allgatherv``); :meth:`~QuantizedAllreduce.adapt`
is :meth:`Engine.refit`. Every wait is bounded (``timeout=``). Errors are collective: a bad input,
a rank with another array size or another configuration raises on *every* rank, naming the rank,
and the communicator stays usable. An exception raised outside these calls on one rank leaves the
others waiting until the timeout; run scripts with ``mpiexec python -m mpi4py script.py``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from mpi4py import MPI

from .core import frontends
from .core.methods import get_method
from .core.protocol import CollectiveTimeout, ProtocolError
from .core.quantizer import Quantizer
from .core.statistics import statistics_length
from .core.wire import parse_header
from .exchange.base import check_payloads
from .exchange.engine import RefitError, blame
from .exchange.numpy_ops import NumpyOps
from .exchange.setup import configure
from .mpi_transport import MpiTransport

__all__ = ["QuantizedAllreduce"]

_PREFIX = "horovod_alq.mpi"
_OPS = ("average", "sum")


class QuantizedAllreduce(frontends.Configured):
    """Average NumPy arrays over an mpi4py communicator with quantized payloads.

    Every rank encodes its array, the payloads are exchanged, and every rank decodes and averages
    them: all ranks return bit-identical arrays, an unbiased estimate of the exact average.
    Adaptive methods (ALQ, AMQ) refit in :meth:`adapt` from statistics summed over the
    communicator, so all ranks switch to the same levels at the same call.

    Parameters
    ----------
    comm : mpi4py.MPI.Intracomm
        Any intracommunicator (``MPI.COMM_WORLD``, or one from ``Split`` / ``Create``). Every rank
        of ``comm`` makes the same calls in the same order, as for any MPI collective.
    method : str
        ``"alq"``, ``"alq-n"``, ``"amq"``, ``"amq-n"`` (adaptive), ``"qsgdinf"``, ``"qsgd"``,
        ``"nuqsgd"``, ``"terngrad"`` (fixed levels); see :class:`~horovod_alq.core.Quantizer`.
    bits : int, optional
        Bits per coordinate on the wire, 2..8 (default 3; TernGrad: 2).
    bucket_size : int
        Coordinates sharing one float32 norm (default 8192).
    seed : int, optional
        Each rank draws its rounding noise from a stream derived from ``(seed, rank)``; None: fresh entropy.
    clip : bool or float
        TernGrad only: clip buckets at this many standard deviations (biased; off by default).
    exchange : {"auto", "allgather", "two-phase"}
        How payloads travel (see :class:`horovod_alq.torch.ALQCompressor`); ``auto``: two-phase
        from 4 ranks on. Two-phase re-quantizes the summed shards with ``bits_second`` bits
        (default ``bits``: the first quantizer's levels, copied at every :meth:`adapt`; other bits:
        refit from the statistics of the reduced shards).
    bits_second : int, optional
    norm : {"l2", "linf"}, optional
        Bucket norm (adaptive methods take either; None: the method's default).
    collect_every : int, optional
        Which calls record this rank's statistics for the next :meth:`adapt`: every
        ``collect_every``-th call since the last one (default 1 for adaptive methods); 0: only calls
        made with ``collect=True``. Recording costs a local pass over the array (docs/mpi4py.md).
    timeout : float, optional
        Seconds to wait for any collective of a call or of :meth:`adapt` before raising an error
        naming it; default ``$HOROVOD_ALQ_TIMEOUT``, else 300; 0: no limit.

    Notes
    -----
    Results have the input's dtype (float16, float32 or float64) and shape; the sum over ranks is
    taken in float32 (:meth:`reduce` can sum in float64).
    """

    def __init__(self, comm: MPI.Intracomm, method: str = "alq", bits: int | None = None, bucket_size: int = 8192,
                 *, seed: int | None = None, clip: bool | float = False, collect_every: int | None = None,
                 exchange: str = "auto", bits_second: int | None = None, norm: str | None = None,
                 timeout: float | None = None) -> None:
        if not isinstance(comm, MPI.Comm) or comm == MPI.COMM_NULL:
            raise TypeError(f"comm must be an mpi4py intracommunicator, got {comm!r}")
        if comm.Is_inter():
            raise ValueError("comm is an intercommunicator; pass an intracommunicator (e.g. Merge() it)")
        self._comm, self._rank, self._size = comm, comm.Get_rank(), comm.Get_size()
        self._method = get_method(method)
        setup = configure(method, bits, bucket_size, clip=clip, norm=norm, bits_second=bits_second, seed=seed,
                          on_request=True, front_end="QuantizedAllreduce (mpi4py)")  # refits: adapt() only
        self._quantizer, self._state = setup.quantizer, setup.state
        if collect_every is None:
            collect_every = 1 if self._method.adaptive else 0
        if isinstance(collect_every, bool) or not isinstance(collect_every, (int, np.integer)) or collect_every < 0:
            raise ValueError(f"collect_every must be a non-negative integer (0: only on request), "
                             f"got {collect_every!r}")
        self._collect_every = int(collect_every)
        self._stats_length = statistics_length(self._method)
        self._pending: np.ndarray | None = None  # this rank's statistics since the last adapt()
        self._pending_second: np.ndarray | None = None  # its reduced shards' (two-phase owner)
        self._calls_since_adapt = 0
        self._transport = MpiTransport(comm, timeout)
        self._stages = [self._transport] * 2  # MPI pairs by call order: one transport for every stage
        self._ops = NumpyOps()
        self._engine = setup.engine(exchange=exchange, fusion_bytes=0, uid="mpi")

    @property
    def comm(self) -> MPI.Intracomm:
        return self._comm

    @property
    def method(self) -> str:
        return self._method.name

    @property
    def quantizer(self) -> Quantizer:
        """The NumPy codec and its levels; change its levels on all ranks alike, or calls will fail."""
        return self._quantizer

    def __repr__(self) -> str:
        return (f"QuantizedAllreduce({self.method!r}, bits={self.bits}, bucket_size={self.bucket_size}, "
                f"rank {self._rank} of {self._size})")

    # ----------------------------------------------------------------- exchange
    def __call__(self, x: Any, *, op: str = "average", collect: bool | None = None) -> np.ndarray:
        """Quantized average (``op="sum"``: sum) of ``x`` (any shape, float16/32/64; the same number
        of elements on every rank) over the communicator; ``collect``: record this rank's
        statistics for the next :meth:`adapt` (None: as ``collect_every``). Collective.

        Returns the shape and dtype of ``x``, bit-identical on all ranks. Raises ValueError on every
        rank when some rank's input is not a floating-point array, the element counts differ, or a
        payload was made with another method, bits, bucket size or levels."""
        arr, decoded = self._round(x, collect, op)
        out = np.zeros(0, np.float32) if decoded is None else decoded.read(0, arr.size)
        if op == "average":
            out /= np.float32(self._size)
        return out.astype(arr.dtype, copy=False).reshape(arr.shape)

    def allgather(self, x: Any, *, collect: bool | None = None) -> list[np.ndarray]:
        """Encode ``x``, allgather the payloads and check every rank's header. Collective.

        Returns one payload per rank (1-D uint8 views, rank order), e.g. to decode later with
        :meth:`reduce` or with the framework kernels, which read the same bytes."""
        arr, decoded = self._round(x, collect, None, exchange="allgather")
        q = self._quantizer
        if decoded is None:  # no coordinates: every rank's payload is the same bare header
            return [q.encode(arr.ravel()) for _ in range(self._size)]
        piece = decoded.pieces[0]
        size = len(piece.payloads) // self._size
        return [piece.payloads[o: o + size] for o in piece.offsets]

    def _round(self, x: Any, collect: bool | None, op: str | None, exchange: str | None = None):
        """One streamed round for ``x``: the array and its ``Decoded`` sum over the ranks (None for an
        empty array). A local error travels in the handshake, so that no rank waits alone."""
        arr, error = None, None
        try:
            if op is not None and op not in _OPS:
                raise ValueError(f"op must be one of {_OPS}, got {op!r}")
            arr = np.asarray(x)
            if not np.issubdtype(arr.dtype, np.floating):
                raise ValueError(f"x must be a floating-point array (float16/32/64), got dtype {arr.dtype}")
        except Exception as err:
            error = err
        numel = 0 if error is not None else arr.size
        try:
            rnd = self._engine.open_stream(self._ops, self._stages, exchange=exchange, elements=numel,
                                           error=_text(error), collect=error is None and self._collects(collect))
        except CollectiveTimeout:
            raise
        except ProtocolError as err:
            exc = RuntimeError if error is not None and not isinstance(error, ValueError) else ValueError
            raise exc(self._explain(err, error, numel, "could not encode the input of")) from None
        result: dict = {}
        if numel:
            rnd.add(arr.ravel(), numel, lambda decoded, failure: result.update(decoded=decoded, failure=failure))
            rnd.wait()
        failure = result.get("failure")
        if isinstance(failure, ProtocolError) and not isinstance(failure, CollectiveTimeout):
            raise ValueError(f"{_PREFIX}: {failure}") from None
        if failure is not None:
            raise failure
        stats = rnd.close()
        self._calls_since_adapt += 1
        if stats is not None:
            self._pending = _add(self._pending, stats[0])
            self._pending_second = _add(self._pending_second, stats[1])
        return arr, result.get("decoded")

    def reduce(self, payloads: list[np.ndarray], *, op: str = "average", dtype: Any = np.float32) -> np.ndarray:
        """Check and decode payloads (e.g. from :meth:`allgather`), made with this configuration and
        levels, and average (or sum) them in list order. Local. Returns shape (n,), ``dtype``
        (float16/32/64; summed in float64 for float64, else in float32)."""
        if op not in _OPS:
            raise ValueError(f"op must be one of {_OPS}, got {op!r}")
        if not payloads:
            raise ValueError("no payloads to reduce")
        dtype = np.dtype(dtype)
        parts = [np.frombuffer(p, dtype=np.uint8) for p in payloads]
        try:
            numel = parse_header(parts[0]).numel
        except ValueError as err:
            raise ValueError(f"{_PREFIX}: payload 0: {err}") from None
        gathered = np.concatenate(parts)
        try:
            offsets = check_payloads(self._ops, gathered, [numel] * len(parts), self._quantizer, "reduce")
        except ProtocolError as err:
            raise ValueError(f"{_PREFIX}: {err}") from None
        total = np.zeros(numel, dtype=np.float64 if dtype == np.float64 else np.float32)
        self._ops.decode_sum(total, gathered, offsets, self._quantizer)
        if op == "average":
            total /= total.dtype.type(len(parts))
        return total.astype(dtype, copy=False)

    def _collects(self, collect: bool | None) -> bool:
        if not self._method.adaptive:
            return False
        if collect is not None:
            return bool(collect)
        return self._collect_every > 0 and self._calls_since_adapt % self._collect_every == 0

    def _explain(self, err: ProtocolError, error: Exception | None, numel: int, what: str) -> str:
        """A failed handshake's message: the ranks at fault (:func:`~horovod_alq.exchange.engine.blame`),
        else the handshake's own."""
        why = blame(self._transport, _text(error), numel, "messages", what)
        return f"{_PREFIX}: {err if why is None else why}"

    # ----------------------------------------------------------------- adaptation
    def adapt(self, stats: np.ndarray | None = None) -> bool:
        """Refit the levels from the statistics of all ranks (:meth:`Engine.refit`). Collective.

        Every rank contributes what it recorded since the last ``adapt()`` (or ``stats``, a vector
        from :meth:`Quantizer.statistics`); the recorded statistics are cleared. Returns whether the
        levels changed (False for fixed methods, or when no rank recorded a finite non-zero bucket).
        Raises, on every rank: ValueError when the ranks' configurations or levels differ or a
        rank's ``stats`` is malformed; RuntimeError when the fit failed on some rank or the ranks
        reached different levels (the previous levels are restored)."""
        local = self._pending if stats is None else stats
        first, error = None, None
        try:
            if local is not None:
                first = np.asarray(local, dtype=np.float64)
                if first.shape != (self._stats_length,):
                    raise ValueError(f"stats has shape {first.shape}, {self.method} expects {(self._stats_length,)}")
                if not np.isfinite(first).all():
                    raise ValueError("stats has non-finite entries")
        except (TypeError, ValueError) as err:
            error = err
        second = self._pending_second if stats is None else None
        try:
            updated = self._engine.refit(first, second, self._transport, error=_text(error))
        except RefitError as err:
            self._clear()
            raise RuntimeError(f"{_PREFIX}: {err}") from None
        except CollectiveTimeout:
            raise
        except ProtocolError as err:  # the handshake: nothing was combined, this rank keeps its statistics
            raise ValueError(self._explain(err, error, 0, "could not adapt on")) from None
        self._clear()
        return updated

    def _clear(self) -> None:
        self._pending = self._pending_second = None
        self._calls_since_adapt = 0

    # ----------------------------------------------------------------- metrics and state
    def metrics(self) -> dict:
        """The framework compressors' keys (:meth:`horovod_alq.core.rounds.RoundState.metrics`);
        ``step`` counts calls, ``uncompressed_coordinates`` is always 0 (every array is quantized)."""
        return self._state.metrics()

    def state_dict(self) -> dict:
        """Levels (both quantizers), counters, and this rank's seed and pending statistics. Loaded on
        another rank, the seed and pending statistics are not taken (that rank keeps its own stream)."""
        return {**self._state.state_dict(), "rank": self._rank, "seed": self._engine.seed,
                "calls_since_adapt": self._calls_since_adapt,
                "pending": None if self._pending is None else self._pending.copy(),
                "pending_second": None if self._pending_second is None else self._pending_second.copy()}

    def load_state_dict(self, state: dict) -> None:
        """Restore a :meth:`state_dict` (same method, bits and bucket size). Local: load the same
        levels on every rank, or the next call fails with a mismatch on every rank."""
        same_rank = state.get("rank") == self._rank
        state = dict(state, quantizer=dict(state["quantizer"]))
        if not same_rank:
            state["quantizer"]["rng"] = None
        self._state.load_state_dict(state)
        self._calls_since_adapt = int(state["calls_since_adapt"])
        if same_rank and state.get("seed") is not None:
            self._engine.seed = int(state["seed"])
        self._pending = _array(state.get("pending") if same_rank else None)
        self._pending_second = _array(state.get("pending_second") if same_rank else None)


def _text(error: Exception | None) -> str | None:
    return None if error is None else f"{type(error).__name__}: {error}"


def _array(values) -> np.ndarray | None:
    return None if values is None else np.array(values, dtype=np.float64)


def _add(total: np.ndarray | None, stats: np.ndarray | None) -> np.ndarray | None:
    return total if stats is None else stats if total is None else total + stats
