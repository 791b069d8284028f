"""Serving experiments: the published *performance* claims on kvtool's serving model.

An experiment file with a ``[serving]`` table runs its workload through
:mod:`kvtool.serving` (engines, batching, links, routers) instead of the cache replay: each
``[[config]]`` names a cluster file (``cluster = "gp7000"`` is
``fixtures/clusters/gp7000.toml``) and every configuration runs under every load of
``loads`` (the ``--sweep`` syntax: ``concurrency=1,4,16`` or ``request-rate=0.5,1``)::

    [serving]
    loads = "concurrency=128,256"
    phases = "iterations"       # optional: one vLLM bench run per prompt length and iteration
    scalars = { mfu_prefill = 0.2 }   # optional: roofline scalars of every engine (a fit)
    num_gpu_blocks = 12000            # optional: every engine's KV pool (an inferred one)

``phases = "iterations"`` (random-prompts workloads, closed loop only) reproduces how the
published WQS / GP7000 read-path numbers were taken: ``vllm bench serve`` run once per
prompt length and iteration, back to back against the same server. Requests are grouped by
(prompt length, iteration), in that order; inside a group ``C`` users send the group's
requests closed-loop; the next group starts when every request of the previous one has
finished, and the cluster's caches and tiers carry over. Each group gets its own
``serving`` figures (vLLM bench's names; ``itl`` is not split by group).

Every time and throughput here is **modelled** (the serving model's clock: roofline step
times and flows over links); counts (hit ratios, bytes) are **simulated** (exact for the
workload, no byte moved). Serving experiments never move bytes.

Invariant of :class:`PhasedArrivals`: every request index is released exactly once, never
before every request of the earlier groups has finished, and at most ``C`` requests of a
group are in flight.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kvtool.errors import UsageError
from kvtool.experiments.figures import RunData
from kvtool.experiments.spec import PHASES, Experiment, cluster_path, parse_loads
from kvtool.serving.load import Load
from kvtool.serving.report import serving_metrics

PhaseKey = tuple[int, int]
"""(prompt tokens, iteration) of a group of requests."""


class PhasedArrivals:
    """Closed loop of ``C`` users over groups run back to back (module docstring).

    Has the interface the event loop uses of :class:`kvtool.serving.load.Arrivals`
    (``initial()``, ``on_finish(index, now)``).
    """

    def __init__(self, phase_of: Sequence[PhaseKey], users: int) -> None:
        if users < 1:
            raise UsageError(f"concurrency must be at least 1, got {users}", field="concurrency")
        groups: dict[PhaseKey, list[int]] = {}
        for i, key in enumerate(phase_of):
            groups.setdefault(key, []).append(i)
        self.order: list[PhaseKey] = sorted(groups)
        self._groups = [groups[k] for k in self.order]
        self.users = users
        self._group = -1
        self._pos = 0
        self._in_flight = 0

    def _open_next(self, now: float) -> list[tuple[float, int]]:
        self._group += 1
        if self._group >= len(self._groups):
            return []
        group = self._groups[self._group]
        n = min(self.users, len(group))
        self._pos = n
        self._in_flight = n
        return [(now, i) for i in group[:n]]

    def initial(self) -> list[tuple[float, int]]:
        return self._open_next(0.0)

    def on_finish(self, index: int, now: float) -> list[tuple[float, int]]:
        group = self._groups[self._group]
        if self._pos < len(group):
            nxt = group[self._pos]
            self._pos += 1
            return [(now, nxt)]
        self._in_flight -= 1
        if self._in_flight == 0:
            return self._open_next(now)
        return []


def load_key(load: Load) -> float:
    return float(load.value)


def phase_keys(requests: Sequence[Any]) -> list[PhaseKey]:
    return [(r.input_length, r.round if r.round is not None else 1) for r in requests]


SHARE_FIELDS = ("gpu_hit_share", "store_hit_share", "recompute_share", "ttft_share_of_e2el")


def shares(doc: dict[str, Any]) -> dict[str, float]:
    """Where a run's prompt tokens came from (shares of all prompt tokens: the GPU prefix
    caches, the tiers below, recomputed; simulated) and TTFT's share of the end-to-end
    latency (mean over mean; modelled)."""
    c, sv = doc["cache"], doc["serving"]
    prompt = c["prompt_tokens"] or 1
    e2el = sv["mean_e2el_ms"]
    return {"gpu_hit_share": c["gpu_hit_tokens"] / prompt,
            "store_hit_share": c["external_hit_tokens"] / prompt,
            "recompute_share": c["recompute_tokens"] / prompt,
            "ttft_share_of_e2el": sv["mean_ttft_ms"] / e2el if e2el else 0.0}


def _phase_doc(seqs: Sequence[Any]) -> dict[str, Any]:
    """vLLM bench's figures over one group's requests (``itl`` is not split by group)."""
    start = min(s.arrival for s in seqs)
    end = max(s.finish for s in seqs)
    doc = serving_metrics(
        start=start, end=end, input_tokens=[s.num_prompt_tokens for s in seqs],
        output_tokens=[s.num_output for s in seqs],
        ttft_s=[s.first_token - s.arrival for s in seqs],
        e2el_s=[s.finish - s.arrival for s in seqs], itl_values_s=[], itl_counts=[])
    for k in [k for k in doc if "_itl_" in k]:
        del doc[k]
    prompt = sum(s.num_prompt_tokens for s in seqs)
    hit = sum(max(0, s.local_hit_tokens) + s.ext_tokens for s in seqs)
    doc["token_hit_ratio"] = hit / prompt if prompt else 0.0
    return doc


def run_serving_kind(exp: Experiment, trace: Path, *,
                     progress: Callable[[str, float | None], Any] | None = None) -> RunData:
    """Run every configuration's cluster under every load; one report per (config, load)."""
    from kvtool.serving.setup import build_setup
    from kvtool.serving.sim import Simulation
    from kvtool.trace import read_trace

    reader = read_trace(trace, fmt="kvtool")
    requests = list(reader)
    B = reader.block_tokens
    loads = parse_loads(exp.serving["loads"])
    phased = exp.serving.get("phases", "none") == "iterations"
    keys = phase_keys(requests)
    results: dict[str, dict[str, Any]] = {}
    per_request: dict[str, list[tuple[int, int, int]]] = {}
    for c in exp.configs:
        assert c.cluster is not None
        built = build_setup(str(cluster_path(c.cluster, exp.path)), block_tokens=B,
                            scalars=exp.serving.get("scalars") or None,
                            num_gpu_blocks=exp.serving.get("num_gpu_blocks"))
        runs: list[dict[str, Any]] = []
        for n, load in enumerate(loads):
            sim = Simulation(requests, built.setup, load, block_tokens=built.block_tokens,
                             router=built.make_router(), trace_block_tokens=B)
            arrivals = None
            if phased:
                arrivals = PhasedArrivals(keys, int(load.value))
                sim.arrivals = arrivals
            if progress is not None:
                with progress(f"{exp.name}: {c.label} · {load.label} (requests)",
                              len(requests)) as advance:
                    doc = sim.run(progress=advance)
            else:
                doc = sim.run()
            doc["cluster"] = built.name
            doc["label"] = f"{c.label} · {load.label}"
            # Requests the run ended without finishing or failing (the event loop ran out of
            # events with requests still queued): 0 in a sound run; tests check it.
            doc["unfinished"] = len(requests) - len(sim.done) - sim.failed
            doc["shares"] = shares(doc)
            if arrivals is not None:
                by_phase: dict[PhaseKey, list[Any]] = {}
                for s in sim.done:
                    by_phase.setdefault(keys[s.index], []).append(s)
                doc["phases"] = [{"input_tokens": k[0], "iteration": k[1],
                                  "serving": _phase_doc(by_phase[k])}
                                 for k in arrivals.order if k in by_phase]
            if n == 0:
                per_request[c.label] = [(keys[s.index][1], s.num_prompt_tokens,
                                         max(0, s.local_hit_tokens) + s.ext_tokens)
                                        for s in sim.done]
            runs.append(doc)
        results[c.label] = {"schema": "kvtool.serving/1", "label": c.label,
                            "cluster": built.describe(), "runs": runs}
    return RunData(mode="simulate", workload=exp.workload, block_bytes=None, results=results,
                   requests=per_request, serving=True)


