"""Audit a proposed placement of objects on a namespace before any I/O runs.

A placement is either a list of extents (offset, length[, buffer address]) or an
allocator rule. Every extent's offset and length must be multiples of the LBA size and
its buffer address a multiple of the memory alignment — the checks a KV store otherwise
discovers at run time as ``EINVAL``. Extents must also not overlap and (when the device
size is known) must end inside the device.

Rule syntax (``--layout``)::

    packed:offset=X,count=N[,size=S][,stride=T][,align=A]

``count`` objects of ``size`` bytes (default: the object size under audit) placed back to
back from ``offset``: object i starts at ``start + i·stride`` where
``start = round_up(offset, A)`` and ``stride = round_up(size, A)`` unless given
(``align`` defaults to 1, i.e. truly packed). Sizes accept ``512``, ``4KiB``, ``1MB``.
A packed rule is audited in O(1), whatever ``count`` is.
"""

from __future__ import annotations

import csv
import io
import itertools
import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvtool.align.arith import check_alignment, round_up
from kvtool.errors import InputError, UsageError
from kvtool.units import parse_size

PROBLEMS = ("offset", "length", "buffer")


@dataclass(frozen=True)
class Extent:
    offset: int
    length: int
    buffer: int | None = None


@dataclass(frozen=True)
class Misalignment:
    """The first extent that breaks the alignment rules, and which of its values do."""

    index: int
    offset: int
    length: int
    buffer: int | None
    problems: tuple[str, ...]
    message: str

    def to_dict(self) -> dict[str, object]:
        return {"index": self.index, "offset": self.offset, "length": self.length,
                "buffer": self.buffer, "problems": list(self.problems), "message": self.message}


@dataclass(frozen=True)
class LayoutAudit:
    """Result of auditing one placement against one alignment."""

    source: str
    lba: int
    mem_align: int
    extents: int
    misaligned: int
    first_misaligned: Misalignment | None
    overlap: tuple[int, int] | None = None
    beyond_end: int | None = None
    device_size: int | None = None

    @property
    def ok(self) -> bool:
        return self.misaligned == 0 and self.overlap is None and self.beyond_end is None

    def to_dict(self) -> dict[str, object]:
        return {
            "source": self.source, "lba": self.lba, "mem_align": self.mem_align,
            "extents": self.extents, "misaligned": self.misaligned,
            "first_misaligned": None if self.first_misaligned is None
            else self.first_misaligned.to_dict(),
            "overlap": None if self.overlap is None else list(self.overlap),
            "beyond_end": self.beyond_end, "device_size": self.device_size, "ok": self.ok,
        }


def _problems(e: Extent, lba: int, mem_align: int) -> tuple[str, ...]:
    out = []
    if e.offset % lba:
        out.append("offset")
    if e.length % lba:
        out.append("length")
    if e.buffer is not None and e.buffer % mem_align:
        out.append("buffer")
    return tuple(out)


def _describe(index: int, e: Extent, problems: Sequence[str], lba: int, mem_align: int) -> str:
    parts = []
    if "offset" in problems:
        parts.append(f"offset {e.offset} ≡ {e.offset % lba} (mod {lba})")
    if "length" in problems:
        parts.append(f"length {e.length} ≡ {e.length % lba} (mod {lba})")
    if "buffer" in problems and e.buffer is not None:
        parts.append(f"buffer {e.buffer:#x} ≡ {e.buffer % mem_align} (mod {mem_align})")
    return f"extent {index}: " + ", ".join(parts)


def audit_extents(extents: Iterable[Extent | tuple[int, ...]], *, lba: int,
                  mem_align: int | None = None, device_size: int | None = None,
                  source: str = "extents") -> LayoutAudit:
    """Check every extent; report the first misaligned one, the first overlap and the
    first extent past ``device_size``. ``mem_align`` defaults to ``lba``."""
    check_alignment(lba, field="lba")
    mem = check_alignment(mem_align if mem_align is not None else lba, field="mem_align")
    items = [e if isinstance(e, Extent) else Extent(*e) for e in extents]
    first: Misalignment | None = None
    bad = 0
    beyond: int | None = None
    for i, e in enumerate(items):
        if e.offset < 0 or e.length <= 0:
            raise UsageError(f"extent {i}: offset must be ≥ 0 and length > 0, got "
                             f"({e.offset}, {e.length})", field="layout")
        probs = _problems(e, lba, mem)
        if probs:
            bad += 1
            if first is None:
                first = Misalignment(i, e.offset, e.length, e.buffer, probs,
                                     _describe(i, e, probs, lba, mem))
        if beyond is None and device_size is not None and e.offset + e.length > device_size:
            beyond = i
    overlap = None
    order = sorted(range(len(items)), key=lambda k: (items[k].offset, k))
    for a, b in itertools.pairwise(order):
        if items[a].offset + items[a].length > items[b].offset:
            overlap = (min(a, b), max(a, b))
            break
    return LayoutAudit(source, lba, mem, len(items), bad, first, overlap, beyond, device_size)


