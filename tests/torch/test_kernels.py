"""Torch kernels against the NumPy reference codec: one wire format, both directions."""

import numpy as np
import pytest
import torch

from horovod_alq.core import Quantizer
from horovod_alq.core.wire import Header, pack_header
from horovod_alq.torch.codecs import cpu_build
from horovod_alq.torch.codecs import torch_kernels as kernels

METHODS = ["qsgdinf", "qsgd", "nuqsgd", "terngrad", "alq", "alq-n", "amq", "amq-n"]


def _torch_encode(q: Quantizer, x: torch.Tensor, use_fused: bool, seed: int = 1) -> torch.Tensor:
    header = torch.frombuffer(
        bytearray(pack_header(Header(_method_id(q), q.bits, q.bucket_size, x.numel(), q.fingerprint, norm=q.norm))),
        dtype=torch.uint8,
    )
    levels = torch.as_tensor(q.levels)
    norm = q.norm
    if use_fused:
        module = cpu_build.load()
        if module is None:
            pytest.skip(f"fused codec unavailable: {cpu_build.status()}")
        return module.encode(x.reshape(-1).contiguous(), levels, header, q.bits, q.bucket_size, norm == "linf", seed)
    gen = torch.Generator().manual_seed(seed)
    return kernels.encode(x, levels, header, bits=q.bits, bucket_size=q.bucket_size, norm=norm, generator=gen)


def _method_id(q):
    from horovod_alq.core.methods import get_method

    return get_method(q.method).id


def _torch_decode(q: Quantizer, payloads: list, n: int, use_fused: bool, scale: float = 1.0) -> torch.Tensor:
    levels = torch.as_tensor(q.levels)
    buf = torch.cat([torch.as_tensor(p) for p in payloads])
    offsets = np.cumsum([0] + [len(p) for p in payloads[:-1]]).tolist()
    out = torch.zeros(n, dtype=torch.float32)
    if use_fused:
        module = cpu_build.load()
        if module is None:
            pytest.skip(f"fused codec unavailable: {cpu_build.status()}")
        return module.decode_sum(out, buf, offsets, levels, q.bits, q.bucket_size, scale)
    for off in offsets:
        kernels.decode_into(out, buf[off:], levels, bits=q.bits, bucket_size=q.bucket_size)
    return out.mul_(scale)


