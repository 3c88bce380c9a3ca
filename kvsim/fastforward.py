"""Decode fast-forward: many steps of a batch that nothing can change, at the cost of few.

In a step where every running request decodes (one new token each, no drafts) and no
request can join, vLLM's ``schedule()`` gives each running request one token, in list order,
and ``update_from_output()`` gives each one output token. Until a request reaches
``max_tokens`` / ``max_model_len`` or a request could be admitted, the next step is the same
batch again, one token further. Inside such a window the only calls with an effect are the
``allocate_slots(req, 1)`` that cross a block boundary (a block is popped from the free
queue) or complete a block (its hash is published; with asynchronous scheduling the
``cache_blocks`` after the outputs arrive then finds nothing new). ``run`` makes exactly
those calls: the window's pops in one ``get_new_blocks`` (the free queue changes by nothing
else inside a window, so the same blocks come off in the same order and evict the same
hashes), handed out in step-by-step order (step, then position in the running list); the
publications in that order, with each request's counters set as they would be then (the
block hashes computed beforehand, a request at a time: hash ids are interned in another
order, and only their equality is ever read); then it moves the counters of all requests.

Step times and records are those of step-by-step simulation: each step has its own start
time, ``t_{j+1} = t_j + d_j`` as SimPy adds them, and the clock jumps to the window's end
in one timeout when that lands on the same float (else one timeout per step; the engine
is alone on its clock). A step is timed by the cost model's ``decode_step_time_s`` (the
step's chunks ``(1, c)`` enter
the cost models only through whole-number sums, Σ(c + 1) and the chunk count, which it is
given exactly; every other feature of a pure decode step, the MoE expert share included, is
fixed by the chunk count). The window stops before any step where step-by-step simulation
would do something else: a completion, an admissible arrival, a free queue too short for the
step's allocations, a run limit. With asynchronous scheduling (a batch queue of two) the step in
flight when the window starts must be such a step too; the window leaves its last step in
flight, as the engine loop would.
"""

from __future__ import annotations

from bisect import bisect_left

from kvsim.kv.manager import KVCacheManager
from kvsim.sched import Chunk, StepPlan


def applies(sched, accept) -> bool:
    """Whether the scheduler's set-up can be fast-forwarded at all (checked once per run)."""
    return (type(sched.kv) is KVCacheManager and accept is None
            and sched.spec.num_speculative_tokens == 0 and sched.spec.num_lookahead_tokens == 0
            and sched.draft_slots == 0 and sched.kv.num_reprefillable == 0)


def window(sched, queue, max_steps: int) -> int:
    """How many steps (up to ``max_steps``) the running batch decodes unchanged; 0 if none.

    ``queue`` is the engine's batch queue before scheduling: empty (synchronous), or the one
    plan in flight (asynchronous), which must itself be a plain decode step of the batch.
    """
    running = sched.running
    num_running = len(running)
    p = sched.params
    if not num_running or (len(sched.waiting) and num_running < p.max_num_seqs):
        return 0
    if num_running > min(sched.token_budget, p.max_num_batched_tokens):
        return 0
    is_async = p.async_scheduling
    if is_async:
        if len(queue) != 1 or not _is_decode_step(queue[0][0], running):
            return 0
        in_flight = 1 if sched.sem.has_num_in_flight_tokens else 0
    elif queue:
        return 0
    placeholders = 1 if is_async else 0
    if not is_async:
        in_flight = 0
    mml = p.max_model_len
    k = max_steps
    for r in running:
        tokens = r.num_prompt_tokens + r.num_output_tokens
        if (r.num_output_tokens < 1 or r.num_output_placeholders != placeholders
                or r.num_in_flight_tokens != in_flight or r.num_draft_tokens
                or r.num_stale_output_tokens
                or tokens + placeholders - r.num_computed_tokens != 1):
            return 0
        # The step scheduled j steps from now samples output number out + j + 1 (and is
        # skipped, asynchronously, when the one in flight already reaches max_tokens); the
        # window ends before any step in which a request finishes.
        k = min(k, r.max_tokens - r.num_output_tokens - 1, mml - tokens - 1)
        if k <= 0:
            return 0
    return k


def _is_decode_step(plan: StepPlan, running: list) -> bool:
    """``plan`` gives every request of ``running``, in order, one sampled token and nothing else."""
    pc = plan.prefix_cache
    if plan.preempted or len(plan.scheduled) != len(running) or pc.queries or pc.hits or (
            pc.preempted_queries or pc.preempted_hits):
        return False
    return all(c.req is r and c.num_new_tokens == 1 and c.samples and not c.num_spec_tokens
               and not c.padded and c.num_computed_before == r.num_computed_tokens - 1
               for c, r in zip(plan.scheduled, running))


