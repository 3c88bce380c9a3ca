"""Drive kvsim's scheduler exactly as ``vllm_driver.py`` drives vLLM's, and compare results.

Both loops share one contract: ``step`` counts the schedule() calls that scheduled tokens;
before each call every request with ``join_step <= step`` joins, in input order; when the
engine is idle the batch with the next ``join_step`` joins; a request whose chunk reaches
``num_tokens`` samples one token. ``drive`` returns the driver's output schema, so
``compare`` can diff the two field by field.
"""

from __future__ import annotations

import hashlib
import json
from collections import deque
from typing import Any

from kvsim.assemble import assemble_scheduler
from kvsim.config import check_groups_for_release, check_retention_interval
from kvsim.errors import EngineDeadError
from kvsim.kv.connector import StepDelayWorker
from kvsim.kv.hybrid import GroupSpec
from kvsim.kv.nixl import PDParams, StepDelayPDWorker
from kvsim.kv.offload import OffloadParams
from kvsim.request import ExplicitTokens, KVTransferParams, Request, RequestSpec, SegmentTokens
from kvsim.sched import PrefixCacheStats, Scheduler, SchedulerParams
from kvsim.schema import vllm_retention
from kvsim.semantics import semantics_for
from kvsim.specdec import EAGLE_METHODS, Drafting

ENGINE_DEFAULTS = {
    "block_size": 16, "num_gpu_blocks": 64, "enable_prefix_caching": True,
    "max_num_batched_tokens": 2048, "max_num_seqs": 256, "max_model_len": 4096,
    "enable_chunked_prefill": True, "long_prefill_token_threshold": 0,
    "scheduling_policy": "fcfs", "scheduler_reserve_full_isl": True,
}
REQUEST_FIELDS = ("cached_tokens", "num_preemptions", "first_scheduled_step", "first_token_step",
                  "finish_step", "num_output_tokens", "external_cached_tokens")
EXTERNAL_TOTALS = tuple(PrefixCacheStats().external_counters())


def prompt_of(spec: dict):
    if "prompt_segments" in spec:
        return SegmentTokens([tuple(s) for s in spec["prompt_segments"]])
    return ExplicitTokens(tuple(spec["prompt_token_ids"]))


def build(engine: dict, version: str) -> Scheduler:
    e = {**ENGINE_DEFAULTS, **engine}
    sem = semantics_for(version)
    if sem is None:
        raise ValueError(f"kvsim does not reproduce vLLM {version}")
    sd = e.get("speculative") or {}
    spec = Drafting(method=sd.get("method", "none"),
                    num_speculative_tokens=sd.get("num_speculative_tokens", 0),
                    disable_eagle_block_drop=sd.get("disable_eagle_block_drop", False),
                    disable_lookahead_block_hashes=sd.get("disable_lookahead_block_hashes", False),
                    parallel_drafting=sd.get("parallel_drafting", False),
                    num_nextn_predict_layers=int(sd.get("mtp_num_layers", 1)))
    groups = [GroupSpec(kind=g["kind"], block_size=g["block_size"],
                        sliding_window=g.get("sliding_window") or 0, eagle=g.get("eagle", False),
                        prefill_checkpoint_alignment=g.get("prefill_checkpoint_alignment"))
              for g in e.get("kv_groups") or ()]
    check_groups_for_release("engine.kv_groups", groups, sem)
    params = SchedulerParams(**{k: e[k] for k in (
        "max_num_batched_tokens", "max_num_seqs", "max_model_len", "enable_chunked_prefill",
        "long_prefill_token_threshold", "scheduling_policy", "scheduler_reserve_full_isl")},
        async_scheduling=bool(e.get("async_scheduling", False)))
    retention = check_retention_interval(
        "engine.prefix_cache_retention_interval", e.get("prefix_cache_retention_interval"), sem,
        groups, eagle=(e.get("speculative") or {}).get("method") in EAGLE_METHODS)
    off = e.get("kv_offloading")
    offload = None if off is None else OffloadParams(
        num_chunks=int(off["cpu_chunks"]), blocks_per_chunk=int(off.get("blocks_per_chunk", 1)),
        offload_prompt_only=bool(off.get("offload_prompt_only", True)),
        store_threshold=int(off.get("store_threshold", 0)),
        eviction_policy=off.get("eviction_policy", "lru"))
    kt = e.get("kv_transfer")
    pd = None if kt is None else PDParams(
        kv_role=kt["kv_role"], engine=0 if kt["kv_role"] == "kv_producer" else 1)
    return assemble_scheduler(sem, params, spec, num_gpu_blocks=e["num_gpu_blocks"],
                              block_size=e["block_size"], enable_caching=e["enable_prefix_caching"],
                              kv_groups=groups,
                              retention_interval=vllm_retention(retention), offload=offload,
                              kv_transfer=pd)


