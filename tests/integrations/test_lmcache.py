"""kvtool's LMCache plugin (kvtool.integrations.lmcache) under LMCache's own engine.

LMCache 0.5.6 runs in the engine virtualenv on CPU tensors (a stand-in GPU connector:
tests/integrations/scripts/lmcache_engine.py), with the plugin as its remote storage on
an O_DIRECT file and on kvtool's NVMe/TCP target with DH-HMAC-CHAP. Every engine run is a
fresh process; what it stored must be found by the next one. Every run also checks that
LMCache freed every memory object (``allocations``) and logged no reference-count warning.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO, free_port
from tests.helpers.engines import run_script, slot_offset
from tests.helpers.secret_search import search

pytestmark = [pytest.mark.slow, pytest.mark.integration]

SCRIPT = REPO / "tests" / "integrations" / "scripts" / "lmcache_engine.py"
CHUNK = 32
OBJECT_BYTES = 12288
"""One block: the 1 KiB header and a 32-token chunk of the test model (8 KiB), padded."""
HEADER_BYTES = 1024
PROMPTS = {"A": {"seed": 1, "tokens": 3 * CHUNK + 7},  # three full chunks and a partial one
           "B": {"seed": 2, "tokens": 4 * CHUNK},
           "C": {"seed": 3, "tokens": 2 * CHUNK},
           "D": {"seed": 4, "tokens": CHUNK}}
LEAKS = ("garbage collected", "Double free", "is negative", "was not called properly")
PLUGIN = "remote_storage_plugin.kvtool."
HOSTNQN = "nqn.2014-08.org.nvmexpress:uuid:6d1c2a2e-8f1e-4c44-9a37-lmcache00001"


class Run:
    """One engine process's results: ``run[i]`` is phase i's result."""

    def __init__(self, results: list[Any], log: str) -> None:
        self.results = results
        self.log = log

    def __getitem__(self, i: int) -> Any:
        return self.results[i][1]

    def find(self, *phase: Any) -> list[Any]:
        return [r for p, r, _x in self.results if p == list(phase)]


def engine(python: Path, tmp_path: Path, plugin: dict[str, Any], phases: list[list[Any]],
           config: dict[str, Any] | None = None, extra: dict[str, Any] | None = None,
           world_size: int = 1, name: str = "kvtool", class_name: str = "KvtoolConnector"
           ) -> Run:
    """Run ``phases`` in a fresh LMCache engine process (``plugin``: the
    ``remote_storage_plugin.kvtool.*`` keys; ``extra``: other ``extra_config`` keys);
    assert it ran them all, freed every memory object after each and logged no leaked or
    doubly freed reference."""
    n = len(list(tmp_path.glob("spec*.json")))
    spec, out = tmp_path / f"spec{n}.json", tmp_path / f"out{n}.json"
    extra = {**(extra or {}),
             **{f"remote_storage_plugin.{name}.{k}": v for k, v in plugin.items()}}
    spec.write_text(json.dumps({"extra": extra, "config": config or {}, "prompts": PROMPTS,
                                "phases": phases, "world_size": world_size, "plugin": name,
                                "class_name": class_name}))
    proc = run_script(python, SCRIPT, str(spec), str(out))
    assert proc.returncode == 0, proc.stdout[-6000:]
    results = json.loads(out.read_text())
    assert [p for p, _r, _x in results] == phases
    for p, _r, x in results:
        assert x["allocations"] == 0, f"memory objects left allocated after {p}"
    leaks = [ln for ln in proc.stdout.splitlines() if any(s in ln for s in LEAKS)]
    assert not leaks, leaks
    return Run(results, proc.stdout)


def report(run: Run, i: int = -1) -> dict[str, Any]:
    return [r for p, r, _x in run.results if p == ["report"]][i]


def nvme_tier(rep: dict[str, Any]) -> dict[str, Any]:
    return next(t for t in rep["store"]["tiers"] if t["name"] == "nvme")


# ---------------------------------------------------------------------- a file
def test_store_destroy_retrieve_and_reopen_in_new_processes(engine_python: Path,
                                                            store_dir: Path,
                                                            tmp_path: Path) -> None:
    place = store_dir / "kv.img"
    extra = {"url": f"8MiB@{place}", "metrics_port": 0}
    sync = {"use_exists_sync": True}  # LMCache's contains() calls exists_sync
    a = PROMPTS["A"]["tokens"]
    first = engine(engine_python, tmp_path, extra, extra=sync, phases=[
        ["store", "A"], ["report"], ["lookup", "A"], ["destroy"],
        ["build"], ["lookup", "A"], ["retrieve", "A"], ["keys", "A"], ["list"],
        ["exists_sync", "A"], ["nonblocking", "A", 2],
        ["collide", "C", "A"], ["lookup", "C"], ["retrieve", "C"],
        ["metrics"], ["report"]])
    stored = report(first, 0)
    assert stored["put_chunks"] == 4 and stored["errors"] == {}
    assert stored["put_bytes"] == a * 256  # 2 layers × K,V × 32 hidden × bf16 per token
    assert stored["object_bytes"] == OBJECT_BYTES
    assert nvme_tier(stored)["stored_blocks"] == 4
    # a new engine (a new plugin, reopening the file) finds every token; the bytes match,
    # the partial last chunk included, and nothing beyond the prompt is written
    assert first.find("lookup", "A") == [a, a]
    got = first.find("retrieve", "A")[0]
    assert got == {"tokens": a, "prefix": True, "match": True, "rest_untouched": True}
    keys = first.find("keys", "A")[0]
    assert first.find("list")[0] == sorted(k["key"] for k in keys)
    sync = first.find("exists_sync", "A")[0]
    assert sync["plugin"] == ["bool"] * 4 and sync["held"] == [True] * 4
    assert sync["lmcache_types"] == ["bool"] * 4 and sync["lmcache"] == [True] * 4
    assert first.find("nonblocking", "A", 2)[0] == {"served": 2}
    # a 64-bit key collision: the lookup finds a block, whose header names another key
    assert first.find("lookup", "C") == [CHUNK]
    assert first.find("retrieve", "C")[0]["tokens"] == 0
    rep = report(first)
    assert rep["mismatched_chunks"] == 1 and rep["errors"] == {}
    assert nvme_tier(rep)["reopened_blocks"] == 4
    metrics = "\n".join(first.find("metrics")[0])
    assert f'kvtool_lmcache_chunks_total{{plugin="kvtool",rank="0",result="hit"}} ' \
           f'{rep["hit_chunks"]}.0' in metrics
    assert 'kvtool_lmcache_tier_failed{plugin="kvtool",rank="0",tier="nvme"} 0.0' in metrics

    # a new process: the index is reopened from the medium; a removal is durable
    second = engine(engine_python, tmp_path, extra, [
        ["build"], ["lookup", "A"], ["retrieve", "A"], ["report"],
        ["clear", "A", CHUNK], ["lookup", "A"], ["list"], ["report"]])
    assert second.find("lookup", "A") == [a, 0]
    assert second.find("retrieve", "A")[0]["match"]
    assert second.find("retrieve", "A")[0]["tokens"] == a
    assert nvme_tier(report(second, 0))["reopened_blocks"] == 5  # A's 4, C's forged one
    assert second.find("clear", "A", CHUNK) == [1]
    assert keys[0]["key"] not in second.find("list")[0]
    assert report(second)["removed_chunks"] == 1

    third = engine(engine_python, tmp_path, extra, [
        ["build"], ["lookup", "A"], ["store", "A"], ["lookup", "A"], ["destroy"],
        ["build"], ["retrieve", "A"]])
    assert third.find("lookup", "A") == [0, a]  # removed for good, then stored again
    assert third.find("retrieve", "A")[0] == got


def test_a_full_store_evicts_least_recently_used(engine_python: Path, store_dir: Path,
                                                 tmp_path: Path) -> None:
    # room for 6 blocks: A's 4 and C's 2; A is read (a use), then D's one evicts C's head
    extra = {"url": f"{6 * OBJECT_BYTES}B@{store_dir / 'small.img'}"}
    a = PROMPTS["A"]["tokens"]
    run = engine(engine_python, tmp_path, extra, [
        ["store", "A"], ["store", "C"], ["retrieve", "A"], ["store", "D"], ["destroy"],
        ["build"], ["lookup", "A"], ["lookup", "C"], ["lookup", "D"], ["retrieve", "A"],
        ["report"]])
    assert run.find("lookup", "C") == [0]  # its head went: the least recently used
    assert run.find("lookup", "A") == [a]
    assert run.find("lookup", "D") == [CHUNK]
    assert all(r["match"] and r["tokens"] == a for r in run.find("retrieve", "A"))
    tier = nvme_tier(report(run))
    assert tier["reopened_blocks"] == 6 and tier["held_blocks"] == 6


def test_dram_pool_over_nvme_through_the_adapter(engine_python: Path, store_dir: Path,
                                                 tmp_path: Path) -> None:
    # KvtoolAdapter serves a plugin named kvtool.<instance>, configured under that name
    pool = Path(f"/dev/shm/kvtool-lmcache-test-{uuid.uuid4().hex[:8]}")
    extra = {"url": f"8MiB@{store_dir / 'kv.img'}", "dram": f"1MiB@{pool}"}
    try:
        run = engine(engine_python, tmp_path, extra,
                     [["store", "A"], ["destroy"], ["build"], ["retrieve", "A"], ["report"]],
                     name="kvtool.shm", class_name="KvtoolAdapter")
    finally:
        pool.unlink(missing_ok=True)
    assert report(run)["plugin"] == "kvtool.shm"
    assert run.find("retrieve", "A")[0]["match"]
    tiers = {t["name"]: t for t in report(run)["store"]["tiers"]}
    assert tiers["dram"]["reopened_blocks"] == 4 and tiers["dram"]["hit_blocks"] == 4
    assert tiers["nvme"]["reopened_blocks"] == 4 and tiers["nvme"]["hit_blocks"] == 0


@pytest.mark.parametrize(("plugin", "world_size", "error"), [
    ({"polcy": "lru"}, 1, f"field '{PLUGIN}polcy': unknown key 'polcy'"),
    ({"commit_interval": 1}, 1, f"field '{PLUGIN}commit_interval': each put is durable "
                                "when it returns: commit_interval is the vLLM connector's"),
    ({}, 2, f"field '{PLUGIN}url': world size 2: each rank needs its own namespace or pool "
            "file: put {rank} in the places"),
], ids=["unknown-key", "vllm-only-key", "ranks-share-a-place"])
def test_a_bad_config_is_one_error_line_and_no_backend(engine_python: Path, store_dir: Path,
                                                       tmp_path: Path, plugin: dict[str, Any],
                                                       world_size: int, error: str) -> None:
    run = engine(engine_python, tmp_path, {"url": f"8MiB@{store_dir / 'kv.img'}", **plugin},
                 [["build"]], world_size=world_size)
    assert run[0] == {"remote_backend": False}
    errors = [ln for ln in run.log.splitlines() if "kvtool LMCache plugin" in ln]
    assert len(errors) == 1 and "ERROR" in errors[0]
    assert "kvtool LMCache plugin kvtool cannot start (no chunk will be stored): " + error \
        in errors[0]
    assert not (store_dir / "kv.img").exists()  # nothing was created


# ---------------------------------------------------------------------- NVMe/TCP
class Target:
    """kvtool's NVMe/TCP target on a free port, DH-HMAC-CHAP both ways, on a file."""

    def __init__(self, directory: Path) -> None:
        from kvtool.target.keys import keygen

        self.backing = directory / "ns.img"
        self.host_key, self.ctrl_key = directory / "host.key", directory / "ctrl.key"
        keygen(self.host_key)
        keygen(self.ctrl_key)
        nqn = "nqn.2026-01.io.kvtool:lmcache"
        ready = directory / "target.ready"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "emulator.nvmetcp", "--listen", f"127.0.0.1:{free_port()}",
             "--nqn", nqn, "--backing", str(self.backing), "--size", "64MiB",
             "--host", HOSTNQN, "--dhchap-key", f"{HOSTNQN}={self.host_key}",
             "--dhchap-ctrl-key", f"{HOSTNQN}={self.ctrl_key}", "--busy-poll", "0",
             "--ready-file", str(ready)],
            cwd=REPO, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE)
        deadline = time.monotonic() + 30
        while not ready.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                err = self.proc.communicate()[1].decode(errors="replace")
                raise RuntimeError(f"the target did not start: {err}")
            time.sleep(0.05)
        self.url = json.loads(ready.read_text())["urls"][0] + "/1"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        if self.proc.stderr is not None:
            self.proc.stderr.close()


