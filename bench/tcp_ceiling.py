#!/usr/bin/env python3
"""The ceiling of any request/response protocol in Python on this machine, next to a stream.

``bench/nvme_tcp.py`` compares kvtool's NVMe/TCP with a plain socket *stream*, which never
waits. A storage protocol at queue depth 1 must wait: send a command, then receive the
answer. This measures, in the same run and with the peer in another process, what the
thinnest possible Python protocol reaches (no NVMe at all, a 72-byte command and a 1 MiB
answer for reads; a 1 MiB + 72-byte command and a 24-byte answer for writes):

* ``stream``: ``sendall`` of 1 MiB buffers into ``recv_into`` (bench/nvme_tcp.py's reference);
* ``rr-block``: request/response, the client sleeping in a blocking ``recv``;
* ``rr-spin``: the same, the client busy-polling with ``MSG_DONTWAIT`` (what kvtool's polled
  queues do);

at QD 1 and QD 8, each as GB/s and as a ratio to the stream of its round (medians).

usage: python bench/tcp_ceiling.py [--rounds 5] [--mib 256] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time

MIB = 1 << 20
CMD = 72
RESP = 24

PEER = r"""
import socket
MIB, CMD, RESP = 1 << 20, 72, 24
srv = socket.socket(); srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("127.0.0.1", 0)); srv.listen(8)
print(srv.getsockname()[1], flush=True)
data = memoryview(bytearray(MIB + 2 * RESP)); inbox = memoryview(bytearray(MIB + CMD))
while True:
    c, _ = srv.accept()
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    mode = c.recv(1)
    try:
        if mode == b"S":            # stream to the client until it hangs up
            while True:
                c.sendall(data[:MIB])
        elif mode == b"D":          # drain a stream, then ack
            while c.recv_into(inbox):
                pass
            c.sendall(b"k")
        elif mode == b"R":          # read: 72-byte command -> 1 MiB + two headers
            while c.recv_into(inbox, CMD, socket.MSG_WAITALL) == CMD:
                c.sendall(data)
        else:                       # write: 1 MiB + 72-byte command -> 24-byte answer
            while c.recv_into(inbox, MIB + CMD, socket.MSG_WAITALL) == MIB + CMD:
                c.sendall(data[:RESP])
    except OSError:
        pass
    c.close()
"""


class Peer:
    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", PEER], stdout=subprocess.PIPE,
                                     text=True)
        assert self.proc.stdout is not None
        self.port = int(self.proc.stdout.readline())
        self.out = memoryview(os.urandom(MIB + CMD))
        self.buf = memoryview(bytearray(MIB + 2 * RESP))

    def _conn(self, mode: bytes) -> socket.socket:
        s = socket.create_connection(("127.0.0.1", self.port))
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        s.sendall(mode)
        return s

    def stream(self, direction: str, n: int) -> float:
        t0 = time.perf_counter()
        with self._conn(b"S" if direction == "read" else b"D") as s:
            if direction == "read":
                left = n * MIB
                while left:
                    left -= s.recv_into(self.buf[: min(left, MIB)])
            else:
                for _ in range(n):
                    s.sendall(self.out[:MIB])
                s.shutdown(socket.SHUT_WR)
                s.recv(1)
        return n * MIB / (time.perf_counter() - t0) / 1e9

    def _recv(self, s: socket.socket, n: int, spin: bool) -> None:
        got = 0
        while got < n:
            if spin:
                try:  # noqa: SIM105 - a with-block per spin costs more than the recv
                    got += s.recv_into(self.buf[got:n], 0, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    pass
            else:
                got += s.recv_into(self.buf[got:n])

    def request_response(self, direction: str, n: int, qd: int, spin: bool) -> float:
        read = direction == "read"
        answer = MIB + 2 * RESP if read else RESP
        command = self.out[:CMD] if read else self.out
        t0 = time.perf_counter()
        with self._conn(b"R" if read else b"W") as s:
            sent = done = 0
            while done < n:
                while sent < n and sent - done < qd:
                    s.sendall(command)
                    sent += 1
                self._recv(s, answer, spin)
                done += 1
        return n * MIB / (time.perf_counter() - t0) / 1e9

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


def median(values: list[float]) -> float:
    s = sorted(values)
    return s[len(s) // 2]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--mib", type=int, default=256, help="MiB per case")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    peer = Peer()
    gbps: dict[str, list[float]] = {}
    ratio: dict[str, list[float]] = {}
    try:
        for _ in range(a.rounds):
            for direction in ("write", "read"):
                ref = peer.stream(direction, a.mib)
                gbps.setdefault(f"{direction} stream", []).append(ref)
                for spin in (False, True):
                    for qd in (1, 8):
                        key = f"{direction} rr-{'spin' if spin else 'block'} qd{qd}"
                        g = peer.request_response(direction, a.mib, qd, spin)
                        gbps.setdefault(key, []).append(g)
                        ratio.setdefault(key, []).append(g / ref)
    finally:
        peer.close()
    out = {k: {"gbps": round(median(v), 3),
               **({"ratio": round(median(ratio[k]), 3), "ratio_min": round(min(ratio[k]), 3),
                   "ratio_max": round(max(ratio[k]), 3)} if k in ratio else {})}
           for k, v in gbps.items()}
    meta = {"rounds": a.rounds, "mib": a.mib, "load_average": os.getloadavg()[0],
            "machine": f"{os.cpu_count()} CPUs, Python {sys.version.split()[0]}",
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    if a.json:
        print(json.dumps({"cases": out, **meta}, indent=2))
        return 0
    for key, row in out.items():
        extra = (f"  ratio to the stream {row['ratio']:.2f} ({row['ratio_min']:.2f}.."
                 f"{row['ratio_max']:.2f})") if "ratio" in row else ""
        print(f"{key:22s} {row['gbps']:.2f} GB/s{extra}")
    print(f"load average {meta['load_average']:.2f}, {meta['machine']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
