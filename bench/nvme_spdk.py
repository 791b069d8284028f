#!/usr/bin/env python3
"""SPDK in the loop: SPDK's host and kvtool's host against SPDK's target and kvtool's target.

All four pairings, measured in the same run, one target at a time (each on CPU 0; hosts on
CPU 1), 256 MiB memory namespace with 512 B LBAs on 127.0.0.1:

* SPDK's ``spdk_nvme_perf`` (one core, no hugepages) → SPDK's ``nvmf_tgt`` (malloc bdev) is
  the reference; the same perf cases → kvtool's target (``python -m emulator.nvmetcp``)
  give the ratio kvtool target / SPDK target;
* kvtool's userspace host (the store engine, ``kvtool.nvme.engine``) → both targets; the
  ratio to SPDK's perf on the same target says how much of the gap is the host.

Cases: 4 KiB random read at QD 1 and QD 32, 4 KiB random write at QD 32, 128 KiB random
read and write at QD 32. Each prints IOPS, GB/s and mean latency; medians over ``--rounds``.

usage: python bench/nvme_spdk.py [--rounds 3] [--seconds 3] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from collections import deque
from concurrent.futures import Future
from pathlib import Path
from statistics import median
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from emulator.spdk import tools  # noqa: E402
from kvtool.nvme.engine import open_nvme_tcp  # noqa: E402
from kvtool.target.spdk.app import SpdkApp  # noqa: E402
from kvtool.target.spdk.install import find_spdk  # noqa: E402

NQN = "nqn.2026-01.io.kvtool:bench-spdk"
HOSTNQN = "nqn.2026-01.io.kvtool:bench-spdk-host"
SIZE = 256 << 20
CASES = [("randread", 4096, 1), ("randread", 4096, 32), ("randwrite", 4096, 32),
         ("randread", 131072, 32), ("randwrite", 131072, 32)]


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_spdk(install: Any, port: int) -> SpdkApp:
    app = SpdkApp(install, cpumask="0x1", die_with_parent=True).start()
    tools.serve_malloc(app, NQN, port, SIZE)
    return app


def start_kvtool(port: int) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        ["taskset", "-c", "0", sys.executable, "-m", "emulator.nvmetcp", "--listen",
         f"127.0.0.1:{port}", "--nqn", NQN, "--backing", f"{SIZE}", "--allow-any-host"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=REPO)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith("ready "):
        proc.kill()
        raise SystemExit(f"kvtool's target did not start: {line!r}")
    return proc


def kvtool_host(port: int, workload: str, io_size: int, qd: int, seconds: float) -> dict[str, float]:
    """The store engine with ``qd`` commands in flight, random aligned offsets."""
    url = f"nvme+tcp://127.0.0.1:{port}/{NQN}/1"
    rng = random.Random(1)
    slots = SIZE // io_size
    bufs = [memoryview(bytearray(os.urandom(io_size))) for _ in range(qd)]
    with open_nvme_tcp(url, write=True, qd=qd, hostnqn=HOSTNQN) as eng:
        submit = eng.submit_write if workload == "randwrite" else eng.submit_read
        inflight: deque[tuple[Future[None], float]] = deque()
        done, lat, k = 0, 0.0, 0
        end = time.perf_counter() + seconds
        started = time.perf_counter()
        while True:
            now = time.perf_counter()
            while len(inflight) < qd and now < end:
                inflight.append((submit(rng.randrange(slots) * io_size, bufs[k % qd]), now))
                k += 1
            if not inflight:
                break
            fut, t0 = inflight.popleft()
            fut.result(timeout=30)
            lat += time.perf_counter() - t0
            done += 1
        elapsed = time.perf_counter() - started
    return {"iops": done / elapsed, "gb_s": done * io_size / elapsed / 1e9,
            "lat_us": lat / done * 1e6}


def spdk_host(install: Any, port: int, workload: str, io_size: int, qd: int,
              seconds: int) -> dict[str, float]:
    r = tools.perf(install, tools.trid("127.0.0.1", port, NQN, HOSTNQN), workload=workload,
                   qd=qd, io_size=io_size, seconds=seconds)
    if not r.run.ok:
        raise SystemExit(f"spdk_nvme_perf failed: {r.run.errors or r.run.output[-1500:]}")
    return {"iops": r.iops, "gb_s": r.gb_s, "lat_us": r.avg_us}


def one_round(install: Any, seconds: int) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for target in ("spdk", "kvtool"):
        port = free_port()
        app = start_spdk(install, port) if target == "spdk" else None
        proc = start_kvtool(port) if target == "kvtool" else None
        try:
            for workload, io_size, qd in CASES:
                case = f"{workload} {io_size // 1024}K QD{qd}"
                out[f"spdk-host|{target}|{case}"] = spdk_host(install, port, workload, io_size,
                                                              qd, seconds)
                out[f"kvtool-host|{target}|{case}"] = kvtool_host(port, workload, io_size, qd,
                                                                  seconds)
        finally:
            if app is not None:
                app.stop()
            if proc is not None:
                proc.terminate()
                proc.wait(15)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    os.sched_setaffinity(0, {1})  # kvtool's host on CPU 1, like spdk_nvme_perf -c 0x2
    install = find_spdk(build=True, log=lambda m: print(m, file=sys.stderr))
    rounds = [one_round(install, args.seconds) for _ in range(args.rounds)]
    keys = list(rounds[0])
    med = {k: {m: median(r[k][m] for r in rounds) for m in ("iops", "gb_s", "lat_us")}
           for k in keys}
    if args.json:
        print(json.dumps({"rounds": rounds, "median": med}, indent=2))
        return 0
    print(f"{args.rounds} round(s) of {args.seconds} s per case; load average "
          f"{os.getloadavg()[0]:.1f}; {install.version()['version']}")
    print(f"{'case':22} {'host':7} {'SPDK target':>24} {'kvtool target':>24} {'kvtool/SPDK':>11}")
    for workload, io_size, qd in CASES:
        case = f"{workload} {io_size // 1024}K QD{qd}"
        for h in ("spdk-host", "kvtool-host"):
            s, k = med[f"{h}|spdk|{case}"], med[f"{h}|kvtool|{case}"]
            cell = lambda d: f"{d['iops']:9,.0f} {d['gb_s']:5.2f} {d['lat_us']:6.0f}"  # noqa: E731
            print(f"{case:22} {h[:-5]:7} {cell(s):>24} {cell(k):>24} "
                  f"{k['iops'] / s['iops']:11.2f}")
    print("cells: IOPS, GB/s, mean latency µs; ratio = IOPS on kvtool's target / SPDK's target")
    print("host limit: kvtool host IOPS / SPDK perf IOPS, same target:")
    for workload, io_size, qd in CASES:
        case = f"{workload} {io_size // 1024}K QD{qd}"
        r = [med[f"kvtool-host|{t}|{case}"]["iops"] / med[f"spdk-host|{t}|{case}"]["iops"]
             for t in ("spdk", "kvtool")]
        print(f"  {case:22} on SPDK target {r[0]:.2f}, on kvtool target {r[1]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
