"""Hybrid KV groups (reference §3.2, §9, §13), expectations from the reference's executed and
measured tables."""

import pytest

from kvsim.config import parse_scenario
from kvsim.engine import build_scheduler
from kvsim.errors import ConfigError
from kvsim.request import Request, RequestSpec, SegmentTokens
from tests.builders import run_until_done

# §13's layout: G0 full attention b = 128 (holds the MTP layer), G1 a full-type stand-in for
# the compressed C128 group (b = 16384), G2 sliding window b = 128, w = 128. U = 16384.
DSV4_GROUPS = [
    {"kind": "full_attention", "block_size": 128, "eagle": True},
    {"kind": "full_attention", "block_size": 16384},
    {"kind": "sliding_window", "block_size": 128, "sliding_window": 128},
]


def repeat_hit(L, groups, spec, version="0.33.0", num_gpu_blocks=4000):
    mml = 65536 if L > 4000 else 4096
    raw = {"model": {"preset": "llama-3.2-1b"}, "hardware": {"preset": "h200"},
           "engine": {"vllm_version": version, "num_gpu_blocks": num_gpu_blocks, "max_model_len": mml,
                      "max_num_batched_tokens": 65536, "max_num_seqs": 8, "kv_groups": groups},
           "speculative": spec}
    s = build_scheduler(parse_scenario(raw))
    for i in range(2):  # A, then B repeating it after A finished
        r = Request(RequestSpec(f"r{i}", 0.0, SegmentTokens([(1, L)]), 1), i)
        s.add_request(r)
        run_until_done(s)  # builders.step checks invariants after every step
    return r.cached_tokens


MTP = {"method": "mtp", "num_speculative_tokens": 1}


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
    groups = [{"kind": "full_attention", "block_size": 16, "eagle": True},
              {"kind": "sliding_window", "block_size": 32, "sliding_window": 64}]
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
    raw = {"model": {"preset": "llama-3.2-1b"}, "hardware": {"preset": "h200"},
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
])
def test_dsv4_layout_by_version(version, spec, expected):
    assert [repeat_hit(L, DSV4_GROUPS, spec, version) for L in (46240, 40000, 32769, 20000)] == expected


def test_all_groups_flagged_collapses_to_zero_on_0221():
    # §13: 0.22.1 MTP with no group flagged (all flagged) -> 0.
    groups = [{k: v for k, v in g.items() if k != "eagle"} for g in DSV4_GROUPS]
    assert repeat_hit(46240, groups, MTP, "0.22.1") == 0


@pytest.mark.parametrize("version, expected", [("0.22.1", 64), ("0.32.0", 80)])
def test_eagle_look_ahead_bound_changed_in_032(version, expected):
    # Measured by the version report on both releases' Schedulers (full b = 16 EAGLE + SWA
    # b = 16, L = 96): 0.22 looks ahead to L - 1 at most, 0.32 as far as the hashes go.
    groups = [{"kind": "full_attention", "block_size": 16, "eagle": True},
              {"kind": "sliding_window", "block_size": 16, "sliding_window": 32}]
    assert repeat_hit(96, groups, {"method": "eagle", "num_speculative_tokens": 1}, version) == expected
