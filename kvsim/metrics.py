"""Turn run records into result files: requests.csv, steps.csv, summary.json.

Everything here reads ``Records`` and writes text; numbers are formatted deterministically, so
the same scenario and seed give byte-identical files.
"""

from __future__ import annotations

import csv
import io
import itertools
import json
import math
from array import array
from dataclasses import fields
from operator import attrgetter

import numpy as np

from kvsim import __version__
from kvsim.engine import Records, StepRecord
from kvsim.model import GiB
from kvsim.scenario_text import resolved_toml
from kvsim.schema import SCHEMA, Scenario

REQUEST_COLUMNS = ("req_id", "arrival_s", "prompt_tokens", "output_tokens", "cached_tokens",
                   "external_cached_tokens", "num_preemptions", "join_step", "first_scheduled_step",
                   "first_token_step", "finish_step", "ttft_s", "tpot_s", "e2e_s", "queue_s",
                   "prefill_s")


_COLUMN = {name: i for i, name in enumerate(REQUEST_COLUMNS)}
# A P/D cluster's requests also say where their prefill ran (empty: the decode instance
# alone), its hit there, and when it finished there (seconds after arrival).
PD_REQUEST_COLUMNS = ("prefill_replica", "prefill_cached_tokens", "prefill_done_s")


def _fmt(v) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.9g}"
    return str(v)


def _request_values(r) -> list:
    """A request's row of requests.csv, in ``REQUEST_COLUMNS`` order: queue time (arrival to
    its first step's start) and prefill time (to its first token) add up to its TTFT."""
    def since(t: float | None, t0: float | None) -> float | None:
        return None if t is None or t0 is None else t - t0
    tpot = None
    if r.finish_s is not None and r.first_token_s is not None and r.num_output_tokens > 1:
        tpot = (r.finish_s - r.first_token_s) / (r.num_output_tokens - 1)
    return [r.req_id, r.arrival_s, r.num_prompt_tokens, r.num_output_tokens, r.cached_tokens,
            r.external_cached_tokens if r.cached_tokens is not None else None, r.num_preemptions,
            r.join_step, r.first_scheduled_step, r.first_token_step,
            r.finish_step, since(r.first_token_s, r.arrival_s), tpot,
            since(r.finish_s, r.arrival_s), since(r.first_scheduled_s, r.arrival_s),
            since(r.first_token_s, r.first_scheduled_s)]


def request_rows(rec: Records) -> list[dict]:
    """One dict per request (a cluster run adds its ``replica``)."""
    rows = []
    for r in rec.requests:
        rows.append(dict(zip(REQUEST_COLUMNS, _request_values(r))))
        if rec.replicas is not None:
            rows[-1]["replica"] = r.replica
    return rows


STEP_COLUMNS = tuple(f.name for f in fields(StepRecord))
# Step fields are numbers, never None: the float ones written as _fmt writes them (``.9g``; an
# int there, as a clock may start at 0, comes out the same), the ints as str() does (%d).
_STEP_LINE = ",".join("%.9g" if f.type == "float" else "%d" for f in fields(StepRecord)) + "\n"
_step_fields = attrgetter(*STEP_COLUMNS)


