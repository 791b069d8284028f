"""``[placement] kind = "hosts"`` on "hosts" this test makes itself: network namespaces
joined by a bridge, each running a node of a Ray cluster the test starts (as a user would
on their machines: a head with token authentication, a worker per host). ``kvtool cluster
up`` runs on the head, joins that Ray, and starts the target and Mooncake through its
agents; ``down`` must leave nothing of kvtool's and the user's Ray running. The test then
stops its own Ray (by the pids in its namespaces) and removes its namespaces.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvtool.cluster import netns as N
from kvtool.target.state import pid_alive
from tests.cluster.conftest import skip_reason
from tests.conftest import REPO

pytestmark = pytest.mark.slow

NODES = ("a", "b", "s")  # two engine hosts (a: Ray head), one storage host

FILE = """
name = "{name}"
[placement]
kind = "hosts"
ray = "{head}:6379"
ray_token_file = "{token}"
[[node]]
name = "a"
address = "{a}"
[[node]]
name = "b"
address = "{b}"
[[node]]
name = "s"
address = "{s}"
storage = true
[[engine]]
node = "a"
gpu = "a100-sxm"
model = "llama-3-8b"
kv_dtype = "fp8"
num_gpu_blocks = 16
[[engine]]
node = "b"
gpu = "a100-sxm"
model = "llama-3-8b"
kv_dtype = "fp8"
num_gpu_blocks = 16
[mooncake]
capacity = "16blk"
master = "a"
segment = "16MiB"
[nvme]
capacity = "16blk"
[[nvme.target]]
name = "t0"
node = "s"
size = "32MiB"
"""


@dataclass
class Hosts:
    """The test's "hosts" (namespaces with addresses), its Ray, and a kvtool to run on a."""

    name: str
    tmp: Path
    netns: dict[str, str]
    address: dict[str, str]
    file: Path
    env: dict[str, str]
    ray_env: dict[str, str]
    temps: list[str]

    def start_ray(self, node: str) -> None:
        """``ray start`` on ``node`` as its user would: the head on a, else a worker."""
        temp = f"/tmp/kvt-{N.tag(self.name)}-{len(self.temps)}"  # Ray's paths stay short
        self.temps.append(temp)
        argv = [str(Path(sys.executable).with_name("ray")), "start",
                f"--node-ip-address={self.address[node]}", "--num-cpus=1",
                "--object-store-memory=80000000", f"--temp-dir={temp}",
                "--disable-usage-stats"]
        argv += ["--head", "--port=6379", "--include-dashboard=false"] if node == "a" \
            else [f"--address={self.address['a']}:6379"]
        started = subprocess.run(["ip", "netns", "exec", self.netns[node], *argv],
                                 capture_output=True, text=True, env=self.ray_env, timeout=180)
        assert started.returncode == 0, started.stderr[-2000:]

    def cluster_file(self, suffix: str, drop: str = "") -> Path:
        """The cluster file under the name ``<name><suffix>`` (less the text ``drop``)."""
        f = self.tmp / f"{self.name}{suffix}.toml"
        f.write_text(self.file.read_text().replace(f'name = "{self.name}"',
                                                   f'name = "{self.name}{suffix}"')
                     .replace(drop, ""))
        return f

    def kvtool(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        """``kvtool ARGS`` on the head host (as its user would run it there)."""
        return subprocess.run(["ip", "netns", "exec", self.netns["a"], sys.executable, "-m",
                               "kvtool", *args], capture_output=True, text=True, env=self.env,
                              timeout=timeout, cwd=REPO)

    def json(self, *args: str, timeout: float = 300) -> Any:
        proc = self.kvtool("--json", *args, timeout=timeout)
        assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-2000:]
        return json.loads(proc.stdout)

    def ray_pids(self, node: str) -> list[int]:
        return [p for p in N.netns_pids(self.netns[node]) if "raylet" in _cmd(p)
                or "gcs_server" in _cmd(p)]


