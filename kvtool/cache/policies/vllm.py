"""``vllm``: vLLM v1's GPU prefix-cache pool exactly (GPU tier only)."""

from __future__ import annotations

from collections.abc import Container
from typing import TYPE_CHECKING, Any, cast

from kvtool.cache.policies.admission import Admission
from kvtool.cache.policies.base import EvictionPolicy

if TYPE_CHECKING:
    from kvtool.serving.kvpool import KVPool


class PromptSeq:
    """A request's prompt as :class:`~kvtool.serving.kvpool.KVPool` reads it."""

    __slots__ = ("block_hashes", "num_computed_tokens", "num_prompt_tokens", "num_tokens",
                 "request_id")

    def __init__(self, keys: list[int], num_tokens: int, block_tokens: int) -> None:
        self.request_id = "replay"
        self.num_tokens = self.num_prompt_tokens = num_tokens
        self.num_computed_tokens = 0
        self.block_hashes = keys[: num_tokens // block_tokens]


class VllmPolicy(EvictionPolicy):
    """vLLM v1's GPU KV pool with prefix caching, exactly (:mod:`kvtool.serving.kvpool`).

    The tier's capacity is vLLM's ``num_gpu_blocks``: block 0 is the null block, so
    ``N`` blocks cache at most ``N - 1``. Each request runs alone and is freed at the end,
    as in a vLLM engine serving one request at a time: its lookup hits at most
    ``⌊(L − 1)/B⌋`` leading full blocks; it takes blocks for all ``L`` prompt tokens from
    the free queue's head (evicting the keys they held), caches its full blocks (a
    recomputed block already cached becomes a second copy), and frees them tail first.
    Blocks a lower tier supplies arrive as vLLM's external (connector) tokens. A request
    longer than the pool (``⌈L/B⌉ > N − 1``), which vLLM would refuse, leaves the pool
    as it was. :attr:`index` is the pool's hash index (distinct cached keys).

    The hierarchy serves this tier through :meth:`serve_request`; :meth:`access`,
    :meth:`admit` and :meth:`evict` exist for the generic interface: ``access`` and
    ``admit`` run the keys as a request of whole blocks, ``evict`` drops the keys of the
    next blocks the pool would reuse (vLLM's ``evict_blocks``).
    """

    name = "vllm"
    pooled = True

    def __init__(self, block_tokens: int = 1) -> None:
        if block_tokens < 1:
            raise ValueError("block_tokens must be at least 1")
        self.block_tokens = block_tokens
        self.pool: KVPool | None = None
        self.index: dict[int, int] = {}

    @property
    def capacity(self) -> float:
        return self.pool.num_gpu_blocks if self.pool is not None else 0

    @capacity.setter
    def capacity(self, value: float) -> None:
        """Set by the :class:`~kvtool.cache.tier.Tier`: build the pool of that many blocks."""
        if value == float("inf") or int(value) < 2:
            raise ValueError("the vllm policy needs a finite pool of at least 2 blocks "
                             "(vLLM's num_gpu_blocks, the null block included)")
        if self.pool is not None:
            raise ValueError("the vllm policy's pool is already built")
        from kvtool.serving.kvpool import KVPool  # the vllm policy only (start-up time)

        self.pool = KVPool(int(value), self.block_tokens)
        self.index = cast(dict[int, int], self.pool.hash_index)

    def _pool(self) -> KVPool:
        if self.pool is None:
            raise ValueError("the vllm policy has no pool yet (put it in a Tier)")
        return self.pool

    def fits(self, input_length: int) -> bool:
        """Whether a prompt of ``input_length`` tokens fits in the pool at all."""
        pool = self._pool()
        return input_length > 0 and -(-input_length // self.block_tokens) <= pool.num_gpu_blocks - 1

    def hit_blocks(self, keys: list[int], input_length: int) -> int:
        """How many leading blocks of the prompt the pool serves (no side effect)."""
        if not self.fits(input_length):
            return 0
        pool = self._pool()
        n = min((input_length - 1) // self.block_tokens, len(keys))
        return pool.cached_prefix_blocks(keys[:n])

    def serve_request(self, keys: list[int], input_length: int, external_blocks: int,
                      evicted: list[int] | None = None) -> tuple[int, int, int]:
        """Run one prompt alone: look up, allocate, cache, free.

        ``external_blocks`` leading blocks past the pool's hit come from lower tiers (the
        connector's tokens). Keys that leave the index are appended to ``evicted``.
        Returns ``(hit blocks, blocks cached, block evictions)``; a prompt that does not
        fit changes nothing and returns zeros.
        """
        if not self.fits(input_length):
            return 0, 0, 0
        pool = self._pool()
        B = self.block_tokens
        seq = PromptSeq(keys, input_length, B)
        blocks, hit = pool.get_computed_blocks(seq)
        ext = min(external_blocks * B, input_length - hit)
        before = pool.evictions
        pool.evicted_keys = cast(list[Any], evicted)
        try:
            new = pool.allocate_slots(seq, input_length - hit - ext, hit, blocks,
                                      num_external_computed_tokens=ext, has_scheduled_reqs=False)
        finally:
            pool.evicted_keys = None
        assert new is not None, "a prompt that fits an idle pool is always allocated"
        pool.free(seq)
        full = len(seq.block_hashes)
        return len(blocks), max(0, full - len(blocks)), pool.evictions - before

    def access(self, keys: list[int], session: int, *, admit: bool = True,
               skip: Container[int] | None = None, record: list[int] | None = None) -> int:
        if not admit:
            return 0
        before = len(self.index)
        fresh = [k for k in dict.fromkeys(keys) if k not in self.index]
        self.serve_request(keys, len(keys) * self.block_tokens, 0)
        if record is not None:
            record.extend(k for k in fresh if k in self.index)
        return max(0, len(self.index) - before)

    def admit(self, keys: list[int]) -> list[int]:
        fresh = [k for k in dict.fromkeys(keys) if k not in self.index]
        self.serve_request(keys, len(keys) * self.block_tokens, 0)
        return [k for k in fresh if k in self.index]

    def evict(self, n: int) -> list[int]:
        pool = self._pool()
        out: list[int] = []
        pool.evicted_keys = cast(list[Any], out)
        try:
            victims = [b for b in pool.free_queue() if pool.block_key(b) is not None][:n]
            pool.evict_blocks(victims)
        finally:
            pool.evicted_keys = None
        return out


def make(*, window: int | None = None, block_tokens: int = 1,
         admission: Admission | None = None) -> EvictionPolicy:
    """A fresh ``vllm`` GPU pool of ``block_tokens``-token blocks; it takes no admission
    rule."""
    if admission is not None:
        raise ValueError("the vllm GPU pool has no admission rule")
    return VllmPolicy(block_tokens)
