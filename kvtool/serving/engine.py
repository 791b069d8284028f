"""One inference engine, shaped like vLLM v1's scheduler (``vllm/v1/core/sched/scheduler.py``).

An :class:`Engine` holds a waiting queue (FCFS), a running list, a :class:`KVPool` (the
GPU tier, vLLM's prefix cache exactly) and a :class:`StepModel` (the roofline step time).
Each step it schedules like vLLM's ``Scheduler.schedule``:

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

Decode runs are **fast-forwarded**: while every running request decodes, nothing waits
that could be admitted and no request crosses a block boundary or finishes, the next steps
are the same batch with contexts one longer; :meth:`Engine.plan_steps` computes them in
one go, and an outside event (an arrival, a finished load) cuts the run at the next step
boundary. The result equals stepping one at a time (tested).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvtool.serving.kvpool import KVPool

WAITING, LOADING, RUNNING, FINISHED, FAILED = 0, 1, 2, 3, 4


class Seq:
    """One request inside an engine (the attributes vLLM's ``Request`` has, plus timings).

    Invariants: ``num_tokens == num_prompt_tokens + num_output``; ``block_hashes`` holds
    the keys of the full blocks of the first ``num_tokens`` tokens; ``0 <=
    num_computed_tokens <= num_tokens``.
    """

    __slots__ = (
        "arrival",
        "block_hashes",
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


class Offload(Protocol):
    """The tiers below an engine's GPU pool, as the engine sees them (the sim implements it)."""

    def plan_load(self, engine: Engine, seq: Seq, start_tokens: int, limit_tokens: int
                  ) -> tuple[int, int]:
        """``(tokens to load, tokens found but declined)`` beyond ``start_tokens`` (the
        GPU hit), at most ``limit_tokens`` in all; decides load versus recompute."""

    def start_load(self, engine: Engine, seq: Seq, start_tokens: int, tokens: int,
                   now: float) -> None:
        """Start the flows of a planned load; the sim calls :meth:`Engine.loaded` when the
        last one ends."""

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
    def step_time(self, items: Sequence[tuple[int, int]]) -> float: ...

    def step_time_sums(self, prefill_tokens: int, prefill_work: float, decode_tokens: int,
                       decode_work: float, kv_tokens: float) -> float: ...


class Engine:
    """One engine (module docstring). The sim owns the clock: it calls :meth:`add`,
    :meth:`plan_steps` when the engine is idle, :meth:`end_step` when a step ends, and
    :meth:`loaded` when a request's loads have arrived."""

    def __init__(self, index: int, name: str, node: str, pool: KVPool, step: StepTime, *,
                 block_tokens: int, max_num_seqs: int = 256, max_num_batched_tokens: int = 8192,
                 offload: Offload | None = None, role: str = "both",
                 fast_forward: bool = True) -> None:
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
        self.fast_forward = fast_forward
        self.waiting: deque[Seq] = deque()
        self.kv_holding: deque[Seq] = deque()
        """Requests whose loads have arrived, holding their blocks (scheduled first)."""
        self.running: list[Seq] = []
        self.stats = EngineStats()
        # the step (or run of decode steps) in progress
        self.busy = False
        self._batch: list[tuple[Seq, int]] = []
        self._ends: list[float] = []
        self._started = 0.0
        self._pending_blocks = 0
        self.itl_values: list[float] = []
        self.itl_counts: list[int] = []
        self.first_tokens: list[Seq] = []
        """Requests that sampled their first token in the steps just ended (the sim takes
        them after :meth:`end_step`, to tell the router their prefill is done)."""

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

    # ------------------------------------------------------------------ scheduling
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
            while pool.allocate_slots(seq, n) is None:
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
        if preempted:
            return batch
        # requests whose loads have arrived hold their blocks: they go first, as vLLM
        # schedules its kv_holding_waiting queue before the waiting queue (otherwise they
        # could hold the pool while the head of the waiting queue waits for it)
        holding = self.kv_holding
        while holding and budget > 0 and len(running) < self.max_num_seqs:
            seq = holding[0]
            n = seq.num_tokens - seq.num_computed_tokens
            if n > budget:
                n = budget
            if pool.allocate_slots(seq, n, full_sequence_must_fit=True,
                                   has_scheduled_reqs=bool(running)) is None:
                return batch
            holding.popleft()
            seq.status = RUNNING
            running.append(seq)
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
                blocks, local = pool.get_computed_blocks(seq)
                first_time = seq.local_hit_tokens < 0
                ext = 0
                if self.offload is not None and seq.decode_only:
                    # P/D split: pull the prompt's KV from the prefill engine, all but the
                    # last token, which this engine computes to sample the first token
                    ext = max(0, seq.num_tokens - 1 - local)
                elif self.offload is not None:
                    cap = ((seq.num_tokens - 1) // self.block_tokens) * self.block_tokens
                    ext, declined = self.offload.plan_load(self, seq, local, cap)
                    if first_time:
                        seq.ext_declined_tokens = declined
                if ext:
                    if pool.allocate_slots(seq, 0, local, blocks,
                                           num_external_computed_tokens=ext,
                                           delay_cache_blocks=True, full_sequence_must_fit=True,
                                           has_scheduled_reqs=bool(running)) is None:
                        break
                    self._record_hits(seq, local, ext, first_time)
                    self._unpend(seq)
                    seq.status = LOADING
                    seq.num_computed_tokens = local + ext
                    if seq.first_scheduled < 0:
                        seq.first_scheduled = now
                    self.offload.start_load(self, seq, local, ext, now)  # type: ignore[union-attr]
                    j += 1
                    continue
                n = seq.num_tokens - local
                if n > budget:
                    n = budget
                if pool.allocate_slots(seq, n, local, blocks, full_sequence_must_fit=True,
                                       has_scheduled_reqs=bool(running)) is None:
                    break
                self._record_hits(seq, local, 0, first_time)
                seq.num_computed_tokens = local
            else:
                n = seq.num_tokens - seq.num_computed_tokens
                if n > budget:
                    n = budget
                if pool.allocate_slots(seq, n, full_sequence_must_fit=True,
                                       has_scheduled_reqs=bool(running)) is None:
                    break
            del waiting[j]
            self._unpend(seq)
            seq.status = RUNNING
            if seq.first_scheduled < 0:
                seq.first_scheduled = now
            running.append(seq)
            batch.append((seq, n))
            budget -= n
        return batch

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
        self.pool.free(seq)
        seq.num_computed_tokens = 0
        seq.status = WAITING
        seq.preemptions += 1
        self.stats.preemptions += 1
        self._pend(seq)
        self.waiting.appendleft(seq)

    # ------------------------------------------------------------------ steps
    def plan_steps(self, now: float) -> list[float]:
        """Schedule the next step (or a run of identical decode steps) at ``now``; return
        the end time of each step (empty: nothing to do, the engine stays idle)."""
        n_waiting_before = len(self.waiting) + len(self.kv_holding)
        batch = self._schedule(now)
        if not batch:
            return []
        self.busy = True
        self._batch = batch
        self._started = now
        step = self.step_model
        items = [(n, s.num_computed_tokens) for s, n in batch]
        t = now + step.step_time(items)
        ends = [t]
        if self.fast_forward and len(self.waiting) + len(self.kv_holding) == n_waiting_before:
            k = self._decode_run_length(batch)
            if k > 1:
                sums = step.step_time_sums
                n = len(items)
                base = 0.0
                for _n, c in items:
                    base += c
                for j in range(1, k):
                    ctx = base + n * j
                    t += sums(0, 0.0, n, ctx + 0.5 * n, ctx + n)
                    ends.append(t)
        self._ends = ends
        return ends

    def _decode_run_length(self, batch: list[tuple[Seq, int]]) -> int:
        """How many identical decode steps may run from this one (1: no fast-forward).

        Valid when the batch is every running request, each decoding, and nothing was
        admitted from the waiting queue (then nothing there can be admitted while the run
        lasts: the pool, the running count and the budget stay as they are). Step ``j`` of
        the run computes position ``c + j`` of each request; steps after the first skip
        ``allocate_slots``, so none may start a new block (``(c + j) % B == 0``) or fill
        one (``(c + j) % B == B − 1``, when vLLM caches it), and none may sample a request's
        last token before the run's last step.
        """
        if len(batch) != len(self.running):
            return 1
        B = self.block_tokens
        k = 1 << 30
        for seq, n in batch:
            c = seq.num_computed_tokens
            if n != 1 or c != seq.num_tokens - 1:
                return 1
            r = c % B
            m = B - 1 - r if r <= B - 2 else 1
            left = seq.max_tokens - seq.num_output
            if left < m:
                m = left
            if m < k:
                k = m
            if k <= 1:
                return 1
        return k

    def cut(self, now: float) -> float | None:
        """An outside event at ``now`` wants the engine's attention: end the run of steps
        at the first step boundary at or after ``now``. Returns the new end time when the
        run was shortened, else ``None``."""
        ends = self._ends
        if len(ends) <= 1:
            return None
        for j, e in enumerate(ends):
            if e >= now:
                if j + 1 < len(ends):
                    del ends[j + 1:]
                    return e
                return None
        return None

    @property
    def run_end(self) -> float:
        """End of the planned steps (valid while :attr:`busy`)."""
        return self._ends[-1]

    def end_step(self) -> list[Seq]:
        """The planned steps have ended; advance requests. Returns the requests that
        finished (in batch order). Inter-token gaps go to :attr:`itl_values` /
        :attr:`itl_counts`."""
        ends = self._ends
        k = len(ends)
        batch = self._batch
        st = self.stats
        t0 = ends[0]
        st.steps += k
        st.busy_s += ends[-1] - self._started
        n_seqs = len(batch)
        st.batch_seqs += n_seqs * k
        if n_seqs > st.max_batch_seqs:
            st.max_batch_seqs = n_seqs
        tokens = 0
        for _s, n in batch:
            tokens += n
        st.batch_tokens += tokens + (k - 1) * n_seqs
        hist = st.batch_hist
        hist[n_seqs] = hist.get(n_seqs, 0) + k
        finished: list[Seq] = []
        B = self.block_tokens
        itl_v = self.itl_values
        itl_c = self.itl_counts
        for seq, n in batch:
            c = seq.num_computed_tokens + n
            seq.num_computed_tokens = c
            if c < seq.num_tokens:
                st.prefill_tokens += n  # a prefill chunk: no token yet
                continue
            if seq.num_output == 0 and not seq.decode_only:
                st.prefill_tokens += n
            else:
                st.decode_tokens += n
            # sample one token at the end of the first step, one more at each later step
            extra = k - 1
            seq.num_output += 1 + extra
            seq.num_tokens += 1 + extra
            seq.num_computed_tokens += extra
            st.decode_tokens += extra
            if seq.first_token < 0:
                seq.first_token = t0
                self.first_tokens.append(seq)
            else:
                itl_v.append(t0 - seq.last_token)
                itl_c.append(1)
            seq.last_token = ends[-1]
            nb = seq.num_tokens // B
            hashes = seq.block_hashes
            full = seq.full_keys
            while len(hashes) < nb and len(hashes) < len(full):
                hashes.append(full[len(hashes)])
            if seq.num_output >= seq.max_tokens:
                finished.append(seq)
        if k > 1:
            prev = t0
            for e in ends[1:]:
                itl_v.append(e - prev)
                itl_c.append(n_seqs)
                prev = e
        if finished:
            done = {id(s) for s in finished}
            self.running = [s for s in self.running if id(s) not in done]
            for seq in finished:
                seq.status = FINISHED
                seq.finish = seq.last_token
                self.pool.free(seq)
        self.busy = False
        self._batch = []
        self._ends = []
        return finished
