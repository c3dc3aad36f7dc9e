"""Every codec backend (torch ops, compiled CPU, Triton under its interpreter) against the NumPy
core and against each other: one wire format, interchangeable payloads, unbiased rounding.

The Triton backend runs on CPU tensors only under Triton's interpreter, which Triton selects once
per process, when it is first imported. The module fixture below sets TRITON_INTERPRET=1 and
imports triton (nothing imports it earlier in the suite: the codecs import it lazily, and "auto"
never does for CPU tensors), then restores the variable after this module; if triton was already
imported compiled, the Triton tests skip and say so. Compilation for the GPU runs in a fresh
process. The interpreter pays per operation and per program: keep tensors and bucket counts small.
"""

import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from horovod_alq.core import Quantizer
from horovod_alq.core.methods import get_method
from horovod_alq.core.packing import unpack_codes
from horovod_alq.core.statistics import GRID, BucketMoments, grid_histograms, normalize, normless_statistics
from horovod_alq.core.wire import Header, levels_fingerprint, pack_header
from horovod_alq.torch import codecs
from horovod_alq.torch.codecs import triton as triton_codec

BACKENDS = ["torch", "cpu", "cpu-generic", "triton"]  # cpu-generic: the CPU codec without its AVX2 kernels
# NumPy under the interpreter flags inf * 0 in non-finite buckets (their codes do not matter)
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")


@pytest.fixture(scope="module", autouse=True)
def triton_interpreter():
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    triton_codec.import_error()  # imports triton now, under the interpreter, if nothing did before
    yield
    if old is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = old


def _resolve(name):
    try:
        return codecs.resolve(name, "cpu")
    except ValueError as err:  # compiled CPU codec not built, or triton not installed
        pytest.skip(str(err))


@pytest.fixture(params=BACKENDS)
def codec(request):
    if request.param != "cpu-generic":
        yield _resolve(request.param)
        return
    cpu = _resolve("cpu")
    cpu._module.set_simd(False)
    try:
        yield cpu
    finally:
        cpu._module.set_simd(True)


def test_cpu_codec_kernels_decode_identically_with_and_without_avx2():
    """Ranks on CPUs with and without AVX2 must turn the same payloads into the same floats."""
    cpu = _resolve("cpu")
    if cpu._module.simd() != "avx2":
        pytest.skip("this CPU has no AVX2")
    for bits, d, n in [(2, 64, 1000), (3, 8192, 20_011), (4, 100, 3001), (5, 256, 999)]:
        q = Quantizer("alq", bits=bits, bucket_size=d, seed=0)
        x = torch.randn(n, generator=torch.Generator().manual_seed(bits))
        payloads = torch.cat([torch.from_numpy(_encode(cpu, q, x * s, seed=s)) for s in (1, 2, 3)])
        size = payloads.numel() // 3
        outs = []
        for simd in (True, False):
            cpu._module.set_simd(simd)
            out = torch.empty(n)
            cpu.decode_sum(
                out, payloads, [0, size, 2 * size], torch.tensor(q.levels), bits=bits, bucket_size=d, scale=0.25
            )
            outs.append(out)
        cpu._module.set_simd(True)
        assert torch.equal(outs[0], outs[1]), (bits, d, n)


def test_cpu_codec_kernels_encode_identically_with_and_without_avx2():
    """The AVX2 encoder does the generic encoder's float32 operations on the same values: the same
    norms and, draw for draw, the same codes (every bits, both norms, dtypes, bucket edges, zero
    and non-finite buckets)."""
    cpu = _resolve("cpu")
    if cpu._module.simd() != "avx2":
        pytest.skip("this CPU has no AVX2")
    cases = [
        ("alq", 2, 64, 1000, torch.float32),
        ("alq", 3, 8192, 20_011, torch.float32),
        ("amq", 4, 96, 3001, torch.float32),
        ("qsgdinf", 5, 256, 999, torch.float32),
        ("terngrad", 2, 64, 640, torch.float16),
        ("alq", 3, 100, 777, torch.float64),
        ("alq", 8, 256, 5000, torch.float32),
        ("amq", 6, 128, 3001, torch.float16),
        ("alq", 7, 512, 4000, torch.float64),
    ]
    for method, bits, d, n, dtype in cases:
        for norm in ("linf", "l2") if get_method(method).adaptive else (get_method(method).norm,):
            q = Quantizer(method, bits=bits, bucket_size=d, norm=norm, seed=0)
            x = torch.randn(n, generator=torch.Generator().manual_seed(bits)) * torch.linspace(0.1, 3, n)
            x[:d] = 0  # a zero bucket
            if n > 3 * d:
                x[2 * d + 5] = float("nan")  # a non-finite one
            payloads = []
            for simd in (True, False):
                cpu._module.set_simd(simd)
                payloads.append(
                    cpu.encode(
                        x.to(dtype),
                        torch.as_tensor(q.levels),
                        _header(get_method(method).id, bits, d, n, q.levels),
                        bits=bits,
                        bucket_size=d,
                        norm=norm,
                        seed=5,
                    )
                )
            cpu._module.set_simd(True)
            assert torch.equal(payloads[0], payloads[1]), (method, bits, d, n, dtype, norm)


_M32, _M64 = 0xFFFFFFFF, 0xFFFFFFFFFFFFFFFF


