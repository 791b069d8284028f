"""``kvtool replay TRACE --cluster FILE`` as a library call: settings in, the report out.

::

    from kvtool.serving.run import ServingSettings, run_serving
    doc = run_serving(ServingSettings("trace.jsonl", clusters=("fixtures/clusters/a100-llama2.toml",),
                                      loads=(Load("concurrency", 16),)))
    doc["runs"][0]["serving"]["output_throughput"]

One run per (cluster, load) pair: several clusters are configurations side by side, several
loads a sweep (``--sweep concurrency=1,4,16``). Every figure is simulated (docs/serving.md).
"""

from __future__ import annotations

import csv
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from kvtool.errors import UsageError, param
from kvtool.fanout import Fanout
from kvtool.serving.load import LOAD_KINDS, Load, default_load

if TYPE_CHECKING:
    from kvtool.serving.setup import BuiltCluster

SCHEMA = "kvtool.serving/1"


@dataclass
class ServingSettings:
    """What ``kvtool replay --cluster`` was asked (typed)."""

    trace: str
    clusters: Sequence[str]
    loads: Sequence[Load] = ()
    """Empty: the trace's default load (:func:`kvtool.serving.load.default_load`)."""
    fmt: str = "auto"
    block_tokens: int | None = None
    skip_bad: int = 0
    seed: int = 0
    exact_steps: bool = False
    """Schedule every engine step on its own (the reference) instead of jumping over runs
    of identical decode steps (:mod:`kvtool.serving.engine`); the report is the same."""
    scalars: dict[str, float] = field(default_factory=dict)
    """Overrides of the roofline's fitted scalars (``mfu_prefill``, ``eta``, ...)."""


def parse_sweep(text: str) -> list[Load]:
    """``concurrency=1,4,16`` or ``request-rate=0.5,1,2`` → one :class:`Load` each."""
    kind, eq, values = text.partition("=")
    kind = kind.strip().replace("_", "-")
    if not eq or kind not in ("concurrency", "request-rate"):
        raise UsageError(f"{text!r}: expected concurrency=C1,C2,... or request-rate=R1,R2,...",
                         field="sweep")
    out = []
    for v in values.split(","):
        v = v.strip()
        try:
            x = math.inf if v == "inf" else float(v)
        except ValueError:
            raise UsageError(f"{text!r}: {v!r} is not a number", field="sweep") from None
        out.append(Load(kind, x))  # type: ignore[arg-type]
    if not out:
        raise UsageError(f"{text!r}: no values", field="sweep")
    return out


class RunBackend(Protocol):
    """A data-mode backend for one run (:class:`~kvtool.serving.sim.DataBackend`), with
    its report and a close."""

    def on_store(self, tier: str, node: str | None, keys: list[int], engine: int) -> None: ...
    def on_load(self, tier: str, node: str | None, keys: list[int], engine: int
                ) -> list[int]: ...
    def on_evict(self, tier: str, node: str | None, keys: list[int]) -> None: ...
    def result(self) -> dict[str, Any]: ...
    def close(self) -> None: ...


def run_serving(s: ServingSettings, *, progress: Callable[[int], None] | None = None,
                on_setup: Callable[[dict[str, Any]], None] | None = None,
                backend: Callable[[BuiltCluster], RunBackend] | None = None,
                fanout: Fanout | None = None) -> dict[str, Any]:
    """Read the trace and the cluster files, run every (cluster, load), return the report.

    ``backend(built)``, when given, opens the real tiers of a run (data mode: the replay
    package's :func:`kvtool.replay.servingdata.open_cluster_data`); each run's report then has
    a ``data`` object and is closed after the run. Without one, the runs are independent
    and ``fanout`` (:mod:`kvtool.fanout`) may run them side by side: the report is the
    same as a serial run's."""
    from kvtool.serving.setup import build_setup
    from kvtool.trace import read_trace

    if not s.clusters:
        raise UsageError(f"give a cluster file with {param('cluster')}", field="cluster")
    reader = read_trace(s.trace, fmt=s.fmt, block_tokens=s.block_tokens, skip_bad=s.skip_bad)
    requests = list(reader)
    B = reader.block_tokens
    sessions = {r.session for r in requests if r.session is not None}
    loads = list(s.loads) or [default_load(reader.timed, bool(sessions), len(sessions))]
    for ld in loads:
        if ld.kind == "timestamps" and not reader.timed:
            raise UsageError(f"{s.trace} has no timestamps: use {param('concurrency')} or "
                             f"{param('request_rate')}", field="speedup")
    built = [build_setup(path, block_tokens=B, scalars=s.scalars) for path in s.clusters]
    head: dict[str, Any] = {
        "mode": "data" if backend is not None else "simulate",
        "schema": SCHEMA,
        "trace": s.trace,
        "format": reader.format,
        "block_tokens": B,
        "requests": len(requests),
        "timed": reader.timed,
        "clusters": [b.describe() for b in built],
        "loads": [ld.to_dict() for ld in loads],
    }
    if on_setup is not None:
        on_setup(head)
    points = _Points(requests, built, [Load(ld.kind, ld.value, seed=s.seed) for ld in loads],
                     B, s.exact_steps)
    if backend is not None or fanout is None or fanout.kind == "serial":
        runs = [points.run(i, progress, backend) for i in range(len(points))]
    else:
        def done(_i: int) -> None:
            if progress is not None:
                progress(len(requests))
        runs = fanout.map(_run_point, points, len(points), done)
    head["runs"] = runs
    head["bad_lines"] = [{"line": ln, "message": m} for ln, m in reader.bad_lines]
    head["serving"] = runs[0]["serving"] if len(runs) == 1 else None
    return head


