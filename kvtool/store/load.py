"""``kvtool load``: write deterministic KV objects onto a target, crash-consistently.

Loading is idempotent: the objects are ordinals ``0 .. count-1`` of the seed's key
sequence (:mod:`kvtool.store.keys`), and keys already in the store are skipped, so
re-running after a crash finishes the job without rewriting what was acknowledged.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvtool.errors import CheckFailed, UsageError, param
from kvtool.store.engine import DEFAULT_QD, AlignedBuffer, IOEngine, open_engine
from kvtool.store.keys import object_keys
from kvtool.store.layout import BadSuperblock, Geometry, NotAStore, new_superblock, plan_layout
from kvtool.store.objectstore import ObjectStore
from kvtool.store.payload import ANALYTIC_CRC_MIN_OBJECTS, Payload, make_payload
from kvtool.store.signatures import PROBE_BYTES, identify

if TYPE_CHECKING:
    from kvtool.nvme.hostauth import HostCredentials

AckSink = Callable[[dict[str, Any]], None]


@dataclass(frozen=True)
class LoadSpec:
    """What to load: object size (and where it came from), how many, with which content."""

    object_bytes: int
    count: int | None = None
    fill: float | None = None
    seed: int = 0
    qd: int = DEFAULT_QD
    force: bool = False
    geometry: Geometry = field(default_factory=Geometry)
    payload_file: str | None = None
    batch_objects: int = 0
    """Objects per commit; 0 = about 64 MiB per commit (at least 4 objects)."""
    lba: int | None = None
    create_bytes: int | None = None


def read_head(engine: IOEngine) -> bytes:
    """The target's first MiB (less on a smaller target), for signature checks."""
    n = min(PROBE_BYTES, engine.size) // engine.lba_size * engine.lba_size
    if n == 0:
        return b""
    buf = AlignedBuffer(n)
    try:
        engine.read_into(0, buf.view)
        return bytes(buf.view)
    finally:
        buf.close()


def _compatible(store: ObjectStore, spec: LoadSpec, payload: Payload, lba: int) -> str | None:
    """Why ``store`` cannot be resumed with ``spec`` (None when it can)."""
    sb = store.sb
    if sb.object_bytes != spec.object_bytes:
        return f"its objects are {sb.object_bytes} B, not {spec.object_bytes} B"
    if sb.seed != spec.seed:
        return f"it was loaded with {param('seed')} {sb.seed}, not {spec.seed}"
    if sb.payload_kind != payload.kind or sb.payload_crc != payload.source_crc:
        return "it was loaded from a different payload source"
    if sb.lba_size != lba:
        return f"it was formatted for {sb.lba_size}-byte blocks, not {lba}"
    return None


def prepare(engine: IOEngine, spec: LoadSpec, payload: Payload, target: str,
            ) -> tuple[ObjectStore | None, int, int, str | None]:
    """Decide, before writing anything, whether to resume or format.

    Returns ``(store to resume or None, slot_count, count, what is being replaced)``;
    raises UsageError for every refusal.
    """
    head = read_head(engine)
    found = identify(head)
    existing: ObjectStore | None = None
    replacing: str | None = None
    if found == "kvtool":
        try:
            existing = ObjectStore.open(engine)
        except (BadSuperblock, NotAStore) as exc:
            if not spec.force:
                raise UsageError(f"{target}: damaged kvtool store ({exc}); {param('force')} "
                                 "reformats it (its objects are lost)", field="target") from None
            replacing = "a damaged kvtool store"
        if existing is not None:
            why = _compatible(existing, spec, payload, engine.lba_size)
            if why is not None:
                if not spec.force:
                    existing.close()
                    raise UsageError(f"{target} holds a kvtool store that cannot be extended: "
                                     f"{why}; {param('force')} reformats it ({len(existing)} objects "
                                     "lost)", field="target")
                replacing = f"a kvtool store of {len(existing)} objects"
                existing.close()
                existing = None
    elif found is not None:
        if not spec.force:
            raise UsageError(f"{target} holds {found}; refusing to overwrite it without "
                             f"{param('force')}",
                             field="target")
        replacing = found
    if existing is not None:
        slots = existing.sb.slot_count
    else:
        slots, _, doff = plan_layout(engine.size, spec.object_bytes, engine.lba_size)
        if slots < 1:
            raise UsageError(f"{target} is too small for one {spec.object_bytes}-byte object "
                             f"({engine.size} bytes; a store needs at least "
                             f"{doff + -(-spec.object_bytes // engine.lba_size) * engine.lba_size}"
                             ")", field="target")
    if spec.count is not None:
        count = spec.count
        if count > slots:
            if existing is not None:
                existing.close()
            raise UsageError(f"{count} objects do not fit: {target} holds at most {slots} "
                             f"objects of {spec.object_bytes} B", field="count")
    else:
        count = math.floor((spec.fill or 1.0) * slots)
    return existing, slots, count, replacing


