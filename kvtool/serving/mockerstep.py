"""NVIDIA Dynamo's mocker step time, for comparing routing with Dynamo on the same clock.

Dynamo's offline replay (``dynamo.replay``, the oracle of ``kv-aware``: docs/serving.md,
"Routers") runs mocker engines whose default timing is a fixed polynomial, not a model of
any GPU (ai-dynamo/dynamo, ``lib/mocker/src/common/perf_model.rs``, ``Polynomial``; the
vLLM-shaped mocker scheduler adds the two parts of a pass)::

    prefill_ms = 4.209989e-07·T² + 1.518344e-02·T + 16.50142    (T: the pass's new prompt
                                                                  tokens; 0 without any)
    decode_ms  = max(1, −25.74·u² + 54.01·u + 5.74)             (u: the share of the KV
                                                                  pool in use, ≤ 1)
    pass       = prefill_ms + decode_ms (the latter only when a request decodes)

The router's load terms (its tracked prefill tokens and blocks) change when requests finish
their prefill and end, so they follow the engines' clock: to compare kvtool's choices with
Dynamo's, both must run the same one. An ``[[engine]]`` with ``step_time =
"dynamo-mocker"`` uses this :class:`MockerStepModel` instead of the roofline; everything else
(the scheduler, the KV pool, links, tiers) is kvtool's. Its times are **modelled**, and say
nothing about a real GPU.

``u`` is the mocker's: the decoding requests' context tokens over the pool's tokens
(``num_gpu_blocks × block_tokens``; one 51,200-token request on 200 blocks of 512 decodes at
26.31 ms = decode_ms(0.5) in both). ``T`` is the step's prefill tokens (the mocker's ``n ×
(⌊Σ isl / n⌋ − ⌊Σ prefix / n⌋)`` over ``n`` chunks, without its rounding of the means, which
moves ``T`` by less than ``n`` tokens). A pass without a decoding request
has no decode part, so a request's first token comes at the end of its last prefill chunk
(a lone 2,048-token prompt: TTFT 49.363 ms = prefill_ms(2048) in both). Checked against
Dynamo 1.6.1's replay: with Dynamo's choices replayed, every one of its choices on 2,000
conversation and 2,000 synthetic Mooncake requests is among kvtool's least-cost engines
(``bench/dynamo_router.py``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from kvtool.geometry.model import ModelSpec
from kvtool.serving.gpus import GPU
from kvtool.serving.roofline import Scalars, StepModel

PREFILL = (4.209989e-07, 1.518344e-02, 1.650142e01)
"""ms = a·T² + b·T + c over a pass's new prompt tokens T (Dynamo's mocker)."""
DECODE = (-25.74, 54.01, 5.74)
"""ms = max(1, a·u² + b·u + c) over the KV pool's used share u ≤ 1 (Dynamo's mocker)."""


def prefill_ms(tokens: float) -> float:
    if tokens <= 0:
        return 0.0
    a, b, c = PREFILL
    return a * tokens * tokens + b * tokens + c


def decode_ms(share: float) -> float:
    u = min(1.0, max(0.0, share))
    a, b, c = DECODE
    return max(1.0, a * u * u + b * u + c)


class MockerStepModel(StepModel):
    """A :class:`StepModel` whose step time is Dynamo's mocker polynomial (module
    docstring); geometry (KV bytes, weights, pool size) stays the model's own.

    ``total_kv_tokens``: the engine's pool in tokens (``num_gpu_blocks × block_tokens``).
    """

    def __init__(self, model_spec: ModelSpec, gpu: GPU, tp: int = 1,
                 weight_dtype: str | None = None, kv_dtype: str | None = None,
                 scalars: Scalars | None = None, *, block_tokens: int = 256,
                 expert_weight_dtype: str | None = None, total_kv_tokens: int) -> None:
        # StepModel's parameters spelled out: compiled (mypyc), a subclass's *args do not
        # reach a native base class's __init__
        super().__init__(model_spec, gpu, tp, weight_dtype, kv_dtype, scalars,
                         block_tokens=block_tokens, expert_weight_dtype=expert_weight_dtype)
        self.total_kv_tokens = max(1, total_kv_tokens)
        self.kind = "dynamo-mocker"

    def step_time_sums(self, prefill_tokens: int, prefill_work: float, decode_tokens: int,
                       decode_work: float, kv_tokens: float) -> float:
        # decode_work = Σ (cached + ½) over the decoding requests, so their context (what u
        # counts) is decode_work + ½·decode_tokens, exactly (halves are exact floats)
        return self._ms(prefill_tokens, decode_tokens,
                        decode_work + 0.5 * decode_tokens) / 1000.0

    def _ms(self, prefill_tokens: int, decode_tokens: int, decode_context: float) -> float:
        ms = prefill_ms(prefill_tokens)
        if decode_tokens:
            ms += decode_ms(decode_context / self.total_kv_tokens)
        return ms

    def step_time(self, items: Iterable[tuple[int, int]]) -> float:
        pt = dt = 0
        context = 0.0
        for new, cached in items:
            if new > 1:
                pt += new
            elif new == 1:
                dt += 1
                context += cached + new
        return self._ms(pt, dt, context) / 1000.0

    def decode_step_ends(self, start: float, n: int, ctx: int, k: int) -> list[float]:
        """End times of a run of ``k`` decode steps of ``n`` requests whose contexts sum to
        ``ctx + n·j`` at step ``j`` (the event engine's jump; the roofline's vectorised
        version does not apply here)."""
        t = start
        out = []
        for j in range(k):
            t += self._ms(0, n, float(ctx + n * j + n)) / 1000.0
            out.append(t)
        return out

    def prefill_time(self, new_tokens: int, cached_tokens: int = 0) -> float:
        return self.step_time(((new_tokens, cached_tokens),))

    def breakdown(self, items: Iterable[tuple[int, int]]) -> dict[str, Any]:
        items = list(items)
        pt = sum(n for n, _c in items if n > 1)
        context = sum(c + n for n, c in items if n == 1)
        return {"basis": "modelled", "step_time": "dynamo-mocker", "prefill_tokens": pt,
                "decode_tokens": sum(1 for n, _c in items if n == 1),
                "prefill_ms": prefill_ms(pt),
                "decode_ms": decode_ms(context / self.total_kv_tokens) if context else 0.0,
                "t": self.step_time(items)}
