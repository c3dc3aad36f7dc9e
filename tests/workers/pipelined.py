"""Worker for tests/torch/test_pipeline_ranks.py: the Horovod PyTorch compressor's rounds of a few
tensors in one fusion buffer, unpipelined (HOROVOD_ALQ_PIPELINE_BYTES=0) and pipelined (--chunk
bytes), in turn in one launch, on the exchange that "auto" picks (allgather on one node,
hierarchical with HOROVOD_ALQ_LOCAL_SIZE=2 on 4 ranks). Reports a digest of each one's results,
its own collectives per round, the exchange, and what every rank gets when the last rank alone
cuts its buffers into other chunks."""

import argparse
import os

import horovod.torch as hvd
import torch
from common import report
from helpers import digest, rank_data

from horovod_alq.torch import ALQCompressor


def rounds(comp, xs, tag: str, count: int) -> tuple[str, float]:
    """``count`` rounds (the first refits): a digest of every output, and own collectives per later round."""
    outs = [hvd.grouped_allreduce(xs, op=hvd.Average, name=f"{tag}0", compression=comp)]
    before = comp.metrics()["collectives"]
    outs += [hvd.grouped_allreduce(xs, op=hvd.Average, name=f"{tag}{k}", compression=comp) for k in range(1, count)]
    return digest(*[y for out in outs for y in out]), (comp.metrics()["collectives"] - before) / (count - 1)


def build(chunk_bytes: int, bucket: int):
    os.environ["HOROVOD_ALQ_PIPELINE_BYTES"] = str(chunk_bytes)  # read when the compressor's engine is made
    return ALQCompressor(bits=3, bucket_size=bucket, seed=5, update_steps=(0,), update_every=0, codec="cpu")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--chunk", type=int, required=True, help="pipeline_bytes of the pipelined rounds")
    parser.add_argument("--sizes", required=True, help="the tensors' sizes, joined by ','")
    parser.add_argument("--bucket", type=int, required=True)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    hvd.init()
    rank = hvd.rank()
    xs = [torch.from_numpy(rank_data(rank, n, seed=k)) for k, n in enumerate(map(int, args.sizes.split(",")))]
    out = {}
    for name, chunk in (("plain", 0), ("piped", args.chunk)):
        comp = build(chunk, args.bucket)
        out[name], out[f"{name}_collectives"] = rounds(comp, xs, name, args.rounds)
        out[f"{name}_exchange"] = comp.metrics()["exchange"]
    comp = build(args.chunk // 2 if rank == hvd.size() - 1 else args.chunk, args.bucket)
    try:
        hvd.grouped_allreduce(xs, op=hvd.Average, name="mismatch", compression=comp)
        out["mismatch"] = None
    except Exception as exc:  # noqa: BLE001 - the test checks the message
        out["mismatch"] = f"{type(exc).__name__}: {exc}"
    report(out)


if __name__ == "__main__":
    main()
