"""Support claims come from the code: each front-end's guide holds the summary that
scripts/docs_support.py writes from horovod_alq.settings (NOT_SERVED, partly()) and the exchange
registry, and no page says that a front-end refuses what it serves (scripts.docs_support)."""

from __future__ import annotations

import pytest

from horovod_alq.settings import NOT_SERVED
from scripts import docs_support


def test_every_guide_holds_its_generated_summary():
    problems = docs_support.block_problems(docs_support.doc_pages())
    assert not problems, "\n".join(problems)


def test_no_page_contradicts_the_support_tables():
    problems = docs_support.contradictions(docs_support.doc_pages())
    assert not problems, "\n".join(problems)


def test_a_summary_follows_the_tables():
    text = docs_support.summary("Horovod TensorFlow")
    for name in NOT_SERVED["Horovod TensorFlow"]:
        assert f"`{name}`" in text
    assert '`"hierarchical-two-phase"`' in text and "error_feedback_dtype" in text
    pages = docs_support.doc_pages()
    page = "docs/guides/mpi4py.md"
    pages[page] = pages[page].replace('`"hierarchical"`, ', "", 1)  # a hand edit of the block
    assert docs_support.block_problems(pages) == [
        f"{page}: the summary of mpi4py is out of date (python -m scripts.docs_support)"
    ]


@pytest.mark.parametrize(
    "page, text, expected",
    [
        # the audit's kinds: a served exchange or setting called refused, a partial list of exchanges,
        # "the same keywords" where some are refused
        ("README.md", 'TensorFlow refuses `exchange="hierarchical"`.', 'exchange "hierarchical"'),
        ("README.md", "In TensorFlow each tensor is exchanged with no fusion.", "`fusion_bytes`"),
        ("README.md", "mpi4py refuses `bits_second`.", "`bits_second`"),
        ("docs/guides/mpi4py.md", 'It takes `exchange="allgather" | "two-phase" | "auto"`.', "also serves"),
        ("docs/guides/horovod-tensorflow.md", "The same keywords as PyTorch.", "refuses"),
    ],
)
def test_a_planted_contradiction_fails(page, text, expected):
    pages = docs_support.doc_pages()
    pages[page] = pages[page] + f"\n\n{text}\n"
    problems = docs_support.contradictions(pages)
    assert len(problems) == 1 and problems[0].startswith(page) and expected in problems[0], problems


@pytest.mark.parametrize(
    "text",
    [
        "TensorFlow refuses `wire` and `codec`.",
        "FSDP2 does not serve `bits_per`.",
        "The same keywords as PyTorch, except those listed below.",
        'TensorFlow serves `exchange="hierarchical"` in its graph.',
    ],
)
def test_a_true_statement_passes(text):
    pages = docs_support.doc_pages()
    pages["README.md"] += f"\n\n{text}\n"
    assert not docs_support.contradictions(pages)
