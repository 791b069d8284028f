"""Synthetic workloads like the reports': multi-turn sessions and re-sent random prompts.

Both generators yield kvtool trace records (plain dicts, one JSONL line each) in serve
order, round by round, and are deterministic for a given seed.

**Multi-turn** (the seed's test): C sessions × R rounds. A session's round-*r* request
re-sends its whole history — a system prompt of S tokens shared by every session, then
each earlier round's N new input tokens and M answer tokens — followed by N new input
tokens, so ``input_length = S + r·N + (r−1)·M`` and ``output_length = M``. The answer
becomes part of the next round's prefix.

**Random prompts** (the vLLM-bench method): P prompts of each length in
``--random-input-len`` (after an optional shared S-token prefix), drawn once with the
seed and re-sent unchanged in every iteration, so iteration 2+ is 100 % reusable up to
the last full block. Prompt *j* is session *j*; iteration *i* is its round *i*.

**Forms.** ``tokens`` writes the token ids (every block is hashed by the reader);
``hash_ids`` writes compact block ids instead: the chained keys of the same token stream,
numbered 0, 1, 2, … in order of first appearance (what ``kvtool trace convert`` makes of
the ``tokens`` form, so the two forms replay identically). Only full blocks get ids.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from kvtool.errors import UsageError

Form = Literal["tokens", "hash_ids"]
VOCAB = 32_000
"""Token ids are drawn uniformly from ``[0, VOCAB)`` (a Llama-sized vocabulary)."""
MAX_REQUEST_TOKENS = 100_000_000
"""Longest request a generator makes (ten times any model's context window today)."""


@dataclass(frozen=True)
class MultiTurn:
    """Parameters of a multi-turn workload (see the module docstring)."""

    sessions: int
    rounds: int
    input_tokens: int
    output_tokens: int
    system_prompt_tokens: int = 0
    block_tokens: int = 256
    seed: int = 0
    form: Form = "tokens"
    interval_ms: float | None = None

    def __post_init__(self) -> None:
        _positive(self.sessions, "sessions")
        _positive(self.rounds, "rounds")
        _not_negative(self.input_tokens, "input_tokens")
        _check_common(self)
        _request_limit(self.input_length(self.rounds), "input_tokens")

    def input_length(self, round_: int) -> int:
        """Input tokens of every session's round-``round_`` request (1-based)."""
        return (self.system_prompt_tokens + round_ * self.input_tokens
                + (round_ - 1) * self.output_tokens)


@dataclass(frozen=True)
class RandomPrompts:
    """Parameters of a seeded random-prompt workload re-sent ``iterations`` times."""

    input_lengths: tuple[int, ...]
    num_prompts: int
    iterations: int
    output_tokens: int = 128
    system_prompt_tokens: int = 0
    block_tokens: int = 256
    seed: int = 0
    form: Form = "tokens"
    interval_ms: float | None = None

    def __post_init__(self) -> None:
        if not self.input_lengths:
            raise UsageError("give at least one length", field="random_input_len")
        for n in self.input_lengths:
            _positive(n, "random_input_len")
        _positive(self.num_prompts, "num_prompts")
        _positive(self.iterations, "iterations")
        _check_common(self)
        _request_limit(self.system_prompt_tokens + max(self.input_lengths), "random_input_len")


def _positive(value: int, field: str) -> None:
    if value <= 0:
        raise UsageError(f"must be positive, got {value}", field=field)


def _not_negative(value: int, field: str) -> None:
    if value < 0:
        raise UsageError(f"must not be negative, got {value}", field=field)


def _check_common(spec: MultiTurn | RandomPrompts) -> None:
    """Check the parameters both workloads share."""
    _positive(spec.block_tokens, "block_tokens")
    _not_negative(spec.output_tokens, "output_tokens")
    _not_negative(spec.system_prompt_tokens, "system_prompt_tokens")
    _not_negative(spec.seed, "seed")
    if spec.form not in ("tokens", "hash_ids"):
        raise UsageError(f"unknown form {spec.form!r} (use tokens or hash_ids)", field="format")
    if spec.interval_ms is not None and not 0 <= spec.interval_ms < math.inf:
        raise UsageError(f"must be a finite number >= 0, got {spec.interval_ms}",
                         field="interval_ms")


def _request_limit(longest: int, field: str) -> None:
    if longest > MAX_REQUEST_TOKENS:
        raise UsageError(f"the longest request would have {longest} tokens; at most "
                         f"{MAX_REQUEST_TOKENS} are allowed", field=field)


class _Ids:
    """Compact block ids: a session's chain gets a fresh id for each new full block."""

    def __init__(self, block_tokens: int, shared_tokens: int) -> None:
        self.block_tokens = block_tokens
        self.next_id = 0
        # The system prompt's full blocks are the same tokens for every session.
        self.shared_blocks = shared_tokens // block_tokens
        self.shared: list[int] = []

    def extend(self, chain: list[int], length: int) -> list[int]:
        """Grow ``chain`` (a session's ids so far) to cover ``length`` tokens' full blocks."""
        want = length // self.block_tokens
        while len(chain) < want:
            i = len(chain)
            if i < self.shared_blocks:
                if i == len(self.shared):
                    self.shared.append(self._fresh())
                chain.append(self.shared[i])
            else:
                chain.append(self._fresh())
        return chain

    def _fresh(self) -> int:
        self.next_id += 1
        return self.next_id - 1


def _record(index: int, interval_ms: float | None, session: int, round_: int,
            input_length: int, output_length: int, block_tokens: int) -> dict[str, Any]:
    rec: dict[str, Any] = {}
    if interval_ms is not None:
        rec["timestamp"] = index * interval_ms
    rec.update(session=session, round=round_, input_length=input_length,
               output_length=output_length, block_tokens=block_tokens)
    return rec


def multi_turn(spec: MultiTurn) -> Iterator[dict[str, Any]]:
    """Records of a multi-turn workload, round by round, sessions 1..C in order."""
    rng = np.random.default_rng(spec.seed)
    system = rng.integers(0, VOCAB, spec.system_prompt_tokens, dtype=np.uint32)
    histories: list[list[np.ndarray]] = [[system] for _ in range(spec.sessions)]
    chains: list[list[int]] = [[] for _ in range(spec.sessions)]
    ids = _Ids(spec.block_tokens, spec.system_prompt_tokens)
    index = 0
    for round_ in range(1, spec.rounds + 1):
        length = spec.input_length(round_)
        for s in range(spec.sessions):
            rec = _record(index, spec.interval_ms, s + 1, round_, length, spec.output_tokens,
                          spec.block_tokens)
            if spec.form == "tokens":
                history = histories[s]
                history.append(rng.integers(0, VOCAB, spec.input_tokens, dtype=np.uint32))
                rec["tokens"] = np.concatenate(history).tolist()
                # The answer joins the history only after this round's request is sent.
                history.append(rng.integers(0, VOCAB, spec.output_tokens, dtype=np.uint32))
            else:
                rec["hash_ids"] = list(ids.extend(chains[s], length))
            index += 1
            yield rec


def random_prompts(spec: RandomPrompts) -> Iterator[dict[str, Any]]:
    """Records of a seeded random-prompt workload, iteration by iteration."""
    rng = np.random.default_rng(spec.seed)
    system = rng.integers(0, VOCAB, spec.system_prompt_tokens, dtype=np.uint32)
    lengths = [n for n in spec.input_lengths for _ in range(spec.num_prompts)]
    prompts: Sequence[list[int]]
    if spec.form == "tokens":
        prompts = [np.concatenate([system, rng.integers(0, VOCAB, n, dtype=np.uint32)]).tolist()
                   for n in lengths]
    else:
        ids = _Ids(spec.block_tokens, spec.system_prompt_tokens)
        prompts = [ids.extend([], spec.system_prompt_tokens + n) for n in lengths]
    index = 0
    for iteration in range(1, spec.iterations + 1):
        for j, n in enumerate(lengths):
            rec = _record(index, spec.interval_ms, j + 1, iteration,
                          spec.system_prompt_tokens + n, spec.output_tokens, spec.block_tokens)
            rec["tokens" if spec.form == "tokens" else "hash_ids"] = list(prompts[j])
            index += 1
            yield rec
