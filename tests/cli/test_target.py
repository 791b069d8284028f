"""``kvtool target``: the emulator end to end (userspace runtime), bad input, exports."""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtool.nvme import host as nvme_host
from kvtool.target import state
from kvtool.target.spdk import backend as spdk_backend
from tests.conftest import FIXTURES, free_port, run, run_json
from tests.helpers import spdk_schema

HOST = "nqn.2014-08.org.nvmexpress:uuid:11111111-1111-4111-8111-111111111111"
NQN = "nqn.2026-01.io.kvtool:clitest"


@pytest.fixture
def state_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    d = tmp_path / "state"
    monkeypatch.setenv("KVTOOL_STATE_DIR", str(d))
    monkeypatch.setenv("KVTOOL_HOSTNQN", HOST)
    yield d
    for name in state.names():  # never leave a target process behind
        run("target", "down", "--name", name)


def write_config(tmp_path: Path, port: int, *, extra_ns: str = "") -> Path:
    path = tmp_path / "emu.toml"
    path.write_text(f"""
backend = "emulator"
name = "clitest"
[emulator]
runtime = "userspace"
[[subsystem]]
nqn = "{NQN}"
hosts = ["@local"]
  [[subsystem.namespace]]
  nsid = 1
  size = "8MiB"
  lba = 512
  [[subsystem.namespace]]
  nsid = 2
  path = "{tmp_path}/ns2.img"
  create = true
  size = "4MiB"
  lba = 4096
{extra_ns}
[[listener]]
address = "127.0.0.1"
port = {port}
""")
    return path


@pytest.mark.integration
def test_emulator_up_status_io_down(tmp_path: Path, state_dir: Path) -> None:
    port = free_port()
    cfg = write_config(tmp_path, port)

    dry = run_json("target", "up", str(cfg), "--dry-run")
    assert dry["dry_run"] and [s["action"] for s in dry["plan"]["steps"]] == ["start"]
    assert state.names() == []

    up = run_json("target", "up", str(cfg))
    assert up["applied"] == 1 and up["status"]["state"] == "up"
    st = run_json("target", "status")
    assert st["runtime"] == "userspace" and st["state"] == "up"
    regs = {r["nsid"]: r for r in st["registrations"]}
    assert regs[1] == {"nqn": NQN, "nsid": 1, "trtype": "tcp", "adrfam": "ipv4",
                       "traddr": "127.0.0.1", "trsvcid": str(port), "size": 8 << 20,
                       "block_size": 512, "url": f"nvme+tcp://127.0.0.1:{port}/{NQN}/1"}
    assert (regs[2]["size"], regs[2]["block_size"]) == (4 << 20, 4096)

    # a host reads and writes the namespaces through the URL status gave
    url = run("target", "status", "--url").stdout.strip()
    assert url == regs[1]["url"]
    with nvme_host.connect("127.0.0.1", port, NQN, hostnqn=HOST) as ctrl:
        pattern = os.urandom(4096)
        ctrl.write(1, 8, pattern)
        assert ctrl.read(1, 8, 8) == pattern
        ctrl.write(2, 3, pattern)
        assert ctrl.read(2, 3, 1) == pattern
    assert (tmp_path / "ns2.img").read_bytes()[3 * 4096: 4 * 4096] == pattern

    again = run_json("target", "up", str(cfg))
    assert again["applied"] == 0 and again["plan"]["steps"] == []
    assert again["status"]["pid"] == st["pid"]

    disc = run_json("target", "discover", f"127.0.0.1:{port}")
    assert any(e["subnqn"] == NQN and e["trsvcid"] == str(port) for e in disc["entries"])

    human = run("target", "status")
    assert human.exit_code == 0 and f"nvme+tcp://127.0.0.1:{port}/{NQN}/1" in human.stdout

    down = run_json("target", "down", str(cfg))
    assert [s["action"] for s in down["plan"]["steps"]] == ["stop"]
    assert state.names() == []
    assert not state.pid_alive(st["pid"])
    with pytest.raises(OSError):
        nvme_host.connect("127.0.0.1", port, NQN, hostnqn=HOST, timeout=2, reconnect=0)
    # the file namespace keeps its data after down
    assert (tmp_path / "ns2.img").read_bytes()[3 * 4096: 4 * 4096] == pattern


