"""Hybrid KV groups (reference §3.2, §9, §13), expectations from the reference's executed and
measured tables."""

import pytest

from kvsim.config import parse_scenario
from kvsim.engine import build_scheduler
from kvsim.errors import ConfigError
from kvsim.oracle.replay import drive
from kvsim.request import Request, RequestSpec, SegmentTokens
from tests.builders import run_until_done

# Llama 3.2 1B as a checkpoint with one MTP layer, so that method "mtp" runs on it.
LLAMA_MTP = {"preset": "llama-3.2-1b", "num_nextn_predict_layers": 1}

# §13's layout: G0 full attention b = 128 (holds the MTP layer), G1 a full-type stand-in for
# the compressed C128 group (b = 16384), G2 sliding window b = 128, w = 128. U = 16384.
DSV4_GROUPS = [
    {"kind": "full_attention", "block_size": 128, "eagle": True},
    {"kind": "full_attention", "block_size": 16384},
    {"kind": "sliding_window", "block_size": 128, "sliding_window": 128},
]


def repeat_hit(L, groups, spec, version="0.33.0", num_gpu_blocks=4000, retention="dense"):
    """B's hit repeating A's L-token prompt. The reference's tables were measured on
    Schedulers built with a hand-made KVCacheConfig, whose retention is dense; so is this
    helper's default (``retention=None``: the release's own default)."""
    mml = 65536 if L > 4000 else 4096
    engine = {"vllm_version": version, "num_gpu_blocks": num_gpu_blocks, "max_model_len": mml,
              "max_num_batched_tokens": 65536, "max_num_seqs": 8, "kv_groups": groups}
    if retention is not None:
        engine["prefix_cache_retention_interval"] = retention
    raw = {"model": LLAMA_MTP, "hardware": {"preset": "h200"},
           "engine": engine, "speculative": spec}
    s = build_scheduler(parse_scenario(raw))
    for i in range(2):  # A, then B repeating it after A finished
        r = Request(RequestSpec(f"r{i}", 0.0, SegmentTokens([(1, L)]), 1), i)
        s.add_request(r)
        run_until_done(s)  # builders.step checks invariants after every step
    return r.cached_tokens


MTP = {"method": "mtp", "num_speculative_tokens": 1}
H1_GROUPS = [{"kind": "full_attention", "block_size": 16, "eagle": True},
             {"kind": "sliding_window", "block_size": 32, "sliding_window": 64}]


@pytest.mark.parametrize("spec, expected", [
    ({"method": "none"}, [32768, 32768, 32768, 16384]),                       # §13, no spec
    (MTP, [32768, 32768, 32768, 16384]),                                     # 0.33 lookahead
    ({**MTP, "disable_lookahead_block_hashes": True}, [32768, 32768, 16384, 16384]),  # 0.33 drop
])
def test_dsv4_layout_033(spec, expected):
    assert [repeat_hit(L, DSV4_GROUPS, spec) for L in (46240, 40000, 32769, 20000)] == expected


def test_no_group_marked_flags_every_group():
    # With no group marked every group is flagged (§3.2). By 0.33.0's coordinator in drop mode:
    # A's G0 caches min(46240, 32768 + 128) -> 257 blocks, G1 min(46240, 32768 + 16384) -> 2
    # blocks. B: G0 matches 257 (look-ahead limit min(46239 + 128, 46240)), drops to 256 = 32768;
    # G1 may look to min(32768 + 16384, 46240) -> 2 blocks, drops one -> 16384; the SWA group
    # and the next pass accept 16384. (0.22.1, which did not cache those extra blocks, gives 0.)
    groups = [{k: v for k, v in g.items() if k != "eagle"} for g in DSV4_GROUPS]
    spec = {**MTP, "disable_lookahead_block_hashes": True}
    assert repeat_hit(46240, groups, spec) == 16384


@pytest.mark.parametrize("L, expected", [(100, 80), (97, 80), (96, 80)])
def test_h2_eagle_look_ahead_is_bounded_by_the_hashes_in_033(L, expected):
    # §3.2 example H2: G0 full b = 16 EAGLE, G1 SWA b = 16 w = 32, U = 16. The reference
    # executed it on May 2026 code, where EAGLE looked ahead to min(cur + b, L - 1): 80/80/64.
    # 0.33.0's coordinator bounds the look-ahead by the hashed tokens instead
    # (min(cur + b, len(block_hashes) * H)); at L = 96 A cached 6 blocks (the extra EAGLE block
    # rule: min(96, 96 + 16)), B may look at all 6, drops one: 80.
    groups = [{"kind": "full_attention", "block_size": 16, "eagle": True},
              {"kind": "sliding_window", "block_size": 16, "sliding_window": 32}]
    spec = {"method": "eagle", "num_speculative_tokens": 1, "disable_lookahead_block_hashes": True}
    assert repeat_hit(L, groups, spec) == expected


