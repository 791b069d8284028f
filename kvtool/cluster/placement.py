"""Where ``kvtool cluster up`` puts a cluster file's nodes: its ``[placement]`` table.

The simulation's spec (:mod:`kvtool.serving.topology`) reads the nodes, engines and tiers
and ignores ``[placement]``; this module reads that table from the same
:class:`~kvtool.configfile.ConfigDocument` (errors name the file, the line and the key, as
every config error does) and checks what a deployment alone needs (docs/cluster.md):

* ``kind = "netns"``: the subnet is private IPv4 with an address per node and the bridge;
  no node names an ``address``;
* ``kind = "hosts"``: every node names a distinct IPv4 ``address``;
* either kind: every target names the storage node running it.

:func:`load_placed` returns the spec and its :class:`PlacementSpec` together (a
:class:`Deployment`). :class:`Nodes` is how each kind makes the nodes and runs things on
them, the interface ``kvtool cluster up``'s one builder calls.
"""

from __future__ import annotations

import ipaddress
import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from kvtool.cluster.state import ClusterState, NodeState, Resource
from kvtool.configfile import (
    ConfigDocument,
    ConfigTable,
    parse_config_text,
    read_config,
    show_value,
)
from kvtool.serving.topology import (
    ClusterSpec,
    NodeSpec,
    TargetCheck,
    cluster_from_document,
)

PLACEMENT_KINDS = ("netns", "hosts")
PLACEMENT_KEYS = frozenset({"kind", "subnet", "link_scale", "link_mbit", "ray",
                            "ray_token_file"})
"""The keys of ``[placement]``."""
_NETNS_ONLY = ("subnet", "link_scale", "link_mbit")
_HOSTS_ONLY = ("ray", "ray_token_file")
DEFAULT_SUBNET = "10.200.0.0/24"

Path_ = tuple[str | int, ...]


@dataclass(frozen=True)
class PlacementSpec:
    """Where ``kvtool cluster up`` puts the nodes (docs/cluster.md).

    ``netns``: one network namespace per node on this machine, joined by a bridge, with
    addresses from ``subnet`` (the bridge takes the first); each node's link is shaped
    with tbf to ``link_mbit`` Mb/s, else to its ``nic_gbps`` × ``link_scale`` (unshaped
    when neither gives a rate).

    ``hosts``: the user's machines, each running a worker of the user's Ray cluster at
    its node's ``address``; ``ray`` is the head's ``HOST:PORT`` (``None``: ``RAY_ADDRESS``
    when ``up`` runs) and ``ray_token_file`` the file of its token when it uses token
    authentication (absolute; ``None``: ``RAY_AUTH_TOKEN_PATH``). No subnet, no shaping.
    """

    kind: str = "netns"
    subnet: str = DEFAULT_SUBNET
    link_scale: float | None = None
    link_mbit: float | None = None
    ray: str | None = None
    ray_token_file: str | None = None

    def link_rate_mbit(self, node: NodeSpec) -> float | None:
        """The tbf rate of ``node``'s link in Mb/s (``None``: unshaped)."""
        if self.link_mbit is not None:
            return self.link_mbit
        if self.link_scale is not None and not math.isinf(node.nic_gbps):
            return node.nic_gbps * 8e3 * self.link_scale
        return None


@dataclass(frozen=True)
class Deployment:
    """A cluster file read for ``kvtool cluster up``: the simulated system and where its
    nodes run (``placement`` ``None``: the file has no ``[placement]``)."""

    spec: ClusterSpec
    placement: PlacementSpec | None


def load_placed(path: str | Path, *, target_check: TargetCheck | None = None) -> Deployment:
    """Read a cluster file with its ``[placement]`` (``target_check``: as
    :func:`kvtool.serving.topology.load_cluster`'s)."""
    p = Path(path)
    return placed_from_document(read_config(p), default_name=p.stem, base_dir=p.parent,
                                target_check=target_check)


def parse_placed(text: str, *, source: str | None = None, name: str = "cluster",
                 base_dir: str | Path | None = None) -> Deployment:
    """Parse cluster TOML text with its ``[placement]`` (see :func:`load_placed`)."""
    return placed_from_document(parse_config_text(text, source=source), default_name=name,
                                base_dir=Path(base_dir) if base_dir is not None else None)


def placed_from_document(doc: ConfigDocument, *, default_name: str = "cluster",
                         base_dir: Path | None = None,
                         target_check: TargetCheck | None = None) -> Deployment:
    spec = cluster_from_document(doc, default_name=default_name, base_dir=base_dir,
                                 target_check=target_check)
    return Deployment(spec, read_placement(doc, spec, base_dir))


