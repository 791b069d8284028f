"""The scripted cases: each plays one host behaviour against a :class:`Target` and reduces
the answer to an :class:`Outcome`. ``CASES`` lists them in order (group, name, function);
the label ``"group: name"`` is the key of docs/nvme-tcp.md's table and of ``REASONS``."""

from __future__ import annotations

import struct
import time
from collections.abc import Callable

from emulator.nvmetcp.conformance.host import (
    HOSTID,
    NO_SGL,
    Closed,
    Outcome,
    RawHost,
    Reply,
    Session,
    Target,
    admin_cmd,
    closed,
    connect_data,
    fabrics_connect,
    get_log,
    identify,
    outcome,
    prop_get,
    prop_set,
    rw,
    status_text,
)
from kvtool.nvme import pdu as P
from kvtool.nvme import spec

# --- cases -----------------------------------------------------------------------------------

Case = Callable[[Target], Outcome]
CASES: list[tuple[str, str, Case]] = []  # (group, name, function)


def case(group: str, name: str) -> Callable[[Case], Case]:
    def deco(fn: Case) -> Case:
        CASES.append((group, name, fn))
        return fn
    return deco


# SGL forms on data-less commands

@case("SGL", "Property Get CAP, all-zero SGL (Data Block, Address, length 0)")
def _sgl_zero_prop_get(t: Target) -> Outcome:
    with RawHost(t.addr) as h:
        h.icreq()
        fabrics_connect(h, t.nqn)
        r = prop_get(h, spec.PROP_CAP, eight=True, sgl=NO_SGL)
        return outcome(r, mqes_ok=(r.cqe.result64 & 0xFFFF) > 0 if r.cqe.ok else "-")


@case("SGL", "Property Set CC.EN then Identify, all-zero SGL on the data-less ones")
def _sgl_zero_enable(t: Target) -> Outcome:
    with RawHost(t.addr) as h:
        h.icreq()
        fabrics_connect(h, t.nqn)
        r = prop_set(h, spec.PROP_CC, spec.CC_DEFAULT_ENABLE, sgl=NO_SGL)
        if not r.cqe.ok:
            return outcome(r)
        for _ in range(200):
            csts = prop_get(h, spec.PROP_CSTS, sgl=NO_SGL)
            if csts.cqe.dw0 & spec.CSTS_RDY:
                break
            time.sleep(0.01)
        idr = h.command(P.Sqe(spec.ADMIN_IDENTIFY, cdw10=spec.CNS_CONTROLLER), read=4096)
        ka = h.command(P.Sqe(spec.ADMIN_KEEP_ALIVE), sgl=NO_SGL)
        return outcome(r, csts_rdy=csts.cqe.dw0 & 1, identify=status_text(idr.cqe),
                       keep_alive=status_text(ka.cqe))


@case("SGL", "Property Get CAP, Transport Data Block SGL, length 0")
def _sgl_transport_prop_get(t: Target) -> Outcome:
    with RawHost(t.addr) as h:
        h.icreq()
        fabrics_connect(h, t.nqn)
        return outcome(prop_get(h, spec.PROP_CAP, eight=True))


@case("SGL", "Keep Alive with a 512-byte Transport SGL (no data to move)")
def _sgl_ka_nonzero(t: Target) -> Outcome:
    with Session(t) as s:
        return outcome(admin_cmd(s, spec.ADMIN_KEEP_ALIVE, sgl=P.SglDescriptor.transport(512)))


@case("SGL", "Identify with SGL length 4095 (needs 4096)")
def _sgl_identify_short(t: Target) -> Outcome:
    with Session(t) as s:
        return outcome(identify(s, spec.CNS_CONTROLLER, length=4095))


@case("SGL", "Identify with a Keyed Data Block SGL (RDMA's form)")
def _sgl_keyed(t: Target) -> Outcome:
    with Session(t) as s:
        return outcome(admin_cmd(s, spec.ADMIN_IDENTIFY, cdw10=1,
                                 sgl=P.SglDescriptor(0, 4096, 0x40)))


@case("SGL", "Fused command (FUSE bits set)")
def _sgl_fused(t: Target) -> Outcome:
    with Session(t) as s:
        sqe = P.Sqe(spec.ADMIN_KEEP_ALIVE, flags=P.SQE_FLAGS_PSDT_SGL | 0x1)
        return outcome(s.admin.command(sqe))