@pytest.mark.parametrize("use_fused", [False, True], ids=["torch", "fused"])
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("n,bucket", [(1000, 64), (12345, 1000), (7, 8192)])
def test_torch_payload_decodes_with_numpy_core(method, n, bucket, use_fused):
    q = Quantizer(method, bucket_size=bucket, seed=0)
    x = torch.randn(n, generator=torch.Generator().manual_seed(n))
    payload = _torch_encode(q, x, use_fused).numpy()
    assert payload.size == 32 + 4 * -(-n // bucket) + -(-n * q.bits // 8)
    decoded = q.decode(payload)
    # every value is norm * level of its bucket, one of the two levels around x / norm
    norms = np.repeat(payload[32 : 32 + 4 * -(-n // bucket)].view("<f4"), bucket)[:n]
    candidates = norms[:, None] * q.levels.astype(np.float32)[None, :]
    assert (decoded[:, None] == candidates).any(axis=1).all()
    r = x.double().numpy() / norms
    cell = np.clip(np.searchsorted(q.levels, r, side="right") - 1, 0, q.levels.size - 2)
    tol = 1e-5 * norms
    assert (decoded >= norms * q.levels[cell] - tol).all()
    assert (decoded <= norms * q.levels[cell + 1] + tol).all()


@pytest.mark.parametrize("use_fused", [False, True], ids=["torch", "fused"])
@pytest.mark.parametrize("method", ["alq", "qsgdinf", "terngrad"])
def test_numpy_payloads_decode_and_sum_with_torch(method, use_fused):
    q = Quantizer(method, bucket_size=100, seed=3)
    xs = [np.random.default_rng(i).standard_normal(1003).astype(np.float32) for i in range(3)]
    payloads = [q.encode(x) for x in xs]
    expected = sum(q.decode(p).astype(np.float64) for p in payloads) / 3
    got = _torch_decode(q, payloads, 1003, use_fused, scale=1 / 3).numpy()
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("use_fused", [False, True], ids=["torch", "fused"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_unbiased_for_every_dtype(dtype, use_fused):
    """Mean of M decodes approaches x: per-coordinate z-scores from the sample size."""
    q = Quantizer("nuqsgd", bucket_size=256, seed=0)
    x = torch.randn(512, generator=torch.Generator().manual_seed(5)).to(dtype)
    m = 400
    dec = np.stack([q.decode(_torch_encode(q, x, use_fused, seed=s).numpy()) for s in range(m)]).astype(np.float64)
    mean, se = dec.mean(0), dec.std(0, ddof=1) / np.sqrt(m)
    target = x.double().numpy()
    z = (mean - target)[se > 0] / se[se > 0]
    # 512 coordinates: |z| > 5 has probability ~3e-7 each under unbiasedness
    assert np.abs(z).max() < 5.0
    assert abs(z.mean()) * np.sqrt(z.size) < 5.0


# The fused encoder has a vectorized path (blocks of 64 coordinates inside one bucket, bits <= 4)
# and a coordinate-by-coordinate one (bucket edges inside a block, tails, bits > 4): cover both,
# with a zero bucket, at every bit width's extremes.
FUSED_PATHS = [
    ("qsgdinf", 2, 256, 1000),
    ("alq", 3, 100, 1000),
    ("amq", 4, 1024, 3000),
    ("qsgd", 5, 64, 700),
    ("nuqsgd", 6, 1000, 2100),
    ("qsgdinf", 8, 40, 333),
]


@pytest.mark.parametrize("simd", [True, False], ids=["avx2", "generic"])
@pytest.mark.parametrize("method,bits,bucket,n", FUSED_PATHS)
def test_fused_unbiased_on_every_path(method, bits, bucket, n, simd):
    """The mean of M fused encodes is within a Bernstein bound of x, per coordinate, with the exact
    variance of each coordinate (its norm and the two levels around it are known); with the AVX2
    kernels (where the CPU has them) and the generic ones."""
    module = cpu_build.load()
    if module is None:
        pytest.skip(f"fused codec unavailable: {cpu_build.status()}")
    module.set_simd(simd)
    try:
        _check_unbiased(Quantizer(method, bits=bits, bucket_size=bucket, seed=0), n, use_fused=True)
    finally:
        module.set_simd(True)


# Adaptive methods with either bucket norm, both torch backends, the fused paths of FUSED_PATHS.
NORM_CASES = [
    ("alq", "linf", 2, 256, 1000),
    ("alq", "linf", 3, 100, 1000),
    ("amq", "linf", 4, 1024, 3000),
    ("alq-n", "linf", 3, 64, 700),
    ("amq-n", "linf", 6, 1000, 2100),
    ("alq", "l2", 3, 100, 1000),
    ("amq", "l2", 2, 256, 1000),
]


@pytest.mark.parametrize("use_fused", [False, True], ids=["torch", "fused"])
@pytest.mark.parametrize("method,norm,bits,bucket,n", NORM_CASES)
def test_unbiased_with_either_norm(method, norm, bits, bucket, n, use_fused):
    q = Quantizer(method, bits=bits, bucket_size=bucket, seed=0, norm=norm)
    payload = _torch_encode(q, torch.randn(n), use_fused).numpy()
    assert payload[5] == {"l2": 0, "linf": 1}[norm]
    other = Quantizer(method, bits=bits, bucket_size=bucket, seed=0, norm={"l2": "linf", "linf": "l2"}[norm])
    with pytest.raises(ValueError, match=f"payload made with norm={norm}, this quantizer uses norm={other.norm}"):
        other.decode(payload)
    _check_unbiased(q, n, use_fused=use_fused)


def _check_unbiased(q: Quantizer, n: int, use_fused: bool) -> None:
    bits, bucket = q.bits, q.bucket_size
    x = torch.randn(n, generator=torch.Generator().manual_seed(bits))
    x[:bucket] = 0.0  # a dead (zero-norm) bucket: exact zeros
    m = 300
    payloads = [_torch_encode(q, x, use_fused, seed=s).numpy() for s in range(m)]
    mean = np.stack([q.decode(p) for p in payloads]).astype(np.float64).mean(0)
    nb = -(-n // bucket)
    norms = np.repeat(payloads[0][32 : 32 + 4 * nb].view("<f4").astype(np.float64), bucket)[:n]
    levels = q.levels.astype(np.float32).astype(np.float64)  # the values the decoder multiplies
    target = x.double().numpy()
    r = np.clip(np.divide(target, norms, out=np.zeros(n), where=norms > 0), -1, 1)
    cell = np.clip(np.searchsorted(levels, r, side="right") - 1, 0, levels.size - 2)
    lo, hi = levels[cell], levels[cell + 1]
    var = norms**2 * np.clip((hi - r) * (r - lo), 0, None)  # of one draw
    c = norms * (hi - lo) / m  # largest single deviation of the mean
    log_term = np.log(2 / 1e-9)  # 1e-9 per coordinate, ~3e-6 for 3,000 coordinates
    bound = c * log_term / 3 + np.sqrt((c * log_term / 3) ** 2 + 2 * var / m * log_term)
    bound += 1e-6 * (np.abs(target) + norms)  # float32 arithmetic of the encoder
    assert (np.abs(mean - target) <= bound).all()
    assert (mean[:bucket] == 0).all()
    assert abs((mean - target).sum()) <= 5 * np.sqrt(var.sum() / m) + 1e-6 * np.abs(target).sum()


def test_fused_encode_does_not_depend_on_thread_count():
    q = Quantizer("alq", bits=3, bucket_size=1000, seed=0)
    x = torch.randn(300_001, generator=torch.Generator().manual_seed(0))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _torch_encode(q, x, True, seed=9)
        torch.set_num_threads(2)
        two = _torch_encode(q, x, True, seed=9)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)
    assert not torch.equal(one, _torch_encode(q, x, True, seed=10))


@pytest.mark.parametrize("use_fused", [False, True], ids=["torch", "fused"])
def test_non_finite_bucket_only(use_fused):
    q = Quantizer("alq", bucket_size=10, seed=0)
    x = torch.randn(40)
    x[15] = float("nan")
    x[33] = float("inf")
    x[0:10] = 0.0
    dec = q.decode(_torch_encode(q, x, use_fused).numpy())
    assert np.isnan(dec[10:20]).all() and np.isnan(dec[30:40]).all()
    assert (dec[0:10] == 0).all() and np.isfinite(dec[20:30]).all()


def test_fused_and_torch_norms_agree():
    q = Quantizer("alq", bucket_size=4096, seed=0)
    x = torch.randn(3 * 4096 + 5)
    a = _torch_encode(q, x, True).numpy()[32 : 32 + 16].view("<f4")
    b = _torch_encode(q, x, False).numpy()[32 : 32 + 16].view("<f4")
    np.testing.assert_allclose(a, b, rtol=1e-6)


def test_corrupted_codes_decode_to_nan_not_garbage():
    q = Quantizer("terngrad", bucket_size=8, seed=0)
    payload = q.encode(np.ones(8, dtype=np.float32))
    payload[-2:] = 0xFF  # code 3 does not exist for TernGrad's 3 levels
    for use_fused in (False, True):
        out = _torch_decode(q, [payload], 8, use_fused).numpy()
        assert np.isnan(out).all()


@pytest.mark.parametrize("norm", ["l2", "linf"])
@pytest.mark.parametrize("method", ["alq", "alq-n", "amq", "amq-n"])
def test_statistics_match_the_numpy_core(method, norm):
    from horovod_alq.core.methods import get_method
    from horovod_alq.core.statistics import GRID, BucketMoments, normless_statistics

    q = Quantizer(method, bucket_size=300, seed=0, norm=norm)
    torch.manual_seed(0)
    x = torch.distributions.StudentT(3.0).sample((5 * 300 + 17,))
    x[300:600] = 0.0
    x[700] = float("nan")
    if get_method(method).normless:
        got = normless_statistics(BucketMoments(*kernels.bucket_moments(x, bucket_size=300, norm=norm)))
    else:
        got = kernels.grid_statistics(x, torch.tensor(GRID), bucket_size=300, norm=norm)
    # agree to float32 rounding (torch reduces in float32, the core in float64); sum r cancels,
    # so its error is relative to sum |r| (~100 here), not to its value: atol 1e-5
    np.testing.assert_allclose(got, q.statistics(x.numpy()), rtol=1e-6, atol=1e-5)
