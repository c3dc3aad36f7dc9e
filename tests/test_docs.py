"""The documentation: the site builds with no warning, every public object is documented in the API
reference, every error the protocol raises is on the troubleshooting page, and every code snippet
of the README and the front-end pages runs as written (2 ranks where it needs ranks)."""

from __future__ import annotations

import ast
import importlib
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from multiproc import RANK_ENV, launch_command

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PACKAGE = ROOT / "horovod_alq"

# The public API: the modules users import, with their __all__.
PUBLIC_MODULES = (
    "horovod_alq.settings",
    "horovod_alq.torch",
    "horovod_alq.torch.ddp",
    "horovod_alq.torch.fsdp",
    "horovod_alq.torch.diloco",
    "horovod_alq.tensorflow",
    "horovod_alq.mpi",
    "horovod_alq.core",
)
# The errors every rank raises when the ranks of an exchange disagree or a collective times out:
# these and every class the package derives from them (protocol_errors()).
PROTOCOL_ERROR_ROOTS = {"ProtocolError", "NotMemberError"}
SNIPPET_PAGES = (
    "README.md",
    "docs/index.md",
    "docs/guides/horovod-torch.md",
    "docs/guides/horovod-tensorflow.md",
    "docs/guides/ddp.md",
    "docs/guides/fsdp.md",
    "docs/guides/mpi4py.md",
    "docs/guides/core.md",
    "docs/guides/diloco.md",
)


def _mkdocs() -> str:
    tool = Path(sys.executable).parent / "mkdocs"
    if not tool.exists():
        pytest.fail(f"mkdocs not found next to {sys.executable}; run `make install`")
    return str(tool)