@case("SGL", "PSDT = PRP on a fabrics queue")
def _sgl_prp(t: Target) -> Outcome:
    with Session(t) as s:
        return outcome(s.admin.command(P.Sqe(spec.ADMIN_KEEP_ALIVE, flags=0)))


# Admin commands before CC.EN

def _before_enable(t: Target, opc: int, cdw10: int = 0, read: int = 0) -> Outcome:
    with Session(t, enable=False) as s:
        return outcome(admin_cmd(s, opc, cdw10=cdw10, read=read))


@case("before CC.EN", "Identify Controller")
def _pre_identify(t: Target) -> Outcome:
    return _before_enable(t, spec.ADMIN_IDENTIFY, cdw10=1, read=4096)


@case("before CC.EN", "Keep Alive")
def _pre_ka(t: Target) -> Outcome:
    return _before_enable(t, spec.ADMIN_KEEP_ALIVE)


@case("before CC.EN", "Get Log Page SMART")
def _pre_log(t: Target) -> Outcome:
    return _before_enable(t, spec.ADMIN_GET_LOG_PAGE, cdw10=2 | (127 << 16), read=512)


@case("before CC.EN", "unknown admin opcode 0xC1")
def _pre_unknown(t: Target) -> Outcome:
    return _before_enable(t, 0xC1)


@case("before CC.EN", "Identify on the discovery controller")
def _pre_disc(t: Target) -> Outcome:
    with RawHost(t.addr) as h:
        h.icreq()
        fabrics_connect(h, spec.DISCOVERY_NQN, kato=0)
        return outcome(h.command(P.Sqe(spec.ADMIN_IDENTIFY, cdw10=1), read=4096))


@case("before CC.EN", "Identify before Connect")
def _pre_connect(t: Target) -> Outcome:
    with RawHost(t.addr) as h:
        h.icreq()
        return outcome(h.command(P.Sqe(spec.ADMIN_IDENTIFY, cdw10=1), read=4096))


@case("before CC.EN", "Property Get CSTS before Connect")
def _pre_connect_prop(t: Target) -> Outcome:
    with RawHost(t.addr) as h:
        h.icreq()
        return outcome(prop_get(h, spec.PROP_CSTS))


# Identify

def _ctrl_facts(raw: bytes) -> dict[str, object]:
    info = spec.ControllerInfo.decode(raw)
    return {"cntrltype": info.cntrltype, "sqes": hex(info.sqes), "cqes": hex(info.cqes),
            "vwc": info.vwc & 1, "oncs": hex(info.oncs), "ctratt_hid128": info.ctratt & 1,
            "oaes_ns": int(bool(info.oaes & spec.AEN_CFG_NS_ATTR)), "lpa": hex(info.lpa),
            "elpe": info.elpe, "aerl": raw[259], "sgls": hex(info.sgls & 0x100003),
            "icdoff": info.icdoff, "msdbd": info.msdbd, "cmic_multi_ctrl": (raw[76] >> 1) & 1,
            "subnqn": info.subnqn == "", "kas": info.kas > 0}


@case("Identify", "CNS 01h controller")
def _id_ctrl(t: Target) -> Outcome:
    with Session(t) as s:
        r = identify(s, spec.CNS_CONTROLLER)
        facts = _ctrl_facts(r.data) if r.cqe.ok else {}
        facts.pop("subnqn", None)
        return outcome(r, **facts)


@case("Identify", "CNS 00h namespace 1")
def _id_ns1(t: Target) -> Outcome:
    with Session(t) as s:
        r = identify(s, spec.CNS_NAMESPACE, 1)
        raw = r.data
        return outcome(r, nsze_ok=int.from_bytes(raw[0:8], "little") > 0, nlbaf=raw[25],
                       flbas=raw[26], nmic=raw[30], dlfeat_reads_zero=raw[33] & 0x7)


@case("Identify", "CNS 00h NSID 0")
def _id_ns0(t: Target) -> Outcome:
    with Session(t) as s:
        r = identify(s, spec.CNS_NAMESPACE, 0)
        return outcome(r, zeros=r.data == bytes(4096) if r.cqe.ok else "-")


@case("Identify", "CNS 00h NSID FFFFFFFFh")
def _id_ns_all(t: Target) -> Outcome:
    with Session(t) as s:
        return outcome(identify(s, spec.CNS_NAMESPACE, 0xFFFFFFFF))


