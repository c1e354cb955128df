"""The package's layout: no import circle, a production path apart from the tooling, short host functions.

The production path is everything ``import splitkv`` and the entries need;
benchmarks (``splitkv.bench``), the teaching model and lesson code
(``splitkv.teaching``) and the test builders (``splitkv.testing``) sit
beside it and may import it, never the other way round.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "splitkv"
TOOLING = ("splitkv.bench", "splitkv.teaching", "splitkv.testing")
#: Most lines of code (docstring excluded) a host function of the production path may have.
MAX_FUNCTION_LINES = 80


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in ROOT.rglob("*.py")}


def _is_tooling(name: str) -> bool:
    return name == "splitkv.__main__" or any(name == t or name.startswith(t + ".") for t in TOOLING)


def _imports(name: str) -> set:
    """Modules of the package that module ``name`` imports, at any depth of its code."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("splitkv")}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not target.startswith("splitkv"):
                continue
            for alias in node.names:  # `from . import workspace` names a module
                sub = f"{target}.{alias.name}"
                found.add(sub if sub in MODULES else target)
    return {m for m in found if m in MODULES and m != name}


GRAPH = {name: _imports(name) for name in MODULES}


def test_the_graph_sees_the_package():
    assert {"splitkv.api", "splitkv.plan", "splitkv.schedule", "splitkv.kernels.verify"} <= set(MODULES)
    assert "splitkv.schedule" in GRAPH["splitkv.plan"] and "splitkv.kernels.verify" in GRAPH["splitkv.plan"]


def test_no_import_circle():
    done, stack = set(), []

    def visit(m):
        if m in stack:
            pytest.fail("import circle: " + " -> ".join(stack[stack.index(m):] + [m]))
        if m in done:
            return
        stack.append(m)
        for n in sorted(GRAPH[m]):
            visit(n)
        stack.pop()
        done.add(m)

    for m in sorted(GRAPH):
        visit(m)


def test_production_imports_no_tooling():
    bad = [(m, n) for m in GRAPH if not _is_tooling(m) for n in GRAPH[m] if _is_tooling(n)]
    assert not bad, f"production modules importing benchmark, teaching or testing code: {bad}"


def test_import_splitkv_loads_no_tooling():
    code = ("import sys, splitkv; "
            "print(sorted(m for m in sys.modules if m.startswith(('splitkv.bench', 'splitkv.teaching', "
            "'splitkv.testing'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=ROOT.parent).stdout.strip()
    assert out == "[]", out


def test_kernel_modules_hold_only_jit_code():
    for name, path in MODULES.items():
        if not name.startswith("splitkv.kernels.") or name.endswith("__init__"):
            continue
        tree = ast.parse(path.read_text())
        for node in tree.body:
            if isinstance(node, ast.FunctionDef):
                assert any("jit" in ast.unparse(d) for d in node.decorator_list), f"{name}.{node.name} is not jit"
            assert not isinstance(node, ast.ClassDef), f"{name} defines a class"
        assert "splitkv.validate" not in GRAPH[name] and "torch" not in path.read_text().split("import triton")[0]


def _code_lines(fn: ast.FunctionDef) -> int:
    lines = fn.end_lineno - fn.lineno + 1
    body = fn.body
    if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant):
        lines -= body[0].end_lineno - body[0].lineno + 1
    return lines


def test_host_functions_are_short():
    long = []
    for name, path in MODULES.items():
        if _is_tooling(name) or name.startswith("splitkv.kernels"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and _code_lines(node) > MAX_FUNCTION_LINES:
                long.append(f"{name}.{node.name}: {_code_lines(node)} lines")
    assert not long, long
