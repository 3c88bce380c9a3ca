"""The scenario schema: every key of every section, declared once, and the records parsing
fills in.

Each key is a ``Key`` with its type, default and meaning; ``docs/scenario.md`` is generated
from these tables (``kvsim.scenario_text.schema_markdown``). A key's default lives here only: the
records below have no defaults of their own, ``kvsim.config`` builds them from the tables.
String modes are ``Literal`` types and their keys' choices are read from those types, so a mode
the schema accepts is one the code names.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal, get_args

from kvsim.kv.hybrid import GroupKind, GroupSpec
from kvsim.kv.offload import OffloadParams
from kvsim.layout import MambaCacheMode
from kvsim.model import (
    DTYPE_BYTES,
    KV_CACHE_DTYPE_BYTES,
    QUANTIZATION_FORMATS,
    AttentionType,
    ModelCfg,
)
from kvsim.sched import SCHEDULING_POLICIES, SchedulingPolicy
from kvsim.semantics import DEFAULT_VERSION, VERSIONS, Semantics, semantics_for
from kvsim.specdec import SPEC_METHODS, AcceptanceKind, Drafting, SpecMethod

# Sizes kvsim builds in memory, bounded before anything is built: blocks of the pool (each an
# object: about 0.7 GB at the bound; a real pool is far smaller, 10^4 to 10^6 blocks) and
# generated requests (or rag documents).
MAX_GPU_BLOCKS = 1 << 22
MAX_REQUESTS = 2_000_000
MAX_REPLICAS = 1024  # engines of a cluster (each its own pool, within MAX_GPU_BLOCKS in all)
MAX_OFFLOAD_GIB = 65536.0  # a CPU offload tier (64 TiB); chunks exist only once stored
WorkloadKind = Literal["trace", "synthetic"]
TraceFormat = Literal["kvsim", "mooncake", "azure"]
GeneratorName = Literal["shared_prefix", "multi_turn", "rag", "agent", "trace_lengths", "random"]
# How a benchmark client draws the random dataset's lengths around L with range ratio r:
# ``vllm bench serve`` uniform on [floor(L(1 - r)), ceil(L(1 + r))] (vllm/benchmarks/datasets.py
# RandomDataset.get_sampling_params); the older ``benchmark_serving.py`` and SGLang's bench_serving
# uniform on [int(r L), L].
RandomRangeRule = Literal["centered", "below"]
ArrivalProcess = Literal["poisson", "gamma", "trace"]
CostModelName = Literal["roofline", "fitted", "interpolated"]
RouterName = Literal["round_robin", "random", "least_loaded", "prefix_aware", "session_affinity"]
KVRoleAll = Literal["kv_both", "kv_producer", "kv_consumer"]
KV_ROLES_ALL: tuple[KVRoleAll, ...] = get_args(KVRoleAll)
LoadMetric = Literal["requests", "kv_usage"]
TRACE_FORMATS: tuple[TraceFormat, ...] = get_args(TraceFormat)
GENERATOR_NAMES: tuple[GeneratorName, ...] = get_args(GeneratorName)
ROUTERS: tuple[RouterName, ...] = get_args(RouterName)


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
    Key("quantization", "str", None, "vLLM's quantization method (`--quantization`; default: "
        "config.json's `quantization_config`): the decoder's linear weights stored in its format "
        "(`fp8`/`modelopt`/`fbgemm_fp8`/`compressed-tensors`: FP8; `modelopt_fp4`: NVFP4, 4.5 "
        "bits; `mxfp4`: MXFP4, 4.25 bits; `awq`/`gptq`: INT4, 4.25 bits), the embeddings and LM "
        "head in `dtype`: the weight bytes a step reads and the KV pool's room; its linear FLOPs "
        "run at the GPU's peak for that format where it has one (`[hardware] "
        "peak_fp8_flops_per_s`, `peak_fp4_flops_per_s`).", choices=tuple(QUANTIZATION_FORMATS)),
    Key("max_position_embeddings", "int", REQUIRED, "Context length; the default `max_model_len`.", low=1),
    Key("num_active_params", "int", None, "Parameters active per token (MoE); default `num_params`.",
        low=1),
    Key("num_experts", "int", 0, "Routed experts per MoE layer (HF `num_experts`, `n_routed_experts` "
        "or `num_local_experts`); 0: a dense model.", low=0),
    Key("num_experts_per_tok", "int", 0, "Routed experts each token activates (MoE top-k).", low=0),
    Key("attention_type", "str", "gqa", "`gqa` (K and V per KV head) or `mla` (one latent of "
        "`kv_lora_rank + qk_rope_head_dim` per token and layer, replicated across TP ranks).",
        choices=get_args(AttentionType)),
    Key("kv_lora_rank", "int", 0, "MLA latent width.", low=0),
    Key("qk_rope_head_dim", "int", 0, "MLA rotary key width.", low=0),
    Key("num_nextn_predict_layers", "int", 0, "MTP modules the checkpoint ships (DeepSeek's "
        "`num_nextn_predict_layers`, Qwen's `mtp_num_hidden_layers`): `mtp` needs one (vLLM "
        "refuses it otherwise), defaults its `num_speculative_tokens` to their number, and more "
        "than one makes it multi-module.", low=0),
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
        "block, by it. Needed for MLA and hybrid models. An AMD GPU gives the gfx major.minor "
        "torch reports on ROCm (`9.4` MI300X/MI325X, `9.5` MI355X); the layout follows vLLM's "
        "CUDA kernels, not its ROCm ones."),
    Key("peak_flops_per_s", "float", None, "Dense BF16/FP16 tensor-core peak, FLOP/s: needed by "
        "the roofline cost model (a fitted profile has the GPU's measured times).",
        low=0, low_open=True),
    Key("peak_fp8_flops_per_s", "float", None, "Dense FP8 tensor-core peak, FLOP/s (FP32 "
        "accumulate), for a GPU that runs FP8 natively (Hopper, Ada, Blackwell; MI300 and later); "
        "left out where it does not (A100, A10G). The roofline runs FP8 weights' linear layers "
        "at it; without it, at `peak_flops_per_s` (dequantized to BF16).", low=0, low_open=True),
    Key("peak_fp4_flops_per_s", "float", None, "Dense FP4 (NVFP4 / MXFP4) tensor-core peak, "
        "FLOP/s, for a GPU that runs FP4 natively (Blackwell, MI355X); left out where it does "
        "not. The roofline runs NVFP4 weights' linear layers at it, as `peak_fp8_flops_per_s` "
        "FP8 ones.", low=0, low_open=True),
    Key("mem_bandwidth_bytes_per_s", "float", REQUIRED, "Device memory bandwidth, bytes/s.",
        low=0, low_open=True),
    Key("memory_bytes", "int", REQUIRED, "Device memory, bytes.", low=1),
    Key("interconnect_bandwidth_bytes_per_s", "float", None, "GPU-to-GPU bandwidth per direction "
        "(NVLink, or PCIe without it), bytes/s: the tensor parallel all-reduces; needed when "
        "`tensor_parallel_size` > 1.", low=0, low_open=True),
    Key("interconnect_latency_s", "float", 5e-6, "Latency of one step of a ring all-reduce, "
        "seconds.", low=0),
    Key("host_link_bandwidth_bytes_per_s", "float", None, "GPU-host bandwidth per direction "
        "(PCIe), bytes/s: KV offload loads (host to GPU) and stores (GPU to host) each run at "
        "this rate, one transfer after another per direction; needed with "
        "`engine.kv_offloading_size`. The presets give the PCIe generation's nominal rate "
        "(pinned copies reach about 80-90 % of it).", low=0, low_open=True),
    Key("host_link_latency_s", "float", 1e-5, "Fixed cost of one offload transfer, seconds "
        "(an assumption: a copy launch and its completion event).", low=0),
)

OFFLOAD_EXTRA_KEYS = (
    Key("block_size", "int", None, "Tokens per offloaded chunk: a multiple of the GPU block "
        "size (give this or `blocks_per_chunk`).", low=1),
    Key("blocks_per_chunk", "int", None, "GPU blocks per offloaded chunk (default 1).", low=1,
        high=1 << 16),
    Key("eviction_policy", "str", "lru", "The CPU tier's eviction: `lru` (a running request's "
        "chunks share one rank, its later positions evicted first; recency committed when it "
        "finishes) or `arc`.", choices=("lru", "arc")),
    Key("offload_prompt_only", "bool", True, "Store only prompt tokens' chunks (decode tokens "
        "are not stored)."),
    Key("store_threshold", "int", 0, "Store a chunk only once it has been offered this many "
        "times (below 2: always).", low=0, high=1 << 20),
    Key("kv_recompute_threshold", "int", 64, "P/D (`kv_role`): NixlConnector's threshold below "
        "which a read is skipped and the tokens recomputed. In vLLM 0.32/0.33 it gates only the "
        "bidirectional read-back (off by default), which kvsim does not model: taken, and "
        "without effect, as in vLLM.", low=0, high=1 << 30),
)
# Which of the keys above configure which connector.
OFFLOAD_ONLY_EXTRA = ("block_size", "blocks_per_chunk", "eviction_policy", "offload_prompt_only",
                      "store_threshold")
PD_ONLY_EXTRA = ("kv_recompute_threshold",)

ENGINE_KEYS = (
    Key("vllm_version", "str", DEFAULT_VERSION, "The vLLM release whose accounting to reproduce.",
        choices=tuple(VERSIONS)),
    Key("block_size", "int", None, "Tokens per KV block (`--block-size`). Default as vLLM: the "
        "attention kernel's preferred size (16; 32 for MLA on Blackwell B200), raised for hybrid "
        "models until an attention page holds a Mamba state. With `kv_groups`: the lcm of the "
        "group block sizes.", low=1, derived=True),
    Key("num_gpu_blocks", "int", None,
        "The whole block pool, vLLM's reserved null block included (as `--num-gpu-blocks-override` "
        "means it). Left out: derived from memory like vLLM (see below). kvsim holds every block: "
        f"at most {MAX_GPU_BLOCKS:,}.", low=2, high=MAX_GPU_BLOCKS, derived=True),
    Key("gpu_memory_utilization", "float", None,
        "Fraction of device memory vLLM may use (default per version: 0.92 for 0.33).",
        low=0, low_open=True, high=1, derived=True),
    Key("kv_cache_memory_bytes", "int", None, "KV cache size in bytes (`--kv-cache-memory-bytes`); "
        "overrides the memory-based estimate.", low=1),
    Key("kv_cache_dtype", "str", "auto", "KV cache dtype (`auto` = model dtype).",
        choices=("auto", *KV_CACHE_DTYPE_BYTES)),
    Key("tensor_parallel_size", "int", 1, "GPUs per replica: weights, KV heads and FLOPs are split "
        "across them; each layer's two all-reduces cross `[hardware]`'s interconnect.", low=1),
    Key("data_parallel_size", "int", 1, "Data-parallel ranks (`--data-parallel-size`): engines of "
        "`tensor_parallel_size` GPUs each, with their own KV cache, behind vLLM's DP load "
        "balancer (each release's rule, from the counts its coordinator publishes every 100 ms). "
        "A dense model's ranks step independently; an MoE model's step in lockstep (an idle rank "
        "runs dummy steps; a step lasts as long as the slowest rank). `num_gpu_blocks` is each "
        "rank's pool. See Data parallel.", low=1, high=MAX_REPLICAS),
    Key("enable_expert_parallel", "bool", False, "MoE: the routed experts are split whole across "
        "the `data_parallel_size × tensor_parallel_size` GPUs (`--enable-expert-parallel`); "
        "without it, vLLM shards every expert over the same GPUs. Either way each GPU holds "
        "1 / (DP × TP) of the experts' weights and its MoE layers run over all ranks' tokens, "
        "gathered and scattered across `[hardware]`'s interconnect."),
    Key("api_server_count", "int", None, "Front-end processes, each its own DP load-balancing "
        "client with its own counts (`--api-server-count`; default as `vllm serve`: "
        "`data_parallel_size`). Requests are taken by them in turn.", low=1, high=MAX_REPLICAS,
        derived=True),
    Key("enable_prefix_caching", "bool", None, "Automatic prefix caching. Default as `vllm "
        "serve`: on, but off for Mamba / linear-attention hybrids before vLLM 0.28 (0.19-0.25 "
        "count them as unsupported, 0.26/0.27 keep them opt-in).", derived=True),
    Key("max_num_batched_tokens", "int", None, "Token budget per step. Default as `vllm serve`: "
        "8192 on a device with >= 70 GiB that is not an A100 (16384 at >= 160 GiB from vLLM 0.32), "
        "else 2048.",
        low=1, derived=True),
    Key("max_num_seqs", "int", None, "Running-request cap. Default as `vllm serve`: 1024 at >= 70 GiB "
        "(not A100; any device at >= 160 GiB from vLLM 0.32), else 256.", low=1, derived=True),
    Key("max_model_len", "int", None, "Longest sequence (prompt + output); default the model's "
        "`max_position_embeddings`, and may exceed it.", low=2, derived=True),
    Key("enable_chunked_prefill", "bool", True, "Split prompts across steps."),
    Key("long_prefill_token_threshold", "int", 0, "Per-step chunk cap for a request (0 = off).", low=0),
    Key("scheduling_policy", "str", "fcfs", "`fcfs` or `priority` (lower value first).",
        choices=SCHEDULING_POLICIES),
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
        "`enable_prefix_caching`, as vLLM sets it.", choices=get_args(MambaCacheMode), derived=True),
    Key("kv_offloading_size", "float", None, "CPU memory for vLLM's native KV offload tier, GiB, "
        "summed over the tensor-parallel ranks (`--kv-offloading-size`; vLLM 0.32/0.33): write-"
        "through stores of each prompt's full chunks, whole-chunk lookups after the GPU prefix "
        "cache, asynchronous loads (see KV offloading). Off when left out or 0 (vLLM refuses 0; "
        "kvsim takes it as off, for sweeps).", low=0, high=MAX_OFFLOAD_GIB),
    Key("kv_offloading_backend", "str", "native", "`--kv-offloading-backend`: `native` (vLLM's "
        "OffloadingConnector); `lmcache` (an LMCache server) is not modelled.",
        choices=("native", "lmcache")),
    Key("kv_connector_extra_config", "table", None, "The connector's "
        "`kv_connector_extra_config` (as `--kv-transfer-config` passes it): an inline table of "
        "the keys below, e.g. `{blocks_per_chunk = 4, eviction_policy = \"lru\"}` for the "
        "offload tier, `{kv_recompute_threshold = 64}` for P/D."),
    Key("kv_role", "str", "kv_both", "P/D disaggregation with vLLM's NixlConnector "
        "(`--kv-transfer-config '{\"kv_connector\": \"NixlConnector\", \"kv_role\": ...}'`, "
        "vLLM 0.32/0.33): `kv_producer` (a prefill instance), `kv_consumer` (a decode instance), "
        "or `kv_both` (no P/D: an aggregated replica, the default). Set per "
        "`[[cluster.deployment]]`; a cluster with producers needs consumers (see P/D "
        "disaggregation).", choices=KV_ROLES_ALL),
    Key("prefix_cache_retention_interval", RETENTION, None, "Which sliding-window and Mamba "
        "checkpoints the prefix cache keeps (`--prefix-cache-retention-interval`, vLLM 0.29+; "
        "0.23-0.28: the `VLLM_PREFIX_CACHE_RETENTION_INTERVAL` environment variable, which this "
        "key stands for): `0` only a prompt's replay boundary and (0.26+) the shared-prefix "
        "junctions lookups find; a positive multiple of the scheduler block size (the lcm of the "
        "group block sizes) also one per that many tokens; `\"dense\"` (vLLM's `None`) one at "
        "every scheduler block. Default: the release's (`0` from 0.29, `\"dense\"` on 0.29 for a "
        "Mamba hybrid with an EAGLE-family drafter; `\"dense\"` before 0.29). 0.23 applies it to "
        "sliding windows only.", derived=True),
)

GROUP_KEYS = (
    Key("kind", "str", REQUIRED, "`full_attention`, `sliding_window` or `mamba` (one Mamba group at "
        "most, in a layout whose groups all share its `block_size`, as vLLM sizes attention "
        "blocks for Mamba models; prefix caching on means vLLM's `mamba_cache_mode = \"align\"`).",
        choices=get_args(GroupKind)),
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

SPECULATIVE_KEYS = (
    Key("method", "str", "none", "Speculative decoding method, as vLLM's `--speculative-config` "
        "`method`.", choices=SPEC_METHODS),
    Key("num_speculative_tokens", "int", None, "Drafts per step, k: required with a method, "
        "except `mtp`, where vLLM's default is the model's MTP layers.", low=1),
    Key("acceptance", "str", "per_position", "Acceptance model: `per_position` (drafts accepted "
        "before the first rejection, position i accepted with probability `acceptance_rates[i]`, "
        "seeded per request), `fixed` (`num_accepted` per step), or `trace` (each request's "
        "`accepted` list from the trace, cycled).", choices=get_args(AcceptanceKind)),
    Key("acceptance_rates", "floats", (0.7,), "Per-position acceptance probability, given the "
        "previous draft was accepted: one for every position, or one per draft "
        "(`num_speculative_tokens` of them).", low=0, high=1),
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

TRACE_ONLY_KEYS = ("path", "format", "speedup", "window_start_s", "window_end_s", "sample_fraction")

WORKLOAD_KEYS = (
    Key("kind", "str", "synthetic", "`trace` (read a file) or `synthetic` (generate).",
        choices=get_args(WorkloadKind)),
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
        choices=get_args(ArrivalProcess)),
    Key("arrival_cv", "float", 2.0, "Coefficient of variation of gamma inter-arrival times (1: "
        "Poisson; above 1: bursty).", low=0, low_open=True),
    Key("num_requests", "int", 100, f"Requests to generate (at most {MAX_REQUESTS:,}: they are "
        "made in memory).", low=1, high=MAX_REQUESTS),
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
    Key("num_documents", "int", 1000, f"rag: documents in the pool (at most {MAX_REQUESTS:,}).",
        low=1, high=MAX_REQUESTS),
    Key("documents_per_request", "int", 4, "rag: documents in each prompt (distinct).", low=1),
    Key("document_tokens", "int", 1024, "rag: tokens per document.", low=1),
    Key("zipf_s", "float", 1.0, "rag: document popularity exponent: the document of rank r is "
        "drawn with weight r^-s (0: uniform).", low=0),
    Key("random_input_len", "int", 1024, "random: prompt tokens around which lengths are drawn "
        "(`--random-input-len`; vLLM's default), after the shared `random_prefix_len`.", low=1),
    Key("random_output_len", "int", 128, "random: output tokens around which lengths are drawn "
        "(`--random-output-len`); each request generates exactly its drawn length, as with "
        "`--ignore-eos`.", low=1),
    Key("random_range_ratio", "float", 0.0, "random: `--random-range-ratio` r: lengths uniform on "
        "whole numbers in the range `random_range_rule` names (0: every request L).", low=0, high=1),
    Key("random_range_rule", "str", "centered", "random: the client's range for ratio r around L: "
        "`centered` = [floor(L(1-r)), ceil(L(1+r))], as `vllm bench serve` draws (r < 1); `below` "
        "= [int(r L), L], as the older `benchmark_serving.py` (and SGLang's bench_serving, "
        "InferenceX's client) draws.", choices=get_args(RandomRangeRule)),
    Key("random_prefix_len", "int", 0, "random: tokens of one random prefix every prompt starts "
        "with (`--random-prefix-len`).", low=0),
    Key("max_concurrency", "int", None, "The benchmark client's `--max-concurrency` C: at most C "
        "requests in flight; a request is sent at its arrival time or, when C are in flight, as "
        "soon as one finishes (first come, first sent). With `request_rate = inf` that is a "
        "closed loop: C requests always in flight. TTFT and E2E count from the send. Default: no "
        "limit (open loop). Not yet with `[cluster]` or data parallel.", low=1),
    Key("num_warmups", "int", 0, "The client's `--num-warmups`: before the benchmark, this many "
        "copies of the first request, at most `max_concurrency` at once; the benchmark starts "
        "when all have finished (arrival times count from then). They run on the engine (and "
        "fill its prefix cache) but are left out of latencies and throughput (requests.csv lists "
        "them as `warmup-<i>`).", low=0, high=MAX_REQUESTS),
    Key("acceptance_rate_mean", "float", None, "Give every request an `accepted` list (for "
        "speculative.acceptance = 'trace'; requests that carry one keep it): a per-request "
        "acceptance rate p drawn from a beta distribution with this mean, each draft position "
        "accepted with probability p until the first rejection.", low=0, high=1),
    Key("acceptance_rate_sd", "float", 0.1, "Standard deviation of the per-request acceptance "
        "rate (0: every request has the mean).", low=0),
)

COST_KEYS = (
    Key("model", "str", None, "Step-time model: `roofline` (from `[hardware]` numbers and its "
        "GPU generation's constants, fitted on public vLLM runs where kvsim has them), "
        "`fitted` (a calibration profile, `kvsim calibrate`) or `interpolated` (vLLM layer profiles "
        "read directly, `layer_profile`); default `interpolated` when `layer_profile` is given, "
        "else `fitted` when `profile` is, else `roofline`.", choices=get_args(CostModelName),
        derived=True),
    Key("profile", "str", None, "Cost profile written by `kvsim calibrate` (a JSON file, relative to "
        "the scenario) or a shipped profile's name (`rtxpro6000-llama-3.1-8b-tp1`, ...); it must be "
        "for the scenario's model shape and `tensor_parallel_size`."),
    Key("layer_profile", "str", None, "Folder of vLLM layer profiles in LLMServingSim's format "
        "(`profiles/<hardware>/<org>/<model>/<variant>`: `meta.yaml`, `tp<N>/attention.csv`, "
        "`dense.csv`, `per_sequence.csv`, `moe.csv`), relative to the scenario; step times are "
        "interpolated in its tables (the fitted form, fitted to the same tables, past their grid). "
        "It must profile the scenario's model at its `tensor_parallel_size`."),
    Key("compute_efficiency", "float", None, "roofline: fraction of the peak FLOP/s of its "
        "weights' format that dense linear layers and attention reach. Default: the GPU "
        "generation's fitted value (`kvsim/presets/roofline.toml`, by `[hardware] "
        "compute_capability`).", low=0, low_open=True, high=1, derived=True),
    Key("moe_compute_efficiency", "float", None, "roofline: the same for the routed experts' "
        "grouped GEMMs. Default: the generation's fitted value.", low=0, low_open=True, high=1,
        derived=True),
    Key("bandwidth_efficiency", "float", None, "roofline: fraction of peak memory bandwidth a "
        "step's weight reads reach. Default: the generation's fitted value.", low=0,
        low_open=True, high=1, derived=True),
    Key("attention_bandwidth_efficiency", "float", None, "roofline: the same for attention's KV "
        "cache reads and writes (paged blocks, a format's dequantization). Default: the "
        "generation's fitted value.", low=0, low_open=True, high=1, derived=True),
    Key("frontend_latency_s", "float", None, "Seconds the API server adds to each request "
        "before its first token (tokenizing, handing it to the engine core, streaming the "
        "token back): a request reaches the scheduler this long after the client sends it, "
        "so TTFT and E2E hold it, TPOT not. Default: the roofline's fitted value with a "
        "benchmark client (`max_concurrency` / `num_warmups`), else 0.", low=0, derived=True),
    Key("step_overhead_s", "float", None, "Fixed per-step engine overhead, seconds, added to the "
        "step's kernels: vLLM's CPU work between steps (scheduling, input preparation, sampling) and "
        "launch gaps that layer timings do not see. Default 2 ms with `roofline` and `fitted` (not "
        "added to a profile fitted to whole engine steps, whose fixed term holds it); 0 with "
        "`interpolated`, whose layer profiles, skew fit included, already time a measured run's steps "
        "(`kvsim calibrate --step-overhead RUN` fits it per GPU from measured runs).", low=0,
        derived=True),
    Key("step_overhead_per_request_s", "float", None, "roofline: CPU seconds per request a step "
        "schedules (the scheduler's and the model runner's per-request bookkeeping, "
        "sampling and output processing); added to the GPU's time, or overlapping it with "
        "`async_scheduling` (the step takes the longer of the two). Default: the generation's "
        "fitted value with `roofline`, else 0.", low=0, derived=True),
)

RUN_KEYS = (
    Key("seed", "int", 0, "Seed for every random choice (same seed, same output).", low=0),
    Key("max_requests", "int", None, "Use only the first N requests of the workload (of a trace: after its "
        "window and sampling).", low=1),
    Key("max_sim_time_s", "float", None, "Stop the clock here; unfinished requests are reported "
        "unfinished.", low=0, low_open=True),
    Key("max_steps", "int", None, "Stop after this many engine steps.", low=1),
)

# Engine keys every replica of a cluster shares: they decide the block hashes a prefix-aware
# router compares across replicas (one deployment: one model, one vLLM image, one block size).
SHARED_ENGINE_KEYS = ("vllm_version", "block_size", "kv_groups")

# P/D: the link between a prefill and a decode GPU, per GPU and direction:
# (bandwidth bytes/s, fixed cost per read s, source).
KV_TRANSFER_LINKS: dict[str, tuple[float, float, str]] = {
    "rdma_400g": (50e9, 2e-5, "400 Gb/s per GPU: a ConnectX-7 NIC (InfiniBand NDR or 400GbE) per "
                  "GPU, as in DGX H100/H200 nodes"),
    "rdma_200g": (25e9, 2e-5, "200 Gb/s per GPU: ConnectX-6 (InfiniBand HDR), as in DGX A100"),
    "rdma_800g": (100e9, 2e-5, "800 Gb/s per GPU: ConnectX-8 (InfiniBand XDR), GB300 systems"),
    "nvlink4": (450e9, 5e-6, "P and D in one NVLink 4 domain: 900 GB/s per H100/H200 GPU, both "
                "directions together"),
    "nvlink5": (900e9, 5e-6, "P and D in one NVLink 5 domain: 1.8 TB/s per B200 GPU, both "
                "directions together"),
    "pcie5": (64e9, 1e-5, "peer-to-peer over PCIe 5.0 x16 (64 GB/s a direction), one host"),
    "ethernet_100g": (12.5e9, 5e-5, "100 Gb/s Ethernet without RDMA (UCX over TCP)"),
}

CLUSTER_KEYS = (
    Key("replicas", "int", 1, "Replicas behind the router, each a whole vLLM engine (`[engine]`) "
        "with its own KV cache. With `[[cluster.deployment]]` tables: their total (leave it out). "
        f"At most {MAX_REPLICAS:,}, holding at most {MAX_GPU_BLOCKS:,} blocks in all.", low=1,
        high=MAX_REPLICAS),
    Key("router", "str", "round_robin", "Routing policy, decided when a request arrives: "
        "`round_robin`, `random` (seeded by `run.seed`), `least_loaded` (by `load_metric`), "
        "`prefix_aware` (longest cached prefix against pending work, see `load_weight`), "
        "`session_affinity` (sticky by the request's session id). See Clusters.",
        choices=ROUTERS),
    Key("load_metric", "str", "requests", "The load `least_loaded` and `session_affinity` "
        "balance: `requests` (waiting + running + routed but not yet admitted) or `kv_usage` "
        "(vLLM's KV-cache usage).", choices=get_args(LoadMetric)),
    Key("load_weight", "float", 0.5, "prefix_aware: w in score = (1 - w) * cached prefix tokens "
        "- w * pending tokens; 0 follows the cache alone, 1 the pending work alone, 0.5 trades "
        "them token for token.", low=0, high=1),
    Key("deployment", "deployments", None, "Replicas with their own engine settings: a list of "
        "`[[cluster.deployment]]` tables (keys below), replicas numbered in table order."),
    Key("prefill_router", "str", None, "P/D: the routing policy over the prefill instances "
        "(the choices of `router`, which picks the decode instance first, as llm-d's "
        "pd-profile-handler runs its decode profile first). Default: `router`.",
        choices=ROUTERS, derived=True),
    Key("non_cached_tokens", "int", 0, "P/D: llm-d's prefix-based-pd-decider `nonCachedTokens`: "
        "a request whose prompt, or whose part not cached on the chosen decode instance, is "
        "shorter than this goes to the decode instance alone (no prefill instance, no "
        "transfer); 0 sends every request through a prefill instance.", low=0, high=1 << 30),
    Key("kv_transfer_link", "str", "rdma_400g", "P/D: the link a decode GPU reads a prefill "
        "GPU's KV cache over, a preset (see P/D disaggregation for their sources): "
        + ", ".join(f"`{k}`" for k in KV_TRANSFER_LINKS) + ".", choices=tuple(KV_TRANSFER_LINKS)),
    Key("kv_transfer_bandwidth_bytes_per_s", "float", None, "P/D: the link's bandwidth per "
        "GPU and direction, bytes/s. Default: the preset's.", low=0, low_open=True,
        derived=True),
    Key("kv_transfer_latency_s", "float", None, "P/D: a fixed cost per read (posting it, its "
        "completion and the notification that frees the prefill's blocks), seconds. Default: "
        "the preset's.", low=0, derived=True),
)

# The [cluster] keys that configure P/D (unused, and not written to a resolved scenario,
# without kv_producer / kv_consumer instances).
PD_CLUSTER_KEYS = ("prefill_router", "non_cached_tokens", "kv_transfer_link",
                   "kv_transfer_bandwidth_bytes_per_s", "kv_transfer_latency_s")

# vLLM's names for what kvsim takes under another key, or does not model: an unknown key with
# one of these names is answered with this, not with a look-alike key's name.
VLLM_NAMES: dict[tuple[str, str], str] = {
    ("engine", "pipeline_parallel_size"): "pipeline parallelism is not modelled",
    ("engine", "model"): "the model is [model] preset (a name or Hugging Face id) or config",
    ("engine", "speculative_config"): "speculative decoding is the [speculative] section",
    ("speculative", "model"): "kvsim reads no drafter checkpoint: method picks the drafter, and "
    "draft_model names a model preset for method = 'draft_model'",
    ("speculative", "speculative_config"): "give the keys of --speculative-config directly in "
    "[speculative] (method, num_speculative_tokens)",
    ("hardware", "gpu"): "name a preset with hardware.preset (kvsim presets lists them)",
}

DEPLOYMENT_REPLICAS = Key("replicas", "int", 1, "Replicas of this deployment.", low=1,
                          high=MAX_REPLICAS)

SCHEMA: dict[str, tuple[Key, ...]] = {
    "model": MODEL_KEYS, "hardware": HARDWARE_KEYS, "engine": ENGINE_KEYS,
    "speculative": SPECULATIVE_KEYS, "workload": WORKLOAD_KEYS, "cost": COST_KEYS, "run": RUN_KEYS,
    "cluster": CLUSTER_KEYS,
}


@dataclass(frozen=True, slots=True)
class HardwareCfg:
    name: str
    device_name: str
    compute_capability: str | None
    peak_flops_per_s: float | None
    peak_fp8_flops_per_s: float | None
    peak_fp4_flops_per_s: float | None
    mem_bandwidth_bytes_per_s: float
    memory_bytes: int
    interconnect_bandwidth_bytes_per_s: float | None
    interconnect_latency_s: float
    host_link_bandwidth_bytes_per_s: float | None
    host_link_latency_s: float

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
    num_gpu_blocks_derived: bool  # from memory, not given
    gpu_memory_utilization: float
    kv_cache_memory_bytes: int | None
    kv_cache_dtype: str
    tensor_parallel_size: int
    data_parallel_size: int
    enable_expert_parallel: bool
    api_server_count: int
    enable_prefix_caching: bool
    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int
    enable_chunked_prefill: bool
    long_prefill_token_threshold: int
    scheduling_policy: SchedulingPolicy
    scheduler_reserve_full_isl: bool
    async_scheduling: bool
    kv_groups: tuple[GroupSpec, ...] | None
    mamba_cache_mode: MambaCacheMode
    prefix_cache_retention_interval: int | str  # an interval >= 0 or "dense"
    kv_offloading_size: float | None
    kv_offloading_backend: str
    kv_connector_extra_config: dict[str, Any] | None  # as given (an inline table)
    kv_role: KVRoleAll
    # Derived: the offload tier as the connector takes it, and one GPU block's bytes on a rank.
    offload: OffloadParams | None
    kv_block_bytes: int

    @property
    def retention_interval(self) -> int | None:
        """The setting as vLLM's KVCacheConfig holds it (None: dense)."""
        return vllm_retention(self.prefix_cache_retention_interval)

    @property
    def semantics(self) -> Semantics:
        sem = semantics_for(self.vllm_version)
        assert sem is not None  # checked at load
        return sem


