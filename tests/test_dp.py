"""Data parallel: vLLM's DP load balancer against each release's own code, MoE lockstep
against hand-derived cases, and dense ranks as independent engines."""

import json
import random
import subprocess
import sys
import types
from pathlib import Path

import pytest
import simpy

from kvsim import dp, engine
from kvsim.cli import main
from kvsim.config import parse_scenario
from kvsim.errors import ConfigError
from kvsim.oracle.validate import oracle_python
from kvsim.semantics import VERSIONS
from kvsim.workload import build_requests

ROOT = Path(__file__).resolve().parents[1]


def _streams(rules, seed: int) -> list[dict]:
    """Random request streams for one client: arrivals, finishes and coordinator publishes in
    time order (counts as the release publishes them)."""
    rng = random.Random(seed)
    out = []
    for case in range(24):
        n = rng.choice((2, 3, 4, 8))
        count = rng.choice((1, 1, 2, 3))
        events, t = [], 0.0
        live: list[tuple[float, str]] = []  # (finish time, id)
        for i in range(rng.randrange(20, 120)):
            t += rng.expovariate(20.0)
            while live and live[0][0] <= t:
                events.append((live[0][0], "finish", live.pop(0)[1]))
            if rng.random() < 0.2:
                counts = [[rng.randrange(6), rng.randrange(9)] + ([round(rng.random(), 3)]
                          if rules.score == "inflight" else []) for _ in range(n)]
                events.append((t, "publish", counts))
                t += 1e-4
            rid = f"c{case}-{i}"
            events.append((t, "route", rid))
            if rng.random() < 0.7:
                live.append((t + rng.expovariate(2.0), rid))
                live.sort()
        events += [(f, "finish", rid) for f, rid in live]
        out.append({"ranks": n, "client_count": count, "client_index": rng.randrange(count),
                    "events": sorted(events, key=lambda e: e[0])})
    return out


def _kvsim_routes(stream: dict, rules) -> list[int]:
    """kvsim.dp.Client on the same stream: publishes as the coordinator's history, each
    request with its finish time."""
    events = stream["events"]
    history = [(t, arg) for t, kind, arg in events if kind == "publish"]
    finish = {arg: t for t, kind, arg in events if kind == "finish"}
    coordinator = types.SimpleNamespace(history=history, ranks=[None] * stream["ranks"])
    client = dp.Client(stream["client_index"], stream["client_count"], coordinator, rules)
    out = []
    for t, kind, rid in events:
        if kind == "route":
            rank = client.choose(t)
            client.sent(rank, types.SimpleNamespace(finish_s=finish.get(rid)))
            out.append(rank)
    return out


