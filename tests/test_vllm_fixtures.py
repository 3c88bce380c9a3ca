"""kvsim against vLLM's own Scheduler, recorded.

tests/fixtures/vllm-<release>[-spec][-hybrid].json.gz hold fuzzed scenarios (kvsim.oracle.fuzz)
together with what that vLLM release's real v1 Scheduler did with them, run on CPU with fake
model outputs by kvsim/oracle/vllm_driver.py (regenerate with tests/fixtures_make.py); "-spec"
files add speculative decoding (drafts accepted per a recorded list), "-hybrid" files several
KV-cache groups. kvsim must reproduce
every recorded field: each step's scheduled tokens in order, preemptions, the block tables'
fingerprint, free blocks and prefix-cache stats; each request's cached tokens, preemptions and
first/last steps; and the final free-queue order.
"""

import gzip
import json
from pathlib import Path

import pytest

from kvsim.oracle.replay import compare, drive

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
