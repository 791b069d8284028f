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

A timed replay asks :meth:`DataReplayer.decide` to serve each request when the serving
model's engine first admits it, in serve order (:mod:`kvtool.serving.serveorder`), and the
report's times are that engine's (simulated); ``--no-times`` feeds the requests one after
the other. Either way the loads are measured here (seconds per link, ``measured``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

from kvtool.cache.replayer import CacheConfig, Replayer, RequestLike, RequestOutcome, outcome
from kvtool.cache.stats import RoundStats
from kvtool.store.payload import Payload, equal
from kvtool.tiers.base import DataTier
from kvtool.tiers.gpu import GpuBlockPool
from kvtool.tiers.mover import (
    ON_TIER_ERROR,
    DataCounters,
    DataMover,
    Measured,
    TierFailed,
)

__all__ = ["MAX_NAMED", "DataCounters", "DataReplayer", "Measured", "TierFailed"]

MAX_NAMED = 100
"""Corrupt or lost blocks named individually in a report (the rest are counted)."""


class _PoolTop:
    """The GPU pool as the hierarchy's top tier (:class:`kvtool.tiers.mover.TopPool`):
    the blocks it caches are the request's working blocks."""

    def __init__(self, gpu: GpuBlockPool, work: dict[int, int]) -> None:
        self.gpu, self.work = gpu, work

    def cache(self, keys: list[int]) -> None:
        gpu, work = self.gpu, self.work
        for key in keys:
            gpu.cache(key, work[key])

    def evict(self, keys: list[int]) -> dict[int, np.ndarray]:
        gpu = self.gpu
        rows = {}
        for key in keys:
            b = gpu.cached.get(key)
            if b is not None:
                rows[key] = gpu.block(b)
            gpu.uncache(key)
        return rows


class DataReplayer(Replayer):
    """A replay whose tiers hold real bytes (see the module docstring).

    ``tiers`` maps ``dram``/``nvme`` to their :class:`~kvtool.tiers.base.DataTier`; the
    GPU tier is the pool itself (``gpu_blocks`` cached blocks, plus ``work_blocks`` for the
    longest request). ``on_tier_error``: ``fail`` raises :class:`TierFailed`;
    ``recompute`` goes on with the failed tier treated as empty. The bytes move through
    a :class:`~kvtool.tiers.mover.DataMover` (the code an engine's connector uses too).
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
        names = [t.name for t in config.tiers]
        gpu_cap = 0
        if names[0] == "gpu":
            gpu_cap = int(config.tiers[0].blocks(block_bytes, block_tokens))
        self.gpu = GpuBlockPool(gpu_cap + work_blocks, block_bytes)
        self._work: dict[int, int] = {}
        self.mover = DataMover(
            names, tiers, holds=lambda j, key: key in self.cache.tiers[j],
            top=_PoolTop(self.gpu, self._work) if names[0] == "gpu" else None,
            on_tier_error=on_tier_error, on_event=on_event)
        super().__init__(config, block_tokens, block_bytes, on_request=on_request,
                         movers={n: self.mover for n in names})
        self.payload = Payload(block_bytes, seed)
        self._scratch = np.empty(block_bytes, dtype=np.uint8)
        self.data_rounds: dict[int, DataCounters] = {}
        self.named: list[dict[str, Any]] = []
        self._req_line = 0
        self._round = 0

    @property
    def measured(self) -> Measured:
        return self.mover.measured

    @property
    def dead(self) -> dict[str, str]:
        return self.mover.dead

    @property
    def on_event(self) -> Callable[[str], None] | None:
        """Told once when a tier fails and the run goes on without it."""
        return self.mover.on_event

    @on_event.setter
    def on_event(self, fn: Callable[[str], None] | None) -> None:
        self.mover.on_event = fn

    def _name(self, kind: str, key: int, tier: str) -> None:
        if len(self.named) < MAX_NAMED:
            self.named.append({"kind": kind, "key": key, "tier": tier, "round": self._round,
                               "line": self._req_line})

    # ------------------------------------------------------------------ one request
    def feed(self, req: RequestLike) -> None:
        self.decide(req)

    def decide(self, req: RequestLike) -> tuple[list[int], list[int]]:
        """Serve one request (the module docstring's steps); return, per tier, the blocks
        served from there (a block that failed its check counts where it was served, or
        not at all when it was recomputed) and the blocks written there for it
        (:meth:`kvtool.cache.replayer.Replayer.decide`)."""
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
        mover = self.mover
        measured = mover.measured
        src = self.cache.lookup(keys, inp)
        k = len(src)
        work = self._work
        # 1. GPU blocks for every block of the request
        self._gpu_blocks(keys, src)
        # 2. loads (checked), lowest tier first so NVMe reads are in flight during DRAM copies
        t_load = time.perf_counter()
        ps = [p for p in range(k) if names[src[p]] != "gpu"]
        failures = mover.load([keys[p] for p in ps], [names[src[p]] for p in ps],
                              [gpu.block(work[keys[p]]) for p in ps], self._verify, dc,
                              self._name) if ps else []
        moved = [(ps[f.pos], f.tier, f.served) for f in failures]
        corrupt_now = [f.tier for f in failures if f.kind == "corrupt"]
        load_s = time.perf_counter() - t_load
        # 3. computed blocks (and hit blocks no tier could serve): their payload into the pool
        t_c = time.perf_counter()
        fill = self.payload.fill
        for key in keys[k:]:
            fill(key, gpu.block(work[key]))
        for p, _frm, to in moved:
            if to is None:
                fill(keys[p], gpu.block(work[keys[p]]))
        measured.compute_s += time.perf_counter() - t_c
        measured.busy_s += time.perf_counter() - t_load
        # 4. metadata: insert / promote / evict, with the mover moving bytes
        mover.begin(lambda key: gpu.block(work[key]))
        per_tier = self.cache.serve(keys, inp, B, self._sid(req.session), st)
        if moved:
            self._recount(moved, inp, st, per_tier)
            mover.repair([(frm, keys[p]) for p, frm, _to in moved], dc)
        # 5. settle the previous request's stores (overlapped with this one), free, release
        mover.end()
        gpu.release(work.values())
        # accounting (the request's TTFT is the serving model's: kvtool.replay.timing)
        st.count_request(inp, req.output_length)
        round_st.add(st)
        if self.on_request is not None:
            corrupt: dict[str, int] = {}
            for tname in corrupt_now:
                corrupt[tname] = corrupt.get(tname, 0) + 1
            self.on_request(outcome(req, r, names, st, corrupt=corrupt, load_s=load_s))
        measured.load_s.append(load_s)
        measured.blocks += len(keys)
        measured.wall_s += time.perf_counter() - t_start
        return st.hit_blocks, st.blocks_written

    def _gpu_blocks(self, keys: list[int], src: list[int]) -> None:
        """A GPU pool block in :attr:`_work` for every block of a request: the blocks the
        GPU tier holds (touched), new ones for the rest."""
        names = self.names
        gpu = self.gpu
        work = self._work
        work.clear()
        held = [keys[p] for p in range(len(src)) if names[src[p]] == "gpu"]
        for key in held:
            b = gpu.cached[key]
            work[key] = b
        gpu.touch(work.values())
        need = [key for key in dict.fromkeys(keys) if key not in work]
        for key, b in zip(need, gpu.allocate(len(need)), strict=True):
            work[key] = b

    def _recount(self, moved: list[tuple[int, str, str | None]], inp: int, st: RoundStats,
                 per_tier: list[int]) -> None:
        """Correct a request's counts for the blocks not served from where the metadata
        says (``moved``: position, the tier it says, the tier that served the block or
        None): their hits move to the tier that served them, or to recompute."""
        B = self.block_tokens
        names = self.names
        for p, frm, to in moved:
            tok = max(0, min(B, inp - p * B))
            i = names.index(frm)
            st.hit_tokens[i] -= tok
            st.hit_blocks[i] -= 1
            per_tier[i] -= 1
            if to is None:
                st.recompute_tokens += tok
            else:
                j = names.index(to)
                st.hit_tokens[j] += tok
                st.hit_blocks[j] += 1
                st.blocks_read[j] += 1
                per_tier[j] += 1

    def _sid(self, session: str | int | None) -> int:
        if session is not None:
            sid = self._sessions.get(session)
            if sid is not None:
                return sid
        return self._session_id(session)

    def _verify(self, key: int, block: np.ndarray) -> bool:
        self.payload.fill(key, self._scratch)
        return equal(block, self._scratch)

    # ------------------------------------------------------------------ report
    def data_totals(self) -> DataCounters:
        total = DataCounters()
        for dc in self.data_rounds.values():
            total.add(dc)
        return total

    def drain(self) -> None:
        """Complete every store still in flight (end of the run, or before a report)."""
        self.mover.drain()

    def persist(self) -> None:
        """End of a run (or a clean stop): commit every data tier that keeps a store, so
        its blocks outlive the run (``kvtool verify`` of the NVMe place checks them)."""
        self.mover.persist()

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
        self.mover.close()
