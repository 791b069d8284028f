"""Conventions of the test suite itself (DEVELOPERS.md; docs/architecture.md, "Tests").

* A hypothesis test with hundreds of examples is marked ``slow``, so the fast subset
  (``-m "not slow"``) stays fast.
* No test module imports helpers from another test module: shared helpers live in a
  ``conftest.py`` (fixtures) or in the ``tests/helpers`` package.
* Text users and contributors read (code, --help, docs) cites pages they have (docs/, the
  specifications), never the product brief or research notes outside the repository.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import REPO

TESTS = REPO / "tests"
MANY_EXAMPLES = 100


def _modules() -> list[Path]:
    return sorted(p for p in TESTS.rglob("*.py") if "helpers" not in p.relative_to(TESTS).parts)


def _decorator_names(fn: ast.FunctionDef) -> list[str]:
    return [ast.unparse(d) for d in fn.decorator_list]


def test_hypothesis_tests_with_many_examples_are_slow() -> None:
    unmarked = []
    for path in _modules():
        tree = ast.parse(path.read_text())
        module_slow = any("mark.slow" in ast.unparse(n) for n in tree.body
                          if isinstance(n, ast.Assign)
                          and any(getattr(t, "id", "") == "pytestmark" for t in n.targets))
        for fn in ast.walk(tree):
            if not isinstance(fn, ast.FunctionDef):
                continue
            for d in fn.decorator_list:
                if not (isinstance(d, ast.Call) and ast.unparse(d.func).endswith("settings")):
                    continue
                for kw in d.keywords:
                    if (kw.arg == "max_examples" and isinstance(kw.value, ast.Constant)
                            and kw.value.value >= MANY_EXAMPLES and not module_slow
                            and not any("mark.slow" in n for n in _decorator_names(fn))):
                        unmarked.append(f"{path.relative_to(REPO)}::{fn.name}")
    assert not unmarked, f"hypothesis tests with ≥ {MANY_EXAMPLES} examples not marked slow: " \
                         f"{unmarked}"


def test_no_test_imports_another_test_module() -> None:
    bad = []
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            names: list[str] = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] if not node.level else []
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            for name in names:
                parts = name.split(".")
                if parts[0] != "tests" or len(parts) < 2:
                    continue
                if parts[-1] == "conftest" or parts[1] == "helpers":
                    continue
                bad.append(f"{path.relative_to(REPO)} imports {name}")
    assert not bad, "import shared helpers from tests/helpers/ or a conftest: " + "; ".join(bad)


def test_no_citations_of_documents_users_do_not_have() -> None:
    bad = []
    roots = [REPO / d for d in ("kvtool", "emulator", "bench", "tests", "docs", "fixtures")]
    files = [REPO / "README.md", REPO / "BENCHMARKS.md"]
    files += [p for r in roots for p in r.rglob("*") if p.suffix in (".py", ".md", ".toml")]
    for path in files:
        if path == Path(__file__):
            continue
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if "BRIEF §" in line or "nvmeof.md §" in line or "semantics §" in line:
                bad.append(f"{path.relative_to(REPO)}:{n}")
    assert not bad, "cite docs/ or a specification instead: " + ", ".join(bad)


def test_no_module_shadows_the_standard_library() -> None:
    """tests/ and bench/ hold scripts run by their path, which puts their directory first on
    ``sys.path``: a module there named like the standard library's (``secrets.py``) replaces
    it for every library the script imports (torch then fails far from the cause). (Package
    modules such as kvtool/store/io.py are only reached as ``kvtool.store.io``.)"""
    import sys

    shadows = [str(p.relative_to(REPO)) for top in ("tests", "bench")
               for p in (REPO / top).rglob("*.py") if p.stem in sys.stdlib_module_names]
    assert not shadows, shadows
