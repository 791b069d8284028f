"""DH-HMAC-CHAP with SPDK (v26.05 from ../shared/vendor) on either side (issue 14).

* kvtool's host → SPDK's nvmf_tgt, configured by ``kvtool target up`` (backend spdk):
  keyring_file_add_key + nvmf_subsystem_add_host with the keys; ``load``/``verify``
  authenticated (SPDK picks the strongest pair both allow: SHA-512 + FFDHE-8192), a wrong
  host key, no key and a wrong controller key refused, ``target down`` removes the keys.
* SPDK's host (spdk_dd through bdev_nvme_attach_controller with dhchap_key) → kvtool's
  target: SHA-256 + NULL, SHA-256 + FFDHE-2048, SHA-512 + FFDHE-4096, uni- and
  bidirectional, bytes checked in the target's backing file; wrong and missing keys refused.
* SPDK's host → SPDK's target, right and wrong key.
The cells with the Linux kernel on one side are in tests/emulator/test_auth_kernel.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from emulator.nvmetcp import Target
from emulator.nvmetcp.config import HostKeyConfig, simple_config
from emulator.spdk import tools
from kvtool.target.spdk.app import SpdkApp
from kvtool.target.spdk.install import SpdkInstall
from tests.conftest import free_port, run, run_json
from tests.helpers.secret_search import files_under, search

HOST = "nqn.2014-08.org.nvmexpress:uuid:55555555-5555-4555-8555-555555555555"
NQN = "nqn.2026-01.io.kvtool:spdkauth"


@pytest.fixture
def keys(tmp_path: Path) -> dict[str, Path]:
    d = tmp_path / "keys"
    d.mkdir()
    out = {}
    for name, extra in (("host", ["--transform", "sha256", "--nqn", HOST]),
                        ("ctrl", ["--length", "48"]), ("wrong", []), ("wrongctrl", [])):
        run_json("target", "keygen", str(d / f"{name}.key"), *extra)
        out[name] = d / f"{name}.key"
    return out


def _spdk_config(keys: dict[str, Path], socket: Path, port: int) -> str:
    return f"""
backend = "spdk"
name = "spdkauth"
[spdk]
socket = "{socket}"
[[host]]
nqn = "{HOST}"
dhchap_key_file = "{keys['host']}"
dhchap_ctrl_key_file = "{keys['ctrl']}"
[[subsystem]]
nqn = "{NQN}"
hosts = ["{HOST}"]
  [[subsystem.namespace]]
  nsid = 1
  size = "16MiB"
