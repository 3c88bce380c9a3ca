"""Scenario files: the only module that reads TOML.

A scenario has the sections ``[model]``, ``[hardware]``, ``[engine]``, ``[speculative]``,
``[workload]``, ``[cost]``, ``[run]`` and, for several replicas behind a router,
``[cluster]``. Engine keys carry vLLM's engine-argument names and take vLLM's default for the
chosen ``vllm_version`` when left out. Every key is declared once in ``SCHEMA`` below, with
its type, default and meaning; ``docs/scenario.md`` is checked against it. Bad input raises
``ConfigError`` naming the key.
"""

from __future__ import annotations

import difflib
import math
import re
import tomllib
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from kvsim import hf, presets, traces
from kvsim.errors import ConfigError
from kvsim.kv.hybrid import GroupSpec
from kvsim.layout import KVLayout, derive_layout, mamba_cache_mode
from kvsim.model import DTYPE_BYTES, KV_CACHE_DTYPE_BYTES, ModelCfg, attention_page_bytes_per_token
from kvsim.semantics import DEFAULT_VERSION, VERSIONS, Semantics, semantics_for

GiB = 1 << 30


@dataclass(frozen=True, slots=True)
class Key:
    """One scenario key: its type (``int``, ``float``, ``bool``, ``str``), default and doc.

    ``default=REQUIRED`` means the key must be given (or come from a preset); ``None`` means
    "derived" (documented in ``doc``). ``choices`` restricts strings; ``low`` bounds numbers
    from below (``low_open`` makes the bound strict).
    """

    name: str
    type: str
    default: Any
    doc: str
    choices: tuple = ()
    low: float | None = None
    low_open: bool = False
    high: float | None = None
    derived: bool = False  # a None default is computed from other keys (see doc)


REQUIRED = object()
RETENTION = 'int or "dense"'  # the type of prefix_cache_retention_interval

MODEL_KEYS = (
    Key("preset", "str", None,
        "A shipped model preset (`kvsim presets`), by name or Hugging Face id (`Qwen/Qwen3-32B`): "
        "a public config.json read as `config` is; any key below overrides it."),
    Key("config", "str", None,
        "A model's Hugging Face `config.json` (or a folder holding one), relative to the scenario: "
        "kvsim reads what vLLM reads (layers and their kinds, heads, MLA, MoE, MTP layers, dtype), "
        "counts the parameters from the shapes and derives the KV layout (`[[engine.kv_groups]]`, "
        "block sizes) as vLLM does. Any key below overrides it."),
    Key("name", "str", "custom", "Label used in outputs."),
    Key("num_hidden_layers", "int", REQUIRED, "Decoder layers (HF `num_hidden_layers`).", low=1),
    Key("hidden_size", "int", REQUIRED, "Model width.", low=1),
    Key("num_attention_heads", "int", REQUIRED, "Query heads.", low=1),
    Key("num_key_value_heads", "int", REQUIRED, "KV heads (GQA).", low=1),
    Key("head_dim", "int", REQUIRED, "Per-head dimension.", low=1),
    Key("intermediate_size", "int", REQUIRED, "MLP width (activation-memory estimate).", low=1),
    Key("vocab_size", "int", REQUIRED, "Vocabulary size (LM-head cost).", low=1),
    Key("num_params", "int", REQUIRED, "Total parameters (weight bytes and linear FLOPs).", low=1),
    Key("dtype", "str", "bfloat16", "Weight dtype.", choices=tuple(DTYPE_BYTES)),
    Key("max_position_embeddings", "int", REQUIRED, "Context length; the default `max_model_len`.", low=1),
    Key("num_active_params", "int", None, "Parameters active per token (MoE); default `num_params`.",
        low=1),
    Key("num_experts", "int", 0, "Routed experts per MoE layer (HF `num_experts`, `n_routed_experts` "
        "or `num_local_experts`); 0: a dense model.", low=0),
    Key("num_experts_per_tok", "int", 0, "Routed experts each token activates (MoE top-k).", low=0),
    Key("attention_type", "str", "gqa", "`gqa` (K and V per KV head) or `mla` (one latent of "
        "`kv_lora_rank + qk_rope_head_dim` per token and layer, replicated across TP ranks).",
        choices=("gqa", "mla")),
    Key("kv_lora_rank", "int", 0, "MLA latent width.", low=0),
    Key("qk_rope_head_dim", "int", 0, "MLA rotary key width.", low=0),
    Key("num_nextn_predict_layers", "int", 1, "MTP modules the checkpoint ships (more than one "
        "makes `mtp` multi-module).", low=0),
    Key("mtp_params", "int", 0, "Parameters of one MTP module's own weights: its decoder layer, "
        "input projection and norms (information; the cost model prices an MTP/EAGLE head as one "
        "average decoder layer).", low=0),
)

HARDWARE_KEYS = (
    Key("preset", "str", None, "Name of a shipped hardware preset; any key below overrides it."),
    Key("name", "str", "custom", "Label used in outputs."),
    Key("device_name", "str", "", "Device name as torch reports it (information only)."),
    Key("compute_capability", "str", None, "CUDA compute capability, `major.minor` (`9.0` for "
        "Hopper, `10.0` for B200, `12.0` for RTX PRO 6000 / RTX 50, `8.9` Ada, `8.0` A100): vLLM "
        "picks its attention kernels, and so MLA block sizes and a hybrid model's attention "
        "block, by it. Needed for MLA and hybrid models."),
    Key("peak_flops_per_s", "float", None, "Dense BF16/FP16 tensor-core peak, FLOP/s: needed by "
        "the roofline cost model (a fitted profile has the GPU's measured times).",
        low=0, low_open=True),
    Key("mem_bandwidth_bytes_per_s", "float", REQUIRED, "Device memory bandwidth, bytes/s.",
        low=0, low_open=True),
    Key("memory_bytes", "int", REQUIRED, "Device memory, bytes.", low=1),
    Key("interconnect_bandwidth_bytes_per_s", "float", None, "GPU-to-GPU bandwidth per direction "
        "(NVLink, or PCIe without it), bytes/s: the tensor parallel all-reduces; needed when "
        "`tensor_parallel_size` > 1.", low=0, low_open=True),
    Key("interconnect_latency_s", "float", 5e-6, "Latency of one step of a ring all-reduce, "
        "seconds.", low=0),
)

