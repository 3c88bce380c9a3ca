"""Clusters: replicas behind a router. One replica is a plain run; each policy's choices on
hand-built cases; the router's lookup is the replica's own and changes nothing; bad config."""

import copy
import csv
import json
import random
from dataclasses import asdict
from pathlib import Path

import pytest
from builders import make_request, make_scheduler, run_until_done

from kvsim import engine, metrics
from kvsim.assemble import cost_inputs
from kvsim.cli import main
from kvsim.cluster import Replica, Router
from kvsim.config import load_scenario, parse_scenario
from kvsim.cost import RooflineCost
from kvsim.errors import ConfigError
from kvsim.request import Status
from kvsim.schema import ClusterCfg
from kvsim.workload import build_requests

ROOT = Path(__file__).resolve().parents[1]

BASE = {"model": {"preset": "llama-3.2-1b"}, "hardware": {"preset": "l40s"},
        "engine": {"num_gpu_blocks": 160, "max_model_len": 2048, "max_num_batched_tokens": 512,
                   "max_num_seqs": 16},
        "workload": {"num_requests": 40, "request_rate": 30.0, "system_prompt_tokens": 96,
                     "num_users": 4, "user_history_tokens": 200, "input_tokens": 40,
                     "output_tokens": 60},
        "run": {"seed": 3}}


def variant(**sections):
    raw = copy.deepcopy(BASE)
    for name, table in sections.items():
        raw.setdefault(name, {}).update(table)
    return raw


# Plain scenarios a one-replica cluster must reproduce: synchronous and asynchronous
# scheduling, preemptions (a tight pool), EAGLE / ngram drafting, a hybrid layout, an older
# release, a Mamba group, priority scheduling, generators with and without session ids.
PLAIN = {
    "sync_preempting": variant(engine={"async_scheduling": False}),
    "async_eagle_multi_turn": variant(
        workload={"generator": "multi_turn", "turns": 3, "think_time_s": 0.2},
        engine={"num_gpu_blocks": 400}, speculative={"method": "eagle", "num_speculative_tokens": 2}),
    "ngram_agent": variant(
        workload={"generator": "agent", "turns": 3, "context_tokens": 300, "think_time_s": 0.1,
                  "output_tokens": 16},
        engine={"num_gpu_blocks": 400}, speculative={"method": "ngram", "num_speculative_tokens": 3}),
    "hybrid_sliding_window_mtp_0.22": variant(
        engine={"vllm_version": "0.22.1", "num_gpu_blocks": 600,
                "kv_groups": [{"kind": "full_attention", "block_size": 32},
                              {"kind": "sliding_window", "block_size": 16, "sliding_window": 64}]},
        speculative={"method": "eagle", "num_speculative_tokens": 1}),
    "mamba_align": variant(
        workload={"generator": "multi_turn", "turns": 3, "think_time_s": 0.2, "num_requests": 24},
        engine={"num_gpu_blocks": 200, "kv_groups": [{"kind": "full_attention", "block_size": 64},
                                                     {"kind": "mamba", "block_size": 64}]}),
    "priority_rag": variant(
        workload={"generator": "rag", "num_documents": 20, "documents_per_request": 2,
                  "document_tokens": 128}, engine={"scheduling_policy": "priority"}),
}


def run(raw):
    sc = parse_scenario(raw)
    return sc, engine.run(sc, build_requests(sc), check_invariants=True)


@pytest.mark.parametrize("name", PLAIN)
def test_one_replica_is_a_plain_run_under_every_router(name):
    raw = PLAIN[name]
    sc, plain = run(raw)
    want = metrics.summarize(sc, plain)
    assert plain.replicas is None and "replica" not in metrics.requests_csv(plain).split("\n")[0]
    for router in ("round_robin", "random", "least_loaded", "prefix_aware", "session_affinity"):
        csc, rec = run({**raw, "cluster": {"replicas": 1, "router": router}})
        rows = metrics.request_rows(rec)
        assert {r.pop("replica") for r in rows} == {0}
        assert rows == metrics.request_rows(plain), router
        assert [asdict(s) for s in rec.steps] == [asdict(s) for s in plain.steps], router
        got = metrics.summarize(csc, rec)
        per = got.pop("replicas")
        assert got.pop("cluster")["router"] == router
        assert got == want, router
        assert per[0] == {"replica": 0, **{k: v for k, v in want.items() if k not in (
            "kvsim_version", "vllm_version", "model", "hardware", "cost_model", "seed")}}


