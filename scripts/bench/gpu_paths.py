"""The CUDA paths that one GPU can reach, checked and timed in one command (issues 52, 67); the
sections, what each checks and how to run it: docs/guides/gpu.md. Writes a Markdown report and a
JSON sidecar (rewritten around every section). Exit status: 0 all ran or skipped, 1 a section
failed, 2 no CUDA device (unless ``--device cpu``).

    PYTHONPATH=. python -m scripts.bench.gpu_paths    # a GPU machine: torch, triton, numpy, scipy
    python -m scripts.bench.gpu_paths --device cpu --tiny --out build/gpu_paths.md   # the dry run
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import faulthandler
import json
import platform
import subprocess
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import torch

from scripts.bench.gpu_paths_codec import Skipped

SECTIONS = (
    "codec bench ddp-gpt ddp-resnet fsdp diloco compile ranks-exchanges ranks-train horovod ranks-horovod".split()
)


class Section:
    """One section's outcome: checks (name, ok, detail), Markdown lines, JSON data, traceback."""

    def __init__(self, key: str, title: str) -> None:
        self.key, self.title = key, title
        self.status, self.reason, self.seconds, self.traceback = "running", "", 0.0, None
        self.checks: list[dict] = []
        self.lines: list[str] = []
        self.data: dict = {}
        self.targets: list[dict] = []

    def check(self, name: str, ok, detail: str = "") -> bool:
        self.checks.append({"name": name, "ok": bool(ok), "detail": detail})
        return bool(ok)

    def target(self, name: str, value: float | None, limit: float, unit: str = "", note: str = "") -> None:
        """A GPU target: recorded (met or missed), not a check (the section does not fail on it)."""
        met = None if value is None else bool(value <= limit)
        self.targets.append({"name": name, "value": value, "limit": limit, "unit": unit, "met": met, "note": note})

    def as_dict(self) -> dict:
        keys = ("key", "title", "status", "reason", "seconds", "checks", "data", "targets", "traceback")
        return {k: getattr(self, k) for k in keys}


