"""Capacity planning for multi-turn KV-cache workloads (docs/plan.md).

The workload: C sessions served round robin, each adding Δ = N + M tokens per round (N new
input tokens, an M-token answer) after a system prompt of S tokens that every session
shares. The cache stores whole blocks of B tokens, s bytes each (s = b·B for b bytes per
token), ρ replicas. Sizes are per tensor-parallel rank (docs/definitions.md): s is the KV
object one rank stores per block and M one rank's tier, so the classic per-rank
duplication t is inside s (s ≈ t·s_copy/tp) and does not appear again below.

Footprint (unique stored bytes) after round r, with block rounding and the system
prompt's full blocks counted once::

    L_r = S + r·Δ                       (answer KV stored in its own round)
        = S + r·N + (r−1)·M             (--answer-kv next-round: stored when re-sent)
    U_r = ⌊S/B⌋ + C·(⌊L_r/B⌋ − ⌊S/B⌋)    unique blocks
    F_r = ρ·s·U_r

Onset: a tier (or hierarchy) of capacity M with watermark h first evicts a live block in
round ``r* = min{r : F_r > h·M}``. ``collapse_round`` interpolates within that round:
``(r*−1) + (h·M − F_{r*−1}) / (F_{r*} − F_{r*−1})``; with S = 0 and no rounding it equals
the closed form ``R = h·M / (ρ·C·b·Δ)`` (the classic ``h·M / (ρ·t·C·b·Δ)`` with its
M the tiers of all ranks together and b a full copy's bytes per token).

Hit ratios per round (token hit ratio, docs/definitions.md):

* **no eviction** (infinite cache): a round-r request hits the previous round's stored
  full blocks;
* **lru** (head-first, the reports' DRAM store): sessions served before the crossing
  point in round r* still hit; from then on every session's chain head is the oldest
  block when it is needed, so each later request finds only the (always recent) shared
  system-prompt blocks — the head-first cascade of docs/plan.md;
* **best** (oracle: keep a fixed subset of sessions): the k sessions that fit in h·M
  keep hitting, the others hit the system prompt only.

``cliff_round`` applies the collapse rule of docs/definitions.md (first r ≥ 3 with a ≥ 25 % relative
drop) to the lru curve. A hierarchy's capacity is the largest tier's with write-through
(every tier below holds a copy of every block) and the sum of the tiers with write-back.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from fractions import Fraction
from typing import TYPE_CHECKING, Any, Literal

from kvtool.collapse import collapse_round
from kvtool.errors import UsageError, param
from kvtool.trace.sessions import Sessions
from kvtool.units import Capacity

if TYPE_CHECKING:
    from kvtool.geometry.blocksize import BlockSize

AnswerKV = Literal["stored", "next-round"]
WritePolicy = Literal["write-through", "write-back"]
MAX_ROUNDS = 10_000_000
"""Search limit for the onset round (beyond it the plan reports ``null``)."""
MAX_PLANNED_ROUNDS = 100_000
"""Largest ``--rounds``: the plan computes and reports every round up to it."""


@dataclass(frozen=True)
class Workload(Sessions):
    """The :class:`~kvtool.trace.sessions.Sessions` shape (C sessions × R rounds with N new input
    and M answer tokens per round) as the capacity formula models it, with ``answer_kv``:
    whether a round's answer KV is stored with it or only recomputed in the next round."""

    answer_kv: AnswerKV = "stored"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.rounds > MAX_PLANNED_ROUNDS:
            raise UsageError(f"at most {MAX_PLANNED_ROUNDS} rounds, got {self.rounds}",
                             field="rounds")
        if self.answer_kv not in ("stored", "next-round"):
            raise UsageError(f"unknown value {self.answer_kv!r} (use stored or next-round)",
                             field="answer_kv")
        if self.input_tokens + self.output_tokens == 0:
            raise UsageError("sessions must add tokens each round (N + M > 0)",
                             field="input_tokens")

    def stored_tokens(self, r: int) -> int:
        """L_r: tokens of a session whose KV is stored after round r (0 for r = 0)."""
        if r <= 0:
            return 0
        if self.answer_kv == "stored":
            return self.system_prompt_tokens + r * self.delta
        return self.input_length(r)

    @property
    def shared_blocks(self) -> int:
        return self.system_prompt_tokens // self.block_tokens

    def unique_blocks(self, r: int) -> int:
        """U_r: unique blocks stored after round r (system prompt blocks counted once)."""
        if r <= 0:
            return 0
        own = self.stored_tokens(r) // self.block_tokens - self.shared_blocks
        return self.shared_blocks + self.sessions * own


