"""Scheduler steps with expectations derived by hand from the reference
(../shared/reference/vllm-kv-semantics.md §3, §4, §7, §8) and vLLM 0.33.0's scheduler.py."""

import pytest

from tests.builders import make_request, make_scheduler, run_until_done, step


@pytest.mark.parametrize("L, expected", [(100, 96), (97, 96), (96, 80), (33, 32), (17, 16)])
def test_repeat_hit_is_capped_at_L_minus_1(L, expected):
    # §3.1 table, "no spec" column: rd(L-1, b).
    s = make_scheduler(block_size=16)
    s.add_request(make_request("A", range(L), max_tokens=1))
    run_until_done(s)
    b = make_request("B", range(L), max_tokens=1)
    s.add_request(b)
    steps = run_until_done(s)
    assert b.cached_tokens == expected
    assert steps[0]["scheduled"] == {"B": L - expected}
    assert (steps[0]["queries"], steps[0]["hits"]) == (L, expected)  # §8: queries count all L


@pytest.mark.parametrize("N, expected", [(800, 800), (808, 800)])
def test_shared_prefix_hit_rounds_down_to_blocks(N, expected):
    # §3.1 "Shared prefix, measured", no-spec column: rd(N, b).
    s = make_scheduler(block_size=16)
    s.add_request(make_request("A", range(1000), max_tokens=1))
    run_until_done(s)
    b = make_request("B", [*range(N), *range(5000, 5000 + 1000 - N)], max_tokens=1)
    s.add_request(b)
    run_until_done(s)
    assert b.cached_tokens == expected


def test_same_step_wave_shares_blocks_published_at_schedule_time():
    # §4 step 8 / §8: 3 requests with a 320-token common prefix in one step -> 0, 320, 320.
    s = make_scheduler(block_size=16)
    reqs = [make_request(f"r{i}", [*range(320), *range(1000 * (i + 1), 1000 * (i + 1) + 16)])
            for i in range(3)]
    for r in reqs:
        s.add_request(r)
    first = step(s)
    assert [r.cached_tokens for r in reqs] == [0, 320, 320]
    assert first["scheduled"] == {"r0": 336, "r1": 16, "r2": 16}
    assert (first["queries"], first["hits"]) == (3 * 336, 640)


def test_chunked_prefill_splits_by_budget():
    # Budget 64: r0 (100) takes 64; r1 waits for budget; step 1: r0's remaining 36, then r1 28.
    s = make_scheduler(max_num_batched_tokens=64, max_num_seqs=8)
    s.add_request(make_request("r0", range(100), max_tokens=3))
    s.add_request(make_request("r1", range(200, 250), max_tokens=3))
    steps = run_until_done(s)
    assert [x["scheduled"] for x in steps[:4]] == [
        {"r0": 64}, {"r0": 36, "r1": 28}, {"r0": 1, "r1": 22}, {"r0": 1, "r1": 1}]


def test_long_prefill_threshold_caps_chunks_when_requests_compete():
    s = make_scheduler(max_num_batched_tokens=64, max_num_seqs=8, long_prefill_token_threshold=32)
    s.add_request(make_request("r0", range(100), max_tokens=2))
    s.add_request(make_request("r1", range(200, 250), max_tokens=2))
    steps = run_until_done(s)
    assert [x["scheduled"] for x in steps[:4]] == [
        {"r0": 32, "r1": 32}, {"r0": 32, "r1": 18}, {"r0": 32, "r1": 1}, {"r0": 4}]


def test_long_prefill_threshold_is_ignored_for_a_lone_request_in_033():
    # 0.33.0 scheduler.py: "When it is the only request there is nobody to starve".
    s = make_scheduler(max_num_batched_tokens=64, max_num_seqs=8, long_prefill_token_threshold=32)
    s.add_request(make_request("r0", range(100), max_tokens=2))
    steps = run_until_done(s)
    assert [x["scheduled"] for x in steps] == [{"r0": 64}, {"r0": 36}, {"r0": 1}]


def test_chunked_prefill_off_stops_at_a_prompt_larger_than_the_budget_left():
    s = make_scheduler(max_num_batched_tokens=128, max_num_seqs=8, enable_chunked_prefill=False)
    s.add_request(make_request("r0", range(100), max_tokens=2))
    s.add_request(make_request("r1", range(200, 250), max_tokens=2))
    steps = run_until_done(s)
    assert [x["scheduled"] for x in steps] == [{"r0": 100}, {"r0": 1, "r1": 50}, {"r1": 1}]


