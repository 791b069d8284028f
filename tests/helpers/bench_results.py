"""The ``vllm bench serve`` result files under ``fixtures/vllm-bench/``: written by kvtool's
own serving model at known scalars (never measurements), for ``kvtool calibrate``'s
examples and tests.

Regenerate them (after a change to the serving model) with
``python -m tests.helpers.bench_results``; ``tests/serving/test_calibrate.py`` checks that
they equal a fresh model run.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from kvtool.serving.calibrate import model_bench_result

REPO = Path(__file__).resolve().parents[2]
CLUSTER = "fixtures/clusters/a100-llama2.toml"
DIRECTORY = REPO / "fixtures" / "vllm-bench"
#: The scalars the fixtures were written at (``mfu_decode`` and ``op_latency_s`` keep
#: their defaults).
TRUTH: dict[str, float] = {"mfu_prefill": 0.55, "eta": 0.7, "c0_s": 0.002}
#: name → (requests, input tokens, output tokens, max_concurrency, request_rate).
RUNS: dict[str, tuple[int, int, int, int | None, float]] = {
    "a100-llama2-c1": (8, 512, 32, 1, math.inf),
    "a100-llama2-c4": (12, 1024, 32, 4, math.inf),
    "a100-llama2-c16": (32, 256, 64, 16, math.inf),
    "a100-llama2-rate4": (16, 768, 48, None, 4.0),
}


def result(name: str) -> dict[str, Any]:
    """The fixture ``name`` as the model writes it now."""
    n, n_in, n_out, conc, rate = RUNS[name]
    return model_bench_result(str(REPO / CLUSTER), [n_in] * n, [n_out] * n,
                              max_concurrency=conc, request_rate=rate, scalars=TRUTH,
                              label=name, cluster_name=CLUSTER)


def write_all() -> None:
    DIRECTORY.mkdir(parents=True, exist_ok=True)
    for name in RUNS:
        (DIRECTORY / f"{name}.json").write_text(json.dumps(result(name)) + "\n")


if __name__ == "__main__":
    write_all()
