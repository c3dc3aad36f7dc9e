"""docs/design/design.md's layout map matches the tree: every entry exists (the package's and the docs'
folders) and every module is on it."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "horovod_alq"


def _layout_block() -> str:
    text = (ROOT / "docs" / "design" / "design.md").read_text()
    found = re.search(r"^## Layout\n(.*?)^## ", text, flags=re.S | re.M)
    assert found, "docs/design/design.md has no '## Layout' section"
    return found.group(1)


def _entries(block: str) -> set[str]:
    """The map's entries: ``horovod_alq/x/``, ``horovod_alq/x.py`` or ``docs/`` at 4 spaces, and the
    names (``x.py``, ``x/``, ``x/y/``) at 8 spaces under the last directory entry."""
    entries, parent = set(), None
    for line in block.splitlines():
        top = re.match(r"^    (horovod_alq/[\w/]*\.?\w*/?|docs/)\s", line + " ")
        child = re.match(r"^        ([\w.][\w./]*)\s", line + " ")
        if top:
            entries.add(top.group(1))
            parent = top.group(1) if top.group(1).endswith("/") else None
        elif child and parent:
            entries.add(parent + child.group(1))
    return entries


def test_every_entry_of_the_map_exists():
    missing = sorted(e for e in _entries(_layout_block()) if not (ROOT / e).exists())
    assert not missing, f"docs/design/design.md's layout map names what the tree lacks: {missing}"


def test_every_module_is_on_the_map():
    block = _layout_block()
    entries = _entries(block)
    mentioned = set(re.findall(r"[\w/]+\.(?:py|cpp|h)\b", block))
    absent = []
    for path in sorted(PACKAGE.rglob("*")):
        if path.suffix not in (".py", ".cpp", ".h") or path.name == "__init__.py" or "__pycache__" in path.parts:
            continue
        rel = str(path.relative_to(ROOT))
        if rel in entries:
            continue
        under_listed_dir = any(rel.startswith(e) for e in entries if e.endswith("/"))
        named = any(m == path.name or rel.endswith("/" + m) for m in mentioned)
        if not (under_listed_dir and named):
            absent.append(rel)
    assert not absent, f"modules missing from docs/design/design.md's layout map: {absent}"
