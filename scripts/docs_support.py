#!/usr/bin/env python
"""What each front-end serves, on its guide, from the code: horovod_alq.settings' NOT_SERVED,
partly() and the exchange registry. Two checks keep the pages honest:

- each front-end's guide holds a generated summary between ``<!-- generated: served by "FRONT END" -->``
  and ``<!-- end served -->`` (:func:`summary`), rewritten by ``python -m scripts.docs_support``;
- no sentence of README.md or of a page outside docs/results says that a front-end refuses (or
  lacks) a setting or an exchange it serves, or that it takes "the same keywords" as PyTorch when it
  does not (:func:`contradictions`).

    python -m scripts.docs_support            # rewrite the summaries
    python -m scripts.docs_support --check    # exit 1, saying what is wrong
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from horovod_alq.exchange import registry
from horovod_alq.settings import FRONT_ENDS, IGNORED, NAMES, NOT_SERVED, partly

ROOT = Path(__file__).resolve().parent.parent
#: The guide of each front-end.
GUIDES = {
    "docs/guides/horovod-torch.md": "Horovod PyTorch",
    "docs/guides/horovod-tensorflow.md": "Horovod TensorFlow",
    "docs/guides/ddp.md": "DDP hook",
    "docs/guides/fsdp.md": "FSDP2",
    "docs/guides/mpi4py.md": "mpi4py",
    "docs/guides/diloco.md": "DiLoCo",
}
#: How the pages name each front-end.
ALIASES = {
    "Horovod PyTorch": r"Horovod PyTorch|PyTorch compressors",
    "Horovod TensorFlow": r"TensorFlow",
    "DDP hook": r"DDP hook",
    "FSDP2": r"FSDP2",
    "mpi4py": r"mpi4py",
    "DiLoCo": r"DiLoCo",
}
REFUSAL = r"\b(refuse[sd]?|not served|does not serve|do not serve|not supported|unsupported|not yet)\b"
#: Words that say a setting is missing without naming it.
PHRASES = {r"\bno fusion\b": "fusion_bytes", r"\bno early start\b": "overlap"}


def _begin(fe: str) -> str:
    return f'<!-- generated: served by "{fe}" -->'


END = "<!-- end served -->"


def exchanges(fe: str) -> tuple[str, ...]:
    """The exchange names ``exchange=`` may take with front-end ``fe``."""
    return partly().get(fe, {}).get("exchange", (registry.choices(), ""))[0]


def summary(fe: str) -> str:
    """The Markdown summary of what ``fe`` serves (the block on its guide)."""
    refused = NOT_SERVED[fe]
    some = {k: v for k, v in partly().get(fe, {}).items() if k != "exchange"}
    lines = [
        f"What {fe} serves (generated from `horovod_alq.settings` and the exchange registry; "
        "[all front-ends](settings.md#which-front-end-serves-which-setting)):",
        "",
        "- exchanges: " + ", ".join(f'`"{e}"`' for e in exchanges(fe)) + ";",
        f"- every shared setting but {len(refused)}: " + "; ".join(f"`{k}` ({why})" for k, why in refused.items()) + ";"
        if refused
        else "- every shared setting;",
    ]
    lines += [f"- `{k}`: {', '.join(map(repr, values))} only ({why});" for k, (values, why) in some.items()]
    lines += [f"- `{k}` is accepted and changes nothing: {why};" for k, why in IGNORED.get(fe, {}).items()]
    lines[-1] = lines[-1][:-1] + "."
    return "\n".join(lines) + "\n"


def _block(text: str, fe: str) -> str | None:
    m = re.search(re.escape(_begin(fe)) + r"\n(.*?)" + re.escape(END), text, flags=re.S)
    return None if m is None else m.group(1)


def block_problems(pages: dict[str, str]) -> list[str]:
    """Guides whose summary is missing or differs from :func:`summary`."""
    problems = []
    for page, fe in GUIDES.items():
        got = _block(pages.get(page, ""), fe)
        if got is None:
            problems.append(f"{page}: no {_begin(fe)} ... {END} block")
        elif got != summary(fe):
            problems.append(f"{page}: the summary of {fe} is out of date (python -m scripts.docs_support)")
    return problems


def _sentences(text: str) -> list[str]:
    """A page's prose, code blocks and generated blocks left out, lines joined, cut into sentences."""
    text = re.sub(r"```.*?```", " ", text, flags=re.S)
    text = re.sub(r"<!-- generated: .*?<!-- end [a-z]+ -->", " ", text, flags=re.S)
    lines = []
    for line in text.splitlines():  # a table's cells are sentences of their own
        line = line.strip()
        lines += [cell + "\n" for cell in line.strip("|").split(" | ")] if line.startswith("|") else [line]
    return re.split(r"(?<=[.;:!?])\s+|\n\s*\n", " \n".join(lines))


