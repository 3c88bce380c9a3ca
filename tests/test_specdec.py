"""Speculative decoding accounting, expectations from the reference (§1, §3.1, §5) and
vLLM 0.33.0's scheduler.py / kv_cache_utils.py."""

import pytest

from kvsim.assemble import acceptance_for, spec_setup
from kvsim.config import parse_scenario
from kvsim.engine import build_scheduler
from kvsim.request import ExplicitTokens, Request, RequestSpec
from kvsim.semantics import VERSIONS
from tests.builders import run_until_done

# Llama 3.2 1B as a checkpoint with one MTP layer, so that method "mtp" runs on it.
LLAMA_MTP = {"preset": "llama-3.2-1b", "num_nextn_predict_layers": 1}


def sched_for(method="eagle", k=2, block_size=16, version="0.33.0", **spec):
    raw = {"model": LLAMA_MTP, "hardware": {"preset": "l40s"},
           "engine": {"vllm_version": version, "block_size": block_size, "num_gpu_blocks": 2000,
                      "max_model_len": 4096, "max_num_batched_tokens": 8192, "max_num_seqs": 64},
           "speculative": {"method": method, **({"num_speculative_tokens": k} if method != "none" else {}),
                           **spec}}
    return build_scheduler(parse_scenario(raw))


_seq = iter(range(10**9))


def req(rid, tokens, max_tokens=1, accepted=None):
    return Request(RequestSpec(rid, 0.0, ExplicitTokens(tuple(tokens)), max_tokens,
                               accepted=accepted), next(_seq))


def shared_prefix_hit(N, **kw):
    s = sched_for(**kw)
    s.add_request(req("A", range(1000)))
    run_until_done(s)
    b = req("B", [*range(N), *range(5000, 5000 + 1000 - N)])
    s.add_request(b)
    run_until_done(s)
    return b.cached_tokens


@pytest.mark.parametrize("kw, expected", [
    # §3.1 "Shared prefix, measured" (b = 16): no spec / ngram rd(N, b); 0.33 eagle
    # (lookahead hashes) rd(N-1, b); 0.33 with disable_lookahead_block_hashes: rd(N, b) - b.
    ({"method": "none"}, (800, 800)),
    ({"method": "ngram"}, (800, 800)),
    ({"method": "draft_model"}, (800, 800)),
    ({"method": "eagle"}, (784, 800)),
    ({"method": "mtp", "k": 1}, (784, 800)),
    ({"method": "eagle", "disable_lookahead_block_hashes": True}, (784, 784)),
    ({"method": "eagle", "disable_eagle_block_drop": True}, (800, 800)),
])
def test_shared_prefix_hits_by_method_033(kw, expected):
    assert (shared_prefix_hit(800, **kw), shared_prefix_hit(808, **kw)) == expected


@pytest.mark.parametrize("L, expected", [(100, 96), (97, 96), (96, 80), (33, 32), (17, 16)])
def test_repeat_with_lookahead_hashes_matches_no_spec(L, expected):
    # §3.1 table, last column (0.33 eagle, lookahead hashes; first request generated 20 tokens).
    s = sched_for(method="eagle")
    s.add_request(req("A", range(L), max_tokens=20))
    run_until_done(s)
    b = req("B", range(L))
    s.add_request(b)
    run_until_done(s)
    assert b.cached_tokens == expected


def test_eagle_worked_trace_of_section_1():
    # §1: b = 16, EAGLE k = 2, 30-token prompt. Step 1 schedules 30 (slots 32: 2 blocks);
    # 2 drafts; step 2 schedules 31 + 2 - 30 = 3, slots 35: 3 blocks; 1 of 2 accepted ->
    # computed 33 - 1 = 32, L = 33; step 3 schedules 33 + 2 - 32 = 3.
    s = sched_for(method="eagle", k=2)
    r = req("R", range(30), max_tokens=10)
    s.add_request(r)
    plan = s.schedule()
    assert [c.num_new_tokens for c in plan.scheduled] == [30]
    assert len(s.kv.block_ids("R")) == 2
    s.update_from_output(plan, lambda _r, n: 1)
    assert (r.num_computed_tokens, r.num_tokens, r.num_draft_tokens) == (30, 31, 2)
    plan = s.schedule()
    assert [(c.num_new_tokens, c.num_spec_tokens) for c in plan.scheduled] == [(3, 2)]
    assert len(s.kv.block_ids("R")) == 3
    s.update_from_output(plan, lambda _r, n: 1)
    assert (r.num_computed_tokens, r.num_tokens) == (32, 33)
    plan = s.schedule()
    assert [c.num_new_tokens for c in plan.scheduled] == [3]
    s.kv.check_invariants()


