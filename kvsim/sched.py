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
from dataclasses import dataclass, field

from kvsim.kv.manager import KVCacheManager
from kvsim.request import Request, Status
from kvsim.semantics import Semantics


@dataclass(frozen=True, slots=True)
class SchedulerParams:
    """The scheduler knobs, under vLLM's engine-argument names."""

    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    scheduling_policy: str = "fcfs"
    scheduler_reserve_full_isl: bool = True


@dataclass(slots=True)
class PrefixCacheStats:
    """vLLM's PrefixCacheStats: one record per admitted lookup (preempted ones apart)."""

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


@dataclass(slots=True)
class StepPlan:
    """What one ``schedule()`` call decided.

    ``scheduled`` is in vLLM's order (running requests, then admissions); each entry is
    ``(request, num_new_tokens, num_computed_tokens_before)``.
    """

    scheduled: list[tuple[Request, int, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    prefix_cache: PrefixCacheStats = field(default_factory=PrefixCacheStats)

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(n for _, n, _ in self.scheduled)


class _FcfsQueue:
    __slots__ = ("_q",)

    def __init__(self):
        self._q: deque[Request] = deque()

    def add(self, req: Request) -> None:
        self._q.append(req)

    def prepend(self, req: Request) -> None:
        self._q.appendleft(req)

    def peek(self) -> Request:
        return self._q[0]

    def pop(self) -> Request:
        return self._q.popleft()

    def __len__(self) -> int:
        return len(self._q)


class _PriorityQueue:
    """A heap ordered as vLLM's ``Request.__lt__``: (priority, arrival_time, request_id)."""

    __slots__ = ("_h",)

    def __init__(self):
        self._h: list[tuple[int, float, str, int, Request]] = []

    def add(self, req: Request) -> None:
        heapq.heappush(self._h, (req.priority, req.arrival_s, req.req_id, req.seq, req))

    prepend = add  # a heap has no front: a preempted request is simply re-inserted

    def peek(self) -> Request:
        return self._h[0][-1]

    def pop(self) -> Request:
        return heapq.heappop(self._h)[-1]

    def __len__(self) -> int:
        return len(self._h)


WAITING_QUEUES = {"fcfs": _FcfsQueue, "priority": _PriorityQueue}


class Scheduler:
    def __init__(self, params: SchedulerParams, kv: KVCacheManager, sem: Semantics,
                 num_lookahead_tokens: int = 0):
        self.params = params
        self.kv = kv
        self.sem = sem
        self.num_lookahead_tokens = num_lookahead_tokens
        self.waiting = WAITING_QUEUES[params.scheduling_policy]()
        self.running: list[Request] = []
        self.priority_policy = params.scheduling_policy == "priority"

    def add_request(self, req: Request) -> None:
        self.waiting.add(req)

    @property
    def num_unfinished(self) -> int:
        return len(self.running) + len(self.waiting)

    # -- schedule ------------------------------------------------------------------------

    def schedule(self) -> StepPlan:
        """Plan one step; mutates queues, block tables and ``num_computed_tokens``."""
        p = self.params
        plan = StepPlan()
        scheduled: dict[str, tuple[Request, int, int]] = {}
        budget = p.max_num_batched_tokens
        threshold = p.long_prefill_token_threshold
        if self.sem.long_prefill_only_with_competition and self.num_unfinished <= 1:
            threshold = 0  # nobody to starve
        budget = self._schedule_running(plan, scheduled, budget, threshold)
        if not plan.preempted:
            self._schedule_waiting(plan, scheduled, budget, threshold)
        plan.scheduled = list(scheduled.values())
        for req, n, _ in plan.scheduled:  # vLLM's _update_after_schedule
            req.num_computed_tokens += n
            req.is_prefill_chunk = req.num_computed_tokens < req.num_tokens
        return plan

    def _schedule_running(self, plan: StepPlan, scheduled: dict, budget: int,
                          threshold: int) -> int:
        p, kv, running = self.params, self.kv, self.running
        idx = 0
        while idx < len(running) and budget > 0:
            req = running[idx]
            n = req.num_tokens - req.num_computed_tokens
            if 0 < threshold < n:
                n = threshold
            n = min(n, budget, p.max_model_len - req.num_computed_tokens - 1)
            if n <= 0:
                idx += 1
                continue
            while True:
                new_blocks = kv.allocate_slots(req, n, num_lookahead_tokens=self.num_lookahead_tokens)
                if new_blocks is not None:
                    break
                if self.priority_policy:
                    victim = max(running, key=lambda r: (r.priority, r.arrival_s))
                    victim_idx = running.index(victim)
                    del running[victim_idx]
                    if victim_idx < idx:
                        idx -= 1
                    if victim.req_id in scheduled:
                        budget += scheduled.pop(victim.req_id)[1]
                else:
                    victim = running.pop()
                self._preempt(victim)
                plan.preempted.append(victim)
                if victim is req:
                    break
            if new_blocks is None:
                if self.priority_policy and req.status is Status.PREEMPTED:
                    continue  # it preempted itself; later (higher-priority) requests may fit
                break
            scheduled[req.req_id] = (req, n, req.num_computed_tokens)
            budget -= n
            idx += 1
        return budget

    def _schedule_waiting(self, plan: StepPlan, scheduled: dict, budget: int,
                          threshold: int) -> None:
        p, kv, waiting = self.params, self.kv, self.waiting
        while budget > 0 and len(waiting) and len(self.running) < p.max_num_seqs:
            req = waiting.peek()
            hit_blocks, hit = kv.get_computed_blocks(req)
            if req.num_preemptions == 0:
                req.cached_tokens = hit  # PrefillStats: the hit at the admitting lookup
            n = req.num_tokens - hit
            if 0 < threshold < n:
                n = threshold
            if not p.enable_chunked_prefill and n > budget:
                break
            n = min(n, budget)
            if kv.allocate_slots(req, n, hit, hit_blocks, self.num_lookahead_tokens,
                                 full_sequence_must_fit=p.scheduler_reserve_full_isl) is None:
                break  # strict head-of-line blocking
            if kv.enable_caching:  # recorded at admission only, so blocked lookups don't count
                plan.prefix_cache.record(req.num_tokens, hit, req.num_preemptions > 0)
            waiting.pop()
            self.running.append(req)
            req.status = Status.RUNNING
            req.num_computed_tokens = hit
            scheduled[req.req_id] = (req, n, hit)
            budget -= n

    def _preempt(self, req: Request) -> None:
        """Recompute preemption: free the blocks (they stay hashed), back to the waiting front."""
        self.kv.free(req)
        req.status = Status.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.waiting.prepend(req)

    # -- outcome -------------------------------------------------------------------------

    def update_from_output(self, plan: StepPlan) -> tuple[list[Request], list[Request]]:
        """Append one sampled token to each request that completed its chunk; finish and free
        those that hit ``max_tokens`` or ``max_model_len``.

        Returns ``(requests that got their first token, requests that finished)``.
        """
        first: list[Request] = []
        finished: list[Request] = []
        max_model_len = self.params.max_model_len
        for req, _, _ in plan.scheduled:
            if req.is_prefill_chunk:
                continue  # a partial prefill chunk samples nothing
            req.num_output_tokens += 1
            if req.num_output_tokens == 1:
                first.append(req)
            if req.num_tokens >= max_model_len or req.num_output_tokens >= req.max_tokens:
                req.status = Status.FINISHED
                self.kv.free(req)
                finished.append(req)
        if finished:
            done = {id(r) for r in finished}
            self.running = [r for r in self.running if id(r) not in done]
        return first, finished
