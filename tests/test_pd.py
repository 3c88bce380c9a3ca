"""P/D disaggregation (kvsim.kv.nixl, kvsim.pd): NixlConnector's scheduler rules on cases
worked by hand from vLLM 0.33's code (nixl/{base,pull}_scheduler.py, scheduler.py; see
../shared/reference/vllm-connectors.md §2), each also run through two of vLLM's own
Schedulers by kvsim/oracle/pd_driver.py, which agreed; recorded fuzzed pairs
(tests/fixtures/pd-vllm-*.json.gz, from tests/fixtures_make.py --pd) replayed; and the timed
cluster (the proxy, the decider, the reads over the link) on numbers worked by hand.

The pair protocol (``replay.drive_pd``, ``pd_driver.py``): in each tick the prefill side
makes one EngineCore step, then the decode side; a request the prefill side finished in
tick t joins the decode side in tick t + 1; a read the decode side's call c posts is done
at its call c + transfer_delay, and the prefill side frees the blocks at its next step."""

import gzip
import json
from pathlib import Path

import pytest

from kvsim.assemble import cost_inputs
from kvsim.config import parse_scenario
from kvsim.cost import COST_MODELS
from kvsim.engine import run
from kvsim.errors import ConfigError
from kvsim.metrics import requests_csv, summarize
from kvsim.oracle.replay import compare_pd, drive_pd
from kvsim.workload import iter_requests

A = list(range(1000, 1064))
FIXTURES = sorted((Path(__file__).parent / "fixtures").glob("pd-vllm-*.json.gz"))


def eng(**kw):
    return {"block_size": 16, "num_gpu_blocks": 64, "max_model_len": 256, **kw}


def steps(result, side):
    return [(s["tick"], s["scheduled"]) for s in result[side]["steps"]]


def test_the_prefill_holds_its_blocks_until_the_decode_side_has_read_them():
    # a: 40 tokens, 3 outputs, reads of 1 call. Tick 0: the prefill side computes all 40
    # (max_tokens 1) and finishes; request_finished keeps its 3 blocks (cdiv(40, 16)): 63 - 3
    # = 60 free. Tick 1: the decode side finds no local hit and reports 40 - 0 external
    # tokens, loaded asynchronously: a waits in WAITING_FOR_REMOTE_KVS with 3 blocks, its
    # read posted by call 1. Tick 2: call 2 reports the read done (finished_recving) and
    # notifies the prefill side. Tick 3: the prefill side frees a's blocks (finished_sending);
    # the decode side publishes the loaded blocks and, the load having reached N, gives the
    # last token back: 1 token, the first output. Ticks 4 and 5: outputs 2 and 3.
    sc = {"prefill": eng(), "decode": eng(), "transfer_delay": 1,
          "requests": [{"req_id": "a", "prompt_token_ids": A[:40], "max_tokens": 3}]}
    r = drive_pd(sc)
    assert steps(r, "prefill") == [(0, {"a": 40})]
    assert r["prefill"]["steps"][0]["num_free_blocks"] == 60
    assert steps(r, "decode") == [(3, {"a": 1}), (4, {"a": 1}), (5, {"a": 1})]
    d = r["decode"]["requests"]["a"]
    assert (d["cached_tokens"], d["external_cached_tokens"], d["join_tick"]) == (40, 40, 1)
    assert r["decode"]["totals"]["external_prefix_cache_hits"] == 40
    # Every block back in both pools at the end (63 usable).
    assert len(r["prefill"]["free_queue_end"]) == len(r["decode"]["free_queue_end"]) == 63


def test_multi_module_mtp_backs_off_and_a_full_local_hit_reads_nothing():
    # MTP with 3 modules reads 3 tokens past a prefill chunk: the backoff is 3 - 1 = 2. a (50
    # tokens): the prefill side computes 48 (the prompt cut by 2, max_tokens 1); the decode
    # side loads 48 and computes the last 2 itself. b repeats a's prompt at tick 20: the
    # prefill side hits 2 blocks of its 48 (capped at 47, block drop off) and computes 16;
    # the decode side holds a's 3 full blocks, a hit of 48 (capped at 49): 48 - 48 = 0
    # external tokens, nothing to read, the notification alone frees the prefill's blocks.
    mtp = {"method": "mtp", "num_speculative_tokens": 3, "mtp_num_layers": 3,
           "disable_eagle_block_drop": True}
    sc = {"prefill": eng(speculative=mtp), "decode": eng(speculative=mtp), "transfer_delay": 0,
          "requests": [{"req_id": "a", "prompt_token_ids": A[:50], "max_tokens": 2},
                       {"req_id": "b", "prompt_token_ids": A[:50], "max_tokens": 2,
                        "output_token_id": -2, "join_step": 20}]}
    r = drive_pd(sc)
    assert [s for _, s in steps(r, "prefill")] == [{"a": 48}, {"b": 16}]
    assert r["prefill"]["requests"]["b"]["cached_tokens"] == 32
    dec = r["decode"]["requests"]
    assert (dec["a"]["cached_tokens"], dec["a"]["external_cached_tokens"]) == (48, 48)
    assert (dec["b"]["cached_tokens"], dec["b"]["external_cached_tokens"]) == (48, 0)
    first = {rid: next(s for _, s in steps(r, "decode") if rid in s)[rid] for rid in "ab"}
    assert first == {"a": 2, "b": 2}