def vllm_retention(value: int | str) -> int | None:
    """prefix_cache_retention_interval as vLLM holds it: ``"dense"`` is its None."""
    return None if value == "dense" else int(value)


@dataclass(frozen=True, slots=True)
class SpecCfg:
    method: SpecMethod
    num_speculative_tokens: int  # 0 with method "none"
    acceptance: AcceptanceKind
    acceptance_rates: tuple[float, ...]
    num_accepted: int
    draft_model: str | None
    disable_eagle_block_drop: bool
    disable_lookahead_block_hashes: bool
    parallel_drafting: bool

    @property
    def enabled(self) -> bool:
        return self.method != "none"

    def drafting(self, num_nextn_predict_layers: int) -> Drafting:
        """The accounting's record of these settings (for a checkpoint with that many MTP
        modules)."""
        return Drafting(self.method, self.num_speculative_tokens, self.disable_eagle_block_drop,
                        self.disable_lookahead_block_hashes, self.parallel_drafting,
                        num_nextn_predict_layers)


@dataclass(frozen=True, slots=True)
class WorkloadCfg:
    kind: WorkloadKind
    trace: str | None
    path: Path | None
    format: TraceFormat
    speedup: float
    window_start_s: float
    window_end_s: float | None
    sample_fraction: float
    generator: GeneratorName
    arrival: ArrivalProcess
    arrival_cv: float
    num_requests: int
    request_rate: float
    system_prompt_tokens: int
    num_users: int
    user_history_tokens: int
    input_tokens: int
    output_tokens: int
    turns: int
    think_time_s: float
    context_tokens: int
    num_documents: int
    documents_per_request: int
    document_tokens: int
    zipf_s: float
    random_input_len: int
    random_output_len: int
    random_range_ratio: float
    random_range_rule: RandomRangeRule
    random_prefix_len: int
    max_concurrency: int | None
    num_warmups: int
    acceptance_rate_mean: float | None
    acceptance_rate_sd: float

    @property
    def client(self) -> bool:
        """A benchmark client sends the requests (``max_concurrency`` or warm-ups), not the
        arrival times alone."""
        return self.max_concurrency is not None or self.num_warmups > 0

    @property
    def reads_trace(self) -> bool:
        """A trace file is read: for its requests, or for arrival times or lengths only."""
        return self.kind == "trace" or self.arrival == "trace" or (
            self.kind == "synthetic" and self.generator == "trace_lengths")


