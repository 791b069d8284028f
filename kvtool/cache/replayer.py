"""The replayer: requests in serve order → tier hierarchy → per-round accounting.

Library use (the CLI ``kvtool replay`` is a thin shell over this)::

    from kvtool.cache import CacheConfig, TierSpec, replay
    from kvtool.trace import read_trace
    from kvtool.units import Capacity

    trace = read_trace("trace.jsonl", fmt="mooncake", block_tokens=512)
    cfg = CacheConfig([TierSpec("dram", Capacity.parse("3000000tok"))])
    [result] = replay(trace, [cfg], block_tokens=trace.block_tokens)
    result["token_hit_ratio"], result["cliff_round"]

Several configurations replay the same request stream side by side, one pass over the
trace (``--compare``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple, Protocol

import msgspec

from kvtool.cache.hierarchy import WRITE_POLICIES, TierHierarchy, WritePolicy
from kvtool.cache.policies import (
    POLICIES,
    POOLED_TIERS,
    WATERMARK_DEFAULTS,
    Admission,
    make_policy,
)
from kvtool.cache.stats import TIME_KEYS, RoundStats
from kvtool.cache.tier import TIER_NAMES, Tier, TierMover, Watermark
from kvtool.collapse import collapse_round
from kvtool.errors import UsageError, param
from kvtool.units import Capacity


class RequestLike(Protocol):
    """What the replayer reads from a request (:class:`kvtool.trace.Request` has it)."""

    @property
    def input_length(self) -> int: ...
    @property
    def output_length(self) -> int: ...
    @property
    def block_keys(self) -> list[int]: ...
    @property
    def session(self) -> str | int | None: ...
    @property
    def round(self) -> int | None: ...
    @property
    def report_round(self) -> int: ...
    @property
    def line(self) -> int: ...


class TierSpec(msgspec.Struct):
    """One tier as the user configured it (capacity not yet resolved to blocks)."""

    name: str
    capacity: Capacity
    policy: str = "lru"
    watermark: Watermark | None = None
    window: int | None = None
    """``prefix-fair`` only: how many of the oldest leaves compete on depth (default 128)."""
    place: str | None = None
    """Data mode: where the tier's bytes live (a file, device or ``nvme+tcp://`` URL)."""
    admit_after: int | None = None
    """Admission by reuse count: a block is stored on its n-th offer (vLLM's
    ``store_threshold``; 1 or None: at once). :class:`~kvtool.cache.policies.Admission`."""
    admit_ttl: int | None = None
    """Admission by TTL: offers more than this many requests apart count anew."""

    def __post_init__(self) -> None:
        if self.name not in TIER_NAMES:
            raise UsageError(f"unknown tier {self.name!r} (use {', '.join(TIER_NAMES)})",
                             field="tier")
        if self.policy not in POLICIES:
            raise UsageError(f"unknown policy {self.policy!r} (use {', '.join(POLICIES)})",
                             field="policy")
        if POLICIES[self.policy].pooled and self.name not in POOLED_TIERS:
            raise UsageError(f"policy {self.policy!r} is vLLM's GPU block pool: it manages the "
                             f"{' or '.join(POOLED_TIERS)} tier only, not {self.name}",
                             field="policy")
        for name in ("admit_after", "admit_ttl"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise UsageError(f"{name} must be a whole number ≥ 1, got {value!r}",
                                 field=f"{self.name}.{name}")
        if self.admit_ttl is not None and (self.admit_after or 1) < 2:
            raise UsageError("admit_ttl limits the offers admit_after counts: give admit_after ≥ 2",
                             field=f"{self.name}.admit_ttl")
        if self.watermark is None and self.policy in WATERMARK_DEFAULTS:
            self.watermark = Watermark(*WATERMARK_DEFAULTS[self.policy])

    def blocks(self, block_bytes: int | None, block_tokens: int) -> float:
        """Capacity in whole blocks; a byte size needs ``block_bytes``."""
        if self.capacity.unit == "bytes" and not block_bytes:
            raise UsageError(f"{self.capacity} is a size in bytes: give {param('model')} or "
                             f"{param('block_bytes')}, or use blk/tok units",
                             field=f"{self.name}")
        return self.capacity.blocks(block_bytes or 0, block_tokens)


class CacheConfig(msgspec.Struct):
    """A whole cache: present tiers (highest first), write policy, and a label."""

    tiers: list[TierSpec]
    write_policy: WritePolicy = "write-through"
    label: str = ""

    def __post_init__(self) -> None:
        if self.write_policy not in WRITE_POLICIES:
            raise UsageError(f"unknown write policy {self.write_policy!r} "
                             f"(use {', '.join(WRITE_POLICIES)})", field="write_policy")
        order = {n: i for i, n in enumerate(TIER_NAMES)}
        self.tiers = sorted((t for t in self.tiers if not t.capacity.is_zero),
                            key=lambda t: order[t.name])
        names = [t.name for t in self.tiers]
        if len(set(names)) != len(names):
            raise UsageError("a tier is given twice", field="tier")
        if not self.tiers:
            raise UsageError(f"no cache tier: give {param('gpu')}, {param('dram')} or "
                             f"{param('nvme')} with a non-zero size",
                             field="dram")
        if not self.label:
            self.label = " + ".join(
                f"{t.name} {t.capacity}{'@' + t.place if t.place else ''} {t.policy}"
                + (f" admit {t.admit_after}" if (t.admit_after or 1) > 1 else "")
                + (f"/{t.admit_ttl}req" if t.admit_ttl else "")
                for t in self.tiers)

    def build(self, block_bytes: int | None, block_tokens: int,
              movers: dict[str, TierMover] | None = None) -> TierHierarchy:
        tiers = []
        for spec in self.tiers:
            cap = spec.blocks(block_bytes, block_tokens)
            if cap <= 0:
                raise UsageError(f"{spec.capacity} holds no whole block of {block_tokens} tokens"
                                 + (f" ({block_bytes} B)" if block_bytes else ""),
                                 field=f"{spec.name}")
            if spec.policy == "vllm" and (cap == math.inf or cap < 2):
                raise UsageError(f"{spec.capacity}: policy 'vllm' needs a finite pool of at "
                                 "least 2 blocks (vLLM's num_gpu_blocks, the null block included)",
                                 field=f"{spec.name}")
            admission = (Admission(spec.admit_after or 1, spec.admit_ttl)
                         if (spec.admit_after or 1) > 1 else None)
            policy = make_policy(spec.policy, window=spec.window, block_tokens=block_tokens,
                                 admission=admission)
            tiers.append(Tier(spec.name, cap, policy, watermark=spec.watermark,
                              mover=(movers or {}).get(spec.name)))
        return TierHierarchy(tiers, self.write_policy)


class RequestOutcome(NamedTuple):
    """One request's accounting (only built when asked for: ``Replayer(per_request=...)``)."""

    line: int
    round: int
    input_tokens: int
    hit_tokens: dict[str, int]
    recompute_tokens: int
    blocks_written: dict[str, int]
    evictions: dict[str, int]
    ttft_s: float
    """The serving model's TTFT (:mod:`kvtool.replay.timing`); ``nan`` when not timed."""
    put_blocks: dict[str, int] | None = None
    promoted_blocks: dict[str, int] | None = None
    corrupt_blocks: dict[str, int] | None = None
    """Data mode: blocks that failed their content check, by the tier that served them."""
    load_s: float | None = None
    """Data mode: measured seconds loading the request's hit blocks into the GPU pool."""


def outcome(req: RequestLike, r: int, names: list[str], one: RoundStats,
            ttft: float = math.nan, corrupt: dict[str, int] | None = None,
            load_s: float | None = None) -> RequestOutcome:
    """One request's :class:`RequestOutcome` from the counters it alone added."""
    def per(values: list[int]) -> dict[str, int]:
        return dict(zip(names, values, strict=True))

    return RequestOutcome(
        line=req.line, round=r, input_tokens=req.input_length, hit_tokens=per(one.hit_tokens),
        recompute_tokens=one.recompute_tokens, blocks_written=per(one.blocks_written),
        evictions=per(one.evictions), ttft_s=ttft,
        put_blocks=per([w - p for w, p in zip(one.blocks_written, one.promoted_blocks,
                                              strict=True)]),
        promoted_blocks=per(one.promoted_blocks), corrupt_blocks=corrupt, load_s=load_s)


class Replayer:
    """One configuration being replayed: feed it requests, then ask for :meth:`result`.

    The replayer counts (hits, puts, promotions, evictions); it keeps no clock. The times of
    :meth:`result` (``TIME_KEYS``, in total and per round) are ``None`` until the serving
    model's one-engine case fills them (:mod:`kvtool.replay.timing`).
    """

    TIME_KEYS = TIME_KEYS

    def __init__(self, config: CacheConfig, block_tokens: int, block_bytes: int | None = None,
                 on_request: Callable[[RequestOutcome], None] | None = None,
                 movers: dict[str, TierMover] | None = None) -> None:
        self.config = config
        self.block_tokens = block_tokens
        self.block_bytes = block_bytes
        self.on_request = on_request
        self.movers = movers
        self.cache = self.config.build(self.block_bytes, self.block_tokens, self.movers)
        self._serve_request = self.cache.server()
        self.names = self.cache.names
        self.rounds: dict[int, RoundStats] = {}
        self.real_rounds = False
        self._sessions: dict[str | int, int] = {}
        self._anonymous = 0

    def _session_id(self, session: str | int | None) -> int:
        """A small int per session, in order of first appearance (the oracle's rank)."""
        if session is None:
            # Each session-less request is a session of its own, ranked by arrival.
            self._anonymous += 1
            return (1 << 40) + self._anonymous
        ids = self._sessions
        sid = ids.get(session)
        if sid is None:
            sid = ids[session] = len(ids)
        return sid

    def _round_of(self, req: RequestLike) -> tuple[int, RoundStats]:
        """The request's reporting round and its counters (made on its first request)."""
        r = req.report_round
        st = self.rounds.get(r)
        if st is None:
            st = self.rounds[r] = RoundStats(len(self.names))
        if not self.real_rounds and req.round is not None:
            self.real_rounds = True
        return r, st

    def feed(self, req: RequestLike) -> None:
        """Serve one request (requests must come in serve order)."""
        r, st = self._round_of(req)
        if self.on_request is not None:
            self._feed_recorded(req, r, st)
            return
        # _serve, inlined: this runs once per request of every replay.
        session = req.session
        if session is None:  # _session_id, inlined for the session-less traces
            self._anonymous += 1
            sid = (1 << 40) + self._anonymous
        else:
            known = self._sessions.get(session)
            sid = self._session_id(session) if known is None else known
        inp = req.input_length
        B = self.block_tokens
        self._serve_request(req.block_keys, inp, B, sid, st)
        st.count_request(inp, req.output_length)

    def decide(self, req: RequestLike) -> tuple[list[int], list[int]]:
        """:meth:`feed` one request, and return, per tier, the blocks it hit there and the
        blocks written there for it (what the hierarchy counted): the serving model times
        what the hierarchy decided (:mod:`kvtool.serving.serveorder`)."""
        one = self._feed_recorded(req, *self._round_of(req))
        return one.hit_blocks, one.blocks_written

    def feed_many(self, requests: Iterable[RequestLike],
                  progress: Callable[[int], None] | None = None) -> int:
        """:meth:`feed` every request of ``requests``; return how many.

        ``progress(1024)`` is called after every 1024th request. With one tier and
        nothing to tell per request (:meth:`TierHierarchy.single_tier`, no
        ``on_request``), the loop is :meth:`feed` and the hierarchy's single-tier serve
        inlined, its counters kept in locals until the round changes: the same counts in
        less time per request (BENCHMARKS.md, "Replay speed"; the equality with
        :meth:`feed` is tests/cache/test_feed_many.py's).
        """
        tier = self.cache.single_tier() if self.on_request is None else None
        n = 0
        if tier is None:
            feed = self.feed
            for req in requests:
                feed(req)
                n += 1
                if progress is not None and not n & 1023:
                    progress(1024)
            return n
        return self._feed_one_tier(tier, requests, progress)

    def _feed_one_tier(self, tier: Tier, requests: Iterable[RequestLike],
                       progress: Callable[[int], None] | None) -> int:
        """:meth:`feed_many` with one tier and no ``on_request``: :meth:`feed` and the
        hierarchy's single-tier serve inlined, the round's counters kept in locals."""
        n = 0
        policy = tier.policy
        index = policy.index
        access, discard = policy.access, policy.discard
        capacity = tier.capacity
        B = self.block_tokens
        rounds = self.rounds
        sessions = self._sessions
        anonymous = self._anonymous
        real_rounds = self.real_rounds
        # this round's counters, added into its RoundStats when the round changes
        st: RoundStats | None = None
        r_now = None
        reqs = inp_sum = out_sum = recompute = hits = hit_blocks = written = evicted = 0
        try:
            for req in requests:
                r = req.report_round
                if r != r_now:
                    if st is not None:
                        _add_one_tier(st, reqs, inp_sum, out_sum, recompute, hits, hit_blocks,
                                      written, evicted)
                        reqs = inp_sum = out_sum = recompute = hits = hit_blocks = written = 0
                        evicted = 0
                    st = rounds.get(r)
                    if st is None:
                        st = rounds[r] = RoundStats(1)
                    r_now = r
                if not real_rounds and req.round is not None:
                    real_rounds = True
                session = req.session
                if session is None:
                    anonymous += 1
                    sid = (1 << 40) + anonymous
                else:
                    known = sessions.get(session)
                    if known is None:
                        known = sessions[session] = len(sessions)
                    sid = known
                keys = req.block_keys
                inp = req.input_length
                k = 0
                for key in keys:
                    if key not in index:
                        break
                    k += 1
                hit = k * B
                if hit > inp:
                    hit = inp
                if k:
                    hits += hit
                    hit_blocks += k
                recompute += inp - hit
                written += access(keys, sid)
                if len(index) > capacity:
                    evicted += discard(len(index) - int(capacity))
                out = req.output_length
                reqs += 1
                inp_sum += inp
                out_sum += out
                n += 1
                if progress is not None and not n & 1023:
                    progress(1024)
        finally:  # also when a request raises (Ctrl-C): what was served is counted
            if st is not None:
                _add_one_tier(st, reqs, inp_sum, out_sum, recompute, hits, hit_blocks, written,
                              evicted)
            self._anonymous = anonymous
            self.real_rounds = real_rounds
        return n

    def _serve(self, req: RequestLike, st: RoundStats) -> None:
        inp = req.input_length
        self.cache.serve(req.block_keys, inp, self.block_tokens, self._session_id(req.session),
                         st)
        st.count_request(inp, req.output_length)

    def _feed_recorded(self, req: RequestLike, r: int, st: RoundStats) -> RoundStats:
        """Serve ``req`` with its own counters, added into its round's ``st``; tell
        ``on_request``; return them."""
        one = RoundStats(len(self.names))
        self._serve(req, one)
        st.add(one)
        if self.on_request is not None:
            self.on_request(outcome(req, r, self.names, one))
        return one

    def totals(self) -> RoundStats:
        total = RoundStats(len(self.names))
        for st in self.rounds.values():
            total.add(st)
        return total

    def cliff_round(self) -> int | None:
        if not self.real_rounds:
            return None
        return collapse_round({r: (st.hit_total, st.input_tokens) for r, st in self.rounds.items()})

    def result(self) -> dict[str, Any]:
        """The report of this configuration (schema: docs/replay.md)."""
        tiers = []
        for spec, tier in zip(self.config.tiers, self.cache.tiers, strict=True):
            tiers.append({
                "name": tier.name,
                "capacity": str(spec.capacity),
                "capacity_blocks": None if tier.capacity == math.inf else int(tier.capacity),
                "capacity_bytes": (None if tier.capacity == math.inf or not self.block_bytes
                                   else int(tier.capacity) * self.block_bytes),
                "policy": spec.policy,
                "watermark": (None if spec.watermark is None else
                              {"high": spec.watermark.high, "ratio": spec.watermark.ratio}),
                "window": getattr(tier.policy, "window", None),
                "occupancy_blocks": len(tier),
            })
        kind = "round" if self.real_rounds else ("window" if len(self.rounds) > 1 else "none")
        out: dict[str, Any] = {
            "label": self.config.label,
            "write_policy": self.config.write_policy,
            "block_tokens": self.block_tokens,
            "block_bytes": self.block_bytes,
            "tiers": tiers,
        }
        out.update(self.totals().to_dict(self.names, self.block_bytes))
        out["cliff_round"] = self.cliff_round()
        out["round_kind"] = kind
        out["times_are_modelled"] = True
        out["time_model"] = None
        out["rounds"] = [{"round": r, **self.rounds[r].to_dict(self.names, self.block_bytes)}
                         for r in sorted(self.rounds)]
        return out


def _add_one_tier(st: RoundStats, requests: int, input_tokens: int, output_tokens: int,
                  recompute: int, hit_tokens: int, hit_blocks: int, written: int,
                  evictions: int) -> None:
    """Add one tier's counters (:meth:`Replayer.feed_many`'s locals) into ``st``; a hit
    block is read from the tier once, so ``blocks_read`` gains ``hit_blocks``."""
    st.requests += requests
    st.input_tokens += input_tokens
    st.output_tokens += output_tokens
    st.recompute_tokens += recompute
    st.hit_tokens[0] += hit_tokens
    st.hit_blocks[0] += hit_blocks
    st.blocks_read[0] += hit_blocks
    st.blocks_written[0] += written
    st.evictions[0] += evictions


def replay(requests: Iterable[RequestLike], configs: Sequence[CacheConfig], *,
           block_tokens: int, block_bytes: int | None = None,
           progress: Callable[[int], None] | None = None,
           on_request: Callable[[int, RequestOutcome], None] | None = None,
           movers: Sequence[dict[str, TierMover] | None] | None = None
           ) -> list[dict[str, Any]]:
    """Replay ``requests`` through every configuration side by side; return their reports.

    ``progress(n)`` is called every 1024 requests (and at the end) with the number served.
    ``on_request(i, outcome)`` receives every request's accounting for configuration ``i``.
    ``movers[i]`` gives configuration ``i``'s tiers data movers (an I/O log, say).
    The reports' times are ``None`` (:class:`Replayer`).
    """

    def recorder(i: int) -> Callable[[RequestOutcome], None] | None:
        if on_request is None:
            return None
        return lambda outcome: on_request(i, outcome)

    runs = [Replayer(c, block_tokens, block_bytes, on_request=recorder(i),
                     movers=movers[i] if movers else None)
            for i, c in enumerate(configs)]
    feeds = [r.feed for r in runs]
    n = 0
    if len(feeds) == 1:
        n = runs[0].feed_many(requests, progress)
    else:
        for req in requests:
            for f in feeds:
                f(req)
            n += 1
            if progress is not None and not n & 1023:
                progress(1024)
    if progress is not None and n & 1023:
        progress(n & 1023)
    return [r.result() for r in runs]