@pytest.mark.parametrize("L, no_spec, eagle_fixed", [
    (200, 192, 160), (210, 192, 192), (224, 192, 192), (225, 224, 192), (257, 256, 224)])
def test_h1_eagle_fixed_write_rule(L, no_spec, eagle_fixed):
    # §3.2 example H1 (executed): G0 full b = 16 EAGLE, G1 SWA b = 32 w = 64, U = 32.
    # Columns "no spec" and "EAGLE + fix" (0.33 in drop mode caches the extra EAGLE block).
    groups = H1_GROUPS
    drop = {"method": "eagle", "num_speculative_tokens": 1, "disable_lookahead_block_hashes": True}
    assert repeat_hit(L, groups, {"method": "none"}) == no_spec
    assert repeat_hit(L, groups, drop) == eagle_fixed


@pytest.mark.parametrize("group, what", [
    ({"kind": "sliding_window", "block_size": 16}, "required for a sliding_window group"),
    ({"kind": "full_attention", "block_size": 16, "sliding_window": 8}, "only for sliding_window"),
    ({"kind": "full_attention", "block_size": 0}, "at least 1"),
    ({"kind": "attention", "block_size": 16}, "must be one of"),
    ({"kind": "full_attention", "block_size": 16, "eagel": True}, "did you mean 'eagle'"),
])
def test_bad_groups_are_one_line_errors(group, what):
    raw = {"model": LLAMA_MTP, "hardware": {"preset": "h200"},
           "engine": {"num_gpu_blocks": 10000, "max_model_len": 4096, "kv_groups": [group]}}
    with pytest.raises(ConfigError) as exc:
        parse_scenario(raw)
    assert "engine.kv_groups[0]" in exc.value.where and what in exc.value.what


@pytest.mark.parametrize("version, spec, expected", [
    # §13 "0.22.1 no spec" and "0.22.1 MTP (drop)": the 32K -> 16K bug.
    ("0.22.1", {"method": "none"}, [32768, 32768, 32768, 16384]),
    ("0.22.1", MTP, [16384, 16384, 16384, 0]),
    ("0.22.0", MTP, [16384, 16384, 16384, 0]),
    # §9 "After #44082": 46240/40000 -> 32768; 32769 -> 16384; 20000 -> 16384 (drop, fixed).
    ("0.32.0", MTP, [32768, 32768, 16384, 16384]),
    # §13 0.21.0 "every computed token is cached, no rounding to U" (not run there; derived):
    # A's groups publish every full block. B (46240): G1 (b = 16384) hits 2 blocks, 32768;
    # G0 (b = 128, EAGLE) looks one block past it, 257 blocks, drops one: 32768; the window
    # group's blocks before it are all cached: 32768 (40000 alike). 32769: G0 may look only
    # to L - 1 = 32768, 256 blocks, drops one: 32640, rounded to U: 16384. 20000: G0 129
    # blocks, drops one: 16384. Same table as the fixed releases; 0.20.2's coordinator is 0.21.0's.
    ("0.21.0", MTP, [32768, 32768, 16384, 16384]),
    ("0.20.2", MTP, [32768, 32768, 16384, 16384]),
])
def test_dsv4_layout_by_version(version, spec, expected):
    assert [repeat_hit(L, DSV4_GROUPS, spec, version) for L in (46240, 40000, 32769, 20000)] == expected


def test_all_groups_flagged_collapses_to_zero_on_0221():
    # §13: 0.22.1 MTP with no group flagged (all flagged) -> 0.
    groups = [{k: v for k, v in g.items() if k != "eagle"} for g in DSV4_GROUPS]
    assert repeat_hit(46240, groups, MTP, "0.22.1") == 0


# -- Checkpoint retention (prefix_cache_retention_interval, 0.32+) ---------------------------
# Rule (0.32/0.33 kv_cache_coordinator.py replay_boundaries, single_type_kv_cache_manager.py
# reachable_block_mask): with the default 0 a sliding-window group publishes the tail a hit
# needs only at the prompt's replay boundaries, L - 1 rounded down to U, or under the EAGLE drop
# {rd(L - 1, U) - U, rd(L, U) - U}, and at a shared-prefix junction a lookup found.


@pytest.mark.parametrize("version, spec, expected", [
    # Lookahead hashes (0.33's MTP default) and no spec: the boundary is rd(L - 1, U), where the
    # repeat's hit ends anyway, so nothing changes: §13's 32768/32768/32768/16384.
    ("0.33.0", MTP, [32768, 32768, 32768, 16384]),
    ("0.33.0", {"method": "none"}, [32768, 32768, 32768, 16384]),
    # The drop (0.32's MTP default, 0.33 with the opt-out): A's window block is kept only at
    # rd(L, U) - U = 16384 (46240, 40000, 32769) or 0 (20000). B's full-attention groups reach
    # 32768 (46240, 40000), the window group has no block ending there and falls back to 16384;
    # at 20000 full attention gives 16384 and the window group nothing at all: 0.
    ("0.33.0", {**MTP, "disable_lookahead_block_hashes": True}, [16384, 16384, 16384, 0]),
    ("0.32.0", MTP, [16384, 16384, 16384, 0]),
])
def test_dsv4_layout_default_retention(version, spec, expected):
    got = [repeat_hit(L, DSV4_GROUPS, spec, version, retention=None) for L in (46240, 40000, 32769, 20000)]
    assert got == expected


