"""``kvtool replay`` through the CLI: JSON/CSV/plot outputs, --compare, --tiers, bad input."""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

import pytest

from tests.conftest import run, run_json
from tests.helpers.cache import write_multi_turn


@pytest.fixture
def trace(tmp_path: Path) -> Path:
    return write_multi_turn(tmp_path / "mt.jsonl", sessions=6, rounds=10, input_tokens=1024,
                            output_tokens=256, block_tokens=256, seed=2)


def test_json_summary_and_rounds(trace: Path) -> None:
    doc = run_json("replay", "--simulate", trace, "--dram", "180blk", "--block-bytes", "1002240")
    for key in ("token_hit_ratio", "hit_tokens", "recompute_tokens", "bytes_written",
                "bytes_read", "cliff_round", "rounds", "evictions", "ttft_p50_s", "ttft_p99_s",
                "wall_s", "requests_per_s", "tiers", "time_model", "bad_lines"):
        assert key in doc, key
    assert doc["times_are_modelled"] is True
    assert len(doc["rounds"]) == 10 and doc["rounds"][0]["round"] == 1
    for r in doc["rounds"]:
        for key in ("token_hit_ratio", "hit_tokens", "recompute_tokens", "bytes_written",
                    "bytes_read"):
            assert key in r
    assert doc["bytes_written"]["dram"] == doc["blocks_written"]["dram"] * 1002240
    assert doc["hit_tokens"]["total"] + doc["recompute_tokens"] == doc["input_tokens"]
    assert doc["cliff_round"] is not None


def test_capacity_units_agree(trace: Path) -> None:
    a = run_json("replay", "--simulate", trace, "--dram", "100blk")
    b = run_json("replay", "--simulate", trace, "--dram", "25600tok")
    c = run_json("replay", "--simulate", trace, "--dram", "1024000B", "--block-bytes", "10240")
    assert a["token_hit_ratio"] == b["token_hit_ratio"] == c["token_hit_ratio"]
    assert c["tiers"][0]["capacity_blocks"] == 100


def test_model_gives_bytes_per_block(trace: Path) -> None:
    doc = run_json("replay", "--simulate", trace, "--dram", "1GB", "--model", "deepseek-v4-flash",
                   "--dtype", "fp8")
    assert doc["block_bytes"] == 1002240
    assert doc["tiers"][0]["capacity_blocks"] == 10**9 // 1002240


def test_three_tiers_and_write_back(trace: Path) -> None:
    doc = run_json("replay", "--simulate", trace, "--gpu", "20blk", "--dram", "60blk", "--nvme", "inf",
                   "--write-policy", "write-back", "--policy", "lru-tail-first")
    assert [t["name"] for t in doc["tiers"]] == ["gpu", "dram", "nvme"]
    assert doc["write_policy"] == "write-back"
    assert all(t["policy"] == "lru-tail-first" for t in doc["tiers"])
    assert doc["hit_tokens"]["nvme"] > 0


def test_compare_side_by_side(trace: Path) -> None:
    doc = run_json("replay", "--simulate", trace, "--compare", "dram=180blk,label=DRAM only",
                   "--compare", "dram=22blk,nvme=inf,label=DRAM/8 + NVMe",
                   "--compare", "dram=180blk,policy=prefix-fair")
    labels = [c["label"] for c in doc["configs"]]
    assert labels[:2] == ["DRAM only", "DRAM/8 + NVMe"]
    only, tiered, fair = doc["configs"]
    assert tiered["token_hit_ratio"] > only["token_hit_ratio"]
    assert fair["tiers"][0]["policy"] == "prefix-fair"


def test_human_output_has_round_table(trace: Path) -> None:
    result = run("replay", "--simulate", trace, "--dram", "180blk")
    assert result.exit_code == 0, result.stderr
    assert "cliff" in result.stdout and "simulated" in result.stdout


