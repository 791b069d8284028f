"""The ``serving`` report: vLLM bench's own names over simulated request timings.

Every figure here is **simulated**: times come from the serving model's clock (roofline
step times, flows over links), never from a wall clock. The names and their definitions
follow ``vllm bench serve --save-result`` (vllm/benchmarks/serve.py):

* ``duration``: from the first arrival to the last completion, seconds;
* ``completed``; ``request_throughput`` (req/s), ``output_throughput`` and
  ``total_token_throughput`` (tokens/s, the latter input + output) over ``duration``;
* ``ttft_ms``: arrival → first token; ``tpot_ms``: (e2el − ttft) / (output − 1), for requests
  with more than one output token; ``itl_ms``: every gap between two tokens of a request;
  ``e2el_ms``: arrival → last token;
* for each: ``mean_``, ``median_``, ``std_``, ``p90_`` and ``p99_`` (numpy's ``mean``,
  ``median``, ``std`` and linear ``percentile``, as vLLM computes them).

numpy computes them for large samples. A small one (up to :data:`SMALL` values, as a short
trace gives) gets the same float64 arithmetic written out here (:func:`describe`): the
pairwise summation of numpy's ``add.reduce``, its median and its linear interpolation, bit
for bit (tests/serving/test_report_stats.py checks them against numpy), so that a short
``replay --simulate`` does not import numpy (0.1 s of start-up, bench/startup.py).

Inter-token latencies come as values with counts (every request of a decode step has the
same gap). Over :data:`SMALL` tokens they are described without expanding them
(:func:`describe_weighted`): the median and percentiles are numpy's of the expanded sample,
bit for bit (the same order statistics and interpolation); the mean and standard deviation
are sums with one rounding (``math.fsum``) where numpy sums pairwise, so they may differ
from numpy's in the last digit or two (tested to 1e-12).
"""

from __future__ import annotations

import bisect
import itertools
import math
import sys
from collections.abc import Sequence
from functools import reduce
from itertools import repeat
from operator import add, mul, sub
from typing import Any

PERCENTILES: tuple[int, ...] = (90, 99)
METRICS: tuple[str, ...] = ("ttft", "tpot", "itl", "e2el")
SMALL = 65_536
"""Samples up to this many values are described in Python, larger ones with numpy."""

_PW_BLOCK = 128
"""numpy's ``PW_BLOCKSIZE``: pairwise summation's leaf size."""


def _pairwise_sum(v: Sequence[float], lo: int, n: int) -> float:
    """numpy's ``DOUBLE_pairwise_sum`` (``loops_utils.h``) over ``v[lo:lo + n]``: under 8
    values one running sum, up to 128 eight running sums combined as a tree, else the two
    halves (split at a multiple of 8) summed apart. (A running sum is ``reduce(add, …)``
    over a slice: the same additions in the same order, in C.)"""
    if n < 8:
        return reduce(add, v[lo:lo + n], 0.0)
    if n <= _PW_BLOCK:
        end = lo + n - n % 8
        r0, r1, r2, r3, r4, r5, r6, r7 = [reduce(add, v[i:end:8]) for i in range(lo, lo + 8)]
        res = ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7))
        for j in range(end, lo + n):
            res += v[j]
        return res
    n2 = n // 2
    n2 -= n2 % 8
    return _pairwise_sum(v, lo, n2) + _pairwise_sum(v, lo + n2, n - n2)


def _mean(v: Sequence[float]) -> float:
    """``np.mean``: ``add.reduce`` from 0.0, divided by the count."""
    return (0.0 + _pairwise_sum(v, 0, len(v))) / len(v)


def _std(v: Sequence[float], m: float | None = None) -> float:
    """``np.std`` (ddof 0): the mean of the squared deviations from the mean (``m``, when
    given), its root."""
    if m is None:
        m = _mean(v)
    d = list(map(sub, v, repeat(m)))
    return math.sqrt(_mean(list(map(mul, d, d))))


def _median(ordered: Sequence[float]) -> float:
    """``np.median`` of sorted values: the middle one, or the mean of the middle two."""
    n = len(ordered)
    h = n // 2
    if n % 2:
        return _mean(ordered[h:h + 1])
    return _mean(ordered[h - 1:h + 1])


def _percentile(ordered: Sequence[float], p: int) -> float:
    """``np.percentile(…, p)`` of sorted values, method "linear": the virtual index
    ``(n - 1) · p/100``, and numpy's ``_lerp`` between its neighbours (from the upper one
    when the weight is at least 0.5)."""
    n = len(ordered)
    virtual = (n - 1) * (p / 100)
    if virtual >= n - 1:
        prev = nxt = n - 1
        gamma = virtual + 1  # numpy's index -1 for the last value; a, b equal anyway
    else:
        prev = math.floor(virtual)
        nxt = prev + 1
        gamma = virtual - prev
    a, b = ordered[prev], ordered[nxt]
    diff = b - a
    if gamma >= 0.5:
        return b - diff * (1 - gamma)
    return a + diff * gamma


