"""The layers import downwards only: no import cycle anywhere in hal/, drivers/ or runtime_glue/.

Every import counts, at module level, inside a function or under ``TYPE_CHECKING``: a cycle
that only a deferred import keeps from failing is still two modules that each need the other.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("hal", "drivers", "runtime_glue")


def modules(root: Path, packages: tuple[str, ...]) -> dict[str, Path]:
    """Every module of ``packages`` under ``root`` by dotted name (a package by its name)."""
    found = {}
    for package in packages:
        for path in (root / package).rglob("*.py"):
            parts = path.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


def imports_of(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The project modules ``name`` imports: ``from a import b`` names ``a.b`` when that is a
    module, else ``a``; a relative import is resolved against ``name``'s package."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base
                for alias in node.names
            ]
        else:
            continue
        out.update(t for t in targets if t in known and t != name)
    return out


def import_cycles(root: Path, packages: tuple[str, ...] = PACKAGES) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    known = modules(root, packages)
    graph = {name: imports_of(name, path, known) for name, path in known.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_no_import_cycles():
    assert import_cycles(ROOT) == []


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


@pytest.mark.parametrize(
    "back_edge",
    [
        "from pkg.a import thing\n",  # at module level
        "def f():\n    from pkg import a\n",  # deferred into a function
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.a import Thing\n",
        "from . import a\n",  # relative
        "from .sub import deep\n",  # relative, through a subpackage (pkg.sub.deep -> pkg.a)
    ],
)
def test_a_planted_cycle_is_found(tmp_path, back_edge):
    _write(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/a.py": "import pkg.b\n",
            "pkg/b.py": back_edge,
            "pkg/sub/__init__.py": "",
            "pkg/sub/deep.py": "from pkg import a\n",
            "pkg/leaf.py": "from pkg import b\n",  # imports into the cycle, is not part of it
        },
    )
    [cycle] = import_cycles(tmp_path, ("pkg",))
    assert "pkg.a" in cycle and "pkg.b" in cycle and "pkg.leaf" not in cycle


def test_a_tree_without_cycles_passes(tmp_path):
    _write(
        tmp_path,
        {
            "pkg/__init__.py": "from pkg.a import x\n",
            "pkg/a.py": "import os\nfrom pkg import b\n",
            "pkg/b.py": "from typing import TYPE_CHECKING\n",
        },
    )
    assert import_cycles(tmp_path, ("pkg",)) == []


def test_runtime_glue_keeps_its_modules_in_layers():
    """Its own modules are few (the package's face); the rest lives in a subpackage per layer,
    each of which says in its docstring what it owns and what it may import."""
    top = sorted(p.name for p in (ROOT / "runtime_glue").glob("*.py"))
    assert len(top) <= 5, top
    for package in (ROOT / "runtime_glue").glob("*/__init__.py"):
        doc = ast.get_docstring(ast.parse(package.read_text())) or ""
        assert "Owns:" in doc and "import" in doc, package
