"""Quantized averaging of NumPy arrays over an mpi4py communicator, without a deep-learning framework.

For code outside PyTorch and TensorFlow (plain NumPy simulations, JAX with arrays converted at the
boundary, research code): the same ALQ / AMQ / QSGD / NUQSGD / TernGrad payloads as the Horovod
compressors (wire format of ``docs/design.md``), exchanged with MPI collectives::

    from mpi4py import MPI
    from horovod_alq.mpi import QuantizedAllreduce

    ar = QuantizedAllreduce(MPI.COMM_WORLD, method="alq", bits=3, bucket_size=8192)
    mean = ar(grad)    # NumPy in, NumPy out: the average over ranks of the decoded payloads
    ar.adapt()         # refit the levels from the statistics of every rank since the last adapt()

Every call is one streamed round of the exchange engine (:mod:`horovod_alq.exchange`, the protocol
and payloads of the Horovod compressors): its handshake (one tiny ``Allreduce``: settings, levels,
round number, element count and whether some rank's input is bad), then ``exchange="allgather"``:
one ``Allgatherv`` of the payloads, or ``"two-phase"``: an ``Alltoallv`` and an ``Allgatherv``.
:meth:`~QuantizedAllreduce.adapt` is the engine's refit (:meth:`Engine.refit`): a handshake, one
``Allreduce`` (SUM) of the fixed-length statistics vectors, and a handshake on the new levels. Only
mpi4py and :mod:`horovod_alq.core` are used; every wait is bounded (``timeout=``).

Errors are collective: a bad input, a rank with a different array size, or a payload made with a
different configuration or levels raises on *every* rank of the communicator (no rank is left
waiting in a collective), naming the rank and what differs, and the communicator stays usable.
Exceptions raised *outside* these calls on one rank only (e.g. a typo in a script) still leave the
others waiting in their next collective until its timeout; run scripts with
``mpiexec python -m mpi4py script.py``, which aborts the whole job on an uncaught exception.
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np
from mpi4py import MPI

from .core.methods import get_method
from .core.protocol import CollectiveTimeout, ProtocolError
from .core.quantizer import Quantizer
from .core.rounds import RefitSchedule, RoundState
from .core.statistics import statistics_length
from .core.wire import parse_header, payload_size
from .exchange import Engine
from .exchange.base import check_payloads
from .exchange.engine import RefitError
from .exchange.numpy_ops import NumpyOps
from .mpi_transport import MpiTransport

__all__ = ["QuantizedAllreduce"]

_PREFIX = "horovod_alq.mpi"
_OPS = ("average", "sum")


class QuantizedAllreduce:
    """Average NumPy arrays over an mpi4py communicator with quantized, allgathered payloads.

    Every rank encodes its array with the NumPy core (:class:`horovod_alq.core.Quantizer`), the
    payloads are allgathered, and every rank decodes all of them and averages: all ranks return
    bit-identical arrays, an unbiased estimate of the exact average. Adaptive methods (ALQ, AMQ)
    refit their levels in :meth:`adapt` from statistics summed over the communicator, so all ranks
    switch to the same (bit-identical) levels at the same call.

    Parameters
    ----------
    comm : mpi4py.MPI.Intracomm
        Any intracommunicator: ``MPI.COMM_WORLD``, or a sub-communicator from ``Split`` /
        ``Create``; each communicator exchanges independently. Every rank of ``comm`` must make the
        same calls (``__call__``, :meth:`adapt`) in the same order, as for any MPI collective.
    method : str
        ``"alq"``, ``"alq-n"``, ``"amq"``, ``"amq-n"`` (adaptive), ``"qsgdinf"``, ``"qsgd"``,
        ``"nuqsgd"``, ``"terngrad"`` (fixed levels); see :class:`~horovod_alq.core.Quantizer`.
    bits : int, optional
        Bits per coordinate on the wire, 2..8 (default 3; TernGrad: 2).
    bucket_size : int
        Coordinates sharing one float32 norm (default 8192). Fewer bits per coordinate with larger
        buckets, but L2-normalized coordinates get smaller, which fixed levels handle badly.
    seed : int, optional
        Each rank draws its rounding noise from its own stream derived from ``(seed, rank in comm)``,
        so runs repeat exactly while the ranks' noise stays independent. None: fresh entropy.
    clip : bool or float
        TernGrad only: clip buckets at this many standard deviations (biased; off by default).
    exchange : {"auto", "allgather", "two-phase"}
        How payloads travel (see :class:`horovod_alq.torch.ALQCompressor`); ``auto`` is two-phase
        from 4 ranks on. The two-phase exchange re-quantizes the summed shards with a second
        quantizer (``bits_second`` bits, default ``bits``): at equal bits it takes the first
        quantizer's levels at every :meth:`adapt`; with other bits :meth:`adapt` refits it from the
        statistics of the reduced shards.
    bits_second : int, optional
    norm : {"l2", "linf"}, optional
        Bucket norm (adaptive methods take either; None: the method's default); see
        :class:`~horovod_alq.core.Quantizer`.
    collect_every : int, optional
        Which calls record this rank's statistics for the next :meth:`adapt`: every
        ``collect_every``-th call since the last :meth:`adapt` (1, the default for adaptive methods:
        every call); 0: only calls made with ``collect=True``. Fixed methods never collect. With an
        adaptive method that you never :meth:`adapt`, pass 0 to skip the statistics' cost.
    timeout : float, optional
        Seconds to wait for one of the exchange's collectives (payloads, handshake) before raising
        an error that names it and the likely causes; default ``$HOROVOD_ALQ_TIMEOUT``, else 300;
        0: no limit. Every collective of a call and of :meth:`adapt` is bounded by it.

    Notes
    -----
    Why statistics are recorded on every call by default: it makes the two-line use above correct
    (``adapt()`` refits from everything the ranks averaged since the last refit, with no bookkeeping
    by the caller), and the cost is local (no communication happens until :meth:`adapt`). The cost
    is one more pass over the array: about a third of an encode with the default bucket size, but
    for the norm-based methods (``alq``, ``amq``) it grows as buckets shrink (the statistics
    evaluate an 801-point CDF per bucket: about 10 encodes' worth at ``bucket_size=512``). If that
    matters, pass ``collect_every=0`` and ``collect=True`` on the calls just before ``adapt()``
    (the paper refits from the current gradients at a few iterations only). Ranks may collect on
    different calls: their vectors are summed, and every use of the sum is a ratio.

    Output dtype: the input's (float16, float32 or float64) and shape, so the call is a drop-in
    replacement for an exact average. Payloads carry float32 values, so this does not add
    precision; the sum over ranks is taken in float32 (:meth:`reduce` can sum in float64).

    Examples
    --------
    >>> ar = QuantizedAllreduce(MPI.COMM_WORLD, "amq", bits=4, bucket_size=1024, seed=0)
    >>> for step in range(steps):
    ...     params -= lr * ar(local_gradient(params))
    ...     if step in (0, 100, 2000):
    ...         ar.adapt()
    >>> ar.metrics()["bits_per_coordinate"]
    """

    def __init__(
        self,
        comm: MPI.Intracomm,
        method: str = "alq",
        bits: int | None = None,
        bucket_size: int = 8192,
        *,
        seed: int | None = None,
        clip: bool | float = False,
        collect_every: int | None = None,
        exchange: str = "auto",
        bits_second: int | None = None,
        norm: str | None = None,
        timeout: float | None = None,
    ) -> None:
        if not isinstance(comm, MPI.Comm) or comm == MPI.COMM_NULL:
            raise TypeError(f"comm must be an mpi4py intracommunicator, got {comm!r}")
        if comm.Is_inter():
            raise ValueError("comm is an intercommunicator; pass an intracommunicator (e.g. Merge() it)")
        self._comm = comm
        self._rank = comm.Get_rank()
        self._size = comm.Get_size()
        self._method = get_method(method)
        self._quantizer = q = Quantizer(method, bits, bucket_size, clip=clip, norm=norm)
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
        second = Quantizer(method, q.bits if bits_second is None else bits_second, q.bucket_size, norm=q.norm)
        self._state = RoundState(q, RefitSchedule((), 0), second)  # refits: adapt() only
        self._transport = MpiTransport(comm, timeout)
        self._stages = [self._transport] * 2  # MPI pairs by call order: one transport for every stage
        self._ops = NumpyOps()
        self._engine = Engine(q, self._state, exchange=exchange, fusion_bytes=0,
                              seed=int.from_bytes(os.urandom(8), "little") if seed is None else int(seed),
                              uid="mpi")

    # ----------------------------------------------------------------- configuration
    @property
    def comm(self) -> MPI.Intracomm:
        return self._comm

    @property
    def quantizer(self) -> Quantizer:
        """The NumPy codec and its levels; change its levels on all ranks alike, or calls will fail."""
        return self._quantizer

    @property
    def method(self) -> str:
        return self._method.name

    @property
    def bits(self) -> int:
        return self._quantizer.bits

    @property
    def bucket_size(self) -> int:
        return self._quantizer.bucket_size

    @property
    def norm(self) -> str:
        """Bucket norm, ``"l2"`` or ``"linf"``."""
        return self._quantizer.norm

    @property
    def levels(self) -> np.ndarray:
        """Current levels, shape (L,), float64 (a copy); identical on all ranks."""
        return self._quantizer.levels

    def __repr__(self) -> str:
        return (f"QuantizedAllreduce({self.method!r}, bits={self.bits}, bucket_size={self.bucket_size}, "
                f"rank {self._rank} of {self._size})")

    # ----------------------------------------------------------------- exchange
    def __call__(self, x: Any, *, op: str = "average", collect: bool | None = None) -> np.ndarray:
        """Quantized average (or sum) of ``x`` over all ranks of the communicator. Collective.

        Parameters
        ----------
        x : array_like, any shape, float16 / float32 / float64
            This rank's array; every rank passes the same number of elements.
        op : {"average", "sum"}
            Average (default) or sum of the ranks' decoded payloads.
        collect : bool, optional
            Record this rank's statistics of ``x`` for the next :meth:`adapt`; None follows
            ``collect_every``.

        Returns
        -------
        np.ndarray, the shape and dtype of ``x``
            Bit-identical on all ranks.

        Raises
        ------
        ValueError
            On every rank: a rank's input is not a floating-point array, the ranks' element counts
            differ, or a payload was made with a different method, bits, bucket size or levels.
        """
        arr, decoded = self._round(x, collect, op)
        out = np.zeros(0, np.float32) if decoded is None else decoded.read(0, arr.size)
        if op == "average":
            out /= np.float32(self._size)
        return out.astype(arr.dtype, copy=False).reshape(arr.shape)

    def allgather(self, x: Any, *, collect: bool | None = None) -> list[np.ndarray]:
        """Encode ``x``, exchange the payloads and check every rank's. Collective.

        The lower half of ``__call__`` with the allgather exchange: use it to keep the payloads
        (e.g. to decode them later with :meth:`reduce`, or with the framework kernels, which read
        the same bytes).

        Returns
        -------
        list of np.ndarray (1-D uint8), one payload per rank in rank order
            Views into one receive buffer; each header has been checked against this rank's
            configuration and levels.
        """
        arr, decoded = self._round(x, collect, None, exchange="allgather")
        q = self._quantizer
        if decoded is None:  # no coordinates: every rank's payload is the same bare header
            return [q.encode(arr.ravel()) for _ in range(self._size)]
        piece = decoded.pieces[0]
        size = payload_size(arr.size, q.bits, q.bucket_size)
        return [piece.payloads[o: o + size] for o in piece.offsets]

    def _round(self, x: Any, collect: bool | None, op: str | None, exchange: str | None = None):
        """One streamed round of the engine for ``x``: the array and its ``Decoded`` sum over the
        ranks (None for an empty array). A local error travels in the handshake."""
        arr, error = None, None
        try:
            if op is not None and op not in _OPS:
                raise ValueError(f"op must be one of {_OPS}, got {op!r}")
            arr = np.asarray(x)
            if not np.issubdtype(arr.dtype, np.floating):
                raise ValueError(f"x must be a floating-point array (float16/32/64), got dtype {arr.dtype}")
        except Exception as err:  # reported to every rank by the handshake, so that no rank waits alone
            error = err
        numel = 0 if error is not None else arr.size
        try:
            rnd = self._engine.open_stream(self._ops, self._stages, exchange=exchange, elements=numel,
                                           error=None if error is None else f"{type(error).__name__}: {error}",
                                           collect=error is None and self._collects(collect))
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
        """Decode payloads (e.g. from :meth:`allgather`) and average or sum them. Local.

        Parameters
        ----------
        payloads : list of 1-D uint8 arrays or bytes-like, made with this configuration and levels
        op : {"average", "sum"}
        dtype : float16, float32 or float64
            Output dtype; the sum is taken in float64 for float64 and in float32 otherwise, adding
            the payloads in list order.

        Returns
        -------
        np.ndarray, shape (n,), ``dtype``
        """
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
        """A handshake failed, alike on every rank: share every rank's error and element count (one
        more exchange, on this path only) and name the ranks at fault; else the handshake's message."""
        shared = [json.loads(m) for m in self._share(json.dumps([None if error is None else
                                                                 f"{type(error).__name__}: {error}", numel]))]
        failed = [f"rank {r}: {m}" for r, (m, _) in enumerate(shared) if m is not None]
        if failed:
            return f"{_PREFIX}: {what} " + "; ".join(failed)
        if len({n for _, n in shared}) > 1:
            sizes = ", ".join(f"rank {r}: {n}" for r, (_, n) in enumerate(shared))
            return f"{_PREFIX}: the ranks passed arrays with different element counts ({sizes})"
        return f"{_PREFIX}: {err}"

    def _share(self, text: str) -> list[str]:
        """Every rank's ``text`` (bounded waits: the longest length, then one allgather)."""
        t = self._transport
        raw = np.frombuffer(text.encode(), dtype=np.uint8)
        n = int(t.allreduce_max(np.array([raw.size], dtype=np.int64), "messages.size")[0])
        buf = np.zeros(n, dtype=np.uint8)
        buf[:raw.size] = raw
        got = t.allgather(buf, [n] * t.size, "messages")()
        return [bytes(got[r * n:(r + 1) * n]).rstrip(b"\0").decode() for r in range(t.size)]

    # ----------------------------------------------------------------- adaptation
    def adapt(self, stats: np.ndarray | None = None) -> bool:
        """Refit the levels from the statistics of all ranks. Collective.

        Every rank contributes the statistics it recorded since the last ``adapt()`` (or ``stats``,
        a vector from :meth:`Quantizer.statistics`, instead); the engine's refit
        (:meth:`horovod_alq.exchange.Engine.refit`) checks that the ranks share method, bits,
        bucket size and levels, sums the vectors with one ``Allreduce``, fits the same levels on
        every rank and checks that the ranks reached the same levels. The recorded statistics are
        cleared.

        Returns
        -------
        bool
            True if the levels were refit; False for fixed methods and when no rank recorded a
            finite non-zero bucket (e.g. all-zero arrays): the levels stay.

        Raises
        ------
        ValueError
            On every rank: the ranks' configurations or current levels differ, or a rank's
            ``stats`` has the wrong length or non-finite entries.
        RuntimeError
            On every rank: the fit failed on some rank, or the ranks reached different levels
            (e.g. different NumPy / SciPy versions); the previous levels are restored.
        """
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
            updated = self._engine.refit(first, second, self._transport,
                                         error=None if error is None else f"{type(error).__name__}: {error}")
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
        """Levels (both quantizers), counters, and this rank's random state and pending statistics.

        Save every rank's state, or rank 0's only: loaded on another rank, the random state and
        pending statistics are not taken (that rank keeps its own stream); levels and counters are.
        """
        return {
            **self._state.state_dict(),
            "rank": self._rank,
            "seed": self._engine.seed,
            "calls_since_adapt": self._calls_since_adapt,
            "pending": None if self._pending is None else self._pending.copy(),
            "pending_second": None if self._pending_second is None else self._pending_second.copy(),
        }

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
        pending = state.get("pending") if same_rank else None
        self._pending = None if pending is None else np.array(pending, dtype=np.float64)
        pending = state.get("pending_second") if same_rank else None
        self._pending_second = None if pending is None else np.array(pending, dtype=np.float64)


def _add(total: np.ndarray | None, stats: np.ndarray | None) -> np.ndarray | None:
    return total if stats is None else stats if total is None else total + stats
