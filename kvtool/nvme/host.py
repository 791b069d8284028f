"""kvtool's userspace NVMe/TCP host (initiator): controllers, discovery, block I/O.

``connect()`` follows the Linux host's sequence: admin queue (ICReq → Fabrics Connect
qid 0 with CNTLID 0xFFFF) → Property Get CAP/VS → Property Set CC.EN → wait CSTS.RDY →
Identify Controller → Set Features Number of Queues → one TCP connection per I/O queue
(ICReq → Connect qid N with the CNTLID). A keep-alive thread sends Keep Alive every
KATO/2. ``close()`` sets CC.SHN, waits for CSTS.SHST = complete and closes the sockets.

I/O queues are interrupt-driven (a reader thread each) unless ``poll=True``: then each
I/O queue is polled — the thread that waits for a command receives its completion itself,
busy-polling briefly (:mod:`kvtool.nvme.queue`), like the Linux host's poll queues and
SPDK's host. The admin queue is always interrupt-driven (keep-alive, shutdown).

Reconnect: when a queue's connection fails (target restart, reset, timeout) a read, write
or flush re-establishes the whole controller (retrying for ``reconnect`` seconds) and then
re-issues the command; reads and writes are idempotent, so a retried write is safe. A
write returns only after the target acknowledged it; if the controller cannot be
re-established in time the call raises :class:`TransportError` — never a silent loss.
"""

from __future__ import annotations

import itertools
import logging
import struct
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from types import TracebackType

from kvtool.nvme import dhchap, spec
from kvtool.nvme import pdu as P
from kvtool.nvme.hostauth import AuthenticationError, HostCredentials, authenticate
from kvtool.nvme.queue import (
    DEFAULT_SPIN,
    Command,
    HostQueue,
    NvmeStatusError,
    RwRequest,
    TransportError,
)
from kvtool.nvme.spec import ControllerInfo, DiscoveryEntry, NamespaceInfo
from kvtool.nvme.url import default_hostnqn, hostid_for

log = logging.getLogger("kvtool.nvme")

ADMIN_QUEUE_DEPTH = 32  # sqsize 31, as the Linux host
DEFAULT_KATO_MS = 10_000

__all__ = [
    "AuthenticationError",
    "ConnectError",
    "Controller",
    "DiscoveryEntry",
    "HostCredentials",
    "NamespaceInfo",
    "NvmeStatusError",
    "TransportError",
    "connect",
    "discover",
]


class ConnectError(NvmeStatusError):
    """Fabrics Connect was refused (unknown subsystem, host not allowed, bad parameters)."""

    def __init__(self, message: str, cqe: P.Cqe) -> None:
        super().__init__("Connect", cqe)
        self.args = (self.errno, message)
        self.strerror = message

    def __str__(self) -> str:
        return str(self.strerror)


