"""kvtool never loses track of a process it started (issue 21, part 1).

For every runtime that starts a background process (userspace, spdk, qemu): up -> down leaves
no process and a free port; up -> status -> down -> status; a ``kvtool target up`` killed
with SIGKILL half-way, then ``down``, cleans everything up; ``down`` acts on the record, not
on the config's runtime of today. Then the records themselves: a dead or reused pid is
cleaned with a note (and the process that reused it is left alone), a ``down`` that cannot
stop a recorded process fails and keeps the record, and ``up`` on a port that another
target's process holds names that target.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtool.target import procs
from kvtool.target import state as st
from tests.conftest import REPO, free_port, is_root, run, run_json

HOST = "nqn.2014-08.org.nvmexpress:uuid:21212121-2121-4121-8121-212121212121"
NQN = "nqn.2026-01.io.kvtool:procs"

RUNTIMES = [
    pytest.param("userspace", id="userspace"),
    pytest.param("spdk", id="spdk", marks=[pytest.mark.spdk, pytest.mark.integration,
                                           pytest.mark.slow]),
    pytest.param("qemu", id="qemu", marks=[pytest.mark.qemu, pytest.mark.integration,
                                           pytest.mark.slow]),
]


@pytest.fixture
def state_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    d = tmp_path / "state"
    monkeypatch.setenv("KVTOOL_STATE_DIR", str(d))
    monkeypatch.setenv("KVTOOL_HOSTNQN", HOST)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    yield d
    for rec in procs.records():  # never leave a process behind, whatever the test did
        procs.stop(rec, timeout=5)


@pytest.fixture
def runtime(request: pytest.FixtureRequest, state_dir: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    name: str = request.param
    if name == "spdk":
        install = request.getfixturevalue("spdk")
        monkeypatch.setenv("KVTOOL_SPDK_DIR", str(install.root))
    if name == "qemu":
        request.getfixturevalue("guest_image")
    return name


def config(path: Path, port: int, *, runtime: str, name: str = "procs") -> Path:
    lba = 4096 if runtime == "qemu" else 512
    path.write_text(f"""
backend = "emulator"
name = "{name}"
[emulator]
runtime = "{runtime}"
[[subsystem]]
nqn = "{NQN}"
hosts = ["@local"]
  [[subsystem.namespace]]
  nsid = 1
  size = "16MiB"
  lba = {lba}
[[listener]]
address = "127.0.0.1"
port = {port}
""")
    return path


def port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def wait_port_free(port: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not port_free(port):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def tokened(token: str) -> list[int]:
    """Live processes carrying ``token`` (the recorded process and its children)."""
    rec = procs.ProcessRecord(target="?", backend="?", runtime=None, role="?", token=token)
    return procs.members(rec)


def assert_nothing_left(port: int, pids: list[int], tokens: list[str]) -> None:
    assert [p for p in pids if st.pid_alive(p)] == []
    assert [t for t in tokens if tokened(t)] == []
    assert procs.records() == [] and st.names() == []
    assert wait_port_free(port), f"port {port} still taken"


@pytest.mark.integration
@pytest.mark.parametrize("runtime", RUNTIMES, indirect=True)
def test_up_status_down_status_leaves_nothing(runtime: str, tmp_path: Path) -> None:
    port = free_port()
    cfg = config(tmp_path / "t.toml", port, runtime=runtime)
    up = run_json("target", "up", str(cfg))
    assert up["status"]["state"] == "up"
    status = run_json("target", "status")
    pid = status["pid"]
    assert st.pid_alive(pid) and not port_free(port)
    [proc] = status["processes"]
    assert (proc["pid"], proc["running"], proc["phase"], proc["ports"]) == (pid, True, "up", [port])
    assert proc["start_time"] == procs.start_time(pid)
    token = procs.records()[0].token
    down = run_json("target", "down", str(cfg))
    assert down["changed"] is True
    assert_nothing_left(port, [pid], [token])
    after = run_json("target", "status", str(cfg))
    assert (after["state"], after["processes"], after["pid"]) == ("down", [], None)
    nothing = run("target", "status")
    assert nothing.exit_code == 0 and "nothing is up" in nothing.stdout


@pytest.mark.integration
@pytest.mark.parametrize("runtime", RUNTIMES, indirect=True)
def test_sigkill_during_up_then_down_cleans_up(runtime: str, tmp_path: Path) -> None:
    port = free_port()
    cfg = config(tmp_path / "t.toml", port, runtime=runtime)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    kv = subprocess.Popen([sys.executable, "-m", "kvtool", "target", "up", str(cfg)], env=env,
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    started: procs.ProcessRecord | None = None
    while started is None and kv.poll() is None and time.monotonic() < deadline:
        started = next((r for r in procs.records() if r.pid), None)
        time.sleep(0.005)
    kv.kill()
    kv.wait()
    assert started is not None, "kvtool finished or failed before its process was recorded"
    assert started.phase == "starting" and st.names() == [], "up was not interrupted half-way"
    pid, token = started.pid, started.token
    assert pid is not None and procs.alive(started)
    # the interrupted up is visible, and the record names its process
    status = run_json("target", "status", "--name", "procs")
    assert status["state"] == "partial" and [p["pid"] for p in status["processes"]] == [pid]
    assert any("interrupted up" in n for n in status["notes"])
    # an up of another target on the same port says who holds it
    other = run("target", "up", str(config(tmp_path / "o.toml", port, runtime="userspace",
                                               name="other")))
    assert other.exit_code == 1 and "held by target 'procs'" in other.stderr
    down = run_json("target", "down", str(cfg))
    assert [s["action"] for s in down["plan"]["steps"]] == ["stop"]
    assert_nothing_left(port, [pid], [token])


@pytest.mark.integration
def test_down_acts_on_the_record_not_on_the_configs_runtime(state_dir: Path, tmp_path: Path) -> None:
    """The issue's case: up with --runtime overriding the file, down with the file alone."""
    port = free_port()
    cfg = config(tmp_path / "t.toml", port, runtime="qemu")  # the file says qemu
    up = run_json("target", "up", str(cfg), "--runtime", "userspace")
    pid = up["status"]["pid"]
    status = run_json("target", "status", str(cfg))  # the record, not the file's runtime
    assert (status["runtime"], status["state"], status["pid"]) == ("userspace", "up", pid)
    assert any("acting on the record" in n for n in status["notes"])
    down = run("target", "down", str(cfg))
    assert down.exit_code == 0 and "acting on the record" in " ".join(down.stdout.split())
    assert_nothing_left(port, [pid], [])