@case("Identify", "CNS 00h inactive NSID 77")
def _id_ns_inactive(t: Target) -> Outcome:
    with Session(t) as s:
        r = identify(s, spec.CNS_NAMESPACE, 77)
        return outcome(r, zeros=r.data == bytes(4096) if r.cqe.ok else "-")


@case("Identify", "CNS 02h active list from 0")
def _id_list(t: Target) -> Outcome:
    with Session(t) as s:
        r = identify(s, spec.CNS_ACTIVE_NS_LIST, 0)
        return outcome(r, first=spec.decode_ns_list(r.data)[:1] if r.cqe.ok else "-")


@case("Identify", "CNS 02h from NSID FFFFFFFEh")
def _id_list_fe(t: Target) -> Outcome:
    with Session(t) as s:
        return outcome(identify(s, spec.CNS_ACTIVE_NS_LIST, 0xFFFFFFFE))


@case("Identify", "CNS 03h descriptors of namespace 1")
def _id_desc(t: Target) -> Outcome:
    with Session(t) as s:
        r = identify(s, spec.CNS_NS_DESC_LIST, 1)
        types = []
        off = 0
        while r.cqe.ok and off + 4 <= 4096 and r.data[off]:
            types.append(r.data[off])
            off += 4 + r.data[off + 1]
        return outcome(r, uuid_and_csi={3, 4} <= set(types))


@case("Identify", "CNS 03h inactive NSID 77")
def _id_desc_inactive(t: Target) -> Outcome:
    with Session(t) as s:
        return outcome(identify(s, spec.CNS_NS_DESC_LIST, 77))


@case("Identify", "CNS 55h (reserved)")
def _id_bad_cns(t: Target) -> Outcome:
    with Session(t) as s:
        return outcome(identify(s, 0x55))


# Get Log Page

@case("Log page", "Error Information, 4 entries")
def _log_error(t: Target) -> Outcome:
    with Session(t) as s:
        return outcome(get_log(s, spec.LID_ERROR, 256))


@case("Log page", "SMART / Health: Data Units Written after 1000+1 blocks")
def _log_smart(t: Target) -> Outcome:
    with Session(t, io=True) as s:
        assert s.io is not None
        before = spec.SmartLog.decode(get_log(s, spec.LID_SMART, 512,
                                              nsid=0xFFFFFFFF).data)
        w = rw(s.io, spec.IO_WRITE, 0, 1, data=bytes(512))
        rw(s.io, spec.IO_WRITE, 8, 1000, write=bytes(512 * 1000))
        rw(s.io, spec.IO_READ, 8, 1000, read=512 * 1000)
        r = get_log(s, spec.LID_SMART, 512, nsid=0xFFFFFFFF)
        after = spec.SmartLog.decode(r.data)
        # 1001 blocks written: +1 or +2 units depending on the remainder before (rounded
        # up); 1000 blocks read: exactly +1 unit.
        written = after.data_units_written - before.data_units_written
        return outcome(r, write=status_text(w.cqe),
                       host_writes=after.host_writes - before.host_writes,
                       host_reads=after.host_reads - before.host_reads,
                       units_written_1_or_2=written in (1, 2),
                       units_read=after.data_units_read - before.data_units_read)


@case("Log page", "SMART / Health for namespace 1")
def _log_smart_ns(t: Target) -> Outcome:
    with Session(t) as s:
        return outcome(get_log(s, spec.LID_SMART, 512, nsid=1))


@case("Log page", "SMART / Health for inactive NSID 77")
def _log_smart_bad_ns(t: Target) -> Outcome:
    with Session(t) as s:
        return outcome(get_log(s, spec.LID_SMART, 512, nsid=77))


@case("Log page", "Firmware Slot Information")
def _log_fw(t: Target) -> Outcome:
    with Session(t) as s:
        r = get_log(s, spec.LID_FW_SLOT, 512)
        return outcome(r, afi_slot=r.data[0] & 7 if r.cqe.ok else "-")


@case("Log page", "Changed Namespace List (nothing changed)")
def _log_changed(t: Target) -> Outcome:
    with Session(t) as s:
        r = get_log(s, spec.LID_CHANGED_NS, 4096)
        return outcome(r, empty=r.data == bytes(4096) if r.cqe.ok else "-")


