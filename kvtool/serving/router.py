"""Routers: which engine serves a request.

``make_router(name, **params)`` builds one of :data:`ROUTERS`; ``router.route(request,
engines)`` returns an index into ``engines`` (a sequence of :class:`EngineView`). A router
never changes an engine; it may keep its own state (the round-robin cursor, the sessions'
engines). Every choice is deterministic: ties go to the lowest index.

``role`` (``route(..., role="prefill")``) restricts the choice to engines whose ``role`` is
that role or ``both`` (prefill/decode split: route to the prefill pool, then the decode
pool); an engine without a ``role`` attribute counts as ``both``. The index returned is
still into the ``engines`` given.

* ``round-robin``: the next engine in turn (one cursor per role).
* ``least-loaded``: the fewest running + waiting requests (``load()``).
* ``session-affinity``: a session's first request picks the least-loaded engine; the
  session's later requests go to the same engine. Requests without a session go to the
  least-loaded engine.
* ``kv-aware``: NVIDIA Dynamo's KV router cost (ai-dynamo/dynamo,
  lib/kv-router/src/scheduling/selector/default.rs, ``worker_logit``; defaults from
  lib/kv-router/src/scheduling/config.rs): for each engine,

  ``overlap = overlap_score_credit · gpu_blocks + host_cache_hit_weight · host_blocks``
  ``logit = prefill_load_scale · max(0, request_blocks − overlap) + active_blocks
  + request_blocks + decode_active_request_weight · load``

  and the lowest logit wins. ``gpu_blocks`` are the request's leading blocks in the
  engine's GPU prefix cache, ``host_blocks`` the further leading blocks in its node's DRAM
  tier (Dynamo's host-pinned tier), ``request_blocks`` the prompt's blocks (rounded up).
  ``active_blocks + request_blocks`` is Dynamo's "potential active blocks" (decode cost).
  Defaults: ``overlap_score_credit`` 1.0, ``prefill_load_scale`` 1.0,
  ``host_cache_hit_weight`` 0.75, ``decode_active_request_weight`` 0.0 (Dynamo's). With the
  defaults this is the documented cost ``logit = overlap_score_weight · prefill_blocks +
  decode_blocks`` (Dynamo docs/router/README.md; ``overlap_score_weight`` is accepted as
  the older name of ``prefill_load_scale``). Dynamo breaks ties at random and can sample
  with a temperature; kvtool takes the lowest index, always.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Hashable, Sequence
from typing import Any, Protocol

from kvtool.errors import UsageError

ROUTERS = ("round-robin", "least-loaded", "session-affinity", "kv-aware")
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
    """Base class: ``route(request, engines, role=None) -> index into engines``."""

    name = ""

    @abstractmethod
    def route(self, request: Any, engines: Sequence[Any], role: str | None = None, *,
              keys: Sequence[int] | None = None) -> int:
        """The chosen engine's index in ``engines`` (``keys``: the request's block keys at
        the engines' block size, when they differ from ``request.block_keys``)."""

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


class KvAwareRouter(Router):
    """Dynamo's KV-router cost (module docstring): prefix overlap against load."""

    name = "kv-aware"

    def __init__(self, *, overlap_score_credit: float = 1.0, prefill_load_scale: float = 1.0,
                 host_cache_hit_weight: float = 0.75, decode_active_request_weight: float = 0.0,
                 block_tokens: int | None = None) -> None:
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
        self.overlap_score_credit = float(overlap_score_credit)
        self.prefill_load_scale = float(prefill_load_scale)
        self.host_cache_hit_weight = float(host_cache_hit_weight)
        self.decode_active_request_weight = float(decode_active_request_weight)
        self.block_tokens = block_tokens

    def params(self) -> dict[str, Any]:
        return {"overlap_score_credit": self.overlap_score_credit,
                "prefill_load_scale": self.prefill_load_scale,
                "host_cache_hit_weight": self.host_cache_hit_weight,
                "decode_active_request_weight": self.decode_active_request_weight}

    def request_blocks(self, request: Any, keys: Sequence[int]) -> int:
        """The prompt's blocks, a partial last block included (Dynamo's request blocks)."""
        n = getattr(request, "input_length", None)
        bt = self.block_tokens or getattr(request, "block_tokens", None)
        if isinstance(n, int) and isinstance(bt, int) and bt > 0:
            return -(-n // bt)
        return len(keys)

    def logits(self, request: Any, engines: Sequence[Any], role: str | None = None, *,
               keys: Sequence[int] | None = None) -> dict[int, float]:
        """Each eligible engine's cost (lower is better)."""
        if keys is None:
            keys = getattr(request, "block_keys", ())
        req = self.request_blocks(request, keys)
        out: dict[int, float] = {}
        for i in _eligible(engines, role):
            e = engines[i]
            gpu = e.gpu_prefix_blocks(keys) if keys else 0
            host_fn = getattr(e, "host_prefix_blocks", None)
            host = max(0, host_fn(keys) - gpu) if keys and host_fn is not None else 0
            overlap = self.overlap_score_credit * gpu + self.host_cache_hit_weight * host
            prefill = self.prefill_load_scale * max(0.0, req - overlap)
            decode = e.active_blocks() + req
            out[i] = prefill + decode + self.decode_active_request_weight * e.load()
        return out

    def route(self, request: Any, engines: Sequence[Any], role: str | None = None, *,
              keys: Sequence[int] | None = None) -> int:
        costs = self.logits(request, engines, role, keys=keys)
        best = min(costs, key=lambda i: (costs[i], i))
        return best


_ALIASES = {"overlap_score_weight": "prefill_load_scale"}


def make_router(name: str, **params: Any) -> Router:
    """A router by name (one of :data:`ROUTERS`); unknown names or parameters are
    :class:`UsageError` naming them."""
    key = str(name).strip().lower().replace("_", "-")
    if key == "round-robin":
        cls: type[Router] = RoundRobinRouter
    elif key == "least-loaded":
        cls = LeastLoadedRouter
    elif key == "session-affinity":
        cls = SessionAffinityRouter
    elif key == "kv-aware":
        kw = {_ALIASES.get(k, k): v for k, v in params.items()}
        allowed = {"overlap_score_credit", "prefill_load_scale", "host_cache_hit_weight",
                   "decode_active_request_weight", "block_tokens"}
        for k in params:
            if _ALIASES.get(k, k) not in allowed:
                raise UsageError(f"unknown parameter {k!r} of the kv-aware router (known: "
                                 f"{', '.join(sorted(allowed | set(_ALIASES)))})", field=k)
        return KvAwareRouter(**kw)
    else:
        raise UsageError(f"unknown router {name!r} (known: {', '.join(ROUTERS)})",
                         field="router")
    if params:
        k = next(iter(params))
        raise UsageError(f"the {key} router takes no parameters, got {k!r}", field=k)
    return cls()
