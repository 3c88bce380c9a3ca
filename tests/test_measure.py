"""kvsim validate --against vllm-engine / vllm-server, the parts that need no vLLM: which hits
count as timing-independent, the error figures, the profile fitted from engine steps, the
/metrics parser, and the one-line errors before any engine starts.

The engine itself runs in tests/test_engine_target.py (opt-in, KVSIM_ENGINE_TESTS=1; CI's
engine step) and in CI's bounded validation run.
"""

import json
import socket
import tomllib
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from kvsim.assemble import cost_inputs
from kvsim.calibrate.fit import fit_features
from kvsim.cli import main
from kvsim.config import parse_scenario
from kvsim.cost.fitted import PARAMS, PROFILE_FORMAT, SHAPE_KEYS, FittedCost, features, pass_time_s
from kvsim.measure import compare, engine, server
from kvsim.workload import build_requests

SCENARIO = Path(__file__).parent.parent / "scenarios/validate/spaced_and_bursts.toml"


def rec(rid, arrival, ttft, e2e, cached=0, out=4):
    return {"req_id": rid, "arrival_s": arrival, "prompt_tokens": 64, "output_tokens": out,
            "cached_tokens": cached, "ttft_s": ttft, "tpot_s": None, "e2e_s": e2e}


def test_timing_independent_spaced_and_warmed():
    bs = 32
    p = tuple(range(100, 164))  # two blocks
    prompts = {"a": p + (1,), "b": p + (2,), "c": p + (3,), "d": tuple(range(500, 600)),
               "e": tuple(range(500, 600)) + (9,)}
    # a alone; b and c overlap each other but share only the two blocks a warmed; d and e
    # overlap and share three blocks nobody warmed.
    run = {"a": rec("a", 0.0, 0.1, 0.2), "b": rec("b", 1.0, 0.1, 0.3), "c": rec("c", 1.05, 0.1, 0.3),
           "d": rec("d", 2.0, 0.1, 0.3), "e": rec("e", 2.01, 0.1, 0.3)}
    assert compare.timing_independent(run, run, prompts, bs, pressure=False) == {"a", "b", "c"}
    # Under cache pressure only requests nothing overlapped count.
    assert compare.timing_independent(run, run, prompts, bs, pressure=True) == {"a"}
    # Both runs must agree: if in the other run a is still running when b and c arrive, their
    # hits could depend on timing (a's cannot: nothing arrived before its first token).
    other = {**run, "a": rec("a", 0.0, 0.1, 1.5)}
    assert compare.timing_independent(run, other, prompts, bs, pressure=False) == {"a"}


def test_summary_error_figures_by_hand():
    meas = {"a": rec("a", 0.0, 0.100, 1.0, cached=32), "b": rec("b", 1.0, 0.200, 2.0, cached=0)}
    pred = {"a": rec("a", 0.0, 0.110, 0.9, cached=32), "b": rec("b", 1.0, 0.150, 2.0, cached=32)}
    rows = compare.side_by_side(meas, pred, {"a"})
    s = compare.summarize(rows, meas, pred)
    assert s["cached_exact_timing_independent"] == [1, 1]
    assert s["cached_exact_timing_dependent"] == [0, 1]
    # TTFT errors 10 % and 25 %: median 17.5 %.
    assert s["ttft_s"]["abs_pct_error"]["p50"] == pytest.approx(17.5)
    # Throughput: 8 tokens over 3.0 s measured, over 3.0 s predicted (b ends at 3.0 in both).
    assert s["throughput_tok_s"]["error_pct"] == pytest.approx(0.0)
    text = compare.table(s)
    assert "1/1 (100.0 %)" in text and "0/1 (0.0 %)" in text
    assert compare.csv_text(rows).splitlines()[0].startswith("req_id,arrival_s")


