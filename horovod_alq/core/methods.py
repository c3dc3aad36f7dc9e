"""The quantization methods: identity, norm, adaptivity and level sets.

Level sets are sorted float64 arrays in [-1, 1] with -1 and 1 as endpoints and no zero level
(TernGrad excepted), as in Faghri et al. (NeurIPS 2020), Table 1 of ``docs/design/design.md``. Each method
has a default bucket norm; the adaptive ones take either (:func:`check_norm`): the paper normalizes
their buckets by the L2 norm (``norm="l2"``), this package by default by the max-abs (``"linf"``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MIN_BITS = 2
MAX_BITS = 8


@dataclass(frozen=True)
class Method:
    """Static description of one quantization method."""

    name: str
    id: int
    norm: str  # default bucket norm, "l2" or "linf"; adaptive methods take either (check_norm)
    adapts: str | None  # None (fixed), "levels" (ALQ) or "multiplier" (AMQ)
    normless: bool  # adaptive statistics: single truncated normal instead of the mixture

    @property
    def adaptive(self) -> bool:
        return self.adapts is not None


METHODS: dict[str, Method] = {
    m.name: m
    for m in (
        Method("qsgdinf", 0, "linf", None, False),
        Method("qsgd", 1, "l2", None, False),
        Method("nuqsgd", 2, "l2", None, False),
        Method("terngrad", 3, "linf", None, False),
        # Adaptive methods: max-abs buckets by default (lower variance than the paper's L2 buckets
        # on every case measured, docs/results/bucket_norm.md); norm="l2" gives the paper's form.
        Method("alq", 4, "linf", "levels", False),
        Method("alq-n", 5, "linf", "levels", True),
        Method("amq", 6, "linf", "multiplier", False),
        Method("amq-n", 7, "linf", "multiplier", True),
    )
}
"""Every quantization method by name: the adaptive ALQ, AMQ (and -N forms) and the fixed schemes."""
METHODS_BY_ID: dict[int, Method] = {m.id: m for m in METHODS.values()}

#: Bucket norms and their code in byte 5 of the payload header.
NORMS: dict[str, int] = {"l2": 0, "linf": 1}
NORMS_BY_CODE: dict[int, str] = {code: name for name, code in NORMS.items()}
#: The norm of the paper (Faghri et al. 2020) for its adaptive methods: L2 buckets.
PAPER_NORM = "l2"


def get_method(name: str) -> Method:
    """Look a method up by name (case-insensitive); ValueError names the allowed values."""
    key = str(name).lower() if isinstance(name, str) else name
    if key not in METHODS:
        raise ValueError(f"unknown method {name!r}; allowed: {', '.join(METHODS)}")
    return METHODS[key]


def check_bits(method: Method, bits: int) -> int:
    """Validate ``bits`` for ``method`` and return it as int."""
    if isinstance(bits, bool) or not isinstance(bits, (int, np.integer)):
        raise ValueError(f"bits must be an integer from {MIN_BITS} to {MAX_BITS}, got {bits!r}")
    bits = int(bits)
    if method.name == "terngrad":
        if bits != 2:
            raise ValueError(f"terngrad sends its 3 levels on 2 bits; bits must be 2, got {bits}")
    elif not MIN_BITS <= bits <= MAX_BITS:
        raise ValueError(f"bits must be from {MIN_BITS} to {MAX_BITS}, got {bits}")
    return bits


def check_norm(method: Method, norm: str | None) -> str:
    """The bucket norm ``method`` uses with ``norm`` (None: the method's default).

    Adaptive methods (ALQ, AMQ and their -N forms) take either ``"l2"`` (the paper's buckets) or
    ``"linf"`` (max-abs buckets, as QSGDinf and TernGrad); fixed methods keep their own norm.

    Raises
    ------
    ValueError
        ``norm`` is not one of the allowed values, or a fixed method is given the other norm.
    """
    if norm is None:
        return method.norm
    if not isinstance(norm, str) or norm.lower() not in NORMS:
        raise ValueError(
            f"norm must be one of {', '.join(repr(n) for n in NORMS)} (or None: the method's default), got {norm!r}"
        )
    norm = norm.lower()
    if not method.adaptive and norm != method.norm:
        raise ValueError(
            f"{method.name} has fixed norm {method.norm!r}; only the adaptive methods "
            f"(alq, alq-n, amq, amq-n) take norm={norm!r}"
        )
    return norm


def uniform_levels(bits: int) -> np.ndarray:
    """QSGD / QSGDinf: ``2**bits`` uniformly spaced levels on [-1, 1], exactly antisymmetric."""
    count = 2**bits
    return (2.0 * np.arange(count) - (count - 1)) / (count - 1)


def multiplier_levels(p: float, bits: int) -> np.ndarray:
    """AMQ levels ``+-{p**s, ..., p, 1}`` with ``s = 2**(bits-1) - 1``; ``p = 0.5`` is NUQSGD."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"multiplier p must lie in (0, 1), got {p!r}")
    s = 2 ** (bits - 1) - 1
    half = float(p) ** np.arange(s, -1, -1, dtype=np.float64)
    return np.concatenate([-half[::-1], half])


def nuqsgd_levels(bits: int) -> np.ndarray:
    """NUQSGD: ``+-{2**-s, ..., 1/2, 1}``."""
    return multiplier_levels(0.5, bits)


def terngrad_levels() -> np.ndarray:
    """TernGrad: {-1, 0, 1}."""
    return np.array([-1.0, 0.0, 1.0])


def initial_levels(method: Method, bits: int) -> np.ndarray:
    """Fixed levels of a fixed method, or the starting levels of an adaptive one (NUQSGD's)."""
    if method.name in ("qsgd", "qsgdinf"):
        return uniform_levels(bits)
    if method.name == "terngrad":
        return terngrad_levels()
    return nuqsgd_levels(bits)
