"""Preparing a replay: the settings checked, the trace read, the configurations resolved
(tier options, ``--tiers`` file, ``--compare``, the default profile) and, in data mode,
places and capacities resolved against this machine. Nothing runs yet."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec

from kvtool.cache.replayer import CacheConfig, TierSpec
from kvtool.errors import UsageError, param
from kvtool.replay.config import TiersFile, build_config, load_tiers_file, parse_compare
from kvtool.replay.job import ReplayJob
from kvtool.replay.media import mem_available
from kvtool.replay.places import default_nvme_place
from kvtool.replay.settings import (
    DEFAULT_MODEL,
    DEFAULT_PROFILE,
    MEMORY_SHARE,
    ReplaySettings,
    check_settings,
)
from kvtool.tiers.option import TierOption
from kvtool.units import Capacity, format_size


def prepare(s: ReplaySettings, *, on_event: Callable[[str], None] | None = None) -> ReplayJob:
    """Check the settings, read the trace, resolve configurations and (data mode)
    capacities against this machine; run nothing yet."""
    from kvtool.trace import read_trace

    check_settings(s)
    tf: TiersFile | None = load_tiers_file(s.tiers_file) if s.tiers_file else None
    # A simulation writing no file while it runs (--iolog, --requests-csv) may meet a bad
    # block id when it reaches the line: its output comes at the end, and pass 1 is faster.
    reader = read_trace(s.trace, fmt=s.fmt, block_tokens=s.block_tokens, skip_bad=s.skip_bad,
                        late_id_checks=(s.simulate and s.iolog is None
                                        and s.requests_csv is None))
    B = reader.block_tokens
    data = not s.simulate
    from kvtool.geometry.blocksize import block_size

    model, dtype = s.model, s.dtype
    given = any(not t.is_zero for t in s.tiers.values()) or tf is not None or bool(s.compares)
    default_model = model is None and s.block_bytes is None and (data or not given)
    if default_model:
        model, dtype = DEFAULT_MODEL[0], dtype or DEFAULT_MODEL[1]
    try:
        size = block_size(model, dtype=dtype, tp=s.tp, block_tokens=B,
                          block_bytes=s.block_bytes)
    except UsageError:
        if not default_model or s.tp is not None:
            raise
        # The default model's geometry does not divide this trace's blocks (e.g. 16-token
        # blocks): keep its bytes per token instead of refusing a plain `kvtool replay`.
        ref = block_size(model, dtype=dtype, block_tokens=256)
        assert ref is not None
        size = block_size(None, block_tokens=B, block_bytes=-(-ref.block_bytes * B // 256))
    block_bytes = size.block_bytes if size else None
    configs: list[CacheConfig] = []
    defaults = not given
    if defaults:
        from kvtool.target import default as default_target

        # --simulate: the same profile, with the default target's namespace as the NVMe size
        nvme = (TierOption(None, "<default>") if data else
                TierOption(Capacity(default_target.NAMESPACE_BYTES, "bytes")))
        if not data and on_event is not None:
            on_event("no tier options: the data-mode default profile, simulated: "
                     + ", ".join(f"{n} {c} {p}" for n, (c, p) in DEFAULT_PROFILE.items())
                     + f", nvme {format_size(default_target.NAMESPACE_BYTES)} lru (the default "
                     f"target's namespace); {size.model if size else ''} "
                     f"{size.dtype if size else ''} blocks")
        configs.append(build_config(
            {n: TierOption(Capacity.parse(c)) for n, (c, _p) in DEFAULT_PROFILE.items()}
            | {"nvme": nvme},
            policy=s.policy, write_policy=s.write_policy, watermark=s.watermark,
            evict_ratio=s.evict_ratio,
            tier_policies=None if s.policy else {n: p for n, (_c, p) in DEFAULT_PROFILE.items()}))
    else:
        if any(not t.is_zero for t in s.tiers.values()) or tf is not None or not s.compares:
            configs.append(build_config(dict(s.tiers), policy=s.policy,
                                        write_policy=s.write_policy, watermark=s.watermark,
                                        evict_ratio=s.evict_ratio, tiers_file=tf))
        configs += [parse_compare(spec, policy=s.policy, write_policy=s.write_policy)
                    for spec in s.compares]
    setup: dict[str, Any] = {"mode": "data" if data else "simulate",
                             "model": size.model if size else None,
                             "dtype": size.dtype if size else None, "block_tokens": B,
                             "block_bytes": block_bytes, "defaults": defaults,
                             "block_size": size.to_dict() if size else None}
    job = ReplayJob(s, reader, configs, B, block_bytes, setup, on_event=on_event)
    if data:
        assert block_bytes is not None
        prepare_data(job)
    else:
        for cfg in configs:
            for spec in cfg.tiers:
                if spec.place is not None:
                    raise UsageError(f"{spec.place}: {param('simulate')} moves no bytes, so a tier "
                                     "takes a capacity, not a place", field=f"{spec.name}")
        setup["configs"] = [{"label": c.label} for c in configs]
    return job


def prepare_data(job: ReplayJob) -> None:
    """Resolve places and capacities, and check that this machine holds them."""
    s, B, bb = job.settings, job.block_tokens, job.block_bytes
    assert bb is not None
    distinct: set[int] = set()
    work = 1
    for r in job.requests():
        distinct.update(r.block_keys)
        work = max(work, len(r.block_keys))
    job.work_blocks = work
    job.setup["trace_blocks"] = len(distinct)
    setups = []
    resolved = []
    for cfg in job.configs:
        specs: list[TierSpec] = []
        tiers_setup: dict[str, Any] = {}
        for spec in cfg.tiers:
            if spec.name == "dram" and spec.place is not None and spec.capacity.unit == "inf":
                # A Mooncake pool's size is what its clients contribute, and this replay is
                # the client: without a size it contributes the default profile's DRAM.
                spec = msgspec.structs.replace(
                    spec, capacity=Capacity.parse(DEFAULT_PROFILE["dram"][0]))
            if spec.name in ("gpu", "dram"):
                if spec.capacity.unit == "inf":
                    raise UsageError(f"data mode holds real bytes: the {spec.name} tier needs "
                                     f"a size (use {param('simulate')} for an unbounded tier)",
                                     field=f"{spec.name}")
                specs.append(spec)
                tiers_setup[spec.name] = {"capacity": str(spec.capacity),
                                          "blocks": int(spec.blocks(bb, B)),
                                          "policy": spec.policy}
                if spec.place is not None:
                    tiers_setup[spec.name]["place"] = spec.place
                continue
            place, why, create = spec.place, "given", None
            if place in (None, "<default>"):
                place, why, create = default_nvme_place()
            assert place is not None
            if create is not None:
                job.create[place] = create
            cap = spec.capacity
            spec = msgspec.structs.replace(spec, place=place)
            specs.append(spec)
            tiers_setup["nvme"] = {"capacity": str(cap) if cap.unit != "inf" else "all of it",
                                   "place": place, "why": why, "policy": spec.policy}
        new = CacheConfig(specs, cfg.write_policy, cfg.label if not job.setup["defaults"] else "")
        resolved.append(new)
        # memory: the GPU pool and DRAM pools of this configuration
        need = 0
        for spec in new.tiers:
            if spec.name in ("gpu", "dram"):
                need += (int(spec.blocks(bb, B)) + job.work_blocks) * bb
        if not any(t.name == "gpu" for t in new.tiers):
            need += job.work_blocks * bb
        avail = mem_available()
        if avail is not None and need > MEMORY_SHARE * avail:
            raise UsageError(
                f"data mode needs {format_size(need)} of memory for the {new.label} pools, but "
                f"this machine has {format_size(avail)} available; use {param('simulate')} for "
                "what-ifs no machine holds", field="dram")
        setups.append({"label": new.label, "write_policy": new.write_policy,
                       "tiers": tiers_setup, "memory_bytes": need})
    job.configs = resolved
    job.setup["configs"] = setups
    job.setup["read_qd"] = s.read_qd
    job.setup["seed"] = s.seed
    job.setup["work_blocks"] = job.work_blocks
    job.setup["on_tier_error"] = s.on_tier_error
