"""Small builders for driving the accounting core without SimPy."""

from __future__ import annotations

import os
from pathlib import Path

from kvsim.kv.manager import KVCacheManager
from kvsim.kv.pool import BlockPool
from kvsim.request import ExplicitTokens, Request, RequestSpec
from kvsim.sched import Scheduler, SchedulerParams
from kvsim.semantics import VERSIONS

# The public data (traces, measured runs, GPU layer profiles) the tests read: one place,
# $KVSIM_SHARED_DATA, else ../shared/data beside the repository (where CI puts it). Tests that
# need it skip cleanly without it.
SHARED_DATA = Path(os.environ.get("KVSIM_SHARED_DATA")
                   or Path(__file__).resolve().parents[2] / "shared" / "data")



def small_chat(num_gpu_blocks: int, num_requests: int) -> str:
    """A small chat scenario (Llama 3.2 1B on an L40S, a shared system prompt and three
    users' histories) that runs in well under a second: the CLI-level tests' common base."""
    return f"""
[model]
preset = "llama-3.2-1b"
[hardware]
preset = "l40s"
[engine]
num_gpu_blocks = {num_gpu_blocks}
max_model_len = 1024
max_num_batched_tokens = 256
max_num_seqs = 8
[workload]
num_requests = {num_requests}
request_rate = 40.0
system_prompt_tokens = 64
num_users = 3
user_history_tokens = 96
input_tokens = 24
output_tokens = 40
"""


_seq = iter(range(10**9))


def make_request(req_id: str, tokens, max_tokens: int = 1, priority: int = 0,
                 arrival_s: float = 0.0) -> Request:
    spec = RequestSpec(req_id=req_id, arrival_s=arrival_s, prompt=ExplicitTokens(tuple(tokens)),
                       max_tokens=max_tokens, priority=priority)
    return Request(spec, next(_seq))


def make_manager(num_gpu_blocks: int, block_size: int, max_model_len: int = 1 << 20,
                 enable_caching: bool = True, version: str = "0.33.0") -> KVCacheManager:
    sem = VERSIONS[version]
    pool = BlockPool(num_gpu_blocks, enable_caching, sem.free_unhashed_to_front)
    return KVCacheManager(pool, block_size, max_model_len, enable_caching)


def make_scheduler(num_gpu_blocks: int = 1000, block_size: int = 16, max_num_batched_tokens: int = 8192,
                   max_num_seqs: int = 256, max_model_len: int = 1 << 16, enable_caching: bool = True,
                   version: str = "0.33.0", **params) -> Scheduler:
    kv = make_manager(num_gpu_blocks, block_size, max_model_len, enable_caching, version)
    p = SchedulerParams(max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                        max_model_len=max_model_len, **params)
    return Scheduler(p, kv, VERSIONS[version])


def step(sched: Scheduler) -> dict:
    """One synchronous step with invariants checked; returns what happened."""
    plan = sched.schedule()
    sched.kv.check_invariants()
    first, finished = sched.update_from_output(plan)
    sched.kv.check_invariants()
    return {
        "scheduled": {c.req.req_id: c.num_new_tokens for c in plan.scheduled},
        "preempted": [r.req_id for r in plan.preempted],
        "finished": [r.req_id for r in finished],
        "queries": plan.prefix_cache.queries,
        "hits": plan.prefix_cache.hits,
    }


def run_until_done(sched: Scheduler, max_steps: int = 10_000) -> list[dict]:
    out = []
    while sched.num_unfinished:
        out.append(step(sched))
        assert len(out) < max_steps
    return out
