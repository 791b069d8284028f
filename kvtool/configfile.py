"""Config files: one reader for every TOML (and JSON) file kvtool takes.

``read_config(path)`` parses a file and returns a :class:`ConfigDocument`: the data plus a
locator that maps a key path such as ``("subsystem", 0, "namespace", 1, "nsid")`` to the
line it is on, so that every error — syntax or meaning — names the file, the line and the
key (``ConfigDocument.error``). ``tomllib`` and ``json`` report lines only for syntax
errors; the locators scan the text once, respecting tables and arrays of tables (TOML)
and nested objects and arrays (JSON). A path that is not found falls back to its longest
known prefix (the enclosing table).

Used by ``kvtool target`` configs (kvtool/target/loader.py), ``kvtool replay --tiers``
(kvtool/replay/config.py), custom model geometries (kvtool/geometry/custom.py) and the
emulator's JSON config (emulator/nvmetcp/config.py).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

from kvtool.errors import InputError

Kind = Literal["toml", "json"]
_HEADER_AOT = re.compile(r"^\s*\[\[\s*(.+?)\s*\]\]\s*(#.*)?$")
_HEADER = re.compile(r"^\s*\[\s*(.+?)\s*\]\s*(#.*)?$")
_KEY = re.compile(
    r"""^\s*((?:"(?:[^"\\]|\\.)*"|'[^']*'|[A-Za-z0-9_-]+)(?:\s*\.\s*(?:"(?:[^"\\]|\\.)*"|'[^']*'|[A-Za-z0-9_-]+))*)\s*="""
)
_INLINE_KEY = re.compile(r"""[{,]\s*("(?:[^"\\]|\\.)*"|[A-Za-z0-9_-]+)\s*=""")
_STRING = re.compile(r""""(?:[^"\\]|\\.)*"|'[^']*'""")

KeyPath = tuple[str | int, ...]


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


class _Locator:
    """Key path → line number; a path with no line of its own takes its nearest parent's."""

    _lines: dict[KeyPath, int]

    def line(self, path: Sequence[str | int]) -> int | None:
        p = tuple(path)
        while p:
            if p in self._lines:
                return self._lines[p]
            p = p[:-1]
        return None


class TomlLocator(_Locator):
    """Key path → line number for one TOML text."""

    def __init__(self, text: str) -> None:
        self._lines: dict[KeyPath, int] = {}
        self._aot_count: dict[KeyPath, int] = {}
        self._scan(text)


    def _resolve(self, parts: list[str]) -> KeyPath:
        """A header's dotted name → a path, entering the latest element of arrays of tables."""
        path: KeyPath = ()
        for part in parts:
            path = (*path, part)
            count = self._aot_count.get(path)
            if count:
                path = (*path, count - 1)
        return path

    def _scan(self, text: str) -> None:
        current: KeyPath = ()
        array_key: KeyPath | None = None  # inside a multi-line array
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


class _Open:
    """An object or array being scanned: where it is, and which member comes next."""

    def __init__(self, path: KeyPath, is_array: bool) -> None:
        self.path = path
        self.is_array = is_array
        self.at: str | int = 0
        self.expect_key = not is_array


class JsonLocator(_Locator):
    """Key path → line number for one JSON text (objects by key, arrays by index)."""

    def __init__(self, text: str) -> None:
        self._lines: dict[KeyPath, int] = {}
        self._scan(text)


    def _scan(self, text: str) -> None:
        stack: list[_Open] = []
        line, i, n = 1, 0, len(text)

        def value_path() -> KeyPath | None:
            if not stack:
                return None
            top = stack[-1]
            return None if top.expect_key else (*top.path, top.at)

        while i < n:
            ch = text[i]
            if ch == "\n":
                line += 1
            elif ch == '"':
                j = i + 1
                while j < n and text[j] != '"':
                    j += 2 if text[j] == "\\" else 1
                top = stack[-1] if stack else None
                if top is not None and top.expect_key:
                    top.at, top.expect_key = json.loads(text[i:j + 1]), False
                    self._lines.setdefault((*top.path, top.at), line)
                else:
                    self._mark(value_path(), line)
                i = j
            elif ch in "{[":
                path = value_path()
                self._mark(path, line)
                stack.append(_Open(path or (), ch == "["))
            elif ch in "}]":
                if stack:
                    stack.pop()
            elif ch == "," and stack:
                top = stack[-1]
                if top.is_array:
                    top.at = int(top.at) + 1
                else:
                    top.expect_key = True
            elif not ch.isspace() and ch != ":":
                self._mark(value_path(), line)
            i += 1

    def _mark(self, path: KeyPath | None, line: int) -> None:
        if path:
            self._lines.setdefault(path, line)


class Locator(Protocol):
    def line(self, path: Sequence[str | int]) -> int | None: ...


def field_name(path: Sequence[str | int]) -> str:
    """``("subsystem", 0, "nqn")`` → ``subsystem[0].nqn`` (how errors name a key)."""
    out = ""
    for p in path:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else p)
    return out


def parse_field_name(name: str) -> KeyPath:
    """The inverse of :func:`field_name`."""
    path: list[str | int] = []
    for m in re.finditer(r"\[(\d+)\]|([^.\[\]]+)", name):
        path.append(int(m.group(1)) if m.group(1) is not None else m.group(2))
    return tuple(path)


@dataclass
class ConfigDocument:
    """A parsed config file: its data and where each key is."""

    data: Any
    source: str | None
    kind: Kind
    locator: Locator

    def line(self, path: Sequence[str | int]) -> int | None:
        return self.locator.line(path)

    def error(self, message: str, path: Sequence[str | int] = ()) -> InputError:
        """An error naming the file, the key's line and the key (``path`` inside tables)."""
        return InputError(message, file=self.source, line=self.line(path) if path else None,
                          field=field_name(path) or None)

    def locate(self, exc: InputError) -> InputError:
        """``exc`` with the line of its field filled in (for errors raised without one)."""
        if exc.line is None and exc.field:
            exc.line = self.line(parse_field_name(exc.field))
            exc.file = exc.file or self.source
            exc.args = (exc._format(),)
        return exc


def parse_config_text(text: str, *, source: str | None = None, kind: Kind = "toml"
                      ) -> ConfigDocument:
    """Parse TOML or JSON text; a syntax error names the file and line."""
    if kind == "json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise InputError(f"invalid JSON: {exc.msg}", file=source, line=exc.lineno) from None
        return ConfigDocument(data, source, kind, JsonLocator(text))
    import tomllib  # here, not at the top: commands that read no TOML skip its import

    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        m = re.search(r"\(at line (\d+), column \d+\)", str(exc))
        msg = re.sub(r"\s*\(at line \d+, column \d+\)", "", str(exc))
        raise InputError(f"invalid TOML: {msg}", file=source,
                         line=int(m.group(1)) if m else None) from None
    return ConfigDocument(data, source, kind, TomlLocator(text))


def read_config(path: str | Path, *, kind: Kind | None = None) -> ConfigDocument:
    """Read and parse a config file (``kind`` from the suffix: ``.json`` is JSON, anything
    else TOML). A missing or unreadable file is bad input naming the file."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InputError("no such file", file=str(p)) from None
    except OSError as exc:
        raise InputError(f"cannot read: {exc.strerror}", file=str(p)) from None
    except UnicodeDecodeError as exc:
        raise InputError(f"not UTF-8 text (byte {exc.start})", file=str(p)) from None
    if kind is None:
        kind = "json" if p.suffix.lower() == ".json" else "toml"
    return parse_config_text(text, source=str(p), kind=kind)
