"""``kvtool trace stats / gen / convert`` through the CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvtool.trace import read_trace
from kvtool.trace.stats import trace_stats
from tests.conftest import FIXTURES, REPO, run, run_json

MULTI = FIXTURES / "traces" / "multiturn-8x12.jsonl"
TOKENS = FIXTURES / "traces" / "multiturn-4x6.tokens.jsonl"


def test_stats_json_equals_the_library() -> None:
    doc = run_json("trace", "stats", str(MULTI))
    lib = trace_stats(read_trace(MULTI))
    for key, value in lib.items():
        assert doc[key] == value, key
    assert (doc["format"], doc["timed"], doc["bad_lines"]) == ("kvtool", False, [])
    assert (doc["sessions"], doc["rounds"], doc["requests"]) == (8, 12, 96)


def test_stats_human_output() -> None:
    result = run("trace", "stats", str(TOKENS))
    assert result.exit_code == 0, result.stderr
    out = result.stdout
    assert "max token hit ratio" in out and "reuse distance" in out and "per round" in out
    assert f"{trace_stats(read_trace(TOKENS))['max_token_hit_ratio']:.4f}" in out


def test_stats_with_model_footprint() -> None:
    doc = run_json("trace", "stats", str(MULTI), "--model", "deepseek-v4-flash", "--dtype", "fp8",
                   "--no-reuse")
    assert doc["unique_bytes"] == doc["unique_blocks"] * 1_002_240
    assert doc["reuse_distance"] is None
    doc = run_json("trace", "stats", str(MULTI), "--block-bytes", "1MiB")
    assert doc["unique_bytes"] == doc["unique_blocks"] * 2**20


def test_stats_on_mooncake_trace(mooncake_traces: Path) -> None:
    doc = run_json("trace", "stats", str(mooncake_traces / "conversation_trace.jsonl"),
                   "--format", "mooncake", "--block-tokens", "512", "--no-reuse")
    assert doc["max_token_hit_ratio"] == pytest.approx(0.3736237491291324, abs=1e-15)
    assert len(doc["per_round"]) == 59


def bad_trace(tmp_path: Path) -> Path:
    path = tmp_path / "bad.jsonl"
    path.write_text(
        '{"timestamp": 0, "input_length": 1000, "output_length": 5, "hash_ids": [1, 2]}\n'
        '{"timestamp": 1, "input_length": "lots", "output_length": 5, "hash_ids": [1]}\n'
        '{"timestamp": 2, "input_length": 1000, "output_length": 5, "hash_ids": [1, 3]}\n')
    return path


@pytest.mark.parametrize("cmd", [["stats"], ["convert", "--to", "kvtool", "-o", "OUT"]])
def test_bad_line_is_one_line_exit_2(tmp_path: Path, cmd: list[str]) -> None:
    path = bad_trace(tmp_path)
    args = [str(tmp_path / "out.jsonl") if a == "OUT" else a for a in cmd]
    result = run("trace", args[0], str(path), *args[1:])
    assert result.exit_code == 2
    assert result.stderr == (f"kvtool: error: {path}:2: field 'input_length': expected an "
                             'integer, got "lots"\n')
    assert result.stdout == ""
    assert not (tmp_path / "out.jsonl").exists()


def test_bad_line_in_a_real_process_has_no_traceback(tmp_path: Path) -> None:
    path = bad_trace(tmp_path)
    out = subprocess.run([sys.executable, "-m", "kvtool", "trace", "stats", str(path)],
                         capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        f"kvtool: error: {path}:2: field 'input_length': expected an integer, got \"lots\""]


def test_skip_bad_reports_skipped_lines(tmp_path: Path) -> None:
    deep = tmp_path / ("a-directory-with-a-long-name-" * 3)  # the line is wider than 80
    deep.mkdir()
    path = bad_trace(deep)
    result = run("--json", "trace", "stats", str(path), "--skip-bad", "1")
    assert result.exit_code == 0
    doc = json.loads(result.stdout)
    assert doc["requests"] == 2
    assert doc["bad_lines"] == [{"line": 2, "message":
                                 "field 'input_length': expected an integer, got \"lots\""}]
    # FILE:LINE: message stays one line, whatever the console's width
    assert f"  {path}:2: field 'input_length'" in result.stderr.splitlines()[1]


def test_missing_file_is_exit_2() -> None:
    result = run("trace", "stats", "/nonexistent/t.jsonl")
    assert result.exit_code == 2
    assert result.stderr == "kvtool: error: /nonexistent/t.jsonl: no such file\n"


def test_gen_multi_turn_and_read_back(tmp_path: Path) -> None:
    out = tmp_path / "t.jsonl"
    doc = run_json("trace", "gen", "--sessions", "3", "--rounds", "4", "--input-tokens", "100",
                   "--output-tokens", "20", "--system-prompt-tokens", "64", "--block-tokens",
                   "32", "--seed", "9", "-o", str(out))
    assert doc["requests"] == 12 and doc["workload"]["kind"] == "multi-turn"
    reqs = list(read_trace(out))
    assert [r.input_length for r in reqs[::3]] == [164, 284, 404, 524]
    again = tmp_path / "again.jsonl"
    run_json("trace", "gen", "--sessions", "3", "--rounds", "4", "--input-tokens", "100",
             "--output-tokens", "20", "--system-prompt-tokens", "64", "--block-tokens", "32",
             "--seed", "9", "-o", str(again))
    assert again.read_bytes() == out.read_bytes()


def test_gen_random_prompts(tmp_path: Path) -> None:
    out = tmp_path / "r.jsonl"
    doc = run_json("trace", "gen", "--random-input-len", "100,1000,10000", "--num-prompts", "2",
                   "--iterations", "3", "--seed", "1", "--format", "hash_ids", "-o", str(out))
    assert doc["requests"] == 18 and doc["workload"]["input_lengths"] == [100, 1000, 10000]
    stats = run_json("trace", "stats", str(out))
    assert stats["per_round"][1]["max_hit_tokens"] == 2 * (0 + 768 + 9984)


def test_gen_to_stdout(tmp_path: Path) -> None:
    result = run("trace", "gen", "--sessions", "1", "--rounds", "2", "--input-tokens", "5",
                 "--output-tokens", "1", "--format", "hash_ids", "-o", "-")
    assert result.exit_code == 0
    assert [json.loads(x)["round"] for x in result.stdout.splitlines()] == [1, 2]


@pytest.mark.parametrize(("args", "field"), [
    (["--sessions", "2", "--rounds", "2", "--input-tokens", "5"], "--output-tokens"),
    (["--rounds", "2", "--input-tokens", "5", "--output-tokens", "1"], "--sessions"),
    (["--random-input-len", "10", "--sessions", "2"], "--sessions"),
    (["--random-input-len", "10,abc"], "--random-input-len"),
    (["--sessions", "2", "--rounds", "2", "--input-tokens", "5", "--output-tokens", "1",
      "--iterations", "2"], "--iterations"),
    (["--sessions", "0", "--rounds", "2", "--input-tokens", "5", "--output-tokens", "1"],
     "--sessions"),
    (["--sessions", "2", "--rounds", "2", "--input-tokens", "5", "--output-tokens", "1",
      "--seed", "-1"], "--seed"),
    (["--sessions", "2", "--rounds", "2", "--input-tokens", "99999999999999999999",
      "--output-tokens", "1"], "--input-tokens"),
    (["--sessions", "2", "--rounds", "2", "--input-tokens", "5", "--output-tokens", "1",
      "--interval-ms", "inf"], "--interval-ms"),
    (["--random-input-len", "10", "--request-rate", "0"], "--request-rate"),
    (["--random-input-len", "10", "--request-rate", "2", "--interval-ms", "5"],
     "--request-rate"),
    (["--random-input-len", "10", "--burstiness", "2"], "--burstiness"),
    (["--random-input-len", "10", "--disable-shuffle"], "--disable-shuffle"),
    (["--prefix-repetition-num-prefixes", "10", "--num-prompts", "5"], "--num-prompts"),
    (["--random-input-len", "10", "--random-range-ratio", "1"], "--random-range-ratio"),
    (["--sessions", "2", "--rounds", "2", "--input-tokens", "5", "--output-tokens", "1",
      "--random-range-ratio", "0.5"], "--random-range-ratio"),
    (["--prefix-repetition-num-prefixes", "0"], "--prefix-repetition-num-prefixes"),
    (["--prefix-repetition-prefix-len", "-1"], "--prefix-repetition-prefix-len"),
    (["--prefix-repetition-suffix-len", "8", "--random-input-len", "10"],
     "--random-input-len"),
    (["--prefix-repetition-suffix-len", "8", "--system-prompt-tokens", "10"],
     "--system-prompt-tokens"),
])
def test_gen_usage_errors(tmp_path: Path, args: list[str], field: str) -> None:
    result = run("trace", "gen", *args, "-o", str(tmp_path / "t.jsonl"))
    assert result.exit_code == 2
    assert result.stderr.startswith(f"kvtool: error: field '{field}': ")
    assert not (tmp_path / "t.jsonl").exists()


def test_gen_to_a_directory_is_exit_2(tmp_path: Path) -> None:
    result = run("trace", "gen", "--sessions", "1", "--rounds", "1", "--input-tokens", "5",
                 "--output-tokens", "1", "-o", str(tmp_path))
    assert result.exit_code == 2
    assert result.stderr == f"kvtool: error: {tmp_path}: cannot write: Is a directory\n"
    assert list(tmp_path.iterdir()) == []


def test_convert_cli(tmp_path: Path) -> None:
    out = tmp_path / "mc.jsonl"
    result = run("--json", "trace", "convert", str(TOKENS), "--to", "mooncake", "-o", str(out))
    assert result.exit_code == 0
    doc = json.loads(result.stdout)
    assert doc["requests"] == 24 and doc["timestamps_added"] is True
    assert doc["read_back_block_tokens"] == 16
    assert "--block-tokens 16" in result.stderr
    back = run_json("trace", "stats", str(out), "--block-tokens", "16")
    assert back["max_hit_tokens"] == trace_stats(read_trace(TOKENS))["max_hit_tokens"]


def test_convert_refuses_to_overwrite_its_input(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_bytes(TOKENS.read_bytes())
    result = run("trace", "convert", str(path), "--to", "kvtool", "-o", str(path))
    assert result.exit_code == 2 and "--output" in result.stderr
    assert path.read_bytes() == TOKENS.read_bytes()


@pytest.mark.parametrize(("name", "args"), [
    ("multiturn-4x6.tokens.jsonl", "--sessions 4 --rounds 6 --input-tokens 16 --output-tokens 8 "
     "--system-prompt-tokens 32 --block-tokens 16 --seed 1"),
    ("multiturn-8x12.jsonl", "--sessions 8 --rounds 12 --input-tokens 1024 --output-tokens 256 "
     "--system-prompt-tokens 2048 --block-tokens 256 --seed 1 --format hash_ids"),
])
def test_fixture_traces_regenerate_byte_for_byte(tmp_path: Path, name: str, args: str) -> None:
    """The commands in fixtures/traces/README.md make exactly the committed files."""
    out = tmp_path / name
    run_json("trace", "gen", *args.split(), "-o", str(out))
    assert out.read_bytes() == (FIXTURES / "traces" / name).read_bytes()
    assert args in (FIXTURES / "traces" / "README.md").read_text()


def test_gen_fixed_length_poisson_then_stats(tmp_path: Path) -> None:
    out = tmp_path / "p.jsonl"
    doc = run_json("trace", "gen", "--random-input-len", "1024", "--output-tokens", "128",
                   "--num-prompts", "200", "--iterations", "1", "--request-rate", "2", "--seed",
                   "0", "--format", "hash_ids", "-o", str(out))
    assert (doc["requests"], doc["timed"]) == (200, True)
    assert doc["arrivals"] == {"interval_ms": None, "request_rate": 2.0, "burstiness": 1.0}
    stats = run_json("trace", "stats", str(out), "--no-reuse")
    assert (stats["requests"], stats["timed"], stats["duration_ms"] <= 100_000.0) == (
        200, True, True)
    assert (stats["input_tokens"], stats["output_tokens"], stats["max_hit_tokens"]) == (
        200 * 1024, 200 * 128, 0)
    ranged = run_json("trace", "gen", "--random-input-len", "1024", "--num-prompts", "50",
                      "--iterations", "1", "--random-range-ratio", "0.5", "--format", "hash_ids",
                      "-o", str(tmp_path / "r.jsonl"))
    assert ranged["workload"]["range_ratio"] == 0.5
    lengths = {r.input_length for r in read_trace(tmp_path / "r.jsonl")}
    assert len(lengths) > 10 and min(lengths) >= 512 and max(lengths) <= 1536
    burst = run_json("trace", "gen", "--random-input-len", "1024", "--num-prompts", "3",
                     "--iterations", "1", "--request-rate", "inf", "--random-prefix-len", "512",
                     "--format", "hash_ids", "-o", str(tmp_path / "b.jsonl"))
    assert burst["arrivals"]["request_rate"] == "inf" and burst["system_prompt_tokens"] == 512
    reqs = list(read_trace(tmp_path / "b.jsonl"))
    assert [r.timestamp for r in reqs] == [0.0, 0.0, 0.0]
    assert [r.input_length for r in reqs] == [1536] * 3
    assert reqs[0].block_keys[:2] == reqs[2].block_keys[:2] != reqs[0].block_keys[2:4]


def test_gen_prefix_repetition(tmp_path: Path) -> None:
    out = tmp_path / "pr.jsonl"
    doc = run_json("trace", "gen", "--prefix-repetition-num-prefixes", "4",
                   "--prefix-repetition-prefix-len", "512", "--prefix-repetition-suffix-len",
                   "100", "--num-prompts", "42", "--format", "hash_ids", "-o", str(out))
    assert doc["requests"] == 40
    assert doc["workload"] == {"kind": "prefix-repetition", "num_prompts": 42,
                               "num_prefixes": 4, "prefix_len": 512, "suffix_len": 100,
                               "output_tokens": 128, "shuffle": True}
    stats = run_json("trace", "stats", str(out), "--no-reuse")
    assert stats["max_hit_tokens"] == (40 - 4) * 512
    assert stats["sessions"] == 0 and stats["input_tokens"] == 40 * 612


@pytest.mark.parametrize(("fixture", "fmt", "requests", "sessions"), [
    ("azure-conv-head.csv", "azure", 40, 0), ("bailian-sample.jsonl", "bailian", 10, 5)])
def test_stats_on_the_other_formats(fixture: str, fmt: str, requests: int,
                                    sessions: int) -> None:
    doc = run_json("trace", "stats", str(FIXTURES / "traces" / fixture))
    assert (doc["format"], doc["timed"], doc["requests"], doc["sessions"]) == (
        fmt, True, requests, sessions)
    result = run("trace", "stats", str(FIXTURES / "traces" / fixture), "--format", fmt)
    # the title names the file: a long checkout path wraps it (at a space)
    assert result.exit_code == 0 and f"({fmt}, " in " ".join(result.stdout.split())


def test_bad_azure_row_is_one_line_exit_2(tmp_path: Path) -> None:
    path = tmp_path / "a.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.68,12,3\n"
                    "2023-11-16 18:15:47.01,n/a,3\n")
    result = run("trace", "stats", str(path))
    assert result.exit_code == 2
    assert result.stderr == (f"kvtool: error: {path}:3: field 'ContextTokens': expected an "
                             'integer, got "n/a"\n')


@pytest.mark.parametrize("to", ["bailian", "azure"])
def test_convert_cli_to_the_other_formats(tmp_path: Path, to: str) -> None:
    out = tmp_path / f"t.{to}"
    result = run("--json", "trace", "convert", str(MULTI), "--to", to, "--interval-ms", "100",
                 "-o", str(out))
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)
    assert (doc["to"], doc["requests"], doc["timestamps_added"]) == (to, 96, True)
    if to == "azure":
        assert doc["dropped"] == ["hash_ids", "session", "round"]
        assert "azure cannot carry hash_ids, session, round: dropped" in result.stderr
    else:
        assert doc["dropped"] == [] and doc["read_back_block_tokens"] == 256
        assert "--block-tokens 256 (bailian readers assume 16)" in result.stderr
    stats = run_json("trace", "stats", str(out), "--block-tokens", "256", "--no-reuse")
    assert (stats["format"], stats["requests"], stats["duration_ms"]) == (to, 96, 9500.0)


@pytest.mark.parametrize("fixture", ["azure-conv-head.csv", "bailian-sample.jsonl"])
def test_replay_reads_the_other_formats(fixture: str) -> None:
    """With room for every block, a replay hits exactly the infinite-cache maximum."""
    path = str(FIXTURES / "traces" / fixture)
    stats = run_json("trace", "stats", path, "--no-reuse")
    doc = run_json("replay", "--simulate", path, "--dram", "inf")
    assert (doc["format"], doc["requests"], doc["block_tokens"]) == (
        stats["format"], stats["requests"], stats["block_tokens"])
    assert doc["token_hit_ratio"] == stats["max_token_hit_ratio"]
