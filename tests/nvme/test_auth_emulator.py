"""DH-HMAC-CHAP between kvtool's host and kvtool's target, over real sockets (issue 14).

The {kvtool host} × {kvtool target} cells of the matrix: right key, wrong key, no key,
unidirectional and bidirectional, SHA-256 + NULL, SHA-256 + FFDHE-2048, SHA-512 + FFDHE-4096;
``kvtool load``/``verify`` over the authenticated connection; refusals say which side failed
(exit 1) and leave the namespace untouched; a host that skips authentication gets the
spec's Authentication Required status for anything but Property Get/Set.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import pytest

from emulator.nvmetcp import Target
from emulator.nvmetcp.config import HostKeyConfig, simple_config
from kvtool.nvme import dhchap as D
from kvtool.nvme import host, spec
from kvtool.nvme import pdu as P
from kvtool.nvme.queue import HostQueue, NvmeStatusError
from kvtool.nvme.url import hostid_for
from tests.conftest import run, run_json

pytestmark = pytest.mark.integration

SUB = "nqn.2026-01.io.kvtool:auth"
HOSTNQN = "nqn.2014-08.org.nvmexpress:uuid:6b767461-7574-4800-8000-0000000000a1"
CELLS = [("sha256", "null"), ("sha256", "ffdhe2048"), ("sha512", "ffdhe4096")]


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Key files made by ``kvtool target keygen`` (plain and transformed)."""
    d = tmp_path_factory.mktemp("keys")
    out = {}
    for name, extra in (("host", ["--transform", "sha256", "--nqn", HOSTNQN]),
                        ("ctrl", ["--transform", "sha512", "--nqn", SUB]),
                        ("wrong", []), ("wrongctrl", ["--length", "64"])):
        doc = run_json("target", "keygen", str(d / f"{name}.key"), *extra)
        assert doc["mode"] == "0600" and (d / f"{name}.key").stat().st_mode & 0o777 == 0o600
        out[name] = d / f"{name}.key"
    return out


def _target(keys: dict[str, Path], backing: Path, hash_name: str, group: str,
            bidi: bool) -> Target:
    hk = HostKeyConfig(HOSTNQN, str(keys["host"]), str(keys["ctrl"]) if bidi else None,
                       [hash_name], [group])
    cfg = simple_config(nqn=SUB, backing=str(backing), size="32MiB", hosts=[HOSTNQN],
                        listen=["127.0.0.1:0"], host_keys=[hk])
    return Target(cfg).start_in_thread()


@pytest.fixture
def backing(tmp_path: Path) -> Path:
    return tmp_path / "ns1.img"


def _url(t: Target) -> str:
    return f"nvme+tcp://127.0.0.1:{t.addresses[0][1]}/{SUB}/1"


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("hash_name, group", CELLS)
@pytest.mark.parametrize("bidi", [False, True], ids=["uni", "bi"])
def test_kvtool_host_kvtool_target(keys: dict[str, Path], backing: Path, hash_name: str,
                                   group: str, bidi: bool) -> None:
    t = _target(keys, backing, hash_name, group, bidi)
    try:
        url = _url(t)
        auth = ["--hostnqn", HOSTNQN, "--dhchap-secret", str(keys["host"])]
        if bidi:
            auth += ["--dhchap-ctrl-secret", str(keys["ctrl"])]
        loaded = run_json("load", url, "--block-bytes", "1002240", "--count", "3", *auth)
        assert loaded["written"] == 3
        checked = run_json("verify", url, *auth)
        assert checked["ok"] and checked["objects_checked"] == 3
        # every queue the host opened authenticated on the target, with the configured algorithms
        with host.connect("127.0.0.1", t.addresses[0][1], SUB, hostnqn=HOSTNQN, io_queues=2,
                          dhchap_secret=D.load_secret_file(keys["host"], field="k")) as ctrl:
            assert ctrl.authenticated and len(ctrl.io) == 2
            conns = [c for c in t.state.connections if c.auth is not None] if t.state else []
            assert sorted(c.qid for c in conns) == [0, 1, 2]
            assert all(c.auth.authenticated for c in conns)
            assert {(c.auth.hash.name, D.DHGROUPS[c.auth.dhgroup]) for c in conns} == \
                {(hash_name, group)}
        before = _sha(backing)
        # refusals: which side failed, exit 1, one line, nothing written
        wrong = run("load", url, "--block-bytes", "4096", "--count", "1", "--force",
                    "--hostnqn", HOSTNQN, "--dhchap-secret", str(keys["wrong"]))
        assert wrong.exit_code == 1, wrong.output
        assert "refused host" in wrong.stderr and wrong.stderr.count("\n") == 1
        none = run("load", url, "--block-bytes", "4096", "--count", "1", "--force",
                   "--hostnqn", HOSTNQN)
        assert none.exit_code == 1
        assert "requires authentication" in none.stderr and none.stderr.count("\n") == 1
        if bidi:
            bad_ctrl = run("load", url, "--block-bytes", "4096", "--count", "1", "--force",
                           "--hostnqn", HOSTNQN, "--dhchap-secret", str(keys["host"]),
                           "--dhchap-ctrl-secret", str(keys["wrongctrl"]))
            assert bad_ctrl.exit_code == 1
            assert "controller" in bad_ctrl.stderr and "failed bidirectional" in bad_ctrl.stderr
        else:
            # the host asks the controller to prove a key the target does not have for it
            no_ctrl = run("verify", url, "--hostnqn", HOSTNQN, "--dhchap-secret",
                          str(keys["host"]), "--dhchap-ctrl-secret", str(keys["ctrl"]))
            assert no_ctrl.exit_code == 1
        assert _sha(backing) == before
    finally:
        t.stop()


