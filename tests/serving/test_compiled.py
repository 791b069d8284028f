"""The serving model's hot modules compiled with mypyc (``kvtool.compiled``, ``make
compiled``) give the same reports as the pure ones, byte for byte, and a build is used only
while it matches the sources it was built from.

The build (about 40 s on 2 cores) goes to the cache directory as ``make compiled`` puts it
there (``KVTOOL_COMPILED_DIR``, else ``/var/tmp/kvtool-compiled``), once per version of the
sources; it needs mypy (the ``test`` extra)."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtool import compiled
from kvtool.compiled.build import build, dependencies
from tests.conftest import FIXTURES, REPO

pytestmark = pytest.mark.slow

TRACES = FIXTURES / "traces"
CLUSTERS = sorted((FIXTURES / "clusters").glob("*.toml"))


@pytest.fixture(scope="module")
def entry() -> Iterator[Path]:
    pytest.importorskip("mypyc", reason="needs mypy (the test extra has it)")
    yield Path(build())


def kvtool(args: list[str], mode: str, cache: Path | None = None) -> str:
    """``python -m kvtool --json ARGS`` from this tree with ``KVTOOL_COMPILED=mode``."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "KVTOOL_COMPILED": mode}
    if cache is not None:
        env["KVTOOL_COMPILED_DIR"] = str(cache)
    done = subprocess.run([sys.executable, "-m", "kvtool", "--json", *args], env=env,
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    return done.stdout


def commands() -> dict[str, list[str]]:
    """Timed replays (the one-engine case: lanes; event-driven and stepped engines; a
    closed loop; three tiers with a GPU pool) and every cluster fixture (P/D, NVMe-oF
    targets, Mooncake, connectors, the mocker's step time, shared GPUs) on a fixture trace."""
    conv = str(TRACES / "multiturn-8x12.jsonl")
    out = {
        "dram": ["replay", conv, "--simulate", "--dram", "64blk"],
        "dram exact-steps": ["replay", conv, "--simulate", "--dram", "64blk", "--exact-steps"],
        "gpu dram nvme concurrency": ["replay", conv, "--simulate", "--gpu", "24blk", "--dram",
                                      "48blk", "--nvme", "200blk", "--concurrency", "4"],
        "lru-tail-first": ["replay", str(TRACES / "bailian-sample.jsonl"), "--simulate",
                           "--dram", "32blk", "--policy", "lru-tail-first"],
    }
    for c in CLUSTERS:
        out[c.stem] = ["replay", conv, "--simulate", "--cluster", str(c)]
    return out


def test_compiled_and_pure_reports_are_the_same(entry: Path) -> None:
    differ = [name for name, args in commands().items()
              if kvtool(args, "1") != kvtool(args, "0")]
    assert not differ, f"compiled and pure reports differ: {differ}"


def test_the_compiled_modules_are_the_ones_imported(entry: Path) -> None:
    code = ("import importlib, kvtool.compiled as c; "
            "print(*(importlib.import_module(m).__file__ for m in c.MODULES))")
    env = {**os.environ, "PYTHONPATH": str(REPO), "KVTOOL_COMPILED": "1"}
    files = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                           text=True, check=True).stdout.split()
    assert len(files) == len(compiled.MODULES)
    assert all(Path(f).is_relative_to(entry) and f.endswith(".so") for f in files), files


def test_an_edited_source_falls_back_to_the_pure_modules(entry: Path, tmp_path: Path) -> None:
    """A copy of the tree matches the build; an edit of a compiled module (another key) or
    of a module one of them imports (the manifest's digest) does not: ``auto`` imports the
    pure module, ``1`` refuses."""
    tree = tmp_path / "tree"
    shutil.copytree(REPO / "kvtool", tree / "kvtool", ignore=shutil.ignore_patterns(
        "__pycache__", "*.so"))
    assert compiled.matching_entry(str(tree))[0] == str(entry)
    code = "import kvtool.serving.sim as m; print(m.__file__)"
    for edited in ("kvtool/serving/sim.py", "kvtool/units.py"):
        path = tree / edited
        text = path.read_text()
        path.write_text(text + "\n# edited\n")
        found, why = compiled.matching_entry(str(tree))
        assert found is None and "make compiled" in why
        env = {**os.environ, "PYTHONPATH": str(tree), "KVTOOL_COMPILED": "auto"}
        out = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path,
                             capture_output=True, text=True, check=True).stdout
        assert out.strip() == str(tree / "kvtool" / "serving" / "sim.py")
        env["KVTOOL_COMPILED"] = "1"
        refused = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path,
                                 capture_output=True, text=True)
        assert refused.returncode != 0 and "KVTOOL_COMPILED=1" in refused.stderr
        path.write_text(text)
    assert compiled.matching_entry(str(tree))[0] == str(entry)


def test_a_cache_others_may_write_is_not_used(entry: Path, tmp_path: Path) -> None:
    shared = tmp_path / "cache"
    shutil.copytree(entry, shared / entry.name)
    shared.chmod(0o755)
    assert compiled.matching_entry(cache=str(shared))[0] == str(shared / entry.name)
    shared.chmod(0o777)
    assert compiled.matching_entry(cache=str(shared))[0] is None


def test_no_python_subclass_of_a_compiled_class() -> None:
    """An interpreted class cannot inherit from a compiled one: a subclass of a class of
    :data:`kvtool.compiled.MODULES` is in one of them too (mypy need not be installed)."""
    defined: dict[str, set[str]] = {}
    trees = {}
    for path in (REPO / "kvtool").rglob("*.py"):
        parts = path.relative_to(REPO).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        trees[name] = ast.parse(path.read_text())
        defined[name] = {n.name for n in trees[name].body if isinstance(n, ast.ClassDef)}
    native = {(m, c) for m in compiled.MODULES for c in defined[m]}
    wrong = []
    for name, tree in trees.items():
        if name in compiled.MODULES:
            continue
        imported = {a.asname or a.name: (n.module, a.name) for n in ast.walk(tree)
                    if isinstance(n, ast.ImportFrom) and n.module for a in n.names}
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                wrong += [f"{name}.{node.name}" for b in node.bases
                          if isinstance(b, ast.Name) and imported.get(b.id) in native]
    assert not wrong, f"compile these too (kvtool.compiled.MODULES): {wrong}"


def test_the_dependencies_cover_what_mypy_reads() -> None:
    """The manifest's dependencies: every kvtool module the compiled ones import, however
    indirectly (an import added anywhere below them is covered without a list to keep)."""
    deps = set(dependencies())
    assert {"kvtool", "kvtool.serving", "kvtool.serving.router", "kvtool.units",
            "kvtool.cache.policies.base", "kvtool.compiled"} <= deps
    assert not deps & set(compiled.MODULES)
