"""The times of a plain ``kvtool replay``: the serving model's one-engine case.

A replay without ``--cluster`` counts hits, puts and evictions with the replay's tier
hierarchy (:mod:`kvtool.cache`), and takes its times — TTFT, each round's wall time,
requests per second — from the serving model (:mod:`kvtool.serving`) run on the same
trace with one engine whose tiers are the replay's:

* the engine: ``gpu`` (default :data:`DEFAULT_GPU`) running the replay's model (its
  ``--model``, else :data:`DEFAULT_MODEL` when only a block size was given), on ``tp``
  GPUs (``--tp``, else the fewest that hold the weights), vLLM's scheduler and defaults
  for that GPU;
* its GPU pool: the replay's GPU tier as vLLM's ``num_gpu_blocks`` plus room for the
  longest request (as data mode's GPU pool; prefix caching on: the hierarchy's GPU tier
  when it decides the hits, the pool's own cache otherwise);
  without a GPU tier, the pool the GPU's memory leaves, with prefix caching off (the
  replay caches nothing there either);
* the tiers below: the replay's DRAM tier (over the GPU's PCIe, or ``read_gbps["dram"]``)
  and NVMe tier (a target of ``read_gbps["nvme"]``, default 5.2 GB/s), each with its
  policy (a watermark is not modelled there);
* the load: a timed trace (Mooncake's) at its timestamps unless ``concurrency`` is
  given; otherwise a closed loop of ``concurrency`` users (default 1) over the trace in
  serve order (``vllm bench serve --max-concurrency`` over a list): a round's requests
  run ``concurrency`` at a time. A round's wall time is from its first arrival to its
  last token.

Every time is **simulated** (roofline step times, flows over links), none measured.

One loop: given the replay's tier hierarchy (``decider``: the replayer, or data mode's,
which moves the bytes), the engine asks it to serve each request in serve order when it
first admits it, then times what it decided: the GPU tier's blocks adopted, the blocks
found below loaded, the rest computed, the puts stored (:mod:`kvtool.serving.serveorder`).
The hits, puts and evictions the report prints are the hierarchy's, the same as a
``--no-times`` replay's; the times are those of the same decisions. Without a decider
(``one_engine_times`` alone) the serving model decides hits itself, with vLLM's prefix
cache and a load-or-recompute choice, as ``--cluster`` runs do.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvtool.cache.replayer import CacheConfig
from kvtool.cache.stats import percentile
from kvtool.errors import UsageError

if TYPE_CHECKING:
    from kvtool.geometry.model import ModelSpec
    from kvtool.serving.load import Load
    from kvtool.serving.roofline import StepModel
    from kvtool.serving.serveorder import Decider
    from kvtool.serving.sim import ClusterSetup, TierSetup, TierStack

DEFAULT_GPU = "h100-sxm"
DEFAULT_MODEL = "llama-3-8b"
DEFAULT_READ_GBPS = {"dram": None, "nvme": 5.2}
"""GB/s of the tiers' paths: DRAM over the GPU's own PCIe (None), NVMe 5.2 (the parallel
read path the FX100 report measured)."""
_NO_POLICY = ("vllm",)


@dataclass
class RequestTimes:
    """One request's simulated times (seconds from the start of the run); ``nan`` when
    the engine could not hold it."""

    arrival: float
    first_token: float
    finish: float

    @property
    def ttft(self) -> float:
        return self.first_token - self.arrival


def lookup_name(model: str) -> str | None:
    """The preset name ``model`` resolves to (``None`` for a file or an unknown name)."""
    from kvtool.geometry.presets import lookup

    try:
        return lookup(model).name
    except Exception:
        return None


def _tp_for(spec: Any, gpu: Any, weight_dtype: str | None) -> int:
    from kvtool.serving.roofline import StepModel

    heads = spec.arch.q_heads
    for tp in (1, 2, 4, 8, 16, 32):
        if heads % tp:
            continue
        step = StepModel(spec, gpu, tp, weight_dtype=weight_dtype)
        if step.weight_bytes_per_rank <= 0.85 * gpu.memory_bytes:
            return tp
    return 32


def one_engine_times(requests: Sequence[Any], cfg: CacheConfig, *, block_tokens: int,
                     block_bytes: int | None, model: str | None, dtype: str | None,
                     tp: int | None, gpu: str | None, concurrency: int | None,
                     read_gbps: dict[str, float], timed: bool = False,
                     exact_steps: bool = False, decider: Decider | None = None,
                     on_decided: Callable[[int], None] | None = None,
                     on_finished: Callable[[int, float], None] | None = None
                     ) -> tuple[list[RequestTimes], dict[str, Any]]:
    """Run the one-engine case (module docstring); return each request's times in serve
    order and a description of the engine (the report's ``time_model``). ``exact_steps``:
    the engine schedules every step on its own (the same times; :mod:`kvtool.serving.engine`).
    ``decider``: the tier hierarchy that decides every hit, in serve order (each request
    decided by the end, ``on_decided(i)`` told after request ``i``, ``on_finished(i,
    ttft)`` when it finished)."""
    from kvtool.serving.gpus import resolve_gpu, vllm_batch_defaults
    from kvtool.serving.load import Load
    from kvtool.serving.roofline import StepModel
    from kvtool.serving.sim import ClusterSetup, EngineSetup

    try:
        g = resolve_gpu(gpu or DEFAULT_GPU)
    except UsageError as exc:
        raise UsageError(exc.message.split(" or define")[0].rstrip(";"),
                         field="engine_gpu") from None
    spec = _engine_model(model)
    t = tp or _tp_for(spec, g, None)
    step = StepModel(spec, g, t, kv_dtype=dtype, block_tokens=block_tokens)
    # what a load or store moves: the replay's block (every rank's copy) when it has one
    kv_block = max(1, round(step.kv_bytes_per_token * block_tokens)) * t
    moved = block_bytes * t if block_bytes else kv_block
    max_tokens, max_seqs = vllm_batch_defaults(g)
    num_gpu_blocks, caching = _gpu_pool(requests, cfg, step, block_tokens=block_tokens,
                                        block_bytes=block_bytes)
    pcie = read_gbps.get("dram") or g.pcie_gbps * t
    nvme_gbps = read_gbps.get("nvme") or DEFAULT_READ_GBPS["nvme"] or math.inf
    tiers = _lower_tiers(cfg, nvme_gbps, block_tokens=block_tokens, block_bytes=block_bytes)
    engine = EngineSetup(name="engine0", node="n0", role="both",
                         num_gpu_blocks=max(2, num_gpu_blocks), block_bytes=moved,
                         pcie_gbps=pcie, step=step, max_num_seqs=max_seqs,
                         max_num_batched_tokens=max_tokens,
                         describe={"model": spec.name, "gpu": g.name, "tp": t, "role": "both"},
                         # with a decider, the hierarchy's GPU tier is the prefix cache
                         enable_caching=caching and decider is None)
    setup = ClusterSetup([engine], {"n0": math.inf}, tiers, "round-robin", {}, name="replay")
    load = (Load("timestamps", 1.0) if timed and concurrency is None else
            Load("concurrency", float(concurrency or 1), by_session=False))
    stack = None
    if decider is not None:
        from kvtool.serving.serveorder import ServeOrderStack

        stack = functools.partial(ServeOrderStack, decider=decider, requests=requests,
                                  on_decided=on_decided, on_finished=on_finished)
    times, doc = _simulate(requests, setup, load, block_tokens=block_tokens,
                           exact_steps=exact_steps, stack=stack)
    described = {
        "kind": "serving model, one engine (docs/replay.md, docs/serving.md)",
        "basis": "simulated",
        "hits": ("the tier hierarchy's, decided in serve order as the engine admits each "
                 "request (kvtool.serving.serveorder)" if decider is not None else
                 "the serving model's own (vLLM's prefix cache, load or recompute)"),
        "gpu": g.name, "model": spec.name, "tp": t,
        "model_note": _model_note(model, spec.name),
        "num_gpu_blocks": engine.num_gpu_blocks, "prefix_caching": caching,
        "max_num_seqs": max_seqs, "max_num_batched_tokens": max_tokens,
        "load": load.label, "concurrency": concurrency if load.kind == "concurrency" else None,
        "pcie_gbps": pcie, "nvme_read_gbps": nvme_gbps,
        "scalars": dataclasses.asdict(step.scalars),
        "failed": doc["serving"]["failed"],
        "serving": doc["serving"],
        "overload": doc["overload"],
    }
    if doc["overload"]["overloaded"]:
        from kvtool.serving.overload import TRY_REPLAY

        described["overload"] = {**doc["overload"], "try": list(TRY_REPLAY)}
    return times, described


def _model_note(model: str | None, used: str) -> str | None:
    """Why the step time is not ``model``'s own (None when it is)."""
    if model is not None and used == lookup_name(model):
        return None
    if model is None:
        return f"no model given: the step time is {used}'s"
    return f"{model} has no parameter counts: the step time is {used}'s"


def _engine_model(model: str | None) -> ModelSpec:
    """The engine's model: ``model`` (a preset or a TOML/JSON file), else
    :data:`DEFAULT_MODEL` where none is given or it has no architecture (a block size
    only)."""
    from kvtool.geometry.presets import lookup

    spec: ModelSpec | None = None
    if model is not None:
        if model.lower().endswith((".toml", ".json")):
            from kvtool.geometry.custom import from_toml

            spec = from_toml(model)
        else:
            spec = lookup(model)
    if spec is None or spec.arch is None:
        spec = lookup(DEFAULT_MODEL)
    return spec


def _gpu_pool(requests: Sequence[Any], cfg: CacheConfig, step: StepModel, *, block_tokens: int,
              block_bytes: int | None) -> tuple[int, bool]:
    """The engine's ``num_gpu_blocks`` and whether it caches prefixes: the replay's GPU
    tier plus room for the longest request, else the pool the GPU's memory leaves,
    uncached."""
    gpu_tier = next((s for s in cfg.tiers if s.name == "gpu"), None)
    if gpu_tier is None:
        return step.kv_pool_blocks(block_tokens), False
    # the tier's blocks, plus room for the longest request, as data mode's GPU pool
    # (the tier is what stays cached; vLLM needs a whole request in its pool to run it)
    work = max((-(-(r.input_length + max(1, r.output_length)) // block_tokens)
                for r in requests), default=1)
    blocks = gpu_tier.blocks(block_bytes, block_tokens)
    num_gpu_blocks = (int(blocks) + work if blocks != math.inf
                      else step.kv_pool_blocks(block_tokens))
    return num_gpu_blocks, True


def _lower_tiers(cfg: CacheConfig, nvme_gbps: float, *, block_tokens: int,
                 block_bytes: int | None) -> list[TierSetup]:
    """The serving model's tiers below the GPU: the replay's DRAM tier on the engine's
    node, its NVMe tier on one target of ``nvme_gbps``."""
    from kvtool.serving.sim import TierSetup

    tiers = []
    for s in cfg.tiers:
        if s.name == "gpu":
            continue
        cap = s.blocks(block_bytes, block_tokens)
        policy = s.policy if s.policy not in _NO_POLICY else "lru"
        if s.name == "dram":
            tiers.append(TierSetup("dram", cap, policy, node="n0"))
        else:
            tiers.append(TierSetup("nvme", cap, policy,
                                   targets=(("nvme", nvme_gbps, nvme_gbps),)))
    return tiers


def _simulate(requests: Sequence[Any], setup: ClusterSetup, load: Load, *, block_tokens: int,
              exact_steps: bool, stack: Callable[..., TierStack] | None = None
              ) -> tuple[list[RequestTimes], dict[str, Any]]:
    """Run the simulation of ``setup`` under ``load``: each request's times in serve order
    and the serving model's document. ``stack``: the tiers below (a
    :class:`~kvtool.serving.serveorder.ServeOrderStack`, which decides the requests the
    engine never admitted at the end)."""
    from kvtool.gcpause import cyclic_gc_paused
    from kvtool.serving.router import make_router
    from kvtool.serving.sim import Simulation

    # The run's garbage is freed by reference counting; its cycles are the simulation's
    # own (engines, tiers, loop), which it holds until it ends and then breaks
    # (Simulation.release): the collector's passes over the trace's block keys and the
    # run's state would find nothing (kvtool.gcpause), nor any leftover of it afterwards.
    with cyclic_gc_paused():
        sim = Simulation(requests, setup, load, block_tokens=block_tokens,
                         router=make_router("round-robin"), exact_steps=exact_steps,
                         stack=stack)
        doc = sim.run()
        if stack is not None:
            from kvtool.serving.serveorder import ServeOrderStack

            assert isinstance(sim.tiers, ServeOrderStack)
            sim.tiers.finish()
        nan = math.nan
        times = []
        for seq in sim.seqs:
            if seq is None or seq.finish < 0:
                times.append(RequestTimes(nan if seq is None else seq.arrival, nan, nan))
            else:
                times.append(RequestTimes(seq.arrival, seq.first_token, seq.finish))
        sim.release()
        del sim  # freed now, before the collector is back (it would walk all of it once)
    return times, doc


def apply_times(result: dict[str, Any], requests: Sequence[Any], times: list[RequestTimes],
                described: dict[str, Any]) -> None:
    """Put the one-engine case's times into a replay's report: TTFT percentiles, wall time
    and requests per second, per round and in total."""
    by_round: dict[int, list[RequestTimes]] = {}
    for req, t in zip(requests, times, strict=True):
        by_round.setdefault(req.report_round, []).append(t)

    def fill(d: dict[str, Any], ts: list[RequestTimes]) -> None:
        ok = [t for t in ts if not math.isnan(t.finish)]
        ttft = sorted(t.ttft for t in ok)
        d["ttft_p50_s"] = percentile(ttft, 50)
        d["ttft_p99_s"] = percentile(ttft, 99)
        wall = (max(t.finish for t in ok) - min(t.arrival for t in ok)) if ok else 0.0
        d["wall_s"] = wall
        d["requests_per_s"] = len(ok) / wall if wall > 0 else None

    for rd in result.get("rounds", []):
        fill(rd, by_round.get(rd["round"], []))
    fill(result, times)
    result["time_model"] = described
