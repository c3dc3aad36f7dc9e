"""Triton kernels of the wire format (``docs/design/design.md``), used by :mod:`.triton`.

This file is loaded by :func:`horovod_alq.torch.codecs.triton.kernels` (twice in one process if
both are needed: once with ``@triton.jit`` compiled for the GPU, once under Triton's interpreter
for CPU tensors), never imported directly: Triton decides between the two when a kernel is
decorated, from ``TRITON_INTERPRET``.

Conventions shared by every kernel:
- element indices, byte offsets and program ids are int64 (payloads of several ranks exceed 2**31
  bytes at 256M elements);
- norms: sum of squares (or max-abs) accumulated in float64, square root in float64, rounded once
  to float32: the same value as the compiled CPU codec and the NumPy core; NaN if any value of
  the bucket is not finite or the norm overflows float32;
- codes: ``r = clamp((x * s) * inv, -1, 1)`` in float32 with ``inv = 1 / (n_b * s)`` (``s = 2**64``
  for norms below 2**-64, so that ``inv`` cannot overflow; else 1: then this is the CPU codec's
  ``x * (1 / n_b)``), ``r = 0`` in buckets whose norm is 0 or NaN, and code ``j + 1`` when
  ``u * (l[j+1] - l[j]) < r - l[j]`` against float32 levels padded to 2**bits with +inf
  (widths padded with 0);
- uniforms: ``u = (2k + 1) / 2**24`` with ``k`` the top 23 bits of a Philox-4x32-10 output
  (``tl.randint4x``) keyed by the 63-bit seed. Element ``i`` uses output ``(i >> 3) & 3`` of the
  counter ``(i >> 5) * 8 + (i & 7)``: one Philox call per 4 elements, and the draw of element ``i``
  depends only on the seed and ``i`` (never on block sizes, the grid or the device);
- packing: 8 codes make one int64 word (code of element ``8g + c`` at bit ``c * BITS``) whose low
  BITS bytes are the bytes ``[g * BITS, (g + 1) * BITS)`` of the code stream;
- the element count, byte counts and the seed are not specialized on (one compiled variant per
  configuration, whatever the tensor sizes and seeds).
"""

import triton
import triton.language as tl

# (globals that kernels read must be constexpr for Triton's compiler)
F64_MAX = tl.constexpr(1.7976931348623157e308)
F32_MAX = tl.constexpr(3.4028234663852886e38)
TINY_NORM = tl.constexpr(5.421010862427522e-20)  # 2**-64: below it, scale by 2**64 before 1 / norm
TINY_SCALE = tl.constexpr(1.8446744073709552e19)  # 2**64
U_SCALE = tl.constexpr(5.9604644775390625e-08)  # 2**-24


@triton.jit
def _nan32():
    return tl.full([], 0x7FC00000, tl.int32).to(tl.float32, bitcast=True)


@triton.jit
def _norm_step(acc, bad, x, LINF: tl.constexpr):
    """One block of float64 values into the running max-abs (or sum of squares) and count of
    non-finite values (NaN and +-inf fail the comparison)."""
    ax = tl.abs(x)
    if LINF:
        acc = tl.maximum(acc, ax)
    else:
        acc += x * x
    return acc, bad + tl.where(ax <= F64_MAX, 0, 1)


