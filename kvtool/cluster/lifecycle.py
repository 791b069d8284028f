"""``kvtool cluster up / status / down``: a cluster file's nodes made real.

``up`` reads the cluster file with its ``[placement]``
(:func:`kvtool.cluster.placement.load_placed`) and builds, in this order, recording each
thing in the :class:`~kvtool.cluster.state.ClusterState` *before* making it:

1. the nodes, through the placement kind's :class:`~kvtool.cluster.placement.Nodes`
   (:data:`PLACEMENTS`): the cluster's folder (keys, logs, Ray's token), and for kind
   ``netns`` the bridge, one namespace and veth pair per node, tbf on each shaped link and
   Ray of the cluster's own (:mod:`kvtool.cluster.netnsnodes`), for kind ``hosts`` a kvtool
   agent on each of the user's Ray hosts (:mod:`kvtool.cluster.hosts`);
2. per storage node a DH-HMAC-CHAP key pair, and its targets (``kvtool target up`` of a
   generated config, on the node: kvtool's userspace NVMe/TCP target or SPDK's nvmf_tgt)
   on the node's address, requiring the key;
3. Mooncake: the HTTP metadata server and the master on the master node, and a segment
   (``mooncake_client``) on every node.

One builder runs steps 2 and 3 for both kinds; what differs (how a node is reached) is the
kind's :class:`~kvtool.cluster.placement.Nodes`.

Every process runs inside its node's namespace and carries ``KVTOOL_CLUSTER=<name>`` in its
environment. ``down`` stops every process found in the cluster's namespaces or carrying
that variable, then removes veths, namespaces, bridge and folder, and checks each is gone;
what it could not remove stays in the record and is named in its error. ``status`` checks
each recorded thing is really there.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvtool.cluster import hosts as H
from kvtool.cluster import netns as N
from kvtool.cluster.errors import ClusterError
from kvtool.cluster.netnsnodes import NetnsNodes, resource_present
from kvtool.cluster.placement import Nodes, load_placed
from kvtool.cluster.services import (
    HOST_NQN_PREFIX,
    MOONCAKE_CLIENT_PORT,
    MOONCAKE_METADATA_PORT,
    MOONCAKE_RPC_PORT,
    START_TIMEOUT_S,
    SUB_NQN_PREFIX,
    TARGET_PORT,
    master_args,
    metadata_args,
    segment_args,
    target_config,
)
from kvtool.cluster.state import (
    ClusterState,
    ClusterTarget,
    EngineState,
    MooncakeState,
    SegmentState,
    load_state,
    remove,
)
from kvtool.errors import UsageError
from kvtool.target.config import Host
from kvtool.target.document import config_document
from kvtool.target.loader import load_config
from kvtool.target.runtimes import AUTO, CLUSTER

Step = Callable[[str], None]


def _no_step(_: str) -> None:
    pass


# -- up ---------------------------------------------------------------------------------------


TARGET_RUNTIMES = CLUSTER  # the runtime registry's (kvtool.target.runtimes)
PLACEMENTS: dict[str, type[Nodes]] = {"netns": NetnsNodes, "hosts": H.HostsNodes}
"""Each ``[placement]`` kind's :class:`~kvtool.cluster.placement.Nodes`."""


def check_target_config(path: Path) -> str | None:
    """Why the kvtool target config at ``path`` cannot serve as a cluster target (``None``:
    it can): a cluster target runs kvtool's emulator backend and serves a namespace."""
    cfg = load_config(path, allow_remote=True)
    if cfg.backend != "emulator" or cfg.runtime not in (AUTO, *TARGET_RUNTIMES):
        return (f"{path}: a cluster target runs kvtool's emulator (backend \"emulator\", "
                f"runtime {' or '.join(TARGET_RUNTIMES)}), got backend {cfg.backend!r}, runtime "
                f"{cfg.runtime!r}")
    if not any(sub.namespaces for sub in cfg.subsystems):
        return f"{path} has no namespace to serve"
    return None


