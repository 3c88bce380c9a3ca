"""Small builders for driving the accounting core without SimPy."""

from __future__ import annotations

import os
from pathlib import Path

from kvsim.kv.manager import KVCacheManager
from kvsim.kv.pool import BlockPool
from kvsim.request import ExplicitTokens, Request, RequestSpec
from kvsim.sched import Scheduler, SchedulerParams
from kvsim.semantics import VERSIONS

# The public data (traces, measured runs, GPU layer profiles) the tests read: one place,
# $KVSIM_SHARED_DATA, else ../shared/data beside the repository (where CI puts it). Tests that
# need it skip cleanly without it.
SHARED_DATA = Path(os.environ.get("KVSIM_SHARED_DATA")
                   or Path(__file__).resolve().parents[2] / "shared" / "data")



def small_chat(num_gpu_blocks: int, num_requests: int) -> str:
    """A small chat scenario (Llama 3.2 1B on an L40S, a shared system prompt and three
    users' histories) that runs in well under a second: the CLI-level tests' common base."""
    return f"""
[model]
preset = "llama-3.2-1b"
[hardware]
preset = "l40s"
[engine]
num_gpu_blocks = {num_gpu_blocks}
max_model_len = 1024
max_num_batched_tokens = 256
max_num_seqs = 8
[workload]
num_requests = {num_requests}
request_rate = 40.0
system_prompt_tokens = 64
num_users = 3
user_history_tokens = 96
input_tokens = 24
output_tokens = 40
"""


_seq = iter(range(10**9))


def make_request(req_id: str, tokens, max_tokens: int = 1, priority: int = 0,
                 arrival_s: float = 0.0) -> Request:
    spec = RequestSpec(req_id=req_id, arrival_s=arrival_s, prompt=ExplicitTokens(tuple(tokens)),
                       max_tokens=max_tokens, priority=priority)
    return Request(spec, next(_seq))


def make_manager(num_gpu_blocks: int, block_size: int, max_model_len: int = 1 << 20,
                 enable_caching: bool = True, version: str = "0.33.0") -> KVCacheManager:
    sem = VERSIONS[version]
    pool = BlockPool(num_gpu_blocks, enable_caching, sem.pool_unhashed_to_front(enable_caching))
    return KVCacheManager(pool, block_size, max_model_len, enable_caching)


def make_scheduler(num_gpu_blocks: int = 1000, block_size: int = 16, max_num_batched_tokens: int = 8192,
                   max_num_seqs: int = 256, max_model_len: int = 1 << 16, enable_caching: bool = True,
                   version: str = "0.33.0", **params) -> Scheduler:
    kv = make_manager(num_gpu_blocks, block_size, max_model_len, enable_caching, version)
    p = SchedulerParams(max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                        max_model_len=max_model_len, **params)
    return Scheduler(p, kv, VERSIONS[version])


def step(sched: Scheduler) -> dict:
    """One synchronous step with invariants checked; returns what happened."""
    plan = sched.schedule()
    sched.kv.check_invariants()
    first, finished = sched.update_from_output(plan)
    sched.kv.check_invariants()
    return {
        "scheduled": {c.req.req_id: c.num_new_tokens for c in plan.scheduled},
        "preempted": [r.req_id for r in plan.preempted],
        "finished": [r.req_id for r in finished],
        "queries": plan.prefix_cache.queries,
        "hits": plan.prefix_cache.hits,
    }


def run_until_done(sched: Scheduler, max_steps: int = 10_000) -> list[dict]:
    out = []
    while sched.num_unfinished:
        out.append(step(sched))
        assert len(out) < max_steps
    return out


# A synthetic layer-profile folder (LLMServingSim's format) whose every table is linear in
# each axis, so interpolation reproduces it exactly and tests can say what a pass costs by hand.
DENSE_OPS = {"qkv_proj": (3.0, 0.010), "o_proj": (2.0, 0.004), "gate_up_proj": (4.0, 0.020),
             "down_proj": (3.0, 0.010), "act_fn": (1.0, 0.001), "rotary_emb": (1.0, 0.001),
             "layernorm": (1.0, 0.0005), "embedding": (2.0, 0.0002),
             "final_layernorm": (1.0, 0.0005)}  # op: (µs at 0 tokens, µs per token)
