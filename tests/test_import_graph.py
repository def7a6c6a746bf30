"""The package's import graph has no circles: each module can be read after the ones it imports.
Reads every ``import`` in ``src/slipstream`` (module level and inside functions) with ast."""
from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"


def import_graph() -> dict[str, set[str]]:
    """{module: the slipstream modules it imports}, a package's ``__init__`` re-exports aside."""
    files = {}
    for f in (SRC / "slipstream").rglob("*.py"):
        name = ".".join(f.relative_to(SRC).with_suffix("").parts).removesuffix(".__init__")
        files[name] = f
    graph = {}
    for name, f in files.items():
        package = name if f.name == "__init__.py" else name.rpartition(".")[0]
        deps = set()
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = package.split(".")[:len(package.split(".")) - node.level + 1] if node.level else []
                module = ".".join(base + ([node.module] if node.module else []))
                for alias in node.names:
                    target = f"{module}.{alias.name}"
                    deps.add(target if target in files else module)
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names)
        graph[name] = {d for d in deps if d in files and d != name and not name.startswith(d + ".")}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
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

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_reader_finds_a_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_graph_is_read_across_layers():
    graph = import_graph()
    assert "slipstream.api_types.autoscaling" in graph["slipstream.operator.autoscaler"]
    assert "slipstream.kernels.cpu_build" in graph["slipstream.kernels.install"]


def test_no_module_imports_itself_through_others():
    assert circles(import_graph()) == []
