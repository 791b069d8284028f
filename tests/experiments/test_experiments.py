"""Experiments as data: the fixture files load, run on the replayer, and match plan."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from kvtool.experiments import find_experiment, list_experiments, run_experiment
from kvtool.plan import Storage, Workload, plan
from kvtool.units import Capacity
from tests.conftest import run, run_json

ALL = ["fx100-parallel-read"]  # measured, not replayed
REPLAY_EXPERIMENTS = ["gp7000-cliff", "gp7000-working-set", "gp7000-50-rounds",
                      "gp7000-hit-supply", "gp7000-read-path", "wqs-random-prompts"]


def test_list_names_every_fixture() -> None:
    doc = run_json("experiment", "list")
    names = {e["name"] for e in doc["experiments"]}
    assert set(REPLAY_EXPERIMENTS + ALL) <= names
    for e in doc["experiments"]:
        assert e["source"] and e["claim"]


def test_cliff_collapse_round_equals_plan_within_one_round() -> None:
    """The cliff experiment's DRAM-only collapse round (replay) vs kvtool plan's, ±1."""
    exp = find_experiment("gp7000-cliff")
    doc = run_experiment(exp, out_dir=None, simulate=True)
    dram_only = next(c for c in doc["configs"] if c["label"] == "DRAM only")
    tiered = next(c for c in doc["configs"] if c["label"] == "DRAM/8 + NVMe")
    w = exp.workload
    predicted = plan(Workload(sessions=w["sessions"], rounds=w["rounds"],
                              input_tokens=w["input_tokens"], output_tokens=w["output_tokens"],
                              block_tokens=w["block_tokens"], answer_kv="next-round"),
                     Storage(None), dram=Capacity.parse("1090blk")).as_given.collapse_round
    # The plan is computed here independently of the experiment's own plan row.
    assert predicted is not None and dram_only["cliff_round"] is not None
    assert abs(dram_only["cliff_round"] - predicted) <= 1
    rows = {r["claim"]: r for r in doc["rows"]}
    assert rows["collapse round predicted by the capacity formula"]["kvtool"] == \
        pytest.approx(predicted)
    assert tiered["cliff_round"] is None
    ratios = [r["token_hit_ratio"] for r in tiered["rounds"]]
    assert all(b >= a for a, b in itertools.pairwise(ratios))  # monotonic
    # Store puts: DRAM-only explodes after the collapse, the tiered run stays flat.
    spread = {r["args"]["config"]: r["kvtool"] for r in doc["rows"] if r["metric"] == "put_spread"}
    assert spread["DRAM only"] > 10
    assert spread["DRAM/8 + NVMe"] == pytest.approx(1.0, abs=0.05)


def test_run_cli_writes_json_csv_png(tmp_path: Path) -> None:
    out = tmp_path / "out"
    doc = run_json("experiment", "run", "gp7000-read-path", "--simulate", "--out", str(out))
    assert doc["schema"] == "kvtool.experiment/1" and doc["mode"] == "simulate"
    for row in doc["rows"]:
        assert set(row) >= {"claim", "published", "kvtool", "unit", "measured"}
        assert row["measured"] is False  # nothing moves in --simulate
    assert [c["schema"] for c in doc["configs"]] == ["kvtool.replay/2"] * 2
    assert json.loads((out / "gp7000-read-path.json").read_text())["rows"] == doc["rows"]
    assert (out / "gp7000-read-path.png").read_bytes()[:4] == b"\x89PNG"
    csv_lines = (out / "gp7000-read-path.csv").read_text().splitlines()
    assert csv_lines[0].startswith("claim,published,kvtool,unit,measured")
    assert len(csv_lines) == 1 + len(doc["rows"])


def test_human_table(tmp_path: Path) -> None:
    result = run("experiment", "run", "gp7000-hit-supply", "--simulate", "--out", str(tmp_path))
    assert result.exit_code == 0, result.stderr
    assert "published vs kvtool" in result.stdout and "87–91" in result.stdout


def test_every_fixture_loads() -> None:
    assert {e.name for e in list_experiments()} >= set(REPLAY_EXPERIMENTS + ALL)


@pytest.mark.parametrize(("old", "new", "where"), [
    ('metric = "hit_ratio"', 'metric = "no-such"', "metric"),
    ('config = "NVMe tier"', 'config = "nope"', "args"),
    ('metric = "hit_ratio"', 'metric = "throughput_ratio"', "metric"),   # retired (issue 38)
])
def test_bad_experiment_file_is_one_line_exit_2(tmp_path: Path, old: str, new: str,
                                                where: str) -> None:
    src = find_experiment("gp7000-read-path").path
    assert src is not None
    body = src.read_text().replace(old, new, 1)
    bad = tmp_path / "gp7000-read-path.toml"
    bad.write_text(body)
    result = run("experiment", "run", str(bad), "--simulate", "--out", str(tmp_path / "o"))
    assert result.exit_code == 2
    assert str(bad) in result.stderr and f"figure[0].{where}" in result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1
    if new == 'metric = "throughput_ratio"':
        assert "serving model" in result.stderr and "serving_ratio" in result.stderr


@pytest.mark.parametrize("table", ["[time]\nconcurrency = 16\n",
                                   "[time]\nprefill_tokens_per_s = 800\n"])
def test_retired_time_table_names_the_replacement(tmp_path: Path, table: str) -> None:
    """One time model (issue 38): an experiment's [time] gets one line saying what replaces it."""
    src = find_experiment("gp7000-read-path").path
    assert src is not None
    bad = tmp_path / "gp7000-read-path.toml"
    bad.write_text(src.read_text().replace("[data]\n", table + "\n[data]\n", 1))
    result = run("experiment", "run", str(bad), "--simulate", "--out", str(tmp_path / "o"))
    assert result.exit_code == 2
    err = result.stderr
    assert err.count("\n") == 1 and "field 'time': the [time] table was retired" in err
    assert "cluster file" in err and "[serving]" in err


