"""The production path in one QEMU guest: soft-RoCE, three PCIe NVMe controllers, an IOMMU.

``RdmaGuest`` wraps a running :class:`emulator.qemu.guest.Guest` booted with ``rdma=True``,
``iommu=True``, ``hostroot=True`` and three QEMU NVMe controllers (``NVME_BDFS``): the first
backs the kernel nvmet target, the other two are the ones
fixtures/targets/spdk-production-guest.toml hands to SPDK. It runs this checkout's kvtool
and SPDK's tools inside the guest (``chroot /hostroot``) and checks that nothing is left.
"""

from __future__ import annotations

import json
import re
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from emulator.qemu.guest import GUEST_ADDR, Guest
from emulator.qemu.rdma import rxe_links

REPO = Path(__file__).resolve().parents[2]
NVME_BDFS = tuple(Guest.nvme_bdf(i) for i in range(3))
NVMET_BDF, SPDK_BDFS = NVME_BDFS[0], NVME_BDFS[1:]
ADDR = GUEST_ADDR
STATE_DIR = "/run/kvtool-rdma"
DRIVE_MB = 512
GUEST_OPTIONS: dict[str, Any] = {"target": False, "hostroot": True, "rdma": True, "iommu": True,
                                 "smp": 2, "mem_mb": 3072, "cpu": "max"}


