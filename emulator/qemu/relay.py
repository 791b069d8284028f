"""Guest-to-host relay that QEMU runs per connection for a ``guestfwd=...-cmd:`` rule.

usage: python3 relay.py PORT

slirp starts this program once per guest connection to the guestfwd address, with the
connection as stdin and stdout, and this copies bytes both ways to 127.0.0.1:PORT. Only the
explicitly forwarded ports are reachable: the guest network runs with ``restrict=on``.
Standard library only, and no output on stderr (it may be the same socket as stdout).

libslirp hands the connection over as one end of a loopback *TCP* socket pair (stdin and
stdout are the same socket). Left alone, Nagle on our end and delayed ACKs towards slirp's
end hold back every small PDU behind an unacknowledged one, which costs milliseconds per
NVMe command; hence TCP_NODELAY, and TCP_QUICKACK after each receive.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import socket
import sys

CHUNK = 1 << 20


def _tune(sock: socket.socket) -> bool:
    """TCP_NODELAY on a TCP socket; returns whether it is TCP (so QUICKACK applies)."""
    if sock.family not in (socket.AF_INET, socket.AF_INET6):
        return False
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return True


def _quickack(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_QUICKACK, 1)


def relay(port: int, guest: socket.socket) -> None:
    """Copy ``guest`` <-> 127.0.0.1:port until both directions have ended."""
    guest.setblocking(True)
    upstream = socket.create_connection(("127.0.0.1", port), timeout=10)
    upstream.settimeout(None)
    quick = {guest: _tune(guest), upstream: _tune(upstream)}
    peer = {guest: upstream, upstream: guest}
    sel = selectors.DefaultSelector()
    sel.register(guest, selectors.EVENT_READ)
    sel.register(upstream, selectors.EVENT_READ)
    while sel.get_map():
        for key, _ in sel.select():
            src: socket.socket = key.fileobj  # type: ignore[assignment]
            data = src.recv(CHUNK)
            if quick[src]:
                _quickack(src)
            if not data:
                sel.unregister(src)
                with contextlib.suppress(OSError):
                    peer[src].shutdown(socket.SHUT_WR)
                continue
            peer[src].sendall(data)


def main() -> int:
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        port = int(sys.argv[1])
        # stdin and stdout are the same connection: one socket object serves both ways
        guest = socket.socket(fileno=os.dup(0))
        relay(port, guest)
    except (OSError, ValueError, IndexError):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
