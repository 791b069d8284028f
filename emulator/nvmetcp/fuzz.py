"""Fuzzing harness for the target's PDU state machine (used by tests and bench/nvme_fuzz.py).

:class:`Harness` drives :class:`~emulator.nvmetcp.connection.QueueConnection` directly —
no sockets — with a fake transport, so hundreds of thousands of inputs run in a minute.
Each input is one connection's byte stream, fed in random-sized chunks. After each input
the harness checks the invariants the target promises:

* nothing raised out of ``data_received`` and no *internal error* was logged (a logged
  internal error means a code path the fuzzer reached was not handled deliberately);
* every byte the target wrote parses as well-formed controller→host PDUs;
* a connection the target closed was closed after a C2HTermReq, or by an orderly path.

:func:`seed_sessions` builds valid sessions (admin bring-up, in-capsule and R2T writes,
reads, digests, a DH-HMAC-CHAP exchange the target refuses) and :func:`mutate` derives
malformed variants from them (bit flips, byte replacement, truncation, insertion,
duplication, splicing, header-field rewrites).
"""

from __future__ import annotations

import asyncio
import logging
import random
import struct
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from emulator.nvmetcp.auth import load_host_keys
from emulator.nvmetcp.config import HostKeyConfig, simple_config
from emulator.nvmetcp.connection import QueueConnection
from emulator.nvmetcp.subsystem import build_subsystems
from emulator.nvmetcp.target import TargetState
from kvtool.nvme import dhchap, spec
from kvtool.nvme import pdu as P

NQN = "nqn.2026-01.io.kvtool:fuzz"
HOSTNQN = "nqn.2026-01.io.kvtool:fuzz-host"
AUTH_HOSTNQN = "nqn.2026-01.io.kvtool:fuzz-auth-host"  # must pass DH-HMAC-CHAP (NULL group)


class FakeTransport(asyncio.Transport):
    """Collects what the target writes; records close."""

    def __init__(self) -> None:
        super().__init__()
        self.out = bytearray()
        self.closed = False

    def write(self, data: Any) -> None:
        if self.closed:
            raise AssertionError("write after close")
        self.out += data

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": ("127.0.0.1", 40000), "sockname": ("127.0.0.1", 4420)}.get(
            name, default)


