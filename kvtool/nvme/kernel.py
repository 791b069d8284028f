"""The Linux kernel's NVMe-oF host (``nvme-rdma``, ``nvme-tcp``), driven as nvme-cli drives it.

A connect is one ``write()`` of an option string to ``/dev/nvme-fabrics`` and one ``read()``
of the kernel's answer from the same descriptor (libnvme ``nvmf_add_ctrl``):

    nqn=SUBNQN,transport=rdma,traddr=10.0.2.15,trsvcid=4420,hostnqn=NQN,hostid=UUID,
    nr_io_queues=2,ctrl_loss_tmo=10,reconnect_delay=1,dhchap_secret=DHHC-1:…   (one line)
    -> instance=3,cntlid=1

The controller is then ``/dev/nvme3`` (``/sys/class/nvme/nvme3``); its namespaces are block
devices ``/dev/nvmeSnN`` (with native multipath, S is the subsystem's instance: the head
device, found through the controller's hidden path ``nvmeScCnN``). A disconnect writes ``1``
to ``/sys/class/nvme/nvmeN/delete_controller`` (nvme-cli ``disconnect``).

Discovery connects a controller to the discovery NQN, reads log page 0x70 through the
admin passthrough ioctl (``NVME_IOCTL_ADMIN_CMD``) until its generation counter is stable,
and deletes the controller, as ``nvme discover`` does.

Secrets reach the kernel in the option string (the kernel copies them; they are never
logged or returned here). Errors: :class:`FabricsError` (an ``OSError`` with the kernel's
errno and what it usually means).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import os
import re
import struct
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kvtool.nvme import spec
from kvtool.nvme.spec import DiscoveryEntry

if TYPE_CHECKING:
    from kvtool.nvme.dhchap import Secret

FABRICS_DEV = "/dev/nvme-fabrics"
SYSFS = Path("/sys/class/nvme")
TRANSPORTS = ("tcp", "rdma")
# kvtool's own default, as its userspace host's reconnect=10 s: a target that is gone for
# longer fails the I/O (nvme-cli's default is 600 s, which would hang a load for 10 minutes)
CTRL_LOSS_TMO = 10
RECONNECT_DELAY = 1
# struct nvme_passthru_cmd (include/uapi/linux/nvme_ioctl.h): 72 bytes
_PASSTHRU = struct.Struct("<BBHIIIQQIIIIIIIIII")
NVME_IOCTL_ADMIN_CMD = (3 << 30) | (_PASSTHRU.size << 16) | (ord("N") << 8) | 0x41
_ERRNO_HINT = {
    errno.ECONNREFUSED: "the target refused the connection (nothing listens there)",
    errno.EHOSTUNREACH: "no route to the target",
    errno.ETIMEDOUT: "the target did not answer",
    errno.EINVAL: "an option the kernel refused, or a Connect the target refused",
    errno.EIO: "the target refused the Connect (host not allowed, or authentication failed)",
    errno.EKEYREJECTED: "DH-HMAC-CHAP failed (wrong key)",
    errno.ENODEV: "no RDMA device can reach that address (no rxe/RoCE port)",
    errno.EADDRNOTAVAIL: "no local address can reach the target",
    errno.EALREADY: "already connected to that subsystem with these options",
}


# what the kernel's connect returns when the target refuses the host's authentication
AUTH_ERRNOS = (errno.EKEYREJECTED, errno.EIO, errno.EACCES, errno.EPERM)


class FabricsError(OSError):
    """The kernel refused a connect, disconnect or discovery; ``errno`` is the kernel's."""


@dataclass(frozen=True)
class ConnectOptions:
    """What ``nvme connect`` passes to the kernel (libnvme ``build_options``)."""

    transport: str
    traddr: str
    trsvcid: int
    subnqn: str
    hostnqn: str
    hostid: str
    nr_io_queues: int | None = None
    queue_size: int | None = None
    ctrl_loss_tmo: int | None = CTRL_LOSS_TMO
    reconnect_delay: int | None = RECONNECT_DELAY
    keep_alive_tmo: int | None = None
    dhchap_secret: Secret | None = None
    dhchap_ctrl_secret: Secret | None = None

    def option_string(self) -> str:
        """The line written to /dev/nvme-fabrics (it carries the secrets: never log it)."""
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, not {self.transport!r}")
        parts = [f"nqn={self.subnqn}", f"transport={self.transport}", f"traddr={self.traddr}",
                 f"trsvcid={self.trsvcid}", f"hostnqn={self.hostnqn}", f"hostid={self.hostid}"]
        for key in ("nr_io_queues", "queue_size", "ctrl_loss_tmo", "reconnect_delay",
                    "keep_alive_tmo"):
            value = getattr(self, key)
            if value is not None:
                parts.append(f"{key}={value}")
        if self.dhchap_secret is not None:
            parts.append(f"dhchap_secret={self.dhchap_secret.encode()}")
        if self.dhchap_ctrl_secret is not None:
            parts.append(f"dhchap_ctrl_secret={self.dhchap_ctrl_secret.encode()}")
        text = ",".join(parts)
        if "\n" in text:
            raise ValueError("an option holds a newline")
        return text


