"""``kvtool cluster up / status / down``: a cluster file's nodes made real.

``up`` reads the cluster file with its ``[placement]``
(:func:`kvtool.cluster.placement.load_placed`) and builds, in this order, recording each thing in the
:class:`~kvtool.cluster.state.ClusterState` *before* making it:

1. the cluster's folder (keys, logs, Ray's token), the bridge, one namespace and veth pair
   per node, tbf on each shaped link (:mod:`kvtool.cluster.netns`);
2. Ray: the head on the first node, a worker on every other node, token authentication
   with a token of this cluster's own;
3. per storage node a DH-HMAC-CHAP key pair, and its targets (``kvtool target up`` of a
   generated config, in the node's namespace: kvtool's userspace NVMe/TCP target or
   SPDK's nvmf_tgt) on the node's address, requiring the key;
4. Mooncake: the HTTP metadata server and the master on the master node, and a segment
   (``mooncake_client``) on every node.

(``[placement] kind = "hosts"``: no namespaces and no Ray of kvtool's own; steps 3 and 4
run on the user's hosts through :mod:`kvtool.cluster.hosts`.)

Every process runs inside its node's namespace and carries ``KVTOOL_CLUSTER=<name>`` in its
environment. ``down`` stops every process found in the cluster's namespaces or carrying
that variable, then removes veths, namespaces, bridge and folder, and checks each is gone;
what it could not remove stays in the record and is named in its error. ``status`` checks
each recorded thing is really there.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvtool.cluster import hosts as H
from kvtool.cluster import netns as N
from kvtool.cluster.driver import kvtool_pythonpath
from kvtool.cluster.errors import ClusterError
from kvtool.cluster.placement import PlacementSpec, load_placed
from kvtool.cluster.services import (
    ENV_TAG,
    HOST_NQN_PREFIX,
    MOONCAKE_CLIENT_PORT,
    MOONCAKE_METADATA_PORT,
    MOONCAKE_RPC_PORT,
    RAY_PORT,
    START_TIMEOUT_S,
    STOP_TIMEOUT_S,
    SUB_NQN_PREFIX,
    TARGET_PORT,
    last_line,
    listening,
    log_reason,
    master_args,
    metadata_args,
    segment_args,
    tagged_pids,
    target_config,
)
from kvtool.cluster.state import (
    ClusterState,
    ClusterTarget,
    EngineState,
    MooncakeState,
    NodeState,
    Resource,
    SegmentState,
    load_state,
    remove,
)
from kvtool.errors import UsageError
from kvtool.serving.topology import ClusterSpec
from kvtool.target.config import Host
from kvtool.target.document import config_document
from kvtool.target.loader import load_config
from kvtool.target.procs import start_time
from kvtool.target.runtimes import AUTO, CLUSTER
from kvtool.target.state import pid_alive

Step = Callable[[str], None]


def _no_step(_: str) -> None:
    pass


# -- up ---------------------------------------------------------------------------------------


TARGET_RUNTIMES = CLUSTER  # the runtime registry's (kvtool.target.runtimes)


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
    hosts = placement.kind == "hosts"
    why = None if hosts else N.available()
    if why is not None:
        raise ClusterError(f"cannot bring a netns cluster up: {why}")
    old = load_state(spec.name)
    if old is not None:
        if old.phase == "up" and status(old)["healthy"]:
            return old
        raise UsageError(f"cluster {spec.name} is recorded ({old.phase}, "
                         f"{'failed: ' + old.error if old.error else 'not healthy'}): take it "
                         f"down first (kvtool cluster down {path})", field="FILE")
    if hosts:
        H.ray_settings(placement)  # the Ray head to join is known, its token file there
    user = None if hosts else N.subnet_user(placement.subnet)
    if user is not None:
        raise UsageError(f"subnet {placement.subnet} overlaps the addresses of {user} "
                         "(another cluster, or a network of this machine): choose another "
                         "[placement] subnet", field="FILE")
    state = ClusterState(name=spec.name, file=str(path.resolve()), kind=placement.kind,
                         subnet=None if hosts else placement.subnet)
    try:
        if hosts:
            H.HostsBuilder(spec, placement, state, step, runtime).build()
        else:
            _Builder(spec, placement, state, step, runtime).build()
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
    """The steps of ``up``, each recording before it creates."""

    def __init__(self, spec: ClusterSpec, placement: PlacementSpec, state: ClusterState,
                 step: Step, runtime: str) -> None:
        self.spec = spec
        self.runtime = runtime
        self.state = state
        self.step = step
        self.placement = placement
        self.env = {**os.environ, ENV_TAG: state.name, "RAY_USAGE_STATS_ENABLED": "0"}

    def build(self) -> None:
        self.network()
        self.ray()
        self.targets()
        self.mooncake()
        self.state.engines = [EngineState(e.name, e.node) for e in self.spec.engines]
        self.state.save()

    # -- network -------------------------------------------------------------------------

    def network(self) -> None:
        s, spec = self.state, self.spec
        files = s.files_dir
        s.add(Resource("dir", str(files)))
        files.mkdir(parents=True, exist_ok=True, mode=0o700)
        net = ipaddress.IPv4Network(self.placement.subnet)
        hosts = list(net.hosts())
        prefix = net.prefixlen
        gateway = str(hosts[0])
        s.bridge = N.bridge_name(s.name)
        self.step(f"bridge {s.bridge} ({gateway}/{prefix})")
        s.add(Resource("bridge", s.bridge))
        N.add_bridge(s.bridge, gateway, prefix)
        master = spec.mooncake.master if spec.mooncake is not None else None
        for i, node in enumerate(spec.nodes):
            roles = ["head"] if i == 0 else []
            if spec.engines_on(node.name):
                roles.append("engine")
            if node.storage:
                roles.append("storage")
            if spec.mooncake is not None and (master or spec.nodes[0].name) == node.name:
                roles.append("mooncake")
            ns, veth = N.netns_name(s.name, node.name), N.veth_name(s.name, i)
            rate = self.placement.link_rate_mbit(node)
            s.nodes.append(NodeState(node.name, ns, str(hosts[i + 1]), roles, rate, veth))
            self.step(f"node {node.name}: namespace {ns}, {hosts[i + 1]}"
                      + (f", link {rate:g} Mb/s" if rate else ""))
            s.add(Resource("netns", ns))
            N.add_netns(ns)
            s.add(Resource("veth", veth))
            N.add_node_link(ns, veth, s.bridge, str(hosts[i + 1]), prefix, gateway)
            if rate is not None:
                N.shape(ns, veth, rate)

    # -- processes -----------------------------------------------------------------------

    def spawn(self, node: NodeState, argv: list[str], what: str, log: str,
              env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        """Start ``argv`` in ``node``'s namespace, in its own session; recorded at once."""
        with open(self.state.files_dir / log, "ab") as out:
            proc = subprocess.Popen(N.exec_argv(node.netns, argv), stdin=subprocess.DEVNULL,
                                    stdout=out, stderr=out, start_new_session=True,
                                    env=env or self.env)
        self.state.add(Resource("process", what, pid=proc.pid, start=start_time(proc.pid),
                                netns=node.netns, what=f"{what} on {node.name}"))
        return proc

    def waitlistening(self, proc: subprocess.Popen[bytes], node: NodeState, port: int,
                       what: str, log: str) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not listening(node.address, port):
            if proc.poll() is not None:
                raise ClusterError(f"{what} on {node.name} exited with status "
                                   f"{proc.returncode} ({self.state.files_dir / log}: "
                                   f"{log_reason(self.state.files_dir / log)})")
            if time.monotonic() > deadline:
                raise ClusterError(f"{what} on {node.name} is not listening on "
                                   f"{node.address}:{port} after {START_TIMEOUT_S:.0f} s")
            time.sleep(0.1)

    def ray(self) -> None:
        s = self.state
        token = s.files_dir / "ray-token"
        s.ray_token_file = str(token)
        fd = os.open(token, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
        env = {**self.env, **s.ray_env()}
        ray_bin = str(Path(sys.executable).with_name("ray"))
        if not os.path.exists(ray_bin):
            found = shutil.which("ray")
            if found is None:
                raise UsageError("ray is not installed: pip install 'kvtool[cluster]'",
                                 field="FILE")
            ray_bin = found
        head = s.nodes[0]
        s.ray_address = f"{head.address}:{RAY_PORT}"
        for i, node in enumerate(s.nodes):
            temp = f"/tmp/kvr-{N.tag(s.name)}-{i}"  # Ray's socket paths must stay short
            argv = [ray_bin, "start", f"--node-ip-address={node.address}",
                    "--num-cpus=2", "--object-store-memory=80000000",
                    f"--temp-dir={temp}", "--disable-usage-stats",
                    f"--resources={json.dumps({'kvtool_node_' + node.name: 1})}"]
            argv += ["--head", f"--port={RAY_PORT}", "--include-dashboard=false"] if i == 0 \
                else [f"--address={s.ray_address}"]
            self.step(f"Ray {'head' if i == 0 else 'worker'} on {node.name}")
            s.add(Resource("ray", node.name, netns=node.netns, what=temp))
            log = s.files_dir / f"ray-{node.name}.log"
            with open(log, "ab") as out:
                rc = subprocess.run(N.exec_argv(node.netns, argv), stdin=subprocess.DEVNULL,
                                    stdout=out, stderr=out, env=env,
                                    timeout=START_TIMEOUT_S * 2).returncode
            if rc != 0:
                raise ClusterError(f"ray start on {node.name} exited with status {rc} "
                                   f"({log}: {log_reason(log)})")

    def targets(self) -> None:
        """Each target through ``kvtool target up`` in its node's namespace: a generated
        config (one memory namespace of ``size``, the node's address, only the cluster's
        host NQN, with its keys) and the runtime asked for (userspace or SPDK)."""
        s, spec = self.state, self.spec
        if spec.nvme is None:
            return
        from kvtool.target.keys import keygen

        hostnqn = f"{HOST_NQN_PREFIX}:{s.name}"
        keys: dict[str, tuple[str, str]] = {}
        ports: dict[str, int] = {}
        env = {**self.env, "KVTOOL_STATE_DIR": str(s.files_dir / "target-state"),
               "PYTHONPATH": kvtool_pythonpath()}
        for t in spec.nvme.targets:
            assert t.node is not None  # the reader checked placement
            node = s.node(t.node)
            if node.name not in keys:
                self.step(f"DH-HMAC-CHAP keys for {node.name}")
                host_key = s.files_dir / f"{node.name}-host.key"
                ctrl_key = s.files_dir / f"{node.name}-ctrl.key"
                for f in (host_key, ctrl_key):
                    keygen(f)
                keys[node.name] = (str(host_key), str(ctrl_key))
            port = ports.get(node.name, TARGET_PORT)
            ports[node.name] = port + 1
            host_key_file, ctrl_key_file = keys[node.name]
            cfg = target_config(f"{s.name}-{t.name}", self.runtime,
                                 f"{SUB_NQN_PREFIX}:{s.name}:{t.name}", t.size, t.config,
                                 Host(hostnqn, host_key_file, ctrl_key_file), node.address,
                                 port)
            subnqn = cfg.subsystems[0].nqn
            config = s.files_dir / f"target-{t.name}.json"
            config.write_text(json.dumps(config_document(cfg), indent=2))
            self.step(f"target {t.name} on {node.name} ({cfg.runtime}): {node.address}:{port}")
            res = s.add(Resource("target", t.name, netns=node.netns, what=str(config)))
            log = s.files_dir / f"target-{t.name}.log"
            with open(log, "ab") as err:
                proc = subprocess.run(
                    N.exec_argv(node.netns, [sys.executable, "-m", "kvtool", "--json", "target",
                                             "up", str(config), "--allow-remote"]),
                    stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=err, env=env,
                    timeout=START_TIMEOUT_S * 3)
            if proc.returncode != 0:
                raise ClusterError(f"target {t.name} on {node.name} did not start (exit "
                                   f"{proc.returncode}: {last_line(log)})")
            pid = json.loads(proc.stdout)["status"].get("pid")
            res.pid, res.start = pid, start_time(pid) if pid else None
            url = f"nvme+tcp://{node.address}:{port}/{subnqn}"
            size = sum(n.size or 0 for n in cfg.subsystems[0].namespaces[:1])
            s.targets.append(ClusterTarget(t.name, node.name, url, subnqn, hostnqn,
                                           host_key_file, ctrl_key_file, size, pid,
                                           cfg.runtime))
            s.save()
            if not listening(node.address, port):
                raise ClusterError(f"target {t.name} on {node.name} is up but nothing listens "
                                   f"on {node.address}:{port}")

    def mooncake(self) -> None:
        s, spec = self.state, self.spec
        if spec.mooncake is None:
            return
        from kvtool.mooncake.pool import mooncake_binary

        master = next(n for n in s.nodes if "mooncake" in n.roles)
        meta_url = f"http://{master.address}:{MOONCAKE_METADATA_PORT}/metadata"
        s.mooncake = MooncakeState(f"{master.address}:{MOONCAKE_RPC_PORT}", meta_url)
        self.step(f"Mooncake master on {master.name}: {s.mooncake.master}")
        meta = self.spawn(master, [mooncake_binary("mooncake_http_metadata_server"),
                                   *metadata_args(master.address)],
                          "mooncake metadata server", "mooncake-metadata.log")
        self.waitlistening(meta, master, MOONCAKE_METADATA_PORT, "mooncake metadata server",
                            "mooncake-metadata.log")
        proc = self.spawn(master, [mooncake_binary("mooncake_master"),
                                   *master_args(master.address)],
                          "mooncake master", "mooncake.log")
        self.waitlistening(proc, master, MOONCAKE_RPC_PORT, "mooncake master",
                            "mooncake.log")
        size = spec.mooncake.segment
        for node in s.nodes:
            self.step(f"Mooncake segment on {node.name}: {size >> 20} MiB")
            log = f"mooncake-segment-{node.name}.log"
            seg = self.spawn(node, [mooncake_binary("mooncake_client"),
                                    *segment_args(node.address, size, s.mooncake.master,
                                                  meta_url)],
                             f"mooncake segment {node.name}", log)
            s.mooncake.segments.append(SegmentState(node.name, node.address, size))
            s.save()
            self.waitlistening(seg, node, MOONCAKE_CLIENT_PORT, "mooncake segment", log)


# -- status -----------------------------------------------------------------------------------


def _process_alive(r: Resource) -> bool:
    return bool(r.pid) and pid_alive(r.pid) and (r.start is None or
                                                  start_time(r.pid or 0) == r.start)


def _ray_pids(netns: str | None) -> list[int]:
    if netns is None:
        return []
    return [p for p in N.netns_pids(netns) if _is_ray(p)]


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _is_ray(pid: int) -> bool:
    cmd = _cmdline(pid)
    return "raylet" in cmd or "gcs_server" in cmd


def resource_present(r: Resource) -> bool:
    """Is this recorded thing really there now?"""
    if r.kind == "netns":
        return N.netns_exists(r.name)
    if r.kind in ("bridge", "veth"):
        return N.link_exists(r.name)
    if r.kind in ("process", "target"):
        return _process_alive(r)
    if r.kind == "ray":
        return bool(_ray_pids(r.netns))
    if r.kind == "dir":
        return os.path.isdir(r.name)
    return False


def status(state: ClusterState) -> dict[str, Any]:
    """What is recorded and whether each part is really there (``healthy``: all of it,
    and ``up`` finished)."""
    ray_nodes: dict[str, bool] = {}
    unreachable = None
    if state.kind == "hosts":
        present, ray_nodes, unreachable = H.probe(state)
    else:
        present = [resource_present(r) for r in state.resources]
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
                      "present": ray_nodes.get(n.name, False) if state.kind == "hosts"
                      else by_kind.get(("netns", n.netns or ""), False),
                      "ray": by_kind.get(("agent" if state.kind == "hosts" else "ray", n.name),
                                         False),
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


def _target_down(state: ClusterState, r: Resource) -> None:
    """``kvtool target down`` of a cluster target (its own cleanup: SPDK's files); what
    it leaves, the process sweep that follows stops."""
    env = {**os.environ, "KVTOOL_STATE_DIR": str(state.files_dir / "target-state"),
           "PYTHONPATH": kvtool_pythonpath()}
    with contextlib.suppress(subprocess.TimeoutExpired, OSError):
        subprocess.run(N.exec_argv(r.netns, [sys.executable, "-m", "kvtool", "-q", "target",
                                             "down", r.what]),
                       stdin=subprocess.DEVNULL, capture_output=True, env=env,
                       timeout=STOP_TIMEOUT_S * 3)


def _cluster_pids(state: ClusterState) -> list[int]:
    pids = set(tagged_pids(state.name))
    for r in state.resources:
        if r.kind == "netns" and N.netns_exists(r.name):
            pids.update(N.netns_pids(r.name))
        if r.kind in ("process", "target") and _process_alive(r) and r.pid:
            pids.add(r.pid)
    pids.discard(os.getpid())
    return sorted(p for p in pids if pid_alive(p))


def _stop_processes(state: ClusterState) -> list[int]:
    """SIGTERM every process of the cluster, SIGKILL what is left; the pids that remain."""
    pids = _cluster_pids(state)
    for sig, wait in ((signal.SIGTERM, STOP_TIMEOUT_S), (signal.SIGKILL, 5.0)):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            pids = _cluster_pids(state)
            if not pids:
                return []
            time.sleep(0.1)
        pids = _cluster_pids(state)
    return pids


def down(state: ClusterState, *, step: Step = _no_step) -> dict[str, Any]:
    """Remove everything the record lists (whatever phase ``up`` reached); a report.

    Raises :class:`ClusterError` naming what could not be removed (the record then keeps
    those, so a later ``down`` tries again).
    """
    state.phase = "stopping"
    state.save()
    removed: list[str] = []
    failed: list[str] = []
    keep: list[Resource] = []
    if state.kind == "hosts":
        # on the hosts, through their agents; nothing runs here but the folder
        before = list(state.resources)
        failed += H.stop(state, step)
        removed += [f"{r.kind} {r.name} on {r.node}" for r in before
                    if r.node is not None and r not in state.resources]
        keep += [r for r in state.resources if r.node is not None]
    else:
        for r in reversed(state.resources):
            if r.kind == "target" and r.netns and N.netns_exists(r.netns) \
                    and os.path.exists(r.what):
                step(f"kvtool target down {r.name}")
                _target_down(state, r)
        step("stopping processes")
        left = _stop_processes(state)
        if left:
            failed.append(f"processes {', '.join(map(str, left))} survived SIGKILL")
    local = [] if state.kind == "hosts" and failed else state.resources
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