@case("Log page", "Commands Supported and Effects")
def _log_effects(t: Target) -> Outcome:
    with Session(t) as s:
        r = get_log(s, spec.LID_CMD_EFFECTS, 4096)
        if not r.cqe.ok:
            return outcome(r)
        acs = struct.unpack_from("<256I", r.data, 0)
        iocs = struct.unpack_from("<256I", r.data, 1024)
        return outcome(r, admin=[hex(i) for i, v in enumerate(acs) if v & 1],
                       io=[hex(i) for i, v in enumerate(iocs) if v & 1])


@case("Log page", "Discovery log (70h) on a data NQN")
def _log_disc_on_data(t: Target) -> Outcome:
    with Session(t) as s:
        return outcome(get_log(s, spec.LID_DISCOVERY, 1024))


@case("Log page", "Discovery log on the discovery NQN")
def _log_disc(t: Target) -> Outcome:
    with RawHost(t.addr) as h:
        h.icreq()
        fabrics_connect(h, spec.DISCOVERY_NQN, kato=0)
        prop_set(h, spec.PROP_CC, spec.CC_DEFAULT_ENABLE)
        time.sleep(0.05)
        r = h.command(P.Sqe(spec.ADMIN_GET_LOG_PAGE, cdw10=0x70 | (255 << 16)), read=1024)
        _gen, numrec = spec.decode_discovery_header(r.data) if r.cqe.ok else (0, 0)
        return outcome(r, has_records=numrec > 0)


@case("Log page", "unknown LID C0h")
def _log_unknown(t: Target) -> Outcome:
    with Session(t) as s:
        return outcome(get_log(s, 0xC0, 512))


# Features

def _features(s: Session, set_: bool, fid: int, cdw11: int = 0) -> Reply:
    return admin_cmd(s, spec.ADMIN_SET_FEATURES if set_ else spec.ADMIN_GET_FEATURES,
                     cdw10=fid, cdw11=cdw11)


@case("Features", "Set Number of Queues 4/4")
def _feat_nq(t: Target) -> Outcome:
    with Session(t) as s:
        r = _features(s, True, spec.FID_NUMBER_OF_QUEUES, (3 << 16) | 3)
        return outcome(r, granted=r.cqe.dw0 > 0)


@case("Features", "Set Number of Queues FFFFh")
def _feat_nq_bad(t: Target) -> Outcome:
    with Session(t) as s:
        return outcome(_features(s, True, spec.FID_NUMBER_OF_QUEUES, 0xFFFF))


@case("Features", "Get Number of Queues")
def _feat_nq_get(t: Target) -> Outcome:
    with Session(t) as s:
        return outcome(_features(s, False, spec.FID_NUMBER_OF_QUEUES))


@case("Features", "Set then Get Keep Alive Timer 15000 ms")
def _feat_kato(t: Target) -> Outcome:
    with Session(t) as s:
        r = _features(s, True, spec.FID_KEEP_ALIVE_TIMER, 15000)
        g = _features(s, False, spec.FID_KEEP_ALIVE_TIMER)
        return outcome(r, get=status_text(g.cqe), kato=g.cqe.dw0)


@case("Features", "Set then Get Async Event Config (namespace notices)")
def _feat_aec(t: Target) -> Outcome:
    with Session(t) as s:
        r = _features(s, True, spec.FID_ASYNC_EVENT_CONFIG, spec.AEN_CFG_NS_ATTR)
        g = _features(s, False, spec.FID_ASYNC_EVENT_CONFIG)
        return outcome(r, get=status_text(g.cqe), aec=hex(g.cqe.dw0))


@case("Features", "Get Host Identifier (EXHID)")
def _feat_hostid(t: Target) -> Outcome:
    with Session(t) as s:
        r = admin_cmd(s, spec.ADMIN_GET_FEATURES, cdw10=spec.FID_HOST_ID, cdw11=1, read=16)
        return outcome(r, hostid=r.data == HOSTID if r.cqe.ok else "-")


@case("Features", "Get unsupported FID 10h (host controlled thermal management)")
def _feat_unknown(t: Target) -> Outcome:
    with Session(t) as s:
        return outcome(_features(s, False, 0x10))


# Keep Alive, unknown opcodes