@pytest.mark.parametrize("L, eagle_drop", [(200, 160), (210, 160), (224, 192), (225, 192), (257, 224)])
def test_h1_default_retention(L, eagle_drop):
    # H1 (G0 full b = 16 EAGLE, G1 SWA b = 32 w = 64, U = 32; the window needs 2 blocks) with
    # the default retention: under the drop A keeps its window tail ending at
    # max(rd(L - 1, 32) - 32, rd(L, 32) - 32): 160 for L = 200/210, 192 for 224/225, 224 for 257.
    # At 210 full attention alone gives 192 (the fixed write rule), the window group only 160.
    drop = {"method": "eagle", "num_speculative_tokens": 1, "disable_lookahead_block_hashes": True}
    assert repeat_hit(L, H1_GROUPS, drop, retention=None) == eagle_drop


def _swa_example(retention, version="0.33.0"):
    # Issue #17's example: layout [sliding_window 16 w 64, full 16, full 128], U = 128, the window
    # needs cdiv(63, 16) = 4 blocks. A (1,315 tokens) keeps its window tail only at its replay
    # boundary rd(1314, 128) = 1280. B shares 1,137 tokens with A: full attention allows
    # rd(1137, 128) = 1024, the window group has nothing there: 0, and B's lookup records the
    # junction 1024, so B keeps a tail there too (and at its own boundary rd(1436, 128) = 1408).
    # C shares 1,152 with B: full attention allows 1152, B's window tails end at 1024 and 1408:
    # 1024. Dense (a tail at every 128): B 1024, C 1152. Interval 256: A also keeps 1024
    # (a multiple of 256), C 1024 (1152 is not).
    A = list(range(1, 1316))
    B = A[:1137] + list(range(5000, 5300))
    C = B[:1152] + list(range(9000, 9060))
    engine = {"block_size": 16, "num_gpu_blocks": 2000, "max_num_batched_tokens": 4096,
              "max_num_seqs": 8, "max_model_len": 4096,
              "kv_groups": [{"kind": "sliding_window", "block_size": 16, "sliding_window": 64},
                            {"kind": "full_attention", "block_size": 16},
                            {"kind": "full_attention", "block_size": 128}]}
    if retention is not None:
        engine["prefix_cache_retention_interval"] = retention
    reqs = [{"req_id": n, "prompt_token_ids": p, "max_tokens": 2, "join_step": 10 * i,
             "output_token_id": -(i + 1)} for i, (n, p) in enumerate([("A", A), ("B", B), ("C", C)])]
    res = drive({"engine": engine, "requests": reqs}, version)
    return [res["requests"][n]["cached_tokens"] for n in "ABC"]


@pytest.mark.parametrize("retention, expected", [
    (None, [0, 0, 1024]), (0, [0, 0, 1024]), ("dense", [0, 1024, 1152]), (256, [0, 1024, 1024])])
def test_sliding_window_retention(retention, expected):
    assert _swa_example(retention) == expected


@pytest.mark.parametrize("version, retention, expected", [
    # 0.23-0.28 read VLLM_PREFIX_CACHE_RETENTION_INTERVAL: unset, dense (B 1024, C 1152).
    ("0.28.0", None, [0, 1024, 1152]),
    # 0.23-0.25 keep no junction tail: B keeps only its replay boundary's (1408), so C's
    # window finds nothing at or below 1152: 0. 0.26 keeps B's junction tail at 1024, as 0.33.
    ("0.23.0", 0, [0, 0, 0]), ("0.25.0", 0, [0, 0, 0]), ("0.26.0", 0, [0, 0, 1024]),
    # Interval 256 in any of them: A's tails at every 256 serve B at 1024, B's serve C at 1024.
    ("0.23.0", 256, [0, 1024, 1024]), ("0.27.0", 256, [0, 1024, 1024]),
])
def test_sliding_window_retention_through_the_environment_variable(version, retention, expected):
    # (Each also what that release's own Scheduler gives, run through kvsim/oracle/vllm_driver.py.)
    assert _swa_example(retention, version) == expected


@pytest.mark.parametrize("version, retention, expected", [
    ("0.33.0", None, [0, 0, 256]), ("0.33.0", "dense", [0, 256, 256]), ("0.33.0", 256, [0, 256, 256]),
    ("0.32.0", None, [0, 0, 256]), ("0.22.1", None, [0, 256, 256])])
