"""The compiled CPU codec's range API (``first=``, the pipelined round's chunks): a range of a vector
that starts on a bucket boundary encodes to the norms and codes the whole vector's encode gives it,
in every kernel variant, and bad ranges are refused with a clear error."""

import pytest
import torch

from horovod_alq.core import Quantizer
from horovod_alq.core.methods import get_method
from horovod_alq.core.wire import Header, levels_fingerprint, pack_header
from horovod_alq.torch import codecs
from horovod_alq.torch.ops import TorchOps


def _cpu():
    try:
        return codecs.resolve("cpu", "cpu")
    except ValueError as err:  # the compiled CPU codec is not built
        pytest.skip(str(err))


def _header(bits, d, n, levels):
    fp = levels_fingerprint(levels)
    raw = pack_header(Header(get_method("alq").id, bits, d, n, fp, norm="l2"))
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def _split(payload, n, d):
    """A payload's norms and codes (bytes)."""
    nb = -(-n // d)
    return payload[32 : 32 + 4 * nb], payload[32 + 4 * nb :]


@pytest.mark.parametrize("simd", [True, False], ids=["avx2", "generic"])
@pytest.mark.parametrize("bits,d,norm", [(3, 64, "l2"), (2, 8, "linf"), (4, 128, "l2"), (8, 16, "linf"), (5, 24, "l2")])
@pytest.mark.parametrize("scaled", [False, True], ids=["plain", "precondition"])
def test_a_range_encodes_to_the_whole_encodes_norms_and_codes(simd, bits, d, norm, scaled):
    cpu = _cpu()
    cpu._module.set_simd(simd)
    try:
        g = torch.Generator().manual_seed(bits + d)
        n = 37 * d + 5  # a short last bucket
        x = torch.randn(n, generator=g)
        w = torch.rand(n, generator=g) + 0.5 if scaled else None
        q = Quantizer("alq", bits=bits, bucket_size=d, norm=norm, seed=0)
        levels = torch.as_tensor(q.levels)
        args = dict(bits=bits, bucket_size=d, norm=norm, seed=99)
        whole = cpu.encode(x, levels, _header(bits, d, n, q.levels), **args, w=w)
        norms, codes = _split(whole, n, d)
        for b0, b1 in [(0, 5), (5, 6), (6, 37), (37, 38), (3, 38)]:  # in buckets
            a, b = b0 * d, min(n, b1 * d)
            header = _header(bits, d, b - a, q.levels)
            part = cpu.encode(x[a:b], levels, header, **args, w=None if w is None else w[a:b].contiguous(), first=a)
            got_norms, got_codes = _split(part, b - a, d)
            assert torch.equal(got_norms, norms[4 * b0 : 4 * b0 + got_norms.numel()])
            assert torch.equal(got_codes, codes[a * bits // 8 : a * bits // 8 + got_codes.numel()])
            # the same range read in place from parts of the stream
            parts = [x[a : a + (b - a) // 2], x[a + (b - a) // 2 : b]]
            scales = None if w is None else [w[a : a + (b - a) // 2], w[a + (b - a) // 2 : b]]
            in_place = cpu.encode_parts(parts, [0, (b - a) // 2], b - a, levels, header, **args, scales=scales, first=a)
            assert torch.equal(in_place, part)
    finally:
        cpu._module.set_simd(True)


def test_the_range_draws_are_not_the_whole_encodes_without_first():
    """``first`` matters: the same range encoded as a vector of its own draws other codes."""
    cpu = _cpu()
    n, d, bits = 64 * 64, 64, 3
    x = torch.randn(n, generator=torch.Generator().manual_seed(1))
    q = Quantizer("alq", bits=bits, bucket_size=d, norm="l2", seed=0)
    levels, args = torch.as_tensor(q.levels), dict(bits=bits, bucket_size=d, norm="l2", seed=5)
    a = 32 * d
    header = _header(bits, d, n - a, q.levels)
    placed = cpu.encode(x[a:], levels, header, **args, first=a)
    alone = cpu.encode(x[a:], levels, header, **args)
    assert not torch.equal(placed, alone)


@pytest.mark.parametrize("first", [-8, 4, 1.5, True])
def test_bad_first_is_refused_naming_it(first):
    cpu = _cpu()
    q = Quantizer("alq", bits=3, bucket_size=64, norm="l2", seed=0)
    x, levels = torch.randn(128), torch.as_tensor(q.levels)
    header = _header(3, 64, 128, q.levels)
    with pytest.raises(ValueError, match="first must be a non-negative multiple of 8"):
        cpu.encode(x, levels, header, bits=3, bucket_size=64, norm="l2", seed=1, first=first)
    with pytest.raises(ValueError, match="first must be a non-negative multiple of 8"):
        cpu.encode_parts([x], [0], 128, levels, header, bits=3, bucket_size=64, norm="l2", seed=1, first=first)


def test_ops_encode_ranges_only_with_a_codec_that_draws_by_index():
    q = Quantizer("alq", bits=3, bucket_size=64, norm="l2", seed=0)
    x = torch.randn(256)
    plain = TorchOps(torch.device("cpu"), "torch")
    assert not plain.encodes_ranges
    with pytest.raises(ValueError, match="cannot encode a range"):
        plain.encode(x, q, 3, first=64)
    assert plain.encode(x, q, 3, first=0).numel() == q.payload_bytes(256)
    _cpu()
    ops = TorchOps(torch.device("cpu"), "cpu")
    assert ops.encodes_ranges
    whole = ops.encode(x, q, 3)
    part = ops.encode(x[128:], q, 3, first=128)
    assert torch.equal(part[32 + 8 :], whole[32 + 16 + 128 * 3 // 8 :])
