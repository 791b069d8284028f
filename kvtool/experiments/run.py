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
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kvtool.errors import UsageError, param
from kvtool.experiments.differs import factor
from kvtool.experiments.figures import METRICS, FigureUnavailable, RunData
from kvtool.experiments.spec import Experiment, block_bytes_of

SCHEMA = "kvtool.experiment/1"
REPLAY_SCHEMA = "kvtool.replay/2"
"""Each configuration's document, as ``kvtool replay --json`` prints it."""
ProgressFactory = Callable[[str, float | None], Any]
"""``progress(description, total)`` → a context manager yielding ``advance(n)``."""


def write_trace(exp: Experiment, path: Path) -> int:
    """Generate the experiment's workload as a kvtool JSONL trace; return its requests."""
    from kvtool.trace.gen import MultiTurn, RandomPrompts, multi_turn, random_prompts
    from kvtool.trace.sessions import Sessions

    w = exp.workload
    records: Any
    if exp.kind == "multi-turn":
        records = multi_turn(MultiTurn(**asdict(Sessions.from_table(w)), seed=w.get("seed", 0),
                                       form="hash_ids"))
    else:
        records = random_prompts(RandomPrompts(
            input_lengths=tuple(w["input_lengths"]), num_prompts=w["num_prompts"],
            iterations=w["iterations"], output_tokens=w.get("output_tokens", 1),
            system_prompt_tokens=w.get("system_prompt_tokens", 0),
            block_tokens=w.get("block_tokens", 256), seed=w.get("seed", 0), form="hash_ids",
            range_ratio=float(w.get("range_ratio", 0.0)),
            reuse_share=float(w.get("reuse_share", 1.0))))
    n = 0
    with open(path, "w", encoding="utf-8") as f:
        for rec in records:
            f.write(json.dumps(rec, separators=(",", ":")) + "\n")
            n += 1
    return n


def _configs(exp: Experiment) -> list[Any]:
    from kvtool.replay.config import parse_compare

    out = []
    for c in exp.configs:
        cfg = parse_compare(c.tiers, policy=None, write_policy=None)
        cfg.label = c.label
        out.append(cfg)
    return out


def _needs_requests(exp: Experiment) -> bool:
    # The random-prompts plot shows the hit ratio by prompt length, so those runs always
    # keep their requests.
    return exp.kind == "random-prompts" or any(
        f.metric == "hit_ratio_by_length" for f in exp.figures)


def run_replay_kind(exp: Experiment, trace: Path, *, simulate: bool,
                    progress: ProgressFactory | None = None, observer: Any = None,
                    dram: str | None = None, nvme: str | None = None,
                    scratch: Path | None = None,
                    on_event: Callable[[str], None] | None = None) -> RunData:
    """Replay the experiment's trace through every configuration.

    ``simulate``: the replayer, side by side in one pass. Otherwise data mode
    (:mod:`kvtool.replay.run`): real bytes in every tier, blocks of the experiment's
    ``[data] block_bytes``; ``dram`` (a ``mooncake://`` URL) and ``nvme`` (a place) put
    every configuration's DRAM / NVMe tier there. Without ``nvme`` each configuration's
    NVMe tier is a store file of its size in ``scratch`` (removed afterwards).
    """
    labels = [c.label for c in exp.configs]
    per_request: dict[str, list[tuple[int, int, int]]] = {label: [] for label in labels}

    def record(i: int, o: Any) -> None:
        per_request[labels[i]].append((o.round, o.input_tokens, o.input_tokens
                                       - o.recompute_tokens))
        if observer is not None:
            observer.request(labels[i], o)

    want = _needs_requests(exp) or observer is not None
    if simulate:
        if dram or nvme:
            raise UsageError(f"{param('simulate')} moves no bytes: a tier takes no place",
                             field="dram" if dram else "nvme")
        return _simulate(exp, trace, labels, per_request, record if want else None, progress,
                         observer)
    scratch = scratch or trace.parent
    files = [scratch / f"nvme-{i}.img" for i in range(len(exp.configs))]
    specs = [_placed(c.tiers, dram, nvme or str(f)) + f",label={c.label}"
             for c, f in zip(exp.configs, files, strict=True)]
    try:
        return _run_data(exp, trace, specs, labels, per_request, record if want else None,
                         progress, observer, on_event)
    finally:
        if nvme is None:
            for f in files:
                f.unlink(missing_ok=True)