def test_mamba_retention(version, retention, expected):
    # Issue #17's Mamba example: block 128, full attention + Mamba, budget 128. A (400 tokens)
    # is prefilled in chunks ending at 128, 256, 384 (+16): states at 128, 256, 384. With the
    # default retention only the replay boundary rd(399, 128) = 384 is kept. C = A[:300] + 150
    # new: full attention allows 256, Mamba has no state there: 0, junction 256, so C's prefill
    # stops at 256 and keeps that state. D = A[:300] + 100: 256. Dense (and 0.22, which has no
    # retention; interval 256 keeps 256 too): C 256.
    A = list(range(1, 401))
    C = A[:300] + list(range(5000, 5150))
    D = A[:300] + list(range(9000, 9100))
    engine = {"block_size": 128, "num_gpu_blocks": 64, "max_num_batched_tokens": 128,
              "max_num_seqs": 8, "max_model_len": 1024,
              "kv_groups": [{"kind": "full_attention", "block_size": 128},
                            {"kind": "mamba", "block_size": 128}]}
    if retention is not None:
        engine["prefix_cache_retention_interval"] = retention
    reqs = [{"req_id": n, "prompt_token_ids": p, "max_tokens": 2, "join_step": 10 * i,
             "output_token_id": -(i + 1)} for i, (n, p) in enumerate([("A", A), ("C", C), ("D", D)])]
    res = drive({"engine": engine, "requests": reqs}, version)
    assert [res["requests"][n]["cached_tokens"] for n in "ACD"] == expected


@pytest.mark.parametrize("engine, what", [
    ({"prefix_cache_retention_interval": 64}, "no effect without a sliding_window or mamba"),
    ({"prefix_cache_retention_interval": 100, "kv_groups": H1_GROUPS}, "multiple of the scheduler"),
    ({"prefix_cache_retention_interval": -1}, 'integer >= 0 or "dense"'),
    ({"prefix_cache_retention_interval": "sparse"}, 'integer >= 0 or "dense"'),
    ({"prefix_cache_retention_interval": 0, "vllm_version": "0.22.1"}, "has no such setting"),
    # 0.23-0.28's variable: vLLM refuses 0 too without a group it applies to, and 0.23 applies
    # it to sliding windows only.
    ({"prefix_cache_retention_interval": 0, "vllm_version": "0.28.0"},
     "refuses VLLM_PREFIX_CACHE_RETENTION_INTERVAL"),
    ({"prefix_cache_retention_interval": 64, "vllm_version": "0.23.0", "kv_groups": [
        {"kind": "full_attention", "block_size": 64}, {"kind": "mamba", "block_size": 64}]},
     "no effect without a sliding_window group"),
])
def test_bad_retention_is_a_one_line_error(engine, what):
    raw = {"model": LLAMA_MTP, "hardware": {"preset": "h200"},
           "engine": {"num_gpu_blocks": 10000, "max_model_len": 4096, **engine}}
    with pytest.raises(ConfigError) as exc:
        parse_scenario(raw)
    assert exc.value.where.endswith("engine.prefix_cache_retention_interval")
    assert what in exc.value.what


def test_retention_default_per_release():
    def resolved(version):
        raw = {"model": LLAMA_MTP, "hardware": {"preset": "h200"},
               "engine": {"vllm_version": version, "num_gpu_blocks": 10000, "max_model_len": 4096}}
        return parse_scenario(raw).engine.prefix_cache_retention_interval
    assert [resolved(v) for v in ("0.19.0", "0.22.1", "0.32.0", "0.33.0")] == ["dense", "dense", 0, 0]
    # 0.23-0.28 only an environment variable (unset: dense); 0.29 the CacheConfig field, 0.
    assert [resolved(v) for v in ("0.23.0", "0.28.0", "0.29.0", "0.31.0")] == ["dense", "dense", 0, 0]


@pytest.mark.parametrize("version, spec, expected", [
    # 0.29's EngineArgs: left unset, a Mamba hybrid with an EAGLE-family drafter gets dense
    # checkpoints (engine/arg_utils.py:2395-2407); without a drafter, or from 0.30, 0.
    ("0.29.0", MTP, "dense"), ("0.29.0", {"method": "none"}, 0), ("0.29.0", {"method": "ngram",
     "num_speculative_tokens": 2}, 0), ("0.30.0", MTP, 0),
])
def test_retention_default_of_a_mamba_hybrid_with_eagle(version, spec, expected):
    raw = {"model": LLAMA_MTP, "hardware": {"preset": "h200"}, "speculative": spec,
           "engine": {"vllm_version": version, "num_gpu_blocks": 400, "max_model_len": 1024,
                      "max_num_batched_tokens": 2048, "max_num_seqs": 8, "kv_groups": MAMBA_H3}}
    assert parse_scenario(raw).engine.prefix_cache_retention_interval == expected


