"""The ``nvme+tcp://`` store I/O engine: :class:`kvtool.store.io.IOEngine` over kvtool's host.

``open_nvme_tcp("nvme+tcp://127.0.0.1:4420/nqn.../1", write=True, qd=32)`` connects a
controller (``io_queues`` TCP connections, ``qd`` commands in flight in total), picks the
namespace (the URL's NSID, else the first active one) and exposes it as a byte-addressed
engine. Requests larger than the controller's MDTS are split and complete as a whole.
``submit_read``/``submit_write`` pipeline commands without a thread per request: the
queue's reader thread completes the future. A request that fails because the connection
dropped is re-issued (reads and writes are idempotent) after the controller reconnects,
on a helper thread, so its future still resolves — or fails with :class:`OSError` if the
target stays away longer than ``reconnect`` seconds.
"""

from __future__ import annotations

import errno
import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from types import TracebackType
from typing import TYPE_CHECKING, Any

from kvtool.errors import AuthenticationFailed, UsageError
from kvtool.nvme import spec
from kvtool.nvme.host import AuthenticationError, ConnectError, Controller, HostCredentials
from kvtool.nvme.queue import TransportError
from kvtool.nvme.url import NvmeUrl, default_hostnqn, parse_nvme_url
from kvtool.store.io import Countdown, check_extent

if TYPE_CHECKING:
    from kvtool.nvme.multipath import MultipathEngine

__all__ = ["NvmeTcpEngine", "open_nvme_tcp"]

log = logging.getLogger("kvtool.nvme")


