"""Data mode across nodes on a real ``kvtool cluster up``: network namespaces as nodes, a
Ray worker in each with token authentication, an emulator target on the storage node
requiring DH-HMAC-CHAP, Mooncake with a segment lent by each node's own client (root;
the cluster helpers of tests/cluster/conftest.py)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cluster.conftest import Cluster, cluster_up
from tests.conftest import run

pytestmark = [pytest.mark.slow, pytest.mark.root, pytest.mark.mooncake]

CLUSTER = """
name = "gp7000-mini"
block_tokens = 32
router = "round-robin"

[placement]
kind = "netns"
subnet = "10.200.0.0/24"

[[node]]
name = "cx81"
dram = "24blk"

[[node]]
name = "cx82"
dram = "24blk"

[[node]]
name = "array"
storage = true

[[engine]]
node = "cx81"
count = 2
gpu = "a100-sxm"
model = "llama-3-8b"
kv_dtype = "fp8"
num_gpu_blocks = 48

[[engine]]
node = "cx82"
count = 2
gpu = "a100-sxm"
model = "llama-3-8b"
kv_dtype = "fp8"
num_gpu_blocks = 48

[mooncake]
capacity = "32blk"
master = "cx81"
segment = "64MiB"

[nvme]
capacity = "48blk"

[[nvme.target]]
name = "array-t0"
node = "array"
size = "128MiB"
read_gbps = 5
write_gbps = 5
"""


def _trace(tmp: Path) -> Path:
    trace = tmp / "small.jsonl"
    res = run("trace", "gen", "--sessions", "6", "--rounds", "4", "--input-tokens", "256",
              "--output-tokens", "32", "-o", str(trace))
    assert res.exit_code == 0, res.stderr
    return trace


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with cluster_up(tmp_path_factory.mktemp("netns-data"), CLUSTER, 219) as c:
        yield c


def test_replay_on_the_cluster_hits_across_nodes_and_survives_a_node(
        cluster: Cluster, tmp_path: Path) -> None:
    trace = _trace(tmp_path)
    sim = cluster.json("replay", str(trace), "--cluster", str(cluster.file), "--simulate",
                       "--concurrency", "3")["runs"][0]
    at = round(sim["serving"]["duration"] / 2, 3)
    doc = cluster.json("replay", str(trace), "--cluster", str(cluster.file),
                       "--concurrency", "3", "--fault", f"node@{at}:cx82", timeout=600)
    r = doc["runs"][0]
    d = r["data"]
    assert d["runtime"] == "ray"
    # every engine ran on its own node's namespace address
    state = json.loads((Path(cluster.env["KVTOOL_STATE_DIR"]) / "clusters"
                        / f"{cluster.name}.json").read_text())
    address = {n["name"]: n["address"] for n in state["nodes"]}
    assert {(e["node"], e["address"]) for e in d["engines"]} == {
        ("cx81", address["cx81"]), ("cx82", address["cx82"])}
    # blocks crossed engines and nodes, every hit checked, nothing corrupt
    assert d["cross_engine_hits"] > 0 and d["verified_blocks"] > 0
    assert d["corrupt_blocks"] == 0
    # the node fault: its engines restarted, its segment's process killed, the run done
    [f] = d["faults"]
    assert f["kind"] == "node" and f["who"] == "cx82" and "Mooncake segment" in f["effect"]
    assert {e["name"] for e in d["engines"] if e["restarted"]} == {
        e["name"] for e in d["engines"] if e["node"] == "cx82"}
    assert r["serving"]["completed"] == doc["requests"]
    assert r["cache"]["recomputed_after_check_blocks"] >= d["lost_blocks"]


def test_a_sweep_fans_out_over_the_cluster_s_ray(cluster: Cluster, tmp_path: Path) -> None:
    trace = _trace(tmp_path)
    args = ("--json", "replay", str(trace), "--cluster", str(cluster.file), "--simulate",
            "--sweep", "concurrency=1,2,4")
    serial = cluster.kvtool(*args, "--jobs", "1")
    fanned = cluster.kvtool(*args)
    assert serial.returncode == fanned.returncode == 0, fanned.stderr[-2000:]
    # run on the head (a driver outside the namespaces cannot hand the other nodes its
    # objects), the points as tasks of the cluster's Ray
    assert "running on the head of cluster" in fanned.stderr
    assert "side by side on Ray cluster" in fanned.stderr
    assert fanned.stdout == serial.stdout
