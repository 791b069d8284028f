"""docs/architecture.md cannot drift from the code: its package map names every package
and module of kvtool/ and emulator/ (and none that is gone), and its layer table is the one
tests/test_import_cycles.py enforces."""

from __future__ import annotations

import re

from tests.conftest import REPO
from tests.helpers.layers import LAYERS

DOC = REPO / "docs" / "architecture.md"
ROOTS = ("kvtool", "emulator")


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
