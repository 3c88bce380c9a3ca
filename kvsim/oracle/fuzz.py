"""Seeded random scenarios in the oracle driver's format, built to hit the accounting's edges.

Prompts share prefixes of random length (block-aligned or not, sometimes whole repeats), pools
range from the minimum vLLM accepts to roomy, budgets force chunking, and requests join in
waves. Prompts are written as ``prompt_segments``; ``to_driver`` expands them to token ids.
"""

from __future__ import annotations

import math
import random
from typing import Any

from kvsim import specdec
from kvsim.semantics import semantics_for
from kvsim.specdec import EAGLE_METHODS


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# The methods a trace draws from: kvsim's own list, EAGLE's family first.
SPEC_METHODS = (*EAGLE_METHODS, *(m for m in specdec.SPEC_METHODS if m not in EAGLE_METHODS and m != "none"))


def _groups(rng: random.Random, mml: int, budget: int) -> tuple[list[dict], int, int]:
    """A random hybrid layout, its alignment U and the blocks one max_model_len request needs."""
    b1, b2 = rng.choice([(16, 16), (16, 32), (32, 16), (8, 32), (16, 64)])
    groups: list[dict[str, Any]] = [
              {"kind": "full_attention", "block_size": b1, "eagle": rng.random() < 0.7},
              {"kind": "sliding_window", "block_size": b2,
               "sliding_window": rng.choice([8, 32, 64, 100])}]
    if rng.random() < 0.3:
        groups.insert(1, {"kind": "full_attention", "block_size": 4 * b1})
    U = math.lcm(*(g["block_size"] for g in groups))
    need = 0
    for g in groups:
        if g["kind"] == "sliding_window":
            tokens = min(g["sliding_window"] - 1 + budget, mml)
            need += cdiv(tokens, g["block_size"]) + 1  # vLLM's start-up bound
        else:
            need += cdiv(mml, g["block_size"])
    return groups, U, need


def _mamba_groups(rng: random.Random, k: int, checkpoints: bool,
                  copies: int = 1) -> tuple[list[dict], int, int]:
    """A Mamba layout as vLLM builds one: every group on the Mamba block size; ``copies``
    Mamba groups, as vLLM splits a 3:1 GatedDeltaNet model's linear layers (Qwen3.5)."""
    b = rng.choice([8, 16, 32, 64])
    groups = [{"kind": "full_attention", "block_size": b, "eagle": rng.random() < 0.5},
              {"kind": "mamba", "block_size": b, "eagle": rng.random() < 0.3}]
    if rng.random() < 0.25:
        groups.append({"kind": "sliding_window", "block_size": b,
                       "sliding_window": rng.choice([8, 32, 100])})
    # Mamba1 (the prefill stops at the checkpoint), Mamba2 (exported from inside a chunk at any
    # offset) or GDN with FlashInfer (on the block grid); vLLM reserves a block for it.
    alignment = rng.choice([None, 1, b])  # drawn for every release alike
    if not checkpoints:
        alignment = None
    if alignment is not None:
        groups[1]["prefill_checkpoint_alignment"] = alignment
    groups[2:2] = [dict(groups[1]) for _ in range(copies - 1)]
    return groups, b, copies * (2 + k + (alignment is not None))  # vLLM's start-up bound


