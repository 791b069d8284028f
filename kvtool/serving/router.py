"""Routers: which engine serves a request.

``make_router(name, **params)`` builds one of :data:`ROUTERS`, the registry (name → the
class, by module path: a router may live in a module of its own; its class says which
parameters it takes, in ``PARAMS``); ``router.route(request,
engines)`` returns an index into ``engines`` (a sequence of :class:`EngineView`). A router
never changes an engine; it may keep its own state (the round-robin cursor, the sessions'
engines). Every choice is repeatable: ties go to the lowest index (``kv-aware``: at random from a
seeded generator, as Dynamo breaks them).

``role`` (``route(..., role="prefill")``) restricts the choice to engines whose ``role`` is
that role or ``both`` (prefill/decode split: route to the prefill pool, then the decode
pool); an engine without a ``role`` attribute counts as ``both``. The index returned is
still into the ``engines`` given.

* ``round-robin``: the next engine in turn (one cursor per role).
* ``least-loaded``: the fewest running + waiting requests (``load()``).
* ``session-affinity``: a session's first request picks the least-loaded engine; the
  session's later requests go to the same engine. Requests without a session go to the
  least-loaded engine.
* ``kv-aware``: NVIDIA Dynamo 1.6.1's default KV router (ai-dynamo/dynamo,
  ``lib/kv-router/src/scheduling/selector``; checked against Dynamo's own offline replay,
  ``tests/serving/test_dynamo_router.py``). It keeps, per engine, what it sent there and
  has not heard back about, as Dynamo's active-sequence tracker does: the prompt tokens
  still in prefill (each request charged its uncached tokens, ``isl − overlap·B``, until
  its first token) and the distinct full prompt blocks of its unfinished requests (until
  they finish). For each eligible engine::

      overlap  = overlap_score_credit · gpu_blocks + host_cache_hit_weight · host_blocks
      prefill  = prefill_load_scale · max(0, (active_prefill_tokens + isl) / B − overlap)
      decode   = active_blocks + the request's full prompt blocks not among them
      logit    = prefill + decode + decode_active_request_weight · active_requests

  and the lowest logit wins; equal logits are broken at random (reservoir sampling, as
  Dynamo does; ``tie_break = "lowest"`` takes the lowest index), from a seeded generator
  so that a run is repeatable. ``gpu_blocks`` are the request's leading blocks in the
  engine's GPU prefix cache (Dynamo's indexer, fed by the engines' KV events),
  ``host_blocks`` the further leading blocks in its node's DRAM tier. On the decode pool of
  a P/D split the logit is the decode term alone (Dynamo's decode routing: no overlap
  credit, no prefill tracking). The engine loop tells the router when a request's prefill
  ends and when it finishes (:meth:`Router.prefill_done`, :meth:`Router.finished`).
  Defaults are Dynamo's (``KvRouterConfig``): credits 1.0 and 0.75, scale 1.0,
  ``decode_active_request_weight`` 0.0; ``overlap_score_weight`` is accepted as the older
  name of ``prefill_load_scale``.
"""

from __future__ import annotations

import importlib
import math
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Hashable, Mapping, Sequence
from typing import Any, ClassVar, Protocol

from kvtool.errors import UsageError

ROUTERS: dict[str, str] = {
    "round-robin": "kvtool.serving.router:RoundRobinRouter",
    "least-loaded": "kvtool.serving.router:LeastLoadedRouter",
    "session-affinity": "kvtool.serving.router:SessionAffinityRouter",
    "kv-aware": "kvtool.serving.router:KvAwareRouter",
}
"""The routers a cluster file's ``router`` names: name → ``module:Class`` (a subclass of
:class:`Router`). Adding one: docs/architecture.md, "Where to add…"."""
ROLES = ("prefill", "decode")


class EngineView(Protocol):
    """What a router may read of an engine (docs/serving.md, "Routers")."""

    index: int
    node: str

    def load(self) -> int: ...                                   # running + waiting requests
    def active_blocks(self) -> int: ...                          # KV blocks in use
    def gpu_prefix_blocks(self, keys: Sequence[int]) -> int: ...  # leading keys in its GPU pool
    def host_prefix_blocks(self, keys: Sequence[int]) -> int: ...  # leading keys in node DRAM


def _eligible(engines: Sequence[Any], role: str | None) -> list[int]:
    if role is None:
        out = list(range(len(engines)))
    else:
        if role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)} or None, got {role!r}")
        out = [i for i, e in enumerate(engines) if getattr(e, "role", "both") in (role, "both")]
    if not out:
        raise ValueError(f"no engine to route to (role {role!r}, {len(engines)} engines)")
    return out


