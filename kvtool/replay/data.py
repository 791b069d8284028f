"""Data mode: the replayer's decisions carried out on tiers that hold real bytes.

:class:`DataReplayer` is a :class:`~kvtool.cache.replayer.Replayer` whose hierarchy has a data
mover attached: the same lookup, store/touch, promotion and eviction decide *which*
blocks live where (so hit tokens per tier equal ``--simulate`` exactly), and this module
moves the bytes. Per request:

1. **lookup** (metadata): the leading blocks held somewhere, each in its highest tier;
2. **load**: the request's blocks get GPU-pool blocks (vLLM semantics: GPU hits are
   referenced in place; loaded hits and computed blocks are allocated); hits in DRAM and
   NVMe are loaded (NVMe reads first, ``read_qd`` in flight, DRAM copies meanwhile) and
   **every block arriving in the GPU pool is checked** against its deterministic payload
   (a function of the chain hash and the seed). A mismatch or a lost object is never
   served: it is counted and named, the block is loaded from a lower tier that holds it
   or recomputed, and the stale copy is rewritten;
3. **compute** (modelled time): the missed blocks are written into the pool (their
   payload);
4. **store** (metadata + data): the hierarchy inserts, promotes and evicts; each insert
   into DRAM or NVMe is copied from the GPU pool (write-through puts and promotions) or
   from the evicting tier (write-back demotions). NVMe writes stay in flight and complete
   during the next request, as vLLM's offloading connector overlaps stores;
5. release: the request's GPU references are dropped; evicted space is freed.

Loads are measured (seconds per link), prefill is modelled: TTFT = measured load time +
recomputed tokens / prefill rate.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvtool.cache.replayer import CacheConfig, Replayer, RequestLike, RequestOutcome, outcome
from kvtool.cache.stats import RoundStats, percentile
from kvtool.errors import CheckFailed, param
from kvtool.replay.config import ON_TIER_ERROR
from kvtool.store.payload import Payload, equal
from kvtool.tiers.base import DataTier, Link, TierError, TransferJob
from kvtool.tiers.dram import DramTier
from kvtool.tiers.gpu import GpuBlockPool

MAX_NAMED = 100
"""Corrupt or lost blocks named individually in a report (the rest are counted)."""


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
class _Interval:
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
    wall time is the replay's own overhead)."""
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


