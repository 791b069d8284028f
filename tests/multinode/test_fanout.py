"""Sweeps fan out (kvtool.fanout): every point's result is the serial run's, byte for
byte, on local processes and on a real local Ray."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

from kvtool.fanout import Fanout, choose_fanout
from tests.conftest import FIXTURES, REPO, run

TRACE = str(FIXTURES / "traces" / "multiturn-8x12.jsonl")
CLUSTER = str(FIXTURES / "clusters" / "gp7000.toml")


def _square_pid(shared: int, i: int) -> tuple[int, int]:
    return shared + i * i, os.getpid()


def _fails_at_two(_shared: Any, i: int) -> int:
    if i == 2:
        raise ValueError(f"point {i} failed")
    return i


def test_processes_keep_index_order_and_run_elsewhere() -> None:
    done: list[int] = []
    out = Fanout("processes", workers=2).map(_square_pid, 10, 5, done.append)
    assert [v for v, _pid in out] == [10, 11, 14, 19, 26]
    assert all(pid != os.getpid() for _v, pid in out)
    assert sorted(done) == [0, 1, 2, 3, 4]


def test_a_point_that_fails_raises_in_the_caller() -> None:
    with pytest.raises(ValueError, match="point 2 failed"):
        Fanout("processes", workers=2).map(_fails_at_two, None, 4)


def test_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert choose_fanout(1).kind == "serial"
    assert choose_fanout(8, jobs=1).kind == "serial"
    assert choose_fanout(8, jobs=2) == Fanout("processes", workers=2)
    assert choose_fanout(8, ray_address="10.0.0.1:6379") == Fanout(
        "ray", workers=8, ray_address="10.0.0.1:6379")
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6380")
    assert choose_fanout(3).ray_address == "127.0.0.1:6380"


def test_choice_follows_a_cluster_that_is_up(monkeypatch: pytest.MonkeyPatch,
                                             tmp_path: Path) -> None:
    from kvtool.cluster.state import ClusterState, ray_head_of

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("KVTOOL_STATE_DIR", str(tmp_path))
    toml = tmp_path / "c.toml"
    toml.write_text('name = "mini"\n')
    assert choose_fanout(3, jobs=2, cluster_ray=lambda: ray_head_of([str(toml)])).kind == "processes"
    state = ClusterState(name="mini", file=str(toml), phase="starting",
                         ray_address="10.201.0.2:6379", ray_token_file="/x/ray-token")
    state.save()
    assert choose_fanout(3, jobs=2, cluster_ray=lambda: ray_head_of([str(toml)])).kind == "processes"
    state.phase = "up"
    state.save()
    fanout = choose_fanout(3, cluster_ray=lambda: ray_head_of([str(toml)]))
    assert (fanout.kind, fanout.ray_address) == ("ray", "10.201.0.2:6379")
    assert dict(fanout.ray_env)["RAY_AUTH_TOKEN_PATH"] == "/x/ray-token"
    assert choose_fanout(3, jobs=1, cluster_ray=lambda: ray_head_of([str(toml)])).kind == "serial"


def _serving(fanout: Fanout | None) -> str:
    from kvtool.serving.load import Load
    from kvtool.serving.run import ServingSettings, run_serving

    s = ServingSettings(TRACE, clusters=(CLUSTER, str(FIXTURES / "clusters" / "gp7000-dram.toml")),
                        loads=(Load("concurrency", 2), Load("concurrency", 16),
                               Load("request-rate", 4.0)))
    return json.dumps(run_serving(s, fanout=fanout), sort_keys=True)


def _compare(fanout: Fanout | None) -> str:
    from kvtool.replay.run import ReplaySettings, prepare
    from kvtool.tiers.option import TierOption

    s = ReplaySettings(TRACE, simulate=True, model="deepseek-v4-flash", dtype="fp8",
                       tiers={"gpu": TierOption.parse("64MiB", tier="gpu"),
                              "dram": TierOption.parse("1GiB", tier="dram")},
                       compares=("dram=256MiB", "gpu=32MiB,dram=128MiB,policy=s3fifo"))
    return json.dumps(prepare(s).run(fanout=fanout), sort_keys=True)


@pytest.mark.slow
def test_sweep_and_compare_identical_serial_processes_ray(local_ray: Any) -> None:
    serial = _serving(None)
    assert len(json.loads(serial)["runs"]) == 6
    assert _serving(Fanout("processes", workers=2)) == serial
    assert _serving(Fanout("ray")) == serial
    serial = _compare(None)
    assert len(json.loads(serial)["configs"]) == 3
    assert _compare(Fanout("processes", workers=2)) == serial
    assert _compare(Fanout("ray")) == serial


NODE_IPS = """
from kvtool.fanout import Fanout

def node_ip(_shared, _i):
    import ray
    return ray.util.get_node_ip_address()

print(sorted(set(Fanout("ray", workers=2, ray_address="local").map(node_ip, None, 2))))
"""


@pytest.mark.slow
def test_a_local_ray_listens_on_loopback_and_leaves_no_file() -> None:
    """``--ray local`` starts a Ray for the run: in Ray's single-machine mode (its node is
    127.0.0.1, where its servers listen), shut down after the run, its session directory
    removed (Ray's default, $TMPDIR/ray, outlives the run). In processes of their own,
    with a temporary directory of the test's: this session's Ray (conftest.py) would be
    joined instead of started. The directory is short and under /tmp: Ray's Unix sockets
    live in it, and a socket's path has at most 107 bytes."""
    pytest.importorskip("ray", reason="the cluster extra (ray) is not installed")
    tmp = Path(tempfile.mkdtemp(prefix="kvtool-test-", dir="/tmp"))
    try:
        _local_ray_runs(tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _local_ray_runs(tmp: Path) -> None:
    env = {**os.environ, "TMPDIR": str(tmp), "PYTHONPATH": str(REPO)}
    env.pop("RAY_ADDRESS", None)
    env.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", None)
    ips = subprocess.run([sys.executable, "-c", NODE_IPS], env=env, capture_output=True,
                         text=True, timeout=300)
    assert ips.returncode == 0, ips.stderr
    assert ips.stdout.strip() == "['127.0.0.1']"
    assert list(tmp.iterdir()) == []
    args = ["--json", "replay", TRACE, "--simulate", "--cluster", CLUSTER, "--sweep",
            "concurrency=1,4"]
    fanned = subprocess.run([sys.executable, "-m", "kvtool", *args, "--ray", "local"], env=env,
                            capture_output=True, text=True, timeout=300)
    assert fanned.returncode == 0, fanned.stderr
    assert fanned.stdout == run(*args, "--jobs", "1").stdout
    assert list(tmp.iterdir()) == []


def test_cli_jobs_checked() -> None:
    r = run("replay", TRACE, "--simulate", "--cluster", CLUSTER, "--sweep",
            "concurrency=1,4", "--jobs", "0")
    assert r.exit_code == 2 and "--jobs" in r.stderr
    r = run("replay", TRACE, "--cluster", CLUSTER, "--jobs", "2")
    assert r.exit_code == 2 and "--jobs" in r.stderr and "data mode" in r.stderr


def test_cli_sweep_on_local_processes_matches_serial() -> None:
    args = ("--json", "replay", TRACE, "--simulate", "--cluster", CLUSTER, "--sweep",
            "concurrency=1,4,16")
    serial = run(*args, "--jobs", "1")
    fanned = run(*args, "--jobs", "2")
    assert serial.exit_code == fanned.exit_code == 0
    assert fanned.stdout == serial.stdout
    assert "2 local processes" in fanned.stderr
