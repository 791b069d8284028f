"""The SPDK fixture itself: nvmf_tgt/spdk_tgt start without hugepages, answer JSON-RPC, stop."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from emulator.spdk import tools
from kvtool.errors import InputError
from kvtool.target.spdk.app import SpdkApp, SpdkAppError
from kvtool.target.spdk.install import SpdkInstall
from kvtool.target.spdk.rpc import SpdkError
from tests.conftest import free_port
from tests.helpers.spdk_fixtures import MakeApp


def test_nvmf_tgt_answers_and_stops(spdk: SpdkInstall) -> None:
    app = SpdkApp(spdk, die_with_parent=True).start()
    try:
        assert app.rpc("spdk_get_version")["version"].startswith("SPDK v26.05")
        with pytest.raises(SpdkError, match="nvmf_get_no_such_method"):
            app.rpc("nvmf_get_no_such_method")
    finally:
        status = app.stop()
    assert status == 0 and not app.running
    assert not app.workdir.exists()  # its private directory (RPC socket, log) is gone
    assert "Reactor started on core 0" in app.log_text()


def test_spdk_tgt_loads_a_json_config(spdk_app: MakeApp, tmp_path: Path) -> None:
    config = tmp_path / "c.json"
    config.write_text(json.dumps({"subsystems": [{"subsystem": "bdev", "config": [
        {"method": "bdev_malloc_create",
         "params": {"name": "M0", "num_blocks": 2048, "block_size": 4096}}]}]}))
    app = spdk_app("spdk_tgt", config=config)
    bdevs = app.rpc("bdev_get_bdevs", {"name": "M0"})
    assert (bdevs[0]["block_size"], bdevs[0]["num_blocks"]) == (4096, 2048)


def test_nvmf_tgt_fixture_listens_on_loopback(nvmf_tgt: SpdkApp) -> None:
    port = free_port()
    nqn = "nqn.2016-06.io.spdk:fixture"
    nvmf_tgt.rpc("nvmf_create_subsystem", {"nqn": nqn, "allow_any_host": True})
    nvmf_tgt.rpc("nvmf_subsystem_add_listener", {"nqn": nqn, "listen_address": {
        "trtype": "TCP", "adrfam": "IPv4", "traddr": "127.0.0.1", "trsvcid": str(port)}})
    subs = {s["nqn"]: s for s in nvmf_tgt.rpc("nvmf_get_subsystems")}
    assert subs[nqn]["listen_addresses"][0]["trsvcid"] == str(port)


def test_a_bad_config_is_reported_with_the_log(spdk: SpdkInstall, tmp_path: Path) -> None:
    config = tmp_path / "bad.json"
    config.write_text('{"subsystems": [{"subsystem": "bdev", "config": '
                      '[{"method": "bdev_nope", "params": {}}]}]}')
    with pytest.raises(SpdkAppError, match="nvmf_tgt"):
        SpdkApp(spdk, config=config, die_with_parent=True).start(timeout=30)


def test_spdk_hosts_against_spdk_target(spdk: SpdkInstall, nvmf_tgt: SpdkApp) -> None:
    """The SPDK × SPDK cell of the interop matrix: identify and perf, no error."""
    port, nqn = free_port(), "nqn.2016-06.io.spdk:self"
    nvmf_tgt.rpc("bdev_malloc_create", {"name": "M0", "num_blocks": 32768, "block_size": 512})
    nvmf_tgt.rpc("nvmf_create_subsystem", {"nqn": nqn, "allow_any_host": True})
    nvmf_tgt.rpc("nvmf_subsystem_add_ns", {"nqn": nqn, "namespace": {"bdev_name": "M0"}})
    nvmf_tgt.rpc("nvmf_subsystem_add_listener", {"nqn": nqn, "listen_address": {
        "trtype": "TCP", "adrfam": "IPv4", "traddr": "127.0.0.1", "trsvcid": str(port)}})
    trid = tools.trid("127.0.0.1", port, nqn)
    run = tools.identify(spdk, trid)
    assert run.ok and "Model Number:                          SPDK bdev Controller" in run.output
    result = tools.perf(spdk, trid, workload="randrw", qd=32, io_size=4096, seconds=1)
    assert result.run.ok and result.iops > 0, result.run.errors
    deadline = time.monotonic() + 10  # SPDK drops a controller asynchronously
    while nvmf_tgt.rpc("nvmf_subsystem_get_controllers", {"nqn": nqn}):
        assert time.monotonic() < deadline, "perf left its controller behind"
        time.sleep(0.1)


def test_a_start_that_fails_after_exec_leaves_nothing_running(
        spdk: SpdkInstall, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without SPDK's RPC client the readiness call fails after nvmf_tgt was started: the
    process is stopped and its directory removed before the error goes up."""
    for name in [m for m in sys.modules if m == "spdk" or m.startswith("spdk.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "spdk", None)
    app = SpdkApp(spdk, die_with_parent=True)
    with pytest.raises(InputError, match="install kvtool\\[spdk\\]"):
        app.start()
    assert app.proc is not None and app.proc.returncode is not None
    assert not app.workdir.exists()


FAKE_APP = '''\
import json, socket, sys, time
path = sys.argv[sys.argv.index("-r") + 1]
s = socket.socket(socket.AF_UNIX)
s.bind(path)          # the socket file exists from here ...
time.sleep(0.8)       # ... but nothing listens yet (a slow start)
s.listen(4)
conn, _ = s.accept()
while True:  # one request a read: the client waits for each answer
    data = conn.recv(65536)
    if not data:
        sys.exit(0)
    req = json.loads(data)
    conn.sendall(json.dumps({"jsonrpc": "2.0", "id": req["id"], "result": True}).encode())
    if req["method"] == "spdk_kill_instance":
        sys.exit(0)
'''


def test_a_socket_bound_before_it_listens_is_waited_for(tmp_path: Path) -> None:
    """An application binds its RPC socket a moment before it listens; on a slow machine
    (a TCG guest, a busy CI box) the start's readiness call can connect in between and be
    refused. That is not a failed start: the call is made again until the application
    answers (here a stand-in that binds, waits 0.8 s, then answers framework_wait_init)."""
    pytest.importorskip("spdk.rpc.client")
    fake = SpdkInstall(tmp_path / "spdk")
    exe = fake.bin("nvmf_tgt")
    exe.parent.mkdir(parents=True)
    exe.write_text(f"#!{sys.executable}\n{FAKE_APP}")
    exe.chmod(0o755)
    app = SpdkApp(fake, die_with_parent=True, workdir=tmp_path / "run")
    try:
        t0 = time.monotonic()
        app.start(timeout=20)
        assert app.running and time.monotonic() - t0 >= 0.7
    finally:
        app.stop()
    assert not app.running
