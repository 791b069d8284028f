"""Checks on CLI results shared by the command tests."""

from __future__ import annotations

import hashlib
from pathlib import Path

from click.testing import Result


def digest(path: Path) -> str:
    """SHA-256 of a file: proves a failed command wrote nothing."""
    return hashlib.sha256(path.read_bytes()).hexdigest()


def one_error_line(result: Result, *words: str) -> None:
    """Exit 2 with exactly one ``kvtool: error:`` line on stderr containing ``words``."""
    assert result.exit_code == 2, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvtool: error:"), result.stderr
    assert "Traceback" not in result.stderr
    for w in words:
        assert w in lines[0], lines[0]
