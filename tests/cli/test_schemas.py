"""Every JSON schema has one shape: the same top-level keys on every path (normal, sampled,
damaged, with and without a block size), each documented on its docs/ page."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import FIXTURES, REPO, run, run_json

SCHEMAS: dict[str, tuple[str, set[str]]] = {
    "kvtool.audit/1": ("audit.md", {
        "schema", "ok", "checks", "device", "failures", "geometry", "layouts", "lbas",
        "mem_align", "object_layout", "objects"}),
    "kvtool.plan/1": ("plan.md", {
        "schema", "workload", "storage", "formula", "collapse_round", "eviction_round",
        "cliff_round", "capacity_needed", "tiers", "steady_hit_ratio", "scenarios", "rounds"}),
    "kvtool.plan-trace/1": ("plan.md", {
        "schema", "trace", "format", "block_size", "policy", "method", "exact", "sample_rate",
        "requests", "input_tokens", "block_accesses", "block_tokens", "block_bytes",
        "unique_blocks", "max_token_hit_ratio", "full", "targets", "curve", "bad_lines",
        "one_pass"}),
    "kvtool.trace.stats/1": ("trace.md", {
        "schema", "trace", "format", "timed", "window_ms", "block_tokens", "block_size",
        "requests", "sessions", "rounds", "duration_ms", "input_tokens", "output_tokens",
        "input_length", "block_accesses", "unique_blocks", "unique_bytes", "max_hit_tokens",
        "max_token_hit_ratio", "max_block_hit_ratio", "per_round", "reuse_distance",
        "bad_lines"}),
    "kvtool.trace.gen/1": ("trace.md", {
        "schema", "output", "requests", "form", "block_tokens", "system_prompt_tokens", "seed",
        "timed", "arrivals", "workload"}),
    "kvtool.trace.convert/1": ("trace.md", {
        "schema", "input", "output", "to", "requests", "block_tokens", "timestamps_added",
        "read_back_block_tokens", "dropped", "bad_lines"}),
    "kvtool.serving/1": ("serving.md", {
        "schema", "mode", "trace", "format", "block_tokens", "requests", "timed", "clusters",
        "loads", "runs", "bad_lines", "serving"}),
    "kvtool.store.load/1": ("store.md", {
        "schema", "target", "engine", "store", "formatted", "replaced", "requested",
        "already_present", "written", "objects", "free_slots", "commits",
        "objects_per_commit", "bytes_written", "padded_bytes_written", "seconds", "gb_per_s",
        "objects_per_s", "qd", "io_path"}),
    "kvtool.store.verify/1": ("store.md", {
        "schema", "target", "ok", "store", "engine", "objects_indexed", "objects_checked",
        "content_checked", "sampled", "bytes_checked", "seconds", "gb_per_s", "objects_per_s",
        "qd", "bad", "index"}),
    "kvtool.store.inspect/1": ("store.md", {
        "schema", "target", "engine", "superblock", "superblock_error", "index", "problems",
        "objects"}),
    "kvtool.store.bench/2": ("store.md", {
        "schema", "target", "engine", "object_bytes", "region_bytes", "seconds_per_case",
        "repeat", "wrote", "interrupted", "results", "bounce_cost", "verdicts"}),
    "kvtool.calibrate/1": ("serving.md", {
        "schema", "cluster", "block_tokens", "files", "fit", "fixed", "metrics", "bounds",
        "start", "scalars", "scalars_basis", "optimiser", "sensitivity", "in_sample",
        "held_out", "replay_flags", "basis"}),
}
REPLAY_HEAD = {"schema", "trace", "format", "block_tokens", "block_bytes", "block_size",
               "bad_lines", "mode", "setup", "interrupted"}


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([b ^ 0xFF]))


def _json(*args: str) -> Any:
    import json

    result = run("--json", *args)
    assert result.exit_code in (0, 1), result.stderr
    return json.loads(result.stdout)


@pytest.fixture
def documents(blank_file: Callable[[int], Path], tmp_path: Path) -> list[dict[str, Any]]:
    trace = str(FIXTURES / "traces" / "multiturn-8x12.jsonl")
    gen = str(tmp_path / "g.jsonl")
    docs = [
        run_json("audit", "--object-bytes", "1002240"),
        run_json("audit", "--model", "llama-3-8b", "--layout", "layer"),
        run_json("plan", "--sessions", "4", "--input-tokens", "512", "--output-tokens", "256",
                 "--dram", "64blk"),
        run_json("plan", "--sessions", "4", "--input-tokens", "512", "--output-tokens", "256",
                 "--dram", "1GB", "--model", "llama-3-8b", "--nvme", "10GB"),
        run_json("plan", trace),
        run_json("plan", trace, "--model", "deepseek-v4-flash", "--sample-limit", "20"),
        run_json("plan", trace, "--sweep", "3"),
        run_json("trace", "stats", trace),
        run_json("trace", "stats", trace, "--model", "deepseek-v4-flash", "--no-reuse"),
        run_json("trace", "gen", "--sessions", "2", "--rounds", "2", "--input-tokens", "100",
                 "--output-tokens", "10", "-o", gen),
        run_json("trace", "gen", "--random-input-len", "100,200", "--num-prompts", "2",
                 "-o", gen + ".r"),
        run_json("trace", "convert", gen, "--to", "mooncake", "-o", str(tmp_path / "m.jsonl")),
        run_json("replay", trace, "--simulate", "--cluster",
                 str(FIXTURES / "clusters" / "a100-llama2.toml")),
        run_json("replay", trace, "--simulate", "--cluster",
                 str(FIXTURES / "clusters" / "a100-llama2.toml"), "--sweep", "concurrency=1,2"),
    ]
    bench = FIXTURES / "vllm-bench"
    docs.append(run_json("calibrate", str(FIXTURES / "clusters" / "a100-llama2.toml"),
                         str(bench / "a100-llama2-c1.json"), str(bench / "a100-llama2-c16.json"),
                         "--fit", "eta", "--max-evals", "20"))
    path = blank_file(8 << 20)
    docs.append(run_json("load", str(path), "--object-bytes", "4096", "--count", "3"))
    docs.append(run_json("load", str(path), "--object-bytes", "4096", "--count", "3"))
    docs.append(run_json("verify", str(path)))
    docs.append(run_json("verify", str(path), "--sample", "1", "--checksums-only"))
    docs.append(run_json("store", "inspect", str(path), "--objects", "2"))
    docs.append(run_json("bench", str(path), "--object-bytes", "4096", "--seconds", "0.01",
                         "--qd", "1", "--pattern", "seq-read"))
    _flip(path, 100)  # a damaged superblock: the same documents, with nulls
    docs.append(_json("verify", str(path)))
    docs.append(_json("store", "inspect", str(path)))
    return docs


def test_every_schema_has_one_shape(documents: list[dict[str, Any]]) -> None:
    seen = set()
    for doc in documents:
        schema = doc["schema"]
        seen.add(schema)
        assert set(doc) == SCHEMAS[schema][1], (schema, set(doc) ^ SCHEMAS[schema][1])
    assert seen == set(SCHEMAS)
    damaged = documents[-2]
    assert damaged["store"] is None and damaged["bad"][0]["check"] == "superblock"


def _replay_shapes(mode: list[str]) -> tuple[set[str], set[str], set[str], set[str]]:
    trace = str(FIXTURES / "traces" / "multiturn-8x12.jsonl")
    one = run_json("replay", *mode, trace, "--dram", "10blk", "--block-bytes", "4096")
    many = run_json("replay", *mode, trace, "--block-bytes", "4096", "--compare", "dram=10blk",
                    "--compare", "dram=20blk")
    head = set(many) - {"configs"}
    per_config = set(many["configs"][0])
    assert head >= REPLAY_HEAD and "configs" in many
    assert set(one) == head | per_config, set(one) ^ (head | per_config)
    for config in many["configs"]:
        assert set(config) == per_config
    rounds = {frozenset(r) for c in [one, *many["configs"]] for r in c["rounds"]}
    assert len(rounds) == 1
    return set(one), head, per_config, next(iter(rounds))


def test_replay_has_two_documented_shapes() -> None:
    """One configuration: the head and its results in one object; several: the head and a
    list of configurations, each with the same keys as the single case's results. Data mode
    and --simulate have the same shape (data-only fields are null in --simulate)."""
    assert _replay_shapes(["--simulate"]) == _replay_shapes([])


@pytest.mark.parametrize("schema", sorted(SCHEMAS))
def test_every_key_is_documented(schema: str) -> None:
    page, keys = SCHEMAS[schema]
    text = (REPO / "docs" / page).read_text()
    assert schema in text
    missing = [k for k in sorted(keys) if not re.search(rf"\b{k}\b", text)]
    assert not missing, f"docs/{page} does not mention {missing}"


def test_the_library_builds_every_document() -> None:
    """docs/architecture.md: commands render what the library returns; no module under
    kvtool/cli names a schema (so no document is assembled there)."""
    found = [f"{p.relative_to(REPO)}:{n}" for p in sorted((REPO / "kvtool" / "cli").glob("*.py"))
             for n, line in enumerate(p.read_text().splitlines(), 1)
             if re.search(r"""["']schema["']\s*:""", line)]
    assert not found, f"documents assembled in the CLI: {found}"
