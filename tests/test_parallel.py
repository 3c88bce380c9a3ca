"""A cluster's replicas on several processes (``kvsim.parallel``): every result file the same,
byte for byte, as on one process, for every routing policy and feature mix; the clusters it
does not take run on one process as before; ``--workers`` checked."""

import pytest
from test_cluster import PLAIN, variant

from kvsim import engine, metrics
from kvsim.cli import main
from kvsim.config import parse_scenario
from kvsim.workload import build_requests

pytestmark = pytest.mark.skipif(not __import__("kvsim.parallel").parallel.can_fork(),
                                reason="no fork start method here")


def _files(raw, workers: int) -> dict[str, str]:
    sc = parse_scenario(raw)
    rec = engine.run(sc, build_requests(sc), workers=workers)
    return metrics.result_files(sc, rec, metrics.summarize(sc, rec))


# Each policy and what it reads (prefix hits, pending tokens, requests, KV usage, sessions),
# on a tight pool (preemptions), with run limits, speculative decoding, hybrid and Mamba
# layouts, an older release, priority scheduling and replicas of their own deployments.
CLUSTERS = {
    "prefix_aware": variant(cluster={"replicas": 4, "router": "prefix_aware"}),
    "prefix_aware_arrivals_at_once": variant(
        workload={"request_rate": float("inf")}, cluster={"replicas": 3, "router": "prefix_aware"}),
    "least_loaded_kv_usage": variant(cluster={"replicas": 3, "router": "least_loaded",
                                              "load_metric": "kv_usage"}),
    "round_robin_time_limit": variant(run={"seed": 3, "max_sim_time_s": 1.0},
                                      cluster={"replicas": 3, "router": "round_robin"}),
    "random_step_limit": variant(run={"seed": 5, "max_steps": 40},
                                 cluster={"replicas": 2, "router": "random"}),
    "session_affinity": {**PLAIN["async_eagle_multi_turn"],
                         "cluster": {"replicas": 3, "router": "session_affinity"}},
    "ngram_agent_prefix_aware": {**PLAIN["ngram_agent"],
                                 "cluster": {"replicas": 2, "router": "prefix_aware"}},
    "hybrid_0.22_prefix_aware": {**PLAIN["hybrid_sliding_window_mtp_0.22"],
                                 "cluster": {"replicas": 3, "router": "prefix_aware"}},
    "mamba_prefix_aware": {**PLAIN["mamba_align"],
                           "cluster": {"replicas": 2, "router": "prefix_aware"}},
    "priority_rag": {**PLAIN["priority_rag"], "cluster": {"replicas": 3, "router": "least_loaded"}},
    "deployments": variant(cluster={"router": "prefix_aware", "deployment": [
        {"replicas": 2, "num_gpu_blocks": 300, "max_num_seqs": 8}, {"max_num_seqs": 4}]}),
}


@pytest.mark.parametrize("name", CLUSTERS)
def test_parallel_replicas_write_the_same_files(name):
    one = _files(CLUSTERS[name], 1)
    assert _files(CLUSTERS[name], 2) == one
    assert _files(CLUSTERS[name], 3) == one


def test_parallel_run_is_not_trivially_one_process(monkeypatch):
    """The comparison above compares something: with workers the parallel driver runs."""
    from kvsim import parallel
    calls = []
    real = parallel.run
    monkeypatch.setattr(parallel, "run", lambda *a, **k: calls.append(a[3]) or real(*a, **k))
    raw = CLUSTERS["prefix_aware"]
    assert _files(raw, 2) == _files(raw, 1)
    assert calls == [2]
    dp = variant(engine={"data_parallel_size": 2}, cluster={"replicas": 2})
    _files(dp, 2)  # (data-parallel ranks: one process)
    assert calls == [2]


