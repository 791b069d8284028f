"""Resolve kernel-module load order without kmod/depmod.

Reads the ``.modinfo`` strings (``depends=``, ``softdep=pre:``) straight out of the ``.ko``
files of an unpacked kernel package (the Debian .deb ships no modules.dep) and returns the
module paths, relative to the modules directory, dependencies first.

Adapted from the qemu-nvmet recipe (../shared/reference/qemu-nvmet/moddeps.py, kvtool project).
"""

from __future__ import annotations

import os
import re
from pathlib import Path


class ModuleNotFound(LookupError):
    """A requested module (or a hard dependency) is neither shipped nor built in."""


def _norm(name: str) -> str:
    return name.replace("-", "_")


def _index(moddir: Path) -> dict[str, str]:
    idx: dict[str, str] = {}
    for root, _dirs, files in os.walk(moddir / "kernel"):
        for f in files:
            if f.endswith(".ko"):
                idx[_norm(f[:-3])] = os.path.relpath(os.path.join(root, f), moddir)
    return idx


def _modinfo(path: Path) -> tuple[list[str], list[str]]:
    data = path.read_bytes()
    deps: list[str] = []
    soft: list[str] = []
    m = re.search(rb"\x00depends=([^\x00]*)\x00", data)
    if m and m.group(1):
        deps = [_norm(d) for d in m.group(1).decode().split(",") if d]
    for m in re.finditer(rb"\x00softdep=pre: ([^\x00]*)\x00", data):
        soft += [_norm(d) for d in m.group(1).decode().split() if d]
    return deps, soft


def resolve(moddir: Path, names: list[str]) -> list[str]:
    """Module paths (relative to ``moddir``) for ``names`` and their dependencies, in load order.

    Soft pre-dependencies are included when shipped and skipped otherwise; a hard dependency
    that is neither shipped nor listed in ``modules.builtin`` raises ModuleNotFound.
    """
    idx = _index(moddir)
    builtin: set[str] = set()
    bfile = moddir / "modules.builtin"
    if bfile.exists():
        builtin = {_norm(os.path.basename(line.strip())[:-3]) for line in bfile.open()}
    order: list[str] = []
    seen: set[str] = set()

    def visit(name: str) -> None:
        name = _norm(name)
        if name in seen:
            return
        seen.add(name)
        if name not in idx:
            if name in builtin:
                return
            raise ModuleNotFound(f"kernel module not found in {moddir}: {name}")
        deps, soft = _modinfo(moddir / idx[name])
        for d in deps:
            visit(d)
        for d in soft:
            if d in idx:
                visit(d)
        order.append(idx[name])

    for n in names:
        visit(n)
    return order
