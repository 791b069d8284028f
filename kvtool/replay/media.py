"""What data mode opens and creates on this machine, checked against it first: the NVMe
tier's place (a target URL, or a store file created when missing, if the disk holds
it), and the memory its pools take."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvtool.errors import UsageError, param
from kvtool.units import format_size

if TYPE_CHECKING:
    from kvtool.nvme.hostauth import HostCredentials


def mem_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def nvme_engine(place: str, create_bytes: int | None, read_qd: int,
                 credentials: HostCredentials | None = None) -> Any:
    from kvtool.store.engine import open_engine

    kernel_host = place.startswith("nvme+rdma://") or (
        place.startswith("nvme+tcp://") and credentials is not None
        and credentials.initiator == "kernel")
    if kernel_host:  # the kernel's NVMe-oF host (kvtool.store.kernelhost)
        try:
            return open_engine(place, write=True, qd=max(read_qd, 16), credentials=credentials)
        except UsageError as exc:
            raise UsageError(exc.message, field="nvme") from None
    if place.startswith("nvme+tcp://"):
        from kvtool.nvme.engine import open_nvme_tcp

        try:
            return open_nvme_tcp(place, write=True, qd=max(read_qd, 16), reconnect=2.0,
                                 timeout=5.0, credentials=credentials)
        except UsageError as exc:
            raise UsageError(exc.message, field="nvme") from None
    path = Path(place)
    if not path.exists():
        if create_bytes is None:
            raise UsageError(f"{place} does not exist; give a size to create it: "
                             f"{param('nvme')} 2GiB@{place}", field="nvme")
        parent = path.resolve().parent
        if not parent.is_dir():
            raise UsageError(f"cannot create {place}: no such directory", field="nvme")
        import shutil

        free = shutil.disk_usage(parent).free
        if create_bytes > free:
            raise UsageError(f"{format_size(create_bytes)} does not fit in {parent} "
                             f"({format_size(free)} free); use a smaller size or {param('simulate')}",
                             field="nvme")
    try:
        return open_engine(place, write=True, qd=max(read_qd, 16),
                           create_bytes=create_bytes if not path.exists() else None)
    except UsageError as exc:
        raise UsageError(exc.message, field="nvme") from None
