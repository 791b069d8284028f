"""Shared test helpers. Package-specific fixtures live in tests/<package>/conftest.py."""

from __future__ import annotations

import json
import mmap
import os
import shutil
import socket
import subprocess
import tempfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

# The pure-Python serving model, whatever the machine's cache of compiled modules holds
# (kvtool.compiled): tests/serving/test_compiled.py compares the two;
# KVTOOL_COMPILED=1 runs the suite on the compiled build.
os.environ.setdefault("KVTOOL_COMPILED", "0")

from kvtool.cli.main import cli

pytest_plugins = ["tests.helpers.qemu_guest", "tests.helpers.spdk_fixtures",
                  "tests.helpers.engines"]
REPO = Path(__file__).resolve().parent.parent
SHARED = REPO.parent / "shared"
FIXTURES = REPO / "fixtures"


# --- running in parallel (tox: ``pytest -n 2 --dist loadfile``, pytest-xdist) -----------
# Each test module runs whole on one worker (module fixtures such as a booted guest are set
# up once). Tests already take free ports and their own state directories; as a net, a
# worker whose environment names no state directory gets its own, so two workers' targets
# never share a record. The modules that boot a guest or run a real engine are the longest
# (minutes each): they are handed out first (tox keeps this order with xdist's
# --no-loadscope-reorder), so that the short ones fill in around them instead of one long
# module starting last on an otherwise idle machine.

LONG_MARKS = ("rdma", "engine", "qemu")
_WORKER_STATE = pytest.StashKey[Path]()


def pytest_configure(config: pytest.Config) -> None:
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker and "KVTOOL_STATE_DIR" not in os.environ:
        state = Path(tempfile.mkdtemp(prefix=f"kvtool-state-{worker}-"))
        os.environ["KVTOOL_STATE_DIR"] = str(state)
        config.stash[_WORKER_STATE] = state


def pytest_unconfigure(config: pytest.Config) -> None:
    state = config.stash.get(_WORKER_STATE, None)
    if state is not None:
        shutil.rmtree(state, ignore_errors=True)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Modules with a test marked rdma, then engine, then qemu first (stable: the order
    within a module, and among the rest, is the collection order)."""
    rank: dict[str, int] = {}
    for item in items:
        module = item.nodeid.split("::", 1)[0]
        marks = [i for i, m in enumerate(LONG_MARKS) if item.get_closest_marker(m)]
        rank[module] = min([rank.get(module, len(LONG_MARKS)), *marks])
    items.sort(key=lambda item: rank[item.nodeid.split("::", 1)[0]])


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


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def is_root() -> bool:
    return os.geteuid() == 0


# --- real storage: files with O_DIRECT and loop devices --------------------------------
# Files live under build/test-store/ in the checkout (a real filesystem), not under /tmp,
# which may be tmpfs (no O_DIRECT); the fixture checks and skips with the reason otherwise.
# Loop devices need root and losetup; they are always detached in ``finally``.

STORE_DIR = Path(os.environ.get("KVTOOL_TEST_STORE_DIR", REPO / "build" / "test-store"))


def _odirect_ok(directory: Path) -> str | None:
    probe = directory / f".odirect-{uuid.uuid4().hex}"
    try:
        fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    except OSError as exc:
        return f"{directory} does not support O_DIRECT ({exc.strerror})"
    try:
        buf = mmap.mmap(-1, 4096)
        os.pwritev(fd, [buf], 0)
        return None
    except OSError as exc:
        return f"{directory} rejects O_DIRECT writes ({exc.strerror})"
    finally:
        os.close(fd)
        probe.unlink(missing_ok=True)


@pytest.fixture
def store_dir() -> Iterator[Path]:
    """A fresh directory on a filesystem that supports O_DIRECT (removed afterwards)."""
    STORE_DIR.mkdir(parents=True, exist_ok=True)
    reason = _odirect_ok(STORE_DIR)
    if reason:
        pytest.skip(reason)
    d = STORE_DIR / uuid.uuid4().hex[:12]
    d.mkdir()
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def make_file(directory: Path, nbytes: int, name: str = "ns.img") -> Path:
    """A zero-filled, fully allocated regular file."""
    path = directory / name
    with open(path, "wb") as f:
        os.posix_fallocate(f.fileno(), 0, nbytes)
    return path


@pytest.fixture
def blank_file(store_dir: Path) -> Callable[[int], Path]:
    return lambda nbytes: make_file(store_dir, nbytes)


@pytest.fixture
def loop_device(store_dir: Path) -> Iterator[Callable[..., str]]:
    """Factory: ``loop_device(nbytes, sector_size=512, read_only=False)`` → /dev/loopN."""
    if not is_root():
        pytest.skip("loop devices need root")
    if shutil.which("losetup") is None:
        pytest.skip("losetup (util-linux) is not installed")
    attached: list[str] = []

    def make(nbytes: int, sector_size: int = 512, read_only: bool = False) -> str:
        backing = make_file(store_dir, nbytes, f"loop{len(attached)}.img")
        cmd = ["losetup", "-f", "--show", f"--sector-size={sector_size}", "--direct-io=on"]
        if read_only:
            cmd.append("--read-only")
        out = subprocess.run([*cmd, str(backing)], capture_output=True, text=True)
        if out.returncode != 0:
            pytest.fail(f"losetup failed: {out.stderr.strip()}")
        dev = out.stdout.strip()
        attached.append(dev)
        return dev

    try:
        yield make
    finally:
        for dev in attached:
            subprocess.run(["losetup", "-d", dev], check=False, capture_output=True)
