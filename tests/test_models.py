"""Models from config.json (kvsim.hf) and the KV layout vLLM builds for them (kvsim.layout).

Every expected number is derived by hand from the config.json and vLLM's rules, or is the model
card's figure; none is kvsim's own output.
"""

import json
from dataclasses import replace

import pytest

from kvsim import presets
from kvsim.config import model_preset, parse_scenario
from kvsim.errors import ConfigError
from kvsim.layout import derive_layout
from kvsim.semantics import VERSIONS

R033, R032, R019 = (VERSIONS[v].layout for v in ("0.33.0", "0.32.0", "0.19.0"))


@pytest.mark.parametrize("name, figure, rel", [
    # Exact totals (the HF hub's safetensors count, or a card giving every digit): to the parameter.
    ("llama-3.1-8b", 8_030_261_248, 0), ("llama-3.1-70b", 70_553_706_496, 0),
    ("llama-3.2-1b", 1_235_814_400, 0), ("qwen3-32b", 32_762_123_264, 0),
    ("qwen3-8b", 8_190_735_360, 0), ("ministral-8b-instruct-2410", 8_019_808_256, 0),
    # Model cards' figures: within 1 %.
    ("deepseek-v3", 671e9, 0.01), ("gpt-oss-120b", 117e9, 0.01), ("gpt-oss-20b", 21e9, 0.01),
    ("qwen3-30b-a3b", 30.5e9, 0.01), ("qwen3.5-35b-a3b", 35e9, 0.01),
    ("qwen3-next-80b-a3b-thinking", 80e9, 0.01), ("smollm2-135m", 135e6, 0.01),
    ("gemma-3-4b-it", 4.30e9, 0.01),
])
def test_parameter_counts_match_the_cards(name, figure, rel):
    assert model_preset(name).num_params == pytest.approx(figure, rel=rel)


def test_active_parameters_of_moe_cards():
    # gpt-oss-120b "5.1B active", gpt-oss-20b "3.6B active" (the input embedding, which
    # kvsim's active count leaves out, is not computed per token).
    assert model_preset("gpt-oss-120b").num_active_params == pytest.approx(5.1e9, rel=0.01)
    assert model_preset("gpt-oss-20b").num_active_params == pytest.approx(3.6e9, rel=0.01)


def test_a_preset_by_hugging_face_id():
    assert presets.by_hf_id("Qwen/Qwen3-32B") == "qwen3-32b"
    sc = parse_scenario({"model": {"preset": "openai/gpt-oss-20b"}, "hardware": {"preset": "h100-sxm"}})
    assert sc.model.name == "gpt-oss-20b"


def _layout(name, rules=R033, cap=(9, 0), tp=1, block=None, caching=True, k=0):
    return derive_layout(model_preset(name), rules, tp=tp, kv_cache_dtype="auto", block_size=block,
                         capability=cap, enable_prefix_caching=caching, num_speculative_tokens=k)


def test_gpt_oss_interleaved_window():
    # 24 layers alternating sliding (128) and full; 8 KV heads of 64, bf16: two groups of 12
    # layers, a page of 16 x 2 x 8 x 64 x 2 bytes, a block id spanning 12 layers.
    lay = _layout("gpt-oss-20b")
    assert [(g.kind, g.sliding_window, g.num_layers) for g in lay.groups] == [
        ("sliding_window", 128, 12), ("full_attention", 0, 12)]
    assert lay.block_size == 16 and lay.block_bytes == 16 * 2 * 8 * 64 * 2 * 12


def test_gemma3_five_to_one():
    # 62 layers, every 6th global: 10 full, 52 sliding (1024). 52 >= 1.5 x 10, so groups of 10
    # layers: 52 sliding layers in ceil(52/10) = 6 groups (layers[i::6]: 9,9,9,9,8,8), 1 full.
    lay = _layout("gemma-3-27b-it")
    kinds = [(g.kind, g.num_layers) for g in lay.groups]
    assert kinds == [("sliding_window", 9)] * 4 + [("sliding_window", 8)] * 2 + [("full_attention", 10)]
    assert all(g.sliding_window == 1024 for g in lay.groups[:6])
    assert lay.block_bytes == 16 * 2 * 16 * 128 * 2 * 10  # 16 KV heads of 128


