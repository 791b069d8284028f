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

from kvtool.configfile import read_config
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
    """Parse and check one experiment file."""
    path = Path(path)
    config = read_config(path, kind="toml")
    doc = config.data
    arrays = ("config", "figure")

    def bad(message: str, key: str, table: str | None = None, nth: int = 0) -> InputError:
        where: tuple[str | int, ...] = (
            (key,) if table is None else (table, nth, key) if table in arrays else (table, key))
        return config.error(message, where)

    if "time" in doc:
        raise bad(TIME_RETIRED, "time")
    for key in doc:
        if key not in _TOP_KEYS:
            raise bad(f"unknown table (use {', '.join(sorted(_TOP_KEYS))})", key)
    head = _table(doc, "experiment", bad)
    for key in head:
        if key not in _EXPERIMENT_KEYS:
            raise bad(f"unknown key (use {', '.join(sorted(_EXPERIMENT_KEYS))})", key, "experiment")
    for key in ("name", "title", "source", "claim", "scale"):
        if not isinstance(head.get(key), str) or not head[key].strip():
            raise bad("required: a non-empty string", key, "experiment")
    if head["name"] != path.stem:
        raise bad(f"must equal the file name's stem {path.stem!r}", "name", "experiment")

    workload = _table(doc, "workload", bad)
    kind = workload.get("kind")
    if kind not in KINDS:
        raise bad(f"must be one of {', '.join(KINDS)}", "kind", "workload")
    allowed = _WORKLOAD_KEYS[kind]
    for key, value in workload.items():
        want = allowed.get(key)
        if want is None:
            raise bad(f"unknown key for kind {kind!r} (use {', '.join(sorted(allowed))})",
                      key, "workload")
        ok = (isinstance(value, int | float) and not isinstance(value, bool)
              if want is float else isinstance(value, want) and not isinstance(value, bool))
        if not ok:
            raise bad(f"must be {want.__name__}, got {value!r}", key, "workload")
        if want is int and value < 0:
            raise bad(f"must not be negative, got {value}", key, "workload")
    for key in _REQUIRED[kind]:
        if key not in workload:
            raise bad(f"required for kind {kind!r}", key, "workload")
    if kind == "parallel-read":
        for t in workload["targets"]:
            if t not in PARALLEL_TARGETS:
                raise bad(f"unknown target {t!r} (use {', '.join(PARALLEL_TARGETS)})",
                          "targets", "workload")
    if kind == "engine-vs-model":
        from kvtool.experiments.engine_model import check_workload

        problem = check_workload(workload)
        if problem:
            key, _, message = problem.partition(": ")
            raise bad(message, key, "workload")
        for table in ("config", "figure", "data", "serving"):
            if table in doc:
                raise bad("an engine-vs-model experiment's rows are its [workload] runs × "
                          "metrics: no [[config]], [[figure]], [data] or [serving]", table)
        return Experiment(head["name"], head["title"], head["source"], head["claim"],
                          head["scale"], kind, workload, [], [], {}, head.get("notes", ""),
                          path)
    if kind == "random-prompts":
        for n in workload["input_lengths"]:
            if not isinstance(n, int) or isinstance(n, bool) or n <= 0:
                raise bad(f"must be positive whole numbers, got {n!r}", "input_lengths",
                          "workload")

    data = doc.get("data", {})
    if not isinstance(data, dict):
        raise bad("must be a table", "data")
    for key, value in data.items():
        if key not in _DATA_KEYS:
            raise bad(f"unknown key (use {', '.join(sorted(_DATA_KEYS))})", key, "data")
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise bad(f"must be a positive whole number, got {value!r}", key, "data")

    serving = doc.get("serving", {})
    if not isinstance(serving, dict):
        raise bad("must be a table", "serving")
    if "serving" in doc:
        _check_serving(serving, kind, bad)
    configs: list[ConfigSpec] = []
    raw_configs = doc.get("config", [])
    if not isinstance(raw_configs, list):
        raise bad("must be an array of tables ([[config]])", "config")
    for i, c in enumerate(raw_configs):
        for key in c:
            if key not in _CONFIG_KEYS:
                raise bad(f"unknown key (use {', '.join(sorted(_CONFIG_KEYS))})", key, "config", i)
        what = "cluster" if serving else "tiers"
        other = "tiers" if serving else "cluster"
        for key in ("label", what):
            if not isinstance(c.get(key), str) or not c[key].strip():
                raise bad("required: a non-empty string", key, "config", i)
        if other in c:
            raise bad(f"a {'serving' if serving else 'replay'} experiment's configurations "
                      f"take {what}, not {other}", other, "config", i)
        if any(ch in c["label"] for ch in ",="):
            raise bad("must not contain ',' or '='", "label", "config", i)
        if any(x.label == c["label"] for x in configs):
            raise bad(f"label {c['label']!r} given twice", "label", "config", i)
        if serving:

            where = cluster_path(c["cluster"], path)
            if not where.is_file():
                raise bad(f"no cluster file {str(where)!r}", "cluster", "config", i)
            configs.append(ConfigSpec(c["label"], "", c["cluster"]))
            continue
        from kvtool.replay.config import parse_compare

        try:
            parse_compare(c["tiers"], policy=None, write_policy=None)
        except InputError as exc:
            raise bad(exc.message, "tiers", "config", i) from None
        configs.append(ConfigSpec(c["label"], c["tiers"]))
    if kind != "parallel-read" and not configs:
        raise bad("a replay experiment needs at least one [[config]]", "config")

    from kvtool.experiments.figures import METRICS, RETIRED_METRICS

    figures: list[Figure] = []
    raw_figures = doc.get("figure", [])
    if not isinstance(raw_figures, list) or not raw_figures:
        raise bad("required: at least one [[figure]]", "figure")
    for i, f in enumerate(raw_figures):
        for key in f:
            if key not in _FIGURE_KEYS:
                raise bad(f"unknown key (use {', '.join(sorted(_FIGURE_KEYS))})", key, "figure", i)
        for key in ("claim", "unit", "metric"):
            if not isinstance(f.get(key), str) or not f[key].strip():
                raise bad("required: a non-empty string", key, "figure", i)
        metric = METRICS.get(f["metric"])
        if f["metric"] in RETIRED_METRICS:
            raise bad(RETIRED_METRICS[f["metric"]], "metric", "figure", i)
        if metric is None:
            raise bad(f"unknown metric (use {', '.join(sorted(METRICS))})", "metric", "figure", i)
        pub = f.get("published")
        if pub is not None and (not isinstance(pub, int | float) or isinstance(pub, bool)):
            raise bad(f"must be a number, got {pub!r}", "published", "figure", i)
        args = f.get("args", {})
        if not isinstance(args, dict):
            raise bad("must be an inline table", "args", "figure", i)
        problem = metric.check(args, [c.label for c in configs], kind, serving=bool(serving))
        if not problem and "stat" in args and f["metric"] == "serving_ratio_span":
            from kvtool.experiments.figures import SPAN_STATS

            if args["stat"] not in SPAN_STATS:
                problem = f"argument 'stat': use {', '.join(SPAN_STATS)}"
        if problem:
            raise bad(problem, "args", "figure", i)
        band = f.get("band")
        if band is not None:
            if (not isinstance(band, list) or len(band) != 2
                    or not all(isinstance(x, int | float) and not isinstance(x, bool)
                               for x in band) or band[0] > band[1]):
                raise bad(f"must be [low, high] numbers, got {band!r}", "band", "figure", i)
            band = (float(band[0]), float(band[1]))
        figures.append(Figure(f["claim"], None if pub is None else float(pub), f["unit"],
                              f["metric"], args, f.get("published_text"), f.get("differs", ""),
                              band))
    return Experiment(head["name"], head["title"], head["source"], head["claim"], head["scale"],
                      kind, workload, configs, figures, data, head.get("notes", ""), path,
                      serving)


