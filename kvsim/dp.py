"""Data parallel (``engine.data_parallel_size``): ranks behind vLLM's DP load balancer, and the
lockstep an MoE model's ranks step in.

vLLM runs each DP rank as its own engine core with its own KV cache. The front end's
``DPLBAsyncMPClient`` (one per API server: ``api_server_count``, as many as ranks by
default) sends each request to a rank by a score over the counts the DP coordinator last
published, plus its own dispatches since (``get_core_engine_for_request``, v1/engine/
core_client.py); each release's score is ``Semantics.dp``:

* 0.19 / 0.22: the lowest ``4 × waiting + running``, the scan starting at the client's own
  rank (``(ranks × client_index) // client_count``) and the first of equals winning; the
  chosen rank's waiting count grows by ``client_count`` until the next publish overwrites it.
  Only an MoE model's ranks (``DPEngineCoreProc``) publish counts: a dense model's stay zero,
  and the coordinator repeats them every 5 s, so its ranks are taken in turn.
* 0.32 / 0.33: the lowest ``max(client_count × in-flight, waiting + running)``, plus
  ``waiting × 6 × max(0, kv_usage − 0.5)`` when requests wait, where in-flight is the
  client's own exact count of its requests not yet finished on that rank; the scan's start
  moves on by one after every pick.

The coordinator (v1/engine/coordinator.py, ``min_stats_update_interval_ms`` = 100) publishes
when 100 ms have passed since its last publish and a rank's counts changed (at once after a
quiet spell: 50 ms later for an MoE model), else the same counts every 5 s. A rank reports
its ``(waiting, running)`` (with KV usage from 0.32) before and after each step when they
change. A request is routed at its arrival from the publishes up to that instant, the
client's dispatches since, and (0.32+) its requests finished by then.

Dense ranks then run independently. An MoE model's ranks step in lockstep (``Lockstep``): once
a request reaches any rank, every rank steps until a periodic all-reduce finds none with
unfinished requests (every 32 steps in 0.19 / 0.22; at the first and every 16th from 0.32); a
rank with nothing to run runs a one-token dummy batch. A step lasts as long as the slowest
rank's, with each rank's MoE layers run over all ranks' tokens on its 1 / DP share of the
experts, and the tokens gathered and scattered across the ranks
(``kvsim.cost.comm.ExpertExchange``).
"""

from __future__ import annotations

import math

from kvsim.cost.base import StepCost
from kvsim.cost.comm import ExpertExchange
from kvsim.request import Request
from kvsim.sched import Scheduler
from kvsim.semantics import DPRules

PUBLISH_INTERVAL_S = 0.1  # DPCoordinatorProc(min_stats_update_interval_ms=100)
REPEAT_INTERVAL_S = 5.0  # its poll timeout while nothing changed
MOE_MIN_TIMEOUT_S = 0.05  # the coordinator's min_timeout with wave coordination (MoE)


class Rank:
    """One DP rank as the balancer and the coordinator see it."""

    __slots__ = ("index", "sched", "counts")

    def __init__(self, index: int, sched: Scheduler):
        self.index = index
        self.sched = sched
        self.counts = (0, 0, 0.0)  # (waiting, running, kv_usage) last reported

    def current(self) -> tuple[int, int, float]:
        s = self.sched
        return len(s.waiting), len(s.running), s.kv.pool.usage()


class Coordinator:
    """The DP coordinator's published counts: every publish as (time, per-rank counts)."""

    def __init__(self, env, ranks: list[Rank], rules: DPRules, moe: bool, done,
                 until: float | None = None):
        self.env, self.ranks, self.done = env, ranks, done
        self.until = until  # the run's time limit: nothing published after it is read
        self.reports = moe or rules.dense_ranks_publish
        self.kv_in_counts = rules.score == "inflight"
        self.min_timeout = MOE_MIN_TIMEOUT_S if moe else 0.0
        self.history: list[tuple[float, list[list[float]]]] = []
        self._changed = False
        self._wake = env.event()

    def report(self, rank: Rank) -> None:
        """``rank`` publishes its counts if they changed (``_maybe_publish_request_counts``)."""
        if not self.reports:
            return
        w, r, kv = rank.current()
        if (w, r) == rank.counts[:2]:
            return
        rank.counts = (w, r, kv)
        if not self._changed:
            self._changed = True
            if not self._wake.triggered:
                self._wake.succeed()

    def run(self):
        """The coordinator's loop (a SimPy process) until every rank is done."""
        env, last = self.env, 0.0
        self._publish()
        while not self.done() and (self.until is None or env.now < self.until):
            wait = PUBLISH_INTERVAL_S if self._changed else REPEAT_INTERVAL_S
            timeout = env.timeout(max(self.min_timeout, last + wait - env.now))
            yield timeout | self._wake
            if self._wake.triggered:
                self._wake = env.event()
            if timeout.processed or env.now >= last + wait:
                self._publish()
                last = env.now

    def _publish(self) -> None:
        counts = [[float(w), float(r), kv] if self.kv_in_counts else [float(w), float(r)]
                  for w, r, kv in (rank.counts for rank in self.ranks)]
        if self.history and self.history[-1][1] == counts:
            counts = self.history[-1][1]  # a repeat: the same counts, held once (read only)
        self.history.append((self.env.now, counts))
        self._changed = False


