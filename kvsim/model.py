"""What kvsim knows of a model: its shape, as vLLM reads it from config.json.

A leaf module (it imports nothing of kvsim's but the error type): the scenario parser, the KV
layout derivation (``kvsim.layout``) and the cost models all take a ``ModelCfg``.
``kvsim.hf`` builds one from a Hugging Face ``config.json``; a scenario can also give the keys
by hand.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

GiB = 1 << 30

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "half": 2, "float32": 4, "float": 4,
               "float8_e4m3fn": 1, "fp8": 1}
KV_CACHE_DTYPE_BYTES = {"fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "bfloat16": 2, "float16": 2}

# Low-bit weight formats: bits per weight, block scales included (MXFP4: an 8-bit scale per
# 32 values; NVFP4: an FP8 scale per 16; INT4: a 16-bit scale and zero per group of 128 in
# AWQ / GPTQ; FP8: per-tensor or 128x128-block scales, a negligible share).
WeightFormat = Literal["fp8", "mxfp4", "nvfp4", "int4"]
FORMAT_BITS: dict[str, float] = {"fp8": 8.0, "mxfp4": 4.25, "nvfp4": 4.5, "int4": 4.25}
# vLLM's quantization methods (``--quantization``, or config.json's quantization_config
# ``quant_method``; ModelOpt's by its quant_algo) -> the format of the decoder's linear weights.
QUANTIZATION_FORMATS: dict[str, WeightFormat] = {
    "fp8": "fp8", "modelopt": "fp8", "fbgemm_fp8": "fp8", "compressed-tensors": "fp8",
    "modelopt_fp4": "nvfp4", "mxfp4": "mxfp4", "awq": "int4", "awq_marlin": "int4",
    "gptq": "int4", "gptq_marlin": "int4"}

AttentionType = Literal["gqa", "mla"]
# A decoder layer's kind, as HF config.json's ``layer_types`` names them (vLLM reads the same
# list): full attention, sliding-window attention, or a linear-attention (GatedDeltaNet) mixer.
LayerType = Literal["full_attention", "sliding_attention", "linear_attention"]
LAYER_TYPES: tuple[LayerType, ...] = ("full_attention", "sliding_attention", "linear_attention")


@dataclass(frozen=True, slots=True)
class GatedDeltaNet:
    """The linear-attention mixer of Qwen3-Next / Qwen3.5 / Qwen3.6 (config.json's ``linear_*``
    keys). Its state per request is a causal-conv tail and a recurrent matrix per value head
    (vLLM: ``MambaStateShapeCalculator.gated_delta_net_state_shape``)."""

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel_dim: int
    ssm_dtype: str | None = None  # config.json's mamba_ssm_dtype (Qwen3.5: "float32"); None: the model dtype

    def state_elements(self, tp: int, num_speculative_tokens: int = 0) -> tuple[int, int]:
        """Elements of (conv state, recurrent state) per layer on one of ``tp`` GPUs."""
        conv_dim = (2 * self.key_head_dim * self.num_key_heads
                    + self.value_head_dim * self.num_value_heads)
        conv = conv_dim // tp * (self.conv_kernel_dim - 1 + num_speculative_tokens)
        ssm = self.num_value_heads // tp * self.value_head_dim * self.key_head_dim
        return conv, ssm


@dataclass(frozen=True, slots=True)
class ModelCfg:
    name: str
    num_hidden_layers: int
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    num_params: int
    dtype: str
    max_position_embeddings: int
    num_active_params: int | None
    num_experts: int
    num_experts_per_tok: int
    attention_type: AttentionType
    kv_lora_rank: int
    qk_rope_head_dim: int
    num_nextn_predict_layers: int
    mtp_params: int
    # vLLM's quantization method (QUANTIZATION_FORMATS); None: the weights in ``dtype``.
    quantization: str | None
    preset: str | None  # the shipped preset it was read from
    config: str | None  # or the config.json file (absolute path)
    # From config.json (kvsim.hf); a model given key by key is all full attention.
    architecture: str = ""
    layer_types: tuple[LayerType, ...] = ()  # one per decoder layer; () = all full_attention
    sliding_window: int = 0
    linear_attention: GatedDeltaNet | None = None
    # DeepSeek Sparse Attention (DeepSeek-V3.2): the lightning indexer's key width; each MLA
    # layer also caches one indexer key per token (0: no indexer).
    index_head_dim: int = 0
    # Of num_params, those stored in ``quantization``'s format (0 with a method: every linear
    # weight of the decoder layers, the embeddings and LM head staying in ``dtype``).
    quantized_params: int = 0
    routed_expert_params: int = 0  # of num_params, the routed experts' (from config.json)
    hf_id: str = ""

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def embedding_params(self) -> int:
        """The embedding and LM-head matrices (2·V·h, at most half the model)."""
        return min(2 * self.vocab_size * self.hidden_size, self.num_params // 2)

    @property
    def quant_format(self) -> WeightFormat | None:
        return QUANTIZATION_FORMATS[self.quantization] if self.quantization else None

    @property
    def low_bit_params(self) -> int:
        """Parameters stored in ``quant_format`` (0 without quantization)."""
        if self.quant_format is None:
            return 0
        return self.quantized_params or self.num_params - self.embedding_params

    def _bytes(self, params: int, low_bit: int) -> int:
        bits = FORMAT_BITS[self.quant_format] if self.quant_format else 0.0
        return (params - low_bit) * self.dtype_bytes + int(low_bit * bits / 8)

    @property
    def weight_bytes(self) -> int:
        """Bytes of the weights as loaded: ``low_bit_params`` in their format (scales
        included), the rest in ``dtype``."""
        return self._bytes(self.num_params, self.low_bit_params)

    @property
    def routed_params(self) -> int:
        """Parameters of the routed experts (0 for a dense model): counted from config.json's
        shapes, or for a model given key by key estimated from its parameters, a token
        reading top-k of the N experts, so that ``num_params − num_active_params`` is
        (N − k) / N of them."""
        n, k = self.num_experts, self.num_experts_per_tok
        if not n or n <= k:
            return 0
        if self.routed_expert_params:
            return self.routed_expert_params
        if self.num_active_params is None:
            return 0
        return (self.num_params - self.num_active_params) * n // (n - k)

    @property
    def routed_expert_bytes(self) -> int:
        """Bytes of the routed experts' weights, in their format (0 for a dense model)."""
        params = self.routed_params
        return self._bytes(params, min(self.low_bit_params, params))

    @property
    def active_params(self) -> int:
        return self.num_active_params or self.num_params

    @property
    def layers(self) -> tuple[LayerType, ...]:
        """Every decoder layer's kind."""
        full: tuple[LayerType, ...] = ("full_attention",)
        return self.layer_types or full * self.num_hidden_layers

    @property
    def num_attention_layers(self) -> int:
        """Layers that keep K and V per token (full or sliding-window attention)."""
        return sum(t != "linear_attention" for t in self.layers)


