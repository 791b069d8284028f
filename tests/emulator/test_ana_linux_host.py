"""Interop (issue 21, part 2): Linux's NVMe/TCP host with native multipath (QEMU guest)
against kvtool's target with two listeners and ANA.

The guest connects to both listeners of one subsystem; the kernel makes one multipath
namespace with two paths and reads their ANA states from kvtool's ANA log page
(``nvme list-subsys`` and ``/sys/block/nvmeXcYnZ/ana_state`` show them). fio writes and
verifies (crc32c) the namespace while ``kvtool target ana`` flips the states twice: fio
sees no error, and the kernel follows each flip (the ANA Change notice): sysfs shows the
new state of each path within 20 s.
"""

from __future__ import annotations

import json
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from emulator.qemu.build import GuestImage
from emulator.qemu.guest import GUESTFWD_ADDR, Guest
from kvtool.target import procs
from kvtool.target import state as st
from tests.conftest import free_port, run, run_json
from tests.helpers.guest_nvme import dmesg_tail
from tests.helpers.qemu_guest import GUEST_HOSTNQN

pytestmark = [pytest.mark.qemu, pytest.mark.integration, pytest.mark.slow]

NQN = "nqn.2026-01.io.kvtool:ana-linux"
HOST = "nqn.2014-08.org.nvmexpress:uuid:21212121-2121-4121-8121-2121212121c9"


@pytest.fixture
def target(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Path, int, int]]:
    monkeypatch.setenv("KVTOOL_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("KVTOOL_HOSTNQN", HOST)
    p1, p2 = free_port(), free_port()
    cfg = tmp_path / "ana.toml"
    cfg.write_text(f"""
backend = "emulator"
name = "ana-linux"
[emulator]
runtime = "userspace"
[[subsystem]]
nqn = "{NQN}"
hosts = ["{GUEST_HOSTNQN}", "@local"]
  [[subsystem.namespace]]
  nsid = 1
  size = "64MiB"
  lba = 512
[[listener]]
address = "127.0.0.1"
port = {p1}
ana = {{ 1 = "optimized" }}
[[listener]]
address = "127.0.0.1"
port = {p2}
ana = {{ 1 = "non-optimized" }}
""")
    run_json("target", "up", str(cfg))
    yield cfg, p1, p2
    for name in st.names():
        run("target", "down", "--name", name)
    for rec in procs.records():
        procs.stop(rec, timeout=5)


def path_states(guest: Guest) -> dict[str, str]:
    """{controller's remote port: ANA state} from sysfs (one line per path)."""
    out = guest.check("for p in /sys/block/nvme*c*n1; do c=$(basename $p); "
                      "ctl=${c%n1}; ctl=nvme${ctl#nvme*c}; "
                      "echo $(cat /sys/class/nvme/$ctl/address) $(cat $p/ana_state); done",
                      timeout=30)
    states = {}
    for line in out.strip().splitlines():
        addr, _, state = line.rpartition(" ")
        port = next(kv.split("=")[1] for kv in addr.split(",") if kv.startswith("trsvcid="))
        states[port] = state
    return states


def test_linux_native_multipath_follows_kvtool_ana(guest_image: GuestImage,
                                                   target: tuple[Path, int, int]) -> None:
    if shutil.which("fio") is None:
        pytest.skip("fio is not installed here (make test installs it)")
    cfg, p1, p2 = target
    with Guest(guest_image, target=False, hostroot=True, guest_forwards=[p1, p2],
               mem_mb=512, size_mb=16) as guest:
        assert guest.check("cat /sys/module/nvme_core/parameters/multipath").strip() == "Y"
        for port in (p1, p2):
            rc, out = guest.exec(f"nvme connect -t tcp -a {GUESTFWD_ADDR} -s {port} -n {NQN}",
                                 timeout=60)
            assert rc == 0, out + dmesg_tail(guest)
        guest.check("for i in $(seq 200); do [ -b /dev/nvme0n1 ] && "
                    "[ $(ls -d /sys/block/nvme*c*n1 | wc -l) = 2 ] && exit 0; usleep 50000; "
                    "done; exit 1", timeout=30)
        listing = guest.check("nvme list-subsys /dev/nvme0n1", timeout=30)
        assert "optimized" in listing and "non-optimized" in listing, listing
        assert path_states(guest) == {str(p1): "optimized", str(p2): "non-optimized"}

        fio: dict[str, object] = {}

        def run_fio() -> None:
            rc, out = guest.exec(
                "chroot /hostroot fio --name=ana --filename=/dev/nvme0n1 --direct=1 "
                "--ioengine=libaio --rw=randwrite --bs=16k --iodepth=8 --size=48M "
                "--time_based --runtime=8 --verify=crc32c --do_verify=1 --verify_fatal=1 "
                "--verify_backlog=64 --randrepeat=0 --output-format=json", timeout=300)
            fio.update(rc=rc, out=out)

        t = threading.Thread(target=run_fio)
        t.start()
        flips = [(p2, "optimized", p1, "inaccessible"), (p1, "optimized", p2, "non-optimized")]
        seen = []
        for up_port, up_state, down_port, down_state in flips:
            time.sleep(2.0)
            for port, state in ((up_port, up_state), (down_port, down_state)):
                r = run("target", "ana", str(cfg), "--listener", f"127.0.0.1:{port}",
                        "--state", state)
                assert r.exit_code == 0, r.stderr
            deadline = time.monotonic() + 20
            want = {str(up_port): up_state, str(down_port): down_state}
            while path_states(guest) != want:
                assert time.monotonic() < deadline, (path_states(guest), want)
                time.sleep(0.2)
            seen.append(path_states(guest))
        t.join(300)
        assert fio.get("rc") == 0, str(fio.get("out"))[-3000:]
        out = str(fio["out"])
        job = json.loads(out[out.index("{"):])["jobs"][0]
        assert job["error"] == 0 and job["write"]["io_bytes"] > 0 and job["read"]["io_bytes"] > 0
        listing = guest.check("nvme list-subsys /dev/nvme0n1", timeout=30)
        guest.exec(f"nvme disconnect -n {NQN}", timeout=30)
    print(json.dumps({"states_after_each_flip": seen, "list_subsys": listing,
                      "fio_write_mib": job["write"]["io_bytes"] >> 20,
                      "fio_verified_mib": job["read"]["io_bytes"] >> 20}, indent=1))
