"""The package's architecture rules, checked on the source (no imports run): no import cycles, the layers
import downward only, no op reaches into another op's private names, no comment narrates sessions.

Layers: ``core`` (single GPU) <- ``dist`` (ranks) <- ``proxy`` (inter-node transport) <- ``ops`` (every op);
``errors`` is below all of them, ``mkernel/__init__`` above.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "mkernel"
LAYER = {"errors": 0, "core": 1, "dist": 2, "proxy": 3, "ops": 4}


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in PKG.rglob("*.py")}


def _resolve(mod: str, is_pkg: bool, level: int, name: str | None) -> str:
    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
    if level > 1:
        base = base[:len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def _imports(mod: str, path: Path, modules: dict) -> list[tuple[str, list[str], int]]:
    """(imported module, names imported from it, line) of every import in ``path`` (any nesting level)."""
    tree = ast.parse(path.read_text())
    is_pkg = path.name == "__init__.py"
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            target = _resolve(mod, is_pkg, node.level, node.module) if node.level else (node.module or "")
            names = [a.name for a in node.names]
            for n in names:  # `from pkg import submodule` imports the submodule
                if f"{target}.{n}" in modules:
                    out.append((f"{target}.{n}", [], node.lineno))
            out.append((target, names, node.lineno))
        elif isinstance(node, ast.Import):
            for a in node.names:
                out.append((a.name, [], node.lineno))
    return [(t, n, ln) for t, n, ln in out if t == "mkernel" or t.startswith("mkernel.")]


def _graph():
    modules = _modules()
    edges = {m: set() for m in modules}
    for m, p in modules.items():
        for target, _, _ in _imports(m, p, modules):
            while target not in modules and "." in target:
                target = target.rsplit(".", 1)[0]
            if target in modules and target != m:
                edges[m].add(target)
    return modules, edges


def test_no_import_cycles():
    """No module imports (directly or through others, at module level or inside a function) a module that
    imports it back; a package's ``__init__`` re-exporting its own submodules is not a cycle."""
    modules, edges = _graph()

    def ignore(a, b):  # a submodule importing its own package's __init__ is how re-exports look: allowed
        return b != "mkernel" and a.startswith(b + ".")

    color, stack, cycles = {}, [], []

    def visit(m):
        color[m] = 1
        stack.append(m)
        for n in sorted(edges[m]):
            if ignore(m, n) or ignore(n, m) or n == "mkernel":
                continue
            if color.get(n) == 1:
                cycles.append(stack[stack.index(n):] + [n])
            elif n not in color:
                visit(n)
        stack.pop()
        color[m] = 2

    for m in sorted(modules):
        if m not in color:
            visit(m)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_layers_import_downward():
    """core imports nothing of dist / proxy / ops; dist nothing of proxy / ops; proxy nothing of ops."""
    modules, edges = _graph()
    bad = []
    for m, targets in edges.items():
        parts = m.split(".")
        if len(parts) < 2 or parts[1] not in LAYER:
            continue
        for t in targets:
            tp = t.split(".")
            if len(tp) >= 2 and tp[1] in LAYER and LAYER[tp[1]] > LAYER[parts[1]]:
                bad.append(f"{m} imports {t}")
    assert not bad, "\n".join(bad)


def test_no_op_uses_another_ops_private_names():
    """An op package imports another op's public names only (``from ..gemm import _x`` or ``G._x`` on an
    imported op module is refused); ``ops/base.py`` is shared by all."""
    modules = _modules()
    bad = []
    for m, p in modules.items():
        parts = m.split(".")
        if len(parts) < 4 or parts[1] != "ops":
            continue
        own = parts[2]
        tree = ast.parse(p.read_text())
        aliases = {}
        for target, names, line in _imports(m, p, modules):
            tp = target.split(".")
            if len(tp) >= 3 and tp[1] == "ops" and tp[2] not in (own, "base"):
                bad += [f"{m}:{line} imports {target}.{n}" for n in names if n.startswith("_")]
                if len(tp) > 3 and any(part.startswith("_") for part in tp[3:]):
                    bad.append(f"{m}:{line} imports private module {target}")
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level and node.module:
                target = _resolve(m, p.name == "__init__.py", node.level, node.module)
                tp = target.split(".")
                if len(tp) >= 3 and tp[1] == "ops" and tp[2] not in (own, "base"):
                    for a in node.names:
                        aliases[a.asname or a.name] = target
            elif isinstance(node, ast.ImportFrom) and node.level == 2 and node.module is None:
                for a in node.names:  # from .. import gemm as G
                    if a.name not in (own, "base"):
                        aliases[a.asname or a.name] = f"mkernel.ops.{a.name}"
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                    and node.attr.startswith("_") and not node.attr.startswith("__")):
                bad.append(f"{m}:{node.lineno} uses {aliases[node.value.id]}.{node.attr}")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("tree", ["mkernel", "cuda_src"])
def test_no_comment_narrates_sessions(tree):
    """Code is not a journal: comments state rules (and cite docs), never session numbers or history."""
    pat = re.compile(r"(first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|"
                     r"[a-z]+teenth|twenty[a-z-]*|thirty[a-z-]*|\d+(st|nd|rd|th)) session", re.I)
    bad = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}" for p in (ROOT / tree).rglob("*")
           if p.suffix in (".py", ".cu", ".cuh") for i, line in enumerate(p.read_text().splitlines(), 1)
           if pat.search(line)]
    assert not bad, "\n".join(bad)


def test_pyproject_lists_every_package():
    """A non-editable install ships only the packages pyproject.toml names: every package directory under
    mkernel/ (an ``__init__.py``) must be listed, or ``pip install .`` leaves it out."""
    tomllib = pytest.importorskip("tomllib")  # (Python >= 3.11)
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    present = {_module_name(p.parent / "__init__.py") for p in PKG.rglob("__init__.py")}
    assert present - listed == set(), f"pyproject.toml [tool.setuptools] packages misses {sorted(present - listed)}"