def _named(sentence: str) -> tuple[set[str], set[str]]:
    """The settings a sentence names (in backquotes, without a value) and the exchanges."""
    settings = {m for m in re.findall(r"`(\w+)=?`", sentence) if m in NAMES}  # (a value: `bits="auto"`, not)
    settings |= {name for phrase, name in PHRASES.items() if re.search(phrase, sentence, re.I)}
    found = set(re.findall(r'exchange="([\w-]+)"', sentence)) | set(re.findall(r'`"([\w-]+)"`', sentence))
    return settings, found & set(registry.choices())


def contradictions(pages: dict[str, str]) -> list[str]:
    """Sentences that say a front-end refuses what it serves, or takes PyTorch's keywords."""
    problems = []
    for page, text in pages.items():
        if page.startswith("docs/results/"):
            continue  # records of runs, as they were
        for sentence in _sentences(text):
            flat = " ".join(sentence.split())
            fes = [fe for fe in FRONT_ENDS if re.search(ALIASES[fe], flat)] or [GUIDES.get(page)]
            if len(fes) != 1 or fes[0] is None:
                continue  # none, or several: which one a word is about is not clear
            fe = fes[0]
            if re.search(r"\bsame\b[^.]{0,40}\bkeywords\b", flat) and not re.search(
                r"\b(except|but|other than|refuses?)\b", flat
            ):
                if NOT_SERVED[fe] != NOT_SERVED["Horovod PyTorch"] and fe != "Horovod PyTorch":
                    problems.append(f"{page}: {flat[:160]!r}: {fe} refuses {', '.join(NOT_SERVED[fe])}")
            for listed in re.findall(r'`exchange=("[^`]*\|[^`]*)`', flat):  # a list of the exchanges
                missing = set(exchanges(fe)) - set(re.findall(r'"([\w-]+)"', listed))
                if missing:
                    problems.append(f"{page}: {flat[:160]!r}: {fe} also serves {', '.join(sorted(missing))}")
            if not re.search(REFUSAL, flat, re.I) and not any(re.search(p, flat, re.I) for p in PHRASES):
                continue
            settings, named = _named(flat)
            refused = set(NOT_SERVED[fe]) | set(partly().get(fe, {})) | set(IGNORED.get(fe, {}))
            for name in sorted(settings - refused):
                problems.append(f"{page}: {flat[:160]!r}: {fe} serves `{name}` (settings.NOT_SERVED)")
            for name in sorted(named & set(exchanges(fe))):
                problems.append(f'{page}: {flat[:160]!r}: {fe} serves exchange "{name}" (the registry)')
    return problems


def doc_pages(root: Path = ROOT) -> dict[str, str]:
    paths = [root / "README.md", *sorted((root / "docs").rglob("*.md"))]
    return {p.relative_to(root).as_posix(): p.read_text() for p in paths}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 if a page is wrong")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    pages = doc_pages()
    if args.check:
        problems = block_problems(pages) + contradictions(pages)
        print("\n".join(problems) or "up to date")
        return 1 if problems else 0
    for page, fe in GUIDES.items():
        text = pages[page]
        if _block(text, fe) is None:
            print(f"{page}: no {_begin(fe)} block; add one with {END} where the summary belongs")
            continue
        new = re.sub(
            re.escape(_begin(fe)) + r"\n.*?" + re.escape(END),
            lambda _: _begin(fe) + "\n" + summary(fe) + END,
            text,
            flags=re.S,
        )
        if new != text:
            (ROOT / page).write_text(new)
            print(f"wrote {page}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
