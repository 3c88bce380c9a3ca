"""The default, uncalibrated step-time model: a roofline over the step's plan.

For one step with chunks ``(n new tokens, c tokens of context before them)``::

    flops = 2 · P_body · Σn                          linear layers, every scheduled token
          + 2 · V · h · (#sampled rows)              LM head, one row per completed chunk
          + 4 · layers · heads · d · Σ n·(c + (n+1)/2)   causal attention (QKᵀ and AV)
    bytes = weight_bytes                              weights read once per step
          + kv_bytes_per_token · Σ (c + n)            KV read by attention
          + kv_bytes_per_token · Σ n                  KV written
    time  = step_overhead_s + max(flops / (peak · compute_efficiency),
                                  bytes / (bandwidth · bandwidth_efficiency))

``P_body`` is the active parameter count (MoE: ``num_active_params``) less the embedding and
LM-head matrices (2·V·h, capped at half the model); weight bytes count every parameter (all
experts are read by a busy MoE step). Tensor parallelism divides FLOPs, weights and KV heads
across GPUs and adds each layer's all-reduces (``kvsim.cost.comm``).

Drafting is costed separately (``draft_time_s``), as passes of the drafter with the same
roofline: EAGLE/EAGLE3/MTP heads are one average decoder layer (active parameters / layers)
plus the shared LM head; a draft model is its own preset; ngram costs nothing.
The first pass runs over every scheduled token (the drafter keeps its own KV in step with the
target's), each of the other k − 1 passes over one row per sampling request.

Efficiencies come from ``[cost]`` and are guesses until fitted (the calibration issue), so
outputs label this model "uncalibrated".
"""

from __future__ import annotations

from dataclasses import dataclass

from kvsim.cost.base import CostInputs, Decodes
from kvsim.cost.comm import AllReduce
from kvsim.cost.fitted import expert_share
from kvsim.model import ModelCfg, kv_bytes_per_token


