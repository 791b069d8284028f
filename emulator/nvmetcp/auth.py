"""DH-HMAC-CHAP on the target side: per-host keys and Fabrics Authentication Send/Receive.

A host with an entry in ``host_keys`` must authenticate on every queue it connects: the
Connect response carries AUTHREQ.ATR, and until the transaction succeeds every command
but Property Get/Set and the authentication commands fails with Authentication Required
(SCT 1, SC 0x91, DNR), as on Linux nvmet. A failed transaction ends the controller once
the host has read the Failure1 (or sent a Failure2), also as nvmet does.
"""

from __future__ import annotations

import logging

from emulator.nvmetcp.config import EmulatorConfig
from emulator.nvmetcp.queue import Queue
from emulator.nvmetcp.sgl import expect_len, transfer_len
from kvtool.errors import InputError
from kvtool.nvme import dhchap as D
from kvtool.nvme import pdu as P
from kvtool.nvme import spec
from kvtool.nvme.spec import status

log = logging.getLogger("emulator.nvmetcp")

AUTH_REQUIRED = status(D.SC_AUTH_REQUIRED, spec.SCT_COMMAND_SPECIFIC)
_CDW10 = (D.SECP_DHCHAP << 24) | (D.SPSP << 16) | (D.SPSP << 8)
FCTYPE_AUTH_SEND, FCTYPE_AUTH_RECEIVE = D.FCTYPE_AUTH_SEND, D.FCTYPE_AUTH_RECEIVE


def load_host_keys(config: EmulatorConfig, *, file: str | None = None) -> dict[str, D.HostKeys]:
    """Read every host's key files (InputError naming the field when one is unusable)."""
    out: dict[str, D.HostKeys] = {}
    for i, hk in enumerate(config.host_keys):
        where = f"host_keys[{i}]"
        try:
            secret = D.load_secret_file(hk.dhchap_key_file, field=f"{where}.dhchap_key_file")
            ctrl = (D.load_secret_file(hk.dhchap_ctrl_key_file,
                                       field=f"{where}.dhchap_ctrl_key_file")
                    if hk.dhchap_ctrl_key_file else None)
        except InputError as exc:
            raise InputError(exc.message, file=file, field=exc.field) from None
        hashes = tuple(D.hash_id(h) for h in hk.dhchap_hashes) or D.ALL_HASHES
        groups = tuple(D.dhgroup_id(g) for g in hk.dhchap_dhgroups) or D.ALL_DHGROUPS
        out[hk.nqn] = D.HostKeys(secret, ctrl, hashes, groups)
    return out


def on_connect(conn: Queue, hostnqn: str, subnqn: str, discovery: bool) -> int:
    """Start a transaction for ``hostnqn`` when it has keys; the Connect result's AUTHREQ bits."""
    keys = conn.state.host_keys.get(hostnqn)
    if keys is None or discovery:
        conn.auth = None
        return 0
    conn.auth = D.ControllerAuth(hostnqn, subnqn, keys)
    return D.CONNECT_ATR


def on_command(conn: Queue, sqe: P.Sqe, data: bytes | memoryview) -> None:
    """Authentication Send (fctype 05h) or Receive (06h), on any queue."""
    auth = conn.auth
    if sqe.cdw10 != _CDW10:  # SECP E9h, SPSP0/1 01h: nothing else is spoken here
        conn.complete(sqe.cid, status(spec.SC_INVALID_FIELD))
        return
    if auth is None:
        conn.complete(sqe.cid, status(spec.SC_CMD_SEQ_ERROR))
        return
    if sqe.fctype == D.FCTYPE_AUTH_SEND:
        length = transfer_len(sqe, data)
        if length == 0 or length != sqe.cdw11 or length > D.RECEIVE_LEN:
            conn.complete(sqe.cid, status(spec.SC_INVALID_FIELD))
        elif data:
            _send(conn, auth, sqe.cid, data)
        elif conn.qid > 0:  # an I/O queue may take it after an R2T
            conn.receive_data(sqe.cid, length, None,
                              lambda view: _send(conn, auth, sqe.cid, bytes(view)))
        else:
            conn.complete(sqe.cid, status(spec.SC_SGL_DESC_TYPE_INVALID))
        return
    al = sqe.cdw11
    if al < 16:
        conn.complete(sqe.cid, status(spec.SC_INVALID_FIELD))
        return
    if not expect_len(conn, sqe, data, al):
        return
    msg = auth.on_receive()
    conn.send_data(sqe.cid, msg[:al] + bytes(max(0, al - len(msg))))
    what = f"host {auth.hostnqn} qid {conn.qid}"
    if auth.failure_sent:
        log.warning("%s: DH-HMAC-CHAP refused: %s", what, auth.message)
        _end(conn, "authentication failed")
    elif auth.authenticated and auth.step == D.MSG_NEGOTIATE:
        _log_success(what, auth)


def _send(conn: Queue, auth: D.ControllerAuth, cid: int,
          data: bytes | memoryview) -> None:
    auth.on_send(data)
    conn.complete(cid)
    what = f"host {auth.hostnqn} qid {conn.qid}"
    if auth.failed:
        log.warning("%s: DH-HMAC-CHAP failed: %s", what, auth.message)
        _end(conn, "authentication failed")
    elif auth.authenticated and auth.step == D.MSG_NEGOTIATE:
        _log_success(what, auth)


def _log_success(what: str, auth: D.ControllerAuth) -> None:
    log.info("%s: authenticated (%s, %s%s)", what, auth.hash.name if auth.hash else "?",
             D.DHGROUPS.get(auth.dhgroup, "?"),
             ", bidirectional" if auth.keys.ctrl_secret is not None else "")


def _end(conn: Queue, reason: str) -> None:
    """Tear the controller down (the kernel's fatal error); queued output goes out first."""
    ctrl = conn.ctrl
    if ctrl is not None:
        conn.flush()
        ctrl.subsys.delete_controller(ctrl, reason=reason)
    else:
        conn.close(reason)
