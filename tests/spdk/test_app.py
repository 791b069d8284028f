"""The SPDK fixture itself: nvmf_tgt/spdk_tgt start without hugepages, answer JSON-RPC, stop."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from emulator.spdk import SpdkApp, SpdkAppError, SpdkInstall
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
