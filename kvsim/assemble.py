"""Put one engine's accounting together: pool, KV manager (one group or hybrid), scheduler.

Used by the simulation (``engine.build_scheduler``, from a scenario) and by the oracle replay
(``oracle.replay.build``, from a driver-format engine table), so both build the same thing.
"""

from __future__ import annotations

from math import lcm

from kvsim.config import SpecCfg
from kvsim.kv.hybrid import GroupSpec, HybridKVCacheManager
from kvsim.kv.manager import KVCacheManager
from kvsim.kv.pool import BlockPool
from kvsim.sched import Scheduler, SchedulerParams
from kvsim.semantics import Semantics
from kvsim.specdec import derive_spec


def assemble_scheduler(sem: Semantics, params: SchedulerParams, spec: SpecCfg, *,
                       num_gpu_blocks: int, block_size: int, enable_caching: bool,
                       kv_groups: list[GroupSpec] | None = None,
                       retention_interval: int | None = None,
                       num_nextn_predict_layers: int = 1) -> Scheduler:
    """A fresh scheduler over its own pool; ``params.spec`` is derived here from ``spec``.

    With ``kv_groups``, each group's block size applies and ``block_size`` does not;
    ``retention_interval`` is vLLM's ``prefix_cache_retention_interval`` (None: dense).
    """
    scheduler_block_size = lcm(*(g.block_size for g in kv_groups)) if kv_groups else block_size
    setup = derive_spec(spec, sem, enable_caching, scheduler_block_size, num_nextn_predict_layers)
    pool = BlockPool(num_gpu_blocks, enable_caching, sem.free_unhashed_to_front)
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
    return Scheduler(params, kv, sem)
