"""``python -m horovod_alq.doctor`` (also the ``horovod-alq-doctor`` command): does ALQ pay here?

On one process it reports the versions, the codec each device gets (and whether the compiled CPU
codec and Triton load), Horovod's build (frameworks, controllers, NCCL) and the settings each
front-end serves. Launched on N ranks, by mpirun (with mpi4py) or torchrun, it also measures the
link latency and throughput inside a node and between nodes and the codec's throughput here, and
predicts, with the project's scale model (:mod:`.model`), ALQ's step against fp16's for a model of
``--params`` parameters::

    python -m horovod_alq.doctor
    mpirun -np 4 python -m horovod_alq.doctor --params 25M --compute-ms 120
    torchrun --nnodes 2 --nproc-per-node 8 ... -m horovod_alq.doctor --params 1.3B

The prediction is no measurement: docs/results/doctor_check.md says how far it was from measured
steps (:data:`.predict.KNOWN_RANGE`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from . import environment, measure
from .predict import KNOWN_RANGE, predict

__all__ = ["main", "predict"]


def _count(text: str) -> float:
    """``25M``, ``1.3B``, ``7e9``, ``350K`` -> a number."""
    scale = {"K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9}.get(text[-1:].upper())
    try:
        return float(text[:-1]) * scale if scale else float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a count: {text!r} (e.g. 25M, 1.3B, 7e9)") from None


def parse(argv) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m horovod_alq.doctor", description=__doc__.split("\n\n")[0])
    p.add_argument("--params", type=_count, default=25e6, help="the model's gradient coordinates (default 25M)")
    p.add_argument("--compute-ms", type=float, default=0.0, help="forward + backward of a step, ms (default 0)")
    p.add_argument("--bits", type=int, default=3, help="ALQ's bits per coordinate (default 3)")
    p.add_argument("--kappa", type=float, default=1.0, help="the whole quantized path over the codec kernels' time")
    p.add_argument("--device", default="cpu", help="the device whose codec is timed (cpu, cuda:0)")
    p.add_argument("--link-bytes", type=_count, default=8 * 2**20, help="bytes of the throughput ping-pong")
    p.add_argument("--codec-size", type=_count, default=4 * 2**20, help="coordinates of the codec timing")
    p.add_argument("--json", help="also write everything as JSON to this file (rank 0)")
    args = p.parse_args(argv)
    if args.params <= 0 or args.compute_ms < 0 or not 1 <= args.bits <= 8 or args.kappa <= 0:
        p.error("--params and --kappa must be positive, --compute-ms not negative, --bits in 1..8")
    return args


def main(argv=None) -> int:
    args = parse(argv)
    ranks = measure.connect()
    rank = 0 if ranks is None else ranks.rank
    report: dict = {}
    if rank == 0:
        report = {
            "versions": environment.versions(),
            "codecs": environment.codecs(),
            "horovod": environment.horovod_build(),
            "served": environment.served(),
        }
    if ranks is not None:
        links = measure.links(ranks, int(args.link_bytes))
        if rank == 0:
            codec, name = measure.codec_speed(args.device, int(args.codec_size))
            per_host = ranks.size / max(1, len(links["hosts"]))
            share = max(1.0, per_host / (os.cpu_count() or 1))
            report["links"] = links
            report["codec"] = {"name": name, "device": args.device, **codec.__dict__}
            report["prediction"] = predict(
                args.params, ranks.size, ranks.local_size, links, codec, args.compute_ms / 1e3, args.bits, share,
                args.kappa,
            )  # fmt: skip
            report["prediction"].update(
                params=args.params, compute_s=args.compute_ms / 1e3, share=share, kappa=args.kappa,
                known_range=list(KNOWN_RANGE), via=ranks.how,
            )  # fmt: skip
    if rank == 0:
        print(render(report))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=1, default=str)
    return 0


def render(r: dict) -> str:
    """The report as text."""
    out = ["horovod-alq doctor", "", "versions: " + ", ".join(f"{k} {v}" for k, v in r["versions"].items())]
    out += ["", "codec per device (codec='auto'):"]
    out += [f"  {c['device']}: {c['codec']} ({c.get('note', '')})" for c in r["codecs"]]
    h = r["horovod"]
    if not h.get("installed"):
        out += ["", "Horovod: not installed (the DDP hook, FSDP2, DiLoCo and mpi4py front-ends need none)"]
    else:
        out += ["", f"Horovod {r['versions'].get('horovod', '?')}: frameworks {', '.join(h['frameworks']) or 'none'}"]
        if "controllers" in h:
            out[-1] += (
                f"; controllers {', '.join(h['controllers'])}; NCCL {'built' if h['nccl_built'] else 'not built'}"
            )
    out += ["", "settings each front-end serves (horovod_alq.settings; every other setting is served):"]
    for fe, s in r["served"].items():
        line = f"  {fe}: exchanges {', '.join(s['exchanges'])}"
        line += f"; refuses {', '.join(s['refuses'])}" if s["refuses"] else "; refuses none"
        line += "".join(f"; {k} only {', '.join(map(repr, v))}" for k, v in s["partly"].items())
        out.append(line)
    if "links" not in r:
        out += ["", "one process: launch on N ranks (mpirun -np N or torchrun) to measure links and predict"]
        return "\n".join(out)
    lk, c, p = r["links"], r["codec"], r["prediction"]
    out += ["", f"{lk['ranks']} ranks via {p['via']}, {lk['ranks_per_node']} per node, hosts {', '.join(lk['hosts'])}"]
    for name in ("inside", "between"):
        if name in lk:
            x = lk[name]
            out.append(
                f"  link {name} a node (ranks {x['pair'][0]}-{x['pair'][1]}): latency {x['latency_s'] * 1e6:.0f} us, "
                f"{x['bytes_per_s'] * 8 / 1e9:.3g} Gbit/s"
            )
    out.append(
        f"  codec {c['name']} on {c['device']}, one thread: encode {1 / c['enc3'] / 1e6:.0f} M coordinates/s "
        f"(3 bits), decode {1 / c['dec'] / 1e6:.0f} M/s"
    )
    lo, hi = p["known_range"]
    out += [
        "",
        f"prediction (scale model) for {p['params']:.3g} parameters, compute {p['compute_s'] * 1e3:g} ms, "
        f"{p['share']:.2g} ranks per core, kappa {p['kappa']:g}:",
        f"  ALQ, exchange {p['exchange']}: {p['alq_s'] * 1e3:.1f} ms per step",
        f"  {p['fp16_row']}: {p['fp16_s'] * 1e3:.1f} ms per step",
        f"  ALQ / fp16 = {p['ratio']:.2f}: " + ("ALQ predicted faster" if p["ratio"] < 1 else "fp16 predicted faster"),
        f"  on measured steps the prediction was {lo:.2f}-{hi:.2f}x the measured ratio (docs/results/doctor_check.md):",
        f"  here that means a measured ALQ / fp16 of about {p['ratio'] / hi:.2f} to {p['ratio'] / lo:.2f}; "
        + verdict(p["ratio"] / hi, p["ratio"] / lo),
    ]
    return "\n".join(out)


def verdict(low: float, high: float) -> str:
    """What a range of ALQ / fp16 step ratios says."""
    if high < 1:
        return "ALQ pays"
    if low > 1:
        return "fp16 is faster: ALQ does not pay here"
    return "too close to call: measure both (scripts/bench/train_step.py, or time your own steps)"


if __name__ == "__main__":
    sys.exit(main())