def load(target: str, spec: LoadSpec, *, ack: AckSink | None = None,
         progress: Callable[[int], None] | None = None,
         on_total: Callable[[int], None] | None = None,
         credentials: HostCredentials | None = None) -> dict[str, Any]:
    """Load ``spec`` onto ``target``; returns the result document (docs/store.md).

    ``ack`` receives one record per durable commit; ``progress(n)`` is called with the
    number of objects just committed, ``on_total(n)`` once with the number to write.
    """
    payload = make_payload(spec.object_bytes, spec.seed, spec.payload_file)
    engine = open_engine(target, write=True, qd=spec.qd, lba=spec.lba,
                         create_bytes=spec.create_bytes, credentials=credentials)
    try:
        store, _, count, replacing = prepare(engine, spec, payload, target)
        formatted = store is None
        if store is None:
            sb = new_superblock(
                device_bytes=engine.size, object_bytes=spec.object_bytes,
                lba_size=engine.lba_size,
                physical_block_size=int(getattr(engine, "physical_block_size", engine.lba_size)),
                seed=spec.seed, created_ns=time.time_ns(), geometry=spec.geometry,
                payload_kind=payload.kind, payload_crc=payload.source_crc,
                payload_bytes=payload.source_bytes)
            store = ObjectStore.format(engine, sb)
        try:
            return _load_into(store, spec, payload, count, target, formatted, replacing,
                              ack, progress, on_total)
        finally:
            store.close()
    except OSError as exc:
        raise CheckFailed(f"{target}: I/O error during load: {exc} (objects acknowledged "
                          "before it are durable)") from None
    finally:
        engine.close()


def _load_into(store: ObjectStore, spec: LoadSpec, payload: Payload, count: int, target: str,
               formatted: bool, replacing: str | None, ack: AckSink | None,
               progress: Callable[[int], None] | None,
               on_total: Callable[[int], None] | None) -> dict[str, Any]:
    sb = store.sb
    keys = object_keys(spec.seed, count, sb.geometry.block_tokens or 256)
    todo = [(i, k) for i, k in enumerate(keys) if k not in store]
    present = count - len(todo)
    if len(todo) > store.free_slots:
        raise UsageError(f"{len(todo)} more objects do not fit: {target} has "
                         f"{store.free_slots} free slots", field="count")
    if on_total is not None:
        on_total(len(todo))
    batch = spec.batch_objects or max(4, (64 << 20) // sb.slot_bytes)
    state = {"batches": 0, "acked": present}

    def committed(records: list[tuple[int, int]]) -> None:
        state["batches"] += 1
        state["acked"] += len(records)
        if ack is not None:
            ack({"batch": state["batches"], "objects": state["acked"],
                 "keys": [f"{k:#018x}" for k, _ in records],
                 "ordinals": [o for _, o in records]})
        if progress is not None:
            progress(len(records))

    analytic = len(todo) >= ANALYTIC_CRC_MIN_OBJECTS
    if analytic:
        payload.expected_crc(0)  # build the CRC basis before the clock starts
    t0 = time.perf_counter()
    writer = store.writer(qd=spec.qd, batch_objects=batch, on_commit=committed)
    try:
        for ordinal, key in todo:
            writer.put(key, _filler(payload, key), ordinal,
                       payload.expected_crc(key) if analytic else None)
    finally:
        writer.close()
    seconds = time.perf_counter() - t0
    written = writer.committed
    nbytes = written * sb.object_bytes
    return {
        "schema": "kvtool.store.load/1",
        "target": target, "engine": store.engine.describe(), "store": sb.to_dict(),
        "formatted": formatted, "replaced": replacing, "requested": count,
        "already_present": present, "written": written, "objects": len(store),
        "free_slots": store.free_slots, "commits": state["batches"],
        "objects_per_commit": batch, "bytes_written": nbytes,
        "padded_bytes_written": written * sb.slot_bytes, "seconds": seconds,
        "gb_per_s": nbytes / seconds / 1e9 if seconds > 0 and written else 0.0,
        "objects_per_s": written / seconds if seconds > 0 and written else 0.0,
        "qd": spec.qd, "io_path": "zero-copy" if sb.object_bytes == sb.slot_bytes else "bounce",
    }


def _filler(payload: Payload, key: int) -> Callable[[Any], None]:
    def fill(out: Any) -> None:
        payload.fill(key, out)
    return fill


class AckFile:
    """Appends one JSON line per acknowledged commit (written only after it is durable)."""

    def __init__(self, path: str | Path) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644)

    def __call__(self, record: dict[str, Any]) -> None:
        os.write(self.fd, (json.dumps(record, separators=(",", ":")) + "\n").encode())

    def close(self) -> None:
        os.close(self.fd)
