"""The roofline step time: hand-computed cases, MoE, TP all-reduce, monotonicity, KV pool."""

from __future__ import annotations

import math
import random

import pytest

from kvtool.errors import UsageError
from kvtool.geometry import lookup
from kvtool.geometry.model import ComponentSpec, ModelSpec
from kvtool.geometry.params import Architecture
from kvtool.serving.gpus import GPU, resolve_gpu
from kvtool.serving.roofline import OTHER_MEM_BYTES, Scalars, StepModel

# A tiny model with round numbers: 2 layers, 2 KV heads x 64 (MHA), 4 query heads,
# hidden 256, vocab 1000, 1,000,000 parameters (bf16).
TINY_ARCH = Architecture(hidden_size=256, q_heads=4, head_dim=64, vocab_size=1000,
                         total_params=1_000_000, active_params=1_000_000, source="test")


def _tiny(arch: Architecture = TINY_ARCH) -> ModelSpec:
    return ModelSpec(name="tiny", source="test", attention="mha", layers=2,
                     components=(ComponentSpec("kv", "kv", 2, elements=2 * 2 * 64),),
                     kv_heads=2, head_dim=64, arch=arch)


def _gpu(**kw: float) -> GPU:
    figures = {"bf16_tflops": 100.0, "hbm_gbps": 1000.0, "interconnect_gbps": 100.0,
               "pcie_gbps": 32.0, **kw}
    return GPU("test-gpu", fp8_tflops=None, memory_bytes=2**30, source="test", **figures)


SCALARS = Scalars(mfu_prefill=0.5, mfu_decode=0.25, eta=0.5, c0_s=1e-3)


def test_hand_computed_mixed_batch() -> None:
    """A prefill of 100 new tokens and one decode at context 50, written out."""
    step = StepModel(_tiny(), _gpu(), scalars=SCALARS)
    assert step.kv_bytes_per_token == 2 * 2 * 2 * 64 * 2  # 1024 B: K+V, 2 layers, bf16
    # attention pair FLOPs: 2·L·n_q·(d_qk + d_v) = 2·2·4·128 = 2048
    flops_prefill = 2 * 1_000_000 * 100 + 2048 * 100 * (0 + 100 / 2)      # 210,240,000
    flops_decode = 2 * 1_000_000 * 1 + 2048 * 1 * (50 + 1 / 2)            # 2,103,424
    t_compute = flops_prefill / (100e12 * 0.5) + flops_decode / (100e12 * 0.25)
    # weights read: all but the input embedding (1000 x 256), bf16; KV: (0+100) + (50+1) tokens
    nbytes = (1_000_000 - 256_000) * 2 + (100 + 51) * 1024                 # 1,642,624
    t_memory = nbytes / (1000e9 * 0.5)
    assert t_compute == pytest.approx(4.28893696e-6) and t_memory == pytest.approx(3.285248e-6)
    items = [(100, 0), (1, 50)]
    assert step.step_time(items) == pytest.approx(t_compute + 1e-3, rel=1e-12)
    b = step.breakdown(items)
    assert b["bound"] == "compute" and b["flops"] == pytest.approx(flops_prefill + flops_decode)
    assert b["bytes"] == pytest.approx(nbytes) and b["t_allreduce"] == 0 and b["c0"] == 1e-3
    assert b["t"] == pytest.approx(step.step_time(items), rel=1e-12)


def test_hand_computed_decode_is_memory_bound() -> None:
    step = StepModel(_tiny(), _gpu(), scalars=SCALARS)
    t_compute = (2 * 1_000_000 + 2048 * 1000.5) / (100e12 * 0.25)
    t_memory = (744_000 * 2 + 1001 * 1024) / (1000e9 * 0.5)               # 5.026048e-6
    assert t_memory > t_compute
    assert step.step_time([(1, 1000)]) == pytest.approx(5.026048e-6 + 1e-3, rel=1e-12)
    assert step.breakdown([(1, 1000)])["bound"] == "memory"


