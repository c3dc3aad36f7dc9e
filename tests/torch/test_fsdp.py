"""The FSDP2 reduce-scatter comm in this process (a gloo group of one rank): setting it on a model,
its ops and argument checks, metrics keys. The multi-rank behaviour: test_fsdp_ranks.py."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from horovod_alq.torch import ALQCompressor
from horovod_alq.torch.fsdp import ALQReduceScatter, quantize_reduce_scatter


def test_set_on_every_fsdp_module(group):
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    with pytest.raises(ValueError, match="no module of this Sequential was fully_shard-ed"):
        quantize_reduce_scatter(model, bits=3)
    mesh = init_device_mesh("cpu", (1,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    comm = quantize_reduce_scatter(model, bits=4, bucket_size=64)
    assert isinstance(comm, ALQReduceScatter) and comm.bits == 4
    groups = [g for m in model.modules() for g in m._get_fsdp_state()._fsdp_param_groups]
    assert len(groups) == 2 and all(g._reduce_scatter_comm.comm is comm for g in groups)
    with pytest.raises(TypeError, match="not both"):
        quantize_reduce_scatter(model, comm, bits=3)


@pytest.mark.parametrize(
    "op, factor", [(dist.ReduceOp.AVG, 1.0), (dist.ReduceOp.SUM, 1.0), (dist.ReduceOp.PREMUL_SUM(0.5), 0.5)]
)
def test_one_rank_is_a_quantized_copy(group, op, factor):
    comm = ALQReduceScatter(bits=8, bucket_size=64, seed=1, update_steps=(), update_every=0)
    x = torch.randn(2000)  # at least min_size (1024) elements: quantized
    out = comm.allocate((2000,), dtype=torch.float32, device=torch.device("cpu"))
    assert comm(out, x, group, op) is None
    err = (out - factor * x).norm() / (factor * x).norm()
    assert 0 < err < 0.02, err  # 8 bits: close, not exact
    m = comm.metrics()
    assert m["step"] == 1 and m["calls"] == 1 and m["bytes_sent"] == 0 and m["exchange"] == "reduce-scatter"


def test_checks(group):
    comm = ALQReduceScatter(bucket_size=64, seed=1)
    x = torch.randn(2048)
    with pytest.raises(ValueError, match="not RedOpType.MAX"):
        comm(torch.empty(2048), x, group, dist.ReduceOp.MAX)
    with pytest.raises(ValueError, match="an input of 2048 and an output of 1024"):
        comm(torch.empty(1024), x, group, dist.ReduceOp.AVG)
    with pytest.raises(TypeError, match="torch.int64"):
        comm(torch.empty(2048, dtype=torch.int64), x.long(), group, dist.ReduceOp.SUM)
    pinned = ALQReduceScatter(process_group=dist.new_group([0]), seed=1)
    with pytest.raises(ValueError, match="made for process group"):
        pinned(torch.empty(2048), x, group, dist.ReduceOp.AVG)
    assert comm.metrics()["step"] == 0  # nothing was exchanged
    with pytest.raises(ValueError, match="needs an adaptive method"):
        ALQReduceScatter(method="qsgd", bits="auto")
    with pytest.raises(ValueError, match="bit_budget applies to bits='auto' only"):
        ALQReduceScatter(bits=3, bit_budget=2.5)


def test_auto_bits_gives_every_parameter_its_width(group):
    """bits="auto": quantize_reduce_scatter records each module's layout (FSDP's: shard j holds every
    parameter's j-th dim-0 chunk), so a reduce-scatter of that module's size allocates a width per
    parameter within the budget (called directly: FSDP on one rank does not call its comm); an
    input of another size is one tensor."""
    model = torch.nn.Sequential(torch.nn.Linear(40, 60), torch.nn.Linear(60, 30))
    fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
    comm = quantize_reduce_scatter(
        model, bits="auto", bit_budget=3.0, bucket_size=64, min_size=16, update_steps=(0,), update_every=0, seed=2
    )
    assert comm.bits == "auto" and comm.bit_budget == 3.0
    sizes = [2400, 60, 1800, 30]
    assert [[k for k, _ in v] for v in comm._layouts.values()] == [sizes]
    x = torch.cat([torch.randn(n) * s for n, s in zip(sizes, (30.0, 1.0, 0.01, 1.0))])
    for _ in range(2):
        comm(torch.empty(x.numel()), x, group, dist.ReduceOp.AVG)
    m = comm.metrics()
    assert len(m["allocation"]) == 4 and m["level_updates"] == 1
    assert sum(n * b for n, b in zip(sizes, m["allocation"])) <= 3.0 * sum(sizes)
    assert m["allocation"][0] > m["allocation"][2], m["allocation"]  # 3000x the scale: more bits
    single = ALQReduceScatter(bits="auto", bucket_size=64, min_size=16, update_steps=(0,), update_every=0, seed=2)
    for _ in range(2):
        single(torch.empty(500), torch.randn(500), group, dist.ReduceOp.AVG)  # no recorded layout
    assert len(single.metrics()["allocation"]) == 1


def test_metrics_keys_match_horovod_compressors(group):
    assert set(ALQReduceScatter(seed=0).metrics()) == set(ALQCompressor(seed=0).metrics())
