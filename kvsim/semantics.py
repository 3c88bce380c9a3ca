"""Per-release vLLM behaviour, one frozen record per reproduced version.

Rules in the accounting core read flags from a ``Semantics`` record; nothing else in kvsim
compares version strings. A release is listed only once its behaviour was read from that
release's own source (``vllm/v1/core``) and checked against its Scheduler.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Semantics:
    version: str
    # BlockPool.free_blocks: blocks without a hash (or all blocks with caching off) go to the
    # *front* of the free queue (LIFO reuse); hashed blocks go to the tail (LRU eviction).
    # Older releases appended every freed block to the tail.
    free_unhashed_to_front: bool
    # Scheduler.schedule: long_prefill_token_threshold applies only when more than one
    # request is running or waiting ("nobody to starve" otherwise).
    long_prefill_only_with_competition: bool
    # Default gpu_memory_utilization (vllm/config/cache.py).
    default_gpu_memory_utilization: float


VERSIONS: dict[str, Semantics] = {
    "0.33.0": Semantics(
        version="0.33.0",
        free_unhashed_to_front=True,
        long_prefill_only_with_competition=True,
        default_gpu_memory_utilization=0.92,
    ),
}

DEFAULT_VERSION = "0.33.0"


def semantics_for(version: str) -> Semantics | None:
    """The record for a vLLM release string, or None if kvsim does not reproduce it."""
    return VERSIONS.get(version)
