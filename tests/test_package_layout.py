"""The package's shape: the engine imports no HTTP, the wheel holds no research drivers, no import circle between
modules (runtime, lazy or type-only), and docstrings and comments state contracts rather than cite logs or history."""

from __future__ import annotations

import ast
import json
import os
import re
import sys
import tomllib
from pathlib import Path

import pytest
from script_runner import Job

ROOT = Path(__file__).resolve().parents[1]
RESEARCH = ROOT / "examples" / "research"


def package_modules(root: Path = ROOT) -> dict[str, tuple[Path, bool]]:
    """Every module the wheel installs, by dotted name -> (file, is a package's ``__init__``), from pyproject's
    ``packages`` and ``package-dir`` (``modeling/`` and ``hub_cards/`` are mapped in from the top level)."""
    config = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {name: root / config["package-dir"].get(name, name.replace(".", "/")) for name in config["packages"]}
    out = {}
    for name, folder in folders.items():
        for path in folder.glob("*.py"):
            is_pkg = path.stem == "__init__"
            out[name if is_pkg else f"{name}.{path.stem}"] = (path, is_pkg)
    return out


def import_graph(modules: dict[str, tuple[Path, bool]]) -> dict[str, dict[str, int]]:
    """module -> {module it imports: line}, over every import statement of the file (top level, inside functions,
    under ``if TYPE_CHECKING``); relative imports resolved; ``from pkg import name`` is an edge to ``pkg.name``
    when that is a module, else to ``pkg``. Only edges between ``modules``."""
    graph = {}
    for name, (path, is_pkg) in modules.items():
        package = name if is_pkg else name.rpartition(".")[0]
        edges = graph[name] = {}
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            else:
                continue
            for target in targets:
                if target in modules and target != name:
                    edges.setdefault(target, node.lineno)
    return graph


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The graph's strongly connected components of more than one module (each is at least one import circle)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_import_circle_between_the_packages_modules():
    graph = import_graph(package_modules())
    assert len(graph) > 100  # the whole package was read
    found = cycles(graph)
    assert found == [], "import circles: " + "; ".join(
        " <-> ".join(f"{m} (imports {', '.join(f'{t}:{graph[m][t]}' for t in graph[m] if t in c)})" for m in c)
        for c in found)


def test_a_type_only_circle_is_found(tmp_path):
    """The control: two modules importing each other, one of them only under ``TYPE_CHECKING``, make one circle."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import B\n")
    (pkg / "b.py").write_text("from . import a\n")
    (pkg / "c.py").write_text("from .a import *\n")
    modules = {"pkg": (pkg / "__init__.py", True), **{f"pkg.{m}": (pkg / f"{m}.py", False) for m in "abc"}}
    assert cycles(import_graph(modules)) == [["pkg.a", "pkg.b"]]


# A fresh interpreter (nothing preloaded) that imports the engine and prints the server modules it imported, as
# `python -c` run in the checkout would (the checkout first on sys.path).
ENGINE_IMPORTS = f"""
import json, sys
sys.path[0] = {str(ROOT)!r}
import adaflash_hf.engine
print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in
                        ('fastapi', 'uvicorn', 'starlette', 'prometheus_client') or m.startswith('adaflash_hf.serve'))))
"""


def background_run(root: Path):
    """tests/conftest.py's `background` fixture: the import runs on the second core while the in-process tests run."""
    (root / "engine_imports.py").write_text(ENGINE_IMPORTS)
    return [Job("engine_imports", [root / "engine_imports.py"], cwd=ROOT)], dict(os.environ), ()


def test_importing_the_engine_imports_no_server(background):
    out = background["engine_imports"]
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


# the research drivers (examples/research), by the names they had in the package
RESEARCH_DRIVERS = {"experiment", "protocol", "train_target", "pretokenize", "corpus"}


def test_the_wheel_holds_no_research_drivers():
    modules = package_modules()
    assert "adaflash_hf.serve.server" in modules and "adaflash_hf.engine.engine" in modules
    assert {name.rpartition(".")[2] for name in modules} & RESEARCH_DRIVERS == set()
    assert not any(name.startswith("examples") for name in modules)
    assert {p.stem for p in RESEARCH.glob("*.py")} >= {"online_experiment", "online_protocol", "train_target",
                                                          "pretokenize", "target_corpus"}


# Docstrings and comments state what code does and promises; figures and history live in BENCHMARKS.md and git.
STALE = re.compile(r"docs/logs|BENCHMARKS|\b[Ii]ssues? \d|\b[Ss]ections? \d|\bH200\b")


def stale_citations(path: Path) -> list[str]:
    """``line: text`` of each docstring or comment line of ``path`` citing a log, a BENCHMARKS section, an issue
    number, a numbered section or H200 figures (string literals that are not docstrings are messages, left alone)."""
    text = path.read_text()
    tree = ast.parse(text)
    docstring_lines = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                docstring_lines.update(range(first.lineno, first.end_lineno + 1))
    hits = []
    for number, line in enumerate(text.splitlines(), 1):
        comment = line.partition("#")[2] if "#" in line else ""
        if STALE.search(comment) or (number in docstring_lines and STALE.search(line)):
            hits.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    return hits


def test_no_docstring_or_comment_cites_logs_benchmarks_sections_or_issues():
    hits = [hit for path, _ in package_modules().values() for hit in stale_citations(path)]
    assert hits == [], "\n".join(hits)


@pytest.mark.parametrize("line, stale", [
    ('"""Measured on an H200 (BENCHMARKS section 3)."""', True),
    ("x = 1  # see docs/logs/run.md", True),
    ('"""Added for issue 58."""', True),
    ('"""Rows verify their own blocks."""', False),
    ('raise ValueError("issue 5 of the input")', False),  # a message, not a docstring
])
def test_the_scan_reads_docstrings_and_comments(tmp_path, line, stale, monkeypatch):
    """The control: the scan flags a citation in a docstring or comment and nothing else."""
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    path = tmp_path / "m.py"
    path.write_text(f"def f():\n    {line}\n")
    assert bool(stale_citations(path)) is stale
