"""Per-release vLLM behaviour, one frozen record per reproduced version.

Rules in the accounting core read flags from a ``Semantics`` record; nothing else in kvsim
compares version strings. A release is listed only once its behaviour was read from that
release's own source (``vllm/v1/core``) and checked against its Scheduler.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvsim.kv.hybrid import HybridRules


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
    # How EAGLE-family drafters (eagle, eagle3, mtp) keep prefix hits safe by default:
    # "drop" the last matched block, or "lookahead" block hashes that also cover the next
    # token(s) (0.33). The opt-out flags the release accepts, if any, are listed.
    eagle_prefix_rule: str
    has_disable_eagle_block_drop: bool
    has_disable_lookahead_block_hashes: bool
    # Scheduler pads a newly admitted request with one token left (a full prefix hit) to a
    # 1 + k verify row of placeholder drafts.
    pad_new_decode_to_spec_width: bool
    # Write rules of the hybrid (several KV groups) coordinator.
    hybrid: HybridRules


VERSIONS: dict[str, Semantics] = {
    "0.33.0": Semantics(
        version="0.33.0",
        free_unhashed_to_front=True,
        long_prefill_only_with_competition=True,
        default_gpu_memory_utilization=0.92,
        eagle_prefix_rule="lookahead",
        has_disable_eagle_block_drop=True,
        has_disable_lookahead_block_hashes=True,
        pad_new_decode_to_spec_width=True,
        hybrid=HybridRules(eagle_caches_extra_block=True, swa_mask_keeps_eagle_block=True),
    ),
}

DEFAULT_VERSION = "0.33.0"


def semantics_for(version: str) -> Semantics | None:
    """The record for a vLLM release string, or None if kvsim does not reproduce it."""
    return VERSIONS.get(version)
