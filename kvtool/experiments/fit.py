"""Unpublished workloads, inferred: the workload under which the model reproduces all of a
report's figures at once (``kvtool experiment fit NAME --vary KEY=LO:HI …``).

A report gives its figures but not always the workload behind them (FX100 publishes
throughput and TTFT gains, not its prompts). :func:`fit` searches the workload keys named
with ``--vary`` — prompt length (``input_lengths``, ``input_tokens``), share of reused
prompts (``reuse_share``), output length (``output_tokens``), shared prefix
(``system_prompt_tokens``), sessions, ... — for the setting whose run of the experiment puts
every published figure closest:

* **residual** of a row: ``ln(kvtool / published)`` (0 inside the row's ``band``, else the
  log distance to the band's nearer end); rows without a number are left out;
* **loss**: the mean squared residual, each capped at ``(ln 2)²`` (scale-free: a 10 % miss
  weighs the same on a TTFT and on a throughput; capped, so that claims the others cannot
  be reconciled with are given up rather than dragging every claim off by a bit: the fit
  keeps as many within 2× as it can, then brings those closest);
* besides workload keys, a roofline scalar (``mfu_prefill``, ...) or every engine's KV pool
  (``num_gpu_blocks``) may be varied, for engines whose figures are unpublished
  (``[serving] scalars`` and ``num_gpu_blocks`` in the experiment file);
* **search**: a grid of ``grid`` points per key (log-spaced when ``hi/lo ≥ 4``), then
  Nelder–Mead (:func:`kvtool.serving.calibrate.nelder_mead`) from the best grid point, over
  the unit box of the keys (integers rounded; every setting evaluated once), within
  ``max_evals`` runs;
* ``--loads`` searches at some of a serving experiment's levels only (a long run's levels
  cost time): rows at the other levels, and rows summing up every level, are left out;
* **met**: a row is met when its residual is within ``ln(1 + tolerance)`` (default 1.25×),
  or inside its band. The answer says whether any evaluated setting met every row — and,
  per row, the best it got alone and where, which shows claims that cannot hold together:
  each is met somewhere, never all in one place.

Every figure is the experiment's own (modelled or simulated); a fit says what workload the
*model* needs, not what the report ran. The document is ``kvtool.experiment-fit/1``
(docs/experiments.md).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from kvtool.errors import UsageError
from kvtool.experiments.spec import Experiment, Figure

SCHEMA = "kvtool.experiment-fit/1"
CAP = math.log(2) ** 2
"""A row's share of the loss is capped here: a figure 2× off or more costs the same."""
DEFAULT_TOLERANCE = 0.25


@dataclass(frozen=True)
class Vary:
    """One workload key searched over ``[lo, hi]``."""

    key: str
    lo: float
    hi: float
    integer: bool
    listed: bool = False
    """The workload holds a list (``input_lengths``): the value becomes its one element."""
    scalar: bool = False
    """A roofline scalar of every engine (``[serving] scalars``), not a workload key."""
    engine: bool = False
    """Every engine's KV pool (``[serving] num_gpu_blocks``), not a workload key."""

    @property
    def log(self) -> bool:
        return self.lo > 0 and self.hi / self.lo >= 4

    def at(self, u: float) -> float | int:
        """The value at ``u`` ∈ [0, 1] of the key's axis (log or linear)."""
        u = min(1.0, max(0.0, u))
        if self.log:
            v = math.exp(math.log(self.lo) + u * (math.log(self.hi) - math.log(self.lo)))
        else:
            v = self.lo + u * (self.hi - self.lo)
        return max(int(self.lo), min(int(self.hi), round(v))) if self.integer else v

    def to_dict(self) -> dict[str, Any]:
        return {"key": self.key, "lo": self.lo, "hi": self.hi, "integer": self.integer,
                "scale": "log" if self.log else "linear",
                "what": "roofline scalar" if self.scalar else
                "engine" if self.engine else "workload"}


