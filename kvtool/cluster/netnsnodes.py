"""``[placement] kind = "netns"``: a cluster's nodes as network namespaces of this machine.

:class:`NetnsNodes` makes the bridge, one namespace and veth pair per node and tbf on each
shaped link (:mod:`kvtool.cluster.netns`), then Ray: the head on the first node, a worker on
every other node, token authentication with a token of this cluster's own. It runs what the
builder asks (targets, Mooncake) inside the node's namespace.
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
from pathlib import Path

from kvtool.cluster import netns as N
from kvtool.cluster.driver import kvtool_pythonpath
from kvtool.cluster.errors import ClusterError
from kvtool.cluster.placement import Nodes, Step, node_roles
from kvtool.cluster.services import (
    ENV_TAG,
    RAY_PORT,
    START_TIMEOUT_S,
    STOP_TIMEOUT_S,
    last_line,
    listening,
    log_reason,
    tagged_pids,
)
from kvtool.cluster.state import ClusterState, NodeState, Resource
from kvtool.errors import UsageError
from kvtool.target.procs import start_time
from kvtool.target.state import pid_alive


class NetnsNodes(Nodes):
    """Namespaces joined by a bridge, with Ray of kvtool's own (needs root)."""

    kind = "netns"
    agent_kind = "ray"

    def available(self) -> str | None:
        why = N.available()
        return None if why is None else f"cannot bring a netns cluster up: {why}"

    def check(self) -> None:
        user = N.subnet_user(self.placement.subnet)
        if user is not None:
            raise UsageError(f"subnet {self.placement.subnet} overlaps the addresses of {user} "
                             "(another cluster, or a network of this machine): choose another "
                             "[placement] subnet", field="FILE")

    def subnet(self) -> str | None:
        return self.placement.subnet

    def close(self) -> None:
        pass  # nothing held open: Ray runs in the namespaces, on its own

    def share_keys(self, files: dict[str, str]) -> None:
        pass  # every node is this machine: the files are where they were made

    def put_files(self, node: NodeState, files: dict[str, str]) -> None:
        pass  # as share_keys

    def make_nodes(self, state: ClusterState) -> None:
        self._state = state
        self.env = {**os.environ, ENV_TAG: state.name, "RAY_USAGE_STATS_ENABLED": "0"}
        self.network()
        self.ray()

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
        for i, node in enumerate(spec.nodes):
            roles = node_roles(spec, node, head=i == 0)
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

    # -- running things in a node's namespace ---------------------------------------------

    def resource(self, kind: str, name: str, node: NodeState, what: str) -> Resource:
        return Resource(kind, name, netns=node.netns, what=what)

    def kvtool(self, node: NodeState, args: list[str], log: str,
               timeout: float) -> tuple[int | None, str, str]:
        s = self.state
        env = {**self.env, "KVTOOL_STATE_DIR": str(s.files_dir / "target-state"),
               "PYTHONPATH": kvtool_pythonpath()}
        path = s.files_dir / log
        with open(path, "ab") as err:
            proc = subprocess.run(
                N.exec_argv(node.netns, [sys.executable, "-m", "kvtool", *args]),
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=err, env=env,
                timeout=timeout)
        return proc.returncode, proc.stdout.decode(errors="replace"), last_line(path)

    def start_time(self, node: NodeState, pid: int) -> int | None:
        return start_time(pid)

    def target_listening(self, node: NodeState, port: int, log: str) -> str | None:
        if listening(node.address, port):
            return None
        return f"nothing listens on {node.address}:{port}"

    def start(self, node: NodeState, program: str, args: list[str], what: str,
              log: str) -> subprocess.Popen[bytes]:
        """Start ``program`` in ``node``'s namespace, in its own session; recorded at once."""
        from kvtool.mooncake.pool import mooncake_binary

        argv = [mooncake_binary(program), *args]
        with open(self.state.files_dir / log, "ab") as out:
            proc = subprocess.Popen(N.exec_argv(node.netns, argv), stdin=subprocess.DEVNULL,
                                    stdout=out, stderr=out, start_new_session=True,
                                    env=self.env)
        self.state.add(Resource("process", what, pid=proc.pid, start=start_time(proc.pid),
                                netns=node.netns, what=f"{what} on {node.name}"))
        return proc

    def wait_listening(self, node: NodeState, started: subprocess.Popen[bytes], port: int,
                       what: str, log: str) -> None:
        path = self.state.files_dir / log
        deadline = time.monotonic() + START_TIMEOUT_S
        while not listening(node.address, port):
            if started.poll() is not None:
                raise ClusterError(f"{what} on {node.name} exited with status "
                                   f"{started.returncode} ({path}: {log_reason(path)})")
            if time.monotonic() > deadline:
                raise ClusterError(f"{what} on {node.name} is not listening on "
                                   f"{node.address}:{port} after {START_TIMEOUT_S:.0f} s")
            time.sleep(0.1)

    # -- a recorded cluster ---------------------------------------------------------------

    @classmethod
    def probe(cls, state: ClusterState
              ) -> tuple[list[bool], dict[str, bool], str | None]:
        present = [resource_present(r) for r in state.resources]
        by_kind = {(r.kind, r.name): ok for r, ok in zip(state.resources, present, strict=True)}
        return (present, {n.name: by_kind.get(("netns", n.netns or ""), False)
                          for n in state.nodes}, None)

    @classmethod
    def stop(cls, state: ClusterState, step: Step
             ) -> tuple[list[str], list[str], list[Resource]]:
        for r in reversed(state.resources):
            if r.kind == "target" and r.netns and N.netns_exists(r.netns) \
                    and os.path.exists(r.what):
                step(f"kvtool target down {r.name}")
                _target_down(state, r)
        step("stopping processes")
        left = _stop_processes(state)
        if left:
            return [], [f"processes {', '.join(map(str, left))} survived SIGKILL"], []
        return [], [], []


# -- this machine's things ------------------------------------------------------------------


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


