"""``replay --simulate --no-times`` pauses the cyclic garbage collector (kvtool.gcpause):
safe only while the replay makes no reference cycles, which these tests check with the
collector itself, for every policy and the options the pause covers."""

from __future__ import annotations

import gc
import json
from pathlib import Path
from typing import Any

import pytest

from kvtool.cache.names import POLICY_NAMES
from kvtool.gcpause import cyclic_gc_paused
from kvtool.replay.run import ReplaySettings, prepare
from kvtool.tiers.option import TierOption
from tests.conftest import run


@pytest.fixture
def trace(tmp_path: Path) -> Path:
    """Sessions of shared prefixes, with rounds: hits, evictions and promotions in every
    tier of the configurations below."""
    path = tmp_path / "t.jsonl"
    with open(path, "w") as f:
        for i in range(240):
            s = i % 6
            keys = [s * 1000 + j for j in range(i // 6 % 9 + 2)] + [10**6 + i]
            f.write(json.dumps({"timestamp": i * 500, "input_length": 512 * len(keys),
                                "output_length": 16, "hash_ids": keys, "session": s,
                                "round": i // 6 + 1}) + "\n")
    return path


def tiers(**caps: str) -> dict[str, TierOption]:
    return {name: TierOption.parse(cap, tier=name) for name, cap in caps.items()}


def cycles_made(settings: ReplaySettings) -> int:
    """Objects in reference cycles that reading, replaying and reporting left behind.

    The run is made once first, unmeasured: what a process does once — a lazy import, a
    library's first look at a type (msgspec's inspection leaves a closure cycle the first
    time, so the first test of a file run alone found 4 objects) — is not a replay's
    garbage; the pause is about what every run leaves."""
    prepare(settings).run()
    gc.collect()
    with cyclic_gc_paused():
        job = prepare(settings)
        doc = job.run()
        del job
        found = gc.collect()
    assert all(r["requests"] == 240 for r in doc.get("configs") or [doc])
    return found


GPU_POLICIES = [p for p in POLICY_NAMES if p != "oracle"]  # oracle: one tier of sessions


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_every_policy_replays_without_cycles(trace: Path, policy: str) -> None:
    three = policy in GPU_POLICIES and policy != "vllm"
    caps = (dict(gpu="6blk", dram="20blk", nvme="inf") if three else dict(dram="20blk"))
    s = ReplaySettings(str(trace), simulate=True, block_tokens=512, policy=policy,
                       tiers=tiers(**caps), times="none")
    assert cycles_made(s) == 0


def test_compare_write_back_iolog_and_request_csv_make_no_cycles(
        trace: Path, tmp_path: Path) -> None:
    times = "none"
    s = ReplaySettings(str(trace), simulate=True, block_tokens=512, block_bytes=4096,
                       tiers=tiers(gpu="6blk", dram="20blk", nvme="200blk"),
                       write_policy="write-back", times=times,
                       compares=("dram=40blk,nvme=inf,policy=radix",))
    assert cycles_made(s) == 0
    s = ReplaySettings(str(trace), simulate=True, block_tokens=512, block_bytes=4096,
                       tiers=tiers(dram="20blk", nvme="200blk"), times=times,
                       iolog=str(tmp_path / "io.log"), requests_csv=str(tmp_path / "r.csv"))
    assert cycles_made(s) == 0


@pytest.mark.parametrize("caps,extra", [
    (dict(dram="20blk"), {}),
    (dict(gpu="6blk", dram="20blk", nvme="inf"), {}),
    (dict(dram="20blk", nvme="200blk"), {"exact_steps": True}),
    (dict(dram="20blk"), {"concurrency": 4}),
    (dict(gpu="6blk", dram="20blk", nvme="200blk"),
     {"compares": ("dram=40blk,nvme=inf,policy=radix",)}),
])
def test_the_serving_models_times_make_no_cycles(trace: Path, caps: dict[str, str],
                                                 extra: dict[str, Any]) -> None:
    # the serving model's run breaks its own cycles once its times are read
    # (Simulation.release); the first run's lazy imports may make some, once
    s = ReplaySettings(str(trace), simulate=True, block_tokens=512, tiers=tiers(**caps),
                       **extra)
    cycles_made(s)
    assert cycles_made(s) == 0


@pytest.mark.parametrize("args,paused", [
    (["--no-times"], True),
    ([], True),                                   # the serving model's times
    (["--no-times", "--jobs", "2", "--compare", "dram=40blk"], False),  # fanned out
])
def test_the_cli_pauses_the_collector_only_where_nothing_cycles(
        trace: Path, monkeypatch: pytest.MonkeyPatch, args: list[str], paused: bool) -> None:
    import kvtool.cli.replay as cli_replay
    import kvtool.replay.job as run_mod

    pauses: list[bool] = []
    during: list[bool] = []  # the collector's state while the replay runs, in this process
    real_pause, real_replay = cli_replay.cyclic_gc_paused, run_mod.replay

    def pause() -> Any:
        pauses.append(True)
        return real_pause()

    def replay(*a: Any, **k: Any) -> Any:
        during.append(gc.isenabled())
        return real_replay(*a, **k)

    monkeypatch.setattr(cli_replay, "cyclic_gc_paused", pause)
    monkeypatch.setattr(run_mod, "replay", replay)
    assert gc.isenabled()
    res = run("--json", "replay", "--simulate", trace, "--dram", "20blk", *args)
    assert res.exit_code == 0, res.output
    assert pauses == ([True] if paused else [])
    assert all(enabled is not paused for enabled in during)
    assert gc.isenabled()  # restored