@pytest.mark.integration
def test_changed_config_restarts_and_failed_start_restores_the_old_target(
        tmp_path: Path, state_dir: Path) -> None:
    port = free_port()
    cfg = write_config(tmp_path, port)
    first = run_json("target", "up", str(cfg))
    old_pid = first["status"]["pid"]
    # the new config moves to a port someone else holds: its start fails half-way
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        bad = write_config(tmp_path, busy.getsockname()[1])
        r = run("target", "up", str(bad))
    assert r.exit_code == 1
    assert "rolled back" in r.stderr and "the target is as it was" in r.stderr
    st = run_json("target", "status")
    assert st["state"] == "up"
    assert run_json("target", "status", str(bad))["digest_matches"] is False
    assert st["pid"] != old_pid  # restarted by the rollback, with the old config
    with nvme_host.connect("127.0.0.1", port, NQN, hostnqn=HOST) as ctrl:
        assert sorted(ctrl.active_namespaces()) == [1, 2]  # served again on the old port
    moved = run_json("target", "up", str(write_config(tmp_path, free_port())))
    assert [s["action"] for s in moved["plan"]["steps"]] == ["stop", "start"]


@pytest.mark.parametrize("edit,field", [
    (("lba = 512", "lba = 512\n  colour = 3"), "subsystem[0].namespace[0].colour"),
    (("nsid = 2", "nsid = 1"), "subsystem[0].namespace[1].nsid"),
    (('address = "127.0.0.1"', 'address = "192.0.2.1"'), "listener[0].address"),
    (('hosts = ["@local"]', 'hosts = ["not-an-nqn"]'), "subsystem[0].hosts[0]"),
])
def test_bad_config_exits_2_and_changes_nothing(tmp_path: Path, state_dir: Path,
                                                edit: tuple[str, str], field: str) -> None:
    port = free_port()
    cfg = write_config(tmp_path, port)
    cfg.write_text(cfg.read_text().replace(*edit))
    r = run("target", "up", str(cfg))
    assert r.exit_code == 2
    line = r.stderr.strip()
    assert "\n" not in line and "Traceback" not in r.stderr
    assert line.startswith(f"kvtool: error: {cfg}:") and f"field '{field}'" in line
    assert state.names() == [] and not (tmp_path / "ns2.img").exists()
    with socket.socket() as s:  # nothing listens
        assert s.connect_ex(("127.0.0.1", port)) != 0


