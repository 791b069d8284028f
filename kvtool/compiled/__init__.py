"""The serving model's hot modules compiled with mypyc (issue 40): an optional build, kept
outside the source tree, used only while it matches the sources.

:data:`MODULES` are compiled together (one mypyc group) by ``make compiled``
(``python -m kvtool.compiled build``, which needs mypy: the ``test`` extra has it) into a
cache directory, ``/var/tmp/kvtool-compiled`` (``KVTOOL_COMPILED_DIR``), one entry per
:func:`source_key`: the digest of the compiled modules' sources and of the interpreter's
extension-module ABI (:mod:`kvtool.compiled.build`; a build keeps the newest few entries).
Nothing is ever written next to a ``.py`` file: a stale ``.so`` beside its source would win
the import.

At ``import kvtool``, :func:`install` puts a finder in front of the import system when the
cache directory exists (one ``stat``; this module imports nothing that ``kvtool``'s
start-up does not: tests/cli/test_startup_imports.py). When one of :data:`MODULES` is first imported the
finder looks up the entry for the sources as they are now and checks the rest of what mypy
read to compile them (every kvtool module they import, directly or not: a ``Final``
constant of theirs is compiled in) against the digests the build recorded. The entry is
used only when all match; otherwise every module stays pure Python. So an edit of any of
those sources, in an editable install, falls back to the pure modules until the next
``make compiled``; it never runs compiled code of other sources.

``KVTOOL_COMPILED``: unset or ``auto`` (the above), ``0`` (pure Python always; the test
suite's default), ``1`` (a matching build is required: importing one of :data:`MODULES`
without it is an ``ImportError``).

The compiled modules give the same reports, byte for byte, as the pure ones
(``tests/serving/test_compiled.py``). What mypyc changes that the sources must respect:
their classes are native (no instance attributes outside the class's own, no methods
patched on an instance, no Python subclass of a compiled class: a subclass is compiled
too), annotations are checked at run time, a tuple of a fixed shape is a value (``is``
between two reads of it is false), and closures of one function share one environment
(a closure that calls a sibling closure holds it in a reference cycle).
"""

from __future__ import annotations

import os
import sys
from importlib.machinery import EXTENSION_SUFFIXES, ExtensionFileLoader, ModuleSpec
from types import ModuleType

MODULES: tuple[str, ...] = (
    "kvtool.serving.engine",
    "kvtool.serving.sim",
    "kvtool.serving.kvpool",
    "kvtool.serving.lanes",
    "kvtool.serving.links",
    "kvtool.serving.roofline",
    "kvtool.serving.load",
    "kvtool.serving.report",
    "kvtool.serving.mockerstep",  # subclasses roofline's StepModel
    "kvtool.serving.serveorder",  # subclasses sim's TierStack
    "kvtool.cache.tier",
    "kvtool.cache.policies.lru",
    "kvtool.cache.policies.lru_tail_first",  # subclasses lru's LruPolicy
)
"""The compiled modules: the serving model's event loop, engines, pool, flows, step time,
load and report, and the tier and LRU policy its tiers evict with."""

GROUP = "kvtool_compiled"
"""The mypyc group: its shared library is the top-level module ``kvtool_compiled__mypyc``."""
FORMAT = 1
"""The layout of a cache entry (part of its key)."""
DEFAULT_DIR = "/var/tmp/kvtool-compiled"
MANIFEST = "manifest"
"""An entry's manifest: lines of ``kind<TAB>name<TAB>value``: ``file`` (a module's
extension file, relative to the entry), ``module`` and ``dependency`` (a source's digest),
``info``."""
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
"""The directory that holds this ``kvtool`` package (a checkout, or site-packages)."""
_NAMES = frozenset((*MODULES, f"{GROUP}__mypyc"))


def cache_dir() -> str:
    return os.environ.get("KVTOOL_COMPILED_DIR") or DEFAULT_DIR


def source_path(module: str, root: str = ROOT) -> str:
    """The source file of kvtool module ``module`` under ``root`` (a package's
    ``__init__.py``), whether it exists or not."""
    base = os.path.join(root, *module.split("."))
    init = os.path.join(base, "__init__.py")
    return init if os.path.isfile(init) else base + ".py"


