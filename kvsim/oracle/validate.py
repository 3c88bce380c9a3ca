"""``kvsim validate --against vllm-scheduler``: a scenario's requests through vLLM's own Scheduler.

kvsim runs the scenario first; each request's join step (the step index at which it joined)
and the drafts it accepted at each verify step are recorded. The same requests, joined at the
same step indices and accepting the same drafts, then go through ``vllm_driver.py`` inside an
oracle environment (``make_env.sh``) and through kvsim's scheduler with the driver's loop
(``replay.drive``); the two results are compared field by field.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path

from kvsim import engine
from kvsim.assemble import acceptance_for
from kvsim.errors import ConfigError
from kvsim.oracle.replay import REQUEST_FIELDS, drive
from kvsim.schema import Scenario
from kvsim.workload import build_requests

DRIVER = Path(__file__).with_name("vllm_driver.py")
# What make_env.sh leaves in an environment once it has finished it (its MARKER).
ENV_READY = ".kvsim-oracle-ok"
STEP_FIELDS = ("scheduled", "preempted", "block_ids", "num_free_blocks", "prefix_cache", "spec")


def oracle_python(version: str, given: str | None) -> Path:
    """The oracle environment's interpreter for ``version``: ``given``, else the one
    ``make_env.sh`` built and finished (its marker; one still being built, or cut off, is not
    there yet). Raises ConfigError if absent."""
    if given:
        p = Path(given)
        ready = p.exists()
    else:
        home = Path(os.environ.get("KVSIM_ORACLE_HOME", Path.home() / ".cache/kvsim/oracle"))
        env = home / f"vllm-{version}"
        p = env / "bin" / "python"
        ready = p.exists() and (env / ENV_READY).exists()
    if not ready:
        raise ConfigError(f"vLLM {version}", f"no oracle environment at {p.parent.parent} "
                          f"(build it with kvsim/oracle/make_env.sh {version}, or pass --oracle-python)")
    return p


def driver_scenario(sc: Scenario) -> dict:
    """The scenario's requests in the driver's format, joined where kvsim joined them."""
    specs = build_requests(sc)
    accept = acceptance_for(sc, record=True) if sc.speculative.enabled else None
    rec = engine.run(sc, specs, accept=accept)
    if rec.stopped_by not in (None, "stall", "engine_dead"):
        raise ConfigError(f"run.{rec.stopped_by}", "validation needs a run that is not cut short")
    e, s = sc.engine, sc.speculative
    eng = {k: getattr(e, k) for k in (
        "block_size", "num_gpu_blocks", "enable_prefix_caching", "max_num_batched_tokens",
        "max_num_seqs", "max_model_len", "enable_chunked_prefill", "long_prefill_token_threshold",
        "scheduling_policy", "scheduler_reserve_full_isl", "async_scheduling")}
    if s.enabled:
        eng["speculative"] = {"method": s.method, "num_speculative_tokens": s.num_speculative_tokens,
                              **{k: True for k in ("disable_eagle_block_drop",
                                                   "disable_lookahead_block_hashes",
                                                   "parallel_drafting") if getattr(s, k)}}
        if s.method == "mtp" and sc.model.num_nextn_predict_layers > 1:  # multi-module MTP
            eng["speculative"]["mtp_num_layers"] = sc.model.num_nextn_predict_layers
    if e.kv_groups:
        # The layout as kvsim resolved it (a model's own included): each group's spec, the
        # Mamba mode and the checkpoint retention the run used.
        eng["kv_groups"] = [{"kind": g.kind, "block_size": g.block_size, "eagle": g.eagle,
                             **({"sliding_window": g.sliding_window}
                                if g.kind == "sliding_window" else {}),
                             **({"prefill_checkpoint_alignment": g.prefill_checkpoint_alignment}
                                if g.prefill_checkpoint_alignment is not None else {})}
                            for g in e.kv_groups]
        if any(g.kind == "mamba" for g in e.kv_groups):
            eng["mamba_cache_mode"] = e.mamba_cache_mode
        eng["prefix_cache_retention_interval"] = e.prefix_cache_retention_interval
    requests = []
    for r in rec.requests:
        if r.join_step is None:
            continue  # never joined (the run stalled before it arrived)
        row = {"req_id": r.req_id, "prompt_token_ids": list(r.prompt.window(0, r.num_prompt_tokens)),
               "max_tokens": r.max_tokens, "priority": r.priority, "arrival_time": r.arrival_s,
               "join_step": r.join_step, "output_token_id": r.output_token_id}
        if accept is not None:
            row["accepted"] = (accept.log or {}).get(r.seq) or [0]
        requests.append(row)
    return {"engine": eng, "requests": requests}


def run_oracle(python: Path, scenario: dict) -> dict:
    """One scenario through vLLM's Scheduler. Raises ConfigError on any oracle failure."""
    with tempfile.TemporaryDirectory() as tmp:
        inp, out = Path(tmp) / "in.json", Path(tmp) / "out.json"
        inp.write_text(json.dumps(scenario))
        proc = subprocess.run([str(python), str(DRIVER), str(inp), str(out)],
                              capture_output=True, text=True)
        if not out.exists():
            last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            raise ConfigError("oracle", f"vLLM's driver failed (exit {proc.returncode}): {last}")
        result = json.loads(out.read_text())
    if "error" in result and "engine_dead" not in result and "stall" not in result:
        # (vLLM's own deadlock or engine death is a result, compared up to where it happened)
        raise ConfigError("oracle", f"vLLM could not run the scenario: {result['error']}")
    return result


