"""One NVMe/TCP queue (one TCP connection) on the target side: PDU framing and queue state.

States: ``await ICReq`` → ``await Connect`` → ``connected`` (admin queue qid 0, or an I/O
queue). Every received byte goes through :class:`kvtool.nvme.pdu.PduParser`'s layout
checks here. A malformed or out-of-order PDU gets a C2HTermReq (FES/FEI say what and
where) and the connection is closed. Commands go to :mod:`emulator.nvmetcp.commands`,
which answers through :meth:`QueueConnection.complete`, :meth:`~QueueConnection.send_data`
and :meth:`~QueueConnection.receive_data` (an R2T; the data arrives in H2CData PDUs and is
streamed straight into its destination). Nothing a peer sends may raise out of
:meth:`QueueConnection.data_received` — an unexpected exception is logged, answered with
a TermReq and closes only this connection.

Limits enforced here: outstanding commands ≤ SQSIZE+1 (exceeding it is fatal), unique
CIDs (except a pending AER's: SPDK's host reuses those after abandoning them), MAXH2CDATA
per H2CData PDU, H2CData offsets exactly in sequence within the R2T's range.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Callable
from dataclasses import dataclass

from emulator.nvmetcp import commands, nvm
from emulator.nvmetcp.queue import Shared
from emulator.nvmetcp.subsystem import Controller, Subsystem
from kvtool.nvme import dhchap, spec
from kvtool.nvme import pdu as P
from kvtool.nvme.spec import status

log = logging.getLogger("emulator.nvmetcp")

_AWAIT_ICREQ, _AWAIT_CONNECT, _CONNECTED, _CLOSED = range(4)
FEI_CID = 10  # byte offset of the CID within a CapsuleCmd PDU (8 + 2)
_CAPSULE_MAX_DATA = 131072  # parser bound; the configured in-capsule size is a CQE status
_STREAM_MIN = 64 * 1024  # larger in-capsule data is received in place, not staged
_STAGE_SIZE = 256 * 1024  # holds any whole non-H2CData PDU (72 + 4 + 128 KiB + 4)
_STAGE_MIN_FREE = 64 * 1024
# At most this much is received into staging at once: a large capsule's payload that comes
# in behind its header would be copied twice (staging, then the namespace), up to a
# quarter of each MiB; 64 KiB still takes in ~15 small PDUs per recv (BENCHMARKS.md).
_STAGE_WINDOW = 64 * 1024
_BATCH_LIMIT = 64 * 1024  # larger output parts are written at once, not batched
_LOWAT_MIN_STEP = 64 * 1024  # streamed data: below this much left, wait for all of it
_SPARE_PER_SIZE = 8
_STATUS_ERROR = 0x0FFE  # SCT and SC
_STATUS_MORE = 0x4000


class _Fatal(Exception):
    def __init__(self, message: str, fes: int, fei: int) -> None:
        super().__init__(message)
        self.fes = fes
        self.fei = fei


@dataclass
class _PendingData:
    """A command waiting for its H2CData. ``dest`` is where the data lands (a backing's own
    memory, or ``buf`` from the spare pool); ``finish`` runs once all of it arrived."""

    cid: int
    length: int
    dest: memoryview
    buf: bytearray | None
    finish: Callable[[memoryview], None]
    received: int = 0
    digest_error: bool = False


class QueueConnection(asyncio.BufferedProtocol):
    """asyncio protocol for one queue. Also driven directly (no socket) by the fuzz tests.

    ``hot_path``: answer canonical small Reads and in-capsule Writes without the general
    dispatch (:meth:`_hot`; the same bytes on the wire). A subclass that observes
    :meth:`_dispatch` or :meth:`_write` turns it off; tests compare both settings."""

    hot_path = True

    def __init__(self, state: Shared) -> None:
        self.state = state
        cfg = state.config
        self._stage = bytearray(_STAGE_SIZE)
        self._sview = memoryview(self._stage)
        self._start = 0  # unparsed bytes are _stage[_start:_end]
        self._end = 0
        self._last_header = b""
        self._sink: memoryview | None = None  # rest of a streamed H2CData's destination
        self._sink_pdu: P.H2CData | P.CapsuleCmd | None = None
        self._sink_data: memoryview | None = None
        self._sink_buf: bytearray | None = None  # a pooled buffer behind _sink_data
        self.landed: memoryview | None = None  # in-capsule write data already in place
        self._sink_len = 0
        self._sink_digest = False
        self._out: list[bytes | memoryview] = []
        self._lowat = 1
        self._spare: dict[int, list[bytearray]] = {}
        self.transport: asyncio.BaseTransport | None = None
        self._state = _AWAIT_ICREQ
        self.hdgst = False
        self.ddgst = False
        self.maxh2cdata = cfg.maxh2cdata
        self._capsule_max = max(_CAPSULE_MAX_DATA, cfg.in_capsule_data_size)
        self.stream_min = _STREAM_MIN  # the fuzz harness lowers it to reach that path
        self.qid = -1
        self.ctrl: Controller | None = None
        self.subsys: Subsystem | None = None
        self.sq_entries = 0
        self.sqhd = 0
        self.sqflow_disabled = False
        self.outstanding: set[int] = set()
        self.aers: list[int] = []
        self.pending: dict[int, _PendingData] = {}
        self._current: P.Sqe | None = None  # the command being dispatched
        self.peer = "?"
        self.local: tuple[str, int] | None = None
        self.auth: dhchap.ControllerAuth | None = None  # DH-HMAC-CHAP on this queue

    @property
    def streaming(self) -> bool:
        """Whether a streamed data PDU's payload is being received straight into its
        destination (the socket's next bytes go there, not to the PDU parser)."""
        return self._sink is not None

    # --- asyncio.Protocol ---------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        peer = transport.get_extra_info("peername")
        sock = transport.get_extra_info("sockname")
        if peer:
            self.peer = f"{peer[0]}:{peer[1]}"
        if sock:
            self.local = (str(sock[0]), int(sock[1]))
        self.state.connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self._state = _CLOSED
        self.state.connections.discard(self)
        self.pending.clear()
        self._sink = self._sink_data = None  # drop views of the backing's memory
        self._sink_pdu = None
        self._sink_buf = None
        ctrl = self.ctrl
        self.ctrl = None
        if ctrl is None:
            return
        if self.qid == 0:
            ctrl.subsys.delete_controller(ctrl, reason="admin queue closed")
        elif ctrl.queues.get(self.qid) is self:
            del ctrl.queues[self.qid]

    # --- receive (asyncio.BufferedProtocol) ---------------------------------------------

    def get_buffer(self, sizehint: int) -> memoryview:
        """Where the next received bytes go: the streamed write's destination or staging."""
        if self._sink is not None:
            return self._sink
        if self._end == len(self._stage) or (
                self._start and len(self._stage) - self._end < _STAGE_MIN_FREE):
            self._compact()
        return self._sview[self._end: self._end + _STAGE_WINDOW]

    def buffer_updated(self, nbytes: int) -> None:
        if self._state == _CLOSED:
            return
        try:
            if self._sink is not None:
                self._sink = self._sink[nbytes:] if nbytes < len(self._sink) else None
            else:
                self._end += nbytes
            self._process()
        except _Fatal as exc:
            self._terminate(exc.fes, exc.fei, str(exc))
        except P.PduError as exc:
            self._terminate(exc.fes, exc.fei, str(exc))
        except Exception as exc:  # a target bug must not take the server down
            log.exception("internal error on connection from %s", self.peer)
            self._terminate(P.FES_INVALID_HEADER_FIELD, 0, f"internal error: {exc!r}")
        finally:
            self.flush()
            self._set_lowat()

    def _set_lowat(self) -> None:
        """While a large write streams in, be woken for half of what is still to come (all
        of it once that is under 64 KiB) instead of for every segment: SO_RCVLOWAT. Never
        more than the PDU still owes — bytes past it may never be sent."""
        if self._sink is None:
            want = 1
        else:
            left = len(self._sink)
            want = left if left <= _LOWAT_MIN_STEP else left // 2
        if want != self._lowat and self.transport is not None:
            sock = self.transport.get_extra_info("socket")
            if sock is not None:
                try:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, want)
                except OSError:
                    return
                self._lowat = want

    def _quickack(self) -> None:
        """ACK a large write's data as it arrives (TCP_QUICKACK). A request/response
        connection is in Linux's "pingpong" mode, where ACKs wait for this side's next
        send; the host's send window then refills one delayed ACK at a time. Lasts until
        this side sends again. (The host does the same for large reads; docs/nvme-tcp.md.)"""
        sock = self.transport.get_extra_info("socket") if self.transport is not None else None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_QUICKACK, 1)

    def data_received(self, data: bytes) -> None:
        """Feed bytes through the buffered path (used by the fuzz harness)."""
        view = memoryview(data)
        while len(view) and self._state != _CLOSED:
            buf = self.get_buffer(len(view))
            n = min(len(buf), len(view))
            buf[:n] = view[:n]
            view = view[n:]
            self.buffer_updated(n)

    def eof_received(self) -> bool | None:
        return None

    def _compact(self) -> None:
        n = self._end - self._start
        if self._start:
            self._sview[:n] = self._sview[self._start: self._end]
        self._start, self._end = 0, n

    def _process(self) -> None:
        view = self._sview
        hot = self._hot_ready()
        answered = False  # by the hot path
        while self._state != _CLOSED and self._sink is None:
            if self._sink_pdu is not None:  # a streamed H2CData's data is all in place
                if not self._finish_stream():
                    break
                continue
            start = self._start
            avail = self._end - start
            if hot and avail >= 72:
                used = self._hot(start, avail)
                if used:
                    self._start = start + used
                    answered = True
                    continue
            if avail < 8:
                break
            self._last_header = bytes(view[start: start + 8])
            ch = P.decode_common(view[start: start + 8])
            is_h2c = ch.pdu_type == P.PduType.H2C_DATA
            lay = P.layout(ch, hdgst=self.hdgst, ddgst=self.ddgst,
                           max_data=self.maxh2cdata if is_h2c else self._capsule_max)
            streamed = is_h2c or lay.data_len > self.stream_min
            need = lay.data_offset if streamed else ch.plen
            if avail < need:
                if start + need > len(self._stage):
                    self._compact()
                break
            self._last_header = bytes(view[start: start + min(ch.hlen, P.TERM_MAX_ERROR_HEADER)])
            pdu = P.decode_header(ch, view[start: start + lay.header_len], lay)
            if isinstance(pdu, P.H2CData):
                self._start_stream(pdu, lay)
                continue
            if streamed and isinstance(pdu, P.CapsuleCmd):
                self._start_capsule_stream(pdu, lay)
                continue
            data = b""
            digest_ok = True
            if lay.data_len:
                d0 = start + lay.data_offset
                data = bytes(view[d0: d0 + lay.data_len])
                if lay.ddgst_len:
                    digest = view[d0 + lay.data_len: d0 + lay.data_len + P.DIGEST_LEN]
                    digest_ok = P.crc32c(data) == int.from_bytes(digest, "little")
            self._start = start + ch.plen
            self._dispatch(P.attach_data(pdu, data), digest_ok)
            hot = self._hot_ready()  # a Connect, an ICReq or authentication may change it
        if self._start == self._end and self._sink is None:
            self._start = self._end = 0
        if answered and self.ctrl is not None:
            self.ctrl.touch()  # keep-alive: once for the commands of this receive

    def _hot_ready(self) -> bool:
        """Whether this queue's Read/Write capsules may take :meth:`_hot`: a connected I/O
        queue without digests (and authenticated, where that is asked for) of a ready
        controller. Evaluated per receive and after every command of the general path:
        nothing else runs in between (one event loop)."""
        ctrl = self.ctrl
        return (self.hot_path and self._state == _CONNECTED and self.qid > 0
                and not self.hdgst and not self.ddgst and ctrl is not None and ctrl.ready
                and (self.auth is None or self.auth.authenticated))

    def _hot(self, start: int, avail: int) -> int:
        """The hot path: a canonical 4 KiB-class Read or in-capsule Write that passes every
        check is answered here, with what the general path (:meth:`_dispatch` →
        :mod:`.commands` → :mod:`.nvm`) would send and record; returns the bytes of the
        PDU, or 0 with nothing done (the general path then takes it, errors included).
        At 4 KiB the general path's dataclasses, layout checks and dispatch layers were
        most of the target's CPU per command (BENCHMARKS.md, issue 40)."""
        cmd = P.decode_hot_capsule(self._stage, start)
        if cmd is None:
            return 0
        opc, cid, nsid, slba, nlb, cdw12, incap, length = cmd
        outstanding = self.outstanding
        if cid in outstanding or len(outstanding) >= self.sq_entries:
            return 0  # the general path decides (a pending AER's CID, or fatal)
        ctrl = self.ctrl
        assert ctrl is not None
        ns = ctrl.subsys.namespaces.get(nsid)
        if ns is None:
            return 0
        if opc == spec.IO_READ and not incap:
            data = nvm.hot_read(self, ns, slba, nlb, length)
            if data is None:
                return 0
            self.sqhd = (self.sqhd + 1) % self.sq_entries
            out = self._out
            if self.sqflow_disabled:
                out.append(P.encode_hot_c2h(cid, length, True))
                out.append(data)
            else:
                out.append(P.encode_hot_c2h(cid, length, False))
                out.append(data)
                out.append(P.encode_hot_resp(cid, self.sqhd, self.qid))
            return 72
        if (opc != spec.IO_WRITE or not incap or incap > self.stream_min or avail < 72 + incap
                or incap > self.state.config.in_capsule_data_size):
            return 0
        d0 = start + 72
        if not nvm.hot_write(self, ns, slba, nlb, cdw12, self._sview[d0: d0 + incap]):
            return 0
        self.sqhd = (self.sqhd + 1) % self.sq_entries
        self._out.append(P.encode_hot_resp(
            cid, 0xFFFF if self.sqflow_disabled else self.sqhd, self.qid))
        return 72 + incap

    def _dispatch(self, pdu: P.Pdu, digest_ok: bool) -> None:
        if isinstance(pdu, P.CapsuleCmd):
            if not digest_ok:  # fails the command (Transient Transport Error), not the link
                self._accept_cid(pdu.sqe.cid)
                self.complete(pdu.sqe.cid, status(spec.SC_TRANSIENT_TRANSPORT, dnr=False))
                return
            self._accept_cid(pdu.sqe.cid)
            if self.ctrl is not None:
                self.ctrl.touch()
            self._current = pdu.sqe
            try:
                commands.dispatch(self, pdu.sqe, pdu.data)
            finally:
                self._current = None
        elif isinstance(pdu, P.ICReq):
            self._on_icreq(pdu)
        elif isinstance(pdu, P.TermReq) and pdu.h2c:
            self.close(f"host sent H2CTermReq FES {pdu.fes:#x}")
        else:
            raise _Fatal(f"unexpected PDU {type(pdu).__name__} from a host",
                         P.FES_INVALID_HEADER_FIELD, 0)

    def _start_stream(self, pdu: P.H2CData, lay: P.Layout) -> None:
        """Validate an H2CData header, then move its data straight to the write's buffer."""
        n = lay.data_len
        pw = self._check_h2c(pdu, n)
        self._sink_into(pdu, lay, pw.dest[pdu.datao: pdu.datao + n])

    def _start_capsule_stream(self, pdu: P.CapsuleCmd, lay: P.Layout) -> None:
        """Large in-capsule data: straight into the namespace when the command is a valid
        write there (no copy, as for H2CData), else into a pooled buffer."""
        n = lay.data_len
        dest = commands.landing_zone(self, pdu.sqe, n)
        if dest is None:
            self._sink_buf = self._take_buffer(n)
            dest = memoryview(self._sink_buf)[:n]
        self._sink_into(pdu, lay, dest)

    def _sink_into(self, pdu: P.H2CData | P.CapsuleCmd, lay: P.Layout,
                   dest: memoryview) -> None:
        n = lay.data_len
        self._start += lay.data_offset
        have = min(n, self._end - self._start)
        dest[:have] = self._sview[self._start: self._start + have]
        self._start += have
        self._sink_pdu = pdu
        self._sink_len = n
        self._sink_digest = bool(lay.ddgst_len)
        self._sink_data = dest
        if have < n:
            if n - have > _LOWAT_MIN_STEP:
                self._quickack()
            self._sink = dest[have:]
            if self._start == self._end:
                self._start = self._end = 0

    def _finish_stream(self) -> bool:
        pdu, dest = self._sink_pdu, self._sink_data
        assert pdu is not None and dest is not None
        digest_ok = True
        if self._sink_digest:
            if self._end - self._start < P.DIGEST_LEN:
                return False
            digest = self._sview[self._start: self._start + P.DIGEST_LEN]
            digest_ok = P.crc32c(dest) == int.from_bytes(digest, "little")
            self._start += P.DIGEST_LEN
        self._sink_pdu = None
        self._sink_data = None
        if isinstance(pdu, P.H2CData):
            self._h2c_done(pdu, self._sink_len, digest_ok)
            return True
        buf, self._sink_buf = self._sink_buf, None
        self.landed = dest if buf is None else None
        try:
            self._dispatch(P.CapsuleCmd(pdu.sqe, dest), digest_ok)
        finally:
            self.landed = None
            with contextlib.suppress(BufferError):  # a handler kept a view: GC frees it
                dest.release()
            if buf is not None:
                self._give_buffer(buf)
        return True

    # --- output -------------------------------------------------------------------------

    def _write(self, pdu: P.Pdu) -> None:
        """Queue a PDU; small PDUs are sent together when the received bytes are processed."""
        if self.transport is None or self._state == _CLOSED:
            return
        for part in P.encode_parts(pdu, hdgst=self.hdgst, ddgst=self.ddgst):
            if len(part) > _BATCH_LIMIT:
                self.flush()
                self.transport.write(part)  # type: ignore[attr-defined]
            else:
                self._out.append(part)

    def flush(self) -> None:
        out = self._out
        if not out:
            return
        self._out = []
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        transport.write(out[0] if len(out) == 1 else b"".join(out))  # type: ignore[attr-defined]

    def close(self, reason: str) -> None:
        if self._state == _CLOSED:
            return
        log.info("closing queue %s from %s: %s", self.qid, self.peer, reason)
        self.flush()
        self._state = _CLOSED
        if self.transport is not None:
            self.transport.close()

    def _terminate(self, fes: int, fei: int, message: str) -> None:
        if self._state == _CLOSED:
            return
        log.warning("terminating connection from %s: %s (FES %#x FEI %d)", self.peer,
                    message, fes, fei)
        self.flush()
        term = P.TermReq(h2c=False, fes=fes, fei=fei, error_header=self._last_header)
        transport = self.transport
        self._state = _CLOSED
        self._sink = None
        if transport is not None:
            for part in P.encode_parts(term):
                transport.write(part)  # type: ignore[attr-defined]
            transport.close()

    # --- queue state --------------------------------------------------------------------

    @property
    def connected(self) -> bool:
        """Fabrics Connect succeeded on this queue."""
        return self._state == _CONNECTED

    def bind(self, ctrl: Controller, subsys: Subsystem, qid: int, sqsize: int,
             cattr: int) -> None:
        """Fabrics Connect succeeded: this queue is ``qid`` of ``ctrl``."""
        self.ctrl = ctrl
        self.subsys = subsys
        self.qid = qid
        self.sq_entries = sqsize + 1
        self.sqhd = 1 % self.sq_entries
        self.sqflow_disabled = bool(cattr & spec.CATTR_DISABLE_SQ_FLOW)
        self._state = _CONNECTED

    def _on_icreq(self, req: P.ICReq) -> None:
        if self._state != _AWAIT_ICREQ:
            raise _Fatal("ICReq on an initialized connection", P.FES_PDU_SEQUENCE_ERROR, 0)
        if req.pfv != 0:
            raise _Fatal(f"unsupported PFV {req.pfv}", P.FES_UNSUPPORTED_PARAMETER, 8)
        if req.hpda != 0:
            raise _Fatal(f"unsupported HPDA {req.hpda}", P.FES_UNSUPPORTED_PARAMETER, 10)
        self._write(P.ICResp(pfv=0, cpda=0, hdgst=req.hdgst, ddgst=req.ddgst,
                             maxh2cdata=self.maxh2cdata))
        self.hdgst = req.hdgst
        self.ddgst = req.ddgst
        self._state = _AWAIT_CONNECT

    def _accept_cid(self, cid: int) -> None:
        if self._state == _AWAIT_ICREQ:
            raise _Fatal("CapsuleCmd before ICReq", P.FES_PDU_SEQUENCE_ERROR, 0)
        if cid in self.outstanding and cid in self.aers:
            # SPDK's host completes its own AERs (ABORTED - SQ DELETION) when it detaches,
            # then reuses their CIDs for the shutdown's Property Set/Get on this queue: the
            # host has given that AER up, so it is forgotten, not a duplicate CID.
            self.aers.remove(cid)
            self.outstanding.discard(cid)
        if cid in self.outstanding:
            raise _Fatal(f"CID {cid} is already outstanding", P.FES_INVALID_HEADER_FIELD,
                         FEI_CID)
        limit = self.sq_entries if self._state == _CONNECTED else 1
        if len(self.outstanding) >= limit:
            raise _Fatal(f"more than {limit} commands outstanding (SQSIZE)",
                         P.FES_INVALID_HEADER_FIELD, FEI_CID)
        self.outstanding.add(cid)
        if self.sq_entries:
            self.sqhd = (self.sqhd + 1) % self.sq_entries

    # --- answers (used by the command handlers) -----------------------------------------

    def complete(self, cid: int, st: int = 0, dw0: int = 0, dw1: int = 0) -> None:
        """Send the command's CQE; a failure also goes into the Error Information log
        (and the CQE's More bit says so, as Linux nvmet does)."""
        self.outstanding.discard(cid)
        if st & _STATUS_ERROR and self.ctrl is not None:
            cur = self._current
            nsid = cur.nsid if cur is not None and cur.cid == cid else 0
            if cur is not None and cur.opcode == spec.OPC_FABRICS:
                nsid = 0
            self.ctrl.record_error(max(self.qid, 0), cid, st, nsid)
            st |= _STATUS_MORE
        sqhd = 0xFFFF if self.sqflow_disabled else self.sqhd
        self._write(P.CapsuleResp(P.Cqe(cid, st, dw0, dw1, sqhd, max(self.qid, 0))))

    def send_data(self, cid: int, data: bytes | memoryview) -> None:
        """C2HData for the whole transfer; SUCCESS replaces the CapsuleResp when allowed."""
        if self.sqflow_disabled:
            self.outstanding.discard(cid)
            self._write(P.C2HData(cid, 0, data, last=True, success=True))
            return
        self._write(P.C2HData(cid, 0, data, last=True))
        self.complete(cid)

    def receive_data(self, cid: int, length: int, dest: memoryview | None,
                     finish: Callable[[memoryview], None]) -> None:
        """Ask for the command's ``length`` data bytes with one R2T (TTAG = CID; CIDs are
        unique). They land in ``dest`` (or a pooled buffer when None); ``finish`` gets them
        once all arrived with good digests, else the command fails here."""
        buf = None
        if dest is None:
            buf = self._take_buffer(length)
            dest = memoryview(buf)[:length]
        self.pending[cid] = _PendingData(cid, length, dest, buf, finish)
        self._write(P.R2T(cid, cid, 0, length))

    def _check_h2c(self, pdu: P.H2CData, n: int) -> _PendingData:
        if self._state != _CONNECTED or self.qid <= 0:
            raise _Fatal("H2CData on a queue without write commands", P.FES_PDU_SEQUENCE_ERROR, 0)
        pw = self.pending.get(pdu.ttag)
        if pw is None:
            raise _Fatal(f"H2CData with unknown TTAG {pdu.ttag}", P.FES_INVALID_HEADER_FIELD, 10)
        if pdu.cccid != pw.cid:
            raise _Fatal(f"H2CData CCCID {pdu.cccid} does not match TTAG {pdu.ttag}",
                         P.FES_INVALID_HEADER_FIELD, 8)
        if pdu.datao != pw.received:
            raise _Fatal(f"H2CData DATAO {pdu.datao}, expected {pw.received}",
                         P.FES_DATA_OUT_OF_RANGE, 12)
        if pdu.datao + n > pw.length:
            raise _Fatal("H2CData past the end of the R2T range", P.FES_DATA_OUT_OF_RANGE, 16)
        if pdu.last and pdu.datao + n != pw.length:  # a missing LAST at the end is tolerated
            raise _Fatal("H2CData LAST_PDU before the end of the R2T range",
                         P.FES_INVALID_HEADER_FIELD, 1)
        return pw

    def _h2c_done(self, pdu: P.H2CData, n: int, digest_ok: bool) -> None:
        pw = self.pending.get(pdu.ttag)
        if pw is None:  # the connection is being torn down
            return
        pw.received += n
        if not digest_ok:
            pw.digest_error = True
        if pw.received < pw.length:
            return
        del self.pending[pw.cid]
        if pw.digest_error:
            self.complete(pw.cid, status(spec.SC_TRANSIENT_TRANSPORT, dnr=False))
        else:
            pw.finish(pw.dest)
        pw.dest.release()
        if pw.buf is not None:
            self._give_buffer(pw.buf)

    def _take_buffer(self, length: int) -> bytearray:
        spare = self._spare.get(length)
        return spare.pop() if spare else bytearray(length)

    def _give_buffer(self, buf: bytearray) -> None:
        spare = self._spare.setdefault(len(buf), [])
        if len(spare) < _SPARE_PER_SIZE:
            spare.append(buf)
