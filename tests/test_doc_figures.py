"""One source per figure: the results tables of README.md and docs/index.md are what
scripts/docs_tables.py computes from the committed data under docs/results/data/, the README's
first screen says what the project is, its two commands, when it pays and what has not run (GPU),
and no page says that something has not run when a committed result page shows that it did; the
results index's prose quotes the table's computed figures."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from scripts import docs_tables

ROOT = Path(__file__).resolve().parent.parent


def _pages() -> dict[str, str]:
    return {page: (ROOT / page).read_text() for page in docs_tables.PAGES}


def test_results_tables_are_computed_from_the_data():
    problems = docs_tables.table_problems(_pages())
    assert not problems, "\n".join(problems) + "\nregenerate with: python -m scripts.docs_tables"


def test_every_row_names_a_result_page_and_data_that_exist():
    rows = docs_tables.rows()
    assert len(rows) >= 10
    for row in rows:
        assert (ROOT / "docs" / "results" / row.source).exists(), row
        for name in row.data:
            assert (docs_tables.DATA / name).exists(), (row.what, name)


def test_no_status_statement_contradicts_a_result_page():
    problems = docs_tables.status_problems(docs_tables.doc_pages())
    assert not problems, "\n".join(problems)


def test_every_status_claim_is_settled_by_its_page():
    """Each claim's evidence is on its settling page: a claim whose evidence moved checks nothing."""
    pages = docs_tables.doc_pages()
    for claim in docs_tables.STATUS_CLAIMS:
        assert claim.settled_by in pages, claim
        assert re.search(claim.evidence, " ".join(pages[claim.settled_by].split())), claim


@pytest.mark.parametrize(
    "page, old, new",
    [
        ("README.md", "| 0.70 ± 0.04x (PowerSGD", "| 0.60 ± 0.04x (PowerSGD"),  # a figure
        ("docs/index.md", "| 9.5-39x lower |", "| 9-39x lower |"),  # the unkept run's end
        ("README.md", "\n| the same at 1 Gbit/s |", "\n"),  # a row dropped
    ],
)
def test_a_figure_that_differs_from_its_data_fails(page, old, new):
    pages = _pages()
    assert old in pages[page]
    pages[page] = pages[page].replace(old, new, 1)
    problems = docs_tables.table_problems(pages)
    assert len(problems) == 1 and problems[0].startswith(page), problems


@pytest.mark.parametrize(
    "text",
    [
        "Its study (held-out loss of the character GPT against bytes) is written and not run yet.",
        "DiLoCo's study of bytes against loss has not been run.",
        "The test suite has not been\n   run against this torch and triton 3.7.1: untested.",
        "One run: a range over runs is still to be measured.",
        "| `auto` (default) | allgather below 4 workers, two-phase from 4 | | |",
    ],
)
def test_a_planted_status_statement_fails(text):
    pages = docs_tables.doc_pages()
    assert not docs_tables.status_problems(pages)
    problems = docs_tables.status_problems({**pages, "docs/planted.md": f"Some words.\n{text}\nMore words.\n"})
    assert problems and all(p.startswith("docs/planted.md:") for p in problems), problems


def test_the_rule_of_auto_with_nodes_is_not_flagged():
    text = "On one node `auto` uses allgather below 4 ranks and two-phase from 4; across nodes, hierarchical."
    assert not docs_tables.status_problems({**docs_tables.doc_pages(), "docs/planted.md": text})


def test_the_readme_first_screen_says_what_when_and_what_ran():
    readme = (ROOT / "README.md").read_text()
    assert not docs_tables.first_screen_problems(readme)
    stale = readme.replace("0.70x fp16's time", "0.75x fp16's time", 1)
    assert [p for p in docs_tables.first_screen_problems(stale) if "100 Mbit/s" in p]
    pushed = "\n" * 20 + readme
    assert len(docs_tables.first_screen_problems(pushed)) >= 3
    no_pip = readme.replace("pip install", "pip-install")
    assert [p for p in docs_tables.first_screen_problems(no_pip) if "existing environment" in p]
    first = readme.replace("```sh\nmake demo", "```sh\npip install .\nmake demo", 1)
    assert [p for p in docs_tables.first_screen_problems(first) if "first commands" in p]