def test_csv_and_plot(trace: Path, tmp_path: Path) -> None:
    csv_path, png = tmp_path / "r.csv", tmp_path / "r.png"
    doc = run_json("replay", "--simulate", trace, "--dram", "180blk", "--csv", csv_path, "--plot", png)
    rows = list(csv.DictReader(csv_path.open()))
    assert len(rows) == 10
    assert rows[0]["round"] == "1" and rows[0]["hit_tokens_gpu"] == ""
    assert float(rows[4]["token_hit_ratio"]) == pytest.approx(doc["rounds"][4]["token_hit_ratio"])
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and 5_000 < len(data) < 300_000


def test_requests_csv(trace: Path, tmp_path: Path) -> None:
    path = tmp_path / "req.csv"
    doc = run_json("replay", "--simulate", trace, "--compare", "dram=180blk,label=a",
                   "--compare", "gpu=10blk,dram=inf,label=b", "--requests-csv", path)
    rows = list(csv.DictReader(path.open()))
    assert len(rows) == 2 * 60
    for label, res in zip("ab", doc["configs"], strict=True):
        mine = [r for r in rows if r["config"] == label]
        assert sum(int(r["hit_tokens"]) for r in mine) == res["hit_tokens"]["total"]
        assert sum(int(r["recompute_tokens"]) for r in mine) == res["recompute_tokens"]
        assert sum(int(r["blocks_written_dram"]) for r in mine) == res["blocks_written"]["dram"]
    assert rows[-1]["round"] == "10" and rows[-1]["hit_tokens_gpu"] != ""


def test_plot_without_matplotlib_names_the_extra(trace: Path, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    result = run("replay", "--simulate", trace, "--dram", "10blk", "--plot", tmp_path / "x.png")
    assert result.exit_code == 2
    assert "kvtool[plot]" in result.stderr and "Traceback" not in result.stderr


def test_tiers_file(trace: Path, tmp_path: Path) -> None:
    toml = tmp_path / "tiers.toml"
    toml.write_text('write_policy = "write-back"\n[dram]\ncapacity = "60blk"\n'
                    'policy = "mooncake"\n[nvme]\ncapacity = "inf"\npolicy = "prefix-fair"\n'
                    'window = 16\n')
    doc = run_json("replay", "--simulate", trace, "--tiers", toml, "--engine-gpu", "a100-sxm",
                   "--concurrency", "4", "--read-gbps", "nvme=2.5")
    dram, nvme = doc["tiers"]
    assert (dram["policy"], dram["watermark"]) == ("mooncake", {"high": 0.9, "ratio": 0.05})
    assert nvme["policy"] == "prefix-fair" and nvme["window"] == 16
    assert doc["write_policy"] == "write-back"
    tm = doc["time_model"]
    assert (tm["gpu"], tm["concurrency"], tm["nvme_read_gbps"]) == ("a100-sxm", 4, 2.5)
    assert tm["basis"] == "simulated" and tm["serving"]["completed"] == doc["requests"]
    # the command line wins over the file
    doc2 = run_json("replay", "--simulate", trace, "--tiers", toml, "--dram", "30blk", "--policy", "lru")
    assert doc2["tiers"][0]["capacity_blocks"] == 30 and doc2["tiers"][0]["policy"] == "lru"


def test_bad_tiers_file_names_file_line_field(trace: Path, tmp_path: Path) -> None:
    toml = tmp_path / "tiers.toml"
    toml.write_text('[dram]\ncapacity = "60blk"\npolicy = "fifo"\n')
    result = run("replay", "--simulate", trace, "--tiers", toml)
    assert result.exit_code == 2
    assert f"{toml}:3: field 'dram.policy'" in result.stderr


@pytest.mark.parametrize(("line", "field"), [
    ('{"timestamp": 5, "input_length": 600, "output_length": 1, "hash_ids": [1, 2', None),
    ('{"timestamp": 5, "input_length": "many", "output_length": 1, "hash_ids": [1]}',
     "input_length"),
    ('{"timestamp": 5, "input_length": -3, "output_length": 1, "hash_ids": [1]}',
     "input_length"),
    ('{"timestamp": 5, "input_length": 600, "output_length": 1, "hash_ids": [1, 2, 3, 4]}',
     "hash_ids"),
    ('{"timestamp": 5, "input_length": 600, "output_length": 1, "hash_ids": [1, "x"]}',
     "hash_ids"),
])
def test_bad_trace_lines_exit_2_with_line_number(tmp_path: Path, line: str,
                                                 field: str | None) -> None:
    good = '{"timestamp": %d, "input_length": 600, "output_length": 1, "hash_ids": [1, 2]}'
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join([good % 1, good % 2, line, good % 9]) + "\n")
    result = run("replay", "--simulate", path, "--format", "mooncake", "--dram", "10blk")
    assert result.exit_code == 2
    err = result.stderr.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert f"{path}:3" in err
    if field:
        assert f"'{field}'" in err
    ok = run_json("replay", "--simulate", path, "--format", "mooncake", "--dram", "10blk", "--skip-bad", "1")
    assert [b["line"] for b in ok["bad_lines"]] == [3]
    assert ok["requests"] == 3


