"""Fault injection for data mode across nodes (``kvtool replay --cluster FILE --fault
KIND@SECONDS[:WHO]`` on a cluster that is up): :class:`Fault` parses one, and
:class:`FaultInjector` fires them as the simulated clock passes their times, against the
engine actors, targets and nodes of a :class:`~kvtool.replay.raydata.RayClusterData`
(which hands its run to the injector; the actors themselves are
:mod:`kvtool.replay.raydata`'s).

``engine`` kills an engine actor (Ray restarts it on its node, empty), ``target`` kills
a storage target's process, ``node`` kills every engine actor of a node and drops its
memory (its DRAM pool and the Mooncake segments it lent), ``link`` sets a netns node's
links down inside its namespace (``ip link set DEV down``). On a hosts cluster a process
is killed by kvtool's agent on its host (its pid is that host's).
"""

from __future__ import annotations

import math
import os
import signal
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvtool.errors import UsageError

if TYPE_CHECKING:
    from kvtool.cluster.state import ClusterState

FAULT_KINDS = ("engine", "target", "node", "link")


@dataclass(frozen=True)
class Fault:
    """``KIND@SECONDS[:WHO]``: at simulated second SECONDS, kill an engine actor
    (``engine``, WHO an engine name, default the first), a storage target's process
    (``target``, WHO a target name) or a node (``node``, WHO a node name: its engine
    actors and its memory), or cut a netns node's links (``link``, WHO a node name)."""

    kind: str
    at_s: float
    who: str | None = None

    @classmethod
    def parse(cls, text: str) -> Fault:
        kind, at, rest = text.partition("@")
        when, _, who = rest.partition(":")
        try:
            at_s = float(when)
        except ValueError:
            at_s = -1.0
        if kind not in FAULT_KINDS or not at or not (at_s >= 0 and math.isfinite(at_s)):
            raise UsageError(f"{text!r}: expected KIND@SECONDS[:WHO] with KIND one of "
                             f"{', '.join(FAULT_KINDS)} (example: engine@2.5:cx81-0)",
                             field="fault")
        return cls(kind, at_s, who or None)


class FaultInjector:
    """The faults of one run, in time order, fired against ``data`` (the run's
    :class:`~kvtool.replay.raydata.RayClusterData`: its ``specs``, ``workers``,
    ``targets``, ``state``, ``writer`` and ``gone``, ``call`` and ``await_restart``)."""

    def __init__(self, faults: Sequence[Fault], data: Any) -> None:
        self.pending = sorted(faults, key=lambda f: f.at_s)
        self.data = data
        self.fired: list[dict[str, Any]] = []
        self.cut: list[tuple[str, str]] = []
        """(namespace, device) of every link a fault cut: the run sets them up at the end."""

    def due(self, now: float) -> None:
        """Fire every fault whose time the simulated clock ``now`` has passed."""
        while self.pending and self.pending[0].at_s <= now:
            f = self.pending.pop(0)
            self.fired.append(self._fire(f, now))

    def restore_links(self) -> None:
        """Set up again every link a fault cut (the run's end)."""
        import subprocess

        for ns, dev in self.cut:
            subprocess.run(["ip", "-n", ns, "link", "set", "dev", dev, "up"],
                           capture_output=True, check=False)
        self.cut = []

    def _fire(self, f: Fault, now: float) -> dict[str, Any]:
        import ray

        d = self.data
        doc: dict[str, Any] = {"kind": f.kind, "at_s": f.at_s, "fired_at_s": now,
                               "wall_s": time.monotonic() - d.wall0, "basis": "simulated"}
        if f.kind == "engine":
            i = self._engine_index(f.who)
            doc["who"] = d.specs[i].name
            doc["node"] = d.specs[i].node
            ray.kill(d.workers[i], no_restart=False)
            d.await_restart([i])
            doc["effect"] = ("actor killed; Ray restarts it on its node, empty; the Mooncake "
                             "segment it lent is gone")
        elif f.kind == "target":
            t = self._target_index(f.who)
            target = d.targets[t]
            doc["who"] = target.name
            if target.pid is None:
                raise UsageError(f"target {target.name} has no process recorded to kill",
                                 field="fault")
            rec = next((r for r in d.state.resources if r.kind == "target"
                        and r.name == target.name and r.pid == target.pid), None)
            host = None if rec is None else rec.node
            doc["effect"] = (f"process {target.pid} killed"
                             if kill_recorded(d.state, host, target.pid,
                                               None if rec is None else rec.start)
                             else f"process {target.pid} was gone already")
            if host is not None:
                doc["effect"] += f" on {host}, through kvtool's agent there"
        elif f.kind == "link":
            node = f.who or d.specs[0].node
            doc["who"] = node
            doc["effect"], cut = cut_links(d.state, node)
            self.cut.extend(cut)
            if cut:
                doc["effect"] += " (set up again when the run ends)"
        else:
            node = f.who or d.specs[0].node
            mine = [s.index for s in d.specs if s.node == node]
            if not mine:
                raise UsageError(f"no engine runs on node {node!r}", field="fault")
            doc["who"] = node
            d.call(mine[0], "drop_node_memory")
            for i in mine:
                ray.kill(d.workers[i], no_restart=False)
            d.await_restart(mine)
            lost = [k for (tier, n, k) in d.writer if tier == "dram" and n == node]
            for k in lost:
                d.gone.add(("dram", node, k))
            segment = kill_segment(d.state, node)
            doc["effect"] = (f"engine actors {', '.join(d.specs[i].name for i in mine)} "
                             "killed and restarted; the node's DRAM pool and the Mooncake "
                             "segments its engines lent lost"
                             + (f"; its Mooncake segment (process {segment}) killed"
                                if segment is not None else ""))
        return doc

    def _engine_index(self, who: str | None) -> int:
        d = self.data
        if who is None:
            return 0
        for s in d.specs:
            if s.name == who:
                return s.index
        raise UsageError(f"no engine named {who!r} (engines: "
                         f"{', '.join(s.name for s in d.specs)})", field="fault")

    def _target_index(self, who: str | None) -> int:
        d = self.data
        if not d.targets:
            raise UsageError("the cluster has no storage target to kill", field="fault")
        if who is None:
            return 0
        for i, t in enumerate(d.targets):
            if t.name == who:
                return i
        raise UsageError(f"no target named {who!r}", field="fault")


