"""Worker for tests/mpi/test_precondition_mpi.py: QuantizedAllreduce with ``scales=`` on every
rank, reported as one dict per rank. Only mpi4py, NumPy and the core."""

import numpy as np
from common import report
from helpers import digest, rank_data, t_stat
from mpi4py import MPI

from horovod_alq.mpi import QuantizedAllreduce


def scales(n: int) -> np.ndarray:
    """The same scale on every rank: four decades, a fixed draw."""
    return (10.0 ** np.random.default_rng(5).uniform(-2, 2, n)).astype(np.float32)


def attempt(fn) -> dict:
    try:
        fn()
    except Exception as err:  # noqa: BLE001
        return {"raised": True, "type": type(err).__name__, "message": str(err)}
    return {"raised": False}


def main() -> None:
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    n, reps = 2048, 300
    x = rank_data(rank, n, seed=11)
    w = scales(n)
    exact = np.mean([rank_data(r, n, seed=11) for r in range(size)], axis=0)
    ar = QuantizedAllreduce(comm, method="alq", bits=3, bucket_size=256, seed=3, timeout=60)
    outs = [ar(x, scales=w) for _ in range(reps)]
    dev = np.stack(outs) - exact
    # t statistics of sums over 64 coordinates (a coordinate alone may never take its rare level)
    t = t_stat(dev.reshape(reps, 32, -1).sum(2))
    listed = ar([x, x[:1000]], scales=[w, w[:1000]])
    out = {
        "rank": rank,
        "reps": reps,
        "t_max": float(np.abs(t).max()),
        "first": digest(outs[0]),
        "listed": digest(*listed),
        "digest": int(ar._state.precondition),
    }
    other = w * (2.0 if rank == size - 1 else 1.0)
    out["differ"] = attempt(lambda: ar(x, scales=other))
    out["one_rank"] = attempt(lambda: ar(x, scales=w if rank == 0 else None))
    bad = w.copy()
    if rank == size - 1:
        bad[7] = np.nan
    out["nan"] = attempt(lambda: ar(x, scales=bad))
    out["shape"] = attempt(lambda: ar(x, scales=w[:10] if rank == 0 else w))
    out["after"] = digest(ar(x, scales=w))  # the communicator still works after the refusals
    report(out)


if __name__ == "__main__":
    main()
