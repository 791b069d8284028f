"""The spdk target backend against a live nvmf_tgt (no hugepages) instead of a schema peer.

A config with the TCP transport's options, two subsystems, malloc and AIO bdevs of 512 B and
4 KiB LBAs, allowed hosts and a listener is brought up on a bare nvmf_tgt; then: ``up`` again
changes nothing; ``status`` reports what SPDK reports (also after a change behind kvtool's
back); kvtool's host sees the namespaces; ``down`` leaves nothing of the config; a real
failure half-way (the listener's port is taken) rolls back on the live target; and
``target export --format spdk`` started as a fresh ``nvmf_tgt --json`` reaches the same state.
"""

from __future__ import annotations

import json
import shutil
import socket
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvtool.nvme.host import connect
from kvtool.target import api
from kvtool.target.loader import load_config
from kvtool.target.plan import ApplyFailed
from kvtool.target.spdk.app import SpdkApp
from tests.conftest import STORE_DIR, _odirect_ok, free_port, run, run_json
from tests.helpers.spdk_fixtures import MakeApp

pytestmark = [pytest.mark.spdk, pytest.mark.integration, pytest.mark.slow]

HOST_A = "nqn.2014-08.org.nvmexpress:uuid:11111111-1111-4111-8111-111111111111"
HOST_B = "nqn.2014-08.org.nvmexpress:uuid:22222222-2222-4222-8222-222222222222"
NQN1 = "nqn.2016-06.io.spdk:kvlive1"
NQN2 = "nqn.2016-06.io.spdk:kvlive2"


def config_text(files: Path, port: int) -> str:
    return f"""
backend = "spdk"
name = "live"

[[transport]]
type = "tcp"
in_capsule_data_size = 8192
max_io_size = 131072
max_queue_depth = 64
max_io_qpairs_per_ctrlr = 4

[[subsystem]]
nqn = "{NQN1}"
serial = "KVLIVE0001"
model = "kvtool live test"
hosts = ["{HOST_A}", "{HOST_B}"]
  [[subsystem.namespace]]
  nsid = 1
  size = "32MiB"
  lba = 512
  [[subsystem.namespace]]
  nsid = 2
  backing = "file"
  path = "{files}/aio4k.img"
  create = true
  size = "16MiB"
  lba = 4096

[[subsystem]]
nqn = "{NQN2}"
allow_any_host = true
  [[subsystem.namespace]]
  nsid = 1
  size = "16MiB"
  lba = 4096
  [[subsystem.namespace]]
  nsid = 2
  backing = "file"
  path = "{files}/aio512.img"
  create = true
  size = "8MiB"
  lba = 512

[[listener]]
address = "127.0.0.1"
port = {port}
"""


@pytest.fixture
def files() -> Iterator[Path]:
    """AIO bdev files on a file system with O_DIRECT (SPDK's AIO bdev opens them so)."""
    STORE_DIR.mkdir(parents=True, exist_ok=True)
    reason = _odirect_ok(STORE_DIR)
    if reason:
        pytest.skip(reason)
    d = STORE_DIR / f"spdk-live-{uuid.uuid4().hex[:8]}"
    d.mkdir()
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def setup(spdk_app: MakeApp, files: Path, tmp_path: Path,
          monkeypatch: pytest.MonkeyPatch) -> tuple[SpdkApp, Path, int]:
    """A bare nvmf_tgt (no transport yet), the config and its listener's port."""
    nvmf_tgt = spdk_app("nvmf_tgt")
    monkeypatch.setenv("KVTOOL_STATE_DIR", str(tmp_path / "state"))
    port = free_port()
    path = tmp_path / "live.toml"
    path.write_text(config_text(files, port))
    return nvmf_tgt, path, port


def snapshot(app: SpdkApp) -> dict[str, Any]:
    """SPDK's own view of what a config owns, normalized for comparison."""
    subs = {}
    for s in app.rpc("nvmf_get_subsystems"):
        if s["subtype"] != "NVMe":
            continue
        subs[s["nqn"]] = {
            "serial": s.get("serial_number"), "model": s.get("model_number"),
            "allow_any_host": s["allow_any_host"],
            "hosts": sorted(h["nqn"] for h in s["hosts"]),
            "listen": sorted((a["trtype"], a["traddr"], a["trsvcid"])
                             for a in s["listen_addresses"]),
            "namespaces": sorted((n["nsid"], n["bdev_name"]) for n in s["namespaces"])}
    bdevs = {b["name"]: (b["product_name"], b["block_size"], b["num_blocks"])
             for b in app.rpc("bdev_get_bdevs")}
    tcp = [t for t in app.rpc("nvmf_get_transports") if t["trtype"] == "TCP"]
    transport = {k: tcp[0][k] for k in ("in_capsule_data_size", "max_io_size",
                                        "max_queue_depth", "max_io_qpairs_per_ctrlr")} if tcp else {}
    return {"subsystems": subs, "bdevs": bdevs, "transport": transport}


def up(path: Path, app: SpdkApp) -> dict[str, Any]:
    out: dict[str, Any] = run_json("target", "up", str(path), "--spdk-socket", str(app.socket))
    return out


