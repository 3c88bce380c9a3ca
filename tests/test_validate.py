"""kvsim validate: the scenario -> oracle conversion, the agreement table, missing oracles.

The oracle itself (vLLM in its own environment) is exercised by tests/test_vllm_fixtures.py
through recorded results; these tests need no vLLM.
"""

import pytest

from kvsim.cli import main
from kvsim.config import parse_scenario
from kvsim.errors import ConfigError
from kvsim.oracle.replay import drive
from kvsim.oracle.validate import agreement, driver_scenario, oracle_python

RAW = {"model": {"preset": "llama-3.2-1b"}, "hardware": {"preset": "l40s"},
       "engine": {"num_gpu_blocks": 300, "max_model_len": 2048, "max_num_batched_tokens": 256,
                  "max_num_seqs": 16},
       "speculative": {"method": "eagle", "num_speculative_tokens": 2},
       "workload": {"num_requests": 20, "request_rate": 50.0, "system_prompt_tokens": 64,
                    "num_users": 2, "user_history_tokens": 32, "input_tokens": 16,
                    "output_tokens": 12}}


def test_driver_scenario_reproduces_the_kvsim_run():
    sc = parse_scenario(RAW)
    scen = driver_scenario(sc)
    assert len(scen["requests"]) == 20
    assert scen["engine"]["speculative"] == {"method": "eagle", "num_speculative_tokens": 2}
    assert scen["engine"]["async_scheduling"] is True  # 0.33's default
    r0 = scen["requests"][0]
    assert len(r0["prompt_token_ids"]) == 64 + 32 + 16 and r0["join_step"] == 0
    # Replaying the recorded joins and acceptances with the driver's loop gives every request
    # the outputs it asked for.
    out = drive(scen, "0.33.0")
    assert all(v["num_output_tokens"] == 12 for v in out["requests"].values())
    assert any(len(r["accepted"]) > 1 for r in scen["requests"])


def test_a_replay_refuses_output_tokens_that_could_be_prompt_tokens():
    # kvsim's block hashes tell a request's outputs from its prompt by sign (prompt ids >= 0).
    scen = driver_scenario(parse_scenario(RAW))
    scen["requests"][3]["output_token_id"] = 7
    with pytest.raises(ValueError, match="output_token_id must be negative"):
        drive(scen, "0.33.0")


def test_agreement_counts_each_field():
    scen = driver_scenario(parse_scenario(RAW))
    a = drive(scen, "0.33.0")
    rows = {f: (ok, total) for f, ok, total, _ in agreement(a, a)}
    assert rows["request.cached_tokens"] == (20, 20) and rows["free_queue_end"] == (1, 1)
    b = drive(scen, "0.33.0")
    b["requests"][next(iter(b["requests"]))]["finish_step"] = -1
    rows = {f: (ok, total, bad) for f, ok, total, bad in agreement(a, b)}
    assert rows["request.finish_step"][0] == 19 and rows["request.finish_step"][2]
    # A deadlock is compared by its step (the driver records {step, ...}, replay the step).
    assert "stall" not in rows
    rows = {f: (ok, total) for f, ok, total, _ in agreement({**a, "stall": 7}, {**a, "stall": {
        "step": 7, "running": []}})}
    assert rows["stall"] == (1, 1)
    rows = {f: (ok, total) for f, ok, total, _ in agreement({**a, "stall": None}, {**a, "stall": {
        "step": 7}})}
    assert rows["stall"] == (0, 1)


def test_missing_oracle_is_a_one_line_error(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KVSIM_ORACLE_HOME", str(tmp_path))
    with pytest.raises(ConfigError, match="make_env.sh 0.33.0"):
        oracle_python("0.33.0", None)
    scen = tmp_path / "s.toml"
    scen.write_text('[model]\npreset = "llama-3.2-1b"\n[hardware]\npreset = "l40s"\n'
                    '[engine]\nnum_gpu_blocks = 300\nmax_model_len = 2048\n'
                    '[workload]\nnum_requests = 3\n')
    assert main(["validate", str(scen)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no oracle environment" in err
    # One still being built (or cut off): its python is there, make_env.sh's marker is not.
    env = tmp_path / "vllm-0.33.0"
    (env / "bin").mkdir(parents=True)
    (env / "bin" / "python").write_text("")
    with pytest.raises(ConfigError, match="make_env.sh 0.33.0"):
        oracle_python("0.33.0", None)
    (env / ".kvsim-oracle-ok").write_text("")
    assert oracle_python("0.33.0", None) == env / "bin" / "python"


def test_driver_scenario_carries_the_layout_kvsim_resolved():
    """A model's own hybrid layout (Qwen3.5: Gated DeltaNet groups exporting prefill
    checkpoints on the block grid, Mamba align mode) reaches the driver whole: replayed from
    the driver's format, every request is scheduled, cached and finished where the kvsim
    run put it (without the checkpoint alignment a prompt's prefill splits at its
    checkpoint instead, a step later)."""
    from kvsim import engine
    from kvsim.workload import build_requests

    raw = {"model": {"preset": "qwen3.5-27b"}, "hardware": {"preset": "h100-sxm"},
           "engine": {"num_gpu_blocks": 300, "max_model_len": 4096,
                      "max_num_batched_tokens": 4096, "max_num_seqs": 8,
                      "enable_prefix_caching": True},
           "workload": {"num_requests": 8, "request_rate": 20.0, "system_prompt_tokens": 1700,
                        "num_users": 1, "user_history_tokens": 0, "input_tokens": 200,
                        "output_tokens": 10}}
    sc = parse_scenario(raw)
    assert any(g.prefill_checkpoint_alignment for g in sc.engine.kv_groups)
    scen = driver_scenario(sc)
    groups = scen["engine"]["kv_groups"]
    assert [g.get("prefill_checkpoint_alignment") for g in groups] == [
        g.prefill_checkpoint_alignment for g in sc.engine.kv_groups]
    assert scen["engine"]["mamba_cache_mode"] == "align"
    rec = engine.run(sc, build_requests(sc))
    out = drive(scen, "0.33.0")["requests"]
    for r in rec.requests:
        got = out[r.req_id]
        assert (got["first_token_step"], got["finish_step"], got["cached_tokens"]) == (
            r.first_token_step, r.finish_step, r.cached_tokens)


def test_a_run_the_engine_dies_in_is_validated_up_to_the_death():
    # tests/test_cli.py's 0.20.0 workload: kvsim's run ends in the engine's death; the driver's
    # requests are the ones that joined, and its replay dies in the same step kvsim's run did.
    import tomllib

    from tests.test_cli import _window_chat
    sc = parse_scenario(tomllib.loads(_window_chat("0.20.0")))
    scen = driver_scenario(sc)
    out = drive(scen, "0.20.0")
    assert out["engine_dead"]["error"] == "ValueError: Cannot get 1 free blocks from the pool"
    assert len(out["steps"]) == out["engine_dead"]["step"]
    rows = {r[0]: r[1:3] for r in agreement(out, out)}
    assert rows["engine_dead"] == (1, 1)
