"""``kvtool cluster up/status/down`` and ``kvtool bench --cluster`` on real namespaces, Ray,
emulator targets and Mooncake (root; one cluster shared by the module: tests/cluster/
conftest.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvtool.cluster import netns as N
from tests.cluster.conftest import Cluster, make_cluster, skip_reason
from tests.conftest import REPO

pytestmark = pytest.mark.slow


def test_status_tells_every_node_target_and_pool(mini: Cluster) -> None:
    from kvtool.cluster.lifecycle import not_up

    doc = mini.json("cluster", "status", str(mini.file))
    assert doc["phase"] == "up" and doc["healthy"], doc
    assert set(doc) == set(not_up(None))  # one shape, up or not
    nodes = {n["name"]: n for n in doc["nodes"]}
    assert set(nodes) == {"cx81", "cx82", "array"}
    assert nodes["cx81"]["roles"][0] == "head" and "mooncake" in nodes["cx81"]["roles"]
    assert nodes["array"]["roles"] == ["storage"]
    # tbf as the file says: 25 GB/s x 0.001 = 200 Mb/s; the array's 75 GB/s = 600 Mb/s
    assert nodes["cx82"]["link_mbit_now"] == pytest.approx(200)
    assert nodes["array"]["link_mbit_now"] == pytest.approx(600)
    assert all(n["present"] and n["ray"] for n in doc["nodes"])
    assert sorted(e["node"] for e in doc["engines"]) == ["cx81", "cx81", "cx82", "cx82"]
    [target] = doc["targets"]
    assert target["running"] and target["url"].startswith(f"nvme+tcp://{nodes['array']['address']}:")
    assert doc["mooncake"]["url"].startswith(f"mooncake://{nodes['cx81']['address']}:")
    assert {s["node"] for s in doc["mooncake"]["segments"]} == {"cx81", "cx82", "array"}
    # every namespace really exists, with the node's address on eth0
    for n in doc["nodes"]:
        out = subprocess.run(["ip", "-n", n["netns"], "-4", "-o", "addr", "show", "eth0"],
                             capture_output=True, text=True, check=True).stdout
        assert f"{n['address']}/" in out
    # and the human form names them within 80 columns
    human = mini.kvtool("cluster", "status", str(mini.file))
    assert human.returncode == 0 and target["url"] in human.stdout
    assert all(n["link_up"] for n in doc["nodes"])


def test_status_tells_a_cut_link(mini: Cluster) -> None:
    """A node whose link is down (a cut: ip link set eth0 down in its namespace) makes the
    cluster unhealthy, and status names it; up again, healthy again."""
    ns = f"kvtool-{mini.name}-cx82"
    subprocess.run(["ip", "-n", ns, "link", "set", "dev", "eth0", "down"], check=True)
    try:
        doc = mini.json("cluster", "status", str(mini.file))
        nodes = {n["name"]: n for n in doc["nodes"]}
        assert not doc["healthy"] and nodes["cx82"]["link_up"] is False
        assert nodes["cx81"]["link_up"] is True
        human = mini.kvtool("cluster", "status", str(mini.file))
        assert "down" in human.stdout
    finally:
        subprocess.run(["ip", "-n", ns, "link", "set", "dev", "eth0", "up"], check=True)
    assert mini.json("cluster", "status", str(mini.file))["healthy"]
    assert max(len(line) for line in human.stdout.splitlines()) <= 80


def test_targets_require_the_key(mini: Cluster) -> None:
    from kvtool.cluster.state import load_state
    from kvtool.errors import AuthenticationFailed, UsageError
    from kvtool.nvme.dhchap import generate_secret, load_secret_file
    from kvtool.nvme.hostauth import HostCredentials
    from kvtool.store.engine import open_engine

    os.environ["KVTOOL_STATE_DIR"] = mini.env["KVTOOL_STATE_DIR"]
    try:
        state = load_state(mini.name)
    finally:
        del os.environ["KVTOOL_STATE_DIR"]
    assert state is not None
    t = state.targets[0]
    key = load_secret_file(t.dhchap_key_file, field="key")
    ctrl = load_secret_file(t.dhchap_ctrl_key_file or "", field="key")
    engine = open_engine(t.url, write=False, credentials=HostCredentials(t.hostnqn, key, ctrl))
    assert engine.size == 96 << 20  # gp7000-mini.toml: array-t0 size = "96MiB"
    engine.close()
    refused = [None, HostCredentials(t.hostnqn), HostCredentials(t.hostnqn, generate_secret())]
    for creds in refused:
        with pytest.raises((AuthenticationFailed, UsageError)):
            open_engine(t.url, write=False, credentials=creds).close()


def test_bench_cluster_reports_each_node(mini: Cluster) -> None:
    doc = mini.json("bench", "--cluster", str(mini.file), "--block-bytes", "1MiB",
                    "--seconds", "1", "--qd", "4")
    assert doc["basis"] == "measured" and doc["clients"] == 2
    [case] = doc["cases"]
    assert case["pattern"] == "rand-read" and case["qd"] == 4
    assert [n["node"] for n in case["nodes"]] == ["cx81", "cx82"]
    for n in case["nodes"]:
        assert n["ops"] > 0 and n["gb_per_s"] > 0 and n["iops"] > 0
        assert n["bytes"] == n["ops"] * (1 << 20)
    agg = case["aggregate"]
    assert agg["bytes"] == sum(n["bytes"] for n in case["nodes"])
    assert agg["window_s"] >= max(n["seconds"] for n in case["nodes"])
    one = mini.json("bench", "--cluster", str(mini.file), "--block-bytes", "1MiB",
                    "--seconds", "1", "--qd", "4", "--clients", "1")
    assert [n["node"] for n in one["cases"][0]["nodes"]] == ["cx81"]


def test_bench_cluster_writes_need_force(mini: Cluster) -> None:
    proc = mini.kvtool("bench", "--cluster", str(mini.file), "--block-bytes", "1MiB",
                       "--pattern", "seq-write")
    assert proc.returncode == 2 and "--force" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


SMALL = """
name = "gp7000-mini"
[placement]
subnet = "10.200.0.0/24"
[[node]]
name = "a"
[[node]]
name = "s"
storage = true
[[engine]]
node = "a"
gpu = "a100-sxm"
model = "llama-3-8b"
num_gpu_blocks = 16
[nvme]
capacity = "16blk"
[[nvme.target]]
name = "t0"
node = "s"
"""


def test_down_after_an_up_killed_half_way(tmp_path: Path) -> None:
    """``up`` SIGKILLed once Ray runs on a node: status says so, down removes everything."""
    why = skip_reason()
    if why:
        pytest.skip(why)
    c = make_cluster(tmp_path, SMALL, 214)
    record = tmp_path / "state" / "clusters" / f"{c.name}.json"
    up = subprocess.Popen([sys.executable, "-m", "kvtool", "cluster", "up", str(c.file)],
                          env=c.env, cwd=REPO, stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                kinds = [r["kind"] for r in json.loads(record.read_text())["resources"]]
            except (OSError, ValueError, KeyError):
                kinds = []
            if kinds.count("ray") == 2:  # the worker's `ray start` is under way
                break
            time.sleep(0.05)
        else:
            pytest.fail("up never reached its second Ray node")
        up.send_signal(signal.SIGKILL)
        up.wait()
        doc = c.json("cluster", "status", str(c.file))
        assert doc["phase"] == "starting" and not doc["healthy"]
        assert doc["targets"] == []  # it never got there
        assert any(n["present"] for n in doc["nodes"])
    finally:
        down = c.kvtool("cluster", "down", str(c.file))
        left = c.leftovers()
    assert down.returncode == 0, down.stderr[-2000:]
    assert not left
    assert not record.exists()
    assert c.json("cluster", "status")["phase"] == "down"


def test_down_after_a_target_that_fails_to_start(tmp_path: Path) -> None:
    """A target that cannot start (its namespace bigger than memory) fails ``up`` with
    exit 1, naming it; the record says failed; down removes the rest."""
    why = skip_reason()
    if why:
        pytest.skip(why)
    c = make_cluster(tmp_path, SMALL.replace('node = "s"\n', 'node = "s"\nsize = "64PiB"\n'),
                     215)
    up = c.kvtool("cluster", "up", str(c.file))
    try:
        assert up.returncode == 1, up.stderr
        assert "target t0" in up.stderr and "cluster down" in up.stderr
        doc = c.json("cluster", "status", str(c.file))
        assert doc["phase"] == "failed" and "target t0" in doc["error"]
    finally:
        down = c.kvtool("cluster", "down", str(c.file))
        left = c.leftovers()
    assert down.returncode == 0, down.stderr[-2000:]
    assert not left and N.bridge_name(c.name) not in subprocess.run(
        ["ip", "-o", "link"], capture_output=True, text=True).stdout



def test_up_again_leaves_a_healthy_cluster_alone(mini: Cluster) -> None:
    before = mini.json("cluster", "status", str(mini.file))
    again = mini.json("cluster", "up", str(mini.file))
    assert again["healthy"] and again["resources"] == before["resources"]


def test_a_second_cluster_on_the_same_subnet_is_refused(mini: Cluster, tmp_path: Path) -> None:
    text = mini.file.read_text().replace(f'name = "{mini.name}"', 'name = "other"')
    f = tmp_path / "other.toml"
    f.write_text(text)
    proc = mini.kvtool("cluster", "up", str(f))
    assert proc.returncode == 2 and "overlaps" in proc.stderr, proc.stderr
    assert not any(ns.startswith("kvtool-other-") for ns in N.namespaces())


def test_down_that_cannot_remove_something_says_so(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A mount inside the cluster's folder keeps it there: down names it and fails; once
    the mount is gone, down finishes."""
    why = skip_reason()
    if why:
        pytest.skip(why)
    from kvtool.cluster import lifecycle
    from kvtool.cluster.errors import ClusterError
    from kvtool.cluster.state import ClusterState, Resource, load_state

    monkeypatch.setenv("KVTOOL_STATE_DIR", str(tmp_path / "state"))
    name = f"t{os.getpid()}"
    state = ClusterState(name=name, file=str(tmp_path / "x.toml"))
    files = state.files_dir
    state.add(Resource("dir", str(files)))
    (files / "busy").mkdir(parents=True)
    ns = N.netns_name(name, "a")
    state.add(Resource("netns", ns))
    N.add_netns(ns)
    subprocess.run(["mount", "-t", "tmpfs", "none", str(files / "busy")], check=True)
    try:
        with pytest.raises(ClusterError, match=f"dir {files} is still there"):
            lifecycle.down(state)
        assert not N.netns_exists(ns)  # what could go, went
        left = load_state(name)
        assert left is not None and left.phase == "failed"
        assert [r.kind for r in left.resources] == ["dir"]
    finally:
        subprocess.run(["umount", str(files / "busy")], check=False)
    left = load_state(name)
    assert left is not None
    assert lifecycle.down(left)["removed"] == [f"dir {files}"]
    assert load_state(name) is None and not files.exists()