def up(file: str | os.PathLike[str], *, runtime: str = CLUSTER[0],
       step: Step = _no_step) -> ClusterState:
    """Bring the cluster of ``file`` up; its record (phase ``up``).

    ``runtime``: how the storage nodes' targets run, kvtool's userspace NVMe/TCP target or
    SPDK's nvmf_tgt (``kvtool target up --runtime``). A cluster already up is left as it is. A
    record of another phase (an ``up`` that failed or was killed) must be taken down
    first. On failure the record keeps phase ``failed`` and everything made so far, for
    :func:`down`.
    """
    path = Path(file)
    if runtime not in TARGET_RUNTIMES:
        raise UsageError(f"unknown target runtime {runtime!r} ({', '.join(TARGET_RUNTIMES)})",
                         field="runtime")
    deployment = load_placed(path, target_check=check_target_config)
    spec, placement = deployment.spec, deployment.placement
    if placement is None:
        raise UsageError(f"{path} has no [placement] table: it says nothing about where its "
                         "nodes run (docs/cluster.md)", field="FILE")
    nodes = PLACEMENTS[placement.kind](spec, placement, step, runtime)
    why = nodes.available()
    if why is not None:
        raise ClusterError(why)
    old = load_state(spec.name)
    if old is not None:
        if old.phase == "up" and status(old)["healthy"]:
            return old
        raise UsageError(f"cluster {spec.name} is recorded ({old.phase}, "
                         f"{'failed: ' + old.error if old.error else 'not healthy'}): take it "
                         f"down first (kvtool cluster down {path})", field="FILE")
    nodes.check()
    state = ClusterState(name=spec.name, file=str(path.resolve()), kind=placement.kind,
                         subnet=nodes.subnet())
    try:
        _Builder(nodes, state).build()
    except BaseException as exc:
        state.phase = "failed"
        state.error = str(exc) or type(exc).__name__
        state.save()
        if isinstance(exc, ClusterError | UsageError):
            raise ClusterError(f"cluster up failed: {exc}; kvtool cluster down {path} "
                               "removes what was made") from None
        raise
    state.phase = "up"
    state.save()
    return state


