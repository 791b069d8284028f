"""What ``kvtool cluster up`` built, recorded as it builds it, so ``down`` and ``status``
(and the commands that run on the cluster) find it.

One JSON file per cluster under the state directory (:func:`kvtool.target.state.state_dir`),
``clusters/<name>.json``. ``up`` saves the record after every step, so it always lists
everything created so far: namespaces, bridge, veths, processes (pid and start time, so a
reused pid is never taken for ours), key files, the Ray head. ``down`` walks
:attr:`ClusterState.resources` in reverse and removes each; ``status`` checks each is really
there. Writes are atomic (temp file, fsync, rename).

Invariants of a :class:`ClusterState`:

* ``resources`` is in creation order; a resource is appended *before* the call that makes
  it returns control to anything that could fail (so a half-made one is still recorded);
* every ``nodes[].name`` is unique; every ``engines[].node`` and ``targets[].node`` is a
  node's name;
* ``targets[].url`` is ``nvme+tcp://ADDR:PORT/SUBNQN`` (what kvtool's nvme engine opens);
  the key files hold DHHC-1 secrets (mode 0600), never the state file.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar, cast

from kvtool.configfile import ConfigDocument, ConfigTable, read_config
from kvtool.errors import InputError
from kvtool.jsondoc import save_record
from kvtool.target.state import renamed_keys, state_dir

SCHEMA = "kvtool.cluster.state/1"


def clusters_dir() -> Path:
    """One ``<name>.json`` record per cluster, and a ``<name>/`` folder of its files."""
    return state_dir() / "clusters"


@dataclass
class NodeState:
    """One node: its namespace (``None`` for a real host), address and roles.

    Roles: ``head`` (Ray head, router), ``engine`` (runs engines: a client node),
    ``storage`` (runs NVMe/TCP targets), ``mooncake`` (runs the Mooncake master).
    """

    name: str
    netns: str | None
    address: str
    roles: list[str] = field(default_factory=list)
    link_mbit: float | None = None  # tbf rate on its link (None: unshaped)
    veth: str | None = None  # root-namespace end of its veth pair


@dataclass
class EngineState:
    name: str
    node: str


@dataclass
class ClusterTarget:
    """One NVMe/TCP target on a storage node; it requires ``hostnqn`` with its key."""

    name: str
    node: str
    url: str  # nvme+tcp://ADDR:PORT/SUBNQN
    subnqn: str
    hostnqn: str
    dhchap_key_file: str
    dhchap_ctrl_key_file: str | None = None
    size: int = 0  # bytes of its namespace
    pid: int | None = None
    runtime: str = "userspace"  # "userspace" (kvtool's emulator) | "spdk" (nvmf_tgt)


@dataclass
class SegmentState:
    """A node's Mooncake segment: the DRAM it lends to the pool."""

    node: str
    address: str  # where its client is reached (the node's address)
    size: int  # bytes


@dataclass
class MooncakeState:
    master: str  # "ip:port" of mooncake_master on the head
    metadata: str  # the metadata server URL ("http://ip:port/metadata")
    protocol: str = "tcp"
    segments: list[SegmentState] = field(default_factory=list)


@dataclass
class Resource:
    """Something ``up`` created and ``down`` removes.

    ``kind``: ``netns`` (name), ``bridge`` (name), ``veth`` (root end's name),
    ``process`` (pid, start, what, netns), ``ray`` (netns: ``ray stop`` there),
    ``dir`` (path: removed with its files). Kind ``hosts`` adds ``agent`` (name: the node;
    what: the name of kvtool's Ray actor there) and ``files`` (name: a folder on the node),
    and its ``process``/``target`` resources name their ``node``: their pid is that host's.
    """

    kind: str
    name: str
    pid: int | None = None
    start: int | None = None  # /proc start time of pid (kvtool.target.procs.start_time)
    netns: str | None = None
    what: str = ""
    node: str | None = None  # kind "hosts": the node it is on (None: this machine)


