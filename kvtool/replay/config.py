"""Cache configurations from a TOML tiers file and from ``--compare`` specs.

Tiers file (``kvtool replay --tiers FILE.toml``; every key optional)::

    write_policy = "write-back"        # or "write-through" (default)
    [gpu]
    capacity = "2GiB"                  # bytes, 5859blk, 3000000tok or inf
    policy = "lru-tail-first"
    [dram]
    capacity = "429.5GB"
    policy = "lru"                     # or vllm-lru, vllm-arc, arc, s3fifo, lfu, ...
    admit_after = 2                    # admission: store a block on its 2nd offer
    admit_ttl = 1000                   #   offers counted within 1000 requests
    watermark = 0.90                   # Mooncake batch eviction: evict ratio×used
    evict_ratio = 0.05                 #   when more than watermark×capacity is used
    [nvme]
    capacity = "46.09TB"               # or a place: "/dev/loop3", "2GiB@/var/tmp/kv.img",
                                       # "nvme+tcp://127.0.0.1:4420/NQN/1" (data mode)

A ``[time]`` table is refused: the replay time model it configured (``cache/timemodel.py``)
was retired; a replay's times come from the serving model (``--concurrency``,
``--read-gbps``, ``--engine-gpu``, or a cluster file with ``--cluster``).

Compare spec (``--compare``, repeatable): comma-separated ``key=value`` with keys
``gpu``, ``dram``, ``nvme`` (capacities; for ``nvme`` also a place,
``nvme=2GiB@/var/tmp/kv.img``), ``policy`` (all tiers), ``gpu-policy`` /
``dram-policy`` / ``nvme-policy``, ``write-policy``, ``watermark``, ``evict-ratio`` and
``label``; e.g. ``dram=53.7GB,nvme=46.09TB,policy=lru,label=DRAM/8+NVMe``.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from kvtool.cache.names import POLICY_NAMES, WRITE_POLICIES
from kvtool.cache.policies import POLICIES, WATERMARK_DEFAULTS
from kvtool.cache.replayer import CacheConfig, TierSpec
from kvtool.cache.tier import TIER_NAMES, Watermark
from kvtool.errors import InputError, UsageError
from kvtool.tiers.option import TierOption
from kvtool.units import Capacity

if TYPE_CHECKING:
    from kvtool.configfile import ConfigTable

_TIER_KEYS = {"capacity", "policy", "watermark", "evict_ratio", "window", "admit_after",
              "admit_ttl"}
_TOP_KEYS = {"write_policy", *TIER_NAMES}
TIME_RETIRED = ("the [time] table was retired with the replay time model (cache/timemodel.py): "
                "a replay's times come from the serving model; give --concurrency N, "
                "--read-gbps TIER=GBPS and --engine-gpu GPU on the command line, or a cluster "
                "file (--cluster FILE; docs/serving.md)")
"""The one line a ``[time]`` table in a tiers file gets (issue 38: one time model)."""


class TierOptions(msgspec.Struct):
    """What a tiers file says about one tier (``None``: not said)."""

    capacity: TierOption | None = None
    policy: str | None = None
    watermark: float | None = None
    evict_ratio: float | None = None
    window: int | None = None
    admit_after: int | None = None
    admit_ttl: int | None = None


class TiersFile(msgspec.Struct):
    """A parsed tiers file."""

    tiers: dict[str, TierOptions] = msgspec.field(default_factory=dict)
    write_policy: str | None = None


def load_tiers_file(path: str | Path) -> TiersFile:
    """Parse and check a tiers file; errors name the file, line and field."""
    from kvtool.configfile import read_config  # only with --tiers (start-up time)

    doc = read_config(path, kind="toml")

    def bad(message: str, key: str, table: str | None = None) -> InputError:
        return doc.error(message, (*table.split("."), key) if table else (key,))

    top = doc.table()
    if top.has("time"):
        raise bad(TIME_RETIRED, "time")
    top.check_keys(_TOP_KEYS)
    out = TiersFile(write_policy=top.choice("write_policy", WRITE_POLICIES))
    for name in TIER_NAMES:
        table = top.table(name)
        if table is not None:
            out.tiers[name] = _tier_table(table)
    return out


def _tier_table(t: ConfigTable) -> TierOptions:
    t.check_keys(_TIER_KEYS)
    name = str(t.path[-1])
    opts = TierOptions(policy=t.choice("policy", POLICY_NAMES), window=_count(t, "window"),
                       admit_after=_count(t, "admit_after"), admit_ttl=_count(t, "admit_ttl"),
                       watermark=_fraction(t, "watermark"),
                       evict_ratio=_fraction(t, "evict_ratio"))
    if t.has("capacity"):
        value = t.data["capacity"]
        try:
            opts.capacity = TierOption.parse(
                str(value) if isinstance(value, str | int) else "?", tier=name)
        except UsageError as exc:
            t.fail(exc.message, t.at("capacity"))
    return opts


def _count(t: ConfigTable, key: str) -> int | None:
    return t.integer(key, lo=1)


def _fraction(t: ConfigTable, key: str) -> float | None:
    """A fraction in (0, 1] (NaN fails too)."""
    if not t.has(key):
        return None
    value = t.number(key, 0.0)
    if not 0 < value <= 1:
        t.fail(f"must be a fraction in (0, 1], got {t.data[key]!r}", t.at(key))
    return value


def make_watermark(policy: str, high: float | None, ratio: float | None) -> Watermark | None:
    """The watermark a tier gets: explicit values, else the policy's implied one."""
    if high is None and ratio is None:
        if policy in WATERMARK_DEFAULTS:
            return Watermark(*WATERMARK_DEFAULTS[policy])
        return None
    return Watermark(high if high is not None else 0.90, ratio if ratio is not None else 0.05)


