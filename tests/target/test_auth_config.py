"""DH-HMAC-CHAP in target configs (issue 14): key files per [[host]], and no secret anywhere.

* The loader: key files named, never inline secrets; modes, formats, algorithm names and
  combinations checked with one line naming file, line and field.
* ``kvtool target up`` on the emulator (userspace runtime, then the qemu runtime: the real
  nvmet of the 6.12 guest configured by kvtool's nvmet backend) → ``load``/``verify``
  authenticated, a wrong key refused, ``status``, ``down``; then every output, log, state
  file and JSON document of the run is searched for the secrets: 0 hits.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtool.errors import InputError
from kvtool.target.loader import parse_config
from tests.conftest import free_port, run, run_json
from tests.helpers.secret_search import files_under, search

HOST = "nqn.2014-08.org.nvmexpress:uuid:44444444-4444-4444-8444-444444444444"
NQN = "nqn.2026-01.io.kvtool:authcfg"


def _config(keydir: Path, port: int, *, runtime: str = "userspace", extra: str = "",
            lba: int = 512) -> str:
    return f"""
backend = "emulator"
name = "authcfg"
[emulator]
runtime = "{runtime}"
[[host]]
nqn = "{HOST}"
dhchap_key_file = "{keydir / 'host.key'}"
dhchap_ctrl_key_file = "{keydir / 'ctrl.key'}"
dhchap_hashes = ["sha512", "sha256"]
dhchap_dhgroups = ["ffdhe2048"]
{extra}
[[subsystem]]
nqn = "{NQN}"
hosts = ["{HOST}"]
  [[subsystem.namespace]]
  nsid = 1
  size = "32MiB"
  lba = {lba}