class Results:
    """Writes requests.csv and steps.csv as records come and keeps what the summary needs.

    Steps come in step order; requests in any order, each once it is final (finished, or
    left at the end of the run): rows are written in workload order (``Request.seq`` from 0),
    each as soon as every earlier one is. ``requests_out`` / ``steps_out`` are text streams.
    A run held in memory (``Records``, a cluster's too: ``replicas`` adds the replica
    columns) goes through the same class, so a streamed run and an in-memory one give the
    same bytes and the same summary.
    """

    def __init__(self, requests_out, steps_out, replicas: bool = False, dp: bool = False,
                 pd: bool = False):
        # Engine columns: a cluster's or data-parallel run's replica, and with data parallel
        # the rank; a P/D cluster's requests also their prefill (PD_REQUEST_COLUMNS).
        engine = (("replica",) if replicas else ()) + (("dp_rank",) if dp else ())
        self._req = csv.writer(requests_out, lineterminator="\n")
        self._req.writerow(REQUEST_COLUMNS + engine + (PD_REQUEST_COLUMNS if pd else ()))
        self._replicas, self._dp, self._pd = replicas, dp, pd
        self._steps = steps_out
        # (a summary's pass formats no rows)
        self._write_steps, self._write_requests = steps_out is not _Discard, requests_out is not _Discard
        steps_out.write(",".join(engine + STEP_COLUMNS) + "\n")
        self._pending: dict[int, object] = {}
        self._next_seq = 0
        self.num_requests = self.num_finished = self.num_preemptions = self.num_warmups = 0
        self.output_tokens = self.finished_prompt_tokens = 0
        self.drafts = self.accepted = self.verifies = 0
        self.cached = array("q")  # cached_tokens of the requests that were admitted
        self.external_cached = 0  # of those, loaded by a KV connector
        self.ttft, self.tpot, self.e2e = array("d"), array("d"), array("d")
        self.queue = array("d")  # queue_s of the requests that were scheduled, in workload order
        self.last_arrival_s = 0.0
        self.num_steps = 0
        self.queries = self.hits = self.preempted_queries = self.preempted_hits = 0
        self.usage = array("d")
        self.draft_s: float = 0

    def step(self, s: StepRecord, replica: int | None = None, dp_rank: int | None = None) -> None:
        if self._write_steps:
            if self._replicas:
                self._steps.write(f"{replica},")
            if self._dp:
                self._steps.write(f"{_fmt(dp_rank)},")
            self._steps.write(_STEP_LINE % _step_fields(s))
        self.num_steps += 1
        self.queries += s.prefix_cache_queries
        self.hits += s.prefix_cache_hits
        self.preempted_queries += s.preempted_prefix_cache_queries
        self.preempted_hits += s.preempted_prefix_cache_hits
        self.usage.append(s.kv_usage)
        self.draft_s += s.draft_s

    def request(self, r) -> None:
        """A final request of a streamed run (written once every earlier one is)."""
        if r.seq != self._next_seq:
            self._pending[r.seq] = r
            return
        self.write_request(r)
        self._next_seq += 1
        while self._next_seq in self._pending:
            self.write_request(self._pending.pop(self._next_seq))
            self._next_seq += 1

    def write_request(self, r) -> None:
        """Write ``r``'s row now and count it."""
        row = _request_values(r)
        if self._write_requests:
            self._req.writerow(
                [_fmt(v) for v in row] + ([_fmt(r.replica)] if self._replicas else [])
                + ([_fmt(r.dp_rank)] if self._dp else [])
                + ([_fmt(v) for v in (r.prefill_replica, r.prefill_cached_tokens,
                                      None if r.prefill_done_s is None
                                      else r.prefill_done_s - r.arrival_s)]
                   if self._pd else []))
        if r.warmup:  # a benchmark client's warm-up: run, listed, not measured
            self.num_warmups += 1
            return
        self.num_requests += 1
        ttft, tpot, e2e, queue = (row[_COLUMN[k]] for k in ("ttft_s", "tpot_s", "e2e_s", "queue_s"))
        self.last_arrival_s = max(self.last_arrival_s, r.arrival_s)
        if queue is not None:
            self.queue.append(queue)
        if r.finish_step is not None:
            self.num_finished += 1
            self.finished_prompt_tokens += r.num_prompt_tokens
            self.e2e.append(e2e)
        if r.cached_tokens is not None:
            self.cached.append(r.cached_tokens)
            self.external_cached += r.external_cached_tokens
        if ttft is not None:
            self.ttft.append(ttft)
        if tpot is not None:
            self.tpot.append(tpot)
        self.output_tokens += r.num_output_tokens
        self.num_preemptions += r.num_preemptions
        self.drafts += r.num_drafts_proposed
        self.accepted += r.num_drafts_accepted
        self.verifies += r.num_verify_steps

    def summary(self, sc: Scenario, rec: Records) -> dict:
        """summary.json's content, once every step and request went through (``rec``: the
        run's end, stop reason, cost label and acceptance counters)."""
        if self._pending:
            raise ValueError(f"request {self._next_seq} never went through")
        span = rec.end_s - rec.benchmark_start_s  # a benchmark client's measured run
        queries, hits = self.queries, self.hits
        e = sc.engine
        return {
            "kvsim_version": __version__,
            "vllm_version": e.vllm_version,
            "model": sc.model.name,
            "hardware": sc.hardware.name,
            "cost_model": rec.cost_label,
            "seed": sc.run.seed,
            "num_requests": self.num_requests,
            "num_finished": self.num_finished,
            **({"num_warmups": self.num_warmups,
                "benchmark_start_s": rec.benchmark_start_s} if sc.workload.client else {}),
            "stopped_by": rec.stopped_by,
            "stop_detail": rec.stop_detail,
            "num_steps": self.num_steps,
            "sim_time_s": span,
            "num_gpu_blocks": e.num_gpu_blocks,
            "num_gpu_blocks_derived": e.num_gpu_blocks_derived,
            "block_size": e.block_size,
            "kv_layout": kv_layout_line(e),
            "prefix_cache_queries": queries,
            "prefix_cache_hits": hits,
            "prefix_cache_hit_rate": hits / queries if queries else None,
            "preempted_prefix_cache_queries": self.preempted_queries,
            "preempted_prefix_cache_hits": self.preempted_hits,
            "cached_tokens_mean": float(np.mean(self.cached)) if self.cached else None,
            "num_preemptions": self.num_preemptions,
            "ttft_s": _dist(self.ttft),
            "tpot_s": _dist(self.tpot),
            "queue_s": _dist(self.queue),
            "last_arrival_s": self.last_arrival_s,
            "over_capacity": over_capacity(self.queue),
            "e2e_s": _dist(self.e2e),
            "throughput": {
                "requests_per_s": self.num_finished / span if span else None,
                "output_tokens_per_s": self.output_tokens / span if span else None,
                "total_tokens_per_s": ((self.output_tokens + self.finished_prompt_tokens) / span
                                       if span else None),
            },
            "kv_usage": {"mean": float(np.mean(self.usage)) if self.usage else 0.0,
                         "max": float(max(self.usage)) if self.usage else 0.0},
            "spec_decode": self._spec_summary(sc, rec),
            "kv_offload": self._offload_summary(sc, rec),
            **_cluster_summary(sc, rec),
        }

    def _offload_summary(self, sc: Scenario, rec: Records) -> dict | None:
        """The CPU offload tier under vLLM's metric names (external_prefix_cache_*,
        prompt_tokens_cached_by_source, kv_offload_*), summed over a cluster's engines."""
        parts = [r.kv_offload for r in (rec.replicas or [rec]) if r.kv_offload is not None]
        if not parts:
            return None
        c = {k: sum(p[k] for p in parts) for k in parts[0]}
        e = sc.engine
        assert e.offload is not None
        q, h = c["external_prefix_cache_queries"], c["external_prefix_cache_hits"]
        return {
            "kv_offloading_size": e.kv_offloading_size,
            "num_cpu_chunks": e.offload.num_chunks,
            "blocks_per_chunk": e.offload.blocks_per_chunk,
            "external_prefix_cache_queries": q,
            "external_prefix_cache_hits": h,
            "external_prefix_cache_hit_rate": h / q if q else None,
            "external_preempted_prefix_cache_queries": c["external_preempted_queries"],
            "external_preempted_prefix_cache_hits": c["external_preempted_hits"],
            "prompt_tokens_cached_by_source": {"device": self.hits, "host": h},
            "external_cached_tokens": self.external_cached,
            **{k: c[k] for k in ("kv_offload_load_bytes", "kv_offload_store_bytes",
                                 "kv_offload_load_time_s", "kv_offload_store_time_s")},
        }

    def _spec_summary(self, sc: Scenario, rec: Records) -> dict | None:
        """vLLM's spec-decode counters: drafts, accepted drafts, mean acceptance length."""
        if not sc.speculative.enabled:
            return None
        drafts, accepted, verifies = self.drafts, self.accepted, self.verifies
        return {
            "method": sc.speculative.method,
            "num_speculative_tokens": sc.speculative.num_speculative_tokens,
            "acceptance_model": acceptance_model(sc),
            "num_drafts": drafts,
            "num_accepted_tokens": accepted,
            "acceptance_rate": accepted / drafts if drafts else None,
            "mean_acceptance_length": 1 + accepted / verifies if verifies else None,
            # vLLM's per-position counters: position i accepted, of all verify steps.
            "num_accepted_tokens_per_pos": rec.accepted_per_pos,
            "acceptance_rate_per_pos": ([a / verifies for a in rec.accepted_per_pos]
                                        if verifies and rec.accepted_per_pos else None),
            "draft_time_s": self.draft_s,
        }