def _make_request(s: dict, seq: int, max_tokens: int | None = None) -> Request:
    accepted = tuple(s["accepted"]) if s.get("accepted") else None
    r = Request(RequestSpec(req_id=str(s["req_id"]), arrival_s=float(s.get("arrival_time", 0.0)),
                            prompt=prompt_of(s),
                            max_tokens=int(s["max_tokens"]) if max_tokens is None else max_tokens,
                            priority=int(s.get("priority", 0)), accepted=accepted), seq)
    r.output_token_id = int(s.get("output_token_id", -1))
    if r.output_token_id >= 0:  # (kvsim's block hashes tell outputs from prompts by sign)
        raise ValueError(f"request {s['req_id']}: output_token_id must be negative")
    return r


def _accept(req: Request, num_drafts: int) -> int:
    """The driver's rule: the request's ``accepted`` list, cycled over its verify steps."""
    seq = req.accepted_trace or (0,)
    return min(seq[req.num_verify_steps % len(seq)], num_drafts)


def drive(scenario: dict, version: str = "0.33.0", check_invariants: bool = True,
          max_steps: int | None = None) -> dict:
    """Run a driver-format scenario through kvsim; the result follows the driver's schema.

    ``max_steps`` stops early (vLLM's algorithm can thrash forever in some tiny pools).
    """
    engine = scenario.get("engine", {})
    sched = build(engine, version)
    # The oracle's fake worker: transfers take a fixed number of schedule() calls.
    worker = (StepDelayWorker(int(engine["kv_offloading"].get("transfer_delay", 0)))
              if sched.connector is not None else None)
    external = PrefixCacheStats()  # the connector's, over every schedule() call
    calls = 0
    specs = scenario["requests"]
    reqs = []
    for i, s in enumerate(specs):
        reqs.append(_make_request(s, i))
    join = [int(s.get("join_step", 0)) for s in specs]
    pending = list(range(len(reqs)))
    steps, step, done, stalled, dead = [], 0, 0, None, None

    def add_joined(limit):
        nonlocal pending
        for i in [i for i in pending if join[i] <= limit]:
            sched.add_request(reqs[i])
        pending = [i for i in pending if join[i] > limit]

    # vLLM's EngineCore: with asynchronous scheduling a batch queue of two, so step N + 1 is
    # scheduled before step N's outputs are applied (Scheduler.schedules_ahead).
    queue: deque = deque()
    planned: dict[str, int] = {}  # verify steps per request, counted at schedule time
    while True:
        add_joined(step)
        if (done == len(reqs) and not queue) or (max_steps is not None and step >= max_steps):
            break
        if not sched.num_unfinished and not queue:
            while worker is not None and sched.has_requests:  # EngineCore steps on, idle
                plan = sched.schedule()
                calls += 1
                worker.submit(plan.connector_meta, calls)
                sched.update_from_output(plan, _accept, worker.output(calls))
            add_joined(min(join[i] for i in pending))
            continue
        if sched.has_requests:
            try:
                plan = sched.schedule()
            except EngineDeadError as exc:  # the release's own failure, in this step
                dead = {"step": step, "error": str(exc)}
                break
            calls += 1
            kv_out = None
            if worker is not None:
                worker.submit(plan.connector_meta, calls)
                kv_out = worker.output(calls)
                external.add(plan.external_prefix_cache)
            executed = bool(plan.scheduled)
            if sched.num_unfinished and not (
                    executed or plan.preempted or any(q[0].scheduled for q in queue)
                    or (worker is not None and (worker.busy or kv_out is not None
                                                or any(q[2] is not None for q in queue)))):
                stalled = step  # the release deadlocks here (e.g. 0.19's uncapped window gate)
                break
            rec = None
            if executed:
                rec = _record(sched, plan, step, planned)
                steps.append(rec)
                step += 1
            queue.appendleft((plan, rec, kv_out))
            if sched.schedules_ahead(len(queue), executed):
                continue
        elif not queue:
            break
        done += len(_apply(sched, *queue.pop()))
        if check_invariants:
            sched.check_invariants()
    # The driver reads cached tokens from a request's first output: a run cut short (an
    # engine death) leaves them unreported for requests that produced none.
    out: dict[str, Any] = {
        "requests": {r.req_id: {"cached_tokens": r.cached_tokens if r.first_token_step is not None
                                else None, "num_preemptions": r.num_preemptions,
                                "first_scheduled_step": r.first_scheduled_step,
                                "first_token_step": r.first_token_step, "finish_step": r.finish_step,
                                "num_output_tokens": r.num_output_tokens} for r in reqs},
        "steps": steps,
        "free_queue_end": list(sched.kv.pool.free_queue),
        "stall": stalled,
        "engine_dead": dead,
    }
    if worker is not None:
        for r in reqs:
            out["requests"][r.req_id]["external_cached_tokens"] = (
                r.external_cached_tokens if r.cached_tokens is not None else None)
        out["totals"] = external.external_counters()
    return out