class DataReplayer(Replayer):
    """A replay whose tiers hold real bytes (see the module docstring).

    ``tiers`` maps ``dram``/``nvme`` to their :class:`~kvtool.tiers.base.DataTier`; the
    GPU tier is the pool itself (``gpu_blocks`` cached blocks, plus ``work_blocks`` for the
    longest request). ``on_tier_error``: ``fail`` raises :class:`TierFailed`;
    ``recompute`` goes on with the failed tier treated as empty.
    """

    def __init__(self, config: CacheConfig, block_tokens: int, block_bytes: int, *,
                 tiers: dict[str, DataTier], work_blocks: int, seed: int = 0,
                 on_tier_error: str = "fail",
                 on_event: Callable[[str], None] | None = None,
                 on_request: Callable[[RequestOutcome], None] | None = None) -> None:
        if on_tier_error not in ON_TIER_ERROR:
            raise ValueError(f"on_tier_error must be one of {ON_TIER_ERROR}")
        self.data_tiers = tiers
        self.bb = block_bytes
        self.seed = seed
        self.on_tier_error = on_tier_error
        self.on_event = on_event
        super().__init__(config, block_tokens, block_bytes, on_request=on_request,
                         movers={t.name: self for t in config.tiers})
        names = self.names
        gpu_cap = 0
        if names[0] == "gpu":
            cap = self.cache.tiers[0].capacity
            gpu_cap = int(cap)
        self.gpu = GpuBlockPool(gpu_cap + work_blocks, block_bytes)
        self.payload = Payload(block_bytes, seed)
        self._scratch = np.empty(block_bytes, dtype=np.uint8)
        self.measured = Measured()
        self.data_rounds: dict[int, DataCounters] = {}
        self.named: list[dict[str, Any]] = []
        self.dead: dict[str, str] = {}
        self._busy: dict[str, _Interval] = {}
        self._work: dict[int, int] = {}
        self._hits: set[int] = set()
        self._src: dict[int, str] = {}
        self._evicted: dict[str, dict[int, np.ndarray]] = {}
        self._evicting = False
        self._defer: dict[str, list[int]] = {}
        self._stores: list[tuple[DataTier, TransferJob, str]] = []
        self._prev_stores: list[tuple[DataTier, TransferJob, str]] = []
        self._req_line = 0
        self._round = 0
        self._corrupt_now: list[str] = []

    # ------------------------------------------------------------------ failures
    def _fail(self, err: TierError) -> None:
        if self.on_tier_error == "fail":
            raise TierFailed(f"{err}; stopped ({param('on_tier_error')} recompute goes on "
                             "without the tier)") from None
        if err.tier not in self.dead:
            self.dead[err.tier] = str(err)
            if self.on_event is not None:
                self.on_event(f"{err}; going on with the {err.tier} tier treated as empty "
                              "(its hits are recomputed)")

    def _name(self, kind: str, key: int, tier: str, counters: DataCounters) -> None:
        if len(self.named) < MAX_NAMED:
            self.named.append({"kind": kind, "key": key, "tier": tier, "round": self._round,
                               "line": self._req_line})

    # ------------------------------------------------------------------ one request
    def feed(self, req: RequestLike) -> None:
        t_start = time.perf_counter()
        r = req.report_round
        self._round, self._req_line = r, req.line
        round_st = self.rounds.get(r)
        if round_st is None:
            round_st = self.rounds[r] = RoundStats(len(self.names))
        st = RoundStats(len(self.names))  # this request alone, added to its round at the end
        dc = self.data_rounds.get(r)
        if dc is None:
            dc = self.data_rounds[r] = DataCounters()
        if not self.real_rounds and req.round is not None:
            self.real_rounds = True
        keys = req.block_keys
        B = self.block_tokens
        inp = req.input_length
        names = self.names
        gpu = self.gpu
        src = self.cache.lookup(keys, inp)
        k = len(src)
        work = self._work
        work.clear()
        self._hits = set(keys[:k])
        # 1. GPU blocks for every block of the request
        held = [keys[p] for p in range(k) if names[src[p]] == "gpu"]
        for key in held:
            b = gpu.cached[key]
            work[key] = b
        gpu.touch(work.values())
        need = [key for key in dict.fromkeys(keys) if key not in work]
        for key, b in zip(need, gpu.allocate(len(need)), strict=True):
            work[key] = b
        # 2. loads, lowest tier first so NVMe reads are in flight during DRAM copies
        t_load = time.perf_counter()
        by_tier: dict[str, list[int]] = {}
        for p in range(k):
            name = names[src[p]]
            if name != "gpu":
                by_tier.setdefault(name, []).append(p)
        failed: list[tuple[int, str, str]] = []  # (position, tier, "corrupt" | "lost")
        jobs = []
        for name in reversed(names):
            ps = by_tier.get(name)
            if not ps:
                continue
            tier = self.data_tiers[name]
            if name in self.dead:
                failed.extend((p, name, "lost") for p in ps)
                continue
            start = time.perf_counter()
            try:
                job = tier.prepare_load([keys[p] for p in ps],
                                        [gpu.block(work[keys[p]]) for p in ps])
            except TierError as err:
                self._fail(err)
                failed.extend((p, name, "lost") for p in ps)
                continue
            jobs.append((name, tier, job, ps, start))
        for name, tier, job, ps, start in jobs:
            try:
                ok = tier.complete_load(job)
            except TierError as err:
                self._fail(err)
                failed.extend((p, name, "lost") for p in ps)
                continue
            end = time.perf_counter()
            n_ok = sum(ok)
            link = self.measured.link(f"gpu<-{name}")
            link.add(n_ok, n_ok * self.bb, self._interval(f"gpu<-{name}", start, end))
            t_v = time.perf_counter()
            for p, good in zip(ps, ok, strict=True):
                key = keys[p]
                if not good:
                    failed.append((p, name, "lost"))
                elif not self._verify(key, gpu.block(work[key])):
                    failed.append((p, name, "corrupt"))
                else:
                    dc.verified_blocks += 1
            self.measured.verify_s += time.perf_counter() - t_v
        moved: list[tuple[int, str, str | None]] = []
        self._corrupt_now = [name for _p, name, kind in failed if kind == "corrupt"]
        if failed:
            moved = self._recover(failed, keys, src, dc)
        load_s = time.perf_counter() - t_load
        # 3. computed blocks: their payload into the pool
        t_c = time.perf_counter()
        fill = self.payload.fill
        for key in keys[k:]:
            fill(key, gpu.block(work[key]))
        self.measured.compute_s += time.perf_counter() - t_c
        self.measured.busy_s += time.perf_counter() - t_load
        # 4. metadata: insert / promote / evict, with the hooks below moving bytes
        self._evicted.clear()
        self._evicting = False
        per_tier = self.cache.serve(keys, inp, B, self._sid(req.session), st)
        # corrections for blocks that were not served from where the metadata says
        recompute_extra = 0
        for p, frm, to in moved:
            tok = max(0, min(B, inp - p * B))
            i = names.index(frm)
            st.hit_tokens[i] -= tok
            st.hit_blocks[i] -= 1
            per_tier[i] -= 1
            if to is None:
                st.recompute_tokens += tok
                recompute_extra += tok
            else:
                j = names.index(to)
                st.hit_tokens[j] += tok
                st.hit_blocks[j] += 1
                st.blocks_read[j] += 1
                per_tier[j] += 1
        if moved:
            self._repair(moved, keys, dc)
        # 5. release, free, and settle the previous request's stores (overlapped with this one)
        t_f = time.perf_counter()
        self._finish_stores()
        for name, ks in self._defer.items():
            if name in self.data_tiers and name not in self.dead:
                self.data_tiers[name].evict(ks)
        self.measured.busy_s += time.perf_counter() - t_f
        self._defer.clear()
        self._evicted.clear()
        gpu.release(work.values())
        # accounting (the request's TTFT is the serving model's: kvtool.replay.timing)
        st.count_request(inp, req.output_length)
        round_st.add(st)
        if self.on_request is not None:
            corrupt: dict[str, int] = {}
            for tname in self._corrupt_now:
                corrupt[tname] = corrupt.get(tname, 0) + 1
            self.on_request(outcome(req, r, names, st, corrupt=corrupt, load_s=load_s))
        self.measured.load_s.append(load_s)
        self.measured.blocks += len(keys)
        self.measured.wall_s += time.perf_counter() - t_start

    def _sid(self, session: str | int | None) -> int:
        if session is not None:
            sid = self._sessions.get(session)
            if sid is not None:
                return sid
        return self._session_id(session)

    def _interval(self, link: str, start: float, end: float) -> float:
        iv = self._busy.get(link)
        if iv is None:
            iv = self._busy[link] = _Interval()
        return iv.add(start, end)

    def _verify(self, key: int, block: np.ndarray) -> bool:
        self.payload.fill(key, self._scratch)
        return equal(block, self._scratch)

    def _recover(self, failed: list[tuple[int, str, str]], keys: list[int], src: list[int],
                 dc: DataCounters) -> list[tuple[int, str, str | None]]:
        """Each failed block: counted and named, then loaded from a lower tier holding a
        good copy, else recomputed. Returns ``(position, from tier, to tier | None)``."""
        names = self.names
        out: list[tuple[int, str, str | None]] = []
        for p, name, kind in sorted(failed):
            key = keys[p]
            block = self.gpu.block(self._work[key])
            if kind == "corrupt":
                dc.corrupt_blocks += 1
            else:
                dc.lost_blocks += 1
            self._name(kind, key, name, dc)
            served: str | None = None
            for j in range(names.index(name) + 1, len(names)):
                lower = names[j]
                tier = self.data_tiers.get(lower)
                if (tier is None or lower in self.dead or key not in self.cache.tiers[j]
                        or key not in tier):
                    continue
                start = time.perf_counter()
                try:
                    job = tier.prepare_load([key], [block])
                    ok = tier.complete_load(job)[0]
                except TierError as err:
                    self._fail(err)
                    continue
                self.measured.link(f"gpu<-{lower}").add(
                    int(ok), self.bb if ok else 0,
                    self._interval(f"gpu<-{lower}", start, time.perf_counter()))
                if not ok:
                    dc.lost_blocks += 1
                    self._name("lost", key, lower, dc)
                    continue
                if self._verify(key, block):
                    dc.verified_blocks += 1
                    served = lower
                    break
                dc.corrupt_blocks += 1
                self._name("corrupt", key, lower, dc)
            if served is None:
                self.payload.fill(key, block)
                dc.recomputed_blocks += 1
            out.append((p, name, served))
        return out

    def _repair(self, moved: list[tuple[int, str, str | None]], keys: list[int],
                dc: DataCounters) -> None:
        """Rewrite the stale copy of every failed block its tier still holds."""
        names = self.names
        for p, frm, _to in moved:
            key = keys[p]
            i = names.index(frm)
            if frm == "gpu" or frm in self.dead or key not in self.cache.tiers[i]:
                continue
            self._store(frm, [key], "gpu")
            dc.repaired_blocks += 1

    # ------------------------------------------------------------------ stores
    def _store(self, name: str, keys: list[int], frm: str, demote: bool = False) -> None:
        """Store ``keys`` into tier ``name``: from the request's GPU-pool blocks, or, for a
        write-back demotion, from the copies tier ``frm`` just evicted."""
        tier = self.data_tiers[name]
        if name in self.dead:
            return
        if not demote:
            gpu, work = self.gpu, self._work
            srcs = [gpu.block(work[key]) for key in keys]
        else:
            rows = self._evicted[frm]
            srcs = [rows[key] for key in keys]
        start = time.perf_counter()
        try:
            job = tier.prepare_store(keys, srcs)
        except TierError as err:
            self._fail(err)
            return
        finally:
            self.measured.busy_s += time.perf_counter() - start
        job.started = start
        link = f"{name}<-{frm}"
        if not job.futures:  # synchronous: done now
            self.measured.link(link).add(len(keys), job.nbytes,
                                         self._interval(link, start, time.perf_counter()))
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
            self._fail(err)
            return
        if job.futures:
            end = max(job.ends) if job.ends else time.perf_counter()
            self.measured.link(link).add(len(job.keys), job.nbytes,
                                         self._interval(link, job.started, end))

    def drain(self) -> None:
        """Complete every store still in flight (end of the run, or before a report)."""
        for tier, job, link in self._prev_stores + self._stores:
            self._complete(tier, job, link)
        self._prev_stores, self._stores = [], []

    # ------------------------------------------------------------------ hierarchy hooks
    def on_read(self, tier: str, keys: list[int]) -> None:
        return None  # loads happened before the metadata step (and were checked)

    def on_write(self, tier: str, keys: list[int]) -> None:
        if tier == "gpu":
            gpu, work = self.gpu, self._work
            for key in keys:
                gpu.cache(key, work[key])
            return
        if self._evicting:
            # write-back: the hierarchy demotes what the tier above just evicted
            self._store(tier, keys, self.names[self.names.index(tier) - 1], demote=True)
        else:
            self._store(tier, keys, "gpu")

    def on_evict(self, tier: str, keys: list[int]) -> None:
        self._evicting = True
        # the evicted copies stay valid until the request ends (nothing allocates or
        # frees before then), so a write-back demotion can copy from them
        rows = self._evicted.setdefault(tier, {})
        if tier == "gpu":
            gpu = self.gpu
            for key in keys:
                b = gpu.cached.get(key)
                if b is not None:
                    rows[key] = gpu.block(b)
                gpu.uncache(key)
            return
        dt = self.data_tiers.get(tier)
        if isinstance(dt, DramTier):
            for key in keys:
                if key in dt:
                    rows[key] = dt.row(key)
        self._defer.setdefault(tier, []).extend(keys)

    # ------------------------------------------------------------------ report
    def data_totals(self) -> DataCounters:
        total = DataCounters()
        for dc in self.data_rounds.values():
            total.add(dc)
        return total

    def persist(self) -> None:
        """End of a run (or a clean stop): commit every data tier that keeps a store, so
        its blocks outlive the run (``kvtool verify`` of the NVMe place checks them)."""
        self.drain()
        for name, tier in self.data_tiers.items():
            commit = getattr(tier, "commit", None)
            if commit is None or name in self.dead:
                continue
            try:
                commit()
            except TierError as err:
                self._fail(err)

    def result(self) -> dict[str, Any]:
        self.drain()
        out = super().result()
        out["mode"] = "data"
        # the report's times are the serving model's (one time model); the measured load
        # seconds are in ``measured`` (``load_s``), beside them
        out["time_basis"] = {"load": "modelled", "prefill": "modelled", "decode": "modelled"}
        for t in out["tiers"]:
            dt = self.data_tiers.get(t["name"])
            if t["name"] == "gpu" or dt is None:
                t.update({"backend": "numpy", "url": None, "pool_blocks": self.gpu.num_blocks,
                          "committed_objects": None})
            else:
                t.update({"backend": dt.backend, "url": dt.url, "pool_blocks": dt.slots,
                          "committed_objects": getattr(dt, "committed", None)})
            t["failed"] = self.dead.get(t["name"])
        out.update(self.data_totals().to_dict())
        out["problems"] = list(self.named)
        out["measured"] = self.measured.to_dict()
        for rnd in out["rounds"]:
            rnd.update(self.data_rounds.get(rnd["round"], DataCounters()).to_dict())
        return out

    def close(self) -> None:
        with contextlib.suppress(TierFailed, TierError):
            self.drain()
        for t in self.data_tiers.values():
            with contextlib.suppress(Exception):  # closing after a failure must not mask it
                t.close()


def _stamp(ends: list[float]) -> Callable[[Any], None]:
    """A done-callback recording when a transfer completed (measured link time)."""
    def done(_f: Any) -> None:
        ends.append(time.perf_counter())
    return done
