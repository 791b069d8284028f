"""The conformance harness's scripted host: raw NVMe/TCP connections driven PDU by PDU,
what a command's answer reduces to (:class:`Outcome`), and the admin-queue bring-up and
command helpers the cases share. Nothing here knows about any particular case."""

from __future__ import annotations

import socket
import time
import uuid
from dataclasses import dataclass, field

from kvtool.nvme import pdu as P
from kvtool.nvme import spec

HOSTNQN = "nqn.2014-08.org.nvmexpress:uuid:6b767463-6f6e-666f-726d-616e63650001"
HOSTID = uuid.UUID("6b767463-6f6e-666f-726d-616e63650001").bytes
TIMEOUT = 5.0
NO_SGL = P.SglDescriptor(0, 0, 0)  # an all-zero Data Block descriptor (sub-type Address)


# --- a scripted host ------------------------------------------------------------------------


class Closed(Exception):
    """The target ended the connection; ``term`` is its C2HTermReq, if it sent one."""

    def __init__(self, term: P.TermReq | None) -> None:
        super().__init__("connection closed" + (f" after C2HTermReq FES {term.fes:#x}"
                                                if term else ""))
        self.term = term


@dataclass
class Reply:
    """What came back for one command."""

    cqe: P.Cqe
    data: bytes = b""
    r2ts: int = 0


