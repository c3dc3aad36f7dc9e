"""Worker for tests/torch/test_dropin.py: the pattern of Horovod v0.28.1's
examples/pytorch/pytorch_synthetic_benchmark.py with its one compression line,
``compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none``, swapped for
``ALQCompressor(...)``; everything else as there (DistributedOptimizer with ``named_parameters``
and ``op=``, broadcast of parameters and optimizer state, ``timeit`` of the step). A small MLP on
fixed synthetic data in place of torchvision's ResNet-50.

Usage: python dropin_torch_benchmark.py [--steps N] [--fp16]
"""

import argparse
import hashlib
import timeit

import horovod.torch as hvd
import torch
import torch.nn.functional as F
import torch.optim as optim
from common import report

from horovod_alq.torch import ALQCompressor

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=12)
p.add_argument("--fp16", action="store_true", help="the example's own hvd.Compression.fp16")
args = p.parse_args()

hvd.init()
torch.manual_seed(hvd.rank())  # different starts: the broadcast must align them
model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
optimizer = optim.SGD(model.parameters(), lr=0.01 * hvd.size())

# Horovod: (optional) compression algorithm.  <- the example's line, swapped
compression = hvd.Compression.fp16 if args.fp16 else ALQCompressor(bits=3, bucket_size=512)

optimizer = hvd.DistributedOptimizer(
    optimizer, named_parameters=model.named_parameters(), compression=compression, op=hvd.Average
)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(optimizer, root_rank=0)

gen = torch.Generator().manual_seed(100 + hvd.rank())
data = torch.randn(32, 64, generator=gen)
target = torch.randint(0, 10, (32,), generator=gen)
losses = []


def benchmark_step():
    optimizer.zero_grad()
    loss = F.cross_entropy(model(data), target)
    loss.backward()
    optimizer.step()
    losses.append(float(loss))


seconds = timeit.timeit(benchmark_step, number=args.steps)
weights = b"".join(t.detach().numpy().tobytes() for t in model.state_dict().values())
out = dict(losses=losses, seconds=seconds, digest=hashlib.sha256(weights).hexdigest())
if not args.fp16:
    m = compression.metrics()
    out.update(steps=m["step"], level_updates=m["level_updates"], bits_per_coordinate=m["bits_per_coordinate"])
report(out)
