"""The benchmark client (kvsim.client): vllm bench serve's concurrency limit and warm-ups, its
random dataset, and the client command line kvsim init reads (kvsim.bench_client)."""

import math
import shlex

import numpy as np
import pytest

from kvsim.bench_client import parse_bench
from kvsim.client import Client
from kvsim.config import parse_scenario
from kvsim.engine import run
from kvsim.errors import ConfigError
from kvsim.metrics import summarize
from kvsim.request import RequestSpec, SegmentTokens
from kvsim.workload import build_requests
from kvsim.workload.synthetic import random_lengths


def spec(i: int, arrival: float = 0.0, n: int = 32) -> RequestSpec:
    return RequestSpec(req_id=f"r{i}", arrival_s=arrival, prompt=SegmentTokens([(1 + 100 * i, n)]),
                       max_tokens=4)


def test_sends_wait_for_a_free_slot_first_come_first_sent():
    # C = 2, five requests due at 0, 0, 0, 5, 5. By hand: r0, r1 sent at 0; r2 waits for the
    # first finish (t = 3); r3 is due at 5 while a slot is free since 4 -> sent at 5; r4 waits
    # for the finish at 7.
    c = Client([spec(i, a) for i, a in enumerate([0, 0, 0, 5, 5])], 2, 0)
    sent = {r.req_id: r for r in c.arrived(0.0)}
    assert sorted(sent) == ["r0", "r1"] and c.next_arrival_s() is None  # both slots taken
    c.finished([sent["r0"]], 3.0)
    assert c.next_arrival_s() == 3.0
    sent |= {r.req_id: r for r in c.arrived(3.0)}
    c.finished([sent["r1"]], 4.0)
    assert c.next_arrival_s() == 5.0 and c.arrived(4.5) == []
    sent |= {r.req_id: r for r in c.arrived(6.0)}  # the engine looked late: sent at 5 all the same
    c.finished([sent["r2"]], 7.0)
    sent |= {r.req_id: r for r in c.arrived(7.0)}
    assert {k: r.arrival_s for k, r in sent.items()} == {"r0": 0, "r1": 0, "r2": 3, "r3": 5,
                                                          "r4": 7}
    assert c.next_arrival_s() is None and c.rest() == []


def test_warmups_copy_the_first_request_and_start_the_clock():
    c = Client([spec(0, 0.0), spec(1, 2.0)], 1, 2)
    (w0,) = c.arrived(0.0)
    assert (w0.req_id, w0.warmup, w0.num_prompt_tokens, c.benchmark_start_s) == (
        "warmup-0", True, 32, None)
    c.finished([w0], 1.0)
    (w1,) = c.arrived(1.0)
    c.finished([w1], 2.5)
    assert c.benchmark_start_s == 2.5
    (r0,) = c.arrived(2.5)
    assert (r0.req_id, r0.arrival_s, r0.warmup) == ("r0", 2.5, False)
    c.finished([r0], 3.0)
    assert c.next_arrival_s() == 4.5  # due 2 s after the benchmark's start
    assert c.total == 4


def _run(**workload):
    sc = parse_scenario({"model": {"preset": "llama-3.2-1b"}, "hardware": {"preset": "l40s"},
                         "engine": {"num_gpu_blocks": 2000, "max_model_len": 4096},
                         "workload": {"generator": "random", "num_requests": 40,
                                      "request_rate": math.inf, "random_input_len": 300,
                                      "random_output_len": 40, "random_range_ratio": 0.5,
                                      **workload}})
    return sc, run(sc, build_requests(sc), check_invariants=True)


def test_closed_loop_keeps_at_most_c_in_flight_and_sends_on_each_finish():
    sc, rec = _run(max_concurrency=5, num_warmups=3)
    warm = [r for r in rec.requests if r.warmup]
    main = sorted((r for r in rec.requests if not r.warmup), key=lambda r: r.seq)
    assert len(warm) == 3 and len(main) == 40
    start = max(r.finish_s for r in warm)
    # Replay the semaphore from the engine's own finish times: the first five are sent when the
    # last warm-up finishes, each later one at the (i - 5)-th finish of the measured run.
    finishes = sorted(r.finish_s for r in main)
    expect = [start] * 5 + finishes[:35]
    assert [r.arrival_s for r in main] == pytest.approx(expect, abs=0)
    for r in main:  # never more than five in flight
        assert sum(q.arrival_s <= r.arrival_s < q.finish_s for q in main) <= 5
    s = summarize(sc, rec)
    assert (s["num_requests"], s["num_warmups"], s["benchmark_start_s"]) == (40, 3, start)
    assert s["throughput"]["requests_per_s"] == pytest.approx(40 / (rec.end_s - start))
    # Warm-ups repeat the first prompt: the prefix cache holds it for the measured run's first.
    assert main[0].cached_tokens == (main[0].num_prompt_tokens - 1) // 16 * 16


def test_without_a_limit_the_client_sends_at_the_arrival_times():
    _, rec = _run(num_warmups=0, max_concurrency=40)
    assert all(r.arrival_s == 0 for r in rec.requests)


