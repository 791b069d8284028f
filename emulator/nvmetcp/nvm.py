"""NVM command set on the target's I/O queues: Read, Write, Flush, Write Zeroes, Dataset
Management (deallocate).

Order of checks as Linux nvmet: controller ready, namespace, the data length the command
needs (Data SGL Length Invalid), then the LBA range. A range past the end is LBA Out of
Range, as the specification says; Linux answers Internal Error there (the block layer's
EIO), which a host cannot tell from a media failure.

Force Unit Access (CDW12 bit 30) on Write and Write Zeroes: the target reports a volatile
write cache (VWC 1), so such a command completes only once its data is durable: the
backing is flushed (``fdatasync``) first, and a failed flush fails the command (Linux
nvmet: ``IOCB_DSYNC`` on a file, ``REQ_FUA`` on a block device).
"""

from __future__ import annotations

import logging
import struct

from emulator.nvmetcp.queue import Queue
from emulator.nvmetcp.sgl import expect_len, transfer_len
from emulator.nvmetcp.subsystem import Controller, Namespace
from kvtool.nvme import pdu as P
from kvtool.nvme import spec
from kvtool.nvme.spec import status

log = logging.getLogger("emulator.nvmetcp")

_DIRECT_MIN = 64 * 1024  # larger reads are sent from the backing's memory without a copy
_DSM_RANGE = struct.Struct("<IIQ")  # context attributes, NLB (1's based), SLBA
_DSM_AD = 1 << 2
_FUA = 1 << 30  # CDW12 of Write and Write Zeroes


def dispatch(conn: Queue, ctrl: Controller, sqe: P.Sqe,
             data: bytes | memoryview) -> None:
    if not ctrl.ready:
        conn.complete(sqe.cid, status(spec.SC_CMD_SEQ_ERROR))
        return
    handler = _HANDLERS.get(sqe.opcode)
    if handler is None:
        conn.complete(sqe.cid, status(spec.SC_INVALID_OPCODE))
        return
    ns = ctrl.subsys.namespaces.get(sqe.nsid)
    if ns is None:
        conn.complete(sqe.cid, status(spec.SC_INVALID_NS))
        return
    ana = conn.state.ana_state(conn.local, ns.anagrpid)
    if ana in _ANA_REFUSED:  # a path error, without DNR: the host retries on another path
        conn.complete(sqe.cid, status(_ANA_REFUSED[ana], spec.SCT_PATH, dnr=False))
        return
    handler(conn, ns, sqe, data)


_ANA_REFUSED = {spec.ANA_INACCESSIBLE: spec.SC_ANA_INACCESSIBLE,
                spec.ANA_PERSISTENT_LOSS: spec.SC_ANA_PERSISTENT_LOSS,
                spec.ANA_CHANGE: spec.SC_ANA_TRANSITION}


def landing_zone(conn: Queue, sqe: P.Sqe, n: int) -> memoryview | None:
    """Where ``n`` bytes of in-capsule data may land before the command runs: the
    namespace's own memory, when the command is a Write that will pass every check."""
    ctrl = conn.ctrl
    if (sqe.opcode != spec.IO_WRITE or not conn.connected or conn.qid <= 0 or ctrl is None
            or not ctrl.ready or n > conn.state.config.in_capsule_data_size
            or n > conn.state.max_transfer or sqe.flags != P.SQE_FLAGS_PSDT_SGL
            or sqe.sgl.sgl_id != P.SGL_DATA_BLOCK_OFFSET or sqe.sgl.address
            or sqe.sgl.length != n):
        return None
    ns = ctrl.subsys.namespaces.get(sqe.nsid)
    if ns is None or n != sqe.nlb * ns.lba_size or sqe.slba + sqe.nlb > ns.nblocks:
        return None
    if conn.state.ana_state(conn.local, ns.anagrpid) in _ANA_REFUSED:
        return None  # refused at dispatch: the data must not land in the namespace
    return ns.backing.view(sqe.slba * ns.lba_size, n)


