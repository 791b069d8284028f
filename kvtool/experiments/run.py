"""Run an experiment: make its workload, run every configuration, compute the figures.

Library use (``kvtool experiment run`` is a thin shell over this)::

    from kvtool.experiments import find_experiment, run_experiment

    doc = run_experiment(find_experiment("gp7000-cliff"), out_dir=Path("out"), simulate=True)
    for row in doc["rows"]:
        print(row["claim"], row["published"], row["kvtool"], row["measured"])

The document is schema ``kvtool.experiment/1`` (docs/json.md, docs/experiments.md).
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvtool.errors import UsageError
from kvtool.experiments.figures import METRICS, FigureUnavailable, RunData
from kvtool.experiments.spec import Experiment, block_bytes_of

SCHEMA = "kvtool.experiment/1"
ProgressFactory = Callable[[str, float | None], Any]
"""``progress(description, total)`` → a context manager yielding ``advance(n)``."""


def write_trace(exp: Experiment, path: Path) -> int:
    """Generate the experiment's workload as a kvtool JSONL trace; return its requests."""
    from kvtool.trace.gen import MultiTurn, RandomPrompts, multi_turn, random_prompts

    w = exp.workload
    records: Any
    if exp.kind == "multi-turn":
        records = multi_turn(MultiTurn(
            sessions=w["sessions"], rounds=w["rounds"], input_tokens=w["input_tokens"],
            output_tokens=w["output_tokens"], system_prompt_tokens=w.get("system_prompt_tokens", 0),
            block_tokens=w.get("block_tokens", 256), seed=w.get("seed", 0), form="hash_ids"))
    else:
        records = random_prompts(RandomPrompts(
            input_lengths=tuple(w["input_lengths"]), num_prompts=w["num_prompts"],
            iterations=w["iterations"], output_tokens=w.get("output_tokens", 1),
            block_tokens=w.get("block_tokens", 256), seed=w.get("seed", 0), form="hash_ids"))
    n = 0
    with open(path, "w", encoding="utf-8") as f:
        for rec in records:
            f.write(json.dumps(rec, separators=(",", ":")) + "\n")
            n += 1
    return n


def _configs(exp: Experiment) -> list[Any]:
    from kvtool.cache.config import parse_compare

    out = []
    for c in exp.configs:
        cfg = parse_compare(c.tiers, policy=None, write_policy=None)
        cfg.label = c.label
        out.append(cfg)
    return out


def _needs_requests(exp: Experiment) -> bool:
    # The random-prompts plot shows TTFT by prompt length, so those runs always keep them.
    return exp.kind == "random-prompts" or any(
        f.metric in ("ttft_ms", "ttft_ratio") for f in exp.figures)


def run_replay_kind(exp: Experiment, trace: Path, *, simulate: bool,
                    progress: ProgressFactory | None = None,
                    observer: Any = None) -> RunData:
    """Replay the experiment's trace through every configuration, side by side."""
    from kvtool.cache import replay
    from kvtool.cache.config import time_model_from
    from kvtool.trace import read_trace

    if not simulate:
        raise UsageError("replay experiments run on the metadata engine: give --simulate",
                         field="--simulate")
    configs = _configs(exp)
    bb = block_bytes_of(exp)
    tm = time_model_from(exp.time, prefill_tps=None, tpot_ms=None, read_gbps={},
                         concurrency=None)
    reader = read_trace(trace, fmt="kvtool")
    if observer is not None:
        observer.block_bytes, observer.block_tokens = bb, reader.block_tokens
    labels = [c.label for c in configs]
    per_request: dict[str, list[tuple[int, int, float]]] = {label: [] for label in labels}

    def record(i: int, o: Any) -> None:
        per_request[labels[i]].append((o.round, o.input_tokens, o.ttft_s))
        if observer is not None:
            observer.request(labels[i], o)

    want = _needs_requests(exp) or observer is not None
    if progress is not None:
        with progress(f"{exp.name}: replay (requests)", len(reader)) as advance:
            results = replay(reader, configs, block_tokens=reader.block_tokens, block_bytes=bb,
                             time_model=tm, progress=advance,
                             on_request=record if want else None)
    else:
        results = replay(reader, configs, block_tokens=reader.block_tokens, block_bytes=bb,
                         time_model=tm, on_request=record if want else None)
    return RunData(mode="simulate", workload=exp.workload, block_bytes=bb,
                   results=dict(zip(labels, results, strict=True)), requests=per_request,
                   plan_inputs=dict(zip(labels, configs, strict=True)))


