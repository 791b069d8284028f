"""Flows over hops no other path shares: the flow network's arithmetic without its machinery.

In a cluster whose tiers below are each node's DRAM only, with no P/D split and no
connector hop (the replay's one-engine case), every flow is a load over its engine's PCIe
into the GPU or a store out of it: a one-hop path that no flow of another path crosses.
There :class:`~kvtool.serving.links.FlowNetwork`'s max-min fair rates are each hop's
capacity over its flows (every hop holds one class, alone: the network's lone-class path)
and a flow's rate never depends on another hop. :class:`Lanes` keeps each such hop as a
processor-sharing queue (a *lane*) with the same state as the network's class (virtual
service, settle time, rate, the head's finish) and the same float operations in the same
order, updating the network's own per-hop counters (bytes, busy time, peak flows) so that
:meth:`FlowNetwork.stats` reads them as before. Completions go in the network's order:
by finish time, then by the head flow's start order (ids count every flow of every lane).

What it saves per flow: the path check, the flow object, the class bookkeeping, the
rebalancing call and the generic completion loop; the event loop asks :meth:`Lanes.
next_completion` as it asked the network (``tests/serving/test_lanes.py`` checks reports
with and without lanes, byte for byte).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from typing import Any

from kvtool.serving.links import _ABS_EPS, _REL_EPS, FlowNetwork, _Resource

Hop = tuple[str, str]
OnDone = Callable[[float], object]


class _Lane:
    """One hop's flows (the network's class of the one-hop path, alone on its hop)."""

    __slots__ = ("dirty", "finish", "flows", "head_id", "rate", "res", "served", "settled",
                 "version")

    def __init__(self, res: _Resource) -> None:
        self.res = res
        self.flows: list[tuple[float, int, float, OnDone | None]] = []
        """Heap of (target, id, bytes, on_done)."""
        self.rate = 0.0
        self.served = 0.0
        self.settled = 0.0
        self.version = 0
        self.finish = math.inf
        self.head_id = -1
        self.dirty = False
        """Flows started since its head's finish was last scheduled (:meth:`Lanes._flush`)."""