def _run_data(exp: Experiment, trace: Path, specs: list[str], labels: list[str],
              per_request: dict[str, list[tuple[int, int, int]]], record: Any,
              progress: ProgressFactory | None, observer: Any,
              on_event: Callable[[str], None] | None) -> RunData:
    from kvtool.replay.run import ReplaySettings, prepare

    w = exp.workload
    bb = exp.data.get("block_bytes")
    # No times: a replay experiment states counts; its claims' times are the serving
    # experiments' (one time model).
    settings = ReplaySettings(
        trace=str(trace), fmt="kvtool", compares=specs, block_bytes=bb,
        model=None if bb else w.get("model"), dtype=None if bb else w.get("dtype"),
        times="none")
    job = prepare(settings, on_event=on_event)
    if observer is not None:
        observer.block_bytes, observer.block_tokens = job.block_bytes, job.block_tokens
    if progress is not None:
        with progress(f"{exp.name}: data mode (requests)", job.total) as advance:
            doc = job.run(progress=advance, on_request=record)
    else:
        doc = job.run(on_request=record)
    if doc.get("interrupted"):
        raise KeyboardInterrupt
    results = doc.get("configs", [doc])
    return RunData(mode="data", workload=exp.workload, block_bytes=job.block_bytes,
                   results=dict(zip(labels, results, strict=True)), requests=per_request,
                   plan_inputs=dict(zip(labels, _configs(exp), strict=True)),
                   setup=job.setup)


def _placed(spec: str, dram: str | None, nvme: str | None) -> str:
    """``spec`` with its DRAM / NVMe capacity given a place: ``dram=1090blk@mooncake://…``."""
    out = []
    for part in spec.split(","):
        key, eq, value = part.partition("=")
        name = key.strip().lower()
        place = {"dram": dram, "nvme": nvme}.get(name) if eq else None
        if place and "@" not in value and "://" not in value and not value.startswith("/"):
            part = f"{key}={value.strip()}@{place}"
        out.append(part)
    return ",".join(out)


def _simulate(exp: Experiment, trace: Path, labels: list[str],
              per_request: dict[str, list[tuple[int, int, int]]], record: Any,
              progress: ProgressFactory | None, observer: Any) -> RunData:
    from kvtool.cache import replay
    from kvtool.trace import read_trace

    configs = _configs(exp)
    bb = block_bytes_of(exp)
    reader = read_trace(trace, fmt="kvtool")
    if observer is not None:
        observer.block_bytes, observer.block_tokens = bb, reader.block_tokens
    if progress is not None:
        with progress(f"{exp.name}: replay (requests)", len(reader)) as advance:
            results = replay(reader, configs, block_tokens=reader.block_tokens, block_bytes=bb,
                             progress=advance, on_request=record)
    else:
        results = replay(reader, configs, block_tokens=reader.block_tokens, block_bytes=bb,
                         on_request=record)
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
        row = {"claim": f.claim, "published": f.published,
               "published_text": published_text, "kvtool": value, "kvtool_text": text,
               "unit": f.unit, "measured": measured, "basis": basis,
               "metric": f.metric, "args": f.args, "differs": f.differs,
               "agrees": f.agrees(value)}
        fx = factor(row, f.band)
        row["factor"] = None if fx is None or math.isinf(fx) else fx
        rows.append(row)
    return rows