def test_fit_features_recovers_a_linear_step_model():
    rng = np.random.default_rng(0)
    feats, y = [], []
    for _ in range(300):
        # Half the chunks decode (one token), so pure-decode and mixed steps both occur.
        chunks = [(1 if rng.random() < 0.5 else int(rng.integers(2, 300)), int(rng.integers(0, 2000)))
                  for _ in range(int(rng.integers(1, 9)))]
        num_chunks = len(chunks)
        pure = all(n == 1 for n, _ in chunks)
        mixed = not pure and any(n == 1 for n, _ in chunks)
        f = features(chunks, num_chunks)
        feats.append(f)
        # t0 + a_tok*T + a_seq*R (pure decode) + a_seq_mixed*R (decodes beside a prefill)
        y.append(0.004 + 2e-4 * sum(n for n, _ in chunks) + 1e-3 * num_chunks * pure
                 + 5e-4 * num_chunks * mixed)
    params, held, _ = fit_features(np.array(feats), np.array(y), rng)
    assert held["median_pct"] < 1.0
    assert params["t0_s"] == pytest.approx(0.004, rel=0.1)
    # One LM-head row per chunk here: a_lm is shared with both per-sequence terms.
    assert params["a_seq_s"] - params["a_seq_mixed_s"] == pytest.approx(5e-4, rel=0.1)


def tiny_profile(tmp_path, sc, draft_in_target):
    prof = {"format": PROFILE_FORMAT,
            "model": {k: getattr(sc.model, k) for k in SHAPE_KEYS},
            "target": {**dict.fromkeys(PARAMS, 0.0), "t0_s": 0.005, "p": 1.0, "q": 1.0,
                       "a_tok_s": 1e-4},
            "draft": None, "draft_in_target": draft_in_target, "whole_engine_steps": True}
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(prof))
    return path


def load_raw():
    raw = tomllib.loads(SCENARIO.read_text())
    raw["workload"]["path"] = str(SCENARIO.parent / raw["workload"]["path"])
    return raw


def test_profile_timed_with_its_drafter_needs_no_drafter_pass(tmp_path):
    raw = load_raw()
    raw["speculative"] = {"method": "eagle", "num_speculative_tokens": 2}
    sc = parse_scenario(raw)
    inp = replace(cost_inputs(sc), profile=tiny_profile(tmp_path, sc, True), step_overhead_s=0.002)
    fc = FittedCost(inp)
    assert fc.draft_time_s([(1, 100)], 1) == 0.0
    # Whole engine steps: the engine's own overhead is in t0, step_overhead_s is not added.
    assert fc.step_time_s([(10, 0)], 1) == pytest.approx(0.005 + 10e-4)
    with pytest.raises(Exception, match="no drafter pass"):
        FittedCost(replace(inp, profile=tiny_profile(tmp_path, sc, False)))


def test_calibration_workload_differs_from_the_replay():
    raw = load_raw()
    raw["workload"] = {"kind": "synthetic", "generator": "shared_prefix", "num_requests": 10,
                       "request_rate": 4.0, "system_prompt_tokens": 64, "num_users": 2,
                       "user_history_tokens": 32, "input_tokens": 16, "output_tokens": 8}
    sc = parse_scenario(raw, SCENARIO)
    before, after = engine.calibration_workload(raw, SCENARIO, sc)
    replay = engine.wire_requests(build_requests(sc))
    # Waves of 1, 2, 4, 8, 16, 8, 4, 2, 1 requests; after the replay the generator, another seed.
    assert len(before) == 46 and len(after) == 10
    assert all(r["req_id"].startswith("cal-") for r in before + after)
    assert max(len(r["prompt_token_ids"]) for r in before) <= sc.engine.max_model_len - 64
    assert [r["arrival_s"] for r in after] != [r["arrival_s"] for r in replay]
    # A trace is never replayed for calibration: waves of another seed instead.
    sc = parse_scenario(load_raw())
    before, after = engine.calibration_workload(load_raw(), SCENARIO, sc)
    assert len(after) == 46 and after != before


