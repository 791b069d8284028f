"""The command's data pointer (SQE flags and SGL descriptor) as the target judges it.

Decided against the references (Linux nvmet 6.1, SPDK; the differential harness in
:mod:`emulator.nvmetcp.conformance` checks it, docs/nvme-tcp.md has the table):

* Fused operations and any PSDT but "SGL, metadata contiguous" fail with Invalid Field
  (Linux's ``nvmet_req_init``; SPDK's too).
* A descriptor of length 0 means "no data" whatever its type and sub-type: a host may
  leave a data-less command's SGL all zero (Linux ``nvmet_tcp_map_data``, SPDK
  ``spdk_nvmf_req_get_xfer``). The all-zero Data Block form was refused here before.
* With data, the descriptor must be a Data Block with sub-type Offset (in-capsule data) or
  a Transport Data Block (R2T/H2CData or C2HData); anything else is SGL Descriptor Type
  Invalid (SPDK and the specification; Linux treats any other type as transport data).
* In-capsule data only on commands that transfer data to the controller (Linux: Invalid
  Field), within the queue's in-capsule size (SGL Offset Invalid, as Linux).
* Each command then checks the length it needs (:func:`expect_len`): a mismatch is Data
  SGL Length Invalid (Linux ``nvmet_check_transfer_len``).
"""

from __future__ import annotations

from emulator.nvmetcp.queue import Queue
from kvtool.nvme import pdu as P
from kvtool.nvme import spec
from kvtool.nvme.spec import status


def is_write(sqe: P.Sqe) -> bool:
    """The command transfers data to the controller (opcode bit 0; FCTYPE for fabrics)."""
    code = sqe.fctype if sqe.opcode == spec.OPC_FABRICS else sqe.opcode
    return bool(code & 1)


def check_pointer(conn: Queue, sqe: P.Sqe, data: bytes | memoryview) -> int:
    if sqe.flags & 0x03 or (sqe.flags >> 6) != 1:
        return status(spec.SC_INVALID_FIELD)  # fused ops unsupported; PSDT must be SGL
    sgl = sqe.sgl
    if data:
        if sgl.sgl_id != P.SGL_DATA_BLOCK_OFFSET:
            return status(spec.SC_SGL_DESC_TYPE_INVALID)
        if not is_write(sqe):
            return status(spec.SC_INVALID_FIELD)
        if sgl.address != 0:
            return status(spec.SC_SGL_OFFSET_INVALID)
        limit = (spec.ADMIN_IN_CAPSULE_MAX if conn.qid <= 0 or sqe.opcode == spec.OPC_FABRICS
                 else conn.state.config.in_capsule_data_size)
        if len(data) > limit:
            return status(spec.SC_SGL_OFFSET_INVALID)
        if sgl.length != len(data):
            return status(spec.SC_SGL_DATA_LEN_INVALID)
        return 0
    if sgl.length == 0:
        return 0
    if sgl.sgl_id == P.SGL_DATA_BLOCK_OFFSET:
        return status(spec.SC_SGL_DATA_LEN_INVALID)  # claims in-capsule data, carries none
    if sgl.sgl_id != P.SGL_TRANSPORT_DATA_BLOCK:
        return status(spec.SC_SGL_DESC_TYPE_INVALID)
    return 0


def transfer_len(sqe: P.Sqe, data: bytes | memoryview) -> int:
    """Bytes the host's data pointer describes (checked by :func:`check_pointer`)."""
    return len(data) if data else sqe.sgl.length


def expect_len(conn: Queue, sqe: P.Sqe, data: bytes | memoryview, n: int) -> bool:
    """The command moves exactly ``n`` bytes; else complete it with Data SGL Length Invalid."""
    if transfer_len(sqe, data) != n:
        conn.complete(sqe.cid, status(spec.SC_SGL_DATA_LEN_INVALID))
        return False
    return True
