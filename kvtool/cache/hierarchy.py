"""The tier hierarchy: lookup, store/touch, promotion, write policy, eviction.

One call of :meth:`TierHierarchy.serve` is one request, in the order docs/definitions.md fixes:

1. **Lookup.** Walk the request's blocks head → tail; each block is found in the highest
   tier holding it; stop at the first block no tier holds. ``k`` blocks hit;
   ``hit tokens = min(k·B, input_length)``, each hit block attributed to its tier.
2. **Store/touch**, top tier first, each tier in its policy's order:

   * the top tier touches every block and inserts every one it lacks (computed blocks,
     and lower-tier hits *promoted* into it);
   * ``write-through``: every lower tier touches the blocks it holds and inserts the
     computed blocks and the blocks promoted from *below* it (an inclusive hierarchy:
     a block hit in NVMe is copied into DRAM and GPU);
   * ``write-back``: lower tiers only touch the blocks they hold; blocks reach them
     when the tier above evicts (step 3).
3. **Evict**, top tier first: each tier evicts down to its capacity (or its watermark
   batch). Under ``write-back`` an evicted block the next tier lacks is written there
   (demotion), before that tier evicts in turn; the bottom tier's victims are dropped.

Counted per tier: hit blocks and tokens; blocks written (inserted); blocks read (hit
loads, and the source copy of a demotion); evictions.

A GPU tier with the ``vllm`` policy (:class:`~kvtool.cache.policies.VllmPolicy`) is a
whole vLLM block pool and serves each request itself (:meth:`TierHierarchy._serve_pooled`):
its hit is at most ``⌊(L − 1)/B⌋`` leading full blocks (the lookup goes on in the lower
tiers from there), it evicts while it allocates (step 1 of the request, not step 3), and
it counts every block it caches as written, a recomputed copy of a cached block included.

An engine that times its loads and stores as flows (the serving model's tiers below its
GPU pools in a ``--cluster`` run) takes those steps one at a time, each when its clock says
it happens: the **timed protocol** (:meth:`TierHierarchy.find`, :meth:`~TierHierarchy.read`,
:meth:`~TierHierarchy.put`; see the section of the class that holds them).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import filterfalse, takewhile
from typing import Literal

from kvtool.cache.names import WRITE_POLICIES
from kvtool.cache.policies import LruPolicy, VllmPolicy
from kvtool.cache.stats import RoundStats
from kvtool.cache.tier import Tier, TimedMover

WritePolicy = Literal["write-through", "write-back"]


class TierHierarchy:
    """Tiers from highest (``gpu``) to lowest (``nvme``); only present tiers are listed.

    Invariant between requests: every tier holds at most its capacity.
    """

    def __init__(self, tiers: Sequence[Tier], write_policy: WritePolicy = "write-through", *,
                 pooled: bool = True, timed_mover: TimedMover | None = None,
                 stale: set[tuple[str, int]] | None = None) -> None:
        """``pooled=False``: every tier is an index of blocks, a ``vllm`` policy's too (the
        timed protocol's hierarchies, whose engines hold their own GPU pools).
        ``timed_mover`` moves the bytes of the timed protocol; ``stale``: the (tier name,
        key) copies that failed their check, a miss until rewritten (hierarchies that
        share tiers share it)."""
        if not tiers:
            raise ValueError("a cache needs at least one tier")
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"unknown write policy {write_policy!r}")
        self.tiers = list(tiers)
        self.write_back = write_policy == "write-back"
        self.timed_mover = timed_mover
        self.stale: set[tuple[str, int]] = set() if stale is None else stale
        self.repaired = 0
        """Stale copies the timed protocol's puts rewrote."""
        self._indexes = [t.policy.index for t in self.tiers]
        self._policies = [t.policy for t in self.tiers]
        self._movers = any(t.mover is not None for t in self.tiers)
        if pooled and any(p.pooled for p in self._policies[1:]):
            raise ValueError("a pooled policy (vllm) can only manage the top tier")
        self._pooled: VllmPolicy | None = (
            self._policies[0] if pooled and isinstance(self._policies[0], VllmPolicy) else None)
        # Tiers whose policy stores only full blocks (vLLM's offloading: vllm-*); they take
        # the general path, which hands them the request's full blocks only.
        self._full_only = [getattr(p, "full_blocks_only", False) for p in self._policies]
        self._general = self._movers or any(self._full_only)
        # The fused path: head-first LRU in every tier, write-through, every tier but the
        # last bounded (so ordered); it does every tier's store/touch in one pass.
        self._fused = (
            not self.write_back and not self._movers and len(self.tiers) in (2, 3)
            and all(type(p) is LruPolicy for p in self._policies)
            and all(p.ordered for p in self._policies[:-1]))  # type: ignore[attr-defined]

    @property
    def names(self) -> list[str]:
        return [t.name for t in self.tiers]

    def lookup(self, keys: list[int], input_length: int | None = None) -> list[int]:
        """Tier index of each leading hit block (stops at the first miss everywhere).

        A pooled top tier (``vllm``) needs the prompt's ``input_length`` (its hit cap)."""
        if self._pooled is not None:
            if input_length is None:
                raise ValueError("a vllm GPU tier needs the request's input_length to look up")
            return self._lookup_pooled(keys, input_length)
        indexes = self._indexes
        src: list[int] = []
        add = src.append
        first = indexes[0]
        if len(indexes) == 2:
            second = indexes[1]
            for key in keys:
                if key in first:
                    add(0)
                elif key in second:
                    add(1)
                else:
                    break
            return src
        if len(indexes) == 3:
            second, third = indexes[1], indexes[2]
            for key in keys:
                if key in first:
                    add(0)
                elif key in second:
                    add(1)
                elif key in third:
                    add(2)
                else:
                    break
            return src
        rest = list(enumerate(indexes))[1:]
        for key in keys:
            if key in first:
                add(0)
                continue
            for j, index in rest:
                if key in index:
                    add(j)
                    break
            else:
                break
        return src

    def single_tier(self) -> Tier | None:
        """The tier, when there is one, without a mover, a pooled policy or a watermark:
        :meth:`serve` then is lookup, touch and evict-to-capacity in that tier alone
        (:meth:`_serve_one`), which a caller serving many requests may run inline
        (:meth:`kvtool.cache.replayer.Replayer.feed_many`)."""
        if (self._pooled is None and not self._general and len(self.tiers) == 1
                and self.tiers[0].watermark is None):
            return self.tiers[0]
        return None

    def server(self) -> Callable[[list[int], int, int, int, RoundStats], list[int]]:
        """:meth:`serve`, or for a single tier without a mover or a pooled policy the
        path it dispatches to (a call less per request for callers that serve many)."""
        if self._pooled is None and not self._general and len(self.tiers) == 1:
            return self._serve_one
        return self.serve

    def serve(self, keys: list[int], input_length: int, block_tokens: int, session: int,
              stats: RoundStats) -> list[int]:
        """Serve one request and count it into ``stats``; return hit blocks per tier.

        ``stats.requests``/``input_tokens``/``output_tokens`` and times are the caller's;
        this adds hits, recompute, writes, reads and evictions.
        """
        if self._pooled is not None:
            return self._serve_pooled(keys, input_length, block_tokens, session, stats)
        tiers = self.tiers
        m = len(tiers)
        if not self._general:
            if m == 1:
                return self._serve_one(keys, input_length, block_tokens, session, stats)
            if self._fused:
                return self._serve_fused(keys, input_length, block_tokens, stats)
            if not self.write_back:
                return self._serve_through(keys, input_length, block_tokens, session, stats)
        # 1. lookup (a tier of full blocks only cannot hit the partial last block)
        src = self.lookup(keys)
        full = input_length // block_tokens
        full_only = self._full_only
        if len(src) > full and any(full_only):
            for p in range(full, len(src)):
                if full_only[src[p]]:
                    del src[p:]
                    break
        k = len(src)
        per_tier = self._count_hits(src, input_length, block_tokens, stats)

        # 2. store / touch
        written = stats.blocks_written
        high = max(src) if src else 0
        hits: set[int] | None = set(keys[:k]) if high > 0 else None
        record: list[int] | None = ([] if tiers[0].mover is not None or hits is not None
                                    else None)
        written[0] += tiers[0].policy.access(keys[:full] if full_only[0] else keys, session,
                                             record=record)
        if hits is not None and record:
            stats.promoted_blocks[0] += _count_in(record, hits)
        if self._movers:
            self._notify(keys, src, record or [])
        low = min(src) if src else m
        for i in range(1, m):
            tier = tiers[i]
            tier_keys = keys[:full] if full_only[i] else keys
            if self.write_back:
                tier.policy.access(tier_keys, session, admit=False)
                continue
            skip = None
            if low < i:
                skip = {keys[p] for p in range(k) if src[p] < i}
            promotes = hits is not None and high > i
            record = [] if tier.mover is not None or promotes else None
            written[i] += tier.policy.access(tier_keys, session, skip=skip, record=record)
            if promotes and record and hits is not None:
                stats.promoted_blocks[i] += _count_in(record, hits)
            if record and tier.mover is not None:
                tier.mover.on_write(tier.name, record)

        # 3. evict, top down (write-back demotes into the next tier first)
        self._evict_from(0, stats)
        return per_tier

    def _evict_from(self, start: int, stats: RoundStats) -> None:
        """Evict each tier from ``start`` down to its capacity (or watermark), top down;
        under write-back a tier's evicted blocks are demoted into the next tier first."""
        tiers = self.tiers
        m = len(tiers)
        written = stats.blocks_written
        evictions = stats.evictions
        for i in range(start, m):
            tier = tiers[i]
            if tier.watermark is None and len(self._indexes[i]) <= tier.capacity:
                continue
            out = tier.evict_to_capacity()
            if not out:
                continue
            evictions[i] += len(out)
            if self.write_back and i + 1 < m:
                below = tiers[i + 1]
                down = below.policy.admit(out)
                if down:
                    stats.blocks_read[i] += len(down)
                    written[i + 1] += len(down)
                    if below.mover is not None:
                        below.mover.on_write(below.name, down)

    def _lookup_pooled(self, keys: list[int], input_length: int) -> list[int]:
        """:meth:`lookup` with a pooled top tier: its capped hit, then the lower tiers."""
        assert self._pooled is not None
        h = self._pooled.hit_blocks(keys, input_length)
        src = [0] * h
        lower = list(enumerate(self._indexes))[1:]
        add = src.append
        for p in range(h, len(keys)):
            key = keys[p]
            for j, index in lower:
                if key in index:
                    add(j)
                    break
            else:
                break
        return src

    def _serve_pooled(self, keys: list[int], input_length: int, block_tokens: int,
                      session: int, stats: RoundStats) -> list[int]:
        """:meth:`serve` with a pooled top tier (``vllm``): the pool runs the request.

        Lower-tier hits reach the pool as external blocks (cached there, so counted as
        promotions). Movers hear of keys entering and leaving the pool's hash index
        (a second copy of a cached key is neither); under write-back the keys the pool
        evicted are demoted into the next tier.
        """
        pooled = self._pooled
        assert pooled is not None
        tiers = self.tiers
        m = len(tiers)
        src = self._lookup_pooled(keys, input_length)
        k = len(src)
        per_tier = self._count_hits(src, input_length, block_tokens, stats)
        h = per_tier[0]
        index0 = self._indexes[0]
        full = min(input_length // block_tokens, len(keys))
        notify = self._movers
        absent = [key for key in keys[h:full] if key not in index0] if notify else []
        evicted: list[int] | None = [] if notify or self.write_back else None
        _, cached, n_evicted = pooled.serve_request(keys, input_length, k - h, evicted)
        written = stats.blocks_written
        written[0] += cached
        if cached and k > h:
            stats.promoted_blocks[0] += max(0, min(k, full) - h)
        stats.evictions[0] += n_evicted
        if evicted:
            evicted = [key for key in dict.fromkeys(evicted) if key not in index0]
        if notify:
            self._notify(keys, src, [key for key in dict.fromkeys(absent) if key in index0])

        # 2. lower tiers: as the general path
        low, high = (min(src), max(src)) if k else (m, 0)
        hits: set[int] | None = set(keys[:k]) if high > 0 else None
        full_only = self._full_only
        for i in range(1, m):
            tier = tiers[i]
            tier_keys = keys[:full] if full_only[i] else keys
            if self.write_back:
                tier.policy.access(tier_keys, session, admit=False)
                continue
            skip = {keys[p] for p in range(k) if src[p] < i} if low < i else None
            promotes = hits is not None and high > i
            record: list[int] | None = [] if tier.mover is not None or promotes else None
            written[i] += tier.policy.access(tier_keys, session, skip=skip, record=record)
            if promotes and record and hits is not None:
                stats.promoted_blocks[i] += _count_in(record, hits)
            if record and tier.mover is not None:
                tier.mover.on_write(tier.name, record)

        # 3. the pool's evictions (made while allocating), then the lower tiers'
        if evicted:
            if tiers[0].mover is not None:
                tiers[0].mover.on_evict(tiers[0].name, evicted)
            if self.write_back and m > 1:
                below = tiers[1]
                down = below.policy.admit(evicted)
                if down:
                    stats.blocks_read[0] += len(down)
                    written[1] += len(down)
                    if below.mover is not None:
                        below.mover.on_write(below.name, down)
        self._evict_from(1, stats)
        return per_tier

    def _serve_fused(self, keys: list[int], input_length: int, block_tokens: int,
                     stats: RoundStats) -> list[int]:
        """:meth:`_serve_through` for 2 or 3 head-first LRU tiers, in one pass over the keys.

        Same semantics, fewer membership tests: for a hit block the lookup already says
        which tiers lack it (those above its source: promote) and which holds it (touch);
        tiers below the source touch it if they hold it and never copy it down.
        """
        tiers = self.tiers
        m = len(tiers)
        src = self.lookup(keys)
        k = len(src)
        per_tier = self._count_hits(src, input_length, block_tokens, stats)
        indexes = self._indexes
        before = [len(ix) for ix in indexes]
        pols: list[LruPolicy] = self._policies  # type: ignore[assignment]
        if m == 2:
            self._fused_touch_two(keys, src)
        else:
            self._fused_touch_three(keys, src)
        for pol in pols:
            if pol.ordered and len(pol.order) > 2 * len(pol.index) + 1024:
                pol.compact()
        if k:
            # head-first LRU admits every block it lacks: each hit from below is promoted
            # into every tier above its source
            promoted = stats.promoted_blocks
            below0 = k - src.count(0)
            promoted[0] += below0
            if m == 3:
                promoted[1] += src.count(2)
        written = stats.blocks_written
        evictions = stats.evictions
        for i, tier in enumerate(tiers):
            ix = indexes[i]
            written[i] += len(ix) - before[i]
            if tier.watermark is not None or len(ix) > tier.capacity:
                evictions[i] += len(tier.evict_to_capacity())
        return per_tier

    def _fused_touch_two(self, keys: list[int], src: list[int]) -> None:
        """:meth:`_serve_fused`'s pass over the keys for 2 tiers: touch each hit block where
        it is held and promote it into the top tier, insert each missed block into both.

        LruPolicy: index[key] counts the key's references in its order deque; a touch or an
        insert appends one (an unordered last tier keeps no deque)."""
        k = len(src)
        indexes = self._indexes
        last = indexes[-1]
        pols: list[LruPolicy] = self._policies  # type: ignore[assignment]
        last_ordered = pols[-1].ordered
        i0 = indexes[0]
        p0 = pols[0].order.append
        p1 = pols[1].order.append if last_ordered else None
        for key, s in zip(keys, src, strict=False):
            i0[key] = i0[key] + 1 if s == 0 else 1
            p0(key)
            if p1 is not None:
                c = last.get(key)
                if c is not None:
                    last[key] = c + 1
                    p1(key)
        for key in keys[k:]:
            c = i0.get(key)
            i0[key] = 1 if c is None else c + 1
            p0(key)
            c = last.get(key)
            if c is None:
                last[key] = 1
                if p1 is not None:
                    p1(key)
            elif p1 is not None:
                last[key] = c + 1
                p1(key)

    def _fused_touch_three(self, keys: list[int], src: list[int]) -> None:
        """:meth:`_serve_fused`'s pass over the keys for 3 tiers (as
        :meth:`_fused_touch_two`): touch or promote each hit block, insert each missed one
        into every tier."""
        k = len(src)
        indexes = self._indexes
        last = indexes[-1]
        pols: list[LruPolicy] = self._policies  # type: ignore[assignment]
        last_ordered = pols[-1].ordered
        i0 = indexes[0]
        p0 = pols[0].order.append
        i1 = indexes[1]
        p1 = pols[1].order.append
        p2 = pols[2].order.append if last_ordered else None
        for key, s in zip(keys, src, strict=False):
            if s == 0:
                i0[key] += 1
                c = i1.get(key)
                if c is not None:
                    i1[key] = c + 1
                    p1(key)
            elif s == 1:
                i0[key] = 1
                i1[key] += 1
                p1(key)
            else:
                i0[key] = 1
                i1[key] = 1
                p1(key)
            p0(key)
            if p2 is not None:
                c = last.get(key)
                if c is not None:
                    last[key] = c + 1
                    p2(key)
        for key in keys[k:]:
            c = i0.get(key)
            i0[key] = 1 if c is None else c + 1
            p0(key)
            c = i1.get(key)
            i1[key] = 1 if c is None else c + 1
            p1(key)
            c = last.get(key)
            if c is None:
                last[key] = 1
                if p2 is not None:
                    p2(key)
            elif p2 is not None:
                last[key] = c + 1
                p2(key)

    def _serve_through(self, keys: list[int], input_length: int, block_tokens: int,
                       session: int, stats: RoundStats) -> list[int]:
        """:meth:`serve` for write-through without movers (same semantics, fewer steps)."""
        m = len(self.tiers)
        src = self.lookup(keys)
        k = len(src)
        per_tier = self._count_hits(src, input_length, block_tokens, stats)
        low, high = (min(src), max(src)) if k else (m, m)
        written = stats.blocks_written
        policies = self._policies
        prefix: set[int] | None = set(keys[:k]) if k and high > 0 else None
        if prefix is None:
            written[0] += policies[0].access(keys, session)
        else:
            record: list[int] = []
            written[0] += policies[0].access(keys, session, record=record)
            stats.promoted_blocks[0] += _count_in(record, prefix)
        for i in range(1, m):
            promotes = prefix is not None and high > i
            record = [] if promotes else None  # type: ignore[assignment]
            if low >= i:
                written[i] += policies[i].access(keys, session, record=record)
            else:
                # Blocks hit above this tier are not copied down (only computed ones are).
                if high < i:
                    if prefix is None:
                        prefix = set(keys[:k])
                    skip = prefix
                else:
                    skip = {keys[p] for p in range(k) if src[p] < i}
                written[i] += policies[i].access(keys, session, skip=skip, record=record)
            if promotes and record and prefix is not None:
                stats.promoted_blocks[i] += _count_in(record, prefix)
        evictions = stats.evictions
        indexes = self._indexes
        for i, tier in enumerate(self.tiers):
            if tier.watermark is not None or len(indexes[i]) > tier.capacity:
                evictions[i] += len(tier.evict_to_capacity())
        return per_tier

    def _serve_one(self, keys: list[int], input_length: int, block_tokens: int, session: int,
                   stats: RoundStats) -> list[int]:
        """:meth:`serve` for a single tier without a mover (the common, hot case)."""
        index = self._indexes[0]
        k = 0
        for key in keys:
            if key not in index:
                break
            k += 1
        hit_tokens = k * block_tokens
        if hit_tokens > input_length:
            hit_tokens = input_length
        if k:
            stats.hit_tokens[0] += hit_tokens
            stats.hit_blocks[0] += k
            stats.blocks_read[0] += k
        stats.recompute_tokens += input_length - hit_tokens
        tier = self.tiers[0]
        policy = tier.policy
        stats.blocks_written[0] += policy.access(keys, session)
        if tier.watermark is not None:
            stats.evictions[0] += len(tier.evict_to_capacity())
        elif len(index) > tier.capacity:
            # Tier.evict_to_capacity without a watermark or a mover (this path has
            # neither): evict the overflow, in the policy's order.
            stats.evictions[0] += policy.discard(len(index) - int(tier.capacity))
        return [k]

    def _count_hits(self, src: list[int], input_length: int, block_tokens: int,
                    stats: RoundStats) -> list[int]:
        """Count a lookup's hits, loads and recomputed tokens; return hit blocks per tier.

        ``hit tokens = min(k·B, input_length)``: the tokens beyond ``input_length`` come
        off the tiers of the last hit blocks.
        """
        m = len(self.tiers)
        k = len(src)
        if not k:
            stats.recompute_tokens += input_length
            return [0] * m
        per_tier = [src.count(j) for j in range(m)]
        hits, hit_blocks, reads = stats.hit_tokens, stats.hit_blocks, stats.blocks_read
        for j in range(m):
            n = per_tier[j]
            if n:
                hits[j] += n * block_tokens
                hit_blocks[j] += n
                reads[j] += n
        excess = k * block_tokens - input_length
        p = k - 1
        while excess > 0 and p >= 0:
            take = min(excess, block_tokens)
            hits[src[p]] -= take
            excess -= take
            p -= 1
        stats.recompute_tokens += max(0, input_length - k * block_tokens)
        return per_tier

    def _notify(self, keys: list[int], src: list[int], new: list[int]) -> None:
        """Tell movers what each tier read and the top tier wrote for this request."""
        by_tier: dict[int, list[int]] = {}
        for p, j in enumerate(src):
            by_tier.setdefault(j, []).append(keys[p])
        for j, ks in by_tier.items():
            mover = self.tiers[j].mover
            if mover is not None:
                mover.on_read(self.tiers[j].name, ks)
        mover = self.tiers[0].mover
        if mover is not None and new:
            mover.on_write(self.tiers[0].name, new)

    # ------------------------------------------------------------------ timed protocol
    # An engine that times its loads and stores as flows (the serving model's tiers below
    # its GPU pools, kvtool.serving.sim.TierStack) takes serve()'s steps one at a time, each
    # when its clock says it happens: the lookup when it plans a load, the reads (and the
    # loads of their bytes) when the load starts, the inserts (puts, promotions) when their
    # flows arrive. Several hierarchies may share their lower tiers (a cluster's pools under
    # each node's DRAM), and then one set of stale copies; each counts, into the caller's
    # stats, what it did to them. Data mode plugs in a TimedMover: the hierarchy calls it
    # as blocks are loaded, stored and evicted.

    def find(self, keys: Sequence[int]) -> list[int]:
        """Tier index of each leading block held (no pooled cap): the lookup."""
        indexes = self._indexes
        if len(indexes) == 1 and not self.stale:
            return [0] * len(list(takewhile(indexes[0].__contains__, keys)))
        src = self.locate(keys)
        return src[:src.index(-1)] if -1 in src else src

    def locate(self, keys: Sequence[int]) -> list[int]:
        """Tier index of each block, the highest holding a good copy (-1: none)."""
        indexes = self._indexes
        stale = self.stale
        if not stale:
            if len(indexes) == 1:
                first = indexes[0]
                return [0 if key in first else -1 for key in keys]
            tiers = list(enumerate(indexes))
            return [next((j for j, ix in tiers if key in ix), -1) for key in keys]
        named = [(j, t.name, ix) for j, (t, ix) in enumerate(zip(self.tiers, indexes,
                                                                  strict=True))]
        return [next((j for j, name, ix in named if key in ix and (name, key) not in stale), -1)
                for key in keys]

    def held(self, i: int, keys: Sequence[int]) -> list[int]:
        """The ``keys`` tier ``i`` holds."""
        return list(filter(self._indexes[i].__contains__, keys))

    def held_prefix(self, i: int, keys: Sequence[int]) -> int:
        """How many leading ``keys`` tier ``i`` holds."""
        return len(list(takewhile(self._indexes[i].__contains__, keys)))

    def lacks(self, i: int, keys: Sequence[int]) -> list[int]:
        """The ``keys`` tier ``i`` holds no good copy of (what a put must write)."""
        index = self._indexes[i]
        if self.stale:
            name, stale = self.tiers[i].name, self.stale
            return [k for k in keys if k not in index or (name, k) in stale]
        return list(filterfalse(index.__contains__, keys))

    def read(self, i: int, keys: list[int], session: int, stats: RoundStats) -> None:
        """A load of ``keys`` (hit blocks) from tier ``i``: count them, refresh them."""
        self._policies[i].access(keys, session, admit=False)
        stats.hit_blocks[i] += len(keys)
        stats.blocks_read[i] += len(keys)

    def load(self, i: int, keys: list[int], by: int) -> list[int]:
        """The bytes of ``keys`` (read from tier ``i``) reach ``by``'s GPU pool, checked by
        the mover: return the keys whose copy failed, stale from now on (none without
        a mover)."""
        mover = self.timed_mover
        if mover is None:
            return []
        name = self.tiers[i].name
        failed = mover.on_load(name, keys, by)
        self.stale.update((name, k) for k in failed)
        return failed

    def touch(self, i: int, keys: list[int], session: int) -> None:
        """Refresh the ``keys`` tier ``i`` holds (a put that found them all there)."""
        self._policies[i].access(keys, session, admit=False)

    def put(self, i: int, keys: list[int], session: int, stats: RoundStats, *, by: int = -1,
            kept: bool = False) -> list[int]:
        """Insert ``keys`` into tier ``i`` (touching those it holds), then evict it down to
        its capacity; count both. A stale copy among ``keys`` is rewritten (counted in
        :attr:`repaired`), an evicted one forgotten. The mover frees the bytes of the
        blocks evicted, then stores those inserted that stayed (``by`` moves them).
        Returns those (``kept``; else maybe ``[]``)."""
        tier = self.tiers[i]
        policy = self._policies[i]
        mover = self.timed_mover
        stale = self.stale
        if not kept and mover is None and not stale:
            stats.blocks_written[i] += policy.access(keys, session)
            out = tier.evict_to_capacity()
            if out:
                stats.evictions[i] += len(out)
            return []
        rec: list[int] = []
        stats.blocks_written[i] += policy.access(keys, session, record=rec)
        out = tier.evict_to_capacity()
        name = tier.name
        if stale:
            for k in keys:
                if (name, k) in stale and k not in rec:
                    stale.discard((name, k))
                    rec.append(k)
                    self.repaired += 1
            for k in out:
                stale.discard((name, k))
        if out:
            stats.evictions[i] += len(out)
            gone = set(out)
            if mover is not None:
                old = [k for k in out if k not in rec]
                if old:
                    mover.on_evict(name, old)
            rec = [k for k in rec if k not in gone]
        if mover is not None and rec:
            mover.on_store(name, rec, by)
        return rec


def _count_in(inserted: list[int], hits: set[int]) -> int:
    """How many inserted blocks were hits (promotions rather than puts)."""
    return sum(1 for key in inserted if key in hits)
