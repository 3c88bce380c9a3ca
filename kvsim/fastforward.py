"""Lazy decode: a running request that only decodes costs nothing until something happens to it.

In a step of vLLM's scheduler a running request in steady decode (its chunk is one new token
that samples, no drafts) takes one token of the budget and calls ``allocate_slots(req, 1)``,
and the step's outputs give it one output token. That call does something only when the
token crosses a block boundary (a block comes off the free queue) or completes a block (its
hash is published); the outputs change nothing but its counters, until the one that finishes
it. ``LazyDecode`` plans the engine's steps with such requests ("members") kept lazily:
their counters lag (``Request.lz_sched`` / ``lz_upd`` say by how many scheduled steps and
applied outputs) and are brought up to date ("materialized") only when something happens:

* a member's block event, at the step computed in advance, in running-list order (requests'
  ``rank``) among the other running requests: what ``allocate_slots(req, 1)`` does then;
* its last step (it leaves and is scheduled, or skipped asynchronously, like any request, and
  its finishing outputs are applied by ``Scheduler.update_from_output``);
* a step that lazy decode can't plan (see below): every member is materialized, the step in
  flight gets its members' chunks back, and ``Scheduler.schedule`` plans it.

The step itself is planned by the scheduler (``Scheduler.schedule_steady``, with this class
as its ``SteadyDecodes``): the other running requests (just admitted, chunked prefills,
leaving members) by its rules request by request, the members' due allocations in their
place, then admissions on the pool as it is at that point of the step. It plans a step only
when nothing in it can be cut short: every running request gets its tokens within the budget
and its blocks from the free queue (no preemption), which it checks first; else ``schedule``
plans it with every member back in place. A step's cost takes the members' chunks ``(1, c)``
as whole-number sums (``StepPlan.num_lazy``, ``lazy_kv``, ``lazy_longest``,
``lazy_shortest``), which give the cost models' floats exactly. So a run gives, byte for
byte, the results of step-by-step simulation (tests compare the two), at a cost that follows
the events — block boundaries, arrivals, completions — not steps × running requests.
``SpecLazyDecode`` (below) does the same with speculative decoding.

Decode windows (``window`` / ``run``, and ``Windows`` for verify steps, below) go further
where a batch can't change for many steps (every running request a member, none finishing,
no arrival that could join): the members are materialized and the window's steps are made
in one pass, their block pops in one ``get_new_blocks``, each request's hashes in one call;
lazy decode starts again after it.

The fast path holds no rule of the KV manager's: where a member's allocation may act next
is the manager's to say (``KVManager.decode_slack``, early but never late), for one
full-attention group as for hybrid layouts (sliding windows freeing blocks as they move,
Mamba states moved and retired, blocks published per group); what an allocation marks in
every step (a Mamba checkpoint re-keyed, ``decode_marks``) the scheduler marks for the
members at each lazy step. Decode windows stay on one full-attention group (their numpy
pass is its rules in closed form).
"""

from __future__ import annotations

import heapq
from bisect import bisect_left, bisect_right, insort
from itertools import accumulate
from operator import attrgetter

from kvsim.kv.manager import KVCacheManager
from kvsim.request import Request, Status
from kvsim.sched import Chunk, Scheduler, StepPlan

_MAX_BACKOFF = 64  # steps before lazy decode is tried again after a step it couldn't plan
_MIN_WINDOW = 16  # steps a decode window must promise before members are materialized for it
_MAX_WINDOW_STEPS = 256  # steps of one window (their acceptances drawn at once)
_rank = attrgetter("rank")


def applies(sched: Scheduler, accept) -> bool:
    """Whether the scheduler's set-up can decode lazily without speculative decoding (checked
    once per run; ``spec_applies``: with it)."""
    return (accept is None and sched.connector is None
            and sched.spec.num_speculative_tokens == 0 and sched.spec.num_lookahead_tokens == 0
            and sched.draft_slots == 0 and sched.kv.num_reprefillable == 0)


