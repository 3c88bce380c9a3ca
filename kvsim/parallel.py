"""A cluster's replicas simulated on several processes, with the same output as on one.

The replicas of a cluster interact only through the router, and the router acts only when a
replica loop asks it to (``kvsim.cluster``'s lazy routing): before a loop changes anything
it routes every request that has arrived by then. So each worker process runs some of the
replicas on a clock of its own, and the processes meet at each arrival ``a``:

1. each worker runs its clock until one of its replicas asks to route at an instant at or
   past ``a`` (``_Host.route_until``) and reports there, every replica of it as the router
   reads it (requests, pending tokens, KV usage, the prefix the arriving request would get);
   a worker whose replicas have all stopped reports "never";
2. the router (in the parent) routes every request that has arrived by the earliest of those
   instants ``T`` — what the first ``route_until(T)`` on one clock routes — from the reports,
   counting in what it has just sent each replica, as ``Replica.receive`` does;
3. each worker's replicas get their requests before it goes on from where it stopped.

Between ``a`` and its report a worker ran only events that route nothing and change nothing
(a loop that stops at a run limit), and nothing else links the replicas, so each replica sees
the same requests at the same instants as on one clock: its steps and requests come out the
same, byte for byte (tests compare every result file). The workers are forked: each has the
scenario and every request already (a message names a request by its index), and hashes
block contents in its own id space (equal ids are equal contents within one process, all a
replica compares).

Replicas of data-parallel ranks or of a P/D pair interact by more than the router (the DP
coordinator, KV transfers), and an offload tier's transfers wake a replica between routing
calls; those clusters run on one process.
"""

from __future__ import annotations

import multiprocessing as mp
import signal
import traceback
from dataclasses import dataclass, fields
from operator import attrgetter
from typing import Any

from kvsim.engine import Records, StepRecord, build_scheduler, simulate
from kvsim.request import Request
from kvsim.schema import Scenario
from kvsim.specdec import Acceptance


def can_fork() -> bool:
    return "fork" in mp.get_all_start_methods()


def _reads_prefixes(sc: Scenario) -> bool:
    """Whether the router reads the prefix a replica would give a request (the only policy
    that does)."""
    return sc.cluster is not None and sc.cluster.router == "prefix_aware"


@dataclass(frozen=True, slots=True)
class _Report:
    """A worker's replicas (in its order) as the router reads them, where the worker
    stopped."""

    at: float  # when a replica of the worker routes first (inf: none will)
    loads: tuple[tuple[int, int, float], ...]  # (requests, pending tokens, KV usage)
    first: int  # the first request looked up (its index; the rest follow it)
    prefixes: tuple[tuple[int, ...], ...]  # the prefix each looked-up request would get
    steps: int  # steps run so far (progress)

    @property
    def looked_to(self) -> int:
        """The request after the last one looked up."""
        return self.first + len(self.prefixes[0])


class _Remote:
    """A replica in a worker, as the router reads it: its last report, plus what the router
    has sent it since (``Replica.reserve``'s counts)."""

    __slots__ = ("index", "worker", "outstanding", "pending", "usage", "cached")

    def __init__(self, index: int, worker: int):
        self.index = index
        self.worker = worker
        self.outstanding = self.pending = 0
        self.usage = 0.0
        self.cached: dict[int, int] = {}  # request seq -> prefix hit here

    def receive(self, req: Request) -> None:
        req.replica = self.index
        self.outstanding += 1
        self.pending += req.num_tokens

    def num_requests(self) -> int:
        return self.outstanding

    def pending_tokens(self) -> int:
        return self.pending

    def kv_usage(self) -> float:
        return self.usage

    def cached_tokens(self, req: Request) -> int:
        return self.cached[req.seq]


