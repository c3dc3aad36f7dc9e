"""Mixed payloads (``bits="auto", bits_per="bucket"``): a width per bucket, chosen from this rank's
bucket norms for every payload (:mod:`horovod_alq.core.bucket_widths`), encoded and decoded through
the codec of each width.

:class:`MixedOps` wraps a :class:`.interfaces.TensorOps`: payloads of a
:class:`~horovod_alq.core.bucket_widths.MixedWidths` are mixed, all others go to the wrapped ops.
Encoding gathers the buckets of each width into one vector (``take_buckets``), or reads them in
place from the round's tensors where the codec can (``encode_parts``), and encodes them with that
width's levels; decoding decodes each width's buckets of the window asked for and adds them
back in place (``add_buckets``), rank by rank. The wrapped ops need three more operations:
``bucket_norms``, ``take_buckets`` and ``add_buckets`` (NumPy and torch have them).
"""

from __future__ import annotations

import numpy as np

from ..core.bucket_widths import BUCKET_WIDTHS, MixedWidths, widths_crc
from ..core.methods import get_method
from ..core.protocol import derive_seed
from ..core.wire import Header, bucket_lengths, pack_header

#: Most runs of consecutive buckets of one width read in place (beyond: gathered, one copy).
RUNS_IN_PLACE = 4096
#: The methods the wrapped ops must have beyond :class:`.interfaces.TensorOps`.
NEEDS = ("bucket_norms", "take_buckets", "add_buckets")


