"""Admin commands on the target: Identify, Get Log Page, Get/Set Features, Keep Alive,
Asynchronous Event Request, Abort.

Statuses follow Linux nvmet 6.1 (``admin-cmd.c``, ``discovery.c``) where it follows the
specification; docs/nvme-tcp.md's conformance table lists every case and the reasons for
the few places where this target follows the specification instead.
"""

from __future__ import annotations

from emulator.nvmetcp import logpages
from emulator.nvmetcp.queue import Queue
from emulator.nvmetcp.sgl import expect_len
from emulator.nvmetcp.subsystem import Controller
from kvtool import __version__
from kvtool.nvme import pdu as P
from kvtool.nvme import spec
from kvtool.nvme.spec import status

MAX_AERS = 4  # AERL + 1
NSID_ALL = 0xFFFFFFFF
_LOG_MAX = 1 << 20
_RAE = 1 << 15  # Get Log Page CDW10: retain the asynchronous event


def dispatch(conn: Queue, ctrl: Controller, sqe: P.Sqe,
             data: bytes | memoryview) -> None:
    opc = sqe.opcode
    if ctrl.subsys.is_discovery:
        if not ctrl.ready:  # Linux's discovery controller: Invalid Opcode until ready
            conn.complete(sqe.cid, status(spec.SC_INVALID_OPCODE))
            return
        handler = _DISCOVERY.get(opc)
    else:
        if not ctrl.ready:
            conn.complete(sqe.cid, status(spec.SC_CMD_SEQ_ERROR))
            return
        handler = _ADMIN.get(opc)
    if handler is None:
        conn.complete(sqe.cid, status(spec.SC_INVALID_OPCODE))
        return
    handler(conn, ctrl, sqe, data)


def keep_alive(conn: Queue, ctrl: Controller, sqe: P.Sqe,
               data: bytes | memoryview) -> None:
    if expect_len(conn, sqe, data, 0):
        conn.complete(sqe.cid)


def abort(conn: Queue, ctrl: Controller, sqe: P.Sqe,
          data: bytes | memoryview) -> None:
    if expect_len(conn, sqe, data, 0):
        conn.complete(sqe.cid, 0, 1)  # bit 0 set: the command was not aborted


def async_event(conn: Queue, ctrl: Controller, sqe: P.Sqe,
                data: bytes | memoryview) -> None:
    if not expect_len(conn, sqe, data, 0):
        return
    if len(conn.aers) >= MAX_AERS:
        conn.complete(sqe.cid, status(spec.SC_AER_LIMIT_EXCEEDED, spec.SCT_COMMAND_SPECIFIC))
        return
    conn.aers.append(sqe.cid)  # completes only when an event occurs
    deliver_events(conn, ctrl)


def deliver_events(conn: Queue, ctrl: Controller) -> None:
    """Complete waiting AERs with queued events (the admin queue's ``ctrl.notify``)."""
    while conn.aers and ctrl.events:
        conn.complete(conn.aers.pop(0), 0, ctrl.events.pop(0))


# --- Identify ----------------------------------------------------------------------------


def identify(conn: Queue, ctrl: Controller, sqe: P.Sqe,
             data: bytes | memoryview) -> None:
    if not expect_len(conn, sqe, data, spec.IDENTIFY_DATA_LEN):
        return
    cns = sqe.cdw10 & 0xFF
    subsys = ctrl.subsys
    nsid = sqe.nsid
    out: bytes
    if subsys.is_discovery and cns != spec.CNS_CONTROLLER:
        conn.complete(sqe.cid, status(spec.SC_INVALID_FIELD))
        return
    if cns == spec.CNS_CONTROLLER:
        out = conn.state.identify_controller(ctrl)
    elif cns == spec.CNS_NAMESPACE:
        if nsid == NSID_ALL:
            conn.complete(sqe.cid, status(spec.SC_INVALID_NS))
            return
        ns = subsys.namespaces.get(nsid)
        out = ns.identify() if ns is not None else bytes(spec.IDENTIFY_DATA_LEN)
    elif cns == spec.CNS_ACTIVE_NS_LIST:
        if nsid >= 0xFFFFFFFE:
            conn.complete(sqe.cid, status(spec.SC_INVALID_NS))
            return
        out = spec.encode_ns_list([n for n in subsys.namespaces if n > nsid])
    elif cns == spec.CNS_NS_DESC_LIST:
        ns = subsys.namespaces.get(nsid)
        if ns is None:
            conn.complete(sqe.cid, status(spec.SC_INVALID_NS))
            return
        out = spec.encode_ns_descriptors(ns.uuid.bytes, ns.uuid.bytes)
    elif cns == spec.CNS_CS_CONTROLLER and (sqe.cdw11 >> 24) == 0:
        out = bytes(spec.IDENTIFY_DATA_LEN)  # NVM command set: no extra limits
    else:
        conn.complete(sqe.cid, status(spec.SC_INVALID_FIELD))
        return
    conn.send_data(sqe.cid, out)


# --- Get Log Page ------------------------------------------------------------------------


