"""Worker for tests/mpi/test_entropy_faults.py: faults on rank 0 of ``wire="entropy"`` on real ranks
(mpi4py), one scenario per communicator (``Dup``), each after a clean warm-up call. Reports, per
scenario, every rank's outcome: the error (type and message) or a digest of the result, and the
entropy wire's warnings."""

import hashlib
import warnings

import numpy as np
from common import report
from mpi4py import MPI

from horovod_alq.core import entropy
from horovod_alq.mpi import QuantizedAllreduce
from horovod_alq.mpi.transport import MpiTransport

SCENARIOS = [
    ("allgather", "coder-other-bytes"),
    ("allgather", "coder-undecodable"),
    ("allgather", "coder-raises"),
    ("two-phase", "coder-other-bytes"),
    ("two-phase", "coder-raises"),
    ("two-phase", "alltoall-in-flight"),
    ("two-phase", "none"),
]


class Fault:
    """Rank 0's first ``shots`` codings (``entropy.encode_streams``) or alltoall payloads broken."""

    def __init__(self, kind: str, shots: int) -> None:
        self.kind, self.shots = kind, shots
        self.real_encode, self.real_alltoall = entropy.encode_streams, MpiTransport.alltoall

    def encode(self, codes, n, d, bits, freq):
        if self.shots <= 0:
            return self.real_encode(codes, n, d, bits, freq)
        self.shots -= 1
        if self.kind == "coder-raises":
            raise RuntimeError("injected coder fault")
        if self.kind == "coder-other-bytes":  # two different codes swapped: a clean frame of other codes
            codes = np.array(codes, copy=True)
            j = int(np.flatnonzero(codes != codes[0])[0])
            codes[0], codes[j] = codes[j], codes[0]
            return self.real_encode(codes, n, d, bits, freq)
        lengths, streams = self.real_encode(codes, n, d, bits, freq)
        streams = np.array(streams, copy=True)
        streams[0] ^= 0x5A
        return lengths, streams

    def alltoall(self, transport, payload, splits, received, name):
        if self.shots > 0 and not name.endswith(".sizes") and transport.size > 1:
            self.shots -= 1
            payload = np.array(payload, copy=True)
            payload[int(splits[0]) + int(splits[1]) // 2] ^= 0x10  # the middle of the frames for rank 1
        return self.real_alltoall(transport, payload, splits, received, name)

    def __enter__(self):
        if self.kind.startswith("coder"):
            entropy.encode_streams = self.encode
        elif self.kind == "alltoall-in-flight":
            fault = self
            MpiTransport.alltoall = lambda t, *a: fault.alltoall(t, *a)
        return self

    def __exit__(self, *exc):
        entropy.encode_streams, MpiTransport.alltoall = self.real_encode, self.real_alltoall
        return False


def run(exchange: str, fault: str) -> dict:
    comm = MPI.COMM_WORLD.Dup()
    rank = comm.Get_rank()
    ar = QuantizedAllreduce(comm, "alq", bits=3, bucket_size=256, seed=3, exchange=exchange, wire="entropy",
                            timeout=60)  # fmt: skip
    x = np.random.default_rng(rank).standard_t(3, 6000).astype(np.float32)
    ar(x)  # warm-up (refit)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        try:
            with Fault(fault, 1 if rank == 0 and fault != "none" else 0):
                out = ar(x)
            got = {"digest": hashlib.sha1(np.ascontiguousarray(out).tobytes()).hexdigest()}
        except Exception as err:  # noqa: BLE001 - the outcome is the report
            got = {"error": type(err).__name__, "message": str(err)}
    comm.Barrier()  # every rank ends the scenario before the next one starts
    return {**got, "warnings": [str(w.message) for w in seen if "entropy" in str(w.message)]}


report({f"{exchange}|{fault}": run(exchange, fault) for exchange, fault in SCENARIOS})
