"""The SimPy engine: when requests join, timings, limits, invariants on every step."""

import json

import pytest

from kvsim import engine, metrics
from kvsim.assemble import cost_inputs
from kvsim.config import parse_scenario
from kvsim.cost import RooflineCost
from kvsim.workload import build_requests


def scenario(tmp_path, rows, **engine_keys):
    p = tmp_path / "t.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    raw = {"model": {"preset": "llama-3.2-1b"}, "hardware": {"preset": "l40s"},
           "engine": {"num_gpu_blocks": 300, "max_model_len": 1024, "max_num_batched_tokens": 512,
                      "max_num_seqs": 8, "async_scheduling": False, **engine_keys},
           "workload": {"kind": "trace", "path": str(p)}}
    return parse_scenario(raw)


def cost_of(sc):
    return RooflineCost(cost_inputs(sc))


def test_a_request_joins_the_first_step_starting_at_or_after_its_arrival(tmp_path):
    probe = scenario(tmp_path, [{"arrival_s": 0, "max_tokens": 1, "prompt_token_ids": [1]}])
    c = cost_of(probe)
    d0 = c.step_time_s([(32, 0)], 1)  # step 0: A's whole prompt, which samples
    d1 = c.step_time_s([(1, 32), (8, 0)], 2)  # step 1: A decodes, B prefills
    rows = [
        {"arrival_s": 0.0, "max_tokens": 4, "prompt_token_ids": list(range(32)), "req_id": "A"},
        {"arrival_s": d0, "max_tokens": 4, "prompt_token_ids": list(range(100, 108)), "req_id": "B"},
        {"arrival_s": d0 + 1e-9, "max_tokens": 4, "prompt_token_ids": list(range(200, 208)),
         "req_id": "C"},
    ]
    sc = scenario(tmp_path, rows)
    rec = engine.run(sc, build_requests(sc), check_invariants=True)
    a, b, c_ = rec.requests
    assert (a.join_step, b.join_step, c_.join_step) == (0, 1, 2)
    assert rec.steps[1].start_s == d0 and rec.steps[1].duration_s == d1
    assert b.first_token_s - b.arrival_s == pytest.approx(d1, rel=1e-12)  # TTFT: end of 1st token's step
    assert a.first_token_step == 0 and a.finish_step == 3


def test_with_async_scheduling_the_next_step_is_planned_while_one_runs(tmp_path):
    # Async (vLLM 0.33's default): step 1 is planned at t = 0 while step 0 runs, so B, arriving
    # when step 0 ends, is planned into step 2 (planned at d0, while step 1 runs), and C,
    # arriving just after, into step 3.
    probe = scenario(tmp_path, [{"arrival_s": 0, "max_tokens": 1, "prompt_token_ids": [1]}])
    d0 = cost_of(probe).step_time_s([(32, 0)], 1)
    rows = [
        {"arrival_s": 0.0, "max_tokens": 4, "prompt_token_ids": list(range(32)), "req_id": "A"},
        {"arrival_s": d0, "max_tokens": 4, "prompt_token_ids": list(range(100, 108)), "req_id": "B"},
        {"arrival_s": d0 + 1e-9, "max_tokens": 4, "prompt_token_ids": list(range(200, 208)),
         "req_id": "C"},
    ]
    sc = scenario(tmp_path, rows, async_scheduling=True)
    rec = engine.run(sc, build_requests(sc), check_invariants=True)
    a, b, c_ = rec.requests
    assert (a.join_step, b.join_step, c_.join_step) == (0, 2, 3)
    assert rec.steps[1].start_s == d0  # step 1 (A's first decode) runs right after step 0
    assert [s.num_scheduled_tokens for s in rec.steps[:2]] == [32, 1]
    assert all(r.finish_step is not None for r in rec.requests)


def test_idle_engine_waits_for_the_next_arrival(tmp_path):
    rows = [{"arrival_s": 0.0, "max_tokens": 2, "prompt_token_ids": [1, 2, 3]},
            {"arrival_s": 50.0, "max_tokens": 2, "prompt_token_ids": [4, 5, 6]}]
    sc = scenario(tmp_path, rows)
    rec = engine.run(sc, build_requests(sc), check_invariants=True)
    assert [s.start_s for s in rec.steps][2] == 50.0
    assert len(rec.steps) == 4 and rec.requests[1].join_step == 2


def test_limits_stop_the_run(tmp_path):
    rows = [{"arrival_s": float(i), "max_tokens": 50, "prompt_token_ids": [i]} for i in range(5)]
    sc = scenario(tmp_path, rows)
    raw_limited = parse_scenario({"model": {"preset": "llama-3.2-1b"}, "hardware": {"preset": "l40s"},
                                  "engine": {"num_gpu_blocks": 300, "max_model_len": 1024,
                                             "max_num_batched_tokens": 512, "max_num_seqs": 8,
                                             "async_scheduling": False},
                                  "workload": {"kind": "trace", "path": str(sc.workload.path)},
                                  "run": {"max_steps": 10}})
    rec = engine.run(raw_limited, build_requests(raw_limited))
    assert len(rec.steps) == 10 and rec.stopped_by == "max_steps"
    assert rec.requests[0].finish_step is None


def test_queue_and_prefill_time_add_up_to_ttft(tmp_path):
    # A (32 tokens) arrives at 0 and prefills in step 0 (d0); B (40 tokens) arrives at d0 / 2,
    # waits for step 1 to start at d0 (queue d0 / 2), prefills in it (d1): TTFT d0 / 2 + d1.
    probe = scenario(tmp_path, [{"arrival_s": 0, "max_tokens": 1, "prompt_token_ids": [1]}])
    c = cost_of(probe)
    d0 = c.step_time_s([(32, 0)], 1)
    d1 = c.step_time_s([(1, 32), (40, 0)], 2)
    sc = scenario(tmp_path, [
        {"arrival_s": 0.0, "max_tokens": 3, "prompt_token_ids": list(range(32)), "req_id": "A"},
        {"arrival_s": d0 / 2, "max_tokens": 3, "prompt_token_ids": list(range(100, 140)),
         "req_id": "B"}])
    rec = engine.run(sc, build_requests(sc), check_invariants=True)
    rows = {r["req_id"]: r for r in metrics.request_rows(rec)}
    assert (rows["A"]["queue_s"], rows["A"]["prefill_s"]) == (0.0, pytest.approx(d0, rel=1e-12))
    assert rows["B"]["queue_s"] == pytest.approx(d0 / 2, rel=1e-12)
    assert rows["B"]["prefill_s"] == pytest.approx(d1, rel=1e-12)
    for r in rows.values():
        assert r["queue_s"] + r["prefill_s"] == pytest.approx(r["ttft_s"], rel=1e-12)
    assert metrics.requests_csv(rec).splitlines()[0].endswith(",e2e_s,queue_s,prefill_s")
