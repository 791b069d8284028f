"""Data mode across nodes (kvtool.replay.raydata) on real pieces: a local Ray
(``ray.init(num_cpus=2)``), engine actors placed on their nodes' Ray node, a Mooncake
master on 127.0.0.1, two emulator targets in processes of their own requiring
DH-HMAC-CHAP; the cluster described by a ClusterState built here."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import run
from tests.multinode.conftest import LocalTarget, NetnsNode, cluster_state

pytestmark = [pytest.mark.slow, pytest.mark.mooncake]


def test_fault_spec_is_checked() -> None:
    from kvtool.errors import UsageError
    from kvtool.replay.raydata import Fault

    assert Fault.parse("node@2.5:n1") == Fault("node", 2.5, "n1")
    assert Fault.parse("target@0") == Fault("target", 0.0, None)
    for bad in ("engine", "disk@1", "engine@-1", "engine@soon", "engine@inf"):
        with pytest.raises(UsageError, match="KIND@SECONDS"):
            Fault.parse(bad)


def test_fault_needs_a_cluster_that_is_up(tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVTOOL_STATE_DIR", str(tmp_path))
    trace, cluster = _inputs(tmp_path)
    res = run("replay", trace, "--cluster", cluster, "--fault", "engine@1")
    assert res.exit_code == 2 and "--fault" in res.stderr and "cluster up" in res.stderr
    res = run("replay", trace, "--dram", "64blk", "--simulate", "--fault", "engine@1")
    assert res.exit_code == 2 and "--fault" in res.stderr

CLUSTER = """
name = "mini"
block_tokens = 32
router = "round-robin"
[[node]]
name = "n0"
dram = "24blk"
[[node]]
name = "n1"
dram = "24blk"
[[engine]]
node = "n0"
count = 2
gpu = "a100-sxm"
model = "llama-3-8b"
kv_dtype = "fp8"
num_gpu_blocks = 48
[[engine]]
node = "n1"
count = 2
gpu = "a100-sxm"
model = "llama-3-8b"
kv_dtype = "fp8"
num_gpu_blocks = 48
[mooncake]
capacity = "32blk"
gbps = 10
[nvme]
capacity = "48blk"
[[nvme.target]]
name = "t0"
read_gbps = 5
write_gbps = 5
[[nvme.target]]
name = "t1"
read_gbps = 5
write_gbps = 5
"""


def _inputs(tmp: Path) -> tuple[str, str]:
    trace = tmp / "small.jsonl"
    res = run("trace", "gen", "--sessions", "6", "--rounds", "4", "--input-tokens", "256",
              "--output-tokens", "32", "-o", str(trace))
    assert res.exit_code == 0, res.stderr
    cluster = tmp / "mini.toml"
    cluster.write_text(CLUSTER)
    return str(trace), str(cluster)


def _run(trace: str, cluster: str, state: Any, faults: tuple[str, ...] = ()) -> dict[str, Any]:
    from kvtool.replay.raydata import Fault, RayClusterData
    from kvtool.serving.load import Load
    from kvtool.serving.run import ServingSettings, run_serving

    s = ServingSettings(trace, clusters=(cluster,), loads=(Load("concurrency", 3),))
    return run_serving(s, backend=lambda b: RayClusterData(
        b, state, seed=5, faults=[Fault.parse(f) for f in faults]))


def _simulated(trace: str, cluster: str) -> dict[str, Any]:
    from kvtool.serving.load import Load
    from kvtool.serving.run import ServingSettings, run_serving

    return run_serving(ServingSettings(trace, clusters=(cluster,),
                                       loads=(Load("concurrency", 3),)))["runs"][0]


def test_engines_on_nodes_share_tiers_and_every_hit_is_checked(
        local_ray: Any, targets: list[LocalTarget], mooncake_master: dict[str, Any],
        tmp_path: Path) -> None:
    trace, cluster = _inputs(tmp_path)
    state = cluster_state("mini", ["n0", "n1"], targets, mooncake_master)
    doc = _run(trace, cluster, state)
    r = doc["runs"][0]
    d = r["data"]
    assert doc["mode"] == "data" and d["runtime"] == "ray"
    assert d["corrupt_blocks"] == 0 and d["lost_blocks"] == 0, d["problems"]
    # every block the model loaded from a tier was read on an engine and checked there
    assert d["verified_blocks"] == sum(r["cache"]["blocks_loaded"].values()) > 0
    # round-robin sends a session's next round to another engine: its prefix hits blocks
    # that engine never computed, through the node's DRAM, Mooncake or the targets
    assert d["cross_engine_hits"] > 0
    assert set(d["tiers"]) == {"dram", "mooncake", "nvme"}
    assert all(c["blocks_written"] > 0 for c in d["tiers"].values())
    assert {e["node"] for e in d["engines"]} == {"n0", "n1"}
    # the bytes follow the clock; the simulated report is --simulate's
    assert r["serving"] == _simulated(trace, cluster)["serving"]
    # nothing is left behind: actors gone, the nodes' DRAM pools removed
    assert not any(Path(f"/dev/shm/kvtool-{d['run']}-{n}.dram").exists() for n in ("n0", "n1"))
    json.dumps(doc)  # what --json prints


@pytest.mark.parametrize("fault, who", [("engine", "engine1"), ("target", "t0"),
                                        ("node", "n1")])
def test_a_fault_mid_run_costs_recomputes_never_corruption(
        local_ray: Any, targets: list[LocalTarget], mooncake_master: dict[str, Any],
        tmp_path: Path, fault: str, who: str) -> None:
    trace, cluster = _inputs(tmp_path)
    sim = _simulated(trace, cluster)
    at = round(sim["serving"]["duration"] / 3, 3)
    state = cluster_state("mini", ["n0", "n1"], targets, mooncake_master)
    doc = _run(trace, cluster, state, faults=(f"{fault}@{at}:{who}",))
    r = doc["runs"][0]
    d = r["data"]
    # the run completes: every request served, none failed
    assert r["serving"]["completed"] == doc["requests"] and r["serving"]["failed"] == 0
    # the report names the fault and when it fired (simulated seconds, at or after its time)
    [f] = d["faults"]
    assert f["kind"] == fault and f["who"] == who and f["fired_at_s"] >= at
    # nothing corrupt was ever served; what was lost was counted and recomputed
    assert d["corrupt_blocks"] == 0
    assert r["cache"]["recomputed_after_check_blocks"] >= d["lost_blocks"]
    if fault == "engine":
        e = next(e for e in d["engines"] if e["name"] == who)
        assert e["restarted"] and e["pid"] != e["first_pid"]
        assert all(not x["restarted"] for x in d["engines"] if x["name"] != who)
    elif fault == "target":
        assert targets[0].proc.wait(5) == -9  # really killed
        assert any(p["kind"] == "target failed" and p["target"] == "t0" for p in d["problems"])
        assert d["lost_blocks"] + d["tiers"]["nvme"]["failed_writes"] > 0
    else:
        assert {e["name"] for e in d["engines"] if e["restarted"]} == {"engine2", "engine3"}
        assert d["lost_blocks"] > 0
        assert all(p["tier"] in ("dram", "mooncake") for p in d["problems"] if "key" in p)
    # blocks that survived still hit, and were checked
    assert d["verified_blocks"] > 0


@pytest.mark.root
def test_a_cut_link_cuts_a_storage_node_off(
        local_ray: Any, targets: list[LocalTarget], netns_storage: NetnsNode,
        mooncake_master: dict[str, Any], tmp_path: Path) -> None:
    import subprocess

    from kvtool.cluster.state import NodeState

    trace, cluster = _inputs(tmp_path)
    at = round(_simulated(trace, cluster)["serving"]["duration"] / 3, 3)
    # t0 lives on storage node s0, in its own namespace; t1 on this machine
    state = cluster_state("mini", ["n0", "n1"], [netns_storage.target, targets[1]],
                          mooncake_master)
    state.nodes.append(NodeState("s0", netns_storage.netns, netns_storage.address,
                                 ["storage"]))
    state.targets[0].node = "s0"
    doc = _run(trace, cluster, state, faults=(f"link@{at}:s0",))
    r = doc["runs"][0]
    d = r["data"]
    assert r["serving"]["completed"] == doc["requests"] and r["serving"]["failed"] == 0
    [f] = d["faults"]
    assert f["kind"] == "link" and f["who"] == "s0" and f["fired_at_s"] >= at
    assert f["effect"] == f"link {netns_storage.device} set down inside namespace " \
                          f"{netns_storage.netns} (set up again when the run ends)"
    # the run set the link it cut up again when it ended
    show = subprocess.run(["ip", "-n", netns_storage.netns, "-o", "link", "show",
                           netns_storage.device], capture_output=True, text=True, check=True)
    assert "UP" in show.stdout.split("<", 1)[1].split(">", 1)[0].split(",")
    # the target is unreachable, not dead: its blocks are lost, none corrupt, t1's hit
    assert netns_storage.target.proc.poll() is None
    assert d["corrupt_blocks"] == 0
    assert any(p["kind"] == "target failed" and p["target"] == "t0" for p in d["problems"])
    assert d["lost_blocks"] + d["tiers"]["nvme"]["failed_writes"] > 0
    assert r["cache"]["recomputed_after_check_blocks"] >= d["lost_blocks"]
    assert d["verified_blocks"] > 0


def test_cli_on_a_cluster_that_is_up(local_ray: Any, targets: list[LocalTarget],
                                     mooncake_master: dict[str, Any], tmp_path: Path,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.helpers.widths import checking_widths

    trace, cluster = _inputs(tmp_path)
    at = round(_simulated(trace, cluster)["serving"]["duration"] / 2, 3)
    monkeypatch.setenv("KVTOOL_STATE_DIR", str(tmp_path / "state"))
    cluster_state("mini", ["n0", "n1"], targets, mooncake_master).save()
    with checking_widths(monkeypatch) as problems:
        res = run("replay", trace, "--cluster", cluster, "--concurrency", "3",
                  "--fault", f"engine@{at}:engine0")
    assert res.exit_code == 0, res.stderr
    assert "engines as Ray actors on their nodes" in res.stderr
    assert "cross-engine hits" in res.stdout and "corrupt 0" in res.stdout
    text = " ".join(res.stdout.split())
    assert "fault engine engine0 at " in text and f"asked for {at:g} s" in text, text
    assert problems == []