class _Builder:
    """The steps of ``up``, each recording before it creates; the nodes are made, and
    things run on them, through the placement's :class:`~kvtool.cluster.placement.Nodes`."""

    def __init__(self, nodes: Nodes, state: ClusterState) -> None:
        self.nodes = nodes
        self.spec = nodes.spec
        self.runtime = nodes.runtime
        self.state = state
        self.step = nodes.step

    def build(self) -> None:
        self.nodes.make_nodes(self.state)
        try:
            self.targets()
            self.mooncake()
        finally:
            self.nodes.close()
        self.state.engines = [EngineState(e.name, e.node) for e in self.spec.engines]
        self.state.save()

    def targets(self) -> None:
        """Each target through ``kvtool target up`` on its node: a generated config (one
        memory namespace of ``size``, the node's address, only the cluster's host NQN, with
        its keys) and the runtime asked for (userspace or SPDK)."""
        s, spec, nodes = self.state, self.spec, self.nodes
        if spec.nvme is None:
            return
        from kvtool.target.keys import keygen

        hostnqn = f"{HOST_NQN_PREFIX}:{s.name}"
        keys: dict[str, tuple[str, str]] = {}
        ports: dict[str, int] = {}
        for t in spec.nvme.targets:
            assert t.node is not None  # the reader checked placement
            node = s.node(t.node)
            if node.name not in keys:
                self.step(f"DH-HMAC-CHAP keys for {node.name}{nodes.keys_note}")
                host_key = s.files_dir / f"{node.name}-host.key"
                ctrl_key = s.files_dir / f"{node.name}-ctrl.key"
                for f in (host_key, ctrl_key):
                    keygen(f)
                nodes.share_keys({str(f): f.read_text() for f in (host_key, ctrl_key)})
                keys[node.name] = (str(host_key), str(ctrl_key))
            port = ports.get(node.name, TARGET_PORT)
            ports[node.name] = port + 1
            host_key_file, ctrl_key_file = keys[node.name]
            cfg = target_config(f"{s.name}-{t.name}", self.runtime,
                                f"{SUB_NQN_PREFIX}:{s.name}:{t.name}", t.size, t.config,
                                Host(hostnqn, host_key_file, ctrl_key_file), node.address, port)
            subnqn = cfg.subsystems[0].nqn
            config = s.files_dir / f"target-{t.name}.json"
            text = json.dumps(config_document(cfg), indent=2)
            config.write_text(text)
            nodes.put_files(node, {str(config): text})
            self.step(f"target {t.name} on {node.name} ({cfg.runtime}): {node.address}:{port}")
            res = s.add(nodes.resource("target", t.name, node, str(config)))
            rc, out, last = nodes.kvtool(node, ["--json", "target", "up", str(config),
                                                "--allow-remote"],
                                         f"target-{t.name}.log", START_TIMEOUT_S * 3)
            if rc != 0:
                raise ClusterError(f"target {t.name} on {node.name} did not start (exit "
                                   f"{rc}: {last})")
            pid = json.loads(out)["status"].get("pid")
            res.pid, res.start = pid, nodes.start_time(node, pid) if pid else None
            url = f"nvme+tcp://{node.address}:{port}/{subnqn}"
            size = sum(n.size or 0 for n in cfg.subsystems[0].namespaces[:1])
            s.targets.append(ClusterTarget(t.name, node.name, url, subnqn, hostnqn,
                                           host_key_file, ctrl_key_file, size, pid,
                                           cfg.runtime))
            s.save()
            why = nodes.target_listening(node, port, f"target-{t.name}.log")
            if why is not None:
                raise ClusterError(f"target {t.name} on {node.name} is up but {why}")

    def mooncake(self) -> None:
        s, spec, nodes = self.state, self.spec, self.nodes
        if spec.mooncake is None:
            return
        master = next(n for n in s.nodes if "mooncake" in n.roles)
        meta_url = f"http://{master.address}:{MOONCAKE_METADATA_PORT}/metadata"
        s.mooncake = MooncakeState(f"{master.address}:{MOONCAKE_RPC_PORT}", meta_url)
        self.step(f"Mooncake master on {master.name}: {s.mooncake.master}")
        for program, args, what, log, port in [
                ("mooncake_http_metadata_server", metadata_args(master.address),
                 "mooncake metadata server", "mooncake-metadata.log", MOONCAKE_METADATA_PORT),
                ("mooncake_master", master_args(master.address), "mooncake master",
                 "mooncake.log", MOONCAKE_RPC_PORT)]:
            started = nodes.start(master, program, args, what, log)
            nodes.wait_listening(master, started, port, what, log)
        size = spec.mooncake.segment
        for node in s.nodes:
            self.step(f"Mooncake segment on {node.name}: {size >> 20} MiB")
            log = f"mooncake-segment-{node.name}.log"
            started = nodes.start(node, "mooncake_client",
                                  segment_args(node.address, size, s.mooncake.master, meta_url),
                                  f"mooncake segment {node.name}", log)
            s.mooncake.segments.append(SegmentState(node.name, node.address, size))
            s.save()
            nodes.wait_listening(node, started, MOONCAKE_CLIENT_PORT, "mooncake segment", log)


# -- status -----------------------------------------------------------------------------------