def compute_rows(exp: Experiment, data: RunData) -> list[dict[str, Any]]:
    rows = []
    for f in exp.figures:
        metric = METRICS[f.metric]
        try:
            v = metric.fn(data, f.args)
            value: float | None = v.value
            text, basis, measured = v.text, v.basis, v.measured
        except FigureUnavailable as exc:
            value, text, basis, measured = None, f"n/a ({exc})", "unavailable", False
        if value is not None and math.isinf(value):
            value = None
        published_text = f.published_text or (
            "–" if f.published is None else f"{f.published:g}")
        rows.append({"claim": f.claim, "published": f.published,
                     "published_text": published_text, "kvtool": value, "kvtool_text": text,
                     "unit": f.unit, "measured": measured, "basis": basis,
                     "metric": f.metric, "args": f.args, "differs": f.differs})
    return rows


def run_experiment(exp: Experiment, *, out_dir: Path | None, simulate: bool = False,
                   progress: ProgressFactory | None = None, observer: Any = None,
                   scratch: Path | None = None) -> dict[str, Any]:
    """Run ``exp``; write JSON, CSV and PNG into ``out_dir`` (when given); return the
    ``kvtool.experiment/1`` document."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="kvtool-exp-") as tmp:
        work = out_dir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        doc: dict[str, Any] = {
            "schema": SCHEMA, "name": exp.name, "title": exp.title, "source": exp.source,
            "claim": exp.claim, "scale": exp.scale, "notes": exp.notes, "kind": exp.kind,
            "workload": exp.workload, "block_bytes": block_bytes_of(exp),
        }
        if exp.kind == "parallel-read":
            from kvtool.experiments.parallel_read import run_parallel_read

            data = run_parallel_read(exp, scratch=scratch or work, progress=progress)
            doc["mode"] = "measure"
            doc["reads"] = data.reads
            doc["configs"] = []
        else:
            trace = work / "trace.jsonl"
            doc["requests"] = write_trace(exp, trace)
            data = run_replay_kind(exp, trace, simulate=simulate, progress=progress,
                                   observer=observer)
            doc["mode"] = data.mode
            doc["configs"] = [{"schema": "kvtool.replay/1", "trace": str(trace),
                               "format": "kvtool", **r} for r in data.results.values()]
            if out_dir is None:
                for c in doc["configs"]:
                    c["trace"] = None
        doc["rows"] = compute_rows(exp, data)
        if out_dir is not None:
            doc["files"] = write_files(exp, doc, data, out_dir)
        else:
            doc["files"] = {}
    return doc


def write_files(exp: Experiment, doc: dict[str, Any], data: RunData, out_dir: Path
                ) -> dict[str, str]:
    from kvtool.cli.output import dump_json

    files = {"json": out_dir / f"{exp.name}.json", "csv": out_dir / f"{exp.name}.csv",
             "png": out_dir / f"{exp.name}.png"}
    if exp.kind != "parallel-read":
        files["rounds_csv"] = out_dir / f"{exp.name}-rounds.csv"
        files["trace"] = out_dir / "trace.jsonl"
    out = {k: str(v) for k, v in files.items()}
    doc["files"] = out
    try:
        with open(files["csv"], "w", newline="", encoding="utf-8") as f:
            w = csv.writer(f)
            w.writerow(["claim", "published", "kvtool", "unit", "measured", "basis",
                        "published_text", "kvtool_text"])
            for r in doc["rows"]:
                w.writerow([r["claim"], "" if r["published"] is None else r["published"],
                            "" if r["kvtool"] is None else r["kvtool"], r["unit"],
                            r["measured"], r["basis"], r["published_text"], r["kvtool_text"]])
        if exp.kind != "parallel-read":
            from kvtool.cache.report import write_csv

            write_csv(list(data.results.values()), files["rounds_csv"])
        from kvtool.experiments.plot import plot_experiment

        plot_experiment(exp, data, files["png"])
        files["json"].write_text(dump_json(doc) + "\n", encoding="utf-8")
    except OSError as exc:
        raise UsageError(f"cannot write into {out_dir}: {exc.strerror or exc}",
                         field="--out") from None
    return out
