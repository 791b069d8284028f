"""``kvtool verify``: read objects back and prove every byte.

Each checked object passes four checks, named in reports:

* ``read`` — the padded extent could be read;
* ``checksum`` — CRC32C of the object's bytes equals the index entry's;
* ``content`` — the bytes equal the deterministic payload regenerated from the key
  (objects written by ``kvtool load``; objects stored through the API carry no payload
  recipe and get checksum and padding checks only);
* ``padding`` — the pad between the object's end and the next LBA is all zeros.

Index entries that fail their own CRC or describe an impossible extent are reported as
``index`` problems with the entry's slot and offset. A damaged superblock is a failed
check (``superblock``) too; a target without a kvtool superblock is bad input.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from kvtool.errors import CheckFailed, UsageError
from kvtool.store.checksum import crc32c
from kvtool.store.engine import DEFAULT_QD, open_engine
from kvtool.store.layout import ORDINAL_NONE, PAYLOAD_FILE, BadSuperblock, NotAStore
from kvtool.store.objectstore import ObjectStore
from kvtool.store.payload import ANALYTIC_CRC_MIN_OBJECTS, Payload, make_payload
from kvtool.store.reader import read_slots

if TYPE_CHECKING:
    from kvtool.nvme.hostauth import HostCredentials

SCHEMA = "kvtool.store.verify/1"


@dataclass(frozen=True)
class Sample:
    """Which objects to check: ``count`` of them, or a ``fraction`` (0 < f ≤ 1), at random."""

    count: int | None = None
    fraction: float | None = None

    def __post_init__(self) -> None:
        if (self.count is None) == (self.fraction is None):
            raise UsageError("give a sample count or a fraction, not both or neither",
                             field="sample")
        if self.count is not None and self.count < 1:
            raise UsageError(f"must be at least 1 object, got {self.count}", field="sample")
        if self.fraction is not None and not 0 < self.fraction <= 1:
            raise UsageError(f"must be a fraction in (0, 1], got {self.fraction}",
                             field="sample")

    def size(self, population: int) -> int:
        if self.count is not None:
            return self.count
        assert self.fraction is not None
        return max(1, round(self.fraction * population)) if population else 0


def choose_sample(slots: list[int], sample: Sample | None, *,
                  seed: int | None = None) -> list[int]:
    """All ``slots``, or a random ``sample`` of them (kept in slot order)."""
    if sample is None:
        return slots
    n = sample.size(len(slots))
    if n >= len(slots):
        return slots
    rng = np.random.default_rng(seed)
    return sorted(rng.choice(np.array(slots), size=n, replace=False).tolist())


@dataclass
class VerifyReport:
    """The ``kvtool.store.verify/1`` document: every key always present (docs/store.md)."""

    target: str
    qd: int
    store: dict[str, Any] | None = None
    engine: dict[str, Any] | None = None
    objects_indexed: int = 0
    objects_checked: int = 0
    content_checked: int = 0
    sampled: bool = False
    bytes_checked: int = 0
    seconds: float = 0.0
    bad: list[dict[str, Any]] = field(default_factory=list)
    index: dict[str, int] | None = None

    @property
    def ok(self) -> bool:
        return not self.bad

    def to_dict(self) -> dict[str, Any]:
        s = self.seconds
        return {
            "schema": SCHEMA, "target": self.target, "ok": self.ok, "store": self.store,
            "engine": self.engine, "objects_indexed": self.objects_indexed,
            "objects_checked": self.objects_checked,
            "content_checked": self.content_checked, "sampled": self.sampled,
            "bytes_checked": self.bytes_checked, "seconds": s,
            "gb_per_s": self.bytes_checked / s / 1e9 if s > 0 and self.bytes_checked else 0.0,
            "objects_per_s": self.objects_checked / s if s > 0 and self.objects_checked
            else 0.0,
            "qd": self.qd, "bad": self.bad, "index": self.index,
        }


def verify(target: str, *, qd: int = DEFAULT_QD, sample: Sample | None = None,
           sample_seed: int | None = None, payload_file: str | None = None,
           checksums_only: bool = False, progress: Callable[[int], None] | None = None,
           on_total: Callable[[int], None] | None = None,
           credentials: HostCredentials | None = None) -> dict[str, Any]:
    """Verify the store on ``target``; returns the report (docs/store.md), ``ok`` false
    when any check failed. Raises UsageError when ``target`` is not a kvtool store."""
    engine = open_engine(target, write=False, qd=qd, credentials=credentials)
    report = VerifyReport(target, qd, sampled=sample is not None)
    try:
        report.engine = engine.describe()
        try:
            store = ObjectStore.open(engine)
        except NotAStore as exc:
            raise UsageError(f"{target} is not a kvtool store ({exc})", field="target") from None
        except OSError as exc:
            raise CheckFailed(f"{target}: cannot read the superblock or index: {exc}") from None
        except BadSuperblock as exc:
            report.bad.append({"check": "superblock", "key": None, "slot": None, "offset": 0,
                               "detail": str(exc)})
            return report.to_dict()
        try:
            _verify_store(store, report, sample=sample, sample_seed=sample_seed,
                          payload_file=payload_file, checksums_only=checksums_only,
                          progress=progress, on_total=on_total)
            return report.to_dict()
        finally:
            store.close()
    finally:
        engine.close()


def _payload_for(store: ObjectStore, payload_file: str | None,
                 checksums_only: bool) -> Payload | None:
    sb = store.sb
    if checksums_only:
        return None
    if sb.payload_kind == PAYLOAD_FILE:
        if payload_file is None:
            raise UsageError("this store was loaded from a payload file (CRC32C "
                             f"{sb.payload_crc:#010x}, {sb.payload_bytes} B): pass the same "
                             "payload file, or check checksums only", field="payload_file")
        payload = make_payload(sb.object_bytes, sb.seed, payload_file)
        if payload.source_crc != sb.payload_crc or payload.source_bytes != sb.payload_bytes:
            raise UsageError(f"{payload_file} is not the file this store was loaded from "
                             f"(CRC32C {payload.source_crc:#010x} ≠ {sb.payload_crc:#010x})",
                             field="payload_file")
        return payload
    return make_payload(sb.object_bytes, sb.seed, None)


class ObjectChecker:
    """The per-object checks (checksum, content, padding), run by the reader threads.

    Returns ``[(check, detail)]`` for one object's padded extent; empty when it is good.
    """

    def __init__(self, store: ObjectStore, payload: Payload | None, *, analytic: bool) -> None:
        self.sb = store.sb
        self.entries = store.entries
        self.payload = payload
        self.analytic = analytic
        self._local = threading.local()

    def __call__(self, slot: int, extent: np.ndarray) -> list[tuple[str, str]]:
        ent = self.entries[slot]
        key, length = int(ent["key"]), int(ent["length"])
        data = extent[:length]
        failures: list[tuple[str, str]] = []
        # Without the analytic CRC, checksum first: the content check may edit the bytes.
        actual: int | None = None if self.analytic else crc32c(data)
        content = self._content(slot, key, data)
        if content is None:
            if actual is None:  # the bytes are exactly the payload: so is their CRC
                actual = self.payload.expected_crc(key) if self.payload else None
        elif content:
            failures.append(("content", content))
        if actual is None:
            actual = crc32c(data)  # a content mismatch restored the bytes first
        stored = int(ent["data_crc"])
        if stored != actual:
            failures.insert(0, ("checksum", f"stored CRC32C {stored:#010x}, computed "
                                f"{actual:#010x}"))
        pad = extent[length:]
        if pad.any():
            at = length + int(np.flatnonzero(pad)[0])
            failures.append(("padding", f"non-zero pad byte at object byte {at} (device "
                             f"offset {self.sb.slot_offset(slot) + at})"))
        return failures

    def has_content(self, slot: int) -> bool:
        """Whether the object carries a payload recipe (written by ``kvtool load``)."""
        ent = self.entries[slot]
        return self.payload is not None and int(ent["ordinal"]) != ORDINAL_NONE \
            and int(ent["length"]) == self.sb.object_bytes

    def _content(self, slot: int, key: int, data: np.ndarray) -> str | None:
        """None: the content matches; "": not checked; else what differs."""
        if not self.has_content(slot):
            return ""
        assert self.payload is not None
        expect = getattr(self._local, "expect", None)
        if expect is None:
            expect = self._local.expect = np.empty(self.sb.object_bytes, dtype=np.uint8)
        found = self.payload.differences_in_place(key, data, expect)
        if found is None:
            return None
        count, at = found
        return (f"{count} byte(s) differ from the payload of this key, first at object byte "
                f"{at} (device offset {self.sb.slot_offset(slot) + at})")


class ProgressBatch:
    """Report progress every ``every`` objects, and the rest at the end."""

    def __init__(self, progress: Callable[[int], None] | None, every: int = 16) -> None:
        self.progress, self.every, self.pending = progress, every, 0

    def add(self) -> None:
        self.pending += 1
        if self.progress is not None and self.pending >= self.every:
            self.progress(self.pending)
            self.pending = 0

    def flush(self) -> None:
        if self.progress is not None and self.pending:
            self.progress(self.pending)
        self.pending = 0


def _verify_store(store: ObjectStore, report: VerifyReport, *, sample: Sample | None,
                  sample_seed: int | None, payload_file: str | None, checksums_only: bool,
                  progress: Callable[[int], None] | None,
                  on_total: Callable[[int], None] | None) -> None:
    sb = store.sb
    payload = _payload_for(store, payload_file, checksums_only)
    slots = choose_sample(store.live_slots(), sample, seed=sample_seed)
    if on_total is not None:
        on_total(len(slots))
    analytic = payload is not None and len(slots) >= ANALYTIC_CRC_MIN_OBJECTS \
        and payload.expected_crc(0) is not None  # builds the basis before the workers start
    checker = ObjectChecker(store, payload, analytic=analytic)
    report.store = sb.to_dict()
    report.objects_indexed = len(store)
    scan = store.scan
    report.index = {"live": scan.live, "stale": scan.stale, "superseded": scan.superseded,
                    "problems": len(scan.problems)}
    for p in scan.problems:
        report.bad.append({"check": "index", "key": f"{p.key:#018x}", "slot": p.slot,
                           "offset": p.entry_offset, "detail": f"{p.reason} (entry at device "
                           f"offset {p.entry_offset}; key as stored, unverified)"})
    batch = ProgressBatch(progress)
    t0 = time.perf_counter()
    for slot, result in read_slots(store, slots, qd=report.qd, check=checker):
        ent = store.entries[slot]
        key, length = f"{int(ent['key']):#018x}", int(ent["length"])
        report.objects_checked += 1
        report.bytes_checked += length
        report.content_checked += checker.has_content(slot)
        if isinstance(result, OSError):
            report.bad.append({"check": "read", "key": key, "slot": slot,
                               "offset": sb.slot_offset(slot), "detail": str(result)})
        else:
            report.bad.extend({"check": name, "key": key, "slot": slot,
                               "offset": sb.slot_offset(slot), "length": length,
                               "detail": detail} for name, detail in result)
        batch.add()
    batch.flush()
    report.seconds = time.perf_counter() - t0
