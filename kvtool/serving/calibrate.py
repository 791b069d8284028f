"""Calibration: fit the roofline's scalars to ``vllm bench serve --save-result`` files.

A result file is one run of ``vllm bench serve`` (vLLM 0.33.0,
``vllm/benchmarks/serve.py``): its settings (``num_prompts``, ``request_rate``,
``burstiness``, ``max_concurrency``, ``model_id``), its metrics under vLLM's names
(``mean_ttft_ms``, ``output_throughput``, ...) and, when saved with ``--save-detailed``,
per-request lists (``input_lens``, ``output_lens``, ``ttfts``, ``start_times``, ...).
``--append-result`` files hold one JSON document per line; each line is a run.
:func:`read_bench_results` reads them; a bad file is an :class:`InputError` naming the
file, the line and the field.

Each run defines a **workload** the model replays (:meth:`BenchRun.workload`):

* requests: the per-request ``input_lens``/``output_lens`` when the file has them (failed
  requests, ``output_lens == 0``, left out), else ``completed`` requests of the mean
  lengths ``total_input_tokens / completed`` and ``total_output_tokens / completed``
  (vLLM's ``random`` dataset: fixed lengths); random prompts, no prefix shared between
  requests (every block key is unique);
* load: ``max_concurrency`` C with ``request_rate`` inf is the model's closed loop of C
  users (each request its own session); no ``max_concurrency`` and ``request_rate`` inf
  sends everything at ``t = 0``; a finite rate replays the file's ``start_times`` (the
  send times vLLM recorded) when it has them, else Poisson arrivals at that rate (kvtool's
  seed, not vLLM's; only for ``burstiness`` 1 and no ``max_concurrency``).

:func:`calibrate` finds the scalars (``mfu_prefill``, ``mfu_decode``, ``eta``, ``c0_s``,
or the subset asked for) that minimise the mean squared log-ratio of the model's metrics
to the files' (default: mean TTFT, mean TPOT, output throughput), with Nelder–Mead
(:func:`nelder_mead`, derivative-free, numpy only) on a box: each scalar is searched on a
log scale between its bounds (:data:`BOUNDS`). It reports the fitted scalars, the error
on the fitted files, a per-scalar sensitivity (which scalars these files pin down), and
the **held-out** MAPE per metric: leave-one-out (each file predicted by a fit to the
others) or k-fold. Fitted scalars are labelled ``fitted``; the model's figures
``simulated``; the files' ``measured`` (whatever the files say).

:func:`model_bench_result` writes a run of kvtool's own model in the same JSON format,
labelled ``kvtool_basis = "simulated"``: the tests fit files written at known scalars and
check that the fit recovers them.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np

from kvtool.configfile import JsonLocator, field_name
from kvtool.errors import InputError, UsageError, param
from kvtool.serving.load import Load

SCHEMA = "kvtool.calibrate/1"

#: The scalars a fit may move, in this order.
FIT_SCALARS: tuple[str, ...] = ("mfu_prefill", "mfu_decode", "eta", "c0_s")
#: Search box per scalar (searched on a log scale). MFU and eta are fractions of a peak
#: (``(0, 1]`` in :class:`~kvtool.serving.roofline.Scalars`), floored at 1 % (5 % for
#: eta) so the log scale is finite; c0 from 1 µs (nothing) to 100 ms (far beyond any
#: step overhead vLLM reports).
BOUNDS: dict[str, tuple[float, float]] = {
    "mfu_prefill": (0.01, 1.0),
    "mfu_decode": (0.01, 1.0),
    "eta": (0.05, 1.0),
    "c0_s": (1e-6, 0.1),
}
#: The metrics a fit compares by default (vLLM's names).
DEFAULT_METRICS: tuple[str, ...] = ("mean_ttft_ms", "mean_tpot_ms", "output_throughput")
#: Metrics a fit may use: vLLM's summary metrics the model also reports.
FIT_METRICS: tuple[str, ...] = (
    "duration", "request_throughput", "output_throughput", "total_token_throughput",
    *(f"{s}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el")
      for s in ("mean", "median", "p90", "p99")),
)
#: Relative move of each fitted scalar for the sensitivity report.
SENSITIVITY_STEP = 0.10
#: Below this largest metric change (%) for a ±10 % move, a scalar is "not identified".
IDENTIFIED_PCT = 1.0


# ---------------------------------------------------------------- reading result files

@dataclass(frozen=True)
class BenchRun:
    """One ``vllm bench serve`` run read from a result file.

    Invariants: ``input_lens`` and ``output_lens`` have the same length, every output
    length is >= 1 (failed requests are left out and counted in ``failed``); when
    ``start_times`` is not ``None`` it has one entry per kept request.
    """

    source: str
    """``FILE`` or, for a file of several runs (``--append-result``), ``FILE:LINE``."""
    file: str
    line: int | None
    model_id: str | None
    num_prompts: int
    request_rate: float
    burstiness: float
    max_concurrency: int | None
    metrics: dict[str, float]
    input_lens: tuple[int, ...]
    output_lens: tuple[int, ...]
    per_request: bool
    """True: lengths from the file's ``input_lens``/``output_lens``; False: mean lengths."""
    start_times: tuple[float, ...] | None
    failed: int
    basis: str = "measured"
    """``measured`` unless the file says otherwise (``kvtool_basis``)."""

    def load(self) -> Load:
        """The model's load for this run (module docstring)."""
        if math.isinf(self.request_rate):
            if self.max_concurrency is not None:
                return Load("concurrency", float(self.max_concurrency))
            return Load("request-rate", math.inf)
        if self.start_times is not None:
            return Load("timestamps", 1.0)
        return Load("request-rate", self.request_rate)

    def load_text(self) -> str:
        ld = self.load()
        if ld.kind == "timestamps":
            return f"rate {self.request_rate:g}/s at start_times"
        return ld.label

    def workload(self, block_tokens: int) -> list[Any]:
        """The requests the model replays: random prompts, every block key unique."""
        from kvtool.trace.schema import Request

        starts = self.start_times
        t0 = min(starts) if starts else 0.0
        out = []
        key = 1
        for i, (n_in, n_out) in enumerate(zip(self.input_lens, self.output_lens, strict=True)):
            n_keys = -(-n_in // block_tokens)
            ts = (starts[i] - t0) * 1000.0 if starts is not None else 0.0
            out.append(Request(ts, n_in, n_out, list(range(key, key + n_keys)), block_tokens))
            key += n_keys
        return out

    def describe(self) -> dict[str, Any]:
        return {"source": self.source, "model_id": self.model_id, "basis": self.basis,
                "requests": len(self.input_lens), "failed_left_out": self.failed,
                "lengths": "per request" if self.per_request else "mean",
                "mean_input": float(np.mean(self.input_lens)) if self.input_lens else 0.0,
                "mean_output": float(np.mean(self.output_lens)) if self.output_lens else 0.0,
                "load": self.load().to_dict(), "arrivals": self.load_text(),
                "metrics": dict(self.metrics)}


class _Doc:
    """One JSON document of a result file, for errors that name file, line and field."""

    def __init__(self, file: str, text: str, line0: int, data: Any, many: bool) -> None:
        self.file = file
        self.line0 = line0
        self.data = data
        self.many = many
        self.locator = JsonLocator(text)

    def error(self, message: str, *path: str | int) -> InputError:
        line = self.locator.line(path) if path else None
        return InputError(message, file=self.file, line=self.line0 + (line or 1) - 1,
                          field=field_name(path) or None)

    def number(self, key: str, *, required: bool = True, default: float | None = None
               ) -> float | None:
        d = self.data
        if key not in d or d[key] is None:
            if required and default is None:
                raise self.error(f"missing: a vllm bench serve result has {key!r}", key) \
                    if key not in d else self.error("must be a number, got null", key)
            return default
        v = d[key]
        if v == "inf":
            return math.inf
        if isinstance(v, bool) or not isinstance(v, int | float) or math.isnan(v):
            raise self.error(f"must be a number, got {json.dumps(v)[:40]}", key)
        return float(v)

    def integer(self, key: str, *, required: bool = True) -> int | None:
        d = self.data
        if key not in d or d[key] is None:
            if required:
                raise self.error(f"missing: a vllm bench serve result has {key!r}", key)
            return None
        v = d[key]
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise self.error(f"must be a whole number >= 0, got {json.dumps(v)[:40]}", key)
        return v

    def int_list(self, key: str, n: int | None) -> list[int]:
        v = self.data[key]
        if not isinstance(v, list):
            raise self.error("must be a list of whole numbers", key)
        for i, x in enumerate(v):
            if isinstance(x, bool) or not isinstance(x, int) or x < 0:
                raise self.error(f"must be a whole number >= 0, got {json.dumps(x)[:40]}", key, i)
        if n is not None and len(v) != n:
            raise self.error(f"has {len(v)} entries, input_lens has {n}", key)
        return v

    def float_list(self, key: str, n: int) -> list[float]:
        v = self.data[key]
        if not isinstance(v, list) or len(v) != n:
            raise self.error(f"must be a list of {n} numbers (one per request)", key)
        for i, x in enumerate(v):
            if isinstance(x, bool) or not isinstance(x, int | float) or not math.isfinite(x):
                raise self.error(f"must be a number, got {json.dumps(x)[:40]}", key, i)
        return [float(x) for x in v]


def _documents(path: str) -> list[_Doc]:
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InputError("no such file", file=path) from None
    except OSError as exc:
        raise InputError(f"cannot read: {exc.strerror}", file=path) from None
    except UnicodeDecodeError as exc:
        raise InputError(f"not UTF-8 text (byte {exc.start})", file=path) from None
    try:
        return [_Doc(path, text, 1, json.loads(text), False)]
    except json.JSONDecodeError as exc:
        if exc.msg != "Extra data":
            raise InputError(f"invalid JSON: {exc.msg}", file=path, line=exc.lineno) from None
    docs = []  # --append-result: one document per line
    for i, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            docs.append(_Doc(path, line, i, json.loads(line), True))
        except json.JSONDecodeError as exc:
            raise InputError(f"invalid JSON: {exc.msg}", file=path, line=i) from None
    return docs


def _run_from(doc: _Doc) -> BenchRun:
    d = doc.data
    source = f"{doc.file}:{doc.line0}" if doc.many else doc.file
    if not isinstance(d, dict):
        raise InputError("expected a JSON object (a vllm bench serve --save-result file)",
                         file=doc.file, line=doc.line0)
    if d.get("ramp_up_strategy") is not None:
        raise doc.error("a ramp-up run's arrival rate changes over time; the model has no "
                        "such load", "ramp_up_strategy")
    num_prompts = doc.integer("num_prompts")
    completed = doc.integer("completed")
    rate = doc.number("request_rate")
    burst = doc.number("burstiness", required=False, default=1.0)
    conc = doc.integer("max_concurrency", required=False)
    assert num_prompts is not None and completed is not None and rate is not None
    assert burst is not None
    if not rate > 0:
        raise doc.error(f"must be positive or \"inf\", got {rate:g}", "request_rate")
    if conc == 0:
        raise doc.error("must be at least 1", "max_concurrency")
    if completed == 0:
        raise doc.error("no request completed: nothing to compare", "completed")
    metrics: dict[str, float] = {}
    for key in FIT_METRICS:
        v = d.get(key)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
            raise doc.error(f"must be a number, got {json.dumps(v)[:40]}", key)
        metrics[key] = float(v)
    starts: list[float] | None = None
    if "input_lens" in d and "output_lens" in d:
        ins = doc.int_list("input_lens", None)
        outs = doc.int_list("output_lens", len(ins))
        keep = [i for i, o in enumerate(outs) if o > 0]
        if not keep:
            raise doc.error("every request failed (all output lengths are 0)", "output_lens")
        if "start_times" in d and d["start_times"] is not None:
            all_starts = doc.float_list("start_times", len(ins))
            starts = [all_starts[i] for i in keep]
        failed = len(ins) - len(keep)
        ins, outs = [ins[i] for i in keep], [outs[i] for i in keep]
        per_request = True
    else:
        tot_in = doc.integer("total_input_tokens")
        tot_out = doc.integer("total_output_tokens")
        assert tot_in is not None and tot_out is not None
        n_in = round(tot_in / completed)
        n_out = round(tot_out / completed)
        if n_out < 1:
            raise doc.error("the mean output length is under one token", "total_output_tokens")
        ins, outs = [n_in] * completed, [n_out] * completed
        failed = num_prompts - completed if num_prompts > completed else 0
        per_request = False
    finite = not math.isinf(rate)
    if finite and starts is None:
        if conc is not None:
            raise doc.error("a finite request_rate under a concurrency limit needs the send "
                            "times (save with --save-detailed: start_times)", "max_concurrency")
        if burst != 1.0:
            raise doc.error(f"arrivals with burstiness {burst:g} are not Poisson; the model "
                            "replays them from start_times (save with --save-detailed)",
                            "burstiness")
    basis = d.get("kvtool_basis")
    model_id = d.get("model_id")
    return BenchRun(
        source=source, file=doc.file, line=doc.line0 if doc.many else None,
        model_id=model_id if isinstance(model_id, str) else None, num_prompts=num_prompts,
        request_rate=rate, burstiness=burst, max_concurrency=conc, metrics=metrics,
        input_lens=tuple(ins), output_lens=tuple(outs), per_request=per_request,
        start_times=tuple(starts) if starts is not None else None, failed=failed,
        basis=basis if isinstance(basis, str) else "measured")


def read_bench_results(path: str) -> list[BenchRun]:
    """The runs in one ``vllm bench serve --save-result`` (or ``--append-result``) file."""
    return [_run_from(doc) for doc in _documents(path)]


# -------------------------------------------------------- the serving model's side

@dataclass
class _ServingModel:
    """Runs the serving model on result files' workloads at given scalars."""

    cluster: str
    block_tokens: int
    fixed: dict[str, float]
    runs: Sequence[BenchRun]
    _workloads: list[list[Any]] = field(default_factory=list)
    evaluations: int = 0

    def __post_init__(self) -> None:
        self._workloads = [r.workload(self.block_tokens) for r in self.runs]

    def metrics(self, scalars: dict[str, float], indexes: Sequence[int]) -> list[dict[str, Any]]:
        """The model's ``serving`` report of each run in ``indexes`` at ``scalars``."""
        from kvtool.serving.setup import build_setup
        from kvtool.serving.sim import Simulation

        self.evaluations += 1
        built = build_setup(self.cluster, block_tokens=self.block_tokens,
                            scalars={**self.fixed, **scalars})
        out = []
        for i in indexes:
            sim = Simulation(self._workloads[i], built.setup, self.runs[i].load(),
                             block_tokens=built.block_tokens, router=built.make_router(),
                             trace_block_tokens=self.block_tokens)
            out.append(sim.run()["serving"])
        return out


def model_bench_result(cluster: str, input_lens: Sequence[int], output_lens: Sequence[int], *,
                       max_concurrency: int | None = None, request_rate: float = math.inf,
                       scalars: dict[str, float] | None = None, block_tokens: int = 16,
                       seed: int = 0, label: str | None = None,
                       cluster_name: str | None = None) -> dict[str, Any]:
    """A run of kvtool's serving model written as ``vllm bench serve --save-result
    --save-detailed`` writes a run (vLLM 0.33.0's keys).

    Every time in it is **simulated** (``kvtool_basis``); ``kvtool_scalars`` records the
    scalars it ran at. ``start_times`` are the simulated send times (s). Per-request
    ``itls`` are not written: the model keeps inter-token gaps in aggregate only (the
    ``*_itl_ms`` statistics are written). ``cluster_name`` is how the file names the
    cluster (default: ``cluster``).
    """
    if len(input_lens) != len(output_lens) or not input_lens:
        raise UsageError("give one output length per input length (at least one request)",
                         field="output_lens")
    run = BenchRun(source="model", file="model", line=None, model_id=None,
                   num_prompts=len(input_lens), request_rate=request_rate, burstiness=1.0,
                   max_concurrency=max_concurrency, metrics={},
                   input_lens=tuple(input_lens), output_lens=tuple(output_lens),
                   per_request=True, start_times=None, failed=0, basis="simulated")
    ld = run.load()
    from kvtool.serving.setup import build_setup
    from kvtool.serving.sim import Simulation

    built = build_setup(cluster, block_tokens=block_tokens, scalars=dict(scalars or {}))
    sim = Simulation(run.workload(block_tokens), built.setup, Load(ld.kind, ld.value, seed=seed),
                     block_tokens=built.block_tokens, router=built.make_router(),
                     trace_block_tokens=block_tokens)
    serving = sim.run()["serving"]
    seqs = sim.seqs
    ok = [s is not None and s.finish >= 0 for s in seqs]
    model_id = built.setup.engines[0].describe["model"]
    doc: dict[str, Any] = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "endpoint_type": "kvtool-model",
        "backend": "kvtool-model",
        "label": label or "kvtool-model",
        "model_id": model_id,
        "tokenizer_id": model_id,
        "num_prompts": len(input_lens),
        "kvtool_basis": "simulated",
        "kvtool_cluster": cluster_name or cluster,
        "kvtool_scalars": {k: v for k, v in (scalars or {}).items()},
        "request_rate": "inf" if math.isinf(request_rate) else request_rate,
        "burstiness": 1.0,
        "max_concurrency": max_concurrency,
    }
    for key in ("duration", "completed", "failed", "total_input_tokens", "total_output_tokens",
                "request_throughput", "output_throughput", "total_token_throughput"):
        doc[key] = serving[key]
    doc["request_goodput"] = None
    doc["input_lens"] = list(input_lens)
    doc["output_lens"] = [s.num_output if good and s is not None else 0
                          for s, good in zip(seqs, ok, strict=True)]
    doc["ttfts"] = [s.first_token - s.arrival if good and s is not None else 0.0
                    for s, good in zip(seqs, ok, strict=True)]
    doc["latencies"] = [s.finish - s.arrival if good and s is not None else 0.0
                        for s, good in zip(seqs, ok, strict=True)]
    doc["start_times"] = [s.arrival if s is not None else 0.0 for s in seqs]
    doc["errors"] = ["" if good else "the model's KV pool cannot hold this request"
                     for good in ok]
    for m in ("ttft", "tpot", "itl", "e2el"):
        for s in ("mean", "median", "std", "p90", "p99"):
            doc[f"{s}_{m}_ms"] = serving[f"{s}_{m}_ms"]
    return doc


