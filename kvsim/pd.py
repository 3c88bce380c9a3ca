"""Prefill/decode disaggregation in time: NIXL's reads between a P/D cluster's instances over
the instance-to-instance link, and the wake-ups that tie the instances' engine loops (the
proxy that routes through both pools is ``kvsim.cluster.PDRouter``; the connector's rules on
both sides are ``kvsim.kv.nixl``).

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

import simpy

from kvsim.engine import ConnectorTimes
from kvsim.kv.connector import ConnectorOutput, RecvJob
from kvsim.schema import ClusterCfg


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


def any_of(env: simpy.Environment, events: list) -> simpy.Event | None:
    """The first of ``events`` to fire (None: there is none to wait for)."""
    if not events:
        return None
    return events[0] if len(events) == 1 else env.any_of(events)


class PDTransfers(ConnectorTimes):
    """One P/D instance's NIXL worker in time (``kvsim.engine.Transfers``' interface) and its
    counters under vLLM's names (``vllm:nixl_*``), written to ``Records.kv_transfer``."""

    def __init__(self, index: int, net: PDNetwork, rec, block_bytes: int, bandwidth: float,
                 latency: float):
        super().__init__(rec)
        self.index = index
        self.net = net
        self.block_bytes = block_bytes
        self.bandwidth = bandwidth
        self.latency = latency
        self.reads: dict[str, tuple[float, RecvJob]] = {}  # decode: in flight
        self.free_at = 0.0  # decode: when its link is free
        self.to_send: set[str] = set()  # prefill: finished, blocks held until read
        self.xfer_time_s: list[float] = []
        self.bytes = 0

    def pending(self, *plans) -> bool:
        return bool(self.reads or self.to_send) or self.hand_over(plans)

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
        return any_of(env, events)

    def report(self) -> None:
        """The decode side's reads (a prefill side posts none): their bytes and times."""
        self.rec.kv_transfer = {**self.external.external_counters(),
                                "nixl_bytes_transferred": self.bytes,
                                "nixl_xfer_time_seconds": sorted(self.xfer_time_s)}


def pd_pools(cfg: ClusterCfg) -> tuple[list[int], list[int]]:
    """The replica indices of the prefill and the decode instances."""
    roles = [e.kv_role for e in cfg.engines]
    return ([i for i, r in enumerate(roles) if r == "kv_producer"],
            [i for i, r in enumerate(roles) if r == "kv_consumer"])
