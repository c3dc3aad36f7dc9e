"""TensorFlow kernels of the wire format in ``docs/design/design.md``: bucket norms, unbiased stochastic
rounding, b-bit packing into a payload, and the decode-and-sum of gathered payloads.

Plain TF ops with static shapes, usable eagerly and inside ``tf.function`` (the compressors wrap
them in their own ``tf.function`` per tensor shape). Randomness is a counter-based hash of a seed
pair that the caller changes every call (:func:`uniforms`), compiled with the rest.
"""

from __future__ import annotations

import tensorflow as tf

from ..core.packing import packed_size
from ..core.wire import HEADER_SIZE, num_buckets


def work_dtype(dtype: tf.DType) -> tf.DType:
    """Precision the codec computes in: float64 stays, every other float type is widened to float32."""
    return tf.float64 if dtype == tf.float64 else tf.float32


def _word_dtype(bits: int) -> tf.DType:
    """Eight codes of ``bits`` bits fit a 32-bit word up to 4 bits, else a 64-bit word."""
    return tf.int32 if bits <= 4 else tf.int64


def bucket_view(flat: tf.Tensor, bucket_size: int) -> tf.Tensor:
    """Zero-pad a 1-D tensor of static length to whole buckets: shape ``(num_buckets, bucket_size)``."""
    n = int(flat.shape[0])
    nb = num_buckets(n, bucket_size)
    pad = nb * bucket_size - n
    if pad:
        flat = tf.pad(flat, [[0, pad]])
    return tf.reshape(flat, [nb, bucket_size])


def bucket_norms(buckets: tf.Tensor, norm: str) -> tf.Tensor:
    """float32 norm of each bucket (``"l2"`` or ``"linf"``); NaN where a value is not finite or the
    norm overflows float32.

    Parameters
    ----------
    buckets : tf.Tensor, shape (B, d), float32 or float64
    norm : {"l2", "linf"}

    Returns
    -------
    tf.Tensor, shape (B,), float32
    """
    nan = tf.constant(float("nan"), tf.float32)
    if norm == "linf":
        # TF's reduce_max propagates NaN, XLA's does not: test finiteness explicitly.
        finite = tf.reduce_all(tf.math.is_finite(buckets), axis=1)
        norms = tf.cast(tf.reduce_max(tf.abs(buckets), axis=1), tf.float32)
        return tf.where(tf.logical_and(finite, tf.math.is_finite(norms)), norms, nan)
    if norm != "l2":
        raise ValueError(f"unknown norm {norm!r}; allowed: l2, linf")
    squares = tf.reduce_sum(tf.square(buckets), axis=1)
    norms = tf.cast(tf.sqrt(squares), tf.float32)
    bad = tf.logical_not(tf.math.is_finite(norms))
    if buckets.dtype == tf.float64:
        return tf.where(bad, nan, norms)

    def rescaled() -> tf.Tensor:
        # Finite values whose squares overflow float32: scale by the bucket's max-abs first.
        peak = tf.reduce_max(tf.abs(buckets), axis=1)
        safe = tf.where(peak > 0, peak, tf.ones_like(peak))
        scaled = peak * tf.sqrt(tf.reduce_sum(tf.square(buckets / safe[:, None]), axis=1))
        return tf.where(tf.math.is_finite(scaled), scaled, nan)

    return tf.cond(tf.reduce_any(bad), rescaled, lambda: norms)


def normalize(buckets: tf.Tensor, norms: tf.Tensor, exact: bool = True) -> tf.Tensor:
    """``r = x / n`` with the float32 norm, clipped to [-1, 1]; 0 in buckets whose norm is 0 or NaN.

    ``exact=False`` (the encoder's hot path) skips the clip and the zeroing, two passes over the
    data that do not change the codes: the rounding of a value a rounding error outside [-1, 1]
    already picks the end level, and a NaN-norm bucket decodes to NaN whatever its codes.
    """
    ok = norms > 0  # False for NaN
    denom = tf.cast(tf.where(ok, norms, tf.ones_like(norms)), buckets.dtype)
    r = buckets / denom[:, None]
    if not exact:
        return r
    r = tf.clip_by_value(r, -1.0, 1.0)
    return tf.where(ok[:, None], r, tf.zeros_like(r))


