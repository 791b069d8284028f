"""kvtool experiment fit (issue 38, item 3): the workload under which the model reproduces a
report's figures at once, each claim's residual, and whether any setting meets them all.

Runs on fx100-serving-cold-read, the smallest serving experiment (16 prompts, one load).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from kvtool.errors import UsageError
from kvtool.experiments import find_experiment
from kvtool.experiments.fit import CAP, fit, parse_vary, residual
from tests.conftest import run, run_json

COLD = "fx100-serving-cold-read"


@pytest.mark.parametrize(("text", "says"), [
    ("input_lengths", "KEY=LO:HI"),
    ("input_lengths=100", "KEY=LO:HI"),
    ("prompt_len=1:2", "not a workload key"),
    ("seed=1:9", "not a workload key"),
    ("input_lengths=9000:100", "LO <= HI"),
    ("input_lengths=a:b", "numbers"),
    ("reuse_share=0.5:2", "at most 1"),
])
def test_parse_vary_refuses(text: str, says: str) -> None:
    with pytest.raises(UsageError, match=says):
        parse_vary(text, find_experiment(COLD))


def test_parse_vary_types() -> None:
    exp = find_experiment(COLD)
    v = parse_vary("input_lengths=1000:64000", exp)
    assert v.integer and v.listed and v.log and v.at(0) == 1000 and v.at(1) == 64000
    s = parse_vary("mfu_prefill=0.2:0.6", exp)
    assert s.scalar and not s.integer and s.at(0.5) == pytest.approx(0.4)
    b = parse_vary("num_gpu_blocks=1000:4000", exp)
    assert b.engine and b.integer and b.at(1) == 4000
    with pytest.raises(UsageError, match="2 <= LO"):
        parse_vary("num_gpu_blocks=0:10", exp)
    with pytest.raises(UsageError, match="holds 5 values"):
        parse_vary("input_lengths=100:1000", find_experiment("wqs-serving-prefill"))
    with pytest.raises(UsageError, match="not a serving experiment"):
        parse_vary("mfu_prefill=0.2:0.6", find_experiment("gp7000-hit-supply"))


def test_residual_is_log_distance_to_number_or_band() -> None:
    assert residual({"kvtool": 200.0, "published": 100.0}, None) == pytest.approx(math.log(2))
    assert residual({"kvtool": 5.0, "published": None}, (3.5, 15.0)) == 0.0
    assert residual({"kvtool": 1.75, "published": None}, (3.5, 15.0)) == \
        pytest.approx(-math.log(2))
    assert residual({"kvtool": None, "published": 1.0}, None) is None


def test_fit_residuals_and_verdict_follow_the_runs() -> None:
    """Two settings of the unpublished prompt length: the best has the lower capped loss,
    its residuals are ln(kvtool / published), and a row is met within 1.25×."""
    exp = find_experiment(COLD)
    doc = fit(exp, [parse_vary("input_lengths=4096:16384", exp)], grid=2, max_evals=2)
    assert doc["schema"] == "kvtool.experiment-fit/1" and doc["evaluations"] == 2
    assert [p["at"]["input_lengths"] for p in doc["points"]] == [4096, 16384]
    assert doc["loss"] == min(p["loss"] for p in doc["points"])
    for row in doc["rows"]:
        r = row["residual"]
        if row["band"] is None:
            assert r == pytest.approx(math.log(row["kvtool"] / row["published"]))
        assert row["met"] == (abs(r) <= math.log(1.25) + 1e-12)
    losses = [min(r["residual"] ** 2, CAP) for r in doc["rows"]]
    assert doc["loss"] == pytest.approx(sum(losses) / len(losses))
    if all(r["met"] for r in doc["rows"]):
        assert doc["meets_all"] and doc["best"] in doc["meeting"]
    # the serial TTFT is the load of 16 prompts at 0.98 GB/s: longer prompts, longer TTFT
    serial = next(r for r in doc["rows"] if r["claim"] == "TTFT, serial reads (0.98 GB/s)")
    assert serial["best_alone"]["at"]["input_lengths"] == 16384


def test_contradictory_claims_cannot_all_hold(tmp_path: Path) -> None:
    """One TTFT published twice, 3× apart: each is met at some prompt length, never both
    at once, and the answer says so with numbers."""
    src = find_experiment(COLD).path
    assert src is not None
    body = src.read_text()
    twin = body.split("[[figure]]")[1].replace("published = 37970", "published = 12660") \
        .replace('published_text = "37.97 s"', 'published_text = "12.66 s"')
    bad = tmp_path / f"{COLD}.toml"
    bad.write_text(body + "\n[[figure]]" + twin)
    doc = run_json("experiment", "fit", str(bad), "--vary", "input_lengths=2048:16384",
                   "--grid", "5", "--max-evals", "5")
    assert doc["meets_all"] is False and doc["meeting"] == []
    twins = [r for r in doc["rows"] if r["claim"] == "TTFT, serial reads (0.98 GB/s)"]
    assert len(twins) == 2 and all(r["best_alone"]["met"] for r in twins)
    assert twins[0]["best_alone"]["at"] != twins[1]["best_alone"]["at"]
    assert "cannot all hold" in doc["verdict"] or "no setting" in doc["verdict"]


def test_fit_cli_human_and_errors(tmp_path: Path) -> None:
    out = tmp_path / "fit.json"
    result = run("experiment", "fit", COLD, "--vary", "input_lengths=8192:8192",
                 "--max-evals", "1", "--out", str(out))
    assert result.exit_code == 0, result.stderr
    assert "best fit" in result.stdout and "residual" in result.stdout
    assert max(len(line) for line in result.stdout.splitlines()) <= 80
    assert out.read_text().startswith("{")
    bad = run("experiment", "fit", COLD, "--vary", "nope=1:2")
    assert bad.exit_code == 2 and len(bad.stderr.strip().splitlines()) == 1
    none = run("experiment", "fit", "fx100-parallel-read", "--vary", "requests=1:2")
    assert none.exit_code == 2 and "no workload to fit" in none.stderr


def test_an_experiments_pool_replaces_every_engines() -> None:
    """``[serving] num_gpu_blocks``: every engine's KV pool, whatever the cluster file says."""
    from kvtool.serving.setup import build_setup

    path = "fixtures/clusters/gp7000.toml"
    assert {e.num_gpu_blocks for e in build_setup(path, block_tokens=256).setup.engines} \
        != {1234}
    built = build_setup(path, block_tokens=256, num_gpu_blocks=1234)
    assert [e.num_gpu_blocks for e in built.setup.engines] == [1234] * 4