class _Host:
    """The router as a worker's replicas see it (``kvsim.cluster.Dispatcher``). A replica
    loop asks it to route what has arrived by ``now`` before it changes anything; once ``now``
    reaches the next arrival the parent has not routed, the worker reports and waits there for
    the parent's word (the requests routed to its replicas, the next arrival). With
    ``looks`` (a router that reads prefixes) a report holds the prefix each replica would give
    every request that has arrived by ``now``: the router routes some of them from it."""

    def __init__(self, conn, reps: dict, requests: list[Request], looks: bool):
        self.conn, self.reps, self.requests, self.looks = conn, reps, requests, looks
        self.pos: int | None = None  # the next arrival not routed yet (its index)
        self.looked: list[int] = []  # requests hashed for a lookup since the last word
        self.ahead = 1  # how many arrivals a report looks up at most
        self.steps = 0  # (progress)

    def route_until(self, now: float) -> None:
        while self.pos is not None and now >= self.requests[self.pos].arrival_s:
            self.conn.send(self.report(now, self.pos))
            self.obey()

    def obey(self) -> None:
        """The parent's next word: prefixes to look up, or the routed requests."""
        while (msg := self.conn.recv())[0] == "look":
            self.conn.send(self.prefixes(msg[1], msg[2]))
        _, sent, self.pos, self.ahead = msg
        for i, seq in sent:
            self.reps[i].receive(self.requests[seq])
        routed_here = {seq for _, seq in sent}
        for seq in self.looked:  # hashed for a lookup, gone to another worker's replica
            if seq not in routed_here:
                self.requests[seq].block_hashes = []
        self.looked = []

    def report(self, at: float, first: int) -> _Report:
        """The replicas at ``at``, with the prefixes of the requests from ``first`` that have
        arrived by then (one at least, ``ahead`` at most)."""
        reqs = self.requests
        end = first
        if self.looks:
            end, last = first + 1, min(len(reqs), first + self.ahead)
            while end < last and reqs[end].arrival_s <= at:
                end += 1
        loads = tuple((rep.num_outstanding, rep.pending_tokens(), rep.kv_usage())
                      for rep in self.reps.values())
        return _Report(at, loads, first, self.prefixes(first, end), self.steps)

    def prefixes(self, first: int, end: int) -> tuple[tuple[int, ...], ...]:
        """The prefix each replica would give requests ``first`` to ``end``."""
        looked = self.requests[first:end]
        self.looked += range(first, end)
        return tuple(tuple(rep.cached_tokens(r) for r in looked) for rep in self.reps.values())

    def next_arrival_s(self) -> float | None:
        return None if self.pos is None else self.requests[self.pos].arrival_s

    def until_next(self, env, replica):
        t = self.next_arrival_s()
        return None if t is None else env.timeout(t - env.now)

    def finished(self, replica, reqs: list[Request], now: float) -> None:
        pass

    def count(self, *_) -> None:
        self.steps += 1

    def drive(self, env) -> None:
        """Run the clock; once every replica has stopped, answer until the routing ends."""
        env.run()
        while self.pos is not None:
            self.conn.send(self.report(float("inf"), self.pos))
            self.obey()


def run(sc: Scenario, requests: list[Request], accept: Acceptance | None, workers: int,
        progress=None) -> list[Records]:
    """Simulate the cluster's replicas on ``workers`` processes; each replica's records, in
    replica order (their requests the workers' final copies)."""
    from kvsim.cluster import Router  # (it imports this module)

    assert sc.cluster is not None
    n = len(sc.engines)
    owned = [list(range(w, n, workers)) for w in range(workers)]
    ctx = mp.get_context("fork")
    pipes = [ctx.Pipe() for _ in owned]
    procs = [ctx.Process(target=_worker, args=(pipes, w, sc, mine, requests, accept),
                         daemon=True) for w, mine in enumerate(owned)]
    for p in procs:
        p.start()
    for _, child in pipes:  # (each end in one process only: a worker gone reads as EOF)
        child.close()
    conns = [parent for parent, _ in pipes]
    ok = False
    try:
        remotes = sorted((_Remote(i, w) for w, mine in enumerate(owned) for i in mine),
                         key=lambda r: r.index)
        router = Router(sc.cluster, remotes, requests, sc.run.seed)
        looks = _reads_prefixes(sc)
        sent: list[list[tuple[int, int]]] = [[] for _ in owned]
        pos: int | None = 0 if requests else None
        ahead = 1  # arrivals a report looks up (twice the last batch: enough, mostly)
        while True:
            for w, conn in enumerate(conns):
                _send(conn, ("go", sent[w], pos, ahead))
                sent[w] = []
            if pos is None:
                break
            reports = [_recv(c) for c in conns]
            until = min(r.at for r in reports)  # the first instant a replica routes at
            if until == float("inf"):  # every replica has stopped: nothing routes the rest
                for conn in conns:
                    _send(conn, ("go", [], None, 0))
                break
            end = pos + 1
            while end < len(requests) and requests[end].arrival_s <= until:
                end += 1
            for mine, report in zip(owned, reports):
                _read(remotes, mine, report.first, report.prefixes, report.loads)
            if looks:  # the batch's prefixes a report did not look up
                short = [(w, r.looked_to) for w, r in enumerate(reports) if r.looked_to < end]
                for w, first in short:
                    _send(conns[w], ("look", first, end))
                for w, first in short:
                    _read(remotes, owned[w], first, _recv(conns[w]))
                ahead = 2 * (end - pos)
            for req in requests[pos:end]:
                rep = router.choose(req)
                rep.receive(req)
                sent[remotes[rep.index].worker].append((rep.index, req.seq))
            if progress is not None:
                done = end - sum(r.outstanding for r in remotes)
                progress(sum(r.steps for r in reports), until, done, len(requests))
            pos = end if end < len(requests) else None
        recs = [_unpacked(rec) for conn in conns for rec in _recv(conn)]
        ok = True
    finally:
        for conn in conns:
            conn.close()
        for p in procs:
            if not ok:
                p.terminate()
            p.join()
    return sorted(recs, key=lambda r: r.replica)


