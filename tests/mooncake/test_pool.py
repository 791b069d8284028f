"""kvtool pool and the Mooncake client against a real master on loopback."""

from __future__ import annotations

import os
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvtool.errors import UsageError
from kvtool.mooncake import parse_mooncake_url
from tests.conftest import run, run_json

pytestmark = [pytest.mark.integration, pytest.mark.mooncake]


def test_url_forms() -> None:
    u = parse_mooncake_url("mooncake://127.0.0.1:50051")
    assert (u.master, u.metadata_url) == ("127.0.0.1:50051", "http://127.0.0.1:8080/metadata")
    u = parse_mooncake_url("mooncake://127.0.0.1:5/?metadata=127.0.0.1:7")
    assert u.metadata_url == "http://127.0.0.1:7/metadata" and str(u).endswith("metadata=127.0.0.1:7")
    for bad in ("mooncake://host", "mooncake://h:0", "mooncake://h:1?x=1", "http://h:1"):
        with pytest.raises(UsageError):
            parse_mooncake_url(bad)


def test_status_up_idempotent_and_url(pool: dict[str, Any]) -> None:
    assert pool["running"] and pool["changed"]
    doc = run_json("pool", "status", "--name", "t")
    assert doc["running"] and doc["url"] == pool["url"]
    assert doc["master"]["port"] == pool["ports"][0]
    rpc, meta, metrics = pool["ports"]
    again = run_json("pool", "up", "--name", "t", "--rpc-port", str(rpc),
                     "--metadata-port", str(meta), "--metrics-port", str(metrics))
    assert again["changed"] is False and again["master"]["pid"] == doc["master"]["pid"]
    with urllib.request.urlopen(doc["metrics_url"], timeout=5) as r:
        assert b"master_" in r.read()  # the master's own Prometheus metrics


def test_client_put_get_bytes_equal(pool: dict[str, Any]) -> None:
    from kvtool.mooncake.client import MooncakeClient

    size = 1_002_240  # a DeepSeek-V4-Flash FP8 block: not a multiple of 512
    objs = [np.frombuffer(os.urandom(size), dtype=np.uint8) for _ in range(6)]
    with MooncakeClient(pool["url"], segment_bytes=64 << 20, buffer_bytes=16 << 20) as c:
        for i, o in enumerate(objs):
            c.put(f"t/{i}", o)
        out = np.zeros(size, dtype=np.uint8)
        assert c.get_into("t/3", out) == size and np.array_equal(out, objs[3])
        c.register(out)  # zero-copy path
        assert c.get_into("t/5", out) == size and np.array_equal(out, objs[5])
        assert c.exists("t/0") and not c.exists("t/none")
        assert c.get_into("t/none", out) == 0
        c.remove("t/0")
        assert not c.exists("t/0")