class _Discard:
    """A text stream that keeps nothing (a summary needs no files)."""

    @staticmethod
    def write(text: str) -> int:
        return len(text)


def _in_memory(rec: Records, req=None, steps=None) -> Results:
    """``rec`` through ``Results``: requests in list order, steps replica by replica."""
    cluster = rec.replicas is not None
    dp = cluster and any(r.dp_rank is not None for r in rec.replicas or ())
    res = Results(_Discard if req is None else req, _Discard if steps is None else steps,
                  cluster, dp, cluster and any(r.kv_transfer is not None for r in rec.replicas or ()))
    if rec.replicas is not None:
        for replica in rec.replicas:
            for s in replica.steps:
                res.step(s, replica.replica, replica.dp_rank)
    else:
        for s in rec.steps:
            res.step(s)
    for r in rec.requests:
        res.write_request(r)
    return res


def requests_csv(rec: Records) -> str:
    """requests.csv (a cluster run adds each request's replica)."""
    buf = io.StringIO()
    _in_memory(rec, req=buf)
    return buf.getvalue()


def steps_csv(rec: Records) -> str:
    """One row per step; a cluster run's rows start with the replica, replica by replica."""
    buf = io.StringIO()
    _in_memory(rec, steps=buf)
    return buf.getvalue()