def default_policy(tier: str, capacity: Capacity) -> str:
    """The policy of a tier nobody chose one for: vLLM's own pool for a finite GPU tier
    (``--gpu N`` is vLLM's ``num_gpu_blocks``), head-first LRU elsewhere."""
    return "vllm" if tier == "gpu" and not capacity.is_infinite else "lru"


def build_config(capacities: Mapping[str, TierOption | Capacity | None], *, policy: str | None,
                 write_policy: str | None, watermark: float | None = None,
                 evict_ratio: float | None = None, tier_policies: dict[str, str] | None = None,
                 tiers_file: TiersFile | None = None, label: str = "") -> CacheConfig:
    """One configuration from command-line values layered over a tiers file.

    Precedence, per item: the command line, then the tiers file, then the defaults
    (policy ``vllm`` for a finite GPU tier, else ``lru``; write policy ``write-through``;
    no watermark).
    """
    tf = tiers_file or TiersFile()
    specs = []
    for name in TIER_NAMES:
        opts = tf.tiers.get(name, TierOptions())
        given = capacities.get(name)
        opt = TierOption(given) if isinstance(given, Capacity) else given
        opt = opt or opts.capacity
        if opt is None or opt.is_zero:
            continue
        cap = opt.capacity if opt.capacity is not None else Capacity.parse("inf")
        every = policy if policy != "vllm" or name == "gpu" else None  # vllm: the GPU's pool
        pol = ((tier_policies or {}).get(name) or every or opts.policy
               or default_policy(name, cap))
        wm = make_watermark(pol, watermark if watermark is not None else opts.watermark,
                            evict_ratio if evict_ratio is not None else opts.evict_ratio)
        specs.append(TierSpec(name, cap, pol, wm, opts.window, place=opt.place,
                              admit_after=opts.admit_after, admit_ttl=opts.admit_ttl))
    wp = write_policy or tf.write_policy or "write-through"
    return CacheConfig(specs, wp, label)  # type: ignore[arg-type]


def parse_compare(spec: str, *, policy: str | None, write_policy: str | None) -> CacheConfig:
    """A ``--compare`` spec → configuration (other tiers come not from the base config)."""
    caps: dict[str, TierOption | Capacity | None] = {}
    tier_policies: dict[str, str] = {}
    values: dict[str, str] = {}
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        key, eq, value = part.partition("=")
        key, value = key.strip().lower(), value.strip()
        if not eq or not value:
            raise UsageError(f"{part!r} in {spec!r} is not key=value "
                             "(example: dram=53.7GB,nvme=46.09TB)", field="compare")
        if key in TIER_NAMES:
            caps[key] = TierOption.parse(value, tier=key, field="compare")
        elif key.endswith("-policy") and key[:-7] in TIER_NAMES:
            tier_policies[key[:-7]] = value
        elif key in {"policy", "write-policy", "watermark", "evict-ratio", "label"}:
            values[key] = value
        else:
            raise UsageError(f"unknown key {key!r} in {spec!r} (use gpu, dram, nvme, policy, "
                             "gpu-policy, dram-policy, nvme-policy, write-policy, watermark, "
                             "evict-ratio, label)", field="compare")
    if not any(c is not None and not c.is_zero for c in caps.values()):
        raise UsageError(f"{spec!r} names no tier with a non-zero size", field="compare")
    for pol in [values.get("policy"), *tier_policies.values()]:
        if pol is not None and pol not in POLICIES:
            raise UsageError(f"unknown policy {pol!r} in {spec!r} (use {', '.join(POLICIES)})",
                             field="compare")
    fractions = {}
    for key in ("watermark", "evict-ratio"):
        if key in values:
            try:
                f = float(values[key])
            except ValueError:
                f = -1.0
            if not 0 < f <= 1:
                raise UsageError(f"{key} must be a fraction in (0, 1], got {values[key]!r}",
                                 field="compare")
            fractions[key] = f
    return build_config(caps, policy=values.get("policy", policy),
                        write_policy=values.get("write-policy", write_policy),
                        watermark=fractions.get("watermark"),
                        evict_ratio=fractions.get("evict-ratio"),
                        tier_policies=tier_policies,
                        label=values.get("label", ""))