class Lanes:
    """A :class:`FlowNetwork` stand-in for one-hop paths that nothing else crosses (module
    docstring): :meth:`start`, :meth:`next_completion`, :meth:`advance`, :meth:`release`."""

    def __init__(self, net: FlowNetwork) -> None:
        self.net = net
        self._lanes: dict[tuple[Hop, ...], _Lane] = {}
        self._heap: list[tuple[float, int, int, _Lane]] = []  # (finish, head id, version)
        self._ids = 0
        self._now = 0.0
        self._dirty: list[_Lane] = []

    @staticmethod
    def eligible(net: FlowNetwork, hops: Sequence[Hop]) -> bool:
        """Whether every hop has a finite, positive capacity (the lane's arithmetic)."""
        for h in hops:
            cap = net.resource(h).capacity
            if not 0.0 < cap < math.inf:
                return False
        return True

    def start(self, now: float, nbytes: float, path: Sequence[Hop],
              on_done: OnDone | None = None) -> None:
        """:meth:`FlowNetwork.start` of a one-hop ``path`` no other path crosses."""
        if not 0.0 <= nbytes < math.inf:  # (nan compares false)
            raise ValueError(f"flow size must be a finite number >= 0, got {nbytes!r}")
        key = tuple(path)
        lane = self._lanes.get(key)
        if lane is None:
            if len(key) != 1:
                raise ValueError(f"a lane is one hop, got {key}")
            lane = self._lanes[key] = _Lane(self.net.resource(key[0]))
        # the network's clock (FlowNetwork._move_to, without its check of overdue flows)
        if now < self._now:
            if self._now - now > 1e-9 * max(1.0, abs(self._now)):
                raise ValueError(f"cannot go back in time: now {self._now!r}, asked {now!r}")
            now = self._now
        else:
            self._now = now = float(now)
        size = float(nbytes)
        flows = lane.flows
        res = lane.res
        if not flows:  # a new (or emptied) class
            lane.served = lane.rate = 0.0
            lane.settled = now
            lane.finish = math.inf
            lane.head_id = -1
        else:  # FlowNetwork._settle
            dt = now - lane.settled
            rate = lane.rate
            if dt > 0 and rate > 0 and rate != math.inf:
                delta = rate * dt
                lane.served += delta
                res.bytes += delta * len(flows)
            lane.settled = now
        fid = self._ids
        self._ids = fid + 1
        heapq.heappush(flows, (lane.served + size, fid, size, on_done))
        active = res.active
        if active == 0:
            res.busy_since = now
        active += 1
        res.active = active
        if active > res.peak_flows:
            res.peak_flows = active
        # the network's rebalance: the rate now, the head's finish when next asked (flows
        # start in bursts at one time; the finish of the burst's last start is the one
        # that counts, the same float as computed at that start)
        lane.rate = res.capacity / len(flows)
        if not lane.dirty:
            lane.dirty = True
            self._dirty.append(lane)

    def _reschedule(self, lane: _Lane, now: float) -> None:
        """The network's lone-class rebalance at ``now`` (the lane settled at ``now``)."""
        flows = lane.flows
        # the network's min over the path's hops of capacity / flows: one hop, of a
        # positive finite capacity (checked when the lane is made)
        rate = lane.res.capacity / len(flows)
        lane.settled = now
        lane.rate = rate
        head_target, head_id = flows[0][0], flows[0][1]
        left = head_target - lane.served
        finish = now + (left if left > 0.0 else 0.0) / rate
        if finish == lane.finish and head_id == lane.head_id:
            return
        lane.version += 1
        lane.finish, lane.head_id = finish, head_id
        heapq.heappush(self._heap, (finish, head_id, lane.version, lane))

    def _flush(self) -> None:
        """Schedule the head of every lane a flow started on (at its last start's time)."""
        for lane in self._dirty:
            lane.dirty = False
            self._reschedule(lane, lane.settled)
        self._dirty.clear()

    def _top(self) -> tuple[float, int, int, _Lane] | None:
        heap = self._heap
        while heap:
            entry = heap[0]
            lane = entry[3]
            if entry[2] == lane.version and lane.flows:
                return entry
            heapq.heappop(heap)
        return None

    def next_completion(self) -> float | None:
        """:meth:`FlowNetwork.next_completion`."""
        if self._dirty:
            self._flush()
        heap = self._heap
        while heap:
            entry = heap[0]
            lane = entry[3]
            if entry[2] == lane.version and lane.flows:
                return entry[0]
            heapq.heappop(heap)
        return None

    def advance(self, t: float) -> int:
        """:meth:`FlowNetwork.advance`: complete, in order, the flows that finish by ``t``."""
        if t < self._now:
            if self._now - t > 1e-9 * max(1.0, abs(self._now)):
                raise ValueError(f"cannot go back in time: now {self._now!r}, asked {t!r}")
            t = self._now
        done = 0
        while True:
            if self._dirty:  # (a callback may have started flows)
                self._flush()
            top = self._top()
            if top is None or top[0] > t:
                break
            heapq.heappop(self._heap)
            if top[0] > self._now:
                self._now = top[0]
            done += self._complete_head(top[3], self._now)
        self._now = float(t)
        return done

    def _complete_head(self, lane: _Lane, now: float) -> int:
        """:meth:`FlowNetwork._complete_head` of the lane's class at ``now``."""
        res = lane.res
        flows = lane.flows
        dt = now - lane.settled
        rate = lane.rate
        if dt > 0 and rate > 0 and rate != math.inf:
            delta = rate * dt
            lane.served += delta
            res.bytes += delta * len(flows)
        lane.settled = now
        served = lane.served
        finished: list[tuple[float, int, float, OnDone | None]] = []
        while flows:
            target = flows[0][0]
            if target - served > _REL_EPS * target + _ABS_EPS:
                break
            finished.append(heapq.heappop(flows))
        if not finished:  # float noise: the head is due now
            finished.append(heapq.heappop(flows))
        for target, _fid, _size, _cb in finished:
            left = target - served
            if left > 0:
                res.bytes += left
            res.active -= 1
            if res.active == 0:
                res.busy_s += now - res.busy_since
        if flows:
            self._reschedule(lane, now)
        else:
            lane.version += 1
        for _target, _fid, _size, cb in finished:
            if cb is not None:
                cb(now)
        return len(finished)

    def release(self) -> None:
        """Drop the lanes (and any callback still in flight): the run's cycles go."""
        self._lanes.clear()
        self._heap = []
        self._dirty.clear()


def use_lanes(sim: Any) -> bool:
    """Whether every flow of ``sim`` (a :class:`~kvtool.serving.sim.Simulation`) runs over
    a one-hop path no other path crosses: each node's DRAM the only tier below, no P/D
    split, no connector hop, every engine's PCIe finite."""
    setup = sim.setup
    if sim.tiers.shared or any(e.role != "both" for e in setup.engines):
        return False
    conn = setup.connector
    if conn is not None and math.isfinite(conn.gbps):
        return False
    net = sim.net
    return all(Lanes.eligible(net, [(f"pcie/{e.name}", d)])
               for e in setup.engines for d in ("up", "down"))