def parse_vary(text: str, exp: Experiment) -> Vary:
    """``KEY=LO:HI`` for a key of ``exp``'s workload (ints stay ints)."""
    key, eq, rng = text.partition("=")
    key = key.strip()
    lo_s, colon, hi_s = rng.partition(":")
    if not eq or not colon:
        raise UsageError(f"{text!r} is not KEY=LO:HI (example: input_lengths=8000:128000)",
                         field="vary")
    from dataclasses import fields

    from kvtool.experiments.spec import WORKLOAD_KEYS
    from kvtool.serving.roofline import Scalars

    scalars = {f.name for f in fields(Scalars)}
    if key == "num_gpu_blocks":
        if not exp.is_serving:
            raise UsageError(f"{key} is an engine's KV pool: {exp.name} is not a serving "
                             "experiment", field="vary")
        try:
            lo, hi = (float(x) for x in rng.split(":"))
        except ValueError:
            raise UsageError(f"{text!r}: LO and HI must be numbers", field="vary") from None
        if not (2 <= lo <= hi):
            raise UsageError(f"{text!r}: want 2 <= LO <= HI", field="vary")
        return Vary(key, lo, hi, True, engine=True)
    if key in scalars:
        if not exp.is_serving:
            raise UsageError(f"{key} is a roofline scalar: {exp.name} is not a serving "
                             "experiment", field="vary")
        try:
            lo, hi = (float(x) for x in rng.split(":"))
        except ValueError:
            raise UsageError(f"{text!r}: LO and HI must be numbers", field="vary") from None
        if not (0 < lo <= hi):
            raise UsageError(f"{text!r}: want 0 < LO <= HI", field="vary")
        return Vary(key, lo, hi, False, scalar=True)
    allowed = WORKLOAD_KEYS[exp.kind]
    if key not in allowed or key in ("kind", "model", "dtype", "seed", "block_tokens",
                                     "block_bytes"):
        names = sorted(k for k in allowed if k not in ("kind", "model", "dtype", "seed",
                                                       "block_tokens", "block_bytes"))
        raise UsageError(f"{key!r} is not a workload key of {exp.name} (use "
                         f"{', '.join(names)})", field="vary")
    current = exp.workload.get(key)
    listed = allowed[key] is list
    if listed and isinstance(current, list) and len(current) != 1:
        raise UsageError(f"{key} of {exp.name} holds {len(current)} values; --vary sets one",
                         field="vary")
    sample = current[0] if listed and current else current
    integer = allowed[key] is int or listed or (isinstance(sample, int) and \
        not isinstance(sample, bool))
    try:
        lo, hi = float(lo_s), float(hi_s)
    except ValueError:
        raise UsageError(f"{text!r}: LO and HI must be numbers", field="vary") from None
    if not (math.isfinite(lo) and math.isfinite(hi)) or lo > hi or lo < 0:
        raise UsageError(f"{text!r}: want 0 <= LO <= HI", field="vary")
    if key == "reuse_share" and hi > 1:
        raise UsageError(f"{text!r}: a share is at most 1", field="vary")
    return Vary(key, lo, hi, integer, listed)


def residual(row: dict[str, Any], band: tuple[float, float] | None) -> float | None:
    """``ln(kvtool / published)``, 0 inside the band (None: nothing to compare); a
    difference in % compares as the ratio it stands for
    (:func:`kvtool.experiments.differs.comparable`)."""
    from kvtool.experiments.differs import comparable

    v, p, band = comparable(row, band)
    if v is None or not v > 0:
        return None if v is None else -math.inf
    if band is not None:
        lo, hi = band
        if lo <= v <= hi:
            return 0.0
        edge = lo if v < lo else hi
        return math.log(v / edge) if edge > 0 else None
    if p is None or not p > 0:
        return None
    return math.log(v / p)


@dataclass
class Point:
    values: dict[str, float | int]
    rows: list[dict[str, Any]]
    residuals: list[float | None]
    loss: float


