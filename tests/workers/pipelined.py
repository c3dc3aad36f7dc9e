"""Worker for tests/torch/test_pipeline_ranks.py: the Horovod PyTorch compressor's rounds of a few
tensors in one fusion buffer, unpipelined (HOROVOD_ALQ_PIPELINE_BYTES=0) and pipelined (--chunk
bytes), in turn in one launch, on the exchange that "auto" picks (allgather on one node,
hierarchical with HOROVOD_ALQ_LOCAL_SIZE=2 on 4 ranks) and on the --wire given. Reports a digest
of each one's results, its own collectives and its byte counters per round, the exchange, and
what every rank gets when the last rank alone cuts its buffers into other chunks; with
--fault-chunk, also what every rank gets when rank 0's coder breaks its frame of that chunk."""

import argparse
import os

import horovod.torch as hvd
import numpy as np
import torch
from common import report
from helpers import digest, rank_data

from horovod_alq.core import entropy
from horovod_alq.torch import ALQCompressor

COUNTERS = ("collectives", "bytes_sent", "bytes_received", "wire_fixed_bytes", "wire_coded_bytes")


def rounds(comp, xs, tag: str, count: int) -> tuple[str, dict]:
    """``count`` rounds (the first refits): a digest of every output, and each of :data:`COUNTERS`
    per later round."""
    outs = [hvd.grouped_allreduce(xs, op=hvd.Average, name=f"{tag}0", compression=comp)]
    before = comp.metrics()
    outs += [hvd.grouped_allreduce(xs, op=hvd.Average, name=f"{tag}{k}", compression=comp) for k in range(1, count)]
    after = comp.metrics()
    return digest(*[y for out in outs for y in out]), {c: (after[c] - before[c]) / (count - 1) for c in COUNTERS}


def build(chunk_bytes: int, bucket: int, wire: str):
    os.environ["HOROVOD_ALQ_PIPELINE_BYTES"] = str(chunk_bytes)  # read when the compressor's engine is made
    return ALQCompressor(bits=3, bucket_size=bucket, seed=5, update_steps=(0,), update_every=0, codec="cpu", wire=wire)


def faulty_round(comp, xs, chunk: int) -> str | None:
    """A round in which rank 0's coder breaks its frame of chunk ``chunk`` (a stream's final state
    flipped: it no longer decodes); what this rank raised, or None."""
    real, calls = entropy.encode_streams, []

    def broken(codes, n, d, bits, freq):
        lengths, streams = real(codes, n, d, bits, freq)
        calls.append(n)
        if len(calls) == chunk + 1:  # one coded payload per chunk's allgather
            streams = np.array(streams, copy=True)
            streams[0] ^= 0x5A
        return lengths, streams

    if hvd.rank() == 0:
        entropy.encode_streams = broken
    try:
        hvd.grouped_allreduce(xs, op=hvd.Average, name="fault", compression=comp)
        return None
    except Exception as exc:  # noqa: BLE001 - the test checks the message
        return f"{type(exc).__name__}: {exc}"
    finally:
        entropy.encode_streams = real


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--chunk", type=int, required=True, help="pipeline_bytes of the pipelined rounds")
    parser.add_argument("--sizes", required=True, help="the tensors' sizes, joined by ','")
    parser.add_argument("--bucket", type=int, required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--wire", default="fixed")
    parser.add_argument("--fault-chunk", type=int, default=-1, help="the chunk whose frame rank 0 breaks (-1: none)")
    args = parser.parse_args()
    hvd.init()
    rank = hvd.rank()
    xs = [torch.from_numpy(rank_data(rank, n, seed=k)) for k, n in enumerate(map(int, args.sizes.split(",")))]
    out = {}
    for name, chunk in (("plain", 0), ("piped", args.chunk)):
        comp = build(chunk, args.bucket, args.wire)
        out[name], counters = rounds(comp, xs, name, args.rounds)
        out[f"{name}_collectives"] = counters["collectives"]
        out[f"{name}_counters"] = counters
        out[f"{name}_exchange"] = comp.metrics()["exchange"]
    if args.fault_chunk >= 0:
        out["fault"] = faulty_round(build(args.chunk, args.bucket, args.wire), xs, args.fault_chunk)
    comp = build(args.chunk // 2 if rank == hvd.size() - 1 else args.chunk, args.bucket, args.wire)
    try:
        hvd.grouped_allreduce(xs, op=hvd.Average, name="mismatch", compression=comp)
        out["mismatch"] = None
    except Exception as exc:  # noqa: BLE001 - the test checks the message
        out["mismatch"] = f"{type(exc).__name__}: {exc}"
    report(out)


if __name__ == "__main__":
    main()
