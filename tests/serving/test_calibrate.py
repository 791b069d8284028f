"""Calibration (kvtool.serving.calibrate, ``kvtool calibrate``): the reader of ``vllm bench
serve --save-result`` files, the model's own result files, the optimiser, and the fit.

No measurement is invented: every result file here is written by kvtool's own model at
known scalars (tests/helpers/bench_results.py, fixtures/vllm-bench/), so a fit must find
those scalars again. Tolerances: the model replays a file's workload exactly, so the true
scalars give zero error; the optimiser stops when its simplex spans 1e-3 of the log-scaled
box (0.5 % of an MFU, 0.3 % of eta, 1 % of c0), and events moving across step boundaries
make the error surface step a little, so a scalar the files pin down (sensitivity report:
a ±10 % move changes some metric by over 1 %) is asked back within 2 %, and the files'
metrics within 0.5 % MAPE.
"""

from __future__ import annotations

import importlib.metadata
import json
import math
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvtool.errors import InputError, UsageError
from kvtool.serving.calibrate import (
    CalibrationSettings,
    _folds,
    calibrate,
    model_bench_result,
    nelder_mead,
    parse_scalar_overrides,
    read_bench_results,
)
from tests.conftest import run, run_json
from tests.helpers.bench_results import CLUSTER, DIRECTORY, REPO, RUNS, TRUTH, result
from tests.helpers.cli import one_error_line

A100 = str(REPO / CLUSTER)
FIX = {name: str(DIRECTORY / f"{name}.json") for name in RUNS}


def _write(tmp_path: Path, doc: Any, name: str = "r.json") -> str:
    p = tmp_path / name
    p.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    return str(p)


def _close(a: float, b: float, rel: float) -> bool:
    return abs(a - b) <= rel * abs(b)


# ---------------------------------------------------------------- the model's own files

def test_fixtures_are_the_models_output() -> None:
    """fixtures/vllm-bench/ is what the model writes today (regenerate: python -m
    tests.helpers.bench_results), so no file there is a measurement or stale."""
    for name in RUNS:
        stored = json.loads(Path(FIX[name]).read_text())
        fresh = result(name)
        assert stored["kvtool_basis"] == "simulated"
        assert set(stored) == set(fresh), name
        for key, value in fresh.items():
            if key == "date":
                continue
            if isinstance(value, float):
                assert _close(stored[key], value, 1e-9), (name, key)
            elif isinstance(value, list) and value and isinstance(value[0], float):
                assert np.allclose(stored[key], value, rtol=1e-9, atol=0), (name, key)
            else:
                assert stored[key] == value, (name, key)


def test_model_result_uses_vllm_bench_keys() -> None:
    """Every key the model writes (except its own kvtool_* labels) is one vLLM 0.33.0's
    serve.py writes, and the settings and metrics it needs are there."""
    try:
        serve = importlib.metadata.distribution("vllm").locate_file("vllm/benchmarks/serve.py")
        source = Path(str(serve)).read_text()
    except (importlib.metadata.PackageNotFoundError, FileNotFoundError):
        pytest.skip("vllm is not installed (pip install --no-deps vllm==0.33.0)")
    doc = result("a100-llama2-c4")
    for key in doc:
        if key.startswith("kvtool_"):
            continue
        m = re.match(r"(mean|median|std|p90|p99)_(ttft|tpot|itl|e2el)_ms$", key)
        if m:  # written as f"{stat}_{metric}_ms" there
            assert f'"{m.group(2)}"' in source
            continue
        assert f'"{key}"' in source, key
    for key in ("num_prompts", "request_rate", "max_concurrency", "burstiness", "input_lens",
                "output_lens", "ttfts", "start_times", "completed", "duration"):
        assert key in doc


def test_model_result_is_consistent() -> None:
    doc = result("a100-llama2-c4")
    n = doc["num_prompts"]
    assert doc["completed"] == n and len(doc["ttfts"]) == n
    assert doc["output_throughput"] == pytest.approx(sum(doc["output_lens"]) / doc["duration"])
    assert np.mean(doc["ttfts"]) * 1000 == pytest.approx(doc["mean_ttft_ms"])
    tpots = [(lat - t) / (o - 1) for lat, t, o in zip(doc["latencies"], doc["ttfts"],
                                                      doc["output_lens"], strict=True)]
    assert np.mean(tpots) * 1000 == pytest.approx(doc["mean_tpot_ms"])


# ---------------------------------------------------------------- the reader

