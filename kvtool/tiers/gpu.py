"""The CPU "GPU" tier: one paged KV pool with vLLM v1 block-pool semantics.

vLLM v1's ``BlockPool`` owns ``num_blocks`` fixed-size KV blocks in device memory and
keeps, per block, an id, a reference count (how many running requests use it) and the
hash of the prefix it holds; a hash → block map finds cached prefixes; a free queue
orders the blocks no request uses. This pool keeps the same state over one preallocated
numpy array ``(num_blocks, block_bytes)``:

* :meth:`allocate` hands out blocks from the front of the free queue with
  ``ref_cnt = 1`` (a request's working blocks: loaded hits and computed blocks);
* :meth:`touch` / :meth:`release` raise and drop a request's references;
* :meth:`cache` records ``key → block`` (the block now holds that prefix);
* :meth:`uncache` is eviction: the key leaves the map and, once no request holds the
  block, the block joins the free queue's tail.

Which cached block is evicted when is the tier's eviction policy (vLLM's own order is
the ``lru-tail-first`` policy), decided by the replayer; the pool carries it out.
The pool holds the tier's capacity plus the working blocks of the longest request, as
vLLM's pool must hold a running request's blocks besides the cached ones.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

import numpy as np

from kvtool.tiers.base import prefault


class GpuBlockPool:
    """Block ids, reference counts, the hash → block map and the free queue."""

    def __init__(self, num_blocks: int, block_bytes: int) -> None:
        if num_blocks < 1 or block_bytes < 1:
            raise ValueError("the GPU pool needs at least one block of at least one byte")
        self.num_blocks = num_blocks
        self.block_bytes = block_bytes
        self.data = np.empty((num_blocks, block_bytes), dtype=np.uint8)
        prefault(self.data)
        self.ref_cnt = [0] * num_blocks
        self.block_key: list[int | None] = [None] * num_blocks
        self.cached: dict[int, int] = {}
        self.free_queue: deque[int] = deque(range(num_blocks))

    def __contains__(self, key: int) -> bool:
        return key in self.cached

    def __len__(self) -> int:
        return len(self.cached)

    @property
    def free_blocks(self) -> int:
        return len(self.free_queue)

    def block(self, block_id: int) -> np.ndarray:
        return self.data[block_id]

    def allocate(self, n: int) -> list[int]:
        """``n`` blocks off the free queue's front, each with one reference."""
        fq = self.free_queue
        if n > len(fq):
            raise RuntimeError(f"GPU pool: {n} blocks asked, {len(fq)} free of "
                               f"{self.num_blocks} (the engine sized it too small)")
        out = [fq.popleft() for _ in range(n)]
        ref = self.ref_cnt
        for b in out:
            ref[b] = 1
        return out

    def touch(self, blocks: Iterable[int]) -> None:
        ref = self.ref_cnt
        for b in blocks:
            ref[b] += 1

    def release(self, blocks: Iterable[int]) -> None:
        """Drop one reference each; a block no request holds and no key names is free."""
        ref, keys, fq = self.ref_cnt, self.block_key, self.free_queue
        for b in blocks:
            ref[b] -= 1
            if ref[b] == 0 and keys[b] is None:
                fq.append(b)

    def cache(self, key: int, block_id: int) -> None:
        self.cached[key] = block_id
        self.block_key[block_id] = key

    def uncache(self, key: int) -> None:
        b = self.cached.pop(key, None)
        if b is None:
            return
        self.block_key[b] = None
        if self.ref_cnt[b] == 0:
            self.free_queue.append(b)
