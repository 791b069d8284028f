"""``[placement] kind = "hosts"``: a cluster on the user's machines, through their Ray.

The user runs a Ray cluster (a head, and a worker on every host, each started with
``--node-ip-address`` = the node's ``address`` in the cluster file); kvtool never logs in
anywhere. On every node ``up`` places a :class:`NodeAgent`, a detached Ray actor pinned
to the node by Ray's ``node:<address>`` resource, and asks it to start what the node runs:

* on a storage node, each target through ``kvtool target up`` of a generated config that
  listens on the node's address and requires the cluster's DH-HMAC-CHAP keys;
* on the Mooncake master node, the metadata server and the master; on every node a
  ``mooncake_client`` lending its segment.

The keys are made where ``up`` runs and written by each agent to the same path on its host
(the cluster's folder, mode 0700), so the targets and every client node find them where the
record says. Every process carries ``KVTOOL_CLUSTER=<name>``. ``down`` asks each node's agent
(a new one when the old one is gone) to take the targets down, stop the recorded processes
and any other carrying the tag in the agent's network namespace (where it started them),
and remove the cluster's folder there; then it kills the agents. The user's Ray processes
are theirs: nothing here stops them.

Invariants: an agent signals only a process carrying the cluster's tag or recorded with its
start time (a reused pid is never taken for ours); every remote thing is recorded, with its
node, before it is made.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from kvtool.cluster.driver import connect, node_resource
from kvtool.cluster.errors import ClusterError
from kvtool.cluster.placement import Nodes, PlacementSpec, Step, node_roles
from kvtool.cluster.services import (
    ENV_TAG,
    START_TIMEOUT_S,
    STOP_TIMEOUT_S,
    last_line,
    listening,
    log_reason,
    tagged_pids,
)
from kvtool.cluster.state import (
    ClusterState,
    NodeState,
    Resource,
)
from kvtool.errors import UsageError

AGENT_NAMESPACE = "kvtool"
"""The Ray namespace of kvtool's node agents (named ``kvtool-<cluster>-<node>``)."""
ANSWER_TIMEOUT_S = 30.0
"""How long an agent may take to answer a question (not a start)."""


def agent_name(cluster: str, node: str) -> str:
    return f"kvtool-{cluster}-{node}"


