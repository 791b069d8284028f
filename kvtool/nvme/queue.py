"""One NVMe/TCP queue on the host side: a TCP connection, its PDU reader thread, its CIDs.

Threading: any thread may :meth:`HostQueue.submit`; a per-queue reader thread receives
every PDU, copies C2HData straight into the command's buffer, answers R2Ts with H2CData
and completes commands (``threading.Event`` + optional callback). Sends are serialized by
a lock. At most ``depth`` commands are outstanding (a semaphore; CIDs are unique among
them). When the connection fails or a command times out, every outstanding command fails
with :class:`TransportError` and the queue is dead; the controller decides whether to
reconnect.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import socket
import threading
from collections import deque
from collections.abc import Callable

from kvtool.nvme import pdu as P
from kvtool.nvme import spec

log = logging.getLogger("kvtool.nvme")

_RECV_BUF = 256 * 1024
_READ_AHEAD = 64 * 1024


class TransportError(ConnectionError):
    """The NVMe/TCP connection failed (closed, reset, timed out, protocol error)."""


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


class Command:
    """An outstanding command: its buffers, progress and completion."""

    __slots__ = ("cid", "cqe", "data_in", "data_out", "done", "error", "on_done", "partial_ok",
                 "received", "sent", "what")

    def __init__(self, what: str, data_in: memoryview | None, data_out: memoryview | None,
                 on_done: Callable[[Command], None] | None) -> None:
        self.what = what
        self.cid = -1
        self.data_in = data_in
        self.data_out = data_out
        self.received = 0
        self.sent = 0
        self.cqe: P.Cqe | None = None
        self.error: BaseException | None = None
        self.done = threading.Event()
        self.on_done = on_done
        # data_in is an allocation length (Authentication Receive): the controller may
        # return less; ``received`` says how much
        self.partial_ok = False

    def result(self) -> P.Cqe:
        """The CQE of a completed command; raises its transport or status error."""
        if self.error is not None:
            raise self.error
        assert self.cqe is not None
        if not self.cqe.ok:
            raise NvmeStatusError(self.what, self.cqe)
        return self.cqe


class _Reader:
    """Buffered exact reads from a socket; large payloads go straight into the caller's view."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = bytearray(_RECV_BUF)
        self.view = memoryview(self.buf)
        self.start = 0
        self.end = 0

    def _fill(self, need: int) -> None:
        if self.end - self.start >= need:
            return
        if self.start:
            n = self.end - self.start
            self.view[:n] = self.view[self.start: self.end]
            self.start, self.end = 0, n
        while self.end < need:
            # Read ahead only a little: bytes past the headers are usually C2HData payload,
            # which readinto() receives straight into the command's buffer.
            got = self.sock.recv_into(self.view[self.end: max(need, self.end + _READ_AHEAD)])
            if not got:
                raise TransportError("connection closed by the target")
            self.end += got

    def read(self, n: int) -> bytes:
        self._fill(n)
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
            got = self.sock.recv_into(dest[pos:])
            if not got:
                raise TransportError("connection closed by the target")
            pos += got

    def skip(self, n: int) -> None:
        while n:
            chunk = min(n, len(self.buf))
            self._fill(chunk)
            self.start += chunk
            n -= chunk