def over_capacity(queue) -> dict | None:
    """Whether requests waited the longer the later they came (the engine fell behind its
    arrivals): mean queue time of the last quarter of the requests (workload order) over a
    second and over 5x the first quarter's; their two means, else None."""
    n = len(queue) // 4
    if n < 5:
        return None
    first, last = float(np.mean(queue[:n])), float(np.mean(queue[-n:]))
    if last > 1.0 and last > 5 * first:
        return {"first_quarter_queue_s": first, "last_quarter_queue_s": last}
    return None


def over_capacity_text(s: dict) -> str | None:
    """The summary's over-capacity finding as a clause, or None."""
    oc = s.get("over_capacity")
    if not oc:
        return None
    return (f"the engine falls behind its arrivals: requests queue {oc['first_quarter_queue_s']:.2f} s "
            f"on average in the first quarter, {oc['last_quarter_queue_s']:.2f} s in the last "
            f"(arrivals end at {s['last_arrival_s']:.0f} s, the run at {s['sim_time_s']:.0f} s)")


def _dist(values) -> dict | None:
    if not values:
        return None
    a = np.asarray(values, dtype=float)
    p50, p90, p99 = np.percentile(a, [50, 90, 99])
    return {"p50": float(p50), "p90": float(p90), "p99": float(p99), "mean": float(a.mean()),
            "count": len(values)}


def summarize(sc: Scenario, rec: Records) -> dict:
    return _in_memory(rec).summary(sc, rec)


