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

# One-token decode chunks ``(1, c)`` given as sums: (count, Σ(c + 1), max(c + 1), min(c + 1)).
Decodes = tuple[int, int, int, int]


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
    layer_profile: Path | None  # an interpolated model's layer-profile folder
    drafter: Drafter


class StepCost(Protocol):
    """A step-time model: seconds of a step over ``chunks``, pairs ``(n new tokens, c tokens of
    context)``, with ``num_sampled`` rows sampled; ``decodes`` stands for further one-token
    chunks ``(1, c)`` as ``Decodes`` (count, Σ(c + 1), max(c + 1), min(c + 1)), giving the
    same seconds as those chunks listed."""

    label: str

    def step_time_s(self, chunks: Sequence[tuple[int, int]], num_sampled: int,
                    decodes: Decodes | None = None) -> float: ...

    def draft_time_s(self, chunks: Sequence[tuple[int, int]], num_sampled: int) -> float: ...

    def moe_time_s(self, tokens: float, ranks: int = 1) -> float:
        """Seconds, within a target step, of the routed experts' work for ``tokens`` tokens on
        a ``1/ranks`` share of the experts (0 for a dense model): with ``ranks`` 1, what a step
        over ``tokens`` tokens holds; an MoE model's expert-parallel ranks each run it over all
        ranks' tokens on their own share (``kvsim.dp.Lockstep``)."""
        ...


def drafter_passes(chunks: Sequence[tuple[int, int]], num_sampled: int):
    """The drafter's passes in a step: ``((chunks, rows), (chunks, rows))`` of its first pass,
    over the step's chunks with one row per sampling request, and of each of its other k − 1
    passes, one token per sampling request at the batch's mean context."""
    context = sum(c + n for n, c in chunks) / len(chunks)
    return (chunks, num_sampled), ([(1, context)] * num_sampled, num_sampled)