ENGINE_KEYS = (
    Key("vllm_version", "str", DEFAULT_VERSION, "The vLLM release whose accounting to reproduce.",
        choices=tuple(VERSIONS)),
    Key("block_size", "int", None, "Tokens per KV block (`--block-size`). Default as vLLM: the "
        "attention kernel's preferred size (16; 32 for MLA on Blackwell B200), raised for hybrid "
        "models until an attention page holds a Mamba state. With `kv_groups`: the lcm of the "
        "group block sizes.", low=1, derived=True),
    Key("num_gpu_blocks", "int", None,
        "The whole block pool, vLLM's reserved null block included (as `--num-gpu-blocks-override` "
        "means it). Left out: derived from memory like vLLM (see below).", low=2, derived=True),
    Key("gpu_memory_utilization", "float", None,
        "Fraction of device memory vLLM may use (default per version: 0.92 for 0.33).",
        low=0, low_open=True, high=1, derived=True),
    Key("kv_cache_memory_bytes", "int", None, "KV cache size in bytes (`--kv-cache-memory-bytes`); "
        "overrides the memory-based estimate.", low=1),
    Key("kv_cache_dtype", "str", "auto", "KV cache dtype (`auto` = model dtype).",
        choices=("auto", *KV_CACHE_DTYPE_BYTES)),
    Key("tensor_parallel_size", "int", 1, "GPUs per replica: weights, KV heads and FLOPs are split "
        "across them; each layer's two all-reduces cross `[hardware]`'s interconnect.", low=1),
    Key("enable_prefix_caching", "bool", True, "Automatic prefix caching."),
    Key("max_num_batched_tokens", "int", None, "Token budget per step. Default as `vllm serve`: "
        "8192 on a device with >= 70 GiB that is not an A100 (16384 at >= 160 GiB), else 2048.",
        low=1, derived=True),
    Key("max_num_seqs", "int", None, "Running-request cap. Default as `vllm serve`: 1024 at >= 70 GiB "
        "(not A100), else 256.", low=1, derived=True),
    Key("max_model_len", "int", None, "Longest sequence (prompt + output); default the model's "
        "`max_position_embeddings`, and may exceed it.", low=2, derived=True),
    Key("enable_chunked_prefill", "bool", True, "Split prompts across steps."),
    Key("long_prefill_token_threshold", "int", 0, "Per-step chunk cap for a request (0 = off).", low=0),
    Key("scheduling_policy", "str", "fcfs", "`fcfs` or `priority` (lower value first).",
        choices=("fcfs", "priority")),
    Key("scheduler_reserve_full_isl", "bool", True, "Admit a waiting request only if its whole "
        "prompt fits in free blocks."),
    Key("async_scheduling", "bool", None, "Asynchronous scheduling: the next step is scheduled "
        "while this one runs. Default: on, as in vLLM, except where vLLM's default turns it off: "
        "ngram drafting before 0.33 and draft_model drafting in 0.19/0.22 (`true` with ngram is "
        "refused before 0.33, as vLLM does).", derived=True),
    Key("kv_groups", "groups", None, "Hybrid layout: a list of `[[engine.kv_groups]]` tables (keys "
        "below). Each group's `block_size` replaces `engine.block_size`; all groups share the pool. "
        "Default: the layout vLLM builds for the model (from its config.json: sliding-window and "
        "linear-attention layers), else one full-attention pool.", derived=True),
    Key("mamba_cache_mode", "str", None, "How Mamba / GatedDeltaNet states are cached "
        "(`--mamba-cache-mode`): `align` (prefix caching on), `none` (off); vLLM 0.19/0.22 also "
        "have `all`, which GatedDeltaNet models turn into `align`. Default from "
        "`enable_prefix_caching`, as vLLM sets it.", choices=("none", "align", "all"), derived=True),
    Key("prefix_cache_retention_interval", RETENTION, None, "Which sliding-window and Mamba "
        "checkpoints the prefix cache keeps (`--prefix-cache-retention-interval`, vLLM 0.32+): `0` "
        "only a prompt's replay boundary and the shared-prefix junctions lookups find; a positive "
        "multiple of the scheduler block size (the lcm of the group block sizes) also one per "
        "that many tokens; `\"dense\"` (vLLM's `None`) one at every scheduler block. Default: the "
        "release's (`0` for 0.32 and 0.33; `\"dense\"` before 0.32, which has no such setting).",
        derived=True),
)

GROUP_KEYS = (
    Key("kind", "str", REQUIRED, "`full_attention`, `sliding_window` or `mamba` (one Mamba group at "
        "most, in a layout whose groups all share its `block_size`, as vLLM sizes attention "
        "blocks for Mamba models; prefix caching on means vLLM's `mamba_cache_mode = \"align\"`).",
        choices=("full_attention", "sliding_window", "mamba")),
    Key("block_size", "int", REQUIRED, "Tokens per block of this group.", low=1),
    Key("sliding_window", "int", None, "Window in tokens (sliding_window groups only).", low=1),
    Key("eagle", "bool", False, "Holds the drafter's layer (EAGLE/MTP). With an EAGLE-family "
        "method and no group marked, every group is, as in vLLM."),
    Key("num_layers", "int", None, "Layers in this group (memory estimate only).", low=1),
    Key("prefill_checkpoint_alignment", "int", None, "Mamba groups, vLLM 0.32+: the layers "
        "export a prefix-cache state from inside a prefill chunk at offsets that are multiples "
        "of this many tokens (vLLM's `MambaSpec.prefill_checkpoint_alignment`): `1` for Mamba2 "
        "layers (NemotronH, Bamba, Granite 4, Falcon-H1, Zamba2), the `block_size` for "
        "GatedDeltaNet (Qwen3-Next, Qwen3.5) with the FlashInfer prefill kernel. Left out "
        "(Mamba1 layers: Jamba; GDN on the FLA kernel) the scheduler ends a chunk at the "
        "checkpoint instead.", low=1),
)

SPEC_METHODS = ("none", "ngram", "eagle", "eagle3", "mtp", "draft_model")
EAGLE_METHODS = ("eagle", "eagle3", "mtp")


def num_prefill_lookahead(method: str, k: int, num_nextn_predict_layers: int, sem: Semantics) -> int:
    """vLLM 0.32+'s num_prefill_lookahead_tokens: how far an EAGLE-family drafter reads past
    a prefill chunk (1; k for multi-module MTP, each module one token further)."""
    if method not in EAGLE_METHODS or not sem.has_prefill_lookahead:
        return 0
    return k if method == "mtp" and min(num_nextn_predict_layers, k) > 1 else 1


SPECULATIVE_KEYS = (
    Key("method", "str", "none", "Speculative decoding method, as vLLM's `--speculative-config` "
        "`method`.", choices=SPEC_METHODS),
    Key("num_speculative_tokens", "int", None, "Drafts per step, k (required with a method).", low=1),
    Key("acceptance", "str", "per_position", "Acceptance model: `per_position` (drafts accepted "
        "before the first rejection, position i accepted with probability `acceptance_rates[i]`, "
        "seeded per request), `fixed` (`num_accepted` per step), or `trace` (each request's "
        "`accepted` list from the trace, cycled).", choices=("per_position", "fixed", "trace")),
    Key("acceptance_rates", "floats", None, "Per-position acceptance probability, given the "
        "previous draft was accepted; default 0.7 at every position.", low=0, high=1),
    Key("num_accepted", "int", None, "Drafts accepted per verify step (acceptance = fixed).", low=0),
    Key("draft_model", "str", None, "Model preset of the draft model (method = draft_model); "
        "costs its forward passes. Default: the target model's preset."),
    Key("disable_eagle_block_drop", "bool", False, "vLLM's opt-out of the EAGLE last-block drop "
        "(0.32 and later)."),
    Key("disable_lookahead_block_hashes", "bool", False, "vLLM 0.33: go back from lookahead "
        "block hashes to the block drop."),
    Key("parallel_drafting", "bool", False, "Parallel drafting (P-EAGLE / PARD): more input "
        "slots per request."),
)

TRACE_FORMATS = ("kvsim", "mooncake", "azure")
GENERATOR_NAMES = ("shared_prefix", "multi_turn", "rag", "agent", "trace_lengths")
TRACE_ONLY_KEYS = ("path", "format", "speedup", "window_start_s", "window_end_s", "sample_fraction")

