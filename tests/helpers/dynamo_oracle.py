"""NVIDIA Dynamo 1.6.1's offline replay as the oracle of kvtool's ``kv-aware`` router.

Dynamo's own code decides: ``dynamo.replay.run_trace_replay`` runs mocker engines and the
default KV router (Rust, a virtual clock) over a Mooncake trace, and reports every
request's worker and reused tokens. ``pip install ai-dynamo`` fails here (it fetches a
dependency from a host this machine cannot reach), but the two wheels install alone::

    pip download --no-deps ai-dynamo==1.6.1 ai-dynamo-runtime==1.6.1
    python -m venv V && V/bin/pip install --no-deps ai_dynamo_runtime-*.whl ai_dynamo-*.whl \\
        typing_extensions

:func:`dynamo_python` (``tests/helpers/dynamo_venv.py``, shared with the speed benchmark
of issue 40) makes that virtualenv once, under ``/var/tmp/kvtool-dynamo-1.6.1-<key>``
(keyed by the pins, built behind an flock, so parallel sessions share it), and returns its
Python, or the reason it could not (the test skips with it). :func:`dynamo_replay` runs one
replay there (a subprocess) and returns every request's worker and reused tokens.

The comparison (``tests/serving/test_dynamo_router.py``, ``bench/dynamo_router.py``):

* **the same cluster and clock**: engines of ``num_gpu_blocks`` blocks and Dynamo's mocker
  step time (``step_time = "dynamo-mocker"``, :mod:`kvtool.serving.mockerstep`), so the
  router's load terms evolve on the same clock;
* **hit ratios**: Dynamo breaks equal costs at random, so its hit ratio varies from run to
  run; kvtool's (seeded) runs are compared with Dynamo's mean over ``runs`` replays;
* **per-request choices**, two ways: (1) *replayed*: kvtool's router is given Dynamo's
  choice for every request (``KvAwareRouter.assign``), and at each request the test checks
  that Dynamo's choice is among the engines of least kv-aware cost in kvtool's state then —
  the router's formula and its tracked terms, checked one decision at a time; (2) *free*:
  the share of requests on the same worker in a free kvtool run and a Dynamo run, under
  the best relabelling of workers, beside the same share between two Dynamo runs (the
  random tie-breaks make two runs of Dynamo itself differ).
"""

from __future__ import annotations

import itertools
import json
import math
import os
import subprocess
import tempfile
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.helpers.dynamo_venv import QUIET, dynamo_python

__all__ = ["DynamoRun", "KvRun", "cluster_text", "dynamo_python", "dynamo_replay",
           "kvtool_replay", "same_worker"]


_RUNNER = r"""
import json, sys
from dynamo.replay import run_trace_replay
a = json.loads(sys.argv[1])
out = []
for mode, runs in a["modes"]:
    for _ in range(runs):
        r = run_trace_replay(a["trace"], num_workers=a["workers"], router_mode=mode,
                             trace_block_size=a["block_tokens"], capture_per_request=True,
                             extra_engine_args={"engine": {"block_size": a["block_tokens"],
                                                           "num_gpu_blocks": a["blocks"]}})
        out.append({"mode": mode, "ratio": r.summary["prefix_cache_reused_ratio"],
                    "mean_ttft_ms": r.summary["mean_ttft_ms"],
                    "mean_tpot_ms": r.summary["mean_tpot_ms"],
                    "reqs": [[p["arrival_time_ms"], p["input_length"],
                              p["requested_output_length"], p["decode_worker_idx"],
                              p["reused_input_tokens"], p["ttft_ms"], p["e2e_latency_ms"]]
                             for p in r.per_request]})
json.dump(out, open(a["out"], "w"))
"""


@dataclass
class DynamoRun:
    """One Dynamo replay: its token hit ratio (``prefix_cache_reused_ratio``), and per trace
    line the worker and reused tokens."""

    mode: str
    ratio: float
    workers: list[int]
    reused: list[int]
    mean_ttft_ms: float
    mean_tpot_ms: float
    ttft_ms: list[float]
    e2e_ms: list[float]


