"""``kvtool experiment run cpu-engine-vs-model``: the serving model fitted to one measured
run of vLLM's CPU build (kvtool's tiny Llama), predicting the others.

The engine test runs the experiment as a user types it (about 1.5 minutes on the shared
2-core machine: four fresh engines); the others check the file, its errors and the model's
side without an engine.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvtool.experiments import find_experiment
from kvtool.experiments.engine_model import (
    DEFAULT_METRICS,
    check_workload,
    compare,
    model_run,
    parse_run,
    rows_of,
    write_traces,
)
from kvtool.serving.load import Load
from tests.conftest import REPO, run

NAME = "cpu-engine-vs-model"
CLUSTER = REPO / "fixtures" / "clusters" / "cpu-tiny-llama.toml"


def test_the_fixture_loads_and_names_its_runs() -> None:
    exp = find_experiment(NAME)
    assert exp.kind == "engine-vs-model" and not exp.configs and not exp.figures
    w = exp.workload
    assert check_workload(w) is None
    runs = [parse_run(r) for r in w["runs"]]
    assert {r.trace for r in runs} == {"random", "multi-turn"}
    assert w["fit"] in w["runs"] and len(runs) >= 3
    assert "What still differs: " in exp.scale


def test_list_shows_it() -> None:
    result = run("--json", "experiment", "list")
    assert result.exit_code == 0, result.stderr
    kinds = {e["name"]: e["kind"] for e in json.loads(result.stdout)["experiments"]}
    assert kinds[NAME] == "engine-vs-model"


@pytest.mark.parametrize(("old", "new", "field"), [
    ('fit = "random@concurrency=1"', 'fit = "random@concurrency=2"', "workload.fit"),
    ('"random@concurrency=4"', '"chat@concurrency=4"', "workload.runs"),
    ('fit_scalars = ["mfu_prefill", "c0_s"]', 'fit_scalars = ["mfu"]', "workload.fit_scalars"),
    ('fit_metrics = ["median_ttft_ms", "median_tpot_ms"]', 'fit_metrics = []',
     "workload.fit_metrics"),
    ('block_tokens = 32 ', 'block_tokens = 48 ', "workload.block_tokens"),
    ('kv_cache = "4MiB"', 'kv_cache = "128blk"', "workload.kv_cache"),
    ('nvme = "64MiB"\n', 'nvme = "64MiB"\n\n[[figure]]\nclaim = "x"\n', "figure"),
])
def test_bad_file_is_one_line_exit_2(tmp_path: Path, old: str, new: str, field: str) -> None:
    src = find_experiment(NAME).path
    assert src is not None
    body = src.read_text()
    assert old in body
    bad = tmp_path / f"{NAME}.toml"
    bad.write_text(body.replace(old, new, 1))
    result = run("experiment", "run", str(bad), "--out", str(tmp_path / "o"))
    assert result.exit_code == 2
    err = result.stderr.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert str(bad) in err and f"'{field}'" in err, err


def test_seeds_do_not_apply() -> None:
    result = run("experiment", "run", NAME, "--seeds", "3")
    assert result.exit_code == 2 and "--seeds" in result.stderr


def test_without_an_engine_it_says_how_to_get_one(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from kvtool.integrations.engine_replay import engine_available

    if engine_available() is None:
        pytest.skip("this Python imports vLLM: the experiment runs the engine in it")
    monkeypatch.setenv("KVTOOL_ENGINE_VENV", str(tmp_path / "no-venv"))
    result = run("-q", "experiment", "run", NAME, "--out", str(tmp_path / "o"))
    assert result.exit_code == 2
    err = result.stderr.strip().splitlines()
    assert len(err) == 1 and "pip install 'kvtool[vllm]'" in err[0]
    assert "kvtool.integrations.venv" in err[0]


def test_the_models_side(tmp_path: Path) -> None:
    """The traces the experiment writes, replayed by the model: the multi-turn trace hits
    its shared prefixes, the random one never; more users queue prefills (TTFT up) and
    finish more requests per second; rows carry measured, modelled and the error."""
    w = find_experiment(NAME).workload
    traces = write_traces(w, tmp_path)
    scalars = {"mfu_prefill": 0.34, "c0_s": 0.003}
    rand1 = model_run(str(CLUSTER), traces["random"], Load("concurrency", 1), scalars)
    rand4 = model_run(str(CLUSTER), traces["random"], Load("concurrency", 4), scalars)
    mt1 = model_run(str(CLUSTER), traces["multi-turn"], Load("concurrency", 1), scalars)
    assert rand1["token_hit_ratio"] == 0 and mt1["token_hit_ratio"] > 0.5
    assert rand4["median_ttft_ms"] > rand1["median_ttft_ms"]
    assert rand4["request_throughput"] > rand1["request_throughput"]
    # c0 is paid once per step: at concurrency 1 a decode step is c0 plus a little
    assert 3.0 < rand1["median_tpot_ms"] < 4.0
    measured = {"median_ttft_ms": 20.0, "median_tpot_ms": 4.0, "request_throughput": 0.0}
    errs = compare(measured, rand1, list(DEFAULT_METRICS))
    assert set(errs) == {"median_ttft_ms", "median_tpot_ms"}  # no positive measurement
    e = errs["median_ttft_ms"]
    assert e["error_pct"] == pytest.approx(100 * (e["modelled"] - 20.0) / 20.0)
    rows = rows_of([{"label": "random@concurrency=1", "metrics": errs}], "random@concurrency=1")
    assert [r["metric"] for r in rows] == ["median_ttft_ms", "median_tpot_ms"]
    assert rows[0]["published"] == 20.0 and rows[0]["basis"] == "modelled"
    assert "in-sample" in rows[0]["kvtool_text"]


def _row_errors(doc: dict, run: str) -> dict[str, float]:
    return {r["metric"]: r["error_pct"] for r in doc["rows"] if r["args"]["run"] == run}


@pytest.mark.slow
@pytest.mark.engine
@pytest.mark.integration
def test_the_experiment_on_the_cpu_engine(engine_python: Path, tiny_model_dir: Path,
                                          tmp_path: Path) -> None:
    """As a user runs it (``kvtool --json experiment run cpu-engine-vs-model``): every
    run measured, the fit's own run close on the metrics fitted, every predicted
    row a finite error, and the model's prefix hits equal to vLLM's."""
    out = tmp_path / "out"
    env = dict(os.environ, KVTOOL_ENGINE_VENV=str(engine_python.parents[1]),
               PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-m", "kvtool", "--json", "experiment", "run",
                           NAME, "--out", str(out)], capture_output=True, text=True,
                          env=env, cwd=REPO, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(proc.stdout)
    assert doc["schema"] == "kvtool.experiment/1" and doc["mode"] == "engine"
    sec = doc["engine_vs_model"]
    w = find_experiment(NAME).workload
    assert [r["label"] for r in sec["runs"]] == w["runs"]
    assert set(sec["scalars"]) == set(w["fit_scalars"]) and sec["scalars_basis"] == "fitted"
    assert len(doc["rows"]) == len(w["runs"]) * len(w["metrics"])
    for r in sec["runs"]:
        assert r["engine"]["name"] == "vllm" and r["requests"] > 0
        assert set(r["metrics"]) == set(w["metrics"])
        hit = r["token_hit_ratio"]
        assert hit["modelled"] == pytest.approx(hit["measured"], abs=0.02), r["label"]
    fit = _row_errors(doc, w["fit"])
    assert sec["fit_metrics"] == w["fit_metrics"]
    # two scalars, two medians: the fit meets them (the reported throughput is a check)
    assert all(abs(fit[m]) < 10 for m in w["fit_metrics"]), fit
    for run_label in w["runs"]:
        for e in _row_errors(doc, run_label).values():
            assert math.isfinite(e)
    assert all(v is not None for v in sec["mape_pct"]["predicted"].values())
    saved = json.loads((out / f"{NAME}.json").read_text())
    assert saved["rows"] == doc["rows"]
    csv_lines = (out / f"{NAME}.csv").read_text().splitlines()
    assert csv_lines[0].startswith("run,fitted_on,metric")
    assert len(csv_lines) == 1 + len(doc["rows"])
