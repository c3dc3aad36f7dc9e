"""The compiled CPU codec's preconditioned kernels (precondition=, issue 69): encode of x * w
without the product in memory, decode_sum divided by w in the same pass. Bit for bit the unfused
path (multiply, encode, decode, divide), with and without AVX2, and unbiased."""

import numpy as np
import pytest
import torch
from helpers import assert_zero_mean

from horovod_alq.core import Quantizer
from horovod_alq.core.methods import get_method
from horovod_alq.core.wire import Header, levels_fingerprint, pack_header
from horovod_alq.torch import codecs


@pytest.fixture(params=[True, False], ids=["avx2", "generic"])
def cpu(request):
    try:
        codec = codecs.resolve("cpu", "cpu")
    except ValueError as err:  # compiled CPU codec not built
        pytest.skip(str(err))
    if request.param and codec._module.simd() != "avx2":
        pytest.skip("this CPU has no AVX2")
    codec._module.set_simd(request.param)
    try:
        yield codec
    finally:
        codec._module.set_simd(True)


def _coding(q: Quantizer, n: int, seed: int) -> tuple[tuple, dict]:
    m = get_method(q.method)
    header = pack_header(Header(m.id, q.bits, q.bucket_size, n, levels_fingerprint(q.levels)))
    args = (torch.as_tensor(q.levels), torch.frombuffer(bytearray(header), dtype=torch.uint8))
    return args, dict(bits=q.bits, bucket_size=q.bucket_size, norm=q.norm, seed=seed)


