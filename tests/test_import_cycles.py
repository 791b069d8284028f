"""Imports in kvtool/ and emulator/ go down the layer table, and never in a cycle
(docs/architecture.md, "Layers").

Every import counts: at module level, inside a function (a lazy import is still a
dependency) and under ``if TYPE_CHECKING:`` (a type-only import is a dependency of the
design: when a lower module needs a higher one's type, give it a Protocol of what it uses,
as emulator/nvmetcp/queue.py does for the command handlers). A cycle means a module is
both a leaf and the hub that wires things together: split the leaf out (as
kvtool/store/io.py is split from the engine factory in kvtool/store/engine.py).
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import REPO
from tests.helpers.layers import LAYERS

PACKAGES = ("kvtool", "emulator")


def _module(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, name: str, known: set[str]) -> set[str]:
    found: set[str] = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]

    class Visitor(ast.NodeVisitor):
        def visit_Import(self, node: ast.Import) -> None:
            found.update(a.name for a in node.names)

        def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            for a in node.names:
                full = f"{module}.{a.name}"
                found.add(full if full in known else module)

    Visitor().visit(ast.parse(path.read_text(), filename=str(path)))
    out = set()
    for m in found:
        while m and m not in known:
            m = m.rpartition(".")[0]
        if m and m != name:
            out.add(m)
    return out


def import_graph() -> dict[str, set[str]]:
    paths = {_module(p): p for pkg in PACKAGES for p in (REPO / pkg).rglob("*.py")}
    known = set(paths)
    return {m: _imports(p, m, known) for m, p in paths.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def test_the_finder_finds_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles() -> None:
    graph = import_graph()
    assert "kvtool.store.engine" in graph and "kvtool.store.io" in graph["kvtool.store.engine"]
    found = cycles(graph)
    detail = "; ".join(" ↔ ".join(c) for c in found)
    assert not found, f"import cycles: {detail}"


def layer_of(layers: tuple[tuple[str, ...], ...]) -> dict[str, int]:
    return {unit: i for i, units in enumerate(layers) for unit in units}


def unit_of(module: str, layer: dict[str, int]) -> str | None:
    """The unit ``module`` belongs to: the longest unit name that is it or a package
    above it."""
    m = module
    while m and m not in layer:
        m = m.rpartition(".")[0]
    return m or None


def upward(graph: dict[str, set[str]], layers: tuple[tuple[str, ...], ...]) -> list[str]:
    """Imports that do not go down the table: ``a -> b (layer i -> layer j)``, and modules
    that no unit holds."""
    layer = layer_of(layers)
    out = []
    for a in sorted(graph):
        ua = unit_of(a, layer)
        if ua is None:
            out.append(f"{a}: in no layer")
            continue
        for b in sorted(graph[a]):
            ub = unit_of(b, layer)
            if ub is None or ub == ua:
                continue
            if layer[ub] >= layer[ua]:
                out.append(f"{a} -> {b} (layer {layer[ua]} {ua} -> layer {layer[ub]} {ub})")
    return out


def test_the_layer_check_finds_an_upward_or_sideways_import() -> None:
    layers = (("low",), ("mid", "side"), ("top",))
    graph = {"low.a": set(), "mid.b": {"low.a"}, "side.c": set(), "top.d": {"mid.b", "side.c"}}
    assert upward(graph, layers) == []
    graph["low.a"] = {"top.d"}
    graph["mid.b"] = {"low.a", "side.c"}
    graph["stray"] = set()
    assert upward(graph, layers) == [
        "low.a -> top.d (layer 0 low -> layer 2 top)",
        "mid.b -> side.c (layer 1 mid -> layer 1 side)",
        "stray: in no layer"]


def test_imports_go_down_the_layer_table() -> None:
    found = upward(import_graph(), LAYERS)
    assert not found, "imports against the layer table:\n" + "\n".join(found)
