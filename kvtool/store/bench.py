"""``kvtool bench``: raw object-sized I/O on a target, like fio but through kvtool's engines.

Each *case* is (pattern, queue depth, path) over a region of object-sized slots:

* patterns: ``seq-write``, ``rand-write``, ``seq-read``, ``rand-read`` (writes run first, so
  reads read written blocks, not holes);
* ``qd`` requests in flight through the engine's asynchronous interface;
* path ``aligned``: an object of the padded size, written/read zero-copy from aligned
  buffers; path ``bounce``: the real object size (not a multiple of the LBA), staged
  through an aligned scratch buffer (write: copy in + zero the pad; read: copy back only
  the object's bytes). The two move the same bytes on the device, so their ratio is the
  bounce path's cost.

Latency is per request, measured around the whole object operation (copies included).
Writes destroy the target's contents: the CLI refuses unless the target is blank, holds
what an earlier ``kvtool bench`` left (its first LBA starts ``KVTBENCH``), or ``--force``
is given.

Every case runs ``repeat`` times, the whole list over and over (so drift in the machine
falls on every case alike); a row reports the median run and the range of the runs, and a
difference (bounce against aligned, a case against ``need``) is called only when the
ranges do not overlap: a single run has no spread, and nothing is called from it.
"""

from __future__ import annotations

import contextlib
import queue
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from kvtool.align import padded_size
from kvtool.errors import CheckFailed, UsageError, param
from kvtool.store.bounce import as_bytes_view, copy_into, stage_for_write
from kvtool.store.engine import AlignedBuffer, IOEngine, open_engine
from kvtool.store.load import read_head
from kvtool.store.signatures import BENCH, BENCH_MAGIC, identify

if TYPE_CHECKING:
    from kvtool.nvme.hostauth import HostCredentials

PATTERNS = ("seq-write", "rand-write", "seq-read", "rand-read")
PATHS = ("aligned", "bounce")


@dataclass(frozen=True)
class Case:
    pattern: str
    qd: int
    path: str
    object_bytes: int

    @property
    def is_write(self) -> bool:
        return self.pattern.endswith("write")


def plan_cases(object_bytes: int, lba: int, patterns: list[str], qds: list[int],
               paths: list[str] | None = None) -> list[Case]:
    """Cases in run order (writes before reads). ``bounce`` needs an unaligned object;
    the ``aligned`` case then uses the padded size."""
    padded = padded_size(object_bytes, lba)
    if paths is None:
        paths = ["aligned", "bounce"] if padded != object_bytes else ["aligned"]
    order = sorted(patterns, key=PATTERNS.index)
    cases = []
    for pattern in order:
        for qd in qds:
            for path in paths:
                size = padded if path == "aligned" else object_bytes
                cases.append(Case(pattern, qd, path, size))
    return cases


