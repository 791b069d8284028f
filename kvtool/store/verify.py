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
from typing import TYPE_CHECKING, Any

import numpy as np

from kvtool.errors import CheckFailed, UsageError
from kvtool.store.checksum import crc32c
from kvtool.store.engine import DEFAULT_QD, open_engine
from kvtool.store.layout import ORDINAL_NONE, PAYLOAD_FILE, BadSuperblock, NotAStore
from kvtool.store.objectstore import ObjectStore, read_slots
from kvtool.store.payload import ANALYTIC_CRC_MIN_OBJECTS, Payload, make_payload

if TYPE_CHECKING:
    from kvtool.nvme.hostauth import HostCredentials

SCHEMA = "kvtool.store.verify/1"


def choose_sample(slots: list[int], sample: str | None, *, seed: int | None = None) -> list[int]:
    """All ``slots``, or ``N`` / ``P%`` of them chosen at random (kept in slot order)."""
    if sample is None:
        return slots
    text = sample.strip()
    try:
        if text.endswith("%"):
            frac = float(text[:-1]) / 100
            if not 0 < frac <= 1:
                raise ValueError
            n = max(1, round(frac * len(slots))) if slots else 0
        else:
            n = int(text)
            if n < 1:
                raise ValueError
    except ValueError:
        raise UsageError(f"expected a count (100) or a percentage (10%), got {sample!r}",
                         field="--sample") from None
    if n >= len(slots):
        return slots
    rng = np.random.default_rng(seed)
    return sorted(rng.choice(np.array(slots), size=n, replace=False).tolist())


def verify(target: str, *, qd: int = DEFAULT_QD, sample: str | None = None,
           sample_seed: int | None = None, payload_file: str | None = None,
           checksums_only: bool = False, progress: Callable[[int], None] | None = None,
           on_total: Callable[[int], None] | None = None,
           credentials: HostCredentials | None = None) -> dict[str, Any]:
    """Verify the store on ``target``; returns the report (docs/store.md), ``ok`` false
    when any check failed. Raises UsageError when ``target`` is not a kvtool store."""
    engine = open_engine(target, write=False, qd=qd, credentials=credentials)
    try:
        try:
            store = ObjectStore.open(engine)
        except NotAStore as exc:
            raise UsageError(f"{target} is not a kvtool store ({exc})", field="TARGET") from None
        except OSError as exc:
            raise CheckFailed(f"{target}: cannot read the superblock or index: {exc}") from None
        except BadSuperblock as exc:
            return {"schema": SCHEMA, "target": target, "ok": False, "store": None,
                    "objects_indexed": 0, "objects_checked": 0, "bytes_checked": 0,
                    "seconds": 0.0, "gb_per_s": 0.0,
                    "bad": [{"check": "superblock", "key": None, "slot": None, "offset": 0,
                             "detail": str(exc)}]}
        try:
            return _verify_store(store, target, qd=qd, sample=sample, sample_seed=sample_seed,
                                 payload_file=payload_file, checksums_only=checksums_only,
                                 progress=progress, on_total=on_total)
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
                             "--payload-file, or --checksums-only", field="--payload-file")
        payload = make_payload(sb.object_bytes, sb.seed, payload_file)
        if payload.source_crc != sb.payload_crc or payload.source_bytes != sb.payload_bytes:
            raise UsageError(f"{payload_file} is not the file this store was loaded from "
                             f"(CRC32C {payload.source_crc:#010x} ≠ {sb.payload_crc:#010x})",
                             field="--payload-file")
        return payload
    return make_payload(sb.object_bytes, sb.seed, None)


