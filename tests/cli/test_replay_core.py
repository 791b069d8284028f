"""One replay core (issue 39, item 1): a timed replay is one loop in which the serving
model's engine asks the tier hierarchy to serve each request, in serve order, and times
what it decided (kvtool.serving.serveorder). Its hits, puts and evictions must be those
of the ``--no-times`` replay — the replayer serving the requests one after the other, as
every replay counted them before — on every fixture trace, the Mooncake traces and in
data mode; its times must be the same whichever way the engine advances time."""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import pytest

from kvtool.replay.run import ReplaySettings, prepare
from kvtool.tiers.option import TierOption

REPO = Path(__file__).resolve().parents[2]
FIXTURES = sorted(p for p in (REPO / "fixtures" / "traces").iterdir()
                  if p.suffix in (".jsonl", ".csv"))
_TIMES = ("ttft_p50_s", "ttft_p99_s", "wall_s", "requests_per_s")


def _counts(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """Each configuration's report without its times (and the measured seconds of data
    mode, which no two runs share)."""
    out = []
    for r in doc.get("configs", [doc]):
        r = copy.deepcopy(r)
        for d in [r, *r["rounds"]]:
            for key in _TIMES:
                d.pop(key, None)
        for key in ("time_model", "measured", "media", "setup", "problems"):
            r.pop(key, None)
        out.append(r)
    return out


def _run(trace: Path | str, **kw: Any) -> dict[str, Any]:
    return prepare(ReplaySettings(str(trace), **kw)).run()


def _same_counts(trace: Path | str, **kw: Any) -> dict[str, Any]:
    timed = _run(trace, **kw)
    untimed = _run(trace, times="none", **kw)
    for t, u in zip(timed.get("configs", [timed]), untimed.get("configs", [untimed]),
                    strict=True):
        assert t["time_model"]["hits"].startswith("the tier hierarchy's")
        assert u["time_model"]["kind"] is None
        assert t["ttft_p50_s"] is not None and t["ttft_p50_s"] > 0
    assert _counts(timed) == _counts(untimed)
    return timed


@pytest.mark.parametrize("trace", FIXTURES, ids=lambda p: p.name)
def test_a_timed_replay_counts_what_the_untimed_one_counts(trace: Path) -> None:
    _same_counts(trace, simulate=True)
    _same_counts(trace, simulate=True, write_policy="write-back",
                 tiers={"gpu": TierOption.parse(tier="gpu", text="40blk"),
                        "dram": TierOption.parse(tier="dram", text="60blk"),
                        "nvme": TierOption.parse(tier="nvme", text="300blk")})


def test_several_configurations_and_a_fanout_count_alike() -> None:
    from kvtool.fanout import Fanout

    trace = REPO / "fixtures" / "traces" / "multiturn-8x12.jsonl"
    kw: dict[str, Any] = {"simulate": True, "model": "llama-3-8b",
                          "compares": ("dram=64MiB", "dram=512MiB,nvme=1GiB")}
    serial = _same_counts(trace, **kw)
    fanned = prepare(ReplaySettings(str(trace), **kw)).run(fanout=Fanout("processes", 2))
    assert _counts(fanned) == _counts(serial)
    for a, b in zip(fanned["configs"], serial["configs"], strict=True):
        assert a["ttft_p50_s"] == b["ttft_p50_s"] and a["wall_s"] == b["wall_s"]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["conversation_trace.jsonl", "synthetic_trace.jsonl"])
def test_mooncake_traces_count_alike(mooncake_traces: Path, name: str) -> None:
    kw: dict[str, Any] = {"simulate": True, "fmt": "mooncake", "block_tokens": 512,
                          "tiers": {"dram": TierOption.parse(tier="dram", text="5859blk")}}
    _same_counts(mooncake_traces / name, **kw)
    kw["tiers"] = {"gpu": TierOption.parse(tier="gpu", text="2000blk"),
                   "dram": TierOption.parse(tier="dram", text="4000blk"),
                   "nvme": TierOption.parse(tier="nvme", text="20000blk")}
    _same_counts(mooncake_traces / name, **kw)


def test_the_engine_times_the_same_stepping_or_jumping() -> None:
    trace = REPO / "fixtures" / "traces" / "multiturn-8x12.jsonl"
    for kw in ({}, {"concurrency": 4}):
        jumped = _run(trace, simulate=True, **kw)
        stepped = _run(trace, simulate=True, exact_steps=True, **kw)
        for a, b in zip([jumped, *jumped["rounds"]], [stepped, *stepped["rounds"]], strict=True):
            for key in _TIMES:
                assert a[key] == b[key] or (math.isnan(a[key]) and math.isnan(b[key]))
        assert jumped["time_model"]["serving"] == stepped["time_model"]["serving"]


def test_the_times_follow_the_decisions() -> None:
    """More hits, lower TTFT: a DRAM tier that holds the conversation's prefixes against
    none (the engine loads what the hierarchy found, and computes the rest)."""
    trace = REPO / "fixtures" / "traces" / "multiturn-8x12.jsonl"
    gpu = {"gpu": TierOption.parse(tier="gpu", text="20blk")}
    small = _run(trace, simulate=True, tiers=gpu)
    big = _run(trace, simulate=True,
               tiers={**gpu, "dram": TierOption.parse(tier="dram", text="4000blk")})
    assert big["token_hit_ratio"] > small["token_hit_ratio"]
    assert big["ttft_p50_s"] < small["ttft_p50_s"]
    serving = big["time_model"]["serving"]
    assert serving["completed"] == big["requests"] and serving["failed"] == 0


def test_data_mode_counts_and_moves_what_it_counts(tmp_path: Path) -> None:
    trace = REPO / "fixtures" / "traces" / "multiturn-4x6.tokens.jsonl"
    kw: dict[str, Any] = {"block_bytes": 65536, "block_tokens": 64,
                          "tiers": {"gpu": TierOption.parse(tier="gpu", text="256KiB"),
                                    "dram": TierOption.parse(tier="dram", text="1MiB"),
                                    "nvme": TierOption.parse(
                                        tier="nvme", text=f"64MiB@{tmp_path / 'kv.img'}")}}
    timed = _same_counts(trace, **kw)
    assert timed["mode"] == "data"
    assert timed["verified_blocks"] > 0 and timed["corrupt_blocks"] == 0
    assert timed["lost_blocks"] == 0