def _cmd(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _tagged(name: str) -> list[str]:
    mark = f"KVTOOL_CLUSTER={name}".encode()
    out = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                if mark in Path(f"/proc/{entry.name}/environ").read_bytes().split(b"\0"):
                    out.append(f"{entry.name}: {_cmd(int(entry.name))[:80]}")
            except OSError:
                continue
    return out


def _stop_pids(pids: list[int]) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(Path(f"/proc/{p}").exists() for p in pids):
            time.sleep(0.1)


@pytest.fixture(scope="module")
def hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hosts]:
    why = skip_reason()
    if why:
        pytest.skip(why)
    tmp = tmp_path_factory.mktemp("hosts")
    name = f"h{uuid.uuid4().hex[:6]}"
    tag = N.tag(name)
    x = int(name[1:3], 16)
    gateway, prefix = f"10.218.{x}.1", 24
    bridge = f"kvt{tag}"
    netns = {n: f"kvtest-{name}-{n}" for n in NODES}
    address = {n: f"10.218.{x}.{i + 2}" for i, n in enumerate(NODES)}
    token = tmp / "ray-token"
    token.write_text(secrets.token_hex(32))
    token.chmod(0o600)
    base = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    pythonpath = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    ray_env = {**base, "PYTHONPATH": pythonpath, "RAY_AUTH_MODE": "token",
               "RAY_AUTH_TOKEN_PATH": str(token), "RAY_USAGE_STATS_ENABLED": "0"}
    file = tmp / f"{name}.toml"
    file.write_text(FILE.format(name=name, head=address["a"], token=token, **address))
    h = Hosts(name, tmp, netns, address, file,
              {**base, "KVTOOL_STATE_DIR": str(tmp / "state"), "PYTHONPATH": pythonpath},
              ray_env, [])
    try:
        N.add_bridge(bridge, gateway, prefix)
        for i, n in enumerate(NODES):
            N.add_netns(netns[n])
            N.add_node_link(netns[n], f"kvt{tag}n{i}", bridge, address[n], prefix, gateway)
        for n in NODES:  # the user's Ray: a head on a, a worker on each host
            h.start_ray(n)
        yield h
    finally:
        for f in tmp.glob(f"{name}*.toml"):
            with contextlib.suppress(Exception):
                h.kvtool("cluster", "down", str(f))
        for n in NODES:
            if N.netns_exists(netns[n]):
                _stop_pids(N.netns_pids(netns[n]))
                N.delete_netns(netns[n])
        N.delete_link(bridge)
        for t in h.temps:
            shutil.rmtree(t, ignore_errors=True)


def test_hosts_cluster_up_status_keys_bench_down(hosts: Hosts) -> None:
    from kvtool.errors import AuthenticationFailed, UsageError
    from kvtool.nvme.dhchap import load_secret_file
    from kvtool.nvme.hostauth import HostCredentials
    from kvtool.store.engine import open_engine

    up = hosts.kvtool("cluster", "up", str(hosts.file))
    assert up.returncode == 0, up.stderr[-3000:]
    doc = hosts.json("cluster", "status", str(hosts.file))
    assert doc["kind"] == "hosts" and doc["phase"] == "up" and doc["healthy"], doc
    assert doc["subnet"] is None and doc["bridge"] is None
    assert doc["ray_address"] == f"{hosts.address['a']}:6379"
    nodes = {n["name"]: n for n in doc["nodes"]}
    assert {k: n["address"] for k, n in nodes.items()} == hosts.address
    assert nodes["a"]["roles"] == ["head", "engine", "mooncake"]
    assert nodes["s"]["roles"] == ["storage"]
    assert all(n["present"] and n["ray"] and n["netns"] is None for n in doc["nodes"])
    [t] = doc["targets"]
    assert t["running"] and t["url"].startswith(f"nvme+tcp://{hosts.address['s']}:4420/")
    assert doc["mooncake"]["url"].startswith(f"mooncake://{hosts.address['a']}:50051")
    # each process runs on its host (its namespace), started there by the host's Ray worker
    procs = [r for r in doc["resources"] if r["kind"] in ("process", "target")]
    assert len(procs) == 1 + 2 + 3  # the target; metadata server, master; 3 segments
    for r in procs:
        where = subprocess.run(["ip", "netns", "identify", str(r["pid"])], capture_output=True,
                               text=True).stdout.strip()
        assert where == hosts.netns[r["node"]], r
    human = hosts.kvtool("cluster", "status", str(hosts.file))
    assert human.returncode == 0 and t["url"] in human.stdout
    assert max(len(line) for line in human.stdout.splitlines()) <= 80

    # the target requires the cluster's key (from this machine, through the test's bridge)
    creds = HostCredentials(t["hostnqn"], load_secret_file(t["dhchap_key_file"], field="k"),
                            load_secret_file(t["dhchap_ctrl_key_file"], field="k"))
    engine = open_engine(t["url"], write=False, credentials=creds)
    assert engine.size == 32 << 20
    engine.close()
    for other in (None, HostCredentials(t["hostnqn"])):
        with pytest.raises((AuthenticationFailed, UsageError)):
            open_engine(t["url"], write=False, credentials=other).close()

    # bench --cluster: a task on each client host, with the keys kvtool put there
    bench = hosts.json("bench", "--cluster", str(hosts.file), "--block-bytes", "1MiB",
                       "--seconds", "1", "--qd", "2")
    [case] = bench["cases"]
    assert [n["node"] for n in case["nodes"]] == ["a", "b"]
    assert all(n["ops"] > 0 and n["bytes"] == n["ops"] << 20 for n in case["nodes"])

    pids = [r["pid"] for r in procs]
    down = hosts.kvtool("cluster", "down", str(hosts.file))
    assert down.returncode == 0, down.stderr[-3000:]
    assert not [p for p in pids if pid_alive(p)]  # a zombie is gone (its parent may be init)
    assert _tagged(hosts.name) == []
    agents = [p for n in NODES for p in N.netns_pids(hosts.netns[n]) if "NodeAgent" in _cmd(p)]
    assert agents == []
    assert all(hosts.ray_pids(n) for n in NODES)  # the user's Ray is theirs: still running
    assert hosts.json("cluster", "status", str(hosts.file))["phase"] == "down"
    assert not (hosts.tmp / "state" / "clusters" / hosts.name).exists()