@pytest.mark.integration
def test_dead_or_reused_pid_is_cleaned_with_a_note(state_dir: Path, tmp_path: Path) -> None:
    port = free_port()
    cfg = config(tmp_path / "t.toml", port, runtime="userspace")
    pid = run_json("target", "up", str(cfg))["status"]["pid"]
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while st.pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    status = run("target", "status", str(cfg))
    assert status.exit_code == 0 and "no longer running; its record was removed" in status.stdout
    assert procs.records() == [] and st.names() == []

    # a record whose pid now belongs to another process: cleaned, that process left alone
    run_json("target", "up", str(cfg))
    [rec] = procs.records()
    stranger = subprocess.Popen(["sleep", "60"])
    try:
        procs.stop(rec)
        # the state as a crash would leave it, but with the pid reused by `sleep`
        rec.pid, rec.phase = stranger.pid, "up"
        rec.save()
        record = st.load("procs")
        assert record is not None and record.pid_start == rec.start_time
        record.pid = stranger.pid
        st.save(record)
        down = run_json("target", "down", "--name", "procs")
        notes = down["plan"]["notes"]
        assert any("belongs to another process" in n for n in notes), notes
        assert stranger.poll() is None  # not killed
        assert procs.records() == [] and st.names() == []
    finally:
        stranger.kill()
        stranger.wait()


@pytest.mark.integration
@pytest.mark.skipif(not is_root() or shutil.which("setpriv") is None,
                    reason="needs root and setpriv, to run down as a user who cannot stop it")
@contextlib.contextmanager
def traversable(path: Path) -> Iterator[None]:
    """Let other users traverse every directory above ``path`` for a while (tox makes its
    ``.tox`` 0700, so an unprivileged user could not reach this test's interpreter)."""
    changed = []
    for d in [path, *path.parents]:
        mode = d.stat().st_mode
        if not mode & 0o001:
            d.chmod(mode | 0o001)
            changed.append((d, mode))
    try:
        yield
    finally:
        for d, mode in changed:
            d.chmod(mode)


def test_down_that_cannot_stop_the_process_fails_and_keeps_the_record(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    shared = Path(tempfile.mkdtemp(prefix="kvtool-procs-"))  # reachable by nobody
    shared.chmod(0o777)
    monkeypatch.setenv("KVTOOL_STATE_DIR", str(shared / "state"))
    monkeypatch.setenv("KVTOOL_HOSTNQN", HOST)
    port = free_port()
    cfg = config(shared / "t.toml", port, runtime="userspace")
    try:
        pid = run_json("target", "up", str(cfg))["status"]["pid"]
        for root, dirs, files in os.walk(shared):
            for n in [*dirs, *files]:
                os.chown(os.path.join(root, n), 65534, 65534)
        env = {**os.environ, "PYTHONPATH": str(REPO), "HOME": str(shared)}
        with traversable(Path(sys.prefix)):
            r = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                                sys.executable, "-m", "kvtool", "target", "down", "--name",
                                "procs"], env=env, capture_output=True, text=True, timeout=120)
        assert r.returncode == 1, r.stdout + r.stderr
        assert "not permitted to signal" in r.stderr and "record is kept" in r.stderr
        assert st.pid_alive(pid) and st.names() == ["procs"] and len(procs.records()) == 1
        assert run_json("target", "down", "--name", "procs")["changed"] is True  # as root
        assert_nothing_left(port, [pid], [])
    finally:
        for rec in procs.records():
            procs.stop(rec, timeout=5)
        shutil.rmtree(shared, ignore_errors=True)


