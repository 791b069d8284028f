"""Hits decided in serve order: the serving model timing what the tier hierarchy decides.

A plain ``kvtool replay`` (no ``--cluster``) runs one loop: the serving model's engine
(:mod:`kvtool.serving.engine`: its scheduler, batches and step times, the flows over its
links) drives the tier hierarchy of :mod:`kvtool.cache`, which alone decides and counts
every hit, put and eviction. :class:`ServeOrderStack` is the engine's
:class:`~kvtool.serving.engine.Offload` that joins the two:

* **When a request is first admitted**, the stack asks the hierarchy to serve it
  (:meth:`Decider.decide`: lookup, loads, store, promotions, evictions, counted as the
  replayer counts them; in data mode the bytes move then, checked). Requests are decided in
  serve order, whatever the engine does: one that arrives before an earlier request was
  decided (the engine cannot hold it, say) first has every earlier one decided, and the
  run ends by deciding the rest. So the hierarchy sees exactly the request stream of a
  ``--no-times`` replay, and its hits, puts and evictions are the same, count for count.
* **The engine then times that decision:** the blocks the hierarchy's GPU tier held are
  adopted at once (GPU memory outside the engine's working pool, which caches nothing
  itself); the blocks found in DRAM or NVMe are loaded, each tier's as one flow over its
  path (PCIe; the target, NIC and PCIe), the request waiting for the last; the rest is
  computed. vLLM never hits a prompt's last token, so the last block is computed when
  every block was found. Nothing is declined: every hit the report counts is loaded.
* **When a request finishes**, the blocks the hierarchy wrote into each tier below for it
  (its puts, promotions and demotions) flow there over the path of a load, the other way,
  behind compute, sharing the links with the loads.

What the model leaves out here: the GPU tier's cached blocks take no room from the running
requests (the engine's pool is the tier's size plus the longest request, as data mode's
GPU pool). A block that failed its check in data mode is loaded from the tier that served
it instead, or computed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from kvtool.serving.sim import ClusterSetup, TierSetup, TierStack

if TYPE_CHECKING:
    from kvtool.serving.engine import Engine, Seq
    from kvtool.serving.sim import Simulation


class Decider(Protocol):
    """The tier hierarchy as it serves requests in serve order
    (:class:`kvtool.cache.replayer.Replayer`, data mode's ``DataReplayer``)."""

    names: list[str]
    """The hierarchy's tiers, highest first (``gpu``, ``dram``, ``nvme``)."""

    def decide(self, req: Any) -> tuple[list[int], list[int]]:
        """Serve ``req`` now; return, per tier, the blocks it hit there and the blocks
        written there for it."""


class _Decision:
    """One request's decision, in blocks: held in the GPU tier, found in each tier below
    (by name, highest first), written into each tier below."""

    __slots__ = ("found", "resident", "written")

    def __init__(self, resident: int, found: dict[str, int], written: dict[str, int]) -> None:
        self.resident = resident
        self.found = found
        self.written = written


class ServeOrderStack(TierStack):
    """The engine's tiers below when the tier hierarchy decides every hit (module
    docstring). ``requests``: the run's requests in serve order (``Seq.index`` indexes
    them); ``on_decided(i)``: called after request ``i`` was decided; ``on_finished(i,
    ttft)``: when it finished, with its simulated TTFT."""

    serve_order = True

    def __init__(self, sim: Simulation, setup: ClusterSetup, block_tokens: int, *,
                 decider: Decider, requests: Sequence[Any],
                 on_decided: Callable[[int], None] | None = None,
                 on_finished: Callable[[int, float], None] | None = None) -> None:
        super().__init__(sim, setup, block_tokens)
        self.decider = decider
        self.requests = requests
        self.on_decided = on_decided
        self.on_finished = on_finished
        self._next = 0
        self._decisions: dict[int, _Decision] = {}
        self.blocks_loaded: dict[str, int] = {}
        """Blocks each tier's load flows carried (the decider counted the hits)."""
        names = decider.names
        self._gpu = 0 if names and names[0] == "gpu" else -1
        self._lower: dict[str, tuple[str, TierSetup | None]] = {}
        """A hierarchy tier's name → the stack's tier whose path its flows take."""
        specs = {t.name: t for t in setup.tiers}
        for n in names:
            if n == "gpu":
                continue
            name = "dram" if n == "dram" else "nvme"
            if name in specs:
                self._lower[n] = (name, None if name == "dram" else specs[name])

    @property
    def present(self) -> bool:
        return True  # every request is decided here, with or without tiers below

    def counted(self) -> dict[str, dict[str, int]]:
        """The blocks the loads carried; promotions and evictions are the decider's."""
        return {"blocks_loaded": dict(self.blocks_loaded), "blocks_promoted": {},
                "evictions": {}}

    # ------------------------------------------------------------- serve order
    def _decide_through(self, index: int) -> None:
        """Decide every request up to ``index`` not yet decided, in serve order."""
        decider, names, reqs = self.decider, self.decider.names, self.requests
        gpu = self._gpu
        while self._next <= index:
            i = self._next
            per, written = decider.decide(reqs[i])
            self._decisions[i] = _Decision(
                per[gpu] if gpu >= 0 else 0,
                {names[j]: c for j, c in enumerate(per) if c and j != gpu},
                {names[j]: c for j, c in enumerate(written) if c and j != gpu})
            self._next = i + 1
            if self.on_decided is not None:
                self.on_decided(i)

    def finish(self) -> None:
        """Decide the requests the engine never admitted (end of the run)."""
        self._decide_through(len(self.requests) - 1)

    def _decision(self, seq: Seq) -> _Decision:
        d = self._decisions.get(seq.index)
        if d is None:
            self._decide_through(seq.index)
            d = self._decisions[seq.index]
        return d

    # ------------------------------------------------------------- Offload protocol
    def host_prefix_blocks(self, engine: Engine, keys: Sequence[int]) -> int:
        return 0  # one engine: no router asks

    def resident_tokens(self, engine: Engine, seq: Seq, start_tokens: int, limit_tokens: int
                        ) -> int:
        got = self._decision(seq).resident * self.B
        return max(0, min(got, limit_tokens - start_tokens))

    def plan_load(self, engine: Engine, seq: Seq, start_tokens: int, limit_tokens: int
                  ) -> tuple[int, int]:
        d = self._decision(seq)
        blocks = sum(d.found.values())
        room = max(0, limit_tokens - start_tokens) // self.B
        return min(blocks, room) * self.B, 0

    def start_load(self, engine: Engine, seq: Seq, start_tokens: int, tokens: int,
                   now: float) -> None:
        d = self._decision(seq)
        left = tokens // self.B
        bb = self.sim.setups[engine.index].block_bytes
        flows: list[tuple[str, TierSetup | None, int]] = []
        for n, count in d.found.items():  # highest tier first: a cut drops the lowest's
            c = count if count < left else left
            left -= c
            where = self._lower.get(n)
            if c and where is not None:
                flows.append((where[0], where[1], c))
        seq.ext_by_tier = {name: c * self.B for name, _spec, c in flows}
        seq.loads_pending = len(flows)
        if not flows:  # (a tier with no path: nothing to wait for)
            self._load_done(engine, seq, tokens)(now)
            return
        for name, spec, c in flows:
            nbytes = c * bb
            self.bytes_loaded[name] = self.bytes_loaded.get(name, 0) + nbytes
            self.blocks_loaded[name] = self.blocks_loaded.get(name, 0) + c
            target = spec.targets[0][0] if spec is not None and spec.targets else None
            self.net.start(now, nbytes, self._path(engine, name, spec, target, True),
                           self._load_done(engine, seq, tokens))

    def store(self, engine: Engine, seq: Seq, now: float,
              stored: Callable[[float], None] | None = None) -> None:
        """The request's puts flow to their tiers (nobody waits for them)."""
        d = self._decisions.pop(seq.index, None)
        bb = self.sim.setups[engine.index].block_bytes
        if d is not None:
            for n, c in d.written.items():
                where = self._lower.get(n)
                if where is None:
                    continue
                name, spec = where
                self.bytes_stored[name] = self.bytes_stored.get(name, 0) + c * bb
                self.blocks_stored[name] = self.blocks_stored.get(name, 0) + c
                target = spec.targets[0][0] if spec is not None and spec.targets else None
                self.net.start(now, c * bb, self._path(engine, name, spec, target, False),
                               _ignore)
        if stored is not None:
            stored(now)
        if self.on_finished is not None:
            self.on_finished(seq.index, seq.first_token - seq.arrival)


def _ignore(_t: float) -> None:
    """A store's flow has arrived (the hierarchy counted it when it decided)."""
