"""Data mode across nodes: ``kvtool replay TRACE --cluster FILE`` on a cluster that is up.

The serving model's event loop (:mod:`kvtool.serving.sim`) stays on the driver, on the
head, with the router; what moves to the nodes is the bytes. :class:`RayClusterData` is
its :class:`~kvtool.serving.sim.DataBackend`: whenever the simulated clock says a block
enters a tier, is loaded from it or leaves it, the engine whose GPU pool the bytes leave
or reach moves them, on its node:

* each engine is an :class:`EngineWorker`, a Ray actor placed on its node (node-affinity
  scheduling on the Ray node whose IP is the node's address). It holds its CPU "GPU" pool
  (the rows blocks are computed into and loaded into), maps its node's DRAM pool (a file
  in the node's ``/dev/shm`` that every engine on the node maps: the node's memory, shared),
  joins the Mooncake Store pool as a client that lends a segment of its memory (the
  cluster-wide DRAM tier), and connects to every NVMe/TCP target with the DH-HMAC-CHAP key
  the cluster made for it;
* placement is the driver's: a slot per block in each node's DRAM pool and on each target
  (:class:`SlotMap`; blocks go to targets as the model sends them, ``key % targets``), an
  object name per block in Mooncake. So a block that one engine computed and stored can be
  loaded by another, on another node: a **cross-engine hit**, counted per tier;
* every block loaded is checked against its payload (:class:`~kvtool.store.payload.Payload`
  of the chain hash and the seed) on the engine that loaded it; one that does not match is
  *corrupt*, one the tier no longer has is *lost*: either way it is never served and the
  model recomputes it (``recomputed_after_check_blocks``).

Faults (:class:`~kvtool.replay.faults.Fault`, ``--fault KIND@SECONDS[:WHO]``) fire when
the simulated clock passes their time; :mod:`kvtool.replay.faults` injects them (engine,
target, node, link). A block that lived only where a fault struck is lost from then on and
recomputed when asked for; the report's ``faults`` names each one and when it fired
(simulated and wall seconds).

What is measured: bytes and the wall seconds each tier's transfers took on the engines;
what is simulated: every time in the ``serving`` report.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from kvtool.errors import UsageError, param
from kvtool.replay.faults import FAULT_KINDS, Fault, FaultInjector
from kvtool.replay.head import ON_HEAD_ENV, cluster_up, on_head
from kvtool.replay.servingdata import TierCounters

if TYPE_CHECKING:
    from kvtool.cluster.state import ClusterState
    from kvtool.serving.setup import BuiltCluster
    from kvtool.serving.sim import TierSetup

ROWS = 16
"""Rows of an engine's GPU pool that one transfer moves at a time."""
IO_TIMEOUT_S = 5.0
"""Longest wait for one NVMe transfer before its target is declared failed."""
SEGMENT_HEADROOM = 1.5
"""Mooncake segments lent in all / the model's Mooncake capacity."""
MAX_NAMED = 100
RESTART_TIMEOUT_S = 60.0
"""Longest wait for Ray to restart a killed engine actor."""
TIERS = ("dram", "mooncake", "nvme")


# ------------------------------------------------------------------ on the nodes
@dataclass(frozen=True)
class TargetAccess:
    """How an engine reaches one NVMe/TCP target (key files hold DHHC-1 secrets)."""

    name: str
    url: str
    hostnqn: str
    key_file: str | None
    ctrl_key_file: str | None = None


@dataclass(frozen=True)
class WorkerSpec:
    """Everything an :class:`EngineWorker` is built from (a Ray actor's restart rebuilds it
    from the same spec)."""

    index: int
    name: str
    node: str
    address: str
    block_bytes: int
    seed: int
    run: str
    dram_path: str | None
    dram_slots: int
    mooncake: str | None
    local_hostname: str
    segment_bytes: int
    targets: tuple[TargetAccess, ...]
    rows: int = ROWS