def _blake2b() -> type:
    try:
        from _blake2 import blake2b  # CPython's own: hashlib loads OpenSSL (3 ms)
    except ImportError:  # pragma: no cover - another Python
        from hashlib import blake2b
    return blake2b


def digest(path: str) -> str:
    with open(path, "rb") as f:
        return str(_blake2b()(f.read(), digest_size=16).hexdigest())


def source_key(root: str = ROOT) -> str:
    """The cache entry's name for the sources under ``root``: the compiled modules' text,
    the extension suffix (interpreter and ABI) and :data:`FORMAT`."""
    h = _blake2b()(f"{FORMAT} {GROUP} {EXTENSION_SUFFIXES[0]}".encode(), digest_size=12)
    for m in MODULES:
        h.update(f"\0{m}\0".encode())
        with open(source_path(m, root), "rb") as f:
            h.update(f.read())
    return str(h.hexdigest())


def read_manifest(entry: str) -> dict[str, dict[str, str]]:
    """An entry's manifest by kind, then name (:data:`MANIFEST`)."""
    out: dict[str, dict[str, str]] = {"file": {}, "module": {}, "dependency": {}, "info": {}}
    with open(os.path.join(entry, MANIFEST)) as f:
        for line in f:
            kind, name, value = line.rstrip("\n").split("\t")
            out[kind][name] = value
    return out


def _private(path: str) -> bool:
    """Whether ``path`` is a directory of this user's that no one else may write: code is
    loaded from it."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return (st.st_mode & 0o170000 == 0o040000 and st.st_uid == os.getuid()
            and not st.st_mode & 0o022)


def matching_entry(root: str = ROOT, cache: str | None = None) -> tuple[str | None, str]:
    """The cache entry built from the sources under ``root`` as they are now, or ``None``
    and why not."""
    cache = cache or cache_dir()
    entry = os.path.join(cache, source_key(root))
    if not (_private(cache) and _private(entry)):
        return None, f"no build of these sources in {cache} (make compiled)"
    try:
        manifest = read_manifest(entry)
    except (OSError, ValueError, KeyError):
        return None, f"{entry}: no manifest (an unfinished build?)"
    for module, want in manifest["dependency"].items():
        path = source_path(module, root)
        if not os.path.isfile(path) or digest(path) != want:
            return None, f"{entry}: built against another {module} (make compiled)"
    if set(manifest["file"]) != _NAMES:
        return None, f"{entry}: built for other modules (make compiled)"
    return entry, ""


class _Finder:
    """Finds :data:`MODULES` (and the group's shared library) in the matching cache entry
    (a meta path finder)."""

    def __init__(self, required: bool) -> None:
        self.required = required
        self.files: dict[str, str] | None = None
        self.why = ""

    def entry_files(self) -> dict[str, str]:
        if self.files is None:
            self.files = {}
            entry, self.why = matching_entry()
            if entry is not None:
                self.files = {m: os.path.join(entry, f)
                              for m, f in read_manifest(entry)["file"].items()}
        return self.files

    def find_spec(self, fullname: str, path: object = None, target: ModuleType | None = None
                  ) -> ModuleSpec | None:
        if fullname not in _NAMES:
            return None
        file = self.entry_files().get(fullname)
        if file is None:
            if self.required:
                raise ImportError(f"KVTOOL_COMPILED=1: {self.why}", name=fullname)
            return None
        spec = ModuleSpec(fullname, ExtensionFileLoader(fullname, file), origin=file)
        spec.has_location = True
        return spec


def install() -> None:
    """Put the finder in front of the import system (``import kvtool`` calls this), unless
    ``KVTOOL_COMPILED=0`` or there is no cache directory (and it is not required)."""
    mode = os.environ.get("KVTOOL_COMPILED", "auto")
    if mode == "0" or any(isinstance(f, _Finder) for f in sys.meta_path):
        return
    if mode != "1" and not os.path.isdir(cache_dir()):
        return
    sys.meta_path.insert(0, _Finder(required=mode == "1"))


def active() -> bool:
    """Whether the compiled modules are the ones imported (or would be)."""
    return any(isinstance(f, _Finder) and f.entry_files() for f in sys.meta_path)
