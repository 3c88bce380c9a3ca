"""Speed without a changed result: decode fast-forward, hash trimming and streamed results give
the bytes step-by-step simulation gives (step-by-step: ``check_invariants=True``, which also
checks the pool after every step and never fast-forwards)."""

import io
import json
import os
from unittest import mock

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvsim import engine, fastforward, metrics
from kvsim.config import parse_scenario
from kvsim.errors import ConfigError
from kvsim.kv.hashing import BlockHasher
from kvsim.request import ExplicitTokens, RequestSpec
from kvsim.semantics import VERSIONS
from kvsim.workload import build_requests
from tests.builders import make_request, synthetic_layer_profile

# Random engines per property test (``KVSIM_LAZY_EXAMPLES``: more by hand).
_EXAMPLES = int(os.environ.get("KVSIM_LAZY_EXAMPLES", "120"))


def scenario(**kw):
    return parse_scenario(sc_raw(**kw))


_LAYERS: list = []


def layer_profile() -> str:
    """A synthetic layer-profile folder for Llama 3.2 1B (made once per session)."""
    if not _LAYERS:
        import tempfile
        from pathlib import Path

        skew = {(0, "n<=8", "sr<=50%", "kvB<=1k", "kp=0"): 0.3}  # else alpha_default 0.05
        _LAYERS.append(synthetic_layer_profile(Path(tempfile.mkdtemp()) / "layers", skew=skew))
    return str(_LAYERS[0])


def sc_raw(version="0.33.0", async_scheduling=True, caching=True, model="llama-3.2-1b",
           hardware="l40s", cost=None, tp=1, **workload):
    return {"model": {"preset": model}, "hardware": {"preset": hardware},
          "cost": {k: layer_profile() if v == "SYNTHETIC" else v for k, v in (cost or {}).items()},
          "engine": {"vllm_version": version, "num_gpu_blocks": 400, "block_size": 16,
                     "max_model_len": 2048, "max_num_batched_tokens": 512, "max_num_seqs": 6,
                     "async_scheduling": async_scheduling, "enable_prefix_caching": caching,
                     "tensor_parallel_size": tp},
          "workload": {"kind": "synthetic", "generator": "shared_prefix", "num_requests": 60,
                       "request_rate": 40.0, "system_prompt_tokens": 40, "num_users": 3,
                       "user_history_tokens": 24, "input_tokens": 30, "output_tokens": 70,
                       **workload},
          "run": {"seed": 3}}


def outputs(sc, **kw):
    rec = engine.run(sc, build_requests(sc), **kw)
    return metrics.requests_csv(rec), metrics.steps_csv(rec), metrics.summary_json(
        metrics.summarize(sc, rec))


@pytest.fixture
def windows(monkeypatch):
    """Counts the steps planned lazily (``"lazy"``) and decoded in windows (``"window"``)."""
    done = {"lazy": 0, "window": 0}
    real_schedule, real_run = fastforward.LazyDecode.schedule, fastforward.Windows._run

    def schedule(self, step):
        plan = real_schedule(self, step)
        done["lazy"] += plan.num_lazy > 0
        return plan

    def run(*args, **kwargs):
        n = yield from real_run(*args, **kwargs)
        done["window"] += n
        return n

    monkeypatch.setattr(fastforward.LazyDecode, "schedule", schedule)
    monkeypatch.setattr(fastforward.Windows, "_run", run)
    return done