def _verify_store(store: ObjectStore, target: str, *, qd: int, sample: str | None,
                  sample_seed: int | None, payload_file: str | None, checksums_only: bool,
                  progress: Callable[[int], None] | None,
                  on_total: Callable[[int], None] | None) -> dict[str, Any]:
    sb = store.sb
    payload = _payload_for(store, payload_file, checksums_only)
    slots = choose_sample(store.live_slots(), sample, seed=sample_seed)
    if on_total is not None:
        on_total(len(slots))
    analytic = payload is not None and len(slots) >= ANALYTIC_CRC_MIN_OBJECTS \
        and payload.expected_crc(0) is not None  # builds the basis before the workers start
    entries = store.entries
    local = threading.local()

    def check(slot: int, extent: np.ndarray) -> list[tuple[str, str, int]]:
        ent = entries[slot]
        key, length = int(ent["key"]), int(ent["length"])
        data = extent[:length]
        failures: list[tuple[str, str, int]] = []
        pad = extent[length:]
        pad_ok = not pad.any()
        stored = int(ent["data_crc"])
        # Without the analytic CRC, checksum first: the content check may edit the bytes.
        actual: int | None = None if analytic else crc32c(data)
        if payload is not None and int(ent["ordinal"]) != ORDINAL_NONE \
                and length == sb.object_bytes:
            expect = getattr(local, "expect", None)
            if expect is None:
                expect = local.expect = np.empty(sb.object_bytes, dtype=np.uint8)
            found = payload.differences_in_place(key, data, expect)
            if found is None:
                if actual is None:  # the bytes are exactly the payload: so is their CRC
                    actual = payload.expected_crc(key)
            else:
                count, at = found
                failures.append(("content", f"{count} byte(s) differ from the payload of "
                                 f"this key, first at object byte {at} (device offset "
                                 f"{sb.slot_offset(slot) + at})", at))
        if actual is None:
            actual = crc32c(data)  # a content mismatch restored the bytes first
        if stored != actual:
            failures.insert(0, ("checksum", f"stored CRC32C {stored:#010x}, computed "
                                f"{actual:#010x}", 0))
        if not pad_ok:
            at = length + int(np.flatnonzero(pad)[0])
            failures.append(("padding", f"non-zero pad byte at object byte {at} (device "
                             f"offset {sb.slot_offset(slot) + at})", at))
        return failures

    bad: list[dict[str, Any]] = []
    for p in store.scan.problems:
        bad.append({"check": "index", "key": f"{p.key:#018x}", "slot": p.slot,
                    "offset": p.entry_offset, "detail": f"{p.reason} (entry at device offset "
                    f"{p.entry_offset}; key as stored, unverified)"})
    t0 = time.perf_counter()
    checked = nbytes = content_checked = 0
    done_since = 0
    for slot, result in read_slots(store, slots, qd=qd, check=check):
        ent = entries[slot]
        key, length = int(ent["key"]), int(ent["length"])
        checked += 1
        nbytes += length
        if payload is not None and int(ent["ordinal"]) != ORDINAL_NONE:
            content_checked += 1
        if isinstance(result, OSError):
            bad.append({"check": "read", "key": f"{key:#018x}", "slot": slot,
                        "offset": sb.slot_offset(slot), "detail": str(result)})
        else:
            for name, detail, _ in result:
                bad.append({"check": name, "key": f"{key:#018x}", "slot": slot,
                            "offset": sb.slot_offset(slot), "length": length,
                            "detail": detail})
        done_since += 1
        if progress is not None and done_since >= 16:
            progress(done_since)
            done_since = 0
    if progress is not None and done_since:
        progress(done_since)
    seconds = time.perf_counter() - t0
    return {
        "schema": SCHEMA,
        "target": target, "ok": not bad, "store": sb.to_dict(),
        "engine": store.engine.describe(),
        "objects_indexed": len(store), "objects_checked": checked,
        "content_checked": content_checked, "sampled": sample is not None,
        "bytes_checked": nbytes, "seconds": seconds,
        "gb_per_s": nbytes / seconds / 1e9 if seconds > 0 and nbytes else 0.0,
        "objects_per_s": checked / seconds if seconds > 0 and checked else 0.0,
        "qd": qd, "bad": bad,
        "index": {"live": store.scan.live, "stale": store.scan.stale,
                  "superseded": store.scan.superseded,
                  "problems": len(store.scan.problems)},
    }