def test_port_in_use_fails_cleanly(tmp_path: Path, state_dir: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        cfg = write_config(tmp_path, busy.getsockname()[1])
        r = run("target", "up", str(cfg))
    assert r.exit_code == 1 and "exited with status" in r.stderr
    assert state.names() == []


def test_status_and_down_without_a_target(state_dir: Path) -> None:
    for op in ("status", "down"):
        r = run("target", op)
        assert r.exit_code == 0 and "nothing is up" in r.stdout, (op, r.stderr)
        assert run_json("target", op)["state"] == "nothing up"
    r = run("target", "status", "--url")  # a script asking for a URL gets none: an error
    assert r.exit_code == 2 and "no target is up" in r.stderr
    r = run("target", "down", "--name", "ghost")
    assert r.exit_code == 2 and "no target named 'ghost'" in r.stderr


def test_export_formats() -> None:
    spdk = run_json("target", "export", str(FIXTURES / "targets" / "spdk-production.toml"),
                    "--format", "spdk")
    records = [r for sub in spdk["subsystems"] for r in sub["config"]]
    assert all(spdk_schema.validate(r["method"], r["params"]) is None for r in records)
    assert spdk == spdk_backend.spdk_config(
        __import__("kvtool.target.loader", fromlist=["x"]).load_config(
            FIXTURES / "targets" / "spdk-production.toml", allow_remote=True, check_paths=False))
    nvmetcli = json.loads(run("target", "export", str(FIXTURES / "targets" / "nvmet-dev.toml"),
                              "--format", "nvmetcli").stdout)
    assert nvmetcli["ports"][0]["addr"] == {"trtype": "tcp", "adrfam": "ipv4",
                                            "traddr": "127.0.0.1", "trsvcid": "4420",
                                            "treq": "not specified"}
    assert [n["device"]["path"] for n in nvmetcli["subsystems"][0]["namespaces"]] == [
        "/dev/ram0", "/var/tmp/kvtool-nvmet-ns2.img"]


def test_help_has_examples() -> None:
    for sub in ("up", "down", "status", "discover", "export"):
        r = run("target", sub, "--help")
        assert r.exit_code == 0 and "Example" in r.stdout


def test_a_target_is_not_silently_moved_to_another_runtime(tmp_path: Path, state_dir: Path) -> None:
    cfg = write_config(tmp_path, free_port())
    run_json("target", "up", str(cfg))
    r = run("target", "up", str(cfg), "--runtime", "qemu", "--dry-run")
    assert r.exit_code == 1 and "take it down first" in r.stderr
    assert state.load("clitest") is not None


def test_discover_where_nothing_listens_is_bad_input() -> None:
    port = free_port()  # bound and released: nothing listens there now
    r = run("target", "discover", f"127.0.0.1:{port}")
    assert r.exit_code == 2, r.stderr
    assert r.stderr.strip().splitlines() == [
        f"kvtool: error: field 'ADDRESS': no NVMe/TCP target at 127.0.0.1:{port}: "
        f"cannot connect to 127.0.0.1:{port}: Connection refused"]
    for option, value in (("--timeout", "-1"), ("--timeout", "0"), ("--timeout", "nan"),
                          ("--hostnqn", "not-an-nqn")):
        r = run("target", "discover", f"127.0.0.1:{port}", option, value)
        assert r.exit_code == 2, r.stderr
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and f"field '{option}'" in lines[0], r.stderr


def _scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=5) as r:
        text = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


@pytest.mark.integration
def test_metrics_port_from_the_config_and_the_option(tmp_path: Path, state_dir: Path) -> None:
    port = free_port()
    cfg = write_config(tmp_path, port)
    cfg.write_text(cfg.read_text().replace('runtime = "userspace"',
                                           'runtime = "userspace"\nmetrics_port = 0'))
    up = run_json("target", "up", str(cfg))
    url = up["status"]["metrics"]
    assert url.startswith("http://127.0.0.1:") and url.endswith("/metrics")
    assert run_json("target", "status")["metrics"] == url
    assert f"metrics: {url}" in run("target", "status").stdout

    writes = ("kvtool_nvmetcp_commands_total", (("opcode", "write"), ("queue", "io")))
    assert _scrape(url).get(writes, 0) == 0
    with nvme_host.connect("127.0.0.1", port, NQN, hostnqn=HOST) as ctrl:
        ctrl.write(1, 0, b"\1" * 4096)
        ctrl.write(1, 8, b"\2" * 4096)
    assert _scrape(url)[writes] == 2  # the reply follows the counting: no wait needed

    # --metrics-port overrides the config: a changed desired state, so the target restarts
    mport = free_port()
    again = run_json("target", "up", str(cfg), "--metrics-port", str(mport))
    assert again["applied"] == 2 and again["status"]["metrics"] == \
        f"http://127.0.0.1:{mport}/metrics"
    assert _scrape(again["status"]["metrics"]).get(writes, 0) == 0

    # other runtimes have no kvtool metrics: bad input, nothing changed
    bad = run("target", "up", str(cfg), "--runtime", "kernel", "--dry-run")
    assert bad.exit_code == 2 and "metrics_port" in bad.stderr and "emu.toml:" in bad.stderr
    bad = run("target", "up", "--runtime", "qemu", "--metrics-port", "0", "--port",
              str(free_port()), "--name", "other", "--dry-run")
    assert bad.exit_code == 2 and "--metrics-port" in bad.stderr
    assert state.names() == ["clitest"]