[[listener]]
address = "127.0.0.1"
port = {port}
"""


@pytest.fixture
def keydir(tmp_path: Path) -> Path:
    d = tmp_path / "keys"
    d.mkdir()
    run_json("target", "keygen", str(d / "host.key"), "--transform", "sha256", "--nqn", HOST)
    run_json("target", "keygen", str(d / "ctrl.key"), "--length", "64")
    run_json("target", "keygen", str(d / "wrong.key"))
    return d


# --- the loader -------------------------------------------------------------------------------

def test_config_names_key_files_and_algorithms(keydir: Path) -> None:
    cfg = parse_config(_config(keydir, 4420), source=str(keydir / "t.toml"))
    h = cfg.host(HOST)
    assert h is not None and h.dhchap_key_file == str(keydir / "host.key")
    assert h.dhchap_hashes == ("sha512", "sha256") and h.dhchap_dhgroups == ("ffdhe2048",)
    assert "DHHC-1" not in str(cfg.to_dict())


def test_relative_key_paths_are_relative_to_the_config(keydir: Path) -> None:
    text = _config(keydir, 4420).replace(str(keydir / "host.key"), "keys/host.key")
    cfg = parse_config(text, source=str(keydir.parent / "t.toml"))
    assert cfg.host(HOST).dhchap_key_file == str((keydir / "host.key").resolve())  # type: ignore[union-attr]


@pytest.mark.parametrize("edit, field, message", [
    (lambda t, k: t.replace(f'dhchap_key_file = "{k / "host.key"}"',
                            f'dhchap_key = "{(k / "host.key").read_text().strip()}"'),
     "host[0].dhchap_key", "secrets are not written into configs"),
    (lambda t, k: t.replace('["sha512", "sha256"]', '["md5"]'),
     "host[0].dhchap_hashes[0]", "unknown DH-HMAC-CHAP hash"),
    (lambda t, k: t.replace('["ffdhe2048"]', '["ffdhe1024"]'),
     "host[0].dhchap_dhgroups[0]", "unknown DH group"),
    (lambda t, k: t.replace(f'dhchap_key_file = "{k / "host.key"}"', ""),
     "host[0].dhchap_ctrl_key_file", "needs dhchap_key_file"),
    (lambda t, k: t.replace(f'hosts = ["{HOST}"]', "allow_any_host = true"),
     "subsystem[0].allow_any_host", "authenticates nobody"),
    (lambda t, k: t.replace("host.key", "missing.key"),
     "host[0].dhchap_key_file", "cannot read key file"),
])
def test_bad_key_configs(keydir: Path, edit: object, field: str, message: str) -> None:
    text = edit(_config(keydir, 4420), keydir)  # type: ignore[operator]
    with pytest.raises(InputError) as err:
        parse_config(text, source="t.toml")
    assert err.value.field == field and message in err.value.message
    assert err.value.line is not None
    secret = (keydir / "host.key").read_text().split(":")[2]
    assert secret[:10] not in str(err.value)


def test_world_readable_key_file_is_refused_by_target_up(keydir: Path, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVTOOL_STATE_DIR", str(tmp_path / "state"))
    (keydir / "host.key").chmod(0o644)
    cfg = tmp_path / "t.toml"
    cfg.write_text(_config(keydir, free_port()))
    r = run("target", "up", str(cfg))
    assert r.exit_code == 2
    assert r.stderr.count("\n") == 1 and "chmod 600" in r.stderr and "t.toml:" in r.stderr


# --- end to end, and the secret grep --------------------------------------------------------

def _key_files(keydir: Path) -> dict[str, Path]:
    return {name: keydir / f"{name}.key" for name in ("host", "ctrl", "wrong")}


def _run_and_collect(keydir: Path, tmp_path: Path, url: str, outputs: dict[str, bytes]) -> None:
    auth = ["--hostnqn", HOST, "--dhchap-secret", str(keydir / "host.key"),
            "--dhchap-ctrl-secret", str(keydir / "ctrl.key")]
    steps = [
        ("load", ["--json", "load", url, "--block-bytes", "1002240", "--count", "3", *auth], 0),
        ("verify", ["--json", "verify", url, *auth], 0),
        ("verify-human", ["verify", url, *auth], 0),
        ("inspect", ["--json", "store", "inspect", url, *auth], 0),
        ("status", ["--json", "target", "status", "--name", "authcfg"], 0),
        ("wrong-key", ["load", url, "--block-bytes", "4096", "--count", "1", "--force",
                       "--hostnqn", HOST, "--dhchap-secret", str(keydir / "wrong.key")], 1),
        ("no-key", ["--json", "verify", url, "--hostnqn", HOST], 1),
        ("debug-wrong", ["--debug", "verify", url, "--hostnqn", HOST, "--dhchap-secret",
                         str(keydir / "wrong.key")], 1),
    ]
    for name, args, code in steps:
        r = run(*args)
        outputs[name] = (r.stdout + r.stderr).encode()
        assert r.exit_code == code, (name, r.stdout, r.stderr)


@pytest.mark.integration
def test_emulator_target_up_authenticated_and_no_secret_anywhere(
        keydir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    state_dir = tmp_path / "state"
    monkeypatch.setenv("KVTOOL_STATE_DIR", str(state_dir))
    port = free_port()
    cfg = tmp_path / "authcfg.toml"
    cfg.write_text(_config(keydir, port))
    outputs: dict[str, bytes] = {}
    up = run("--json", "target", "up", str(cfg))
    outputs["up"] = (up.stdout + up.stderr).encode()
    assert up.exit_code == 0, up.stderr
    try:
        _run_and_collect(keydir, tmp_path, f"nvme+tcp://127.0.0.1:{port}/{NQN}/1", outputs)
        status = run_json("target", "status", "--name", "authcfg")
        ns = status["subsystems"][0]["namespaces"][0]
        assert ns["enabled"] and ns["size"] == 32 << 20  # probed live, authenticated
    finally:
        down = run("--json", "target", "down", str(cfg))
        outputs["down"] = (down.stdout + down.stderr).encode()
    assert down.exit_code == 0
    files = files_under(state_dir)
    log = b"".join(v for k, v in files.items() if k.endswith(".log"))
    assert b"DH-HMAC-CHAP refused" in log  # the wrong key reached the target and was logged
    assert any(str(keydir / "host.key").encode() in v for v in files.values())
    hits = search({**outputs, **files}, _key_files(keydir), HOST)
    assert hits == []


@pytest.mark.qemu
@pytest.mark.integration
@pytest.mark.slow
def test_qemu_runtime_configures_nvmet_auth_and_no_secret_anywhere(
        guest_image_612: object, keydir: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """kvtool's nvmet backend, run inside the 6.12 guest, writes hosts/<NQN>/dhchap_* from
    the key files (read through the guest's view of the host root)."""
    state_dir = tmp_path / "state"
    monkeypatch.setenv("KVTOOL_STATE_DIR", str(state_dir))
    port = free_port()
    cfg = tmp_path / "authcfg.toml"
    cfg.write_text(_config(keydir, port, runtime="qemu", lba=4096))
    outputs: dict[str, bytes] = {}
    up = run("--json", "target", "up", str(cfg))
    outputs["up"] = (up.stdout + up.stderr).encode()
    assert up.exit_code == 0, up.stdout + up.stderr
    try:
        _run_and_collect(keydir, tmp_path, f"nvme+tcp://127.0.0.1:{port}/{NQN}/1", outputs)
    finally:
        down = run("--json", "target", "down", str(cfg))
        outputs["down"] = (down.stdout + down.stderr).encode()
    assert down.exit_code == 0, down.stdout + down.stderr
    files = files_under(state_dir)
    guest_log = b"".join(v for k, v in files.items() if k.endswith(".log"))
    assert b"hmac(sha512)" in guest_log and b"ffdhe2048" in guest_log  # the guest's plan
    hits = search({**outputs, **files}, _key_files(keydir), HOST)
    assert hits == []
