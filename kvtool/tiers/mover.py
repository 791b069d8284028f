"""The data mover: a tier hierarchy's decisions carried out on tiers that hold real bytes.

:class:`DataMover` is the :class:`~kvtool.cache.tier.TierMover` of a
:class:`~kvtool.cache.hierarchy.TierHierarchy` whose tiers are :class:`DataTier`\\ s. The
hierarchy decides *which* blocks live where (lookup, store/touch, promotion, write policy,
eviction); the mover moves the bytes and proves them. Two users share it, so a tier's
semantics live in one place:

* a data-mode replay (:mod:`kvtool.replay.data`): the top tier is its CPU "GPU" pool,
  and the bytes of a request's blocks are rows of that pool;
* an inference engine's connector (:mod:`kvtool.integrations`): the engine's own KV cache
  is the top tier (not in the hierarchy), and the bytes of a request's blocks are copied
  out of it.

Per request, the caller:

1. **loads** the hit blocks the hierarchy's lookup placed in the lower tiers
   (:meth:`DataMover.load`): NVMe reads first (``read_qd`` in flight), DRAM copies
   meanwhile; every block is checked (``check(key, block)``: a deterministic payload; or,
   with ``checksums``, against the CRC32C of the bytes that were stored in that tier:
   the mover takes it as it stores them, per tier, since two tiers may hold copies made
   at different times); a corrupt or lost block is counted, named, and loaded from a lower tier that
   holds a good copy, else left to the caller to recompute;
2. calls the hierarchy's ``serve`` between :meth:`begin` (``source(key)``: the bytes of
   any block of this request) and :meth:`end`: each insert into a data tier is stored from
   ``source`` (puts and promotions) or, for a write-back demotion, from the copy the tier
   above just evicted; evictions are deferred to :meth:`end`, so those copies stay valid;
   stores stay in flight and complete during the next request (as vLLM's offloading
   connector overlaps them);
3. :meth:`repair`\\ s the stale copy of every block that failed its check.

A tier's medium failing raises :class:`~kvtool.tiers.base.TierError`; with
``on_tier_error="fail"`` the mover raises :class:`TierFailed`, with ``"recompute"`` the
tier is treated as empty from then on (its hits are recomputed).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import numpy as np

from kvtool.cache.stats import percentile
from kvtool.errors import CheckFailed, param
from kvtool.store.checksum import crc32c
from kvtool.tiers.base import DataTier, Link, TierError, TransferJob
from kvtool.tiers.dram import DramTier
from kvtool.tiers.option import ON_TIER_ERROR


class TierFailed(CheckFailed):
    """A tier's medium failed mid-run and ``on_tier_error="fail"`` stops the run (exit 1)."""


@dataclass
class DataCounters:
    """Per round (and total): what the content checks found."""

    verified_blocks: int = 0
    corrupt_blocks: int = 0
    lost_blocks: int = 0
    recomputed_blocks: int = 0
    """Hit blocks that could not be served from any tier and were recomputed."""
    repaired_blocks: int = 0
    """Stale copies rewritten after a corrupt or lost load."""

    def add(self, other: DataCounters) -> None:
        for k in ("verified_blocks", "corrupt_blocks", "lost_blocks", "recomputed_blocks",
                  "repaired_blocks"):
            setattr(self, k, getattr(self, k) + getattr(other, k))

    def to_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


@dataclass
class Interval:
    """Wall seconds a link was busy: the union of its transfers' [start, end] intervals."""

    seconds: float = 0.0
    last_end: float = 0.0

    def add(self, start: float, end: float) -> float:
        lo = max(start, self.last_end)
        busy = max(0.0, end - lo)
        self.seconds += busy
        self.last_end = max(self.last_end, end)
        return busy


