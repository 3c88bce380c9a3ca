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
- ``request_finished(req)`` before a finished request's blocks are freed.

An offload tier (``kvsim.kv.offload``) plugs in here; a P/D transfer will too. A worker
(``StepDelayWorker`` here; a timed one in the engine) decides when submitted jobs finish.
Pure Python, no SimPy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Protocol

from kvsim.request import Request

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
class ConnectorMeta:
    """What one step hands the worker (vLLM's ``OffloadingConnectorMetadata``)."""

    load_jobs: tuple[TransferJob, ...] = ()
    store_jobs: tuple[TransferJob, ...] = ()
    jobs_to_flush: frozenset[int] = frozenset()


@dataclass(frozen=True, slots=True)
class ConnectorOutput:
    """What the worker reports with a step's outputs (vLLM's ``KVConnectorOutput``):
    finished jobs, and the requests whose asynchronous loads finished."""

    completed_jobs: tuple[int, ...] = ()
    finished_recving: frozenset[str] = frozenset()


@dataclass(frozen=True, slots=True)
class StepView:
    """One ``schedule()`` as the connector sees it (the parts of vLLM's ``SchedulerOutput``
    it reads): tokens scheduled per request in scheduling order, the request objects, the
    block ids each request holds now and whether they are its whole table, the requests
    preempted and those that finished since the last step."""

    num_scheduled_tokens: dict[str, int]
    requests: dict[str, Request]
    new_block_ids: dict[str, tuple[list[int], bool]]
    preempted: tuple[str, ...]
    finished: tuple[Request, ...]


class KVConnector(Protocol):
    """The scheduler side of a KV connector."""

    def on_new_request(self, req: Request) -> None: ...

    def get_num_new_matched_tokens(self, req: Request, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]: ...

    def update_state_after_alloc(self, req: Request, block_ids: list[int], block_hashed: list[bool],
                                 num_external_tokens: int) -> None: ...

    def build_connector_meta(self, step: StepView) -> ConnectorMeta: ...

    def update_connector_output(self, output: ConnectorOutput) -> None: ...

    def request_finished(self, req: Request) -> bool: ...

    def has_pending_work(self) -> bool: ...

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
