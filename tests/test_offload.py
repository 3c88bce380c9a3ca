"""vLLM 0.33's native CPU offloading (kvsim.kv.offload) on cases worked by hand from the rules
(../shared/reference/vllm-connectors.md §1 and the connector's code); each case was also run
through vLLM's own OffloadingConnector by the oracle driver, which agreed. Transfers take
``transfer_delay`` scheduler calls, as the oracle's fake worker does: a load is submitted in
the call that carries it, a store in the call after, each reported done ``delay`` calls after
submission."""

import csv

import pytest

from kvsim.config import parse_scenario
from kvsim.engine import run
from kvsim.errors import ConfigError
from kvsim.kv.connector import ConnectorMeta, TimedWorker, TransferJob
from kvsim.kv.offload import CPUOffloadingManager, _Access, num_cpu_chunks
from kvsim.metrics import requests_csv, summarize
from kvsim.oracle.fuzz import random_scenario
from kvsim.oracle.replay import build, drive
from kvsim.workload import iter_requests

A = list(range(1000, 1064))  # 64 tokens: 4 blocks of 16
B = list(range(5000, 5170))  # 170 tokens


def engine(num_gpu_blocks, max_model_len, cpu_chunks, delay=0, **extra):
    return {"block_size": 16, "num_gpu_blocks": num_gpu_blocks, "max_model_len": max_model_len,
            "kv_offloading": {"cpu_chunks": cpu_chunks, "transfer_delay": delay, **extra}}


def req(rid, tokens, max_tokens, join=0):
    return {"req_id": rid, "prompt_token_ids": tokens, "max_tokens": max_tokens, "join_step": join}


def test_cpu_tier_serves_the_tail_the_gpu_evicted():
    # a (64 tokens, 3 outputs) holds blocks 1-5 and stores its 4 prompt chunks. Freed tail
    # first: block 5 (no hash) to the queue's front, then 4, 3, 2, 1 to its back. b (160
    # tokens) takes 10 blocks at admission and 1 for its first decode token: 5..13, then 4
    # and 3, evicting a's 4th and 3rd blocks. c = a's prompt + 3 tokens hits blocks 1-2 on
    # the GPU (32) and a's chunks 3-4 on the CPU (32): 64 cached, 32 of them external.
    sc = {"engine": engine(14, 208, 8),
          "requests": [req("a", A, 3), req("b", B[:160], 3, 6), req("c", A + [7, 8, 9], 3, 12)]}
    out = drive(sc)
    c = out["requests"]["c"]
    assert (c["cached_tokens"], c["external_cached_tokens"]) == (64, 32)
    # Queries beyond the local hit: a 64, b 160, c 67 - 32; hits: c's 32.
    assert out["totals"]["external_prefix_cache_queries"] == 64 + 160 + 35
    assert out["totals"]["external_prefix_cache_hits"] == 32


def test_a_prompt_wholly_in_the_cpu_tier_loads_all_of_it_and_recomputes_its_last_token():
    # b (170 tokens) needs all 11 usable blocks, evicting every block of a. d = a's prompt:
    # no local hit; the lookup is capped at N = 64 (not N - 1), so all 4 chunks load, and
    # when the load is done the last token is given back and computed alone.
    sc = {"engine": engine(12, 176, 16),
          "requests": [req("a", A, 1), req("b", B, 1, 1), req("d", A, 2, 2)]}
    out = drive(sc)
    d = out["requests"]["d"]
    assert (d["cached_tokens"], d["external_cached_tokens"]) == (64, 64)
    first = next(s for s in out["steps"] if "d" in s["scheduled"])
    assert first["scheduled"]["d"] == 1