def test_host_without_authentication_gets_authentication_required(
        keys: dict[str, Path], backing: Path) -> None:
    """A raw host that connects but skips DH-HMAC-CHAP: ATR in the Connect result, then
    status 0x4191 (SCT 1, SC 91h, DNR) for Identify; Property Get still answers."""
    t = _target(keys, backing, "sha256", "null", False)
    q = HostQueue("127.0.0.1", t.addresses[0][1], qid=0, depth=8)
    try:
        data = spec.ConnectData(hostid_for(HOSTNQN), 0xFFFF, SUB, HOSTNQN).encode()
        cqe = q.execute(P.Sqe(spec.OPC_FABRICS, nsid=spec.FCTYPE_CONNECT, cdw10=0, cdw11=31),
                        what="Connect", data_out=memoryview(data),
                        in_capsule_max=spec.ADMIN_IN_CAPSULE_MAX)
        assert cqe.dw0 & D.CONNECT_ATR
        q.execute(P.Sqe(spec.OPC_FABRICS, nsid=spec.FCTYPE_PROPERTY_GET, cdw10=1,
                        cdw11=spec.PROP_CAP), what="Property Get")
        with pytest.raises(NvmeStatusError) as err:
            q.execute(P.Sqe(spec.ADMIN_IDENTIFY, cdw10=spec.CNS_CONTROLLER),
                      what="Identify", data_in=memoryview(bytearray(4096)))
        assert (err.value.sct, err.value.sc, err.value.dnr) == (1, 0x91, True)
    finally:
        q.close()
        t.stop()


def test_other_hosts_unaffected_and_target_logs_no_secret(
        keys: dict[str, Path], backing: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    t = _target(keys, backing, "sha256", "ffdhe2048", True)
    try:
        with pytest.raises(host.AuthenticationError) as err:
            host.connect("127.0.0.1", t.addresses[0][1], SUB, hostnqn=HOSTNQN, reconnect=0,
                         dhchap_secret=D.load_secret_file(keys["wrong"], field="k"))
        assert err.value.side == "host"
    finally:
        t.stop()
    assert "host response mismatch" in caplog.text
    for name in ("host", "ctrl", "wrong"):
        b64 = keys[name].read_text().split(":")[2]
        assert b64[:16] not in caplog.text


def test_bad_key_files_are_input_errors(keys: dict[str, Path], tmp_path: Path) -> None:
    loose = tmp_path / "loose.key"
    loose.write_text(keys["host"].read_text())
    loose.chmod(0o644)
    r = run("verify", "nvme+tcp://127.0.0.1:9/nqn.2026-01.io.kvtool:x", "--dhchap-secret",
            str(loose))
    assert r.exit_code == 2 and "chmod 600" in r.stderr and r.stderr.count("\n") == 1
    r = run("verify", "/dev/null", "--dhchap-secret", str(keys["host"]))
    assert r.exit_code == 2 and "nvme+tcp://" in r.stderr
    r = run("verify", "nvme+tcp://127.0.0.1:9/nqn.2026-01.io.kvtool:x", "--dhchap-ctrl-secret",
            str(keys["ctrl"]))
    assert r.exit_code == 2 and "--dhchap-secret" in r.stderr


def test_replay_data_mode_on_an_authenticated_target(keys: dict[str, Path],
                                                     backing: Path) -> None:
    """``kvtool replay --nvme nvme+tcp://…`` takes the same options (data mode, real bytes)."""
    t = _target(keys, backing, "sha256", "ffdhe2048", True)
    try:
        url = _url(t)
        trace = Path(__file__).parents[2] / "fixtures" / "traces" / "multiturn-8x12.jsonl"
        args = ["replay", str(trace), "--block-bytes", "64KiB", "--nvme", url,
                "--hostnqn", HOSTNQN]
        doc = run_json(*args, "--dhchap-secret", str(keys["host"]),
                       "--dhchap-ctrl-secret", str(keys["ctrl"]))
        assert doc["mode"] == "data"
        refused = run(*args)
        assert refused.exit_code == 1 and "requires authentication" in refused.stderr
    finally:
        t.stop()
