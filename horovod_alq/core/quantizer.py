"""The reference codec and adaptation entry point: :class:`Quantizer`.

Faghri et al., "Adaptive Gradient Quantization for Data-Parallel SGD" (NeurIPS 2020). The payload
layout and encoding rules are those of ``docs/design/design.md``; the framework kernels produce and consume
the same bytes.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from .methods import PAPER_NORM, Method, check_bits, check_norm, get_method, initial_levels, multiplier_levels
from .packing import pack_codes, unpack_codes
from .statistics import distribution_from_statistics, normalize, summarize
from .wire import HEADER_SIZE, Header, check_header, levels_fingerprint, pack_header, parse_payload, payload_size

_MAX_BUCKET = 2**32 - 1  # the header's bucket size field is a uint32
TERNGRAD_CLIP = 2.5  # standard deviations, as in Wen et al. (NeurIPS 2017)
#: (method, bits, bucket size, norm) -> the adaptive methods' starting (levels, multiplier), fitted
#: once per process (an 8-bit ALQ fit takes about a second).
_GAUSSIAN_STARTS: dict[tuple, tuple] = {}


def stochastic_round(r: np.ndarray, levels: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Unbiased stochastic rounding of normalized coordinates to level indices.

    For ``levels[j] <= r < levels[j+1]`` the code is ``j + 1`` with probability
    ``(r - levels[j]) / (levels[j+1] - levels[j])``, else ``j``; so ``E[levels[code]] = r``.

    Parameters
    ----------
    r : np.ndarray, shape (n,), float64
        Values in ``[levels[0], levels[-1]]``.
    levels : np.ndarray, shape (L,), float64
        Strictly increasing, ``L <= 256``.
    rng : np.random.Generator
        Source of the ``n`` uniform draws.

    Returns
    -------
    np.ndarray, shape (n,), uint8
    """
    j = np.searchsorted(levels, r, side="right") - 1
    np.clip(j, 0, levels.size - 2, out=j)
    lo = levels[j]
    p = (r - lo) / (levels[j + 1] - lo)
    return (j + (rng.random(r.shape) < p)).astype(np.uint8)


def gaussian_sigma(bucket_size: int, norm: str) -> float:
    """Scale of the normalized coordinates of a bucket of ``bucket_size`` i.i.d. Gaussian values:
    ``1 / sqrt(d)`` for L2 buckets, ``1 / m`` for max-abs buckets with ``m`` the median of the
    largest of ``d`` absolute standard normals (``P(max |z| <= m) = 1/2``). The adaptive methods
    start from the levels they fit to ``N(0, sigma**2)`` truncated to [-1, 1]."""
    d = int(bucket_size)
    if norm == "l2" or d == 1:
        return 1.0 / np.sqrt(d)
    from scipy.special import ndtri

    # (2 Phi(m) - 1)**d = 1/2, solved in a form that keeps precision for large d
    m = float(ndtri(1.0 - 0.5 * -np.expm1(np.log(0.5) / d)))
    return 1.0 / m


def check_code_entropy(method: Method, bits: int, value: Any) -> float | None:
    """``code_entropy`` as a float, None, or ValueError naming the problem."""
    if value is None:
        return None
    if method.adapts != "levels":
        raise ValueError(f"code_entropy fits adapted levels: it needs alq or alq-n, not {method.name!r}")
    if isinstance(value, bool) or not isinstance(value, (int, float, np.number)) or not 0.0 < value <= bits:
        raise ValueError(
            f"code_entropy must be a positive number of bits per coordinate up to bits={bits}, got {value!r}"
        )
    return float(value)


def _check_bucket_size(bucket_size: Any) -> int:
    if isinstance(bucket_size, bool) or not isinstance(bucket_size, (int, np.integer)):
        raise ValueError(f"bucket_size must be a positive integer, got {bucket_size!r}")
    if not 1 <= bucket_size <= _MAX_BUCKET:
        raise ValueError(f"bucket_size must be from 1 to {_MAX_BUCKET}, got {bucket_size}")
    return int(bucket_size)


