"""The production path in the QEMU guest: NVMe-oF over RDMA (soft-RoCE) to Linux nvmet and to
SPDK, SPDK driving PCIe NVMe controllers (QEMU's, through vfio-pci and an emulated IOMMU),
and the kernel's host attaching them, all driven by ``kvtool`` itself inside the guest.

One guest for the module (Linux 6.12: DH-HMAC-CHAP on both kernel sides): 2 vCPUs (SPDK's
reactor on one, its host tools on the other), 3 GiB, three 512 MiB NVMe controllers
(tests/helpers/rdma_guest.py). Each test makes its rxe device and leaves nothing behind:
no rxe device, no SPDK process, no fabrics controller, every controller on ``nvme``.
docs/rdma.md has the interoperability matrix these tests cover.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from emulator.qemu.build import GuestImage
from emulator.qemu.guest import Guest
from emulator.qemu.rdma import add_rxe, del_rxe
from emulator.spdk import tools
from kvtool.nvme.url import default_hostnqn
from kvtool.target.spdk.install import SpdkInstall, SpdkNotFound, find_spdk
from tests.conftest import FIXTURES
from tests.helpers.qemu_guest import start_guest
from tests.helpers.rdma_guest import (
    ADDR,
    DRIVE_MB,
    GUEST_OPTIONS,
    NVMET_BDF,
    SPDK_BDFS,
    RdmaGuest,
)

pytestmark = [pytest.mark.rdma, pytest.mark.qemu, pytest.mark.integration, pytest.mark.slow]

PRODUCTION = FIXTURES / "targets" / "spdk-production-guest.toml"
SPDK_URL1 = f"nvme+rdma://{ADDR}:4420/nqn.2016-06.io.spdk:kvcache1/1"
SPDK_URL2 = f"nvme+rdma://{ADDR}:4421/nqn.2016-06.io.spdk:kvcache2/1"
NVMET_NQN = "nqn.2026-01.io.kvtool:rdma"
LOAD = ("--model", "deepseek-v4-flash", "--dtype", "fp8")  # 1,002,240 B objects: bounce path


@pytest.fixture(scope="module")
def spdk_root() -> Path | None:
    """SPDK built with RDMA (emulator/spdk/build.sh); None (SPDK cases skip) without sources."""
    try:
        return find_spdk(build=True, log=print).root
    except SpdkNotFound as exc:
        from kvtool.target.spdk.install import BUILD_SCRIPT, VENDOR
        if VENDOR.is_dir() and BUILD_SCRIPT.is_file():
            pytest.fail(f"SPDK cannot be built: {exc}")
        return None


@pytest.fixture(scope="module")
def rg(guest_image_612: GuestImage, spdk_root: Path | None,
       tmp_path_factory: pytest.TempPathFactory) -> Iterator[RdmaGuest]:
    drives = tmp_path_factory.mktemp("nvme-drives")
    paths = []
    for i in range(3):
        path = drives / f"nvme{i}.img"
        with path.open("wb") as f:
            f.truncate(DRIVE_MB << 20)
        paths.append(str(path))
    guest = start_guest(Guest(guest_image_612, nvme=paths, **GUEST_OPTIONS))
    try:
        # a kernel host refused during DH-HMAC-CHAP otherwise waits admin_timeout (60 s) per
        # attempt (docs/qemu-guest.md)
        guest.check("echo 10 > /sys/module/nvme_core/parameters/admin_timeout")
        yield RdmaGuest(guest, spdk_root)
    finally:
        guest.stop()


@pytest.fixture
def rxe(rg: RdmaGuest) -> Iterator[RdmaGuest]:
    """An rxe device on eth0 for one test; afterwards nothing of the test may be left."""
    add_rxe(rg.guest)
    try:
        yield rg
    finally:
        rg.cleanup()
        del_rxe(rg.guest)
    left = rg.leftovers()
    assert not left, f"left behind: {left}"


def need_spdk(rg: RdmaGuest) -> SpdkInstall:
    if rg.spdk_root is None:
        pytest.skip("SPDK's sources are not in ../shared/vendor/spdk")
    return SpdkInstall(rg.spdk_root)


def nvmet_config(rg: RdmaGuest, tmp: Path, *, keys: tuple[Path, ...] = ()) -> Path:
    """A kernel nvmet target with an RDMA listener on the first QEMU NVMe drive."""
    device = rg.kernel_block(NVMET_BDF)
    hostnqn = default_hostnqn()
    if keys:
        hosts = (f'[[host]]\nnqn = "{hostnqn}"\ndhchap_key_file = "{keys[0]}"\n'
                 'dhchap_hashes = ["sha256"]\ndhchap_dhgroups = ["null"]\n\n')
        access = f'hosts = ["{hostnqn}"]'
    else:
        hosts, access = "", "allow_any_host = true"
    path = tmp / "nvmet-rdma.toml"
    path.write_text(f"""backend = "nvmet"
