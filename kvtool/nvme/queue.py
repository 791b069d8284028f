"""One NVMe/TCP queue on the host side: a TCP connection, its PDUs, its CIDs.

Any thread may :meth:`HostQueue.submit`. Sends are serialized by a lock. At most ``depth``
commands are outstanding (CIDs are unique among them). Receiving — copying C2HData
straight into the command's buffer, answering R2Ts with H2CData, completing commands
(``threading.Event`` + optional callback) — happens in one of two modes, chosen per queue
as the Linux host chooses between its default and its poll queues (``nr_poll_queues``):

* **interrupt** (default): a per-queue reader thread receives every PDU; a waiter sleeps
  until the reader hands it the completion. Callbacks run on the reader thread, so
  fire-and-forget users (futures) need nobody to drive the queue.
* **polled** (``poll=True``): no reader thread. The thread that waits for a command
  receives the PDUs itself (:meth:`HostQueue.wait`, or :meth:`HostQueue.reap` for
  callback users, like SPDK's ``spdk_nvme_qpair_process_completions``), busy-polling the
  socket for ``spin`` seconds before it sleeps in ``poll(2)``. On a small VM a process
  wake-up costs tens of microseconds and an interrupt-driven command pays two of them
  (reader, then waiter); polling pays none (bench/nvme_tcp.py, BENCHMARKS.md).
  Callbacks run on the reaping thread. One thread reaps at a time (a lock); the others
  wait for it to complete their commands or to leave. Sends never block a polled
  queue's only reader: a send that finds the socket full receives while it waits,
  deferring R2Ts and callbacks until the send is done, so a target that stops reading
  until its replies are read cannot deadlock it.

When the connection fails or a command times out, every outstanding command fails with
:class:`TransportError` and the queue is dead; the controller decides whether to
reconnect.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import queue
import select
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any, Literal, overload

from kvtool.nvme import pdu as P
from kvtool.nvme import spec

log = logging.getLogger("kvtool.nvme")

_RECV_BUF = 256 * 1024
_READ_AHEAD = 64 * 1024
DEFAULT_SPIN = 0.001  # polled queues: busy-poll this long (s) before sleeping in poll(2)
_FOLLOW_NAP = 0.0005  # polled queues: a waiter that is not the reaper re-checks this often
_SEND_STALL = 0.002  # polled queues: a send blocked this long looks at what has arrived
_QUICKACK_MIN = 64 * 1024  # reads larger than a loopback segment ask for quick ACKs


class TransportError(ConnectionError):
    """The NVMe/TCP connection failed (closed, reset, timed out, protocol error)."""


class SendFailed(TransportError):
    """A send on a queue failed: the command (or batch) it carried had been registered and
    has failed with the queue, its callbacks run; whoever sent it must not settle it again."""


class Unreachable(TransportError):
    """No connection could be made: nothing listens there, or the name does not resolve."""


class NvmeStatusError(OSError):
    """A command completed with an error status."""

    def __init__(self, what: str, cqe: P.Cqe) -> None:
        self.cqe = cqe
        self.sct, self.sc, self.dnr = cqe.sct, cqe.sc, cqe.dnr
        name = spec.status_name(cqe.sct, cqe.sc)
        super().__init__(errno.EIO, f"{what}: {name} (SCT {cqe.sct:#x}, SC {cqe.sc:#04x}"
                                    f"{', DNR' if cqe.dnr else ''})")


class Done:
    """A command's completion flag: set once, waited on by any number of threads.

    What ``threading.Event`` offers commands, built on one C lock held until ``set()``
    (as CPython's own thread-join flag is) instead of a pure-Python Condition: at 4 KiB the
    Event's construction, ``set()`` and the slot semaphore were a tenth of the host's time
    per command (cProfile; BENCHMARKS.md).
    """

    __slots__ = ("_flag", "_lock")

    def __init__(self) -> None:
        self._flag = False
        self._lock = threading.Lock()
        self._lock.acquire()

    def is_set(self) -> bool:
        return self._flag

    def set(self) -> None:
        """Only the thread that completes the command calls this, once."""
        if not self._flag:
            self._flag = True
            self._lock.release()

    def wait(self, timeout: float | None = None) -> bool:
        if self._flag:
            return True
        if timeout is not None and timeout <= 0:
            return False
        if self._lock.acquire(timeout=-1 if timeout is None else timeout):
            self._lock.release()  # the next waiter's turn
        return self._flag


class Command:
    """An outstanding command: its buffers, progress and completion."""

    __slots__ = ("_what", "cid", "cqe", "data_in", "data_out", "done", "error", "on_done",
                 "partial_ok", "received", "sent")

    def __init__(self, what: str | tuple[Any, ...], data_in: memoryview | None,
                 data_out: memoryview | None,
                 on_done: Callable[[Command], None] | None) -> None:
        self._what = what  # a tuple is formatted only when a message needs it
        self.cid = -1
        self.data_in = data_in
        self.data_out = data_out
        self.received = 0
        self.sent = 0
        self.cqe: P.Cqe | None = None
        self.error: BaseException | None = None
        self.done = Done()
        self.on_done = on_done
        # data_in is an allocation length (Authentication Receive): the controller may
        # return less; ``received`` says how much
        self.partial_ok = False

    @property
    def what(self) -> str:
        """The command for messages: "Read nsid 1 lba 0+8"."""
        what = self._what
        if isinstance(what, tuple):
            name, nsid, slba, nlb = what
            return f"{name} nsid {nsid} lba {slba}+{nlb}"
        return what

    def result(self) -> P.Cqe:
        """The CQE of a completed command; raises its transport or status error."""
        if self.error is not None:
            raise self.error
        assert self.cqe is not None
        if not self.cqe.ok:
            raise NvmeStatusError(self.what, self.cqe)
        return self.cqe


class _Reader:
    """Buffered exact reads from a socket; large payloads go straight into the caller's view.

    With ``wait`` set (polled queues) every receive is non-blocking and ``wait()`` is
    called whenever nothing has arrived: it spins, sleeps or raises TimeoutError.
    """

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = bytearray(_RECV_BUF)
        self.view = memoryview(self.buf)
        self.start = 0
        self.end = 0
        self.wait: Callable[[], None] | None = None

    def _recv(self, dest: memoryview) -> int:
        if self.wait is None:
            return self.sock.recv_into(dest)
        while True:
            try:
                return self.sock.recv_into(dest, 0, socket.MSG_DONTWAIT)
            except BlockingIOError:
                self.wait()

    def pending(self) -> bool:
        """Bytes have arrived (buffered or in the socket); never blocks. Polled queues only."""
        if self.end > self.start:
            return True
        if self.start:
            self.start = self.end = 0
        try:
            got = self.sock.recv_into(self.view[:_READ_AHEAD], 0, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return False
        if not got:
            raise TransportError("connection closed by the target")
        self.end = got
        return True

    def fill(self, need: int) -> None:
        if self.end - self.start >= need:
            return
        if self.start:
            n = self.end - self.start
            self.view[:n] = self.view[self.start: self.end]
            self.start, self.end = 0, n
        while self.end < need:
            # Read ahead only a little: bytes past the headers are usually C2HData payload,
            # which readinto() receives straight into the command's buffer.
            got = self._recv(self.view[self.end: max(need, self.end + _READ_AHEAD)])
            if not got:
                raise TransportError("connection closed by the target")
            self.end += got

    def read(self, n: int) -> bytes:
        self.fill(n)
        out = bytes(self.view[self.start: self.start + n])
        self.start += n
        return out

    def readinto(self, dest: memoryview) -> None:
        n = len(dest)
        have = min(n, self.end - self.start)
        if have:
            dest[:have] = self.view[self.start: self.start + have]
            self.start += have
        pos = have
        while pos < n:
            got = self._recv(dest[pos:])
            if not got:
                raise TransportError("connection closed by the target")
            pos += got

    def skip(self, n: int) -> None:
        while n:
            chunk = min(n, len(self.buf))
            self.fill(chunk)
            self.start += chunk
            n -= chunk


RwRequest = tuple[int, int, memoryview, Callable[[Command], None]]
"""A Read or Write for :meth:`HostQueue.submit_rw_many`: (slba, nlb, buffer, on_done)."""


class HostQueue:
    """A connected (ICReq/ICResp done) NVMe/TCP queue; Fabrics Connect is the caller's job.

    ``poll``: receive on the waiting thread instead of a reader thread (module docstring);
    ``spin``: how long a polled queue busy-polls before it sleeps.
    """

    def __init__(self, host: str, port: int, *, qid: int, depth: int, hdgst: bool = False,
                 ddgst: bool = False, timeout: float = 10.0, poll: bool = False,
                 spin: float = DEFAULT_SPIN) -> None:
        self.qid = qid
        self.depth = depth
        self.timeout = timeout
        self.polled = poll
        self.spin = spin
        self.in_capsule_max = spec.ADMIN_IN_CAPSULE_MAX
        try:
            sock = socket.create_connection((host, port), timeout=timeout)
        except OSError as exc:
            raise Unreachable(f"cannot connect to {host}:{port}: "
                              f"{exc.strerror or exc}") from None
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock
        self.reader = _Reader(sock)
        self.hdgst = False
        self.ddgst = False
        self.maxh2cdata = 0
        try:
            self._handshake(hdgst, ddgst)
        except BaseException:
            sock.close()
            raise
        # The fd blocks; polled queues receive with MSG_DONTWAIT and wait in poll(2)
        # themselves, and their sends block for at most _SEND_STALL.
        # Command timeouts are enforced by waiters.
        sock.settimeout(None)
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()
        self._cmds: dict[int, Command] = {}
        # Free CIDs; taking one is taking a slot (at most ``depth`` outstanding).
        self._free: queue.SimpleQueue[int] = queue.SimpleQueue()
        for cid in range(depth):
            self._free.put(cid)
        self._r2t_backlog: deque[tuple[Command, P.R2T]] = deque()
        self.dead: BaseException | None = None
        self._thread: threading.Thread | None = None
        # polled mode: who receives, until when, and what waits for a send to finish
        self._rx_lock = threading.Lock()
        self._rx_owner = 0  # thread id of the receiving thread
        self._deadline = 0.0
        self._spin_until = 0.0
        self._in_send = False
        self._deferred: list[Command] = []
        self._poll_in = select.poll()
        self._poll_in.register(sock, select.POLLIN)
        self._poll_out = select.poll()
        self._poll_out.register(sock, select.POLLOUT)
        self._poll_any = select.poll()
        self._poll_any.register(sock, select.POLLIN | select.POLLOUT)
        if poll:
            self.reader.wait = self._wait_readable
            # a blocking send returns (partly done) after this long without room
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO,
                            struct.pack("ll", 0, int(_SEND_STALL * 1e6)))
        else:
            self._thread = threading.Thread(target=self._read_loop, daemon=True,
                                            name=f"nvme-tcp-q{qid}")
            self._thread.start()

    def _handshake(self, hdgst: bool, ddgst: bool) -> None:
        self.sock.sendall(P.encode(P.ICReq(hdgst=hdgst, ddgst=ddgst)))
        try:
            raw = self.reader.read(8)
            ch = P.decode_common(raw)
            if ch.pdu_type == P.PduType.C2H_TERM_REQ:
                lay = P.layout(ch, hdgst=False, ddgst=False, max_data=128)
                term = P.decode_header(ch, raw + self.reader.read(lay.header_len - 8), lay)
                assert isinstance(term, P.TermReq)
                raise TransportError(f"target rejected ICReq (C2HTermReq FES {term.fes:#x})")
            if ch.pdu_type != P.PduType.ICRESP:
                raise TransportError(f"expected ICResp, got PDU type {ch.pdu_type:#x}")
            lay = P.layout(ch, hdgst=False, ddgst=False, max_data=0)
            resp = P.decode_header(ch, raw + self.reader.read(lay.header_len - 8), lay)
        except TimeoutError:
            raise TransportError("no ICResp from the target in time") from None
        except P.PduError as exc:
            raise TransportError(f"malformed ICResp: {exc}") from None
        except OSError as exc:
            raise TransportError(f"ICReq/ICResp failed: {exc}") from None
        assert isinstance(resp, P.ICResp)
        # The same checks as the Linux host (nvme_tcp_init_connection).
        if resp.pfv != 0:
            raise TransportError(f"ICResp PFV {resp.pfv} unsupported")
        if resp.cpda != 0:
            raise TransportError(f"ICResp CPDA {resp.cpda} unsupported (need 0)")
        if resp.hdgst != hdgst or resp.ddgst != ddgst:
            raise TransportError("target did not accept the requested digests")
        if resp.maxh2cdata < 4096 or resp.maxh2cdata % 4:
            raise TransportError(f"ICResp MAXH2CDATA {resp.maxh2cdata} invalid")
        self.hdgst, self.ddgst, self.maxh2cdata = hdgst, ddgst, resp.maxh2cdata

    # --- submission ---------------------------------------------------------------------

    def submit(self, sqe: P.Sqe, *, what: str | tuple[Any, ...],
               data_out: memoryview | None = None,
               data_in: memoryview | None = None,
               on_done: Callable[[Command], None] | None = None,
               in_capsule_max: int | None = None, partial_ok: bool = False) -> Command:
        """Send ``sqe`` (CID and SGL are filled in here); return its :class:`Command`.

        Host→controller data goes in-capsule when it fits ``in_capsule_max`` (default:
        this queue's limit), otherwise after the target's R2T. Blocks while ``depth``
        commands are outstanding (a polled queue reaps completions meanwhile).
        """
        cmd = self._register(what, data_in, data_out, on_done)
        cmd.partial_ok = partial_ok
        sqe.cid = cmd.cid
        sqe.flags = P.SQE_FLAGS_PSDT_SGL
        limit = self.in_capsule_max if in_capsule_max is None else in_capsule_max
        capsule_data: memoryview | bytes = b""
        if data_out is not None and len(data_out) and len(data_out) <= limit:
            sqe.sgl = P.SglDescriptor.in_capsule(len(data_out))
            capsule_data = data_out
            cmd.sent = len(data_out)
        else:
            n = len(data_out) if data_out is not None else len(data_in or b"")
            sqe.sgl = P.SglDescriptor.transport(n)
        self._send(P.encode_parts(P.CapsuleCmd(sqe, capsule_data), hdgst=self.hdgst,
                                  ddgst=self.ddgst))
        return cmd

    def submit_rw(self, opcode: int, nsid: int, slba: int, nlb: int, buf: memoryview,
                  on_done: Callable[[Command], None] | None = None) -> Command:
        """A Read into ``buf`` or a Write from it (``nlb`` blocks at ``slba``): what
        :meth:`submit` does, with the capsule header packed in one step (the hot path)."""
        write = opcode == spec.IO_WRITE
        what = ("Write" if write else "Read", nsid, slba, nlb)
        data_in, data_out = (None, buf) if write else (buf, None)
        n = len(buf)
        if self.hdgst or self.ddgst:
            sqe = P.Sqe(opcode, nsid=nsid, cdw10=slba & 0xFFFFFFFF, cdw11=slba >> 32,
                        cdw12=(nlb - 1) & 0xFFFF)
            cmd = self.submit(sqe, what=what, data_out=data_out, data_in=data_in,
                              on_done=on_done)
        else:
            cmd = self._register(what, data_in, data_out, on_done)
            parts: list[bytes | memoryview]
            if write and n and n <= self.in_capsule_max:
                cmd.sent = n
                parts = [P.encode_io_capsule(opcode, cmd.cid, nsid, slba, nlb, n, 0), buf]
            else:
                parts = [P.encode_io_capsule(opcode, cmd.cid, nsid, slba, nlb, 0, n)]
            self._send(parts)
        if not write and n > _QUICKACK_MIN:
            self._quickack()
        return cmd

    def submit_rw_many(self, opcode: int, nsid: int, reqs: deque[RwRequest]) -> None:
        """Submit Reads (or Writes) from the left of ``reqs`` in **one send**: the first
        waits for a slot as :meth:`submit_rw` does, the others go while slots are free;
        what finds none stays in ``reqs`` for the caller's next call. A request taken off
        ``reqs`` is the queue's: its ``on_done`` runs once, also when the send fails (the
        queue fails it; :class:`SendFailed` is raised then). Any other exception leaves
        the request it was about in ``reqs``: the rest are the caller's to fail.

        One ``sendmsg`` for a request's worth of capsules instead of one per command: on
        a small machine each send also gave the GIL to a reader thread and back.
        Digest and polled queues submit one at a time (:meth:`submit_rw`)."""
        if self.hdgst or self.ddgst or self.polled:
            slba, nlb, buf, on_done = reqs[0]
            try:
                self.submit_rw(opcode, nsid, slba, nlb, buf, on_done)
            except SendFailed:
                reqs.popleft()
                raise
            reqs.popleft()
            return
        write = opcode == spec.IO_WRITE
        name = "Write" if write else "Read"
        parts: list[bytes | memoryview] = []
        quickack = False
        limit = self.in_capsule_max
        encode = P.encode_io_capsule
        wait = True
        while reqs:
            slba, nlb, buf, on_done = reqs[0]
            data_in, data_out = (None, buf) if write else (buf, None)
            cmd = self._register((name, nsid, slba, nlb), data_in, data_out, on_done,
                                 wait=wait)
            if cmd is None:
                break
            reqs.popleft()
            wait = False
            n = len(buf)
            if write and n and n <= limit:
                cmd.sent = n
                parts += (encode(opcode, cmd.cid, nsid, slba, nlb, n, 0), buf)
            else:
                parts.append(encode(opcode, cmd.cid, nsid, slba, nlb, 0, n))
                quickack = quickack or (not write and n > _QUICKACK_MIN)
        self._send(parts)
        if quickack:
            self._quickack()

    def _quickack(self) -> None:
        """ACK the coming data at once (TCP_QUICKACK), whatever the last exchange was.

        Why: a request/response connection is in Linux's "pingpong" mode, where ACKs
        wait to ride on the next request. A large read's data then stalls each time the
        target's send window fills, until a delayed ACK opens it: one 64 KiB segment per
        wake-up. Measured on 1 MiB reads at QD 1: 20-40 % of commands took 2x as long
        without it (BENCHMARKS.md). The setting lasts until this side sends again."""
        with contextlib.suppress(OSError):
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_QUICKACK, 1)

    @overload
    def _register(self, what: str | tuple[Any, ...], data_in: memoryview | None,
                  data_out: memoryview | None, on_done: Callable[[Command], None] | None,
                  wait: Literal[True] = True) -> Command: ...

    @overload
    def _register(self, what: str | tuple[Any, ...], data_in: memoryview | None,
                  data_out: memoryview | None, on_done: Callable[[Command], None] | None,
                  wait: bool) -> Command | None: ...

    def _register(self, what: str | tuple[Any, ...], data_in: memoryview | None,
                  data_out: memoryview | None,
                  on_done: Callable[[Command], None] | None,
                  wait: bool = True) -> Command | None:
        """A new outstanding command with a free CID (waits for one while ``depth`` are
        outstanding; without ``wait``, None when none is free now)."""
        if self.dead is not None:
            raise TransportError(f"queue {self.qid} is down: {self.dead}")
        if not wait:
            try:
                cid: int | None = self._free.get_nowait()
            except queue.Empty:
                return None
        else:
            cid = self._take_slot()
        if cid is None:
            self.fail(TransportError(f"queue {self.qid}: no free slot in {self.timeout:g} s"))
            raise TransportError(f"queue {self.qid} stalled")
        cmd = Command(what, data_in, data_out, on_done)
        cmd.cid = cid
        with self._lock:
            if self.dead is not None:
                self._free.put(cid)
                raise TransportError(f"queue {self.qid} is down: {self.dead}")
            self._cmds[cid] = cmd
        return cmd

    def _take_slot(self) -> int | None:
        """A free CID, or None when none came free in time."""
        free = self._free
        if not self.polled:
            try:
                return free.get(timeout=self.timeout)
            except queue.Empty:
                return None
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                return free.get_nowait()
            except queue.Empty:
                pass
            if self.dead is not None:
                raise TransportError(f"queue {self.qid} is down: {self.dead}")
            if time.monotonic() > deadline:
                return None
            # every slot is taken by an outstanding command: receive until one completes
            self._reap_for(lambda: not free.empty(), deadline,
                           f"queue {self.qid}: a free slot")

    def wait(self, cmd: Command, timeout: float | None = None) -> P.Cqe:
        """Wait for ``cmd``; on timeout the queue is failed (the target went silent)."""
        limit = self.timeout if timeout is None else timeout
        if self.polled:
            if not cmd.done.is_set():
                self._reap_for(cmd.done.is_set, time.monotonic() + limit, cmd.what)
        elif not cmd.done.wait(limit):
            self.fail(TransportError(f"{cmd.what}: no completion in {limit:g} s"))
            cmd.done.wait(1.0)
        return cmd.result()

    def execute(self, sqe: P.Sqe, *, what: str, data_out: memoryview | None = None,
                data_in: memoryview | None = None, timeout: float | None = None,
                in_capsule_max: int | None = None) -> P.Cqe:
        cmd = self.submit(sqe, what=what, data_out=data_out, data_in=data_in,
                          in_capsule_max=in_capsule_max)
        return self.wait(cmd, timeout)

    def _send(self, parts: list[bytes | memoryview]) -> None:
        try:
            with self._send_lock:
                if self.polled:
                    self._send_polled(parts)
                else:
                    self._sendall_parts(parts)
        except OSError as exc:
            err = exc if isinstance(exc, TransportError) else \
                TransportError(f"send failed: {exc.strerror or exc}")
            self.fail(err)
            raise SendFailed(str(err)) from None
        self._after_send()

    def _after_send(self) -> None:
        """Polled queues: run what waited for a send to finish (R2T answers, callbacks)."""
        if self._in_send:
            return
        if self._r2t_backlog:
            self._answer_r2ts()
        if self._deferred:
            self._run_deferred()

    def _send_rest(self, parts: list[bytes | memoryview], sent: int) -> None:
        for part in parts:
            n = len(part)
            if sent >= n:
                sent -= n
                continue
            self.sock.sendall(memoryview(part)[sent:])
            sent = 0

    def _send_polled(self, parts: list[bytes | memoryview]) -> None:
        """Send, blocking in the kernel for at most ``_SEND_STALL`` (SO_SNDTIMEO): when the
        socket stays full that long, receive (if nobody else is) until it has room, so
        both directions keep moving."""
        try:
            sent = self.sock.sendmsg(parts)
        except BlockingIOError:
            sent = 0
        if sent == sum(p.nbytes if type(p) is memoryview else len(p) for p in parts):
            return  # the usual case: all of it at once
        views = [memoryview(p).cast("B") for p in parts]
        deadline = 0.0
        while views:
            if sent < sum(len(v) for v in views):
                if not deadline:
                    deadline = time.monotonic() + self.timeout
                self._wait_writable(deadline)
            while sent:
                if sent >= len(views[0]):
                    sent -= len(views.pop(0))
                else:
                    views[0] = views[0][sent:]
                    sent = 0
            if views:
                try:
                    sent = self.sock.sendmsg(views)
                except BlockingIOError:
                    sent = 0

    def _wait_writable(self, deadline: float) -> None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TransportError(f"queue {self.qid}: the target took no data for "
                                 f"{self.timeout:g} s")
        mine = self._rx_owner == threading.get_ident()
        if not mine and not self._rx_enter():
            # another thread is receiving, so the target's replies keep draining
            self._poll_out.poll(min(left, _FOLLOW_NAP * 4) * 1000.0)
            return
        try:
            with self._receiving(deadline, spin=False):
                events = self._poll_any.poll(left * 1000.0)
                if not events or any(ev & select.POLLOUT for _, ev in events):
                    return
                # The target sends to us and waits for us to read before it reads on:
                # receive now; R2T answers and callbacks wait until this send is done.
                self._in_send = True
                try:
                    while self.reader.pending():
                        self._read_one()
                finally:
                    self._in_send = False
        finally:
            if not mine:
                self._rx_exit()

    @contextlib.contextmanager
    def _receiving(self, deadline: float, *, spin: bool) -> Iterator[None]:
        """Receive on this thread, inside another receive or send, until ``deadline``; the
        outer one's deadline comes back afterwards. A failure fails the queue and surfaces
        as TransportError (Ctrl-C as itself: the queue is failed, the interrupt goes on)."""
        saved = self._deadline, self._spin_until
        self._deadline = deadline
        self._spin_until = time.monotonic() + self.spin if spin else 0.0
        try:
            yield
        except BaseException as exc:
            self._reader_failed(exc)
            if not isinstance(exc, Exception):
                raise
            raise TransportError(f"queue {self.qid}: {self.dead or exc}") from None
        finally:
            self._deadline, self._spin_until = saved

    def _rx_enter(self) -> bool:
        """Become the receiving thread of a polled queue, if nobody is."""
        if not self._rx_lock.acquire(blocking=False):
            return False
        self._rx_owner = threading.get_ident()
        return True

    def _rx_exit(self) -> None:
        self._rx_owner = 0
        self._rx_lock.release()

    @contextlib.contextmanager
    def _receiver(self, deadline: float) -> Iterator[None]:
        """The body receives as this queue's receiving thread (entered with
        :meth:`_rx_enter`) until ``deadline``; leaving gives the role up. A failure fails
        the queue and is swallowed (the waiters see ``dead``); Ctrl-C goes on."""
        self._deadline = deadline
        self._spin_until = time.monotonic() + self.spin
        try:
            yield
        except BaseException as exc:
            self._reader_failed(exc)
            if not isinstance(exc, Exception):
                raise
        finally:
            self._rx_exit()

    # --- receive ------------------------------------------------------------------------

    def reap(self) -> int:
        """Polled queues: process every PDU that has arrived, without waiting for more;
        completion callbacks run on this thread. Returns the number of PDUs processed
        (0 when another thread is reaping). Interrupt queues: always 0."""
        if not self.polled or self.dead is not None or not self._rx_enter():
            return 0
        n = 0
        with self._receiver(time.monotonic() + self.timeout):  # a PDU begun is finished
            while self.reader.pending():
                self._read_one()
                n += 1
                self._after_send()
        self._after_send()
        return n

    def _reap_for(self, done: Callable[[], bool], deadline: float, what: str) -> None:
        """Polled queues: receive on this thread until ``done()`` or ``deadline``; when
        another thread is receiving, wait for it to finish our work or to leave. On the
        deadline the queue fails (the target went silent), as an interrupt queue's does."""
        limit = deadline - time.monotonic()
        if self._rx_owner == threading.get_ident():
            self._reap_nested(done, deadline)
            return
        while not done():
            if self.dead is not None:
                return
            if not self._rx_enter():
                if time.monotonic() > deadline:
                    self.fail(TransportError(f"{what}: no completion in {limit:g} s"))
                    return
                time.sleep(_FOLLOW_NAP)
                continue
            with self._receiver(deadline):
                try:
                    while not done():
                        self._read_one()
                        self._after_send()
                except TimeoutError:  # between PDUs: the target went silent
                    self.fail(TransportError(f"{what}: no completion in {limit:g} s"))
            self._after_send()

    def _reap_nested(self, done: Callable[[], bool], deadline: float) -> None:
        """A callback on the receiving thread waits (or needs a free slot): receive here,
        as the thread already does; the outer receive loop carries on afterwards."""
        with self._receiving(deadline, spin=True):
            while not done() and self.dead is None:
                self._read_one()
                self._after_send()

    def _wait_readable(self) -> None:
        """Nothing has arrived on a polled queue: spin a while, then sleep in poll(2)."""
        now = time.monotonic()
        if now < self._spin_until:
            return
        left = self._deadline - now
        if left <= 0 or not self._poll_in.poll(left * 1000.0):
            raise TimeoutError
        self._spin_until = time.monotonic() + self.spin

    def _read_loop(self) -> None:
        try:
            while True:
                self._read_one()
        except BaseException as exc:
            self._reader_failed(exc)

    def _reader_failed(self, exc: BaseException) -> None:
        if self.dead is not None:
            return
        if isinstance(exc, TimeoutError):
            exc = TransportError(f"queue {self.qid}: the target went silent mid-PDU")
        elif isinstance(exc, P.PduError):
            self._send_term(exc)
            exc = TransportError(f"protocol error from the target: {exc}")
        elif isinstance(exc, OSError) and not isinstance(exc, TransportError):
            exc = TransportError(f"connection lost: {exc.strerror or exc}")
        self.fail(exc)

    def _send_term(self, exc: P.PduError) -> None:
        try:
            # a polled queue may fail inside its own send (the lock is this thread's)
            lock = self._send_lock
            if lock.acquire(blocking=False) if self.polled else lock.acquire(timeout=1.0):
                try:
                    self.sock.sendall(P.encode(P.TermReq(h2c=True, fes=exc.fes, fei=exc.fei)))
                finally:
                    lock.release()
        except OSError:
            pass

    def _read_one(self) -> None:
        reader = self.reader
        if not self.hdgst:
            # Completions and read data in their one canonical form, decoded in place.
            reader.fill(8)
            if reader.buf[reader.start] == P.PduType.CAPSULE_RESP:
                reader.fill(24)
                cqe = P.decode_hot_resp(reader.buf, reader.start)
                if cqe is not None:
                    reader.start += 24
                    self._on_response(cqe)
                    return
            elif not self.ddgst and reader.buf[reader.start] == P.PduType.C2H_DATA:
                reader.fill(24)
                hot = P.decode_hot_c2h(reader.buf, reader.start)
                if hot is not None:
                    reader.start += 24
                    self._on_c2h(*hot, 0, 0)
                    return
        raw = reader.read(8)
        ch = P.decode_common(raw)
        lay = P.layout(ch, hdgst=self.hdgst, ddgst=self.ddgst, max_data=1 << 31)
        header = raw + reader.read(lay.header_len - 8)
        pdu = P.decode_header(ch, header, lay)
        if isinstance(pdu, P.CapsuleResp):
            self._on_response(pdu.cqe)
        elif isinstance(pdu, P.C2HData):
            self._on_c2h(pdu.cccid, pdu.datao, lay.data_len, pdu.success,
                         lay.data_offset - lay.header_len, lay.ddgst_len)
        elif isinstance(pdu, P.R2T):
            self._on_r2t(pdu)
        elif isinstance(pdu, P.TermReq) and not pdu.h2c:
            reader.skip(lay.data_len)
            raise TransportError(f"target terminated the connection (C2HTermReq FES "
                                 f"{pdu.fes:#x}, FEI {pdu.fei})")
        else:
            raise P.PduError(f"unexpected PDU type {ch.pdu_type:#x} from a controller", fei=0)

    def _command(self, cid: int, what: str) -> Command:
        cmd = self._cmds.get(cid)
        if cmd is None:
            raise P.PduError(f"{what} for unknown CID {cid}", fei=8)
        return cmd

    def _on_response(self, cqe: P.Cqe) -> None:
        cmd = self._command(cqe.cid, "CapsuleResp")
        cmd.cqe = cqe
        if cqe.ok and cmd.data_in is not None and cmd.received != len(cmd.data_in) \
                and cmd.error is None and not cmd.partial_ok:
            cmd.error = TransportError(f"{cmd.what}: {cmd.received} of {len(cmd.data_in)} "
                                       "bytes received before the completion")
        self._finish(cmd)

    def _on_c2h(self, cccid: int, datao: int, n: int, success: bool, pad: int,
                ddgst_len: int) -> None:
        """C2HData for ``cccid``: ``n`` bytes at ``datao``, after ``pad`` bytes (PDO past
        the header) and followed by a ``ddgst_len``-byte data digest."""
        cmd = self._command(cccid, "C2HData")
        dest = cmd.data_in
        if dest is None or datao != cmd.received or datao + n > len(dest):
            raise P.PduError(f"C2HData offset {datao}+{n} outside the expected range",
                             fes=P.FES_DATA_OUT_OF_RANGE, fei=12)
        if pad:
            self.reader.skip(pad)
        view = dest[datao: datao + n]
        self.reader.readinto(view)
        if ddgst_len:
            digest = self.reader.read(P.DIGEST_LEN)
            try:
                P.check_data_digest(view, digest)
            except P.PduError:
                cmd.error = TransportError(f"{cmd.what}: data digest mismatch")
        cmd.received += n
        if success:
            if cmd.received != len(dest) and not cmd.partial_ok:
                raise P.PduError("C2HData SUCCESS before all data arrived", fei=1)
            cmd.cqe = P.Cqe(cmd.cid)
            self._finish(cmd)

    def _on_r2t(self, r2t: P.R2T) -> None:
        cmd = self._command(r2t.cccid, "R2T")
        src = cmd.data_out
        # The same checks as the Linux host (nvme_tcp_handle_r2t).
        if src is None or r2t.r2tl == 0 or r2t.r2to + r2t.r2tl > len(src) \
                or r2t.r2to < cmd.sent:
            raise P.PduError(f"R2T offset {r2t.r2to} length {r2t.r2tl} invalid for "
                             f"{cmd.what}", fes=P.FES_DATA_OUT_OF_RANGE, fei=12)
        cmd.sent = r2t.r2to + r2t.r2tl
        self._r2t_backlog.append((cmd, r2t))
        if not self.polled:
            self._answer_r2ts()
        # polled: answered once this thread stops receiving (it may be inside a send)

    def _answer_r2ts(self) -> None:
        """Send the H2CData the backlogged R2Ts ask for. Interrupt queues wait for the
        send lock; a polled queue leaves the backlog to whoever is sending now."""
        backlog = self._r2t_backlog
        while backlog and not self._in_send and self._send_lock.acquire(
                blocking=not self.polled):
            try:
                while backlog:
                    cmd, r2t = backlog.popleft()
                    if cmd.done.is_set():
                        continue
                    src = cmd.data_out
                    assert src is not None  # checked when the R2T arrived
                    end = r2t.r2to + r2t.r2tl
                    off = r2t.r2to
                    while off < end:
                        n = min(self.maxh2cdata, end - off)
                        pdu = P.H2CData(cmd.cid, r2t.ttag, off, src[off: off + n],
                                        last=off + n == end)
                        parts = P.encode_parts(pdu, hdgst=self.hdgst, ddgst=self.ddgst)
                        if self.polled:
                            self._send_polled(parts)
                        else:
                            self._sendall_parts(parts)
                        off += n
            except OSError as exc:
                err = exc if isinstance(exc, TransportError) else \
                    TransportError(f"send failed: {exc.strerror or exc}")
                self._send_lock.release()
                self.fail(err)
                return
            self._send_lock.release()
        if self._deferred and not self._in_send:
            self._run_deferred()

    def _sendall_parts(self, parts: list[bytes | memoryview]) -> None:
        """Interrupt queues: a blocking send of every part (one ``sendmsg`` mostly)."""
        if len(parts) == 1:
            self.sock.sendall(parts[0])
            return
        sent = self.sock.sendmsg(parts)
        if sent < sum(len(p) for p in parts):
            self._send_rest(parts, sent)

    def _finish(self, cmd: Command) -> None:
        with self._lock:
            if self._cmds.pop(cmd.cid, None) is None:
                return
        self._free.put(cmd.cid)
        cmd.done.set()
        if cmd.on_done is not None:
            if self._in_send:  # a callback may submit: not while this thread holds the send
                self._deferred.append(cmd)
            else:
                self._callback(cmd)

    def _run_deferred(self) -> None:
        cmds, self._deferred = self._deferred, []
        for cmd in cmds:
            self._callback(cmd)

    @staticmethod
    def _callback(cmd: Command) -> None:
        assert cmd.on_done is not None
        try:
            cmd.on_done(cmd)
        except Exception:  # a callback bug must not kill the reader
            log.exception("completion callback failed")

    # --- teardown -----------------------------------------------------------------------

    def fail(self, exc: BaseException) -> None:
        """Mark the queue dead, close the socket, fail every outstanding command."""
        with self._lock:
            if self.dead is None:
                self.dead = exc
            cmds = list(self._cmds.values())
            self._cmds.clear()
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        for cmd in cmds:
            if cmd.error is None:
                cmd.error = exc if isinstance(exc, TransportError) else TransportError(str(exc))
            self._free.put(cmd.cid)  # wakes a submitter waiting for a slot: it sees `dead`
            cmd.done.set()
            if cmd.on_done is not None:
                self._callback(cmd)

    def close(self) -> None:
        self.fail(TransportError(f"queue {self.qid} closed"))
        if self._thread is not None:
            self._thread.join(2.0)
        self.sock.close()

    def __repr__(self) -> str:
        mode = "polled" if self.polled else "interrupt"
        return f"<HostQueue qid={self.qid} depth={self.depth} {mode} dead={self.dead!r}>"
