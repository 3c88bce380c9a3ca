"""Many vLLM replicas behind a router (``[cluster]``), on one simulated clock.

Each replica is a whole engine (its own scheduler, block pool and prefix cache, and its own
``[engine]`` settings where a ``[[cluster.deployment]]`` says so); all replicas' engine loops
run in one SimPy environment (``engine.simulate``), or spread over processes that meet where
the router acts, with the same results (``kvsim.parallel``). A request is routed when it arrives, from
what the router can see at that instant, and goes to that replica's queue; the replica admits
it at its next scheduling call, exactly as a lone engine admits an arrival.

Routing is lazy but exact: replica state changes only at engine events (a step planned, a
step's outcome applied), so the state at an arrival instant ``a`` is the state just before the
first event at or after ``a``. Every replica loop asks the router to route what has arrived
before it changes anything (``RoutedArrivals.advance`` / ``arrived``), and an idle replica
sleeps until the next arrival, whoever gets it. Nothing a router reads changes between events,
so deciding before the next event acts is deciding at the arrival. With one replica this is
the plain engine loop: the same admission times, the same output.

What the router sees of a replica (``Replica``), as a real router would:

* its outstanding requests: routed and not finished (waiting, running, or routed but not yet
  admitted), which a router knows from its own dispatches and the streamed responses;
* the tokens still to compute for them, ``sum(num_tokens - num_computed_tokens)`` (a waiting
  request counts its whole prompt: its hit is known only at admission), as NVIDIA Dynamo's KV
  router tracks the prefill load of what it dispatched;
* vLLM's KV-cache usage (``vllm:kv_cache_usage_perc``), exact at the instant where a real
  router scrapes it with some lag;
* the prefix it would hit, from the replica's own block-hash map: the manager's real lookup
  (``get_computed_blocks``: chained block hashes, the EAGLE drop, hybrid groups), read-only
  (no LRU touch, no stats). This is what a router fed vLLM's KV events (block stored / removed,
  as llm-d's precise prefix-cache scorer and Dynamo's KV router consume) knows, without the
  events' delivery lag; an approximate index (SGLang's router, llm-d's estimated scorer: the
  prefixes the router sent, not what the replica kept) is not modelled.

Block hashes are comparable across replicas because every replica that caches hashes in one
id space (``share_hashes``), as vLLM's content hashes are equal on every replica of a
deployment.

A replica with ``data_parallel_size`` > 1 is a ``DPGroup``: its ranks are engines behind
vLLM's own DP load balancer (``kvsim.dp``), and the router sees the group as one server
(requests and pending tokens summed over the ranks, KV usage their mean, the best rank's
prefix). A scenario without ``[cluster]`` but with data parallel runs here as one such group.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import replace
from typing import Protocol

import simpy

from kvsim import dp, parallel
from kvsim.assemble import cost_inputs
from kvsim.cost.comm import ExpertExchange
from kvsim.engine import Records, build_scheduler, simulate
from kvsim.errors import EngineDeadError
from kvsim.pd import PDNetwork, PDTransfers, Waker, any_of, pd_pools
from kvsim.request import KVTransferParams, Request, RequestSpec
from kvsim.sched import Scheduler
from kvsim.schema import ClusterCfg, Scenario
from kvsim.specdec import Acceptance


class RoutedReplica(Protocol):
    """What a router reads of a replica and how it sends one a request (``Replica``, a
    ``DPGroup``, or a replica simulated in another process, ``kvsim.parallel``)."""

    index: int

    def receive(self, req: Request) -> None: ...

    def num_requests(self) -> int: ...

    def pending_tokens(self) -> int: ...

    def kv_usage(self) -> float: ...

    def cached_tokens(self, req: Request) -> int: ...


class Dispatcher(Protocol):
    """What a replica's arrivals (``RoutedArrivals``) ask of whoever routes requests."""

    def route_until(self, now: float) -> None: ...

    def next_arrival_s(self) -> float | None: ...

    def until_next(self, env: simpy.Environment, replica: Replica) -> simpy.Event | None: ...

    def finished(self, replica: Replica, reqs: list[Request], now: float) -> None: ...


