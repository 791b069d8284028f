"""Experiments as data: the TOML files under ``fixtures/experiments/`` and their schema.

An experiment file names a published claim, the workload that re-creates it at laptop
scale, the cache configurations compared, and the figures to put side by side::

    [experiment]
    name = "gp7000-cliff"                  # must equal the file name's stem
    title = "GP7000 long-output cliff"
    source = "GP7000 report (seeds/000), figure 3"
    claim = "DRAM-only LRU collapses at round 8 (plan 8.6); DRAM/8 + NVMe rises"
    scale = "C=112 → 16 sessions; DRAM 429.5 GB → 1,024 blocks (same R = capacity/writes)"

    [workload]                             # kind: multi-turn, random-prompts, parallel-read
    kind = "multi-turn"
    sessions = 16
    ...

    [[config]]                             # one per configuration, the --compare syntax
    label = "DRAM only"
    tiers = "dram=1024blk,policy=lru"

    [[figure]]                             # one row of the side-by-side table
    claim = "collapse round, DRAM only"
    published = 8
    unit = "round"
    metric = "cliff_round"                 # kvtool.experiments.figures.METRICS
    args = { config = "DRAM only" }
    differs = "why kvtool's figure can differ at this scale"

Times come from one model, the serving model: an experiment that states a time or a
throughput is a serving experiment (``[serving]``), whose ``[[config]]`` name cluster files
(the engines). The ``[time]`` table of the retired replay time model is refused with one
line saying so (:data:`TIME_RETIRED`).

Errors name the file, line and key (exit 2).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtool.configfile import ConfigTable, read_config
from kvtool.errors import InputError
from kvtool.experiments.engine_model import REQUIRED as ENGINE_MODEL_REQUIRED
from kvtool.experiments.engine_model import WORKLOAD_KEYS as ENGINE_MODEL_KEYS

KINDS = ("multi-turn", "random-prompts", "parallel-read", "engine-vs-model")

_EXPERIMENT_KEYS = {"name", "title", "source", "claim", "scale", "notes"}
_TOP_KEYS = {"experiment", "workload", "data", "config", "figure", "serving"}
TIME_RETIRED = ("the [time] table was retired with the replay time model "
                "(cache/timemodel.py): an experiment's times come from the serving model; "
                "give each [[config]] a cluster file (cluster = \"NAME\", "
                "fixtures/clusters/) and add a [serving] table (docs/experiments.md)")
_DATA_KEYS = {"block_bytes"}
_CONFIG_KEYS = {"label", "tiers", "cluster"}
_FIGURE_KEYS = {"claim", "published", "published_text", "unit", "metric", "args", "differs",
                "band"}
_SERVING_KEYS = {"loads", "phases", "scalars", "num_gpu_blocks"}
AGREE_TOLERANCE = 0.05
"""A row without a ``band`` agrees when kvtool's figure is within 5 % of the published one."""

_MULTI_TURN = {"sessions": int, "rounds": int, "input_tokens": int, "output_tokens": int,
               "system_prompt_tokens": int, "block_tokens": int, "seed": int}
_RANDOM = {"input_lengths": list, "num_prompts": int, "iterations": int, "output_tokens": int,
           "block_tokens": int, "seed": int, "system_prompt_tokens": int, "reuse_share": float,
           "range_ratio": float}
_PARALLEL = {"requests": int, "tokens_per_request": int, "chunk_tokens": int, "chunk_bytes": int,
             "serial_qd": int, "parallel_qd": int, "targets": list, "repeats": int,
             "prefill_tokens_per_s": float}
_COMMON = {"kind": str, "model": str, "dtype": str, "block_bytes": int}
_ENGINE_MODEL = dict(ENGINE_MODEL_KEYS)
"""``engine-vs-model``: a real engine's runs against the serving model
(:mod:`kvtool.experiments.engine_model`); no ``[[config]]``, ``[[figure]]``, ``[data]`` or
``[serving]``: its rows are every run × metric of ``[workload]``."""
_WORKLOAD_KEYS: dict[str, dict[str, type]] = {
    "multi-turn": {**_COMMON, **_MULTI_TURN},
    "random-prompts": {**_COMMON, **_RANDOM},
    "parallel-read": {**_COMMON, **_PARALLEL},
    "engine-vs-model": _ENGINE_MODEL,
}
WORKLOAD_KEYS = _WORKLOAD_KEYS
"""Each workload kind's keys and their types (what ``kvtool experiment fit --vary`` may set)."""
_REQUIRED = {
    "multi-turn": ("sessions", "rounds", "input_tokens", "output_tokens"),
    "random-prompts": ("input_lengths", "num_prompts", "iterations"),
    "parallel-read": ("requests", "tokens_per_request", "chunk_tokens", "targets"),
    "engine-vs-model": ENGINE_MODEL_REQUIRED,
}
PARALLEL_TARGETS = ("file", "loop", "nvme-tcp")


