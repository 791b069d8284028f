#!/usr/bin/env python3
"""Fuzz the userspace NVMe/TCP target's PDU parser and state machine.

Feeds ``--count`` malformed connection streams (seeded mutations of valid sessions: bit
flips, header-field rewrites, truncation, insertion, duplication, splicing; with and
without digests) straight into the target's connection state machine, then ``--sockets``
more through real sockets to a running target, and checks after every input that nothing
raised, no internal error was logged, and everything the target sent parses as
well-formed PDUs. The reference it prints against is the rate of valid sessions through
the same harness. Exit status 1 if any invariant broke.

usage: python bench/nvme_fuzz.py [--count 200000] [--sockets 1000] [--seed N]
"""

from __future__ import annotations

import argparse
import logging
import random
import socket
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from emulator.nvmetcp import Target, simple_config
from emulator.nvmetcp.fuzz import (
    HOSTNQN,
    NQN,
    Harness,
    mutate,
    run_fuzz,
    seed_sessions,
)
from kvtool.nvme import host


def socket_fuzz(count: int, seed: int) -> tuple[int, float]:
    logging.getLogger("emulator.nvmetcp").setLevel(logging.ERROR)  # expected warnings
    target = Target(simple_config(nqn=NQN, backing="1MiB", hosts=[HOSTNQN],
                                  listen=["127.0.0.1:0"])).start_in_thread()
    try:
        rng = random.Random(seed)
        corpus = seed_sessions(rng)
        t0 = time.perf_counter()
        for i in range(count):
            stream = mutate(corpus[i % len(corpus)], rng, corpus)
            with socket.create_connection(("127.0.0.1", target.port), timeout=10) as s:
                try:
                    s.sendall(stream)
                    s.shutdown(socket.SHUT_WR)
                    while s.recv(65536):
                        pass
                except (ConnectionResetError, BrokenPipeError):
                    pass
        dt = time.perf_counter() - t0
        with host.connect("127.0.0.1", target.port, NQN, hostnqn=HOSTNQN) as ctrl:
            ctrl.write(1, 0, b"alive!!!" * 64)
            assert ctrl.read(1, 0, 1) == b"alive!!!" * 64, "target lost data after fuzzing"
        return count, dt
    finally:
        target.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--count", type=int, default=200_000)
    ap.add_argument("--sockets", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=20261129)
    a = ap.parse_args()

    h = Harness()
    try:
        rng = random.Random(a.seed)
        valid = seed_sessions(rng)
        t0 = time.perf_counter()
        for _ in range(20):
            for s in valid:
                h.run(s, rng)
        valid_rate = 20 * len(valid) / (time.perf_counter() - t0)
        h.stats.inputs = h.stats.terminated = 0
        t0 = time.perf_counter()
        stats = run_fuzz(a.count, seed=a.seed, harness=h)
        dt = time.perf_counter() - t0
    finally:
        h.close()
    n_sock, dt_sock = socket_fuzz(a.sockets, a.seed + 1)
    print(f"state machine: {stats.inputs} inputs in {dt:.1f} s ({stats.inputs / dt:,.0f}/s; "
          f"valid sessions run at {valid_rate:,.0f}/s, ratio {stats.inputs / dt / valid_rate:.2f})")
    print(f"  terminated with C2HTermReq: {stats.terminated} "
          f"({stats.terminated / max(1, stats.inputs):.0%}); invariant failures: "
          f"{len(stats.failures)}")
    print(f"sockets: {n_sock} malformed connections in {dt_sock:.1f} s; target still serves")
    for f in stats.failures[:10]:
        print("  FAIL", f)
    return 1 if stats.failures else 0


if __name__ == "__main__":
    sys.exit(main())