@dataclass(frozen=True, slots=True)
class _Pass:
    """Roofline coefficients of one forward pass of some stack of layers."""

    linear_flops_per_token: float
    lm_head_flops_per_row: float
    attn_flops_per_pair: float
    weight_bytes: float
    kv_bytes_per_token: float

    def time_s(self, chunks, num_rows: int, flops_per_s: float, bytes_per_s: float,
               decodes: Decodes | None = None) -> float:
        """``decodes``: further chunks ``(n, c)`` of one length, as ``Decodes``."""
        tokens = pairs = kv_read = 0.0
        if decodes is not None:
            # Whole-number sums (pairs of an (n, c) chunk: n·c + n(n + 1)/2) far below 2**53:
            # added in any order they give the same floats as chunk by chunk.
            count, n, total = decodes[0], decodes[1], decodes[2]
            tokens, pairs = float(count * n), float(n * total - count * n * (n - 1) // 2)
            kv_read = float(total)
        for n, c in chunks:
            tokens += n
            pairs += n * (c + (n + 1) / 2)
            kv_read += c + n
        return self.time_of(tokens, pairs, kv_read, num_rows, flops_per_s, bytes_per_s)

    def time_of(self, tokens: float, pairs: float, kv_read: float, num_rows: int,
                flops_per_s: float, bytes_per_s: float) -> float:
        """``time_s`` from the chunks' sums: tokens Σn, pairs Σn·(c + (n+1)/2), KV read Σ(c + n)."""
        flops = (self.linear_flops_per_token * tokens + self.lm_head_flops_per_row * num_rows
                 + self.attn_flops_per_pair * pairs)
        nbytes = self.weight_bytes + self.kv_bytes_per_token * (kv_read + tokens)
        return max(flops / flops_per_s, nbytes / bytes_per_s)


def _model_pass(model: ModelCfg, tp: int, kv_cache_dtype: str, num_layers: int | None = None,
                body_params: float | None = None) -> _Pass:
    weight_params: float
    lm = model.vocab_size * model.hidden_size
    layers = num_layers or model.num_hidden_layers
    if body_params is None:
        body_params = max(model.active_params - 2 * lm, model.active_params // 2)
        weight_params = model.num_params
    else:
        weight_params = body_params + lm
    per_layer_kv = kv_bytes_per_token(model, kv_cache_dtype, tp) / model.num_hidden_layers
    return _Pass(
        linear_flops_per_token=2.0 * body_params / tp,
        lm_head_flops_per_row=2.0 * lm / tp,
        attn_flops_per_pair=(4.0 * layers * model.num_attention_layers / model.num_hidden_layers
                             * model.num_attention_heads * model.head_dim / tp),
        weight_bytes=weight_params * model.weight_bytes / model.num_params / tp,
        kv_bytes_per_token=per_layer_kv * layers,
    )


class RooflineCost:
    label = "roofline (uncalibrated)"

    def __init__(self, inp: CostInputs):
        model, tp, kv_cache_dtype = inp.model, inp.tensor_parallel_size, inp.kv_cache_dtype
        assert inp.peak_flops_per_s is not None  # required by the scenario for the roofline
        self.target = _model_pass(model, tp, kv_cache_dtype)
        self.allreduce = AllReduce(inp)
        self.num_layers = model.num_hidden_layers
        self.flops_per_s = inp.peak_flops_per_s * inp.compute_efficiency
        self.bytes_per_s = inp.mem_bandwidth_bytes_per_s * inp.bandwidth_efficiency
        self.overhead_s = inp.step_overhead_s
        self.experts = (model.num_experts, model.num_experts_per_tok)
        self.expert_read_s = model.routed_expert_bytes / tp / self.bytes_per_s
        self.drafter: _Pass | None = None
        self.num_draft_passes = 0
        self.draft_layers = 1
        d = inp.drafter
        if d.method not in ("none", "ngram"):
            self.num_draft_passes = d.num_passes
            if d.method == "draft_model":
                draft = d.model or model
                self.drafter = _model_pass(draft, tp, kv_cache_dtype)
                self.draft_layers = draft.num_hidden_layers
            else:
                layer = self.target.linear_flops_per_token * tp / 2 / model.num_hidden_layers
                self.drafter = _model_pass(model, tp, kv_cache_dtype, num_layers=1, body_params=layer)

    def step_time_s(self, chunks, num_sampled: int,
                    decodes: Decodes | None = None) -> float:
        """Seconds for the target model's step over ``chunks`` (pairs ``(n, c)``) and
        ``decodes`` (further chunks as ``Decodes``), the same seconds, bit for bit, as with
        those chunks listed."""
        tokens = sum(n for n, _ in chunks) + (decodes[0] * decodes[1] if decodes is not None else 0)
        return (self.overhead_s + self.target.time_s(chunks, num_sampled, self.flops_per_s,
                                                     self.bytes_per_s, decodes)
                + self.allreduce.time_s(tokens, self.num_layers))

    def moe_time_s(self, tokens: float, ranks: int = 1) -> float:
        """Reading the routed experts ``tokens`` tokens touch on a ``1/ranks`` share of them
        (the roofline reads every weight each step; this is the experts' share of that read)."""
        return self.expert_read_s * expert_share(tokens, *self.experts) / ranks

    def draft_time_s(self, chunks, num_sampled: int, decodes: Decodes | None = None) -> float:
        """Seconds the drafter adds to the step (0 without speculative decoding or for ngram)."""
        if self.drafter is None or not num_sampled:
            return 0.0
        tokens = sum(n for n, _ in chunks) + (decodes[0] * decodes[1] if decodes is not None else 0)
        first = (self.drafter.time_s(chunks, num_sampled, self.flops_per_s, self.bytes_per_s,
                                     decodes)
                 + self.allreduce.time_s(tokens, self.draft_layers))
        # Its other passes: one token per sampling request, at no context (num_sampled
        # chunks (1, 0)).
        rest = (self.drafter.time_s((), num_sampled, self.flops_per_s, self.bytes_per_s,
                                    (num_sampled, 1, num_sampled, 1, 1))
                + self.allreduce.time_s(num_sampled, self.draft_layers))
        return first + (self.num_draft_passes - 1) * rest
