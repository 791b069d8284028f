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
* for each: ``mean_``, ``median_``, ``std_``, ``p90_`` and ``p99_`` (numpy's linear
  percentile, as vLLM computes them).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

PERCENTILES: tuple[int, ...] = (90, 99)
METRICS: tuple[str, ...] = ("ttft", "tpot", "itl", "e2el")


def _stats(name: str, values_ms: np.ndarray) -> dict[str, float]:
    out: dict[str, float] = {}
    if values_ms.size == 0:
        out[f"mean_{name}_ms"] = 0.0
        out[f"median_{name}_ms"] = 0.0
        out[f"std_{name}_ms"] = 0.0
        for p in PERCENTILES:
            out[f"p{p}_{name}_ms"] = 0.0
        return out
    out[f"mean_{name}_ms"] = float(np.mean(values_ms))
    out[f"median_{name}_ms"] = float(np.median(values_ms))
    out[f"std_{name}_ms"] = float(np.std(values_ms))
    for p in PERCENTILES:
        out[f"p{p}_{name}_ms"] = float(np.percentile(values_ms, p))
    return out


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
    ttft = np.asarray(ttft_s, dtype=float) * 1000.0
    e2el = np.asarray(e2el_s, dtype=float) * 1000.0
    outs = np.asarray(output_tokens, dtype=float)
    multi = outs > 1
    tpot = (e2el[multi] - ttft[multi]) / (outs[multi] - 1) if n else np.zeros(0)
    itl = (np.repeat(np.asarray(itl_values_s, dtype=float), np.asarray(itl_counts, dtype=np.int64))
           * 1000.0) if len(itl_values_s) else np.zeros(0)
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
    doc.update(_stats("itl", itl))
    doc.update(_stats("e2el", e2el))
    doc["basis"] = "simulated"
    return doc