def test_up_status_idempotent_down(setup: tuple[SpdkApp, Path, int]) -> None:
    app, path, port = setup
    first = up(path, app)
    assert first["changed"] is True
    live = snapshot(app)
    assert live["transport"] == {"in_capsule_data_size": 8192, "max_io_size": 131072,
                                 "max_queue_depth": 64, "max_io_qpairs_per_ctrlr": 4}
    s1, s2 = live["subsystems"][NQN1], live["subsystems"][NQN2]
    assert (s1["serial"], s1["model"], s1["allow_any_host"]) == (
        "KVLIVE0001", "kvtool live test", False)
    assert s1["hosts"] == sorted([HOST_A, HOST_B]) and s2["allow_any_host"] is True
    assert s1["listen"] == s2["listen"] == [("TCP", "127.0.0.1", str(port))]
    kinds = sorted((live["bdevs"][b][0], live["bdevs"][b][1], live["bdevs"][b][2])
                   for sub in (s1, s2) for _, b in sub["namespaces"])
    assert kinds == sorted([("Malloc disk", 512, 65536), ("AIO disk", 4096, 4096),
                            ("Malloc disk", 4096, 4096), ("AIO disk", 512, 16384)])

    again = up(path, app)
    assert (again["changed"], again["applied"]) == (False, 0)
    assert snapshot(app) == live

    status = run_json("target", "status", str(path), "--spdk-socket", str(app.socket))
    assert status["state"] == "up" and status["spdk_version"].startswith("SPDK v26.05")
    got = {(r["nqn"], r["nsid"]): (r["size"], r["block_size"]) for r in status["registrations"]}
    assert got == {(NQN1, 1): (32 << 20, 512), (NQN1, 2): (16 << 20, 4096),
                   (NQN2, 1): (16 << 20, 4096), (NQN2, 2): (8 << 20, 512)}

    # kvtool's host sees what SPDK serves
    with connect("127.0.0.1", port, NQN1, hostnqn=HOST_B) as ctrl:
        assert ctrl.active_namespaces() == [1, 2]
        assert ctrl.identify_namespace(2).lba_size == 4096

    # status reads SPDK's view: a namespace removed behind kvtool's back shows
    app.rpc("nvmf_subsystem_remove_ns", {"nqn": NQN2, "nsid": 2})
    status = run_json("target", "status", str(path), "--spdk-socket", str(app.socket))
    assert sorted((r["nqn"], r["nsid"]) for r in status["registrations"]) == [
        (NQN1, 1), (NQN1, 2), (NQN2, 1)]
    repaired = up(path, app)  # and up puts it back
    assert repaired["applied"] == 1 and snapshot(app) == live

    down = run_json("target", "down", str(path), "--spdk-socket", str(app.socket))
    assert down["changed"] is True
    after = snapshot(app)
    assert after["subsystems"] == {} and after["bdevs"] == {}
    assert after["transport"] == live["transport"]  # SPDK cannot delete a transport


def test_failure_half_way_rolls_back_on_the_live_target(setup: tuple[SpdkApp, Path, int]) -> None:
    """The listener's port is already taken: nvmf_subsystem_add_listener fails for real."""
    app, path, port = setup
    before = snapshot(app)
    with socket.socket() as squatter:
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 0)
        squatter.bind(("127.0.0.1", port))
        squatter.listen(1)
        cfg = load_config(path)
        with pytest.raises(ApplyFailed) as info:
            api.up(cfg, api.Options(spdk_socket=str(app.socket)))
        assert "nvmf_subsystem_add_listener" in str(info.value)
        result = run("target", "up", str(path), "--spdk-socket", str(app.socket))
        assert result.exit_code == 1 and "rolled back" in result.stderr, result.stderr
    after = snapshot(app)
    assert after["subsystems"] == {} and after["bdevs"] == {}
    assert after["transport"] != before["transport"]  # created, and kept: no RPC deletes it
    # with the port free again the same config comes up
    assert up(path, app)["changed"] is True
    assert set(snapshot(app)["subsystems"]) == {NQN1, NQN2}


def test_export_starts_a_fresh_nvmf_tgt_in_the_same_state(
        setup: tuple[SpdkApp, Path, int], spdk_app: MakeApp, tmp_path: Path) -> None:
    app, path, _ = setup
    up(path, app)
    live = snapshot(app)
    exported = run("target", "export", str(path), "--format", "spdk")
    assert exported.exit_code == 0, exported.stderr
    doc = json.loads(exported.stdout)
    app.stop()  # frees the listener's port and the AIO files
    config = tmp_path / "exported.json"
    config.write_text(json.dumps(doc))
    fresh = spdk_app("nvmf_tgt", config=config)
    assert snapshot(fresh) == live
    # and kvtool's view of the fresh target is "up", with nothing to change
    status = run_json("target", "status", str(path), "--spdk-socket", str(fresh.socket))
    assert status["state"] == "up"
    plan = run_json("target", "up", str(path), "--spdk-socket", str(fresh.socket), "--dry-run")
    assert plan["plan"]["steps"] == []