@pytest.mark.parametrize("version, expected", [("0.22.1", 64), ("0.32.0", 80)])
def test_eagle_look_ahead_bound_changed_in_032(version, expected):
    # Measured by the version report on both releases' Schedulers (full b = 16 EAGLE + SWA
    # b = 16, L = 96): 0.22 looks ahead to L - 1 at most, 0.32 as far as the hashes go.
    groups = [{"kind": "full_attention", "block_size": 16, "eagle": True},
              {"kind": "sliding_window", "block_size": 16, "sliding_window": 32}]
    assert repeat_hit(96, groups, {"method": "eagle", "num_speculative_tokens": 1}, version) == expected


# -- Mamba groups (reference §3.2 example H3, §4) -----------------------------------------

MAMBA_H3 = [{"kind": "full_attention", "block_size": 64}, {"kind": "mamba", "block_size": 64}]


def _mamba_manager(version, eagle_drop):
    from kvsim.kv.hybrid import GroupSpec, HybridKVCacheManager
    from kvsim.kv.pool import BlockPool
    from kvsim.semantics import VERSIONS
    sem = VERSIONS[version]
    pool = BlockPool(64, True, sem.pool_unhashed_to_front(True))
    groups = [GroupSpec(g["kind"], g["block_size"]) for g in MAMBA_H3]
    return HybridKVCacheManager(pool, groups, 1024, True, eagle_family=eagle_drop,
                                eagle_drop=eagle_drop, rules=sem.hybrid)


@pytest.mark.parametrize("chunks, no_spec, eagle", [
    ([192, 8], 192, 0),        # the scheduler's split without spec; EAGLE: G0 pops to 128, no state there
    ([128, 72], 128, 128),     # the split under EAGLE (last cache position one block earlier)
    ([128, 64, 8], 192, 128),  # a smaller budget: states at 128 and 192
])
def test_h3_mamba_hit_depends_on_how_a_was_chunked(chunks, no_spec, eagle):
    # §3.2 example H3: G0 full attention b = 64, G1 Mamba b = 64, L = 200. Mamba checkpoints
    # exist only at the block-aligned chunk ends of A; B (the same prompt) hits the last one
    # that every group accepts.
    got = []
    for drop in (False, True):
        kv = _mamba_manager("0.32.0", drop)
        a = Request(RequestSpec("A", 0.0, SegmentTokens([(1, 200)]), 1), 0)
        for n in chunks:
            assert kv.allocate_slots(a, n) is not None
            a.num_computed_tokens += n
            kv.new_step_starts()
            kv.check_invariants()
        kv.free(a)
        kv.check_invariants()
        b = Request(RequestSpec("B", 0.0, SegmentTokens([(1, 200)]), 1), 1)
        got.append(kv.get_computed_blocks(b)[1])
    assert got == [no_spec, eagle]


def mamba_chunks_and_hit(version, spec, budget=2048):
    raw = {"model": LLAMA_MTP, "hardware": {"preset": "h200"},
           "engine": {"vllm_version": version, "num_gpu_blocks": 200, "max_model_len": 1024,
                      "max_num_batched_tokens": budget, "max_num_seqs": 8, "kv_groups": MAMBA_H3,
                      "enable_prefix_caching": True},  # a hybrid's default before 0.28: off
           "speculative": spec}
    s = build_scheduler(parse_scenario(raw))
    a = Request(RequestSpec("A", 0.0, SegmentTokens([(1, 200)]), 1), 0)
    s.add_request(a)
    chunks = []
    while s.num_unfinished:
        plan = s.schedule()
        chunks += [c.num_new_tokens for c in plan.scheduled]
        s.update_from_output(plan)
        s.kv.check_invariants()
    b = Request(RequestSpec("B", 0.0, SegmentTokens([(1, 200)]), 1), 1)
    s.add_request(b)
    run_until_done(s)
    return chunks, b.cached_tokens


EAGLE1 = {"method": "eagle", "num_speculative_tokens": 1}


@pytest.mark.parametrize("version, spec, chunks, hit", [
    # 0.19/0.22 split: last cache position L - L % b = 192, one block less under EAGLE.
    ("0.19.0", {"method": "none"}, [192, 8], 192),
    ("0.22.1", EAGLE1, [128, 72], 128),
    # 0.32: rd(L - 1, b) = 192, with the drop rd(L, b) - b = 128.
    ("0.32.0", {"method": "none"}, [192, 8], 192),
    ("0.32.0", EAGLE1, [128, 72], 128),
    # 0.33's lookahead hashes need no drop: rd(L - max(1, 1), b) = 192, and B hits 192.
    ("0.33.0", EAGLE1, [192, 8], 192),
])
def test_h3_scheduler_split(version, spec, chunks, hit):
    assert mamba_chunks_and_hit(version, spec) == (chunks, hit)


