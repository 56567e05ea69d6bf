"""The layers import downwards only: no import cycle anywhere in hal/, drivers/ or runtime_glue/,
and every package imports only what its docstring declares.

Each package's docstring holds the one declaration of its layer, a sentence the test parses:
"May import:", then package names in double backticks joined by ", " and " and", then a period
(or "May import: nothing."). A name is one package, not its subpackages, which declare their
own; imports within a package are always allowed; libraries outside the project are not
checked.

Every import counts, at module level, inside a function or under ``TYPE_CHECKING``: a cycle
that only a deferred import keeps from failing is still two modules that each need the other.
"""

from __future__ import annotations

import ast
import re
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


# Strict on purpose: a list the test cannot read is a layer nobody checks.
DECLARED = re.compile(
    r"May import: (nothing|``[\w.]+``(?:, ``[\w.]+``)*(?: and ``[\w.]+``)?)\.(?:\s|$)"
)
FORMAT = "'May import: ``a``, ``b`` and ``c``.' or 'May import: nothing.'"


def owner(module: str, packages: set[str]) -> str:
    """The deepest package ``module`` lies in; a package owns itself."""
    parts = module.split(".")
    return next(
        ".".join(parts[:n]) for n in range(len(parts), 0, -1) if ".".join(parts[:n]) in packages
    )


def declaration(package: str, path: Path, packages: set[str]) -> tuple[set[str], list[str]]:
    """The packages ``package``'s docstring says it may import, and what is wrong with the
    declaration (missing, written twice, unreadable, naming no package of the project)."""
    doc = " ".join((ast.get_docstring(ast.parse(path.read_text())) or "").split())
    if doc.count("May import") != 1:
        return set(), [f"{package} must declare its imports once in its docstring: {FORMAT}"]
    match = DECLARED.search(doc)
    if match is None:
        return set(), [f"{package}'s 'May import:' must read {FORMAT}"]
    names = set(re.findall(r"``([\w.]+)``", match[1]))
    return names, [
        f"{package} declares {n}, which is not a package" for n in sorted(names - packages)
    ]


def layer_violations(root: Path, packages: tuple[str, ...] = PACKAGES) -> list[str]:
    """Every import a module's package does not declare, and every missing or unreadable
    declaration, one message each."""
    known = modules(root, packages)
    package_names = {name for name, path in known.items() if path.name == "__init__.py"}
    allowed: dict[str, set[str]] = {}
    problems: list[str] = []
    for package in sorted(package_names):
        allowed[package], wrong = declaration(package, known[package], package_names)
        problems += wrong
    for name, path in sorted(known.items()):
        home = owner(name, package_names)
        for target in sorted(imports_of(name, path, known)):
            there = owner(target, package_names)
            if there != home and there not in allowed[home]:
                rule = ", ".join(sorted(allowed[home])) or "nothing"
                problems.append(f"{name} imports {target}, but {home} may import only: {rule}")
    return problems


def declared(package: str) -> set[str]:
    """What the repository's ``package`` declares it may import."""
    return declaration(package, ROOT.joinpath(*package.split("."), "__init__.py"), set())[0]


def test_every_package_imports_only_what_its_docstring_declares():
    assert layer_violations(ROOT) == []


def test_the_declarations_keep_the_designs_layers():
    """DESIGN.md's layers: hal imports no runtime and no driver, no driver imports another, the
    runtime reaches drivers only through the registry, and the model never the engine. (hal's
    conformance kit, ``hal.testing``, runs the runtime end to end and declares it.)"""
    assert declared("hal") == set()
    drivers = {p.parent.name for p in (ROOT / "drivers").glob("*/__init__.py")}
    for driver in drivers:
        assert declared(f"drivers.{driver}") == {"hal"}, driver
    runtime = [p.parent for p in (ROOT / "runtime_glue").rglob("__init__.py")]
    for package in runtime:
        name = ".".join(package.relative_to(ROOT).parts)
        assert not any(n.startswith("drivers") for n in declared(name)), name
    assert not any(n.startswith("runtime_glue.engine") for n in declared("runtime_glue.ouro"))


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


LAYERED = {
    "pkg/__init__.py": '"""May import: nothing."""\n',
    "pkg/low/__init__.py": '"""The bottom.\n\nMay import: nothing. Not ``pkg.high``."""\n',
    "pkg/low/a.py": "import os\nfrom pkg.low import b\n",
    "pkg/low/b.py": "",
    "pkg/low/deep/__init__.py": '"""May import: ``pkg.low``."""\n',
    "pkg/low/deep/c.py": "from pkg.low.b import x\n",
    "pkg/high/__init__.py": '"""On top.\n\nMay import: ``pkg.low``\nand ``pkg``."""\n',
    "pkg/high/d.py": "from pkg.low import a\nimport pkg\n",
}


def test_a_tree_that_keeps_its_declarations_passes(tmp_path):
    _write(tmp_path, LAYERED)
    assert layer_violations(tmp_path, ("pkg",)) == []


@pytest.mark.parametrize(
    "upward",
    [
        "from pkg.high import d\n",  # at module level
        "def f():\n    import pkg.high.d\n",  # deferred into a function
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.high.d import D\n",
        "from ..high import d\n",  # relative
    ],
)
def test_a_planted_upward_import_is_reported_naming_module_import_and_rule(tmp_path, upward):
    _write(tmp_path, {**LAYERED, "pkg/low/b.py": upward})
    assert layer_violations(tmp_path, ("pkg",)) == [
        "pkg.low.b imports pkg.high.d, but pkg.low may import only: nothing"
    ]


def test_declaring_a_package_does_not_declare_its_subpackages(tmp_path):
    _write(tmp_path, {**LAYERED, "pkg/high/d.py": "from pkg.low.deep import c\n"})
    assert layer_violations(tmp_path, ("pkg",)) == [
        "pkg.high.d imports pkg.low.deep.c, but pkg.high may import only: pkg, pkg.low"
    ]


@pytest.mark.parametrize(
    ("docstring", "problem"),
    [
        ('"""A new package."""\n', "pkg.high must declare its imports once"),
        ("", "pkg.high must declare its imports once"),
        ('"""May import: nothing.\n\nMay import: ``pkg``."""\n', "pkg.high must declare"),
        ('"""May import every other layer."""\n', "pkg.high's 'May import:' must read"),
        ('"""May import: pkg.low."""\n', "pkg.high's 'May import:' must read"),
        ('"""May import: ``pkg.lwo``."""\n', "pkg.high declares pkg.lwo, which is not a package"),
    ],
)
def test_a_missing_or_unreadable_declaration_is_reported(tmp_path, docstring, problem):
    _write(tmp_path, {**LAYERED, "pkg/high/__init__.py": docstring})
    assert any(p.startswith(problem) for p in layer_violations(tmp_path, ("pkg",)))
