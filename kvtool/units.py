"""Human sizes, shared by every command.

Sizes: ``512``, ``4KiB``, ``429.5GB``, ``46.09TB``, ``1.5 MiB``. Decimal prefixes
(kB/KB, MB, GB, TB, PB) are powers of 1000, binary ones (KiB … PiB) powers of 1024;
a bare letter (``K``, ``M``, ``G``, ``T``, ``P``) is binary, as in fio and dd.
Arithmetic is exact (:class:`decimal.Decimal`); a size that is not a whole number
of bytes is rejected rather than rounded.

Cache capacities also take ``5859blk`` (blocks), ``3000000tok`` (tokens) and
``inf`` (unbounded); see :class:`Capacity`.
"""

from __future__ import annotations

import math
import re
from decimal import Decimal, InvalidOperation
from typing import Literal, NamedTuple

from kvtool.errors import UsageError, param

_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "m": 1 << 20,
    "g": 1 << 30,
    "t": 1 << 40,
    "p": 1 << 50,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "pb": 10**15,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
    "pib": 1 << 50,
}

# Patterns, compiled on first use (re caches them): a command pays only for those it uses.
_SIZE_RE = r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([A-Za-z]*)\s*$"
_CAP_RE = r"(?i)^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*(blk|blks|blocks?|tok|toks|tokens?)\s*$"


def parse_size(text: str | int, *, field: str = "size", allow_zero: bool = True) -> int:
    """Parse a human size into bytes; raise :class:`UsageError` naming ``field``."""
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise UsageError(f"size must not be negative, got {text}", field=field)
        return text
    s = str(text)
    m = re.match(_SIZE_RE, s)
    if not m:
        raise UsageError(
            f"not a size: {s!r} (examples: 512, 4KiB, 429.5GB, 46.09TB)", field=field
        )
    number, unit = m.groups()
    mult = _UNITS.get(unit.lower())
    if mult is None:
        raise UsageError(
            f"unknown unit {unit!r} in {s!r} (use B, KB/MB/GB/TB, KiB/MiB/GiB/TiB)", field=field
        )
    try:
        value = Decimal(number) * mult
    except InvalidOperation as exc:  # pragma: no cover - the regex admits only digits
        raise UsageError(f"not a size: {s!r}", field=field) from exc
    if value != value.to_integral_value():
        raise UsageError(f"{s!r} is not a whole number of bytes ({value} B)", field=field)
    result = int(value)
    if result == 0 and not allow_zero:
        raise UsageError(f"size must be positive, got {s!r}", field=field)
    return result


def format_size(n: float, *, binary: bool | None = None, precision: int = 2) -> str:
    """Format bytes for people: ``1002240`` → ``1.00 MB``; ``4096`` → ``4 KiB``.

    With ``binary=None`` a power-of-two-friendly value (a multiple of 1 KiB) is shown in
    binary units, anything else in decimal units.
    """
    if n < 0:
        return "-" + format_size(-n, binary=binary, precision=precision)
    if math.isinf(n):
        return "inf"
    if binary is None:
        binary = _looks_binary(n)
    base, units = (1024, ["B", "KiB", "MiB", "GiB", "TiB", "PiB"]) if binary else (
        1000, ["B", "KB", "MB", "GB", "TB", "PB"])
    value = float(n)
    for unit in units:
        if value < base or unit == units[-1]:
            if unit == "B":
                return f"{int(value)} B" if value.is_integer() else f"{value:.{precision}f} B"
            if value.is_integer():
                return f"{int(value)} {unit}"
            return f"{value:.{precision}f} {unit}"
        value /= base
    raise AssertionError("unreachable")


def _looks_binary(n: float) -> bool:
    """True when ``n`` is a quarter-multiple of its largest binary unit (4 KiB, 1.5 MiB)."""
    if n < 1024 or not float(n).is_integer():
        return False
    unit = 1 << (10 * min(5, (int(n).bit_length() - 1) // 10))
    return (int(n) * 4) % unit == 0


def parse_percent(text: str, *, field: str = "percent") -> float:
    """``80%`` or ``0.8`` → 0.8; must lie in (0, 1]."""
    s = str(text).strip()
    try:
        value = float(s[:-1]) / 100 if s.endswith("%") else float(s)
    except ValueError as exc:
        raise UsageError(f"not a percentage: {s!r} (example: 80%)", field=field) from exc
    if not 0 < value <= 1:
        raise UsageError(f"must be in (0%, 100%], got {s!r}", field=field)
    return value


CapacityUnit = Literal["bytes", "blocks", "tokens", "inf"]


class Capacity(NamedTuple):
    """A cache-tier capacity as the user gave it: bytes, blocks, tokens or unbounded.

    It is resolved to whole blocks only once block size is known
    (:meth:`blocks`), because ``3000000tok`` means a different number of blocks at
    256 and 512 tokens per block.
    """

    value: int
    unit: CapacityUnit

    @classmethod
    def parse(cls, text: str | int, *, field: str = "capacity") -> Capacity:
        s = str(text).strip()
        if s.lower() in {"inf", "infinite", "unlimited"}:
            return cls(0, "inf")
        m = re.match(_CAP_RE, s)
        if m:
            number, unit = m.groups()
            d = Decimal(number)
            if d != d.to_integral_value():
                raise UsageError(f"{s!r}: blocks and tokens must be whole numbers", field=field)
            return cls(int(d), "blocks" if unit.lower().startswith("b") else "tokens")
        return cls(parse_size(s, field=field), "bytes")

    @property
    def is_infinite(self) -> bool:
        return self.unit == "inf"

    @property
    def is_zero(self) -> bool:
        return self.unit != "inf" and self.value == 0

    def blocks(self, block_bytes: int, block_tokens: int) -> float:
        """Whole blocks this capacity holds (``math.inf`` when unbounded).

        Bytes round down to whole blocks; tokens round down to whole blocks.
        """
        if self.unit == "inf":
            return math.inf
        if self.unit == "blocks":
            return self.value
        if self.unit == "tokens":
            return self.value // block_tokens
        if block_bytes <= 0:
            raise UsageError(f"a capacity in bytes needs the block size ({param('model')} or "
                             f"{param('block_bytes')})", field="capacity")
        return self.value // block_bytes

    def __str__(self) -> str:
        if self.unit == "inf":
            return "inf"
        if self.unit == "blocks":
            return f"{self.value}blk"
        if self.unit == "tokens":
            return f"{self.value}tok"
        return format_size(self.value)
