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
    optional, absent = off:
          speculative: {method: "eagle" | "eagle3" | "mtp" | "ngram" |
                        "draft_model", num_speculative_tokens: k,
                        disable_eagle_block_drop, disable_lookahead_block_hashes,
                        parallel_drafting (bools; passed on only when true, and
                        only to releases that have them, else a warning),
                        prompt_lookup_min, prompt_lookup_max (ngram),
                        mtp_num_layers (mtp: the draft's num_nextn_predict_layers,
                        default 1; > 1 is multi-module MTP)}
          kv_groups: [{kind: "full_attention" | "sliding_window" | "mamba",
                       block_size, sliding_window (sliding_window only),
                       eagle (bool), num_layers (default 1),
                       prefill_checkpoint_alignment (mamba only: the spec's
                       num_prefill_checkpoint_blocks = 1 with this alignment;
                       0.32+)}, ...]
          mamba_cache_mode: "align" | "none" (default: "align" with prefix
                       caching, else "none"; read only when a mamba group exists)
          async_scheduling: bool (default false)
          prefix_cache_retention_interval: int >= 0 | "dense" (CacheConfig's
                       field, "dense" for its None; absent: CacheConfig's own
                       default, i.e. the engine's; 0.23-0.28, without the field,
                       read VLLM_PREFIX_CACHE_RETENTION_INTERVAL, which the
                       driver sets for an int and unsets otherwise; older
                       releases accept only "dense" and absent)
          kv_offloading: {cpu_chunks (the CPU tier's size in offload chunks; the
                       driver sets cpu_bytes_to_use to exactly that many of the
                       chunks vLLM's CPUOffloadingSpec sizes), eviction_policy
                       ("lru" | "arc", default "lru"), blocks_per_chunk (default
                       1), offload_prompt_only (default vLLM's), store_threshold
                       (default 0), transfer_delay (default 0: the schedule()
                       calls a copy takes, see _FakeCopyEngine)}. vLLM's native CPU offloading, wired as
                       VllmConfig wires --kv-offloading-size with backend
                       "native" (OffloadingConnector, kv_role kv_both); 0.32+.
  requests[]: req_id, prompt_token_ids, max_tokens, priority (default 0),
          arrival_time (default 0.0), join_step (default 0),
          output_token_id (default -1: the token every sampling step returns),
          accepted (spec decoding only; list of ints, default [0]: at the
          request's j-th verify step the number of accepted drafts is
          min(accepted[j % len(accepted)], drafts scheduled for it that step);
          the placeholder drafts vLLM pads a one-token admission with are
          never accepted and are not a verify step)

How the engine is built (mirrors EngineCore of the release at hand):
  * Model: a tiny Llama config.json (no weights, no tokenizer).
  * speculative: a real SpeculativeConfig(target_model_config,
    target_parallel_config, ...). eagle / eagle3 / draft_model use a local draft
    folder holding the same tiny Llama config (architecture LlamaForCausalLM);
    mtp uses a local tiny DeepSeek-V3 config (num_nextn_predict_layers =
    mtp_num_layers), which the release rewrites to deepseek_mtp; ngram needs no
    model. The request block hasher is
    get_request_block_hasher(hash_block_size, hash_fn,
    vllm_config.num_hash_lookahead_tokens) where the release has that argument
    (0.33), else get_request_block_hasher(hash_block_size, hash_fn); in 0.19
    hash_block_size is cache_config.block_size (EngineCore's
    scheduler_block_size there).
  * kv_groups: one KVCacheGroupSpec per entry, FullAttentionSpec /
    SlidingWindowSpec / MambaSpec: the groups the release's planner would form
    for such a model. The KVCacheConfig itself comes from the release's own
    planning code, as EngineCore gets it: num_gpu_blocks as
    cache_config.num_gpu_blocks_override, then get_kv_cache_configs(...,
    global_kv_cache_groups) + generate_scheduler_kv_cache_config (0.33), or
    get_kv_cache_config_from_groups (older), so every engine-level field the
    planner sets (prefix_cache_retention_interval, 0.32+) is the engine's.
    Sliding-window specs get extra_retained_tokens = num_prefill_lookahead - 1
    where the release has it (as its KV-cache planner does). Mamba specs get
    mamba_cache_mode and num_speculative_blocks = k. As EngineCore does,
    cache_config.block_size becomes the smallest prefix-cacheable group block
    size, and (block_size, hash_block_size) come from the release's
    resolve_kv_cache_block_sizes. A group's is_eagle_group is set from "eagle"
    only when speculative decoding is on and the release's planner would
    annotate groups (0.32, 0.33: SpeculativeConfig.use_eagle_block_drop();
    0.22: use_eagle(); 0.19 has no such flag); otherwise a warning says the
    flag was ignored. Without kv_groups the single
    full-attention group is built as before and never flagged (a lone group is
    flagged by the coordinator's fallback anyway).
  * Fields that had to be set on the built config by hand (because the tiny
    Llama model config would not produce them) are listed in "warnings".

Drive loop: see drive(). The output schema is documented in drive()'s
docstring.

The script re-executes itself with PYTHONHASHSEED=0 unless that is already
set, so NONE_HASH, and with it every block hash, is the same in every run.
Tested against every release kvsim covers (kvsim.semantics.VERSIONS; differences
are handled by inspecting signatures and, for the batch queue, EngineCore's
source). A release may reject a combination itself, e.g. ngram with
async_scheduling before 0.33: the result then carries "error".
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
import collections  # noqa: E402
import dataclasses  # noqa: E402
import functools  # noqa: E402
import inspect  # noqa: E402
import math  # noqa: E402
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
# Speed benchmarks (benchmarks/speed_vs_vllm.py): leave out the per-step block tables, the
# driver's own costliest bookkeeping, so the timed loop is mostly vLLM's.
WITHOUT_BLOCK_IDS = os.environ.get("KVSIM_ORACLE_NO_BLOCK_IDS") == "1"

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

# A tiny DeepSeek-V3 config, the MTP draft: SpeculativeConfig rewrites
# deepseek_v3 to deepseek_mtp (DeepSeekMTPModel). Weights are never loaded.
_TINY_DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "num_hidden_layers": 1,
    "first_k_dense_replace": 1,
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "n_group": 1,
    "topk_group": 1,
    "kv_lora_rank": 16,
    "q_lora_rank": None,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 16,
    "v_head_dim": 16,
    "vocab_size": 32000,
    "max_position_embeddings": 1 << 20,
    "rms_norm_eps": 1e-6,
    "torch_dtype": "float32",
    "num_nextn_predict_layers": 1,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": False,
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
# Optional engine keys; absent means off (the behaviour before they existed).
ENGINE_OPTIONAL = (
    "kv_offloading",
    "speculative",
    "kv_groups",
    "mamba_cache_mode",
    "async_scheduling",
    "prefix_cache_retention_interval",
    "kv_transfer",
)
# kvsim.specdec's methods but "none" (this driver runs in vLLM's environment, without kvsim;
# tests/test_specdec.py checks the two lists agree).
SPEC_METHODS = ("eagle", "eagle3", "mtp", "ngram", "draft_model")
EAGLE_FAMILY = ("eagle", "eagle3", "mtp")  # SpeculativeConfig.use_eagle()
SPEC_FLAGS = (
    "disable_eagle_block_drop",
    "disable_lookahead_block_hashes",
    "parallel_drafting",
)
SPEC_KEYS = {
    "method",
    "num_speculative_tokens",
    "prompt_lookup_min",
    "prompt_lookup_max",
    "mtp_num_layers",
    *SPEC_FLAGS,
}
OFFLOAD_KEYS = {
    "cpu_chunks",
    "eviction_policy",
    "blocks_per_chunk",
    "offload_prompt_only",
    "store_threshold",
    "transfer_delay",
}
GROUP_KINDS = ("full_attention", "sliding_window", "mamba")
GROUP_KEYS = {
    "kind",
    "block_size",
    "sliding_window",
    "eagle",
    "num_layers",
    "prefill_checkpoint_alignment",
}

_MODEL_DIRS: dict[str, str] = {}


def _config_dir(name: str, config: dict) -> str:
    """A temporary folder holding only config.json (made once per process)."""
    d = _MODEL_DIRS.get(name)
    if d is None:
        d = tempfile.mkdtemp(prefix=f"kvsim-oracle-{name}-")
        atexit.register(shutil.rmtree, d, True)
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(config, f)
        _MODEL_DIRS[name] = d
    return d


def _model_dir() -> str:
    return _config_dir("llama", _TINY_LLAMA)


def _mtp_dir(num_layers: int) -> str:
    cfg = dict(_TINY_DEEPSEEK_V3, num_nextn_predict_layers=int(num_layers))
    return _config_dir(f"deepseek-mtp{int(num_layers)}", cfg)


def _accepted_params(fn) -> set[str] | None:
    """Parameter names fn (or a class constructor) accepts; None if any.

    A class whose constructor only forwards (*args, **kwargs), such as
    AsyncScheduler, is judged by the first base class that names its
    parameters.
    """
    targets = list(fn.__mro__) if inspect.isclass(fn) else [fn]
    for target in targets:
        if target is object:
            break
        try:
            sig = inspect.signature(target)
        except (TypeError, ValueError):  # pragma: no cover
            return None
        params = sig.parameters.values()
        if any(p.kind is p.VAR_KEYWORD for p in params):
            if inspect.isclass(fn) and all(
                p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL) for p in params
            ):
                continue  # a pure forwarder: look at the base class
            return None
        return set(sig.parameters)
    return None


def _call_filtered(fn, kwargs: dict, dropped: list[str], what: str):
    accepted = _accepted_params(fn)
    if accepted is not None:
        for k in list(kwargs):
            if k not in accepted:
                dropped.append(f"{what}.{k}")
                del kwargs[k]
    return fn(**kwargs)


def _known_object(value, name: str, keys: set[str]) -> dict:
    """``value`` if it is an object holding only ``keys``, else ValueError."""
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be an object")
    unknown = set(value) - keys
    if unknown:
        raise ValueError(f"unknown {name} keys: {sorted(unknown)}")
    return value


def _check_speculative(spec) -> dict:
    spec = _known_object(spec, "engine.speculative", SPEC_KEYS)
    if spec.get("method") not in SPEC_METHODS:
        raise ValueError(f"engine.speculative.method must be one of {SPEC_METHODS}")
    k = spec.get("num_speculative_tokens")
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError("engine.speculative.num_speculative_tokens must be an int >= 1")
    return spec


def _check_offloading(d) -> dict:
    out = dict(_known_object(d, "engine.kv_offloading", OFFLOAD_KEYS))
    for key, low in (("cpu_chunks", 1), ("blocks_per_chunk", 1), ("store_threshold", 0),
                     ("transfer_delay", 0)):
        if key in out and (not isinstance(out[key], int) or isinstance(out[key], bool)
                           or out[key] < low):
            raise ValueError(f"kv_offloading.{key} must be an int >= {low}")
    if "cpu_chunks" not in out:
        raise ValueError("kv_offloading.cpu_chunks is required")
    if out.get("eviction_policy", "lru") not in ("lru", "arc"):
        raise ValueError("kv_offloading.eviction_policy must be 'lru' or 'arc'")
    return out


def _check_kv_transfer(d) -> dict:
    d = _known_object(d, "engine.kv_transfer", {"kv_role", "engine_id", "kv_recompute_threshold"})
    if d.get("kv_role") not in ("kv_producer", "kv_consumer"):
        raise ValueError("engine.kv_transfer.kv_role must be kv_producer or kv_consumer")
    if not isinstance(d.get("engine_id"), str):
        raise ValueError("engine.kv_transfer.engine_id must be a string")
    return d


def _offload_extra_config(offload: dict) -> dict:
    """kv_connector_extra_config as a user passes it with --kv-transfer-config beside
    --kv-offloading-size (cpu_bytes_to_use is set from the planned layout later)."""
    extra: dict = {"eviction_policy": offload.get("eviction_policy", "lru")}
    for key in ("blocks_per_chunk", "offload_prompt_only", "store_threshold"):
        if key in offload:
            extra[key] = offload[key]
    return extra


def _size_cpu_tier(vllm_config, kv_cache_config, offload: dict) -> None:
    """Set cpu_bytes_to_use (and kv_offloading_size, GiB) to exactly cpu_chunks of the
    chunks CPUOffloadingSpec carves: round_up(bytes per GPU block x world size x
    blocks_per_chunk, page size)."""
    import mmap

    from vllm.utils.math_utils import round_up

    per_block = kv_cache_config.kv_cache_tensors[0].size // kv_cache_config.num_blocks
    world = vllm_config.parallel_config.world_size
    chunk = round_up(per_block * world * int(offload.get("blocks_per_chunk", 1)), mmap.PAGESIZE)
    cpu_bytes = int(offload["cpu_chunks"]) * chunk
    vllm_config.kv_transfer_config.kv_connector_extra_config["cpu_bytes_to_use"] = cpu_bytes
    vllm_config.cache_config.kv_offloading_size = cpu_bytes / (1 << 30)


def _check_kv_groups(groups) -> list[dict]:
    if not isinstance(groups, list) or not groups:
        raise ValueError("engine.kv_groups must be a non-empty list")
    for i, g in enumerate(groups):
        if not isinstance(g, dict):
            raise ValueError(f"engine.kv_groups[{i}] must be an object")
        unknown = set(g) - GROUP_KEYS
        if unknown:
            raise ValueError(f"unknown engine.kv_groups[{i}] keys: {sorted(unknown)}")
        if g.get("kind") not in GROUP_KINDS:
            raise ValueError(f"engine.kv_groups[{i}].kind must be one of {GROUP_KINDS}")
        if int(g.get("block_size", 0)) < 1:
            raise ValueError(f"engine.kv_groups[{i}].block_size must be >= 1")
        if (g["kind"] == "sliding_window") != ("sliding_window" in g):
            raise ValueError(
                f"engine.kv_groups[{i}]: sliding_window is required for, and only "
                "allowed with, kind sliding_window"
            )
        if int(g.get("num_layers", 1)) < 1:
            raise ValueError(f"engine.kv_groups[{i}].num_layers must be >= 1")
    return groups


def _build_speculative_config(spec: dict, model_config, parallel_config, dropped):
    from vllm.config import SpeculativeConfig

    method = spec["method"]
    kw: dict = dict(
        method=method,
        num_speculative_tokens=int(spec["num_speculative_tokens"]),
        target_model_config=model_config,
        target_parallel_config=parallel_config,
    )
    if method in ("eagle", "eagle3", "draft_model"):
        kw["model"] = _model_dir()
    elif method == "mtp":
        kw["model"] = _mtp_dir(int(spec.get("mtp_num_layers", 1)))
    elif method == "ngram":
        for key in ("prompt_lookup_min", "prompt_lookup_max"):
            if key in spec:
                kw[key] = int(spec[key])
    for flag in SPEC_FLAGS:
        if spec.get(flag):
            kw[flag] = True
    sc = _call_filtered(SpeculativeConfig, kw, dropped, "SpeculativeConfig")
    if sc.method != method:
        raise RuntimeError(f"SpeculativeConfig changed method {method!r} to {sc.method!r}")
    return sc


def _annotates_eagle_groups(spec_config) -> bool:
    """Whether the release's KV-cache planner would set is_eagle_group at all."""
    if spec_config is None:
        return False
    f = getattr(spec_config, "use_eagle_block_drop", None)  # 0.32 and later
    if callable(f):
        return bool(f())
    return bool(spec_config.use_eagle())


def _extra_retained_tokens(vllm_config) -> int:
    """A sliding window's extra_retained_tokens as the release's planner tags it: 0.31+
    num_prefill_lookahead_tokens - 1; 0.28-0.30 num_speculative_tokens - 1 under
    use_multi_module_mtp() (0.28 v1/core/kv_cache_utils.py:2135-2147); none before."""
    if hasattr(type(vllm_config), "num_prefill_lookahead_tokens"):
        return max(0, int(vllm_config.num_prefill_lookahead_tokens) - 1)
    sc = vllm_config.speculative_config
    if sc is not None and getattr(sc, "use_multi_module_mtp", lambda: False)():
        return int(sc.num_speculative_tokens) - 1
    return 0


def _group_spec(g: dict, vllm_config, warnings: list[str], page_tokens: int):
    """One group's spec. Every group gets the same page size, as a real hybrid
    model's do (vLLM's planner unifies them, sizing Mamba pages up with
    page_size_padded): 2 x 64 x page_tokens float32 values per block."""
    from vllm.v1 import kv_cache_interface as kvi

    kind = g["kind"]
    b = int(g["block_size"])
    head_size = 64 * page_tokens // b
    page_bytes = 2 * 64 * page_tokens * 4
    dropped: list[str] = []
    if kind == "full_attention":
        spec = FullAttentionSpec(
            block_size=b, num_kv_heads=1, head_size=head_size, dtype=torch.float32
        )
    elif kind == "sliding_window":
        kw = dict(
            block_size=b,
            num_kv_heads=1,
            head_size=head_size,
            dtype=torch.float32,
            sliding_window=int(g["sliding_window"]),
        )
        extra = _extra_retained_tokens(vllm_config)
        if extra:
            kw["extra_retained_tokens"] = extra
        spec = _call_filtered(kvi.SlidingWindowSpec, kw, dropped, "SlidingWindowSpec")
    else:
        # As MambaBase.get_kv_cache_spec builds it (no ReplaySSM).
        sc = vllm_config.speculative_config
        kw = dict(
            block_size=b,
            shapes=((4, 16),),
            dtypes=(torch.float32,),
            num_speculative_blocks=int(sc.num_speculative_tokens) if sc is not None else 0,
            page_size_padded=page_bytes,
        )
        if g.get("prefill_checkpoint_alignment") is not None:
            # As MambaMixer2 (alignment 1) and GDN with FlashInfer (the block grid)
            # build theirs.
            if "num_prefill_checkpoint_blocks" not in {
                f.name for f in dataclasses.fields(kvi.MambaSpec)
            }:
                raise ValueError(
                    "kv_groups: prefill_checkpoint_alignment needs a vLLM with "
                    "MambaSpec.num_prefill_checkpoint_blocks"
                )
            kw["num_prefill_checkpoint_blocks"] = 1
            kw["prefill_checkpoint_alignment"] = int(g["prefill_checkpoint_alignment"])
        mode = getattr(vllm_config.cache_config, "mamba_cache_mode", None)
        if mode is not None:
            kw["mamba_cache_mode"] = mode
        spec = _call_filtered(kvi.MambaSpec, kw, dropped, "MambaSpec")
    warnings.extend(f"KV spec field not supported by this vLLM: {d}" for d in dropped)
    return spec


def _batch_queue_rule() -> str:
    """How this release's EngineCore.step_with_batch_queue decides, after
    queueing a batch, whether to return without waiting for the oldest one.

    "has_requests" (0.32, 0.33): when the queue is not full and (the batch
    scheduled tokens or the scheduler still has requests).
    "not_done" (0.19 - 0.22): when the batch scheduled tokens, the queue is
    not full and the oldest batch's output is not ready yet. The driver
    takes it as never ready (the device is still busy with it), the usual
    case under load; a real engine decides by timing.
    Read from the release's own vllm/v1/engine/core.py.
    """
    path = os.path.join(os.path.dirname(vllm.__file__), "v1", "engine", "core.py")
    with open(path) as f:
        src = f.read()
    i = src.find("def step_with_batch_queue")
    body = src[i : src.find("\n    def ", i + 1)] if i >= 0 else ""
    if "model_executed or self.scheduler.has_requests()" in body:
        return "has_requests"
    if "not batch_queue[-1][0].done()" in body:
        return "not_done"
    raise RuntimeError("unrecognised EngineCore.step_with_batch_queue in this vLLM")


# The CacheConfig / SchedulerConfig fields build_scheduler always sets itself (it sets
# mamba_cache_mode whenever a Mamba group makes it matter; 0.33's EngineArgs no longer
# passes it on); every other field keeps its class default, which must be what EngineArgs
# gives the engine (see engine_default_gaps).
CACHE_FIELDS_SET = {"block_size", "enable_prefix_caching", "mamba_cache_mode"}
SCHEDULER_FIELDS_SET = {
    "max_num_seqs",
    "max_num_batched_tokens",
    "max_model_len",
    "is_encoder_decoder",
    "enable_chunked_prefill",
    "long_prefill_token_threshold",
    "policy",
    "scheduler_reserve_full_isl",
    "async_scheduling",
}
_ENGINE_DEFAULT_GAPS: list[str] | None = None


@functools.cache
def _engine_args():
    """EngineArgs as `vllm serve` starts from them, for the driver's model (built once)."""
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=_model_dir(), skip_tokenizer_init=True)


def engine_default_gaps() -> list[str]:
    """The CacheConfig / SchedulerConfig fields whose EngineArgs default (what `vllm
    serve` and LLM(...) start from) differs from the class default the driver leaves
    them at. A referee built from class defaults would miss such an engine-level
    default by construction (0.33's KVCacheConfig.prefix_cache_retention_interval was
    one: None by hand, 0 from the planner), so any gap stops the driver."""
    global _ENGINE_DEFAULT_GAPS
    if _ENGINE_DEFAULT_GAPS is None:
        args = _engine_args()
        gaps = []
        for cls, done in ((CacheConfig, CACHE_FIELDS_SET), (SchedulerConfig, SCHEDULER_FIELDS_SET)):
            for f in dataclasses.fields(cls):
                if f.name in done or not f.init or not hasattr(args, f.name):
                    continue
                default = f.default
                if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
                    default = f.default_factory()  # type: ignore[misc]
                if type(default).__name__ == "FieldInfo":  # a pydantic Field(...)
                    factory = getattr(default, "default_factory", None)
                    default = factory() if factory is not None else default.default
                if default is dataclasses.MISSING:
                    continue
                value = getattr(args, f.name)
                if type(value).__name__ == "_UnsetType":
                    continue  # resolved by the engine; the driver resolves it the same way
                if value != default:
                    gaps.append(f"{cls.__name__}.{f.name}: EngineArgs {value!r}, class {default!r}")
        _ENGINE_DEFAULT_GAPS = gaps
    return _ENGINE_DEFAULT_GAPS


RETENTION_ENV = "VLLM_PREFIX_CACHE_RETENTION_INTERVAL"


def build_scheduler(engine: dict):
    """Return (scheduler, request_block_hasher or None, warnings, info)."""
    gaps = engine_default_gaps()
    if gaps:
        raise RuntimeError("engine defaults the driver does not reproduce: " + "; ".join(gaps))
    e = dict(ENGINE_DEFAULTS)
    unknown = set(engine) - set(ENGINE_DEFAULTS) - set(ENGINE_OPTIONAL)
    if unknown:
        raise ValueError(f"unknown engine keys: {sorted(unknown)}")
    e.update(engine)
    spec_in, groups_in, offload, transfer = (
        None if engine.get(key) is None else check(engine[key])
        for key, check in (("speculative", _check_speculative), ("kv_groups", _check_kv_groups),
                           ("kv_offloading", _check_offloading),
                           ("kv_transfer", _check_kv_transfer)))
    if offload is not None and transfer is not None:
        raise ValueError("engine: kv_transfer and kv_offloading together are not driven")
    async_sched = bool(engine.get("async_scheduling", False))
    num_blocks = int(e["num_gpu_blocks"])
    max_model_len = int(e["max_model_len"])
    prefix_caching = bool(e["enable_prefix_caching"])
    dropped: list[str] = []
    warnings: list[str] = []

    block_size = int(e["block_size"])
    mamba_groups = [g for g in groups_in or () if g["kind"] == "mamba"]
    if groups_in is not None:
        # EngineCore sets cache_config.block_size to the smallest block size of
        # the prefix-cacheable groups (all kinds offered here are).
        block_size = min(int(g["block_size"]) for g in groups_in)
        if "block_size" in engine and int(engine["block_size"]) != block_size:
            warnings.append(
                f"engine.block_size {engine['block_size']} replaced by {block_size}, "
                "the smallest kv_groups block size, as EngineCore does"
            )

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
            async_scheduling=async_sched,
        ),
        dropped,
        "SchedulerConfig",
    )
    cache_kwargs: dict = dict(block_size=block_size, enable_prefix_caching=prefix_caching)
    mamba_mode = None
    if mamba_groups:
        mamba_mode = str(engine.get("mamba_cache_mode") or ("align" if prefix_caching else "none"))
        cache_kwargs["mamba_cache_mode"] = mamba_mode
        if prefix_caching:
            cache_kwargs["mamba_block_size"] = int(mamba_groups[0]["block_size"])
    os.environ.pop(RETENTION_ENV, None)  # (a previous scenario's)
    if "prefix_cache_retention_interval" in engine:
        retention = engine["prefix_cache_retention_interval"]
        has_field = "prefix_cache_retention_interval" in {
            f.name for f in dataclasses.fields(CacheConfig)
        }
        if retention == "dense":
            if has_field:
                cache_kwargs["prefix_cache_retention_interval"] = None
        elif not has_field:
            if RETENTION_ENV not in vllm.envs.environment_variables:
                raise ValueError(
                    "engine.prefix_cache_retention_interval: this vLLM has no such setting"
                )
            # 0.23-0.28: the coordinator reads the variable when it is built.
            os.environ[RETENTION_ENV] = str(int(retention))
        else:
            cache_kwargs["prefix_cache_retention_interval"] = int(retention)
    elif mamba_groups and spec_in is not None and spec_in["method"] in EAGLE_FAMILY and (
            type(getattr(_engine_args(), "prefix_cache_retention_interval", None)).__name__
            == "_UnsetType"):
        # 0.29's EngineArgs: left unset, a Mamba hybrid with an EAGLE-family drafter gets
        # dense checkpoints (engine/arg_utils.py:2395-2407; the driver's model is not hybrid).
        cache_kwargs["prefix_cache_retention_interval"] = None
    if offload is not None:
        if "kv_offloading_size" not in {f.name for f in dataclasses.fields(CacheConfig)}:
            raise ValueError("engine.kv_offloading: this vLLM has no kv_offloading_size")
        # --kv-offloading-size N --kv-offloading-backend native; the size is made exact
        # below, once the layout (bytes per block) is planned.
        cache_kwargs["kv_offloading_size"] = 1.0
        cache_kwargs["kv_offloading_backend"] = "native"
    cache_config = _call_filtered(CacheConfig, cache_kwargs, dropped, "CacheConfig")
    vc_kwargs: dict = dict(
        model_config=model_config,
        scheduler_config=scheduler_config,
        cache_config=cache_config,
        device_config=DeviceConfig(device="cpu"),
    )
    if offload is not None:
        from vllm.config import KVTransferConfig

        # VllmConfig's post-init adds the connector, kv_role and cpu_bytes_to_use.
        vc_kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector_extra_config=_offload_extra_config(offload)
        )
    if transfer is not None:
        from vllm.config import KVTransferConfig

        # --kv-transfer-config '{"kv_connector": "NixlConnector", "kv_role": ...}', as a
        # P/D deployment passes it (the extra config only where the scenario sets it).
        extra = {k: transfer[k] for k in ("kv_recompute_threshold",) if k in transfer}
        vc_kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="NixlConnector", kv_role=transfer["kv_role"],
            engine_id=transfer["engine_id"], kv_connector_extra_config=extra
        )
    if spec_in is not None:
        from vllm.config import ParallelConfig

        parallel_config = ParallelConfig()
        vc_kwargs["parallel_config"] = parallel_config
        vc_kwargs["speculative_config"] = _build_speculative_config(
            spec_in, model_config, parallel_config, dropped
        )
    vllm_config = VllmConfig(**vc_kwargs)
    # VllmConfig's post-init may rewrite settings. Check that the ones the
    # oracle depends on survived.
    sc = vllm_config.scheduler_config
    checks = {
        "async_scheduling": (bool(getattr(sc, "async_scheduling", False)), async_sched),
        "enable_chunked_prefill": (
            bool(sc.enable_chunked_prefill),
            bool(e["enable_chunked_prefill"]),
        ),
        "enable_prefix_caching": (
            bool(vllm_config.cache_config.enable_prefix_caching),
            prefix_caching,
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
    if spec_in is not None:
        got = vllm_config.speculative_config
        checks["speculative"] = (
            (got.method, int(got.num_speculative_tokens)) if got is not None else None,
            (spec_in["method"], int(spec_in["num_speculative_tokens"])),
        )
    for name, (got, want) in checks.items():
        if got != want:
            raise RuntimeError(f"VllmConfig changed {name}: wanted {want}, got {got}")
    got_mode = getattr(vllm_config.cache_config, "mamba_cache_mode", mamba_mode)
    if mamba_groups and got_mode != mamba_mode:
        warnings.append(
            f"set cache_config.mamba_cache_mode={mamba_mode!r} by hand "
            f"(VllmConfig made it {got_mode!r} for the tiny Llama model)"
        )
        vllm_config.cache_config.mamba_cache_mode = mamba_mode

    spec_config = vllm_config.speculative_config
    if groups_in is None:
        # With offloading and an EAGLE-family drafter, the lone group is flagged as a real
        # engine's planner flags the group holding the drafter's layers (its attention
        # shares the target's spec): the offloading connector reads the flag (the
        # scheduler's coordinator treats a lone group so anyway).
        flag: dict = {}
        if offload is not None and _annotates_eagle_groups(spec_config) and "is_eagle_group" in {
            f.name for f in dataclasses.fields(KVCacheGroupSpec)
        }:
            flag["is_eagle_group"] = True
        groups = [
            KVCacheGroupSpec(
                ["model.layers.0.self_attn.attn"],
                FullAttentionSpec(
                    block_size=block_size,
                    num_kv_heads=1,
                    head_size=64,
                    dtype=torch.float32,
                ),
                **flag,
            )
        ]
    else:
        has_flag = "is_eagle_group" in {
            f.name for f in dataclasses.fields(KVCacheGroupSpec)
        }
        annotate = _annotates_eagle_groups(spec_config)
        page_tokens = math.lcm(*(int(g["block_size"]) for g in groups_in))
        groups = []
        layer = 0
        for i, g in enumerate(groups_in):
            n = int(g.get("num_layers", 1))
            suffix = "mixer" if g["kind"] == "mamba" else "self_attn.attn"
            names = [f"model.layers.{layer + j}.{suffix}" for j in range(n)]
            layer += n
            kw: dict = {}
            if g.get("eagle"):
                if not has_flag:
                    warnings.append(
                        f"kv_groups[{i}].eagle ignored: this vLLM has no "
                        "KVCacheGroupSpec.is_eagle_group"
                    )
                elif not annotate:
                    warnings.append(
                        f"kv_groups[{i}].eagle ignored: this vLLM flags groups only "
                        "with an EAGLE-family drafter that uses the block drop"
                    )
                else:
                    kw["is_eagle_group"] = True
            groups.append(
                KVCacheGroupSpec(
                    names, _group_spec(g, vllm_config, warnings, page_tokens), **kw
                )
            )
    kv_cache_config = _plan_kv_cache_config(vllm_config, groups, num_blocks)
    if offload is not None:
        _size_cpu_tier(vllm_config, kv_cache_config, offload)
    vllm_config.cache_config.num_gpu_blocks = num_blocks
    vllm_config.cache_config.num_cpu_blocks = 0

    resolve = getattr(kv_cache_utils, "resolve_kv_cache_block_sizes", None)
    if resolve is not None:
        scheduler_block_size, hash_block_size = resolve(kv_cache_config, vllm_config)
        resolve_align = getattr(kv_cache_utils, "resolve_cache_hit_alignment_tokens", None)
        if resolve_align is not None and hasattr(kv_cache_config, "hash_block_size"):
            # EngineCore records these on the config (read by connectors only).
            kv_cache_config.hash_block_size = hash_block_size
            kv_cache_config.cache_hit_alignment_tokens = resolve_align(
                kv_cache_config, vllm_config, scheduler_block_size, hash_block_size
            )
    else:  # pragma: no cover - older releases
        scheduler_block_size = hash_block_size = block_size
        if groups_in is not None and len(groups_in) > 1:
            warnings.append(
                "this vLLM has no resolve_kv_cache_block_sizes; the Scheduler "
                "derives its block sizes itself"
            )
    sched_cls = Scheduler
    if async_sched:
        get_cls = getattr(vllm_config.scheduler_config, "get_scheduler_cls", None)
        if get_cls is not None:
            sched_cls = get_cls()
        else:  # pragma: no cover
            from vllm.v1.core.sched.async_scheduler import AsyncScheduler

            sched_cls = AsyncScheduler
    sched = _call_filtered(
        sched_cls,
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
    warnings = [f"engine setting not supported by this vLLM: {d}" for d in dropped] + warnings
    queue_size = 1
    queue_rule = "has_requests"
    if async_sched:
        # 0.19: EngineCore reads max_concurrent_batches from the executor
        # (uniproc/multiproc: 2 with async scheduling and no PP).
        queue_size = int(getattr(vllm_config, "max_concurrent_batches", 2) or 2)
        queue_rule = _batch_queue_rule()
    if offload is not None:
        manager = sched.connector.connector_scheduler.manager
        if manager._num_chunks != int(offload["cpu_chunks"]):
            raise RuntimeError(
                f"CPU tier has {manager._num_chunks} chunks, wanted {offload['cpu_chunks']}"
            )
    info = {
        "offload_delay": int(offload.get("transfer_delay", 0)) if offload else None,
        "num_groups": len(groups),
        "nested_block_ids": groups_in is not None,
        "spec_k": int(spec_in["num_speculative_tokens"]) if spec_in is not None else 0,
        "async": async_sched,
        "queue_size": queue_size,
        "queue_rule": queue_rule,
    }
    return sched, hasher, warnings, info


def _plan_kv_cache_config(vllm_config, groups: list, num_blocks: int):
    """The KVCacheConfig EngineCore would hand the Scheduler for these groups and
    a pool of num_blocks (vLLM's --num-gpu-blocks-override), made by the release's
    own planning code, never by hand: whatever engine-level field the planner
    sets (prefix_cache_retention_interval in 0.32+) comes with it."""
    try:  # 0.33
        from vllm.v1.core import kv_cache_planning as planning
    except ImportError:  # 0.32 and older keep the planner in kv_cache_utils
        planning = kv_cache_utils
    vllm_config.cache_config.num_gpu_blocks_override = num_blocks
    layer_specs = {
        name: group.kv_cache_spec for group in groups for name in group.layer_names
    }
    if getattr(vllm_config.cache_config, "kv_cache_layout", "set") is None:
        # 0.33: EngineCore resolves the memory layout first (it places bytes, not
        # blocks): block-outermost ones, which any mix of page sizes can use.
        from vllm.config.cache import KVCacheLayout
        from vllm.v1.attention.backends.utils import resolve_kv_cache_layout

        names = [m.name for m in KVCacheLayout if m.is_block_outermost]
        resolve_kv_cache_layout(vllm_config, [names], layer_specs.values())
    # Memory is moot under the override; give the planner exactly that much.
    per_block = sum(g.kv_cache_spec.page_size_bytes * len(g.layer_names) for g in groups)
    memory = num_blocks * per_block
    params = inspect.signature(planning.get_kv_cache_configs).parameters
    if "global_kv_cache_groups" in params:
        (config,) = planning.get_kv_cache_configs(
            vllm_config, [layer_specs], [memory], groups
        )
        config = kv_cache_utils.generate_scheduler_kv_cache_config([config])
    else:
        config = planning.get_kv_cache_config_from_groups(vllm_config, groups, memory)
    if config.num_blocks != num_blocks:
        raise RuntimeError(
            f"vLLM's planner made {config.num_blocks} blocks, wanted {num_blocks}"
        )
    return config


# (hash_fn, num_hash_lookahead_tokens, hash_block_size) -> block hasher.
_HASHERS: dict = {}
_NONE_HASH_FN = None


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


class _InsertionOrderedSet:
    """Scheduler.finished_req_ids with its requests in the order they finished.

    vLLM keeps a plain set, and the offloading connector stores finished requests' chunks
    and commits their LRU recency by iterating it: an order that depends on the process's
    string hashes (PYTHONHASHSEED), so vLLM itself may evict differently from run to run
    when requests finish in the same step. With offloading the driver puts this in its
    place after every schedule(): one of the orders vLLM can take, and one kvsim takes."""

    def __init__(self):
        self._d: dict[str, None] = {}

    def add(self, x: str) -> None:
        self._d[x] = None

    def __contains__(self, x) -> bool:
        return x in self._d

    def __iter__(self):
        return iter(list(self._d))

    def __len__(self) -> int:
        return len(self._d)


class _FakeCopyEngine:
    """vLLM's OffloadingWorker interface (the copy engine under OffloadingConnectorWorker)
    with the copies faked: each is done `delay` schedule() calls after it is submitted
    (0: in the same step's output); `wait` (a flush) finishes them at once."""

    def __init__(self, delay: int):
        self.delay = delay
        self.call = 0
        self.due: dict[int, int] = {}

    def submit_store(self, job_id, src_spec, dst_spec) -> bool:
        self.due[job_id] = self.call + self.delay
        return True

    def submit_load(self, job_id, src_spec, dst_spec, expedited: bool = False) -> bool:
        self.due[job_id] = self.call + self.delay
        return True

    def get_finished(self):
        from vllm.v1.kv_offload.base import TransferResult

        done = sorted(j for j, c in self.due.items() if c <= self.call)
        for j in done:
            del self.due[j]
        return [TransferResult(job_id=j, success=True) for j in done]

    def wait(self, job_ids) -> None:
        for j in job_ids:
            if j in self.due:
                self.due[j] = min(self.due[j], self.call)

    def shutdown(self) -> None:
        self.due.clear()


class _OffloadWorker:
    """vLLM's own OffloadingConnectorWorker over the fake copy engine, stepped as the model
    runner steps it: handle_preemptions (flushed stores submitted and waited for), then
    start_kv_transfers (the previous step's stores, then this step's loads), then, after
    the forward pass, prepare_store_kv (this step's stores, submitted next step), and
    get_finished / build_connector_worker_meta for the step's output."""

    def __init__(self, sched, delay: int):
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import (
            build_offloading_config,
        )
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker import (
            OffloadingConnectorWorker,
        )
        from vllm.v1.kv_offload.factory import OffloadingSpecFactory

        spec = OffloadingSpecFactory.create_spec(
            build_offloading_config(sched.vllm_config, sched.kv_cache_config)
        )
        self.worker = OffloadingConnectorWorker(spec, sched.vllm_config, sched.kv_cache_config)
        self.engine = _FakeCopyEngine(delay)
        self.worker.worker = self.engine  # what register_kv_caches would build on a GPU

    def step(self, so, call: int):
        """Run the worker's hooks for the step `so` (schedule() call `call`); return its
        KVConnectorOutput, or None when nothing finished."""
        from vllm.v1.outputs import KVConnectorOutput

        self.engine.call = call
        meta = so.kv_connector_metadata
        if meta is not None:
            self.worker.handle_preemptions(meta)
            self.worker.start_kv_transfers(meta)
            self.worker.prepare_store_kv(meta)
        _, recving = self.worker.get_finished(set())
        worker_meta = self.worker.build_connector_worker_meta()
        if not recving and worker_meta is None:
            return None
        return KVConnectorOutput(finished_recving=recving or None,
                                 kv_connector_worker_meta=worker_meta)

    @property
    def busy(self) -> bool:
        return bool(self.engine.due or self.worker._unsubmitted_store_jobs)


DRAFT_TOKEN_ID = 2**30 + 7  # any id that is not vLLM's -1 placeholder


def _draft_token_ids(req_ids: list[str], drafts: list[list[int]]):
    from vllm.v1.outputs import DraftTokenIds

    return DraftTokenIds(req_ids, drafts)


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


def _take_connector_stats(sched) -> dict:
    """The connector's prefix-cache stats recorded by the last schedule() (vLLM's
    external_prefix_cache_*), reset as make_stats() resets them."""
    st = getattr(sched, "connector_prefix_cache_stats", None)
    if st is None:
        return _prefix_stats_dict(None)
    out = _prefix_stats_dict(st)
    sched.connector_prefix_cache_stats = type(st)()
    return out


def drive(scenario: dict, max_steps: int = 1_000_000) -> dict:
    """Run one scenario and return its result.

    Loop. `step` counts the schedule() calls that scheduled more than 0 tokens.
    Before each schedule() call, every not-yet-added request with
    join_step <= step is added, in input order. Right after schedule(), each
    scheduled request whose prompt is complete (it is not a partial prefill
    chunk: num_computed_tokens >= num_tokens, plus the output placeholders
    under async scheduling) is given the sampled list
    [output_token_id] * (1 + a), where a = 0 without spec decoding and
    a = min(accepted[j % len(accepted)], drafts scheduled for it this step)
    at its j-th verify step (a step in which it had scheduled drafts and was
    already running before the schedule() call: a request admitted from the
    waiting queue with one token left is padded to 1 + k with placeholder
    drafts, which get a = 0 and do not count as a verify step). A
    partial prefill chunk samples []. update_from_output then takes that list.
    The loop ends when every request has finished.
    When everything added so far has finished and the rest would join at a
    later step, that step can never come, because idle calls do not count.
    The driver then does what an idle EngineCore would: one empty
    schedule()/update_from_output if the scheduler still holds finished ids,
    then it adds the batch with the next join_step.
    A schedule() call that schedules 0 tokens, with unfinished requests and
    no batch that scheduled tokens still in flight, and no preemption, is a
    stall: "error" and "stall" are set and the run stops. (A call that
    schedules 0 tokens only because it preempted everything is not a step;
    the engine simply schedules again.) An exception raised by schedule()
    (0.20.0's "ValueError: Cannot get N free blocks from the pool") kills
    a real EngineCore: "error" and "engine_dead" are set and the run stops
    there, with what was recorded before it.

    Synchronous scheduling (the default) is EngineCore.step + post_step:
    schedule(); update_from_output(); then, with spec decoding and when the
    model executed (tokens > 0) and the scheduler output does not say
    skip_drafts, update_draft_token_ids with k drafts, all output_token_id,
    for every request that sampled this step and is still unfinished (what
    the model runner proposes; the scheduler ignores drafts for prefill chunks
    itself). Drafts are never attached under async scheduling: there the
    AsyncScheduler schedules placeholder drafts itself, as with a real worker.

    async_scheduling: EngineCore.step_with_batch_queue, with the batch queue
    size the release gives (VllmConfig.max_concurrent_batches in 0.32/0.33,
    the executor's in older releases; 2 with async scheduling and no
    pipeline parallelism). Each iteration (one call of that method; requests
    due join before it, as between EngineCore steps):
      1. if scheduler.has_requests(): schedule() a batch and push it on the
         queue; then return early, i.e. go to the next iteration without
         waiting, if the queue is not full and
           0.32 / 0.33: the batch scheduled tokens or the scheduler still
                        has requests;
           0.19 - 0.22: the batch scheduled tokens and the oldest queued
                        batch is not finished yet; the driver takes it as
                        never finished in time (the device is still busy),
                        the usual case under load; a real engine decides by
                        timing here;
      2. otherwise (not returned early, or nothing to schedule) pop the
         OLDEST batch and call update_from_output with its fake output.
    So with size 2: schedule(0); schedule(1); update(0); schedule(2);
    update(1); ... : batch n+1 is scheduled before batch n's output is
    processed. An empty batch (0 tokens) goes through the queue too, with an
    empty output. The fake output of a batch is fixed when it is scheduled
    (a request samples iff it is not a partial prefill chunk after that
    schedule()). Step numbers are still given in schedule() order; a
    request's first_token_step / finish_step is the number of the step whose
    output produced the token / finished it. The loop ends when every
    request has finished and the queue is drained.

    Output:
      vllm_version: str
      requests: {req_id: {cached_tokens, num_preemptions, first_scheduled_step,
                 first_token_step, finish_step, finish_reason,
                 num_output_tokens}}. A field is null if it never happened.
                 With spec decoding also num_draft_tokens, num_accepted_tokens:
                 the drafts scheduled for it and the drafts accepted, summed
                 over the steps whose output update_from_output applied to it
                 (a request already finished when a batch's output is
                 processed, possible under async scheduling, adds nothing).
      steps: [{step, scheduled: {req_id: n}, preempted: [req_id] (sorted),
               block_ids: {req_id: [int]} (after schedule(), group 0; with
                          engine.kv_groups: {req_id: [[group 0 ids],
                          [group 1 ids], ...]}, null blocks as 0; empty
                          with KVSIM_ORACLE_NO_BLOCK_IDS=1),
               num_free_blocks, usage (both after this step's
                          update_from_output),
               prefix_cache: {requests, queries, hits, preempted_requests,
                              preempted_queries, preempted_hits},
               spec: {req_id: [num_scheduled_drafts, num_accepted]}
                     (spec decoding only; requests with scheduled drafts),
               num_free_blocks_after_schedule (async scheduling only)}]
      free_queue_end: [block ids, head to tail]
      totals: {prefix_cache_queries, prefix_cache_hits, prefix_cache_requests,
               preempted_queries, preempted_hits, preempted_requests}
      num_steps, num_schedule_calls: int
      error: str, stall: {...}, warnings: [str],
      engine_dead: {step, error: "ExceptionType: message"}   (only when they apply)
      timing: {build_s, drive_s}   (only with KVSIM_ORACLE_TIMING=1)
    """
    engine = scenario.get("engine", {})
    specs = list(scenario["requests"])
    ids = [str(s["req_id"]) for s in specs]
    if len(set(ids)) != len(ids):
        raise ValueError("duplicate req_id")

    t0 = time.perf_counter()
    sched, hasher, warnings, info = build_scheduler(engine)
    t_build = time.perf_counter() - t0
    kvm = sched.kv_cache_manager
    pool = kvm.block_pool
    spec_k = info["spec_k"]
    nested = info["nested_block_ids"]
    is_async = info["async"]
    queue_size = info["queue_size"]
    queue_rule = info["queue_rule"]
    worker = _OffloadWorker(sched, info["offload_delay"]) if info["offload_delay"] is not None else None
    if worker is not None:
        sched.finished_req_ids = _InsertionOrderedSet()

    out_tok = {str(s["req_id"]): int(s.get("output_token_id", -1)) for s in specs}
    accept_plan: dict[str, list[int]] = {}
    for s in specs:
        acc = s.get("accepted", [0])
        if not isinstance(acc, list) or not acc or any(
            not isinstance(a, int) or isinstance(a, bool) or a < 0 for a in acc
        ):
            raise ValueError(f"request {s['req_id']}: accepted must be a non-empty list of ints >= 0")
        accept_plan[str(s["req_id"])] = acc
    verify_count = dict.fromkeys(ids, 0)
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
    if worker is not None:
        for pr in per_req.values():
            pr["external_cached_tokens"] = None
    if spec_k:
        for pr in per_req.values():
            pr["num_draft_tokens"] = 0
            pr["num_accepted_tokens"] = 0
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
    if worker is not None:
        totals.update(dict.fromkeys(("external_prefix_cache_queries", "external_prefix_cache_hits",
                                     "external_prefix_cache_requests", "external_preempted_queries",
                                     "external_preempted_hits", "external_preempted_requests"), 0))
    error = None
    stall = None
    dead = None
    step = 0
    n_calls = 0
    # In-flight batches, newest first: (scheduler_output, model_runner_output,
    # step record or None, {req_id: (drafts, accepted)}).
    queue: collections.deque = collections.deque()
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

    def take_stats() -> dict:
        cst = _take_connector_stats(sched)
        if worker is not None:
            for k in _STAT_KEYS:
                name = k if k.startswith("preempted") else "prefix_cache_" + k
                totals["external_" + name] += cst[k]
        return cst

    def with_transfers(mro, so, call: int):
        """Run the worker's connector hooks for this step and attach its report."""
        if worker is not None:
            mro.kv_connector_output = worker.step(so, call)
        return mro

    def process_output(so, mro, rec, spec_info) -> None:
        """update_from_output for one batch, and what it produced."""
        if spec_k:
            for rid, (nd, na) in spec_info.items():
                r = sched.requests.get(rid)
                if r is not None and not r.is_finished():
                    per_req[rid]["num_draft_tokens"] += nd
                    per_req[rid]["num_accepted_tokens"] += na
        eco = sched.update_from_output(so, mro)
        if rec is None:
            return
        for client_outs in eco.values():
            for o in client_outs.outputs:
                rid = o.request_id
                pr = per_req.get(rid)
                if pr is None:  # pragma: no cover
                    continue
                if o.new_token_ids:
                    pr["num_output_tokens"] += len(o.new_token_ids)
                    if pr["first_token_step"] is None:
                        pr["first_token_step"] = rec["step"]
                if pr["cached_tokens"] is None:
                    ps = getattr(o, "prefill_stats", None)
                    if ps is not None:
                        pr["cached_tokens"] = int(ps.num_cached_tokens)
                        if worker is not None:
                            pr["external_cached_tokens"] = int(ps.num_external_cached_tokens)
                    elif getattr(o, "num_cached_tokens", None) is not None:
                        # pragma: no cover - older releases
                        pr["cached_tokens"] = int(o.num_cached_tokens)
                if o.finish_reason is not None:
                    pr["finish_step"] = rec["step"]
                    pr["finish_reason"] = str(o.finish_reason)
                    finished.add(rid)
        rec["num_free_blocks"] = int(pool.get_num_free_blocks())
        rec["usage"] = float(kvm.usage)
        if spec_k and not is_async and not getattr(so, "skip_drafts", False):
            # EngineCore.post_step: the drafts proposed in this step.
            d_ids = []
            for rid in so.num_scheduled_tokens:
                r = sched.requests.get(rid)
                if (
                    r is not None
                    and not r.is_finished()
                    and mro.sampled_token_ids[mro.req_id_to_index[rid]]
                ):
                    d_ids.append(rid)
            if d_ids:
                sched.update_draft_token_ids(
                    # Real drafts carry DRAFT_TOKEN_ID, never -1 (vLLM's placeholder).
                    _draft_token_ids(d_ids, [[DRAFT_TOKEN_ID] * spec_k for rid in d_ids])
                )

    while True:
        add_joined(step)
        if len(finished) == len(ids) and not queue:
            break
        if n_calls >= max_steps:
            error = f"max_steps ({max_steps}) exceeded"
            break

        if len(reqs) == len(finished) and not queue:
            # Idle: see the docstring.
            # EngineCore keeps stepping while finished ids are to be returned or the
            # connector has transfers in flight (Scheduler.has_requests).
            idle_error = False
            while sched.has_requests():
                so = sched.schedule()
                n_calls += 1
                if worker is not None:
                    sched.finished_req_ids = _InsertionOrderedSet()
                pst = _prefix_stats_dict(kvm.make_prefix_cache_stats())
                if so.total_num_scheduled_tokens != 0 or any(pst.values()) or any(
                    take_stats().values()
                ):
                    idle_error = True
                    break
                sched.update_from_output(so, with_transfers(_model_runner_output([], []), so, n_calls))
                if n_calls >= max_steps:
                    break
            if idle_error:
                error = "idle schedule() call scheduled tokens or recorded stats"
                break
            add_joined(min(int(s.get("join_step", 0)) for s in pending))
            continue

        if sched.has_requests():
            # Requests scheduled from the waiting queue in this call (new or
            # resumed) can carry drafts only as vLLM's padding placeholders.
            running_before = {r.request_id for r in sched.running} if spec_k else ()
            try:
                so = sched.schedule()
            except Exception as exc:  # noqa: BLE001 - vLLM's own failure: its engine core dies
                dead = {"step": step, "error": f"{type(exc).__name__}: {exc}"}
                error = f"engine died at step {step}: {dead['error']}"
                break
            n_calls += 1
            kv_out = None
            if worker is not None:
                sched.finished_req_ids = _InsertionOrderedSet()
                kv_out = worker.step(so, n_calls)  # this step's connector hooks, its report
            # Prefix-cache stats are recorded inside schedule(). Read and reset
            # them now, before make_stats() in update_from_output takes them.
            pstats = _prefix_stats_dict(kvm.make_prefix_cache_stats())
            totals["prefix_cache_queries"] += pstats["queries"]
            totals["prefix_cache_hits"] += pstats["hits"]
            totals["prefix_cache_requests"] += pstats["requests"]
            totals["preempted_queries"] += pstats["preempted_queries"]
            totals["preempted_hits"] += pstats["preempted_hits"]
            totals["preempted_requests"] += pstats["preempted_requests"]
            cstats = take_stats()

            nst = dict(so.num_scheduled_tokens)
            preempted = sorted(so.preempted_req_ids or ())
            executed = so.total_num_scheduled_tokens > 0

            if not executed and not preempted and not any(
                q[0].total_num_scheduled_tokens > 0 for q in queue
            ) and sched.get_num_unfinished_requests() > 0 and not (
                worker is not None
                and (worker.busy or kv_out is not None
                     or any(q[1].kv_connector_output is not None for q in queue))
            ):
                # Unfinished requests exist, nothing was scheduled and nothing
                # is in flight. With no connector nothing changes until a step
                # runs, so this is a stall. Requests that have not joined
                # cannot join either: they are waiting for a step that never
                # comes.
                running = [r.request_id for r in sched.running]
                waiting = [
                    rid for rid in reqs if rid not in finished and rid not in running
                ]
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

            rec = None
            spec_info: dict[str, tuple[int, int]] = {}
            if executed:
                # This call scheduled tokens: it is step number `step`. (A
                # call that scheduled nothing because it preempted everything
                # is not a step; its batch is empty.)
                block_ids = {}
                req_ids = list(nst)
                sampled = []
                spec_rec = {}
                sched_spec = so.scheduled_spec_decode_tokens or {}
                for rid in req_ids:
                    if WITHOUT_BLOCK_IDS:
                        pass
                    elif nested:
                        block_ids[rid] = [[int(b) for b in g] for g in kvm.get_block_ids(rid)]
                    else:
                        block_ids[rid] = [int(b) for b in kvm.get_block_ids(rid)[0]]
                    pr = per_req[rid]
                    if pr["first_scheduled_step"] is None:
                        pr["first_scheduled_step"] = step
                    r = reqs[rid]
                    # A partial prefill chunk must return no token.
                    if is_async:
                        samples = not r.is_prefill_chunk
                    else:
                        samples = r.num_computed_tokens >= r.num_tokens
                    n_acc = 0
                    scheduled_drafts = sched_spec.get(rid, ())
                    n_drafts = len(scheduled_drafts)
                    if n_drafts and samples and rid not in running_before:
                        # Placeholder drafts vLLM pads a one-token admission with: never
                        # accepted, and not one of the request's verify steps. (Told apart
                        # by admission, not by their -1 ids: under async scheduling every
                        # scheduled draft is a -1 placeholder.)
                        spec_rec[rid] = [n_drafts, 0]
                        spec_info[rid] = (n_drafts, 0)
                    elif n_drafts and samples:
                        plan = accept_plan[rid]
                        n_acc = min(plan[verify_count[rid] % len(plan)], n_drafts)
                        verify_count[rid] += 1
                        spec_rec[rid] = [n_drafts, n_acc]
                        spec_info[rid] = (n_drafts, n_acc)
                    sampled.append([out_tok[rid]] * (1 + n_acc) if samples else [])
                mro = _model_runner_output(req_ids, sampled)
                rec = {
                    "step": step,
                    "scheduled": nst,
                    "preempted": preempted,
                    "block_ids": block_ids,
                    "num_free_blocks": None,
                    "usage": None,
                    "prefix_cache": pstats,
                }
                if worker is not None:
                    rec["external_prefix_cache"] = cstats
                if spec_k:
                    rec["spec"] = spec_rec
                if is_async:
                    rec["num_free_blocks_after_schedule"] = int(pool.get_num_free_blocks())
                steps.append(rec)
                step += 1
            else:
                mro = _model_runner_output([], [])
            if worker is not None:
                mro.kv_connector_output = kv_out
            queue.appendleft((so, mro, rec, spec_info))
            if len(queue) < queue_size and (
                executed if queue_rule == "not_done" else executed or sched.has_requests()
            ):
                continue
        elif not queue:  # pragma: no cover - has_requests() False, nothing in flight
            error = "scheduler has no requests but requests are unfinished"
            break

        so, mro, rec, spec_info = queue.pop()
        process_output(so, mro, rec, spec_info)

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
    if dead is not None:
        result["engine_dead"] = dead
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
        # An optional cap on schedule() calls: vLLM itself can thrash forever in a tiny pool.
        return drive(scenario, max_steps=int(scenario.get("max_schedule_calls", 1_000_000)))
    except Exception as exc:  # noqa: BLE001
        import traceback

        traceback.print_exc()
        return {
            "vllm_version": VLLM_VERSION,
            "error": f"{type(exc).__name__}: {exc}",
            "exception": type(exc).__name__,
        }


def main(argv: list[str], drive_safe=None) -> int:
    """IN.json (a scenario or a list) to OUT.json through ``drive_safe`` (this driver's, or
    pd_driver.py's)."""
    drive_safe = drive_safe or _drive_safe
    if len(argv) != 3:
        print(f"usage: {argv[0]} IN.json OUT.json", file=sys.stderr)
        return 2
    with open(argv[1]) as f:
        data = json.load(f)
    if isinstance(data, list):
        result = [drive_safe(s) for s in data]
        failed = any("error" in r for r in result)
    else:
        result = drive_safe(data)
        failed = "error" in result
    tmp = argv[2] + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, argv[2])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
