#!/usr/bin/env python3
"""Drive vLLM's real v1 Scheduler on CPU with fake model outputs (the oracle).

Standalone: imports only vllm, torch and the standard library, never kvsim.

    /path/to/oracle-venv/bin/python kvsim/oracle/vllm_driver.py IN.json OUT.json

IN.json holds either one scenario, {"engine": {...}, "requests": [...]}, or a
JSON list of scenarios. For a list, OUT.json is the list of results in the same
order, all computed in one process: importing vLLM takes seconds, while
building a scheduler takes milliseconds. The exit status is 0 when every
scenario ran to completion, 1 when any result carries "error", and 2 on bad
usage.

Input schema (every engine key is optional; the defaults are below):
  engine: block_size, num_gpu_blocks (pool size; block 0 is vLLM's null block),
          enable_prefix_caching, max_num_batched_tokens, max_num_seqs,
          max_model_len, enable_chunked_prefill, long_prefill_token_threshold,
          scheduling_policy ("fcfs" | "priority"), scheduler_reserve_full_isl
  requests[]: req_id, prompt_token_ids, max_tokens, priority (default 0),
          arrival_time (default 0.0), join_step (default 0),
          output_token_id (default -1: the token every sampling step returns)

Drive loop: see drive(). The output schema is documented in drive()'s
docstring.

The script re-executes itself with PYTHONHASHSEED=0 unless that is already
set, so NONE_HASH, and with it every block hash, is the same in every run.
Tested against vLLM 0.33.0. Older releases are handled by inspecting
signatures, but that path has not been tested.
"""

from __future__ import annotations

import json
import os
import sys
import time

if __name__ == "__main__" and os.environ.get("PYTHONHASHSEED") != "0":
    _env = dict(os.environ, PYTHONHASHSEED="0")
    _argv = [sys.executable, os.path.abspath(__file__), *sys.argv[1:]]
    os.execve(sys.executable, _argv, _env)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("DO_NOT_TRACK", "1")

import atexit  # noqa: E402
import dataclasses  # noqa: E402
import inspect  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402

import torch  # noqa: E402
import vllm  # noqa: E402
from vllm.config import (  # noqa: E402
    CacheConfig,
    DeviceConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.core import kv_cache_utils  # noqa: E402
from vllm.v1.core.kv_cache_utils import (  # noqa: E402
    get_request_block_hasher,
    init_none_hash,
)
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
)
from vllm.v1.outputs import ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

try:  # 0.33: vllm.utils.hashing; older: vllm.utils
    from vllm.utils.hashing import get_hash_fn_by_name  # noqa: E402
except ImportError:  # pragma: no cover
    from vllm.utils import get_hash_fn_by_name  # type: ignore  # noqa: E402

VLLM_VERSION = str(getattr(vllm, "__version__", "unknown"))
WITH_TIMING = os.environ.get("KVSIM_ORACLE_TIMING") == "1"

# A tiny Llama config. Only config.json is written: there are no weights and no
# tokenizer (skip_tokenizer_init=True).
_TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "num_hidden_layers": 1,
    "vocab_size": 32000,
    "max_position_embeddings": 1 << 20,
    "rms_norm_eps": 1e-5,
    "hidden_act": "silu",
    "torch_dtype": "float32",
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}

ENGINE_DEFAULTS = {
    "block_size": 16,
    "num_gpu_blocks": 64,
    "enable_prefix_caching": True,
    "max_num_batched_tokens": 2048,
    "max_num_seqs": 256,
    "max_model_len": 4096,
    "enable_chunked_prefill": True,
    "long_prefill_token_threshold": 0,
    "scheduling_policy": "fcfs",
    "scheduler_reserve_full_isl": True,
}

_MODEL_DIR: str | None = None


def _model_dir() -> str:
    global _MODEL_DIR
    if _MODEL_DIR is None:
        d = tempfile.mkdtemp(prefix="kvsim-oracle-llama-")
        atexit.register(shutil.rmtree, d, True)
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(_TINY_LLAMA, f)
        _MODEL_DIR = d
    return _MODEL_DIR


