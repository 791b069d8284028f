"""Alignment arithmetic: residues, padding and LBA counts.

All functions take non-negative sizes and a positive alignment and are exact integer
arithmetic; they raise :class:`ValueError` on a programming error (negative size, zero
alignment). User-supplied alignments are checked first with :func:`check_alignment`,
which raises :class:`~kvtool.errors.UsageError` naming the option.
"""

from __future__ import annotations

from kvtool.errors import UsageError


def _check(n: int, a: int) -> None:
    if n < 0:
        raise ValueError(f"size must not be negative, got {n}")
    if a <= 0:
        raise ValueError(f"alignment must be positive, got {a}")


def round_up(n: int, a: int) -> int:
    """Smallest multiple of ``a`` that is ≥ ``n``."""
    _check(n, a)
    return -(-n // a) * a


def round_down(n: int, a: int) -> int:
    """Largest multiple of ``a`` that is ≤ ``n``."""
    _check(n, a)
    return n // a * a


def residue(n: int, a: int) -> int:
    """``n mod a``: the bytes past the last whole ``a``-byte unit (0 when aligned)."""
    _check(n, a)
    return n % a


def is_aligned(n: int, a: int) -> bool:
    return residue(n, a) == 0


def padded_size(nbytes: int, lba: int) -> int:
    """Bytes an object of ``nbytes`` occupies on a device with ``lba``-byte blocks."""
    return round_up(nbytes, lba)


def lbas(nbytes: int, lba: int) -> int:
    """Number of ``lba``-byte logical blocks an object of ``nbytes`` occupies."""
    return round_up(nbytes, lba) // lba


def check_alignment(a: int, *, field: str = "lba") -> int:
    """Return ``a`` if it is a power of two ≥ 1, else raise :class:`UsageError`."""
    if isinstance(a, bool) or not isinstance(a, int) or a <= 0:
        raise UsageError(f"alignment must be a positive power of two, got {a!r}", field=field)
    if a & (a - 1):
        raise UsageError(f"alignment must be a power of two (512, 4096, ...), got {a}",
                         field=field)
    return a
