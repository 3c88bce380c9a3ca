"""The KV-connector seam: vLLM's ``KVConnectorBase_V1`` scheduler-side interface, and what
the worker reports back (``vllm/distributed/kv_transfer/kv_connector/v1/base.py``).

The scheduler calls a connector at the same points vLLM's does:

- ``on_new_request`` when a request is added;
- ``get_num_new_matched_tokens(req, local_hit)`` at admission, after the local prefix-cache
  lookup: the tokens beyond ``local_hit`` the connector can load, and whether it loads them
  asynchronously (the request then waits in ``WAITING_FOR_REMOTE_KVS`` holding its blocks);
  ``None`` defers the request to a later step;
- ``update_state_after_alloc(req, block_ids, num_external_tokens)`` once its blocks exist;
- ``build_connector_meta(step)`` at the end of ``schedule()``: the transfer jobs this step
  submits to the worker;
- ``update_connector_output(output)`` with each step's outputs: the jobs the worker finished;
- ``request_finished(req)`` before a finished request's blocks are freed: whether to keep
  them until the worker reports the request in ``finished_sending`` (a P/D prefill side
  whose blocks the decode side still reads), and the ``kv_transfer_params`` of its output.

An offload tier (``kvsim.kv.offload``) and a P/D pair (``kvsim.kv.nixl``) plug in here. A
worker (``StepDelayWorker`` here; timed ones in the engine) decides when submitted jobs
finish. Pure Python, no SimPy.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Literal, Protocol

from kvsim.request import KVTransferParams, Request

JobKind = Literal["load", "store"]


@dataclass(frozen=True, slots=True)
class TransferJob:
    """One transfer the worker runs: ``num_blocks`` GPU blocks of ``req_id`` loaded from or
    stored to the tier."""

    job_id: int
    req_id: str
    kind: JobKind
    num_blocks: int


@dataclass(frozen=True, slots=True)
class RecvJob:
    """One read of a remote prefill's blocks by the decode side (an entry of
    ``NixlConnectorMetadata.reqs_to_recv``): ``num_blocks`` local blocks of ``req_id`` filled
    from request ``remote_request_id`` on engine ``remote_engine`` (0 blocks: a full local
    hit, only the notification that frees the remote blocks); ``awaiting`` when the request
    waits for it in WAITING_FOR_REMOTE_KVS."""

    req_id: str
    remote_engine: int
    remote_request_id: str
    num_blocks: int
    awaiting: bool


@dataclass(frozen=True, slots=True)
class ConnectorMeta:
    """What one step hands the worker: an offload tier's jobs (vLLM's
    ``OffloadingConnectorMetadata``), a P/D side's reads and the finished requests whose
    blocks wait to be read (``NixlConnectorMetadata.reqs_to_recv`` / ``reqs_to_send``)."""

    load_jobs: tuple[TransferJob, ...] = ()
    store_jobs: tuple[TransferJob, ...] = ()
    jobs_to_flush: frozenset[int] = frozenset()
    reqs_to_recv: tuple[RecvJob, ...] = ()
    reqs_to_send: tuple[str, ...] = ()

    @property
    def hands_over(self) -> bool:
        """Whether it hands the worker anything."""
        return bool(self.load_jobs or self.store_jobs or self.jobs_to_flush or self.reqs_to_recv
                    or self.reqs_to_send)


@dataclass(frozen=True, slots=True)
class ConnectorOutput:
    """What the worker reports with a step's outputs (vLLM's ``KVConnectorOutput``):
    finished jobs, the requests whose asynchronous loads finished, and those whose blocks
    the decode side has read (their blocks are freed)."""

    completed_jobs: tuple[int, ...] = ()
    finished_recving: frozenset[str] = frozenset()
    finished_sending: tuple[str, ...] = ()  # in the order their blocks are freed


@dataclass(frozen=True, slots=True)
class StepView:
    """One ``schedule()`` as the connector sees it (the parts of vLLM's ``SchedulerOutput``
    it reads): tokens scheduled per request in scheduling order, each request's new block
    ids and whether they are its whole table, the requests preempted and those that finished
    since the last step."""

    num_scheduled_tokens: dict[str, int]
    new_block_ids: dict[str, tuple[list[int], bool]]
    preempted: tuple[str, ...]
    finished: tuple[Request, ...]


class KVConnector(Protocol):
    """The scheduler side of a KV connector. ``is_kv_consumer``: it loads KV into the
    engine's blocks (vLLM's ``kv_role`` kv_consumer or kv_both); ``requires_kv_delivery``:
    it hands KV off when a request finishes, so a preempted request's in-flight output is
    dropped rather than let it finish (vLLM's property of that name)."""

    @property
    def is_kv_consumer(self) -> bool: ...

    @property
    def requires_kv_delivery(self) -> bool: ...

    def on_new_request(self, req: Request) -> None: ...

    def get_num_new_matched_tokens(self, req: Request, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]: ...

    def update_state_after_alloc(self, req: Request, block_ids: list[int], block_hashed: list[bool],
                                 num_external_tokens: int) -> None: ...

    def build_connector_meta(self, step: StepView) -> ConnectorMeta: ...

    def update_connector_output(self, output: ConnectorOutput) -> None: ...

    def request_finished(self, req: Request) -> tuple[bool, KVTransferParams | None]: ...

    def has_pending_work(self) -> bool: ...

    def held_keys(self) -> list[int]: ...

    def check_invariants(self) -> None: ...


@dataclass(slots=True)
class StepDelayWorker:
    """A worker whose transfers take a fixed number of scheduler steps, as the oracle's fake
    worker: a load is submitted in the step that carries it, a store in the step after (its
    KV is written by that step's forward pass), a flushed job at once; each is reported
    done ``delay`` steps after it was submitted (0: in the same step's output)."""

    delay: int = 0
    due: dict[int, tuple[int, str | None]] = field(default_factory=dict)

    def submit(self, meta: ConnectorMeta | None, call: int) -> None:
        if meta is None:
            return
        for job in meta.load_jobs:
            self.due[job.job_id] = (call + self.delay, job.req_id)
        for job in meta.store_jobs:
            self.due[job.job_id] = (call + 1 + self.delay, None)
        for job_id in meta.jobs_to_flush:
            if job_id in self.due:
                at, req_id = self.due[job_id]
                self.due[job_id] = (min(at, call), req_id)

    def output(self, call: int) -> ConnectorOutput | None:
        done = sorted(j for j, (at, _) in self.due.items() if at <= call)
        if not done:
            return None
        recving = frozenset(r for j in done if (r := self.due[j][1]) is not None)
        for j in done:
            del self.due[j]
        return ConnectorOutput(tuple(done), recving)

    @property
    def busy(self) -> bool:
        return bool(self.due)


@dataclass(slots=True)
class _Transfer:
    job_id: int
    req_id: str | None  # a load's request (reported as finished_recving)
    num_bytes: int
    done_s: float


class TimedWorker:
    """The worker side of native CPU offloading with its copies timed
    (``OffloadingConnectorWorker`` over ``CPUOffloadingWorker``): one stream per direction,
    each running its transfers one after another, in submission order, at the host link's
    bandwidth (each tensor-parallel rank over its own link: ``block_bytes`` is one rank's).

    At the start of a step, as ``handle_preemptions`` and ``start_kv_transfers`` do: stores
    this step flushes are submitted with the previous step's stores and waited for (the step
    starts when they are done); then this step's loads. This step's other stores are
    submitted at the start of the next step (their KV is written by this step's forward
    pass). At the end of a step the transfers finished by then are reported, per direction
    in submission order (``get_finished``). Loads do not hold a step up: the request waits in
    WAITING_FOR_REMOTE_KVS."""

    def __init__(self, block_bytes: int, bandwidth_bytes_per_s: float, latency_s: float):
        self.block_bytes = block_bytes
        self.bandwidth = bandwidth_bytes_per_s
        self.latency = latency_s
        self.loads: deque[_Transfer] = deque()
        self.stores: deque[_Transfer] = deque()
        self.free_at = {"load": 0.0, "store": 0.0}
        self.unsubmitted: list[TransferJob] = []
        self.load_bytes = self.store_bytes = 0
        self.load_time_s = self.store_time_s = 0.0

    def _submit(self, job: TransferJob, now: float) -> _Transfer:
        queue = self.loads if job.kind == "load" else self.stores
        start = max(now, self.free_at[job.kind])
        num_bytes = job.num_blocks * self.block_bytes
        took = self.latency + num_bytes / self.bandwidth
        t = _Transfer(job.job_id, job.req_id if job.kind == "load" else None, num_bytes,
                      start + took)
        self.free_at[job.kind] = t.done_s
        queue.append(t)
        if job.kind == "load":
            self.load_bytes += num_bytes
            self.load_time_s += took
        else:
            self.store_bytes += num_bytes
            self.store_time_s += took
        return t

    def begin_step(self, meta: ConnectorMeta | None, now: float) -> float:
        """Submit what a step starting at ``now`` submits; returns when it can start."""
        stores = list(meta.store_jobs) if meta is not None else []
        start = now
        if meta is not None and meta.jobs_to_flush:
            flushed = [j for j in stores if j.job_id in meta.jobs_to_flush]
            stores = [j for j in stores if j.job_id not in meta.jobs_to_flush]
            for job in [*self.unsubmitted, *flushed]:
                self._submit(job, now)
            self.unsubmitted = []
            start = max([now, *(t.done_s for t in (*self.loads, *self.stores)
                                if t.job_id in meta.jobs_to_flush)])
        for job in self.unsubmitted:
            self._submit(job, now)
        self.unsubmitted = stores
        for job in meta.load_jobs if meta is not None else ():
            self._submit(job, start)
        return start

    def end_step(self, now: float) -> ConnectorOutput | None:
        """The transfers finished by ``now``, reported with the step's outputs."""
        done: list[int] = []
        recving: set[str] = set()
        for queue in (self.stores, self.loads):
            while queue and queue[0].done_s <= now:
                t = queue.popleft()
                done.append(t.job_id)
                if t.req_id is not None:
                    recving.add(t.req_id)
        if not done:
            return None
        return ConnectorOutput(tuple(done), frozenset(recving))

    @property
    def busy(self) -> bool:
        return bool(self.loads or self.stores or self.unsubmitted)

    def next_done_s(self) -> float | None:
        """When the next submitted transfer finishes (None: none is submitted)."""
        heads = [q[0].done_s for q in (self.loads, self.stores) if q]
        return min(heads) if heads else None