def test_reader_maps_each_load() -> None:
    c4 = read_bench_results(FIX["a100-llama2-c4"])[0]
    assert (c4.load().kind, c4.load().value) == ("concurrency", 4)
    assert c4.per_request and c4.input_lens == (1024,) * 12 and c4.output_lens == (32,) * 12
    assert c4.basis == "simulated" and c4.model_id == "llama-2-7b"
    rate = read_bench_results(FIX["a100-llama2-rate4"])[0]
    assert rate.load().kind == "timestamps" and rate.start_times is not None
    reqs = rate.workload(16)
    assert reqs[0].timestamp == 0.0 and reqs[-1].timestamp > 0
    keys = [k for r in reqs for k in r.block_keys]
    assert len(keys) == len(set(keys)) == 16 * 768 // 16  # random prompts: nothing shared


def test_reader_without_details_uses_mean_lengths(tmp_path: Path) -> None:
    doc = result("a100-llama2-rate4")
    for k in ("input_lens", "output_lens", "ttfts", "start_times", "errors"):
        del doc[k]
    doc["total_input_tokens"] = 10 * 500 + 3  # rounded mean
    doc["total_output_tokens"] = 10 * 48 - 2
    doc["completed"] = 10
    doc["num_prompts"] = 12
    r = read_bench_results(_write(tmp_path, doc))[0]
    assert not r.per_request and r.start_times is None
    assert r.input_lens == (500,) * 10 and r.output_lens == (48,) * 10
    assert r.failed == 2
    assert (r.load().kind, r.load().value) == ("request-rate", 4.0)  # Poisson, kvtool's seed


def test_reader_leaves_failed_requests_out(tmp_path: Path) -> None:
    doc = result("a100-llama2-c4")
    doc["output_lens"][3] = 0
    doc["errors"][3] = "timeout"
    r = read_bench_results(_write(tmp_path, doc))[0]
    assert len(r.input_lens) == 11 and r.failed == 1


def test_append_result_file_holds_one_run_per_line(tmp_path: Path) -> None:
    a, b = result("a100-llama2-c1"), result("a100-llama2-c4")
    path = _write(tmp_path, json.dumps(a) + "\n" + json.dumps(b) + "\n")
    runs = read_bench_results(path)
    assert [r.source for r in runs] == [f"{path}:1", f"{path}:2"]
    b["request_rate"] = "fast"
    path = _write(tmp_path, json.dumps(a) + "\n" + json.dumps(b) + "\n", "bad.json")
    with pytest.raises(InputError) as exc:
        read_bench_results(path)
    assert str(exc.value).startswith(f"{path}:2: field 'request_rate':")


def _edit(key: str, value: Any) -> dict[str, Any]:
    doc = result("a100-llama2-rate4")
    if value is _DELETE:
        del doc[key]
    else:
        doc[key] = value
    return doc


_DELETE = object()
BAD = [
    (_edit("num_prompts", _DELETE), "num_prompts", "missing"),
    (_edit("request_rate", "fast"), "request_rate", "must be a number"),
    (_edit("request_rate", 0), "request_rate", "positive"),
    (_edit("max_concurrency", 0), "max_concurrency", "at least 1"),
    (_edit("completed", 0), "completed", "no request completed"),
    (_edit("output_lens", [1] * 3), "output_lens", "has 3 entries"),
    (_edit("input_lens", [1, "x"]), "input_lens[1]", "whole number"),
    (_edit("mean_ttft_ms", "slow"), "mean_ttft_ms", "must be a number"),
    (_edit("ramp_up_strategy", "linear"), "ramp_up_strategy", "ramp-up"),
    (_edit("start_times", [0.0]), "start_times", "one per request"),
]


@pytest.mark.parametrize(("doc", "field", "words"), BAD, ids=[b[1] for b in BAD])
def test_bad_file_names_file_line_and_field(tmp_path: Path, doc: dict[str, Any], field: str,
                                            words: str) -> None:
    path = _write(tmp_path, doc)
    with pytest.raises(InputError) as exc:
        read_bench_results(path)
    assert str(exc.value).startswith(f"{path}:1: field '{field}':"), str(exc.value)
    assert words in str(exc.value)


def test_finite_rate_needs_send_times_when_not_poisson(tmp_path: Path) -> None:
    for key, value, field in (("burstiness", 0.5, "burstiness"),
                              ("max_concurrency", 4, "max_concurrency")):
        doc = result("a100-llama2-rate4")
        del doc["start_times"]
        doc[key] = value
        with pytest.raises(InputError, match=f"field '{field}'"):
            read_bench_results(_write(tmp_path, doc))


def test_not_json_names_the_line(tmp_path: Path) -> None:
    path = _write(tmp_path, '{"num_prompts": 3,\n "x": }')
    with pytest.raises(InputError, match=re.escape(f"{path}:2: invalid JSON")):
        read_bench_results(path)
    with pytest.raises(InputError, match="no such file"):
        read_bench_results(str(tmp_path / "missing.json"))


# ---------------------------------------------------------------- the optimiser

