"""Store puts vs promotions (docs/definitions.md), counted apart, on a hand-checked trace."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvtool.cache import CacheConfig, TierSpec, replay
from kvtool.experiments import find_experiment, run_experiment
from kvtool.trace import read_trace
from kvtool.units import Capacity

# Blocks of 4 tokens; DRAM holds 2 blocks (head-first LRU), NVMe everything; write-through.
#
# round 1: [1,2,3] all miss → puts dram 3, nvme 3; DRAM evicts block 1 → holds {2,3}.
# round 2: [1,2,3,4]: 1 hits in NVMe, 2 and 3 in DRAM, 4 misses →
#          DRAM: promotion 1 (block 1), put 1 (block 4); NVMe: put 1 (block 4);
#          DRAM evicts 1 and 2 (oldest first) → holds {3,4}.
# round 3: [1,2,3,4,5]: 1, 2 hit in NVMe, 3, 4 in DRAM, 5 misses →
#          DRAM: promotions 2 (blocks 1, 2), put 1 (block 5); NVMe: put 1.
WANT = {1: ({"dram": 3, "nvme": 3}, {"dram": 0, "nvme": 0}),
        2: ({"dram": 1, "nvme": 1}, {"dram": 1, "nvme": 0}),
        3: ({"dram": 1, "nvme": 1}, {"dram": 2, "nvme": 0})}


def _trace(tmp_path: Path) -> Path:
    trace = tmp_path / "t.jsonl"
    lines = [{"session": 1, "round": r, "input_length": 4 * n, "output_length": 1,
              "block_tokens": 4, "hash_ids": list(range(1, n + 1))}
             for r, n in ((1, 3), (2, 4), (3, 5))]
    trace.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return trace


def _check(res: dict[str, Any], block_bytes: int) -> None:
    rounds = {r["round"]: r for r in res["rounds"]}
    for r, (puts, promoted) in WANT.items():
        assert rounds[r]["put_blocks"] == puts, r
        assert rounds[r]["promoted_blocks"] == promoted, r
        assert rounds[r]["put_bytes"] == {t: block_bytes * n for t, n in puts.items()}
    assert rounds[2]["hit_tokens"]["nvme"] == 4 and rounds[2]["hit_tokens"]["dram"] == 8
    assert rounds[3]["hit_tokens"]["nvme"] == 8 and rounds[3]["recompute_tokens"] == 4
    assert res["put_blocks"] == {"dram": 5, "nvme": 5}
    assert res["promoted_blocks"] == {"dram": 3, "nvme": 0}


def test_puts_and_promotions_hand_checked(tmp_path: Path) -> None:
    cfg = CacheConfig([TierSpec("dram", Capacity.parse("2blk")),
                       TierSpec("nvme", Capacity.parse("inf"))])
    [res] = replay(read_trace(_trace(tmp_path)), [cfg], block_tokens=4, block_bytes=100)
    _check(res, 100)


@pytest.mark.integration
def test_puts_and_promotions_hand_checked_in_data_mode(tmp_path: Path, store_dir: Path) -> None:
    """The same trace with real bytes: a DRAM pool and an NVMe tier on an O_DIRECT file."""
    from kvtool.replay.run import ReplaySettings, prepare

    nvme = store_dir / "nvme.img"
    job = prepare(ReplaySettings(str(_trace(tmp_path)),
                                 compares=[f"dram=2blk,nvme=64blk@{nvme}"], block_bytes=4096))
    res = job.run()
    assert res["mode"] == "data" and res["corrupt_blocks"] == 0 and res["lost_blocks"] == 0
    assert res["verified_blocks"] >= 3 + 4  # every hit block arriving was checked
    _check(res, 4096)


def test_cliff_experiment_counts_store_puts_not_promotions() -> None:
    """The published shape: DRAM-only puts explode after the collapse; the tiered run's
    puts stay flat while its DRAM tier takes promotions from NVMe, counted apart."""
    doc = run_experiment(find_experiment("gp7000-cliff"), out_dir=None, simulate=True)
    by = {c["label"]: c for c in doc["configs"]}
    late = [r for r in by["DRAM/8 + NVMe"]["rounds"] if r["round"] >= 10]
    assert all(r["put_blocks"]["dram"] == r["put_blocks"]["nvme"] for r in late)
    assert sum(r["promoted_blocks"]["dram"] for r in late) > 0
    dram_only = by["DRAM only"]["rounds"]
    assert dram_only[-1]["put_blocks"]["dram"] > 10 * dram_only[3]["put_blocks"]["dram"]
    assert max(r["put_blocks"]["nvme"] for r in late) <= 1.05 * min(
        r["put_blocks"]["nvme"] for r in late)