@pytest.mark.parametrize("rule,ratio,low,high", [
    ("centered", 0.5, 512, 1536),  # vllm bench serve: [floor(1024 * 0.5), ceil(1024 * 1.5)]
    ("below", 0.8, 819, 1024),     # benchmark_serving.py: [int(0.8 * 1024), 1024]
    ("centered", 0.0, 1024, 1024),
])
def test_random_lengths_range(rule, ratio, low, high):
    x = random_lengths(1024, ratio, rule, 20000, np.random.default_rng(0))
    assert (x.min(), x.max()) == (low, high)
    assert abs(x.mean() - (low + high) / 2) < 0.02 * high


def test_random_dataset_prompts_share_only_the_prefix():
    sc = parse_scenario({"model": {"preset": "llama-3.2-1b"}, "hardware": {"preset": "l40s"},
                         "workload": {"generator": "random", "num_requests": 3,
                                      "random_prefix_len": 100, "random_input_len": 50}})
    a, b, _ = build_requests(sc)
    assert len(a.prompt) == len(b.prompt) == 150
    assert a.prompt.window(0, 100) == b.prompt.window(0, 100)
    assert not set(a.prompt.window(100, 150)) & set(b.prompt.window(100, 150))
    assert a.max_tokens == 128  # vLLM's default --random-output-len


def test_centered_ratio_one_and_clusters_are_refused():
    base = {"model": {"preset": "llama-3.2-1b"}, "hardware": {"preset": "l40s"}}
    with pytest.raises(ConfigError, match="random_range_ratio"):
        parse_scenario({**base, "workload": {"generator": "random", "random_range_ratio": 1.0}})
    with pytest.raises(ConfigError, match="workload.max_concurrency"):
        parse_scenario({**base, "workload": {"max_concurrency": 4}, "cluster": {"replicas": 2}})


def test_parse_bench_command():
    b = parse_bench(shlex.split(
        "vllm bench serve --model m --dataset-name random --random-input-len 8192 "
        "--random-output-len=1024 --random-range-ratio 0.8 --num-prompts 320 "
        "--max-concurrency 32 --num-warmups 64 --ignore-eos --seed 7 --base-url http://x:8000"))
    got = {k: v for k, (v, _) in b.workload.items()}
    assert got == {"random_input_len": 8192, "random_output_len": 1024, "random_range_ratio": 0.8,
                   "num_requests": 320, "max_concurrency": 32, "num_warmups": 64,
                   "request_rate": math.inf, "generator": "random",
                   "random_range_rule": "centered"}
    assert b.seed == 7 and b.not_modelled == ["--model", "--base-url"]
    old = parse_bench(["python3", "benchmark_serving.py", "--burstiness", "4", "--request-rate", "2",
                       "--dataset-name", "random"])
    assert old.workload["random_range_rule"][0] == "below"
    assert old.workload["arrival_cv"][0] == 0.5  # gamma of shape 4: CV 1/2


@pytest.mark.parametrize("words,match", [
    ("vllm bench serve --max-concurency 4", "did you mean --max-concurrency"),
    ("vllm bench serve --dataset-name sharegpt", "not modelled"),
    ("vllm bench serve --num-prompts many", "expected an integer"),
    ("python benchmark_serving.py --num-prompts 10", "default dataset is sharegpt"),
])
def test_parse_bench_errors(words, match):
    with pytest.raises(ConfigError, match=match):
        parse_bench(shlex.split(words))


def test_lazy_decode_gives_the_step_by_step_run():
    sc, step_by_step = _run(max_concurrency=6, num_warmups=2)
    lazy = run(sc, build_requests(sc))
    key = [(r.req_id, r.arrival_s, r.first_token_s, r.finish_s) for r in step_by_step.requests]
    assert [(r.req_id, r.arrival_s, r.first_token_s, r.finish_s) for r in lazy.requests] == key


def test_frontend_latency_delays_each_request_by_exactly_that_much():
    # One request in flight at a time: the engine is idle whenever a request reaches it, so
    # the API server's 50 ms shifts every request's first token by 50 ms after its send and
    # changes nothing else (TPOT, tokens, the order).
    def ttfts(latency):
        sc = parse_scenario({**_raw(8), "cost": {"frontend_latency_s": latency}})
        rec = run(sc, build_requests(sc), check_invariants=True)
        rs = sorted(rec.requests, key=lambda r: r.seq)
        return ([r.first_token_s - r.arrival_s for r in rs],
                [(r.finish_s - r.first_token_s, r.num_output_tokens) for r in rs])

    t0, rest0 = ttfts(0.0)
    t1, rest1 = ttfts(0.05)
    assert [b - a for a, b in zip(t0, t1)] == pytest.approx([0.05] * 8, abs=1e-9)
    assert [d for d, _ in rest1] == pytest.approx([d for d, _ in rest0], abs=1e-9)
    assert [n for _, n in rest1] == [n for _, n in rest0]


def _raw(n: int) -> dict:
    return {"model": {"preset": "llama-3.2-1b"}, "hardware": {"preset": "l40s"},
            "engine": {"num_gpu_blocks": 2000, "max_model_len": 4096},
            "workload": {"generator": "random", "num_requests": n, "request_rate": math.inf,
                         "random_input_len": 300, "random_output_len": 40,
                         "random_range_ratio": 0.5, "max_concurrency": 1}}