def test_down_names_what_a_lost_host_kept(hosts: Hosts) -> None:
    """The storage host's Ray worker dies (its user's): status says so, down stops the rest
    and fails naming what is left there; once the host's worker is back, down finishes."""
    f = hosts.cluster_file("-lost", drop=FILE[FILE.index("[mooncake]"):FILE.index("[nvme]")])
    name = f"{hosts.name}-lost"
    up = hosts.kvtool("cluster", "up", str(f))
    assert up.returncode == 0, up.stderr[-3000:]
    [target] = [r for r in hosts.json("cluster", "status", str(f))["resources"]
                if r["kind"] == "target"]
    # the host's Ray goes (all its processes but kvtool's, which outlive it)
    ours = {int(x.split(":")[0]) for x in _tagged(name)}
    _stop_pids([p for p in N.netns_pids(hosts.netns["s"]) if p not in ours])
    doc = hosts.json("cluster", "status", str(f))
    assert not doc["healthy"]
    assert {n["name"]: n["present"] for n in doc["nodes"]} == {"a": True, "b": True, "s": False}
    down = hosts.kvtool("cluster", "down", str(f))
    assert down.returncode == 1, down.stderr
    [msg] = [line for line in down.stderr.splitlines() if "left things behind" in line]
    assert f"no Ray node at {hosts.address['s']}" in msg and "target t0" in msg, msg
    assert pid_alive(target["pid"])  # still there, as down said
    left = hosts.json("cluster", "status", str(f))
    assert left["phase"] == "failed"
    assert {r["node"] for r in left["resources"] if r["node"]} == {"s"}  # a, b: all gone
    hosts.start_ray("s")
    down = hosts.kvtool("cluster", "down", str(f))
    assert down.returncode == 0, down.stderr[-3000:]
    assert not pid_alive(target["pid"]) and _tagged(name) == []
    assert hosts.json("cluster", "status", str(f))["phase"] == "down"


