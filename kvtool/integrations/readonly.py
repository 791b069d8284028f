"""What a store's durable places hold, read without opening them for writing.

A TP>1 engine's scheduler runs in another process than its workers, which own the tiers;
it learns what rank 0 holds by reading the places' indexes: a ``/dev/shm`` pool's entry
table and the NVMe store's committed index. Read-only, lock-free: the worker may change
them meanwhile, and a block offered here but gone by the time it loads fails its check
(the engine recomputes it).
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

from kvtool.integrations.spec import StoreSpec


def held_keys(spec: StoreSpec) -> list[tuple[str, set[int]]]:
    """(tier, keys it holds) for each durable place of ``spec``, top tier first."""
    out: list[tuple[str, set[int]]] = []
    if spec.dram is not None and spec.dram.place and spec.dram.place.startswith("/"):
        out.append(("dram", _shm_keys(spec.dram.place)))
    if spec.nvme is not None and spec.nvme.place:
        out.append(("nvme", _store_keys(spec, spec.nvme.place)))
    return out


def _shm_keys(path: str) -> set[int]:
    from kvtool.tiers.shm import held_keys as pool_keys

    return pool_keys(path)


def _store_keys(spec: StoreSpec, place: str) -> set[int]:
    from kvtool.nvme.hostauth import HostCredentials
    from kvtool.store.objectstore import ObjectStore

    engine: Any = None
    try:
        if place.startswith("nvme+"):
            from kvtool.nvme.engine import open_nvme_tcp

            creds = HostCredentials.load(spec.hostnqn, spec.dhchap_secret,
                                         spec.dhchap_ctrl_secret)
            engine = open_nvme_tcp(place, write=False, qd=4, timeout=5.0, credentials=creds)
        elif os.path.exists(place):
            from kvtool.store.engine import open_engine

            engine = open_engine(place, write=False)
        else:
            return set()
        store = ObjectStore.open(engine)
        try:
            return set(store.by_key)
        finally:
            store.close()
    except Exception:
        return set()
    finally:
        if engine is not None:
            with contextlib.suppress(Exception):
                engine.close()
