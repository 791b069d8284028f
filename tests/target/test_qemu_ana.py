"""ANA on the real Linux nvmet (issue 21, part 2): the emulator's qemu runtime runs kvtool's
nvmet backend inside a QEMU guest against the guest kernel's configfs. The config's ANA
groups and listener states are applied there (``ana_grpid``,
``ports/N/ana_groups/G/ana_state``), ``kvtool target ana`` changes them at run time (it runs
``kvtool target ana`` in the guest), ``status`` reads them from the guest's configfs; and
kvtool's host against Linux nvmet (interop): ``kvtool load`` through both forwarded
listeners while the states flip (written to the guest's configfs directly: the guest's
kvtool takes seconds to start under TCG) and one port is unlinked from the subsystem for a
second, then ``kvtool verify`` clean.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvtool.target import procs
from kvtool.target import state as st
from kvtool.target.guest import guest_exec
from tests.conftest import free_port, run, run_json
from tests.helpers.multipath_faults import load_through_faults

pytestmark = [pytest.mark.qemu, pytest.mark.integration, pytest.mark.slow]

HOST = "nqn.2014-08.org.nvmexpress:uuid:21212121-2121-4121-8121-2121212121d1"
NQN = "nqn.2026-01.io.kvtool:qemu-ana"


@pytest.fixture
def target(guest_image: object, tmp_path: Path,
           monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Path, int, int]]:
    monkeypatch.setenv("KVTOOL_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("KVTOOL_HOSTNQN", HOST)
    p1, p2 = free_port(), free_port()
    cfg = tmp_path / "qemu-ana.toml"
    cfg.write_text(f"""
backend = "emulator"
name = "qemu-ana"
[emulator]
runtime = "qemu"
[[subsystem]]
nqn = "{NQN}"
hosts = ["@local"]
  [[subsystem.namespace]]
  nsid = 1
  size = "96MiB"
  ana_group = 2
[[listener]]
id = 1
address = "127.0.0.1"
port = {p1}
ana = {{ 2 = "optimized" }}
[[listener]]
id = 2
address = "127.0.0.1"
port = {p2}
ana = {{ 2 = "non-optimized" }}
""")
    yield cfg, p1, p2
    for name in st.names():
        run("target", "down", "--name", name)
    for rec in procs.records():
        procs.stop(rec, timeout=30)


def ana_of(status: dict[str, Any], port: int) -> dict[str, str]:
    [sub] = status["subsystems"]
    return dict(next(x["ana"] for x in sub["listeners"] if x["port"] == port))


def test_nvmet_in_the_guest_applies_ana_and_kvtool_host_fails_over(
        target: tuple[Path, int, int], tmp_path: Path) -> None:
    cfg, p1, p2 = target
    up = run_json("target", "up", str(cfg))
    assert up["status"]["state"] == "up"
    status = run_json("target", "status")
    assert (ana_of(status, p1), ana_of(status, p2)) == ({"2": "optimized"},
                                                        {"2": "non-optimized"})
    record = st.load("qemu-ana")
    assert record is not None
    control = int(record.extra["control_port"])
    rc, out = guest_exec(control, "cat /sys/kernel/config/nvmet/subsystems/"
                         f"{NQN}/namespaces/1/ana_grpid "
                         "/sys/kernel/config/nvmet/ports/2/ana_groups/2/ana_state")
    assert rc == 0 and out.split() == ["2", "non-optimized"], out
    flip = run_json("target", "ana", str(cfg), "--listener", f"127.0.0.1:{p1}", "--group", "2",
                    "--state", "inaccessible")
    assert flip["previous"] == "optimized"
    assert ana_of(run_json("target", "status"), p1) == {"2": "inaccessible"}
    run_json("target", "ana", str(cfg), "--listener", f"127.0.0.1:{p1}", "--group", "2",
             "--state", "optimized")

    port_of = {f"127.0.0.1:{p1}": 1, f"127.0.0.1:{p2}": 2}

    def kill(addr: str) -> None:  # the port leaves the subsystem: nvmet drops its controllers
        rc, out = guest_exec(control, f"rm /sys/kernel/config/nvmet/ports/{port_of[addr]}"
                             f"/subsystems/{NQN}")
        assert rc == 0, out

    def revive(addr: str) -> None:
        rc, out = guest_exec(control, f"ln -s /sys/kernel/config/nvmet/subsystems/{NQN} "
                             f"/sys/kernel/config/nvmet/ports/{port_of[addr]}/subsystems/{NQN}")
        assert rc == 0, out

    def set_state(addr: str, state: str) -> None:  # what kvtool's nvmet backend writes
        rc, out = guest_exec(control, f"echo {state} > /sys/kernel/config/nvmet/ports/"
                             f"{port_of[addr]}/ana_groups/2/ana_state")
        assert rc == 0, out

    try:
        summary = load_through_faults("qemu-ana", p1, p2, NQN, tmp_path / "load.json", kill=kill,
                                  revive=revive, count=20000, object_bytes="4KiB", group=2,
                                  qd=1, rounds=4, set_state=set_state,
                                      warmup=4.0)
    finally:
        print(guest_exec(control, "dmesg | tail -30")[1])
    assert summary["verified"] == 20000