def test_sums_equal_items_and_empty_batch_is_free() -> None:
    step = StepModel(lookup("llama-3-8b"), resolve_gpu("h100-sxm"))
    items = [(512, 1000), (1, 300), (1, 7000), (64, 0)]
    pt, pw = 576, 512 * (1000 + 256) + 64 * 32
    sums = step.step_time_sums(pt, pw, 2, 300.5 + 7000.5, 1512 + 301 + 7001 + 64)
    assert sums == pytest.approx(step.step_time(items), rel=1e-12)
    assert step.step_time([]) == 0.0 and step.breakdown([])["t"] == 0.0
    assert step.prefill_time(1024, 2048) == step.step_time([(1024, 2048)])


def test_default_c0_is_3us_per_memory_bound_op() -> None:
    step = StepModel(lookup("llama-2-7b"), resolve_gpu("a100-sxm"))
    assert step.c0_s == pytest.approx(5 * 32 * 3e-6)


def test_tp_allreduce_by_hand() -> None:
    """TP 2: two all-reduces per layer of T·hidden·2 bytes, ring cost 2(t-1)/t."""
    step = StepModel(_tiny(), _gpu(), tp=2, scalars=SCALARS)
    assert step.kv_bytes_per_token == 512  # each rank holds one of the 2 KV heads
    b = step.breakdown([(100, 0), (1, 50)])
    per_allreduce = 10e-6 + 2 * (2 - 1) / 2 * (101 * 256 * 2) / 100e9
    assert b["t_allreduce"] == pytest.approx(2 * 2 * per_allreduce, rel=1e-12)
    assert b["flops"] == pytest.approx((210_240_000 + 2_103_424) / 2)
    assert b["t"] == pytest.approx(max(b["t_compute"], b["t_memory"]) + 1e-3 + b["t_allreduce"])
    slow = StepModel(_tiny(), _gpu(interconnect_gbps=10.0), tp=2, scalars=SCALARS)
    assert slow.step_time([(100, 0)]) > step.step_time([(100, 0)])


def test_tp_must_divide_query_heads() -> None:
    with pytest.raises(UsageError) as err:
        StepModel(lookup("qwen2.5-32b"), resolve_gpu("h100-sxm"), tp=16)  # 40 heads
    assert err.value.field == "tp"


MOE_ARCH = Architecture(
    hidden_size=256, q_heads=4, head_dim=64, vocab_size=1000, source="test",
    total_params=2_843_200, active_params=1_000_000, experts=8, experts_per_token=2,
    moe_intermediate_size=200, moe_layers=2)


def test_moe_uses_active_params_and_touches_expected_experts() -> None:
    arch = MOE_ARCH
    assert arch.expert_params == 3 * 256 * 200 and arch.routed_params == 2 * 8 * 153_600
    assert arch.shared_params == 1_000_000 - 2 * 2 * 153_600                # 385,600
    assert arch.expected_experts(1) == pytest.approx(2.0)
    assert arch.expected_experts(2) == pytest.approx(8 * (1 - (6 / 8) ** 2))  # 3.5
    step = StepModel(_tiny(arch), _gpu(), scalars=SCALARS)
    one = step.breakdown([(1, 0)])
    # FLOPs: the active parameters only, like a 2M dense model
    assert one["flops"] == pytest.approx(2 * 1_000_000 + 2048 * 0.5)
    # bytes: shared weights (less the input embedding) + 2 experts in each of 2 layers
    assert one["weight_bytes"] == pytest.approx((385_600 - 256_000 + 2 * 2 * 153_600) * 2)
    many = step.breakdown([(1, 0)] * 1000)
    assert many["weight_bytes"] == pytest.approx((385_600 - 256_000 + 2 * 8 * 153_600) * 2)
    # a dense model with the same total reads everything even for one token
    dense = Architecture(hidden_size=256, q_heads=4, head_dim=64, vocab_size=1000,
                         source="test", total_params=2_843_200, active_params=2_843_200)
    d = StepModel(_tiny(dense), _gpu(), scalars=SCALARS)
    assert d.step_time([(1, 0)]) > step.step_time([(1, 0)])