_GONE = "a worker process ended without its results"


def _send(conn, msg: tuple) -> None:
    try:
        conn.send(msg)
    except OSError:  # the worker has gone: a failing one left its traceback before it went
        _recv(conn)
        raise RuntimeError(_GONE) from None


def _recv(conn) -> Any:
    try:
        msg = conn.recv()
    except (EOFError, OSError):
        raise RuntimeError(_GONE) from None
    if isinstance(msg, _Failure):
        raise RuntimeError(f"a worker process failed:\n{msg.text}")
    return msg


@dataclass(frozen=True, slots=True)
class _Failure:
    text: str


def _read(remotes: list[_Remote], mine: list[int], first: int,
          prefixes: tuple[tuple[int, ...], ...],
          loads: tuple[tuple[int, int, float], ...] | None = None) -> None:
    """The router's view of one worker's replicas (``mine``, in its order): their prefixes
    for the requests from ``first`` on, and with ``loads`` (a new report) their loads, the
    prefixes read before forgotten."""
    for k, i in enumerate(mine):
        rep = remotes[i]
        if loads is not None:
            rep.outstanding, rep.pending, rep.usage = loads[k]
            rep.cached.clear()
        rep.cached.update(zip(range(first, first + len(prefixes[k])), prefixes[k]))


def _worker(pipes: list, w: int, sc: Scenario, mine: list[int], requests: list[Request],
            accept: Acceptance | None) -> None:
    # The parent answers Ctrl-C and SIGTERM (a worker stops when it does, quietly).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    for v, (parent, child) in enumerate(pipes):  # (keep only this worker's end)
        parent.close()
        if v != w:
            child.close()
    conn = pipes[w][1]
    try:
        conn.send(_serve(conn, sc, mine, requests, accept))
    except (EOFError, OSError):
        pass  # the parent has gone (its pipe closed)
    except Exception:
        conn.send(_Failure(traceback.format_exc()))
    finally:
        conn.close()


def _serve(conn, sc: Scenario, mine: list[int], requests: list[Request],
           accept: Acceptance | None) -> list[tuple[Records, list[tuple]]]:
    """A worker: its replicas on its own clock, each routing call at or past the next
    arrival a stop to hear from the parent."""
    from kvsim.cluster import Replica, RoutedArrivals

    scenarios = {i: sc.replica(i) for i in mine}
    reps = {i: Replica(i, build_scheduler(scenarios[i], i)) for i in mine}
    caching = [rep.sched.kv for rep in reps.values() if rep.sched.kv.enable_caching]
    for kv in caching[1:]:
        kv.share_hashes(caching[0])
    host = _Host(conn, reps, requests, _reads_prefixes(sc))
    host.obey()  # the first arrival
    recs = [Records(requests=reps[i].requests, replica=i) for i in mine]
    simulate([(scenarios[i], reps[i].sched, RoutedArrivals(host, reps[i]), rec)
              for i, rec in zip(mine, recs)], accept, progress=host.count, drive=host.drive)
    for rec in recs:
        for r in rec.requests:  # (what the result files read stays)
            r.block_hashes, r.group_keys = [], {}
    return [_packed(rec) for rec in recs]


_STEP_FIELDS = attrgetter(*(f.name for f in fields(StepRecord)))


def _packed(rec: Records) -> tuple[Records, list[tuple]]:
    """``rec`` to send: its steps as tuples (pickled 5x faster than the records)."""
    steps = [_STEP_FIELDS(s) for s in rec.steps]
    rec.steps = []
    return rec, steps


def _unpacked(packed: tuple[Records, list[tuple]]) -> Records:
    rec, steps = packed
    rec.steps = [StepRecord(*s) for s in steps]
    return rec