def test_a_bad_block_id_stops_a_replay_before_it_writes_a_file(tmp_path: Path) -> None:
    """``--simulate`` checks a sorted Mooncake trace's block ids as it reads them
    (``late_id_checks``), but not when it writes files while it runs: an --iolog or a
    --requests-csv replay meets the bad line before it creates either."""
    good = '{"timestamp": %d, "input_length": 600, "output_length": 1, "hash_ids": [1, 2]}'
    bad = '{"timestamp": 5, "input_length": 600, "output_length": 1, "hash_ids": [1, "x"]}'
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join([good % 1, good % 2, bad, good % 9]) + "\n")
    log, csv = tmp_path / "nvme.iolog", tmp_path / "requests.csv"
    for extra in (["--nvme", "20blk", "--block-bytes", "4096", "--iolog", str(log)],
                  ["--dram", "10blk", "--requests-csv", str(csv)]):
        result = run("replay", "--simulate", path, "--format", "mooncake", *extra)
        assert result.exit_code == 2, result.stderr
        assert f"{path}:3: field 'hash_ids'" in result.stderr
    assert not log.exists() and not csv.exists()


def test_bad_values_exit_2(trace: Path) -> None:
    for args, field in [(["--dram", "lots"], "--dram"),
                        (["--dram", "1GB"], "--dram"),          # bytes without a block size
                        (["--compare", "dram"], "--compare"),
                        (["--compare", "dram=1blk,colour=red"], "--compare"),
                        (["--dram", "1blk", "--read-gbps", "nvme=fast"], "--read-gbps"),
                        (["--dram", "1blk", "--evict-ratio", "0"], "--evict-ratio"),
                        (["--dram", "1blk", "--watermark", "nan"], "--watermark"),
                        (["--dram", "1blk", "--engine-gpu", "tpu-v9"], "--engine-gpu")]:
        result = run("replay", "--simulate", trace, *args)
        assert result.exit_code == 2, args
        assert result.stderr.startswith(f"kvtool: error: field '{field}': "), result.stderr
        assert len(result.stderr.splitlines()) == 1


CLUSTER = Path(__file__).resolve().parents[2] / "fixtures" / "clusters" / "gp7000-mini.toml"


@pytest.mark.parametrize(("args", "field"), [
    (["--policy", "lfu"], "--policy"), (["--dram", "24blk"], "--dram"),
    (["--write-policy", "write-back"], "--write-policy"), (["--watermark", "0.9"], "--watermark"),
    (["--model", "llama3-8b"], "--model"), (["--block-bytes", "1MiB"], "--block-bytes"),
    (["--engine-gpu", "h100-sxm"], "--engine-gpu"), (["--read-gbps", "nvme=3"], "--read-gbps"),
    (["--compare", "dram=1blk"], "--compare"), (["--no-times"], "--no-times"),
    (["--on-tier-error", "fail"], "--on-tier-error"), (["--iolog-version", "2"], "--iolog-version"),
    (["--metrics-port", "0"], "--metrics-port"), (["--nvme", "1GiB@/tmp/x.img"], "--nvme")])