def hot_read(conn: Queue, ns: Namespace, slba: int, nlb: int,
             length: int) -> bytes | memoryview | None:
    """The data of a small Read of ``ns`` (of a ready controller) that passes every check
    :func:`dispatch` and :func:`read` make, counted; None (nothing done) for anything
    else, which then takes the general path. The connection's hot path (canonical
    capsules, no digests) uses it, and copies the data into its output before it returns
    to the event loop, so a view of a memory backing is returned as it is (one copy fewer
    than :func:`read`'s)."""
    lba_size = ns.lba_size
    backing = ns.backing
    state = conn.state
    if (length > _DIRECT_MIN or length != nlb * lba_size
            or (slba + nlb) * lba_size > backing.size or length > state.max_transfer
            or (state.ana and state.ana_state(conn.local, ns.anagrpid) in _ANA_REFUSED)):
        return None
    offset = slba * lba_size
    try:
        data = backing.view(offset, length) or backing.read(offset, length)
    except OSError:
        return None  # the general path reads again and fails the command
    ns.count_read(length)
    return data


def hot_write(conn: Queue, ns: Namespace, slba: int, nlb: int, cdw12: int,
              data: memoryview) -> bool:
    """Store a small in-capsule Write (no FUA) to ``ns`` (of a ready controller) that
    passes every check :func:`dispatch` and :func:`write` make, and count it: True.
    False (nothing written) for anything else, which then takes the general path."""
    lba_size = ns.lba_size
    backing = ns.backing
    state = conn.state
    length = len(data)
    if (cdw12 & _FUA or length != nlb * lba_size or (slba + nlb) * lba_size > backing.size
            or length > state.max_transfer
            or (state.ana and state.ana_state(conn.local, ns.anagrpid) in _ANA_REFUSED)):
        return False
    try:
        backing.write(slba * lba_size, data)
    except OSError:
        return False  # the general path writes again and fails the command
    ns.count_write(length)
    return True


def _range_ok(conn: Queue, ns: Namespace, sqe: P.Sqe, slba: int, nlb: int) -> bool:
    if slba + nlb > ns.nblocks:
        conn.complete(sqe.cid, status(spec.SC_LBA_OUT_OF_RANGE))
        return False
    return True


def _io_error(conn: Queue, ns: Namespace, cid: int, what: str,
              exc: OSError) -> None:
    log.error("%s of namespace %d failed: %s", what, ns.nsid, exc)
    sc = spec.SC_INTERNAL if what == "flush" else spec.SC_DATA_TRANSFER_ERROR
    conn.complete(cid, status(sc, dnr=False))


def flush(conn: Queue, ns: Namespace, sqe: P.Sqe, data: bytes | memoryview) -> None:
    if expect_len(conn, sqe, data, 0) and _durable(conn, ns, sqe.cid, "flush"):
        conn.complete(sqe.cid)


def _transfer(conn: Queue, ns: Namespace, sqe: P.Sqe,
              data: bytes | memoryview) -> tuple[int, int] | None:
    """A Read's or Write's byte offset and length, or None once it has been failed (SGL length
    disagreeing with NLB, LBA range, more than MDTS)."""
    slba, nlb = sqe.slba, sqe.nlb
    length = nlb * ns.lba_size
    if not expect_len(conn, sqe, data, length) or not _range_ok(conn, ns, sqe, slba, nlb):
        return None
    if length > conn.state.max_transfer:
        conn.complete(sqe.cid, status(spec.SC_INVALID_FIELD))
        return None
    return slba * ns.lba_size, length


def read(conn: Queue, ns: Namespace, sqe: P.Sqe, data: bytes | memoryview) -> None:
    checked = _transfer(conn, ns, sqe, data)
    if checked is None:
        return
    offset, length = checked
    try:
        view = ns.backing.view(offset, length) if length > _DIRECT_MIN else None
        payload = view if view is not None else ns.backing.read(offset, length)
    except OSError as exc:
        _io_error(conn, ns, sqe.cid, "read", exc)
        return
    ns.count_read(length)
    conn.send_data(sqe.cid, payload)