def hostid_text(hostnqn: str) -> str:
    """The host ID nvme-cli would send for ``hostnqn``: the UUID of a ``…:uuid:`` NQN
    (``/etc/nvme/hostid`` when it matches), else the same uuid5 kvtool's userspace host uses."""
    from kvtool.nvme.url import hostid_for
    return str(uuid.UUID(bytes=hostid_for(hostnqn)))


@dataclass(frozen=True)
class KernelController:
    """One fabrics controller the kernel host holds (``/sys/class/nvme/NAME``)."""

    name: str  # "nvme3"
    transport: str
    subnqn: str
    address: str  # the sysfs address line: traddr=…,trsvcid=…

    @property
    def instance(self) -> int:
        return int(self.name[len("nvme"):])

    @property
    def sysfs(self) -> Path:
        return SYSFS / self.name

    @property
    def device(self) -> str:
        return f"/dev/{self.name}"

    def traddr(self) -> tuple[str, int]:
        fields = dict(p.split("=", 1) for p in self.address.split(",") if "=" in p)
        return fields.get("traddr", ""), int(fields.get("trsvcid", "0") or 0)

    def namespaces(self) -> dict[int, str]:
        """NSID -> block device (``/dev/nvmeSnN``) of every namespace the host has found."""
        out: dict[int, str] = {}
        with contextlib.suppress(OSError):
            for entry in self.sysfs.iterdir():
                m = re.fullmatch(r"nvme(\d+)(?:c\d+)?n(\d+)", entry.name)
                if m is None:
                    continue
                head = f"nvme{m.group(1)}n{m.group(2)}"
                try:
                    nsid = int((Path("/sys/block") / head / "nsid").read_text())
                except (OSError, ValueError):
                    try:
                        nsid = int((entry / "nsid").read_text())
                    except (OSError, ValueError):
                        continue
                out[nsid] = f"/dev/{head}"
        return out

    def block_device(self, nsid: int | None = None, timeout: float = 15.0) -> str:
        """The block device of ``nsid`` (default: the lowest), waiting for the kernel's
        namespace scan; FabricsError(ENOENT) when it does not appear."""
        deadline = time.monotonic() + timeout
        while True:
            found = self.namespaces()
            if found:
                key = min(found) if nsid is None else nsid
                if key in found and os.path.exists(found[key]):
                    return found[key]
            if time.monotonic() > deadline:
                have = ", ".join(str(n) for n in sorted(found)) or "none"
                raise FabricsError(errno.ENOENT, f"{self.name} ({self.subnqn}) has no namespace "
                                   f"{nsid if nsid is not None else ''} (found: {have})".replace(
                                       "namespace  (", "namespace ("))
            time.sleep(0.05)

    def to_json(self) -> dict[str, object]:
        addr, port = self.traddr()
        return {"controller": self.name, "device": self.device, "transport": self.transport,
                "subnqn": self.subnqn, "traddr": addr, "trsvcid": port,
                "namespaces": {str(k): v for k, v in sorted(self.namespaces().items())}}


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def controllers() -> list[KernelController]:
    """Every fabrics controller (TCP, RDMA) the kernel host holds now."""
    out = []
    with contextlib.suppress(OSError):
        for d in sorted(SYSFS.iterdir(), key=lambda p: p.name):
            transport = _read(d / "transport")
            if transport in TRANSPORTS:
                out.append(KernelController(d.name, transport, _read(d / "subsysnqn"),
                                            _read(d / "address")))
    return out


def controller(name: str) -> KernelController:
    """The fabrics controller ``name`` (``nvme3`` or ``/dev/nvme3``); FabricsError if none."""
    name = os.path.basename(name)
    for c in controllers():
        if c.name == name:
            return c
    raise FabricsError(errno.ENODEV, f"no NVMe-oF controller {name} on this host")


def find(transport: str, traddr: str, trsvcid: int, subnqn: str) -> list[KernelController]:
    """Controllers already connected to that subsystem through that address."""
    return [c for c in controllers()
            if c.transport == transport and c.subnqn == subnqn and c.traddr() == (traddr, trsvcid)]


def _fabrics_available() -> None:
    if not os.path.exists(FABRICS_DEV):
        raise FabricsError(errno.ENOENT, f"{FABRICS_DEV} is missing: load the kernel's NVMe-oF "
                           "host (modprobe nvme-rdma / nvme-tcp)")