def sweep_doc(data: RunData) -> dict[str, Any]:
    """The runs of every configuration as one ``kvtool replay --sweep`` document (for its
    CSV and plot), the configuration's label as the cluster name."""
    runs = []
    for label, res in data.results.items():
        for r in res["runs"]:
            runs.append({**r, "cluster": label})
    return {"runs": runs}


def plot_serving(exp: Experiment, data: RunData, path: Path) -> None:
    """The PNG: with phases, TTFT p50 and total token throughput by prompt length, one line
    per configuration and iteration (the first load); else ``kvtool replay --sweep``'s
    plot (throughput and TTFT p50/p99 against load, one line per configuration)."""
    title = f"{exp.name}: {exp.title} (serving model, modelled)"
    if exp.serving.get("phases", "none") != "iterations":
        from kvtool.serving.run import write_plot

        write_plot(sweep_doc(data), path, title=title)
        return
    from kvtool.plotting import pyplot, save

    plt = pyplot("out")
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for label, res in data.results.items():
        phases = res["runs"][0].get("phases", [])
        for it in sorted({p["iteration"] for p in phases}):
            pts = sorted((p["input_tokens"], p["serving"]) for p in phases
                         if p["iteration"] == it)
            xs = [x for x, _sv in pts]
            ax1.plot(xs, [sv["median_ttft_ms"] / 1000 for _x, sv in pts], marker="o",
                     label=f"{label}, iteration {it}")
            ax2.plot(xs, [sv["total_token_throughput"] for _x, sv in pts], marker="o",
                     label=f"{label}, iteration {it}")
    for ax in (ax1, ax2):
        ax.set_xlabel("prompt tokens")
        ax.set_xscale("log")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7, loc="best")
    ax1.set_yscale("log")
    ax1.set_ylabel("TTFT p50, s (modelled)")
    ax2.set_ylabel("total tokens/s (modelled)")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    save(fig, path, field="out", dpi=110)


__all__ = ["PHASES", "PhasedArrivals", "cluster_path", "parse_loads", "plot_serving",
           "run_serving_kind", "sweep_doc"]
