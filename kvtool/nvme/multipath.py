"""ANA multipath: one namespace over several NVMe/TCP paths, as an ``IOEngine``.

``nvme+tcp://127.0.0.1:4420,127.0.0.1:4421/NQN/1`` opens a :class:`MultipathEngine`: one
controller per address (path). Each path's ANA state for the namespace's group comes from
the ANA log page (0x0C) read through that path, re-read when the path reports an ANA
Change notice (an Asynchronous Event Request is kept outstanding on every path) and when
an I/O fails with an ANA status.

Invariants:

* I/O goes only to paths that are connected and **optimized**; when none is, to the
  non-optimized ones; when none of those either, the request waits (up to
  ``failover_timeout`` seconds) for a path to come back. Among the candidates a path is
  picked round-robin, or by the fewest commands in flight (``policy="queue-depth"``).
* A request that fails on a path for a path reason (the connection dropped, a
  keep-alive timeout, an ANA inaccessible/transition/persistent-loss status, a transient
  transport error) is re-issued whole on another path; the caller sees no error. Reads
  and writes are idempotent, so a request completed twice is harmless. Any other status
  (LBA out of range, invalid field) fails the request as on one path.
* A failed path is reconnected in the background every ``retry_interval`` seconds; it takes
  I/O again once connected and its ANA state is usable.
* Every failover is counted: ``stats()`` gives, per failover, the path it left, the cause,
  and the seconds from the failure being seen to the first I/O completed on another path
  (measured; ``seen_at``/``completed_at`` are wall-clock times, to compare with the time a
  fault was injected).
"""

from __future__ import annotations

import errno
import itertools
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

from kvtool.nvme import pdu as P
from kvtool.nvme import spec
from kvtool.nvme.host import Controller
from kvtool.nvme.queue import Command, NvmeStatusError, TransportError
from kvtool.store.io import check_extent

log = logging.getLogger("kvtool.nvme.multipath")

POLICIES = ("round-robin", "queue-depth")
USABLE = (spec.ANA_OPTIMIZED, spec.ANA_NON_OPTIMIZED)


def is_path_error(exc: BaseException) -> bool:
    """An error that another path may not have: the connection, or an ANA/path status."""
    if isinstance(exc, NvmeStatusError):
        return exc.sct == spec.SCT_PATH or (exc.sct == spec.SCT_GENERIC and
                                            exc.sc == spec.SC_TRANSIENT_TRANSPORT)
    return isinstance(exc, (TransportError, ConnectionError, TimeoutError)) or (
        isinstance(exc, OSError) and exc.errno in (errno.ECONNRESET, errno.EPIPE,
                                                   errno.ECONNREFUSED, errno.ETIMEDOUT))