@pytest.mark.parametrize("version, b_chunks, c_hit", [
    # A = tokens 1..200 chunked [192, 8]: full-attention blocks to 192, a Mamba state at 192
    # only. B shares A's first 150 tokens, then 100 of its own: full attention hits 128, Mamba
    # nothing below it, so B's hit is 0 and 128 tokens are a junction no Mamba state marks.
    # 0.23: B's chunks follow the last-block split alone, [192, 58]: its states at 192 (its
    # own prefix) only, and C (B's first 150 tokens, then others) hits 0.
    ("0.23.0", [192, 58], 0),
    # 0.24 (Marconi): B's first chunk stops at the junction, rd(128 - 0, 64) = 128; the next
    # at the last cache position, 250 - 250 % 64 = 192; then the tail: [128, 64, 58]. A state
    # at 128, and C hits 128.
    ("0.24.0", [128, 64, 58], 128),
])
def test_mamba_junction_split_by_release(version, b_chunks, c_hit):
    raw = {"model": LLAMA_MTP, "hardware": {"preset": "h200"},
           "engine": {"vllm_version": version, "num_gpu_blocks": 200, "max_model_len": 1024,
                      "max_num_batched_tokens": 2048, "max_num_seqs": 8, "kv_groups": MAMBA_H3,
                      "enable_prefix_caching": True}}
    s = build_scheduler(parse_scenario(raw))
    prompts = {"A": [(1, 200)], "B": [(1, 150), (1000, 100)], "C": [(1, 150), (2000, 50)]}
    chunks, hits = {}, {}
    for i, (rid, segs) in enumerate(prompts.items()):
        r = Request(RequestSpec(rid, 0.0, SegmentTokens(segs), 1), i)
        s.add_request(r)
        while s.num_unfinished:
            plan = s.schedule()
            chunks.setdefault(rid, []).extend(c.num_new_tokens for c in plan.scheduled)
            s.update_from_output(plan)
            s.kv.check_invariants()
        hits[rid] = r.cached_tokens
    assert chunks["A"] == [192, 8] and hits["B"] == 0
    assert (chunks["B"], hits["C"]) == (b_chunks, c_hit)


def test_h3_split_under_a_small_budget_keeps_every_block_state():
    # Budget 72: chunks round down to the block (64, 64, 64), then the tail; states at
    # 64, 128 and 192 (the older ones freed, still hashed): B hits 192.
    assert mamba_chunks_and_hit("0.33.0", {"method": "none"}, budget=72) == ([64, 64, 64, 8], 192)


@pytest.mark.parametrize("version, groups, budget, where, what", [
    ("0.33.0", [{"kind": "mamba", "block_size": 64, "prefill_checkpoint_alignment": 64},
                {"kind": "mamba", "block_size": 64}], 2048,
     "kv_groups[1].prefill_checkpoint_alignment", "every mamba group must have the same"),
    ("0.33.0", [{"kind": "full_attention", "block_size": 16}, {"kind": "mamba", "block_size": 64}],
     2048, "kv_groups[1].block_size", "every group must use the mamba block_size"),
    # 0.22's split rounds chunks down to the block: 64 > 32 schedules nothing, ever.
    ("0.22.1", MAMBA_H3, 32, "kv_groups", "exceeds the largest prefill chunk (32)"),
])
def test_bad_mamba_layouts_are_one_line_errors(version, groups, budget, where, what):
    raw = {"model": LLAMA_MTP, "hardware": {"preset": "h200"},
           "engine": {"vllm_version": version, "num_gpu_blocks": 1000, "max_model_len": 1024,
                      "max_num_batched_tokens": budget, "max_num_seqs": 8, "kv_groups": groups,
                      "enable_prefix_caching": True}}
    with pytest.raises(ConfigError) as exc:
        parse_scenario(raw)
    assert exc.value.where.endswith(where) and what in exc.value.what


def test_mamba_block_larger_than_a_chunk_advances_sub_block_in_033():
    # 0.32+: when the block exceeds the chunk limit, chunks run sub-block and re-align at the
    # next boundary (64 = 32 + 32); the last chunk ends at rd(L - 1, 64) = 192, then 8 more.
    chunks, hit = mamba_chunks_and_hit("0.33.0", {"method": "none"}, budget=32)
    assert chunks == [32] * 6 + [8] and hit == 192


# -- Prefill checkpoints inside a chunk (Mamba2 / GDN, 0.32+) --------------------------------


def _mamba_checkpoint_run(alignment, budget, retention=None, version="0.33.0"):
    # Full attention + Mamba, block 128. A: 400 tokens; A2 repeats it; C = A[:300] + 150 new;
    # D = A[:300] + 100 new (each joins after the previous one finished).
    A = list(range(1, 401))
    C = A[:300] + list(range(5000, 5150))
    D = A[:300] + list(range(9000, 9100))
    mamba = {"kind": "mamba", "block_size": 128}
    if alignment is not None:
        mamba["prefill_checkpoint_alignment"] = alignment
    engine = {"block_size": 128, "num_gpu_blocks": 64, "max_num_batched_tokens": budget,
              "max_num_seqs": 8, "max_model_len": 1024,
              "kv_groups": [{"kind": "full_attention", "block_size": 128}, mamba]}
    if retention is not None:
        engine["prefix_cache_retention_interval"] = retention
    reqs = [{"req_id": n, "prompt_token_ids": p, "max_tokens": 2, "join_step": 10 * i,
             "output_token_id": -(i + 1)}
            for i, (n, p) in enumerate([("A", A), ("A2", A), ("C", C), ("D", D)])]
    res = drive({"engine": engine, "requests": reqs}, version)["requests"]
    return res["A"]["first_token_step"], [res[n]["cached_tokens"] for n in ("A2", "C", "D")]


