"""A model from its Hugging Face ``config.json``: what vLLM reads, and the shapes it builds.

``model_from_config(cfg, where)`` reads the fields vLLM's model classes read (the release's
``vllm/model_executor/models/<family>.py`` and transformers' configuration classes for the
defaults a config.json leaves out) and returns a ``ModelCfg``: layer count and each layer's kind
(``layer_types``, or the family's pattern: ``sliding_window_pattern``, ``full_attention_interval``,
``max_window_layers``), head and KV dims, MLA, MoE, MTP layers, tied embeddings, dtype, and the
parameter count from the weight shapes. No weights, no network, no transformers.

A field that is missing or malformed, or an architecture this module does not read, is a
``ConfigError`` naming the file and the field: nothing is guessed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvsim.errors import ConfigError
from kvsim.model import DTYPE_BYTES, LAYER_TYPES, AttentionType, GatedDeltaNet, LayerType, ModelCfg

_MISSING = object()


@dataclass(frozen=True, slots=True)
class _Family:
    """How one family of architectures lays out its weights (vLLM's model file in ``file``)."""

    file: str
    qk_norm: bool = False            # per-head RMSNorm on q and k (Qwen3, Gemma 3, Qwen3-Next)
    attention_bias: str = ""         # config key that turns on q/k/v (and o) biases
    qkv_bias: bool = False           # q/k/v biases always (Qwen2)
    o_bias: bool = False             # the output projection has a bias too (gpt-oss)
    gated_attention: bool = False    # q_proj also emits a sigmoid output gate (Qwen3-Next, 3.5)
    norms_per_layer: int = 2         # RMSNorms of width hidden_size per decoder layer
    sinks: bool = False              # one learned attention sink per query head (gpt-oss)
    multimodal: bool = False         # the language model's keys sit under ``text_config``
    vision: str = ""                 # the vision tower's kind, for the parameter count
    weights: str = ""                # "deepseek" (MLA, shared experts) or "gpt_oss" (biased experts)


FAMILIES: dict[str, _Family] = {
    "LlamaForCausalLM": _Family("llama.py", attention_bias="attention_bias"),
    "MistralForCausalLM": _Family("mistral.py"),
    "Qwen2ForCausalLM": _Family("qwen2.py", qkv_bias=True),
    "Qwen3ForCausalLM": _Family("qwen3.py", qk_norm=True, attention_bias="attention_bias"),
    "Qwen3MoeForCausalLM": _Family("qwen3_moe.py", qk_norm=True, attention_bias="attention_bias"),
    "Qwen3NextForCausalLM": _Family("qwen3_next.py", qk_norm=True, gated_attention=True),
    "Qwen3_5ForConditionalGeneration": _Family("qwen3_5.py", qk_norm=True, gated_attention=True,
                                               multimodal=True, vision="qwen3_vl"),
    "Qwen3_5MoeForConditionalGeneration": _Family("qwen3_5.py", qk_norm=True, gated_attention=True,
                                                  multimodal=True, vision="qwen3_vl"),
    "GptOssForCausalLM": _Family("gpt_oss.py", attention_bias="attention_bias", o_bias=True,
                                 sinks=True, weights="gpt_oss"),
    "Gemma3ForCausalLM": _Family("gemma3.py", qk_norm=True, norms_per_layer=4),
    "Gemma3ForConditionalGeneration": _Family("gemma3_mm.py", qk_norm=True, norms_per_layer=4,
                                              multimodal=True, vision="siglip"),
    "DeepseekV3ForCausalLM": _Family("deepseek_v2.py", weights="deepseek"),
    "DeepseekV32ForCausalLM": _Family("deepseek_v2.py", weights="deepseek"),
}

# Defaults transformers' configuration classes supply when config.json leaves a key out
# (transformers/models/<type>/configuration_<type>.py); vLLM reads the filled-in object.
_TEXT_DEFAULTS: dict[str, dict[str, Any]] = {
    "Gemma3ForConditionalGeneration": {
        "vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216,
        "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4,
        "head_dim": 256, "max_position_embeddings": 131_072, "sliding_window": 4096,
        "sliding_window_pattern": 6, "tie_word_embeddings": True},
    "Gemma3ForCausalLM": {"head_dim": 256, "sliding_window_pattern": 6,
                          "tie_word_embeddings": True},
    "Qwen3NextForCausalLM": {"full_attention_interval": 4},
}
_VISION_DEFAULTS: dict[str, dict[str, Any]] = {
    # Gemma 3's SigLIP tower (transformers SiglipVisionConfig as Gemma3Config fills it in).
    "siglip": {"hidden_size": 1152, "intermediate_size": 4304, "num_hidden_layers": 27,
               "num_channels": 3, "image_size": 896, "patch_size": 14},
}


def read_config_file(path: str | Path) -> tuple[dict, Path]:
    """The JSON of ``path`` (a config.json, or a folder holding one) and the file read."""
    p = Path(path).expanduser()
    if p.is_dir():
        p = p / "config.json"
    try:
        data = json.loads(p.read_text())
    except FileNotFoundError:
        raise ConfigError(str(p), "no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(str(p), f"cannot read: {exc}") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(str(p), f"not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(str(p), "must be a JSON object (a model's config.json)")
    return data, p


class _Reader:
    """Typed access to one table of config.json, errors naming the file and the field."""

    def __init__(self, table: dict, where: str, prefix: str = "", defaults: dict | None = None):
        self.table, self.where, self.prefix, self.defaults = table, where, prefix, defaults or {}

    def has(self, key: str) -> bool:
        return self.table.get(key) is not None or key in self.defaults

    def raw(self, key: str, default: Any = _MISSING) -> Any:
        v = self.table.get(key)
        if v is None:
            v = self.defaults.get(key, default)
        if v is _MISSING:
            raise ConfigError(f"{self.where}: {self.prefix}{key}", "missing")
        return v

    def int(self, key: str, default: Any = _MISSING, low: int = 1) -> Any:
        """An integer >= ``low``, or ``default`` (None included) when the key is absent."""
        v = self.raw(key, default)
        if v is None:
            return v
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise ConfigError(f"{self.where}: {self.prefix}{key}",
                              f"must be an integer >= {low}, got {v!r}")
        return v

    def bool(self, key: str, default: bool) -> bool:
        v = self.raw(key, default)
        if not isinstance(v, bool):
            raise ConfigError(f"{self.where}: {self.prefix}{key}", f"must be true or false, got {v!r}")
        return v


def model_from_config(cfg: dict, where: str, *, name: str = "", hf_id: str = "",
                      preset: str | None = None, config: str | None = None) -> ModelCfg:
    """The ``ModelCfg`` vLLM builds from config.json ``cfg`` (``where`` names the file)."""
    archs = cfg.get("architectures")
    if not isinstance(archs, list) or not archs or not isinstance(archs[0], str):
        raise ConfigError(f"{where}: architectures", "missing (a list naming the model class)")
    arch = archs[0]
    fam = FAMILIES.get(arch)
    if fam is None:
        raise ConfigError(f"{where}: architectures", f"{arch!r} is not an architecture kvsim "
                          f"reads (known: {', '.join(FAMILIES)})")
    top = _Reader(cfg, where)
    if fam.multimodal:
        text_cfg = cfg.get("text_config") or {}
        if not isinstance(text_cfg, dict):
            raise ConfigError(f"{where}: text_config", "must be an object")
        t = _Reader(text_cfg, where, "text_config.", _TEXT_DEFAULTS.get(arch))
    else:
        t = _Reader(cfg, where, "", _TEXT_DEFAULTS.get(arch))

    H = t.int("hidden_size")
    L = t.int("num_hidden_layers")
    nq = t.int("num_attention_heads")
    nkv = t.int("num_key_value_heads", nq)
    d = t.int("head_dim", None) or H // nq  # vLLM: config.head_dim, else hidden / heads
    V = t.int("vocab_size")
    max_pos = t.int("max_position_embeddings")
    tied = t.raw("tie_word_embeddings", None)
    if tied is None:
        tied = top.bool("tie_word_embeddings", False)
    dtype = _dtype(cfg, t, where)
    kind = fam.weights

    layer_types = _layer_types(arch, t, L)
    window = t.int("sliding_window", 0, low=0) if "sliding_attention" in layer_types else 0
    if "sliding_attention" in layer_types and not window:
        raise ConfigError(f"{where}: {t.prefix}sliding_window", "missing (the model has "
                          "sliding-window layers)")
    gdn = None
    if "linear_attention" in layer_types:
        gdn = GatedDeltaNet(
            num_key_heads=t.int("linear_num_key_heads"),
            num_value_heads=t.int("linear_num_value_heads"),
            key_head_dim=t.int("linear_key_head_dim"),
            value_head_dim=t.int("linear_value_head_dim"),
            conv_kernel_dim=t.int("linear_conv_kernel_dim"),
            ssm_dtype=_ssm_dtype(t, where) if arch.startswith("Qwen3_5") else None)

    # -- weights, by shape -------------------------------------------------------------------
    bias = fam.qkv_bias or (fam.attention_bias and t.bool(fam.attention_bias, False))
    attention_type: AttentionType = "gqa"
    kv_lora = rope = index_head_dim = 0
    if kind == "deepseek":
        attention_type = "mla"
        kv_lora, rope = t.int("kv_lora_rank"), t.int("qk_rope_head_dim")
        nope, v_dim = t.int("qk_nope_head_dim"), t.int("v_head_dim")
        q_lora = t.int("q_lora_rank", None)
        q = (H * q_lora + q_lora + q_lora * nq * (nope + rope)) if q_lora else H * nq * (nope + rope)
        attn = (q + H * (kv_lora + rope) + kv_lora + kv_lora * nq * (nope + v_dim) + nq * v_dim * H)
        if arch == "DeepseekV32ForCausalLM":  # the lightning indexer (deepseek_v2.py Indexer)
            ni, di = t.int("index_n_heads"), t.int("index_head_dim")
            attn += (q_lora or H) * ni * di + H * di + 2 * di + H * ni
            index_head_dim = di
        d = nope + rope  # vLLM's get_head_size for MLA is kv_lora + rope; q/k head size here
        nkv = nq
    else:
        attn = (H * nq * d * (2 if fam.gated_attention else 1) + 2 * H * nkv * d + nq * d * H)
        if bias:
            attn += nq * d + 2 * nkv * d + (H if fam.o_bias else 0)
        if fam.qk_norm:
            attn += 2 * d
        if fam.sinks:
            attn += nq
    inter = t.int("intermediate_size", 0, low=0)  # the dense MLP's width (gpt-oss: an expert's)
    dense_mlp = 3 * H * inter
    moe, active_moe, experts, top_k = _moe(kind, t, H)
    moe_layers = _moe_layers(kind, t, L, experts)
    gdn_mixer = _gdn_params(gdn, H) if gdn else 0
    layers = 0
    for i, lt in enumerate(layer_types):
        layers += (gdn_mixer if lt == "linear_attention" else attn) + fam.norms_per_layer * H
        layers += moe if i in moe_layers else dense_mlp
    embed = V * H
    body = embed + layers + H + (0 if tied else V * H)
    vision = _vision_params(fam.vision, cfg, where, H)
    total = body + vision
    active = total - embed - vision - len(moe_layers) * (moe - active_moe)
    quantization = _quantization(cfg.get("quantization_config"))
    quantized = 0
    if quantization == "mxfp4":
        # gpt-oss: the experts' projection weights (not their biases) in MXFP4.
        quantized = len(moe_layers) * experts * 3 * H * inter

    num_mtp = (t.int("num_nextn_predict_layers", 0, low=0) if kind == "deepseek"
               else t.int("mtp_num_hidden_layers", 0, low=0))
    mtp_layer = attn + (moe if moe_layers else dense_mlp) + fam.norms_per_layer * H
    mtp = 2 * H * H + 3 * H + mtp_layer if num_mtp else 0
    return ModelCfg(
        name=name or str(cfg.get("_name_or_path") or arch), num_hidden_layers=L, hidden_size=H,
        num_attention_heads=nq, num_key_value_heads=nkv, head_dim=d,
        intermediate_size=inter or t.int("moe_intermediate_size"),
        vocab_size=V, num_params=total, dtype=dtype, max_position_embeddings=max_pos,
        num_active_params=active if experts else None, num_experts=experts,
        num_experts_per_tok=top_k, attention_type=attention_type, kv_lora_rank=kv_lora,
        qk_rope_head_dim=rope, num_nextn_predict_layers=num_mtp, mtp_params=mtp,
        architecture=arch,
        layer_types=layer_types if set(layer_types) != {"full_attention"} else (),
        sliding_window=window, linear_attention=gdn, index_head_dim=index_head_dim,
        quantization=quantization, quantized_params=quantized, hf_id=hf_id,
        # The routed experts alone: (E − k) of them are the block's inactive part.
        routed_expert_params=(len(moe_layers) * (moe - active_moe) // (experts - top_k) * experts
                              if experts > top_k else 0),
        preset=preset,
        config=config)


def _quantization(q) -> str | None:
    """vLLM's quantization method for a config.json's ``quantization_config`` (None: the
    weights are in the dtype, or a whole-model FP8 checkpoint, which ``_dtype`` reads as
    float8): ModelOpt by its quant_algo, compressed-tensors by its weights' bits."""
    if not isinstance(q, dict):
        return None
    method = q.get("quant_method")
    if method == "modelopt":
        algo = str(q.get("quant_algo", "")).upper()
        return "modelopt_fp4" if "FP4" in algo else "modelopt" if "FP8" in algo else None
    if method == "compressed-tensors":
        bits = {w.get("num_bits") for g in (q.get("config_groups") or {}).values()
                if isinstance(g, dict) and isinstance(w := g.get("weights"), dict)}
        return "awq" if bits == {4} else "compressed-tensors" if bits == {8} else None
    if method in ("mxfp4", "awq", "gptq", "fbgemm_fp8", "modelopt_fp4"):
        return method
    return None


def _dtype(cfg: dict, t: _Reader, where: str) -> str:
    """The weights' dtype as vLLM loads them: torch_dtype (``dtype`` in transformers 5), an FP8
    checkpoint's float8 format from its quantization_config."""
    q = cfg.get("quantization_config")
    if isinstance(q, dict) and q.get("quant_method") == "fp8":
        return "float8_e4m3fn"
    v = cfg.get("torch_dtype") or cfg.get("dtype") or t.raw("torch_dtype", None) or t.raw(
        "dtype", "bfloat16")
    if v not in DTYPE_BYTES:
        raise ConfigError(f"{where}: torch_dtype", f"{v!r} is not a dtype kvsim knows "
                          f"({', '.join(DTYPE_BYTES)})")
    return v


def _ssm_dtype(t: _Reader, where: str) -> str | None:
    v = t.raw("mamba_ssm_dtype", None)
    if v is not None and v not in DTYPE_BYTES:
        raise ConfigError(f"{where}: {t.prefix}mamba_ssm_dtype", f"{v!r} is not a dtype kvsim knows")
    return v


def _layer_types(arch: str, t: _Reader, L: int) -> tuple[LayerType, ...]:
    """Each decoder layer's kind, as the release's model file decides it."""
    full: LayerType = "full_attention"
    sliding: LayerType = "sliding_attention"
    linear: LayerType = "linear_attention"
    given = t.raw("layer_types", None)
    if given is not None:
        if (not isinstance(given, list) or len(given) != L
                or any(x not in LAYER_TYPES for x in given)):
            raise ConfigError(f"{t.where}: {t.prefix}layer_types", f"must list one of "
                              f"{', '.join(LAYER_TYPES)} for each of the {L} layers")
        return tuple(LAYER_TYPES[LAYER_TYPES.index(x)] for x in given)
    if arch.startswith("Gemma3"):
        # transformers Gemma3TextConfig: every sliding_window_pattern-th layer is global.
        pattern = t.int("sliding_window_pattern")
        return tuple(full if (i + 1) % pattern == 0 else sliding
                     for i in range(L))
    if arch.startswith(("Qwen3Next", "Qwen3_5")):
        interval = t.int("full_attention_interval")
        return tuple(full if (i + 1) % interval == 0 else linear
                     for i in range(L))
    if arch.startswith(("Qwen2", "Qwen3")):
        # transformers Qwen2/Qwen3 config: sliding windows only with use_sliding_window, from
        # layer max_window_layers on.
        if t.bool("use_sliding_window", False) and t.has("sliding_window"):
            first = t.int("max_window_layers", L, low=0)
            return tuple(sliding if i >= first else full for i in range(L))
        return (full,) * L
    if arch in ("MistralForCausalLM", "LlamaForCausalLM") and t.raw("sliding_window", None):
        # No layer_types: vLLM's Attention takes cache_config.sliding_window (the model's) for
        # every layer.
        return (sliding,) * L
    return (full,) * L


def _moe(kind: str, t: _Reader, H: int) -> tuple[int, int, int, int]:
    """(params of one MoE block, of its active part, routed experts, top-k); zeros if dense."""
    E = (t.int("n_routed_experts", 0, low=0) if kind == "deepseek" else
         t.int("num_local_experts", 0, low=0) if kind == "gpt_oss" else
         t.int("num_experts", 0, low=0))
    if not E:
        return 0, 0, 0, 0
    k = t.int("num_experts_per_tok")
    if kind == "gpt_oss":
        inter = t.int("intermediate_size")
        expert = H * 2 * inter + 2 * inter + inter * H + H   # gate_up and down, with biases
        router = H * E + E
        return router + E * expert, router + k * expert, E, k
    inter = t.int("moe_intermediate_size")
    expert = 3 * H * inter
    router = H * E
    shared = 0
    if kind == "deepseek":
        router += E  # e_score_correction_bias
        shared = t.int("n_shared_experts", 0, low=0) * expert
    elif t.has("shared_expert_intermediate_size") and t.int("shared_expert_intermediate_size", 0,
                                                              low=0):
        shared = 3 * H * t.int("shared_expert_intermediate_size") + H  # + the shared-expert gate
    return router + E * expert + shared, router + k * expert + shared, E, k


def _moe_layers(kind: str, t: _Reader, L: int, experts: int) -> set[int]:
    if not experts:
        return set()
    if kind == "deepseek":
        first = t.int("first_k_dense_replace", 0, low=0)
        freq = t.int("moe_layer_freq", 1)
        return {i for i in range(first, L) if i % freq == 0}
    step = t.int("decoder_sparse_step", 1)
    dense = set(t.raw("mlp_only_layers", []) or [])
    return {i for i in range(L) if i not in dense and (i + 1) % step == 0}


def _gdn_params(g: GatedDeltaNet, H: int) -> int:
    """One GatedDeltaNet mixer (qwen3_next.py Qwen3NextGatedDeltaNet)."""
    k, v = g.num_key_heads * g.key_head_dim, g.num_value_heads * g.value_head_dim
    conv_dim = 2 * k + v
    return (H * (2 * k + 2 * v)            # in_proj_qkvz
            + H * 2 * g.num_value_heads    # in_proj_ba
            + conv_dim * g.conv_kernel_dim  # depthwise conv1d
            + 2 * g.num_value_heads        # dt_bias, A_log
            + g.value_head_dim             # gated RMSNorm
            + v * H)                       # out_proj


def _vision_params(kind: str, cfg: dict, where: str, text_hidden: int) -> int:
    """The vision tower and projector of a multimodal checkpoint (loaded with the model)."""
    if not kind:
        return 0
    table = cfg.get("vision_config") or {}
    if not isinstance(table, dict):
        raise ConfigError(f"{where}: vision_config", "must be an object")
    v = _Reader(table, where, "vision_config.", _VISION_DEFAULTS.get(kind))
    h, i, n = v.int("hidden_size"), v.int("intermediate_size"), v.int(
        "depth" if kind == "qwen3_vl" else "num_hidden_layers")
    block = 4 * (h * h + h) + 2 * h * i + i + h + 4 * h  # attention, MLP (biases), two LayerNorms
    if kind == "siglip":
        p, s = v.int("patch_size"), v.int("image_size")
        embed = v.int("num_channels") * p * p * h + h + (s // p) ** 2 * h
        return embed + n * block + 2 * h + h * text_hidden + h  # post-LN; projector and its norm
    # Qwen3-VL ViT (qwen3_vl.py): Conv3d patch embed, learned positions, patch merger(s).
    p, tp, c = v.int("patch_size"), v.int("temporal_patch_size"), v.int("in_channels")
    m = v.int("spatial_merge_size")
    out = v.int("out_hidden_size", text_hidden)
    merged = h * m * m
    merger = 2 * h + merged * merged + merged + merged * out + out
    deepstack = len(v.raw("deepstack_visual_indexes", []) or [])
    mergers = merger + deepstack * (2 * merged + merged * merged + merged + merged * out + out)
    embed = c * tp * p * p * h + h + v.int("num_position_embeddings") * h
    return embed + n * block + mergers