@dataclass(frozen=True)
class Figure:
    """One row of the table: a published number and how kvtool computes its own."""

    claim: str
    published: float | None
    unit: str
    metric: str
    args: dict[str, Any] = field(default_factory=dict)
    published_text: str | None = None
    differs: str = ""
    band: tuple[float, float] | None = None
    """The published range that counts as agreement (default: published ± 5 %)."""

    def agrees(self, value: float | None) -> bool | None:
        """Whether kvtool's ``value`` matches the published figure (None: nothing to
        compare). A row that does not agree must say why in ``differs``."""
        if value is None:
            return None
        if self.band is not None:
            return self.band[0] <= value <= self.band[1]
        if self.published is None:
            return None
        if self.published == 0:
            return value == 0
        return abs(value / self.published - 1) <= AGREE_TOLERANCE


@dataclass(frozen=True)
class ConfigSpec:
    label: str
    tiers: str
    """The ``--compare`` syntax: ``dram=128blk,nvme=inf,policy=lru`` (replay experiments)."""
    cluster: str | None = None
    """Serving experiments: a cluster file (a stem under ``fixtures/clusters/`` or a path)."""


@dataclass(frozen=True)
class Experiment:
    name: str
    title: str
    source: str
    claim: str
    scale: str
    kind: str
    workload: dict[str, Any]
    configs: list[ConfigSpec]
    figures: list[Figure]
    data: dict[str, Any] = field(default_factory=dict)
    """Data mode only: ``block_bytes`` (smaller blocks than the model's, so real bytes fit
    a laptop; counts are the same, bytes scale down)."""
    notes: str = ""
    path: Path | None = None
    serving: dict[str, Any] = field(default_factory=dict)
    """``[serving]``: ``loads`` (the ``--sweep`` syntax) and ``phases``; empty for cache
    replay experiments (:mod:`kvtool.experiments.serving`)."""

    @property
    def is_serving(self) -> bool:
        return bool(self.serving)

    def config(self, label: str) -> ConfigSpec:
        for c in self.configs:
            if c.label == label:
                return c
        raise KeyError(label)


def load_experiment(path: str | Path) -> Experiment:
    """Parse and check one experiment file (errors name file, line and key)."""
    path = Path(path)
    top = read_config(path, kind="toml").table()
    if top.has("time"):
        top.fail(TIME_RETIRED, top.at("time"))
    top.check_keys(_TOP_KEYS)
    head = _required_table(top, "experiment")
    head.check_keys(_EXPERIMENT_KEYS)
    name, title, source, claim, scale = (head.text(key, required=True, nonempty=True)
                                         for key in ("name", "title", "source", "claim", "scale"))
    if name != path.stem:
        head.fail(f"must equal the file name's stem {path.stem!r}", head.at("name"))
    notes = head.text("notes", "")
    workload = _required_table(top, "workload")
    kind = workload.text("kind", required=True)
    if kind not in KINDS:
        workload.fail(f"expected one of {', '.join(KINDS)}, got {kind!r}", workload.at("kind"))
    _check_workload(workload, kind)

    if kind == "engine-vs-model":
        for table in ("config", "figure", "data", "serving"):
            if top.has(table):
                top.fail("an engine-vs-model experiment's rows are its [workload] runs × "
                         "metrics: no [[config]], [[figure]], [data] or [serving]",
                         top.at(table))
        return Experiment(name, title, source, claim, scale, kind, workload.data, [], [],
                          notes=notes, path=path)

    data = top.table("data")
    if data is not None:
        data.check_keys(_DATA_KEYS)
        for key in data.data:
            data.integer(key, lo=1)
    serving = top.table("serving")
    if serving is not None:
        _check_serving(serving, kind)
    configs = _configs(top, path, serving=serving is not None)
    if kind != "parallel-read" and not configs:
        top.fail("a replay experiment needs at least one [[config]]", top.at("config"))
    figures = _figures(top, kind, configs, serving=serving is not None)
    return Experiment(name, title, source, claim, scale, kind, workload.data, configs, figures,
                      data={} if data is None else data.data, notes=notes,
                      path=path, serving={} if serving is None else serving.data)