# ---------------------------------------------------------------- the optimiser

def nelder_mead(f: Callable[[np.ndarray], float], x0: np.ndarray, *, step: float = 0.1,
                xtol: float = 1e-3, ftol: float = 1e-8, max_evals: int = 300
                ) -> tuple[np.ndarray, float, int]:
    """Minimise ``f`` over the unit box ``[0, 1]^n`` from ``x0`` (Nelder–Mead, standard
    coefficients 1, 2, ½, ½; points outside the box are projected onto it).

    Stops when the simplex is within ``xtol`` of its best vertex in every coordinate and
    the values within ``ftol``, or after ``max_evals`` evaluations. Returns the best point,
    its value and the evaluations used. Deterministic.
    """
    n = len(x0)
    evals = 0

    def fx(x: np.ndarray) -> float:
        nonlocal evals
        evals += 1
        return float(f(x))

    pts = [np.clip(np.asarray(x0, dtype=float), 0.0, 1.0)]
    for i in range(n):
        p = pts[0].copy()
        p[i] = p[i] + step if p[i] + step <= 1.0 else p[i] - step
        pts.append(p)
    vals = [fx(p) for p in pts]
    while evals < max_evals:
        order = np.argsort(vals, kind="stable")
        pts = [pts[i] for i in order]
        vals = [vals[i] for i in order]
        spread = max(float(np.max(np.abs(p - pts[0]))) for p in pts[1:]) if n else 0.0
        if spread <= xtol and vals[-1] - vals[0] <= ftol:
            break
        centroid = np.mean(pts[:-1], axis=0)
        xr = np.clip(centroid + (centroid - pts[-1]), 0.0, 1.0)
        fr = fx(xr)
        if fr < vals[0]:
            xe = np.clip(centroid + 2.0 * (centroid - pts[-1]), 0.0, 1.0)
            fe = fx(xe)
            pts[-1], vals[-1] = (xe, fe) if fe < fr else (xr, fr)
            continue
        if fr < vals[-2]:
            pts[-1], vals[-1] = xr, fr
            continue
        if fr < vals[-1]:  # outside contraction
            xc = np.clip(centroid + 0.5 * (xr - centroid), 0.0, 1.0)
            fc = fx(xc)
            if fc <= fr:
                pts[-1], vals[-1] = xc, fc
                continue
        else:  # inside contraction
            xc = centroid + 0.5 * (pts[-1] - centroid)
            fc = fx(xc)
            if fc < vals[-1]:
                pts[-1], vals[-1] = xc, fc
                continue
        for i in range(1, n + 1):  # shrink towards the best
            pts[i] = pts[0] + 0.5 * (pts[i] - pts[0])
            vals[i] = fx(pts[i])
    best = int(np.argmin(vals))
    return pts[best], vals[best], evals


