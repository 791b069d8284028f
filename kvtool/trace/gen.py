"""Synthetic workloads: multi-turn sessions, random prompts, vLLM bench's prefix repetition.

The generators yield kvtool trace records (plain dicts, one JSONL line each) in serve
order and are deterministic for a given seed.

**Multi-turn** (the seed's test): C sessions × R rounds. A session's round-*r* request
re-sends its whole history — a system prompt of S tokens shared by every session, then
each earlier round's N new input tokens and M answer tokens — followed by N new input
tokens, so ``input_length = S + r·N + (r−1)·M`` and ``output_length = M``. The answer
becomes part of the next round's prefix.

**Random prompts** (the vLLM-bench method): P prompts of each length in
``--random-input-len`` (after an optional shared S-token prefix), drawn once with the
seed and re-sent unchanged in every iteration, so iteration 2+ is 100 % reusable up to
the last full block. Prompt *j* is session *j*; iteration *i* is its round *i*.

**Prefix repetition** (vLLM bench's ``prefix_repetition`` dataset,
``PrefixRepetitionRandomDataset``): ``num_prefixes`` random prefixes of P tokens; each
gets ``num_prompts // num_prefixes`` requests made of the prefix and a fresh random
suffix of S tokens, so ``input_length = P + S``; the requests are then shuffled (as vLLM
does unless ``--disable-shuffle``). Requests are independent: no session, no round.

**Arrivals** (every workload): untimed (served in file order, round by round); every
``interval_ms``; or at ``request_rate`` requests per second as ``vllm bench serve``
schedules them (``get_request``): gaps drawn from a gamma distribution with shape
``burstiness`` and mean 1/rate (burstiness 1: Poisson arrivals), summed, then scaled so
that the last of N requests arrives at N/rate exactly; ``request_rate = inf`` sends all at
t = 0, ``burstiness = inf`` makes the gaps constant. Arrival times use their own random
stream, so a seed gives the same prompts with or without them.

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

from kvtool.errors import UsageError, param
from kvtool.trace.sessions import Sessions, not_negative, positive

Form = Literal["tokens", "hash_ids"]
VOCAB = 32_000
"""Token ids are drawn uniformly from ``[0, VOCAB)`` (a Llama-sized vocabulary)."""
MAX_REQUEST_TOKENS = 100_000_000
"""Longest request a generator makes (ten times any model's context window today)."""


@dataclass(frozen=True)
class MultiTurn(Sessions):
    """Parameters of a multi-turn workload (see the module docstring): the
    :class:`Sessions` shape plus how the trace is written."""

    seed: int = 0
    form: Form = "tokens"
    interval_ms: float | None = None
    request_rate: float | None = None
    burstiness: float = 1.0

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_common(self)
        _request_limit(self.input_length(self.rounds), "input_tokens")


@dataclass(frozen=True)
class RandomPrompts:
    """Parameters of a seeded random-prompt workload re-sent ``iterations`` times.

    ``range_ratio`` r (vLLM bench's ``--random-range-ratio``): each prompt's length is
    drawn uniformly from the integers in [⌊L·(1−r)⌋, ⌈L·(1+r)⌉] and its answer length from
    [max(1, ⌊M·(1−r)⌋), max(1, ⌈M·(1+r)⌉)] (random stream ``(seed, 3)``); 0 keeps every
    length fixed. A prompt keeps its lengths in every iteration.

    ``reuse_share`` s: in iterations 2 and later, ``round(s·N)`` of the N prompts (chosen
    by random stream ``(seed, 4)``, the same ones each iteration) are re-sent as they were;
    the others are fresh prompts of the same lengths (a new draw per iteration, after the
    shared system prompt). 1 (the default) is vLLM bench's fixed seed: every prompt
    re-sent.
    """

    input_lengths: tuple[int, ...]
    num_prompts: int
    iterations: int
    output_tokens: int = 128
    system_prompt_tokens: int = 0
    block_tokens: int = 256
    seed: int = 0
    form: Form = "tokens"
    interval_ms: float | None = None
    request_rate: float | None = None
    burstiness: float = 1.0
    range_ratio: float = 0.0
    reuse_share: float = 1.0

    def __post_init__(self) -> None:
        if not 0 <= self.reuse_share <= 1:
            raise UsageError(f"must be in [0, 1], got {self.reuse_share}", field="reuse_share")
        if not self.input_lengths:
            raise UsageError("give at least one length", field="random_input_len")
        for n in self.input_lengths:
            positive(n, "random_input_len")
        positive(self.num_prompts, "num_prompts")
        positive(self.iterations, "iterations")
        not_negative(self.system_prompt_tokens, "system_prompt_tokens")
        if not 0 <= self.range_ratio < 1:
            raise UsageError(f"must be in [0, 1), got {self.range_ratio}",
                             field="random_range_ratio")
        shortest = self.system_prompt_tokens + self.length_range(min(self.input_lengths))[0]
        if shortest < 1:
            raise UsageError(f"the shortest prompt could have {shortest} tokens; give a "
                             "smaller ratio, longer prompts or a prefix", field="random_range_ratio")
        _check_common(self)
        _request_limit(self.system_prompt_tokens + self.length_range(max(self.input_lengths))[1],
                       "random_input_len")

    def length_range(self, n: int, floor: int = 0) -> tuple[int, int]:
        """The lengths a prompt (or, with ``floor`` 1, an answer) of mean ``n`` may get."""
        r = self.range_ratio
        return max(floor, math.floor(n * (1 - r))), max(floor, math.ceil(n * (1 + r)))

    def draw_lengths(self) -> tuple[list[int], list[int]]:
        """Input (without the shared prefix) and output lengths of every prompt, in order."""
        lengths = [n for n in self.input_lengths for _ in range(self.num_prompts)]
        if self.range_ratio == 0:
            return lengths, [self.output_tokens] * len(lengths)
        rng = np.random.default_rng([self.seed, 3])
        ins = [int(rng.integers(lo, hi + 1)) for lo, hi in map(self.length_range, lengths)]
        lo, hi = self.length_range(self.output_tokens, 1)
        outs = rng.integers(lo, hi + 1, size=len(lengths)).tolist()
        return ins, outs


@dataclass(frozen=True)
class PrefixRepetition:
    """Parameters of vLLM bench's prefix-repetition workload (module docstring).

    Defaults are vLLM's (``PrefixRepetitionRandomDataset``): 10 prefixes of 256 tokens,
    256-token suffixes, 128 output tokens.
    """

    num_prompts: int
    prefix_tokens: int = 256
    suffix_tokens: int = 256
    num_prefixes: int = 10
    output_tokens: int = 128
    shuffle: bool = True
    block_tokens: int = 256
    seed: int = 0
    form: Form = "tokens"
    interval_ms: float | None = None
    request_rate: float | None = None
    burstiness: float = 1.0

    def __post_init__(self) -> None:
        positive(self.num_prompts, "num_prompts")
        positive(self.num_prefixes, "prefix_repetition_num_prefixes")
        not_negative(self.prefix_tokens, "prefix_repetition_prefix_len")
        not_negative(self.suffix_tokens, "prefix_repetition_suffix_len")
        if self.num_prompts < self.num_prefixes:
            raise UsageError(f"{self.num_prompts} requests cannot cover "
                             f"{self.num_prefixes} prefixes (give at least one per prefix)",
                             field="num_prompts")
        if self.prefix_tokens + self.suffix_tokens == 0:
            raise UsageError("prefix and suffix are both empty",
                             field="prefix_repetition_prefix_len")
        _check_common(self)
        _request_limit(self.prefix_tokens + self.suffix_tokens, "prefix_repetition_prefix_len")

    @property
    def requests(self) -> int:
        """Requests written: ``num_prompts // num_prefixes`` per prefix, as vLLM."""
        return self.num_prompts // self.num_prefixes * self.num_prefixes


Spec = MultiTurn | RandomPrompts | PrefixRepetition


def _check_common(spec: Spec) -> None:
    """Check the parameters both workloads share."""
    positive(spec.block_tokens, "block_tokens")
    not_negative(spec.output_tokens, "output_tokens")
    not_negative(spec.seed, "seed")
    if spec.form not in ("tokens", "hash_ids"):
        raise UsageError(f"unknown form {spec.form!r} (use tokens or hash_ids)", field="format")
    if spec.interval_ms is not None and not 0 <= spec.interval_ms < math.inf:
        raise UsageError(f"must be a finite number >= 0, got {spec.interval_ms}",
                         field="interval_ms")
    if spec.request_rate is not None:
        if spec.interval_ms is not None:
            raise UsageError(f"give {param('interval_ms')} or {param('request_rate')}, not both",
                             field="request_rate")
        if not spec.request_rate > 0:
            raise UsageError(f"must be a positive number of requests per second or inf, got "
                             f"{spec.request_rate}", field="request_rate")
    if not spec.burstiness > 0:
        raise UsageError(f"must be positive (1: Poisson arrivals) or inf, got "
                         f"{spec.burstiness}", field="burstiness")
    if spec.burstiness != 1.0 and spec.request_rate is None:
        raise UsageError(f"needs {param('request_rate')}", field="burstiness")


def arrival_times_ms(n: int, spec: Spec) -> list[float] | None:
    """Arrival times of ``n`` requests in ms, or None when the workload is untimed.

    ``interval_ms``: request *i* at *i*·interval. ``request_rate``:
    :func:`rate_arrivals_ms` with the spec's burstiness and seed.
    """
    if spec.request_rate is None:
        if spec.interval_ms is None:
            return None
        return [i * spec.interval_ms for i in range(n)]
    return rate_arrivals_ms(n, spec.request_rate, spec.burstiness, spec.seed)


def rate_arrivals_ms(n: int, request_rate: float, burstiness: float = 1.0,
                     seed: int = 0) -> list[float]:
    """``n`` arrival times in ms at ``request_rate`` req/s, as ``vllm bench serve`` sends them.

    vLLM's ``get_request``: gaps drawn from gamma(shape ``burstiness``, scale
    1/(rate·burstiness)) — mean 1/rate, Poisson arrivals at burstiness 1 — summed, then
    scaled so that the last arrival is at n/rate exactly. ``request_rate = inf``: all at
    0; ``burstiness = inf``: constant gaps 1/rate. The gaps come from the random stream
    ``(seed, 1)`` (not the one prompts are drawn from); times are rounded to µs.
    """
    if not request_rate > 0:
        raise UsageError(f"must be a positive number of requests per second or inf, got "
                         f"{request_rate}", field="request_rate")
    if not burstiness > 0:
        raise UsageError(f"must be positive (1: Poisson arrivals) or inf, got {burstiness}",
                         field="burstiness")
    not_negative(seed, "seed")
    if request_rate == math.inf:
        return [0.0] * n
    if burstiness == math.inf:
        gaps = np.full(n, 1.0 / request_rate)
    else:
        rng = np.random.default_rng([seed, 1])
        gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=n)
    times = np.cumsum(gaps)
    if n and times[-1] != 0:
        times *= (n / request_rate) / times[-1]
    return [round(float(t) * 1000.0, 3) for t in times]


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


