"""Communication between GPUs: tensor parallel's all-reduces a step's layers wait for, and the
token exchange of an MoE model's data-parallel ranks.

vLLM's row-parallel layers (attention's ``o_proj``, the MLP's ``down_proj``) end in an
all-reduce of the layer's output, ``T × hidden_size`` activations, across the
``tensor_parallel_size`` GPUs. An all-reduce of ``M`` bytes over ``P`` GPUs moves
``2(P − 1)/P · M`` bytes over each GPU's link and waits ``⌈log2 P⌉`` latencies: the small
messages of a decode step go through vLLM's custom all-reduce, every GPU reading the others'
buffers at once over NVLink (one or two shots, not a ring's ``2(P − 1)`` hops; NCCL's tree
for larger ones is logarithmic too). So one pass over ``L`` layers adds ``2 · L`` of them, at
``[hardware]``'s interconnect bandwidth and latency. Layer profiles
measured per GPU (LLMServingSim's, kvsim's own benchmark) hold no communication, so both cost
models add this term.
"""

from __future__ import annotations

import math

from kvsim.cost.base import CostInputs


class AllReduce:
    """Seconds of one pass's all-reduces for ``tokens`` tokens (0 on one GPU)."""

    def __init__(self, inp: CostInputs):
        self.tp = tp = inp.tensor_parallel_size
        self.per_token_s = self.fixed_s = 0.0
        if tp > 1:
            bandwidth = inp.interconnect_bandwidth_bytes_per_s
            assert bandwidth is not None  # required by the scenario with tensor parallelism
            act_bytes = max(2, inp.model.dtype_bytes)  # activations stay 16-bit under fp8 weights
            self.per_token_s = 2 * (tp - 1) / tp * inp.model.hidden_size * act_bytes / bandwidth
            self.fixed_s = math.ceil(math.log2(tp)) * inp.interconnect_latency_s

    def time_s(self, tokens: float, num_layers: int) -> float:
        if self.tp == 1 or not tokens:
            return 0.0
        return 2 * num_layers * (self.fixed_s + self.per_token_s * tokens)


class ExpertExchange:
    """Seconds of one lockstep step's token exchange across ``ranks`` data-parallel ranks of an
    MoE model: each MoE layer gathers every rank's tokens before its experts and scatters the
    results after (vLLM's all-gather / reduce-scatter dispatch, its default all2all backend),
    two ring collectives of ``T × hidden_size`` activations in all, ``(R − 1)/R`` of them
    crossing each link, ``R − 1`` hops of latency each; every decoder layer is counted as MoE."""

    def __init__(self, inp: CostInputs, ranks: int):
        self.ranks = ranks
        self.per_token_s = self.fixed_s = 0.0
        if ranks > 1 and inp.model.num_experts:
            bandwidth = inp.interconnect_bandwidth_bytes_per_s
            assert bandwidth is not None  # required by the scenario for an MoE model's DP ranks
            act_bytes = max(2, inp.model.dtype_bytes)
            self.per_token_s = (ranks - 1) / ranks * inp.model.hidden_size * act_bytes / bandwidth
            self.fixed_s = (ranks - 1) * inp.interconnect_latency_s
        self.num_layers = inp.model.num_hidden_layers

    def time_s(self, tokens: float) -> float:
        """The exchange for ``tokens`` gathered tokens (every rank's own)."""
        if not self.per_token_s:
            return 0.0
        return 2 * self.num_layers * (self.fixed_s + self.per_token_s * tokens)