@dataclass
class Measured:
    """Measured figures of one data-mode run."""

    links: dict[str, Link] = field(default_factory=dict)
    load_s: list[float] = field(default_factory=list)
    verify_s: float = 0.0
    compute_s: float = 0.0
    busy_s: float = 0.0
    """Main-thread seconds spent moving, checking or generating bytes (the rest of the
    wall time is the caller's own overhead)."""
    wall_s: float = 0.0
    blocks: int = 0

    def link(self, name: str) -> Link:
        lk = self.links.get(name)
        if lk is None:
            lk = self.links[name] = Link()
        return lk

    def to_dict(self) -> dict[str, Any]:
        overhead = max(0.0, self.wall_s - self.busy_s)
        ls = sorted(self.load_s)
        return {
            "links": {k: v.to_dict() for k, v in sorted(self.links.items())},
            "load_s": {"total": sum(ls), "p50": percentile(ls, 50), "p99": percentile(ls, 99)},
            "verify_s": self.verify_s,
            "generate_s": self.compute_s,
            "wall_s": self.wall_s,
            "blocks": self.blocks,
            "overhead_us_per_block": (overhead / self.blocks * 1e6) if self.blocks else None,
        }


class TopPool(Protocol):
    """A top tier that is not a :class:`DataTier` (the replay's GPU pool): the blocks the
    hierarchy caches there are already in it."""

    def cache(self, keys: list[int]) -> None:
        """The hierarchy inserted ``keys`` (blocks of the current request)."""

    def evict(self, keys: list[int]) -> dict[int, np.ndarray]:
        """The hierarchy evicted ``keys``: forget them and return their bytes (valid until
        :meth:`DataMover.end`), for a write-back demotion into the tier below."""


class Failure(NamedTuple):
    """A block that failed to load from the tier the lookup placed it in."""

    pos: int
    """Its position in the load's ``keys``."""
    tier: str
    kind: str
    """``corrupt`` (the check failed) or ``lost`` (the tier no longer had it)."""
    served: str | None
    """The lower tier that served a good copy instead; None: recompute it."""


Check = Callable[[int, np.ndarray], bool]
"""``check(key, block)``: whether ``block`` holds the right bytes for ``key`` (None: the
CRC32C the mover recorded when it stored the block in that tier, ``checksums=True``)."""

Problem = Callable[[str, int, str], None]
"""``problem(kind, key, tier)``: a block failed (``corrupt`` or ``lost``) in ``tier``."""


