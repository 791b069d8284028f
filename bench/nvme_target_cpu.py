#!/usr/bin/env python3
"""The target's CPU per 4 KiB command in one process, without sockets: the load-free side
of bench/nvme_target_perf.py.

An I/O queue of kvtool's target (a :class:`~emulator.nvmetcp.connection.QueueConnection`
on a 64 MiB memory namespace, replies going to a transport that discards them) is fed
batches of ``--qd`` Read capsules (Transport SGL) or Write capsules (4 KiB in-capsule)
through ``get_buffer``/``buffer_updated``, as the socket path feeds it. Prints CPU µs per
command; ``--general`` turns the hot path off (the general dispatch, as before issue 40).

Instructions per command (counted, load-free): run it twice under callgrind with N and 2N
batches and divide the difference by N × QD::

    valgrind --tool=callgrind --callgrind-out-file=/dev/null \\
        python bench/nvme_target_cpu.py read --qd 32 --batches 100

usage: python bench/nvme_target_cpu.py read|write [--qd 32] [--batches 2000] [--general]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from emulator.nvmetcp.auth import load_host_keys
from emulator.nvmetcp.config import simple_config
from emulator.nvmetcp.connection import QueueConnection
from emulator.nvmetcp.fuzz import HOSTNQN, NQN, FakeTransport, admin_session
from emulator.nvmetcp.subsystem import build_subsystems
from emulator.nvmetcp.target import TargetState
from kvtool.nvme import pdu as P
from kvtool.nvme import spec

SIZE = 64 << 20


class Discard(FakeTransport):
    def write(self, data: Any) -> None:
        pass


def capsule(sqe: P.Sqe, data: bytes = b"", transport_len: int = 0) -> bytes:
    sqe.sgl = (P.SglDescriptor.in_capsule(len(data)) if data
               else P.SglDescriptor.transport(transport_len))
    return P.encode(P.CapsuleCmd(sqe, data))


def io_queue(general: bool) -> QueueConnection:
    cfg = simple_config(nqn=NQN, backing=str(SIZE), hosts=[HOSTNQN], listen=["127.0.0.1:0"])
    loop = asyncio.new_event_loop()
    state = TargetState(cfg, build_subsystems(cfg), loop, load_host_keys(cfg))
    state.listeners = [("127.0.0.1", 4420)]
    admin = QueueConnection(state)
    admin.connection_made(FakeTransport())
    admin.data_received(admin_session())
    assert admin.ctrl is not None and admin.ctrl.ready
    conn = QueueConnection(state)
    conn.hot_path = not general
    conn.connection_made(Discard())
    data = spec.ConnectData(bytes(16), admin.ctrl.cntlid, NQN, HOSTNQN).encode()
    conn.data_received(P.encode(P.ICReq()) + capsule(P.Sqe(
        spec.OPC_FABRICS, nsid=spec.FCTYPE_CONNECT, cdw10=1 << 16, cdw11=127), data))
    assert conn.connected
    return conn


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("op", choices=("read", "write"))
    ap.add_argument("--qd", type=int, default=32, help="commands per receive (≤ 128)")
    ap.add_argument("--batches", type=int, default=2000)
    ap.add_argument("--general", action="store_true", help="without the hot path")
    args = ap.parse_args()
    conn = io_queue(args.general)
    rng = random.Random(1)
    payload = rng.randbytes(4096)
    batches = []
    for _ in range(16):
        parts = []
        for cid in range(args.qd):
            slba = rng.randrange(SIZE // 4096) * 8
            opcode = spec.IO_READ if args.op == "read" else spec.IO_WRITE
            sqe = P.Sqe(opcode, cid=cid, nsid=1, cdw10=slba, cdw12=7)
            parts.append(capsule(sqe, payload if args.op == "write" else b"", 4096))
        batches.append(b"".join(parts))

    def feed(batch: bytes) -> None:
        view = memoryview(batch)
        while len(view):
            buf = conn.get_buffer(-1)
            n = min(len(buf), len(view))
            buf[:n] = view[:n]
            view = view[n:]
            conn.buffer_updated(n)

    for b in batches:  # warm: every namespace page the batches touch
        feed(b)
    t0 = time.process_time()
    for i in range(args.batches):
        feed(batches[i & 15])
    cpu = time.process_time() - t0
    path = "general path" if args.general else "hot path"
    print(f"{args.op} QD{args.qd}, {path}: {cpu / (args.batches * args.qd) * 1e6:.2f} µs CPU "
          f"per command ({args.batches * args.qd} commands)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
