"""Find the line of a key in a TOML document.

``tomllib`` reports lines only for syntax errors; a semantic error (a duplicate NSID, an
unknown key) must still name the line. :class:`Locator` scans the text once and maps key
paths such as ``("subsystem", 0, "namespace", 1, "nsid")`` to 1-based line numbers, with
arrays of tables numbered in document order, exactly as ``tomllib`` builds its lists.
A path that is not found falls back to its longest known prefix (the enclosing table).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

_HEADER_AOT = re.compile(r"^\s*\[\[\s*(.+?)\s*\]\]\s*(#.*)?$")
_HEADER = re.compile(r"^\s*\[\s*(.+?)\s*\]\s*(#.*)?$")
_KEY = re.compile(
    r"""^\s*((?:"(?:[^"\\]|\\.)*"|'[^']*'|[A-Za-z0-9_-]+)(?:\s*\.\s*(?:"(?:[^"\\]|\\.)*"|'[^']*'|[A-Za-z0-9_-]+))*)\s*="""
)
_INLINE_KEY = re.compile(r"""[{,]\s*("(?:[^"\\]|\\.)*"|[A-Za-z0-9_-]+)\s*=""")
_STRING = re.compile(r""""(?:[^"\\]|\\.)*"|'[^']*'""")

Path_ = tuple[str | int, ...]


def _split_dotted(text: str) -> list[str]:
    parts: list[str] = []
    for m in re.finditer(r""""((?:[^"\\]|\\.)*)"|'([^']*)'|([A-Za-z0-9_-]+)""", text):
        parts.append(next(g for g in m.groups() if g is not None))
    return parts


def _strip_comment(line: str) -> str:
    out, quote = [], ""
    for ch in line:
        if quote:
            if ch == quote:
                quote = ""
        elif ch in "\"'":
            quote = ch
        elif ch == "#":
            break
        out.append(ch)
    return "".join(out)


class Locator:
    """Key path → line number for one TOML text."""

    def __init__(self, text: str) -> None:
        self._lines: dict[Path_, int] = {}
        self._aot_count: dict[Path_, int] = {}
        self._scan(text)

    def line(self, path: Sequence[str | int]) -> int | None:
        p = tuple(path)
        while p:
            if p in self._lines:
                return self._lines[p]
            p = p[:-1]
        return None

    def _resolve(self, parts: list[str]) -> Path_:
        """A header's dotted name → a path, entering the latest element of arrays of tables."""
        path: Path_ = ()
        for part in parts:
            path = (*path, part)
            count = self._aot_count.get(path)
            if count:
                path = (*path, count - 1)
        return path

    def _scan(self, text: str) -> None:
        current: Path_ = ()
        array_key: Path_ | None = None  # inside a multi-line array
        array_index = 0
        depth = 0
        for lineno, raw in enumerate(text.splitlines(), start=1):
            line = _strip_comment(raw)
            if array_key is not None:
                for _ in _STRING.finditer(line):
                    self._lines.setdefault((*array_key, array_index), lineno)
                    array_index += 1
                depth += line.count("[") - line.count("]")
                if depth <= 0:
                    array_key = None
                continue
            m = _HEADER_AOT.match(line)
            if m:
                parts = _split_dotted(m.group(1))
                parent = self._resolve(parts[:-1])
                key = (*parent, parts[-1])
                index = self._aot_count.get(key, 0)
                self._aot_count[key] = index + 1
                current = (*key, index)
                self._lines[current] = lineno
                self._lines.setdefault(key, lineno)
                continue
            m = _HEADER.match(line)
            if m and not _KEY.match(line):
                parts = _split_dotted(m.group(1))
                current = (*self._resolve(parts[:-1]), parts[-1])
                self._lines[current] = lineno
                continue
            m = _KEY.match(line)
            if not m:
                continue
            key_path = (*current, *_split_dotted(m.group(1)))
            self._lines[key_path] = lineno
            rest = line[m.end():]
            for sub in _INLINE_KEY.finditer(rest):
                self._lines.setdefault((*key_path, _split_dotted(sub.group(1))[0]), lineno)
            opened = rest.count("[") - rest.count("]")
            if rest.lstrip().startswith("["):
                index = 0
                for _ in _STRING.finditer(rest):
                    self._lines.setdefault((*key_path, index), lineno)
                    index += 1
                if opened > 0:
                    array_key, array_index, depth = key_path, index, opened
