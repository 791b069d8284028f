"""Links shared by concurrent flows: per-direction bandwidth, max-min fair rates.

A :class:`FlowNetwork` holds named links, each with a bandwidth per direction (``"up"``
and ``"down"``, GB/s = 1e9 B/s; ``math.inf`` means unlimited). A flow moves ``nbytes``
over a path of ``(link, direction)`` hops; while it is active it holds every hop at once
(a cut-through transfer, as RDMA and NVMe-oF move data), so its rate is limited by its
most contended hop.

Rates are **max-min fair**, computed by progressive filling: all flows' rates rise
together; when a hop's bandwidth is used up, the flows through it are frozen at their
share and the rest keep rising. Rates are recomputed whenever a flow starts or ends, and
only for the flows connected to the change (those sharing a hop, transitively).

Invariants:

* Flows with the same path always get the same rate, so they are kept together in one
  *class*: a class has a count, a rate and a "virtual service" counter (bytes each of its
  flows has received since the class was created); a flow finishes when the counter
  reaches its start value plus its size. Work per event is proportional to the number of
  classes touched, not the number of flows.
* The time only moves forward: :meth:`FlowNetwork.advance` completes flows in order of
  finish time, ties by start order, calling each ``on_done(t)`` with the finish time
  ``t`` (after the network's state is consistent, so a callback may start new flows at
  ``t``). :meth:`FlowNetwork.start` never completes a flow nor runs a callback; it
  refuses a ``now`` past a pending completion.
* A zero-byte flow, or one whose every hop is unlimited, finishes at its start time:
  :meth:`next_completion` returns that time and the next ``advance`` completes it (its
  callback never runs inside :meth:`start`).
* Conservation: every byte started is delivered exactly once on every hop of its path
  (``stats()`` counts bytes per hop and direction, bytes still in flight included up to
  the current time).

Stats per link and direction: ``bytes`` delivered, ``busy_s`` (time with at least one
active flow), ``peak_flows`` (most flows active at once). All figures are *simulated*.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Final

DIRECTIONS = ("up", "down")
GB: Final = 1e9  # GB/s → B/s

Hop = tuple[str, str]  # (link name, "up" | "down")
OnDone = Callable[[float], object]

# Relative tolerance below which a flow's remaining bytes count as delivered (float error
# from splitting time into many rate periods).
_REL_EPS: Final = 1e-9
_ABS_EPS: Final = 1e-6


@dataclass(eq=False, slots=True)
class Flow:
    """One transfer: ``nbytes`` over ``path``, started at ``start_time``."""

    id: int
    nbytes: float
    path: tuple[Hop, ...]
    start_time: float
    on_done: OnDone | None = None
    end_time: float | None = None
    _target: float = 0.0  # class virtual-service value at which it is done

    @property
    def done(self) -> bool:
        return self.end_time is not None


@dataclass(eq=False, slots=True)
class _Resource:
    """One direction of one link."""

    capacity: float  # B/s
    classes: dict[_Class, None] = field(default_factory=dict)
    """The classes through it, in the order they were created (a dict, not a set: a set of
    objects iterates in address order, which would make rates' rounding differ run to run)."""
    active: int = 0  # flows
    bytes: float = 0.0
    busy_s: float = 0.0
    busy_since: float = 0.0
    peak_flows: int = 0
    # scratch of FlowNetwork._component / _rebalance
    mark: int = 0
    cap_left: float = 0.0
    weight: int = 0
    users: list[_Class] = field(default_factory=list)


@dataclass(eq=False, slots=True)
class _Class:
    """The active flows sharing one path; they all get the same rate."""

    path: tuple[Hop, ...]
    resources: tuple[_Resource, ...]
    flows: list[tuple[float, int, Flow]] = field(default_factory=list)  # heap by (target, id)
    rate: float = 0.0  # B/s per flow
    served: float = 0.0  # virtual service (bytes per flow) at `settled`
    settled: float = 0.0
    version: int = 0
    finish: float = math.inf  # of the head flow, as last scheduled
    head_id: int = -1
    mark: int = 0  # scratch of FlowNetwork._component / _rebalance
    new_rate: float = 0.0


class FlowNetwork:
    """Links with per-direction bandwidth shared max-min fairly by concurrent flows."""

    def __init__(self) -> None:
        self._res: dict[Hop, _Resource] = {}
        self._links: list[str] = []
        self._classes: dict[tuple[Hop, ...], _Class] = {}
        self._spare: dict[tuple[Hop, ...], _Class] = {}
        """Classes that emptied, one per path, reused by the path's next flow."""
        self._paths: dict[tuple[Hop, ...], tuple[Hop, ...]] = {}  # checked paths
        self._heap: list[tuple[float, int, int, int, _Class]] = []  # (finish, head id, tie, version)
        self._ids = itertools.count()
        self._tie = itertools.count()
        self._gen = 0
        self._now = 0.0
        self._active = 0
        self.started_bytes = 0.0
        self.delivered_bytes = 0.0
        self.completed = 0

    # -- links -------------------------------------------------------------------------------

    def add_link(self, name: str, up_gbps: float = math.inf, down_gbps: float = math.inf) -> None:
        """Add a link with ``up_gbps`` and ``down_gbps`` (GB/s per direction, > 0 or inf)."""
        if name in self._links:
            raise ValueError(f"link {name!r} already exists")
        for label, gbps in (("up_gbps", up_gbps), ("down_gbps", down_gbps)):
            if not gbps > 0:
                raise ValueError(f"link {name!r}: {label} must be > 0, got {gbps!r}")
        self._links.append(name)
        self._res[(name, "up")] = _Resource(up_gbps * GB)
        self._res[(name, "down")] = _Resource(down_gbps * GB)

    def has_link(self, name: str) -> bool:
        return (name, "up") in self._res

    def resource(self, hop: Hop) -> _Resource:
        """One hop's capacity (B/s) and counters: a lane (:mod:`kvtool.serving.lanes`)
        that carries the hop's flows keeps them, so :meth:`stats` reports its traffic."""
        return self._res[hop]

    def capacity(self, name: str, direction: str) -> float:
        """A link's bandwidth in one direction, GB/s (``inf`` when unlimited)."""
        try:
            return self._res[(name, direction)].capacity / GB
        except KeyError:
            raise ValueError(f"unknown link or direction: {name!r} {direction!r}") from None

    @property
    def links(self) -> tuple[str, ...]:
        return tuple(self._links)

    @property
    def now(self) -> float:
        """The network's clock: the latest time it was advanced or started at."""
        return self._now

    @property
    def active_flows(self) -> int:
        return self._active

    # -- flows -------------------------------------------------------------------------------

    def start(self, now: float, nbytes: float, path: Sequence[Hop],
              on_done: OnDone | None = None) -> Flow:
        """Start a flow of ``nbytes`` over ``path`` at ``now``; ``on_done(t)`` runs when done.

        Nothing completes inside ``start``: call :meth:`advance` up to ``now`` first (a flow
        due before ``now`` and not yet completed is an error; one due exactly at ``now`` may
        wait for the next ``advance``).
        """
        if not 0.0 <= nbytes < math.inf:  # (nan compares false)
            raise ValueError(f"flow size must be a finite number >= 0, got {nbytes!r}")
        key = tuple(path)
        try:
            hops = self._paths.get(key)
        except TypeError:  # hops given as lists
            key = tuple(tuple(h) for h in path)  # type: ignore[misc]
            hops = self._paths.get(key)
        if hops is None:
            hops = self._check_path(key)
            self._paths[key] = hops
        self._move_to(now)
        t = self._now
        size = float(nbytes)
        flow = Flow(next(self._ids), size, hops, t, on_done)
        self.started_bytes += size
        cls = self._classes.get(hops)
        if cls is None:
            cls = self._spare.pop(hops, None)
            if cls is None:
                cls = _Class(hops, tuple(self._res[h] for h in hops), settled=t)
            else:  # the path's last class, emptied: as new (its version goes on rising)
                cls.served = cls.rate = 0.0
                cls.settled = t
                cls.finish = math.inf
                cls.head_id = -1
            self._classes[hops] = cls
            for r in cls.resources:
                r.classes[cls] = None
        else:
            self._settle(cls)
        target = cls.served + size
        flow._target = target
        heapq.heappush(cls.flows, (target, flow.id, flow))
        self._active += 1
        for r in cls.resources:
            active = r.active
            if active == 0:
                r.busy_since = t
            active += 1
            r.active = active
            if active > r.peak_flows:
                r.peak_flows = active
        self._rebalance(cls.resources, cls)
        return flow

    def _check_path(self, path: tuple[Hop, ...]) -> tuple[Hop, ...]:
        hops = tuple((str(link), str(d)) for link, d in path)
        if not hops:
            raise ValueError("a flow needs at least one (link, direction) hop")
        if len(set(hops)) != len(hops):
            raise ValueError(f"a flow's path lists a hop twice: {hops}")
        for hop in hops:
            if hop not in self._res:
                if hop[1] not in DIRECTIONS:
                    raise ValueError(f"direction must be 'up' or 'down', got {hop[1]!r}")
                raise ValueError(f"unknown link {hop[0]!r}")
        return hops

    def rate(self, flow: Flow) -> float:
        """The flow's current rate in B/s (0 once it is done)."""
        if flow.done:
            return 0.0
        return self._classes[flow.path].rate

    def next_completion(self) -> float | None:
        """Absolute time at which the next active flow finishes (None when none is active)."""
        heap = self._heap  # _top, written out: the event loop asks before every event
        while heap:
            entry = heap[0]
            cls = entry[4]
            if entry[3] == cls.version and cls.flows:
                return entry[0]
            heapq.heappop(heap)
        return None

    def advance(self, t: float) -> int:
        """Move the clock to ``t``, completing (in order) the flows that finish by then.

        Returns how many flows completed. Going back in time is an error.
        """
        if t < self._now:
            if self._now - t > 1e-9 * max(1.0, abs(self._now)):
                raise ValueError(f"cannot go back in time: now {self._now!r}, asked {t!r}")
            t = self._now
        done = 0
        while True:
            top = self._top()
            if top is None or top[0] > t:
                break
            finish, _, _, _, cls = heapq.heappop(self._heap)
            self._now = max(self._now, finish)
            done += self._complete_head(cls)
        self._now = float(t)
        return done

    def _move_to(self, now: float) -> None:
        if now < self._now:
            if self._now - now > 1e-9 * max(1.0, abs(self._now)):
                raise ValueError(f"cannot go back in time: now {self._now!r}, asked {now!r}")
            return
        top = self._top()
        if top is not None and now - top[0] > 1e-9 * max(1.0, abs(now)):
            raise ValueError(f"a flow finishes at {top[0]!r}, before {now!r}: advance() first")
        self._now = float(now)

    def stats(self) -> dict[str, dict[str, dict[str, float]]]:
        """``{link: {"up": {"bytes", "busy_s", "peak_flows"}, "down": {...}}}`` up to now."""
        for cls in self._classes.values():
            self._settle(cls)
        out: dict[str, dict[str, dict[str, float]]] = {}
        for name in self._links:
            per: dict[str, dict[str, float]] = {}
            for d in DIRECTIONS:
                r = self._res[(name, d)]
                busy = r.busy_s + (self._now - r.busy_since if r.active else 0.0)
                per[d] = {"bytes": r.bytes, "busy_s": busy, "peak_flows": r.peak_flows}
            out[name] = per
        return out

    def release(self) -> None:
        """Break the network's reference cycles (a link refers to its flow classes and they
        to it) once it is no longer advanced: the classes, the emptied ones kept for reuse,
        the completion heap and the scratch lists are dropped (with any flow still in
        flight); the links and their counts (:meth:`stats`) stay."""
        for r in self._res.values():
            r.classes.clear()
            r.users = []
        self._classes.clear()
        self._spare.clear()
        self._heap = []

    # -- internals ---------------------------------------------------------------------------

    def _top(self) -> tuple[float, int, int, int, _Class] | None:
        heap = self._heap
        while heap:
            entry = heap[0]
            cls = entry[4]
            if entry[3] == cls.version and cls.flows:
                return entry
            heapq.heappop(heap)
        return None

    def _settle(self, cls: _Class) -> None:
        """Bring the class's virtual service (and its hops' byte counts) up to now."""
        dt = self._now - cls.settled
        if dt > 0 and cls.flows and cls.rate > 0 and not math.isinf(cls.rate):
            delta = cls.rate * dt
            cls.served += delta
            moved = delta * len(cls.flows)
            for r in cls.resources:
                r.bytes += moved
        cls.settled = self._now

    def _complete_head(self, cls: _Class) -> int:
        """Complete every flow of ``cls`` that is done at the current time."""
        self._settle(cls)
        finished: list[Flow] = []
        if math.isinf(cls.rate):
            while cls.flows:
                _, _, f = heapq.heappop(cls.flows)
                finished.append(f)
        else:
            while cls.flows:
                target = cls.flows[0][0]
                if target - cls.served > _REL_EPS * target + _ABS_EPS:
                    break
                _, _, f = heapq.heappop(cls.flows)
                finished.append(f)
            if not finished:  # float noise: the head is due now
                _, _, f = heapq.heappop(cls.flows)
                finished.append(f)
        for f in finished:
            # Credit the bytes the lazy counter has not (rounding, or an unlimited path).
            left = f._target - cls.served
            if left > 0:
                for r in cls.resources:
                    r.bytes += left
            f.end_time = self._now
            self.delivered_bytes += f.nbytes
            self.completed += 1
            self._active -= 1
            for r in cls.resources:
                r.active -= 1
                if r.active == 0:
                    r.busy_s += self._now - r.busy_since
        if cls.flows:
            self._rebalance(cls.resources, cls)
        else:
            del self._classes[cls.path]
            for r in cls.resources:
                r.classes.pop(cls, None)
            cls.version += 1
            self._spare[cls.path] = cls
            for r in cls.resources:
                if r.classes:  # (else no class is connected to the change: no rate moves)
                    self._rebalance(cls.resources)
                    break
        for f in finished:
            if f.on_done is not None:
                f.on_done(self._now)
        return len(finished)

    def _component(self, seeds: Iterable[_Resource]) -> tuple[list[_Class], list[_Resource]]:
        """The classes and resources connected to ``seeds`` through shared hops."""
        self._gen += 1
        gen = self._gen
        classes: list[_Class] = []
        resources: list[_Resource] = []
        stack = list(seeds)
        while stack:
            r = stack.pop()
            if r.mark == gen:
                continue
            r.mark = gen
            resources.append(r)
            for c in r.classes:
                if c.mark != gen:
                    c.mark = gen
                    classes.append(c)
                    stack.extend(c.resources)
        return classes, resources

    def _rebalance(self, seeds: Iterable[_Resource], changed: _Class | None = None) -> None:
        """Recompute max-min fair rates (progressive filling) for the connected classes.

        Only classes whose rate changes (or ``changed``, whose flows did) are settled and
        rescheduled: between rate changes a class's service is linear in time.
        """
        if changed is not None:
            res = changed.resources
            for r in res:
                if len(r.classes) != 1:
                    break
            else:
                # the class is alone on its hops: its rate is the smallest share, as
                # progressive filling finds it (the same division, the same float)
                flows = changed.flows
                n = len(flows)
                rate = math.inf
                for r in res:
                    cap = r.capacity
                    share = (cap if cap > 0.0 else 0.0) / n
                    if share < rate:
                        rate = share
                now = self._now
                # _settle, then _schedule, written out (a flow starts or ends here)
                old = changed.rate
                dt = now - changed.settled
                if dt > 0 and old > 0 and old != math.inf:
                    delta = old * dt
                    changed.served += delta
                    moved = delta * n
                    for r in res:
                        r.bytes += moved
                changed.settled = now
                changed.rate = rate
                head_target, head_id, _ = flows[0]
                if rate == math.inf:
                    finish = now
                elif rate <= 0:
                    finish = math.inf
                else:
                    left = head_target - changed.served
                    finish = now + (left if left > 0.0 else 0.0) / rate
                if finish == changed.finish and head_id == changed.head_id:
                    return
                changed.version += 1
                changed.finish, changed.head_id = finish, head_id
                heap = self._heap
                if finish < math.inf:
                    heapq.heappush(heap, (finish, head_id, next(self._tie), changed.version,
                                          changed))
                if len(heap) > 64 + 4 * len(self._classes):  # drop stale entries
                    self._heap = [e for e in heap if e[3] == e[4].version and e[4].flows]
                    heapq.heapify(self._heap)
                return
        classes, resources = self._component(seeds)
        if classes:
            self._fill(classes, resources, changed)

    def _fill(self, classes: list[_Class], resources: list[_Resource],
              changed: _Class | None) -> None:
        """Progressive filling over connected ``classes`` and their ``resources``: each
        class's max-min fair rate; those whose rate changes (and ``changed``) are settled
        and rescheduled."""
        for r in resources:
            r.cap_left = r.capacity
            r.weight = 0
            r.users = []
        for c in classes:
            n = len(c.flows)
            c.new_rate = -1.0
            for r in c.resources:
                r.weight += n
                r.users.append(c)
        open_res = [r for r in resources if r.weight > 0]
        left = len(classes)
        while left:
            best: _Resource | None = None
            best_share = math.inf
            for r in open_res:
                w = r.weight
                if w > 0:
                    cap = r.cap_left
                    share = (cap if cap > 0.0 else 0.0) / w
                    if share < best_share:
                        best, best_share = r, share
            if best is None:  # only unlimited hops remain
                for c in classes:
                    if c.new_rate < 0:
                        c.new_rate = math.inf
                break
            open_res.remove(best)
            for c in best.users:
                if c.new_rate >= 0:
                    continue
                c.new_rate = best_share
                left -= 1
                n = len(c.flows)
                used = best_share * n
                for r in c.resources:
                    r.cap_left -= used
                    r.weight -= n
        for c in classes:
            new = c.new_rate
            old = c.rate
            if c is not changed and (new == old or (old < math.inf and abs(new - old) <= 1e-12 * old)):
                continue
            self._settle(c)
            c.rate = new
            self._schedule(c)

    def _schedule(self, c: _Class) -> None:
        """(Re)enter the class in the heap at its head flow's finish time, if that changed."""
        head_target, head_id, _ = c.flows[0]
        if math.isinf(c.rate):
            finish = self._now
        elif c.rate <= 0:
            finish = math.inf
        else:
            finish = self._now + max(0.0, head_target - c.served) / c.rate
        if finish == c.finish and head_id == c.head_id:
            return
        c.version += 1
        c.finish, c.head_id = finish, head_id
        if finish < math.inf:
            heapq.heappush(self._heap, (finish, head_id, next(self._tie), c.version, c))
        if len(self._heap) > 64 + 4 * len(self._classes):  # drop stale entries
            self._heap = [e for e in self._heap if e[3] == e[4].version and e[4].flows]
            heapq.heapify(self._heap)
