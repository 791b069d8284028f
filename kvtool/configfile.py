"""Config files: one reader for every TOML (and JSON) file kvtool takes.

``read_config(path)`` parses a file and returns a :class:`ConfigDocument`: the data plus a
locator that maps a key path such as ``("subsystem", 0, "namespace", 1, "nsid")`` to the
line it is on, so that every error — syntax or meaning — names the file, the line and the
key (``ConfigDocument.error``). ``tomllib`` and ``json`` report lines only for syntax
errors; the locators scan the text once, respecting tables and arrays of tables (TOML)
and nested objects and arrays (JSON). A path that is not found falls back to its longest
known prefix (the enclosing table).

``ConfigDocument.table(path)`` gives typed access to one table (:class:`ConfigTable`:
``text``, ``integer``, ``number``, ``size``, ``choice``, ``flag``, ``str_list``,
``tables``, ``check_keys``), each wrong key or value an error naming file, line and key.

Used by ``kvtool target`` configs (kvtool/target/loader.py), ``kvtool replay --tiers``
(kvtool/replay/config.py), custom model geometries (kvtool/geometry/custom.py),
experiments (kvtool/experiments/spec.py) and the emulator's JSON config
(emulator/nvmetcp/config.py).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, NoReturn, Protocol, overload

from kvtool.errors import InputError
from kvtool.units import parse_size

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
    """A parsed config file: its data and where each key is (``locator`` None: data that
    did not come from this text, e.g. converted from another layout; errors then name the
    file and the key, without a line)."""

    data: Any
    source: str | None
    kind: Kind
    locator: Locator | None

    def line(self, path: Sequence[str | int]) -> int | None:
        return self.locator.line(path) if self.locator is not None else None

    def error(self, message: str, path: Sequence[str | int] = ()) -> InputError:
        """An error naming the file, the key's line and the key (``path`` inside tables)."""
        return InputError(message, file=self.source, line=self.line(path) if path else None,
                          field=field_name(path) or None)

    def table(self, path: Sequence[str | int] = ()) -> ConfigTable:
        """Typed access to the table at ``path`` (default: the whole document); an error
        if it is not a table."""
        data = self.data
        for key in path:
            data = data[key]
        return ConfigTable(self, data, tuple(path))

    def locate(self, exc: InputError) -> InputError:
        """``exc`` with the line of its field filled in (for errors raised without one)."""
        if exc.line is None and exc.field:
            exc.locate(self.source, self.line(parse_field_name(exc.field)))
        return exc