def test_spdk_targets(tmp_path: Path, spdk: object) -> None:
    """--runtime spdk: SPDK's nvmf_tgt on the storage node, requiring the key; down stops it."""
    why = skip_reason()
    if why:
        pytest.skip(why)
    from kvtool.errors import AuthenticationFailed, UsageError
    from kvtool.nvme.dhchap import load_secret_file
    from kvtool.nvme.hostauth import HostCredentials
    from kvtool.store.engine import open_engine

    c = make_cluster(tmp_path, SMALL, 216)
    up = c.kvtool("cluster", "up", str(c.file), "--runtime", "spdk")
    try:
        assert up.returncode == 0, up.stderr[-2000:]
        doc = c.json("cluster", "status", str(c.file))
        [t] = doc["targets"]
        assert doc["healthy"] and t["runtime"] == "spdk" and t["running"]
        pid = next(r["pid"] for r in doc["resources"] if r["kind"] == "target")
        assert "nvmf_tgt" in Path(f"/proc/{pid}/cmdline").read_bytes().decode()
        creds = HostCredentials(t["hostnqn"], load_secret_file(t["dhchap_key_file"], field="k"),
                                load_secret_file(t["dhchap_ctrl_key_file"], field="k"))
        engine = open_engine(t["url"], write=False, credentials=creds)
        assert engine.size == 64 << 20
        engine.close()
        with pytest.raises((AuthenticationFailed, UsageError)):
            open_engine(t["url"], write=False, credentials=HostCredentials(t["hostnqn"])).close()
    finally:
        down = c.kvtool("cluster", "down", str(c.file))
        left = c.leftovers()
    assert down.returncode == 0, down.stderr[-2000:]
    assert not left and not Path(f"/proc/{pid}").exists()


