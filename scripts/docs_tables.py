#!/usr/bin/env python
"""The results tables of README.md and docs/index.md, written from the committed data under
docs/results/data/, between ``<!-- generated: python -m scripts.docs_tables -->`` and
``<!-- end generated -->``, and the checks that keep the pages honest (tests/test_doc_figures.py).

    python -m scripts.docs_tables            # rewrite both tables in place
    python -m scripts.docs_tables --check    # exit 1, saying what differs, if a page is out of date
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "docs" / "results" / "data"
BEGIN = "<!-- generated: python -m scripts.docs_tables -->"
END = "<!-- end generated -->"
#: The pages holding the table, with the path from each to docs/results/.
PAGES = {"README.md": "docs/results/", "docs/index.md": "results/"}


@dataclass(frozen=True)
class Row:
    what: str
    alq: str
    against: str
    source: str  # the result page under docs/results/ that holds the full account
    data: tuple[str, ...]  # the files under docs/results/data/ the figure is computed from


def _json(name: str):
    return json.loads((DATA / name).read_text())


def _span(values, digits: int = 2) -> str:
    lo, hi = min(values), max(values)
    return f"{lo:.{digits}f}" if f"{lo:.{digits}f}" == f"{hi:.{digits}f}" else f"{lo:.{digits}f}-{hi:.{digits}f}"


_WORDS = {2: "two", 3: "three", 4: "four"}


def _step_ratios(name: str, workers: int, rate: str, row: str, reference: str = "hvd-fp16") -> list[float]:
    """A row's step over the reference row's, in each run of scripts/bench/train_step.py's JSON with
    that worker count and rate (rows interleaved in one run)."""
    out = []
    for run in _json(name)["runs"]:
        if run["workers"] == workers and run["rate"] == rate:
            res = run["run"]["results"]
            out.append(res[row]["step_s"] / res[reference]["step_s"])
    if not out:
        raise ValueError(f"{name}: no run of {workers} workers at {rate}")
    return out


def _variance_row() -> Row:
    data = _json("variance.json")
    it, var = data["iterations"], data["variance"]

    def mean(key):  # the mean over every measurement after iteration 0 (the page's "all" column)
        return statistics.fmean(v for i, v in zip(it, var[key]) if i > 0)

    ratios = [mean(f"qsgdinf|3|{d}|-") / mean(f"alq-linf|3|{d}|paper") for d in (512, 8192)]
    return Row(
        "quantization variance on a CNN's gradients (buckets 512 and 8192)",
        f"{min(ratios):.2g}-{max(ratios):.2g}x lower",
        "QSGDinf, the best fixed scheme",
        "variance_training.md",
        ("variance.json",),
    )


def _gpt_rows() -> list[Row]:
    summary = _json("accuracy_gpt.json")["summary"]
    qsgd = summary["alq@3"]["vs_qsgdinf"]
    psgd = summary["pairs"]["alq@3 - psgd-match"]
    return [
        Row(
            f"held-out loss of a character GPT, same seed ({qsgd['n']} seeds)",
            f"{qsgd['mean']:+.3f} ± {qsgd['sem']:.3f} nats/char, {qsgd['lower']} of {qsgd['n']} seeds",
            "QSGDinf at 3 bits",
            "accuracy_transformer.md",
            ("accuracy_gpt.json",),
        ),
        Row(
            "the same, at equal bytes",
            f"{psgd['mean']:+.3f} ± {psgd['sem']:.3f}, {psgd['lower']} of {psgd['n']} seeds",
            "PowerSGD rank 9",
            "accuracy_transformer.md",
            ("accuracy_gpt.json",),
        ),
    ]


def _mnist_row() -> Row:
    d = _json("accuracy_norm.json")["summary"]["alq-linf@b3d8192"]["vs_fp32"]
    return Row(
        f"MNIST test accuracy ({d['n']} seeds)",
        f"{d['mean']:+.2f} ± {d['sem']:.2f} points",
        "fp32",
        "accuracy_cnn.md",
        ("accuracy_norm.json",),
    )


def _step_rows() -> list[Row]:
    runs = ("bench_train_step_2026-12-01.json", "bench_train_step.json")
    auto = [r for name in runs for r in _step_ratios(name, 4, "100mbit", "hvd-alq")]
    two_phase = [r for name in runs for r in _step_ratios(name, 4, "100mbit", "hvd-alq-2p")]
    cores = ("bench_train_step_cores_two.json", "bench_train_step_cores_two_B.json")
    one_core = [r for name in cores for r in _step_ratios(name, 2, "1gbit", "hvd-alq")]
    long = ("bench_train_step_cores_long_A.json", "bench_train_step_cores_long_B.json")
    shared = [r for name in (*runs, *long) for r in _step_ratios(name, 4, "1gbit", "hvd-alq")]
    return [
        Row(
            "full training step, 4 workers, 100 Mbit/s links",
            f"{_span(auto + two_phase)}x ({_WORDS[len(runs)]} runs each of two rows of the same configuration: "
            f'`exchange="auto"` {_span(auto)}x, `"two-phase"` {_span(two_phase)}x)',
            "Horovod fp16",
            "training_steps.md",
            runs,
        ),
        Row(
            "full training step, 2 workers (a core each), 1 Gbit/s links",
            f"{_span(one_core)}x (both row orders)",
            "Horovod fp16",
            "training_steps.md",
            cores,
        ),
        Row(
            "full training step, 4 workers on 2 cores, 1 Gbit/s links",
            f"{_span(shared)}x ({_WORDS[len(shared)]} runs)",
            "Horovod fp16",
            "training_steps.md",
            (*runs, *long),
        ),
    ]


def _nodes_rows() -> list[Row]:
    rows = _json("hierarchical_error.json")

    def pick(model, ranks, g, row):
        (r,) = [
            r
            for r in rows
            if (r["model"], r["ranks"], r["local_size"], r["row"], r["bits"]) == (model, ranks, g, row, 3)
        ]
        return r

    flat, hier = "flat two-phase", "hierarchical"
    pairs = [(pick(m, 4, 2, hier), pick(m, 4, 2, flat)) for m in ("cnn", "gpt")]
    size = [h["inter_node_bytes"] / f["inter_node_bytes"] for h, f in pairs]
    error = [h["error"] / f["error"] for h, f in pairs]
    # from 4 nodes (hierarchical two-phase): every layout of 4 or more nodes in the data
    many = [
        (pick(r["model"], r["ranks"], r["local_size"], "hierarchical two-phase"), r)
        for r in rows
        if r["row"] == flat and r["bits"] == 3 and r["local_size"] > 1 and r["ranks"] // r["local_size"] >= 4
    ]
    per_g = [h["inter_node_bytes"] / f["inter_node_bytes"] * f["local_size"] for h, f in many]
    if not many or not all(abs(x - 1) < 0.05 for x in per_g):
        raise ValueError(f"hierarchical_error.json: from 4 nodes the bytes are not 1/G of flat's: {per_g}")
    error_many = [h["error"] / f["error"] for h, f in many]
    layouts = sorted({f"{f['ranks'] // f['local_size']} x {f['local_size']}" for _, f in many})
    steps = _nodes_steps()
    return [
        Row(
            "bytes between nodes, 2 nodes x 2 ranks (hierarchical exchange, the default across nodes)",
            f"{_span(size)}x, at {_span(error)}x the quantization error (CNN, GPT gradients); from 4 nodes of G "
            f"(hierarchical two-phase) 1/G at {_span(error_many)}x the error ({', '.join(layouts)})",
            "flat ALQ, 3 bits (two-phase)",
            "clusters.md",
            ("hierarchical_error.json",),
        ),
        Row(
            f"full training step, 2 nodes x 2 ranks on 2 cores, 100 Mbit/s between nodes ({steps['runs']} runs)",
            f"{_span(steps['100mbit'])}x (hierarchical, the default); {_span(steps['1gbit'])}x at 1 Gbit/s",
            "Horovod fp16",
            "bench_train_step.md",
            steps["files"],
        ),
    ]


def _nodes_steps() -> dict:
    from scripts.bench.step_repeats import load

    files = tuple(f"bench_train_step_nodes_shm_{i}.json" for i in (1, 2, 3))
    table = load([DATA / name for name in files])["table"]
    out = {"files": files, "runs": len(files)}
    for rate in ("100mbit", "1gbit"):
        out[rate] = [v[1] for v in table[("2x2", rate)]["hvd-alq-h"]]
    return out


def _time_to_accuracy_rows() -> list[Row]:
    summary = _json("time_to_accuracy.json")["summary"]

    def target(rate, row, fraction=0.75):
        (t,) = [t for t in summary[rate]["rows"][row]["targets"] if t["fraction"] == fraction]
        return t

    def ratio(t):
        mean, se = t["ratio"]
        seeds = "" if t["reached"] == t["seeds"] else f", in {t['reached']} of {t['seeds']} seeds"
        return f"{mean:.2f}x{seeds}" if t["reached"] < 2 else f"{mean:.2f} ± {se:.2f}x{seeds}"

    alq = target("100mbit", "hvd-alq")
    seeds = alq["seeds"]
    return [
        Row(
            f"time to accuracy, character GPT, 2 nodes x 2 ranks, 100 Mbit/s between nodes ({seeds} seeds): time "
            "to the loss fp16 reaches at 75% of its steps",
            f"{ratio(alq)} (PowerSGD at equal bytes {ratio(target('100mbit', 'ddp-psgd'))})",
            "Horovod fp16",
            "time_to_accuracy.md",
            ("time_to_accuracy.json",),
        ),
        Row(
            "the same at 1 Gbit/s",
            ratio(target("1gbit", "hvd-alq")),
            "Horovod fp16",
            "time_to_accuracy.md",
            ("time_to_accuracy.json",),
        ),
    ]


def rows() -> list[Row]:
    """Every row of the results table, computed from docs/results/data/."""
    bits = 3 + 32 / 8192  # b bits per coordinate and a float32 norm per bucket of 8192 (the wire format)
    return [
        Row("bits per coordinate on the wire (bucket 8192)", f"{bits:.3f}", "fp16: 16", "codec_speed.md", ()),
        _variance_row(),
        *_gpt_rows(),
        _mnist_row(),
        *_step_rows(),
        *_nodes_rows(),
        *_time_to_accuracy_rows(),
    ]


def table(prefix: str, computed: list[Row] | None = None) -> str:
    """The Markdown table, its links relative to a page whose path to docs/results/ is ``prefix``."""
    lines = ["| what | ALQ, 3 bits | against | source |", "|---|---|---|---|"]
    for r in rows() if computed is None else computed:
        lines.append(f"| {r.what} | {r.alq} | {r.against} | [{r.source.removesuffix('.md')}]({prefix}{r.source}) |")
    return "\n".join(lines)


def replace_table(text: str, new: str) -> str:
    """``text`` with what lies between the markers replaced by ``new``; ValueError without markers."""
    start = text.find(BEGIN)
    end = text.find(END, start) if start >= 0 else -1
    if end < 0:
        raise ValueError(f"no {BEGIN} ... {END} block")
    return text[: start + len(BEGIN)] + "\n" + new + "\n" + text[end:]


def table_problems(texts: dict[str, str], computed: list[Row] | None = None) -> list[str]:
    """For each page of :data:`PAGES` (its text in ``texts``), the lines of its generated table that
    differ from what this module writes."""
    computed = rows() if computed is None else computed
    problems = []
    for page, prefix in PAGES.items():
        text = texts[page]
        try:
            want = replace_table(text, table(prefix, computed))
        except ValueError as exc:
            problems.append(f"{page}: {exc}")
            continue
        if want != text:
            start = text.find(BEGIN)
            have = text[start : text.find(END, start)].splitlines()[1:]
            need = table(prefix, computed).splitlines()
            diff = [f"  page:      {a}\n  from data: {b}" for a, b in zip(have, need) if a != b]
            if len(have) != len(need):
                diff.append(f"  {len(have)} lines on the page, {len(need)} from the data")
            problems.append(
                f"{page}: the results table differs from `python -m scripts.docs_tables`:\n" + "\n".join(diff)
            )
    return problems


def first_screen_problems(readme: str, lines: int = 30) -> list[str]:
    """What the README's first ``lines`` lines lack: the two commands (its first commands), how to
    install into an existing environment, when it pays (time to accuracy's 75% target at 100 Mbit/s
    and 1 Gbit/s, the figures from its data) and the GPU status."""
    screen = " ".join(readme.splitlines()[:lines])
    first = re.search(r"```sh\n(.*?)```", readme, re.S)
    commands = [line.split("#")[0].strip() for line in first.group(1).splitlines()] if first else []
    summary = _json("time_to_accuracy.json")["summary"]
    ratios = [
        next(t for t in summary[rate]["rows"]["hvd-alq"]["targets"] if t["fraction"] == 0.75)["ratio"][0]
        for rate in ("100mbit", "1gbit")
    ]
    wanted = {
        "make demo": "make demo   # ",
        "make test": "make test   # ",
        "100 Mbit/s": "100 Mbit/s",
        "1 Gbit/s": "1 Gbit/s",
        "time to accuracy at 100 Mbit/s": f"{ratios[0]:.2f}x",
        "time to accuracy at 1 Gbit/s": f"{ratios[1]:.2f}x",
        "the GPU status": "No GPU path has run on a GPU",
        "an install into an existing environment": "pip install",
        "the system-Horovod route": "HOROVOD_ALQ_SYSTEM_HOROVOD=1",
    }
    problems = [
        f"README.md's first {lines} lines lack {what} ({text!r})" for what, text in wanted.items() if text not in screen
    ]
    if commands[:2] != ["make demo", "make test"]:
        problems.append(f"README.md's first commands are {commands[:2]}, not make demo and make test")
    return problems


# ------------------------------------------------------------------------------- status statements


@dataclass(frozen=True)
class StatusClaim:
    """A statement that something has not run (``pattern``, searched in every page), and the
    committed page that shows it did (``settled_by``, which must contain ``evidence``)."""

    pattern: str
    settled_by: str
    evidence: str
    what: str


STATUS_CLAIMS = (
    StatusClaim(
        r"diloco[^.]*?\b(study|studies)\b[^.]*?\b(not (been )?run|untested|to be measured)",
        "docs/results/diloco_study.md",
        r"\| h50-alq2 \|",
        "the DiLoCo study ran (3 seeds)",
    ),
    StatusClaim(
        r"\b(study|studies)\b[^.]*?\bis written and not\s+run",
        "docs/results/diloco_study.md",
        r"\| h50-alq2 \|",
        "the DiLoCo study ran (3 seeds)",
    ),
    StatusClaim(
        r"(this torch|that torch|triton 3\.7\.1|pypi's (cuda )?torch)"
        r"[^.]*?\b(untested|(were|was|has) not (been )?run)\b",
        "docs/guides/getting-started.md",
        r"`make test`[^.]*: 1590 passed",
        "the suite and the Horovod build passed against PyPI's CUDA torch in a Debian 13 root",
    ),
    StatusClaim(
        r"range (over runs )?(is )?still to be measured",
        "docs/results/bench_train_step.md",
        r"\(3 runs\)",
        "the range over runs of the node step times is measured (3 runs)",
    ),
    StatusClaim(
        r"test_tensorflow_process_sets\.py`?,? (which )?was not run",
        "docs/results/horovod_suite.md",
        r"TensorFlow process sets \(issue 21",
        "Horovod's TensorFlow process-set tests ran",
    ),
    StatusClaim(
        r"allgather below 4 (workers|ranks),? (and )?two-phase from 4(?![^|.]*\bnode)",
        "docs/guides/settings.md",
        r'"hierarchical"` \(auto on 2 or 3 nodes\)',
        'exchange="auto" picks a hierarchical exchange across nodes of several ranks (registry.choose_exchange)',
    ),
)


def doc_pages(root: Path = ROOT) -> dict[str, str]:
    """README.md and every Markdown page under docs/, by path relative to ``root``."""
    paths = [root / "README.md", *sorted((root / "docs").rglob("*.md"))]
    return {p.relative_to(root).as_posix(): p.read_text() for p in paths}


def status_problems(pages: dict[str, str], claims=STATUS_CLAIMS) -> list[str]:
    """Every statement of ``claims`` found in ``pages`` (the settling page included) while the
    settling page holds its evidence; a page's lines are joined, so a statement may span lines."""
    problems = []
    for claim in claims:
        settled = pages.get(claim.settled_by, "")
        if not re.search(claim.evidence, " ".join(settled.split())):
            continue  # not settled (yet): the statement may stand
        for page, text in pages.items():
            flat = " ".join(text.split())
            for m in re.finditer(claim.pattern, flat, flags=re.I):
                problems.append(
                    f"{page}: {m.group(0)!r} contradicts {claim.settled_by} ({claim.what}; "
                    f"it contains {claim.evidence!r})"
                )
    return problems


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 if a page is out of date")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    computed = rows()
    if args.check:
        problems = table_problems({page: (ROOT / page).read_text() for page in PAGES}, computed)
        problems += status_problems(doc_pages()) + first_screen_problems((ROOT / "README.md").read_text())
        print("\n".join(problems) or "up to date")
        return 1 if problems else 0
    for page, prefix in PAGES.items():
        path = ROOT / page
        text = path.read_text()
        new = replace_table(text, table(prefix, computed))
        if new != text:
            path.write_text(new)
            print(f"wrote {page}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
