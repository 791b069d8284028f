"""NVMe-oF over soft-RoCE against NVMe/TCP, in one QEMU (TCG) guest: the interop matrix's figures.

Boots the guest of tests/rdma (Linux 6.12, rdma_rxe on eth0, an emulated IOMMU, three QEMU
NVMe controllers), then for each target -- Linux nvmet on the first controller, SPDK's
nvmf_tgt (fixtures/targets/spdk-production-guest.toml plus a TCP listener) on the second --
serves the same namespace over RDMA and over TCP on the guest's own address, and measures
through each transport, in the same run:

* the kernel's host (``kvtool target connect``) with fio: 4 KiB random reads at QD 16 (IOPS)
  and 128 KiB sequential reads at QD 8 (GB/s);
* SPDK's host, ``spdk_nvme_perf`` 4 KiB randread QD 16;

and prints each figure with its RDMA/TCP ratio. Figures are soft-RoCE under TCG on whatever
machine runs this: they compare the two transports' software paths in one guest, not
hardware (docs/rdma.md).

    python bench/nvme_rdma_guest.py [--seconds 5] [--json]
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from emulator.qemu.build import ensure_built  # noqa: E402
from emulator.qemu.guest import GUEST_ADDR, Guest  # noqa: E402
from emulator.qemu.rdma import add_rxe, del_rxe  # noqa: E402
from emulator.spdk import tools  # noqa: E402
from kvtool.nvme.url import default_hostnqn  # noqa: E402
from kvtool.target.spdk.install import find_spdk  # noqa: E402

NVMET_NQN = "nqn.2026-01.io.kvtool:bench"
SPDK_NQN = "nqn.2016-06.io.spdk:kvcache1"


class Box:
    def __init__(self, guest: Guest, spdk: Path) -> None:
        self.guest, self.spdk = guest, spdk

    def chroot(self, argv: list[str], timeout: float = 600) -> str:
        env = (f"HOME=/tmp PATH=/usr/bin:/bin:/usr/sbin:/sbin KVTOOL_STATE_DIR=/run/kvb "
               f"KVTOOL_SPDK_DIR={self.spdk}")
        rc, out = self.guest.exec("chroot /hostroot /bin/sh -c " + shlex.quote(
            f"cd {REPO} && /usr/bin/env {env} " + shlex.join(argv)), timeout)
        if rc != 0:
            raise RuntimeError(f"{' '.join(argv)} exited {rc}: {out[-1500:]}")
        return out

    def kv(self, *args: str) -> dict:
        out = self.chroot([sys.executable, "-m", "kvtool", *args, "--json"])
        return json.loads(out[out.index("{"):])

    def runner(self, argv: list[str], timeout: float) -> tuple[int, str]:
        try:
            return 0, self.chroot(["timeout", "-k", "5", str(int(timeout)), *argv], timeout + 30)
        except RuntimeError as exc:
            return 1, str(exc)

    def fio(self, device: str, rw: str, bs: str, qd: int, seconds: int) -> dict:
        out = self.chroot(["fio", "--name=b", f"--filename={device}", "--direct=1",
                           "--ioengine=libaio", f"--rw={rw}", f"--bs={bs}", f"--iodepth={qd}",
                           "--size=256M", "--time_based", f"--runtime={seconds}",
                           "--output-format=json"])
        job = json.loads(out[out.index("{"):])["jobs"][0]["read"]
        return {"iops": job["iops"], "gb_s": job["bw_bytes"] / 1e9}


def measure(box: Box, urls: dict[str, str], port: int, nqn: str, seconds: int) -> dict:
    rows: dict[str, dict] = {}
    for transport, url in urls.items():
        dev = box.kv("target", "connect", url)["block_device"]
        try:
            rand = box.fio(dev, "randread", "4k", 16, seconds)
            seq = box.fio(dev, "read", "128k", 8, seconds)
        finally:
            box.kv("target", "disconnect", url)
        trid = tools.trid(GUEST_ADDR, port, nqn, default_hostnqn(), trtype=transport.upper())
        perf = tools.perf(find_spdk(), trid, workload="randread", qd=16, seconds=seconds,
                          runner=box.runner)
        rows[transport] = {"fio_4k_randread_iops": rand["iops"],
                           "fio_128k_read_gb_s": seq["gb_s"],
                           "spdk_perf_4k_randread_iops": perf.iops,
                           "spdk_perf_errors": len(perf.run.errors)}
    rows["ratio_rdma_tcp"] = {k: rows["rdma"][k] / rows["tcp"][k] if rows["tcp"][k] else None
                              for k in rows["rdma"] if not k.endswith("errors")}
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    spdk = find_spdk(build=True).root
    image = ensure_built(kernel="6.12")
    work = Path(tempfile.mkdtemp(prefix="kvtool-rdma-bench-"))
    drives = []
    for i in range(3):
        path = work / f"nvme{i}.img"
        with path.open("wb") as f:
            f.truncate(512 << 20)
        drives.append(str(path))
    result: dict = {"machine": "QEMU TCG guest (Linux 6.12, 2 vCPUs), soft-RoCE (rdma_rxe)",
                    "date": time.strftime("%Y-%m-%d"), "seconds": args.seconds}
    with Guest(image, target=False, hostroot=True, rdma=True, iommu=True, smp=2,
               mem_mb=3072, cpu="max", nvme=drives) as guest:
        box = Box(guest, spdk)
        add_rxe(guest)
        try:
            dev = guest.check("ls /sys/bus/pci/devices/0000:00:10.0/nvme/*/ | grep -E "
                              "'^nvme[0-9]+n1$'").strip()
            cfg = work / "nvmet.toml"
            cfg.write_text(f'backend = "nvmet"\nname = "bench-nvmet"\n[[subsystem]]\n'
                           f'nqn = "{NVMET_NQN}"\nallow_any_host = true\n'
                           f'[[subsystem.namespace]]\nnsid = 1\nbacking = "block"\n'
                           f'path = "/dev/{dev}"\n'
                           + "".join(f'[[listener]]\ntransport = "{t}"\naddress = "{GUEST_ADDR}"'
                                     f'\nport = 4420\n' for t in ("rdma", "tcp")))
            box.kv("target", "up", str(cfg), "--allow-remote")
            try:
                result["nvmet"] = measure(box, {
                    t: f"nvme+{t}://{GUEST_ADDR}:4420/{NVMET_NQN}/1" for t in ("rdma", "tcp")},
                    4420, NVMET_NQN, args.seconds)
            finally:
                box.kv("target", "down", str(cfg))
            prod = (REPO / "fixtures" / "targets" / "spdk-production-guest.toml").read_text()
            spdk_cfg = work / "spdk.toml"
            spdk_cfg.write_text(prod + '\n[[transport]]\ntype = "tcp"\n\n[[listener]]\n'
                                f'transport = "tcp"\naddress = "{GUEST_ADDR}"\nport = 4420\n'
                                f'subsystems = ["{SPDK_NQN}"]\n')
            box.kv("target", "up", str(spdk_cfg), "--allow-remote")
            try:
                result["spdk"] = measure(box, {
                    t: f"nvme+{t}://{GUEST_ADDR}:4420/{SPDK_NQN}/1" for t in ("rdma", "tcp")},
                    4420, SPDK_NQN, args.seconds)
            finally:
                box.kv("target", "down", str(spdk_cfg))
        finally:
            del_rxe(guest)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"{result['machine']}, {result['date']}, {args.seconds} s per figure (measured)")
    for target in ("nvmet", "spdk"):
        r = result[target]
        for key in r["rdma"]:
            if key.endswith("errors"):
                continue
            ratio = r["ratio_rdma_tcp"][key]
            print(f"{target:6} {key:28} rdma {r['rdma'][key]:10.3f}  tcp {r['tcp'][key]:10.3f}"
                  f"  rdma/tcp {ratio:5.2f}" if ratio is not None else "")
    return 0


if __name__ == "__main__":
    sys.exit(main())