class Replica:
    """One replica as the router sees it."""

    __slots__ = ("index", "dp_rank", "sched", "requests", "inbox", "num_outstanding",
                 "handed_tokens")

    def __init__(self, index: int, sched: Scheduler, dp_rank: int | None = None):
        self.index = index
        self.dp_rank = dp_rank  # a DP group's rank
        self.sched = sched
        self.requests: list[Request] = []  # every request routed here, in routing order
        self.inbox: list[Request] = []  # routed, not yet handed to the engine loop
        self.num_outstanding = 0  # routed, not finished
        # The tokens of the outstanding requests not yet in the scheduler's queues.
        self.handed_tokens = 0

    def receive(self, req: Request) -> None:
        """The router sends ``req`` here."""
        self.reserve(req)
        self.deliver(req)

    def reserve(self, req: Request) -> None:
        """The router has chosen this replica for ``req`` (outstanding here from now on; a
        P/D decode instance gets it once its prefill instance is done)."""
        req.replica, req.dp_rank = self.index, self.dp_rank
        self.requests.append(req)
        self.num_outstanding += 1
        self.handed_tokens += req.num_tokens

    def deliver(self, req: Request) -> None:
        """``req`` reaches the engine (its loop admits it at its next scheduling call)."""
        self.inbox.append(req)

    def take_inbox(self) -> list[Request]:
        """The requests delivered since, for the engine loop to add."""
        out, self.inbox = self.inbox, []
        self.handed_tokens -= sum(r.num_tokens for r in out)
        return out

    def finished(self, reqs: list[Request]) -> None:
        self.num_outstanding -= len(reqs)

    def num_requests(self) -> int:
        """Waiting + running + routed but not yet admitted."""
        return self.num_outstanding

    def pending_tokens(self) -> int:
        """Tokens still to compute for the outstanding requests."""
        return self.handed_tokens + self.sched.tokens_to_compute()

    def kv_usage(self) -> float:
        return self.sched.kv.pool.usage()

    def cached_tokens(self, req: Request) -> int:
        """The prefix-cache hit ``req`` would get here now (the manager's own lookup; 0 where
        that lookup kills the release's engine, which then dies when it schedules ``req``)."""
        try:
            return self.sched.kv.hit_tokens(req)
        except EngineDeadError:
            return 0


class DPGroup:
    """A replica of data-parallel ranks, as the router sees it (``Replica``'s interface): one
    server whose DP load balancer (``balancer``, set when the clock starts) picks the rank."""

    def __init__(self, index: int, ranks: list[Replica]):
        self.index = index
        self.ranks = ranks
        self.balancer: dp.Balancer | None = None

    def receive(self, req: Request) -> None:
        assert self.balancer is not None
        self.ranks[self.balancer.route(req)].receive(req)

    def num_requests(self) -> int:
        return sum(r.num_requests() for r in self.ranks)

    def pending_tokens(self) -> int:
        return sum(r.pending_tokens() for r in self.ranks)

    def kv_usage(self) -> float:
        return sum(r.kv_usage() for r in self.ranks) / len(self.ranks)

    def cached_tokens(self, req: Request) -> int:
        return max(r.cached_tokens(req) for r in self.ranks)


