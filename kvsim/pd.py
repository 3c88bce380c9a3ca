"""Prefill/decode disaggregation in time: the proxy that sends each request through a prefill
and a decode instance, and NIXL's reads between them over the instance-to-instance link.

The proxy (``PDRouter``) works as vLLM's P/D proxy behind llm-d's pd-profile-handler: when a
request arrives it picks the decode instance first (``[cluster] router`` over the decode
pool), then asks llm-d's prefix-based decider (``non_cached_tokens``) whether to run a
prefill instance at all; if so it picks one (``prefill_router`` over the prefill pool) and
sends it the request with ``max_tokens = 1`` and ``do_remote_decode``. When that finishes,
the proxy sends the request to the decode instance with the ``kv_transfer_params`` the
prefill's output carried (``kvsim.kv.nixl`` holds the connector's rules on both sides). A
request the decider keeps from the prefill pool goes to its decode instance alone.

The reads (``PDTransfers``, one per engine): a decode instance's worker starts the reads its
step hands it at the step's start (``start_load_kv``); each of its tensor-parallel ranks
reads its share of the blocks over its own NIC, so a read of ``n`` blocks takes the link's
latency plus ``n`` × one rank's block bytes over the link's per-GPU bandwidth. Reads into
one decode instance queue on its link in the order they start: NIXL posts every read at once
(``nixl/pull_worker.py``: ``_read_blocks`` → ``nixl_wrapper.transfer``) and the NIC shares its
bandwidth among them; a queue drains a burst in the same time, finishing the early reads
sooner than a fair share would. A read with nothing to read (a full local hit) is only the
notification, the latency. The decode worker reports a finished read with the first step
that ends after it (``get_finished``); the prefill instance learns of it by the
notification, reported in ``finished_sending`` with its first step that ends after the
read, and frees the blocks then. The prefill side's own NIC is not modelled as a
bottleneck (decode instances reading one prefill instance at once do not slow each other).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import simpy

from kvsim.kv.connector import ConnectorOutput, RecvJob
from kvsim.request import KVTransferParams, Request, RequestSpec
from kvsim.sched import PrefixCacheStats
from kvsim.schema import ClusterCfg

if TYPE_CHECKING:
    from kvsim.cluster import Replica, Router


class Waker:
    """An event another engine triggers to wake an idle engine loop (a request handed over,
    a read of its blocks posted)."""

    def __init__(self, env: simpy.Environment):
        self.env = env
        self.event = env.event()

    def wake(self) -> None:
        if not self.event.triggered:
            self.event.succeed()

    def wait(self) -> simpy.Event:
        """The event to wait on now (a fresh one once the last has fired)."""
        if self.event.triggered:
            self.event = self.env.event()
        return self.event


@dataclass(slots=True)
class PDNetwork:
    """What the engines of a P/D cluster share: each engine's waker and, per prefill
    instance, when the decode side's read of each finished request's blocks ends."""

    wakers: list[Waker]
    read_done_s: list[dict[str, float]] = field(default_factory=list)

    def notify(self, engine: int, req_id: str, at: float) -> None:
        self.read_done_s[engine][req_id] = at
        self.wakers[engine].wake()


def _any(env: simpy.Environment, events: list) -> simpy.Event | None:
    if not events:
        return None
    return events[0] if len(events) == 1 else env.any_of(events)


class PDTransfers:
    """One P/D instance's NIXL worker in time (``kvsim.engine.Transfers``' interface) and its
    counters under vLLM's names (``vllm:nixl_*``), written to ``Records.kv_transfer``."""

    def __init__(self, index: int, net: PDNetwork, rec, block_bytes: int, bandwidth: float,
                 latency: float, consumer: bool):
        self.index = index
        self.net = net
        self.rec = rec
        self.block_bytes = block_bytes
        self.bandwidth = bandwidth
        self.latency = latency
        self.consumer = consumer
        self.external = PrefixCacheStats()
        self.reads: dict[str, tuple[float, RecvJob]] = {}  # decode: in flight
        self.free_at = 0.0  # decode: when its link is free
        self.to_send: set[str] = set()  # prefill: finished, blocks held until read
        self.xfer_time_s: list[float] = []
        self.bytes = 0

    def planned(self, plan) -> None:
        self.external.add(plan.external_prefix_cache)

    def pending(self, *plans) -> bool:
        return bool(self.reads or self.to_send) or any(
            p.connector_meta is not None and p.connector_meta.hands_over for p in plans)

    def begin(self, plan, now: float) -> float:
        meta = plan.connector_meta
        if meta is None:
            return now
        self.to_send.update(meta.reqs_to_send)
        for job in meta.reqs_to_recv:
            num_bytes = job.num_blocks * self.block_bytes
            if num_bytes:
                start = max(now, self.free_at)
                done = self.free_at = start + self.latency + num_bytes / self.bandwidth
                self.xfer_time_s.append(done - start)
                self.bytes += num_bytes
            else:
                done = now + self.latency  # the notification alone
            self.reads[job.req_id] = (done, job)
            self.net.notify(job.remote_engine, job.remote_request_id, done)
        return now

    def end(self, now: float) -> ConnectorOutput | None:
        recving = frozenset(r for r, (done, job) in self.reads.items()
                            if done <= now and job.awaiting)
        for r in [r for r, (done, _) in self.reads.items() if done <= now]:
            del self.reads[r]
        read = self.net.read_done_s[self.index]
        sent = tuple(sorted((r for r in self.to_send if read.get(r, math.inf) <= now),
                            key=lambda r: (read[r], r)))
        for r in sent:
            self.to_send.discard(r)
            del read[r]
        if not (recving or sent):
            return None
        return ConnectorOutput(finished_recving=recving, finished_sending=sent)

    def idle(self, env: simpy.Environment, arrivals) -> simpy.Event | None:
        """A step ran nothing: wait for the next read to end, the next arrival, or word from
        another engine (a request handed over, a read of held blocks posted); None when no
        read is in flight and no finished request waits for one."""
        if not (self.reads or self.to_send):
            return None
        now = env.now
        read = self.net.read_done_s[self.index]
        times = [done for done, _ in self.reads.values()]
        times += [read[r] for r in self.to_send if r in read]
        if (t := arrivals.next_arrival_s()) is not None:
            times.append(t)
        events: list = [env.timeout(max(0.0, min(times) - now))] if times else []
        events.append(self.net.wakers[self.index].wait())
        return _any(env, events)

    def report(self) -> None:
        x = self.xfer_time_s
        self.rec.kv_transfer = {
            "kv_role": "kv_consumer" if self.consumer else "kv_producer",
            **self.external.external_counters(),
            "nixl_num_transfers": len(x), "nixl_bytes_transferred": self.bytes,
            "nixl_xfer_time_seconds_sum": sum(x)}
        if self.consumer:
            self.rec.kv_transfer["nixl_xfer_time_seconds"] = sorted(x)