class Quantizer:
    """Bucketed stochastic quantizer with fixed (QSGD, NUQSGD, TernGrad) or adaptive (ALQ, AMQ) levels.

    Parameters
    ----------
    method : str
        Adaptive: ``"alq"``, ``"alq-n"`` (adapted levels), ``"amq"``, ``"amq-n"`` (adapted multiplier
        ``p`` of the levels ``+-{p**s, ..., p, 1}``); the ``-n`` variants fit one truncated normal
        instead of the norm-weighted mixture. Adaptive methods start from the levels they fit to
        Gaussian gradients, i.e. normalized coordinates ``N(0, sigma**2)`` truncated to [-1, 1], with
        ``sigma = 1/sqrt(bucket_size)`` for L2 buckets and 1 / (median max-abs of ``bucket_size``
        standard normals) for max-abs buckets (:func:`gaussian_sigma`; NUQSGD's fixed levels, the
        paper's start, lose a factor of ~100 in variance at d = 8192 with L2 buckets).
        Fixed: ``"qsgdinf"``, ``"qsgd"``, ``"nuqsgd"``, ``"terngrad"``.
    bits : int, optional
        Bits per coordinate on the wire, 2 to 8 (``2**bits`` levels). Default 3; TernGrad sends its
        3 levels on 2 bits and only accepts (and defaults to) 2.
    bucket_size : int
        Coordinates sharing one float32 norm. Larger buckets cost fewer bits but make the normalized
        coordinates smaller (L2 norm), which fixed levels handle badly.
    seed : int or None
        Seed of the quantizer's own ``np.random.Generator``; each :meth:`encode` draws fresh numbers.
    clip : bool or float
        TernGrad only: clip each bucket at ``clip`` standard deviations of its values before
        quantizing (``True`` means 2.5, the TernGrad paper's choice). Off by default because clipping
        biases the estimate; it lowers the variance on heavy-tailed gradients.
    norm : {"l2", "linf"} or None
        Bucket norm. None: the method's default (``METHODS[method].norm``: ``"linf"`` for the
        adaptive methods). The adaptive methods take either: ``"linf"`` normalizes by the bucket's
        max-abs (as QSGDinf and TernGrad), so the end levels +-1 are the largest coordinate and the
        adapted interior levels cover the bulk; ``"l2"`` is the paper's form (Faghri et al.
        normalize by the bucket's L2 norm; at d = 8192 the coordinates are ~1/sqrt(d) and the end
        levels are almost never used). Fixed methods only take their own norm. The norm travels in
        the payload header.

    Examples
    --------
    >>> q = Quantizer("alq", bits=3, bucket_size=8192, seed=0)
    >>> payload = q.encode(grad)              # 1-D uint8
    >>> approx = q.decode(payload)            # float32, grad.size elements
    >>> q.adapt(q.statistics(grad))           # or the sum / mean of all workers' vectors
    """

    def __init__(
        self,
        method: str,
        bits: int | None = None,
        bucket_size: int = 8192,
        seed: int | None = None,
        clip: bool | float = False,
        norm: str | None = None,
        code_entropy: float | None = None,
    ) -> None:
        self._method: Method = get_method(method)
        self._norm = check_norm(self._method, norm)
        if bits is None:
            bits = 2 if self._method.name == "terngrad" else 3
        self._bits = check_bits(self._method, bits)
        self._bucket_size = _check_bucket_size(bucket_size)
        self._clip = self._check_clip(clip)
        self._code_entropy = check_code_entropy(self._method, self._bits, code_entropy)
        self._rng = np.random.default_rng(seed)
        self._multiplier: float | None = 0.5 if self._method.adapts == "multiplier" else None
        self._store_levels(initial_levels(self._method, self._bits))
        if self._method.adaptive:
            key = (self._method.name, self._bits, self._bucket_size, self._norm, self._code_entropy)
            if key not in _GAUSSIAN_STARTS:
                from .distributions import TruncatedNormal  # (loads SciPy: only adaptive methods need it)

                self._fit(TruncatedNormal(0.0, gaussian_sigma(self._bucket_size, self._norm)))
                _GAUSSIAN_STARTS[key] = (self._levels, self._multiplier)
            self._multiplier = _GAUSSIAN_STARTS[key][1]
            self._store_levels(_GAUSSIAN_STARTS[key][0])

    def _check_clip(self, clip: bool | float) -> float | None:
        if clip is False or clip is None:
            return None
        if self._method.name != "terngrad":
            raise ValueError(f"clip applies to terngrad only, not {self._method.name}")
        value = TERNGRAD_CLIP if clip is True else clip
        if isinstance(value, bool) or not isinstance(value, (int, float, np.number)) or not value > 0:
            raise ValueError(f"clip must be False, True or a positive number of standard deviations, got {clip!r}")
        return float(value)

    # ----------------------------------------------------------------- configuration
    @property
    def method(self) -> str:
        """Method name, e.g. ``"alq"``."""
        return self._method.name

    @property
    def bits(self) -> int:
        return self._bits

    @property
    def bucket_size(self) -> int:
        return self._bucket_size

    @property
    def norm(self) -> str:
        """Bucket norm, ``"l2"`` or ``"linf"``."""
        return self._norm

    @property
    def clip(self) -> float | None:
        """TernGrad clipping threshold in standard deviations, or None."""
        return self._clip

    @property
    def code_entropy(self) -> float | None:
        """The code entropy the levels are fitted for (bits per coordinate), or None: ALQ's fit."""
        return self._code_entropy

    @property
    def levels(self) -> np.ndarray:
        """Current levels, shape (L,), float64, sorted, from -1 to 1 (a copy)."""
        return self._levels.copy()

    @property
    def multiplier(self) -> float | None:
        """AMQ's multiplier ``p`` (levels ``+-{p**s, ..., p, 1}``); None for other methods."""
        return self._multiplier

    @property
    def fingerprint(self) -> int:
        """Levels fingerprint written into every payload header (uint64)."""
        return self._fingerprint

    def payload_bytes(self, numel: int) -> int:
        """Bytes of a payload of ``numel`` coordinates (:func:`~.wire.payload_size`)."""
        return payload_size(numel, self._bits, self.bucket_size)

    def __repr__(self) -> str:
        return f"Quantizer({self.method!r}, bits={self.bits}, bucket_size={self.bucket_size}, norm={self.norm!r})"

    # ----------------------------------------------------------------- levels and state
    def _store_levels(self, levels: np.ndarray) -> None:
        levels = np.array(levels, dtype=np.float64)
        levels.setflags(write=False)
        self._levels = levels
        self._levels32 = levels.astype(np.float32)
        self._fingerprint = levels_fingerprint(levels)

    def set_levels(self, levels: np.ndarray) -> None:
        """Replace the levels (e.g. with those another rank computed).

        Parameters
        ----------
        levels : array_like, shape (L,), float
            Strictly increasing, finite, first -1 and last 1, ``L`` as for this configuration.
            AMQ: must be ``+-{p**s, ..., p, 1}`` for some ``p`` in (0, 1). Fixed methods: must
            equal their fixed levels.
        """
        arr = np.asarray(levels, dtype=np.float64)
        size = self._levels.size
        if arr.shape != (size,):
            raise ValueError(
                f"levels must have shape ({size},) for {self.method} with bits={self.bits}, got {arr.shape}"
            )
        if not np.all(np.isfinite(arr)):
            raise ValueError("levels must be finite")
        if arr[0] != -1.0 or arr[-1] != 1.0:
            raise ValueError(f"levels must start at -1 and end at 1, got {arr[0]} and {arr[-1]}")
        if not np.all(np.diff(arr) > 0):
            raise ValueError("levels must be strictly increasing")
        if not self._method.adaptive:
            if not np.array_equal(arr, self._levels):
                raise ValueError(f"{self.method} has fixed levels {self._levels.tolist()}")
            return
        if self._method.adapts == "multiplier":
            p = float(arr[-2])
            if not 0.0 < p < 1.0 or not np.allclose(arr, multiplier_levels(p, self.bits), rtol=1e-9, atol=1e-12):
                raise ValueError(f"{self.method} levels must be +-{{p**s, ..., p, 1}} for some p in (0, 1)")
            self._multiplier = p
            arr = multiplier_levels(p, self.bits)
        self._store_levels(arr)

    def state_dict(self) -> dict:
        """Configuration and adaptive state: levels, multiplier and the random generator's state, in
        plain Python types (the levels a list of exact float64 values), so that ``torch.load``'s
        default ``weights_only=True`` and any pickle-free format take it."""
        return {
            "method": self.method,
            "bits": self.bits,
            "bucket_size": self.bucket_size,
            "norm": self.norm,
            "levels": [float(v) for v in self.levels],
            "multiplier": None if self._multiplier is None else float(self._multiplier),
            "rng": self._rng.bit_generator.state,
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore a :meth:`state_dict` of a quantizer with the same method, norm, bits and bucket size.

        A state without ``"norm"`` (saved before the norm was configurable) has the paper's L2 norm
        for the adaptive methods and the fixed norm for the others."""
        state = dict(state)
        state.setdefault("norm", PAPER_NORM if self._method.adaptive else self._method.norm)
        for key in ("method", "norm", "bits", "bucket_size"):
            if state[key] != getattr(self, key):
                raise ValueError(f"state has {key}={state[key]!r}, this quantizer has {key}={getattr(self, key)!r}")
        if state.get("multiplier") is not None and self._method.adapts == "multiplier":
            self.set_levels(multiplier_levels(float(state["multiplier"]), self.bits))
            if not np.allclose(self._levels, state["levels"], rtol=1e-9, atol=1e-12):
                raise ValueError("state's levels do not match its multiplier")
        else:
            self.set_levels(state["levels"])
        if state.get("rng") is not None:
            self._rng.bit_generator.state = state["rng"]

    # ----------------------------------------------------------------- codec
    def _flat_float(self, x: Any) -> np.ndarray:
        x = np.asarray(x)
        if not np.issubdtype(x.dtype, np.floating):
            raise ValueError(f"x must be a floating-point array (float16/32/64), got dtype {x.dtype}")
        return x.ravel()

    def _clipped(self, x: np.ndarray) -> np.ndarray:
        """TernGrad clipping: each bucket to +-clip * (standard deviation of its values)."""
        d, n = self._bucket_size, x.size
        nb = -(-n // d)
        xb = np.zeros(nb * d, dtype=np.float64)
        xb[:n] = x
        xb = xb.reshape(nb, d)
        counts = np.full(nb, d, dtype=np.float64)
        if nb:
            counts[-1] = n - (nb - 1) * d
        with np.errstate(invalid="ignore", over="ignore"):
            mean = xb.sum(axis=1) / counts
            var = np.einsum("ij,ij->i", xb, xb) / counts - mean**2
            bound = (self._clip * np.sqrt(np.maximum(var, 0.0)))[:, None]
            clipped = np.where(np.isfinite(xb), np.clip(xb, -bound, bound), xb)  # keep NaN/Inf visible
        return clipped.ravel()[:n]

    def encode(self, x: np.ndarray, rng: np.random.Generator | None = None) -> np.ndarray:
        """Quantize ``x`` into a self-describing payload.

        Parameters
        ----------
        x : np.ndarray, any shape, float16/float32/float64
            Flattened in C order. A bucket holding NaN or Inf (or, for float64 input, values whose
            norm overflows float32) is sent with norm NaN and decodes to NaN.
        rng : np.random.Generator, optional
            Source of the rounding draws (default: the quantizer's own generator).

        Returns
        -------
        np.ndarray, shape (payload_size(x.size, bits, bucket_size),), uint8
            32-byte header, one float32 norm per bucket, codes at ``bits`` bits per coordinate.
        """
        x = self._flat_float(x)
        if self._clip is not None:
            x = self._clipped(x)
        n, d = x.size, self._bucket_size
        nz = normalize(x, d, self._norm)
        codes = stochastic_round(nz.r.reshape(-1)[:n], self._levels, self._rng if rng is None else rng)
        out = np.empty(payload_size(n, self._bits, d), dtype=np.uint8)
        out[:HEADER_SIZE] = np.frombuffer(
            pack_header(Header(self._method.id, self._bits, d, n, self._fingerprint, norm=self._norm)), dtype=np.uint8
        )
        end = HEADER_SIZE + 4 * nz.norms.size
        out[HEADER_SIZE:end] = nz.norms.astype("<f4").view(np.uint8)
        out[end:] = pack_codes(codes, self._bits)
        return out

    def decode(self, payload: np.ndarray) -> np.ndarray:
        """Reconstruct the values of a payload made by a quantizer with the same configuration.

        Parameters
        ----------
        payload : np.ndarray (1-D uint8) or bytes-like

        Returns
        -------
        np.ndarray, shape (n,), float32
            ``norm[i // bucket_size] * float32(levels)[code_i]``.

        Raises
        ------
        ValueError
            Truncated or corrupted header, or method, bits, bucket size or levels differ from this
            quantizer's. Norms and codes are not checksummed: corrupting them changes values silently
            (except TernGrad's unused code 3, which is reported).
        """
        header, norms, packed = parse_payload(payload)
        check_header(header, self._method.id, self._bits, self._bucket_size, self._fingerprint, self._norm)
        n, d = header.numel, self._bucket_size
        codes = unpack_codes(packed, self._bits, n)
        if self._levels.size < 2**self._bits and n and int(codes.max()) >= self._levels.size:
            raise ValueError(f"code {int(codes.max())} out of range for {self._levels.size} levels (corrupted codes)")
        nb = header.num_buckets
        out = np.empty(nb * d, dtype=np.float32)
        out[:n] = self._levels32[codes]
        out[n:] = 0.0
        out.reshape(nb, d)[...] *= norms.astype(np.float32)[:, None]
        return out[:n]

    # ----------------------------------------------------------------- adaptation
    def statistics(self, x: np.ndarray) -> np.ndarray:
        """This worker's additive statistics vector of ``x`` (sum or average it over workers).

        Parameters
        ----------
        x : np.ndarray, any shape, floating dtype

        Returns
        -------
        np.ndarray, shape (statistics.statistics_length(method),), float64
        """
        x = self._flat_float(x)
        return summarize(self._method, normalize(x, self._bucket_size, self._norm))

    def adapt(self, stats: np.ndarray) -> None:
        """Refit the levels from a statistics vector, or the sum or mean of several workers' vectors.

        ALQ: coordinate descent on the levels, started from the current ones. AMQ: gradient descent
        on the multiplier, one start at the current ``p``. Deterministic, so ranks given the same
        vector end with the same levels. No-op for fixed methods.

        The fitted levels (AMQ: the multiplier) are rounded to float32, the precision they have on
        the wire anyway, so that a last-ulp difference between two CPUs' math libraries cannot give
        ranks different levels (except in the rare case that it straddles a float32 rounding point).
        """
        if not self._method.adaptive:
            return
        self._fit(distribution_from_statistics(self._method, stats))

    def _set_fitted(self, fitted: np.ndarray) -> None:
        rounded = fitted.astype(np.float32).astype(np.float64)
        self.set_levels(rounded if np.all(np.diff(rounded) > 0) else fitted)

    def _fit(self, dist) -> None:
        from .adaptation import fit_alq_levels, fit_amq_multiplier  # (loads SciPy: only adaptive methods need it)

        if self._method.adapts == "levels":
            levels = fit_alq_levels(dist, self._bits, init=self._levels.copy())
            if self._code_entropy is not None:
                from .rate_levels import fit_levels_for_entropy

                levels = fit_levels_for_entropy(dist, self._bits, self._code_entropy, init=levels)
            self._set_fitted(levels)
        else:
            p = float(fit_amq_multiplier(dist, self._bits, previous=self._multiplier))
            p32 = float(np.float32(p))
            p = p32 if 0.0 < p32 < 1.0 else p
            self._multiplier = p
            self._store_levels(multiplier_levels(p, self._bits))


def adapt_together(quantizers: Sequence[Quantizer], stats: Sequence[np.ndarray]) -> None:
    """:meth:`Quantizer.adapt` of every quantizer from its statistics vector, with the ALQ level fits
    run together (:func:`~.adaptation.fit_alq_levels_together`: the same levels, at about the cost
    of the widest fit; ``bits="auto"`` refits its widths in use so)."""
    from .adaptation import fit_alq_levels_together  # (loads SciPy, needed at refits only)

    alq = [
        (q, distribution_from_statistics(q._method, st))
        for q, st in zip(quantizers, stats)
        if q._method.adapts == "levels" and q.code_entropy is None
    ]
    for q, st in zip(quantizers, stats):
        if q._method.adapts != "levels" or q.code_entropy is not None:
            q.adapt(st)
    fitted = fit_alq_levels_together(
        [d for _, d in alq], [q.bits for q, _ in alq], inits=[q.levels.copy() for q, _ in alq]
    )
    for (q, _), levels in zip(alq, fitted):
        q._set_fitted(levels)