def _least_loaded(engines: Sequence[Any], candidates: list[int]) -> int:
    best, best_load = candidates[0], engines[candidates[0]].load()
    for i in candidates[1:]:
        load = engines[i].load()
        if load < best_load:
            best, best_load = i, load
    return best


class Router(ABC):
    """Base class: ``route(request, engines, role=None) -> index into engines``.

    The engine loop also reports each routed request's progress: :meth:`prefill_done`
    when its first token is out, :meth:`finished` when it ends (or fails). Routers that
    track what they sent (``kv-aware``) use them; the others ignore them.
    """

    name = ""
    PARAMS: ClassVar[frozenset[str]] = frozenset()
    """The keyword parameters the constructor takes (from the cluster file's ``[router]``
    table); none by default."""
    ALIASES: ClassVar[Mapping[str, str]] = {}
    """Older names of parameters → their names."""

    @abstractmethod
    def route(self, request: Any, engines: Sequence[Any], role: str | None = None, *,
              keys: Sequence[int] | None = None) -> int:
        """The chosen engine's index in ``engines`` (``keys``: the request's block keys at
        the engines' block size, when they differ from ``request.block_keys``)."""

    def prefill_done(self, request: Any, role: str | None = None) -> None:  # noqa: B027
        """``request``'s prefill (routed with ``role``) has ended: its first token is out."""

    def finished(self, request: Any, role: str | None = None) -> None:  # noqa: B027
        """``request`` (routed with ``role``) has ended on its engine, or failed."""

    def params(self) -> dict[str, Any]:
        """The router's parameters (JSON-ready)."""
        return {}


class RoundRobinRouter(Router):
    """Engines in turn, one cursor per role (invariant: cursor counts requests routed)."""

    name = "round-robin"

    def __init__(self) -> None:
        self._next: dict[str | None, int] = {}

    def route(self, request: Any, engines: Sequence[Any], role: str | None = None, *,
              keys: Sequence[int] | None = None) -> int:
        candidates = _eligible(engines, role)
        n = self._next.get(role, 0)
        self._next[role] = n + 1
        return candidates[n % len(candidates)]


class LeastLoadedRouter(Router):
    """The engine with the fewest running + waiting requests; ties by index."""

    name = "least-loaded"

    def route(self, request: Any, engines: Sequence[Any], role: str | None = None, *,
              keys: Sequence[int] | None = None) -> int:
        return _least_loaded(engines, _eligible(engines, role))


class SessionAffinityRouter(Router):
    """A session sticks to the engine its first request went to (one map per role)."""

    name = "session-affinity"

    def __init__(self) -> None:
        self._home: dict[tuple[str | None, Hashable], int] = {}

    def route(self, request: Any, engines: Sequence[Any], role: str | None = None, *,
              keys: Sequence[int] | None = None) -> int:
        candidates = _eligible(engines, role)
        session = getattr(request, "session", None)
        if session is None:
            return _least_loaded(engines, candidates)
        home = self._home.get((role, session))
        if home is not None and home < len(engines) and home in candidates:
            return home
        pick = _least_loaded(engines, candidates)
        self._home[(role, session)] = pick
        return pick


class _Active:
    """What the KV router has sent to one engine and not heard back about (Dynamo's
    active sequences): prompt tokens in prefill, and a count per full prompt block."""

    __slots__ = ("blocks", "prefill_tokens", "requests", "total")

    def __init__(self) -> None:
        self.prefill_tokens = 0
        self.requests = 0
        self.total = 0
        """Prompt blocks of the active requests, shared ones counted once per request."""
        self.blocks: Counter[int] = Counter()


TIE_BREAKS = ("random", "lowest")


