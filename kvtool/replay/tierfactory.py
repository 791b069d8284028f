"""Data mode's tier factory: a configuration's data tiers opened on their places (DRAM
pool, shared-memory or Mooncake pool, NVMe store), with the slots one request needs in
flight, and the NVMe target's own write counter (:class:`MediaCounter`)."""

from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING, Any

import msgspec

from kvtool.cache.replayer import CacheConfig
from kvtool.errors import UsageError, param
from kvtool.replay.media import nvme_engine
from kvtool.replay.settings import ReplaySettings
from kvtool.units import Capacity

if TYPE_CHECKING:
    from kvtool.tiers.base import DataTier


class MediaCounter:
    """The NVMe tier's bytes written, read back from the target's own SMART / Health log
    (Data Units Written, units of 512,000 bytes) before and after the run."""

    UNIT = 512_000

    def __init__(self, engine: Any) -> None:
        self.ctrl = engine.ctrl
        self.nsid = engine.nsid
        self.before = self.ctrl.smart_log(self.nsid)

    def finish(self, tier: DataTier | None, result: dict[str, Any]) -> dict[str, Any]:
        try:
            after = self.ctrl.smart_log(self.nsid)
        except Exception as exc:
            return {"source": "smart", "error": str(exc)}
        units = after.data_units_written - self.before.data_units_written
        nvme = result["measured"]["links"]
        put = sum(v["bytes"] for k, v in nvme.items() if k.startswith("nvme<-"))
        blocks = sum(v["blocks"] for k, v in nvme.items() if k.startswith("nvme<-"))
        padded = blocks * (tier.padded if tier is not None and hasattr(tier, "padded") else 0)
        meta = getattr(tier, "metadata_bytes", 0) if tier is not None else 0
        return {"source": "smart", "counted": units > 0 or put == 0,
                "data_units_written": units,
                "media_bytes_written": units * self.UNIT,
                "replay_put_bytes": put, "replay_padded_bytes": padded,
                "store_metadata_bytes": meta, "unit_bytes": self.UNIT}


def open_tiers(cfg: CacheConfig, block_bytes: int, work_blocks: int, s: ReplaySettings,
               setup: dict[str, Any], create: dict[str, int]
               ) -> tuple[dict[str, DataTier], MediaCounter | None, CacheConfig]:
    """Open the data tiers of ``cfg`` (DRAM pool, NVMe store; the GPU pool is the
    engine's) and return them with ``cfg`` whose NVMe capacity is resolved to blocks
    (a place without a size: what it holds). ``create``: files to create, and their size."""
    from kvtool.align import round_up
    from kvtool.store.layout import Geometry
    from kvtool.tiers.base import TierError
    from kvtool.tiers.nvme import NvmeTier

    B = setup["block_tokens"]
    tiers: dict[str, DataTier] = {}
    media = None
    specs = []
    try:
        for spec in cfg.tiers:
            head = headroom(cfg, spec.name, block_bytes, B, work_blocks)
            if spec.name == "dram":
                tiers["dram"] = dram_tier(spec.place, int(spec.blocks(block_bytes, B)) + head,
                                          block_bytes)
            elif spec.name == "nvme":
                assert spec.place is not None
                place = spec.place
                want = spec.blocks(block_bytes, B)
                create_bytes = None
                if not place.startswith(("nvme+tcp://", "nvme+rdma://")) \
                        and not os.path.exists(place):
                    if want != math.inf:
                        create_bytes = ((int(want) + head) * round_up(block_bytes, 4096)
                                        + (64 << 20))
                    else:
                        create_bytes = create.get(place)
                engine = nvme_engine(place, create_bytes, s.read_qd, s.credentials)
                if place.startswith("nvme+tcp://"):
                    try:
                        media = MediaCounter(engine)
                    except Exception:
                        media = None
                try:
                    tier = NvmeTier(
                        engine, block_bytes=block_bytes, url=place,
                        max_slots=None if want == math.inf else int(want) + head,
                        read_qd=s.read_qd, write_qd=s.write_qd, seed=s.seed,
                        keyed_payload=True,
                        geometry=Geometry(model=setup.get("model") or "",
                                          dtype=setup.get("dtype") or "", block_tokens=B,
                                          tp=s.tp or 1))
                except TierError as exc:
                    engine.close()
                    raise UsageError(str(exc), field="nvme") from None
                tiers["nvme"] = tier
                if want == math.inf:
                    if tier.slots - head < 1:
                        raise UsageError(
                            f"{place} holds {tier.slots} blocks of {block_bytes:,} B, not "
                            f"more than the {head} one request needs in flight; use a bigger "
                            f"place or {param('simulate')}", field="nvme")
                    spec = msgspec.structs.replace(spec, capacity=Capacity(tier.slots - head,
                                                                           "blocks"))
                elif tier.slots < int(want) + head:
                    raise UsageError(
                        f"{place} holds {tier.slots} blocks of {block_bytes:,} B; "
                        f"{spec.capacity} is {int(want)} blocks (+{head} in flight): use a "
                        f"smaller {param('nvme')} size, a bigger place, or {param('simulate')}", field="nvme")
            specs.append(spec)
    except BaseException:
        for t in tiers.values():
            t.close()
        raise
    return tiers, media, CacheConfig(specs, cfg.write_policy, cfg.label)


def dram_tier(place: str | None, slots: int, block_bytes: int) -> DataTier:
    """The DRAM tier of ``slots`` blocks: a Mooncake Store pool (``mooncake://``), a
    shared-memory pool file (emptied: a replay starts cold), or this process's memory."""
    from kvtool.tiers.base import TierError
    from kvtool.tiers.dram import DramTier

    if place is not None and place.startswith("mooncake://"):
        from kvtool.tiers.mooncake import MooncakeTier  # kvtool pool

        return MooncakeTier(place, slots=slots, block_bytes=block_bytes)
    if place is not None:  # a shared-memory pool file
        from kvtool.tiers.shm import ShmDramTier

        try:
            shm = ShmDramTier(place, slots, block_bytes)
        except TierError as exc:
            raise UsageError(str(exc), field="dram") from None
        shm.evict(list(shm.rows))  # a replay starts cold
        return shm
    return DramTier(slots, block_bytes)


def headroom(cfg: CacheConfig, name: str, block_bytes: int, block_tokens: int,
              work_blocks: int) -> int:
    """Slots beyond the capacity a tier needs within one request: blocks are inserted
    before the tier evicts down to its capacity (docs/definitions.md), and a watermark above may
    demote a whole batch at once."""
    extra = work_blocks
    names = [t.name for t in cfg.tiers]
    i = names.index(name)
    if i > 0:
        above = cfg.tiers[i - 1]
        if above.watermark is not None:
            cap = above.blocks(block_bytes, block_tokens)
            if cap != math.inf:
                extra += math.ceil((1 - above.watermark.high + above.watermark.ratio) * cap) + 1
    return extra
