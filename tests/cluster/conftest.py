"""A real cluster of network namespaces with Ray, emulator targets and Mooncake.

Needs root, ``ip netns``, Ray (extra ``cluster``) and Mooncake (extra ``mooncake``); skips
with the reason otherwise. Every cluster made here has a name and a subnet of its own and
its record under a temporary state directory, and is taken down (and checked gone) even
when a test fails.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import FIXTURES, REPO


def skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "a netns cluster needs root"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "ip/tc (iproute2) not installed"
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"ip netns unavailable: {probe.stderr.strip()}"
    if importlib.util.find_spec("ray") is None:
        return "Ray not installed (pip install 'kvtool[cluster]')"
    if not (Path(sys.executable).parent / "mooncake_master").exists() \
            and shutil.which("mooncake_master") is None:
        return "Mooncake not installed (pip install 'kvtool[mooncake]')"
    return None


@dataclass
class Cluster:
    """A cluster file of this test run and how to call kvtool on it."""

    name: str
    file: Path
    env: dict[str, str]

    def kvtool(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "kvtool", *args], capture_output=True,
                              text=True, env=self.env, timeout=timeout, cwd=REPO)

    def json(self, *args: str, timeout: float = 300) -> Any:
        proc = self.kvtool("--json", *args, timeout=timeout)
        assert proc.returncode == 0, proc.stderr[-2000:] + proc.stdout[-2000:]
        return json.loads(proc.stdout)

    def leftovers(self) -> list[str]:
        """Namespaces, links and processes of this cluster still there."""
        from kvtool.cluster import netns as N

        left = [ns for ns in N.namespaces() if ns.startswith(f"kvtool-{self.name}-")]
        for link in subprocess.run(["ip", "-o", "link", "show"], capture_output=True,
                                   text=True).stdout.splitlines():
            if f"kv{N.tag(self.name)}" in link or f"kvb{N.tag(self.name)}" in link:
                left.append(link.split(":")[1].strip())
        mark = f"KVTOOL_CLUSTER={self.name}".encode()
        for entry in os.scandir("/proc"):
            if entry.name.isdigit():
                try:
                    with open(f"/proc/{entry.name}/environ", "rb") as f:
                        if mark in f.read().split(b"\0"):
                            cmd = Path(f"/proc/{entry.name}/cmdline").read_bytes()
                            left.append(f"pid {entry.name}: {cmd[:80]!r}")
                except OSError:
                    continue
        return left


def make_cluster(tmp: Path, text: str, subnet_octet: int) -> Cluster:
    """``text`` (a cluster file) under a fresh name and subnet 10.<octet>.<x>.0/24."""
    name = f"t{uuid.uuid4().hex[:6]}"
    x = int(name[1:3], 16)
    text = text.replace('name = "gp7000-mini"', f'name = "{name}"')
    text = text.replace('subnet = "10.200.0.0/24"', f'subnet = "10.{subnet_octet}.{x}.0/24"')
    text = text.replace('"../models/', f'"{FIXTURES}/models/')  # the file moves to tmp
    file = tmp / f"{name}.toml"
    file.write_text(text)
    env = {**os.environ, "KVTOOL_STATE_DIR": str(tmp / "state"),
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    return Cluster(name, file, env)


@contextlib.contextmanager
def cluster_up(tmp: Path, text: str, subnet_octet: int) -> Iterator[Cluster]:
    """``text`` (a cluster file) brought up with ``kvtool cluster up`` (skipped with the
    reason where it cannot be), and down at the end: down must succeed and leave nothing."""
    why = skip_reason()
    if why:
        pytest.skip(why)
    c = make_cluster(tmp, text, subnet_octet)
    try:
        up = c.kvtool("cluster", "up", str(c.file))
        assert up.returncode == 0, up.stderr[-3000:]
        yield c
    finally:
        down = c.kvtool("cluster", "down", str(c.file))
        left = c.leftovers()
        assert down.returncode == 0 and not left, (down.stderr[-2000:], left)


@pytest.fixture(scope="module")
def mini(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """gp7000-mini brought up once for the module (and down at the end)."""
    with cluster_up(tmp_path_factory.mktemp("cluster"),
                    (FIXTURES / "clusters" / "gp7000-mini.toml").read_text(), 213) as c:
        yield c