@pytest.mark.parametrize("delay, first_step", [(0, 3), (3, 9)])
def test_a_chunk_still_being_stored_defers_the_request(delay, first_step):
    # a's 4 chunks ride step 0 (call 1), are submitted in call 2 and done in call 2 + delay.
    # c (a's prompt, joining at step 1) hits 3 blocks on the GPU (48 = N - 1 rounded to
    # blocks) and looks up chunk 4 from there: pending until the store is done, so c waits;
    # then it loads that one chunk (the N cap again: 16 external tokens for a prompt the GPU
    # holds all but one token of), which is done `delay` calls later, and computes 1 token
    # in the next call. x keeps a step running in every call. delay 0: lookup hit in call 3,
    # c runs in call 4 (step 3); delay 3: store done in call 5, load in call 6, done in call
    # 9, c runs in call 10 (step 9).
    sc = {"engine": engine(40, 176, 16, delay),
          "requests": [req("a", A, 1), req("x", B[:40], 12), req("c", A, 2, 1)]}
    c = drive(sc)["requests"]["c"]
    assert (c["cached_tokens"], c["external_cached_tokens"]) == (64, 16)
    assert c["first_scheduled_step"] == first_step


def _stored(manager, keys, positions):
    acc = _Access(positions=dict(zip(keys, positions)))
    assert manager.prepare_store(keys, acc) == keys
    manager.complete_store(keys)
    return acc


def test_a_store_eviction_cannot_make_room_for_is_refused_whole():
    m = CPUOffloadingManager(8)
    _stored(m, [1, 2, 3, 4], [16, 32, 48, 64])
    # 10 new chunks, 4 free slots, 4 evictable: 6 evictions needed, refused, nothing changed.
    assert m.prepare_store(list(range(100, 110)), _Access()) is None
    assert sorted(m.policy.chunks) == [1, 2, 3, 4]
    m.check_invariants()


def test_lru_evicts_a_finished_requests_tail_first():
    m = CPUOffloadingManager(3)
    acc = _stored(m, [1, 2, 3], [16, 32, 48])
    m.on_request_finished(acc)  # recency committed tail first: 3 oldest, then 2, then 1
    _stored(m, [9], [16])
    assert sorted(m.policy.chunks) == [1, 2, 9]
    _stored(m, [10], [16])
    assert sorted(m.policy.chunks) == [1, 9, 10]
    m.check_invariants()


def test_a_chunk_being_loaded_is_not_evicted():
    m = CPUOffloadingManager(2)
    _stored(m, [1, 2], [16, 32])
    m.prepare_load([1], _Access())
    assert m.prepare_store([7, 8], _Access()) is None  # only chunk 2 is evictable
    assert m.prepare_store([7], _Access()) == [7]
    assert sorted(m.policy.chunks) == [1, 7]
    m.check_invariants()


@pytest.mark.parametrize("seed", range(40))
def test_fuzzed_offload_runs_keep_every_invariant(seed):
    # check_invariants on the pool and the tier after every step (the oracle compares the
    # results: tests/test_vllm_fixtures.py, python -m kvsim.oracle.suite --mixes offload).
    sc = random_scenario(seed, version="0.33.0", offload=True)
    out = drive(sc, check_invariants=True)
    assert all(r["finish_step"] is not None for r in out["requests"].values()) or out["stall"] is not None


@pytest.mark.parametrize("change, message", [
    ({"enable_prefix_caching": False}, "needs enable_prefix_caching"),
    ({"speculative": {"method": "draft_model", "num_speculative_tokens": 2}}, "draft model"),
])
def test_what_is_not_reproduced_yet_is_refused(change, message):
    with pytest.raises(ConfigError, match=message):
        build({**engine(40, 176, 8), **change}, "0.33.0")


def test_other_releases_refuse_offloading():
    with pytest.raises(ConfigError, match="not 0.22.1"):
        build(engine(40, 176, 8), "0.22.1")


# -- the timed worker, the scenario keys, a run -------------------------------------------

MiB = 1 << 20


def job(job_id, kind, blocks, req="r"):
    return TransferJob(job_id, req, kind, blocks)


def test_a_load_takes_its_bytes_over_the_link_and_loads_queue_behind_each_other():
    # 1 MiB blocks over 1 GiB/s: a block takes 1/1024 s; 10 µs a transfer.
    w = TimedWorker(MiB, float(1 << 30), 1e-5)
    assert w.begin_step(ConnectorMeta(load_jobs=(job(0, "load", 4, "a"), job(1, "load", 2, "b"))),
                        0.0) == 0.0
    a_done = 1e-5 + 4 / 1024
    b_done = a_done + 1e-5 + 2 / 1024
    assert w.next_done_s() == pytest.approx(a_done)
    assert w.end_step(a_done - 1e-9) is None
    out = w.end_step(b_done)
    assert out.completed_jobs == (0, 1) and out.finished_recving == {"a", "b"}
    assert (w.load_bytes, w.busy) == (6 * MiB, False)


