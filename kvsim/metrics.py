"""Turn run records into result files: requests.csv, steps.csv, summary.json.

Everything here reads ``Records`` and writes text; numbers are formatted deterministically, so
the same scenario and seed give byte-identical files.
"""

from __future__ import annotations

import csv
import io
import json
from dataclasses import asdict, fields

import numpy as np

from kvsim import __version__
from kvsim.config import Scenario, resolved_toml
from kvsim.engine import Records, StepRecord

REQUEST_COLUMNS = ("req_id", "arrival_s", "prompt_tokens", "output_tokens", "cached_tokens",
                   "num_preemptions", "join_step", "first_scheduled_step", "first_token_step",
                   "finish_step", "ttft_s", "tpot_s", "e2e_s")


def _fmt(v) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.9g}"
    return str(v)


def request_rows(rec: Records) -> list[dict]:
    """One dict per request (a cluster run adds its ``replica``)."""
    rows = []
    for r in rec.requests:
        ttft = None if r.first_token_s is None else r.first_token_s - r.arrival_s
        e2e = None if r.finish_s is None else r.finish_s - r.arrival_s
        tpot = None
        if r.finish_s is not None and r.num_output_tokens > 1:
            tpot = (r.finish_s - r.first_token_s) / (r.num_output_tokens - 1)
        rows.append({
            "req_id": r.req_id, "arrival_s": r.arrival_s, "prompt_tokens": r.num_prompt_tokens,
            "output_tokens": r.num_output_tokens, "cached_tokens": r.cached_tokens,
            "num_preemptions": r.num_preemptions, "join_step": r.join_step,
            "first_scheduled_step": r.first_scheduled_step, "first_token_step": r.first_token_step,
            "finish_step": r.finish_step, "ttft_s": ttft, "tpot_s": tpot, "e2e_s": e2e,
        })
        if rec.replicas is not None:
            rows[-1]["replica"] = r.replica
    return rows


def _csv(columns, rows) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(columns)
    for row in rows:
        w.writerow([_fmt(row[c]) for c in columns])
    return buf.getvalue()


def requests_csv(rec: Records) -> str:
    cluster = ("replica",) if rec.replicas is not None else ()
    return _csv(REQUEST_COLUMNS + cluster, request_rows(rec))


def steps_csv(rec: Records) -> str:
    """One row per step; a cluster run's rows start with the replica, replica by replica."""
    columns = tuple(f.name for f in fields(StepRecord))
    if rec.replicas is None:
        return _csv(columns, (asdict(s) for s in rec.steps))
    return _csv(("replica", *columns), ({"replica": i, **asdict(s)}
                                         for i, r in enumerate(rec.replicas) for s in r.steps))


def _dist(values: list[float]) -> dict | None:
    if not values:
        return None
    a = np.asarray(values, dtype=float)
    p50, p90, p99 = np.percentile(a, [50, 90, 99])
    return {"p50": float(p50), "p90": float(p90), "p99": float(p99), "mean": float(a.mean()),
            "count": len(values)}


