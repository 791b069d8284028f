"""The SPDK backend over a real Unix socket, against a peer that enforces SPDK's schemas.

Each request kvtool sends goes through the PyPI ``spdk`` client to :class:`SpdkPeer`, which
rejects anything SPDK's strict JSON decoder would (method names and parameter schemas of
schema/schema.yaml, see tests/helpers/spdk_schema.py) and then applies SPDK's semantics.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtool.errors import InputError
from kvtool.target.config import TargetConfig
from kvtool.target.loader import load_config, parse_config
from kvtool.target.plan import ApplyFailed, apply
from kvtool.target.spdk.backend import SpdkBackend, spdk_config
from kvtool.target.spdk.rpc import SpdkError, SpdkRpc
from tests.conftest import FIXTURES
from tests.helpers import spdk_schema
from tests.helpers.spdk_peer import SpdkPeer

PRODUCTION = FIXTURES / "targets" / "spdk-production.toml"


@pytest.fixture
def peer(tmp_path: Path) -> Iterator[SpdkPeer]:
    p = SpdkPeer(str(tmp_path / "spdk.sock"))
    yield p
    p.close()


def backend_for(peer: SpdkPeer) -> SpdkBackend:
    return SpdkBackend(SpdkRpc(peer.path, timeout=10))


def local_config(tmp_path: Path, *, malloc_mib: int = 64, extra: str = "") -> TargetConfig:
    text = f"""
backend = "spdk"
name = "local"
[[transport]]
type = "tcp"
in_capsule_data_size = 8192
max_io_size = 131072
{extra}
[[subsystem]]
nqn = "nqn.2016-06.io.spdk:cnode1"
serial = "SPDK0001"
hosts = ["nqn.2014-08.org.nvmexpress:uuid:11111111-1111-4111-8111-111111111111"]
  [[subsystem.namespace]]
  nsid = 1
  size = "{malloc_mib}MiB"
  lba = 512
  bdev_name = "Malloc0"
  [[subsystem.namespace]]
  nsid = 2
  backing = "file"
  path = "{tmp_path}/aio.img"
  create = true
  size = "16MiB"
  lba = 4096