def test_the_readme_is_short():
    """At most 120 lines: everything else lives on the pages it links."""
    assert len((ROOT / "README.md").read_text().splitlines()) <= 120


def _index_quotes(rows) -> list[str]:
    """The figures docs/results/index.md's prose repeats from the results table, as that prose words
    them, built from the table's computed cells (so the prose cannot drift from the data)."""
    cells = {r.what: r.alq for r in rows}

    def cell(start: str) -> str:
        (found,) = [alq for what, alq in cells.items() if what.startswith(start)]
        return found

    def spans(text: str) -> list[tuple[str, str]]:
        return re.findall(r"(\d+(?:\.\d+)?)-(\d+(?:\.\d+)?)x", text)

    ((var_lo, var_hi),) = spans(cell("quantization variance on a CNN"))
    gpt = re.match(r"-(\d\.\d+ ± \d\.\d+)", cell("held-out loss of a character GPT")).group(1)
    psgd = re.match(r"-(\d\.\d+ ± \d\.\d+)", cell("the same, at equal bytes")).group(1)
    auto4 = spans(cell("full training step, 4 workers, 100 Mbit/s"))[1]  # exchange="auto"
    ((core_lo, core_hi),) = spans(cell("full training step, 2 workers (a core each)"))
    ((four_lo, four_hi),) = spans(cell("full training step, 4 workers on 2 cores"))
    error_lo, error_hi = spans(cell("bytes between nodes"))[0]
    (n100_lo, n100_hi), (n1g_lo, n1g_hi) = spans(cell("full training step, 2 nodes x 2 ranks"))
    tta = cell("time to accuracy, character GPT")
    tta_psgd = re.search(r"equal bytes (\d\.\d+x), in (\d) of (\d) seeds", tta).groups()
    tta_mean = re.match(r"(\d\.\d+) ±", tta).group(1)
    tta_1g = re.match(r"(\d\.\d+) ±", cell("the same at 1 Gbit/s")).group(1)
    return [
        f"{var_lo}x (d=512) to {var_hi}x (d=8192) less variance than QSGDinf",
        f"by {gpt} nats/char at 3 bits",
        f"(−{psgd})",
        f"{auto4[0]}-{auto4[1]}x fp16's step with 4 workers",
        f"{core_lo}-{core_hi}x fp16 at 1 Gbit/s",
        f"full step {four_lo}-{four_hi}x fp16's with 4 workers",
        f"at {error_hi}x (CNN) and {error_lo}x (GPT)",
        f"{n100_lo}-{n100_hi}x fp16's step at 100 Mbit/s",
        f"{n1g_lo}-{n1g_hi}x at 1 Gbit/s",
        f"and {tta_mean}x fp16's time",
        f"{tta_psgd[0]} in {tta_psgd[1]} of {tta_psgd[2]}",
        f"ALQ takes {tta_1g}x fp16's time",
    ]


def _index_prose_problems(rows) -> list[str]:
    text = " ".join((ROOT / "docs" / "results" / "index.md").read_text().split())
    return [quote for quote in _index_quotes(rows) if quote not in text]


def test_the_results_index_prose_quotes_the_computed_figures():
    """Figures the index's prose repeats from the results table are the table's computed ones; a
    changed figure in the data (planted) is caught."""
    rows = docs_tables.rows()
    assert not _index_prose_problems(rows)
    planted = [r if not r.what.startswith("full training step, 2 nodes") else _replace_cell(r) for r in rows]
    assert _index_prose_problems(planted) == ["0.55-0.62x fp16's step at 100 Mbit/s"]


def _replace_cell(row):
    return dataclasses.replace(row, alq=row.alq.replace("0.53-0.62x", "0.55-0.62x"))
