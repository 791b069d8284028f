"""The desired state of an NVMe-oF target, independent of the backend that realises it.

One :class:`TargetConfig` describes subsystems (each with namespaces and allowed hosts),
listeners (transport, address, port and the subsystems reachable there), optional per-host
secrets and optional transport tuning. Backends translate it into their own objects
(configfs directories for ``nvmet``, JSON-RPC calls for ``spdk``, a process for the
emulator's userspace runtime).

Invariants (enforced by :mod:`kvtool.target.loader`, relied on by every backend):

* subsystem NQNs are unique and well formed; NSIDs are unique within a subsystem;
* every listener names existing subsystems; no two listeners share (transport, address, port);
* a subsystem either allows any host or lists its hosts (it may list none: nobody connects);
* ``Namespace.backing`` decides which of ``path``/``size``/``nvme`` are set.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from kvtool.target.runtimes import CHOICES

BackendName = Literal["nvmet", "spdk", "emulator"]
Backing = Literal["memory", "file", "block", "nvme"]

BACKENDS: tuple[str, ...] = ("nvmet", "spdk", "emulator")
RUNTIMES: tuple[str, ...] = CHOICES  # the registry's (kvtool.target.runtimes)
BACKINGS: tuple[str, ...] = ("memory", "file", "block", "nvme")
TRANSPORTS: tuple[str, ...] = ("tcp", "rdma")
DEFAULT_PORT = 4420
ANA_GROUP_MAX = 128  # as Linux nvmet (NVMET_MAX_ANAGRPS)
ANA_STATES: tuple[str, ...] = ("optimized", "non-optimized", "inaccessible")


@dataclass(frozen=True)
class NvmeAttach:
    """An NVMe controller SPDK attaches to (``bdev_nvme_attach_controller``)."""

    trtype: str  # "PCIe" | "TCP" | "RDMA"
    traddr: str  # PCI BDF or IP
    adrfam: str | None = None
    trsvcid: str | None = None
    subnqn: str | None = None
    namespace: int = 1  # which namespace of that controller (bdev "<name>n<namespace>")


@dataclass(frozen=True)
class Namespace:
    nsid: int
    backing: Backing
    path: str | None = None  # file or block device (backing file/block)
    size: int | None = None  # bytes: memory size, or size of a file created with ``create``
    create: bool = False  # create the backing file (sparse) when it is missing
    lba: int | None = None  # LBA data size; None = what the backing gives (512 for memory)
    bdev_module: Literal["aio", "uring"] = "aio"  # SPDK module for file/block backing
    bdev_name: str | None = None  # SPDK bdev name; derived when None
    uuid: str | None = None
    nguid: str | None = None
    buffered_io: bool = False  # nvmet file backing: page cache instead of O_DIRECT
    nvme: NvmeAttach | None = None
    ana_group: int | None = None  # its ANA group (None: group 1)

    @property
    def group(self) -> int:
        return self.ana_group or 1

    @property
    def block_size(self) -> int:
        return self.lba or 512


@dataclass(frozen=True)
class Subsystem:
    nqn: str
    namespaces: tuple[Namespace, ...] = ()
    hosts: tuple[str, ...] = ()
    allow_any_host: bool = False
    serial: str | None = None
    model: str | None = None
    max_namespaces: int | None = None  # SPDK only

    def namespace(self, nsid: int) -> Namespace | None:
        return next((n for n in self.namespaces if n.nsid == nsid), None)


@dataclass(frozen=True)
class Listener:
    """One transport address. nvmet: a configfs port (``id``); SPDK: a listener per subsystem."""

    id: int
    transport: str  # "tcp" | "rdma"
    address: str
    port: int
    family: str  # "ipv4" | "ipv6"
    subsystems: tuple[str, ...]
    inline_data_size: int | None = None  # nvmet port param
    ana: tuple[tuple[int, str], ...] = ()  # ANA state per group here; groups not named: optimized

    def ana_state(self, group: int) -> str:
        return dict(self.ana).get(group, "optimized")


@dataclass(frozen=True)
class Host:
    """A host NQN and, for DH-HMAC-CHAP, its key files (never the secrets themselves)."""

    nqn: str
    dhchap_key_file: str | None = None  # the host proves this secret (DHHC-1, mode 0600)
    dhchap_ctrl_key_file: str | None = None  # set: the controller proves this one too
    dhchap_hashes: tuple[str, ...] = ()  # allowed, preferred first ("sha256"...); () = default
    dhchap_dhgroups: tuple[str, ...] = ()  # allowed ("null", "ffdhe2048"...); () = default

    @property
    def key_files(self) -> tuple[str, ...]:
        return tuple(f for f in (self.dhchap_key_file, self.dhchap_ctrl_key_file) if f)


@dataclass(frozen=True)
class Transport:
    """Transport tuning (SPDK ``nvmf_create_transport``; nvmet maps ``in_capsule_data_size``)."""

    type: str
    io_unit_size: int | None = None
    in_capsule_data_size: int | None = None
    max_io_size: int | None = None
    max_queue_depth: int | None = None
    max_io_qpairs_per_ctrlr: int | None = None


MAX_BUSY_POLL_US = 1_000_000  # python -m emulator.nvmetcp --busy-poll's range


@dataclass(frozen=True)
class TargetConfig:
    name: str
    backend: BackendName
    subsystems: tuple[Subsystem, ...]
    listeners: tuple[Listener, ...]
    hosts: tuple[Host, ...] = ()
    transports: tuple[Transport, ...] = ()
    runtime: str = "auto"  # one of RUNTIMES (the registry: kvtool.target.runtimes)
    metrics_port: int | None = None  # the userspace runtime's Prometheus port (0: any free)
    busy_poll_us: int | None = None  # the userspace runtime's event-loop polling (None: its own)
    nvmet_root: str | None = None
    spdk_socket: str | None = None
    spdk_timeout: float = 60.0
    # [spdk] start = true: kvtool starts nvmf_tgt itself (and stops it on down), binding the
    # config's PCIe controllers to spdk_pci_driver first and giving them back afterwards
    spdk_start: bool = False
    spdk_mem_mb: int | None = None  # its DPDK memory without hugepages (-s); None: 1024
    spdk_cpumask: str | None = None  # its reactor cores (-m); None: 0x1
    spdk_pci_driver: str = "vfio-pci"
    source: str | None = None  # the file it came from, for messages
    locator: Any = field(default=None, compare=False, repr=False)  # kvtool.configfile.Locator

    def subsystem(self, nqn: str) -> Subsystem | None:
        return next((s for s in self.subsystems if s.nqn == nqn), None)

    def host(self, nqn: str) -> Host | None:
        return next((h for h in self.hosts if h.nqn == nqn), None)

    def all_host_nqns(self) -> list[str]:
        """Every host NQN the config mentions (allowed hosts and [[host]] entries), sorted."""
        names = {h.nqn for h in self.hosts}
        for s in self.subsystems:
            names.update(s.hosts)
        return sorted(names)

    def listeners_of(self, nqn: str) -> list[Listener]:
        return [lst for lst in self.listeners if nqn in lst.subsystems]

    def ana_groups(self) -> list[int]:
        """The ANA groups the namespaces are in, sorted."""
        return sorted({n.group for s in self.subsystems for n in s.namespaces})

    def has_ana(self) -> bool:
        """The config says something about ANA (a group other than 1, or a listener state)."""
        return any(lst.ana for lst in self.listeners) or self.ana_groups() not in ([], [1]) \
            or any(n.ana_group is not None for s in self.subsystems for n in s.namespaces)

    def pci_controllers(self) -> list[str]:
        """PCI addresses of the PCIe NVMe controllers the namespaces attach (SPDK), in order."""
        out: list[str] = []
        for s in self.subsystems:
            for n in s.namespaces:
                if n.nvme is not None and n.nvme.trtype == "PCIe" and n.nvme.traddr not in out:
                    out.append(n.nvme.traddr)
        return out

    def transport(self, trtype: str) -> Transport | None:
        return next((t for t in self.transports if t.type == trtype), None)

    def to_dict(self) -> dict[str, Any]:
        """The config as plain data (no source/locator); stable across runs."""
        d = asdict(self)
        d.pop("locator", None)
        d.pop("source", None)
        for key in ("metrics_port", "busy_poll_us", "spdk_mem_mb", "spdk_cpumask"):
            if d[key] is None:
                del d[key]  # digests of configs without it stay as they were
        if not d["spdk_start"]:
            del d["spdk_start"], d["spdk_pci_driver"]
        for sub in d["subsystems"]:
            for ns in sub["namespaces"]:
                if ns["ana_group"] is None:
                    del ns["ana_group"]
        for lst in d["listeners"]:
            if not lst["ana"]:
                del lst["ana"]
        return d

    def digest(self) -> str:
        """SHA-256 of the desired state: equal digests mean nothing to change.

        A key file rewritten in place (key rotation) changes it too: its inode, size and
        mtime are part of the state (not its content: no secret reaches the state file).
        """
        doc = self.to_dict()
        doc["key_file_stamps"] = [_stamp(f) for h in self.hosts for f in h.key_files]
        text = json.dumps(doc, sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()

    def host_keys(self) -> list[Host]:
        """The [[host]] entries with DH-HMAC-CHAP keys."""
        return [h for h in self.hosts if h.dhchap_key_file]

    def where(self, *path: str | int) -> tuple[str | None, int | None]:
        """(file, line) of a key path such as ("subsystem", 0, "namespace", 1, "nsid")."""
        line = self.locator.line(path) if self.locator is not None else None
        return self.source, line


def _stamp(path: str) -> list[int]:
    try:
        st = os.stat(path)
    except OSError:
        return []
    return [st.st_ino, st.st_size, st.st_mtime_ns]
