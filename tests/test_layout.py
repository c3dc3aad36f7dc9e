"""The layout of tests/: a helper lives in one file (tests/helpers.py for those the tests and the
worker scripts share) and is imported everywhere else; no test file edits ``sys.path``."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

TESTS = Path(__file__).resolve().parent
#: The places that may put folders on ``sys.path``: a rank's bootstrap (tests/workers/_boot.py);
#: pytest's own comes from setup.cfg's ``pythonpath``.
PATH_EDITORS = {"workers/_boot.py"}


def _modules():
    for path in sorted(TESTS.rglob("*.py")):
        yield path.relative_to(TESTS).as_posix(), ast.parse(path.read_text(), filename=str(path))


def _is_fixture(node: ast.FunctionDef) -> bool:
    for dec in node.decorator_list:
        target = dec.func if isinstance(dec, ast.Call) else dec
        if (isinstance(target, ast.Attribute) and target.attr == "fixture") or (
            isinstance(target, ast.Name) and target.id == "fixture"
        ):
            return True
    return False


def _body(node: ast.FunctionDef) -> str:
    """The function's body without its docstring, as ``ast.dump`` writes it (no positions)."""
    body = node.body
    if (
        body
        and isinstance(body[0], ast.Expr)
        and isinstance(body[0].value, ast.Constant)
        and isinstance(body[0].value.value, str)
    ):
        body = body[1:]
    return "\n".join(ast.dump(stmt) for stmt in body)


def duplicated_helpers(modules) -> dict:
    """``{(name, body): [files]}`` for every module-level function (not ``test_*``, not a fixture,
    not ``main``) defined with the same name and body in more than one file."""
    seen = defaultdict(list)
    for rel, tree in modules:
        for node in tree.body:
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            if node.name.startswith("test_") or node.name == "main" or _is_fixture(node):
                continue
            seen[(node.name, _body(node))].append(rel)
    return {key: files for key, files in seen.items() if len(files) > 1}


def test_duplicated_helpers_finds_a_copy_and_ignores_tests_fixtures_and_main():
    copy = (
        "import pytest\n\ndef h(x):\n    '''doc {}'''\n    return x + 1\n\n"
        "def test_a():\n    pass\n\ndef main():\n    pass\n\n@pytest.fixture\ndef f():\n    return 1\n"
    )
    other = (
        "def h(x):\n    return x + 2\n\ndef test_a():\n    pass\n\ndef main():\n    pass\n\n"
        "@pytest.fixture\ndef f():\n    return 1\n"
    )
    one, two = ast.parse(copy.format(1)), ast.parse(copy.format(2))
    assert list(duplicated_helpers([("a.py", one), ("b.py", two)]).values()) == [["a.py", "b.py"]]
    assert duplicated_helpers([("a.py", one), ("b.py", ast.parse(other))]) == {}


def test_no_helper_defined_twice():
    dups = duplicated_helpers(_modules())
    assert not dups, "helpers defined in several files (move them to tests/helpers.py): " + "; ".join(
        f"{name} in {', '.join(files)}" for (name, _), files in sorted(dups.items())
    )


def test_only_the_worker_bootstrap_edits_sys_path():
    editors = []
    for rel, tree in _modules():
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and node.attr == "path"
                and isinstance(node.value, ast.Name)
                and node.value.id == "sys"
                and rel not in PATH_EDITORS
            ):
                editors.append(f"{rel}:{node.lineno}")
    assert not editors, f"sys.path used outside {sorted(PATH_EDITORS)}: {editors}"
