"""The figures an experiment can put beside a published number (``[[figure]] metric``).

Each metric reads the finished run (:class:`RunData`: every configuration's replay
document, per-request times, or the parallel-read measurements) and returns a
:class:`Value`: the number, how to print it, and its *basis*:

* ``simulated`` — counted by the replayer (``--simulate``): exact for the
  workload, but no byte moved;
* ``counted`` — counted in data mode, where every block really moved and was checked;
* ``modelled`` — a time or throughput from the serving model's clock (serving
  experiments, whose counts are ``simulated``), or a formula (``kvtool plan``);
* ``measured`` — timed on this machine (bytes read through a real engine).

A row is *measured* when its basis is ``counted`` or ``measured``.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

MEASURED_BASES = ("counted", "measured")


@dataclass
class RunData:
    """What a run produced, for the metrics to read."""

    mode: str
    """``simulate`` or ``data`` (replay kinds), ``measure`` (parallel-read)."""
    workload: dict[str, Any]
    block_bytes: int | None = None
    results: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Configuration label → its replay document."""
    requests: dict[str, list[tuple[int, int, int]]] = field(default_factory=dict)
    """Configuration label → (round, input tokens, hit tokens) of every request."""
    reads: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Parallel-read target → ``{"serial": row, "parallel": row}``."""
    plan_inputs: dict[str, Any] = field(default_factory=dict)
    """Configuration label → its CacheConfig (for ``plan_collapse_round``)."""
    setup: dict[str, Any] | None = None
    """Data mode: what the replay chose (block size, places, pools)."""
    serving: bool = False
    """A serving experiment: ``results`` maps a label to ``{"runs": [report per load]}``
    (:mod:`kvtool.experiments.serving`)."""
    bands: dict[str, tuple[list[int], list[float], list[float], list[float]]] = field(
        default_factory=dict)
    """``--seeds N``: configuration label → (rounds, mean, 95 % low, high) of the token hit
    ratio over the seeds (:func:`kvtool.experiments.seeds.round_band`)."""


@dataclass(frozen=True)
class Value:
    value: float | None
    text: str
    basis: str

    @property
    def measured(self) -> bool:
        return self.basis in MEASURED_BASES


class FigureUnavailable(Exception):
    """The figure cannot be computed in this mode (the row says why)."""


@dataclass(frozen=True)
class Metric:
    args: Mapping[str, tuple[type | tuple[type, ...], bool]]
    """Argument name → (accepted types, required)."""
    kinds: tuple[str, ...]
    fn: Callable[[RunData, dict[str, Any]], Value]
    doc: str
    config_args: tuple[str, ...] = ()
    serving: bool = False
    """Reads serving-model runs (experiments with ``[serving]``), not cache replays."""

    def check(self, args: dict[str, Any], labels: list[str], kind: str,
              serving: bool = False) -> str | None:
        if kind not in self.kinds:
            return f"this metric applies to workload kinds {', '.join(self.kinds)}"
        if serving != self.serving:
            return ("this metric reads serving-model runs: the experiment needs a [serving] "
                    "table" if self.serving else
                    "this metric reads cache replays, not serving-model runs ([serving])")
        for key, value in args.items():
            spec = self.args.get(key)
            if spec is None:
                return f"unknown argument {key!r} (use {', '.join(sorted(self.args)) or 'none'})"
            if not isinstance(value, spec[0]) or isinstance(value, bool):
                return f"argument {key!r}: wrong type {type(value).__name__}"
        for key, (_t, required) in self.args.items():
            if required and key not in args:
                return f"argument {key!r} is required"
        for key in self.config_args:
            if key in args and args[key] not in labels:
                return f"argument {key!r}: no [[config]] labelled {args[key]!r}"
        return None


def _count_basis(run: RunData) -> str:
    return "counted" if run.mode == "data" else "simulated"


def _round(res: dict[str, Any], rnd: int | str | None) -> dict[str, Any]:
    if rnd is None:
        return res
    rounds = res["rounds"]
    if rnd == "last":
        return rounds[-1]
    for r in rounds:
        if r["round"] == rnd:
            return r
    raise FigureUnavailable(f"no round {rnd}")


def _pct(x: float) -> str:
    return f"{x:.4f}"


def _hit_ratio(run: RunData, a: dict[str, Any]) -> Value:
    r = _round(run.results[a["config"]], a.get("round"))
    return Value(r["token_hit_ratio"], _pct(r["token_hit_ratio"]), _count_basis(run))


def _hit_ratio_ratio(run: RunData, a: dict[str, Any]) -> Value:
    num = _round(run.results[a["num"]], a.get("round"))["token_hit_ratio"]
    den = _round(run.results[a["den"]], a.get("round"))["token_hit_ratio"]
    if den == 0:
        return Value(math.inf, f"{_pct(num)} / 0 (∞)", _count_basis(run))
    return Value(num / den, f"{num / den:,.1f}× ({_pct(den)} → {_pct(num)})", _count_basis(run))


def _cliff(run: RunData, a: dict[str, Any]) -> Value:
    c = run.results[a["config"]]["cliff_round"]
    return Value(None if c is None else float(c), "none" if c is None else str(c),
                 _count_basis(run))


def _plan_collapse(run: RunData, a: dict[str, Any]) -> Value:
    from kvtool.plan import Storage, Workload, plan
    from kvtool.trace.sessions import Sessions

    cfg = run.plan_inputs[a["config"]]
    dram = next((t.capacity for t in cfg.tiers if t.name == "dram"), None)
    if dram is None:
        raise FigureUnavailable("the configuration has no DRAM tier")
    p = plan(Workload(**asdict(Sessions.from_table(run.workload)), answer_kv="next-round"),
             Storage(run.block_bytes), dram=dram)
    c = p.as_given.collapse_round
    return Value(c, "none" if c is None else f"{c:.2f}", "modelled")


def _recompute(run: RunData, a: dict[str, Any]) -> Value:
    r = _round(run.results[a["config"]], a.get("round"))
    return Value(float(r["recompute_tokens"]), f"{r['recompute_tokens']:,}", _count_basis(run))


def _recompute_ratio(run: RunData, a: dict[str, Any]) -> Value:
    num = _round(run.results[a["num"]], a.get("round"))["recompute_tokens"]
    den = _round(run.results[a["den"]], a.get("round"))["recompute_tokens"]
    if den == 0:
        return Value(math.inf, f"{num:,} → 0 (∞)", _count_basis(run))
    return Value(num / den, f"{num / den:,.1f}× ({num:,} → {den:,})", _count_basis(run))


def put_blocks(rnd: dict[str, Any], tier: str, tiers: list[str]) -> int:
    """Store puts (computed blocks written) into ``tier`` in one round.

    Uses the replayer's own ``put_blocks`` when the report has it. Older reports count
    promotions and puts together in ``blocks_written``; there the two are equal only for
    the bottom tier (nothing is promoted into it), so other tiers are refused.
    """
    if "put_blocks" in rnd:
        return int(rnd["put_blocks"][tier] or 0)
    if tier != tiers[-1]:
        raise FigureUnavailable(f"this report does not count puts into {tier} apart from "
                                "promotions")
    return int(rnd["blocks_written"][tier] or 0)


def _puts_series(run: RunData, a: dict[str, Any]) -> list[int]:
    res = run.results[a["config"]]
    tiers = [t["name"] for t in res["tiers"]]
    # Under write-through every computed block is put into every tier, so the bottom
    # tier's puts are the store's puts; nothing is ever promoted into the bottom tier.
    tier = a.get("tier", tiers[-1])
    if tier not in tiers:
        raise FigureUnavailable(f"the configuration has no {tier} tier")
    first = a.get("from_round", 2)
    return [put_blocks(r, tier, tiers) for r in res["rounds"] if r["round"] >= first]


def _put_spread(run: RunData, a: dict[str, Any]) -> Value:
    """max / min of the puts per round (from ``from_round``, default 2)."""
    series = _puts_series(run, a)
    bb = run.block_bytes
    lo, hi = min(series), max(series)
    if lo == 0:
        return Value(math.inf, f"0 → {hi:,} blocks", _count_basis(run))

    def amount(blocks: int) -> str:
        return f"{blocks * bb / 1e9:,.2f} GB" if bb else f"{blocks:,} blocks"

    return Value(hi / lo, f"{hi / lo:,.1f}× ({amount(lo)} → {amount(hi)} per round)",
                 _count_basis(run))


def _share(run: RunData, a: dict[str, Any]) -> Value:
    """Share of input tokens served by a tier (``store`` = dram + nvme) or recomputed."""
    res = run.results[a["config"]]
    first = a.get("from_round", 1)
    rounds = [r for r in res["rounds"] if r["round"] >= first]
    total = sum(r["input_tokens"] for r in rounds)
    what = a["of"]
    if what == "recompute":
        part = sum(r["recompute_tokens"] for r in rounds)
    elif what == "store":
        part = sum((r["hit_tokens"].get("dram") or 0) + (r["hit_tokens"].get("nvme") or 0)
                   for r in rounds)
    else:
        part = sum(r["hit_tokens"].get(what) or 0 for r in rounds)
    share = part / total if total else 0.0
    return Value(100 * share, f"{100 * share:.1f} %", _count_basis(run))


def _excess_recompute(run: RunData, a: dict[str, Any]) -> Value:
    """Recomputed tokens of the reusable prefix (the previous round's prompts) as % of it,
    per round from round 2; ``stat`` max or min over the rounds."""
    rounds = run.results[a["config"]]["rounds"]
    values = []
    for prev, cur in itertools.pairwise(rounds):
        reusable = prev["input_tokens"]
        if reusable:
            hit = cur["hit_tokens"]["total"]
            values.append(100 * max(0, reusable - hit) / reusable)
    if not values:
        raise FigureUnavailable("fewer than two rounds")
    v = max(values) if a.get("stat", "max") == "max" else min(values)
    return Value(v, f"{v:.3f} %", _count_basis(run))


def _errors(run: RunData, a: dict[str, Any]) -> Value:
    res = run.results[a["config"]]
    if run.mode != "data":
        raise FigureUnavailable("no bytes move in a simulated run")
    n = int(res.get("corrupt_blocks", 0) or 0) + int(res.get("lost_blocks", 0) or 0)
    return Value(float(n), f"{n}", "counted")


def _load_link(run: RunData, config: str, link: str | None) -> dict[str, Any]:
    res = run.results[config]
    links = (res.get("measured") or {}).get("links")
    if run.mode != "data" or not links:
        raise FigureUnavailable("no bytes move in a simulated run")
    name = link or f"gpu<-{res['tiers'][-1]['name']}"
    got = links.get(name)
    if not got or not got.get("gbps"):
        raise FigureUnavailable(f"nothing moved over {name}")
    return dict(got, name=name)


def _load_gbps(run: RunData, a: dict[str, Any]) -> Value:
    """Measured GB/s of a link (default: the configuration's store tier into the GPU tier)."""
    got = _load_link(run, a["config"], a.get("link"))
    return Value(got["gbps"], f"{got['gbps']:.2f} GB/s ({got['name']})", "measured")


def _load_ratio(run: RunData, a: dict[str, Any]) -> Value:
    num = _load_link(run, a["num"], None)
    den = _load_link(run, a["den"], None)
    v = num["gbps"] / den["gbps"]
    return Value(v, f"{v:.2f} ({num['name']} {num['gbps']:.2f} / {den['name']} "
                    f"{den['gbps']:.2f} GB/s)", "measured")


def _hit_by_length(run: RunData, a: dict[str, Any]) -> Value:
    """Token hit ratio of the round's requests of ``input_tokens`` (random prompts)."""
    rnd, n = a.get("round", 2), a["input_tokens"]
    got = [(inp, hit) for r, inp, hit in run.requests[a["config"]] if r == rnd and inp == n]
    if not got:
        raise FigureUnavailable(f"no round-{rnd} request of {n} input tokens")
    v = sum(h for _i, h in got) / sum(i for i, _h in got)
    return Value(v, _pct(v), _count_basis(run))


def _read(run: RunData, a: dict[str, Any]) -> dict[str, Any]:
    t = run.reads.get(a["target"])
    if t is None:
        raise FigureUnavailable(f"target {a['target']} was not measured "
                                f"({run.reads.get('_skipped', {}).get(a['target'], 'not run')})")
    return t


def _read_gbps(run: RunData, a: dict[str, Any]) -> Value:
    row = _read(run, a)[a["mode"]]
    return Value(row["gbps"], f"{row['gbps']:.2f} GB/s", "measured")


def _read_speedup(run: RunData, a: dict[str, Any]) -> Value:
    t = _read(run, a)
    v = t["parallel"]["gbps"] / t["serial"]["gbps"]
    return Value(v, f"{v:.2f}× ({t['serial']['gbps']:.2f} → {t['parallel']['gbps']:.2f} GB/s)",
                 "measured")


def _read_ttft(run: RunData, a: dict[str, Any]) -> Value:
    row = _read(run, a)[a["mode"]]
    return Value(row["ttft_s"], f"{row['ttft_s']:.3f} s", "measured")


def _read_ttft_ratio(run: RunData, a: dict[str, Any]) -> Value:
    t = _read(run, a)
    v = t["serial"]["ttft_s"] / t["parallel"]["ttft_s"]
    return Value(v, f"{v:.2f}× ({t['serial']['ttft_s']:.3f} → {t['parallel']['ttft_s']:.3f} s)",
                 "measured")


# ------------------------------------------------------------------ serving-model runs


def _serving_basis(field: str) -> str:
    """Times and throughputs come from the serving model's clock (modelled); counts are
    exact for the workload (simulated)."""
    timed = (field.endswith("_ms") or field.endswith("_throughput")
             or field in ("duration", "ttft_share_of_e2el"))
    return "modelled" if timed else "simulated"


def _serving_fmt(field: str, v: float) -> str:
    if field.endswith("_ms"):
        return f"{v:,.0f} ms" if v < 10_000 else f"{v / 1000:,.2f} s"
    if field == "request_throughput":
        return f"{v:,.2f} req/s"
    if field.endswith("_throughput"):
        return f"{v:,.0f} tok/s"
    if field == "duration":
        return f"{v:,.1f} s"
    if field.endswith("ratio"):
        return f"{v:.4f}"
    if field.endswith("_share") or field == "ttft_share_of_e2el":
        return f"{100 * v:.1f} %"
    return f"{v:,.4g}"


def _serving_run(run: RunData, config: str, load: float | int | None) -> dict[str, Any]:
    runs = run.results[config]["runs"]
    if load is None:
        if len(runs) != 1:
            raise FigureUnavailable("the experiment runs several loads: give args.load")
        return runs[0]
    for r in runs:
        if float(r["load"]["value"]) == float(load):
            return r
    raise FigureUnavailable(f"no run at load {load:g}")


def _serving_field(r: dict[str, Any], field: str, input_tokens: int | None,
                   iteration: int | None) -> float:
    if input_tokens is not None or iteration is not None:
        phases = r.get("phases")
        if not phases:
            raise FigureUnavailable('no phases: the experiment needs [serving] phases = '
                                    '"iterations"')
        match = [p for p in phases
                 if (input_tokens is None or p["input_tokens"] == input_tokens)
                 and (iteration is None or p["iteration"] == iteration)]
        if len(match) != 1:
            raise FigureUnavailable(f"{len(match)} phases of {input_tokens} tokens, "
                                    f"iteration {iteration}")
        sv = match[0]["serving"]
        if field not in sv:
            raise FigureUnavailable(f"no figure {field!r} per phase")
        return float(sv[field])
    if field in r["serving"]:
        return float(r["serving"][field])
    if field in r["cache"] and isinstance(r["cache"][field], int | float):
        return float(r["cache"][field])
    if field in r.get("shares", {}):
        return float(r["shares"][field])
    raise FigureUnavailable(f"no figure {field!r} in the serving report")


def _need_serving(run: RunData) -> None:
    if not run.serving:
        raise FigureUnavailable("not a serving-model run")


def _serving_value(run: RunData, a: dict[str, Any]) -> Value:
    """A figure of the serving report (``serving`` or ``cache``), or of one phase."""
    _need_serving(run)
    f = a["field"]
    v = _serving_field(_serving_run(run, a["config"], a.get("load")), f, a.get("input_tokens"),
                       a.get("iteration"))
    return Value(v, _serving_fmt(f, v), _serving_basis(f))


def _serving_ratio(run: RunData, a: dict[str, Any]) -> Value:
    """``field`` of ``num`` over ``den`` (configurations; each at its own iteration when
    ``num_iteration``/``den_iteration`` are given, else ``iteration``)."""
    _need_serving(run)
    f = a["field"]
    it = a.get("iteration")
    num = _serving_field(_serving_run(run, a["num"], a.get("load")), f, a.get("input_tokens"),
                         a.get("num_iteration", it))
    den = _serving_field(_serving_run(run, a["den"], a.get("load")), f, a.get("input_tokens"),
                         a.get("den_iteration", it))
    if den == 0:
        return Value(math.inf, f"{_serving_fmt(f, num)} / 0 (∞)", _serving_basis(f))
    v = num / den
    return Value(v, f"{v:,.3f} ({_serving_fmt(f, num)} / {_serving_fmt(f, den)})",
                 _serving_basis(f))


def _serving_ratio_span(run: RunData, a: dict[str, Any]) -> Value:
    """``field`` of ``num`` over ``den`` at every load both ran; ``stat``: ``range`` (the
    ratio farthest from 1; text min–max), ``pct_range`` (the same as a % difference),
    ``count_below`` (loads where the ratio is below 1), ``max_diff_pct`` (largest
    |ratio − 1| in %)."""
    _need_serving(run)
    f = a["field"]
    pairs = []
    for r in run.results[a["num"]]["runs"]:
        load = float(r["load"]["value"])
        try:
            d = _serving_run(run, a["den"], load)
        except FigureUnavailable:
            continue
        num = _serving_field(r, f, a.get("input_tokens"), a.get("iteration"))
        den = _serving_field(d, f, a.get("input_tokens"), a.get("iteration"))
        if den:
            pairs.append((load, num / den))
    if not pairs:
        raise FigureUnavailable("no load ran in both configurations")
    ratios = [p for _l, p in pairs]
    loads = [lo for lo, _p in pairs]
    where = f"over {len(pairs)} loads, {min(loads):g}–{max(loads):g}"
    stat = a.get("stat", "range")
    far = max(ratios, key=lambda x: abs(x - 1))
    basis = _serving_basis(f)
    if stat == "count_below":
        k = sum(1 for x in ratios if x < 1)
        return Value(float(k), f"{k} of {len(ratios)}", basis)
    if stat == "max_diff_pct":
        v = 100 * abs(far - 1)
        return Value(v, f"{v:.1f} % ({where})", basis)
    if stat == "pct_range":
        lo, hi = 100 * (min(ratios) - 1), 100 * (max(ratios) - 1)
        return Value(100 * (far - 1), f"{lo:+.1f} % to {hi:+.1f} % ({where})", basis)
    return Value(far, f"{min(ratios):.3f}–{max(ratios):.3f} ({where})", basis)


SPAN_STATS = ("range", "pct_range", "count_below", "max_diff_pct")

_SERVING_TIMES = ("a serving experiment's `serving` / `serving_ratio` (fields duration, "
                  "median_ttft_ms, output_throughput, ...; docs/experiments.md)")
RETIRED_METRICS = {
    name: (f"metric {name!r} read the retired replay time model; times come from the "
           f"serving model: use {_SERVING_TIMES}")
    for name in ("wall_s", "wall_ratio", "throughput_ratio", "ttft_ms", "ttft_ratio")}
"""Metrics of the replay time model (issue 38): each file naming one gets this line."""


_Args = dict[str, tuple[type | tuple[type, ...], bool]]
_REPLAY = ("multi-turn", "random-prompts")
_RND: tuple[type, ...] = (int, str)
_C: _Args = {"config": (str, True)}
_R: _Args = {"round": (_RND, False)}
_PAIR: _Args = {"num": (str, True), "den": (str, True), "round": (_RND, False)}
_TARGET: _Args = {"target": (str, True)}
_MODE: _Args = {"mode": (str, True)}
_SV: _Args = {"field": (str, True), "load": ((int, float), False), "input_tokens": (int, False),
              "iteration": (int, False)}
_SVPAIR: _Args = {"num": (str, True), "den": (str, True)}

METRICS: dict[str, Metric] = {
    "cliff_round": Metric(_C, _REPLAY, _cliff, "collapse round (docs/definitions.md)", ("config",)),
    "plan_collapse_round": Metric(_C, ("multi-turn",), _plan_collapse,
                                  "kvtool plan's collapse round for the config's DRAM tier",
                                  ("config",)),
    "hit_ratio": Metric({**_C, **_R}, _REPLAY, _hit_ratio, "token hit ratio (a round or all)",
                        ("config",)),
    "hit_ratio_ratio": Metric(_PAIR, _REPLAY, _hit_ratio_ratio, "hit ratio num / den",
                              ("num", "den")),
    "recompute_tokens": Metric({**_C, **_R}, _REPLAY, _recompute, "recomputed tokens",
                               ("config",)),
    "recompute_ratio": Metric(_PAIR, _REPLAY, _recompute_ratio, "recomputed tokens num / den",
                              ("num", "den")),
    "put_spread": Metric({**_C, "tier": (str, False), "from_round": (int, False)}, _REPLAY,
                         _put_spread, "max / min store puts per round", ("config",)),
    "share": Metric({**_C, "of": (str, True), "from_round": (int, False)}, _REPLAY, _share,
                    "% of input tokens from a tier, the store, or recomputed", ("config",)),
    "excess_recompute": Metric({**_C, "stat": (str, False)}, _REPLAY, _excess_recompute,
                               "% of the reusable prefix recomputed", ("config",)),
    "errors": Metric(_C, _REPLAY, _errors, "corrupt + lost blocks (data mode)", ("config",)),
    "load_gbps": Metric({**_C, "link": (str, False)}, _REPLAY, _load_gbps,
                        "measured GB/s of a link (data mode)", ("config",)),
    "load_ratio": Metric({"num": (str, True), "den": (str, True)}, _REPLAY, _load_ratio,
                         "measured load GB/s into the GPU tier, num / den (data mode)",
                         ("num", "den")),
    "hit_ratio_by_length": Metric({**_C, "input_tokens": (int, True), "round": (int, False)},
                                  _REPLAY, _hit_by_length,
                                  "token hit ratio of the requests of one length in a round",
                                  ("config",)),
    "serving": Metric({**_C, **_SV}, _REPLAY, _serving_value,
                      "a serving-model figure (vLLM bench's names, or a cache count) of one "
                      "configuration at one load (or phase)", ("config",), serving=True),
    "serving_ratio": Metric({**_SVPAIR, **_SV, "num_iteration": (int, False),
                             "den_iteration": (int, False)}, _REPLAY, _serving_ratio,
                            "a serving-model figure, num / den", ("num", "den"), serving=True),
    "serving_ratio_span": Metric({**_SVPAIR, **_SV, "stat": (str, False)}, _REPLAY,
                                 _serving_ratio_span,
                                 "a serving-model figure, num / den, over every load",
                                 ("num", "den"), serving=True),
    "read_gbps": Metric({**_TARGET, **_MODE}, ("parallel-read",), _read_gbps, "GB/s"),
    "read_speedup": Metric(_TARGET, ("parallel-read",), _read_speedup, "parallel / serial GB/s"),
    "read_ttft_s": Metric({**_TARGET, **_MODE}, ("parallel-read",), _read_ttft, "cold TTFT"),
    "read_ttft_ratio": Metric(_TARGET, ("parallel-read",), _read_ttft_ratio,
                              "serial / parallel TTFT"),
}