def _inputs(n: int, d: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A gradient with a zero bucket, a tiny one and a NaN, and scales over four decades."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.rand(n, generator=g)
    x[:d] = 0
    if n > 3 * d:
        x[d : 2 * d] *= 1e-30
        x[2 * d + 3] = float("nan")
    return x, 10.0 ** (torch.rand(n, generator=g) * 4 - 2)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same floats, NaN where the other has NaN."""
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0))


@pytest.mark.parametrize(
    "method,bits,d,n,dtype",
    [
        ("alq", 3, 8192, 20_011, torch.float32),
        ("alq", 2, 64, 1000, torch.float32),
        ("amq", 4, 96, 3001, torch.float16),
        ("alq", 3, 128, 2000, torch.bfloat16),
        ("qsgdinf", 6, 256, 1500, torch.float64),
        ("alq", 3, 100, 777, torch.float32),  # buckets not a multiple of 8: the product made whole first
    ],
)
def test_fused_encode_and_decode_are_the_unfused_ones(cpu, method, bits, d, n, dtype):
    """encode(x, w=w) gives the bytes of encode(x * w) (torch's product: float32, float64 for
    float64 x); decode_sum(divide=w) the floats of decode_sum(...) / w, windows included."""
    q = Quantizer(method, bits=bits, bucket_size=d, seed=0)
    x, w = _inputs(n, d, bits)
    x = x.to(dtype)
    args, kw = _coding(q, n, 5)
    fused = cpu.encode(x, *args, **kw, w=w)
    assert torch.equal(fused, cpu.encode((x * w).contiguous(), *args, **kw))
    assert not torch.equal(fused, cpu.encode(x, *args, **kw))
    payloads = torch.cat([fused, cpu.encode(x, *args, **{**kw, "seed": 6}, w=w)])
    lv = torch.as_tensor(q.levels)
    for start in (0, d * 8) if d % 8 == 0 and n > 9 * d else (0,):
        m = n - start
        want, got = torch.empty(m), torch.full((m,), 7.0)
        offsets = [0, fused.numel()]
        cpu.decode_sum(want, payloads, offsets, lv, bits=bits, bucket_size=d, scale=0.5, start=start, numel=n)
        cpu.decode_sum(
            got, payloads, offsets, lv, bits=bits, bucket_size=d, scale=0.5, start=start, numel=n, divide=w[start:]
        )
        assert _same(got, want / w[start:]), start
        assert bool(torch.isnan(got).any()) == (start == 0 and n > 3 * d)  # the NaN bucket's


@pytest.mark.parametrize("bits,d,norm", [(3, 64, "linf"), (2, 8, "l2"), (4, 128, "linf")])
def test_fused_encode_parts_is_the_encode_of_the_scaled_stream(cpu, bits, d, norm):
    """Parts read in place with their scales: the payload of the stream of the products (parts that
    fill buckets, end inside one, share one, leave gaps)."""
    g = torch.Generator().manual_seed(bits)
    sizes, gaps = [3 * d, d // 2 + 1, 5, 2 * d + 3, 1, d], [0, d - 1, 0, 7, d, 2]
    parts, scales, starts, pos = [], [], [], 0
    for size, gap in zip(sizes, gaps):
        pos += gap
        parts.append(torch.randn(size, generator=g))
        scales.append(torch.rand(size, generator=g) * 10 + 0.1)
        starts.append(pos)
        pos += size
    length = pos + 3
    stream = torch.zeros(length)
    for part, w, start in zip(parts, scales, starts):
        stream[start : start + part.numel()] = part * w
    q = Quantizer("alq", bits=bits, bucket_size=d, norm=norm, seed=0)
    args, kw = _coding(q, length, 11)
    want = cpu.encode(stream, *args, **kw)
    assert torch.equal(cpu.encode_parts(parts, starts, length, *args, **kw, scales=scales), want)
    with pytest.raises(ValueError, match="2 scales for 6 parts"):
        cpu.encode_parts(parts, starts, length, *args, **kw, scales=scales[:2])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_feedback_is_the_feedback_of_the_product(cpu, dtype):
    """encode_feedback(x, err, w=w): the bytes and the error buffer of encode_feedback(x * w, err),
    over rounds: the error is kept in the scaled space."""
    q = Quantizer("alq", bits=3, bucket_size=64, seed=0)
    x, w = _inputs(1000, 64, 3)
    errors = [torch.zeros(1000, dtype=dtype), torch.zeros(1000, dtype=dtype)]
    for seed in range(3):
        args, kw = _coding(q, 1000, seed)
        unfused = cpu.encode_feedback((x * w).contiguous(), errors[0], *args, **kw)
        fused = cpu.encode_feedback(x, errors[1], *args, **kw, w=w)
        assert torch.equal(fused, unfused) and torch.equal(errors[1], errors[0]), seed
    assert errors[1].abs().sum() > 0


def test_fused_round_is_unbiased(cpu):
    """E[decode_sum(encode(g, w=w), divide=w)] = g: 400 roundings of a heavy-tailed gradient whose
    scales span four decades, the deviations of 32 sums of coordinates tested by t statistics."""
    q = Quantizer("alq", bits=3, bucket_size=256, seed=0)
    g = torch.from_numpy((np.random.default_rng(0).standard_t(3, 1024) * 1e-3).astype(np.float32))
    w = 10.0 ** (torch.rand(1024, generator=torch.Generator().manual_seed(1)) * 4 - 2)
    q.adapt(q.statistics((g * w).numpy()))
    lv, out, reps = torch.as_tensor(q.levels), torch.empty(1024), 400
    dev = np.empty((reps, 1024))
    for r in range(reps):
        args, kw = _coding(q, 1024, r)
        cpu.decode_sum(out, cpu.encode(g, *args, **kw, w=w), [0], lv, bits=3, bucket_size=256, scale=1.0, divide=w)
        dev[r] = (out - g).numpy()
    assert_zero_mean(dev.reshape(reps, 32, -1).sum(2))
    assert_zero_mean(dev.sum(1, keepdims=True))


def test_bad_scales_are_refused(cpu):
    q = Quantizer("alq", bits=3, bucket_size=64, seed=0)
    args, kw = _coding(q, 100, 1)
    x = torch.randn(100)
    with pytest.raises(ValueError, match="encode: a preconditioning scale must be float32 .* 100 values"):
        cpu.encode(x, *args, **kw, w=torch.ones(99))
    with pytest.raises(ValueError, match="float32"):
        cpu.encode(x, *args, **kw, w=torch.ones(100, dtype=torch.float64))
    with pytest.raises(ValueError, match="decode_sum"):
        payload = cpu.encode(x, *args, **kw)
        cpu.decode_sum(torch.empty(100), payload, [0], args[0], bits=3, bucket_size=64, scale=1.0, divide=torch.ones(3))


@pytest.mark.parametrize("codec", ["cpu", "torch"])
def test_ops_scale_with_every_codec(codec):
    """TorchOps: the compiled codec fuses (encode_parts reads parts * w, decode_sum divides); other
    codecs decline encode_parts with scales (the job then builds the products) and divide after
    their decode: the same floats either way."""
    from horovod_alq.torch.ops import TorchOps

    try:
        ops = TorchOps(torch.device("cpu"), codec)
    except ValueError as err:  # compiled CPU codec not built
        pytest.skip(str(err))
    assert ops.fuses_scales == (codec == "cpu")
    q = Quantizer("alq", bits=3, bucket_size=64, seed=0)
    g = torch.Generator().manual_seed(4)
    x, w = torch.randn(1000, generator=g), torch.rand(1000, generator=g) + 0.1
    payload = ops.encode(x * w, q, 3)
    fused = ops.encode_parts([x], [0], 1000, q, 3, scales=[w])
    assert (fused is None) == (codec != "cpu")
    assert fused is None or torch.equal(fused, payload)
    want, got = ops.empty(1000), ops.empty(1000)
    ops.decode_sum(want, payload, [0], q, scale=0.5)
    ops.decode_sum(got, payload, [0], q, scale=0.5, divide=w)
    assert torch.equal(got, want / w)
