"""Load models: when each request of a trace reaches the cluster.

Three ways to send a trace, as ``vllm bench serve`` does, plus the trace's own clock:

* **closed loop** (``concurrency=C``, vLLM's ``--max-concurrency``): ``C`` users; each takes
  the next *session* in order of first appearance and sends its rounds one after another,
  the next round when the previous reply has ended; a request without a session is a
  session of one round. This is how a chat user behaves: round *r+1* is never sent before
  round *r* has been answered, so its prefix can hit;
* **open loop** (``request_rate=R``, vLLM's ``--request-rate``): Poisson arrivals at ``R``
  requests per second (seeded), in serve order, whether or not earlier requests have ended;
  ``R = inf`` sends everything at ``t = 0``;
* **trace timestamps** (``timestamps``, with ``speedup``): request *i* arrives at
  ``(timestamp_i − timestamp_0) / speedup`` ms.

:func:`default_load` picks what a run without a load flag uses: a timed trace at its
timestamps; an untimed one with sessions closed-loop with one user per session; an untimed
one without sessions all at once (vLLM's default ``--request-rate inf``).

Invariant: every request index is released exactly once; a closed loop releases the next
round of a user only from :meth:`Arrivals.on_finish` of that user's previous request.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from kvtool.errors import UsageError, param

LoadKind = Literal["concurrency", "request-rate", "timestamps"]
LOAD_KINDS: tuple[str, ...] = ("concurrency", "request-rate", "timestamps")


class Timed(Protocol):
    @property
    def timestamp(self) -> float: ...
    @property
    def session(self) -> str | int | None: ...


class ArrivalSource(Protocol):
    """What the event loop asks of its arrivals: :class:`Arrivals`, or another release
    order (an experiment's phased closed loop, ``kvtool.experiments.serving``). A Protocol,
    not the class: compiled (``kvtool.compiled``), ``Simulation.arrivals`` only takes an
    object of its declared type."""

    def initial(self) -> list[tuple[float, int]]:
        """``(time_s, index)`` of the requests released before anything has finished."""

    def on_finish(self, index: int, now: float) -> list[tuple[float, int]]:
        """Requests released because request ``index`` ended at ``now``."""


@dataclass(frozen=True)
class Load:
    """One load setting: its kind and value (``concurrency`` users, ``request-rate``
    req/s, or ``timestamps`` with ``value`` the speedup)."""

    kind: LoadKind
    value: float
    seed: int = 0
    by_session: bool = True
    """Closed loop: a user sends a whole session (True), or the next request in serve
    order whatever its session (False: ``vllm bench serve --max-concurrency`` over a list;
    the one-engine case of a plain replay, whose rounds are the trace's serve order)."""

    def __post_init__(self) -> None:
        if self.kind not in LOAD_KINDS:
            raise UsageError(f"unknown load {self.kind!r} (use {', '.join(LOAD_KINDS)})",
                             field="load")
        if self.kind == "concurrency":
            if self.value < 1 or self.value != int(self.value):
                raise UsageError(f"concurrency must be a whole number >= 1, got {self.value:g}",
                                 field="concurrency")
        elif not self.value > 0:
            raise UsageError(f"must be positive, got {self.value:g}",
                             field="request_rate" if self.kind == "request-rate" else "speedup")

    @property
    def label(self) -> str:
        if self.kind == "concurrency":
            return f"concurrency {int(self.value)}"
        if self.kind == "request-rate":
            return f"request rate {self.value:g}/s"
        return "trace timestamps" + (f" ×{self.value:g}" if self.value != 1 else "")

    def to_dict(self) -> dict[str, object]:
        value: float | int | str = self.value
        if self.kind == "concurrency":
            value = int(self.value)
        elif self.value == math.inf:
            value = "inf"
        return {"kind": self.kind, "value": value, "seed": self.seed}


def default_load(timed: bool, has_sessions: bool, sessions: int) -> Load:
    """The load of a run without a load flag (module docstring)."""
    if timed:
        return Load("timestamps", 1.0)
    if has_sessions:
        return Load("concurrency", float(max(1, sessions)))
    return Load("request-rate", math.inf)


class Arrivals:
    """Releases request indexes over simulated time for one :class:`Load`."""

    def __init__(self, requests: Sequence[Timed], load: Load) -> None:
        self.load = load
        self._requests = requests
        self._next_of: dict[int, int] = {}
        self._queue: list[list[int]] = []
        self._qpos = 0

    def initial(self) -> list[tuple[float, int]]:
        """``(time_s, index)`` of the requests released before anything has finished."""
        reqs = self._requests
        n = len(reqs)
        kind = self.load.kind
        if kind == "timestamps":
            if not n:
                return []
            t0 = min(r.timestamp for r in reqs)
            speed = self.load.value
            return [((r.timestamp - t0) / 1000.0 / speed, i) for i, r in enumerate(reqs)]
        if kind == "request-rate":
            rate = self.load.value
            if rate == math.inf:
                return [(0.0, i) for i in range(n)]
            rng = random.Random(self.load.seed)
            t = 0.0
            out = []
            for i in range(n):
                out.append((t, i))
                t += rng.expovariate(rate)
            return out
        # closed loop: sessions in order of first appearance, rounds in serve order
        sessions: dict[object, list[int]] = {}
        order: list[list[int]] = []
        for i, r in enumerate(reqs):
            key = r.session if r.session is not None and self.load.by_session else ("#", i)
            chain = sessions.get(key)
            if chain is None:
                chain = sessions[key] = []
                order.append(chain)
            chain.append(i)
        for chain in order:
            for a, b in itertools.pairwise(chain):
                self._next_of[a] = b
        self._queue = order
        users = min(int(self.load.value), len(order))
        self._qpos = users
        return [(0.0, chain[0]) for chain in order[:users]]

    def on_finish(self, index: int, now: float) -> list[tuple[float, int]]:
        """Requests released because request ``index`` ended at ``now`` (closed loop)."""
        if self.load.kind != "concurrency":
            return []
        nxt = self._next_of.get(index)
        if nxt is not None:
            return [(now, nxt)]
        if self._qpos < len(self._queue):
            chain = self._queue[self._qpos]
            self._qpos += 1
            return [(now, chain[0])]
        return []


def rescale_keys(block_keys: Sequence[int], n_blocks: int, trace_tokens: int,
                 engine_tokens: int) -> list[int | None]:
    """Keys of the first ``n_blocks`` blocks of ``engine_tokens`` tokens, from a trace's
    chained keys of ``trace_tokens``-token blocks (``None`` where the trace has none).

    Equal sizes keep the keys. A trace block of ``f`` engine blocks gives sub-block ``j``
    of key ``k`` the key ``k·f + j`` (injective for a fixed ``f``; two requests share it
    exactly when they share the trace block, whose key covers its whole prefix). An engine
    block of ``m`` trace blocks takes the key of its last one (a chained key names the
    whole prefix up to its end).
    """
    tB, eB = trace_tokens, engine_tokens
    have = len(block_keys)
    if tB == eB:
        if have >= n_blocks:
            return list(block_keys[:n_blocks])
        return [*block_keys, *([None] * (n_blocks - have))]
    if tB % eB == 0:
        f = tB // eB
        return [block_keys[i // f] * f + i % f if i // f < have else None
                for i in range(n_blocks)]
    m = eB // tB
    return [block_keys[i * m + m - 1] if i * m + m - 1 < have else None
            for i in range(n_blocks)]


def check_block_sizes(trace_tokens: int, engine_tokens: int) -> None:
    if trace_tokens % engine_tokens and engine_tokens % trace_tokens:
        raise UsageError(f"the engines' blocks of {engine_tokens} tokens and the trace's of "
                         f"{trace_tokens} do not divide one another: set block_tokens in the "
                         f"cluster file, or {param('block_tokens')}, so that one divides the other",
                         field="block_tokens")


def output_block_keys(requests: Sequence[object], trace_tokens: int,
                      engine_tokens: int | None = None) -> list[list[int]]:
    """Each request's keys for every *full* engine block of its prompt and its reply.

    The prompt's blocks take the trace's keys (:func:`rescale_keys` when the engine's
    blocks differ from the trace's). The blocks the reply completes get the keys the
    session's next round has at the same positions, when that round starts with this
    request's whole prompt (so the reply really is part of its prefix: the chained keys of
    a kvtool trace, Mooncake's ``hash_ids``). A block with no key from the trace gets a
    fresh one no other block has (negative, so it never equals a trace key). vLLM hashes
    a reply's blocks as it generates them; this gives them the identity the next round's
    prompt has.
    """
    tB = trace_tokens
    B = engine_tokens or trace_tokens
    check_block_sizes(tB, B)
    out: list[list[int]] = []
    last_of: dict[object, int] = {}
    nxt: dict[int, int] = {}
    for i, r in enumerate(requests):
        s = getattr(r, "session", None)
        if s is not None:
            prev = last_of.get(s)
            if prev is not None:
                nxt[prev] = i
            last_of[s] = i
    for i, r in enumerate(requests):
        prompt = r.input_length  # type: ignore[attr-defined]
        total = prompt + r.output_length  # type: ignore[attr-defined]
        full_prompt = prompt // B
        full_total = total // B
        given = rescale_keys(r.block_keys, full_prompt, tB, B)  # type: ignore[attr-defined]
        mine: list[int] = (given if None not in given else  # type: ignore[assignment]
                           [k if k is not None else -1 - (i * 65536 + b)
                            for b, k in enumerate(given)])
        if full_total > full_prompt:
            j = nxt.get(i)
            tail: list[int | None] = [None] * (full_total - full_prompt)
            if j is not None:
                theirs = rescale_keys(requests[j].block_keys, full_total, tB, B)  # type: ignore[attr-defined]
                if theirs[:full_prompt] == given and None not in given:
                    tail = theirs[full_prompt:]
            mine += [k if k is not None else -1 - (i * 65536 + full_prompt + b)
                     for b, k in enumerate(tail)]
        out.append(mine)
    return out