def run_case(engine: IOEngine, case: Case, *, region_bytes: int, seconds: float,
             max_ops: int | None = None, seed: int = 0,
             tick: Callable[[], None] | None = None) -> dict[str, Any]:
    """Run one case; returns its result row (docs/store.md, ``kvtool bench``).

    ``qd`` requests stay in flight through the engine's asynchronous interface (the path
    ``load`` and ``verify`` use). Each request owns one aligned buffer; on the bounce path
    also an ordinary array holding the object, copied in before a write and out after a
    read, inside the measured latency.
    """
    lba = engine.lba_size
    padded = padded_size(case.object_bytes, lba)
    slots = max(1, region_bytes // padded)
    limit = max_ops if max_ops is not None else 1 << 62
    rng = np.random.default_rng(seed)
    order = rng.integers(0, slots, size=min(limit, 1 << 20), dtype=np.int64)
    bufs, users = _buffers(case, padded, rng)
    done: queue.SimpleQueue[tuple[int, int, BaseException | None]] = queue.SimpleQueue()
    lat: list[int] = []
    issued = 0

    def start(k: int) -> None:
        nonlocal issued
        i = issued
        issued += 1
        slot = i % slots if case.pattern.startswith("seq") else int(order[i % order.size])
        t = time.perf_counter_ns()
        user = users[k]
        if case.is_write:
            view = bufs[k].view if user is None else stage_for_write(
                as_bytes_view(user), bufs[k], padded)
            fut = engine.submit_write(slot * padded, view)
        else:
            fut = engine.submit_read(slot * padded, bufs[k].view)
        fut.add_done_callback(lambda f: done.put((k, t, f.exception())))

    deadline = time.perf_counter() + seconds
    t0 = time.perf_counter()
    inflight = 0
    error: BaseException | None = None
    try:
        for k in range(min(case.qd, limit)):
            start(k)
            inflight += 1
        while inflight:
            k, t, exc = done.get()
            inflight -= 1
            if exc is not None:
                error = error or exc
                continue
            user = users[k]
            if user is not None and not case.is_write:
                copy_into(as_bytes_view(user), bufs[k].view[:case.object_bytes])
            lat.append(time.perf_counter_ns() - t)
            if tick is not None:
                tick()
            if error is None and issued < limit and time.perf_counter() < deadline:
                start(k)
                inflight += 1
        if error is not None:
            raise error
        if case.is_write:
            engine.flush()
        elapsed = time.perf_counter() - t0
    finally:
        while inflight:
            done.get()
            inflight -= 1
        for b in bufs:
            b.close()
    return _row(case, padded, lat, elapsed)


def _buffers(case: Case, padded: int, rng: np.random.Generator
             ) -> tuple[list[AlignedBuffer], list[np.ndarray | None]]:
    """Each request's aligned buffer of ``padded`` bytes, and on the bounce path its
    ordinary array of the object's bytes (random bytes in whichever the writes send)."""
    zero_copy = case.path == "aligned"
    bufs = [AlignedBuffer(padded) for _ in range(case.qd)]
    users = [None if zero_copy else rng.integers(0, 256, size=case.object_bytes, dtype=np.uint8)
             for _ in range(case.qd)]
    if zero_copy:
        for b in bufs:
            np.frombuffer(b.view, dtype=np.uint8)[:] = rng.integers(0, 256, size=padded,
                                                                    dtype=np.uint8)
    return bufs, users


def _row(case: Case, padded: int, lat: list[int], elapsed: float) -> dict[str, Any]:
    """A case's result row from its requests' latencies (ns) and its elapsed seconds."""
    all_lat = np.asarray(lat, dtype=np.int64)
    ops = int(all_lat.size)
    pct = (np.percentile(all_lat, [50, 99, 99.9]) / 1000.0).tolist() if ops else [0.0] * 3
    return {
        "pattern": case.pattern, "qd": case.qd, "path": case.path,
        "object_bytes": case.object_bytes, "padded_bytes": padded, "ops": ops,
        "seconds": elapsed, "iops": ops / elapsed if elapsed else 0.0,
        "gb_per_s": ops * case.object_bytes / elapsed / 1e9 if elapsed else 0.0,
        "device_gb_per_s": ops * padded / elapsed / 1e9 if elapsed else 0.0,
        "lat_us": {"p50": pct[0], "p99": pct[1], "p99_9": pct[2],
                   "mean": float(all_lat.mean()) / 1000.0 if ops else 0.0},
    }


def _beyond(a: tuple[float, float], b: tuple[float, float], runs: int) -> bool:
    """Whether ranges ``a`` and ``b`` (min, max) are apart, with more than one run each."""
    return runs > 1 and (a[1] < b[0] or b[1] < a[0])


def bounce_cost(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """For each (pattern, qd) with both paths: bounce/aligned throughput (medians), and
    whether the difference is beyond the runs' spread."""
    by = {(r["pattern"], r["qd"], r["path"]): r for r in rows}
    out = []
    for (pattern, qd, path), r in by.items():
        if path != "bounce" or (pattern, qd, "aligned") not in by:
            continue
        a = by[(pattern, qd, "aligned")]
        ratio = r["iops"] / a["iops"] if a["iops"] else 0.0
        out.append({"pattern": pattern, "qd": qd, "bounce_over_aligned": ratio,
                    "cost": 1.0 - ratio,
                    "beyond_spread": _beyond(tuple(r["iops_range"]), tuple(a["iops_range"]),
                                             min(r["runs"], a["runs"]))})
    return out


def verdicts(rows: list[dict[str, Any]], need_gbps: float) -> list[dict[str, Any]]:
    """Per pattern, its best case (median GB/s) against ``need_gbps``: ``meets`` when every
    run of it reached the need, ``short`` when none did, else ``within spread``."""
    out = []
    for pattern in PATTERNS:
        mine = [r for r in rows if r["pattern"] == pattern]
        if not mine:
            continue
        best = max(mine, key=lambda r: r["gb_per_s"])
        lo, hi = best["gb_per_s_range"]
        verdict = ("meets" if lo >= need_gbps else "short" if hi < need_gbps
                   else "within spread")
        out.append({"pattern": pattern, "qd": best["qd"], "path": best["path"],
                    "gb_per_s": best["gb_per_s"], "gb_per_s_range": [lo, hi],
                    "need_gb_per_s": need_gbps, "verdict": verdict})
    return out


def _summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One row from a case's runs: the median run (by IOPS), with every run's range."""
    ordered = sorted(runs, key=lambda r: r["iops"])
    row = dict(ordered[(len(ordered) - 1) // 2])
    iops = [r["iops"] for r in runs]
    gbps = [r["gb_per_s"] for r in runs]
    row.update(runs=len(runs), iops_range=[min(iops), max(iops)],
               gb_per_s_range=[min(gbps), max(gbps)],
               spread=(max(iops) - min(iops)) / row["iops"] if row["iops"] else 0.0,
               iops_runs=iops)
    return row


def _mark(engine: IOEngine) -> None:
    """Leave :data:`BENCH_MAGIC` in the first LBA: a later bench may write again."""
    n = max(engine.lba_size, 4096)
    buf = AlignedBuffer(n)
    try:
        view = buf.view
        view[:] = bytes(n)
        view[:len(BENCH_MAGIC)] = BENCH_MAGIC
        engine.write_from(0, view)
        engine.flush()
    finally:
        buf.close()


def bench(target: str, *, object_bytes: int, qds: list[int], patterns: list[str],
          paths: list[str] | None = None, seconds: float = 1.0, max_ops: int | None = None,
          region_bytes: int = 1 << 30, force: bool = False, lba: int | None = None,
          create_bytes: int | None = None, repeat: int = 3, need_gbps: float | None = None,
          progress: Callable[[int], None] | None = None,
          on_total: Callable[[int], None] | None = None,
          credentials: HostCredentials | None = None) -> dict[str, Any]:
    """Run every case ``repeat`` times on ``target``; returns the ``kvtool.store.bench/2``
    document (with ``verdicts`` against ``need_gbps`` when given).

    Write patterns need a blank target, one an earlier bench wrote, or ``force``
    (UsageError otherwise, nothing written). Ctrl-C stops the runs: the document then
    covers the cases with at least one run, with ``interrupted`` set.
    """
    if repeat < 1:
        raise UsageError(f"must be at least 1, got {repeat}", field="repeat")
    writes = any(p.endswith("write") for p in patterns)
    engine = open_engine(target, write=writes, qd=max(qds), lba=lba, create_bytes=create_bytes,
                         credentials=credentials)
    wrote = False
    try:
        if writes and not force:
            found = identify(read_head(engine))
            if found is not None and found != BENCH:
                what = "a kvtool store" if found == "kvtool" else found
                raise UsageError(f"{target} holds {what}; write patterns would destroy it: "
                                 f"use {param('force')}, or {param('read_only')}", field="target")
        if paths and "bounce" in paths and object_bytes % engine.lba_size == 0:
            raise UsageError(f"{object_bytes} B is a whole number of {engine.lba_size} B "
                             "blocks: there is no bounce path to measure", field="path")
        cases = plan_cases(object_bytes, engine.lba_size, patterns, qds, paths)
        region = min(region_bytes, engine.size)
        if region < max(padded_size(c.object_bytes, engine.lba_size) for c in cases):
            raise UsageError(f"the region ({region} B) is smaller than one object",
                             field="region")
        if on_total is not None:
            on_total(len(cases) * repeat)
        runs: list[list[dict[str, Any]]] = [[] for _ in cases]
        interrupted = False
        try:
            for _ in range(repeat):
                for i, case in enumerate(cases):
                    wrote = wrote or case.is_write
                    try:
                        runs[i].append(run_case(engine, case, region_bytes=region,
                                                seconds=seconds, max_ops=max_ops, seed=i))
                    except OSError as exc:
                        raise CheckFailed(f"{target}: I/O error during {case.pattern} at QD "
                                          f"{case.qd}: {exc}") from None
                    if progress is not None:
                        progress(1)
        except KeyboardInterrupt:
            interrupted = True
        rows = [_summarise(r) for r in runs if r]
        return {"schema": "kvtool.store.bench/2", "target": target,
                "engine": engine.describe(), "object_bytes": object_bytes,
                "region_bytes": region, "seconds_per_case": seconds, "repeat": repeat,
                "wrote": wrote, "interrupted": interrupted, "results": rows,
                "bounce_cost": bounce_cost(rows),
                "verdicts": verdicts(rows, need_gbps) if need_gbps is not None else None}
    finally:
        try:
            if wrote:
                with contextlib.suppress(OSError):  # a failed target: the error is reported
                    _mark(engine)
        finally:
            engine.close()