def run_experiment(exp: Experiment, *, out_dir: Path | None, simulate: bool = False,
                   progress: ProgressFactory | None = None, observer: Any = None,
                   scratch: Path | None = None, dram: str | None = None,
                   nvme: str | None = None,
                   on_event: Callable[[str], None] | None = None,
                   seeds: int = 1) -> dict[str, Any]:
    """Run ``exp``; write JSON, CSV and PNG into ``out_dir`` (when given); return the
    ``kvtool.experiment/1`` document. Replay experiments run in data mode unless
    ``simulate`` (``dram``/``nvme``: places for their tiers, see :func:`run_replay_kind`).
    ``seeds`` > 1 re-runs a generated workload with that many seeds and reports every
    figure as a mean with a 95 % bootstrap interval (:mod:`kvtool.experiments.seeds`)."""
    import tempfile

    _check_seeds(exp, seeds)
    seed_list = [exp.workload.get("seed", 0) + i for i in range(seeds)]

    with tempfile.TemporaryDirectory(prefix="kvtool-exp-") as tmp:
        work = out_dir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        doc: dict[str, Any] = {
            "schema": SCHEMA, "name": exp.name, "title": exp.title, "source": exp.source,
            "claim": exp.claim, "scale": exp.scale, "notes": exp.notes, "kind": exp.kind,
            "workload": exp.workload, "block_bytes": block_bytes_of(exp),
            # One shape for every kind and mode (docs/experiments.md): what does not apply
            # is null.
            "mode": None, "requests": None, "setup": None, "reads": None, "configs": [],
            "seeds": None, "engine_vs_model": None,
        }
        if exp.kind == "engine-vs-model":
            _run_engine_vs_model(exp, doc, work, out_dir, progress=progress,
                                 on_event=on_event)
            return doc
        if exp.kind == "parallel-read":
            from kvtool.experiments.parallel_read import run_parallel_read

            data = run_parallel_read(exp, scratch=scratch or work, progress=progress)
            doc["mode"] = "measure"
            doc["reads"] = data.reads
        elif exp.is_serving:
            from kvtool.experiments.serving import run_serving_kind

            trace = work / "trace.jsonl"
            doc["requests"] = write_trace(exp, trace)
            data = run_serving_kind(exp, trace, progress=progress)
            doc["mode"] = data.mode
            doc["block_bytes"] = None
            doc["configs"] = list(data.results.values())
        else:
            trace = work / "trace.jsonl"
            doc["requests"] = write_trace(exp, trace)
            data = run_replay_kind(exp, trace, simulate=simulate, progress=progress,
                                   observer=observer, dram=dram, nvme=nvme,
                                   scratch=scratch or work, on_event=on_event)
            doc["mode"] = data.mode
            doc["block_bytes"] = data.block_bytes
            doc["setup"] = data.setup
            doc["configs"] = [{"schema": REPLAY_SCHEMA, "trace": str(trace), "format": "kvtool",
                               "mode": data.mode, **r} for r in data.results.values()]
            if out_dir is None:
                for c in doc["configs"]:
                    c["trace"] = None
        doc["rows"] = compute_rows(exp, data)
        for row in doc["rows"]:
            row["seeds"] = None
        if seeds > 1:
            _more_seeds(exp, doc, data, seed_list, work, simulate=simulate, progress=progress,
                        observer=observer, dram=dram, nvme=nvme, scratch=scratch or work,
                        on_event=on_event)
        if out_dir is not None:
            doc["files"] = write_files(exp, doc, data, out_dir)
        else:
            doc["files"] = {}
    return doc


def _check_seeds(exp: Experiment, seeds: int) -> None:
    """Refuse a number of seeds the experiment cannot take (only a generated workload is
    re-seeded)."""
    if seeds < 1:
        raise UsageError(f"must be at least 1, got {seeds}", field="seeds")
    if seeds > 1 and exp.kind == "engine-vs-model":
        raise UsageError(f"{exp.name} measures a real engine once per run and fits the model "
                         "to one of them: --seeds does not apply", field="seeds")
    if seeds > 1 and exp.kind == "parallel-read":
        raise UsageError(f"{exp.name} measures reads, it generates no workload to re-seed "
                         "(its [workload] repeats set how often it measures)", field="seeds")


def _run_engine_vs_model(exp: Experiment, doc: dict[str, Any], work: Path,
                         out_dir: Path | None, *, progress: ProgressFactory | None,
                         on_event: Callable[[str], None] | None) -> None:
    """Run an ``engine-vs-model`` experiment (a real engine, then the model fitted to it)
    into ``doc``, with its files in ``out_dir`` when given."""
    from kvtool.experiments.engine_model import rows_of, run_engine_vs_model
    from kvtool.experiments.spec import cluster_path

    section = run_engine_vs_model(exp, work, cluster_path(exp.workload["cluster"], exp.path),
                                  progress=progress, on_event=on_event)
    doc["mode"] = "engine"
    doc["block_bytes"] = None
    doc["requests"] = sum(r["requests"] for r in section["runs"])
    doc["engine_vs_model"] = section
    doc["rows"] = rows_of(section["runs"], section["fit"])
    if out_dir is not None:
        doc["files"] = write_engine_files(exp, doc, out_dir)
    else:
        doc["files"] = {}