CASES = [
    dict(),  # the queue fills up: arrivals join during windows, completions end them
    dict(request_rate=2.0),  # light load: arrivals end windows
    dict(async_scheduling=False),
    dict(caching=False),
    dict(version="0.19.0"),
    dict(version="0.22.1", async_scheduling=False),
    dict(version="0.32.0"),
    dict(request_rate=float("inf"), output_tokens=200),  # a pool too small: preemptions
    dict(generator="multi_turn", turns=3, think_time_s=0.2),
    # Cost models: the roofline with tensor parallel all-reduces and a step overhead; the fitted
    # form (pure-decode terms, all-reduces) on a dense model at tp 2 and on an MoE model, whose
    # expert share 1 - (1 - k/N)^T is not linear in T.
    dict(model="llama-3.1-8b", hardware="h100-sxm", tp=2, cost={"step_overhead_s": 0.0031}),
    dict(model="llama-3.1-8b", hardware="rtx-pro-6000", tp=2,
         cost={"model": "fitted", "profile": "rtxpro6000-llama-3.1-8b-tp2",
               "step_overhead_s": 0.0007}),
    dict(model="qwen3-30b-a3b", hardware="rtx-pro-6000",
         cost={"model": "fitted", "profile": "rtxpro6000-qwen3-30b-a3b-tp1"}),
    # Interpolated layer profiles: every decode's context counts (the mean, and the longest and
    # shortest through the skew fit's bucket), in a window as step by step.
    dict(cost={"layer_profile": "SYNTHETIC"}),
]


def test_decode_windows_run_where_the_batch_is_full_or_alone(windows):
    """The cases above where a window can run: a full batch (arrivals wait), light load."""
    for case in CASES[:3]:
        windows["window"] = 0
        outputs(scenario(**case))
        assert windows["window"] > 0, case


@pytest.mark.parametrize("case", CASES, ids=[str(c) for c in CASES])
def test_lazy_decode_and_windows_give_the_bytes_of_step_by_step(case, windows):
    sc = scenario(**case)
    fast = outputs(sc)
    assert windows["lazy"] > 0, "no step was planned lazily: the case tests nothing"
    slow = outputs(sc, check_invariants=True)
    assert fast == slow
    # Streamed (as kvsim run writes), windows' steps written straight from their fields.
    req, steps = io.StringIO(), io.StringIO()
    results = metrics.Results(req, steps)
    rec = engine.run(sc, iter(build_requests(sc)), results=results)
    assert (req.getvalue(), steps.getvalue(), metrics.summary_json(results.summary(sc, rec))) == slow


@pytest.mark.parametrize("limit", [{"max_steps": 123}, {"max_sim_time_s": 0.9}])
@pytest.mark.parametrize("spec", [False, True], ids=["plain", "eagle"])
def test_a_run_limit_inside_a_window_stops_where_step_by_step_stops(limit, spec, windows):
    sc = scenario()
    raw = {**_raw(sc), "run": {"seed": 3, **limit}}
    if spec:
        raw = {**spec_raw(), "run": {"seed": 3, **limit}}
    sc = parse_scenario(raw)
    fast = outputs(sc)
    assert windows["window"] > 0
    assert fast == outputs(sc, check_invariants=True)
    assert engine.run(sc, build_requests(sc)).stopped_by == next(iter(limit))


def _raw(sc):
    e = sc.engine
    return {"model": {"preset": "llama-3.2-1b"}, "hardware": {"preset": "l40s"},
            "engine": {"vllm_version": e.vllm_version, "num_gpu_blocks": e.num_gpu_blocks,
                       "block_size": e.block_size, "max_model_len": e.max_model_len,
                       "max_num_batched_tokens": e.max_num_batched_tokens,
                       "max_num_seqs": e.max_num_seqs, "async_scheduling": e.async_scheduling},
            "workload": {"kind": "synthetic", "generator": "shared_prefix", "num_requests": 60,
                         "request_rate": 40.0, "system_prompt_tokens": 40, "num_users": 3,
                         "user_history_tokens": 24, "input_tokens": 30, "output_tokens": 70}}


def test_dropping_unused_hash_keys_changes_no_result(monkeypatch):
    # Prefix sharing and preemptions (re-lookups of a request's own hashes) in a small pool.
    sc = scenario(request_rate=float("inf"), output_tokens=200)
    kept = outputs(sc)
    monkeypatch.setattr(engine, "_TRIM_HASHES", 20)
    dropped = []
    real = BlockHasher.forget_all_but

    def spy(self, live):
        before = len(self)
        real(self, live)
        dropped.append(before - len(self))

    monkeypatch.setattr(BlockHasher, "forget_all_but", spy)
    assert outputs(sc) == kept
    assert sum(dropped) > 0