def _to_unit(name: str, x: float) -> float:
    lo, hi = BOUNDS[name]
    x = min(max(x, lo), hi)
    return (math.log(x) - math.log(lo)) / (math.log(hi) - math.log(lo))


def _from_unit(name: str, u: float) -> float:
    lo, hi = BOUNDS[name]
    u = min(max(float(u), 0.0), 1.0)
    return math.exp(math.log(lo) + u * (math.log(hi) - math.log(lo)))


# ---------------------------------------------------------------- the fit

@dataclass
class CalibrationSettings:
    """What ``kvtool calibrate`` was asked (typed)."""

    cluster: str
    results: Sequence[str]
    fit: Sequence[str] = FIT_SCALARS
    metrics: Sequence[str] = DEFAULT_METRICS
    folds: int | None = None
    """Held-out validation: ``None`` leave-one-out; k >= 2 k-fold (files in order, file
    ``i`` in fold ``i mod k``); 0 none."""
    block_tokens: int = 16
    """Tokens per block of the replayed workloads (vLLM's default block size)."""
    fixed: dict[str, float] = field(default_factory=dict)
    """Scalars held at these values (not fitted)."""
    max_evals: int = 500
    """Evaluations (each runs the model on every file of the fit) per fit."""


def _residuals(meas: Sequence[BenchRun], modelled: Sequence[dict[str, Any]],
               metrics: Sequence[str]) -> list[float]:
    out = []
    for run, sv in zip(meas, modelled, strict=True):
        for m in metrics:
            y = run.metrics.get(m)
            if y is None or y <= 0:
                continue
            v = float(sv.get(m, 0.0))
            out.append(math.log(v / y) if v > 0 else math.log(1e-9 / y))
    return out