@dataclass(frozen=True)
class PackedRule:
    """``count`` objects of ``size`` bytes from ``offset``, ``stride`` apart (see module doc)."""

    offset: int
    count: int
    size: int
    stride: int
    align: int = 1

    @classmethod
    def make(cls, *, offset: int, count: int, size: int, stride: int | None = None,
             align: int = 1) -> PackedRule:
        if count <= 0 or size <= 0 or offset < 0:
            raise UsageError("packed rule needs offset ≥ 0, count > 0 and size > 0",
                             field="layout")
        check_alignment(align, field="layout")
        start = round_up(offset, align)
        step = round_up(size, align) if stride is None else stride
        if step <= 0:
            raise UsageError(f"stride must be positive, got {step}", field="layout")
        return cls(start, count, size, step, align)

    def extent(self, i: int) -> Extent:
        return Extent(self.offset + i * self.stride, self.size)

    def extents(self) -> Iterable[Extent]:
        return (self.extent(i) for i in range(self.count))

    def __str__(self) -> str:
        return (f"packed:offset={self.offset},count={self.count},size={self.size},"
                f"stride={self.stride},align={self.align}")


def parse_rule(text: str, *, default_size: int | None = None) -> PackedRule:
    """Parse ``packed:offset=0,count=1000[,size=..][,stride=..][,align=..]``."""
    kind, _, body = text.partition(":")
    if kind.strip().lower() != "packed":
        raise UsageError(f"unknown layout rule {kind!r} (use packed:offset=X,count=N[,size=S]"
                         "[,stride=T][,align=A] or an extents file)", field="layout")
    values: dict[str, int] = {}
    for item in filter(None, (s.strip() for s in body.split(","))):
        key, eq, val = item.partition("=")
        key = key.strip().lower()
        if not eq or key not in {"offset", "count", "size", "stride", "align"}:
            raise UsageError(f"bad rule item {item!r} (keys: offset, count, size, stride, align)",
                             field="layout")
        if key == "count":
            try:
                values[key] = int(val)
            except ValueError:
                raise UsageError(f"count must be an integer, got {val!r}",
                                 field="layout") from None
        else:
            values[key] = parse_size(val, field="layout")
    if "count" not in values:
        raise UsageError("packed rule needs count=N", field="layout")
    size = values.get("size", default_size)
    if size is None:
        raise UsageError("packed rule needs size=S when no object size is given",
                         field="layout")
    return PackedRule.make(offset=values.get("offset", 0), count=values["count"], size=size,
                           stride=values.get("stride"), align=values.get("align", 1))