@dataclass
class ClusterState:
    """A cluster ``up`` has made (or is making): see the module docstring."""

    name: str
    file: str
    kind: str = "netns"  # "netns" | "hosts"
    phase: str = "starting"  # "starting" | "up" | "failed" | "stopping"
    error: str | None = None  # why ``up`` failed
    subnet: str | None = None
    bridge: str | None = None
    nodes: list[NodeState] = field(default_factory=list)
    ray_address: str | None = None  # head GCS "ip:port"
    ray_token_file: str | None = None  # Ray's auth token (mode 0600): RAY_AUTH_TOKEN_PATH
    engines: list[EngineState] = field(default_factory=list)
    targets: list[ClusterTarget] = field(default_factory=list)
    mooncake: MooncakeState | None = None
    resources: list[Resource] = field(default_factory=list)
    created: float = field(default_factory=time.time)
    schema: str = SCHEMA

    # -- lookups -----------------------------------------------------------------------------

    def node(self, name: str) -> NodeState:
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(name)

    @property
    def head(self) -> NodeState:
        return next((n for n in self.nodes if "head" in n.roles), self.nodes[0])

    def client_nodes(self) -> list[NodeState]:
        """Nodes that run engines (the clients of the storage targets), in file order."""
        return [n for n in self.nodes if "engine" in n.roles]

    def storage_nodes(self) -> list[NodeState]:
        return [n for n in self.nodes if "storage" in n.roles]

    def ray_env(self) -> dict[str, str]:
        """Environment a Ray process of this cluster needs (token auth, no usage stats).

        A driver joins with ``ray.init(address=ray_address)`` under this environment;
        :func:`kvtool.cluster.driver.run_on_head` runs one on the head node."""
        env = {"RAY_USAGE_STATS_ENABLED": "0"}
        if self.ray_token_file:
            env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=self.ray_token_file)
        return env

    @property
    def files_dir(self) -> Path:
        """Its generated files: keys, target configs, logs."""
        return clusters_dir() / self.name

    @property
    def path(self) -> Path:
        return clusters_dir() / f"{self.name}.json"

    # -- JSON ----------------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_document(cls, doc: ConfigDocument) -> ClusterState:
        """The record in a parsed state file (errors name the file, line and field)."""
        return _record(doc.table(), cls)

    def save(self) -> Path:
        return save(self)

    def add(self, resource: Resource) -> Resource:
        """Record ``resource`` and save at once (before anything else can fail)."""
        self.resources.append(resource)
        self.save()
        return resource


def save(state: ClusterState) -> Path:
    return save_record(state.path, state.to_json())


R = TypeVar("R")
_RECORDS: dict[str, type[Any]] = {
    c.__name__: c for c in (NodeState, EngineState, ClusterTarget, SegmentState, MooncakeState,
                            Resource)}
"""The records a state file nests, by the name their fields' annotations give them."""


def _record(t: ConfigTable, cls: type[R]) -> R:
    """One record (a dataclass of this module) from a table: its fields' keys only, every
    field without a default given, each value of its annotated type."""
    if cls is ClusterTarget:
        t.data = renamed_keys(t.data)  # records of an older kvtool stay readable
    fields = {f.name: f for f in dataclasses.fields(cast(Any, cls))}
    t.check_keys(fields)
    values: dict[str, Any] = {}
    for name, f in fields.items():
        if t.has(name):
            values[name] = _field(t, name, str(f.type))
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            t.require(name)
    return cls(**values)


def _field(t: ConfigTable, key: str, annotation: str) -> Any:
    """The value at ``key`` as ``annotation`` (a field's type, as written) says."""
    if annotation.endswith(" | None"):
        if t.data[key] is None:
            return None
        annotation = annotation.removesuffix(" | None")
    if annotation == "str":
        return t.text(key)
    if annotation == "int":
        return t.integer(key)
    if annotation == "float":
        return t.number(key, 0.0)
    if annotation == "list[str]":
        return t.str_list(key)
    if annotation.startswith("list["):
        return [_record(item, _RECORDS[annotation[5:-1]]) for item in t.tables(key)]
    table = t.table(key)
    assert table is not None
    return _record(table, _RECORDS[annotation])


def cluster_name(file: str | os.PathLike[str]) -> str:
    """The name a cluster file gives its cluster (``name``, else the file's stem)."""
    p = Path(file)
    name = read_config(p).table().text("name")
    return name.strip() if name is not None and name.strip() else p.stem


def load_state(name_or_file: str | os.PathLike[str]) -> ClusterState | None:
    """The record of a cluster, by name, by its cluster file, or by the record's path.

    ``None`` when no cluster of that name is recorded (never brought up, or taken down).
    """
    s = str(name_or_file)
    p = Path(s)
    if p.suffix == ".json" and p.is_file() and _is_record(p):
        path = p
    elif p.suffix in (".toml", ".json") or os.sep in s:
        path = clusters_dir() / f"{cluster_name(p)}.json"
    else:
        path = clusters_dir() / f"{s}.json"
    if not path.is_file():
        return None
    return ClusterState.from_document(read_config(path, kind="json"))


def _is_record(p: Path) -> bool:
    try:
        data = read_config(p, kind="json").data
    except InputError:
        return False
    return isinstance(data, dict) and data.get("schema") == SCHEMA


def remove(name: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        (clusters_dir() / f"{name}.json").unlink()


def names() -> list[str]:
    d = clusters_dir()
    if not d.is_dir():
        return []
    return sorted(p.stem for p in d.glob("*.json"))


def ray_head_of(cluster_files: Sequence[str]) -> tuple[str | None, tuple[tuple[str, str], ...]]:
    """The Ray head of the first of ``cluster_files`` whose cluster ``kvtool cluster up``
    made and is up, with the environment to join it under (its token); ``(None, ())``
    when none is (what :func:`kvtool.fanout.choose_fanout` asks through its
    ``cluster_ray``)."""
    for path in cluster_files:
        try:
            state = load_state(path)
        except InputError:
            continue  # the cluster file itself is read (and reported) by the run
        if state is not None and state.phase == "up" and state.ray_address:
            return state.ray_address, tuple(sorted(state.ray_env().items()))
    return None, ()
