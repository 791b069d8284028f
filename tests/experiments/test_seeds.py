"""``--seeds N``: every figure over N seeds of a generated workload, mean and 95 % bootstrap
interval, in the JSON, the CSV, the table and the plot's band."""

from __future__ import annotations

import csv
import dataclasses
from pathlib import Path

import numpy as np
import pytest

from kvtool.errors import UsageError
from kvtool.experiments import find_experiment, run_experiment
from kvtool.experiments.seeds import bootstrap_ci, round_band, summarize
from tests.conftest import run


def test_bootstrap_interval_holds_the_mean_and_is_deterministic() -> None:
    vals = [0.61, 0.64, 0.58, 0.70, 0.66]
    mean, lo, hi = bootstrap_ci(vals)
    assert mean == pytest.approx(sum(vals) / 5)
    assert min(vals) <= lo < mean < hi <= max(vals)
    assert bootstrap_ci(vals) == (mean, lo, hi)
    assert bootstrap_ci([3.0, 3.0, 3.0]) == (3.0, 3.0, 3.0)
    assert bootstrap_ci([7.0]) == (7.0, 7.0, 7.0)
    # more spread, wider interval
    _, lo2, hi2 = bootstrap_ci([v * 3 for v in vals])
    assert hi2 - lo2 > hi - lo


def test_bootstrap_interval_covers_the_true_mean_about_95_percent() -> None:
    rng = np.random.default_rng(1)
    trials, covered = 300, 0
    for _ in range(trials):
        sample = rng.normal(10.0, 2.0, size=30)
        _, lo, hi = bootstrap_ci(sample.tolist(), resamples=1000)
        covered += lo <= 10.0 <= hi
    # the percentile bootstrap undercovers a little at n = 30; 300 trials: ±2.5 % s.e.
    assert 0.86 <= covered / trials <= 0.99


def test_summary_needs_every_seed() -> None:
    s = summarize([1.0, None, 3.0], [0, 1, 2])
    assert s["mean"] is None and s["ci95"] is None and s["n"] == 2
    s = summarize([1.0, 2.0, 3.0], [0, 1, 2])
    assert s["mean"] == 2.0 and s["ci95"][0] < 2.0 < s["ci95"][1]


def test_round_band_over_seeds() -> None:
    docs = [{"rounds": [{"round": 1, "token_hit_ratio": 0.0},
                        {"round": 2, "token_hit_ratio": v}]} for v in (0.5, 0.7)]
    rounds, mean, lo, hi = round_band(docs)
    assert rounds == [1, 2] and mean == [0.0, pytest.approx(0.6)]
    assert lo[0] == hi[0] == 0.0 and lo[1] < 0.6 < hi[1]


def test_seeds_rows_are_each_seeds_figures(tmp_path: Path) -> None:
    exp = find_experiment("gp7000-hit-supply")
    base = exp.workload.get("seed", 0)
    doc = run_experiment(exp, out_dir=tmp_path, simulate=True, seeds=3)
    assert doc["seeds"]["seeds"] == [base, base + 1, base + 2]
    alone = [run_experiment(dataclasses.replace(exp, workload={**exp.workload, "seed": s}),
                            out_dir=None, simulate=True)["rows"] for s in doc["seeds"]["seeds"]]
    for j, row in enumerate(doc["rows"]):
        sd = row["seeds"]
        assert sd["values"] == [rows[j]["kvtool"] for rows in alone]
        if sd["mean"] is not None:
            assert row["kvtool"] == sd["mean"]
            assert sd["ci95"][0] <= sd["mean"] <= sd["ci95"][1]
    # the replay documents are the first seed's
    assert doc["configs"][0]["rounds"] == run_experiment(exp, out_dir=None, simulate=True
                                                          )["configs"][0]["rounds"]
    with open(tmp_path / f"{exp.name}.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["seeds"] for r in rows] == [str(r["seeds"]["n"]) for r in doc["rows"]]
    assert (tmp_path / f"{exp.name}.png").stat().st_size > 0
    assert not list(tmp_path.glob("trace-seed*.jsonl"))


def test_single_run_has_null_seeds() -> None:
    doc = run_experiment(find_experiment("gp7000-hit-supply"), out_dir=None, simulate=True)
    assert doc["seeds"] is None and all(r["seeds"] is None for r in doc["rows"])


def test_parallel_read_has_no_workload_to_reseed() -> None:
    with pytest.raises(UsageError, match="re-seed"):
        run_experiment(find_experiment("fx100-parallel-read"), out_dir=None, seeds=2)


def test_cli_table_says_mean_and_interval(tmp_path: Path) -> None:
    result = run("experiment", "run", "gp7000-hit-supply", "--simulate", "--seeds", "2",
                 "--out", str(tmp_path))
    assert result.exit_code == 0, result.stderr
    assert "mean [95 % CI] over seeds" in result.stdout
