"""Preconditioned quantization's fused path through Horovod's fused rounds (Engine.add(scale=w)),
with ranks as threads: the round quantizes g * w formed inside the compiled codec's encode and
divides its decode by w, and every rank gets the floats of the unfused path (add g * w, divide
the output by w), bit for bit, in ordered rounds, early starts, rounds whose ranks ordered their
tensors differently, and an exchange that quantizes sums (the job builds the products then)."""

import numpy as np
import pytest

from horovod_alq.settings import Settings, configure
from horovod_alq.testing import Hub

torch = pytest.importorskip("torch")

SIZES = (300, 200, 70, 130)


@pytest.fixture(scope="module")
def ops_class():
    from horovod_alq.torch.ops import TorchOps

    class Counting(TorchOps):
        """TorchOps counting the encodes that formed x * w in the codec."""

        fused = 0

        def encode_parts(self, *args, scales=None, **kwargs):
            out = super().encode_parts(*args, scales=scales, **kwargs)
            type(self).fused += scales is not None and out is not None
            return out

    try:
        ops = Counting(torch.device("cpu"), "cpu")
    except ValueError as err:  # compiled CPU codec not built
        pytest.skip(str(err))
    assert ops.fuses_scales
    return Counting


def _round(engines, tensors, scales, ops, hub, tag, fused, early, swap):
    def rank(r, t):
        order = list(range(len(tensors[r])))[:: -1 if r == swap else 1]
        entries = []
        for k in order:
            x, w = tensors[r][k], scales[k]
            extra = {"ops": ops} if early else {}
            if fused:
                entry = engines[r].add(x, x.numel(), tuple(x.shape), "float32", t, ident=k, scale=w, **extra)
            else:
                entry = engines[r].add(x * w, x.numel(), tuple(x.shape), "float32", t, ident=k, **extra)
            entries.append((k, entry))
        for k, (_, v) in entries:  # every control vector leaves before any is waited for (Horovod's async ops)
            hub.put(f"{tag}.c{k}", r, v)
        outs = {}
        for k, (e, _) in entries:
            out = engines[r].finish(e, np.sum(hub.get(f"{tag}.c{k}"), axis=0), ops, t)[0]
            outs[k] = out if fused else out / scales[k]
        return [outs[k] for k in range(len(tensors[r]))]

    return hub.outcomes(rank)


def _run(ops, exchange, ranks, fused, early=False, swap=None, g=None):
    settings = [
        configure(Settings("alq", 3, 64, seed=1, exchange=exchange, update_steps=(0,), update_every=0))
        for _ in range(ranks)
    ]
    engines = [s.engine(uid="t") for s in settings]
    hub = Hub(ranks, timeout=20.0, local_size=g)
    gen = torch.Generator().manual_seed(0)
    scales = [10.0 ** (torch.rand(n, generator=gen) * 4 - 2) for n in SIZES]
    outs = []
    for step in range(3):  # round 0 refits, then the new levels
        tensors = [[torch.randn(n, generator=gen) for n in SIZES] for _ in range(ranks)]
        got = _round(engines, tensors, scales, ops, hub, f"r{step}", fused, early, swap)
        for out in got:
            assert not isinstance(out, BaseException), out
        outs.append(got)
    return outs


@pytest.mark.parametrize(
    "exchange, ranks, g, early, swap",
    [
        ("allgather", 2, None, False, None),
        ("two-phase", 3, None, False, None),
        ("two-phase", 2, None, True, None),  # buffers started early
        ("allgather", 2, None, False, 1),  # rank 1 adds its tensors in reverse order
        ("hierarchical", 4, 2, False, None),  # sums in the node first: the job builds the products
    ],
)
def test_fused_rounds_are_the_unfused_ones(ops_class, exchange, ranks, g, early, swap):
    ops = ops_class(torch.device("cpu"), "cpu")
    ops_class.fused = 0
    fused = _run(ops, exchange, ranks, True, early, swap, g)
    assert (ops_class.fused > 0) == (exchange != "hierarchical"), ops_class.fused
    ops_class.fused = 0
    unfused = _run(ops, exchange, ranks, False, early, swap, g)
    assert ops_class.fused == 0
    for step, (a, b) in enumerate(zip(fused, unfused)):
        for r, (xa, xb) in enumerate(zip(a, b)):
            for k, (ta, tb) in enumerate(zip(xa, xb)):
                assert torch.equal(ta, tb), (step, r, k)
                assert torch.equal(ta, a[0][k]), (step, r, k)  # the same on every rank
