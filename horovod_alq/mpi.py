"""Quantized averaging of NumPy arrays over an mpi4py communicator, without a deep-learning framework.

For code outside PyTorch and TensorFlow (plain NumPy simulations, JAX with arrays converted at the
boundary, research code): the same ALQ / AMQ / QSGD / NUQSGD / TernGrad payloads as the Horovod
compressors (wire format of ``docs/design.md``), exchanged with MPI collectives::

    from mpi4py import MPI
    from horovod_alq.mpi import QuantizedAllreduce

    ar = QuantizedAllreduce(MPI.COMM_WORLD, method="alq", bits=3, bucket_size=8192)
    mean = ar(grad)    # NumPy in, NumPy out: the average over ranks of the decoded payloads
    ar.adapt()         # refit the levels from the statistics of every rank since the last adapt()

Per call: one ``Allgather`` of three int64 per rank (status, element count, payload bytes), then the
exchange engine of :mod:`horovod_alq.exchange` (the protocol's control vector and handshake, then
``exchange="allgather"``: one ``Allgatherv`` of the payloads, or ``"two-phase"``: an ``Alltoallv``
and an ``Allgatherv``), the same protocol and payloads as the Horovod compressors. Per
:meth:`~QuantizedAllreduce.adapt`: two tiny agreement ``Allreduce`` calls around one ``Allreduce``
(SUM) of the fixed-length statistics vector. Only mpi4py and :mod:`horovod_alq.core` are used.

Errors are collective: a bad input, a rank with a different array size, or a payload made with a
different configuration or levels raises on *every* rank of the communicator (no rank is left
waiting in a collective), naming the rank and what differs, and the communicator stays usable.
Exceptions raised *outside* these calls on one rank only (e.g. a typo in a script) still leave the
others waiting in their next collective; run scripts with ``mpiexec python -m mpi4py script.py``,
which aborts the whole job on an uncaught exception.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
from mpi4py import MPI

from .core.methods import NORMS, get_method
from .core.protocol import ProtocolError, resolve_timeout, wait_for
from .core.quantizer import Quantizer
from .core.rounds import RoundState
from .core.statistics import statistics_length
from .core.wire import check_header, parse_header, parse_payload
from .exchange import Engine

__all__ = ["QuantizedAllreduce"]

_PREFIX = "horovod_alq.mpi"
_OPS = ("average", "sum")
_U64 = np.uint64


def _rank_seed(seed: int | None, rank: int) -> int | None:
    """A per-rank seed derived from ``(seed, rank)``: independent rounding noise on every rank."""
    if seed is None:
        return None
    state = np.random.SeedSequence(int(seed), spawn_key=(int(rank),)).generate_state(4, np.uint32)
    return int.from_bytes(state.tobytes(), "little")


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
        request = self.comm.Iallgatherv([np.ascontiguousarray(payload), MPI.BYTE],
                                        [buf, (counts, self._displacements(counts)), MPI.BYTE])
        return self._waiter(request, buf, name)

    def alltoall(self, payload, splits, received, name):
        send, recv = [int(c) for c in splits], [int(c) for c in received]
        buf = np.empty(sum(recv), dtype=np.uint8)
        request = self.comm.Ialltoallv([np.ascontiguousarray(payload), (send, self._displacements(send)), MPI.BYTE],
                                       [buf, (recv, self._displacements(recv)), MPI.BYTE])
        return self._waiter(request, buf, name)

    def _allreduce(self, vec, dtype, op, name):
        out = np.empty(np.shape(vec), dtype=dtype)
        return self._waiter(self.comm.Iallreduce(np.ascontiguousarray(vec, dtype=dtype), out, op=op), out, name)()

    def allreduce_sum(self, vec, name):
        return self._allreduce(vec, np.float64, MPI.SUM, name)

    def allreduce_max(self, vec, name):
        return self._allreduce(vec, np.int64, MPI.MAX, name)


class NumpyOps:
    """The exchange engine's tensor ops on NumPy arrays, with the core's reference codec."""

    def stream(self, parts, starts, length, out=None, padding=()):
        if out is None:
            out = np.zeros(length, dtype=np.float32)
        else:
            for a, b in padding:
                out[a:b] = 0
        for part, start in zip(parts, starts):
            out[start: start + part.size] = part.ravel()
        return out

    def zeros(self, n):
        return np.zeros(n, dtype=np.float32)

    def empty(self, n):
        return np.empty(n, dtype=np.float32)

    def encode(self, x, quantizer, seed):
        return quantizer.encode(x, rng=np.random.default_rng(seed))

    def encode_parts(self, parts, starts, length, quantizer, seed):
        return None  # the reference codec encodes the stream

    def decode_sum(self, out, payloads, offsets, quantizer, *, start=0, numel=None, scale=1.0):
        out[:] = 0
        for offset in offsets:
            size = parse_header(payloads[offset:]).payload_size
            out += quantizer.decode(payloads[offset: offset + size])[start: start + out.size]
        if scale != 1.0:
            out *= np.float32(scale)

    def statistics(self, x, quantizer):
        return quantizer.statistics(x)

    def cat(self, parts):
        return np.concatenate(list(parts))

    def to_numpy(self, x):
        return x

    def from_numpy(self, a):
        return np.ascontiguousarray(a)


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
        0: no limit. (The per-call status allgather and :meth:`adapt`'s collectives still block.)

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
    precision; the sum over ranks is taken in float64 for float64 input and float32 otherwise.

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
        self._quantizer = Quantizer(method, bits, bucket_size, seed=_rank_seed(seed, self._rank), clip=clip,
                                    norm=norm)
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
        q = self._quantizer
        second = Quantizer(method, q.bits if bits_second is None else bits_second, q.bucket_size, norm=q.norm)
        self._state = RoundState(q, second=second)
        self._transport = MpiTransport(comm, timeout)
        self._ops = NumpyOps()
        self._engine = Engine(q, self._state, exchange=exchange, fusion_bytes=0,
                              seed=int.from_bytes(os.urandom(8), "little") if seed is None else int(seed),
                              uid="mpi", manual_refit=True)

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
        arr, stats = self._preflight(x, collect, op, encode=False)
        entry, vec = self._engine.add(arr.ravel(), arr.size, (arr.size,), "float", self._transport)
        reduced = self._transport.allreduce_sum(vec, "control")
        try:
            out, _ = self._engine.finish(entry, reduced, self._ops, self._transport)
        except ProtocolError as err:
            raise ValueError(f"{_PREFIX}: {err}") from None
        self._record(stats, self._engine.last_second_statistics)
        if op == "average":
            out /= np.float32(self._size)
        return out.astype(arr.dtype, copy=False).reshape(arr.shape)


    def allgather(self, x: Any, *, collect: bool | None = None) -> list[np.ndarray]:
        """Encode ``x``, exchange the payloads and check every rank's. Collective.

        The lower half of ``__call__``: use it to keep the payloads (e.g. to decode them later with
        :meth:`reduce`, or with the framework kernels, which read the same bytes).

        Returns
        -------
        list of np.ndarray (1-D uint8), one payload per rank in rank order
            Views into one receive buffer; each header has been checked against this rank's
            configuration and levels.
        """
        return self._exchange(x, collect, None)

    def _exchange(self, x: Any, collect: bool | None, op: str | None) -> list[np.ndarray]:
        arr, stats, payload = self._preflight(x, collect, op, encode=True)
        counts = [payload.size] * self._size
        buf = self._transport.allgather(payload, counts, "payloads")()
        parts = [buf[i * payload.size: (i + 1) * payload.size] for i in range(self._size)]
        self._check_payloads(parts, arr.size)
        st = self._state
        st.step += 1
        st.payload_bytes += payload.size
        st.bytes_sent += (self._size - 1) * payload.size
        st.bytes_received += (self._size - 1) * payload.size
        st.coordinates += arr.size
        self._record(stats, None)
        return parts

    def _preflight(self, x: Any, collect: bool | None, op: str | None, encode: bool):
        """Every local check, and what only this rank can compute, then one ``Allgather`` of
        (status, element count, payload bytes): a failure on one rank raises on every rank."""
        q = self._quantizer
        arr, payload, stats, numel, error = None, None, None, -1, None
        try:
            if op is not None and op not in _OPS:
                raise ValueError(f"op must be one of {_OPS}, got {op!r}")
            arr = np.asarray(x)
            if not np.issubdtype(arr.dtype, np.floating):
                raise ValueError(f"x must be a floating-point array (float16/32/64), got dtype {arr.dtype}")
            numel = arr.size
            if encode:
                payload = q.encode(arr)
            if self._collects(collect):
                stats = q.statistics(arr)
        except Exception as err:  # reported to every rank below, so that no rank waits alone
            error = err

        status = np.array([0 if error is None else 1, numel, 0 if payload is None else payload.size], dtype=np.int64)
        table = np.empty((self._size, 3), dtype=np.int64)
        self._comm.Allgather(status, table)
        if table[:, 0].any():
            self._raise_input_errors(table, error)
        if not (table[:, 1] == numel).all():
            sizes = ", ".join(f"rank {r}: {int(n)}" for r, n in enumerate(table[:, 1]))
            raise ValueError(f"{_PREFIX}: the ranks passed arrays with different element counts ({sizes})")
        return (arr, stats, payload) if encode else (arr, stats)

    def _record(self, stats: np.ndarray | None, second: np.ndarray | None) -> None:
        """Count the call and keep this rank's statistics for the next :meth:`adapt`."""
        self._calls_since_adapt += 1
        if stats is not None:
            self._pending = stats if self._pending is None else self._pending + stats
            if second is not None:
                self._pending_second = second if self._pending_second is None else self._pending_second + second

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
        acc_dtype = np.float64 if dtype == np.float64 else np.float32
        total = None
        for rank, payload in enumerate(payloads):
            try:
                values = self._quantizer.decode(payload)
            except ValueError as err:
                raise ValueError(f"{_PREFIX}: payload {rank}: {err}") from None
            if total is None:
                total = values.astype(acc_dtype)
            elif values.size != total.size:
                raise ValueError(f"{_PREFIX}: payload {rank} has {values.size} elements, payload 0 has {total.size}")
            else:
                total += values
        if op == "average":
            total /= acc_dtype(len(payloads))
        return total.astype(dtype, copy=False)

    def _collects(self, collect: bool | None) -> bool:
        if not self._method.adaptive:
            return False
        if collect is not None:
            return bool(collect)
        return self._collect_every > 0 and self._calls_since_adapt % self._collect_every == 0

    def _raise_input_errors(self, table: np.ndarray, error: Exception | None) -> None:
        """Some rank failed to encode: share the messages (every rank takes this branch) and raise."""
        mine = None if error is None else f"{type(error).__name__}: {error}"
        messages = self._comm.allgather(mine)
        failed = [f"rank {r}: {m}" for r, m in enumerate(messages) if m is not None]
        text = f"{_PREFIX}: could not encode the input of " + "; ".join(failed)
        if isinstance(error, ValueError) or error is None:
            raise ValueError(text) from error
        raise RuntimeError(text) from error

    def _check_payloads(self, parts: list[np.ndarray], numel: int) -> None:
        """Every rank checks every payload, so every rank sees (and raises on) any mismatch."""
        q = self._quantizer
        problems = []
        for rank, part in enumerate(parts):
            try:
                header, _, _ = parse_payload(part)
                check_header(header, self._method.id, q.bits, q.bucket_size, q.fingerprint, q.norm)
                if header.numel != numel:
                    raise ValueError(f"payload has {header.numel} elements, the ranks' arrays have {numel}")
            except ValueError as err:
                problems.append(f"rank {rank}: {err}")
        if problems:
            raise ValueError(f"{_PREFIX}: payloads do not match the configuration of rank {self._rank} "
                             f"({self.method}, bits={q.bits}, bucket_size={q.bucket_size}): " + "; ".join(problems))

    # ----------------------------------------------------------------- adaptation
    def adapt(self, stats: np.ndarray | None = None) -> bool:
        """Refit the levels from the statistics of all ranks. Collective.

        Every rank contributes the statistics it recorded since the last ``adapt()`` (or ``stats``,
        a vector from :meth:`Quantizer.statistics`, instead); they are summed with one
        ``Allreduce`` and every rank fits the same levels from the same vector. Before, the ranks
        check that they share method, bits, bucket size and levels; after, that they reached the
        same levels. The recorded statistics are cleared.

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
        q = self._quantizer
        local = self._pending if stats is None else stats
        error = None
        vec = np.zeros(self._stats_length, dtype=np.float64)
        try:
            if local is not None:
                arr = np.asarray(local, dtype=np.float64)
                if arr.shape != vec.shape:
                    raise ValueError(f"stats has shape {arr.shape}, {self.method} expects {vec.shape}")
                if not np.isfinite(arr).all():
                    raise ValueError("stats has non-finite entries")
                vec[:] = arr
        except (TypeError, ValueError) as err:
            error = f"{type(err).__name__}: {err}"
        fields = {"stats": 0 if error is None else 1, "method": self._method.id, "norm": NORMS[q.norm], "bits": q.bits,
                  "bucket_size": q.bucket_size, "levels": q.fingerprint}
        self._agree(fields, error)

        second = self._state.second
        # the owners' statistics of reduced shards (two-phase): refit the second quantizer as well
        own_second = self._pending_second if stats is None else None
        vec2 = np.zeros(self._stats_length, dtype=np.float64) if own_second is None else own_second
        self._pending = self._pending_second = None
        self._calls_since_adapt = 0
        if not self._method.adaptive:
            return False
        total = np.empty(2 * vec.size, dtype=np.float64)
        self._comm.Allreduce(np.concatenate([vec, vec2]), total, op=MPI.SUM)
        fit_first, fit_second = total[0] > 0, total[vec.size] > 0 and self._state.adapt_second
        if not fit_first:
            return False
        previous = (q.state_dict(), second.state_dict())
        error = None
        try:
            q.adapt(total[:vec.size])
            self._state.refitted_first()
            if fit_second:
                second.adapt(total[vec.size:])
        except Exception as err:  # made collective by the agreement below
            error = f"{type(err).__name__}: {err}"
        try:
            self._agree({"fit": 0 if error is None else 1, "levels": q.fingerprint,
                         "second": second.fingerprint}, error, exc=RuntimeError, after=True)
        except RuntimeError:
            q.load_state_dict(previous[0])
            second.load_state_dict(previous[1])
            raise
        self._state.level_updates += 1
        return True

    def _agree(self, fields: dict[str, int], error: str | None, exc: type = ValueError, after: bool = False) -> None:
        """Check that ``fields`` (non-negative ints < 2**64) are equal on all ranks; raise on all if not.

        One ``Allreduce`` (MAX) of the values and their bitwise complements gives every rank the
        maximum and the minimum of each field.
        """
        values = np.array(list(fields.values()), dtype=_U64)
        both = np.concatenate([values, ~values])
        out = np.empty_like(both)
        self._comm.Allreduce(both, out, op=MPI.MAX)
        k = values.size
        hi, lo = out[:k], ~out[k:]
        names = list(fields)
        if hi[0] != 0:  # the first field flags a local error on some rank: share the messages
            messages = self._comm.allgather(error)
            failed = "; ".join(f"rank {r}: {m}" for r, m in enumerate(messages) if m is not None)
            what = "refit the levels" if after else "adapt"
            raise exc(f"{_PREFIX}: could not {what} on {failed}")
        differ = [i for i in range(1, k) if hi[i] != lo[i]]
        if differ:
            detail = ", ".join(
                f"{names[i]} (from {int(lo[i]):#018x} to {int(hi[i]):#018x})" if names[i] == "levels"
                else f"{names[i]} (from {int(lo[i])} to {int(hi[i])})" for i in differ)
            if after:
                raise exc(f"{_PREFIX}: ranks reached different levels from the same statistics: {detail}; "
                          f"do all ranks run the same NumPy and SciPy? Previous levels restored")
            raise exc(f"{_PREFIX}: ranks differ in {detail}; every rank must use the same configuration and "
                      f"levels")

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
