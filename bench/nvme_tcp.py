#!/usr/bin/env python3
"""NVMe/TCP benchmark: kvtool host ↔ kvtool target on loopback vs a plain Python socket stream.

Measured in the same run, both with the peer in a separate process:

* reference: a plain Python TCP stream on 127.0.0.1 (``sendall`` of 1 MiB buffers into
  ``recv_into``), in each direction — the best a Python NVMe/TCP stack could approach;
* 1 MiB sequential writes and reads through kvtool's host to ``python -m emulator.nvmetcp``
  (memory namespace) at QD 1 and QD 8 → GB/s and the ratio to the reference (bars: ≥ 0.8,
  QD 1 write ≥ 0.6);
* 4 KiB random reads at QD 1 and QD 32 → IOPS and latency p50/p99 (µs);
* with ``--spdk DIR`` (an SPDK build, see ../shared/reference/spdk/NOTES.md): SPDK's
  ``spdk_nvme_perf`` against the same target, 4 KiB random reads at QD 32 and random
  50/50 read/write at QD 8, next to kvtool's host doing the same → the IOPS ratio
  kvtool/SPDK (bar: ≥ 0.7).

Each round measures the reference and the NVMe/TCP cases back to back, so a busy machine
slows both alike; the printed ratio is the median over rounds. On a shared machine the
ratios swing by ±50 % between runs, so the sequential cases also report CPU time per MiB
(this process + the peer process, from getrusage and /proc): what a change to the stack
saves shows there even when the wall clock is dominated by other load.

``--poll`` measures kvtool's host with polled I/O queues (completions received on the
waiting thread, busy-polling) instead of the default reader threads — on an idle machine
the polled host meets every bar, the reader threads pay two wake-ups per command
(BENCHMARKS.md, issue 12 third pass); ``--busy-poll USEC``
sets the target's event-loop polling (default: the target's own, 500 µs; 0 disables).
``bench/tcp_ceiling.py`` measures what a bare Python request/response protocol reaches
against the same kind of stream.

usage: python bench/nvme_tcp.py [--rounds 5] [--mib 256] [--io-queues 1] [--disable-sqflow]
                               [--poll] [--busy-poll USEC] [--spdk DIR] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import random
import resource
import socket
import subprocess
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from kvtool.nvme import host, spec  # noqa: E402
from kvtool.nvme.queue import Command, HostQueue  # noqa: E402

NQN = "nqn.2026-01.io.kvtool:bench"
HOSTNQN = "nqn.2026-01.io.kvtool:bench-host"
MIB = 1 << 20

STREAM_PEER = r"""
import socket, sys
srv = socket.socket(); srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("127.0.0.1", 0)); srv.listen(4)
print(srv.getsockname()[1], flush=True)
buf = bytearray(1 << 20); view = memoryview(buf)
while True:
    conn, _ = srv.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    hdr = conn.recv(9, socket.MSG_WAITALL)
    if len(hdr) < 9:
        break
    mode, n = hdr[:1], int.from_bytes(hdr[1:], "little")
    if mode == b"W":          # drain n bytes, then ack
        left = n
        while left:
            got = conn.recv_into(view[: min(left, len(buf))])
            left -= got
        conn.sendall(b"k")
    else:                     # send n bytes
        left = n
        while left:
            k = min(left, len(buf)); conn.sendall(view[:k]); left -= k
    conn.close()