HEAD_OPS = {"lm_head": (40.0, 0.5), "sampler": (10.0, 0.1)}  # op: (µs, µs per sequence)
ATTENTION_GRID = {"pc": (0, 16, 64, 256, 1024), "kp": (0, 256, 1024, 4096),
                  "nd": (0, 1, 4, 16, 64), "kd": (0, 64, 256, 1024, 4096)}
MOE_GRID = {"tokens": (1, 16, 256, 2048), "experts": (8, 64, 128)}


def synthetic_attention_us(pc, kp, nd, kd):
    """Multilinear in (pc, kp, nd, kd): what interpolation must give anywhere in the grid."""
    return 5.0 + 0.01 * pc + 0.0001 * pc * kp + 0.1 * nd + 0.0002 * nd * kd


def synthetic_moe_us(tokens, experts):
    return 20.0 + 0.05 * tokens + 0.5 * experts + 0.001 * tokens * experts


def synthetic_layer_profile(folder: Path, hf_model: str = "meta-llama/Llama-3.2-1B",
                            moe: bool = False, skew: dict | None = None) -> Path:
    """Write the folder (``meta.yaml``, ``tp1/*.csv``); ``skew``: {(pc, n, sr, kvB, kp) labels:
    alpha} for a ``skew_fit`` block with its ``tp1/skew_fit.csv``. Returns the folder."""
    import itertools

    sub = folder / "tp1"
    sub.mkdir(parents=True, exist_ok=True)
    g = ATTENTION_GRID
    lines = ["prefill_chunk,kv_prefill,n_decode,kv_decode,time_us"]
    for pc, kp, nd, kd in itertools.product(g["pc"], g["kp"], g["nd"], g["kd"]):
        if (pc == 0 and kp) or (nd == 0 and kd) or (nd and not kd) or (pc == 0 and nd == 0):
            continue  # as LLMServingSim's grid: no context without its tokens, no empty batch
        lines.append(f"{pc},{kp},{nd},{kd},{synthetic_attention_us(pc, kp, nd, kd)!r}")
    (sub / "attention.csv").write_text("\n".join(lines) + "\n")
    tokens = [2 ** i for i in range(12)]
    (sub / "dense.csv").write_text("layer,tokens,time_us\n" + "".join(
        f"{op},{t},{a + b * t!r}\n" for op, (a, b) in DENSE_OPS.items() for t in tokens))
    (sub / "per_sequence.csv").write_text("layer,sequences,time_us\n" + "".join(
        f"{op},{s},{a + b * s!r}\n" for op, (a, b) in HEAD_OPS.items() for s in tokens[:9]))
    if moe:
        (sub / "moe.csv").write_text("tokens,activated_experts,time_us\n" + "".join(
            f"{t},{e},{synthetic_moe_us(t, e)!r}\n"
            for t in MOE_GRID["tokens"] for e in MOE_GRID["experts"]))
    meta = [f"model: {hf_model}", "gpu: Synthetic GPU", "hardware: SYNTH", "vllm_version: 0.19.0",
            "variant: bf16", "tp_degrees: [1]"]
    if skew is not None:
        meta += ["skew_fit:", "  enabled: true", "  bucket_axes:",
                 "    n_bins: [0, 2, 8, 64, 1000000]", "    n_labels: [n<=2, n<=8, n<=64, n>64]",
                 "    skew_rate_bins: [-0.01, 0.5, 1.01]", "    skew_rate_labels: [sr<=50%, sr>50%]",
                 "    kv_big_bins: [0, 1024, 1000000000]", "    kv_big_labels: [kvB<=1k, kvB>1k]",
                 "    kp_bins: [-1, 0, 1000000000]", "    kp_labels: [kp=0, kp>0]",
                 "  per_tp:", "    1:", "      alpha_default: 0.05",
                 "      bucket_table: tp1/skew_fit.csv"]
        (sub / "skew_fit.csv").write_text(
            "pc,n_label,skew_rate_label,kv_big_label,kp_label,alpha,n_samples\n" + "".join(
                f"{k[0]},{k[1]},{k[2]},{k[3]},{k[4]},{a},4\n" for k, a in skew.items()))
    (folder / "meta.yaml").write_text("\n".join(meta) + "\n")
    return folder