def test_round_robin_replicas_run_like_separate_engines():
    # Replicas are independent engines: round robin over two gives each the plain run of
    # every other request (the hash id space they share changes nothing).
    raw = variant(engine={"async_scheduling": False})
    sc, rec = run({**raw, "cluster": {"replicas": 2, "router": "round_robin"}})
    specs = build_requests(sc)
    for i in (0, 1):
        alone = engine.run(parse_scenario(raw), specs[i::2])
        mine = [r for r in metrics.request_rows(rec) if r.pop("replica") == i]
        assert mine == metrics.request_rows(alone)
        assert [asdict(s) for s in rec.replicas[i].steps] == [asdict(s) for s in alone.steps]
    assert len(rec.steps) == len(rec.replicas[0].steps) + len(rec.replicas[1].steps)


def test_progress_adds_the_replicas_up():
    sc = parse_scenario(variant(cluster={"replicas": 3}))
    calls = []
    rec = engine.run(sc, build_requests(sc), progress=lambda *a: calls.append(a))
    assert [c[0] for c in calls] == [256 * (i + 1) for i in range(len(rec.steps) // 256)]
    assert all(c[3] == 40 for c in calls) and calls[-1][2] <= 40
    assert [c[2] for c in calls] == sorted(c[2] for c in calls)


def test_the_router_decides_on_the_state_at_the_arrival_instant(tmp_path):
    # least_loaded, two synchronous replicas. At t = 0, X1 -> 0, X2 -> 1, X3 -> 0 (ties to
    # the lower index). X1 and X3 finish when replica 0's first step ends (t0); X2's longer
    # first step ends later. B arrives during both steps: then replica 0 holds two requests,
    # replica 1 one, so B goes to 1, though the first event after B's arrival is replica 0's
    # step end, after which replica 0 would be empty. C, arriving after t0, finds it empty.
    sc = parse_scenario(BASE)
    cost = RooflineCost(cost_inputs(sc))
    t0 = cost.step_time_s([(2, 0), (2, 0)], 2)  # X1 and X3, both sampling
    t1 = cost.step_time_s([(512, 0)], 0)  # X2's first chunk (max_num_batched_tokens 512)
    assert t0 < t1
    rows = [{"arrival_s": 0, "max_tokens": 1, "prompt_token_ids": [1, 2], "req_id": "X1"},
            {"arrival_s": 0, "max_tokens": 50, "prompt_segments": [[100, 1000]], "req_id": "X2"},
            {"arrival_s": 0, "max_tokens": 1, "prompt_token_ids": [3, 4], "req_id": "X3"},
            {"arrival_s": t0 / 2, "max_tokens": 1, "prompt_token_ids": [5], "req_id": "B"},
            {"arrival_s": (t0 + t1) / 2, "max_tokens": 1, "prompt_token_ids": [6], "req_id": "C"}]
    p = tmp_path / "t.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    _, rec = run(variant(engine={"async_scheduling": False}, workload={"kind": "trace", "path": str(p)},
                         cluster={"replicas": 2, "router": "least_loaded"}))
    assert [(r.steps[0].start_s, r.steps[0].duration_s) for r in rec.replicas] == [(0, t0), (0, t1)]
    assert [r.replica for r in rec.requests] == [0, 1, 0, 1, 0]
    assert rec.requests[3].join_step == 1  # B joins replica 1 when its first step ends


# -- policies on hand-built replicas --------------------------------------------------------


def cfg(router, load_metric="requests", load_weight=0.5, n=3):
    return ClusterCfg(replicas=n, router=router, load_metric=load_metric, load_weight=load_weight,
                      deployment=None, engines=(), prefill_router=router, non_cached_tokens=0,
                      kv_transfer_link="", kv_transfer_bandwidth_bytes_per_s=0.0,
                      kv_transfer_latency_s=0.0)


def replicas(n=3, num_gpu_blocks=100):
    reps = [Replica(i, make_scheduler(num_gpu_blocks=num_gpu_blocks, block_size=16))
            for i in range(n)]
    for rep in reps[1:]:
        rep.sched.kv.share_hashes(reps[0].sched.kv)
    return reps


def warm(rep, tokens):
    """Leave ``tokens``' full blocks cached (free, hashed) on the replica."""
    rep.sched.add_request(make_request(f"warm{rep.index}-{len(tokens)}", tokens))
    run_until_done(rep.sched)


