"""Shared test helpers. Package-specific fixtures live in tests/<package>/conftest.py."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from kvtool.cli.main import cli

pytest_plugins = ["tests.qemu_guest"]
REPO = Path(__file__).resolve().parent.parent
SHARED = REPO.parent / "shared"
FIXTURES = REPO / "fixtures"


def run(*args: str, input: str | None = None) -> Result:
    """Run the kvtool CLI in-process (stdout and stderr kept apart)."""
    return CliRunner().invoke(cli, [str(a) for a in args], input=input, catch_exceptions=False)


def run_json(*args: str) -> Any:
    """Run with --json, assert exit 0, return the parsed document."""
    result = run("--json", *args)
    assert result.exit_code == 0, result.stderr + result.stdout
    return json.loads(result.stdout)


@pytest.fixture
def mooncake_traces() -> Path:
    """../shared/traces/mooncake, or skip with the reason."""
    path = SHARED / "traces" / "mooncake"
    if not (path / "conversation_trace.jsonl").exists():
        pytest.skip(f"public Mooncake traces not present at {path} (../shared is reference material)")
    return path


def is_root() -> bool:
    return os.geteuid() == 0
