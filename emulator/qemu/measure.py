"""Reference figures for the kernel guest: 1 MiB sequential I/O from kvtool's userspace host
to the guest kernel's nvmet-tcp target, against a raw TCP stream through the same forward.

  python -m emulator.qemu.measure [--mib 48] [--qd 1,8] [--json]

Each line is MB/s and its ratio to a raw TCP stream in the same direction through slirp's
hostfwd (``dd`` in the guest reading or writing the connection itself), measured in the
same run, so the figure says how much of the path's capacity NVMe/TCP gets. Also measured,
for scale and without a ratio: the guest kernel's own host against its own target over the
guest's loopback (no slirp). These are emulator figures (TCG, slirp, a small VM), useful
for proving and comparing, not as hardware numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from typing import Any

from emulator.qemu.guest import Guest

MiB = 1 << 20


def _engine_seq(url: str, *, write: bool, qd: int, total: int, digests: bool) -> float:
    from kvtool.nvme.engine import open_nvme_tcp
    from kvtool.store.engine import AlignedBuffer

    engine = open_nvme_tcp(url, write=True, qd=qd, header_digest=digests, data_digest=digests)
    buf = AlignedBuffer(MiB)
    buf.view[:] = os.urandom(MiB)
    try:
        t0 = time.monotonic()
        pending = []
        for i in range(total // MiB):
            submit = engine.submit_write if write else engine.submit_read
            pending.append(submit(i * MiB, buf.view))
            if len(pending) >= qd:
                pending.pop(0).result()
        for fut in pending:
            fut.result()
        if write:
            engine.flush()
        return total / (time.monotonic() - t0) / 1e6
    finally:
        engine.close()
        buf.close()


def _raw_stream(guest: Guest, total: int) -> float:
    """Host -> guest: the control shell execs ``dd`` reading the connection itself."""
    data = bytes(MiB)
    with socket.create_connection(("127.0.0.1", guest.control_port), timeout=60) as s:
        s.sendall(b"exec dd of=/dev/null bs=1M 2>/dev/null\n")
        time.sleep(0.3)  # let the shell exec dd before the payload arrives
        t0 = time.monotonic()
        for _ in range(total // MiB):
            s.sendall(data)
        s.shutdown(socket.SHUT_WR)
        s.recv(1)  # EOF once dd has read everything and exited
        return total / (time.monotonic() - t0) / 1e6


def _raw_stream_from_guest(guest: Guest, total: int) -> float:
    """Guest -> host: ``dd`` in the control shell writes straight into the connection."""
    got = 0
    with socket.create_connection(("127.0.0.1", guest.control_port), timeout=60) as s:
        s.sendall(f"exec dd if=/dev/zero bs=1M count={total // MiB} 2>/dev/null\n".encode())
        first = s.recv(MiB)
        t0 = time.monotonic()
        got = len(first)
        while chunk := s.recv(MiB):
            got += len(chunk)
        dt = time.monotonic() - t0
    if got != total:
        raise RuntimeError(f"raw stream from the guest delivered {got} of {total} bytes")
    return (total - len(first)) / dt / 1e6


def measure(total_mib: int = 48, qds: tuple[int, ...] = (1, 8),
            guest: Guest | None = None) -> dict[str, Any]:
    """Run every case; boots a guest unless given a ready target-mode ``guest`` (whose
    namespace 1 is overwritten from offset 0 and must hold at least ``total_mib`` MiB)."""
    if guest is None:
        with Guest(size_mb=max(64, total_mib), mem_mb=256 + total_mib) as own:
            return measure(total_mib, qds, own)
    total = total_mib * MiB
    rows: list[dict[str, Any]] = []
    url = f"nvme+tcp://127.0.0.1:{guest.target_port}/{guest.nqn}/1"
    raw = {"write": _raw_stream(guest, total), "read": _raw_stream_from_guest(guest, total)}
    for qd in qds:
        for digests in (False, True):
            for write in (True, False):
                mbps = _engine_seq(url, write=write, qd=qd, total=total, digests=digests)
                rows.append({"path": "kvtool host -> guest kernel target",
                             "op": "write" if write else "read", "qd": qd,
                             "digests": digests, "mb_per_s": round(mbps, 1)})
    dev = guest.check(f"nvme connect -t tcp -a 127.0.0.1 -s 4420 -n {guest.nqn} >/dev/null &&"
                      " for i in $(seq 100); do for c in /sys/class/nvme/nvme*; do"
                      f" [ \"$(cat $c/subsysnqn)\" = {guest.nqn} ] && [ -b /dev/${{c##*/}}n1 ]"
                      " && echo /dev/${c##*/}n1 && exit 0; done; usleep 50000; done; exit 1")
    dev = dev.strip()
    try:
        for op, cmd in (("write", f"dd if=/dev/zero of={dev} bs=1M count={total_mib}"
                                  " oflag=direct"),
                        ("read", f"dd if={dev} of=/dev/null bs=1M count={total_mib}"
                                 " iflag=direct")):
            t0 = time.monotonic()
            guest.check(cmd, timeout=600)
            rows.append({"path": "guest kernel host -> guest kernel target (guest loopback)",
                         "op": op, "qd": 1, "digests": False,
                         "mb_per_s": round(total / (time.monotonic() - t0) / 1e6, 1)})
    finally:
        guest.exec(f"nvme disconnect -n {guest.nqn}")
    for row in rows:
        # writes move data host -> guest, reads guest -> host: compare with that direction;
        # the in-guest loopback rows do not cross slirp, so no ratio applies
        over_slirp = row["path"].startswith("kvtool host")
        row["ratio_to_raw_stream"] = (round(row["mb_per_s"] / raw[row["op"]], 2)
                                      if over_slirp else None)
    return {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "bytes": total,
            "io_bytes": MiB, "boot_seconds": round(guest.boot_seconds or 0, 2),
            "cpus": os.cpu_count(), "load_avg_1m": round(os.getloadavg()[0], 2),
            "raw_stream_host_to_guest_mb_per_s": round(raw["write"], 1),
            "raw_stream_guest_to_host_mb_per_s": round(raw["read"], 1), "rows": rows}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m emulator.qemu.measure", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=48, help="MiB moved per case (default 48)")
    ap.add_argument("--qd", default="1,8", help="queue depths (default 1,8)")
    ap.add_argument("--json", action="store_true", help="one JSON document on stdout")
    args = ap.parse_args(argv)
    result = measure(args.mib, tuple(int(q) for q in args.qd.split(",")))
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"{result['date']}, {result['cpus']} CPUs, load {result['load_avg_1m']}, "
          f"guest boot {result['boot_seconds']} s, {args.mib} MiB per case, 1 MiB I/Os")
    print("raw TCP stream over slirp hostfwd (the reference for the ratios): host -> guest "
          f"{result['raw_stream_host_to_guest_mb_per_s']} MB/s (writes), guest -> host "
          f"{result['raw_stream_guest_to_host_mb_per_s']} MB/s (reads)")
    for r in result["rows"]:
        ratio = "" if r["ratio_to_raw_stream"] is None else f"x{r['ratio_to_raw_stream']}"
        print(f"{r['mb_per_s']:8.1f} MB/s  {ratio:<6} {r['path']}: {r['op']}"
              f" qd{r['qd']}{' digests' if r['digests'] else ''}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
