"""The host's DH-HMAC-CHAP exchange on one queue, over Fabrics Authentication Send/Receive.

:mod:`kvtool.nvme.dhchap` has the protocol; this runs it on a connected
:class:`~kvtool.nvme.queue.HostQueue` right after Fabrics Connect, the way the Linux host
does (``nvme_auth_negotiate``/``nvme_auth_wait``): Negotiate → Challenge → Reply →
Success1 (→ Success2 when the host also authenticates the controller).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from kvtool.nvme import dhchap as D
from kvtool.nvme import pdu as P
from kvtool.nvme import spec
from kvtool.nvme.dhchap import AuthFailed, HostAuth, Rejected, Secret
from kvtool.nvme.queue import HostQueue, NvmeStatusError, TransportError

_CDW10 = (D.SECP_DHCHAP << 24) | (D.SPSP << 16) | (D.SPSP << 8)


@dataclass(frozen=True)
class HostCredentials:
    """Who the host says it is and how it proves it. ``repr`` shows no key material."""

    hostnqn: str | None = None
    secret: Secret | None = None  # the host's DH-HMAC-CHAP secret
    ctrl_secret: Secret | None = None  # the controller's: set = bidirectional
    # whose NVMe-oF host connects: "kvtool" (the userspace NVMe/TCP host) or "kernel"
    # (Linux nvme-tcp/nvme-rdma through /dev/nvme-fabrics; nvme+rdma:// always)
    initiator: str | None = None  # None: kvtool's (the default)

    @classmethod
    def load(cls, hostnqn: str | None, secret_file: str | None, ctrl_file: str | None, *,
             fields: tuple[str, str, str] = ("hostnqn", "dhchap_secret", "dhchap_ctrl_secret"),
             initiator: str | None = None) -> HostCredentials | None:
        """Credentials from a host NQN and DH-HMAC-CHAP key *files* (mode 0600; secrets
        never come from argv or a config's text); None when none is given. ``fields``
        name the three where a caller took them (options, config keys), for its errors:
        :class:`~kvtool.errors.UsageError`, one line, no key material."""
        if hostnqn is None and secret_file is None and ctrl_file is None and initiator is None:
            return None
        from kvtool.errors import UsageError
        from kvtool.nvme.dhchap import load_secret_file
        from kvtool.nvme.url import check_nqn

        if ctrl_file is not None and secret_file is None:
            raise UsageError(f"bidirectional authentication needs the host's own secret too "
                             f"({fields[1]})", field=fields[2])
        if hostnqn is not None:
            check_nqn(hostnqn, field=fields[0])
        return cls(hostnqn=hostnqn,
                   secret=load_secret_file(secret_file, field=fields[1]) if secret_file else None,
                   ctrl_secret=(load_secret_file(ctrl_file, field=fields[2])
                                if ctrl_file else None),
                   initiator=initiator)


class AuthenticationError(OSError):
    """DH-HMAC-CHAP failed. ``side`` is who failed to prove itself: "host" or "controller"."""

    def __init__(self, side: str, message: str, reason: int = D.FAILED) -> None:
        super().__init__(message)
        self.side = side
        self.reason = reason

    def __str__(self) -> str:
        return str(self.args[0])


def _send(q: HostQueue, data: bytes) -> None:
    sqe = P.Sqe(spec.OPC_FABRICS, nsid=D.FCTYPE_AUTH_SEND, cdw10=_CDW10, cdw11=len(data))
    q.execute(sqe, what="Authentication Send", data_out=memoryview(data),
              in_capsule_max=spec.ADMIN_IN_CAPSULE_MAX)


def _receive(q: HostQueue) -> bytes:
    buf = bytearray(D.RECEIVE_LEN)
    sqe = P.Sqe(spec.OPC_FABRICS, nsid=D.FCTYPE_AUTH_RECEIVE, cdw10=_CDW10, cdw11=len(buf))
    cmd = q.submit(sqe, what="Authentication Receive", data_in=memoryview(buf),
                   partial_ok=True)  # AL is a maximum: SPDK sends just the message
    q.wait(cmd)
    return bytes(buf[:cmd.received])


def authenticate(q: HostQueue, *, hostnqn: str, subnqn: str, secret: Secret,
                 ctrl_secret: Secret | None, tid: int, where: str) -> HostAuth:
    """Run one transaction on ``q``; raise :class:`AuthenticationError` naming the side."""
    auth = HostAuth(hostnqn, subnqn, secret, ctrl_secret, tid)
    qname = f"queue {q.qid}"
    try:
        _send(q, auth.negotiate())
        challenge = _receive(q)
        try:
            reply = auth.reply(challenge)
        except AuthFailed as exc:
            _send_failure(q, auth, exc.reason)
            raise AuthenticationError("controller", f"DH-HMAC-CHAP: the controller at {where} "
                                      f"sent an unusable challenge on {qname}: {exc}",
                                      exc.reason) from None
        _send(q, reply)
        success1 = _receive(q)
        try:
            success2 = auth.finish(success1)
        except AuthFailed as exc:
            _send_failure(q, auth, exc.reason)
            raise AuthenticationError("controller", f"DH-HMAC-CHAP: the controller at {where} "
                                      f"failed bidirectional authentication on {qname}: {exc}",
                                      exc.reason) from None
        if success2 is not None:
            _send(q, success2)
    except Rejected as exc:
        raise AuthenticationError("host", f"DH-HMAC-CHAP: the target at {where} refused host "
                                  f"{hostnqn} on {qname}: {exc} (Failure1 reason "
                                  f"{exc.reason:#04x}); check --dhchap-secret",
                                  exc.reason) from None
    except NvmeStatusError as exc:
        raise AuthenticationError("host", f"DH-HMAC-CHAP: the target at {where} refused the "
                                  f"exchange on {qname}: {exc}") from None
    except TransportError as exc:
        # The kernel target tears the controller down after a failed transaction, often
        # before the host reads its Failure1 (reference NOTES, caveat 4).
        raise AuthenticationError("host", f"DH-HMAC-CHAP: the target at {where} dropped the "
                                  f"connection during authentication of host {hostnqn} on "
                                  f"{qname} (it refused the host's key): {exc}") from None
    return auth


def _send_failure(q: HostQueue, auth: HostAuth, reason: int) -> None:
    with contextlib.suppress(OSError):  # the connection is being given up anyway
        _send(q, auth.failure2(reason))