def test_down_stops_processes(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("mooncake.store")
    from tests.conftest import free_port

    monkeypatch.setenv("KVTOOL_STATE_DIR", str(tmp_path))
    ports = [str(free_port()) for _ in range(3)]
    doc = run_json("pool", "up", "--name", "d", "--rpc-port", ports[0], "--metadata-port",
                   ports[1], "--metrics-port", ports[2])
    pids = [doc["master"]["pid"], doc["metadata"]["pid"]]
    assert run_json("pool", "down", "--name", "d")["changed"] is True
    for pid in pids:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            cmdline = b""  # gone
        assert b"mooncake" not in cmdline
    assert run_json("pool", "status", "--name", "d")["running"] is False
    assert run_json("pool", "down", "--name", "d")["changed"] is False


def test_port_in_use_is_exit_2(pool: dict[str, Any], monkeypatch: pytest.MonkeyPatch,
                               tmp_path: Any) -> None:
    monkeypatch.setenv("KVTOOL_STATE_DIR", str(tmp_path))
    result = run("pool", "up", "--name", "x", "--rpc-port", str(pool["ports"][0]))
    assert result.exit_code == 2 and "in use" in result.stderr


def test_mooncake_tier_protocol(pool: dict[str, Any]) -> None:
    """The DRAM tier on Mooncake: store, load byte-exact, miss, evict, capacity."""
    from kvtool.store.payload import Payload
    from kvtool.tiers.mooncake import MooncakeTier

    bb = 1_002_240
    p = Payload(bb, 3)
    src = []
    for k in range(40):
        a = np.empty(bb, dtype=np.uint8)
        p.fill(k, a)
        src.append(a)
    tier = MooncakeTier(pool["url"], slots=40, block_bytes=bb)
    try:
        tier.complete_store(tier.prepare_store(list(range(40)), src))  # 3 batches
        assert tier.lookup([0, 1, 2, 99, 3]) == 3 and len(tier) == 40
        dst = [np.zeros(bb, np.uint8) for _ in range(20)]
        keys = [39, 99, *range(18)]
        assert tier.complete_load(tier.prepare_load(keys, dst)) == [True, False] + [True] * 18
        assert np.array_equal(dst[0], src[39]) and all(
            np.array_equal(dst[i + 2], src[i]) for i in range(18))
        with pytest.raises(RuntimeError):
            tier.prepare_store([40], [src[0]])  # full
        tier.evict([5, 6])
        assert 5 not in tier and not tier.client.exists(tier.object_key(5))
        assert tier.complete_load(tier.prepare_load([5], dst[:1])) == [False]
        tier.prepare_store([5], [src[7]])  # a new block in a freed slot
        tier.prepare_store([5], [src[5]])  # re-put replaces
        assert tier.complete_load(tier.prepare_load([5], dst[:1])) == [True]
        assert np.array_equal(dst[0], src[5])
    finally:
        tier.close()


def test_no_pool_is_one_line_exit_2_at_once() -> None:
    pytest.importorskip("mooncake.store")
    from kvtool.mooncake.client import MooncakeClient, MooncakeError
    from tests.conftest import free_port

    with pytest.raises(MooncakeError, match="kvtool pool up"):
        MooncakeClient(f"mooncake://127.0.0.1:{free_port()}")


def test_replay_data_mode_with_the_dram_tier_on_mooncake(pool: dict[str, Any],
                                                         store_dir: Path) -> None:
    """kvtool replay in data mode, DRAM on the pool: same hits as --simulate, every block
    that arrived checked, nothing corrupt or lost."""
    from tests.conftest import FIXTURES

    trace = str(FIXTURES / "traces" / "multiturn-8x12.jsonl")
    sim = run_json("replay", trace, "--simulate", "--gpu", "8blk", "--dram", "24blk",
                   "--nvme", "inf", "--block-bytes", "65536")
    data = run_json("replay", trace, "--gpu", "8blk", "--dram", f"24blk@{pool['url']}",
                    "--nvme", f"512blk@{store_dir / 'nvme.img'}", "--block-bytes", "65536")
    assert data["mode"] == "data"
    assert [t["backend"] for t in data["tiers"]] == ["numpy", "mooncake", "objectstore"]
    assert data["tiers"][1]["url"] == pool["url"]
    assert [r["hit_tokens"] for r in data["rounds"]] == [r["hit_tokens"] for r in sim["rounds"]]
    assert data["put_blocks"] == sim["put_blocks"]
    assert data["promoted_blocks"] == sim["promoted_blocks"]
    assert data["hit_tokens"]["dram"] > 0 and data["verified_blocks"] > 0
    assert data["corrupt_blocks"] == 0 and data["lost_blocks"] == 0
    links = data["measured"]["links"]
    assert links["gpu<-dram"]["bytes"] > 0 and links["dram<-gpu"]["bytes"] > 0


def test_dram_url_without_a_size_contributes_the_default(pool: dict[str, Any],
                                                         store_dir: Path) -> None:
    from tests.conftest import FIXTURES

    doc = run_json("replay", str(FIXTURES / "traces" / "multiturn-8x12.jsonl"),
                   "--dram", pool["url"], "--nvme", f"256blk@{store_dir / 'n.img'}",
                   "--block-bytes", "65536")
    dram = doc["setup"]["configs"][0]["tiers"]["dram"]
    assert dram["place"] == pool["url"] and dram["blocks"] == (256 << 20) // 65536
    assert doc["tiers"][0]["backend"] == "mooncake" and doc["corrupt_blocks"] == 0


def test_experiment_with_dram_on_mooncake(pool: dict[str, Any], store_dir: Path,
                                          tmp_path: Path) -> None:
    doc = run_json("experiment", "run", "gp7000-read-path", "--dram", pool["url"],
                   "--scratch", str(store_dir), "--out", str(tmp_path / "o"))
    assert doc["mode"] == "data"
    dram = next(c for c in doc["configs"] if c["label"] == "DRAM tier")
    assert dram["tiers"][0]["backend"] == "mooncake" and dram["corrupt_blocks"] == 0
    rows = {r["metric"]: r for r in doc["rows"]}
    assert rows["load_ratio"]["measured"] is True and rows["load_ratio"]["kvtool"] > 0


def test_pool_documents_have_one_shape(pool: dict[str, Any], tmp_path: Path,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    up = run_json("pool", "status", "--name", "t")
    monkeypatch.setenv("KVTOOL_STATE_DIR", str(tmp_path))
    started = {k: v for k, v in pool.items() if k not in ("state", "ports")}  # the fixture's
    shapes = {frozenset(d) for d in (up, started, run_json("pool", "status", "--name", "none"),
                                     run_json("pool", "down", "--name", "none"))}
    assert len(shapes) == 1, shapes
    text = (Path(__file__).resolve().parents[2] / "docs" / "mooncake.md").read_text()
    assert all(k in text for k in up)
