"""kvsim against vLLM's own Scheduler, recorded.

tests/fixtures/vllm-<release>[-spec][-hybrid|-mamba][-async].json.gz hold fuzzed scenarios
(kvsim.oracle.fuzz) together with what that vLLM release's real v1 Scheduler did with them,
run on CPU with fake model outputs by kvsim/oracle/vllm_driver.py (regenerate with
tests/fixtures_make.py); "-spec" files add speculative decoding (drafts accepted per a
recorded list), "-hybrid" files several KV-cache groups, "-mamba" layouts with a Mamba group,
"-async" asynchronous scheduling (the batch queue of two), "-offload" native CPU offloading
(vLLM's OffloadingConnector, its transfers finished by a fake worker after 0-3 steps; each
request's external cached tokens and the external_prefix_cache counters are compared too);
"-regressions" files hold the cases
named in REGRESSIONS below. kvsim must reproduce every recorded field: each step's
scheduled tokens in order, preemptions, the block tables' fingerprint, free blocks and
prefix-cache stats; each request's cached tokens, preemptions and first/last steps; and the
final free-queue order.
"""

import gzip
import json
from pathlib import Path

import pytest

from kvsim.errors import ConfigError
from kvsim.oracle.replay import compare, drive
from kvsim.oracle.suite import ci_versions, resolve_versions
from kvsim.semantics import DEFAULT_VERSION, VERSIONS

FIXTURES = sorted((Path(__file__).parent / "fixtures").glob("vllm-*.json.gz"))


def cases():
    for path in FIXTURES:
        data = json.loads(gzip.decompress(path.read_bytes()))
        for case in data["cases"]:
            name = path.name.removesuffix(".json.gz")
            yield pytest.param(data["vllm_version"], case, id=f"{name}-seed{case['scenario']['seed']}")


@pytest.mark.parametrize("version, case", list(cases()))
def test_kvsim_matches_vllm_scheduler(version, case):
    result = drive(case["scenario"], version)
    assert compare(result, case["vllm"]) == []


def test_fixtures_exercise_the_hard_paths():
    cs = [c for _, c in (p.values for p in cases())]
    assert len(cs) >= 100
    vllm = [c["vllm"] for c in cs]
    assert sum(any(r["num_preemptions"] for r in v["requests"].values()) for v in vllm) >= 20
    assert sum(v["totals"]["prefix_cache_hits"] > 0 for v in vllm) >= 50
    assert sum(v["totals"]["preempted_hits"] > 0 for v in vllm) >= 10
    assert sum(c["scenario"]["engine"]["scheduling_policy"] == "priority" for c in cs) >= 10
    # Runs in which the release's own engine dies (0.20.0/0.20.1's capped window count).
    assert sum("engine_dead" in v for v in vllm) >= 5
    # The offload tier: external hits, lookups of preempted requests, transfers of 0-3 steps.
    off = [c for c in cs if "kv_offloading" in c["scenario"]["engine"]]
    assert sum(c["vllm"]["totals"]["external_prefix_cache_hits"] > 0 for c in off) >= 20
    assert sum(c["vllm"]["totals"]["external_preempted_requests"] > 0 for c in off) >= 10
    assert {c["scenario"]["engine"]["kv_offloading"]["transfer_delay"] for c in off} >= {0, 1, 3}
    assert sum(c["scenario"]["engine"]["kv_offloading"].get("eviction_policy") == "arc"
               for c in off) >= 40


