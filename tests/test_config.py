"""Scenario loading: defaults, presets, derived values and one-line errors."""

from pathlib import Path

import pytest
from builders import SHARED_DATA

from kvsim.config import load_scenario, parse_scenario
from kvsim.errors import ConfigError
from kvsim.scenario_text import resolved_toml, schema_markdown
from kvsim.schema import SCHEMA
from kvsim.semantics import VERSIONS

ROOT = Path(__file__).resolve().parents[1]
BASE = {"model": {"preset": "llama-3.1-8b"}, "hardware": {"preset": "h100-sxm"}}


def scenario(**sections):
    raw = {k: dict(v) for k, v in BASE.items()}
    for k, v in sections.items():
        raw.setdefault(k, {}).update(v)
    return parse_scenario(raw)


def error(**sections) -> ConfigError:
    with pytest.raises(ConfigError) as exc:
        scenario(**sections)
    return exc.value


def test_defaults_are_vllm_033_serve_defaults():
    e = scenario().engine
    assert (e.vllm_version, e.block_size, e.enable_prefix_caching, e.enable_chunked_prefill) == (
        "0.33.0", 16, True, True)
    assert (e.scheduling_policy, e.scheduler_reserve_full_isl, e.gpu_memory_utilization) == (
        "fcfs", True, 0.92)
    # vLLM schedules asynchronously by default, and so does kvsim, in every release; vLLM's
    # default turns it off for ngram before 0.33 and for draft_model in 0.19/0.22.
    assert e.async_scheduling is True
    for version in ("0.19.0", "0.22.0", "0.22.1", "0.32.0"):
        assert scenario(engine={"vllm_version": version}).engine.async_scheduling is True
    ngram = {"method": "ngram", "num_speculative_tokens": 2}
    draft = {"method": "draft_model", "num_speculative_tokens": 2}
    eagle = {"method": "eagle", "num_speculative_tokens": 2}
    # ngram off before 0.33; draft_model before 0.28 (config/vllm.py 0.28:1201).
    def release(v):
        return tuple(int(x) for x in v.split("."))
    off = {(v, m) for v in VERSIONS for m in ("ngram", "draft_model")
           if release(v) < ((0, 33, 0) if m == "ngram" else (0, 28, 0))}
    for v in VERSIONS:
        for s in (ngram, draft, eagle):
            on = scenario(engine={"vllm_version": v}, speculative=s).engine.async_scheduling
            assert on is ((v, s["method"]) not in off), (v, s["method"])
    # Prefix caching: on by default, but for Mamba / linear-attention hybrids only from 0.28
    # (EngineArgs: is_prefix_caching_supported is False for hybrids in 0.19-0.25, 0.26/0.27
    # keep them opt-in). Sliding-window layouts are not hybrids in vLLM's sense.
    mamba = [{"kind": "full_attention", "block_size": 64}, {"kind": "mamba", "block_size": 64}]
    window = [{"kind": "full_attention", "block_size": 16},
              {"kind": "sliding_window", "block_size": 16, "sliding_window": 32}]
    for v in VERSIONS:
        old = release(v) < (0, 28, 0)
        gdn = scenario(model={"preset": "qwen3.5-27b"}, engine={"vllm_version": v}).engine
        by_hand = scenario(engine={"vllm_version": v, "kv_groups": mamba}).engine
        assert (gdn.enable_prefix_caching, gdn.mamba_cache_mode) == (
            (False, "none") if old else (True, "align")), v
        assert by_hand.enable_prefix_caching is not old, v
        assert scenario(engine={"vllm_version": v, "kv_groups": window}).engine.enable_prefix_caching
        assert scenario(engine={"vllm_version": v}).engine.enable_prefix_caching
        assert scenario(model={"preset": "qwen3.5-27b"}, engine={
            "vllm_version": v, "enable_prefix_caching": True}).engine.enable_prefix_caching
    # H100 (79 GiB, not an A100): `vllm serve` defaults.
    assert (e.max_num_batched_tokens, e.max_num_seqs) == (8192, 1024)
    assert e.max_model_len == 131072  # the model's context length
    a100 = scenario(hardware={"preset": "a100-80gb"}).engine
    assert (a100.max_num_batched_tokens, a100.max_num_seqs) == (2048, 256)