class LazyDecode:
    """Plans and applies the engine's steps for ``sched`` (a set-up ``applies`` accepts).

    ``queue`` is the engine's batch queue of ``(plan, step index)``, newest first: with
    asynchronous scheduling the plan in flight while the next is scheduled."""

    def __init__(self, sched: Scheduler, queue, accept=None):
        self.sched = sched
        self.kv = sched.kv
        self.queue = queue
        self.is_async = sched.params.async_scheduling
        self.in_flight = sched.sem.has_num_in_flight_tokens
        self.num_members = 0
        self.sum_off = 0  # Σ (computed − lz_sched) over members: Σ c of step s is sum_off + M·s
        self.longest: list[tuple[int, int, Request]] = []  # (-(computed − lz_sched), rank, r), stale allowed
        self.shortest: list[tuple[int, int, Request]] = []  # (computed − lz_sched, rank, r), stale allowed
        self.events: dict[int, list[Request]] = {}  # step -> members whose allocate_slots acts
        self.leaving: list[tuple[int, int, Request]] = []  # (step, rank, r): no longer lazy
        self.others: list[Request] = []  # running requests that are not members, by rank
        self.sched_next = 0  # the step being (or next to be) scheduled
        self.upd_next = 0  # the step whose outputs come next
        self.retry_at = 0
        self.backoff = 1
        self._due: list[Request] = []  # the members whose allocation acts this step
        self._marks: dict[int, list[int]] = {}  # id(member) -> keys it marks every step
        self.by_rank: list[tuple[int, int, Request]] = []  # (-rank, join no., r), stale allowed
        self._num_joins = 0
        self.chunk_len = 1  # each member's tokens a step (SteadyDecodes)
        self.accept = accept
        # Decode windows: on one full-attention group (their numpy rules are its own).
        self.windows = Windows(sched, queue, accept) if type(self.kv) is KVCacheManager else None
        sched.steady = self

    # -- a member's counters --------------------------------------------------------------

    def _materialize(self, r: Request) -> None:
        """Bring a member's counters up to date (it stays a member)."""
        assert r.lz_sched is not None  # a member
        s = self.sched_next - r.lz_sched  # its lazy steps scheduled since
        u = self.upd_next - r.lz_upd  # their outputs applied since
        r.num_computed_tokens += s
        r.num_output_tokens += u
        if self.is_async:
            r.num_output_placeholders += s - u
        if self.in_flight:
            r.num_in_flight_tokens += s - u
        r.lz_sched += s
        r.lz_upd += u

    def _next_event(self, r: Request, step: int, earliest: int) -> int | None:
        """The first step from ``earliest`` at which the member's ``allocate_slots(r, 1)``
        may act (``r`` as it is when ``step`` is scheduled; its computed tokens and tokens
        gain one a step): where the KV manager says (``decode_slack``)."""
        slack = self.kv.decode_slack(r, 1)
        return None if slack is None else max(step + slack, earliest)

    def _last_step(self, r: Request, step: int, pending) -> int | None:
        """For a running request that is not a member: the step at which it would stop being
        lazy if it became one at ``step`` (None: it can't). It must be decoding steadily:
        one sampling token to schedule, no drafts, nothing stale, its first token out;
        asynchronously, the step in flight (``pending``: its chunks by request) gives it one
        sampled token (perhaps its first, applied as the chunk it is)."""
        if r.num_draft_tokens or r.num_stale_output_tokens or r.status is not Status.RUNNING:
            return None
        if not self._publications_can_wait(r):
            return None
        tokens = r.num_prompt_tokens + r.num_output_tokens
        if self.is_async:
            c = pending.get(id(r))
            if (r.num_output_placeholders != 1 or r.num_computed_tokens != tokens or c is None
                    or not c.samples or c.num_spec_tokens):
                return None
        elif (r.num_output_placeholders or r.num_computed_tokens != tokens - 1
              or not r.num_output_tokens):
            return None  # (without outputs yet, its next step samples its first token)
        # Steps left, this one included, until the outputs finish it (max_tokens or
        # max_model_len; asynchronously, the step in flight gives it one first);
        # synchronously it leaves at its last step, asynchronously at the step after (which
        # skips it while its last output is in flight).
        left = self.sched.outputs_left(r) - (1 if self.is_async else 0)
        leave = step + left - (0 if self.is_async else 1)
        return leave if leave > step else None

    def _publications_can_wait(self, r: Request) -> bool:
        """Whether what a member's outputs publish may wait for its next allocation (which
        publishes as far before any lookup reads the hash map): no output publishes past
        it, and every block still to publish holds an output token (no other request can
        share it)."""
        kv = self.kv
        if not kv.enable_caching:
            return True
        after = self.sched.published_after_output(r, self.is_async)
        return (after is None or after <= r.num_tokens) and kv.prompt_published(r)

    def members_tokens_to_compute(self) -> int:
        """``SteadyDecodes.members_tokens_to_compute``: every member lags alike (they joined
        with the same gap between tokens and computed tokens, and move alike), so one says
        it for all (the next to leave: ``leaving`` holds members alone)."""
        r = self.leaving[0][2]
        assert r.lz_sched is not None  # a member
        gap = (r.num_tokens + self.upd_next - r.lz_upd) - (r.num_computed_tokens + self.sched_next
                                                            - r.lz_sched)
        return self.num_members * max(0, gap)

    def _join(self, r: Request, step: int, leave: int) -> None:
        r.lz_sched, r.lz_upd, r.lz_in = step, self.upd_next, step
        off = r.num_computed_tokens - step  # (kept by _materialize: both move by s)
        self.num_members += 1
        self.sum_off += off
        heapq.heappush(self.longest, (-off, r.rank, r))
        heapq.heappush(self.shortest, (off, r.rank, r))
        heapq.heappush(self.leaving, (leave, r.rank, r))
        self._joined(r, step)

    def _joined(self, r: Request, step: int) -> None:
        """What every member keeps from its join: its place in the running list, its next
        allocation."""
        self._num_joins += 1
        heapq.heappush(self.by_rank, (-r.rank, self._num_joins, r))
        self._track(r, step, step)

    def last_rank(self) -> int:
        """``SteadyDecodes.last_rank``."""
        return -self._top("by_rank", self.num_members)

    def _track(self, r: Request, step: int, earliest: int) -> None:
        """After a member's allocation (or its join): its next one, from ``earliest``, and
        the keys it marks published every step until then (``KVManager.decode_marks``)."""
        self._add_event(r, self._next_event(r, step, earliest))
        marks = self.kv.decode_marks(r, self.chunk_len)
        if marks:
            self._marks[id(r)] = marks

    def marks(self) -> list[int]:
        """``SteadyDecodes.marks``."""
        return [key for keys in self._marks.values() for key in keys] if self._marks else []

    def _add_event(self, r: Request, event: int | None) -> None:
        if event is None:
            return
        due = self.events.get(event)
        if due is None:
            self.events[event] = [r]
        else:
            due.append(r)

    def _leave(self, r: Request) -> None:
        """Materialized, it becomes an ordinary running request."""
        self._materialize(r)
        assert r.lz_sched is not None  # a member
        self.num_members -= 1
        self.sum_off -= r.num_computed_tokens - r.lz_sched
        self._marks.pop(id(r), None)
        r.lz_sched = None

    # -- one step -------------------------------------------------------------------------

    def schedule(self, step: int) -> StepPlan:
        """Plan step ``step`` (``Scheduler.schedule``'s plan, lazily where it can be)."""
        self.sched_next = step
        if not self.num_members:
            if step < self.retry_at:
                return self.sched.schedule()
            self.others = list(self.sched.running)
        plan = self._schedule_lazily(step)
        if plan is None:
            self.dissolve()
            self.retry_at = step + self.backoff
            self.backoff = min(2 * self.backoff, _MAX_BACKOFF)
            return self.sched.schedule()
        self.backoff = 1
        self.sched_next = step + 1
        return plan

    def _schedule_lazily(self, step: int) -> StepPlan | None:
        sched = self.sched
        in_flight = self.queue[0][0] if self.is_async and self.queue else None
        # Members whose last lazy step is behind them become ordinary requests (their
        # outputs in flight are applied one by one).
        while self.leaving and self.leaving[0][0] <= step:
            r = heapq.heappop(self.leaving)[2]
            if in_flight is not None:  # asynchronous scheduling
                in_flight.exits.append(self._in_flight_chunk(r))
            self._leave(r)
            insort(self.others, r, key=_rank)
        # Requests that now decode steadily join.
        pending = {id(c.req): c for c in in_flight.scheduled} if in_flight is not None else {}
        stay = []
        for r in self.others:
            leave = self._last_step(r, step, pending)
            if leave is None:
                stay.append(r)
            else:
                self._join(r, step, leave)
        self.others = stay
        num_lazy = self.num_members
        if not num_lazy:
            return None
        num_running = len(sched.running)
        plan = sched.schedule_steady(self)
        if plan is None:
            return None
        for r in self._due:  # their allocations are done: the next ones
            self._track(r, step, step + 1)
        self.others.extend(sched.running[num_running:])  # admitted
        self._sums(plan, step)
        return plan

    def _sums(self, plan: StepPlan, step: int) -> None:
        """The members' chunks ``(1, c)`` of step ``step`` as sums, on ``plan``."""
        num_lazy = self.num_members
        plan.lazy_kv = self.sum_off + num_lazy * (step + 1)
        plan.lazy_longest = -self._top("longest", num_lazy) + step + 1
        plan.lazy_shortest = self._top("shortest", num_lazy) + step + 1

    def _in_flight_chunk(self, r: Request) -> Chunk:
        """A member's chunk in the step in flight (asynchronous scheduling), brought up to
        date: what an ordinary request's would be."""
        self._materialize(r)
        return Chunk(r, 1, r.num_computed_tokens - 1, samples=True)

    def due(self) -> list[Request]:
        """``SteadyDecodes.due``: the members whose ``allocate_slots(r, 1)`` acts at the step
        being scheduled, brought up to date, by rank."""
        step = self.sched_next
        due = self._due = [r for r in self.events.pop(step, ()) if r.lz_sched is not None]
        if len(due) > 1:
            due.sort(key=_rank)
        for r in due:
            self._materialize(r)
            if self._marks:
                self._marks.pop(id(r), None)
        return due

    def _top(self, name: str, num_lazy: int) -> int:
        """The first key of heap ``name`` among current members (stale entries dropped)."""
        heap = getattr(self, name)
        if len(heap) > 2 * num_lazy + 64:  # drop the entries of members that left
            heap = [e for e in heap if e[2].lz_sched is not None]
            heapq.heapify(heap)
            setattr(self, name, heap)
        while heap[0][2].lz_sched is None:
            heapq.heappop(heap)
        return heap[0][0]

    def update(self, plan: StepPlan, index: int | None, accept=None):
        """Apply the outputs of step ``index`` (``Scheduler.update_from_output``'s result):
        members' implicitly, the chunks' one by one."""
        chunks = plan.scheduled
        if plan.exits:
            chunks = sorted([*chunks, *plan.exits], key=lambda c: c.req.rank)
        # A member that joined after this step was planned has its chunk here.
        joined = [c.req for c in chunks if c.req.lz_sched is not None]
        for r in joined:
            self._materialize(r)
        if plan.exits:  # (update_from_output reads the chunks alone)
            plan = StepPlan(scheduled=chunks)
        first, finished = self.sched.update_from_output(plan, accept)
        if index is not None:
            self.upd_next = index + 1
        for r in joined:
            r.lz_upd = self.upd_next
        if finished and self.num_members + len(self.others):
            done = {id(r) for r in finished}
            self.others = [r for r in self.others if id(r) not in done]
        return first, finished

    def window_ahead(self, step: int, now: float, arrivals, last_step_s: float) -> bool:
        """Whether a decode window may start at ``step`` (``run_window``): every running
        request is a member, none leaves for ``_MIN_WINDOW`` steps, the step in flight is
        theirs alone, and no arrival can join that soon (judged by the last step's time)."""
        sched = self.sched
        if (self.windows is None or not self.num_members or self.others
                or (self.leaving and self.leaving[0][0] - step < _MIN_WINDOW)):
            return False
        if self.is_async:
            plan = self.queue[0][0] if self.queue else None
            if plan is None or plan.scheduled or plan.exits or not plan.num_lazy:
                return False
        if len(sched.running) < sched.params.max_num_seqs:
            wake = arrivals.next_arrival_s()
            if sched.may_admit or (wake is not None
                                      and wake - now < _MIN_WINDOW * last_step_s):
                return False
        return True

    def run_window(self, env, cost, arrivals, step: int, max_steps: int, max_sim_time_s,
                   record, progress, num_finished: int):
        """Decode a window of steps at once (``Windows``, the members brought up to date
        first; a SimPy generator, returns the steps done: 0 when it finds none)."""
        self.dissolve()
        assert self.windows is not None  # window_ahead()
        done = yield from self.windows.run(env, cost, arrivals, step, max_steps, max_sim_time_s,
                                           record, progress, num_finished)
        # The window applied its steps' outputs, but the last one's when asynchronous.
        self.upd_next = step + done - (1 if self.is_async else 0)
        return done

    def dissolve(self) -> None:
        """Materialize every member and stop: the step in flight gets its members' chunks."""
        if self.num_members:
            members = [r for r in self.sched.running if r.lz_sched is not None]
            in_flight = self.queue[0] if self.is_async and self.queue else None
            lazy = []
            if in_flight is not None and in_flight[0].num_lazy:
                lazy = [self._in_flight_chunk(r) for r in members if r.lz_in <= in_flight[1]]
            for r in members:
                self._leave(r)
            if in_flight is not None and in_flight[0].num_lazy:
                plan, index = in_flight
                chunks = [*plan.scheduled, *plan.exits, *lazy]
                chunks.sort(key=lambda c: c.req.rank)
                self.queue[0] = (StepPlan(scheduled=chunks, prefix_cache=plan.prefix_cache),
                                 index)
        self.others = []
        self.longest, self.shortest, self.events, self.leaving = [], [], {}, []
        self.by_rank = []
        self._marks.clear()