def dynamo_replay(python: Path, trace: Path, *, workers: int, blocks: int, block_tokens: int,
                  modes: Sequence[tuple[str, int]]) -> list[DynamoRun]:
    """Run Dynamo's offline replay of ``trace`` (Mooncake JSONL) in its virtualenv, once per
    (``round_robin`` | ``kv_router``, runs); per-request records are mapped back to trace
    lines by (arrival, input and output length)."""
    with tempfile.TemporaryDirectory(prefix="kvtool-dynamo-") as tmp:
        out = Path(tmp) / "out.json"
        args = {"trace": str(trace), "workers": workers, "blocks": blocks,
                "block_tokens": block_tokens, "modes": list(modes), "out": str(out)}
        env = dict(os.environ, **QUIET)
        proc = subprocess.run([str(python), "-c", _RUNNER, json.dumps(args)],
                              capture_output=True, text=True, timeout=1800, env=env,
                              check=False)
        if proc.returncode != 0:
            tail = " | ".join(proc.stderr.strip().splitlines()[-5:])
            raise RuntimeError(f"Dynamo's replay failed: {tail}")
        raw = json.loads(out.read_text())
    lines = [json.loads(x) for x in trace.read_text().splitlines() if x.strip()]
    t0 = lines[0]["timestamp"]
    runs = []
    for r in raw:
        index: dict[tuple[float, int, int], list[int]] = defaultdict(list)
        for i, q in enumerate(lines):
            index[(round(q["timestamp"] - t0, 3), q["input_length"], q["output_length"])].append(i)
        w = [-1] * len(lines)
        hit = [0] * len(lines)
        ttft = [math.nan] * len(lines)
        e2e = [math.nan] * len(lines)
        for t, n, o, worker, reused, first, end in sorted(r["reqs"]):
            i = index[(round(t, 3), n, o)].pop(0)
            w[i], hit[i], ttft[i], e2e[i] = worker, reused, first, end
        runs.append(DynamoRun(r["mode"], r["ratio"], w, hit, r["mean_ttft_ms"],
                              r["mean_tpot_ms"], ttft, e2e))
    return runs


def cluster_text(workers: int, blocks: int, block_tokens: int, router: str,
                 tie_seed: int = 0) -> str:
    """The kvtool cluster file of Dynamo's replay: ``workers`` mocker-clocked engines of
    ``blocks`` blocks (vLLM's scheduler limits as the mocker's: 256 sequences, 8,192 tokens)."""
    text = f'name = "dynamo-{router}"\nblock_tokens = {block_tokens}\n'
    if router == "kv-aware":
        text += f'[router]\nname = "kv-aware"\nseed = {tie_seed}\n'
    else:
        text += f'router = "{router}"\n'
    return text + (f'[[engine]]\ncount = {workers}\ngpu = "h100-sxm"\nmodel = "llama-3-8b"\n'
                   f'num_gpu_blocks = {blocks}\nstep_time = "dynamo-mocker"\n'
                   f'max_num_seqs = 256\nmax_num_batched_tokens = 8192\n')


@dataclass
class KvRun:
    ratio: float
    workers: list[int]
    reused: list[int]
    in_argmin: int | None = None
    """Replayed Dynamo choices: requests whose Dynamo choice was among kvtool's cheapest."""


def kvtool_replay(cluster: Path, trace: Path, *, block_tokens: int,
                  forced: Sequence[int] | None = None, exact_steps: bool = False) -> KvRun:
    """kvtool's serving model on ``cluster`` over ``trace`` at its timestamps; with
    ``forced``, the router sends request ``i`` to engine ``forced[i]`` (Dynamo's choice) and
    counts the requests where that choice was among its least-cost engines."""
    from kvtool.serving.load import Load
    from kvtool.serving.router import KvAwareRouter
    from kvtool.serving.setup import build_setup
    from kvtool.serving.sim import Simulation
    from kvtool.trace import read_trace

    reader = read_trace(str(trace), fmt="mooncake", block_tokens=block_tokens)
    reqs = list(reader)
    built = build_setup(str(cluster), block_tokens=block_tokens)
    router: Any = built.make_router()
    counter = [0]
    if forced is not None:
        assert isinstance(router, KvAwareRouter)
        line = {id(q): i for i, q in enumerate(reqs)}
        base = router

        class Replayed:
            def route(self, request: Any, engines: Sequence[Any], role: str | None = None, *,
                      keys: Sequence[int] | None = None) -> int:
                costs = base.logits(request, engines, role, keys=keys)
                least = min(costs.values())
                want = forced[line[id(request)]]
                counter[0] += costs[want] == least
                return base.assign(request, engines, want, role, keys=keys)

            def prefill_done(self, request: Any, role: str | None = None) -> None:
                base.prefill_done(request, role)

            def finished(self, request: Any, role: str | None = None) -> None:
                base.finished(request, role)

        router = Replayed()
    sim = Simulation(reqs, built.setup, Load("timestamps", 1.0),
                     block_tokens=built.block_tokens, router=router,
                     trace_block_tokens=block_tokens, exact_steps=exact_steps)
    doc = sim.run()
    seqs = [s for s in sim.seqs if s is not None]
    return KvRun(doc["cache"]["token_hit_ratio"], [s.engine for s in seqs],
                 [max(0, s.local_hit_tokens) + s.ext_tokens for s in seqs],
                 counter[0] if forced is not None else None)


def same_worker(a: Sequence[int], b: Sequence[int], workers: int) -> int:
    """Requests placed alike by two runs, under the relabelling of workers that agrees most."""
    counts = [[0] * workers for _ in range(workers)]
    for x, y in zip(a, b, strict=True):
        if x >= 0 and y >= 0:
            counts[x][y] += 1
    return max(sum(counts[i][p] for i, p in enumerate(perm))
               for perm in itertools.permutations(range(workers)))