def get_log_page(conn: Queue, ctrl: Controller, sqe: P.Sqe,
                 data: bytes | memoryview) -> None:
    lid = sqe.cdw10 & 0xFF
    numd = ((sqe.cdw11 & 0xFFFF) << 16 | (sqe.cdw10 >> 16)) + 1
    length = numd * 4
    offset = sqe.cdw12 | (sqe.cdw13 << 32)
    if not expect_len(conn, sqe, data, length):
        return
    if offset % 4 or length > _LOG_MAX:
        conn.complete(sqe.cid, status(spec.SC_INVALID_FIELD))
        return
    page = _log_page(conn, ctrl, sqe, lid)
    if page is None:
        return
    if lid == spec.LID_CHANGED_NS and not sqe.cdw10 & _RAE:
        ctrl.changed_ns.clear()  # reading it clears it and re-arms the notice
        ctrl.masked_events.discard(lid)
    if lid == spec.LID_ANA and not sqe.cdw10 & _RAE:
        ctrl.masked_events.discard(lid)  # re-arms the ANA Change notice
    chunk = page[offset: offset + length]
    conn.send_data(sqe.cid, chunk + bytes(length - len(chunk)))


def _log_page(conn: Queue, ctrl: Controller, sqe: P.Sqe, lid: int) -> bytes | None:
    """The whole page, or None after completing the command with an error."""
    subsys = ctrl.subsys
    invalid = status(spec.SC_INVALID_LOG_PAGE, spec.SCT_COMMAND_SPECIFIC)
    if subsys.is_discovery:
        if lid != spec.LID_DISCOVERY:
            conn.complete(sqe.cid, invalid)
            return None
        return conn.state.discovery_log(ctrl.hostnqn, conn.local)
    if lid == spec.LID_ERROR:
        return logpages.error_log(ctrl.errors)
    if lid == spec.LID_SMART:
        nsid = sqe.nsid
        if nsid in (0, NSID_ALL):
            counters = logpages.SmartCounters()
            for ns in subsys.namespaces.values():
                counters = counters + ns.smart
        else:
            found = subsys.namespaces.get(nsid)
            if found is None:
                conn.complete(sqe.cid, status(spec.SC_INVALID_NS))
                return None
            counters = found.smart
        return logpages.smart_log(logpages.SmartCounters(
            counters.bytes_read, counters.bytes_written, counters.reads, counters.writes,
            ctrl.error_count))
    if lid == spec.LID_FW_SLOT:
        return logpages.firmware_slot_log(__version__[:8])
    if lid == spec.LID_CHANGED_NS:
        return logpages.changed_ns_log(ctrl.changed_ns)
    if lid == spec.LID_CMD_EFFECTS:
        return logpages.effects_log()
    if lid == spec.LID_ANA:
        return conn.state.ana_log(ctrl, rgo=bool(sqe.cdw10 & spec.ANA_LOG_RGO))
    conn.complete(sqe.cid, invalid)
    return None


# --- Features ----------------------------------------------------------------------------

# The features a host sets and reads back as plain values (Arbitration, Power Management,
# Error Recovery, Write Atomicity Normal): the bits this controller keeps, and each one's
# value on a new controller (SPDK's and the specification's: all zero). The mandatory
# features of docs/nvme-tcp.md's sweep table; ``Controller.features`` holds what was set.
_PLAIN_FEATURES = {
    spec.FID_ARBITRATION: 0xFFFF_FF07,  # AB, LPW, MPW, HPW (bits 7:3 reserved)
    spec.FID_POWER_MANAGEMENT: 0xFF,  # PS (only 0: NPSS is 0), WH
    spec.FID_ERROR_RECOVERY: 0xFFFF,  # TLER (DULBE unsupported: setting it is refused)
    spec.FID_WRITE_ATOMICITY: 0x1,  # DN
}


def _temperature_selector_ok(cdw11: int) -> bool:
    """TMPSEL 0–8 or 15 (all sensors), THSEL 0 (over) or 1 (under): Temperature Threshold."""
    tmpsel, thsel = (cdw11 >> 16) & 0xF, (cdw11 >> 20) & 0x3
    return (tmpsel <= 8 or tmpsel == 15) and thsel <= 1


