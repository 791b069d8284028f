"""``kvtool replay`` as a library call: typed settings in, the report document out.

::

    from kvtool.replay.run import ReplaySettings, prepare
    job = prepare(ReplaySettings("trace.jsonl"))        # data mode, default tiers
    print(job.setup)                                     # what it chose (sizes, URL, model)
    doc = job.run()                                      # schema kvtool.replay/2

Two modes (docs/replay.md):

* **data** (default): every tier holds real bytes — the CPU "GPU" pool, a DRAM pool and an
  NVMe tier on kvtool's object store (:mod:`kvtool.replay.data`). Without tier options it
  uses the default profile (:data:`DEFAULT_PROFILE`) and puts the NVMe tier on the running
  built-in target (``kvtool target up``), else on a store file in the cache directory;
* **simulate** (``--simulate``): the replayer only, for what-ifs no machine holds.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from kvtool.cache.replayer import CacheConfig, RequestOutcome, TierSpec, replay
from kvtool.errors import UsageError, param
from kvtool.fanout import Fanout
from kvtool.gcpause import cyclic_gc_paused
from kvtool.replay.config import (
    TiersFile,
    build_config,
    load_tiers_file,
    parse_compare,
)
from kvtool.tiers.option import ON_TIER_ERROR, TierOption
from kvtool.trace.stats import MaxHitRatio
from kvtool.units import Capacity, format_size

if TYPE_CHECKING:
    from kvtool.cache.iolog import IologWriter
    from kvtool.nvme.hostauth import HostCredentials
    from kvtool.replay.timing import ReplayTiming
    from kvtool.tiers.base import DataTier

# Data mode (kvtool.replay.data, kvtool.tiers: numpy, the store) is imported when a data-mode
# run starts, so that --simulate starts fast (bench/startup.py).

SCHEMA = "kvtool.replay/2"

DEFAULT_MODEL = ("deepseek-v4-flash", "fp8")
"""Model whose block size data mode uses when neither --model nor --block-bytes is given."""

DEFAULT_PROFILE: dict[str, tuple[str, str]] = {
    "gpu": ("128MiB", "vllm"),
    "dram": ("256MiB", "lru"),
}
"""Default data-mode tiers (capacity, policy): a small GPU pool with vLLM's own prefix-cache
semantics (:class:`kvtool.cache.policies.VllmPolicy`) and a Mooncake-like DRAM tier; the
NVMe tier is the default place."""

DEFAULT_NVME_FILE_BYTES = 1 << 30
"""Size of the store file the NVMe tier uses when no kvtool target is up (allocated on
disk when created; the default target's memory-backed namespace is larger)."""

MEMORY_SHARE = 0.8
"""Data mode refuses pools larger than this share of the memory available now."""


def cache_dir() -> Path:
    env = os.environ.get("KVTOOL_CACHE_DIR")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "kvtool"


def mem_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


class ReplaySettings(msgspec.Struct):
    """Everything ``kvtool replay`` takes, as typed values (CLI options map 1:1)."""

    trace: str
    fmt: str = "auto"
    block_tokens: int | None = None
    skip_bad: int = 0
    simulate: bool = False
    tiers: dict[str, TierOption] = msgspec.field(default_factory=dict)
    policy: str | None = None
    tiers_file: str | None = None
    write_policy: str | None = None
    watermark: float | None = None
    evict_ratio: float | None = None
    compares: Sequence[str] = ()
    model: str | None = None
    dtype: str | None = None
    tp: int | None = None
    block_bytes: int | None = None
    read_gbps: dict[str, float] = msgspec.field(default_factory=dict)
    concurrency: int | None = None
    engine_gpu: str | None = None
    """The GPU of the one-engine case that times the replay (kvtool.replay.timing)."""
    times: str = "serving"
    """Where the report's times come from: ``serving`` (the serving model's one-engine
    case) or ``none`` (null: ``--no-times``). There is no other time model."""
    exact_steps: bool = False
    """The serving model's engines schedule every step on its own (the same times;
    :mod:`kvtool.serving.engine`)."""
    read_qd: int = 16
    write_qd: int = 16
    seed: int = 0
    on_tier_error: str = "fail"
    requests_csv: str | None = None
    iolog: str | None = None
    """--simulate: write the NVMe tier's block I/O as a fio iolog here (kvtool.cache.iolog)."""
    iolog_version: int = 3
    credentials: HostCredentials | None = None  # nvme+tcp:// places: host NQN, DH-HMAC-CHAP


def _open_iolog(job: ReplayJob) -> IologWriter | None:
    """The NVMe tier's fio iolog writer (``--iolog``), checked against the job."""
    s = job.settings
    if s.iolog is None:
        return None
    from kvtool.cache.iolog import IOLOG_VERSIONS, IologWriter

    if s.iolog_version not in IOLOG_VERSIONS:
        raise UsageError(f"use 2 or 3, got {s.iolog_version}", field="iolog_version")
    if len(job.configs) != 1:
        raise UsageError(f"writes one configuration's I/O: drop {param('compare')}", field="iolog")
    if "nvme" not in [t.name for t in job.configs[0].tiers]:
        raise UsageError(f"logs the NVMe tier's I/O: give {param('nvme')}", field="iolog")
    if not job.block_bytes:
        raise UsageError(f"needs the block size in bytes: give {param('model')} or "
                         f"{param('block_bytes')}", field="iolog")
    return IologWriter(s.iolog, block_bytes=job.block_bytes, version=s.iolog_version)


def _clocked(requests: Any, log: IologWriter | None) -> Any:
    """``requests``, setting the iolog's clock to each request's timestamp before it is served."""
    if log is None:
        return requests
    return (_stamp(log, r) for r in requests)


def _stamp(log: IologWriter, r: Any) -> Any:
    log.at(r.timestamp)
    return r


def _measured(requests: Any, maximum: MaxHitRatio) -> Any:
    """``requests``, each added to ``maximum`` (the trace's unbounded hit ratio) as it
    passes: the replay's one pass over the trace serves both."""
    add = maximum.add
    for r in requests:
        add(r.block_keys, r.input_length, r.block_tokens)
        yield r


def _check(s: ReplaySettings) -> None:
    if s.concurrency is not None and s.concurrency < 1:
        raise UsageError(f"must be at least 1, got {s.concurrency}", field="concurrency")
    if s.read_qd < 1:
        raise UsageError(f"must be at least 1, got {s.read_qd}", field="read_qd")
    if s.times not in ("serving", "none"):
        raise UsageError(f"use serving or none, got {s.times!r}", field="times")
    for tier, rate in s.read_gbps.items():
        if not rate > 0:
            raise UsageError(f"must be a positive number, got {rate!r}",
                             field=f"read_gbps.{tier}")
    if s.on_tier_error not in ON_TIER_ERROR:
        raise UsageError(f"use {' or '.join(ON_TIER_ERROR)}", field="on_tier_error")
    if s.iolog is not None and not s.simulate:
        raise UsageError(f"logs the simulated NVMe layout: add {param('simulate')} (data mode's "
                         "offsets are the object store's; trace the device itself there)",
                         field="iolog")


class ReplayJob(msgspec.Struct):
    """A prepared replay: the trace read, configurations resolved, nothing run yet."""

    settings: ReplaySettings
    reader: Any
    configs: list[CacheConfig]
    block_tokens: int
    block_bytes: int | None
    setup: dict[str, Any]
    """What was chosen (mode, model, block size, tiers, places): printed before the run."""
    work_blocks: int = 0
    _sink: Callable[[int, RequestOutcome], None] | None = None
    create: dict[str, int] = msgspec.field(default_factory=dict)
    on_event: Callable[[str], None] | None = None
    interrupted: bool = False

    @property
    def mode(self) -> str:
        return "simulate" if self.settings.simulate else "data"

    @property
    def total(self) -> int:
        """Requests to serve in all (every configuration replays the whole trace)."""
        return len(self.reader) * (len(self.configs) if self.mode == "data" else 1)

    def run(self, progress: Callable[[int], None] | None = None,
            on_request: Callable[[int, RequestOutcome], None] | None = None,
            fanout: Fanout | None = None) -> dict[str, Any]:
        """Replay and return the report (schema :data:`SCHEMA`, docs/json.md).

        ``on_request(i, outcome)`` receives every request's accounting for configuration
        ``i`` (besides ``--requests-csv``). A ``KeyboardInterrupt`` stops the run cleanly:
        the report covers the requests served so far and says ``"interrupted": true``.
        ``fanout`` (:mod:`kvtool.fanout`): with ``--simulate``, several configurations and
        no per-request output, each configuration (its replay and its times) is a point
        run side by side; the report is the serial run's.
        """
        if (fanout is not None and fanout.kind != "serial" and self.mode == "simulate"
                and len(self.configs) > 1 and on_request is None
                and not self.settings.requests_csv and self.settings.iolog is None):
            return self._run_fanned(fanout, progress)
        per_request = None
        if self.settings.requests_csv:
            from kvtool.cache.report import RequestCsv

            per_request = RequestCsv(self.settings.requests_csv, [c.label for c in self.configs])
        sinks = [f for f in (per_request, on_request) if f is not None]
        # (a Ctrl-C while the serving model times the trace stops the command: nothing
        # has been replayed yet, so there is no partial report to give)
        timing = self._timing() if self.settings.times == "serving" else None
        sink: Callable[[int, RequestOutcome], None] | None = None
        if sinks:
            def sink(i: int, outcome: RequestOutcome) -> None:
                if timing is not None:
                    # a request's TTFT is the serving model's (the report's times)
                    outcome = outcome._replace(ttft_s=timing.ttft(i, outcome.line))
                for f in sinks:
                    f(i, outcome)
        self._sink = sink
        maximum = MaxHitRatio()
        try:
            if self.mode == "simulate":
                log = _open_iolog(self)
                try:
                    # the timed run has decoded the trace already: replay that list
                    source = timing.requests if timing is not None else self.reader
                    results = replay(_clocked(_measured(source, maximum), log), self.configs,
                                     block_tokens=self.block_tokens,
                                     block_bytes=self.block_bytes,
                                     progress=progress, on_request=sink,
                                     movers=[{"nvme": log}] if log is not None else None)
                finally:
                    if log is not None:
                        log.close()
                if log is not None:
                    results[0]["iolog"] = log.summary()
                for r in results:
                    _simulated(r)
            else:
                results = [self._run_data(i, cfg, progress) for i, cfg in enumerate(self.configs)
                           if not self.interrupted]
                if not self.interrupted:
                    for r in self.reader:
                        maximum.add(r.block_keys, r.input_length, r.block_tokens)
        finally:
            if per_request is not None:
                per_request.close()
        return self._report(results, timing, maximum)

    def _run_fanned(self, fanout: Fanout, progress: Callable[[int], None] | None
                    ) -> dict[str, Any]:
        """:meth:`run` with each configuration a point of ``fanout``."""
        from kvtool.replay.timing import ReplayTiming

        requests = list(self.reader)
        maximum = MaxHitRatio()
        for r in requests:
            maximum.add(r.block_keys, r.input_length, r.block_tokens)
        timing_kwargs = self._timing_kwargs() if self.settings.times == "serving" else None
        points = _ConfigPoints(requests, self.configs, self.block_tokens, self.block_bytes,
                               timing_kwargs)
        share = len(requests) // len(self.configs)

        def done(_i: int) -> None:
            if progress is not None:
                progress(share)
        out = fanout.map(_run_config_point, points, len(self.configs), done)
        results = []
        for r, _t in out:
            _simulated(r)
            results.append(r)
        timing = None
        if timing_kwargs is not None:
            timing = ReplayTiming(requests, [t for _r, t in out],
                                  {r.line: i for i, r in enumerate(requests)})
        return self._report(results, timing, maximum)

    def _report(self, results: list[dict[str, Any]], timing: ReplayTiming | None,
                maximum: MaxHitRatio) -> dict[str, Any]:
        for i, r in enumerate(results):
            if timing is not None and not self.interrupted:
                timing.apply(i, r)
            else:
                timing_off(r, "interrupted" if self.interrupted else "--no-times")
        for r in results:
            _one_shape(r)
        bad = [{"line": line, "message": msg} for line, msg in self.reader.bad_lines]
        head = {"schema": SCHEMA, "trace": self.settings.trace, "format": self.reader.format,
                "mode": self.mode, "block_tokens": self.block_tokens,
                "block_bytes": self.block_bytes, "block_size": self.setup["block_size"],
                "setup": self.setup, "bad_lines": bad, "interrupted": self.interrupted}
        # "% of max": the trace's hit ratio with unbounded tiers (trace stats)
        tail = {"max_token_hit_ratio": None if self.interrupted else maximum.ratio}
        if len(results) == 1:
            return {**head, **results[0], **tail}
        return {**head, "configs": results, **tail}

    def _timing(self) -> ReplayTiming:
        """Each configuration's times from the serving model's one-engine case
        (:mod:`kvtool.replay.timing`), computed before the replay so that per-request
        outputs carry them too."""
        from kvtool.replay.timing import ReplayTiming

        with cyclic_gc_paused():  # the requests and their block keys: no cycles
            requests = list(self.reader)
        return ReplayTiming.run(requests, self.configs, **self._timing_kwargs())

    def _timing_kwargs(self) -> dict[str, Any]:
        """The one-engine case's parameters (:func:`kvtool.replay.timing.one_engine_times`)
        but the requests and the configuration."""
        s = self.settings
        return {"block_tokens": self.block_tokens, "block_bytes": self.block_bytes,
                "model": self.setup.get("model"), "dtype": self.setup.get("dtype"), "tp": s.tp,
                "gpu": s.engine_gpu, "concurrency": s.concurrency,
                "read_gbps": dict(s.read_gbps), "timed": self.reader.timed,
                "exact_steps": s.exact_steps}

    # -------------------------------------------------------------- data mode
    def _fits(self, caps: dict[str, int]) -> None:
        """One line when the trace's blocks outnumber the largest tier (write-through:
        it bounds what the hierarchy holds), with the size that would hold them."""
        n = self.setup.get("trace_blocks") or 0
        name, most = max(caps.items(), key=lambda kv: kv[1], default=("", 0))
        if self.on_event is not None and self.block_bytes and n > most:
            need = format_size(n * self.block_bytes)
            self.on_event(f"the trace's {n:,} distinct blocks ({need}) do not fit the largest "
                          f"tier ({name}: {most:,} blocks): hits fall as blocks are evicted "
                          f"before reuse; to hold them all give an NVMe tier of {need} or "
                          "more (--nvme SIZE@FILE, or a bigger target namespace)")

    def _run_data(self, index: int, cfg: CacheConfig,
                  progress: Callable[[int], None] | None) -> dict[str, Any]:
        assert self.block_bytes is not None
        s = self.settings
        tiers, media, cfg = open_tiers(cfg, self.block_bytes, self.work_blocks, s, self.setup,
                                       self.create)
        if self.setup["defaults"]:  # the label names the NVMe tier's real capacity
            cfg = msgspec.structs.replace(cfg, label="")
        if self.on_event is not None:
            caps = {t.name: int(t.blocks(self.block_bytes, self.block_tokens)) for t in cfg.tiers}
            if "nvme" in tiers:
                nv = next(t for t in cfg.tiers if t.name == "nvme")
                self.on_event(f"nvme tier: {caps['nvme']:,} blocks "
                              f"({format_size(caps['nvme'] * self.block_bytes)}) on {nv.place}")
            self._fits(caps)
        from kvtool.replay.data import DataReplayer

        try:
            sink = self._sink
            eng = DataReplayer(cfg, self.block_tokens, self.block_bytes, tiers=tiers,
                             work_blocks=self.work_blocks, seed=s.seed,
                             on_tier_error=s.on_tier_error,
                             on_event=self.on_event,
                             on_request=None if sink is None else
                             (lambda o: sink(index, o)))
        except BaseException:
            for t in tiers.values():
                t.close()
            raise
        served = 0
        try:
            try:
                for req in self.reader:
                    eng.feed(req)
                    served += 1
                    if progress is not None:
                        progress(1)
            except KeyboardInterrupt:
                self.interrupted = True
            eng.persist()
            out = eng.result()
            out["requests_served"] = served
            if media is not None:
                out["media"] = media.finish(tiers.get("nvme"), out)
            return out
        finally:
            eng.close()


DATA_FIELDS: dict[str, Any] = {
    "time_basis": {"load": "modelled", "prefill": "modelled", "decode": "modelled"},
    "verified_blocks": None, "corrupt_blocks": None, "lost_blocks": None,
    "recomputed_blocks": None, "repaired_blocks": None, "problems": [], "measured": None,
    "media": None, "iolog": None,
}
"""Fields only data mode measures: ``null`` in ``--simulate`` so both modes share one shape."""


def _simulated(r: dict[str, Any]) -> None:
    """A ``--simulate`` configuration's report: no places, no backends."""
    r["mode"] = "simulate"
    r["requests_served"] = r["requests"]
    for t in r["tiers"]:
        t.update({"backend": "metadata", "url": None, "pool_blocks": None,
                  "failed": None, "committed_objects": None})


class _ConfigPoints(msgspec.Struct):
    """``--compare`` with ``--simulate``: one point per configuration (its replay, and
    its one-engine times when ``timing`` gives their parameters)."""

    requests: list[Any]
    configs: list[CacheConfig]
    block_tokens: int
    block_bytes: int | None
    timing: dict[str, Any] | None


def _run_config_point(p: _ConfigPoints, i: int) -> tuple[dict[str, Any], Any]:
    from kvtool.replay.timing import one_engine_times

    cfg = p.configs[i]
    result = replay(p.requests, [cfg], block_tokens=p.block_tokens,
                    block_bytes=p.block_bytes)[0]
    times = one_engine_times(p.requests, cfg, **p.timing) if p.timing is not None else None
    return result, times


def timing_off(result: dict[str, Any], why: str) -> None:
    """A report without times (``--no-times``, or an interrupted run): they are null."""
    for d in [result, *result.get("rounds", [])]:
        for key in ("ttft_p50_s", "ttft_p99_s", "wall_s", "requests_per_s"):
            d[key] = None
    result["time_model"] = {"kind": None, "basis": None, "why_none": why}


def _one_shape(result: dict[str, Any]) -> None:
    for key, value in DATA_FIELDS.items():
        result.setdefault(key, value)
    for rnd in result["rounds"]:
        for key in ("verified_blocks", "corrupt_blocks", "lost_blocks", "recomputed_blocks",
                    "repaired_blocks"):
            rnd.setdefault(key, None)


# ------------------------------------------------------------------ tiers
class MediaCounter:
    """The NVMe tier's bytes written, read back from the target's own SMART / Health log
    (Data Units Written, units of 512,000 bytes) before and after the run."""

    UNIT = 512_000

    def __init__(self, engine: Any) -> None:
        self.ctrl = engine.ctrl
        self.nsid = engine.nsid
        self.before = self.ctrl.smart_log(self.nsid)

    def finish(self, tier: DataTier | None, result: dict[str, Any]) -> dict[str, Any]:
        try:
            after = self.ctrl.smart_log(self.nsid)
        except Exception as exc:
            return {"source": "smart", "error": str(exc)}
        units = after.data_units_written - self.before.data_units_written
        nvme = result["measured"]["links"]
        put = sum(v["bytes"] for k, v in nvme.items() if k.startswith("nvme<-"))
        blocks = sum(v["blocks"] for k, v in nvme.items() if k.startswith("nvme<-"))
        padded = blocks * (tier.padded if tier is not None and hasattr(tier, "padded") else 0)
        meta = getattr(tier, "metadata_bytes", 0) if tier is not None else 0
        return {"source": "smart", "counted": units > 0 or put == 0,
                "data_units_written": units,
                "media_bytes_written": units * self.UNIT,
                "replay_put_bytes": put, "replay_padded_bytes": padded,
                "store_metadata_bytes": meta, "unit_bytes": self.UNIT}


def nvme_engine(place: str, create_bytes: int | None, read_qd: int,
                 credentials: HostCredentials | None = None) -> Any:
    from kvtool.store.engine import open_engine

    kernel_host = place.startswith("nvme+rdma://") or (
        place.startswith("nvme+tcp://") and credentials is not None
        and credentials.initiator == "kernel")
    if kernel_host:  # the kernel's NVMe-oF host (kvtool.store.kernelhost)
        try:
            return open_engine(place, write=True, qd=max(read_qd, 16), credentials=credentials)
        except UsageError as exc:
            raise UsageError(exc.message, field="nvme") from None
    if place.startswith("nvme+tcp://"):
        from kvtool.nvme.engine import open_nvme_tcp

        try:
            return open_nvme_tcp(place, write=True, qd=max(read_qd, 16), reconnect=2.0,
                                 timeout=5.0, credentials=credentials)
        except UsageError as exc:
            raise UsageError(exc.message, field="nvme") from None
    path = Path(place)
    if not path.exists():
        if create_bytes is None:
            raise UsageError(f"{place} does not exist; give a size to create it: "
                             f"{param('nvme')} 2GiB@{place}", field="nvme")
        parent = path.resolve().parent
        if not parent.is_dir():
            raise UsageError(f"cannot create {place}: no such directory", field="nvme")
        import shutil

        free = shutil.disk_usage(parent).free
        if create_bytes > free:
            raise UsageError(f"{format_size(create_bytes)} does not fit in {parent} "
                             f"({format_size(free)} free); use a smaller size or {param('simulate')}",
                             field="nvme")
    try:
        return open_engine(place, write=True, qd=max(read_qd, 16),
                           create_bytes=create_bytes if not path.exists() else None)
    except UsageError as exc:
        raise UsageError(exc.message, field="nvme") from None


def open_tiers(cfg: CacheConfig, block_bytes: int, work_blocks: int, s: ReplaySettings,
               setup: dict[str, Any], create: dict[str, int]
               ) -> tuple[dict[str, DataTier], MediaCounter | None, CacheConfig]:
    """Open the data tiers of ``cfg`` (DRAM pool, NVMe store; the GPU pool is the
    engine's) and return them with ``cfg`` whose NVMe capacity is resolved to blocks
    (a place without a size: what it holds). ``create``: files to create, and their size."""
    from kvtool.align import round_up
    from kvtool.store.layout import Geometry
    from kvtool.tiers.base import TierError
    from kvtool.tiers.dram import DramTier
    from kvtool.tiers.nvme import NvmeTier

    B = setup["block_tokens"]
    tiers: dict[str, DataTier] = {}
    media = None
    specs = []
    try:
        for spec in cfg.tiers:
            head = _headroom(cfg, spec.name, block_bytes, B, work_blocks)
            if spec.name == "dram":
                cap = int(spec.blocks(block_bytes, B))
                if spec.place is not None and spec.place.startswith("mooncake://"):
                    from kvtool.tiers.mooncake import MooncakeTier  # kvtool pool

                    tiers["dram"] = MooncakeTier(spec.place, slots=cap + head,
                                                 block_bytes=block_bytes)
                elif spec.place is not None:  # a shared-memory pool file
                    from kvtool.tiers.shm import ShmDramTier

                    try:
                        shm = ShmDramTier(spec.place, cap + head, block_bytes)
                    except TierError as exc:
                        raise UsageError(str(exc), field="dram") from None
                    shm.evict(list(shm.rows))  # a replay starts cold
                    tiers["dram"] = shm
                else:
                    tiers["dram"] = DramTier(cap + head, block_bytes)
            elif spec.name == "nvme":
                assert spec.place is not None
                place = spec.place
                want = spec.blocks(block_bytes, B)
                create_bytes = None
                if not place.startswith(("nvme+tcp://", "nvme+rdma://")) \
                        and not os.path.exists(place):
                    if want != math.inf:
                        create_bytes = ((int(want) + head) * round_up(block_bytes, 4096)
                                        + (64 << 20))
                    else:
                        create_bytes = create.get(place)
                engine = nvme_engine(place, create_bytes, s.read_qd, s.credentials)
                if place.startswith("nvme+tcp://"):
                    try:
                        media = MediaCounter(engine)
                    except Exception:
                        media = None
                try:
                    tier = NvmeTier(
                        engine, block_bytes=block_bytes, url=place,
                        max_slots=None if want == math.inf else int(want) + head,
                        read_qd=s.read_qd, write_qd=s.write_qd, seed=s.seed,
                        keyed_payload=True,
                        geometry=Geometry(model=setup.get("model") or "",
                                          dtype=setup.get("dtype") or "", block_tokens=B,
                                          tp=s.tp or 1))
                except TierError as exc:
                    engine.close()
                    raise UsageError(str(exc), field="nvme") from None
                tiers["nvme"] = tier
                if want == math.inf:
                    if tier.slots - head < 1:
                        raise UsageError(
                            f"{place} holds {tier.slots} blocks of {block_bytes:,} B, not "
                            f"more than the {head} one request needs in flight; use a bigger "
                            f"place or {param('simulate')}", field="nvme")
                    spec = msgspec.structs.replace(spec, capacity=Capacity(tier.slots - head,
                                                                           "blocks"))
                elif tier.slots < int(want) + head:
                    raise UsageError(
                        f"{place} holds {tier.slots} blocks of {block_bytes:,} B; "
                        f"{spec.capacity} is {int(want)} blocks (+{head} in flight): use a "
                        f"smaller {param('nvme')} size, a bigger place, or {param('simulate')}", field="nvme")
            specs.append(spec)
    except BaseException:
        for t in tiers.values():
            t.close()
        raise
    return tiers, media, CacheConfig(specs, cfg.write_policy, cfg.label)


def _headroom(cfg: CacheConfig, name: str, block_bytes: int, block_tokens: int,
              work_blocks: int) -> int:
    """Slots beyond the capacity a tier needs within one request: blocks are inserted
    before the tier evicts down to its capacity (docs/definitions.md), and a watermark above may
    demote a whole batch at once."""
    extra = work_blocks
    names = [t.name for t in cfg.tiers]
    i = names.index(name)
    if i > 0:
        above = cfg.tiers[i - 1]
        if above.watermark is not None:
            cap = above.blocks(block_bytes, block_tokens)
            if cap != math.inf:
                extra += math.ceil((1 - above.watermark.high + above.watermark.ratio) * cap) + 1
    return extra


# ------------------------------------------------------------------ prepare
def default_nvme_place() -> tuple[str, str, int | None]:
    """(place, why, bytes to create) for the default NVMe tier."""
    from kvtool.target import default
    from kvtool.target import state as st

    record = st.load(default.NAME)
    if record is not None and st.pid_alive(record.pid):
        for ep in record.endpoints:
            for lst in ep.get("listeners", []):
                if lst.get("transport") == "tcp":
                    url = f"nvme+tcp://{lst['address']}:{lst['port']}/{ep['nqn']}/1"
                    return url, "the running kvtool target (kvtool target up)", None
    path = cache_dir() / "replay-nvme.img"
    why = f"no kvtool target is up: a store file kvtool keeps; rm {path} removes it"
    if path.exists():
        return str(path), why, None
    path.parent.mkdir(parents=True, exist_ok=True)
    return str(path), why, DEFAULT_NVME_FILE_BYTES


def prepare(s: ReplaySettings, *, on_event: Callable[[str], None] | None = None) -> ReplayJob:
    """Check the settings, read the trace, resolve configurations and (data mode)
    capacities against this machine; run nothing yet."""
    from kvtool.trace import read_trace

    _check(s)
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
        _prepare_data(job)
    else:
        for cfg in configs:
            for spec in cfg.tiers:
                if spec.place is not None:
                    raise UsageError(f"{spec.place}: {param('simulate')} moves no bytes, so a tier "
                                     "takes a capacity, not a place", field=f"{spec.name}")
        setup["configs"] = [{"label": c.label} for c in configs]
    return job


def _prepare_data(job: ReplayJob) -> None:
    """Resolve places and capacities, and check that this machine holds them."""
    s, B, bb = job.settings, job.block_tokens, job.block_bytes
    assert bb is not None
    distinct: set[int] = set()
    work = 1
    for r in job.reader:
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


def describe_setup(setup: dict[str, Any]) -> list[str]:
    """The setup as lines for people (printed before the run)."""
    bb = setup.get("block_bytes")
    lines = [f"mode {setup['mode']}"
             + (f" · model {setup['model']} {setup['dtype'] or ''}".rstrip() if setup.get("model")
                else "")
             + f" · {setup['block_tokens']} tokens/block"
             + (f" · {bb:,} B/block" if bb else "")]
    for c in setup.get("configs", []):
        if "tiers" not in c:
            continue
        parts = []
        for name, t in c["tiers"].items():
            if name == "nvme":
                size = "all" if t["capacity"] == "all of it" else t["capacity"]
                parts.append(f"nvme {size} of {t['place']} ({t['why']}), {t['policy']}")
            else:
                parts.append(f"{name} {t['capacity']} ({t['blocks']} blocks), {t['policy']}")
        lines.append("tiers: " + "; ".join(parts) + f" · {c['write_policy']}"
                     + f" · pools {format_size(c['memory_bytes'])}")
    return lines
