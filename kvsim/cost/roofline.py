"""The default step-time model: a roofline over the step's plan.

For one step with chunks ``(n new tokens, c tokens of context before them)`` over T = Σn
tokens::

    compute = 2 · (P_body − P_routed·k/E) · T / peak(dense format)    linear layers
            + 2 · P_routed·k/E · T / peak(expert format)              the top-k routed experts
            + 2 · V · h · (#sampled rows) / peak(BF16)                LM head
            + 4 · heads · d · Σ n·(c' + (n+1)/2) / peak(BF16)         attention, per layer
    weights = dense weight bytes
            + routed expert bytes · (1 − (1 − k/E)^T)   the experts the step's tokens touch
    kv      = kv_bytes_per_token · Σ (c' + n)           KV read by attention
            + kv_bytes_per_token · Σ n                  KV written
    gpu     = max(compute, weights / (bandwidth · bandwidth_efficiency)
                           + kv / (bandwidth · attention_bandwidth_efficiency)) + all-reduces
    cpu     = step_overhead_per_request_s · (requests in the step)
    time    = step_overhead_s + (max(gpu, cpu) with async scheduling, else gpu + cpu)

``c'`` is ``c`` on full-attention layers and at most the window on sliding-window ones.
``P_body`` is the active parameter count (MoE: ``num_active_params``) less the embedding and
LM-head matrices (2·V·h, capped at half the model). Each peak is the GPU's for the weights'
format (``format_peak``: FP8 and NVFP4 where it has those tensor cores, else BF16) times
``compute_efficiency`` (``moe_compute_efficiency`` for the routed experts). Weight bytes are
in their format (``[model] quantization``). Tensor parallelism divides FLOPs, weights and KV
heads across GPUs and adds each layer's all-reduces (``kvsim.cost.comm``).

Drafting is costed separately (``draft_time_s``), as passes of the drafter with the same
roofline: EAGLE/EAGLE3/MTP heads are one average decoder layer (active parameters / layers)
plus the shared LM head; a draft model is its own preset; ngram costs nothing.
The first pass runs over every scheduled token (the drafter keeps its own KV in step with the
target's), each of the other k − 1 passes over one row per sampling request.

Efficiencies and fixed costs come from ``[cost]``, by default the GPU generation's in
``kvsim/presets/roofline.toml``, fitted by ``calibration/fit_inferencex.py`` on InferenceX's
public vLLM runs; a generation with no table of its own takes ``[default]`` and outputs label
the model "uncalibrated".
"""

from __future__ import annotations

from dataclasses import dataclass

from kvsim.cost.base import CostInputs, Decodes
from kvsim.cost.comm import AllReduce
from kvsim.cost.fitted import expert_share
from kvsim.model import ModelCfg, kv_bytes_per_token