@dataclass(frozen=True)
class Storage:
    """How blocks occupy capacity: s bytes per block (one rank's), ρ replicas, watermark h."""

    block_bytes: int | None
    """s; ``None`` when no geometry was given (capacities must then be blocks or tokens)."""
    replicas: int = 1
    watermark: float = 1.0
    write_policy: WritePolicy = "write-through"
    size: BlockSize | None = None
    """Where s comes from (model, dtype, tp, t, a full copy's bytes), when known."""

    def __post_init__(self) -> None:
        if self.block_bytes is not None and self.block_bytes <= 0:
            raise UsageError(f"must be positive, got {self.block_bytes}", field="block_bytes")
        if self.replicas < 1:
            raise UsageError(f"must be at least 1, got {self.replicas}", field="replicas")
        if not 0 < self.watermark <= 1:
            raise UsageError(f"must be in (0, 1], got {self.watermark}", field="watermark")
        if self.write_policy not in ("write-through", "write-back"):
            raise UsageError(f"unknown write policy {self.write_policy!r}",
                             field="write_policy")

    @property
    def copies(self) -> int:
        """ρ: stored copies of every block (t is inside s)."""
        return self.replicas

    @property
    def unit_bytes(self) -> int:
        """Bytes one block occupies in the model (1 when working in blocks)."""
        return self.block_bytes if self.block_bytes is not None else 1


@dataclass(frozen=True)
class Scenario:
    """One tier configuration's predictions."""

    name: str
    tiers: dict[str, float]
    """Tier → capacity in model units (bytes, or blocks without geometry); absent = 0."""
    capacity: float
    """The hierarchy's effective capacity h·M in model units (inf when unbounded)."""
    collapse_round: float | None
    eviction_round: int | None
    cliff_round: int | None
    lru: list[float] = field(repr=False)
    best: list[float] = field(repr=False)
    lru_writes: list[float] = field(repr=False)
    """Model units written per round under lru, recompute included (docs/plan.md)."""


def capacity_units(cap: Capacity, storage: Storage, block_tokens: int, field_name: str) -> float:
    """A tier capacity in model units (bytes with geometry, else blocks)."""
    if cap.is_infinite:
        return math.inf
    if cap.unit == "bytes":
        if storage.block_bytes is None:
            raise UsageError(f"a capacity in bytes needs {param('model')} or "
                             f"{param('block_bytes')} (or give blocks/tokens: 5859blk, "
                             "3000000tok)", field=field_name)
        return float(cap.value)
    return float(cap.blocks(storage.unit_bytes, block_tokens) * storage.unit_bytes)


