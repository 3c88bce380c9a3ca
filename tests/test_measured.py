"""``kvsim validate --against measured``: replaying LLMServingSim's measured vLLM GPU runs."""

import json
import shutil

import pytest
from builders import SHARED_DATA

from kvsim import measured
from kvsim.cli import main

RUNS = SHARED_DATA / "llmservingsim" / "runs" / "RTXPRO6000"
PROFILES = SHARED_DATA / "llmservingsim" / "profiles" / "RTXPRO6000"
pytestmark = pytest.mark.skipif(not RUNS.is_dir(), reason="no ../shared/data/llmservingsim here")


def _table(folder):
    sc, rec, rows, table = measured.compare(folder)
    return sc, rows, {(t["metric"], t["stat"]): t for t in table}


def test_llama_run_measured_side_and_prediction():
    sc, rows, t = _table(RUNS / "Llama-3.1-8B")
    # The measured column, as the peer's validation/summary.txt states it (TTFT = first token -
    # queued on the engine clock): mean 7,097.2 ms, P99 19,755.3 ms; TPOT mean 32.5 ms.
    assert t[("TTFT", "Mean")]["vllm"] == pytest.approx(7097.2, abs=0.05)
    assert t[("TTFT", "P99")]["vllm"] == pytest.approx(19755.3, abs=0.05)
    assert t[("TPOT", "Mean")]["vllm"] == pytest.approx(32.5, abs=0.05)
    assert t[("TTFT", "Mean")]["peer"] == 6815.7
    assert len(rows) == 300 and sc.engine.vllm_version == "0.19.0"
    assert sc.engine.tensor_parallel_size == 1 and sc.engine.max_num_seqs == 128
    # Step times interpolated in the same GPU's layer profiles, found in the tree the run is in.
    assert sc.cost.model == "interpolated" and sc.cost.step_overhead_s == 0
    assert sc.cost.layer_profile == str((PROFILES / "meta-llama" / "Llama-3.1-8B" / "bf16").resolve())
    # The bar, where kvsim meets it on this run (TTFT mean and median it misses: the
    # README says by how much and why).
    for metric, stat in (("TTFT", "P99"), ("TPOT", "Mean")):
        assert abs(t[(metric, stat)]["diff_pct"]) < 5, (metric, stat)


def test_qwen_tp2_run_uses_the_runs_interconnect():
    sc, _, t = _table(RUNS / "Qwen3-32B")
    # config.json: link_bw 16 (GB/s), link_latency 20000 (ns)
    assert sc.hardware.interconnect_bandwidth_bytes_per_s == 16e9
    assert sc.hardware.interconnect_latency_s == pytest.approx(20e-6)
    assert sc.engine.tensor_parallel_size == 2
    assert abs(t[("TTFT", "Mean")]["diff_pct"]) < 5 and abs(t[("TPOT", "Mean")]["diff_pct"]) < 5


def test_moe_run_replays_on_two_data_parallel_ranks():
    sc, rows, t = _table(RUNS / "Qwen3-30B-A3B-Instruct-2507")
    # meta.json: data_parallel_size 2, enable_expert_parallel; vLLM's AsyncLLM in one process
    # (one DP client); the peer's summary: TTFT mean 1,086.0 ms, TPOT mean 47.3 ms.
    e = sc.engine
    assert (e.data_parallel_size, e.enable_expert_parallel, e.api_server_count) == (2, True, 1)
    assert t[("TTFT", "Mean")]["vllm"] == pytest.approx(1086.0, abs=0.05)
    assert t[("TPOT", "Mean")]["vllm"] == pytest.approx(47.3, abs=0.05)
    assert len(rows) == 300 and {r["kvsim_dp_rank"] for r in rows} == {0, 1}
    # The bar where kvsim meets it on this run (TTFT P99 and TPOT mean; the README says
    # by how much the TTFT mean and median miss).
    for metric, stat in (("TTFT", "P99"), ("TPOT", "Mean")):
        assert abs(t[(metric, stat)]["diff_pct"]) < 5, (metric, stat)


