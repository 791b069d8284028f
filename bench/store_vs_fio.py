#!/usr/bin/env python3
"""kvtool load/verify throughput against fio on the same target, in the same run.

For each object size (the DeepSeek-V4-Flash FP8 block, 1,002,240 B, which takes the
bounce path, and an aligned object of the same padded size) and each repetition:

* fio ``rw=write`` then ``rw=read``: ``direct=1``, ``ioengine=libaio``, ``bs`` = padded
  object size, the same ``iodepth`` as kvtool's ``--qd``, over exactly the extent kvtool's
  data area uses (``offset`` = data offset, ``size`` = count × slot), ``end_fsync=1``;
* ``kvtool load`` (a freshly wiped store: every object written, checksummed, committed
  durably) and ``kvtool verify`` (every object read, checksum and content checked), run
  through the same library calls as the CLI.

Throughput is compared on device bytes (padded slots), i.e. the same I/O stream fio
issues. Printed ratios: kvtool/fio for load and verify (target ≥ 0.90), and the bounce
object against the aligned object of the same padded size (target: cost ≤ 5%): medians
of ratios paired within each repetition, with their range; odd repetitions run kvtool
before fio, so drift of a shared disk hits both.

Usage: .venv/bin/python bench/store_vs_fio.py [--target PATH] [--size 3GiB] [--qd 8]
       [--count 1000] [--reps 3] [--loop-sector 512] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from kvtool.align import padded_size
from kvtool.store.layout import plan_layout
from kvtool.store.load import LoadSpec, load
from kvtool.store.verify import verify
from kvtool.units import parse_size

DSV4_FP8_BLOCK = 1_002_240


def fio(target: str, rw: str, *, bs: int, qd: int, offset: int, size: int) -> float:
    """fio bandwidth in bytes/s for one job."""
    cmd = ["fio", "--name=ref", f"--filename={target}", f"--rw={rw}", f"--bs={bs}",
           f"--iodepth={qd}", "--direct=1", "--ioengine=libaio", f"--offset={offset}",
           f"--size={size}", "--end_fsync=1" if rw == "write" else "--end_fsync=0",
           "--output-format=json", "--allow_file_create=0"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    job = json.loads(out[out.index("{"):])["jobs"][0]
    side = job["write" if rw == "write" else "read"]
    return float(side["bw_bytes"])


def wipe_head(target: str) -> None:
    """Zero the first MiB (the superblock) so the next load formats a fresh store."""
    fd = os.open(target, os.O_WRONLY)
    try:
        os.pwrite(fd, bytes(1 << 20), 0)
        os.fsync(fd)
    finally:
        os.close(fd)


def kvtool_load(target: str, object_bytes: int, count: int, qd: int) -> dict[str, Any]:
    wipe_head(target)
    return load(target, LoadSpec(object_bytes=object_bytes, count=count, qd=qd, seed=1))


def _dev_bytes(target: str) -> int:
    if target.startswith("/dev/"):
        return int(subprocess.run(["blockdev", "--getsize64", target], check=True,
                                  capture_output=True, text=True).stdout)
    return os.stat(target).st_size


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Repetitions of (fio write, kvtool load, fio read, kvtool verify) per object size.

    Within a repetition each kvtool run is paired with the fio run next to it in time; odd
    repetitions run kvtool first, so slow drift of a shared disk does not favour either.
    Ratios are medians of the paired ratios.
    """
    target = args.target
    lba = args.lba
    sizes = {"bounce": DSV4_FP8_BLOCK, "aligned": padded_size(DSV4_FP8_BLOCK, lba)}
    keys = ("fio_write", "load", "fio_read", "verify")
    rows: dict[str, dict[str, list[float]]] = {k: {m: [] for m in keys} for k in sizes}
    pairs: dict[str, list[float]] = {}
    for rep in range(args.reps):
        labels = list(sizes) if rep % 2 == 0 else list(reversed(sizes))
        for label in labels:
            obj = sizes[label]
            slot = padded_size(obj, lba)
            _, _, data_offset = plan_layout(_dev_bytes(target), obj, lba)
            extent = args.count * slot
            r = rows[label]

            def fio_w(r: dict[str, list[float]] = r, slot: int = slot, off: int = data_offset,
                      ext: int = extent) -> None:
                r["fio_write"].append(fio(target, "write", bs=slot, qd=args.qd, offset=off,
                                          size=ext))

            def fio_r(r: dict[str, list[float]] = r, slot: int = slot, off: int = data_offset,
                      ext: int = extent) -> None:
                r["fio_read"].append(fio(target, "read", bs=slot, qd=args.qd, offset=off,
                                         size=ext))

            def kv_load(r: dict[str, list[float]] = r, obj: int = obj) -> None:
                res = kvtool_load(target, obj, args.count, args.qd)
                r["load"].append(res["padded_bytes_written"] / res["seconds"])

            def kv_verify(r: dict[str, list[float]] = r, slot: int = slot) -> None:
                v = verify(target, qd=args.qd)
                assert v["ok"], v["bad"][:3]
                r["verify"].append(v["objects_checked"] * slot / v["seconds"])

            if rep % 2 == 0:
                fio_w(), kv_load(), fio_r(), kv_verify()
            else:
                kv_load(), kv_verify(), fio_w(), fio_r()
            pairs.setdefault(f"load/fio_write [{label}]", []).append(
                r["load"][-1] / r["fio_write"][-1])
            pairs.setdefault(f"verify/fio_read [{label}]", []).append(
                r["verify"][-1] / r["fio_read"][-1])
            print(f"rep {rep} {label:8s} fio write {r['fio_write'][-1] / 1e9:.3f} GB/s, "
                  f"load {r['load'][-1] / 1e9:.3f}; fio read {r['fio_read'][-1] / 1e9:.3f}, "
                  f"verify {r['verify'][-1] / 1e9:.3f}", file=sys.stderr, flush=True)
        for what in ("load", "verify"):
            pairs.setdefault(f"bounce/aligned {what}", []).append(
                rows["bounce"][what][-1] / rows["aligned"][what][-1])
    med = {label: {k: statistics.median(v) for k, v in r.items()} for label, r in rows.items()}
    return {"target": target, "qd": args.qd, "count": args.count, "reps": args.reps,
            "lba": lba, "object_bytes": sizes, "median_bytes_per_s": med,
            "ratios": {k: statistics.median(v) for k, v in pairs.items()},
            "ratio_ranges": {k: [min(v), max(v)] for k, v in pairs.items()}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", help="file or block device (default: a new file under "
                    "/var/tmp/kvtool-bench)")
    ap.add_argument("--size", default="3GiB", help="size of the file to create")
    ap.add_argument("--qd", type=int, default=8)
    ap.add_argument("--count", type=int, default=1000)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--loop-sector", type=int, choices=(512, 4096),
                    help="run on a loop device with this sector size over the file")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if shutil.which("fio") is None:
        print("fio is not installed (apt-get install fio)", file=sys.stderr)
        return 2
    made: Path | None = None
    loop: str | None = None
    if args.target is None:
        d = Path("/var/tmp/kvtool-bench")
        d.mkdir(parents=True, exist_ok=True)
        made = d / "bench.img"
        size = parse_size(args.size)
        subprocess.run(["fio", "--name=prefill", f"--filename={made}", "--rw=write",
                        "--bs=4M", f"--size={size}", "--direct=1", "--ioengine=libaio",
                        "--iodepth=8", "--output-format=terse"], check=True,
                       capture_output=True)
        args.target = str(made)
    try:
        if args.loop_sector:
            loop = subprocess.run(["losetup", "-f", "--show", "--direct-io=on",
                                   f"--sector-size={args.loop_sector}", args.target],
                                  check=True, capture_output=True, text=True).stdout.strip()
            args.target = loop
        args.lba = args.loop_sector or 512
        if not args.target.startswith("/dev/"):
            from kvtool.align import probe_device

            args.lba = probe_device(args.target).dio_offset_align
        t0 = time.time()
        result = run(args)
        result["wall_s"] = time.time() - t0
        result["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    finally:
        if loop:
            subprocess.run(["losetup", "-d", loop], check=False)
        if made is not None:
            made.unlink(missing_ok=True)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for label, m in result["median_bytes_per_s"].items():
            print(f"{label:8s} " + ", ".join(f"{k} {v / 1e9:.3f} GB/s" for k, v in m.items()))
        for k, v in result["ratios"].items():
            lo, hi = result["ratio_ranges"][k]
            print(f"{k:28s} {v:.3f}  (range {lo:.3f} … {hi:.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