def summarize(sc: Scenario, rec: Records) -> dict:
    rows = request_rows(rec)
    finished = [r for r in rows if r["finish_step"] is not None]
    steps = rec.steps
    queries = sum(s.prefix_cache_queries for s in steps)
    hits = sum(s.prefix_cache_hits for s in steps)
    out_tokens = sum(r.num_output_tokens for r in rec.requests)
    prompt_tokens = sum(r["prompt_tokens"] for r in finished)
    span = rec.end_s
    usage = [s.kv_usage for s in steps]
    admitted = [r["cached_tokens"] for r in rows if r["cached_tokens"] is not None]
    e = sc.engine
    return {
        "kvsim_version": __version__,
        "vllm_version": e.vllm_version,
        "model": sc.model.name,
        "hardware": sc.hardware.name,
        "cost_model": rec.cost_label,
        "seed": sc.run.seed,
        "num_requests": len(rows),
        "num_finished": len(finished),
        "stopped_by": rec.stopped_by,
        "num_steps": len(steps),
        "sim_time_s": span,
        "num_gpu_blocks": e.num_gpu_blocks,
        "num_gpu_blocks_derived": e.num_gpu_blocks_derived,
        "block_size": e.block_size,
        "prefix_cache_queries": queries,
        "prefix_cache_hits": hits,
        "prefix_cache_hit_rate": hits / queries if queries else None,
        "preempted_prefix_cache_queries": sum(s.preempted_prefix_cache_queries for s in steps),
        "preempted_prefix_cache_hits": sum(s.preempted_prefix_cache_hits for s in steps),
        "cached_tokens_mean": float(np.mean(admitted)) if admitted else None,
        "num_preemptions": sum(r.num_preemptions for r in rec.requests),
        "ttft_s": _dist([r["ttft_s"] for r in rows if r["ttft_s"] is not None]),
        "tpot_s": _dist([r["tpot_s"] for r in rows if r["tpot_s"] is not None]),
        "e2e_s": _dist([r["e2e_s"] for r in finished]),
        "throughput": {
            "requests_per_s": len(finished) / span if span else None,
            "output_tokens_per_s": out_tokens / span if span else None,
            "total_tokens_per_s": (out_tokens + prompt_tokens) / span if span else None,
        },
        "kv_usage": {"mean": float(np.mean(usage)) if usage else 0.0,
                     "max": float(max(usage)) if usage else 0.0},
        "spec_decode": _spec_summary(sc, rec),
        **_cluster_summary(sc, rec),
    }


# Keys of a run's summary that say nothing of one replica in particular.
_RUN_KEYS = ("kvsim_version", "vllm_version", "model", "hardware", "cost_model", "seed")


def _cluster_summary(sc: Scenario, rec: Records) -> dict:
    """A cluster run: the router and, per replica, the summary of its own requests and steps."""
    if rec.replicas is None:
        return {}
    c = sc.cluster
    per = []
    for i, r in enumerate(rec.replicas):
        s = summarize(sc.replica(i), r)
        per.append({"replica": i, **{k: v for k, v in s.items() if k not in _RUN_KEYS}})
    return {"cluster": {"replicas": c.replicas, "router": c.router, "load_metric": c.load_metric,
                        "load_weight": c.load_weight,
                        "num_gpu_blocks_total": sum(e.num_gpu_blocks for e in c.engines)},
            "replicas": per}


def _spec_summary(sc: Scenario, rec: Records) -> dict | None:
    """vLLM's spec-decode counters: drafts, accepted drafts, mean acceptance length."""
    if not sc.speculative.enabled:
        return None
    drafts = sum(r.num_drafts_proposed for r in rec.requests)
    accepted = sum(r.num_drafts_accepted for r in rec.requests)
    verifies = sum(r.num_verify_steps for r in rec.requests)
    return {
        "method": sc.speculative.method,
        "num_speculative_tokens": sc.speculative.num_speculative_tokens,
        "num_drafts": drafts,
        "num_accepted_tokens": accepted,
        "acceptance_rate": accepted / drafts if drafts else None,
        "mean_acceptance_length": 1 + accepted / verifies if verifies else None,
        # vLLM's per-position counters: position i accepted, of all verify steps.
        "num_accepted_tokens_per_pos": rec.accepted_per_pos,
        "acceptance_rate_per_pos": [a / verifies for a in rec.accepted_per_pos] if verifies else None,
        "draft_time_s": sum(s.draft_s for s in rec.steps),
    }


def result_files(sc: Scenario, rec: Records, summary: dict) -> dict[str, str]:
    """A run folder's files (``kvsim.results.RESULT_FILES``) as text."""
    return {"requests.csv": requests_csv(rec), "steps.csv": steps_csv(rec),
            "summary.json": summary_json(summary), "scenario.resolved.toml": resolved_toml(sc)}