def test_a_store_is_submitted_in_the_next_step_and_runs_beside_loads():
    w = TimedWorker(MiB, float(1 << 30), 0.0)
    w.begin_step(ConnectorMeta(store_jobs=(job(0, "store", 8),)), 0.0)
    assert w.next_done_s() is None and w.busy  # written by this step's forward pass first
    w.begin_step(ConnectorMeta(load_jobs=(job(1, "load", 8, "a"),)), 0.5)
    # The store and the load start together, one per direction.
    assert w.end_step(0.5 + 8 / 1024).completed_jobs == (0, 1)


def test_a_flushed_store_holds_its_step_until_it_is_written():
    w = TimedWorker(MiB, float(1 << 30), 0.0)
    w.begin_step(ConnectorMeta(store_jobs=(job(0, "store", 4),)), 0.0)
    start = w.begin_step(ConnectorMeta(store_jobs=(job(1, "store", 2),),
                                       jobs_to_flush=frozenset({0, 1})), 1.0)
    assert start == pytest.approx(1.0 + 6 / 1024)  # both written, one after the other
    assert w.end_step(start).completed_jobs == (0, 1)


def test_the_tier_holds_the_chunks_its_gib_buys():
    # Llama-3.1-8B: a 16-token block is 32 layers x 2 x 8 KV heads x 128 x 2 bytes = 2 MiB.
    assert num_cpu_chunks(64, 2 * MiB, 1, 1) == 32768
    assert num_cpu_chunks(64, 2 * MiB, 1, 4) == 8192
    # TP 2: each rank holds half the heads, and a chunk spans both ranks.
    assert num_cpu_chunks(64, MiB, 2, 1) == 32768
    # A chunk is rounded up to the page: 3 blocks of 1000 bytes take 4096.
    assert num_cpu_chunks(1, 1000, 1, 3) == (1 << 30) // 4096


def _scenario(**engine):
    return {"model": {"preset": "llama-3.1-8b"}, "hardware": {"preset": "h100-sxm"},
            "engine": {"num_gpu_blocks": 400, "max_model_len": 4096, **engine},
            "workload": {"kind": "synthetic", "generator": "multi_turn", "num_requests": 120,
                         "request_rate": 4}}


