"""Widths per bucket, chosen by each rank for every payload from its own bucket norms
(``bits="auto", bits_per="bucket"``).

A bucket ``b`` of squared norm ``s_b`` quantized at width ``w`` has error close to ``s_b c_w``,
where ``c_w`` is the error per unit of squared bucket norm of ``w``'s levels on the gradients'
normalized distribution (the same for every bucket of one size: the normalized coordinates of
all buckets follow it). ``c`` comes from the allreduced refit statistics, so every rank holds the
same; the norms are this rank's, so each rank picks its own widths for every payload, at every
step: which buckets are large changes from step to step (docs/results/bits_per_tensor.md).

:func:`allocate_buckets` minimizes ``sum_b s_b c_{w_b}`` under ``sum_b n_b w_b <= cap``: every
bucket starts at the narrowest width and the segments of ``c``'s lower convex hull are taken in
order of error reduction per bit while they fit. The width depends on the gradient only, never on
the random rounding, so each bucket's code stays unbiased and so does their sum.

A mixed payload (header ``bits = 0``, :mod:`.wire`) holds the width of every bucket and their
CRC-32 (a corrupted width would decode other buckets' codes with the wrong width), then one
ordinary payload per width from 2 to 8 (the buckets of that width back to back, in order; empty
for a width not taken), then zeros up to a size that depends only on the element count, the
bucket size and the budget (:func:`.wire.mixed_payload_size`), so the ranks' payloads are the same size.
"""

from __future__ import annotations

import copy

import numpy as np

from .allocation import hull
from .methods import get_method
from .packing import packed_size
from .protocol import stable_hash
from .wire import (
    BUCKET_WIDTHS,
    BUDGET_UNITS,
    HEADER_SIZE,
    bucket_lengths,
    budget_units,
    check_header,
    code_bits,
    mixed_payload_size,
    num_buckets,
    parse_header,
    widths_crc,
)

# The mixed payload's format and arithmetic live with the wire format; these names stay importable from here.
__all__ = [
    "BUCKET_WIDTHS",
    "BUDGET_UNITS",
    "MixedWidths",
    "allocate_buckets",
    "budget_units",
    "code_bits",
    "mixed_payload_size",
    "widths_crc",
]


