"""Trace reading and synthetic generation."""

import json

import numpy as np
import pytest

from kvsim.config import parse_scenario
from kvsim.errors import ConfigError
from kvsim.request import ExplicitTokens, SegmentTokens
from kvsim.workload import build_requests
from kvsim.workload.jsonl import read_kvsim_jsonl
from kvsim.workload.synthetic import shared_prefix


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
    assert (a.req_id, a.arrival_s, a.max_tokens, a.prompt.window(0, 3)) == ("0", 0.5, 4, (1, 2, 3))
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
    raw = {"model": {"preset": "llama-3.2-1b"}, "hardware": {"preset": "l40s"},
           "engine": {"max_model_len": 64, "num_gpu_blocks": 100},
           "workload": {"kind": "trace", "path": str(p)}}
    with pytest.raises(ConfigError, match="exceeds max_model_len 64"):
        build_requests(parse_scenario(raw))


def test_arrival_order_is_stable(tmp_path):
    p = write(tmp_path, [{"arrival_s": t, "max_tokens": 1, "prompt_token_ids": [i], "req_id": f"r{i}"}
                         for i, t in enumerate([1.0, 0.5, 1.0, 0.5])])
    raw = {"model": {"preset": "llama-3.2-1b"}, "hardware": {"preset": "l40s"},
           "engine": {"max_model_len": 64, "num_gpu_blocks": 100},
           "workload": {"kind": "trace", "path": str(p)}}
    assert [s.req_id for s in build_requests(parse_scenario(raw))] == ["r1", "r3", "r0", "r2"]


def test_shared_prefix_structure():
    raw = {"model": {"preset": "llama-3.2-1b"}, "hardware": {"preset": "l40s"},
           "workload": {"num_requests": 50, "system_prompt_tokens": 32, "num_users": 3,
                        "user_history_tokens": 16, "input_tokens": 8, "request_rate": 5.0}}
    w = parse_scenario(raw).workload
    specs = shared_prefix(w, np.random.default_rng(1))
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
    assert [s.arrival_s for s in shared_prefix(w, np.random.default_rng(1))] == arrivals
