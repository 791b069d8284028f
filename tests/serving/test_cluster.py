"""The cluster file: every fixture loads; defaults are vLLM's; errors name file, line and key."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from kvtool.errors import InputError
from kvtool.serving.gpus import resolve_gpu
from kvtool.serving.router import make_router
from kvtool.serving.topology import (
    DEFAULT_BLOCK_TOKENS,
    DEFAULT_GPU_MEMORY_UTILIZATION,
    ClusterSpec,
    load_cluster,
    parse_cluster,
    vllm_batch_defaults,
)
from kvtool.units import Capacity
from tests.conftest import FIXTURES

CLUSTERS = FIXTURES / "clusters"
SMALLEST = '[[engine]]\ngpu = "a100-sxm"\nmodel = "llama-2-7b"\ntp = 1\n'


def _load(tmp_path: Path, text: str, name: str = "c.toml") -> ClusterSpec:
    p = tmp_path / name
    p.write_text(text)
    return load_cluster(p)


def _error(tmp_path: Path, text: str) -> InputError:
    with pytest.raises(InputError) as info:
        _load(tmp_path, text)
    return info.value


def test_every_fixture_loads() -> None:
    files = sorted(CLUSTERS.glob("*.toml"))
    assert {f.name for f in files} >= {
        "a100-llama2.toml", "gp7000.toml", "gp7000-dram.toml", "fx100.toml",
        "fx100-recompute.toml", "wqs-400.toml", "wqs-800.toml"}
    for f in files:
        spec = load_cluster(f)
        assert spec.engines and spec.name
        make_router(spec.router.name, **spec.router.params)
        for e in spec.engines:
            assert e.num_gpu_blocks > 1
            assert e.node in {n.name for n in spec.nodes}


def test_the_smallest_file_takes_vllm_defaults(tmp_path: Path) -> None:
    spec = _load(tmp_path, SMALLEST, "tiny.toml")
    assert spec.name == "tiny" and spec.block_tokens == DEFAULT_BLOCK_TOKENS == 16
    assert spec.router.name == "round-robin" and not spec.pd
    assert spec.mooncake is None and spec.nvme is None
    (e,) = spec.engines
    (node,) = spec.nodes
    assert e.node == node.name and node.auto and math.isinf(node.nic_gbps) and node.dram is None
    assert (e.gpu.name, e.model.name, e.tp, e.dtype, e.kv_dtype, e.role) == \
        ("a100-sxm", "llama-2-7b", 1, "bf16", "bf16", "both")
    # vLLM 0.33 online serving on an A100 (EngineArgs.get_batch_defaults): 2048 / 256
    assert (e.max_num_batched_tokens, e.max_num_seqs) == (2048, 256)
    assert e.gpu_memory_utilization == DEFAULT_GPU_MEMORY_UTILIZATION == 0.92
    assert e.num_gpu_blocks_basis == "modelled"
    assert e.num_gpu_blocks == e.step.kv_pool_blocks(16, 0.92)
    # llama-2-7b bf16: 32 layers x 2 x 32 heads x 128 x 2 B = 512 KiB per token, 16 tokens
    assert e.block_bytes == e.all_ranks_block_bytes == 16 * 512 * 1024
    assert e.pcie_gbps == resolve_gpu("a100-sxm").pcie_gbps
    assert e.enable_prefix_caching


def test_vllm_batch_defaults_by_gpu() -> None:
    assert vllm_batch_defaults(resolve_gpu("a100-sxm")) == (2048, 256)    # "a100" excluded
    assert vllm_batch_defaults(resolve_gpu("h100-sxm")) == (8192, 1024)   # >= 70 GiB
    assert vllm_batch_defaults(resolve_gpu("h200-sxm")) == (8192, 1024)   # 141 GiB < 160
    assert vllm_batch_defaults(resolve_gpu("ascend-910b")) == (2048, 256)  # 64 GiB


def test_gp7000_fixture_as_the_report_describes() -> None:
    spec = load_cluster(CLUSTERS / "gp7000.toml")
    assert [e.name for e in spec.engines] == ["cx81-0", "cx81-1", "cx82-0", "cx82-1"]
    assert [e.node for e in spec.engines] == ["cx81", "cx81", "cx82", "cx82"]
    assert {(e.tp, e.kv_dtype, e.model.name, e.gpu.name) for e in spec.engines} == \
        {(4, "fp8", "deepseek-v4-flash", "rtx-6000d")}
    assert spec.gpus["rtx-6000d"].memory_bytes == int(83.6 * 2**30)
    assert spec.block_tokens == 256 and spec.router.name == "kv-aware"
    assert [n.nic_gbps for n in spec.nodes] == [25.0, 25.0]          # 200 Gb/s
    # the report's KV object: 1,002,240 B per 256-token block
    assert {e.block_bytes for e in spec.engines} == {1_002_240}
    assert spec.mooncake is not None and spec.nvme is not None
    assert spec.mooncake.capacity == Capacity(429_500_000_000 // 8, "bytes")
    assert spec.capacity_blocks(spec.mooncake.capacity) == 429_500_000_000 // 8 // 1_002_240
    assert spec.nvme.capacity == Capacity(46_090_000_000_000, "bytes")
    assert len(spec.nvme.targets) == 3
    dram = load_cluster(CLUSTERS / "gp7000-dram.toml")
    assert dram.nvme is None and dram.mooncake is not None
    assert dram.mooncake.capacity.value == 8 * spec.mooncake.capacity.value


def test_wqs_fixtures_differ_only_in_the_network() -> None:
    a, b = load_cluster(CLUSTERS / "wqs-400.toml"), load_cluster(CLUSTERS / "wqs-800.toml")
    assert [n.nic_gbps for n in a.nodes] == [50.0] and [n.nic_gbps for n in b.nodes] == [100.0]
    assert a.engines[0].to_dict() == b.engines[0].to_dict()
    assert a.nvme == b.nvme and a.nvme is not None
    assert sum(t.read_gbps for t in a.nvme.targets) == 180.0   # the report's 180 GB/s
    assert not a.engines[0].enable_prefix_caching              # the report turned it off


def test_fx100_pair_differs_only_in_the_tier() -> None:
    tier, plain = load_cluster(CLUSTERS / "fx100.toml"), load_cluster(CLUSTERS / "fx100-recompute.toml")
    assert tier.nvme is not None and plain.nvme is None and plain.mooncake is None
    assert tier.engines[0].to_dict() == plain.engines[0].to_dict()
    e = tier.engines[0]
    assert (e.tp, e.dtype, e.model.name) == (8, "fp8", "qwen3-coder-480b-a35b")


def test_full_schema(tmp_path: Path) -> None:
    spec = _load(tmp_path, """