def test_site_builds_with_no_warning(tmp_path):
    site = tmp_path / "site"
    proc = subprocess.run(
        [_mkdocs(), "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    assert "WARNING" not in log, log[-4000:]
    reference = (site / "reference" / "torch.html").read_text()
    assert 'id="horovod_alq.torch.ALQCompressor"' in reference
    assert "Settings to start from" in reference  # a parameter of QuantizedCompressor's docstring
    assert (site / "results" / "index.html").exists()
    variance = (site / "results" / "variance_training.html").read_text()
    assert re.search(r'<img [^>]*src="variance_vs_iter.png"', variance)
    assert (site / "results" / "variance_vs_iter.png").stat().st_size > 10_000
    assert (site / "results" / "data" / "variance.json").exists()


# Markdown links: [text](target "title"), ![alt](target), and reference definitions [id]: target.
_LINK = re.compile(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_DEFINITION = re.compile(r"^\s{0,3}\[[^\]]+\]:\s+<?(\S+?)>?(?:\s|$)")


def _markdown_links(path: Path) -> list[tuple[int, str]]:
    """(line number, target) of every link of a Markdown file, outside code blocks and code spans."""
    found, fence = [], None
    for number, line in enumerate(path.read_text().splitlines(), 1):
        marker = re.match(r"\s*(`{3,}|~{3,})", line)
        if marker:
            if fence is None:
                fence = marker.group(1)
            elif marker.group(1).startswith(fence):
                fence = None
            continue
        if fence is not None:
            continue
        text = re.sub(r"(`+).*?\1", "", line)
        found += [(number, m.group(1)) for m in _LINK.finditer(text)]
        found += [(number, m.group(1)) for m in _DEFINITION.finditer(text)]
    return found


def _anchors(page: Path) -> set[str]:
    """The ids of a page's headings as the toc extension makes them (explicit {#id} too)."""
    from markdown.extensions.toc import slugify

    ids, seen, fence = set(), {}, False
    for line in page.read_text().splitlines():
        if re.match(r"\s*(```|~~~)", line):
            fence = not fence
        heading = None if fence else re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not heading:
            continue
        text = heading.group(1)
        explicit = re.search(r"\{#([\w-]+)[^}]*\}\s*$", text)
        if explicit:
            ids.add(explicit.group(1))
            continue
        text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text).replace("`", "").replace("*", "")
        slug = slugify(text, "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        ids.add(slug if n == 0 else f"{slug}_{n}")
    return ids


def _link_pages() -> list[Path]:
    return [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]


def test_every_relative_link_resolves():
    """Every relative link of README.md and of the pages under docs/ names a file that exists; a
    page's links stay inside docs/ (the site has nothing else); README's links into docs/ that name
    an anchor name a heading of that page (mkdocs checks the anchors of links between pages)."""
    problems, checked = [], 0
    for page in _link_pages():
        where = page.relative_to(ROOT)
        for number, target in _markdown_links(page):
            if re.match(r"[a-zA-Z][\w+.-]*:", target) or target.startswith("#"):
                continue  # http:, mailto:, ...; an anchor on the same page (checked by mkdocs)
            path, _, anchor = target.partition("#")
            if target.startswith("/"):
                problems.append(f"{where}:{number}: absolute link {target}")
                continue
            resolved = (page.parent / path).resolve()
            checked += 1
            if not resolved.exists():
                problems.append(f"{where}:{number}: {target} does not exist")
            elif page.is_relative_to(DOCS) and not resolved.is_relative_to(DOCS):
                problems.append(f"{where}:{number}: {target} is outside docs/, not part of the site")
            elif anchor and not page.is_relative_to(DOCS) and resolved.suffix == ".md":
                if anchor not in _anchors(resolved):
                    problems.append(f"{where}:{number}: {target}: no heading with that anchor")
    assert not problems, "\n".join(problems)
    assert checked > 200  # the pattern still finds the links


def test_readme_links_into_the_docs():
    targets = [t for _, t in _markdown_links(ROOT / "README.md") if t.startswith("docs/")]
    assert {"docs/index.md", "docs/results/index.md", "docs/guides/getting-started.md"} <= {
        t.partition("#")[0] for t in targets
    }


# A results page named in code, comments and docstrings: docs/results/<page>.md, maybe with #anchor.
_PAGE_REFERENCE = re.compile(r"docs/results/([\w-]+\.md)(?:#([\w-]+))?")
_CODE_SUFFIXES = {".py", ".sh", ".c", ".cc", ".cpp", ".cu", ".h", ".hpp", ".cuh", ".txt", ".cfg", ".toml"}


def _broken_page_references(files) -> list[str]:
    """'file:line: reference: why' for each docs/results page a file names that does not exist, or
    whose anchor the page does not define."""
    problems, anchors = [], {}
    for path in files:
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            for match in _PAGE_REFERENCE.finditer(line):
                page, anchor = DOCS / "results" / match.group(1), match.group(2)
                where = f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}:{number}: {match.group(0)}"
                if not page.exists():
                    problems.append(f"{where}: no such page")
                elif anchor and anchor not in anchors.setdefault(page, _anchors(page)):
                    problems.append(f"{where}: the page has no such anchor")
    return problems


def _code_files() -> list[Path]:
    found = [ROOT / "Makefile"]
    for folder in ("horovod_alq", "scripts", "tests"):
        found += [p for p in sorted((ROOT / folder).rglob("*")) if p.suffix in _CODE_SUFFIXES and p.is_file()]
    return found


def test_code_names_only_results_pages_and_anchors_that_exist():
    """Results pages get folded into one page per topic (a report becomes a section with an anchor):
    a comment, docstring or default that names a page must name one that exists, and its anchor."""
    files = _code_files()
    assert len(files) > 100 and ROOT / "scripts" / "study" / "scale.py" in files
    problems = _broken_page_references(files)
    assert not problems, "pages folded or renamed; name page.md#anchor instead:\n" + "\n".join(problems)


_OUTPUT_OPTIONS = {"--out", "--out-dir", "--data", "--results-dir", "--json"}


def test_scripts_write_their_reports_under_build_by_default():
    """The pages under docs/results are curated (reports folded by hand into one page per topic): no
    script's default output (--out, --out-dir, ...; or ``args.out = ...`` when none was given) is
    there; a rerun writes a fresh report under build/results."""
    problems = []
    for path in sorted((ROOT / "scripts").rglob("*.py")):
        source = path.read_text()
        for node in ast.walk(ast.parse(source)):
            value = None
            if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
                if node.args[0].value in _OUTPUT_OPTIONS:
                    value = next((k.value for k in node.keywords if k.arg == "default"), None)
            elif isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Attribute) and t.attr in ("out", "out_dir") for t in node.targets
            ):
                value = node.value
            text = ast.get_source_segment(source, value) if value is not None else ""
            if "docs" in text:
                problems.append(f"{path.relative_to(ROOT)}:{node.lineno}: {text}")
    assert not problems, "default outputs under docs/: use build/results\n" + "\n".join(problems)