WORKLOAD_KEYS = (
    Key("kind", "str", "synthetic", "`trace` (read a file) or `synthetic` (generate).",
        choices=("trace", "synthetic")),
    Key("trace", "str", None, "A known public trace by name (`kvsim traces`), read from the trace "
        "cache (`$KVSIM_TRACE_DIR`, else `~/.cache/kvsim/traces`). Give `trace` or `path`."),
    Key("path", "str", None, "Trace file, relative to the scenario file (kind = trace, "
        "arrival = trace, or generator = trace_lengths)."),
    Key("format", "str", None, "Trace format: `kvsim` JSONL, `mooncake` JSONL (hash ids), `azure` "
        "CSV. Default: the named trace's format, else `kvsim`.", choices=TRACE_FORMATS, derived=True),
    Key("speedup", "float", 1.0, "Replay the trace this many times faster: arrival times (after the "
        "window) are divided by it.", low=0, low_open=True),
    Key("window_start_s", "float", 0.0, "Keep trace requests arriving at or after this trace time, "
        "seconds; it becomes t = 0.", low=0),
    Key("window_end_s", "float", None, "Keep trace requests arriving before this trace time, seconds "
        "(default: to the end).", low=0, low_open=True),
    Key("sample_fraction", "float", 1.0, "Keep this fraction of the trace's requests in the window, "
        "drawn without replacement with the run's seed, in trace order.", low=0, low_open=True,
        high=1),
    Key("generator", "str", "shared_prefix", "Synthetic generator (kind = synthetic; see Workloads).",
        choices=GENERATOR_NAMES),
    Key("arrival", "str", "poisson", "Arrival process of the requests (`shared_prefix`, `rag`) or of "
        "the conversations / sessions (`multi_turn`, `agent`): `poisson` at `request_rate`, `gamma` "
        "(mean rate `request_rate`, inter-arrival CV `arrival_cv`), `trace` (the arrival times of "
        "the trace given by `trace` or `path`, after window, sampling and speedup).",
        choices=("poisson", "gamma", "trace")),
    Key("arrival_cv", "float", 2.0, "Coefficient of variation of gamma inter-arrival times (1: "
        "Poisson; above 1: bursty).", low=0, low_open=True),
    Key("num_requests", "int", 100, "Requests to generate.", low=1),
    Key("request_rate", "float", 10.0, "Mean arrival rate, per second, of requests or of "
        "conversations / sessions (`inf`: all at t = 0).", low=0, low_open=True),
    Key("system_prompt_tokens", "int", 512, "Prefix shared by every request.", low=0),
    Key("num_users", "int", 8, "shared_prefix: users; each request belongs to one, drawn "
        "uniformly.", low=1),
    Key("user_history_tokens", "int", 1024, "shared_prefix: per-user prefix after the system "
        "prompt, shared by that user's requests.", low=0),
    Key("input_tokens", "int", 128, "Fresh tokens per request: shared_prefix and rag: the question "
        "at the end; multi_turn: each new user message; agent: mean tool observation "
        "(exponential).", low=1),
    Key("output_tokens", "int", 128, "Tokens each request generates (`max_tokens`).", low=1),
    Key("turns", "int", 4, "multi_turn: requests per conversation; agent: steps per session.",
        low=1),
    Key("think_time_s", "float", 5.0, "multi_turn, agent: mean time (exponential) from one turn's "
        "arrival to the next (reading and typing, or the tool call).", low=0),
    Key("context_tokens", "int", 8192, "agent: per-session context after the system prompt (task, "
        "files), shared by that session's steps only.", low=0),
    Key("num_documents", "int", 1000, "rag: documents in the pool.", low=1),
    Key("documents_per_request", "int", 4, "rag: documents in each prompt (distinct).", low=1),
    Key("document_tokens", "int", 1024, "rag: tokens per document.", low=1),
    Key("zipf_s", "float", 1.0, "rag: document popularity exponent: the document of rank r is "
        "drawn with weight r^-s (0: uniform).", low=0),
    Key("acceptance_rate_mean", "float", None, "Give every request an `accepted` list (for "
        "speculative.acceptance = 'trace'; requests that carry one keep it): a per-request "
        "acceptance rate p drawn from a beta distribution with this mean, each draft position "
        "accepted with probability p until the first rejection.", low=0, high=1),
    Key("acceptance_rate_sd", "float", 0.1, "Standard deviation of the per-request acceptance "
        "rate (0: every request has the mean).", low=0),
)

COST_KEYS = (
    Key("model", "str", None, "Step-time model: `roofline` (uncalibrated, from `[hardware]` numbers) "
        "or `fitted` (a calibration profile, `kvsim calibrate`); default `fitted` when `profile` is "
        "given, else `roofline`.", choices=("roofline", "fitted"), derived=True),
    Key("profile", "str", None, "Cost profile written by `kvsim calibrate` (a JSON file, relative to "
        "the scenario) or a shipped profile's name (`rtxpro6000-llama-3.1-8b-tp1`, ...); it must be "
        "for the scenario's model shape and `tensor_parallel_size`."),
    Key("compute_efficiency", "float", 0.6, "Fraction of peak FLOP/s a step reaches.", low=0,
        low_open=True, high=1),
    Key("bandwidth_efficiency", "float", 0.8, "Fraction of peak bandwidth a step reaches.", low=0,
        low_open=True, high=1),
    Key("step_overhead_s", "float", 0.002, "Fixed per-step engine overhead, seconds, added to either "
        "model: vLLM's CPU work between steps (scheduling, input preparation, sampling) and kernel "
        "launch gaps, which layer timings do not see (not added to a profile fitted to whole engine steps, "
        "whose fixed term holds it).", low=0),
)

RUN_KEYS = (
    Key("seed", "int", 0, "Seed for every random choice (same seed, same output).", low=0),
    Key("max_requests", "int", None, "Use only the first N requests of the workload (of a trace: after its "
        "window and sampling).", low=1),
    Key("max_sim_time_s", "float", None, "Stop the clock here; unfinished requests are reported "
        "unfinished.", low=0, low_open=True),
    Key("max_steps", "int", None, "Stop after this many engine steps.", low=1),
)

ROUTERS = ("round_robin", "random", "least_loaded", "prefix_aware", "session_affinity")
# Engine keys every replica of a cluster shares: they decide the block hashes a prefix-aware
# router compares across replicas (one deployment: one model, one vLLM image, one block size).
SHARED_ENGINE_KEYS = ("vllm_version", "block_size", "kv_groups")

CLUSTER_KEYS = (
    Key("replicas", "int", 1, "Replicas behind the router, each a whole vLLM engine (`[engine]`) "
        "with its own KV cache. With `[[cluster.deployment]]` tables: their total (leave it out).",
        low=1),
    Key("router", "str", "round_robin", "Routing policy, decided when a request arrives: "
        "`round_robin`, `random` (seeded by `run.seed`), `least_loaded` (by `load_metric`), "
        "`prefix_aware` (longest cached prefix against pending work, see `load_weight`), "
        "`session_affinity` (sticky by the request's session id). See Clusters.",
        choices=ROUTERS),
    Key("load_metric", "str", "requests", "The load `least_loaded` and `session_affinity` "
        "balance: `requests` (waiting + running + routed but not yet admitted) or `kv_usage` "
        "(vLLM's KV-cache usage).", choices=("requests", "kv_usage")),
    Key("load_weight", "float", 0.5, "prefix_aware: w in score = (1 - w) * cached prefix tokens "
        "- w * pending tokens; 0 follows the cache alone, 1 the pending work alone, 0.5 trades "
        "them token for token.", low=0, high=1),
    Key("deployment", "deployments", None, "Replicas with their own engine settings: a list of "
        "`[[cluster.deployment]]` tables (keys below), replicas numbered in table order."),
)

DEPLOYMENT_REPLICAS = Key("replicas", "int", 1, "Replicas of this deployment.", low=1)

SCHEMA: dict[str, tuple[Key, ...]] = {
    "model": MODEL_KEYS, "hardware": HARDWARE_KEYS, "engine": ENGINE_KEYS,
    "speculative": SPECULATIVE_KEYS, "workload": WORKLOAD_KEYS, "cost": COST_KEYS, "run": RUN_KEYS,
    "cluster": CLUSTER_KEYS,
}


@dataclass(frozen=True, slots=True)
class HardwareCfg:
    name: str
    device_name: str
    mem_bandwidth_bytes_per_s: float
    memory_bytes: int
    peak_flops_per_s: float | None = None
    interconnect_bandwidth_bytes_per_s: float | None = None
    interconnect_latency_s: float = 5e-6
    compute_capability: str | None = None

    @property
    def capability(self) -> tuple[int, int] | None:
        """compute_capability as (major, minor), or None if not given."""
        if self.compute_capability is None:
            return None
        major, minor = self.compute_capability.split(".")
        return int(major), int(minor)