def _more_seeds(exp: Experiment, doc: dict[str, Any], data: RunData, seed_list: list[int],
                work: Path, **run: Any) -> None:
    """Run seeds ``seed_list[1:]`` (the first ran already, into ``doc`` and ``data``); put
    each figure's mean and 95 % interval into ``doc["rows"]`` and the per-round bands into
    ``data.bands``. ``configs`` stays the first seed's documents."""
    from dataclasses import replace

    from kvtool.experiments.seeds import METHOD, ci_text, round_band, summarize

    values = [[row["kvtool"]] for row in doc["rows"]]
    results = {label: [res] for label, res in data.results.items()}
    for seed in seed_list[1:]:
        exp_s = replace(exp, workload={**exp.workload, "seed": seed})
        trace = work / f"trace-seed{seed}.jsonl"
        write_trace(exp_s, trace)
        try:
            more = run_replay_kind(exp_s, trace, **run)
        finally:
            trace.unlink(missing_ok=True)
        for vals, row in zip(values, compute_rows(exp_s, more), strict=True):
            vals.append(row["kvtool"])
        for label, res in more.results.items():
            results[label].append(res)
    for row, vals in zip(doc["rows"], values, strict=True):
        summary = summarize(vals, seed_list)
        row["seeds"] = summary
        row["kvtool"] = summary["mean"]
        row["kvtool_text"] = ci_text(summary, row["unit"])
    doc["seeds"] = {"n": len(seed_list), "seeds": seed_list, "method": METHOD}
    data.bands = {label: round_band(res) for label, res in results.items()}


def write_engine_files(exp: Experiment, doc: dict[str, Any], out_dir: Path
                       ) -> dict[str, str]:
    """An engine-vs-model run's NAME.json and NAME.csv (one row per run and metric)."""
    from kvtool.jsondoc import dump_json

    files = {"json": out_dir / f"{exp.name}.json", "csv": out_dir / f"{exp.name}.csv"}
    out = {k: str(v) for k, v in files.items()}
    doc["files"] = out
    section = doc["engine_vs_model"]
    try:
        with open(files["csv"], "w", newline="", encoding="utf-8") as f:
            w = csv.writer(f)
            w.writerow(["run", "fitted_on", "metric", "unit", "measured", "modelled",
                        "error_pct"])
            for r in doc["rows"]:
                w.writerow([r["args"]["run"], section["fit"], r["metric"], r["unit"],
                            r["published"], r["kvtool"], r["error_pct"]])
        files["json"].write_text(dump_json(doc) + "\n", encoding="utf-8")
    except OSError as exc:
        raise UsageError(f"cannot write into {out_dir}: {exc.strerror or exc}",
                         field="out") from None
    return out


def write_files(exp: Experiment, doc: dict[str, Any], data: RunData, out_dir: Path
                ) -> dict[str, str]:
    from kvtool.jsondoc import dump_json

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
                        "published_text", "kvtool_text", "seeds", "ci95_low", "ci95_high"])
            for r in doc["rows"]:
                sd = r.get("seeds") or {}
                lo, hi = sd.get("ci95") or ("", "")
                w.writerow([r["claim"], "" if r["published"] is None else r["published"],
                            "" if r["kvtool"] is None else r["kvtool"], r["unit"],
                            r["measured"], r["basis"], r["published_text"], r["kvtool_text"],
                            sd.get("n", ""), lo, hi])
        if data.serving:
            from kvtool.experiments.serving import plot_serving, sweep_doc
            from kvtool.serving.run import write_csv as write_sweep_csv

            write_sweep_csv(sweep_doc(data), files["rounds_csv"])
            plot_serving(exp, data, files["png"])
        else:
            if exp.kind != "parallel-read":
                from kvtool.cache.report import write_csv

                write_csv(list(data.results.values()), files["rounds_csv"])
            from kvtool.experiments.plot import plot_experiment

            plot_experiment(exp, data, files["png"])
        files["json"].write_text(dump_json(doc) + "\n", encoding="utf-8")
    except OSError as exc:
        raise UsageError(f"cannot write into {out_dir}: {exc.strerror or exc}",
                         field="out") from None
    return out