def random_scenario(seed: int, spec: bool = False, hybrid: bool | str = False,
                    async_scheduling: bool = False, version: str | None = None,
                    offload: bool = False) -> dict:
    """A seeded scenario; ``spec`` adds speculative decoding, ``hybrid`` a multi-group layout
    (``"mamba"``: one with a Mamba group), ``async_scheduling`` vLLM's asynchronous
    scheduler, ``offload`` native CPU offloading (its draws from a stream of their own). With
    ``version``, settings that release lacks (Mamba checkpoints inside a chunk, a periodic
    retention interval) are left out; the draws are the same, so a seed
    gives every release the same scenario otherwise."""
    sem = semantics_for(version) if version is not None else None
    rng = random.Random(seed)
    b = rng.choice([4, 8, 16, 32])
    mml = rng.choice([128, 256, 512, 1024])
    min_blocks = cdiv(mml, b) + 1  # vLLM refuses a pool that cannot hold max_model_len
    chunked = rng.random() < 0.85
    budget = rng.choice([32, 64, 128, 256, 2048])
    if not chunked:
        budget = max(budget, mml)
    engine: dict[str, Any] = {
        "block_size": b,
        "num_gpu_blocks": min_blocks + rng.choice([0, 1, 3, min_blocks // 2, 2 * min_blocks, 6 * min_blocks]),
        "enable_prefix_caching": rng.random() < 0.85,
        "max_num_batched_tokens": budget,
        "max_num_seqs": min(budget, rng.choice([2, 4, 8, 256])),
        "max_model_len": mml,
        "enable_chunked_prefill": chunked,
        "long_prefill_token_threshold": rng.choice([0, 0, 0, 16, 48]),
        "scheduling_policy": "priority" if rng.random() < 0.3 else "fcfs",
        "scheduler_reserve_full_isl": rng.random() < 0.8,
    }
    if async_scheduling:
        engine["async_scheduling"] = True
    k = 0
    if spec:
        method = rng.choice(SPEC_METHODS)
        if offload and method == "draft_model":  # not reproduced with a tier yet
            method = "eagle"
        k = 1 if method == "mtp" else rng.randint(1, 4)
        engine["speculative"] = {"method": method, "num_speculative_tokens": k}
        engine["max_num_batched_tokens"] = budget = max(budget, 8 * (k + 1))
        engine["max_num_seqs"] = min(engine["max_num_seqs"], budget)
    if hybrid == "mamba":
        # The number of Mamba groups comes from its own stream: the other draws stay as before.
        copies = random.Random(f"mamba-groups-{seed}").choice([1, 1, 2, 3])
        groups, U, need = _mamba_groups(rng, k, sem is None or sem.has_mamba_prefill_checkpoints,
                                        copies)
        need += sum(cdiv(mml, g["block_size"]) for g in groups if g["kind"] != "mamba")
        engine["kv_groups"] = groups
        engine["block_size"] = b = U
        engine["num_gpu_blocks"] = need + 1 + rng.choice([0, 2, need // 2, 2 * need])
    elif hybrid:
        groups, U, need = _groups(rng, mml, budget)
        engine["kv_groups"] = groups
        engine["block_size"] = b = U
        engine["num_gpu_blocks"] = need + 1 + rng.choice([0, 2, need // 2, 2 * need])
    docs = []
    next_id = 1
    for _ in range(rng.randint(2, 5)):
        n = rng.choice([rng.randint(1, 300), b * rng.randint(1, 12)])
        docs.append([next_id, n])
        next_id += n
    requests: list[dict[str, Any]] = []
    join = 0
    for i in range(rng.randint(4, 40)):
        if requests and rng.random() < 0.15:
            segs = [list(s) for s in rng.choice(requests)["prompt_segments"]]  # exact repeat
        else:
            first, n = rng.choice(docs)
            cut = rng.choice([n, rng.randint(1, n), b * max(1, n // b)])
            segs = [[first, min(cut, n)]]
            tail = rng.choice([0, rng.randint(1, 60), b])
            if tail:
                segs.append([next_id, tail])
                next_id += tail
        if sum(n for _, n in segs) >= mml:  # prompt + one output must fit max_model_len
            first, n = segs[0]
            segs = [[first, min(n, mml - 1 - rng.randint(0, 20))]]
        join += rng.choice([0, 0, 0, 1, 2, 5, 20])
        requests.append({
            "req_id": f"r{i}",
            "prompt_segments": segs,
            "max_tokens": rng.choice([1, 2, rng.randint(1, 40), rng.randint(40, 120)]),
            "priority": rng.randint(0, 3),
            "arrival_time": join * 0.01 + i * 1e-6,
            "join_step": join,
            "output_token_id": -(i + 1),
        })
        if k:
            requests[-1]["accepted"] = [rng.randint(0, k) for _ in range(rng.randint(1, 4))]
    if hybrid and rng.random() < 0.4:
        # Checkpoint retention other than the release's default: dense (any release) or
        # periodic (0.23+; left out for an older release, whose checkpoints are dense); 0,
        # replay boundaries only, is not the default of 0.23-0.28 (an environment variable).
        retention = rng.choice(["dense", U, 2 * U, 4 * U])
        if (sem is not None and sem.retention_setting == "env"
                and random.Random(seed * 31 + 7).random() < 0.3):  # (not the main stream)
            retention = 0
        if retention == "dense" or sem is None or sem.retention_setting != "none":
            engine["prefix_cache_retention_interval"] = retention
    if spec and engine["speculative"]["method"] == "mtp" and rng.random() < 0.3:
        # Multi-module MTP: k modules, each reading one token further (prefill look-ahead k);
        # the scheduler block must hold k, as vLLM requires with prefix caching.
        k2 = rng.randint(2, 3)
        if engine["block_size"] >= k2 and engine["max_num_batched_tokens"] > 8 * (k2 + 1):
            engine["speculative"].update(num_speculative_tokens=k2, mtp_num_layers=k2)
            for r in requests:
                r["accepted"] = [rng.randint(0, k2) for _ in r["accepted"]]
    if spec and engine["speculative"]["method"] in EAGLE_METHODS and rng.random() < 0.3:
        # 0.33: back from lookahead block hashes to the block drop (other releases drop anyway).
        engine["speculative"]["disable_lookahead_block_hashes"] = True
    if offload:  # (vLLM's connector needs the block hashes prefix caching makes)
        engine["enable_prefix_caching"] = True
        engine["kv_offloading"] = _offloading(random.Random(f"offload-{seed}"),
                                              engine["num_gpu_blocks"], seed)
    return {"seed": seed, "engine": engine, "requests": requests}


def _offloading(rng: random.Random, num_gpu_blocks: int, seed: int) -> dict:
    """A CPU tier from one chunk (evicting all the time) to several GPU pools, chunks of 1-4
    blocks, sometimes a store threshold or decode tokens stored, LRU or ARC, transfers of 0-3
    steps."""
    off: dict[str, Any] = {
        "cpu_chunks": rng.choice([1, 3, max(1, num_gpu_blocks // 4), num_gpu_blocks,
                                  4 * num_gpu_blocks]),
        "blocks_per_chunk": rng.choice([1, 1, 2, 4]),
        "transfer_delay": rng.choice([0, 0, 1, 3]),
    }
    if rng.random() < 0.2:
        off["store_threshold"] = 2
    if rng.random() < 0.2:
        off["offload_prompt_only"] = False
    if random.Random(f"arc-{seed}").random() < 0.4:  # a stream of its own: LRU draws unchanged
        off["eviction_policy"] = "arc"
    return off


def to_driver(scenario: dict) -> dict:
    """The scenario with ``prompt_segments`` expanded to ``prompt_token_ids``."""
    reqs = []
    for r in scenario["requests"]:
        r = dict(r)
        segs = r.pop("prompt_segments", None)
        if segs is not None:
            r["prompt_token_ids"] = [t for f, n in segs for t in range(f, f + n)]
        reqs.append(r)
    return {"engine": scenario["engine"], "requests": reqs}


def random_pd_scenario(seed: int, spec: bool = False, async_scheduling: bool = False) -> dict:
    """A seeded P/D pair (``oracle/pd_driver.py``'s input): ``random_scenario``'s engine and
    requests, the engine on both sides with the decode side's pool drawn again (from a
    stream of its own: a pool that cannot hold every request at once makes the decode side
    preempt while the prefill side holds blocks for it), more multi-module MTP (the P/D
    backoff), reads of 0-3 schedule() calls and sometimes a ``kv_recompute_threshold``."""
    base = random_scenario(seed, spec=spec, async_scheduling=async_scheduling)
    rng = random.Random(f"pd-{seed}")
    engine = base["engine"]
    if spec and rng.random() < 0.3 and engine["block_size"] >= 3 and (
            engine["max_num_batched_tokens"] > 8 * 4):
        # Multi-module MTP, whose prefill look-ahead sets the P/D backoff (k - 1 tokens the
        # prefill leaves to the decode side).
        k = rng.randint(2, 3)
        engine["speculative"] = {"method": "mtp", "num_speculative_tokens": k,
                                 "mtp_num_layers": k}
        for r in base["requests"]:
            r["accepted"] = [rng.randint(0, k) for _ in r.get("accepted") or [0]]
    decode = dict(engine)
    blocks = engine["num_gpu_blocks"]
    min_blocks = cdiv(engine["max_model_len"], engine["block_size"]) + 1
    decode["num_gpu_blocks"] = max(min_blocks, rng.choice([blocks, blocks // 2, 2 * blocks,
                                                           min_blocks]))
    sc: dict[str, Any] = {"seed": seed, "prefill": engine, "decode": decode,
                          "transfer_delay": rng.choice([0, 0, 1, 3]),
                          "requests": base["requests"]}
    if rng.random() < 0.3:
        sc["kv_recompute_threshold"] = rng.choice([0, 8, 64])
    return sc


def pd_to_driver(scenario: dict) -> dict:
    """A P/D scenario with its prompts expanded (``to_driver``)."""
    reqs = to_driver({"engine": {}, "requests": scenario["requests"]})["requests"]
    return {**{k: v for k, v in scenario.items() if k != "seed"}, "requests": reqs}
