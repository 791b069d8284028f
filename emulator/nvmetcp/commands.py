"""Command dispatch on the target: the data pointer, then fabrics, admin or NVM commands.

The data pointer rules are in :mod:`emulator.nvmetcp.sgl`; the command sets in
:mod:`~emulator.nvmetcp.fabrics`, :mod:`~emulator.nvmetcp.admin` and
:mod:`~emulator.nvmetcp.nvm`.
"""

from __future__ import annotations

from emulator.nvmetcp import admin, fabrics, nvm
from emulator.nvmetcp.auth import AUTH_REQUIRED
from emulator.nvmetcp.nvm import landing_zone
from emulator.nvmetcp.queue import Queue
from emulator.nvmetcp.sgl import check_pointer
from kvtool.nvme import pdu as P
from kvtool.nvme import spec
from kvtool.nvme.spec import status

__all__ = ["dispatch", "landing_zone"]


def dispatch(conn: Queue, sqe: P.Sqe, data: bytes | memoryview) -> None:
    """Run one command (its CID is already accounted for); every path completes it or
    leaves it deliberately outstanding (an AER, a write waiting for H2CData)."""
    st = check_pointer(conn, sqe, data)
    if st:
        conn.complete(sqe.cid, st)
        return
    if sqe.opcode == spec.OPC_FABRICS:
        fabrics.dispatch(conn, sqe, data)
        return
    ctrl = conn.ctrl
    if not conn.connected or ctrl is None:
        conn.complete(sqe.cid, status(spec.SC_INVALID_OPCODE))
    elif conn.auth is not None and not conn.auth.authenticated:
        conn.complete(sqe.cid, AUTH_REQUIRED)  # DH-HMAC-CHAP first (nvmet_check_auth_status)
    elif conn.qid == 0:
        admin.dispatch(conn, ctrl, sqe, data)
    else:
        nvm.dispatch(conn, ctrl, sqe, data)