@pytest.mark.parametrize(
    "text, why",
    [
        ("# measured in docs/" + "results/bench_no_such_page.md", "no such page"),  # split: not found here
        ("# measured in docs/" + "results/codec_speed.md#no_such_anchor", "no such anchor"),
    ],
)
def test_a_reference_to_a_missing_page_or_anchor_fails(tmp_path, text, why):
    planted = tmp_path / "planted.py"
    planted.write_text(f"x = 1\n{text}\n")
    assert [why in p for p in _broken_page_references([planted])] == [True]
    planted.write_text("# docs/results/codec_speed.md#bench_codec_widths and docs/results/index.md\n")
    assert _broken_page_references([planted]) == []


def _public_objects():
    for module_name in PUBLIC_MODULES:
        module = importlib.import_module(module_name)
        lazy = getattr(module, "_EXPORTS", {})  # horovod_alq.core: name -> submodule
        for name in module.__all__:
            obj = getattr(module, name)
            defined_in = f"{module_name}.{lazy[name]}" if name in lazy else getattr(obj, "__module__", module_name)
            yield module_name, name, defined_in


def _reference_directives() -> set[str]:
    text = "\n".join(p.read_text() for p in (DOCS / "reference").glob("*.md"))
    return set(re.findall(r"^::: ([\w.]+)", text, flags=re.M))


def test_every_public_object_is_in_the_reference_with_a_docstring():
    import griffe

    documented = _reference_directives()
    # the package parsed once (a load per object would parse every module again: 57 times)
    package = griffe.GriffeLoader(search_paths=[str(ROOT)]).load(PACKAGE.name)
    missing, undocumented = [], []
    for module_name, name, defined_in in _public_objects():
        paths = {f"{module_name}.{name}", f"{defined_in}.{name}"}
        if not paths & documented:
            missing.append(f"{module_name}.{name}")
            continue
        path = sorted(paths & documented)[0]
        found = package[path.removeprefix(f"{PACKAGE.name}.")]
        targets = [found] + [
            m
            for m in getattr(found, "members", {}).values()
            if not m.name.startswith("_") and (m.is_function or m.is_class) and not m.is_alias and m.name != "__init__"
        ]
        undocumented += [t.path for t in targets if not (t.docstring and t.docstring.value.strip())]
    assert not missing, f"public objects missing from docs/reference/*.md (add a ::: line): {missing}"
    assert not undocumented, f"public objects without a docstring: {undocumented}"