def write(conn: Queue, ns: Namespace, sqe: P.Sqe, data: bytes | memoryview) -> None:
    checked = _transfer(conn, ns, sqe, data)
    if checked is None:
        return
    offset, length = checked
    cid = sqe.cid
    fua = bool(sqe.cdw12 & _FUA)
    if data:
        if conn.landed is not None and data is conn.landed:
            _written(conn, ns, cid, length, fua)  # received straight into the namespace
        else:
            _store(conn, ns, cid, offset, data, fua)
        return
    direct = ns.backing.view(offset, length)

    def finish(received: memoryview) -> None:
        if direct is None:
            _store(conn, ns, cid, offset, received, fua)
        else:  # the data already sits in the backing's memory
            _written(conn, ns, cid, length, fua)

    conn.receive_data(cid, length, direct, finish)


def _store(conn: Queue, ns: Namespace, cid: int, offset: int,
           data: bytes | bytearray | memoryview, fua: bool) -> None:
    try:
        ns.backing.write(offset, data)
    except OSError as exc:
        _io_error(conn, ns, cid, "write", exc)
        return
    _written(conn, ns, cid, len(data), fua)


def _written(conn: Queue, ns: Namespace, cid: int, length: int, fua: bool) -> None:
    """Complete a Write whose data is in the backing; with FUA, once it is durable."""
    if fua and not _durable(conn, ns, cid, "write"):
        return
    ns.count_write(length)
    conn.complete(cid)


def _durable(conn: Queue, ns: Namespace, cid: int, what: str) -> bool:
    """Flush the backing (a Flush, or a command with FUA); False once the command has
    been failed for it."""
    try:
        ns.backing.flush()
    except OSError as exc:
        _io_error(conn, ns, cid, what, exc)
        return False
    return True


def write_zeroes(conn: Queue, ns: Namespace, sqe: P.Sqe,
                 data: bytes | memoryview) -> None:
    slba, nlb = sqe.slba, sqe.nlb
    if not expect_len(conn, sqe, data, 0) or not _range_ok(conn, ns, sqe, slba, nlb):
        return
    try:
        ns.backing.write_zeroes(slba * ns.lba_size, nlb * ns.lba_size)
    except OSError as exc:
        _io_error(conn, ns, sqe.cid, "write zeroes", exc)
        return
    if sqe.cdw12 & _FUA and not _durable(conn, ns, sqe.cid, "write zeroes"):
        return
    conn.complete(sqe.cid)


def dataset_management(conn: Queue, ns: Namespace, sqe: P.Sqe,
                       data: bytes | memoryview) -> None:
    """Deallocate (AD) zeroes the ranges; the read/write hints (IDR, IDW) are accepted and
    ignored, as Linux does. The range list may come in-capsule or after an R2T."""
    nr = (sqe.cdw10 & 0xFF) + 1
    need = nr * _DSM_RANGE.size
    have = transfer_len(sqe, data)
    if have < need:  # Linux: at least the ranges NR announces (nvmet_check_data_len_lte)
        conn.complete(sqe.cid, status(spec.SC_SGL_DATA_LEN_INVALID))
        return
    if data:
        _deallocate(conn, ns, sqe, bytes(data[:need]))
        return
    conn.receive_data(sqe.cid, have, None,
                      lambda received: _deallocate(conn, ns, sqe, bytes(received[:need])))


def _deallocate(conn: Queue, ns: Namespace, sqe: P.Sqe, ranges: bytes) -> None:
    if not sqe.cdw11 & _DSM_AD:
        conn.complete(sqe.cid)
        return
    todo = []
    for _attrs, nlb, slba in _DSM_RANGE.iter_unpack(ranges):
        if slba + nlb > ns.nblocks:
            conn.complete(sqe.cid, status(spec.SC_LBA_OUT_OF_RANGE))
            return
        todo.append((slba, nlb))
    try:
        for slba, nlb in todo:
            ns.backing.write_zeroes(slba * ns.lba_size, nlb * ns.lba_size)
    except OSError as exc:
        _io_error(conn, ns, sqe.cid, "deallocate", exc)
        return
    conn.complete(sqe.cid)


_HANDLERS = {
    spec.IO_READ: read,
    spec.IO_WRITE: write,
    spec.IO_FLUSH: flush,
    spec.IO_WRITE_ZEROES: write_zeroes,
    spec.IO_DSM: dataset_management,
}
