"""Overload said out loud (issue 38, item 7): when requests arrive faster than the modelled
engines finish them, the report says so in one line, and the JSON has the same."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtool.serving.load import Load
from kvtool.serving.overload import TRY, TRY_REPLAY, assess, line
from kvtool.serving.setup import build_setup
from kvtool.serving.sim import Simulation
from kvtool.trace import read_trace
from tests.conftest import run, run_json

ENGINE = '[[engine]]\ngpu = "a100-sxm"\nmodel = "llama-3-8b"\ntp = 1\n'


def timed_trace(path: Path, n: int, gap_ms: float, tokens: int = 4096) -> Path:
    """``n`` distinct prompts, one every ``gap_ms``, 64 output tokens each."""
    with open(path, "w") as f:
        for i in range(n):
            keys = [i * 100 + j for j in range(-(-tokens // 512))]
            f.write(json.dumps({"timestamp": i * gap_ms, "input_length": tokens,
                                "output_length": 64, "hash_ids": keys}) + "\n")
    return path


def test_assess_by_hand() -> None:
    # 4 requests a second for 10 s on an engine that finished 10 in its 10 busy seconds
    arrivals = [i / 4 for i in range(41)]
    waits = [a + i * 0.5 for i, a in enumerate(arrivals)]          # the queue grows
    got = assess(arrivals, waits, [41], [41 / 1.0], "timestamps")
    assert got["overloaded"] and got["arrival_rate"] == pytest.approx(4.0)
    assert got["capacity_rps"] == pytest.approx(1.0) and got["ratio"] == pytest.approx(4.0)
    assert got["try"] == list(TRY) and got["basis"] == "simulated"
    said = line(got)
    assert said is not None and said.startswith("overloaded: requests arrive at 4/s")
    assert "--concurrency" in said and "\n" not in said
    # the same arrivals, served as fast as they come: no queue, no word
    fine = assess(arrivals, arrivals, [41], [5.0], "timestamps")
    assert not fine["overloaded"] and fine["try"] == [] and line(fine) is None
    # a closed loop cannot overload; all at once is a burst, not a rate
    assert not assess(arrivals, waits, [41], [41.0], "concurrency")["overloaded"]
    assert assess([0.0] * 41, waits, [41], [41.0], "request-rate")["arrival_rate"] is None


@pytest.mark.parametrize(("gap_ms", "overloaded"), [(20.0, True), (4000.0, False)])
def test_the_simulation_reports_overload(tmp_path: Path, gap_ms: float,
                                         overloaded: bool) -> None:
    (tmp_path / "c.toml").write_text(ENGINE)
    reader = read_trace(str(timed_trace(tmp_path / "t.jsonl", 120, gap_ms)))
    built = build_setup(str(tmp_path / "c.toml"), block_tokens=reader.block_tokens)
    sim = Simulation(list(reader), built.setup, Load("timestamps", 1.0),
                     block_tokens=built.block_tokens, router=built.make_router(),
                     trace_block_tokens=reader.block_tokens)
    doc = sim.run()
    o = doc["overload"]
    assert o["overloaded"] is overloaded
    assert o["arrival_rate"] == pytest.approx(1000 / gap_ms)
    if overloaded:
        assert o["ratio"] > 1.05 and o["queue_last_s"] > o["queue_first_s"] + 1
        # the capacity is what the engine achieved while busy, under the arrival rate
        assert o["capacity_rps"] < o["arrival_rate"]
    else:
        assert o["capacity_rps"] > o["arrival_rate"]


def test_the_replay_says_it_in_one_line_and_in_json(tmp_path: Path) -> None:
    trace = timed_trace(tmp_path / "t.jsonl", 120, 20.0)
    args = ["replay", str(trace), "--simulate", "--format", "mooncake", "--block-tokens",
            "512", "--dram", "500blk", "--engine-gpu", "a100-sxm"]
    result = run(*args)
    assert result.exit_code == 0, result.stderr
    text = " ".join(result.stdout.split())
    assert "overloaded: requests arrive at 50/s" in text and "--engine-gpu GPU" in text
    o = run_json(*args)["time_model"]["overload"]
    assert o["overloaded"] and o["try"] == list(TRY_REPLAY)
    assert o["arrival_rate"] == pytest.approx(50.0) and o["capacity_rps"] < 50
    # --cluster: the same, with the cluster's list of what to try
    (tmp_path / "c.toml").write_text(ENGINE)
    doc = run_json("replay", str(trace), "--simulate", "--format", "mooncake",
                   "--block-tokens", "512", "--cluster", str(tmp_path / "c.toml"))
    assert doc["runs"][0]["overload"]["overloaded"] and doc["runs"][0]["overload"]["try"] == list(TRY)
    calm = run("replay", str(trace), "--simulate", "--format", "mooncake", "--block-tokens",
               "512", "--cluster", str(tmp_path / "c.toml"), "--concurrency", "4")
    assert calm.exit_code == 0 and "overloaded" not in calm.stdout
