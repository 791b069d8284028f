"""docs/architecture.md cannot drift from the code: its package map names every package
and module of kvtool/ and emulator/ (and none that is gone), its layer table is the one
tests/test_import_cycles.py enforces, the library never prints (only kvtool/cli/ writes
to the process's stdout and stderr), and no function of kvtool/ is longer than
``MAX_FUNCTION_LINES``."""

from __future__ import annotations

import ast
import re

from tests.conftest import REPO
from tests.helpers.layers import LAYERS

DOC = REPO / "docs" / "architecture.md"
ROOTS = ("kvtool", "emulator")
MAX_FUNCTION_LINES = 80
"""The longest a function of kvtool/ may be, from its ``def`` to its last line (decorators
not counted; issue 39)."""


def _section(title: str) -> list[list[str]]:
    """The rows (cells) of the first table after the heading ``## title``."""
    text = DOC.read_text()
    start = text.index(f"## {title}\n")
    rows = []
    for line in text[start:].splitlines()[1:]:
        if line.startswith("## "):
            break
        if line.startswith("|") and not set(line) <= set("|- "):
            rows.append([c.strip() for c in line.strip().strip("|").split("|")])
    return rows[1:]  # the header


def _ticked(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


def packages() -> dict[str, list[str]]:
    """Each package right under kvtool/ and emulator/ → its modules (paths below it, no
    .py, ``__init__`` left out)."""
    out = {}
    for root in ROOTS:
        for pkg in sorted((REPO / root).iterdir()):
            if (pkg / "__init__.py").exists():
                out[f"{root}/{pkg.name}"] = sorted(
                    str(p.relative_to(pkg).with_suffix("")) for p in pkg.rglob("*.py")
                    if p.name != "__init__.py")
    return out


def top_modules() -> list[str]:
    return sorted(f"{root}/{p.name}" for root in ROOTS for p in (REPO / root).glob("*.py")
                  if f"{root}/{p.name}" != "emulator/__init__.py")


def test_the_package_map_names_every_package_and_module() -> None:
    rows = _section("Package map")
    named = {name: row for row in rows for name in _ticked(row[0])}
    problems = []
    for pkg, modules in packages().items():
        if pkg not in named:
            problems.append(f"no row for {pkg}")
            continue
        listed = set(_ticked(named[pkg][1]))
        problems += [f"{pkg}: module {m} not in its row" for m in modules if m not in listed]
        problems += [f"{pkg}: row names {m}, which is gone" for m in sorted(listed)
                     if m not in modules]
    problems += [f"no row for {m}" for m in top_modules() if m not in named]
    problems += [f"row for {n}, which is gone" for n in named
                 if n != "bench/" and not (REPO / n).exists()]
    assert not problems, "docs/architecture.md, Package map:\n" + "\n".join(problems)


def test_the_layer_table_is_the_enforced_one() -> None:
    rows = _section("Data flow")  # the layer table follows the data-flow diagram
    drawn = {int(row[0]): tuple(u for u in _ticked(re.sub(r"\([^)]*\)", "", row[1]))
                                if u.startswith(ROOTS))
             for row in rows if row[0].isdigit()}
    want = dict(enumerate(LAYERS))
    for i, units in want.items():
        assert set(drawn.get(i, ())) == set(units), \
            f"docs/architecture.md layer {i}: {drawn.get(i)} but tests enforce {units}"
    assert set(drawn) == set(want)


_STREAMS = {"stdout", "stderr", "__stdout__", "__stderr__"}


def _is_main_guard(node: ast.stmt) -> bool:
    """``if __name__ == "__main__":`` at a module's top level."""
    return (isinstance(node, ast.If) and isinstance(node.test, ast.Compare)
            and isinstance(node.test.left, ast.Name) and node.test.left.id == "__name__"
            and any(isinstance(c, ast.Constant) and c.value == "__main__"
                    for c in node.test.comparators))


def prints(source: str) -> list[str]:
    """Where ``source`` calls ``print()`` or names ``sys.stdout``/``sys.stderr``
    (``LINE: what``), outside its ``if __name__ == "__main__":`` block.

    That block is a program (``python -m kvtool.cluster.driver``, ...), not the library: its
    stdout is the protocol its parent reads. The functions it calls return values or take
    callbacks, like everything the CLI calls."""
    tree = ast.parse(source)
    found: list[str] = []
    for top in tree.body:
        if _is_main_guard(top):
            continue
        for node in ast.walk(top):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                    and node.func.id == "print":
                found.append(f"{node.lineno}: print()")
            elif isinstance(node, ast.Attribute) and node.attr in _STREAMS \
                    and isinstance(node.value, ast.Name) and node.value.id == "sys":
                found.append(f"{node.lineno}: sys.{node.attr}")
            elif isinstance(node, ast.ImportFrom) and node.module == "sys" \
                    and any(a.name in _STREAMS for a in node.names):
                found.append(f"{node.lineno}: from sys import {node.names[0].name}")
    return found


def test_the_finder_finds_prints() -> None:
    src = ("import sys\nprint('x')\nsys.stderr.write('y')\nfrom sys import stdout\n"
           "def f(): return 1\nif __name__ == '__main__':\n    print(f())\n")
    assert prints(src) == ["2: print()", "3: sys.stderr", "4: from sys import stdout"]


def test_the_library_never_prints() -> None:
    """Progress goes through callbacks or logging, results are returned: the CLI
    (kvtool/cli/) alone decides what the user sees (docs/architecture.md)."""
    found = []
    for path in sorted((REPO / "kvtool").rglob("*.py")):
        rel = path.relative_to(REPO)
        if rel.parts[1] == "cli":
            continue
        found += [f"{rel}:{where}" for where in prints(path.read_text())]
    assert not found, "the library prints (return it, or take a callback):\n" + "\n".join(found)


def long_functions(source: str, limit: int) -> list[str]:
    """The functions and methods of ``source`` longer than ``limit`` lines, from ``def``
    to their last line (``LINE: NAME (N lines)``)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            assert node.end_lineno is not None
            length = node.end_lineno - node.lineno + 1
            if length > limit:
                found.append(f"{node.lineno}: {node.name} ({length} lines)")
    return found


def test_the_finder_finds_long_functions() -> None:
    src = ("def short():\n    return 1\n\n\nclass C:\n    @staticmethod\n"
           "    async def long():\n" + "        x = 1\n" * 3)
    assert long_functions(src, 3) == ["7: long (4 lines)"]  # the decorator is not counted
    assert long_functions(src, 4) == []


def test_no_function_is_over_the_limit() -> None:
    """A long function does several jobs: split it into named steps (docs/architecture.md)."""
    found = []
    for path in sorted((REPO / "kvtool").rglob("*.py")):
        rel = path.relative_to(REPO)
        found += [f"{rel}:{where}" for where in long_functions(path.read_text(),
                                                               MAX_FUNCTION_LINES)]
    assert not found, (f"functions over {MAX_FUNCTION_LINES} lines (split them into "
                       "helpers, one job each):\n" + "\n".join(found))