# -- decode windows: a batch that nothing can change, many steps at once ------------------
#
# In a step where every running request decodes steadily and no request can join, vLLM's
# ``schedule()`` gives each running request the same chunk, in list order: its token (and,
# with speculative decoding, its k drafts to verify), and ``update_from_output()`` gives each
# one 1 + a tokens, a the drafts it accepted (drawn from its own stream, ``Acceptance.peek``;
# 0 without drafts): its computed tokens and its tokens both move by 1 + a. Until a request
# reaches ``max_tokens`` / ``max_model_len`` or a request could be admitted, the next step is
# the same batch again. Inside such a window the only calls with an effect are the
# ``allocate_slots`` that cross a table's end (a block is popped from the free queue,
# ``KVCacheManager.num_blocks_to_grow``'s rule) or complete a block (its hash is published,
# up to the tokens; and, after an output, ``Scheduler.published_after_output``). ``Windows``
# finds the window (the batch full or nothing waiting, no request near its end, enough free
# blocks), and makes exactly those calls in step-by-step order (step, allocations before
# outputs, running-list order): the window's pops in one ``get_new_blocks`` (the free queue
# changes by nothing else inside a window, so the same blocks come off in the same order and
# evict the same hashes), handed out in that order; the publications in that order, each
# request's block hashes made beforehand in one call (ids are interned in another order than
# step by step; only their equality is ever read); then it moves the counters of all requests.
#
# Step times and records are those of step-by-step simulation: each step has its own start
# time, ``t_{j+1} = t_j + d_j`` as SimPy adds them, and the clock jumps to the window's end
# in one timeout when that lands on the same float (else one timeout per step; the engine
# is alone on its clock). A step is timed by the cost model from its chunks as sums
# (``Decodes``: the count, Σ(c + n), max and min, whole numbers, which give the cost models'
# floats exactly). The window stops before any step where step-by-step simulation would do
# something else: a completion, an admissible arrival, a free queue too short for the step's
# allocations, a run limit. With asynchronous scheduling (a batch queue of two) the step in
# flight when the window starts is its first executed step, and it leaves its last scheduled
# step in flight, as the engine loop would.


