"""The exchange engine's tensor ops on NumPy arrays, with the core's reference codec (the mpi4py
front-end; the engine's tests)."""

from __future__ import annotations

import numpy as np

from ..core.statistics import auto_statistics, bucket_norms, normalize
from ..core.wire import parse_header


def bucket_index(ids: np.ndarray, n: int, bucket_size: int) -> np.ndarray:
    """The coordinates of buckets ``ids`` (sorted) of a vector of ``n``, in order."""
    d = int(bucket_size)
    idx = (np.asarray(ids, dtype=np.int64)[:, None] * d + np.arange(d)[None, :]).ravel()
    return idx[idx < n]


class NumpyOps:
    """:class:`.interfaces.TensorOps` on host NumPy arrays. ``decode_sum`` accumulates in ``out``'s dtype
    (float32 for the engine's results; float64 where a caller asks for it)."""

    def stream(self, parts, starts, length, out=None, padding=()):
        if out is None:
            out = np.zeros(length, dtype=np.float32)
        else:
            for a, b in padding:
                out[a:b] = 0
        for part, start in zip(parts, starts):
            out[start : start + part.size] = part.ravel()
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
            out += quantizer.decode(payloads[offset : offset + size])[start : start + out.size]
        if scale != 1.0:
            out *= np.float32(scale)

    def statistics(self, x, quantizer):
        return quantizer.statistics(x)

    def auto_statistics(self, x, quantizer):
        return auto_statistics(normalize(x, quantizer.bucket_size, quantizer.norm), quantizer.method)

    def bucket_norms(self, x, bucket_size, norm):
        return bucket_norms(x, bucket_size, norm)

    def take_buckets(self, x, ids, bucket_size):
        return x[bucket_index(ids, x.size, bucket_size)]

    def add_buckets(self, out, values, ids, bucket_size, scale=1.0):
        out[bucket_index(ids, out.size, bucket_size)] += values * np.float32(scale)

    def cat(self, parts):
        return np.concatenate(list(parts))

    def as_bytes(self, x):
        return np.ascontiguousarray(x, dtype=np.float32).view(np.uint8)

    def from_bytes(self, b):
        return np.ascontiguousarray(b, dtype=np.uint8).view(np.float32)

    def to_numpy(self, x):
        return x

    def from_numpy(self, a):
        return np.ascontiguousarray(a)
