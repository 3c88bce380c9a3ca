"""The KV-cache layout vLLM builds for a model: groups, block sizes, bytes per block.

What vLLM derives at start-up, after the model is built (vLLM 0.33 file names; the rules that
moved between releases are in ``LayoutRules``, one record per release in ``kvsim.semantics``):

1. the attention block size: ``--block-size``, else the attention backend's preferred size for
   the GPU generation (``Platform.update_block_size_for_backend``, ``platforms/interface.py``;
   the backend by ``platforms/cuda.py _get_backend_priorities``);
2. for hybrid models (GatedDeltaNet / Mamba layers with attention), the attention block raised
   until an attention page holds a Mamba state, and the Mamba page padded to it
   (``Platform._align_hybrid_block_size``; 0.19: the hybrid model config's
   ``verify_and_update_config``, ``model_executor/models/config.py``); ``mamba_cache_mode``
   from ``enable_prefix_caching`` (``MambaModelConfig.verify_and_update_config``);
3. one spec per layer (each layer's ``get_kv_cache_spec``), then the KV-cache groups
   (``v1/core/kv_cache_planning.py get_kv_cache_groups``: one group when every layer is alike,
   else layers bucketed by spec and split into groups of equal layer count), and the bytes one
   block id takes (``get_kv_cache_config_from_groups``): ``num_blocks = memory // block_bytes``.

Pure arithmetic on a ``ModelCfg``: no vLLM, no torch. ``kvsim.oracle.layout`` runs vLLM's own
path on CPU for the same config.json, and the tests compare the two.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from kvsim.errors import ConfigError
from kvsim.kv.hybrid import GroupSpec
from kvsim.model import GiB, ModelCfg, attention_page_bytes_per_token

MambaCacheMode = Literal["none", "align", "all"]
Capability = tuple[int, int]
DEFAULT_BLOCK_SIZE = 16  # vLLM's CacheConfig.DEFAULT_BLOCK_SIZE
FLASHINFER_GDN_CHECKPOINT_ALIGNMENT = 64  # v1/attention/backends/gdn_attn.py (0.33)


@dataclass(frozen=True, slots=True)
class LayoutRules:
    """How one release derives the layout (the parts that changed between releases)."""

    # Where the hybrid attention block is raised: "model_config" (0.19: a fixed kernel
    # alignment of 16, 64 for MLA) or "platform" (0.22+: at least the chosen block size, and
    # the backend's smallest kernel block).
    hybrid_align: Literal["model_config", "platform"]
    # 0.32+: the raised block is also a multiple of every backend's smallest kernel block
    # (0.31's _find_non_ssm_backends left out: its layout is not refereed); 0.27+: of 128 for
    # MLA hybrids (0.27 platforms/interface.py:883-888).
    hybrid_backend_alignment: bool
    hybrid_mla_align_128: bool
    # 0.33: in align mode the raised block is a multiple of the Mamba layers' prefill
    # checkpoint alignment (GatedDeltaNet on FlashInfer's prefill kernel: 64).
    hybrid_checkpoint_alignment: bool
    # The mamba_cache_mode values the release has (0.19/0.22 also "all", which a model without
    # Mamba prefix-caching support turns into "align").
    mamba_cache_modes: tuple[MambaCacheMode, ...]


@dataclass(frozen=True, slots=True)
class KVLayout:
    """The layout of one engine: what ``[engine]`` gets when the model comes from config.json."""

    groups: tuple[GroupSpec, ...] | None  # None: one full-attention pool of ``block_size``
    block_size: int                       # vLLM's cache_config.block_size (the attention block)
    block_bytes: int                      # bytes one block id takes on one GPU, all layers
    mamba_cache_mode: MambaCacheMode


# -- attention kernels -------------------------------------------------------------------


def attention_kernel_blocks(model: ModelCfg, capability: Capability | None) -> tuple[int, ...]:
    """The kernel block sizes of the attention backend vLLM picks for this GPU generation
    (``(16,)`` stands for vLLM's ``MultipleOf(16)``: any multiple of 16).

    Standard attention: FlashAttention (Hopper, Ampere, Ada) or FlashInfer (Blackwell SM100),
    both at multiples of 16. MLA (``platforms/cuda.py _get_backend_priorities``): Hopper
    FLASH_ATTN_MLA (multiples of 16), Blackwell SM100 FLASHINFER_MLA (32 or 64), other GPUs
    TRITON_MLA (multiples of 16). Sparse MLA (DeepSeek-V3.2's indexer): the indexer backend
    reads 64-token blocks on CUDA (``mla/indexer.py``: ``[64]``) and FlashMLA-sparse
    multiples of 64, on every generation.
    """
    if model.attention_type == "mla" and model.index_head_dim:
        return (64,)
    if model.attention_type == "mla":
        if capability is None:
            raise ConfigError("hardware.compute_capability", "needed for an MLA model: vLLM's "
                              "MLA kernel, and so its block size, depends on the GPU generation")
        if capability[0] == 10:
            return (32, 64)
    return (16,)


def preferred_block_size(model: ModelCfg, capability: Capability | None) -> int:
    """The block size vLLM chooses when ``--block-size`` is not given
    (``AttentionBackend.get_preferred_block_size``: the default 16 if the kernel takes it,
    else its smallest block)."""
    sizes = attention_kernel_blocks(model, capability)
    return DEFAULT_BLOCK_SIZE if DEFAULT_BLOCK_SIZE in sizes else min(sizes)


# -- Mamba / GatedDeltaNet state ----------------------------------------------------------


def mamba_page_bytes(model: ModelCfg, tp: int, num_speculative_tokens: int) -> int:
    """One linear-attention layer's state on one GPU (vLLM's MambaSpec.page_size_bytes before
    padding): the conv tail in the model dtype, the recurrent state in mamba_ssm_dtype."""
    g = model.linear_attention
    assert g is not None
    conv, ssm = g.state_elements(tp, num_speculative_tokens)
    act = max(2, model.dtype_bytes)  # model_config.dtype: an FP8 checkpoint computes in 16 bits
    ssm_bytes = {"float32": 4, "float": 4}.get(g.ssm_dtype or "", act)
    return conv * act + ssm * ssm_bytes


def mamba_prefill_checkpoint_alignment(model: ModelCfg, capability: Capability | None) -> int | None:
    """GatedDeltaNet's in-chunk checkpoint alignment (0.33 ``_resolve_gdn_prefill_backend``):
    FlashInfer's prefill kernel on Hopper; elsewhere the FLA kernel, which exports none.
    (Blackwell takes FlashInfer's only with a CUDA 13 runtime, which the oracle's run of vLLM's
    own path, at capability 10.0, did not pick: kvsim follows it.)"""
    if model.linear_attention is None or capability is None:
        return None
    return FLASHINFER_GDN_CHECKPOINT_ALIGNMENT if capability[0] == 9 else None


def _raise_hybrid_block(model: ModelCfg, rules: LayoutRules, block_size: int, attn_token: int,
                        mamba_page: int, mode: MambaCacheMode, capability: Capability | None) -> int:
    """The attention block vLLM raises a hybrid model's block to (>= one Mamba state)."""
    kernel_min = min(attention_kernel_blocks(model, capability))
    if rules.hybrid_align == "model_config":
        align = 64 if model.attention_type == "mla" else 16
    else:
        align = max(kernel_min, block_size)
    backend_align = kernel_min if rules.hybrid_backend_alignment else 1
    if rules.hybrid_mla_align_128 and model.attention_type == "mla":
        align = max(align, 128)
    if mode == "align" and rules.hybrid_checkpoint_alignment:
        align = math.lcm(align, mamba_prefill_checkpoint_alignment(model, capability) or 1)
    attn_block = align * -(-mamba_page // (align * attn_token))
    attn_block = backend_align * -(-attn_block // backend_align)
    return max(block_size, attn_block)


# -- the layout ---------------------------------------------------------------------------


def mamba_cache_mode(rules: LayoutRules, given: MambaCacheMode | None,
                     enable_prefix_caching: bool) -> MambaCacheMode:
    """vLLM's MambaModelConfig.verify_and_update_config: caching on means "align" (0.19/0.22:
    "all" for models that support Mamba prefix caching; GatedDeltaNet models do not, so they
    fall back to "align"); caching off means "none"."""
    if not enable_prefix_caching:
        return "none"
    if given in (None, "none", "all"):
        return "align"
    return given


def derive_layout(model: ModelCfg, rules: LayoutRules, *, tp: int, kv_cache_dtype: str,
                  block_size: int | None, capability: Capability | None,
                  enable_prefix_caching: bool, mamba_cache_mode_given: MambaCacheMode | None = None,
                  num_speculative_tokens: int = 0) -> KVLayout:
    """The layout vLLM builds for ``model`` on one engine of ``tp`` GPUs.

    With caching off vLLM sizes a Mamba group's block to max_model_len; a request then holds one
    state block either way, so kvsim gives that group the attention block.
    """
    attn_token = attention_page_bytes_per_token(model, kv_cache_dtype, tp)
    if block_size is not None:
        kernels = attention_kernel_blocks(model, capability)
        if not any(block_size % k == 0 for k in kernels):
            raise ConfigError("engine.block_size", f"{block_size} is not a multiple of the "
                              f"attention kernel's block ({' or '.join(map(str, kernels))} on "
                              "this GPU): vLLM finds no attention backend for it")
    block = block_size or preferred_block_size(model, capability)
    layers = model.layers
    mode: MambaCacheMode = "none"
    if "linear_attention" in layers:
        mode = mamba_cache_mode(rules, mamba_cache_mode_given, enable_prefix_caching)
        block = _raise_hybrid_block(model, rules, block, attn_token,
                                    mamba_page_bytes(model, tp, num_speculative_tokens), mode,
                                    capability)
    page = block * attn_token  # every attention layer's page; Mamba pages are padded to it
    if set(layers) == {"full_attention"}:
        return KVLayout(None, block, page * len(layers), mode)

    # One spec per layer; layers with equal specs form a bucket (in layer order of first
    # appearance), and buckets split into groups of group_size layers.
    buckets: dict[str, list[int]] = {}
    for i, t in enumerate(layers):
        buckets.setdefault(t, []).append(i)
    sizes = [len(v) for v in buckets.values()]
    group_size = max(sizes) if max(sizes) < min(sizes) * 1.5 else min(sizes)
    checkpoint = mamba_prefill_checkpoint_alignment(model, capability) if (
        mode == "align" and rules.hybrid_checkpoint_alignment) else None
    groups: list[GroupSpec] = []
    for kind, members in buckets.items():
        num_groups = -(-len(members) // group_size)
        for i in range(num_groups):
            n = len(members[i::num_groups])
            if kind == "full_attention":
                groups.append(GroupSpec("full_attention", block, num_layers=n))
            elif kind == "sliding_attention":
                groups.append(GroupSpec("sliding_window", block, sliding_window=model.sliding_window,
                                        num_layers=n))
            else:
                groups.append(GroupSpec("mamba", block, num_layers=n,
                                        prefill_checkpoint_alignment=block if checkpoint else None))
    return KVLayout(tuple(groups), block, page * group_size, mode)


def estimate_kv_cache_bytes(model: ModelCfg, memory_bytes: int, util: float, tp: int,
                            max_num_batched_tokens: int, max_num_seqs: int,
                            dp: int = 1) -> tuple[int, dict]:
    """vLLM's "available KV cache memory", estimated without profiling.

    ``memory × gpu_memory_utilization − weights − activation peak − non-torch memory``, where
    the weights are split over the ``tp`` GPUs, and an MoE model's routed experts over all
    ``dp × tp`` GPUs of its data-parallel ranks (vLLM's FusedMoE shards them across the
    flattened DP × TP group, whole experts with expert parallelism, slices without), where
    the activation peak stands in for vLLM's profile run (a ``max_num_batched_tokens`` forward
    pass: MLP intermediate and residual stream, plus float32 logits for ``max_num_seqs``
    sampled rows) and non-torch memory (CUDA context, graphs, NCCL) is taken as 1 GiB.
    """
    experts = model.routed_expert_bytes
    weights = (model.weight_bytes - experts) // tp + experts // (tp * dp)
    activation = (max_num_batched_tokens * (2 * model.intermediate_size // tp + 4 * model.hidden_size)
                  * model.dtype_bytes + max_num_seqs * model.vocab_size * 4)
    non_torch = 1 * GiB
    avail = int(memory_bytes * util) - weights - activation - non_torch
    return avail, {"weights_bytes": weights, "activation_bytes": activation,
                   "non_torch_bytes": non_torch}