def test_a_dropped_key_comes_back_under_a_new_id_and_kept_chains_keep_theirs():
    h = BlockHasher(block_size=2)
    a = make_request("a", [1, 2, 3, 4, 5, 6], max_tokens=1)
    ids_a = list(h.block_hashes(a, 3))
    # Only a's third block is held: its ancestors stay so the chain is found again.
    h.forget_all_but({ids_a[2]})
    again = make_request("b", [1, 2, 3, 4, 5, 6], max_tokens=1)
    assert h.block_hashes(again, 3) == ids_a
    h.forget_all_but(set())
    assert len(h) == 0
    fresh = make_request("c", [1, 2], max_tokens=1)
    assert h.block_hashes(fresh, 1)[0] not in ids_a  # never an id something may still hold


def test_streamed_results_are_the_bytes_of_the_in_memory_ones():
    sc = scenario(request_rate=float("inf"), output_tokens=200)  # finishes out of order
    req, steps = io.StringIO(), io.StringIO()
    results = metrics.Results(req, steps)
    rec = engine.run(sc, iter(build_requests(sc)), results=results)
    assert rec.requests == [] and rec.steps == []
    mem_req, mem_steps, mem_summary = outputs(sc)
    assert (req.getvalue(), steps.getvalue()) == (mem_req, mem_steps)
    assert metrics.summary_json(results.summary(sc, rec)) == mem_summary


@pytest.mark.parametrize("case", CASES[-4:], ids=["roofline-tp2", "fitted-tp2", "fitted-moe",
                                                  "interpolated"])
def test_lazy_decodes_cost_what_their_chunks_cost(case):
    """``step_time_s`` and ``draft_time_s`` with decode chunks of one length given as sums
    (count, n, Σ(c + n), max(c + n), min(c + n)), as lazy decode and windows time them, are
    those of the chunks listed, bit for bit, for any contexts, beside prefill chunks or
    alone."""
    import random

    from kvsim.assemble import cost_inputs
    from kvsim.cost import COST_MODELS

    rng = random.Random(5)
    for k in (0, 1, 3):  # one-token decodes, and verify chunks of 1 + k (with a drafter)
        raw = sc_raw(**case)
        if k:
            raw["speculative"] = {"method": "eagle", "num_speculative_tokens": k}
        sc = parse_scenario(raw)
        cost = COST_MODELS[sc.cost.model](cost_inputs(sc))
        for count in (1, 2, 7, 64, 256):
            contexts = [rng.randrange(0, 40_000) for _ in range(count)]
            decodes = [(1 + k, c) for c in contexts]
            sums = (count, 1 + k, sum(c + 1 + k for c in contexts),
                    max(c + 1 + k for c in contexts), min(c + 1 + k for c in contexts))
            for prefills in ([], [(rng.randrange(2 + k, 9000), rng.randrange(0, 9000))
                                  for _ in range(3)]):
                num_sampled = count + len(prefills)
                listed = cost.step_time_s([*prefills, *decodes], num_sampled)
                assert cost.step_time_s(prefills, num_sampled, sums) == listed
                listed = cost.draft_time_s([*prefills, *decodes], num_sampled)
                assert cost.draft_time_s(prefills, num_sampled, sums) == listed
                assert not k or listed > 0


