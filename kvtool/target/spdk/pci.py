"""Hand PCIe NVMe controllers to SPDK's userspace driver and give them back to the kernel.

What SPDK's ``scripts/setup.sh`` does for each device it manages (``linux_bind_driver``):
write the driver's name to ``/sys/bus/pci/devices/BDF/driver_override``, unbind the device
from its current driver, and ask the kernel to probe it again (``/sys/bus/pci/drivers_probe``),
so that only the named driver takes it; ``reset`` empties ``driver_override`` and probes again,
so the kernel's ``nvme`` driver binds it back.

``vfio-pci`` is the default: with an IOMMU it maps DMA for SPDK by virtual address, which
is what SPDK's ``--no-huge`` needs (SPDK forces IOVA = VA without hugepages; without an
IOMMU — ``uio_pci_generic`` or vfio's no-IOMMU mode — the device would be handed virtual
addresses as physical ones, so SPDK refuses 4 KiB pages there: ``lib/env_dpdk/memory.c``).

A controller whose namespaces are mounted or held (a partition, device-mapper, md, or a
kernel nvmet namespace) is refused, as setup.sh refuses a device "in use".
"""

from __future__ import annotations

import errno
import os
import subprocess
import time
from pathlib import Path

from kvtool.target.plan import TargetError

SYSFS = Path("/sys/bus/pci")
DRIVERS = ("vfio-pci", "uio_pci_generic")
KERNEL_DRIVER = "nvme"
_MODULES = {"vfio-pci": "vfio-pci", "uio_pci_generic": "uio_pci_generic", "nvme": "nvme"}


def device(bdf: str) -> Path:
    return SYSFS / "devices" / bdf


def driver(bdf: str) -> str | None:
    """The driver bound to ``bdf`` now, or None."""
    link = device(bdf) / "driver"
    try:
        return os.path.basename(os.readlink(link))
    except OSError:
        return None


def exists(bdf: str) -> bool:
    return device(bdf).is_dir()


def block_devices(bdf: str) -> list[str]:
    """The kernel block devices of the NVMe controller at ``bdf`` (``nvme0n1``, …)."""
    out: list[str] = []
    nvme = device(bdf) / "nvme"
    if not nvme.is_dir():
        return out
    for ctrl in nvme.iterdir():
        for entry in ctrl.iterdir():
            if entry.name.startswith("nvme") and "n" in entry.name[4:] and (entry / "size").exists():
                out.append(entry.name)
    return sorted(out)


def in_use(bdf: str) -> str | None:
    """Why ``bdf`` must not be taken from the kernel now (None: it is free)."""
    try:
        mounts = Path("/proc/mounts").read_text()
    except OSError:
        mounts = ""
    for name in block_devices(bdf):
        block = Path("/sys/block") / name
        holders = sorted(p.name for p in (block / "holders").glob("*"))
        if holders:
            return f"/dev/{name} is held by {', '.join(holders)}"
        parts = [name, *sorted(p.name for p in block.glob(f"{name}p*"))]
        for part in parts:
            if f"/dev/{part} " in mounts:
                return f"/dev/{part} is mounted"
        try:  # a block device claimed by a file system, nvmet or dm refuses O_EXCL
            os.close(os.open(f"/dev/{name}", os.O_RDONLY | os.O_EXCL))
        except OSError as exc:
            if exc.errno == errno.EBUSY:
                return f"/dev/{name} is open exclusively (a file system, nvmet, or dm)"
    return None


def vfio_users(bdf: str) -> list[int]:
    """Pids that hold ``bdf``'s VFIO group open (a running SPDK application)."""
    try:
        group = os.path.basename(os.readlink(device(bdf) / "iommu_group"))
    except OSError:
        return []
    wanted = {f"/dev/vfio/{group}", f"/dev/vfio/noiommu-{group}"}
    pids = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            fds = os.listdir(f"/proc/{entry.name}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{entry.name}/fd/{fd}") in wanted:
                    pids.append(int(entry.name))
                    break
            except OSError:
                continue
    return pids


def _write(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def _ensure_driver(name: str) -> None:
    if (SYSFS / "drivers" / name).is_dir():
        return
    subprocess.run(["modprobe", _MODULES.get(name, name)], capture_output=True, check=False)
    if not (SYSFS / "drivers" / name).is_dir():
        raise TargetError(f"the {name} driver is not loaded (modprobe {_MODULES.get(name, name)})")


def _rebind(bdf: str, override: str, want: str | None, timeout: float) -> None:
    dev = device(bdf)
    try:
        _write(dev / "driver_override", override + "\n" if override else "\n")
        current = driver(bdf)
        if current is not None:
            _write(dev / "driver" / "unbind", bdf)
        _write(SYSFS / "drivers_probe", bdf)
    except OSError as exc:
        raise TargetError(f"cannot rebind PCI device {bdf}: {exc.strerror}") from None
    if want is None:
        return
    deadline = time.monotonic() + timeout
    while driver(bdf) != want:
        if time.monotonic() > deadline:
            raise TargetError(f"PCI device {bdf} is bound to {driver(bdf) or 'no driver'}, "
                              f"not {want}, {timeout:.0f} s after the rebind")
        time.sleep(0.05)


def bind(bdf: str, name: str = "vfio-pci", timeout: float = 15.0) -> str | None:
    """Bind ``bdf`` to ``name`` for SPDK; returns the driver it had (to give it back)."""
    if name not in DRIVERS:
        raise TargetError(f"PCI driver {name!r} is not one SPDK uses ({', '.join(DRIVERS)})")
    if not exists(bdf):
        raise TargetError(f"no PCI device {bdf} on this machine")
    before = driver(bdf)
    if before == name:
        return before
    if before == KERNEL_DRIVER:
        why = in_use(bdf)
        if why:
            raise TargetError(f"PCI device {bdf} is in use by the kernel: {why}")
    _ensure_driver(name)
    _rebind(bdf, name, name, timeout)
    return before


def release(bdf: str, timeout: float = 30.0) -> str | None:
    """Give ``bdf`` back to the kernel (driver_override cleared, probed again): the ``nvme``
    driver takes an NVMe controller. Returns the driver it then has."""
    if not exists(bdf):
        raise TargetError(f"no PCI device {bdf} on this machine")
    if driver(bdf) == KERNEL_DRIVER:
        with_override = (device(bdf) / "driver_override").read_text().strip()
        if with_override in ("", "(null)"):
            return KERNEL_DRIVER
    users = vfio_users(bdf)
    if users:
        raise TargetError(f"PCI device {bdf} is still in use through VFIO by pid "
                          f"{', '.join(map(str, users))} (a running SPDK application): stop it "
                          "first")
    want = KERNEL_DRIVER if (SYSFS / "drivers" / KERNEL_DRIVER).is_dir() else None
    _rebind(bdf, "", want, timeout)
    return driver(bdf)