def _events(kv, reqs, k: int) -> tuple[list[int], list[int]]:
    """Within ``k`` steps: the steps at which a block is popped (sorted, one per pop), and the
    block events, ``(j * len(reqs) + i) * 2 + kind``: ``reqs[i]`` pops a block at step j
    (kind 0) or publishes the blocks its ``num_tokens`` completed (kind 1) — in this order,
    as ``allocate_slots`` does them. A later event may not change anything."""
    b, num_reqs = kv.block_size, len(reqs)
    tables, cached, caching = kv.req_to_blocks, kv.num_cached_block, kv.enable_caching
    pops: list[int] = []
    events: list[int] = []
    end, stride = 2 * k * num_reqs, 2 * b * num_reqs
    for i, r in enumerate(reqs):
        # Step j needs slots for computed + j + 1 tokens: a pop whenever that passes the table.
        first_pop = len(tables[r.req_id]) * b - r.num_computed_tokens
        pops.extend(range(first_pop, k, b))
        events.extend(range(2 * (first_pop * num_reqs + i), end, stride))
        if caching:
            # Step j publishes up to num_tokens (tokens + j) // b blocks.
            first_fill = (cached.get(r.req_id, 0) + 1) * b - r.num_prompt_tokens - r.num_output_tokens
            if first_fill < 0:  # full blocks left unpublished: at once, then on the grid
                events.append(2 * i + 1)
            events.extend(range(2 * (first_fill % b * num_reqs + i) + 1, end, stride))
    pops.sort()
    return pops, events


def run(env, sched, cost, queue, arrivals, step: int, k: int,
        max_sim_time_s: float | None, record, progress, num_finished: int):
    """Simulate up to ``k`` decode steps, the next to schedule being ``step`` (a SimPy
    generator); returns how many were scheduled. Arrivals join the waiting queue as they
    would (join step, order); an arrival that could be admitted, or ``max_sim_time_s``,
    ends the window.

    The engine must be alone on its clock: the window's steps are timed first (step j
    starts at ``t_j``, ``t_{j+1} = t_j + d_j``, the sums SimPy makes step by step), then
    its block events are made, and the clock moves to the window's end in one timeout when
    that lands on the same float (else one timeout per step)."""
    running = sched.running
    num_running = len(running)
    kv = sched.kv
    pool = kv.pool
    pops, events = _events(kv, running, k)
    num_free = pool.num_free_blocks
    if len(pops) > num_free:
        k = pops[num_free]  # that step's allocation would fail: stop before it
        if k == 0:
            return 0
    # The step executed while step + j is scheduled: step + j itself, or the one before.
    lag = 1 if queue else 0
    base = [(r.num_computed_tokens, r.num_output_tokens) for r in running]
    sum_context = sum(c for c, _ in base) - lag * num_running
    full = num_running >= sched.params.max_num_seqs
    wake = arrivals.next_arrival_s()
    # Step times, and where the window stops: a run limit, or an arrival that could join.
    starts: list[float] = []
    durations: list[float] = []
    t = env.now
    step_time = cost.decode_step_time_s
    for j in range(k):
        if (max_sim_time_s is not None and t >= max_sim_time_s) or (
                not full and wake is not None and wake <= t):
            break
        d = step_time(num_running, sum_context + (j + 1) * num_running)
        starts.append(t)
        durations.append(d)
        t = t + d
    done = len(durations)
    if not done:
        return 0
    end = 2 * done * num_running
    events = sorted(e for e in events if e < end)
    # The free queue changes only by these pops inside a window (nothing is freed or
    # touched), and a popped block is never one published here: popping them all at once
    # evicts the same hashes, in the same order, and leaves the same hash map.
    num_pops = bisect_left(pops, done)
    blocks = iter(pool.get_new_blocks(num_pops))
    if kv.enable_caching:
        # Each request's block hashes up to what the window's last step publishes, in one
        # pass (ids are interned in another order than step by step; only their equality
        # is ever looked at).
        b, hasher = kv.block_size, kv.hasher
        for r, (_, out) in zip(running, base):
            num_full = (r.num_prompt_tokens + out + done - 1) // b
            if num_full > len(r.block_hashes):
                r.num_output_tokens = out + done - 1
                hasher.block_hashes(r, num_full)
                r.num_output_tokens = out
    tables = kv.req_to_blocks
    waiting = sched.waiting
    usage = pool.usage_at
    ei, num_events = 0, len(events)
    pi = 0
    for j in range(done):
        now = starts[j]
        if wake is not None and wake <= now:  # a full batch: arrivals wait
            for r in arrivals.arrived(now):
                r.join_step = step + j
                sched.add_request(r)
            wake = arrivals.next_arrival_s()
        limit = 2 * (j + 1) * num_running
        while ei < num_events and events[ei] < limit:
            i, fill = divmod(events[ei] - 2 * j * num_running, 2)
            r = running[i]
            if fill:
                c, out = base[i]
                r.num_computed_tokens, r.num_output_tokens = c + j + 1, out + j
                kv.cache_blocks(r, r.num_prompt_tokens + out + j)
            else:
                tables[r.req_id].append(next(blocks))
                pi += 1
            ei += 1
        free = num_free - pi
        record(step + j - lag, now, durations[j], num_running, len(waiting), free, usage(free))
        if progress is not None:
            progress(step + j + 1 - lag, now + durations[j], num_finished, arrivals.total)
    delay = t - env.now
    if env.now + delay == t:
        yield env.timeout(delay)
    else:
        for d in durations:
            yield env.timeout(d)
    for r, (c, out) in zip(running, base):
        r.num_computed_tokens, r.num_output_tokens = c + done, out + done
    if lag:
        # The last step scheduled stays in flight.
        queue[0] = (StepPlan(scheduled=[Chunk(r, 1, r.num_computed_tokens - 1, samples=True)
                                        for r in running]), step + done - 1)
    return done