def test_moe_preset_decode_reads_a_fraction_of_the_weights() -> None:
    step = StepModel(lookup("qwen3-coder-480b-a35b"), resolve_gpu("h200-sxm"), tp=8)
    one = step.breakdown([(1, 1000)])["weight_bytes"]
    full = step.breakdown([(1, 1000)] * 4096)["weight_bytes"]
    assert one < 0.1 * full  # 8 of 160 experts vs nearly all
    assert full < step.weight_bytes_per_rank


def _random_batch(rng: random.Random) -> list[tuple[int, int]]:
    return [(rng.choice([1, 1, 1, rng.randint(2, 4096)]), rng.randint(0, 50_000))
            for _ in range(rng.randint(1, 40))]


PRESET_SETUPS = [("llama-2-7b", "a100-sxm", 1), ("qwen2.5-32b", "h20", 4),
                 ("qwen3-coder-480b-a35b", "h200-sxm", 8), ("deepseek-v4-flash", "rtx-pro-6000", 4),
                 ("deepseek-v3", "h200-sxm", 8)]


@pytest.mark.parametrize(("model", "gpu", "tp"), PRESET_SETUPS)
def test_more_tokens_are_never_faster(model: str, gpu: str, tp: int) -> None:
    step = StepModel(lookup(model), resolve_gpu(gpu), tp=tp)
    rng = random.Random(19)
    for _ in range(200):
        items = _random_batch(rng)
        t = step.step_time(items)
        i = rng.randrange(len(items))
        new, cached = items[i]
        more_new = [*items[:i], (new + rng.randint(1, 512), cached), *items[i + 1:]]
        more_ctx = [*items[:i], (new, cached + rng.randint(1, 4096)), *items[i + 1:]]
        more_seqs = [*items, (rng.choice([1, 300]), rng.randint(0, 9000))]
        for bigger in (more_new, more_ctx, more_seqs):
            assert step.step_time(bigger) >= t


@pytest.mark.parametrize(("model", "gpu", "tp"), PRESET_SETUPS)
def test_faster_hardware_is_never_slower(model: str, gpu: str, tp: int) -> None:
    spec, base = lookup(model), resolve_gpu(gpu)
    step = StepModel(spec, base, tp=tp)
    better = [GPU(base.name, base.bf16_tflops, base.fp8_tflops, base.memory_bytes,
                  base.hbm_gbps * 2, base.interconnect_gbps, base.pcie_gbps, "x"),
              GPU(base.name, base.bf16_tflops * 2, (base.fp8_tflops or 0) * 2 or None,
                  base.memory_bytes, base.hbm_gbps, base.interconnect_gbps, base.pcie_gbps, "x"),
              GPU(base.name, base.bf16_tflops, base.fp8_tflops, base.memory_bytes,
                  base.hbm_gbps, base.interconnect_gbps * 2, base.pcie_gbps, "x")]
    rng = random.Random(7)
    batches = [_random_batch(rng) for _ in range(100)]
    for g in better:
        faster = StepModel(spec, g, tp=tp)
        for items in batches:
            assert faster.step_time(items) <= step.step_time(items)
    hbm_only = StepModel(spec, better[0], tp=tp)
    assert any(hbm_only.step_time(b) < step.step_time(b) for b in batches)


def test_compressed_attention_grows_slower_with_context() -> None:
    """V4-Flash's compressed attention: a 100k prefill costs far less than full attention
    of the same shape would (its pair FLOPs are a few % of 2·L·n_q·(d+d))."""
    spec = lookup("deepseek-v4-flash")
    assert spec.arch is not None
    full = 2 * 43 * 64 * (512 + 512)
    assert spec.arch.pair_flops(43) < 0.05 * full
    step = StepModel(spec, resolve_gpu("h200-sxm"), tp=4)
    assert step.prefill_time(100_000) / step.prefill_time(1000) < 150