class NodeAgent:
    """kvtool's hand on one host of a ``hosts`` cluster (a detached Ray actor there).

    It starts processes in their own session with ``KVTOOL_CLUSTER=<cluster>`` in their
    environment and their output in a log under ``folder``, and stops only processes that
    carry that tag or match a recorded (pid, start time).
    """

    def __init__(self, cluster: str, node: str, address: str, folder: str) -> None:
        self.cluster, self.node, self.address = cluster, node, address
        self.folder = Path(folder)
        self.procs: dict[int, subprocess.Popen[bytes]] = {}

    def _env(self, state_dir: str | None = None) -> dict[str, str]:
        from kvtool.cluster.driver import kvtool_pythonpath

        env = {**os.environ, ENV_TAG: self.cluster, "PYTHONPATH": kvtool_pythonpath()}
        if state_dir is not None:
            env["KVTOOL_STATE_DIR"] = state_dir
        return env

    def hello(self) -> dict[str, Any]:
        """Where the agent runs: its pid, its Ray node's address, its Python."""
        import ray

        return {"pid": os.getpid(), "address": ray.util.get_node_ip_address(),
                "python": sys.executable}

    def put_files(self, files: dict[str, str]) -> None:
        """Write each ``path: text`` (mode 0600; folders made with mode 0700)."""
        for path, text in files.items():
            p = Path(path)
            p.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            tmp = p.with_name(p.name + ".tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(text)
            os.replace(tmp, p)

    def start(self, program: str, args: list[str], log: str) -> dict[str, Any]:
        """Start ``program`` (a Mooncake executable, found as on any kvtool host) with
        ``args``; its pid and start time."""
        from kvtool.mooncake.pool import mooncake_binary
        from kvtool.target.procs import start_time

        self.folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        with open(self.folder / log, "ab") as out:
            proc = subprocess.Popen([mooncake_binary(program), *args], stdin=subprocess.DEVNULL,
                                    stdout=out, stderr=out, start_new_session=True,
                                    env=self._env())
        self.procs[proc.pid] = proc
        return {"pid": proc.pid, "start": start_time(proc.pid)}

    def kvtool(self, args: list[str], log: str, state_dir: str,
               timeout: float) -> dict[str, Any]:
        """Run ``kvtool ARGS`` here to its end (``target up``/``down``): its exit status,
        standard output and the last line of its log."""
        self.folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        path = self.folder / log
        with open(path, "ab") as err:
            try:
                proc = subprocess.run([sys.executable, "-m", "kvtool", *args],
                                      stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                      stderr=err, env=self._env(state_dir), timeout=timeout)
            except subprocess.TimeoutExpired:
                return {"rc": None, "stdout": "", "last": f"no end in {timeout:g} s"}
        return {"rc": proc.returncode, "stdout": proc.stdout.decode(errors="replace"),
                "last": last_line(path)}

    def wait_listening(self, pid: int | None, port: int, log: str) -> str | None:
        """Wait until something listens on this node's ``address:port``; why not
        (``None``: it does)."""
        deadline = time.monotonic() + START_TIMEOUT_S
        proc = self.procs.get(pid or -1)
        while not listening(self.address, port):
            if proc is not None and proc.poll() is not None:
                return (f"exited with status {proc.returncode} ({self.folder / log}: "
                        f"{log_reason(self.folder / log)})")
            if time.monotonic() > deadline:
                return f"not listening on {self.address}:{port} after {START_TIMEOUT_S:.0f} s"
            time.sleep(0.1)
        return None

    def alive(self, procs: list[tuple[int, int | None]]) -> list[bool]:
        """Is each (pid, start time) still that process?"""
        from kvtool.target.procs import start_time
        from kvtool.target.state import pid_alive

        return [pid_alive(pid) and (start is None or start_time(pid) == start)
                for pid, start in procs]

    def start_time(self, pid: int) -> int | None:
        from kvtool.target.procs import start_time

        return start_time(pid)

    def exists(self, paths: list[str]) -> list[bool]:
        return [os.path.exists(p) for p in paths]

    def stop(self, procs: list[tuple[int, int | None]]) -> list[int]:
        """SIGTERM the recorded processes still alive and every process carrying the
        cluster's tag in this agent's network namespace (where it started them: on one
        machine with several "hosts" as namespaces, only this one's), SIGKILL what is
        left; the pids that survive."""
        here = _netns_of(os.getpid())

        def ours() -> list[int]:
            recorded = [pid for (pid, _), ok in zip(procs, self.alive(procs), strict=True)
                        if ok]
            tagged = [p for p in tagged_pids(self.cluster) if _netns_of(p) == here]
            return sorted(set(recorded) | set(tagged) - {os.getpid()})

        pids = ours()
        for sig, wait in ((signal.SIGTERM, STOP_TIMEOUT_S), (signal.SIGKILL, 5.0)):
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, sig)
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline:
                for proc in self.procs.values():
                    proc.poll()  # reap our own children
                pids = ours()
                if not pids:
                    return []
                time.sleep(0.1)
        return pids

    def kill(self, procs: list[tuple[int, int | None]]) -> list[int]:
        """SIGKILL each recorded (pid, start time) that is still that process (a fault
        injected on this host: nothing else is signalled); the pids killed."""
        killed = []
        for (pid, _start), ok in zip(procs, self.alive(procs), strict=True):
            if ok:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)
        for proc in self.procs.values():
            proc.poll()  # reap our own children
        return killed

    def remove(self, paths: list[str]) -> list[str]:
        """Remove each folder (with its files); those still there."""
        import shutil

        for p in paths:
            shutil.rmtree(p, ignore_errors=True)
        return [p for p in paths if os.path.exists(p)]


def _netns_of(pid: int) -> str | None:
    """The network namespace of ``pid`` (``net:[inode]``; ``None``: gone or not ours)."""
    try:
        return os.readlink(f"/proc/{pid}/ns/net")
    except OSError:
        return None


# -- the driver's side --------------------------------------------------------------------------