name = "full"
block_tokens = 32
[router]
name = "kv-aware"
host_cache_hit_weight = 0.5
[gpu.big]
base = "h100-sxm"
memory_gib = 100
[[node]]
name = "n0"
gpus = 4
nic_gbps = 12.5
dram = "2000blk"
dram_policy = "radix"
pcie_gbps = 16
[[node]]
name = "n1"
nic_gbps = "inf"
[[engine]]
name = "p"
node = "n0"
count = 2
gpu = "big"
model = "llama-3-8b"
tp = 2
role = "prefill"
max_num_seqs = 8
max_num_batched_tokens = 4096
num_gpu_blocks = 1000
[[engine]]
node = "n1"
gpu = "h100-sxm"
model = "llama-3-8b"
role = "decode"
kv_dtype = "fp8"
gpu_memory_utilization = 0.5
[mooncake]
capacity = "100blk"
policy = "lru"
gbps = 40
[nvme]
capacity = "inf"
[[nvme.target]]
name = "a"
read_gbps = 3
write_gbps = 2
""".replace('kv_dtype = "fp8"\n', ""))
    assert spec.pd and spec.block_tokens == 32
    assert spec.router.name == "kv-aware" and dict(spec.router.params) == {"host_cache_hit_weight": 0.5}
    assert [e.name for e in spec.engines] == ["p-0", "p-1", "engine2"]
    p0, _, d = spec.engines
    assert (p0.role, p0.num_gpu_blocks, p0.num_gpu_blocks_basis, p0.max_num_seqs) == \
        ("prefill", 1000, "given", 8)
    assert p0.gpu.name == "big" and p0.pcie_gbps == 16 and p0.host_link_gbps == 32
    assert d.role == "decode" and d.gpu_memory_utilization == 0.5 and d.pcie_gbps == 64
    n0 = spec.node("n0")
    assert n0.dram == Capacity(2000, "blocks") and n0.dram_policy == "radix" and n0.gpus == 4
    assert math.isinf(spec.node("n1").nic_gbps)
    assert spec.mooncake is not None and spec.mooncake.gbps == 40
    assert spec.nvme is not None and spec.nvme.targets[0].write_gbps == 2
    assert math.isinf(spec.capacity_blocks(spec.nvme.capacity))
    doc = spec.to_dict()
    assert doc["nvme"]["blocks"] is None and doc["nodes"][0]["dram"]["blocks"] == 2000


def test_default_block_tokens_apply_only_when_the_file_gives_none(tmp_path: Path) -> None:
    p = tmp_path / "c.toml"
    p.write_text(SMALLEST)
    spec = load_cluster(p, default_block_tokens=64)
    (e,) = spec.engines
    assert spec.block_tokens == 64 and e.block_bytes == 64 * 512 * 1024
    assert e.num_gpu_blocks == e.step.kv_pool_blocks(64, 0.92)
    p.write_text("block_tokens = 32\n" + SMALLEST)
    assert load_cluster(p, default_block_tokens=64).block_tokens == 32


def test_parse_cluster_text() -> None:
    spec = parse_cluster(SMALLEST, source="inline.toml", name="inline")
    assert spec.name == "inline" and spec.source == "inline.toml"


@pytest.mark.parametrize(("text", "line", "field", "words"), [
    (SMALLEST + "colour = 1\n", 5, "engine[0].colour", "unknown key 'colour'"),
    ("colour = 1\n" + SMALLEST, 1, "colour", "unknown key 'colour'"),
    ('[[engine]]\ngpu = "a100-sxm"\nmodel = "llama-2-7b"\ntp = 3\n', 4, "engine[0].tp",
     "must divide"),
    ('[[engine]]\ngpu = "a100-sxm"\nmodel = "llama-9"\n', 3, "engine[0].model", "unknown model"),
    ('[[engine]]\ngpu = "b999"\nmodel = "llama-2-7b"\n', 2, "engine[0].gpu", "unknown GPU"),
    ('[[engine]]\nmodel = "llama-2-7b"\n', 1, "engine[0].gpu", "missing required key 'gpu'"),
    (SMALLEST + 'role = "prefill"\n', 1, "engine", "needs at least one 'decode'"),
    (SMALLEST + 'node = "x"\n', 5, "engine[0].node", "unknown node 'x'"),
    (SMALLEST + "count = 0\n", 5, "engine[0].count", "at least 1"),
    (SMALLEST + "enable_prefix_caching = 1\n", 5, "engine[0].enable_prefix_caching",
     "true or false"),
    (SMALLEST + "num_gpu_blocks = 100\ngpu_memory_utilization = 0.5\n", 6,
     "engine[0].gpu_memory_utilization", "not both"),
    (SMALLEST + "gpu_memory_utilization = 1.5\n", 5, "engine[0].gpu_memory_utilization",
     "(0, 1]"),
    ('[[engine]]\ngpu = "a100-sxm"\nmodel = "qwen3-coder-480b-a35b"\n', 1, "engine[0].tp",
     "no room"),
    ('router = "random"\n' + SMALLEST, 1, "router", "unknown router"),
    ('[router]\nname = "kv-aware"\ntemperature = 1\n' + SMALLEST, 3, "router.temperature",
     "unknown parameter"),
    ('[router]\nname = "least-loaded"\nweight = 1\n' + SMALLEST, 3, "router.weight",
     "takes no parameters"),
    ('[[node]]\nname = "n"\nnic_gbps = 0\n' + SMALLEST + 'node = "n"\n', 3, "node[0].nic_gbps",
     "bandwidth"),
    ('[[node]]\nname = "n"\ndram = "lots"\n' + SMALLEST + 'node = "n"\n', 3, "node[0].dram",
     "not a size"),
    ('[[node]]\nname = "n"\ngpus = 1\n' + SMALLEST + 'node = "n"\ncount = 2\n', 7,
     "engine[0].tp", "has 1 GPUs"),
    ('[[node]]\nname = "idle"\n' + SMALLEST, 2, "node[0].name", "has no engine"),
    (SMALLEST + '[mooncake]\npolicy = "lru"\n', 5, "mooncake.capacity", "missing required"),
    (SMALLEST + '[nvme]\ncapacity = "1TB"\n', 5, "nvme", "at least one [[nvme.target]]"),
    (SMALLEST + '[nvme]\ncapacity = "1TB"\n[[nvme.target]]\nread_gbps = -1\n', 8,
     "nvme.target[0].read_gbps", "bandwidth"),
    (SMALLEST + '[mooncake]\ncapacity = "1TB"\npolicy = "fifo"\n', 7, "mooncake.policy",
     "unknown policy"),
    (SMALLEST + SMALLEST.replace("llama-2-7b", "llama-3-8b"), 7, "engine[1].model",
     "same model"),
    ('[[gpu]]\nname = "x"\nbf16_tflops = 1\n' + SMALLEST, 1, "gpu[0].memory_gib", "required"),
    ("block_tokens = 100\n" + SMALLEST.replace("llama-2-7b", "deepseek-v4-flash")
     .replace('tp = 1', 'tp = 1\nkv_dtype = "fp8"'), 1, "block_tokens", "multiple of"),
    ('[[engine]]\ngpu = "a100-sxm"\nmodel = "llama-2-7b"\ntp = 1\nkv_dtype = "fp7"\n', 5,
     "engine[0].kv_dtype", "unknown dtype"),
])
def test_errors_name_file_line_and_key(tmp_path: Path, text: str, line: int, field: str,
                                       words: str) -> None:
    err = _error(tmp_path, text)
    assert err.file == str(tmp_path / "c.toml")
    assert err.field == field, str(err)
    assert err.line == line, str(err)
    assert words in err.message, str(err)
    assert str(err).startswith(f"{tmp_path / 'c.toml'}:{line}: field '{field}': ")


def test_capacity_in_bytes_needs_one_block_size(tmp_path: Path) -> None:
    two_tps = ('[[engine]]\ngpu = "h100-sxm"\nmodel = "llama-3-8b"\ntp = 1\n'
               '[[engine]]\ngpu = "h100-sxm"\nmodel = "llama-3-8b"\ntp = 2\n')
    err = _error(tmp_path, two_tps + '[mooncake]\ncapacity = "10GB"\n')
    assert err.field == "mooncake.capacity" and "ambiguous" in err.message
    spec = _load(tmp_path, two_tps + '[mooncake]\ncapacity = "1000blk"\n')
    assert spec.mooncake is not None and spec.capacity_blocks(spec.mooncake.capacity) == 1000


def test_json_cluster_files(tmp_path: Path) -> None:
    p = tmp_path / "c.json"
    p.write_text('{"engine": [{"gpu": "a100-sxm", "model": "llama-2-7b", "tp": 1,\n'
                 '  "max_num_seqs": 0}]}')
    with pytest.raises(InputError) as info:
        load_cluster(p)
    assert info.value.field == "engine[0].max_num_seqs" and info.value.line == 2


@pytest.mark.parametrize(("extra", "line", "field", "words"), [
    ("count = 0\n", 5, "engine[0].count", "must be at least 1"),
    ('[mooncake]\ncapacity = "1TB"\nsegment = "lots"\n', 7, "mooncake.segment", "size"),
    ('[connector]\nlookup_ms = -1\n', 6, "connector.lookup_ms", "milliseconds"),
])
def test_cli_reports_a_bad_cluster_field_as_file_line_field(tmp_path: Path, extra: str, line: int,
                                                            field: str, words: str) -> None:
    """The one config reader (issue 39): one line FILE:LINE: field 'F': …, exit 2."""
    from tests.conftest import run

    p = tmp_path / "c.toml"
    p.write_text(SMALLEST + extra)
    result = run("replay", str(FIXTURES / "traces" / "multiturn-4x6.tokens.jsonl"), "--simulate",
                 "--cluster", str(p))
    assert result.exit_code == 2
    (err,) = result.stderr.strip().splitlines()
    assert err.startswith(f"kvtool: error: {p}:{line}: field '{field}': "), err
    assert words in err and "Traceback" not in result.stderr
