"""Running a prepared replay (:class:`ReplayJob`): ``--simulate`` through the replayer
(configurations side by side when a fanout is given), data mode through the data tiers,
the times from the serving model's one-engine case."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import msgspec

from kvtool.cache.replayer import CacheConfig, Replayer, RequestOutcome, replay
from kvtool.errors import UsageError, param
from kvtool.fanout import Fanout
from kvtool.gcpause import cyclic_gc_paused
from kvtool.replay.report import one_shape, simulated, timing_off
from kvtool.replay.settings import SCHEMA, ReplaySettings
from kvtool.replay.tierfactory import open_tiers
from kvtool.trace.stats import MaxHitRatio
from kvtool.units import format_size

if TYPE_CHECKING:
    from kvtool.cache.iolog import IologWriter

# Data mode (kvtool.replay.data, kvtool.tiers: numpy, the store) is imported when a data-mode
# run starts, so that --simulate starts fast (bench/startup.py).


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
    _requests: list[Any] | None = None

    def requests(self) -> list[Any]:
        """The trace's requests in serve order, decoded once for the whole run (after
        the reader's pass 1): data mode's preparation, each configuration's data-mode
        pass, the serving model's times and the hit-ratio bound all go over this list.
        A ``--no-times`` simulation, which goes over the trace once, streams the reader
        instead (:meth:`one_pass`), so that its memory stays the reader's."""
        if self._requests is None:
            with cyclic_gc_paused():  # the requests and their block keys: no cycles
                self._requests = list(self.reader)
        return self._requests

    def one_pass(self) -> Any:
        """What a single pass reads: the decoded requests if the run has them, else the
        reader itself."""
        return self._requests if self._requests is not None else self.reader

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

        One loop per configuration: the serving model's engine admits the requests and
        asks the tier hierarchy to serve each, in serve order; the hierarchy decides and
        counts every hit, and the engine times what it decided
        (:mod:`kvtool.replay.timing`). With ``--no-times`` the requests are served in
        serve order without the engine (several configurations side by side in one pass
        with ``--simulate``): the same hierarchy, the same counts, no times.

        ``on_request(i, outcome)`` receives every request's accounting for configuration
        ``i`` (besides ``--requests-csv``), with its TTFT when timed. A
        ``KeyboardInterrupt`` stops the run cleanly: the report covers the requests served
        so far, without times, and says ``"interrupted": true``. ``fanout``
        (:mod:`kvtool.fanout`): with ``--simulate``, several configurations and no
        per-request output, each configuration is a point run side by side; the report is
        the serial run's.
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
        sink: Callable[[int, RequestOutcome], None] | None = None
        if sinks:
            def sink(i: int, outcome: RequestOutcome) -> None:
                for f in sinks:
                    f(i, outcome)
        self._sink = sink
        maximum = MaxHitRatio()
        try:
            if self.mode == "simulate" and self.settings.times == "none":
                results = self._run_untimed(progress, maximum)
            else:
                results = [self._run_config(i, cfg, progress) for i, cfg in
                           enumerate(self.configs) if not self.interrupted]
                if not self.interrupted:
                    for r in self.requests():
                        maximum.add(r.block_keys, r.input_length, r.block_tokens)
        finally:
            if per_request is not None:
                per_request.close()
        return self._report(results, maximum)

    def _run_untimed(self, progress: Callable[[int], None] | None,
                     maximum: MaxHitRatio) -> list[dict[str, Any]]:
        """``--simulate --no-times``: every configuration side by side, one pass over the
        trace (streamed when nothing else decoded it)."""
        log = _open_iolog(self)
        try:
            results = replay(_clocked(_measured(self.one_pass(), maximum), log), self.configs,
                             block_tokens=self.block_tokens, block_bytes=self.block_bytes,
                             progress=progress, on_request=self._sink,
                             movers=[{"nvme": log}] if log is not None else None)
        finally:
            if log is not None:
                log.close()
        if log is not None:
            results[0]["iolog"] = log.summary()
        for r in results:
            simulated(r)
        return results

    def _run_fanned(self, fanout: Fanout, progress: Callable[[int], None] | None
                    ) -> dict[str, Any]:
        """:meth:`run` with each configuration a point of ``fanout``."""
        requests = self.requests()
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
        results = fanout.map(_run_config_point, points, len(self.configs), done)
        return self._report(results, maximum)

    def _report(self, results: list[dict[str, Any]], maximum: MaxHitRatio) -> dict[str, Any]:
        for r in results:
            if self.interrupted:
                timing_off(r, "interrupted")
            elif r.get("time_model") is None:
                timing_off(r, "--no-times")
            one_shape(r)
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

    def _timing_kwargs(self) -> dict[str, Any]:
        """The one-engine case's parameters (:func:`kvtool.replay.timing.one_engine_times`)
        but the requests, the configuration and its hierarchy."""
        s = self.settings
        return {"block_tokens": self.block_tokens, "block_bytes": self.block_bytes,
                "model": self.setup.get("model"), "dtype": self.setup.get("dtype"), "tp": s.tp,
                "gpu": s.engine_gpu, "concurrency": s.concurrency,
                "read_gbps": dict(s.read_gbps), "timed": self.reader.timed,
                "exact_steps": s.exact_steps}

    def _run_config(self, index: int, cfg: CacheConfig,
                    progress: Callable[[int], None] | None) -> dict[str, Any]:
        """One configuration: its hierarchy (data mode's moves bytes), served in serve
        order by the serving model's engine, or alone with ``--no-times``."""
        if self.mode == "data":
            return self._run_data(index, cfg, progress)
        log = _open_iolog(self)
        outcomes: list[RequestOutcome] = []
        try:
            decider = Replayer(cfg, self.block_tokens, self.block_bytes,
                               on_request=outcomes.append if self._sink is not None else None,
                               movers={"nvme": log} if log is not None else None)
            out = self._serve(decider, cfg, progress, index, outcomes,
                              _ClockedDecider(decider, log) if log is not None else decider)
        finally:
            if log is not None:
                log.close()
        if log is not None:
            out["iolog"] = log.summary()
        simulated(out)
        return out

    def _serve(self, hierarchy: Any, cfg: CacheConfig,
               progress: Callable[[int], None] | None, index: int,
               outcomes: list[RequestOutcome], decider: Any = None,
               finish: Callable[[], None] | None = None) -> dict[str, Any]:
        """:func:`serve_all` for this job; each request's outcome (``outcomes``, gathered
        by the hierarchy) goes to the sink, with its TTFT when timed."""
        requests = self.requests()
        timing = self._timing_kwargs() if self.settings.times == "serving" else None
        out_rows = _InOrder(outcomes, index, self._sink)
        out, times, interrupted = serve_all(
            hierarchy, requests, cfg, timing, progress, decider=decider, finish=finish,
            on_finished=out_rows.finished if self._sink is not None else None)
        if interrupted:
            self.interrupted = True
        out_rows.flush(times)
        return out

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

        outcomes: list[RequestOutcome] = []
        try:
            eng = DataReplayer(cfg, self.block_tokens, self.block_bytes, tiers=tiers,
                               work_blocks=self.work_blocks, seed=s.seed,
                               on_tier_error=s.on_tier_error, on_event=self.on_event,
                               on_request=outcomes.append if self._sink is not None else None)
        except BaseException:
            for t in tiers.values():
                t.close()
            raise
        try:
            out = self._serve(eng, cfg, progress, index, outcomes, finish=eng.persist)
            if media is not None:
                out["media"] = media.finish(tiers.get("nvme"), out)
            return out
        finally:
            eng.close()