def test_a_clusters_replicas_decode_lazily_and_one_replica_matches_a_lone_run(windows):
    """Replicas behind a router decode lazily but never in windows (the router's arrivals
    share their clock); a one-replica cluster gives the lone engine's records."""
    from dataclasses import asdict

    sc = scenario()
    plain = engine.run(sc, build_requests(sc))
    assert windows["lazy"] > 0 and windows["window"] > 0
    windows.update(lazy=0, window=0)
    csc = parse_scenario({**sc_raw(), "cluster": {"replicas": 1, "router": "least_loaded"}})
    rec = engine.run(csc, build_requests(csc))
    assert windows["lazy"] > 0 and windows["window"] == 0
    rows = metrics.request_rows(rec)
    assert {r.pop("replica") for r in rows} == {0}
    assert rows == metrics.request_rows(plain)
    assert [asdict(s) for s in rec.steps] == [asdict(s) for s in plain.steps]


SWA = [{"kind": "full_attention", "block_size": 16},
       {"kind": "sliding_window", "block_size": 16, "sliding_window": 40}]
MAMBA = [{"kind": "full_attention", "block_size": 32},
         {"kind": "mamba", "block_size": 32, "prefill_checkpoint_alignment": 1}]


@pytest.mark.parametrize("router", ["prefix_aware", "least_loaded", "session_affinity"])
@pytest.mark.parametrize("case", [dict(), dict(async_scheduling=False, version="0.22.1"),
                                  dict(request_rate=float("inf"), output_tokens=200),
                                  dict(engine={"kv_groups": SWA}),
                                  dict(engine={"kv_groups": MAMBA, "block_size": 32})],
                         ids=["async", "sync", "preempting", "sliding-window", "mamba"])
def test_lazy_replicas_give_the_bytes_of_step_by_step(router, case, windows):
    """A router reads its replicas (pending tokens, KV usage, cached prefixes) at every
    arrival: lazily kept requests are brought up to date first, so every route, step and
    request is the one step-by-step simulation gives."""
    case = dict(case)
    extra = case.pop("engine", {})
    raw = sc_raw(**case)
    raw["engine"].update(extra)
    raw["workload"].update(num_requests=90, generator="multi_turn", turns=3, think_time_s=0.05)
    raw["cluster"] = {"replicas": 3, "router": router, "load_metric": "kv_usage"}
    sc = parse_scenario(raw)
    fast = outputs(sc)
    assert windows["lazy"] > 0
    assert fast == outputs(sc, check_invariants=True)


@pytest.mark.parametrize("spec", [False, True], ids=["plain", "eagle"])
@pytest.mark.parametrize("async_scheduling", [True, False])
def test_a_replicas_pending_tokens_count_its_lazy_members_as_they_are(async_scheduling, spec,
                                                                      monkeypatch):
    """At every read, the replica's pending tokens are those its requests' counters give once
    brought up to date (every member materialized: its lag applied; with speculative
    decoding, its path's acceptances)."""
    from kvsim.cluster import Replica

    real = Replica.pending_tokens
    reads = {"members": 0}

    def checked(self):
        got = real(self)
        lazy = self.sched.steady
        if lazy is not None and lazy.num_members:
            reads["members"] += 1
            for r in self.sched.running:
                if r.lz_sched is not None:
                    lazy._materialize(r)
        sched = self.sched
        want = self.handed_tokens + sum(max(0, r.num_tokens - r.num_computed_tokens)
                                        for q in (sched.waiting, sched.running, sched.kv_holding)
                                        for r in q)
        assert got == want
        return got

    monkeypatch.setattr(Replica, "pending_tokens", checked)
    version = "0.33.0" if async_scheduling else "0.22.1"
    raw = (spec_raw if spec else sc_raw)(async_scheduling=async_scheduling, version=version)
    raw["workload"].update(num_requests=90, generator="multi_turn", turns=3, think_time_s=0.05)
    raw["cluster"] = {"replicas": 3, "router": "prefix_aware"}
    outputs(parse_scenario(raw))
    assert reads["members"] > 50


@pytest.mark.parametrize("router", ["prefix_aware", "least_loaded", "session_affinity"])
@pytest.mark.parametrize("case", [dict(), dict(async_scheduling=False, version="0.22.1"),
                                  dict(request_rate=float("inf"), output_tokens=200,
                                       num_requests=60),
                                  dict(engine={"kv_groups": MAMBA, "block_size": 32})],
                         ids=["async", "sync", "preempting", "mamba"])