def test_a_failing_worker_fails_the_run(monkeypatch):
    """A worker's exception (or its death) ends the run with an error, not a hang."""
    from kvsim import parallel

    def boom(*a):
        raise ValueError("boom in a worker")
    monkeypatch.setattr(parallel, "_serve", boom)
    with pytest.raises(RuntimeError, match="boom in a worker"):
        _files(CLUSTERS["prefix_aware"], 2)
    monkeypatch.setattr(parallel, "_serve", lambda *a: __import__("os")._exit(3))
    with pytest.raises(RuntimeError, match="ended without its results"):
        _files(CLUSTERS["prefix_aware"], 2)


def test_a_worker_that_failed_before_the_parent_wrote_is_reported_with_its_error():
    """The worker failed and closed its end before the parent's next "go": the parent's
    write fails, and the worker's traceback, already in the pipe, is what the run reports
    (it said only that a worker ended, in one of CI's runs)."""
    import multiprocessing as mp

    from kvsim import parallel

    parent, child = mp.get_context("fork").Pipe()
    child.send(parallel._Failure("ValueError: boom in a worker"))
    child.close()
    with pytest.raises(RuntimeError, match="boom in a worker"):
        parallel._send(parent, ("go", [], 0, 1))
    parent, child = mp.get_context("fork").Pipe()
    child.close()
    with pytest.raises(RuntimeError, match="ended without its results"):
        parallel._send(parent, ("go", [], 0, 1))


def test_progress_reaches_the_end(tmp_path):
    sc = parse_scenario(CLUSTERS["prefix_aware"])
    seen = []
    rec = engine.run(sc, build_requests(sc), progress=lambda *a: seen.append(a), workers=2)
    assert len(rec.steps) >= 256 and seen
    assert all(b[0] >= a[0] for a, b in zip(seen, seen[1:]))
    assert all(s[0] % 256 == 0 for s in seen)  # (counts the terminal bar redraws at)
    assert seen[-1][3] == len(rec.requests)


def test_workers_flag_is_checked(tmp_path, capsys):
    p = tmp_path / "s.toml"
    p.write_text('[model]\npreset = "llama-3.2-1b"\n')
    assert main(["run", str(p), "--workers", "0", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "--workers" in err and "at least 1" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "o").exists()


def test_prefix_aware_choices_on_workers_derived_by_hand(tmp_path):
    """Five requests on 2 replicas, prefix_aware with load_weight 0 (the cached prefix alone;
    ties: fewer pending tokens, fewer requests, lower index), block 16, each later request
    arriving after everything before it finished:
    A (256 tokens of run 0) and B (64 of run 10000) at t = 0: A to replica 0 (all tied), B to
    replica 1 (replica 0 has A's 256 tokens pending); C = A's 256 + 32 new: replica 0 holds
    A's 16 full blocks, a hit of 256; D = B's 64 + 16 new: replica 1, a hit of 64 (4 blocks);
    E shares nothing: all tied again, replica 0."""
    import json

    lines = [(0.0, [[0, 256]]), (0.0, [[10000, 64]]), (10.0, [[0, 256], [20000, 32]]),
             (20.0, [[10000, 64], [30000, 16]]), (30.0, [[50000, 48]])]
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"arrival_s": t, "max_tokens": 4, "prompt_segments": s,
                                         "req_id": name}) + "\n"
                             for name, (t, s) in zip("ABCDE", lines)))
    raw = variant(engine={"block_size": 16, "enable_prefix_caching": True},
                  workload={"kind": "trace", "path": str(trace), "format": "kvsim"},
                  cluster={"replicas": 2, "router": "prefix_aware", "load_weight": 0.0})
    for key in ("num_requests", "request_rate", "system_prompt_tokens", "num_users",
                "user_history_tokens", "input_tokens", "output_tokens"):
        raw["workload"].pop(key)
    sc = parse_scenario(raw, tmp_path / "s.toml")
    rec = engine.run(sc, build_requests(sc), workers=2)
    got = {r.req_id: (r.replica, r.cached_tokens) for r in rec.requests}
    assert got == {"A": (0, 0), "B": (1, 0), "C": (0, 256), "D": (1, 64), "E": (0, 0)}