def test_a_target_config_is_served_and_still_requires_the_key(tmp_path: Path) -> None:
    """A storage node serving the user's target config (a file namespace, allow_any_host):
    cluster up keeps its namespaces, listens on the node's address and requires the key."""
    why = skip_reason()
    if why:
        pytest.skip(why)
    from kvtool.errors import AuthenticationFailed, UsageError
    from kvtool.nvme.dhchap import load_secret_file
    from kvtool.nvme.hostauth import HostCredentials
    from kvtool.store.engine import open_engine

    (tmp_path / "mine.toml").write_text(f"""
backend = "emulator"
name = "mine"
[emulator]
runtime = "userspace"
[[subsystem]]
nqn = "nqn.2026-01.io.example:mine"
allow_any_host = true
  [[subsystem.namespace]]
  nsid = 1
  backing = "file"
  path = "{tmp_path / 'ns1.img'}"
  create = true
  size = "24MiB"
  lba = 4096
[[listener]]
address = "127.0.0.1"
port = 4420
""")
    c = make_cluster(tmp_path, SMALL.replace('node = "s"\n', 'node = "s"\nconfig = "mine.toml"\n'),
                     217)
    up = c.kvtool("cluster", "up", str(c.file))
    try:
        assert up.returncode == 0, up.stderr[-2000:]
        [t] = c.json("cluster", "status", str(c.file))["targets"]
        assert t["running"] and t["url"].endswith(":4420/nqn.2026-01.io.example:mine")
        assert not t["url"].startswith("nvme+tcp://127.0.0.1")
        creds = HostCredentials(t["hostnqn"], load_secret_file(t["dhchap_key_file"], field="k"),
                                load_secret_file(t["dhchap_ctrl_key_file"], field="k"))
        engine = open_engine(t["url"], write=False, credentials=creds)
        assert (engine.size, engine.lba_size) == (24 << 20, 4096)
        engine.close()
        assert (tmp_path / "ns1.img").stat().st_size == 24 << 20
        for other in (None, HostCredentials(t["hostnqn"])):
            with pytest.raises((AuthenticationFailed, UsageError)):
                open_engine(t["url"], write=False, credentials=other).close()
    finally:
        down = c.kvtool("cluster", "down", str(c.file))
        left = c.leftovers()
    assert down.returncode == 0 and not left, (down.stderr[-2000:], left)