def test_nelder_mead_finds_an_interior_minimum() -> None:
    target = np.array([0.2, 0.7, 0.45])
    u, val, evals = nelder_mead(lambda x: float(np.sum((x - target) ** 2)),
                                np.array([0.5, 0.5, 0.5]), xtol=1e-5, ftol=1e-14)
    assert np.allclose(u, target, atol=1e-4) and val < 1e-8 and evals < 300


def test_nelder_mead_stays_in_the_box() -> None:
    seen: list[np.ndarray] = []

    def f(x: np.ndarray) -> float:
        seen.append(x.copy())
        return float((x[0] - 1.7) ** 2 + (x[1] + 0.4) ** 2)

    u, _val, _ = nelder_mead(f, np.array([0.5, 0.5]))
    assert all(((p >= 0) & (p <= 1)).all() for p in seen)
    assert np.allclose(u, [1.0, 0.0], atol=1e-3)


def test_folds() -> None:
    assert _folds(3, None) == ("leave-one-out", [[0], [1], [2]])
    assert _folds(5, 2) == ("2-fold", [[0, 2, 4], [1, 3]])
    assert _folds(3, 0) == ("none", [])
    assert _folds(1, None) == ("none", [])


# ---------------------------------------------------------------- the fit

def test_fit_recovers_two_scalars() -> None:
    doc = calibrate(CalibrationSettings(
        A100, [FIX["a100-llama2-c1"], FIX["a100-llama2-c16"]], fit=("mfu_prefill", "eta"),
        fixed={"c0_s": TRUTH["c0_s"]}, folds=0))
    for n in ("mfu_prefill", "eta"):
        assert _close(doc["scalars"][n], TRUTH[n], 0.02), doc["scalars"]
        assert doc["sensitivity"][n]["identified"]
    assert doc["in_sample"]["mape_pct"]["all"] < 0.5
    assert doc["held_out"]["method"] == "none" and doc["held_out"]["mape_pct"] is None
    assert doc["replay_flags"][0].startswith("--scalar mfu_prefill=0.5")


@pytest.mark.slow
def test_fit_recovers_three_scalars_and_held_out_error_is_zero() -> None:
    files = [FIX[n] for n in ("a100-llama2-c1", "a100-llama2-c4", "a100-llama2-c16",
                              "a100-llama2-rate4")]
    doc = calibrate(CalibrationSettings(A100, files, fit=("mfu_prefill", "eta", "c0_s")))
    for n in ("mfu_prefill", "eta", "c0_s"):
        assert _close(doc["scalars"][n], TRUTH[n], 0.02), doc["scalars"]
    assert doc["held_out"]["method"] == "leave-one-out"
    assert len(doc["held_out"]["folds"]) == 4
    for m, v in doc["held_out"]["mape_pct"].items():
        assert v < 0.5, (m, v)
    # A fold's own scalars are not asked back: without the concurrency-1 run the others
    # pin eta against c0 only loosely (a 10 % move along that valley changes their
    # metrics by under 1 %), and the Poisson run's TTFT steps by ~1 % where an arrival
    # moves to the next step, so a fold may stop on such a step; its predictions, bounded
    # above, are what held-out validation checks.
    assert all(set(f["scalars"]) == {"mfu_prefill", "eta", "c0_s"}
               for f in doc["held_out"]["folds"])


@pytest.mark.slow
def test_fit_recovers_all_four_scalars(tmp_path: Path) -> None:
    truth = {"mfu_prefill": 0.5, "mfu_decode": 0.4, "eta": 0.75, "c0_s": 0.003}
    files = []
    for i, (c, n, n_in, n_out) in enumerate(((1, 6, 512, 24), (4, 12, 1024, 24),
                                             (32, 48, 128, 32))):
        doc = model_bench_result(A100, [n_in] * n, [n_out] * n, max_concurrency=c,
                                 scalars=truth)
        files.append(_write(tmp_path, doc, f"r{i}.json"))
    fit = calibrate(CalibrationSettings(A100, files, folds=0))
    for name in ("mfu_prefill", "eta", "c0_s"):
        assert _close(fit["scalars"][name], truth[name], 0.02), fit["scalars"]
    # decode FLOPs barely move a memory-bound A100 step: looser, and the report says so
    assert _close(fit["scalars"]["mfu_decode"], truth["mfu_decode"], 0.10), fit["scalars"]
    assert fit["in_sample"]["mape_pct"]["all"] < 0.5


def test_held_out_error_shows_a_wrong_model() -> None:
    """Fitting eta alone, with mfu_prefill held at its default (0.45, not the files' 0.55),
    cannot match the TTFTs: the held-out error says so."""
    doc = calibrate(CalibrationSettings(
        A100, [FIX["a100-llama2-c1"], FIX["a100-llama2-c4"]], fit=("eta",),
        fixed={"c0_s": TRUTH["c0_s"]}, metrics=("mean_ttft_ms",), max_evals=60))
    assert doc["held_out"]["mape_pct"]["mean_ttft_ms"] > 2.0


