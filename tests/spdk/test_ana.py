"""ANA on SPDK (issue 21, part 2): the spdk runtime and the spdk backend apply a config's ANA
groups and listener states (``ana_reporting``, ``anagrpid``,
``nvmf_subsystem_listener_set_ana_state``), ``kvtool target ana`` changes them at run time,
``status`` reads them back from SPDK; and kvtool's host against SPDK's target with two
listeners: ``kvtool load`` while the states flip and one listener is removed, then
``kvtool verify`` clean.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvtool.target import procs
from kvtool.target import state as st
from kvtool.target.spdk.app import SpdkApp
from kvtool.target.spdk.install import SpdkInstall
from kvtool.target.spdk.rpc import SpdkRpc
from tests.conftest import FIXTURES, free_port, run, run_json
from tests.helpers.multipath_faults import load_through_faults

pytestmark = [pytest.mark.spdk, pytest.mark.integration, pytest.mark.slow]

HOST = "nqn.2014-08.org.nvmexpress:uuid:21212121-2121-4121-8121-2121212121b7"
NQN = "nqn.2026-01.io.kvtool:multipath"


@pytest.fixture
def env(spdk: SpdkInstall, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.setenv("KVTOOL_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("KVTOOL_SPDK_DIR", str(spdk.root))
    monkeypatch.setenv("KVTOOL_HOSTNQN", HOST)
    yield tmp_path
    for name in st.names():
        run("target", "down", "--name", name)
    for rec in procs.records():
        procs.stop(rec, timeout=5)


def multipath_config(path: Path, p1: int, p2: int, *, engine: str | None) -> Path:
    text = (FIXTURES / "targets" / "multipath.toml").read_text()
    text = text.replace("port = 4420", f"port = {p1}").replace("port = 4421", f"port = {p2}")
    if engine is None:  # the spdk backend on an nvmf_tgt kvtool did not start
        text = text.replace('backend = "emulator"', 'backend = "spdk"')
        text = text.replace('[emulator]\nruntime = "userspace"\n', "")
    else:
        text = text.replace('runtime = "userspace"', f'runtime = "{engine}"')
    path.write_text(text)
    return path


def ana_of(status: dict[str, Any], port: int) -> dict[str, str]:
    [sub] = status["subsystems"]
    return dict(next(x["ana"] for x in sub["listeners"] if x["port"] == port))


def test_spdk_runtime_ana_and_load_through_flips_and_a_removed_listener(env: Path) -> None:
    p1, p2 = free_port(), free_port()
    cfg = multipath_config(env / "mp.toml", p1, p2, engine="spdk")
    up = run_json("target", "up", str(cfg))
    steps = [(s["action"], s["kind"], s["target"]) for s in up["plan"]["steps"]]
    assert ("update", "listener", f"{NQN} tcp 127.0.0.1:{p2} ANA group 1") in steps
    status = run_json("target", "status")  # SPDK's own view (nvmf_subsystem_get_listeners)
    assert (ana_of(status, p1), ana_of(status, p2)) == ({"1": "optimized"},
                                                        {"1": "non-optimized"})
    sock = SpdkRpc(status["socket"], timeout=30)
    listen = {f"127.0.0.1:{p}": {"trtype": "TCP", "adrfam": "IPv4", "traddr": "127.0.0.1",
                                 "trsvcid": str(p)} for p in (p1, p2)}

    def kill(addr: str) -> None:  # the listener goes away: SPDK drops its connections
        sock.call("nvmf_subsystem_remove_listener", {"nqn": NQN, "listen_address": listen[addr]})

    def revive(addr: str) -> None:
        sock.call("nvmf_subsystem_add_listener", {"nqn": NQN, "listen_address": listen[addr]})

    # 60,000 objects of 4 KiB: against SPDK the load outlasts the faults by seconds (12,000
    # of 16 KiB could end right after the last flip, before any I/O showed the failover)
    summary = load_through_faults("multipath", p1, p2, NQN, env / "load.json", kill=kill,
                                  revive=revive, count=60000, object_bytes="4KiB")
    assert summary["verified"] == 60000
    sock.close()


def test_spdk_backend_applies_ana_and_exports_it(env: Path, spdk_app: Any) -> None:
    app: SpdkApp = spdk_app("nvmf_tgt")
    p1, p2 = free_port(), free_port()
    cfg = multipath_config(env / "mp.toml", p1, p2, engine=None)
    sock = str(app.socket)
    up = run_json("target", "up", str(cfg), "--spdk-socket", sock)
    created = next(c for c in app.rpc("nvmf_get_subsystems") if c["nqn"] == NQN)
    assert created["namespaces"][0]["anagrpid"] == 1  # only listed with ANA reporting
    assert up["status"]["state"] == "up"
    flip = run_json("target", "ana", "--name", "multipath", "--listener", f"127.0.0.1:{p1}",
                    "--state", "inaccessible")
    assert flip["previous"] == "optimized"
    have = {x["address"]["trsvcid"]: x["ana_states"][0]["ana_state"]
            for x in app.rpc("nvmf_subsystem_get_listeners", {"nqn": NQN})}
    assert have == {str(p1): "inaccessible", str(p2): "non_optimized"}
    # up again with the file: the file's states come back (the config is the desired state)
    again = run_json("target", "up", str(cfg), "--spdk-socket", sock)
    assert [s["detail"] for s in again["plan"]["steps"]] == ["inaccessible -> optimized"]
    # the exported SPDK JSON config starts an nvmf_tgt with the same ANA states
    exported = run("target", "export", str(cfg), "--format", "spdk")
    assert exported.exit_code == 0
    doc = json.loads(exported.stdout)
    path = env / "spdk.json"
    path.write_text(json.dumps(doc))
    run_json("target", "down", str(cfg), "--spdk-socket", sock)
    p3, p4 = free_port(), free_port()
    doc_text = path.read_text().replace(f'"{p1}"', f'"{p3}"').replace(f'"{p2}"', f'"{p4}"')
    path.write_text(doc_text)
    second: SpdkApp = spdk_app("nvmf_tgt", config=path)
    have = {x["address"]["trsvcid"]: x["ana_states"][0]["ana_state"]
            for x in second.rpc("nvmf_subsystem_get_listeners", {"nqn": NQN})}
    assert have == {str(p3): "optimized", str(p4): "non_optimized"}


def test_paths_from_spdks_discovery_log(env: Path) -> None:
    """``?paths=discover``: one address in the URL, the other from SPDK's discovery log
    (which lists every listener of the subsystem)."""
    p1, p2 = free_port(), free_port()
    cfg = multipath_config(env / "mp.toml", p1, p2, engine="spdk")
    run_json("target", "up", str(cfg))
    url = f"nvme+tcp://127.0.0.1:{p2}/{NQN}/1?paths=discover"
    loaded = run_json("load", url, "--block-bytes", "64KiB", "--count", "32")
    mp = loaded["engine"]["multipath"]
    assert {p["address"]: p["ana_state"] for p in mp["paths"]} == {
        f"127.0.0.1:{p2}": "non-optimized", f"127.0.0.1:{p1}": "optimized"}
    assert next(p for p in mp["paths"] if p["address"] == f"127.0.0.1:{p1}")["completed"] > 0
    assert run_json("verify", url)["ok"] is True