@case("Admin", "fifth Asynchronous Event Request (AERL 3)")
def _aer_limit(t: Target) -> Outcome:
    with Session(t) as s:
        for cid in range(100, 104):  # four AERs stay outstanding
            s.admin.send(P.CapsuleCmd(P.Sqe(spec.ADMIN_ASYNC_EVENT, cid=cid,
                                            sgl=P.SglDescriptor.transport(0))))
        return outcome(admin_cmd(s, spec.ADMIN_ASYNC_EVENT))


@case("Admin", "Abort of a command that is not outstanding")
def _abort(t: Target) -> Outcome:
    with Session(t) as s:
        r = admin_cmd(s, spec.ADMIN_ABORT, cdw10=(77 << 16) | 0)
        return outcome(r, not_aborted=r.cqe.dw0 & 1)


@case("Admin", "Property Get of an unknown offset (30h)")
def _prop_unknown(t: Target) -> Outcome:
    with Session(t) as s:
        return outcome(prop_get(s.admin, 0x30))


@case("Admin", "Property Set CC.EN with IOSQES 5 (wrong SQ entry size)")
def _prop_bad_cc(t: Target) -> Outcome:
    with RawHost(t.addr) as h:
        h.icreq()
        fabrics_connect(h, t.nqn)
        r = prop_set(h, spec.PROP_CC, 0x00450001)
        time.sleep(0.1)
        csts = prop_get(h, spec.PROP_CSTS).cqe.dw0
        return outcome(r, rdy=csts & 1, cfs=(csts >> 1) & 1)


@case("Log page", "SMART / Health with a dword-aligned offset (LPO 4)")
def _log_offset(t: Target) -> Outcome:
    with Session(t) as s:
        return outcome(get_log(s, spec.LID_SMART, 508, nsid=0xFFFFFFFF, offset=4))


@case("Features", "Set Keep Alive Timer with the Save bit")
def _feat_save(t: Target) -> Outcome:
    with Session(t) as s:
        return outcome(admin_cmd(s, spec.ADMIN_SET_FEATURES,
                                 cdw10=spec.FID_KEEP_ALIVE_TIMER | (1 << 31), cdw11=15000))


@case("I/O", "Write with FUA, Read with Limited Retry")
def _io_fua(t: Target) -> Outcome:
    with Session(t, io=True) as s:
        assert s.io is not None
        w = rw(s.io, spec.IO_WRITE, 40, 1, data=b"\x5a" * 512, cdw12_extra=1 << 30)
        r = rw(s.io, spec.IO_READ, 40, 1, read=512, cdw12_extra=1 << 31)
        return outcome(w, read=status_text(r.cqe), same=r.data == b"\x5a" * 512)


@case("I/O", "Flush of NSID FFFFFFFFh")
def _io_flush_all(t: Target) -> Outcome:
    with Session(t, io=True) as s:
        assert s.io is not None
        return outcome(s.io.command(P.Sqe(spec.IO_FLUSH, nsid=0xFFFFFFFF)))


@case("I/O", "Read of NSID 0")
def _io_ns0(t: Target) -> Outcome:
    with Session(t, io=True) as s:
        assert s.io is not None
        return outcome(rw(s.io, spec.IO_READ, 0, 1, read=512, nsid=0))


@case("Admin", "Keep Alive")
def _ka(t: Target) -> Outcome:
    with Session(t) as s:
        return outcome(admin_cmd(s, spec.ADMIN_KEEP_ALIVE))


@case("Admin", "unknown admin opcode C1h")
def _admin_unknown(t: Target) -> Outcome:
    with Session(t) as s:
        return outcome(admin_cmd(s, 0xC1))


@case("Admin", "Firmware Commit (10h, not offered)")
def _admin_fw_commit(t: Target) -> Outcome:
    with Session(t) as s:
        return outcome(admin_cmd(s, 0x10))


@case("Admin", "I/O opcode Read on the admin queue")
def _admin_read(t: Target) -> Outcome:
    with Session(t) as s:
        return outcome(admin_cmd(s, spec.IO_READ, nsid=1, read=512))


@case("Admin", "unknown fabrics FCTYPE 7Eh")
def _fabrics_unknown(t: Target) -> Outcome:
    with Session(t) as s:
        return outcome(s.admin.command(P.Sqe(spec.OPC_FABRICS, nsid=0x7E)))


@case("I/O", "unknown I/O opcode 7Eh")
def _io_unknown(t: Target) -> Outcome:
    with Session(t, io=True) as s:
        assert s.io is not None
        return outcome(s.io.command(P.Sqe(0x7E, nsid=1)))