def test_down_after_an_up_that_failed_on_a_host(hosts: Hosts) -> None:
    """The target cannot start on its host (a namespace bigger than memory): up exits 1
    naming it, after the agents were placed; down removes them and the rest."""
    f = hosts.cluster_file("-fail", drop=FILE[FILE.index("[mooncake]"):FILE.index("[nvme]")])
    f.write_text(f.read_text().replace('size = "32MiB"', 'size = "64PiB"'))
    name = f"{hosts.name}-fail"
    up = hosts.kvtool("cluster", "up", str(f))
    assert up.returncode == 1, up.stderr[-2000:]
    assert "target t0 on s did not start" in up.stderr and "cluster down" in up.stderr
    doc = hosts.json("cluster", "status", str(f))
    assert doc["phase"] == "failed" and not doc["healthy"] and "target t0" in doc["error"]
    assert {r["node"] for r in doc["resources"] if r["kind"] == "agent"} == set(NODES)
    down = hosts.kvtool("cluster", "down", str(f))
    assert down.returncode == 0, down.stderr[-2000:]
    assert _tagged(name) == []
    agents = [p for n in NODES for p in N.netns_pids(hosts.netns[n]) if "NodeAgent" in _cmd(p)]
    assert agents == [] and all(hosts.ray_pids(n) for n in NODES)
    assert hosts.json("cluster", "status", str(f))["phase"] == "down"


def test_replay_faults_kill_a_host_s_processes_through_its_agent(hosts: Hosts) -> None:
    """A data-mode replay on the hosts cluster with a ``target`` and a ``node`` fault: the
    target's process and node b's Mooncake segment client (pids of their hosts, started
    there by kvtool's agents) are killed through the agents; the run completes, recomputing
    what was lost, nothing corrupt. (The test's hosts share this machine's PID namespace,
    where a kill from the driver would land too: the report says which way it went. A
    driver in a PID namespace of its own cannot join the test's Ray.)"""
    from tests.conftest import run

    f = hosts.cluster_file("-faults")
    # 1 MiB blocks: the target holds 32 of them, the tiers 16 each, an engine's GPU 48
    f.write_text(f.read_text().replace("[placement]", "block_tokens = 16\n[placement]", 1)
                 .replace("num_gpu_blocks = 16", "num_gpu_blocks = 48"))
    name = f"{hosts.name}-faults"
    trace = hosts.tmp / "faults.jsonl"
    made = run("trace", "gen", "--sessions", "4", "--rounds", "4", "--input-tokens", "128",
               "--output-tokens", "16", "-o", str(trace))
    assert made.exit_code == 0, made.stderr
    up = hosts.kvtool("cluster", "up", str(f))
    assert up.returncode == 0, up.stderr[-3000:]
    try:
        res = hosts.json("cluster", "status", str(f))["resources"]
        [target] = [r for r in res if r["kind"] == "target"]
        [segment] = [r for r in res if r["name"] == "mooncake segment b"]
        others = [r["pid"] for r in res if r["kind"] == "process" and r is not segment]
        sim = hosts.json("replay", str(trace), "--cluster", str(f), "--simulate")["runs"][0]
        third = sim["serving"]["duration"] / 3
        doc = hosts.json("replay", str(trace), "--cluster", str(f), "--fault",
                         f"target@{third:.3f}:t0", "--fault", f"node@{2 * third:.3f}:b",
                         timeout=600)
        r = doc["runs"][0]
        d = r["data"]
        t, n = d["faults"]
        assert t["kind"] == "target" and t["who"] == "t0", t
        assert t["effect"] == (f"process {target['pid']} killed on s, through kvtool's "
                               "agent there"), t
        assert n["kind"] == "node" and n["who"] == "b", n
        assert n["effect"].endswith(f"Mooncake segment (process {segment['pid']} on b, "
                                    "through kvtool's agent there) killed"), n
        # killed on their hosts (one PID namespace here: this machine sees them gone)
        assert not pid_alive(target["pid"]) and not pid_alive(segment["pid"])
        assert all(pid_alive(p) for p in others)  # the agent killed nothing else
        assert {e["name"] for e in d["engines"] if e["restarted"]} == {
            e["name"] for e in d["engines"] if e["node"] == "b"}
        assert r["serving"]["completed"] == doc["requests"]
        assert d["corrupt_blocks"] == 0
        # the engines found the target gone (its blocks lost from then on, recomputed)
        assert any(p["kind"] == "target failed" and p["target"] == "t0"
                   and p["at_s"] >= t["fired_at_s"] for p in d["problems"]), d["problems"]
        assert r["cache"]["recomputed_after_check_blocks"] >= d["lost_blocks"]
    finally:
        down = hosts.kvtool("cluster", "down", str(f))
    assert down.returncode == 0, down.stderr[-3000:]
    assert _tagged(name) == []
