"""One vLLM v1 scheduler step (``vllm/v1/core/sched/scheduler.py``), synchronous mode.

``schedule()`` plans a step: RUNNING requests first, in list order, within the token budget
(preempting the newest running request, or the lowest-priority one, when blocks run out);
then, only if nothing was preempted, WAITING requests in queue order, each looked up in the
prefix cache and admitted only if its whole prompt fits (strict head-of-line blocking).
``update_from_output()`` applies the step's outcome: every request whose chunk reached
``num_tokens`` samples one token; requests that reach ``max_tokens`` or ``max_model_len``
finish and free their blocks. No SimPy here: time is not this module's business.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Literal, Protocol, get_args

from kvsim.errors import ConfigError
from kvsim.kv.connector import ConnectorMeta, ConnectorOutput, KVConnector, StepView
from kvsim.kv.hybrid import HybridKVCacheManager, mamba_checkpoint_exportable, mamba_checkpoint_position
from kvsim.kv.manager import KVCacheManager, KVManager
from kvsim.request import Request, Status
from kvsim.semantics import Semantics

SchedulingPolicy = Literal["fcfs", "priority"]
SCHEDULING_POLICIES: tuple[SchedulingPolicy, ...] = get_args(SchedulingPolicy)


@dataclass(frozen=True, slots=True)
class SpecParams:
    """Speculative decoding as the scheduler sees it (all zero: off).

    ``num_lookahead_tokens`` extra KV slots are reserved on every allocation (EAGLE/MTP and
    draft models: k; ngram: 0); ``draft_slots`` is vLLM's ``max_num_new_slots_for_drafting``,
    taken from the input budget per scheduled request; ``num_prefill_lookahead`` tokens at the
    end of a prompt are never left alone in a chunk (multi-module MTP).
    """

    num_speculative_tokens: int = 0
    num_lookahead_tokens: int = 0
    draft_slots: int = 0
    num_prefill_lookahead: int = 0


@dataclass(frozen=True, slots=True)
class SchedulerParams:
    """The scheduler knobs, under vLLM's engine-argument names."""

    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    scheduling_policy: SchedulingPolicy = "fcfs"
    scheduler_reserve_full_isl: bool = True
    spec: SpecParams = SpecParams()
    # vLLM's AsyncScheduler: the next step is scheduled before this one's outputs arrive.
    async_scheduling: bool = False


@dataclass(slots=True)
class PrefixCacheStats:
    """vLLM's PrefixCacheStats: one record per admitted lookup (preempted ones apart). The
    connector's (``external_prefix_cache_*``) counts queries beyond the local hit."""

    requests: int = 0
    queries: int = 0
    hits: int = 0
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0

    def record(self, num_tokens: int, num_hits: int, preempted: bool) -> None:
        if preempted:
            self.preempted_requests += 1
            self.preempted_queries += num_tokens
            self.preempted_hits += num_hits
        else:
            self.requests += 1
            self.queries += num_tokens
            self.hits += num_hits

    def add(self, other: PrefixCacheStats) -> None:
        self.requests += other.requests
        self.queries += other.queries
        self.hits += other.hits
        self.preempted_requests += other.preempted_requests
        self.preempted_queries += other.preempted_queries
        self.preempted_hits += other.preempted_hits

    def external_counters(self) -> dict[str, int]:
        """A connector's stats under the names vLLM's metrics and the oracle driver give them
        (``vllm:external_prefix_cache_*``)."""
        return {"external_prefix_cache_queries": self.queries,
                "external_prefix_cache_hits": self.hits,
                "external_prefix_cache_requests": self.requests,
                "external_preempted_queries": self.preempted_queries,
                "external_preempted_hits": self.preempted_hits,
                "external_preempted_requests": self.preempted_requests}


@dataclass(slots=True)
class Chunk:
    """One request's share of a step: ``num_new_tokens`` after ``num_computed_before`` tokens,
    of which the last ``num_spec_tokens`` are drafts to verify (``padded``: placeholder drafts
    vLLM adds to a newly admitted one-token request, which can never be accepted)."""

    req: Request
    num_new_tokens: int
    num_computed_before: int
    num_spec_tokens: int = 0
    padded: bool = False
    samples: bool = False  # the chunk reaches the end of the known tokens: it samples