def test_kv_pool_blocks_by_hand() -> None:
    """Llama-2-7B on one A100-SXM 80 GB, 16-token blocks, 0.9 utilisation."""
    step = StepModel(lookup("llama-2-7b"), resolve_gpu("a100-sxm"))
    memory = 80 * 2**30                                    # 85,899,345,920
    weights = 6_738_415_616 * 2                            # counted params, bf16
    reserve = 3_758_096_384                                # AIConfigurator other_mem, TP 1
    block = 16 * 2 * 32 * 32 * 128 * 2                     # 8,388,608 B
    expected = (int(memory * 0.9) - weights - reserve) // block
    assert expected == 7161
    assert step.kv_pool_blocks(16) == 7161
    assert step.kv_pool_blocks(16, gpu_memory_utilization=0.5) < 7161
    assert step.reserve_bytes() == OTHER_MEM_BYTES


def test_kv_pool_blocks_tp_and_mla() -> None:
    spec, gpu = lookup("deepseek-v4-flash"), resolve_gpu("rtx-pro-6000")
    step = StepModel(spec, gpu, tp=4)
    # fp8 weights, fp4 experts, split over 4 ranks; MLA: every rank holds the full 1,002,240 B
    non_routed = 284_000_000_000 - 43 * 256 * 3 * 4096 * 2048
    weights = math.ceil((non_routed * 1 + 43 * 256 * 3 * 4096 * 2048 * 0.5) / 4)
    assert step.weight_bytes_per_rank == weights
    free = int(gpu.memory_bytes * 0.9) - weights - (3_758_096_384 + 411_041_792)
    assert step.kv_pool_blocks(256) == free // 1_002_240


def test_kv_pool_refuses_a_model_that_does_not_fit() -> None:
    with pytest.raises(UsageError) as err:
        StepModel(lookup("qwen3-coder-480b-a35b"), resolve_gpu("a100-sxm"), tp=1).kv_pool_blocks(16)
    assert err.value.field == "tp" and "no room" in err.value.message


def test_model_without_parameters_is_refused() -> None:
    spec = ModelSpec(name="kv-only", source="t", attention="mha", layers=2,
                     components=(ComponentSpec("kv", "kv", 2, elements=256),), kv_heads=2,
                     head_dim=64)
    with pytest.raises(UsageError) as err:
        StepModel(spec, resolve_gpu("h100-sxm"))
    assert err.value.field == "model"


@pytest.mark.parametrize(("kw", "field"), [({"mfu_prefill": 0}, "mfu_prefill"),
                                           ({"eta": 1.5}, "eta"), ({"c0_s": -1.0}, "c0_s")])
def test_bad_scalars_name_the_field(kw: dict[str, float], field: str) -> None:
    with pytest.raises(UsageError) as err:
        Scalars(**kw)
    assert err.value.field == field


def test_fp8_weights_use_the_fp8_peak_where_there_is_one() -> None:
    spec = lookup("llama-3-8b")
    h100, a100 = resolve_gpu("h100-sxm"), resolve_gpu("a100-sxm")
    prefill = [(4096, 0)]
    assert StepModel(spec, h100, weight_dtype="fp8").step_time(prefill) < \
        StepModel(spec, h100, weight_dtype="bf16").step_time(prefill)
    # A100 has no FP8 tensor cores: same compute, fewer bytes
    a8 = StepModel(spec, a100, weight_dtype="fp8").breakdown(prefill)
    a16 = StepModel(spec, a100, weight_dtype="bf16").breakdown(prefill)
    assert a8["t_compute"] == a16["t_compute"] and a8["weight_bytes"] < a16["weight_bytes"]
    with pytest.raises(UsageError) as err:
        StepModel(spec, h100, weight_dtype="fp7")
    assert err.value.field == "weight_dtype"


def test_expert_dtype_follows_the_checkpoint_unless_weights_are_changed() -> None:
    spec, gpu = lookup("deepseek-v4-flash"), resolve_gpu("h200-sxm")
    assert StepModel(spec, gpu, tp=4).expert_weight_dtype == "fp4"
    assert StepModel(spec, gpu, tp=4, weight_dtype="fp8").expert_weight_dtype == "fp4"
    bf16 = StepModel(spec, gpu, tp=4, weight_dtype="bf16")
    assert bf16.expert_weight_dtype == "bf16"
    assert bf16.weight_bytes_per_rank == 284_000_000_000 * 2 // 4
    assert StepModel(spec, gpu, tp=4, weight_dtype="bf16",
                     expert_weight_dtype="fp4").expert_weight_dtype == "fp4"


