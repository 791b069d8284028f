"""One inference engine, shaped like vLLM v1's scheduler (``vllm/v1/core/sched/scheduler.py``).

An engine holds a waiting queue (FCFS), a running list, a :class:`KVPool` (the GPU tier,
vLLM's prefix cache exactly) and a :class:`StepModel` (the roofline step time). Each step
it schedules like vLLM's ``Scheduler.schedule``:

1. **Running requests first**, in order: each gets ``num_tokens − num_computed_tokens``
   new tokens (the rest of its prompt, or 1 to decode), capped by the step's token budget
   (``max_num_batched_tokens``: chunked prefill). ``allocate_slots`` reserves their KV
   blocks; when the pool is full the *last* running request is preempted (its blocks freed,
   its computed tokens reset: preemption by recompute) and put back at the front of the
   waiting queue, until the allocation fits or the request preempted itself.
2. **Then waiting requests**, unless step 1 preempted any, while budget and
   ``max_num_seqs`` allow: a new (or preempted) request looks up the GPU prefix cache
   (``get_computed_blocks``), then the tiers below (:class:`Offload`); a hit there that
   loads faster than it recomputes is loaded asynchronously (vLLM's
   ``WAITING_FOR_REMOTE_KVS``: blocks allocated, the request waits in the queue while the
   flows run; once they have all arrived it holds its blocks in the ``kv_holding`` queue,
   which is scheduled before the waiting queue, as vLLM's ``kv_holding_waiting``). The
   first request that cannot be allocated stops the loop (FCFS). As vLLM's default
   ``scheduler_reserve_full_isl``, a waiting request is admitted only when its whole prompt
   fits the free blocks (and the watermark, when others run), not just its first chunk.

A step lasts :meth:`StepModel.step_time` of its batch. At its end each request's computed
tokens advance; a request that has computed all its tokens samples one (its first token
ends its prefill: TTFT); a request with all its output tokens finishes and frees its blocks
(tail first). Stores to the tiers below run behind compute (the sim starts their flows).

**Two ways to advance time**, one contract with the event loop (:mod:`kvtool.serving.sim`):

* :class:`SteppedEngine` (``exact_steps``) schedules every step on its own, every running
  request touched every step: the reference.
* :class:`EventEngine` (the default) jumps from event to event. A request that is
  decoding is not touched while nothing happens to it: its state is ``base + step`` (the
  engine's step counter), the batch's step time needs only the number of decoding
  requests and the sum of their contexts, and each decoding request has one entry in a
  heap of *stops*: the next step at which it needs a block (``allocate_slots`` takes one
  from the pool, which can evict or preempt), fills one (vLLM caches it), or samples its
  last token. While no request prefills, nothing is admitted or preempted, the steps up to
  the next stop are a run of identical decode steps with contexts one longer each; the
  engine computes their end times in one go (the same float additions, in the same order,
  as stepping) and the loop jumps to the run's end.

The contract (both engines): :meth:`Engine.plan` schedules at ``now`` and returns the time
of the engine's next own event (the end of its planned steps; ``None``: idle); nothing
anyone can observe changes in the engine before then, except through an outside event
(an arrival routed to it, a load that arrived), after which the loop calls
:meth:`Engine.cut`: the engine ends its run at the first step boundary the event can
affect, or keeps it when the event cannot change any of its coming schedules (its
admission is blocked by a request ahead of whatever the event added). :meth:`Engine.end_step`
closes the planned steps at their end and returns the requests that finished. A new
mechanism that changes a step's shape plugs in by giving the decoding requests a stop
(or by ending the run: :meth:`EventEngine.plan` plans a run only for a batch of pure
decodes); one that changes what the loop may observe mid-run must call ``cut``.

What is not skipped: every step that computes prompt tokens (a prefill chunk, mixed with
the decodes as vLLM's chunked prefill mixes them), admits, preempts, or at which a
decoding request needs or fills a block or finishes, is scheduled on its own. Both engines
give the same report, bit for bit (``tests/serving/test_time_advance.py``).
"""

from __future__ import annotations

import heapq
import itertools
import operator
from bisect import bisect_left
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final, Protocol

from kvtool.serving.kvpool import KVPool

if TYPE_CHECKING:
    from kvtool.serving.roofline import Ends

# one Final name each: compiled (mypyc), a Final int is a constant, not a module lookup
WAITING: Final = 0
LOADING: Final = 1
RUNNING: Final = 2
FINISHED: Final = 3
FAILED: Final = 4
_BLOCKED: Final = -1
_LOADS: Final = -2
"""What :meth:`Engine._admit_fresh` returns instead of a token count: the request could not
be allocated; it started loading from the tiers."""