# Mismatches found while building kvsim, each pinned to the recorded case that exposed it.
REGRESSIONS = {
    ("vllm-0.33.0-spec-hybrid", 3028): "0.32+ publish the prompt tail inside a coarse "
                                       "full-attention block (partial entry): freed to the tail",
    ("vllm-0.33.0-regressions", 4144): "async: the sliding-window admission cap uses "
                                       "max_in_flight_tokens = 2 x max_num_batched_tokens (seed "
                                       "4101 had it, in a pool vLLM's planner refuses at start-up)",
    ("vllm-0.33.0-spec-hybrid-async", 4105): "same (a preemption the wrong cap caused)",
    ("vllm-0.19.0-spec", 2014): "a draft reservation leaving exactly 0 tokens falls back to "
                                "max_num_batched_tokens (vLLM tests the value for truth)",
    ("vllm-0.33.0-regressions", 100163): "padding a one-token admission to 1 + k needs a running "
                                         "request scheduled this step, not an earlier admission",
    ("vllm-0.33.0-regressions", 100207): "same, in a hybrid layout",
    ("vllm-0.32.0-regressions", 100163): "same, on 0.32",
    ("vllm-0.32.0-spec", 2009): "0.32's priority policy ends the running pass when a request preempts "
                        "itself (0.33 continues)",
    ("vllm-0.22.1-regressions", 500001): "async before 0.32: a sliding window is freed behind all "
                                         "computed tokens (no num_in_flight_tokens)",
    ("vllm-0.19.0-regressions", 500001): "same, on 0.19",
    ("vllm-0.22.1-regressions", 500023): "async on 0.22: the sliding-window admission cap counts "
                                         "max_num_batched_tokens (no max_in_flight_tokens)",
    ("vllm-0.22.1-regressions", 600839): "0.22's priority preemption of a running request skipped "
                                         "this step (async) passes over the request after the "
                                         "current one (index moved back only for scheduled victims)",
    ("vllm-0.19.0-regressions", 600839): "same, on 0.19",
    ("vllm-0.22.1-spec-mamba", 4): "0.19/0.22 only round the candidate to full attention's block on "
                                   "later passes: an EAGLE Mamba group looked up one block further "
                                   "raises the hit above full attention's own",
    ("vllm-0.32.0-spec-mamba", 5): "0.32 re-keys the prompt's checkpoint state on every cache call, "
                                   "deferring a same-step sibling that hits it (0.33 skips keyed blocks)",
    ("vllm-0.32.0-regressions", 1020408): "under the EAGLE drop the prompt's Mamba checkpoint is one "
                                          "block earlier (Mamba follows the attention replay boundary)",
    ("vllm-0.32.0-regressions", 1020417): "same, async",
    ("vllm-0.33.0-regressions", 100242): "0.33 under the EAGLE drop: a sparse-retention window "
                                         "group also keeps the tail one of its blocks below a "
                                         "shared-prefix junction (0.32 does not)",
    ("vllm-0.33.0-regressions", 100243): "same, for a Mamba group's state",
    ("vllm-0.33.0-regressions", 800274): "multi-module MTP (k = 2): a sliding window keeps the "
                                         "k - 1 re-prefillable tokens below it "
                                         "(extra_retained_tokens)",
    ("vllm-0.33.0-regressions", 100272): "offloading: requests that finish in the same step have "
                                         "their chunks stored and their LRU recency committed in "
                                         "the order they finished (the driver fixes vLLM's "
                                         "hash-ordered finished_req_ids to that order)",
    ("vllm-0.33.0-regressions", 100016): "offloading with async scheduling (a KV consumer with a "
                                         "second batch in flight): a freed request's blocks wait "
                                         "for the last step that scheduled it, and a victim whose "
                                         "blocks would wait is not preempted (the step schedules "
                                         "nothing instead)",
    ("vllm-0.33.0-regressions", 100038): "a step that schedules nothing while a queued batch still "
                                         "carries a finished load is no deadlock",
    ("vllm-0.33.0-regressions", 100092): "offloading with EAGLE: an asynchronous load's admission "
                                         "reserves a verify step's blocks (1 + k + lookahead) for "
                                         "itself and for each request still prefilling",
    ("vllm-0.33.0-regressions", 100115): "same, with async scheduling",
    ("vllm-0.19.1-regressions", 100132): "0.19.1's sliding-window EAGLE lookup: a run may end only "
                                         "where its length before the drop is U-aligned (0.20+ "
                                         "after it): vLLM hits 32, the 0.20 rule 0",
    ("vllm-0.19.1-regressions", 100144): "same",
    ("vllm-0.19.1-regressions", 100176): "same",
    ("vllm-0.19.0-regressions", 100093): "0.19.0's sliding-window EAGLE lookup asserts on the first "
                                         "hit the window's scan finds (a block smaller than U): "
                                         "the engine dies in that step",
    ("vllm-0.19.0-regressions", 100086): "same, at step 71, async",
    ("vllm-0.20.0-regressions", 100092): "0.20.0 caps a window's count in every allocation check, "
                                         "not only the admission gate: a decode step counts 1 block, "
                                         "takes 2, and the pool raises (the engine dies)",
    ("vllm-0.20.0-regressions", 100066): "same, for a first chunk: counts the window's capped "
                                         "blocks, asks the pool for all 8",
    ("vllm-0.23.0-regressions", 100038): "0.23-0.28 read VLLM_PREFIX_CACHE_RETENTION_INTERVAL; "
                                         "0.23 sparsifies windows only (every Mamba state kept) "
                                         "and keeps no junction tail",
    ("vllm-0.24.0-regressions", 100007): "0.24/0.25 sparsify Mamba states too, still without "
                                         "junction tails",
    ("vllm-0.24.0-regressions", 100022): "same (Mamba alone with the variable set)",
    ("vllm-0.26.0-regressions", 100012): "0.26+ keep the shared-prefix junction's window tail",
    ("vllm-0.26.0-regressions", 100026): "same, for a Mamba state",
}


@pytest.mark.parametrize("key", sorted(REGRESSIONS), ids=lambda k: f"{k[0]}-seed{k[1]}")
def test_named_regressions(key):
    path = Path(__file__).parent / "fixtures" / f"{key[0]}.json.gz"
    data = json.loads(gzip.decompress(path.read_bytes()))
    case = next((c for c in data["cases"] if c["scenario"]["seed"] == key[1]), None)
    if case is None:  # pragma: no cover - the fixture must hold the case
        pytest.fail(f"{key} is not in {path.name}: {REGRESSIONS[key]}")
    assert compare(drive(case["scenario"], data["vllm_version"]), case["vllm"]) == [], REGRESSIONS[key]


def test_ci_rotation_runs_every_release():
    # CI's subset: the newest release and three others in turn; ceil(others / 3) turns in a
    # row cover every other release once.
    others = [v for v in VERSIONS if v != DEFAULT_VERSION]
    seen: list[str] = []
    for turn in range(-(-len(others) // 3)):
        picked = ci_versions(turn)
        assert picked[0] == DEFAULT_VERSION and len(picked) == 4
        seen += picked[1:]
    assert sorted(set(seen)) == sorted(others)
    assert resolve_versions("all") == list(VERSIONS)
    with pytest.raises(ConfigError, match="not a covered release: 0.18.1"):
        resolve_versions("0.33.0,0.18.1")