def describe(values: Sequence[float]) -> dict[str, float]:
    """``mean``, ``median``, ``std`` and ``p90``, ``p99`` (:data:`PERCENTILES`) of
    ``values`` as numpy computes them; all 0.0 for no values."""
    if not len(values):
        return {"mean": 0.0, "median": 0.0, "std": 0.0, **{f"p{p}": 0.0 for p in PERCENTILES}}
    if len(values) > SMALL:
        import numpy as np  # only for large samples: 0.1 s of start-up

        a = np.asarray(values, dtype=float)
        return {"mean": float(np.mean(a)), "median": float(np.median(a)),
                "std": float(np.std(a)),
                **{f"p{p}": float(np.percentile(a, p)) for p in PERCENTILES}}
    v = list(map(float, values))
    ordered = sorted(v)
    m = _mean(v)
    return {"mean": m, "median": _median(ordered), "std": _std(v, m),
            **{f"p{p}": _percentile(ordered, p) for p in PERCENTILES}}


def describe_weighted(values: Sequence[float], counts: Sequence[int]) -> dict[str, float]:
    """:func:`describe` of the sample where ``values[i]`` occurs ``counts[i]`` times, without
    expanding it (module docstring). Up to :data:`SMALL` values it is :func:`describe` of the
    expanded sample, bit for bit."""
    n = sum(counts)
    if n <= SMALL:
        return describe([float(v) for v, c in zip(values, counts, strict=True)
                         for _ in range(c)])
    np = sys.modules.get("numpy")
    if np is not None:  # already loaded (a long run loads it): the same floats, faster
        va = np.asarray(values, dtype=np.float64)
        ca = np.asarray(counts, dtype=np.int64)
        mean = math.fsum((va * ca).tolist()) / n
        d = va - mean
        var = math.fsum((d * d * ca).tolist()) / n
        order_a = np.argsort(va, kind="stable")
        vs: list[float] = va[order_a].tolist()
        order: Sequence[int] = range(len(vs))
        ends: Sequence[int] = np.cumsum(ca[order_a]).tolist()
    else:
        if len(values) != len(counts):
            raise ValueError("values and counts differ in length")
        vs = list(map(float, values))
        # the same products and squares as a loop would make (fsum rounds once: any order)
        mean = math.fsum(map(mul, vs, counts)) / n
        dev = list(map(sub, vs, repeat(mean)))
        var = math.fsum(map(mul, map(mul, dev, dev), counts)) / n
        order = sorted(range(len(vs)), key=vs.__getitem__)
        ends = list(itertools.accumulate(map(counts.__getitem__, order)))

    def at(rank: int) -> float:  # the expanded sample's value at 0-based ``rank``
        return vs[order[bisect.bisect_right(ends, rank)]]

    h = n // 2
    median = at(h) if n % 2 else (at(h - 1) + at(h)) / 2

    def pct(p: int) -> float:  # _percentile's virtual index and interpolation
        virtual = (n - 1) * (p / 100)
        if virtual >= n - 1:
            return at(n - 1)
        prev = math.floor(virtual)
        gamma = virtual - prev
        a, b = at(prev), at(prev + 1)
        diff = b - a
        if gamma >= 0.5:
            return b - diff * (1 - gamma)
        return a + diff * gamma

    return {"mean": mean, "median": median, "std": math.sqrt(var),
            **{f"p{p}": pct(p) for p in PERCENTILES}}


def _stats(name: str, values_ms: Sequence[float]) -> dict[str, float]:
    return {f"{k}_{name}_ms": x for k, x in describe(values_ms).items()}


def serving_metrics(*, start: float, end: float, input_tokens: Sequence[int],
                    output_tokens: Sequence[int], ttft_s: Sequence[float],
                    e2el_s: Sequence[float], itl_values_s: Sequence[float],
                    itl_counts: Sequence[int], failed: int = 0) -> dict[str, Any]:
    """The ``serving`` object of completed requests (lists are per completed request;
    ``itl_values_s[k]`` occurred ``itl_counts[k]`` times)."""
    n = len(ttft_s)
    duration = max(0.0, end - start)
    tot_in = int(sum(input_tokens))
    tot_out = int(sum(output_tokens))
    ttft = [float(t) * 1000.0 for t in ttft_s]
    e2el = [float(t) * 1000.0 for t in e2el_s]
    tpot = [(e - t) / (float(o) - 1) for t, e, o in zip(ttft, e2el, output_tokens, strict=True)
            if o > 1]
    per_s = (lambda x: x / duration) if duration > 0 else (lambda x: 0.0)
    doc: dict[str, Any] = {
        "duration": duration,
        "completed": n,
        "failed": failed,
        "total_input_tokens": tot_in,
        "total_output_tokens": tot_out,
        "request_throughput": per_s(n),
        "output_throughput": per_s(tot_out),
        "total_token_throughput": per_s(tot_in + tot_out),
    }
    doc.update(_stats("ttft", ttft))
    doc.update(_stats("tpot", tpot))
    doc.update({f"{k}_itl_ms": x for k, x in describe_weighted(
        [float(v) * 1000.0 for v in itl_values_s], itl_counts).items()})
    doc.update(_stats("e2el", e2el))
    doc["basis"] = "simulated"
    return doc
