"""The mypyc build of :data:`kvtool.compiled.MODULES` into the cache (``make compiled``:
``python -m kvtool.compiled build``). Needs mypy (the ``test`` extra), gcc and Python's
headers (``make`` installs ``python3-dev`` and ``gcc``); about 40 s on 2 cores."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from kvtool.compiled import (
    GROUP,
    MANIFEST,
    MODULES,
    ROOT,
    _private,
    cache_dir,
    digest,
    matching_entry,
    source_key,
    source_path,
)

KEEP = 8
"""Entries a build keeps (the newest; one per version of the sources built: branches,
worktrees)."""

_SETUP = """\
from setuptools import setup
from mypyc.build import mypycify

setup(name="kvtool-compiled", ext_modules=mypycify({paths!r}, opt_level="3",
      multi_file=True, group_name={group!r}, target_dir={target!r}),
      script_args=["build_ext", "--build-lib", {out!r}, "--build-temp", {temp!r},
                   "--parallel", {jobs!r}])
"""


def dependencies(root: str = ROOT) -> list[str]:
    """The kvtool modules that :data:`~kvtool.compiled.MODULES` import, directly or not
    (every import: at module level, in a function, under ``TYPE_CHECKING``), and the
    packages above them: what mypy reads to compile them, besides themselves."""
    seen = set(MODULES)
    todo = list(MODULES)
    for m in MODULES:  # the packages above them
        parts = m.split(".")
        todo.extend(p for p in (".".join(parts[:i]) for i in range(1, len(parts)))
                    if p not in seen)
        seen.update(todo)
    while todo:
        tree = ast.parse(Path(source_path(todo.pop(), root)).read_bytes())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            else:
                continue
            for name in names:
                parts = name.split(".")
                for i in range(1, len(parts) + 1):
                    m = ".".join(parts[:i])
                    if (m == "kvtool" or m.startswith("kvtool.")) and m not in seen \
                            and os.path.isfile(source_path(m, root)):
                        seen.add(m)
                        todo.append(m)
    return sorted(seen - set(MODULES))


def build(python: str | None = None, root: str = ROOT, cache: str | None = None,
          jobs: int | None = None) -> str:
    """Compile :data:`~kvtool.compiled.MODULES` of the sources under ``root`` with mypyc
    (``python`` must have mypy, and be the interpreter version that will import them) into
    the cache entry for them, unless it is there already; returns the entry. The sources
    are copied first (the compiled modules and every kvtool module they import): the entry
    is built from exactly the text its key and manifest name."""
    cache = cache or cache_dir()
    have, _why = matching_entry(root, cache)
    if have is not None:
        return have
    os.makedirs(cache, mode=0o755, exist_ok=True)
    if not _private(cache):
        raise PermissionError(f"{cache}: not a directory of this user's that only it may write")
    key = source_key(root)
    work = Path(tempfile.mkdtemp(prefix=f".build-{key}-", dir=cache))
    try:
        src = work / "src"
        digests = _copy_sources(Path(root), src)
        if source_key(str(src)) != key:
            raise RuntimeError("the sources changed while they were copied: build again")
        out = work / "entry"
        files = _compile(python or sys.executable, src, work, out, jobs)
        version = subprocess.run([python or sys.executable, "-m", "mypy", "--version"],
                                 capture_output=True, text=True).stdout.strip()
        lines = [("file", m, f) for m, f in files.items()]
        lines += [("module" if m in MODULES else "dependency", m, d) for m, d in digests.items()]
        lines += [("info", "key", key), ("info", "mypyc", version),
                  ("info", "python", sys.version.split()[0])]
        (out / MANIFEST).write_text("".join(f"{k}\t{n}\t{v}\n" for k, n, v in lines))
        out.chmod(0o755)
        entry = Path(cache) / key
        if entry.exists():  # a stale entry of these sources (a dependency changed), or a
            os.rename(entry, work / "old")  # concurrent build's: replaced whole
        os.rename(out, entry)
        _prune(Path(cache), keep=entry)
        return str(entry)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _copy_sources(root: Path, src: Path) -> dict[str, str]:
    """Copy the compiled modules and their :func:`dependencies` from ``root`` to ``src``;
    their digests (of the copies)."""
    digests = {}
    for m in (*MODULES, *dependencies(str(root))):
        rel = Path(source_path(m, str(root))).relative_to(root)
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(root / rel, src / rel)
        digests[m] = digest(str(src / rel))
    return digests


def _compile(python: str, src: Path, work: Path, out: Path, jobs: int | None
             ) -> dict[str, str]:
    """mypyc over the compiled modules in ``src``, their extension modules into ``out``;
    each module's file, relative to ``out``."""
    paths = [str(Path(source_path(m, str(src))).relative_to(src)) for m in MODULES]
    script = _SETUP.format(paths=paths, group=GROUP, target=str(work / "c"), out=str(out),
                           temp=str(work / "o"), jobs=str(jobs or os.cpu_count() or 1))
    env = {**os.environ, "PYTHONPATH": "", "MYPY_CACHE_DIR": str(work / "mypy")}
    done = subprocess.run([python, "-c", script], cwd=src, env=env, capture_output=True,
                          text=True)
    if done.returncode:
        raise RuntimeError(f"mypyc failed:\n{done.stdout[-4000:]}{done.stderr[-4000:]}")
    files = {}
    for m in (*MODULES, f"{GROUP}__mypyc"):
        found = list(out.glob(m.replace(".", "/") + ".*.so"))
        if len(found) != 1:
            raise RuntimeError(f"mypyc built no {m} in {out}")
        files[m] = str(found[0].relative_to(out))
    return files


def _prune(cache: Path, keep: Path) -> None:
    entries = sorted((p for p in cache.iterdir() if (p / MANIFEST).is_file() and p != keep),
                     key=lambda p: p.stat().st_mtime, reverse=True)
    for old in entries[KEEP - 1:]:
        shutil.rmtree(old, ignore_errors=True)


def clean(cache: str | None = None) -> None:
    """Remove every cache entry."""
    shutil.rmtree(cache or cache_dir(), ignore_errors=True)