def test_max_num_seqs_caps_the_running_set():
    s = make_scheduler(max_num_seqs=2)
    for i in range(3):
        s.add_request(make_request(f"r{i}", range(i * 100, i * 100 + 10), max_tokens=2))
    steps = run_until_done(s)
    assert [x["scheduled"] for x in steps] == [{"r0": 10, "r1": 10}, {"r0": 1, "r1": 1}, {"r2": 10},
                                               {"r2": 1}]


def test_fcfs_preempts_the_newest_and_admits_nothing_in_that_step():
    # b = 4, 6 usable blocks, caching off. Three 8-token prompts take 2 blocks each (step 0).
    # Step 1: r0 needs a 3rd block, none free -> running.pop() = r2 is preempted; r0, r1 decode.
    # r0 and r1 finish (max_tokens 2); step 2 re-prefills r2 from scratch: prompt + 1 output.
    s = make_scheduler(num_gpu_blocks=7, block_size=4, enable_caching=False)
    reqs = [make_request(f"r{i}", range(i * 10, i * 10 + 8), max_tokens=2) for i in range(3)]
    for r in reqs:
        s.add_request(r)
    steps = run_until_done(s)
    assert [(x["scheduled"], x["preempted"]) for x in steps] == [
        ({"r0": 8, "r1": 8, "r2": 8}, []), ({"r0": 1, "r1": 1}, ["r2"]), ({"r2": 9}, [])]
    assert [r.num_preemptions for r in reqs] == [0, 0, 1]
    assert reqs[2].cached_tokens == 0


def test_fcfs_preemption_block_ids():
    # Same run, tracking block ids (0.33: unhashed blocks are freed to the queue's front).
    # step 0: r0 [1,2] r1 [3,4] r2 [5,6]; r2 preempted -> queue [6,5]; r0 takes 6, r1 takes 5.
    # r0 frees [6,2,1] then r1 [5,4,3] to the front -> queue [5,4,3,6,2,1]; r2 takes [5,4,3].
    s = make_scheduler(num_gpu_blocks=7, block_size=4, enable_caching=False)
    reqs = [make_request(f"r{i}", range(i * 10, i * 10 + 8), max_tokens=2) for i in range(3)]
    for r in reqs:
        s.add_request(r)
    step(s)
    assert [s.kv.block_ids(r.req_id) for r in reqs] == [[1, 2], [3, 4], [5, 6]]
    plan = s.schedule()
    assert [s.kv.block_ids(r.req_id) for r in reqs[:2]] == [[1, 2, 6], [3, 4, 5]]
    s.update_from_output(plan)
    assert list(s.kv.pool.free_queue) == [5, 4, 3, 6, 2, 1]
    s.schedule()
    assert s.kv.block_ids("r2") == [5, 4, 3]


def test_priority_preempts_the_lowest_priority_latest_arrival():
    # Admission order (priority, arrival): r0 (0, 0.0), r2 (0, 0.2), r1 (1, 0.1).
    # Step 1: r0 needs a block -> victim = max(priority, arrival) = r1.
    s = make_scheduler(num_gpu_blocks=7, block_size=4, enable_caching=False,
                       scheduling_policy="priority")
    s.add_request(make_request("r0", range(0, 8), max_tokens=2, priority=0, arrival_s=0.0))
    s.add_request(make_request("r1", range(10, 18), max_tokens=2, priority=1, arrival_s=0.1))
    s.add_request(make_request("r2", range(20, 28), max_tokens=2, priority=0, arrival_s=0.2))
    steps = run_until_done(s)
    assert list(steps[0]["scheduled"]) == ["r0", "r2", "r1"]
    assert (steps[1]["scheduled"], steps[1]["preempted"]) == ({"r0": 1, "r2": 1}, ["r1"])
    assert steps[2]["scheduled"] == {"r1": 9}


def test_blocked_request_is_counted_once_at_admission():
    # §8, measured on 0.33.0: lookups of a request held back by the admission gate add nothing
    # until the step that admits it. b = 16, 7 usable blocks: r0 (96 tokens, 6 blocks, then a 7th
    # for decode) leaves 1 free; r1 (80 tokens = 5 blocks, 3 of them hit on r0's just-published
    # blocks) needs 2 new ones and waits until r0 finishes; then it hits r0's 3 cached blocks.
    s = make_scheduler(num_gpu_blocks=8, block_size=16, max_num_seqs=8)
    s.add_request(make_request("r0", range(96), max_tokens=4))
    s.add_request(make_request("r1", [*range(48), *range(500, 532)], max_tokens=1))
    steps = run_until_done(s)
    assert [x["scheduled"] for x in steps] == [{"r0": 96}, {"r0": 1}, {"r0": 1}, {"r0": 1},
                                               {"r1": 32}]
    assert [(x["queries"], x["hits"]) for x in steps] == [(96, 0), (0, 0), (0, 0), (0, 0), (80, 48)]