# Keys of a run's summary that say nothing of one replica in particular.
_RUN_KEYS = ("kvsim_version", "vllm_version", "model", "hardware", "cost_model", "seed")


def _cluster_summary(sc: Scenario, rec: Records) -> dict:
    """A cluster or data-parallel run: the router and, per engine (replica, and rank with
    data parallel), the summary of its own requests and steps."""
    if rec.replicas is None:
        return {}
    per = []
    for r in rec.replicas:
        s = summarize(sc.replica(r.replica), r)
        rank = {} if r.dp_rank is None else {"dp_rank": r.dp_rank,
                                             "num_dummy_steps": r.num_dummy_steps}
        per.append({"replica": r.replica, **rank, **{k: v for k, v in s.items() if k not in _RUN_KEYS}})
    blocks = sum(int(e.num_gpu_blocks) * e.data_parallel_size for e in sc.engines)
    c = sc.cluster
    if c is None:
        e = sc.engine
        return {"data_parallel": {"data_parallel_size": e.data_parallel_size,
                                  "enable_expert_parallel": e.enable_expert_parallel,
                                  "api_server_count": e.api_server_count,
                                  "lockstep": sc.dp_lockstep,
                                  "num_gpu_blocks_total": blocks},
                "replicas": per}
    out = {"cluster": {"replicas": c.replicas, "router": c.router, "load_metric": c.load_metric,
                       "load_weight": c.load_weight, "num_gpu_blocks_total": blocks},
           "replicas": per}
    if c.disaggregated:
        out["pd"] = _pd_summary(sc, rec, per)
    return out


def _pd_summary(sc: Scenario, rec: Records, per: list[dict]) -> dict:
    """A P/D cluster: its settings, each pool (the prefill pool's requests are the proxy's
    max_tokens = 1 requests: their TTFT is the prefill's), the requests that skipped the
    prefill pool, the handover, and the decode side's NIXL counters under vLLM's names."""
    c, engines = sc.cluster, rec.replicas
    assert c is not None and engines is not None
    # (P/D instances are one engine each: an engine's index is its replica's.)
    roles = [c.engines[r.replica].kv_role for r in engines]

    def pool(role: str) -> dict:
        mine = [i for i, r in enumerate(roles) if r == role]
        reps = [per[i] for i in mine]
        recs = [engines[i] for i in mine]
        queries = sum(s["prefix_cache_queries"] for s in reps)
        hits = sum(s["prefix_cache_hits"] for s in reps)
        ttft = [q.first_token_s - q.arrival_s for r in recs for q in r.requests
                if q.first_token_s is not None]
        return {"instances": [s["replica"] for s in reps],
                "num_gpu_blocks_total": sum(sc.engines[s["replica"]].num_gpu_blocks for s in reps),
                "prefix_cache_queries": queries, "prefix_cache_hits": hits,
                "prefix_cache_hit_rate": hits / queries if queries else None,
                "num_preemptions": sum(s["num_preemptions"] for s in reps),
                "ttft_s": _dist(ttft),
                "kv_usage_mean": (float(np.mean([s["kv_usage"]["mean"] for s in reps]))
                                  if reps else 0.0)}

    consumers = [r.kv_transfer for r, role in zip(engines, roles)
                 if r.kv_transfer is not None and role == "kv_consumer"]
    times = [t for x in consumers for t in x["nixl_xfer_time_seconds"]]
    q = sum(x["external_prefix_cache_queries"] for x in consumers)
    h = sum(x["external_prefix_cache_hits"] for x in consumers)
    handover = [r.first_token_s - r.prefill_done_s for r in rec.requests
                if r.prefill_done_s is not None and r.first_token_s is not None]
    return {
        "prefill_router": c.prefill_router, "decode_router": c.router,
        "non_cached_tokens": c.non_cached_tokens, "kv_transfer_link": c.kv_transfer_link,
        "kv_transfer_bandwidth_bytes_per_s": c.kv_transfer_bandwidth_bytes_per_s,
        "kv_transfer_latency_s": c.kv_transfer_latency_s,
        "prefill_pool": pool("kv_producer"), "decode_pool": pool("kv_consumer"),
        "num_through_prefill": sum(r.prefill_replica is not None for r in rec.requests),
        "num_decode_only": sum(r.prefill_replica is None for r in rec.requests),
        # From the prefill's finish to the first token on the decode instance: the pull and
        # the recomputed last token, and the queueing on the decode side.
        "prefill_to_first_token_s": _dist(handover),
        "external_prefix_cache_queries": q, "external_prefix_cache_hits": h,
        "external_prefix_cache_hit_rate": h / q if q else None,
        "nixl_num_transfers": len(times),
        "nixl_bytes_transferred": sum(x["nixl_bytes_transferred"] for x in consumers),
        "nixl_xfer_time_seconds": _dist(times),
    }