def _check_serving(serving: dict[str, Any], kind: str, bad: Any) -> None:
    """``[serving]``: the loads parse, phases are known and fit the load and workload."""
    from kvtool.errors import UsageError

    for key in serving:
        if key not in _SERVING_KEYS:
            raise bad(f"unknown key (use {', '.join(sorted(_SERVING_KEYS))})", key, "serving")
    if kind == "parallel-read":
        raise bad("a parallel-read experiment measures reads: no [serving]", "serving")
    loads = serving.get("loads")
    if not isinstance(loads, str) or not loads.strip():
        raise bad('required: the --sweep syntax, e.g. "concurrency=1,4,16"', "loads", "serving")
    try:
        parsed = parse_loads(loads)
    except UsageError as exc:
        raise bad(exc.message, "loads", "serving") from None
    scalars = serving.get("scalars", {})
    if not isinstance(scalars, dict):
        raise bad("must be an inline table of roofline scalars", "scalars", "serving")
    from kvtool.serving.roofline import Scalars

    try:
        Scalars(**scalars)
    except TypeError:
        from dataclasses import fields

        names = ", ".join(f.name for f in fields(Scalars))
        raise bad(f"unknown roofline scalar (use {names})", "scalars", "serving") from None
    except UsageError as exc:
        raise bad(exc.message, "scalars", "serving") from None
    blocks = serving.get("num_gpu_blocks")
    if blocks is not None and (isinstance(blocks, bool) or not isinstance(blocks, int)
                               or blocks < 2):
        raise bad(f"must be an integer of at least 2, got {blocks!r}", "num_gpu_blocks",
                  "serving")
    phases = serving.get("phases", "none")
    if phases not in PHASES:
        raise bad(f"must be one of {', '.join(PHASES)}", "phases", "serving")
    if phases == "iterations":
        if kind != "random-prompts":
            raise bad("phases by iteration need a random-prompts workload", "phases", "serving")
        if any(ld.kind != "concurrency" for ld in parsed):
            raise bad("phases by iteration run closed-loop: use concurrency=...", "loads",
                      "serving")


def _table(doc: dict[str, Any], key: str, bad: Any) -> dict[str, Any]:
    value = doc.get(key)
    if not isinstance(value, dict):
        raise bad("required table", key)
    return value


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