class Router:
    """Routes each request, at its arrival, to one replica by the configured policy.

    Ties go to the less loaded replica, then to the lower index (see each policy).
    """

    def __init__(self, cfg: ClusterCfg, replicas: Sequence[RoutedReplica], requests: list[Request],
                 seed: int):
        self.cfg = cfg
        self.replicas = replicas
        self._reqs = requests
        self._next = 0
        self._count = 0  # round_robin
        self._rng = random.Random(seed)  # random
        self._sessions: dict[str, RoutedReplica] = {}  # session_affinity
        self.choose = getattr(self, "_" + cfg.router)

    def next_arrival_s(self) -> float | None:
        return self._reqs[self._next].arrival_s if self._next < len(self._reqs) else None

    def route_until(self, now: float) -> None:
        """Route every request that has arrived by ``now``, in arrival order."""
        reqs = self._reqs
        while self._next < len(reqs) and reqs[self._next].arrival_s <= now:
            req = reqs[self._next]
            self._next += 1
            self.dispatch(req)

    def dispatch(self, req: Request) -> None:
        self.choose(req).receive(req)

    def finished(self, replica: Replica, reqs: list[Request], now: float) -> None:
        """``replica`` finished ``reqs`` (a P/D proxy hands prefilled requests on)."""

    def until_next(self, env: simpy.Environment, replica: Replica) -> simpy.Event | None:
        """What an idle ``replica`` waits on: the next arrival (None: none will come)."""
        t = self.next_arrival_s()
        return None if t is None else env.timeout(t - env.now)

    # -- policies: each returns a replica ------------------------------------------------

    def _round_robin(self, req: Request) -> RoutedReplica:
        i = self._count % len(self.replicas)
        self._count += 1
        return self.replicas[i]

    def _random(self, req: Request) -> RoutedReplica:
        return self.replicas[self._rng.randrange(len(self.replicas))]

    def _load(self, rep: RoutedReplica) -> tuple:
        if self.cfg.load_metric == "kv_usage":
            return rep.kv_usage(), rep.num_requests()
        return (rep.num_requests(),)

    def _least_loaded(self, req: Request) -> RoutedReplica:
        """The lowest load (``load_metric``; KV usage ties go by requests), then lowest index."""
        return min(self.replicas, key=lambda rep: (self._load(rep), rep.index))

    def _prefix_aware(self, req: Request) -> RoutedReplica:
        """Highest ``(1 - w) * cached - w * pending`` (``w = load_weight``; cached: the prefix
        this replica's cache would give the request now; pending: tokens still to compute for
        its outstanding requests), then fewer pending tokens, fewer requests, lowest index."""
        w = self.cfg.load_weight

        def key(rep: RoutedReplica):
            pending = rep.pending_tokens()
            cached = rep.cached_tokens(req)
            return (-((1 - w) * cached - w * pending), pending, rep.num_requests(), rep.index)
        return min(self.replicas, key=key)

    def _session_affinity(self, req: Request) -> RoutedReplica:
        """A session's first request goes where least_loaded would send it, its later ones to
        the same replica; a request without a session id goes by least_loaded."""
        sid = req.session_id
        if sid is None:
            return self._least_loaded(req)
        rep = self._sessions.get(sid)
        if rep is None:
            rep = self._sessions[sid] = self._least_loaded(req)
        return rep


class PDRouter(Router):
    """The P/D proxy, as vLLM's P/D proxy behind llm-d's pd-profile-handler: when a request
    arrives it picks the decode instance first (this router's policy over the decode pool),
    then asks llm-d's prefix-based decider (``non_cached_tokens``) whether to run a prefill
    instance at all; if so it picks one (``prefill_router`` over the prefill pool) and sends it
    the request with ``max_tokens = 1`` and ``do_remote_decode``. When that finishes, the
    request goes to its decode instance with the ``kv_transfer_params`` the prefill's output
    carried. A request the decider keeps from the prefill pool goes to its decode instance
    alone. The decode instance counts a request in prefill as outstanding (the proxy knows
    its own dispatches)."""

    def __init__(self, cfg: ClusterCfg, prefill: list[Replica], decode: list[Replica],
                 requests: list[Request], seed: int):
        super().__init__(cfg, list(decode), requests, seed)
        self.prefill = Router(replace(cfg, router=cfg.prefill_router), list(prefill), [],
                              seed + 1)
        self.threshold = cfg.non_cached_tokens
        # The engines' network, once the clock exists (P/D instances are one engine each:
        # a replica's index is its engine's).
        self.net: PDNetwork | None = None
        self.in_prefill: dict[tuple[int, str], tuple[Request, Replica]] = {}
        self.expected: dict[int, int] = {}  # decode replica -> requests still in prefill

    def dispatch(self, req: Request) -> None:
        drep = self.choose(req)
        assert isinstance(drep, Replica)
        drep.reserve(req)
        if not self._disaggregate(req, drep):
            drep.deliver(req)
            return
        prep = self.prefill.choose(req)
        shadow = Request(RequestSpec(req.req_id, req.arrival_s, req.prompt, 1, req.priority,
                                     None, req.session_id), req.seq)
        shadow.kv_transfer_params = KVTransferParams(do_remote_decode=True)
        req.prefill_replica = prep.index
        self.in_prefill[(prep.index, req.req_id)] = (req, drep)
        self.expected[drep.index] = self.expected.get(drep.index, 0) + 1
        prep.receive(shadow)

    def _disaggregate(self, req: Request, drep: Replica) -> bool:
        """llm-d's prefix-based-pd-decider: a prefill instance unless the prompt, or its part
        the decode instance has not cached, is shorter than ``non_cached_tokens``."""
        n = self.threshold
        if n <= 0:
            return True
        return req.num_prompt_tokens >= n and req.num_prompt_tokens - drep.cached_tokens(req) >= n

    def finished(self, replica: Replica, reqs: list[Request], now: float) -> None:
        assert self.net is not None
        for shadow in reqs:
            entry = self.in_prefill.pop((replica.index, shadow.req_id), None)
            if entry is None:
                continue  # a decode instance's request
            req, drep = entry
            req.kv_transfer_params = shadow.kv_transfer_output
            req.prefill_cached_tokens = shadow.cached_tokens
            req.prefill_done_s = now
            self.expected[drep.index] -= 1
            drep.deliver(req)
            self.net.wakers[drep.index].wake()

    def until_next(self, env: simpy.Environment, replica: Replica) -> simpy.Event | None:
        """The next arrival, or a request in prefill for this decode instance."""
        events: list = []
        if (t := self.next_arrival_s()) is not None:
            events.append(env.timeout(t - env.now))
        if self.expected.get(replica.index):
            assert self.net is not None
            events.append(self.net.wakers[replica.index].wait())
        return any_of(env, events)