def serve_all(hierarchy: Any, requests: list[Any], cfg: CacheConfig,
              timing: dict[str, Any] | None, progress: Callable[[int], None] | None, *,
              decider: Any = None, finish: Callable[[], None] | None = None,
              on_finished: Callable[[int, float | None], None] | None = None
              ) -> tuple[dict[str, Any], list[Any] | None, bool]:
    """Serve ``requests`` through ``hierarchy`` (a :class:`~kvtool.cache.replayer.Replayer`,
    or data mode's) in serve order: driven by the serving model's one-engine case, which
    asks ``decider`` (default: the hierarchy) to serve each request as it admits it and
    times what it decided (``timing``: its parameters), or, without ``timing``, one
    request after the other. ``progress(1)`` after each request; ``finish()`` before the
    result (data mode commits its tiers); ``on_finished(i, ttft)`` as the engine finishes
    request ``i`` (``ttft`` None without ``timing``). Returns the hierarchy's result with
    the times, each request's times (``None`` without), and whether a
    ``KeyboardInterrupt`` stopped the run (then without times: the report covers the
    requests served)."""
    times: list[Any] | None = None
    described = None
    served = 0
    interrupted = False
    try:
        if timing is not None:
            from kvtool.replay.timing import one_engine_times

            def decided(_i: int) -> None:
                nonlocal served
                served += 1
                if progress is not None:
                    progress(1)
            times, described = one_engine_times(
                requests, cfg, **timing, decider=decider if decider is not None else hierarchy,
                on_decided=decided, on_finished=on_finished)
        elif on_finished is None and progress is None:
            # nobody watches each request (a fanned-out point): feed_many's fast path,
            # counting what it served (a Ctrl-C stops it mid-trace)
            def counted() -> Iterator[Any]:
                nonlocal served
                for req in requests:
                    yield req
                    served += 1
            hierarchy.feed_many(counted())
        else:
            for req in requests:
                hierarchy.feed(req)
                if on_finished is not None:
                    on_finished(served, None)
                served += 1
                if progress is not None:
                    progress(1)
    except KeyboardInterrupt:
        interrupted = True
        times = None
    if finish is not None:
        finish()
    out: dict[str, Any] = hierarchy.result()
    out["requests_served"] = served
    if times is not None and described is not None:
        from kvtool.replay.timing import apply_times

        apply_times(out, requests, times, described)
    return out, times, interrupted