def test_unknown_experiment_exit_2() -> None:
    result = run("experiment", "run", "no-such-experiment", "--simulate")
    assert result.exit_code == 2 and "gp7000-cliff" in result.stderr


@pytest.mark.integration
@pytest.mark.slow
def test_cliff_in_data_mode_matches_simulate_and_plan(store_dir: Path) -> None:
    """Real bytes (DRAM pool, NVMe tier on an O_DIRECT file): every count equals the
    replayer's, the collapse is plan's ±1, and nothing wrong was served."""
    exp = find_experiment("gp7000-cliff")
    sim = run_experiment(exp, out_dir=None, simulate=True)
    data = run_experiment(exp, out_dir=None, scratch=store_dir)
    assert data["mode"] == "data" and data["block_bytes"] == 65536
    for s, d in zip(sim["configs"], data["configs"], strict=True):
        assert [r["hit_tokens"] for r in d["rounds"]] == [r["hit_tokens"] for r in s["rounds"]]
        assert d["put_blocks"] == s["put_blocks"] and d["cliff_round"] == s["cliff_round"]
        assert d["corrupt_blocks"] == 0 and d["lost_blocks"] == 0 and d["verified_blocks"] > 0
    rows = {r["claim"]: r for r in data["rows"]}
    plan_row = rows["collapse round predicted by the capacity formula"]
    replay_row = rows["collapse round, DRAM only (measured by the replay)"]
    assert replay_row["measured"] is True and abs(replay_row["kvtool"] - plan_row["kvtool"]) <= 1
    assert not list(store_dir.glob("nvme-*.img"))  # the experiment's store files are removed


def test_experiment_documents_have_one_shape(store_dir: Path, tmp_path: Path) -> None:
    """simulate, data and measure runs: the same top-level keys, each documented."""
    small = tmp_path / "fx100-parallel-read.toml"
    src = find_experiment("fx100-parallel-read").path
    assert src is not None
    small.write_text(src.read_text().replace("chunk_bytes = 4194304", "chunk_bytes = 65536")
                     .replace('targets = ["file", "loop", "nvme-tcp"]', 'targets = ["file"]'))
    from kvtool.experiments.spec import load_experiment

    docs = [run_experiment(find_experiment("gp7000-read-path"), out_dir=None, simulate=True),
            run_experiment(find_experiment("gp7000-read-path"), out_dir=None, scratch=store_dir),
            run_experiment(load_experiment(small), out_dir=None, scratch=store_dir)]
    assert [d["mode"] for d in docs] == ["simulate", "data", "measure"]
    assert len({frozenset(d) for d in docs}) == 1
    text = (Path(__file__).resolve().parents[2] / "docs" / "experiments.md").read_text()
    missing = [k for k in docs[0] if f"{k}" not in text]
    assert not missing
    list_doc = run_json("experiment", "list")
    assert set(list_doc) == {"schema", "experiments"}


def test_every_scale_names_what_still_differs() -> None:
    """Issue 38: each experiment's ``scale`` says what still differs from the report."""
    from kvtool.experiments import list_experiments

    for exp in list_experiments():
        assert "What still differs: " in exp.scale, exp.name


@pytest.mark.parametrize(("old", "new", "line", "field", "words"), [
    ("num_prompts = 16", 'num_prompts = "sixteen"', 12, "workload.num_prompts",
     "expected an integer"),
    ("input_lengths = [10000]", "input_lengths = [0]", 11, "workload.input_lengths[0]",
     "at least 1"),
    ("block_bytes = 65536", "block_bytes = 0", 22, "data.block_bytes", "at least 1"),
    ('tiers = "nvme=1024blk"', 'tiers = ""', 30, "config[1].tiers", "non-empty string"),
    ("seed = 1", "seeds = 1", 16, "workload.seeds", "unknown key 'seeds'"),
    ("published = 1.0", 'published = "1"', 34, "figure[0].published", "expected a number"),
])
def test_bad_field_names_file_line_and_field(tmp_path: Path, old: str, new: str, line: int,
                                             field: str, words: str) -> None:
    """The one config reader (issue 39): an experiment's errors read FILE:LINE: field 'F': …"""
    src = find_experiment("gp7000-read-path").path
    assert src is not None and old in src.read_text()
    bad = tmp_path / "gp7000-read-path.toml"
    bad.write_text(src.read_text().replace(old, new, 1))
    result = run("experiment", "run", str(bad), "--simulate", "--out", str(tmp_path / "o"))
    assert result.exit_code == 2
    (err,) = result.stderr.strip().splitlines()
    assert err.startswith(f"kvtool: error: {bad}:{line}: field '{field}': "), err
    assert words in err and "Traceback" not in result.stderr