@pytest.mark.parametrize("alignment, budget, retention, first_token, hits", [
    # Mamba1: the prompt's checkpoint is rd(399, 128) = 384, so the scheduler ends A's first
    # chunk there ([384, 16]): A's first token comes a step later. A2 hits that state (384);
    # C gets 0 (no state at 256, only the replay boundary is kept) and leaves the junction
    # 256 that D hits.
    (None, 2048, None, 1, [384, 0, 256]),
    # Mamba2 (alignment 1) and GDN with FlashInfer (alignment = block): the one chunk
    # [0, 400) reaches the prefill end and contains 384 (0 + 128 <= 384 < 400, the checkpoint
    # column 2 lies after the initial state's): the state at 384 is exported from inside
    # it, into a block reserved for it. A decodes from step 0, the hits are the same.
    (1, 2048, None, 0, [384, 0, 256]),
    (128, 2048, None, 0, [384, 0, 256]),
    # Dense retention cannot help C here: the one chunk left no state at 256.
    (1, 2048, "dense", 0, [384, 0, 256]),
    # ... unless chunks end there: budget 256 gives [256, 144] with a state at 256 (dense
    # keeps it) and the internal checkpoint at 384: C 256.
    (1, 256, "dense", 1, [384, 256, 256]),
])
def test_mamba_prefill_checkpoints_inside_a_chunk(alignment, budget, retention, first_token, hits):
    assert _mamba_checkpoint_run(alignment, budget, retention) == (first_token, hits)


def test_mamba_prefill_checkpoints_need_032():
    raw = {"model": LLAMA_MTP, "hardware": {"preset": "h200"},
           "engine": {"vllm_version": "0.22.1", "num_gpu_blocks": 10000, "max_model_len": 4096,
                      "kv_groups": [{"kind": "full_attention", "block_size": 128},
                                    {"kind": "mamba", "block_size": 128,
                                     "prefill_checkpoint_alignment": 1}]}}
    with pytest.raises(ConfigError) as exc:
        parse_scenario(raw)
    assert exc.value.where.endswith("kv_groups[1].prefill_checkpoint_alignment")
    raw["engine"]["vllm_version"] = "0.33.0"
    raw["engine"]["kv_groups"][0]["prefill_checkpoint_alignment"] = 1
    with pytest.raises(ConfigError) as exc:
        parse_scenario(raw)
    assert "only for mamba groups" in exc.value.what


def test_window_keeps_the_multi_module_mtp_tail():
    # vLLM 0.32+'s SlidingWindowManager.get_num_skipped_tokens: computed - w + 1 -
    # extra_retained_tokens, with extra = num_prefill_lookahead - 1 = k - 1 for multi-module
    # MTP. w = 32, b = 16, k = 2: at 47 computed tokens 16 are skipped without the tail (block
    # 0 freed), 15 with it (kept); the admission cap counts the extra token too.
    from kvsim.kv.hybrid import GroupSpec, HybridKVCacheManager
    from kvsim.kv.pool import BlockPool
    groups = [GroupSpec("full_attention", 16), GroupSpec("sliding_window", 16, sliding_window=32)]
    for extra, skipped in ((0, 16), (1, 15)):
        kv = HybridKVCacheManager(BlockPool(100, True, True), groups, 4096, True,
                                  num_reprefillable=extra)
        assert kv.groups[1].num_skipped_tokens(47) == skipped
    # The start-up bound: cdiv(min(w - 1 + extra + in_flight, max_model_len), b) + 1.
    assert groups[1].max_blocks_per_request(4096, 64, extra_retained_tokens=1) == 7  # 96 tokens
    assert groups[1].max_blocks_per_request(4096, 64) == 7  # 95 tokens
    assert groups[1].max_blocks_per_request(4096, 65, extra_retained_tokens=1) == 8  # 97 tokens


def _first_change(kv, req, n: int, lookahead: int = 0) -> int:
    """Step ``req`` forward one decode token at a time (computed tokens and tokens alike)
    through ``allocate_slots``; the tokens gained before a call first changes a table, a
    published count or the free queue."""
    def state():
        tables = getattr(kv, "groups", None)
        if tables is None:
            return ([b.block_id for b in kv.req_to_blocks[req.req_id]],
                    kv.num_cached_block.get(req.req_id), kv.pool.num_free_blocks)
        return ([[b.block_id for b in g.tables[req.req_id]] for g in tables],
                [g.num_cached.get(req.req_id) for g in tables], kv.pool.num_free_blocks)

    for x in range(200):
        before = state()
        assert kv.allocate_slots(req, n, num_lookahead_tokens=lookahead) is not None
        if state() != before:
            return x
        req.num_computed_tokens += 1
        req.num_output_tokens += 1
    raise AssertionError("no change in 200 tokens")