def summary_json(summary: dict) -> str:
    return json.dumps(summary, indent=2) + "\n"


def summary_table(summary: dict, out_dir: str | None = None) -> str:
    """A short human-readable table for the terminal."""
    s = summary
    stop = {None: "", "stall": " (vLLM deadlocks here: the head of the waiting queue can never "
            "be admitted and nothing runs)"}.get(s["stopped_by"], f" (stopped by {s['stopped_by']})")
    lines = [
        f"kvsim {s['kvsim_version']} · vLLM {s['vllm_version']} semantics · {s['model']} on "
        f"{s['hardware']} · cost model: {s['cost_model']}",
        f"requests      {s['num_finished']} finished of {s['num_requests']}{stop}; "
        f"{s['num_steps']} steps; {s['sim_time_s']:.3f} s simulated",
    ]
    if s["prefix_cache_queries"]:
        lines.append(f"prefix cache  {s['prefix_cache_hits']:,} hit of {s['prefix_cache_queries']:,} "
                     f"queried tokens ({100 * s['prefix_cache_hit_rate']:.1f} %); "
                     f"mean cached tokens per request {s['cached_tokens_mean']:.1f}")
    else:
        lines.append("prefix cache  off (no lookups)")
    lines.append(f"preemptions   {s['num_preemptions']}")
    sd = s.get("spec_decode")
    if sd and sd["acceptance_rate"] is not None:
        lines.append(f"spec decode   {sd['method']} k={sd['num_speculative_tokens']}: "
                     f"{100 * sd['acceptance_rate']:.1f} % of drafts accepted, mean acceptance "
                     f"length {sd['mean_acceptance_length']:.2f}; drafter "
                     f"{sd['draft_time_s']:.3f} s of the run")
    lines.append(f"{'':14}{'p50':>10}{'p90':>10}{'p99':>10}{'mean':>10}")
    for key, label, scale in (("ttft_s", "TTFT ms", 1e3), ("tpot_s", "TPOT ms", 1e3),
                              ("e2e_s", "E2E s", 1.0)):
        d = s[key]
        if d is None:
            lines.append(f"{label:14}{'-':>10}")
            continue
        # A space before every value keeps columns apart past 10 characters (queued runs).
        lines.append(f"{label:14}" + "".join(f" {d[q] * scale:>9.2f}" for q in ("p50", "p90", "p99", "mean")))
    t = s["throughput"]
    if t["requests_per_s"] is not None:
        lines.append(f"throughput    {t['requests_per_s']:.2f} req/s, "
                     f"{t['output_tokens_per_s']:.1f} output tok/s")
    derived = " (derived from memory; set engine.num_gpu_blocks to pin it)"
    lines.append(f"KV usage      mean {100 * s['kv_usage']['mean']:.1f} %, max "
                 f"{100 * s['kv_usage']['max']:.1f} % of {s['num_gpu_blocks'] - 1} usable blocks"
                 f"{derived if s['num_gpu_blocks_derived'] else ''}")
    if "cluster" in s:
        c = s["cluster"]
        lines.append(f"cluster       {c['replicas']} replicas, router {c['router']}")
        lines.append(f"{'  replica':14}{'requests':>10}{'hit %':>10}{'TTFT p50':>10}{'TTFT p99':>10}"
                     f"{'KV mean %':>10}")
        for r in s["replicas"]:
            t = r["ttft_s"]
            hit = r["prefix_cache_hit_rate"]
            lines.append(f"{'  ' + str(r['replica']):14}{r['num_requests']:>10}"
                         + (f" {100 * hit:>9.1f}" if hit is not None else f"{'-':>10}")
                         + (f" {1e3 * t['p50']:>9.2f} {1e3 * t['p99']:>9.2f}" if t else f"{'-':>10}" * 2)
                         + f" {100 * r['kv_usage']['mean']:>9.1f}")
    if out_dir:
        lines.append(f"results in    {out_dir}")
    return "\n".join(lines)