@dataclass(frozen=True, slots=True)
class EngineCfg:
    vllm_version: str
    block_size: int
    num_gpu_blocks: int
    num_gpu_blocks_derived: bool
    gpu_memory_utilization: float
    kv_cache_memory_bytes: int | None
    kv_cache_dtype: str
    tensor_parallel_size: int
    enable_prefix_caching: bool
    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int
    enable_chunked_prefill: bool
    long_prefill_token_threshold: int
    scheduling_policy: str
    scheduler_reserve_full_isl: bool
    async_scheduling: bool
    kv_groups: tuple[GroupSpec, ...] | None = None
    prefix_cache_retention_interval: int | str = 0  # an interval >= 0 or "dense"
    mamba_cache_mode: str = "none"

    @property
    def retention_interval(self) -> int | None:
        """The setting as vLLM's KVCacheConfig holds it (None: dense)."""
        return vllm_retention(self.prefix_cache_retention_interval)

    @property
    def semantics(self) -> Semantics:
        sem = semantics_for(self.vllm_version)
        assert sem is not None  # checked at load
        return sem


@dataclass(frozen=True, slots=True)
class SpecCfg:
    method: str = "none"
    num_speculative_tokens: int = 0
    acceptance: str = "per_position"
    acceptance_rates: tuple[float, ...] = ()
    num_accepted: int = 0
    draft_model: str | None = None
    disable_eagle_block_drop: bool = False
    disable_lookahead_block_hashes: bool = False
    parallel_drafting: bool = False

    @property
    def enabled(self) -> bool:
        return self.method != "none"

    @property
    def eagle_family(self) -> bool:
        return self.method in EAGLE_METHODS


@dataclass(frozen=True, slots=True)
class WorkloadCfg:
    kind: str
    format: str
    path: Path | None
    generator: str
    num_requests: int
    request_rate: float
    system_prompt_tokens: int
    num_users: int
    user_history_tokens: int
    input_tokens: int
    output_tokens: int
    trace: str | None = None
    speedup: float = 1.0
    window_start_s: float = 0.0
    window_end_s: float | None = None
    sample_fraction: float = 1.0
    arrival: str = "poisson"
    arrival_cv: float = 2.0
    turns: int = 4
    think_time_s: float = 5.0
    context_tokens: int = 8192
    num_documents: int = 1000
    documents_per_request: int = 4
    document_tokens: int = 1024
    zipf_s: float = 1.0
    acceptance_rate_mean: float | None = None
    acceptance_rate_sd: float = 0.1

    @property
    def reads_trace(self) -> bool:
        """A trace file is read: for its requests, or for arrival times or lengths only."""
        return self.kind == "trace" or self.arrival == "trace" or (
            self.kind == "synthetic" and self.generator == "trace_lengths")


@dataclass(frozen=True, slots=True)
class CostCfg:
    model: str
    compute_efficiency: float
    bandwidth_efficiency: float
    step_overhead_s: float
    profile: str | None = None  # resolved path of the calibration profile (model = fitted)


@dataclass(frozen=True, slots=True)
class RunCfg:
    seed: int
    max_requests: int | None
    max_sim_time_s: float | None
    max_steps: int | None


@dataclass(frozen=True, slots=True)
class ClusterCfg:
    replicas: int
    router: str
    load_metric: str
    load_weight: float
    # [[cluster.deployment]] tables as given: (replicas, ((engine key, value), ...)) each.
    deployment: tuple[tuple[int, tuple[tuple[str, Any], ...]], ...] | None
    engines: tuple[EngineCfg, ...]  # one per replica, in replica order


@dataclass(frozen=True, slots=True)
class Scenario:
    path: Path | None
    model: ModelCfg
    hardware: HardwareCfg
    engine: EngineCfg
    speculative: SpecCfg
    workload: WorkloadCfg
    cost: CostCfg
    run: RunCfg
    cluster: ClusterCfg | None = None  # None: one engine, no router (a plain run)

    def replica(self, i: int) -> Scenario:
        """The scenario replica ``i`` of the cluster runs (its own engine settings)."""
        assert self.cluster is not None
        return replace(self, engine=self.cluster.engines[i], cluster=None)


# -- parsing ------------------------------------------------------------------------------