def cells(r: tf.Tensor, levels: tf.Tensor) -> tf.Tensor:
    """Index ``j`` (int32) of the cell ``levels[j] <= r < levels[j+1]``, clipped to ``[0, L-2]``.

    One ``tf.searchsorted`` over the interior levels: on CPU several times faster than a sum of
    ``L - 2`` comparisons, which materializes a tensor per level."""
    interior = tf.reshape(levels[1:-1], [1, -1])
    j = tf.searchsorted(interior, tf.reshape(r, [1, -1]), side="right", out_type=tf.int32)
    return tf.reshape(j, tf.shape(r))


def _fmix32(h: tf.Tensor) -> tf.Tensor:
    """MurmurHash3's 32-bit finalizer (a bijection with full avalanche), in uint32 ops."""
    shift = tf.bitwise.right_shift
    h = tf.bitwise.bitwise_xor(h, shift(h, tf.constant(16, tf.uint32))) * tf.constant(0x85EBCA6B, tf.uint32)
    h = tf.bitwise.bitwise_xor(h, shift(h, tf.constant(13, tf.uint32))) * tf.constant(0xC2B2AE35, tf.uint32)
    return tf.bitwise.bitwise_xor(h, shift(h, tf.constant(16, tf.uint32)))


def uniforms(tensor: tf.Tensor, seed: tf.Tensor, bucket_size: int) -> tf.Tensor:
    """The uniform draws of one encoding: shape ``(num_buckets, bucket_size)``, in the codec's work
    dtype. Counter-based: draw i hashes (seed, i) with uint32 arithmetic only, so XLA compiles it
    into the encoder (TF's random kernels cost a third of the encoder). Each draw is
    ``(2k + 1) / 2^24`` with k 23 bits of the hash: exact in float32, P(u < p) is p to the nearest
    2^-23. ``seed``: int64 pair (both words of both enter the keys)."""
    nb = num_buckets(tensor.shape.num_elements(), bucket_size)
    count = nb * bucket_size
    if count >= 2**32:
        raise ValueError(f"horovod_alq: tensors of {count} or more elements (2**32) are not supported")
    words = tf.reshape(tf.bitcast(tf.cast(seed, tf.int64), tf.uint32), [4])
    xor = tf.bitwise.bitwise_xor
    key0 = _fmix32(xor(words[0], _fmix32(words[1] + tf.constant(0x9E3779B9, tf.uint32))))
    key1 = _fmix32(xor(words[2], _fmix32(xor(words[3], key0))))
    index = tf.bitcast(tf.range(count, dtype=tf.int32), tf.uint32)
    h = _fmix32(xor(_fmix32(index * tf.constant(0x9E3779B9, tf.uint32) + key0), key1))
    k = tf.bitwise.right_shift(h, tf.constant(9, tf.uint32))
    u = tf.cast(tf.bitcast(2 * k + 1, tf.int32), tf.float32) * (2.0**-24)
    return tf.reshape(tf.cast(u, work_dtype(tensor.dtype)), [nb, bucket_size])


#: Under XLA, up to this many levels the cell search is an unrolled chain of comparisons and
#: selects (fused into one loop: about 3x faster than tf.searchsorted plus two gathers at 8 levels).
UNROLL_MAX_LEVELS = 16


