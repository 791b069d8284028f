"""Memory per cached block of a kvtool cache tier, at 10 million blocks.

Target (issue 23; issue 3 asked 150): ≤ 100 bytes per cached block at 10 million blocks. The tier is fed
requests of 32 chained random 64-bit keys (like kvtool.trace.hashing's) until it holds
``--blocks`` blocks; the resident-set growth (VmRSS from /proc/self/status) divided by the
blocks held is the figure. It includes the key ints themselves, which only the cache
keeps alive. The reference is the 100-byte target; the ratio printed is figure / 100.

    python bench/replay_memory.py [--blocks 10000000] [--policy lru]
"""

from __future__ import annotations

import argparse
import gc
import random
import time

from kvtool.cache import Tier, make_policy
from kvtool.cache.hierarchy import TierHierarchy
from kvtool.cache.stats import RoundStats

TARGET = 100


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--blocks", type=int, default=10_000_000)
    ap.add_argument("--policy", default="lru")
    args = ap.parse_args()
    rng = random.Random(1)
    cache = TierHierarchy([Tier("dram", args.blocks, make_policy(args.policy))])
    stats = RoundStats(1)
    gc.collect()
    before = rss_bytes()
    t = time.perf_counter()
    session = 0
    while len(cache.tiers[0]) < args.blocks:
        keys = [rng.getrandbits(64) for _ in range(32)]
        cache.serve(keys, 32 * 256, 256, session, stats)
        session += 1
    gc.collect()
    grown = rss_bytes() - before
    held = len(cache.tiers[0])
    per = grown / held
    print(f"policy {args.policy}: {held:,} blocks cached, RSS +{grown / 2**20:,.0f} MiB "
          f"in {time.perf_counter() - t:.1f} s")
    print(f"bytes per cached block: {per:.1f}  (target ≤ {TARGET}: ratio {per / TARGET:.2f}, "
          f"{'ok' if per <= TARGET else 'OVER'})")


if __name__ == "__main__":
    main()