"""


class StreamPeer:
    """A plain Python TCP peer in another process: drains (W) or sends (R) N bytes."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", STREAM_PEER], stdout=subprocess.PIPE,
                                     text=True)
        assert self.proc.stdout is not None
        self.port = int(self.proc.stdout.readline())
        self.data = memoryview(os.urandom(MIB))
        self.buf = memoryview(bytearray(MIB))

    def measure(self, mode: str, total: int) -> float:
        """GB/s of one ``total``-byte stream in direction ``mode`` ("W" to the peer, "R")."""
        with socket.create_connection(("127.0.0.1", self.port)) as s:
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            t0 = time.perf_counter()
            s.sendall(mode.encode() + total.to_bytes(8, "little"))
            if mode == "W":
                for _ in range(total // MIB):
                    s.sendall(self.data)
                assert s.recv(1) == b"k"
            else:
                left = total
                while left:
                    left -= s.recv_into(self.buf[: min(left, MIB)])
            return total / (time.perf_counter() - t0) / 1e9

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


def cpu_seconds(pid: int) -> float:
    """CPU seconds of this process (all threads) plus those of single-threaded process
    ``pid`` (schedstat: nanoseconds, where /proc/PID/stat counts 10 ms ticks)."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime + int(
        Path(f"/proc/{pid}/schedstat").read_text().split()[0]) / 1e9


def start_target(size: str, busy_poll_us: int | None = None) -> tuple[subprocess.Popen[str], int]:
    extra = [] if busy_poll_us is None else ["--busy-poll", str(busy_poll_us)]
    proc = subprocess.Popen(
        [sys.executable, "-m", "emulator.nvmetcp", "--listen", "127.0.0.1:0", "--nqn", NQN,
         "--backing", size, "--host", HOSTNQN, *extra], cwd=REPO, stdout=subprocess.PIPE,
        text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith("ready "):
        raise SystemExit(f"target did not start: {line!r}")
    return proc, int(line.split()[1].split(":")[2].split("/")[0])


def next_done(ctrl: host.Controller, done: queue.SimpleQueue[Any],
              order: deque[tuple[HostQueue, Command]]) -> Any:
    """The next completion a callback put into ``done``. Interrupt queues: the reader
    thread puts it there. Polled queues: this thread receives it, waiting on the oldest
    outstanding command (its callback and any others run here)."""
    if not ctrl.poll:
        return done.get()
    while done.empty():
        while order[0][1].done.is_set():
            order.popleft()
        q, cmd = order[0]
        q.wait(cmd)
    return done.get()


def run_pipelined(ctrl: host.Controller, opcode: int, offsets: list[int], size: int, qd: int,
                  bufs: list[memoryview]) -> list[float]:
    """Keep ``qd`` commands in flight over ``offsets``; return each op's latency (s)."""
    done: queue.SimpleQueue[tuple[int, float, Command]] = queue.SimpleQueue()
    order: deque[tuple[HostQueue, Command]] = deque()
    lat: list[float] = []
    it = iter(offsets)
    inflight = 0

    def submit(slot: int) -> bool:
        off = next(it, None)
        if off is None:
            return False
        t0 = time.perf_counter()
        order.append(ctrl.submit_io(opcode, 1, off // 512, bufs[slot], 512,
                                    on_done=lambda cmd, s=slot, t=t0: done.put((s, t, cmd))))
        return True

    for slot in range(qd):
        if submit(slot):
            inflight += 1
    while inflight:
        slot, t0, cmd = next_done(ctrl, done, order)
        lat.append(time.perf_counter() - t0)
        cmd.result()
        inflight -= 1
        if submit(slot):
            inflight += 1
    return lat


def spdk_perf(spdk: Path, port: int, qd: int, workload: str, seconds: int) -> float:
    """IOPS of spdk_nvme_perf (4 KiB, one core, no hugepages) against the target."""
    trid = (f"trtype:TCP adrfam:IPv4 traddr:127.0.0.1 trsvcid:{port} subnqn:{NQN} "
            f"hostnqn:{HOSTNQN}")
    args = [str(spdk / "build" / "bin" / "spdk_nvme_perf"), "--no-huge", "-s", "512",
            "-c", "0x2", "-q", str(qd), "-o", "4096", "-w", workload, "-t", str(seconds),
            "-r", trid]
    if workload == "randrw":
        args += ["-M", "50"]
    done = subprocess.run(["timeout", "-k", "5", str(seconds + 30), *args], text=True,
                          capture_output=True, env={"PATH": "/usr/bin:/bin"})
    for line in done.stdout.splitlines():
        if line.strip().startswith("Total"):
            return float(line.split(":")[1].split()[0])
    raise SystemExit(f"spdk_nvme_perf gave no total (exit {done.returncode}):\n"
                     f"{done.stdout[-2000:]}{done.stderr[-2000:]}")


def kvtool_mixed(ctrl: host.Controller, qd: int, ios: int, region: int,
                 rng: random.Random) -> float:
    """IOPS of 4 KiB random 50/50 reads and writes at ``qd`` through kvtool's host."""
    offsets = [rng.randrange(region // 4096) * 4096 for _ in range(ios)]
    ops = [spec.IO_READ if rng.random() < 0.5 else spec.IO_WRITE for _ in range(ios)]
    bufs = [memoryview(bytearray(4096)) for _ in range(qd)]
    done: queue.SimpleQueue[tuple[int, Command]] = queue.SimpleQueue()
    order: deque[tuple[HostQueue, Command]] = deque()
    it = iter(zip(offsets, ops, strict=True))
    inflight = 0

    def submit(slot: int) -> bool:
        nxt = next(it, None)
        if nxt is None:
            return False
        order.append(ctrl.submit_io(nxt[1], 1, nxt[0] // 512, bufs[slot], 512,
                                    on_done=lambda cmd, s=slot: done.put((s, cmd))))
        return True

    t0 = time.perf_counter()
    for slot in range(qd):
        inflight += submit(slot)
    while inflight:
        slot, cmd = next_done(ctrl, done, order)
        cmd.result()
        inflight -= 1
        inflight += submit(slot)
    return ios / (time.perf_counter() - t0)


def pct(values: list[float], p: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, round(p / 100 * (len(s) - 1)))]


def median(values: list[float]) -> float:
    s = sorted(values)
    return s[len(s) // 2]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5,
                    help="interleaved rounds (reference and NVMe/TCP back to back; medians)")
    ap.add_argument("--mib", type=int, default=256, help="MiB moved per sequential case")
    ap.add_argument("--ios", type=int, default=4000, help="4 KiB random reads per case")
    ap.add_argument("--io-queues", type=int, default=1)
    ap.add_argument("--spdk", type=Path, help="SPDK build dir: compare with spdk_nvme_perf")
    ap.add_argument("--spdk-seconds", type=int, default=5)
    ap.add_argument("--disable-sqflow", action="store_true",
                    help="connect with SQ flow control disabled: reads complete with C2HData "
                         "SUCCESS, no CapsuleResp")
    ap.add_argument("--poll", action="store_true",
                    help="polled I/O queues: completions received on the waiting thread")
    ap.add_argument("--busy-poll", type=int, metavar="USEC",
                    help="the target's --busy-poll (default: the target's default)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()

    peer = StreamPeer()
    region = 512 * MIB
    proc, port = start_target(f"{region // MIB + 16}MiB", a.busy_poll)
    samples: dict[str, list[float]] = {}
    cpu: dict[str, list[float]] = {}  # CPU ms per MiB, both processes together
    ratios: dict[str, list[float]] = {}
    lat_all: dict[str, list[float]] = {"qd1": [], "qd32": []}
    iops: dict[str, list[float]] = {"qd1": [], "qd32": []}
    spdk_rows: dict[str, list[tuple[float, float]]] = {}
    try:
        with host.connect("127.0.0.1", port, NQN, hostnqn=HOSTNQN, io_queues=a.io_queues,
                          queue_depth=64, disable_sqflow=a.disable_sqflow,
                          poll=a.poll) as ctrl:
            payload = memoryview(os.urandom(MIB))
            rng = random.Random(1)
            for _ in range(a.rounds):
                for name, mode, opcode in (("write", "W", spec.IO_WRITE),
                                           ("read", "R", spec.IO_READ)):
                    c0 = cpu_seconds(peer.proc.pid)
                    ref = peer.measure(mode, a.mib * MIB)
                    cpu.setdefault(f"reference_{name}", []).append(
                        (cpu_seconds(peer.proc.pid) - c0) * 1e3 / a.mib)
                    samples.setdefault(f"reference_{name}", []).append(ref)
                    for qd in (1, 8):
                        bufs = [payload if opcode == spec.IO_WRITE
                                else memoryview(bytearray(MIB)) for _ in range(qd)]
                        offsets = [(i * MIB) % region for i in range(a.mib)]
                        c0 = cpu_seconds(proc.pid)
                        t0 = time.perf_counter()
                        run_pipelined(ctrl, opcode, offsets, MIB, qd, bufs)
                        gbps = a.mib * MIB / (time.perf_counter() - t0) / 1e9
                        cpu.setdefault(f"{name}_qd{qd}", []).append(
                            (cpu_seconds(proc.pid) - c0) * 1e3 / a.mib)
                        samples.setdefault(f"{name}_qd{qd}", []).append(gbps)
                        ratios.setdefault(f"{name}_qd{qd}", []).append(gbps / ref)
                for qd in (1, 32):
                    offsets = [rng.randrange(region // 4096) * 4096 for _ in range(a.ios)]
                    bufs = [memoryview(bytearray(4096)) for _ in range(qd)]
                    t0 = time.perf_counter()
                    lat = run_pipelined(ctrl, spec.IO_READ, offsets, 4096, qd, bufs)
                    iops[f"qd{qd}"].append(a.ios / (time.perf_counter() - t0))
                    lat_all[f"qd{qd}"].extend(lat)
                if a.spdk is not None:
                    for key, qd, wl in (("randread_qd32", 32, "randread"),
                                        ("randrw_qd8", 8, "randrw")):
                        theirs = spdk_perf(a.spdk, port, qd, wl, a.spdk_seconds)
                        if wl == "randread":
                            offs = [rng.randrange(region // 4096) * 4096
                                    for _ in range(a.ios)]
                            bufs = [memoryview(bytearray(4096)) for _ in range(qd)]
                            t0 = time.perf_counter()
                            run_pipelined(ctrl, spec.IO_READ, offs, 4096, qd, bufs)
                            ours = a.ios / (time.perf_counter() - t0)
                        else:
                            ours = kvtool_mixed(ctrl, qd, a.ios, region, rng)
                        spdk_rows.setdefault(key, []).append((ours, theirs))
    finally:
        proc.terminate()
        proc.wait(10)
        peer.close()
    seq = {k: {"gbps": round(median(v), 3), "ratio": round(median(ratios[k]), 3),
               "ratio_min": round(min(ratios[k]), 3), "ratio_max": round(max(ratios[k]), 3),
               "cpu_ms_per_mib": round(median(cpu[k]), 3)}
           for k, v in samples.items() if not k.startswith("reference")}
    ref = {k.split("_")[1]: round(median(v), 3) for k, v in samples.items()
           if k.startswith("reference")}
    ref_cpu = {k.split("_")[1]: round(median(v), 3) for k, v in cpu.items()
               if k.startswith("reference")}
    rnd = {k: {"iops": round(median(iops[k])), "p50_us": round(pct(lat_all[k], 50) * 1e6, 1),
               "p99_us": round(pct(lat_all[k], 99) * 1e6, 1)} for k in iops}
    vs_spdk = {k: {"kvtool_iops": round(median([o for o, _ in v])),
                   "spdk_perf_iops": round(median([t for _, t in v])),
                   "ratio": round(median([o / t for o, t in v]), 3)}
               for k, v in spdk_rows.items()}
    results = {"reference_stream_gbps": ref, "reference_cpu_ms_per_mib": ref_cpu,
               "seq_1mib": seq, "rand_read_4k": rnd,
               "vs_spdk_perf_4k": vs_spdk,
               "disable_sqflow": a.disable_sqflow, "poll": a.poll, "busy_poll_us": a.busy_poll,
               "rounds": a.rounds, "mib_per_case": a.mib,
               "io_queues": a.io_queues,
               "machine": f"{os.cpu_count()} CPUs, Python {sys.version.split()[0]}",
               "load_average": os.getloadavg()[0],
               "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    if a.json:
        print(json.dumps(results, indent=2))
        return 0
    print(f"reference plain Python TCP stream (median of {a.rounds}): write {ref['write']:.2f} "
          f"GB/s, read {ref['read']:.2f} GB/s; CPU (both ends) write {ref_cpu['write']:.3f}, "
          f"read {ref_cpu['read']:.3f} ms/MiB")
    for key, row in seq.items():
        floor = 0.6 if key == "write_qd1" else 0.8
        bar = "ok" if row["ratio"] >= floor else f"BELOW {floor}"
        print(f"1 MiB seq {key:9s} {row['gbps']:.2f} GB/s  ratio {row['ratio']:.2f} "
              f"(rounds {row['ratio_min']:.2f}..{row['ratio_max']:.2f})  {bar}  CPU (host + "
              f"target) {row['cpu_ms_per_mib']:.3f} ms/MiB")
    for key, r in rnd.items():
        print(f"4 KiB rand-read {key:5s} {r['iops']:>7} IOPS  p50 {r['p50_us']:.0f} µs  "
              f"p99 {r['p99_us']:.0f} µs")
    for key, v in vs_spdk.items():
        bar = "ok" if v["ratio"] >= 0.7 else "BELOW 0.7"
        print(f"4 KiB {key:13s} kvtool host {v['kvtool_iops']:>7} IOPS  spdk_nvme_perf "
              f"{v['spdk_perf_iops']:>7} IOPS  ratio {v['ratio']:.2f}  {bar}")
    print(f"host queues: {'polled' if a.poll else 'interrupt (reader threads)'}; target "
          f"busy-poll: {'default' if a.busy_poll is None else a.busy_poll} µs")
    print(f"load average during the run: {results['load_average']:.2f} (2 vCPUs shared)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