def fit(exp: Experiment, varies: list[Vary], *, grid: int = 3, max_evals: int = 40,
        tolerance: float = DEFAULT_TOLERANCE, loads: str | None = None,
        on_point: Callable[[int, Point], None] | None = None) -> dict[str, Any]:
    """Search ``varies`` for the workload that puts ``exp``'s figures closest (module
    docstring); return the ``kvtool.experiment-fit/1`` document. A roofline scalar
    (``mfu_prefill``, ...) may be varied too, for engines whose figures are unpublished."""
    from kvtool.experiments.run import run_experiment
    from kvtool.serving.calibrate import nelder_mead

    exp = _checked(exp, varies, grid=grid, max_evals=max_evals, tolerance=tolerance,
                   loads=loads)
    bands = [f.band for f in exp.figures]
    # a row that sums up every level (serving_ratio_span) says nothing at a subset of them
    scored = [i for i, f in enumerate(exp.figures) if (f.band is not None or f.published)
              and not (loads is not None and f.metric == "serving_ratio_span")]
    if not scored:
        raise UsageError(f"{exp.name} has no figure with a published number to fit",
                         field="NAME")
    cache: dict[tuple[float | int, ...], Point] = {}
    order: list[Point] = []

    def evaluate(u: Any) -> float:
        values = {v.key: v.at(float(x)) for v, x in zip(varies, u, strict=True)}
        key = tuple(values.values())
        point = cache.get(key)
        if point is None:
            try:
                doc = run_experiment(_at(exp, varies, values), out_dir=None, simulate=True)
            except UsageError as err:
                raise UsageError(f"{', '.join(f'{k}={x:g}' for k, x in values.items())}: "
                                 f"{err.message}", field="vary") from None
            res = [residual(doc["rows"][i], bands[i]) for i in range(len(exp.figures))]
            loss = _loss([res[i] for i in scored
                          if doc["rows"][i]["kvtool"] is not None or loads is None])
            point = cache[key] = Point(values, doc["rows"], res, loss)
            order.append(point)
            if on_point is not None:
                on_point(len(order), point)
        return point.loss

    axes = [[k / (grid - 1) if grid > 1 else 0.5 for k in range(grid)] for _v in varies]
    for u in itertools.product(*axes):
        if len(order) >= max_evals:
            break
        evaluate(u)
    best = min(order, key=lambda p: p.loss)
    left = max_evals - len(order)
    if left > len(varies):
        import numpy as np

        x0 = np.array([_unit(v, best.values[v.key]) for v in varies])
        nelder_mead(evaluate, x0, step=0.5 / max(1, grid - 1) if grid > 1 else 0.25,
                    xtol=1e-3, ftol=1e-9, max_evals=left)
        best = min(order, key=lambda p: p.loss)
    limit = math.log1p(tolerance)

    def met(r: float | None) -> bool | None:
        return None if r is None else abs(r) <= limit + 1e-12

    live = [i for i in scored if best.rows[i]["kvtool"] is not None or loads is None]
    every = [p for p in order if all(met(p.residuals[i]) for i in live)]
    rows = [_fit_row(exp.figures[i], i, best, order, met) for i in live]
    return {
        "schema": SCHEMA, "name": exp.name, "title": exp.title, "source": exp.source,
        "vary": [v.to_dict() for v in varies], "fixed": {k: v for k, v in exp.workload.items()
                                                        if k not in {x.key for x in varies}},
        "scalars": dict(exp.serving.get("scalars") or {}),
        "num_gpu_blocks": exp.serving.get("num_gpu_blocks"),
        "tolerance": tolerance, "grid": grid, "max_evals": max_evals,
        "loads": exp.serving.get("loads") if exp.is_serving else None,
        "evaluations": len(order), "loss": best.loss,
        "loss_kind": "mean squared log residual, each capped at (ln 2)^2", "best": dict(best.values),
        "rows": rows, "meets_all": bool(every),
        "meeting": [dict(p.values) for p in every[:10]],
        "verdict": _verdict(bool(every), rows, tolerance),
        "points": [{"at": dict(p.values), "loss": p.loss} for p in order],
        "basis": "the experiment's own figures (modelled or simulated), one run per setting",
    }


def _loss(got: list[float | None]) -> float:
    """The loss of one setting's residuals (module docstring): their mean square, each
    capped at ``CAP``, a row without a finite residual counting as ``CAP``."""
    finite = [r for r in got if r is not None and math.isfinite(r)]
    missing = len(got) - len(finite)
    return (sum(min(r * r, CAP) for r in finite) + CAP * missing) / max(1, len(got))


