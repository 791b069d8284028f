"""Tier options: a capacity, a place, or both.

``--dram 1GiB`` (a local pool of that size), ``--nvme nvme+tcp://127.0.0.1:4420/NQN/1``
(the whole namespace), ``--nvme /dev/loop3`` (the whole device), ``--nvme
2GiB@/var/tmp/kv.img`` (2 GiB of that file, created if missing). The same text is
accepted in ``--compare`` specs and tiers files. Capacities also take ``blk``/``tok``
units and ``inf`` (``--simulate`` only, unless the place bounds it).
"""

from __future__ import annotations

from typing import NamedTuple

from kvtool.errors import UsageError
from kvtool.units import Capacity

ON_TIER_ERROR = ("fail", "recompute")
"""What a data run does when a tier's medium fails: stop, or go on without the tier."""

PLACED_TIERS: dict[str, str] = {
    "dram": "a mooncake:// URL (a Mooncake Store pool: kvtool pool up) or a shared-memory "
            "file such as /dev/shm/kvtool-pool (a pool that outlives the process)",
    "nvme": "a file, a block device or an nvme+tcp:// URL",
}
"""Tiers that take a place, and what the place may be."""


def _looks_like_place(text: str) -> bool:
    return "://" in text or text.startswith(("/", "./", "../", "~"))


class TierOption(NamedTuple):
    """One tier as given on the command line: ``capacity`` and/or ``place``."""

    capacity: Capacity | None = None
    place: str | None = None

    @classmethod
    def parse(cls, text: str, *, tier: str, field: str | None = None) -> TierOption:
        field = field or f"--{tier}"
        text = text.strip()
        cap_text: str | None
        place: str | None
        if "@" in text and not text.startswith(("nvme+tcp://", "nvme+rdma://")):
            cap_text, _, place = text.partition("@")
            cap_text, place = cap_text.strip(), place.strip()
            if not cap_text or not place:
                raise UsageError(f"{text!r}: expected SIZE@PLACE (example: 2GiB@/var/tmp/kv.img)",
                                 field=field)
        elif _looks_like_place(text):
            cap_text, place = None, text
        else:
            cap_text, place = text, None
        cap = Capacity.parse(cap_text, field=field) if cap_text is not None else None
        if place is not None:
            if tier not in PLACED_TIERS:
                raise UsageError(f"{text!r}: the {tier} tier is a local pool and takes a size "
                                 f"only (example: --{tier} 1GiB)", field=field)
            if place.startswith("~"):
                from pathlib import Path
                place = str(Path(place).expanduser())
            if tier == "nvme" and place.startswith("mooncake://"):
                raise UsageError(f"{text!r}: the {tier} tier's place is "
                                 f"{PLACED_TIERS[tier]}", field=field)
            if tier == "dram" and place.startswith("mooncake://"):
                from kvtool.mooncake import parse_mooncake_url

                parse_mooncake_url(place, field=field)
            elif tier == "dram" and ("://" in place or not place.startswith("/")):
                raise UsageError(f"{text!r}: the {tier} tier's place is "
                                 f"{PLACED_TIERS[tier]}", field=field)
        return cls(cap, place)

    @property
    def is_zero(self) -> bool:
        return self.place is None and (self.capacity is None or self.capacity.is_zero)

    def __str__(self) -> str:
        if self.place is None:
            return str(self.capacity)
        return self.place if self.capacity is None else f"{self.capacity}@{self.place}"