def _apply(sched: Scheduler, plan, rec: dict | None, kv_out) -> list[Request]:
    """A batch's outputs applied (``update_from_output``) and recorded; the requests it
    finished."""
    first, finished = sched.update_from_output(plan, _accept, kv_out)
    if rec is not None:
        for r in first:
            r.first_token_step = rec["step"]
        for r in finished:
            r.finish_step = rec["step"]
        rec["num_free_blocks"] = sched.kv.pool.num_free_blocks
    return finished


def _record(sched: Scheduler, plan, step: int, planned: dict[str, int]) -> dict:
    """A step as the driver records it, at schedule time (frees are filled in at update)."""
    spec = {}
    for c in plan.scheduled:
        req = c.req
        if req.first_scheduled_step is None:
            req.first_scheduled_step = step
        if c.num_spec_tokens and c.samples:
            if c.padded:
                spec[req.req_id] = [c.num_spec_tokens, 0]
            else:
                n = planned.get(req.req_id, 0)
                planned[req.req_id] = n + 1
                seq = req.accepted_trace or (0,)
                spec[req.req_id] = [c.num_spec_tokens, min(seq[n % len(seq)], c.num_spec_tokens)]
    pc = plan.prefix_cache
    return {
        "step": step,
        "scheduled": {c.req.req_id: c.num_new_tokens for c in plan.scheduled},
        "preempted": sorted(r.req_id for r in plan.preempted),
        "block_ids": {c.req.req_id: sched.kv.block_ids(c.req.req_id) for c in plan.scheduled},
        "num_free_blocks": None,
        "spec": spec,
        "prefix_cache": {"requests": pc.requests, "queries": pc.queries, "hits": pc.hits,
                         "preempted_requests": pc.preempted_requests,
                         "preempted_queries": pc.preempted_queries, "preempted_hits": pc.preempted_hits},
    }