class _InternalErrors(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info:
            self.records.append(record)


@dataclass
class Stats:
    inputs: int = 0
    terminated: int = 0
    responses: int = 0
    failures: list[str] = field(default_factory=list)


class Harness:
    """A target state (memory namespace) plus an event loop that is never run."""

    def __init__(self, *, mdts: int = 4, queue_size: int = 8, hot_path: bool = True) -> None:
        self.hot_path = hot_path  # QueueConnection.hot_path of the connections it runs
        self._keydir = tempfile.TemporaryDirectory(prefix="kvtool-fuzz-")
        key = Path(self._keydir.name) / "host.key"
        dhchap.write_secret_file(key, dhchap.generate_secret())
        cfg = simple_config(nqn=NQN, backing="1MiB", hosts=[HOSTNQN, AUTH_HOSTNQN],
                            listen=["127.0.0.1:0"], mdts=mdts, max_queue_size=queue_size,
                            in_capsule_data_size=32768, maxh2cdata=8192,
                            host_keys=[HostKeyConfig(AUTH_HOSTNQN, str(key), None,
                                                     ["sha256"], ["null"])])
        self.loop = asyncio.new_event_loop()
        self.state = TargetState(cfg, build_subsystems(cfg), self.loop,
                                 load_host_keys(cfg))
        self.state.listeners = [("127.0.0.1", 4420)]
        self.errors = _InternalErrors()
        logger = logging.getLogger("emulator.nvmetcp")
        logger.addHandler(self.errors)
        self._logger = logger
        self._old_level = logger.level
        logger.setLevel(logging.ERROR)  # fuzzing makes a lot of expected warnings
        self.stats = Stats()
        # A long-lived, enabled controller (cntlid 1) so I/O-queue sessions reach real I/O.
        self._admin = QueueConnection(self.state)
        self._admin.connection_made(FakeTransport())
        self._admin.data_received(admin_session())
        if self._admin.ctrl is None or not self._admin.ctrl.ready:
            raise RuntimeError("fuzz harness: the admin bring-up failed")
        self.cntlid = self._admin.ctrl.cntlid

    def close(self) -> None:
        self._admin.connection_lost(None)
        self._logger.removeHandler(self.errors)
        self._logger.setLevel(self._old_level)
        for sub in self.state.subsystems.values():
            for ns in sub.namespaces.values():
                ns.backing.close()
        self.loop.close()
        self._keydir.cleanup()

    def run(self, stream: bytes, rng: random.Random | None = None) -> bytes:
        """Feed ``stream`` to a fresh connection; check the invariants; return its output."""
        rng = rng or random.Random(len(stream))
        conn = QueueConnection(self.state)
        conn.stream_min = 2048  # larger in-capsule data takes the streamed (in-place) path
        conn.hot_path = self.hot_path
        tr = FakeTransport()
        conn.connection_made(tr)
        before = len(self.errors.records)
        pos = 0
        try:
            while pos < len(stream) and not tr.closed:
                n = rng.choice((1, 3, 8, 24, 72, 128, 512, 4096, 1 << 20))
                conn.data_received(stream[pos: pos + n])
                pos += n
        except Exception as exc:  # the invariant: nothing escapes
            self.stats.failures.append(f"data_received raised {exc!r}")
        finally:
            conn.connection_lost(None)
        self.stats.inputs += 1
        if len(self.errors.records) > before:
            rec = self.errors.records[-1]
            self.stats.failures.append(f"internal error: {rec.getMessage()} {rec.exc_info!r}")
        out = bytes(tr.out)
        problem = check_output(out, hdgst=conn.hdgst, ddgst=conn.ddgst)
        if problem:
            self.stats.failures.append(problem)
        if tr.closed and out and _last_type(out) == P.PduType.C2H_TERM_REQ:
            self.stats.terminated += 1
        self.stats.responses += out.count(bytes([P.PduType.CAPSULE_RESP]))
        return out


def _last_type(out: bytes) -> int:
    pos, last = 0, -1
    while pos + 8 <= len(out):
        last = out[pos]
        plen = struct.unpack_from("<I", out, pos + 4)[0]
        if plen < 8:
            break
        pos += plen
    return last


def check_output(out: bytes, *, hdgst: bool, ddgst: bool) -> str | None:
    """Parse the target's output as controller→host PDUs; return a problem or None.

    The ICResp (first PDU) is parsed without digests, the rest with the negotiated ones.
    """
    if not out:
        return None
    parser = P.PduParser(max_data=1 << 24)
    parser.feed(out)
    try:
        first = parser.next_pdu()
        if not isinstance(first, P.ICResp | P.TermReq):
            return f"first PDU from the target is {type(first).__name__}"
        parser.hdgst, parser.ddgst = hdgst, ddgst
        while True:
            pdu = parser.next_pdu()
            if pdu is None:
                break
            if isinstance(pdu, P.ICReq | P.CapsuleCmd | P.H2CData) or (
                    isinstance(pdu, P.TermReq) and pdu.h2c):
                return f"target sent a host-side PDU {type(pdu).__name__}"
    except P.PduError as exc:
        return f"target output does not parse: {exc}"
    if parser.buffered:
        return f"target output ends with {parser.buffered} bytes of a partial PDU"
    return None


# --- valid sessions ------------------------------------------------------------------------


def _cmd(sqe: P.Sqe, data: bytes = b"", *, hd: bool, dd: bool, transport_len: int = 0) -> bytes:
    sqe.flags = P.SQE_FLAGS_PSDT_SGL
    if data:
        sqe.sgl = P.SglDescriptor.in_capsule(len(data))
    else:
        sqe.sgl = P.SglDescriptor.transport(transport_len)
    return P.encode(P.CapsuleCmd(sqe, data), hdgst=hd, ddgst=dd)


def _connect(qid: int, cntlid: int, *, hd: bool, dd: bool, cid: int = 0,
             hostnqn: str = HOSTNQN, cattr: int = 0) -> bytes:
    data = spec.ConnectData(bytes(16), cntlid, NQN, hostnqn).encode()
    return _cmd(P.Sqe(spec.OPC_FABRICS, cid=cid, nsid=spec.FCTYPE_CONNECT, cdw10=qid << 16,
                      cdw11=7 | (cattr << 16), cdw12=0), data, hd=hd, dd=dd)


def admin_session(*, hd: bool = False, dd: bool = False) -> bytes:
    """ICReq, Connect qid 0, CC.EN, CSTS, Identify ctrl/ns/list, features, log page."""
    parts = [P.encode(P.ICReq(hdgst=hd, ddgst=dd)), _connect(0, 0xFFFF, hd=hd, dd=dd)]
    fab = spec.OPC_FABRICS
    parts.append(_cmd(P.Sqe(fab, cid=1, nsid=spec.FCTYPE_PROPERTY_SET, cdw11=spec.PROP_CC,
                            cdw12=spec.CC_DEFAULT_ENABLE), hd=hd, dd=dd))
    parts.append(_cmd(P.Sqe(fab, cid=2, nsid=spec.FCTYPE_PROPERTY_GET, cdw11=spec.PROP_CSTS),
                      hd=hd, dd=dd))
    parts.append(_cmd(P.Sqe(fab, cid=3, nsid=spec.FCTYPE_PROPERTY_GET, cdw10=1,
                            cdw11=spec.PROP_CAP), hd=hd, dd=dd))
    for cid, cns, nsid in ((4, spec.CNS_CONTROLLER, 0), (5, spec.CNS_NAMESPACE, 1),
                           (6, spec.CNS_ACTIVE_NS_LIST, 0), (7, spec.CNS_NS_DESC_LIST, 1)):
        parts.append(_cmd(P.Sqe(spec.ADMIN_IDENTIFY, cid=cid, nsid=nsid, cdw10=cns), hd=hd,
                          dd=dd, transport_len=4096))
    parts.append(_cmd(P.Sqe(spec.ADMIN_SET_FEATURES, cid=1, cdw10=spec.FID_NUMBER_OF_QUEUES,
                            cdw11=0x00010001), hd=hd, dd=dd))
    parts.append(_cmd(P.Sqe(spec.ADMIN_GET_LOG_PAGE, cid=2, cdw10=spec.LID_SMART | (127 << 16)),
                      hd=hd, dd=dd, transport_len=512))
    parts.append(_cmd(P.Sqe(spec.ADMIN_KEEP_ALIVE, cid=3), hd=hd, dd=dd))
    parts.append(_cmd(P.Sqe(spec.ADMIN_ASYNC_EVENT, cid=9), hd=hd, dd=dd))
    return b"".join(parts)


def io_session(rng: random.Random, *, hd: bool = False, dd: bool = False) -> bytes:
    """ICReq, Connect qid 1 to controller 1, in-capsule write, R2T-style write, reads."""
    parts = [P.encode(P.ICReq(hdgst=hd, ddgst=dd)), _connect(1, 1, hd=hd, dd=dd)]
    small = rng.randbytes(1024)
    parts.append(_cmd(P.Sqe(spec.IO_WRITE, cid=1, nsid=1, cdw10=8, cdw12=1), small, hd=hd,
                      dd=dd))
    big = rng.randbytes(12288)
    parts.append(_cmd(P.Sqe(spec.IO_WRITE, cid=2, nsid=1, cdw10=64, cdw12=23), hd=hd, dd=dd,
                      transport_len=len(big)))
    parts.append(P.encode(P.H2CData(2, 2, 0, big[:8192], last=False), hdgst=hd, ddgst=dd))
    parts.append(P.encode(P.H2CData(2, 2, 8192, big[8192:], last=True), hdgst=hd, ddgst=dd))
    parts.append(_cmd(P.Sqe(spec.IO_READ, cid=3, nsid=1, cdw10=64, cdw12=23), hd=hd, dd=dd,
                      transport_len=len(big)))
    parts.append(_cmd(P.Sqe(spec.IO_FLUSH, cid=4, nsid=1), hd=hd, dd=dd))
    return b"".join(parts)


def io_hot_session(rng: random.Random, *, hd: bool = False, dd: bool = False,
                   sqflow: bool = True) -> bytes:
    """Small Reads and in-capsule Writes of the kind the target's hot path answers (see
    ``QueueConnection._hot``), and their near misses that it leaves to the general path:
    the last blocks and one past them, FUA, another namespace, NLB disagreeing with the
    data, a Read at and past MDTS; ``sqflow=False`` connects with SQ flow control
    disabled (C2HData SUCCESS, SQHD 0xFFFF)."""
    parts = [P.encode(P.ICReq(hdgst=hd, ddgst=dd)),
             _connect(1, 1, hd=hd, dd=dd, cattr=0 if sqflow else spec.CATTR_DISABLE_SQ_FLOW)]
    w, r = spec.IO_WRITE, spec.IO_READ
    last = (1 << 20) // 512 - 1
    writes = ((0, 1, 512, 0), (8, 4, 2048, 0), (last - 3, 4, 2048, 0), (last, 2, 1024, 0),
              (16, 1, 512, 1 << 30), (24, 2, 512, 0))
    for cid, (slba, nlb, n, flags) in enumerate(writes, 1):
        parts.append(_cmd(P.Sqe(w, cid=cid, nsid=1, cdw10=slba, cdw12=(nlb - 1) | flags),
                          rng.randbytes(n), hd=hd, dd=dd))
    parts.append(_cmd(P.Sqe(w, cid=7, nsid=2, cdw10=0), rng.randbytes(512), hd=hd, dd=dd))
    reads = ((0, 8, 4096), (last, 1, 512), (last, 2, 1024), (8, 4, 4096), (0, 128, 65536),
             (0, 129, 66048), (last - 3, 4, 2048))
    for cid, (slba, nlb, n) in enumerate(reads, 8):
        parts.append(_cmd(P.Sqe(r, cid=cid, nsid=1, cdw10=slba, cdw12=nlb - 1), hd=hd,
                          dd=dd, transport_len=n))
    parts.append(_cmd(P.Sqe(r, cid=15, nsid=0xFFFFFFFF, cdw10=0), hd=hd, dd=dd,
                      transport_len=512))
    parts.append(_cmd(P.Sqe(spec.IO_FLUSH, cid=16, nsid=1), hd=hd, dd=dd))
    return b"".join(parts)


def admin_logs_session(*, hd: bool = False, dd: bool = False) -> bytes:
    """Bring-up with an all-zero SGL on the data-less commands, then every log page, the
    features, Get Host Identifier, an AER."""
    none = P.SglDescriptor(0, 0, 0)
    fab = spec.OPC_FABRICS
    parts = [P.encode(P.ICReq(hdgst=hd, ddgst=dd)), _connect(0, 0xFFFF, hd=hd, dd=dd)]
    for sqe in (P.Sqe(fab, cid=1, nsid=spec.FCTYPE_PROPERTY_SET, cdw11=spec.PROP_CC,
                      cdw12=spec.CC_DEFAULT_ENABLE, sgl=none),
                P.Sqe(fab, cid=2, nsid=spec.FCTYPE_PROPERTY_GET, cdw11=spec.PROP_CSTS,
                      sgl=none)):
        parts.append(P.encode(P.CapsuleCmd(sqe), hdgst=hd, ddgst=dd))
    cid = 3
    for lid, n in ((spec.LID_ERROR, 256), (spec.LID_SMART, 512), (spec.LID_FW_SLOT, 512),
                   (spec.LID_CHANGED_NS, 4096), (spec.LID_CMD_EFFECTS, 4096)):
        parts.append(_cmd(P.Sqe(spec.ADMIN_GET_LOG_PAGE, cid=cid, nsid=0xFFFFFFFF,
                                cdw10=lid | ((n // 4 - 1) << 16)), hd=hd, dd=dd,
                          transport_len=n))
        cid += 1
    for fid, cdw11 in ((spec.FID_ASYNC_EVENT_CONFIG, spec.AEN_CFG_NS_ATTR),
                       (spec.FID_KEEP_ALIVE_TIMER, 5000)):
        parts.append(_cmd(P.Sqe(spec.ADMIN_SET_FEATURES, cid=cid, cdw10=fid, cdw11=cdw11),
                          hd=hd, dd=dd))
        cid += 1
    parts.append(_cmd(P.Sqe(spec.ADMIN_GET_FEATURES, cid=cid, cdw10=spec.FID_HOST_ID,
                            cdw11=1), hd=hd, dd=dd, transport_len=16))
    parts.append(_cmd(P.Sqe(spec.ADMIN_ASYNC_EVENT, cid=cid + 1), hd=hd, dd=dd))
    return b"".join(parts)


def io_trim_session(*, hd: bool = False, dd: bool = False) -> bytes:
    """Write Zeroes, Dataset Management in-capsule and after an R2T, Flush."""
    parts = [P.encode(P.ICReq(hdgst=hd, ddgst=dd)), _connect(1, 1, hd=hd, dd=dd)]
    parts.append(_cmd(P.Sqe(spec.IO_WRITE_ZEROES, cid=1, nsid=1, cdw10=16, cdw12=7),
                      hd=hd, dd=dd))
    ranges = struct.pack("<IIQ", 0, 8, 32) + struct.pack("<IIQ", 0, 4, 100)
    parts.append(_cmd(P.Sqe(spec.IO_DSM, cid=2, nsid=1, cdw10=1, cdw11=4), ranges,
                      hd=hd, dd=dd))
    parts.append(_cmd(P.Sqe(spec.IO_DSM, cid=3, nsid=1, cdw10=1, cdw11=4), hd=hd, dd=dd,
                      transport_len=len(ranges)))
    parts.append(P.encode(P.H2CData(3, 3, 0, ranges, last=True), hdgst=hd, ddgst=dd))
    parts.append(_cmd(P.Sqe(spec.IO_FLUSH, cid=4, nsid=1), hd=hd, dd=dd))
    landed = bytes(range(256)) * 64  # 16 KiB in-capsule: received straight into place
    parts.append(_cmd(P.Sqe(spec.IO_WRITE, cid=5, nsid=1, cdw10=256, cdw12=31), landed,
                      hd=hd, dd=dd))
    parts.append(_cmd(P.Sqe(spec.IO_DSM, cid=6, nsid=1, cdw10=0, cdw11=4),
                      ranges[:16] + bytes(4000), hd=hd, dd=dd))  # streamed, not a write
    return b"".join(parts)


def auth_session(rng: random.Random, *, hd: bool = False, dd: bool = False) -> bytes:
    """Connect as a host that must authenticate; Identify before it (Authentication
    Required), AUTH_Negotiate, read the challenge, a Reply with a wrong response, read the
    Failure1 (the target then deletes the controller)."""
    fab = spec.OPC_FABRICS
    cdw10 = (dhchap.SECP_DHCHAP << 24) | (dhchap.SPSP << 16) | (dhchap.SPSP << 8)
    parts = [P.encode(P.ICReq(hdgst=hd, ddgst=dd)),
             _connect(0, 0xFFFF, hd=hd, dd=dd, hostnqn=AUTH_HOSTNQN),
             _cmd(P.Sqe(spec.ADMIN_IDENTIFY, cid=1, cdw10=spec.CNS_CONTROLLER), hd=hd, dd=dd,
                  transport_len=4096)]
    negotiate = dhchap.Negotiate(7).encode()
    reply = dhchap.Reply(7, rng.randbytes(32), bytes(32), False, 0).encode()
    for cid, msg in ((2, negotiate), (4, reply)):
        parts.append(_cmd(P.Sqe(fab, cid=cid, nsid=dhchap.FCTYPE_AUTH_SEND, cdw10=cdw10,
                                cdw11=len(msg)), msg, hd=hd, dd=dd))
        parts.append(_cmd(P.Sqe(fab, cid=cid + 1, nsid=dhchap.FCTYPE_AUTH_RECEIVE,
                                cdw10=cdw10, cdw11=4096), hd=hd, dd=dd, transport_len=4096))
    return b"".join(parts)


def seed_sessions(rng: random.Random) -> list[bytes]:
    out = []
    for hd, dd in ((False, False), (True, False), (False, True), (True, True)):
        out.append(admin_session(hd=hd, dd=dd))
        out.append(io_session(rng, hd=hd, dd=dd))
        out.append(admin_logs_session(hd=hd, dd=dd))
        out.append(io_trim_session(hd=hd, dd=dd))
        out.append(io_hot_session(rng, hd=hd, dd=dd))
        out.append(auth_session(rng, hd=hd, dd=dd))
    out.append(io_hot_session(rng, sqflow=False))
    return out


def _pdu_offsets(stream: bytes) -> list[int]:
    offs, pos = [], 0
    while pos + 8 <= len(stream):
        offs.append(pos)
        plen = struct.unpack_from("<I", stream, pos + 4)[0]
        if plen < 8:
            break
        pos += plen
    return offs


_INTERESTING = (0, 1, 2, 3, 4, 7, 8, 23, 24, 72, 127, 128, 255, 0x7F, 0x80, 0xFF, 0xFFFF,
                0x10000, 0x7FFFFFFF, 0xFFFFFFFF)


def mutate(stream: bytes, rng: random.Random, corpus: list[bytes]) -> bytes:
    """One malformed variant of ``stream`` (1–4 stacked mutations)."""
    data = bytearray(stream)
    offs = _pdu_offsets(stream) or [0]
    for _ in range(rng.randint(1, 4)):
        if not data:
            data = bytearray(rng.randbytes(rng.randint(1, 64)))
        op = rng.randrange(10)
        if op == 0:  # flip bits
            for _ in range(rng.randint(1, 8)):
                i = rng.randrange(len(data))
                data[i] ^= 1 << rng.randrange(8)
        elif op == 1:  # random bytes
            i = rng.randrange(len(data))
            n = rng.randint(1, 16)
            data[i: i + n] = rng.randbytes(n)
        elif op == 2:  # truncate
            del data[rng.randrange(len(data)):]
        elif op == 3:  # insert garbage
            i = rng.randrange(len(data) + 1)
            data[i:i] = rng.randbytes(rng.randint(1, 32))
        elif op in (4, 5, 6):  # rewrite a common-header field of one PDU
            base = rng.choice(offs)
            if base + 8 > len(data):
                continue
            fld = rng.choice(((0, "B"), (1, "B"), (2, "B"), (3, "B"), (4, "<I")))
            value = rng.choice(_INTERESTING) & (0xFF if fld[1] == "B" else 0xFFFFFFFF)
            struct.pack_into(fld[1], data, base + fld[0], value)
        elif op == 7:  # rewrite a PDU-specific u16/u32 (CID, TTAG, DATAO, DATAL, SQE dwords)
            base = rng.choice(offs)
            pos = base + rng.randrange(8, 72, 2)
            if pos + 4 > len(data):
                continue
            struct.pack_into("<I" if rng.random() < 0.5 else "<H", data, pos,
                             rng.choice(_INTERESTING) & 0xFFFF)
        elif op == 8:  # duplicate or drop one PDU
            if len(offs) < 2:
                continue
            k = rng.randrange(len(offs) - 1)
            piece = bytes(data[offs[k]: offs[k + 1]])
            if rng.random() < 0.5:
                data[offs[k]:offs[k]] = piece
            else:
                del data[offs[k]: offs[k + 1]]
            offs = _pdu_offsets(bytes(data)) or [0]
        else:  # splice with another session
            other = rng.choice(corpus)
            cut = rng.randrange(len(data) + 1)
            data = data[:cut] + bytearray(other[rng.randrange(len(other) + 1):])
    return bytes(data)


def run_fuzz(count: int, seed: int = 0, harness: Harness | None = None) -> Stats:
    """Run ``count`` mutated inputs (plus the valid seeds) and return the statistics."""
    rng = random.Random(seed)
    own = harness is None
    h = harness or Harness()
    try:
        corpus = seed_sessions(rng)
        for s in corpus:  # the valid seeds must work cleanly
            h.run(s, rng)
        for i in range(count):
            h.run(mutate(corpus[i % len(corpus)], rng, corpus), rng)
        return h.stats
    finally:
        if own:
            h.close()