def _record(times: list[float] | None, index: int, session: int | None, round_: int | None,
            input_length: int, output_length: int, block_tokens: int) -> dict[str, Any]:
    rec: dict[str, Any] = {}
    if times is not None:
        rec["timestamp"] = times[index]
    if session is not None:
        rec["session"] = session
    if round_ is not None:
        rec["round"] = round_
    rec.update(input_length=input_length, output_length=output_length,
               block_tokens=block_tokens)
    return rec


def multi_turn(spec: MultiTurn) -> Iterator[dict[str, Any]]:
    """Records of a multi-turn workload, round by round, sessions 1..C in order."""
    rng = np.random.default_rng(spec.seed)
    system = rng.integers(0, VOCAB, spec.system_prompt_tokens, dtype=np.uint32)
    histories: list[list[np.ndarray]] = [[system] for _ in range(spec.sessions)]
    chains: list[list[int]] = [[] for _ in range(spec.sessions)]
    ids = _Ids(spec.block_tokens, spec.system_prompt_tokens)
    times = arrival_times_ms(spec.sessions * spec.rounds, spec)
    index = 0
    for round_ in range(1, spec.rounds + 1):
        length = spec.input_length(round_)
        for s in range(spec.sessions):
            rec = _record(times, index, s + 1, round_, length, spec.output_tokens,
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
    lengths, outputs = spec.draw_lengths()
    prompts: Sequence[list[int]]
    if spec.form == "tokens":
        prompts = [np.concatenate([system, rng.integers(0, VOCAB, n, dtype=np.uint32)]).tolist()
                   for n in lengths]
    else:
        ids = _Ids(spec.block_tokens, spec.system_prompt_tokens)
        prompts = [ids.extend([], spec.system_prompt_tokens + n) for n in lengths]
    times = arrival_times_ms(len(lengths) * spec.iterations, spec)
    reused = set(range(len(lengths)))
    if spec.reuse_share < 1:
        keep = round(spec.reuse_share * len(lengths))
        order = np.random.default_rng([spec.seed, 4]).permutation(len(lengths)).tolist()
        reused = set(order[:keep])
    index = 0
    for iteration in range(1, spec.iterations + 1):
        for j, n in enumerate(lengths):
            rec = _record(times, index, j + 1, iteration,
                          spec.system_prompt_tokens + n, outputs[j], spec.block_tokens)
            if iteration == 1 or j in reused:
                body = list(prompts[j])
            elif spec.form == "tokens":
                body = np.concatenate([system, rng.integers(0, VOCAB, n, dtype=np.uint32)]
                                      ).tolist()
            else:
                body = ids.extend([], spec.system_prompt_tokens + n)
            rec["tokens" if spec.form == "tokens" else "hash_ids"] = body
            index += 1
            yield rec


def prefix_repetition(spec: PrefixRepetition) -> Iterator[dict[str, Any]]:
    """Records of vLLM bench's prefix-repetition workload, shuffled unless asked not to.

    The shuffle uses its own random stream ``(seed, 2)``, so both forms list the
    requests in the same order. In the ``hash_ids`` form a prefix's full blocks are
    shared by its requests and every later block is new, which is what the chained keys
    of the ``tokens`` form give.
    """
    rng = np.random.default_rng(spec.seed)
    per_prefix = spec.num_prompts // spec.num_prefixes
    groups = [g for g in range(spec.num_prefixes) for _ in range(per_prefix)]
    order = (np.random.default_rng([spec.seed, 2]).permutation(len(groups)).tolist()
             if spec.shuffle else list(range(len(groups))))
    length = spec.prefix_tokens + spec.suffix_tokens
    times = arrival_times_ms(len(groups), spec)
    prompts: list[list[int]] = []
    if spec.form == "tokens":
        for _prefix in range(spec.num_prefixes):
            prefix = rng.integers(0, VOCAB, spec.prefix_tokens, dtype=np.uint32)
            for _ in range(per_prefix):
                suffix = rng.integers(0, VOCAB, spec.suffix_tokens, dtype=np.uint32)
                prompts.append(np.concatenate([prefix, suffix]).tolist())
    shared_blocks = spec.prefix_tokens // spec.block_tokens
    full_blocks = length // spec.block_tokens
    shared: list[list[int]] = [[] for _ in range(spec.num_prefixes)]
    next_id = 0
    for index, j in enumerate(order):
        rec = _record(times, index, None, None, length, spec.output_tokens, spec.block_tokens)
        if spec.form == "tokens":
            rec["tokens"] = prompts[j]
        else:
            ids = shared[groups[j]]
            keys: list[int] = []
            for k in range(full_blocks):
                if k < shared_blocks and k < len(ids):
                    keys.append(ids[k])
                    continue
                keys.append(next_id)
                if k < shared_blocks:
                    ids.append(next_id)
                next_id += 1
            rec["hash_ids"] = keys
        yield rec




def workload_of(spec: Spec) -> dict[str, Any]:
    """The ``workload`` member of ``kvtool trace gen``'s document: ``spec``'s own numbers."""
    if isinstance(spec, MultiTurn):
        return {"kind": "multi-turn", "sessions": spec.sessions, "rounds": spec.rounds,
                "input_tokens": spec.input_tokens, "output_tokens": spec.output_tokens}
    if isinstance(spec, RandomPrompts):
        return {"kind": "random", "input_lengths": list(spec.input_lengths),
                "num_prompts": spec.num_prompts, "iterations": spec.iterations,
                "output_tokens": spec.output_tokens, "range_ratio": spec.range_ratio}
    return {"kind": "prefix-repetition", "num_prompts": spec.num_prompts,
            "num_prefixes": spec.num_prefixes, "prefix_len": spec.prefix_tokens,
            "suffix_len": spec.suffix_tokens, "output_tokens": spec.output_tokens,
            "shuffle": spec.shuffle}


def gen_document(spec: Spec, output: str, requests: int) -> dict[str, Any]:
    """``kvtool trace gen``'s document (docs/json.md): ``requests`` written to ``output``
    from ``spec``. Infinite rates are the string ``"inf"`` (JSON has no infinity)."""

    def finite(x: float) -> float | str:
        return "inf" if x == math.inf else x

    timed = spec.interval_ms is not None or spec.request_rate is not None
    return {"schema": "kvtool.trace.gen/1", "output": output, "requests": requests,
            "form": spec.form, "block_tokens": spec.block_tokens,
            "system_prompt_tokens": getattr(spec, "system_prompt_tokens", 0), "seed": spec.seed,
            "timed": timed,
            "arrivals": {"interval_ms": spec.interval_ms,
                         "request_rate": None if spec.request_rate is None
                         else finite(spec.request_rate),
                         "burstiness": None if spec.request_rate is None
                         else finite(spec.burstiness)},
            "workload": workload_of(spec)}