name = "nvmet-rdma"

{hosts}[[subsystem]]
nqn = "{NVMET_NQN}"
serial = "KVTOOLRDMA0001"
{access}

  [[subsystem.namespace]]
  nsid = 1
  backing = "block"
  path = "{device}"

[[listener]]
transport = "rdma"
address = "{ADDR}"
port = 4420

[[listener]]
transport = "tcp"
address = "{ADDR}"
port = 4420
""")
    return path


def perf_and_identify(rg: RdmaGuest, install: SpdkInstall, port: int, subnqn: str,
                      listed: bool) -> None:
    """spdk_nvme_perf randread and randrw, and spdk_nvme_identify (of the discovery
    controller: it admits SPDK's random host NQN), over RDMA: no error line. ``listed``:
    the discovery log shows that random host the subsystem (allow_any_host)."""
    trid = tools.trid(ADDR, port, subnqn, default_hostnqn(), trtype="RDMA")
    for workload in ("randread", "randrw"):
        r = tools.perf(install, trid, workload=workload, qd=16, seconds=2, runner=rg.runner)
        assert r.run.ok and r.iops > 0, f"{workload}: {r.run.errors or r.run.output[-2000:]}"
    disc = tools.trid(ADDR, port, "nqn.2014-08.org.nvmexpress.discovery", trtype="RDMA")
    ident = tools.identify(install, disc, runner=rg.runner)
    assert ident.ok and "NVMeoF Controller at RDMA" in ident.output, ident.output[-2000:]
    assert (subnqn in ident.output) == listed  # SPDK lists only what the host may use


def load_verify(rg: RdmaGuest, url: str, count: int = 64) -> dict[str, object]:
    load = rg.kv_json("load", url, *LOAD, "--count", str(count), "--force")
    # objects an earlier load acknowledged are kept (same keys): the rest is written
    assert load["written"] + load["already_present"] == count and load["written"] > 0
    assert load["engine"]["host"] == "kernel" and load["engine"]["transport"] == "rdma"
    verify = rg.kv_json("verify", url)
    assert verify["ok"] is True and verify["objects_checked"] == load["objects"] >= count, verify
    return load


def test_kernel_nvmet_over_rdma(rxe: RdmaGuest, tmp_path: Path) -> None:
    """up -> connect -> load 64 -> verify -> fio verify -> SPDK's hosts -> discover -> down,
    on Linux nvmet with an RDMA listener and a QEMU NVMe drive as the namespace."""
    rg = rxe
    cfg = nvmet_config(rg, tmp_path)
    up = rg.kv_json("target", "up", str(cfg), "--allow-remote")
    assert up["changed"] is True
    url = f"nvme+rdma://{ADDR}:4420/{NVMET_NQN}/1"
    conn = rg.kv_json("target", "connect", url)
    assert conn["transport"] == "rdma" and conn["block_device"].startswith("/dev/nvme")
    load = load_verify(rg, url)
    assert load["engine"]["block_device"] == conn["block_device"]  # the connected controller
    rg.fio_verify(conn["block_device"], offset_mb=384)
    disc = rg.kv_json("target", "discover", f"{ADDR}:4420", "--transport", "rdma")
    assert {(e["subnqn"], e["trtype"]) for e in disc["entries"]} >= {(NVMET_NQN, "rdma")}
    rg.kv_ok("target", "disconnect", conn["block_device"])
    # the same namespace through the kernel's NVMe/TCP host (--host kernel)
    tcp = f"nvme+tcp://{ADDR}:4420/{NVMET_NQN}/1"
    verify = rg.kv_json("verify", tcp, "--host", "kernel")
    assert verify["ok"] is True and verify["objects_checked"] == 64
    assert verify["engine"]["transport"] == "tcp" and not rg.fabrics_controllers()
    if rg.spdk_root is not None:  # last: randrw overwrites the namespace
        perf_and_identify(rg, SpdkInstall(rg.spdk_root), 4420, NVMET_NQN, listed=True)
    rg.kv_ok("target", "down", str(cfg))


@pytest.mark.pcie
@pytest.mark.spdk
def test_spdk_production_guest(rxe: RdmaGuest) -> None:
    """fixtures/targets/spdk-production-guest.toml applied: SPDK attaches both QEMU NVMe
    controllers over PCIe (vfio-pci) and serves them over RDMA; kvtool loads and verifies
    through the kernel's host; nvmf_tgt killed mid-load loses nothing acknowledged; SPDK's
    hosts run over RDMA; the drives' SMART Data Units Written grow; down gives the
    controllers back to the kernel's nvme driver. (One up for all of it: each kvtool start
    in the TCG guest costs seconds.)"""
    rg = rxe
    install = need_spdk(rg)
    before = {bdf: rg.smart_units_written(bdf) for bdf in SPDK_BDFS}
    up = rg.kv_json("target", "up", str(PRODUCTION), "--allow-remote", timeout=600)
    assert up["runtime"] == "nvmf_tgt"
    assert [s["action"] for s in up["plan"]["steps"][:3]] == ["bind", "bind", "start"]
    status = rg.kv_json("target", "status", "--name", "kv-nof-guest")
    assert status["state"] == "up"
    assert {p["traddr"]: p["driver"] for p in status["pci"]} == dict.fromkeys(SPDK_BDFS,
                                                                             "vfio-pci")
    assert [s["state"] for s in status["subsystems"]] == ["up", "up"]
    rc, out = rg.chroot(["python3", str(install.rpc_py), "-s", "/var/tmp/spdk.sock",
                         "bdev_get_bdevs"])
    assert rc == 0, out
    bdevs = {b["name"]: b for b in json.loads(out[out.index("["):])}
    for name, bdf in zip(("Nvme0n1", "Nvme1n1"), SPDK_BDFS, strict=True):
        trid = bdevs[name]["driver_specific"]["nvme"][0]["trid"]
        assert (trid["trtype"], trid["traddr"]) == ("PCIe", bdf)
        assert bdevs[name]["num_blocks"] * bdevs[name]["block_size"] == DRIVE_MB << 20

    # first, on the fresh target: nvmf_tgt SIGKILLed while kvtool loads over RDMA
    rg.kv_json("target", "connect", SPDK_URL1)  # the load uses this controller
    acked = kill_mid_load(rg, status["pid"], SPDK_URL1)
    rg.kv_ok("target", "up", str(PRODUCTION), "--allow-remote", timeout=600)  # a new nvmf_tgt
    verify = rg.kv_json("verify", SPDK_URL1)
    assert verify["ok"] is True and verify["objects_checked"] >= acked, (acked, verify)

    load_verify(rg, SPDK_URL2, count=16)  # connects, loads, disconnects by itself
    conn = rg.kv_json("target", "connect", SPDK_URL1)
    load_verify(rg, SPDK_URL1)
    rg.fio_verify(conn["block_device"], offset_mb=384)
    disc = rg.kv_json("target", "discover", f"{ADDR}:4421", "--transport", "rdma")
    assert "nqn.2016-06.io.spdk:kvcache2" in {e["subnqn"] for e in disc["entries"]}
    rg.kv_ok("target", "disconnect", SPDK_URL1)
    perf_and_identify(rg, install, 4420, "nqn.2016-06.io.spdk:kvcache1",  # randrw: last
                      listed=False)
    down = rg.kv_json("target", "down", str(PRODUCTION))
    assert [s["action"] for s in down["plan"]["steps"]] == ["stop", "release", "release"]
    for bdf in SPDK_BDFS:
        assert rg.driver(bdf) == "nvme"
        rg.kernel_block(bdf)  # the kernel's block device is back
    after = {bdf: rg.smart_units_written(bdf) for bdf in SPDK_BDFS}
    # Data Units are thousands of 512 B: the acknowledged objects, then the rest of 64, of
    # 1,002,496 B each through Nvme0n1 (fio's 8 MiB besides), 16 through Nvme1n1
    assert after[SPDK_BDFS[0]] - before[SPDK_BDFS[0]] >= max(64, acked) * 1_002_496 // 512_000
    assert after[SPDK_BDFS[1]] - before[SPDK_BDFS[1]] >= 16 * 1_002_496 // 512_000


def kill_mid_load(rg: RdmaGuest, pid: int, url: str, count: int = 400) -> int:
    """SIGKILL nvmf_tgt (``pid``) while kvtool loads ``url`` over RDMA (through the
    controller already connected): the load fails with one line (exit 1) once the kernel's
    host gives the controller up (ctrl_loss_tmo 10 s), and the controller is gone. Returns
    how many objects it acknowledged (its --ack-file)."""
    script = (f"chroot /hostroot /bin/sh -c 'cd {rg.repo} && /usr/bin/env {rg.env_line()} "
              f"{rg.python} -m kvtool load {url} {' '.join(LOAD)} --count {count} --force "
              "--batch 8 --qd 2 --ack-file /run/acks.jsonl' >/run/load.out 2>&1; "
              "echo $? >/run/load.rc")
    rg.sh(f"rm -f /run/acks.jsonl /run/load.rc; ({script}) </dev/null >/dev/null 2>&1 &")
    deadline = time.monotonic() + 240
    # (a redirection from a missing file makes busybox sh print an error: test first)
    while int(rg.sh("[ -f /run/acks.jsonl ] && wc -l </run/acks.jsonl || echo 0")[1]) < 2:
        assert time.monotonic() < deadline, rg.sh("cat /run/load.out")[1]
        assert not rg.sh("cat /run/load.rc 2>/dev/null")[1].strip(), rg.sh("cat /run/load.out")
        time.sleep(0.3)
    rg.sh(f"kill -9 {pid}")
    while rg.sh("cat /run/load.rc 2>/dev/null")[1].strip() == "":
        assert time.monotonic() < deadline + 120, "the load did not end"
        time.sleep(1)
    rc = int(rg.sh("cat /run/load.rc")[1])
    out = rg.sh("cat /run/load.out")[1]
    assert rc == 1, out + rg.diagnostics()
    lines = [ln for ln in out.splitlines() if ln.startswith("kvtool: error:")]
    assert "Traceback" not in out and len(lines) == 1, repr(out[-3000:])
    acks = [json.loads(line) for line in rg.sh("cat /run/acks.jsonl")[1].splitlines()
            if line.startswith("{")]
    acked = int(acks[-1]["objects"])
    assert 0 < acked < count
    assert not rg.fabrics_controllers()  # the kernel gave the lost controller up
    return acked


def test_wrong_dhchap_key_over_rdma(rxe: RdmaGuest, tmp_path: Path) -> None:
    """DH-HMAC-CHAP over RDMA: the kernel target refuses a host with the wrong key (exit 1,
    one line, no secret); the right key connects."""
    rg = rxe
    good, bad = tmp_path / "host.key", tmp_path / "wrong.key"
    for key in (good, bad):  # on the host: the guest sees /tmp through hostroot
        subprocess.run([sys.executable, "-m", "kvtool", "target", "keygen", str(key)],
                       check=True, capture_output=True)
    cfg = nvmet_config(rg, tmp_path, keys=(good,))
    rg.kv_ok("target", "up", str(cfg), "--allow-remote")
    url = f"nvme+rdma://{ADDR}:4420/{NVMET_NQN}/1"
    try:
        rc, out = rg.kv("target", "connect", url, "--dhchap-secret", str(bad))
        assert rc == 1, out
        lines = [ln for ln in out.splitlines() if ln.strip()]
        assert len(lines) == 1 and "DH-HMAC-CHAP" in lines[0] and "refused" in lines[0], out
        assert "DHHC-1" not in out and "Traceback" not in out
        assert not rg.fabrics_controllers()
        conn = rg.kv_json("target", "connect", url, "--dhchap-secret", str(good))
        assert conn["block_device"].startswith("/dev/nvme")
        rg.kv_ok("target", "disconnect", url)
    finally:
        rg.kv_ok("target", "down", str(cfg))