@pytest.fixture
def target(store_dir: Path) -> Iterator[Target]:
    t = Target(store_dir)
    try:
        yield t
    finally:
        t.stop()


def test_nvme_tcp_with_dhchap_corrupt_slot_and_target_down(engine_python: Path,
                                                           target: Target,
                                                           tmp_path: Path) -> None:
    extra = {"url": target.url, "hostnqn": HOSTNQN, "dhchap_secret": str(target.host_key),
             "dhchap_ctrl_secret": str(target.ctrl_key)}
    a = PROMPTS["A"]["tokens"]
    first = engine(engine_python, tmp_path, extra, [["store", "A"], ["keys", "A"],
                                                     ["report"]])
    assert report(first)["put_chunks"] == 4 and report(first)["errors"] == {}
    assert nvme_tier(report(first))["url"] == target.url

    # flip bytes of chunk 1's data on the target's medium, behind kvtool's back
    kid = first.find("keys", "A")[0][1]["id"]
    at = slot_offset(str(target.backing), kid) + HEADER_BYTES + 100
    fd = os.open(target.backing, os.O_RDWR)
    try:
        os.pwrite(fd, bytes(b ^ 0xFF for b in os.pread(fd, 8, at)), at)
        os.fsync(fd)
    finally:
        os.close(fd)

    second = engine(engine_python, tmp_path, extra, [
        ["build"], ["lookup", "A"], ["retrieve", "A"], ["store", "A"], ["report"],
        ["destroy"], ["build"], ["retrieve", "A"],
        ["kill", target.proc.pid], ["retrieve", "A"], ["store", "B"], ["lookup", "B"],
        ["lookup", "A"], ["report"]])
    # the corrupt chunk is a miss: only the chunk before it is served (LMCache recomputes
    # the rest); storing the prompt again rewrites the bad copy
    assert second.find("lookup", "A")[0] == a
    first_try, repaired, down = second.find("retrieve", "A")
    assert first_try == {"tokens": CHUNK, "prefix": True, "match": True,
                         "rest_untouched": True}
    rep = report(second, 0)
    assert rep["bad_chunks"] == 1 and rep["store"]["corrupt_blocks"] == 1
    assert rep["store"]["repaired_blocks"] == 1 and rep["errors"] == {}
    assert repaired == {"tokens": a, "prefix": True, "match": True, "rest_untouched": True}
    # the target is killed: misses, no exception into LMCache, stores go nowhere
    assert down["tokens"] == 0 and down["rest_untouched"]
    assert second.find("lookup", "B") == [0]
    assert second.find("lookup", "A")[1] == 0
    rep = report(second)
    assert nvme_tier(rep)["failed"] and rep["errors"] == {}
    # no secret in anything the engine logged
    key_files = {"host": target.host_key, "ctrl": target.ctrl_key}
    assert search({"log": (first.log + second.log).encode()}, key_files, HOSTNQN) == []