@case("I/O", "Read of inactive NSID 77")
def _io_bad_ns(t: Target) -> Outcome:
    with Session(t, io=True) as s:
        assert s.io is not None
        return outcome(rw(s.io, spec.IO_READ, 0, 1, read=512, nsid=77))


# Connect rules

@case("Connect", "I/O queue Connect before any admin queue (CNTLID FFFFh)")
def _conn_io_first(t: Target) -> Outcome:
    with RawHost(t.addr) as h:
        h.icreq()
        r = fabrics_connect(h, t.nqn, qid=1, cntlid=0xFFFF)
        return outcome(r, ipo=hex(r.cqe.dw0 & 0x1FFFF))


@case("Connect", "I/O queue Connect with an unknown CNTLID")
def _conn_io_unknown(t: Target) -> Outcome:
    with Session(t) as s, RawHost(t.addr) as h:
        h.icreq()
        r = fabrics_connect(h, t.nqn, qid=1, cntlid=(s.cntlid + 100) % 0xFFEF or 1)
        return outcome(r, ipo=hex(r.cqe.dw0 & 0x1FFFF))


@case("Connect", "admin Connect to an unknown SUBNQN")
def _conn_bad_nqn(t: Target) -> Outcome:
    with RawHost(t.addr) as h:
        h.icreq()
        r = fabrics_connect(h, "nqn.2026-01.io.kvtool:no-such-subsystem")
        return outcome(r, ipo=hex(r.cqe.dw0 & 0x1FFFF))


@case("Connect", "I/O queue Connect with a different SUBNQN than its controller's")
def _conn_io_other_nqn(t: Target) -> Outcome:
    with Session(t) as s, RawHost(t.addr) as h:
        h.icreq()
        r = fabrics_connect(h, "nqn.2026-01.io.kvtool:no-such-subsystem", qid=1,
                            cntlid=s.cntlid)
        return outcome(r, ipo=hex(r.cqe.dw0 & 0x1FFFF))


@case("Connect", "duplicate I/O queue ID")
def _conn_dup(t: Target) -> Outcome:
    with Session(t, io=True) as s, RawHost(t.addr) as h:
        h.icreq()
        return outcome(fabrics_connect(h, t.nqn, qid=1, cntlid=s.cntlid))


@case("Connect", "I/O queue SQSIZE 0")
def _conn_sqsize0(t: Target) -> Outcome:
    with Session(t) as s, RawHost(t.addr) as h:
        h.icreq()
        r = fabrics_connect(h, t.nqn, qid=1, cntlid=s.cntlid, sqsize=0)
        return outcome(r, ipo=hex(r.cqe.dw0 & 0x1FFFF))


@case("Connect", "I/O queue SQSIZE above CAP.MQES")
def _conn_sqsize_big(t: Target) -> Outcome:
    with Session(t) as s, RawHost(t.addr) as h:
        mqes = prop_get(s.admin, spec.PROP_CAP, eight=True).cqe.result64 & 0xFFFF
        h.icreq()
        r = fabrics_connect(h, t.nqn, qid=1, cntlid=s.cntlid, sqsize=mqes + 1)
        return outcome(r, ipo=hex(r.cqe.dw0 & 0x1FFFF))


@case("Connect", "admin queue SQSIZE 31 (Linux host's)")
def _conn_admin_ok(t: Target) -> Outcome:
    with RawHost(t.addr) as h:
        h.icreq()
        r = fabrics_connect(h, t.nqn, sqsize=31)
        return outcome(r)


@case("Connect", "second Connect on a connected queue")
def _conn_twice(t: Target) -> Outcome:
    with Session(t) as s:
        r = fabrics_connect(s.admin, t.nqn)
        return outcome(r)


@case("Connect", "Connect with RECFMT 1")
def _conn_recfmt(t: Target) -> Outcome:
    with RawHost(t.addr) as h:
        h.icreq()
        sqe = P.Sqe(spec.OPC_FABRICS, nsid=spec.FCTYPE_CONNECT, cdw10=1, cdw11=31,
                    cdw12=30000)
        r = h.command(sqe, data=connect_data(t.nqn))
        return outcome(r, ipo=hex(r.cqe.dw0 & 0x1FFFF))


# I/O

def _nsze(s: Session) -> tuple[int, int]:
    info = spec.NamespaceInfo.decode(1, identify(s, spec.CNS_NAMESPACE, 1).data)
    return info.nsze, info.lba_size


