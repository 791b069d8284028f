"""The cluster file's placement ([placement], storage nodes, target and Mooncake
placement): what it accepts, and one line naming file, line and field for what it does not
(no root needed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtool.cluster.placement import load_placed, parse_placed
from kvtool.errors import InputError
from kvtool.serving.topology import load_cluster
from tests.conftest import FIXTURES, run, run_json

BASE = """\
name = "p"
[placement]
kind = "netns"
subnet = "10.200.0.0/24"
link_scale = 0.001
[[node]]
name = "a"
nic_gbps = 25
[[node]]
name = "s"
storage = true
[[engine]]
node = "a"
gpu = "a100-sxm"
model = "llama-3-8b"
num_gpu_blocks = 16
[mooncake]
capacity = "16blk"
master = "a"
segment = "32MiB"
[nvme]
capacity = "16blk"
[[nvme.target]]
name = "t0"
node = "s"
size = "48MiB"
"""


def test_placement_is_read() -> None:
    placed = parse_placed(BASE, source="p.toml")
    spec, placement = placed.spec, placed.placement
    assert placement is not None
    assert placement.subnet == "10.200.0.0/24"
    assert placement.link_rate_mbit(spec.node("a")) == pytest.approx(200)
    assert placement.link_rate_mbit(spec.node("s")) is None  # no nic_gbps: unshaped
    assert spec.node("s").storage and not spec.engines_on("s")
    assert spec.nvme is not None and spec.nvme.targets[0].node == "s"
    assert spec.nvme.targets[0].size == 48 << 20
    assert spec.mooncake is not None and spec.mooncake.master == "a"
    assert spec.mooncake.segment == 32 << 20


def test_every_cluster_fixture_still_loads() -> None:
    files = sorted((FIXTURES / "clusters").glob("*.toml"))
    assert any(f.name == "gp7000-mini.toml" for f in files)
    for f in files:
        load_cluster(f)
    placed = load_placed(FIXTURES / "clusters" / "gp7000-mini.toml")
    mini = placed.spec
    assert placed.placement is not None
    assert [n.name for n in mini.nodes if n.storage] == ["array"]
    assert len(mini.engines) == 4 and {e.node for e in mini.engines} == {"cx81", "cx82"}


@pytest.mark.parametrize(("old", "new", "line", "field", "words"), [
    ('kind = "netns"', 'kind = "vm"', 3, "placement.kind", "unknown placement kind"),
    ('subnet = "10.200.0.0/24"', 'subnet = "8.8.8.0/24"', 4, "placement.subnet", "private"),
    ('subnet = "10.200.0.0/24"', 'subnet = "10.200.0.0/30"', 4, "placement.subnet", "no room"),
    ('subnet = "10.200.0.0/24"', 'subnet = "10.200.0.1/24"', 4, "placement.subnet",
     "not a subnet"),
    ('subnet = "10.200.0.0/24"', "subnet = 4", 4, "placement.subnet",
     "expected a non-empty string"),
    ("link_scale = 0.001", "link_scale = -1", 5, "placement.link_scale", "> 0"),
    ("link_scale = 0.001", "link_scale = 0.001\nlink_mbit = 100", 6, "placement.link_mbit",
     "not both"),
    ("link_scale = 0.001", "link_speed = 1", 5, "placement.link_speed", "unknown key"),
    ("storage = true", 'storage = "yes"', 11, "node[1].storage", "true or false"),
    ('node = "s"\nsize', 'node = "a"\nsize', 25, "nvme.target[0].node", "not a storage node"),
    ('node = "s"\nsize', 'node = "x"\nsize', 25, "nvme.target[0].node", "unknown node"),
    ('size = "48MiB"', 'size = "4KiB"', 26, "nvme.target[0].size", "at least 1MiB"),
    ('master = "a"', 'master = "b"', 19, "mooncake.master", "unknown node"),
    ('segment = "32MiB"', 'segment = "lots"', 20, "mooncake.segment", "not a size"),
])
def test_bad_placement_is_one_line_exit_2(tmp_path: Path, old: str, new: str, line: int,
                                          field: str, words: str) -> None:
    assert old in BASE
    f = tmp_path / "p.toml"
    f.write_text(BASE.replace(old, new, 1))
    with pytest.raises(InputError) as err:
        load_placed(f)
    assert err.value.line == line and err.value.field == field, str(err.value)
    result = run("cluster", "up", str(f))
    assert result.exit_code == 2
    [msg] = result.stderr.strip().splitlines()
    assert msg.startswith(f"kvtool: {f}:{line}: field '{field}'") or \
        f"{f.name}:{line}: field '{field}'" in msg, msg
    assert words in msg


def test_the_simulation_lets_placement_be(tmp_path: Path) -> None:
    """``[placement]`` is the deployment's (kvtool.cluster.placement): the simulation's spec
    reads the rest of the file and does not look at it."""
    f = tmp_path / "p.toml"
    f.write_text(BASE.replace('subnet = "10.200.0.0/24"', "subnet = 4"))
    assert [n.name for n in load_cluster(f).nodes] == ["a", "s"]
    with pytest.raises(InputError) as err:
        load_placed(f)
    assert err.value.field == "placement.subnet"


def test_a_target_without_node_in_a_placed_cluster(tmp_path: Path) -> None:
    f = tmp_path / "p.toml"
    f.write_text(BASE.replace('node = "s"\nsize', 'size'))
    result = run("cluster", "up", str(f))
    assert result.exit_code == 2
    assert "field 'nvme.target[0].node'" in result.stderr and "storage nodes: s" in result.stderr


def test_up_needs_a_placement(tmp_path: Path) -> None:
    f = tmp_path / "p.toml"
    f.write_text((FIXTURES / "clusters" / "gp7000.toml").read_text())
    result = run("cluster", "up", str(f))
    assert result.exit_code == 2 and "[placement]" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_status_and_down_of_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvtool.cluster.lifecycle import not_up

    monkeypatch.setenv("KVTOOL_STATE_DIR", str(tmp_path))
    doc = run_json("cluster", "status")
    assert doc == not_up(None)
    f = FIXTURES / "clusters" / "gp7000-mini.toml"
    assert run_json("cluster", "status", str(f))["phase"] == "down"
    assert run_json("cluster", "down", str(f)) == {"schema": "kvtool.cluster.down/1",
                                                   "name": str(f), "removed": []}


def _status_doc() -> dict[str, object]:
    from kvtool.cluster.lifecycle import not_up

    doc = not_up("gp7000-mini")
    doc.update(phase="up", healthy=True, subnet="10.200.0.0/24", bridge="kvbe36472",
               ray_address="10.200.0.2:6379")
    doc["nodes"] = [
        {"name": n, "netns": f"kvtool-gp7000-mini-{n}", "address": f"10.200.0.{i + 2}",
         "roles": roles, "link_mbit": 200.0, "link_mbit_now": 200.0, "present": True,
         "ray": True, "engines": engines}
        for i, (n, roles, engines) in enumerate([
            ("cx81", ["head", "engine", "mooncake"], ["cx81-0", "cx81-1"]),
            ("cx82", ["engine"], ["cx82-0", "cx82-1"]), ("array", ["storage"], [])])]
    doc["targets"] = [{"name": "array-t0", "node": "array", "runtime": "userspace",
                       "url": "nvme+tcp://10.200.0.4:4420/nqn.2026-01.io.kvtool:cluster:"
                              "gp7000-mini:array-t0", "running": True}]
    doc["mooncake"] = {"url": "mooncake://10.200.0.2:50051?metadata=10.200.0.2:8080",
                       "segments": [{"node": "cx81"}, {"node": "cx82"}, {"node": "array"}]}
    return doc


def test_human_output_fits_80_columns() -> None:
    from kvtool.cli.bench import render_cluster
    from kvtool.cli.cluster import render
    from tests.helpers.widths import width_problems

    doc = _status_doc()
    assert not width_problems(lambda con: render(con, doc))
    row = {"gb_per_s": 0.0239, "iops": 22.8, "lat_us": {"p50": 350977.0}, "link_mbit": 200.0}
    bench = {"cluster": "gp7000-mini", "clients": 2, "object_bytes": 1 << 20, "seconds": 3.0,
             "cases": [{"pattern": "rand-read", "qd": 8,
                        "nodes": [{"node": "cx81", **row}, {"node": "cx82", **row}],
                        "aggregate": {"gb_per_s": 0.0462, "iops": 44.1, "late": ["cx82"]}}]}
    assert not width_problems(lambda con: render_cluster(con, bench))


def test_target_config(tmp_path: Path) -> None:
    target = tmp_path / "t.toml"
    demo = (FIXTURES / "targets" / "demo.toml").read_text()
    target.write_text(demo)
    assert 'runtime = "userspace"' in demo
    (tmp_path / "qemu.toml").write_text(demo.replace('runtime = "userspace"', 'runtime = "qemu"'))
    text = BASE.replace('size = "48MiB"', 'config = "t.toml"')
    f = tmp_path / "p.toml"
    f.write_text(text)
    spec = load_cluster(f)
    assert spec.nvme is not None and spec.nvme.targets[0].config == str(target.resolve())
    for old, new, words in [
            ('config = "t.toml"', 'config = "t.toml"\nsize = "48MiB"', "not both"),
            ('config = "t.toml"', 'config = "missing.toml"', "no such target config"),
            ('config = "t.toml"', 'config = "qemu.toml"', "runs kvtool's emulator")]:
        f.write_text(text.replace(old, new))
        result = run("cluster", "up", str(f))
        assert result.exit_code == 2 and words in result.stderr, result.stderr
        [line] = result.stderr.strip().splitlines()
        assert "field 'nvme.target[0]." in line


HOSTS = """\
name = "p"
[placement]
kind = "hosts"
ray = "192.168.7.1:6379"
ray_token_file = "ray-token"
[[node]]
name = "a"
address = "192.168.7.1"
[[node]]
name = "s"
storage = true
address = "192.168.7.2"
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