def test_num_gpu_blocks_override_and_kv_cache_memory_bytes():
    assert scenario(engine={"num_gpu_blocks": 9000}).engine.num_gpu_blocks == 9000
    # Llama-3.1-8B bf16: 2 (K,V) x 32 layers x 8 heads x 128 x 2 bytes = 131072 B/token,
    # x 16 tokens = 2 MiB per block -> 1 GiB holds 512 blocks.
    e = scenario(engine={"kv_cache_memory_bytes": 1 << 30, "max_model_len": 4096}).engine
    assert (e.num_gpu_blocks, e.num_gpu_blocks_derived) == (512, True)
    fp8 = scenario(engine={"kv_cache_memory_bytes": 1 << 30, "max_model_len": 4096,
                           "kv_cache_dtype": "fp8"}).engine
    assert fp8.num_gpu_blocks == 1024


def test_model_context_length_does_not_cap_max_model_len():
    assert scenario(engine={"max_model_len": 262144}).engine.max_model_len == 262144


def test_preset_keys_can_be_overridden():
    sc = scenario(model={"num_hidden_layers": 16})
    assert sc.model.num_hidden_layers == 16 and sc.model.hidden_size == 4096


@pytest.mark.parametrize("sections, where, what", [
    ({"engine": {"blok_size": 16}}, "engine.blok_size", "did you mean 'block_size'"),
    ({"engine": {"block_size": -16}}, "engine.block_size", "at least 1, got -16"),
    ({"engine": {"block_size": "16"}}, "engine.block_size", "must be an integer"),
    ({"engine": {"enable_prefix_caching": 1}}, "engine.enable_prefix_caching", "true or false"),
    ({"engine": {"scheduling_policy": "lifo"}}, "engine.scheduling_policy", "must be one of"),
    ({"engine": {"vllm_version": "0.99.0"}}, "engine.vllm_version", "must be one of"),
    ({"engine": {"num_gpu_blocks": 100}}, "engine.max_model_len", "needs 8192 blocks"),
    ({"engine": {"max_num_batched_tokens": 16, "max_num_seqs": 32}}, "engine.max_num_batched_tokens",
     "at least max_num_seqs"),
    ({"engine": {"async_scheduling": True, "vllm_version": "0.22.1"},
      "speculative": {"method": "ngram", "num_speculative_tokens": 2}}, "engine.async_scheduling",
     "refuses ngram"),
    ({"model": {"preset": "llama-3.1-9b"}}, "model.preset", "did you mean 'llama-3.1-8b'"),
    ({"workload": {"kind": "trace"}}, "workload.path", "missing"),
    ({"workload": {"kind": "trace", "path": "/nonexistent.jsonl"}}, "workload.path", "no such file"),
    ({"workload": {"request_rate": 0}}, "workload.request_rate", "greater than 0"),
    ({"cost": {"compute_efficiency": 1.5}}, "cost.compute_efficiency", "at most 1"),
    ({"runn": {"seed": 1}}, "[runn]", "did you mean 'run'"),
])
def test_bad_input_names_the_key(sections, where, what):
    exc = error(**sections)
    assert exc.where.endswith(where)
    assert what in exc.what


def test_missing_model_key_without_preset():
    with pytest.raises(ConfigError) as exc:
        parse_scenario({"model": {"hidden_size": 10}, "hardware": {"preset": "h100-sxm"}})
    assert "model.num_hidden_layers" in exc.value.where


def test_relative_trace_path_resolves_against_the_scenario_folder(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "t.jsonl").write_text('{"arrival_s": 0, "max_tokens": 1, "prompt_token_ids": [1]}\n')
    (tmp_path / "s.toml").write_text('[model]\npreset = "llama-3.1-8b"\n[hardware]\npreset = "h100-sxm"\n'
                                     '[workload]\nkind = "trace"\npath = "sub/t.jsonl"\n')
    assert load_scenario(tmp_path / "s.toml").workload.path == tmp_path / "sub" / "t.jsonl"


def test_resolved_toml_round_trips(tmp_path):
    sc = load_scenario(ROOT / "scenarios" / "quickstart.toml")
    (tmp_path / "r.toml").write_text(resolved_toml(sc))
    again = load_scenario(tmp_path / "r.toml")
    assert (again.model, again.hardware, again.workload, again.cost, again.run) == (
        sc.model, sc.hardware, sc.workload, sc.cost, sc.run)
    assert again.engine.num_gpu_blocks == sc.engine.num_gpu_blocks


def test_every_scenario_file_loads(monkeypatch, tmp_path):
    """Scenarios naming a public trace load from the shared data folder (laid out like the
    trace cache) when it is there, and otherwise fail with the cache's one-line message."""
    files = sorted((ROOT / "scenarios").glob("*.toml"))
    assert files
    monkeypatch.setenv("KVSIM_TRACE_DIR", str(SHARED_DATA if SHARED_DATA.is_dir() else tmp_path))
    for f in files:
        if "trace = " in f.read_text() and not SHARED_DATA.is_dir():
            with pytest.raises(ConfigError, match="is not in the trace cache"):
                load_scenario(f)
        else:
            load_scenario(f)


