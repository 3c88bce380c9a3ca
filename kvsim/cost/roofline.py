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

``P_body`` is the parameter count less the embedding and LM-head matrices (2·V·h, capped at
half the model). Tensor parallelism divides FLOPs, weights and KV heads across GPUs; no
communication is charged. Efficiencies come from ``[cost]`` and are guesses until fitted
(the calibration issue), so outputs label this model "uncalibrated".
"""

from __future__ import annotations

from kvsim.config import CostCfg, HardwareCfg, ModelCfg, kv_bytes_per_token


class RooflineCost:
    label = "roofline (uncalibrated)"

    def __init__(self, model: ModelCfg, hw: HardwareCfg, cost: CostCfg, tp: int,
                 kv_cache_dtype: str = "auto"):
        lm = model.vocab_size * model.hidden_size
        body = max(model.num_params - 2 * lm, model.num_params // 2)
        self.linear_flops_per_token = 2.0 * body / tp
        self.lm_head_flops_per_row = 2.0 * lm / tp
        self.attn_flops_per_pair = (4.0 * model.num_hidden_layers * model.num_attention_heads
                                    * model.head_dim / tp)
        self.weight_bytes = model.num_params * model.dtype_bytes / tp
        self.kv_bytes_per_token = kv_bytes_per_token(model, kv_cache_dtype, tp)
        self.flops_per_s = hw.peak_flops_per_s * cost.compute_efficiency
        self.bytes_per_s = hw.mem_bandwidth_bytes_per_s * cost.bandwidth_efficiency
        self.overhead_s = cost.step_overhead_s

    def step_time_s(self, chunks, num_sampled: int) -> float:
        """Seconds for a step of ``chunks`` (pairs ``(n, c)``) producing ``num_sampled`` tokens."""
        tokens = pairs = kv_read = 0.0
        for n, c in chunks:
            tokens += n
            pairs += n * (c + (n + 1) / 2)
            kv_read += c + n
        flops = (self.linear_flops_per_token * tokens + self.lm_head_flops_per_row * num_sampled
                 + self.attn_flops_per_pair * pairs)
        nbytes = self.weight_bytes + self.kv_bytes_per_token * (kv_read + tokens)
        return self.overhead_s + max(flops / self.flops_per_s, nbytes / self.bytes_per_s)