class NvmeTcpEngine:
    """One NVMe/TCP namespace as an :class:`~kvtool.store.io.IOEngine`."""

    mem_align = 1  # data is copied to/from sockets: any buffer address works
    item_callbacks = True  # completions arrive on the queues' reader threads

    def __init__(self, ctrl: Controller, nsid: int, *, url: str, write: bool, qd: int) -> None:
        ns = ctrl.namespace(nsid)
        self.ctrl = ctrl
        self.nsid = nsid
        self.url = url
        self.size = ns.size_bytes
        self.lba_size = ns.lba_size
        self.qd = qd
        self.writable = write
        self._retry: ThreadPoolExecutor | None = None
        self._retry_lock = threading.Lock()
        self._closed = False

    # --- checks -------------------------------------------------------------------------

    def check(self, offset: int, buf: memoryview) -> None:
        # NVMe/TCP copies through socket buffers: no memory alignment, only whole LBAs
        check_extent(offset, buf.nbytes, self.lba_size, self.size)

    def _writable(self) -> None:
        if not self.writable:
            raise PermissionError(errno.EBADF, f"{self.url} is open read-only")

    # --- blocking -----------------------------------------------------------------------

    def read_into(self, offset: int, buf: memoryview) -> None:
        self.check(offset, buf)
        self.ctrl.read_into(self.nsid, offset // self.lba_size, buf)

    def write_from(self, offset: int, buf: memoryview) -> None:
        self._writable()
        self.check(offset, buf)
        self.ctrl.write(self.nsid, offset // self.lba_size, buf)

    def flush(self) -> None:
        self._writable()
        self.ctrl.flush(self.nsid)

    # --- pipelined ----------------------------------------------------------------------

    def submit_read(self, offset: int, buf: memoryview) -> Future[None]:
        self.check(offset, buf)
        return self._submit(spec.IO_READ, offset, buf)

    def submit_write(self, offset: int, buf: memoryview) -> Future[None]:
        self._writable()
        self.check(offset, buf)
        return self._submit(spec.IO_WRITE, offset, buf)

    def submit_reads(self, items: Sequence[tuple[int, memoryview]], *,
                     on_item: Callable[[int], None] | None = None) -> Future[None]:
        """Several reads, one future (:func:`kvtool.store.io.submit_batch`): no future per
        command, and the caller is woken once, when the last one has completed.
        ``on_item(i)``: run on the reader thread as each read completes (see
        :mod:`kvtool.store.io`)."""
        for offset, buf in items:
            self.check(offset, buf)
        return self._submit_many(spec.IO_READ, items, on_item)

    def submit_writes(self, items: Sequence[tuple[int, memoryview]]) -> Future[None]:
        """Several writes, one future (see :meth:`submit_reads`)."""
        self._writable()
        for offset, buf in items:
            self.check(offset, buf)
        return self._submit_many(spec.IO_WRITE, items)

    def _submit(self, opcode: int, offset: int, buf: memoryview) -> Future[None]:
        return self._submit_many(opcode, [(offset, buf)])

    def _submit_many(self, opcode: int, items: Sequence[tuple[int, memoryview]],
                     on_item: Callable[[int], None] | None = None) -> Future[None]:
        """Submit every item; the future resolves once all have completed (a request that
        failed with the connection is re-issued after the reconnect first) and raises
        the first failure. ``on_item(i)`` runs first for each item that completed."""
        count = Countdown(len(items))
        if not items:
            return count.fut
        count.fut.set_running_or_notify_cancel()  # no cancel(): the commands are out
        settle = count.settle
        views = [memoryview(buf).cast("B") for _offset, buf in items]

        def done(i: int, err: BaseException | None) -> None:
            if err is None:
                if on_item is not None:
                    try:
                        on_item(i)
                    except Exception:  # the caller's work, not the read's: it stands
                        log.exception("a read's completion callback failed")
                settle(None)
            elif (isinstance(err, TransportError) and self.ctrl.reconnect > 0
                  and not self._closed):
                self._retry_pool().submit(self._redo, settle, opcode, items[i][0], views[i])
            else:
                settle(err)

        self.ctrl.submit_many(opcode, self.nsid,
                              [(offset, view) for (offset, _b), view in zip(items, views,
                                                                            strict=True)],
                              self.lba_size, done)
        return count.fut

    def _redo(self, settle: Callable[[BaseException | None], None], opcode: int, offset: int,
              view: memoryview) -> None:
        try:
            if opcode == spec.IO_WRITE:
                self.ctrl.write(self.nsid, offset // self.lba_size, view)
            else:
                self.ctrl.read_into(self.nsid, offset // self.lba_size, view)
        except BaseException as exc:
            settle(exc)
            return
        settle(None)

    def _retry_pool(self) -> ThreadPoolExecutor:
        with self._retry_lock:
            if self._retry is None:
                self._retry = ThreadPoolExecutor(max_workers=4, thread_name_prefix="nvme-retry")
            return self._retry

    # --- lifecycle ----------------------------------------------------------------------

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._retry is not None:
            self._retry.shutdown(wait=True)
        self.ctrl.close()

    def __enter__(self) -> NvmeTcpEngine:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def describe(self) -> dict[str, Any]:
        info = self.ctrl.info
        return {
            "kind": "nvme-tcp", "target": self.url, "engine": "nvme-tcp",
            "size_bytes": self.size, "lba_size": self.lba_size, "mem_align": self.mem_align,
            "qd": self.qd, "subnqn": self.ctrl.subnqn, "nsid": self.nsid,
            "hostnqn": self.ctrl.hostnqn, "cntlid": self.ctrl.cntlid,
            "io_queues": len(self.ctrl.io), "max_transfer": self.ctrl.max_transfer,
            "model": info.mn if info else "", "serial": info.sn if info else "",
        }


def open_nvme_tcp(url: str, *, write: bool, qd: int = 32, hostnqn: str | None = None,
                  credentials: HostCredentials | None = None,
                  **opts: Any) -> NvmeTcpEngine | MultipathEngine:
    """Connect to ``nvme+tcp://HOST:PORT/SUBNQN[/NSID][?hostnqn=]`` and return the engine.

    Host NQN: ``hostnqn`` argument, else the URL's ``?hostnqn=``, else the machine default
    (:func:`kvtool.nvme.url.default_hostnqn`). ``opts``: ``io_queues`` (default 1, 2 when
    qd ≥ 16), ``header_digest``, ``data_digest``, ``timeout`` (s), ``reconnect`` (s).
    ``credentials``: host NQN and DH-HMAC-CHAP secrets (its ``hostnqn`` wins over the URL's).
    Failing to connect raises :class:`~kvtool.errors.UsageError` (field ``TARGET``); failed
    authentication raises :class:`~kvtool.errors.AuthenticationFailed` (exit 1).
    """
    if qd < 1:
        raise UsageError(f"queue depth must be at least 1, got {qd}", field="qd")
    parsed = parse_nvme_url(url)
    creds = credentials or HostCredentials()
    nqn = hostnqn or creds.hostnqn or parsed.hostnqn or default_hostnqn()
    io_queues = int(opts.get("io_queues") or (2 if qd >= 16 else 1))
    depth = max(2, -(-qd // io_queues))
    if parsed.discover_paths:
        parsed = _discovered_paths(parsed, nqn, creds, float(opts.get("timeout", 10.0)))
    if parsed.alternates:
        return _open_multipath(parsed, nqn, creds, write=write, qd=qd, io_queues=io_queues,
                               depth=depth, opts=opts)
    try:
        ctrl = Controller(parsed.host, parsed.port, parsed.subnqn, hostnqn=nqn,
                          io_queues=io_queues, queue_depth=depth,
                          header_digest=bool(opts.get("header_digest", False)),
                          data_digest=bool(opts.get("data_digest", False)),
                          timeout=float(opts.get("timeout", 10.0)),
                          reconnect=float(opts.get("reconnect", 10.0)),
                          dhchap_secret=creds.secret, dhchap_ctrl_secret=creds.ctrl_secret)
    except AuthenticationError as exc:
        raise AuthenticationFailed(str(exc)) from None
    except ConnectError as exc:
        raise UsageError(str(exc), field="target") from None
    except OSError as exc:
        raise UsageError(f"{url}: {exc}", field="target") from None
    try:
        nsid = parsed.nsid
        if nsid is None:
            active = ctrl.active_namespaces()
            if not active:
                raise UsageError(f"{url}: the subsystem has no active namespace", field="target")
            nsid = active[0]
        elif not ctrl.identify_namespace(nsid).active:
            raise UsageError(f"{url}: namespace {nsid} is not active", field="target")
        return NvmeTcpEngine(ctrl, nsid, url=str(parsed), write=write, qd=qd)
    except BaseException:
        ctrl.close()
        raise


def _discovered_paths(parsed: NvmeUrl, hostnqn: str, creds: HostCredentials,
                      timeout: float) -> NvmeUrl:
    """``parsed`` with every TCP address of its subsystem in the discovery logs of its
    addresses and of the discovery controllers they refer to (Linux nvmet lists only the
    port asked, plus referrals; SPDK every listener)."""
    from dataclasses import replace

    from kvtool.nvme.host import discover
    paths = list(parsed.paths)
    queue, seen = list(parsed.paths), set[tuple[str, int]]()
    while queue:
        addr = queue.pop(0)
        if addr in seen or len(seen) >= 16:
            continue
        seen.add(addr)
        try:
            entries = discover(addr[0], addr[1], hostnqn=hostnqn, timeout=timeout,
                               dhchap_secret=creds.secret, dhchap_ctrl_secret=creds.ctrl_secret)
        except OSError:
            continue  # that address is down: the others may still list the paths
        for e in entries:
            if e.trtype != spec.TRTYPE_TCP or not e.trsvcid.isdigit():
                continue
            found = (e.traddr, int(e.trsvcid))
            if e.subtype == spec.SUBTYPE_DISCOVERY:  # a referral to another discovery controller
                queue.append(found)
            elif e.subnqn == parsed.subnqn and found not in paths:
                paths.append(found)
    (host, port), *alternates = paths
    return replace(parsed, host=host, port=port, alternates=tuple(alternates))


def _open_multipath(parsed: NvmeUrl, hostnqn: str, creds: HostCredentials, *, write: bool,
                    qd: int, io_queues: int, depth: int, opts: dict[str, Any]) -> MultipathEngine:
    """Several addresses: one controller per path, I/O on the optimized ones
    (:mod:`kvtool.nvme.multipath`)."""
    from kvtool.nvme.multipath import MultipathEngine

    def connect(host: str, port: int) -> Controller:
        return Controller(host, port, parsed.subnqn, hostnqn=hostnqn, io_queues=io_queues,
                          queue_depth=depth, header_digest=bool(opts.get("header_digest", False)),
                          data_digest=bool(opts.get("data_digest", False)),
                          timeout=float(opts.get("timeout", 10.0)), reconnect=0,
                          kato_ms=int(opts.get("kato_ms", 5000)),
                          dhchap_secret=creds.secret, dhchap_ctrl_secret=creds.ctrl_secret)

    nsid = parsed.nsid or 1
    try:
        return MultipathEngine(connect, list(parsed.paths), nsid, url=str(parsed), write=write,
                               qd=qd, policy=str(opts.get("multipath_policy", "round-robin")),
                               failover_timeout=float(opts.get("failover_timeout", 30.0)))
    except AuthenticationError as exc:
        raise AuthenticationFailed(str(exc)) from None
    except ConnectError as exc:
        raise UsageError(str(exc), field="target") from None
    except OSError as exc:
        raise UsageError(f"{parsed}: {exc}", field="target") from None
