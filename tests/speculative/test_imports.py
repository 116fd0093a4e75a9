"""flashdraft.speculative has no import cycle, not even through imports inside functions (which Python resolves late,
so such a cycle never fails at import time: it only hides which module depends on which)."""

from __future__ import annotations

import ast
from pathlib import Path

import flashdraft.speculative

PACKAGE = Path(flashdraft.speculative.__file__).parent


def module_name(path: Path, root: Path, package: str) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([package, *parts])


def import_graph(root: Path, package: str) -> dict[str, set[str]]:
    """Module -> the modules of `package` (the directory `root`) it imports anywhere in its source.

    `from p import name` counts as an import of `p.name` when that is a module of the package, else of `p`.
    """
    files = {module_name(path, root, package): path for path in sorted(root.rglob("*.py"))}
    graph: dict[str, set[str]] = {name: set() for name in files}
    for name, path in files.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:  # relative: from the module's own package, `level - 1` packages up
                    base = name.split(".") if is_package else name.split(".")[:-1]
                    base = base[: len(base) - (node.level - 1)]
                    origin = ".".join(base + ([node.module] if node.module else []))
                else:
                    origin = node.module
                targets = [
                    f"{origin}.{alias.name}" if f"{origin}.{alias.name}" in files else origin for alias in node.names
                ]
            else:
                continue
            graph[name].update(t for t in targets if t in files and t != name)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None (depth-first search)."""
    state: dict[str, str] = {}  # "open" while on the current path, "done" once fully explored
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_speculative_has_no_import_cycle():
    graph = import_graph(PACKAGE, "flashdraft.speculative")
    # The graph is the real one: the edges that used to close cycles through function-level imports are there.
    assert "flashdraft.speculative.engine.session" in graph["flashdraft.speculative.generate"]
    assert "flashdraft.speculative.engine.session" in graph["flashdraft.speculative.baselines"]
    assert "flashdraft.speculative.result" in graph["flashdraft.speculative.engine.session"]
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_the_finder_sees_a_cycle_through_a_function_level_import(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from pkg.a import f\n")
    (pkg / "a.py").write_text("def f():\n    from pkg.sub import b\n    return b.g()\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "b.py").write_text("from .. import a\n\ndef g():\n    return a\n")
    (pkg / "c.py").write_text("import pkg.a\n")
    graph = import_graph(pkg, "pkg")
    assert graph == {
        "pkg": {"pkg.a"},
        "pkg.a": {"pkg.sub.b"},
        "pkg.sub": set(),
        "pkg.sub.b": {"pkg.a"},
        "pkg.c": {"pkg.a"},
    }
    assert find_cycle(graph) == ["pkg.a", "pkg.sub.b", "pkg.a"]
    graph["pkg.sub.b"].clear()
    assert find_cycle(graph) is None