def route(router, reqs):
    """Route requests arriving at t = 0 one by one; returns the replica of each."""
    out = []
    for r in reqs:
        router._reqs.append(r)
        router.route_until(0.0)
        out.append(r.replica)
    return out


def load(rep, n, tokens=100):
    """``n`` outstanding requests of ``tokens`` uncomputed tokens each (routed, not admitted)."""
    for _ in range(n):
        rep.receive(make_request("x", range(10**6, 10**6 + tokens)))


def test_round_robin_cycles_whatever_the_load():
    reps = replicas()
    load(reps[0], 5)
    router = Router(cfg("round_robin"), reps, [], seed=0)
    assert route(router, [make_request(str(i), [i]) for i in range(7)]) == [0, 1, 2, 0, 1, 2, 0]


def test_random_is_seeded_and_uniform():
    got = route(Router(cfg("random"), replicas(), [], seed=11),
                [make_request(str(i), [i]) for i in range(20)])
    rng = random.Random(11)
    assert got == [rng.randrange(3) for _ in range(20)]
    again = route(Router(cfg("random"), replicas(), [], seed=11),
                  [make_request(str(i), [i]) for i in range(20)])
    assert again == got


def test_least_loaded_by_requests_ties_go_to_the_lower_index():
    reps = replicas()
    router = Router(cfg("least_loaded"), reps, [], seed=0)
    # Equal load: 0; then 1 and 2 tie at zero: 1; then 2; then all at one: 0 again.
    assert route(router, [make_request(str(i), [i]) for i in range(4)]) == [0, 1, 2, 0]
    load(reps[1], 3)
    load(reps[2], 1)
    # Loads now 2, 4, 2 (a request routed and not yet admitted counts): 0 and 2 tie.
    assert route(router, [make_request("a", [1])]) == [0]
    assert route(router, [make_request("b", [1])]) == [2]


def test_least_loaded_forgets_finished_requests():
    reps = replicas(2)
    router = Router(cfg("least_loaded", n=2), reps, [], seed=0)
    first = make_request("first", range(40), max_tokens=1)
    assert route(router, [first]) == [0]
    for r in reps[0].take_inbox():  # as the engine loop hands it over and reports it done
        reps[0].sched.add_request(r)
    run_until_done(reps[0].sched)  # it finishes: replica 0 is empty again
    assert first.status is Status.FINISHED
    reps[0].finished([first])
    assert route(router, [make_request("next", [1])]) == [0]


def test_least_loaded_by_kv_usage_then_requests():
    reps = replicas()
    # Running requests hold blocks: 3 blocks on replica 0, 1 on replica 1, none on 2.
    for rep, n in ((reps[0], 48), (reps[1], 16)):
        rep.sched.add_request(make_request(f"hold{rep.index}", range(n), max_tokens=50))
        rep.sched.schedule()
    assert [rep.kv_usage() for rep in reps] == pytest.approx([3 / 99, 1 / 99, 0.0])
    router = Router(cfg("least_loaded", "kv_usage"), reps, [], seed=0)
    assert route(router, [make_request("a", [1])]) == [2]
    # Replica 2 now has the same usage (0) but one request routed: still 2 (usage first) ...
    assert route(router, [make_request("b", [1])]) == [2]
    # ... until equal usage, where fewer requests win.
    reps2 = replicas(2)
    load(reps2[0], 2)
    load(reps2[1], 1)
    assert route(Router(cfg("least_loaded", "kv_usage", n=2), reps2, [], seed=0),
                 [make_request("c", [1])]) == [1]


PREFIX = list(range(100, 164))  # 64 tokens: 4 full blocks of 16


def test_prefix_aware_follows_the_longest_cached_prefix():
    reps = replicas()
    warm(reps[1], PREFIX[:32])
    warm(reps[2], PREFIX)
    req = make_request("r", PREFIX + [7] * 20)
    assert [rep.cached_tokens(req) for rep in reps] == [0, 32, 64]
    assert route(Router(cfg("prefix_aware"), reps, [], seed=0), [req]) == [2]