class Client:
    """One API server's ``DPLBAsyncMPClient``: its view of the ranks' load."""

    def __init__(self, index: int, client_count: int, coordinator: Coordinator, rules: DPRules):
        n = len(coordinator.ranks)
        self.coordinator, self.rules, self.client_count = coordinator, rules, client_count
        self.start = (n * index) // client_count
        self.lb: list[list[float]] = [[0.0, 0.0, 0.0] if rules.score == "inflight" else [0.0, 0.0]
                                      for _ in range(n)]
        self._applied = 0
        self._sent: list[list[Request]] = [[] for _ in range(n)]  # this client's, per rank

    def choose(self, at: float) -> int:
        """The rank for a request arriving at ``at``."""
        history = self.coordinator.history
        while self._applied < len(history) and history[self._applied][0] <= at:
            self.lb = [list(c) for c in history[self._applied][1]]  # replaced wholesale
            self._applied += 1
        n = len(self.lb)
        best, chosen = math.inf, 0
        for i in range(n):
            idx = (self.start + i) % n
            if self.rules.score == "waiting4":
                waiting, running = self.lb[idx]
                score = waiting * 4 + running
            else:
                waiting, running, kv = self.lb[idx]
                score = max(self.client_count * self._inflight(idx, at), waiting + running)
                if waiting:
                    score += waiting * 6.0 * max(0.0, kv - 0.5)
            if score < best:
                best, chosen = score, idx
        self.lb[chosen][0] += self.client_count
        if self.rules.rotate_start:
            self.start = (self.start + 1) % n
        return chosen

    def sent(self, rank: int, req: Request) -> None:
        self._sent[rank].append(req)

    def _inflight(self, rank: int, at: float) -> int:
        """This client's requests on ``rank`` whose finish had not reached it by ``at``."""
        live = self._sent[rank] = [r for r in self._sent[rank]
                                   if r.finish_s is None or r.finish_s > at]
        return len(live)


class Balancer:
    """vLLM's DP load balancing over one group's ranks: requests are taken by the API servers
    in turn, each routing with its own client."""

    def __init__(self, coordinator: Coordinator, rules: DPRules, api_server_count: int):
        self.clients = [Client(i, api_server_count, coordinator, rules) for i in range(api_server_count)]
        self._count = 0

    def route(self, req: Request) -> int:
        client = self.clients[self._count % len(self.clients)]
        self._count += 1
        rank = client.choose(req.arrival_s)
        client.sent(rank, req)
        return rank


class Lockstep:
    """An MoE model's DP ranks stepping together (``DPEngineCoreProc``'s waves).

    Each rank's engine loop calls ``step`` once per step it takes while the wave runs, with
    its own step's seconds and tokens; the step ends for all when the last rank has called,
    after the slowest rank's time with the MoE layers over all ranks' tokens. A rank with
    nothing to run asks ``running``: while the wave runs it takes a dummy step."""

    def __init__(self, env, costs: list[StepCost], exchange: ExpertExchange, rules: DPRules, busy):
        self.env, self.costs, self.exchange = env, costs, exchange  # one cost model per rank
        self.rules = rules
        self.busy = busy  # busy(rank index) -> whether that rank has work or requests routed
        self.members = set(range(len(costs)))
        self.step_counter = 0
        self.tail = False  # the wave runs on to its next all-reduce
        self._submitted: dict[int, tuple[float, float, int]] = {}
        self._release = env.event()

    def running(self) -> bool:
        """Whether the wave runs: a rank has work, or its next all-reduce is still ahead."""
        if self.tail or any(self.busy(i) for i in self.members):
            return True
        self.step_counter = 0  # the wave is over; the next request starts another
        return False

    def dummy(self, rank: int) -> tuple[float, float, int]:
        """A one-token dummy batch's (seconds, MoE seconds within, tokens)."""
        cost = self.costs[rank]
        return cost.step_time_s([(1, 0)], 1), cost.moe_time_s(1), 1

    def step(self, rank: int, seconds: float, moe_seconds: float, tokens: int):
        """Take part in one lockstep step (a SimPy generator: ``yield from``)."""
        self._submitted[rank] = (seconds, moe_seconds, tokens)
        release = self._release
        if len(self._submitted) == len(self.members):
            self._finish_step()
        yield release

    def leave(self, rank: int) -> None:
        """``rank``'s loop has ended: steps no longer wait for it."""
        self.members.discard(rank)
        if self.members and len(self._submitted) == len(self.members):
            self._finish_step()

    def _finish_step(self) -> None:
        subs, self._submitted = self._submitted, {}
        ranks = len(self.costs)
        gathered = sum(t for _, _, t in subs.values())  # every rank's own tokens, gathered
        longest = 0.0
        for rank, (seconds, moe, _) in subs.items():
            own = seconds - moe + self.costs[rank].moe_time_s(gathered, ranks)
            longest = max(longest, own)
        longest += self.exchange.time_s(gathered)
        self.step_counter += 1
        r = self.rules
        synced = (self.step_counter % r.sync_interval == 0
                  or (r.sync_at_first_step and self.step_counter == 1))
        self.tail = not synced
        release, self._release = self._release, self.env.event()
        self.env.timeout(longest).callbacks.append(lambda _: release.succeed())


class RankLink:
    """What one rank's engine loop tells the coordinator and shares with its lockstep."""

    __slots__ = ("rank", "coordinator", "lockstep", "_left")

    def __init__(self, rank: Rank, coordinator: Coordinator, lockstep: Lockstep | None,
                 left: set[int]):
        self.rank, self.coordinator, self.lockstep = rank, coordinator, lockstep
        self._left = left  # the group's ranks whose loops have ended

    def report(self) -> None:
        self.coordinator.report(self.rank)

    def leave(self) -> None:
        """The rank's loop has ended (the run is over for it)."""
        self._left.add(self.rank.index)
        if self.lockstep is not None:
            self.lockstep.leave(self.rank.index)