def test_hosts_placement_is_read(tmp_path: Path) -> None:
    f = tmp_path / "h.toml"
    f.write_text(HOSTS)
    spec, placement = load_placed(f).spec, load_placed(f).placement
    assert placement is not None and placement.kind == "hosts"
    assert placement.ray == "192.168.7.1:6379"
    assert placement.ray_token_file == str(tmp_path / "ray-token")
    assert [n.address for n in spec.nodes] == ["192.168.7.1", "192.168.7.2"]
    assert placement.link_rate_mbit(spec.node("a")) is None  # no shaping on hosts
    f.write_text(HOSTS.replace('ray = "192.168.7.1:6379"\n', ""))
    assert load_placed(f).placement.ray is None  # type: ignore[union-attr]  # RAY_ADDRESS


@pytest.mark.parametrize(("old", "new", "line", "field", "words"), [
    ('address = "192.168.7.2"', "", 9, "node[1]", "has no address"),
    ('address = "192.168.7.2"', 'address = "192.168.7.1"', 12, "node[1].address",
     "node 'a''s too"),
    ('address = "192.168.7.2"', 'address = "host-s"', 12, "node[1].address", "IPv4"),
    ('address = "192.168.7.2"', 'address = "0.0.0.0"', 12, "node[1].address",
     "one host's IPv4"),
    ('ray = "192.168.7.1:6379"', 'ray = "192.168.7.1"', 4, "placement.ray", "HOST:PORT"),
    ('ray = "192.168.7.1:6379"', 'subnet = "10.1.0.0/24"', 4, "placement.subnet",
     'applies to kind = "netns"'),
    ('ray = "192.168.7.1:6379"', "link_mbit = 200", 4, "placement.link_mbit",
     'applies to kind = "netns"'),
])
def test_bad_hosts_placement_is_one_line_exit_2(tmp_path: Path, old: str, new: str,
                                                line: int, field: str, words: str) -> None:
    f = tmp_path / "h.toml"
    f.write_text(HOSTS.replace(old, new, 1))
    with pytest.raises(InputError) as err:
        load_placed(f)
    assert err.value.line == line and err.value.field == field, str(err.value)
    result = run("cluster", "up", str(f))
    assert result.exit_code == 2
    [msg] = result.stderr.strip().splitlines()
    assert f"field '{field}'" in msg and words in msg, msg