def result_files(sc: Scenario, rec: Records, summary: dict) -> dict[str, str]:
    """A run folder's files (``kvsim.results.RESULT_FILES``) as text."""
    req, steps = io.StringIO(), io.StringIO()
    _in_memory(rec, req, steps)  # (both in one pass)
    return {"requests.csv": req.getvalue(), "steps.csv": steps.getvalue(),
            "summary.json": summary_json(summary), "scenario.resolved.toml": resolved_toml(sc)}


def kv_layout_line(e) -> str:
    """The engine's KV groups in one line: ``3 x mamba (16 layers) + full_attention (16 layers);
    block 832, mamba_cache_mode align``."""
    if not e.kv_groups:
        return f"one full-attention pool, block {e.block_size}"
    names = (g.kind + (f" {g.sliding_window}" if g.kind == "sliding_window" else "")
             + (f" ({g.num_layers} layers)" if g.num_layers else "") for g in e.kv_groups)
    runs = [(name, len(list(same))) for name, same in itertools.groupby(names)]
    groups = " + ".join(f"{n} x {name}" if n > 1 else name for name, n in runs)
    mode = f", mamba_cache_mode {e.mamba_cache_mode}" if any(g.kind == "mamba" for g in e.kv_groups) else ""
    return f"{groups}; block {e.block_size}{mode}"


def summary_json(summary: dict) -> str:
    return json.dumps(summary, indent=2) + "\n"


def acceptance_model(sc: Scenario) -> str:
    """How the run decided acceptances, in words (the default said so: it shapes every result)."""
    s = sc.speculative
    if s.acceptance == "fixed":
        return f"fixed, {s.num_accepted} accepted per verify step"
    if s.acceptance == "trace":
        return "trace, each request's accepted list"
    default = next(k.default for k in SCHEMA["speculative"] if k.name == "acceptance_rates")
    rates = ", ".join(f"{r:g}" for r in s.acceptance_rates)
    if len(s.acceptance_rates) == 1:
        return (f"per_position, {rates} at every position"
                + (" (kvsim's default: set speculative.acceptance_rates)"
                   if s.acceptance_rates == default else ""))
    return f"per_position, {rates} by position"


def time_unit(seconds: float, smallest: str = "ms") -> tuple[str, float]:
    """The unit a latency of up to ``seconds`` reads best in (no smaller than ``smallest``),
    and the scale from seconds: ms below 10 s, s below 10 minutes, else min."""
    units = [("ms", 1e3, 10.0), ("s", 1.0, 600.0), ("min", 1 / 60, math.inf)]
    for unit, scale, below in units[[u for u, _, _ in units].index(smallest):]:
        if seconds < below:
            return unit, scale
    raise AssertionError("unreachable")


def context_line(summaries: list[dict]) -> str:
    """What runs simulated, in one line: what they share, and every value where they differ."""
    def field(key: str) -> str:
        seen = list(dict.fromkeys(str(s[key]) for s in summaries))
        return seen[0] if len(seen) == 1 else " / ".join(seen) + " (varied)"
    return (f"kvsim {field('kvsim_version')} · vLLM {field('vllm_version')} semantics · "
            f"{field('model')} on {field('hardware')} · cost model: {field('cost_model')}")