def _fixture_cases():
    for path in FIXTURES:
        data = json.loads(gzip.decompress(path.read_bytes()))
        for case in data["cases"]:
            yield pytest.param(data["vllm_version"], case,
                               id=f"{path.name.removesuffix('.json.gz')}-seed{case['scenario']['seed']}")


@pytest.mark.parametrize("version, case", list(_fixture_cases()))
def test_kvsim_matches_vllms_nixl_pair(version, case):
    from kvsim.oracle.fuzz import pd_to_driver

    assert compare_pd(drive_pd(pd_to_driver(case["scenario"]), version), case["vllm"]) == []


def test_the_recorded_pairs_exercise_the_hard_paths():
    cs = [c for _, c in (p.values for p in _fixture_cases())]
    assert len(cs) >= 200
    dec = [c["vllm"]["decode"]["requests"].values() for c in cs]
    # Local hits on the decode side shrink the pull; preemptions on both sides; deadlocks.
    assert sum(any((r["cached_tokens"] or 0) > (r["external_cached_tokens"] or 0) for r in d)
               for d in dec) >= 100
    assert sum(any(r["num_preemptions"] for r in d) for d in dec) >= 30
    assert sum(any(r["num_preemptions"] for r in c["vllm"]["prefill"]["requests"].values())
               for c in cs) >= 10
    assert sum(c["vllm"].get("stall") is not None for c in cs) >= 5
    assert sum(c["scenario"]["prefill"].get("speculative", {}).get("mtp_num_layers", 1) > 1
               for c in cs) >= 20
    assert {c["scenario"]["transfer_delay"] for c in cs} == {0, 1, 3}
    assert sum(c["scenario"]["prefill"].get("async_scheduling", False) for c in cs) >= 100


# -- the timed cluster -------------------------------------------------------------------

def _pd_scenario(requests, cluster=None, prefill=1, decode=1, **engine):
    lines = [{"timestamp": t, "input_length": n, "output_length": o, "hash_ids": h}
             for t, n, o, h in requests]
    return lines, {
        "model": {"preset": "llama-3.1-8b"}, "hardware": {"preset": "h100-sxm"},
        "engine": {"num_gpu_blocks": 4000, "max_model_len": 8192, "block_size": 16, **engine},
        "cluster": {"router": "round_robin", **(cluster or {}),
                    "deployment": [{"replicas": prefill, "kv_role": "kv_producer"},
                                   {"replicas": decode, "kv_role": "kv_consumer"}]},
        "run": {"seed": 0}}


def _run(tmp_path, requests, limits=None, **kw):
    lines, raw = _pd_scenario(requests, **kw)
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps(x) + "\n" for x in lines))
    raw["workload"] = {"kind": "trace", "path": str(trace), "format": "mooncake"}
    raw["run"].update(limits or {})
    sc = parse_scenario(raw, tmp_path / "s.toml")
    return sc, run(sc, list(iter_requests(sc)), check_invariants=True)


def test_a_read_takes_the_blocks_bytes_over_the_link_then_one_step(tmp_path):
    # One request of 1,024 tokens (2 Mooncake hash blocks of 512), 4 outputs. Llama-3.1-8B's
    # 16-token block on one GPU: 16 x 32 layers x 2 (K, V) x 8 KV heads x 128 x 2 bytes =
    # 2 MiB; the decode side reads all 64 blocks: 128 MiB over rdma_400g (50 GB/s, 20 us a
    # read): 20e-6 + 134,217,728 / 50e9 s. Its first token comes one decode step (the last
    # prompt token recomputed) after the read ends.
    sc, rec = _run(tmp_path, [(0, 1024, 4, [1, 2])])
    s = summarize(sc, rec)["pd"]
    xfer = 20e-6 + 64 * 2 * 2**20 / 50e9
    assert s["nixl_bytes_transferred"] == 64 * 2 * 2**20
    assert s["nixl_num_transfers"] == 1
    assert s["nixl_xfer_time_seconds"]["p50"] == pytest.approx(xfer)
    (r,) = rec.requests
    assert (r.prefill_replica, r.replica, r.external_cached_tokens, r.cached_tokens) == (0, 1, 1024, 1024)
    cost = COST_MODELS[sc.cost.model](cost_inputs(sc.replica(1)))
    one_step = cost.step_time_s([(1, 1023)], 1)
    assert r.first_token_s - r.prefill_done_s == pytest.approx(xfer + one_step)
    # The prefill instance ran the proxy's max_tokens = 1 request: its TTFT is the prefill.
    (p,) = rec.replicas[0].requests
    assert (p.num_output_tokens, p.first_token_s) == (1, r.prefill_done_s)