def test_netns_refuses_hosts_keys(tmp_path: Path) -> None:
    f = tmp_path / "p.toml"
    for old, new, field in [('name = "s"\n', 'name = "s"\naddress = "10.0.0.9"\n',
                             "node[1].address"),
                            ("link_scale = 0.001", 'ray = "10.0.0.1:6379"', "placement.ray")]:
        f.write_text(BASE.replace(old, new, 1))
        result = run("cluster", "up", str(f))
        assert result.exit_code == 2 and f"field '{field}'" in result.stderr, result.stderr
        assert "applies to" in result.stderr


def test_hosts_up_needs_a_ray_address(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVTOOL_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    f = tmp_path / "h.toml"
    f.write_text(HOSTS.replace('ray = "192.168.7.1:6379"\n', ""))
    result = run("cluster", "up", str(f))
    assert result.exit_code == 2 and "RAY_ADDRESS" in result.stderr, result.stderr
    assert run_json("cluster", "status", str(f))["phase"] == "down"  # nothing was made
    f.write_text(HOSTS.replace('"ray-token"', '"missing-token"'))
    result = run("cluster", "up", str(f))
    assert result.exit_code == 2 and "no such Ray token file" in result.stderr


def test_hosts_status_fits_80_columns() -> None:
    from kvtool.cli.cluster import render
    from tests.helpers.widths import width_problems

    doc = _status_doc()
    doc.update(kind="hosts", subnet=None, bridge=None,
               ray_error="Ray at 192.168.7.1:6379: cannot join Ray at 192.168.7.1:6379: "
                         "Failed to connect to the GCS server in 60 s")
    for n in doc["nodes"]:  # type: ignore[attr-defined]
        n.update(netns=None, link_mbit=None, link_mbit_now=None, address="192.168.107.211")
    assert not width_problems(lambda con: render(con, doc))


def test_a_host_agent_kills_only_the_recorded_process(tmp_path: Path) -> None:
    """A fault's kill on a host (``NodeAgent.kill``, here in this process): a recorded
    (pid, start time) that is still that process is SIGKILLed; one whose start time does not
    match (a reused pid) and one that is gone are left alone."""
    import signal
    import subprocess

    from kvtool.cluster.hosts import NodeAgent
    from kvtool.target.procs import start_time

    agent = NodeAgent("c", "n", "127.0.0.1", str(tmp_path))
    procs = [subprocess.Popen(["sleep", "60"]) for _ in range(2)]
    try:
        mine, other = procs
        start = start_time(mine.pid)
        assert start is not None
        assert agent.kill([(other.pid, (start_time(other.pid) or 0) + 1)]) == []
        assert agent.kill([(mine.pid, start)]) == [mine.pid]
        assert mine.wait(10) == -signal.SIGKILL
        assert other.poll() is None  # not that process: untouched
        assert agent.kill([(mine.pid, start)]) == []  # gone now
    finally:
        for p in procs:
            p.kill()
            p.wait()