def test_docs_list_every_key():
    doc = (ROOT / "docs" / "scenario.md").read_text()
    assert schema_markdown() in doc, "python -m kvsim.scenario_text docs/scenario.md"
    assert all(f"`{k.name}`" in doc for keys in SCHEMA.values() for k in keys)


def test_each_default_is_stated_once_in_the_key_tables():
    """The records carry no defaults of their own: every field is filled from its key."""
    import dataclasses

    from kvsim import schema
    from kvsim.model import ModelCfg

    records = {"model": ModelCfg, "hardware": schema.HardwareCfg, "engine": schema.EngineCfg,
               "speculative": schema.SpecCfg, "workload": schema.WorkloadCfg,
               "cost": schema.CostCfg, "run": schema.RunCfg, "cluster": schema.ClusterCfg}
    # Fields that no key sets: derived at load (engine), or read from config.json (model).
    not_keys = {"engine": {"num_gpu_blocks_derived", "offload", "kv_block_bytes"},
                "cluster": {"engines"}, "cost": {"roofline_constants"},
                "model": {"architecture", "layer_types", "sliding_window", "linear_attention",
                          "index_head_dim",
                          "quantized_params", "routed_expert_params", "hf_id"}}
    for section, cls in records.items():
        keys = {k.name for k in SCHEMA[section]} - ({"preset"} if section == "hardware" else set())
        fields = {f.name: f for f in dataclasses.fields(cls)}
        assert set(fields) == keys | not_keys.get(section, set()), section
        defaulted = [n for n in keys if fields[n].default is not dataclasses.MISSING]
        assert not defaulted, f"{section}: {defaulted} restate their key's default"


def test_string_modes_are_typed_and_the_keys_choices_are_those_types():
    from typing import get_args

    from kvsim.cost import COST_MODELS
    from kvsim.schema import CostModelName, SpecCfg, WorkloadCfg

    assert set(COST_MODELS) == set(get_args(CostModelName))
    keys = {(s, k.name): k for s, ks in SCHEMA.items() for k in ks}
    for section, cls in (("speculative", SpecCfg), ("workload", WorkloadCfg)):
        hints = __import__("typing").get_type_hints(cls)
        for name in ("method", "acceptance") if section == "speculative" else (
                "kind", "format", "generator", "arrival"):
            assert keys[section, name].choices == get_args(hints[name]), (section, name)


@pytest.mark.parametrize("version, memory_gib, name, cc, expected", [
    # EngineArgs.get_batch_defaults, read in each release's engine/arg_utils.py:
    ("0.33.0", 178, "B200", "10.0", (16384, 1024)),  # >= 160 GiB tier (0.32+)
    ("0.32.0", 178, "B200", "10.0", (16384, 1024)),
    ("0.22.1", 178, "B200", "10.0", (8192, 1024)),  # no 160 GiB tier before 0.32
    ("0.19.0", 178, "B200", "10.0", (8192, 1024)),
    ("0.33.0", 119, "NVIDIA GB10", "12.1", (2048, 256)),  # GB10 kept on the small tier (0.33)
    ("0.32.0", 119, "NVIDIA GB10", "12.1", (8192, 1024)),
    ("0.33.0", 80, "NVIDIA A100-SXM4-80GB", "8.0", (2048, 256)),  # no A100 on the 70 GiB tier
    ("0.33.0", 48, "L40S", "8.9", (2048, 256)),
])
def test_batch_defaults_are_the_releases_own(version, memory_gib, name, cc, expected):
    sc = scenario(hardware={"name": name, "memory_bytes": memory_gib << 30, "compute_capability": cc},
                  engine={"vllm_version": version, "async_scheduling": False,
                          "num_gpu_blocks": 4096, "max_model_len": 4096})
    assert (sc.engine.max_num_batched_tokens, sc.engine.max_num_seqs) == expected


