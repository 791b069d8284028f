#!/usr/bin/env python3
"""Heavy I/O from the Linux kernel's NVMe/TCP host onto kvtool's target, checked by fio.

See emulator/qemu/kernel_fio.py for what runs: fio --verify=crc32c in the guest over the
kernel's nvme-tcp host on a kvtool target namespace (sequential and random, QD 1 and 32),
then the same bytes read by kvtool's host, the guest and from the backing file must agree.

Exit 0 when fio reports no verify error and all three views agree.

usage: python bench/nvme_kernel_fio.py [--gib 1] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from emulator.qemu.kernel_fio import ok, run


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=1.0, help="namespace size and data written")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvtool-fio-") as tmp:
        result = run(int(a.gib * 1024), Path(tmp))
    result["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    if a.json:
        print(json.dumps(result, indent=2))
    else:
        for j in result["jobs"]:  # type: ignore[attr-defined]
            print(f"{j['job']:10s} {j['rw']:9s} bs {j['bs']:5s} QD {j['iodepth']:2d}: "
                  f"{j['write_mib']} MiB written, {j['verified_mib']} MiB verified "
                  f"(crc32c), errors {j['errors']}, {j['write_mbps']} MB/s, {j['seconds']} s")
        print(f"sha256 guest (kernel host) {result['guest_sha256'][:16]}…, kvtool host "
              f"{result['kvtool_host_sha256'][:16]}…, backing file "  # type: ignore[index]
              f"{result['backing_sha256'][:16]}…: "  # type: ignore[index]
              f"{'agree' if result['views_agree'] else 'DIFFER'}; discard and zero-out read "
              f"back as zeros: {result['discard_and_zeroout_read_zeros']}")
    return 0 if ok(result) else 1


if __name__ == "__main__":
    sys.exit(main())