class Controller:
    """A connected NVMe-oF controller (admin queue + I/O queues). Thread-safe.

    Use :func:`connect` to make one. It is a context manager; ``close()`` is idempotent.
    """

    def __init__(self, host: str, port: int, subnqn: str, *, hostnqn: str | None = None,
                 io_queues: int = 1, queue_depth: int = 32, header_digest: bool = False,
                 data_digest: bool = False, timeout: float = 10.0,
                 kato_ms: int = DEFAULT_KATO_MS, reconnect: float = 10.0,
                 disable_sqflow: bool = False, dhchap_secret: dhchap.Secret | None = None,
                 dhchap_ctrl_secret: dhchap.Secret | None = None, poll: bool = False,
                 spin: float = DEFAULT_SPIN) -> None:
        if io_queues < 0 or queue_depth < 2:
            raise ValueError("io_queues must be ≥ 0 and queue_depth ≥ 2")
        self.host, self.port, self.subnqn = host, port, subnqn
        self.hostnqn = hostnqn or default_hostnqn()
        self.hostid = hostid_for(self.hostnqn)
        self.want_io_queues = 0 if subnqn == spec.DISCOVERY_NQN else io_queues
        self.want_depth = queue_depth
        self.header_digest, self.data_digest = header_digest, data_digest
        self.timeout = timeout
        self.kato_ms = 0 if subnqn == spec.DISCOVERY_NQN else kato_ms
        self.reconnect = reconnect
        self.disable_sqflow = disable_sqflow
        self.poll, self.spin = poll, spin
        self._secret, self._ctrl_secret = dhchap_secret, dhchap_ctrl_secret
        self._tid = int.from_bytes(self.hostid[:2], "little")
        self.authenticated = False
        self.admin: HostQueue | None = None
        self.io: list[HostQueue] = []
        self.cntlid = 0
        self.cap = 0
        self.vs = 0
        self.info: ControllerInfo | None = None
        self.generation = 0
        self.reconnects = 0
        self._rr = itertools.count()
        self._ns_cache: dict[int, NamespaceInfo] = {}
        self._reconnect_lock = threading.Lock()
        self._closed = False
        self._ka_stop = threading.Event()
        self._ka_thread: threading.Thread | None = None
        self._establish()
        self._start_keep_alive()

    # --- bring-up -----------------------------------------------------------------------

    def _establish(self) -> None:
        queues: list[HostQueue] = []
        try:
            admin = HostQueue(self.host, self.port, qid=0, depth=ADMIN_QUEUE_DEPTH,
                              hdgst=self.header_digest, ddgst=self.data_digest,
                              timeout=self.timeout)
            queues.append(admin)
            cntlid = self._fabrics_connect(admin, 0, ADMIN_QUEUE_DEPTH - 1, 0xFFFF)
            cap = self._prop_get(admin, spec.PROP_CAP, eight=True)
            vs = self._prop_get(admin, spec.PROP_VS)
            self._prop_set(admin, spec.PROP_CC, spec.CC_DEFAULT_ENABLE)
            self._wait_csts(admin, spec.CSTS_RDY, spec.CSTS_RDY,
                            max(1.0, spec.cap_timeout_s(cap)), "CSTS.RDY")
            raw = self._identify(admin, spec.CNS_CONTROLLER, 0)
            info = ControllerInfo.decode(raw)
            if info.cntlid != cntlid:
                log.warning("Identify CNTLID %d differs from Connect's %d", info.cntlid, cntlid)
            io: list[HostQueue] = []
            if self.want_io_queues:
                want = self.want_io_queues - 1
                cqe = admin.execute(P.Sqe(spec.ADMIN_SET_FEATURES,
                                          cdw10=spec.FID_NUMBER_OF_QUEUES,
                                          cdw11=(want << 16) | want),
                                    what="Set Features (Number of Queues)")
                granted = min(cqe.dw0 & 0xFFFF, cqe.dw0 >> 16) + 1
                depth = min(self.want_depth, spec.cap_mqes(cap) + 1, info.maxcmd or 0xFFFF)
                for qid in range(1, min(self.want_io_queues, granted) + 1):
                    q = HostQueue(self.host, self.port, qid=qid, depth=depth,
                                  hdgst=self.header_digest, ddgst=self.data_digest,
                                  timeout=self.timeout, poll=self.poll, spin=self.spin)
                    queues.append(q)
                    q.in_capsule_max = info.io_in_capsule_max
                    self._fabrics_connect(q, qid, depth - 1, cntlid)
                    io.append(q)
        except BaseException:
            for q in queues:
                q.close()
            raise
        self.admin, self.io = admin, io
        self.cntlid, self.cap, self.vs, self.info = cntlid, cap, vs, info
        self.generation += 1

    def _fabrics_connect(self, q: HostQueue, qid: int, sqsize: int, cntlid: int) -> int:
        data = spec.ConnectData(self.hostid, cntlid, self.subnqn, self.hostnqn).encode()
        cattr = spec.CATTR_DISABLE_SQ_FLOW if self.disable_sqflow else 0
        sqe = P.Sqe(spec.OPC_FABRICS, nsid=spec.FCTYPE_CONNECT, cdw10=qid << 16,
                    cdw11=sqsize | (cattr << 16), cdw12=self.kato_ms if qid == 0 else 0)
        cmd = q.submit(sqe, what="Connect", data_out=memoryview(data),
                       in_capsule_max=spec.ADMIN_IN_CAPSULE_MAX)
        try:
            cqe = q.wait(cmd)
        except NvmeStatusError as exc:
            raise self._connect_error(exc.cqe) from None
        self._authenticate(q, cqe.dw0)
        return cqe.dw0 & 0xFFFF

    def _authenticate(self, q: HostQueue, result: int) -> None:
        """DH-HMAC-CHAP on ``q`` when the Connect result asks for it (AUTHREQ.ATR)."""
        where = f"{self.host}:{self.port} ({self.subnqn})"
        if result & dhchap.CONNECT_ASCR:
            raise AuthenticationError("host", f"DH-HMAC-CHAP: the target at {where} requires a "
                                      "secure channel (TLS concatenation), which kvtool does "
                                      "not support")
        if not result & dhchap.CONNECT_ATR:
            if self._ctrl_secret is not None:
                raise AuthenticationError("controller", f"DH-HMAC-CHAP: the target at {where} "
                                          "did not ask for authentication, so the controller "
                                          "cannot be verified (dhchap_ctrl_secret given)")
            return
        if self._secret is None:
            raise AuthenticationError("host", f"DH-HMAC-CHAP: the target at {where} requires "
                                      f"authentication of host {self.hostnqn}, but no "
                                      "dhchap_secret was given")
        self._tid = (self._tid + 1) & 0xFFFF
        authenticate(q, hostnqn=self.hostnqn, subnqn=self.subnqn, secret=self._secret,
                     ctrl_secret=self._ctrl_secret, tid=self._tid, where=where)
        if q.qid == 0:
            self.authenticated = True

    def _connect_error(self, cqe: P.Cqe) -> ConnectError:
        where = f"{self.host}:{self.port}"
        ipo, in_data = cqe.dw0 & 0xFFFF, bool(cqe.dw0 & (1 << 16))
        if cqe.sct == 1 and cqe.sc == spec.SC_CONNECT_INVALID_HOST:
            msg = f"host NQN {self.hostnqn} is not allowed to connect to {self.subnqn} at {where}"
        elif cqe.sct == 1 and cqe.sc == spec.SC_CONNECT_INVALID_PARAM and in_data and ipo == 256:
            msg = f"subsystem {self.subnqn} does not exist at {where}"
        else:
            msg = (f"Connect to {self.subnqn} at {where} refused: "
                   f"{spec.status_name(cqe.sct, cqe.sc)} (IPO {ipo}"
                   f"{' in connect data' if in_data else ''})")
        return ConnectError(msg, cqe)

    def _prop_get(self, q: HostQueue, offset: int, *, eight: bool = False) -> int:
        sqe = P.Sqe(spec.OPC_FABRICS, nsid=spec.FCTYPE_PROPERTY_GET, cdw10=1 if eight else 0,
                    cdw11=offset)
        cqe = q.execute(sqe, what=f"Property Get {offset:#x}")
        return cqe.result64 if eight else cqe.dw0

    def _prop_set(self, q: HostQueue, offset: int, value: int) -> None:
        sqe = P.Sqe(spec.OPC_FABRICS, nsid=spec.FCTYPE_PROPERTY_SET, cdw10=0, cdw11=offset,
                    cdw12=value & 0xFFFFFFFF, cdw13=value >> 32)
        q.execute(sqe, what=f"Property Set {offset:#x}")

    def _wait_csts(self, q: HostQueue, mask: int, want: int, limit: float, what: str) -> None:
        deadline = time.monotonic() + limit
        delay = 0.001
        while True:
            csts = self._prop_get(q, spec.PROP_CSTS)
            if csts & spec.CSTS_CFS:
                raise TransportError(f"controller fatal status (CSTS.CFS) waiting for {what}")
            if csts & mask == want:
                return
            if time.monotonic() > deadline:
                raise TransportError(f"timed out after {limit:g} s waiting for {what}")
            time.sleep(delay)
            delay = min(delay * 2, 0.1)

    def _identify(self, q: HostQueue, cns: int, nsid: int, cdw11: int = 0) -> bytes:
        buf = bytearray(spec.IDENTIFY_DATA_LEN)
        q.execute(P.Sqe(spec.ADMIN_IDENTIFY, nsid=nsid, cdw10=cns, cdw11=cdw11),
                  what=f"Identify (CNS {cns:#x})", data_in=memoryview(buf))
        return bytes(buf)

    # --- keep-alive and reconnect -------------------------------------------------------------

    def _start_keep_alive(self) -> None:
        if self.kato_ms <= 0:
            return
        self._ka_thread = threading.Thread(target=self._keep_alive, daemon=True,
                                           name="nvme-keepalive")
        self._ka_thread.start()

    def stop_keep_alive(self) -> None:
        """Send no more Keep Alive commands, for the rest of this controller's life: the
        target drops the controller once KATO passes in silence, and the next command
        reconnects (what a host that stalls looks like to the target)."""
        self._ka_stop.set()

    def _keep_alive(self) -> None:
        interval = self.kato_ms / 2000.0
        while not self._ka_stop.wait(interval):
            admin = self.admin
            if admin is None or admin.dead is not None:
                continue
            try:
                admin.execute(P.Sqe(spec.ADMIN_KEEP_ALIVE), what="Keep Alive")
            except OSError as exc:
                log.warning("keep-alive failed: %s", exc)

    def _admin(self) -> HostQueue:
        self._check_open()
        admin = self.admin
        assert admin is not None
        if admin.dead is not None:
            self._recover(self.generation, admin.dead)
            admin = self.admin
            assert admin is not None
        return admin

    def _recover(self, generation: int, cause: BaseException) -> None:
        """Re-establish the controller unless another thread already did (``generation``)."""
        if self.reconnect <= 0:
            raise TransportError(f"connection to {self.subnqn} lost: {cause}") from None
        with self._reconnect_lock:
            self._check_open()
            if self.generation != generation:
                return
            log.warning("connection to %s lost (%s); reconnecting", self.subnqn, cause)
            for q in [*self.io, *([self.admin] if self.admin else [])]:
                q.close()
            deadline = time.monotonic() + self.reconnect
            delay = 0.05
            last: BaseException = cause
            while time.monotonic() < deadline and not self._closed:
                try:
                    self._establish()
                except (ConnectError, AuthenticationError):
                    raise
                except (TransportError, NvmeStatusError, OSError) as exc:
                    last = exc
                    time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
                    delay = min(delay * 2, 0.5)
                    continue
                self.reconnects += 1
                log.warning("reconnected to %s (cntlid %d)", self.subnqn, self.cntlid)
                return
            raise TransportError(f"connection to {self.subnqn} at {self.host}:{self.port} "
                                 f"lost and not re-established in {self.reconnect:g} s: "
                                 f"{last}") from None

    def _check_open(self) -> None:
        if self._closed:
            raise TransportError("controller is closed")

    # --- admin commands ---------------------------------------------------------------

    def identify_controller(self) -> ControllerInfo:
        """Identify Controller (CNS 0x01), issued now."""
        info = ControllerInfo.decode(self._identify(self._admin(), spec.CNS_CONTROLLER, 0))
        self.info = info
        return info

    def active_namespaces(self) -> list[int]:
        """Active namespace IDs (Identify CNS 0x02), ascending."""
        out: list[int] = []
        start = 0
        while True:
            ids = spec.decode_ns_list(self._identify(self._admin(), spec.CNS_ACTIVE_NS_LIST,
                                                     start))
            out.extend(ids)
            if len(ids) < 1024:
                return out
            start = ids[-1]

    def identify_namespace(self, nsid: int) -> NamespaceInfo:
        """Identify Namespace (CNS 0x00); an inactive NSID gives ``nsze == 0``."""
        info = NamespaceInfo.decode(nsid, self._identify(self._admin(), spec.CNS_NAMESPACE,
                                                         nsid))
        if info.active:
            self._ns_cache[nsid] = info
        return info

    def namespace(self, nsid: int) -> NamespaceInfo:
        """Cached :meth:`identify_namespace`; raises ValueError for an inactive NSID."""
        info = self._ns_cache.get(nsid)
        if info is None:
            info = self.identify_namespace(nsid)
            if not info.active:
                raise ValueError(f"namespace {nsid} is not active on {self.subnqn}")
        return info

    def get_log_page(self, lid: int, length: int, offset: int = 0, nsid: int = 0,
                     lsp: int = 0) -> bytes:
        """Get Log Page ``lid``; ``lsp``: the log specific field (ANA: 1 = groups only)."""
        if length <= 0 or length % 4 or offset % 4:
            raise ValueError("log page length and offset must be positive multiples of 4")
        numd = length // 4 - 1
        buf = bytearray(length)
        self._admin().execute(
            P.Sqe(spec.ADMIN_GET_LOG_PAGE, nsid=nsid,
                  cdw10=lid | ((lsp & 0x7F) << 8) | ((numd & 0xFFFF) << 16),
                  cdw11=numd >> 16, cdw12=offset & 0xFFFFFFFF, cdw13=offset >> 32),
            what=f"Get Log Page {lid:#x}", data_in=memoryview(buf))
        return bytes(buf)

    def ana_log(self) -> tuple[int, list[spec.AnaGroup]]:
        """The ANA log page (0x0C): (change count, groups with their NSIDs) as seen through
        this controller; reading it re-arms the ANA Change notice."""
        info = self.info or self.identify_controller()
        length = 16 + 32 * min(info.nanagrpid or 1, 1024) + 4 * min(info.nn or 1, 1024)
        return spec.decode_ana_log(self.get_log_page(spec.LID_ANA, length))

    def set_features(self, fid: int, value: int) -> int:
        """Set Features ``fid`` to ``value`` (CDW11); returns the completion's DW0."""
        cqe = self._admin().execute(P.Sqe(spec.ADMIN_SET_FEATURES, cdw10=fid, cdw11=value),
                                    what=f"Set Features {fid:#x}")
        return int(cqe.dw0)

    def submit_admin(self, sqe: P.Sqe, what: str,
                     on_done: Callable[[Command], None]) -> Command:
        """Send an admin command without waiting (an Asynchronous Event Request);
        ``on_done`` runs on the queue's receiving thread: it must not wait for the queue."""
        return self._admin().submit(sqe, what=what, on_done=on_done)

    def smart_log(self, nsid: int = 0xFFFFFFFF) -> spec.SmartLog:
        """SMART / Health Information (log page 0x02): the controller's (all namespaces) or
        one namespace's I/O counters."""
        return spec.SmartLog.decode(self.get_log_page(spec.LID_SMART, spec.SMART_LOG_LEN,
                                                      nsid=nsid))

    def discovery_log(self) -> list[DiscoveryEntry]:
        """Get Log Page 0x70, re-read until GENCTR is stable (the Linux host's algorithm)."""
        for _ in range(10):
            head = self.get_log_page(spec.LID_DISCOVERY, spec.DISCOVERY_LOG_HEADER)
            genctr, numrec = spec.decode_discovery_header(head)
            numrec = min(numrec, 1024)
            full = self.get_log_page(spec.LID_DISCOVERY, spec.DISCOVERY_LOG_HEADER +
                                     numrec * spec.DISCOVERY_LOG_ENTRY)
            again, _ = spec.decode_discovery_header(
                self.get_log_page(spec.LID_DISCOVERY, spec.DISCOVERY_LOG_HEADER))
            if again == genctr:
                base = spec.DISCOVERY_LOG_HEADER
                return [DiscoveryEntry.decode(full[base + i * 1024: base + (i + 1) * 1024])
                        for i in range(numrec)]
        raise TransportError("discovery log kept changing (GENCTR unstable)")

    # --- I/O ----------------------------------------------------------------------------

    @property
    def max_transfer(self) -> int:
        """Largest data transfer of one command (MDTS; 1 MiB chunks when unlimited)."""
        info = self.info
        limit = info.max_transfer if info is not None else None
        return limit if limit is not None else 1 << 20

    def _queue(self) -> HostQueue:
        if not self.io:
            raise TransportError(f"{self.subnqn} has no I/O queues")
        return self.io[next(self._rr) % len(self.io)]

    def submit_io(self, opcode: int, nsid: int, slba: int, buf: memoryview, lba_size: int,
                  on_done: Callable[[Command], None] | None = None) -> tuple[HostQueue, Command]:
        """Submit one Read/Write (``len(buf)`` ≤ :attr:`max_transfer`) without waiting."""
        self._check_open()
        q = self._queue()
        return q, q.submit_rw(opcode, nsid, slba, len(buf) // lba_size, buf, on_done)

    def submit_split(self, opcode: int, nsid: int, offset: int, view: memoryview,
                     lba_size: int, done: Callable[[BaseException | None], None]) -> None:
        """Submit ``view`` at byte ``offset`` as Read/Write commands of at most
        :attr:`max_transfer` bytes, without waiting; ``done(error)`` runs once, when every
        piece has completed (``error``: the first piece's failure, else ``None``). A piece
        that cannot be sent counts as failed with the rest of the unsent ones."""
        self.submit_many(opcode, nsid, [(offset, view)], lba_size,
                         lambda _i, err: done(err))

    def submit_many(self, opcode: int, nsid: int, items: Sequence[tuple[int, memoryview]],
                    lba_size: int, done: Callable[[int, BaseException | None], None]) -> None:
        """:meth:`submit_split` for every ``(offset, view)`` of ``items``: ``done(i, error)``
        runs once per item. The commands go to the I/O queues in turns, each turn as many
        as the queue has free slots for, in one send (:meth:`HostQueue.submit_rw_many`);
        this waits only for free slots, never for completions."""
        chunk = max(lba_size, self.max_transfer // lba_size * lba_size)
        pending: deque[RwRequest] = deque()
        for i, (offset, view) in enumerate(items):
            size = len(view)
            if not size:
                done(i, None)
                continue
            base = offset // lba_size
            on_done = _piece_counter(i, -(-size // chunk), done)
            for off in range(0, size, chunk):
                piece = view[off: off + chunk]
                pending.append((base + off // lba_size, len(piece) // lba_size, piece, on_done))
        try:
            self._check_open()
            while pending:
                self._queue().submit_rw_many(opcode, nsid, pending)
        except OSError as exc:
            for _slba, _nlb, _piece, on_done in pending:
                on_done(_failed(exc))

    def reap(self) -> int:
        """Polled I/O queues: process the completions that have arrived (callbacks run on
        this thread), without waiting; returns the PDUs processed. 0 for interrupt queues."""
        return sum(q.reap() for q in self.io)

    def _rw(self, opcode: int, nsid: int, slba: int, buf: memoryview) -> None:
        ns = self.namespace(nsid)
        lba = ns.lba_size
        if len(buf) % lba:
            raise ValueError(f"{len(buf)} bytes is not a multiple of the {lba}-byte block")
        if slba < 0 or slba + len(buf) // lba > ns.nsze:
            raise ValueError(f"LBA range {slba}+{len(buf) // lba} is outside namespace {nsid} "
                             f"({ns.nsze} blocks)")
        if not len(buf):
            return
        chunk = max(lba, self.max_transfer // lba * lba)
        while True:
            generation = self.generation
            try:
                pending = []
                for off in range(0, len(buf), chunk):
                    pending.append(self.submit_io(opcode, nsid, slba + off // lba,
                                                  buf[off: off + chunk], lba))
                for q, cmd in pending:
                    q.wait(cmd)
                return
            except TransportError as exc:
                if self._closed:
                    raise
                self._recover(generation, exc)

    def read_into(self, nsid: int, slba: int, buf: memoryview) -> None:
        self._rw(spec.IO_READ, nsid, slba, memoryview(buf).cast("B"))

    def read(self, nsid: int, slba: int, nlb: int) -> bytes:
        buf = bytearray(nlb * self.namespace(nsid).lba_size)
        self.read_into(nsid, slba, memoryview(buf))
        return bytes(buf)

    def write(self, nsid: int, slba: int, data: bytes | bytearray | memoryview) -> None:
        """Write whole blocks; returns once the target acknowledged every block."""
        self._rw(spec.IO_WRITE, nsid, slba, memoryview(data).cast("B"))

    def write_zeroes(self, nsid: int, slba: int, nlb: int) -> None:
        """Write Zeroes over ``nlb`` blocks (at most 65536 per command) from ``slba``."""
        if not 1 <= nlb <= 0x10000:
            raise ValueError("Write Zeroes covers 1..65536 blocks per command")
        self.execute_io(P.Sqe(spec.IO_WRITE_ZEROES, nsid=nsid, cdw10=slba & 0xFFFFFFFF,
                              cdw11=slba >> 32, cdw12=nlb - 1),
                        f"Write Zeroes nsid {nsid} lba {slba}+{nlb}")

    def deallocate(self, nsid: int, ranges: list[tuple[int, int]]) -> None:
        """Dataset Management, Deallocate: ``ranges`` of (slba, nlb), at most 256; the
        target may drop the blocks (they read as zeros on kvtool's target)."""
        if not 1 <= len(ranges) <= 256:
            raise ValueError("Dataset Management takes 1..256 ranges")
        data = b"".join(struct.pack("<IIQ", 0, nlb, slba) for slba, nlb in ranges)
        self.execute_io(P.Sqe(spec.IO_DSM, nsid=nsid, cdw10=len(ranges) - 1,
                              cdw11=1 << 2), f"Deallocate nsid {nsid}", data)

    def execute_io(self, sqe: P.Sqe, what: str, data: bytes | None = None) -> None:
        """Run one I/O command as built (a passthrough: no range or size checks here, the
        target judges it) and wait for it; ``data`` goes out with it. A lost connection
        is recovered and the command sent again. A refusal raises
        :class:`~kvtool.nvme.queue.NvmeStatusError` naming ``what``."""
        while True:
            generation = self.generation
            try:
                q = self._queue()
                q.execute(sqe, what=what,
                          data_out=memoryview(data) if data is not None else None)
                return
            except TransportError as exc:
                if self._closed:
                    raise
                self._recover(generation, exc)

    def flush(self, nsid: int) -> None:
        """NVMe Flush: every write completed before this call becomes durable."""
        self.execute_io(P.Sqe(spec.IO_FLUSH, nsid=nsid), f"Flush nsid {nsid}")

    # --- teardown -----------------------------------------------------------------------

    def close(self) -> None:
        """Orderly shutdown (CC.SHN, wait CSTS.SHST) then close the sockets; idempotent."""
        if self._closed:
            return
        self._closed = True
        self._ka_stop.set()
        admin = self.admin
        if admin is not None and admin.dead is None:
            try:
                cc = self._prop_get(admin, spec.PROP_CC)
                self._prop_set(admin, spec.PROP_CC,
                               (cc & ~spec.CC_SHN_MASK) | spec.CC_SHN_NORMAL)
                self._wait_csts(admin, spec.CSTS_SHST_MASK, spec.CSTS_SHST_COMPLETE,
                                min(self.timeout, 5.0), "shutdown (CSTS.SHST)")
            except OSError as exc:
                log.warning("shutdown of %s not confirmed: %s", self.subnqn, exc)
        for q in self.io:
            q.close()
        if admin is not None:
            admin.close()
        if self._ka_thread is not None:
            self._ka_thread.join(2.0)

    def __enter__(self) -> Controller:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"<Controller {self.subnqn} at {self.host}:{self.port} cntlid={self.cntlid} "
                f"io_queues={len(self.io)}>")


def connect(host: str, port: int, subnqn: str, *, hostnqn: str | None = None,
            io_queues: int = 1, queue_depth: int = 32, header_digest: bool = False,
            data_digest: bool = False, timeout: float = 10.0, kato_ms: int = DEFAULT_KATO_MS,
            reconnect: float = 10.0, disable_sqflow: bool = False,
            dhchap_secret: dhchap.Secret | None = None,
            dhchap_ctrl_secret: dhchap.Secret | None = None, poll: bool = False,
            spin: float = DEFAULT_SPIN) -> Controller:
    """Connect to ``subnqn`` at ``host:port`` and return a ready :class:`Controller`.

    Raises :class:`TransportError` when the target cannot be reached or misbehaves and
    :class:`ConnectError` when it refuses the connection (e.g. host NQN not allowed),
    :class:`AuthenticationError` when DH-HMAC-CHAP fails (``side`` says who failed).
    ``poll``: polled I/O queues (completions received on the waiting thread, which
    busy-polls for ``spin`` seconds before sleeping); callback users then drive them with
    :meth:`Controller.reap`.
    """
    return Controller(host, port, subnqn, hostnqn=hostnqn, io_queues=io_queues,
                      queue_depth=queue_depth, header_digest=header_digest,
                      data_digest=data_digest, timeout=timeout, kato_ms=kato_ms,
                      reconnect=reconnect, disable_sqflow=disable_sqflow,
                      dhchap_secret=dhchap_secret, dhchap_ctrl_secret=dhchap_ctrl_secret,
                      poll=poll, spin=spin)


def discover(host: str, port: int, *, hostnqn: str | None = None, timeout: float = 10.0,
             dhchap_secret: dhchap.Secret | None = None,
             dhchap_ctrl_secret: dhchap.Secret | None = None) -> list[DiscoveryEntry]:
    """Read the discovery log page from the discovery controller at ``host:port``."""
    with Controller(host, port, spec.DISCOVERY_NQN, hostnqn=hostnqn, io_queues=0,
                    timeout=timeout, reconnect=0, dhchap_secret=dhchap_secret,
                    dhchap_ctrl_secret=dhchap_ctrl_secret) as ctrl:
        return ctrl.discovery_log()


class _Failed:
    """Stands in for a command that was never sent (:meth:`Controller.submit_many`)."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error

    def result(self) -> None:
        raise self.error


def _failed(exc: BaseException) -> Command:
    return _Failed(exc)  # type: ignore[return-value]


def _piece_counter(i: int, pieces: int, done: Callable[[int, BaseException | None], None]
                   ) -> Callable[[Command], None]:
    """The ``on_done`` of item ``i``'s ``pieces`` commands: ``done(i, first error)`` once the
    last has completed (one command: straight through, no lock)."""
    if pieces == 1:
        def one(cmd: Command) -> None:
            try:
                cmd.result()
            except BaseException as exc:
                done(i, exc)
                return
            done(i, None)
        return one
    lock = threading.Lock()
    left = [pieces]
    first: list[BaseException] = []

    def each(cmd: Command) -> None:
        err: BaseException | None = None
        try:
            cmd.result()
        except BaseException as exc:
            err = exc
        with lock:
            left[0] -= 1
            if err is not None and not first:
                first.append(err)
            if left[0]:
                return
        done(i, first[0] if first else None)
    return each