class RawHost:
    """One NVMe/TCP connection driven PDU by PDU (blocking, single command at a time)."""

    def __init__(self, addr: tuple[str, int], *, timeout: float = TIMEOUT) -> None:
        self.sock = socket.create_connection(addr, timeout=timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.parser = P.PduParser(max_data=16 << 20)
        self.hdgst = self.ddgst = False
        self.cpda = 0
        self.next_cid = 1

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> RawHost:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def send_raw(self, raw: bytes) -> None:
        self.sock.sendall(raw)

    def send(self, pdu: P.Pdu) -> None:
        self.send_raw(P.encode(pdu, hdgst=self.hdgst, ddgst=self.ddgst))

    def recv(self) -> P.Pdu:
        while True:
            try:
                pdu = self.parser.next_pdu()
            except P.DataDigestError as exc:
                pdu = exc.pdu
            if pdu is not None:
                if isinstance(pdu, P.TermReq):
                    raise Closed(pdu)
                return pdu
            try:
                chunk = self.sock.recv(1 << 20)
            except (ConnectionResetError, BrokenPipeError):
                chunk = b""
            if not chunk:
                raise Closed(None)
            self.parser.feed(chunk)

    def icreq(self, *, hdgst: bool = False, ddgst: bool = False, hpda: int = 0) -> P.ICResp:
        self.send(P.ICReq(pfv=0, hpda=hpda, hdgst=hdgst, ddgst=ddgst, maxr2t=0))
        resp = self.recv()
        if not isinstance(resp, P.ICResp):
            raise ProtocolViolation(f"expected ICResp, got {type(resp).__name__}")
        self.hdgst, self.ddgst, self.cpda = resp.hdgst, resp.ddgst, resp.cpda
        self.parser.hdgst, self.parser.ddgst = resp.hdgst, resp.ddgst
        return resp

    def command(self, sqe: P.Sqe, *, data: bytes = b"", read: int = 0,
                write: bytes = b"", sgl: P.SglDescriptor | None = None) -> Reply:
        """Send ``sqe``: ``data`` in-capsule, or ``write`` after the target's R2Ts, or
        ``read`` bytes expected in C2HData. ``sgl`` overrides the descriptor the host
        would build (Transport Data Block for ``read``/``write``, else the in-capsule one)."""
        sqe.cid = self.next_cid
        self.next_cid = self.next_cid % 0xFFF0 + 1
        if sgl is None:
            if data:
                sgl = P.SglDescriptor.in_capsule(len(data))
            else:
                sgl = P.SglDescriptor.transport(read or len(write))
        sqe.sgl = sgl
        self.send(P.CapsuleCmd(sqe, data))
        got = bytearray()
        r2ts = 0
        while True:
            pdu = self.recv()
            if isinstance(pdu, P.CapsuleResp):
                return Reply(pdu.cqe, bytes(got), r2ts)
            if isinstance(pdu, P.C2HData):
                if pdu.datao != len(got):
                    raise ProtocolViolation(f"C2HData DATAO {pdu.datao}, expected {len(got)}")
                got += pdu.data
                if pdu.success:
                    return Reply(P.Cqe(sqe.cid, 0), bytes(got), r2ts)
            elif isinstance(pdu, P.R2T):
                r2ts += 1
                chunk = write[pdu.r2to: pdu.r2to + pdu.r2tl]
                self.send(P.H2CData(sqe.cid, pdu.ttag, pdu.r2to, chunk, last=True))
            else:
                raise ProtocolViolation(f"unexpected {type(pdu).__name__}")


class ProtocolViolation(Exception):
    """The target sent something a host cannot accept."""


# --- outcomes --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Outcome:
    """The comparable result of a case: ``kind`` is ``status`` or ``closed``; ``status``
    is "SUCCESS" or "SCT/SC name (DNR)"; ``facts`` are the fields compared; ``note`` is
    shown but not compared (e.g. whether a TermReq came before the close)."""

    kind: str
    status: str = ""
    facts: tuple[tuple[str, str], ...] = ()
    note: str = ""

    def key(self) -> tuple[str, str, tuple[tuple[str, str], ...]]:
        return (self.kind, self.status, self.facts)

    def text(self) -> str:
        if self.kind == "error":
            return f"harness error: {self.note}"
        if self.kind == "no answer":
            return f"no answer in {TIMEOUT:g} s"
        if self.kind == "closed":
            return "connection closed" + (f" ({self.note})" if self.note else "")
        out = self.status
        if self.facts:
            out += "; " + ", ".join(f"{k}={v}" for k, v in self.facts)
        return out


def status_text(cqe: P.Cqe) -> str:
    if cqe.ok:
        return "SUCCESS"
    return f"{spec.status_name(cqe.sct, cqe.sc)}{' (DNR)' if cqe.dnr else ''}"


def outcome(reply: Reply, **facts: object) -> Outcome:
    return Outcome("status", status_text(reply.cqe),
                   tuple((k, str(v)) for k, v in facts.items()))


def closed(exc: Closed) -> Outcome:
    note = f"after C2HTermReq FES {exc.term.fes:#x}" if exc.term else "no C2HTermReq"
    return Outcome("closed", note=note)


# --- the target under test -------------------------------------------------------------------


@dataclass
class Target:
    host: str
    port: int
    nqn: str
    nsze: int = 0
    lba: int = 512
    mqes: int = 0
    facts: dict[str, str] = field(default_factory=dict)

    @property
    def addr(self) -> tuple[str, int]:
        return (self.host, self.port)


def connect_data(subnqn: str, cntlid: int = 0xFFFF, hostnqn: str = HOSTNQN) -> bytes:
    return spec.ConnectData(HOSTID, cntlid, subnqn, hostnqn).encode()


def fabrics_connect(h: RawHost, subnqn: str, *, qid: int = 0, sqsize: int = 31,
                    cntlid: int = 0xFFFF, kato: int = 30000) -> Reply:
    sqe = P.Sqe(spec.OPC_FABRICS, nsid=spec.FCTYPE_CONNECT, cdw10=qid << 16, cdw11=sqsize,
                cdw12=kato if qid == 0 else 0)
    return h.command(sqe, data=connect_data(subnqn, cntlid))


def prop_get(h: RawHost, offset: int, *, eight: bool = False,
             sgl: P.SglDescriptor | None = None) -> Reply:
    return h.command(P.Sqe(spec.OPC_FABRICS, nsid=spec.FCTYPE_PROPERTY_GET,
                           cdw10=1 if eight else 0, cdw11=offset), sgl=sgl)


def prop_set(h: RawHost, offset: int, value: int, *,
             sgl: P.SglDescriptor | None = None) -> Reply:
    return h.command(P.Sqe(spec.OPC_FABRICS, nsid=spec.FCTYPE_PROPERTY_SET, cdw11=offset,
                           cdw12=value), sgl=sgl)


class Session:
    """An admin queue (and optionally one I/O queue) brought up the Linux host's way."""

    def __init__(self, t: Target, *, enable: bool = True, io: bool = False,
                 hdgst: bool = False, ddgst: bool = False) -> None:
        self.t = t
        self.admin = RawHost(t.addr)
        self.io: RawHost | None = None
        try:
            self.admin.icreq()
            r = fabrics_connect(self.admin, t.nqn)
            if not r.cqe.ok:
                raise ProtocolViolation(f"admin Connect failed: {status_text(r.cqe)}")
            self.cntlid = r.cqe.dw0 & 0xFFFF
            if enable:
                self.enable()
            if io:
                self.io = self.open_io(1, hdgst=hdgst, ddgst=ddgst)
        except BaseException:
            self.close()
            raise

    def enable(self) -> None:
        prop_set(self.admin, spec.PROP_CC, spec.CC_DEFAULT_ENABLE)
        deadline = time.monotonic() + TIMEOUT
        while not prop_get(self.admin, spec.PROP_CSTS).cqe.dw0 & spec.CSTS_RDY:
            if time.monotonic() > deadline:
                raise ProtocolViolation("CSTS.RDY never became 1")
            time.sleep(0.01)

    def open_io(self, qid: int, *, hdgst: bool = False, ddgst: bool = False,
                sqsize: int = 31) -> RawHost:
        h = RawHost(self.t.addr)
        try:
            h.icreq(hdgst=hdgst, ddgst=ddgst)
            r = fabrics_connect(h, self.t.nqn, qid=qid, sqsize=sqsize, cntlid=self.cntlid)
            if not r.cqe.ok:
                raise ProtocolViolation(f"I/O Connect failed: {status_text(r.cqe)}")
        except BaseException:
            h.close()
            raise
        return h

    def close(self) -> None:
        if self.io is not None:
            self.io.close()
        self.admin.close()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def admin_cmd(s: Session, opc: int, *, nsid: int = 0, cdw10: int = 0, cdw11: int = 0,
              cdw12: int = 0, read: int = 0, sgl: P.SglDescriptor | None = None) -> Reply:
    return s.admin.command(P.Sqe(opc, nsid=nsid, cdw10=cdw10, cdw11=cdw11, cdw12=cdw12),
                           read=read, sgl=sgl)


def identify(s: Session, cns: int, nsid: int = 0, cdw11: int = 0, length: int = 4096) -> Reply:
    return admin_cmd(s, spec.ADMIN_IDENTIFY, nsid=nsid, cdw10=cns, cdw11=cdw11, read=length)


def get_log(s: Session, lid: int, length: int, *, nsid: int = 0, offset: int = 0,
            rae: bool = False) -> Reply:
    numd = length // 4 - 1
    return s.admin.command(P.Sqe(spec.ADMIN_GET_LOG_PAGE, nsid=nsid,
                                 cdw10=lid | ((numd & 0xFFFF) << 16) | (1 << 15 if rae else 0),
                                 cdw11=numd >> 16, cdw12=offset), read=length)


def rw(h: RawHost, opc: int, slba: int, nlb: int, *, data: bytes = b"", read: int = 0,
       write: bytes = b"", sgl: P.SglDescriptor | None = None, nsid: int = 1,
       cdw12_extra: int = 0) -> Reply:
    return h.command(P.Sqe(opc, nsid=nsid, cdw10=slba & 0xFFFFFFFF, cdw11=slba >> 32,
                           cdw12=((nlb - 1) & 0xFFFF) | cdw12_extra),
                     data=data, read=read, write=write, sgl=sgl)

