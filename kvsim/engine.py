"""The only SimPy code: one engine loop on a simulated clock.

Each scheduling call first admits the requests that have arrived by then (equal arrival times
join in workload order). Synchronously, a step is planned, the clock advances by the cost
model's step time, and the step's outcome is applied; with asynchronous scheduling (vLLM's
batch queue of two) step N + 1 is planned when step N starts, before N's outcome is applied.
When nothing is left to run the loop sleeps until the next arrival instead of polling.

The loop takes its requests from an arrival source: ``Arrivals`` (the workload in arrival
order) for a plain run; for a cluster, every replica's loop runs in the same environment and
takes what the router hands it (``kvsim.cluster``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Sequence, Sized
from dataclasses import dataclass, field
from typing import Protocol

import simpy

from kvsim import fastforward
from kvsim.assemble import acceptance_for, build_scheduler, cost_inputs
from kvsim.client import Client
from kvsim.cost import COST_MODELS
from kvsim.errors import EngineDeadError
from kvsim.kv.connector import ConnectorOutput, TimedWorker
from kvsim.kv.manager import KVCacheManager
from kvsim.request import Request, RequestSpec
from kvsim.sched import PrefixCacheStats, Scheduler
from kvsim.schema import Scenario
from kvsim.specdec import Acceptance, AcceptanceTally

_MAX_WINDOW = 1 << 30  # steps of one decode window when no run limit caps it
_TRIM_HASHES = 1 << 21  # len(BlockHasher) (keys, chains) reached before unused ones are dropped


@dataclass(slots=True)
class StepRecord:
    step: int
    start_s: float
    duration_s: float  # the whole step, drafting included
    draft_s: float  # of which the drafter's own passes
    num_scheduled_tokens: int
    num_spec_tokens: int  # draft tokens verified in this step
    num_prefill_tokens: int
    num_decode_tokens: int
    num_scheduled_reqs: int
    num_preempted: int
    num_running: int
    num_waiting: int
    num_free_blocks: int
    kv_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    preempted_prefix_cache_queries: int
    preempted_prefix_cache_hits: int


@dataclass(slots=True)
class Records:
    """What a run produced: the requests (with their timings) and one record per step."""

    requests: list[Request]
    steps: list[StepRecord] = field(default_factory=list)
    end_s: float = 0.0
    # "max_steps" / "max_sim_time_s" when a limit cut the run; "stall" when vLLM's own
    # algorithm deadlocks (nothing can be scheduled, requests left); "engine_dead" when the
    # release's own code raises (``stop_detail``: its exception, ``EngineDeadError``).
    stopped_by: str | None = None
    stop_detail: str | None = None
    cost_label: str = ""
    # vLLM's num_accepted_tokens_per_pos (speculative decoding only; a cluster's summed).
    accepted_per_pos: list[int] | None = None
    # A cluster or data-parallel run: each engine's own records (its requests and steps), in
    # replica order, a replica's ranks in rank order; ``steps`` above then holds every
    # engine's steps, engine by engine.
    replicas: list[Records] | None = None
    # Which engine these are the records of (in a ``replicas`` list): the cluster replica
    # and, with data parallel, the rank.
    replica: int = 0
    dp_rank: int | None = None
    # An MoE model's DP rank: the dummy batches it ran in lockstep waves, having nothing to run.
    num_dummy_steps: int = 0
    # When a benchmark client's measured run started, after its warm-ups (kvsim.client).
    benchmark_start_s: float = 0.0
    # A KV offload tier's counters under vLLM's names (external_prefix_cache_*,
    # kv_offload_{load,store}_{bytes,time}); None without one.
    kv_offload: dict[str, float] | None = None
    # A P/D instance's NIXL counters (kvsim.pd.PDTransfers.report); None otherwise.
    kv_transfer: dict | None = None


class ArrivalSource(Protocol):
    """Where an engine loop takes its requests from: ``Arrivals`` for a plain run, a
    cluster's ``RoutedArrivals`` for a replica.

    ``until_next(env)`` is what an idle engine waits on for its next request (None: none can
    come); ``finished(reqs, now)`` tells the source which requests a step finished (a P/D
    prefill instance's go on to their decode instance)."""

    def advance(self, now: float) -> None: ...

    def arrived(self, now: float) -> list[Request]: ...

    def next_arrival_s(self) -> float | None: ...

    def until_next(self, env: simpy.Environment) -> simpy.Event | None: ...

    def finished(self, reqs: list[Request], now: float) -> None: ...


class Arrivals:
    """The requests of one engine, in arrival order (equal times keep their order).

    ``specs`` may be any iterable of ``RequestSpec``: each request is made only when it is
    next to arrive (and appended to ``made``, when given), so a streamed run holds only the
    requests that have arrived and not finished."""

    __slots__ = ("_specs", "_made", "_seq", "_head", "total")

    def __init__(self, specs: Iterable[RequestSpec], made: list[Request] | None = None):
        self.total = len(specs) if isinstance(specs, Sized) else 0  # 0: not known
        self._specs = iter(specs)
        self._made = made
        self._seq = 0
        self._head: Request | None = None
        self._next()

    def _next(self) -> None:
        spec = next(self._specs, None)
        if spec is None:
            self._head = None
            return
        self._head = head = Request(spec, self._seq)
        self._seq += 1
        if self._made is not None:
            self._made.append(head)

    def advance(self, now: float) -> None:
        """Time has reached ``now`` (a cluster routes what has arrived; nothing to do here)."""

    def arrived(self, now: float) -> list[Request]:
        """The requests not yet handed out that have arrived by ``now``, in order."""
        out = []
        while self._head is not None and self._head.arrival_s <= now:
            out.append(self._head)
            self._next()
        return out

    def next_arrival_s(self) -> float | None:
        """When the next request can arrive; None when none will."""
        return None if self._head is None else self._head.arrival_s

    def until_next(self, env: simpy.Environment) -> simpy.Event | None:
        t = self.next_arrival_s()
        return None if t is None else env.timeout(t - env.now)

    def finished(self, reqs: list[Request], now: float) -> None:
        pass

    def rest(self) -> list[Request]:
        """Every request that has not arrived (made now)."""
        out = []
        while self._head is not None:
            out.append(self._head)
            self._next()
        return out


def run(sc: Scenario, specs: Iterable[RequestSpec], check_invariants: bool = False,
        progress: Callable[[int, float, int, int], None] | None = None,
        accept: Acceptance | None = None, results=None, workers: int = 1) -> Records:
    """Simulate ``specs`` (sorted by arrival) on the scenario's engine, or on its cluster of
    replicas behind a router (``[cluster]``); returns the records.

    ``accept`` replaces the scenario's acceptance model (e.g. one that records its draws).
    With ``results`` (a ``metrics.Results``; not for a cluster) every step record and every
    request, once final, goes there instead of into the records, and requests are made from
    ``specs`` only as they arrive: memory stays flat however long the run. ``workers``: a
    cluster's replicas on that many processes, the records the same (``kvsim.parallel``).
    """
    if accept is None and sc.speculative.enabled:
        accept = acceptance_for(sc)
    if sc.multi_engine:
        from kvsim.cluster import run_cluster  # it builds on this module

        if results is not None:
            raise ValueError("a cluster run is not streamed (its result files group by replica)")
        return run_cluster(sc, [Request(s, i) for i, s in enumerate(specs)], accept,
                           check_invariants, progress, workers)
    rec = Records(requests=[])
    made = rec.requests if results is None else None
    w = sc.workload
    arrivals = (Client(specs, w.max_concurrency, w.num_warmups, made, sc.cost.frontend_latency_s)
                if w.client else Arrivals(specs, made))
    simulate([(sc, build_scheduler(sc), arrivals, rec)], accept, check_invariants, progress,
             results)
    if isinstance(arrivals, Client):
        start = arrivals.benchmark_start_s
        rec.benchmark_start_s = rec.end_s if start is None else start
    return rec


def simulate(engines: Sequence[tuple[Scenario, Scheduler, ArrivalSource, Records]],
             accept: Acceptance | None,
             check_invariants: bool = False, progress=None, results=None, links=None,
             transfers=None, drive: Callable[[simpy.Environment], None] | None = None) -> None:
    """Run one engine loop per ``(scenario, scheduler, arrivals, records)`` on one clock until
    none has anything left to do; each fills its records (a lone engine: or ``results``).
    ``links(env, costs)``, if given, makes the engines data-parallel ranks: it returns each
    engine's ``kvsim.dp.RankLink`` (or None) and starts the DP coordinators' processes.
    ``transfers(env)``, if given, returns each engine's connector transfers in time (a P/D
    cluster's, ``kvsim.pd``); an engine whose entry is None, or every engine without it,
    times its connector itself (an offload tier: ``Transfers``). An engine left waiting on
    another that can no longer run (a P/D prefill instance holding blocks for a decode
    instance that stopped) ends, when the clock runs out of events, as stopped by that
    instance's run limit, or by "stall" if it deadlocked. ``drive(env)``, if given, runs the
    clock instead of ``env.run()`` (a worker process of ``kvsim.parallel`` runs it in pieces).

    An engine keeps its steadily decoding requests lazily (``kvsim.fastforward``; not a
    data-parallel rank, and with speculative decoding only alone); what a router reads of a
    replica stays exact (``Scheduler.tokens_to_compute``, the pool, the hash map). A lone
    engine fed by ``Arrivals`` also decodes in windows and trims its interned block hashes
    (replicas share one hash id space)."""
    env = simpy.Environment()
    tallies = []
    alone = len(engines) == 1 and type(engines[0][2]) in (Arrivals, Client)
    costs = [COST_MODELS[sc.cost.model](cost_inputs(sc)) for sc, _, _, _ in engines]
    rank_links = links(env, costs) if links is not None else [None] * len(engines)
    timed = transfers(env) if transfers is not None else [None] * len(engines)
    loops = []
    for (sc, sched, arrivals, rec), cost, link, xfer in zip(engines, costs, rank_links, timed):
        rec.cost_label = cost.label
        tally = AcceptanceTally(accept) if accept is not None else None
        tallies.append(tally)
        if xfer is None:
            xfer = Transfers(sc, rec) if sched.connector is not None else NO_TRANSFERS
        loops.append((env.process(_engine_loop(
            env, sc, sched, cost, tally, rec, arrivals, check_invariants, progress,
            results if alone else None, alone, link, xfer)), rec, xfer))
    if drive is None:
        env.run()
    else:
        drive(env)
    # An engine still waiting for an event nothing will trigger: another one it depends on
    # stopped, at a run limit (that limit stops it too) or in a deadlock.
    cause = next((r.stopped_by for _, r, _ in loops if r.stopped_by not in (None, "stall")),
                 "stall")
    for proc, rec, xfer in loops:
        if proc.is_alive:
            rec.stopped_by = rec.stopped_by or cause
            xfer.report()
            rec.end_s = env.now
    for (sc, _, _, rec), tally in zip(engines, tallies):
        if tally is not None:
            rec.accepted_per_pos = tally.accepted_per_pos(sc.speculative.num_speculative_tokens)


def _engine_loop(env, sc, sched, cost, accept, rec, arrivals, check_invariants, progress,
                 results, alone, link, transfers):
    """One engine core's loop; ``link`` (a ``kvsim.dp.RankLink``) makes it a data-parallel
    rank: it reports its counts to the DP coordinator, and an MoE model's rank steps in
    lockstep with the others (``link.lockstep``); ``transfers`` times its KV connector."""
    lockstep = link.lockstep if link is not None else None
    try:
        yield from _engine_steps(env, sc, sched, cost, accept, rec, arrivals, check_invariants,
                                 progress, results, alone, link, lockstep, transfers)
    finally:
        if link is not None:
            link.leave()


def _engine_steps(env, sc, sched, cost, accept, rec, arrivals, check_invariants, progress,
                  results, alone, link, lockstep, transfers):
    limits = sc.run
    add_step = rec.steps.append if results is None else results.step

    def decode_record(*fields):  # a decode window's step
        add_step(_decode_record(*fields))
    # vLLM's EngineCore: synchronous scheduling runs schedule -> execute -> update; with
    # asynchronous scheduling a queue of two batches lets step N + 1 be scheduled while step N
    # executes (its outputs are applied after), and the queue fills first (0.19/0.22 only
    # schedule the second batch once the first has executed, unless the first is empty),
    # which kvsim, like its oracle driver, takes as never: the device is busy):
    # Scheduler.schedules_ahead.
    queue: deque = deque()  # (plan, step index or None), newest first
    step = num_finished = 0
    last_step_s = 0.0
    # Lazy decode, for a lone engine and a router's replicas (what a router reads of them
    # stays exact); decode windows only alone on the clock.
    lazy: fastforward.LazyDecode | None = None
    if link is None and not check_invariants:
        if fastforward.applies(sched, accept):
            lazy = fastforward.LazyDecode(sched, queue)
        elif fastforward.spec_applies(sched, accept):
            lazy = fastforward.SpecLazyDecode(sched, queue, accept)
    trim_at = _TRIM_HASHES if alone and isinstance(sched.kv, KVCacheManager) else None
    while True:
        now = env.now
        if limits.max_sim_time_s is not None and now >= limits.max_sim_time_s:
            rec.stopped_by = "max_sim_time_s"
            break
        if limits.max_steps is not None and step >= limits.max_steps:
            rec.stopped_by = "max_steps"
            break
        for r in arrivals.arrived(now):
            r.join_step = step
            sched.add_request(r)
        if link is not None:
            link.report()  # before the step (DPEngineCoreProc._maybe_publish_request_counts)
        if alone and lazy is not None and lazy.window_ahead(step, now, arrivals, last_step_s):
            done = yield from lazy.run_window(
                env, cost, arrivals, step, _MAX_WINDOW if limits.max_steps is None
                else limits.max_steps - step, limits.max_sim_time_s, decode_record, progress,
                num_finished)
            if done:
                step += done
                continue
        if sched.has_requests:
            try:
                plan = sched.schedule() if lazy is None else lazy.schedule(step)
            except EngineDeadError as exc:  # the engine core dies in the step it schedules
                rec.stopped_by, rec.stop_detail = "engine_dead", str(exc)
                break
            executed = plan.executes
            transfers.planned(plan)
            if sched.num_unfinished and not (
                    executed or plan.preempted or any(q[0].executes for q in queue)
                    or transfers.pending(plan, *(q[0] for q in queue))):
                # The release deadlocks: the head of the waiting queue can never be admitted
                # and nothing runs (e.g. 0.19's admission gate without a window cap, #39734).
                rec.stopped_by = "stall"
                break
            index = None
            if executed:
                index, step = step, step + 1
            queue.appendleft((plan, index))
            if sched.schedules_ahead(len(queue), executed):
                continue
        elif not queue:
            if lockstep is not None and lockstep.running():  # the wave runs: a dummy batch
                rec.num_dummy_steps += 1
                yield from lockstep.step(link.rank.index, *lockstep.dummy(link.rank.index))
                continue
            wake = arrivals.until_next(env)
            if wake is None:
                break
            yield wake  # idle until the next arrival
            continue
        plan, index = queue.pop()
        begin = transfers.begin(plan, env.now)  # a flush holds the step up
        if begin > env.now:
            yield env.timeout(begin - env.now)
        start = env.now
        duration = draft = 0.0
        if index is not None:
            for c in plan.scheduled:
                if c.req.first_scheduled_step is None:  # its queue time ends as this step starts
                    c.req.first_scheduled_step, c.req.first_scheduled_s = index, start
            chunks = [(c.num_new_tokens, c.num_computed_before) for c in plan.scheduled]
            # Lazily planned members sample too; their chunks come as sums (cost Decodes).
            num_sampled = sum(c.samples for c in plan.scheduled) + plan.num_lazy
            sums = (plan.num_lazy, plan.lazy_len, plan.lazy_kv, plan.lazy_longest,
                    plan.lazy_shortest) if plan.num_lazy else None
            duration = cost.step_time_s(chunks, num_sampled, sums)
            draft = cost.draft_time_s(chunks, num_sampled, sums)
            if lockstep is None:
                yield env.timeout(duration + draft)
            else:
                tokens = plan.num_scheduled_tokens
                yield from lockstep.step(link.rank.index, duration + draft, cost.moe_time_s(tokens),
                                         tokens)
                duration = env.now - start - draft  # the slowest rank's, and the exchange
            last_step_s = duration + draft
            arrivals.advance(env.now)  # a router decides before this step's outcome lands
        elif lockstep is not None:  # nothing executed while the wave runs: a dummy batch
            rec.num_dummy_steps += 1
            yield from lockstep.step(link.rank.index, *lockstep.dummy(link.rank.index))
        elif (wake := transfers.idle(env, arrivals)) is not None:
            # Nothing runs but transfers: the engine steps on until one finishes (or a
            # request arrives).
            yield wake
        end = env.now
        if lazy is None:
            first, finished = sched.update_from_output(plan, accept, transfers.end(end))
        else:
            first, finished = lazy.update(plan, index, accept)
        for r in first:
            r.first_token_step, r.first_token_s = index, end
        for r in finished:
            r.finish_step, r.finish_s = index, end
            r.block_hashes = []  # never looked up again
            if accept is not None:
                accept.forget(r)
        if finished:
            arrivals.finished(finished, end)
        num_finished += len(finished)
        if link is not None:
            link.report()  # after the step
        if index is not None:
            add_step(_step_record(index, start, duration, draft, plan, sched))
        if results is not None:
            for r in finished:
                results.request(r)
        if check_invariants:
            sched.check_invariants()
        if trim_at is not None and len(sched.kv.hasher) > trim_at:
            sched.kv.forget_unused_hashes(
                [*sched.running, *sched.kv_holding, *sched.waiting],
                sched.connector.held_keys() if sched.connector is not None else ())
            trim_at = max(_TRIM_HASHES, 2 * len(sched.kv.hasher))
        if progress is not None and index is not None:
            progress(index + 1, end, num_finished,
                     arrivals.total if alone else len(rec.requests))
    if lazy is not None:
        lazy.dissolve()  # every request's counters as step-by-step simulation leaves them
    transfers.report()
    rec.end_s = env.now
    if alone:
        left = arrivals.rest()  # made now: a run cut short lists them too
        if results is not None:
            for r in [*sched.running, *sched.kv_holding, *sched.waiting, *left]:
                results.request(r)


class ConnectorTimes:
    """What an engine's KV-connector transfers in time share, whatever the connector: vLLM's
    connector prefix-cache stats of each schedule() (``external_prefix_cache_*``), and
    whether planned steps still hand the worker something. Subclasses: ``Transfers`` (an
    offload tier), ``kvsim.pd.PDTransfers`` (a P/D instance)."""

    def __init__(self, rec: Records):
        self.rec = rec
        self.external = PrefixCacheStats()

    def planned(self, plan) -> None:
        """vLLM's connector prefix-cache stats of one schedule()."""
        self.external.add(plan.external_prefix_cache)

    @staticmethod
    def hand_over(plans) -> bool:
        return any(p.connector_meta is not None and p.connector_meta.hands_over for p in plans)


class Transfers(ConnectorTimes):
    """An engine's KV-connector transfers in time: the worker's copies over the host link
    (``TimedWorker``) and vLLM's counters, written to the records at the end
    (``Records.kv_offload``)."""

    def __init__(self, sc: Scenario, rec: Records):
        super().__init__(rec)
        hw = sc.hardware
        assert hw.host_link_bandwidth_bytes_per_s is not None  # config requires it with a tier
        self.worker = TimedWorker(sc.engine.kv_block_bytes, hw.host_link_bandwidth_bytes_per_s,
                                  hw.host_link_latency_s)

    def pending(self, *plans) -> bool:
        """Whether transfers are in flight or planned steps still hand some over."""
        return self.worker.busy or self.hand_over(plans)

    def begin(self, plan, now: float) -> float:
        """Submit the step's transfers; when it can start."""
        return self.worker.begin_step(plan.connector_meta, now)

    def idle(self, env, arrivals) -> simpy.Event | None:
        """What a step that runs nothing waits for: the next transfer's end or arrival; None
        when nothing is in flight (the next step submits what is waiting at once)."""
        done = self.worker.next_done_s()
        if done is None:
            return None
        arrival = arrivals.next_arrival_s()
        return env.timeout(max(0.0, (done if arrival is None else min(done, arrival)) - env.now))

    def end(self, now: float) -> ConnectorOutput | None:
        return self.worker.end_step(now)

    def report(self) -> None:
        w = self.worker
        self.rec.kv_offload = {**self.external.external_counters(),
                               "kv_offload_load_bytes": w.load_bytes,
                               "kv_offload_store_bytes": w.store_bytes,
                               "kv_offload_load_time_s": w.load_time_s,
                               "kv_offload_store_time_s": w.store_time_s}


class _NoTransfers:
    """An engine without a KV connector: nothing to time or count."""

    def planned(self, plan) -> None:
        pass

    def pending(self, *plans) -> bool:
        return False

    def begin(self, plan, now: float) -> float:
        return now

    def idle(self, env, arrivals) -> simpy.Event | None:
        return None

    def end(self, now: float) -> ConnectorOutput | None:
        return None

    def report(self) -> None:
        pass


NO_TRANSFERS = _NoTransfers()


def _decode_record(step, start, duration, draft, num_running, num_tokens, num_spec,
                   num_waiting, num_free_blocks, kv_usage) -> StepRecord:
    """The record ``_step_record`` makes of a decode window's step: every running request
    scheduled, ``num_tokens`` decode tokens of which ``num_spec`` drafts, nothing else."""
    return StepRecord(step, start, duration + draft, draft, num_tokens, num_spec, 0, num_tokens,
                      num_running, 0, num_running, num_waiting, num_free_blocks, kv_usage,
                      0, 0, 0, 0)


def _step_record(step, start, duration, draft, plan, sched) -> StepRecord:
    # Decode tokens: those scheduled past the prompt (a re-prefill after preemption counts
    # as prefill, like vLLM's own prompt/generation split).
    decode = plan.num_lazy * plan.lazy_len + sum(c.num_new_tokens for c in plan.scheduled
                                                 if c.num_computed_before >= c.req.num_prompt_tokens)
    total = plan.num_scheduled_tokens
    pc = plan.prefix_cache
    pool = sched.kv.pool
    return StepRecord(
        step=step, start_s=start, duration_s=duration + draft, draft_s=draft,
        num_scheduled_tokens=total,
        num_spec_tokens=plan.num_lazy * (plan.lazy_len - 1) + sum(
            c.num_spec_tokens for c in plan.scheduled if not c.padded),
        num_prefill_tokens=total - decode, num_decode_tokens=decode,
        num_scheduled_reqs=len(plan.scheduled) + plan.num_lazy, num_preempted=len(plan.preempted),
        num_running=len(sched.running), num_waiting=len(sched.waiting) + len(sched.kv_holding),
        num_free_blocks=pool.num_free_blocks, kv_usage=pool.usage(),
        prefix_cache_queries=pc.queries, prefix_cache_hits=pc.hits,
        preempted_prefix_cache_queries=pc.preempted_queries,
        preempted_prefix_cache_hits=pc.preempted_hits)