class _Agents:
    """The node agents of one cluster, from a driver joined to its Ray."""

    def __init__(self, ray: Any, state: ClusterState) -> None:
        self.ray = ray
        self.state = state
        self.handles: dict[str, Any] = {}

    def alive_addresses(self) -> set[str]:
        return {n["NodeManagerAddress"] for n in self.ray.nodes() if n.get("Alive")}

    def get(self, node: NodeState, *, create: bool) -> Any:
        """The agent on ``node`` (made when ``create`` and there is none), answering; ``None``
        when there is none and ``create`` is false."""
        if node.name in self.handles:
            return self.handles[node.name]
        name = agent_name(self.state.name, node.name)
        try:
            handle = self.ray.get_actor(name, namespace=AGENT_NAMESPACE)
        except ValueError:
            if not create:
                return None
            if node.address not in self.alive_addresses():
                raise ClusterError(f"no Ray node at {node.address} (node {node.name}): start "
                                   f"a Ray worker there with --node-ip-address="
                                   f"{node.address}") from None
            handle = self.ray.remote(NodeAgent).options(
                name=name, namespace=AGENT_NAMESPACE, lifetime="detached", num_cpus=0,
                max_restarts=0, resources=node_resource(node.address),
            ).remote(self.state.name, node.name, node.address, str(self.state.files_dir))
        hello = self.call(node, handle.hello, timeout=START_TIMEOUT_S)
        if hello["address"] != node.address:
            raise ClusterError(f"kvtool's agent for {node.name} runs on the Ray node at "
                               f"{hello['address']}, not {node.address}")
        self.handles[node.name] = handle
        return handle

    def call(self, node: NodeState, method: Any, *args: Any,
             timeout: float = ANSWER_TIMEOUT_S) -> Any:
        """``method(*args)`` on ``node``'s agent, its answer; a :class:`ClusterError`
        naming the node when it fails or does not answer in ``timeout`` seconds."""
        ray = self.ray
        ref = method.remote(*args)
        try:
            return ray.get(ref, timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            raise ClusterError(f"kvtool's agent on {node.name} ({node.address}) did not "
                               f"answer in {timeout:g} s") from None
        except ray.exceptions.RayError as exc:
            lines = [x for x in str(exc).splitlines() if x.strip()]
            raise ClusterError(f"kvtool's agent on {node.name} ({node.address}) failed: "
                               f"{lines[-1] if lines else type(exc).__name__}") from None

    def kill(self, node: NodeState) -> bool:
        """Kill ``node``'s agent; whether it is gone."""
        handle = self.handles.pop(node.name, None)
        name = agent_name(self.state.name, node.name)
        if handle is None:
            try:
                handle = self.ray.get_actor(name, namespace=AGENT_NAMESPACE)
            except ValueError:
                return True
        self.ray.kill(handle, no_restart=True)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                self.ray.get_actor(name, namespace=AGENT_NAMESPACE)
            except ValueError:
                return True
            time.sleep(0.2)
        return False


def kill_processes(state: ClusterState, node: str,
                   procs: list[tuple[int, int | None]]) -> list[int]:
    """SIGKILL recorded processes on ``node`` of a hosts cluster through the node's agent,
    from a driver already joined to the cluster's Ray (a replay's fault); the pids killed
    (a process no longer that one is left alone). A :class:`ClusterError` when the node has
    no agent answering."""
    import ray

    agents = _Agents(ray, state)
    n = state.node(node)
    agent = agents.get(n, create=False)
    if agent is None:
        raise ClusterError(f"no kvtool agent on {n.name} ({n.address}): is the cluster up?")
    killed: list[int] = agents.call(n, agent.kill, procs)
    return killed


def ray_settings(placement: PlacementSpec) -> tuple[str, str | None]:
    """The Ray head's ``HOST:PORT`` and its token file: the file's, else the environment's
    (``RAY_ADDRESS``, ``RAY_AUTH_TOKEN_PATH``)."""
    address = placement.ray or os.environ.get("RAY_ADDRESS")
    if not address:
        raise UsageError("a hosts cluster joins your Ray cluster: give [placement] ray = "
                         "\"HEAD:PORT\" (or set RAY_ADDRESS)", field="placement.ray")
    address = address.removeprefix("ray://")
    token = placement.ray_token_file or os.environ.get("RAY_AUTH_TOKEN_PATH") or None
    if token is not None and not os.path.isfile(token):
        raise UsageError(f"no such Ray token file: {token}", field="placement.ray_token_file")
    return address, token


class HostsNodes(Nodes):
    """The user's hosts, each reached through kvtool's agent there (a Ray actor)."""

    kind = "hosts"
    keys_note = ", to every node"
    agent_kind = "agent"
    local_after_failure = False  # the folder stays while the hosts hold things

    @classmethod
    def probe(cls, state: ClusterState
              ) -> tuple[list[bool], dict[str, bool], str | None]:
        return probe(state)

    @classmethod
    def stop(cls, state: ClusterState, step: Step
             ) -> tuple[list[str], list[str], list[Resource]]:
        """On the hosts, through their agents; nothing runs here but the folder."""
        before = list(state.resources)
        failed = stop(state, step)
        removed = [f"{r.kind} {r.name} on {r.node}" for r in before
                   if r.node is not None and r not in state.resources]
        return removed, failed, [r for r in state.resources if r.node is not None]

    def check(self) -> None:
        ray_settings(self.placement)  # the Ray head to join is known, its token file there

    def make_nodes(self, state: ClusterState) -> None:
        self._state = s = state
        spec = self.spec
        s.ray_address, s.ray_token_file = ray_settings(self.placement)
        s.add(Resource("dir", str(s.files_dir)))
        s.files_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        head_host = s.ray_address.rpartition(":")[0]
        head = next((n.name for n in spec.nodes if n.address == head_host), spec.nodes[0].name)
        for node in spec.nodes:
            assert node.address is not None  # the reader checked placement
            s.nodes.append(NodeState(node.name, None, node.address,
                                     node_roles(spec, node, head=node.name == head)))
        s.save()
        self.step(f"joining Ray at {s.ray_address}")
        self.ray = connect(s)
        try:
            self.agents = _Agents(self.ray, s)
            missing = [f"{n.name} ({n.address})" for n in s.nodes
                       if n.address not in self.agents.alive_addresses()]
            if missing:
                raise ClusterError(f"Ray at {s.ray_address} has no node at {', '.join(missing)}"
                                   ": start a Ray worker on each with --node-ip-address=ADDRESS")
            for n in s.nodes:
                self.step(f"kvtool agent on {n.name} ({n.address})")
                s.add(Resource("agent", n.name, node=n.name, what=agent_name(s.name, n.name)))
                self.agents.get(n, create=True)
                s.add(Resource("files", str(s.files_dir), node=n.name,
                               what=f"the cluster's folder on {n.name}"))
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        ray, self.ray = getattr(self, "ray", None), None
        if ray is not None:
            ray.shutdown()

    def call(self, node: NodeState, method: str, *args: Any,
             timeout: float = ANSWER_TIMEOUT_S) -> Any:
        """``method(*args)`` of ``node``'s agent (made by :meth:`make_nodes`)."""
        agent = self.agents.get(node, create=False)
        return self.agents.call(node, getattr(agent, method), *args, timeout=timeout)

    def share_keys(self, files: dict[str, str]) -> None:
        for other in self.state.nodes:  # the target's node, and every client of it
            self.call(other, "put_files", files)

    def put_files(self, node: NodeState, files: dict[str, str]) -> None:
        self.call(node, "put_files", files)

    def resource(self, kind: str, name: str, node: NodeState, what: str) -> Resource:
        return Resource(kind, name, node=node.name, what=what)

    def kvtool(self, node: NodeState, args: list[str], log: str,
               timeout: float) -> tuple[int | None, str, str]:
        out = self.call(node, "kvtool", args, log, str(self.state.files_dir / "target-state"),
                        timeout, timeout=timeout + 30)
        return out["rc"], out["stdout"], out["last"]

    def start_time(self, node: NodeState, pid: int) -> int | None:
        started: int | None = self.call(node, "start_time", pid)
        return started

    def target_listening(self, node: NodeState, port: int, log: str) -> str | None:
        why: str | None = self.call(node, "wait_listening", None, port, log,
                                    timeout=START_TIMEOUT_S + 30)
        return why

    def start(self, node: NodeState, program: str, args: list[str], what: str,
              log: str) -> Resource:
        """``program`` on ``node`` through its agent, recorded first."""
        res = self.state.add(Resource("process", what, node=node.name,
                                      what=f"{what} on {node.name}"))
        started = self.call(node, "start", program, args, log)
        res.pid, res.start = started["pid"], started["start"]
        self.state.save()
        return res

    def wait_listening(self, node: NodeState, started: Resource, port: int, what: str,
                       log: str) -> None:
        why = self.call(node, "wait_listening", started.pid, port, log,
                        timeout=START_TIMEOUT_S + 30)
        if why is not None:
            raise ClusterError(f"{started.name} on {node.name} {why}")


# -- status and down ----------------------------------------------------------------------------

REMOTE_KINDS = ("agent", "files", "process", "target")


def probe(state: ClusterState) -> tuple[list[bool], dict[str, bool], str | None]:
    """Whether each of ``state.resources`` is really there (a local ``dir`` here, the rest
    asked of its node's agent), whether each node's Ray worker is alive, and why Ray could
    not be asked (``None``: it was)."""
    present = [r.kind == "dir" and os.path.isdir(r.name) for r in state.resources]
    nodes = dict.fromkeys((n.name for n in state.nodes), False)
    try:
        ray = connect(state)
    except Exception as exc:
        return present, nodes, f"Ray at {state.ray_address}: {str(exc).splitlines()[0]}"
    try:
        agents = _Agents(ray, state)
        alive = agents.alive_addresses()
        for node in state.nodes:
            nodes[node.name] = node.address in alive
            mine = [i for i, r in enumerate(state.resources) if r.node == node.name]
            if not mine or not nodes[node.name]:
                continue
            try:
                agent = agents.get(node, create=False)
            except ClusterError:
                continue
            if agent is None:
                continue
            procs = [i for i in mine if state.resources[i].kind in ("process", "target")]
            answers = agents.call(node, agent.alive,
                                  [(state.resources[i].pid or 0, state.resources[i].start)
                                   for i in procs])
            for i, ok in zip(procs, answers, strict=True):
                present[i] = bool(state.resources[i].pid) and ok
            files = [i for i in mine if state.resources[i].kind == "files"]
            for i, ok in zip(files, agents.call(node, agent.exists,
                                                [state.resources[i].name for i in files]),
                             strict=True):
                present[i] = ok
            for i in mine:
                if state.resources[i].kind == "agent":
                    present[i] = True
    except ClusterError as exc:
        return present, nodes, str(exc)
    finally:
        ray.shutdown()
    return present, nodes, None


def stop(state: ClusterState, step: Any) -> list[str]:
    """Stop and remove everything ``up`` started on the hosts, in phases over all nodes
    (targets down, processes stopped, folders removed, agents killed: hosts may share a
    filesystem); what could not be, each naming its node. What went leaves
    ``state.resources``."""
    remote = [r for r in state.resources if r.node is not None]
    if not remote:
        return []
    try:
        ray = connect(state)
    except Exception as exc:
        return [f"Ray at {state.ray_address} cannot be reached ({str(exc).splitlines()[0]}): "
                f"nothing on the hosts was stopped"]
    failed: list[str] = []
    gone: set[int] = set()
    try:
        agents = _Agents(ray, state)
        reached: list[tuple[NodeState, Any, list[Resource]]] = []
        for node in state.nodes:
            mine = [r for r in remote if r.node == node.name]
            if not mine:
                continue
            try:
                reached.append((node, agents.get(node, create=True), mine))
            except ClusterError as exc:
                failed.append(f"{exc}: left {', '.join(f'{r.kind} {r.name}' for r in mine)}")

        def each(what: str, fn: Any) -> None:
            for node, agent, mine in reached:
                try:
                    fn(node, agent, mine)
                except ClusterError as exc:
                    failed.append(f"{what} on {node.name}: {exc}")

        def targets_down(node: NodeState, agent: Any, mine: list[Resource]) -> None:
            for r in mine:
                if r.kind == "target":
                    step(f"kvtool target down {r.name} on {node.name}")
                    agents.call(node, agent.kvtool, ["-q", "target", "down", r.what],
                                f"target-{r.name}.log", str(state.files_dir / "target-state"),
                                STOP_TIMEOUT_S * 3, timeout=STOP_TIMEOUT_S * 3 + 30)

        def processes(node: NodeState, agent: Any, mine: list[Resource]) -> None:
            step(f"stopping kvtool's processes on {node.name}")
            procs = [r for r in mine if r.kind in ("process", "target")]
            left = agents.call(node, agent.stop, [(r.pid, r.start) for r in procs if r.pid],
                               timeout=STOP_TIMEOUT_S + 60)
            if left:
                failed.append(f"processes {', '.join(map(str, left))} on {node.name} "
                              "survived SIGKILL")
            else:
                gone.update(id(r) for r in procs)

        def folders(node: NodeState, agent: Any, mine: list[Resource]) -> None:
            paths = [r for r in mine if r.kind == "files"]
            still = agents.call(node, agent.remove, [r.name for r in paths])
            for r in paths:
                if r.name in still:
                    failed.append(f"{r.name} on {node.name} is still there")
                else:
                    gone.add(id(r))

        def agent_down(node: NodeState, agent: Any, mine: list[Resource]) -> None:
            step(f"stopping kvtool's agent on {node.name}")
            if agents.kill(node):
                gone.update(id(r) for r in mine if r.kind == "agent")
            else:
                failed.append(f"kvtool's agent on {node.name} is still there")

        each("taking targets down", targets_down)
        each("stopping processes", processes)
        each("removing files", folders)
        each("stopping kvtool's agent", agent_down)
    finally:
        ray.shutdown()
    state.resources = [r for r in state.resources if id(r) not in gone]
    state.save()
    return failed
