"""Where a round's tensors sit in its stream, and how the stream is cut into fusion buffers."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence


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
