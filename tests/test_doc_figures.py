"""One source per figure: the results tables of README.md and docs/index.md are what
scripts/docs_tables.py computes from the committed data under docs/results/data/, the README's
first screen says what the project is, its two commands, when it pays and what has not run (GPU),
and no page says that something has not run when a committed result page shows that it did."""

from __future__ import annotations

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
