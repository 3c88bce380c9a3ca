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
    mem_bandwidth_bytes_per_s: float
    interconnect_bandwidth_bytes_per_s: float | None  # required when tensor_parallel_size > 1
    interconnect_latency_s: float
    compute_efficiency: float
    bandwidth_efficiency: float
    step_overhead_s: float
    profile: Path | None  # a fitted model's profile
    drafter: Drafter


class StepCost(Protocol):
    """A step-time model: seconds of a step over ``chunks``, pairs ``(n new tokens, c tokens of
    context)``, with ``num_sampled`` rows sampled; ``decodes`` stands for further one-token
    chunks ``(1, c)`` as (count, Σ(c + 1), max(c + 1)), giving the same seconds as those
    chunks listed."""

    label: str

    def step_time_s(self, chunks: Sequence[tuple[int, int]], num_sampled: int,
                    decodes: tuple[int, int, int] | None = None) -> float: ...

    def draft_time_s(self, chunks: Sequence[tuple[int, int]], num_sampled: int) -> float: ...

    def moe_time_s(self, tokens: float) -> float:
        """Seconds, within a target step over ``tokens`` tokens, of reading the routed experts
        those tokens touch (0 for a dense model): what an MoE model's data-parallel ranks
        redo over all ranks' tokens on their share of the experts (``kvsim.dp.Lockstep``)."""
        ...
