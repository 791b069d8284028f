"""The serving report's statistics in Python equal numpy's, bit for bit.

:func:`kvtool.serving.report.describe` computes small samples without numpy (so that a
short ``replay --simulate`` does not import it) and large ones with numpy; both must give
the float64 numpy gives, since vLLM's bench computes these figures with numpy. numpy is
the oracle here: every figure is compared with ``==`` on its repr.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtool.serving import report
from kvtool.serving.report import PERCENTILES, describe, serving_metrics

# times in ms as the model produces them, and values of mixed sign and magnitude (where the
# order of a float sum shows)
FLOATS = st.floats(min_value=-1e12, max_value=1e12, allow_nan=False, allow_infinity=False)
TIMES = st.floats(min_value=0.0, max_value=1e7, allow_nan=False, allow_infinity=False)


def by_numpy(values: list[float]) -> dict[str, float]:
    a = np.asarray(values, dtype=float)
    return {"mean": float(np.mean(a)), "median": float(np.median(a)), "std": float(np.std(a)),
            **{f"p{p}": float(np.percentile(a, p)) for p in PERCENTILES}}


def same(a: dict[str, float], b: dict[str, float]) -> bool:
    return a.keys() == b.keys() and all(repr(a[k]) == repr(b[k]) for k in a)


@pytest.mark.slow
@settings(max_examples=400, deadline=None)
@given(st.lists(FLOATS | TIMES, min_size=1, max_size=700))
def test_python_statistics_equal_numpys(values: list[float]) -> None:
    assert same(describe(values), by_numpy(values))


@pytest.mark.parametrize("n", [1, 2, 7, 8, 9, 15, 16, 17, 127, 128, 129, 135, 136, 137, 255,
                               256, 257, 1000, 1031, 4096, 9999, 65_536])
def test_every_summation_shape_equals_numpys(n: int) -> None:
    """Sizes at numpy's pairwise-summation edges: 8 accumulators from 8 values, blocks of
    128, halves split at multiples of 8; values whose sum depends on the order."""
    rng = np.random.default_rng(n)
    values = (rng.standard_normal(n) * 10.0 ** rng.integers(-6, 12, n)).tolist()
    assert same(describe(values), by_numpy(values))
    times = (rng.random(n) * 1e5).tolist()
    assert same(describe(times), by_numpy(times))


def test_empty_samples_are_zero() -> None:
    assert describe([]) == {"mean": 0.0, "median": 0.0, "std": 0.0,
                            **{f"p{p}": 0.0 for p in PERCENTILES}}


def test_large_samples_go_to_numpy(monkeypatch: pytest.MonkeyPatch) -> None:
    """Above ``SMALL`` values numpy computes them: the same figures."""
    values = (np.random.default_rng(7).random(3000) * 1e4).tolist()
    small = describe(values)
    monkeypatch.setattr(report, "SMALL", 100)
    assert same(describe(values), small)


def old_serving_metrics(*, start: float, end: float, input_tokens: Any, output_tokens: Any,
                        ttft_s: Any, e2el_s: Any, itl_values_s: Any, itl_counts: Any,
                        failed: int = 0) -> dict[str, Any]:
    """``serving_metrics`` as it was written with numpy throughout (until 2026-12-02)."""
    def stats(name: str, v: np.ndarray) -> dict[str, float]:
        if v.size == 0:
            return {f"{k}_{name}_ms": 0.0 for k in ("mean", "median", "std", "p90", "p99")}
        return {f"mean_{name}_ms": float(np.mean(v)), f"median_{name}_ms": float(np.median(v)),
                f"std_{name}_ms": float(np.std(v)),
                **{f"p{p}_{name}_ms": float(np.percentile(v, p)) for p in PERCENTILES}}

    n = len(ttft_s)
    duration = max(0.0, end - start)
    ttft = np.asarray(ttft_s, dtype=float) * 1000.0
    e2el = np.asarray(e2el_s, dtype=float) * 1000.0
    outs = np.asarray(output_tokens, dtype=float)
    multi = outs > 1
    tpot = (e2el[multi] - ttft[multi]) / (outs[multi] - 1) if n else np.zeros(0)
    itl = (np.repeat(np.asarray(itl_values_s, dtype=float), np.asarray(itl_counts, dtype=np.int64))
           * 1000.0) if len(itl_values_s) else np.zeros(0)
    tot_in, tot_out = int(sum(input_tokens)), int(sum(output_tokens))
    per_s = (lambda x: x / duration) if duration > 0 else (lambda x: 0.0)
    doc: dict[str, Any] = {"duration": duration, "completed": n, "failed": failed,
                           "total_input_tokens": tot_in, "total_output_tokens": tot_out,
                           "request_throughput": per_s(n), "output_throughput": per_s(tot_out),
                           "total_token_throughput": per_s(tot_in + tot_out)}
    for name, v in (("ttft", ttft), ("tpot", tpot), ("itl", itl), ("e2el", e2el)):
        doc.update(stats(name, v))
    doc["basis"] = "simulated"
    return doc


REQUEST = st.tuples(st.integers(1, 100_000), st.integers(1, 400),
                    st.floats(0.0, 100.0), st.floats(0.0, 1000.0))


@pytest.mark.slow
@settings(max_examples=200, deadline=None)
@given(st.lists(REQUEST, max_size=60), st.lists(st.tuples(st.floats(0.0, 1.0),
                                                          st.integers(0, 400)), max_size=40))
def test_serving_metrics_are_the_numpy_documents(requests: list[tuple[int, int, float, float]],
                                                 itl: list[tuple[float, int]]) -> None:
    kwargs: dict[str, Any] = dict(
        start=0.0, end=float(len(requests)), input_tokens=[r[0] for r in requests],
        output_tokens=[r[1] for r in requests], ttft_s=[r[2] for r in requests],
        e2el_s=[r[2] + r[3] for r in requests], itl_values_s=[v for v, _ in itl],
        itl_counts=[c for _, c in itl], failed=1)
    new, old = serving_metrics(**kwargs), old_serving_metrics(**kwargs)
    assert new.keys() == old.keys()
    for k in new:
        assert repr(new[k]) == repr(old[k]) or (isinstance(new[k], float)
                                                and math.isnan(new[k]) and math.isnan(old[k])), k


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(TIMES | FLOATS, st.integers(0, 50)), min_size=1, max_size=300))
def test_weighted_statistics_are_numpys_of_the_expanded_sample(
        pairs: list[tuple[float, int]]) -> None:
    """Inter-token gaps with counts, described without expanding them: the median and the
    percentiles are numpy's of the expanded sample bit for bit, mean and std within 1e-12
    (numpy sums pairwise, kvtool with one rounding)."""
    values, counts = [v for v, _ in pairs], [c for _, c in pairs]
    expanded = [v for v, c in pairs for _ in range(c)]
    if not expanded:
        return
    old = report.SMALL
    try:
        report.SMALL = 0  # always the weighted path (the expanded sample is small here)
        got = report.describe_weighted(values, counts)
    finally:
        report.SMALL = old
    want = by_numpy(expanded)
    for k in ("median", *(f"p{p}" for p in PERCENTILES)):
        assert repr(got[k]) == repr(want[k]), k
    scale = max(abs(v) for v in expanded) or 1.0
    for k in ("mean", "std"):
        assert math.isclose(got[k], want[k], rel_tol=1e-12, abs_tol=1e-12 * scale), k
    assert same(report.describe_weighted(values, counts), describe(expanded))


def test_weighted_statistics_with_and_without_numpy_loaded(monkeypatch: pytest.MonkeyPatch
                                                            ) -> None:
    """The weighted path uses numpy only when something loaded it: the same floats."""
    rng = np.random.default_rng(3)
    values = (rng.random(5000) * 80.0).tolist() + [1.5] * 10
    counts = rng.integers(1, 40, 5010).tolist()
    with_np = report.describe_weighted(values, counts)
    monkeypatch.delitem(__import__("sys").modules, "numpy")
    assert same(report.describe_weighted(values, counts), with_np)