def _suggest(name: str, known: list[str]) -> str:
    close = difflib.get_close_matches(name, known, n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _tables(where: str, value: Any, section: str) -> list[dict]:
    """A non-empty TOML array of tables (``[[section]]``), or ConfigError."""
    if not isinstance(value, list) or not value or not all(isinstance(t, dict) for t in value):
        raise ConfigError(where, f"must be a list of tables ([[{section}]])")
    return value


def _check_groups(where: str, value: Any) -> tuple:
    value = _tables(where, value, "engine.kv_groups")
    keys = {k.name: k for k in GROUP_KEYS}
    out = []
    for i, table in enumerate(value):
        w = f"{where}[{i}]"
        for name in table:
            if name not in keys:
                raise ConfigError(f"{w}.{name}", f"unknown key{_suggest(name, list(keys))}")
        g = {}
        for k in GROUP_KEYS:
            if k.name in table:
                g[k.name] = _check_value(f"{w}.{k.name}", k, table[k.name])
            elif k.default is REQUIRED:
                raise ConfigError(f"{w}.{k.name}", "missing")
            else:
                g[k.name] = k.default
        if (g["kind"] == "sliding_window") != (g["sliding_window"] is not None):
            raise ConfigError(f"{w}.sliding_window", "required for a sliding_window group"
                              if g["kind"] == "sliding_window" else "only for sliding_window groups")
        if g["prefill_checkpoint_alignment"] is not None and g["kind"] != "mamba":
            raise ConfigError(f"{w}.prefill_checkpoint_alignment", "only for mamba groups")
        out.append(GroupSpec(kind=g["kind"], block_size=g["block_size"],
                             sliding_window=g["sliding_window"] or 0, eagle=g["eagle"],
                             num_layers=g["num_layers"],
                             prefill_checkpoint_alignment=g["prefill_checkpoint_alignment"]))
    mamba = [i for i, g in enumerate(out) if g.kind == "mamba"]
    if len({out[i].prefill_checkpoint_alignment for i in mamba}) > 1:
        raise ConfigError(f"{where}[{mamba[1]}].prefill_checkpoint_alignment", "every mamba group "
                          "must have the same (vLLM's Mamba layers share one checkpoint grid)")
    if mamba and len({g.block_size for g in out}) > 1:
        raise ConfigError(f"{where}[{mamba[0]}].block_size", "with a mamba group every group must "
                          "use the mamba block_size (vLLM's layout for Mamba models; sub-block "
                          "Mamba hits are not modelled)")
    return tuple(out)


def _check_deployments(where: str, value: Any) -> tuple:
    """``[[cluster.deployment]]`` tables: ``replicas`` plus [engine] keys to override."""
    value = _tables(where, value, "cluster.deployment")
    engine_keys = {k.name: k for k in ENGINE_KEYS}
    out = []
    for i, table in enumerate(value):
        w = f"{where}[{i}]"
        overrides = []
        for name, v in table.items():
            if name == "replicas":
                continue
            if name in SHARED_ENGINE_KEYS:
                raise ConfigError(f"{w}.{name}", f"every replica shares {', '.join(SHARED_ENGINE_KEYS)}"
                                  " (a router compares block hashes across replicas); set it in "
                                  "[engine]")
            if name not in engine_keys:
                raise ConfigError(f"{w}.{name}", "unknown key (a deployment takes replicas and "
                                  f"[engine] keys){_suggest(name, ['replicas', *engine_keys])}")
            overrides.append((name, _check_value(f"{w}.{name}", engine_keys[name], v)))
        n = _check_value(f"{w}.replicas", DEPLOYMENT_REPLICAS, table.get("replicas", 1))
        out.append((n, tuple(overrides)))
    return tuple(out)


def _check_value(where: str, key: Key, value: Any) -> Any:
    t = key.type
    if t == "groups":
        return _check_groups(where, value)
    if t == "deployments":
        return _check_deployments(where, value)
    if t == "floats":
        if (not isinstance(value, list) or not value
                or not all(isinstance(x, int | float) and not isinstance(x, bool) for x in value)):
            raise ConfigError(where, f"must be a non-empty list of numbers, got {value!r}")
        value = [float(x) for x in value]
        if any(not (key.low or 0) <= x <= (key.high if key.high is not None else math.inf)
               or math.isnan(x) for x in value):
            raise ConfigError(where, f"entries must lie in [{key.low:g}, {key.high:g}], got {value!r}")
        return tuple(value)
    if t == RETENTION:
        if value == "dense":
            return value
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(where, f'must be an integer >= 0 or "dense", got {value!r}')
        return value
    if t == "bool":
        if not isinstance(value, bool):
            raise ConfigError(where, f"must be true or false, got {value!r}")
        return value
    if t == "str":
        if not isinstance(value, str):
            raise ConfigError(where, f"must be a string, got {value!r}")
        if key.choices and value not in key.choices:
            raise ConfigError(where, f"must be one of {', '.join(map(repr, key.choices))}, "
                              f"got {value!r}{_suggest(value, list(key.choices))}")
        return value
    if t == "int":
        if isinstance(value, float) and value.is_integer() and abs(value) < 2**62:
            value = int(value)  # 1e9 style
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(where, f"must be an integer, got {value!r}")
    elif t == "float":
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(where, f"must be a number, got {value!r}")
        value = float(value)
        if math.isnan(value):
            raise ConfigError(where, "must be a number, got nan")
    if key.low is not None and (value < key.low or (key.low_open and value == key.low)):
        bound = f"greater than {key.low:g}" if key.low_open else f"at least {key.low:g}"
        raise ConfigError(where, f"must be {bound}, got {value!r}")
    if key.high is not None and value > key.high:
        raise ConfigError(where, f"must be at most {key.high:g}, got {value!r}")
    return value


def _section(raw: dict, section: str, file: str) -> dict[str, Any]:
    """Validate one section: unknown keys, types, ranges, presets. Returns key -> value."""
    table = raw.get(section, {})
    if not isinstance(table, dict):
        raise ConfigError(f"{file}: {section}", "must be a table ([" + section + "])")
    keys = {k.name: k for k in SCHEMA[section]}
    for name in table:
        if name not in keys:
            raise ConfigError(f"{file}: {section}.{name}",
                              f"unknown key{_suggest(name, list(keys))}")
    merged: dict[str, Any] = {}
    preset_name = table.get("preset")
    if preset_name is not None:
        _check_value(f"{file}: {section}.preset", keys["preset"], preset_name)
        kind = "models" if section == "model" else "hardware"
        data = presets.load(kind, preset_name)
        if data is None:
            known = presets.names(kind)
            raise ConfigError(f"{file}: {section}.preset",
                              f"unknown preset {preset_name!r}{_suggest(preset_name, known)}; "
                              f"known: {', '.join(known)}")
        merged.update({k: v for k, v in data.items() if k in keys})
    merged.update(table)
    out = {}
    for key in SCHEMA[section]:
        where = f"{file}: {section}.{key.name}"
        if key.name in merged:
            out[key.name] = _check_value(where, key, merged[key.name])
        elif key.default is REQUIRED:
            hint = " (or name a preset with 'preset = ...')" if "preset" in keys else ""
            raise ConfigError(where, f"missing{hint}")
        else:
            out[key.name] = key.default
    return out


def _build(cls, values: dict[str, Any]):
    return cls(**{f.name: values[f.name] for f in fields(cls) if f.name in values})


def model_preset(name: str, where: str = "--model") -> ModelCfg:
    """The model of shipped preset ``name`` (or its Hugging Face id). Raises ConfigError
    naming ``where``."""
    data = presets.load("models", name)
    if data is None:
        known = presets.names("models")
        raise ConfigError(where, f"unknown model preset {name!r}{_suggest(name, known)}; "
                          f"known: {', '.join(known)}")
    return hf.model_from_config(data["config"], f"kvsim/presets/models/{data['name']}.json",
                                name=data["name"], hf_id=data.get("hf_id", ""),
                                preset=data["name"])


def model_from_path(path: str | Path) -> ModelCfg:
    """The model of a config.json (or a folder holding one). Raises ConfigError."""
    data, p = hf.read_config_file(path)
    return hf.model_from_config(data, str(p), name=p.parent.name, config=str(p.resolve()))


def _model(raw: dict, file: str, base: Path | None) -> ModelCfg:
    """[model]: a preset or a config.json, with keys overriding it, or every key by hand."""
    table = raw.get("model", {})
    if not isinstance(table, dict):
        raise ConfigError(f"{file}: model", "must be a table ([model])")
    where = f"{file}: model"
    if "preset" in table and "config" in table:
        raise ConfigError(f"{where}.config", "give preset or config, not both")
    if "preset" not in table and "config" not in table:
        return _build(ModelCfg, _section(raw, "model", file))
    keys = {k.name: k for k in MODEL_KEYS}
    for name in table:
        if name not in keys:
            raise ConfigError(f"{where}.{name}", f"unknown key{_suggest(name, list(keys))}")
    if "preset" in table:
        name = _check_value(f"{where}.preset", keys["preset"], table["preset"])
        model = model_preset(name, f"{where}.preset")
    else:
        path = Path(_check_value(f"{where}.config", keys["config"], table["config"])).expanduser()
        if not path.is_absolute() and base is not None:
            path = base / path
        model = model_from_path(path)
    overrides = {k: _check_value(f"{where}.{k}", keys[k], v) for k, v in table.items()
                 if k not in ("preset", "config")}
    n = overrides.get("num_hidden_layers")
    if n is not None and model.layer_types and n != len(model.layer_types):
        raise ConfigError(f"{where}.num_hidden_layers", f"{n} differs from the {len(model.layer_types)} "
                          f"layer kinds of {model.preset or model.config}")
    return replace(model, **overrides)


def estimate_kv_cache_bytes(model: ModelCfg, hw: HardwareCfg, util: float, tp: int,
                            max_num_batched_tokens: int, max_num_seqs: int) -> tuple[int, dict]:
    """vLLM's "available KV cache memory", estimated without profiling.

    ``memory × gpu_memory_utilization − weights − activation peak − non-torch memory``, where
    the activation peak stands in for vLLM's profile run (a ``max_num_batched_tokens`` forward
    pass: MLP intermediate and residual stream, plus float32 logits for ``max_num_seqs``
    sampled rows) and non-torch memory (CUDA context, graphs, NCCL) is taken as 1 GiB.
    """
    weights = model.weight_bytes // tp
    activation = (max_num_batched_tokens * (2 * model.intermediate_size // tp + 4 * model.hidden_size)
                  * model.dtype_bytes + max_num_seqs * model.vocab_size * 4)
    non_torch = 1 * GiB
    avail = int(hw.memory_bytes * util) - weights - activation - non_torch
    return avail, {"weights_bytes": weights, "activation_bytes": activation,
                   "non_torch_bytes": non_torch}


def _engine(raw: dict, file: str, model: ModelCfg, hw: HardwareCfg) -> EngineCfg:
    e = _section(raw, "engine", file)
    where = f"{file}: engine"
    sem = semantics_for(e["vllm_version"])
    method = (raw.get("speculative") or {}).get("method", "none")
    ngram = method == "ngram"
    if e["async_scheduling"] is None:
        e["async_scheduling"] = sem.async_modelled and method not in sem.async_default_off_methods
    elif e["async_scheduling"] and ngram and not sem.async_allows_ngram:
        raise ConfigError(f"{where}.async_scheduling", f"vLLM {sem.version} refuses ngram "
                          "drafting with asynchronous scheduling")
    elif e["async_scheduling"] and not sem.async_modelled:
        raise ConfigError(f"{where}.async_scheduling",
                          f"vLLM {sem.version}'s asynchronous scheduler is not modelled yet "
                          f"(modelled: {', '.join(v for v, s in VERSIONS.items() if s.async_modelled)}); "
                          "set it to false")
    big = hw.memory_bytes >= 70 * GiB and "a100" not in (hw.name + hw.device_name).lower()
    if e["max_num_batched_tokens"] is None:
        e["max_num_batched_tokens"] = 16384 if hw.memory_bytes >= 160 * GiB else 8192 if big else 2048
    if e["max_num_seqs"] is None:
        e["max_num_seqs"] = 1024 if big or hw.memory_bytes >= 160 * GiB else 256
    if e["max_model_len"] is None:
        e["max_model_len"] = model.max_position_embeddings
    if e["gpu_memory_utilization"] is None:
        e["gpu_memory_utilization"] = sem.default_gpu_memory_utilization
    tp = e["tensor_parallel_size"]
    if model.num_attention_heads % tp:
        raise ConfigError(f"{where}.tensor_parallel_size",
                          f"{tp} does not divide num_attention_heads ({model.num_attention_heads})")
    if tp > 1 and hw.interconnect_bandwidth_bytes_per_s is None:
        raise ConfigError(f"{file}: hardware.interconnect_bandwidth_bytes_per_s",
                          f"needed for tensor_parallel_size {tp} (each layer's all-reduces)")
    # vLLM's own start-up checks (SchedulerConfig.verify_max_model_len).
    mnbt, mml = e["max_num_batched_tokens"], e["max_model_len"]
    if not e["enable_chunked_prefill"] and mnbt < mml:
        raise ConfigError(f"{where}.max_num_batched_tokens",
                          f"{mnbt} is smaller than max_model_len ({mml}) with chunked prefill off; "
                          "vLLM refuses this")
    if mnbt < e["max_num_seqs"]:
        raise ConfigError(f"{where}.max_num_batched_tokens",
                          f"{mnbt} must be at least max_num_seqs ({e['max_num_seqs']})")
    if e["long_prefill_token_threshold"] > mml:
        raise ConfigError(f"{where}.long_prefill_token_threshold",
                          f"{e['long_prefill_token_threshold']} exceeds max_model_len ({mml})")
    k = (raw.get("speculative") or {}).get("num_speculative_tokens")
    # Speculative tokens, for Mamba's state blocks and a window's re-prefillable tail (k is
    # checked with [speculative] below).
    nsb = k if method != "none" and isinstance(k, int) and not isinstance(k, bool) and k > 0 else 0
    if e["mamba_cache_mode"] == "all" and "all" not in sem.layout.mamba_cache_modes:
        raise ConfigError(f"{where}.mamba_cache_mode", f"vLLM {sem.version} has no mode 'all' "
                          f"(it has {', '.join(map(repr, sem.layout.mamba_cache_modes))})")
    if e["kv_groups"] is None:
        layout = _layout(model, hw, e, sem, nsb, f"{file}: ")
        e["kv_groups"], e["block_size"] = layout.groups, layout.block_size
        e["mamba_cache_mode"] = layout.mamba_cache_mode
        block_bytes = layout.block_bytes
    else:
        # Groups by hand: vLLM's hybrid allocator gives every group the same number of layers,
        # and one block id spans one page in each of those layers: a group's worth of layers.
        groups = e["kv_groups"]
        per_layer = attention_page_bytes_per_token(model, e["kv_cache_dtype"], tp)
        layers = max((g.num_layers or 0 for g in groups), default=0) or -(-model.num_hidden_layers
                                                                         // len(groups))
        block_bytes = int(per_layer * max(g.block_size for g in groups) * layers)
        e["block_size"] = math.lcm(*(g.block_size for g in groups))
        e["mamba_cache_mode"] = mamba_cache_mode(sem.layout, e["mamba_cache_mode"],
                                                 e["enable_prefix_caching"]) if any(
            g.kind == "mamba" for g in groups) else "none"
    groups = e["kv_groups"]
    mamba = [g for g in groups or () if g.kind == "mamba"]
    if mamba and e["enable_prefix_caching"] and sem.hybrid.mamba_split == "last_block":
        # 0.19/0.22 round every prefill chunk down to the block: a block larger than a chunk
        # can ever be means no prompt longer than one block is ever scheduled (vLLM stalls).
        b, limit = mamba[0].block_size, mnbt
        if e["long_prefill_token_threshold"] > 0:
            limit = min(limit, e["long_prefill_token_threshold"])
        if b > limit:
            raise ConfigError(f"{where}.kv_groups", f"the mamba block_size ({b}) exceeds the "
                              f"largest prefill chunk ({limit}): vLLM {sem.version}'s aligned "
                              "split can never schedule a longer prompt (the engine stalls)")
    derived = e["num_gpu_blocks"] is None
    if derived:
        if e["kv_cache_memory_bytes"] is not None:
            avail = e["kv_cache_memory_bytes"]
        else:
            avail, parts = estimate_kv_cache_bytes(model, hw, e["gpu_memory_utilization"], tp,
                                                   mnbt, e["max_num_seqs"])
            if avail <= 0:
                raise ConfigError(f"{where}.num_gpu_blocks",
                                  f"no memory left for the KV cache: {hw.memory_bytes / GiB:.1f} GiB × "
                                  f"{e['gpu_memory_utilization']} minus weights "
                                  f"{parts['weights_bytes'] / GiB:.1f} GiB and activations leaves "
                                  f"{avail / GiB:.1f} GiB; raise tensor_parallel_size or "
                                  "gpu_memory_utilization, or set num_gpu_blocks")
        e["num_gpu_blocks"] = int(avail // block_bytes)
    usable = e["num_gpu_blocks"] - 1
    if groups:
        # vLLM's max_in_flight_tokens (0.32+), or max_num_batched_tokens before.
        in_flight = mnbt * (2 if e["async_scheduling"] and sem.has_max_in_flight_tokens else 1)
        extra = max(0, num_prefill_lookahead(method, nsb, model.num_nextn_predict_layers, sem) - 1)
        needed = sum(g.max_blocks_per_request(mml, in_flight, num_speculative_blocks=nsb,
                                              mamba_align=e["enable_prefix_caching"],
                                              extra_retained_tokens=extra) for g in groups)
    else:
        needed = -(-mml // e["block_size"])
    if needed > usable:
        raise ConfigError(f"{where}.max_model_len",
                          f"one request of max_model_len {mml} needs {needed} blocks but the pool has "
                          f"{usable} usable (num_gpu_blocks {e['num_gpu_blocks']} minus the null "
                          "block); vLLM refuses to start: lower max_model_len or enlarge the pool")
    e["num_gpu_blocks_derived"] = derived
    check_groups_for_release(f"{where}.kv_groups", groups, sem)
    e["prefix_cache_retention_interval"] = check_retention_interval(
        f"{where}.prefix_cache_retention_interval", e["prefix_cache_retention_interval"], sem,
        groups)
    return _build(EngineCfg, e)


def _layout(model: ModelCfg, hw: HardwareCfg, e: dict, sem: Semantics, num_spec: int,
            file: str) -> KVLayout:
    """The KV layout vLLM derives for the model on this engine and GPU (kvsim.layout)."""
    try:
        return derive_layout(
            model, sem.layout, tp=e["tensor_parallel_size"], kv_cache_dtype=e["kv_cache_dtype"],
            block_size=e["block_size"], capability=hw.capability,
            enable_prefix_caching=e["enable_prefix_caching"],
            mamba_cache_mode_given=e["mamba_cache_mode"], num_speculative_tokens=num_spec)
    except ConfigError as exc:  # a key the derivation needs (hardware.compute_capability)
        raise ConfigError(f"{file}{exc.where}", f"{exc.what} (or set engine.block_size and "
                          "engine.kv_groups by hand)" if exc.where.startswith("hardware") else
                          exc.what) from None


def check_groups_for_release(where: str, groups, sem: Semantics) -> None:
    """Refuse group settings the release does not have (vLLM would reject the spec field)."""
    for i, g in enumerate(groups or ()):
        if g.prefill_checkpoint_alignment is not None and not sem.has_mamba_prefill_checkpoints:
            raise ConfigError(f"{where}[{i}].prefill_checkpoint_alignment", f"vLLM {sem.version} "
                              "has no prefill checkpoints inside a chunk (0.32 and later)")


def vllm_retention(value: int | str) -> int | None:
    """prefix_cache_retention_interval as vLLM holds it: ``"dense"`` is its None."""
    return None if value == "dense" else int(value)


def check_retention_interval(where: str, value: int | str | None, sem: Semantics,
                             groups) -> int | str:
    """The release's default when ``value`` is None, else ``value`` if vLLM accepts it
    (kv_cache_coordinator.py _validate_prefix_cache_retention_interval, 0.32+)."""
    if value is None:
        d = sem.default_prefix_cache_retention_interval
        return "dense" if d is None else d
    if value == "dense":
        return value
    if not sem.has_prefix_cache_retention_interval:
        raise ConfigError(where, f"vLLM {sem.version} has no such setting (its checkpoints are "
                          "dense); leave it out or set it to \"dense\"")
    if value > 0:
        if not any(g.kind in ("sliding_window", "mamba") for g in groups or ()):
            raise ConfigError(where, f"{value} has no effect without a sliding_window or mamba "
                              "group in engine.kv_groups (vLLM refuses it); set it to 0")
        unit = math.lcm(*(g.block_size for g in groups))
        if value % unit:
            raise ConfigError(where, f"{value} must be a multiple of the scheduler block size "
                              f"({unit}, the lcm of the group block sizes)")
    return value


def _workload(raw: dict, file: str, base: Path | None) -> WorkloadCfg:
    w = _section(raw, "workload", file)
    where = f"{file}: workload"
    lengths = w["kind"] == "synthetic" and w["generator"] == "trace_lengths"
    reads = w["kind"] == "trace" or w["arrival"] == "trace" or lengths
    if reads:
        if w["trace"] is not None and w["path"] is not None:
            raise ConfigError(f"{where}.trace", "give trace (a known name) or path (a file), not both")
        if w["trace"] is not None:
            t = traces.known(w["trace"], f"{where}.trace")
            if w["format"] is not None and w["format"] != t.format:
                raise ConfigError(f"{where}.format", f"trace {t.name!r} is in format {t.format!r}, "
                                  f"not {w['format']!r}")
            w["format"] = t.format
            w["path"] = traces.locate(t.name, f"{where}.trace")
        elif w["path"] is None:
            need = ("kind = 'trace'" if w["kind"] == "trace" else
                    "generator = 'trace_lengths'" if lengths else "arrival = 'trace'")
            raise ConfigError(f"{where}.path", f"missing ({need} reads a file: give path, or trace "
                              "= a known trace name)")
        else:
            p = Path(w["path"]).expanduser()
            if not p.is_absolute() and base is not None:
                p = base / p
            if not p.is_file():
                what = "is a directory, not a trace file" if p.is_dir() else "no such file"
                raise ConfigError(f"{where}.path", f"{what}: {p}")
            w["path"] = p
        if w["window_end_s"] is not None and w["window_end_s"] <= w["window_start_s"]:
            raise ConfigError(f"{where}.window_end_s", f"{w['window_end_s']} must be greater than "
                              f"window_start_s ({w['window_start_s']})")
    else:
        for key in ("path", "trace"):
            if w[key] is not None:
                raise ConfigError(f"{where}.{key}", "only used with kind = 'trace', arrival = "
                                  "'trace' or generator = 'trace_lengths'")
    w["format"] = w["format"] or "kvsim"
    if w["kind"] == "synthetic" and w["generator"] == "rag" and (
            w["documents_per_request"] > w["num_documents"]):
        raise ConfigError(f"{where}.documents_per_request", f"{w['documents_per_request']} exceeds "
                          f"num_documents ({w['num_documents']})")
    mean, sd = w["acceptance_rate_mean"], w["acceptance_rate_sd"]
    if mean is not None and 0 < mean < 1 and sd * sd >= mean * (1 - mean):
        raise ConfigError(f"{where}.acceptance_rate_sd", f"{sd} is too large for mean {mean}: a beta "
                          f"distribution needs sd < sqrt(mean * (1 - mean)) = "
                          f"{math.sqrt(mean * (1 - mean)):.4g}")
    return _build(WorkloadCfg, w)


def _speculative(raw: dict, file: str, engine: EngineCfg) -> SpecCfg:
    s = _section(raw, "speculative", file)
    where = f"{file}: speculative"
    if s["method"] == "none":
        return SpecCfg()  # other keys are inert (variants switch the method alone)
    k = s["num_speculative_tokens"]
    if k is None:
        raise ConfigError(f"{where}.num_speculative_tokens", f"missing (required with method = "
                          f"'{s['method']}')")
    sem = engine.semantics
    for flag, ok in (("disable_eagle_block_drop", sem.has_disable_eagle_block_drop),
                     ("disable_lookahead_block_hashes", sem.has_disable_lookahead_block_hashes)):
        if s[flag] and not ok:
            raise ConfigError(f"{where}.{flag}", f"vLLM {engine.vllm_version} has no such option")
    if s["acceptance"] == "fixed":
        if s["num_accepted"] is None:
            raise ConfigError(f"{where}.num_accepted", "missing (required with acceptance = 'fixed')")
        if s["num_accepted"] > k:
            raise ConfigError(f"{where}.num_accepted", f"{s['num_accepted']} exceeds "
                              f"num_speculative_tokens ({k})")
    s["num_accepted"] = s["num_accepted"] or 0
    s["acceptance_rates"] = s["acceptance_rates"] or (0.7,)
    if s["draft_model"] is not None:
        if s["method"] != "draft_model":
            raise ConfigError(f"{where}.draft_model", "only used with method = 'draft_model'")
        model_preset(s["draft_model"], f"{where}.draft_model")
    if s["parallel_drafting"] and s["method"] not in ("eagle", "eagle3", "draft_model"):
        raise ConfigError(f"{where}.parallel_drafting", "only EAGLE and draft models draft in parallel")
    groups = engine.kv_groups or ()
    if (s["method"] in EAGLE_METHODS and sem.hybrid.eagle_swa_must_be_aligned
            and any(g.kind == "sliding_window" and g.block_size != engine.block_size for g in groups)):
        raise ConfigError(f"{where}.method", f"vLLM {engine.vllm_version} fails an assertion with "
                          "EAGLE/MTP and a sliding-window group whose block is smaller than the "
                          f"alignment ({engine.block_size})")
    if engine.max_num_batched_tokens <= k:
        raise ConfigError(f"{file}: engine.max_num_batched_tokens", f"{engine.max_num_batched_tokens} "
                          f"leaves no room for {k} lookahead slots (vLLM refuses it)")
    return _build(SpecCfg, s)


def _cost(raw: dict, file: str, base: Path | None, model: ModelCfg, engine: EngineCfg,
          hw: HardwareCfg) -> CostCfg:
    from kvsim.cost import fitted  # the profile reader (JSON); no numpy

    c = _section(raw, "cost", file)
    if c["model"] is None:
        c["model"] = "fitted" if c["profile"] else "roofline"
    where = f"{file}: cost.profile"
    if c["model"] == "fitted":
        if not c["profile"]:
            raise ConfigError(f"{file}: cost.model", "'fitted' needs cost.profile (kvsim calibrate "
                              "writes one)")
        try:
            path = fitted.resolve_profile(c["profile"], base)
            profile = fitted.load_profile(path)
        except ConfigError as exc:
            raise ConfigError(where, exc.what if exc.where == "cost.profile" else str(exc)) from None
        fitted.check_matches(profile, model, engine.tensor_parallel_size, where)
        c["profile"] = str(path.resolve())
    elif c["profile"]:
        raise ConfigError(where, "is used only with cost.model = 'fitted'")
    elif hw.peak_flops_per_s is None:
        raise ConfigError(f"{file}: hardware.peak_flops_per_s", "missing: the roofline cost model "
                          "needs it (or give cost.profile, a fitted profile)")
    return _build(CostCfg, c)


def parse_scenario(raw: dict, path: Path | None = None) -> Scenario:
    """Validate a scenario table (as ``tomllib`` returns it). Raises ConfigError."""
    file = path.name if path else "scenario"
    for section in raw:
        if section not in SCHEMA:
            raise ConfigError(f"{file}: [{section}]", f"unknown section{_suggest(section, list(SCHEMA))}")
    model = _model(raw, file, path.parent if path else None)
    if model.num_experts and not 1 <= model.num_experts_per_tok <= model.num_experts:
        raise ConfigError(f"{file}: model.num_experts_per_tok", f"must be between 1 and num_experts "
                          f"({model.num_experts}) for an MoE model, got {model.num_experts_per_tok}")
    hardware = _build(HardwareCfg, _section(raw, "hardware", file))
    cc = hardware.compute_capability
    if cc is not None and not re.fullmatch(r"\d{1,2}\.\d", cc):
        raise ConfigError(f"{file}: hardware.compute_capability", f"must be 'major.minor' like "
                          f"'9.0', got {cc!r}")
    engine = _engine(raw, file, model, hardware)
    speculative = _speculative(raw, file, engine)
    workload = _workload(raw, file, path.parent if path else None)
    if (workload.acceptance_rate_mean is not None and speculative.enabled
            and speculative.acceptance != "trace"):
        raise ConfigError(f"{file}: workload.acceptance_rate_mean", "generated acceptances are used "
                          "only with speculative.acceptance = 'trace'")
    base = path.parent if path else None
    return Scenario(
        path=path,
        model=model,
        hardware=hardware,
        engine=engine,
        speculative=speculative,
        workload=workload,
        cost=_cost(raw, file, base, model, engine, hardware),
        run=_build(RunCfg, _section(raw, "run", file)),
        cluster=_cluster(raw, file, base, model, hardware, engine) if "cluster" in raw else None,
    )


def _cluster(raw: dict, file: str, base: Path | None, model: ModelCfg, hw: HardwareCfg,
             engine: EngineCfg) -> ClusterCfg:
    c = _section(raw, "cluster", file)
    deployments = c["deployment"]
    if deployments is None:
        return _build(ClusterCfg, {**c, "engines": (engine,) * c["replicas"]})
    if "replicas" in raw["cluster"]:
        raise ConfigError(f"{file}: cluster.replicas", "give replicas or [[cluster.deployment]] "
                          "tables (whose replicas add up), not both")
    engines: list[EngineCfg] = []
    for i, (n, overrides) in enumerate(deployments):
        # A deployment's engine is [engine] with its keys replaced, checked like [engine].
        raw_d = {**raw, "engine": {**raw.get("engine", {}), **dict(overrides)}}
        try:
            e = _engine(raw_d, file, model, hw)
            _speculative(raw_d, file, e)
            _cost(raw_d, file, base, model, e, hw)
        except ConfigError as exc:
            inner = exc.where.removeprefix(f"{file}: ")
            where = inner.replace("engine.", f"cluster.deployment[{i}].", 1) if inner.startswith(
                "engine.") else f"cluster.deployment[{i}] ({inner})"
            raise ConfigError(f"{file}: {where}", exc.what) from None
        engines += [e] * n
    return _build(ClusterCfg, {**c, "replicas": len(engines), "engines": tuple(engines)})


def load_scenario(path: str | Path) -> Scenario:
    """Read and validate a scenario file. Raises ConfigError (missing file, bad TOML, bad key)."""
    return parse_scenario(load_raw(path), Path(path).resolve())


def load_raw(path: str | Path) -> dict:
    """A scenario file's table, unvalidated. Raises ConfigError (missing file, bad TOML)."""
    p = Path(path)
    try:
        with p.open("rb") as f:
            raw = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(str(p), "no such file") from None
    except IsADirectoryError:
        raise ConfigError(str(p), "is a directory, not a scenario file") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(str(p), f"not valid TOML: {exc}") from None
    except OSError as exc:
        raise ConfigError(str(p), exc.strerror or str(exc)) from None
    return raw


# -- writing the resolved scenario ---------------------------------------------------------


def toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return repr(v)
    if isinstance(v, tuple | list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    if isinstance(v, Path):
        v = str(v)
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    raise TypeError(f"cannot write {v!r} as TOML")


def resolved_toml(sc: Scenario) -> str:
    """Every key with the value the run used (presets expanded, defaults filled in).

    Loading this text again gives the same scenario (trace paths are absolute).
    """
    lines = ["# Resolved by kvsim: every key with the value this run used.", ""]
    for section in SCHEMA:
        cfg = getattr(sc, section)
        if cfg is None:
            continue  # no [cluster]
        lines.append(f"[{section}]")
        for key in SCHEMA[section]:
            if not hasattr(cfg, key.name):
                continue
            v = getattr(cfg, key.name)
            if v is None or (section == "model" and key.name in ("preset", "config") and not v):
                continue
            if section == "workload" and (key.name == "trace" or (
                    key.name in TRACE_ONLY_KEYS and not sc.workload.reads_trace)):
                continue  # a named trace is written as its resolved path
            if section == "speculative" and key.name != "method" and not sc.speculative.enabled:
                continue
            if key.type in ("groups", "deployments") or (
                    section == "cluster" and key.name == "replicas" and sc.cluster.deployment):
                continue  # written as [[engine.kv_groups]] / [[cluster.deployment]] tables below
            lines.append(f"{key.name} = {toml_value(v)}")
        lines.append("")
        if section == "engine" and sc.engine.kv_groups:
            for g in sc.engine.kv_groups:
                lines.append("[[engine.kv_groups]]")
                for k in GROUP_KEYS:
                    v = getattr(g, k.name)
                    if v is not None and not (k.name == "sliding_window" and g.kind != "sliding_window"):
                        lines.append(f"{k.name} = {toml_value(v)}")
                lines.append("")
        if section == "cluster" and sc.cluster.deployment:
            first = 0
            for n, _ in sc.cluster.deployment:
                # The deployment's engine values that differ from [engine], as resolved.
                e = sc.cluster.engines[first]
                first += n
                lines += ["[[cluster.deployment]]", f"replicas = {n}"]
                for k in ENGINE_KEYS:
                    v = getattr(e, k.name)
                    if k.name not in SHARED_ENGINE_KEYS and v != getattr(sc.engine, k.name):
                        lines.append(f"{k.name} = {toml_value(v)}")
                lines.append("")
    return "\n".join(lines)


def schema_markdown() -> str:
    """The key tables of docs/scenario.md, generated from ``SCHEMA`` (a test keeps them in sync)."""
    out = []
    for section, keys in SCHEMA.items():
        out += [f"### [{section}]", "", "| key | type | default | meaning |", "|---|---|---|---|"]
        for k in keys:
            if k.default is REQUIRED:
                default = "required"
            elif k.default is None:
                default = "derived" if k.derived else "none"
            else:
                default = f"`{toml_value(k.default)}`"
            kind = k.type + (" (" + ", ".join(f"`{c}`" for c in k.choices) + ")" if k.choices else "")
            out.append(f"| `{k.name}` | {kind} | {default} | {k.doc} |")
        out.append("")
        sub = {"engine": ("engine.kv_groups", GROUP_KEYS),
               "cluster": ("cluster.deployment", (DEPLOYMENT_REPLICAS,))}.get(section)
        if sub:
            out += [f"#### [[{sub[0]}]]", "", "| key | type | default | meaning |",
                    "|---|---|---|---|"]
            for k in sub[1]:
                default = "required" if k.default is REQUIRED else (
                    "none" if k.default is None else f"`{toml_value(k.default)}`")
                kind = k.type + (" (" + ", ".join(f"`{c}`" for c in k.choices) + ")" if k.choices else "")
                out.append(f"| `{k.name}` | {kind} | {default} | {k.doc} |")
            if section == "cluster":
                out.append("| any `[engine]` key | as in `[engine]` | the `[engine]` value | This "
                           "deployment's value, except for the keys every replica shares: "
                           + ", ".join(f"`{k}`" for k in SHARED_ENGINE_KEYS) + ". |")
            out.append("")
    return "\n".join(out)
