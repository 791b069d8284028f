"""A real loop device over a sparse file (root only), detached in ``finally``."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


@contextmanager
def loop_device(tmp_path: Path, size: int = 64 << 20, sector_size: int | None = None
                ) -> Iterator[str]:
    """Attach ``losetup -f --show [--sector-size N]`` over a ``size``-byte file."""
    if os.geteuid() != 0:
        pytest.skip("loop devices need root")
    if shutil.which("losetup") is None:
        pytest.skip("losetup (util-linux) is not installed")
    image = tmp_path / f"loop-{sector_size or 512}.img"
    with open(image, "wb") as f:
        f.truncate(size)
    cmd = ["losetup", "-f", "--show"]
    if sector_size is not None:
        cmd += ["--sector-size", str(sector_size)]
    dev = subprocess.run([*cmd, str(image)], check=True, capture_output=True,
                         text=True).stdout.strip()
    try:
        yield dev
    finally:
        subprocess.run(["losetup", "-d", dev], check=False, capture_output=True)
