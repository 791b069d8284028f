"""One NVMe/TCP queue (one TCP connection) on the target side: the PDU state machine.

States: ``await ICReq`` → ``await Connect`` → ``connected`` (admin queue qid 0, or an I/O
queue). Every received byte goes through :class:`kvtool.nvme.pdu.PduParser`. A malformed
or out-of-order PDU gets a C2HTermReq (FES/FEI say what and where) and the connection is
closed; command-level errors get a CQE with the NVMe status the Linux target would give.
Nothing a peer sends may raise out of :meth:`QueueConnection.data_received` — an
unexpected exception is logged, answered with a TermReq and closes only this connection.

Limits enforced: outstanding commands ≤ SQSIZE+1 (exceeding it is fatal), unique CIDs
(except a pending AER's: SPDK's host reuses those after abandoning them), MDTS (Invalid
Field), in-capsule data size (SGL Offset Invalid), MAXH2CDATA per H2CData PDU, H2CData
offsets exactly in sequence within the R2T's range.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from emulator.nvmetcp.model import Closable, Controller, Namespace, Subsystem
from kvtool.nvme import pdu as P
from kvtool.nvme import spec
from kvtool.nvme.spec import status

if TYPE_CHECKING:
    from emulator.nvmetcp.target import TargetState

log = logging.getLogger("emulator.nvmetcp")

_AWAIT_ICREQ, _AWAIT_CONNECT, _CONNECTED, _CLOSED = range(4)
MAX_AERS = 4
FEI_CID = 10  # byte offset of the CID within a CapsuleCmd PDU (8 + 2)
_CAPSULE_MAX_DATA = 131072  # parser bound; the configured in-capsule size is a CQE status
_STAGE_SIZE = 256 * 1024  # holds any whole non-H2CData PDU (72 + 4 + 128 KiB + 4)
_STAGE_MIN_FREE = 64 * 1024
_BATCH_LIMIT = 64 * 1024  # larger output parts are written at once, not batched
_SPARE_PER_SIZE = 8


class _Fatal(Exception):
    def __init__(self, message: str, fes: int, fei: int) -> None:
        super().__init__(message)
        self.fes = fes
        self.fei = fei


@dataclass
class _PendingWrite:
    """A write waiting for its H2CData. ``dest`` is the backing's own memory when it has
    some (data lands in place), else ``buf`` (written to the backing at the end)."""

    cid: int
    ns: Namespace
    offset: int
    length: int
    dest: memoryview
    buf: bytearray | None
    received: int = 0
    digest_error: bool = False


class QueueConnection(asyncio.BufferedProtocol, Closable):
    """asyncio protocol for one queue. Also driven directly (no socket) by the fuzz tests."""

    def __init__(self, state: TargetState) -> None:
        self.state = state
        cfg = state.config
        self._stage = bytearray(_STAGE_SIZE)
        self._sview = memoryview(self._stage)
        self._start = 0  # unparsed bytes are _stage[_start:_end]
        self._end = 0
        self._last_header = b""
        self._sink: memoryview | None = None  # rest of a streamed H2CData's destination
        self._sink_pdu: P.H2CData | None = None
        self._sink_data: memoryview | None = None
        self._sink_len = 0
        self._sink_digest = False
        self._out: list[bytes | memoryview] = []
        self._spare: dict[int, list[bytearray]] = {}
        self.transport: asyncio.BaseTransport | None = None
        self._state = _AWAIT_ICREQ
        self.hdgst = False
        self.ddgst = False
        self.maxh2cdata = cfg.maxh2cdata
        self.qid = -1
        self.ctrl: Controller | None = None
        self.subsys: Subsystem | None = None
        self.sq_entries = 0
        self.sqhd = 0
        self.sqflow_disabled = False
        self.outstanding: set[int] = set()
        self.aers: list[int] = []
        self.pending: dict[int, _PendingWrite] = {}
        self.peer = "?"
        self.local: tuple[str, int] | None = None

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
        return self._sview[self._end:]

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
            self._flush()

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
        while self._state != _CLOSED and self._sink is None:
            if self._sink_pdu is not None:  # a streamed H2CData's data is all in place
                if not self._finish_stream():
                    break
                continue
            start = self._start
            avail = self._end - start
            if avail < 8:
                break
            self._last_header = bytes(view[start: start + 8])
            ch = P.decode_common(view[start: start + 8])
            is_h2c = ch.pdu_type == P.PduType.H2C_DATA
            lay = P.layout(ch, hdgst=self.hdgst, ddgst=self.ddgst,
                           max_data=self.maxh2cdata if is_h2c else _CAPSULE_MAX_DATA)
            need = lay.data_offset if is_h2c else ch.plen
            if avail < need:
                if start + need > len(self._stage):
                    self._compact()
                break
            self._last_header = bytes(view[start: start + min(ch.hlen, P.TERM_MAX_ERROR_HEADER)])
            pdu = P.decode_header(ch, view[start: start + lay.header_len], lay)
            if isinstance(pdu, P.H2CData):
                self._start_stream(pdu, lay)
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
        if self._start == self._end and self._sink is None:
            self._start = self._end = 0

    def _dispatch(self, pdu: P.Pdu, digest_ok: bool) -> None:
        if isinstance(pdu, P.CapsuleCmd):
            if not digest_ok:  # fails the command (Transient Transport Error), not the link
                self._accept_cid(pdu.sqe.cid)
                self._complete(pdu.sqe.cid, status(spec.SC_TRANSIENT_TRANSPORT, dnr=False))
                return
            self._on_capsule(pdu)
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
        dest = pw.dest[pdu.datao: pdu.datao + n]
        self._start += lay.data_offset
        have = min(n, self._end - self._start)
        dest[:have] = self._sview[self._start: self._start + have]
        self._start += have
        self._sink_pdu = pdu
        self._sink_len = n
        self._sink_digest = bool(lay.ddgst_len)
        self._sink_data = dest
        if have < n:
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
        self._h2c_done(pdu, self._sink_len, digest_ok)
        return True

    # --- output -------------------------------------------------------------------------

    def _write(self, pdu: P.Pdu) -> None:
        """Queue a PDU; small PDUs are sent together when the received bytes are processed."""
        if self.transport is None or self._state == _CLOSED:
            return
        for part in P.encode_parts(pdu, hdgst=self.hdgst, ddgst=self.ddgst):
            if len(part) > _BATCH_LIMIT:
                self._flush()
                self.transport.write(part)  # type: ignore[attr-defined]
            else:
                self._out.append(part)

    def _flush(self) -> None:
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
        self._flush()
        self._state = _CLOSED
        if self.transport is not None:
            self.transport.close()

    def _terminate(self, fes: int, fei: int, message: str) -> None:
        if self._state == _CLOSED:
            return
        log.warning("terminating connection from %s: %s (FES %#x FEI %d)", self.peer,
                    message, fes, fei)
        self._flush()
        term = P.TermReq(h2c=False, fes=fes, fei=fei, error_header=self._last_header)
        transport = self.transport
        self._state = _CLOSED
        self._sink = None
        if transport is not None:
            for part in P.encode_parts(term):
                transport.write(part)  # type: ignore[attr-defined]
            transport.close()

    # --- PDU handlers -------------------------------------------------------------------

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

    def _complete(self, cid: int, st: int = 0, dw0: int = 0, dw1: int = 0) -> None:
        self.outstanding.discard(cid)
        sqhd = 0xFFFF if self.sqflow_disabled else self.sqhd
        self._write(P.CapsuleResp(P.Cqe(cid, st, dw0, dw1, sqhd, max(self.qid, 0))))

    def _send_data(self, cid: int, data: bytes | memoryview) -> None:
        """C2HData for the whole transfer; SUCCESS replaces the CapsuleResp when allowed."""
        if self.sqflow_disabled:
            self.outstanding.discard(cid)
            self._write(P.C2HData(cid, 0, data, last=True, success=True))
            return
        self._write(P.C2HData(cid, 0, data, last=True))
        self._complete(cid)

    def _on_capsule(self, cap: P.CapsuleCmd) -> None:
        sqe = cap.sqe
        self._accept_cid(sqe.cid)
        ctrl = self.ctrl
        if ctrl is not None:
            ctrl.touch()
        st = self._check_sgl(sqe, cap.data)
        if st:
            self._complete(sqe.cid, st)
            return
        if sqe.opcode == spec.OPC_FABRICS:
            self._on_fabrics(sqe, cap.data)
            return
        if self._state != _CONNECTED or ctrl is None:
            self._complete(sqe.cid, status(spec.SC_INVALID_OPCODE))
            return
        if self.qid == 0:
            self._on_admin(ctrl, sqe)
        else:
            self._on_io(ctrl, sqe, cap.data)

    def _check_sgl(self, sqe: P.Sqe, data: bytes | memoryview) -> int:
        if sqe.flags & 0x03 or (sqe.flags >> 6) != 1:
            return status(spec.SC_INVALID_FIELD)  # fused ops unsupported; PSDT must be SGL
        sgl = sqe.sgl
        if data:
            if sgl.sgl_id != P.SGL_DATA_BLOCK_OFFSET:
                return status(spec.SC_SGL_DESC_TYPE_INVALID)
            if sgl.address != 0:
                return status(spec.SC_SGL_OFFSET_INVALID)
            limit = (spec.ADMIN_IN_CAPSULE_MAX if self.qid <= 0 or sqe.opcode == spec.OPC_FABRICS
                     else self.state.config.in_capsule_data_size)
            if len(data) > limit:
                return status(spec.SC_SGL_OFFSET_INVALID)
            if sgl.length != len(data):
                return status(spec.SC_SGL_DATA_LEN_INVALID)
            return 0
        if sgl.sgl_id == P.SGL_DATA_BLOCK_OFFSET:
            return status(spec.SC_SGL_DATA_LEN_INVALID) if sgl.length else 0
        if sgl.sgl_id != P.SGL_TRANSPORT_DATA_BLOCK:
            return status(spec.SC_SGL_DESC_TYPE_INVALID)
        return 0

    # --- fabrics ------------------------------------------------------------------------

    def _on_fabrics(self, sqe: P.Sqe, data: bytes | memoryview) -> None:
        fctype = sqe.fctype
        if fctype == spec.FCTYPE_CONNECT:
            self._on_connect(sqe, data)
            return
        ctrl = self.ctrl
        if self._state != _CONNECTED or ctrl is None:
            self._complete(sqe.cid, status(spec.SC_INVALID_OPCODE))
            return
        if self.qid != 0:
            self._complete(sqe.cid, status(spec.SC_INVALID_OPCODE))
            return
        size8 = sqe.cdw10 & 0x7
        ofst = sqe.cdw11
        if fctype == spec.FCTYPE_PROPERTY_GET:
            if size8 == 1 and ofst == spec.PROP_CAP:
                cap = spec.make_cap(mqes=self.state.config.max_queue_size - 1)
                self._complete(sqe.cid, 0, cap & 0xFFFFFFFF, cap >> 32)
            elif size8 == 0 and ofst in (spec.PROP_VS, spec.PROP_CC, spec.PROP_CSTS):
                value = {spec.PROP_VS: self.state.vs, spec.PROP_CC: ctrl.cc,
                         spec.PROP_CSTS: ctrl.csts}[ofst]
                self._complete(sqe.cid, 0, value)
            else:
                self._complete(sqe.cid, status(spec.SC_INVALID_FIELD))
        elif fctype == spec.FCTYPE_PROPERTY_SET:
            if size8 == 0 and ofst == spec.PROP_CC:
                ctrl.set_cc(sqe.cdw12)
                self._complete(sqe.cid)
            else:
                self._complete(sqe.cid, status(spec.SC_INVALID_FIELD))
        else:
            self._complete(sqe.cid, status(spec.SC_INVALID_OPCODE))

    def _on_connect(self, sqe: P.Sqe, data: bytes | memoryview) -> None:
        cid = sqe.cid
        cs = spec.SCT_COMMAND_SPECIFIC
        if self._state == _CONNECTED:
            self._complete(cid, status(spec.SC_CONNECT_CTRL_BUSY, cs))
            return
        if len(data) != spec.CONNECT_DATA_LEN:
            self._complete(cid, status(spec.SC_SGL_DATA_LEN_INVALID))
            return
        recfmt, qid = sqe.cdw10 & 0xFFFF, sqe.cdw10 >> 16
        sqsize, cattr = sqe.cdw11 & 0xFFFF, (sqe.cdw11 >> 16) & 0xFF
        kato = sqe.cdw12
        cfg = self.state.config
        if recfmt != 0:
            self._complete(cid, status(spec.SC_CONNECT_INCOMPATIBLE_FORMAT, cs), 40)
            return
        cd = spec.ConnectData.decode(data)
        subsys = self.state.find_subsystem(cd.subnqn)
        if subsys is None:
            log.info("connect from %s to unknown subsystem %r", self.peer, cd.subnqn)
            self._complete(cid, status(spec.SC_CONNECT_INVALID_PARAM, cs), (1 << 16) | 256)
            return
        if not subsys.host_allowed(cd.hostnqn):
            log.warning("connect from %s: host %r not allowed on %s", self.peer, cd.hostnqn,
                        subsys.nqn)
            self._complete(cid, status(spec.SC_CONNECT_INVALID_HOST, cs), (1 << 16) | 512)
            return
        if sqsize == 0 or sqsize + 1 > cfg.max_queue_size:
            self._complete(cid, status(spec.SC_CONNECT_INVALID_PARAM, cs), 44)
            return
        if qid == 0:
            if cd.cntlid != 0xFFFF:
                self._complete(cid, status(spec.SC_CONNECT_INVALID_PARAM, cs), (1 << 16) | 16)
                return
            ctrl = subsys.new_controller(cd.hostnqn, cd.hostid, kato)
            ctrl.queues[0] = self
            ctrl.arm_keep_alive(self.state.loop, cfg.kato_grace_s)
        else:
            found = subsys.controllers.get(cd.cntlid)
            if found is None or found.deleted:
                self._complete(cid, status(spec.SC_CONNECT_INVALID_PARAM, cs), (1 << 16) | 16)
                return
            if found.hostnqn != cd.hostnqn:
                self._complete(cid, status(spec.SC_CONNECT_INVALID_PARAM, cs), (1 << 16) | 512)
                return
            if subsys.is_discovery or qid > cfg.max_io_queues:
                self._complete(cid, status(spec.SC_CONNECT_INVALID_PARAM, cs), 42)
                return
            if qid in found.queues:
                self._complete(cid, status(spec.SC_CMD_SEQ_ERROR))
                return
            ctrl = found
            ctrl.queues[qid] = self
            ctrl.touch()
        self.ctrl = ctrl
        self.subsys = subsys
        self.qid = qid
        self.sq_entries = sqsize + 1
        self.sqhd = 1 % self.sq_entries
        self.sqflow_disabled = bool(cattr & spec.CATTR_DISABLE_SQ_FLOW)
        self._state = _CONNECTED
        log.info("%s connected %s qid %d cntlid %d (host %s)", self.peer, subsys.nqn, qid,
                 ctrl.cntlid, cd.hostnqn)
        self._complete(cid, 0, ctrl.cntlid)

    # --- admin --------------------------------------------------------------------------

    def _on_admin(self, ctrl: Controller, sqe: P.Sqe) -> None:
        opc = sqe.opcode
        if not ctrl.ready:
            self._complete(sqe.cid, status(spec.SC_CMD_SEQ_ERROR))
            return
        disc = ctrl.subsys.is_discovery
        if opc == spec.ADMIN_IDENTIFY:
            self._identify(ctrl, sqe)
        elif opc == spec.ADMIN_GET_LOG_PAGE:
            self._get_log_page(ctrl, sqe)
        elif opc == spec.ADMIN_KEEP_ALIVE:
            self._complete(sqe.cid)
        elif opc in (spec.ADMIN_SET_FEATURES, spec.ADMIN_GET_FEATURES):
            self._features(ctrl, sqe, opc == spec.ADMIN_SET_FEATURES)
        elif opc == spec.ADMIN_ASYNC_EVENT:
            if len(self.aers) >= MAX_AERS:
                self._complete(sqe.cid, status(spec.SC_AER_LIMIT_EXCEEDED,
                                               spec.SCT_COMMAND_SPECIFIC))
            else:
                self.aers.append(sqe.cid)  # completes only when an event occurs
        elif opc == spec.ADMIN_ABORT and not disc:
            self._complete(sqe.cid, 0, 1)  # bit 0 set: the command was not aborted
        else:
            self._complete(sqe.cid, status(spec.SC_INVALID_OPCODE))

    def _data_len_ok(self, sqe: P.Sqe, length: int) -> bool:
        if sqe.sgl.sgl_id != P.SGL_TRANSPORT_DATA_BLOCK or sqe.sgl.length != length:
            self._complete(sqe.cid, status(spec.SC_SGL_DATA_LEN_INVALID))
            return False
        return True

    def _identify(self, ctrl: Controller, sqe: P.Sqe) -> None:
        cns = sqe.cdw10 & 0xFF
        subsys = ctrl.subsys
        if subsys.is_discovery and cns != spec.CNS_CONTROLLER:
            self._complete(sqe.cid, status(spec.SC_INVALID_FIELD))
            return
        nsid = sqe.nsid
        data: bytes
        if cns == spec.CNS_CONTROLLER:
            data = self.state.identify_controller(ctrl)
        elif cns == spec.CNS_NAMESPACE:
            if nsid == 0 or nsid == 0xFFFFFFFF:
                self._complete(sqe.cid, status(spec.SC_INVALID_NS))
                return
            ns = subsys.namespaces.get(nsid)
            data = ns.identify() if ns is not None else bytes(spec.IDENTIFY_DATA_LEN)
        elif cns == spec.CNS_ACTIVE_NS_LIST:
            if nsid >= 0xFFFFFFFE:
                self._complete(sqe.cid, status(spec.SC_INVALID_NS))
                return
            data = spec.encode_ns_list([n for n in subsys.namespaces if n > nsid])
        elif cns == spec.CNS_NS_DESC_LIST:
            ns = subsys.namespaces.get(nsid)
            if ns is None:
                self._complete(sqe.cid, status(spec.SC_INVALID_NS))
                return
            data = spec.encode_ns_descriptors(ns.uuid.bytes, ns.uuid.bytes)
        elif cns == spec.CNS_CS_CONTROLLER and (sqe.cdw11 >> 24) == 0:
            data = bytes(spec.IDENTIFY_DATA_LEN)  # NVM command set: no extra limits
        else:
            self._complete(sqe.cid, status(spec.SC_INVALID_FIELD))
            return
        if self._data_len_ok(sqe, spec.IDENTIFY_DATA_LEN):
            self._send_data(sqe.cid, data)

    def _get_log_page(self, ctrl: Controller, sqe: P.Sqe) -> None:
        lid = sqe.cdw10 & 0xFF
        numd = ((sqe.cdw11 & 0xFFFF) << 16 | (sqe.cdw10 >> 16)) + 1
        length = numd * 4
        offset = sqe.cdw12 | (sqe.cdw13 << 32)
        if offset % 4:
            self._complete(sqe.cid, status(spec.SC_INVALID_FIELD))
            return
        if ctrl.subsys.is_discovery:
            if lid != spec.LID_DISCOVERY:
                self._complete(sqe.cid, status(spec.SC_INVALID_LOG_PAGE,
                                               spec.SCT_COMMAND_SPECIFIC))
                return
            log_data = self.state.discovery_log(ctrl.hostnqn, self.local)
        elif lid in (spec.LID_ERROR, spec.LID_SMART, spec.LID_FW_SLOT):
            log_data = b""  # nothing to report: an all-zero page
        else:
            self._complete(sqe.cid, status(spec.SC_INVALID_LOG_PAGE, spec.SCT_COMMAND_SPECIFIC))
            return
        if length > (1 << 20):
            self._complete(sqe.cid, status(spec.SC_INVALID_FIELD))
            return
        chunk = log_data[offset: offset + length]
        if self._data_len_ok(sqe, length):
            self._send_data(sqe.cid, chunk + bytes(length - len(chunk)))

    def _features(self, ctrl: Controller, sqe: P.Sqe, is_set: bool) -> None:
        fid = sqe.cdw10 & 0xFF
        nq = self.state.config.max_io_queues - 1
        if fid == spec.FID_NUMBER_OF_QUEUES and not ctrl.subsys.is_discovery:
            if is_set and (sqe.cdw11 & 0xFFFF == 0xFFFF or sqe.cdw11 >> 16 == 0xFFFF):
                self._complete(sqe.cid, status(spec.SC_INVALID_FIELD))
                return
            self._complete(sqe.cid, 0, (nq << 16) | nq)
        elif fid == spec.FID_KEEP_ALIVE_TIMER:
            if is_set:
                ctrl.kato_ms = sqe.cdw11
                ctrl.arm_keep_alive(self.state.loop, self.state.config.kato_grace_s)
            self._complete(sqe.cid, 0, 0 if is_set else ctrl.kato_ms)
        elif fid == spec.FID_ASYNC_EVENT_CONFIG:
            if is_set:
                ctrl.aec = sqe.cdw11
            self._complete(sqe.cid, 0, 0 if is_set else ctrl.aec)
        else:
            self._complete(sqe.cid, status(spec.SC_INVALID_FIELD))

    # --- I/O ----------------------------------------------------------------------------

    def _on_io(self, ctrl: Controller, sqe: P.Sqe, data: bytes | memoryview) -> None:
        if not ctrl.ready:
            self._complete(sqe.cid, status(spec.SC_CMD_SEQ_ERROR))
            return
        opc = sqe.opcode
        if opc not in (spec.IO_READ, spec.IO_WRITE, spec.IO_FLUSH):
            self._complete(sqe.cid, status(spec.SC_INVALID_OPCODE))
            return
        ns = ctrl.subsys.namespaces.get(sqe.nsid)
        if ns is None:
            self._complete(sqe.cid, status(spec.SC_INVALID_NS))
            return
        if opc == spec.IO_FLUSH:
            try:
                ns.backing.flush()
            except OSError as exc:
                log.error("flush of namespace %d failed: %s", ns.nsid, exc)
                self._complete(sqe.cid, status(spec.SC_INTERNAL, dnr=False))
                return
            self._complete(sqe.cid)
            return
        slba, nlb = sqe.slba, sqe.nlb
        if slba + nlb > ns.nblocks:
            self._complete(sqe.cid, status(spec.SC_LBA_OUT_OF_RANGE))
            return
        length = nlb * ns.lba_size
        if length > self.state.max_transfer:
            self._complete(sqe.cid, status(spec.SC_INVALID_FIELD))
            return
        offset = slba * ns.lba_size
        if opc == spec.IO_READ:
            if data:
                self._complete(sqe.cid, status(spec.SC_INVALID_FIELD))  # in-capsule on a read
                return
            if not self._data_len_ok(sqe, length):
                return
            try:
                view = ns.backing.view(offset, length) if length > _BATCH_LIMIT else None
                payload = view if view is not None else ns.backing.read(offset, length)
            except OSError as exc:
                log.error("read of namespace %d failed: %s", ns.nsid, exc)
                self._complete(sqe.cid, status(spec.SC_DATA_TRANSFER_ERROR, dnr=False))
                return
            self._send_data(sqe.cid, payload)
            return
        if data:
            if len(data) != length:
                self._complete(sqe.cid, status(spec.SC_SGL_DATA_LEN_INVALID))
                return
            self._do_write(sqe.cid, ns, offset, data)
            return
        if sqe.sgl.length != length:
            self._complete(sqe.cid, status(spec.SC_SGL_DATA_LEN_INVALID))
            return
        # Transport data: ask for all of it with one R2T (TTAG = CID; CIDs are unique).
        direct = ns.backing.view(offset, length)
        buf = None
        if direct is None:
            buf = self._take_buffer(length)
            direct = memoryview(buf)[:length]
        self.pending[sqe.cid] = _PendingWrite(sqe.cid, ns, offset, length, direct, buf)
        self._write(P.R2T(sqe.cid, sqe.cid, 0, length))

    def _do_write(self, cid: int, ns: Namespace, offset: int,
                  data: bytes | bytearray | memoryview) -> None:
        try:
            ns.backing.write(offset, data)
        except OSError as exc:
            log.error("write of namespace %d failed: %s", ns.nsid, exc)
            self._complete(cid, status(spec.SC_DATA_TRANSFER_ERROR, dnr=False))
            return
        self._complete(cid)

    def _check_h2c(self, pdu: P.H2CData, n: int) -> _PendingWrite:
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
            self._complete(pw.cid, status(spec.SC_TRANSIENT_TRANSPORT, dnr=False))
        elif pw.buf is None:
            self._complete(pw.cid)  # the data already sits in the backing's memory
        else:
            self._do_write(pw.cid, pw.ns, pw.offset, pw.dest)
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