@dataclass(slots=True)
class StepPlan:
    """What one ``schedule()`` call decided; ``scheduled`` is in vLLM's order (running
    requests, then admissions).

    A step planned by lazy decode (``kvsim.fastforward``) also gives ``num_lazy`` running
    requests ``lazy_len`` decode tokens each (one, or a verify step's 1 + k: k drafts) without
    a chunk of their own: chunks ``(lazy_len, c)`` with Σ(c + lazy_len) = ``lazy_kv``,
    max(c + lazy_len) = ``lazy_longest`` and min(c + lazy_len) = ``lazy_shortest``; ``exits``
    are chunks of this step whose requests stopped being lazy before its outputs arrived."""

    scheduled: list[Chunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    prefix_cache: PrefixCacheStats = field(default_factory=PrefixCacheStats)
    external_prefix_cache: PrefixCacheStats = field(default_factory=PrefixCacheStats)
    connector_meta: ConnectorMeta | None = None  # what the KV connector hands the worker
    num_lazy: int = 0
    lazy_len: int = 1
    lazy_kv: int = 0
    lazy_longest: int = 0
    lazy_shortest: int = 0
    exits: list[Chunk] = field(default_factory=list)

    @property
    def executes(self) -> bool:
        """Whether the step runs the model (something is scheduled)."""
        return bool(self.scheduled) or self.num_lazy > 0

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(c.num_new_tokens for c in self.scheduled) + self.num_lazy * self.lazy_len


class _FcfsQueue:
    """``num_tokens``: the queued requests' tokens (prompt and outputs), kept as they come and
    go (a router reads it; a late output to a queued request is added by the scheduler)."""

    __slots__ = ("_q", "num_tokens")

    def __init__(self):
        self._q: deque[Request] = deque()
        self.num_tokens = 0

    def add(self, req: Request) -> None:
        self._q.append(req)
        self.num_tokens += req.num_tokens

    def prepend(self, req: Request) -> None:
        self._q.appendleft(req)
        self.num_tokens += req.num_tokens

    def peek(self) -> Request:
        return self._q[0]

    def remove(self, req: Request) -> None:
        self._q.remove(req)
        self.num_tokens -= req.num_tokens

    def pop(self) -> Request:
        req = self._q.popleft()
        self.num_tokens -= req.num_tokens
        return req

    def __iter__(self):
        return iter(self._q)

    def __len__(self) -> int:
        return len(self._q)


class _PriorityQueue:
    """A heap ordered as vLLM's ``Request.__lt__``: (priority, arrival_time, request_id);
    ``num_tokens`` as ``_FcfsQueue``'s."""

    __slots__ = ("_h", "num_tokens")

    def __init__(self):
        self._h: list[tuple[int, float, str, int, Request]] = []
        self.num_tokens = 0

    def add(self, req: Request) -> None:
        heapq.heappush(self._h, (req.priority, req.arrival_s, req.req_id, req.seq, req))
        self.num_tokens += req.num_tokens

    prepend = add  # a heap has no front: a preempted request is simply re-inserted

    def peek(self) -> Request:
        return self._h[0][-1]

    def remove(self, req: Request) -> None:
        self._h = [e for e in self._h if e[-1] is not req]
        heapq.heapify(self._h)
        self.num_tokens -= req.num_tokens

    def pop(self) -> Request:
        req = heapq.heappop(self._h)[-1]
        self.num_tokens -= req.num_tokens
        return req

    def __iter__(self):
        return (e[-1] for e in self._h)

    def __len__(self) -> int:
        return len(self._h)


def _rank(ask: tuple[Request, int]) -> int:
    return ask[0].rank


WAITING_QUEUES: dict[SchedulingPolicy, type[_FcfsQueue] | type[_PriorityQueue]] = {
    "fcfs": _FcfsQueue, "priority": _PriorityQueue}


Acceptance = Callable[[Request, int], int]
"""How many of ``n`` drafts a request accepts at this verify step (0 <= result <= n)."""


class SteadyDecodes(Protocol):
    """Running requests a fast path keeps without chunks of their own
    (``kvsim.fastforward.LazyDecode``): each of its ``num_members`` is scheduled ``chunk_len``
    tokens a step (its sampled token and any drafts), and only the ``due`` ones have an
    ``allocate_slots`` that acts this step (a block to take or to publish). ``others`` are
    the rest of the running list, by rank."""

    num_members: int
    chunk_len: int  # a member's tokens a step: one, or a verify step's 1 + k
    others: list[Request]

    def due(self) -> list[Request]:
        """The members whose allocation acts this step, their counters as ``schedule()``
        would find them, by rank."""
        ...

    def members_tokens_to_compute(self) -> int:
        """Σ max(0, num_tokens − num_computed_tokens) over the members, as they are now."""
        ...

    def last_rank(self) -> int:
        """The highest rank among the members (the last of them in the running list)."""
        ...

    def marks(self) -> list[int]:
        """The keys the members' allocations would mark published this step, the due ones'
        aside (``KVManager.decode_marks``)."""
        ...


def reserved_token_budget(sem: Semantics, max_num_batched_tokens: int, max_num_seqs: int,
                          draft_slots: int, where: str = "engine.max_num_batched_tokens") -> int:
    """Before 0.28 (``per_request_draft_slots`` off) the scheduler's token budget is what is
    left after reserving the draft slots of ``max_num_seqs`` requests
    (VllmConfig._set_max_num_scheduled_tokens). 0.20+ refuse a budget left at 0 or below
    (ConfigError at ``where``); 0.19 falls back to the full budget on exactly 0 (it tests the
    value for truth) and schedules nothing, ever, below it."""
    budget = max_num_batched_tokens - draft_slots * max_num_seqs
    if budget <= 0 and sem.rejects_nonpositive_scheduled_tokens:
        raise ConfigError(where, f"{max_num_batched_tokens} less {draft_slots} draft slot(s) for "
                                 f"each of max_num_seqs = {max_num_seqs} leaves {budget} tokens "
                                 f"to schedule; vLLM {sem.version} refuses it")
    return budget or max_num_batched_tokens


class Scheduler:
    def __init__(self, params: SchedulerParams, kv: KVManager, sem: Semantics,
                 connector: KVConnector | None = None):
        self.params = params
        self.kv = kv
        self.sem = sem
        # A KV connector (kvsim.kv.connector): an offload tier, or one side of a P/D pair.
        self.connector = connector
        # Waiting requests that hold blocks (a finished or pending load) go first (0.33's
        # kv_holding_waiting); loads the worker reported, not yet taken up.
        self.kv_holding = WAITING_QUEUES[params.scheduling_policy]()
        self.finished_recving: set[str] = set()
        # Requests finished since the last schedule() (SchedulerOutput.finished_req_ids).
        self.finished_since: list[Request] = []
        # Requests still prefilling: an asynchronous load is admitted only if it leaves
        # the blocks they still need free (0.33's _inflight_prefills).
        self.inflight_prefills: dict[str, Request] = {}
        # With a connector that loads into blocks (kv_role kv_both or kv_consumer) and a
        # second batch in flight (async scheduling), a freed request's blocks go back to the
        # pool only once the last step that scheduled it has been processed (0.33's
        # defer_block_free): steps are numbered as scheduled and as processed.
        self.defer_block_free = (connector is not None and connector.is_kv_consumer
                                 and params.async_scheduling)
        # A preempted request's in-flight output is dropped (a producer's connector).
        self.requires_kv_delivery = connector is not None and connector.requires_kv_delivery
        # Finished requests whose blocks stay until the worker reports them sent (a P/D
        # prefill side; vLLM keeps them in ``requests``).
        self.sending: dict[str, Request] = {}
        self.sched_step_seq = self.processed_step_seq = 0
        self.deferred_frees: deque[tuple[int, list]] = deque()
        # Running requests' table lengths before this step's allocation (a connector sees
        # only their new blocks; new and resumed requests' whole tables).
        self._held_before: dict[str, int] = {}
        self.spec = params.spec
        # Draft-model input slots: charged per scheduled request (0.32+), or reserved for
        # max_num_seqs requests up front by shrinking the token budget (earlier releases).
        if sem.per_request_draft_slots:
            self.draft_slots, self.token_budget = params.spec.draft_slots, params.max_num_batched_tokens
        else:
            self.draft_slots = 0
            self.token_budget = reserved_token_budget(sem, params.max_num_batched_tokens,
                                                      params.max_num_seqs, params.spec.draft_slots)
        self.waiting = WAITING_QUEUES[params.scheduling_policy]()
        self.running: list[Request] = []
        self.priority_policy = params.scheduling_policy == "priority"
        self._num_admitted = 0
        # A fast path's lazily kept running requests (``kvsim.fastforward``), if any.
        self.steady: SteadyDecodes | None = None

    def tokens_to_compute(self) -> int:
        """The tokens its unfinished requests have still to compute (a router's pending
        tokens; a queued request has computed none)."""
        running, members = self.running, 0
        if self.steady is not None and self.steady.num_members:
            running, members = self.steady.others, self.steady.members_tokens_to_compute()
        return self.waiting.num_tokens + members + sum(
            max(0, r.num_tokens - r.num_computed_tokens) for queue in (running, self.kv_holding)
            for r in queue)

    def add_request(self, req: Request) -> None:
        if self.connector is not None:
            self.connector.on_new_request(req)  # (it may cut a P/D prefill's prompt)
        self.waiting.add(req)

    @property
    def num_unfinished(self) -> int:
        return len(self.running) + len(self.waiting) + len(self.kv_holding)

    @property
    def has_requests(self) -> bool:
        """Whether the engine must keep stepping: unfinished requests, finished ones the
        connector has not been told of, or transfers in flight."""
        return bool(self.num_unfinished or self.finished_since or self.sending
                    or (self.connector is not None and self.connector.has_pending_work()))

    def schedules_ahead(self, queued: int, executed: bool) -> bool:
        """vLLM's EngineCore batch queue (two batches with asynchronous scheduling, else
        one): with ``queued`` batches in flight, the newest of which ``executed`` or not,
        whether the next batch is scheduled before the oldest one's outputs are processed
        (0.32+: the queue always fills first; 0.19/0.22: only after a batch that executed,
        the oldest taken as still running, as the oracle driver takes it)."""
        return queued < (2 if self.params.async_scheduling else 1) and (executed or (
            self.has_requests and not self.sem.batch_queue_fill_requires_execution))

    # -- schedule ------------------------------------------------------------------------

    def schedule(self) -> StepPlan:
        """Plan one step; mutates queues, block tables and ``num_computed_tokens``."""
        p = self.params
        plan = StepPlan()
        scheduled: dict[str, Chunk] = {}
        self.kv.new_step_starts()
        self._held_before = {}
        # vLLM keeps two budgets: scheduled tokens, and model inputs, from which each
        # scheduled request also takes ``draft_slots`` (draft-model inputs).
        budget = [self.token_budget, p.max_num_batched_tokens]
        threshold = self._long_prefill_threshold()
        prefill_scheduled = self._schedule_running(plan, scheduled, budget, threshold)
        if not plan.preempted:
            self._schedule_waiting(plan, scheduled, budget, threshold, prefill_scheduled,
                                   bool(scheduled))
        plan.scheduled = list(scheduled.values())
        if self.connector is not None:
            plan.connector_meta = self.connector.build_connector_meta(self._step_view(plan))
            self.finished_since = []
        if self.defer_block_free and plan.scheduled:
            self.sched_step_seq += 1
        self._update_after_schedule(plan.scheduled)
        return plan

    def _step_view(self, plan: StepPlan) -> StepView:
        """This step as vLLM's SchedulerOutput shows it to a connector: new and resumed
        requests with their whole block table, running ones with this step's new blocks."""
        tables = self.kv.req_to_blocks
        new_ids: dict[str, tuple[list[int], bool]] = {}
        for c in plan.scheduled:
            req_id = c.req.req_id
            table = tables.get(req_id, ())
            held = self._held_before.get(req_id)
            new_ids[req_id] = ([b.block_id for b in table], True) if held is None else (
                [b.block_id for b in table[held:]], False)
        return StepView({c.req.req_id: c.num_new_tokens for c in plan.scheduled}, new_ids,
                        tuple(r.req_id for r in plan.preempted), tuple(self.finished_since))

    def _update_after_schedule(self, chunks: list[Chunk]) -> None:
        """vLLM's ``_update_after_schedule``: the scheduled tokens count as computed."""
        k, is_async = self.spec.num_speculative_tokens, self.params.async_scheduling
        in_flight = self.sem.has_num_in_flight_tokens
        for c in chunks:
            req = c.req
            req.num_computed_tokens += c.num_new_tokens
            if in_flight:
                req.num_in_flight_tokens += c.num_new_tokens
            if self.defer_block_free:
                req.last_sched_seq = self.sched_step_seq
            req.is_prefill_chunk = req.num_computed_tokens < req.num_tokens + req.num_output_placeholders
            c.samples = not req.is_prefill_chunk
            if c.samples and self.inflight_prefills:
                self.inflight_prefills.pop(req.req_id, None)
            if is_async and c.samples:
                # The sampled token and the drafts are placeholders until the outputs arrive;
                # the next step already verifies k placeholder drafts.
                req.num_output_placeholders += 1 + c.num_spec_tokens
                req.num_draft_tokens = k

    def _reserve_prefill_lookahead(self, req: Request, computed: int, n: int) -> int:
        """Multi-module MTP: never end a prefill chunk within the drafter's read-ahead."""
        npl = self.spec.num_prefill_lookahead
        remaining = req.num_tokens - computed - n
        if 0 < remaining < npl:
            n -= npl - remaining
        return max(n, 0)

    def _mamba_block_aligned_split(self, req: Request, n: int, num_new_computed: int = 0) -> int:
        """Cut a prefill chunk so that Mamba states land where they can be cached (align
        mode): chunks end on block boundaries, and one ends at the prompt's checkpoint
        position (the last cacheable block end; a block earlier under the EAGLE drop)."""
        start = req.num_computed_tokens + num_new_computed
        prefill_end = max(req.num_prompt_tokens, req.num_tokens - 1)  # resumed: replay outputs
        if start >= prefill_end:
            return n
        kv, b = self.kv, self.kv.block_size
        assert isinstance(kv, HybridKVCacheManager)  # only a hybrid layout has a Mamba group
        end = start + n
        split = self.sem.hybrid.mamba_split
        junction = req.shared_prefix_boundary
        if split == "checkpoint":  # 0.32+: get_mamba_prefill_checkpoint_position
            last = mamba_checkpoint_position(req.num_tokens, b, kv.eagle_drop, kv.hash_lookahead)
        else:  # before: the prompt's last full block
            last = req.num_tokens - req.num_tokens % b
            if kv.eagle_drop:
                last = max(last - b, 0)
        if split in ("last_block", "last_block_junction"):  # 0.19-0.25
            if end < last:
                n = n // b * b
            elif start < last < end:
                n = last - start
            # 0.24/0.25: an admission that looked up (nothing computed yet) stops at the junction.
            uncached = junction - start
            if (split == "last_block_junction" and req.num_computed_tokens == 0
                    and junction and uncached >= b and n > uncached):
                n = uncached // b * b
            return n
        # 0.26+: floor the end to the block grid, then stop at the earliest mandatory position
        # inside the chunk. 0.32+: a chunk that reaches the prefill end and can export the
        # checkpoint from inside need not stop there.
        internal = (kv.mamba_checkpoint_alignment is not None and end >= prefill_end
                    and mamba_checkpoint_exportable(
                        start, end,
                        mamba_checkpoint_position(prefill_end, b, kv.eagle_drop, kv.hash_lookahead),
                        kv.hash_block_size, b, kv.mamba_checkpoint_alignment))
        if internal:
            last = 0
        nxt = (start // b + 1) * b  # onto the block grid after a mid-block start
        if split == "last_block_stops":  # 0.26: only before the last block
            if end < last:
                end = end // b * b
            grid = nxt if start % b and nxt <= last else 0
        else:  # 0.27+: anywhere before the prefill end, advancing by less than a block if it must
            if end < prefill_end:
                max_prefill = self.token_budget
                if self.params.long_prefill_token_threshold > 0:
                    max_prefill = min(max_prefill, self.params.long_prefill_token_threshold)
                aligned = end // b * b
                if aligned > start or b <= max_prefill:
                    end = aligned
            grid = nxt if start % b and not internal else 0
        stops = (grid, last, start + (junction - start) // b * b if start < junction < end else 0)
        end = min((s for s in stops if start < s < end), default=end)
        return max(end - start, 0)

    def _long_prefill_threshold(self) -> int:
        """The step's long_prefill_token_threshold (0: none)."""
        if self.sem.long_prefill_only_with_competition and self.num_unfinished <= 1:
            return 0  # nobody to starve
        return self.params.long_prefill_token_threshold

    def _running_chunk(self, req: Request, threshold: int, budget: list[int] | None) -> int:
        """The tokens a running request is scheduled within ``budget`` (None: uncut), before
        its allocation; none (<= 0) when it has nothing to compute this step."""
        computed = req.num_computed_tokens
        placeholders = req.num_output_placeholders
        if placeholders and computed + 2 - placeholders >= req.num_prompt_tokens + req.max_tokens:
            return 0  # async: the step in flight already reaches max_tokens
        n = req.num_prompt_tokens + req.num_output_tokens + req.num_draft_tokens + placeholders - computed
        if 0 < threshold < n:
            n = threshold
        n = min(n, self.params.max_model_len - computed - 1)
        if budget is not None:
            n = min(n, budget[0], budget[1] - self.draft_slots)
        if self.kv.mamba_align:
            n = self._mamba_block_aligned_split(req, n)
        if self.spec.num_prefill_lookahead and computed + n < req.num_tokens:  # (a prefill)
            n = self._reserve_prefill_lookahead(req, computed, n)
        return n

    def _running_chunk_made(self, req: Request, n: int) -> Chunk:
        """The chunk of ``n`` tokens an allocated running request gets; its drafts in it
        are verified (fresh ones come after this step)."""
        computed = req.num_computed_tokens
        num_spec = 0
        if req.num_draft_tokens:
            num_spec = max(0, min(req.num_draft_tokens,
                                  n + computed - req.num_tokens - req.num_output_placeholders))
            req.num_draft_tokens = 0
        return Chunk(req, n, computed, num_spec)

    def _schedule_running(self, plan: StepPlan, scheduled: dict, budget: list[int],
                          threshold: int) -> bool:
        kv, running, spec = self.kv, self.running, self.spec
        slots = self.draft_slots
        prefill_scheduled = False
        idx = 0
        while idx < len(running) and budget[0] > 0:
            if budget[1] <= slots:
                break
            req = running[idx]
            n = self._running_chunk(req, threshold, budget)
            if n <= 0:
                idx += 1
                continue
            if self.connector is not None:
                self._held_before[req.req_id] = len(kv.req_to_blocks.get(req.req_id, ()))
            while True:
                new_blocks = kv.allocate_slots(req, n, num_lookahead_tokens=spec.num_lookahead_tokens)
                if new_blocks is not None:
                    break
                victim = (max(running, key=lambda r: (r.priority, r.arrival_s))
                          if self.priority_policy else running[-1])
                if self.defer_block_free and victim.last_sched_seq > self.processed_step_seq:
                    break  # its blocks would come back only later: preempting frees nothing now
                if self.priority_policy:
                    victim_idx = running.index(victim)
                    del running[victim_idx]
                    if victim_idx < idx and (self.sem.priority_victim_before_index_reindexes
                                             or victim.req_id in scheduled):
                        idx -= 1
                    if victim.req_id in scheduled:
                        restored = scheduled.pop(victim.req_id).num_new_tokens
                        budget[0] += restored
                        budget[1] += restored + slots
                else:
                    victim = running.pop()
                self._preempt(victim)
                plan.preempted.append(victim)
                if victim is req:
                    break
            if new_blocks is None:
                if (self.priority_policy and req.status is Status.PREEMPTED
                        and self.sem.priority_self_preempt_continues):
                    continue  # it preempted itself; later (higher-priority) requests may fit
                break
            prefill_scheduled |= req.is_prefill_chunk
            scheduled[req.req_id] = self._running_chunk_made(req, n)
            budget[0] -= n
            budget[1] -= n + slots
            idx += 1
        return prefill_scheduled

    def schedule_steady(self, steady: SteadyDecodes) -> StepPlan | None:
        """``schedule()`` for a step in which ``steady``'s members decode without chunks of
        their own (``num_lazy`` of the plan; their counters are the fast path's to move):
        the running requests in list order, then admissions, by the rules ``schedule()``
        follows. None, with nothing changed, when that step could cut a member or a request
        before one short (the token budget) or preempt (too few free blocks): ``schedule()``
        must plan it, every member brought up to date. Without a KV connector."""
        kv, p, slots = self.kv, self.params, self.draft_slots
        assert self.connector is None
        kv.new_step_starts()
        lookahead = self.spec.num_lookahead_tokens
        threshold = self._long_prefill_threshold()
        asks = [(r, 0) for r in steady.due()]  # 0: a member's tokens, no chunk
        kv.mark_published(steady.marks())
        member = steady.chunk_len
        num_tokens = steady.num_members * member
        budget = [self.token_budget - num_tokens,
                  p.max_num_batched_tokens - num_tokens - slots * steady.num_members]
        # The running list in order: the members and the requests before the last of them
        # whole (else None: one would be cut), those after it within what is left, as
        # _schedule_running cuts them.
        last = steady.last_rank()
        for r in steady.others:
            if r.rank < last:
                n = self._running_chunk(r, threshold, None)
            elif budget[0] <= 0 or budget[1] <= slots:
                break
            else:
                n = self._running_chunk(r, threshold, budget)
            if n > 0:
                asks.append((r, n))
                budget[0] -= n
                budget[1] -= n + slots
        if budget[0] < 0 or budget[1] < 0:
            return None
        if sum(kv.num_blocks_to_grow(r, n or member, lookahead)
               for r, n in asks) > kv.pool.num_free_blocks:
            return None
        self._held_before = {}
        plan = StepPlan(num_lazy=steady.num_members, lazy_len=member)
        scheduled: dict[str, Chunk] = {}
        prefill_scheduled = False
        if len(asks) > 1:
            asks.sort(key=_rank)
        for r, n in asks:
            if kv.allocate_slots(r, n or member, num_lookahead_tokens=lookahead) is None:
                raise AssertionError("schedule_steady: a checked allocation failed")
            if n:
                prefill_scheduled |= r.is_prefill_chunk
                scheduled[r.req_id] = self._running_chunk_made(r, n)
        self._schedule_waiting(plan, scheduled, budget, threshold, prefill_scheduled, True)
        plan.scheduled = list(scheduled.values())
        self._update_after_schedule(plan.scheduled)
        return plan

    def published_after_output(self, req: Request, had_placeholders: bool) -> int | None:
        """The tokens a running request's blocks are published up to once an output has
        been applied to it (None: not then); ``had_placeholders``: before that output."""
        if self.params.async_scheduling and self.sem.async_publish_after_placeholders:
            return req.num_computed_tokens - req.num_output_placeholders
        if self.sem.cache_after_verify and (had_placeholders or self.spec.num_speculative_tokens):
            # Verified tokens (accepted drafts, async outputs) are published now.
            return req.num_computed_tokens - req.num_in_flight_tokens
        return None

    def chunk_size(self, req: Request) -> int:
        """The tokens a running request would be scheduled now, the budget aside (<= 0: none)."""
        return self._running_chunk(req, self._long_prefill_threshold(), None)

    def outputs_left(self, req: Request) -> int:
        """Output tokens ``req`` may still sample before it stops (``max_tokens`` or
        ``max_model_len``); at least one."""
        return max(min(req.max_tokens - req.num_output_tokens,
                       self.params.max_model_len - req.num_prompt_tokens - req.num_output_tokens), 1)

    @property
    def may_admit(self) -> bool:
        """Whether a waiting request could join the running list (the count allows it)."""
        return bool(len(self.waiting) + len(self.kv_holding)) and len(self.running) < self.params.max_num_seqs

    def _schedule_waiting(self, plan: StepPlan, scheduled: dict, budget: list[int],
                          threshold: int, prefill_scheduled: bool,
                          running_scheduled: bool) -> None:
        p, kv, waiting, spec, sem = self.params, self.kv, self.waiting, self.spec, self.sem
        k, slots = spec.num_speculative_tokens, self.draft_slots
        lookahead = spec.num_lookahead_tokens if sem.lookahead_on_admission else 0
        # (running_scheduled: a running request has a chunk this step; admissions below
        # don't count for the padding)
        connector, holding = self.connector, self.kv_holding
        skipped: list[Request] = []
        skipped_holding: list[Request] = []

        def skip(queue) -> None:
            """Set the head aside for this step (vLLM's skip_request): a request holding
            blocks goes back to the holding queue, the others to the waiting queue."""
            r = queue.pop()
            (skipped_holding if r.num_computed_tokens > 0 or r.status is Status.WAITING_FOR_REMOTE_KVS
             else skipped).append(r)

        while budget[0] > 0:
            queue = holding if len(holding) else waiting
            if not len(queue):
                break
            if budget[1] <= slots or len(self.running) >= p.max_num_seqs:
                break
            req = queue.peek()
            if req.status is Status.WAITING_FOR_REMOTE_KVS:
                if req.req_id not in self.finished_recving:
                    skip(queue)
                    continue
                self._finish_remote_load(req)
            if req.num_stale_output_tokens and not req.drop_stale_output:
                skip(queue)  # async: wait for its in-flight outputs (unless they are dropped)
                continue
            ext, load_async, ext_queries = 0, False, 0
            if req.num_computed_tokens == 0:
                hit_blocks, hit = kv.get_computed_blocks(req)
                if connector is not None:
                    matched, load_async = connector.get_num_new_matched_tokens(req, hit)
                    if matched is None:  # the connector cannot tell yet
                        skip(queue)
                        continue
                    ext = matched
                    ext_queries = req.num_tokens - hit
                computed = hit + ext
                if req.num_preemptions == 0 or (sem.cached_tokens_until_first_token
                                                and req.num_output_tokens == 0):
                    req.cached_tokens = computed  # PrefillStats: the hit at the admitting lookup
                    req.external_cached_tokens = ext
                if kv.enable_caching and not sem.prefix_stats_at_admission:
                    plan.prefix_cache.record(req.num_tokens, hit, req.num_preemptions > 0)
            else:  # its blocks were loaded: carry on from them
                hit_blocks, hit, computed = None, 0, req.num_computed_tokens
            request_budget = min(budget[0], budget[1] - slots)
            n = 0 if load_async else req.num_tokens - computed
            padded = False
            pad = sem.pad_new_decode_to_spec_width
            if (pad != "never" and k and n == 1 and not prefill_scheduled
                    and (running_scheduled or (pad == "running_or_hit" and computed > 0))):
                # Pad a one-token admission to a full 1 + k verify row (placeholder drafts)
                # to keep the decode batch uniform: 0.25-0.28 end the pass rather than pass
                # max_model_len; 0.29+ pad only if the row and the sampled token fit.
                if pad == "running" and computed + 1 + k > p.max_model_len:
                    break
                if pad == "running" or computed + 1 + k + 1 <= p.max_model_len:
                    if 1 + k > request_budget:
                        break  # rather not schedule than schedule it unpadded
                    n, padded = 1 + k, True
            if 0 < threshold < n:
                n = threshold
            if not load_async:
                if not p.enable_chunked_prefill and n > request_budget:
                    break
                n = min(n, request_budget)
                if kv.mamba_align:
                    n = self._mamba_block_aligned_split(req, n, hit)
                    if n == 0:
                        break
                    if padded and n != 1 + k:  # keep all 1 + k rows or none: drop the padding
                        n, padded = 1, False
                n = self._reserve_prefill_lookahead(req, computed, n)
                if n == 0:  # can't end this chunk here
                    if not sem.skip_zero_chunk_admission:
                        break
                    skip(queue)  # let the requests behind it go first
                    continue
            # An asynchronous load holds its blocks with no progress: admit it only if it
            # leaves the blocks the requests still prefilling need.
            reserved = self._inflight_reserved_blocks() if load_async else 0
            if kv.allocate_slots(req, n, hit, hit_blocks, 0 if load_async else lookahead,
                                 full_sequence_must_fit=p.scheduler_reserve_full_isl,
                                 num_external_computed_tokens=ext, delay_cache_blocks=load_async,
                                 reserved_blocks=reserved) is None:
                break  # strict head-of-line blocking
            if connector is not None:
                self._connector_allocated(req, ext)
                if ext_queries:
                    plan.external_prefix_cache.record(ext_queries, ext, req.num_preemptions > 0)
            if kv.enable_caching and sem.prefix_stats_at_admission and hit_blocks is not None:
                plan.prefix_cache.record(req.num_tokens, hit, req.num_preemptions > 0)
            if load_async:
                req.status = Status.WAITING_FOR_REMOTE_KVS
                req.num_computed_tokens = computed
                self.inflight_prefills[req.req_id] = req
                skip(queue)
                continue
            queue.pop()
            self.running.append(req)
            self._num_admitted += 1
            req.rank = self._num_admitted  # orders the running list (lazy decode's events)
            req.status = Status.RUNNING
            req.num_computed_tokens = computed
            if connector is not None and computed + n < req.num_tokens:
                self.inflight_prefills[req.req_id] = req
            scheduled[req.req_id] = Chunk(req, n, computed, k if padded else 0, padded)
            budget[0] -= n
            budget[1] -= n + slots
        for req in reversed(skipped):  # back to the front, in their order
            waiting.prepend(req)
        for req in reversed(skipped_holding):
            holding.prepend(req)

    def check_invariants(self) -> None:
        """The KV manager's and the connector's invariants (blocks set aside count as held);
        the queues' token counts."""
        self.kv.check_invariants([blocks for _, blocks in self.deferred_frees])
        for queue in (self.waiting, self.kv_holding):
            assert queue.num_tokens == sum(r.num_tokens for r in queue), "queued tokens"
        assert all(r.num_computed_tokens == 0 for r in self.waiting), "a waiting request computed"
        if self.connector is not None:
            self.connector.check_invariants()

    def _free_blocks(self, req: Request) -> None:
        """Free the request's blocks, or set them aside until the steps in flight that may
        still write them are processed (``defer_block_free``)."""
        if not self.defer_block_free or req.last_sched_seq <= self.processed_step_seq:
            self.kv.free(req)
            return
        kv = self.kv
        assert isinstance(kv, KVCacheManager)  # the connector takes one full-attention group
        blocks = kv.pop_blocks_for_free(req)
        if blocks:
            self.deferred_frees.append((self.sched_step_seq, blocks))

    def _finish_remote_load(self, req: Request) -> None:
        """vLLM's _update_waiting_for_remote_kv: publish the loaded blocks; a load that
        reaches the last token gives it back, to be recomputed for its logits."""
        self.kv.cache_blocks(req, req.num_computed_tokens)
        if req.num_computed_tokens == req.num_tokens:
            req.num_computed_tokens -= 1
        self.finished_recving.discard(req.req_id)
        req.status = Status.PREEMPTED if req.num_preemptions else Status.WAITING

    def _connector_allocated(self, req: Request, num_external_tokens: int) -> None:
        kv = self.kv
        assert isinstance(kv, KVCacheManager)  # the connector takes one full-attention group
        table = kv.req_to_blocks.get(req.req_id, [])
        assert self.connector is not None
        self.connector.update_state_after_alloc(
            req, [b.block_id for b in table], [b.block_hash is not None for b in table],
            num_external_tokens)

    def _inflight_reserved_blocks(self) -> int:
        """Blocks the requests still prefilling need to hold their whole sequence (and a
        verify step's 1 + k tokens and lookahead slots), and a verify step's blocks for the
        loading request itself (0.33's _inflight_prefill_reserved_blocks +
        _spec_decode_step_blocks)."""
        kv = self.kv
        assert isinstance(kv, KVCacheManager)
        spec = self.spec
        k = spec.num_speculative_tokens
        step = 1 + k + spec.num_lookahead_tokens if k else 0
        return sum(kv.num_blocks_to_allocate(r.req_id, min(r.num_tokens, self.params.max_model_len)
                                             + step, [])
                   for r in self.inflight_prefills.values()) + -(-step // kv.block_size)

    def _preempt(self, req: Request) -> None:
        """Recompute preemption: free the blocks (they stay hashed), back to the waiting front."""
        self._free_blocks(req)
        if self.inflight_prefills:
            self.inflight_prefills.pop(req.req_id, None)
        req.status = Status.PREEMPTED
        req.num_computed_tokens = 0
        req.num_draft_tokens = 0
        if self.sem.stale_outputs_on_preempt:
            # Async: outputs in flight become stale; their placeholders go (0.32
            # scheduler.py:1596-1606; 0.27+). Before, the placeholders stay and the late output is
            # applied like any other (0.19 scheduler.py:956-976).
            # A producer's hand-off must not come from a preempted run: its in-flight
            # output is dropped, not delivered (0.32+ requires_kv_delivery).
            req.drop_stale_output = self.requires_kv_delivery or (
                req.drop_stale_output and req.num_stale_output_tokens > 0)
            req.num_stale_output_tokens = req.num_in_flight_tokens
            req.num_output_placeholders = 0
        req.num_preemptions += 1
        self.waiting.prepend(req)

    # -- outcome -------------------------------------------------------------------------

    def update_from_output(self, plan: StepPlan, accept: Acceptance | None = None,
                           kv_output: ConnectorOutput | None = None
                           ) -> tuple[list[Request], list[Request]]:
        """Apply a step's outcome. Each request whose chunk reached ``num_tokens`` samples one
        token plus the drafts it accepts (``accept``; rejected drafts roll
        ``num_computed_tokens`` back, their blocks stay); requests reaching ``max_tokens`` or
        ``max_model_len`` finish and free their blocks; the others get ``k`` fresh drafts
        (asynchronous scheduling gave them placeholder drafts already).

        Outputs of a request preempted while they were in flight ("stale") are still delivered
        but change no counter; outputs of a request that finished meanwhile are dropped.
        ``kv_output`` is what the KV connector's worker reports with the step (after the
        finished requests are freed, as vLLM applies it).
        Returns ``(requests that got their first token, requests that finished)``.
        """
        first: list[Request] = []
        finished: list[Request] = []
        if self.defer_block_free and plan.scheduled:
            # Every block write of this step and the earlier ones is done.
            self.processed_step_seq += 1
            deferred = self.deferred_frees
            while deferred and deferred[0][0] <= self.processed_step_seq:
                self.kv.pool.free_blocks(reversed(deferred.popleft()[1]))
        k = self.spec.num_speculative_tokens
        is_async = self.params.async_scheduling
        in_flight = self.sem.has_num_in_flight_tokens
        cache_after_verify = self.sem.cache_after_verify
        publish_after_placeholders = is_async and self.sem.async_publish_after_placeholders
        cache_blocks = self.kv.cache_blocks
        for c in plan.scheduled:
            req = c.req
            if in_flight:
                req.num_in_flight_tokens -= c.num_new_tokens
            stale = req.num_stale_output_tokens > 0
            if stale:
                req.num_stale_output_tokens -= c.num_new_tokens
            if req.status is Status.FINISHED or not c.samples or (stale and req.drop_stale_output):
                continue  # finished meanwhile, a partial prefill chunk, or a dropped output
            num_new = 1
            if c.num_spec_tokens:
                accepted = 0 if c.padded or accept is None else accept(req, c.num_spec_tokens)
                rejected = c.num_spec_tokens - accepted
                if not stale:
                    if req.num_computed_tokens > 0:
                        req.num_computed_tokens -= rejected
                    if req.num_output_placeholders > 0:
                        req.num_output_placeholders -= rejected
                num_new += accepted
                if not c.padded:
                    req.num_drafts_proposed += c.num_spec_tokens
                    req.num_drafts_accepted += accepted
                    req.num_verify_steps += 1
            if req.num_output_tokens == 0:
                first.append(req)
            was_running = req.status is Status.RUNNING
            had_placeholders = req.num_output_placeholders > 0
            i = self.outputs_left(req)  # the tokens kept
            stopped = i <= num_new
            if stopped:
                if cache_after_verify and not stale:
                    req.num_computed_tokens -= num_new - i  # trimmed at the stop
            else:
                i = num_new
            req.num_output_tokens += i
            if not was_running:  # a late output to a preempted request: it waits
                self.waiting.num_tokens += i
            if not stale:
                if publish_after_placeholders:
                    req.num_output_placeholders -= i  # the tokens kept
                elif had_placeholders:
                    req.num_output_placeholders -= num_new  # the untrimmed count
            if was_running and (publish_after_placeholders or not stale):
                upto = self.published_after_output(req, had_placeholders)
                if upto is not None:
                    cache_blocks(req, upto)
            if stopped:
                req.status = Status.FINISHED
                if not was_running:
                    self.waiting.remove(req)
                delay_free = False
                if self.connector is not None:
                    self.inflight_prefills.pop(req.req_id, None)
                    delay_free, req.kv_transfer_output = self.connector.request_finished(req)
                    self.finished_since.append(req)
                if delay_free:
                    self.sending[req.req_id] = req
                else:
                    self._free_blocks(req)
                finished.append(req)
            elif k and not is_async:
                req.num_draft_tokens = k
        if len(finished) > 8:
            done = {id(r) for r in finished}
            self.running = [r for r in self.running if id(r) not in done]
        else:
            for r in finished:
                with suppress(ValueError):  # (it finished while preempted: a late output)
                    self.running.remove(r)
        if kv_output is not None:
            self.update_connector_output(kv_output)
        return first, finished

    def update_connector_output(self, kv_output: ConnectorOutput) -> None:
        """vLLM's _update_from_kv_xfer_finished: the connector learns which transfers are
        done; requests whose loads finished may be scheduled from the next step on; finished
        requests whose blocks were read free them."""
        assert self.connector is not None
        self.connector.update_connector_output(kv_output)
        self.finished_recving.update(kv_output.finished_recving)
        for req_id in kv_output.finished_sending:
            self._free_blocks(self.sending.pop(req_id))