def test_speculative_lazy_replicas_give_the_bytes_of_step_by_step(router, case, windows):
    """Replicas keep speculative requests lazily too: every route, step and request as
    step-by-step simulation gives them (pending tokens read from the members' paths)."""
    raw = spec_raw(**case)
    raw["workload"].update(generator="multi_turn", turns=3, think_time_s=0.05)
    raw["cluster"] = {"replicas": 3, "router": router, "load_metric": "kv_usage"}
    sc = parse_scenario(raw)
    fast = outputs(sc)
    assert windows["lazy"] > 0
    assert fast == outputs(sc, check_invariants=True)


def test_block_contents_are_equal_exactly_when_the_tokens_are():
    """The canonical block content (a run of consecutive ids is its first id, a repeated id
    ``(id,)``) of prompts given as runs, as explicit ids, across the prompt/output boundary
    and of outputs alone."""
    from kvsim.request import ExplicitTokens, Request, RequestSpec, SegmentTokens, block_content

    rng = __import__("random").Random(11)
    reqs = []
    for n in range(200):
        segs = [(rng.choice([0, 5, 7, 100]) + rng.randrange(4), rng.randrange(1, 9))
                for _ in range(rng.randrange(1, 5))]
        prompt = SegmentTokens(segs)
        if n % 2:
            prompt = ExplicitTokens(prompt.window(0, len(prompt)))
        r = Request(RequestSpec(req_id=str(n), arrival_s=0.0, prompt=prompt, max_tokens=9), n)
        r.num_output_tokens = rng.randrange(0, 7)
        reqs.append(r)
    for size in (1, 2, 3, 5):
        for step in (1, size):
            seen: dict = {}
            back: dict = {}
            for r in reqs:
                for first in (0, r.num_prompt_tokens):  # from the start; outputs alone
                    count = (r.num_tokens - first - size) // step + 1
                    if count <= 0:
                        continue
                    got = r.block_contents(first, count, step, size)
                    windows = [r.token_window(first + k * step, first + k * step + size)
                               for k in range(count)]
                    for content, tokens in zip(got, windows):
                        assert content == block_content(tokens)
                        assert seen.setdefault(tokens, content) == content
                        assert back.setdefault(content, tokens) == tokens
                        run = tuple(range(tokens[0], tokens[0] + size))
                        assert isinstance(content, int) == (tokens == run)