def test_bad_runs_are_one_line_errors(tmp_path, capsys):
    run = tmp_path / "runs" / "x"
    shutil.copytree(RUNS / "Llama-3.1-8B", run)
    meta = json.loads((run / "vllm" / "meta.json").read_text())
    (run / "vllm" / "meta.json").write_text(json.dumps({**meta, "dataset_path": "nope.jsonl"}))
    assert main(["validate", "--against", "measured", str(run), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "dataset_path 'nope.jsonl'" in err[0]
    assert not (tmp_path / "o").exists()
    assert main(["validate", "--against", "measured", str(tmp_path / "none")]) == 2
    assert "not a folder" in capsys.readouterr().err


def test_cli_writes_side_by_side_results(tmp_path, capsys):
    out = tmp_path / "o"
    assert main(["validate", "--against", "measured", str(RUNS / "Llama-3.1-8B"), "--out", str(out)]) == 0
    text = capsys.readouterr().out
    # vLLM's KV memory on the 96 GB RTX PRO 6000 (torch total 101,974,016,000 B) at 0.9, less
    # Llama-3.1-8B's bf16 weights, a 2,048-token activation peak plus 128 float32 logit rows and
    # 1 GiB of non-torch memory, in blocks of 16 tokens × 131,072 B:
    avail = (int(101_974_016_000 * 0.9) - 2 * 8_030_261_248
             - (2048 * (2 * 14336 + 4 * 4096) * 2 + 128 * 128256 * 4) - 2**30)
    assert "TTFT Mean" in text and f"{avail // (16 * 131072)} KV blocks of 16" in text
    assert {p.name for p in out.iterdir()} == {"validate.csv", "summary.json", "validate.png"}
    lines = (out / "validate.csv").read_text().splitlines()
    assert lines[0].startswith("req_id,") and len(lines) == 301


def test_a_gpu_without_a_preset_is_built_from_the_runs_files(tmp_path, capsys):
    # A run on a GPU kvsim has no preset for: config.json names it, meta.json gives its name and
    # memory and the KV block count vLLM profiled; the replay uses them and says so.
    run = tmp_path / "runs" / "x"
    shutil.copytree(RUNS / "Llama-3.1-8B", run, ignore=shutil.ignore_patterns("outputs"))
    cfg = json.loads((run / "config.json").read_text())
    cfg["nodes"][0]["instances"][0]["hardware"] = "RTXA6000"
    (run / "config.json").write_text(json.dumps(cfg))
    meta = json.loads((run / "vllm" / "meta.json").read_text())
    meta.update(device_name="NVIDIA RTX A6000", total_memory_bytes=51_041_271_808,
                num_gpu_blocks=9000,
                dataset_path=str(measured._find_upward(RUNS / "Llama-3.1-8B", meta["dataset_path"])))
    (run / "vllm" / "meta.json").write_text(json.dumps(meta))
    bw = cfg["nodes"][0]["instances"][0]["npu_mem"]["mem_bw"]
    sc, rec, rows, _ = measured.compare(run, "rtxpro6000-llama-3.1-8b-tp1")
    assert sc.hardware.device_name == "NVIDIA RTX A6000"
    assert sc.hardware.memory_bytes == 51_041_271_808
    assert sc.hardware.mem_bandwidth_bytes_per_s == bw * 1e9
    assert sc.engine.num_gpu_blocks == 9000 and not sc.engine.num_gpu_blocks_derived
    assert len(rows) == 300
    assert main(["validate", "--against", "measured", str(run), "--profile",
                 "rtxpro6000-llama-3.1-8b-tp1", "--out", str(tmp_path / "o")]) == 0
    assert "9000 KV blocks of 16 (as the run recorded)" in capsys.readouterr().out
    # Without a profile for that GPU, one line asks for one.
    assert main(["validate", "--against", "measured", str(run), "--out", str(tmp_path / "p")]) == 2
    assert "give one with --profile" in capsys.readouterr().err


def test_a_gpu_with_layer_profiles_beside_the_run_replays_on_them(tmp_path, capsys):
    # LLMServingSim's own repository layout: bench/examples/<hw>/<model> beside
    # profiler/perf/<hw>/<org>/<model>/<variant>; a GPU kvsim has no preset or shipped profile for.
    run = tmp_path / "bench" / "examples" / "OTHERGPU" / "Llama-3.1-8B"
    shutil.copytree(RUNS / "Llama-3.1-8B", run, ignore=shutil.ignore_patterns("outputs"))
    cfg = json.loads((run / "config.json").read_text())
    cfg["nodes"][0]["instances"][0]["hardware"] = "OTHERGPU"
    (run / "config.json").write_text(json.dumps(cfg))
    meta = json.loads((run / "vllm" / "meta.json").read_text())
    # vLLM's resolved config, as LLMServingSim's newer collector records it: its effective
    # settings win over engine_kwargs and vLLM's defaults.
    resolved = {"scheduler_config": {"max_num_seqs": 96, "async_scheduling": False,
                                     "max_num_batched_tokens": 2048, "policy": "fcfs"},
                "cache_config": {"block_size": 16, "enable_prefix_caching": True,
                                 "cache_dtype": "auto", "num_gpu_blocks": 9000},
                "model_config": {"max_model_len": 32768}}
    meta.update(dataset_path=str(measured._find_upward(RUNS / "Llama-3.1-8B", meta["dataset_path"])),
                hardware={"device_name": "Other GPU", "device_total_memory_bytes": 48 * 2**30},
                resolved_config=resolved)
    (run / "vllm" / "meta.json").write_text(json.dumps(meta))
    layers = tmp_path / "profiler" / "perf" / "OTHERGPU" / "meta-llama" / "Llama-3.1-8B" / "bf16"
    shutil.copytree(PROFILES / "meta-llama" / "Llama-3.1-8B" / "bf16", layers,
                    ignore=shutil.ignore_patterns("tp2"))
    sc, rec, rows, _ = measured.compare(run)
    assert sc.cost.model == "interpolated" and sc.cost.layer_profile == str(layers.resolve())
    assert sc.hardware.device_name == "Other GPU" and sc.hardware.memory_bytes == 48 * 2**30
    assert sc.engine.num_gpu_blocks == 9000 and len(rows) == 300
    assert (sc.engine.max_num_seqs, sc.engine.async_scheduling, sc.engine.max_model_len) == (
        96, False, 32768)
    assert main(["validate", "--against", "measured", str(run), "--out", str(tmp_path / "o")]) == 0
    assert "cost model interpolated (NVIDIA RTX PRO 6000" in capsys.readouterr().out


def test_the_step_overhead_fitted_to_a_run_brings_its_mean_tpot(capsys):
    # The fit's own promise, against the measured mean TPOT (32.5 ms): replayed with the
    # overhead it prints, the run's mean TPOT comes out within 0.1 ms (or the fit is 0 and the
    # replay is already slower).
    assert main(["calibrate", "--step-overhead", str(RUNS / "Llama-3.1-8B")]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("rtx-pro-6000: [cost] step_overhead_s = ")
    overhead = float(line.split("=")[1].split("#")[0])
    _, _, t = _table_with(RUNS / "Llama-3.1-8B", overhead)
    miss = t[("TPOT", "Mean")]["kvsim"] - t[("TPOT", "Mean")]["vllm"]
    assert abs(miss) < 0.1 or (overhead == 0 and miss > 0)


def _table_with(folder, overhead):
    sc, rec, rows, table = measured.compare(folder, None, {"cost": {"step_overhead_s": overhead}})
    return sc, rows, {(t["metric"], t["stat"]): t for t in table}


def test_a_model_without_a_preset_is_given_by_its_config_json(tmp_path, capsys):
    # Llama-3.1-8B's public config.json: the replay builds the model from it (the layer
    # profiles' model has a preset of the same shape, so they are accepted).
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
           "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
           "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256,
           "max_position_embeddings": 131072, "torch_dtype": "bfloat16",
           "tie_word_embeddings": False, "rope_theta": 500000.0, "hidden_act": "silu"}
    path = tmp_path / "llama" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(cfg))
    sc, _, rows, _ = measured.compare(RUNS / "Llama-3.1-8B", model=str(path))
    assert sc.model.num_hidden_layers == 32 and sc.model.num_key_value_heads == 8
    assert sc.cost.model == "interpolated" and len(rows) == 300
    assert main(["validate", "--against", "measured", str(RUNS / "Llama-3.1-8B"), "--model",
                 "nope", "--out", str(tmp_path / "o")]) == 2
    assert "unknown model preset 'nope'" in capsys.readouterr().err


def test_a_speculative_run_replays_with_its_method(tmp_path, capsys):
    # vLLM's resolved speculative_config (EAGLE-3, 2 tokens) carries over; a method kvsim does
    # not model is one line.
    run = tmp_path / "runs" / "x"
    shutil.copytree(RUNS / "Llama-3.1-8B", run, ignore=shutil.ignore_patterns("outputs"))
    meta = json.loads((run / "vllm" / "meta.json").read_text())
    meta["dataset_path"] = str(measured._find_upward(RUNS / "Llama-3.1-8B", meta["dataset_path"]))
    meta["resolved_config"] = {"speculative_config": {"method": "eagle3", "num_speculative_tokens": 2}}
    (run / "vllm" / "meta.json").write_text(json.dumps(meta))
    raw = measured.scenario_table(measured.load_run(run), "rtxpro6000-llama-3.1-8b-tp1")
    assert raw["speculative"] == {"method": "eagle3", "num_speculative_tokens": 2}
    meta["resolved_config"] = {"speculative_config": {"method": "medusa", "num_speculative_tokens": 2}}
    (run / "vllm" / "meta.json").write_text(json.dumps(meta))
    assert main(["validate", "--against", "measured", str(run), "--profile",
                 "rtxpro6000-llama-3.1-8b-tp1", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "'medusa' is not modelled" in err[0]
