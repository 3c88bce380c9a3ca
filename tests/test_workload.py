"""Trace reading and synthetic generation."""

import json

import numpy as np
import pytest

from kvsim.config import parse_scenario
from kvsim.errors import ConfigError
from kvsim.request import ExplicitTokens, SegmentTokens
from kvsim.workload import build_requests
from kvsim.workload.jsonl import read_kvsim_jsonl
from kvsim.workload.synthetic import process_arrivals, shared_prefix

# Llama 3.2 1B as a checkpoint with one MTP layer, so that method "mtp" runs on it.
LLAMA_MTP = {"preset": "llama-3.2-1b", "num_nextn_predict_layers": 1}


def generate(gen, w, seed):
    rng = np.random.default_rng(seed)
    return gen(w, rng, lambda n: process_arrivals(w, n, rng))


def write(tmp_path, lines):
    p = tmp_path / "t.jsonl"
    p.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return p


def test_segments_expand_like_explicit_ids():
    seg = SegmentTokens([(5, 3), (100, 2), (7, 4)])
    ids = ExplicitTokens((5, 6, 7, 100, 101, 7, 8, 9, 10))
    assert len(seg) == len(ids) == 9
    for a in range(9):
        for b in range(a, 10):
            assert seg.window(a, b) == ids.window(a, b)


def test_reads_ids_segments_and_defaults(tmp_path):
    p = write(tmp_path, [
        {"arrival_s": 0.5, "max_tokens": 4, "prompt_token_ids": [1, 2, 3]},
        "",
        {"arrival_s": 0, "max_tokens": 2, "prompt_segments": [[10, 5]], "req_id": "x", "priority": 2},
    ])
    a, b = read_kvsim_jsonl(p)
    assert (a.req_id, a.arrival_s, a.max_tokens, a.prompt.window(0, 3)) == ("r0", 0.5, 4, (1, 2, 3))
    assert (b.req_id, b.priority, b.prompt.window(0, 5)) == ("x", 2, (10, 11, 12, 13, 14))


@pytest.mark.parametrize("line, what", [
    ("{not json", "not valid JSON"),
    ({"arrival_s": -1, "max_tokens": 1, "prompt_token_ids": [1]}, "arrival_s"),
    ({"arrival_s": 0, "max_tokens": 0, "prompt_token_ids": [1]}, "max_tokens"),
    ({"arrival_s": 0, "max_tokens": 1}, "exactly one of"),
    ({"arrival_s": 0, "max_tokens": 1, "prompt_token_ids": [1, -2]}, "non-negative"),
    ({"arrival_s": 0, "max_tokens": 1, "prompt_token_ids": []}, "non-empty"),
    ({"arrival_s": 0, "max_tokens": 1, "prompt_segments": [[1, 0]]}, "length >= 1"),
    ({"arrival_s": 0, "max_tokens": 1, "prompt_token_ids": [1], "max_token": 3}, "did you mean 'max_tokens'"),
    ([1, 2], "JSON object"),
])
def test_bad_line_is_reported_with_its_number(tmp_path, line, what):
    p = write(tmp_path, [{"arrival_s": 0, "max_tokens": 1, "prompt_token_ids": [1]}, line])
    with pytest.raises(ConfigError) as exc:
        read_kvsim_jsonl(p)
    assert exc.value.where == f"{p}:2"
    assert what in exc.value.what


def test_empty_trace_and_repeated_ids_are_errors(tmp_path):
    with pytest.raises(ConfigError, match="no requests"):
        read_kvsim_jsonl(write(tmp_path, ["", ""]))
    dup = {"arrival_s": 0, "max_tokens": 1, "prompt_token_ids": [1], "req_id": "a"}
    with pytest.raises(ConfigError, match="repeats line 1"):
        read_kvsim_jsonl(write(tmp_path, [dup, dup]))


def test_prompt_of_max_model_len_is_rejected(tmp_path):
    p = write(tmp_path, [{"arrival_s": 0, "max_tokens": 1, "prompt_token_ids": list(range(64))}])
    raw = {"model": LLAMA_MTP, "hardware": {"preset": "l40s"},
           "engine": {"max_model_len": 64, "num_gpu_blocks": 100},
           "workload": {"kind": "trace", "path": str(p)}}
    with pytest.raises(ConfigError, match="exceeds max_model_len 64"):
        build_requests(parse_scenario(raw))


