"""The layout rules of docs/ARCHITECTURE.md that no linter checks as written:
no import cycle between gpuwarden's modules (function-level imports counted), no
private name imported from another module, no function over 80 lines.

The layers themselves are import-linter contracts (``[tool.importlinter]`` in
pyproject.toml, run by ``lint-imports`` in CI); ``obj._name`` of another module
is ruff's SLF001."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import grimp

PACKAGE = Path(__file__).resolve().parents[2] / "src" / "gpuwarden"
#: job code the broker runs as processes, never imports: not part of the layout
SHIPPED_MODULES = PACKAGE / "modules"
MAX_FUNCTION_LINES = 80


def package_files() -> Iterator[Path]:
    for path in sorted(PACKAGE.rglob("*.py")):
        if SHIPPED_MODULES not in path.parents:
            yield path


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_between_modules() -> None:
    built = grimp.build_graph("gpuwarden", include_external_packages=False)
    modules = {m for m in built.modules if not m.startswith("gpuwarden.modules")}
    # a package's __init__ is not a module that imports its children here
    graph = {
        m: {i for i in built.find_modules_directly_imported_by(m) if i in modules} for m in modules
    }
    assert len(graph) > 50  # the whole package was read
    assert cycles(graph) == []


def private_imports(source: str, name: str) -> Iterator[str]:
    for node in ast.walk(ast.parse(source, filename=name)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("gpuwarden"):
            for alias in node.names:
                if alias.name.startswith("_") and not alias.name.startswith("__"):
                    yield f"{name}:{node.lineno}: {node.module}.{alias.name}"


def test_the_private_import_check_sees_one() -> None:
    source = "from gpuwarden.store.sqlite import SqliteStore, _example\n"
    assert list(private_imports(source, "x.py")) == ["x.py:1: gpuwarden.store.sqlite._example"]
    assert list(private_imports("from gpuwarden import __version__\n", "x.py")) == []


def test_no_private_name_imported_from_another_module() -> None:
    found = [
        line
        for path in package_files()
        for line in private_imports(path.read_text(), str(path.relative_to(PACKAGE)))
    ]
    assert found == []


def long_functions(source: str, name: str) -> Iterator[str]:
    for node in ast.walk(ast.parse(source, filename=name)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            assert node.end_lineno is not None
            lines = node.end_lineno - node.lineno + 1
            if lines > MAX_FUNCTION_LINES:
                yield f"{name}:{node.lineno}: {node.name} ({lines} lines)"


def test_the_length_check_sees_a_long_function() -> None:
    body = "".join(f"    x = {i}\n" for i in range(MAX_FUNCTION_LINES))
    assert list(long_functions(f"def f():\n{body}", "x.py")) == ["x.py:1: f (81 lines)"]
    assert list(long_functions(f"def f():\n{body[: -len('    x = 79')]}", "x.py")) == []


def test_no_function_over_80_lines() -> None:
    files = list(package_files())
    assert len(files) > 50
    found = [
        line
        for path in files
        for line in long_functions(path.read_text(), str(path.relative_to(PACKAGE)))
    ]
    assert found == []