class _InOrder:
    """Each request's outcome to the sink in serve order, as soon as it and every earlier
    request have finished in the engine (with its TTFT), so that ``--requests-csv`` and
    the metrics grow as the run goes; :meth:`flush` gives the rest at the end."""

    def __init__(self, outcomes: list[RequestOutcome], config: int,
                 sink: Callable[[int, RequestOutcome], None] | None) -> None:
        self.outcomes, self.config, self.sink = outcomes, config, sink
        self.ttft: dict[int, float | None] = {}
        self.next = 0

    def finished(self, i: int, ttft: float | None) -> None:
        self.ttft[i] = ttft
        while self.next in self.ttft and self.next < len(self.outcomes):
            self._emit(self.next, self.ttft.pop(self.next))

    def _emit(self, k: int, ttft: float | None) -> None:
        assert self.sink is not None
        o = self.outcomes[k]
        self.sink(self.config, o if ttft is None else o._replace(ttft_s=ttft))
        self.next = k + 1

    def flush(self, times: list[Any] | None) -> None:
        """The outcomes not given yet: with their TTFT when the run was timed to its end."""
        if self.sink is None:
            return
        for k in range(self.next, len(self.outcomes)):
            self._emit(k, None if times is None else times[k].ttft)


class _ClockedDecider:
    """A hierarchy whose NVMe tier logs its I/O (``--iolog``): the log's clock is set to
    each request's timestamp before the request is served."""

    def __init__(self, hierarchy: Replayer, log: IologWriter) -> None:
        self.hierarchy, self.log = hierarchy, log
        self.names = hierarchy.names

    def decide(self, req: Any) -> tuple[list[int], list[int]]:
        self.log.at(req.timestamp)
        return self.hierarchy.decide(req)


class _ConfigPoints(msgspec.Struct):
    """``--compare`` with ``--simulate``: one point per configuration (its replay, timed
    by the one-engine case when ``timing`` gives its parameters)."""

    requests: list[Any]
    configs: list[CacheConfig]
    block_tokens: int
    block_bytes: int | None
    timing: dict[str, Any] | None


def _run_config_point(p: _ConfigPoints, i: int) -> dict[str, Any]:
    cfg = p.configs[i]
    hierarchy = Replayer(cfg, p.block_tokens, p.block_bytes)
    out, _times, _interrupted = serve_all(hierarchy, p.requests, cfg, p.timing, None)
    simulated(out)
    return out
