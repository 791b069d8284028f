"""One bytes-per-block (docs/definitions.md) through every command that takes a model.

For a GQA model sharded over 8 ranks and an MLA model copied on 8 ranks, trace stats,
replay, plan, load, bench and audit must report the same block size, and a capacity of
N blocks' worth of bytes must hold N blocks in both replay and plan.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from kvtool.geometry import block_size
from tests.conftest import REPO, run, run_json

TRACE = str(REPO / "fixtures" / "traces" / "multiturn-8x12.jsonl")  # B = 256
N = 40  # blocks the DRAM tier is sized for

CASES = [
    # GQA: 8 KV heads split over 8 ranks, one rank stores 1/8 of a copy (t = 1)
    ("llama-3-70b", "bf16", 8, 83_886_080 // 8, 83_886_080, 1),
    # MLA: no heads to split, every rank stores a full copy (t = 8)
    ("deepseek-v4-flash", "fp8", 8, 1_002_240, 1_002_240, 8),
]


@pytest.mark.parametrize(("model", "dtype", "tp", "s", "copy", "t"), CASES)
def test_every_command_reports_one_block_size(model: str, dtype: str, tp: int, s: int,
                                              copy: int, t: int,
                                              blank_file: Callable[[int], Path]) -> None:
    size = block_size(model, dtype=dtype, tp=tp, block_tokens=256)
    assert size is not None
    assert (size.block_bytes, size.copy_bytes, size.per_rank_duplication) == (s, copy, t)
    assert size.all_ranks_bytes == s * tp
    expected = size.to_dict()
    geo = ["--model", model, "--dtype", dtype, "--tp", str(tp)]

    stats = run_json("trace", "stats", TRACE, *geo, "--no-reuse")
    assert stats["block_size"] == expected
    assert stats["unique_bytes"] == stats["unique_blocks"] * s

    dram = str(N * s)
    rep = run_json("replay", "--simulate", TRACE, *geo, "--dram", dram)
    assert rep["block_size"] == expected and rep["block_bytes"] == s
    by_blocks = run_json("replay", "--simulate", TRACE, "--dram", f"{N}blk")
    assert rep["tiers"][0]["capacity_blocks"] == N == by_blocks["tiers"][0]["capacity_blocks"]
    assert rep["hit_tokens"] == by_blocks["hit_tokens"]

    pl = run_json("plan", "--sessions", "8", "--input-tokens", "256", "--output-tokens", "256",
                  *geo, "--dram", dram)
    assert pl["storage"]["block_size"] == expected and pl["formula"]["terms"]["s"] == s
    assert pl["formula"]["terms"]["t"] == t
    assert pl["tiers"]["dram"]["blocks"] == N

    path = blank_file(64 << 20)
    ld = run_json("load", str(path), *geo, "--count", "1")
    assert ld["store"]["object_bytes"] == s
    assert ld["store"]["geometry"]["tp"] == tp

    bn = run_json("bench", str(path), *geo, "--force", "--pattern", "seq-write", "--qd", "1",
                  "--ops", "1", "--region", "32MiB")
    assert bn["object_bytes"] == s

    au = run_json("audit", *geo)
    assert au["geometry"]["block_bytes"] == s and au["geometry"]["copy_block_bytes"] == copy
    assert au["geometry"]["per_rank_duplication"] == t


def test_block_bytes_is_a_size_everywhere() -> None:
    a = run_json("replay", "--simulate", TRACE, "--block-bytes", "1MiB", "--dram", "40MiB")
    b = run_json("replay", "--simulate", TRACE, "--block-bytes", str(1 << 20), "--dram", "40blk")
    assert a["block_bytes"] == 1 << 20 and a["tiers"][0]["capacity_blocks"] == 40
    assert a["hit_tokens"] == b["hit_tokens"]
    assert a["block_size"]["tp"] == 1 and a["block_size"]["model"] is None


@pytest.mark.parametrize("command", [
    ["trace", "stats", TRACE], ["replay", "--simulate", TRACE, "--dram", "40blk"],
    ["plan", "--sessions", "8", "--input-tokens", "256", "--output-tokens", "256",
     "--dram", "40blk"],
])
@pytest.mark.parametrize(("extra", "field"), [
    (["--dtype", "fp8"], "--dtype"), (["--tp", "2"], "--tp"),
    (["--model", "llama-3-8b", "--block-bytes", "1MiB"], "--block-bytes"),
    (["--block-bytes", "0"], "--block-bytes"), (["--block-bytes", "12 parsecs"], "--block-bytes"),
])
def test_model_options_without_a_model_are_errors(command: list[str], extra: list[str],
                                                   field: str) -> None:
    result = run(*command, *extra)
    assert result.exit_code == 2, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and f"'{field}'" in lines[0], result.stderr
