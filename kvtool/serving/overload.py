"""Overload, said out loud: does the offered load exceed what the modelled engines serve?

An open-loop run (a trace's timestamps, or a Poisson request rate) sends requests whether
or not earlier ones have ended. When they arrive faster than the engines can finish them,
the queue grows through the run and every later request waits longer: TTFTs of hours are
then the queue, not the cache or the engine. :func:`assess` says so, in numbers:

* **arrival rate** ``λ`` = requests / (last arrival − first arrival), over the requests
  that arrived at distinct times (an open loop; a closed loop cannot overload: its
  ``C`` users wait for their replies);
* **modelled capacity** ``μ`` = Σ over engines of (requests that engine finished / the
  seconds it was busy): the rate the engines finish requests while they work. Under
  load below capacity an engine idles part of the time, so ``μ ≥ λ``; at saturation it
  is busy throughout and ``μ`` is what it achieves with the run's own mix of requests;
* **the queue grows**: the mean wait from arrival to first scheduling of the last third
  of the requests (by arrival) is longer than the first third's by more than a second.

``overloaded`` = ``λ > 1.05 μ`` and the queue grows. :data:`TRY` lists what to change
(:data:`TRY_REPLAY` for a plain replay's one engine).
Every figure here is **simulated** (the serving model's clock).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

MARGIN = 1.05
"""λ must exceed μ by 5 % (numerical slack: μ is an estimate from the run itself)."""
GROWTH_S = 1.0
"""The queue grows: the last third's mean wait exceeds the first third's by this much."""
TRY = ("a cluster file with more engines, or faster GPUs (--cluster FILE)",
       "--concurrency C (a closed loop of C users: requests wait for replies)",
       "--speedup X (X < 1 sends the trace's timestamps slower)")
"""What to try with ``--cluster``, in the order the line gives them."""
TRY_REPLAY = ("--cluster FILE (several engines; there --speedup X < 1 also slows the "
              "trace's timestamps)",
              "--concurrency C (a closed loop of C users: requests wait for replies)",
              "--engine-gpu GPU (a faster engine)")
"""What to try in a plain replay (one engine; ``--speedup`` needs ``--cluster``)."""


def assess(arrivals: Sequence[float], first_scheduled: Sequence[float],
           engine_done: Sequence[int], engine_busy_s: Sequence[float],
           load_kind: str) -> dict[str, Any]:
    """The ``overload`` block of a serving report (module docstring).

    ``arrivals`` / ``first_scheduled``: each finished request's arrival and first
    scheduling (seconds); ``engine_done`` / ``engine_busy_s``: each engine's finished
    requests and busy seconds; ``load_kind``: the load's kind (``concurrency``,
    ``request-rate``, ``timestamps``).
    """
    out: dict[str, Any] = {"overloaded": False, "arrival_rate": None, "capacity_rps": None,
                           "ratio": None, "queue_first_s": None, "queue_last_s": None,
                           "basis": "simulated", "try": []}
    capacity = sum(d / b for d, b in zip(engine_done, engine_busy_s, strict=True) if b > 0)
    out["capacity_rps"] = capacity if capacity > 0 else None
    if load_kind == "concurrency" or len(arrivals) < 3:
        return out
    span = max(arrivals) - min(arrivals)
    if not span > 0:
        return out  # all at once (request rate inf): a burst, not a rate
    rate = (len(arrivals) - 1) / span
    out["arrival_rate"] = rate
    pairs = sorted(zip(arrivals, first_scheduled, strict=True))
    third = max(1, len(pairs) // 3)
    first = sum(s - a for a, s in pairs[:third]) / third
    last = sum(s - a for a, s in pairs[-third:]) / third
    out["queue_first_s"], out["queue_last_s"] = first, last
    if capacity > 0:
        out["ratio"] = rate / capacity
        if rate > MARGIN * capacity and last - first > GROWTH_S:
            out["overloaded"] = True
            out["try"] = list(TRY)
    return out


def line(block: dict[str, Any] | None) -> str | None:
    """The one line a report prints when ``block`` says the run was overloaded."""
    if not block or not block.get("overloaded"):
        return None
    return (f"overloaded: requests arrive at {block['arrival_rate']:,.3g}/s, the modelled "
            f"engines finish at most {block['capacity_rps']:,.3g}/s "
            f"({block['ratio']:,.1f}× capacity), so the queue grows through the run "
            f"(mean wait {block['queue_first_s']:,.0f} s → {block['queue_last_s']:,.0f} s); "
            f"try {'; '.join(block['try'])}")