[[listener]]
address = "127.0.0.1"
port = 4420
"""
    return parse_config(text, source="local.toml")


def production() -> TargetConfig:
    return load_config(PRODUCTION, allow_remote=True)


def test_production_config_up_uses_only_published_methods(peer: SpdkPeer) -> None:
    backend = backend_for(peer)
    plan = backend.plan_up(production())
    apply(plan)
    assert peer.rejected == []
    methods = {m for m, _ in peer.requests}
    assert methods <= set(spdk_schema.METHODS)
    assert {"nvmf_create_transport", "bdev_nvme_attach_controller", "nvmf_create_subsystem",
            "nvmf_subsystem_add_ns", "nvmf_subsystem_add_host",
            "nvmf_subsystem_add_listener"} <= methods
    subs = {k: v for k, v in peer.subsystems.items() if v["subtype"] == "NVMe"}
    assert len(subs) == 3
    assert all(len(s["namespaces"]) == 2 for s in subs.values())
    assert all(len(s["hosts"]) == 2 and not s["allow_any_host"] for s in subs.values())
    assert peer.transports["RDMA"]["in_capsule_data_size"] == 8192
    assert sorted(peer.controllers) == ["Nvme0", "Nvme1", "Nvme2", "Nvme3", "Nvme4", "Nvme5"]
    # 6 x 7.68 TB = the report's 46.09 TB tier
    total = sum(b["block_size"] * b["num_blocks"] for b in peer.bdevs.values())
    assert total == 6 * 7_680_000_000_000
    status = backend.status(production())
    assert {s["state"] for s in status["subsystems"]} == {"up"}
    assert status["subsystems"][0]["listeners"][0]["transport"] == "rdma"


def test_up_again_is_a_no_op_and_down_removes_what_it_owns(peer: SpdkPeer) -> None:
    backend = backend_for(peer)
    cfg = production()
    apply(backend.plan_up(cfg))
    n_requests = len(peer.requests)
    plan = backend.plan_up(cfg)
    assert plan.empty, [s.describe() for s in plan.steps]
    assert all(m.startswith(("nvmf_get", "bdev_get", "bdev_nvme_get", "spdk_get"))
               for m, _ in peer.requests[n_requests:])
    foreign = "nqn.2016-06.io.spdk:someone-else"
    peer.rpc_nvmf_create_subsystem(foreign, allow_any_host=True)
    down = backend.plan_down(cfg)
    order = [(s.action, s.kind) for s in down.steps]
    assert order.index(("delete", "listener")) < order.index(("delete", "namespace")) \
        < order.index(("delete", "subsystem")) < order.index(("delete", "bdev"))
    apply(down)
    assert peer.rejected == []
    assert set(peer.subsystems) == {"nqn.2014-08.org.nvmexpress.discovery", foreign}
    assert peer.bdevs == {} and peer.controllers == {}
    assert "RDMA" in peer.transports  # shared, SPDK cannot delete it
    assert backend.plan_down(cfg).empty


def test_failure_half_way_rolls_back(peer: SpdkPeer, tmp_path: Path) -> None:
    backend = backend_for(peer)
    cfg = local_config(tmp_path)
    # the transport exists already (SPDK cannot delete one, so a fresh run could not undo it)
    SpdkRpc(peer.path).call("nvmf_create_transport", {"trtype": "TCP", "in_capsule_data_size": 8192,
                                                      "max_io_size": 131072})
    before = peer.state()
    peer.fail_next("nvmf_subsystem_add_listener", -32602, "Listener already exists")
    with pytest.raises(ApplyFailed) as info:
        apply(backend.plan_up(cfg))
    assert "Listener already exists" in str(info.value) and info.value.rolled_back
    assert peer.state() == before
    assert not (tmp_path / "aio.img").exists()  # the file this run created is gone too
    assert peer.rejected == []


def test_failure_after_a_change_restores_the_old_bdevs(peer: SpdkPeer, tmp_path: Path) -> None:
    backend = backend_for(peer)
    apply(backend.plan_up(local_config(tmp_path)))
    before = peer.state()
    bigger = local_config(tmp_path, malloc_mib=128)
    plan = backend.plan_up(bigger)
    assert [(s.action, s.kind) for s in plan.steps] == [
        ("delete", "namespace"), ("delete", "bdev"), ("create", "bdev"), ("create", "namespace")]
    peer.fail_next("nvmf_subsystem_add_ns")
    with pytest.raises(ApplyFailed):
        apply(plan)
    after = peer.state()
    assert after["bdevs"]["Malloc0"]["num_blocks"] == before["bdevs"]["Malloc0"]["num_blocks"]
    assert after["subsystems"] == before["subsystems"]
    apply(backend.plan_up(bigger))
    assert peer.bdevs["Malloc0"]["num_blocks"] == 128 * 2048
    assert backend.plan_up(bigger).empty
    assert peer.rejected == []


def test_status_gives_the_registration_facts(peer: SpdkPeer, tmp_path: Path) -> None:
    backend = backend_for(peer)
    cfg = local_config(tmp_path)
    apply(backend.plan_up(cfg))
    st = backend.status(cfg)
    assert st["spdk_version"] == "SPDK v26.09"
    ns = st["subsystems"][0]["namespaces"]
    assert [(n["nsid"], n["size"], n["block_size"]) for n in ns] == [
        (1, 64 << 20, 512), (2, 16 << 20, 4096)]
    assert st["subsystems"][0]["listeners"] == [
        {"id": None, "transport": "tcp", "address": "127.0.0.1", "port": 4420, "family": "ipv4"}]


def test_io_unit_size_only_for_targets_that_still_accept_it(tmp_path: Path) -> None:
    extra = "io_unit_size = 8192"
    text_cfg = local_config(tmp_path, extra=extra)
    old = SpdkPeer(str(tmp_path / "old.sock"), version=(25, 9))
    try:
        apply(backend_for(old).plan_up(text_cfg))
        assert old.rejected == []
        assert old.transports["TCP"]["io_unit_size"] == 8192
    finally:
        old.close()
    (tmp_path / "aio.img").unlink()
    new = SpdkPeer(str(tmp_path / "new.sock"), version=(26, 9))
    try:
        with pytest.raises(InputError) as info:
            backend_for(new).plan_up(text_cfg)
        assert info.value.field == "transport[0].io_unit_size" and info.value.line == 8
        assert "removed io_unit_size" in str(info.value)
        assert not any(m == "nvmf_create_transport" for m, _ in new.requests)
    finally:
        new.close()


def test_schema_rejects_what_spdk_rejects(peer: SpdkPeer) -> None:
    rpc = SpdkRpc(peer.path, timeout=10)
    with pytest.raises(SpdkError) as e:
        rpc.call("nvmf_create_transport", {"trtype": "TCP", "io_unit_size": 8192})
    assert e.value.code == -32602 and "io_unit_size" in str(e.value)
    with pytest.raises(SpdkError) as e:
        rpc.call("nvmf_subsystem_add_ns", {"nqn": "nqn.2016-06.io.spdk:x", "namespace": {}})
    assert e.value.code == -32602 and "bdev_name" in str(e.value)
    with pytest.raises(SpdkError) as e:
        rpc.call("construct_malloc_bdev", {})
    assert e.value.code == -32601
    rpc.call("nvmf_create_transport", {"trtype": "TCP"})
    with pytest.raises(SpdkError, match="already exists"):
        rpc.call("nvmf_create_transport", {"trtype": "tcp"})


def test_exported_config_is_valid_spdk_json(tmp_path: Path) -> None:
    doc = spdk_config(production())
    records = [r for sub in doc["subsystems"] for r in sub["config"]]
    assert [sub["subsystem"] for sub in doc["subsystems"]] == ["bdev", "nvmf"]
    assert len([r for r in records if r["method"] == "nvmf_subsystem_add_ns"]) == 6
    for r in records:
        assert spdk_schema.validate(r["method"], r["params"]) is None, r
    # replaying the exported records on a fresh target builds the same state as `up`
    replay = SpdkPeer(str(tmp_path / "replay.sock"))
    applied = SpdkPeer(str(tmp_path / "applied.sock"))
    try:
        rpc = SpdkRpc(replay.path, timeout=10)
        for r in records:
            rpc.call(r["method"], r["params"])
        apply(backend_for(applied).plan_up(production()))
        assert replay.state() == applied.state()
    finally:
        replay.close()
        applied.close()


def test_no_socket_is_a_clear_error(tmp_path: Path) -> None:
    backend = SpdkBackend(socket_path=str(tmp_path / "absent.sock"))
    with pytest.raises(Exception, match=r"no SPDK RPC socket at .*absent\.sock: is spdk_tgt running"):
        backend.plan_up(production())
