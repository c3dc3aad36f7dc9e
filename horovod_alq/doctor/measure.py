"""What the doctor measures across ranks (link latency and throughput, inside a node and between
nodes) and on this process (the codec's throughput), with mpi4py under mpirun or torch.distributed
(gloo) under torchrun."""

from __future__ import annotations

import os
import socket
import statistics
import time

import numpy as np

from ..exchange.topology import resolve_local_size
from .model import Codec


class Ranks:
    """The launcher's ranks: rank, size, ranks per node (nodes are runs of consecutive ranks) and
    blocking send / receive of NumPy bytes."""

    def __init__(self, how: str, rank: int, size: int, launcher_local: tuple[int, int] | None) -> None:
        self.how, self.rank, self.size = how, rank, size
        self.local_size = resolve_local_size(size, rank, launcher_local)

    def send(self, buf: np.ndarray, dst: int) -> None:
        raise NotImplementedError

    def recv(self, buf: np.ndarray, src: int) -> None:
        raise NotImplementedError

    def barrier(self) -> None:
        raise NotImplementedError

    def gather(self, obj) -> list:
        """Every rank's ``obj`` (picklable), on every rank."""
        raise NotImplementedError


class _MPIRanks(Ranks):
    def __init__(self) -> None:
        from mpi4py import MPI

        self.comm = MPI.COMM_WORLD
        local = os.environ.get("OMPI_COMM_WORLD_LOCAL_SIZE"), os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK")
        launcher = (int(local[0]), int(local[1])) if None not in local else None
        super().__init__("mpi4py", self.comm.Get_rank(), self.comm.Get_size(), launcher)

    def send(self, buf, dst):
        self.comm.Send(buf, dest=dst)

    def recv(self, buf, src):
        self.comm.Recv(buf, source=src)

    def barrier(self):
        self.comm.Barrier()

    def gather(self, obj):
        return self.comm.allgather(obj)


class _GlooRanks(Ranks):
    def __init__(self) -> None:
        import torch.distributed as dist

        # its exit hook waits for gloo's worker threads to go idle before the interpreter finalizes:
        # a worker that frees a finished send's tensors after that aborts the process (SIGABRT)
        import horovod_alq.torch.dist_transport  # noqa: F401

        if not dist.is_initialized():
            dist.init_process_group("gloo")
        self.dist = dist
        local = os.environ.get("LOCAL_WORLD_SIZE"), os.environ.get("LOCAL_RANK")
        launcher = (int(local[0]), int(local[1])) if None not in local else None
        super().__init__("torch.distributed (gloo)", dist.get_rank(), dist.get_world_size(), launcher)

    def send(self, buf, dst):
        import torch

        self.dist.send(torch.from_numpy(buf), dst)

    def recv(self, buf, src):
        import torch

        self.dist.recv(torch.from_numpy(buf), src)

    def barrier(self):
        self.dist.barrier()

    def gather(self, obj):
        out = [None] * self.size
        self.dist.all_gather_object(out, obj)
        return out


def connect() -> Ranks | None:
    """The ranks this process was launched among: mpi4py under mpirun, torch.distributed under
    torchrun; None for a single process (no launcher, or a launcher of one rank)."""
    if int(os.environ.get("OMPI_COMM_WORLD_SIZE", os.environ.get("PMI_SIZE", "1"))) > 1:
        try:
            return _MPIRanks()
        except ImportError:
            pass  # mpirun without mpi4py: torch.distributed below needs MASTER_ADDR
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and "MASTER_ADDR" in os.environ:
        return _GlooRanks()
    if int(os.environ.get("OMPI_COMM_WORLD_SIZE", "1")) > 1:
        raise RuntimeError("launched by mpirun, but mpi4py is not installed: pip install mpi4py, or use torchrun")
    return None


def pingpong(ranks: Ranks, a: int, b: int, nbytes: int, repeats: int) -> float | None:
    """Seconds one way for ``nbytes`` between ranks ``a`` and ``b`` (median over ``repeats`` round
    trips, halved); None on the other ranks. Every rank must call it (the others wait at the end)."""
    buf = np.zeros(max(nbytes, 1), np.uint8)
    times = []
    for i in range(repeats + 1):  # the first round trip warms up
        if ranks.rank == a:
            start = time.perf_counter()
            ranks.send(buf, b)
            ranks.recv(buf, b)
            if i:
                times.append((time.perf_counter() - start) / 2)
        elif ranks.rank == b:
            ranks.recv(buf, a)
            ranks.send(buf, a)
    ranks.barrier()
    return statistics.median(times) if times else None


def links(ranks: Ranks, nbytes: int = 1 << 23, repeats: int = 5) -> dict:
    """Latency (8 bytes) and throughput (``nbytes``) between rank 0 and its neighbour inside its
    node, and between rank 0 and the first rank of the next node; on rank 0 (None elsewhere).
    The pairs: ``{"inside": ..., "between": ...}``, each ``{"pair", "latency_s", "bytes_per_s"}``."""
    g, n = ranks.local_size, ranks.size
    pairs = {}
    if g > 1:
        pairs["inside"] = (0, 1)
    if n > g:
        pairs["between"] = (0, g)
    out = {}
    for name, (a, b) in pairs.items():
        lat = pingpong(ranks, a, b, 8, 50)
        one_way = pingpong(ranks, a, b, nbytes, repeats)
        if ranks.rank == 0:
            out[name] = {"pair": [a, b], "latency_s": lat, "bytes_per_s": nbytes / one_way}
    hosts = ranks.gather(socket.gethostname())
    return {"ranks": n, "ranks_per_node": g, "hosts": sorted(set(hosts)), **out} if ranks.rank == 0 else None


def codec_speed(device: str = "cpu", n: int = 1 << 22, repeats: int = 5) -> tuple[Codec, str]:
    """Seconds per coordinate of ``codec="auto"``'s encode at 3 and 4 bits and of its decode-and-sum
    (3 bits) on ``device`` (one thread on the CPU, as one rank's share), and the codec's name."""
    import torch

    from ..core import Quantizer
    from ..torch.ops import TorchOps

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ops = TorchOps(torch.device(device))
        x = torch.from_numpy(np.random.default_rng(0).standard_t(3.0, n).astype(np.float32)).to(device)
        out = torch.empty_like(x)
        per = {}
        for bits in (3, 4):
            q = Quantizer("alq", bits=bits, bucket_size=8192, seed=0)
            enc, dec = [], []
            for r in range(repeats + 1):
                start = time.perf_counter()
                payload = ops.encode(x, q, seed=r)
                _sync(device)
                mid = time.perf_counter()
                ops.decode_sum(out, payload, [0], q)
                _sync(device)
                if r:
                    enc.append(mid - start)
                    dec.append(time.perf_counter() - mid)
            per[bits] = (statistics.median(enc) / n, statistics.median(dec) / n)
        return Codec(per[3][0], per[4][0], per[3][1]), ops.codec.name
    finally:
        torch.set_num_threads(threads)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize(device)
