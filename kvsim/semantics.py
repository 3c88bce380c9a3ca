"""Per-release vLLM behaviour, one frozen record per reproduced version.

Rules in the accounting core read flags from a ``Semantics`` record; nothing else in kvsim
compares version strings. A release is listed only once its behaviour was read from that
release's own ``vllm/v1/core`` source and checked against its Scheduler on CPU (the recorded
cases in ``tests/fixtures/``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from kvsim.kv.hybrid import HybridRules
from kvsim.layout import LayoutRules
from kvsim.model import GiB

PadNewDecode = Literal["never", "running", "running_fits", "running_or_hit"]
FreeOrder = Literal["never", "with_caching", "always"]
RetentionSetting = Literal["none", "env", "config"]


@dataclass(frozen=True, slots=True)
class DPRules:
    """Data parallel (``--data-parallel-size``): how the front end's ``DPLBAsyncMPClient``
    picks a rank (v1/engine/core_client.py ``get_core_engine_for_request``) from the counts the
    DP coordinator publishes (v1/engine/coordinator.py), and how MoE ranks' lockstep waves end
    (v1/engine/core.py ``DPEngineCoreProc``)."""

    # "waiting4": score 4 × waiting + running (0.19 core_client.py:1354, 0.22 :1399);
    # "inflight": max(client_count × in-flight, waiting + running), plus waiting × 6 ×
    # max(0, kv_usage − 0.5) when requests wait (0.32 :1671-1679, 0.33 :1786-1794).
    score: Literal["waiting4", "inflight"]
    # The scan's start rank moves on by one after every balanced pick (0.25+), so ties
    # alternate; before, it stays at the client's own start.
    rotate_start: bool
    # A dense model's ranks publish their counts too (0.27+: EngineCoreProc before and after
    # each step); before, only MoE ranks (DPEngineCoreProc) did, and the coordinator repeats
    # all-zero counts every 5 s.
    dense_ranks_publish: bool
    # MoE waves: the all-reduce of "any rank has unfinished requests" runs every this many
    # loop steps (0.19-0.29: 32; 0.30+: ParallelConfig.dp_sync_interval, 16), and also at a
    # wave's first step from 0.32.
    sync_interval: int
    sync_at_first_step: bool


@dataclass(frozen=True, slots=True)
class OffloadRules:
    """The native CPU offloading connector of a release (``--kv-offloading-size``):
    ``lru_request_ranks``: the LRU tier ranks a running request's chunks together, later
    positions evicted first, until it finishes (0.33 ``v1/kv_offload/cpu/policies/lru.py``
    ``_RequestRank``); 0.32 gives every stored chunk a fresh rank.
    ``restore_from_start``: a lookup (a new or preempted request's admission) offers every
    chunk for storing again (0.33 ``get_num_new_matched_tokens`` resets
    ``next_stored_chunk_idx``); 0.32 goes on from where the request's stores had got to."""

    lru_request_ranks: bool
    restore_from_start: bool


@dataclass(frozen=True, slots=True)
class Semantics:
    version: str
    # BlockPool.free_blocks: blocks without a hash (so all blocks with caching off) go to the
    # *front* of the free queue (LIFO reuse), hashed blocks to the tail (LRU eviction):
    # "always" (0.24+, block_pool.py:614-635); "with_caching" (0.27.x: with caching off every
    # block is appended, 0.27 block_pool.py:733-742); "never" (before 0.24: all to the tail;
    # 0.23's two prepending call sites are HybridRules.skipped_unhashed_to_front).
    free_unhashed_to_front: FreeOrder
    # long_prefill_token_threshold applies only when more than one request is running or
    # waiting ("nobody to starve" otherwise); 0.31+.
    long_prefill_only_with_competition: bool
    # Default gpu_memory_utilization (vllm/config/cache.py).
    default_gpu_memory_utilization: float
    # `vllm serve`'s max_num_batched_tokens / max_num_seqs defaults by device
    # (EngineArgs.get_batch_defaults, engine/arg_utils.py): a tier for devices of 160 GiB and
    # more (0.28+), and GB10 (DGX Spark, capability 12.1) kept on the small tier (0.33).
    batch_tier_160gib: bool
    batch_small_tier_on_gb10: bool
    # `vllm serve`'s enable_prefix_caching default for a Mamba / linear-attention hybrid
    # (ModelConfig.is_hybrid; other models: on in every release): on from 0.28; off before,
    # as is_prefix_caching_supported is False for generative hybrids in 0.19-0.25 (0.19
    # config/model.py:1785-1790) and 0.26/0.27 keep it opt-in (0.26 engine/arg_utils.py
    # :2518-2522). Explicitly enabled, it works in every release.
    hybrid_prefix_caching_default: bool
    # How EAGLE-family drafters (eagle, eagle3, mtp) keep prefix hits safe by default:
    # "drop" the last matched block, or "lookahead" block hashes that also cover the next
    # token(s) (0.33). The opt-out flags the release accepts are listed.
    eagle_prefix_rule: str
    has_disable_eagle_block_drop: bool
    has_disable_lookahead_block_hashes: bool
    # Scheduler pads a newly admitted request with one token left to a 1 + k verify row of
    # placeholder drafts: "never" (before 0.25); "running" (0.25-0.28: when running requests
    # were scheduled in the step, and a row past max_model_len ends the waiting pass, 0.25
    # scheduler.py:812-826); "running_fits" (0.29: left unpadded when the row and the sampled
    # token pass max_model_len, 0.29 :962-982); "running_or_hit" (0.30+: also after a prefix
    # hit, 0.32 :1131-1153).
    pad_new_decode_to_spec_width: PadNewDecode
    # Rules of the hybrid (several KV groups) coordinator.
    hybrid: HybridRules
    # Priority policy: a running request that preempted itself lets the (higher-priority)
    # requests after it still be scheduled in that step (0.33); before, the pass ended.
    priority_self_preempt_continues: bool
    # Priority policy: removing a victim that sits before the current running request moves
    # the loop index back (0.28+; 0.32 scheduler.py:810-812); before, only a victim scheduled in this
    # step did (0.19 scheduler.py:480-498, 0.22 :461-479), so removing one skipped in this
    # step (async: its step in flight already reaches max_tokens) shifts the list and the
    # request after the current one is passed over.
    priority_victim_before_index_reindexes: bool
    # Prefix-cache stats are recorded when a waiting request is admitted (0.27+); before, at
    # every lookup, so a request held back by the admission gate is counted every step.
    prefix_stats_at_admission: bool
    # num_cached_tokens is overwritten by every lookup until the first output token (0.22),
    # instead of being the hit of the request's first admission.
    cached_tokens_until_first_token: bool
    # Admissions allocate the speculative lookahead slots too (0.23+); before, only running
    # requests did.
    lookahead_on_admission: bool
    # Draft-model input slots: taken per scheduled request from the input budget (0.28+), or
    # reserved up front as max_num_batched_tokens - slots × max_num_seqs.
    per_request_draft_slots: bool
    # VllmConfig._set_max_num_scheduled_tokens refuses a configuration whose draft slots leave
    # max_num_scheduled_tokens <= 0 (0.20.0 config/vllm.py:1391-1400, 0.22.1 :1566-1574);
    # 0.19 runs it (an exact 0 falls back to max_num_batched_tokens, below 0 nothing is
    # ever scheduled).
    rejects_nonpositive_scheduled_tokens: bool
    # With speculative decoding on, blocks of accepted drafts are published right after
    # verification, also for a request that just stopped (0.33); before, only at the
    # request's next allocation.
    cache_after_verify: bool
    # The multi-module MTP prefill look-ahead (never ending a chunk inside it, not caching its
    # last k - 1 tokens) exists (0.28+).
    has_prefill_lookahead: bool
    # A waiting request whose chunk rounds to 0 is skipped rather than ending the pass (0.33).
    skip_zero_chunk_admission: bool
    # kvsim reproduces this release's asynchronous scheduler (AsyncScheduler + the batch
    # queue), which vLLM turns on by default; it is then kvsim's default too.
    async_modelled: bool
    # Spec methods for which VllmConfig's default (async_scheduling None) turns asynchronous
    # scheduling off: 0.19/0.22 allow only EAGLE/MTP types (ngram, draft_model off;
    # 0.19 config/vllm.py:755-767, 0.22 :935-957), 0.32 also draft_model (:1585-1610), 0.33
    # any method with its V2 model runner.
    async_default_off_methods: tuple[str, ...]
    # After an async output: 0.33 counts placeholders down by the untrimmed token count and
    # publishes up to computed - in-flight tokens; 0.32's AsyncScheduler counts down by the
    # tokens kept and publishes up to computed - placeholders.
    async_publish_after_placeholders: bool
    # vLLM accepts ngram drafting with asynchronous scheduling (0.33); before, it refuses it
    # and its default turns asynchronous scheduling off for ngram.
    async_allows_ngram: bool
    # vLLM tracks Request.num_in_flight_tokens (0.26+): windows are freed only behind the
    # processed tokens (remove_skipped_blocks gets computed - in flight), and preempting a
    # request with outputs in flight zeroes its placeholders and marks those outputs stale
    # (delivered, but changing no counter; the request waits for them before re-admission).
    # Before, remove_skipped_blocks got all computed tokens (0.22 kv_cache_manager.py:373-375)
    # and _preempt_request kept num_output_placeholders, so a late output is applied like any
    # other (0.19 scheduler.py:956-976, 0.22 :929-949).
    has_num_in_flight_tokens: bool
    # The preemption half of the above (0.27+; 0.26 frees windows behind the processed tokens
    # but still preempts the old way, 0.26 scheduler.py:1212-1234).
    stale_outputs_on_preempt: bool
    # VllmConfig.max_in_flight_tokens (max_concurrent_batches × max_num_batched_tokens, 0.26+)
    # bounds a sliding window's blocks in the admission cap and the start-up pool check;
    # before, max_num_batched_tokens did (0.22 v1/kv_cache_interface.py:463-492).
    has_max_in_flight_tokens: bool
    # EngineCore.step_with_batch_queue schedules the next batch before processing the oldest
    # only when this one executed (0.19 engine/core.py:477-483, 0.22 :525-531: "model_executed
    # and ... not batch_queue[-1][0].done()"; kvsim, like the oracle driver, takes the oldest
    # batch as still running, the GPU-busy order); 0.23+ also when nothing executed but the
    # scheduler has requests (0.32 :753-758).
    batch_queue_fill_requires_execution: bool
    # CacheConfig.prefix_cache_retention_interval (vllm/config/cache.py; the planner copies it
    # into KVCacheConfig: 0.32 v1/core/kv_cache_utils.py get_kv_cache_config_from_groups, 0.33
    # v1/core/kv_cache_planning.py; the coordinator reads it, v1/core/kv_cache_coordinator.py,
    # and the managers' reachable_block_mask apply it): which sliding-window and Mamba
    # checkpoints are published. The release's default, 0 (replay boundaries and shared-prefix
    # junctions only), or None: dense, every U boundary. History (read from the wheels): 0.19
    # and 0.22 have nothing (dense); 0.23-0.28 an environment variable,
    # VLLM_PREFIX_CACHE_RETENTION_INTERVAL, unset = dense (envs.py); 0.29 the CacheConfig
    # field, default 0 (the variable deprecated); 0.30+ Field(default=0). ``retention_setting``:
    # "none" (dense only), "env" (the variable: kvsim's prefix_cache_retention_interval sets
    # it; vLLM refuses it, 0 too, without a group it applies to) or "config" (the field).
    retention_setting: RetentionSetting
    default_prefix_cache_retention_interval: int | None
    # 0.29: left unset, the interval is dense for a Mamba hybrid with an EAGLE-family drafter
    # (engine/arg_utils.py:2395-2407: the drop makes the one replay boundary unreachable).
    retention_dense_for_hybrid_eagle: bool
    # MambaSpec.num_prefill_checkpoint_blocks / prefill_checkpoint_alignment (0.32+): Mamba2
    # and GDN layers export a checkpoint state from inside a prefill chunk
    # (Scheduler._mamba_block_aligned_split, MambaManager._needs_internal_checkpoint).
    has_mamba_prefill_checkpoints: bool
    # How the release derives a model's KV layout at start-up (kvsim.layout): the hybrid
    # attention-block raise (0.19 model_executor/models/config.py
    # HybridAttentionMambaModelConfig; 0.22+ platforms/interface.py _align_hybrid_block_size,
    # 0.32 adding the backends' kernel alignment and 128 for MLA, 0.33 the Mamba prefill
    # checkpoint alignment) and the mamba_cache_mode values (config/cache.py MambaCacheMode).
    layout: LayoutRules
    dp: DPRules
    # Native CPU offloading as kvsim reproduces it; None: not reproduced for this release.
    offload: OffloadRules | None
    # Prefill/decode disaggregation with NixlConnector's pull scheduler as kvsim reproduces
    # it (0.32+: nixl/{base,pull}_scheduler.py, the prefill backoff; 0.31's differs).
    nixl_pd: bool

    def serve_batch_defaults(self, memory_bytes: int, device_name: str,
                             capability: tuple[int, int] | None) -> tuple[int, int]:
        """`vllm serve`'s (max_num_batched_tokens, max_num_seqs) on a CUDA device with
        ``memory_bytes`` named ``device_name``."""
        if self.batch_tier_160gib and memory_bytes >= 160 * GiB:
            return 16384, 1024
        small = "a100" in device_name.lower() or (
            self.batch_small_tier_on_gb10 and capability == (12, 1))
        if memory_bytes >= 70 * GiB and not small:
            return 8192, 1024
        return 2048, 256

    def pool_unhashed_to_front(self, enable_caching: bool) -> bool:
        """Whether the block pool frees unhashed blocks to the queue's front."""
        return self.free_unhashed_to_front == "always" or (
            self.free_unhashed_to_front == "with_caching" and enable_caching)

    def default_prefix_caching(self, is_hybrid: bool) -> bool:
        """EngineArgs' enable_prefix_caching default (None) for a model, ``is_hybrid``: with
        Mamba / linear-attention layers."""
        return self.hybrid_prefix_caching_default or not is_hybrid

    def default_async_scheduling(self, method: str) -> bool:
        """VllmConfig's async_scheduling default (None) for speculative ``method``."""
        return self.async_modelled and method not in self.async_default_off_methods


_V033 = Semantics(
    version="0.33.0",
    free_unhashed_to_front="always",
    long_prefill_only_with_competition=True,
    default_gpu_memory_utilization=0.92,
    batch_tier_160gib=True,
    batch_small_tier_on_gb10=True,
    hybrid_prefix_caching_default=True,
    eagle_prefix_rule="lookahead",
    has_disable_eagle_block_drop=True,
    has_disable_lookahead_block_hashes=True,
    pad_new_decode_to_spec_width="running_or_hit",
    hybrid=HybridRules(),
    priority_self_preempt_continues=True,
    priority_victim_before_index_reindexes=True,
    prefix_stats_at_admission=True,
    cached_tokens_until_first_token=False,
    lookahead_on_admission=True,
    per_request_draft_slots=True,
    rejects_nonpositive_scheduled_tokens=True,
    cache_after_verify=True,
    has_prefill_lookahead=True,
    skip_zero_chunk_admission=True,
    async_modelled=True,
    async_default_off_methods=(),
    async_publish_after_placeholders=False,
    async_allows_ngram=True,
    has_num_in_flight_tokens=True,
    stale_outputs_on_preempt=True,
    has_max_in_flight_tokens=True,
    batch_queue_fill_requires_execution=False,
    retention_setting="config",
    default_prefix_cache_retention_interval=0,
    retention_dense_for_hybrid_eagle=False,
    has_mamba_prefill_checkpoints=True,
    layout=LayoutRules(hybrid_align="platform", hybrid_backend_alignment=True, hybrid_mla_align_128=True,
                       hybrid_checkpoint_alignment=True, mamba_cache_modes=("align", "none")),
    dp=DPRules(score="inflight", rotate_start=True, dense_ranks_publish=True, sync_interval=16,
               sync_at_first_step=True),
    offload=OffloadRules(lru_request_ranks=True, restore_from_start=True),
    nixl_pd=True,
)
_V032 = replace(_V033, version="0.32.0", eagle_prefix_rule="drop",
                hybrid=replace(_V033.hybrid, mamba_tail_rekey="always", junction_eagle_tail=False),
                has_disable_lookahead_block_hashes=False, priority_self_preempt_continues=False,
                cache_after_verify=False, skip_zero_chunk_admission=False,
                layout=replace(_V033.layout, hybrid_checkpoint_alignment=False),
                async_default_off_methods=("ngram",), async_publish_after_placeholders=True,
                async_allows_ngram=False, batch_small_tier_on_gb10=False,
                offload=OffloadRules(lru_request_ranks=False, restore_from_start=False))
_V022 = replace(_V032, version="0.22.1", free_unhashed_to_front="never", batch_tier_160gib=False,
                hybrid_prefix_caching_default=False,
                long_prefill_only_with_competition=False, has_disable_eagle_block_drop=False,
                pad_new_decode_to_spec_width="never",
                hybrid=HybridRules(lookup="max_hit", writes="u_rounded", trim_all_full_groups=False,
                                   partial_tail_hashes=False, cap_at_full_attention_hit=False,
                                   mamba_split="last_block", mamba_tail_rekey="never",
                                   mamba_retire=False, mamba_min_cap=False,
                                   mamba_skip_back_spec_blocks=True,
                                   mamba_noop_marks_allocated=False,
                                   mamba_eagle_margin=True),
                prefix_stats_at_admission=False, cached_tokens_until_first_token=True,
                lookahead_on_admission=False, per_request_draft_slots=False,
                priority_victim_before_index_reindexes=False,
                has_prefill_lookahead=False, async_default_off_methods=("ngram", "draft_model"),
                has_num_in_flight_tokens=False, stale_outputs_on_preempt=False,
                has_max_in_flight_tokens=False,
                batch_queue_fill_requires_execution=True,
                retention_setting="none",
                default_prefix_cache_retention_interval=None,
                has_mamba_prefill_checkpoints=False,
                layout=LayoutRules(hybrid_align="platform", hybrid_backend_alignment=False,
                                   hybrid_mla_align_128=False,
                                   hybrid_checkpoint_alignment=False,
                                   mamba_cache_modes=("all", "align", "none")),
                dp=DPRules(score="waiting4", rotate_start=False, dense_ranks_publish=False,
                           sync_interval=32, sync_at_first_step=False),
                offload=None, nixl_pd=False)
_V019 = replace(_V022, version="0.19.0", default_gpu_memory_utilization=0.9,
                hybrid=HybridRules(lookup="spiral", writes="all", swa_admission_cap="never",
                                   trim_all_full_groups=False, per_group_eagle_flags=False,
                                   swa_eagle_scan="assert", partial_tail_hashes=False,
                                   cap_at_full_attention_hit=False, mamba_split="last_block",
                                   mamba_tail_rekey="never", mamba_retire=False,
                                   mamba_min_cap=False, mamba_skip_back_spec_blocks=True,
                                   mamba_eagle_margin=True,
                                   mamba_noop_marks_allocated=False),
                cached_tokens_until_first_token=False, rejects_nonpositive_scheduled_tokens=False,
                layout=replace(_V022.layout, hybrid_align="model_config"))

# 0.19.1 differs from 0.19.0 in one hunk of vllm/v1/core (single_type_kv_cache_manager.py
# :536-541, 567-578): EAGLE with a sliding-window block smaller than U is served (the pre-drop
# alignment test, then a re-alignment), no longer asserted.
_V0191 = replace(_V019, version="0.19.1", hybrid=replace(_V019.hybrid, swa_eagle_scan="pre_pop"))
# 0.21.0 is the 0.22 record but for the hybrid coordinator's writes: every group caches every
# full block (HybridKVCacheCoordinator.cache_blocks and SlidingWindowManager._cache_block_mask
# come with 0.22.0). 0.20.2's scheduler checks the full-sequence gate itself before
# allocate_slots (scheduler.py:744-757, KVCacheManager.can_fit_full_sequence) where 0.21.0
# passes full_sequence_must_fit (kv_cache_manager.py:334-350): the same count at the same
# point, so the same record.
_V021 = replace(_V022, version="0.21.0", hybrid=replace(_V022.hybrid, writes="all"))
# 0.20.0 and 0.20.1 (vllm/v1/core byte-identical) are 0.20.2 but for the sliding-window cap:
# it applies in every block count (0.20.0 single_type_kv_cache_manager.py:116-128 has no
# apply_admission_cap), so allocate_slots' per-step check (kv_cache_manager.py:384-398) can
# pass while allocate_new_blocks (:238-260) takes the uncapped count and BlockPool
# .get_new_blocks raises (block_pool.py:334): the engine dies where 0.20.2 preempts. 0.20.2
# passes the cap to the full-sequence gate only (kv_cache_manager.py:260).
_V0200 = replace(_V021, version="0.20.0", hybrid=replace(_V021.hybrid, swa_admission_cap="always"))
# 0.23.0: admissions reserve the lookahead slots too (scheduler.py:736-739), the batch queue
# fills when nothing executed but requests wait (engine/core.py:541-546), an EAGLE group
# caches one block past U and the window mask keeps it (kv_cache_coordinator.py:554-580,
# single_type_kv_cache_manager.py:714), and a window's or an old Mamba state's unhashed
# blocks go to the free queue's front (single_type_kv_cache_manager.py:497-501, 751-765).
# VLLM_PREFIX_CACHE_RETENTION_INTERVAL comes with 0.23 (envs.py:285, kv_cache_coordinator.py
# :30-57, 121-127): sliding windows only, a tail at num_prompt_tokens - 1 alone
# (single_type_kv_cache_manager.py:739-746).
_V023 = replace(_V022, version="0.23.0", lookahead_on_admission=True,
                batch_queue_fill_requires_execution=False, retention_setting="env",
                hybrid=replace(_V022.hybrid, writes="eagle_extra", skipped_unhashed_to_front=True,
                               mamba_retention=False, retention_junction=False,
                               junction_eagle_tail=False, replay_boundaries_eagle=False))
# 0.24.0: every free puts unhashed blocks at the queue's front (block_pool.py:614-635), and
# an admission's first Mamba chunk stops at the shared-prefix junction (scheduler.py:377-385).
# Retention sparsifies Mamba states too (kv_cache_coordinator.py:41-52,
# single_type_kv_cache_manager.py:1021-1069).
_V024 = replace(_V023, version="0.24.0", free_unhashed_to_front="always",
                hybrid=replace(_V023.hybrid, mamba_split="last_block_junction",
                               skipped_unhashed_to_front=False, mamba_retention=True))
# 0.25.0: the DP client's scan start moves on after every balanced pick (core_client.py
# :1437-1442), and a one-token admission is padded to a verify row when running requests were
# scheduled (scheduler.py:812-826).
_V025 = replace(_V024, version="0.25.0", dp=replace(_V024.dp, rotate_start=True),
                pad_new_decode_to_spec_width="running")
# 0.26.0 (0.26 scheduler.py, kv_cache_coordinator.py, single_type_kv_cache_manager.py):
# cached tokens from the first admission only (:805-813); windows sized by
# max_in_flight_tokens (kv_cache_interface.py:584) and freed behind the processed tokens
# (kv_cache_manager.py:443-447), preemption still the old way; full attention caps later
# passes at its own hit (:728-736), no look-ahead margin for Mamba (:746-756); the prompt-tail
# entry at num_prompt_tokens (:765-792); the Mamba split's mandatory stops (:355-423), the
# computed count no longer stepped back (:1384-1394); under sparse retention the shared-prefix
# junction is a reachable boundary too (:428-431).
_V026 = replace(_V025, version="0.26.0", cached_tokens_until_first_token=False,
                has_max_in_flight_tokens=True, has_num_in_flight_tokens=True,
                hybrid=replace(_V025.hybrid, cap_at_full_attention_hit=True,
                               mamba_eagle_margin=False, partial_tail_hashes=True,
                               partial_tail_limit="prompt", mamba_split="last_block_stops",
                               mamba_skip_back_spec_blocks=False, retention_junction=True))
# 0.27.0: prefix-cache stats at admission (kv_cache_manager.py:218-227, scheduler.py
# :1016-1020); preempting a request with outputs in flight marks them stale
# (scheduler.py:1274-1313); the DP client scores in-flight requests and dense ranks publish
# their counts (core_client.py:1484-1504, engine/core.py:1377-1399); with caching off every
# freed block is appended (block_pool.py:733-742); the Mamba split floors any chunk ending
# before the prefill end (scheduler.py:362-440); MLA hybrids align to 128
# (platforms/interface.py:883-888).
_V027 = replace(_V026, version="0.27.0", prefix_stats_at_admission=True,
                stale_outputs_on_preempt=True, free_unhashed_to_front="with_caching",
                dp=replace(_V026.dp, score="inflight", dense_ranks_publish=True),
                hybrid=replace(_V026.hybrid, mamba_split="prefill_end_stops"),
                layout=replace(_V026.layout, hybrid_mla_align_128=True))
# 0.28.0: the 160 GiB batch tier (engine/arg_utils.py:2582-2601); draft slots charged per
# scheduled request (config/vllm.py:1839-1876, scheduler.py:497-499); a priority victim before
# the current request moves the index back (scheduler.py:644-657); the multi-module MTP
# prefill look-ahead (scheduler.py:246-271, 455-474); draft models keep async scheduling on
# (config/vllm.py:1201); with caching off freed blocks go to the front again
# (block_pool.py:733-743); a no-op Mamba allocation marks the request allocated
# (single_type_kv_cache_manager.py:1574-1578).
_V028 = replace(_V027, version="0.28.0", batch_tier_160gib=True, per_request_draft_slots=True,
                hybrid_prefix_caching_default=True,
                priority_victim_before_index_reindexes=True, has_prefill_lookahead=True,
                async_default_off_methods=("ngram",), free_unhashed_to_front="always",
                hybrid=replace(_V027.hybrid, mamba_noop_marks_allocated=True))
# 0.29.0: the retention interval is a CacheConfig field, default 0, but dense for a Mamba
# hybrid with an EAGLE-family drafter (config/cache.py:60-66, engine/arg_utils.py:2395-2407),
# and a retained tail ends at num_prompt_tokens - 1 alone (single_type_kv_cache_manager.py
# :459); every full-attention group is trimmed to the hit; a one-token admission beside
# running requests is padded only if the row fits max_model_len (scheduler.py:962-982).
_V029 = replace(_V028, version="0.29.0", pad_new_decode_to_spec_width="running_fits",
                retention_setting="config",
                default_prefix_cache_retention_interval=0, retention_dense_for_hybrid_eagle=True,
                hybrid=replace(_V028.hybrid, trim_all_full_groups=True, junction_eagle_tail=False,
                               replay_boundaries_eagle=False))
# 0.30.0: disable_eagle_block_drop (config/speculative.py); MoE DP waves all-reduce every
# 16 steps and at a wave's first (engine/core.py); a one-token admission padded after a
# prefix hit too (scheduler.py:1045-1064); retained tails at both replay boundaries under the
# EAGLE drop (kv_cache_coordinator.py:314-333); old Mamba states retired past null gaps
# (single_type_kv_cache_manager.py:1625-1644).
_V030 = replace(_V029, version="0.30.0", has_disable_eagle_block_drop=True,
                retention_dense_for_hybrid_eagle=False,
                pad_new_decode_to_spec_width="running_or_hit",
                dp=replace(_V029.dp, sync_interval=16, sync_at_first_step=True),
                hybrid=replace(_V029.hybrid, replay_boundaries_eagle=True, mamba_retire=True))
# 0.31.0: long_prefill_token_threshold only with competition (scheduler.py); a Mamba
# allocation takes at most what is missing (single_type_kv_cache_manager.py:1805-1811). Its
# offloading connector and NixlConnector are not reproduced (0.31's async-load reservation and
# P/D backoff differ from 0.32's): offload and P/D scenarios are refused.
_V031 = replace(_V030, version="0.31.0", long_prefill_only_with_competition=True,
                hybrid=replace(_V030.hybrid, mamba_min_cap=True))

VERSIONS: dict[str, Semantics] = {
    "0.19.0": _V019,
    "0.19.1": _V0191,
    "0.20.0": _V0200,
    "0.20.1": replace(_V0200, version="0.20.1"),  # vllm/v1/core byte-identical to 0.20.0
    "0.20.2": replace(_V021, version="0.20.2"),
    "0.21.0": _V021,
    "0.22.0": replace(_V022, version="0.22.0"),  # vllm/v1/core byte-identical to 0.22.1
    "0.22.1": _V022,
    "0.23.0": _V023,
    "0.24.0": _V024,
    "0.25.0": _V025,
    "0.25.1": replace(_V025, version="0.25.1"),  # vllm/v1/core, config, engine byte-identical
    "0.26.0": _V026,
    "0.27.0": _V027,
    "0.27.1": replace(_V027, version="0.27.1"),  # vllm/v1/core, config, engine byte-identical
    "0.28.0": _V028,
    "0.29.0": _V029,
    "0.30.0": _V030,
    "0.31.0": _V031,
    "0.32.0": _V032,
    "0.33.0": _V033,
}

DEFAULT_VERSION = "0.33.0"


def semantics_for(version: str) -> Semantics | None:
    """The record for a vLLM release string, or None if kvsim does not reproduce it."""
    return VERSIONS.get(version)
