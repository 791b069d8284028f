"""Step time of one engine step, a roofline with a few fitted scalars (docs/serving.md).

One step runs a batch of sequences, each with ``new`` tokens to compute (a prefill chunk,
or 1 for decode) after ``cached`` tokens already in its KV cache. Per TP rank
(the roofline of BLIS and AIConfigurator, written out in docs/serving.md; every figure it
gives is **modelled**):

* FLOPs = ``2·N_active·T_new + pair·Σ new·(cached + new/2) + tok·T_new``, all ``/ tp``;
  ``pair`` = ``2·L·n_q·(d_qk + d_v)`` (= ``4·L·n_q·d_head``) for full attention,
  ``tok`` the context-independent attention of compressed/sparse models (0 otherwise);
* bytes = weights touched (dense: all but the input embedding; MoE: shared weights + the
  experts the batch's tokens are expected to route to) ``/ tp``, plus the KV cache read,
  ``Σ (cached + new) · kv_bytes_per_token`` (one rank's share);
* ``t = max(t_compute, t_memory) + c0 + t_allreduce`` with
  ``t_compute = FLOPs_prefill / (peak·mfu_prefill) + FLOPs_decode / (peak·mfu_decode)``,
  ``t_memory = bytes / (HBM·eta)`` and, for ``tp > 1``, two all-reduces per layer of
  ``T_new · hidden · 2`` bytes, each ``latency + 2·(tp−1)/tp · bytes / interconnect``.

MFU rule: each sequence's FLOPs are charged at the MFU of its kind — a sequence with more
than one new token is a prefill chunk (``mfu_prefill``), one new token is decode
(``mfu_decode``). A mixed batch therefore blends the two by FLOPs, with no switch-over jump
when a batch tips from decode- to prefill-dominated.

Invariants of :class:`StepModel`: ``step_time`` is non-decreasing in every sequence's new
and cached tokens and in the batch (given ``mfu_prefill <= 2·mfu_decode``, so that a
1-token decode turning into a 2-token chunk cannot get cheaper; the defaults satisfy it);
it is non-increasing in peak FLOPS, HBM bandwidth,
interconnect bandwidth, MFU and eta; an empty batch takes 0 s.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, TypeAlias

from kvtool.errors import UsageError, param
from kvtool.geometry.model import ModelSpec
from kvtool.geometry.params import WEIGHT_BYTES
from kvtool.geometry.params import weight_dtype as canonical_weight_dtype
from kvtool.serving.gpus import GPU

#: AIConfigurator's ``misc.other_mem`` (3.5 GiB "for safer deployment": activations, CUDA
#: graphs and non-torch memory) in every systems/*.yaml.
OTHER_MEM_BYTES = 3_758_096_384
#: AIConfigurator's ``misc.nccl_mem`` by TP size (NCCL buffers); 8 applies above 8.
NCCL_MEM_BYTES: dict[int, int] = {1: 0, 2: 358_612_992, 4: 411_041_792, 8: 411_041_792}
#: Activations cross the all-reduce in bf16.
ACTIVATION_BYTES = 2
#: Memory-bound operations per decoder layer that c0 counts: the four weight GEMMs
#: (QKV, O, gate/up, down) and attention.
OPS_PER_LAYER = 5
#: Runs of at least this many decode steps are computed with numpy (the same floats), once
#: numpy is imported or a model has computed :data:`_NUMPY_AFTER` decode steps (numpy's
#: import, 0.1 s, is not worth it for a short replay: bench/startup.py).
_VECTOR_STEPS: Final = 48
_NUMPY_AFTER: Final = 400_000
_BOUND_MARGIN: Final = 1.0 + 1e-9
"""A run of decode steps is memory-bound throughout when its memory time exceeds its compute
time by this factor at its first and last step (:meth:`StepModel.decode_step_ends`)."""

if TYPE_CHECKING:
    import numpy as np
    from numpy.typing import NDArray

    Ends: TypeAlias = Sequence[float] | NDArray[np.float64]
    """End times of a run of steps: a list, or a numpy array for a long run."""


@dataclass(frozen=True)
class Scalars:
    """The fitted scalars of the roofline, with defaults from peers (docs/serving.md).

    * ``mfu_prefill`` 0.45, ``mfu_decode`` 0.30: BLIS's H100 roofline defaults
      (inference-sim/inference-sim, docs/serving.md).
    * ``eta`` 0.8: AIConfigurator's ``mem_bw_empirical_scaling_factor`` (every
      systems/*.yaml).
    * ``c0_s``: fixed time per step; ``None`` derives it as AIConfigurator's
      ``mem_empirical_constant_latency`` (3 µs) per memory-bound operation,
      ``OPS_PER_LAYER`` (5) per layer.
    * ``op_latency_s`` 3 µs: that constant latency.
    * ``allreduce_latency_s`` 10 µs: AIConfigurator's ``p2p_latency``, per all-reduce.
    """

    mfu_prefill: float = 0.45
    mfu_decode: float = 0.30
    eta: float = 0.8
    c0_s: float | None = None
    op_latency_s: float = 3e-6
    allreduce_latency_s: float = 10e-6

    def __post_init__(self) -> None:
        for key in ("mfu_prefill", "mfu_decode", "eta"):
            value = getattr(self, key)
            if isinstance(value, bool) or not (isinstance(value, int | float) and 0 < value <= 1):
                raise UsageError(f"must be in (0, 1], got {value!r}", field=key)
        for key in ("c0_s", "op_latency_s", "allreduce_latency_s"):
            value = getattr(self, key)
            if value is not None and (isinstance(value, bool) or not (
                    isinstance(value, int | float) and value >= 0 and math.isfinite(value))):
                raise UsageError(f"must be a non-negative number of seconds, got {value!r}",
                                 field=key)


class StepModel:
    """Step time of one engine (one model on ``tp`` GPUs) for a batch of sequences.

    Everything per call is arithmetic on constants computed here; :meth:`step_time_sums`
    takes aggregated sums so the engine need not build a list per step.
    """

    def __init__(self, model_spec: ModelSpec, gpu: GPU, tp: int = 1,
                 weight_dtype: str | None = None, kv_dtype: str | None = None,
                 scalars: Scalars | None = None, *, block_tokens: int = 256,
                 expert_weight_dtype: str | None = None) -> None:
        arch = model_spec.arch
        if arch is None:
            raise UsageError(
                f"model {model_spec.name!r} has no parameter counts, so its step time cannot "
                "be modelled: use a preset or give hidden_size, q_heads, vocab_size, "
                f"total_params ... in the {param('geometry')} file", field="model")
        if isinstance(tp, bool) or not isinstance(tp, int) or tp <= 0:
            raise UsageError(f"TP size must be a positive integer, got {tp!r}", field="tp")
        if arch.q_heads % tp:
            raise UsageError(f"{model_spec.name} has {arch.q_heads} attention heads; the TP size "
                             f"must divide them (vLLM's rule), got {tp}", field="tp")
        s = scalars or Scalars()
        wd = canonical_weight_dtype(weight_dtype or arch.weight_dtype)
        # Experts keep the checkpoint's own dtype while the checkpoint runs as published
        # (V4-Flash: fp8 weights, fp4 experts); another weight dtype applies to them too.
        native = arch.expert_weight_dtype if wd == canonical_weight_dtype(arch.weight_dtype) \
            else None
        ed = canonical_weight_dtype(expert_weight_dtype or native or wd,
                                    field="expert_weight_dtype")
        geometry = model_spec.geometry(dtype=kv_dtype, block_tokens=block_tokens, tp=tp)
        self.model = model_spec
        self.arch = arch
        self.gpu = gpu
        self.tp = tp
        self.weight_dtype = wd
        self.expert_weight_dtype = ed
        self.kv_dtype = geometry.dtype
        self.scalars = s
        self.block_tokens = block_tokens
        self.kind = "roofline"
        """The step time: ``roofline`` here (``dynamo-mocker``: :mod:`.mockerstep`)."""
        self.kv_bytes_per_token: float = geometry.block_bytes / block_tokens
        """One rank's KV bytes per token (a shard for MHA/GQA, a full copy for MLA)."""

        layers = model_spec.layers
        peak = gpu.peak_tflops(wd) * 1e12
        self._flops_token = (2.0 * arch.active_params + arch.attn_token_flops) / tp
        self._flops_pair = arch.pair_flops(layers) / tp
        self._inv_prefill = 1.0 / (peak * s.mfu_prefill)
        self._inv_decode = 1.0 / (peak * s.mfu_decode)
        self._inv_mem = 1.0 / (gpu.hbm_gbps * 1e9 * s.eta)
        wb, eb = WEIGHT_BYTES[wd], WEIGHT_BYTES[ed]
        # Weights read per step: the input embedding is gathered row by row, not read whole.
        shared_read = max(arch.shared_params - arch.vocab_size * arch.hidden_size, 0)
        self._shared_bytes = shared_read * wb / tp
        self._expert_bytes = arch.moe_layers * arch.expert_params * eb / tp
        self._experts = float(arch.experts)
        self._log_miss = (math.log1p(-arch.experts_per_token / arch.experts)
                          if arch.is_moe and arch.experts_per_token < arch.experts
                          else -math.inf)
        non_routed = arch.total_params - arch.routed_params
        self.weight_bytes_per_rank: int = math.ceil((non_routed * wb + arch.routed_params * eb) / tp)
        """Weights resident on one rank (what the KV pool cannot use)."""
        self.c0_s: float = s.c0_s if s.c0_s is not None else \
            OPS_PER_LAYER * layers * s.op_latency_s
        if tp > 1:
            n = 2 * layers
            self._ar_fixed = n * s.allreduce_latency_s
            self._ar_token = n * 2.0 * (tp - 1) / tp * arch.hidden_size * ACTIVATION_BYTES / \
                (gpu.interconnect_gbps * 1e9)
        else:
            self._ar_fixed = self._ar_token = 0.0
        self._decode_steps = 0
        """Decode steps :meth:`decode_step_ends` has computed (when numpy pays off)."""

    # -- the hot path ---------------------------------------------------------------------

    def step_time_sums(self, prefill_tokens: int, prefill_work: float, decode_tokens: int,
                       decode_work: float, kv_tokens: float) -> float:
        """Step time from sums over the batch (seconds).

        ``prefill_tokens``/``decode_tokens``: new tokens of prefill sequences (new > 1) and
        of decode sequences (new = 1); ``*_work``: ``Σ new·(cached + new/2)`` over each
        kind; ``kv_tokens``: ``Σ (cached + new)`` over the batch.
        """
        t_new = prefill_tokens + decode_tokens
        if t_new <= 0:
            return 0.0
        ft, fp = self._flops_token, self._flops_pair
        t_compute = (ft * prefill_tokens + fp * prefill_work) * self._inv_prefill + \
            (ft * decode_tokens + fp * decode_work) * self._inv_decode
        weights = self._shared_bytes
        if self._expert_bytes:
            weights += self._expert_bytes * self._experts * (
                1.0 - math.exp(t_new * self._log_miss))
        t_memory = (weights + kv_tokens * self.kv_bytes_per_token) * self._inv_mem
        return (t_compute if t_compute > t_memory else t_memory) + self.c0_s + \
            self._ar_fixed + self._ar_token * t_new

    def decode_step_ends(self, start: float, n: int, ctx: int, k: int) -> Ends:
        """End times of ``k`` decode steps of ``n`` sequences, one after the other from
        ``start``, whose contexts sum to ``ctx + n·j`` at step ``j`` (a run of identical
        decode steps, :mod:`kvtool.serving.engine`).

        The same floats as stepping: each step's time is :meth:`step_time_sums`'s arithmetic
        (the sums are integers and halves, exact), added to the clock one at a time. Long
        runs compute it with numpy, element by element, and ``cumsum`` (a sequential sum),
        which are the same IEEE operations in the same order (tested).
        """
        self._decode_steps += k
        weights = self._shared_bytes
        if self._expert_bytes:
            weights += self._expert_bytes * self._experts * (1.0 - math.exp(n * self._log_miss))
        if k < _VECTOR_STEPS or ("numpy" not in sys.modules
                                 and self._decode_steps < _NUMPY_AFTER):
            # step_time_sums(0, 0.0, n, c + n/2, c + n) written out: its prefill part is
            # 0.0, and 0.0 + x is x
            ft_n, fp, inv_d = self._flops_token * n, self._flops_pair, self._inv_decode
            kvb, inv_mem = self.kv_bytes_per_token, self._inv_mem
            c0, ar_fixed, ar_n = self.c0_s, self._ar_fixed, self._ar_token * n
            half = 0.5 * n
            t = start
            out: list[float] = []
            append = out.append
            if ar_fixed == 0.0 and ar_n == 0.0:
                # one GPU: adding the all-reduce terms (+0.0 twice) changes no positive float;
                # (c + n) * kvb converts the int exactly, as float() does
                last = ctx + n * (k - 1)
                tc0 = (ft_n + fp * (ctx + half)) * inv_d
                tc1 = (ft_n + fp * (last + half)) * inv_d
                if ((weights + (ctx + n) * kvb) * inv_mem > tc0 * _BOUND_MARGIN
                        and (weights + (last + n) * kvb) * inv_mem > tc1 * _BOUND_MARGIN
                        and (weights + (last + n) * kvb) * inv_mem < tc0 * 1e6):
                    # memory-bound at both ends by a margin far above rounding: both times
                    # are affine in c, so the memory time is the larger at every step
                    for cn in range(ctx + n, last + n + 1, n):
                        t += (weights + cn * kvb) * inv_mem + c0
                        append(t)
                    return out
                for c in range(ctx, ctx + n * k, n):
                    t_compute = (ft_n + fp * (c + half)) * inv_d
                    t_memory = (weights + (c + n) * kvb) * inv_mem
                    t += (t_compute if t_compute > t_memory else t_memory) + c0
                    append(t)
                return out
            for c in range(ctx, ctx + n * k, n):
                t_compute = (ft_n + fp * (c + half)) * inv_d
                t_memory = (weights + float(c + n) * kvb) * inv_mem
                t += (t_compute if t_compute > t_memory else t_memory) + c0 + ar_fixed + ar_n
                append(t)
            return out
        import numpy as np

        cs = np.arange(k, dtype=np.int64) * n + ctx
        tc = (self._flops_token * n + self._flops_pair * (cs + 0.5 * n)) * self._inv_decode
        tm = (weights + (cs + n).astype(np.float64) * self.kv_bytes_per_token) * self._inv_mem
        dt = np.where(tc > tm, tc, tm)
        dt += self.c0_s
        dt += self._ar_fixed
        dt += self._ar_token * n
        dt[0] += start
        return np.cumsum(dt)

    def step_time(self, items: Iterable[tuple[int, int]]) -> float:
        """Seconds for one step of ``items`` = ``(new_tokens, cached_tokens)`` per sequence."""
        pt = dt = 0
        pw = dw = kv = 0.0
        for new, cached in items:
            if new > 1:
                pt += new
                pw += new * (cached + new / 2)
            elif new == 1:
                dt += 1
                dw += cached + 0.5
            kv += cached + new
        return self.step_time_sums(pt, pw, dt, dw, kv)

    def prefill_time(self, new_tokens: int, cached_tokens: int = 0) -> float:
        """One sequence's prefill of ``new_tokens`` after ``cached_tokens``, alone in a step
        (the load-or-recompute comparison)."""
        return self.step_time(((new_tokens, cached_tokens),))

    # -- reporting ------------------------------------------------------------------------

    def breakdown(self, items: Iterable[tuple[int, int]]) -> dict[str, Any]:
        """The terms of :meth:`step_time` for ``items`` (per rank; all **modelled**)."""
        pt = dt = 0
        pw = dw = kv = 0.0
        for new, cached in items:
            if new > 1:
                pt, pw = pt + new, pw + new * (cached + new / 2)
            elif new == 1:
                dt, dw = dt + 1, dw + cached + 0.5
            kv += cached + new
        t_new = pt + dt
        ft, fp = self._flops_token, self._flops_pair
        flops_p, flops_d = ft * pt + fp * pw, ft * dt + fp * dw
        weights = 0.0
        if t_new > 0:
            weights = self._shared_bytes + self._expert_bytes * self._experts * (
                1.0 - math.exp(t_new * self._log_miss))
        kv_bytes = kv * self.kv_bytes_per_token
        t_compute = flops_p * self._inv_prefill + flops_d * self._inv_decode
        t_memory = (weights + kv_bytes) * self._inv_mem
        on = t_new > 0
        t_ar = (self._ar_fixed + self._ar_token * t_new) if on else 0.0
        c0 = self.c0_s if on else 0.0
        return {"basis": "modelled", "new_tokens": t_new, "prefill_tokens": pt,
                "decode_tokens": dt, "flops": flops_p + flops_d, "weight_bytes": weights,
                "kv_bytes": kv_bytes, "bytes": weights + kv_bytes, "t_compute": t_compute,
                "t_memory": t_memory, "t_allreduce": t_ar, "c0": c0,
                "bound": "compute" if t_compute > t_memory else "memory",
                "t": (max(t_compute, t_memory) + c0 + t_ar) if on else 0.0}

    def reserve_bytes(self) -> int:
        """Memory one rank keeps outside weights and KV: AIConfigurator's ``other_mem``
        (3.5 GiB) plus its ``nccl_mem`` for this TP size."""
        nccl = NCCL_MEM_BYTES.get(self.tp)
        if nccl is None:
            nccl = NCCL_MEM_BYTES[8] if self.tp > 8 else NCCL_MEM_BYTES[
                min(k for k in NCCL_MEM_BYTES if k >= self.tp)]
        return OTHER_MEM_BYTES + nccl

    def kv_pool_blocks(self, block_tokens: int, gpu_memory_utilization: float = 0.9,
                       reserve_bytes: int | None = None) -> int:
        """GPU KV blocks per engine, as vLLM reports ``num_gpu_blocks`` (null block included).

        ``⌊(memory·utilization − weights per rank − reserve) / bytes per block per rank⌋``;
        ``reserve`` defaults to :meth:`reserve_bytes`. Raises :class:`UsageError` when the
        weights leave no room (vLLM refuses to start then, too).
        """
        u = gpu_memory_utilization
        if isinstance(u, bool) or not isinstance(u, int | float) or not 0 < u <= 1:
            raise UsageError(f"must be in (0, 1], got {u!r}", field="gpu_memory_utilization")
        block = self.model.geometry(dtype=self.kv_dtype, block_tokens=block_tokens,
                                    tp=self.tp).block_bytes
        reserve = self.reserve_bytes() if reserve_bytes is None else reserve_bytes
        free = int(self.gpu.memory_bytes * u) - self.weight_bytes_per_rank - reserve
        blocks = free // block if free > 0 else 0
        if blocks <= 0:
            raise UsageError(
                f"{self.model.name} on {self.tp} x {self.gpu.name}: "
                f"{self.weight_bytes_per_rank / 2**30:.1f} GiB of {self.weight_dtype} weights "
                f"per rank + {reserve / 2**30:.1f} GiB reserve leave no room for KV blocks in "
                f"{u:g} x {self.gpu.memory_bytes / 2**30:.1f} GiB; use a larger {param('tp')} "
                "or narrower weights", field="tp")
        return int(blocks)

    def describe(self) -> dict[str, Any]:
        """The constants this model was built with (JSON-ready)."""
        return {"model": self.model.name, "gpu": self.gpu.name, "tp": self.tp,
                "weight_dtype": self.weight_dtype,
                "expert_weight_dtype": self.expert_weight_dtype, "kv_dtype": self.kv_dtype,
                "kv_bytes_per_token": self.kv_bytes_per_token,
                "weight_bytes_per_rank": self.weight_bytes_per_rank, "c0_s": self.c0_s,
                "scalars": {"mfu_prefill": self.scalars.mfu_prefill,
                            "mfu_decode": self.scalars.mfu_decode, "eta": self.scalars.eta,
                            "op_latency_s": self.scalars.op_latency_s,
                            "allreduce_latency_s": self.scalars.allreduce_latency_s},
                "basis": "modelled"}
