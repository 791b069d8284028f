"""Run-to-run spread of a generated workload: the same experiment under N seeds.

``kvtool experiment run NAME --seeds N`` generates the workload with seeds ``s, s+1, …,
s+N−1`` (``s``: the experiment's ``seed``, default 0), runs every configuration on each,
and reports every figure as the mean over the seeds with a 95 % confidence interval of
that mean: the percentile bootstrap (B. Efron, R. Tibshirani, *An Introduction to the
Bootstrap*, 1993, ch. 13) with :data:`RESAMPLES` resamples drawn by a fixed-seed
generator, so the interval is the same on every run of the same results.

With few seeds the interval is narrow-biased (5 seeds give at most 5 distinct values): it
says how much the figure moves with the seed, not a population bound.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

RESAMPLES = 2000
LEVEL = 0.95
METHOD = (f"percentile bootstrap of the mean, {RESAMPLES} resamples, {LEVEL:.0%} interval, "
          "generator seed 0")


def bootstrap_ci(values: Sequence[float], *, level: float = LEVEL, resamples: int = RESAMPLES,
                 seed: int = 0) -> tuple[float, float, float]:
    """(mean, low, high): the mean of ``values`` and its percentile-bootstrap interval."""
    import numpy as np

    x = np.asarray(values, dtype=float)
    if x.size == 0:
        raise ValueError("no values")
    mean = float(x.mean())
    if x.size == 1 or float(x.min()) == float(x.max()):
        return mean, mean, mean
    rng = np.random.default_rng(seed)
    means = x[rng.integers(0, x.size, size=(resamples, x.size))].mean(axis=1)
    alpha = (1.0 - level) / 2.0
    lo, hi = np.quantile(means, [alpha, 1.0 - alpha])
    return mean, float(lo), float(hi)


def summarize(values: Sequence[float | None], seeds: Sequence[int]) -> dict[str, Any]:
    """One figure over the seeds: ``{seeds, values, n, mean, ci95}`` (``mean``/``ci95``
    ``null`` when some seed could not give the figure)."""
    vals = list(values)
    usable = [float(v) for v in vals if v is not None and math.isfinite(v)]
    out: dict[str, Any] = {"seeds": list(seeds), "values": vals, "n": len(usable),
                           "mean": None, "ci95": None}
    if usable and len(usable) == len(vals):
        mean, lo, hi = bootstrap_ci(usable)
        out.update(mean=mean, ci95=[lo, hi])
    return out


def ci_text(summary: dict[str, Any], unit: str) -> str:
    """``mean [low, high]`` for the table (four significant digits)."""
    if summary["mean"] is None:
        return f"n/a ({summary['n']} of {len(summary['values'])} seeds gave a value)"
    lo, hi = summary["ci95"]
    return f"{summary['mean']:.4g} [{lo:.4g}, {hi:.4g}]"


def round_band(results: Sequence[dict[str, Any]], key: str = "token_hit_ratio"
               ) -> tuple[list[int], list[float], list[float], list[float]]:
    """Per round over the seeds' replay documents of one configuration: (rounds, mean,
    low, high) of ``key``, for the rounds every seed has."""
    per_seed = [{r["round"]: r[key] for r in res["rounds"]} for res in results]
    rounds = sorted(set.intersection(*(set(p) for p in per_seed))) if per_seed else []
    mean, lo, hi = [], [], []
    for rnd in rounds:
        m, low, high = bootstrap_ci([p[rnd] for p in per_seed])
        mean.append(m)
        lo.append(low)
        hi.append(high)
    return rounds, mean, lo, hi