def test_rejected_drafts_keep_their_blocks():
    # b = 16, k = 3 (eagle: 3 lookahead slots). Prompt 28: step 0 slots 28 + 3 = 31 -> 2
    # blocks. Step 1 verifies 3 drafts (4 tokens), slots 28 + 4 + 3 = 35 -> 3 blocks; all
    # rejected: computed back to 29, but the 3 blocks stay.
    s = sched_for(method="eagle", k=3, block_size=16)
    r = req("R", range(28), max_tokens=50)
    s.add_request(r)
    s.update_from_output(s.schedule(), lambda _r, n: 0)
    assert len(s.kv.block_ids("R")) == 2
    s.update_from_output(s.schedule(), lambda _r, n: 0)
    assert (r.num_computed_tokens, r.num_tokens, len(s.kv.block_ids("R"))) == (29, 30, 3)
    s.kv.check_invariants()


def test_full_hit_admission_is_padded_to_a_verify_row():
    # 0.33 pads a newly admitted request with one token left (a full prefix hit while others
    # run) to 1 + k tokens of placeholder drafts, which are never accepted.
    # A (65 tokens) caches 4 full blocks; B repeats it: hit rd(64, 16) = 64, one token left,
    # A already scheduled in this step -> B gets 1 + 2 tokens, 2 of them placeholders.
    s = sched_for(method="eagle", k=2)
    s.add_request(req("A", range(65), max_tokens=30))
    s.update_from_output(s.schedule(), lambda _r, n: n)
    b = req("B", range(65), max_tokens=3)
    s.add_request(b)
    plan = s.schedule()
    chunk = {c.req.req_id: c for c in plan.scheduled}["B"]
    assert (b.cached_tokens, chunk.num_new_tokens, chunk.num_spec_tokens, chunk.padded) == (64, 3, 2, True)
    s.update_from_output(plan, lambda _r, n: n)  # placeholders are rejected whatever the model
    assert (b.num_computed_tokens, b.num_tokens) == (65, 66)


@pytest.mark.parametrize("version, alone, beside_a", [
    ("0.24.0", (1, False), (1, False)),  # no padding before 0.25
    ("0.25.0", (1, False), (3, True)),   # 0.25: only beside running requests scheduled this step
    ("0.29.0", (1, False), (3, True)),   # 0.29: the same, the row fitting max_model_len
    ("0.32.0", (3, True), (3, True)),    # 0.32+: also a prefix hit's admission alone
    ("0.33.0", (3, True), (3, True)),
])
def test_padding_a_one_token_admission_by_release(version, alone, beside_a):
    # B repeats a 65-token prompt cached by A: hit 64 (ngram drafts: no EAGLE drop), one token
    # left. "alone": A finished, B is the step's only request; "beside_a": A still decoding,
    # scheduled first. A padded row is 1 + k = 3 tokens (scheduler.py 0.25 :812-826, 0.32
    # :1131-1153).
    got = []
    for a_tokens in (1, 30):
        s = sched_for(method="ngram", k=2, version=version)
        s.add_request(req("A", range(65), max_tokens=a_tokens))
        s.update_from_output(s.schedule(), lambda _r, n: n)
        b = req("B", range(65), max_tokens=3)
        s.add_request(b)
        chunk = {c.req.req_id: c for c in s.schedule().scheduled}["B"]
        got.append((chunk.num_new_tokens, chunk.padded))
    assert got == [alone, beside_a]


def test_max_tokens_trims_accepted_drafts():
    s = sched_for(method="eagle", k=3)
    r = req("R", range(20), max_tokens=3)
    s.add_request(r)
    s.update_from_output(s.schedule(), lambda _r, n: n)  # 1 token
    first, finished = s.update_from_output(s.schedule(), lambda _r, n: n)  # 3 accepted + 1
    assert finished == [r] and r.num_output_tokens == 3


def test_acceptance_models():
    sc = parse_scenario({"model": LLAMA_MTP, "hardware": {"preset": "l40s"},
                         "speculative": {"method": "eagle", "num_speculative_tokens": 4,
                                         "acceptance": "fixed", "num_accepted": 3}})
    a = acceptance_for(sc)
    r = req("R", [1])
    assert (a(r, 4), a(r, 2)) == (3, 2)
    trace = acceptance_for(parse_scenario({
        "model": LLAMA_MTP, "hardware": {"preset": "l40s"},
        "speculative": {"method": "eagle", "num_speculative_tokens": 4, "acceptance": "trace"}}))
    t = req("T", [1], accepted=(2, 0, 4))
    got = []
    for _ in range(4):
        got.append(trace(t, 4))
        t.num_verify_steps += 1
    assert got == [2, 0, 4, 2]
    rates = parse_scenario({"model": LLAMA_MTP, "hardware": {"preset": "l40s"},
                            "speculative": {"method": "eagle", "num_speculative_tokens": 3,
                                            "acceptance_rates": [0.9, 0.5, 0.5]}, "run": {"seed": 5}})
    pp = acceptance_for(rates)
    draws = [pp(req(f"p{i}", [1]), 3) for i in range(4000)]
    # P(>=1) = 0.9, P(>=2) = 0.45, P(3) = 0.225: mean 1.575.
    assert abs(sum(draws) / len(draws) - 1.575) < 0.05
    assert all(0 <= d <= 3 for d in draws)