def test_qwen35_attention_block_raised_to_the_gdn_state():
    # Qwen3.5-27B: GDN conv (2 x 16 x 128 + 48 x 128) x (4 - 1) bf16 = 61,440 B, recurrent
    # 48 x 128 x 128 float32 (mamba_ssm_dtype) = 3,145,728 B; attention 2 x 4 x 256 x 2 = 4,096 B
    # per token. 0.33 on Hopper (FlashInfer GDN prefill, checkpoints every 64): 64 x
    # ceil(3,207,168 / (64 x 4,096)) = 832. Ampere (FLA kernel, no checkpoints): 16 x 49 = 784.
    # TP 4: conv 15,360 + recurrent 786,432 = 801,792 B against 1,024 B: 64 x 13 = 832.
    assert _layout("qwen3.5-27b").block_size == 832
    assert _layout("qwen3.5-27b", cap=(8, 0)).block_size == 784
    assert _layout("qwen3.5-27b", tp=4).block_size == 832
    lay = _layout("qwen3.5-27b")
    assert [(g.kind, g.num_layers) for g in lay.groups] == [("mamba", 16)] * 3 + [("full_attention", 16)]
    assert lay.groups[0].prefill_checkpoint_alignment == 832 and lay.mamba_cache_mode == "align"
    assert _layout("qwen3.5-27b", cap=(8, 0)).groups[0].prefill_checkpoint_alignment is None
    # MTP with k = 2 lengthens the conv tail by 2 rows: 10,240 x 5 x 2 = 102,400 B more... 64 x
    # ceil(3,248,128 / 262,144) = 832 still; caching off: mode none.
    assert _layout("qwen3.5-27b", k=2).block_size == 832
    assert _layout("qwen3.5-27b", caching=False).mamba_cache_mode == "none"


def test_mla_block_by_gpu_generation():
    # DeepSeek-V3: one 512 + 64 latent, bf16 KV: 1,152 B per token and layer, 61 layers.
    assert _layout("deepseek-v3").block_bytes == 16 * 1152 * 61            # Hopper FLASH_ATTN_MLA
    assert _layout("deepseek-v3", cap=(10, 0)).block_size == 32            # B200 FLASHINFER_MLA
    with pytest.raises(ConfigError, match="compute_capability"):
        _layout("deepseek-v3", cap=None)


def test_sparse_mla_indexer_keys_share_the_block():
    # DeepSeek-V3.2 (vLLM 0.33 mla/indexer.py, deepseek_v2.py DeepseekV32IndexerCache): 64-token
    # blocks on every generation; per layer and token the bf16 latent (512 + 64) * 2 bytes plus
    # the indexer key, 128 fp8 values and a float32 scale: 132 bytes, in the same block.
    for cap in ((9, 0), (10, 0)):
        lay = _layout("deepseek-v3.2", cap=cap)
        assert (lay.block_size, lay.block_bytes) == (64, 61 * 64 * (1152 + 132))


def test_sparse_mla_with_an_fp8_cache_is_refused_not_guessed():
    raw = {"model": {"preset": "deepseek-v3.2"}, "hardware": {"preset": "h200"},
           "engine": {"kv_cache_dtype": "fp8", "tensor_parallel_size": 8}}
    raw["hardware"] |= {"interconnect_bandwidth_bytes_per_s": 450e9}
    with pytest.raises(ConfigError, match="engine.kv_cache_dtype: 'fp8' with DeepSeek Sparse"):
        parse_scenario(raw)
    raw["engine"]["num_gpu_blocks"] = 4096  # the pool given: the page size is not needed
    assert parse_scenario(raw).engine.block_size == 64


def test_layout_reaches_the_engine_and_the_resolved_scenario():
    import tomllib

    from kvsim.scenario_text import resolved_toml
    sc = parse_scenario({"model": {"preset": "qwen3.5-27b"}, "hardware": {"preset": "h100-sxm"},
                         "engine": {"max_model_len": 32768, "kv_cache_memory_bytes": 10 * 2**30}})
    assert sc.engine.block_size == 832 and len(sc.engine.kv_groups) == 4
    # a block id spans 16 layers of 832 x 4,096 B
    assert sc.engine.num_gpu_blocks == 10 * 2**30 // (832 * 4096 * 16)
    again = parse_scenario(tomllib.loads(resolved_toml(sc)))
    # (the resolved file states num_gpu_blocks and the groups, so nothing is derived again)
    assert replace(again.engine, num_gpu_blocks_derived=True) == sc.engine
    assert again.model == sc.model


@pytest.mark.parametrize("config, where, what", [
    ({"architectures": ["FooForCausalLM"]}, "architectures", "'FooForCausalLM' is not an architecture"),
    ({}, "architectures", "missing"),
    ({"architectures": ["LlamaForCausalLM"], "hidden_size": 64}, "num_hidden_layers", "missing"),
    ({"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_hidden_layers": "x"},
     "num_hidden_layers", "must be an integer"),
])
def test_bad_config_json_is_one_line_naming_the_file_and_field(tmp_path, config, where, what):
    f = tmp_path / "config.json"
    f.write_text(json.dumps(config))
    with pytest.raises(ConfigError) as exc:
        parse_scenario({"model": {"config": str(tmp_path)}, "hardware": {"preset": "h100-sxm"}})
    assert exc.value.where.endswith(f"config.json: {where}") and what in exc.value.what
    f.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        parse_scenario({"model": {"config": str(f)}, "hardware": {"preset": "h100-sxm"}})
