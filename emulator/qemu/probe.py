"""Probe an NVMe/TCP listener: send an ICReq, expect an ICResp (NVMe/TCP transport spec 3.6.2).

QEMU's slirp hostfwd accepts a TCP connection on the host side before the guest listens and
then drops it, so a successful ``connect()`` proves nothing: only an ICResp does.
Adapted from the qemu-nvmet recipe (../shared/reference/qemu-nvmet/probe_icreq.py).
"""

from __future__ import annotations

import socket
import struct
import time
from dataclasses import dataclass

ICREQ, ICRESP = 0x00, 0x01


@dataclass(frozen=True)
class ICResp:
    pfv: int
    cpda: int
    dgst: int
    maxh2cdata: int


def build_icreq(hpda: int = 0, digest: int = 0, maxr2t: int = 0) -> bytes:
    """A 128-byte ICReq: common header (type, flags, hlen, pdo, plen) + PFV, HPDA, DGST, MAXR2T."""
    pdu = struct.pack("<BBBBI", ICREQ, 0, 128, 0, 128) + struct.pack("<HBBI", 0, hpda, digest, maxr2t)
    return pdu + bytes(128 - len(pdu))


def _recv_exact(s: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        if not chunk:
            raise ConnectionError(f"EOF after {len(buf)} of {n} bytes")
        buf += chunk
    return buf


def probe(host: str, port: int, *, digest: int = 0, timeout: float = 5.0) -> ICResp:
    """One ICReq/ICResp exchange; raises OSError or ValueError when no valid ICResp comes back."""
    with socket.create_connection((host, port), timeout=timeout) as s:
        s.sendall(build_icreq(digest=digest))
        ptype, _flags, hlen, _pdo, plen = struct.unpack("<BBBBI", _recv_exact(s, 8))
        if ptype != ICRESP or hlen != 128 or plen != 128:
            raise ValueError(f"unexpected PDU type={ptype:#x} hlen={hlen} plen={plen}")
        pfv, cpda, dgst, maxdata = struct.unpack("<HBBI", _recv_exact(s, plen - 8)[:8])
        return ICResp(pfv, cpda, dgst, maxdata)


def wait_for_icresp(host: str, port: int, timeout: float) -> ICResp:
    """Retry ``probe`` until it succeeds or ``timeout`` seconds pass (then re-raise the last error)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return probe(host, port, timeout=min(5.0, max(0.5, deadline - time.monotonic())))
        except (OSError, ValueError):
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.1)