class RdmaGuest:
    def __init__(self, guest: Guest, spdk_root: Path | None) -> None:
        self.guest = guest
        self.spdk_root = spdk_root

    # --- running things in the guest ---------------------------------------------------------
    def sh(self, shell: str, timeout: float = 120.0) -> tuple[int, str]:
        t0 = time.monotonic()
        out = self.guest.exec(shell, timeout)
        if time.monotonic() - t0 > 2:  # shown with a failure's captured output
            print(f"[{time.monotonic() - t0:5.1f} s] {shell[-160:]}")
        return out

    repo = str(REPO)
    python = sys.executable

    def env_line(self) -> str:
        """The environment kvtool runs with in the guest, as ``K=V ...``."""
        env = {"HOME": "/tmp", "PATH": "/usr/bin:/bin:/usr/sbin:/sbin",
               "KVTOOL_STATE_DIR": STATE_DIR, "PYTHONDONTWRITEBYTECODE": "1"}
        if self.spdk_root is not None:
            env["KVTOOL_SPDK_DIR"] = str(self.spdk_root)
        return " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())

    def chroot(self, argv: list[str], timeout: float = 300.0) -> tuple[int, str]:
        """Run argv in the host root (this checkout's interpreter, Debian's tools)."""
        return self.sh("chroot /hostroot /bin/sh -c "
                       + shlex.quote(f"cd {shlex.quote(self.repo)} && /usr/bin/env "
                                     f"{self.env_line()} " + shlex.join(argv)), timeout)

    def kv(self, *args: str, timeout: float = 300.0) -> tuple[int, str]:
        """``kvtool ARGS`` in the guest; (exit status, stdout+stderr)."""
        return self.chroot([self.python, "-m", "kvtool", *args], timeout)

    def kv_ok(self, *args: str, timeout: float = 300.0) -> str:
        rc, out = self.kv(*args, timeout=timeout)
        assert rc == 0, f"kvtool {' '.join(args)} exited {rc}:\n{out}"
        return out

    def kv_json(self, *args: str, timeout: float = 300.0) -> dict[str, Any]:
        out = self.kv_ok(*args, "--json", timeout=timeout)
        return json.loads(out[out.index("{"):])

    def runner(self, argv: list[str], timeout: float) -> tuple[int, str]:
        """emulator.spdk.tools' runner: SPDK's host tools in the guest."""
        return self.chroot(["timeout", "-k", "5", str(int(timeout)), *argv], timeout + 30)

    # --- what is there -------------------------------------------------------------------------
    def driver(self, bdf: str) -> str:
        return self.sh(f"basename $(readlink /sys/bus/pci/devices/{bdf}/driver) 2>/dev/null")[1].strip()

    def kernel_block(self, bdf: str) -> str:
        """/dev/nvmeXnY of the PCIe controller at ``bdf`` (kernel nvme driver)."""
        rc, out = self.sh(f"ls /sys/bus/pci/devices/{bdf}/nvme/*/ | grep -E '^nvme[0-9]+n[0-9]+$' "
                          "| head -1")
        name = out.strip()
        assert rc == 0 and name, f"no kernel block device for {bdf}: {out}"
        return f"/dev/{name}"

    def smart_units_written(self, bdf: str) -> int:
        """SMART Data Units Written of the controller at ``bdf`` (kernel nvme driver, nvme-cli)."""
        _rc, out = self.sh(f"ls /sys/bus/pci/devices/{bdf}/nvme/")
        ctrl = out.split()[0]
        rc, out = self.sh(f"nvme smart-log /dev/{ctrl} -o json")
        assert rc == 0, out
        return int(json.loads(out[out.index("{"):])["data_units_written"])

    def fabrics_controllers(self) -> list[str]:
        _rc, out = self.sh("for c in /sys/class/nvme/*; do t=$(cat $c/transport); "
                          "[ \"$t\" = pcie ] || echo ${c##*/}:$t; done")
        return out.split()

    def leftovers(self) -> list[str]:
        """What the production path must not leave behind: rxe devices, SPDK processes,
        fabrics controllers, devices off the kernel's nvme driver, configfs objects."""
        left = [f"rdma link {link}" for link in rxe_links(self.guest)]
        _rc, out = self.sh("ps -o pid,args | grep -E 'nvmf_tgt|spdk_nvme' | grep -v grep")
        left += [f"process {line.strip()}" for line in out.splitlines() if line.strip()]
        left += [f"controller {c}" for c in self.fabrics_controllers()]
        left += [f"PCI {bdf} on {self.driver(bdf) or 'no driver'}" for bdf in NVME_BDFS
                 if self.driver(bdf) != "nvme"]
        _rc, out = self.sh("ls /sys/kernel/config/nvmet/subsystems /sys/kernel/config/nvmet/ports")
        left += [f"configfs {n}" for n in re.findall(r"^(?!/)(\S+)$", out, re.M)]
        return left

    def diagnostics(self) -> str:
        """What a failure message needs: the guest's kernel log (less SPDK's per-command
        notices), processes, memory, RDMA links and nvmf_tgt's log."""
        return self.sh("for f in /proc/[0-9]*/stat; do case $(cat $f 2>/dev/null) in "
                       "*reactor*|*nvmf_tgt*) echo \"zombie/exit: $(cat $f)\";; esac; done; "
                       "dmesg | grep -i -E 'segfault|trap|killed|oom|general protection|rxe' "
                       "| tail; dmesg | grep -v -e 'I/O queues' -e 'mapped 2' | tail -60; "
                       "ps -o pid,stat,rss,args | cut -c1-100; free -m; "
                       "/hostroot/usr/bin/rdma link show 2>&1 || chroot /hostroot rdma link; "
                       "grep -h -v -e nvme_qpair -e cdata_init /run/kvtool-rdma/run/*.log "
                       "/hostroot/tmp/kvtool-spdk-*/nvmf_tgt.log 2>/dev/null | tail -30")[1]

    def cleanup(self) -> None:
        """After a failed test: take down every target recorded in the guest and
        disconnect every fabrics controller (what a passing test did itself)."""
        _rc, out = self.sh(f"ls {STATE_DIR}/targets 2>/dev/null")
        for name in re.findall(r"^(\S+)\.json$", out, re.M):
            self.kv("target", "down", "--name", name)
        for entry in self.fabrics_controllers():
            self.sh(f"echo 1 > /sys/class/nvme/{entry.split(':')[0]}/delete_controller")

    def fio_verify(self, device: str, offset_mb: int, size_mb: int = 8) -> str:
        """fio writes ``size_mb`` at ``offset_mb`` with CRC32C verify headers, reads them back."""
        rc, out = self.chroot(
            ["fio", "--name=verify", f"--filename={device}", "--direct=1", "--ioengine=libaio",
             "--rw=randwrite", "--bs=64k", "--iodepth=8", f"--offset={offset_mb}M",
             f"--size={size_mb}M", "--verify=crc32c", "--do_verify=1", "--verify_fatal=1",
             "--output-format=terse", "--terse-version=3"], 300)
        assert rc == 0, f"fio verify on {device} failed:\n{out}"
        return out
