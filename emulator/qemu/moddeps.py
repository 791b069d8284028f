"""Resolve kernel-module load order without kmod/depmod.

Reads the ``.modinfo`` strings (``depends=``, ``softdep=pre:``) straight out of the ``.ko``
files of an unpacked kernel package (the Debian .deb ships no modules.dep) and returns the
module paths, relative to the modules directory, dependencies first.

Adapted from the qemu-nvmet recipe (../shared/reference/qemu-nvmet/moddeps.py, kvtool project).
"""

from __future__ import annotations

import gzip
import lzma
import os
import re
import subprocess
from pathlib import Path

# Debian's 6.12 packages ship compressed modules (.ko.xz); busybox insmod needs plain .ko.
SUFFIXES = (".ko", ".ko.xz", ".ko.zst", ".ko.gz")


def plain(relpath: str) -> str:
    """The module's path with the compression suffix dropped (``….ko``)."""
    for suffix in SUFFIXES[1:]:
        if relpath.endswith(suffix):
            return relpath[: -len(suffix) + 3]
    return relpath


def read_module(path: Path) -> bytes:
    """The uncompressed bytes of a ``.ko``, ``.ko.xz``, ``.ko.zst`` or ``.ko.gz`` module."""
    data = path.read_bytes()
    name = path.name
    if name.endswith(".xz"):
        return lzma.decompress(data)
    if name.endswith(".gz"):
        return gzip.decompress(data)
    if name.endswith(".zst"):
        return subprocess.run(["zstd", "-dcq"], input=data, capture_output=True,
                              check=True).stdout
    return data


class ModuleNotFound(LookupError):
    """A requested module (or a hard dependency) is neither shipped nor built in."""


def _norm(name: str) -> str:
    return name.replace("-", "_")


def _index(moddir: Path) -> dict[str, str]:
    idx: dict[str, str] = {}
    for root, _dirs, files in os.walk(moddir / "kernel"):
        for f in files:
            suffix = next((x for x in SUFFIXES if f.endswith(x)), None)
            if suffix is not None:
                idx[_norm(f[: -len(suffix)])] = os.path.relpath(os.path.join(root, f), moddir)
    return idx


def _modinfo(path: Path) -> tuple[list[str], list[str]]:
    data = read_module(path)
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
        builtin = {_norm(os.path.basename(plain(line.strip()))[:-3]) for line in bfile.open()}
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