def agreement(kvsim: dict, vllm: dict) -> list[tuple[str, int, int, list[str]]]:
    """Per field: (field, matches, total, first mismatches)."""
    rows = []
    reqs = vllm["requests"]
    for f in REQUEST_FIELDS:
        bad = [f"{rid}: kvsim {kvsim['requests'].get(rid, {}).get(f)} vllm {v.get(f)}"
               for rid, v in reqs.items() if kvsim["requests"].get(rid, {}).get(f) != v.get(f)]
        rows.append((f"request.{f}", len(reqs) - len(bad), len(reqs), bad[:3]))
    ksteps, vsteps = kvsim["steps"], vllm["steps"]
    n = max(len(ksteps), len(vsteps))
    for f in STEP_FIELDS:
        if not vsteps or f not in vsteps[0]:
            continue
        bad = []
        for i in range(n):
            a = ksteps[i].get(f) if i < len(ksteps) else None
            b = vsteps[i].get(f) if i < len(vsteps) else None
            if f == "scheduled" and a is not None and b is not None:
                a, b = list(a.items()), list(b.items())
            if a != b:
                bad.append(f"step {i}: kvsim {a} vllm {b}")
        rows.append((f"step.{f}", n - len(bad), n, bad[:3]))
    vstall = (vllm.get("stall") or {}).get("step")  # (the driver's record; kvsim's is a step)
    if kvsim.get("stall") is not None or vstall is not None:
        same = kvsim.get("stall") == vstall
        rows.append(("stall", int(same), 1, [] if same else [
            f"deadlock at step: kvsim {kvsim.get('stall')} vllm {vstall}"]))
    if kvsim.get("engine_dead") or vllm.get("engine_dead"):
        same = kvsim.get("engine_dead") == vllm.get("engine_dead")
        rows.append(("engine_dead", int(same), 1, [] if same else [
            f"kvsim {kvsim.get('engine_dead')} vllm {vllm.get('engine_dead')}"]))
    same = kvsim["free_queue_end"] == vllm["free_queue_end"]
    rows.append(("free_queue_end", int(same), 1, [] if same else ["final free-queue order differs"]))
    return rows


def validate(sc: Scenario, version: str | None, python: str | None) -> tuple[list, dict]:
    version = version or sc.engine.vllm_version
    if version != sc.engine.vllm_version:
        raise ConfigError("--vllm", f"{version} differs from the scenario's engine.vllm_version "
                          f"({sc.engine.vllm_version}); set the scenario's version")
    scenario = driver_scenario(sc)
    vllm = run_oracle(oracle_python(version, python), scenario)
    return agreement(drive(scenario, version, check_invariants=False), vllm), scenario


def table(rows) -> str:
    width = max(len(r[0]) for r in rows)
    lines = [f"{'field':<{width}}  matches"]
    for field, ok, total, bad in rows:
        lines.append(f"{field:<{width}}  {ok}/{total}")
        lines.extend(f"{'':<{width}}    {b[:160]}" for b in bad)
    return "\n".join(lines)