class ConfigTable:
    """Typed access to one table of a :class:`ConfigDocument`.

    Invariant: every value it returns has the type its method names (``text`` a ``str``,
    ``integer`` an ``int`` in range, ``size`` a positive byte count, ...), and every
    wrong value raises :class:`~kvtool.errors.InputError` naming the file, the line and
    the key (``path`` is the table's key path in the document).
    """

    def __init__(self, doc: ConfigDocument, data: Any, path: KeyPath) -> None:
        self.doc = doc
        self.path = path
        if not isinstance(data, dict):
            self.fail(f"expected a table, got {show_value(data)}", path)
        self.data: dict[str, Any] = data

    def fail(self, message: str, path: Sequence[str | int] | None = None) -> NoReturn:
        """Raise the error ``message`` at ``path`` (default: this table)."""
        raise self.doc.error(message, self.path if path is None else path)

    def at(self, key: str | int) -> KeyPath:
        """The key path of ``key`` in this table."""
        return (*self.path, key)

    def check_keys(self, allowed: Iterable[str]) -> None:
        allowed = set(allowed)
        for key in self.data:
            if key not in allowed:
                hint = ", ".join(sorted(allowed))
                self.fail(f"unknown key {key!r} (allowed here: {hint})", (*self.path, key))

    def has(self, key: str) -> bool:
        return key in self.data

    @overload
    def text(self, key: str, default: str, *, required: bool = False,
             nonempty: bool = False) -> str: ...

    @overload
    def text(self, key: str, default: None = None, *, required: Literal[True],
             nonempty: bool = False) -> str: ...

    @overload
    def text(self, key: str, default: str | None = None, *, required: bool = False,
             nonempty: bool = False) -> str | None: ...

    def text(self, key: str, default: str | None = None, *, required: bool = False,
             nonempty: bool = False) -> str | None:
        """The string at ``key``; ``default`` when absent (an error when ``required``);
        ``nonempty``: an error when it is blank."""
        if key not in self.data:
            if required:
                self.fail(f"missing required key {key!r}", (*self.path, key))
            return default
        v = self.data[key]
        if not isinstance(v, str) or (nonempty and not v.strip()):
            what = "a non-empty string" if nonempty else "a string"
            self.fail(f"expected {what}, got {show_value(v)}", (*self.path, key))
        return v

    def require(self, key: str, why: str = "") -> None:
        """An error unless ``key`` is given (``why``: added to the message)."""
        if key not in self.data:
            self.fail(f"missing required key {key!r}{why}", (*self.path, key))

    def choice(self, key: str, options: Iterable[str], default: str | None = None) -> str | None:
        v = self.text(key, default)
        options = tuple(options)
        if v is not None and v.lower() not in options:
            self.fail(f"expected one of {', '.join(options)}, got {v!r}", (*self.path, key))
        return None if v is None else v.lower()

    def flag(self, key: str, default: bool = False) -> bool:
        v = self.data.get(key, default)
        if not isinstance(v, bool):
            self.fail(f"expected true or false, got {show_value(v)}", (*self.path, key))
        return v

    @overload
    def integer(self, key: str, default: int, *, lo: int | None = None, hi: int | None = None,
                required: bool = False) -> int: ...

    @overload
    def integer(self, key: str, default: None = None, *, lo: int | None = None,
                hi: int | None = None, required: Literal[True]) -> int: ...

    @overload
    def integer(self, key: str, default: int | None = None, *, lo: int | None = None,
                hi: int | None = None, required: bool = False) -> int | None: ...

    def integer(self, key: str, default: int | None = None, *, lo: int | None = None,
                hi: int | None = None, required: bool = False) -> int | None:
        """The integer at ``key`` (not a bool) within ``lo..hi``; ``default`` when absent
        (an error when ``required``)."""
        if key not in self.data:
            if required:
                self.fail(f"missing required key {key!r}", (*self.path, key))
            return default
        v = self.data[key]
        if isinstance(v, bool) or not isinstance(v, int):
            self.fail(f"expected an integer, got {show_value(v)}", (*self.path, key))
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            if hi is None:
                self.fail(f"must be at least {lo}, got {v}", (*self.path, key))
            bounds = f"{lo if lo is not None else '-inf'}..{hi}"
            self.fail(f"{v} is out of range {bounds}", (*self.path, key))
        return v

    def number(self, key: str, default: float, *, lo: float | None = None) -> float:
        """The number (an integer or a float, not a bool) at ``key``, at least ``lo``;
        ``default`` when absent."""
        if key not in self.data:
            return default
        v = self.data[key]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v:
            self.fail(f"expected a number, got {show_value(v)}", (*self.path, key))
        if lo is not None and v < lo:
            self.fail(f"must be at least {lo}, got {v}", (*self.path, key))
        return float(v)

    def size(self, key: str) -> int | None:
        if key not in self.data:
            return None
        v = self.data[key]
        if isinstance(v, bool) or not isinstance(v, (int, str)):
            self.fail(f"expected a size such as 1GiB, got {show_value(v)}", (*self.path, key))
        try:
            n = parse_size(v, field=key)
        except InputError as exc:
            self.fail(exc.message, (*self.path, key))
        if n <= 0:
            self.fail("size must be positive", (*self.path, key))
        return n

    def array(self, key: str) -> list[Any]:
        """The array at ``key`` (any items); empty when absent."""
        v = self.data.get(key, [])
        if not isinstance(v, list):
            self.fail(f"expected an array, got {show_value(v)}", (*self.path, key))
        return v

    def str_list(self, key: str) -> list[str]:
        v = self.data.get(key, [])
        if not isinstance(v, list):
            self.fail(f"expected a list of strings, got {show_value(v)}", (*self.path, key))
        for i, item in enumerate(v):
            if not isinstance(item, str):
                self.fail(f"expected a string, got {show_value(item)}", (*self.path, key, i))
        return list(v)

    def int_list(self, key: str, *, lo: int | None = None) -> list[int]:
        """The array of integers (each at least ``lo``) at ``key``; empty when absent."""
        v = self.data.get(key, [])
        if not isinstance(v, list):
            self.fail(f"expected a list of integers, got {show_value(v)}", (*self.path, key))
        for i, item in enumerate(v):
            if isinstance(item, bool) or not isinstance(item, int):
                self.fail(f"expected an integer, got {show_value(item)}", (*self.path, key, i))
            if lo is not None and item < lo:
                self.fail(f"must be at least {lo}, got {item}", (*self.path, key, i))
        return list(v)

    def tables(self, key: str) -> list[ConfigTable]:
        """The ``[[key]]`` tables (one ``[key]`` table: a list of one, at ``key``'s path)."""
        v = self.data.get(key, [])
        if isinstance(v, dict):
            return [ConfigTable(self.doc, v, (*self.path, key))]
        if not isinstance(v, list):
            self.fail(f"expected [[{key}]] tables, got {show_value(v)}", (*self.path, key))
        return [ConfigTable(self.doc, item, (*self.path, key, i)) for i, item in enumerate(v)]

    def table(self, key: str) -> ConfigTable | None:
        if key not in self.data:
            return None
        return ConfigTable(self.doc, self.data[key], (*self.path, key))


def show_value(v: Any) -> str:
    return f"{type(v).__name__} {v!r}"


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
