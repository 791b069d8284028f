"""Fabrics commands on the target: Connect, Property Get and Property Set.

:data:`HANDLERS` maps FCTYPE → handler; another module adds a command type with
:func:`register` (e.g. Authentication Send/Receive) without touching this one.
Statuses and Connect's IPO values follow Linux nvmet (``fabrics-cmd.c``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from emulator.nvmetcp import auth
from emulator.nvmetcp.admin import deliver_events
from emulator.nvmetcp.queue import Queue
from emulator.nvmetcp.sgl import expect_len
from kvtool.nvme import pdu as P
from kvtool.nvme import spec
from kvtool.nvme.spec import status

log = logging.getLogger("emulator.nvmetcp")

FabricsHandler = Callable[["Queue", P.Sqe, "bytes | memoryview"], None]

# Connect's IPO (Invalid Parameter Offset) in CQE DW0: bit 16 set = offset in the data.
IPO_IN_DATA = 1 << 16
IPO_CNTLID = IPO_IN_DATA | 16
IPO_SUBNQN = IPO_IN_DATA | 256
IPO_HOSTNQN = IPO_IN_DATA | 512
IPO_QID = 42
IPO_SQSIZE = 44


def register(fctype: int, handler: FabricsHandler) -> None:
    """Serve FCTYPE ``fctype`` with ``handler(conn, sqe, data)``."""
    HANDLERS[fctype] = handler


def dispatch(conn: Queue, sqe: P.Sqe, data: bytes | memoryview) -> None:
    fctype = sqe.fctype
    if fctype != spec.FCTYPE_CONNECT and (not conn.connected or conn.ctrl is None):
        conn.complete(sqe.cid, status(spec.SC_INVALID_OPCODE))  # only Connect comes first
        return
    handler = HANDLERS.get(fctype)
    if handler is None:
        conn.complete(sqe.cid, status(spec.SC_INVALID_OPCODE))
        return
    handler(conn, sqe, data)


def _admin_only(conn: Queue, sqe: P.Sqe) -> bool:
    if conn.qid != 0:
        conn.complete(sqe.cid, status(spec.SC_INVALID_OPCODE))
        return False
    return True


def property_get(conn: Queue, sqe: P.Sqe, data: bytes | memoryview) -> None:
    ctrl = conn.ctrl
    if ctrl is None or not _admin_only(conn, sqe) or not expect_len(conn, sqe, data, 0):
        return
    size8 = sqe.cdw10 & 0x7
    ofst = sqe.cdw11
    if size8 == 1 and ofst == spec.PROP_CAP:
        cap = spec.make_cap(mqes=conn.state.config.max_queue_size - 1)
        conn.complete(sqe.cid, 0, cap & 0xFFFFFFFF, cap >> 32)
    elif size8 == 0 and ofst in (spec.PROP_VS, spec.PROP_CC, spec.PROP_CSTS):
        value = {spec.PROP_VS: conn.state.vs, spec.PROP_CC: ctrl.cc,
                 spec.PROP_CSTS: ctrl.csts}[ofst]
        conn.complete(sqe.cid, 0, value)
    else:
        conn.complete(sqe.cid, status(spec.SC_INVALID_FIELD))


def property_set(conn: Queue, sqe: P.Sqe, data: bytes | memoryview) -> None:
    ctrl = conn.ctrl
    if ctrl is None or not _admin_only(conn, sqe) or not expect_len(conn, sqe, data, 0):
        return
    size8 = sqe.cdw10 & 0x7
    if size8 == 0 and sqe.cdw11 == spec.PROP_CC:
        ctrl.set_cc(sqe.cdw12)
        conn.complete(sqe.cid)
    else:
        conn.complete(sqe.cid, status(spec.SC_INVALID_FIELD))


def connect(conn: Queue, sqe: P.Sqe, data: bytes | memoryview) -> None:
    cid = sqe.cid
    cs = spec.SCT_COMMAND_SPECIFIC
    if conn.connected:  # Linux: only Property Get/Set are fabrics commands on a live queue
        conn.complete(cid, status(spec.SC_INVALID_OPCODE))
        return
    if not expect_len(conn, sqe, data, spec.CONNECT_DATA_LEN):
        return
    recfmt, qid = sqe.cdw10 & 0xFFFF, sqe.cdw10 >> 16
    sqsize, cattr = sqe.cdw11 & 0xFFFF, (sqe.cdw11 >> 16) & 0xFF
    kato = sqe.cdw12
    state = conn.state
    cfg = state.config
    if recfmt != 0:
        conn.complete(cid, status(spec.SC_CONNECT_INCOMPATIBLE_FORMAT, cs))  # no IPO here
        return
    cd = spec.ConnectData.decode(data)
    subsys = state.find_subsystem(cd.subnqn)
    if subsys is None:
        log.info("connect from %s to unknown subsystem %r", conn.peer, cd.subnqn)
        conn.complete(cid, status(spec.SC_CONNECT_INVALID_PARAM, cs), IPO_SUBNQN)
        return
    if not subsys.host_allowed(cd.hostnqn):
        log.warning("connect from %s: host %r not allowed on %s", conn.peer, cd.hostnqn,
                    subsys.nqn)
        conn.complete(cid, status(spec.SC_CONNECT_INVALID_HOST, cs), IPO_HOSTNQN)
        return
    if sqsize == 0 or sqsize + 1 > cfg.max_queue_size:
        conn.complete(cid, status(spec.SC_CONNECT_INVALID_PARAM, cs), IPO_SQSIZE)
        return
    if qid == 0:
        if cd.cntlid != 0xFFFF:
            conn.complete(cid, status(spec.SC_CONNECT_INVALID_PARAM, cs), IPO_CNTLID)
            return
        ctrl = subsys.new_controller(cd.hostnqn, cd.hostid, kato)
        ctrl.queues[0] = conn
        ctrl.port = conn.local
        ctrl.arm_keep_alive(state.loop, cfg.kato_grace_s)
        admin_ctrl = ctrl

        def notify() -> None:
            deliver_events(conn, admin_ctrl)
            conn.flush()

        ctrl.notify = notify
    else:
        found = subsys.controllers.get(cd.cntlid)
        if found is None or found.deleted:
            conn.complete(cid, status(spec.SC_CONNECT_INVALID_PARAM, cs), IPO_CNTLID)
            return
        if found.hostnqn != cd.hostnqn:
            conn.complete(cid, status(spec.SC_CONNECT_INVALID_PARAM, cs), IPO_HOSTNQN)
            return
        if subsys.is_discovery or qid > cfg.max_io_queues:
            conn.complete(cid, status(spec.SC_CONNECT_INVALID_PARAM, cs), IPO_QID)
            return
        if qid in found.queues:
            conn.complete(cid, status(spec.SC_CMD_SEQ_ERROR))
            return
        ctrl = found
        ctrl.queues[qid] = conn
        ctrl.touch()
    conn.bind(ctrl, subsys, qid, sqsize, cattr)
    authreq = auth.on_connect(conn, cd.hostnqn, subsys.nqn, subsys.is_discovery)
    log.info("%s connected %s qid %d cntlid %d (host %s%s)", conn.peer, subsys.nqn, qid,
             ctrl.cntlid, cd.hostnqn, ", DH-HMAC-CHAP" if authreq else "")
    conn.complete(cid, 0, ctrl.cntlid | authreq)


HANDLERS: dict[int, FabricsHandler] = {
    spec.FCTYPE_CONNECT: connect,
    spec.FCTYPE_PROPERTY_GET: property_get,
    spec.FCTYPE_PROPERTY_SET: property_set,
    auth.FCTYPE_AUTH_SEND: auth.on_command,
    auth.FCTYPE_AUTH_RECEIVE: auth.on_command,
}
