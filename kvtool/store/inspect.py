"""``kvtool store inspect``: the superblock and a summary of the index (read-only)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from kvtool.errors import CheckFailed, UsageError
from kvtool.store.engine import open_engine
from kvtool.store.layout import ORDINAL_KEYED, BadSuperblock, NotAStore
from kvtool.store.load import read_head
from kvtool.store.objectstore import ObjectStore
from kvtool.store.signatures import identify

if TYPE_CHECKING:
    from kvtool.nvme.hostauth import HostCredentials

SCHEMA = "kvtool.store.inspect/1"


def inspect(target: str, *, list_objects: int = 0,
            credentials: HostCredentials | None = None) -> dict[str, Any]:
    """Describe the store on ``target``; UsageError when it holds none.

    A damaged superblock is reported (``superblock_error``) rather than raised, so people
    can see what is there.
    """
    engine = open_engine(target, write=False, qd=1, credentials=credentials)
    try:
        try:
            store = ObjectStore.open(engine)
        except NotAStore as exc:
            head = read_head(engine)
            found = f"it holds {identify(head) or 'nothing (all zeros)'}" if head else str(exc)
            raise UsageError(f"{target} is not a kvtool store ({found})", field="target") from None
        except OSError as exc:
            raise CheckFailed(f"{target}: cannot read the superblock or index: {exc}") from None
        except BadSuperblock as exc:
            return {"schema": SCHEMA, "target": target, "engine": engine.describe(),
                    "superblock": None,
                    "superblock_error": str(exc), "index": None, "problems": [],
                    "objects": []}
        try:
            sb, e = store.sb, store.entries
            live = np.array(store.live_slots(), dtype=np.int64)
            gens = e["generation"][live] if live.size else np.empty(0, dtype=np.uint64)
            index = {
                "slots": sb.slot_count, "live": len(store), "free": store.free_slots,
                "fill": len(store) / sb.slot_count, "stale": store.scan.stale,
                "superseded": store.scan.superseded, "problems": len(store.scan.problems),
                "bytes_stored": int(e["length"][live].sum()) if live.size else 0,
                "capacity_bytes": sb.slot_count * sb.object_bytes,
                "generation_min": int(gens.min()) if gens.size else None,
                "generation_max": int(gens.max()) if gens.size else None,
                "padding_bytes_per_object": sb.slot_bytes - sb.object_bytes,
            }
            objects = [{"slot": int(s), "key": f"{int(e['key'][s]):#018x}",
                        "offset": int(e["offset"][s]), "length": int(e["length"][s]),
                        "crc32c": f"{int(e['data_crc'][s]):#010x}",
                        "generation": int(e["generation"][s]),
                        "ordinal": None if int(e["ordinal"][s]) >= ORDINAL_KEYED
                        else int(e["ordinal"][s])}
                       for s in live[:list_objects].tolist()]
            problems = [{"slot": p.slot, "entry_offset": p.entry_offset,
                         "key": f"{p.key:#018x}", "reason": p.reason}
                        for p in store.scan.problems]
            return {"schema": SCHEMA, "target": target, "engine": engine.describe(),
                    "superblock": sb.to_dict(),
                    "superblock_error": None, "index": index, "problems": problems,
                    "objects": objects}
        finally:
            store.close()
    finally:
        engine.close()