class PDRouter:
    """The P/D proxy (``RoutedArrivals``' router): a request goes to a decode instance (via a
    prefill instance unless the decider says otherwise) when it arrives."""

    def __init__(self, decode: Router, prefill: Router, non_cached_tokens: int,
                 requests: list[Request]):
        self.decode = decode  # over the decode pool
        self.prefill = prefill  # over the prefill pool
        self.threshold = non_cached_tokens
        self._reqs = requests
        self._next = 0
        # The engines' network, once the clock exists (P/D instances are one engine each:
        # a replica's index is its engine's).
        self.net: PDNetwork | None = None
        self.in_prefill: dict[tuple[int, str], tuple[Request, Replica]] = {}
        self.expected: dict[int, int] = {}  # decode replica -> requests still in prefill

    def next_arrival_s(self) -> float | None:
        return self._reqs[self._next].arrival_s if self._next < len(self._reqs) else None

    def route_until(self, now: float) -> None:
        reqs = self._reqs
        while self._next < len(reqs) and reqs[self._next].arrival_s <= now:
            req = reqs[self._next]
            self._next += 1
            drep = self.decode.choose(req)
            drep.reserve(req)
            if not self._disaggregate(req, drep):
                drep.deliver(req)
                continue
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
        """``replica`` finished ``reqs``: a prefill instance's go on to their decode instance
        with the params the prefill's output carried."""
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
        events: list = []
        if (t := self.next_arrival_s()) is not None:
            events.append(env.timeout(t - env.now))
        if self.expected.get(replica.index):
            assert self.net is not None
            events.append(self.net.wakers[replica.index].wait())
        return _any(env, events)


def pd_pools(cfg: ClusterCfg) -> tuple[list[int], list[int]]:
    """The replica indices of the prefill and the decode instances."""
    roles = [e.kv_role for e in cfg.engines]
    return ([i for i, r in enumerate(roles) if r == "kv_producer"],
            [i for i, r in enumerate(roles) if r == "kv_consumer"])