def read_placement(doc: ConfigDocument, spec: ClusterSpec,
                   base_dir: Path | None = None) -> PlacementSpec | None:
    """``doc``'s ``[placement]`` checked against ``spec`` (``None``: there is none)."""
    t = doc.table().table("placement")
    if t is None:
        return None
    t.check_keys(PLACEMENT_KEYS)
    kind = (_text(t, "kind", "netns") or "netns").lower()
    if kind not in PLACEMENT_KINDS:
        t.fail(f"unknown placement kind {t.data['kind']!r} (known: "
               f"{', '.join(PLACEMENT_KINDS)})", t.at("kind"))
    for key in _HOSTS_ONLY if kind == "netns" else _NETNS_ONLY:
        if t.has(key):
            t.fail(f"{key} applies to kind = \"{'hosts' if kind == 'netns' else 'netns'}\"",
                   t.at(key))
    if kind == "hosts":
        _placed_targets(doc, spec)
        return _hosts(doc, t, spec, base_dir)
    for i, node in enumerate(spec.nodes):
        if node.address is not None:
            raise doc.error("a node's address applies to [placement] kind = \"hosts\" "
                            "(kind \"netns\" gives addresses from the subnet)",
                            ("node", i, "address"))
    subnet = _text(t, "subnet", DEFAULT_SUBNET) or DEFAULT_SUBNET
    try:
        net = ipaddress.ip_network(subnet, strict=True)
    except ValueError as exc:
        t.fail(f"not a subnet: {exc}", t.at("subnet"))
    if not isinstance(net, ipaddress.IPv4Network) or not net.is_private:
        t.fail(f"expected a private IPv4 subnet such as {DEFAULT_SUBNET!r}, got {subnet!r}",
               t.at("subnet"))
    if net.num_addresses - 2 < len(spec.nodes) + 1:
        t.fail(f"{subnet} has no room for {len(spec.nodes)} nodes and the bridge",
               t.at("subnet"))
    scale, mbit = _positive(t, "link_scale"), _positive(t, "link_mbit")
    if scale is not None and mbit is not None:
        t.fail("give link_scale or link_mbit, not both", t.at("link_mbit"))
    _placed_targets(doc, spec)
    return PlacementSpec(kind=kind, subnet=str(net), link_scale=scale, link_mbit=mbit)


def _text(t: ConfigTable, key: str, default: str | None = None) -> str | None:
    v = t.text(key, nonempty=True)
    return default if v is None else v.strip()


def _positive(t: ConfigTable, key: str) -> float | None:
    if not t.has(key):
        return None
    v = t.number(key, 0.0)
    if v <= 0 or math.isinf(v):
        t.fail(f"expected a number > 0, got {show_value(t.data[key])}", t.at(key))
    return v


def _placed_targets(doc: ConfigDocument, spec: ClusterSpec) -> None:
    """With a placement, every target names the storage node running it."""
    storage = [n.name for n in spec.nodes if n.storage]
    for i, target in enumerate(spec.nvme.targets if spec.nvme is not None else ()):
        if target.node is None:
            if not storage:
                raise doc.error("a placed cluster runs its targets on storage nodes: add a "
                                "[[node]] with storage = true", ("nvme", "target", i))
            raise doc.error(f"which storage node runs it? (storage nodes: "
                            f"{', '.join(storage)})", ("nvme", "target", i, "node"))


def _hosts(doc: ConfigDocument, t: ConfigTable, spec: ClusterSpec,
           base_dir: Path | None) -> PlacementSpec:
    """``kind = "hosts"``: every node names its address (distinct); ``ray`` is
    ``HOST:PORT``; ``ray_token_file`` is resolved against the file's folder."""
    seen: dict[str, str] = {}
    for i, node in enumerate(spec.nodes):
        if node.address is None:
            raise doc.error(f"node {node.name!r} has no address: kind = \"hosts\" runs each "
                            "node on the host at its address (its Ray worker's node IP)",
                            ("node", i) if not node.auto else ("placement", "kind"))
        if node.address in seen:
            raise doc.error(f"address {node.address} is node {seen[node.address]!r}'s too",
                            ("node", i, "address"))
        seen[node.address] = node.name
    ray = _text(t, "ray")
    if ray is not None:
        host, sep, port = ray.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            t.fail(f"expected the Ray head's HOST:PORT such as '192.168.1.10:6379', got "
                   f"{ray!r}", t.at("ray"))
    token = _text(t, "ray_token_file")
    if token is not None:
        p = Path(token).expanduser()
        if not p.is_absolute() and base_dir is not None:
            p = base_dir / p
        token = str(p.resolve())
    return PlacementSpec(kind="hosts", subnet="", ray=ray, ray_token_file=token)


# -- the interface the builder calls, once per kind ---------------------------------------------


Step = Callable[[str], None]


