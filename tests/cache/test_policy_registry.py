"""The policy registry (kvtool/cache/policies/__init__.py): one module per policy, one
registration each; the names the CLI and the files accept come from it, and reading them
imports no policy."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvtool.cache.policies import POLICIES, EvictionPolicy, make_policy
from tests.conftest import REPO


@pytest.mark.parametrize("name", list(POLICIES))
def test_every_registered_policy_is_made_by_its_module(name: str) -> None:
    policy = make_policy(name, block_tokens=16)
    assert isinstance(policy, EvictionPolicy)
    assert (REPO / "kvtool" / "cache" / "policies" / f"{POLICIES[name].module}.py").exists()


def test_the_names_import_no_policy() -> None:
    code = ("import sys, kvtool.cache.names as n; assert n.POLICY_NAMES; "
            "print(sorted(m for m in sys.modules if m.startswith('kvtool.cache.policies.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=REPO).stdout
    assert out.strip() == "[]"