@case("I/O", "Write 4 KiB in-capsule, read back")
def _io_incapsule(t: Target) -> Outcome:
    with Session(t, io=True) as s:
        assert s.io is not None
        data = bytes(range(256)) * 16
        w = rw(s.io, spec.IO_WRITE, 64, 8, data=data)
        r = rw(s.io, spec.IO_READ, 64, 8, read=4096)
        return outcome(w, r2ts=w.r2ts, read=status_text(r.cqe), same=r.data == data)


@case("I/O", "Write 128 KiB with R2T/H2CData, read back")
def _io_r2t(t: Target) -> Outcome:
    with Session(t, io=True) as s:
        assert s.io is not None
        data = bytes((i * 7) & 0xFF for i in range(128 * 1024))
        w = rw(s.io, spec.IO_WRITE, 256, 256, write=data)
        r = rw(s.io, spec.IO_READ, 256, 256, read=len(data))
        return outcome(w, r2t=w.r2ts > 0, read=status_text(r.cqe), same=r.data == data)


@case("I/O", "Write 8 KiB with a Transport SGL (fits the in-capsule size)")
def _io_small_r2t(t: Target) -> Outcome:
    with Session(t, io=True) as s:
        assert s.io is not None
        w = rw(s.io, spec.IO_WRITE, 128, 16, write=bytes(8192))
        return outcome(w, r2t=w.r2ts > 0)


@case("I/O", "Read at the last LBA")
def _io_last(t: Target) -> Outcome:
    with Session(t, io=True) as s:
        assert s.io is not None
        nsze, lba = _nsze(s)
        return outcome(rw(s.io, spec.IO_READ, nsze - 1, 1, read=lba))


@case("I/O", "Read past the end (last LBA + 1 block)")
def _io_past(t: Target) -> Outcome:
    with Session(t, io=True) as s:
        assert s.io is not None
        nsze, lba = _nsze(s)
        return outcome(rw(s.io, spec.IO_READ, nsze - 1, 2, read=2 * lba))


@case("I/O", "Write past the end")
def _io_write_past(t: Target) -> Outcome:
    with Session(t, io=True) as s:
        assert s.io is not None
        nsze, lba = _nsze(s)
        return outcome(rw(s.io, spec.IO_WRITE, nsze, 1, data=bytes(lba)))


@case("I/O", "Read with SGL length 1024 for NLB 1 (512)")
def _io_sgl_mismatch(t: Target) -> Outcome:
    with Session(t, io=True) as s:
        assert s.io is not None
        return outcome(rw(s.io, spec.IO_READ, 0, 1, sgl=P.SglDescriptor.transport(1024)))


@case("I/O", "Write in-capsule 1024 bytes for NLB 1")
def _io_write_mismatch(t: Target) -> Outcome:
    with Session(t, io=True) as s:
        assert s.io is not None
        return outcome(rw(s.io, spec.IO_WRITE, 0, 1, data=bytes(1024)))


@case("I/O", "Read with in-capsule data")
def _io_read_incapsule(t: Target) -> Outcome:
    with Session(t, io=True) as s:
        assert s.io is not None
        try:
            return outcome(rw(s.io, spec.IO_READ, 0, 1, data=bytes(512)))
        except Closed as exc:
            return closed(exc)


@case("I/O", "Flush")
def _io_flush(t: Target) -> Outcome:
    with Session(t, io=True) as s:
        assert s.io is not None
        return outcome(s.io.command(P.Sqe(spec.IO_FLUSH, nsid=1)))


@case("I/O", "Flush with the all-zero SGL")
def _io_flush_zero_sgl(t: Target) -> Outcome:
    with Session(t, io=True) as s:
        assert s.io is not None
        return outcome(s.io.command(P.Sqe(spec.IO_FLUSH, nsid=1), sgl=NO_SGL))


@case("I/O", "Write Zeroes 8 blocks, read back")
def _io_wz(t: Target) -> Outcome:
    with Session(t, io=True) as s:
        assert s.io is not None
        rw(s.io, spec.IO_WRITE, 512, 8, data=b"\xa5" * 4096)
        w = s.io.command(P.Sqe(spec.IO_WRITE_ZEROES, nsid=1, cdw10=512, cdw12=7))
        r = rw(s.io, spec.IO_READ, 512, 8, read=4096)
        return outcome(w, zeros=r.data == bytes(4096))