def kill_segment(state: ClusterState, node: str) -> str | None:
    """Kill the process lending ``node``'s Mooncake segment, when ``kvtool cluster up``
    recorded one (and it is still that process); its pid (and the host whose agent killed
    it), else ``None``."""
    for r in state.resources:
        if (r.kind == "process" and r.name == f"mooncake segment {node}" and r.pid
                and kill_recorded(state, r.node, r.pid, r.start)):
            return str(r.pid) + ("" if r.node is None
                                 else f" on {r.node}, through kvtool's agent there")
    return None


def kill_recorded(state: ClusterState, host: str | None, pid: int,
                   start: int | None) -> bool:
    """SIGKILL a process ``up`` recorded (``start``: its recorded start time, checked so
    that a reused pid is never taken for it). ``host``: the node of a hosts cluster it is
    on (its record's ``node``), whose agent kills it there (the pid is that host's);
    ``None``: this machine (netns nodes share its pids). Whether it was still that process
    and is killed."""
    from kvtool.target.procs import start_time

    if host is not None:
        from kvtool.cluster.hosts import kill_processes

        return pid in kill_processes(state, host, [(pid, start)])
    if start is not None and start_time(pid) != start:
        return False
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return False
    return True


def cut_links(state: ClusterState, node: str) -> tuple[str, list[tuple[str, str]]]:
    """``ip link set DEV down`` for every link of ``node``'s namespace but loopback: the
    node is cut off. Returns what was done (or why it could not be) and the (namespace,
    device) pairs set down."""
    import subprocess

    try:
        ns = state.node(node).netns
    except KeyError:
        raise UsageError(f"no node named {node!r}", field="fault") from None
    if ns is None:
        raise UsageError(f"node {node} is a host, not a network namespace: a link cut "
                         "applies to netns nodes", field="fault")
    out = subprocess.run(["ip", "-n", ns, "-o", "link", "show"], capture_output=True,
                         text=True, check=False)
    if out.returncode != 0:
        return f"not cut: ip -n {ns} link show: {out.stderr.strip()}", []
    devs = [line.split(":")[1].strip().split("@")[0] for line in out.stdout.splitlines()
            if ":" in line]
    devs = [d for d in devs if d != "lo"]
    cut: list[tuple[str, str]] = []
    for dev in devs:
        done = subprocess.run(["ip", "-n", ns, "link", "set", "dev", dev, "down"],
                              capture_output=True, text=True, check=False)
        if done.returncode != 0:
            return (f"not cut: ip -n {ns} link set dev {dev} down: {done.stderr.strip()}",
                    cut)
        cut.append((ns, dev))
    return f"link {', '.join(devs)} set down inside namespace {ns}", cut