@pytest.mark.parametrize("model,gpu,tp", [("llama-3-8b", "h100-sxm", 1),
                                          ("deepseek-v4-flash", "rtx-pro-6000", 4),
                                          ("qwen3-coder-480b-a35b", "h20", 8)])
def test_a_run_of_decode_steps_adds_up_as_stepping(model: str, gpu: str, tp: int) -> None:
    """``decode_step_ends`` (numpy for long runs, a loop for short ones) gives the floats
    of one :meth:`step_time` per step added to the clock one at a time, bit for bit."""
    import numpy  # noqa: F401  (imported: long runs take the vectorised path)

    step = StepModel(lookup(model), resolve_gpu(gpu), tp, block_tokens=256)
    rng = random.Random(7)
    for k in (1, 5, 47, 48, 300, 2000):
        n = rng.randint(1, 300)
        cached = [rng.randint(0, 60_000) for _ in range(n)]
        start = rng.uniform(0.0, 5000.0)
        t, want = start, []
        for j in range(k):
            t += step.step_time([(1, c + j) for c in cached])
            want.append(t)
        got = step.decode_step_ends(start, n, sum(cached), k)
        assert [float(x) for x in got] == want, (k, n)


def test_a_run_of_decode_steps_without_numpy(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without numpy loaded, long runs take the written-out loop: the same floats."""
    import sys

    step = StepModel(lookup("deepseek-v4-flash"), resolve_gpu("rtx-pro-6000"), 4,
                     block_tokens=256)
    monkeypatch.delitem(sys.modules, "numpy")
    rng = random.Random(11)
    for k in (1, 60, 900):
        n = rng.randint(1, 200)
        ctx = rng.randint(0, 4_000_000)
        start = rng.uniform(0.0, 100.0)
        t, want = start, []
        for j in range(k):
            c = ctx + n * j
            t += step.step_time_sums(0, 0.0, n, c + 0.5 * n, float(c + n))
            want.append(t)
        got = step.decode_step_ends(start, n, ctx, k)
        assert isinstance(got, list) and got == want, (k, n)


@pytest.mark.parametrize("model,gpu", [("llama-3-8b", "h100-sxm"), ("llama-3-8b", "rtx-pro-6000")])
def test_one_gpu_runs_memory_bound_compute_bound_and_crossing(
        monkeypatch: pytest.MonkeyPatch, model: str, gpu: str) -> None:
    """One GPU (no all-reduce terms): a run memory-bound at both ends takes the memory time
    alone; compute-bound runs and runs that cross over take the full comparison: every one
    the floats of stepping."""
    import sys

    step = StepModel(lookup(model), resolve_gpu(gpu), 1, block_tokens=512)
    monkeypatch.delitem(sys.modules, "numpy", raising=False)
    rng = random.Random(5)
    bounds = set()
    for _ in range(300):
        n = rng.choice([1, 2, 8, 40, 128, 256, 512])
        ctx = rng.choice([0, n, 10 * n, rng.randint(0, 50_000 * n)])
        k = rng.randint(1, 300)
        start = rng.uniform(0.0, 10_000.0)
        t, want = start, []
        for j in range(k):
            c = ctx + n * j
            t += step.step_time_sums(0, 0.0, n, c + 0.5 * n, float(c + n))
            want.append(t)
        assert step.decode_step_ends(start, n, ctx, k) == want, (n, ctx, k)
        ends = [step.breakdown([(1, c // n)] * n) for c in (ctx, ctx + n * (k - 1))]
        bounds.add(tuple(b["t_memory"] > b["t_compute"] for b in ends))
    assert (True, True) in bounds and len(bounds) > 1, bounds  # memory-bound, and not
