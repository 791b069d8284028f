"""Is a row's ``differs`` specific? It must name what makes kvtool's figure differ.

A row whose figure is more than 2× from the published one (issue 38's bar) must say why in
a way a reader can act on: it names

* **a parameter** in backquotes — a key of the cluster file (``mfu_prefill`` and the
  other roofline scalars, ``num_gpu_blocks``, ``[connector] lookup_ms``, ...) or of the
  experiment's workload (``input_lengths``, ``reuse_share``, ...): the input to change, or
  whose published value is missing; or
* **a missing mechanism**: ``not modelled: NAME`` with a NAME of :data:`MECHANISMS`, what
  the model does not have.

:func:`named` returns what a text names (empty when nothing), and :func:`factor` how far
a figure is from its published number or band; tests/experiments/test_serving_experiments.py
applies both to every experiment's modelled rows.
"""

from __future__ import annotations

import math
import re
from typing import Any

MECHANISMS: dict[str, str] = {
    "run-to-run noise": "the model is deterministic: a real cluster's repeated runs differ",
    "engine-side variation": "engines that differ from run to run (clocks, kernels, "
                             "stragglers); the model's identical engines do not",
    "kernel-level GPU sharing": "engines sharing cards (share_gpus) take turns by whole "
                                "steps; real cards interleave their kernels",
}
"""Mechanisms the serving model does not have, by the name a ``differs`` gives them."""

_DIFFERENCES = ("pct_range", "max_diff_pct")
"""``serving_ratio_span`` statistics that are differences in % (compared as ratios)."""
_BACKQUOTED = re.compile(r"`([^`]+)`")


def parameter_names() -> set[str]:
    """Every name a ``differs`` may give as a parameter: cluster-file keys (with their
    table, ``[connector] gbps``, and bare), roofline scalars, workload keys."""
    from dataclasses import fields

    from kvtool.experiments.spec import WORKLOAD_KEYS
    from kvtool.serving.roofline import Scalars
    from kvtool.serving.topology import CLUSTER_KEYS

    names: set[str] = set()
    for table, keys in CLUSTER_KEYS.items():
        for k in keys:
            names.add(k)
            if table:
                names.add(f"[{table}] {k}")
                names.add(f"{table}.{k}")
    names.update(f.name for f in fields(Scalars))
    for kind in WORKLOAD_KEYS.values():
        names.update(kind)
    names.discard("name")
    names.discard("kind")
    return names


def named(text: str) -> list[str]:
    """The parameters (backquoted) and missing mechanisms (``not modelled: NAME``) that
    ``text`` names."""
    params = parameter_names()
    out = [p for p in _BACKQUOTED.findall(text) if p.strip() in params]
    low = text.lower()
    for name in MECHANISMS:
        if f"not modelled: {name.lower()}" in low:
            out.append(name)
    return out


def comparable(row: dict[str, Any], band: tuple[float, float] | None
               ) -> tuple[float | None, float | None, tuple[float, float] | None]:
    """A row's ``(kvtool, published, band)`` as compared: a difference in % between two
    configurations (``serving_ratio_span``'s ``pct_range`` and ``max_diff_pct``) as the
    ratio it stands for, ``1 + x/100`` (a factor between two differences near 0, or across
    0, would say nothing)."""
    v, published = row.get("kvtool"), row.get("published")
    if row.get("metric") == "serving_ratio_span" and \
            (row.get("args") or {}).get("stat") in _DIFFERENCES:
        def r(x: float | None) -> float | None:
            return None if x is None else 1 + x / 100
        return r(v), r(published), None if band is None else \
            (1 + band[0] / 100, 1 + band[1] / 100)
    return v, published, band


def factor(row: dict[str, Any], band: tuple[float, float] | None) -> float | None:
    """How far kvtool's figure is from the published one, as a factor ≥ 1 (1 inside the
    band; ``inf`` across a sign); None when the row has no number to compare. Differences
    in % compare as ratios (:func:`comparable`)."""
    v, published, band = comparable(row, band)
    if v is None:
        return None
    if band is not None:
        lo, hi = band
        if lo <= v <= hi:
            return 1.0
        target: float = lo if v < lo else hi
    else:
        if published is None:
            return None
        target = float(published)
    if target == 0 or v == 0 or (target > 0) != (v > 0):
        return math.inf
    r = v / target
    return max(r, 1 / r)
