"""Data-mode replay against references measured in the same run (issue 10).

Three ratios, each against a reference taken in the same process, on the same bytes:

1. **DRAM tier copies** (``DramTier.prepare_store`` + ``prepare_load`` of DeepSeek-size
   blocks) vs ``numpy.copyto`` of the same bytes between two preallocated arrays;
   target ≥ 0.8×.
2. **NVMe-tier reads inside replay** (the ``gpu<-nvme`` link of a data-mode replay:
   bytes / seconds the link was busy, bounce copy into the GPU pool included) vs
   ``kvtool bench --pattern rand-read --path bounce`` at the same queue depth on the same
   target; target ≥ 0.8×.
3. **Replay overhead**: the replay's wall time not spent moving, checking or generating
   bytes, per block (``measured.overhead_us_per_block``); target ≤ 20 µs.

    python bench/replay_data.py [--target build/bench/replay-nvme.img] [--qd 16] [--repeat 3]

``--target`` is a file (created, O_DIRECT) or an ``nvme+tcp://`` URL (its namespace is
overwritten).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
TRACE = REPO / "fixtures" / "traces" / "multiturn-8x12.jsonl"
BLOCK = 1_002_240  # DeepSeek-V4-Flash FP8, 256 tokens (≡ 256 mod 512: the bounce path)


def dram_vs_memcpy(blocks: int, repeat: int) -> tuple[float, float, float]:
    """GB/s of the DRAM tier (store + load, both counted), of numpy.copyto, and the median
    of their ratios over interleaved trials (each trial runs both back to back, so load
    from other processes hits both alike)."""
    from kvtool.tiers.dram import DramTier

    tier = DramTier(blocks, BLOCK)
    src = np.random.default_rng(1).integers(0, 255, size=(blocks, BLOCK), dtype=np.uint8)
    dst = np.empty_like(src)
    keys = list(range(blocks))
    srcs = list(src)
    dsts = list(dst)
    ours, ref = [], []
    for _ in range(repeat):
        t = time.perf_counter()
        tier.complete_store(tier.prepare_store(keys, srcs))
        tier.complete_load(tier.prepare_load(keys, dsts))
        ours.append(2 * blocks * BLOCK / (time.perf_counter() - t) / 1e9)
        assert np.array_equal(dst[-1], src[-1])
        t = time.perf_counter()
        for a, b in zip(srcs, dsts, strict=True):  # the same 2 copies per block, no tier
            np.copyto(b, a)
        for a, b in zip(dsts, srcs, strict=True):
            np.copyto(b, a)
        ref.append(2 * blocks * BLOCK / (time.perf_counter() - t) / 1e9)
    ratio = statistics.median(o / r for o, r in zip(ours, ref, strict=True))
    return statistics.median(ours), statistics.median(ref), ratio


def kvtool(*args: str) -> dict:
    out = subprocess.run([sys.executable, "-m", "kvtool", "--json", *args], cwd=REPO,
                         check=True, capture_output=True, text=True).stdout
    return json.loads(out)


def replay_reads(target: str, qd: int) -> dict:
    place = target if target.startswith("nvme+tcp://") else f"700MiB@{target}"
    doc = kvtool("replay", str(TRACE), "--dram", "8blk", "--nvme", place,
                 "--model", "deepseek-v4-flash", "--dtype", "fp8", "--read-qd", str(qd))
    return doc


def bench_reads(target: str, qd: int) -> float:
    doc = kvtool("bench", target, "--model", "deepseek-v4-flash", "--dtype", "fp8", "--qd",
                 str(qd), "--pattern", "rand-read", "--path", "bounce", "--seconds", "2",
                 "--region", "600MiB", "--read-only")
    return float(doc["results"][0]["gb_per_s"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=str(REPO / "build" / "bench" / "replay-nvme.img"))
    ap.add_argument("--qd", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dram-blocks", type=int, default=256)
    a = ap.parse_args()
    if not a.target.startswith("nvme+tcp://"):
        Path(a.target).parent.mkdir(parents=True, exist_ok=True)
        if Path(a.target).exists():
            os.unlink(a.target)  # replay creates it (and formats it) at the size it needs
    print(f"load average {os.getloadavg()[0]:.2f}, {os.cpu_count()} CPUs")

    ours, ref, ratio = dram_vs_memcpy(a.dram_blocks, max(15, 5 * a.repeat))
    print(f"1. DRAM tier copies   {ours:6.2f} GB/s   numpy.copyto {ref:6.2f} GB/s   "
          f"ratio {ratio:.2f} (median of interleaved trials; target >= 0.8)")

    replays, benches, overheads = [], [], []
    for _ in range(a.repeat):
        doc = replay_reads(a.target, a.qd)  # replay first: it formats the store bench reads
        link = doc["measured"]["links"]["gpu<-nvme"]
        replays.append(link["gbps"])
        overheads.append(doc["measured"]["overhead_us_per_block"])
        benches.append(bench_reads(a.target, a.qd))
    r, b = statistics.median(replays), statistics.median(benches)
    print(f"2. NVMe reads in replay {r:6.2f} GB/s ({link['blocks']} blocks, QD {a.qd})   "
          f"kvtool bench rand-read QD {a.qd} {b:6.2f} GB/s   ratio {r / b:.2f} (target >= 0.8)")
    o = statistics.median(overheads)
    print(f"3. replay overhead    {o:6.1f} us/block ({doc['measured']['blocks']} blocks, "
          f"wall {doc['measured']['wall_s']:.2f} s)   (target <= 20)")
    print(f"   runs: replay {[round(x, 2) for x in replays]} bench "
          f"{[round(x, 2) for x in benches]} overhead {[round(x, 1) for x in overheads]}")


if __name__ == "__main__":
    main()