def _argv(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")


@pytest.mark.integration
def test_busy_poll_from_the_config_and_the_option(tmp_path: Path, state_dir: Path) -> None:
    """[emulator] busy_poll_us reaches the target process; --busy-poll overrides it (a
    changed desired state: the target restarts); other runtimes refuse it."""
    port = free_port()
    cfg = write_config(tmp_path, port)
    cfg.write_text(cfg.read_text().replace('runtime = "userspace"',
                                           'runtime = "userspace"\nbusy_poll_us = 0'))
    up = run_json("target", "up", str(cfg))
    argv = _argv(up["status"]["pid"])
    assert argv[argv.index("--busy-poll") + 1] == "0"
    with nvme_host.connect("127.0.0.1", port, NQN, hostnqn=HOST) as ctrl:
        ctrl.write(1, 0, b"\1" * 4096)
        assert ctrl.read(1, 0, 8) == b"\1" * 4096
    again = run_json("target", "up", str(cfg), "--busy-poll", "200")
    assert again["applied"] == 2
    argv = _argv(again["status"]["pid"])
    assert argv[argv.index("--busy-poll") + 1] == "200"
    assert run_json("target", "up", str(cfg), "--busy-poll", "200")["applied"] == 0
    bad = run("target", "up", str(cfg), "--runtime", "kernel", "--dry-run")
    assert bad.exit_code == 2 and "busy_poll_us" in bad.stderr and "emu.toml:" in bad.stderr
    bad = run("target", "up", "--runtime", "qemu", "--busy-poll", "0", "--port",
              str(free_port()), "--name", "other", "--dry-run")
    assert bad.exit_code == 2 and "--busy-poll" in bad.stderr
    assert state.names() == ["clitest"]


@pytest.mark.integration
def test_default_target_takes_busy_poll(tmp_path: Path, state_dir: Path) -> None:
    up = run_json("target", "up", "--port", str(free_port()), "--name", "bp",
                  "--busy-poll", "0")
    argv = _argv(up["status"]["pid"])
    assert argv[argv.index("--busy-poll") + 1] == "0"


def test_engine_is_the_deprecated_name_of_runtime(tmp_path: Path, state_dir: Path) -> None:
    """``--engine`` (flag) and ``[emulator] engine`` (key) still work, each with one line
    on stderr saying so; ``--engine`` with ``--runtime`` is bad usage."""
    import subprocess
    import sys

    cfg = write_config(tmp_path, free_port())
    r = run("--json", "target", "up", str(cfg), "--engine", "userspace", "--dry-run")
    assert r.exit_code == 0, r.stderr
    assert json.loads(r.stdout)["runtime"] == "userspace"
    assert r.stderr.strip().splitlines() == [
        "kvtool: --engine is deprecated: use --runtime (same values)"]
    r = run("target", "up", str(cfg), "--engine", "userspace", "--runtime", "kernel",
            "--dry-run")
    assert r.exit_code == 2 and "give --runtime only" in r.stderr
    r = run("cluster", "up", str(cfg), "--engine", "spdk", "--runtime", "spdk")
    assert r.exit_code == 2 and "give --runtime only" in r.stderr
    assert state.names() == []

    cfg.write_text(cfg.read_text().replace('runtime = "userspace"', 'engine = "userspace"'))
    env = {**os.environ, "PYTHONPATH": str(FIXTURES.parent)}
    out = subprocess.run([sys.executable, "-m", "kvtool", "--json", "target", "up", str(cfg),
                          "--dry-run"], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["runtime"] == "userspace"
    assert out.stderr.strip().splitlines() == [
        f"{cfg}:5: [emulator] engine is deprecated: call it runtime (same values)"]