def _required_table(top: ConfigTable, key: str) -> ConfigTable:
    table = top.table(key)
    if table is None:
        top.fail("missing required table", top.at(key))
    return table


def _check_workload(w: ConfigTable, kind: str) -> None:
    """``[workload]``: the keys ``kind`` takes, each of its type; the required ones given."""
    allowed = _WORKLOAD_KEYS[kind]
    w.check_keys(allowed)
    for key, want in allowed.items():
        if key not in w.data:
            continue
        if want is int:
            w.integer(key, lo=0)
        elif want is float:
            w.number(key, 0.0)
        elif want is str:
            w.text(key)
        else:
            w.array(key)
    for key in _REQUIRED[kind]:
        w.require(key, f" for kind {kind!r}")
    if kind == "parallel-read":
        for i, t in enumerate(w.str_list("targets")):
            if t not in PARALLEL_TARGETS:
                w.fail(f"unknown target {t!r} (use {', '.join(PARALLEL_TARGETS)})",
                       (*w.at("targets"), i))
    elif kind == "random-prompts":
        w.int_list("input_lengths", lo=1)
    elif kind == "engine-vs-model":
        from kvtool.experiments.engine_model import check_workload

        problem = check_workload(w.data)
        if problem:
            key, _, message = problem.partition(": ")
            w.fail(message, w.at(key))


def _configs(top: ConfigTable, path: Path, *, serving: bool) -> list[ConfigSpec]:
    """``[[config]]``: a label and tiers (replay), or a label and a cluster file (serving)."""
    configs: list[ConfigSpec] = []
    what, other = ("cluster", "tiers") if serving else ("tiers", "cluster")
    for c in top.tables("config"):
        c.check_keys(_CONFIG_KEYS)
        label = c.text("label", required=True, nonempty=True)
        value = c.text(what, required=True, nonempty=True)
        if c.has(other):
            c.fail(f"a {'serving' if serving else 'replay'} experiment's configurations "
                   f"take {what}, not {other}", c.at(other))
        if any(ch in label for ch in ",="):
            c.fail("must not contain ',' or '='", c.at("label"))
        if any(x.label == label for x in configs):
            c.fail(f"label {label!r} given twice", c.at("label"))
        if serving:
            where = cluster_path(value, path)
            if not where.is_file():
                c.fail(f"no cluster file {str(where)!r}", c.at("cluster"))
            configs.append(ConfigSpec(label, "", value))
            continue
        from kvtool.replay.config import parse_compare

        try:
            parse_compare(value, policy=None, write_policy=None)
        except InputError as exc:
            c.fail(exc.message, c.at("tiers"))
        configs.append(ConfigSpec(label, value))
    return configs


def _figures(top: ConfigTable, kind: str, configs: list[ConfigSpec], *, serving: bool
             ) -> list[Figure]:
    """``[[figure]]``: at least one; each a known metric whose ``args`` it accepts."""
    from kvtool.experiments.figures import METRICS, RETIRED_METRICS, SPAN_STATS

    figures: list[Figure] = []
    tables = top.tables("figure")
    if not tables:
        top.fail("missing required [[figure]] (at least one)", top.at("figure"))
    for f in tables:
        f.check_keys(_FIGURE_KEYS)
        claim, unit, name = (f.text(key, required=True, nonempty=True)
                             for key in ("claim", "unit", "metric"))
        if name in RETIRED_METRICS:
            f.fail(RETIRED_METRICS[name], f.at("metric"))
        metric = METRICS.get(name)
        if metric is None:
            f.fail(f"unknown metric (use {', '.join(sorted(METRICS))})", f.at("metric"))
        pub = f.number("published", 0.0) if f.has("published") else None
        args_table = f.table("args")
        args = {} if args_table is None else args_table.data
        problem = metric.check(args, [c.label for c in configs], kind, serving=serving)
        if not problem and "stat" in args and name == "serving_ratio_span" \
                and args["stat"] not in SPAN_STATS:
            problem = f"argument 'stat': use {', '.join(SPAN_STATS)}"
        if problem:
            f.fail(problem, f.at("args"))
        band = None
        if f.has("band"):
            raw = f.array("band")
            if (len(raw) != 2 or not all(isinstance(x, int | float) and not isinstance(x, bool)
                                         for x in raw) or raw[0] > raw[1]):
                f.fail(f"must be [low, high] numbers, got {raw!r}", f.at("band"))
            band = (float(raw[0]), float(raw[1]))
        figures.append(Figure(claim, pub, unit, name, args, f.text("published_text"),
                              f.text("differs", ""), band))
    return figures