def test_arrival_order_is_stable(tmp_path):
    p = write(tmp_path, [{"arrival_s": t, "max_tokens": 1, "prompt_token_ids": [i], "req_id": f"r{i}"}
                         for i, t in enumerate([1.0, 0.5, 1.0, 0.5])])
    raw = {"model": LLAMA_MTP, "hardware": {"preset": "l40s"},
           "engine": {"max_model_len": 64, "num_gpu_blocks": 100},
           "workload": {"kind": "trace", "path": str(p)}}
    assert [s.req_id for s in build_requests(parse_scenario(raw))] == ["r1", "r3", "r0", "r2"]


def test_shared_prefix_structure():
    raw = {"model": LLAMA_MTP, "hardware": {"preset": "l40s"},
           "workload": {"num_requests": 50, "system_prompt_tokens": 32, "num_users": 3,
                        "user_history_tokens": 16, "input_tokens": 8, "request_rate": 5.0}}
    w = parse_scenario(raw).workload
    specs = generate(shared_prefix, w, 1)
    assert all(len(s.prompt) == 56 for s in specs)
    systems = {s.prompt.window(0, 32) for s in specs}
    assert len(systems) == 1
    by_user = {}
    for s in specs:
        by_user.setdefault(s.req_id.split("-")[0], set()).add(s.prompt.window(32, 48))
    assert all(len(v) == 1 for v in by_user.values())
    assert len({next(iter(v)) for v in by_user.values()}) == len(by_user)
    assert len({s.prompt.window(48, 56) for s in specs}) == 50
    arrivals = [s.arrival_s for s in specs]
    assert arrivals == sorted(arrivals)
    assert 0.12 < arrivals[-1] / 50 < 0.28  # mean gap of a 5 req/s Poisson process: 0.2 s
    assert [s.arrival_s for s in generate(shared_prefix, w, 1)] == arrivals


# -- generators with shared structure ------------------------------------------------------

SMALL = {"model": LLAMA_MTP, "hardware": {"preset": "l40s"}}


def specs_of(workload, speculative=None, seed=0):
    raw = {**SMALL, "workload": workload, "run": {"seed": seed}}
    if speculative:
        raw["speculative"] = speculative
    return build_requests(parse_scenario(raw))


def test_multi_turn_prompt_is_history_plus_new_message():
    specs = specs_of({"generator": "multi_turn", "num_requests": 10, "turns": 4,
                      "system_prompt_tokens": 64, "input_tokens": 20, "output_tokens": 30,
                      "think_time_s": 2.0, "request_rate": 1.0})
    assert len(specs) == 10
    convs = {}
    for s in specs:
        c, t = s.req_id.split("-")
        convs.setdefault(c, {})[int(t[1:])] = s
    assert sorted(len(v) for v in convs.values()) == [2, 4, 4]  # the last one is cut to 10
    systems = set()
    for turns in convs.values():
        for t, s in turns.items():
            assert len(s.prompt) == 64 + t * 50 + 20
            if t:
                prev = turns[t - 1]
                assert s.prompt.window(0, len(prev.prompt)) == prev.prompt.window(0, len(prev.prompt))
                assert s.arrival_s >= prev.arrival_s
            systems.add(s.prompt.window(0, 64))
    assert len(systems) == 1
    firsts = [turns[0].prompt.window(64, 84) for turns in convs.values()]
    assert len(set(firsts)) == 3  # conversations share only the system prompt


def test_agent_context_grows_and_sessions_do_not_share_it():
    specs = specs_of({"generator": "agent", "num_requests": 12, "turns": 6, "system_prompt_tokens": 32,
                      "context_tokens": 500, "input_tokens": 40, "output_tokens": 8})
    by = {}
    for s in specs:
        by.setdefault(s.req_id.split("-")[0], []).append(s)
    assert len(by) == 2
    for steps in by.values():
        lens = [len(s.prompt) for s in steps]
        assert lens == sorted(lens) and lens[0] > 532 and all(s.max_tokens == 8 for s in steps)
        for a, b in zip(steps, steps[1:]):
            assert b.prompt.window(0, len(a.prompt)) == a.prompt.window(0, len(a.prompt))
    a, b = by.values()
    assert a[0].prompt.window(0, 32) == b[0].prompt.window(0, 32)
    assert a[0].prompt.window(32, 532) != b[0].prompt.window(32, 532)