@pytest.mark.parametrize("lookahead, want", [(0, 7), (3, 5)])
def test_decode_slack_of_one_full_attention_group(lookahead, want):
    # Block 16, a 40-token prompt prefilled (3 blocks, 48 slots; 2 full blocks published),
    # one output: 40 computed, 41 tokens. Block 2 (tokens 32-47) is published once 48 tokens
    # are in: 7 more. The chunk at c computed needs c + 1 + lookahead slots: past 48 at
    # c = 48 (8 more) or, with 3 lookahead slots, at c = 45 (5 more).
    from tests.builders import make_manager, make_request
    kv = make_manager(100, 16)
    req = make_request("a", range(40), max_tokens=100)
    kv.allocate_slots(req, 40)
    req.num_computed_tokens, req.num_output_tokens = 40, 1
    assert kv.decode_slack(req, 1, lookahead) == want
    assert _first_change(kv, req, 1, lookahead) == want  # step by step: the first call that acts


def test_decode_slack_of_a_sliding_window_layout():
    # Full attention and a 40-token window, both block 16 (U = 16), 0.32+ rules, no EAGLE.
    # A 64-token prompt prefilled: 4 blocks in each group, all 4 published. At 64 computed
    # (one output, 65 tokens) the window skips 64 - 40 + 1 = 25 tokens: block 0 is wholly
    # below them and the next call frees it (slack 0). That call also takes block 4 (65
    # slots). At 65 computed / 66 tokens: the window frees block 1 once 32 tokens are
    # skipped (c = 71: 6 more); 80 slots last until c = 80 (15 more); block 4 is published
    # at 80 tokens (14 more): 6.
    from kvsim.kv.hybrid import GroupSpec, HybridKVCacheManager
    from kvsim.kv.pool import BlockPool
    from tests.builders import make_request
    groups = [GroupSpec("full_attention", 16), GroupSpec("sliding_window", 16, sliding_window=40)]
    kv = HybridKVCacheManager(BlockPool(100, True, True), groups, 4096, True)
    req = make_request("a", range(64), max_tokens=100)
    kv.allocate_slots(req, 64)
    assert [g.num_cached[req.req_id] for g in kv.groups] == [4, 4]
    req.num_computed_tokens, req.num_output_tokens = 64, 1
    assert kv.decode_slack(req, 1) == 0
    kv.allocate_slots(req, 1)
    assert [len(g.tables[req.req_id]) for g in kv.groups] == [5, 5]
    assert kv.groups[1].tables[req.req_id][0] is kv.pool.null_block
    req.num_computed_tokens, req.num_output_tokens = 65, 2
    assert kv.decode_slack(req, 1) == 6
    assert _first_change(kv, req, 1) == 6  # step by step: block 1 leaves the window then
    assert kv.groups[1].tables[req.req_id][1] is kv.pool.null_block


# -- the sliding-window admission cap, by release (0.20.0/0.20.1 apply it to every count) --

def _swa_manager(version, num_blocks):
    from kvsim.kv.hybrid import GroupSpec, HybridKVCacheManager
    from kvsim.kv.pool import BlockPool
    from kvsim.semantics import VERSIONS
    sem = VERSIONS[version]
    groups = [GroupSpec("full_attention", 4), GroupSpec("sliding_window", 4, sliding_window=4)]
    return HybridKVCacheManager(BlockPool(num_blocks, True, sem.pool_unhashed_to_front(True)),
                                groups, 1024, True, max_in_flight_tokens=8, rules=sem.hybrid)


@pytest.mark.parametrize("version", ["0.20.0", "0.20.1", "0.20.2", "0.33.0"])
def test_swa_cap_in_every_count_kills_the_engine_on_0200(version):
    from kvsim.errors import EngineDeadError
    # A 32-token first chunk needs 8 blocks per group. The window's cap is
    # cdiv(min(4 - 1 + 8, 1024), 4) + 1 = 4 blocks (SlidingWindowSpec.
    # max_admission_blocks_per_request). 13 usable blocks: 0.20.2+ count 8 + 8 = 16 > 13 and
    # refuse the allocation; 0.20.0 counts 8 + 4 = 12 <= 13, gives full attention its 8 and
    # then asks the pool for the window's 8 with 5 left.
    kv = _swa_manager(version, 14)
    r = Request(RequestSpec("R", 0.0, SegmentTokens([(1, 32)]), 1), 0)
    if version in ("0.20.0", "0.20.1"):
        with pytest.raises(EngineDeadError, match="^ValueError: Cannot get 8 free blocks from the pool$"):
            kv.allocate_slots(r, 32)
    else:
        assert kv.allocate_slots(r, 32) is None
        assert kv.pool.num_free_blocks == 13