class MixedOps:
    """``ops`` with mixed payloads for :class:`MixedWidths` quantizers (every other call delegated)."""

    def __init__(self, ops) -> None:
        missing = [m for m in NEEDS if not hasattr(ops, m)]
        if missing:
            raise TypeError(
                f"bits_per='bucket' needs tensor ops with {', '.join(missing)}; {type(ops).__name__} has none"
            )
        self.inner = ops
        self._read: tuple = (None, {})  # the payloads last decoded from, and their layouts by offset

    def _layout(self, payloads, offset: int, q: MixedWidths, numel: int):
        """A payload's layout (:meth:`MixedWidths.layout`), read once per gathered buffer (a
        buffer's tensors are decoded window by window from the same payloads)."""
        if self._read[0] is not payloads:
            self._read = (payloads, {"host": self.inner.to_numpy(payloads)})
        seen = self._read[1]
        key = (int(offset), numel, q.fingerprint)
        if key not in seen:
            seen[key] = q.layout(seen["host"], int(offset), numel)
        return seen[key]

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def encode_feedback(self, x, error, q, seed):
        """The wrapped ops' one-pass error feedback for one width; None for mixed widths."""
        fused = None if isinstance(q, MixedWidths) else getattr(self.inner, "encode_feedback", None)
        return None if fused is None else fused(x, error, q, seed)

    def encode(self, x, q, seed):
        if not isinstance(q, MixedWidths):
            return self.inner.encode(x, q, seed)
        n = int(x.shape[0])
        norms = self.inner.bucket_norms(x, q.bucket_size, q.norm) if n else np.zeros(0)
        return self._assemble(q, n, norms, seed, lambda ids, qw, seed_w: self._encode_buckets(x, ids, n, qw, seed_w))

    def _assemble(self, q: MixedWidths, n: int, norms: np.ndarray, seed: int, encode_width):
        """A mixed payload of ``n`` coordinates with bucket norms ``norms``: header, widths and their
        CRC, then ``encode_width(ids, quantizer, seed)`` of each width's buckets, then zeros up to
        its size. None as soon as ``encode_width`` gives None (the widths with the most buckets go
        first, so a codec that cannot read in place says so at the first call)."""
        ops, d = self.inner, q.bucket_size
        widths = q.widths(np.square(norms, dtype=np.float64), bucket_lengths(n, d), n)
        header = pack_header(
            Header(get_method(q.method).id, 0, d, n, q.fingerprint, norm=q.norm, budget256=q.budget256)
        )
        crc = np.frombuffer(widths_crc(widths), dtype=np.uint8)
        by_width = {w: np.flatnonzero(widths == w) for w in BUCKET_WIDTHS}
        encoded = {}
        for w in sorted(BUCKET_WIDTHS, key=lambda w: -by_width[w].size):  # the first call says if it can
            encoded[w] = encode_width(by_width[w], q.quantizers[w], derive_seed(seed, w))
            if encoded[w] is None:
                return None
        parts = [ops.from_numpy(np.concatenate([np.frombuffer(header, dtype=np.uint8), widths, crc]))]
        parts += [encoded[w] for w in BUCKET_WIDTHS]
        used = sum(int(part.shape[0]) for part in parts)
        parts.append(ops.from_numpy(np.zeros(q.payload_bytes(n) - used, dtype=np.uint8)))
        return ops.cat(parts)

    def _parts_norms(self, parts, starts, length: int, d: int, norm: str) -> np.ndarray:
        """The bucket norms of the stream of ``length`` coordinates that holds ``parts`` at ``starts``
        (each on a bucket boundary) and zeros elsewhere, as :meth:`bucket_norms` of that stream gives
        them: a part's last bucket, completed by the zeros after it, is measured on a zero-padded copy."""
        ops = self.inner
        out = np.zeros(-(-length // d))
        for part, s in zip(parts, starts):
            n = int(part.shape[0])
            b, full = s // d, n - n % d
            if n % d and s + n < length:  # zeros follow the tail in the stream
                if full:
                    out[b : b + full // d] = ops.bucket_norms(part[:full], d, norm)
                padded = ops.zeros(d)
                padded[: n % d] = part[full:]
                out[b + full // d] = ops.bucket_norms(padded, d, norm)[0]
            elif n:
                out[b : b - (-n // d)] = ops.bucket_norms(part, d, norm)
        return out

    def _encode_parts_buckets(self, parts, starts, length: int, ids, q, seed):
        """The payload of buckets ``ids`` of the stream of :meth:`_parts_norms`, back to back, read in
        place from ``parts`` (None where the codec cannot)."""
        ops, d = self.inner, q.bucket_size
        if ids.size == 0:
            return ops.encode(ops.zeros(0), q, seed)
        cut = np.flatnonzero(np.diff(ids) != 1) + 1
        firsts, lasts = ids[np.concatenate([[0], cut])], ids[np.concatenate([cut - 1, [ids.size - 1]])]
        starts = [int(s) for s in starts]
        ends = [s + int(p.shape[0]) for p, s in zip(parts, starts)]
        pieces, at, offset, k = [], [], 0, 0
        for a, b in zip((firsts * d).tolist(), np.minimum((lasts + 1) * d, length).tolist()):
            while k < len(parts) and ends[k] <= a:  # spans and parts are in stream order
                k += 1
            j = k
            while j < len(parts) and starts[j] < b:  # the parts that the span [a, b) overlaps
                lo, hi = max(a, starts[j]), min(b, ends[j])
                if lo < hi:
                    pieces.append(parts[j][lo - starts[j] : hi - starts[j]])
                    at.append(offset + lo - a)
                j += 1
            offset += b - a
        return ops.encode_parts(pieces, at, offset, q, seed)

    def _encode_buckets(self, x, ids, n, q, seed):
        """The payload of buckets ``ids`` of ``x`` back to back: read in place, run by run of
        consecutive buckets, where the codec can (:meth:`encode_parts`), else gathered first."""
        ops, d = self.inner, q.bucket_size
        if 0 < ids.size:
            cut = np.flatnonzero(np.diff(ids) != 1) + 1
            firsts, lasts = ids[np.concatenate([[0], cut])], ids[np.concatenate([cut - 1, [ids.size - 1]])]
            if firsts.size <= RUNS_IN_PLACE:
                spans = [(int(a) * d, min((int(b) + 1) * d, n)) for a, b in zip(firsts, lasts)]
                starts = np.concatenate([[0], np.cumsum([e - s for s, e in spans])]).tolist()
                payload = ops.encode_parts([x[s:e] for s, e in spans], starts[:-1], starts[-1], q, seed)
                if payload is not None:
                    return payload
        return ops.encode(ops.take_buckets(x, ids, d), q, seed)

    def encode_parts(self, parts, starts, length, q, seed):
        if not isinstance(q, MixedWidths):
            return self.inner.encode_parts(parts, starts, length, q, seed)
        d = q.bucket_size
        if length == 0 or any(int(s) % d for s in starts):
            return None  # the caller encodes the stream
        norms = self._parts_norms(parts, starts, length, d, q.norm)
        return self._assemble(
            q,
            length,
            norms,
            seed,
            lambda ids, qw, seed_w: self._encode_parts_buckets(parts, starts, length, ids, qw, seed_w),
        )

    def decode_sum(self, out, payloads, offsets, q, *, start=0, numel=None, scale=1.0):
        if not isinstance(q, MixedWidths):
            return self.inner.decode_sum(out, payloads, offsets, q, start=start, numel=numel, scale=scale)
        ops, d = self.inner, q.bucket_size
        size = int(out.shape[0])
        numel = size if numel is None else int(numel)
        if start % d:
            raise AssertionError(f"a mixed payload is decoded from bucket boundaries, not from {start}")
        b0, b1 = start // d, -(-(start + size) // d)
        span = min(b1 * d, numel) - b0 * d  # the window's whole buckets
        target = out if span == size else ops.zeros(span)
        target[:] = 0
        lengths = bucket_lengths(numel, d)
        for offset in offsets:
            _, runs = self._layout(payloads, offset, q, numel)
            for w, pos, ids in runs:
                k0, k1 = np.searchsorted(ids, b0), np.searchsorted(ids, b1)
                if k0 == k1:
                    continue
                n_w = int(lengths[ids].sum())
                part = ops.empty(min(int(k1) * d, n_w) - int(k0) * d)
                ops.decode_sum(part, payloads, [pos], q.quantizers[w], start=int(k0) * d, numel=n_w)
                ops.add_buckets(target, part, ids[k0:k1] - b0, d, scale)
        if target is not out:
            out[:] = target[:size]
