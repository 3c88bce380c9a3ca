"""kvsim: a block-exact simulator of vLLM v1's KV-cache accounting.

The accounting core (``kvsim.kv``, ``kvsim.sched``) is plain Python and reproduces vLLM's
Scheduler, KVCacheManager and BlockPool step for step; ``kvsim.engine`` wraps it in a SimPy
clock driven by a cost model (``kvsim.cost``).
"""

__version__ = "0.1.0"