class _Fitter:
    def __init__(self, serving: _ServingModel, names: Sequence[str], metrics: Sequence[str],
                 start: dict[str, float], max_evals: int,
                 progress: Callable[[int], None] | None) -> None:
        self.serving = serving
        self.names = list(names)
        self.metrics = metrics
        self.start = start
        self.max_evals = max_evals
        self.progress = progress

    def scalars(self, u: np.ndarray) -> dict[str, float]:
        return {n: _from_unit(n, float(x)) for n, x in zip(self.names, u, strict=True)}

    def fit(self, indexes: Sequence[int]) -> tuple[dict[str, float], float, int]:
        """``(scalars, loss, evaluations)`` of a fit to the runs ``indexes``."""
        serving = self.serving
        runs = [serving.runs[i] for i in indexes]
        cache: dict[tuple[float, ...], float] = {}

        def loss(u: np.ndarray) -> float:
            key = tuple(round(float(x), 12) for x in u)
            if key not in cache:
                r = _residuals(runs, serving.metrics(self.scalars(u), indexes), self.metrics)
                cache[key] = float(np.mean(np.square(r))) if r else 0.0
                if self.progress is not None:
                    self.progress(1)
            return cache[key]

        u0 = np.array([_to_unit(n, self.start[n]) for n in self.names])
        if not self.names:
            return {}, loss(u0), 1
        u, val, evals = nelder_mead(loss, u0, max_evals=self.max_evals)
        # Restarts from the best point with a fresh simplex: the model's error surface
        # steps a little where events move across step boundaries (an arrival landing in
        # the next step), and Nelder-Mead can settle on such a step inside a long valley
        # (eta against c0). Restart while a restart lowers the loss by at least 10 %.
        while evals < self.max_evals:
            u2, val2, e2 = nelder_mead(loss, u, max_evals=self.max_evals - evals)
            evals += e2
            better = val2 < 0.9 * val
            if val2 < val:
                u, val = u2, val2
            if not better:
                break
        return self.scalars(u), val, evals