def _checked(exp: Experiment, varies: list[Vary], *, grid: int, max_evals: int,
             tolerance: float, loads: str | None) -> Experiment:
    """Check :func:`fit`'s arguments; the experiment to search (at ``loads`` only, when
    given)."""
    if not varies:
        raise UsageError("give at least one --vary KEY=LO:HI", field="vary")
    if len({v.key for v in varies}) != len(varies):
        raise UsageError("a key is given twice", field="vary")
    if exp.kind == "parallel-read":
        raise UsageError(f"{exp.name} measures reads: it has no workload to fit", field="NAME")
    if grid < 1 or max_evals < 1 or not tolerance > 0:
        raise UsageError("grid and max_evals must be at least 1, tolerance positive",
                         field="grid")
    if loads is not None:
        # search at these loads only (a long run's levels cost time); rows at the others
        # cannot be computed and are left out of the loss
        if not exp.is_serving:
            raise UsageError("--loads is for serving experiments", field="loads")
        from kvtool.experiments.spec import parse_loads

        parse_loads(loads)
        exp = replace(exp, serving={**exp.serving, "loads": loads})
    return exp


def _at(exp: Experiment, varies: list[Vary], values: dict[str, float | int]) -> Experiment:
    """``exp`` with the varied keys set to ``values``: workload keys, roofline scalars and
    engine keys (``num_gpu_blocks``) each where they belong."""
    workload = dict(exp.workload)
    serving = dict(exp.serving)
    scal = dict(serving.get("scalars") or {})
    for v in varies:
        if v.scalar:
            scal[v.key] = values[v.key]
        elif v.engine:
            serving[v.key] = values[v.key]
        else:
            workload[v.key] = [values[v.key]] if v.listed else values[v.key]
    if scal:
        serving["scalars"] = scal
    return replace(exp, workload=workload, serving=serving)


def _fit_row(f: Figure, i: int, best: Point, order: list[Point],
             met: Callable[[float | None], bool | None]) -> dict[str, Any]:
    """Row ``i`` of the fit's document: figure ``f`` at the best setting, and the best it
    got alone among the points evaluated (``order``)."""
    row = best.rows[i]
    alone = [p for p in order if p.residuals[i] is not None]
    top = min(alone, key=lambda p: abs(p.residuals[i] or 0.0)) if alone else None
    return {
        "claim": f.claim, "published": f.published, "published_text": row["published_text"],
        "band": list(f.band) if f.band else None, "kvtool": row["kvtool"],
        "kvtool_text": row["kvtool_text"], "unit": f.unit, "basis": row["basis"],
        "residual": best.residuals[i], "met": met(best.residuals[i]),
        "best_alone": None if top is None else {
            "residual": top.residuals[i], "met": met(top.residuals[i]),
            "at": dict(top.values)}}


def _unit(v: Vary, value: float) -> float:
    if v.hi == v.lo:
        return 0.5
    if v.log:
        return (math.log(value) - math.log(v.lo)) / (math.log(v.hi) - math.log(v.lo))
    return (value - v.lo) / (v.hi - v.lo)


def _verdict(every: bool, rows: list[dict[str, Any]], tolerance: float) -> str:
    within = f"within {1 + tolerance:g}× (or their bands)"
    if every:
        return f"a setting meets every claim {within}"
    alone = [r for r in rows if r["best_alone"] and r["best_alone"]["met"]]
    never = [r for r in rows if not (r["best_alone"] and r["best_alone"]["met"])]
    if not never:
        return (f"no setting searched meets every claim {within}, though each is met at "
                "some setting: these claims cannot all hold under one workload of this "
                "shape")
    return (f"no setting searched meets every claim {within}: {len(alone)} of {len(rows)} "
            f"are met at some setting, {len(never)} at none ("
            + "; ".join(r["claim"] for r in never[:3])
            + (f"; and {len(never) - 3} more" if len(never) > 3 else "")
            + ")")
