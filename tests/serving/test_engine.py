"""The engine's scheduler: cases computed by hand, and jumping between events equal to stepping."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from kvtool.serving.engine import Engine, EventEngine, Seq, SteppedEngine, make_engine
from kvtool.serving.kvpool import KVPool


class ConstStep:
    """A step time of ``base + per_token × new tokens`` (hand-checkable)."""

    def __init__(self, base: float = 1.0, per_token: float = 0.0) -> None:
        self.base = base
        self.per_token = per_token

    def step_time(self, items: Sequence[tuple[int, int]]) -> float:
        return self.base + self.per_token * sum(n for n, _c in items)

    def step_time_sums(self, prefill_tokens: int, prefill_work: float, decode_tokens: int,
                       decode_work: float, kv_tokens: float) -> float:
        return self.base + self.per_token * (prefill_tokens + decode_tokens)

    def prefill_time(self, new_tokens: int, cached_tokens: int = 0) -> float:
        return self.base + self.per_token * new_tokens


def engine(blocks: int = 100, B: int = 4, budget: int = 8, seqs: int = 256,
           ff: bool = True, step: ConstStep | None = None) -> Engine:
    return make_engine(0, "e0", "n0", KVPool(blocks, B), step or ConstStep(), exact_steps=not ff,
                       block_tokens=B, max_num_seqs=seqs, max_num_batched_tokens=budget)


def seq(i: int, prompt: int, out: int, B: int = 4, keys: list[int] | None = None) -> Seq:
    full = keys if keys is not None else [1000 * (i + 1) + b for b in range((prompt + out) // B)]
    return Seq(i, prompt, out, full, B, 0.0)


def run(e: Engine, seqs: list[Seq], limit: int = 10_000) -> list[tuple[int, float]]:
    """Step the engine alone from t = 0 until idle; return (index, finish) in order."""
    for s in seqs:
        e.add(s)
    now = 0.0
    out = []
    for _ in range(limit):
        end = e.plan(now)
        if end is None:
            return out
        now = end
        out += [(s.index, s.finish) for s in e.end_step()]
    raise AssertionError("engine did not go idle")


def test_chunked_prefill_then_decode_by_hand() -> None:
    e = engine(budget=8, ff=False)
    a = seq(0, 10, 3)
    assert run(e, [a]) == [(0, 4.0)]
    # t=1: 8 of 10 prompt tokens; t=2: the last 2 and the first token; t=3, t=4: decode
    assert a.first_token == 2.0 and a.finish == 4.0 and a.num_output == 3
    assert e.stats.steps == 4 and e.stats.prefill_tokens == 10 and e.stats.decode_tokens == 2
    assert e.itl_values == [1.0, 1.0]


def test_budget_shared_running_first_by_hand() -> None:
    e = engine(budget=8, ff=False)
    a, b = seq(0, 6, 2), seq(1, 6, 2)
    # step 1: A 6 + B 2 (budget); step 2: A decodes (done), B its last 4 (first token);
    # step 3: B decodes (done)
    assert run(e, [a, b]) == [(0, 2.0), (1, 3.0)]
    assert (a.first_token, b.first_token) == (1.0, 2.0)
    assert e.stats.batch_hist == {2: 2, 1: 1}


def test_max_num_seqs_holds_the_queue() -> None:
    e = engine(budget=100, seqs=1, ff=False)
    a, b = seq(0, 4, 2), seq(1, 4, 2)
    assert run(e, [a, b]) == [(0, 2.0), (1, 4.0)]
    assert b.first_scheduled == 2.0


def test_prefix_hit_skips_prefill_but_recomputes_the_last_block() -> None:
    e = engine(budget=100, ff=False, step=ConstStep(1.0, 0.5))
    shared = [7, 8, 9]
    a = seq(0, 12, 1, keys=[*shared, 100])
    b = seq(1, 12, 1, keys=[*shared, 200])
    run(e, [a])
    run(e, [b])
    # vLLM caps the hit at floor((12-1)/4)*4 = 8 tokens: B computes 4 tokens
    assert b.local_hit_tokens == 8
    assert b.finish - b.first_scheduled == pytest.approx(1.0 + 0.5 * 4)


def test_preemption_by_recompute_when_the_pool_is_full() -> None:
    # 5 usable blocks of 4 tokens. A and B (prompt 8 = 2 blocks each) both start; decoding,
    # each needs a third block at position 8: only one is left, so the last running
    # request (B) is preempted, and recomputed after A finishes.
    e = engine(blocks=6, B=4, budget=100, ff=False)
    a, b = seq(0, 8, 4), seq(1, 8, 4)
    done = run(e, [a, b])
    assert [i for i, _t in done] == [0, 1]
    assert b.preemptions >= 1 and a.preemptions == 0
    assert e.stats.preemptions == b.preemptions


def expanded(e: Engine) -> list[float]:
    return [v for v, c in zip(e.itl_values, e.itl_counts, strict=True) for _ in range(c)]


@pytest.mark.parametrize("budget,B,blocks", [(8, 4, 64), (64, 16, 64), (2048, 16, 64),
                                             (64, 4, 24), (16, 4, 14)])
def test_jumping_equals_stepping(budget: int, B: int, blocks: int) -> None:
    def jobs() -> list[Seq]:
        return [seq(i, 5 + 7 * i, 3 + 11 * (i % 5), B=B) for i in range(12)]

    step = ConstStep(0.01, 0.001)
    seqs = min(256, budget)
    slow = engine(blocks=blocks, B=B, budget=budget, seqs=seqs, ff=False, step=step)
    fast = engine(blocks=blocks, B=B, budget=budget, seqs=seqs, ff=True, step=step)
    assert isinstance(slow, SteppedEngine) and isinstance(fast, EventEngine)
    js, jf = jobs(), jobs()
    assert run(slow, js) == run(fast, jf)
    for s, f in zip(js, jf, strict=True):
        assert (s.first_token, s.finish, s.num_output, s.preemptions) == \
            (f.first_token, f.finish, f.num_output, f.preemptions)
    assert slow.itl_values
    assert expanded(slow) == expanded(fast)
    assert slow.stats == fast.stats
    assert slow.pool.free_queue() == fast.pool.free_queue()


def test_event_engine_needs_a_token_per_decoding_request() -> None:
    # max_num_seqs above the token budget: some decoding requests may get no token in a
    # step, which the event engine does not model; make_engine steps instead
    assert isinstance(engine(budget=8, seqs=16), SteppedEngine)
    with pytest.raises(ValueError, match="max_num_seqs"):
        EventEngine(0, "e0", "n0", KVPool(10, 4), ConstStep(), block_tokens=4,
                    max_num_seqs=16, max_num_batched_tokens=8)


def test_request_too_big_for_the_pool_does_not_fit() -> None:
    e = engine(blocks=3, B=4)
    assert not e.fits(seq(0, 8, 4))
    assert e.fits(seq(1, 4, 4))
