"""Object keys for ``kvtool load``: the cache replayer's chained block keys.

``kvtool load --seed S`` stores the KV blocks of synthetic conversations, keyed exactly
as the cache replayer keys them (:func:`kvtool.trace.hashing.chain_hashes`): session *s*
is ``SESSION_BLOCKS`` blocks of seeded token ids, and object *i* (its *ordinal*) is block
``i % SESSION_BLOCKS`` of session ``i // SESSION_BLOCKS``. So the same seed gives the
same keys in every run, which lets a re-run resume and ``verify`` regenerate content.
"""

from __future__ import annotations

import numpy as np

from kvtool.trace.hashing import chain_hashes

SESSION_BLOCKS = 64
"""Blocks per synthetic session (a 16k-token conversation at 256 tokens per block)."""
VOCAB = 151_936
"""Token ids are drawn from [0, VOCAB) (Qwen2's vocabulary size)."""


def object_keys(seed: int, count: int, block_tokens: int = 256) -> list[int]:
    """Keys of ordinals ``0 .. count-1`` for ``seed``."""
    keys: list[int] = []
    session = 0
    while len(keys) < count:
        rng = np.random.Generator(np.random.PCG64([seed, session]))
        tokens = rng.integers(0, VOCAB, size=SESSION_BLOCKS * block_tokens, dtype=np.int64)
        keys.extend(chain_hashes(tokens.tolist(), block_tokens))
        session += 1
    return keys[:count]