def test_options_a_cluster_replay_would_ignore_are_refused(trace: Path, args: list[str],
                                                           field: str) -> None:
    """With --cluster the cluster file sets tiers, policies, model and links, and the serving
    model's run takes no --no-times, iolog or metrics: such an option is one line, exit 2,
    not silently ignored (as --policy was)."""
    result = run("replay", "--simulate", trace, "--cluster", CLUSTER, *args)
    assert result.exit_code == 2, (args, result.stdout)
    assert result.stderr.startswith(f"kvtool: error: field '{field}': "), result.stderr
    assert len(result.stderr.splitlines()) == 1


def test_options_a_cluster_replay_takes_still_work(trace: Path) -> None:
    ok = run("replay", "--simulate", trace, "--cluster", CLUSTER, "--read-qd", "4",
             "--seed", "3", "--concurrency", "2")
    assert ok.exit_code == 0, ok.stderr


def test_binary_tiers_file_is_exit_2(trace: Path, tmp_path: Path) -> None:
    toml = tmp_path / "tiers.toml"
    toml.write_bytes(b'[dram]\ncapacity = "\xff"\n')
    result = run("replay", "--simulate", trace, "--tiers", toml)
    assert result.exit_code == 2
    assert result.stderr == f"kvtool: error: {toml}: not UTF-8 text (byte 19)\n"


@pytest.mark.parametrize("time", ["prefill_tokens_per_s = 5000", "tpot_ms = 20",
                                  "concurrency = 4", "read_gbps = { nvme = 2.5 }"])
def test_retired_time_table_is_one_line_naming_the_replacement(trace: Path, tmp_path: Path,
                                                               time: str) -> None:
    """The replay time model was retired (issue 38): a [time] table says what replaces it."""
    toml = tmp_path / "tiers.toml"
    toml.write_text(f'[dram]\ncapacity = "60blk"\n[time]\n{time}\n')
    result = run("replay", "--simulate", trace, "--tiers", toml)
    assert result.exit_code == 2, result.stderr
    err = result.stderr
    assert err.startswith(f"kvtool: error: {toml}:3: field 'time': the [time] table was retired")
    assert err.count("\n") == 1 and "--concurrency" in err and "--cluster" in err


def test_mooncake_trace_replays(mooncake_traces: Path) -> None:
    doc = run_json("replay", "--simulate", mooncake_traces / "synthetic_trace.jsonl", "--format", "mooncake",
                   "--block-tokens", "512", "--dram", "inf")
    assert doc["round_kind"] in ("window", "none") and doc["cliff_round"] is None
    assert doc["token_hit_ratio"] == pytest.approx(0.6512444360312151, rel=1e-12)
    json.dumps(doc)


def test_simulate_without_tier_options_uses_the_data_mode_profile(trace: Path) -> None:
    """No tier options: the data-mode default profile (and model), counted, and said."""
    from kvtool.target import default

    r = run("replay", "--simulate", str(trace))
    assert r.exit_code == 0, r.stderr
    assert "data-mode default profile" in " ".join(r.stderr.split())
    doc = run_json("replay", "--simulate", str(trace))
    assert doc["setup"]["defaults"] is True and doc["block_bytes"] == 1002240
    tiers = {t["name"]: t for t in doc["tiers"]}
    assert [tiers[n]["policy"] for n in ("gpu", "dram", "nvme")] == ["vllm", "lru", "lru"]
    assert tiers["nvme"]["capacity_blocks"] == default.NAMESPACE_BYTES // 1002240
    assert tiers["dram"]["capacity_blocks"] == (256 << 20) // 1002240
