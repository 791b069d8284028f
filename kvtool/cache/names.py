"""The names the cache's registries answer to, for command-line choices and file checks.

A leaf: it imports nothing, so ``kvtool --help`` and argument parsing stay cheap (the
policies themselves pull in the vLLM pool model). Invariant: :data:`POLICY_NAMES` lists
the keys of :data:`kvtool.cache.policies.POLICIES` in order (a test checks it), and
:data:`WRITE_POLICIES` is what :class:`~kvtool.cache.hierarchy.TierHierarchy` takes.
"""

from __future__ import annotations

POLICY_NAMES: tuple[str, ...] = (
    "lru", "lru-tail-first", "radix", "prefix-fair", "oracle", "mooncake", "vllm", "arc",
    "s3fifo", "lfu", "vllm-lru", "vllm-arc")
"""Eviction policies by name: ``--policy`` choices and ``policy = ...`` in a tiers file."""

WRITE_POLICIES: tuple[str, ...] = ("write-through", "write-back")
"""How a write reaches the lower tiers: every tier at once, or on eviction."""
