"""The nvmet backend against the REAL configfs of a Linux kernel in a QEMU guest.

``kvtool target up`` with the emulator's qemu runtime boots the guest and runs kvtool's own
``target up --backend nvmet`` inside it (host root over read-only 9p, chroot), so the
guest kernel's configfs is configured by the same code the pyfakefs tests exercise. Then
the host reads and writes the namespaces through the forwarded port with kvtool's
userspace NVMe/TCP host, and ``target down`` tears the configfs tree down in the guest.
The errno checks at the end confirm, on the real kernel, the rules that
tests/helpers/fake_nvmet.py simulates.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from kvtool.nvme import host as nvme_host
from kvtool.target import state
from kvtool.target.guest import GUEST_DIR, guest_exec, json_tail, kvtool_in_guest
from tests.conftest import free_port, run, run_json

pytestmark = [pytest.mark.qemu, pytest.mark.integration, pytest.mark.slow]

HOST = "nqn.2014-08.org.nvmexpress:uuid:33333333-3333-4333-8333-333333333333"
NQN = "nqn.2026-01.io.kvtool:qemutest"


def test_nvmet_backend_on_the_guest_kernel(guest_image: object, tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVTOOL_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("KVTOOL_HOSTNQN", HOST)
    port = free_port()
    cfg = tmp_path / "qemu.toml"
    cfg.write_text(f"""
backend = "emulator"
name = "qemutest"
[emulator]
runtime = "qemu"
[[subsystem]]
nqn = "{NQN}"
serial = "KVTQEMU0001"
hosts = ["@local"]
  [[subsystem.namespace]]
  nsid = 1
  size = "16MiB"
  [[subsystem.namespace]]
  nsid = 2
  size = "8MiB"
[[listener]]
id = 1
address = "127.0.0.1"
port = {port}
""")
    try:
        up = run_json("target", "up", str(cfg))
        assert up["applied"] == 1 and up["status"]["state"] == "up"
        record = state.load("qemutest")
        assert record is not None and record.runtime == "qemu"
        guest_plan = [f"{s['action']} {s['kind']}" for s in record.extra["guest_plan"]["steps"]]
        # the guest ran the nvmet plan in kernel order against its real configfs
        assert guest_plan.index("create subsystem") < guest_plan.index("create namespace") \
            < guest_plan.index("create port") < guest_plan.index("link port")
        control = int(record.extra["control_port"])

        # idempotent on the real tree: a second run inside the guest changes nothing
        rc, out = guest_exec(control, kvtool_in_guest(
            f"--json up {GUEST_DIR}/target.json --backend nvmet --allow-remote"), timeout=300)
        assert rc == 0, out
        assert json_tail(out)["applied"] == 0

        # the real kernel refuses what the simulated one refuses (docs/target.md)
        root = "/sys/kernel/config/nvmet"
        for shell, words in [
            (f"echo /tmp/x > {root}/subsystems/{NQN}/namespaces/1/device_path", "busy"),
            (f"echo 4999 > {root}/ports/1/addr_trsvcid", "denied"),
            (f"rmdir {root}/subsystems/{NQN}", "busy"),
            (f"rmdir {root}/ports/1", "not empty"),
        ]:
            rc, out = guest_exec(control, shell, timeout=30)
            assert rc != 0 and words in out.lower(), (shell, out)

        st = run_json("target", "status")
        regs = {r["nsid"]: r for r in st["registrations"]}
        assert {n: (r["traddr"], r["trsvcid"], r["size"], r["block_size"])
                for n, r in regs.items()} == {1: ("127.0.0.1", str(port), 16 << 20, 4096),
                                              2: ("127.0.0.1", str(port), 8 << 20, 4096)}

        # the host reads and writes the guest kernel's namespaces through the forward
        with nvme_host.connect("127.0.0.1", port, NQN, hostnqn=HOST) as ctrl:
            info = ctrl.identify_namespace(1)
            assert info.nsze * info.lba_size == 16 << 20 and info.lba_size == 4096
            data = os.urandom(3 * 4096)
            ctrl.write(1, 100, data)
            ctrl.write(2, 7, data[:4096])
            assert ctrl.read(1, 100, 3) == data
            assert ctrl.read(2, 7, 1) == data[:4096]
        disc = run_json("target", "discover", f"127.0.0.1:{port}")
        assert any(e["subnqn"] == NQN for e in disc["entries"])

        down = run_json("target", "down")
        assert down["applied"] == 1
        assert state.names() == []
        assert not state.pid_alive(record.pid)
        # the supervisor ran `target down` in the guest: its JSON is the log's last document
        log = Path(record.extra["log"]).read_text()
        start = log.rindex('{\n  "schema": "kvtool.target.down/1"')
        guest_down, _ = json.JSONDecoder().raw_decode(log[start:])
        assert guest_down["plan"]["operation"] == "down", log[-2000:]
        # unlink, port, 2 x (enable=0, namespace), allowed host, subsystem, host
        assert guest_down["applied"] >= 8
    finally:
        for name in state.names():
            run("target", "down", "--name", name)


def test_plan_json_is_what_the_guest_will_do(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Dry run needs no guest: the plan names the boot and the in-guest apply."""
    monkeypatch.setenv("KVTOOL_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("KVTOOL_HOSTNQN", HOST)
    cfg = Path(__file__).resolve().parents[2] / "fixtures" / "targets" / "qemu-nvmet.toml"
    doc = run_json("target", "up", str(cfg), "--dry-run")
    assert [s["action"] for s in doc["plan"]["steps"]] == ["start"]
    assert "kvtool target up --backend nvmet" in doc["plan"]["steps"][0]["detail"]
    assert state.names() == []
    assert json.dumps(doc)