class RoutedArrivals:
    """A replica's arrival source (``engine.Arrivals``' interface): what the router gave it
    (a P/D cluster's router: ``PDRouter``)."""

    __slots__ = ("router", "replica")

    def __init__(self, router: Dispatcher, replica: Replica):
        self.router = router
        self.replica = replica

    def advance(self, now: float) -> None:
        self.router.route_until(now)

    def arrived(self, now: float) -> list[Request]:
        self.router.route_until(now)
        return self.replica.take_inbox()

    def next_arrival_s(self) -> float | None:
        """The next arrival anywhere: it may come here, so an idle replica wakes for it."""
        return self.router.next_arrival_s()

    def until_next(self, env) -> simpy.Event | None:
        return self.router.until_next(env, self.replica)

    def finished(self, reqs: list[Request], now: float) -> None:
        self.replica.finished(reqs)
        self.router.finished(self.replica, reqs, now)


def run_cluster(sc: Scenario, requests: list[Request], accept: Acceptance | None,
                check_invariants: bool = False, progress=None, workers: int = 1) -> Records:
    """Simulate ``requests`` (in arrival order) on the scenario's cluster, or on its one engine's
    data-parallel ranks; the records hold every request (with its ``replica`` and
    ``dp_rank``), every engine's steps, and each engine's own records in ``replicas``.

    ``workers`` > 1: the replicas run on that many processes (at most one a replica), with the
    same records (``kvsim.parallel``), where only the router joins them (no data-parallel
    ranks, no P/D pair, no offload tier: its transfers wake a replica between its routing
    calls) and invariants are not checked."""
    if (workers > 1 and sc.cluster is not None and not sc.cluster.disaggregated
            and len(sc.engines) > 1 and not check_invariants and parallel.can_fork()
            and all(e.data_parallel_size == 1 and e.offload is None for e in sc.engines)):
        if progress is not None:
            progress = _ClusterProgress(progress, requests).every
        recs = parallel.run(sc, requests, accept, min(workers, len(sc.engines)), progress)
        final = {r.seq: r for rec in recs for r in rec.requests}
        return _cluster_records([final.get(r.seq, r) for r in requests], recs, accept)
    scenarios = [sc.replica(i) for i in range(len(sc.engines))]
    engines: list[Replica] = []  # every engine: each replica's ranks in rank order
    replicas: list[Replica | DPGroup] = []  # what the router routes to
    for i, s in enumerate(scenarios):
        n = s.engine.data_parallel_size
        ranks = [Replica(i, build_scheduler(s, i), r if n > 1 else None) for r in range(n)]
        engines += ranks
        replicas.append(ranks[0] if n == 1 else DPGroup(i, ranks))
    # One hash id space for the engines that cache (one with caching off never hashes, and
    # its hashes may be keyed differently: no lookahead hashes without caching).
    caching = [rep.sched.kv for rep in engines if rep.sched.kv.enable_caching]
    for kv in caching[1:]:
        kv.share_hashes(caching[0])
    # Data parallel alone: one replica, nothing for the router to choose.
    cfg = sc.cluster or ClusterCfg(replicas=1, router="round_robin", load_metric="requests",
                                   load_weight=0.5, deployment=None, engines=(sc.engine,),
                                   prefill_router="round_robin", non_cached_tokens=0,
                                   kv_transfer_link="", kv_transfer_bandwidth_bytes_per_s=0.0,
                                   kv_transfer_latency_s=0.0)  # (no P/D)
    recs = [Records(requests=rep.requests, replica=rep.index, dp_rank=rep.dp_rank) for rep in engines]
    router: Router
    transfers = None
    if cfg.disaggregated:
        prefill, decode = pd_pools(cfg)
        pool = [r for r in replicas if isinstance(r, Replica)]
        assert len(pool) == len(replicas)  # (config refuses data parallel in a P/D instance)
        router = pd_router = PDRouter(cfg, [pool[i] for i in prefill], [pool[i] for i in decode],
                                      requests, sc.run.seed)

        def transfers(env):
            net = pd_router.net = PDNetwork([Waker(env) for _ in engines],
                                            [{} for _ in engines])
            return [PDTransfers(i, net, rec, s.engine.kv_block_bytes,
                                cfg.kv_transfer_bandwidth_bytes_per_s, cfg.kv_transfer_latency_s)
                    for i, (rec, s) in enumerate(zip(recs, scenarios))]
    else:
        router = Router(cfg, replicas, requests, sc.run.seed)
    if progress is not None:
        progress = _ClusterProgress(progress, requests)

    def links(env, costs):
        out: list[dp.RankLink | None] = [None] * len(engines)
        for group in replicas:
            if isinstance(group, DPGroup):
                _start_group(env, group, scenarios[group.index], engines, costs, out)
        return out
    simulate([(scenarios[e.index], e.sched, RoutedArrivals(router, e), rec) for e, rec in zip(engines, recs)],
             accept, check_invariants, progress, links=links, transfers=transfers)
    return _cluster_records(requests, recs, accept)