def set_features(conn: Queue, ctrl: Controller, sqe: P.Sqe,
                 data: bytes | memoryview) -> None:
    fid = sqe.cdw10 & 0xFF
    if fid == spec.FID_HOST_ID:  # set once at Connect (the fabrics rule)
        conn.complete(sqe.cid, status(spec.SC_CMD_SEQ_ERROR))
        return
    if not expect_len(conn, sqe, data, 0):
        return
    nq = conn.state.config.max_io_queues - 1
    discovery = ctrl.subsys.is_discovery
    invalid = status(spec.SC_INVALID_FIELD)
    if fid == spec.FID_NUMBER_OF_QUEUES and not discovery:
        if sqe.cdw11 & 0xFFFF == 0xFFFF or sqe.cdw11 >> 16 == 0xFFFF:
            conn.complete(sqe.cid, invalid)
            return
        conn.complete(sqe.cid, 0, (nq << 16) | nq)
    elif fid == spec.FID_KEEP_ALIVE_TIMER:
        ctrl.kato_ms = sqe.cdw11
        ctrl.arm_keep_alive(conn.state.loop, conn.state.config.kato_grace_s)
        conn.complete(sqe.cid)
    elif fid == spec.FID_ASYNC_EVENT_CONFIG:
        # The SMART critical warnings are accepted (as Linux and SPDK) and never raised:
        # nothing here wears out, heats up or loses its backup power.
        supported = 0 if discovery else (spec.AEN_CFG_SMART_WARNINGS | spec.AEN_CFG_NS_ATTR
                                         | spec.AEN_CFG_ANA_CHANGE)
        if sqe.cdw11 & ~supported:
            conn.complete(sqe.cid, invalid)
            return
        ctrl.aec = sqe.cdw11
        conn.complete(sqe.cid)
    elif discovery:
        conn.complete(sqe.cid, invalid)
    elif fid in _PLAIN_FEATURES:
        refused = {spec.FID_POWER_MANAGEMENT: sqe.cdw11 & 0x1F,  # a power state but 0
                   spec.FID_ERROR_RECOVERY: sqe.cdw11 & (1 << 16)}.get(fid, 0)  # DULBE
        if refused:
            conn.complete(sqe.cid, invalid)
            return
        ctrl.features[fid] = sqe.cdw11 & _PLAIN_FEATURES[fid]
        conn.complete(sqe.cid)
    elif fid == spec.FID_TEMPERATURE_THRESHOLD:
        # No sensor: a valid threshold is accepted and has nothing to act on (as SPDK).
        conn.complete(sqe.cid, 0 if _temperature_selector_ok(sqe.cdw11) else invalid)
    elif fid == spec.FID_VOLATILE_WRITE_CACHE:
        # The cache is the page cache (or process memory): it cannot be turned off.
        conn.complete(sqe.cid, 0 if sqe.cdw11 & 1 else status(
            spec.SC_FEATURE_NOT_CHANGEABLE, spec.SCT_COMMAND_SPECIFIC))
    else:
        conn.complete(sqe.cid, invalid)


def get_features(conn: Queue, ctrl: Controller, sqe: P.Sqe,
                 data: bytes | memoryview) -> None:
    fid = sqe.cdw10 & 0xFF
    if fid == spec.FID_HOST_ID:
        if sqe.cdw11 & 1 == 0:  # EXHID: fabrics use the 128-bit host identifier only
            conn.complete(sqe.cid, status(spec.SC_INVALID_FIELD))
            return
        if expect_len(conn, sqe, data, 16):
            conn.send_data(sqe.cid, ctrl.hostid[:16].ljust(16, b"\0"))
        return
    discovery = ctrl.subsys.is_discovery
    if fid not in (_DISCOVERY_FEATURES if discovery else _FEATURES):
        # An unknown FID is Invalid Field whatever the data length (spec and SPDK; Linux
        # checks the length first): there is no data structure to be too long for.
        conn.complete(sqe.cid, status(spec.SC_INVALID_FIELD))
        return
    if not expect_len(conn, sqe, data, 0):
        return
    nq = conn.state.config.max_io_queues - 1
    if fid == spec.FID_NUMBER_OF_QUEUES:
        conn.complete(sqe.cid, 0, (nq << 16) | nq)
    elif fid == spec.FID_KEEP_ALIVE_TIMER:
        conn.complete(sqe.cid, 0, ctrl.kato_ms)
    elif fid == spec.FID_ASYNC_EVENT_CONFIG:
        conn.complete(sqe.cid, 0, ctrl.aec)
    elif fid in _PLAIN_FEATURES:
        conn.complete(sqe.cid, 0, ctrl.features.get(fid, 0))
    elif fid == spec.FID_TEMPERATURE_THRESHOLD:
        ok = _temperature_selector_ok(sqe.cdw11)  # no sensor: every threshold reads 0
        conn.complete(sqe.cid, 0 if ok else status(spec.SC_INVALID_FIELD))
    else:  # Volatile Write Cache
        conn.complete(sqe.cid, 0, 1)  # WCE: present and enabled (VWC is 1)


# The FIDs Get Features answers (Host Identifier is answered before the length check).
_DISCOVERY_FEATURES = {spec.FID_KEEP_ALIVE_TIMER, spec.FID_ASYNC_EVENT_CONFIG}
_FEATURES = {*_DISCOVERY_FEATURES, *_PLAIN_FEATURES, spec.FID_NUMBER_OF_QUEUES,
             spec.FID_TEMPERATURE_THRESHOLD, spec.FID_VOLATILE_WRITE_CACHE}


_ADMIN = {
    spec.ADMIN_IDENTIFY: identify,
    spec.ADMIN_GET_LOG_PAGE: get_log_page,
    spec.ADMIN_KEEP_ALIVE: keep_alive,
    spec.ADMIN_SET_FEATURES: set_features,
    spec.ADMIN_GET_FEATURES: get_features,
    spec.ADMIN_ASYNC_EVENT: async_event,
    spec.ADMIN_ABORT: abort,
}
_DISCOVERY = {opc: h for opc, h in _ADMIN.items() if opc != spec.ADMIN_ABORT}
