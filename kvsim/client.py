"""The benchmark client in front of an engine: ``vllm bench serve``'s concurrency limit and
warm-ups.

vLLM's client (``vllm/benchmarks/serve.py``, ``benchmark``) first sends ``--num-warmups``
copies of the first request, at most ``--max-concurrency`` C at once, and waits for them all;
then the benchmark's clock starts. Request i is due at its arrival time (the request-rate
process: all at once for ``--request-rate inf``) and is sent once it is due and one of the C
slots is free (``asyncio.Semaphore(C)``: first come, first sent). Its TTFT and latency count
from the send (``request_func`` takes its start time there), so here a request's
``arrival_s`` is its send time::

    send_i = max(due_i, the earliest time a slot is free after send_(i-1))

A send is final once the clock reaches it: a slot frees only when a request finishes, never
earlier than now. The request reaches the scheduler ``frontend_latency_s`` after its send (the
API server's tokenizing and hand-over, and the first token's way back, in one term).
Warm-ups are marked (``RequestSpec.warmup``): they run on the engine, and fill its prefix
cache, but the metrics leave them out and count throughput from ``benchmark_start_s``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sized
from dataclasses import replace

from kvsim.request import Request, RequestSpec


class Client:
    """An ``engine.ArrivalSource`` that sends ``specs`` (sorted by arrival) as a benchmark
    client does: ``max_concurrency`` in flight at most (None: no limit), after
    ``num_warmups`` copies of the first request. ``made``, when given, gets every request as
    it is sent."""

    __slots__ = ("_specs", "_next", "_warm", "_warm_left", "_free", "_made", "_seq", "total",
                 "benchmark_start_s", "_latency_s", "_sent")

    def __init__(self, specs: Iterable[RequestSpec], max_concurrency: int | None,
                 num_warmups: int, made: list[Request] | None = None,
                 frontend_latency_s: float = 0.0):
        self._latency_s = frontend_latency_s
        self._sent: deque[Request] = deque()  # sent, not yet at the scheduler
        self._specs = iter(specs)
        self._next: RequestSpec | None = next(self._specs, None)
        first = self._next
        warm = num_warmups if first is not None else 0
        self._warm = deque(replace(first, req_id=f"warmup-{i}", arrival_s=0.0, warmup=True)
                           for i in range(warm)) if first is not None else deque()
        self._warm_left = warm  # warm-ups not yet finished
        # Times from which each free slot is free, in order (None: no limit).
        self._free: deque[float] | None = (deque([0.0] * max_concurrency)
                                           if max_concurrency is not None else None)
        self._made = made
        self._seq = 0
        self.total = len(specs) + warm if isinstance(specs, Sized) else 0  # 0: not known
        # When the measured run starts (its arrival times count from it); None while the
        # warm-ups run.
        self.benchmark_start_s: float | None = 0.0 if not warm else None

    def _head(self) -> tuple[RequestSpec | None, float]:
        """The next request to send and when it is due (None: none now, or ever)."""
        if self._warm:
            return self._warm[0], 0.0
        if self.benchmark_start_s is None or self._next is None:
            return None, 0.0
        return self._next, self.benchmark_start_s + self._next.arrival_s

    def _send_s(self) -> float | None:
        """When the next request is sent, as far as is known now: None when none is due or
        every slot is taken (a slot frees when a request finishes)."""
        spec, due = self._head()
        if spec is None:
            return None
        if self._free is None:
            return due
        return max(due, self._free[0]) if self._free else None

    def next_arrival_s(self) -> float | None:
        """When the next request reaches the scheduler, as far as is known now."""
        if self._sent:
            return self._sent[0].arrival_s + self._latency_s
        t = self._send_s()
        return None if t is None else t + self._latency_s

    def arrived(self, now: float) -> list[Request]:
        """The requests at the scheduler by ``now`` and not yet handed out, in order."""
        while (t := self._send_s()) is not None and t <= now:
            spec: RequestSpec | None
            if self._warm:
                spec = self._warm.popleft()
            else:
                spec = self._next
                assert spec is not None  # (_send_s found it)
                self._next = next(self._specs, None)
            if self._free is not None:
                self._free.popleft()
            self._sent.append(self._make(replace(spec, arrival_s=t)))
        out = []
        while self._sent and self._sent[0].arrival_s + self._latency_s <= now:
            out.append(self._sent.popleft())
        return out

    def _make(self, spec: RequestSpec) -> Request:
        r = Request(spec, self._seq)
        self._seq += 1
        if self._made is not None:
            self._made.append(r)
        return r

    def advance(self, now: float) -> None:
        """Time has reached ``now`` (nothing to do)."""

    def until_next(self, env):
        t = self.next_arrival_s()
        return None if t is None else env.timeout(max(t - env.now, 0.0))

    def finished(self, reqs: list[Request], now: float) -> None:
        """``reqs`` finished at ``now``: their slots are free; the last warm-up starts the run."""
        for r in reqs:
            if self._free is not None:
                self._free.append(now)
            if r.warmup:
                self._warm_left -= 1
                if not self._warm_left:
                    self.benchmark_start_s = now

    def rest(self) -> list[Request]:
        """Every request not sent (made now, at the time it was due)."""
        out = [*self._sent, *(self._make(s) for s in self._warm)]
        self._sent.clear()
        self._warm.clear()
        start = self.benchmark_start_s or 0.0
        while self._next is not None:
            out.append(self._make(replace(self._next, arrival_s=start + self._next.arrival_s)))
            self._next = next(self._specs, None)
        return out