def block_ids_digest(block_ids: dict) -> str:
    """A short fingerprint of one step's block tables (fixtures store this, not the tables)."""
    text = json.dumps(list(block_ids.items()), separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def compare(kvsim: dict, vllm: dict, limit: int = 10) -> list[str]:
    """Mismatches between two results, first ``limit`` of them (empty: identical)."""
    out: list[str] = []
    for rid, want in vllm["requests"].items():
        got = kvsim["requests"].get(rid, {})
        for f in REQUEST_FIELDS:
            if got.get(f) != want.get(f):
                out.append(f"request {rid} {f}: kvsim {got.get(f)} vllm {want.get(f)}")
    if kvsim.get("engine_dead") != vllm.get("engine_dead"):
        out.append(f"engine_dead: kvsim {kvsim.get('engine_dead')} vllm {vllm.get('engine_dead')}")
    if len(kvsim["steps"]) != len(vllm["steps"]):
        out.append(f"steps: kvsim {len(kvsim['steps'])} vllm {len(vllm['steps'])}")
    for ks, vs in zip(kvsim["steps"], vllm["steps"]):
        if "block_ids_digest" in vs:
            ks = {**ks, "block_ids_digest": block_ids_digest(ks["block_ids"])}
        fields = [f for f in ("scheduled", "preempted", "block_ids", "block_ids_digest",
                              "num_free_blocks", "prefix_cache", "spec") if f in vs]
        for f in fields:
            a, b = ks[f], vs[f]
            if f == "scheduled":  # order matters: running first, then admissions
                a, b = list(a.items()), list(b.items())
            if a != b:
                out.append(f"step {vs['step']} {f}: kvsim {a} vllm {b}")
    if kvsim["free_queue_end"] != vllm["free_queue_end"]:
        out.append("free_queue_end differs")
    for key in EXTERNAL_TOTALS:
        if key in vllm.get("totals", {}) and kvsim.get("totals", {}).get(key) != vllm["totals"][key]:
            out.append(f"totals {key}: kvsim {kvsim.get('totals', {}).get(key)} vllm {vllm['totals'][key]}")
    return out[:limit]


class _PDSide:
    """One engine of a P/D pair as ``oracle/pd_driver.py`` steps it."""

    def __init__(self, engine: dict, role: str, version: str):
        self.sched = build({**engine, "kv_transfer": {"kv_role": role}}, version)
        self.reqs: list[Request] = []
        self.join_tick: dict[str, int] = {}
        self.steps: list[dict] = []
        self.step = 0
        self.calls = 0
        self.planned: dict[str, int] = {}
        self.prefix = PrefixCacheStats()
        self.external = PrefixCacheStats()
        self.active = False
        self.queue: deque = deque()  # batches in flight, newest first

    def add(self, req: Request, tick: int) -> None:
        self.reqs.append(req)
        self.join_tick[req.req_id] = tick
        self.sched.add_request(req)

    def call(self, tick: int, worker_step, check_invariants: bool) -> list[Request]:
        """One EngineCore iteration (``drive``'s batch queue); returns the requests it
        finished."""
        sched = self.sched
        if sched.has_requests:
            plan = sched.schedule()
            self.calls += 1
            kv_out = worker_step(plan.connector_meta, self.calls)
            meta = plan.connector_meta
            self.active |= bool(plan.scheduled or plan.preempted or kv_out is not None
                                or (meta is not None and (meta.reqs_to_recv or meta.reqs_to_send)))
            self.prefix.add(plan.prefix_cache)
            self.external.add(plan.external_prefix_cache)
            rec = None
            if plan.scheduled:
                rec = _record(sched, plan, self.step, self.planned)
                rec["tick"] = tick
                self.steps.append(rec)
                self.step += 1
            self.queue.appendleft((plan, rec, kv_out))
            self.active |= any(q[0].scheduled for q in self.queue)
            if sched.schedules_ahead(len(self.queue), bool(plan.scheduled)):
                return []
        elif not self.queue:
            return []
        finished = _apply(sched, *self.queue.pop())
        if check_invariants:
            sched.check_invariants()
        return finished

    def result(self) -> dict:
        p = self.prefix
        return {
            # (the driver reads a hit from the outputs: none before the first token)
            "requests": {r.req_id: {
                "cached_tokens": r.cached_tokens if r.first_token_step is not None else None,
                "num_preemptions": r.num_preemptions,
                "first_scheduled_step": r.first_scheduled_step,
                "first_token_step": r.first_token_step, "finish_step": r.finish_step,
                "num_output_tokens": r.num_output_tokens, "join_tick": self.join_tick[r.req_id],
                "external_cached_tokens": (r.external_cached_tokens
                                           if r.first_token_step is not None else None)}
                for r in self.reqs},
            "steps": self.steps,
            "free_queue_end": list(self.sched.kv.pool.free_queue),
            "totals": {"prefix_cache_queries": p.queries, "prefix_cache_hits": p.hits,
                       "prefix_cache_requests": p.requests, "preempted_queries": p.preempted_queries,
                       "preempted_hits": p.preempted_hits,
                       "preempted_requests": p.preempted_requests,
                       **self.external.external_counters()},
        }


def drive_pd(scenario: dict, version: str = "0.33.0", check_invariants: bool = True,
             max_ticks: int = 200_000) -> dict:
    """Run a P/D scenario (``oracle/pd_driver.py``'s input) through two kvsim engines in the
    driver's ticks; the result follows the driver's schema."""
    # (The scenario's kv_recompute_threshold goes to vLLM's side only: see kvsim.kv.nixl.)
    p = _PDSide(scenario.get("prefill", {}), "kv_producer", version)
    d = _PDSide(scenario.get("decode", {}), "kv_consumer", version)
    worker = StepDelayPDWorker(int(scenario.get("transfer_delay", 0)))
    specs = scenario["requests"]
    order = {str(s["req_id"]): i for i, s in enumerate(specs)}
    pending = list(specs)
    handover: list[Request] = []
    tick = done = 0
    stall = None
    while True:
        for s in [s for s in pending if int(s.get("join_step", 0)) <= tick]:
            r = _make_request(s, order[str(s["req_id"])], max_tokens=1)  # as the proxy sends it
            r.kv_transfer_params = KVTransferParams(do_remote_decode=True)
            p.add(r, tick)
        pending = [s for s in pending if int(s.get("join_step", 0)) > tick]
        for pr in handover:
            s = specs[order[pr.req_id]]
            r = _make_request(s, order[pr.req_id])
            r.kv_transfer_params = pr.kv_transfer_output
            d.add(r, tick)
        handover = []
        if (done == len(specs) and not p.sched.has_requests and not d.sched.has_requests
                and not p.queue and not d.queue):
            break
        if tick >= max_ticks:
            break
        p.active = d.active = False
        handover = p.call(tick, lambda meta, call: worker.prefill_step(meta), check_invariants)
        done += len(d.call(tick, worker.decode_step, check_invariants))
        if done < len(specs) and not (pending or handover or p.active or d.active or worker.reads):
            stall = tick  # nothing ran, moved or is in flight: the pair deadlocks
            break
        tick += 1
    return {"prefill": p.result(), "decode": d.result(), "num_ticks": tick, "stall": stall}


def compare_pd(kvsim: dict, vllm: dict, limit: int = 10) -> list[str]:
    """Mismatches between two P/D results (each side as ``compare``, with the ticks)."""
    out: list[str] = []
    if kvsim.get("stall") != vllm.get("stall"):
        out.append(f"stall: kvsim {kvsim.get('stall')} vllm {vllm.get('stall')}")
    if kvsim["num_ticks"] != vllm["num_ticks"]:
        out.append(f"num_ticks: kvsim {kvsim['num_ticks']} vllm {vllm['num_ticks']}")
    for side in ("prefill", "decode"):
        k, v = kvsim[side], vllm[side]
        out += [f"{side}: {m}" for m in compare(k, v, limit)]
        for rid, want in v["requests"].items():
            if k["requests"].get(rid, {}).get("join_tick") != want["join_tick"]:
                out.append(f"{side}: request {rid} join_tick: kvsim "
                           f"{k['requests'].get(rid, {}).get('join_tick')} vllm {want['join_tick']}")
        out += [f"{side}: step {vs['step']} tick: kvsim {ks['tick']} vllm {vs['tick']}"
                for ks, vs in zip(k["steps"], v["steps"]) if ks["tick"] != vs["tick"]]
        out += [f"{side}: totals {key}: kvsim {k['totals'].get(key)} vllm {val}"
                for key, val in v["totals"].items() if k["totals"].get(key) != val]
    return out[:limit]