class Ctx:
    """What every section gets: the device, the sizes (--tiny) and the parsed arguments."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args, self.tiny = args, args.tiny
        self.device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
        self.cuda = self.device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def pick(self, tiny, full):
        return tiny if self.tiny else full


def run_sections(specs, ctx: Ctx, write=None, fail=(), limit: float = 0) -> list[Section]:
    """Run each ``(key, title, fn)`` as ``fn(ctx, section)`` whatever the earlier ones did (a raise
    fails it, :class:`Skipped` skips it); ``write(sections)`` around each, ``fail``: keys that raise
    at once (tests), ``limit``: seconds after which the process ends."""
    done: list[Section] = []
    for key, title, fn in specs:
        sec = Section(key, title)
        done.append(sec)
        print(f"== {title}", flush=True)
        if write is not None:
            write(done)  # a section that never returns stays "running" in the report
        if limit:
            faulthandler.dump_traceback_later(limit, exit=True)
        start = time.perf_counter()
        try:
            if key in fail:
                raise RuntimeError(f"injected failure (--fail {key})")
            fn(ctx, sec)
            ctx.sync()  # an asynchronous CUDA error belongs to the section that caused it
            bad = [c["name"] for c in sec.checks if not c["ok"]]
            sec.status, sec.reason = ("failed", "failed checks: " + "; ".join(bad)) if bad else ("passed", "")
        except Skipped as skip:
            sec.status, sec.reason = "skipped", str(skip)
        except Exception as exc:  # noqa: BLE001 - reported; the next section still runs
            sec.status, sec.reason = (
                "failed",
                f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}",
            )
            sec.traceback = traceback.format_exc()
        faulthandler.cancel_dump_traceback_later()
        sec.seconds = round(time.perf_counter() - start, 2)
        print(f"   {sec.status} in {sec.seconds:.1f} s {sec.reason}", flush=True)
        if write is not None:
            write(done)
    return done


# ---------------------------------------------------------------------------------------- report
def environment(ctx: Ctx) -> dict:
    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": np.__version__,
        "host": platform.node(),
        "cpus": __import__("os").cpu_count(),
    }
    for name in ("triton", "scipy", "horovod"):
        try:
            env[name] = __import__("importlib.metadata").metadata.version(name)
        except Exception:  # noqa: BLE001
            env[name] = "not installed"
    if ctx.cuda:
        prop = torch.cuda.get_device_properties(0)
        env.update(
            gpu=prop.name,
            memory_gib=round(prop.total_memory / 2**30, 1),
            cuda=torch.version.cuda,
            capability=".".join(map(str, torch.cuda.get_device_capability(0))),
        )
        with contextlib.suppress(Exception):
            query = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
            env["driver"] = subprocess.run(query, capture_output=True, text=True, timeout=30).stdout.strip()
    return env


def markdown(header: dict, sections: list[Section]) -> str:
    env = header["environment"]
    lines = [
        f"# GPU paths check ({header['date']})",
        "",
        f"`{header['command']}`",
        "",
        "Environment: " + "; ".join(f"{k} {v}" for k, v in env.items()) + ".",
        "",
        "| section | status | seconds | reason |",
        "|---|---|---|---|",
    ]
    lines += [f"| {s.title} | {s.status} | {s.seconds:.1f} | {s.reason} |" for s in sections]
    targets = [(s, t) for s in sections for t in s.targets]
    if targets:
        lines += ["", "## Targets", "", "| target | value | limit | met |", "|---|---|---|---|"]
        for s, t in targets:
            value = "-" if t["value"] is None else f"{t['value']:.3g}{t['unit']}"
            met = {True: "yes", False: "NO", None: t["note"] or "n/a"}[t["met"]]
            lines.append(f"| {t['name']} | {value} | {t['limit']:g}{t['unit']} | {met} |")
    for s in sections:
        lines += ["", f"## {s.title}", "", f"Status: **{s.status}**{': ' + s.reason if s.reason else ''}", ""]
        lines += [
            f"- [{'x' if c['ok'] else ' '}] {c['name']}" + (f": {c['detail']}" if c["detail"] else "") for c in s.checks
        ]
        lines += ([""] if s.checks else []) + s.lines
        if s.traceback:
            lines += ["", "```", s.traceback.rstrip(), "```"]
    return "\n".join(lines) + "\n"


def writer(header: dict, out: str | None):
    def write(sections: list[Section]) -> None:
        if not out:
            return
        path = Path(out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(markdown(header, sections))
        data = {**header, "sections": [s.as_dict() for s in sections]}
        path.with_suffix(".json").write_text(json.dumps(data, indent=1, default=str) + "\n")

    return write


def parse(argv) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: the dry run (gloo)")
    p.add_argument("--tiny", action="store_true", help="tiny sizes and models (the CPU dry run)")
    p.add_argument("--out", default="build/gpu_paths.md", help="the Markdown report; its JSON beside it (.json)")
    p.add_argument("--only", default="", help=f"comma-separated section keys: {','.join(SECTIONS)}")
    p.add_argument("--sizes", default="", help="codec benchmark sizes (default 16M,64M,256M; --tiny 64K,256K)")
    p.add_argument("--bandwidth", type=float, default=4e12, help="bytes/s of the memory floor (default 4e12)")
    p.add_argument("--section-timeout", type=float, default=300, help="seconds; 0: none (default 300)")
    p.add_argument("--horovod-gloo", default="", help="a Horovod built without GPU operations (ranks-horovod)")
    p.add_argument("--fail", default="", help="comma-separated section keys that raise at once (tests the report)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU build"
        print(
            f"gpu_paths: no CUDA device (torch {torch.__version__}, {build}); --device cpu runs the dry run",
            file=sys.stderr,
        )
        return 2
    from scripts.bench import gpu_paths_codec as codec
    from scripts.bench import gpu_paths_ranks as ranks
    from scripts.bench import gpu_paths_steps as steps

    ctx = Ctx(args)
    torch.manual_seed(0)
    header = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": " ".join(["python -m scripts.bench.gpu_paths", *argv]),
        "environment": environment(ctx),
    }
    fns = {**codec.SECTIONS, **steps.SECTIONS, **ranks.SECTIONS}
    keys = [k.strip() for k in args.only.split(",") if k.strip()] or SECTIONS
    unknown = [k for k in keys if k not in fns]
    if unknown:
        print(f"gpu_paths: unknown sections {unknown}; choose from {', '.join(SECTIONS)}", file=sys.stderr)
        return 2
    start = time.perf_counter()
    sections = run_sections(
        [(k, *fns[k]) for k in keys], ctx, writer(header, args.out), args.fail.split(","), args.section_timeout
    )
    header["seconds"] = round(time.perf_counter() - start, 1)
    writer(header, args.out)(sections)
    steps.shutdown()
    print(
        f"gpu_paths: {', '.join(f'{s.key} {s.status}' for s in sections)} in {header['seconds']} s; report {args.out}"
    )
    return 1 if any(s.status == "failed" for s in sections) else 0


if __name__ == "__main__":
    sys.exit(main())
