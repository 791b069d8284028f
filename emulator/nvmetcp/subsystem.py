"""The target's subsystems, their namespaces and controllers (event-loop confined).

Mirrors the kernel's nvmet: a subsystem has namespaces and an allowed-host list; a host's
admin-queue Connect creates a controller (dynamic CNTLID) which owns the I/O queues
connected with that CNTLID; losing the admin queue, a keep-alive timeout, or target
shutdown deletes the controller and closes its queues.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from emulator.nvmetcp.backing import Backing, open_backing
from emulator.nvmetcp.config import EmulatorConfig, SubsystemConfig
from emulator.nvmetcp.logpages import ERROR_LOG_SLOTS, ErrorEntry, SmartCounters
from kvtool.errors import InputError
from kvtool.nvme import spec

_UUID_NS = uuid.UUID("6a7e8f52-1c2d-4b1e-9a51-6b7674616b76")


@dataclass
class Namespace:
    nsid: int
    backing: Backing
    lba_size: int
    subnqn: str
    smart: SmartCounters = field(default_factory=SmartCounters)
    anagrpid: int = 1

    def count_read(self, nbytes: int) -> None:
        s = self.smart
        s.bytes_read += nbytes
        s.reads += 1

    def count_write(self, nbytes: int) -> None:
        s = self.smart
        s.bytes_written += nbytes
        s.writes += 1

    @property
    def nblocks(self) -> int:
        return self.backing.size // self.lba_size

    def identify(self) -> bytes:
        return spec.NamespaceInfo(self.nsid, self.nblocks, self.nblocks, self.nblocks,
                                  self.lba_size, self.uuid.bytes, self.uuid.bytes[:8],
                                  spec.DLFEAT_READS_ZERO | spec.DLFEAT_WZ_DEALLOCATE,
                                  self.anagrpid).encode()

    @property
    def uuid(self) -> uuid.UUID:
        """Stable across restarts: derived from the subsystem NQN and NSID."""
        return uuid.uuid5(_UUID_NS, f"{self.subnqn}/{self.nsid}")


class Controller:
    """One host's controller on a subsystem; ``queues`` maps qid → connection."""

    def __init__(self, subsys: Subsystem, cntlid: int, hostnqn: str, hostid: bytes,
                 kato_ms: int) -> None:
        self.subsys = subsys
        self.cntlid = cntlid
        self.hostnqn = hostnqn
        self.hostid = hostid
        self.kato_ms = kato_ms
        self.cc = 0
        self.csts = 0
        # Every notice this target raises is enabled until the host says otherwise, as
        # Linux nvmet and SPDK do (docs/nvme-tcp.md, the sweep); a discovery controller
        # raises none.
        self.aec = 0 if subsys.is_discovery else spec.AEN_CFG_NS_ATTR | spec.AEN_CFG_ANA_CHANGE
        self.features: dict[int, int] = {}  # Set Features values of the plain features (admin)
        self.queues: dict[int, Closable] = {}
        self.errors: list[ErrorEntry] = []  # the newest ERROR_LOG_SLOTS failed commands
        self.error_count = 0
        self.changed_ns: set[int] = set()
        self.events: list[int] = []  # asynchronous events waiting for an AER (CQE DW0)
        self.masked_events: set[int] = set()  # log pages whose event waits to be read
        self.notify: Callable[[], None] | None = None  # the admin queue delivers events
        self.port: tuple[str, int] | None = None  # the listener its admin queue came through
        self.last_seen = time.monotonic()
        self._timer: asyncio.TimerHandle | None = None
        self.deleted = False

    @property
    def ready(self) -> bool:
        return bool(self.csts & spec.CSTS_RDY)

    def touch(self) -> None:
        self.last_seen = time.monotonic()

    def record_error(self, sqid: int, cid: int, st: int, nsid: int, lba: int = 0,
                     location: int = 0xFFFF) -> None:
        self.error_count += 1
        self.errors.append(ErrorEntry(self.error_count, sqid, cid, st, location, lba, nsid))
        if len(self.errors) > ERROR_LOG_SLOTS:
            del self.errors[0]

    def namespace_changed(self, nsid: int) -> None:
        """Note ``nsid`` in the Changed Namespace List; raise the notice if the host asked
        for it and has not yet an unread one (the Linux target's rule)."""
        self.changed_ns.add(nsid)
        if not self.aec & spec.AEN_CFG_NS_ATTR or spec.LID_CHANGED_NS in self.masked_events:
            return
        self.masked_events.add(spec.LID_CHANGED_NS)
        self.events.append((spec.LID_CHANGED_NS << 16) | (spec.AER_NOTICE_NS_CHANGED << 8)
                           | spec.AER_TYPE_NOTICE)
        if self.notify is not None:
            self.notify()

    def ana_changed(self) -> None:
        """An ANA state changed on this controller's port: raise the ANA Change notice if
        the host enabled it and has no unread one (Linux nvmet's rule)."""
        if not self.aec & spec.AEN_CFG_ANA_CHANGE or spec.LID_ANA in self.masked_events:
            return
        self.masked_events.add(spec.LID_ANA)
        self.events.append((spec.LID_ANA << 16) | (spec.AER_NOTICE_ANA_CHANGE << 8)
                           | spec.AER_TYPE_NOTICE)
        if self.notify is not None:
            self.notify()

    def set_cc(self, new: int) -> None:
        """Property Set CC, with the kernel's transitions (nvmet_update_cc)."""
        old = self.cc
        self.cc = new
        if new & spec.CC_EN and not old & spec.CC_EN:
            self._start()
        if not new & spec.CC_EN and old & spec.CC_EN:
            self._clear()
        if new & spec.CC_SHN_MASK and not old & spec.CC_SHN_MASK:
            for ns in self.subsys.namespaces.values():
                ns.backing.flush()
            self._clear()
            self.csts |= spec.CSTS_SHST_COMPLETE
        if not new & spec.CC_SHN_MASK and old & spec.CC_SHN_MASK:
            self.csts &= ~spec.CSTS_SHST_COMPLETE

    def _start(self) -> None:
        cc = self.cc
        iosqes, iocqes = (cc >> 16) & 0xF, (cc >> 20) & 0xF
        mps, ams, css = (cc >> 7) & 0xF, (cc >> 11) & 0x7, (cc >> 4) & 0x7
        bad_qes = not self.subsys.is_discovery and (iosqes != 6 or iocqes != 4)
        if bad_qes or mps != 0 or ams != 0 or css != 0:
            self.csts = spec.CSTS_CFS
            return
        self.csts = spec.CSTS_RDY

    def _clear(self) -> None:
        self.csts &= ~spec.CSTS_RDY
        self.cc = 0

    def arm_keep_alive(self, loop: asyncio.AbstractEventLoop, grace_s: float) -> None:
        """(Re)start the keep-alive watchdog; KATO 0 on a discovery controller means 120 s."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        kato = self.kato_ms / 1000.0
        if kato <= 0 and self.subsys.is_discovery:
            kato = 120.0
        if kato <= 0:
            return
        limit = kato + grace_s

        def check() -> None:
            self._timer = None
            if self.deleted:
                return
            idle = time.monotonic() - self.last_seen
            if idle >= limit:
                self.subsys.delete_controller(self, reason=f"keep-alive timeout ({kato:g} s)")
            else:
                self._timer = loop.call_later(limit - idle, check)

        self._timer = loop.call_later(limit, check)

    def cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


class Closable(Protocol):
    """What a controller needs from a queue connection."""

    def close(self, reason: str) -> None: ...


@dataclass
class Subsystem:
    nqn: str
    serial: str
    model: str
    namespaces: dict[int, Namespace] = field(default_factory=dict)
    hosts: set[str] = field(default_factory=set)
    allow_any_host: bool = False
    is_discovery: bool = False
    controllers: dict[int, Controller] = field(default_factory=dict)
    next_cntlid: int = 1
    on_delete: Callable[[Controller, str], None] | None = None

    def host_allowed(self, hostnqn: str) -> bool:
        return self.is_discovery or self.allow_any_host or hostnqn in self.hosts

    def new_controller(self, hostnqn: str, hostid: bytes, kato_ms: int) -> Controller:
        for _ in range(0xFFEF):
            cntlid = self.next_cntlid
            self.next_cntlid = 1 if cntlid >= 0xFFEF else cntlid + 1
            if cntlid not in self.controllers:
                ctrl = Controller(self, cntlid, hostnqn, hostid, kato_ms)
                self.controllers[cntlid] = ctrl
                return ctrl
        raise RuntimeError("no free controller ID")

    def namespaces_changed(self, nsid: int) -> None:
        for ctrl in list(self.controllers.values()):
            ctrl.namespace_changed(nsid)

    def delete_controller(self, ctrl: Controller, *, reason: str) -> None:
        if ctrl.deleted:
            return
        ctrl.deleted = True
        ctrl.cancel_timer()
        self.controllers.pop(ctrl.cntlid, None)
        for conn in list(ctrl.queues.values()):
            conn.close(reason)
        ctrl.queues.clear()
        if self.on_delete is not None:
            self.on_delete(ctrl, reason)


def _serial(nqn: str) -> str:
    return uuid.uuid5(_UUID_NS, nqn).hex[:20]


def build_subsystems(config: EmulatorConfig) -> dict[str, Subsystem]:
    """Open every namespace's backing; on failure close the ones already opened."""
    subs: dict[str, Subsystem] = {}
    opened: list[Backing] = []
    try:
        for i, scfg in enumerate(config.subsystems):
            subs[scfg.nqn] = _build_one(scfg, i, opened)
    except BaseException:
        for b in opened:
            b.close()
        raise
    return subs


def _build_one(scfg: SubsystemConfig, index: int, opened: list[Backing]) -> Subsystem:
    sub = Subsystem(nqn=scfg.nqn, serial=scfg.serial or _serial(scfg.nqn), model=scfg.model,
                    hosts=set(scfg.hosts), allow_any_host=scfg.allow_any_host)
    for j, ncfg in enumerate(scfg.namespaces):
        backing = open_backing(ncfg.backing, size=ncfg.size,
                               field=f"subsystems[{index}].namespaces[{j}].backing")
        opened.append(backing)
        if backing.size < ncfg.lba_size:
            raise InputError(f"backing {ncfg.backing} is smaller than one "
                             f"{ncfg.lba_size}-byte block",
                             field=f"subsystems[{index}].namespaces[{j}].backing")
        sub.namespaces[ncfg.nsid] = Namespace(ncfg.nsid, backing, ncfg.lba_size, scfg.nqn,
                                              anagrpid=ncfg.anagrpid)
    return sub


def discovery_subsystem() -> Subsystem:
    return Subsystem(nqn=spec.DISCOVERY_NQN, serial=_serial(spec.DISCOVERY_NQN),
                     model="kvtool emulator discovery", is_discovery=True)