@pytest.mark.parametrize("sections, where, what", [
    # vLLM's SpeculativeConfig: mtp drafts with the checkpoint's own MTP layers.
    ({"speculative": {"method": "mtp", "num_speculative_tokens": 1}}, "speculative.method",
     "'mtp' needs a model with MTP layers; llama-3.1-8b has none"),
    ({"speculative": {"method": "eagle3", "num_speculative_tokens": 3,
                      "acceptance_rates": [0.8, 0.6]}}, "speculative.acceptance_rates",
     "2 rates for 3 drafts"),
    # FlashAttention's kernel takes multiples of 16 (flash_attn.py get_supported_kernel_block_sizes).
    ({"engine": {"block_size": 17}}, "engine.block_size", "17 is not a multiple of the attention "
     "kernel's block (16 on this GPU)"),
    # B200's FLASHINFER_MLA takes 32 or 64: 16 is refused there (Hopper's FLASH_ATTN_MLA takes it).
    ({"model": {"preset": "deepseek-v3"}, "hardware": {"preset": "h200", "compute_capability": "10.0"},
      "engine": {"block_size": 16, "tensor_parallel_size": 8}}, "engine.block_size",
     "16 is not a multiple of the attention kernel's block (32 or 64 on this GPU)"),
])
def test_what_vllm_refuses_is_refused(sections, where, what):
    exc = error(**sections)
    assert exc.where == f"scenario: {where}" and exc.what.startswith(what), exc


def test_mtp_drafts_default_to_the_checkpoints_mtp_layers():
    # DeepSeek-V3's config.json: num_nextn_predict_layers 1; Qwen3.5-27B's mtp_num_hidden_layers 1.
    for preset in ("deepseek-v3", "qwen3.5-27b"):
        sc = scenario(model={"preset": preset}, hardware={"preset": "h200"},
                      engine={"tensor_parallel_size": 8}, speculative={"method": "mtp"})
        assert sc.speculative.num_speculative_tokens == 1
    assert scenario(engine={"block_size": 32}).engine.block_size == 32


@pytest.mark.parametrize("sections, where, what", [
    ({"hardware": {"preset": "h100"}}, "hardware.preset", "(did you mean 'h100-sxm'?)"),
    ({"hardware": {"preset": "H100"}}, "hardware.preset", "(did you mean 'h100-sxm'?)"),
    ({"model": {"preset": "Llama-3.1-8B"}}, "model.preset", "(did you mean 'llama-3.1-8b'?)"),
    ({"engine": {"max_num_seq": 8}}, "engine.max_num_seq", "unknown key (did you mean 'max_num_seqs'?)"),
    # vLLM's own names for what kvsim takes elsewhere: said so, not a look-alike key.
    ({"engine": {"pipeline_parallel_size": 2}}, "engine.pipeline_parallel_size",
     "not a kvsim key: pipeline parallelism"),
    ({"speculative": {"model": "x"}}, "speculative.model", "not a kvsim key: kvsim reads no drafter"),
])
def test_suggestions_point_at_what_was_meant(sections, where, what):
    exc = error(**sections)
    assert exc.where == f"scenario: {where}" and what in exc.what, exc
    assert "tensor_parallel_size" not in exc.what and "draft_model'?" not in exc.what


def test_mla_without_a_latent_is_refused():
    # Found by the bad-input property test: a preset made MLA by hand has kv_lora_rank 0, a
    # zero-byte cache page (a division by zero when the pool was derived).
    exc = error(model={"preset": "llama-3.2-1b", "attention_type": "mla"})
    assert exc.where == "scenario: model.kv_lora_rank" and "above 0" in exc.what


@pytest.mark.parametrize("version, seqs, budget", [
    # One draft-model input slot per request reserved up front (before 0.28): 64 - 64 x 1 = 0.
    # 0.19 tests the value for truth and falls back to max_num_batched_tokens (64); 0.20+
    # raise ("max_num_scheduled_tokens is set to 0", config/vllm.py 0.20.0:1391-1400).
    ("0.19.0", 64, 64), ("0.21.0", 64, None), ("0.27.0", 64, None),
    ("0.21.0", 32, 32),  # 64 - 32 x 1
    ("0.28.0", 64, 64),  # 0.28+: slots charged per scheduled request, the budget whole
])
def test_draft_slots_reserved_from_the_budget_by_release(version, seqs, budget):
    from kvsim.engine import build_scheduler
    sections = dict(engine={"vllm_version": version, "max_num_batched_tokens": 64,
                            "max_num_seqs": seqs},
                    speculative={"method": "draft_model", "draft_model": "llama-3.2-1b",
                                 "num_speculative_tokens": 2, "acceptance": "fixed",
                                 "num_accepted": 1})
    if budget is None:
        exc = error(**sections)
        assert exc.where.endswith("engine.max_num_batched_tokens") and "refuses" in exc.what
    else:
        assert build_scheduler(scenario(**sections)).token_budget == budget