class HostQueue:
    """A connected (ICReq/ICResp done) NVMe/TCP queue; Fabrics Connect is the caller's job."""

    def __init__(self, host: str, port: int, *, qid: int, depth: int, hdgst: bool = False,
                 ddgst: bool = False, timeout: float = 10.0) -> None:
        self.qid = qid
        self.depth = depth
        self.timeout = timeout
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
        sock.settimeout(None)  # the reader blocks; command timeouts are enforced by waiters
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()
        self._cmds: dict[int, Command] = {}
        self._free: deque[int] = deque(range(depth))
        self._slots = threading.Semaphore(depth)
        self.dead: BaseException | None = None
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

    def submit(self, sqe: P.Sqe, *, what: str, data_out: memoryview | None = None,
               data_in: memoryview | None = None,
               on_done: Callable[[Command], None] | None = None,
               in_capsule_max: int | None = None, partial_ok: bool = False) -> Command:
        """Send ``sqe`` (CID and SGL are filled in here); return its :class:`Command`.

        Host→controller data goes in-capsule when it fits ``in_capsule_max`` (default:
        this queue's limit), otherwise after the target's R2T. Blocks while ``depth``
        commands are outstanding.
        """
        if self.dead is not None:
            raise TransportError(f"queue {self.qid} is down: {self.dead}")
        if not self._slots.acquire(timeout=self.timeout):
            self.fail(TransportError(f"queue {self.qid}: no free slot in {self.timeout:g} s"))
            raise TransportError(f"queue {self.qid} stalled")
        cmd = Command(what, data_in, data_out, on_done)
        cmd.partial_ok = partial_ok
        with self._lock:
            if self.dead is not None:
                self._slots.release()
                raise TransportError(f"queue {self.qid} is down: {self.dead}")
            cmd.cid = self._free.popleft()
            self._cmds[cmd.cid] = cmd
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

    def wait(self, cmd: Command, timeout: float | None = None) -> P.Cqe:
        """Wait for ``cmd``; on timeout the queue is failed (the target went silent)."""
        if not cmd.done.wait(self.timeout if timeout is None else timeout):
            self.fail(TransportError(f"{cmd.what}: no completion in "
                                     f"{self.timeout if timeout is None else timeout:g} s"))
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
                if len(parts) == 1:
                    self.sock.sendall(parts[0])
                else:
                    total = sum(len(p) for p in parts)
                    sent = self.sock.sendmsg(parts)
                    if sent < total:
                        self._send_rest(parts, sent)
        except OSError as exc:
            err = TransportError(f"send failed: {exc.strerror or exc}")
            self.fail(err)
            raise err from None

    def _send_rest(self, parts: list[bytes | memoryview], sent: int) -> None:
        for part in parts:
            n = len(part)
            if sent >= n:
                sent -= n
                continue
            self.sock.sendall(memoryview(part)[sent:])
            sent = 0

    # --- receive ------------------------------------------------------------------------

    def _read_loop(self) -> None:
        try:
            while True:
                self._read_one()
        except BaseException as exc:
            if self.dead is None:
                if isinstance(exc, P.PduError):
                    self._send_term(exc)
                    exc = TransportError(f"protocol error from the target: {exc}")
                elif isinstance(exc, OSError) and not isinstance(exc, TransportError):
                    exc = TransportError(f"connection lost: {exc.strerror or exc}")
                self.fail(exc)

    def _send_term(self, exc: P.PduError) -> None:
        try:
            with self._send_lock:
                self.sock.sendall(P.encode(P.TermReq(h2c=True, fes=exc.fes, fei=exc.fei)))
        except OSError:
            pass

    def _read_one(self) -> None:
        reader = self.reader
        raw = reader.read(8)
        ch = P.decode_common(raw)
        lay = P.layout(ch, hdgst=self.hdgst, ddgst=self.ddgst, max_data=1 << 31)
        header = raw + reader.read(lay.header_len - 8)
        pdu = P.decode_header(ch, header, lay)
        if isinstance(pdu, P.CapsuleResp):
            self._on_response(pdu.cqe)
        elif isinstance(pdu, P.C2HData):
            self._on_c2h(pdu, lay)
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

    def _on_c2h(self, pdu: P.C2HData, lay: P.Layout) -> None:
        cmd = self._command(pdu.cccid, "C2HData")
        dest = cmd.data_in
        n = lay.data_len
        if dest is None or pdu.datao != cmd.received or pdu.datao + n > len(dest):
            raise P.PduError(f"C2HData offset {pdu.datao}+{n} outside the expected range",
                             fes=P.FES_DATA_OUT_OF_RANGE, fei=12)
        self.reader.skip(lay.data_offset - lay.header_len)
        view = dest[pdu.datao: pdu.datao + n]
        self.reader.readinto(view)
        if lay.ddgst_len:
            digest = self.reader.read(P.DIGEST_LEN)
            try:
                P.check_data_digest(view, digest)
            except P.PduError:
                cmd.error = TransportError(f"{cmd.what}: data digest mismatch")
        cmd.received += n
        if pdu.success:
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
        end = r2t.r2to + r2t.r2tl
        off = r2t.r2to
        while off < end:
            n = min(self.maxh2cdata, end - off)
            pdu = P.H2CData(cmd.cid, r2t.ttag, off, src[off: off + n], last=off + n == end)
            self._send(P.encode_parts(pdu, hdgst=self.hdgst, ddgst=self.ddgst))
            off += n
        cmd.sent = end

    def _finish(self, cmd: Command) -> None:
        with self._lock:
            if self._cmds.pop(cmd.cid, None) is None:
                return
            self._free.append(cmd.cid)
        self._slots.release()
        cmd.done.set()
        if cmd.on_done is not None:
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
            self._slots.release()
            cmd.done.set()
            if cmd.on_done is not None:
                try:
                    cmd.on_done(cmd)
                except Exception:
                    log.exception("completion callback failed")

    def close(self) -> None:
        self.fail(TransportError(f"queue {self.qid} closed"))
        self._thread.join(2.0)
        self.sock.close()

    def __repr__(self) -> str:
        return f"<HostQueue qid={self.qid} depth={self.depth} dead={self.dead!r}>"