def test_a_run_with_a_cpu_tier_reports_vllms_counters():
    sc = parse_scenario(_scenario(kv_offloading_size=16.0))
    assert sc.engine.offload.num_chunks == 8192
    rec = run(sc, list(iter_requests(sc)), check_invariants=True)
    s = summarize(sc, rec)["kv_offload"]
    assert s["external_prefix_cache_hits"] > 0
    # Hits are whole blocks here (one block a chunk): every hit token was loaded once.
    hits = s["external_prefix_cache_hits"] + s["external_preempted_prefix_cache_hits"]
    assert s["kv_offload_load_bytes"] == hits // 16 * 2 * MiB
    assert s["external_cached_tokens"] == sum(r.external_cached_tokens for r in rec.requests)
    assert s["external_cached_tokens"] == s["external_prefix_cache_hits"]
    # Stores are whole blocks of prompts: at most every prompt block once.
    assert s["kv_offload_store_bytes"] % (2 * MiB) == 0
    assert s["kv_offload_store_bytes"] <= sum(r.num_prompt_tokens // 16 for r in rec.requests) * 2 * MiB
    # Same seed, same output.
    rec2 = run(sc, list(iter_requests(sc)))
    assert requests_csv(rec2) == requests_csv(rec)


def test_without_a_tier_the_run_is_unchanged_and_reports_none():
    sc = parse_scenario(_scenario())
    assert sc.engine.offload is None
    assert summarize(sc, run(sc, list(iter_requests(sc))))["kv_offload"] is None


@pytest.mark.parametrize("engine, where", [
    ({"kv_connector_extra_config": {"blocks_per_chunk": 2}},
     "engine.kv_connector_extra_config.blocks_per_chunk"),
    ({"kv_offloading_size": 8.0, "kv_offloading_backend": "lmcache"}, "kv_offloading_backend"),
    ({"kv_offloading_size": 8.0, "kv_connector_extra_config": {"block_size": 24}},
     "kv_connector_extra_config.block_size"),
    ({"kv_offloading_size": 8.0, "kv_connector_extra_config": {"block_size": 32,
                                                               "blocks_per_chunk": 2}},
     "kv_connector_extra_config"),
    ({"kv_offloading_size": 8.0, "kv_connector_extra_config": {"chunk": 2}},
     "kv_connector_extra_config.chunk"),
    ({"kv_offloading_size": 8.0, "vllm_version": "0.22.1"}, "kv_offloading_size"),
    ({"kv_offloading_size": 1e-6}, "kv_offloading_size"),
])
def test_bad_offload_settings_name_the_key(engine, where):
    with pytest.raises(ConfigError) as e:
        parse_scenario(_scenario(**engine))
    assert e.value.where.endswith(where)


def test_extra_config_block_size_sets_the_chunk():
    sc = parse_scenario(_scenario(kv_offloading_size=8.0,
                                  kv_connector_extra_config={"block_size": 64}))
    assert (sc.engine.offload.blocks_per_chunk, sc.engine.offload.num_chunks) == (4, 1024)


@pytest.mark.parametrize("tier, split", [(False, (48, 0)), (True, (48, 16))])
def test_a_kv_connector_turns_lookahead_hashes_off_and_the_tier_gives_the_block_back(tier, split):
    # EAGLE, 3 drafts, vLLM 0.33: c repeats a's 64-token prompt. The hit is capped at N - 1 =
    # 63 tokens: 3 blocks. Without a connector, 0.33's lookahead hashes keep all 3: 48 local.
    # Any KV connector turns them off (VllmConfig.num_hash_lookahead_tokens), so the EAGLE
    # drop takes the last matched block: 32 local. The tier then looks up from chunk 3,
    # queries one chunk more than the N cap allows (chunks 3 and 4), drops one as the EAGLE
    # group rule says, and loads chunk 3: 16 external, 48 in all.
    e = {"block_size": 16, "num_gpu_blocks": 40, "max_model_len": 176,
         "speculative": {"method": "eagle", "num_speculative_tokens": 3}}
    if tier:
        e["kv_offloading"] = {"cpu_chunks": 64}
    c = drive({"engine": e, "requests": [req("a", A, 1), req("c", A, 2, 3)]})["requests"]["c"]
    assert (c["cached_tokens"], c.get("external_cached_tokens") or 0) == split


def _reuse(m, key, position):
    """A request that loads ``key`` and finishes."""
    acc = _Access(positions={key: position})
    m.prepare_load([key], acc)
    m.complete_load([key])
    m.on_request_finished(acc)


@pytest.mark.parametrize("policy, kept", [("lru", [2, 3]), ("arc", [1, 3])])
def test_arc_keeps_a_reused_chunk_that_lru_evicts(policy, kept):
    # Two chunks. Request 1 stores chunk 1; request 2 loads it (a reuse) and finishes; request
    # 3 then stores chunks 2 and 3. LRU evicts the least recent: chunk 1. ARC has chunk 1 in
    # T2 (reused) and chunk 2 alone in T1 (T1's target is 0): it evicts chunk 2, into B1.
    m = CPUOffloadingManager(2, eviction_policy=policy)
    m.on_request_finished(_stored(m, [1], [16]))
    _reuse(m, 1, 16)
    acc = _stored(m, [2], [16])
    acc.positions[3] = 32
    assert m.prepare_store([3], acc) == [3]
    m.complete_store([3])
    assert sorted(m.policy.chunk_keys()) == kept
    m.check_invariants()
    if policy == "arc":
        assert list(m.policy.b1) == [2]
        # Offering chunk 2 again is a ghost hit in B1: T1's target grows by max(1, |B2|/|B1|).
        m.prepare_store([2], _Access(positions={2: 16}))
        assert m.policy.target_t1 == 1


def test_a_chunk_another_request_is_loading_defers_the_request():
    # b evicts all of a's blocks (as above). d1 and d2 repeat a's prompt in the same step:
    # d1 loads all 4 chunks (the N cap); d2 finds no GPU hit (d1's blocks are published only
    # once its load is done) and its chunks being loaded, so it waits. After d1's load, d2
    # hits d1's blocks on the GPU (3 of them: N - 1) and loads the 4th chunk itself: 48 + 16.
    sc = {"engine": engine(12, 176, 16, delay=1),
          "requests": [req("a", A, 1), req("b", B, 1, 1), req("d1", A, 2, 2), req("d2", A, 2, 2)]}
    out = drive(sc)
    d1, d2 = out["requests"]["d1"], out["requests"]["d2"]
    assert (d1["cached_tokens"], d1["external_cached_tokens"]) == (64, 64)
    assert (d2["cached_tokens"], d2["external_cached_tokens"]) == (64, 16)
    assert d2["first_scheduled_step"] > d1["first_scheduled_step"]
    assert out["totals"]["external_prefix_cache_hits"] == 64 + 16


@pytest.mark.parametrize("request_ranks, evicted", [(True, 3), (False, 1)])
def test_lru_evicts_a_running_requests_tail_first_in_033_and_its_head_first_in_032(
        request_ranks, evicted):
    # One request stores chunks 1, 2, 3 (positions 16, 32, 48) and is still running. 0.33
    # ranks them (request rank, -position): the tail is the least recent. 0.32 gives each a
    # fresh rank as it is stored: the head is.
    m = CPUOffloadingManager(3, request_ranks=request_ranks)
    _stored(m, [1, 2, 3], [16, 32, 48])
    _stored(m, [9], [16])
    assert evicted not in set(m.policy.chunk_keys())
    m.check_invariants()


def test_compare_varies_the_tier(tmp_path, capsys):
    from kvsim.cli import main

    (tmp_path / "s.toml").write_text(
        '[model]\npreset = "llama-3.2-1b"\n[hardware]\npreset = "l40s"\n'
        "[engine]\nnum_gpu_blocks = 160\nmax_model_len = 2048\n"
        "[workload]\ngenerator = \"multi_turn\"\nnum_requests = 40\nrequest_rate = 8.0\n")
    out = tmp_path / "cmp"
    assert main(["compare", str(tmp_path / "s.toml"), "--out", str(out),
                 "--vary", "engine.kv_offloading_size=0,4"]) == 0
    assert "CPU hit %" in capsys.readouterr().out
    rows = list(csv.DictReader((out / "compare.csv").open()))
    assert [r["variant"] for r in rows] == ["kv_offloading_size=0", "kv_offloading_size=4"]
    assert rows[0]["external_prefix_cache_hit_rate"] == ""
    assert float(rows[1]["external_prefix_cache_hit_rate"]) > 0


def test_the_resolved_scenario_keeps_the_tier():
    import tomllib

    from kvsim.scenario_text import resolved_toml

    sc = parse_scenario(_scenario(kv_offloading_size=8.0, kv_connector_extra_config={
        "blocks_per_chunk": 2, "eviction_policy": "arc", "store_threshold": 2}))
    text = resolved_toml(sc)
    assert ('kv_connector_extra_config = {blocks_per_chunk = 2, eviction_policy = "arc", '
            "store_threshold = 2}") in text
    assert parse_scenario(tomllib.loads(text)).engine == sc.engine


def test_a_store_threshold_stores_a_chunk_on_its_second_offer():
    # store_threshold = 2 (CPUOffloadingManager: offers are counted first, then only keys
    # offered at least twice are stored): the first offer stores nothing, the second does.
    m = CPUOffloadingManager(4, store_threshold=2)
    assert m.prepare_store([5], _Access(positions={5: 16})) == []
    assert m.prepare_store([5], _Access(positions={5: 16})) == [5]
    m.check_invariants()