def test_the_decider_keeps_short_or_cached_prompts_from_the_prefill_pool(tmp_path):
    # non_cached_tokens 600: a (1,024 tokens, nothing cached) goes through the prefill pool;
    # b (512 tokens) is shorter than 600: decode-only; c shares a's first 512-token block and
    # adds 512 new tokens: the decode instance, having loaded a, holds a's 1,024 tokens, so
    # c's uncached part is 512 < 600: decode-only too, its 512-token hit local.
    sc, rec = _run(tmp_path, [(0, 1024, 2, [1, 2]), (5000, 512, 2, [7]), (10000, 1024, 2, [1, 3])],
                   cluster={"non_cached_tokens": 600})
    a, b, c = rec.requests
    assert (a.prefill_replica, b.prefill_replica, c.prefill_replica) == (0, None, None)
    assert (b.cached_tokens, b.external_cached_tokens) == (0, 0)
    assert (c.cached_tokens, c.external_cached_tokens) == (512, 0)
    s = summarize(sc, rec)["pd"]
    assert (s["num_through_prefill"], s["num_decode_only"]) == (1, 2)
    assert len(rec.replicas[0].requests) == 1


def test_a_pd_run_is_deterministic_and_reports_both_pools(tmp_path):
    reqs = [(i * 200, 512 * (1 + i % 3), 8, list(range(i % 4, i % 4 + 1 + i % 3))) for i in range(24)]
    sc, rec = _run(tmp_path, reqs, prefill=2, decode=2)
    _, rec2 = _run(tmp_path, reqs, prefill=2, decode=2)
    assert requests_csv(rec) == requests_csv(rec2)
    s = summarize(sc, rec)
    assert s["num_finished"] == 24 and s["stopped_by"] is None
    pd = s["pd"]
    assert (pd["prefill_pool"]["instances"], pd["decode_pool"]["instances"]) == ([0, 1], [2, 3])
    assert pd["prefill_pool"]["ttft_s"]["count"] == 24
    # Every request pulled what its decode instance had not cached, block by block.
    assert pd["nixl_bytes_transferred"] == sum(-(-r.external_cached_tokens // 16) * 2 * 2**20
                                               for r in rec.requests)
    header = requests_csv(rec).splitlines()[0]
    assert header.endswith("replica,prefill_replica,prefill_cached_tokens,prefill_done_s")


@pytest.mark.parametrize("change, where", [
    ({"engine": {"kv_role": "kv_producer"}, "cluster": None}, "engine.kv_role"),
    ({"deployment": [{"replicas": 2, "kv_role": "kv_producer"}]}, "cluster.deployment"),
    ({"deployment": [{"kv_role": "kv_producer"}, {"kv_role": "kv_consumer"}, {}]},
     "cluster.deployment"),
    ({"engine": {"vllm_version": "0.22.1"}}, "kv_role"),
    ({"engine": {"kv_connector_extra_config": {"kv_recompute_threshold": 8}}, "no_pd": True},
     "kv_connector_extra_config.kv_recompute_threshold"),
    ({"deployment": [{"kv_role": "kv_producer", "kv_offloading_size": 4.0},
                     {"kv_role": "kv_consumer"}]}, "kv_role"),
    ({"deployment": [{"kv_role": "kv_producer", "data_parallel_size": 2},
                     {"kv_role": "kv_consumer"}]}, "kv_role"),
    ({"cluster_keys": {"kv_transfer_link": "carrier_pigeon"}}, "cluster.kv_transfer_link"),
])
def test_bad_pd_settings_name_the_key(tmp_path, change, where):
    _, raw = _pd_scenario([])
    raw["workload"] = {"kind": "synthetic", "generator": "multi_turn", "num_requests": 4,
                       "request_rate": 1}
    raw["engine"].update(change.get("engine", {}))
    if "deployment" in change:
        raw["cluster"]["deployment"] = change["deployment"]
    if change.get("no_pd"):
        raw["cluster"]["deployment"] = [{"replicas": 2}]
    raw["cluster"].update(change.get("cluster_keys", {}))
    if "cluster" in change:
        del raw["cluster"]
    with pytest.raises(ConfigError) as e:
        parse_scenario(raw, tmp_path / "s.toml")
    assert e.value.where.split(": ")[-1].endswith(where), e.value.where


def test_a_run_limit_stops_the_prefill_instance_waiting_on_a_stopped_decode_instance(tmp_path):
    # The decode instance stops at run.max_steps (20 steps, within the first seconds) while
    # requests still arrive, one a second; the prefill instance, holding their blocks for
    # reads that never come, stops by the same limit, not as a deadlock.
    sc, rec = _run(tmp_path, [(i * 1000, 1024, 64, [1, 2 + i]) for i in range(6)],
                   limits={"max_steps": 20})
    assert [r.stopped_by for r in rec.replicas] == ["max_steps", "max_steps"]
    assert summarize(sc, rec)["stopped_by"] == "max_steps"