class DataMover:
    """Moves the bytes behind a :class:`~kvtool.cache.hierarchy.TierHierarchy` (see the
    module docstring). ``names``: the hierarchy's tier names, top first; ``tiers``: the
    data tier of each lower name (and of the top one unless ``top`` stands for it);
    ``holds(i, key)``: whether the hierarchy's tier ``i`` holds ``key`` (its metadata).
    A load or recovery returns :class:`Failure` records."""

    def __init__(self, names: Sequence[str], tiers: dict[str, DataTier], *,
                 holds: Callable[[int, int], bool], top: TopPool | None = None,
                 source: str = "gpu", on_tier_error: str = "fail", checksums: bool = False,
                 on_event: Callable[[str], None] | None = None) -> None:
        if on_tier_error not in ON_TIER_ERROR:
            raise ValueError(f"on_tier_error must be one of {ON_TIER_ERROR}")
        self.names = list(names)
        self.tiers = tiers
        self.holds = holds
        self.top = top
        self.source = source
        """The name of where a request's blocks are (its links are ``TIER<-source`` and
        ``source<-TIER``): the GPU pool, or the engine's KV cache."""
        self.on_tier_error = on_tier_error
        self.on_event = on_event
        self.measured = Measured()
        self.crcs: dict[str, dict[int, int]] | None = (
            {name: {} for name in tiers} if checksums else None)
        """``checksums``: per tier, the CRC32C of each block it holds, as stored."""
        self._req_crcs: dict[int, int] = {}
        self.dead: dict[str, str] = {}
        """Tiers whose medium failed (``recompute``): name → the error."""
        self._busy: dict[str, Interval] = {}
        self._source: Callable[[int], np.ndarray] | None = None
        self._evicted: dict[str, dict[int, np.ndarray]] = {}
        self._evicting = False
        self._defer: dict[str, list[int]] = {}
        self._stores: list[tuple[DataTier, TransferJob, str]] = []
        self._prev_stores: list[tuple[DataTier, TransferJob, str]] = []

    # ------------------------------------------------------------------ failures
    def fail(self, err: TierError) -> None:
        """A tier's medium failed: stop (``fail``) or go on without it (``recompute``)."""
        if self.on_tier_error == "fail":
            raise TierFailed(f"{err}; stopped ({param('on_tier_error')} recompute goes on "
                             "without the tier)") from None
        if err.tier not in self.dead:
            self.dead[err.tier] = str(err)
            if self.on_event is not None:
                self.on_event(f"{err}; going on with the {err.tier} tier treated as empty "
                              "(its hits are recomputed)")

    def alive(self, name: str) -> bool:
        return name in self.tiers and name not in self.dead

    def interval(self, link: str, start: float, end: float) -> float:
        """Add [start, end] to ``link``'s busy time; return the seconds it added."""
        iv = self._busy.get(link)
        if iv is None:
            iv = self._busy[link] = Interval()
        return iv.add(start, end)

    # ------------------------------------------------------------------ loads
    def load(self, keys: Sequence[int], where: Sequence[str], dsts: Sequence[np.ndarray],
             check: Check | None, counters: DataCounters, problem: Problem) -> list[Failure]:
        """Load ``keys[i]`` from tier ``where[i]`` into ``dsts[i]`` and check each block.

        Lowest tier first, so NVMe reads are in flight during DRAM copies. A block that is
        lost or fails ``check`` is counted in ``counters``, named through ``problem``, and
        loaded from a lower tier holding a good copy (:meth:`recover`). Returns a
        :class:`Failure` for every block not served from ``where[i]`` (its ``served``
        None: no tier had a good copy; the caller recomputes it). Links are named
        ``{source}<-{tier}``."""
        by_tier: dict[str, list[int]] = {}
        for i, name in enumerate(where):
            by_tier.setdefault(name, []).append(i)
        failed: list[tuple[int, str, str]] = []  # (i, tier, "corrupt" | "lost")
        jobs = []
        for name in reversed(self.names):
            ps = by_tier.get(name)
            if not ps:
                continue
            tier = self.tiers[name]
            if name in self.dead:
                failed.extend((i, name, "lost") for i in ps)
                continue
            start = time.perf_counter()
            try:
                job = tier.prepare_load([keys[i] for i in ps], [dsts[i] for i in ps],
                                        checksum=check is None)
            except TierError as err:
                self.fail(err)
                failed.extend((i, name, "lost") for i in ps)
                continue
            jobs.append((name, tier, job, ps, start))
        for name, tier, job, ps, start in jobs:
            try:
                ok = tier.complete_load(job)
            except TierError as err:
                self.fail(err)
                failed.extend((i, name, "lost") for i in ps)
                continue
            end = time.perf_counter()
            n_ok = sum(ok)
            link = f"{self.source}<-{name}"
            self.measured.link(link).add(n_ok, n_ok * tier.block_bytes,
                                         self.interval(link, start, end))
            t_v = time.perf_counter()
            crcs = job.crcs
            for k, (i, good) in enumerate(zip(ps, ok, strict=True)):
                if not good:
                    failed.append((i, name, "lost"))
                elif not self._good(check, name, keys[i], dsts[i],
                                    crcs[k] if crcs is not None else None):
                    failed.append((i, name, "corrupt"))
                else:
                    counters.verified_blocks += 1
            self.measured.verify_s += time.perf_counter() - t_v
        if not failed:
            return []
        return self.recover(failed, keys, dsts, check, counters, problem)

    def recover(self, failed: list[tuple[int, str, str]], keys: Sequence[int],
                dsts: Sequence[np.ndarray], check: Check | None, counters: DataCounters,
                problem: Problem) -> list[Failure]:
        """Each failed block: counted and named, then loaded from a lower tier holding a
        good copy, else left for the caller to recompute (``served`` None)."""
        names = self.names
        out: list[Failure] = []
        for i, name, kind in sorted(failed):
            key, block = keys[i], dsts[i]
            if kind == "corrupt":
                counters.corrupt_blocks += 1
            else:
                counters.lost_blocks += 1
            problem(kind, key, name)
            served: str | None = None
            for j in range(names.index(name) + 1, len(names)):
                lower = names[j]
                tier = self.tiers.get(lower)
                if (tier is None or lower in self.dead or not self.holds(j, key)
                        or key not in tier):
                    continue
                start = time.perf_counter()
                try:
                    job = tier.prepare_load([key], [block])
                    ok = tier.complete_load(job)[0]
                except TierError as err:
                    self.fail(err)
                    continue
                link = f"{self.source}<-{lower}"
                self.measured.link(link).add(int(ok), tier.block_bytes if ok else 0,
                                             self.interval(link, start, time.perf_counter()))
                if not ok:
                    counters.lost_blocks += 1
                    problem("lost", key, lower)
                    continue
                if self._good(check, lower, key, block):
                    counters.verified_blocks += 1
                    served = lower
                    break
                counters.corrupt_blocks += 1
                problem("corrupt", key, lower)
            if served is None:
                counters.recomputed_blocks += 1
            out.append(Failure(i, name, kind, served))
        return out

    def _good(self, check: Check | None, tier: str, key: int, block: np.ndarray,
              crc: int | None = None) -> bool:
        """Whether ``block`` (from ``tier``) is ``key``'s: ``check``, else its CRC32C
        (``crc``, when the tier took it as the block arrived) against the one stored."""
        if check is not None:
            return check(key, block)
        assert self.crcs is not None, "a load without a check needs checksums=True"
        want = self.crcs[tier].get(key)
        return want is not None and (crc32c(block) if crc is None else crc) == want

    # ------------------------------------------------------------------ one request
    def begin(self, source: Callable[[int], np.ndarray]) -> None:
        """Before the hierarchy serves a request: ``source(key)`` gives the bytes of any
        block of that request (computed, or loaded and checked)."""
        self._source = source
        self._req_crcs.clear()
        self._evicted.clear()
        self._evicting = False

    def repair(self, moved: Sequence[tuple[str, int]], counters: DataCounters) -> None:
        """Rewrite, from the request's good bytes, the stale copy of each ``(tier, key)``
        whose load failed, where the hierarchy still has the tier hold it."""
        names = self.names
        for frm, key in moved:
            i = names.index(frm)
            if i == 0 and self.top is not None:
                continue
            if frm in self.dead or frm not in self.tiers or not self.holds(i, key):
                continue
            self._store(frm, [key], self.source)
            counters.repaired_blocks += 1

    def end(self) -> None:
        """After the request: complete the previous request's stores (this one's stay in
        flight) and free what the tiers evicted."""
        t_f = time.perf_counter()
        self._finish_stores()
        for name, ks in self._defer.items():
            if name in self.tiers and name not in self.dead:
                self.tiers[name].evict(ks)
            if self.crcs is not None and name in self.crcs:
                held = self.crcs[name]
                tier = self.tiers[name]
                for key in ks:
                    if key not in tier:  # (evicted, not stored again in this request)
                        held.pop(key, None)
        self.measured.busy_s += time.perf_counter() - t_f
        self._defer.clear()
        self._evicted.clear()
        self._source = None

    # ------------------------------------------------------------------ stores
    def _store(self, name: str, keys: list[int], frm: str, demote: bool = False) -> None:
        """Store ``keys`` into tier ``name``: from the request's blocks (``source``), or,
        for a write-back demotion, from the copies tier ``frm`` just evicted."""
        tier = self.tiers[name]
        if name in self.dead:
            return
        if not demote:
            source = self._source
            if source is None:
                raise RuntimeError("DataMover: a store outside begin()/end()")
            srcs = [source(key) for key in keys]
        else:
            rows = self._evicted[frm]
            srcs = [rows[key] for key in keys]
        if self.crcs is not None:
            held = self.crcs[name]
            if demote:
                above = self.crcs.get(frm, {})
                for key, row in zip(keys, srcs, strict=True):
                    crc = above.get(key)
                    held[key] = crc32c(row) if crc is None else crc
            else:
                taken = self._req_crcs
                for key, row in zip(keys, srcs, strict=True):
                    crc = taken.get(key)
                    if crc is None:
                        crc = taken[key] = crc32c(row)
                    held[key] = crc
        start = time.perf_counter()
        try:
            if self.crcs is not None:
                # the checksums the loads will be checked against are the ones a tier
                # records with the blocks (one pass over the bytes, not two)
                held = self.crcs[name]
                job = tier.prepare_store(keys, srcs, crcs=[held[k] for k in keys])
            else:
                job = tier.prepare_store(keys, srcs)
        except TierError as err:
            self.fail(err)
            return
        finally:
            self.measured.busy_s += time.perf_counter() - start
        job.started = start
        link = f"{name}<-{frm}"
        if not job.futures:  # synchronous: done now
            self.measured.link(link).add(len(keys), job.nbytes,
                                         self.interval(link, start, time.perf_counter()))
        else:
            for f in job.futures:
                f.add_done_callback(_stamp(job.ends))
        self._stores.append((tier, job, link))

    def _finish_stores(self) -> None:
        """Complete the stores of the previous request; keep this request's in flight."""
        for tier, job, link in self._prev_stores:
            self._complete(tier, job, link)
        self._prev_stores, self._stores = self._stores, []

    def _complete(self, tier: DataTier, job: TransferJob, link: str) -> None:
        if tier.name in self.dead:
            return
        try:
            tier.complete_store(job)
        except TierError as err:
            self.fail(err)
            return
        if job.futures:
            end = max(job.ends) if job.ends else time.perf_counter()
            self.measured.link(link).add(len(job.keys), job.nbytes,
                                         self.interval(link, job.started, end))

    def drain(self) -> None:
        """Complete every store still in flight (end of the run, or before a report)."""
        for tier, job, link in self._prev_stores + self._stores:
            self._complete(tier, job, link)
        self._prev_stores, self._stores = [], []

    # ------------------------------------------------------------------ hierarchy hooks
    def on_read(self, tier: str, keys: list[int]) -> None:
        return None  # loads happened before the metadata step (and were checked)

    def on_write(self, tier: str, keys: list[int]) -> None:
        if self.top is not None and tier == self.names[0]:
            self.top.cache(keys)
            return
        if self._evicting:
            # write-back: the hierarchy demotes what the tier above just evicted
            self._store(tier, keys, self.names[self.names.index(tier) - 1], demote=True)
        else:
            self._store(tier, keys, self.source)

    def on_evict(self, tier: str, keys: list[int]) -> None:
        self._evicting = True
        # the evicted copies stay valid until end() (nothing allocates or frees before
        # then), so a write-back demotion can copy from them
        if self.top is not None and tier == self.names[0]:
            self._evicted.setdefault(tier, {}).update(self.top.evict(keys))
            return
        rows = self._evicted.setdefault(tier, {})
        dt = self.tiers.get(tier)
        if isinstance(dt, DramTier):
            for key in keys:
                if key in dt:
                    rows[key] = dt.row(key)
        self._defer.setdefault(tier, []).extend(keys)

    # ------------------------------------------------------------------ end of a run
    def persist(self) -> None:
        """End of a run (or a clean stop): commit every data tier that keeps a store, so
        its blocks outlive the run (``kvtool verify`` of the NVMe place checks them)."""
        self.drain()
        for name, tier in self.tiers.items():
            commit = getattr(tier, "commit", None)
            if commit is None or name in self.dead:
                continue
            try:
                commit()
            except TierError as err:
                self.fail(err)

    def close(self) -> None:
        with contextlib.suppress(TierFailed, TierError):
            self.drain()
        for t in self.tiers.values():
            with contextlib.suppress(Exception):  # closing after a failure must not mask it
                t.close()


def _stamp(ends: list[float]) -> Callable[[Any], None]:
    """A done-callback recording when a transfer completed (measured link time)."""
    def done(_f: Any) -> None:
        ends.append(time.perf_counter())
    return done