@dataclass(frozen=True, slots=True)
class _Pass:
    """Roofline coefficients of one forward pass of some stack of layers: linear work split
    into the routed experts' and the rest, each at the peak of its weights' format (seconds
    per FLOP), attention of full and sliding-window layers apart (a window caps the context a
    token attends to and reads), and the weight bytes a step reads: the routed experts' only
    for the experts its tokens touch."""

    linear_s_per_token: float  # dense linear work (attention projections, dense / shared MLPs)
    expert_s_per_token: float  # the top-k routed experts' work
    lm_head_s_per_row: float
    full_attn_s_per_pair: float
    window_attn_s_per_pair: float
    window: int  # the sliding layers' window (0: none)
    dense_weight_bytes: float
    expert_weight_bytes: float
    experts: tuple[int, int]  # (num_experts, top_k)
    full_kv_bytes_per_token: float
    window_kv_bytes_per_token: float

    def time_s(self, chunks, num_rows: int, bytes_per_s: float, kv_bytes_per_s: float,
               decodes: Decodes | None = None) -> float:
        """``decodes``: further chunks ``(n, c)`` of one length, as ``Decodes``; weights are
        read at ``bytes_per_s``, the KV cache at ``kv_bytes_per_s``."""
        tokens = pairs = kv_read = 0.0
        w_pairs = w_read = 0.0
        w = self.window
        if decodes is not None:
            # Whole-number sums (pairs of an (n, c) chunk: n·c + n(n + 1)/2) far below 2**53:
            # added in any order they give the same floats as chunk by chunk.
            count, n, total = decodes[0], decodes[1], decodes[2]
            tokens, pairs = float(count * n), float(n * total - count * n * (n - 1) // 2)
            kv_read = float(total)
            if w:  # every chunk's context capped at the window: at most count·w each
                w_read = float(min(total, count * w))
                w_pairs = float(min(pairs, count * n * w))
        for n, c in chunks:
            tokens += n
            pairs += n * (c + (n + 1) / 2)
            kv_read += c + n
            if w:
                w_read += min(c + n, w)
                w_pairs += n * min(c + (n + 1) / 2, w)
        if not w:
            w_pairs, w_read = pairs, kv_read
        return self.time_of(tokens, pairs, kv_read, w_pairs, w_read, num_rows, bytes_per_s,
                            kv_bytes_per_s)

    def time_of(self, tokens: float, pairs: float, kv_read: float, w_pairs: float, w_read: float,
                num_rows: int, bytes_per_s: float, kv_bytes_per_s: float) -> float:
        compute = ((self.linear_s_per_token + self.expert_s_per_token) * tokens
                   + self.lm_head_s_per_row * num_rows + self.full_attn_s_per_pair * pairs
                   + self.window_attn_s_per_pair * w_pairs)
        weights = (self.dense_weight_bytes
                   + self.expert_weight_bytes * expert_share(tokens, *self.experts))
        kv = (self.full_kv_bytes_per_token * (kv_read + tokens)
              + self.window_kv_bytes_per_token * (w_read + tokens))
        return max(compute, weights / bytes_per_s + kv / kv_bytes_per_s)


def format_peak(fmt: str | None, inp: CostInputs) -> float:
    """The tensor-core peak a linear layer whose weights are in ``fmt`` runs at: FP8 weights on
    FP8 tensor cores (W8A8), NVFP4 on FP4 ones, where the GPU has them; MXFP4 and INT4 weights,
    and any format without its tensor cores, are dequantized to BF16 (vLLM's Marlin and
    MXFP4-BF16 kernels)."""
    assert inp.peak_flops_per_s is not None  # required by the scenario for the roofline
    native = {"fp8": inp.peak_fp8_flops_per_s, "nvfp4": inp.peak_fp4_flops_per_s}.get(fmt or "")
    return native or inp.peak_flops_per_s


def _model_pass(model: ModelCfg, inp: CostInputs, num_layers: int | None = None,
                body_params: float | None = None) -> _Pass:
    """The target model's pass, or (``num_layers``, ``body_params``) a drafter's stack."""
    tp, eff = inp.tensor_parallel_size, inp.compute_efficiency
    lm = model.vocab_size * model.hidden_size
    layers = num_layers or model.num_hidden_layers
    fmt = model.quant_format or ("fp8" if model.dtype_bytes == 1 else None)
    experts = model.routed_expert_bytes > 0 and body_params is None
    n, k = model.num_experts, model.num_experts_per_tok
    active_experts = model.routed_params * k / n if experts else 0.0
    if body_params is None:
        body_params = max(model.active_params - model.embedding_params, model.active_params // 2)
        dense_bytes: float = model.weight_bytes - (model.routed_expert_bytes if experts else 0)
    else:
        dense_bytes = (body_params + lm) * model.weight_bytes / model.num_params
    dense_fmt = None if model.quantization == "mxfp4" else fmt  # gpt-oss: experts only
    peak_dense = format_peak(dense_fmt, inp) * eff
    peak_expert = format_peak(fmt, inp) * inp.moe_compute_efficiency
    peak_bf16 = format_peak(None, inp) * eff
    kinds = model.layers
    attn_layers = model.num_attention_layers
    window_layers = sum(t == "sliding_attention" for t in kinds) if model.sliding_window else 0
    per_layer_kv = kv_bytes_per_token(model, inp.kv_cache_dtype, tp) / max(attn_layers, 1)
    share = layers / model.num_hidden_layers  # a drafter's one layer: an average layer's share
    attn = 4.0 * model.num_attention_heads * model.head_dim / tp / peak_bf16 * share
    return _Pass(
        linear_s_per_token=2.0 * (body_params - active_experts) / tp / peak_dense,
        expert_s_per_token=2.0 * active_experts / tp / peak_expert,
        lm_head_s_per_row=2.0 * lm / tp / peak_bf16,
        full_attn_s_per_pair=attn * (attn_layers - window_layers),
        window_attn_s_per_pair=attn * window_layers,
        window=model.sliding_window if window_layers else 0,
        dense_weight_bytes=dense_bytes / tp,
        expert_weight_bytes=model.routed_expert_bytes / tp if experts else 0.0,
        experts=(n, k) if experts else (0, 0),
        full_kv_bytes_per_token=per_layer_kv * (attn_layers - window_layers) * share,
        window_kv_bytes_per_token=per_layer_kv * window_layers * share,
    )


class RooflineCost:
    def __init__(self, inp: CostInputs):
        self.label = f"roofline ({inp.roofline_constants})"
        model = inp.model
        self.target = _model_pass(model, inp)
        self.allreduce = AllReduce(inp)
        self.num_layers = model.num_hidden_layers
        self.bytes_per_s = inp.mem_bandwidth_bytes_per_s * inp.bandwidth_efficiency
        self.kv_bytes_per_s = inp.mem_bandwidth_bytes_per_s * inp.attention_bandwidth_efficiency
        self.overhead_s = inp.step_overhead_s
        self.per_request_s = inp.step_overhead_per_request_s
        self.overlap = inp.async_scheduling
        self.experts = (model.num_experts, model.num_experts_per_tok)
        self.expert_read_s = model.routed_expert_bytes / inp.tensor_parallel_size / self.bytes_per_s
        self.drafter: _Pass | None = None
        self.num_draft_passes = 0
        self.draft_layers = 1
        d = inp.drafter
        if d.method not in ("none", "ngram"):
            self.num_draft_passes = d.num_passes
            if d.method == "draft_model":
                draft = d.model or model
                self.drafter = _model_pass(draft, inp)
                self.draft_layers = draft.num_hidden_layers
            else:
                body = max(model.active_params - model.embedding_params, model.active_params // 2)
                self.drafter = _model_pass(model, inp, num_layers=1,
                                           body_params=body / model.num_hidden_layers)

    def step_time_s(self, chunks, num_sampled: int,
                    decodes: Decodes | None = None) -> float:
        """Seconds for the target model's step over ``chunks`` (pairs ``(n, c)``) and
        ``decodes`` (further chunks as ``Decodes``), the same seconds, bit for bit, as with
        those chunks listed."""
        count = len(chunks) + (decodes[0] if decodes is not None else 0)
        tokens = sum(n for n, _ in chunks) + (decodes[0] * decodes[1] if decodes is not None else 0)
        gpu = (self.target.time_s(chunks, num_sampled, self.bytes_per_s, self.kv_bytes_per_s,
                                  decodes)
               + self.allreduce.time_s(tokens, self.num_layers))
        cpu = self.per_request_s * count
        return self.overhead_s + (max(gpu, cpu) if self.overlap else gpu + cpu)

    def moe_time_s(self, tokens: float, ranks: int = 1) -> float:
        """Reading the routed experts ``tokens`` tokens touch on a ``1/ranks`` share of them
        (the roofline reads every weight each step; this is the experts' share of that read)."""
        return self.expert_read_s * expert_share(tokens, *self.experts) / ranks

    def draft_time_s(self, chunks, num_sampled: int, decodes: Decodes | None = None) -> float:
        """Seconds the drafter adds to the step (0 without speculative decoding or for ngram)."""
        if self.drafter is None or not num_sampled:
            return 0.0
        tokens = sum(n for n, _ in chunks) + (decodes[0] * decodes[1] if decodes is not None else 0)
        first = (self.drafter.time_s(chunks, num_sampled, self.bytes_per_s, self.kv_bytes_per_s,
                                     decodes)
                 + self.allreduce.time_s(tokens, self.draft_layers))
        # Its other passes: one token per sampling request, at no context (num_sampled
        # chunks (1, 0)).
        rest = (self.drafter.time_s((), num_sampled, self.bytes_per_s, self.kv_bytes_per_s,
                                    (num_sampled, 1, num_sampled, 1, 1))
                + self.allreduce.time_s(num_sampled, self.draft_layers))
        return first + (self.num_draft_passes - 1) * rest