def _errors(runs: Sequence[BenchRun], modelled: Sequence[dict[str, Any]],
            metrics: Sequence[str]) -> list[dict[str, Any]]:
    rows = []
    for run, sv in zip(runs, modelled, strict=True):
        per: dict[str, Any] = {}
        for m in metrics:
            y = run.metrics.get(m)
            if y is None or y <= 0:
                continue
            v = float(sv.get(m, 0.0))
            per[m] = {"measured": y, "modelled": v, "error_pct": 100.0 * (v - y) / y}
        rows.append({"source": run.source, "metrics": per})
    return rows


def _mape(rows: Sequence[dict[str, Any]], metrics: Sequence[str]) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    all_errs: list[float] = []
    for m in metrics:
        errs = [abs(r["metrics"][m]["error_pct"]) for r in rows if m in r["metrics"]]
        out[m] = float(np.mean(errs)) if errs else None
        all_errs.extend(errs)
    out["all"] = float(np.mean(all_errs)) if all_errs else None
    return out


def _folds(n: int, folds: int | None) -> tuple[str, list[list[int]]]:
    if folds == 0 or n < 2:
        return "none", []
    if folds is None or folds >= n:
        return "leave-one-out", [[i] for i in range(n)]
    return f"{folds}-fold", [[i for i in range(n) if i % folds == k] for k in range(folds)]