def _cluster_records(requests: list[Request], recs: list[Records],
                     accept: Acceptance | None) -> Records:
    """A cluster's records from its engines' (in engine order)."""
    return Records(
        requests=requests, steps=[s for r in recs for s in r.steps],
        end_s=max(r.end_s for r in recs),
        stopped_by=next((r.stopped_by for r in recs if r.stopped_by), None),
        stop_detail=next((r.stop_detail for r in recs if r.stop_detail), None),
        cost_label=" / ".join(dict.fromkeys(r.cost_label for r in recs)), replicas=recs,
        accepted_per_pos=(None if accept is None
                          else [sum(c) for c in zip(*(r.accepted_per_pos for r in recs))]))


def _start_group(env, group: DPGroup, sc: Scenario, engines: list[Replica], costs: list,
                 links: list) -> None:
    """A DP group's coordinator, balancer and (an MoE model) lockstep, on the clock ``env``."""
    rules = sc.engine.semantics.dp
    moe = sc.dp_lockstep
    ranks = [dp.Rank(r.dp_rank or 0, r.sched) for r in group.ranks]
    left: set[int] = set()
    coordinator = dp.Coordinator(env, ranks, rules, moe, done=lambda: len(left) == len(ranks),
                                 until=sc.run.max_sim_time_s)
    group.balancer = dp.Balancer(coordinator, rules, sc.engine.api_server_count)
    first = engines.index(group.ranks[0])
    lockstep = None
    if moe:
        def busy(i: int) -> bool:
            rep = group.ranks[i]
            return bool(rep.sched.num_unfinished or rep.inbox)
        lockstep = dp.Lockstep(env, costs[first:first + len(ranks)],
                               ExpertExchange(cost_inputs(sc), len(ranks)), rules, busy)
    for i, rank in enumerate(ranks):
        links[first + i] = dp.RankLink(rank, coordinator, lockstep, left)
    env.process(coordinator.run())


class _ClusterProgress:
    """One progress callback for all replicas: steps summed, finished requests counted."""

    def __init__(self, progress, requests: list[Request]):
        self.progress, self.requests = progress, requests
        self.steps = 0

    def every(self, steps: int, sim_s: float, finished: int, total: int) -> None:
        """From ``kvsim.parallel``: the steps and finished requests so far."""
        if steps // 256 > self.steps // 256:  # (as a step count the bar redraws at)
            self.progress(steps - steps % 256, sim_s, finished, total)
        self.steps = steps

    def __call__(self, step: int, sim_s: float, finished: int, total: int) -> None:
        self.steps += 1
        if self.steps % 256 == 0:  # as often as the terminal bar looks
            done = sum(r.finish_s is not None for r in self.requests)
            self.progress(self.steps, sim_s, done, len(self.requests))