def spec_applies(sched: Scheduler, accept) -> bool:
    """Whether the set-up can decode lazily, and in windows, with speculative decoding
    (``SpecLazyDecode``; checked once per run)."""
    return accept is not None and sched.connector is None and sched.spec.num_speculative_tokens > 0


class Windows:
    """Decode windows for ``sched`` (a set-up ``applies`` or ``spec_applies`` accepts);
    ``queue`` as ``LazyDecode``'s, ``accept`` the run's acceptance (with ``peek``/``take``;
    None without speculative decoding)."""

    def __init__(self, sched: Scheduler, queue, accept):
        self.sched = sched
        assert isinstance(sched.kv, KVCacheManager)
        self.kv: KVCacheManager = sched.kv
        self.queue = queue
        self.accept = accept
        self.k = sched.spec.num_speculative_tokens

    def _steady(self, max_steps: int):
        """The window's running requests' acceptances (one row per request), or None."""
        sched, k = self.sched, self.k
        running = sched.running
        p = sched.params
        n = 1 + k
        num_running = len(running)
        if (not num_running or sched.may_admit or num_running * n > sched.token_budget
                or num_running * (n + sched.draft_slots) > p.max_num_batched_tokens):
            return None
        if p.async_scheduling:
            if len(self.queue) != 1 or not _is_decode_step(self.queue[0][0], running, n):
                return None
        elif self.queue:
            return None
        # A window of W steps must not reach any request's end: its W outputs (tokens E(W))
        # finish none (E(W) < outputs_left), and its last chunk still fits max_model_len
        # whole (E(W - 1) + computed + 1 + k <= max_model_len - 1).
        mml = p.max_model_len
        steps = min(max_steps, _MAX_WINDOW_STEPS)
        for r in running:
            if not _decodes_steadily(sched, r, n):
                return None
            steps = min(steps, sched.outputs_left(r) - 1)
            if steps < _MIN_WINDOW:
                return None
        if not k:  # no drafts, none accepted: E(t) = t (steady_gains' bound in closed form)
            steps = min(steps, min(mml - 1 - n - r.num_computed_tokens for r in running) + 1)
            return [[0] * steps] if steps >= _MIN_WINDOW else None
        rows = []
        for r in running:
            row = self.accept.peek(r, k, steps)
            steps = min(steps, len(steady_gains(row, sched.outputs_left(r) - 1,
                                                mml - 1 - n - r.num_computed_tokens)) - 1)
            if steps < _MIN_WINDOW:
                return None
            rows.append(row)
        return [row[:steps] for row in rows]

    def run(self, env, cost, arrivals, step: int, max_steps: int, max_sim_time_s,
            record, progress, num_finished: int):
        """Simulate a window of verify steps, the next to schedule being ``step`` (a SimPy
        generator); returns the steps scheduled (0: no window here)."""
        rows = self._steady(max_steps)  # (cheap when not: the first misfit says so)
        if rows is None:
            return 0
        return (yield from self._run(env, cost, arrivals, step, rows, max_sim_time_s, record,
                                     progress, num_finished))

    def _run(self, env, cost, arrivals, step, rows, max_sim_time_s, record, progress,
             num_finished):
        import numpy as np

        sched, kv, k = self.sched, self.kv, self.k
        running = sched.running
        num_running = len(running)
        n = 1 + k
        b, mml = kv.block_size, sched.params.max_model_len
        la = sched.spec.num_lookahead_tokens
        acc = np.array(rows, dtype=np.int64)  # (request, window update)
        if not k:  # (one row stands for all: none accepts anything)
            acc = np.broadcast_to(acc, (num_running, acc.shape[1]))
        width = acc.shape[1]
        emitted = np.zeros((num_running, width + 1), dtype=np.int64)
        np.cumsum(acc + 1, axis=1, out=emitted[:, 1:])
        c0 = np.array([r.num_computed_tokens for r in running], dtype=np.int64)[:, None]
        t0 = np.array([r.num_tokens for r in running], dtype=np.int64)[:, None]
        context = c0 + emitted[:, :width]  # computed tokens as step j is scheduled
        # Blocks each allocation leaves the table with (kv's rule: slots up to min(computed
        # + n + lookahead, max_model_len)), and the pops that takes.
        held = np.array([len(kv.req_to_blocks[r.req_id]) for r in running], dtype=np.int64)[:, None]
        need = np.maximum.accumulate(np.concatenate(
            [held, -(-np.minimum(context + n + la, mml) // b)], axis=1), axis=1)
        pops = np.diff(need, axis=1)
        per_step = np.cumsum(pops.sum(axis=0))
        num_free = kv.pool.num_free_blocks
        steps = int(np.searchsorted(per_step, num_free, side="right"))  # allocations that fit
        if steps < 1:
            return 0
        # Step times (step j executes j, or asynchronously j - 1: the one in flight first).
        lag = 1 if self.queue else 0
        full = num_running >= sched.params.max_num_seqs
        wake = arrivals.next_arrival_s()
        starts: list[float] = []
        durations: list[tuple[float, float]] = []
        t = env.now
        # Each executed step's chunks (n, c) as sums (``Decodes``).
        total = (context.sum(axis=0) + num_running * n).tolist()
        longest = (context.max(axis=0) + n).tolist()
        shortest = (context.min(axis=0) + n).tolist()
        for j in range(steps):
            if (max_sim_time_s is not None and t >= max_sim_time_s) or (
                    not full and wake is not None and wake <= t):
                break
            if lag and j == 0:
                chunks = [(c.num_new_tokens, c.num_computed_before) for c in self.queue[0][0].scheduled]
                d = cost.step_time_s(chunks, num_running)
                dr = cost.draft_time_s(chunks, num_running)
            else:
                i = j - lag
                sums = (num_running, n, total[i], longest[i], shortest[i])
                d = cost.step_time_s((), num_running, sums)
                dr = cost.draft_time_s((), num_running, sums) if k else 0.0  # (no drafter)
            starts.append(t)
            durations.append((d, dr))
            t = t + (d + dr)
        done = len(durations)
        if not done:
            return 0
        # Block events: pops and publications, in step-by-step order (step, then allocations
        # before outputs, then running-list order; a pop before its allocation's publication).
        # An event is ``key << 32 | blocks``: key = (position of the call) * 2 + kind (0 a
        # pop, 1 a publication up to ``blocks`` full blocks); a call's position is (2 * step
        # + 0 for the allocation, 1 for the output) * running + its place in the list.
        pi, pj = np.nonzero(pops[:, :done])
        keys = [np.repeat(((2 * pj * num_running + pi) * 2) << 32, pops[pi, pj])]
        if kv.enable_caching:
            # Published full blocks: by the allocation (up to the tokens), by the output
            # (``published_after_output``, a fixed offset from the tokens in steady decode).
            after = sched.published_after_output(running[0], sched.params.async_scheduling)
            shift = None if after is None else after - running[0].num_tokens
            tokens = np.empty((num_running, 2 * done), dtype=np.int64)
            tokens[:, 0::2] = t0 + emitted[:, :done]
            tokens[:, 1::2] = t0 + emitted[:, 1:done + 1]
            upto = tokens.copy()
            if shift is None:
                upto[:, 1::2] = -b  # nothing published then
            else:
                upto[:, 1::2] += shift
            target = np.minimum((upto - kv.num_reprefillable) // b,
                                (tokens - kv.hasher.lookahead) // b)
            cached = np.array([kv.num_cached_block.get(r.req_id, 0) for r in running],
                              dtype=np.int64)[:, None]
            before = np.maximum.accumulate(np.concatenate([cached, target[:, :-1]], axis=1), axis=1)
            ei, ej = np.nonzero(target > before)
            keys.append((((ej * num_running + ei) * 2 + 1) << 32) | target[ei, ej])
            # Each request's block hashes up to what it publishes last, in one pass (ids are
            # interned in another order than step by step; only their equality is read).
            final = np.maximum(before[:, -1], target[:, -1]).tolist()
            hasher = kv.hasher
            for r, num_full, out in zip(running, final, (t0[:, 0] + emitted[:, done]).tolist()):
                if num_full > len(r.block_hashes):
                    kept, r.num_output_tokens = r.num_output_tokens, out - r.num_prompt_tokens
                    hasher.block_hashes(r, num_full)
                    r.num_output_tokens = kept
        events = np.sort(np.concatenate(keys)).tolist()
        outs = [r.num_output_tokens for r in running]
        # The window's pops come off the free queue in one call (nothing else changes it in
        # a window, and no block published here is free), handed out in order.
        blocks = iter(kv.pool.get_new_blocks(int(per_step[done - 1])))
        tables = kv.req_to_blocks
        waiting = sched.waiting
        usage = kv.pool.usage_at
        ei, num_events = 0, len(events)
        tokens_per_step = num_running * n
        for j in range(done):
            now = starts[j]
            if wake is not None and wake <= now:  # a full batch: arrivals wait
                for r in arrivals.arrived(now):
                    r.join_step = step + j
                    sched.add_request(r)
                wake = arrivals.next_arrival_s()
            limit = (2 * (j + 1) * num_running * 2) << 32
            while ei < num_events and events[ei] < limit:
                key = events[ei] >> 32
                r = running[(key >> 1) % num_running]
                if key & 1:  # a publication: what cache_blocks publishes then
                    kv.publish_blocks(r, events[ei] & 0xFFFFFFFF)
                else:
                    tables[r.req_id].append(next(blocks))
                ei += 1
            free = num_free - int(per_step[j])
            d, dr = durations[j]
            record(step + j - lag, now, d, dr, num_running, tokens_per_step, num_running * k,
                   len(waiting), free, usage(free))
            if progress is not None:
                progress(step + j + 1 - lag, now + d + dr, num_finished, arrivals.total)
        delay = t - env.now
        if env.now + delay == t:
            yield env.timeout(delay)
        else:
            for d, dr in durations:
                yield env.timeout(d + dr)
        # Every request's counters after the window's outputs; its acceptances used up.
        gained = emitted[:, done].tolist()
        accepted = acc[:, :done].sum(axis=1).tolist()
        for r, out, g, a in zip(running, outs, gained, accepted):
            r.num_computed_tokens += g
            r.num_output_tokens = out + g
            if k:
                self.accept.take(r, k, done)
                r.num_drafts_proposed += k * done
                r.num_drafts_accepted += a
                r.num_verify_steps += done
        if lag:
            # The last step scheduled stays in flight.
            last = context[:, done - 1].tolist()
            self.queue[0] = (StepPlan(scheduled=[
                Chunk(r, n, c, k, samples=True) for r, c in zip(running, last)]), step + done - 1)
        return done


def _decodes_steadily(sched: Scheduler, r: Request, n: int) -> bool:
    """Whether running request ``r``, as ``schedule()`` finds it, decodes steadily in chunks
    of ``n`` tokens (its token and n − 1 drafts): its outputs applied, nothing stale, its next
    chunk whole and never cut by the long-prefill threshold; asynchronously, its previous
    chunk in flight (placeholders for it, computed past its tokens by the drafts)."""
    k = n - 1
    if (r.num_output_tokens < 1 or r.num_draft_tokens != k or r.num_stale_output_tokens
            or r.status is not Status.RUNNING):
        return False
    if sched.params.async_scheduling:
        placeholders, offset = n, k
        in_flight = n if sched.sem.has_num_in_flight_tokens else 0
    else:
        placeholders = in_flight = 0
        offset = -1
    return (r.num_output_placeholders == placeholders and r.num_in_flight_tokens == in_flight
            and r.num_computed_tokens - r.num_tokens == offset and sched.chunk_size(r) == n
            and not 0 < sched.params.long_prefill_token_threshold < n)


def _is_decode_step(plan: StepPlan, running: list, n: int) -> bool:
    """``plan`` gives every request of ``running``, in order, one decode chunk of ``n``
    tokens (its n − 1 drafts) and nothing else."""
    pc = plan.prefix_cache
    if plan.preempted or plan.num_lazy or plan.exits or len(plan.scheduled) != len(running) or (
            pc.queries or pc.hits or pc.preempted_queries or pc.preempted_hits):
        return False
    return all(c.req is r and c.num_new_tokens == n and c.samples and c.num_spec_tokens == n - 1
               and not c.padded and c.num_computed_before >= r.num_prompt_tokens
               for c, r in zip(plan.scheduled, running))


def steady_gains(accepted: list[int], cap: int, fit: int) -> list[int]:
    """A steadily decoding request's tokens gained after each of its next outputs (E(0) = 0,
    E(t + 1) = E(t) + 1 + a_t) for as long as it stays steady: its outputs finish it not
    (E(t) <= ``cap``: ``outputs_left`` − 1) and every chunk it is scheduled fits whole
    (the one after t outputs starts E(t) past its computed tokens now: E(t) <= ``fit``)."""
    gains = [0, *accumulate(map(_plus_one, accepted))]
    # The last t with E(t) <= cap and E(t - 1) <= fit (E only grows).
    last = min(bisect_right(gains, cap) - 1, bisect_right(gains, fit))
    return gains[:last + 1]


_plus_one = (1).__add__


class _Path:
    """A speculative member's steady decode from its join: ``gains`` (``steady_gains`` of
    its acceptances, the output in flight at an asynchronous join first), computed tokens
    ``c0`` then; ``used`` of the acceptances are applied (the one in flight at the join as
    that step's own output)."""

    __slots__ = ("req", "join", "c0", "gains", "used")

    def __init__(self, req: Request, join: int, c0: int, gains: list[int], used: int):
        self.req, self.join, self.c0, self.gains, self.used = req, join, c0, gains, used


class SpecLazyDecode(LazyDecode):
    """Lazy decode with speculative decoding (a set-up ``spec_applies`` accepts; a lone
    engine or a router's replica): a member is scheduled a verify chunk of 1 + k tokens every step, and its
    outputs give it 1 + a tokens, ``a`` drawn ahead from its own stream when it joins
    (``Acceptance.peek``), so its whole steady path is known: its computed tokens and tokens
    at step j are c0 + E(j − join) and t0 + E(j − join) (``steady_gains``), its allocations
    act where the KV manager says they may (``decode_slack``), and it leaves before the
    step whose chunk or output is not a steady one. An output's own publication (vLLM's
    after-verify one) is left to the member's next allocation, which publishes as far
    before any lookup reads the hash map, or to when it is brought up to date (a preemption
    may free its blocks then): a member joins only if that holds and every block still to
    publish holds an output token (no other request can share it)."""

    def __init__(self, sched: Scheduler, queue, accept):
        super().__init__(sched, queue, accept)
        self.k = sched.spec.num_speculative_tokens
        self.chunk_len = 1 + self.k
        self.paths: dict[int, _Path] = {}

    def _last_step(self, r: Request, step: int, pending) -> int | None:
        sched, k, n = self.sched, self.k, self.chunk_len
        if not _decodes_steadily(sched, r, n):
            return None
        if self.is_async:  # the chunk in flight: a whole verify step of its own
            c = pending.get(id(r))
            if c is None or not c.samples or c.num_new_tokens != n or c.num_spec_tokens != k or c.padded:
                return None
        if not self._publications_can_wait(r):
            return None
        cap = sched.outputs_left(r) - 1
        if cap < 2:
            return None
        fit = sched.params.max_model_len - 1 - n - r.num_computed_tokens
        want = max(8, cap // n)  # verify steps: at least cap // n fit (each gains at most n)
        while True:  # (drawn ahead no further than needed: the rest would be thrown away)
            gains = steady_gains(self.accept.peek(r, k, want), cap, fit)
            if len(gains) <= want or want >= cap:
                break
            want = min(cap, 2 * want)
        life = len(gains) - 1
        if life < 2:
            return None
        self.paths[id(r)] = _Path(r, step, r.num_computed_tokens, gains,
                                  1 if self.is_async else 0)
        return step + life

    def _join(self, r: Request, step: int, leave: int) -> None:
        r.lz_sched, r.lz_upd, r.lz_in = step, self.upd_next, step
        self.num_members += 1
        heapq.heappush(self.leaving, (leave, r.rank, r))
        self._joined(r, step)

    def _materialize(self, r: Request) -> None:
        assert r.lz_sched is not None  # a member
        p = self.paths[id(r)]
        s = self.sched_next - r.lz_sched
        u = self.upd_next - r.lz_upd
        k, n = self.k, self.chunk_len
        if u:
            self.accept.take(r, k, u)  # (its acceptances: the ones its path was drawn with)
            gained = p.gains[p.used + u] - p.gains[p.used]
            p.used += u
            r.num_output_tokens += gained
            r.num_computed_tokens -= u * k - (gained - u)  # the rejected drafts
            r.num_drafts_proposed += u * k
            r.num_drafts_accepted += gained - u
            r.num_verify_steps += u
        r.num_computed_tokens += s * n
        if self.is_async:
            r.num_output_placeholders += (s - u) * n
        if self.in_flight:
            r.num_in_flight_tokens += (s - u) * n
        r.lz_sched += s
        r.lz_upd += u
        if u and self.kv.enable_caching:
            # What the last output published (an allocation since would have published as
            # far): a member brought up to date holds what step by step holds now (a
            # preemption may free its blocks next).
            upto = self.sched.published_after_output(r, self.is_async)
            if upto is not None:
                self.kv.cache_blocks(r, upto)

    def _next_event(self, r: Request, step: int, earliest: int) -> int | None:
        """The first step from ``earliest`` at which the member's allocation may act (where
        the KV manager says, ``decode_slack``, its tokens gained along its path), if before
        it leaves."""
        p = self.paths[id(r)]
        slack = self.kv.decode_slack(r, self.chunk_len, self.sched.spec.num_lookahead_tokens)
        if slack is None:
            return None
        event = max(bisect_left(p.gains, p.gains[step - p.join] + slack), earliest - p.join)
        return p.join + event if event < len(p.gains) - 1 else None

    def _leave(self, r: Request) -> None:
        self._materialize(r)
        self.num_members -= 1
        del self.paths[id(r)]
        self._marks.pop(id(r), None)
        r.lz_sched = None

    def _in_flight_chunk(self, r: Request) -> Chunk:
        self._materialize(r)
        p = self.paths[id(r)]
        return Chunk(r, self.chunk_len, p.c0 + p.gains[self.sched_next - 1 - p.join], self.k,
                     samples=True)

    def _sums(self, plan: StepPlan, step: int) -> None:
        n = self.chunk_len
        contexts = [p.c0 + p.gains[step - p.join] for p in self.paths.values()]
        plan.lazy_kv = sum(contexts) + n * len(contexts)
        plan.lazy_longest = max(contexts) + n
        plan.lazy_shortest = min(contexts) + n

    def members_tokens_to_compute(self) -> int:
        """Each member's tokens less its computed ones as ``_materialize`` would bring them
        up to date, without doing it (a router reads this between steps; bringing them up
        would draw their acceptances and publish their blocks early): a step scheduled adds
        n computed tokens, an output 1 + a tokens and 1 + a computed ones back of the n (its
        rejected drafts), so the gap moves by n per step whose output is still to come."""
        n = self.chunk_len
        return sum(max(0, r.num_tokens - r.num_computed_tokens
                       - n * ((self.sched_next - r.lz_sched) - (self.upd_next - r.lz_upd)))
                   for r in (p.req for p in self.paths.values()) if r.lz_sched is not None)

    def dissolve(self) -> None:
        super().dissolve()
        self.paths.clear()