@st.composite
def lazy_cases(draw):
    """A random engine (release, scheduling, budgets, a pool that may preempt) and requests with
    shared prefixes arriving together or spread out."""
    block_size = draw(st.sampled_from([16, 32, 48]))  # what vLLM's attention kernels take
    mml = draw(st.integers(24, 600))
    min_blocks = -(-mml // block_size) + 1
    chunked = draw(st.booleans())
    budget = draw(st.integers(8, 160))
    if not chunked:
        budget = max(budget, mml)
    engine_keys = {
        "vllm_version": draw(st.sampled_from(sorted(VERSIONS))),
        "num_gpu_blocks": draw(st.integers(min_blocks, min_blocks + 120)), "block_size": block_size,
        "max_model_len": mml, "max_num_batched_tokens": budget,
        "max_num_seqs": min(draw(st.integers(1, 24)), budget),
        "enable_chunked_prefill": chunked, "async_scheduling": draw(st.booleans()),
        "enable_prefix_caching": draw(st.booleans()),
        "long_prefill_token_threshold": draw(st.sampled_from([0, 0, 5, 17])),
        "scheduling_policy": draw(st.sampled_from(["fcfs", "priority"])),
        "scheduler_reserve_full_isl": draw(st.booleans())}
    prefixes = [tuple(draw(st.lists(st.integers(0, 2), max_size=50))) for _ in range(3)]
    spread = draw(st.sampled_from([0.0, 0.002, 0.02]))
    specs = []
    for i in range(draw(st.integers(1, 30))):
        body = draw(st.sampled_from(prefixes)) + tuple(draw(st.lists(st.integers(0, 2), max_size=40)))
        body = (body or (0,))[: mml - 1]
        specs.append(RequestSpec(f"r{i}", i * spread * draw(st.integers(0, 3)),
                                 ExplicitTokens(body), draw(st.integers(1, 120)),
                                 draw(st.integers(0, 2))))
    specs.sort(key=lambda s: s.arrival_s)
    return engine_keys, specs


def _run_and_pool(sc, specs, check_invariants):
    """A run's results and records, and its pool at the end: the free queue's order and each
    published hash's block, the hash as the contents it chains (decode windows and lazy
    members intern ids in another order than step by step); on a hybrid layout a key is its
    group and the contents of its fine or coarse hash."""
    built = []
    real_build = engine.build_scheduler

    def build(sc):
        built.append(real_build(sc))
        return built[-1]

    with mock.patch.object(engine, "build_scheduler", build):
        rec = engine.run(sc, specs, check_invariants=check_invariants)
    kv = built[0].kv
    num_groups = len(getattr(kv, "groups", ())) or 1
    coarse = {cid: span for span, cid in getattr(kv, "_coarse", {}).items()}
    ids = {key // num_groups for key in kv.pool.cached}
    fine = kv.hasher.contents([x for h in ids for x in coarse.get(h, (h,))])

    def content(key):
        h = key // num_groups
        return key % num_groups, (tuple(fine[x] for x in coarse[h]) if h in coarse else fine[h])

    return (metrics.requests_csv(rec), metrics.steps_csv(rec), rec.stopped_by,
            list(kv.pool.free_queue),
            {content(h): sorted(b) if isinstance(b, dict) else b.block_id
             for h, b in kv.pool.cached.items()})


@settings(max_examples=_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lazy_cases())
def test_lazy_decode_gives_the_bytes_of_step_by_step_on_random_engines(case):
    """Results, step records and, at the end, the pool itself (which block goes next, which
    hash is evicted first, which block each hash finds)."""
    engine_keys, specs = case
    sc = parse_scenario({**sc_raw(), "engine": engine_keys, "run": {"seed": 1, "max_steps": 4000}})
    assert _run_and_pool(sc, specs, False) == _run_and_pool(sc, specs, True)


SPEC_CASES = [
    dict(),  # async (0.33's default with EAGLE), per-position acceptance
    dict(async_scheduling=False),
    dict(version="0.19.0"),
    dict(version="0.22.1", async_scheduling=False),
    dict(version="0.32.0", speculative={"method": "eagle3", "num_speculative_tokens": 2,
                                        "acceptance": "fixed", "num_accepted": 1}),
    dict(speculative={"method": "ngram", "num_speculative_tokens": 4, "acceptance": "fixed",
                      "num_accepted": 3}, async_scheduling=False),
    dict(caching=False),
    dict(speculative={"method": "eagle", "num_speculative_tokens": 3, "parallel_drafting": True},
         cost={"model": "fitted", "profile": "rtxpro6000-llama-3.1-8b-tp2"},
         model="llama-3.1-8b", hardware="rtx-pro-6000", tp=2),
    dict(cost={"layer_profile": "SYNTHETIC"}),
    dict(request_rate=float("inf"), output_tokens=200, num_requests=40),  # a pool that runs out
    # Preemptions by priority in a small pool: a member brought up to date holds what its
    # last output published (the victim's freed blocks keep their hashes).
    dict(async_scheduling=False, engine={"num_gpu_blocks": 43, "scheduling_policy": "priority",
                                         "max_model_len": 267},
         speculative={"method": "eagle", "num_speculative_tokens": 1, "acceptance_rates": [1.0]},
         request_rate=100.0, output_tokens=100, num_requests=60),
]


def spec_raw(speculative=None, num_requests=48, engine=None, **kw):
    raw = sc_raw(**kw)
    raw["engine"].update(engine or {})
    raw["speculative"] = speculative or {"method": "eagle", "num_speculative_tokens": 3,
                                         "acceptance": "per_position",
                                         "acceptance_rates": [0.9, 0.8, 0.6]}
    # Requests in lockstep (one length, arriving together) keep a batch steady for windows.
    raw["workload"].update(num_requests=num_requests, request_rate=kw.get("request_rate", 200.0),
                           output_tokens=kw.get("output_tokens", 120))
    raw["engine"]["max_num_seqs"] = 8
    return raw


@pytest.mark.parametrize("case", SPEC_CASES, ids=[str(c) for c in SPEC_CASES])
def test_speculative_lazy_decode_and_windows_give_the_bytes_of_step_by_step(case, windows):
    sc = parse_scenario(spec_raw(**case))
    fast = outputs(sc)
    assert windows["lazy"] > 0 and windows["window"] > 0, "the case tests nothing"
    assert fast == outputs(sc, check_invariants=True)


def test_a_long_prefill_threshold_below_a_verify_chunk_keeps_requests_step_by_step():
    """A threshold below 1 + k cuts a decode's chunk once requests compete (0.32+: not while
    one runs alone), so a request alone must not start decoding lazily with whole chunks."""
    sc = parse_scenario(spec_raw(version="0.32.0", async_scheduling=False, request_rate=3.0,
                                 engine={"long_prefill_token_threshold": 3}))
    assert outputs(sc) == outputs(sc, check_invariants=True)


@st.composite
def spec_cases(draw):
    """A random engine with speculative decoding, and requests that run in step or not."""
    engine_keys, specs = draw(lazy_cases())
    k = draw(st.integers(1, 5))
    method = draw(st.sampled_from(["eagle", "eagle3", "ngram", "draft_model"]))
    spec = {"method": method, "num_speculative_tokens": k,
            "parallel_drafting": draw(st.booleans()) and method != "ngram"}
    if method == "draft_model":
        spec["draft_model"] = "llama-3.2-1b"
    kind = draw(st.sampled_from(["fixed", "per_position"]))
    if kind == "fixed":
        spec.update(acceptance="fixed", num_accepted=draw(st.integers(0, k)))
    else:
        spec.update(acceptance="per_position",
                    acceptance_rates=draw(st.lists(st.sampled_from([0.0, 0.5, 0.9, 1.0]),
                                                   min_size=1, max_size=1)))
    return engine_keys, spec, _maybe_lockstep(draw, specs)


def _maybe_lockstep(draw, specs):
    """``specs``, or a lockstep batch instead: one length, arriving together."""
    if not draw(st.booleans()):
        return specs
    body = specs[0].prompt if specs else ExplicitTokens((1, 2, 3))
    out = draw(st.integers(40, 160))
    return [RequestSpec(f"l{i}", 0.0, body, out, 0) for i in range(draw(st.integers(2, 24)))]


@settings(max_examples=_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec_cases())
def test_speculative_lazy_decode_gives_the_bytes_of_step_by_step_on_random_engines(case):
    engine_keys, spec, specs = case
    raw = {**sc_raw(), "engine": engine_keys, "speculative": spec,
           "run": {"seed": 1, "max_steps": 4000}}
    try:
        sc = parse_scenario(raw)
    except ConfigError:
        return  # a release that refuses the mix (vLLM's own checks)
    assert _run_and_pool(sc, specs, False) == _run_and_pool(sc, specs, True)


# -- hybrid layouts: full attention with sliding windows, Mamba groups -----------------------


@st.composite
def hybrid_cases(draw):
    """A random engine on a hybrid layout (the differential fuzzer's: full attention and
    sliding windows of several block sizes, or Mamba groups in align mode with or without
    checkpoints exported from inside a chunk), with or without speculative decoding."""
    import random

    from kvsim.oracle.fuzz import _groups, _mamba_groups
    engine_keys, specs = draw(lazy_cases())
    rng = random.Random(draw(st.integers(0, 1 << 30)))
    k = draw(st.integers(0, 4))
    mml, budget = engine_keys["max_model_len"], engine_keys["max_num_batched_tokens"]
    if draw(st.booleans()):
        groups, U, need = _mamba_groups(rng, k, engine_keys["vllm_version"] >= "0.32",
                                        draw(st.sampled_from([1, 1, 2, 3])))
        need += sum(-(-mml // g["block_size"]) for g in groups if g["kind"] != "mamba")
    else:
        groups, U, need = _groups(rng, mml, budget)
    engine_keys = {**engine_keys, "kv_groups": groups, "block_size": U,
                   "num_gpu_blocks": need + 1 + draw(st.sampled_from([0, 2, need // 2, 2 * need]))}
    if draw(st.integers(0, 4)) == 0:
        engine_keys["prefix_cache_retention_interval"] = draw(st.sampled_from(["dense", U, 2 * U]))
    spec = None
    if k:
        spec = {"method": draw(st.sampled_from(["eagle", "eagle3", "ngram"])),
                "num_speculative_tokens": k, "acceptance": "per_position",
                "acceptance_rates": [draw(st.sampled_from([0.0, 0.5, 0.9, 1.0]))]}
        specs = _maybe_lockstep(draw, specs)
    return engine_keys, spec, specs


@settings(max_examples=_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(hybrid_cases())
def test_lazy_decode_on_hybrid_layouts_gives_the_bytes_of_step_by_step(case):
    engine_keys, spec, specs = case
    raw = {**sc_raw(), "engine": engine_keys, "run": {"seed": 1, "max_steps": 4000}}
    if spec:
        raw["speculative"] = spec
    try:
        sc = parse_scenario(raw)
    except ConfigError:
        return  # a release that refuses the mix (vLLM's own checks)
    assert _run_and_pool(sc, specs, False) == _run_and_pool(sc, specs, True)


HYBRID_CASES = [
    dict(engine={"kv_groups": SWA}),  # async, per-position acceptance
    dict(engine={"kv_groups": SWA}, async_scheduling=False, version="0.22.1"),
    dict(engine={"kv_groups": MAMBA, "block_size": 32}),
    dict(engine={"kv_groups": MAMBA, "block_size": 32, "prefix_cache_retention_interval": 64},
         version="0.32.0", async_scheduling=False),
    dict(engine={"kv_groups": [*SWA, {"kind": "full_attention", "block_size": 64}],
                 "block_size": 64}, request_rate=float("inf"), output_tokens=200,
         num_requests=40),  # three groups, U = 64, a pool that runs out
]


@pytest.mark.parametrize("spec", [True, False], ids=["eagle", "plain"])
@pytest.mark.parametrize("case", HYBRID_CASES, ids=[str(c["engine"]) for c in HYBRID_CASES])
def test_lazy_decode_on_named_hybrid_layouts_gives_the_bytes_of_step_by_step(case, spec, windows):
    raw = spec_raw(**case)
    if not spec:
        del raw["speculative"]
    sc = parse_scenario(raw)
    fast = outputs(sc)
    assert windows["lazy"] > 0, "the case tests nothing"
    assert fast == outputs(sc, check_invariants=True)


def test_lazy_decode_dies_where_step_by_step_dies(windows):
    # 0.20.0's capped sliding-window count (tests/test_cli.py's workload): a lazy step plans
    # by the blocks allocations take, so the step the engine dies in is planned by schedule().
    import tomllib

    from tests.test_cli import _window_chat
    sc = parse_scenario(tomllib.loads(_window_chat("0.20.0")))
    fast = outputs(sc)
    assert windows["lazy"] > 0, "the case tests nothing"
    assert json.loads(fast[2])["stopped_by"] == "engine_dead"
    assert fast == outputs(sc, check_invariants=True)