def _splitmix64(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def _lowbias32(h: np.ndarray) -> np.ndarray:
    h = h.astype(np.uint64)
    h ^= h >> 16
    h = (h * 0x7FEB352D) & _M32
    h ^= h >> 15
    h = (h * 0x846CA68B) & _M32
    return h ^ (h >> 16)


def _reference_codes(x: np.ndarray, norms: np.ndarray, levels: np.ndarray, d: int, seed: int) -> np.ndarray:
    """The compiled codec's codes, written out in NumPy from its documented draw (codec_kernels.h:
    uniform_at, stochastic_code) in the same float32 operations, for coordinates below 2**32."""
    key = _splitmix64(seed)
    a, b = key & _M32, key >> 32
    i = np.arange(x.size, dtype=np.uint64)
    h = _lowbias32((_lowbias32(i ^ a) + b) & _M32)
    u = ((2 * (h >> 9) + 1).astype(np.float32) * np.float32(2.0**-24)).astype(np.float32)
    lv = levels.astype(np.float32)
    widths = (lv[1:] - lv[:-1]).astype(np.float32)
    with np.errstate(divide="ignore"):  # zero buckets: their codes are 0 (set by the caller)
        inv = (np.float32(1) / np.repeat(norms, d)[: x.size]).astype(np.float32)
    r = np.clip((x.astype(np.float32) * inv).astype(np.float32), np.float32(-1), np.float32(1))
    cell = (lv[None, 1:-1] <= r[:, None]).sum(axis=1)
    up = (u * widths[cell]).astype(np.float32) < (r - lv[cell]).astype(np.float32)
    return cell + up


@pytest.mark.parametrize("simd", [True, False], ids=["avx2", "generic"])
@pytest.mark.parametrize(
    "method,bits,norm",
    [
        ("alq", 2, "linf"),
        ("amq", 3, "l2"),
        ("alq", 4, "linf"),
        ("qsgdinf", 5, "linf"),
        ("alq", 6, "l2"),
        ("amq-n", 7, "linf"),
        ("alq", 8, "linf"),
        ("alq-n", 8, "l2"),
    ],
)
def test_cpu_codes_are_the_documented_draw(simd, method, bits, norm):
    """Draw for draw, the compiled codec's codes are those of its documented hash and rounding
    rule, in the vectorized chunks (whole 64-coordinate blocks: a select over the levels up to 4
    bits, a gathered binary search from 5) and coordinate by coordinate (bucket edges, tails): a
    bucket size that leaves both, levels fitted to a heavy-tailed gradient, a zero bucket."""
    cpu = _resolve("cpu")
    if simd and cpu._module.simd() != "avx2":
        pytest.skip("this CPU has no AVX2")
    cpu._module.set_simd(simd)
    try:
        q = Quantizer(method, bits=bits, bucket_size=200, norm=norm, seed=0)
        t = np.random.default_rng(bits).standard_t(3.0, 3000) * np.linspace(0.1, 2, 3000)
        x = torch.from_numpy(t.astype(np.float32))
        q.adapt(q.statistics(x.double().numpy()))
        x[400:600] = 0
        payload = cpu.encode(
            x,
            torch.as_tensor(q.levels),
            _header(get_method(method).id, bits, 200, x.numel(), q.levels),
            bits=bits,
            bucket_size=200,
            norm=norm,
            seed=12345,
        ).numpy()
    finally:
        cpu._module.set_simd(True)
    norms = _norms(payload, x.numel(), 200)
    want = _reference_codes(x.numpy(), norms, q.levels, 200, 12345)
    want[norms.repeat(200)[: x.numel()] == 0] = 0
    got = _codes(payload, x.numel(), 200, bits)
    assert (got == want).all(), np.flatnonzero(got != want)[:10]
    assert len(set(want.tolist())) > 2**bits // 2  # the levels are in use, not just the extremes


@pytest.mark.parametrize("simd", [True, False], ids=["avx2", "generic"])
@pytest.mark.parametrize("bits,d,norm", [(3, 64, "linf"), (2, 8, "l2"), (4, 128, "linf"), (6, 32, "l2")])
def test_cpu_encode_parts_is_the_encode_of_the_stream(simd, bits, d, norm):
    """Tensors read in place give the payload of the stream that holds them and zeros elsewhere: the
    same bytes, for parts that fill whole buckets, end inside one, share one, or leave gaps."""
    cpu = _resolve("cpu")
    cpu._module.set_simd(simd)
    try:
        g = torch.Generator().manual_seed(bits)
        sizes, gaps = [3 * d, d // 2 + 1, 5, 2 * d + 3, 1, d], [0, d - 1, 0, 7, d, 2]
        parts, starts, pos = [], [], 0
        for size, gap in zip(sizes, gaps):
            pos += gap
            parts.append(torch.randn(size, generator=g) * (1 + len(parts)))
            starts.append(pos)
            pos += size
        length = pos + 3  # trailing zeros too
        stream = torch.zeros(length)
        for part, start in zip(parts, starts):
            stream[start : start + part.numel()] = part
        q = Quantizer("alq", bits=bits, bucket_size=d, norm=norm, seed=0)
        args = dict(bits=bits, bucket_size=d, norm=norm, seed=11)
        header = _header(get_method("alq").id, bits, d, length, q.levels)
        want = cpu.encode(stream, torch.as_tensor(q.levels), header, **args)
        got = cpu.encode_parts(parts, starts, length, torch.as_tensor(q.levels), header, **args)
        assert torch.equal(got, want)
        with pytest.raises(RuntimeError, match="overlap"):
            cpu.encode_parts(parts[:2], [0, 1], length, torch.as_tensor(q.levels), header, **args)
    finally:
        cpu._module.set_simd(True)


@pytest.mark.parametrize("simd", [True, False], ids=["avx2", "generic"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(
    "bits,d,n,norm", [(3, 64, 1000, "linf"), (2, 8, 77, "l2"), (4, 128, 517, "l2"), (8, 16, 260, "linf")]
)
def test_cpu_encode_feedback_is_the_two_pass_error_feedback(simd, dtype, bits, d, n, norm):
    """The compiled one-pass error feedback gives the bytes and the buffer of the two-pass one
    (add, encode, decode, subtract), bit for bit, over rounds with a NaN bucket (which keeps
    its error), a bucket of tiny values, a zero bucket and a short last bucket."""
    from horovod_alq.exchange.feedback import ErrorFeedback, Pending
    from horovod_alq.torch.ops import TorchOps

    def encode(fb, o, x, seed):  # one tensor "k", its error committed (the exchange succeeded)
        pending = Pending()
        payload = fb.encode(o, x, q, seed, "own", [("k", 0, n, 0)], pending, (0, 1))
        fb.commit(pending)
        return payload

    key = ("own", "k", 0, n)
    cpu = _resolve("cpu")
    cpu._module.set_simd(simd)
    try:
        ops = TorchOps(torch.device("cpu"), "cpu")

        class TwoPass:  # the same ops without the one-pass kernel
            def __getattr__(self, name):
                if name == "encode_feedback":
                    raise AttributeError(name)
                return getattr(ops, name)

        q = Quantizer("alq", bits=bits, bucket_size=d, norm=norm, seed=0)
        one, two = ErrorFeedback(dtype), ErrorFeedback(dtype)
        g = torch.Generator().manual_seed(bits * 7 + d)
        for step in range(5):
            x = torch.randn(n, generator=g)
            x[d : 2 * d] *= 1e-30 if step % 2 else 0.0
            if step == 2:
                x[3] = float("nan")
            if step == 3:
                x[2 * d + 1] = float("inf")
            before = None if step == 0 else one.buffers[key].clone()
            got = encode(one, ops, x, 100 + step)
            want = encode(two, TwoPass(), x, 100 + step)
            assert torch.equal(got, want), step
            e = one.buffers[key]
            assert e.dtype == getattr(torch, dtype) and torch.equal(e, two.buffers[key]), step
            if step == 0 and dtype == "float32":  # what the payload dropped
                decoded = ops.zeros(n)
                ops.decode_sum(decoded, got, [0], q)
                assert torch.equal(e, x - decoded)
            if step in (2, 3):  # the bucket holding NaN or Inf kept its error, the others moved
                bad = 0 if step == 2 else 2 * d + 1
                b = slice(bad // d * d, bad // d * d + d)
                assert torch.equal(e[b], before[b]) and not torch.equal(e, before)
        assert bool(one.buffers[key].abs().gt(0).any())
    finally:
        cpu._module.set_simd(True)


def test_mixed_widths_take_the_two_pass_error_feedback():
    """bits_per="bucket" payloads hold several widths: the one-width kernel must not encode them."""
    from horovod_alq.core.bucket_widths import MixedWidths
    from horovod_alq.exchange.mixed import MixedOps
    from horovod_alq.torch.ops import TorchOps

    _resolve("cpu")
    mixed = MixedOps(TorchOps(torch.device("cpu"), "cpu"))
    qs = {b: Quantizer("alq", bits=b, bucket_size=64, seed=0) for b in (2, 3, 4)}
    x, e = torch.randn(256), torch.zeros(256)
    assert mixed.encode_feedback(x, e, MixedWidths(qs, 3.0, 3), 1) is None
    assert torch.equal(mixed.encode_feedback(x, e.clone(), qs[3], 1), mixed.inner.encode(x, qs[3], 1))


def test_cpu_encode_feedback_refuses_what_it_cannot_take():
    cpu = _resolve("cpu")
    q = Quantizer("alq", bits=3, bucket_size=64, seed=0)
    header = _header(get_method("alq").id, 3, 64, 100, q.levels)
    levels = torch.as_tensor(q.levels)
    args = dict(bits=3, bucket_size=64, norm="l2", seed=1)
    with pytest.raises(RuntimeError, match="err must be"):
        cpu.encode_feedback(torch.randn(100), torch.zeros(99), levels, header, **args)
    with pytest.raises(RuntimeError, match="x must be"):
        cpu.encode_feedback(torch.randn(100).double(), torch.zeros(100), levels, header, **args)
    with pytest.raises(RuntimeError, match="multiple of 8"):
        cpu.encode_feedback(torch.randn(100), torch.zeros(100), levels, header, **{**args, "bucket_size": 60})


@pytest.mark.parametrize("bits,d", [(3, 64), (2, 8), (5, 16), (3, 100)])
def test_decode_sum_of_a_window_is_the_window_of_the_decode(codec, bits, d):
    """Coordinates [start, start + m) of payloads, scaled: the same floats as that slice of the
    whole decode (the engine decodes each tensor of a fused buffer straight into its output)."""
    q = Quantizer("alq", bits=bits, bucket_size=d, seed=0)
    step = next(k * d for k in range(1, 9) if (k * d * bits) % 8 == 0)  # windows whose codes begin on a byte
    n = 4 * step + 3
    payloads = [_encode(codec, q, _x(n, torch.float32, seed) * (1 + seed), seed=seed + 1) for seed in range(3)]
    whole = _decode_sum(codec, q, payloads, n, scale=1 / 3)
    buf = torch.from_numpy(np.concatenate(payloads))
    offsets = [0, payloads[0].size, 2 * payloads[0].size]
    for start, m in [(0, n), (step, 2 * d), (step, n - step), (2 * step, 1), (0, d + 1)]:
        out = torch.full((m,), 7.0)
        codec.decode_sum(
            out, buf, offsets, torch.as_tensor(q.levels), bits=bits, bucket_size=d, scale=1 / 3, start=start, numel=n
        )
        np.testing.assert_array_equal(out.numpy(), whole[start : start + m], err_msg=f"{start}+{m}")


@pytest.fixture
def triton():
    return _resolve("triton")


def _header(method_id, bits, d, n, levels) -> torch.Tensor:
    raw = pack_header(Header(method_id, bits, d, n, levels_fingerprint(levels)))
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def _encode(codec, q: Quantizer, x: torch.Tensor, seed: int = 1, **kw) -> np.ndarray:
    m = get_method(q.method)
    payload = codec.encode(
        x.reshape(-1).contiguous(),
        torch.as_tensor(q.levels),
        _header(m.id, q.bits, q.bucket_size, x.numel(), q.levels),
        bits=q.bits,
        bucket_size=q.bucket_size,
        norm=m.norm,
        seed=seed,
        **kw,
    )
    assert payload.dtype == torch.uint8 and payload.dim() == 1
    return payload.numpy()


def _decode_sum(codec, q: Quantizer, payloads: list, n: int, scale: float = 1.0) -> np.ndarray:
    buf = torch.from_numpy(np.concatenate(payloads))
    offsets = np.cumsum([0] + [p.size for p in payloads[:-1]]).tolist()
    out = torch.full((n,), 7.0)  # overwritten, not accumulated into
    got = codec.decode_sum(
        out, buf, offsets, torch.as_tensor(q.levels), bits=q.bits, bucket_size=q.bucket_size, scale=scale
    )
    assert got is out
    return out.numpy()


def _norms(payload: np.ndarray, n: int, d: int) -> np.ndarray:
    return payload[32 : 32 + 4 * -(-n // d)].view("<f4")


def _codes(payload: np.ndarray, n: int, d: int, bits: int) -> np.ndarray:
    return unpack_codes(payload[32 + 4 * -(-n // d) :], bits, n).astype(np.int64)


# (method, bits, bucket size, n, dtype): fused Triton path (d % 8 == 0) and generic path,
# linear level search (bits <= 4) and binary search, short last buckets, every input dtype
CASES = [
    ("alq", 3, 64, 300, torch.float32),
    ("qsgdinf", 8, 40, 333, torch.float64),
    ("nuqsgd", 6, 96, 250, torch.float16),
    ("terngrad", 2, 256, 600, torch.bfloat16),
    ("amq", 4, 100, 257, torch.float32),
    ("qsgd", 5, 48, 200, torch.float32),
    ("qsgdinf", 7, 24, 100, torch.float16),
]


def _x(n, dtype, seed=0):
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("method,bits,d,n,dtype", CASES)
def test_payload_is_the_wire_format(codec, method, bits, d, n, dtype):
    q = Quantizer(method, bits=bits, bucket_size=d, seed=0)
    x = _x(n, dtype, seed=bits)
    payload = _encode(codec, q, x)
    assert payload.size == 32 + 4 * -(-n // d) + -(-n * q.bits // 8)
    header = _header(get_method(method).id, q.bits, d, n, q.levels).numpy()
    assert (payload[:32] == header).all()
    core_norms = normalize(x.double().numpy(), d, get_method(method).norm).norms
    if codec.name == "torch":  # float32 reductions
        np.testing.assert_allclose(_norms(payload, n, d), core_norms, rtol=2e-6)
    else:  # float64 accumulation, rounded once: the core's float32 norms, byte for byte
        assert (_norms(payload, n, d) == core_norms).all()
    used = -(-n * q.bits // 8) * 8 - n * q.bits  # unused trailing bits are 0
    assert payload[-1] >> (8 - used) == 0 if used else True
    decoded = q.decode(payload)
    norms = np.repeat(_norms(payload, n, d), d)[:n]
    levels = q.levels.astype(np.float32)
    assert (decoded[:, None] == norms[:, None] * levels[None, :]).any(axis=1).all()
    r = np.clip(x.double().numpy() / norms, -1, 1)
    cell = np.clip(np.searchsorted(q.levels, r, side="right") - 1, 0, q.levels.size - 2)
    tol = 1e-5 * norms
    assert (decoded >= norms * q.levels[cell] - tol).all()
    assert (decoded <= norms * q.levels[cell + 1] + tol).all()


@pytest.mark.parametrize("method,bits,d,n,dtype", [CASES[0], CASES[1], CASES[4]])
def test_payloads_decode_identically_with_every_backend_and_the_core(method, bits, d, n, dtype):
    """A payload from any backend (and from the core) decodes, summed and scaled, to the same
    values with every backend as with Quantizer.decode."""
    q = Quantizer(method, bits=bits, bucket_size=d, seed=0)
    x = _x(n, dtype, seed=7)
    x[:d] = 0.0  # a zero bucket
    x[d + 1] = float("nan")  # a NaN bucket
    available = [name for name in BACKENDS if name in codecs.available("cpu")]
    payloads = [_encode(codecs.resolve(name, "cpu"), q, x, seed=3) for name in available]
    payloads.append(q.encode(x.double().numpy()))
    expected = sum(q.decode(p).astype(np.float64) for p in payloads) * 0.25
    for name in available:
        got = _decode_sum(codecs.resolve(name, "cpu"), q, payloads, n, scale=0.25)
        np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-7)
        assert np.isnan(got[d : 2 * d]).all() and (got[:d] == 0).all()
        for p in payloads:  # each alone: exactly the core's float32 decode
            np.testing.assert_array_equal(_decode_sum(codecs.resolve(name, "cpu"), q, [p], n), q.decode(p))


@pytest.mark.parametrize("bits,d", [(3, 100), (3, 64), (8, 40)])
def test_decode_sum_of_unaligned_payloads(codec, bits, d):
    """Payloads back to back at odd byte offsets (as an allgather returns them), scale folded in."""
    q = Quantizer("qsgdinf", bits=bits, bucket_size=d, seed=3)
    xs = [np.random.default_rng(i).standard_normal(1003).astype(np.float32) for i in range(3)]
    payloads = [q.encode(x) for x in xs]
    assert payloads[0].size % 4 != 0
    expected = sum(q.decode(p).astype(np.float64) for p in payloads) / 3
    np.testing.assert_allclose(_decode_sum(codec, q, payloads, 1003, scale=1 / 3), expected, rtol=1e-5, atol=1e-6)


def test_corrupted_codes_decode_to_nan(codec):
    q = Quantizer("terngrad", bucket_size=8, seed=0)
    payload = q.encode(np.ones(8, dtype=np.float32))
    payload[-2:] = 0xFF  # code 3 does not exist for TernGrad's 3 levels
    assert np.isnan(_decode_sum(codec, q, [payload], 8)).all()


def test_decode_of_no_payloads_is_zero(codec):
    q = Quantizer("alq", bucket_size=8, seed=0)
    out = torch.full((5,), 3.0)
    codec.decode_sum(
        out, torch.zeros(0, dtype=torch.uint8), [], torch.as_tensor(q.levels), bits=3, bucket_size=8, scale=2.0
    )
    assert (out == 0).all()


@pytest.mark.parametrize("norm", ["l2", "linf"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_codes_are_exact_where_rounding_is_deterministic(codec, dtype, norm):
    """Values that are exactly norm * level round to that level with certainty: every backend
    writes the same codes and decodes x exactly (levels and norm are powers of two)."""
    levels = np.array([-1.0, -0.5, -0.25, 0.0, 0.125, 0.5, 1.0])
    idx = np.random.default_rng(0).integers(0, levels.size, 77)
    idx[::16] = 6  # every bucket of 16 reaches 1, so its max-abs is exactly 4
    values = 4.0 * levels[idx]
    if norm == "l2":  # scale so that the bucket's L2 norm is a power of two: one bucket [4, 0, ...]
        values = np.zeros(16)
        values[0] = 4.0
        idx = np.full(16, 3)
        idx[0] = 6
    x = torch.tensor(values).to(dtype)
    d = 16
    header = _header(0, 3, d, x.numel(), levels)
    payload = codec.encode(x, torch.as_tensor(levels), header, bits=3, bucket_size=d, norm=norm, seed=5)
    payload = payload.numpy()
    assert (_norms(payload, x.numel(), d) == 4.0).all()
    assert (_codes(payload, x.numel(), d, 3) == idx).all()
    out = torch.empty(x.numel())
    codec.decode_sum(out, torch.from_numpy(payload), [0], torch.as_tensor(levels), bits=3, bucket_size=d, scale=1.0)
    assert (out.numpy() == values).all()


# Forced uniforms through the Triton kernels' testing hook: bits 2..8 (linear and binary level
# search), fused (d % 8 == 0) and generic paths, zero / NaN / tiny-norm buckets, short last bucket.
EXACT = [
    ("qsgdinf", 2, 64, 200, torch.float32),
    ("terngrad", 2, 30, 95, torch.float16),
    ("alq", 3, 64, 190, torch.bfloat16),
    ("amq", 4, 50, 170, torch.float64),
    ("qsgd", 5, 72, 200, torch.float32),
    ("nuqsgd", 6, 33, 100, torch.float32),
    ("qsgdinf", 7, 128, 300, torch.float64),
    ("alq", 8, 56, 150, torch.float16),
    ("qsgd", 8, 20, 90, torch.float32),
]


def _numpy_reference_codes(
    x: np.ndarray, norms: np.ndarray, levels: np.ndarray, u: np.ndarray, bucket_size: int
) -> np.ndarray:
    """The codes the Triton encoder writes for given uniforms: float32 arithmetic as in
    ``_triton_kernels`` (``r = clamp((x * s) * (1 / (n_b * s)))``, compare ``u * width < r - lo``)."""
    f = np.float32
    x = np.asarray(x).astype(f)
    nb_norm = np.repeat(np.asarray(norms, dtype=f), bucket_size)[: x.size]
    live = np.isfinite(nb_norm) & (nb_norm > 0)
    s = np.where(nb_norm < f(2.0**-64), f(2.0**64), f(1.0)).astype(f)
    with np.errstate(all="ignore"):
        inv = np.where(live, f(1.0) / (nb_norm * s), f(0.0)).astype(f)
        r = np.clip((x * s) * inv, f(-1), f(1)).astype(f)
    r = np.where(live, r, f(0.0)).astype(f)
    lf = np.asarray(levels, dtype=f)
    cell = np.clip(np.searchsorted(lf, r, side="right") - 1, 0, lf.size - 1)
    width = np.append(lf[1:] - lf[:-1], f(0.0)).astype(f)
    lo = lf[cell]
    up = (np.asarray(u, dtype=f) * width[cell]).astype(f) < (r - lo).astype(f)
    return (cell + up).astype(np.int64)


@pytest.mark.parametrize("method,bits,d,n,dtype", EXACT)
def test_triton_codes_for_given_uniforms(triton, method, bits, d, n, dtype):
    q = Quantizer(method, bits=bits, bucket_size=d, seed=0)
    x = _x(n, dtype, seed=bits)
    x[:d] = 0.0  # zero bucket
    x[d + 2] = float("inf")  # non-finite bucket
    if dtype == torch.float32:
        x[2 * d : 3 * d] *= 1e-25  # norm below 2**-64: 1 / norm alone would overflow
    rng = np.random.default_rng(bits)
    u = (2 * rng.integers(0, 1 << 23, n) + 1) / 2.0**24
    u[:5] = [0.5 / 2**23, 1 - 0.5 / 2**23, 0.5, 0.25, 0.75]
    payload = _encode(triton, q, x, uniforms=torch.tensor(u, dtype=torch.float32))
    norms = _norms(payload, n, d)
    assert np.isnan(norms[1]) and norms[0] == 0
    expected = _numpy_reference_codes(x.float().numpy(), norms, q.levels, u, d)
    assert (_codes(payload, n, d, q.bits) == expected).all()
    dec = q.decode(payload)
    assert (dec[:d] == 0).all() and np.isnan(dec[d : 2 * d]).all() and np.isfinite(dec[2 * d :]).all()


def test_triton_fused_and_generic_paths_write_identical_payloads(triton):
    """Draws depend only on the seed and the element index, not on the kernel or its tiling."""
    q = Quantizer("alq", bits=3, bucket_size=64, seed=0)
    x = _x(300, torch.float32, seed=1)
    fused = _encode(triton, q, x, seed=11)
    saved = triton.max_fused_bucket, triton.encode_quads
    try:
        triton.max_fused_bucket, triton.encode_quads = 0, 2  # generic path, several programs
        generic = _encode(triton, q, x, seed=11)
    finally:
        triton.max_fused_bucket, triton.encode_quads = saved
    assert (fused == generic).all()
    assert (_encode(triton, q, x, seed=11) == fused).all()
    assert not (_encode(triton, q, x, seed=12) == fused).all()


def test_triton_large_bucket_norm_is_split_over_programs(triton):
    q = Quantizer("qsgd", bits=4, bucket_size=1000, seed=0)
    x = _x(2500, torch.float32, seed=2)
    saved = triton.norm_chunk
    try:
        triton.norm_chunk = 96  # buckets of 1000 over 11 programs each, reduced by torch
        payload = _encode(triton, q, x)
    finally:
        triton.norm_chunk = saved
    assert (_norms(payload, 2500, 1000) == normalize(x.double().numpy(), 1000, "l2").norms).all()


@pytest.mark.parametrize("method,bits,d", [("nuqsgd", 3, 64), ("qsgdinf", 2, 40), ("alq", 6, 32)])
def test_unbiased(codec, method, bits, d):
    """The mean of M independent encodes is within a Bernstein bound of x, per coordinate, with the
    exact variance of each coordinate. The M encodes are M copies of x in one tensor (the draws are
    independent across elements), so that the interpreter runs one call."""
    n, m = 2 * d, 200
    q = Quantizer(method, bits=bits, bucket_size=d, seed=0)
    x = _x(n, torch.float32, seed=bits)
    x[: d // 2] = 0.0
    if codec.name == "triton":  # the generic path: a few programs instead of one per bucket
        saved, codec.max_fused_bucket = codec.max_fused_bucket, 0
    try:
        payload = _encode(codec, q, x.repeat(m), seed=9)
    finally:
        if codec.name == "triton":
            codec.max_fused_bucket = saved
    dec = q.decode(payload).astype(np.float64).reshape(m, n)
    mean = dec.mean(0)
    norms = np.repeat(_norms(payload, n, d)[: n // d].astype(np.float64), d)
    levels = q.levels.astype(np.float32).astype(np.float64)
    target = x.double().numpy()
    r = np.clip(target / norms, -1, 1)
    cell = np.clip(np.searchsorted(levels, r, side="right") - 1, 0, levels.size - 2)
    lo, hi = levels[cell], levels[cell + 1]
    var = norms**2 * np.clip((hi - r) * (r - lo), 0, None)
    c = norms * (hi - lo) / m
    log_term = np.log(2 / 1e-9)
    bound = c * log_term / 3 + np.sqrt((c * log_term / 3) ** 2 + 2 * var / m * log_term)
    bound += 1e-6 * (np.abs(target) + norms)
    assert (np.abs(mean - target) <= bound).all()
    assert abs((mean - target).sum()) <= 5 * np.sqrt(var.sum() / m) + 1e-6 * np.abs(target).sum()
    assert dec.std(0).max() > 0  # the copies did draw independently


@pytest.mark.parametrize("norm", ["l2", "linf"])
def test_non_finite_zero_and_short_buckets(codec, norm):
    q = Quantizer("qsgdinf" if norm == "linf" else "alq", bucket_size=10, seed=0)
    x = torch.randn(47, generator=torch.Generator().manual_seed(4))
    x[15] = float("nan")
    x[33] = float("-inf")
    x[0:10] = 0.0
    dec = q.decode(_encode(codec, q, x))
    assert np.isnan(dec[10:20]).all() and np.isnan(dec[30:40]).all()
    assert (dec[0:10] == 0).all() and np.isfinite(dec[20:30]).all() and np.isfinite(dec[40:]).all()


def test_unbiased_for_tiny_and_subnormal_norms(codec):
    """Buckets whose norm is below 2**-64 (1 / norm may overflow float32) or subnormal: the mean of
    K decodes stays within 6 standard errors of x at every coordinate (one decode's error is at most
    the norm, so its standard deviation is too). Before the CPU codec scaled such buckets, their
    zeros decoded to -norm. (Fewer decodes for Triton, interpreted on CPU: the bound follows K.)"""
    d, k = 64, 60 if codec.name == "triton" else 200
    g = torch.Generator().manual_seed(3)
    x = torch.rand(3 * d, generator=g) * 2 - 1
    x[:d] *= 1e-40  # subnormal float32
    x[d : 2 * d] *= 1e-30  # normal, below 2**-64
    x[5] = x[d + 5] = 0.0
    q = Quantizer("alq", bits=3, bucket_size=d, seed=0)
    mean = np.mean([q.decode(_encode(codec, q, x, seed=s)) for s in range(1, k + 1)], axis=0)
    norms = np.repeat(np.abs(x.numpy()).reshape(3, d).max(axis=1), d)
    err = np.abs(mean - x.numpy())
    assert (err <= 6 * norms / np.sqrt(k) + 1e-45).all(), (err / norms).max()


def test_empty_tensor(codec):
    q = Quantizer("alq", bucket_size=16, seed=0)
    payload = _encode(codec, q, torch.zeros(0))
    assert payload.size == 32


@pytest.mark.parametrize("method,norm", [("alq", "l2"), ("alq", "linf"), ("alq-n", "l2"), ("qsgdinf", "linf")])
def test_statistics_match_the_numpy_core(codec, method, norm):
    torch.manual_seed(0)
    d = 300
    x = torch.distributions.StudentT(3.0).sample((4 * d + 17,))
    x[d : 2 * d] = 0.0
    x[2 * d + 5] = float("nan")
    q = Quantizer(method, bucket_size=d, seed=0, norm=norm)
    moments = codec.bucket_moments(x, bucket_size=d, norm=norm)
    want = BucketMoments(*(np.asarray(a) for a in moments))
    ref = normalize(x.numpy(), d, norm)
    keep = np.isfinite(ref.norms) & (ref.norms > 0)
    np.testing.assert_array_equal(want.norms, ref.norms[keep].astype(np.float64))
    np.testing.assert_array_equal(want.count, [d, d, 17])
    np.testing.assert_allclose(want.sum_r, ref.r[keep].sum(1), rtol=1e-6, atol=1e-5)
    np.testing.assert_allclose(want.sum_r2, (ref.r[keep] ** 2).sum(1), rtol=1e-6)
    if get_method(method).normless or method == "qsgdinf":
        got = normless_statistics(want)
    else:
        got = codec.grid_statistics(x, torch.tensor(GRID), bucket_size=d, norm=norm)
        if codec.name in ("triton", "cpu"):  # exactly: float64-accumulated norms, r = float32(x) / norm
            np.testing.assert_allclose(got, _grid_reference(x, d, norm), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(got, q.statistics(x.numpy()), rtol=1e-6, atol=1e-5)


def _grid_reference(x: torch.Tensor, d: int, norm: str) -> np.ndarray:
    """[W, C(GRID)] in NumPy with the core's float32 norms and r = float32(x) / norm in float32."""
    ref = normalize(x.double().numpy(), d, norm)
    n = x.numel()
    norms = np.repeat(ref.norms, d)[:n]
    keep = np.isfinite(norms) & (norms > 0)
    with np.errstate(all="ignore"):
        r = np.clip(x.float().numpy() / norms, np.float32(-1), np.float32(1)).astype(np.float64)
    counts = np.repeat(np.minimum(d, n - np.arange(ref.norms.size) * d), d)[:n]
    weights = np.where(keep, norms.astype(np.float64) / counts, 0.0)
    cells = np.maximum(np.searchsorted(GRID, np.where(keep, r, 0.0), side="left"), 1)
    hist = np.bincount(cells, weights=weights, minlength=GRID.size + 1)
    bucket_keep = np.isfinite(ref.norms) & (ref.norms > 0)
    return np.concatenate([[ref.norms[bucket_keep].astype(np.float64).sum()], np.cumsum(hist[: GRID.size])])


@pytest.mark.parametrize("grid", ["GRID", "dense"])
def test_grid_cells_exact_at_and_beside_grid_points(codec, grid):
    """The cell of every coordinate is the core's (``searchsorted`` on the grid) also for values on a
    grid point, one float32 step either side of it, signed zeros, tiny values and +-1: with the
    default grid (the CPU codec's table lookup) and a grid of points too close for it (its bisection),
    in turn, so that the codec's per-thread table follows a change of grid."""
    g = GRID if grid == "GRID" else np.concatenate([[-1.0], np.linspace(0.5, 0.5001, 300), [1.0]])
    g32 = g.astype(np.float32)
    values = np.concatenate(
        [
            g32,
            np.nextafter(g32, np.float32(2)),
            np.nextafter(g32, np.float32(-2)),
            np.array([0.0, -0.0, 1e-30, -1e-30, 1e-7, -1e-7, 1.0, -1.0], np.float32),
        ]
    )
    values = np.clip(values, np.float32(-1), np.float32(1)).astype(np.float32)
    x = torch.from_numpy(np.concatenate([[np.float32(1.0)], values]))  # max-abs norm 1: r = x exactly
    d = x.numel()
    for grid_values in (g, GRID):  # the other grid after this one: the cached table must follow
        got = codec.grid_statistics(x, torch.tensor(grid_values), bucket_size=d, norm="linf")
        per_cell = np.rint(np.diff(np.concatenate([[0.0], got[1:]])) * d).astype(np.int64)
        cells = np.maximum(np.searchsorted(grid_values, x.numpy().astype(np.float64), side="left"), 1)
        np.testing.assert_array_equal(per_cell, np.bincount(cells, minlength=grid_values.size + 1)[: grid_values.size])


@pytest.mark.parametrize("norm", ["l2", "linf"])
def test_grid_histograms_match_the_numpy_core(codec, norm):
    """bits="auto": row 0 is grid_statistics, row 1 the same cells weighted by squared norms."""
    torch.manual_seed(1)
    d = 300
    x = torch.distributions.StudentT(3.0).sample((4 * d + 17,))
    x[:d] *= 50.0  # buckets of very different norms: the two weightings differ
    x[d : 2 * d] = 0.0
    x[2 * d + 5] = float("nan")
    got = codec.grid_histograms(x, torch.tensor(GRID), bucket_size=d, norm=norm)
    want = grid_histograms(normalize(x.numpy(), d, norm))
    assert got.shape == want.shape == (2, 1 + GRID.size)
    np.testing.assert_allclose(
        got[0],
        codec.grid_statistics(x, torch.tensor(GRID), bucket_size=d, norm=norm),
        rtol=1e-12 if codec.name != "triton" else 1e-6,
        atol=1e-12,
    )  # triton: torch kernels
    for row, ref in zip(got, want):
        np.testing.assert_allclose(row, ref, rtol=1e-6, atol=1e-6 * ref[-1])
    assert got[1, 0] == pytest.approx(got[1, -1], rel=1e-12)  # total weight: every coordinate counted once


@pytest.mark.parametrize("method", ["alq", "amq-n"])
def test_auto_rows_match_the_numpy_core(codec, method):
    """bits="auto": every tensor's refit vector (errors per width, statistics) from the codec
    equals the NumPy core's, and the batched errors equal each tensor's own."""
    from helpers import quantization_errors

    from horovod_alq.core.auto_bits import AutoBits
    from horovod_alq.exchange.job import auto_rows
    from horovod_alq.exchange.numpy_ops import NumpyOps
    from horovod_alq.torch.ops import TorchOps

    gen = torch.Generator().manual_seed(2)
    parts = [s * torch.randn(n, generator=gen) for s, n in ((1.0, 700), (30.0, 300), (0.01, 1000))]
    auto = AutoBits(method, 3.0, 256)
    ops = TorchOps("cpu", "cpu")
    ops.codec = codec
    got = auto_rows(auto, ops, parts)
    want = auto_rows(auto, NumpyOps(), [p.numpy() for p in parts])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-9 * np.abs(want).max())
    qs = [auto.quantizers[w] for w in (2, 3, 4, 5, 6, 7, 8)]
    for row, p in zip(want, parts):
        np.testing.assert_allclose(row[:7], quantization_errors(p.numpy(), qs), rtol=1e-12)
        np.testing.assert_allclose(row, auto.row(p.numpy()), rtol=1e-12)


def test_triton_statistics_over_split_and_grouped_buckets(triton):
    x = torch.randn(3000, generator=torch.Generator().manual_seed(3))
    x[1000:2000] *= 3
    saved = triton.stats_chunk
    try:
        for chunk in (256, 1 << 15):  # buckets of 1000 split over 4 programs each; all in one program
            triton.stats_chunk = chunk
            got = triton.grid_statistics(x, torch.tensor(GRID), bucket_size=1000, norm="l2")
            np.testing.assert_allclose(got, _grid_reference(x, 1000, "l2"), rtol=1e-12, atol=1e-12)
            norms, count, sum_r, sum_r2 = triton.bucket_moments(x, bucket_size=1000, norm="l2")
            ref = normalize(x.double().numpy(), 1000, "l2")
            np.testing.assert_array_equal(norms, ref.norms)
            np.testing.assert_array_equal(count, [1000] * 3)
            np.testing.assert_allclose(sum_r, ref.r.sum(1), rtol=1e-6, atol=1e-5)
            np.testing.assert_allclose(sum_r2, (ref.r**2).sum(1), rtol=1e-6)
    finally:
        triton.stats_chunk = saved


# ---------------------------------------------------------------------- registry
def test_unknown_codec_lists_the_choices():
    with pytest.raises(ValueError, match="unknown codec 'fast'.*'auto', 'torch', 'cpu', 'triton'"):
        codecs.resolve("fast", "cpu")


def test_triton_on_cpu_without_interpreter_says_how(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    if triton_codec.import_error() is not None:
        pytest.skip("triton not installed")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        codecs.resolve("triton", "cpu")
    assert "triton" not in codecs.available("cpu")
    assert codecs.resolve("auto", "cpu").name in ("cpu", "torch")


def test_triton_imported_before_the_interpreter_was_asked_for_says_so():
    if triton_codec.import_error() is not None:
        pytest.skip("triton not installed")
    code = (
        "import os, triton.language; os.environ['TRITON_INTERPRET'] = '1'\n"
        "from horovod_alq.torch import codecs\n"
        "try:\n    codecs.resolve('triton', 'cpu')\nexcept ValueError as err:\n    print(err)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    env.pop("TRITON_INTERPRET")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert "imported before it was set" in out.stdout, out.stdout + out.stderr


def test_triton_not_importable_says_how_to_install(monkeypatch):
    monkeypatch.setattr(triton_codec, "_IMPORT_ERROR", ["ModuleNotFoundError: No module named 'triton'"])
    with pytest.raises(ValueError, match="not importable.*pip install triton==3.6.0"):
        codecs.resolve("triton", "cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert codecs.resolve("auto", "meta").name == "torch"


def test_auto_and_available():
    names = codecs.available("cpu")
    assert names[0] == "torch"
    auto = codecs.resolve("auto", "cpu")
    assert auto.name == ("cpu" if "cpu" in names else "torch")  # never the interpreter on CPU
    with pytest.raises(ValueError, match="CPU tensors"):
        codecs.resolve("cpu", "meta")


def test_a_new_backend_is_one_registry_entry(monkeypatch):
    monkeypatch.setattr(codecs, "_FACTORIES", dict(codecs._FACTORIES))
    codecs.register("mine", lambda device: codecs.resolve("torch", device))
    assert "mine" in codecs.names() and "mine" in codecs.available("cpu")
    assert codecs.resolve("mine", "cpu").name == "torch"


def test_compressor_codec_keyword():
    from horovod_alq.torch import ALQCompressor

    assert ALQCompressor(codec="triton")._codec == "triton"
    with pytest.raises(ValueError, match="unknown codec"):
        ALQCompressor(codec="gpu")
    with pytest.warns(DeprecationWarning, match="fused= is deprecated"):
        assert ALQCompressor(fused=False)._codec == "torch"
    with pytest.warns(DeprecationWarning):
        assert ALQCompressor(fused=True)._codec == "auto"


# ---------------------------------------------------------------------- GPU compilation
def test_triton_kernels_compile_for_the_gpu(tmp_path):
    """No GPU here: compile the kernels as the GPU would run them (sm_90, H100/H200) down to cubins
    with the ptxas that ships with Triton, so that a kernel the interpreter accepts but the compiler
    rejects fails here. In a fresh process: this one imported Triton for the interpreter.
    (Triton caches the cubins under ~/.triton: later runs take seconds.)"""
    if triton_codec.import_error() is not None:
        pytest.skip("triton not installed")
    script = Path(__file__).with_name("compile_triton_kernels.py")
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    result = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("cubin") == 5, result.stdout


@pytest.mark.parametrize("name", ["torch", "cpu", "triton"])
@pytest.mark.parametrize("method", ["alq", "alq-n"])
def test_the_exchange_calls_its_codec_at_all_three_places(name, method):
    """encode, decode-and-sum and statistics of the exchange's torch ops (what a compressor with
    codec=name runs): the payload decodes as the core decodes it, the statistics are the core's."""
    from horovod_alq.torch.ops import TorchOps

    _resolve(name)
    ops = TorchOps("cpu", name)
    assert ops.codec.name == name
    x = _x(200, torch.float32, seed=5)
    q = Quantizer(method, bits=3, bucket_size=64, seed=0)
    payload = ops.encode(x, q, 1)
    out = ops.zeros(200)
    ops.decode_sum(out, torch.cat([payload, payload]), [0, payload.numel()], q)
    np.testing.assert_array_equal(out.numpy(), q.decode(payload.numpy()) * np.float32(2))
    np.testing.assert_allclose(ops.statistics(x, q), q.statistics(x.numpy()), rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("bits_per", ["tensor", "bucket"])
@pytest.mark.parametrize(
    "codec, exchange",
    # Triton's interpreter takes seconds a round: its allgather case covers its runs of several widths
    [(b, e) for b in BACKENDS for e in ("allgather", "two-phase") if (b, e) != ("triton", "two-phase")],
    indirect=["codec"],
)
def test_mixed_widths_in_one_buffer_sum_unbiased_on_every_backend(codec, exchange, bits_per):
    """bits="auto" through the exchange engine on 3 thread ranks with this backend: after the refit,
    tensors of widths chosen apart (``bits_per="bucket"``: buckets, in mixed payloads) share one
    fusion buffer; the decoded sum is identical on every rank and unbiased (per bucket t tests at
    1e-6, Bonferroni over the buckets, 60 rounds; Triton's interpreter, at seconds a round:
    allgather, one rank, 6 buckets, 20 rounds)."""
    from helpers import assert_zero_mean

    from horovod_alq.settings import Settings, configure
    from horovod_alq.testing import exchange_round
    from horovod_alq.torch.ops import TorchOps

    slow = codec.name == "triton"
    n, rounds, d, scales = (1 if slow else 3), (20 if slow else 60), 64, (100.0, 1.0, 0.01)
    sizes = (130, 190, 64) if slow else (300, 520, 200)
    setups = [
        configure(
            Settings("alq", "auto", d, bit_budget=3.0, bits_per=bits_per, update_steps=(0,), update_every=0, seed=5)
        )
        for _ in range(n)
    ]
    engines = [s.engine(exchange=exchange, uid="c") for s in setups]
    ops = TorchOps("cpu", "torch")
    ops.codec = _Serialized(codec)  # Triton's interpreter is not thread-safe; the ranks are threads
    g = torch.Generator().manual_seed(0)
    xs = [[torch.randn(k, generator=g) * s for s, k in zip(scales, sizes)] for _ in range(n)]
    truth = [sum(x[k].double() for x in xs) for k in range(len(sizes))]
    exchange_round(engines, xs, ops, "refit")
    devs = []
    for step in range(rounds):
        outs = exchange_round(engines, xs, ops, f"s{step}")
        assert all(torch.equal(a, b) for o in outs[1:] for a, b in zip(outs[0], o))
        devs.append(torch.cat([(o.double() - tr) / s for o, tr, s in zip(outs[0], truth, scales)]).numpy())
    if bits_per == "tensor":
        assert len(set(setups[0].state.metrics()["allocation"])) > 1
    else:  # a payload of rank 0's stream: buckets of several widths, within the budget
        from horovod_alq.core.wire import bucket_lengths
        from horovod_alq.exchange.mixed import MixedOps

        mixed = setups[0].state.auto.mixed
        x = torch.cat([torch.cat([t, torch.zeros(-len(t) % d)]) for t in xs[0]])
        widths, _ = mixed.layout(MixedOps(ops).encode(x, mixed, 3).numpy(), 0, x.numel())
        assert len(set(widths.tolist())) > 2 and (bucket_lengths(x.numel(), d) * widths).sum() <= 3 * x.numel()
    dev = np.array(devs)
    assert_zero_mean(np.add.reduceat(dev, np.arange(0, dev.shape[1], d), axis=1))


@pytest.mark.parametrize("norm", ["l2", "linf"])
def test_mixed_payload_read_in_place_is_the_streams(codec, norm):
    """``bits_per="bucket"``: a mixed payload encoded from a round's tensors in place (``encode_parts``:
    tensors on bucket boundaries, zeros between, short last buckets, a window that starts inside a
    tensor and ends at the stream's end) has the bytes of the one encoded from the stream; where
    the codec cannot read in place, None (the engine then encodes the stream)."""
    from horovod_alq.core.auto_bits import AUTO_WIDTHS, AutoBits
    from horovod_alq.exchange.mixed import MixedOps
    from horovod_alq.torch.ops import TorchOps

    d = 64
    auto = AutoBits("alq", 3.0, d, norm, bits_per="bucket")
    g = torch.Generator().manual_seed(4)
    sizes, scales = (300, 64, 1000, 130, 7), (1.0, 30.0, 0.01, 5.0, 2.0)
    xs = [torch.randn(k, generator=g) * s for k, s in zip(sizes, scales)]
    starts = np.concatenate([[0], np.cumsum([-(-k // d) * d for k in sizes[:-1]])]).tolist()
    length = starts[-1] + sizes[-1]
    stream = torch.zeros(length)
    for x, s0 in zip(xs, starts):
        stream[s0 : s0 + x.numel()] = x
    ops = MixedOps(TorchOps("cpu", "torch"))
    ops.inner.codec = codec
    # the widths come from the same norms, bit for bit: an L2 norm of a short row is not always that
    # of the row completed by zeros, so 40 tensors with short last buckets, zeros after each
    short = [torch.randn(int(k), generator=g) for k in torch.randint(1, 3 * d, (40,), generator=g)]
    at = np.concatenate([[0], np.cumsum([-(-x.numel() // d) * d for x in short[:-1]])]).tolist()
    whole = torch.zeros(at[-1] + short[-1].numel())
    for x, s0 in zip(short, at):
        whole[s0 : s0 + x.numel()] = x
    np.testing.assert_array_equal(ops._parts_norms(short, at, whole.numel(), d, norm), ops.bucket_norms(whole, d, norm))
    for refit in (False, True):  # before the first refit every bucket has one width: one run across all
        if refit:
            rows = np.stack([auto.row(x.numpy()) for x in xs])
            auto.refit(rows, list(sizes), [(k, 0) for k in sizes])  # every width's levels, the error model
        for lo in (0, 2 * d):  # the whole stream; a window from inside the first tensor
            parts, at = [], []
            for x, s0 in zip(xs, starts):
                a, b = max(lo, s0), s0 + x.numel()
                if a < b:
                    parts.append(x[a - s0 :])
                    at.append(a - lo)
            got = ops.encode_parts(parts, at, length - lo, auto.mixed, 9)
            want = ops.encode(stream[lo:], auto.mixed, 9)
            widths, _ = auto.mixed.layout(want.numpy(), 0, length - lo)
            assert len(set(widths.tolist())) > 2 if refit else len(set(widths.tolist())) == 1, widths
            if getattr(codec, "encode_parts", None) is None:
                assert got is None
            else:
                assert torch.equal(got, want), (norm, refit, lo)
    assert ops.encode_parts(parts[:1], [d + 1], length, auto.mixed, 9) is None  # off a bucket boundary
    assert sorted(auto.quantizers) == list(AUTO_WIDTHS)


@pytest.mark.parametrize("norm", ["l2", "linf"])
@pytest.mark.parametrize("n", [0, 64, 200, 1000])
def test_torch_bucket_ops_match_numpy(norm, n):
    """What mixed payloads need from the tensor ops: bucket norms, buckets taken and added back
    (the short last bucket included), on torch as on NumPy."""
    from horovod_alq.exchange.numpy_ops import NumpyOps
    from horovod_alq.torch.ops import TorchOps

    x = _x(n, torch.float32, seed=2) if n else torch.zeros(0)
    ops, ref = TorchOps("cpu", "torch"), NumpyOps()
    np.testing.assert_allclose(ops.bucket_norms(x, 64, norm), ref.bucket_norms(x.numpy(), 64, norm), rtol=1e-6)
    ids = np.arange(-(-n // 64))[::2]
    taken = ops.take_buckets(x, ids, 64)
    np.testing.assert_array_equal(taken.numpy(), ref.take_buckets(x.numpy(), ids, 64))
    out, expected = torch.ones(n), np.ones(n, dtype=np.float32)
    ops.add_buckets(out, taken, ids, 64, scale=0.5)
    ref.add_buckets(expected, taken.numpy(), ids, 64, scale=0.5)
    np.testing.assert_array_equal(out.numpy(), expected)


class _Serialized:
    """A codec whose calls run one at a time."""

    def __init__(self, codec) -> None:
        import threading

        self._codec, self._lock = codec, threading.Lock()

    def __getattr__(self, name):
        attr = getattr(self._codec, name)
        if not callable(attr):
            return attr

        def call(*args, **kwargs):
            with self._lock:
                return attr(*args, **kwargs)

        return call


def test_cpu_codec_refuses_cuda_tensors_naming_the_codecs_that_serve_them():
    """A CUDA device for codec 'cpu' raises at once (no allocation, so no GPU needed here),
    naming the codecs that take CUDA tensors."""
    with pytest.raises(ValueError, match="codec 'cpu'") as err:
        codecs.resolve("cpu", torch.device("cuda", 0))
    assert "codec='auto'" in str(err.value) and "'triton'" in str(err.value), err.value
