"""One pass of a trace through a real vLLM engine (``kvtool replay TRACE --engine vllm``).

Run by :mod:`kvtool.integrations.engine_replay` as a child process (``python -m
kvtool.integrations.engine_pass JOB.json``), so that every pass is a fresh engine process
(as a restarted server is) and the driver needs no vLLM: the job file says what to run,
the pass writes its result file and prints one JSON line per finished request (progress).

The engine runs in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``; vLLM's engine core in
this process: 2 s to start instead of 15–50 s) with one OpenMP thread unless
``OMP_NUM_THREADS`` says otherwise (reference/real-engines.md: spinning threads slow a
shared box 10–40×). Requests are released by :class:`kvtool.serving.load.Arrivals` on
the wall clock — the trace's timestamps, a Poisson rate, or a closed loop of users each
sending a session's rounds in turn — and the engine is stepped; each step's outputs give
the first-token and finish times (measured). Greedy sampling of exactly the trace's
output length (``ignore_eos``), so two passes can be compared token for token.
"""

from __future__ import annotations

import heapq
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np


def prompt_tokens(block_keys: list[int], input_length: int, block_tokens: int, vocab: int,
                  line: int, cache: dict[int, np.ndarray]) -> list[int]:
    """The token ids a request's prompt is made of: block ``i`` is a deterministic
    function of its key (so equal prefixes are equal token sequences); tokens past the
    last key are the request's own (its line and position)."""
    out: list[np.ndarray] = []
    need = input_length
    for key in block_keys:
        if need <= 0:
            break
        toks = cache.get(key)
        if toks is None:
            rng = np.random.Generator(np.random.PCG64(key & ((1 << 64) - 1)))
            toks = cache[key] = rng.integers(1, vocab, size=block_tokens, dtype=np.int64)
        out.append(toks[:need])
        need -= len(out[-1])
    if need > 0:
        rng = np.random.Generator(np.random.PCG64((1 << 63) | line))
        out.append(rng.integers(1, vocab, size=need, dtype=np.int64))
    return np.concatenate(out).tolist() if out else []


def _counters(llm: Any) -> dict[str, Any]:
    """vLLM's own metrics (``llm.get_metrics()``): counters summed over their labels, the
    ``source``-labelled ones by source."""
    out: dict[str, Any] = {}
    for m in llm.get_metrics():
        value = getattr(m, "value", None)
        if value is None or not isinstance(value, int | float):
            continue
        source = (getattr(m, "labels", None) or {}).get("source")
        if source is not None:
            out.setdefault(m.name, {})[source] = out.get(m.name, {}).get(source, 0) + value
        else:
            out[m.name] = out.get(m.name, 0) + value
    return out