[[listener]]
address = "127.0.0.1"
port = {port}
"""


def test_kvtool_host_to_spdk_target(nvmf_tgt: SpdkApp, keys: dict[str, Path], tmp_path: Path,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    state_dir = tmp_path / "state"
    monkeypatch.setenv("KVTOOL_STATE_DIR", str(state_dir))
    port = free_port()
    cfg = tmp_path / "spdkauth.toml"
    cfg.write_text(_spdk_config(keys, nvmf_tgt.socket, port))
    outputs: dict[str, bytes] = {}

    def cli(name: str, *args: str, code: int = 0) -> str:
        r = run(*args)
        outputs[name] = (r.stdout + r.stderr).encode()
        assert r.exit_code == code, (name, r.stdout, r.stderr)
        return r.stdout + r.stderr

    up = json.loads(cli("up", "--json", "target", "up", str(cfg)))
    kinds = [s["kind"] for s in up["plan"]["steps"]]
    assert kinds.count("key") == 2, up["plan"]
    hosts = nvmf_tgt.rpc("nvmf_get_subsystems")[-1]["hosts"]
    assert hosts[0]["dhchap_key"] and hosts[0]["dhchap_ctrlr_key"]
    url = f"nvme+tcp://127.0.0.1:{port}/{NQN}/1"
    auth = ["--hostnqn", HOST, "--dhchap-secret", str(keys["host"]),
            "--dhchap-ctrl-secret", str(keys["ctrl"])]
    loaded = cli("load", "--json", "load", url, "--block-bytes", "1002240", "--count", "2", *auth)
    assert json.loads(loaded)["written"] == 2
    checked = cli("verify", "--json", "verify", url, "--hostnqn", HOST, "--dhchap-secret",
                  str(keys["host"]))
    assert json.loads(checked)["ok"]
    cli("status", "--json", "target", "status", "--name", "spdkauth")
    cli("export", "target", "export", str(cfg))
    for args, side in ((["--dhchap-secret", str(keys["wrong"])], "refused host"),
                       ([], "requires authentication"),
                       (["--dhchap-secret", str(keys["host"]), "--dhchap-ctrl-secret",
                         str(keys["wrongctrl"])], "failed bidirectional")):
        assert side in cli(side, "verify", url, "--hostnqn", HOST, *args, code=1)
    log = nvmf_tgt.log_text()
    assert "challenge response mismatch" in log
    down = json.loads(cli("down", "--json", "target", "down", str(cfg)))
    assert down["applied"] >= 1
    assert nvmf_tgt.rpc("keyring_get_keys") == []
    found = search({**outputs, **files_under(state_dir), "nvmf_tgt log": log.encode()},
                   {k: keys[k] for k in ("host", "ctrl", "wrong", "wrongctrl")}, HOST)
    assert found == []


def _dd(spdk: SpdkInstall, tmp_path: Path, port: int, nqn: str, key: Path | None,
        ckey: Path | None) -> tools.ToolRun:
    conf = tmp_path / "dd.json"
    conf.write_text(json.dumps(tools.nvme_bdev_config(
        "Auth", "127.0.0.1", port, nqn, HOST, str(key) if key else None,
        str(ckey) if ckey else None)))
    src = tmp_path / "src.bin"
    src.write_bytes(bytes(range(256)) * 32)
    return tools.dd(spdk, conf, ["--if", str(src), "--ob", "Authn1", "--bs", "4096"],
                    timeout=90)


@pytest.mark.parametrize("hash_name, group, bidi", [("sha256", "null", True),
                                                    ("sha256", "ffdhe2048", False),
                                                    ("sha512", "ffdhe4096", True)])
def test_spdk_host_to_kvtool_target(spdk: SpdkInstall, keys: dict[str, Path], tmp_path: Path,
                                    hash_name: str, group: str, bidi: bool,
                                    caplog: pytest.LogCaptureFixture) -> None:
    backing = tmp_path / "ns1.img"
    cfg = simple_config(nqn=NQN, backing=str(backing), size="16MiB", hosts=[HOST],
                        listen=["127.0.0.1:0"], host_keys=[HostKeyConfig(
                            HOST, str(keys["host"]), str(keys["ctrl"]), [hash_name], [group])])
    t = Target(cfg).start_in_thread()
    try:
        port = t.addresses[0][1]
        ok = _dd(spdk, tmp_path, port, NQN, keys["host"], keys["ctrl"] if bidi else None)
        assert ok.ok, ok.output[-2000:]
        assert backing.read_bytes()[:8192] == bytes(range(256)) * 32
        backing.write_bytes(bytes(16 << 20))
        for key, ckey, why in ((keys["wrong"], None, "AUTHENTICATING"),
                               (None, None, "missing DH-HMAC-CHAP key"),
                               (keys["host"], keys["wrongctrl"], "controller challenge mismatch")):
            bad = _dd(spdk, tmp_path, port, NQN, key, ckey)
            assert not bad.ok and why in bad.output, bad.output[-1500:]
        assert backing.read_bytes()[:8192] == bytes(8192)  # nothing was written
    finally:
        t.stop()
    assert "host response mismatch (wrong host key)" in caplog.text


def test_spdk_host_to_spdk_target(spdk: SpdkInstall, nvmf_tgt: SpdkApp, keys: dict[str, Path],
                                  tmp_path: Path) -> None:
    port = free_port()
    rpc = nvmf_tgt.rpc
    rpc("bdev_malloc_create", {"name": "AuthM", "num_blocks": 8192, "block_size": 512})
    rpc("nvmf_create_subsystem", {"nqn": NQN, "allow_any_host": False})
    rpc("nvmf_subsystem_add_ns", {"nqn": NQN, "namespace": {"bdev_name": "AuthM"}})
    rpc("keyring_file_add_key", {"name": "hk", "path": str(keys["host"])})
    rpc("keyring_file_add_key", {"name": "ck", "path": str(keys["ctrl"])})
    rpc("nvmf_subsystem_add_host", {"nqn": NQN, "host": HOST, "dhchap_key": "hk",
                                    "dhchap_ctrlr_key": "ck"})
    rpc("nvmf_subsystem_add_listener", {"nqn": NQN, "listen_address": {
        "trtype": "TCP", "adrfam": "IPv4", "traddr": "127.0.0.1", "trsvcid": str(port)}})
    for ckey in (keys["ctrl"], None):  # bidirectional, unidirectional
        ok = _dd(spdk, tmp_path, port, NQN, keys["host"], ckey)
        assert ok.ok, ok.output[-2000:]
    bad = _dd(spdk, tmp_path, port, NQN, keys["wrong"], None)
    assert not bad.ok
    assert "challenge response mismatch" in nvmf_tgt.log_text()
    bad = _dd(spdk, tmp_path, port, NQN, None, None)
    assert not bad.ok and "missing DH-HMAC-CHAP key" in bad.output
    bad = _dd(spdk, tmp_path, port, NQN, keys["host"], keys["wrongctrl"])
    assert not bad.ok and "controller challenge mismatch" in bad.output