def test_prefix_aware_trades_a_longer_prefix_against_a_long_queue():
    # Replica 0 holds the 64-token prefix but has 100 tokens pending; replica 1 is idle and cold.
    # w = 0.5: score 0 = 0.5 * 64 - 0.5 * 100 = -18 < score 1 = 0: replica 1.
    # w = 0.25: 0.75 * 64 - 0.25 * 100 = 23 > 0: replica 0. w = 0: the cache alone: 0.
    # Break-even at w = 64 / 164.
    for w, want in ((0.5, 1), (0.25, 0), (0.0, 0), (1.0, 1), (0.39, 0), (0.40, 1)):
        reps = replicas(2)
        warm(reps[0], PREFIX)
        load(reps[0], 1, tokens=100)
        req = make_request("r", PREFIX + [7] * 20)
        assert route(Router(cfg("prefix_aware", load_weight=w, n=2), reps, [], seed=0), [req]) == [want], w


def test_prefix_aware_ties_go_by_pending_then_requests_then_index():
    # Cold replicas, w = 0: every score is 0. Fewer pending tokens wins ...
    reps = replicas()
    load(reps[0], 1, tokens=10)
    load(reps[1], 2, tokens=4)
    load(reps[2], 1, tokens=9)
    router = Router(cfg("prefix_aware", load_weight=0.0), reps, [], seed=0)
    assert route(router, [make_request("a", [1, 2])]) == [1]  # 8 pending < 9 < 10
    # ... then fewer requests (10 pending tokens each, in two requests or in one) ...
    reps = replicas(2)
    load(reps[0], 2, tokens=5)
    load(reps[1], 1, tokens=10)
    assert route(Router(cfg("prefix_aware", load_weight=0.0, n=2), reps, [], seed=0),
                 [make_request("b", [1])]) == [1]
    # ... then the lower index.
    assert route(Router(cfg("prefix_aware", n=2), replicas(2), [], seed=0),
                 [make_request("c", [1])]) == [0]


def test_the_routers_lookup_is_the_replicas_own_and_changes_nothing():
    reps = replicas(1)
    rep = reps[0]
    warm(rep, PREFIX)
    warm(rep, list(range(500, 548)))
    pool = rep.sched.kv.pool
    before = (list(pool.free_queue), dict(pool.cached), [b.ref_cnt for b in pool.blocks])
    req = make_request("r", PREFIX + [7] * 5)
    assert rep.cached_tokens(req) == 64
    assert (list(pool.free_queue), dict(pool.cached), [b.ref_cnt for b in pool.blocks]) == before
    # Admission then gets exactly that hit.
    rep.sched.add_request(req)
    plan = rep.sched.schedule()
    assert req.cached_tokens == 64 and plan.prefix_cache.hits == 64
    # The lookup's own rule: never the whole prompt (the last token is recomputed).
    assert rep.cached_tokens(make_request("exact", PREFIX)) == 48


def test_the_routers_lookup_applies_the_eagle_drop():
    # EAGLE in 0.32 gives back the last matched block: the router sees what admission will hit.
    sc = parse_scenario(variant(engine={"vllm_version": "0.32.0", "async_scheduling": False},
                                speculative={"method": "eagle", "num_speculative_tokens": 2}))
    rep = Replica(0, engine.build_scheduler(sc))
    warm(rep, PREFIX)
    req = make_request("r", PREFIX + [7] * 20)
    assert rep.cached_tokens(req) == 48  # 4 cached blocks, the last dropped
    rep.sched.add_request(req)
    rep.sched.schedule()
    assert req.cached_tokens == 48


def test_session_affinity_is_sticky_and_places_new_sessions_by_load():
    reps = replicas()
    load(reps[0], 2)
    router = Router(cfg("session_affinity"), reps, [], seed=0)
    reqs = [make_request(str(i), [i]) for i in range(6)]
    for r, sid in zip(reqs, ["a", "b", "a", None, "c", "b"]):
        r.session_id = sid
    # Loads 2, 0, 0: a -> 1; b -> 2; a again -> 1 (sticky; loads 2, 2, 1); no session ->
    # least loaded: 2; c, new, at loads 2, 2, 2 -> 0; b -> 2 (sticky, though the most loaded).
    assert route(router, reqs) == [1, 2, 1, 2, 0, 2]