def node_roles(spec: ClusterSpec, node: NodeSpec, *, head: bool) -> list[str]:
    """What ``node`` runs: ``head`` (Ray's), ``engine``, ``storage``, ``mooncake``."""
    roles = ["head"] if head else []
    if spec.engines_on(node.name):
        roles.append("engine")
    if node.storage:
        roles.append("storage")
    master = spec.mooncake.master if spec.mooncake is not None else None
    if spec.mooncake is not None and (master or spec.nodes[0].name) == node.name:
        roles.append("mooncake")
    return roles


class Nodes(ABC):
    """How one kind of placement makes a cluster's nodes and runs things on them: what
    ``kvtool cluster up``'s one builder (:mod:`kvtool.cluster.lifecycle`) calls. The kinds:
    :class:`kvtool.cluster.netnsnodes.NetnsNodes` (namespaces on this machine) and
    :class:`kvtool.cluster.hosts.HostsNodes` (the user's hosts, through their Ray).

    Every method that makes something records it in :attr:`state` first."""

    kind: ClassVar[str]
    keys_note: ClassVar[str] = ""
    """Appended to the step that makes a storage node's keys (where they go)."""
    agent_kind: ClassVar[str]
    """The kind of the resource that is kvtool's hand on a node (``status``'s ``ray``)."""
    local_after_failure: ClassVar[bool] = True
    """Whether ``down`` removes the things of this machine (the cluster's folder) when
    :meth:`stop` could not stop everything on the nodes."""

    def __init__(self, spec: ClusterSpec, placement: PlacementSpec, step: Step,
                 runtime: str) -> None:
        self.spec, self.placement, self.step, self.runtime = spec, placement, step, runtime
        self._state: ClusterState | None = None

    @property
    def state(self) -> ClusterState:
        assert self._state is not None, "make_nodes first"
        return self._state

    # before the record exists

    def available(self) -> str | None:
        """Why this kind cannot run from here (``None``: it can)."""
        return None

    @abstractmethod
    def check(self) -> None:
        """Checks before anything is recorded (a :class:`~kvtool.errors.UsageError`)."""

    def subnet(self) -> str | None:
        """The subnet the record names (``None``: none of kvtool's)."""
        return None

    # the build

    @abstractmethod
    def make_nodes(self, state: ClusterState) -> None:
        """The cluster's folder, its nodes (``state.nodes``) and a way to reach each."""

    @abstractmethod
    def close(self) -> None:
        """Let go of what :meth:`make_nodes` holds open (after the build, failed or not)."""

    @abstractmethod
    def share_keys(self, files: dict[str, str]) -> None:
        """A storage node's key files (``path: text``), made here, to every node."""

    @abstractmethod
    def put_files(self, node: NodeState, files: dict[str, str]) -> None:
        """Files made here (``path: text``) to ``node``, at the same paths."""

    @abstractmethod
    def resource(self, kind: str, name: str, node: NodeState, what: str) -> Resource:
        """A record of ``kind`` ``name`` on ``node``."""

    @abstractmethod
    def kvtool(self, node: NodeState, args: list[str], log: str,
               timeout: float) -> tuple[int | None, str, str]:
        """``kvtool ARGS`` run to its end on ``node`` (the cluster's target state folder):
        its exit status, standard output, and the last line of ``log``."""

    @abstractmethod
    def start_time(self, node: NodeState, pid: int) -> int | None:
        """The start time of process ``pid`` on ``node``."""

    @abstractmethod
    def target_listening(self, node: NodeState, port: int, log: str) -> str | None:
        """Why nothing listens on ``node``'s ``port`` after a target started (``None``:
        something does)."""

    @abstractmethod
    def start(self, node: NodeState, program: str, args: list[str], what: str,
              log: str) -> Any:
        """Start the Mooncake ``program`` on ``node`` (recorded as process ``what``); a
        handle for :meth:`wait_listening`."""

    @abstractmethod
    def wait_listening(self, node: NodeState, started: Any, port: int, what: str,
                       log: str) -> None:
        """Wait until what :meth:`start` started listens on ``port`` (a
        :class:`~kvtool.cluster.errors.ClusterError` when it exits or does not)."""

    # -- a recorded cluster (``status``, ``down``) ----------------------------------------

    @classmethod
    @abstractmethod
    def probe(cls, state: ClusterState
              ) -> tuple[list[bool], dict[str, bool], str | None]:
        """Whether each of ``state.resources`` is really there, whether each node is, and
        why the nodes could not be asked (``None``: they were)."""

    @classmethod
    @abstractmethod
    def stop(cls, state: ClusterState, step: Step
             ) -> tuple[list[str], list[str], list[Resource]]:
        """Stop what runs on the nodes: what was removed, what could not be (each a
        message), and the records on the nodes to keep. The things of this machine
        (``Resource.node`` ``None``) are ``down``'s to remove."""