@dataclass(frozen=True, slots=True)
class CostCfg:
    model: CostModelName
    profile: str | None  # resolved path of the calibration profile (model = fitted)
    layer_profile: str | None  # resolved layer-profile folder (model = interpolated)
    compute_efficiency: float
    moe_compute_efficiency: float
    bandwidth_efficiency: float
    attention_bandwidth_efficiency: float
    step_overhead_s: float
    step_overhead_per_request_s: float
    frontend_latency_s: float
    # Where the roofline's constants come from: "fitted, compute capability 9.0" (the
    # generation's table in kvsim/presets/roofline.toml), "uncalibrated" (no table for it),
    # "[cost] constants" (the scenario gives one or more).
    roofline_constants: str


@dataclass(frozen=True, slots=True)
class RunCfg:
    seed: int
    max_requests: int | None
    max_sim_time_s: float | None
    max_steps: int | None


@dataclass(frozen=True, slots=True)
class ClusterCfg:
    replicas: int
    router: RouterName
    load_metric: LoadMetric
    load_weight: float
    # [[cluster.deployment]] tables as given: (replicas, ((engine key, value), ...)) each.
    deployment: tuple[tuple[int, tuple[tuple[str, Any], ...]], ...] | None
    engines: tuple[EngineCfg, ...]  # one per replica, in replica order
    # P/D (resolved: prefill_router from router, the link's numbers from its preset).
    prefill_router: RouterName
    non_cached_tokens: int
    kv_transfer_link: str
    kv_transfer_bandwidth_bytes_per_s: float
    kv_transfer_latency_s: float

    @property
    def disaggregated(self) -> bool:
        """Prefill and decode instances (kv_producer / kv_consumer), not aggregated replicas."""
        return any(e.kv_role != "kv_both" for e in self.engines)


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

    @property
    def engines(self) -> tuple[EngineCfg, ...]:
        """Each replica's engine: the cluster's, or the one ``[engine]``."""
        return self.cluster.engines if self.cluster is not None else (self.engine,)

    @property
    def multi_engine(self) -> bool:
        """Several engines run: a cluster's replicas, or data-parallel ranks."""
        return self.cluster is not None or any(e.data_parallel_size > 1 for e in self.engines)

    @property
    def dp_lockstep(self) -> bool:
        """Whether the engine's data-parallel ranks step in lockstep: an MoE model's do
        (vLLM's ``DPEngineCoreProc`` when ``model_config.is_moe``), a dense model's do not."""
        return self.engine.data_parallel_size > 1 and self.model.num_experts > 0

    def replica(self, i: int) -> Scenario:
        """The scenario replica ``i`` of the cluster runs (its own engine settings)."""
        if self.cluster is None:
            assert i == 0
            return self
        return replace(self, engine=self.cluster.engines[i], cluster=None)