def _check_serving(serving: ConfigTable, kind: str) -> None:
    """``[serving]``: the loads parse, phases are known and fit the load and workload."""
    from kvtool.errors import UsageError

    serving.check_keys(_SERVING_KEYS)
    if kind == "parallel-read":
        serving.fail("a parallel-read experiment measures reads: no [serving]")
    loads = serving.text("loads", required=True, nonempty=True)
    try:
        parsed = parse_loads(loads)
    except UsageError as exc:
        serving.fail(exc.message, serving.at("loads"))
    scalars = serving.table("scalars")
    from kvtool.serving.roofline import Scalars

    try:
        Scalars(**({} if scalars is None else scalars.data))
    except TypeError:
        from dataclasses import fields

        names = ", ".join(f.name for f in fields(Scalars))
        serving.fail(f"unknown roofline scalar (use {names})", serving.at("scalars"))
    except UsageError as exc:
        serving.fail(exc.message, serving.at("scalars"))
    serving.integer("num_gpu_blocks", lo=2)
    phases = serving.choice("phases", PHASES, "none")
    if phases == "iterations":
        if kind != "random-prompts":
            serving.fail("phases by iteration need a random-prompts workload",
                         serving.at("phases"))
        if any(ld.kind != "concurrency" for ld in parsed):
            serving.fail("phases by iteration run closed-loop: use concurrency=...",
                         serving.at("loads"))


def experiments_dir() -> Path:
    """``fixtures/experiments`` of the checkout kvtool runs from."""
    return Path(__file__).resolve().parents[2] / "fixtures" / "experiments"


def list_experiments(directory: Path | None = None) -> list[Experiment]:
    d = directory or experiments_dir()
    if not d.is_dir():
        raise InputError("no experiments directory (kvtool runs from a source checkout: "
                         "fixtures/experiments/)", file=d)
    return [load_experiment(p) for p in sorted(d.glob("*.toml"))]


def list_document(experiments: list[Experiment]) -> dict[str, Any]:
    """``kvtool experiment list``'s document (docs/json.md)."""
    return {"schema": "kvtool.experiment-list/1",
            "experiments": [{"name": e.name, "title": e.title, "source": e.source,
                             "claim": e.claim, "kind": e.kind, "scale": e.scale}
                            for e in experiments]}


def find_experiment(name: str, directory: Path | None = None) -> Experiment:
    """An experiment by name, or a path to an experiment file."""
    if name.endswith(".toml") or "/" in name:
        return load_experiment(name)
    d = directory or experiments_dir()
    path = d / f"{name}.toml"
    if not path.exists():
        known = sorted(p.stem for p in d.glob("*.toml")) if d.is_dir() else []
        raise InputError(f"no experiment {name!r} (known: {', '.join(known) or 'none'})",
                         field="NAME")
    return load_experiment(path)


def block_bytes_of(exp: Experiment) -> int | None:
    """Bytes per block (docs/definitions.md): the workload's ``block_bytes``, else its
    model's geometry."""
    from kvtool.geometry import block_size

    w = exp.workload
    tokens = w.get("chunk_tokens") or w.get("block_tokens", 256)
    size = block_size(w.get("model"), dtype=w.get("dtype"), block_tokens=tokens,
                      block_bytes=int(w["block_bytes"]) if "block_bytes" in w else None)
    return size.block_bytes if size else None


PHASES = ("none", "iterations")
"""How a serving experiment groups its requests into back-to-back runs."""


def cluster_path(name: str, exp_path: Path | None) -> Path:
    """A ``[[config]] cluster``: a path (relative to the experiment file), else the stem of
    a file under ``fixtures/clusters/``."""
    p = Path(name)
    if p.suffix in (".toml", ".json") or "/" in name:
        if not p.is_absolute() and exp_path is not None:
            p = exp_path.parent / p
        return p
    return Path(__file__).resolve().parents[2] / "fixtures" / "clusters" / f"{name}.toml"


def parse_loads(text: str) -> list[Any]:
    from kvtool.serving.run import parse_sweep

    return parse_sweep(text)
