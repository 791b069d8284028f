"""What to do with an object of a given size on a device with a given LBA size.

An object is either written as is (its size is a whole number of LBAs) or padded to
the next LBA boundary and moved through an aligned scratch ("bounce") buffer:

* write: copy the ``nbytes`` object into the scratch, zero the ``pad_bytes`` tail,
  write ``padded_bytes``;
* read: read ``padded_bytes`` into the scratch, copy back only the first ``nbytes``.

Invariants: ``padded_bytes == lbas * lba``; ``0 <= residue < lba``;
``pad_bytes == padded_bytes - nbytes``; ``pad_bytes == 0`` iff ``residue == 0``
iff ``strategy == "aligned"``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kvtool.align.arith import check_alignment, lbas, padded_size, residue
from kvtool.errors import UsageError

Strategy = Literal["aligned", "bounce"]

#: Page alignment: a buffer aligned to it satisfies O_DIRECT on every kernel version.
PAGE = 4096


@dataclass(frozen=True)
class BouncePlan:
    """The aligned scratch buffer that carries one padded object."""

    scratch_bytes: int
    scratch_align: int
    copy_in_bytes: int
    zero_fill_bytes: int
    copy_back_bytes: int

    def to_dict(self) -> dict[str, int]:
        return {"scratch_bytes": self.scratch_bytes, "scratch_align": self.scratch_align,
                "copy_in_bytes": self.copy_in_bytes, "zero_fill_bytes": self.zero_fill_bytes,
                "copy_back_bytes": self.copy_back_bytes}


@dataclass(frozen=True)
class ObjectPlan:
    """How an object of ``nbytes`` is stored on ``lba``-byte logical blocks."""

    nbytes: int
    lba: int
    mem_align: int
    residue: int
    padded_bytes: int
    lbas: int
    pad_bytes: int
    waste_fraction: float
    strategy: Strategy
    bounce: BouncePlan | None
    explanation: str

    @property
    def ok(self) -> bool:
        """True when the object needs no padding."""
        return self.strategy == "aligned"

    def to_dict(self) -> dict[str, object]:
        return {
            "object_bytes": self.nbytes, "lba": self.lba, "mem_align": self.mem_align,
            "residue": self.residue, "padded_bytes": self.padded_bytes, "lbas": self.lbas,
            "pad_bytes": self.pad_bytes, "waste_fraction": self.waste_fraction,
            "strategy": self.strategy, "ok": self.ok,
            "bounce": None if self.bounce is None else self.bounce.to_dict(),
            "explanation": self.explanation,
        }


def plan_object(nbytes: int, lba: int, mem_align: int = PAGE) -> ObjectPlan:
    """Plan the on-device form of an ``nbytes`` object on ``lba``-byte blocks.

    ``mem_align`` is the alignment the I/O buffer must have (the device's
    ``dio_mem_align``; a page by default, which every kernel accepts).
    """
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
        raise UsageError(f"object size must be a positive number of bytes, got {nbytes!r}",
                         field="object_bytes")
    check_alignment(lba, field="lba")
    check_alignment(mem_align, field="mem_align")
    r = residue(nbytes, lba)
    padded = padded_size(nbytes, lba)
    n_lbas = lbas(nbytes, lba)
    pad = padded - nbytes
    waste = pad / padded
    if r == 0:
        return ObjectPlan(nbytes, lba, mem_align, 0, padded, n_lbas, 0, 0.0, "aligned", None,
                          f"{nbytes} B = {n_lbas} × {lba} B: write it as is from a buffer "
                          f"aligned to {mem_align} B")
    scratch_align = max(mem_align, lba)
    bounce = BouncePlan(scratch_bytes=padded, scratch_align=scratch_align, copy_in_bytes=nbytes,
                        zero_fill_bytes=pad, copy_back_bytes=nbytes)
    return ObjectPlan(
        nbytes, lba, mem_align, r, padded, n_lbas, pad, waste, "bounce", bounce,
        f"{nbytes} B ≡ {r} (mod {lba}): pad by {pad} B to {padded} B = {n_lbas} "
        f"LBA{'s' if n_lbas != 1 else ''}; write "
        f"through a {padded}-B scratch buffer aligned to {scratch_align} B (copy the object in, "
        f"zero the {pad}-B tail), and on read copy back only the first {nbytes} B")
