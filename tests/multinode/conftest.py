"""A real local Ray for the multi-node tests: ``ray.init(num_cpus=2)`` on 127.0.0.1, once
per test session, shut down afterwards (CI has two cores)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO, free_port


@pytest.fixture(scope="session")
def local_ray() -> Iterator[Any]:
    """This session's Ray, started as ``--ray local`` starts one (:func:`kvtool.fanout.local_ray`:
    on 127.0.0.1 only, its session directory removed after it)."""
    ray = pytest.importorskip("ray", reason="the cluster extra (ray) is not installed")
    from kvtool.fanout import local_ray as started

    # Ray's workers are processes of their own: they find this checkout's kvtool
    # through PYTHONPATH, inherited from the driver.
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), old) if p)
    try:
        with started(num_cpus=2, include_dashboard=False, log_to_driver=False,
                     logging_level="error"):
            assert {n["NodeManagerAddress"] for n in ray.nodes()} == {"127.0.0.1"}
            yield ray
    finally:
        if old is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old


# --- the pieces of a cluster, on 127.0.0.1: a Mooncake master, NVMe/TCP targets with keys -

HOSTNQN = "nqn.2014-08.org.nvmexpress:uuid:6b767461-7574-4800-8000-00000000c1a5"


@dataclass
class LocalTarget:
    """An emulator target in a process of its own (a storage node's target), requiring
    DH-HMAC-CHAP from :data:`HOSTNQN`."""

    name: str
    proc: subprocess.Popen[bytes]
    url: str
    key_file: str

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_target(name: str, directory: Path, size: str = "96MiB",
                 netns: str | None = None, listen: str = "127.0.0.1:0") -> LocalTarget:
    """A target process; with ``netns``, inside that namespace, on its ``listen``."""
    from kvtool.target.keys import keygen

    key = directory / f"{name}.key"
    keygen(key)
    ready = directory / f"{name}.ready"
    nqn = f"nqn.2026-01.io.kvtool:{name}"
    inside = ["ip", "netns", "exec", netns] if netns else []
    remote = ["--allow-remote"] if netns else []
    proc = subprocess.Popen(
        [*inside, sys.executable, "-m", "emulator.nvmetcp", "--listen", listen, *remote,
         "--nqn", nqn, "--backing", size, "--host", HOSTNQN, "--dhchap-key", f"{HOSTNQN}={key}",
         "--busy-poll", "0", "--ready-file", str(ready)],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    deadline = time.monotonic() + 30
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            err = proc.communicate()[1].decode(errors="replace")
            raise RuntimeError(f"target {name} did not start: {err}")
        time.sleep(0.05)
    url = json.loads(ready.read_text())["urls"][0]
    return LocalTarget(name, proc, f"{url}/1", str(key))


@pytest.fixture
def targets(tmp_path: Path) -> Iterator[list[LocalTarget]]:
    out: list[LocalTarget] = []
    try:
        for name in ("t0", "t1"):
            out.append(start_target(name, tmp_path))
        yield out
    finally:
        for t in out:
            t.stop()


@dataclass
class NetnsNode:
    """A storage node in a network namespace of its own, joined to this one by a veth
    pair with private addresses on the two ends (nothing else is touched)."""

    netns: str
    address: str
    device: str
    """The namespace's end of the veth pair."""
    target: LocalTarget


@pytest.fixture
def netns_storage(tmp_path: Path) -> Iterator[NetnsNode]:
    """Target ``t0`` in a namespace of its own (root, ``ip``); all removed afterwards."""
    import random
    import shutil
    import uuid

    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("network namespaces need root and iproute2")
    tag = uuid.uuid4().hex[:6]
    ns, host_end, ns_end = f"kvt-{tag}", f"kvh{tag}", f"kvn{tag}"
    net = f"10.254.{random.randrange(256)}"

    def ip(*args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True)

    target = None
    ip("netns", "add", ns)
    try:
        ip("link", "add", host_end, "type", "veth", "peer", "name", ns_end, "netns", ns)
        ip("addr", "add", f"{net}.1/30", "dev", host_end)
        ip("link", "set", host_end, "up")
        ip("-n", ns, "addr", "add", f"{net}.2/30", "dev", ns_end)
        ip("-n", ns, "link", "set", ns_end, "up")
        ip("-n", ns, "link", "set", "lo", "up")
        (tmp_path / ns).mkdir()
        target = start_target("t0", tmp_path / ns, netns=ns, listen=f"{net}.2:0")
        yield NetnsNode(ns, f"{net}.2", ns_end, target)
    finally:
        if target is not None:
            target.stop()
        subprocess.run(["ip", "link", "del", host_end], capture_output=True, check=False)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)


@pytest.fixture(scope="module")
def mooncake_master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    pytest.importorskip("mooncake.store", reason="the mooncake extra is not installed")
    from kvtool.mooncake import pool as P

    mp = pytest.MonkeyPatch()
    mp.setenv("KVTOOL_STATE_DIR", str(tmp_path_factory.mktemp("pool-state")))
    ports = [free_port() for _ in range(3)]
    while len(set(ports)) < 3:
        ports = [free_port() for _ in range(3)]
    doc = P.up("mn", rpc_port=ports[0], metadata_port=ports[1], metrics_port=ports[2])
    try:
        yield {**doc, "ports": ports}
    finally:
        P.down("mn")
        mp.undo()


def cluster_state(name: str, nodes: list[str], targets: list[LocalTarget],
                  mooncake: dict[str, Any] | None) -> Any:
    """A :class:`~kvtool.cluster.state.ClusterState` of ``nodes`` that all live on this
    machine (address 127.0.0.1, as the local Ray knows it), with these targets and pool."""
    from kvtool.cluster.state import ClusterState, ClusterTarget, MooncakeState, NodeState

    state = ClusterState(name=name, file=f"{name}.toml", kind="hosts", phase="up")
    state.nodes = [NodeState(n, None, "127.0.0.1", ["engine"]) for n in nodes]
    state.targets = [ClusterTarget(t.name, nodes[-1], t.url, t.url.split("/")[3], HOSTNQN,
                                   t.key_file, pid=t.proc.pid) for t in targets]
    if mooncake is not None:
        rpc, meta, _metrics = mooncake["ports"]
        state.mooncake = MooncakeState(f"127.0.0.1:{rpc}", f"http://127.0.0.1:{meta}/metadata")
    return state