def kv_cache_dtype_bytes(model: ModelCfg, kv_cache_dtype: str) -> int:
    """Bytes of one cached K or V element (``auto``: the model dtype; an fp8 checkpoint still
    keeps its KV cache in 16 bits unless told otherwise)."""
    if kv_cache_dtype != "auto":
        return KV_CACHE_DTYPE_BYTES[kv_cache_dtype]
    return max(2, model.dtype_bytes)


def indexer_bytes_per_token(model: ModelCfg) -> int:
    """A sparse-attention layer's indexer-key bytes per token: fp8 values and one float32
    scale per 128 (``DeepseekV32IndexerCache``: ``head_dim + head_dim // 128 * 4``, uint8,
    whatever the KV cache dtype)."""
    return model.index_head_dim + model.index_head_dim // 128 * 4


def attention_page_bytes_per_token(model: ModelCfg, kv_cache_dtype: str, tp: int) -> int:
    """One attention layer's KV bytes per token on one GPU (vLLM's ``page_size_bytes`` of an
    attention spec with block_size 1): K and V per KV head, or MLA's one latent, replicated
    (with a sparse-attention model's indexer key, which shares the layer's block ids)."""
    dtype_bytes = kv_cache_dtype_bytes(model, kv_cache_dtype)
    if model.attention_type == "mla":
        return ((model.kv_lora_rank + model.qk_rope_head_dim) * dtype_bytes
                + indexer_bytes_per_token(model))
    kv_heads = max(1, model.num_key_value_heads // tp)  # vLLM's ModelConfig.get_num_kv_heads
    return 2 * kv_heads * model.head_dim * dtype_bytes


def kv_bytes_per_token(model: ModelCfg, engine_kv_dtype: str, tp: int) -> int:
    """Bytes of K and V per token across all attention layers, on one GPU of the replica."""
    return model.num_attention_layers * attention_page_bytes_per_token(model, engine_kv_dtype, tp)