def _pieces(node: ast.AST) -> list:
    """The literal text of a message expression: strings, with None where a value is formatted in
    (``{PREFIX}`` is the package name)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.JoinedStr):
        out = []
        for value in node.values:
            if isinstance(value, ast.FormattedValue) and getattr(value.value, "id", None) == "PREFIX":
                out.append("horovod_alq")
            else:
                out += _pieces(value) if isinstance(value, ast.Constant) else [None]
        return out
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _pieces(node.left) + _pieces(node.right)
    return [None]


def _trees() -> list[tuple[Path, ast.Module]]:
    return [(path, ast.parse(path.read_text())) for path in sorted(PACKAGE.rglob("*.py"))]


def protocol_errors(trees) -> set[str]:
    """PROTOCOL_ERROR_ROOTS and the names of every class of the package derived from them."""
    bases = {
        node.name: {getattr(b, "id", None) or getattr(b, "attr", None) for b in node.bases}
        for _, tree in trees
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef)
    }
    names = set(PROTOCOL_ERROR_ROOTS)
    while True:
        more = {name for name, parents in bases.items() if parents & names} - names
        if not more:
            return names
        names |= more


def protocol_messages() -> list[tuple[str, str]]:
    """(where, message) for every protocol error the package constructs; a formatted value is '…'."""
    found, trees = [], _trees()
    errors = protocol_errors(trees)
    for path, tree in trees:
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and node.args):
                continue
            name = getattr(node.func, "id", None) or getattr(node.func, "attr", None)
            if name in errors:
                text = "".join("…" if p is None else p for p in _pieces(node.args[0]))
                if text.strip("… "):  # a message passed through from elsewhere has no text of its own
                    found.append((f"{path.relative_to(ROOT)}:{node.lineno}", " ".join(text.split())))
    return found


def test_protocol_messages_are_found():
    assert {"ReductionMismatch", "CollectiveTimeout", "RefitError"} <= protocol_errors(_trees())
    messages = dict(protocol_messages())
    assert len(messages) >= 15
    assert any("did not complete within" in m for m in messages.values())  # the timeout
    assert any("op=Sum and op=Average only" in m for m in messages.values())


def test_every_protocol_error_is_on_the_troubleshooting_page():
    page = " ".join((DOCS / "guides" / "troubleshooting.md").read_text().split())
    missing = [f"{where}: {message}" for where, message in protocol_messages() if message not in page]
    assert not missing, (
        "messages missing from docs/guides/troubleshooting.md (copy each, with … for the "
        "values filled in at run time):\n" + "\n".join(missing)
    )


_BLOCK = re.compile(r"(?:<!-- snippet: (?P<spec>[^>]*?) -->\n)?```(?P<lang>\w*)\n(?P<code>.*?)\n```", re.S)


def snippets():
    """(page, spec, code) for every python block of SNIPPET_PAGES; spec is the marker before it."""
    for page in SNIPPET_PAGES:
        for m in _BLOCK.finditer((ROOT / page).read_text()):
            if m.group("lang") == "python":
                yield page, m.group("spec"), m.group("code")


def _runnable():
    return [
        pytest.param(code, spec, id=f"{Path(page).stem}-{i}")
        for i, (page, spec, code) in enumerate(snippets())
        if spec and not spec.startswith("excerpt of")
    ]


def _excerpt_problem(code: str, program: str) -> str | None:
    """The first line of ``code`` that is not in ``program`` in order (None: an excerpt of it)."""
    lines = iter(line.strip() for line in program.splitlines())
    for line in (line.strip() for line in code.splitlines()):
        if line and not any(line == other for other in lines):
            return line
    return None


def test_every_snippet_is_marked_and_every_excerpt_is_part_of_a_program():
    programs: dict[str, list[str]] = {}
    for page, spec, code in snippets():
        if spec and not spec.startswith("excerpt"):
            programs.setdefault(page, []).append(code)
    problems = []
    for page, spec, code in snippets():
        if spec is None:
            problems.append(f"{page}: a python block without a <!-- snippet: ... --> marker:\n{code[:200]}")
        elif spec.startswith("excerpt of "):
            source = spec.removeprefix("excerpt of ")
            if source not in programs:
                problems.append(f"{page}: excerpt of {source}, which has no runnable snippet")
                continue
            missing = [_excerpt_problem(code, program) for program in programs[source]]
            if all(missing):
                problems.append(f"{page}: excerpt line not in {source}'s programs, in order: {missing[0]!r}")
        elif spec not in ("python", "mpirun -np 2", "torchrun --nproc-per-node 2"):
            problems.append(f"{page}: unknown snippet marker {spec!r}")
    assert not problems, "\n".join(problems)
    assert len(programs) >= 6


@pytest.mark.multiproc
@pytest.mark.parametrize("code, spec", _runnable())
def test_snippet_runs_as_written(code, spec, tmp_path):
    script = tmp_path / "snippet.py"
    script.write_text(code + "\n")
    if spec == "python":
        command, ranks = [sys.executable, str(script)], 1
    else:
        launcher = "mpi" if spec.startswith("mpirun") else "torchrun"
        command, ranks = [*launch_command(launcher, 2), sys.executable, str(script)], 2
    proc = subprocess.Popen(
        command,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        env={**os.environ, **RANK_ENV},
    )
    try:
        out, _ = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"snippet timed out after 300 s:\n{out[-3000:]}")
    assert proc.returncode == 0, out[-4000:]
    if ranks == 1:
        assert "bits/coordinate" in out, out[-2000:]
        return
    # (the ranks' lines may run together: mpirun forwards their output as it comes)
    sums = dict(re.findall(r"rank (\d+): [^\n]*?sum (?:of the mean )?(-?\d+\.\d{6})", out))
    assert sorted(sums) == ["0", "1"], out[-3000:]
    assert sums["0"] == sums["1"], f"ranks differ: {sums}"
