"""mypy lets through only the missing imports of third-party packages that ship no types
(pyproject.toml): a global ``ignore_missing_imports`` let a stale first-party import (a
module renamed away) pass the type check."""

from __future__ import annotations

import tomllib

from tests.conftest import REPO

FIRST_PARTY = ("kvtool", "emulator", "tests", "bench")


def test_missing_imports_are_ignored_only_for_named_third_party_packages() -> None:
    mypy = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["mypy"]
    assert "ignore_missing_imports" not in mypy, "no global ignore_missing_imports"
    for override in mypy.get("overrides", []):
        if not override.get("ignore_missing_imports"):
            continue
        modules = override["module"]
        modules = [modules] if isinstance(modules, str) else modules
        for m in modules:
            assert m.split(".")[0] not in FIRST_PARTY, f"first-party {m} let through"
            assert m.split(".")[0] not in ("*", ""), f"{m}: name the package"