class CapacityPlan:
    """Predictions for one workload on one storage model; :meth:`to_dict` is the JSON."""

    def __init__(self, workload: Workload, storage: Storage, tiers: dict[str, float],
                 *, nvme_given: bool) -> None:
        self.w = workload
        self.s = storage
        self.tiers = {t: c for t, c in tiers.items() if c}
        if not self.tiers.get("dram"):
            raise UsageError("a DRAM tier is required (the formula's M)", field="dram")
        self.nvme_given = nvme_given
        w = workload
        self.footprint = [self.footprint_units(r) for r in range(w.rounds + 1)]
        self.infinite = [self.round_ratio(r, hit_all=True) for r in range(1, w.rounds + 1)]
        self.needed = self.footprint[-1] / storage.watermark
        without = {t: c for t, c in self.tiers.items() if t != "nvme"}
        if nvme_given:
            with_nvme = dict(self.tiers)
        else:
            with_nvme = {**self.tiers, "nvme": max(self.needed, self.tiers.get("nvme", 0.0))}
        self.without_nvme = self.scenario("without_nvme", without)
        self.with_nvme = self.scenario("with_nvme", with_nvme)
        self.as_given = self.with_nvme if nvme_given else self.without_nvme

    # -- model ---------------------------------------------------------------------------
    def footprint_units(self, r: int) -> float:
        """F_r in model units."""
        return float(self.s.copies * self.s.unit_bytes * self.w.unique_blocks(r))

    def _footprint_search(self, limit: float) -> tuple[int, float, float] | None:
        """(r*, F_{r*−1}, F_{r*}) for the first r with F_r > limit, or None."""
        if math.isinf(limit):
            return None
        w = self.w
        per_round = self.s.copies * self.s.unit_bytes * w.sessions * w.delta / w.block_tokens
        # Jump close to the answer, then step: F_r grows by about per_round each round.
        r = max(1, int(limit // per_round) - 2) if per_round > 0 else 1
        while self.footprint_units(r - 1) > limit and r > 1:
            r = max(1, r - 16)
        while r <= MAX_ROUNDS:
            f = self.footprint_units(r)
            if f > limit:
                return r, self.footprint_units(r - 1), f
            r += 1
        return None

    def round_ratio(self, r: int, *, hit_all: bool, kept: float = 1.0) -> float:
        """Token hit ratio of round r when a fraction ``kept`` of sessions keep their chains.

        The others hit only the shared system prompt's full blocks (always recent).
        """
        w = self.w
        length = w.input_length(r)
        bt = w.block_tokens
        if r == 1:
            # Only the system prompt can hit, for every session but the first to store it.
            full = w.shared_blocks * bt * (w.sessions - 1) / w.sessions
            return min(full, length) / length if length else 0.0
        chain = (w.stored_tokens(r - 1) // bt) * bt
        shared = w.shared_blocks * bt
        hit = chain if hit_all else kept * chain + (1 - kept) * shared
        return min(hit, length) / length if length else 0.0

    def scenario(self, name: str, tiers: dict[str, float]) -> Scenario:
        caps = [c for c in tiers.values() if c]
        total = (max(caps) if self.s.write_policy == "write-through" else sum(caps)) if caps else 0.0
        limit = self.s.watermark * total
        found = self._footprint_search(limit)
        collapse = eviction = None
        w = self.w
        lru: list[float] = []
        best: list[float] = []
        writes: list[float] = []
        if found is not None:
            r_star, f_before, f_at = found
            eviction = r_star
            collapse = (r_star - 1) + (limit - f_before) / (f_at - f_before)
        for r in range(1, w.rounds + 1):
            full = self.infinite[r - 1]
            if eviction is None or r < eviction:
                lru.append(full)
                best.append(full)
                writes.append(self.footprint_units(r) - self.footprint_units(r - 1))
                continue
            kept = 0.0
            if r == eviction:
                assert collapse is not None
                # Sessions served before the crossing point (by writes) still hit.
                kept = collapse - (r - 1)
            lru.append(self.round_ratio(r, hit_all=False, kept=kept))
            # A session that misses recomputes and rewrites its whole chain but the shared
            # system-prompt blocks (which hit); the others write only their new blocks.
            own = w.stored_tokens(r) // w.block_tokens - w.shared_blocks
            own_before = max(0, w.stored_tokens(r - 1) // w.block_tokens - w.shared_blocks)
            blocks = w.sessions * (kept * (own - own_before) + (1 - kept) * own)
            if r == 1:
                blocks += w.shared_blocks
            writes.append(self.s.copies * self.s.unit_bytes * blocks)
            shared = self.s.copies * self.s.unit_bytes * w.shared_blocks
            per_session = (self.footprint_units(r) - shared) / w.sessions
            k = min(w.sessions, max(0, math.floor((limit - shared) / per_session))) \
                if per_session > 0 else w.sessions
            best.append(self.round_ratio(r, hit_all=False, kept=k / w.sessions))
        cliff = collapse_round({r: (Fraction(x), 1) for r, x in enumerate(lru, start=1)})
        return Scenario(name, tiers, limit, collapse, eviction, cliff, lru, best, writes)

    def overall(self, ratios: list[float]) -> float:
        """Whole-run token hit ratio (Σ hit tokens / Σ input tokens) of per-round ratios."""
        w = self.w
        num = sum(ratios[r - 1] * w.input_length(r) for r in range(1, w.rounds + 1))
        den = sum(w.input_length(r) for r in range(1, w.rounds + 1))
        return num / den if den else 0.0

    # -- report --------------------------------------------------------------------------
    def simple_r(self) -> float | None:
        """R = h·M / (ρ·C·b·Δ) with M the as-given hierarchy's capacity."""
        w, s = self.w, self.s
        denom = s.copies * w.sessions * (s.unit_bytes / w.block_tokens) * w.delta
        cap = self.as_given.capacity
        return None if math.isinf(cap) else cap / denom

    def _bytes(self, units: float) -> float | None:
        if self.s.block_bytes is None or math.isinf(units):
            return None
        return units

    def _blocks(self, units: float) -> float:
        return units / self.s.unit_bytes

    def _scenario_dict(self, sc: Scenario) -> dict[str, Any]:
        return {
            "tiers": {t: {"bytes": self._bytes(c), "blocks": self._blocks(c)}
                      for t, c in sc.tiers.items()},
            "effective_capacity": {"bytes": self._bytes(sc.capacity),
                                   "blocks": self._blocks(sc.capacity)},
            "collapse_round": sc.collapse_round,
            "eviction_round": sc.eviction_round,
            "cliff_round": sc.cliff_round,
            "steady_hit_ratio": {"no_eviction": self.infinite[-1], "lru": sc.lru[-1],
                                 "best": sc.best[-1]},
            "token_hit_ratio": {"no_eviction": self.overall(self.infinite),
                                "lru": self.overall(sc.lru), "best": self.overall(sc.best)},
        }

    def to_dict(self) -> dict[str, Any]:
        w, s = self.w, self.s
        b = s.unit_bytes / w.block_tokens if s.block_bytes is not None else None
        g = self.as_given
        tdup = s.size.per_rank_duplication if s.size else 1
        tp = s.size.tp if s.size else 1
        terms: dict[str, Any] = {
            "h": s.watermark, "M": self._bytes(g.capacity / s.watermark),
            "M_blocks": self._blocks(g.capacity / s.watermark),
            "rho": s.replicas, "t": tdup, "C": w.sessions, "b": b,
            "delta": w.delta, "S": w.system_prompt_tokens, "B": w.block_tokens,
            "s": s.block_bytes,
        }
        uses = [
            "R = h·M / (ρ·C·b·Δ), refined: r* = min{r : F_r > h·M}",
            f"per rank (docs/definitions.md): s = one rank's KV object per block, M = one "
            f"rank's tier; t = {tdup} rank(s) hold each byte, already inside s, so this is "
            f"the reference formula h·M / (ρ·t·C·b·Δ) with M = all {tp} rank(s)' tiers and "
            f"b = a full copy's bytes per token",
            "F_r = ρ·s·U_r with U_r = ⌊S/B⌋ + C·(⌊L_r/B⌋ − ⌊S/B⌋): block rounding, "
            "shared system prompt counted once, partial blocks not stored",
            ("L_r = S + r·Δ (answer KV stored in its own round)" if w.answer_kv == "stored"
             else "L_r = S + r·N + (r−1)·M (answer KV stored when the next round re-sends it)"),
            ("M = largest tier (write-through: lower tiers hold every block)"
             if s.write_policy == "write-through" else "M = sum of the tiers (write-back)"),
            "collapse_round interpolates F linearly inside round r*",
            "lru: head-first cascade after the crossing point (docs/plan.md); best: keep a fixed "
            "subset of sessions",
        ]
        rounds = []
        for r in range(1, w.rounds + 1):
            rounds.append({
                "round": r,
                "input_tokens": w.input_length(r),
                "stored_tokens": w.stored_tokens(r),
                "unique_blocks": w.unique_blocks(r),
                "footprint_bytes": self._bytes(self.footprint[r]),
                "footprint_blocks": self._blocks(self.footprint[r]),
                "writes_bytes": self._bytes(self.footprint[r] - self.footprint[r - 1]),
                "writes_blocks": self._blocks(self.footprint[r] - self.footprint[r - 1]),
                "lru_writes_bytes": self._bytes(g.lru_writes[r - 1]),
                "lru_writes_blocks": self._blocks(g.lru_writes[r - 1]),
                "hit_ratio": {"no_eviction": self.infinite[r - 1], "lru": g.lru[r - 1],
                              "best": g.best[r - 1]},
                "hit_ratio_without_nvme": self.without_nvme.lru[r - 1],
            })
        return {
            "schema": "kvtool.plan/1",
            "workload": {"sessions": w.sessions, "input_tokens": w.input_tokens,
                         "output_tokens": w.output_tokens,
                         "system_prompt_tokens": w.system_prompt_tokens, "rounds": w.rounds,
                         "block_tokens": w.block_tokens, "answer_kv": w.answer_kv},
            "storage": {"block_bytes": s.block_bytes, "bytes_per_token": b,
                        "block_size": s.size.to_dict() if s.size else None,
                        "replicas": s.replicas, "watermark": s.watermark,
                        "write_policy": s.write_policy},
            "formula": {"expression": "R = h·M / (ρ·C·b·Δ)", "terms": terms,
                        "R": self.simple_r(), "uses": uses},
            "collapse_round": g.collapse_round,
            "eviction_round": g.eviction_round,
            "cliff_round": g.cliff_round,
            "capacity_needed": {"bytes": self._bytes(self.needed),
                                "blocks": self._blocks(self.needed),
                                "rounds": w.rounds},
            "tiers": {
                t: {"bytes": self._bytes(c), "blocks": self._blocks(c),
                    "holds_rounds": self._holds(c),
                    "shortfall_bytes": self._bytes(max(0.0, self.needed - c))}
                for t, c in self.tiers.items()
            },
            "steady_hit_ratio": g.lru[-1],
            "scenarios": {"without_nvme": self._scenario_dict(self.without_nvme),
                          "with_nvme": {**self._scenario_dict(self.with_nvme),
                                        "nvme_sized_to_need": not self.nvme_given}},
            "rounds": rounds,
        }

    def _holds(self, capacity: float) -> float | None:
        """collapse round of a single tier of this capacity (None: never within the limit)."""
        limit = self.s.watermark * capacity
        found = self._footprint_search(limit)
        if found is None:
            return None
        r, f0, f1 = found
        return (r - 1) + (limit - f0) / (f1 - f0)


def plan(workload: Workload, storage: Storage, *, dram: Capacity, gpu: Capacity | None = None,
         nvme: Capacity | None = None) -> CapacityPlan:
    """Plan ``workload`` on tiers ``gpu``/``dram``/``nvme`` (None or zero: absent)."""
    tiers: dict[str, float] = {}
    for name, cap in (("gpu", gpu), ("dram", dram), ("nvme", nvme)):
        if cap is not None and not cap.is_zero:
            tiers[name] = capacity_units(cap, storage, workload.block_tokens, name)
    return CapacityPlan(workload, storage, tiers, nvme_given=nvme is not None and not nvme.is_zero)
