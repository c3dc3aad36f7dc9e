"""The mpi4py front-end, :class:`QuantizedAllreduce` (the package docstring tells how it works)."""

from __future__ import annotations

from typing import Any

import numpy as np
from mpi4py import MPI

from .. import compressor_mixins as mixins
from ..core.methods import get_method
from ..core.protocol import CollectiveTimeout, ProtocolError, error_text, stable_hash
from ..core.quantizer import Quantizer
from ..core.statistics import statistics_length
from ..core.wire import parse_header
from ..exchange import registry
from ..exchange.numpy_ops import NumpyOps
from ..exchange.payloads import check_payloads
from ..exchange.refit import RefitError
from ..settings import Settings, configure
from . import inputs
from .blame import blame
from .pending import Pending, without_rng
from .transport import MpiTransport

__all__ = ["QuantizedAllreduce"]

_PREFIX = "horovod_alq.mpi"


class QuantizedAllreduce(mixins.Configured):
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
    method, bits, bucket_size, **keywords
        The shared settings, :class:`horovod_alq.settings.Settings` (its fields as keywords;
        None: the default). ``bits="auto"``: a width per array of a call's list, chosen by
        :meth:`adapt` under ``bit_budget``. ``clip`` (TernGrad) is served here; levels are refit by
        :meth:`adapt`. A setting mpi4py does not serve raises ValueError naming why
        (:data:`horovod_alq.settings.NOT_SERVED`; the table in docs/guides/settings.md).
    settings : horovod_alq.settings.Settings, optional
        Settings to start from; the keywords given override them.
    collect_every : int, optional
        Which calls record this rank's statistics for the next :meth:`adapt`: every
        ``collect_every``-th call since the last one (default 1 for adaptive methods); 0: only calls
        made with ``collect=True``. Recording costs a local pass over the array (docs/guides/mpi4py.md).
    Notes
    -----
    Results have the input's dtype (float16, float32 or float64) and shape; the sum over ranks is
    taken in float32 (:meth:`reduce` can sum in float64).
    """

    FRONT_END = "mpi4py"

    def __init__(
        self,
        comm: MPI.Intracomm,
        method: str | None = None,
        bits: int | str | None = None,
        bucket_size: int | None = None,
        *,
        settings: Settings | None = None,
        collect_every: int | None = None,
        **keywords,
    ) -> None:
        if not isinstance(comm, MPI.Comm) or comm == MPI.COMM_NULL:
            raise TypeError(f"comm must be an mpi4py intracommunicator, got {comm!r}")
        if comm.Is_inter():
            raise ValueError("comm is an intercommunicator; pass an intracommunicator (e.g. Merge() it)")
        self._comm, self._rank, self._size = comm, comm.Get_rank(), comm.Get_size()
        self.settings = s = Settings.of(
            settings, self.FRONT_END, method=method, bits=bits, bucket_size=bucket_size, **keywords
        )
        self._method = get_method(s.method)
        setup = configure(s, on_request=True)  # refits: adapt() only
        self._quantizer, self._state = setup.quantizer, setup.state
        if collect_every is None:
            collect_every = 1 if self._method.adaptive else 0
        if isinstance(collect_every, bool) or not isinstance(collect_every, (int, np.integer)) or collect_every < 0:
            raise ValueError(
                f"collect_every must be a non-negative integer (0: only on request), got {collect_every!r}"
            )
        self._collect_every = int(collect_every)
        self._stats_length = statistics_length(self._method)
        self._pending = Pending(self._state.auto is not None)  # recorded for the next adapt()
        self._transport = MpiTransport(comm, s.timeout)
        # MPI pairs by call order: one transport for every stage
        self._stages = [self._transport] * registry.max_stages()
        self._ops = NumpyOps()
        self._engine = setup.engine(uid="mpi", fusion_bytes=0, early=False)

    @property
    def comm(self) -> MPI.Intracomm:
        return self._comm

    @property
    def method(self) -> str:
        return self._method.name

    @property
    def quantizer(self) -> Quantizer:
        """The NumPy codec and its levels (``bits="auto"``: the default width's); change its levels
        on all ranks alike, or calls will fail."""
        return self._quantizer

    def __repr__(self) -> str:
        return (
            f"QuantizedAllreduce({self.method!r}, bits={self.bits}, bucket_size={self.bucket_size}, "
            f"rank {self._rank} of {self._size})"
        )

    # ----------------------------------------------------------------- exchange
    def __call__(
        self, x: Any, *, op: str = "average", collect: bool | None = None, scales: Any = None, key: Any = None
    ) -> np.ndarray | list[np.ndarray]:
        """Quantized average (``op="sum"``: sum) over the communicator of ``x``: an array (any shape,
        float16/32/64), or a list or tuple of arrays exchanged in one round (one handshake, one
        payload per rank; each array starts on a bucket boundary, so it is quantized as it would be
        alone; with ``bits="auto"`` each is one tensor of the allocation). Every rank passes the
        same element counts in the same order (shapes may differ); a list of numbers is a list of
        0-d arrays (pass ``np.asarray(values)`` for one array).
        ``collect``: record this rank's statistics for the next :meth:`adapt` (None: as
        ``collect_every``). ``scales``: preconditioned quantization (docs/design/design.md,
        "Preconditioned quantization"): a positive, finite scale array per array (``x``'s shape; one
        array, or a list like ``x``), identical on every rank (its digest is in the handshake: ranks
        whose scales differ raise on every rank); each array is quantized as ``x * w`` and returned
        as ``decoded / w``. ``key`` (required with ``error_feedback=True``): what ``x`` is, the
        key of its error-feedback buffer (a name; for a list, one per array, or one name), the
        same at every call for the same array: arrays that alternate on one instance keep their
        own errors. Collective.

        Returns the shape and dtype of ``x`` (a list: one array per array), bit-identical on all
        ranks. Raises ValueError on every rank when some rank's input is not a floating-point
        array, the element counts differ, or a payload was made with another method,
        bits, bucket size or levels."""
        listed = isinstance(x, (list, tuple))
        if scales is not None and not listed:
            scales = [scales]
        arrays, decoded, starts = self._round(list(x) if listed else [x], listed, collect, op, scales=scales, key=key)
        outs = []
        for i, (arr, start) in enumerate(zip(arrays, starts)):
            out = np.zeros(0, np.float32) if not arr.size else decoded.read(start, start + arr.size)
            if op == "average":
                out /= np.float32(self._size)
            if scales is not None and arr.size:
                out = out / self._scales[i].reshape(-1)
            outs.append(out.astype(arr.dtype, copy=False).reshape(arr.shape))
        return outs if listed else outs[0]

    def allgather(self, x: Any, *, collect: bool | None = None) -> list[np.ndarray]:
        """Encode ``x`` (one array), allgather the payloads and check every rank's header. Collective.

        Returns one payload per rank (1-D uint8 views, rank order), e.g. to decode later with
        :meth:`reduce` or with the framework kernels, which read the same bytes. Not with
        ``bits="auto"`` (ValueError on every rank)."""
        refusal = (
            None
            if self.bit_budget is None
            else ValueError("allgather() returns payloads of one width: not with bits='auto' (call the allreduce)")
        )
        refusal = refusal or (
            None
            if self._state.feedback is None
            else ValueError(
                "allgather() returns this call's payloads: not with error_feedback=True (use the allreduce)"
            )
        )
        arrays, decoded, _ = self._round([x], False, collect, None, exchange="allgather", refusal=refusal)
        q = self._quantizer
        if decoded is None:  # no coordinates: every rank's payload is the same bare header
            return [q.encode(arrays[0].ravel()) for _ in range(self._size)]
        piece = decoded.pieces[0]
        size = len(piece.payloads) // self._size
        return [piece.payloads[o : o + size] for o in piece.offsets]

    def _round(
        self,
        xs: list,
        listed: bool,
        collect: bool | None,
        op: str | None,
        exchange: str | None = None,
        refusal: Exception | None = None,
        scales: Any = None,
        key: Any = None,
    ):
        """One streamed round for the arrays ``xs``: the arrays, the ``Decoded`` sum over the ranks
        of their round (None when they hold no element) and each array's start in it. A local
        error (or ``refusal``) travels in the handshake, so that no rank waits alone."""
        arrays, error = [], refusal
        try:
            arrays, self._scales, self._keys = inputs.checked(
                xs, listed, op, scales, key, self._state.feedback is not None
            )
        except Exception as err:
            error = error or err
            self._scales = self._keys = None
        self._state.precondition = inputs.scales_digest(self._scales)
        counts = [int(a.size) for a in arrays] if error is None else [0]
        shown = counts if listed else counts[0]  # what the ranks must agree on
        numel = sum(counts)
        try:
            rnd = self._engine.open_stream(
                self._ops,
                self._stages,
                exchange=exchange,
                elements=numel,
                order=stable_hash(shown),
                error=error_text(error),
                collect=error is None and self._collects(collect),
            )
        except CollectiveTimeout:
            raise
        except ProtocolError as err:
            exc = RuntimeError if error is not None and not isinstance(error, ValueError) else ValueError
            raise exc(self._explain(err, error, shown, "could not encode the input of")) from None
        live = [a for a in arrays if a.size]  # bits="auto": each is the tensor (elements, 0) of the round
        result: dict = {}
        layout = None
        if live:
            flats = [np.ravel(a).astype(np.float32, copy=False) for a in live]
            if self._scales is not None:  # quantize x * w
                ws = [w for a, w in zip(arrays, self._scales) if a.size]
                flats = [f * w.reshape(-1) for f, w in zip(flats, ws)]
            layout = rnd.add(
                flats,
                numel,
                lambda decoded, failure: result.update(decoded=decoded, failure=failure),
                whole=True,
                idents=None if self._keys is None else [(k, a.size) for k, a in zip(self._keys, arrays) if a.size],
            )
            rnd.wait()
        failure = result.get("failure")
        if isinstance(failure, ProtocolError) and not isinstance(failure, CollectiveTimeout):
            raise ValueError(f"{_PREFIX}: {failure}") from None
        if failure is not None:
            raise failure
        self._pending.record(rnd.close(), rnd.keys)
        self._pending.calls += 1
        starts = iter(layout.starts if layout else ())
        return arrays, result.get("decoded"), [next(starts) if a.size else 0 for a in arrays]

    def reduce(self, payloads: list[np.ndarray], *, op: str = "average", dtype: Any = np.float32) -> np.ndarray:
        """Check and decode payloads (e.g. from :meth:`allgather`), made with this configuration and
        levels, and average (or sum) them in list order. Local. Returns shape (n,), ``dtype``
        (float16/32/64; summed in float64 for float64, else in float32)."""
        if op not in inputs.OPS:
            raise ValueError(f"op must be one of {inputs.OPS}, got {op!r}")
        if self.bit_budget is not None:
            raise ValueError("reduce() decodes payloads of one width: not with bits='auto'")
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
        return self._collect_every > 0 and self._pending.calls % self._collect_every == 0

    def _explain(self, err: ProtocolError, error: Exception | None, shown: Any, what: str, **differ: str) -> str:
        """A failed handshake's message: :func:`.blame.blame`'s, else the handshake's own."""
        why = blame(self._transport, error_text(error), shown, "messages", what, **differ)
        return f"{_PREFIX}: {err if why is None else why}"

    # ----------------------------------------------------------------- adaptation
    def adapt(self, stats: np.ndarray | None = None) -> bool:
        """Refit the levels from the statistics of all ranks (:meth:`Engine.refit`). Collective.

        Every rank contributes what it recorded since the last ``adapt()`` (or ``stats``, a vector
        from :meth:`Quantizer.statistics`); the recorded statistics are cleared. Returns whether the
        levels changed (False for fixed methods, or when no rank recorded a finite non-zero bucket).

        ``bits="auto"``: a collecting call records each array's row (its quantization error at
        every width and its statistics); later collecting calls of the same element counts add to
        it, a collecting call of other arrays replaces it. ``adapt()`` sums the rows over the
        ranks, gives each array the width that minimizes the total error under ``bit_budget`` and
        refits each width in use from its arrays' statistics; later calls of exactly these arrays
        use these widths, other calls ``floor(bit_budget)`` bits. Every rank must have recorded the
        same arrays; ``stats`` does not apply.

        Raises, on every rank: ValueError when the ranks' configurations, levels or recorded arrays
        differ or a rank's ``stats`` is malformed; RuntimeError when the fit failed on some rank or
        the ranks reached different levels (the previous levels are restored)."""
        first, error = self._pending.contribution(stats, self._stats_length, self.method)
        second = self._pending.second if stats is None else None
        keys = self._pending.keys if self._state.auto is not None else ()
        try:
            updated = self._engine.refit(first, second, self._transport, error=error_text(error), keys=keys)
        except RefitError as err:
            self._pending.clear()
            raise RuntimeError(f"{_PREFIX}: {err}") from None
        except CollectiveTimeout:
            raise
        except ProtocolError as err:  # the handshake: nothing was combined, this rank keeps its statistics
            raise ValueError(
                self._explain(
                    err,
                    error,
                    [n for n, _ in keys],
                    "could not adapt on",
                    differ="the ranks recorded different arrays since the last adapt() (elements per array)",
                )
            ) from None
        self._pending.clear()
        return updated

    # ----------------------------------------------------------------- metrics and state
    def metrics(self) -> dict:
        """The framework compressors' keys (:meth:`horovod_alq.core.rounds.RoundState.metrics`);
        ``step`` counts calls, ``uncompressed_coordinates`` is always 0 (every array is quantized)."""
        return self._state.metrics()

    def state_dict(self) -> dict:
        """Levels (both quantizers; ``bits="auto"``: every width's and the allocation), counters, and
        this rank's seed and pending statistics (``bits="auto"``: rows and ``pending_keys``). Loaded
        on another rank, the seed and pending statistics are not taken (that rank keeps its own stream)."""
        return {**self._state.state_dict(), "rank": self._rank, "seed": self._engine.seed, **self._pending.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Restore a :meth:`state_dict` (same method, bits and bucket size). Local: load the same
        levels on every rank, or the next call fails with a mismatch on every rank."""
        same_rank = state.get("rank") == self._rank
        if not same_rank:
            state = without_rng(state)
        self._state.load_state_dict(state)
        if same_rank and state.get("seed") is not None:
            self._engine.seed = int(state["seed"])
        self._pending.load_state_dict(state, same_rank)