def connect(opts: ConnectOptions) -> KernelController:
    """Add a controller (``nvme connect``); returns it once the kernel answered."""
    _fabrics_available()
    line = opts.option_string()
    try:
        fd = os.open(FABRICS_DEV, os.O_RDWR)
    except OSError as exc:
        raise FabricsError(exc.errno, f"cannot open {FABRICS_DEV}: {exc.strerror}") from None
    try:
        try:
            os.write(fd, line.encode())
        except OSError as exc:
            hint = _ERRNO_HINT.get(exc.errno or 0, exc.strerror or "")
            raise FabricsError(exc.errno, f"the kernel refused to connect to {opts.subnqn} at "
                               f"{opts.transport} {opts.traddr}:{opts.trsvcid}: "
                               f"{os.strerror(exc.errno or 0)} ({hint})") from None
        answer = os.read(fd, 4096).decode(errors="replace")
    finally:
        os.close(fd)
    m = re.search(r"instance=(\d+)", answer)
    if m is None:
        raise FabricsError(errno.EPROTO, f"unexpected answer from {FABRICS_DEV}: {answer!r}")
    name = f"nvme{m.group(1)}"
    deadline = time.monotonic() + 5
    while not (SYSFS / name / "transport").exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    return KernelController(name, opts.transport, opts.subnqn,
                            _read(SYSFS / name / "address")
                            or f"traddr={opts.traddr},trsvcid={opts.trsvcid}")


def disconnect(name: str, timeout: float = 30.0) -> None:
    """Delete controller ``name`` (``nvme disconnect -d``), waiting until it is gone."""
    ctrl = controller(name)
    try:
        (ctrl.sysfs / "delete_controller").write_text("1")
    except OSError as exc:
        if exc.errno != errno.ENOENT:
            raise FabricsError(exc.errno, f"cannot delete {ctrl.name}: {exc.strerror}") from None
    deadline = time.monotonic() + timeout
    while ctrl.sysfs.exists():
        if time.monotonic() > deadline:
            raise FabricsError(errno.EBUSY, f"{ctrl.name} is still there {timeout:.0f} s after "
                               "delete_controller")
        time.sleep(0.05)


@contextlib.contextmanager
def connected(opts: ConnectOptions) -> Iterator[KernelController]:
    ctrl = connect(opts)
    try:
        yield ctrl
    finally:
        with contextlib.suppress(FabricsError):
            disconnect(ctrl.name)


def _get_log_page(fd: int, lid: int, length: int, offset: int = 0) -> bytes:
    buf = bytearray(length)
    addr = ctypes.addressof((ctypes.c_char * length).from_buffer(buf))
    numd = length // 4 - 1
    cmd = bytearray(_PASSTHRU.pack(
        0x02, 0, 0, 0, 0, 0, 0, addr, 0, length,
        lid | ((numd & 0xFFFF) << 16), numd >> 16, offset & 0xFFFFFFFF, offset >> 32, 0, 0,
        0, 0))
    try:
        rc = fcntl.ioctl(fd, NVME_IOCTL_ADMIN_CMD, cmd)
    except OSError as exc:
        raise FabricsError(exc.errno, f"Get Log Page {lid:#x} failed: {exc.strerror}") from None
    if rc:
        raise FabricsError(errno.EIO, f"Get Log Page {lid:#x}: NVMe status {rc:#x}")
    return bytes(buf)


def discovery_log(ctrl: KernelController) -> list[DiscoveryEntry]:
    """Log page 0x70 of a connected discovery controller, read until GENCTR is stable."""
    fd = os.open(ctrl.device, os.O_RDWR)
    try:
        for _ in range(10):
            head = _get_log_page(fd, spec.LID_DISCOVERY, spec.DISCOVERY_LOG_HEADER)
            genctr, numrec = spec.decode_discovery_header(head)
            numrec = min(numrec, 1024)
            full = _get_log_page(fd, spec.LID_DISCOVERY,
                                 spec.DISCOVERY_LOG_HEADER + numrec * spec.DISCOVERY_LOG_ENTRY)
            again, _ = spec.decode_discovery_header(
                _get_log_page(fd, spec.LID_DISCOVERY, spec.DISCOVERY_LOG_HEADER))
            if again == genctr:
                base = spec.DISCOVERY_LOG_HEADER
                size = spec.DISCOVERY_LOG_ENTRY
                return [DiscoveryEntry.decode(full[base + i * size: base + (i + 1) * size])
                        for i in range(numrec)]
    finally:
        os.close(fd)
    raise FabricsError(errno.EAGAIN, "discovery log kept changing (GENCTR unstable)")


def discover(transport: str, traddr: str, trsvcid: int, hostnqn: str,
             hostid: str | None = None) -> list[DiscoveryEntry]:
    """``nvme discover``: the discovery log of the discovery controller at that address."""
    opts = ConnectOptions(transport, traddr, trsvcid, spec.DISCOVERY_NQN, hostnqn,
                          hostid or hostid_text(hostnqn), ctrl_loss_tmo=None,
                          reconnect_delay=None)
    with connected(opts) as ctrl:
        return discovery_log(ctrl)
