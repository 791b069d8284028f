"""``kvtool replay``'s default GPU tier (policy ``vllm``) is vLLM's pool, request by request.

A multi-turn trace (shared system prompt, sessions that come back) replays with
``--simulate --gpu Nblk``; each request's GPU hit tokens must equal what a
:class:`~kvtool.serving.kvpool.KVPool` of ``N`` blocks gives when the same prompts run
alone, one after another, and (when vllm is installed) what vLLM's own
``KVCacheManager`` gives.
"""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from kvtool.serving.kvpool import KVPool
from tests.conftest import run_json
from tests.helpers.cache import requests_of, write_multi_turn
from tests.helpers.vllm_oracle import Seq, block_hasher_for, key_bytes, load_vllm_core

B = 16


@pytest.fixture(scope="module")
def trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("kvpool") / "multi_turn.jsonl"
    # 12 sessions × 6 rounds; rounds end mid-block and on block boundaries (16 | 32+48)
    return write_multi_turn(path, sessions=12, rounds=6, input_tokens=40, output_tokens=8,
                            system_prompt_tokens=32, block_tokens=B)


def pool_hits(trace: Path, num_blocks: int) -> list[int]:
    """Each request run alone on a KVPool, in serve order: its hit tokens."""
    pool = KVPool(num_blocks, B)
    hits = []
    for i, r in enumerate(requests_of(trace)):
        L = r.input_length
        seq = Seq(f"r{i}", r.block_keys, L, B)
        blocks_needed = (L + B - 1) // B
        if blocks_needed >= num_blocks:   # vLLM would refuse it: the pool stays as it is
            hits.append(0)
            continue
        blocks, hit = pool.get_computed_blocks(seq)
        assert pool.allocate_slots(seq, L - hit, hit, blocks) is not None
        pool.free(seq)
        hits.append(hit)
    return hits


def replay_hits(trace: Path, tmp_path: Path, *extra: str) -> list[dict[str, str]]:
    """Per-request rows of ``kvtool replay --simulate --requests-csv``."""
    out = tmp_path / "requests.csv"
    run_json("replay", "--simulate", str(trace), "--block-tokens", str(B),
             "--requests-csv", str(out), *extra)
    with open(out) as f:
        return list(csv.DictReader(f))


def replay_gpu_hits(trace: Path, tmp_path: Path, *extra: str) -> list[int]:
    return [int(row["hit_tokens_gpu"]) for row in replay_hits(trace, tmp_path, *extra)]


@pytest.mark.parametrize("num_blocks", [12, 40, 200])
def test_replay_gpu_hits_equal_kvpool(trace: Path, tmp_path: Path, num_blocks: int) -> None:
    got = replay_gpu_hits(trace, tmp_path, "--gpu", f"{num_blocks}blk")
    want = pool_hits(trace, num_blocks)
    assert got == want
    assert any(want)                         # the sizes are not all trivial
    assert not all(h == r.input_length for h, r in zip(want, requests_of(trace), strict=True))


@pytest.mark.parametrize("dram", [None, "300blk"])
def test_replay_gpu_hits_equal_vllm(trace: Path, tmp_path: Path, dram: str | None) -> None:
    """vLLM's KVCacheManager, given the DRAM tier's hits as connector (external) tokens."""
    try:
        core = load_vllm_core()
    except ImportError as exc:  # pragma: no cover - depends on the environment
        pytest.skip(f"vLLM's code is not available ({exc})")
    num_blocks = 24
    rows = replay_hits(trace, tmp_path, "--gpu", f"{num_blocks}blk",
                       *(("--dram", dram) if dram else ()))
    mgr = core.make_manager(num_blocks, B, max_model_len=1 << 20)
    external = 0
    for i, (r, row) in enumerate(zip(requests_of(trace), rows, strict=True)):
        req = core.request.Request(
            f"r{i}", [0] * r.input_length, core.request.SamplingParams(max_tokens=1), None,
            block_hasher=block_hasher_for([key_bytes(k) for k in r.block_keys], B))
        blocks, hit, _ = mgr.get_computed_blocks(req)
        ext = int(row["hit_tokens_dram"]) if dram else 0
        external += ext
        new = mgr.allocate_slots(req, r.input_length - hit - ext, num_new_computed_tokens=hit,
                                 new_computed_blocks=blocks, num_external_computed_tokens=ext,
                                 full_sequence_must_fit=True)
        assert int(row["hit_tokens_gpu"]) == (hit if new is not None else 0), i
        if new is not None:
            mgr.free(req)
    assert external > 0 or dram is None


def test_gpu_blocks_are_vllm_num_gpu_blocks(trace: Path) -> None:
    doc = run_json("replay", "--simulate", str(trace), "--block-tokens", str(B), "--gpu", "40blk")
    [gpu] = doc["tiers"]
    assert gpu["policy"] == "vllm" and gpu["capacity_blocks"] == 40
    assert gpu["occupancy_blocks"] <= 39      # block 0 is the null block


@pytest.mark.parametrize("write_policy", ["write-through", "write-back"])
def test_data_mode_moves_bytes_as_the_simulation_counts(trace: Path, write_policy: str) -> None:
    """Data mode's GPU pool follows the vllm tier's hash index: same counts, verified bytes."""
    args = ["replay", str(trace), "--block-tokens", str(B), "--gpu", "24blk", "--dram", "100blk",
            "--write-policy", write_policy]
    sim = run_json(*args, "--simulate")
    data = run_json(*args, "--block-bytes", "4096")
    for key in ("hit_tokens", "evictions", "blocks_written", "promoted_blocks"):
        assert data[key] == sim[key], key
    assert sim["hit_tokens"]["gpu"] and sim["hit_tokens"]["dram"]
    assert data["verified_blocks"] > 0 and data["corrupt_blocks"] == 0 and data["lost_blocks"] == 0