def test_metrics_parser():
    text = "\n".join([
        "# HELP vllm:prefix_cache_queries_total x",
        'vllm:prefix_cache_queries_total{engine="0",model_name="m"} 1234.0',
        'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 1000.0',
        'vllm:cache_config_info{block_size="32",engine="0",num_gpu_blocks="16384"} 1.0',
        'vllm:time_to_first_token_seconds_count{engine="0"} 3.0'])

    class Fake:
        def __call__(self, url, path, timeout):
            return 200, text
    orig = server._get
    server._get = Fake()
    try:
        counters, info = server.scrape("http://127.0.0.1:1")
    finally:
        server._get = orig
    assert counters == {"vllm:prefix_cache_queries": 1234.0, "vllm:prefix_cache_hits": 1000.0}
    assert info["num_gpu_blocks"] == "16384" and info["block_size"] == "32"


def one_line_error(capsys, argv, where):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("kvsim: error: ") and where in err, err
    return err


def scenario_file(tmp_path, edit):
    text = SCENARIO.read_text().replace('path = "traces/', f'path = "{SCENARIO.parent}/traces/')
    for old, new in edit:
        assert old in text
        text = text.replace(old, new)
    p = tmp_path / "s.toml"
    p.write_text(text)
    return p


@pytest.mark.parametrize("edit, where", [
    ([("block_size = 32 ", "block_size = 16 ")], "engine.block_size"),
    ([('vllm_version = "0.32.0"', 'vllm_version = "0.33.0"')], "engine.vllm_version"),
    ([("vocab_size = 32000", "vocab_size = 20000")], "workload"),
])
def test_engine_target_refuses_what_the_cpu_engine_cannot_run(tmp_path, capsys, edit, where):
    out = tmp_path / "out"
    err = one_line_error(capsys, ["validate", "--against", "vllm-engine", str(scenario_file(tmp_path, edit)),
                                  "--out", str(out)], where)
    assert "Traceback" not in err and not out.exists()


def test_engine_target_without_environment(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("KVSIM_ENGINE_HOME", str(tmp_path / "none"))
    one_line_error(capsys, ["validate", "--against", "vllm-engine", str(scenario_file(tmp_path, []))],
                   "make_engine_env.sh")


def test_server_target_needs_a_profile(tmp_path, capsys):
    one_line_error(capsys, ["validate", "--against", "vllm-server", str(scenario_file(tmp_path, []))],
                   "--profile")


def test_server_target_port_in_use_starts_nothing(tmp_path, capsys):
    sc = parse_scenario(load_raw())
    prof = tiny_profile(tmp_path, sc, False)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        argv = ["validate", "--against", "vllm-server", str(scenario_file(tmp_path, [])),
                "--profile", str(prof), "--port", str(port)]
        err = one_line_error(capsys, argv, "--port")
    assert "in use" in err


def test_bad_url(tmp_path, capsys):
    sc = parse_scenario(load_raw())
    prof = tiny_profile(tmp_path, sc, False)
    one_line_error(capsys, ["validate", "--against", "vllm-server", str(scenario_file(tmp_path, [])),
                            "--profile", str(prof), "--url", "ftp://x"], "--url")


def test_mean_unbiased_fit_gets_the_mean_step_under_skewed_noise():
    # Steps t0 + a_tok*T times lognormal noise of mean 1 (median exp(-sigma^2/2) = 0.88 at
    # sigma 0.5): the relative fit follows the median, the mean-unbiased one the mean, which
    # latencies (sums of steps) need.
    rng = np.random.default_rng(1)
    sigma = 0.5
    feats, y = [], []
    for _ in range(2000):
        chunks = [(int(rng.integers(2, 400)), 0)]
        f = features(chunks, 1)
        feats.append(f)
        y.append((0.004 + 2e-5 * f[0]) * rng.lognormal(-sigma ** 2 / 2, sigma))
    feats, y = np.array(feats), np.array(y)
    true_total = float(np.sum(0.004 + 2e-5 * feats[:, 0]))
    rel, _, _ = fit_features(feats, y, np.random.default_rng(0))
    mean, _, _ = fit_features(feats, y, np.random.default_rng(0), mean_unbiased=True)
    total = {name: sum(pass_time_s(p, f) for f in feats) for name, p in (("rel", rel), ("mean", mean))}
    assert total["mean"] == pytest.approx(true_total, rel=0.03)
    assert total["rel"] < 0.95 * true_total