def status(state: ClusterState) -> dict[str, Any]:
    """What is recorded and whether each part is really there (``healthy``: all of it,
    and ``up`` finished)."""
    present, node_present, unreachable = PLACEMENTS[state.kind].probe(state)
    agent = PLACEMENTS[state.kind].agent_kind
    resources = [{"kind": r.kind, "name": r.name, "what": r.what or r.name,
                  "pid": r.pid, "node": r.node, "present": ok}
                 for r, ok in zip(state.resources, present, strict=True)]
    by_kind = {(r.kind, r.name): ok for r, ok in zip(state.resources, present, strict=True)}
    nodes = []
    for n in state.nodes:
        nodes.append({"name": n.name, "netns": n.netns, "address": n.address,
                      "roles": n.roles, "link_mbit": n.link_mbit,
                      "link_mbit_now": N.shaped_mbit(n.netns) if n.netns and
                      N.netns_exists(n.netns) else None,
                      "link_up": N.link_up(n.netns) if n.netns and
                      N.netns_exists(n.netns) else None,
                      "present": node_present.get(n.name, False),
                      "ray": by_kind.get((agent, n.name), False),
                      "engines": [e.name for e in state.engines if e.node == n.name]})
    targets = []
    for t in state.targets:
        alive = any(r["present"] for r in resources
                    if r["kind"] == "target" and r["name"] == t.name)
        targets.append({"name": t.name, "node": t.node, "runtime": t.runtime, "url": t.url,
                        "hostnqn": t.hostnqn,
                        "dhchap_key_file": t.dhchap_key_file,
                        "dhchap_ctrl_key_file": t.dhchap_ctrl_key_file, "running": alive})
    pool = None
    if state.mooncake is not None:
        meta = state.mooncake.metadata.split("//", 1)[-1].split("/", 1)[0]
        pool = {"url": f"mooncake://{state.mooncake.master}?metadata={meta}",
                "master": state.mooncake.master, "metadata": state.mooncake.metadata,
                "segments": [{"node": g.node, "address": g.address, "bytes": g.size}
                             for g in state.mooncake.segments]}
    healthy = state.phase == "up" and all(r["present"] for r in resources) \
        and all(n["present"] and n["link_up"] is not False for n in nodes) \
        and unreachable is None
    return {"schema": "kvtool.cluster.status/2", "name": state.name, "file": state.file,
            "kind": state.kind, "phase": state.phase, "error": state.error,
            "healthy": healthy, "subnet": state.subnet, "bridge": state.bridge,
            "ray_address": state.ray_address, "ray_error": unreachable, "nodes": nodes,
            "engines": [{"name": e.name, "node": e.node} for e in state.engines],
            "targets": targets, "mooncake": pool, "resources": resources,
            "state_file": str(state.path)}


def not_up(name: str | None) -> dict[str, Any]:
    """:func:`status`'s document for a cluster with no record (same keys)."""
    return {"schema": "kvtool.cluster.status/2", "name": name, "file": None, "kind": None,
            "phase": "down", "error": None, "healthy": False, "subnet": None, "bridge": None,
            "ray_address": None, "ray_error": None, "nodes": [], "engines": [], "targets": [],
            "mooncake": None, "resources": [], "state_file": None}


# -- down -------------------------------------------------------------------------------------


def nothing_to_remove(name: str) -> dict[str, Any]:
    """:func:`down`'s document when no record of ``name`` exists (same keys)."""
    return {"schema": "kvtool.cluster.down/1", "name": name, "removed": []}


def down(state: ClusterState, *, step: Step = _no_step) -> dict[str, Any]:
    """Remove everything the record lists (whatever phase ``up`` reached); a report.

    Raises :class:`ClusterError` naming what could not be removed (the record then keeps
    those, so a later ``down`` tries again).
    """
    state.phase = "stopping"
    state.save()
    kind = PLACEMENTS[state.kind]
    removed, failed, keep = kind.stop(state, step)
    local = [] if failed and not kind.local_after_failure else state.resources
    keep += [r for r in state.resources if r.node is None and r not in local]
    for r in reversed(local):
        if r.node is not None:
            continue
        try:
            if r.kind == "veth":
                N.delete_link(r.name)
            elif r.kind == "netns":
                N.delete_netns(r.name)
            elif r.kind == "bridge":
                N.delete_link(r.name)
            elif r.kind == "ray" and r.what.startswith("/tmp/kvr-"):
                shutil.rmtree(r.what, ignore_errors=True)
            elif r.kind == "dir":
                shutil.rmtree(r.name, ignore_errors=True)
        except ClusterError as exc:
            failed.append(str(exc))
        if resource_present(r) or (r.kind == "ray" and os.path.exists(r.what)):
            keep.append(r)
            if r.kind not in ("process", "target", "ray"):
                failed.append(f"{r.kind} {r.name} is still there")
        else:
            removed.append(f"{r.kind} {r.name}")
            step(f"removed {r.kind} {r.name}")
    if failed:
        state.resources = list(reversed(keep))
        state.phase = "failed"
        state.error = "; ".join(failed)
        with contextlib.suppress(OSError):
            state.save()
        raise ClusterError(f"cluster {state.name}: down left things behind: "
                           f"{'; '.join(failed)}")
    remove(state.name)
    return {"schema": "kvtool.cluster.down/1", "name": state.name, "removed": removed}