def test_spec_setup_by_method():
    def setup(method, k=3, **kw):
        raw = {"model": LLAMA_MTP, "hardware": {"preset": "l40s"},
               "speculative": {"method": method, "num_speculative_tokens": k, **kw}}
        return spec_setup(parse_scenario(raw))
    e = setup("eagle")
    assert (e.params.num_lookahead_tokens, e.params.draft_slots) == (3, 0)
    assert (e.hash_lookahead, e.eagle_drop) == (1, False)
    d = setup("draft_model")
    assert (d.params.num_lookahead_tokens, d.params.draft_slots, d.eagle_drop) == (3, 1, False)
    n = setup("ngram")
    assert (n.params.num_lookahead_tokens, n.params.draft_slots, n.hash_lookahead) == (0, 0, 0)
    p = setup("eagle3", parallel_drafting=True)
    assert p.params.draft_slots == 2


@pytest.mark.parametrize("version", list(VERSIONS))
@pytest.mark.parametrize("method", ["none", "ngram", "eagle"])
def test_shared_prefix_hits_by_version(version, method):
    # §3.1 and §13: a finished 1000-token request, then one sharing its first N tokens (b = 16).
    # No spec / ngram: rd(N, 16) = 800 for N = 800 and 808. EAGLE: drop releases (<= 0.32)
    # rd(N, 16) - 16 = 784 for both; 0.33 (lookahead hashes) rd(N - 1, 16) = 784, 800.
    expected = {"none": (800, 800), "ngram": (800, 800),
                "eagle": (784, 800) if version == "0.33.0" else (784, 784)}[method]
    assert (shared_prefix_hit(800, method=method, version=version),
            shared_prefix_hit(808, method=method, version=version)) == expected


def test_disable_eagle_block_drop_032():
    # §3.1: 0.32.0 with disable_eagle_block_drop=True gives 800 for N = 800.
    assert shared_prefix_hit(800, method="eagle", version="0.32.0", disable_eagle_block_drop=True) == 800


def test_the_oracle_driver_knows_every_method():
    # The driver runs in vLLM's own environment without kvsim, so it keeps its own list.
    import ast
    from pathlib import Path

    from kvsim import specdec

    tree = ast.parse((Path(specdec.__file__).parent / "oracle" / "vllm_driver.py").read_text())
    lists = [ast.literal_eval(node.value) for node in ast.walk(tree) if isinstance(node, ast.Assign)
             and any(getattr(t, "id", None) == "SPEC_METHODS" for t in node.targets)]
    assert [set(x) for x in lists] == [set(specdec.SPEC_METHODS) - {"none"}]


def test_acceptances_drawn_ahead_are_the_ones_drawn_step_by_step():
    """per_position: whatever was peeked ahead (and for how many drafts), each verify step
    accepts what the rule gives on the request's own uniforms in order
    (``random.Random(f"{seed}:{seq}")``; drafts accepted in order while a uniform falls below
    its position's rate: one uniform per accepted draft and one for the rejection, none
    after all are accepted)."""
    import random

    from kvsim.specdec import Acceptance, AcceptanceTally

    rates = (0.9, 0.6, 0.3)
    req = Request(RequestSpec("r", 0.0, ExplicitTokens((1, 2, 3)), 50), 7)
    uniforms = random.Random("5:7")

    def by_hand(num_drafts: int) -> int:
        accepted = 0
        while accepted < num_drafts and uniforms.random() < rates[min(accepted, 2)]:
            accepted += 1
        return accepted

    accept = Acceptance("per_position", rates, 0, seed=5, record=True)
    tally = AcceptanceTally(accept)
    first = tally.peek(req, 3, 10)  # drawn ahead, not used up
    assert tally.peek(req, 3, 10) == first
    got = tally.take(req, 3, 4)
    got.append(tally(req, 2))  # fewer drafts than peeked for: the same uniforms, counted again
    got += [tally(req, 3) for _ in range(3)]
    ahead = tally.peek(req, 3, 2)
    got += tally.take(req, 3, 2)
    got += tally.take(req, 3, 6) + [tally(req, 1), tally(req, 3)]
    drafts = [3, 3, 3, 3, 2, 3, 3, 3, 3, 3] + [3] * 6 + [1, 3]
    want = [by_hand(n) for n in drafts]
    assert got == want
    assert first[:4] == want[:4] and ahead == want[8:10]
    assert accept.log == {7: want}
    assert sorted(tally.outcomes.elements()) == sorted(want)
