"""What a step-time model is given, and what it answers.

The cost models take a ``CostInputs``: the model's shape and how it is split, the GPU's
figures, the ``[cost]`` settings and the drafter's passes; ``kvsim.assemble.cost_inputs``
makes one from a scenario. Each model answers the ``StepCost`` protocol.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from kvsim.model import ModelCfg
from kvsim.specdec import SpecMethod

# Decode chunks ``(n, c)`` of one length n given as sums: (count, n, Σ(c + n), max(c + n),
# min(c + n)); whole numbers, so that sums of them are the floats chunk-by-chunk addition gives.
Decodes = tuple[int, int, float, float, float]


@dataclass(frozen=True, slots=True)
class Drafter:
    """The drafting speculative decoding adds to every step: ``num_passes`` (k) passes of the
    ``method``'s drafter ("none" and "ngram" run none); ``model`` is a draft model's shape."""

    method: SpecMethod
    num_passes: int
    model: ModelCfg | None


@dataclass(frozen=True, slots=True)
class CostInputs:
    model: ModelCfg
    tensor_parallel_size: int
    kv_cache_dtype: str
    peak_flops_per_s: float | None  # the roofline's, required there
    peak_fp8_flops_per_s: float | None  # dense FP8 / FP4 tensor-core peaks (None: not native)
    peak_fp4_flops_per_s: float | None
    mem_bandwidth_bytes_per_s: float
    interconnect_bandwidth_bytes_per_s: float | None  # required when tensor_parallel_size > 1
    interconnect_latency_s: float
    compute_efficiency: float
    moe_compute_efficiency: float  # the routed experts' grouped GEMMs
    bandwidth_efficiency: float
    attention_bandwidth_efficiency: float  # the KV cache's reads and writes
    step_overhead_s: float
    step_overhead_per_request_s: float  # the roofline's CPU time per scheduled request
    async_scheduling: bool  # the CPU's step work overlaps the GPU's (vLLM --async-scheduling)
    roofline_constants: str  # where the roofline's constants come from (its label)
    profile: Path | None  # a fitted model's profile
    layer_profile: Path | None  # an interpolated model's layer-profile folder
    drafter: Drafter


class StepCost(Protocol):
    """A step-time model: seconds of a step over ``chunks``, pairs ``(n new tokens, c tokens of
    context)``, with ``num_sampled`` rows sampled; ``decodes`` stands for further decode
    chunks ``(n, c)`` of one length (one token, or a verify step's 1 + k) as ``Decodes``
    (count, n, Σ(c + n), max(c + n), min(c + n)), giving the same seconds as those chunks
    listed, bit for bit."""

    label: str

    def step_time_s(self, chunks: Sequence[tuple[int, int]], num_sampled: int,
                    decodes: Decodes | None = None) -> float: ...

    def draft_time_s(self, chunks: Sequence[tuple[int, int]], num_sampled: int,
                     decodes: Decodes | None = None) -> float: ...

    def moe_time_s(self, tokens: float, ranks: int = 1) -> float:
        """Seconds, within a target step, of the routed experts' work for ``tokens`` tokens on
        a ``1/ranks`` share of the experts (0 for a dense model): with ``ranks`` 1, what a step
        over ``tokens`` tokens holds; an MoE model's expert-parallel ranks each run it over all
        ranks' tokens on their own share (``kvsim.dp.Lockstep``)."""
        ...


def drafter_passes(chunks: Sequence[tuple[int, int]], num_sampled: int,
                   decodes: Decodes | None = None):
    """The drafter's passes in a step: ``((chunks, rows), (chunks, rows))`` of its first pass,
    over the step's chunks (and ``decodes``, which it keeps as they are) with one row per
    sampling request, and of each of its other k − 1 passes, one token per sampling request at
    the batch's mean context."""
    total: float = sum(c + n for n, c in chunks)  # (whole numbers: exact)
    count = len(chunks)
    if decodes is not None:
        total, count = total + decodes[2], count + decodes[0]
    return (chunks, num_sampled), ([(1, total / count)] * num_sampled, num_sampled)