class Seq:
    """One request inside an engine (the attributes vLLM's ``Request`` has, plus timings).

    Invariants: ``num_tokens == num_prompt_tokens + num_output``; ``block_hashes`` holds
    the keys of the full blocks of the first ``num_tokens`` tokens; ``0 <=
    num_computed_tokens <= num_tokens``. While an :class:`EventEngine` holds it as a
    decoding request (``dec_gen >= 0``) those fields are brought up to date only when the
    engine needs them (:meth:`EventEngine._materialize`); its state is then
    ``num_computed_tokens = base_c + step`` and ``num_output = base_out + step``.
    """

    __slots__ = (
        "adm",
        "arrival",
        "base_c",
        "base_out",
        "block_hashes",
        "dec_gen",
        "decode_only",
        "engine",
        "ext_by_tier",
        "ext_declined_tokens",
        "ext_tokens",
        "finish",
        "first_scheduled",
        "first_token",
        "full_keys",
        "index",
        "last_token",
        "loads_pending",
        "local_hit_tokens",
        "max_tokens",
        "num_computed_tokens",
        "num_output",
        "num_prompt_tokens",
        "num_tokens",
        "pd_source",
        "pending_blocks",
        "preemptions",
        "request_id",
        "session",
        "status",
        "target_tokens",
    )

    def __init__(self, index: int, prompt_tokens: int, max_tokens: int, full_keys: list[int],
                 block_tokens: int, arrival: float, session: object = None) -> None:
        self.index = index
        self.request_id = str(index)
        self.num_prompt_tokens = prompt_tokens
        self.max_tokens = max(1, max_tokens)
        self.num_output = 0
        self.num_tokens = prompt_tokens
        self.num_computed_tokens = 0
        self.full_keys = full_keys
        self.block_hashes: list[int] = full_keys[: prompt_tokens // block_tokens]
        self.arrival = arrival
        self.session = session
        self.status = WAITING
        self.first_scheduled = -1.0
        self.first_token = -1.0
        self.last_token = -1.0
        self.finish = -1.0
        self.local_hit_tokens = -1
        self.ext_tokens = 0
        self.ext_by_tier: dict[str, int] = {}
        self.ext_declined_tokens = 0
        self.preemptions = 0
        self.loads_pending = 0
        self.engine = -1
        self.decode_only = False
        """P/D split: the prompt's KV arrives from a prefill engine; this engine decodes."""
        self.pd_source = -1
        """P/D split: the prefill engine that holds the prompt's KV."""
        self.pending_blocks = 0
        self.target_tokens = self.max_tokens
        """P/D split: the reply's length (the prefill engine samples just one token)."""
        self.adm = -1
        """EventEngine: the request's place in the running order (-1: not running)."""
        self.dec_gen = -1
        """EventEngine: the id of its live stop while it decodes lazily (-1: it does not)."""
        self.base_c = 0
        self.base_out = 0


class Offload(Protocol):
    """The tiers below an engine's GPU pool, as the engine sees them (the sim implements it)."""

    def plan_load(self, engine: Engine, seq: Seq, start_tokens: int, limit_tokens: int
                  ) -> tuple[int, int]:
        """``(tokens to load, tokens found but declined)`` beyond ``start_tokens`` (the
        GPU hit), at most ``limit_tokens`` in all; decides load versus recompute. No side
        effect: the engine asks again at every step its request waits."""

    def note_decision(self, load: bool) -> None:
        """A request the tiers had blocks for was admitted: it loads them (``load``) or
        recomputes them (counted once per admission)."""

    def resident_tokens(self, engine: Engine, seq: Seq, start_tokens: int, limit_tokens: int
                        ) -> int:
        """Tokens beyond ``start_tokens``, at most ``limit_tokens`` in all, that GPU memory
        outside the engine's pool holds (the tier hierarchy's GPU tier when hits are
        decided in serve order, :mod:`kvtool.serving.serveorder`): adopted as computed
        without a load, in fresh blocks (0 for the tiers below)."""

    def start_load(self, engine: Engine, seq: Seq, start_tokens: int, tokens: int,
                   now: float) -> None:
        """Start the flows of a planned load; the sim calls :meth:`Engine.loaded` when the
        last one ends."""

    pd_direct: bool
    """P/D split: the decode engine pulls the prompt's KV from the prefill engine (else it
    loads it from the tiers below, where the prefill engine stored it)."""

    serve_order: bool
    """Hits are decided in serve order by the tier hierarchy (:meth:`resident_tokens` is
    asked before :meth:`plan_load`)."""

    def host_prefix_blocks(self, engine: Engine, keys: Sequence[int]) -> int:
        """Leading ``keys`` held by the engine's node DRAM tier (the router's view)."""


@dataclass
class EngineStats:
    """Counters of one engine over a run (all simulated)."""

    steps: int = 0
    busy_s: float = 0.0
    batch_seqs: int = 0
    batch_tokens: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    preemptions: int = 0
    max_batch_seqs: int = 0
    gpu_hit_tokens: int = 0
    gpu_query_tokens: int = 0
    ext_hit_tokens: int = 0
    ext_declined_tokens: int = 0
    batch_hist: dict[int, int] = field(default_factory=dict)

    def to_dict(self, span_s: float) -> dict[str, Any]:
        return {
            "steps": self.steps,
            "busy_s": self.busy_s,
            "busy_fraction": self.busy_s / span_s if span_s > 0 else 0.0,
            "mean_batch_seqs": self.batch_seqs / self.steps if self.steps else 0.0,
            "max_batch_seqs": self.max_batch_seqs,
            "mean_batch_tokens": self.batch_tokens / self.steps if self.steps else 0.0,
            "prefill_tokens": self.prefill_tokens,
            "decode_tokens": self.decode_tokens,
            "preemptions": self.preemptions,
            "gpu_prefix_hit_tokens": self.gpu_hit_tokens,
            "gpu_prefix_query_tokens": self.gpu_query_tokens,
            "external_hit_tokens": self.ext_hit_tokens,
            "external_declined_tokens": self.ext_declined_tokens,
            "batch_seqs_histogram": {str(k): v for k, v in sorted(self.batch_hist.items())},
        }


class StepTime(Protocol):
    """The step time an engine needs (:class:`~kvtool.serving.roofline.StepModel`). A
    model may also give ``decode_step_ends(start, n, ctx, k)``, the end times of a run of
    ``k`` decode steps (a vectorised :meth:`step_time_sums` added up one step at a time);
    without it the event engine adds them up itself."""

    def step_time(self, items: Sequence[tuple[int, int]]) -> float: ...

    def step_time_sums(self, prefill_tokens: int, prefill_work: float, decode_tokens: int,
                       decode_work: float, kv_tokens: float) -> float: ...


def _decode_step_ends(step: StepTime, start: float, n: int, ctx: int, k: int) -> Ends:
    """``StepModel.decode_step_ends`` for a step model without it."""
    sums = step.step_time_sums
    half = 0.5 * n
    t = start
    out = []
    for j in range(k):
        c = ctx + n * j
        t += sums(0, 0.0, n, c + half, float(c + n))
        out.append(t)
    return out


class Engine:
    """What both engines share (module docstring): the queues, the pool, the statistics,
    the router's views, admission from the queues and preemption. The event loop owns the
    clock: it calls :meth:`add`, :meth:`plan` when the engine is idle, :meth:`cut` when an
    outside event reaches it while it is busy, :meth:`end_step` when its planned steps
    end, and :meth:`loaded` when a request's loads have arrived."""

    running: Any
    """The running requests in running order (a list or an insertion-ordered dict)."""

    def __init__(self, index: int, name: str, node: str, pool: KVPool, step: StepTime, *,
                 block_tokens: int, max_num_seqs: int = 256, max_num_batched_tokens: int = 8192,
                 offload: Offload | None = None, role: str = "both") -> None:
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be positive")
        self.index = index
        self.name = name
        self.node = node
        self.pool = pool
        self.step_model = step
        self.block_tokens = block_tokens
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.offload = offload
        self.role = role
        self.waiting: deque[Seq] = deque()
        self.kv_holding: deque[Seq] = deque()
        """Requests whose loads have arrived, holding their blocks (scheduled first)."""
        self.stats = EngineStats()
        self.busy = False
        """Planned steps are in progress (until :meth:`end_step`)."""
        self._busy_since = -1.0
        """Start of the current busy period (-1: idle); ``stats.busy_s`` adds whole periods."""
        self._pending_blocks = 0
        self.plans = 0
        """Calls of :meth:`plan` that planned steps: the events the engine stopped at."""
        self._blocked: Seq | None = None
        self._can_admit = False
        self._hold_need: tuple[Seq | None, int] = (None, 0)
        """The holding queue's head when it last could not be admitted, and the free blocks
        it needs: while fewer are free it is not tried again (nothing else changes it)."""
        self._wait_need: tuple[Seq | None, int, bool, int] = (None, 0, False, 0)
        """Without prefix caching: the waiting request that last could not be admitted, its
        tokens, whether others ran, and the free blocks its whole prompt needs then (no hit
        changes it): while fewer are free, the same request is blocked again."""
        self.itl_values: list[float] = []
        self.itl_counts: list[int] = []
        self.first_tokens: list[Seq] = []
        """Requests that sampled their first token in the steps just ended (the sim takes
        them after :meth:`end_step`, to tell the router their prefill is done)."""
        self._setup()

    def _setup(self) -> None:
        """The subclass's own state, set at the end of :meth:`__init__` (one constructor
        signature for all engines: mypyc's native classes do not forward ``*args`` to a
        base class's ``__init__``)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ views (router)
    def load(self) -> int:
        """Requests this engine holds: running plus waiting (vLLM's num_running + num_waiting)."""
        return len(self.running) + len(self.waiting) + len(self.kv_holding)

    def active_blocks(self) -> int:
        """KV blocks in use, plus those the waiting requests' prompts will take (what a
        router that tracks what it sent counts, as Dynamo's active sequences do)."""
        return self.pool.num_gpu_blocks - 1 - self.pool.num_free_blocks + self._pending_blocks

    def gpu_prefix_blocks(self, keys: Sequence[int]) -> int:
        return self.pool.cached_prefix_blocks(keys)

    def host_prefix_blocks(self, keys: Sequence[int]) -> int:
        """Leading keys in this engine's node DRAM tier (0 without one)."""
        off = self.offload
        return off.host_prefix_blocks(self, keys) if off is not None else 0

    # ------------------------------------------------------------------ input
    def fits(self, seq: Seq) -> bool:
        """Whether the request could ever be held: its prompt and reply in the whole pool."""
        need = -(-(seq.num_prompt_tokens + seq.max_tokens) // self.block_tokens)
        return need <= self.pool.num_gpu_blocks - 1

    def add(self, seq: Seq) -> None:
        seq.engine = self.index
        seq.status = WAITING
        self._pend(seq)
        self.waiting.append(seq)

    def _pend(self, seq: Seq) -> None:
        seq.pending_blocks = -(-seq.num_tokens // self.block_tokens)
        self._pending_blocks += seq.pending_blocks

    def _unpend(self, seq: Seq) -> None:
        self._pending_blocks -= seq.pending_blocks
        seq.pending_blocks = 0

    def loaded(self, seq: Seq) -> None:
        """All of ``seq``'s loads have arrived: cache the loaded blocks; it waits, holding
        them, in the queue that is scheduled first."""
        self.pool.cache_blocks(seq, seq.num_computed_tokens)
        seq.status = WAITING
        self.waiting.remove(seq)
        self.kv_holding.append(seq)

    # ------------------------------------------------------------------ the contract
    def plan(self, now: float) -> float | None:
        """Schedule at ``now``; return the end of the planned steps (``None``: nothing to
        do, the engine stays idle)."""
        raise NotImplementedError

    def cut(self, now: float, after: int) -> float | None:
        """An outside event at ``now`` reached the busy engine. ``after``: engines with a
        lower index have already passed a step boundary at exactly ``now`` (the loop's
        order of simultaneous events). Returns the new end of the planned steps when the
        engine ends them early, else ``None``."""
        return None

    def end_step(self) -> list[Seq]:
        """The planned steps have ended; advance requests. Returns the requests that
        finished (in running order). Inter-token gaps go to :attr:`itl_values` /
        :attr:`itl_counts` (a value and how many tokens had it, in the order the steps
        sampled them)."""
        raise NotImplementedError

    def _start_running(self, seq: Seq) -> None:
        """Append ``seq`` to the running requests."""
        raise NotImplementedError

    # ------------------------------------------------------------------ shared steps
    def _busy(self, now: float) -> None:
        self.busy = True
        if self._busy_since < 0:
            self._busy_since = now

    def _idle(self, now: float) -> None:
        if self._busy_since >= 0:
            self.stats.busy_s += now - self._busy_since
            self._busy_since = -1.0

    def _admit(self, now: float, budget: int, batch: list[tuple[Seq, int]]) -> None:
        """Admit requests from the holding queue, then the waiting queue, into ``batch``
        while ``budget`` tokens and ``max_num_seqs`` allow (module docstring, step 2).
        Records what stopped it: :attr:`_blocked` (the request that could not be
        allocated) and :attr:`_can_admit` (budget and room for one more were left)."""
        pool = self.pool
        running = self.running
        self._blocked = None
        holding = self.kv_holding
        while holding and budget > 0 and len(running) < self.max_num_seqs:
            seq = holding[0]
            n = seq.num_tokens - seq.num_computed_tokens
            if n > budget:
                n = budget
            held, need = self._hold_need
            if held is seq and pool.num_free_blocks < need:
                self._blocked = seq  # holding its blocks, it needs as many as before
                self._can_admit = True
                return
            if pool.allocate_slots(seq, n, full_sequence_must_fit=True,
                                   has_scheduled_reqs=bool(running)) is None:
                self._hold_need = (seq, pool.full_sequence_need(seq))
                self._blocked = seq
                self._can_admit = True
                return
            if held is seq:
                self._hold_need = (None, 0)  # it may come back (preempted) holding others
            holding.popleft()
            seq.status = RUNNING
            self._start_running(seq)
            batch.append((seq, n))
            budget -= n
        waiting = self.waiting
        j = 0
        while budget > 0 and j < len(waiting):
            if len(running) >= self.max_num_seqs:
                break
            seq = waiting[j]
            if seq.status == LOADING:
                j += 1
                continue
            if seq.num_computed_tokens == 0:
                n = self._admit_fresh(now, seq, budget)
                if n == _LOADS:
                    j += 1
                    continue
            else:
                n = seq.num_tokens - seq.num_computed_tokens
                if n > budget:
                    n = budget
                if pool.allocate_slots(seq, n, full_sequence_must_fit=True,
                                       has_scheduled_reqs=bool(running)) is None:
                    n = _BLOCKED
            if n == _BLOCKED:
                self._blocked = seq
                self._can_admit = True
                return
            del waiting[j]
            self._unpend(seq)
            seq.status = RUNNING
            if seq.first_scheduled < 0:
                seq.first_scheduled = now
            self._start_running(seq)
            batch.append((seq, n))
            budget -= n
        self._can_admit = budget > 0 and len(running) < self.max_num_seqs

    def _admit_fresh(self, now: float, seq: Seq, budget: int) -> int:
        """Look up the prefix of waiting request ``seq``, which has computed nothing, in the
        GPU pool and the tiers, and allocate its slots: the tokens it computes this step,
        ``_LOADS`` when it starts loading from the tiers instead, or ``_BLOCKED`` when its
        blocks do not fit."""
        pool = self.pool
        running = self.running
        off = self.offload
        has_running = bool(running)
        w_seq, w_tokens, w_running, w_need = self._wait_need
        if (w_seq is seq and w_tokens == seq.num_tokens and w_running is has_running
                and pool.num_free_blocks < w_need):
            return _BLOCKED  # as below: it still needs more than is free
        blocks, local = pool.get_computed_blocks(seq)
        need = pool.full_sequence_need(seq, blocks, has_scheduled_reqs=has_running)
        if need > pool.num_free_blocks:
            # whether it loads or recomputes, its whole prompt must fit: it does
            # not, so the tiers' answer cannot change this step (it has no effect)
            if not pool.enable_caching:  # no hit: its need stays while it waits
                self._wait_need = (seq, seq.num_tokens, has_running, need)
            return _BLOCKED
        first_time = seq.local_hit_tokens < 0
        ext = declined = resident = 0
        if off is not None and seq.decode_only and off.pd_direct:
            # P/D split: pull the prompt's KV from the prefill engine, all but the
            # last token, which this engine computes to sample the first token
            ext = max(0, seq.num_tokens - 1 - local)
        elif off is not None:
            cap = ((seq.num_tokens - 1) // self.block_tokens) * self.block_tokens
            if off.serve_order:  # GPU memory outside the pool may hold part of it
                resident = off.resident_tokens(self, seq, local, cap)
                local += resident
            ext, declined = off.plan_load(self, seq, local, cap)
            if first_time:
                seq.ext_declined_tokens = declined
        if ext:
            if pool.allocate_slots(seq, 0, local - resident, blocks,
                                   num_external_computed_tokens=resident + ext,
                                   delay_cache_blocks=True, full_sequence_must_fit=True,
                                   has_scheduled_reqs=bool(running)) is None:
                return _BLOCKED
            assert off is not None
            if not seq.decode_only:
                off.note_decision(True)
            self._record_hits(seq, local, ext, first_time)
            self._unpend(seq)
            seq.status = LOADING
            seq.num_computed_tokens = local + ext
            if seq.first_scheduled < 0:
                seq.first_scheduled = now
            off.start_load(self, seq, local, ext, now)
            return _LOADS
        n = seq.num_tokens - local
        if n > budget:
            n = budget
        if pool.allocate_slots(seq, n, local - resident, blocks,
                               num_external_computed_tokens=resident,
                               full_sequence_must_fit=True,
                               has_scheduled_reqs=bool(running)) is None:
            return _BLOCKED
        if declined:
            assert off is not None
            off.note_decision(False)
        self._record_hits(seq, local, 0, first_time)
        seq.num_computed_tokens = local
        return n

    def _record_hits(self, seq: Seq, local: int, ext: int, first_time: bool) -> None:
        if first_time:
            seq.local_hit_tokens = local
            seq.ext_tokens = ext
            st = self.stats
            st.gpu_hit_tokens += local
            st.gpu_query_tokens += seq.num_tokens
            st.ext_hit_tokens += ext
            st.ext_declined_tokens += seq.ext_declined_tokens
        self.pool.record_prefix_cache_stats(seq, local, preempted=not first_time)

    def _preempt(self, seq: Seq) -> None:
        """``seq`` (already out of the running requests) is preempted by recompute."""
        self.pool.free(seq)
        seq.num_computed_tokens = 0
        seq.status = WAITING
        seq.preemptions += 1
        self.stats.preemptions += 1
        self._pend(seq)
        self.waiting.appendleft(seq)

    def _sample(self, seq: Seq, t: float, st: EngineStats, n: int) -> bool:
        """``seq`` computed its last ``n`` tokens in the step that ended at ``t``: count
        them, sample one token. Returns whether it has all its output tokens."""
        if seq.num_output == 0 and not seq.decode_only:
            st.prefill_tokens += n
        else:
            st.decode_tokens += n
        seq.num_output += 1
        seq.num_tokens += 1
        if seq.first_token < 0:
            seq.first_token = t
            self.first_tokens.append(seq)
        else:
            self.itl_values.append(t - seq.last_token)
            self.itl_counts.append(1)
        seq.last_token = t
        nb = seq.num_tokens // self.block_tokens
        hashes = seq.block_hashes
        have = len(hashes)
        if have < nb:
            hashes.extend(seq.full_keys[have:nb])
        return seq.num_output >= seq.max_tokens

    def _count_step(self, st: EngineStats, n_seqs: int, tokens: int, k: int) -> None:
        """``k`` steps of ``n_seqs`` requests, ``tokens`` new tokens in the first and one
        per request in each later one."""
        st.steps += k
        st.batch_seqs += n_seqs * k
        if n_seqs > st.max_batch_seqs:
            st.max_batch_seqs = n_seqs
        st.batch_tokens += tokens + (k - 1) * n_seqs
        hist = st.batch_hist
        hist[n_seqs] = hist.get(n_seqs, 0) + k

    def _finish(self, seq: Seq) -> None:
        seq.status = FINISHED
        seq.finish = seq.last_token
        self.pool.free(seq)


class SteppedEngine(Engine):
    """Every step scheduled on its own, every running request touched each step (the
    reference the event-driven engine is checked against; ``--exact-steps``)."""

    def _setup(self) -> None:
        self.running = []  # mypyc: no narrowing of Engine.running
        self._batch: list[tuple[Seq, int]] = []
        self._end = 0.0

    def _start_running(self, seq: Seq) -> None:
        self.running.append(seq)

    def _schedule(self, now: float) -> list[tuple[Seq, int]]:
        pool = self.pool
        budget = self.max_num_batched_tokens
        running = self.running
        batch: list[tuple[Seq, int]] = []
        preempted = False
        i = 0
        while i < len(running) and budget > 0:
            seq = running[i]
            n = seq.num_tokens - seq.num_computed_tokens
            if n > budget:
                n = budget
            if n <= 0:
                i += 1
                continue
            scheduled = True
            while pool.allocate_running(seq, n) is None:
                victim = running.pop()
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    scheduled = False
                    break
            if not scheduled:
                break
            batch.append((seq, n))
            budget -= n
            i += 1
        if not preempted:
            self._admit(now, budget, batch)
        return batch

    def plan(self, now: float) -> float | None:
        batch = self._schedule(now)
        if not batch:
            self._idle(now)
            return None
        self._busy(now)
        self.plans += 1
        self._batch = batch
        self._end = now + self.step_model.step_time(
            [(n, s.num_computed_tokens) for s, n in batch])
        return self._end

    def end_step(self) -> list[Seq]:
        t = self._end
        batch = self._batch
        st = self.stats
        tokens = 0
        for _s, n in batch:
            tokens += n
        self._count_step(st, len(batch), tokens, 1)
        finished: list[Seq] = []
        for seq, n in batch:
            c = seq.num_computed_tokens + n
            seq.num_computed_tokens = c
            if c < seq.num_tokens:
                st.prefill_tokens += n  # a prefill chunk: no token yet
                continue
            if self._sample(seq, t, st, n):
                finished.append(seq)
        if finished:
            done = {id(s) for s in finished}
            self.running = [s for s in self.running if id(s) not in done]
            for seq in finished:
                self._finish(seq)
        self.busy = False
        self._batch = []
        return finished


class EventEngine(Engine):
    """Jumps over runs of identical decode steps (module docstring).

    State: ``running`` maps each running request's admission number to it, in running
    order; the requests computing their prompt (``_prefilling``) are its tail (a request
    admitted later can finish its prompt no earlier: the budget goes in running order);
    the others decode lazily: ``_n_dec`` of them, ``_sum_base`` the sum of their
    ``base_c``, so their contexts sum to ``_sum_base + _n_dec · step`` at step ``step``.
    ``_stops`` is a heap of ``(stop, adm, gen, seq)``: the first step at which a decoding
    request must be scheduled on its own (a block to allocate or to cache), or the step
    after it samples its last token. Steps are numbered by ``_step_no`` (the next one).

    Needs ``max_num_seqs <= max_num_batched_tokens`` (every decoding request gets its token
    each step, as vLLM's defaults guarantee); :func:`make_engine` gives a stepped engine
    otherwise.
    """

    def _setup(self) -> None:
        if self.max_num_seqs > self.max_num_batched_tokens:
            raise ValueError("an event-driven engine needs max_num_seqs <= "
                             "max_num_batched_tokens")
        self.running = {}  # mypyc
        self._adm = 0
        self._prefilling: list[Seq] = []
        self._n_dec = 0
        self._sum_base = 0
        self._step_no = 0
        self._last_end = 0.0
        self._stops: list[tuple[int, int, int, Seq]] = []
        self._gen = itertools.count()
        self._due: list[tuple[int, int, int, Seq]] = []
        self._caching = self.pool.enable_caching
        self._run_ends = getattr(self.step_model, "decode_step_ends", None) or (
            lambda start, n, ctx, k: _decode_step_ends(self.step_model, start, n, ctx, k))
        # the planned steps (a list, or a numpy array for a long run)
        self._ends: Ends = []
        self._items: list[tuple[Seq, int]] = []
        self._run_dec = 0

    # ------------------------------------------------------------------ lazy decoders
    def _start_running(self, seq: Seq) -> None:
        adm = self._adm
        self._adm = adm + 1
        seq.adm = adm
        self.running[adm] = seq
        self._prefilling.append(seq)

    def _materialize(self, seq: Seq, step: int) -> None:
        """Bring a decoding request's fields up to the start of step ``step``."""
        out = seq.base_out + step
        seq.num_output = out
        seq.num_tokens = seq.num_prompt_tokens + out
        seq.num_computed_tokens = seq.base_c + step
        seq.last_token = self._last_end
        nb = seq.num_tokens // self.block_tokens
        hashes = seq.block_hashes
        have = len(hashes)
        if have < nb:
            hashes.extend(seq.full_keys[have:nb])

    def _push_stop(self, seq: Seq, step: int) -> None:
        """Enter the decoding request's next stop at or after step ``step``."""
        B = self.block_tokens
        c = seq.base_c + step
        stop = step + seq.max_tokens - (seq.base_out + step)  # the step after its last token
        a = step + (-c) % B  # needs a new block for position c + (a - step)
        if a < stop:
            stop = a
        if self._caching:
            f = step + (B - 1 - c) % B  # fills a block: vLLM caches it
            if f < stop and (c + f - step + 1) // B <= len(seq.full_keys):
                stop = f
        gen = next(self._gen)
        seq.dec_gen = gen
        heapq.heappush(self._stops, (stop, seq.adm, gen, seq))

    def _add_decoder(self, seq: Seq, step: int) -> None:
        seq.base_c = seq.num_computed_tokens - step
        seq.base_out = seq.num_output - step
        self._n_dec += 1
        self._sum_base += seq.base_c
        self._push_stop(seq, step)

    def _drop_decoder(self, seq: Seq) -> None:
        self._n_dec -= 1
        self._sum_base -= seq.base_c
        seq.dec_gen = -1

    def _pop_last(self) -> Seq:
        """Preempt the last running request."""
        _adm, victim = self.running.popitem()
        victim.adm = -1
        if victim.dec_gen >= 0:
            self._materialize(victim, self._step_no)
            self._drop_decoder(victim)
        else:
            last = self._prefilling.pop()
            if last is not victim:
                raise RuntimeError("event engine: the prefilling requests are not the tail "
                                   "of the running order")
        self._preempt(victim)
        return victim

    def _next_stop(self) -> int:
        heap = self._stops
        while heap and heap[0][2] != heap[0][3].dec_gen:
            heapq.heappop(heap)
        return heap[0][0]

    # ------------------------------------------------------------------ the contract
    def _grow_due(self, S: int) -> tuple[bool, bool]:
        """Give a slot for one more token to each decoding request whose stop is due at
        step ``S``, preempting from the end of the running list where the pool is full:
        whether any was preempted, and whether a due request preempted itself (the step
        schedules nothing more)."""
        pool = self.pool
        heap = self._stops
        due = self._due
        while heap and heap[0][0] == S:
            entry = heapq.heappop(heap)
            if entry[2] == entry[3].dec_gen:
                due.append(entry)
        preempted = stopped = False
        if due:
            if len(due) > 1:
                due.sort()
            for _stop, _adm, gen, seq in due:
                if seq.dec_gen != gen:
                    continue  # preempted by an earlier request of this step
                self._materialize(seq, S)
                while pool.allocate_running(seq, 1) is None:
                    victim = self._pop_last()
                    preempted = True
                    if victim is seq:
                        stopped = True
                        break
                if stopped:
                    break
                self._push_stop(seq, S + 1)
            due.clear()
        return preempted, stopped

    def plan(self, now: float) -> float | None:
        S = self._step_no
        pool = self.pool
        heap = self._stops
        if (heap and heap[0][0] == S) or self._due:
            preempted, stopped = self._grow_due(S)
        else:
            preempted = stopped = False
        n_dec = self._n_dec
        budget = self.max_num_batched_tokens - n_dec
        items: list[tuple[Seq, int]] = []
        if not stopped:
            pre = self._prefilling
            i = 0
            while i < len(pre) and budget > 0:
                seq = pre[i]
                n = seq.num_tokens - seq.num_computed_tokens
                if n > budget:
                    n = budget
                if n <= 0:
                    i += 1
                    continue
                scheduled = True
                while pool.allocate_running(seq, n) is None:
                    victim = self._pop_last()
                    preempted = True
                    if victim is seq:
                        scheduled = False
                        break
                if not scheduled:
                    break
                items.append((seq, n))
                budget -= n
                i += 1
            n_dec = self._n_dec
        if not preempted:
            self._admit(now, budget, items)
        if not n_dec and not items:
            self._idle(now)
            return None
        self._busy(now)
        self.plans += 1
        self._items = items
        self._run_dec = n_dec
        # the sums of step S: the decoding requests', then the others' (integers and halves,
        # exact in floats, so any order gives stepping's values)
        ctx = self._sum_base + n_dec * S
        if not items and not preempted:
            # a pure decode step: the same batch up to the next stop, contexts one longer
            ends = self._run_ends(now, n_dec, ctx, self._next_stop() - S)
            self._ends = ends
            return float(ends[-1])
        pt = 0
        dt = n_dec
        pw = 0.0
        dw = ctx + 0.5 * n_dec
        kv = float(ctx + n_dec)
        for seq, n in items:
            c = seq.num_computed_tokens
            if n > 1:
                pt += n
                pw += n * (c + n / 2)
            elif n == 1:
                dt += 1
                dw += c + 0.5
            kv += c + n
        t = now + self.step_model.step_time_sums(pt, pw, dt, dw, kv)
        self._ends = [t]
        return t

    def cut(self, now: float, after: int) -> float | None:
        ends = self._ends
        if len(ends) <= 1:
            return None
        if not self._can_admit:
            return None  # no budget or room: nothing can be admitted before the run ends
        blocked = self._blocked
        if blocked is not None:
            holding = self.kv_holding
            if (holding[0] is blocked) if holding else blocked.status == WAITING:
                return None  # the same request still blocks admission: nothing new runs
        j = bisect_left(ends, now)
        if j < len(ends) and ends[j] == now and self.index < after:
            j += 1  # that boundary has passed: the step after it is scheduled already
        if j >= len(ends) - 1:
            return None
        self._ends = ends[:j + 1]
        return float(ends[j])

    def end_step(self) -> list[Seq]:
        ends = self._ends
        k = len(ends)
        items = self._items
        n_dec = self._run_dec
        st = self.stats
        tokens = n_dec
        for _s, n in items:
            tokens += n
        # _count_step(st, n_seqs, tokens, k), written out
        n_seqs = n_dec + len(items)
        st.steps += k
        st.batch_seqs += n_seqs * k
        if n_seqs > st.max_batch_seqs:
            st.max_batch_seqs = n_seqs
        st.batch_tokens += tokens + (k - 1) * n_seqs
        hist = st.batch_hist
        hist[n_seqs] = hist.get(n_seqs, 0) + k
        st.decode_tokens += n_dec * k
        t = float(ends[-1])
        if n_dec:
            itl_v = self.itl_values
            itl_c = self.itl_counts
            if k == 1:
                itl_v.append(t - self._last_end)
                itl_c.append(n_dec)
            elif isinstance(ends, list):
                itl_v.extend(map(operator.sub, ends, itertools.chain((self._last_end,), ends)))
                itl_c.extend(itertools.repeat(n_dec, k))
            else:  # numpy: the same subtractions
                import numpy as np

                itl_v.extend(np.diff(ends, prepend=self._last_end).tolist())
                itl_c.extend([n_dec] * k)
        S = self._step_no + k
        self._step_no = S
        self._last_end = t
        finished: list[Seq] = []
        heap = self._stops
        while heap and heap[0][0] == S:
            entry = heapq.heappop(heap)
            seq = entry[3]
            if entry[2] != seq.dec_gen:
                continue
            if seq.base_out + S >= seq.max_tokens:
                self._materialize(seq, S)
                self._drop_decoder(seq)
                finished.append(seq)
            else:
                self._due.append(entry)
        if items:
            pre = self._prefilling
            done = 0
            for seq, n in items:
                c = seq.num_computed_tokens + n
                seq.num_computed_tokens = c
                if c < seq.num_tokens:
                    st.prefill_tokens += n  # a prefill chunk: no token yet
                    continue
                if pre[done] is not seq:
                    raise RuntimeError("event engine: a request finished its prompt before "
                                       "one admitted earlier")
                done += 1
                if self._sample(seq, t, st, n):
                    finished.append(seq)
                else:
                    self._add_decoder(seq, S)
            del pre[:done]
        running = self.running
        for seq in finished:
            del running[seq.adm]
            seq.adm = -1
            self._finish(seq)
        self.busy = False
        self._items = []
        return finished


def make_engine(index: int, name: str, node: str, pool: KVPool, step: StepTime, *,
                exact_steps: bool = False, **kwargs: Any) -> Engine:
    """An :class:`EventEngine`, or a :class:`SteppedEngine` with ``exact_steps`` (or when
    ``max_num_seqs > max_num_batched_tokens``, which the event engine does not model)."""
    seqs = kwargs.get("max_num_seqs", 256)
    tokens = kwargs.get("max_num_batched_tokens", 8192)
    cls: type[Engine] = SteppedEngine if exact_steps or seqs > tokens else EventEngine
    return cls(index, name, node, pool, step, **kwargs)