@pytest.mark.parametrize("version", list(VERSIONS))
def test_balancer_routes_as_vllms_own_client(version, tmp_path):
    try:
        python = oracle_python(version, None)
    except ConfigError as exc:
        pytest.skip(str(exc))
    rules = VERSIONS[version].dp
    streams = _streams(rules, seed=int(version.replace(".", "")))
    wire = [{**s, "events": [[kind, arg] for _, kind, arg in s["events"]]} for s in streams]
    out = tmp_path / "routes.json"
    done = subprocess.run([str(python), str(ROOT / "kvsim" / "oracle" / "dp_lb_driver.py"), str(out)],
                          input=json.dumps(wire), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    theirs = json.loads(out.read_text())
    ours = [_kvsim_routes(s, rules) for s in streams]
    assert sum(map(len, ours)) > 1000
    for stream, a, b in zip(streams, ours, theirs):
        assert a == b, (stream["ranks"], stream["client_count"], stream["client_index"])


MOE = """
[model]
preset = "qwen3-30b-a3b"
[hardware]
preset = "h100-sxm"
interconnect_bandwidth_bytes_per_s = 450e9
[engine]
vllm_version = "{version}"
num_gpu_blocks = 300
max_model_len = 1024
data_parallel_size = 2
enable_expert_parallel = true
[workload]
num_requests = 1
request_rate = 1.0
system_prompt_tokens = 0
num_users = 1
user_history_tokens = 0
input_tokens = 100
output_tokens = 40
"""


@pytest.mark.parametrize("version, tail", [("0.33.0", 8), ("0.32.0", 8), ("0.22.1", 24), ("0.19.0", 24)])
def test_moe_ranks_step_in_waves_until_the_release_all_reduce(tmp_path, version, tail):
    # One request (100-token prompt, 40 tokens out) reaches rank 0: it runs 40 steps (the
    # prefill and 39 decodes) while rank 1 runs dummy batches beside it. The wave ends at the
    # first all-reduce that finds no work: 0.32+ reduces at steps 1, 16, 32, 48, so at 48
    # (8 dummy steps after the last real one); 0.19 / 0.22 every 32 steps, so at 64 (24 after).
    (tmp_path / "s.toml").write_text(MOE.format(version=version))
    assert main(["run", str(tmp_path / "s.toml"), "--out", str(tmp_path / "o"), "-q"]) == 0
    s = json.loads((tmp_path / "o" / "summary.json").read_text())
    ranks = {r["dp_rank"]: (r["num_steps"], r["num_dummy_steps"]) for r in s["replicas"]}
    assert ranks == {0: (40, tail), 1: (0, 40 + tail)}
    # In lockstep, each step starts and ends on both ranks at once.
    steps = (tmp_path / "o" / "steps.csv").read_text().splitlines()
    assert steps[0].startswith("replica,dp_rank,step,start_s,duration_s")


def test_each_gpu_holds_its_share_of_the_experts():
    # Qwen3-30B-A3B's config.json: 48 MoE layers of 128 experts, each gate, up and down
    # projections of 2048 x 768, in bf16: 2 x 48 x 128 x 3 x 2048 x 768 bytes of routed experts.
    # vLLM's FusedMoE splits them over the DP x TP GPUs, so with 2 ranks each GPU holds half.
    from kvsim.layout import estimate_kv_cache_bytes

    sc = parse_scenario(__import__("tomllib").loads(MOE.format(version="0.33.0")))
    routed = 2 * 48 * 128 * 3 * 2048 * 768
    assert sc.model.routed_expert_bytes == routed
    args = (sc.model, 80 * 2**30, 0.9, 1, 2048, 128)
    one, two = (estimate_kv_cache_bytes(*args, dp=n)[1]["weights_bytes"] for n in (1, 2))
    assert one == sc.model.weight_bytes and one - two == routed // 2


class _Cost:
    def __init__(self, moe_per_token):
        self.moe_per_token = moe_per_token

    def step_time_s(self, chunks, num_sampled, decodes=None):
        return 0.003

    def moe_time_s(self, tokens, ranks=1):
        return self.moe_per_token * min(tokens, 40) / ranks


def test_a_lockstep_step_lasts_as_long_as_the_slowest_rank():
    # Rank 0 runs 10 ms with 4 ms of MoE over its 30 tokens; rank 1 a dummy batch (3 ms, 1
    # token). Together 31 tokens: each rank's MoE over 31 tokens on half the experts, so
    # rank 0: 10 − 4 + 31 × (4/30 ms... ) — the fake's MoE is 0.1333 ms a token up to 40:
    # 31 tokens → 4.1333 ms, halved 2.0667 ms: rank 0 8.0667 ms, rank 1 3 − 0.1333 + 2.0667 =
    # 4.9333 ms; plus the exchange: 2 × 2 layers × (1 µs + 31 × 10 ns) = 5.24 µs.
    env = simpy.Environment()
    per = 0.004 / 30
    costs = [_Cost(per), _Cost(per)]
    exchange = types.SimpleNamespace(time_s=lambda t: 2 * 2 * (1e-6 + t * 1e-8))
    step = dp.Lockstep(env, costs, exchange, VERSIONS["0.33.0"].dp, busy=lambda i: i == 0)
    ends = []

    def rank0():
        yield from step.step(0, 0.010, 0.004, 30)
        ends.append(env.now)

    def rank1():
        yield env.timeout(0)
        yield from step.step(1, *step.dummy(1))
        ends.append(env.now)
    env.process(rank0())
    env.process(rank1())
    env.run()
    want = 0.010 - 0.004 + 31 * per / 2 + 2 * 2 * (1e-6 + 31e-8)
    assert ends == [pytest.approx(want, abs=1e-15)] * 2


DENSE = """
[model]
preset = "llama-3.2-1b"
[hardware]
preset = "l40s"
[engine]
vllm_version = "{version}"
num_gpu_blocks = 300
max_model_len = 1024
max_num_seqs = 4
data_parallel_size = {dp}
[workload]
num_requests = 12
request_rate = inf
system_prompt_tokens = 0
num_users = 12
user_history_tokens = 0
input_tokens = 64
output_tokens = 20
"""


@pytest.mark.parametrize("version", ["0.19.0", "0.33.0"])
def test_dense_ranks_are_independent_engines(version):
    # 12 requests at t = 0 over 2 ranks of a dense model, taken in turn by vllm serve's
    # default 2 API servers, whose clients start their scans at ranks 0 and 1 and see no
    # counts yet (the coordinator's first publish, all zeros). Client 0 sends request 0 to
    # rank 0 (a tie, the scan's first), client 1 request 1 to rank 1 (its own start); then
    # client 0's local count for rank 0 (0.19: waiting + 2, score 8 against 0; 0.33: in-flight
    # 1, score 2 against 0, its start now at rank 1) sends request 2 to rank 1, and client 1's
    # request 3 to rank 0: ranks 0, 1, 1, 0 over and over, 6 each. Each rank then runs exactly
    # as one engine given its own 6 requests: no dummy steps, no lockstep.
    sc = parse_scenario(__import__("tomllib").loads(DENSE.format(version=version, dp=2)))
    rec = engine.run(sc, build_requests(sc), check_invariants=True)
    assert [r.dp_rank for r in rec.requests] == [0, 1, 1, 0] * 3
    lone = parse_scenario(__import__("tomllib").loads(DENSE.format(version=version, dp=1)))
    for rank, mine in enumerate(rec.replicas):
        assert mine.num_dummy_steps == 0
        specs = [s for i, s in enumerate(build_requests(lone)) if (i % 4 in (1, 2)) == rank]
        alone = engine.run(lone, specs, check_invariants=True)
        assert [(s.start_s, s.duration_s, s.num_scheduled_tokens) for s in mine.steps] == \
            [(s.start_s, s.duration_s, s.num_scheduled_tokens) for s in alone.steps]


def test_expert_parallel_needs_experts(tmp_path, capsys):
    (tmp_path / "b.toml").write_text(DENSE.format(version="0.33.0", dp=2).replace(
        "data_parallel_size = 2", "data_parallel_size = 2\nenable_expert_parallel = true"))
    assert main(["run", str(tmp_path / "b.toml"), "--out", str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "engine.enable_expert_parallel" in err and "no experts" in err
    assert not (tmp_path / "b").exists()


if __name__ == "__main__":
    sys.exit(pytest.main([__file__]))


def test_cluster_replicas_are_dp_groups(tmp_path):
    # Two replicas behind round_robin, each of 2 ranks: requests alternate between replicas,
    # and inside each its own balancer (2 API servers) deals them 0, 1, 1, 0 as above.
    text = DENSE.format(version="0.33.0", dp=2) + '[cluster]\nreplicas = 2\nrouter = "round_robin"\n'
    (tmp_path / "s.toml").write_text(text)
    assert main(["run", str(tmp_path / "s.toml"), "--out", str(tmp_path / "o"), "-q"]) == 0
    from kvsim import plots

    run = plots.Variant("x", tmp_path / "o")
    req = run.requests
    assert list(req["replica"]) == [0, 1] * 6
    assert [int(r) for r, rep in zip(req["dp_rank"], req["replica"]) if rep == 0] == [0, 1, 1, 0, 0, 1]
    s = json.loads((tmp_path / "o" / "summary.json").read_text())
    assert [(r["replica"], r["dp_rank"]) for r in s["replicas"]] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert s["cluster"]["num_gpu_blocks_total"] == 4 * 300
    # Inter-token latencies are taken engine by engine: they add up to each request's
    # first token to its last.
    values, weights, _ = plots.inter_token_latencies(run)
    assert float((values * weights).sum()) == pytest.approx(float((req["e2e_s"] - req["ttft_s"]).sum()))


def test_the_coordinator_stops_at_the_runs_time_limit_and_holds_a_repeat_once():
    # Nothing changes: vLLM's coordinator republishes the same counts every 5 s
    # (REPEAT_INTERVAL_S). Under run.max_sim_time_s = 12 it publishes at 0, 5, 10 and, its
    # wait begun before the limit, 15, then stops, even while an engine step runs far past the
    # limit (a bad-input case: 1,024 ranks and a 10^7 s step made 2 million publishes of 1,024
    # counts before); the repeats share the first publish's counts.
    env = simpy.Environment()
    ranks = [dp.Rank(i, None) for i in range(3)]
    coordinator = dp.Coordinator(env, ranks, VERSIONS["0.33.0"].dp, moe=True,
                                 done=lambda: False, until=12.0)
    env.process(coordinator.run())
    env.run(until=1e7)
    assert [t for t, _ in coordinator.history] == [0.0, 5.0, 10.0, 15.0]
    assert all(c is coordinator.history[0][1] for _, c in coordinator.history)
