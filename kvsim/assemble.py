"""Put one engine together from its parts: the accounting (pool, KV manager for one group or
hybrid, scheduler) and its step-time model.

The schema's records stop here: ``build_scheduler`` and ``cost_inputs`` hand the accounting and
the cost models their own small records of a scenario. The oracle replay
(``oracle.replay.build``, from a driver-format engine table) calls ``assemble_scheduler``
too, so both build the same thing.
"""

from __future__ import annotations

from math import lcm
from pathlib import Path

from kvsim.config import model_preset
from kvsim.cost.base import CostInputs, Drafter
from kvsim.kv.connector import KVConnector
from kvsim.kv.hybrid import GroupSpec, HybridKVCacheManager
from kvsim.kv.manager import KVCacheManager, KVManager
from kvsim.kv.nixl import NixlConnector, PDParams, check_pd, prefill_backoff
from kvsim.kv.offload import OffloadingConnector, OffloadParams, check_offload
from kvsim.kv.pool import BlockPool
from kvsim.sched import Scheduler, SchedulerParams
from kvsim.schema import Scenario
from kvsim.semantics import Semantics
from kvsim.specdec import Acceptance, Drafting, SpecSetup, derive_spec


def build_scheduler(sc: Scenario, engine_index: int = 0) -> Scheduler:
    """A fresh scheduler with its own pool and manager for the scenario's engine (engine
    ``engine_index`` of a cluster: a P/D instance's id)."""
    e = sc.engine
    params = SchedulerParams(
        max_num_batched_tokens=e.max_num_batched_tokens, max_num_seqs=e.max_num_seqs,
        max_model_len=e.max_model_len, enable_chunked_prefill=e.enable_chunked_prefill,
        long_prefill_token_threshold=e.long_prefill_token_threshold,
        scheduling_policy=e.scheduling_policy,
        scheduler_reserve_full_isl=e.scheduler_reserve_full_isl,
        async_scheduling=e.async_scheduling)
    return assemble_scheduler(e.semantics, params,
                              sc.speculative.drafting(sc.model.num_nextn_predict_layers),
                              num_gpu_blocks=e.num_gpu_blocks, block_size=e.block_size,
                              enable_caching=e.enable_prefix_caching,
                              kv_groups=list(e.kv_groups or ()),
                              retention_interval=e.retention_interval, offload=e.offload,
                              kv_transfer=None if e.kv_role == "kv_both" else PDParams(
                                  e.kv_role, engine_index))


def spec_setup(sc: Scenario) -> SpecSetup:
    """The accounting consequences of the scenario's speculative decoding (as
    ``build_scheduler`` derives them)."""
    e = sc.engine
    return derive_spec(sc.speculative.drafting(sc.model.num_nextn_predict_layers), e.semantics,
                       e.enable_prefix_caching, e.block_size,
                       kv_transfer=e.offload is not None or e.kv_role != "kv_both")


def acceptance_for(sc: Scenario, record: bool = False) -> Acceptance:
    """The scenario's acceptance model (``record``: keep every draw, for validation)."""
    s = sc.speculative
    return Acceptance(s.acceptance, s.acceptance_rates, s.num_accepted, sc.run.seed, record)