def test_settings_are_checked() -> None:
    with pytest.raises(UsageError, match="cannot fit 'op_latency_s'"):
        calibrate(CalibrationSettings(A100, [FIX["a100-llama2-c1"]], fit=("op_latency_s",)))
    with pytest.raises(UsageError, match="unknown metric"):
        calibrate(CalibrationSettings(A100, [FIX["a100-llama2-c1"]], metrics=("ttft",)))
    with pytest.raises(UsageError, match="both fitted and fixed"):
        calibrate(CalibrationSettings(A100, [FIX["a100-llama2-c1"]], fixed={"eta": 0.5}))
    with pytest.raises(UsageError, match="at least 2"):
        calibrate(CalibrationSettings(A100, [FIX["a100-llama2-c1"]], folds=1))


def test_parse_scalar_overrides() -> None:
    assert parse_scalar_overrides(["mfu_prefill=0.5", "c0-s=0.002"]) == \
        {"mfu_prefill": 0.5, "c0_s": 0.002}
    for bad, words in (("mfu=0.5", "expected NAME=VALUE"), ("eta=x", "not a number"),
                       ("eta=1.5", "(0, 1]")):
        with pytest.raises(UsageError, match=re.escape(words)):
            parse_scalar_overrides([bad])


# ---------------------------------------------------------------- the commands

def test_cli_fits_and_replay_reproduces_the_file(tmp_path: Path) -> None:
    doc = run_json("calibrate", A100, FIX["a100-llama2-c1"], FIX["a100-llama2-c16"],
                   "--fit", "mfu_prefill,eta", "--scalar", "c0_s=0.002", "--folds", "0")
    assert doc["schema"] == "kvtool.calibrate/1" and doc["fit"] == ["mfu_prefill", "eta"]
    flags = [w for f in doc["replay_flags"] for w in f.split()] + ["--scalar", "c0_s=0.002"]
    # replaying the file's workload with the fitted flags gives the file's figures back
    trace = tmp_path / "c16.jsonl"
    gen = run("trace", "gen", "-o", str(trace), "--random-input-len", "256", "--num-prompts", "32",
              "--iterations", "1", "--output-tokens", "64", "--block-tokens", "16")
    assert gen.exit_code == 0, gen.stderr
    rep = run_json("replay", str(trace), "--simulate", "--cluster", A100, "--concurrency", "16",
                   *flags)
    stored = json.loads(Path(FIX["a100-llama2-c16"]).read_text())
    for m in ("mean_ttft_ms", "mean_tpot_ms", "output_throughput"):
        assert _close(rep["serving"][m], stored[m], 0.005), m


def test_cli_human_output_fits_80_columns(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "80")
    res = run("calibrate", A100, FIX["a100-llama2-c1"], FIX["a100-llama2-c16"], "--fit",
              "mfu_prefill,eta", "--scalar", "c0_s=0.002", "--folds", "0", "--max-evals", "40")
    assert res.exit_code == 0, res.stderr
    assert "scalars (fitted)" in res.stdout and "MAPE" in res.stdout
    assert max(len(line) for line in res.stdout.splitlines()) <= 80


def test_cli_bad_file_is_one_line(tmp_path: Path) -> None:
    path = _write(tmp_path, _edit("num_prompts", _DELETE))
    one_error_line(run("calibrate", A100, path), path, "num_prompts")
    one_error_line(run("calibrate", A100, FIX["a100-llama2-c1"], "--scalar", "eta=2"),
                   "--scalar")
    one_error_line(run("calibrate", A100, FIX["a100-llama2-c1"], "--fit", "nope"), "--fit")


def test_replay_scalar_needs_a_cluster(tmp_path: Path) -> None:
    trace = str(REPO / "fixtures" / "traces" / "multiturn-8x12.jsonl")
    one_error_line(run("replay", trace, "--simulate", "--scalar", "eta=0.5"), "--scalar",
                   "--cluster")
    one_error_line(run("replay", trace, "--simulate", "--cluster", A100, "--scalar", "eta"),
                   "--scalar")


def test_held_out_mape_is_finite_per_metric() -> None:
    doc = calibrate(CalibrationSettings(
        A100, [FIX["a100-llama2-c1"], FIX["a100-llama2-c16"]], fit=("eta",),
        fixed={"c0_s": TRUTH["c0_s"], "mfu_prefill": TRUTH["mfu_prefill"]},
        max_evals=80))
    held = doc["held_out"]["mape_pct"]
    assert set(held) == {"mean_ttft_ms", "mean_tpot_ms", "output_throughput", "all"}
    assert all(math.isfinite(v) and v < 0.5 for v in held.values())
    assert _close(doc["scalars"]["eta"], TRUTH["eta"], 0.02)