class EngineWorker:
    """One engine's bytes on its node (module docstring). Invariant: a block it reports
    loaded equals its payload; anything else comes back as lost or corrupt."""

    def __init__(self, spec: WorkerSpec) -> None:
        from kvtool.store.engine import AlignedBuffer
        from kvtool.store.payload import Payload

        self.spec = spec
        bb = spec.block_bytes
        self.padded = -(-bb // 4096) * 4096
        self.payload = Payload(bb, spec.seed)
        self._buf = AlignedBuffer(spec.rows * self.padded)
        self.rows = np.frombuffer(self._buf.view, dtype=np.uint8).reshape(spec.rows, self.padded)
        self.rows[:, ::4096] = 0  # the pool is preallocated: touch every page now
        self.want = np.empty(bb, dtype=np.uint8)
        self.dram: np.memmap[Any, np.dtype[np.uint8]] | None = None
        if spec.dram_path is not None:
            fd = os.open(spec.dram_path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                if os.fstat(fd).st_size < spec.dram_slots * bb:
                    os.ftruncate(fd, spec.dram_slots * bb)
            finally:
                os.close(fd)
            self.dram = np.memmap(spec.dram_path, dtype=np.uint8, mode="r+",
                                  shape=(spec.dram_slots, bb))
        self.mooncake: Any = None
        if spec.mooncake is not None:
            from kvtool.mooncake.client import MooncakeClient

            self.mooncake = MooncakeClient(spec.mooncake, segment_bytes=spec.segment_bytes,
                                           buffer_bytes=max(16 << 20, 2 * self.rows.nbytes),
                                           local_hostname=spec.local_hostname)
            self.mooncake.register(self.rows)
        self.engines: list[Any] = []
        self.dead: dict[int, str] = {}
        for i, t in enumerate(spec.targets):
            try:
                self.engines.append(self._connect(t))
            except Exception as exc:  # a target that is gone: its blocks are lost
                self.engines.append(None)
                self.dead[i] = f"connect: {exc}"

    @staticmethod
    def _connect(t: TargetAccess) -> Any:
        from kvtool.nvme.dhchap import load_secret_file
        from kvtool.nvme.engine import open_nvme_tcp
        from kvtool.nvme.hostauth import HostCredentials

        creds = HostCredentials(
            t.hostnqn,
            load_secret_file(t.key_file, field="dhchap_secret") if t.key_file else None,
            load_secret_file(t.ctrl_key_file, field="dhchap_ctrl_secret")
            if t.ctrl_key_file else None)
        return open_nvme_tcp(t.url, write=True, qd=ROWS, credentials=creds,
                             timeout=IO_TIMEOUT_S, reconnect=1.0)

    def ready(self) -> dict[str, Any]:
        """Who and where it is, and each target's namespace (bytes, LBA) or why not."""
        import socket

        return {"pid": os.getpid(), "host": socket.gethostname(),
                "targets": [None if e is None else {"size": e.size, "lba": e.lba_size}
                            for e in self.engines],
                "dead": {str(k): v for k, v in self.dead.items()}}

    def _name(self, key: int) -> str:
        return f"kvtool/{self.spec.run}/{key:x}"

    def _ptrs(self, n: int) -> list[int]:
        base = self.rows.ctypes.data
        return [base + i * self.padded for i in range(n)]

    def store(self, tier: str, keys: Sequence[int], where: Sequence[Any]) -> dict[str, Any]:
        """Compute ``keys`` into the GPU pool's rows and write them to ``tier`` at
        ``where`` (a DRAM slot, a (target, slot), or nothing for Mooncake). Returns the
        keys that did not reach the tier, and the wall seconds of the transfers."""
        bb = self.spec.block_bytes
        failed: list[int] = []
        errors: dict[str, str] = {}
        seconds = 0.0
        for start in range(0, len(keys), self.spec.rows):
            part = keys[start:start + self.spec.rows]
            places = where[start:start + self.spec.rows]
            for i, k in enumerate(part):
                self.payload.fill(k, self.rows[i, :bb])
            t0 = time.perf_counter()
            if tier == "dram":
                assert self.dram is not None
                for i, slot in enumerate(places):
                    self.dram[slot] = self.rows[i, :bb]
            elif tier == "mooncake":
                names = [self._name(k) for k in part]
                replace = [n for n, again in zip(names, places, strict=True) if again]
                if replace:  # a repair: Mooncake refuses a second put of a name
                    self.mooncake.batch_remove(replace)
                rcs = self.mooncake.batch_put_from(names, self._ptrs(len(part)),
                                                   [bb] * len(part))
                failed += [k for k, rc in zip(part, rcs, strict=True) if rc != 0]
            else:
                failed += self._nvme(part, places, write=True, errors=errors)
            seconds += time.perf_counter() - t0
        return {"failed": failed, "errors": errors, "seconds": seconds}

    def load(self, tier: str, keys: Sequence[int], where: Sequence[Any]) -> dict[str, Any]:
        """Read ``keys`` from ``tier`` into the GPU pool's rows and check each against its
        payload. Returns the lost and the corrupt keys, and the wall seconds of the reads."""
        from kvtool.store.payload import equal

        bb = self.spec.block_bytes
        lost: list[int] = []
        corrupt: list[int] = []
        errors: dict[str, str] = {}
        seconds = 0.0
        verified = 0
        for start in range(0, len(keys), self.spec.rows):
            part = keys[start:start + self.spec.rows]
            places = where[start:start + self.spec.rows]
            t0 = time.perf_counter()
            got = [True] * len(part)
            if tier == "dram":
                assert self.dram is not None
                for i, slot in enumerate(places):
                    self.rows[i, :bb] = self.dram[slot]
            elif tier == "mooncake":
                n = self.mooncake.batch_get_into([self._name(k) for k in part],
                                                 self._ptrs(len(part)), [bb] * len(part))
                got = [x == bb for x in n]
            else:
                bad = set(self._nvme(part, places, write=False, errors=errors))
                got = [k not in bad for k in part]
            seconds += time.perf_counter() - t0
            for i, (k, ok) in enumerate(zip(part, got, strict=True)):
                if not ok:
                    lost.append(k)
                    continue
                self.payload.fill(k, self.want)
                if equal(self.rows[i, :bb], self.want):
                    verified += 1
                else:
                    corrupt.append(k)
        return {"lost": lost, "corrupt": corrupt, "verified": verified, "errors": errors,
                "seconds": seconds}

    def _nvme(self, keys: Sequence[int], places: Sequence[tuple[int, int]], *, write: bool,
              errors: dict[str, str]) -> list[int]:
        """Write or read ``keys`` at their (target, slot); the keys that failed. A target
        that fails once is dead for this engine (its blocks fail at once from then on).

        The transfers run on a helper thread with a deadline: a target behind a cut link
        answers nothing, not even a reset, and a send to it would block for as long as TCP
        retries. Past the deadline the target it was waiting on is dead, its connection is
        shut (which ends the blocked send) and every key of the call has failed."""
        import threading

        out: list[list[int]] = []
        busy: list[int] = []

        def run() -> None:
            out.append(self._nvme_io(keys, places, write, errors, busy))

        th = threading.Thread(target=run, name="nvme-io", daemon=True)
        th.start()
        th.join(2 * IO_TIMEOUT_S)
        if out:
            return out[0]
        t = busy[-1] if busy else places[0][0]
        self._kill(t, TimeoutError(f"no answer in {2 * IO_TIMEOUT_S:g} s"), errors)
        return list(keys)

    def _nvme_io(self, keys: Sequence[int], places: Sequence[tuple[int, int]], write: bool,
                 errors: dict[str, str], busy: list[int]) -> list[int]:
        futures = []
        failed: list[int] = []
        for i, (k, (t, slot)) in enumerate(zip(keys, places, strict=True)):
            eng = self.engines[t]
            if eng is None or t in self.dead:
                failed.append(k)
                continue
            row = memoryview(self.rows[i])
            busy.append(t)
            try:
                f = (eng.submit_write if write else eng.submit_read)(slot * self.padded, row)
            except Exception as exc:
                self._kill(t, exc, errors)
                failed.append(k)
                continue
            futures.append((k, t, f))
        for k, t, f in futures:
            busy.append(t)
            try:
                f.result(timeout=IO_TIMEOUT_S)
            except Exception as exc:
                self._kill(t, exc, errors)
                failed.append(k)
        return failed

    def _kill(self, t: int, exc: BaseException, errors: dict[str, str]) -> None:
        """Target ``t`` is dead for this engine: say why, and shut its connection on a
        thread of its own (closing one that does not answer may itself wait)."""
        import threading

        why = f"{type(exc).__name__}: {exc}".strip()
        if t not in self.dead:
            self.dead[t] = why
            eng = self.engines[t]
            if eng is not None:
                threading.Thread(target=_close_quietly, args=(eng,), daemon=True).start()
        errors[self.spec.targets[t].name] = self.dead[t]

    def remove(self, keys: Sequence[int]) -> None:
        """Drop Mooncake objects (an eviction); names already gone are fine."""
        for start in range(0, len(keys), 256):
            self.mooncake.batch_remove([self._name(k) for k in keys[start:start + 256]])

    def drop_node_memory(self) -> None:
        """The node loses its memory: its DRAM pool file goes (the engines that restart
        on it map a new, empty one)."""
        if self.spec.dram_path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.spec.dram_path)

    def close(self) -> None:
        for t, e in enumerate(self.engines):
            if e is not None and t not in self.dead:  # a dead one is being closed already
                _close_quietly(e)
        if self.mooncake is not None:
            self.mooncake.close()
        self.dram = None


def _close_quietly(engine: Any) -> None:
    # a dead target's connection: what is left of it goes, whatever it answers
    with contextlib.suppress(Exception):
        engine.close()


# ------------------------------------------------------------------ on the driver
@dataclass
class SlotMap:
    """Blocks in a fixed number of slots. Invariant: a key holds at most one slot, a slot
    at most one key."""

    slots: int
    of: dict[int, int] = field(default_factory=dict)
    free: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.free = list(range(self.slots - 1, -1, -1))

    def place(self, key: int) -> int | None:
        """The key's slot (a new one if it had none); ``None`` when every slot is taken."""
        s = self.of.get(key)
        if s is None and self.free:
            s = self.of[key] = self.free.pop()
        return s

    def drop(self, key: int) -> None:
        s = self.of.pop(key, None)
        if s is not None:
            self.free.append(s)


@dataclass
class _Counter(TierCounters):
    """A tier's measured traffic, and the writes that a dead target or node refused."""

    failed_writes: int = 0


class RayClusterData:
    """The serving model's tiers on a cluster's nodes (module docstring); a
    :class:`~kvtool.serving.sim.DataBackend` with its report (:meth:`result`)."""

    def __init__(self, built: BuiltCluster, state: ClusterState, *, seed: int = 0,
                 faults: Sequence[Fault] = ()) -> None:
        import sys

        joined = sys.modules.get("ray")
        if joined is None or not joined.is_initialized():
            # Ray reads its token settings when it is imported
            os.environ.update(state.ray_env())
        import ray

        self.built = built
        self.state = state
        self.seed = seed
        self.block_bytes = built.setup.engines[0].block_bytes
        self.run = uuid.uuid4().hex[:12]
        self.faults = FaultInjector(faults, self)
        self.clock: Callable[[], float] = lambda: 0.0
        self.wall0 = time.monotonic()
        self._started_ray = False
        if not ray.is_initialized():
            from kvtool.cluster.driver import connect

            connect(state)  # the cluster's Ray head, with its token
            self._started_ray = True
        self.verified = self.corrupt = self.lost = 0
        self.cross: dict[str, int] = {}
        self.named: list[dict[str, Any]] = []
        self.counters: dict[str, _Counter] = {}
        self.writer: dict[tuple[str, str | None, int], int] = {}
        self.gone: set[tuple[str, str | None, int]] = set()
        """Blocks the model holds whose bytes are lost (a fault, a failed write)."""
        self.in_mooncake: set[int] = set()
        self.restarts = [0] * len(built.setup.engines)
        tiers = {t.name: t for t in built.setup.tiers if t.capacity_blocks > 0}
        for t in tiers.values():
            if t.capacity_blocks == math.inf:
                raise UsageError(f"data mode holds real bytes: the {t.name} tier of "
                                 f"{built.name} needs a size (use {param('simulate')} for an "
                                 "unbounded tier)", field="cluster")
        self.dram: dict[str, SlotMap] = {t.node: SlotMap(int(t.capacity_blocks))
                                         for t in built.setup.tiers
                                         if t.name == "dram" and t.capacity_blocks > 0
                                         and t.node is not None}
        nodes = {n.name: n for n in state.nodes}
        missing = sorted({e.node for e in built.setup.engines} - set(nodes))
        if missing:
            raise UsageError(f"cluster {state.name} has no node {', '.join(missing)} that "
                             f"{built.name} places engines on", field="cluster")
        self.targets: list[Any] = self._nvme_targets(tiers)
        mooncake_url, segment = self._mooncake_share(tiers)
        self.specs = self._worker_specs(nodes, mooncake_url, segment)
        self.workers: list[Any] = []
        try:
            self._start_workers()
        except BaseException:
            self.close()
            raise
        self.nvme: list[SlotMap] = self._nvme_slots()
        self.places = self._places()

    def _nvme_targets(self, tiers: dict[str, TierSetup]) -> list[Any]:
        """The cluster's storage targets behind the nvme tier's targets, by name (else in
        turn); none without an nvme tier."""
        state, built = self.state, self.built
        if "nvme" not in tiers:
            return []
        names = [name for name, _r, _w in tiers["nvme"].targets]
        by_name = {t.name: t for t in state.targets}
        if not state.targets:
            raise UsageError(f"cluster {state.name} has no storage target for the nvme "
                             f"tier of {built.name}", field="cluster")
        return [by_name.get(n, state.targets[i % len(state.targets)])
                for i, n in enumerate(names)]

    def _mooncake_share(self, tiers: dict[str, TierSetup]) -> tuple[str | None, int]:
        """The Mooncake master's URL for the mooncake tier (None without one), and the
        bytes each engine lends the pool (0 where the nodes lend their own segments)."""
        state, built = self.state, self.built
        if "mooncake" not in tiers:
            return None, 0
        if state.mooncake is None:
            raise UsageError(f"cluster {state.name} has no Mooncake master for the "
                             f"mooncake tier of {built.name}", field="cluster")
        mooncake_url = _mooncake_url(state)
        # the cluster's nodes lend their segments through clients of their own
        # (kvtool cluster up); else each engine lends a share of the pool
        segment = 0 if state.mooncake.segments else max(64 << 20, math.ceil(
            tiers["mooncake"].capacity_blocks * self.block_bytes * SEGMENT_HEADROOM
            / len(built.setup.engines)))
        return mooncake_url, segment

    def _worker_specs(self, nodes: dict[str, Any], mooncake_url: str | None,
                      segment: int) -> list[WorkerSpec]:
        """What each engine's worker actor is started with: its node, DRAM pool, Mooncake
        share and storage targets."""
        specs = []
        for i, e in enumerate(self.built.setup.engines):
            node = nodes[e.node]
            dram = self.dram.get(e.node)
            specs.append(WorkerSpec(
                index=i, name=e.name, node=e.node, address=node.address,
                block_bytes=self.block_bytes, seed=self.seed, run=self.run,
                dram_path=f"/dev/shm/kvtool-{self.run}-{e.node}.dram" if dram else None,
                dram_slots=dram.slots if dram else 0, mooncake=mooncake_url,
                local_hostname=node.address, segment_bytes=segment,
                targets=tuple(TargetAccess(t.name, t.url, t.hostnqn, t.dhchap_key_file,
                                         t.dhchap_ctrl_key_file) for t in self.targets)))
        return specs

    def _nvme_slots(self) -> list[SlotMap]:
        """The slots of each storage target's namespace, as the first worker found it
        (closing everything when a target cannot be reached)."""
        nvme: list[SlotMap] = []
        if self.targets:
            info = self._ready[0]["targets"]
            padded = -(-self.block_bytes // 4096) * 4096
            for t, ns in zip(self.targets, info, strict=True):
                if ns is None:
                    self.close()
                    raise UsageError(f"engine {self.specs[0].name} cannot reach target "
                                     f"{t.name} ({t.url}): {self._ready[0]['dead']}",
                                     field="cluster")
                nvme.append(SlotMap(ns["size"] // padded))
        return nvme

    # -------------------------------------------------------------- workers
    def _start_workers(self) -> None:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        by_ip = {n["NodeManagerAddress"]: n["NodeID"] for n in ray.nodes() if n.get("Alive")}
        actor = ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=0)(EngineWorker)
        for s in self.specs:
            node_id = by_ip.get(s.address)
            if node_id is None:
                raise UsageError(f"no Ray node at {s.address} (node {s.node} of engine "
                                 f"{s.name}); Ray nodes: {', '.join(sorted(by_ip))}",
                                 field="cluster")
            self.workers.append(actor.options(
                name=f"kvtool-{self.run}-{s.index}",
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)
            ).remote(s))
        self._ready = ray.get([w.ready.remote() for w in self.workers])
        self._pids = [r["pid"] for r in self._ready]

    def _call(self, engine: int, method: str, *args: Any) -> Any:
        """One call on an engine's actor; ``None`` when the actor died during it."""
        import ray

        try:
            return ray.get(getattr(self.workers[engine], method).remote(*args))
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError,
                ray.exceptions.ActorUnschedulableError):
            # died, or its node is gone (a cut link: Ray cannot place it again)
            self.restarts[engine] += 1
            return None

    def started(self, clock: Callable[[], float]) -> None:
        """The run's simulated clock (faults fire on it)."""
        self.clock = clock

    def await_restart(self, engines: list[int]) -> None:
        """Wait until Ray has brought the killed actors back (new processes on their
        nodes), so that the run goes on against engines that are up again."""
        import ray

        deadline = time.monotonic() + RESTART_TIMEOUT_S
        for i in engines:
            while True:
                try:
                    now = ray.get(self.workers[i].ready.remote(), timeout=RESTART_TIMEOUT_S)
                except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError,
                        ray.exceptions.ActorUnschedulableError,
                        ray.exceptions.GetTimeoutError):
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.1)
                    continue
                if now["pid"] != self._pids[i]:
                    self._pids[i] = now["pid"]
                    break
                time.sleep(0.1)  # the kill has not reached it yet

    def call(self, engine: int, method: str, *args: Any) -> Any:
        """``method(*args)`` on engine ``engine``'s actor (the fault injector's way in)."""
        return self._call(engine, method, *args)

    # -------------------------------------------------------------- DataBackend
    def _count(self, tier: str) -> _Counter:
        c = self.counters.get(tier)
        if c is None:
            c = self.counters[tier] = _Counter()
        return c

    def _where(self, tier: str, node: str | None, keys: list[int]
               ) -> tuple[list[int], list[Any], list[int]]:
        """Placed keys, their places, and the keys with no place (full or dead)."""
        placed: list[int] = []
        where: list[Any] = []
        unplaced: list[int] = []
        for k in keys:
            if tier == "dram":
                assert node is not None
                s = self.dram[node].place(k)
                w: Any = s
            elif tier == "nvme":
                t = k % len(self.nvme)
                s = self.nvme[t].place(k)
                w = (t, s)
            else:
                s = 0
                w = k in self.in_mooncake
            if s is None:
                unplaced.append(k)
            else:
                placed.append(k)
                where.append(w)
        return placed, where, unplaced

    def on_store(self, tier: str, node: str | None, keys: list[int], engine: int) -> None:
        self.faults.due(self.clock())
        node = node if tier == "dram" else None
        placed, where, failed = self._where(tier, node, keys)
        c = self._count(tier)
        if placed:
            out = self._call(engine, "store", tier, placed, where)
            if out is None:
                failed += placed
            else:
                failed += out["failed"]
                c.write_s += out["seconds"]
                self._errors(out["errors"])
        bad = set(failed)
        for k in keys:
            if k in bad:
                self.gone.add((tier, node, k))
            else:
                self.gone.discard((tier, node, k))
                self.writer[(tier, node, k)] = engine
                if tier == "mooncake":
                    self.in_mooncake.add(k)
        ok = len(keys) - len(bad)
        c.blocks_written += ok
        c.bytes_written += ok * self.block_bytes
        c.failed_writes += len(bad)

    def on_load(self, tier: str, node: str | None, keys: list[int], engine: int) -> list[int]:
        self.faults.due(self.clock())
        node = node if tier == "dram" else None
        known = [k for k in keys if (tier, node, k) not in self.gone]
        lost = [k for k in keys if (tier, node, k) in self.gone]
        corrupt: list[int] = []
        c = self._count(tier)
        if known:
            where: list[Any]
            if tier == "dram":
                assert node is not None
                where = [self.dram[node].of[k] for k in known]
            elif tier == "nvme":
                where = [(k % len(self.nvme), self.nvme[k % len(self.nvme)].of[k]) for k in known]
            else:
                where = [None] * len(known)
            out = self._call(engine, "load", tier, known, where)
            if out is None:
                lost += known
            else:
                lost += out["lost"]
                corrupt = out["corrupt"]
                c.read_s += out["seconds"]
                self._errors(out["errors"])
                bad = set(out["lost"]) | set(corrupt)
                for k in known:
                    if k in bad:
                        continue
                    self.verified += 1
                    c.blocks_read += 1
                    c.bytes_read += self.block_bytes
                    if self.writer.get((tier, node, k), engine) != engine:
                        self.cross[tier] = self.cross.get(tier, 0) + 1
        for k in lost:
            self.lost += 1
            self.gone.add((tier, node, k))
            self._name("lost", k, tier, engine)
        for k in corrupt:
            self.corrupt += 1
            self._name("corrupt", k, tier, engine)
        return lost + corrupt

    def on_evict(self, tier: str, node: str | None, keys: list[int]) -> None:
        self.faults.due(self.clock())
        node = node if tier == "dram" else None
        for k in keys:
            self.writer.pop((tier, node, k), None)
            self.gone.discard((tier, node, k))
            if tier == "dram":
                assert node is not None
                self.dram[node].drop(k)
            elif tier == "nvme":
                self.nvme[k % len(self.nvme)].drop(k)
        if tier == "mooncake":
            held = [k for k in keys if k in self.in_mooncake]
            self.in_mooncake.difference_update(held)
            if held:
                self._call(0, "remove", held)
        self._count(tier).evicted += len(keys)

    def _errors(self, errors: dict[str, str]) -> None:
        for name, why in errors.items():
            if not any(p.get("target") == name for p in self.named):
                self.named.append({"kind": "target failed", "target": name, "error": why,
                                   "at_s": self.clock()})

    def _name(self, kind: str, key: int, tier: str, engine: int) -> None:
        if len(self.named) < MAX_NAMED:
            self.named.append({"kind": kind, "key": key, "tier": tier,
                               "engine": self.specs[engine].name, "at_s": self.clock()})

    # -------------------------------------------------------------- report
    def _places(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for node, m in self.dram.items():
            out[f"dram/{node}"] = f"/dev/shm of node {node} ({m.slots:,} blocks)"
        if self.specs and self.specs[0].mooncake:
            out["mooncake"] = (f"Mooncake Store at {self.specs[0].mooncake} (a segment from "
                               f"each of {len(self.specs)} engines)")
        for t, m in zip(self.targets, self.nvme, strict=True):
            out[f"nvme/{t.name}"] = f"{t.url} ({m.slots:,} slots, DH-HMAC-CHAP)"
        return out

    def result(self) -> dict[str, Any]:
        return {"mode": "data", "runtime": "ray", "run": self.run,
                "block_bytes": self.block_bytes,
                "seed": self.seed, "places": dict(self.places),
                "verified_blocks": self.verified, "corrupt_blocks": self.corrupt,
                "lost_blocks": self.lost,
                "cross_engine_hits": sum(self.cross.values()),
                "cross_engine_hits_by_tier": dict(sorted(self.cross.items())),
                "problems": list(self.named),
                "tiers": {k: v.to_dict() for k, v in sorted(self.counters.items())},
                "engines": self._engines(),
                "faults": list(self.faults.fired),
                "basis": "measured"}

    def _engines(self) -> list[dict[str, Any]]:
        """Each engine actor: where it runs, its process now and at the start (a killed
        actor comes back as another process), calls that failed because it died."""
        out = []
        for i, s in enumerate(self.specs):
            now = self._call(i, "ready")
            out.append({"name": s.name, "node": s.node, "address": s.address,
                        "pid": None if now is None else now["pid"],
                        "first_pid": self._ready[i]["pid"],
                        "restarted": now is None or now["pid"] != self._ready[i]["pid"],
                        "failed_calls": self.restarts[i]})
        return out

    def close(self) -> None:
        """Set up again the links a fault cut, close every engine's connections, remove
        each node's DRAM pool, stop the actors."""

        import ray

        self.faults.restore_links()
        if not ray.is_initialized():
            return
        dropped: set[str] = set()
        for i, w in enumerate(self.workers):
            self._call(i, "close")
            if self.specs[i].dram_path and self.specs[i].node not in dropped:
                dropped.add(self.specs[i].node)
                self._call(i, "drop_node_memory")
            ray.kill(w, no_restart=True)
        self.workers = []
        for spec in self.specs:
            # netns nodes share this machine's /dev/shm: a pool whose engines could not
            # remove it (dead) goes here
            if spec.dram_path is not None:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(spec.dram_path)
        if self._started_ray:
            ray.shutdown()


def _mooncake_url(state: ClusterState) -> str:
    from urllib.parse import urlsplit

    assert state.mooncake is not None
    meta = urlsplit(state.mooncake.metadata)
    return f"mooncake://{state.mooncake.master}?metadata={meta.hostname}:{meta.port}"


__all__ = ["FAULT_KINDS", "ON_HEAD_ENV", "EngineWorker", "Fault", "RayClusterData", "SlotMap", "TargetAccess",
           "WorkerSpec", "cluster_up", "on_head"]