def cost_inputs(sc: Scenario) -> CostInputs:
    """What the scenario's step-time model is given (the draft model's shape resolved)."""
    s, hw, c, e = sc.speculative, sc.hardware, sc.cost, sc.engine
    draft = None
    if s.method == "draft_model" and s.draft_model:
        draft = model_preset(s.draft_model, "speculative.draft_model")
    return CostInputs(
        model=sc.model, tensor_parallel_size=e.tensor_parallel_size,
        kv_cache_dtype=e.kv_cache_dtype, peak_flops_per_s=hw.peak_flops_per_s,
        peak_fp8_flops_per_s=hw.peak_fp8_flops_per_s,
        peak_fp4_flops_per_s=hw.peak_fp4_flops_per_s,
        mem_bandwidth_bytes_per_s=hw.mem_bandwidth_bytes_per_s,
        interconnect_bandwidth_bytes_per_s=hw.interconnect_bandwidth_bytes_per_s,
        interconnect_latency_s=hw.interconnect_latency_s,
        compute_efficiency=c.compute_efficiency,
        moe_compute_efficiency=c.moe_compute_efficiency,
        bandwidth_efficiency=c.bandwidth_efficiency,
        attention_bandwidth_efficiency=c.attention_bandwidth_efficiency,
        step_overhead_s=c.step_overhead_s,
        step_overhead_per_request_s=c.step_overhead_per_request_s,
        async_scheduling=e.async_scheduling, roofline_constants=c.roofline_constants,
        profile=Path(c.profile) if c.profile else None,
        layer_profile=Path(c.layer_profile) if c.layer_profile else None,
        drafter=Drafter(s.method, s.num_speculative_tokens, draft))


def assemble_scheduler(sem: Semantics, params: SchedulerParams, spec: Drafting, *,
                       num_gpu_blocks: int, block_size: int, enable_caching: bool,
                       kv_groups: list[GroupSpec] | None = None,
                       retention_interval: int | None = None,
                       offload: OffloadParams | None = None,
                       kv_transfer: PDParams | None = None) -> Scheduler:
    """A fresh scheduler over its own pool; ``params.spec`` is derived here from ``spec``.

    With ``kv_groups``, each group's block size applies and ``block_size`` does not;
    ``retention_interval`` is vLLM's ``prefix_cache_retention_interval`` (None: dense);
    ``offload`` adds vLLM's native CPU offloading behind the KV-connector seam,
    ``kv_transfer`` makes the engine one side of a P/D pair (NixlConnector).
    """
    if offload is not None:
        check_offload("engine.kv_offloading_size", offload, sem, spec.method,
                      bool(kv_groups), enable_caching)
    if kv_transfer is not None:
        check_pd("kv_role", sem, bool(kv_groups))
    scheduler_block_size = lcm(*(g.block_size for g in kv_groups)) if kv_groups else block_size
    setup = derive_spec(spec, sem, enable_caching, scheduler_block_size,
                        kv_transfer=offload is not None or kv_transfer is not None)
    pool = BlockPool(num_gpu_blocks, enable_caching, sem.pool_unhashed_to_front(enable_caching))
    kv: KVManager
    if kv_groups:
        # vLLM's max_in_flight_tokens (0.32+), or max_num_batched_tokens before.
        in_flight = params.max_num_batched_tokens * (
            2 if params.async_scheduling and sem.has_max_in_flight_tokens else 1)
        kv = HybridKVCacheManager(pool, list(kv_groups), params.max_model_len, enable_caching,
                                  eagle_family=spec.eagle_family, eagle_drop=setup.eagle_drop,
                                  hash_lookahead=setup.hash_lookahead,
                                  num_reprefillable=setup.num_reprefillable,
                                  max_in_flight_tokens=in_flight, rules=sem.hybrid,
                                  num_speculative_blocks=spec.num_speculative_tokens,
                                  retention_interval=retention_interval)
    else:
        kv = KVCacheManager(pool, block_size, params.max_model_len, enable_caching,
                            eagle_drop=setup.eagle_drop, hash_lookahead=setup.hash_lookahead,
                            num_reprefillable=setup.num_reprefillable)
    params = SchedulerParams(**{**{f: getattr(params, f) for f in params.__dataclass_fields__},
                                "spec": setup.params})
    connector: KVConnector | None = None
    if offload is not None:
        assert isinstance(kv, KVCacheManager) and sem.offload is not None  # check_offload
        connector = OffloadingConnector(kv.hasher, block_size, offload, sem.offload,
                                        eagle_group=setup.eagle_drop)
    elif kv_transfer is not None:
        connector = NixlConnector(kv_transfer, block_size,
                                  prefill_backoff(setup.params.num_prefill_lookahead))
    return Scheduler(params, kv, sem, connector)