class KvAwareRouter(Router):
    """Dynamo's KV router (module docstring): prefix overlap against tracked load."""

    name = "kv-aware"
    PARAMS = frozenset({"overlap_score_credit", "prefill_load_scale", "host_cache_hit_weight",
                        "decode_active_request_weight", "block_tokens", "track_prefill_tokens",
                        "assume_kv_reuse", "tie_break", "seed"})
    ALIASES: ClassVar[Mapping[str, str]] = {"overlap_score_weight": "prefill_load_scale"}

    def __init__(self, *, overlap_score_credit: float = 1.0, prefill_load_scale: float = 1.0,
                 host_cache_hit_weight: float = 0.75, decode_active_request_weight: float = 0.0,
                 block_tokens: int | None = None, track_prefill_tokens: bool = True,
                 assume_kv_reuse: bool = True, tie_break: str = "random",
                 seed: int = 0) -> None:
        for key, v in (("overlap_score_credit", overlap_score_credit),
                       ("prefill_load_scale", prefill_load_scale),
                       ("host_cache_hit_weight", host_cache_hit_weight),
                       ("decode_active_request_weight", decode_active_request_weight)):
            if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) \
                    or v < 0:
                raise UsageError(f"must be a number >= 0, got {v!r}", field=key)
        if block_tokens is not None and (isinstance(block_tokens, bool)
                                         or not isinstance(block_tokens, int) or block_tokens <= 0):
            raise UsageError(f"must be a positive integer, got {block_tokens!r}",
                             field="block_tokens")
        for key, b in (("track_prefill_tokens", track_prefill_tokens),
                       ("assume_kv_reuse", assume_kv_reuse)):
            if not isinstance(b, bool):
                raise UsageError(f"must be true or false, got {b!r}", field=key)
        if tie_break not in TIE_BREAKS:
            raise UsageError(f"use {' or '.join(TIE_BREAKS)}, got {tie_break!r}",
                             field="tie_break")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise UsageError(f"must be a whole number, got {seed!r}", field="seed")
        self.overlap_score_credit = float(overlap_score_credit)
        self.prefill_load_scale = float(prefill_load_scale)
        self.host_cache_hit_weight = float(host_cache_hit_weight)
        self.decode_active_request_weight = float(decode_active_request_weight)
        self.block_tokens = block_tokens
        self.track_prefill_tokens = track_prefill_tokens
        self.assume_kv_reuse = assume_kv_reuse
        self.tie_break = tie_break
        self.seed = seed
        import random

        self._rng = random.Random(seed)
        self._active: dict[int, _Active] = {}
        # (id(request), role) → (engine index, prefill tokens still charged, its blocks)
        self._sent: dict[tuple[int, str | None], tuple[int, int, tuple[int, ...]]] = {}

    def params(self) -> dict[str, Any]:
        return {"overlap_score_credit": self.overlap_score_credit,
                "prefill_load_scale": self.prefill_load_scale,
                "host_cache_hit_weight": self.host_cache_hit_weight,
                "decode_active_request_weight": self.decode_active_request_weight,
                "track_prefill_tokens": self.track_prefill_tokens,
                "assume_kv_reuse": self.assume_kv_reuse,
                "tie_break": self.tie_break, "seed": self.seed}

    def _bt(self, request: Any, keys: Sequence[int]) -> int:
        bt = self.block_tokens or getattr(request, "block_tokens", None)
        if isinstance(bt, int) and bt > 0:
            return bt
        n = getattr(request, "input_length", None)
        return max(1, -(-n // len(keys))) if isinstance(n, int) and keys else 1

    def request_blocks(self, request: Any, keys: Sequence[int]) -> int:
        """The prompt's blocks, a partial last block included (Dynamo's request blocks)."""
        n = getattr(request, "input_length", None)
        if isinstance(n, int):
            return -(-n // self._bt(request, keys))
        return len(keys)

    def _load(self, index: int) -> _Active:
        a = self._active.get(index)
        if a is None:
            a = self._active[index] = _Active()
        return a

    def _score(self, request: Any, engines: Sequence[Any], role: str | None,
               keys: Sequence[int]) -> dict[int, tuple[float, int, tuple[int, ...]]]:
        """Each eligible engine's (logit, uncached prompt tokens, full prompt blocks)."""
        isl = getattr(request, "input_length", None)
        B = self._bt(request, keys)
        if not isinstance(isl, int):
            isl = len(keys) * B
        full = tuple(keys[: isl // B])
        decode_pool = role == "decode"
        out: dict[int, tuple[float, int, tuple[int, ...]]] = {}
        for i in _eligible(engines, role):
            e = engines[i]
            a = self._load(getattr(e, "index", i))
            if decode_pool:
                gpu = host = 0
            else:
                gpu = e.gpu_prefix_blocks(keys) if keys else 0
                host_fn = getattr(e, "host_prefix_blocks", None)
                host = max(0, host_fn(keys) - gpu) if keys and host_fn is not None else 0
            credit = self.overlap_score_credit * gpu + self.host_cache_hit_weight * host
            uncached = max(0, isl - gpu * B)
            tracked = self.track_prefill_tokens and not decode_pool
            raw = (a.prefill_tokens + isl) / B if tracked else 0.0
            prefill = self.prefill_load_scale * max(raw - credit, 0.0)
            if self.assume_kv_reuse:
                # chained keys are distinct within a prompt: its blocks not yet active
                blocks = a.blocks
                decode = len(blocks) + list(map(blocks.__contains__, full)).count(False)
            else:
                decode = a.total + len(full)
            logit = prefill + decode + self.decode_active_request_weight * a.requests
            out[i] = (logit, uncached, full)
        return out

    def logits(self, request: Any, engines: Sequence[Any], role: str | None = None, *,
               keys: Sequence[int] | None = None) -> dict[int, float]:
        """Each eligible engine's cost (lower is better)."""
        if keys is None:
            keys = getattr(request, "block_keys", ())
        return {i: v[0] for i, v in self._score(request, engines, role, keys).items()}

    def route(self, request: Any, engines: Sequence[Any], role: str | None = None, *,
              keys: Sequence[int] | None = None) -> int:
        if keys is None:
            keys = getattr(request, "block_keys", ())
        scores = self._score(request, engines, role, keys)
        best, best_cost, ties = -1, math.inf, 0
        for i, (cost, _u, _f) in scores.items():
            if cost < best_cost:
                best, best_cost, ties = i, cost, 1
            elif cost == best_cost:
                ties += 1
                if self.tie_break == "random" and self._rng.randrange(ties) == 0:
                    best = i
        self._commit(request, engines, best, role, scores[best])
        return best

    def assign(self, request: Any, engines: Sequence[Any], j: int, role: str | None = None,
               *, keys: Sequence[int] | None = None) -> int:
        """Send ``request`` to ``engines[j]`` whatever its cost, tracking it as :meth:`route`
        does (a replay of another router's choices: tests/serving/test_dynamo_router.py)."""
        if keys is None:
            keys = getattr(request, "block_keys", ())
        scores = self._score(request, engines, role, keys)
        self._commit(request, engines, j, role, scores[j])
        return j

    def _commit(self, request: Any, engines: Sequence[Any], best: int, role: str | None,
                score: tuple[float, int, tuple[int, ...]]) -> None:
        _cost, uncached, full = score
        index = getattr(engines[best], "index", best)
        a = self._load(index)
        charge = uncached if self.track_prefill_tokens and role != "decode" else 0
        a.prefill_tokens += charge
        a.requests += 1
        a.total += len(full)
        a.blocks.update(full)  # counted in C
        key = (id(request), role)
        old = self._sent.pop(key, None)
        if old is not None:  # routed again before it ended (a retry): forget the old send
            self._release(old)
        self._sent[key] = (index, charge, full)

    def prefill_done(self, request: Any, role: str | None = None) -> None:
        key = (id(request), role)
        sent = self._sent.get(key)
        if sent is not None and sent[1]:
            index, charge, full = sent
            self._load(index).prefill_tokens -= charge
            self._sent[key] = (index, 0, full)

    def finished(self, request: Any, role: str | None = None) -> None:
        sent = self._sent.pop((id(request), role), None)
        if sent is not None:
            self._release(sent)

    def _release(self, sent: tuple[int, int, tuple[int, ...]]) -> None:
        index, charge, full = sent
        a = self._load(index)
        a.prefill_tokens -= charge
        a.requests -= 1
        a.total -= len(full)
        blocks = a.blocks
        for k in full:
            n = blocks[k] - 1
            if n:
                blocks[k] = n
            else:
                del blocks[k]


def router_class(name: str) -> type[Router]:
    """The registered class of router ``name`` (case and ``_``/``-`` as the file may write
    them); an unknown name is a :class:`UsageError` naming the known ones."""
    key = str(name).strip().lower().replace("_", "-")
    where = ROUTERS.get(key)
    if where is None:
        raise UsageError(f"unknown router {name!r} (known: {', '.join(ROUTERS)})",
                         field="router")
    module, _, cls = where.partition(":")
    found: type[Router] = getattr(importlib.import_module(module), cls)
    return found


def make_router(name: str, *, defaults: Mapping[str, Any] | None = None,
                **params: Any) -> Router:
    """A router by name (one of :data:`ROUTERS`); unknown names or parameters are
    :class:`UsageError` naming them. ``defaults``: values for parameters not given, used
    only by a router that takes them (the cluster's block size)."""
    cls = router_class(name)
    if not cls.PARAMS:
        if params:
            k = next(iter(params))
            raise UsageError(f"the {cls.name} router takes no parameters, got {k!r}", field=k)
        return cls()
    for k in params:
        if cls.ALIASES.get(k, k) not in cls.PARAMS:
            raise UsageError(f"unknown parameter {k!r} of the {cls.name} router (known: "
                             f"{', '.join(sorted(cls.PARAMS | set(cls.ALIASES)))})", field=k)
    kw = {cls.ALIASES.get(k, k): v for k, v in params.items()}
    for k, v in (defaults or {}).items():
        if k in cls.PARAMS:
            kw.setdefault(k, v)
    return cls(**kw)
