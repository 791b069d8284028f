"""Without the ``spdk`` extra (PyPI ``spdk``, SPDK's JSON-RPC client) a spdk config is one
line naming the extra, exit 2 — not an internal error."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.conftest import FIXTURES, run

CONFIG = FIXTURES / "targets" / "spdk-malloc.toml"


@pytest.fixture
def no_spdk_client(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    for name in [m for m in sys.modules if m == "spdk" or m.startswith("spdk.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "spdk", None)  # import spdk... raises ImportError
    monkeypatch.setenv("KVTOOL_STATE_DIR", str(tmp_path / "state"))
    return tmp_path


@pytest.mark.parametrize("args", [
    ["target", "up", str(CONFIG)],
    ["target", "up", str(CONFIG), "--dry-run"],
    ["target", "status", str(CONFIG)],
    ["target", "down", str(CONFIG)],
    ["target", "export", str(CONFIG), "--format", "spdk", "--live"],
    ["target", "up", str(FIXTURES / "targets" / "demo.toml"), "--runtime", "spdk"],
], ids=["up", "dry-run", "status", "down", "export-live", "runtime-spdk"])
def test_missing_extra_is_one_line_exit_2(no_spdk_client: Path, args: list[str]) -> None:
    result = run(*args, "--spdk-socket", str(no_spdk_client / "spdk.sock")) \
        if "--runtime" not in args else run(*args)
    assert result.exit_code == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "install kvtool[spdk]" in lines[0], result.stderr
    assert "Traceback" not in result.stderr and "ModuleNotFoundError" not in result.stderr


def test_export_needs_no_client(no_spdk_client: Path) -> None:
    """The config as SPDK JSON is computed locally: no client needed."""
    result = run("target", "export", str(CONFIG), "--format", "spdk")
    assert result.exit_code == 0, result.stderr
    assert '"nvmf_create_subsystem"' in result.stdout