@triton.jit
def _norm_accumulate(x_ptr, start, end, LINF: tl.constexpr, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    """(sum of squares or max-abs in float64, count of non-finite values) of x[start:end]
    (``end - start <= ITERS * BLOCK``)."""
    acc = tl.zeros([BLOCK], tl.float64)
    bad = tl.zeros([BLOCK], tl.int32)
    for it in range(ITERS):
        idx = start + it * BLOCK + tl.arange(0, BLOCK)
        m = idx < end
        x = tl.load(x_ptr + idx, mask=m, other=0.0).to(tl.float64)
        acc, bad = _norm_step(acc, bad, x, LINF)
    if LINF:
        total = tl.max(acc, axis=0)
    else:
        total = tl.sum(acc, axis=0)
    return total, tl.sum(bad, axis=0)


@triton.jit
def _finish_norm(total, bad, LINF: tl.constexpr):
    if LINF:
        norm = total.to(tl.float32)
    else:
        norm = tl.sqrt(total).to(tl.float32)
    ok = (bad == 0) & (norm <= F32_MAX)
    return tl.where(ok, norm, _nan32())


@triton.jit
def _code_word(x_ptr, g, c, lo_i, hi_i, live, s, inv, u, lv_ptr, wd_ptr, BITS: tl.constexpr, LINEAR: tl.constexpr):
    """int64 words of the groups ``g`` ([G]): elements ``8g + c`` inside ``[lo_i, hi_i)`` are
    coded, the others give code 0. ``live``, ``s``, ``inv``: scalars or [G, 8] tiles."""
    i = g[:, None] * 8 + c[None, :]
    m = (i >= lo_i) & (i < hi_i)
    x = tl.load(x_ptr + i, mask=m, other=0.0).to(tl.float32)
    r = tl.minimum(tl.maximum((x * s) * inv, -1.0), 1.0)
    r = tl.where(live, r, 0.0)
    P: tl.constexpr = 1 << BITS
    if LINEAR:
        # few levels: a select per level (levels as scalars, +inf padding never selected)
        cell = tl.zeros(r.shape, tl.int32)
        lo = tl.zeros(r.shape, tl.float32) + tl.load(lv_ptr)
        width = tl.zeros(r.shape, tl.float32) + tl.load(wd_ptr)
        for j in tl.static_range(1, P - 1):
            lj = tl.load(lv_ptr + j)
            wj = tl.load(wd_ptr + j)
            ge = lj <= r
            cell += ge.to(tl.int32)
            lo = tl.where(ge, lj, lo)
            width = tl.where(ge, wj, width)
    else:
        # branch-free binary search for the last padded level <= r (levels[0] = -1 <= r)
        cell = tl.zeros(r.shape, tl.int32)
        for t in tl.static_range(BITS):
            probe = cell + (1 << (BITS - 1 - t))
            ge = tl.load(lv_ptr + probe) <= r
            cell = tl.where(ge, probe, cell)
        lo = tl.load(lv_ptr + cell)
        width = tl.load(wd_ptr + cell)
    code = cell + (u * width < r - lo).to(tl.int32)
    code = tl.where(m, code, 0).to(tl.int64)
    return tl.sum(code << (c[None, :] * BITS), axis=1)


@triton.jit
def _store_word(codes_ptr, g, c, word, g_lo, g_hi, code_bytes, BITS: tl.constexpr):
    """Low BITS bytes of each word to the code stream, for the groups in ``[g_lo, g_hi)``."""
    byte = g[:, None] * BITS + c[None, :]
    m = (c[None, :] < BITS) & (g[:, None] >= g_lo) & (g[:, None] < g_hi) & (byte < code_bytes)
    values = ((word[:, None] >> (c[None, :] * 8)) & 0xFF).to(tl.uint8)
    tl.store(codes_ptr + byte, values, mask=m)


@triton.jit
def _uniform(bits):
    return ((bits >> 9).to(tl.float32) * 2.0 + 1.0) * U_SCALE


@triton.jit
def _encode_quads(
    x_ptr,
    codes_ptr,
    u_ptr,
    q,
    c,
    lo_i,
    hi_i,
    g_lo,
    g_hi,
    code_bytes,
    live,
    s,
    inv,
    inv_ptr,
    s_ptr,
    d,
    seed,
    lv_ptr,
    wd_ptr,
    BITS: tl.constexpr,
    LINEAR: tl.constexpr,
    HAS_U: tl.constexpr,
    GATHER: tl.constexpr,
):
    """Codes of the quads ``q`` ([Q]; a quad is 4 groups, 32 elements) restricted to elements
    ``[lo_i, hi_i)``, stored for groups ``[g_lo, g_hi)``; one Philox call per 4 elements.
    GATHER: ``inv`` and ``s`` per element from the per-bucket arrays ``inv_ptr``, ``s_ptr``
    (bucket ``i // d``, live where ``inv > 0``); else the scalars ``live``, ``s``, ``inv``."""
    if not HAS_U:
        r0, r1, r2, r3 = tl.randint4x(seed, q[:, None] * 8 + c[None, :])
    for k in tl.static_range(4):
        g = q * 4 + k
        i = g[:, None] * 8 + c[None, :]
        m = (i >= lo_i) & (i < hi_i)
        if HAS_U:
            u = tl.load(u_ptr + i, mask=m, other=0.5)
        elif k == 0:
            u = _uniform(r0)
        elif k == 1:
            u = _uniform(r1)
        elif k == 2:
            u = _uniform(r2)
        else:
            u = _uniform(r3)
        if GATHER:
            b = i // d
            inv_k = tl.load(inv_ptr + b, mask=m, other=0.0)
            s_k = tl.load(s_ptr + b, mask=m, other=1.0)
            word = _code_word(x_ptr, g, c, lo_i, hi_i, inv_k > 0.0, s_k, inv_k, u, lv_ptr, wd_ptr, BITS, LINEAR)
        else:
            word = _code_word(x_ptr, g, c, lo_i, hi_i, live, s, inv, u, lv_ptr, wd_ptr, BITS, LINEAR)
        _store_word(codes_ptr, g, c, word, g_lo, g_hi, code_bytes, BITS)


@triton.jit(do_not_specialize=["n", "code_bytes", "seed"])
def _encode_fused_kernel(
    x_ptr,
    norms_ptr,
    codes_ptr,
    u_ptr,
    lv_ptr,
    wd_ptr,
    n,
    d,
    code_bytes,
    seed,
    LINF: tl.constexpr,
    BITS: tl.constexpr,
    LINEAR: tl.constexpr,
    HAS_U: tl.constexpr,
    BLOCK: tl.constexpr,
    ITERS: tl.constexpr,
    Q: tl.constexpr,
    QITERS: tl.constexpr,
):
    """One program per bucket (d % 8 == 0, so a bucket owns whole code bytes): the norm, then the
    codes, reading the bucket twice (the second read comes from L2)."""
    b = tl.program_id(0).to(tl.int64)
    start = b * d
    end = tl.minimum(start + d, n)
    total, bad = _norm_accumulate(x_ptr, start, end, LINF, BLOCK, ITERS)
    norm = _finish_norm(total, bad, LINF)
    tl.store(norms_ptr + b, norm)
    live = (norm > 0.0) & (norm <= F32_MAX)  # False for NaN
    s = tl.where(norm < TINY_NORM, TINY_SCALE, 1.0).to(tl.float32)
    inv = tl.where(live, tl.math.div_rn(tl.full([], 1.0, tl.float32), tl.where(live, norm * s, 1.0)), 0.0)
    g_lo = start // 8
    g_hi = (end + 7) // 8
    c = tl.arange(0, 8).to(tl.int64)
    for it in range(QITERS):
        q = g_lo // 4 + it * Q + tl.arange(0, Q).to(tl.int64)
        _encode_quads(
            x_ptr,
            codes_ptr,
            u_ptr,
            q,
            c,
            start,
            end,
            g_lo,
            g_hi,
            code_bytes,
            live,
            s,
            inv,
            norms_ptr,
            norms_ptr,
            d,
            seed,
            lv_ptr,
            wd_ptr,
            BITS,
            LINEAR,
            HAS_U,
            False,
        )


@triton.jit(do_not_specialize=["n", "code_bytes", "seed"])
def _codes_kernel(
    x_ptr,
    inv_ptr,
    s_ptr,
    codes_ptr,
    u_ptr,
    lv_ptr,
    wd_ptr,
    n,
    d,
    code_bytes,
    seed,
    BITS: tl.constexpr,
    LINEAR: tl.constexpr,
    HAS_U: tl.constexpr,
    Q: tl.constexpr,
):
    """Codes of Q quads per program, any bucket size: per-element inv and s gathered by bucket."""
    pid = tl.program_id(0).to(tl.int64)
    q = pid * Q + tl.arange(0, Q).to(tl.int64)
    c = tl.arange(0, 8).to(tl.int64)
    _encode_quads(
        x_ptr,
        codes_ptr,
        u_ptr,
        q,
        c,
        0,
        n,
        0,
        (n + 7) // 8,
        code_bytes,
        True,
        1.0,
        1.0,
        inv_ptr,
        s_ptr,
        d,
        seed,
        lv_ptr,
        wd_ptr,
        BITS,
        LINEAR,
        HAS_U,
        True,
    )


@triton.jit(do_not_specialize=["n", "nb"])
def _norm_partials_kernel(
    x_ptr,
    total_ptr,
    bad_ptr,
    n,
    d,
    nb,
    S,
    CH,
    LINF: tl.constexpr,
    RB: tl.constexpr,
    BLOCK: tl.constexpr,
    ITERS: tl.constexpr,
):
    """Partial norms (float64 sum of squares or max-abs, non-finite count) to index ``b * S + s``.
    S == 1: program ``pid`` takes the RB whole buckets ``pid * RB + row`` as the rows of a tile;
    S > 1 (RB == 1): chunk ``s = pid % S`` (CH elements) of bucket ``pid // S``.
    ``min(d, CH) <= ITERS * BLOCK``."""
    pid = tl.program_id(0).to(tl.int64)
    s = pid % S
    rows = (pid // S) * RB + tl.arange(0, RB).to(tl.int64)
    valid = rows < nb
    lo = rows * d + s * CH
    hi = tl.minimum(tl.minimum(rows * d + d, n), lo + CH)
    acc = tl.zeros([RB, BLOCK], tl.float64)
    bad = tl.zeros([RB, BLOCK], tl.int32)
    for it in range(ITERS):
        idx = lo[:, None] + it * BLOCK + tl.arange(0, BLOCK)[None, :]
        m = (idx < hi[:, None]) & valid[:, None]
        x = tl.load(x_ptr + idx, mask=m, other=0.0).to(tl.float64)
        acc, bad = _norm_step(acc, bad, x, LINF)
    if LINF:
        total = tl.max(acc, axis=1)
    else:
        total = tl.sum(acc, axis=1)
    tl.store(total_ptr + rows * S + s, total, mask=valid)
    tl.store(bad_ptr + rows * S + s, tl.sum(bad, axis=1), mask=valid)


@triton.jit
def _load_f32(ptr, m):
    """float32 from 4 little-endian bytes at any alignment (payloads of later ranks start at
    arbitrary byte offsets of the gathered buffer)."""
    b0 = tl.load(ptr, mask=m, other=0).to(tl.uint32)
    b1 = tl.load(ptr + 1, mask=m, other=0).to(tl.uint32)
    b2 = tl.load(ptr + 2, mask=m, other=0).to(tl.uint32)
    b3 = tl.load(ptr + 3, mask=m, other=0).to(tl.uint32)
    return (b0 | (b1 << 8) | (b2 << 16) | (b3 << 24)).to(tl.float32, bitcast=True)


@triton.jit(do_not_specialize=["n", "nb"])
def _decode_sum_kernel(
    out_ptr,
    pay_ptr,
    off_ptr,
    table_ptr,
    n,
    d,
    nb,
    scale,
    NUM_PAYLOADS: tl.constexpr,
    BITS: tl.constexpr,
    G: tl.constexpr,
    ALIGNED: tl.constexpr,
):
    """out[i] = scale * sum_p norm_p[i // d] * table[code_p[i]] for G groups of 8 per program."""
    pid = tl.program_id(0).to(tl.int64)
    g = pid * G + tl.arange(0, G).to(tl.int64)
    c = tl.arange(0, 8).to(tl.int64)
    i = g[:, None] * 8 + c[None, :]
    m = i < n
    code_bytes = (n * BITS + 7) // 8
    byte = g[:, None] * BITS + c[None, :]
    bmask = (c[None, :] < BITS) & (byte < code_bytes)
    gm = g * 8 < n
    acc = tl.zeros([G, 8], tl.float32)
    for p in range(NUM_PAYLOADS):
        base = tl.load(off_ptr + p) + 32
        raw = tl.load(pay_ptr + base + 4 * nb + byte, mask=bmask, other=0).to(tl.int64)
        word = tl.sum(raw << (c[None, :] * 8), axis=1)
        codes = (word[:, None] >> (c[None, :] * BITS)) & ((1 << BITS) - 1)
        value = tl.load(table_ptr + codes)
        if ALIGNED:  # d % 8 == 0: one bucket per group
            norm = _load_f32(pay_ptr + base + 4 * ((g * 8) // d), gm)
            acc += value * norm[:, None]
        else:
            norm = _load_f32(pay_ptr + base + 4 * (i // d), m)
            acc += value * norm
    tl.store(out_ptr + i, acc * scale, mask=m)


@triton.jit(do_not_specialize=["n", "nb"])
def _stats_kernel(
    x_ptr,
    norms_ptr,
    grid_ptr,
    sr_ptr,
    sr2_ptr,
    hist_ptr,
    n,
    d,
    nb,
    S,
    CH,
    X64: tl.constexpr,
    HIST: tl.constexpr,
    GBITS: tl.constexpr,
    R: tl.constexpr,
    BLOCK: tl.constexpr,
    ITERS: tl.constexpr,
):
    """Statistics of refit rounds. Program ``pid`` covers buckets ``[(pid // S) * R, ... + R)``
    (R whole buckets when S == 1) or chunk ``pid % S`` of CH elements of bucket ``pid // S``
    (when S > 1, R == 1); ``CH <= ITERS * BLOCK``. Per (bucket, chunk): sum r and sum r^2
    (float64) to ``sr_ptr``, ``sr2_ptr`` at ``b * S + chunk``; HIST: the program's histogram of
    grid cells weighted by ``n_b / count_b`` to row ``pid`` of ``hist_ptr`` (2**GBITS float64
    columns). ``r = clamp(x / n_b, -1, 1)`` (IEEE division, as the torch kernels), 0 in dead
    buckets; cell = max(#{grid < r}, 1) by binary search over the grid padded with +inf."""
    pid = tl.program_id(0).to(tl.int64)
    s = pid % S
    b_lo = (pid // S) * R
    HB: tl.constexpr = 1 << GBITS
    hist = tl.zeros([HB], tl.float64)
    for rb in range(R):
        b = b_lo + rb
        valid = b < nb
        bstart = b * d
        bend = tl.minimum(bstart + d, n)
        lo = bstart + s * CH
        hi = tl.minimum(lo + CH, bend)
        norm = tl.load(norms_ptr + b, mask=valid, other=0.0)
        live = (norm > 0.0) & (norm <= F32_MAX)
        safe = tl.where(live, norm, 1.0)
        sr = tl.zeros([BLOCK], tl.float64)
        sr2 = tl.zeros([BLOCK], tl.float64)
        counts = tl.zeros([HB], tl.int32)
        for it in range(ITERS):
            idx = lo + it * BLOCK + tl.arange(0, BLOCK)
            m = (idx < hi) & valid
            if X64:
                x = tl.load(x_ptr + idx, mask=m, other=0.0).to(tl.float64)
                r = tl.minimum(tl.maximum(x / safe.to(tl.float64), -1.0), 1.0)
            else:
                x = tl.load(x_ptr + idx, mask=m, other=0.0).to(tl.float32)
                r = tl.minimum(tl.maximum(tl.math.div_rn(x, safe), -1.0), 1.0).to(tl.float64)
            r = tl.where(m, tl.where(live, r, 0.0), 0.0)
            sr += r
            sr2 += r * r
            if HIST:
                pos = tl.zeros([BLOCK], tl.int32)
                for t in tl.static_range(GBITS):
                    probe = pos + (1 << (GBITS - 1 - t))
                    below = tl.load(grid_ptr + probe - 1) < r
                    pos = tl.where(below, probe, pos)
                counts += tl.histogram(tl.maximum(pos, 1), HB, mask=m)
        tl.store(sr_ptr + b * S + s, tl.sum(sr, axis=0), mask=valid)
        tl.store(sr2_ptr + b * S + s, tl.sum(sr2, axis=0), mask=valid)
        if HIST:
            count = tl.maximum(bend - bstart, 1).to(tl.float64)
            weight = tl.where(live, norm.to(tl.float64) / count, 0.0)
            hist += counts.to(tl.float64) * weight
    if HIST:
        tl.store(hist_ptr + pid * HB + tl.arange(0, HB), hist)