@dataclass
class Path:
    """One address of the subsystem: its controller (None while down) and ANA state."""

    host: str
    port: int
    ctrl: Controller | None = None
    ana: int = spec.ANA_OPTIMIZED
    grpid: int = 0
    error: str | None = None  # why it is down
    inflight: int = 0
    completed: int = 0
    failures: int = 0
    down_since: float | None = None
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def label(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    @property
    def live(self) -> bool:
        ctrl = self.ctrl
        return ctrl is not None and self.error is None and ctrl.admin is not None \
            and ctrl.admin.dead is None and all(q.dead is None for q in ctrl.io)

    def to_json(self) -> dict[str, Any]:
        return {"address": self.label, "state": "live" if self.live else "down",
                "ana_state": spec.ANA_STATE_NAMES.get(self.ana, str(self.ana)),
                "ana_group": self.grpid, "error": self.error, "inflight": self.inflight,
                "completed": self.completed, "failures": self.failures,
                "cntlid": self.ctrl.cntlid if self.ctrl is not None else None}


class MultipathEngine:
    """One namespace over several paths (see the module docstring)."""

    mem_align = 1  # data is copied to/from sockets: any buffer address works

    def __init__(self, connect: Callable[[str, int], Controller],
                 paths: list[tuple[str, int]], nsid: int, *, url: str, write: bool, qd: int,
                 policy: str = "round-robin", failover_timeout: float = 30.0,
                 retry_interval: float = 0.2) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}")
        self._connect = connect
        self.paths = [Path(h, p) for h, p in paths]
        self.nsid = nsid
        self.url = url
        self.writable = write
        self.qd = qd
        self.policy = policy
        self.failover_timeout = failover_timeout
        self.retry_interval = retry_interval
        self._rr = itertools.count()
        self._closed = False
        self._wake = threading.Condition()
        self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="nvme-mpath")
        self._failovers: list[dict[str, Any]] = []
        self._open_failover: dict[str, Any] | None = None  # waiting for its first completion
        self._stats_lock = threading.Lock()
        self.retried = 0
        errors = []
        for path in self.paths:
            try:
                self._bring_up(path)
            except OSError as exc:
                self._mark_down(path, exc)
                errors.append(f"{path.label}: {exc}")
        if not any(p.live for p in self.paths):
            self._pool.shutdown(wait=False)
            raise TransportError("no path to the namespace could be connected: "
                                 + "; ".join(errors))
        first = next(p for p in self.paths if p.live)
        assert first.ctrl is not None
        ns = first.ctrl.namespace(nsid)
        self.size = ns.size_bytes
        self.lba_size = ns.lba_size
        self._monitor = threading.Thread(target=self._watch, name="nvme-mpath-watch",
                                         daemon=True)
        self._monitor.start()

    # --- paths --------------------------------------------------------------------------

    def _bring_up(self, path: Path) -> None:
        """Connect, read the namespace's ANA group and state, arm the ANA Change notice."""
        ctrl = self._connect(path.host, path.port)
        try:
            info = ctrl.info or ctrl.identify_controller()
            ns = ctrl.identify_namespace(self.nsid)
            if not ns.active:
                raise TransportError(f"namespace {self.nsid} is not active through {path.label}")
            path.grpid = ns.anagrpid
            ana = spec.ANA_OPTIMIZED
            if info.ana:
                ctrl.set_features(spec.FID_ASYNC_EVENT_CONFIG, spec.AEN_CFG_ANA_CHANGE)
                ana = self._read_ana(ctrl, path)
        except BaseException:
            ctrl.close()
            raise
        old = path.ctrl
        path.ctrl, path.ana, path.error, path.down_since = ctrl, ana, None, None
        if old is not None:
            self._pool.submit(old.close)
        if info.ana:
            self._arm_aer(path, ctrl)
        log.info("path %s up (ANA %s)", path.label, spec.ANA_STATE_NAMES.get(ana, ana))
        self._notify()

    def _read_ana(self, ctrl: Controller, path: Path) -> int:
        _chg, groups = ctrl.ana_log()
        for g in groups:
            if g.grpid == path.grpid or self.nsid in g.nsids:
                path.grpid = g.grpid
                return g.state
        return spec.ANA_INACCESSIBLE  # the namespace is in no group seen through this path

    def _refresh_ana(self, path: Path) -> None:
        ctrl = path.ctrl
        if ctrl is None or self._closed:
            return
        try:
            state = self._read_ana(ctrl, path)
        except OSError as exc:
            self._mark_down(path, exc)
            return
        if state != path.ana:
            log.info("path %s: ANA %s -> %s", path.label, spec.ANA_STATE_NAMES.get(path.ana),
                     spec.ANA_STATE_NAMES.get(state))
            if path.ana in USABLE and state not in USABLE:
                self._fault(path, f"ANA {spec.ANA_STATE_NAMES.get(state, state)} (log page)")
        path.ana = state
        self._notify()

    def _arm_aer(self, path: Path, ctrl: Controller) -> None:
        def on_event(cmd: Command) -> None:
            if self._closed or path.ctrl is not ctrl:
                return
            try:
                cqe = cmd.result()
            except OSError as exc:
                if is_path_error(exc):
                    self._mark_down(path, exc)
                return
            event = cqe.dw0
            if (event >> 16) & 0xFF == spec.LID_ANA:  # re-read (re-arms it), then re-arm the AER
                self._pool.submit(self._after_event, path, ctrl)
            else:
                self._pool.submit(self._arm_aer, path, ctrl)

        try:
            ctrl.submit_admin(P.Sqe(spec.ADMIN_ASYNC_EVENT), "Asynchronous Event Request",
                              on_event)
        except OSError as exc:
            self._mark_down(path, exc)

    def _after_event(self, path: Path, ctrl: Controller) -> None:
        self._refresh_ana(path)
        if path.ctrl is ctrl and not self._closed:
            self._arm_aer(path, ctrl)

    def _mark_down(self, path: Path, exc: BaseException) -> None:
        if path.error is None:
            path.failures += 1
            path.down_since = time.monotonic()
            log.warning("path %s down: %s", path.label, exc)
            self._fault(path, str(exc))
        path.error = str(exc) or type(exc).__name__
        self._notify()

    def _watch(self) -> None:
        """Reconnect paths that are down; notice queues that died between I/Os."""
        last_poll = time.monotonic()
        while not self._closed:
            poll = time.monotonic() - last_poll >= 1.0
            if poll:
                last_poll = time.monotonic()
            for path in self.paths:
                if self._closed:
                    return
                if path.error is None and path.ctrl is not None and not path.live:
                    self._mark_down(path, TransportError("connection lost"))
                if poll and path.live and path.ana not in USABLE:
                    self._refresh_ana(path)  # a peer that sends no ANA Change notice
                if path.error is not None:
                    try:
                        self._bring_up(path)
                    except OSError as exc:
                        path.error = str(exc) or type(exc).__name__
            with self._wake:
                self._wake.wait(self.retry_interval)

    def _notify(self) -> None:
        with self._wake:
            self._wake.notify_all()

    def _choose(self) -> Path | None:
        live = [p for p in self.paths if p.live]
        best = [p for p in live if p.ana == spec.ANA_OPTIMIZED] or \
            [p for p in live if p.ana == spec.ANA_NON_OPTIMIZED]
        if not best:
            return None
        if self.policy == "queue-depth":
            return min(best, key=lambda p: p.inflight)
        return best[next(self._rr) % len(best)]

    def _wait_for_path(self, deadline: float) -> Path:
        with self._wake:
            while True:
                if self._closed:
                    raise TransportError("engine is closed")
                path = self._choose()
                if path is not None:
                    return path
                left = deadline - time.monotonic()
                if left <= 0:
                    states = ", ".join(f"{p.label} {'live' if p.live else 'down'} "
                                       f"{spec.ANA_STATE_NAMES.get(p.ana)}" for p in self.paths)
                    raise TransportError(f"no usable path to {self.url} for "
                                         f"{self.failover_timeout:g} s ({states})")
                self._wake.wait(min(left, 0.05))

    # --- checks -------------------------------------------------------------------------

    def check(self, offset: int, buf: memoryview) -> None:
        check_extent(offset, buf.nbytes, self.lba_size, self.size)

    def _writable(self) -> None:
        if not self.writable:
            raise PermissionError(errno.EBADF, f"{self.url} is open read-only")

    # --- I/O ----------------------------------------------------------------------------

    def read_into(self, offset: int, buf: memoryview) -> None:
        self.submit_read(offset, buf).result()

    def write_from(self, offset: int, buf: memoryview) -> None:
        self.submit_write(offset, buf).result()

    def submit_read(self, offset: int, buf: memoryview) -> Future[None]:
        self.check(offset, buf)
        return self._submit(spec.IO_READ, offset, buf)

    def submit_write(self, offset: int, buf: memoryview) -> Future[None]:
        self._writable()
        self.check(offset, buf)
        return self._submit(spec.IO_WRITE, offset, buf)

    def flush(self) -> None:
        """Flush through every live, usable path (each controller's completed writes); at
        least one must succeed, else it waits for a path as I/O does."""
        self._writable()
        deadline = time.monotonic() + self.failover_timeout
        while True:
            done = 0
            for path in self.paths:
                ctrl = path.ctrl
                if not path.live or ctrl is None or path.ana not in USABLE:
                    continue
                try:
                    ctrl.flush(self.nsid)
                    done += 1
                except OSError as exc:
                    if not is_path_error(exc):
                        raise
                    self._path_failed(path, exc)
            if done:
                return
            self._wait_for_path(deadline)

    def _submit(self, opcode: int, offset: int, buf: memoryview) -> Future[None]:
        fut: Future[None] = Future()
        fut.set_running_or_notify_cancel()
        view = memoryview(buf).cast("B")
        if not len(view):
            fut.set_result(None)
            return fut
        path = self._choose()
        if path is None:
            self._pool.submit(self._retry, fut, opcode, offset, view, None)
        else:
            self._issue(path, fut, opcode, offset, view)
        return fut

    def _issue(self, path: Path, fut: Future[None], opcode: int, offset: int,
               view: memoryview) -> None:
        ctrl = path.ctrl
        assert ctrl is not None
        with path.lock:
            path.inflight += 1

        def done(err: BaseException | None) -> None:
            with path.lock:
                path.inflight -= 1
            if err is None:
                path.completed += 1
                self._completed_on(path)
                fut.set_result(None)
            elif is_path_error(err) and not self._closed:
                self._path_failed(path, err)
                self._pool.submit(self._retry, fut, opcode, offset, view, path)
            else:
                fut.set_exception(err)

        ctrl.submit_split(opcode, self.nsid, offset, view, self.lba_size, done)

    def _path_failed(self, path: Path, exc: BaseException) -> None:
        """A request failed on ``path``: note the failover, take the path out of use."""
        if isinstance(exc, NvmeStatusError) and exc.sct == spec.SCT_PATH:
            self._fault(path, str(exc))
            path.ana = {spec.SC_ANA_INACCESSIBLE: spec.ANA_INACCESSIBLE,
                        spec.SC_ANA_PERSISTENT_LOSS: spec.ANA_PERSISTENT_LOSS}.get(
                            exc.sc, spec.ANA_CHANGE)
            self._pool.submit(self._refresh_ana, path)
            self._notify()
        else:
            self._mark_down(path, exc)

    def _fault(self, path: Path, cause: str) -> None:
        """``path`` stopped taking I/O: the failover lasts until an I/O completes elsewhere."""
        with self._stats_lock:
            if self._open_failover is None or self._open_failover["from"] != path.label:
                self._open_failover = {"from": path.label, "cause": cause,
                                       "seen": time.monotonic(), "seen_at": time.time()}

    def _completed_on(self, path: Path) -> None:
        with self._stats_lock:
            fo = self._open_failover
            if fo is None or fo["from"] == path.label:
                return
            self._open_failover = None
            self._failovers.append({"from": fo["from"], "to": path.label, "cause": fo["cause"],
                                    "failover_s": time.monotonic() - fo["seen"],
                                    "seen_at": fo["seen_at"], "completed_at": time.time()})

    def _retry(self, fut: Future[None], opcode: int, offset: int, view: memoryview,
               failed: Path | None) -> None:
        with self._stats_lock:
            self.retried += failed is not None
        try:
            path = self._wait_for_path(time.monotonic() + self.failover_timeout)
        except BaseException as exc:
            fut.set_exception(exc)
            return
        self._issue(path, fut, opcode, offset, view)

    # --- reporting and lifecycle ------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Paths (state, ANA state, I/Os completed, failures), the requests re-issued on
        another path, and every failover with its time (measured)."""
        with self._stats_lock:
            return {"policy": self.policy, "paths": [p.to_json() for p in self.paths],
                    "retried_requests": self.retried, "failovers": list(self._failovers)}

    def describe(self) -> dict[str, Any]:
        live = next((p for p in self.paths if p.live and p.ctrl is not None), None)
        info = live.ctrl.info if live is not None and live.ctrl is not None else None
        ctrl = live.ctrl if live is not None else None
        return {
            "kind": "nvme-tcp", "target": self.url, "engine": "nvme-tcp-multipath",
            "size_bytes": self.size, "lba_size": self.lba_size, "mem_align": self.mem_align,
            "qd": self.qd, "subnqn": ctrl.subnqn if ctrl else "", "nsid": self.nsid,
            "hostnqn": ctrl.hostnqn if ctrl else "",
            "max_transfer": ctrl.max_transfer if ctrl else None,
            "model": info.mn if info else "", "serial": info.sn if info else "",
            "multipath": self.stats(),
        }

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._notify()
        self._monitor.join(5.0)
        self._pool.shutdown(wait=True)
        for path in self.paths:
            if path.ctrl is not None:
                path.ctrl.close()

    def __enter__(self) -> MultipathEngine:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