def run(job: dict[str, Any], on_done: Callable[[int], None] | None = None) -> dict[str, Any]:
    """Run the pass ``job`` describes (module docstring); its result document.
    ``on_done(i)`` hears of each request that finishes (its index in the trace)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from kvtool.serving.load import Arrivals, Load
    from kvtool.trace import read_trace

    reader = read_trace(job["trace"], fmt=job["fmt"], block_tokens=job["trace_block_tokens"],
                        skip_bad=job["skip_bad"])
    reqs = list(reader)
    from kvtool.integrations.torchextras import hide_unloadable

    hidden = hide_unloadable()  # before vLLM imports transformers
    import vllm
    from vllm import LLM

    B = job["block_tokens"]
    vocab = job["vocab"]
    cache: dict[int, np.ndarray] = {}
    prompts = [prompt_tokens(r.block_keys, r.input_length, r.block_tokens, vocab, r.line,
                             cache) for r in reqs]
    cache.clear()
    kv = None
    if job.get("connector") is not None:
        kv = {"kv_connector": "KvtoolConnector",
              "kv_connector_module_path": "kvtool.integrations.vllm",
              "kv_role": "kv_both", "kv_connector_extra_config": job["connector"]}
    t_init = time.perf_counter()
    llm = LLM(model=job["model"], dtype=job.get("dtype", "auto"), skip_tokenizer_init=True,
              enable_prefix_caching=True,
              kv_cache_memory_bytes=int(job["gpu_bytes"]), enforce_eager=True,
              seed=job["seed"], disable_log_stats=False, max_model_len=job["max_model_len"],
              block_size=B, kv_transfer_config=kv)
    init_s = time.perf_counter() - t_init
    engine = llm.llm_engine
    load = Load(job["load"]["kind"], float(job["load"]["value"]), seed=job["load"]["seed"])
    times = _drive(engine, reqs, prompts, Arrivals(reqs, load), job["seed"], on_done)
    counters = _counters(llm)
    connector = None
    if kv is not None:
        from kvtool.integrations.vllm import close_stores, store_reports

        reports = store_reports()
        connector = reports[0] if reports else None
        close_stores()
    cfg = engine.vllm_config
    info = {"name": "vllm", "version": vllm.__version__, "model": job["model"],
            "block_size": B, "num_gpu_blocks": int(cfg.cache_config.num_gpu_blocks or 0),
            "kv_cache_bytes": int(job["gpu_bytes"]), "max_model_len": job["max_model_len"],
            "init_s": init_s, "omp_threads": os.environ.get("OMP_NUM_THREADS"),
            "hidden_packages": hidden}
    with _quiet():
        engine.engine_core.shutdown()
    return {"engine": info, "wall_s": times.wall, "arrive_s": times.arrive,
            "first_token_s": times.first, "finish_s": times.finish, "itl_s": times.itl,
            "cached_tokens": times.cached,
            "input_tokens": [r.input_length for r in reqs],
            "output_tokens": [len(t) for t in times.tokens],
            "tokens": times.tokens if job.get("keep_tokens") else None,
            "vllm": counters, "connector": connector}


@dataclass
class _Times:
    """What a pass measured, per request (index in the trace): seconds from its start."""

    arrive: list[float]
    first: list[float]
    finish: list[float]
    itl: list[list[float]]
    """Inter-token latencies: the gap before each token after the first."""
    tokens: list[list[int]]
    """The token ids generated."""
    cached: list[int]
    """Prompt tokens vLLM found cached (its pool, or loaded by the connector)."""
    wall: float = 0.0


def _drive(engine: Any, reqs: list[Any], prompts: list[list[int]], arrivals: Any, seed: int,
           on_done: Callable[[int], None] | None) -> _Times:
    """Release the requests to ``engine`` as ``arrivals`` says, on the wall clock, and step
    it until every one has finished; what each step's outputs tell."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    pending: list[tuple[float, int]] = list(arrivals.initial())
    heapq.heapify(pending)
    n = len(reqs)
    out = _Times(arrive=[0.0] * n, first=[0.0] * n, finish=[0.0] * n,
                 itl=[[] for _ in range(n)], tokens=[[] for _ in range(n)], cached=[0] * n)
    arrive, first, finish, itl = out.arrive, out.first, out.finish, out.itl
    last_t = [0.0] * n
    ntok = [0] * n
    running: set[int] = set()
    t0 = time.perf_counter()
    while pending or running:
        now = time.perf_counter() - t0
        while pending and pending[0][0] <= now:
            t, i = heapq.heappop(pending)
            r = reqs[i]
            sp = SamplingParams(max_tokens=max(1, r.output_length),
                                min_tokens=max(1, r.output_length), temperature=0.0,
                                ignore_eos=True, detokenize=False, seed=seed)
            engine.add_request(str(i), TokensPrompt(prompt_token_ids=prompts[i]), sp)
            arrive[i] = max(t, 0.0)
            running.add(i)
        if not running:
            time.sleep(max(0.0, pending[0][0] - (time.perf_counter() - t0)))
            continue
        outs = engine.step()
        now = time.perf_counter() - t0
        for o in outs:
            i = int(o.request_id)
            got = len(o.outputs[0].token_ids) if o.outputs else 0
            if got > ntok[i]:
                if ntok[i] == 0:
                    first[i] = now
                else:
                    # tokens of one step arrive together: the first gap, then 0s
                    itl[i].append(now - last_t[i])
                    itl[i].extend([0.0] * (got - ntok[i] - 1))
                last_t[i] = now
                ntok[i] = got
            if o.finished:
                finish[i] = now
                out.tokens[i] = list(o.outputs[0].token_ids)
                out.cached[i] = int(o.num_cached_tokens or 0)
                running.discard(i)
                for item in arrivals.on_finish(i, now):
                    heapq.heappush(pending, item)
                if on_done is not None:
                    on_done(i)
    out.wall = time.perf_counter() - t0
    return out


class _quiet:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> bool:
        return True  # a failing shutdown must not lose the pass's result


def main(argv: list[str], on_done: Callable[[int], None] | None = None) -> int:
    job = json.loads(Path(argv[0]).read_text())
    result = run(job, on_done)
    Path(job["out"]).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    # The program, not the library: one JSON line per finished request on its stdout is
    # the progress kvtool.integrations.engine_replay reads.
    raise SystemExit(main(sys.argv[1:],
                          lambda i: print(json.dumps({"done": i}), flush=True)))