def _accepted_params(fn) -> set[str] | None:
    """Parameter names fn (or a class constructor) accepts; None if any."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # pragma: no cover
        return None
    if any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values()):
        return None
    return set(sig.parameters)


def _call_filtered(fn, kwargs: dict, dropped: list[str], what: str):
    accepted = _accepted_params(fn)
    if accepted is not None:
        for k in list(kwargs):
            if k not in accepted:
                dropped.append(f"{what}.{k}")
                del kwargs[k]
    return fn(**kwargs)


# (hash_fn, num_hash_lookahead_tokens, hash_block_size) -> block hasher.
_HASHERS: dict = {}
_NONE_HASH_FN = None


def build_scheduler(engine: dict):
    """Return (scheduler, request_block_hasher or None, warnings)."""
    e = dict(ENGINE_DEFAULTS)
    unknown = set(engine) - set(ENGINE_DEFAULTS)
    if unknown:
        raise ValueError(f"unknown engine keys: {sorted(unknown)}")
    e.update(engine)
    block_size = int(e["block_size"])
    num_blocks = int(e["num_gpu_blocks"])
    max_model_len = int(e["max_model_len"])
    dropped: list[str] = []

    model_config = ModelConfig(
        model=_model_dir(),
        skip_tokenizer_init=True,
        max_model_len=max_model_len,
        dtype="float32",
        seed=0,
    )
    scheduler_config = _call_filtered(
        SchedulerConfig,
        dict(
            max_num_seqs=int(e["max_num_seqs"]),
            max_num_batched_tokens=int(e["max_num_batched_tokens"]),
            max_model_len=max_model_len,
            is_encoder_decoder=False,
            enable_chunked_prefill=bool(e["enable_chunked_prefill"]),
            long_prefill_token_threshold=int(e["long_prefill_token_threshold"]),
            policy=str(e["scheduling_policy"]),
            scheduler_reserve_full_isl=bool(e["scheduler_reserve_full_isl"]),
            async_scheduling=False,
        ),
        dropped,
        "SchedulerConfig",
    )
    cache_config = CacheConfig(
        block_size=block_size,
        enable_prefix_caching=bool(e["enable_prefix_caching"]),
    )
    vllm_config = VllmConfig(
        model_config=model_config,
        scheduler_config=scheduler_config,
        cache_config=cache_config,
        device_config=DeviceConfig(device="cpu"),
    )
    # VllmConfig's post-init may rewrite settings. Check that the ones the
    # oracle depends on survived.
    sc = vllm_config.scheduler_config
    checks = {
        "async_scheduling": (bool(getattr(sc, "async_scheduling", False)), False),
        "enable_chunked_prefill": (
            bool(sc.enable_chunked_prefill),
            bool(e["enable_chunked_prefill"]),
        ),
        "enable_prefix_caching": (
            bool(vllm_config.cache_config.enable_prefix_caching),
            bool(e["enable_prefix_caching"]),
        ),
        "long_prefill_token_threshold": (
            int(sc.long_prefill_token_threshold),
            int(e["long_prefill_token_threshold"]),
        ),
        "max_num_batched_tokens": (
            int(sc.max_num_batched_tokens),
            int(e["max_num_batched_tokens"]),
        ),
        "max_model_len": (int(vllm_config.model_config.max_model_len), max_model_len),
        "block_size": (int(vllm_config.cache_config.block_size), block_size),
    }
    for name, (got, want) in checks.items():
        if got != want:
            raise RuntimeError(f"VllmConfig changed {name}: wanted {want}, got {got}")

    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["model.layers.0.self_attn.attn"],
                FullAttentionSpec(
                    block_size=block_size,
                    num_kv_heads=1,
                    head_size=64,
                    dtype=torch.float32,
                ),
            )
        ],
    )
    vllm_config.cache_config.num_gpu_blocks = num_blocks
    vllm_config.cache_config.num_cpu_blocks = 0

    resolve = getattr(kv_cache_utils, "resolve_kv_cache_block_sizes", None)
    if resolve is not None:
        scheduler_block_size, hash_block_size = resolve(kv_cache_config, vllm_config)
    else:  # pragma: no cover - older releases
        scheduler_block_size = hash_block_size = block_size
    sched = _call_filtered(
        Scheduler,
        dict(
            vllm_config=vllm_config,
            kv_cache_config=kv_cache_config,
            structured_output_manager=StructuredOutputManager(vllm_config),
            block_size=scheduler_block_size,
            hash_block_size=hash_block_size,
            log_stats=True,
        ),
        [],  # block sizes are optional extras in older releases
        "Scheduler",
    )

    # The request block hasher, built as EngineCore builds it.
    hasher = None
    if vllm_config.cache_config.enable_prefix_caching:
        global _NONE_HASH_FN
        hash_fn = get_hash_fn_by_name(vllm_config.cache_config.prefix_caching_hash_algo)
        if _NONE_HASH_FN is not hash_fn:
            init_none_hash(hash_fn)
            _NONE_HASH_FN = hash_fn
        lookahead = int(getattr(vllm_config, "num_hash_lookahead_tokens", 0) or 0)
        key = (hash_fn, lookahead, hash_block_size)
        hasher = _HASHERS.get(key)
        if hasher is None:
            n_params = len(inspect.signature(get_request_block_hasher).parameters)
            if n_params >= 3:
                hasher = get_request_block_hasher(hash_block_size, hash_fn, lookahead)
            else:  # pragma: no cover - 0.32 and older
                if lookahead:
                    raise RuntimeError("hash lookahead needs a newer vLLM")
                hasher = get_request_block_hasher(hash_block_size, hash_fn)
            _HASHERS[key] = hasher
    warnings = [f"engine setting not supported by this vLLM: {d}" for d in dropped]
    return sched, hasher, warnings


def _make_request(spec: dict, hasher) -> Request:
    sp = SamplingParams(max_tokens=int(spec["max_tokens"]), ignore_eos=True, temperature=0.0)
    kwargs = dict(
        request_id=str(spec["req_id"]),
        prompt_token_ids=[int(t) for t in spec["prompt_token_ids"]],
        sampling_params=sp,
        pooling_params=None,
        arrival_time=float(spec.get("arrival_time", 0.0)),
        priority=int(spec.get("priority", 0)),
        block_hasher=hasher,
    )
    accepted = _accepted_params(Request)
    if accepted is not None and "eos_token_id" in accepted:  # pragma: no cover
        kwargs["eos_token_id"] = None
    return Request(**kwargs)


def _model_runner_output(req_ids: list[str], sampled: list[list[int]]):
    kwargs: dict = dict(
        req_ids=req_ids,
        req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
        sampled_token_ids=sampled,
    )
    # Older releases have required fields with no default.
    if dataclasses.is_dataclass(ModelRunnerOutput):
        for f in dataclasses.fields(ModelRunnerOutput):
            if (
                f.init
                and f.name not in kwargs
                and f.default is dataclasses.MISSING
                and f.default_factory is dataclasses.MISSING  # type: ignore[misc]
            ):  # pragma: no cover
                kwargs[f.name] = {} if f.name.endswith("_dict") else None
    return ModelRunnerOutput(**kwargs)


_STAT_KEYS = (
    "requests",
    "queries",
    "hits",
    "preempted_requests",
    "preempted_queries",
    "preempted_hits",
)


def _prefix_stats_dict(st) -> dict:
    return {k: int(getattr(st, k, 0)) if st is not None else 0 for k in _STAT_KEYS}


def drive(scenario: dict, max_steps: int = 1_000_000) -> dict:
    """Run one scenario and return its result.

    Loop. `step` counts the schedule() calls that scheduled more than 0 tokens.
    Before each schedule() call, every not-yet-added request with
    join_step <= step is added, in input order. After schedule(), each
    scheduled request whose prompt is complete
    (num_computed_tokens >= num_tokens) samples [output_token_id]. A partial
    prefill chunk samples []. Then update_from_output runs. The loop ends when
    every request has finished.
    When everything added so far has finished and the rest would join at a
    later step, that step can never come, because idle calls do not count.
    The driver then does what an idle EngineCore would: one empty
    schedule()/update_from_output if the scheduler still holds finished ids,
    then it adds the batch with the next join_step.
    A schedule() call that schedules 0 tokens while unfinished requests
    exist is a stall: "error" and "stall" are set and the run stops.

    Output:
      vllm_version: str
      requests: {req_id: {cached_tokens, num_preemptions, first_scheduled_step,
                 first_token_step, finish_step, finish_reason,
                 num_output_tokens}}. A field is null if it never happened.
      steps: [{step, scheduled: {req_id: n}, preempted: [req_id] (sorted),
               block_ids: {req_id: [int]} (after schedule(), group 0),
               num_free_blocks, usage (both after update_from_output),
               prefix_cache: {requests, queries, hits, preempted_requests,
                              preempted_queries, preempted_hits}}]
      free_queue_end: [block ids, head to tail]
      totals: {prefix_cache_queries, prefix_cache_hits, prefix_cache_requests,
               preempted_queries, preempted_hits, preempted_requests}
      num_steps, num_schedule_calls: int
      error: str, stall: {...}, warnings: [str]   (only when they apply)
      timing: {build_s, drive_s}   (only with KVSIM_ORACLE_TIMING=1)
    """
    engine = scenario.get("engine", {})
    specs = list(scenario["requests"])
    ids = [str(s["req_id"]) for s in specs]
    if len(set(ids)) != len(ids):
        raise ValueError("duplicate req_id")

    t0 = time.perf_counter()
    sched, hasher, warnings = build_scheduler(engine)
    t_build = time.perf_counter() - t0
    kvm = sched.kv_cache_manager
    pool = kvm.block_pool

    out_tok = {str(s["req_id"]): int(s.get("output_token_id", -1)) for s in specs}
    per_req = {
        rid: {
            "cached_tokens": None,
            "num_preemptions": 0,
            "first_scheduled_step": None,
            "first_token_step": None,
            "finish_step": None,
            "finish_reason": None,
            "num_output_tokens": 0,
        }
        for rid in ids
    }
    reqs: dict[str, Request] = {}
    pending = specs  # not yet added, in input order
    finished: set[str] = set()
    steps: list[dict] = []
    totals = {
        "prefix_cache_queries": 0,
        "prefix_cache_hits": 0,
        "prefix_cache_requests": 0,
        "preempted_queries": 0,
        "preempted_hits": 0,
        "preempted_requests": 0,
    }
    error = None
    stall = None
    step = 0
    n_calls = 0
    t1 = time.perf_counter()

    def add_joined(limit: int) -> None:
        nonlocal pending
        still = []
        for s in pending:
            if int(s.get("join_step", 0)) <= limit:
                r = _make_request(s, hasher)
                reqs[r.request_id] = r
                sched.add_request(r)
            else:
                still.append(s)
        pending = still

    while True:
        add_joined(step)
        if len(finished) == len(ids):
            break
        if n_calls >= max_steps:
            error = f"max_steps ({max_steps}) exceeded"
            break

        if len(reqs) == len(finished):
            # Idle: see the docstring.
            if sched.has_requests():
                so = sched.schedule()
                n_calls += 1
                pst = _prefix_stats_dict(kvm.make_prefix_cache_stats())
                if so.total_num_scheduled_tokens != 0 or any(pst.values()):
                    error = "idle schedule() call scheduled tokens or recorded stats"
                    break
                sched.update_from_output(so, _model_runner_output([], []))
            add_joined(min(int(s.get("join_step", 0)) for s in pending))
            continue

        so = sched.schedule()
        n_calls += 1
        # Prefix-cache stats are recorded inside schedule(). Read and reset them
        # now, before make_stats() in update_from_output takes them.
        pstats = _prefix_stats_dict(kvm.make_prefix_cache_stats())
        totals["prefix_cache_queries"] += pstats["queries"]
        totals["prefix_cache_hits"] += pstats["hits"]
        totals["prefix_cache_requests"] += pstats["requests"]
        totals["preempted_queries"] += pstats["preempted_queries"]
        totals["preempted_hits"] += pstats["preempted_hits"]
        totals["preempted_requests"] += pstats["preempted_requests"]

        nst = dict(so.num_scheduled_tokens)
        preempted = sorted(so.preempted_req_ids or ())

        if so.total_num_scheduled_tokens == 0 and preempted:
            # Every candidate was preempted (possible when the victims' blocks are shared
            # with the request that needed room). Nothing ran, so this is not a step;
            # the engine simply schedules again (kvsim's engine does the same).
            sched.update_from_output(so, _model_runner_output([], []))
            continue

        if so.total_num_scheduled_tokens == 0:
            # Unfinished requests exist and nothing was scheduled. A
            # synchronous scheduler with no connector changes nothing until a
            # step runs, so this is a stall. Requests that have not joined
            # cannot join either: they are waiting for a step that never comes.
            running = [r.request_id for r in sched.running]
            waiting = [rid for rid in reqs if rid not in finished and rid not in running]
            not_joined = [str(s["req_id"]) for s in pending]
            error = (
                f"stall at step {step}: schedule() scheduled 0 tokens with "
                f"{len(reqs) - len(finished)} unfinished request(s) "
                f"(running={running}, waiting={waiting}, not_joined={not_joined}, "
                f"free_blocks={pool.get_num_free_blocks()})"
            )
            stall = {
                "step": step,
                "running": running,
                "waiting": waiting,
                "not_joined": not_joined,
                "preempted": preempted,
                "num_free_blocks": pool.get_num_free_blocks(),
                "usage": kvm.usage,
                "prefix_cache": pstats,
            }
            break

        # This call scheduled tokens: it is step number `step`.
        block_ids = {}
        req_ids = list(nst)
        sampled = []
        for rid in req_ids:
            block_ids[rid] = [int(b) for b in kvm.get_block_ids(rid)[0]]
            pr = per_req[rid]
            if pr["first_scheduled_step"] is None:
                pr["first_scheduled_step"] = step
            r = reqs[rid]
            # A partial prefill chunk must return no token.
            sampled.append([out_tok[rid]] if r.num_computed_tokens >= r.num_tokens else [])

        eco = sched.update_from_output(so, _model_runner_output(req_ids, sampled))
        for client_outs in eco.values():
            for o in client_outs.outputs:
                rid = o.request_id
                pr = per_req.get(rid)
                if pr is None:  # pragma: no cover
                    continue
                if o.new_token_ids:
                    pr["num_output_tokens"] += len(o.new_token_ids)
                    if pr["first_token_step"] is None:
                        pr["first_token_step"] = step
                if pr["cached_tokens"] is None:
                    ps = getattr(o, "prefill_stats", None)
                    if ps is not None:
                        pr["cached_tokens"] = int(ps.num_cached_tokens)
                    elif getattr(o, "num_cached_tokens", None) is not None:
                        # pragma: no cover - older releases
                        pr["cached_tokens"] = int(o.num_cached_tokens)
                if o.finish_reason is not None:
                    pr["finish_step"] = step
                    pr["finish_reason"] = str(o.finish_reason)
                    finished.add(rid)

        steps.append(
            {
                "step": step,
                "scheduled": nst,
                "preempted": preempted,
                "block_ids": block_ids,
                "num_free_blocks": int(pool.get_num_free_blocks()),
                "usage": float(kvm.usage),
                "prefix_cache": pstats,
            }
        )
        step += 1

    t_drive = time.perf_counter() - t1
    for rid, r in reqs.items():
        per_req[rid]["num_preemptions"] = int(r.num_preemptions)
    result: dict = {
        "vllm_version": VLLM_VERSION,
        "requests": per_req,
        "steps": steps,
        "free_queue_end": [
            int(b.block_id) for b in pool.free_block_queue.get_all_free_blocks()
        ],
        "totals": totals,
        "num_steps": step,
        "num_schedule_calls": n_calls,
    }
    if error is not None:
        result["error"] = error
    if stall is not None:
        result["stall"] = stall
    if warnings:
        result["warnings"] = warnings
    if WITH_TIMING:
        result["timing"] = {"build_s": t_build, "drive_s": t_drive}
    return result


def _drive_safe(scenario: dict) -> dict:
    """Like drive(), but turn an exception into an error result.

    An exception, for example vLLM rejecting the engine settings, becomes
    {"vllm_version", "error", "exception"}. It is also printed to stderr.
    """
    try:
        return drive(scenario)
    except Exception as exc:  # noqa: BLE001
        import traceback

        traceback.print_exc()
        return {
            "vllm_version": VLLM_VERSION,
            "error": f"{type(exc).__name__}: {exc}",
            "exception": type(exc).__name__,
        }


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print(f"usage: {argv[0]} IN.json OUT.json", file=sys.stderr)
        return 2
    with open(argv[1]) as f:
        data = json.load(f)
    if isinstance(data, list):
        result = [_drive_safe(s) for s in data]
        failed = any("error" in r for r in result)
    else:
        result = _drive_safe(data)
        failed = "error" in result
    tmp = argv[2] + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, argv[2])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