def stochastic_codes(r: tf.Tensor, levels: tf.Tensor, u: tf.Tensor, unrolled: bool = False) -> tf.Tensor:
    """Unbiased stochastic rounding of ``r`` (values in [-1, 1], up to rounding) to int32 indices
    into ``levels``.

    For ``levels[j] <= r <= levels[j+1]`` the code is ``j + 1`` with probability
    ``(r - levels[j]) / (levels[j+1] - levels[j])``, else ``j``.

    Parameters
    ----------
    r : tf.Tensor, float32 or float64
    levels : tf.Tensor, shape (L,), float64 (cast to ``r.dtype``)
    u : tf.Tensor, shape of ``r``, same dtype
        Uniform draws on [0, 1), e.g. from :func:`uniforms`.
    unrolled : bool
        Find the cell by a chain of ``L - 2`` comparisons and selects (when ``L <= UNROLL_MAX_LEVELS``):
        the fast form under XLA, slow op by op. Same codes either way.
    """
    levels = tf.cast(levels, r.dtype)
    count = int(levels.shape[0])
    if unrolled and count <= UNROLL_MAX_LEVELS:
        j = tf.zeros(tf.shape(r), tf.int32)
        lo = tf.fill(tf.shape(r), levels[0])
        width = tf.fill(tf.shape(r), levels[1] - levels[0])
        for i in range(1, count - 1):
            above = r >= levels[i]
            j = tf.where(above, i, j)
            lo = tf.where(above, levels[i], lo)
            width = tf.where(above, levels[i + 1] - levels[i], width)
    else:
        j = cells(r, levels)
        lo = tf.gather(levels, j)
        width = tf.gather(levels[1:] - levels[:-1], j)
    return j + tf.cast(u * width < r - lo, tf.int32)


