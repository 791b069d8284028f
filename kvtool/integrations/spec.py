"""What an engine integration's tiers are: the same tier words as ``kvtool replay``.

A vLLM connector reads them from ``kv_connector_extra_config``, an LMCache plugin from its
``remote_storage_plugin.kvtool.*`` keys, ``kvtool replay --engine vllm`` from its flags::

    {"dram": "1GiB@/dev/shm/kvtool-pool",                      # or "1GiB", or mooncake://…
     "nvme": "nvme+tcp://127.0.0.1:4420/nqn.2026-01.io.kvtool:default/1",   # or SIZE@FILE
     "policy": "lru", "write_policy": "write-through", "tiers": "tiers.toml",
     "hostnqn": "nqn.2014-08.org.nvmexpress:uuid:…",
     "dhchap_secret": "host.key", "dhchap_ctrl_secret": "ctrl.key",   # key *files*
     "read_qd": 32, "commit_interval": 0.25, "reformat": false, "metrics_port": 9400}

``{rank}`` in a place stands for the worker's tensor-parallel rank: each rank keeps its own
blocks (its shard of every layer), so each needs its own namespace or pool file.
Errors are :class:`~kvtool.errors.UsageError`\\ s naming the key as the caller spells it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

import msgspec

from kvtool.cache.names import POLICY_NAMES, WRITE_POLICIES
from kvtool.errors import UsageError
from kvtool.tiers.option import ON_TIER_ERROR, TierOption

KEYS: dict[str, str] = {
    "dram": "the DRAM tier: a size, SIZE@/dev/shm/FILE (outlives the process) or mooncake://",
    "nvme": "the NVMe tier: a place (file, block device, nvme+tcp:// URL) or SIZE@PLACE",
    "policy": "eviction policy of every tier",
    "write_policy": "write-through or write-back",
    "tiers": "a tiers TOML file (per-tier capacity, policy, watermark)",
    "hostnqn": "host NQN presented to an nvme+tcp:// target",
    "dhchap_secret": "DH-HMAC-CHAP: the host's key file (mode 0600)",
    "dhchap_ctrl_secret": "DH-HMAC-CHAP: the controller's key file (bidirectional)",
    "read_qd": "NVMe reads in flight",
    "commit_interval": "seconds between commits of the NVMe tier's new blocks (0: every step)",
    "reformat": "format a place holding a kvtool store of other blocks (erases it)",
    "metrics_port": "serve kvtool's Prometheus metrics on 127.0.0.1:PORT",
    "on_tier_error": "a tier's medium fails: recompute (default: its blocks are misses) or fail",
}
"""The keys a tier spec takes, and what each is."""


class StoreSpec(msgspec.Struct, frozen=True):
    """An engine integration's tiers, as given (nothing opened)."""

    dram: TierOption | None = None
    nvme: TierOption | None = None
    policy: str | None = None
    write_policy: str | None = None
    tiers: str | None = None
    hostnqn: str | None = None
    dhchap_secret: str | None = None
    dhchap_ctrl_secret: str | None = None
    read_qd: int = 32
    commit_interval: float = 0.25
    """Seconds between two commits of the durable tiers (a group commit): an engine step
    completes its writes, and commits them once this long has passed since the last
    commit. What a crash loses is at most this long's blocks, each then a miss, never
    wrong bytes. 0: every step commits."""
    reformat: bool = False
    metrics_port: int | None = None
    on_tier_error: str = "recompute"

    @classmethod
    def parse(cls, values: Mapping[str, Any], *, where: str = "") -> StoreSpec:
        """From a mapping of :data:`KEYS` (other keys are ignored when ``where`` is a
        shared table such as LMCache's ``extra_config``, else refused); ``where`` prefixes
        each key in errors (``kv_connector_extra_config.``)."""
        def field(key: str) -> str:
            return f"{where}{key}"

        unknown = sorted(k for k in values if k not in KEYS)
        if unknown:
            raise UsageError(f"unknown key {unknown[0]!r} (use {', '.join(KEYS)})",
                             field=field(unknown[0]))

        def text(key: str) -> str | None:
            v = values.get(key)
            if v is None:
                return None
            if not isinstance(v, str) or not v.strip():
                raise UsageError(f"expected text ({KEYS[key]}), got {v!r}", field=field(key))
            return v.strip()

        def integer(key: str, default: int | None, lo: int, hi: int) -> int | None:
            v = values.get(key, default)
            if v is None:
                return None
            if isinstance(v, str) and v.strip().isdigit():
                v = int(v)
            if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
                raise UsageError(f"expected a whole number in {lo}..{hi}, got {v!r}",
                                 field=field(key))
            return v

        tiers: dict[str, TierOption | None] = {}
        for name in ("dram", "nvme"):
            t = text(name)
            tiers[name] = None if t is None else TierOption.parse(t, tier=name, field=field(name))
        policy, write_policy = text("policy"), text("write_policy")
        if policy is not None and policy not in POLICY_NAMES:
            raise UsageError(f"unknown policy {policy!r} (use {', '.join(POLICY_NAMES)})",
                             field=field("policy"))
        if policy == "vllm":
            raise UsageError("policy 'vllm' is vLLM's own GPU pool: the engine's KV cache is "
                             "that tier here; give the lower tiers' policy", field=field("policy"))
        if write_policy is not None and write_policy not in WRITE_POLICIES:
            raise UsageError(f"use {' or '.join(WRITE_POLICIES)}, got {write_policy!r}",
                             field=field("write_policy"))
        on_error = text("on_tier_error") or "recompute"
        if on_error not in ON_TIER_ERROR:
            raise UsageError(f"use {' or '.join(ON_TIER_ERROR)}, got {on_error!r}",
                             field=field("on_tier_error"))
        interval = values.get("commit_interval", 0.25)
        if isinstance(interval, str):
            with contextlib.suppress(ValueError):
                interval = float(interval)
        if (not isinstance(interval, int | float) or isinstance(interval, bool)
                or not 0 <= interval <= 3600):
            raise UsageError(f"expected seconds in 0..3600, got {interval!r}",
                             field=field("commit_interval"))
        reformat = values.get("reformat", False)
        if isinstance(reformat, str) and reformat.lower() in ("true", "false"):
            reformat = reformat.lower() == "true"
        if not isinstance(reformat, bool):
            raise UsageError(f"expected true or false, got {reformat!r}", field=field("reformat"))
        spec = cls(dram=tiers["dram"], nvme=tiers["nvme"], policy=policy,
                   write_policy=write_policy, tiers=text("tiers"), hostnqn=text("hostnqn"),
                   dhchap_secret=text("dhchap_secret"),
                   dhchap_ctrl_secret=text("dhchap_ctrl_secret"),
                   read_qd=integer("read_qd", 32, 1, 1024) or 32,
                   commit_interval=float(interval), reformat=reformat,
                   metrics_port=integer("metrics_port", None, 0, 65535),
                   on_tier_error=on_error)
        if spec.dram is None and spec.nvme is None and spec.tiers is None:
            raise UsageError(f"no tier: give {field('dram')} and/or {field('nvme')} (example: "
                             '"dram": "1GiB", "nvme": "nvme+tcp://127.0.0.1:4420/NQN/1")',
                             field=field("nvme"))
        return spec

    def for_rank(self, rank: int) -> StoreSpec:
        """This spec with ``{rank}`` in its places replaced by ``rank``."""
        def sub(opt: TierOption | None) -> TierOption | None:
            if opt is None or opt.place is None or "{rank}" not in opt.place:
                return opt
            return TierOption(opt.capacity, opt.place.replace("{rank}", str(rank)))
        return msgspec.structs.replace(self, dram=sub(self.dram), nvme=sub(self.nvme))

    def unranked_places(self) -> list[str]:
        """The places (of the DRAM and NVMe tiers) that do not name ``{rank}``: ranks of a
        TP>1 engine would share them (a size alone is a pool in the process: none)."""
        places = [o.place for o in (self.dram, self.nvme) if o is not None and o.place]
        return [p for p in places if "{rank}" not in p]

    def to_dict(self) -> dict[str, Any]:
        """The spec as its keys (secrets are file names; nothing here is key material)."""
        out: dict[str, Any] = {}
        for key in KEYS:
            v = getattr(self, key)
            if v is not None and v is not False:
                out[key] = str(v) if isinstance(v, TierOption) else v
        return out
