"""kvtool's tiers under an inference engine: the block store a connector or plugin drives.

:class:`BlockStore` is the data mode of ``kvtool replay`` with the engine as its top tier:
the same :class:`~kvtool.cache.hierarchy.TierHierarchy` (lookup, store/touch, promotion,
write policy, eviction, from :mod:`kvtool.replay.config`'s tier words) and the same
:class:`~kvtool.tiers.mover.DataMover` moving the bytes between the engine's KV cache and
the data tiers (a DRAM pool — local, a ``/dev/shm`` file, or Mooncake Store — and kvtool's
object store on a file, block device or ``nvme+tcp://`` namespace). What differs:

* **Keys** are the engine's prompt blocks, chain-hashed by kvtool
  (:func:`kvtool.trace.hashing.chain_hashes` of the token ids, salted with the model,
  its KV geometry and the rank: :func:`block_keys`), so every process of every run agrees.
* **Checks** are CRC32C: the mover takes the CRC of each block as it stores it, per tier;
  a load whose bytes do not match is counted corrupt and never served (the caller
  recomputes it, and the stale copy is rewritten once it has).
* **Durable tiers**: the NVMe tier opens the store its place holds and commits its
  writes (and evictions) through the store's crash-consistent protocol (:meth:`commit`:
  at most every ``commit_interval`` seconds from an engine's steps, :meth:`step_done`,
  and at :meth:`close`); a ``/dev/shm`` DRAM pool keeps an index beside its rows. A new
  process finds what an earlier one stored, with the checksums it stored; one that
  crashed loses at most its last interval's blocks (misses, never wrong bytes).
* **A failing tier is a miss**, never an error for the engine (``on_tier_error`` =
  ``recompute``): the tier is dropped, its hits recomputed, and the engine goes on.

Thread-safe: one lock around every call (an engine's scheduler and worker may call from
two threads).
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvtool.cache.hierarchy import TierHierarchy
from kvtool.cache.stats import RoundStats
from kvtool.errors import UsageError
from kvtool.integrations.spec import StoreSpec
from kvtool.store.layout import Geometry
from kvtool.tiers.base import DataTier, TierError
from kvtool.tiers.mover import DataCounters, DataMover, TierFailed
from kvtool.units import Capacity

SCHEMA = "kvtool.blockstore/1"


def block_keys(tokens: Sequence[int], block_tokens: int, salt: bytes) -> list[int]:
    """The keys of the full blocks of ``tokens`` (a prompt): kvtool's chain hash, so a
    block's key covers every token before it, salted so that another model, KV geometry
    or rank never shares a key."""
    from kvtool.trace.hashing import chain_hashes

    return chain_hashes(tokens, block_tokens, extra=salt)


@dataclass
class TierCounters:
    """One tier's traffic, as the engine saw it."""

    hit_blocks: int = 0
    """Blocks loaded from this tier into the engine (checked good)."""
    loaded_bytes: int = 0
    stored_blocks: int = 0
    stored_bytes: int = 0
    load_seconds: list[float] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        ls = sorted(self.load_seconds)
        return {"hit_blocks": self.hit_blocks, "loaded_bytes": self.loaded_bytes,
                "stored_blocks": self.stored_blocks, "stored_bytes": self.stored_bytes,
                "load_p50_s": ls[len(ls) // 2] if ls else None,
                "load_max_s": ls[-1] if ls else None}


class BlockStore:
    """The tiers of ``spec`` for blocks of ``block_bytes`` (``block_tokens`` tokens each;
    see the module docstring). ``request_blocks``: the most blocks one request stores (the
    engine's longest prompt), room each tier keeps beyond its capacity while a request is
    served. ``identity`` names the blocks on durable media (model, dtype, tokens/block,
    tp): a place holding other blocks is refused unless ``spec.reformat``."""

    def __init__(self, spec: StoreSpec, *, block_bytes: int, block_tokens: int,
                 request_blocks: int, identity: Geometry,
                 on_event: Callable[[str], None] | None = None) -> None:
        from kvtool.replay.config import build_config, load_tiers_file

        self.spec = spec
        self.block_bytes = block_bytes
        self.block_tokens = block_tokens
        self.identity = identity
        self.on_event = on_event
        tf = load_tiers_file(spec.tiers) if spec.tiers else None
        cfg = build_config({"dram": spec.dram, "nvme": spec.nvme}, policy=spec.policy,
                           write_policy=spec.write_policy, tiers_file=tf)
        if any(t.name == "gpu" for t in cfg.tiers):
            raise UsageError("the engine's own KV cache is the GPU tier: give dram and nvme "
                             "tiers only", field="tiers")
        self._lock = threading.RLock()
        self.data_tiers, cfg, self.unavailable = _open_tiers(
            cfg, spec, block_bytes, block_tokens, request_blocks, identity)
        for why in self.unavailable.values():
            if on_event is not None:
                on_event(f"{why}; going on without it (its blocks are misses)")
        self.config = cfg
        names = [t.name for t in cfg.tiers] if cfg is not None else []
        self.names = names
        try:
            self.mover = DataMover(names, self.data_tiers,
                                   holds=self._holds,
                                   source="engine", on_tier_error=spec.on_tier_error,
                                   checksums=True, on_event=on_event)
            self.hierarchy: TierHierarchy | None = (
                cfg.build(block_bytes, block_tokens, {n: self.mover for n in names})
                if cfg is not None else None)
            self.reopened = self._adopt()
        except BaseException:
            for t in self.data_tiers.values():
                t.close()
            raise
        self.counters = DataCounters()
        self.per_tier = {n: TierCounters() for n in names}
        self.stats = RoundStats(len(names))
        self.problems: list[dict[str, Any]] = []
        self.lookups = 0
        self.lookup_blocks = 0
        self.commits = 0
        self._last_commit = time.monotonic()
        self._sessions: dict[Any, int] = {}
        self._anonymous = 0
        self._stale: list[tuple[str, int]] = []
        """(tier, key) of copies that failed their check: rewritten at the next save."""
        self._removed: set[int] = set()
        """Keys :meth:`remove` dropped while a tier's metadata still holds them: misses
        until a save stores them again."""
        self.closed = False

    def _holds(self, j: int, key: int) -> bool:
        return self.hierarchy is not None and key in self.hierarchy.tiers[j]

    # ------------------------------------------------------------------ opening
    def _adopt(self) -> dict[str, int]:
        """Durable tiers: what their places already held joins the hierarchy's metadata
        (each tier's policy admits it) with the checksums it was stored with; a tier that
        now holds more than its capacity evicts the overflow."""
        found: dict[str, int] = {}
        crcs = self.mover.crcs
        assert crcs is not None
        if self.hierarchy is None:
            return found
        for i, name in enumerate(self.names):
            tier = self.data_tiers[name]
            persisted = getattr(tier, "persisted_crcs", None)
            if persisted is None:
                continue
            held = persisted()
            if not held:
                continue
            h_tier = self.hierarchy.tiers[i]
            h_tier.policy.admit(list(held))
            crcs[name].update(held)
            found[name] = len(held)
            over = h_tier.overflow()
            if over:
                out = h_tier.policy.evict(over)
                tier.evict(out)
                for key in out:
                    crcs[name].pop(key, None)
        return found

    # ------------------------------------------------------------------ engine calls
    def lookup(self, keys: Sequence[int]) -> list[str]:
        """The tier of each leading block some live tier holds (stops at the first block
        none holds): what the engine can load instead of computing."""
        with self._lock:
            self.lookups += 1
            self.lookup_blocks += len(keys)
            if self.hierarchy is None:
                return []
            src = self.hierarchy.lookup(list(keys))
            dead = self.mover.dead
            names = self.names
            removed = self._removed
            out = []
            for p, j in enumerate(src):
                if removed and keys[p] in removed:
                    break
                name = names[j]
                if name in dead:  # a lower live tier may still hold it
                    key = keys[p]
                    name = next((n for i, n in enumerate(names) if i > j and n not in dead
                                 and key in self.hierarchy.tiers[i]), "")
                    if not name:
                        break
                out.append(name)
            return out

    def load(self, keys: Sequence[int], where: Sequence[str],
             dsts: Sequence[np.ndarray]) -> list[bool]:
        """Load ``keys[i]`` (found in tier ``where[i]`` by :meth:`lookup`) into ``dsts[i]``
        (uint8 arrays of ``block_bytes``); each block is checked, and a bad one is loaded
        from a lower tier holding a good copy. Returns whether each block arrived good:
        a ``False`` block must be recomputed (it is counted, never served)."""
        with self._lock:
            if not keys:
                return []
            t0 = time.perf_counter()
            failures = self.mover.load(keys, where, dsts, None, self.counters, self._problem)
            ok = [True] * len(keys)
            served = list(where)
            for f in failures:
                ok[f.pos] = f.served is not None
                served[f.pos] = f.served or ""
                self._stale.append((f.tier, keys[f.pos]))
            dt = time.perf_counter() - t0
            for name in set(served):
                if not name:
                    continue
                c = self.per_tier[name]
                n = served.count(name)
                c.hit_blocks += n
                c.loaded_bytes += n * self.block_bytes
                c.load_seconds.append(dt)
            return ok

    def save(self, keys: Sequence[int], input_length: int, source: Callable[[int], np.ndarray],
             session: Any = None) -> None:
        """A request's prompt blocks are computed (or loaded) in the engine: the hierarchy
        serves the request (touch, store, promote, evict) and the mover stores what it
        decides from ``source(key)`` (the block's bytes, copied out of the engine's KV
        cache); copies that failed their check earlier are rewritten. Stores complete in
        the background; :meth:`commit` makes them durable."""
        with self._lock:
            if self.hierarchy is None:
                return
            st = RoundStats(len(self.names))
            if session is None:  # each session-less request is a session of its own
                self._anonymous += 1
                sid = (1 << 40) + self._anonymous
            else:
                sid = self._sessions.setdefault(session, len(self._sessions))
            self.mover.begin(source)
            try:
                self.hierarchy.serve(list(keys), input_length, self.block_tokens, sid, st)
                if self._stale:
                    mine = set(keys)
                    fix = [(t, k) for t, k in self._stale if k in mine]
                    self._stale = [(t, k) for t, k in self._stale if k not in mine]
                    self.mover.repair(fix, self.counters)
                if self._removed:
                    self._removed.difference_update(keys)
            finally:
                self.mover.end()
            self.stats.add(st)

    def remove(self, keys: Sequence[int]) -> int:
        """Drop ``keys`` from every tier (an engine's explicit removal, not an eviction):
        each copy is freed (a durable tier's at the next :meth:`commit`) and the keys are
        misses until a save stores them again. Returns how many of them a tier held."""
        with self._lock:
            crcs = self.mover.crcs
            assert crcs is not None
            n = 0
            if self.hierarchy is None:
                return 0
            for key in keys:
                if key in self._removed:
                    continue
                held = [name for i, name in enumerate(self.names)
                        if key in self.hierarchy.tiers[i]]
                if not held:
                    continue
                n += 1
                self._removed.add(key)
                for name in held:
                    if name not in self.mover.dead:
                        self.data_tiers[name].evict([key])
                    crcs[name].pop(key, None)
                    self._stale.append((name, key))  # the next save rewrites it
            return n

    def held(self) -> list[int]:
        """Every key some live tier holds (each once; a removed key is not held)."""
        with self._lock:
            seen: dict[int, None] = {}
            if self.hierarchy is None:
                return []
            for i, name in enumerate(self.names):
                if name not in self.mover.dead:
                    seen.update(dict.fromkeys(self.hierarchy.tiers[i].policy.index))
            return [k for k in seen if k not in self._removed]

    def step_done(self) -> int:
        """An engine step has stored what it stores: complete the stores in flight, and
        :meth:`commit` once ``spec.commit_interval`` seconds have passed since the last
        commit (a group commit: a commit is a flush, an index write and a flush, which on
        a real device cost more than a step's writes). Returns the blocks committed."""
        with self._lock:
            if time.monotonic() - self._last_commit >= self.spec.commit_interval:
                return self.commit()
            self.mover.drain()
            return 0

    def commit(self) -> int:
        """Complete the stores in flight and commit the durable tiers' new blocks and
        evictions (one batch of the store's protocol each); returns blocks committed."""
        with self._lock:
            n = 0
            self._last_commit = time.monotonic()
            self.mover.drain()
            for name, tier in self.data_tiers.items():
                pending = getattr(tier, "commit_pending", None)
                if pending is None or name in self.mover.dead:
                    continue
                try:
                    n += pending()
                except TierError as err:
                    self.mover.fail(err)
            self.commits += 1
            return n

    def _problem(self, kind: str, key: int, tier: str) -> None:
        if len(self.problems) < 100:
            self.problems.append({"kind": kind, "key": key, "tier": tier})

    # ------------------------------------------------------------------ report
    def report(self) -> dict[str, Any]:
        """Counters since the store was opened (schema :data:`SCHEMA`)."""
        with self._lock:
            tiers = []
            for name in self.names:
                dt = self.data_tiers[name]
                assert self.hierarchy is not None
                # stores from the engine complete in the background: count the completed
                # ones (a store's link is counted when it completes, by a later save or a
                # commit)
                link = self.mover.measured.link(f"{name}<-engine")
                c = self.per_tier[name]
                c.stored_blocks, c.stored_bytes = link.blocks, link.bytes
                tiers.append({"name": name, "backend": dt.backend, "url": dt.url,
                              "slots": dt.slots, "held_blocks": len(self.hierarchy.tiers[
                                  self.names.index(name)]),
                              "reopened_blocks": self.reopened.get(name, 0),
                              "failed": self.mover.dead.get(name),
                              **self.per_tier[name].to_dict()})
            for name, why in self.unavailable.items():
                tiers.append({"name": name, "backend": None, "url": None, "slots": 0,
                              "held_blocks": 0, "reopened_blocks": 0, "failed": why,
                              **TierCounters().to_dict()})
            return {"schema": SCHEMA, "block_bytes": self.block_bytes,
                    "block_tokens": self.block_tokens, "tiers": tiers,
                    "lookups": self.lookups, "commits": self.commits,
                    **self.counters.to_dict(), "problems": list(self.problems),
                    "links": self.mover.measured.to_dict()["links"]}

    def close(self) -> None:
        """Complete and commit what is in flight, then close every tier (idempotent)."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            with contextlib.suppress(TierFailed, TierError):
                self.commit()
            self.mover.close()

    def __enter__(self) -> BlockStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Unreachable(Exception):
    """A tier's place could not be opened (one line: why)."""


def _open_tiers(cfg: Any, spec: StoreSpec, block_bytes: int, block_tokens: int,
                request_blocks: int, identity: Geometry
                ) -> tuple[dict[str, DataTier], Any, dict[str, str]]:
    """Open the data tiers of ``cfg``; return them, ``cfg`` with the tiers that opened and
    their capacities resolved to blocks (a place without a size: what it holds, less one
    request's room), and why each other tier did not open. A place that cannot be opened
    (a target down, refused credentials, a pool in use, a store of other blocks) is an
    error with ``on_tier_error = fail``, else a tier that is not there (its blocks miss)."""
    import msgspec

    from kvtool.cache.replayer import CacheConfig

    head = request_blocks + 1
    tiers: dict[str, DataTier] = {}
    unavailable: dict[str, str] = {}
    specs = []
    try:
        for ts in cfg.tiers:
            try:
                tier, cap = _open_tier(ts, spec, block_bytes, block_tokens, head, identity)
            except _Unreachable as exc:
                if spec.on_tier_error == "fail":
                    raise UsageError(str(exc), field=ts.name) from None
                unavailable[ts.name] = str(exc)
                continue
            tiers[ts.name] = tier
            specs.append(msgspec.structs.replace(ts, capacity=Capacity(cap, "blocks")))
    except BaseException:
        for t in tiers.values():
            t.close()
        raise
    return (tiers, CacheConfig(specs, cfg.write_policy, cfg.label) if specs else None,
            unavailable)


def _open_tier(ts: Any, spec: StoreSpec, block_bytes: int, block_tokens: int, head: int,
               identity: Geometry) -> tuple[DataTier, int]:
    """One tier and its capacity in blocks; :class:`_Unreachable` when its place cannot
    be opened, :class:`UsageError` when it is not described right."""
    from kvtool.nvme.hostauth import HostCredentials
    from kvtool.replay.run import nvme_engine
    from kvtool.tiers.dram import DramTier
    from kvtool.tiers.nvme import NvmeTier

    if ts.name == "dram":
        if ts.capacity.unit == "inf":
            raise UsageError("the DRAM tier holds real bytes: give it a size (example: 1GiB, "
                             "or 1GiB@/dev/shm/kvtool-pool)", field="dram")
        cap = int(ts.blocks(block_bytes, block_tokens))
        place = ts.place
        try:
            if place is not None and place.startswith("mooncake://"):
                from kvtool.tiers.mooncake import MooncakeTier

                return MooncakeTier(place, slots=cap + head, block_bytes=block_bytes,
                                    run_id=_mooncake_prefix(identity), durable=True), cap
            if place is not None:
                from kvtool.tiers.shm import ShmDramTier

                return ShmDramTier(place, cap + head, block_bytes,
                                   identity=(identity.model, identity.dtype,
                                             identity.block_tokens, identity.tp)), cap
        except Exception as exc:
            raise _Unreachable(f"dram tier ({place}): {_line(exc)}") from None
        return DramTier(cap + head, block_bytes), cap
    place = ts.place
    if place is None:
        raise UsageError("the NVMe tier needs a place: a file (SIZE@/var/tmp/kv.img), a block "
                         "device or an nvme+tcp:// URL", field="nvme")
    want = ts.blocks(block_bytes, block_tokens)
    creds = HostCredentials.load(spec.hostnqn, spec.dhchap_secret, spec.dhchap_ctrl_secret)
    create = None
    if not place.startswith("nvme+") and want != math.inf:
        import os

        if not os.path.exists(place):
            create = (int(want) + head) * -(-block_bytes // 4096) * 4096 + (64 << 20)
    try:
        engine = nvme_engine(place, create, spec.read_qd, creds)
    except Exception as exc:
        raise _Unreachable(f"nvme tier ({place}): {_line(exc)}") from None
    try:
        tier = NvmeTier(engine, block_bytes=block_bytes, url=place,
                        max_slots=None if want == math.inf else int(want) + head,
                        read_qd=spec.read_qd, geometry=identity, durable=True,
                        reformat=spec.reformat)
    except Exception as exc:
        engine.close()
        raise _Unreachable(_line(exc)) from None
    if tier.slots <= head:
        tier.close()
        raise UsageError(f"{place} holds {tier.slots} blocks of {block_bytes:,} B, not more "
                         f"than the {head} one request needs", field="nvme")
    cap = tier.slots - head if want == math.inf else min(int(want), tier.slots - head)
    return tier, cap


def _line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0]


def _mooncake_prefix(identity: Geometry) -> str:
    """A Mooncake key prefix every process storing these blocks agrees on."""
    from hashlib import blake2b

    h = blake2b(f"{identity.model}|{identity.dtype}|{identity.block_tokens}|{identity.tp}"
                .encode(), digest_size=6).hexdigest()
    return f"engine-{h}"