def _checked(s: CalibrationSettings) -> tuple[list[str], list[str]]:
    """Check the settings; the scalars to fit and the metrics to fit them to, each once,
    in the order given."""
    names = list(dict.fromkeys(s.fit))
    for n in names:
        if n not in FIT_SCALARS:
            raise UsageError(f"cannot fit {n!r}: choose from {', '.join(FIT_SCALARS)}",
                             field="fit")
    for n in s.fixed:
        if n in names:
            raise UsageError(f"{n} is both fitted and fixed: drop it from one",
                             field="fit")
    metrics = list(dict.fromkeys(s.metrics))
    if not metrics:
        raise UsageError("give at least one metric", field="metrics")
    for m in metrics:
        if m not in FIT_METRICS:
            raise UsageError(f"unknown metric {m!r}: choose from {', '.join(FIT_METRICS)}",
                             field="metrics")
    if s.folds is not None and (s.folds < 0 or s.folds == 1):
        raise UsageError(f"must be 0 (none) or at least 2, got {s.folds}", field="folds")
    if not s.results:
        raise UsageError("give at least one vllm bench serve result file", field="results")
    return names, metrics


def _sensitivity(serving: _ServingModel, fitted: dict[str, float], names: list[str],
                 metrics: list[str], everything: list[int]) -> dict[str, Any]:
    """Per fitted scalar, the largest metric change (%) when it moves by ±10 %
    (``SENSITIVITY_STEP``) within its bounds, and whether that identifies it."""
    sens: dict[str, Any] = {}
    base_sv = serving.metrics(fitted, everything)
    for n in names:
        worst = 0.0
        for sign in (-1.0, 1.0):
            x = fitted[n] * (1.0 + sign * SENSITIVITY_STEP)
            lo, hi = BOUNDS[n]
            if not lo <= x <= hi:
                continue
            moved = serving.metrics({**fitted, n: x}, everything)
            for a, b in zip(base_sv, moved, strict=True):
                for m in metrics:
                    if a.get(m):
                        worst = max(worst, abs(b[m] - a[m]) / abs(a[m]) * 100.0)
        sens[n] = {"max_change_pct": worst, "identified": worst >= IDENTIFIED_PCT}
    return sens


