"""The names the cache's registries answer to, for command-line choices and file checks.

Cheap to import: the policy registry (:data:`kvtool.cache.policies.POLICIES`) imports no
policy module, so ``kvtool --help`` and argument parsing stay cheap (the policies
themselves pull in the vLLM pool model). :data:`WRITE_POLICIES` is what
:class:`~kvtool.cache.hierarchy.TierHierarchy` takes.
"""

from __future__ import annotations

from kvtool.cache.policies import POLICIES

POLICY_NAMES: tuple[str, ...] = tuple(POLICIES)
"""Eviction policies by name: ``--policy`` choices and ``policy = ...`` in a tiers file
(the registry's keys, in its order)."""

WRITE_POLICIES: tuple[str, ...] = ("write-through", "write-back")
"""How a write reaches the lower tiers: every tier at once, or on eviction."""