def pack_codes(codes: tf.Tensor, bits: int) -> tf.Tensor:
    """Pack int codes (< 2**bits, 1-D, static length n) into ``ceil(n * bits / 8)`` uint8 bytes,
    LSB-first bit stream (eight codes make one little-endian word whose low ``bits`` bytes are sent)."""
    n = int(codes.shape[0])
    groups = -(-n // 8)
    word = _word_dtype(bits)
    codes = tf.cast(codes, word)
    if groups * 8 != n:
        codes = tf.pad(codes, [[0, groups * 8 - n]])
    shifts = tf.constant([i * bits for i in range(8)], word)
    words = tf.reduce_sum(tf.bitwise.left_shift(tf.reshape(codes, [groups, 8]), shifts), axis=1)
    raw = tf.bitcast(words, tf.uint8)  # (groups, 4 or 8), little-endian on every supported host
    return tf.reshape(raw[:, :bits], [-1])[: packed_size(n, bits)]


def unpack_codes(packed: tf.Tensor, bits: int, n: int) -> tf.Tensor:
    """Inverse of :func:`pack_codes` on a batch: ``packed`` (R, ceil(n*bits/8)) uint8 -> (R, n) int32."""
    groups = -(-n // 8)
    word = _word_dtype(bits)
    width = 4 if word == tf.int32 else 8
    rows = tf.shape(packed)[0]
    missing = groups * bits - int(packed.shape[1])
    if missing:
        packed = tf.pad(packed, [[0, 0], [0, missing]])
    raw = tf.reshape(packed, [rows, groups, bits])
    if width > bits:
        raw = tf.pad(raw, [[0, 0], [0, 0], [0, width - bits]])
    words = tf.bitcast(raw, word)  # (R, groups)
    shifts = tf.constant([i * bits for i in range(8)], word)
    codes = tf.bitwise.bitwise_and(tf.bitwise.right_shift(words[:, :, None], shifts), (1 << bits) - 1)
    return tf.cast(tf.reshape(codes, [rows, groups * 8])[:, :n], tf.int32)


def encode(
    tensor: tf.Tensor,
    levels: tf.Tensor,
    header: tf.Tensor,
    seed: tf.Tensor,
    *,
    bits: int,
    bucket_size: int,
    norm: str,
    unrolled: bool = False,
) -> tf.Tensor:
    """Encode a float tensor (static shape) into one payload ``header | float32 norms | packed codes``.

    Parameters
    ----------
    tensor : tf.Tensor, any static shape, float16/bfloat16/float32/float64
    levels : tf.Tensor, shape (L,), float64
    header : tf.Tensor, shape (32,), uint8
    seed : tf.Tensor, shape (2,), int64
        Seed pair of the rounding's draws (:func:`uniforms`).
    bits, bucket_size : int
    norm : {"l2", "linf"}
    unrolled : bool
        See :func:`stochastic_codes` (True under XLA).

    Returns
    -------
    tf.Tensor, shape (payload_size(n, bits, bucket_size),), uint8
    """
    u = uniforms(tensor, seed, bucket_size)
    return encode_with_uniforms(
        tensor, levels, header, u, bits=bits, bucket_size=bucket_size, norm=norm, unrolled=unrolled
    )


def encode_with_uniforms(
    tensor: tf.Tensor,
    levels: tf.Tensor,
    header: tf.Tensor,
    u: tf.Tensor,
    *,
    bits: int,
    bucket_size: int,
    norm: str,
    unrolled: bool = False,
) -> tf.Tensor:
    """:func:`encode` with the uniform draws given (``u`` from :func:`uniforms`)."""
    flat = tf.reshape(tf.cast(tensor, work_dtype(tensor.dtype)), [-1])
    n = int(flat.shape[0])
    buckets = bucket_view(flat, bucket_size)
    norms = bucket_norms(buckets, norm)
    codes = stochastic_codes(normalize(buckets, norms, exact=False), levels, u, unrolled)
    packed = pack_codes(tf.reshape(codes, [-1])[:n], bits)
    return tf.concat([header, tf.reshape(tf.bitcast(norms, tf.uint8), [-1]), packed], axis=0)


def decode_sum(
    gathered: tf.Tensor, levels: tf.Tensor, scale: tf.Tensor, *, ranks: int, numel: int, bits: int, bucket_size: int
) -> tf.Tensor:
    """Decode ``ranks`` equally sized payloads laid end to end and return ``scale * sum`` (float32).

    The payloads must already be validated (same configuration as this rank; see the compressor).
    Value of coordinate i in one payload: ``norm[i // d] * float32(levels)[code_i]``; the sum runs in
    rank order, so every rank computes bitwise the same result from the same bytes.

    Parameters
    ----------
    gathered : tf.Tensor, shape (ranks * payload_size,), uint8
    levels : tf.Tensor, shape (L,), float64; codes past ``L - 1`` decode to NaN
    scale : tf.Tensor, scalar float32
    """
    nb = num_buckets(numel, bucket_size)
    end_norms = HEADER_SIZE + 4 * nb
    size = end_norms + packed_size(numel, bits)
    rows = tf.reshape(gathered, [ranks, size])
    norms = tf.bitcast(tf.reshape(rows[:, HEADER_SIZE:end_norms], [ranks, nb, 4]), tf.float32)
    codes = unpack_codes(rows[:, end_norms:], bits, numel)
    table = tf.cast(levels, tf.float32)
    spare = (1 << bits) - int(levels.shape[0])
    if spare:
        table = tf.concat([table, tf.fill([spare], tf.constant(float("nan"), tf.float32))], axis=0)
    values = tf.gather(table, codes)  # (ranks, numel)
    pad = nb * bucket_size - numel
    if pad:
        values = tf.pad(values, [[0, 0], [0, pad]])
    values = tf.reshape(values, [ranks, nb, bucket_size]) * norms[:, :, None]
    out = values[0]
    for r in range(1, ranks):
        out = out + values[r]
    return tf.reshape(out, [-1])[:numel] * scale


def _normalized(tensor: tf.Tensor, bucket_size: int, norm: str):
    """``(r, norms, counts, keep)``: float64 normalized buckets (B, d) as the encoder computes them,
    float64 norms and element counts (B,), and the finite non-zero-norm buckets (B,) bool."""
    flat = tf.reshape(tf.cast(tensor, work_dtype(tensor.dtype)), [-1])
    n = int(flat.shape[0])
    buckets = bucket_view(flat, bucket_size)
    norms = bucket_norms(buckets, norm)
    nb = int(buckets.shape[0])
    counts = [float(bucket_size)] * nb
    if nb:
        counts[-1] = float(n - (nb - 1) * bucket_size)
    keep = norms > 0  # False for NaN
    return (
        tf.cast(normalize(buckets, norms), tf.float64),
        tf.cast(norms, tf.float64),
        tf.constant(counts, tf.float64),
        keep,
    )


def normless_statistics(tensor: tf.Tensor, *, bucket_size: int, norm: str) -> tf.Tensor:
    """``[N, sum r, sum r**2, sum_b (sum_r_b)**2 / count_b]`` over finite non-zero-norm buckets:
    :func:`horovod_alq.core.statistics.normless_statistics` of the encoder's buckets (float64, (4,))."""
    r, _, counts, keep = _normalized(tensor, bucket_size, norm)
    kept = tf.cast(keep, tf.float64)
    sum_r = tf.reduce_sum(r, axis=1)
    return tf.stack(
        [
            tf.reduce_sum(counts * kept),
            tf.reduce_sum(sum_r * kept),
            tf.reduce_sum(tf.reduce_sum(tf.square(r), axis=1) * kept),
            tf.reduce_sum(tf.square(sum_r) / counts * kept),
        ]
    )


def grid_statistics(tensor: tf.Tensor, grid, *, bucket_size: int, norm: str) -> tf.Tensor:
    """Norm-based statistics ``[W, C(grid[0]), ..., C(grid[-1])]`` (float64, (1 + G,)), as
    :func:`horovod_alq.core.statistics.grid_statistics` defines them: ``W = sum_b n_b`` and
    ``C(g) = sum_b n_b / count_b * #{i in bucket b : r_i <= g}`` over finite non-zero buckets."""
    return _grid_cumulative(tensor, grid, bucket_size, norm, squared=False)[0]


def grid_histograms(tensor: tf.Tensor, grid, *, bucket_size: int, norm: str) -> tf.Tensor:
    """Shape (2, 1 + G), float64: row 0 :func:`grid_statistics`, row 1 the same counts weighted by
    ``n_b**2`` (``[sum_b n_b**2 count_b, C2(grid)]``), as
    :func:`horovod_alq.core.statistics.grid_histograms` (``bits="auto"``). One grid search for both."""
    return _grid_cumulative(tensor, grid, bucket_size, norm, squared=True)


def _grid_cumulative(tensor: tf.Tensor, grid, bucket_size: int, norm: str, squared: bool) -> tf.Tensor:
    grid = tf.convert_to_tensor(grid, tf.float64)
    r, norms, counts, keep = _normalized(tensor, bucket_size, norm)
    n = tensor.shape.num_elements()
    size = int(grid.shape[0])
    kept = tf.where(keep, norms, tf.zeros_like(norms))
    flat = tf.reshape(r, [1, -1])[:, :n]
    cells = tf.reshape(
        tf.maximum(tf.searchsorted(tf.reshape(grid, [1, -1]), flat, side="left", out_type=tf.int32), 1), [-1]
    )
    rows = [(kept / counts, tf.reduce_sum(kept))]
    if squared:
        rows.append((kept * kept, tf.reduce_sum(kept * kept * counts)))
    out = []
    for bucket_weight, total in rows:
        weights = tf.reshape(tf.broadcast_to(bucket_weight[:, None], tf.shape(r)), [-1])[:n]
        hist = tf.math.unsorted_segment_sum(weights, cells, size + 1)
        out.append(tf.concat([total[None], tf.cumsum(hist[:size])], axis=0))
    return tf.stack(out)