def calibrate(s: CalibrationSettings, *, progress: Callable[[int], None] | None = None
              ) -> dict[str, Any]:
    """Fit the scalars to the result files; report the fit and its held-out error."""
    from kvtool.serving.setup import build_setup

    names, metrics = _checked(s)
    runs: list[BenchRun] = []
    for path in s.results:
        runs.extend(read_bench_results(path))
    for m in metrics:
        if not any(m in r.metrics and r.metrics[m] > 0 for r in runs):
            raise InputError(f"no file has a positive {m!r}: choose other {param('metrics')}",
                             file=runs[0].file if len(s.results) == 1 else None, field=m)
    built = build_setup(s.cluster, block_tokens=s.block_tokens, scalars=dict(s.fixed))
    base = built.scalars
    default_c0 = built.setup.engines[0].step.c0_s
    start = {"mfu_prefill": base.mfu_prefill, "mfu_decode": base.mfu_decode,
             "eta": base.eta, "c0_s": base.c0_s if base.c0_s is not None else default_c0}
    serving = _ServingModel(s.cluster, s.block_tokens, dict(s.fixed), runs)
    fitter = _Fitter(serving, names, metrics, start, s.max_evals, progress)
    everything = list(range(len(runs)))
    fitted, loss, evals = fitter.fit(everything)
    in_sample = _errors(runs, serving.metrics(fitted, everything), metrics)

    sens = _sensitivity(serving, fitted, names, metrics, everything)
    method, folds = _folds(len(runs), s.folds)
    held_rows: list[dict[str, Any]] = []
    fold_docs = []
    for k, held in enumerate(folds):
        train = [i for i in everything if i not in held]
        sc, fl, ev = fitter.fit(train)
        predicted = serving.metrics(sc, held)
        rows = _errors([runs[i] for i in held], predicted, metrics)
        held_rows.extend(rows)
        fold_docs.append({"fold": k, "held_out": [runs[i].source for i in held],
                          "scalars": sc, "loss": fl, "evaluations": ev})
    return {
        "schema": SCHEMA,
        "cluster": s.cluster,
        "block_tokens": s.block_tokens,
        "files": [r.describe() for r in runs],
        "fit": names,
        "fixed": dict(s.fixed),
        "metrics": metrics,
        "bounds": {n: list(BOUNDS[n]) for n in names},
        "start": {n: start[n] for n in names},
        "scalars": {n: fitted[n] for n in names},
        "scalars_basis": "fitted",
        "optimiser": {"name": "nelder-mead", "space": "log-scaled box", "loss":
                      "mean squared log(modelled / measured)", "value": loss,
                      "evaluations": evals, "runs_per_evaluation": len(runs)},
        "sensitivity": sens,
        "in_sample": {"mape_pct": _mape(in_sample, metrics), "files": in_sample},
        "held_out": {"method": method, "mape_pct": _mape(held_rows, metrics) if held_rows
                     else None, "files": held_rows, "folds": fold_docs},
        "replay_flags": [f"--scalar {n}={_fmt(fitted[n])}" for n in names],
        "basis": {"scalars": "fitted", "modelled": "simulated", "measured":
                  sorted({r.basis for r in runs})},
    }