@dataclass
class _Points:
    """Every (cluster, load) of a run, in report order: cluster-major."""

    requests: list[Any]
    built: list[BuiltCluster]
    loads: list[Load]
    trace_block_tokens: int
    exact_steps: bool

    def __len__(self) -> int:
        return len(self.built) * len(self.loads)

    def run(self, i: int, progress: Callable[[int], None] | None = None,
            backend: Callable[[BuiltCluster], RunBackend] | None = None) -> dict[str, Any]:
        from kvtool.serving.sim import Simulation

        b = self.built[i // len(self.loads)]
        ld = self.loads[i % len(self.loads)]
        data = backend(b) if backend is not None else None
        try:
            sim = Simulation(self.requests, b.setup, ld, block_tokens=b.block_tokens,
                             router=b.make_router(), exact_steps=self.exact_steps,
                             trace_block_tokens=self.trace_block_tokens, backend=data)
            started = getattr(data, "started", None)
            if started is not None:  # a backend that times faults on the simulated clock
                started(lambda: sim.now)
            doc = sim.run(progress=progress)
            if data is not None:
                doc["data"] = data.result()
        finally:
            if data is not None:
                data.close()
        doc["cluster"] = b.name
        doc["label"] = f"{b.name} · {ld.label}"
        return doc


def _run_point(points: _Points, i: int) -> dict[str, Any]:
    return points.run(i)


SWEEP_COLUMNS = ("cluster", "load", "value", "completed", "duration", "request_throughput",
                 "output_throughput", "total_token_throughput", "mean_ttft_ms",
                 "median_ttft_ms", "p90_ttft_ms", "p99_ttft_ms", "mean_tpot_ms",
                 "median_tpot_ms", "p99_tpot_ms", "mean_itl_ms", "p99_itl_ms",
                 "mean_e2el_ms", "p99_e2el_ms", "token_hit_ratio", "preemptions")


def sweep_rows(doc: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for r in doc["runs"]:
        sv = r["serving"]
        row = {"cluster": r["cluster"], "load": r["load"]["kind"], "value": r["load"]["value"]}
        for k in SWEEP_COLUMNS[3:]:
            if k in sv:
                row[k] = sv[k]
        row["token_hit_ratio"] = r["cache"]["token_hit_ratio"]
        row["preemptions"] = r["cache"]["preemptions"]
        rows.append(row)
    return rows


def write_csv(doc: dict[str, Any], path: str | os.PathLike[str]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(SWEEP_COLUMNS))
        w.writeheader()
        for row in sweep_rows(doc):
            w.writerow(row)


def write_plot(doc: dict[str, Any], path: str | os.PathLike[str], title: str = "") -> None:
    """Throughput and TTFT p50/p99 against load, one line per cluster (simulated)."""
    from kvtool.plotting import pyplot, save

    plt = pyplot("plot")
    rows = sweep_rows(doc)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    clusters = list(dict.fromkeys(r["cluster"] for r in rows))
    kind = rows[0]["load"] if rows else "concurrency"
    for name in clusters:
        pts = [r for r in rows if r["cluster"] == name]
        xs = [float(r["value"]) if r["value"] != "inf" else math.nan for r in pts]
        ax1.plot(xs, [r["output_throughput"] for r in pts], marker="o", label=name)
        line, = ax2.plot(xs, [r["median_ttft_ms"] / 1000 for r in pts], marker="o",
                         label=f"{name} p50")
        ax2.plot(xs, [r["p99_ttft_ms"] / 1000 for r in pts], marker="x", linestyle="--",
                 color=line.get_color(), label=f"{name} p99")
    for ax in (ax1, ax2):
        ax.set_xlabel(kind.replace("-", " ") + (" (users)" if kind == "concurrency" else " (req/s)"))
        ax.grid(True, alpha=0.3)
        if kind == "concurrency":
            ax.set_xscale("log", base=2)
            ticks = sorted({float(r["value"]) for r in rows})
            ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
    ax1.set_ylabel("output tokens/s (simulated)")
    ax2.set_ylabel("TTFT, s (simulated)")
    ax2.set_yscale("log")
    ax1.legend(fontsize=8, loc="best")
    ax2.legend(fontsize=8, loc="best")
    fig.suptitle(title or "kvtool replay --sweep (simulated)")
    fig.tight_layout()
    save(fig, path, field="plot", dpi=110)


__all__ = ["LOAD_KINDS", "SCHEMA", "ServingSettings", "parse_sweep", "run_serving",
           "sweep_rows", "write_csv", "write_plot"]