def allocate_buckets(squared: np.ndarray, lengths: np.ndarray, c: np.ndarray, cap: int) -> np.ndarray:
    """The width of every bucket (uint8, from :data:`BUCKET_WIDTHS`) minimizing ``sum_b squared[b] *
    c[w_b]`` under ``sum_b lengths[b] * w_b <= cap`` (``cap`` at least twice the coordinates).

    Segments of ``c``'s lower convex hull are taken in decreasing error reduction per bit while the
    running total fits, in one sort (exact when all buckets have one length and the cap falls on a
    segment's end; otherwise within one segment of the optimum). Non-finite or negative squared
    norms count as 0 (the narrowest width)."""
    squared = np.where(np.isfinite(squared) & (squared > 0), np.asarray(squared, dtype=np.float64), 0.0)
    lengths = np.asarray(lengths, dtype=np.int64)
    widths = np.asarray(BUCKET_WIDTHS, dtype=np.int64)
    out = np.full(squared.size, widths[0], dtype=np.uint8)
    on_hull = hull(widths, np.asarray(c, dtype=np.float64))
    spare = int(cap) - int(lengths.sum()) * int(widths[0])
    if spare < 0:
        raise ValueError(f"cap {cap} is below {int(widths[0])} bits per coordinate")
    if len(on_hull) < 2 or not squared.any():
        return out
    step = np.diff(widths[on_hull])  # bits per coordinate of each segment
    slope = -np.diff(np.asarray(c, dtype=np.float64)[on_hull]) / step  # error reduction per bit, decreasing
    live = np.flatnonzero(squared > 0)
    ratio = (squared[live] / lengths[live])[:, None] * slope[None, :]  # per coordinate-bit
    cost = lengths[live][:, None] * step[None, :]
    order = np.argsort(-ratio.ravel(), kind="stable")
    taken = np.cumsum(cost.ravel()[order]) <= spare
    k = int(np.argmin(taken)) if not taken.all() else taken.size  # the prefix that fits
    segments = np.zeros(live.size, dtype=np.int64)
    np.add.at(segments, order[:k] // len(step), 1)
    out[live] = widths[np.asarray(on_hull)[segments]]
    return out


class MixedWidths:
    """What encodes and decodes mixed payloads: one quantizer per width (its levels), the error
    model ``c`` (None: every bucket at ``default``) and the budget. Quantizer-like where the
    exchange needs it (``method``, ``bucket_size``, ``norm``, ``bits`` = 0, ``fingerprint``,
    :meth:`payload_bytes`)."""

    bits = 0

    def __init__(self, quantizers: dict, budget: float, default: int, c: np.ndarray | None = None) -> None:
        q = quantizers[default]
        if q.bucket_size % 8:
            raise ValueError(f"bits_per='bucket' needs a bucket_size that is a multiple of 8, got {q.bucket_size}")
        self.quantizers = dict(quantizers)
        self.method, self.bucket_size, self.norm = q.method, q.bucket_size, q.norm
        self.budget256 = budget_units(budget)
        self.default = int(default)
        self.c = None if c is None else np.asarray(c, dtype=np.float64).copy()

    @property
    def fingerprint(self) -> int:
        """Hash of every width's levels, the error model and the budget (mixed payload headers)."""
        model = () if self.c is None else tuple(float(v) for v in self.c)
        return stable_hash(self.budget256, tuple(self.quantizers[w].fingerprint for w in BUCKET_WIDTHS), model, bits=63)

    def __copy__(self) -> "MixedWidths":
        """A snapshot whose levels a later refit does not change."""
        out = object.__new__(MixedWidths)
        out.__dict__.update(self.__dict__)
        out.quantizers = {w: copy.copy(q) for w, q in self.quantizers.items()}
        return out

    def payload_bytes(self, numel: int) -> int:
        return mixed_payload_size(numel, self.bucket_size, self.budget256)

    def widths(self, squared: np.ndarray, lengths: np.ndarray, numel: int) -> np.ndarray:
        """This payload's width per bucket from its buckets' squared norms."""
        if self.c is None:
            return np.full(squared.size, self.default, dtype=np.uint8)
        return allocate_buckets(squared, lengths, self.c, code_bits(numel, self.budget256))

    def layout(self, host: np.ndarray, offset: int, numel: int) -> tuple[np.ndarray, list[tuple[int, int, np.ndarray]]]:
        """Read and check a mixed payload at ``offset`` of ``host`` (its header already checked
        against this configuration): its widths per bucket and, per width taken, ``(width, offset of
        its payload, its buckets)``. ValueError names what is wrong."""
        d = self.bucket_size
        b = num_buckets(numel, d)
        widths = host[offset + HEADER_SIZE : offset + HEADER_SIZE + b]
        crc = host[offset + HEADER_SIZE + b : offset + HEADER_SIZE + b + 4]
        if widths.size != b or crc.size != 4:
            raise ValueError("mixed payload: bucket widths truncated")
        if widths_crc(widths) != bytes(crc):
            raise ValueError("mixed payload: bucket widths corrupted (checksum mismatch)")
        if b and (widths.min() < BUCKET_WIDTHS[0] or widths.max() > BUCKET_WIDTHS[-1]):
            raise ValueError("mixed payload: bucket widths out of 2..8")
        lengths = bucket_lengths(numel, d)
        if int((lengths * widths).sum()) > code_bits(numel, self.budget256):
            raise ValueError("mixed payload: its bucket widths exceed the budget")
        pos, runs = offset + HEADER_SIZE + b + 4, []
        for w in BUCKET_WIDTHS:
            ids = np.flatnonzero(widths == w)
            n = int(lengths[ids].sum())
            header = parse_header(host[pos : pos + HEADER_SIZE])
            q = self.quantizers[w]
            check_header(header, get_method(q.method).id, w, d, q.fingerprint, q.norm)
            if header.numel != n:
                raise ValueError(f"mixed payload: its {w}-bit part has {header.numel} elements, its widths say {n}")
            if ids.size:
                runs.append((w, pos, ids))
            pos += HEADER_SIZE + 4 * num_buckets(n, d) + packed_size(n, w)
        if pos > offset + self.payload_bytes(numel):
            raise ValueError("mixed payload: its parts run past its size")
        return widths, runs