def _fmt(x: float) -> str:
    return f"{x:.6g}"


def parse_scalar_overrides(items: Sequence[str]) -> dict[str, float]:
    """``["mfu_prefill=0.5", "c0_s=0.002"]`` → overrides of the roofline's scalars."""
    from kvtool.serving.roofline import Scalars

    out: dict[str, float] = {}
    known = list(Scalars.__dataclass_fields__)
    for item in items:
        key, eq, value = item.partition("=")
        key = key.strip().replace("-", "_")
        if not eq or key not in known:
            raise UsageError(f"{item!r}: expected NAME=VALUE with NAME one of "
                             f"{', '.join(known)}", field="scalar")
        try:
            out[key] = float(value)
        except ValueError:
            raise UsageError(f"{item!r}: {value.strip()!r} is not a number",
                             field="scalar") from None
    if out:
        try:
            Scalars(**out)
        except InputError as exc:
            raise UsageError(f"{exc.field}={out.get(exc.field or '', '')}: {exc.message}",
                             field="scalar") from None
    return out


__all__ = ["BOUNDS", "DEFAULT_METRICS", "FIT_METRICS", "FIT_SCALARS", "SCHEMA", "BenchRun",
           "CalibrationSettings", "calibrate", "model_bench_result", "nelder_mead",
           "parse_scalar_overrides", "read_bench_results"]