def test_generators_and_traces_carry_session_ids(tmp_path):
    sc = parse_scenario(variant(workload={"generator": "multi_turn", "turns": 2}))
    ids = {s.req_id: s.session_id for s in build_requests(sc)}
    assert ids["c0-t0"] == ids["c0-t1"] == "c0" and ids["c1-t1"] == "c1"
    assert {s.session_id for s in build_requests(parse_scenario(variant()))} <= {"u0", "u1", "u2", "u3"}
    rag = parse_scenario(variant(workload={"generator": "rag", "num_documents": 5,
                                           "documents_per_request": 1}))
    assert {s.session_id for s in build_requests(rag)} == {None}
    p = tmp_path / "t.jsonl"
    p.write_text('{"arrival_s": 0, "max_tokens": 2, "prompt_token_ids": [1], "session_id": 7}\n'
                 '{"arrival_s": 0, "max_tokens": 2, "prompt_token_ids": [1]}\n')
    tr = parse_scenario(variant(workload={"kind": "trace", "path": str(p)}))
    assert [s.session_id for s in build_requests(tr)] == ["7", None]
    p.write_text('{"arrival_s": 0, "max_tokens": 2, "prompt_token_ids": [1], "session_id": true}\n')
    with pytest.raises(ConfigError, match=r"t.jsonl:1: session_id must be a string or an integer"):
        build_requests(parse_scenario(variant(workload={"kind": "trace", "path": str(p)})))


def test_session_affinity_keeps_conversations_together_end_to_end():
    raw = variant(workload={"generator": "multi_turn", "turns": 4, "think_time_s": 0.3},
                  engine={"num_gpu_blocks": 400})
    _, rec = run({**raw, "cluster": {"replicas": 3, "router": "session_affinity"}})
    where = {}
    for r in rec.requests:
        where.setdefault(r.session_id, set()).add(r.replica)
    assert all(len(v) == 1 for v in where.values()) and len(where) == 10
    assert {r.replica for r in rec.requests} == {0, 1, 2}


# -- configuration, outputs, compare --------------------------------------------------------


def test_deployments_give_replicas_their_own_engines(tmp_path):
    raw = variant(cluster={"router": "least_loaded", "deployment": [
        {"replicas": 2, "num_gpu_blocks": 300, "max_num_seqs": 8}, {"max_num_seqs": 4}]})
    sc = parse_scenario(raw)
    assert sc.cluster.replicas == 3
    assert [(e.num_gpu_blocks, e.max_num_seqs) for e in sc.cluster.engines] == [
        (300, 8), (300, 8), (160, 4)]
    assert sc.replica(2).engine.max_num_batched_tokens == 512 and sc.replica(2).cluster is None
    p = tmp_path / "s.toml"
    p.write_text(_toml(raw))
    out = tmp_path / "out"
    assert main(["run", str(p), "--out", str(out), "-q"]) == 0
    again = tmp_path / "again"
    assert main(["run", str(out / "scenario.resolved.toml"), "--out", str(again), "-q"]) == 0
    for f in ("requests.csv", "steps.csv", "summary.json"):
        assert (out / f).read_bytes() == (again / f).read_bytes(), f
    summary = json.loads((out / "summary.json").read_text())
    assert [r["num_gpu_blocks"] for r in summary["replicas"]] == [300, 300, 160]
    assert summary["cluster"]["num_gpu_blocks_total"] == 760
    assert sum(r["num_requests"] for r in summary["replicas"]) == summary["num_requests"] == 40
    rows = list(csv.DictReader((out / "requests.csv").open()))
    assert {r["replica"] for r in rows} == {"0", "1", "2"}
    steps = list(csv.DictReader((out / "steps.csv").open()))
    assert [sum(s["replica"] == str(i) for s in steps) for i in range(3)] == [
        r["num_steps"] for r in summary["replicas"]]


def _toml(raw):
    lines = []
    for section, table in raw.items():
        if section == "cluster":
            continue
        lines.append(f"[{section}]")
        lines += [f"{k} = {json.dumps(v)}" for k, v in table.items()]
    if "cluster" in raw:
        lines.append("[cluster]")
        lines += [f"{k} = {json.dumps(v)}" for k, v in raw["cluster"].items() if k != "deployment"]
        deployments = raw["cluster"].get("deployment", ())
        if isinstance(deployments, dict):  # a table where a list of tables belongs
            lines.append("[cluster.deployment]")
            lines += [f"{k} = {json.dumps(v)}" for k, v in deployments.items()]
            deployments = ()
        for d in deployments:
            lines.append("[[cluster.deployment]]")
            lines += [f"{k} = {json.dumps(v)}" for k, v in d.items()]
    return "\n".join(lines) + "\n"


