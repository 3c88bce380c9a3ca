"""Prefill/decode disaggregation: the scheduler side of vLLM's NixlConnector (pull mode,
``distributed/kv_transfer/kv_connector/v1/nixl/{base,pull}_scheduler.py``, 0.32 and 0.33),
one instance per engine, ``kv_role`` kv_producer (the prefill side) or kv_consumer (the
decode side).

The P/D proxy sends a request to a prefill engine with ``max_tokens = 1`` and
``do_remote_decode``; that engine's connector drops the trailing ``backoff`` prompt tokens
(``_truncate_request_for_prefill``), and when the request finishes keeps its blocks
(``request_finished`` delays the free) until the decode side has read them
(``finished_sending``). The proxy then sends the request to a decode engine with the
params the prefill's output carried (``do_remote_prefill``, the remote request and blocks).
There the connector reports the prompt less the backoff, less the local prefix hit, as
external tokens loaded asynchronously: the request waits in WAITING_FOR_REMOTE_KVS holding
its blocks until the read finishes (``finished_recving``), then recomputes what the load
did not cover (at least the last token). A full local hit reads nothing; the remote blocks
are freed by a notification alone.

``kv_recompute_threshold`` (``kv_connector_extra_config``) gates only the bidirectional
read-back in these releases (a prefill-bound request that carries remote blocks, off by
default), which kvsim does not model: the connector has no use for it, and the referee,
which sets it on vLLM's side, checks that it changes nothing. Pure Python, no SimPy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kvsim.errors import ConfigError
from kvsim.kv.connector import ConnectorMeta, ConnectorOutput, RecvJob, StepView
from kvsim.request import KVTransferParams, Request
from kvsim.semantics import VERSIONS, Semantics

KVRole = Literal["kv_producer", "kv_consumer"]


@dataclass(frozen=True, slots=True)
class PDParams:
    """One engine's place in a P/D deployment: its ``kv_role`` and its index among the
    cluster's engines (vLLM's ``engine_id``)."""

    kv_role: KVRole
    engine: int = 0


def check_pd(where: str, sem: Semantics, hybrid: bool) -> None:
    """Refuse, with a ConfigError at ``where``, what kvsim does not reproduce."""
    if not sem.nixl_pd:
        covered = [v for v, s in VERSIONS.items() if s.nixl_pd]
        raise ConfigError(where, f"P/D disaggregation (NixlConnector) is reproduced for vLLM "
                          f"{', '.join(covered)}, not {sem.version}")
    if hybrid:
        raise ConfigError(where, "P/D disaggregation of a hybrid KV layout is not reproduced "
                          "yet (one KV cache group is)")


def prefill_backoff(num_prefill_lookahead: int) -> int:
    """``_prefill_backoff()``: trailing prompt tokens the prefill side does not compute and
    the decode side recomputes: a multi-module MTP drafter's lookahead window less one (vLLM
    also backs off one token for a Mamba model, whose hybrid layout P/D refuses here)."""
    return max(0, num_prefill_lookahead - 1)


class NixlConnector:
    """One engine's NixlConnector scheduler side (``NixlPullConnectorScheduler``)."""

    def __init__(self, pd: PDParams, block_size: int, backoff: int):
        self.role: KVRole = pd.kv_role
        self.engine = pd.engine
        self.block_size = block_size
        self.backoff = backoff
        self._reqs_need_recv: dict[str, RecvJob] = {}
        self._reqs_need_send: list[str] = []

    @property
    def is_kv_consumer(self) -> bool:
        return self.role == "kv_consumer"

    @property
    def requires_kv_delivery(self) -> bool:
        return self.role == "kv_producer"  # (KVConnectorBase_V1's default)

    def on_new_request(self, req: Request) -> None:
        params = req.kv_transfer_params
        if params is not None and params.do_remote_decode:
            self._truncate_request_for_prefill(req, params)

    def _truncate_request_for_prefill(self, req: Request, params: KVTransferParams) -> None:
        """Drop the trailing backoff tokens, once (a preempted request is not cut again)."""
        b = self.backoff
        if b and not params.p_side_truncated and req.num_prompt_tokens > b:
            req.num_prompt_tokens -= b
            req.max_tokens = 1
            params.p_side_truncated = True

    def _remote_prefill_token_count(self, num_prompt_tokens: int) -> int:
        b = self.backoff
        return num_prompt_tokens - b if b and num_prompt_tokens > b else num_prompt_tokens

    def get_num_new_matched_tokens(self, req: Request, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        params = req.kv_transfer_params
        if params is None:
            return 0, False
        if params.do_remote_prefill:
            count = self._remote_prefill_token_count(req.num_prompt_tokens) - num_computed_tokens
            if count > 0:
                return count, True
        return 0, False

    def update_state_after_alloc(self, req: Request, block_ids: list[int], block_hashed: list[bool],
                                 num_external_tokens: int) -> None:
        params = req.kv_transfer_params
        if params is None or not params.do_remote_prefill:
            return
        if params.remote_num_blocks:
            assert params.remote_engine is not None and params.remote_request_id is not None
            # The blocks the read fills: the unhashed ones (a full local hit reads none).
            unhashed = (sum(1 for b, hashed in zip(block_ids, block_hashed) if not hashed and b)
                        if num_external_tokens > 0 else 0)
            self._reqs_need_recv[req.req_id] = RecvJob(
                req.req_id, params.remote_engine, params.remote_request_id, unhashed,
                num_external_tokens > 0)
        else:
            assert num_external_tokens == 0
        params.do_remote_prefill = False  # one transfer per request

    def request_finished(self, req: Request) -> tuple[bool, KVTransferParams | None]:
        """A prefill side keeps a finished request's blocks until they are read, and returns
        the decode side's params; a decode side frees at once."""
        params = req.kv_transfer_params
        # (A decode-side request finishes only after its allocation cleared do_remote_prefill:
        # kvsim aborts nothing, so vLLM's clean-up of a never-scheduled one has no case here.)
        if params is None or not params.do_remote_decode:
            return False, None
        num_blocks = -(-req.num_computed_tokens // self.block_size)
        if num_blocks:
            self._reqs_need_send.append(req.req_id)
        return num_blocks > 0, KVTransferParams(
            do_remote_prefill=True, remote_engine=self.engine, remote_request_id=req.req_id,
            remote_num_blocks=num_blocks)

    def build_connector_meta(self, step: StepView) -> ConnectorMeta:
        meta = ConnectorMeta(reqs_to_recv=tuple(self._reqs_need_recv.values()),
                             reqs_to_send=tuple(self._reqs_need_send))
        self._reqs_need_recv = {}
        self._reqs_need_send = []
        return meta

    def update_connector_output(self, output: ConnectorOutput) -> None:
        pass  # (vLLM's stops heartbeats here)

    def has_pending_work(self) -> bool:
        return False  # a finished request awaiting its read keeps the engine stepping itself

    def held_keys(self) -> list[int]:
        return []

    def check_invariants(self) -> None:
        pass  # it holds no blocks or keys of its own


class StepDelayPDWorker:
    """Both NIXL workers of a P/D pair with reads counted in schedule() calls, as the
    referee's fake workers (``oracle/pd_driver.py``): a read the decode side's call ``c``
    hands over is done at its call ``c + delay`` (at ``c`` when it reads no blocks): the
    request is then reported in ``finished_recving`` if it waits for it, and the prefill
    side is notified; the prefill side reports a request in ``finished_sending`` at its
    first call after both the notification and the step that handed it over."""

    def __init__(self, delay: int):
        self.delay = delay
        self.reads: dict[str, tuple[int, RecvJob]] = {}
        self.to_send: set[str] = set()
        self.notified: set[str] = set()

    def decode_step(self, meta: ConnectorMeta | None, call: int) -> ConnectorOutput | None:
        for job in meta.reqs_to_recv if meta is not None else ():
            self.reads[job.req_id] = (call + (self.delay if job.num_blocks else 0), job)
        recving = set()
        for req_id, (due, job) in list(self.reads.items()):
            if due <= call:
                del self.reads[req_id]
                if job.awaiting:
                    recving.add(req_id)
                self.notified.add(job.remote_request_id)
        return ConnectorOutput(finished_recving=frozenset(recving)) if recving else None

    def prefill_step(self, meta: ConnectorMeta | None) -> ConnectorOutput | None:
        if meta is not None:
            self.to_send.update(meta.reqs_to_send)
        sent = sorted(self.to_send & self.notified)
        self.to_send.difference_update(sent)
        self.notified.difference_update(sent)
        return ConnectorOutput(finished_sending=tuple(sent)) if sent else None