@case("I/O", "Write Zeroes past the end")
def _io_wz_past(t: Target) -> Outcome:
    with Session(t, io=True) as s:
        assert s.io is not None
        nsze, _lba = _nsze(s)
        return outcome(s.io.command(P.Sqe(spec.IO_WRITE_ZEROES, nsid=1, cdw10=nsze - 1,
                                          cdw12=1)))


@case("I/O", "Dataset Management deallocate, 2 ranges in-capsule")
def _io_dsm(t: Target) -> Outcome:
    with Session(t, io=True) as s:
        assert s.io is not None
        ranges = struct.pack("<IIQ", 0, 8, 1024) + struct.pack("<IIQ", 0, 16, 2048)
        r = s.io.command(P.Sqe(spec.IO_DSM, nsid=1, cdw10=1, cdw11=1 << 2), data=ranges)
        return outcome(r)


@case("I/O", "Dataset Management with fewer range bytes than NR says")
def _io_dsm_short(t: Target) -> Outcome:
    with Session(t, io=True) as s:
        assert s.io is not None
        ranges = struct.pack("<IIQ", 0, 8, 1024)
        r = s.io.command(P.Sqe(spec.IO_DSM, nsid=1, cdw10=1, cdw11=1 << 2), data=ranges)
        return outcome(r)


# Transport: ICReq and digests

@case("Transport", "ICReq HPDA 1 (8-byte data alignment)")
def _tr_hpda(t: Target) -> Outcome:
    with RawHost(t.addr) as h:
        try:
            resp = h.icreq(hpda=1)
        except Closed as exc:
            return closed(exc)
        r = fabrics_connect(h, t.nqn)
        return outcome(r, cpda=resp.cpda)


@case("Transport", "header + data digests: Write 4 KiB in-capsule, 64 KiB R2T, read back")
def _tr_digests(t: Target) -> Outcome:
    with Session(t, io=True, hdgst=True, ddgst=True) as s:
        assert s.io is not None
        data = bytes(range(256)) * 256
        rw(s.io, spec.IO_WRITE, 96, 8, data=data[:4096])
        w = rw(s.io, spec.IO_WRITE, 96, 128, write=data)
        r = rw(s.io, spec.IO_READ, 96, 128, read=len(data))
        return outcome(w, hdgst=s.io.hdgst, ddgst=s.io.ddgst, same=r.data == data)


@case("Transport", "wrong header digest on a command")
def _tr_bad_hdgst(t: Target) -> Outcome:
    with Session(t) as s, RawHost(t.addr) as h:
        h.icreq(hdgst=True)
        raw = bytearray(P.encode(P.CapsuleCmd(P.Sqe(spec.OPC_FABRICS, nsid=1, cid=1,
                                                    cdw11=31, sgl=P.SglDescriptor.in_capsule(
                                                        1024)),
                                              connect_data(t.nqn, s.cntlid)), hdgst=True))
        raw[72] ^= 0xFF
        h.send_raw(bytes(raw))
        try:
            pdu = h.recv()
        except Closed as exc:
            return closed(exc)
        return Outcome("status", f"answered {type(pdu).__name__}")


@case("Transport", "wrong data digest on an in-capsule write")
def _tr_bad_ddgst(t: Target) -> Outcome:
    with Session(t) as s, RawHost(t.addr) as h:
        h.icreq(ddgst=True)
        fabrics_connect(h, t.nqn, qid=1, cntlid=s.cntlid)
        sqe = P.Sqe(spec.IO_WRITE, cid=9, nsid=1, sgl=P.SglDescriptor.in_capsule(512))
        raw = bytearray(P.encode(P.CapsuleCmd(sqe, bytes(512)), ddgst=True))
        raw[-1] ^= 0xFF
        h.send_raw(bytes(raw))
        try:
            pdu = h.recv()
        except Closed as exc:
            return closed(exc)
        if isinstance(pdu, P.CapsuleResp):
            return Outcome("status", status_text(pdu.cqe))
        return Outcome("status", f"answered {type(pdu).__name__}")


@case("Transport", "CapsuleCmd before ICReq")
def _tr_no_icreq(t: Target) -> Outcome:
    with RawHost(t.addr) as h:
        try:
            fabrics_connect(h, t.nqn)
        except Closed as exc:
            return closed(exc)
        return Outcome("status", "answered")

