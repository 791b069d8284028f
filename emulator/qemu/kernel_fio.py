"""Heavy I/O from the Linux kernel's NVMe/TCP host onto kvtool's target, checked by fio.

A QEMU guest (Linux 6.1, its nvme-tcp host) connects to ``python -m emulator.nvmetcp``
running on this machine (a file namespace) and runs fio (this machine's, through the
guest's read-only view of /) with ``--verify=crc32c`` on the namespace: sequential and
random writes at QD 1 and QD 32, every block read back and checked by fio. Then kvtool's
own host reads the same namespace over NVMe/TCP, and its bytes must equal both what the
guest reads through the kernel (O_DIRECT) and the target's backing file; a ``blkdiscard``
and a ``blkdiscard -z`` from the guest (Dataset Management, Write Zeroes) read as zeros.
Used by ``bench/nvme_kernel_fio.py`` (≥ 1 GiB) and tests/emulator/test_kernel_fio.py.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from emulator.qemu.build import GUEST_HOSTNQN, ensure_built
from emulator.qemu.guest import GUESTFWD_ADDR, Guest
from kvtool.nvme import host

REPO = Path(__file__).resolve().parents[2]
NQN = "nqn.2026-01.io.kvtool:fio"
KVTOOL_HOSTNQN = "nqn.2026-01.io.kvtool:fio-host"
MIB = 1 << 20


@dataclass(frozen=True)
class Job:
    name: str
    rw: str
    bs: str
    iodepth: int
    offset_mib: int
    size_mib: int


def jobs_for(total_mib: int) -> list[Job]:
    """Four regions, one per (pattern, depth): the larger share to the fast sequential ones."""
    q = total_mib // 8
    return [Job("seq-qd32", "write", "1M", 32, 0, 4 * q),
            Job("rand-qd32", "randwrite", "64k", 32, 4 * q, 2 * q),
            Job("seq-qd1", "write", "128k", 1, 6 * q, q),
            Job("rand-qd1", "randwrite", "16k", 1, 7 * q, q)]


def fio_cmd(dev: str, job: Job) -> str:
    return (f"chroot /hostroot fio --name={job.name} --filename={dev} --direct=1 "
            f"--ioengine=libaio --rw={job.rw} --bs={job.bs} --iodepth={job.iodepth} "
            f"--offset={job.offset_mib}M --size={job.size_mib}M --verify=crc32c "
            f"--do_verify=1 --verify_fatal=1 --randrepeat=0 --output-format=json")


def start_target(backing: Path, size: int) -> tuple[subprocess.Popen[str], int]:
    with backing.open("wb") as f:
        f.truncate(size)
    proc = subprocess.Popen(
        [sys.executable, "-m", "emulator.nvmetcp", "--listen", "127.0.0.1:0", "--nqn", NQN,
         "--backing", str(backing), "--host", GUEST_HOSTNQN, "--host", KVTOOL_HOSTNQN],
        cwd=REPO, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith("ready "):
        proc.kill()
        raise RuntimeError(f"kvtool's target did not start: {line!r}")
    return proc, int(line.split()[1].split("/")[2].rsplit(":", 1)[1])


def run(total_mib: int, workdir: Path) -> dict[str, object]:
    """Run every job; return fio's per-job figures and the cross-checks."""
    size = total_mib * MIB
    proc, port = start_target(workdir / "ns1.img", size)
    result: dict[str, object] = {"total_mib": total_mib, "jobs": []}
    try:
        with Guest(ensure_built(), target=False, hostroot=True, guest_forwards=[port],
                   mem_mb=512, size_mb=16) as guest:
            guest.check(f"nvme connect -t tcp -a {GUESTFWD_ADDR} -s {port} -n {NQN}",
                        timeout=60)
            dev = guest.check(
                "for i in $(seq 200); do for c in /sys/class/nvme/nvme*; do"
                f" [ \"$(cat $c/subsysnqn)\" = {NQN} ] && [ -b /dev/$(basename $c)n1 ] &&"
                " echo /dev/$(basename $c)n1 && exit 0; done; usleep 50000; done; exit 1",
                timeout=30).strip()
            jobs = []
            for job in jobs_for(total_mib):
                t0 = time.monotonic()
                rc, out = guest.exec(fio_cmd(dev, job), timeout=3600)
                doc = json.loads(out[out.index("{"):])
                j = doc["jobs"][0]
                jobs.append({"job": job.name, "rw": job.rw, "bs": job.bs,
                             "iodepth": job.iodepth, "mib": job.size_mib, "fio_exit": rc,
                             "errors": j["error"], "write_mib": j["write"]["io_bytes"] // MIB,
                             "verified_mib": j["read"]["io_bytes"] // MIB,
                             "write_mbps": round(j["write"]["bw_bytes"] / 1e6, 1),
                             "seconds": round(time.monotonic() - t0, 1)})
            result["jobs"] = jobs
            # the kernel's discard and zero-out reach the target as Dataset Management
            # (deallocate) and Write Zeroes: both ranges must read back as zeros
            # util-linux's blkdiscard by its path: a bare name runs busybox's own applet
            # (no -z) where busybox prefers its applets to PATH
            blkdiscard = "chroot /hostroot /sbin/blkdiscard"
            guest.check(f"{blkdiscard} -o 0 -l {MIB} {dev} && "
                        f"{blkdiscard} -z -o {MIB} -l {MIB} {dev}", timeout=120)
            guest_sha = guest.check(f"dd if={dev} bs=1M count={total_mib} iflag=direct "
                                    "2>/dev/null | sha256sum", timeout=3600).split()[0]
            guest.exec(f"nvme disconnect -n {NQN}", timeout=30)
        h = hashlib.sha256()
        with host.connect("127.0.0.1", port, NQN, hostnqn=KVTOOL_HOSTNQN) as ctrl:
            buf = bytearray(16 * MIB)
            for off in range(0, size, len(buf)):
                n = min(len(buf), size - off)
                ctrl.read_into(1, off // 512, memoryview(buf)[:n])
                h.update(memoryview(buf)[:n])
            zeros = ctrl.read(1, 0, 2 * MIB // 512) == bytes(2 * MIB)
        kvtool_sha = h.hexdigest()
    finally:
        proc.terminate()
        proc.wait(30)
    backing_sha = hashlib.sha256((workdir / "ns1.img").read_bytes()).hexdigest()
    result.update({"guest_sha256": guest_sha, "kvtool_host_sha256": kvtool_sha,
                   "backing_sha256": backing_sha,
                   "views_agree": guest_sha == kvtool_sha == backing_sha,
                   "discard_and_zeroout_read_zeros": zeros})
    return result


def ok(result: dict[str, object]) -> bool:
    jobs = result["jobs"]
    assert isinstance(jobs, list)
    return bool(jobs) and bool(result["views_agree"]) and bool(
        result["discard_and_zeroout_read_zeros"]) and all(
        j["fio_exit"] == 0 and j["errors"] == 0 and j["verified_mib"] == j["mib"]
        for j in jobs)