def audit_rule(rule: PackedRule, *, lba: int, device_size: int | None = None) -> LayoutAudit:
    """Audit a packed rule exactly without listing its extents.

    Offsets are ``s + i·t``; ``s + i·t ≡ 0 (mod a)`` has solutions iff ``gcd(t, a) | s``,
    and then exactly one residue class of i modulo ``a / gcd(t, a)`` — so aligned offsets
    can be counted in closed form.
    """
    check_alignment(lba, field="lba")
    s, t, n, size = rule.offset, rule.stride, rule.count, rule.size
    g = math.gcd(t, lba)
    period = lba // g
    if s % g:
        aligned = 0
    else:
        i0 = (-(s // g) * pow(t // g, -1, period)) % period if period > 1 else 0
        aligned = 0 if i0 >= n else (n - 1 - i0) // period + 1
    length_bad = size % lba != 0
    misaligned = n if length_bad else n - aligned
    first = None
    if misaligned:
        # else offset 0 is aligned and the stride is not a multiple of lba: extent 1 is off
        idx = 0 if length_bad or s % lba else 1
        e = rule.extent(idx)
        probs = _problems(e, lba, lba)
        first = Misalignment(idx, e.offset, e.length, None, probs, _describe(idx, e, probs, lba, lba))
    overlap = (0, 1) if n > 1 and t < size else None
    beyond = None
    if device_size is not None and s + (n - 1) * t + size > device_size:
        beyond = 0 if s + size > device_size else (device_size - size - s) // t + 1
    return LayoutAudit(str(rule), lba, lba, n, misaligned, first, overlap, beyond, device_size)


def read_extents(path: str | Path) -> list[Extent]:
    """Read extents from JSON (``[[off, len], ...]``, ``[{"offset":, "length":, "buffer":}]``
    or ``{"extents": [...]}``) or CSV (``offset,length[,buffer]``, optional header, ``#``
    comments). Numbers may be decimal, ``0x`` hex, or sizes such as ``4KiB``."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UsageError(f"no such extents file: {p} (or give a rule: "
                         "packed:offset=X,count=N)", field="layout") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"cannot read: {exc}", file=p) from None
    if p.suffix.lower() == ".json" or text.lstrip()[:1] in ("[", "{"):
        return _json_extents(text, p)
    return _csv_extents(text, p)


def _number(value: object, p: Path, line: int | None, fld: str) -> int:
    if isinstance(value, bool):
        raise InputError(f"expected a number, got {value!r}", file=p, line=line, field=fld)
    if isinstance(value, int):
        n = value
    elif isinstance(value, str):
        v = value.strip()
        try:
            n = int(v, 0)
        except ValueError:
            try:
                n = parse_size(v, field=fld)
            except UsageError:
                raise InputError(f"not a number or size: {value!r}", file=p, line=line,
                                 field=fld) from None
    else:
        raise InputError(f"expected a number, got {value!r}", file=p, line=line, field=fld)
    if n < 0 or (fld == "length" and n == 0):
        raise InputError(f"must be {'positive' if fld == 'length' else 'non-negative'}, got {n}",
                         file=p, line=line, field=fld)
    return n


def _json_extents(text: str, p: Path) -> list[Extent]:
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputError(f"not valid JSON: {exc.msg}", file=p, line=exc.lineno) from None
    if isinstance(doc, dict):
        doc = doc.get("extents")
    if not isinstance(doc, list):
        raise InputError("expected a list of extents or {\"extents\": [...]}", file=p,
                         field="extents")
    out = []
    for i, item in enumerate(doc):
        where = f"extents[{i}]"
        if isinstance(item, dict):
            unknown = set(item) - set(PROBLEMS)
            if unknown:
                raise InputError(f"unknown key {sorted(unknown)[0]!r} in {where}", file=p,
                                 field=sorted(unknown)[0])
            for key in ("offset", "length"):
                if key not in item:
                    raise InputError(f"{where} lacks {key!r}", file=p, field=key)
            vals = [item["offset"], item["length"], item.get("buffer")]
        elif isinstance(item, list) and len(item) in (2, 3):
            vals = [*item, None] if len(item) == 2 else list(item)
        else:
            raise InputError(f"{where} must be [offset, length(, buffer)] or an object",
                             file=p, field="extents")
        off = _number(vals[0], p, None, "offset")
        length = _number(vals[1], p, None, "length")
        buf = None if vals[2] is None else _number(vals[2], p, None, "buffer")
        out.append(Extent(off, length, buf))
    return out


def _csv_extents(text: str, p: Path) -> list[Extent]:
    out = []
    for lineno, row in enumerate(csv.reader(io.StringIO(text)), start=1):
        cells = [c.strip() for c in row]
        if not cells or not any(cells) or cells[0].startswith("#"):
            continue
        if cells[0].lower() == "offset":
            continue  # header
        if len(cells) not in (2, 3):
            raise InputError(f"expected offset,length[,buffer], got {len(cells)} columns",
                             file=p, line=lineno, field="extents")
        off = _number(cells[0], p, lineno, "offset")
        length = _number(cells[1], p, lineno, "length")
        buf = _number(cells[2], p, lineno, "buffer") if len(cells) == 3 and cells[2] else None
        out.append(Extent(off, length, buf))
    if not out:
        raise InputError("no extents in file", file=p, field="extents")
    return out