def summary_table(summary: dict, out_dir: str | None = None) -> str:
    """A short human-readable table for the terminal."""
    s = summary
    stop = {None: "", "stall": " (vLLM deadlocks here: the head of the waiting queue can never "
            "be admitted and nothing runs)",
            "engine_dead": f" (vLLM's engine core dies here: {s.get('stop_detail')})"}.get(
        s["stopped_by"], f" (stopped by {s['stopped_by']})")
    lines = [
        context_line([s]),
        f"requests      {s['num_finished']} finished of {s['num_requests']}{stop}; "
        f"{s['num_steps']} steps; {s['sim_time_s']:.3f} s simulated",
    ]
    if s["prefix_cache_queries"]:
        lines.append(f"prefix cache  {s['prefix_cache_hits']:,} hit of {s['prefix_cache_queries']:,} "
                     f"queried tokens ({100 * s['prefix_cache_hit_rate']:.1f} %); "
                     f"mean cached tokens per request {s['cached_tokens_mean']:.1f}")
    else:
        lines.append("prefix cache  off (no lookups)")
    ko = s.get("kv_offload")
    if ko:
        rate = ko["external_prefix_cache_hit_rate"]
        lines.append(f"CPU offload   {ko['kv_offloading_size']:g} GiB ({ko['num_cpu_chunks']:,} chunks of "
                     f"{ko['blocks_per_chunk']} blocks): {ko['external_prefix_cache_hits']:,} hit of "
                     f"{ko['external_prefix_cache_queries']:,} tokens queried past the GPU hit"
                     + (f" ({100 * rate:.1f} %)" if rate is not None else ""))
        lines.append(f"{'':14}loaded {ko['kv_offload_load_bytes'] / GiB:.2f} GiB, stored "
                     f"{ko['kv_offload_store_bytes'] / GiB:.2f} GiB")
    lines.append(f"preemptions   {s['num_preemptions']}")
    behind = over_capacity_text(s)
    if behind:
        lines.append(f"over capacity {behind}")
    sd = s.get("spec_decode")
    if sd and sd["acceptance_rate"] is not None:
        lines.append(f"spec decode   {sd['method']} k={sd['num_speculative_tokens']}: "
                     f"{100 * sd['acceptance_rate']:.1f} % of drafts accepted, mean acceptance "
                     f"length {sd['mean_acceptance_length']:.2f}; drafter "
                     f"{sd['draft_time_s']:.3f} s of the run")
        lines.append(f"{'':14}acceptance: {sd['acceptance_model']}")
    lines.append(f"{'':14}{'p50':>10}{'p90':>10}{'p99':>10}{'mean':>10}")
    for key, name, smallest in (("ttft_s", "TTFT", "ms"), ("tpot_s", "TPOT", "ms"),
                                ("e2e_s", "E2E", "s"), ("queue_s", "queue", "ms")):
        d = s.get(key)
        if d is None:
            if key != "queue_s":
                lines.append(f"{name + ' ms':14}{'-':>10}")
            continue
        unit, scale = time_unit(d["p99"], smallest)
        # A space before every value keeps columns apart past 10 characters.
        lines.append(f"{name + ' ' + unit:14}"
                     + "".join(f" {d[q] * scale:>9.2f}" for q in ("p50", "p90", "p99", "mean")))
    t = s["throughput"]
    if t["requests_per_s"] is not None:
        lines.append(f"throughput    {t['requests_per_s']:.2f} req/s, "
                     f"{t['output_tokens_per_s']:.1f} output tok/s")
    if s.get("kv_layout"):
        lines.append(f"KV layout     {s['kv_layout']}")
    derived = " (derived from memory; set engine.num_gpu_blocks to pin it)"
    lines.append(f"KV usage      mean {100 * s['kv_usage']['mean']:.1f} %, max "
                 f"{100 * s['kv_usage']['max']:.1f} % of {s['num_gpu_blocks'] - 1} usable blocks"
                 f"{derived if s['num_gpu_blocks_derived'] else ''}")
    if "cluster" in s or "data_parallel" in s:
        pd = s.get("pd")
        if pd:
            n_p, n_d = len(pd["prefill_pool"]["instances"]), len(pd["decode_pool"]["instances"])
            lines.append(f"P/D           {n_p} prefill + {n_d} decode instances (NixlConnector), "
                         f"routers {pd['prefill_router']} / {pd['decode_router']}; "
                         f"{pd['num_decode_only']} of {s['num_requests']} requests decode-only")
            x = pd["nixl_xfer_time_seconds"]
            lines.append(f"{'':14}pulled {pd['nixl_bytes_transferred'] / GiB:.2f} GiB in "
                         f"{pd['nixl_num_transfers']:,} reads over {pd['kv_transfer_link']}"
                         + (f", read p50 {1e3 * x['p50']:.2f} ms, p99 {1e3 * x['p99']:.2f} ms"
                            if x else "")
                         + f"; decode-side hits {pd['decode_pool']['prefix_cache_hits']:,} tokens")
            pools = (("prefill", pd["prefill_pool"]), ("decode", pd["decode_pool"]))
            unit, scale = time_unit(max((p["ttft_s"]["p99"] for _, p in pools if p["ttft_s"]),
                                        default=0.0))
            lines.append(f"{'  pool (' + unit + ')':14}{'instances':>10}{'hit %':>10}{'TTFT p50':>10}"
                         f"{'TTFT p99':>10}{'KV mean %':>10}")
            for name, p in pools:
                t, hit = p["ttft_s"], p["prefix_cache_hit_rate"]
                lines.append(f"{'  ' + name:14}{len(p['instances']):>10}"
                             + (f" {100 * hit:>9.1f}" if hit is not None else f"{'-':>10}")
                             + (f" {scale * t['p50']:>9.2f} {scale * t['p99']:>9.2f}" if t
                                else f"{'-':>10}" * 2)
                             + f" {100 * p['kv_usage_mean']:>9.1f}")
        if "cluster" in s:
            c = s["cluster"]
            lines.append(f"cluster       {c['replicas']} replicas, router {c['router']}")
        else:
            d = s["data_parallel"]
            lines.append(f"data parallel {d['data_parallel_size']} ranks behind vLLM's DP load balancer "
                         f"({d['api_server_count']} API server{'s' if d['api_server_count'] > 1 else ''}), "
                         + ("in lockstep (MoE)" if d["lockstep"] else "stepping independently")
                         + (", expert parallel" if d["enable_expert_parallel"] else ""))
        unit, scale = time_unit(max((r["ttft_s"]["p99"] for r in s["replicas"] if r["ttft_s"]),
                                    default=0.0))
        lines.append(f"{'  replica (' + unit + ')':14}{'requests':>10}{'hit %':>10}{'TTFT p50':>10}"
                     f"{'TTFT p99':>10}{'KV mean %':>10}")
        for r in s["replicas"]:
            t = r["ttft_s"]
            hit = r["prefix_cache_hit_rate"]
            name = str(r["replica"]) + (f" rank {r['dp_rank']}" if "dp_rank" in r else "")
            lines.append(f"{'  ' + name:14}{r['num_requests']:>10}"
                         + (f" {100 * hit:>9.1f}" if hit is not None else f"{'-':>10}")
                         + (f" {scale * t['p50']:>9.2f} {scale * t['p99']:>9.2f}" if t
                            else f"{'-':>10}" * 2)
                         + f" {100 * r['kv_usage']['mean']:>9.1f}")
    if out_dir:
        lines.append(f"results in    {out_dir}")
    return "\n".join(lines)
