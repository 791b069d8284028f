"""``vllm-lru`` and ``vllm-arc`` equal vLLM 0.33.0's CPU offloading manager request by
request: the same hits, stores, evictions and cached blocks after every request.

vLLM's own ``CPUOffloadingManager`` (``vllm/v1/kv_offload/cpu/``) is driven with the calls
its offloading connector makes for one request (lookup until the first miss,
``prepare_load``/``complete_load`` of the hit run, ``prepare_store``/``complete_store`` of
the blocks after it, ``on_request_finished``); kvtool replays the same requests through
a one-tier hierarchy. Needs ``pip install --no-deps vllm==0.33.0`` (see tox.ini).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from kvtool.cache import CacheConfig, Replayer, TierSpec
from kvtool.cache.replayer import RequestOutcome
from kvtool.trace import read_trace
from kvtool.units import Capacity
from tests.helpers.cache import req
from tests.helpers.vllm_offload import VLLM_VERSION, load

VLLM = load()
pytestmark = pytest.mark.skipif(
    VLLM is None or VLLM.version != VLLM_VERSION,
    reason=f"vLLM {VLLM_VERSION} is not installed (pip install --no-deps vllm=={VLLM_VERSION}): "
           "the vllm-* policies are checked against its own offloading code")

TRACE = Path(__file__).resolve().parents[3] / "shared" / "traces" / "mooncake" / "conversation_trace.jsonl"


class VllmTier:
    """vLLM's CPUOffloadingManager behind the offloading connector's calls for one request."""

    def __init__(self, capacity: int, policy: str, store_threshold: int = 1) -> None:
        assert VLLM is not None
        self.m = VLLM.CPUOffloadingManager(capacity, cache_policy=policy,
                                           store_threshold=store_threshold)
        self.n = 0

    @staticmethod
    def key(k: int) -> Any:
        assert VLLM is not None
        return VLLM.make_offload_key((k & (2**64 - 1)).to_bytes(8, "big"), 0)

    def serve(self, blocks: list[int], block_tokens: int) -> tuple[int, int, list[Any]]:
        """One request of full blocks: (hit blocks, blocks stored, evicted keys)."""
        assert VLLM is not None
        self.n += 1
        ctx = VLLM.ReqContext(f"r{self.n}")
        keys = [self.key(k) for k in blocks]
        for pos, key in enumerate(keys):
            ctx.set_offload_key_position(key, (pos + 1) * block_tokens)
        m = self.m
        m.on_new_request(ctx)
        k = 0
        for key in keys:
            if m.lookup(key, ctx) != VLLM.LookupResult.HIT:
                break
            k += 1
        if k:
            m.prepare_load(keys[:k], ctx)
            m.complete_load(keys[:k], ctx)
        out = m.prepare_store(keys[k:] if k else keys, ctx)
        stored, evicted = 0, []
        if out is not None:
            if out.keys_to_store:
                m.complete_store(out.keys_to_store, ctx)
            stored, evicted = len(out.keys_to_store), list(out.evicted_keys)
        m.on_request_finished(ctx)
        return k, stored, evicted

    def cached(self) -> set[Any]:
        pol = self.m._policy
        return set(pol.chunks) if hasattr(pol, "chunks") else set(pol.t1) | set(pol.t2)


def compare(stream: list[tuple[list[int], int]], B: int, capacity: int, policy: str,
            threshold: int = 1) -> dict[str, int]:
    """Replay ``stream`` (block keys, input tokens) both ways; assert per-request equality."""
    ours: list[RequestOutcome] = []
    spec = TierSpec("dram", Capacity.parse(f"{capacity}blk"), f"vllm-{policy}",
                    admit_after=threshold if threshold > 1 else None)
    rep = Replayer(CacheConfig([spec]), B, on_request=ours.append)
    tier = rep.cache.tiers[0]
    theirs = VllmTier(capacity, policy, threshold)
    totals = {"hits": 0, "stored": 0, "evicted": 0}
    for i, (keys, tokens) in enumerate(stream):
        rep.feed(req(keys, block_tokens=B, input_length=tokens))
        k, stored, evicted = theirs.serve(keys[: tokens // B], B)
        o = ours[-1]
        where = f"request {i} ({policy}, {capacity} blocks, threshold {threshold})"
        assert o.hit_tokens["dram"] == k * B, where
        assert o.blocks_written["dram"] == stored, where
        assert o.evictions["dram"] == len(evicted), where
        assert {VllmTier.key(x) for x in tier.policy.index} == theirs.cached(), where
        totals["hits"] += k
        totals["stored"] += stored
        totals["evicted"] += len(evicted)
    return totals


def random_stream(seed: int, n: int = 300, B: int = 16) -> list[tuple[list[int], int]]:
    """Chains from a small prefix tree (shared heads, growing sessions), partial tails."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        path = [rng.randrange(3) for _ in range(rng.randrange(1, 12))]
        keys = [hash(tuple(path[: i + 1])) & 0xFFFFFFFF for i in range(len(path))]
        out.append((keys, len(keys) * B - rng.randrange(B)))
    return out


@pytest.mark.parametrize("policy", ["lru", "arc"])
@pytest.mark.parametrize("capacity", [1, 3, 8, 20])
@pytest.mark.parametrize("threshold", [1, 2])
def test_random_streams_equal_vllm_request_by_request(policy: str, capacity: int,
                                                      threshold: int) -> None:
    for seed in range(4):
        totals = compare(random_stream(seed), 16, capacity, policy, threshold)
        assert totals["hits"] > 0  # the stream exercises hits, not only misses


@pytest.mark.slow
@pytest.mark.skipif(not TRACE.exists(), reason=f"{TRACE} is missing")
@pytest.mark.parametrize("policy", ["lru", "arc"])
@pytest.mark.parametrize("capacity", [500, 2000])
def test_mooncake_conversation_equals_vllm_request_by_request(policy: str, capacity: int) -> None:
    stream = []
    for r in read_trace(TRACE, fmt="mooncake", block_tokens=512):
        stream.append((list(r.block_keys), r.input_length))
        if len(stream) == 2000:
            break
    totals = compare(stream, 512, capacity, policy)
    assert totals["evicted"] > 0 and totals["hits"] > 0