def test_a_replica_without_prefix_caching_joins_a_prefix_aware_cluster():
    # 0.33 EAGLE hashes blocks with one token of lookahead, but only where caching is on.
    raw = variant(engine={"num_gpu_blocks": 400},
                  speculative={"method": "eagle", "num_speculative_tokens": 2},
                  cluster={"router": "prefix_aware", "deployment": [
                      {"replicas": 2}, {"enable_prefix_caching": False}]})
    _, rec = run(raw)
    off = [r for r in rec.requests if r.replica == 2]
    assert off and all(r.cached_tokens == 0 for r in off)
    assert any(r.cached_tokens for r in rec.requests if r.replica != 2)
    assert rec.replicas[2].steps and all(s.prefix_cache_queries == 0 for s in rec.replicas[2].steps)


def test_compare_varies_cluster_keys(tmp_path):
    p = tmp_path / "s.toml"
    p.write_text(_toml(variant(cluster={"replicas": 2})))
    out = tmp_path / "cmp"
    assert main(["compare", str(p), "--out", str(out), "-q",
                 "--vary", "cluster.router=round_robin,prefix_aware"]) == 0
    rows = list(csv.DictReader((out / "compare.csv").open()))
    assert [r["variant"] for r in rows] == ["router=round_robin", "router=prefix_aware"]
    # Each user's history lives where its first request went: following it hits more.
    assert float(rows[1]["prefix_cache_hit_rate"]) > float(rows[0]["prefix_cache_hit_rate"])
    assert "replica" in (out / "router=prefix_aware" / "requests.csv").read_text().split("\n")[0]


@pytest.mark.parametrize("cluster, where", [
    ({"replicas": 0}, "cluster.replicas: must be at least 1, got 0"),
    ({"router": "least_busy"}, "cluster.router: must be one of"),
    ({"router": "prefix_aware", "load_weight": 1.5}, "cluster.load_weight: must be at most 1"),
    ({"load_weight": -0.1}, "cluster.load_weight: must be at least 0"),
    ({"load_metric": "tokens"}, "cluster.load_metric: must be one of"),
    ({"replicas": 2, "deployment": [{"replicas": 2}]}, "cluster.replicas: give replicas or"),
    ({"deployment": [{"replicas": 0}]}, "cluster.deployment[0].replicas: must be at least 1"),
    ({"deployment": [{"block_size": 32}]}, "cluster.deployment[0].block_size: every replica shares"),
    ({"deployment": [{}, {"num_gpu_block": 9}]}, "cluster.deployment[1].num_gpu_block: unknown key"),
    ({"deployment": [{"max_num_seqs": 1024}]}, "cluster.deployment[0].max_num_batched_tokens: 512 "
                                               "must be at least max_num_seqs"),
    ({"deployment": {"replicas": 2}}, "cluster.deployment: must be a list of tables"),
    ({"replica": 2}, "cluster.replica: unknown key (did you mean 'replicas'?)"),
])
def test_bad_cluster_config_one_line_exit_2(tmp_path, capsys, cluster, where):
    with pytest.raises(ConfigError):
        parse_scenario(variant(cluster=cluster))
    raw = variant()
    raw["cluster"] = cluster
    p = tmp_path / "s.toml"
    p.write_text(_toml(raw))
    out = tmp_path / "out"
    assert main(["run", str(p), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("kvsim: error: s.toml: ") and where in err, err
    assert not out.exists()


def test_validate_refuses_a_cluster(tmp_path, capsys):
    p = tmp_path / "s.toml"
    p.write_text(_toml(variant(cluster={"replicas": 2})))
    assert main(["validate", str(p)]) == 2
    assert capsys.readouterr().err == ("kvsim: error: s.toml: [cluster]: validate checks one engine "
                                       "against vLLM's Scheduler; remove the section (each replica "
                                       "is such an engine)\n")
    for target in ("vllm-engine", "vllm-server"):
        assert main(["validate", "--against", target, str(p), "--out", str(tmp_path / "o")]) == 2
        err = capsys.readouterr().err
        assert err.startswith("kvsim: error: s.toml: [cluster]: validation replays into one") and \
            err.count("\n") == 1, target
        assert not (tmp_path / "o").exists()


def test_the_mooncake_cluster_scenario_parses_up_to_its_trace(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSIM_TRACE_DIR", str(tmp_path))  # an empty trace cache
    with pytest.raises(ConfigError, match="workload.trace"):
        load_scenario(ROOT / "scenarios" / "mooncake_conversation_cluster.toml")
