"""Worker: Horovod PyTorch allreduce (Sum, Average, int64) and allgather with rank-dependent values.

Reports the results and which controller (MPI or Gloo) Horovod runs on.
"""

import horovod.torch as hvd
import torch
from common import report

hvd.init()
r, n = hvd.rank(), hvd.size()

x = torch.tensor([r + 1.0, 10.0 * (r + 1), -float(r), 0.25], dtype=torch.float32)
xi = torch.tensor([r + 1, 1000 * r, -(2**40)], dtype=torch.int64)
# Rank r contributes r + 1 rows, so the ranks' first dimensions differ.
rows = torch.arange((r + 1) * 3, dtype=torch.float64).reshape(r + 1, 3) + 100.0 * r

gathered = hvd.allgather(rows, name="t.gather")
report(
    {
        "rank": r,
        "size": n,
        "mpi_enabled": hvd.mpi_enabled(),
        "gloo_enabled": hvd.gloo_enabled(),
        "sum": hvd.allreduce(x, op=hvd.Sum, name="t.sum"),
        "average": hvd.allreduce(x, op=hvd.Average, name="t.avg"),
        "int_sum": hvd.allreduce(xi, op=hvd.Sum, name="t.isum"),
        "gather": gathered,
        "gather_dtype": str(gathered.dtype),
    }
)
hvd.shutdown()
