"""GPU codec benchmark (issue 12): the Triton codec against the memory-bandwidth floor.

    python -m scripts.bench.gpu --out build/results/bench_gpu_table.md        # 16M, 64M, 256M float32
    # the report goes by hand into docs/results/codec_speed.md#bench_gpu

For each size: encode, decode-and-sum of 1, 4 and 8 payloads, grid statistics (a refit round),
the fp16 cast round trip (``x.half().float()``), with CUDA events, median of ``--repeats`` runs
after warm-up (which includes Triton's compilation); peak extra memory from
``torch.cuda.max_memory_allocated`` (beyond the input, the payloads and the output), as a multiple
of the input's bytes; and the ratio to the memory floor: the bytes an operation must move (encode:
read 4 B and write bits/8 B per coordinate plus the norms; decode of P payloads: read P payloads,
write 4 B per coordinate; statistics: read the input once; fp16 round trip: 12 B per coordinate)
at ``--bandwidth`` bytes/s (default 4e12, as in the issue; the measured device-to-device copy
bandwidth is printed too). ``--baseline`` adds the plain torch-ops codec for comparison. Before
timing, a small tensor is encoded on the GPU and under Triton's interpreter with the same seed:
the payloads should agree byte for byte (the draws depend only on the seed and the element index),
and a GPU payload must decode identically with the torch-ops codec.

Needs only torch with CUDA, Triton and numpy (not Horovod, not scipy): run from the repository root.
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

import torch

from scripts.common.gpu import _import_codecs, agreement_check, bench_size, copy_bandwidth, parse_size


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="16M,64M,256M", help="comma-separated float32 element counts")
    parser.add_argument("--bits", type=int, default=3)
    parser.add_argument("--bucket-size", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--bandwidth", type=float, default=4e12, help="bytes/s of the memory floor")
    parser.add_argument(
        "--baseline",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also time the plain torch-ops codec (default: yes)",
    )
    parser.add_argument("--out", help="write the markdown report here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_gpu: no CUDA device", file=sys.stderr)
        return 2
    codecs = _import_codecs()
    import triton

    lines = [
        f"# GPU codec benchmark ({datetime.date.today().isoformat()})",
        "",
        f"`{' '.join(['python', '-m', 'scripts.bench.gpu'] + (argv if argv is not None else sys.argv[1:]))}`",
        "",
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, "
        f"CUDA {torch.version.cuda}; float32 input, {args.bits} bits, bucket {args.bucket_size}, "
        f"L2 norm; CUDA events, median of {args.repeats}. Floor: bytes moved at "
        f"{args.bandwidth / 1e12:.1f} TB/s; measured copy bandwidth {copy_bandwidth() / 1e12:.2f} TB/s. "
        f"Peak extra: allocated beyond input, payloads and output, x input bytes.",
        "",
    ]
    lines += agreement_check(codecs, args.bits, args.bucket_size) + [""]
    lines += ["| elements | codec | operation | ms | / floor | peak extra (x input) |", "|---|---|---|---|---|---|"]
    summary = [
        "",
        "| elements | codec | (encode + decode x1) ms | / fp16 round trip | / floor |",
        "|---|---|---|---|---|",
    ]
    for size in args.sizes.split(","):
        n = parse_size(size)
        rows = bench_size(
            codecs, size.strip(), n, args.bits, args.bucket_size, args.repeats, args.bandwidth, args.baseline
        )
        for name, backend, op, ms, floor, extra in rows:
            lines.append(f"| {name} | {backend} | {op} | {ms:.3f} | {ms / floor:.1f}x | {extra:.3f} |")
        fp16 = next(r[3] for r in rows if r[2] == "fp16 cast round trip")
        for backend in dict.fromkeys(r[1] for r in rows if r[2] == "encode"):
            enc = next(r for r in rows if r[1] == backend and r[2] == "encode")
            dec = next(r for r in rows if r[1] == backend and r[2] == "decode-sum x1")
            total, floor = enc[3] + dec[3], enc[4] + dec[4]
            summary.append(f"| {size.strip()} | {backend} | {total:.3f} | {total / fp16:.1f}x | {total / floor:.1f}x |")
        print("\n".join(lines[-len(rows) :]), flush=True)
    text = "\n".join(lines + summary) + "\n"
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