def test_rag_documents_follow_zipf_popularity():
    specs = specs_of({"generator": "rag", "num_requests": 400, "num_documents": 50,
                      "documents_per_request": 3, "document_tokens": 16, "system_prompt_tokens": 16,
                      "input_tokens": 8, "zipf_s": 1.2})
    counts = {}
    for s in specs:
        assert len(s.prompt) == 16 + 3 * 16 + 8
        docs = [s.prompt.window(16 + 16 * j, 32 + 16 * j) for j in range(3)]
        assert len(set(docs)) == 3
        for d in docs:
            counts[d] = counts.get(d, 0) + 1
    ranked = sorted(counts, key=lambda d: d[0])  # document r has the r-th id range
    assert counts[ranked[0]] > counts[ranked[4]] > counts[ranked[-1]]
    assert len({s.prompt.window(64, 72) for s in specs}) == 400  # questions are unique
    uniform = specs_of({"generator": "rag", "num_requests": 400, "num_documents": 50,
                        "documents_per_request": 3, "document_tokens": 16, "zipf_s": 0})
    assert len({s.prompt.window(512, 528) for s in uniform}) > 40


def test_gamma_arrivals_have_the_configured_rate_and_cv():
    specs = specs_of({"num_requests": 4000, "request_rate": 20.0, "arrival": "gamma",
                      "arrival_cv": 3.0, "system_prompt_tokens": 0, "user_history_tokens": 0,
                      "input_tokens": 1})
    gaps = np.diff([0.0] + [s.arrival_s for s in specs])
    assert gaps.mean() == pytest.approx(0.05, rel=0.15)
    assert gaps.std() / gaps.mean() == pytest.approx(3.0, rel=0.2)


def test_trace_driven_arrivals(tmp_path):
    p = write(tmp_path, [{"arrival_s": t, "max_tokens": 1, "prompt_token_ids": [1]}
                         for t in (0.0, 0.5, 2.0, 7.0)])
    specs = specs_of({"generator": "rag", "num_requests": 3, "arrival": "trace", "path": str(p),
                      "speedup": 2.0, "num_documents": 5, "documents_per_request": 1})
    assert [s.arrival_s for s in specs] == [0.0, 0.25, 1.0]
    with pytest.raises(ConfigError, match="has 4 requests .* needs 6"):
        specs_of({"generator": "multi_turn", "num_requests": 12, "turns": 2, "arrival": "trace",
                  "path": str(p)})


def test_generated_acceptances():
    spec = {"method": "mtp", "num_speculative_tokens": 3, "acceptance": "trace"}
    w = {"num_requests": 200, "output_tokens": 300, "acceptance_rate_mean": 0.6,
         "acceptance_rate_sd": 0.15}
    specs = specs_of(w, spec)
    assert all(s.accepted and all(0 <= a <= 3 for a in s.accepted) for s in specs)
    per_request = [np.mean([a > 0 for a in s.accepted]) for s in specs]
    assert np.mean(per_request) == pytest.approx(0.6, abs=0.05)
    assert np.std(per_request) == pytest.approx(0.15, rel=0.3)
    assert [s.accepted for s in specs_of(w, spec)] == [s.accepted for s in specs]
    with pytest.raises(ConfigError, match="needs an 'accepted' list"):
        specs_of({"num_requests": 2}, spec)
    with pytest.raises(ConfigError, match="only with speculative.acceptance = 'trace'"):
        specs_of(w, {"method": "mtp", "num_speculative_tokens": 3})
    with pytest.raises(ConfigError, match="too large for mean"):
        specs_of({**w, "acceptance_rate_sd": 0.5}, spec)


@pytest.mark.parametrize("generator", ["shared_prefix", "multi_turn", "rag", "agent"])
def test_generators_are_seeded(generator):
    w = {"generator": generator, "num_requests": 30, "num_documents": 20, "context_tokens": 64,
         "arrival": "gamma"}
    a, b, c = specs_of(w, seed=1), specs_of(w, seed=1), specs_of(w, seed=2)
    key = lambda specs: [(s.req_id, s.arrival_s, s.prompt.window(0, len(s.prompt))) for s in specs]  # noqa: E731
    assert key(a) == key(b) != key(c)
