"""Layout rules a newcomer relies on: short modules, no import cycles, the layer order of docs/architecture.md (nothing
below the CLI imports it), no work log."""

import ast
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "flashdraft"
MAX_LINES = 400
# Spelt in pieces, so that this file does not match itself.
_WORD = "sess" + "ion"
WORK_LOG = re.compile(rf"{_WORD} [0-9]|{_WORD}-[0-9]|this {_WORD}", re.IGNORECASE)


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(modules: dict[str, ast.Module]) -> dict[str, set[str]]:
    """Module -> flashdraft modules it imports anywhere (function bodies too); `from X import Y` counts X.Y when
    Y is a submodule, else X; a name that is no module counts as its nearest enclosing module."""
    graph = {}
    for name, tree in modules.items():
        package = name if name in modules and _is_package(name, modules) else name.rpartition(".")[0]
        edges = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            else:
                continue
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    edges.add(target)
        graph[name] = edges
    return graph


def _is_package(name: str, modules: dict) -> bool:
    return any(other.startswith(name + ".") for other in modules)


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as [a, b, ..., a], or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node):
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def package_modules() -> dict[str, ast.Module]:
    return {module_name(p): ast.parse(p.read_text(), str(p)) for p in sorted(PACKAGE.rglob("*.py"))}


def test_find_cycle_finds_a_cycle_and_only_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_import_graph_counts_function_level_and_submodule_imports():
    modules = {
        "p": ast.parse(""),
        "p.a": ast.parse("def f():\n    from p import b\n"),
        "p.b": ast.parse("import os\nfrom p.a import f\n"),
    }
    graph = import_graph(modules)
    assert graph["p.a"] == {"p.b"} and "p.a" in graph["p.b"]
    assert find_cycle(graph) is not None


def test_import_graph_resolves_relative_imports_in_packages_and_modules():
    modules = {
        "p": ast.parse("from p.a import f\n"),
        "p.a": ast.parse("def f():\n    from p.sub import b\n    return b.g()\n"),
        "p.sub": ast.parse("from . import b\n"),
        "p.sub.b": ast.parse("from .. import a\n\ndef g():\n    return a\n"),
        "p.c": ast.parse("import p.a\n"),
    }
    graph = import_graph(modules)
    assert graph == {"p": {"p.a"}, "p.a": {"p.sub.b"}, "p.sub": {"p.sub.b"}, "p.sub.b": {"p.a"}, "p.c": {"p.a"}}
    assert find_cycle(graph) == ["p.a", "p.sub.b", "p.a"]
    graph["p.sub.b"].clear()
    assert find_cycle(graph) is None


def test_no_module_outside_the_kernels_is_over_400_lines():
    long = {
        str(p.relative_to(ROOT)): n
        for p in PACKAGE.rglob("*.py")
        if "kernels" not in p.relative_to(PACKAGE).parts and (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert long == {}


def test_no_import_cycle_among_flashdraft_modules():
    graph = import_graph(package_modules())
    # The graph is the real one: `from package import submodule` and `from module import name` are edges.
    assert "flashdraft.speculative.engine.session" in graph["flashdraft.speculative.generate"]
    assert "flashdraft.speculative.engine.session" in graph["flashdraft.speculative.baselines"]
    assert "flashdraft.speculative.result" in graph["flashdraft.speculative.engine.session"]
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_nothing_outside_the_cli_imports_it():
    graph = import_graph(package_modules())
    offenders = {
        name: sorted(t for t in targets if t == "flashdraft.cli" or t.startswith("flashdraft.cli."))
        for name, targets in graph.items()
        if not (name == "flashdraft.cli" or name.startswith("flashdraft.cli.") or name == "flashdraft.__main__")
    }
    assert {k: v for k, v in offenders.items() if v} == {}


ARCHITECTURE = ROOT / "docs" / "architecture.md"


def documented_layers(text: str) -> list[set[str]]:
    """The layers of the diagram under "## The layers", top first: each line's leading `name/` and `name.py` words
    (up to its description) as flashdraft module names."""
    block = text.split("## The layers", 1)[1].split("```", 2)[1]
    layers = []
    for line in block.splitlines():
        names = []
        for word in line.split():
            if not re.fullmatch(r"[a-z_0-9]+(/|\.py)", word):
                break
            names.append("flashdraft." + word.removesuffix("/").removesuffix(".py"))
        if names:
            layers.append(set(names))
    return layers


def layer_of(module: str, layers: list[set[str]]) -> int | None:
    """0 for the top layer, 1 below it, ...; None for a module no layer names."""
    if module.endswith(".__main__"):  # `python -m flashdraft`: the CLI
        return 0
    if "." not in module:  # the root package (it imports versions only): the ground floor
        return len(layers) - 1
    top = ".".join(module.split(".")[:2])
    return next((depth for depth, names in enumerate(layers) if top in names), None)


def upward_imports(graph: dict[str, set[str]], layers: list[set[str]]) -> set[tuple[str, str]]:
    """(importer, imported) for every import of a module in a higher layer than the importer's."""
    return {
        (name, target)
        for name, targets in graph.items()
        for target in targets
        if layer_of(target, layers) < layer_of(name, layers)
    }


def test_documented_layers_are_read_as_written():
    text = "## The layers\n\n```\ncli/        the top\ntrain/  speculative/   loop\nio/  hub.py   the floor\n```\n"
    layers = documented_layers(text)
    assert layers == [
        {"flashdraft.cli"},
        {"flashdraft.train", "flashdraft.speculative"},
        {"flashdraft.io", "flashdraft.hub"},
    ]
    assert layer_of("flashdraft.train.loss.fused", layers) == 1 and layer_of("flashdraft.__main__", layers) == 0
    assert layer_of("flashdraft", layers) == 2 and layer_of("flashdraft.other", layers) is None


def test_upward_imports_finds_function_level_imports_up_the_layers():
    layers = [{"p.top"}, {"p.mid"}, {"p.low"}]
    modules = {
        "p.top": ast.parse("from p import mid, low\n"),
        "p.mid": ast.parse("import p.low\ndef f():\n    import p.top\n"),
        "p.low": ast.parse("def g():\n    from p.mid import f\n"),
    }
    assert upward_imports(import_graph(modules), layers) == {("p.mid", "p.top"), ("p.low", "p.mid")}


def test_every_module_imports_only_from_its_layer_or_below():
    """The layer rule of docs/architecture.md, over every import of every module, function bodies included."""
    layers = documented_layers(ARCHITECTURE.read_text())
    assert len(layers) == 4 and layers[0] == {"flashdraft.cli"}
    modules = package_modules()
    assert [name for name in modules if layer_of(name, layers) is None] == []  # every module has a layer
    assert upward_imports(import_graph(modules), layers) == set()


def test_the_work_log_pattern_matches_what_it_must():
    assert WORK_LOG.search(f"measured in {_WORD.title()} 12") and WORK_LOG.search(f"see THIS {_WORD.upper()}")
    assert not WORK_LOG.search("engine/session.py holds the Session class")


def test_no_tracked_file_speaks_of_work_sessions():
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout.split(b"\0")
    hits = []
    for name in filter(None, files):
        path = ROOT / name.decode()
        if not path.is_file():
            continue
        data = path.read_bytes()
        if b"\0" in data[:8192]:
            continue  # binary
        hits += [
            f"{name.decode()}:{i}"
            for i, line in enumerate(data.decode(errors="replace").splitlines(), 1)
            if WORK_LOG.search(line)
        ]
    assert hits == []