@pytest.mark.integration
def test_up_on_a_port_another_target_holds_names_it(state_dir: Path, tmp_path: Path) -> None:
    port = free_port()
    first = config(tmp_path / "a.toml", port, runtime="userspace", name="first")
    pid = run_json("target", "up", str(first))["status"]["pid"]
    second = run("target", "up", str(config(tmp_path / "b.toml", port, runtime="userspace",
                                            name="second")))
    assert second.exit_code == 1
    assert f"port {port} is held by target 'first'" in second.stderr
    assert f"pid {pid}" in second.stderr and "kvtool target down --name first" in second.stderr
    assert second.stderr.strip().count("\n") == 0
    run_json("target", "down", "--name", "first")
    assert_nothing_left(port, [pid], [])


def test_process_record_is_written_before_the_process_exists(state_dir: Path) -> None:
    rec = procs.ProcessRecord(target="t", backend="emulator", runtime="userspace", role="x",
                              ports=[1])
    rec.save()
    [back] = procs.records("t")
    assert (back.pid, back.phase, back.token) == (None, "starting", rec.token)
    assert json.loads(rec.path.read_text())["ports"] == [1]
    assert procs.sweep() == []  # a fresh record without a pid: an up about to start it
    child = subprocess.Popen(["sleep", "30"], env=rec.env())
    try:
        rec.started(child.pid)
        assert procs.is_recorded_process(rec) and procs.members(rec) == [child.pid]
        procs.stop(rec)
        assert child.poll() is not None and procs.records() == []
    finally:
        child.kill()
        child.wait()


# --- the spdk backend: kvtool configures an nvmf_tgt it did not start --------------------

def spdk_backend_config(path: Path, port: int, namespaces: int = 6) -> Path:
    nss = "".join(f"""
  [[subsystem.namespace]]
  nsid = {i}
  size = "4MiB"
  lba = 512
  bdev_name = "Procs{i}"
""" for i in range(1, namespaces + 1))
    path.write_text(f"""
backend = "spdk"
name = "procs-spdk"
[[transport]]
type = "tcp"
[[subsystem]]
nqn = "{NQN}"
hosts = ["@local"]
{nss}
[[listener]]
address = "127.0.0.1"
port = {port}
""")
    return path


def spdk_left(app: object) -> tuple[list[str], list[str]]:
    """Subsystems (other than discovery) and bdevs still in the nvmf_tgt."""
    subs = [s["nqn"] for s in app.rpc("nvmf_get_subsystems")  # type: ignore[attr-defined]
            if s["subtype"] != "Discovery"]
    return subs, [b["name"] for b in app.rpc("bdev_get_bdevs")]  # type: ignore[attr-defined]


@pytest.mark.spdk
@pytest.mark.integration
@pytest.mark.slow
def test_spdk_backend_up_status_down_status(nvmf_tgt: object, state_dir: Path,
                                            tmp_path: Path) -> None:
    port = free_port()
    cfg = spdk_backend_config(tmp_path / "s.toml", port)
    sock = str(nvmf_tgt.socket)  # type: ignore[attr-defined]
    assert run_json("target", "up", str(cfg), "--spdk-socket", sock)["status"]["state"] == "up"
    status = run_json("target", "status")
    assert status["state"] == "up" and status["processes"] == [] and not port_free(port)
    run_json("target", "down", str(cfg))  # the socket comes from the record
    assert spdk_left(nvmf_tgt) == ([], [])
    assert_nothing_left(port, [], [])
    assert nvmf_tgt.running  # type: ignore[attr-defined]  # not ours to stop
    assert run_json("target", "status", str(cfg), "--spdk-socket", sock)["state"] == "down"


@pytest.mark.spdk
@pytest.mark.integration
@pytest.mark.slow
def test_spdk_backend_sigkill_during_up_then_down(nvmf_tgt: object, state_dir: Path,
                                                  tmp_path: Path) -> None:
    port = free_port()
    cfg = spdk_backend_config(tmp_path / "s.toml", port, namespaces=12)
    sock = str(nvmf_tgt.socket)  # type: ignore[attr-defined]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    kv = subprocess.Popen([sys.executable, "-m", "kvtool", "target", "up", str(cfg),
                           "--spdk-socket", sock], env=env, stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while kv.poll() is None and time.monotonic() < deadline and not spdk_left(nvmf_tgt)[1]:
        time.sleep(0.002)
    kv.kill()
    kv.wait()
    _subs, bdevs = spdk_left(nvmf_tgt)
    assert len(bdevs) > 0 and st.names() == [], "up was not interrupted half-way"
    run_json("target", "down", str(cfg), "--spdk-socket", sock)
    assert spdk_left(nvmf_tgt) == ([], [])
    assert_nothing_left(port, [], [])
